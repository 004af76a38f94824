//! Per-unit clipped gradients of the CQL loss for DP-SGD (DESIGN §2.3, §2.5), without a loop over
//! examples.
//!
//! Rows of a batch are grouped by privacy unit (`unit_of_row`, non-decreasing). A unit's
//! gradient is the MEAN of its rows' per-example gradients, clipped to L2 norm `C`:
//! `g_u = (1/k_u) sum_{i in u} grad l_i`, `clip(g_u) = g_u min(1, C / |g_u|)`.
//!
//! The backward pass ([`super::cql`]) gives, per layer, every row's pre-activation gradient
//! `d_i` and input `a_i`; row `i`'s weight gradient is `d_i a_i^T` and its bias gradient `d_i`.
//! So, with `ã_i = [a_i, 1]`,
//!
//! ```text
//! |sum_{i in u} grad_l l_i|^2 = sum_{i,j in u} (d_i . d_j) (ã_i . ã_j)
//! ```
//!
//! computed with one batched Gram product per layer over units padded to the largest unit
//! (zero rows add nothing), or row norms alone when every unit has one row. The clipped sum is
//! then ONE weighted matmul per layer, `sum_u s_u g_u = (W D)^T A` with `W = diag(s_u(i) / k_u(i))`;
//! [`per_unit_clipped`] materialises the `U` clipped vectors with batched matmuls instead.
//!
//! **Rounding is accounted for.** The norms are computed in f32, and for a unit whose rows'
//! gradients cancel, the Gram sum can be off by far more than f32's relative precision. The clip
//! factor therefore uses a rigorous upper bound on the norm, `|g_u|^2 + gamma_n (sum_i |g_i|)^2 /
//! k_u^2` per layer, with the standard floating-point summation bound `gamma_n = 2 n 2^-24`
//! (`n` = the longest chain of additions: a dot product over a layer's widths plus the `k^2`
//! Gram terms). For a one-row unit this inflates the norm by about `n 2^-24` (~3e-5 relative at
//! width 256): a unit's clipped gradient is then at most `C` in exact arithmetic, whatever
//! the rounding, which is what the sensitivity of the Gaussian mechanism needs. The `norms`
//! returned are the plain estimates (before clipping, without the margin). This relies on
//! IEEE f32 matmuls: candle's CUDA backend must keep `set_gemm_reduced_precision_f32(false)`
//! (its default: no TF32).

use candle_core::{D, Device, Tensor};
use fedrl_common::offline::CqlConfig;

use super::batch::TransitionBatch;
use super::cql::{PerExample, flatten_layers, per_example};
use super::qnet::QNetSpec;
use crate::{NnError, Result};

/// Every unit's clipped gradient, materialised.
#[derive(Clone, Debug, PartialEq)]
pub struct UnitGradients {
    /// One flat gradient per unit (layout of [`QNetSpec`]), each of L2 norm at most `C`.
    pub grads: Vec<Vec<f32>>,
    /// Each unit's gradient norm before clipping (L2, loss units per parameter unit).
    pub norms: Vec<f64>,
}

/// How the rows of a batch fall into units.
struct Grouping {
    /// Rows of each unit (0 for a unit without rows: its gradient is zero).
    counts: Vec<usize>,
    /// First row of each unit.
    starts: Vec<usize>,
    /// Largest count.
    kmax: usize,
    /// Every unit has exactly `kmax` rows: the regrouping is a reshape, no padding needed.
    uniform: bool,
}

impl Grouping {
    fn new(unit_of_row: &[u32], n_rows: usize, n_units: usize) -> Result<Self> {
        if unit_of_row.len() != n_rows {
            return Err(NnError::Invalid(format!(
                "unit_of_row has {} entries for {n_rows} rows",
                unit_of_row.len()
            )));
        }
        if n_units == 0 {
            return Err(NnError::Invalid("no units".into()));
        }
        let mut counts = vec![0usize; n_units];
        let mut prev = 0u32;
        for &u in unit_of_row {
            if u < prev {
                return Err(NnError::Invalid(
                    "unit_of_row must be non-decreasing (rows grouped by unit)".into(),
                ));
            }
            prev = u;
            let slot = counts.get_mut(u as usize).ok_or_else(|| {
                NnError::Invalid(format!("unit {u} out of range for {n_units} units"))
            })?;
            *slot += 1;
        }
        let mut starts = Vec::with_capacity(n_units);
        let mut at = 0;
        for &c in &counts {
            starts.push(at);
            at += c;
        }
        let kmax = counts.iter().copied().max().unwrap_or(0);
        Ok(Grouping {
            uniform: counts.iter().all(|&c| c == kmax),
            counts,
            starts,
            kmax,
        })
    }

    fn n_units(&self) -> usize {
        self.counts.len()
    }

    /// `[U * kmax]` row indices; padding slots point at row `n_rows` (a zero row appended).
    fn pad_index(&self, n_rows: usize, device: &Device) -> Result<Tensor> {
        let mut idx = Vec::with_capacity(self.n_units() * self.kmax);
        for (&s, &c) in self.starts.iter().zip(&self.counts) {
            idx.extend((0..self.kmax).map(|j| if j < c { (s + j) as u32 } else { n_rows as u32 }));
        }
        let len = idx.len();
        Ok(Tensor::from_vec(idx, len, device)?)
    }

    /// `[B, w]` rows regrouped as `[U, kmax, w]`, zero-padded through `idx`
    /// ([`Self::pad_index`]); `None` when the units are uniform (a reshape).
    fn pad(&self, t: &Tensor, idx: Option<&Tensor>) -> Result<Tensor> {
        let (_, w) = t.dims2()?;
        let Some(idx) = idx else {
            return Ok(t.reshape((self.n_units(), self.kmax, w))?);
        };
        let zero = Tensor::zeros((1, w), t.dtype(), t.device())?;
        Ok(Tensor::cat(&[t, &zero], 0)?
            .index_select(idx, 0)?
            .reshape((self.n_units(), self.kmax, w))?)
    }
}

/// The clip factor of every unit and its gradient norm before clipping.
struct Clip {
    scales: Vec<f64>,
    norms: Vec<f64>,
}

fn check_clip(clip_norm: f64) -> Result<()> {
    if !(clip_norm.is_finite() && clip_norm > 0.0) {
        return Err(NnError::Invalid(format!(
            "clip norm must be finite and > 0, got {clip_norm}"
        )));
    }
    Ok(())
}

/// Norms of the units' mean gradients (Gram form, see the module docs) and the clip factors
/// from their rounding-safe upper bounds.
fn unit_clip(pe: &PerExample, g: &Grouping, idx: Option<&Tensor>, clip_norm: f64) -> Result<Clip> {
    let mut norm2: Option<Tensor> = None;
    let mut abs2: Option<Tensor> = None;
    let mut longest_dot = 0usize;
    for (delta, input) in pe.deltas.iter().zip(&pe.inputs) {
        let (_, fan_out) = delta.dims2()?;
        let (_, fan_in) = input.dims2()?;
        longest_dot = longest_dot.max(fan_out + fan_in + 1);
        // Row norms: |d_i|^2 and |ã_i|^2 = |a_i|^2 + 1.
        let dn = delta.sqr()?.sum_keepdim(D::Minus1)?;
        let an = (input.sqr()?.sum_keepdim(D::Minus1)? + 1.0)?;
        let (n2, a2) = match (g.uniform, g.kmax) {
            (true, 1) => {
                // Unit u is row u: |g_u|^2 = |d|^2 |ã|^2 and (sum |g_i|)^2 is the same.
                let t = dn.mul(&an)?.squeeze(D::Minus1)?;
                (t.clone(), t)
            }
            _ => {
                let dp = g.pad(delta, idx)?;
                let ones = Tensor::ones(input.dims2()?.0, input.dtype(), input.device())?
                    .unsqueeze(D::Minus1)?;
                let ap = g.pad(&Tensor::cat(&[input, &ones], 1)?, idx)?;
                let gd = gram(&dp)?;
                let ga = gram(&ap)?;
                let n2 = gd.mul(&ga)?.sum((1, 2))?;
                let row_abs = g.pad(&dn.mul(&an)?.sqrt()?, idx)?; // [U, k, 1]
                let a2 = row_abs.sum((1, 2))?.sqr()?;
                (n2, a2)
            }
        };
        norm2 = Some(match norm2 {
            None => n2,
            Some(acc) => acc.add(&n2)?,
        });
        abs2 = Some(match abs2 {
            None => a2,
            Some(acc) => acc.add(&a2)?,
        });
    }
    let (Some(norm2), Some(abs2)) = (norm2, abs2) else {
        return Err(NnError::Invalid("Q-network without layers".into()));
    };
    let norm2: Vec<f32> = norm2.to_vec1()?;
    let abs2: Vec<f32> = abs2.to_vec1()?;
    // Additions along the longest chain: a dot product, the k^2 Gram terms, the layer sum.
    let n_chain = longest_dot + g.kmax * g.kmax + pe.deltas.len() + 4;
    let gamma = 2.0 * n_chain as f64 * f64::powi(2.0, -24);
    let mut scales = Vec::with_capacity(g.n_units());
    let mut norms = Vec::with_capacity(g.n_units());
    for (u, &k) in g.counts.iter().enumerate() {
        if k == 0 {
            scales.push(1.0);
            norms.push(0.0);
            continue;
        }
        let inv_k2 = 1.0 / (k * k) as f64;
        let est = f64::from(norm2[u]).max(0.0) * inv_k2;
        let upper = est + gamma * f64::from(abs2[u]) * inv_k2;
        if !upper.is_finite() {
            return Err(NnError::Invalid(format!(
                "unit {u}: gradient norm is not finite (diverged parameters?)"
            )));
        }
        let upper = upper.sqrt();
        scales.push(if upper > clip_norm {
            clip_norm / upper
        } else {
            1.0
        });
        norms.push(est.sqrt());
    }
    Ok(Clip { scales, norms })
}

/// Largest unit size for which [`gram`] uses broadcast products instead of batched matmuls:
/// the product holds `B k w` floats (`B` rows, width `w`), which stays small for `k <= 8`.
const BROADCAST_GRAM_MAX_ROWS: usize = 8;

/// `[U, k, w]` -> `[U, k, k]` Gram matrices of every unit's rows. For small `k` a broadcast
/// product and a sum (`U k^2 w` element operations, a few large ops) beats `U` tiny matmuls,
/// each of which pays a thread dispatch on the CPU.
fn gram(p: &Tensor) -> Result<Tensor> {
    let (_, k, _) = p.dims3()?;
    if k <= BROADCAST_GRAM_MAX_ROWS {
        Ok(p.unsqueeze(2)?.broadcast_mul(&p.unsqueeze(1)?)?.sum(3)?)
    } else {
        Ok(p.matmul(&p.transpose(1, 2)?.contiguous()?)?)
    }
}

/// Shared start of both entry points: forward/backward, grouping, clip factors.
#[allow(clippy::too_many_arguments)]
fn prepare(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    params: &[f32],
    target: &[f32],
    batch: &TransitionBatch,
    unit_of_row: &[u32],
    n_units: usize,
    clip_norm: f64,
    device: &Device,
) -> Result<(PerExample, Grouping, Option<Tensor>, Clip)> {
    check_clip(clip_norm)?;
    let g = Grouping::new(unit_of_row, batch.len(), n_units)?;
    let pe = per_example(spec, cfg, params, target, batch, device)?;
    let idx = if g.uniform {
        None
    } else {
        Some(g.pad_index(batch.len(), device)?)
    };
    let clip = unit_clip(&pe, &g, idx.as_ref(), clip_norm)?;
    Ok((pe, g, idx, clip))
}

/// Every unit's mean CQL gradient over its rows, clipped to L2 norm `clip_norm`, materialised
/// (`n_units` flat vectors). `unit_of_row[i]` (in `0..n_units`, non-decreasing) names the unit of
/// row `i` of `batch`; a unit with no rows gets a zero gradient. See the module docs for the
/// computation and its rounding margin.
#[allow(clippy::too_many_arguments)]
pub fn per_unit_clipped(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    params: &[f32],
    target: &[f32],
    batch: &TransitionBatch,
    unit_of_row: &[u32],
    n_units: usize,
    clip_norm: f64,
    device: &Device,
) -> Result<UnitGradients> {
    let (pe, g, idx, clip) = prepare(
        spec,
        cfg,
        params,
        target,
        batch,
        unit_of_row,
        n_units,
        clip_norm,
        device,
    )?;
    let u = g.n_units();
    let weights: Vec<f32> = clip
        .scales
        .iter()
        .zip(&g.counts)
        .map(|(&s, &k)| if k == 0 { 0.0 } else { (s / k as f64) as f32 })
        .collect();
    let weights = Tensor::from_vec(weights, (u, 1, 1), device)?;
    let mut parts = Vec::with_capacity(2 * pe.deltas.len());
    for (delta, input) in pe.deltas.iter().zip(&pe.inputs) {
        let (dp, ap) = (g.pad(delta, idx.as_ref())?, g.pad(input, idx.as_ref())?);
        let dw = dp.broadcast_mul(&weights)?; // [U, k, out]
        let gw = if g.kmax == 1 {
            // Outer products as one broadcast product: U tiny matmuls would each pay a dispatch.
            dw.transpose(1, 2)?.broadcast_mul(&ap)?
        } else {
            dw.transpose(1, 2)?.matmul(&ap)?
        }; // [U, out, in]
        parts.push(gw.flatten_from(1)?);
        parts.push(dw.sum(1)?);
    }
    let grads: Vec<Vec<f32>> = Tensor::cat(&parts, 1)?.to_vec2()?;
    Ok(UnitGradients {
        grads,
        norms: clip.norms,
    })
}

/// The sum over units of their clipped mean gradients (what DP-SGD adds noise to), computed as
/// one weighted matmul per layer without materialising the per-unit vectors, and every unit's
/// norm before clipping. Same arguments and semantics as [`per_unit_clipped`]; the two agree to
/// float rounding.
#[allow(clippy::too_many_arguments)]
pub fn clipped_sum(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    params: &[f32],
    target: &[f32],
    batch: &TransitionBatch,
    unit_of_row: &[u32],
    n_units: usize,
    clip_norm: f64,
    device: &Device,
) -> Result<(Vec<f32>, Vec<f64>)> {
    let (pe, g, _, clip) = prepare(
        spec,
        cfg,
        params,
        target,
        batch,
        unit_of_row,
        n_units,
        clip_norm,
        device,
    )?;
    // Row weight s_u / k_u for the row's unit.
    let mut w = Vec::with_capacity(batch.len());
    for (u, &k) in g.counts.iter().enumerate() {
        w.extend(std::iter::repeat_n((clip.scales[u] / k as f64) as f32, k));
    }
    let n = w.len();
    let w = Tensor::from_vec(w, (n, 1), device)?;
    let grads: Vec<(Tensor, Tensor)> = pe
        .deltas
        .iter()
        .zip(&pe.inputs)
        .map(|(delta, input)| {
            let dw = delta.broadcast_mul(&w)?;
            Ok((dw.t()?.matmul(input)?, dw.sum(0)?))
        })
        .collect::<candle_core::Result<_>>()?;
    Ok((flatten_layers(&grads)?, clip.norms))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::Xoshiro256PlusPlus;
    use rand::{RngExt, SeedableRng};

    /// A unit whose two rows' gradients almost cancel: the f32 Gram estimate of its norm can be
    /// far below the true norm (even clamped to 0), so a clip factor from the estimate alone
    /// would let more than `C` through. With the rounding margin, the unit's clipped gradient
    /// is at most `C` in exact (f64) arithmetic, every time.
    #[test]
    fn clip_factor_is_safe_under_cancellation() {
        let mut under_estimated = 0;
        for seed in 0..200u64 {
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
            let (out, fan_in) = (64usize, 48usize);
            let v: Vec<f32> = (0..out).map(|_| rng.random_range(-300f32..300.0)).collect();
            let e: Vec<f32> = (0..out).map(|_| rng.random_range(-0.01f32..0.01)).collect();
            let a: Vec<f32> = (0..fan_in).map(|_| rng.random_range(-1f32..1.0)).collect();
            let d2: Vec<f32> = v.iter().zip(&e).map(|(x, y)| -x + y).collect();
            // Exact mean gradient of the unit from the f32 inputs: ((v + d2) / 2) [a, 1]^T.
            let sum_d: Vec<f64> = v
                .iter()
                .zip(&d2)
                .map(|(&x, &y)| (f64::from(x) + f64::from(y)) / 2.0)
                .collect();
            let a2: f64 = a.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() + 1.0;
            let true_norm = (sum_d.iter().map(|x| x * x).sum::<f64>() * a2).sqrt();
            let mut rows_d = v.clone();
            rows_d.extend_from_slice(&d2);
            let mut rows_a = a.clone();
            rows_a.extend_from_slice(&a);
            let pe = PerExample {
                inputs: vec![Tensor::from_vec(rows_a, (2, fan_in), &Device::Cpu).unwrap()],
                deltas: vec![Tensor::from_vec(rows_d, (2, out), &Device::Cpu).unwrap()],
                losses: Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu).unwrap(),
            };
            let g = Grouping::new(&[0, 0], 2, 1).unwrap();
            let idx = g.pad_index(2, &Device::Cpu).unwrap();
            let c = 0.5 * true_norm;
            let clip = unit_clip(&pe, &g, Some(&idx), c).unwrap();
            if clip.norms[0] < true_norm * 0.99 {
                under_estimated += 1;
            }
            assert!(
                clip.scales[0] * true_norm <= c,
                "seed {seed}: clipped norm {} > C = {c} (estimate {}, true {true_norm})",
                clip.scales[0] * true_norm,
                clip.norms[0]
            );
        }
        // The scenario is real: the plain estimate is often too small.
        assert!(
            under_estimated > 10,
            "only {under_estimated} under-estimates"
        );
    }
}
