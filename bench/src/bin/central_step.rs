//! One central DP-SGD step (DESIGN §2.5, issue 55 §3) with `--units` sampled units of one
//! transition each, discrete CQL loss, for the Q-network 8-256-256-4 and an MLP of about 1 M
//! parameters (8-1024-1024-4, 1,062,916 parameters), on the CPU:
//!
//! - `summed`: the summed path the central mode runs (`summed_clipped`: per-example norms, one
//!   weighted f64 product per layer), the sum quantised once onto the public grid, exact
//!   discrete Gaussian noise calibrated to the summed sensitivity, the noisy mean, an Adam step;
//! - `per_unit`: the path it replaced (`per_unit_clipped`: every unit's clipped gradient
//!   materialised, re-clipped and quantised one by one as the engine does), the same noise and
//!   Adam step;
//! - `plain`: the non-private minibatch step of the same network and batch (`loss_and_grad`
//!   over the batch, an Adam step).
//!
//! Each private case is also timed without the noise (`*_no_noise`: everything else the same),
//! since the exact sampler's cost grows with the parameter count and not with the batch. Where
//! the time goes, as further cases:
//! - `plain_grad` / `summed_grad`: the gradient alone (`loss_and_grad`, `summed_clipped`), no
//!   quantisation, noise or Adam;
//! - `noise_1t` / `noise_2t`: the exact noise of one release alone (`d` discrete Gaussian samples
//!   through `DiscreteGaussianNoise::add_to`) in a rayon pool of 1 and of 2 threads; their lines
//!   also give nanoseconds per coordinate.
//!
//! ```text
//! cargo build --release -p fedrl-bench --bin central_step
//! RAYON_NUM_THREADS=2 target/release/central_step [--units 256] [--rounds 5] [--seconds 2]
//!     [--networks 256,1024] [--cases plain,summed,...]
//! ```
//! Cases run interleaved in rounds (a loaded machine biases no case); each prints one JSON line
//! per network and case (median seconds per step over rounds), then the ratios to `plain`
//! (median of per-round ratios). `bench/run_central_step.sh` adds the Opacus peers and appends
//! everything to `bench/results/central_step.jsonl`.

use std::time::Instant;

use anyhow::Context;
use fedrl_common::offline::CqlConfig;
use fedrl_common::privacy::clipping::clip_l2;
use fedrl_common::privacy::fixed_point::{
    DEFAULT_GRID_BITS, FixedPointSum, Grid, NoiseCalibration, SummedBound,
};
use fedrl_common::privacy::noise::DiscreteGaussianNoise;
use fedrl_rl::candle_core::Device;
use fedrl_rl::offline::{
    Adam, QNetSpec, TransitionBatch, loss_and_grad, per_unit_clipped, summed_clipped,
};

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let argv: Vec<String> = std::env::args().collect();
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A deterministic pseudo-random batch (a splitmix hash of the index), as the per-example bench.
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

/// Seconds per call of `f`, run for at least `seconds` (and 3 calls) after 2 warm-up calls.
fn time(seconds: f64, f: &mut dyn FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    let t = Instant::now();
    let mut n = 0usize;
    loop {
        f()?;
        n += 1;
        let s = t.elapsed().as_secs_f64();
        if s >= seconds && n >= 3 {
            return Ok(s / n as f64);
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The private step's tail: the noisy mean of `sum` (released with `noise` when given) and an
/// Adam step with it.
fn release_and_step(
    sum: FixedPointSum,
    cal: &NoiseCalibration,
    noise: Option<&mut DiscreteGaussianNoise>,
    denom: f64,
    adam: &mut Adam,
    params: &mut [f32],
) -> anyhow::Result<()> {
    let mean: Vec<f32> = match noise {
        Some(n) => sum.release(n, cal, denom)?,
        None => {
            let gamma = sum.grid().gamma();
            sum.sum()
                .iter()
                .map(|&v| (v as f64 * gamma / denom) as f32)
                .collect()
        }
    };
    adam.step(params, &mean);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    fedrl_bench::train_like_fedrl();
    let units: usize = arg("--units", 256);
    let rounds: usize = arg("--rounds", 5).max(1);
    let seconds: f64 = arg("--seconds", 2.0);
    let networks: String = arg("--networks", "256,1024".to_string());
    let all_cases = "plain,summed,summed_no_noise,per_unit,per_unit_no_noise,plain_grad,\
                     summed_grad,noise_1t,noise_2t";
    let cases: String = arg("--cases", all_cases.to_string());
    let pools = [1usize, 2].map(|t| rayon::ThreadPoolBuilder::new().num_threads(t).build());
    let [Ok(pool_1), Ok(pool_2)] = pools else {
        anyhow::bail!("could not build the rayon pools of the noise cases");
    };
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into());
    let device = Device::Cpu;
    let cfg = CqlConfig::default();
    let clip = 1.0;
    let z = 1.0;
    let denom = units as f64;
    for width in networks.split(',') {
        let width: usize = width.trim().parse().context("--networks: widths")?;
        let spec = QNetSpec {
            obs_dim: 8,
            hidden: vec![width, width],
            n_actions: 4,
        };
        let name = format!("8-{width}-{width}-4");
        let d = spec.dim();
        let target = spec.init(1);
        let data = batch(units, spec.obs_dim, spec.n_actions);
        let one_each: Vec<u32> = (0..units as u32).collect();
        let grid = Grid::for_clip_norm(clip, DEFAULT_GRID_BITS)?;
        let bound = SummedBound {
            max_units: units as u64,
            max_rows: units as u64,
        };
        let summed_cal = NoiseCalibration::for_summed(&grid, &bound, d, z)?;
        let mut noise = DiscreteGaussianNoise::seeded(7);
        let mut q = vec![0i64; d];
        // Each case keeps its own parameters and optimizer, as a run would.
        let mut p_plain = spec.init(0);
        let mut p_sum = p_plain.clone();
        let mut p_unit = p_plain.clone();
        let mut adam_plain = Adam::new(d, 1e-4, 1e-8);
        let mut adam_sum = Adam::new(d, 1e-4, 1e-8);
        let mut adam_unit = Adam::new(d, 1e-4, 1e-8);
        let names: Vec<&str> = cases.split(',').map(str::trim).collect();
        if !names.contains(&"plain") {
            anyhow::bail!("--cases must include plain (the ratios' base)");
        }
        let mut zeros = vec![0i64; d];
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
        for _ in 0..rounds {
            for (i, case) in names.iter().enumerate() {
                let with_noise = !case.ends_with("no_noise");
                let t = match *case {
                    "plain" => time(seconds, &mut || {
                        let (_, g) = loss_and_grad(&spec, &cfg, &p_plain, &target, &data, &device)?;
                        adam_plain.step(&mut p_plain, &g);
                        Ok(())
                    })?,
                    "plain_grad" => time(seconds, &mut || {
                        loss_and_grad(&spec, &cfg, &p_plain, &target, &data, &device)?;
                        Ok(())
                    })?,
                    "summed_grad" => time(seconds, &mut || {
                        summed_clipped(
                            &spec, &cfg, &p_sum, &target, &data, &one_each, units, clip, &device,
                        )?;
                        Ok(())
                    })?,
                    c if c.starts_with("noise_") => {
                        let pool = if c == "noise_1t" { &pool_1 } else { &pool_2 };
                        time(seconds, &mut || {
                            zeros.fill(0);
                            pool.install(|| noise.add_to(&mut zeros, summed_cal.distribution()))?;
                            Ok(())
                        })?
                    }
                    c if c.starts_with("summed") => time(seconds, &mut || {
                        let s = summed_clipped(
                            &spec, &cfg, &p_sum, &target, &data, &one_each, units, clip, &device,
                        )?;
                        grid.quantize_sum(&s.sum, units as u64, &mut q)?;
                        let mut acc = FixedPointSum::new(grid, d);
                        acc.add_quantized(&q, units as u64)?;
                        let n = with_noise.then_some(&mut noise);
                        release_and_step(acc, &summed_cal, n, denom, &mut adam_sum, &mut p_sum)
                    })?,
                    c if c.starts_with("per_unit") => time(seconds, &mut || {
                        let g = per_unit_clipped(
                            &spec, &cfg, &p_unit, &target, &data, &one_each, units, clip, &device,
                        )?;
                        let mut acc = FixedPointSum::new(grid, d);
                        for mut v in g.grads {
                            // As the engine: re-clip, quantise, add.
                            clip_l2(&mut v, clip);
                            acc.add(&v)?;
                        }
                        let n = with_noise.then_some(&mut noise);
                        // Today's path in central mode also runs with the summed calibration.
                        release_and_step(acc, &summed_cal, n, denom, &mut adam_unit, &mut p_unit)
                    })?,
                    other => anyhow::bail!("unknown case {other}"),
                };
                times[i].push(t);
            }
        }
        for (case, t) in names.iter().zip(&times) {
            let mut line = serde_json::json!({
                "bench": "central_step", "case": case, "network": name, "params": d,
                "units": units, "rows_per_unit": 1, "device": "cpu",
                "rayon_threads": threads, "rounds": rounds,
                "seconds_per_step": median(t.clone()),
                "seconds_per_step_rounds": t,
            });
            if let Some(pool_threads) = case.strip_prefix("noise_") {
                line["rayon_threads"] = serde_json::json!(pool_threads.trim_end_matches('t'));
                line["ns_per_coordinate"] = serde_json::json!(median(t.clone()) * 1e9 / d as f64);
                line["noise_sigma_grid_units"] = serde_json::json!(summed_cal.sigma());
            }
            println!("{line}");
        }
        // Median over rounds of (case / plain) in the same round; plain is names[plain_at].
        let plain_at = names.iter().position(|&c| c == "plain").unwrap_or(0);
        let mut ratios = serde_json::json!({
            "bench": "central_step", "network": name, "params": d, "units": units,
            "summed_sensitivity_grid_units": summed_cal.l2_sensitivity(),
            "per_unit_sensitivity_grid_units": grid.l2_sensitivity(),
        });
        for (i, case) in names.iter().enumerate() {
            if i == plain_at {
                continue;
            }
            let r: Vec<f64> = times[i]
                .iter()
                .zip(&times[plain_at])
                .map(|(a, p)| a / p)
                .collect();
            ratios[format!("ratio_{case}_over_plain")] = serde_json::json!(median(r));
        }
        println!("{ratios}");
    }
    Ok(())
}
