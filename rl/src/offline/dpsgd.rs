//! One DP-SGD step's per-unit work, the same code in both update modes (DESIGN §2.5): the
//! federated client agent runs it on the units it hosts, the central aggregator on the units'
//! uploaded data. Which transitions a unit uses at step `r` depends only on `(data_seed, r,
//! unit)` and the unit's own data, so both modes feed the engine the same clipped gradients.
//!
//! [`summed_unit_gradients`] is the central mode's summed path: the same units, rows and clip,
//! but only the sum of the clipped gradients, accumulated in f64 (see
//! [`super::per_example`]'s "The summed path").
//!
//! Also the wire form of a unit's data for the central mode's one-time upload
//! ([`encode_rows`] / [`decode_rows`]).

use candle_core::Device;
use fedrl_common::offline::CqlConfig;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use thiserror::Error;

use super::batch::TransitionBatch;
use super::per_example::{SummedGradient, per_unit_clipped, summed_clipped};
use super::qnet::QNetSpec;
use crate::NnError;
use crate::rollout::mix;

/// The rows unit `unit` uses at step `round`: `k` indices drawn uniformly with replacement from
/// `0..n_rows`, from a generator seeded by `(data_seed, round, unit)` alone.
pub fn draw_rows(data_seed: u64, round: u64, unit: u64, n_rows: usize, k: u32) -> Vec<usize> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(mix(mix(data_seed, round), unit));
    (0..k).map(|_| rng.random_range(0..n_rows)).collect()
}

/// Every given unit's clipped gradient of the CQL loss at step `round`.
///
/// `offer` is the round's offered vector: the online parameters, then the target network's
/// (`2 * spec.dim()` values). Each unit's gradient is the mean of the per-example gradients of
/// its [`draw_rows`] transitions, clipped to L2 norm `clip_norm` (`f64::INFINITY`: no clipping,
/// for a non-private twin). A unit with no data gets a zero gradient. One batched computation
/// for all units.
#[allow(clippy::too_many_arguments)]
pub fn unit_gradients(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    offer: &[f32],
    units: &[(u64, &TransitionBatch)],
    round: u64,
    data_seed: u64,
    transitions_per_unit: u32,
    clip_norm: f64,
    device: &Device,
) -> crate::Result<Vec<(u64, Vec<f32>)>> {
    let dim = spec.dim();
    if offer.len() != 2 * dim {
        return Err(crate::NnError::ParamLength {
            got: offer.len(),
            expected: 2 * dim,
        });
    }
    let (params, target) = offer.split_at(dim);
    // A unit with no data left (every transition of it released as a stable prefix) still
    // answers its offer, with a zero gradient: the round need not wait for it.
    let empty: Vec<(u64, Vec<f32>)> = units
        .iter()
        .filter(|(_, d)| d.is_empty())
        .map(|(u, _)| (*u, vec![0.0; dim]))
        .collect();
    let (batch, unit_of_row, ids) = gather(spec, units, round, data_seed, transitions_per_unit);
    if ids.is_empty() {
        return Ok(empty);
    }
    // A non-private twin clips at +inf: the largest finite bound clips nothing.
    let clip = if clip_norm.is_finite() {
        clip_norm
    } else {
        f64::MAX
    };
    let grads = per_unit_clipped(
        spec,
        cfg,
        params,
        target,
        &batch,
        &unit_of_row,
        ids.len(),
        clip,
        device,
    )?;
    let mut out: Vec<(u64, Vec<f32>)> = ids.into_iter().zip(grads.grads).collect();
    out.extend(empty);
    Ok(out)
}

/// The rows of every given unit with data at step `round` ([`draw_rows`]), as one batch, the
/// unit index of each row, and the ids of the units with data in batch order.
fn gather(
    spec: &QNetSpec,
    units: &[(u64, &TransitionBatch)],
    round: u64,
    data_seed: u64,
    transitions_per_unit: u32,
) -> (TransitionBatch, Vec<u32>, Vec<u64>) {
    let mut batch = TransitionBatch::new(spec.obs_dim);
    let mut unit_of_row = Vec::new();
    let mut ids = Vec::new();
    for (unit, data) in units {
        if data.is_empty() {
            continue;
        }
        let idx = ids.len() as u32;
        for row in draw_rows(data_seed, round, *unit, data.len(), transitions_per_unit) {
            batch.push_from(data, row);
            unit_of_row.push(idx);
        }
        ids.push(*unit);
    }
    (batch, unit_of_row, ids)
}

/// The summed path of [`unit_gradients`]: the sum of every given unit's clipped gradient at step
/// `round` (same rows, same clip), accumulated in f64, without materialising the per-unit
/// vectors. A unit without data adds nothing (its per-unit gradient is zero) and has no entry
/// in the result's `norms` and `clip_factors`, which follow the order of the units with data.
/// `clip_norm` must be finite (the summed path is for private rounds).
#[allow(clippy::too_many_arguments)]
pub fn summed_unit_gradients(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    offer: &[f32],
    units: &[(u64, &TransitionBatch)],
    round: u64,
    data_seed: u64,
    transitions_per_unit: u32,
    clip_norm: f64,
    device: &Device,
) -> crate::Result<SummedGradient> {
    let dim = spec.dim();
    if offer.len() != 2 * dim {
        return Err(crate::NnError::ParamLength {
            got: offer.len(),
            expected: 2 * dim,
        });
    }
    let (params, target) = offer.split_at(dim);
    let (batch, unit_of_row, ids) = gather(spec, units, round, data_seed, transitions_per_unit);
    if ids.is_empty() {
        return Ok(SummedGradient {
            sum: vec![0.0; dim],
            norms: Vec::new(),
            clip_factors: Vec::new(),
            mean_loss: None,
        });
    }
    summed_clipped(
        spec,
        cfg,
        params,
        target,
        &batch,
        &unit_of_row,
        ids.len(),
        clip_norm,
        device,
    )
}

/// Runs one step's per-unit computation `f` ([`unit_gradients`], [`summed_unit_gradients`]) on
/// `units`, leaving out every unit whose gradient norm is not finite: when `f` fails with
/// [`NnError::NonFiniteUnits`], those units are dropped and `f` runs again on the others.
/// Returns `f`'s result and the ids of the units left out (in the order found).
///
/// Sound for the others because a unit's rows ([`draw_rows`]) and each row's per-example
/// gradient depend on that unit's own data alone, not on the other rows of the batch (the
/// assumption [`super::per_example`] states): the units kept get what they would have got
/// without the ones left out.
pub fn without_non_finite_units<'a, T>(
    units: &[(u64, &'a TransitionBatch)],
    mut f: impl FnMut(&[(u64, &'a TransitionBatch)]) -> crate::Result<T>,
) -> crate::Result<(T, Vec<u64>)> {
    let mut kept = units.to_vec();
    let mut left_out = Vec::new();
    loop {
        match f(&kept) {
            Err(NnError::NonFiniteUnits { units: positions }) => {
                // Positions count the units with rows, in order ([`gather`]).
                let with_rows: Vec<u64> = kept
                    .iter()
                    .filter(|(_, d)| !d.is_empty())
                    .map(|(u, _)| *u)
                    .collect();
                let mut bad = Vec::with_capacity(positions.len());
                for p in positions {
                    let Some(u) = with_rows.get(p) else {
                        return Err(NnError::Invalid(format!(
                            "a non-finite unit at batch position {p} of {}",
                            with_rows.len()
                        )));
                    };
                    bad.push(*u);
                }
                if bad.is_empty() {
                    return Err(NnError::Invalid(
                        "non-finite units reported without positions".into(),
                    ));
                }
                kept.retain(|(u, _)| !bad.contains(u));
                left_out.extend(bad);
            }
            other => return other.map(|t| (t, left_out)),
        }
    }
}

/// Values per uploaded row: observation, next observation, action, reward, terminal.
pub fn row_width(obs_dim: usize) -> usize {
    2 * obs_dim + 3
}

/// A unit's transitions as the f32 payload of a `UnitData` frame.
pub fn encode_rows(data: &TransitionBatch) -> Vec<f32> {
    let d = data.obs_dim;
    let mut out = Vec::with_capacity(data.len() * row_width(d));
    for i in 0..data.len() {
        out.extend_from_slice(&data.obs[i * d..(i + 1) * d]);
        out.extend_from_slice(&data.next_obs[i * d..(i + 1) * d]);
        out.push(data.actions[i] as f32);
        out.push(data.rewards[i]);
        out.push(data.terminals[i]);
    }
    out
}

/// Why an uploaded unit's data was refused.
#[derive(Debug, Error, PartialEq)]
pub enum RowsError {
    #[error("observation dimension {got}, the task's environment has {expected}")]
    ObsDim { expected: usize, got: usize },
    #[error("no transitions")]
    Empty,
    #[error("{rows} rows of {width} values need {expected} values, the payload has {got}")]
    Length {
        rows: usize,
        width: usize,
        expected: usize,
        got: usize,
    },
    #[error("row {row}: a non-finite value")]
    NonFinite { row: usize },
    #[error("row {row}: action {value} is not an index below {n_actions}")]
    Action {
        row: usize,
        value: f32,
        n_actions: usize,
    },
    #[error("row {row}: terminal flag {value} is neither 0 nor 1")]
    Terminal { row: usize, value: f32 },
}

/// Checks and decodes an uploaded payload of `rows` rows (from a client: nothing is trusted).
pub fn decode_rows(
    spec: &QNetSpec,
    obs_dim: usize,
    rows: usize,
    payload: &[f32],
) -> Result<TransitionBatch, RowsError> {
    if obs_dim != spec.obs_dim {
        return Err(RowsError::ObsDim {
            expected: spec.obs_dim,
            got: obs_dim,
        });
    }
    if rows == 0 {
        return Err(RowsError::Empty);
    }
    let width = row_width(obs_dim);
    let expected = rows.saturating_mul(width);
    if payload.len() != expected {
        return Err(RowsError::Length {
            rows,
            width,
            expected,
            got: payload.len(),
        });
    }
    let mut out = TransitionBatch::new(obs_dim);
    for (row, r) in payload.chunks_exact(width).enumerate() {
        if r.iter().any(|v| !v.is_finite()) {
            return Err(RowsError::NonFinite { row });
        }
        let (a, rew, term) = (r[2 * obs_dim], r[2 * obs_dim + 1], r[2 * obs_dim + 2]);
        if a < 0.0 || a.fract() != 0.0 || a as usize >= spec.n_actions {
            return Err(RowsError::Action {
                row,
                value: a,
                n_actions: spec.n_actions,
            });
        }
        if term != 0.0 && term != 1.0 {
            return Err(RowsError::Terminal { row, value: term });
        }
        out.obs.extend_from_slice(&r[..obs_dim]);
        out.next_obs.extend_from_slice(&r[obs_dim..2 * obs_dim]);
        out.actions.push(a as u32);
        out.rewards.push(rew);
        out.terminals.push(term);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> QNetSpec {
        QNetSpec {
            obs_dim: 2,
            hidden: vec![4],
            n_actions: 3,
        }
    }

    fn batch() -> TransitionBatch {
        TransitionBatch {
            obs_dim: 2,
            obs: vec![0.1, 0.2, 0.3, 0.4],
            actions: vec![2, 0],
            rewards: vec![1.0, -0.5],
            next_obs: vec![0.3, 0.4, 0.5, 0.6],
            terminals: vec![0.0, 1.0],
        }
    }

    #[test]
    fn rows_round_trip_and_bad_rows_are_refused() {
        let b = batch();
        let enc = encode_rows(&b);
        assert_eq!(decode_rows(&spec(), 2, 2, &enc).unwrap(), b);
        assert!(matches!(
            decode_rows(&spec(), 3, 2, &enc),
            Err(RowsError::ObsDim { .. })
        ));
        assert!(matches!(
            decode_rows(&spec(), 2, 3, &enc),
            Err(RowsError::Length { .. })
        ));
        let mut bad = enc.clone();
        bad[4] = 3.0; // action of row 0 out of range
        assert!(matches!(
            decode_rows(&spec(), 2, 2, &bad),
            Err(RowsError::Action { row: 0, .. })
        ));
        let mut bad = enc.clone();
        bad[4] = 0.5;
        assert!(decode_rows(&spec(), 2, 2, &bad).is_err());
        let mut bad = enc.clone();
        bad[6] = 0.5; // terminal of row 0
        assert!(matches!(
            decode_rows(&spec(), 2, 2, &bad),
            Err(RowsError::Terminal { row: 0, .. })
        ));
        let mut bad = enc;
        bad[8] = f32::NAN;
        assert!(matches!(
            decode_rows(&spec(), 2, 2, &bad),
            Err(RowsError::NonFinite { row: 1 })
        ));
        assert_eq!(decode_rows(&spec(), 2, 0, &[]), Err(RowsError::Empty));
    }

    #[test]
    fn drawn_rows_depend_only_on_seed_round_and_unit() {
        let a = draw_rows(7, 3, 11, 50, 8);
        assert_eq!(a, draw_rows(7, 3, 11, 50, 8));
        assert!(a.iter().all(|&i| i < 50));
        assert_ne!(a, draw_rows(7, 4, 11, 50, 8));
        assert_ne!(a, draw_rows(7, 3, 12, 50, 8));
    }

    /// A unit's gradient is the same whether it is computed alone (as a federated client with
    /// one unit does) or in a batch with other units (as the central aggregator does).
    #[test]
    fn a_units_gradient_does_not_depend_on_its_batch() {
        let s = spec();
        let cfg = CqlConfig {
            hidden: s.hidden.clone(),
            ..CqlConfig::default()
        };
        let mut offer = s.init(1);
        offer.extend(s.init(2));
        let (a, b) = (batch(), {
            let mut b = batch();
            b.rewards = vec![3.0, 2.0];
            b
        });
        let dev = Device::Cpu;
        let both =
            unit_gradients(&s, &cfg, &offer, &[(5, &a), (9, &b)], 4, 0, 3, 0.5, &dev).unwrap();
        let alone = unit_gradients(&s, &cfg, &offer, &[(9, &b)], 4, 0, 3, 0.5, &dev).unwrap();
        assert_eq!(both.len(), 2);
        assert_eq!(both[1].0, 9);
        for (x, y) in both[1].1.iter().zip(&alone[0].1) {
            assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{x} vs {y}");
        }
        let norm: f64 = both[0]
            .1
            .iter()
            .map(|v| (*v as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(norm <= 0.5 + 1e-6, "{norm}");
        // A non-private twin (clip +inf) gets the unclipped gradient.
        let free =
            unit_gradients(&s, &cfg, &offer, &[(5, &a)], 4, 0, 3, f64::INFINITY, &dev).unwrap();
        let l2 = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        assert!(l2(&free[0].1) > norm, "{} vs {norm}", l2(&free[0].1));
    }

    /// Issue 59, item 1: a unit whose data makes its gradient non-finite (observations of 1e30)
    /// is left out of the step, by its id, and the other units get exactly what they get
    /// without it, on both paths; before, the whole step failed ("unit 1: gradient norm is not
    /// finite", a batch position).
    #[test]
    fn a_unit_with_a_non_finite_gradient_is_left_out_by_id() {
        let s = spec();
        let cfg = CqlConfig {
            hidden: s.hidden.clone(),
            ..CqlConfig::default()
        };
        let mut offer = s.init(1);
        offer.extend(s.init(2));
        let good = batch();
        let mut absurd = batch();
        absurd.obs.iter_mut().for_each(|v| *v = 1e30);
        absurd.next_obs.iter_mut().for_each(|v| *v = -1e30);
        let dev = Device::Cpu;
        let units = [(5, &good), (7, &absurd), (9, &good)];
        // Without the helper the step fails as a whole.
        let e = unit_gradients(&s, &cfg, &offer, &units, 4, 0, 3, 0.5, &dev).unwrap_err();
        assert!(
            matches!(&e, NnError::NonFiniteUnits { units } if units == &vec![1]),
            "{e}"
        );
        let (grads, out) = without_non_finite_units(&units, |u| {
            unit_gradients(&s, &cfg, &offer, u, 4, 0, 3, 0.5, &dev)
        })
        .unwrap();
        assert_eq!(out, vec![7]);
        assert_eq!(grads.iter().map(|g| g.0).collect::<Vec<_>>(), vec![5, 9]);
        let alone = unit_gradients(
            &s,
            &cfg,
            &offer,
            &[(5, &good), (9, &good)],
            4,
            0,
            3,
            0.5,
            &dev,
        )
        .unwrap();
        assert_eq!(grads, alone);
        let (sum, out) = without_non_finite_units(&units, |u| {
            summed_unit_gradients(&s, &cfg, &offer, u, 4, 0, 3, 0.5, &dev)
        })
        .unwrap();
        assert_eq!(out, vec![7]);
        assert_eq!(sum.norms.len(), 2);
        assert!(sum.sum.iter().all(|v| v.is_finite()));
        // The operator's training loss is the CQL loss of the step's rows (the same rows the
        // gradient uses), computed by the plain trainer's loss.
        let kept = [(5, &good), (9, &good)];
        let (rows, _, _) = gather(&s, &kept, 4, 0, 3);
        let (params, target) = offer.split_at(s.dim());
        let (want, _) =
            crate::offline::cql::loss_and_grad(&s, &cfg, params, target, &rows, &dev).unwrap();
        let got = sum.mean_loss.unwrap();
        assert!(
            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
            "{got} vs {want}"
        );
        // Every unit bad: all left out, an empty (zero) step.
        let (sum, out) = without_non_finite_units(&[(7, &absurd)], |u| {
            summed_unit_gradients(&s, &cfg, &offer, u, 4, 0, 3, 0.5, &dev)
        })
        .unwrap();
        assert_eq!(out, vec![7]);
        assert!(sum.sum.iter().all(|v| *v == 0.0));
    }
}
