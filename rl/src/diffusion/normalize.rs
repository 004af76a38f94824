//! Per-dimension standardisation of encoded transitions, fitted on **public data only**.
//!
//! PrivORL pre-trains on public data and fine-tunes with DP-SGD on sensitive data. Statistics of
//! the sensitive data computed outside the DP mechanism would leak it (the authors' code refits
//! the normaliser on the sensitive set before fine-tuning, `synther/training/train_diffuser.py:
//! 172,184`; fedrl does not). So a [`Normalizer`] can only be fitted from [`PublicRows`], a type
//! whose constructor says the rows are public, and a synthesizer keeps the one it was built with
//! for its whole life.
//!
//! The transform is SynthER's `standard` normaliser (`synther/diffusion/norm.py:41-64`,
//! gin line 9): `x' = (x - mean) / (std + 1e-5)` with the sample standard
//! deviation (PyTorch's `std`, divisor `n - 1`). Binary entries are left as they are: the
//! terminal flag as in SynthER (`disable_terminal_norm = True`, gin line 12), and, in fedrl, the
//! one-hot action entries too (binary like the flag; and a one-hot entry that is constant in the
//! public data would otherwise be divided by 1e-5). A real entry whose public standard deviation
//! is below [`MIN_STD`] is only centred (divisor 1), for the same reason.
//!
//! [`PublicSupport`] is the other public statistic: the real entries whose public values take
//! only a few distinct values (CartPole's reward is always 1), to which sampled values are
//! snapped before decoding, as the one-hot action and the terminal flag are decoded to their
//! discrete values. A model's output is continuous, so without it a point mass (every real
//! reward exactly 1.0) is released as a cloud around it.
//!
//! Invariants: `mean` and `scale` have one finite entry per dimension, `scale > 0`;
//! `unnormalize(normalize(x)) == x` up to f32 rounding; a snapped entry only ever takes a value
//! seen in the public data.

use serde::{Deserialize, Serialize};

use super::encode::{EntryKind, TransitionLayout};
use crate::{NnError, Result};

/// SynthER's additive epsilon on the standard deviation (`norm.py:45`).
pub const STD_EPS: f64 = 1e-5;
/// A real dimension with a smaller public standard deviation is centred but not scaled.
pub const MIN_STD: f64 = 1e-3;

/// Encoded rows known to be public (no privacy cost to read them): rows of `dim` values.
#[derive(Clone, Debug, PartialEq)]
pub struct PublicRows {
    dim: usize,
    values: Vec<f32>,
}

impl PublicRows {
    /// Declares `values` (row-major, rows of `dim`) public data. Errors on a ragged or empty
    /// array or a non-finite value.
    pub fn new(dim: usize, values: Vec<f32>) -> Result<Self> {
        if dim == 0 || values.is_empty() || !values.len().is_multiple_of(dim) {
            return Err(NnError::Invalid(format!(
                "public rows: {} values are not a positive number of rows of {dim}",
                values.len()
            )));
        }
        if values.iter().any(|v| !v.is_finite()) {
            return Err(NnError::Invalid("public rows: non-finite value".into()));
        }
        Ok(PublicRows { dim, values })
    }

    /// Values per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.values.len() / self.dim
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The rows, row-major.
    pub fn values(&self) -> &[f32] {
        &self.values
    }
}

/// Per-dimension affine map `x' = (x - mean) / scale`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Normalizer {
    pub mean: Vec<f32>,
    pub scale: Vec<f32>,
}

impl Normalizer {
    /// Fits on public rows laid out by `layout` (see the module doc for which entries are
    /// scaled). Needs at least two rows.
    pub fn fit_public(layout: &TransitionLayout, public: &PublicRows) -> Result<Self> {
        let d = layout.dim();
        if public.dim() != d {
            return Err(NnError::Invalid(format!(
                "normaliser: public rows have {} entries, the layout {d}",
                public.dim()
            )));
        }
        let n = public.len();
        if n < 2 {
            return Err(NnError::Invalid(
                "normaliser: at least two public rows are needed".into(),
            ));
        }
        let mut sum = vec![0.0f64; d];
        for row in public.values().chunks_exact(d) {
            for (s, &v) in sum.iter_mut().zip(row) {
                *s += f64::from(v);
            }
        }
        let mean: Vec<f64> = sum.iter().map(|s| s / n as f64).collect();
        let mut ss = vec![0.0f64; d];
        for row in public.values().chunks_exact(d) {
            for ((s, &v), m) in ss.iter_mut().zip(row).zip(&mean) {
                *s += (f64::from(v) - m).powi(2);
            }
        }
        let kinds = layout.kinds();
        let (mut m_out, mut s_out) = (Vec::with_capacity(d), Vec::with_capacity(d));
        for j in 0..d {
            let std = (ss[j] / (n - 1) as f64).sqrt();
            match kinds[j] {
                EntryKind::Real if std >= MIN_STD => {
                    m_out.push(mean[j] as f32);
                    s_out.push((std + STD_EPS) as f32);
                }
                EntryKind::Real => {
                    m_out.push(mean[j] as f32);
                    s_out.push(1.0);
                }
                EntryKind::OneHot | EntryKind::Terminal => {
                    m_out.push(0.0);
                    s_out.push(1.0);
                }
            }
        }
        Ok(Normalizer {
            mean: m_out,
            scale: s_out,
        })
    }

    /// Dimensions.
    pub fn dim(&self) -> usize {
        self.mean.len()
    }

    /// Checks lengths, finiteness and positive scales (for a normaliser read from a file).
    pub fn check(&self) -> Result<()> {
        if self.mean.len() != self.scale.len()
            || self.mean.iter().any(|m| !m.is_finite())
            || self.scale.iter().any(|s| !(s.is_finite() && *s > 0.0))
        {
            return Err(NnError::Invalid(
                "normaliser: lengths differ or a mean/scale is not finite and positive".into(),
            ));
        }
        Ok(())
    }

    /// Normalises rows (row-major, rows of [`Self::dim`]) in place.
    pub fn normalize(&self, rows: &mut [f32]) {
        for row in rows.chunks_exact_mut(self.dim()) {
            for ((v, m), s) in row.iter_mut().zip(&self.mean).zip(&self.scale) {
                *v = (*v - m) / s;
            }
        }
    }

    /// Inverse of [`Self::normalize`], in place.
    pub fn unnormalize(&self, rows: &mut [f32]) {
        for row in rows.chunks_exact_mut(self.dim()) {
            for ((v, m), s) in row.iter_mut().zip(&self.mean).zip(&self.scale) {
                *v = *v * s + m;
            }
        }
    }
}

/// For each entry of a layout, the sorted distinct values the public data gives it when they are
/// few (at most the `max_values` given to [`PublicSupport::fit`]); `None` for entries with more,
/// and for one-hot and terminal entries (decoded discretely anyway). Public data only, like the
/// normaliser: snapping to it is post-processing that costs no privacy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PublicSupport {
    entries: Vec<Option<Vec<f32>>>,
}

impl PublicSupport {
    /// The support of every real entry of `layout` with at most `max_values` distinct public
    /// values (0: none is snapped).
    pub fn fit(layout: &TransitionLayout, public: &PublicRows, max_values: usize) -> Result<Self> {
        let d = layout.dim();
        if public.dim() != d {
            return Err(NnError::Invalid(format!(
                "public support: public rows have {} entries, the layout {d}",
                public.dim()
            )));
        }
        let kinds = layout.kinds();
        let mut entries = Vec::with_capacity(d);
        for (j, kind) in kinds.iter().enumerate() {
            if max_values == 0 || *kind != EntryKind::Real {
                entries.push(None);
                continue;
            }
            let mut seen: Vec<f32> = Vec::new();
            let mut few = true;
            for row in public.values().chunks_exact(d) {
                let v = row[j];
                if !seen.iter().any(|s| s.to_bits() == v.to_bits()) {
                    if seen.len() == max_values {
                        few = false;
                        break;
                    }
                    seen.push(v);
                }
            }
            entries.push(few.then(|| {
                seen.sort_by(f32::total_cmp);
                seen
            }));
        }
        Ok(PublicSupport { entries })
    }

    /// Indices of the entries that are snapped.
    pub fn snapped(&self) -> Vec<usize> {
        (0..self.entries.len())
            .filter(|&j| self.entries[j].is_some())
            .collect()
    }

    /// The support of entry `j`, if it is snapped.
    pub fn values(&self, j: usize) -> Option<&[f32]> {
        self.entries.get(j).and_then(|e| e.as_deref())
    }

    /// Replaces every snapped entry of `rows` (unnormalised, row-major, rows of the layout's
    /// dimension) by the nearest of its public values (the lower one on a tie). A no-op for a
    /// support of another dimension than the rows'.
    pub fn snap(&self, rows: &mut [f32]) {
        let d = self.entries.len();
        if d == 0 || self.snapped().is_empty() {
            return;
        }
        for row in rows.chunks_exact_mut(d) {
            for (v, e) in row.iter_mut().zip(&self.entries) {
                if let Some(support) = e {
                    *v = nearest(support, *v);
                }
            }
        }
    }
}

/// The value of the sorted, non-empty `support` nearest to `x` (the lower on a tie; NaN maps to
/// the first value).
fn nearest(support: &[f32], x: f32) -> f32 {
    let mut best = support[0];
    for &s in &support[1..] {
        if (s - x).abs() < (best - x).abs() {
            best = s;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diffusion::encode::ActionCoding;

    #[test]
    fn a_constant_public_entry_is_snapped_and_a_varied_one_is_not() {
        // [s (1), a (one-hot 2), r, s' (1), done]: s varies, r takes two values.
        let layout = TransitionLayout {
            obs_dim: 1,
            action: ActionCoding::Discrete { n: 2 },
            model_terminal: true,
        };
        let mut values = Vec::new();
        for i in 0..20 {
            let r = if i % 5 == 0 { 0.0 } else { 1.0 };
            values.extend_from_slice(&[i as f32 * 0.1, 1.0, 0.0, r, i as f32 * 0.1 + 0.05, 0.0]);
        }
        let public = PublicRows::new(6, values).unwrap();
        let support = PublicSupport::fit(&layout, &public, 8).unwrap();
        assert_eq!(support.snapped(), vec![3], "only the reward has few values");
        assert_eq!(support.values(3), Some(&[0.0f32, 1.0][..]));
        let mut rows = vec![
            0.33, 0.9, 0.2, 0.97, 0.41, 0.7, -1.0, 0.1, 0.8, 0.2, -1.2, 0.2,
        ];
        support.snap(&mut rows);
        // The reward goes to the nearest public value; nothing else changes (a tie goes low).
        assert_eq!(
            rows,
            vec![
                0.33, 0.9, 0.2, 1.0, 0.41, 0.7, -1.0, 0.1, 0.8, 0.0, -1.2, 0.2
            ]
        );
        let mut tie = vec![0.0, 0.0, 0.0, 0.5, 0.0, 0.0];
        support.snap(&mut tie);
        assert_eq!(tie[3], 0.0);
        // Off: nothing is snapped.
        let off = PublicSupport::fit(&layout, &public, 0).unwrap();
        assert!(off.snapped().is_empty());
        // More values than allowed: not snapped.
        let one = PublicSupport::fit(&layout, &public, 1).unwrap();
        assert!(one.snapped().is_empty());
    }
}
