//! The experts of seed 000/002 (appendix B.1): `m` PPO policies, each trained on a setting of a
//! B.1 population, softened so that every action has probability at least `p_min`
//! (Assumption 1), each playing its demonstrations on the default environment
//! ([`Behaviour::Experts`]). The experts stay with the dataset: [`ExpertSet`] answers the
//! coordinator's count queries (the probability, under each expert, of a trajectory's
//! prefixes).
//!
//! Training (batched across experts): every expert keeps its own parameters across
//! iterations. Iteration `i`: each expert plays one episode in its own setting's environment
//! with its own (unsoftened, sampled) policy, then runs one local PPO update
//! ([`crate::local_update`], the project's PPO: 4 epochs of 2 minibatches, Adam) from its own
//! parameters and adds the whole delta (no clip, no noise: this training uses no one's data).
//! Adam's moments start fresh every iteration, as in the FedAvg path of the behaviour policy;
//! they are never shared between experts. The experts' PPO steps are batched: all experts'
//! episodes are collected first (plain `f32` forward passes, one per expert per step), then
//! the experts are ordered by episode length (ties by id) and trained in fixed groups of
//! `group_size` as stacked `[group, ...]` tensors.
//!
//! With `shared_iterations > 0` the experts first share a starting policy, trained by
//! averaging the local PPO updates of [`SHARED_COHORT`] experts' episodes per iteration
//! (cycling through the experts' settings), and run their own iterations from it, at
//! `expert_lr` (see [`Behaviour::Experts`] for why).
//!
//! Softening (B.1, last paragraph): at a state `s` the expert's most likely action (the argmax
//! of its logits, ties to the lowest index) gets probability `1 - (A - 1) p_min` and every
//! other action `p_min`, so the softened policy is a function of the argmax alone.
//!
//! Determinism: expert `u`'s initial weights, its training episodes and its demonstrations are
//! drawn from `(spec.seed, u, ...)` alone, and the training groups do not depend on the thread
//! count, so the same spec gives the same experts and dataset bit for bit on any number of
//! threads.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{Device, Tensor};
use fedrl_common::offline::{Behaviour, DatasetSpec, SHARED_COHORT};
use fedrl_sim::{Action, Env, Population, Space};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use safetensors::tensor::Dtype;

use super::cache::{self, CacheError};
use super::dataset::{Dataset, Episode, spread};
use super::generate::{MAX_EPISODES, Progress, mix};
use crate::local_update::{LocalUpdateExt, train_users};
use crate::mlp::{ModelSpec, RowMlp, RowScratch};
use crate::rollout::{UserBatch, run_users_own};
use crate::tensor_io;
use crate::{LocalUpdateConfig, NnError, Result};

/// The file beside a dataset's `data/` holding its experts' (unsoftened) policy parameters.
pub const EXPERTS_FILE: &str = "experts.safetensors";

/// The one metadata key of [`EXPERTS_FILE`] (format 2): an [`ExpertsHeader`] as JSON. One key
/// because safetensors writes its metadata map in `HashMap` order, so several keys made two saves
/// of the same experts differ in their header bytes.
const META_HEADER: &str = "fedrl.experts_header";
/// Format 1's metadata keys (one string each), still read so that caches written before format 2
/// load.
const META_SPEC: &str = "fedrl.model_spec";
const META_P_MIN: &str = "fedrl.p_min";
const META_EXPERTS: &str = "fedrl.experts";
const META_FORMAT: &str = "fedrl.experts_format";
/// Version of [`EXPERTS_FILE`]'s layout written by [`ExpertSet::save`].
const EXPERTS_FORMAT: u32 = 2;

/// What [`EXPERTS_FILE`]'s metadata says of its tensors.
#[derive(serde::Serialize, serde::Deserialize)]
struct ExpertsHeader {
    format: u32,
    model: ModelSpec,
    p_min: f64,
    experts: usize,
}

/// The header of a format-1 experts file: four string keys.
fn header_v1(meta: &HashMap<String, String>) -> std::result::Result<ExpertsHeader, String> {
    let get = |k: &str| meta.get(k).ok_or_else(|| format!("no {k} in the metadata"));
    if get(META_FORMAT)? != "1" {
        return Err(format!("unknown experts format {}", get(META_FORMAT)?));
    }
    Ok(ExpertsHeader {
        format: 1,
        model: serde_json::from_str(get(META_SPEC)?).map_err(|e| format!("model spec: {e}"))?,
        p_min: get(META_P_MIN)?
            .parse()
            .map_err(|e| format!("p_min: {e}"))?,
        experts: get(META_EXPERTS)?
            .parse()
            .map_err(|e| format!("experts: {e}"))?,
    })
}

/// Where a plan's experts train (their B.1 grid settings) and play their demonstrations.
#[derive(Clone, Debug, PartialEq)]
pub enum SettingSource {
    /// A B.1 population (`cartpole-b1`, ...) and the default environment `DatasetSpec::env`.
    Population(Population),
    /// `gymnasium:<id>`: setting `s` is `gymnasium.make(id, **grid_kwargs_of(s))`, the default
    /// environment `gymnasium.make(id, **kwargs)`, in the bridge's workers.
    Gymnasium {
        env_id: String,
        table: fedrl_common::offline::DatasetGymnasium,
    },
}

/// The experts' environments while they are generated: fedrl's own, or made by the bridge's
/// workers (held for the whole generation; each MAKE replaces a worker's environments).
enum EnvMaker<'a> {
    Rust(&'a Population),
    Gym {
        pool: Box<fedrl_sim::gym_bridge::GymPool>,
        table: &'a fedrl_common::offline::DatasetGymnasium,
    },
}

impl EnvMaker<'_> {
    fn start(plan: &ExpertsPlan, population_seed: u64) -> Result<EnvMaker<'_>> {
        Ok(match &plan.source {
            SettingSource::Population(p) => EnvMaker::Rust(p),
            SettingSource::Gymnasium { env_id, table } => EnvMaker::Gym {
                pool: Box::new(super::gym::start_pool(
                    super::gym::gym_config(env_id, table, population_seed),
                    table,
                )?),
                table,
            },
        })
    }

    /// The training environments of `experts` (each its grid setting's), in order.
    fn setting_envs(&mut self, plan: &ExpertsPlan, experts: &[u64]) -> Result<Vec<Box<dyn Env>>> {
        match self {
            EnvMaker::Rust(p) => experts
                .iter()
                .map(|&u| p.setting_env(plan.setting(u)).map_err(NnError::from))
                .collect(),
            EnvMaker::Gym { pool, table } => {
                let kwargs: Vec<_> = experts
                    .iter()
                    .map(|&u| table.grid_kwargs_of(plan.setting(u)))
                    .collect();
                super::gym::make_envs(pool, experts, &kwargs)
            }
        }
    }
}

/// Experts whose episodes are collected together in one lockstep rollout.
const ROLLOUT_CHUNK: usize = 64;

/// The validated parameters of a [`Behaviour::Experts`] spec.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertsPlan {
    /// Where the experts train and play: a B.1 population of fedrl's own environments, or a
    /// Gymnasium environment's grid.
    pub source: SettingSource,
    /// Number of grid settings of the population.
    pub settings: u64,
    pub per_setting: u64,
    pub iterations: u64,
    pub p_min: f64,
    /// Episode cap in steps (0: the environment's own limit).
    pub max_steps: u64,
    /// The experts' policy/value model.
    pub model: ModelSpec,
    pub n_actions: usize,
    pub obs_dim: usize,
    /// The PPO settings of the shared start (`shared_iterations`) and, with `expert_lr` as
    /// learning rate, of each expert's own iterations.
    pub ppo: LocalUpdateConfig,
    /// PPO iterations of the shared starting policy (0: none).
    pub shared_iterations: u64,
    /// Adam learning rate of each expert's own iterations.
    pub expert_lr: f64,
    /// Worker threads of the generation (default: the available parallelism); the experts and
    /// their demonstrations do not depend on it.
    pub threads: usize,
}

impl ExpertsPlan {
    /// Grid setting of expert `u`: `(u / per_setting) mod settings`.
    pub fn setting(&self, u: u64) -> u64 {
        (u / self.per_setting) % self.settings
    }
}

/// The PPO settings of the experts: the workspace defaults (CleanRL-like: 4 epochs, 2
/// minibatches, Adam at 2.5e-3, ratio clip 0.2) with `hidden` widths, one episode per iteration
/// capped at `max_steps`, no DP clip, all experts' threads managed by the generator, and a
/// reward scale that brings the environment's per-step rewards near 1 for the value network
/// (HIV's rewards are 1e4 to 1e8 per step: scaled by 1e-5; the others by the default 0.1).
pub fn expert_ppo_config(env_id: &str, hidden: &[usize], max_steps: u64) -> LocalUpdateConfig {
    let reward_scale = if env_id.starts_with("HIVTreatment") {
        1e-5
    } else {
        0.1
    };
    LocalUpdateConfig {
        clip_norm: f64::INFINITY,
        threads: 1,
        hidden: hidden.to_vec(),
        max_episode_steps: max_steps as usize,
        reward_scale,
        ..LocalUpdateConfig::default()
    }
}

fn invalid(m: String) -> NnError {
    NnError::Invalid(m)
}

/// Checks a [`Behaviour::Experts`] spec against its environments and returns its plan: the
/// behaviour's own checks, `spec.env` an environment id (the default environment) with a Box
/// observation and Discrete actions, the population a B.1 grid whose environment has the same
/// spaces, `p_min x n_actions <= 1`, `population_seed` 0 (the grid is walked in order, the seed
/// would change nothing), and a dataset size that fits in memory.
pub fn plan(spec: &DatasetSpec) -> Result<ExpertsPlan> {
    let Behaviour::Experts {
        population,
        per_setting,
        iterations,
        hidden,
        p_min,
        max_steps,
        shared_iterations,
        expert_lr,
    } = &spec.behaviour
    else {
        return Err(invalid("not an experts spec".into()));
    };
    spec.behaviour.validate().map_err(invalid)?;
    if let Some((env_id, table)) = super::gym::gymnasium_of(spec)? {
        return plan_gym(spec, env_id, table);
    }
    let default_env = fedrl_sim::make(&spec.env).map_err(|e| {
        invalid(format!(
            "experts play their demonstrations on the default environment: {:?} is not an \
             environment id ({e})",
            spec.env
        ))
    })?;
    let pop = Population::new(population, 0)?;
    let settings = pop.grid_settings().ok_or_else(|| {
        invalid(format!(
            "experts train on a B.1 population (cartpole-b1, acrobot-b1, hiv-b1), not {population:?}"
        ))
    })?;
    let probe = pop.setting_env(0)?;
    if probe.observation_space() != default_env.observation_space()
        || probe.action_space() != default_env.action_space()
    {
        return Err(invalid(format!(
            "population {population:?} ({}) and the default environment {} differ in their spaces",
            pop.env_id(),
            spec.env
        )));
    }
    let obs_dim = match default_env.observation_space() {
        Space::Box { low, .. } => low.len(),
        Space::Discrete { .. } => {
            return Err(invalid(format!(
                "{}: experts need a Box observation space",
                spec.env
            )));
        }
    };
    let n_actions = match default_env.action_space() {
        Space::Discrete { n } => *n,
        Space::Box { .. } => {
            return Err(invalid(format!(
                "{}: experts need a Discrete action space",
                spec.env
            )));
        }
    };
    if n_actions < 2 || p_min * n_actions as f64 > 1.0 {
        return Err(invalid(format!(
            "p_min = {p_min} with {n_actions} actions: p_min x n_actions must be <= 1"
        )));
    }
    if spec.population_seed != 0 {
        return Err(invalid(
            "experts take the population's grid settings in order: population_seed must be 0"
                .into(),
        ));
    }
    if spec.units == 0 || spec.episodes_per_unit == 0 {
        return Err(invalid(
            "a dataset needs at least one unit and one episode per unit".into(),
        ));
    }
    match spec.units.checked_mul(spec.episodes_per_unit) {
        Some(n) if n <= MAX_EPISODES => {}
        _ => {
            return Err(invalid(format!(
                "{} units x {} episodes is more than the {MAX_EPISODES} episodes a dataset may hold",
                spec.units, spec.episodes_per_unit
            )));
        }
    }
    let ppo = expert_ppo_config(pop.env_id(), hidden, *max_steps);
    let model = ppo.model_spec(default_env.observation_space(), default_env.action_space())?;
    Ok(ExpertsPlan {
        source: SettingSource::Population(pop),
        settings,
        per_setting: u64::from(*per_setting),
        iterations: *iterations,
        p_min: *p_min,
        max_steps: *max_steps,
        model,
        n_actions,
        obs_dim,
        expert_lr: expert_lr.unwrap_or(ppo.lr),
        ppo,
        shared_iterations: *shared_iterations,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
    })
}

/// [`plan`] for a `gymnasium:<id>` spec: the spaces are the table's declaration (the workers
/// are checked against it when they start), the settings its grid's.
fn plan_gym(
    spec: &DatasetSpec,
    env_id: &str,
    table: &fedrl_common::offline::DatasetGymnasium,
) -> Result<ExpertsPlan> {
    let Behaviour::Experts {
        per_setting,
        iterations,
        hidden,
        p_min,
        max_steps,
        shared_iterations,
        expert_lr,
        ..
    } = &spec.behaviour
    else {
        return Err(invalid("not an experts spec".into()));
    };
    let n_actions = table.actions;
    if p_min * n_actions as f64 > 1.0 {
        return Err(invalid(format!(
            "p_min = {p_min} with {n_actions} actions: p_min x n_actions must be <= 1"
        )));
    }
    if spec.population_seed != 0 {
        return Err(invalid(
            "experts take the grid's settings in order: population_seed must be 0".into(),
        ));
    }
    if spec.units == 0 || spec.episodes_per_unit == 0 {
        return Err(invalid(
            "a dataset needs at least one unit and one episode per unit".into(),
        ));
    }
    match spec.units.checked_mul(spec.episodes_per_unit) {
        Some(n) if n <= MAX_EPISODES => {}
        _ => {
            return Err(invalid(format!(
                "{} units x {} episodes is more than the {MAX_EPISODES} episodes a dataset may hold",
                spec.units, spec.episodes_per_unit
            )));
        }
    }
    let obs = Space::Box {
        low: vec![f32::NEG_INFINITY; table.obs_dim],
        high: vec![f32::INFINITY; table.obs_dim],
    };
    let act = Space::Discrete { n: n_actions };
    let ppo = expert_ppo_config(&spec.env, hidden, *max_steps);
    let model = ppo.model_spec(&obs, &act)?;
    Ok(ExpertsPlan {
        source: SettingSource::Gymnasium {
            env_id: env_id.to_string(),
            table: table.clone(),
        },
        settings: table.grid_settings(),
        per_setting: u64::from(*per_setting),
        iterations: *iterations,
        p_min: *p_min,
        max_steps: *max_steps,
        model,
        n_actions,
        obs_dim: table.obs_dim,
        expert_lr: expert_lr.unwrap_or(ppo.lr),
        ppo,
        shared_iterations: *shared_iterations,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
    })
}

/// The softened action probabilities (Assumption 1) for a state whose most likely action is
/// `argmax`: `1 - (A - 1) p_min` for it, `p_min` for every other action.
pub fn softened_probs(argmax: usize, n_actions: usize, p_min: f64) -> Vec<f64> {
    let mut p = vec![p_min; n_actions];
    if let Some(x) = p.get_mut(argmax) {
        *x = 1.0 - (n_actions as f64 - 1.0) * p_min;
    }
    p
}

/// Index of the largest value, ties to the lowest index (NaN never wins).
fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// Runs `f(job)` for `jobs` jobs on up to `threads` scoped threads (a shared counter hands out
/// the jobs) and returns the results in job order. `done(n)` is called on the calling thread
/// each time a job finishes (`n` jobs so far), so it need not be `Send`.
fn parallel<T: Send>(
    jobs: usize,
    threads: usize,
    f: impl Fn(usize) -> Result<T> + Sync,
    done: &mut dyn FnMut(usize),
) -> Result<Vec<T>> {
    let next = AtomicUsize::new(0);
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Result<T>)>();
    let mut out: Vec<Option<T>> = (0..jobs).map(|_| None).collect();
    let mut failed: Option<NnError> = None;
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, jobs.max(1)) {
            let (tx, next, f) = (tx.clone(), &next, &f);
            s.spawn(move || {
                loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    if j >= jobs {
                        return;
                    }
                    let r = f(j);
                    let stop = r.is_err();
                    // The receiver lives until every sender is gone.
                    let _ = tx.send((j, r));
                    if stop {
                        // Hand out no more work.
                        next.store(jobs, Ordering::Relaxed);
                        return;
                    }
                }
            });
        }
        drop(tx);
        let mut n = 0;
        for (j, r) in rx {
            match r {
                Ok(v) => {
                    out[j] = Some(v);
                    n += 1;
                    done(n);
                }
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    out.into_iter()
        .map(|o| o.ok_or_else(|| invalid("a worker thread panicked".into())))
        .collect()
}

/// What [`train_experts`] measured: the mean training-episode return (reward units, each
/// expert in its own setting, sampling its unsoftened policy) of every iteration, before that
/// iteration's update. Entry 0 is the untrained experts.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainingCurve {
    /// The shared start's iterations (the mean over the iteration's cohort), then the experts'
    /// own (the mean over all experts).
    pub mean_return: Vec<f64>,
}

/// Trains the `m` experts of `plan` (see the module documentation) and returns their full
/// (policy and value) parameter vectors, in expert order.
pub fn train_experts(
    plan: &ExpertsPlan,
    m: u64,
    seed: u64,
    progress: &mut dyn FnMut(Progress),
) -> Result<(Vec<Vec<f32>>, TrainingCurve)> {
    let mut maker = EnvMaker::start(plan, 0)?;
    train_with(plan, &mut maker, m, seed, progress)
}

/// [`train_experts`] with its environments from `maker`.
fn train_with(
    plan: &ExpertsPlan,
    maker: &mut EnvMaker<'_>,
    m: u64,
    seed: u64,
    progress: &mut dyn FnMut(Progress),
) -> Result<(Vec<Vec<f32>>, TrainingCurve)> {
    let layout = plan.model.layout();
    let m_us = usize::try_from(m).map_err(|_| invalid(format!("{m} experts")))?;
    let total = plan.shared_iterations + plan.iterations;
    let mut curve = Vec::with_capacity(total as usize);
    let mut params: Vec<Vec<f32>> = if plan.shared_iterations > 0 {
        let shared = train_shared(plan, maker, m, seed, &mut curve, progress)?;
        vec![shared; m_us]
    } else {
        (0..m)
            .map(|u| plan.model.init(mix(&[seed, u, 0x1417])))
            .collect()
    };
    let all: Vec<u64> = (0..m).collect();
    let mut envs = maker.setting_envs(plan, &all)?;
    let rollout = plan.ppo.rollout();
    let own = LocalUpdateConfig {
        lr: plan.expert_lr,
        ..plan.ppo.clone()
    };
    let threads = plan.threads.max(1);
    let chunks = m_us.div_ceil(ROLLOUT_CHUNK);
    for it in 0..plan.iterations {
        let seeds: Vec<u64> = (0..m).map(|u| mix(&[seed, u, it, 0x7261])).collect();
        // Phase 1: every expert's episode with its own parameters, in fixed chunks of experts
        // (each chunk's environments behind a lock so that any worker may take the chunk).
        let slots: Vec<Mutex<&mut [Box<dyn Env>]>> =
            envs.chunks_mut(ROLLOUT_CHUNK).map(Mutex::new).collect();
        let batches: Vec<Vec<UserBatch>> = parallel(
            chunks,
            threads,
            |c| {
                let lo = c * ROLLOUT_CHUNK;
                let mut chunk = slots[c]
                    .lock()
                    .map_err(|_| invalid("environment lock poisoned".into()))?;
                let hi = lo + chunk.len();
                let ps: Vec<&[f32]> = params[lo..hi].iter().map(Vec::as_slice).collect();
                run_users_own(
                    &plan.model,
                    &layout,
                    &ps,
                    &mut chunk,
                    &seeds[lo..hi],
                    &rollout,
                    false,
                    true,
                )
            },
            &mut |_| {},
        )?;
        drop(slots);
        let batches: Vec<UserBatch> = batches.into_iter().flatten().collect();
        curve.push(mean_episode_return(&batches));
        // Phase 2: PPO from each expert's own parameters, in groups of similar length.
        let mut order: Vec<usize> = (0..m_us).collect();
        order.sort_by_key(|&u| (batches[u].len(), u));
        let groups: Vec<&[usize]> = order.chunks(plan.ppo.group_size.max(1)).collect();
        let deltas = group_deltas(
            plan,
            &groups,
            |u| params[u].as_slice(),
            &batches,
            &seeds,
            &own,
            threads,
        )?;
        for (group, ds) in groups.iter().zip(deltas) {
            for (&u, d) in group.iter().zip(ds) {
                for (p, x) in params[u].iter_mut().zip(d) {
                    *p += x;
                }
            }
        }
        progress(Progress::Training {
            done: plan.shared_iterations + it + 1,
            total,
            train_return: curve[curve.len() - 1],
        });
    }
    Ok((params, TrainingCurve { mean_return: curve }))
}

/// One local PPO update per expert of each group in `groups` (indices into `batches` and
/// `seeds`), from `start(i)`, the groups trained in parallel as stacked tensors; the deltas in
/// the groups' order.
fn group_deltas<'a>(
    plan: &ExpertsPlan,
    groups: &[&[usize]],
    start: impl Fn(usize) -> &'a [f32] + Sync,
    batches: &[UserBatch],
    seeds: &[u64],
    cfg: &LocalUpdateConfig,
    threads: usize,
) -> Result<Vec<Vec<Vec<f32>>>> {
    let layout = plan.model.layout();
    parallel(
        groups.len(),
        threads,
        |g| {
            let group = groups[g];
            let starts: Vec<&[f32]> = group.iter().map(|&i| start(i)).collect();
            let bs: Vec<UserBatch> = group.iter().map(|&i| batches[i].clone()).collect();
            let sd: Vec<u64> = group.iter().map(|&i| seeds[i]).collect();
            let ups = train_users(
                &plan.model,
                &layout,
                &starts,
                &bs,
                &sd,
                cfg,
                &Device::Cpu,
                None,
            )?;
            Ok(ups.into_iter().map(|u| u.delta).collect())
        },
        &mut |_| {},
    )
}

/// The mean return of every episode in `batches` (0 when there is none).
fn mean_episode_return(batches: &[UserBatch]) -> f64 {
    let (sum, n) = batches
        .iter()
        .flat_map(|b| b.episode_returns.iter())
        .fold((0.0, 0usize), |(s, n), r| (s + r, n + 1));
    sum / n.max(1) as f64
}

/// Trains the shared starting policy of `plan` (`shared_iterations`, see
/// [`Behaviour::Experts`]): iteration `i` takes the experts `(i c + k) mod m`, `k < c =
/// min(m, SHARED_COHORT)`, each plays one episode in its own setting with the shared policy and
/// runs one local PPO update from it; the policy moves by the mean update. Pushes each
/// iteration's mean cohort return onto `curve`. Deterministic: the cohort's training groups
/// are fixed, whatever the thread count.
fn train_shared(
    plan: &ExpertsPlan,
    maker: &mut EnvMaker<'_>,
    m: u64,
    seed: u64,
    curve: &mut Vec<f64>,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<f32>> {
    let layout = plan.model.layout();
    let m_us = usize::try_from(m).map_err(|_| invalid(format!("{m} experts")))?;
    if m_us == 0 {
        return Err(invalid("a shared start needs at least one expert".into()));
    }
    let cohort = m_us.min(SHARED_COHORT);
    let rollout = plan.ppo.rollout();
    let threads = plan.threads.max(1);
    let total = plan.shared_iterations + plan.iterations;
    let group = plan.ppo.group_size.clamp(1, cohort);
    let mut shared = plan.model.init(mix(&[seed, 0x7368_6172]));
    for it in 0..plan.shared_iterations {
        let start = (it as usize).wrapping_mul(cohort) % m_us;
        let members: Vec<u64> = (0..cohort).map(|k| ((start + k) % m_us) as u64).collect();
        let seeds: Vec<u64> = members
            .iter()
            .map(|&u| mix(&[seed, u, it, 0x7368]))
            .collect();
        let mut envs = maker.setting_envs(plan, &members)?;
        let starts: Vec<&[f32]> = vec![shared.as_slice(); cohort];
        let batches = run_users_own(
            &plan.model,
            &layout,
            &starts,
            &mut envs,
            &seeds,
            &rollout,
            false,
            true,
        )?;
        curve.push(mean_episode_return(&batches));
        let idx: Vec<usize> = (0..cohort).collect();
        let groups: Vec<&[usize]> = idx.chunks(group).collect();
        let deltas = group_deltas(
            plan,
            &groups,
            |_| shared.as_slice(),
            &batches,
            &seeds,
            &plan.ppo,
            threads,
        )?;
        // Sum in cohort order, then divide: the same result on any number of threads.
        let mut sum = vec![0f32; shared.len()];
        for d in deltas.iter().flatten() {
            for (s, x) in sum.iter_mut().zip(d) {
                *s += x;
            }
        }
        let n = cohort as f32;
        for (p, s) in shared.iter_mut().zip(sum) {
            *p += s / n;
        }
        progress(Progress::Training {
            done: it + 1,
            total,
            train_return: curve[curve.len() - 1],
        });
    }
    Ok(shared)
}

/// The policy parameters (`0..policy_len` of the layout) of every expert.
fn policy_parts(layout: &crate::ParamLayout, params: &[Vec<f32>]) -> Vec<Vec<f32>> {
    params
        .iter()
        .map(|p| p[..layout.policy_len].to_vec())
        .collect()
}

/// The policy-only layout of `model` (the value layers dropped): the layout of the stored
/// experts.
fn policy_layout(model: &ModelSpec) -> crate::ParamLayout {
    let mut l = model.layout();
    let n = l.policy_layers.len() * 2 + usize::from(l.log_std.is_some());
    l.params.truncate(n);
    l.value_layers.clear();
    l.len = l.policy_len;
    l
}

/// Plays one demonstration of the softened expert `net` in `env` (from `reset_seed`), capped at
/// `max_steps` (0: the environment's own limit; a capped episode is truncated).
#[allow(clippy::too_many_arguments)] // internal
fn demonstrate(
    env: &mut dyn Env,
    net: &RowMlp,
    model: &ModelSpec,
    n_actions: usize,
    p_min: f64,
    max_steps: u64,
    reset_seed: u64,
    rng: &mut Xoshiro256PlusPlus,
    id: u64,
    unit: u64,
) -> Result<Episode> {
    let d = model.obs_dim;
    let mut obs = vec![0.0f32; d];
    env.reset(reset_seed, &mut obs);
    let mut e = Episode {
        id,
        unit,
        observations: obs.clone(),
        actions: Vec::new(),
        rewards: Vec::new(),
        terminations: Vec::new(),
        truncations: Vec::new(),
    };
    let mut x = Vec::with_capacity(d);
    let mut scratch = RowScratch::default();
    let p_top = 1.0 - (n_actions as f64 - 1.0) * p_min;
    loop {
        x.clear();
        x.extend_from_slice(&obs);
        model.normalize_obs(&mut x);
        let best = argmax(net.policy(&x, &mut scratch));
        // One uniform draw per step: below p_top the expert's action, else one of the others
        // uniformly (each with probability p_min).
        let r: f64 = rng.random();
        let a = if r < p_top {
            best
        } else {
            let k = (((r - p_top) / p_min) as usize).min(n_actions - 2);
            if k < best { k } else { k + 1 }
        };
        let step = env.step(Action::Discrete(a), &mut obs)?;
        e.actions.push(a as u32);
        e.rewards.push(step.reward as f32);
        e.terminations.push(step.terminated);
        e.observations.extend_from_slice(&obs);
        let capped = max_steps > 0 && e.actions.len() as u64 >= max_steps;
        let truncated = !step.terminated && (step.truncated || capped);
        e.truncations.push(truncated);
        if step.terminated || truncated {
            return Ok(e);
        }
    }
}

/// Every expert's `episodes_per_unit` demonstrations on the default environment, in unit
/// order (episode `k` of unit `u` has id `u * episodes_per_unit + k`).
fn record(
    spec: &DatasetSpec,
    plan: &ExpertsPlan,
    policies: &[Vec<f32>],
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<Episode>> {
    let layout = policy_layout(&plan.model);
    let epu = spec.episodes_per_unit;
    let m = policies.len();
    let chunk = ROLLOUT_CHUNK;
    let jobs = m.div_ceil(chunk);
    let per_chunk = parallel(
        jobs,
        plan.threads.max(1),
        |c| {
            let mut env = fedrl_sim::make(&spec.env)?;
            let mut out = Vec::new();
            let lo = c * chunk;
            for (i, policy) in policies[lo..(lo + chunk).min(m)].iter().enumerate() {
                let net = RowMlp::new(&layout, policy);
                let u64_ = (lo + i) as u64;
                for k in 0..epu {
                    let key = mix(&[spec.seed, u64_, k]);
                    let mut rng = Xoshiro256PlusPlus::seed_from_u64(key);
                    let reset_seed = mix(&[key, 0x0072_6573_6574]);
                    out.push(demonstrate(
                        env.as_mut(),
                        &net,
                        &plan.model,
                        plan.n_actions,
                        plan.p_min,
                        plan.max_steps,
                        reset_seed,
                        &mut rng,
                        u64_ * epu + k,
                        u64_,
                    )?);
                }
            }
            Ok(out)
        },
        &mut |n| {
            // Jobs finish in any order; report experts done (exact once all are).
            progress(Progress::Recording {
                done: ((n * chunk).min(m)) as u64,
                total: m as u64,
            })
        },
    )?;
    Ok(per_chunk.into_iter().flatten().collect())
}

/// Experts whose demonstrations are played together through the bridge.
const GYM_RECORD_CHUNK: usize = 256;

/// [`record`] through the bridge: the same demonstrations (reset seeds, one uniform draw per
/// step, the cap), the default environments made once per chunk of [`GYM_RECORD_CHUNK`]
/// experts and their `k`-th demonstrations played in lockstep, one thread per worker.
fn record_gym(
    spec: &DatasetSpec,
    plan: &ExpertsPlan,
    pool: &mut fedrl_sim::gym_bridge::GymPool,
    table: &fedrl_common::offline::DatasetGymnasium,
    policies: &[Vec<f32>],
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<Episode>> {
    let layout = policy_layout(&plan.model);
    let epu = spec.episodes_per_unit;
    let m = policies.len();
    let p_top = 1.0 - (plan.n_actions as f64 - 1.0) * plan.p_min;
    let shares = pool.workers();
    let mut out = Vec::with_capacity(m * epu as usize);
    for lo in (0..m).step_by(GYM_RECORD_CHUNK) {
        let hi = (lo + GYM_RECORD_CHUNK).min(m);
        let units: Vec<u64> = (lo as u64..hi as u64).collect();
        let kwargs = vec![table.kwargs.clone(); units.len()];
        let mut envs = super::gym::make_envs(pool, &units, &kwargs)?;
        let nets: Vec<RowMlp> = policies[lo..hi]
            .iter()
            .map(|p| RowMlp::new(&layout, p))
            .collect();
        let mut per_unit: Vec<Vec<Episode>> = vec![Vec::with_capacity(epu as usize); units.len()];
        for k in 0..epu {
            let mut lanes: Vec<super::gym::Lane> = units
                .iter()
                .map(|&u| {
                    let key = mix(&[spec.seed, u, k]);
                    super::gym::Lane {
                        id: u * epu + k,
                        unit: u,
                        reset_seed: mix(&[key, 0x0072_6573_6574]),
                        rng: Xoshiro256PlusPlus::seed_from_u64(key),
                    }
                })
                .collect();
            // As `demonstrate`: one uniform draw per step.
            let act = |i: usize, obs: &[f32], rng: &mut Xoshiro256PlusPlus| -> usize {
                let mut x = obs.to_vec();
                plan.model.normalize_obs(&mut x);
                let mut scratch = RowScratch::default();
                let best = argmax(nets[i].policy(&x, &mut scratch));
                let r: f64 = rng.random();
                if r < p_top {
                    best
                } else {
                    let k = (((r - p_top) / plan.p_min) as usize).min(plan.n_actions - 2);
                    if k < best { k } else { k + 1 }
                }
            };
            let eps = super::gym::play_parallel(
                &mut envs,
                &mut lanes,
                plan.obs_dim,
                plan.max_steps,
                shares,
                &act,
            )?;
            for (i, e) in eps.into_iter().enumerate() {
                per_unit[i].push(e);
            }
        }
        out.extend(per_unit.into_iter().flatten());
        progress(Progress::Recording {
            done: hi as u64,
            total: m as u64,
        });
    }
    Ok(out)
}

/// Trained experts with their dataset: what [`generate_experts`] returns.
#[derive(Clone, Debug)]
pub struct GeneratedExperts {
    /// The demonstrations (unit = expert id).
    pub dataset: Dataset,
    /// The experts' (unsoftened) policies.
    pub experts: ExpertSet,
    /// Mean training return per iteration (entry 0: untrained).
    pub curve: TrainingCurve,
}

/// Trains the experts of a [`Behaviour::Experts`] spec and records their demonstrations (see
/// the module documentation). `spec.units` experts, `spec.episodes_per_unit` demonstrations
/// each; the dataset's id is [`DatasetSpec::minari_id`], its `env_id` the default environment.
pub fn generate_experts(
    spec: &DatasetSpec,
    progress: &mut dyn FnMut(Progress),
) -> Result<GeneratedExperts> {
    let plan = plan(spec)?;
    let mut maker = EnvMaker::start(&plan, 0)?;
    let (params, curve) = train_with(&plan, &mut maker, spec.units, spec.seed, progress)?;
    let layout = plan.model.layout();
    let policies = policy_parts(&layout, &params);
    drop(params);
    let episodes = match &mut maker {
        EnvMaker::Rust(_) => record(spec, &plan, &policies, progress)?,
        EnvMaker::Gym { pool, table } => record_gym(spec, &plan, pool, table, &policies, progress)?,
    };
    let dataset = Dataset {
        id: spec.minari_id(),
        env_id: spec.env.clone(),
        obs_dim: plan.obs_dim,
        n_actions: plan.n_actions,
        episodes,
    };
    let experts = ExpertSet::new(plan.model.clone(), plan.p_min, policies)?;
    Ok(GeneratedExperts {
        dataset,
        experts,
        curve,
    })
}

/// The spread of the experts' quality: each expert's mean demonstration return (reward units,
/// softened policy on the default environment), summarised over experts.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ExpertReturns {
    pub experts: usize,
    /// Mean over experts.
    pub mean: f64,
    /// Quantiles over experts (numpy's linear interpolation).
    pub min: f64,
    pub q25: f64,
    pub median: f64,
    pub q75: f64,
    pub max: f64,
}

impl ExpertReturns {
    /// The spread of the per-unit mean returns of `dataset` (one unit = one expert).
    pub fn of(dataset: &Dataset) -> Self {
        let mut per: std::collections::BTreeMap<u64, (f64, usize)> = Default::default();
        for e in &dataset.episodes {
            let s = per.entry(e.unit).or_default();
            s.0 += e.total_return();
            s.1 += 1;
        }
        let [mean, min, q25, median, q75, max] =
            spread(per.values().map(|(s, n)| s / *n as f64).collect());
        ExpertReturns {
            experts: per.len(),
            mean,
            min,
            q25,
            median,
            q75,
            max,
        }
    }
}

/// The experts of a dataset, queried by the client agents that host them: softened action
/// probabilities and the probabilities of trajectory prefixes (seed 002, Algorithm 1's count
/// query; each expert's answer is in (0, 1], so one expert changes a count by at most 1).
///
/// Queries run one batched forward pass (candle's matmul over stacked weights) per block of
/// experts; the demonstrations were played with a plain row-by-row forward pass of the same
/// weights. The two agree up to `f32` rounding, so an argmax may differ only where two logits
/// tie to about 1e-6; each answer stays in (0, 1] either way.
#[derive(Clone, Debug)]
pub struct ExpertSet {
    model: ModelSpec,
    p_min: f64,
    n_actions: usize,
    /// Per expert: its policy parameters (policy-only layout).
    policies: Vec<Vec<f32>>,
    /// Per block of [`QUERY_BLOCK`] experts: the stacked policy layers (weights `[k, in, out]`,
    /// biases `[k, out]`) for one batched forward pass per query.
    blocks: Vec<Vec<(Tensor, Tensor)>>,
}

/// Experts per stacked block of [`ExpertSet`]: bounds a query's memory (block x L x hidden
/// floats per layer) and is the unit of its parallelism.
const QUERY_BLOCK: usize = 256;

impl ExpertSet {
    /// Experts from their policy parameters (each of the policy-only length of `model`'s
    /// layout); `model` must have a discrete action space and `p_min` satisfy Assumption 1.
    pub fn new(model: ModelSpec, p_min: f64, policies: Vec<Vec<f32>>) -> Result<Self> {
        let n_actions = match model.action {
            crate::ActionKind::Discrete { n } => n,
            crate::ActionKind::Gaussian { .. } => {
                return Err(invalid("experts need a discrete policy".into()));
            }
        };
        if !(p_min.is_finite() && p_min > 0.0 && p_min * n_actions as f64 <= 1.0) {
            return Err(invalid(format!(
                "p_min = {p_min} with {n_actions} actions: need 0 < p_min <= 1 / n_actions"
            )));
        }
        model.check_preprocessing()?;
        let layout = policy_layout(&model);
        for (u, p) in policies.iter().enumerate() {
            layout
                .check(p)
                .map_err(|e| invalid(format!("expert {u}: {e}")))?;
            if p.iter().any(|x| !x.is_finite()) {
                return Err(invalid(format!("expert {u}: non-finite parameters")));
            }
        }
        let mut blocks = Vec::with_capacity(policies.len().div_ceil(QUERY_BLOCK));
        for block in policies.chunks(QUERY_BLOCK) {
            let refs: Vec<&[f32]> = block.iter().map(Vec::as_slice).collect();
            let t = layout.stack(&refs, &Device::Cpu)?;
            blocks.push(
                layout
                    .policy_layers
                    .iter()
                    .map(|&i| (t[i].clone(), t[i + 1].clone()))
                    .collect(),
            );
        }
        Ok(Self {
            model,
            p_min,
            n_actions,
            policies,
            blocks,
        })
    }

    /// Number of experts.
    pub fn experts(&self) -> u64 {
        self.policies.len() as u64
    }

    /// Number of discrete actions.
    pub fn n_actions(&self) -> usize {
        self.n_actions
    }

    /// Observation length.
    pub fn obs_dim(&self) -> usize {
        self.model.obs_dim
    }

    /// Minimum action probability of the softened experts.
    pub fn p_min(&self) -> f64 {
        self.p_min
    }

    /// The experts' model (policy and value; only the policy is stored).
    pub fn model(&self) -> &ModelSpec {
        &self.model
    }

    /// Expert `unit`'s policy parameters (policy-only layout).
    pub fn policy(&self, unit: u64) -> Result<&[f32]> {
        self.policies
            .get(usize::try_from(unit).unwrap_or(usize::MAX))
            .map(Vec::as_slice)
            .ok_or_else(|| self.unknown(unit))
    }

    fn unknown(&self, unit: u64) -> NnError {
        invalid(format!(
            "unknown expert {unit}: the set holds {}",
            self.policies.len()
        ))
    }

    fn check_unit(&self, unit: u64) -> Result<usize> {
        usize::try_from(unit)
            .ok()
            .filter(|&u| u < self.policies.len())
            .ok_or_else(|| self.unknown(unit))
    }

    /// The most likely action (ties to the lowest index) of each expert of `experts` at every
    /// observation of `obs` (`rows` rows of `obs_dim` raw values, already checked): one
    /// batched forward pass `[k, rows, obs_dim]` through the stacked weights per block of
    /// experts, blocks in parallel. Row `j` of the `i`-th queried expert is at `i * rows + j`.
    fn argmaxes(&self, experts: &[usize], obs: &[f32], rows: usize) -> Result<Vec<usize>> {
        let d = self.model.obs_dim;
        let mut x = obs.to_vec();
        self.model.normalize_obs(&mut x);
        let x = Tensor::from_vec(x, (1, rows, d), &Device::Cpu)?;
        // The queried experts by block, with their positions in `experts`.
        let mut by_block: std::collections::BTreeMap<usize, Vec<(usize, u32)>> = Default::default();
        for (pos, &u) in experts.iter().enumerate() {
            by_block
                .entry(u / QUERY_BLOCK)
                .or_default()
                .push((pos, (u % QUERY_BLOCK) as u32));
        }
        let jobs: Vec<(usize, Vec<(usize, u32)>)> = by_block.into_iter().collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let a = self.n_actions;
        let parts = parallel(
            jobs.len(),
            threads,
            |j| {
                let (b, members) = &jobs[j];
                let block = &self.blocks[*b];
                let whole = members.len() == block[0].0.dim(0)?
                    && members.iter().enumerate().all(|(i, m)| m.1 as usize == i);
                let layers: Vec<(Tensor, Tensor)> = if whole {
                    block.clone()
                } else {
                    let idx: Vec<u32> = members.iter().map(|m| m.1).collect();
                    let idx = Tensor::from_vec(idx, members.len(), &Device::Cpu)?;
                    block
                        .iter()
                        .map(|(w, bias)| {
                            Ok((w.index_select(&idx, 0)?, bias.index_select(&idx, 0)?))
                        })
                        .collect::<Result<_>>()?
                };
                let xs = x.broadcast_as((members.len(), rows, d))?.contiguous()?;
                let refs: Vec<(&Tensor, &Tensor)> = layers.iter().map(|(w, b)| (w, b)).collect();
                let logits = crate::mlp::forward(&xs, &refs)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                Ok(logits.chunks_exact(a).map(argmax).collect::<Vec<usize>>())
            },
            &mut |_| {},
        )?;
        let mut out = vec![0usize; experts.len() * rows];
        for ((_, members), best) in jobs.iter().zip(parts) {
            for (i, (pos, _)) in members.iter().enumerate() {
                out[pos * rows..(pos + 1) * rows].copy_from_slice(&best[i * rows..(i + 1) * rows]);
            }
        }
        Ok(out)
    }

    fn check_obs(&self, obs: &[f32], rows: usize) -> Result<()> {
        let d = self.model.obs_dim;
        if obs.len() != rows * d {
            return Err(invalid(format!(
                "{} observation values for {rows} steps of {d}",
                obs.len()
            )));
        }
        if let Some(i) = obs.iter().position(|x| !x.is_finite()) {
            return Err(invalid(format!("observation value {i} is not finite")));
        }
        Ok(())
    }

    /// Softened action probabilities of expert `unit` at the raw observation `obs` (they sum to
    /// 1; the expert's most likely action gets `1 - (A - 1) p_min`, every other `p_min`).
    pub fn action_probs(&self, unit: u64, obs: &[f32]) -> Result<Vec<f64>> {
        let u = self.check_unit(unit)?;
        self.check_obs(obs, 1)?;
        let a = self.argmaxes(&[u], obs, 1)?;
        Ok(softened_probs(a[0], self.n_actions, self.p_min))
    }

    /// For the trajectory `s_1..s_L` (`obs`: `L x obs_dim` raw observations) with actions
    /// `a_1..a_L`, for each expert of `units` (in order): the `L` values
    /// `prod_{j <= h} pi_u(a_j | s_j)`, `h = 1..=L`, under the softened policy (f64 products,
    /// each in (0, 1], non-increasing in `h`). Errors: unknown unit, wrong lengths, an action
    /// out of range, a non-finite observation.
    pub fn prefix_probabilities(
        &self,
        units: &[u64],
        obs: &[f32],
        actions: &[u32],
    ) -> Result<Vec<Vec<f64>>> {
        let experts = self.check_query(units, obs, actions)?;
        let rows = actions.len();
        if rows == 0 {
            return Ok(vec![Vec::new(); units.len()]);
        }
        let p_top = 1.0 - (self.n_actions as f64 - 1.0) * self.p_min;
        let best = self.argmaxes(&experts, obs, rows)?;
        Ok(best
            .chunks_exact(rows)
            .map(|b| {
                let mut p = 1.0f64;
                b.iter()
                    .zip(actions)
                    .map(|(&b, &a)| {
                        p *= if b == a as usize { p_top } else { self.p_min };
                        p
                    })
                    .collect()
            })
            .collect())
    }

    /// What a client agent answers to a count query: for each prefix length `h = 1..=L`, the
    /// sum over `units` of [`ExpertSet::prefix_probabilities`], in `[0, units.len()]`.
    pub fn prefix_counts(&self, units: &[u64], obs: &[f32], actions: &[u32]) -> Result<Vec<f64>> {
        let probs = self.prefix_probabilities(units, obs, actions)?;
        let mut out = vec![0.0f64; actions.len()];
        for p in &probs {
            for (o, x) in out.iter_mut().zip(p) {
                *o += x;
            }
        }
        Ok(out)
    }

    fn check_query(&self, units: &[u64], obs: &[f32], actions: &[u32]) -> Result<Vec<usize>> {
        let experts = units
            .iter()
            .map(|&u| self.check_unit(u))
            .collect::<Result<Vec<usize>>>()?;
        self.check_obs(obs, actions.len())?;
        if let Some(&a) = actions.iter().find(|&&a| a as usize >= self.n_actions) {
            return Err(invalid(format!(
                "action {a} out of range 0..{}",
                self.n_actions
            )));
        }
        Ok(experts)
    }

    /// Writes the experts to `path` as safetensors: one tensor per policy parameter with the
    /// experts stacked first (`policy.0.weight`: `[m, out, in]`, ...), and the model spec,
    /// `p_min` and the number of experts as one JSON metadata entry. The same experts always give
    /// the same bytes.
    pub fn save(&self, path: &Path) -> Result<()> {
        let layout = policy_layout(&self.model);
        let m = self.policies.len();
        let tensors: Vec<tensor_io::Tensor> = layout
            .params
            .iter()
            .map(|p| {
                let mut values = Vec::with_capacity(m * p.numel());
                for pol in &self.policies {
                    values.extend_from_slice(&pol[p.offset..p.offset + p.numel()]);
                }
                let mut shape = vec![m];
                shape.extend_from_slice(&p.shape);
                tensor_io::Tensor::f32(p.name.clone(), shape, &values)
            })
            .collect();
        let header = ExpertsHeader {
            format: EXPERTS_FORMAT,
            model: self.model.clone(),
            p_min: self.p_min,
            experts: m,
        };
        let json =
            serde_json::to_string(&header).map_err(|e| invalid(format!("experts header: {e}")))?;
        let data = tensor_io::serialize(&tensors, META_HEADER, json)?;
        std::fs::write(path, data)?;
        Ok(())
    }

    /// Reads experts written by [`ExpertSet::save`], in this format or format 1 (names, shapes
    /// and counts checked).
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path)?;
        let bad = |m: String| invalid(format!("{}: {m}", path.display()));
        let meta = tensor_io::metadata(&bytes)?.ok_or_else(|| bad("no metadata".into()))?;
        let ExpertsHeader {
            model,
            p_min,
            experts: m,
            ..
        } = match meta.get(META_HEADER) {
            Some(json) => {
                let h: ExpertsHeader =
                    serde_json::from_str(json).map_err(|e| bad(format!("experts header: {e}")))?;
                if h.format != EXPERTS_FORMAT {
                    return Err(bad(format!("unknown experts format {}", h.format)));
                }
                h
            }
            None => header_v1(&meta).map_err(bad)?,
        };
        let st = tensor_io::parse(&bytes)?;
        let layout = policy_layout(&model);
        if st.len() != layout.params.len() {
            return Err(bad(format!(
                "{} tensors, the policy has {}",
                st.len(),
                layout.params.len()
            )));
        }
        let mut tensors = Vec::with_capacity(layout.params.len());
        for p in &layout.params {
            let mut shape = vec![m];
            shape.extend_from_slice(&p.shape);
            let data = tensor_io::tensor_bytes(&st, &p.name, Dtype::F32, Some(&shape))
                .map_err(|e| bad(e.to_string()))?;
            tensors.push(data);
        }
        // Allocated only once the file's tensors are known to hold m experts.
        let mut policies = vec![vec![0.0f32; layout.len]; m];
        for (p, t) in layout.params.iter().zip(&tensors) {
            let n = p.numel();
            for (i, c) in t.chunks_exact(4).enumerate() {
                policies[i / n][p.offset + i % n] = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Self::new(model, p_min, policies).map_err(|e| bad(e.to_string()))
    }

    /// The experts of the dataset of `spec` under `root`, generating and storing the dataset
    /// with its experts first if it is not cached (as [`cache::load_or_generate`]). A cached
    /// dataset without its experts file is an error.
    pub fn load(spec: &DatasetSpec, root: &Path) -> std::result::Result<Self, CacheError> {
        Self::load_with_progress(spec, root, &mut |_| {})
    }

    /// [`ExpertSet::load`] reporting a generation's progress.
    pub fn load_with_progress(
        spec: &DatasetSpec,
        root: &Path,
        progress: &mut dyn FnMut(Progress),
    ) -> std::result::Result<Self, CacheError> {
        let (_, _) = cache::load_or_generate(spec, root, progress)?;
        let dir = super::minari::dataset_dir(root, &spec.minari_id())?;
        let set = Self::read_for(spec, &dir)?;
        Ok(set)
    }

    /// Reads the experts file of the dataset folder `dir` and checks it against `spec` (number
    /// of experts, hidden widths, `p_min`).
    pub fn read_for(spec: &DatasetSpec, dir: &Path) -> std::result::Result<Self, CacheError> {
        let path = dir.join(EXPERTS_FILE);
        if !path.is_file() {
            return Err(CacheError::MissingExperts { path });
        }
        let set = Self::read(&path)?;
        if let Behaviour::Experts { hidden, p_min, .. } = &spec.behaviour
            && (set.experts() != spec.units || &set.model.hidden != hidden || set.p_min != *p_min)
        {
            return Err(CacheError::Generate(invalid(format!(
                "{}: {} experts with hidden {:?} and p_min {}, the spec says {} with {hidden:?} \
                 and {p_min}",
                path.display(),
                set.experts(),
                set.model.hidden,
                set.p_min,
                spec.units
            ))));
        }
        Ok(set)
    }
}
