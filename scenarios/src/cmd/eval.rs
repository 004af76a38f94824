//! `fedrl eval RUN_DIR` or `fedrl eval --policy FILE --env ID [--episodes N] [--json]`:
//! evaluates a saved policy (the PPO MLP `policy.safetensors`, the log-linear riverswim
//! policy, or offline CQL's greedy `q_network.safetensors`). Given a `fedrl run` output
//! directory it reads the run's stored `scenario.toml` and its exported policy, and evaluates
//! behind the run's own environment and pump settings (population, population seed,
//! `low_risk_weight`, `decision_min`, `low_glucose_suspend`, `iob_limit`,
//! `sensitivity_scaling`), so none has to be retyped. On glucose simulators (UVA/Padova,
//! Dosing) it also prints the clinical table of the evaluated patient-days (time in range,
//! hypo- and hyperglycaemia, LBGI/HBGI, per age group when there are several, spread and worst
//! patient), and puts the full clinical report under `clinical` with --json.
//!
//! Seeds (`--seed S`): a PPO policy's episode i resets its environment with `mix(S + i, 0)`
//! ([`fedrl_rl::rollout::mix`], SplitMix64), an offline CQL Q-network's with `mix(S, i)`, a
//! log-linear policy's with `S + i`: each as the task's own evaluations seed theirs.
//!
//! `--env gymnasium:<id> --scenario FILE` (or a RUN_DIR of such a run) evaluates in Gymnasium
//! environments made by the bridge's Python workers (this process starts and owns the workers;
//! they end with it): a DPPG scenario's users as its `[task.gymnasium]` table makes them, or,
//! for an offline CQL scenario whose dataset was recorded in `gymnasium:<id>`, the dataset's
//! default environment (`[task.dataset.gymnasium]`), where its Q-network acts greedily. Without
//! the bridge's interpreter it fails naming the script that installs it.
//!
//! `--deferred STATE_DIR --scenario FILE [--set K=V ...]` completes a standalone
//! `fedrl aggregator`'s run evaluated in Gymnasium environments (a `gymnasium:<id>` DPPG
//! population, offline CQL on a Gymnasium dataset): the aggregator runs no Python, so it kept the
//! models it would have evaluated and left their evaluations `{"deferred": true}`; this
//! evaluates them through the bridge on the episodes the aggregator would have played, fills the
//! rows, exports the model the aggregator would select and writes the final evaluation into the
//! report, as `fedrl run` does after its own aggregator ends
//! ([`crate::deferred_eval::complete_state_dir`]).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use fedrl_common::device::DeviceSpec;
use fedrl_common::offline::{DatasetSource, DatasetSpec};
use fedrl_common::scenario::{Scenario, Task};
use fedrl_rl::evaluate::evaluate_logged;
use fedrl_rl::offline::gym::GreedyGymEvaluator;
use fedrl_rl::offline::qnet::QNetSpec;
use fedrl_rl::offline::train::evaluate_greedy_for;
use fedrl_rl::{EvalConfig, io, loglinear};
use fedrl_sim::Env;
use fedrl_sim::clinical::{
    ClinicalReport, GlucoseMetrics, PoolSummary, patient_label, summarize_episode,
};
use fedrl_sim::gym_bridge::{self, GymPool};
use fedrl_sim::population::{Population, PumpOverrides};
use fedrl_tasks::dppg::{DppgTaskExt, declared_spaces, gym_config};

use super::UsageError;

/// The environments of users `first_user..first_user + episodes` of the `gymnasium:<id>`
/// population `env`, made by bridge workers from the DPPG scenario at `path` (its
/// `[task.gymnasium]` table), in user order, with the pool that owns the workers.
fn gymnasium_envs(
    path: &Path,
    env: &str,
    first_user: u64,
    episodes: u64,
) -> anyhow::Result<(GymPool, Vec<Box<dyn Env>>)> {
    let scenario = fedrl_tasks::scenario_from_file(path)
        .map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
    let task = match scenario.task {
        Task::Dppg(t) if t.population == env => t,
        _ => {
            return Err(UsageError(format!(
                "{} is neither a DPPG scenario with population = {env:?} nor an offline CQL \
                 scenario whose dataset was recorded in {env:?}",
                path.display()
            ))
            .into());
        }
    };
    let cfg = gym_config(&task).ok_or_else(|| UsageError("no [task.gymnasium] table".into()))?;
    let mut pool = GymPool::start(cfg, task.gymnasium.as_ref().map(declared_spaces))
        .with_context(|| format!("starting the Gymnasium workers of {env}"))?;
    let users: Vec<u64> = (0..episodes).map(|i| first_user + i).collect();
    let (groups, dropped) = pool.envs_for(&users);
    if let Some((user, why)) = dropped.first() {
        anyhow::bail!("user {user}: {why}");
    }
    // The workers hold contiguous shares in order: concatenated, the groups are in user order.
    let envs = groups.into_iter().flat_map(|g| g.envs).collect();
    Ok((pool, envs))
}

/// The dataset of the offline CQL scenario at `path` when it was recorded in the Gymnasium
/// environment `env` (its Q-network is evaluated in the dataset's default environment); `None`
/// for any other scenario.
fn offline_gym_dataset(path: &Path, env: &str) -> anyhow::Result<Option<DatasetSpec>> {
    let scenario = fedrl_tasks::scenario_from_file(path)
        .map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
    Ok(match scenario.task {
        Task::OfflineCql(t) => match t.dataset {
            DatasetSource::Generated(d) if d.env == env && d.gymnasium.is_some() => Some(d),
            _ => None,
        },
        _ => None,
    })
}

#[derive(clap::Args)]
pub struct Args {
    /// The state directory of a standalone `fedrl aggregator` whose run evaluated in Gymnasium
    /// environments (a `gymnasium:<id>` DPPG population, offline CQL on a Gymnasium dataset) has
    /// ended: evaluates the models it kept (`eval-snapshots/`) through the Gymnasium bridge on
    /// the episodes it would have played, fills the deferred `eval` of its `metrics.jsonl`
    /// rows, exports the model it would select (DPPG: the best-evaluated one as
    /// `policy.safetensors`) and writes the final evaluation into `report.json` (what `fedrl
    /// run` does after its aggregator ends). Needs the `--scenario` and `--set`s the aggregator
    /// ran with.
    #[arg(long, value_name = "STATE_DIR", requires = "scenario",
          conflicts_with_all = ["run_dir", "policy", "env", "population_seed", "low_risk_weight",
                                "decision_min", "low_glucose_suspend", "iob_limit",
                                "sensitivity_scaling", "stochastic"])]
    pub deferred: Option<PathBuf>,
    /// With --deferred: a `--set KEY=VALUE` the aggregator was started with (repeatable, as
    /// given to it).
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = crate::overrides::parse,
          requires = "deferred")]
    pub sets: Vec<crate::overrides::Override>,
    /// A `fedrl run` output directory: its exported policy, evaluated behind the environment
    /// and pump settings of its stored `scenario.toml` (instead of --policy and --env and the
    /// population and pump flags, which it excludes).
    #[arg(value_name = "RUN_DIR",
          conflicts_with_all = ["env", "scenario", "population_seed", "low_risk_weight", "decision_min",
                                "low_glucose_suspend", "iob_limit", "sensitivity_scaling"])]
    pub run_dir: Option<PathBuf>,
    /// A policy written by `fedrl run` (`policy.safetensors`, or offline CQL's
    /// `q_network.safetensors`); with RUN_DIR, another policy file to evaluate behind that
    /// run's environment.
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// Environment id (see `fedrl sim list`) or population name; with a population, episode i
    /// runs user `--first-user + i`. `gymnasium:<id>` needs `--scenario`.
    #[arg(long)]
    pub env: Option<String>,
    /// With `--env gymnasium:<id>`: the DPPG scenario of that population, whose
    /// `[task.gymnasium]` table (module, kwargs, per-user draws, interpreter, declared spaces)
    /// and `population_seed` make the users' environments (`--population-seed` is ignored); or
    /// the offline CQL scenario whose dataset was recorded there, whose
    /// `[task.dataset.gymnasium]` table makes the dataset's default environment. A RUN_DIR's own
    /// stored scenario is used without it.
    #[arg(long)]
    pub scenario: Option<PathBuf>,
    /// Number of episodes (each in its own environment instance, run as one batch).
    #[arg(long, default_value_t = 100)]
    pub episodes: u64,
    /// Base seed of the episodes' resets. A PPO policy's episode i resets its environment with
    /// `mix(seed + i, 0)` (SplitMix64, `fedrl_rl::rollout::mix`: the reset of the first
    /// episode of a rollout seeded `seed + i`); an offline CQL Q-network's with
    /// `mix(seed, i)`, as its evaluations during training do; a log-linear policy's with
    /// `seed + i` itself.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Population seed (only for population names).
    #[arg(long)]
    pub population_seed: Option<u64>,
    /// `uva-padova-pump*` populations: the scenario's `task.low_risk_weight`, if it set one.
    #[arg(long)]
    pub low_risk_weight: Option<f64>,
    /// `uva-padova-pump*` populations: the scenario's `task.decision_min` (minutes), if it set
    /// one; the policy must be evaluated at the decision interval it was trained at.
    #[arg(long)]
    pub decision_min: Option<u32>,
    /// `uva-padova-pump*` populations: the scenario's `task.low_glucose_suspend`, if it set one.
    #[arg(long)]
    pub low_glucose_suspend: Option<bool>,
    /// `uva-padova-pump*` populations: the scenario's `task.iob_limit`, if it set one.
    #[arg(long)]
    pub iob_limit: Option<bool>,
    /// `uva-padova-pump*` populations: the scenario's `task.sensitivity_scaling`, if it set
    /// one; the policy must be evaluated with the action scaling it was trained with.
    #[arg(long)]
    pub sensitivity_scaling: Option<f64>,
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

/// What is evaluated where: the policy file, the environment's name and its population (with
/// the pump settings applied).
struct Target {
    policy: PathBuf,
    env: String,
    population: Population,
}

/// The exported model files a run directory may hold, in the order they are looked for.
const RUN_POLICIES: [&str; 2] = [
    fedrl_tasks::dppg::POLICY_FILE,
    fedrl_tasks::offline_cql::QNET_FILE,
];

/// The policy, environment and population of a `fedrl run` output directory, from its stored
/// `scenario.toml` (`policy` overrides the run's own exported file).
fn run_target(dir: &Path, policy: Option<&Path>) -> anyhow::Result<Target> {
    let file = dir.join(crate::deploy::SCENARIO_FILE);
    if !file.is_file() {
        return Err(UsageError(format!(
            "{} is not a fedrl run output directory (no {})",
            dir.display(),
            crate::deploy::SCENARIO_FILE
        ))
        .into());
    }
    let scenario: Scenario = fedrl_tasks::scenario_from_file(&file)
        .map_err(|e| UsageError(format!("{}: {e}", file.display())))?;
    let (env, population) = match &scenario.task {
        Task::Dppg(t) => (
            t.population.clone(),
            t.population().map_err(|e| UsageError(e.to_string()))?,
        ),
        Task::LogLinearPg(t) => (
            t.population.clone(),
            Population::new(&t.population, t.population_seed)
                .map_err(|e| UsageError(e.to_string()))?,
        ),
        Task::OfflineCql(t) => {
            // A stored dataset's environment: the scenario's, else the one it records.
            let (env, seed) = fedrl_tasks::stored::source_env(&t.dataset)
                .map_err(|e| UsageError(e.to_string()))?;
            let population = Population::new(&env, seed).map_err(|e| UsageError(e.to_string()))?;
            (env, population)
        }
        other => {
            return Err(UsageError(format!(
                "a `{}` run exports no policy fedrl eval plays (its report holds its \
                 evaluation)",
                other.kind_name()
            ))
            .into());
        }
    };
    let policy = match policy {
        Some(p) => p.to_path_buf(),
        None => RUN_POLICIES
            .iter()
            .map(|f| dir.join(f))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                UsageError(format!(
                    "{} holds no exported policy ({}): did the run finish?",
                    dir.display(),
                    RUN_POLICIES.join(" or ")
                ))
            })?,
    };
    Ok(Target {
        policy,
        env,
        population,
    })
}

/// The policy and environment named by the flags.
fn flag_target(args: &Args) -> anyhow::Result<Target> {
    let (Some(policy), Some(env)) = (&args.policy, &args.env) else {
        return Err(UsageError("give RUN_DIR, or --policy and --env".into()).into());
    };
    let population = Population::new(env, args.population_seed.unwrap_or(0))
        .and_then(|p| {
            p.with_pump_overrides(PumpOverrides {
                low_risk_weight: args.low_risk_weight,
                decision_min: args.decision_min,
                low_glucose_suspend: args.low_glucose_suspend,
                iob_limit: args.iob_limit,
                sensitivity_scaling: args.sensitivity_scaling,
            })
        })
        .map_err(|e| UsageError(e.to_string()))?;
    Ok(Target {
        policy: policy.clone(),
        env: env.clone(),
        population,
    })
}

/// `--deferred STATE_DIR`: the deferred evaluations of a standalone aggregator's run.
fn run_deferred(state_dir: &Path, args: &Args) -> anyhow::Result<ExitCode> {
    use crate::deferred_eval::{StandaloneError, StandaloneOutcome, complete_state_dir};
    let Some(file) = &args.scenario else {
        return Err(UsageError("--deferred needs --scenario FILE".into()).into());
    };
    let text = std::fs::read_to_string(file)
        .map_err(|e| UsageError(format!("reading {}: {e}", file.display())))?;
    let mut scenario: Scenario =
        crate::overrides::load(&text, &args.sets, fedrl_tasks::scenario_from_toml_str)
            .map_err(|e| UsageError(format!("{}: {e:#}", file.display())))?;
    // Where the evaluations compute (the aggregator's device may be one this machine lacks).
    scenario.device = args.device;
    if !crate::deferred_eval::defers_evaluations(&scenario) {
        return Err(UsageError(format!(
            "{}: --deferred applies to runs evaluated in Gymnasium environments (DPPG on a \
             gymnasium:<id> population, offline CQL on a dataset recorded in one); any other \
             run's aggregator evaluates its models itself",
            file.display()
        ))
        .into());
    }
    let fe = match complete_state_dir(&scenario, state_dir) {
        Ok(StandaloneOutcome::Evaluated(fe)) => fe,
        Ok(StandaloneOutcome::NothingDeferred) => {
            eprintln!("{}: no evaluation is deferred", state_dir.display());
            return Ok(ExitCode::SUCCESS);
        }
        Err(e) => {
            if let Some(i) = e.downcast_ref::<crate::deploy::Interrupted>() {
                eprintln!(
                    "interrupted ({}) before the evaluations were written: {} is unchanged; \
                     run the same command again",
                    i.signal.name(),
                    state_dir.display()
                );
                return Ok(ExitCode::from(i.signal.exit_status()));
            }
            if e.downcast_ref::<StandaloneError>().is_some() {
                return Err(UsageError(format!("{e:#}")).into());
            }
            return Err(e);
        }
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&fe)?);
    } else {
        println!(
            "{}: evaluations written into metrics.jsonl and report.json; final evaluation {}",
            state_dir.display(),
            match (
                fe["final_eval_return"].as_f64(),
                fe["final_eval_return_std"].as_f64()
            ) {
                (Some(m), Some(s)) => format!("return {m:.2} ± {s:.2}"),
                _ => format!("failed: {}", fe["final_eval_error"]),
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if let Some(dir) = &args.deferred {
        return run_deferred(dir, &args);
    }
    if args.episodes == 0 {
        return Err(UsageError("--episodes must be at least 1".into()).into());
    }
    let device = fedrl_rl::device::open(args.device).map_err(|e| UsageError(e.to_string()))?;
    let target = match &args.run_dir {
        Some(dir) => run_target(dir, args.policy.as_deref())?,
        None => flag_target(&args)?,
    };
    let Target {
        policy,
        env,
        population,
    } = target;
    if !policy.is_file() {
        return Err(UsageError(format!("no policy file at {}", policy.display())).into());
    }
    let bytes = std::fs::read(&policy)
        .with_context(|| format!("reading the policy {}", policy.display()))?;
    // The scenario whose table makes a Gymnasium environment.
    let gym_scenario = match (gym_bridge::env_id_of(&env), &args.run_dir, &args.scenario) {
        (None, ..) => None,
        (Some(_), Some(dir), _) => Some(dir.join(crate::deploy::SCENARIO_FILE)),
        (Some(_), None, Some(p)) => Some(p.clone()),
        (Some(_), None, None) => {
            return Err(UsageError(format!(
                "--env {env} needs --scenario FILE: its [task.gymnasium] (or \
                 [task.dataset.gymnasium]) table makes the environments"
            ))
            .into());
        }
    };
    // An offline CQL scenario's Gymnasium dataset: its Q-network plays in the dataset's default
    // environment, made below by the evaluator (no users, no population).
    let offline_gym = match &gym_scenario {
        Some(p) => offline_gym_dataset(p, &env)?,
        None => None,
    };
    // A Gymnasium population's environments live in worker processes; `_workers` keeps them
    // until the evaluation is done.
    let (_workers, mut envs) = if offline_gym.is_some() {
        (None, Vec::new())
    } else if let Some(scenario) = &gym_scenario {
        let (pool, envs) = gymnasium_envs(scenario, &env, args.first_user, args.episodes)?;
        (Some(pool), envs)
    } else {
        let envs: Vec<Box<dyn Env>> = (0..args.episodes)
            .map(|i| population.user_env(args.first_user + i))
            .collect::<Result<_, _>>()?;
        (None, envs)
    };
    let seeds: Vec<u64> = (0..args.episodes).map(|i| args.seed + i).collect();
    let started = std::time::Instant::now();
    // Three kinds of exported policy: the PPO MLP (`fedrl.model_spec`), the log-linear
    // riverswim policy (`fedrl.loglinear_spec`) and offline CQL's Q-network (`q.L.weight`, ...).
    let mut clinical: Option<ClinicalReport> = None;
    if offline_gym.is_some() && QNetSpec::from_safetensors(&bytes).is_err() {
        return Err(UsageError(format!(
            "{} is not a Q-network: in {env}, an offline CQL dataset's environment, fedrl eval \
             plays the run's exported Q-network ({})",
            policy.display(),
            fedrl_tasks::offline_cql::QNET_FILE
        ))
        .into());
    }
    let returns: Vec<f64> = match io::from_bytes(&bytes) {
        Ok((spec, params)) => {
            let cfg = EvalConfig {
                episodes_per_env: 1,
                greedy: !args.stochastic,
                ..EvalConfig::default()
            };
            let (r, logs) = evaluate_logged(&spec, &params, &mut envs, &seeds, &cfg, &device)
                .context("evaluating (does the policy match this environment's spaces?)")?;
            let mut days = Vec::new();
            for ep in &logs {
                let user = args.first_user + ep.env as u64;
                let label = patient_label(&population, user);
                days.extend(
                    summarize_episode(&label, Some(user), &ep.samples)
                        .with_context(|| format!("clinical metrics of {label}"))?,
                );
            }
            clinical = ClinicalReport::new(days);
            r.returns
        }
        Err(mlp_err) => {
            if let Ok((spec, params)) = loglinear::from_bytes(&bytes) {
                envs.iter_mut()
                    .zip(&seeds)
                    .map(|(env, &seed)| {
                        loglinear::rollout(&spec, &params, env.as_mut(), seed, !args.stochastic)
                            .map(|ep| ep.total_reward())
                    })
                    .collect::<Result<_, _>>()
                    .context("evaluating (does the policy match this environment's spaces?)")?
            } else if let Ok((spec, params)) = QNetSpec::from_safetensors(&bytes) {
                // Offline CQL's exported Q-network (`q_network.safetensors`): it acts greedily
                // in its Q-values, episode i from seed i of `--seed`'s stream.
                if args.stochastic {
                    return Err(UsageError(
                        "a Q-network acts greedily in its Q-values; --stochastic does not apply"
                            .into(),
                    )
                    .into());
                }
                let episodes = args.episodes as usize;
                match &offline_gym {
                    // Through the bridge, in the dataset's default environment: the workers
                    // start here (a missing interpreter is refused naming the install script).
                    Some(dataset) => GreedyGymEvaluator::start(dataset)
                        .with_context(|| format!("starting the Gymnasium workers of {env}"))?
                        .evaluate(&spec, &params, episodes, args.seed, 0),
                    None => evaluate_greedy_for(&spec, &params, &env, episodes, args.seed, 0),
                }
                .context("evaluating the Q-network (does it match this environment's spaces?)")?
                .returns
            } else {
                anyhow::bail!(
                    "reading the policy {}: {mlp_err} (nor is it a log-linear policy or an offline \
                     CQL Q-network)",
                    policy.display()
                );
            }
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
        let mut out = serde_json::json!({
                "policy": policy.display().to_string(),
                "env": env,
                "episodes": r.returns.len(),
                "mean_return": r.mean,
                "std_return": r.std,
                "min_return": min,
                "max_return": max,
                "greedy": !args.stochastic,
                "wall_seconds": started.elapsed().as_secs_f64(),
        });
        if let (Some(c), Some(obj)) = (&clinical, out.as_object_mut()) {
            obj.insert("clinical".into(), serde_json::to_value(c)?);
        }
        println!("{out}");
    } else {
        println!(
            "{} on {}: mean return {:.2} ± {:.2} (standard deviation) over {} episodes (min {:.1}, max {:.1}; {})",
            policy.display(),
            env,
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
        if let Some(c) = &clinical {
            print!("{}", clinical_table(c));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One table row: percentages of time, mean glucose and risk indices.
fn row(label: &str, days: usize, m: &GlucoseMetrics) -> String {
    format!(
        "{label:<18} {days:>5} {:>6.1} {:>6.1} {:>6.1} {:>6.1} {:>6.1} {:>6.0} {:>6.2} {:>6.2} {:>6.2}\n",
        100.0 * m.time_in_range,
        100.0 * m.time_below_70,
        100.0 * m.time_below_54,
        100.0 * m.time_above_180,
        100.0 * m.time_above_250,
        m.mean_mg_dl,
        m.lbgi,
        m.hbgi,
        m.risk_index,
    )
}

/// The clinical table: pooled and per-group means over patient-days on BG, the pooled CGM row,
/// the spread over patients and the worst patient of each pool.
fn clinical_table(c: &ClinicalReport) -> String {
    let mut t = String::from(
        "clinical metrics (mean over patient-days; % of time)\n\
         pool               days   TIR%   <70%   <54%  >180%  >250%   mean   LBGI   HBGI     RI\n",
    );
    // One group (a dosing population, one age group) is the pool itself: its rows would
    // repeat the pooled ones.
    let groups = if c.groups.len() > 1 {
        c.groups.len()
    } else {
        0
    };
    let pools: Vec<(String, &PoolSummary)> = std::iter::once(("all (BG)".to_string(), &c.pooled))
        .chain(
            c.groups
                .iter()
                .take(groups)
                .map(|(g, p)| (format!("{g} (BG)"), p)),
        )
        .collect();
    for (label, p) in &pools {
        t.push_str(&row(label, p.patient_days, &p.bg));
    }
    t.push_str(&row("all (CGM)", c.pooled.patient_days, &c.pooled.cgm));
    for (label, p) in &pools {
        let s = &p.spread_bg;
        t.push_str(&format!(
            "{label}: TIR over {} patients min {:.1}% / median {:.1}% / max {:.1}%; worst patient {} ({:.1}% in range, {:.1}% below 70)\n",
            p.patients,
            100.0 * s.min.time_in_range,
            100.0 * s.median.time_in_range,
            100.0 * s.max.time_in_range,
            p.worst.patient,
            100.0 * p.worst.bg.time_in_range,
            100.0 * p.worst.bg.time_below_70,
        ));
    }
    let z = &c.pooled.cvga_bg_zones;
    t.push_str(&format!(
        "CVGA zones (BG): A {:.0}%, B {:.0}%, C {:.0}%, D {:.0}%, E {:.0}%\n",
        100.0 * z.a,
        100.0 * z.b,
        100.0 * z.c,
        100.0 * z.d,
        100.0 * z.e
    ));
    t
}

/// Returns of the evaluated episodes, their mean and (population) standard deviation.
struct Summary {
    returns: Vec<f64>,
    mean: f64,
    std: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use fedrl_sim::clinical::ClinicalSummary;

    #[test]
    fn table_has_pooled_group_and_worst_rows() {
        let day = |p: &str, g: f64| ClinicalSummary::new(p, &[g, g, 100.0], &[g; 3]).unwrap();
        let c = ClinicalReport::new(vec![day("adult#001", 120.0), day("child#004", 50.0)]).unwrap();
        let t = clinical_table(&c);
        assert!(t.contains("all (BG)"), "{t}");
        assert!(t.contains("adult (BG)") && t.contains("child (BG)"), "{t}");
        assert!(
            t.contains("worst patient child#004 (33.3% in range, 66.7% below 70)"),
            "{t}"
        );
        // Pooled TIR: (100% + 33.3%) / 2.
        assert!(t.lines().nth(2).unwrap().contains("66.7"), "{t}");
    }

    /// Issue 58: one group (a dosing population) is the pool: each row and the worst patient
    /// are printed once.
    #[test]
    fn one_group_prints_each_row_once() {
        let day = |p: &str, g: f64| ClinicalSummary::new(p, &[g, g, 100.0], &[g; 3]).unwrap();
        let c = ClinicalReport::new(vec![day("adult#001", 120.0), day("adult#002", 50.0)]).unwrap();
        assert_eq!(c.groups.len(), 1);
        let t = clinical_table(&c);
        assert_eq!(t.matches("worst patient").count(), 1, "{t}");
        assert!(!t.contains("adult (BG)"), "{t}");
        assert_eq!(t.matches("all (BG)").count(), 2, "{t}");
    }
}
