//! Re-runs PriMORL's policy phase (seed 001, Algorithm 4) on an ensemble a finished run
//! released (`<run>/ensemble.safetensors`), with the scenario's policy settings or overrides.
//! The policy phase is post-processing of the released model: it reads no dataset and costs no
//! privacy, so a longer SAC run or another penalty can be tried without paying the model phase
//! (35 minutes for cart-pole balance) again. MOPO's real-data minibatches and data-branched
//! rollouts need the dataset: on a MOPO run's (non-private) ensemble the re-run is model-only,
//! like the No Privacy variant, unless `--real` loads the dataset (from `$FEDRL_DATA_DIR`).
//! A scenario's `public_start_fraction` (or `--public-starts F`, any run) reads only the
//! dataset's public split, to branch rollouts from its states.
//!
//! ```text
//! cargo build --release -p fedrl-bench --bin primorl_policy
//! target/release/primorl_policy runs/primorl/balance-primorl-c1.0-e15-s0 [--epochs 50]
//!     [--lambda 1.0] [--rollout-length 20] [--start-fraction 0.5] [--seed 0]
//!     [--target-entropy -1] [--learned-units] [--public-starts 0.5]
//!     [--real [--real-ratio 0.05] [--data-start-fraction 1.0]] [--results bench/results/primorl_policy.jsonl]
//! ```
//!
//! Appends one JSON line per run: the run directory, the settings, and the normalised return
//! after every SAC epoch.

use std::io::Write;
use std::path::PathBuf;

use clap::Parser;
use fedrl_rl::candle_core::Device;
use fedrl_rl::primorl::{PolicyData, policy_phase};

#[derive(Parser)]
struct Args {
    /// Output directory of a finished private `primorl` run (holds `scenario.toml` and
    /// `ensemble.safetensors`).
    run: PathBuf,
    /// SAC epochs (each the scenario's `updates_per_epoch` updates); default the scenario's.
    #[arg(long)]
    epochs: Option<usize>,
    /// Weight of the uncertainty penalty in the model reward `r - lambda u`; default the
    /// scenario's.
    #[arg(long)]
    lambda: Option<f64>,
    /// Model rollout length H in steps; default the scenario's.
    #[arg(long)]
    rollout_length: Option<usize>,
    /// Fraction of rollouts started from states the model generated earlier; default the
    /// scenario's.
    #[arg(long)]
    start_fraction: Option<f64>,
    /// A MOPO run only: load the dataset and keep the scenario's real-data settings (real
    /// transitions in each minibatch, rollouts branched from dataset states).
    #[arg(long)]
    real: bool,
    /// With `--real`: fraction of each SAC minibatch from the real transitions; default the
    /// scenario's.
    #[arg(long, requires = "real")]
    real_ratio: Option<f64>,
    /// With `--real`: fraction of rollouts branched from dataset states; default the scenario's.
    #[arg(long, requires = "real")]
    data_start_fraction: Option<f64>,
    /// Any run: branch this fraction of the rollouts (of those not branched from the dataset)
    /// from states of the dataset's public split (the 1% that belongs to no privacy unit and
    /// already sets the ensemble's input normalisation), never from the private part; no real
    /// transitions enter the minibatches. Default the scenario's `public_start_fraction`.
    #[arg(long)]
    public_starts: Option<f64>,
    /// Target entropy of SAC's automatic temperature; default the scenario's.
    #[arg(long, allow_hyphen_values = true)]
    target_entropy: Option<f64>,
    /// Take the uncertainty `u` in the units a normalised-target ensemble learns instead of raw
    /// units (the scenario's `uncertainty_in_learned_units`).
    #[arg(long)]
    learned_units: bool,
    /// Seed of SAC and of the rollouts' start states; default the scenario's.
    #[arg(long)]
    seed: Option<u64>,
    /// After training, print one real episode in blocks of this many steps: the mean reward and
    /// the last observation of each block (0: no trace).
    #[arg(long, default_value_t = 0)]
    trace_block: usize,
    #[arg(long, default_value = "bench/results/primorl_policy.jsonl")]
    results: PathBuf,
}

fn main() -> anyhow::Result<()> {
    fedrl_bench::train_like_fedrl();
    let args = Args::parse();
    let run = fedrl_bench::load_primorl_run(&args.run)?;
    let task = &run.task;
    let mut cfg = task.policy.clone();
    if let Some(r) = args.real_ratio {
        cfg.real_ratio = r;
    }
    if let Some(f) = args.data_start_fraction {
        cfg.data_start_fraction = f;
    }
    if let Some(f) = args.public_starts {
        anyhow::ensure!(
            (0.0..=1.0).contains(&f),
            "--public-starts {f}: a fraction in [0, 1]"
        );
        cfg.public_start_fraction = f;
    }
    if !args.real && cfg.reads_data() {
        eprintln!(
            "{}: MOPO's real-data minibatches and data-branched rollouts need the dataset (--real); this re-run is model-only",
            run.name
        );
        cfg.real_ratio = 0.0;
        cfg.data_start_fraction = 0.0;
    }
    anyhow::ensure!(
        !args.real || run.non_private,
        "{}: --real reads the dataset, which only a non-private (MOPO) run may do",
        run.name
    );
    // The dataset (from $FEDRL_DATA_DIR), only when the real transitions or the public split's
    // start states are needed.
    let data = if args.real || cfg.public_start_fraction > 0.0 {
        let root = fedrl_rl::offline::data_root(None)?;
        let (dataset, private_units) = fedrl_rl::offline::continuous::load_source_units(
            &task.dataset,
            &root,
            &mut |_| {},
            &|_| args.real,
        )?;
        PolicyData::from_dataset(&cfg, &dataset, private_units, args.real)?
    } else {
        PolicyData::default()
    };
    if let Some(e) = args.epochs {
        cfg.epochs = e;
    }
    if let Some(l) = args.lambda {
        cfg.lambda = l;
    }
    if let Some(h) = args.rollout_length {
        cfg.rollout_length = h;
    }
    if let Some(f) = args.start_fraction {
        cfg.model_start_fraction = f;
    }
    if let Some(s) = args.seed {
        cfg.seed = s;
    }
    if let Some(h) = args.target_entropy {
        cfg.target_entropy = h;
    }
    cfg.uncertainty_in_learned_units |= args.learned_units;
    let device = Device::Cpu;
    let env_id = fedrl_rl::offline::continuous::source_env(
        &task.dataset,
        &fedrl_rl::offline::data_root(None)?,
    )?;
    if let Some(dir) = args.results.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let (mut agent, curve) = policy_phase(
        &run.ensemble,
        &env_id,
        &cfg,
        data.starts(),
        &device,
        &mut |e| {
            eprintln!(
                "SAC epoch {:>3}/{}: normalised {:7.1}, model reward {:6.3}, penalty {:6.3}, {:.0} s",
                e.epoch, cfg.epochs, e.normalized_return, e.model_reward, e.penalty, e.seconds
            );
        },
    )?;
    if args.trace_block > 0 {
        let mut env = fedrl_sim::make(&env_id)?;
        let mut obs = vec![0.0f32; env.observation_space().dim()];
        env.reset(cfg.seed, &mut obs);
        let (mut t, mut block) = (0usize, 0.0f64);
        loop {
            let a = agent.act(&obs, true)?;
            let mut next = vec![0.0f32; obs.len()];
            let step = env.step(fedrl_sim::Action::Continuous(&a), &mut next)?;
            obs = next;
            block += step.reward;
            t += 1;
            let done = step.terminated || step.truncated;
            if t % args.trace_block == 0 || done {
                eprintln!(
                    "steps {:>5}: mean reward {:.3}, observation {:?}",
                    t,
                    block / ((t - 1) % args.trace_block + 1) as f64,
                    obs
                );
                block = 0.0;
            }
            if done {
                break;
            }
        }
    }
    let line = serde_json::json!({
        "run": args.run,
        "scenario": run.name,
        "epochs": cfg.epochs,
        "lambda": cfg.lambda,
        "rollout_length": cfg.rollout_length,
        "model_start_fraction": cfg.model_start_fraction,
        "real_ratio": cfg.real_ratio,
        "data_start_fraction": cfg.data_start_fraction,
        "public_start_fraction": cfg.public_start_fraction,
        // Whether --public-starts overrode the scenario's fraction (rows before the setting
        // existed carried the fraction in data_start_fraction with this flag set).
        "public_starts": args.public_starts.is_some(),
        "seed": cfg.seed,
        "target_entropy": cfg.target_entropy,
        "uncertainty_in_learned_units": cfg.uncertainty_in_learned_units,
        "final_normalized_return": curve.last().map(|e| e.normalized_return),
        "curve": curve.iter().map(|e| (e.epoch, e.normalized_return)).collect::<Vec<_>>(),
        // Per epoch, the mean model reward before the penalty per rollout step (reward units):
        // near 1 on balance means the model believes the policy keeps the pole up.
        "model_reward": curve.iter().map(|e| e.model_reward).collect::<Vec<_>>(),
        "seconds": curve.last().map(|e| e.seconds),
    });
    println!("{line}");
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.results)?;
    writeln!(out, "{line}")?;
    Ok(())
}
