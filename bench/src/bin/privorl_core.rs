//! Speed of PrivORL-n's diffusion synthesizer (seed 003; `fedrl_rl::diffusion`): denoiser
//! training steps per second and sampled transitions per second, at the CPU default size (width
//! 256, 4 residual blocks) on CartPole-shaped transitions (4 observations, 2 one-hot actions,
//! reward, next observation, terminal flag: 12 entries), batches of 128 (PrivORL's), the Heun
//! sampler with 128 steps (255 network calls per sample).
//!
//! ```text
//! cargo build --release -p fedrl-bench --bin privorl_core
//! target/release/privorl_core [--steps 200] [--samples 2000] [--device cpu]
//! ```
//!
//! One thread unless `RAYON_NUM_THREADS` says otherwise (as `fedrl` runs). Prints and appends
//! one JSON line to `bench/results/privorl_core.jsonl`: steps/s and transitions/s (wall), the
//! process CPU seconds of each phase (meaningful when other jobs share the machine), and the
//! settings and the 1-minute load average at the start. `--samples 0` times training only.
//! The PyTorch peer of the same network and sampler is `bench/peers/synther_peer.py`;
//! `bench/run_privorl_peer.sh` runs both, interleaved.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use fedrl_rl::diffusion::{
    ActionCoding, Actions, DenoiserConfig, PublicRows, SynthesizerConfig, TransitionLayout,
    TransitionSynthesizer, Transitions, Weights,
};

#[derive(Parser)]
struct Args {
    /// Timed training steps (after 5 warm-up steps).
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Timed samples (after a warm-up of 100); 0: no sampling.
    #[arg(long, default_value_t = 2000)]
    samples: usize,
    /// Rows per sampler call.
    #[arg(long, default_value_t = 2000)]
    sample_chunk: usize,
    #[arg(long, default_value_t = 256)]
    width: usize,
    #[arg(long, default_value_t = 4)]
    blocks: usize,
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long, default_value = "bench/results/privorl_core.jsonl")]
    results: PathBuf,
    /// Instead of timing: write the initial flat weights (PyTorch layout and names), the
    /// Fourier frequencies, a few rows with their noise levels and noise, and fedrl's EDM
    /// outputs for them (`F(x, c_noise)`, `D(x, sigma)`, the per-row losses) as JSON, for
    /// `synther_peer.py --check` to recompute in PyTorch.
    #[arg(long)]
    dump: Option<PathBuf>,
}

/// The `--dump` reference: fedrl's outputs on `rows` (normalised, `[b, d]`) under the initial
/// weights of a denoiser for `d` values.
fn dump_reference(
    path: &std::path::Path,
    model: &fedrl_rl::diffusion::DiffusionModel,
    rows: &[f32],
    d: usize,
) -> anyhow::Result<()> {
    use fedrl_rl::candle_core::Tensor;
    use fedrl_rl::diffusion::edm;
    let b = rows.len() / d;
    let net = model.denoiser();
    let cfg = &model.config().edm;
    let dev = net.device();
    let params = model.online_params();
    let sigmas: Vec<f64> = (0..b).map(|i| 0.002 * 3f64.powi(i as i32)).collect();
    let noise: Vec<f32> = (0..b * d).map(|k| ((k as f32) * 0.618).sin()).collect();
    let x = Tensor::from_slice(rows, (b, d), dev)?;
    let t: Vec<f32> = sigmas
        .iter()
        .map(|&s| cfg.precond(s).c_noise as f32)
        .collect();
    let f = net.forward(&params, &x, &Tensor::from_slice(&t, b, dev)?)?;
    let den = edm::denoise(cfg, net, &params, &x, &sigmas)?;
    let n = Tensor::from_slice(&noise, (b, d), dev)?;
    let loss = edm::per_example_loss(cfg, net, &params, &x, &sigmas, &n)?;
    let names: Vec<_> = net
        .spec()
        .param_shapes()
        .into_iter()
        .map(|p| serde_json::json!({"name": p.name, "shape": p.shape}))
        .collect();
    let j = serde_json::json!({
        "params": names,
        "flat": model.online_flat()?,
        "freqs": net.freqs()?,
        "rows": rows, "data_dim": d, "sigmas": sigmas, "noise": noise, "c_noise": t,
        "net_out": f.flatten_all()?.to_vec1::<f32>()?,
        "denoised": den.flatten_all()?.to_vec1::<f32>()?,
        "losses": loss.to_vec1::<f32>()?,
    });
    std::fs::write(path, j.to_string()).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// This process's user + system CPU time in seconds (Linux `/proc/self/stat`); `None` elsewhere.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Smooth made-up CartPole-shaped transitions.
fn transitions(n: usize) -> Transitions {
    let mut obs = Vec::with_capacity(4 * n);
    let mut next = Vec::with_capacity(4 * n);
    for i in 0..n {
        let x = i as f32 * 0.013;
        let s = [
            x.sin() * 0.5,
            x.cos(),
            (2.0 * x).sin() * 0.1,
            (0.7 * x).cos() * 0.8,
        ];
        obs.extend_from_slice(&s);
        next.extend(
            s.iter()
                .enumerate()
                .map(|(j, v)| v + 0.02 * (j as f32 - 1.5)),
        );
    }
    Transitions {
        obs_dim: 4,
        obs,
        actions: Actions::Discrete((0..n).map(|i| (i % 3 == 0) as u32).collect()),
        rewards: vec![1.0; n],
        next_obs: next,
        terminals: (0..n).map(|i| f32::from(i % 50 == 49)).collect(),
    }
}

fn main() -> anyhow::Result<()> {
    fedrl_bench::train_like_fedrl();
    let args = Args::parse();
    let load_avg: Option<f64> = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split(' ').next()?.parse().ok());
    let spec: fedrl_common::device::DeviceSpec = args.device.parse()?;
    let device = fedrl_rl::device::open(spec)?;
    let layout = TransitionLayout {
        obs_dim: 4,
        action: ActionCoding::Discrete { n: 2 },
        model_terminal: true,
    };
    let data = transitions(10_000);
    let public = PublicRows::new(layout.dim(), layout.encode(&data)?)?;
    let mut cfg = SynthesizerConfig {
        denoiser: DenoiserConfig {
            width: args.width,
            blocks: args.blocks,
            ..DenoiserConfig::default()
        },
        ..SynthesizerConfig::default()
    };
    cfg.train.batch_size = args.batch;
    cfg.train.sample_chunk = args.sample_chunk;
    let mut synth = TransitionSynthesizer::new(layout, &public, cfg, 1, &device)?;
    let rows = synth.encode_public(&public)?;
    let d = layout.dim();
    let n = rows.len() / d;
    let b = args.batch.min(n);
    if let Some(path) = &args.dump {
        return dump_reference(path, synth.model(), &rows[..8 * d], d);
    }
    let model = synth.model_mut();
    let mut step = |k: usize| -> anyhow::Result<f32> {
        let at = (k * b) % (n - b + 1);
        Ok(model.train_step(&rows[at * d..(at + b) * d])?)
    };
    for k in 0..5 {
        step(k)?;
    }
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let mut last = 0.0;
    for k in 0..args.steps {
        last = step(k)?;
    }
    let train_wall = t0.elapsed().as_secs_f64();
    let train_cpu = cpu_seconds().zip(c0).map(|(a, b)| a - b);
    let (mut sample_wall, mut sample_cpu) = (f64::NAN, None);
    if args.samples > 0 {
        synth.model_mut().sample_normalized(100, Weights::Ema)?;
        let (t1, c1) = (Instant::now(), cpu_seconds());
        let out = synth.sample(args.samples)?;
        sample_wall = t1.elapsed().as_secs_f64();
        sample_cpu = cpu_seconds().zip(c1).map(|(a, b)| a - b);
        anyhow::ensure!(out.len() == args.samples, "sampled {} rows", out.len());
    }
    let line = serde_json::json!({
        "bench": "privorl_core",
        "device": args.device,
        "threads": std::env::var("RAYON_NUM_THREADS").unwrap_or_default(),
        "width": args.width,
        "blocks": args.blocks,
        "params": synth.model().denoiser().spec().num_params(),
        "data_dim": d,
        "batch": b,
        "train_steps": args.steps,
        "train_steps_per_s": args.steps as f64 / train_wall,
        "train_cpu_s": train_cpu,
        "last_loss": last,
        "sample_steps": synth.model().config().edm.sample_steps,
        "samples": args.samples,
        "sample_chunk": args.sample_chunk,
        "sampled_transitions_per_s": (args.samples > 0).then(|| args.samples as f64 / sample_wall),
        "sample_cpu_s": sample_cpu,
        "load_avg_1m": load_avg,
        "peer": serde_json::Value::Null,
    });
    println!("{line}");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.results)
        .with_context(|| format!("opening {}", args.results.display()))?;
    writeln!(f, "{line}")?;
    Ok(())
}
