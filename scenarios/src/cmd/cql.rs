//! `fedrl cql DATASET`: the non-private discrete CQL baseline on an offline dataset (minibatch
//! Adam on the whole dataset, no clipping, no noise), evaluated greedily in the simulator. It is
//! the reference a private run is compared with, and what `bench/run_offline_cql.sh` measures
//! against d3rlpy's `DiscreteCQL` on the same Minari files.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use fedrl_common::offline::CqlConfig;
use fedrl_rl::candle_core::Device;
use fedrl_rl::offline::{QNetSpec, evaluate_greedy, minari, train_cql};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::cmd::UsageError;
use crate::cmd::data::{RootArg, locate};

#[derive(clap::Args)]
pub struct Args {
    /// A dataset id under the root, or a dataset folder (the one holding `data/`).
    dataset: String,
    #[command(flatten)]
    root: RootArg,
    /// Gradient steps. Default 10000.
    #[arg(long, default_value_t = 10_000)]
    steps: u64,
    /// Seed of the minibatches (the network's initialisation is `--model-seed`). Default 0.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seed of the Q-network's initial weights. Default: `--seed`.
    #[arg(long)]
    model_seed: Option<u64>,
    /// Greedy evaluation episodes after training. Default 100.
    #[arg(long, default_value_t = 100)]
    eval_episodes: usize,
    /// Environment to evaluate in. Default: the dataset's.
    #[arg(long)]
    env: Option<String>,
    /// Hidden widths, comma-separated. Default 256,256 (d3rlpy's).
    #[arg(long, value_delimiter = ',')]
    hidden: Option<Vec<usize>>,
    /// Adam learning rate. Default 6.25e-5 (d3rlpy's).
    #[arg(long)]
    lr: Option<f64>,
    /// Minibatch size. Default 32 (d3rlpy's).
    #[arg(long)]
    batch_size: Option<usize>,
    /// CQL(H) weight. Default 1.
    #[arg(long)]
    alpha: Option<f64>,
    /// Steps between target copies. Default 8000 (d3rlpy's).
    #[arg(long)]
    target_update_interval: Option<u64>,
    /// Factor the rewards are multiplied by in the TD target (a public constant; HIV treatment's
    /// rewards reach 1e6 per step, its expert scenarios use 1e-4). Default 1.
    #[arg(long)]
    reward_scale: Option<f64>,
    /// Discount factor. Default 0.99.
    #[arg(long)]
    gamma: Option<f64>,
    /// Write the trained Q-network here (safetensors).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let wall = Instant::now();
    let dir = locate(&a.dataset, &a.root)?;
    let read = minari::read(&dir).with_context(|| format!("reading {}", dir.display()))?;
    let d = read.dataset;
    let env = a.env.clone().unwrap_or_else(|| d.env_id.clone());
    if env.is_empty() {
        return Err(UsageError(format!(
            "{} names no environment to evaluate in: pass --env",
            dir.display()
        ))
        .into());
    }
    let defaults = CqlConfig::default();
    let cfg = CqlConfig {
        hidden: a.hidden.clone().unwrap_or(defaults.hidden),
        learning_rate: a.lr.unwrap_or(defaults.learning_rate),
        batch_size: a.batch_size.unwrap_or(defaults.batch_size),
        alpha: a.alpha.unwrap_or(defaults.alpha),
        target_update_interval: a
            .target_update_interval
            .unwrap_or(defaults.target_update_interval),
        model_seed: a.model_seed.unwrap_or(a.seed),
        reward_scale: a.reward_scale.unwrap_or(defaults.reward_scale),
        gamma: a.gamma.unwrap_or(defaults.gamma),
        ..defaults
    };
    let spec = QNetSpec {
        obs_dim: d.obs_dim,
        hidden: cfg.hidden.clone(),
        n_actions: d.n_actions,
    };
    let data = d.transitions();
    let bar = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(a.steps)
    };
    bar.set_style(
        ProgressStyle::with_template("{msg:>14} [{bar:40}] {pos}/{len} {elapsed}<{eta}")
            .map_err(|e| anyhow::anyhow!("progress template: {e}"))?
            .progress_chars("=> "),
    );
    let t = Instant::now();
    let params = train_cql(
        &spec,
        &cfg,
        &data,
        a.steps,
        a.seed,
        &Device::Cpu,
        &mut |step, loss| {
            if step % 100 == 0 {
                bar.set_position(step);
                bar.set_message(format!("loss {loss:.4}"));
            }
        },
    )?;
    let train_s = t.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let eval = evaluate_greedy(&spec, &params, &env, a.eval_episodes, 0xE7A1 ^ a.seed)?;
    if let Some(out) = &a.out {
        spec.save(out, &params)?;
    }
    let result = json!({
        "dataset": d.id,
        "env": env,
        "transitions": data.len(),
        "steps": a.steps,
        "seed": a.seed,
        "return_mean": eval.mean,
        "return_std": eval.std,
        "eval_episodes": eval.returns.len(),
        "train_s": train_s,
        "wall_s": wall.elapsed().as_secs_f64(),
    });
    if a.json {
        println!("{result}");
    } else {
        println!(
            "{}: {} steps on {} transitions in {train_s:.1} s; greedy return {:.1} ± {:.1} (standard deviation) over {} episodes of {env}",
            d.id,
            a.steps,
            data.len(),
            eval.mean,
            eval.std,
            eval.returns.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}
