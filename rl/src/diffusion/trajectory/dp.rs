//! PrivORL-j's per-trajectory DP-SGD contribution (seed 003, section VI-B, Eq. 7; issue 56
//! build item 3): the privacy unit is the **trajectory**. At step `round`, trajectory `u`
//! contributes
//!
//! ```text
//! g_u = (1/k) sum_{j in F_u} grad l_j,     contribution = g_u min(1, C / |g_u|)
//! ```
//!
//! where `F_u` is at most `max_fragments` (32 in the paper's setting,
//! [`super::MAX_FRAGMENTS_PER_TRAJECTORY`]) of its fragments drawn without replacement
//! ([`draw_fragments`]), `k = |F_u|` and `l_j` fragment `j`'s weighted EDM loss at a noise level
//! and noise drawn for it. The trajectory is clipped **once**, however many fragments it has,
//! so adding or removing one trajectory changes the sum of contributions by at most `C`: the
//! sensitivity per trajectory is `C`, what the engine's Gaussian noise and the ledger's
//! accountant assume when the aggregator Poisson-samples trajectories (the sampling rate is
//! over trajectories, section VII). The authors' code instead duplicates trajectories and uses
//! fixed batches; issue 56 forbids copying that.
//!
//! # How it fits the central path
//! The shape is that of [`crate::offline::dpsgd`] for CQL: which fragments, noise levels and
//! noise a unit uses at step `round` depend only on `(data_seed, round, unit)` and the unit's
//! own fragments, so the federated agent hosting a trajectory and the central aggregator
//! holding its upload compute the same contribution. [`trajectory_contributions`] returns the
//! materialised per-unit vectors (the per-unit path, and the federated agent's answer);
//! [`summed_trajectory_contributions`] returns their sum accumulated in f64 as
//! [`SummedGradient`], the summed path's type. A unit whose gradient is not finite makes both
//! fail with [`NnError::NonFiniteUnits`] (positions in `units`), as CQL's functions do, so the
//! caller's leave-out-and-retry loop applies unchanged.
//!
//! The gradient is computed with candle's autograd, one backward pass per trajectory (the
//! fragments of one trajectory in one batch): the mean over fragments is taken before the
//! backward pass, so no per-fragment gradient is materialised. (CQL's per-example Gram trick
//! is specific to its MLP; the transformer has no such closed form.)
//!
//! # Rounding
//! A contribution is returned in f32. Its clip factor is computed from the f64 norm of the f32
//! gradient (exact squares, an f64 sum: relative error below `P 2^-53` for `P` parameters) and
//! lowered by the factor `1 - 2^-20`, which covers that error and the final rounding to f32
//! (relative `2^-24` per coordinate) many times over; the norm of the returned f32 vector is
//! then checked in f64 and the vector shrunk further in the (never observed) case it exceeds
//! `C`. So each returned contribution has L2 norm at most `C` as f32 values. The summed path
//! adds those exact f32 values in f64: its error is at most `gamma_U sum_u |c_u| <= gamma_U U C`
//! (`U` units, `gamma_n = n 2^-53 / (1 - n 2^-53)`), within what
//! [`SummedBound`](fedrl_common::privacy::fixed_point::SummedBound) allows for `max_units = U`
//! and any `max_rows >= U`.

use candle_core::{Tensor, Var};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use super::{CondNet, Conditioned, Fragments, tensors_from_flat};
use crate::diffusion::edm::{self, EdmConfig};
use crate::offline::per_example::SummedGradient;
use crate::rollout::mix;
use crate::{NnError, Result};

/// The clip factor's safety margin (see "Rounding" in the module docs).
const CLIP_MARGIN: f64 = 1.0 - 1.0 / (1u64 << 20) as f64;

/// Every given trajectory's clipped contribution.
#[derive(Clone, Debug, PartialEq)]
pub struct TrajectoryContributions {
    /// `(unit, contribution)` in the order of the units given; each of L2 norm at most `C`
    /// (flat layout of the network's [`CondNet::param_shapes`]).
    pub contributions: Vec<(u64, Vec<f32>)>,
    /// Each unit's gradient norm before clipping.
    pub norms: Vec<f64>,
    /// Each unit's clip factor in `(0, 1]`.
    pub clip_factors: Vec<f64>,
}

/// The fragments trajectory `unit` uses at step `round`: `min(max, n_fragments)` distinct
/// indices in `0..n_fragments` (a partial Fisher-Yates shuffle), from a generator seeded by
/// `(data_seed, round, unit)` alone. Returns that generator too: the unit's noise levels and
/// noise continue its stream.
pub fn draw_fragments(
    data_seed: u64,
    round: u64,
    unit: u64,
    n_fragments: usize,
    max: usize,
) -> (Vec<usize>, Xoshiro256PlusPlus) {
    // A stream apart from CQL's `draw_rows` for the same (seed, round, unit).
    let mut rng =
        Xoshiro256PlusPlus::seed_from_u64(mix(mix(mix(data_seed, round), unit), 0x074a_1ec7));
    let k = max.min(n_fragments);
    let mut idx: Vec<usize> = (0..n_fragments).collect();
    for i in 0..k {
        let j = rng.random_range(i..n_fragments);
        idx.swap(i, j);
    }
    idx.truncate(k);
    (idx, rng)
}

/// Every given trajectory's mean fragment gradient, clipped once to L2 norm `clip_norm`
/// (module docs). `params` is the network's flat parameter vector; `units` pairs each
/// trajectory's id with its fragments ([`super::split_fragments`]; every unit must have at
/// least one). `max_fragments` is at most [`super::MAX_FRAGMENTS_PER_TRAJECTORY`] in the paper's
/// setting; any positive value keeps the sensitivity `C`. `clip_norm = f64::INFINITY` clips
/// nothing (a non-private twin).
#[allow(clippy::too_many_arguments)]
pub fn trajectory_contributions<N: CondNet + ?Sized>(
    edm_cfg: &EdmConfig,
    net: &N,
    params: &[f32],
    units: &[(u64, &Fragments)],
    round: u64,
    data_seed: u64,
    max_fragments: usize,
    clip_norm: f64,
) -> Result<TrajectoryContributions> {
    if clip_norm.is_nan() || clip_norm <= 0.0 || max_fragments == 0 {
        return Err(NnError::Invalid(format!(
            "trajectory contributions: clip norm {clip_norm} and max_fragments {max_fragments} \
             must be positive"
        )));
    }
    edm_cfg.check()?;
    let dev = net.device().clone();
    let vars: Vec<Var> = tensors_from_flat(net.param_shapes(), params, &dev)?
        .iter()
        .map(Var::from_tensor)
        .collect::<candle_core::Result<_>>()?;
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (d, c) = (net.data_dim(), net.cond_dim());
    let mut out = TrajectoryContributions {
        contributions: Vec::with_capacity(units.len()),
        norms: Vec::with_capacity(units.len()),
        clip_factors: Vec::with_capacity(units.len()),
    };
    let mut bad = Vec::new();
    for (pos, (unit, frags)) in units.iter().enumerate() {
        if frags.is_empty() || frags.row_dim() != d || frags.cond_dim() != c {
            return Err(NnError::Invalid(format!(
                "trajectory {unit}: {} fragments of {} values (condition {}) for a network of \
                 {d} ({c})",
                frags.len(),
                frags.row_dim(),
                frags.cond_dim()
            )));
        }
        let (idx, mut rng) = draw_fragments(data_seed, round, *unit, frags.len(), max_fragments);
        let chosen = frags.select(&idx);
        let k = idx.len();
        let x0 = Tensor::from_slice(&chosen.x, (k, d), &dev)?;
        let ct = Tensor::from_slice(&chosen.cond, (k, c), &dev)?;
        let sigmas: Vec<f64> = (0..k).map(|_| edm_cfg.draw_sigma(&mut rng)).collect();
        let noise = edm::normal_tensor(k, d, &mut rng, &dev)?;
        let cnet = Conditioned { net, cond: &ct };
        let loss =
            edm::per_example_loss(edm_cfg, &cnet, &tensors, &x0, &sigmas, &noise)?.mean_all()?;
        let grads = loss.backward()?;
        let mut g = Vec::with_capacity(params.len());
        for v in &vars {
            match grads.get(v) {
                Some(t) => g.extend(t.flatten_all()?.to_vec1::<f32>()?),
                None => g.extend(std::iter::repeat_n(0.0, v.elem_count())),
            }
        }
        let norm = norm_f64(&g);
        if !norm.is_finite() {
            bad.push(pos);
            continue;
        }
        let (contribution, factor) = clip(g, norm, clip_norm);
        out.contributions.push((*unit, contribution));
        out.norms.push(norm);
        out.clip_factors.push(factor);
    }
    if !bad.is_empty() {
        return Err(NnError::NonFiniteUnits { units: bad });
    }
    Ok(out)
}

/// The sum over the given trajectories of their clipped contributions, accumulated in f64
/// (what DP-SGD adds noise to), with each unit's norm and clip factor: the summed path's form
/// of [`trajectory_contributions`] (same arguments; `clip_norm` must be finite).
#[allow(clippy::too_many_arguments)]
pub fn summed_trajectory_contributions<N: CondNet + ?Sized>(
    edm_cfg: &EdmConfig,
    net: &N,
    params: &[f32],
    units: &[(u64, &Fragments)],
    round: u64,
    data_seed: u64,
    max_fragments: usize,
    clip_norm: f64,
) -> Result<SummedGradient> {
    if !clip_norm.is_finite() {
        return Err(NnError::Invalid(
            "the summed path needs a finite clip norm".into(),
        ));
    }
    let per = trajectory_contributions(
        edm_cfg,
        net,
        params,
        units,
        round,
        data_seed,
        max_fragments,
        clip_norm,
    )?;
    let mut sum = vec![0f64; params.len()];
    for (_, v) in &per.contributions {
        for (s, x) in sum.iter_mut().zip(v) {
            *s += f64::from(*x);
        }
    }
    Ok(SummedGradient {
        sum,
        norms: per.norms,
        clip_factors: per.clip_factors,
        mean_loss: None,
    })
}

/// L2 norm of f32 values, squares summed in f64.
pub fn norm_f64(v: &[f32]) -> f64 {
    v.iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt()
}

/// `g` scaled to norm at most `c` (its computed norm `norm`), as f32, and the factor used.
fn clip(g: Vec<f32>, norm: f64, c: f64) -> (Vec<f32>, f64) {
    if !c.is_finite() || norm <= c * CLIP_MARGIN {
        return (g, 1.0);
    }
    let mut s = c / norm * CLIP_MARGIN;
    loop {
        let out: Vec<f32> = g.iter().map(|&x| (f64::from(x) * s) as f32).collect();
        if norm_f64(&out) <= c {
            return (out, s);
        }
        s *= CLIP_MARGIN;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragment_draws_are_distinct_bounded_and_seeded() {
        let (a, _) = draw_fragments(7, 3, 11, 100, 32);
        assert_eq!(a.len(), 32);
        let mut s = a.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 32);
        assert!(a.iter().all(|&i| i < 100));
        assert_eq!(draw_fragments(7, 3, 11, 100, 32).0, a);
        assert_ne!(draw_fragments(7, 4, 11, 100, 32).0, a);
        let (b, _) = draw_fragments(7, 3, 11, 5, 32);
        let mut b2 = b.clone();
        b2.sort_unstable();
        assert_eq!(b2, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn clipping_never_exceeds_the_bound() {
        for (scale, c) in [(1e-3f32, 1.0), (3.0, 1.0), (1e6, 0.1), (7.0, 7.0)] {
            let g: Vec<f32> = (0..1000)
                .map(|i| scale * ((i as f32 * 0.37).sin()))
                .collect();
            let n = norm_f64(&g);
            let (out, f) = clip(g.clone(), n, c);
            assert!(norm_f64(&out) <= c, "{scale} {c}");
            assert!(f <= 1.0 && f > 0.0);
            if n < 0.5 * c {
                assert_eq!(out, g);
            } else {
                assert!(norm_f64(&out) > c * 0.999);
            }
        }
    }
}
