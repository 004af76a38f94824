//! `fedrl eval --policy FILE --env ID [--episodes N] [--json]`: evaluates a saved policy.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use fedrl_common::device::DeviceSpec;
use fedrl_rl::{EvalConfig, evaluate, io, loglinear};
use fedrl_sim::Env;
use fedrl_sim::population::Population;

use super::UsageError;

#[derive(clap::Args)]
pub struct Args {
    /// A policy written by `fedrl run` (`policy.safetensors`).
    #[arg(long)]
    pub policy: PathBuf,
    /// Environment id (see `fedrl sim list`) or population name; with a population, episode i
    /// runs user `--first-user + i`.
    #[arg(long)]
    pub env: String,
    /// Number of episodes (each in its own environment instance, run as one batch).
    #[arg(long, default_value_t = 100)]
    pub episodes: u64,
    /// Seed of the first episode's reset (episode i uses seed + i).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Population seed (only for population names).
    #[arg(long, default_value_t = 0)]
    pub population_seed: u64,
    /// First user id for populations (choose ids outside the training users).
    #[arg(long, default_value_t = 1_000_000)]
    pub first_user: u64,
    /// Sample actions from the policy instead of acting greedily.
    #[arg(long)]
    pub stochastic: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Where the policy runs: `cpu` or `cuda:N` (needs a build with the `cuda` feature).
    #[arg(long, value_name = "cpu|cuda:N", default_value = "cpu")]
    pub device: DeviceSpec,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.episodes == 0 {
        return Err(UsageError("--episodes must be at least 1".into()).into());
    }
    let device = fedrl_rl::device::open(args.device).map_err(|e| UsageError(e.to_string()))?;
    if !args.policy.is_file() {
        return Err(UsageError(format!("no policy file at {}", args.policy.display())).into());
    }
    let bytes = std::fs::read(&args.policy)
        .with_context(|| format!("reading the policy {}", args.policy.display()))?;
    let population =
        Population::new(&args.env, args.population_seed).map_err(|e| UsageError(e.to_string()))?;
    let mut envs: Vec<Box<dyn Env>> = (0..args.episodes)
        .map(|i| population.user_env(args.first_user + i))
        .collect::<Result<_, _>>()?;
    let seeds: Vec<u64> = (0..args.episodes).map(|i| args.seed + i).collect();
    let started = std::time::Instant::now();
    // Two kinds of exported policy: the PPO MLP (`fedrl.model_spec`) and the log-linear
    // riverswim policy (`fedrl.loglinear_spec`).
    let returns: Vec<f64> = match io::from_bytes(&bytes) {
        Ok((spec, params)) => {
            let cfg = EvalConfig {
                episodes_per_env: 1,
                greedy: !args.stochastic,
                ..EvalConfig::default()
            };
            evaluate(&spec, &params, &mut envs, &seeds, &cfg, &device)
                .context("evaluating (does the policy match this environment's spaces?)")?
                .returns
        }
        Err(mlp_err) => {
            let (spec, params) = loglinear::from_bytes(&bytes).map_err(|_| {
                anyhow::anyhow!("reading the policy {}: {mlp_err}", args.policy.display())
            })?;
            envs.iter_mut()
                .zip(&seeds)
                .map(|(env, &seed)| {
                    loglinear::rollout(&spec, &params, env.as_mut(), seed, !args.stochastic)
                        .map(|ep| ep.total_reward())
                })
                .collect::<Result<_, _>>()
                .context("evaluating (does the policy match this environment's spaces?)")?
        }
    };
    let n = returns.len().max(1) as f64;
    let mean = returns.iter().sum::<f64>() / n;
    let std = (returns.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
    let r = Summary { returns, mean, std };
    let (min, max) = r
        .returns
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "policy": args.policy.display().to_string(),
                "env": args.env,
                "episodes": r.returns.len(),
                "mean_return": r.mean,
                "std_return": r.std,
                "min_return": min,
                "max_return": max,
                "greedy": !args.stochastic,
                "wall_seconds": started.elapsed().as_secs_f64(),
            })
        );
    } else {
        println!(
            "{} on {}: mean return {:.2} ± {:.2} over {} episodes (min {:.1}, max {:.1}; {})",
            args.policy.display(),
            args.env,
            r.mean,
            r.std,
            r.returns.len(),
            min,
            max,
            if args.stochastic {
                "sampled actions"
            } else {
                "greedy actions"
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Returns of the evaluated episodes, their mean and (population) standard deviation.
struct Summary {
    returns: Vec<f64>,
    mean: f64,
    std: f64,
}
