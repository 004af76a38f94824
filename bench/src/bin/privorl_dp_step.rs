//! One DP fine-tuning step of PrivORL-n's synthesizer (seed 003, Eq. 2; `tasks/src/privorl`'s
//! central mode) against a non-private training step of the same denoiser at the same batch,
//! on the CPU (width 256, 4 residual blocks, CartPole-shaped rows of 12 values by default):
//!
//! - `plain`: [`DiffusionModel::train_step`] on `--units` rows (mean EDM loss, backward,
//!   global-norm clip, AdamW, EMA);
//! - `dp`: what the central path does per round with `--units` sampled units of one transition
//!   each: the online weights as the flat offer, [`summed_unit_gradients`] (each unit's own
//!   noise draw, exact per-example norms from one probed backward pass, clip to C = 1, the f64
//!   sum), the sum quantised once onto the public grid, exact discrete Gaussian noise
//!   calibrated to the summed sensitivity (z = 0.79, the scenario's), the noisy mean, and
//!   [`DiffusionModel::apply_gradient`] (AdamW, EMA);
//! - `dp_no_noise`: the same without the noise sampler (its cost grows with the parameter
//!   count, not the batch); `dp_grad`: the offer and [`summed_unit_gradients`] alone.
//!
//! ```text
//! cargo build --release -p fedrl-bench --bin privorl_dp_step
//! RAYON_NUM_THREADS=1 target/release/privorl_dp_step [--units 256] [--rounds 5] [--seconds 2]
//!     [--cases plain,dp,dp_no_noise,dp_grad] [--results bench/results/privorl_core.jsonl]
//! ```
//! Cases run interleaved in rounds (a loaded machine biases no case); one JSON line per case
//! (median seconds per step over rounds) and one with the ratios to `plain` (median of the
//! per-round ratios), printed and appended to `--results`.

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use fedrl_common::privacy::fixed_point::{
    DEFAULT_GRID_BITS, FixedPointSum, Grid, NoiseCalibration, SummedBound,
};
use fedrl_common::privacy::noise::DiscreteGaussianNoise;
use fedrl_rl::diffusion::dp::{UnitRows, summed_unit_gradients};
use fedrl_rl::diffusion::{DenoiserConfig, DiffusionModel, SynthesizerConfig};

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let argv: Vec<String> = std::env::args().collect();
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
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

/// Normalised-looking rows (a smooth deterministic pattern of roughly unit scale).
fn rows(n: usize, d: usize) -> Vec<f32> {
    (0..n * d)
        .map(|k| ((k as f32) * 0.7311).sin() * 1.3)
        .collect()
}

fn main() -> anyhow::Result<()> {
    fedrl_bench::train_like_fedrl();
    let units: usize = arg("--units", 256);
    let rounds: usize = arg("--rounds", 5).max(1);
    let seconds: f64 = arg("--seconds", 2.0);
    let width: usize = arg("--width", 256);
    let blocks: usize = arg("--blocks", 4);
    let d: usize = arg("--dim", 12);
    let z: f64 = arg("--noise-multiplier", 0.79);
    let cases: String = arg("--cases", "plain,dp,dp_no_noise,dp_grad".to_string());
    let results: String = arg("--results", "bench/results/privorl_core.jsonl".to_string());
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into());
    let device = fedrl_rl::candle_core::Device::Cpu;
    let cfg = SynthesizerConfig {
        denoiser: DenoiserConfig {
            width,
            blocks,
            ..DenoiserConfig::default()
        },
        ..SynthesizerConfig::default()
    };
    let data = rows(units, d);
    let clip = 1.0;
    let denom = units as f64;
    // Each case keeps its own model and optimiser, as a run would.
    let mut plain = DiffusionModel::new(d, cfg, 0, &device)?;
    let mut private = DiffusionModel::new(d, cfg, 0, &device)?;
    let p = plain.denoiser().spec().num_params();
    let grid = Grid::for_clip_norm(clip, DEFAULT_GRID_BITS)?;
    let bound = SummedBound {
        max_units: units as u64,
        max_rows: units as u64,
    };
    let cal = NoiseCalibration::for_summed(&grid, &bound, p, z)?;
    let mut noise = DiscreteGaussianNoise::seeded(7);
    let mut q = vec![0i64; p];
    let unit_rows: Vec<UnitRows> = (0..units)
        .map(|u| UnitRows {
            unit: u as u64,
            rows: &data[u * d..(u + 1) * d],
        })
        .collect();
    let names: Vec<&str> = cases.split(',').map(str::trim).collect();
    let plain_at = names
        .iter()
        .position(|&c| c == "plain")
        .context("--cases must include plain (the ratios' base)")?;
    let mut round = 0u64;
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for _ in 0..rounds {
        for (i, case) in names.iter().enumerate() {
            let t = match *case {
                "plain" => time(seconds, &mut || {
                    plain.train_step(&data)?;
                    Ok(())
                })?,
                "dp_grad" => time(seconds, &mut || {
                    let offer = private.online_flat()?;
                    let net = private.denoiser();
                    let edm = &private.config().edm;
                    round += 1;
                    summed_unit_gradients(net, edm, &offer, &unit_rows, round, 0, 1, clip)?;
                    Ok(())
                })?,
                "dp" | "dp_no_noise" => time(seconds, &mut || {
                    let offer = private.online_flat()?;
                    let net = private.denoiser();
                    let edm = &private.config().edm;
                    round += 1;
                    let s = summed_unit_gradients(net, edm, &offer, &unit_rows, round, 0, 1, clip)?;
                    grid.quantize_sum(&s.sum, units as u64, &mut q)?;
                    let mut acc = FixedPointSum::new(grid, p);
                    acc.add_quantized(&q, units as u64)?;
                    let mean: Vec<f32> = if *case == "dp" {
                        acc.release(&mut noise, &cal, denom)?
                    } else {
                        let gamma = acc.grid().gamma();
                        acc.sum()
                            .iter()
                            .map(|&v| (v as f64 * gamma / denom) as f32)
                            .collect()
                    };
                    private.apply_gradient(&mean)?;
                    Ok(())
                })?,
                other => anyhow::bail!("unknown case {other}"),
            };
            times[i].push(t);
        }
    }
    let mut out = Vec::new();
    for (case, t) in names.iter().zip(&times) {
        out.push(serde_json::json!({
            "bench": "privorl_dp_step", "case": case, "width": width, "blocks": blocks,
            "data_dim": d, "params": p, "units": units, "rows_per_unit": 1,
            "noise_multiplier": z, "device": "cpu", "threads": threads, "rounds": rounds,
            "seconds_per_step": median(t.clone()),
            "seconds_per_step_rounds": t,
        }));
    }
    let mut ratios = serde_json::json!({
        "bench": "privorl_dp_step", "width": width, "blocks": blocks, "params": p,
        "units": units, "threads": threads,
    });
    for (i, case) in names.iter().enumerate() {
        if i == plain_at {
            continue;
        }
        let r: Vec<f64> = times[i]
            .iter()
            .zip(&times[plain_at])
            .map(|(a, b)| a / b)
            .collect();
        ratios[format!("ratio_{case}_over_plain")] = serde_json::json!(median(r));
    }
    out.push(ratios);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&results)
        .with_context(|| format!("opening {results}"))?;
    for line in out {
        println!("{line}");
        writeln!(f, "{line}")?;
    }
    Ok(())
}
