//! Speed of PrivORL-j's trajectory synthesizer (seed 003, section VI;
//! `fedrl_rl::diffusion::trajectory`): fragment training steps per second and sampled
//! transitions per second, on Pendulum-shaped transitions (3 observations, 1 continuous action,
//! reward, next observation, terminal flag: 9 entries) in fragments of `H` transitions
//! conditioned on their link transition. The denoiser is the CPU default conditional residual
//! MLP (width 256, 4 blocks) or, with `--net transformer`, the paper's transformer (6 layers, 4
//! heads, width 256: meant for a GPU). The Heun sampler takes 128 steps (255 network calls per
//! fragment).
//!
//! ```text
//! cargo build --release -p fedrl-bench --bin privorl_traj
//! target/release/privorl_traj [--net mlp|transformer] [--horizon 64] [--steps 50] [--fragments 64]
//! ```
//!
//! One thread unless `RAYON_NUM_THREADS` says otherwise. Prints and appends one JSON line to
//! `bench/results/privorl_core.jsonl` (`"bench": "privorl_traj"`), in the style of
//! `privorl_core`: steps/s and transitions/s (wall), the process CPU seconds of each phase, and
//! the settings.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use fedrl_rl::diffusion::trajectory::{
    CondNet, FragmentNetConfig, Fragments, TrajectoryConfig, TrajectorySynthesizer,
    TransformerConfig,
};
use fedrl_rl::diffusion::{
    ActionCoding, Actions, DenoiserConfig, PublicRows, TransitionLayout, Transitions, Weights,
};

#[derive(Parser)]
struct Args {
    /// `mlp` (CPU default) or `transformer`.
    #[arg(long, default_value = "mlp")]
    net: String,
    /// Transitions per fragment.
    #[arg(long, default_value_t = 64)]
    horizon: usize,
    /// Timed training steps (after 3 warm-up steps).
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Fragments per training batch.
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Timed sampled fragments (one sampler call).
    #[arg(long, default_value_t = 64)]
    fragments: usize,
    #[arg(long, default_value_t = 256)]
    width: usize,
    /// `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long, default_value = "bench/results/privorl_core.jsonl")]
    results: PathBuf,
}

/// This process's user + system CPU time in seconds (Linux `/proc/self/stat`); `None` elsewhere.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// One smooth made-up Pendulum-shaped trajectory of `n` steps (phase `p`).
fn trajectory(n: usize, p: f32) -> Transitions {
    let (mut obs, mut next, mut acts) = (Vec::new(), Vec::new(), Vec::new());
    let state = |k: usize| {
        let th = p + k as f32 * 0.05;
        [th.cos(), th.sin(), 0.3 * (2.0 * th).sin()]
    };
    for k in 0..n {
        obs.extend(state(k));
        next.extend(state(k + 1));
        acts.push((0.1 * k as f32 + p).sin() * 2.0);
    }
    Transitions {
        obs_dim: 3,
        rewards: obs.chunks(3).map(|s| -(1.0 - s[0])).collect(),
        obs,
        actions: Actions::Continuous {
            dim: 1,
            values: acts,
        },
        next_obs: next,
        terminals: (0..n).map(|k| f32::from(k + 1 == n)).collect(),
    }
}

fn main() -> anyhow::Result<()> {
    fedrl_bench::train_like_fedrl();
    let args = Args::parse();
    let spec: fedrl_common::device::DeviceSpec = args.device.parse()?;
    let device = fedrl_rl::device::open(spec)?;
    let layout = TransitionLayout {
        obs_dim: 3,
        action: ActionCoding::Continuous { dim: 1 },
        model_terminal: true,
    };
    let trajs: Vec<Transitions> = (0..40).map(|i| trajectory(200, i as f32 * 0.15)).collect();
    let mut public = Vec::new();
    for t in &trajs {
        public.extend(layout.encode(t)?);
    }
    let public = PublicRows::new(layout.dim(), public)?;
    let net = match args.net.as_str() {
        "mlp" => FragmentNetConfig::Mlp(DenoiserConfig {
            width: args.width,
            ..DenoiserConfig::default()
        }),
        "transformer" => FragmentNetConfig::Transformer(TransformerConfig {
            width: args.width,
            ..TransformerConfig::default()
        }),
        other => anyhow::bail!("--net must be mlp or transformer, got {other}"),
    };
    let cfg = TrajectoryConfig {
        horizon: args.horizon,
        net,
        ..TrajectoryConfig::default()
    };
    let mut synth = TrajectorySynthesizer::new(layout, &public, cfg, 1, &device)?;
    let mut all = Fragments::empty(layout.dim(), args.horizon);
    for t in &trajs {
        all.extend(&synth.fragments(t)?)?;
    }
    let n = all.len();
    let b = args.batch;
    let model = synth.model_mut();
    let mut step = |k: usize| -> anyhow::Result<f32> {
        let idx: Vec<usize> = (0..b).map(|j| (k * b + j) % n).collect();
        let batch = all.select(&idx);
        Ok(model.train_step(&batch.x, &batch.cond)?)
    };
    for k in 0..3 {
        step(k)?;
    }
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let mut last = 0.0;
    for k in 0..args.steps {
        last = step(k)?;
    }
    let train_wall = t0.elapsed().as_secs_f64();
    let train_cpu = cpu_seconds().zip(c0).map(|(a, b)| a - b);
    // Conditions: half first fragments, half links from the data.
    let d = layout.dim();
    let mut cond = Vec::with_capacity(args.fragments * (d + 1));
    for i in 0..args.fragments {
        if i % 2 == 0 {
            cond.extend(std::iter::repeat_n(0.0, d + 1));
        } else {
            cond.extend_from_slice(all.cond_row(i % n));
        }
    }
    let (t1, c1) = (Instant::now(), cpu_seconds());
    let out = synth.model_mut().sample_normalized(&cond, Weights::Ema)?;
    let sample_wall = t1.elapsed().as_secs_f64();
    let sample_cpu = cpu_seconds().zip(c1).map(|(a, b)| a - b);
    anyhow::ensure!(
        out.len() == args.fragments * args.horizon * d,
        "sampled {} values",
        out.len()
    );
    let transitions = (args.fragments * args.horizon) as f64;
    let line = serde_json::json!({
        "bench": "privorl_traj",
        "device": args.device,
        "threads": std::env::var("RAYON_NUM_THREADS").unwrap_or_default(),
        "net": args.net,
        "width": args.width,
        "params": synth.model().net().num_params(),
        "horizon": args.horizon,
        "transition_dim": d,
        "batch_fragments": b,
        "train_steps": args.steps,
        "train_steps_per_s": args.steps as f64 / train_wall,
        "train_cpu_s": train_cpu,
        "last_loss": last,
        "sample_steps": synth.model().edm().sample_steps,
        "sampled_fragments": args.fragments,
        "sampled_transitions_per_s": transitions / sample_wall,
        "sample_cpu_s": sample_cpu,
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
