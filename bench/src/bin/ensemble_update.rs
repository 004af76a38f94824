//! Speed of PriMORL's per-trajectory ensemble update (seed 001, `EnsClipGD`): the fused CPU loop
//! that `fedrl_rl::ensemble::local_updates` runs on the CPU against the batched tensor path
//! (`local_updates_on_tensors`), on one client's share of a swing-up round: 15 trajectories of
//! 1,000 rows, a 5 x [128, 128] ensemble, minibatches of 16, one epoch, flat clip 0.5.
//!
//! ```text
//! cargo build --release -p fedrl-bench --bin ensemble_update
//! target/release/ensemble_update [--reps 3]          # one thread, as `fedrl` runs
//! RAYON_NUM_THREADS=2 target/release/ensemble_update  # members in parallel on 2 threads
//! ```
//!
//! Both paths train the same copies (the test `fused_cpu_update_equals_the_tensor_path_*`).
//! Prints and appends one JSON line per path to `bench/results/ensemble_update.jsonl`: wall
//! seconds and process CPU seconds per call (CPU time stays meaningful when other jobs share the
//! machine), and the fused path's speed-up in both.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use fedrl_common::task::primorl::EnsembleClipping;
use fedrl_rl::candle_core::Device;
use fedrl_rl::ensemble::{
    EnsembleSpec, LocalModelConfig, ModelRows, local_updates, local_updates_on_tensors,
};

#[derive(Parser)]
struct Args {
    /// Calls of each path (after one warm-up call each).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Trajectories per call.
    #[arg(long, default_value_t = 15)]
    trajectories: usize,
    /// Rows per trajectory.
    #[arg(long, default_value_t = 1000)]
    rows: usize,
    #[arg(long, default_value = "bench/results/ensemble_update.jsonl")]
    results: PathBuf,
}

/// This process's user + system CPU time in seconds (Linux `/proc/self/stat`, clock ticks of
/// 1/100 s); `None` elsewhere.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Smooth made-up transitions with cart-pole's shapes (5 observations, 1 action).
fn trajectory(spec: &EnsembleSpec, rows: usize, seed: u64) -> anyhow::Result<ModelRows> {
    let mut x = seed as f32 * 0.37;
    let (mut obs, mut act, mut rew, mut next) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for t in 0..rows {
        let s: Vec<f32> = (0..spec.obs_dim)
            .map(|j| (x + j as f32 * 0.7).sin())
            .collect();
        let a = (x * 1.3 + t as f32 * 0.01).cos();
        x += 0.05;
        let s2: Vec<f32> = s
            .iter()
            .enumerate()
            .map(|(j, v)| v + 0.01 * a * (j as f32 + 1.0))
            .collect();
        rew.push(s[0] * s[0] - 0.1 * a * a);
        obs.extend_from_slice(&s);
        act.push(a);
        next.extend_from_slice(&s2);
    }
    Ok(ModelRows::from_transitions(spec, &obs, &act, &rew, &next)?)
}

fn main() -> anyhow::Result<()> {
    fedrl_bench::train_like_fedrl();
    let args = Args::parse();
    let spec = EnsembleSpec::new(5, 1, vec![128, 128], 5);
    let cfg = LocalModelConfig {
        epochs: 1,
        batch_size: 16,
        lr: 0.01,
        weight_decay: 5e-5,
        clip_norm: 0.5,
        clipping: EnsembleClipping::Flat,
    };
    let global = spec.init(1);
    let trajs: Vec<ModelRows> = (0..args.trajectories)
        .map(|k| trajectory(&spec, args.rows, k as u64))
        .collect::<anyhow::Result<_>>()?;
    let refs: Vec<&ModelRows> = trajs.iter().collect();
    let seeds: Vec<u64> = (0..args.trajectories as u64).collect();
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_default();
    let dev = Device::Cpu;
    let mut rows = Vec::new();
    for path in ["tensor", "fused"] {
        let call = || -> anyhow::Result<()> {
            let f = if path == "fused" {
                local_updates
            } else {
                local_updates_on_tensors
            };
            f(&spec, &cfg, &global, &refs, &seeds, &dev, false)?;
            Ok(())
        };
        call()?;
        let (t0, c0) = (Instant::now(), cpu_seconds());
        for _ in 0..args.reps {
            call()?;
        }
        let wall = t0.elapsed().as_secs_f64() / args.reps as f64;
        let cpu = match (c0, cpu_seconds()) {
            (Some(a), Some(b)) => Some((b - a) / args.reps as f64),
            _ => None,
        };
        rows.push((path, wall, cpu));
    }
    let (_, tw, tc) = rows[0];
    let (_, fw, fc) = rows[1];
    let speedup_cpu = match (tc, fc) {
        (Some(t), Some(f)) if f > 0.0 => Some(t / f),
        _ => None,
    };
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.results)
        .with_context(|| format!("opening {}", args.results.display()))?;
    for (path, wall, cpu) in &rows {
        let line = serde_json::json!({
            "path": path,
            "threads": threads,
            "trajectories": args.trajectories,
            "rows": args.rows,
            "reps": args.reps,
            "wall_s": wall,
            "cpu_s": cpu,
            "speedup_wall": tw / fw,
            "speedup_cpu": speedup_cpu,
        });
        println!("{line}");
        writeln!(out, "{line}")?;
    }
    Ok(())
}
