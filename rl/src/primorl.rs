//! PriMORL (seed 001) glue shared by the client agent and the aggregator: the ensemble a task
//! trains with its public input normalisation, the local-update settings, and the per-round
//! minibatch seeds. The ensemble itself is [`crate::ensemble`]; the data,
//! [`crate::offline::continuous`].

use fedrl_common::task::TaskError;
use fedrl_common::task::primorl::PrimorlTask;

use crate::ensemble::{EnsembleSpec, LocalModelConfig, ModelRows};
use crate::offline::continuous::{ContinuousDataset, ContinuousEpisode};
use crate::{NnError, Result};

/// The dynamics ensemble a [`PrimorlTask`] trains.
pub trait PrimorlTaskExt {
    /// The ensemble for the dataset's environment (box observations and actions), with identity
    /// input normalisation: the shape only. The normalisation comes from the public split once
    /// the dataset is loaded.
    fn ensemble_shape(&self) -> std::result::Result<crate::ensemble::EnsembleSpec, TaskError>;
}

impl PrimorlTaskExt for PrimorlTask {
    fn ensemble_shape(&self) -> std::result::Result<crate::ensemble::EnsembleSpec, TaskError> {
        // A Gymnasium dataset's spaces are the ones its table declares (the workers are
        // checked against them at generation): no Python is needed to know the shape.
        if let Some((_, g)) = self.dataset.generated().and_then(|s| s.gymnasium_env()) {
            let spec = crate::ensemble::EnsembleSpec::new(
                g.obs_dim,
                g.act_dim,
                self.ensemble.hidden.clone(),
                self.ensemble.members,
            );
            spec.check().map_err(|e| model_error("task.ensemble", e))?;
            return Ok(spec);
        }
        // A stored dataset without `env` records its own: read from its header.
        let env_id = match self.dataset.env() {
            Some(e) => e.to_string(),
            None => crate::offline::data_root(None)
                .map_err(|e| model_error("task.dataset", e))
                .and_then(|root| {
                    crate::offline::continuous::source_env(&self.dataset, &root)
                        .map_err(|e| model_error("task.dataset", e))
                })?,
        };
        let env = fedrl_sim::make(&env_id).map_err(|e| model_error("task.dataset.env", e))?;
        let (obs_dim, act_dim) = match (env.observation_space(), env.action_space()) {
            (fedrl_sim::Space::Box { low: o, .. }, fedrl_sim::Space::Box { low: a, .. }) => {
                (o.len(), a.len())
            }
            (o, a) => {
                return Err(TaskError::Invalid(format!(
                    "task.dataset.env: PriMORL needs box observations and actions, `{env_id}` has {o:?} and {a:?}"
                )));
            }
        };
        let spec = crate::ensemble::EnsembleSpec::new(
            obs_dim,
            act_dim,
            self.ensemble.hidden.clone(),
            self.ensemble.members,
        );
        spec.check().map_err(|e| model_error("task.ensemble", e))?;
        Ok(spec)
    }
}

fn model_error(
    field: &'static str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> TaskError {
    TaskError::Model {
        field,
        source: Box::new(e),
    }
}

/// The task's ensemble for `dataset`, its inputs normalised by the mean and standard deviation
/// of the public split's steps (units from `private_units` on: public by the task's definition,
/// so nothing private shapes the model before the DP rounds).
pub fn ensemble_spec(
    task: &PrimorlTask,
    dataset: &ContinuousDataset,
    private_units: u64,
) -> Result<EnsembleSpec> {
    let mut spec = task
        .ensemble_shape()
        .map_err(|e: TaskError| NnError::Invalid(e.to_string()))?;
    if dataset.meta.obs_dim != spec.obs_dim || dataset.meta.act_dim != spec.act_dim {
        return Err(NnError::Invalid(format!(
            "dataset of {} has observations of {} and actions of {}; the task's ensemble expects {} and {}",
            dataset.meta.env_id,
            dataset.meta.obs_dim,
            dataset.meta.act_dim,
            spec.obs_dim,
            spec.act_dim
        )));
    }
    let (public, _) = dataset.split(private_units);
    if public.is_empty() {
        return Err(NnError::Invalid(format!(
            "the dataset's public split is empty ({} episodes, {private_units} private)",
            dataset.episodes.len(),
        )));
    }
    let (mean, std) = dataset.input_stats(&public);
    spec.input_offset = mean;
    spec.input_scale = std;
    if task.ensemble.normalize_targets {
        spec.output_scale = target_scales(&public, spec.obs_dim)?;
    }
    spec.check()?;
    Ok(spec)
}

/// Standard deviation of each component of `(s' - s, r)` over `episodes` (the public split),
/// floored at 1e-6 of the largest so a constant component cannot divide by zero.
pub fn target_scales(episodes: &[&ContinuousEpisode], d: usize) -> Result<Vec<f32>> {
    let mut sum = vec![0.0f64; d + 1];
    let mut sq = vec![0.0f64; d + 1];
    let mut n = 0usize;
    for e in episodes {
        for t in 0..e.len() {
            for k in 0..=d {
                let y = if k < d {
                    f64::from(e.observations[(t + 1) * d + k] - e.observations[t * d + k])
                } else {
                    f64::from(e.rewards[t])
                };
                sum[k] += y;
                sq[k] += y * y;
            }
            n += 1;
        }
    }
    if n == 0 {
        return Err(NnError::Invalid(
            "target normalisation: the public split has no transitions".into(),
        ));
    }
    let std: Vec<f64> = sum
        .iter()
        .zip(&sq)
        .map(|(s, q)| {
            let m = s / n as f64;
            (q / n as f64 - m * m).max(0.0).sqrt()
        })
        .collect();
    let floor = std.iter().cloned().fold(0.0, f64::max).max(1e-12) * 1e-6;
    Ok(std.iter().map(|s| s.max(floor) as f32).collect())
}

/// The public split's rows (units from `private_units` on), concatenated (the early-stopping
/// set).
pub fn public_rows(
    dataset: &ContinuousDataset,
    private_units: u64,
    spec: &EnsembleSpec,
) -> Result<ModelRows> {
    let (public, _) = dataset.split(private_units);
    let mut rows = ModelRows::default();
    for e in public {
        let r = e.model_rows(spec)?;
        rows.inputs.extend_from_slice(&r.inputs);
        rows.targets.extend_from_slice(&r.targets);
    }
    Ok(rows)
}

/// The local update of a trajectory under the round's clip norm C (+inf in a non-private twin,
/// which then projects onto `nonprivate_clip_norm` if the task sets one).
pub fn local_config(task: &PrimorlTask, clip_norm: f64) -> LocalModelConfig {
    let e = &task.ensemble;
    let clip_norm = if clip_norm.is_finite() {
        clip_norm
    } else {
        e.nonprivate_clip_norm.unwrap_or(f64::INFINITY)
    };
    LocalModelConfig {
        epochs: e.epochs,
        batch_size: e.batch_size,
        lr: e.lr,
        weight_decay: e.weight_decay,
        clip_norm,
        clipping: e.clipping,
    }
}

/// The minibatch-order seed of `unit` in `round` (not privacy noise: any fixed rule will do).
pub fn trajectory_seed(data_seed: u64, round: u64, unit: u64) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64 ^ data_seed;
    for w in [round, unit] {
        h ^= w.wrapping_add(0x9e37_79b9_7f4a_7c15);
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 31;
    }
    h
}

/// The training rows of every private episode among `episodes` (units below
/// `private_units`: public units never train), by unit.
pub fn private_rows<'a>(
    private_units: u64,
    spec: &EnsembleSpec,
    episodes: impl IntoIterator<Item = &'a ContinuousEpisode>,
) -> Result<std::collections::BTreeMap<u64, ModelRows>> {
    let mut out = std::collections::BTreeMap::new();
    for e in episodes {
        if e.unit < private_units {
            out.insert(e.unit, e.model_rows(spec)?);
        }
    }
    Ok(out)
}

/// Seed 001's normalised score: Pendulum-v1's return mapped from [-1500, 0] to [0, 1000]
/// (appendix C); dm_control tasks already score in [0, 1000] and are returned unchanged.
pub fn normalized_return(env_id: &str, ret: f64) -> f64 {
    // Gymnasium's Pendulum-v1 through the bridge is the same task (same reward).
    if env_id.strip_prefix("gymnasium:").unwrap_or(env_id) == "Pendulum-v1" {
        (ret + 1500.0) / 1500.0 * 1000.0
    } else {
        ret
    }
}

/// The public split's transitions, from which a fraction `policy.public_start_fraction` of the
/// policy phase's rollouts branch; `None` (nothing kept) when that fraction is 0. `policy` is
/// the task's policy settings or a re-run's overrides of them; units from `private_units` on
/// are public (the task's `dataset.units`).
pub fn public_start_states(
    policy: &fedrl_common::task::primorl::PolicyPhaseConfig,
    dataset: &ContinuousDataset,
    private_units: u64,
) -> Result<Option<crate::sac::ReplayBuffer>> {
    if policy.public_start_fraction <= 0.0 {
        return Ok(None);
    }
    let (public, _) = dataset.split(private_units);
    if public.is_empty() {
        return Err(NnError::Invalid(
            "public_start_fraction > 0, but the dataset has no public split".into(),
        ));
    }
    real_transitions(dataset.meta.obs_dim, dataset.meta.act_dim, public).map(Some)
}

/// What a policy phase reads besides the released model, taken from the dataset once: MOPO's
/// real transitions (only when `real`) and the public split's start states (when
/// `policy.public_start_fraction > 0`). Holding them, nothing later reads the dataset.
#[derive(Default)]
pub struct PolicyData {
    pub real: Option<crate::sac::ReplayBuffer>,
    pub public: Option<crate::sac::ReplayBuffer>,
}

impl PolicyData {
    /// Units from `private_units` on are public (the task's `dataset.units`).
    pub fn from_dataset(
        policy: &fedrl_common::task::primorl::PolicyPhaseConfig,
        dataset: &ContinuousDataset,
        private_units: u64,
        real: bool,
    ) -> Result<Self> {
        let real = if real {
            Some(real_transitions(
                dataset.meta.obs_dim,
                dataset.meta.act_dim,
                &dataset.episodes,
            )?)
        } else {
            None
        };
        Ok(PolicyData {
            real,
            public: public_start_states(policy, dataset, private_units)?,
        })
    }

    /// The buffers as [`policy_phase`] takes them.
    pub fn starts(&self) -> StartData<'_> {
        StartData {
            real: self.real.as_ref(),
            public: self.public.as_ref(),
        }
    }
}

/// Every transition of `episodes` in a replay buffer (the MOPO baseline's real data; a time
/// limit is not a terminal state).
pub fn real_transitions<'a>(
    obs_dim: usize,
    act_dim: usize,
    episodes: impl IntoIterator<Item = &'a ContinuousEpisode>,
) -> Result<crate::sac::ReplayBuffer> {
    let episodes: Vec<&ContinuousEpisode> = episodes.into_iter().collect();
    let steps: usize = episodes.iter().map(|e| e.len()).sum();
    let mut buffer = crate::sac::ReplayBuffer::new(obs_dim, act_dim, steps.max(1))?;
    for e in episodes {
        let n = e.len();
        if e.observations.len() != (n + 1) * obs_dim || e.actions.len() != n * act_dim {
            return Err(NnError::Invalid(format!(
                "episode of unit {}: {} observation and {} action values for {n} steps",
                e.unit,
                e.observations.len(),
                e.actions.len()
            )));
        }
        for t in 0..n {
            let last = t + 1 == n;
            buffer.push(
                &e.observations[t * obs_dim..(t + 1) * obs_dim],
                &e.actions[t * act_dim..(t + 1) * act_dim],
                e.rewards[t],
                &e.observations[(t + 1) * obs_dim..(t + 2) * obs_dim],
                last && e.terminated,
            )?;
        }
    }
    Ok(buffer)
}

/// How far, in public-split standard deviations, a model state may leave the public mean
/// before its rollout is cut.
const ROLLOUT_STD_BOUND: f32 = 10.0;

/// Per observation coordinate, the box model rollouts must stay in: the environment's
/// observation space where it is finite (with 5% slack), otherwise the public split's mean plus or minus
/// [`ROLLOUT_STD_BOUND`] standard deviations (public information only: the ensemble's input
/// normalisation comes from the public split).
fn rollout_bounds(space: &fedrl_sim::Space, spec: &EnsembleSpec) -> Vec<(f32, f32)> {
    (0..spec.obs_dim)
        .map(|i| {
            let wide = (
                spec.input_offset[i] - ROLLOUT_STD_BOUND * spec.input_scale[i],
                spec.input_offset[i] + ROLLOUT_STD_BOUND * spec.input_scale[i],
            );
            match space {
                fedrl_sim::Space::Box { low, high }
                    if low[i].is_finite() && high[i].is_finite() =>
                {
                    // A little slack: a model's cos(theta) of 1.001 is noise, not divergence.
                    let slack = 0.05 * (high[i] - low[i]);
                    (low[i] - slack, high[i] + slack)
                }
                fedrl_sim::Space::Box { .. } => wide,
                fedrl_sim::Space::Discrete { .. } => wide,
            }
        })
        .collect()
}

/// Rollout batches tried in a row before a model whose every state leaves the box is refused.
const MAX_EMPTY_REFRESHES: usize = 20;

/// What one epoch of the policy phase measured.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PolicyEpoch {
    /// 1-based epoch.
    pub epoch: usize,
    /// SAC updates so far.
    pub updates: u64,
    /// Mean undiscounted return of the deterministic policy in the real environment (reward
    /// units) over the evaluation episodes, and its standard deviation.
    pub eval_return: f64,
    pub eval_return_std: f64,
    /// [`normalized_return`] of `eval_return`.
    pub normalized_return: f64,
    /// The standard deviation of the episodes' normalised returns (the normalisation is
    /// affine: `eval_return_std` times its slope).
    #[serde(default)]
    pub normalized_return_std: f64,
    /// Evaluation episodes behind the mean (0 in reports written before it was recorded).
    #[serde(default)]
    pub eval_episodes: usize,
    /// Mean model reward before the penalty, and mean penalty `lambda u`, over this epoch's
    /// rollout steps.
    pub model_reward: f64,
    pub penalty: f64,
    /// Temperature, critic loss and entropy of the epoch's last update.
    pub alpha: f64,
    pub q_loss: f64,
    pub entropy: f64,
    /// Per observation coordinate, the lowest and highest value of the model states this
    /// epoch's rollouts added to SAC's buffer (all inside the plausible box; empty when the
    /// epoch made no rollout).
    #[serde(default)]
    pub model_obs_range: Vec<(f32, f32)>,
    /// Seconds since the phase started.
    pub seconds: f64,
}

/// First reset seed of the policy phase's real-environment evaluations; far from the dataset's
/// mixed 64-bit episode seeds and the start-state seeds drawn below.
const EVAL_SEED_BASE: u64 = 3_000_000_000;

/// Where a policy phase may branch its model rollouts from, besides the environment's public
/// initial distribution and the model's own states.
#[derive(Clone, Copy, Default)]
pub struct StartData<'a> {
    /// The real dataset's transitions (the MOPO baseline only: reading them is not
    /// post-processing of the released model).
    pub real: Option<&'a crate::sac::ReplayBuffer>,
    /// The public split's transitions (no privacy unit's data; any scenario).
    pub public: Option<&'a crate::sac::ReplayBuffer>,
}

/// Start states of one batch of `cfg.rollout_batch` model rollouts, concatenated: a fraction
/// `cfg.data_start_fraction` drawn from the real transitions' states (MOPO's branching; only
/// when `data.real` is given), then, of the rest, a fraction `cfg.public_start_fraction` from
/// the public split's states (when `data.public` is given), then, of the rest, a fraction
/// `cfg.model_start_fraction` from states the model generated earlier (`model`, once it holds
/// any), and the others from `env`'s public initial distribution.
pub fn rollout_starts(
    cfg: &fedrl_common::task::primorl::PolicyPhaseConfig,
    data: StartData<'_>,
    model: &crate::sac::ReplayBuffer,
    rng: &mut impl rand::Rng,
    env: &mut dyn fedrl_sim::Env,
) -> Result<Vec<f32>> {
    use rand::RngExt;
    let n = cfg.rollout_batch;
    let obs_dim = env.observation_space().dim();
    let mut starts = Vec::with_capacity(n * obs_dim);
    // How many of the rollouts from index `from` on a buffer takes, one draw per rollout (no
    // draws at all for a missing buffer or a zero fraction, so each setting's stream of
    // random numbers stays what it was before the others existed).
    let mut take =
        |buffer: Option<&crate::sac::ReplayBuffer>, fraction: f64, from: usize| match buffer {
            Some(b) if fraction > 0.0 && !b.is_empty() => {
                (from..n).filter(|_| rng.random::<f64>() < fraction).count()
            }
            _ => 0,
        };
    let from_data = take(data.real, cfg.data_start_fraction, 0);
    let from_public = take(data.public, cfg.public_start_fraction, from_data);
    let from_model = take(
        Some(model),
        cfg.model_start_fraction,
        from_data + from_public,
    );
    for (buffer, count) in [(data.real, from_data), (data.public, from_public)] {
        if let (Some(b), true) = (buffer, count > 0) {
            starts.extend(b.sample(count, rng)?.obs);
        }
    }
    if from_model > 0 {
        starts.extend(model.sample(from_model, rng)?.next_obs);
    }
    let mut o = vec![0.0f32; obs_dim];
    for _ in from_data + from_public + from_model..n {
        env.reset(rng.random_range(0..EVAL_SEED_BASE), &mut o);
        starts.extend_from_slice(&o);
    }
    Ok(starts)
}

/// The policy phase of PriMORL (seed 001, Algorithm 4): SAC trained only on rollouts of the
/// pessimistic model `ensemble` (reward `r - lambda u`), `rollout_length` steps long, started
/// from the environment's public initial distribution or, for a fraction
/// `model_start_fraction`, from states the model generated earlier, and, for a fraction
/// `public_start_fraction`, from the public split's states (`data.public`). With
/// `data.real = None` no private data is read: the policy is post-processing of the released
/// ensemble and the public split. The MOPO baseline passes the real transitions (see
/// [`real_transitions`]), draws `cfg.real_ratio` of each minibatch from them and branches
/// `cfg.data_start_fraction` of the rollouts from their states. After every epoch the deterministic policy is evaluated in the real
/// environment `env_id` (a diagnostic; it reads no data either) and `on_epoch` sees the result.
pub fn policy_phase(
    ensemble: &crate::ensemble::Ensemble,
    env_id: &str,
    cfg: &fedrl_common::task::primorl::PolicyPhaseConfig,
    data: StartData<'_>,
    device: &candle_core::Device,
    on_epoch: &mut dyn FnMut(&PolicyEpoch),
) -> Result<(crate::sac::SacAgent, Vec<PolicyEpoch>)> {
    let env = PhaseEnv::Sim(fedrl_sim::make(env_id)?);
    let (agent, curve, _) = policy_phase_in(ensemble, env_id, env, cfg, data, device, on_epoch)?;
    Ok((agent, curve))
}

/// The real environment of a policy phase, as the phase sees it.
pub enum PhaseEnv {
    /// fedrl's own: rollouts start from its resets (its public initial distribution), and each
    /// epoch's policy is evaluated in it.
    Sim(Box<dyn fedrl_sim::Env>),
    /// An environment known by its spaces only: a Gymnasium environment, which the aggregator
    /// cannot step (it runs no Python, DESIGN §2.6). Rollouts that would start from the
    /// environment's resets start from `initial` instead: the first observations of the public
    /// split's episodes (public data: a sample of the same initial distribution), drawn
    /// uniformly. No epoch is evaluated here: each epoch's actor is returned instead, for
    /// `fedrl run` to evaluate through the bridge on [`eval_seed`]'s episodes, and the epochs'
    /// evaluation fields are left at 0 (the report marks the curve `deferred`).
    Recorded {
        spaces: crate::offline::continuous::RecordedSpaces,
        /// `k x obs_dim` start states, `k >= 1`.
        initial: Vec<f32>,
    },
}

/// The reset seed of evaluation episode `k` of a policy phase with settings `cfg`: the same in
/// the aggregator and in a deferred evaluation.
pub fn eval_seed(cfg: &fedrl_common::task::primorl::PolicyPhaseConfig, k: usize) -> u64 {
    EVAL_SEED_BASE + cfg.seed * 10_000 + k as u64
}

/// The first observation of each episode of `episodes` (the public split's: where a
/// [`PhaseEnv::Recorded`] phase's rollouts start instead of the environment's resets).
pub fn initial_states<'a>(
    obs_dim: usize,
    episodes: impl IntoIterator<Item = &'a ContinuousEpisode>,
) -> Vec<f32> {
    episodes
        .into_iter()
        .filter(|e| e.observations.len() >= obs_dim)
        .flat_map(|e| e.observations[..obs_dim].iter().copied())
        .collect()
}

/// [`policy_phase`] in `env`; also returns each epoch's actor parameters when `env` is
/// [`PhaseEnv::Recorded`] (empty otherwise).
pub fn policy_phase_in(
    ensemble: &crate::ensemble::Ensemble,
    env_id: &str,
    mut env: PhaseEnv,
    cfg: &fedrl_common::task::primorl::PolicyPhaseConfig,
    data: StartData<'_>,
    device: &candle_core::Device,
    on_epoch: &mut dyn FnMut(&PolicyEpoch),
) -> Result<(crate::sac::SacAgent, Vec<PolicyEpoch>, Vec<Vec<f32>>)> {
    use rand::RngExt;
    use rand::SeedableRng;
    use rand::rngs::Xoshiro256PlusPlus;

    use crate::sac::{ReplayBuffer, SacAgent, SacConfig};

    let started = std::time::Instant::now();
    let (obs_space, act_space) = match &env {
        PhaseEnv::Sim(e) => (e.observation_space().clone(), e.action_space().clone()),
        PhaseEnv::Recorded { spaces, initial } => {
            let d = spaces.obs_low.len();
            if d == 0 || initial.is_empty() || initial.len() % d != 0 {
                return Err(NnError::Invalid(format!(
                    "{env_id}: the policy phase needs the public split's initial states ({} \
                     values for observations of {d})",
                    initial.len()
                )));
            }
            (
                spaces.observation_space(),
                fedrl_sim::Space::Box {
                    low: spaces.act_low.clone(),
                    high: spaces.act_high.clone(),
                },
            )
        }
    };
    let obs_dim = obs_space.dim();
    let fedrl_sim::Space::Box { low, high } = act_space else {
        return Err(NnError::Invalid(format!(
            "{env_id}: the policy phase needs box actions"
        )));
    };
    let spec = ensemble.spec();
    let bounds = rollout_bounds(&obs_space, spec);
    if spec.obs_dim != obs_dim || spec.act_dim != low.len() {
        return Err(NnError::Invalid(format!(
            "{env_id} has observations of {obs_dim} and actions of {}; the ensemble models {} and {}",
            low.len(),
            spec.obs_dim,
            spec.act_dim
        )));
    }
    let sac_cfg = SacConfig {
        hidden: cfg.hidden.clone(),
        actor_lr: cfg.lr,
        critic_lr: cfg.lr,
        alpha_lr: cfg.lr,
        gamma: cfg.gamma,
        batch_size: cfg.batch_size,
        target_entropy: Some(cfg.target_entropy),
        ..SacConfig::default()
    };
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(cfg.seed);
    let mut agent = SacAgent::new(obs_dim, &low, &high, &sac_cfg, rng.random(), device)?;
    // Enough room for the rollouts of about 50 refreshes (MOPO keeps several epochs of them).
    let capacity = (cfg.rollout_batch * cfg.rollout_length * 50).max(cfg.batch_size);
    let mut buffer = ReplayBuffer::new(obs_dim, low.len(), capacity)?;
    let mut curve = Vec::with_capacity(cfg.epochs);
    let (mut reward_sum, mut penalty_sum, mut steps) = (0.0f64, 0.0f64, 0u64);

    if cfg.public_start_fraction > 0.0 && data.public.is_none_or(|p| p.is_empty()) {
        return Err(NnError::Invalid(format!(
            "policy phase: public_start_fraction = {} needs the public split's transitions",
            cfg.public_start_fraction
        )));
    }
    let real = data.real;
    // MOPO's split of each minibatch; without real data every row is a model row.
    let n_real = match real {
        Some(r) if !r.is_empty() => {
            ((cfg.real_ratio * cfg.batch_size as f64).round() as usize).min(cfg.batch_size)
        }
        Some(_) => {
            return Err(NnError::Invalid(
                "policy phase: the real-data buffer is empty".into(),
            ));
        }
        None if cfg.reads_data() => {
            return Err(NnError::Invalid(format!(
                "policy phase: real_ratio = {} and data_start_fraction = {} need the real transitions",
                cfg.real_ratio, cfg.data_start_fraction
            )));
        }
        None => 0,
    };
    let n_model = cfg.batch_size - n_real;

    let rollouts = |agent: &mut SacAgent,
                    buffer: &mut ReplayBuffer,
                    rng: &mut Xoshiro256PlusPlus,
                    env: &mut PhaseEnv,
                    range: &mut Vec<(f32, f32)>|
     -> Result<(f64, f64, u64)> {
        let starts = match env {
            PhaseEnv::Sim(e) => rollout_starts(cfg, data, buffer, rng, e.as_mut())?,
            PhaseEnv::Recorded { initial, .. } => {
                let mut from = InitialStates {
                    states: initial,
                    obs_space: &obs_space,
                };
                rollout_starts(cfg, data, buffer, rng, &mut from)?
            }
        };
        let (mut r_sum, mut p_sum, mut count) = (0.0, 0.0, 0u64);
        let mut cur = starts;
        for _ in 0..cfg.rollout_length {
            if cur.is_empty() {
                break;
            }
            let act = agent.act(&cur, false)?;
            let step = ensemble.step(
                &cur,
                &act,
                cfg.uncertainty,
                cfg.uncertainty_in_learned_units,
                cfg.lambda,
                rng,
            )?;
            let a = low.len();
            let mut next = Vec::with_capacity(cur.len());
            for (k, r) in step.reward.iter().enumerate() {
                let s2 = &step.next_obs[k * obs_dim..(k + 1) * obs_dim];
                // A model state outside the public plausible box ends that rollout (no terminal
                // states in these tasks): an undertrained or noisy model otherwise compounds
                // its error into states no real trajectory reaches, and SAC's targets explode.
                let inside = s2
                    .iter()
                    .zip(&bounds)
                    .all(|(x, (lo, hi))| x.is_finite() && x >= lo && x <= hi);
                if !(r.is_finite() && inside) {
                    continue;
                }
                let pen = cfg.lambda * step.uncertainty[k];
                buffer.push(
                    &cur[k * obs_dim..(k + 1) * obs_dim],
                    &act[k * a..(k + 1) * a],
                    *r,
                    s2,
                    false,
                )?;
                r_sum += f64::from(*r) + pen;
                p_sum += pen;
                count += 1;
                if range.is_empty() {
                    range.resize(obs_dim, (f32::INFINITY, f32::NEG_INFINITY));
                }
                for (x, (lo, hi)) in s2.iter().zip(range.iter_mut()) {
                    (*lo, *hi) = (lo.min(*x), hi.max(*x));
                }
                next.extend_from_slice(s2);
            }
            cur = next;
        }
        Ok((r_sum, p_sum, count))
    };

    let mut last = Default::default();
    let mut updates = 0u64;
    let mut actors = Vec::new();
    let mut range = Vec::new();
    for epoch in 1..=cfg.epochs {
        for u in 0..cfg.updates_per_epoch {
            if u % cfg.rollout_every == 0 || buffer.len() < n_model.max(1) {
                let mut tries = 0;
                loop {
                    let (r, p, c) =
                        rollouts(&mut agent, &mut buffer, &mut rng, &mut env, &mut range)?;
                    reward_sum += r;
                    penalty_sum += p;
                    steps += c;
                    tries += 1;
                    if buffer.len() >= n_model.max(1) {
                        break;
                    }
                    if tries >= MAX_EMPTY_REFRESHES {
                        return Err(NnError::Invalid(format!(
                            "policy phase: after {tries} batches of {} rollouts the model gave only {} transitions inside the plausible state box (fewer than a minibatch of {}); the ensemble is too poor to plan in",
                            cfg.rollout_batch,
                            buffer.len(),
                            cfg.batch_size
                        )));
                    }
                }
            }
            let mut batch = buffer.sample(n_model, &mut rng)?;
            if let (Some(r), true) = (real, n_real > 0) {
                batch.append(r.sample(n_real, &mut rng)?);
            }
            last = agent.update(&batch)?;
            updates += 1;
        }
        let (m, sd) = match &mut env {
            PhaseEnv::Sim(e) => evaluate_actor(&mut agent, e.as_mut(), cfg)?,
            PhaseEnv::Recorded { .. } => {
                actors.push(agent.actor_params()?);
                (0.0, 0.0)
            }
        };
        let deferred = matches!(env, PhaseEnv::Recorded { .. });
        let e = PolicyEpoch {
            epoch,
            updates,
            eval_return: m,
            eval_return_std: sd,
            normalized_return: normalized_return(env_id, m),
            normalized_return_std: sd
                * (normalized_return(env_id, 1.0) - normalized_return(env_id, 0.0)).abs(),
            eval_episodes: if deferred { 0 } else { cfg.eval_episodes },
            model_reward: reward_sum / steps.max(1) as f64,
            penalty: penalty_sum / steps.max(1) as f64,
            alpha: last.alpha,
            q_loss: last.q_loss,
            entropy: last.entropy,
            model_obs_range: std::mem::take(&mut range),
            seconds: started.elapsed().as_secs_f64(),
        };
        (reward_sum, penalty_sum, steps) = (0.0, 0.0, 0);
        on_epoch(&e);
        curve.push(e);
    }
    Ok((agent, curve, actors))
}

/// The deterministic policy of `agent` over `cfg.eval_episodes` episodes of `env`, episode `k`
/// reset with [`eval_seed`]`(cfg, k)`: the mean undiscounted return and its (population)
/// standard deviation. The policy phase's per-epoch evaluation.
pub fn evaluate_actor(
    agent: &mut crate::sac::SacAgent,
    env: &mut dyn fedrl_sim::Env,
    cfg: &fedrl_common::task::primorl::PolicyPhaseConfig,
) -> Result<(f64, f64)> {
    let obs_dim = env.observation_space().dim();
    let mut returns = Vec::with_capacity(cfg.eval_episodes);
    let mut obs = vec![0.0f32; obs_dim];
    for k in 0..cfg.eval_episodes {
        env.reset(eval_seed(cfg, k), &mut obs);
        let mut ret = 0.0;
        loop {
            let a = agent.act(&obs, true)?;
            let mut next = vec![0.0f32; obs_dim];
            let s = env.step(fedrl_sim::Action::Continuous(&a), &mut next)?;
            obs = next;
            ret += s.reward;
            if s.terminated || s.truncated {
                break;
            }
        }
        returns.push(ret);
    }
    Ok(mean_std(&returns))
}

/// Metadata key of an actor-snapshot file (JSON: `{"epochs": E}`).
pub const SNAPSHOTS_META_KEY: &str = "fedrl.primorl_policy_actors";

/// Writes each policy-phase epoch's actor to `path`: tensors `actor.<epoch>` (1-based), each
/// the flat parameters [`crate::sac::SacAgent::actor_params`] gives, written to a temporary
/// file renamed into place.
pub fn save_actor_snapshots(actors: &[Vec<f32>], path: &std::path::Path) -> Result<()> {
    use crate::tensor_io::{Tensor, serialize};
    let tensors: Vec<Tensor> = actors
        .iter()
        .enumerate()
        .map(|(i, a)| Tensor::f32(format!("actor.{}", i + 1), vec![a.len()], a))
        .collect();
    let meta = serde_json::json!({ "epochs": actors.len() }).to_string();
    let bytes = serialize(&tensors, SNAPSHOTS_META_KEY, meta)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Reads [`save_actor_snapshots`]'s file: the actors of epochs `1..=E`, in order.
pub fn load_actor_snapshots(path: &std::path::Path) -> Result<Vec<Vec<f32>>> {
    use crate::tensor_io::{le_f32s, metadata_entry, parse, tensor_bytes};
    let bytes = std::fs::read(path)?;
    let bad = |m: &str| NnError::Invalid(format!("{}: {m}", path.display()));
    let meta = metadata_entry(&bytes, SNAPSHOTS_META_KEY)?
        .ok_or_else(|| bad("not a policy snapshot file"))?;
    let epochs = serde_json::from_str::<serde_json::Value>(&meta)
        .ok()
        .and_then(|v| v["epochs"].as_u64())
        .ok_or_else(|| bad("no epoch count"))?;
    let st = parse(&bytes)?;
    (1..=epochs)
        .map(|e| {
            Ok(le_f32s(tensor_bytes(
                &st,
                &format!("actor.{e}"),
                safetensors::Dtype::F32,
                None,
            )?))
        })
        .collect()
}

/// Evaluates each of `actors` (loaded into `agent` in turn) in the default environment of the
/// `gymnasium:<id>` dataset `spec` (`gymnasium.make(id, **kwargs)`) through the bridge, on the
/// episodes the policy phase evaluates in (episode `k` reset with [`eval_seed`]`(cfg, k)`):
/// per actor, the mean return and its standard deviation, as [`evaluate_actor`] computes them.
/// The `cfg.eval_episodes` episodes are played together, each step one message per worker and
/// the workers concurrently; every action is the actor's on that episode's observation alone,
/// so the figures are those a one-episode-at-a-time loop gives. `on_actor(i, mean, std)`
/// follows the progress.
pub fn evaluate_actors_gym(
    spec: &fedrl_common::task::primorl::ContinuousDatasetSpec,
    agent: &mut crate::sac::SacAgent,
    actors: &[Vec<f32>],
    cfg: &fedrl_common::task::primorl::PolicyPhaseConfig,
    on_actor: &mut dyn FnMut(usize, f64, f64),
) -> Result<Vec<(f64, f64)>> {
    use crate::offline::gym::{
        bridge_config, make_envs, reset_shares, start_declared, step_shares,
    };
    use fedrl_sim::gym_bridge::{DeclaredAction, DeclaredSpaces};
    let Some((id, g)) = spec.gymnasium_env() else {
        return Err(NnError::Invalid(format!(
            "{:?} is not a gymnasium:<id> dataset",
            spec.env
        )));
    };
    let mut pool = start_declared(
        bridge_config(id, g.bridge(), spec.seed),
        DeclaredSpaces {
            obs_dim: g.obs_dim,
            action: DeclaredAction::Box { dim: g.act_dim },
        },
    )?;
    let n = cfg.eval_episodes;
    let users: Vec<u64> = (0..n as u64).collect();
    let mut envs = make_envs(&mut pool, &users, &vec![g.kwargs.clone(); n])?;
    let shares = pool.workers();
    let (d, a) = (g.obs_dim, g.act_dim);
    let seeds: Vec<u64> = (0..n).map(|k| eval_seed(cfg, k)).collect();
    let mut out = Vec::with_capacity(actors.len());
    for (i, actor) in actors.iter().enumerate() {
        agent.set_actor_params(actor)?;
        let mut obs = vec![0.0f32; n * d];
        reset_shares(&mut envs, &seeds, &mut obs, d, shares)?;
        let mut returns = vec![0.0f64; n];
        let mut live: Vec<usize> = (0..n).collect();
        while !live.is_empty() {
            let mut actions = Vec::with_capacity(live.len() * a);
            for &k in &live {
                actions.extend(agent.act(&obs[k * d..(k + 1) * d], true)?);
            }
            let steps = step_shares(&mut envs, &live, &actions, a, &mut obs, d, shares)?;
            let mut still = Vec::with_capacity(live.len());
            for (&k, s) in live.iter().zip(steps) {
                returns[k] += s.reward;
                if !(s.terminated || s.truncated) {
                    still.push(k);
                }
            }
            live = still;
        }
        let (m, sd) = mean_std(&returns);
        on_actor(i, m, sd);
        out.push((m, sd));
    }
    Ok(out)
}

/// Mean and population standard deviation (0 and 0 for no values).
pub fn mean_std(returns: &[f64]) -> (f64, f64) {
    if returns.is_empty() {
        return (0.0, 0.0);
    }
    let m = returns.iter().sum::<f64>() / returns.len() as f64;
    let var = returns.iter().map(|r| (r - m).powi(2)).sum::<f64>() / returns.len() as f64;
    (m, var.sqrt())
}

/// The public split's initial states as an "environment" whose reset draws one of them: what
/// [`rollout_starts`] reads of a [`PhaseEnv::Recorded`] environment. Only `reset` and the
/// observation space are used; the reset seed picks the state (uniform over them).
struct InitialStates<'a> {
    states: &'a [f32],
    obs_space: &'a fedrl_sim::Space,
}

impl fedrl_sim::Env for InitialStates<'_> {
    fn id(&self) -> &'static str {
        "public-initial-states"
    }
    fn observation_space(&self) -> &fedrl_sim::Space {
        self.obs_space
    }
    fn action_space(&self) -> &fedrl_sim::Space {
        self.obs_space
    }
    fn reset(&mut self, seed: u64, obs: &mut [f32]) {
        let d = self.obs_space.dim();
        let n = (self.states.len() / d.max(1)) as u64;
        let k = (seed % n.max(1)) as usize;
        obs[..d].copy_from_slice(&self.states[k * d..(k + 1) * d]);
    }
    fn step(
        &mut self,
        _action: fedrl_sim::Action<'_>,
        _obs: &mut [f32],
    ) -> std::result::Result<fedrl_sim::Step, fedrl_sim::SimError> {
        Err(fedrl_sim::SimError::Invalid(
            "the public split's initial states cannot be stepped".into(),
        ))
    }
    fn state(&self) -> Vec<f64> {
        Vec::new()
    }
    fn set_state(
        &mut self,
        _state: &[f64],
        _obs: &mut [f32],
    ) -> std::result::Result<(), fedrl_sim::SimError> {
        Err(fedrl_sim::SimError::Invalid(
            "the public split's initial states have no state to set".into(),
        ))
    }
}
