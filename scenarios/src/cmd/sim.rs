//! `fedrl sim ...`: exercise and validate the simulators of `fedrl-sim`.
//!
//! - `replay --trace FILE [--json]`: replays a reference trace file (Gymnasium, simglucose, HIV,
//!   Dosing, dm_control cart-pole; recognised from its contents) and reports per environment,
//!   patient or episode; exit code 1
//!   on any mismatch, 2 when the file cannot be read or recognised.
//! - `bench --env ID [--steps N]`: steps per second with uniformly random actions;
//!   `--env gymnasium:<id> [--module M]` steps it through one Gymnasium bridge worker (one
//!   message per step: the bridge's per-step cost; `bench/run_gym_bridge.sh` measures batches).
//! - `list [--json]`: environments and populations.

use std::hint::black_box;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use fedrl_sim::gym_bridge::{self, GymConfig, GymPool};
use fedrl_sim::np_rng::NpPcg64;
use fedrl_sim::replay::ReplayResult;
use fedrl_sim::{Action, Space};
use serde_json::json;

use crate::cmd::UsageError;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: SimCommand,
}

#[derive(clap::Subcommand)]
enum SimCommand {
    /// Replay a reference trace file and compare observations, rewards and flags.
    Replay(ReplayArgs),
    /// Measure steps per second of one environment with random actions.
    Bench(BenchArgs),
    /// List environments and user populations.
    List(ListArgs),
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// Trace file (JSON) from testdata/ or made the same way.
    #[arg(long)]
    trace: PathBuf,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Environment id (see `fedrl sim list`), or `gymnasium:<id>` for a Gymnasium environment
    /// stepped through one bridge worker.
    #[arg(long)]
    env: String,
    /// `gymnasium:<id>` only: a Python module imported before `gymnasium.make` (e.g. the one
    /// registering your own environment).
    #[arg(long)]
    module: Option<String>,
    /// Number of steps to time.
    #[arg(long, default_value_t = 1_000_000)]
    steps: u64,
    /// Seed of the first reset and of the random actions.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object instead of a line.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct ListArgs {
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        SimCommand::Replay(a) => replay(a),
        SimCommand::Bench(a) => bench(a),
        SimCommand::List(a) => list(a),
    }
}

fn replay(args: ReplayArgs) -> anyhow::Result<ExitCode> {
    let results = fedrl_sim::replay::replay_file(&args.trace).map_err(|e| {
        UsageError(format!(
            "cannot replay {}: {e}",
            args.trace.as_path().display()
        ))
    })?;
    let pass = !results.is_empty() && results.iter().all(|r| r.pass);
    if args.json {
        let out = json!({
            "trace": args.trace,
            "pass": pass,
            "results": results,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_replay_table(&results);
        println!(
            "{}: {} of {} passed",
            if pass { "PASS" } else { "FAIL" },
            results.iter().filter(|r| r.pass).count(),
            results.len()
        );
    }
    Ok(if pass {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn print_replay_table(results: &[ReplayResult]) {
    let width = results
        .iter()
        .map(|r| r.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    println!(
        "{:<width$}  {:>8}  {:>7}  {:>10}  {:>10}  {:<9}  {:>10}  {:>10}  result",
        "name", "episodes", "steps", "max error", "tolerance", "kind", "bad flags", "reward err"
    );
    for r in results {
        println!(
            "{:<width$}  {:>8}  {:>7}  {:>10.3e}  {:>10.1e}  {:<9}  {:>10}  {:>10.3e}  {}",
            r.name,
            r.episodes,
            r.steps,
            r.max_error,
            r.tolerance,
            r.error_kind,
            r.mismatched_flags,
            r.max_reward_error,
            if r.pass { "pass" } else { "FAIL" }
        );
    }
}

fn bench(args: BenchArgs) -> anyhow::Result<ExitCode> {
    if args.steps == 0 {
        return Err(UsageError("--steps must be at least 1".into()).into());
    }
    // A Gymnasium environment lives in a worker process that `_worker` owns until the end.
    let (_worker, mut env) = match gym_bridge::env_id_of(&args.env) {
        Some(id) => {
            let mut cfg = GymConfig::new(id);
            cfg.module = args.module.clone();
            let mut pool = GymPool::start(cfg, None)
                .with_context(|| format!("starting a Gymnasium worker for {id}"))?;
            let (groups, dropped) = pool.envs_for(&[0]);
            if let Some((_, why)) = dropped.first() {
                anyhow::bail!("{}: {why}", args.env);
            }
            let env = groups
                .into_iter()
                .flat_map(|g| g.envs)
                .next()
                .context("the worker made no environment")?;
            (Some(pool), env)
        }
        None => (
            None,
            fedrl_sim::make(&args.env).map_err(|e| UsageError(e.to_string()))?,
        ),
    };
    let mut obs = vec![0f32; env.observation_space().dim()];
    let action_space = env.action_space().clone();
    let mut rng = NpPcg64::from_seed(args.seed ^ 0x5eed);
    let mut u = vec![0f32; action_space.dim()];
    let mut episodes = 1u64;
    let mut episode_seed = args.seed;
    env.reset(episode_seed, &mut obs);
    let start = Instant::now();
    for _ in 0..args.steps {
        let action = match &action_space {
            Space::Discrete { n } => {
                Action::Discrete(((u128::from(rng.next_u64()) * (*n as u128)) >> 64) as usize)
            }
            Space::Box { low, high } => {
                for ((x, lo), hi) in u.iter_mut().zip(low).zip(high) {
                    let (lo, hi) = (clamp_finite(*lo), clamp_finite(*hi));
                    *x = lo + (hi - lo) * rng.next_f64() as f32;
                }
                Action::Continuous(&u)
            }
        };
        let step = env
            .step(action, &mut obs)
            .with_context(|| format!("{} step failed", args.env))?;
        if step.terminated || step.truncated {
            episodes += 1;
            episode_seed += 1;
            env.reset(episode_seed, &mut obs);
        }
        black_box(&obs);
    }
    let secs = start.elapsed().as_secs_f64();
    let rate = args.steps as f64 / secs;
    if args.json {
        let out = json!({
            "env": args.env,
            "steps": args.steps,
            "episodes": episodes,
            "seconds": secs,
            "steps_per_second": rate,
        });
        println!("{out}");
    } else {
        println!(
            "{}: {} steps ({} episodes) in {:.3} s = {:.0} steps/s",
            args.env, args.steps, episodes, secs, rate
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Random actions in an unbounded box are drawn from [-1, 1].
fn clamp_finite(v: f32) -> f32 {
    if v.is_finite() { v } else { v.signum() }
}

fn list(args: ListArgs) -> anyhow::Result<ExitCode> {
    let envs = fedrl_sim::list();
    let pops = fedrl_sim::population::list();
    if args.json {
        let out = json!({ "environments": envs, "populations": pops });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(ExitCode::SUCCESS);
    }
    let w = envs.iter().map(|e| e.id.len()).max().unwrap_or(2);
    println!("environments:");
    for e in &envs {
        println!(
            "  {:<w$}  {:>5} steps  {}",
            e.id, e.max_episode_steps, e.summary
        );
    }
    let w = pops.iter().map(|p| p.name.len()).max().unwrap_or(4);
    println!("populations (any environment id is also a homogeneous population):");
    for p in &pops {
        let settings = if p.settings == 0 {
            "continuous".to_string()
        } else {
            format!("{} settings", p.settings)
        };
        println!(
            "  {:<w$}  {:<18}  {:>13}  {}",
            p.name, p.env_id, settings, p.summary
        );
    }
    Ok(ExitCode::SUCCESS)
}
