//! Per-example clipped gradients of the discrete CQL loss (issue 12, first Performance bullet).
//!
//! `RAYON_NUM_THREADS=2 cargo bench -p fedrl-bench --bench per_example [-- --batch 256
//! --seconds 3 --rounds 5 --device cpu]` (`--seconds` per case, split over the rounds)
//!
//! Q-network 8-256-256-4 (ReLU), random transitions, one row per unit unless named otherwise.
//! Cases (examples/s of one gradient computation, forward and backward included, no optimizer
//! step):
//! - `clipped_sum`: the sum of per-unit clipped gradients (DP-SGD's noised quantity);
//! - `clipped_sum_k4`: the same with units of 4 rows each (Gram-matrix norms);
//! - `per_unit_clipped`: every unit's clipped gradient materialised (what a client sends);
//! - `plain`: the non-private mean gradient (`loss_and_grad`) of the same batch.
//!
//! The cases run interleaved in `--rounds` rounds. Prints one JSON line per case (median
//! examples/s over rounds), then the ratios `plain / clipped_sum` (time of the private step
//! relative to the plain one; median of per-round ratios).

use std::time::Instant;

use fedrl_common::offline::CqlConfig;
use fedrl_rl::offline::{QNetSpec, TransitionBatch, clipped_sum, loss_and_grad, per_unit_clipped};

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let argv: Vec<String> = std::env::args().collect();
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A deterministic pseudo-random batch (splitmix-style hash of the index: no RNG crate needed).
fn batch(n: usize, obs_dim: usize, n_actions: usize) -> TransitionBatch {
    let h = |i: u64| {
        let mut z = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let mut b = TransitionBatch::new(obs_dim);
    for i in 0..n as u64 {
        for j in 0..obs_dim as u64 {
            b.obs.push(h(i * 64 + j));
            b.next_obs.push(h(1_000_000 + i * 64 + j));
        }
        b.actions.push((i % n_actions as u64) as u32);
        b.rewards.push(h(2_000_000 + i));
        b.terminals.push(if i % 10 == 0 { 1.0 } else { 0.0 });
    }
    b
}

/// Runs `f` for at least `seconds` (after a warm-up) and returns examples/s.
fn time(
    batch: usize,
    seconds: f64,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    for _ in 0..10 {
        f()?;
    }
    let t = Instant::now();
    let mut n = 0usize;
    loop {
        f()?;
        n += 1;
        let s = t.elapsed().as_secs_f64();
        if s >= seconds && n >= 5 {
            return Ok((n * batch) as f64 / s);
        }
    }
}

fn main() -> anyhow::Result<()> {
    let device_name: String = arg("--device", "cpu".to_string());
    let device = fedrl_rl::device::parse(&device_name)?;
    let b: usize = arg("--batch", 256);
    let seconds: f64 = arg("--seconds", 3.0);
    let rounds: usize = arg("--rounds", 5).max(1);
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into());
    let spec = QNetSpec {
        obs_dim: 8,
        hidden: vec![256, 256],
        n_actions: 4,
    };
    let cfg = CqlConfig::default();
    let params = spec.init(0);
    let target = spec.init(1);
    let data = batch(b, spec.obs_dim, spec.n_actions);
    let one_each: Vec<u32> = (0..b as u32).collect();
    let by_four: Vec<u32> = (0..b as u32).map(|i| i / 4).collect();
    let clip = 1.0;
    type Case<'a> = (&'static str, Box<dyn FnMut() -> anyhow::Result<()> + 'a>);
    let mut cases: Vec<Case> = vec![
        (
            "plain",
            Box::new(|| {
                loss_and_grad(&spec, &cfg, &params, &target, &data, &device)?;
                Ok(())
            }),
        ),
        (
            "clipped_sum",
            Box::new(|| {
                clipped_sum(
                    &spec, &cfg, &params, &target, &data, &one_each, b, clip, &device,
                )?;
                Ok(())
            }),
        ),
        (
            "clipped_sum_k4",
            Box::new(|| {
                clipped_sum(
                    &spec,
                    &cfg,
                    &params,
                    &target,
                    &data,
                    &by_four,
                    b / 4,
                    clip,
                    &device,
                )?;
                Ok(())
            }),
        ),
        (
            "per_unit_clipped",
            Box::new(|| {
                per_unit_clipped(
                    &spec, &cfg, &params, &target, &data, &one_each, b, clip, &device,
                )?;
                Ok(())
            }),
        ),
    ];
    // Rounds interleave the cases, so a machine whose load drifts (shared cores) biases no case;
    // figures are medians over rounds, ratios medians of per-round ratios.
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..rounds {
        for (i, (_, f)) in cases.iter_mut().enumerate() {
            rates[i].push(time(b, seconds / rounds as f64, f)?);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for ((case, _), r) in cases.iter().zip(&rates) {
        let eps = median(r.clone());
        println!(
            "{}",
            serde_json::json!({
                "case": case, "batch": b, "network": "8-256-256-4", "device": device_name,
                "rayon_threads": threads, "rounds": rounds, "examples_per_s": eps,
                "seconds_per_step": b as f64 / eps,
            })
        );
    }
    let ratio = |num: usize, den: usize| {
        median(
            rates[num]
                .iter()
                .zip(&rates[den])
                .map(|(a, c)| a / c)
                .collect(),
        )
    };
    println!(
        "{}",
        serde_json::json!({
            "ratio_plain_over_clipped_sum": ratio(0, 1),
            "ratio_plain_over_clipped_sum_k4": ratio(0, 2),
        })
    );
    Ok(())
}
