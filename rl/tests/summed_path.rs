//! The central mode's summed path (`summed_clipped`): it equals the sum of the per-unit clipped
//! gradients, and after quantising the sum once onto the public grid, adding or removing one
//! unit moves the integer sum by at most the sensitivity the ledger records for it
//! (`NoiseCalibration::for_summed`).

use candle_core::Device;
use fedrl_common::offline::CqlConfig;
use fedrl_common::privacy::fixed_point::{Grid, NoiseCalibration, SummedBound};
use fedrl_rl::offline::{QNetSpec, TransitionBatch, per_unit_clipped, summed_clipped};
use proptest::prelude::*;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

const CPU: Device = Device::Cpu;

fn spec() -> QNetSpec {
    QNetSpec {
        obs_dim: 4,
        hidden: vec![16, 8],
        n_actions: 3,
    }
}

fn cfg_for(spec: &QNetSpec) -> CqlConfig {
    CqlConfig {
        hidden: spec.hidden.clone(),
        alpha: 0.7,
        gamma: 0.95,
        ..CqlConfig::default()
    }
}

/// `rows[u]` random transitions for unit `u`, concatenated, and the unit of every row.
fn units_batch(
    spec: &QNetSpec,
    rows: &[usize],
    seed: u64,
    scale: f32,
) -> (TransitionBatch, Vec<u32>) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut b = TransitionBatch::new(spec.obs_dim);
    let mut unit_of_row = Vec::new();
    for (u, &k) in rows.iter().enumerate() {
        for _ in 0..k {
            for _ in 0..spec.obs_dim {
                b.obs.push(scale * rng.random_range(-2.0f32..2.0));
                b.next_obs.push(scale * rng.random_range(-2.0f32..2.0));
            }
            b.actions.push(rng.random_range(0..spec.n_actions as u32));
            b.rewards.push(rng.random_range(-3.0f32..3.0));
            b.terminals
                .push(if rng.random_bool(0.3) { 1.0 } else { 0.0 });
            unit_of_row.push(u as u32);
        }
    }
    (b, unit_of_row)
}

/// The batch without unit `drop`'s rows (later units renumbered).
fn without_unit(
    b: &TransitionBatch,
    unit_of_row: &[u32],
    drop: u32,
) -> (TransitionBatch, Vec<u32>) {
    let keep: Vec<usize> = (0..b.len()).filter(|&i| unit_of_row[i] != drop).collect();
    let units = keep
        .iter()
        .map(|&i| unit_of_row[i] - u32::from(unit_of_row[i] > drop))
        .collect();
    (b.select(&keep), units)
}

fn l2_i64(a: &[i64], b: &[i64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// Under the same data, parameters and clip, the summed path gives the sum of the per-unit
/// path's clipped vectors (f32 rounding apart), for one-row and multi-row units.
#[test]
fn the_summed_path_equals_the_sum_of_per_unit_clipped_gradients() {
    let spec = spec();
    let cfg = cfg_for(&spec);
    let params = spec.init(3);
    let target = spec.init(4);
    for rows in [vec![1usize; 12], vec![3, 1, 2, 4, 1, 2]] {
        let (batch, units) = units_batch(&spec, &rows, 7, 1.0);
        for c in [0.05, 1.0, 1e3] {
            let per = per_unit_clipped(
                &spec,
                &cfg,
                &params,
                &target,
                &batch,
                &units,
                rows.len(),
                c,
                &CPU,
            )
            .unwrap();
            let s = summed_clipped(
                &spec,
                &cfg,
                &params,
                &target,
                &batch,
                &units,
                rows.len(),
                c,
                &CPU,
            )
            .unwrap();
            let mut want = vec![0f64; spec.dim()];
            for g in &per.grads {
                want.iter_mut()
                    .zip(g)
                    .for_each(|(w, x)| *w += f64::from(*x));
            }
            let diff = want
                .iter()
                .zip(&s.sum)
                .map(|(a, b)| (a - b).powi(2))
                .sum::<f64>()
                .sqrt();
            let n = want.iter().map(|a| a * a).sum::<f64>().sqrt();
            assert!(
                diff <= 1e-5 * n + 1e-12,
                "rows {rows:?} C {c}: |diff| {diff:e} of {n:e}"
            );
            assert_eq!(s.norms, per.norms);
            let clipped = s.clip_factors.iter().filter(|&&f| f < 1.0).count();
            let want_clipped = per.norms.iter().filter(|&&n| n > c).count();
            assert_eq!(clipped, want_clipped, "C {c}");
        }
    }
}

/// A multi-row unit whose rows cancel (to far below `1/R` of their norms) is held to the
/// row-norm cap: its weight times its mean row norm is at most `R C`.
#[test]
fn cancelling_rows_are_held_to_the_row_norm_cap() {
    let spec = spec();
    let cfg = CqlConfig {
        alpha: 0.0,
        gamma: 0.0,
        ..cfg_for(&spec)
    };
    let params = spec.init(5);
    // Two identical rows but rewards +-big: the TD gradients (Huber, |diff| > 1: sign only)
    // cancel exactly, the mean is ~0 and the clip factor from the mean's norm alone is 1.
    let (mut batch, _) = units_batch(&spec, &[2], 1, 1.0);
    let (o, no) = (batch.obs[..4].to_vec(), batch.next_obs[..4].to_vec());
    batch.obs[4..8].copy_from_slice(&o);
    batch.next_obs[4..8].copy_from_slice(&no);
    batch.actions[1] = batch.actions[0];
    batch.terminals = vec![1.0, 1.0];
    batch.rewards = vec![1e3, -1e3];
    let c = 1e-3;
    let s = summed_clipped(&spec, &cfg, &params, &params, &batch, &[0, 0], 1, c, &CPU).unwrap();
    assert!(s.norms[0] < 1e-6, "the rows must cancel: {}", s.norms[0]);
    // The rows' own gradient norms (each row as its own unit, no clipping).
    let rows = per_unit_clipped(
        &spec,
        &cfg,
        &params,
        &params,
        &batch,
        &[0, 1],
        2,
        1e30,
        &CPU,
    )
    .unwrap();
    let mean = (rows.norms[0] + rows.norms[1]) / 2.0;
    assert!(
        mean > 1e3 * c,
        "rows of norm {mean} would not reach the cap"
    );
    let r = fedrl_common::privacy::fixed_point::SUMMED_ROW_NORM_CAP;
    assert!(
        s.clip_factors[0] * mean <= r * c * (1.0 + 1e-9),
        "factor {} x mean row norm {mean} > R C",
        s.clip_factors[0]
    );
    // Not clipped to nothing: the cap binds with equality (up to its rounding slack).
    assert!(s.clip_factors[0] * mean >= r * c * (1.0 - 1e-6));
    assert!(s.sum.iter().all(|v| v.abs() < 1e-9));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Adding or removing one unit changes the summed path's quantised integer sum by at most
    /// the L2 sensitivity recorded for it (`NoiseCalibration::for_summed`), whatever the grid's
    /// resolution: on coarse grids (down to 2 bits, `C / gamma` in [4, 8)) the `sqrt(d)`
    /// rounding term is most of that bound.
    #[test]
    fn one_unit_moves_the_quantised_sum_by_at_most_the_recorded_sensitivity(
        rows in prop::collection::vec(1usize..4, 1..10),
        drop_at in 0usize..10,
        seed in 0u64..1_000,
        clip in 1e-3f64..10.0,
        bits in 2u32..=24,
        scale in 0.1f32..5.0,
    ) {
        let spec = spec();
        let cfg = cfg_for(&spec);
        let params = spec.init(seed);
        let target = spec.init(seed + 1);
        let n = rows.len();
        let drop = (drop_at % n) as u32;
        let (batch, units) = units_batch(&spec, &rows, seed, scale);
        let full = summed_clipped(&spec, &cfg, &params, &target, &batch, &units, n, clip, &CPU).unwrap();
        let grid = Grid::for_clip_norm(clip, bits).unwrap();
        let d = spec.dim();
        let mut q = vec![0i64; d];
        grid.quantize_sum(&full.sum, n as u64, &mut q).unwrap();
        let mut q2 = vec![0i64; d];
        if n > 1 {
            let (b2, u2) = without_unit(&batch, &units, drop);
            let less = summed_clipped(&spec, &cfg, &params, &target, &b2, &u2, n - 1, clip, &CPU).unwrap();
            grid.quantize_sum(&less.sum, n as u64 - 1, &mut q2).unwrap();
        }
        // The public bound of the larger round: n units, every row.
        let bound = SummedBound { max_units: n as u64, max_rows: batch.len() as u64 };
        let cal = NoiseCalibration::for_summed(&grid, &bound, d, 10.0).unwrap();
        let moved = l2_i64(&q, &q2);
        prop_assert!(
            moved <= cal.l2_sensitivity(),
            "moved {} > recorded sensitivity {} (C/gamma {})",
            moved, cal.l2_sensitivity(), clip / grid.gamma()
        );
        prop_assert!(cal.l2_sensitivity() >= clip / grid.gamma());
        prop_assert!(cal.sigma() / cal.l2_sensitivity() >= 10.0);
    }
}
