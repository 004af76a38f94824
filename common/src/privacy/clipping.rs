//! Clipping of a privacy unit's contribution, so that its L2 sensitivity is bounded.
//!
//! Every function clips in place and returns what it did ([`Clipped`]): the norm before clipping
//! and the factor applied. Vectors are f32 but norms are accumulated in f64; the factor is shrunk
//! by a few f32 ulps so that the rounded result never exceeds the bound (sensitivity is a hard
//! guarantee, not an approximation).

use std::ops::Range;

use super::PrivacyError;

/// Relative safety margin applied when scaling down, so f32 rounding cannot push the norm above
/// the bound.
const ROUNDING_MARGIN: f64 = 4.0 * f32::EPSILON as f64;

/// What clipping did to one segment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Clipped {
    /// L2 norm before clipping (NaN or +inf if the input was not finite).
    pub norm: f64,
    /// Factor the segment was multiplied by, in [0, 1]. 0 when the input was not finite: a
    /// non-finite contribution is replaced by zeros rather than trusted.
    pub factor: f64,
}

impl Clipped {
    pub fn was_clipped(&self) -> bool {
        self.factor < 1.0
    }
}

/// L2 norm, accumulated in f64 (relative error below 1e-12 for any length a model has; the
/// clip factor's margin and the fixed-point sum's exact norm check do not rely on it being
/// correctly rounded).
pub fn l2_norm(v: &[f32]) -> f64 {
    // Eight independent partial sums: one serial f64 chain waits on the add latency for every
    // coordinate, and this norm is computed once per update by the aggregator (the re-clip).
    let mut acc = [0.0f64; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += (x as f64) * (x as f64);
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        *a += (x as f64) * (x as f64);
    }
    acc.iter().sum::<f64>().sqrt()
}

/// Clips `v` to L2 norm at most `bound` (flat clipping).
pub fn clip_l2(v: &mut [f32], bound: f64) -> Clipped {
    let norm = l2_norm(v);
    let factor = if !norm.is_finite() {
        0.0
    } else if norm > bound {
        bound / norm * (1.0 - ROUNDING_MARGIN)
    } else {
        1.0
    };
    if factor < 1.0 {
        for x in v.iter_mut() {
            *x = if factor == 0.0 {
                0.0
            } else {
                (*x as f64 * factor) as f32
            };
        }
    }
    Clipped { norm, factor }
}

/// Clips each segment `segments[i]` of `v` to its own bound `bounds[i]`. The segments must be
/// disjoint and cover `v`; the whole vector then has norm at most sqrt(sum of bounds^2).
pub fn clip_segments(
    v: &mut [f32],
    segments: &[Range<usize>],
    bounds: &[f64],
) -> Result<Vec<Clipped>, PrivacyError> {
    if segments.len() != bounds.len() {
        return Err(PrivacyError::InvalidParameter(format!(
            "{} segments but {} bounds",
            segments.len(),
            bounds.len()
        )));
    }
    let mut covered = 0usize;
    for s in segments {
        if s.start != covered || s.end < s.start || s.end > v.len() {
            return Err(PrivacyError::InvalidParameter(format!(
                "segments must be contiguous and cover the vector: segment {s:?} after {covered}"
            )));
        }
        covered = s.end;
    }
    if covered != v.len() {
        return Err(PrivacyError::InvalidParameter(format!(
            "segments cover {covered} of {} components",
            v.len()
        )));
    }
    for &b in bounds {
        check_bound(b)?;
    }
    Ok(segments
        .iter()
        .zip(bounds)
        .map(|(s, &b)| clip_l2(&mut v[s.clone()], b))
        .collect())
}

/// Per-layer clipping (McMahan et al. 2018): `layer_sizes` split `v` into L layers, each clipped
/// to C / sqrt(L), so the whole update has norm at most C.
pub fn clip_per_layer(
    v: &mut [f32],
    layer_sizes: &[usize],
    bound: f64,
) -> Result<Vec<Clipped>, PrivacyError> {
    check_bound(bound)?;
    let segments = segments_of(layer_sizes);
    let each = bound / (layer_sizes.len().max(1) as f64).sqrt();
    clip_segments(v, &segments, &vec![each; segments.len()])
}

/// Flat ensemble clipping (seed 001, Algorithm 3): `v` is the concatenation of `n_models`
/// models of equal size; each model's delta is clipped to C / sqrt(N), so the ensemble delta has
/// norm at most C.
pub fn clip_ensemble_flat(
    v: &mut [f32],
    n_models: usize,
    bound: f64,
) -> Result<Vec<Clipped>, PrivacyError> {
    check_bound(bound)?;
    if n_models == 0 || !v.len().is_multiple_of(n_models) {
        return Err(PrivacyError::InvalidParameter(format!(
            "{} components do not split into {n_models} equal models",
            v.len()
        )));
    }
    let size = v.len() / n_models;
    let segments = segments_of(&vec![size; n_models]);
    let each = bound / (n_models as f64).sqrt();
    clip_segments(v, &segments, &vec![each; n_models])
}

/// Per-layer ensemble clipping (seed 001, Algorithm 3): `v` is the concatenation of `n_models`
/// models, each laid out as `layer_sizes`; each of the N x L layer deltas is clipped to
/// C / sqrt(N L).
pub fn clip_ensemble_per_layer(
    v: &mut [f32],
    n_models: usize,
    layer_sizes: &[usize],
    bound: f64,
) -> Result<Vec<Clipped>, PrivacyError> {
    check_bound(bound)?;
    let per_model: usize = layer_sizes.iter().sum();
    if n_models == 0 || layer_sizes.is_empty() || per_model * n_models != v.len() {
        return Err(PrivacyError::InvalidParameter(format!(
            "{} components do not match {n_models} models of layers {layer_sizes:?}",
            v.len()
        )));
    }
    let all: Vec<usize> = (0..n_models)
        .flat_map(|_| layer_sizes.iter().copied())
        .collect();
    let segments = segments_of(&all);
    let each = bound / ((n_models * layer_sizes.len()) as f64).sqrt();
    clip_segments(v, &segments, &vec![each; segments.len()])
}

fn segments_of(sizes: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&n| {
            let r = start..start + n;
            start += n;
            r
        })
        .collect()
}

fn check_bound(bound: f64) -> Result<(), PrivacyError> {
    if bound.is_finite() && bound > 0.0 {
        Ok(())
    } else {
        Err(PrivacyError::InvalidParameter(format!(
            "clip norm must be finite and > 0, got {bound}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_vectors_are_untouched() {
        let mut v = vec![0.3f32, -0.4];
        let c = clip_l2(&mut v, 1.0);
        assert_eq!(v, vec![0.3, -0.4]);
        assert_eq!(c.factor, 1.0);
        assert!((c.norm - 0.5).abs() < 1e-7);
    }

    #[test]
    fn non_finite_input_becomes_zero() {
        let mut v = vec![1.0f32, f32::NAN];
        let c = clip_l2(&mut v, 1.0);
        assert_eq!(c.factor, 0.0);
        assert_eq!(v, vec![0.0, 0.0]);
    }

    #[test]
    fn ensemble_bounds_split_the_budget() {
        let mut v = vec![10.0f32; 12];
        let parts = clip_ensemble_flat(&mut v, 3, 1.5).unwrap();
        assert_eq!(parts.len(), 3);
        for m in v.chunks(4) {
            assert!(l2_norm(m) <= 1.5 / 3f64.sqrt());
        }
        let mut w = vec![10.0f32; 12];
        let parts = clip_ensemble_per_layer(&mut w, 2, &[4, 2], 1.0).unwrap();
        assert_eq!(parts.len(), 4);
        assert!(l2_norm(&w[0..4]) <= 0.5 && l2_norm(&w[4..6]) <= 0.5);
        assert!(clip_ensemble_flat(&mut [0.0; 5], 2, 1.0).is_err());
    }

    proptest! {
        #[test]
        fn flat_clip_never_exceeds_bound(
            v in prop::collection::vec(-1e6f32..1e6, 1..200),
            c in 1e-3f64..1e3,
        ) {
            let mut w = v.clone();
            let r = clip_l2(&mut w, c);
            prop_assert!(l2_norm(&w) <= c);
            // Direction is preserved.
            for (a, b) in v.iter().zip(&w) {
                prop_assert!((*a as f64 * r.factor - *b as f64).abs() <= 1e-6 * a.abs().max(1.0) as f64);
            }
        }

        #[test]
        fn layer_and_ensemble_clips_bound_the_whole(
            v in prop::collection::vec(-1e4f32..1e4, 24),
            c in 1e-2f64..1e2,
        ) {
            let mut a = v.clone();
            clip_per_layer(&mut a, &[10, 6, 8], c).unwrap();
            prop_assert!(l2_norm(&a) <= c);
            let mut b = v.clone();
            clip_ensemble_flat(&mut b, 4, c).unwrap();
            prop_assert!(l2_norm(&b) <= c);
            let mut d = v.clone();
            clip_ensemble_per_layer(&mut d, 3, &[5, 3], c).unwrap();
            prop_assert!(l2_norm(&d) <= c);
        }
    }
}
