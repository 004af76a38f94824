//! Clip-norm calibration for a PriMORL scenario (seed 001, appendix F.3: "we set z = 0 and
//! progressively decreased C until it started to adversely affect performance"). Before paying
//! for whole runs at several C, this measures what C would cut: the unclipped local-update
//! norms of sampled trajectories, at the initial ensemble and during non-private FedAvg with no
//! clipping at all, in process (no QUIC, no noise).
//!
//! ```text
//! cargo build --release -p fedrl-bench --bin primorl_clip
//! target/release/primorl_clip scenarios/pendulum-primorl.toml [--rounds 400] [--every 100]
//!     [--sample 200] [--results bench/results/primorl_clip.jsonl]
//! ```
//!
//! For each checkpoint round it appends one JSON line: quantiles of the norm C must reach for
//! the trajectory's delta not to be clipped (flat: sqrt(N) x the largest member delta norm;
//! per-layer: sqrt(N L) x the largest layer delta norm, as the scenario's clipping mode
//! projects) and the public split's MSE. Each round trains on a Poisson sample at the scenario's
//! rate (the mean of the sampled trajectories' deltas, divided by the expected count as the
//! engine does).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Parser;
use fedrl_common::privacy::ledger::Participation;
use fedrl_common::scenario::Task;
use fedrl_common::task::primorl::EnsembleClipping;
use fedrl_rl::candle_core::Device;
use fedrl_rl::ensemble::{Ensemble, EnsembleSpec, LocalModelConfig, ModelRows, local_updates};
use fedrl_rl::primorl::{ensemble_spec, local_config, private_rows, public_rows, trajectory_seed};

#[derive(Parser)]
struct Args {
    /// A `primorl` scenario file.
    scenario: PathBuf,
    /// Non-private, unclipped FedAvg rounds to run.
    #[arg(long, default_value_t = 400)]
    rounds: u64,
    /// Measure the norms every this many rounds (and before the first).
    #[arg(long, default_value_t = 100)]
    every: u64,
    /// Trajectories whose norms are measured at each checkpoint.
    #[arg(long, default_value_t = 200)]
    sample: usize,
    #[arg(long, default_value = "bench/results/primorl_clip.jsonl")]
    results: PathBuf,
}

/// The C at which `delta` is not clipped under `mode`.
fn needed_c(spec: &EnsembleSpec, mode: EnsembleClipping, delta: &[f32]) -> f64 {
    let norm = |s: &[f32]| s.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    let member = spec.member_len();
    match mode {
        EnsembleClipping::Flat => {
            let worst = delta.chunks(member).map(norm).fold(0.0, f64::max);
            worst * (spec.members as f64).sqrt()
        }
        EnsembleClipping::PerLayer => {
            let sizes = spec.layer_sizes();
            let mut worst: f64 = 0.0;
            for m in delta.chunks(member) {
                let mut start = 0;
                for &n in &sizes {
                    worst = worst.max(norm(&m[start..start + n]));
                    start += n;
                }
            }
            worst * ((spec.members * sizes.len()) as f64).sqrt()
        }
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() -> anyhow::Result<()> {
    fedrl_bench::train_like_fedrl();
    let args = Args::parse();
    let scenario = fedrl_tasks::scenario_from_file(&args.scenario)
        .with_context(|| format!("reading {}", args.scenario.display()))?;
    let Task::Primorl(task) = &scenario.task else {
        bail!("{}: not a primorl scenario", args.scenario.display());
    };
    let Participation::Sampled { rate } = scenario.participation else {
        bail!("primorl scenarios sample trajectories");
    };
    let rate = rate.get();
    let root = fedrl_rl::offline::data_root(None)?;
    eprintln!("loading (or generating) the dataset");
    let (data, private_units) = fedrl_rl::offline::continuous::load_source_units(
        &task.dataset,
        &root,
        &mut |_| {},
        &|_| true,
    )?;
    let spec = ensemble_spec(task, &data, private_units)?;
    let public = public_rows(&data, private_units, &spec)?;
    let private = private_rows(private_units, &spec, &data.episodes)?;
    drop(data);
    let units: Vec<(u64, ModelRows)> = private.into_iter().collect();
    let cfg = LocalModelConfig {
        clip_norm: f64::INFINITY,
        ..local_config(task, f64::INFINITY)
    };
    let device = Device::Cpu;
    let mut params = spec.init(task.model_seed);
    let expected = rate * units.len() as f64;
    // Fixed sampling rule (not privacy noise: nothing here is released).
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    if let Some(dir) = args.results.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.results)?;
    // The unclipped local updates of the units at `picks` from `params`.
    let updates = |picks: &[usize], round: u64, params: &[f32]| {
        let rows: Vec<&ModelRows> = picks.iter().map(|&i| &units[i].1).collect();
        let seeds: Vec<u64> = picks
            .iter()
            .map(|&i| trajectory_seed(task.data_seed, round, units[i].0))
            .collect();
        local_updates(&spec, &cfg, params, &rows, &seeds, &device, false).map(|(ups, _)| ups)
    };
    let started = std::time::Instant::now();
    for round in 0..=args.rounds {
        if round % args.every == 0 {
            let picks: Vec<usize> = (0..args.sample)
                .map(|_| (next() % units.len() as u64) as usize)
                .collect();
            let ups = updates(&picks, round, &params)?;
            let mut c: Vec<f64> = ups
                .iter()
                .map(|u| needed_c(&spec, task.ensemble.clipping, &u.delta))
                .collect();
            c.sort_by(f64::total_cmp);
            let mse = Ensemble::new(&spec, &params, &device)?.mse(&public)?;
            let line = serde_json::json!({
                "scenario": scenario.name,
                "round": round,
                "clipping": task.ensemble.clipping,
                "public_mse": mse,
                "c_needed": {
                    "p10": quantile(&c, 0.1), "p25": quantile(&c, 0.25), "p50": quantile(&c, 0.5),
                    "p75": quantile(&c, 0.75), "p90": quantile(&c, 0.9),
                },
                "seconds": started.elapsed().as_secs_f64(),
            });
            println!("{line}");
            writeln!(out, "{line}")?;
        }
        if round == args.rounds {
            break;
        }
        // One unclipped, noiseless round on a Poisson sample.
        let threshold = (rate * u64::MAX as f64) as u64;
        let picks: Vec<usize> = (0..units.len()).filter(|_| next() < threshold).collect();
        if picks.is_empty() {
            continue;
        }
        let ups = updates(&picks, round, &params)?;
        for u in &ups {
            for (p, d) in params.iter_mut().zip(&u.delta) {
                *p += d / expected as f32;
            }
        }
    }
    Ok(())
}
