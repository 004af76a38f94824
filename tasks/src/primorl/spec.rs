//! Plain-data description of PriMORL (seed 001): the continuous-action dataset its trajectories
//! hold, the dynamics ensemble trained by DP-FedAvg over trajectories (Algorithms 1-3), and the
//! policy phase, SAC inside the pessimistic private model (Algorithm 4). The ensemble, the SAC
//! learner and the dataset generation live in `fedrl_rl`.
//!
//! This is the kind's spec: plain serde data, checked without a model. It sits in the kind's
//! folder with the rest of the kind, but `common/src/task.rs` compiles it into `fedrl-common`
//! (as `fedrl_common::task::primorl`): `Task`, which the protocol, the scenario loader and the
//! engine read without candle, names it. So `crate` here is `fedrl_common`. Adding a kind:
//! docs/adding-a-task-kind.md.

use serde::{Deserialize, Serialize};

/// How a trajectory's ensemble delta is bounded (seed 001, Algorithm 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EnsembleClipping {
    /// Each member's delta to C / sqrt(N).
    Flat,
    /// Each of the N x L layer deltas (a layer is its weight and bias) to C / sqrt(N L).
    PerLayer,
}

/// Which model uncertainty penalises the reward of the pessimistic model (seed 001, 4.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Uncertainty {
    /// u_MA(s, a) = max_i |sigma_i(s, a)|_2: the largest norm over members of the predicted
    /// standard deviations of `(s' - s, r)` (MOPO's reference implementation; the Frobenius norm
    /// of the diagonal matrix of standard deviations).
    MaxAleatoric,
    /// u_MPD(s, a) = max_{i, j} |mu_i(s, a) - mu_j(s, a)|_2 over pairs of members.
    MaxPairwiseDiff,
}

/// Who acts while a continuous-action dataset is recorded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ContinuousBehaviour {
    /// Uniformly random actions in the action box.
    Random,
    /// A replay-style mixture (seed 001, appendix D) from one SAC learning run on the simulator
    /// (nobody's data): `checkpoints` actors snapshotted evenly over `steps` environment steps,
    /// the first being the untrained actor; unit `u` plays one episode with checkpoint
    /// `u % checkpoints`, its deterministic action plus Gaussian noise of standard deviation
    /// `noise_std` (as a fraction of the action range's half-width), clipped to the box.
    /// The paper keeps every training episode of 6-600 DDPG runs (6-30 M learner steps); one
    /// learning run's checkpoints with exploration noise give the same random-to-expert mix
    /// on 2 cores.
    SacCheckpoints {
        /// Environment steps of the learning run.
        steps: u64,
        /// Snapshots, >= 2 (the untrained actor and the final one at least).
        checkpoints: u32,
        /// Exploration noise, in [0, 2].
        noise_std: f64,
    },
}

/// A named, seeded procedure that makes a continuous-action dataset: `units` private episodes of
/// `env`, one per privacy unit (unit `u` owns episode `u`), and `public` more (ids from `units`
/// on) that form the public split (seed 001 keeps 1% of the episodes public for early
/// stopping). Equal specs give equal datasets bit for bit, so a dataset is cached under a key
/// derived from its spec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContinuousDatasetSpec {
    /// Environment id with a Box action space (`Pendulum-v1`, `cartpole-balance`, ...), a
    /// population name (`pendulum-gml`), or `gymnasium:<id>` (a Gymnasium environment stepped
    /// by the bridge's Python workers, made as [`ContinuousDatasetSpec::gymnasium`] says).
    pub env: String,
    /// Private episodes K (one per unit).
    pub units: u64,
    /// Public episodes (ids `units..units + public`; no unit owns them). Default 0.
    #[serde(default)]
    pub public: u64,
    /// Seed of the behaviour's learning run and of the episodes.
    #[serde(default)]
    pub seed: u64,
    pub behaviour: ContinuousBehaviour,
    /// `env = "gymnasium:<id>"` only (required there, refused elsewhere): how the Gymnasium
    /// bridge makes the environments and the spaces they must have. Absent, and left out of
    /// the canonical JSON, for fedrl's own environments, so their cache keys do not move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gymnasium: Option<Box<ContinuousGymnasium>>,
}

/// How a `gymnasium:<id>` continuous dataset's environments are made by the Gymnasium bridge
/// (`fedrl_sim::gym_bridge`), in the process that generates the data (`fedrl run`, `fedrl data
/// generate`, a client agent), never in the aggregator, which works from the declared spaces.
///
/// Unit `u` (and public episode `u`) plays in `gymnasium.make(id, **kwargs, **drawn)`, `drawn`
/// being `user_kwargs` drawn for user `u` from the spec's `seed` (the population seed, as a
/// `gymnasium:<id>` DPPG population's users); the `sac_checkpoints` behaviour learns in the
/// default environment, `gymnasium.make(id, **kwargs)`. The same fields as the discrete
/// datasets' `[task.dataset.gymnasium]` (`crate::offline::DatasetGymnasium`), with a Box
/// action of `act_dim` values instead of `actions`, and no experts' grid.
///
/// Everything but `python`, `workers` and the deadlines enters the dataset's cache key (they do
/// not change the data: every episode is reset with its own seed and explores with its own
/// random stream).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContinuousGymnasium {
    /// Observation length (a Box observation, flattened).
    pub obs_dim: usize,
    /// Action length (a Box action; its bounds come from the environment).
    pub act_dim: usize,
    /// A Python module imported before `gymnasium.make` (it may register the user's own
    /// environment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module: Option<String>,
    /// The Python interpreter. Default: `FEDRL_PYTHON`, else `.venv-bridge/bin/python` made by
    /// `scripts/install-python-bridge.sh`. Not part of the cache key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<String>,
    /// Keyword arguments of every environment (the default one and every unit's).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    /// Keyword arguments drawn per unit (after `kwargs`), as `[task.gymnasium.user_kwargs]` of
    /// a DPPG task.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub user_kwargs: std::collections::BTreeMap<String, crate::task::dppg::KwargDraw>,
    /// Worker processes stepping the environments. Default 2. Not part of the cache key.
    #[serde(default = "d_gym_workers")]
    pub workers: usize,
    /// Seconds one batched reset or step may take. Default 60. Not part of the cache key.
    #[serde(default = "d_gym_step_timeout")]
    pub step_timeout_s: f64,
    /// Seconds a worker may take to start or to make a batch of environments. Default 300.
    /// Not part of the cache key.
    #[serde(default = "d_gym_start_timeout")]
    pub start_timeout_s: f64,
}

fn d_gym_workers() -> usize {
    crate::offline::d_gym_workers()
}
fn d_gym_step_timeout() -> f64 {
    crate::offline::d_gym_step_timeout()
}
fn d_gym_start_timeout() -> f64 {
    crate::offline::d_gym_start_timeout()
}

impl ContinuousGymnasium {
    /// The bridge's worker settings (shared with the discrete datasets' table).
    pub fn bridge(&self) -> crate::offline::BridgeFields<'_> {
        crate::offline::BridgeFields {
            module: self.module.as_deref(),
            python: self.python.as_deref(),
            kwargs: &self.kwargs,
            user_kwargs: &self.user_kwargs,
            workers: self.workers,
            step_timeout_s: self.step_timeout_s,
            start_timeout_s: self.start_timeout_s,
        }
    }

    /// Checks what needs no Python: the declared spaces, the workers, deadlines and draws.
    pub fn check(&self) -> Result<(), String> {
        if self.obs_dim == 0 || self.act_dim == 0 {
            return Err(format!(
                "task.dataset.gymnasium: obs_dim and act_dim must be >= 1 (a continuous dataset \
                 has Box observations and actions), got {} and {}",
                self.obs_dim, self.act_dim
            ));
        }
        self.bridge().check()
    }
}

/// Version of the continuous generation procedure and file layout (part of every cache key).
pub const CONTINUOUS_FORMAT_VERSION: u32 = 1;

impl ContinuousDatasetSpec {
    /// The Gymnasium id and table of a `gymnasium:<id>` spec, `None` for fedrl's own
    /// environments (checked by [`ContinuousDatasetSpec::check_gymnasium`]).
    pub fn gymnasium_env(&self) -> Option<(&str, &ContinuousGymnasium)> {
        match (
            self.env.strip_prefix(crate::offline::GYMNASIUM_PREFIX),
            &self.gymnasium,
        ) {
            (Some(id), Some(g)) => Some((id, &**g)),
            _ => None,
        }
    }

    /// The table is given exactly when `env` is `gymnasium:<id>`, and checks.
    pub fn check_gymnasium(&self) -> Result<(), String> {
        let gym = self.env.starts_with(crate::offline::GYMNASIUM_PREFIX);
        match (gym, &self.gymnasium) {
            (false, None) => Ok(()),
            (false, Some(_)) => Err(format!(
                "task.dataset.gymnasium applies to env = \"gymnasium:<id>\" only, not {:?}",
                self.env
            )),
            (true, None) => Err(format!(
                "task.dataset.env = {:?} needs a [task.dataset.gymnasium] table (obs_dim, \
                 act_dim, ...)",
                self.env
            )),
            (true, Some(g)) => {
                if self.env.len() == crate::offline::GYMNASIUM_PREFIX.len() {
                    return Err("task.dataset.env: gymnasium:<id> needs an id".into());
                }
                g.check()
            }
        }
    }

    /// This spec with what cannot change the data at its defaults: a Gymnasium dataset's
    /// interpreter path (machine-specific), worker count and deadlines. Two specs with equal
    /// identities describe the same data; the cache key and the procedure a dataset file
    /// records are computed from it.
    pub fn data_identity(&self) -> ContinuousDatasetSpec {
        let mut keyed = self.clone();
        if let Some(g) = &mut keyed.gymnasium {
            g.python = None;
            g.workers = d_gym_workers();
            g.step_timeout_s = d_gym_step_timeout();
            g.start_timeout_s = d_gym_start_timeout();
        }
        keyed
    }

    /// The stable key of this spec: FNV-1a (64 bits) of the canonical JSON of its
    /// [`ContinuousDatasetSpec::data_identity`] and [`CONTINUOUS_FORMAT_VERSION`], as 16
    /// lowercase hex digits.
    pub fn cache_key(&self) -> String {
        let canonical = serde_json::to_value(self.data_identity())
            .map(|v| v.to_string())
            .unwrap_or_else(|e| unreachable!("a ContinuousDatasetSpec always serialises: {e}"));
        let text = format!("{canonical}#continuous{CONTINUOUS_FORMAT_VERSION}");
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in text.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{h:016x}")
    }

    /// Whether episode `id` is in the public split.
    pub fn is_public(&self, id: u64) -> bool {
        id >= self.units
    }

    /// The cache file name: `<env, lower-cased>-<key>.safetensors`.
    pub fn file_name(&self) -> String {
        let env: String = self
            .env
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .collect();
        format!("{env}-{}.safetensors", self.cache_key())
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.units == 0 {
            return Err("task.dataset.units must be >= 1".into());
        }
        self.check_gymnasium()?;
        if let ContinuousBehaviour::SacCheckpoints {
            steps,
            checkpoints,
            noise_std,
        } = &self.behaviour
            && (*steps == 0 || *checkpoints < 2 || !(0.0..=2.0).contains(noise_std))
        {
            return Err(format!(
                "task.dataset.behaviour: sac_checkpoints needs steps >= 1, checkpoints >= 2 and noise_std in [0, 2], got {steps}, {checkpoints} and {noise_std}"
            ));
        }
        Ok(())
    }
}

/// A continuous-action dataset stored under the data root (`fedrl data list` shows it as
/// `continuous/<name>`: `fedrl data import` of a Box-action Minari dataset, or one PriMORL
/// generated), used as PriMORL's data without generating anything.
///
/// Its episodes, in file order, are split by position: the last `public` form the public split
/// (early stopping, the model's input normalisation, the policy phase's public starts), which
/// the data owner declares public by naming it here; the others are the privacy units, one
/// trajectory each (unit `i` is the `i`-th episode), as PriMORL's guarantee is per trajectory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredContinuous {
    /// `continuous/<name>`, as `fedrl data list` shows it.
    pub name: String,
    /// How episodes map to units: only `"episode"` (the default), PriMORL's trajectory level.
    #[serde(default)]
    pub units: crate::offline::UnitMap,
    /// The last `public` episodes of the file are the public split, >= 1.
    pub public: u64,
    /// The environment the policy phase runs and is evaluated in (`fedrl sim list`). Absent:
    /// the one the dataset records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<String>,
}

/// PriMORL's data: a generation spec, or a stored continuous dataset by name.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ContinuousSource {
    Generated(ContinuousDatasetSpec),
    Stored(StoredContinuous),
}

impl<'de> Deserialize<'de> for ContinuousSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        // The shape is chosen by `name`, so a typo is reported against the right fields (an
        // untagged enum would say only "did not match any variant").
        let v = serde_json::Value::deserialize(d)?;
        let Some(obj) = v.as_object() else {
            return Err(D::Error::custom(
                "the dataset must be a table: a generation spec (env, units, public, behaviour) or a stored dataset (name = \"continuous/<name>\", public = P)",
            ));
        };
        if obj.contains_key("name") {
            let mixed: Vec<&str> = ["behaviour", "seed"]
                .into_iter()
                .filter(|k| obj.contains_key(*k))
                .chain(
                    obj.get("units")
                        .is_some_and(serde_json::Value::is_number)
                        .then_some("units (a number)"),
                )
                .collect();
            if !mixed.is_empty() {
                return Err(D::Error::custom(format!(
                    "`name` names a stored dataset, but {} belong to a generation spec: give either `name` (with `public` and optionally `env`) or a generation spec, not both",
                    mixed.join(", ")
                )));
            }
            StoredContinuous::deserialize(v)
                .map(ContinuousSource::Stored)
                .map_err(D::Error::custom)
        } else {
            ContinuousDatasetSpec::deserialize(v)
                .map(ContinuousSource::Generated)
                .map_err(D::Error::custom)
        }
    }
}

impl From<ContinuousDatasetSpec> for ContinuousSource {
    fn from(s: ContinuousDatasetSpec) -> Self {
        ContinuousSource::Generated(s)
    }
}

impl ContinuousSource {
    /// The generation spec, when the data is generated.
    pub fn generated(&self) -> Option<&ContinuousDatasetSpec> {
        match self {
            ContinuousSource::Generated(s) => Some(s),
            ContinuousSource::Stored(_) => None,
        }
    }

    /// The environment the scenario names (a generation spec's, or a stored dataset's `env`);
    /// `None`: the one a stored dataset records.
    pub fn env(&self) -> Option<&str> {
        match self {
            ContinuousSource::Generated(s) => Some(&s.env),
            ContinuousSource::Stored(s) => s.env.as_deref(),
        }
    }

    /// Public-split episodes.
    pub fn public(&self) -> u64 {
        match self {
            ContinuousSource::Generated(s) => s.public,
            ContinuousSource::Stored(s) => s.public,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        match self {
            ContinuousSource::Generated(s) => s.validate(),
            ContinuousSource::Stored(s) => {
                let Some(file) = s.name.strip_prefix("continuous/") else {
                    return Err(format!(
                        "task.dataset.name: PriMORL reads continuous-action datasets, named `continuous/<name>` as `fedrl data list` shows them; got {:?}",
                        s.name
                    ));
                };
                if file.is_empty() || file.contains(['/', '\\']) || file.starts_with('.') {
                    return Err(format!(
                        "task.dataset.name: {:?} is not a dataset name",
                        s.name
                    ));
                }
                if s.units != crate::offline::UnitMap::Episode {
                    return Err(
                        "task.dataset.units: PriMORL's privacy unit is a trajectory, so each episode is one unit: only units = \"episode\" (the default) is accepted".into(),
                    );
                }
                if s.env.as_deref().is_some_and(str::is_empty) {
                    return Err(
                        "task.dataset.env must not be empty (leave it out to use the dataset's)"
                            .into(),
                    );
                }
                Ok(())
            }
        }
    }
}

/// The dynamics ensemble and its per-trajectory local update (seed 001, Tables 4-5).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnsembleConfig {
    /// Hidden widths of every member (swish). CartPole: [128, 128]; Pendulum: [64, 64].
    pub hidden: Vec<usize>,
    /// Members N. CartPole 5, Pendulum 3.
    pub members: usize,
    /// Flat (CartPole) or per-layer (Pendulum).
    pub clipping: EnsembleClipping,
    /// Local epochs E over the trajectory. Default 1.
    #[serde(default = "d_one_usize")]
    pub epochs: usize,
    /// Minibatch rows B. Default 16.
    #[serde(default = "d_batch")]
    pub batch_size: usize,
    /// Local SGD step size. Default 1e-3.
    #[serde(default = "d_model_lr")]
    pub lr: f64,
    /// L2 weight decay (`weight_decay / 2 |W|^2` per weight matrix). Default 5e-5.
    #[serde(default = "d_weight_decay")]
    pub weight_decay: f64,
    /// Non-private twins only (`non_private = true`, where the scenario clips nothing): the
    /// ensemble clip norm the local steps still project onto, as seed 001's "No Privacy"
    /// variant (clipping, no noise). Absent: no clipping ("No Clip"). Ignored by private runs,
    /// whose clip norm is the scenario's `clip_norm`.
    #[serde(default)]
    pub nonprivate_clip_norm: Option<f64>,
    /// Learn each component of the target `(s' - s, r)` divided by its standard deviation on the
    /// public split (public data: no privacy cost), so that the loss, the early-stopping MSE and
    /// the clip bound weigh the components alike. Needed where they differ by orders of
    /// magnitude (dm_control cart-pole at dt = 0.01 s: the cart's position change has a standard
    /// deviation of 0.004, the reward 0.27). Default false (raw targets, as seed 001).
    #[serde(default)]
    pub normalize_targets: bool,
}

/// The policy phase: SAC on rollouts of the pessimistic private model only (seed 001, Algorithm
/// 4 and Table 5), then evaluation in the real environment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyPhaseConfig {
    /// u_MA or u_MPD.
    pub uncertainty: Uncertainty,
    /// Take `u` in the units a normalised-target ensemble learns (each component of
    /// `(s' - s, r)` over its public standard deviation) instead of raw units, so that a
    /// disagreement about a small component (the cart's position change) counts as much as one
    /// about a large one. No effect on raw-target ensembles. Default false (raw units).
    #[serde(default)]
    pub uncertainty_in_learned_units: bool,
    /// Reward penalty lambda (Pendulum and CartPole: 2).
    pub lambda: f64,
    /// Rollout length H (Pendulum 30, CartPole 20).
    pub rollout_length: usize,
    /// SAC epochs; the policy is evaluated in the real environment after each.
    pub epochs: usize,
    /// SAC updates per epoch.
    pub updates_per_epoch: usize,
    /// Model rollouts started per `rollout_every` updates (batched). Default 400.
    #[serde(default = "d_rollouts")]
    pub rollout_batch: usize,
    /// Updates between two batches of rollouts. Default 250.
    #[serde(default = "d_rollout_every")]
    pub rollout_every: usize,
    /// Fraction of rollouts that start from a state the model itself generated earlier instead
    /// of the environment's public initial distribution (model states are post-processing of
    /// the released model, never data). Default 0.5.
    #[serde(default = "d_half")]
    pub model_start_fraction: f64,
    /// SAC hidden widths (actor and critics). Default [256, 256].
    #[serde(default = "d_sac_hidden")]
    pub hidden: Vec<usize>,
    /// Actor, critic and temperature learning rate. Default 3e-4.
    #[serde(default = "d_sac_lr")]
    pub lr: f64,
    /// Discount. Default 0.99.
    #[serde(default = "d_gamma")]
    pub gamma: f64,
    /// SAC minibatch. Default 256.
    #[serde(default = "d_sac_batch")]
    pub batch_size: usize,
    /// Target entropy of the automatic temperature. Default -3 (seed 001, Table 5).
    #[serde(default = "d_target_entropy")]
    pub target_entropy: f64,
    /// Real-environment episodes per evaluation. Default 10 (the paper's).
    #[serde(default = "d_eval_episodes")]
    pub eval_episodes: usize,
    /// Seed of the policy phase (SAC, rollouts; not privacy noise). Default 0.
    #[serde(default)]
    pub seed: u64,
    /// Fraction of each SAC minibatch drawn from the real dataset instead of model rollouts:
    /// MOPO's `real_ratio` (0.05 in its paper). Reading the data makes the policy no longer
    /// post-processing of the released model, so only a non-private baseline may set it.
    /// Default 0 (PriMORL: model data only).
    #[serde(default)]
    pub real_ratio: f64,
    /// Fraction of model rollouts branched from states of the real dataset, as MOPO does (its
    /// rollouts start from dataset states, so the model data covers the states its 5% of real
    /// transitions come from). Reading the data makes the policy no longer post-processing of
    /// the released model, so only a non-private baseline may set it. The remaining rollouts
    /// start as `model_start_fraction` says. Default 0 (PriMORL: the public initial
    /// distribution and model states only).
    #[serde(default)]
    pub data_start_fraction: f64,
    /// Fraction of the other model rollouts (those not branched from the real dataset)
    /// branched from states of the dataset's public split: the episodes that belong to no
    /// privacy unit and already set the ensemble's input normalisation. The policy stays
    /// post-processing of the released model and public data, so this costs no privacy and any
    /// scenario may set it. Swing-up needs it: rollouts of H steps from the hanging start never
    /// reach an upright pole (bench/README.md, "PriMORL on cart-pole swing-up"); on balance,
    /// which starts upright, it hurts. The remaining rollouts start as `model_start_fraction`
    /// says. Default 0.
    #[serde(default)]
    pub public_start_fraction: f64,
}

impl PolicyPhaseConfig {
    /// Whether the policy phase reads the real dataset (the MOPO baseline only).
    pub fn reads_data(&self) -> bool {
        self.real_ratio > 0.0 || self.data_start_fraction > 0.0
    }
}

/// Parameters of [`crate::task::Task::Primorl`]. Each of the dataset's K trajectories is one
/// privacy unit (trajectory-level DP); the scenario's `users` is K and its participation is a
/// Poisson sample at rate q drawn by the aggregator; the dataset's public episodes belong to no
/// unit. Each round, every sampled trajectory's host
/// trains the global ensemble on that trajectory alone (`ensemble`), projects onto the ensemble
/// clip ball of the scenario's `clip_norm` after every step and sends the delta; the engine
/// re-clips, sums, adds noise z C and divides by the expected count q K; the model adds the
/// result. Training stops at `rounds` or when the public split's MSE has not improved for
/// `patience` evaluations; the policy phase then runs on the aggregator without the data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrimorlTask {
    /// The trajectories: a generation spec, or a stored continuous dataset by name.
    pub dataset: ContinuousSource,
    pub ensemble: EnsembleConfig,
    /// Seed of the ensemble's initial weights. Default 0.
    #[serde(default)]
    pub model_seed: u64,
    /// Seed of the trajectories' minibatch order (not privacy noise). Default 0.
    #[serde(default)]
    pub data_seed: u64,
    /// Public-split evaluation every this many rounds. Default 10.
    #[serde(default = "d_eval_every")]
    pub eval_every: u64,
    /// Evaluations without a better public MSE before training stops (seed 001: 10). Default 10.
    #[serde(default = "d_patience")]
    pub patience: u64,
    pub policy: PolicyPhaseConfig,
}

/// One episode per unit: a PriMORL unit is a trajectory.
impl crate::task::TaskSpec for PrimorlTask {
    const KIND: &'static str = "primorl";
    const CONFIG_VERSION: u32 = 1;
    fn unit_kind(&self) -> crate::privacy::ledger::UnitKind {
        crate::privacy::ledger::UnitKind::Trajectory
    }
    fn check(&self) -> Result<(), crate::task::TaskError> {
        self.validate().map_err(crate::task::TaskError::Invalid)
    }
}

impl PrimorlTask {
    pub fn validate(&self) -> Result<(), String> {
        self.dataset.validate()?;
        if self.dataset.public() == 0 {
            return Err(
                "task.dataset.public must be >= 1: early stopping and the model's input normalisation use the public split (seed 001: 1% of the episodes)"
                    .into(),
            );
        }
        let e = &self.ensemble;
        if e.hidden.is_empty() || e.hidden.contains(&0) || e.members == 0 {
            return Err("task.ensemble: hidden widths and members must be >= 1".into());
        }
        if e.epochs == 0 || e.batch_size == 0 || !(e.lr.is_finite() && e.lr > 0.0) {
            return Err("task.ensemble: epochs, batch_size and lr must be positive".into());
        }
        if !(e.weight_decay.is_finite() && e.weight_decay >= 0.0) {
            return Err("task.ensemble.weight_decay must be >= 0".into());
        }
        if e.nonprivate_clip_norm
            .is_some_and(|c| !(c.is_finite() && c > 0.0))
        {
            return Err("task.ensemble.nonprivate_clip_norm must be finite and > 0".into());
        }
        if self.eval_every == 0 || self.patience == 0 {
            return Err("task.eval_every and task.patience must be >= 1".into());
        }
        let p = &self.policy;
        if !(p.lambda.is_finite() && p.lambda >= 0.0) {
            return Err(format!("task.policy.lambda must be >= 0, got {}", p.lambda));
        }
        if p.rollout_length == 0
            || p.epochs == 0
            || p.updates_per_epoch == 0
            || p.rollout_batch == 0
            || p.rollout_every == 0
            || p.batch_size == 0
            || p.eval_episodes == 0
        {
            return Err("task.policy: rollout_length, epochs, updates_per_epoch, rollout_batch, rollout_every, batch_size and eval_episodes must be >= 1".into());
        }
        if p.hidden.is_empty() || p.hidden.contains(&0) {
            return Err("task.policy.hidden must be non-empty widths >= 1".into());
        }
        if !(0.0..=1.0).contains(&p.model_start_fraction) || !(0.0..1.0).contains(&p.gamma) {
            return Err("task.policy: model_start_fraction in [0, 1] and gamma in [0, 1)".into());
        }
        if !(0.0..1.0).contains(&p.real_ratio) {
            return Err(format!(
                "task.policy.real_ratio must be in [0, 1), got {}",
                p.real_ratio
            ));
        }
        if !(0.0..=1.0).contains(&p.data_start_fraction) {
            return Err(format!(
                "task.policy.data_start_fraction must be in [0, 1], got {}",
                p.data_start_fraction
            ));
        }
        if !(0.0..=1.0).contains(&p.public_start_fraction) {
            return Err(format!(
                "task.policy.public_start_fraction must be in [0, 1], got {}",
                p.public_start_fraction
            ));
        }
        if !(p.lr.is_finite() && p.lr > 0.0 && p.target_entropy.is_finite()) {
            return Err("task.policy: lr must be > 0 and target_entropy finite".into());
        }
        Ok(())
    }
}

fn d_one_usize() -> usize {
    1
}
fn d_batch() -> usize {
    16
}
fn d_model_lr() -> f64 {
    1e-3
}
fn d_weight_decay() -> f64 {
    5e-5
}
fn d_rollouts() -> usize {
    400
}
fn d_rollout_every() -> usize {
    250
}
fn d_half() -> f64 {
    0.5
}
fn d_sac_hidden() -> Vec<usize> {
    vec![256, 256]
}
fn d_sac_lr() -> f64 {
    3e-4
}
fn d_gamma() -> f64 {
    0.99
}
fn d_sac_batch() -> usize {
    256
}
fn d_target_entropy() -> f64 {
    -3.0
}
fn d_eval_episodes() -> usize {
    10
}
fn d_eval_every() -> u64 {
    10
}
fn d_patience() -> u64 {
    10
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `scenarios/pendulum-primorl.toml`'s dataset: its key, computed before the Gymnasium
    /// table existed (and the name of the file it generated), must not move.
    #[test]
    fn an_existing_specs_cache_key_is_unchanged() {
        let spec: ContinuousDatasetSpec = toml::from_str(
            "env = \"Pendulum-v1\"\nunits = 29700\npublic = 300\nseed = 0\n\
             behaviour = { kind = \"sac_checkpoints\", steps = 20000, checkpoints = 10, noise_std = 0.3 }",
        )
        .expect("spec");
        assert_eq!(spec.cache_key(), "c278809e67da0d1d");
        assert!(!serde_json::to_string(&spec).unwrap().contains("gymnasium"));
        assert!(spec.validate().is_ok());
    }

    fn gym_spec() -> ContinuousDatasetSpec {
        toml::from_str(
            "env = \"gymnasium:Pendulum-v1\"\nunits = 4\npublic = 1\nseed = 2\n\
             behaviour = { kind = \"random\" }\n\
             [gymnasium]\nobs_dim = 3\nact_dim = 1\nkwargs = { g = 9.81 }",
        )
        .expect("gym spec")
    }

    #[test]
    fn the_gymnasium_table_keys_the_data_not_the_machine() {
        let spec = gym_spec();
        spec.validate().expect("valid");
        let key = spec.cache_key();
        let mut local = spec.clone();
        let g = local.gymnasium.as_mut().unwrap();
        g.python = Some("/opt/py/bin/python".into());
        g.workers = 7;
        g.step_timeout_s = 5.0;
        g.start_timeout_s = 9.0;
        assert_eq!(
            local.cache_key(),
            key,
            "python, workers and deadlines are not data"
        );
        assert_eq!(local.data_identity(), spec.data_identity());
        let mut other = spec.clone();
        other
            .gymnasium
            .as_mut()
            .unwrap()
            .kwargs
            .insert("g".into(), serde_json::json!(5.0));
        assert_ne!(other.cache_key(), key, "kwargs change the environment");
        let mut drawn = spec.clone();
        drawn.gymnasium.as_mut().unwrap().user_kwargs.insert(
            "m".into(),
            crate::task::dppg::KwargDraw::Uniform([0.5, 1.5]),
        );
        assert_ne!(drawn.cache_key(), key);
        assert_eq!(spec.gymnasium_env().map(|(id, _)| id), Some("Pendulum-v1"));
    }

    #[test]
    fn the_gymnasium_table_goes_with_a_gymnasium_env_only() {
        let mut no_table = gym_spec();
        no_table.gymnasium = None;
        let e = no_table.validate().unwrap_err();
        assert!(e.contains("needs a [task.dataset.gymnasium] table"), "{e}");
        let mut rust = gym_spec();
        rust.env = "Pendulum-v1".into();
        let e = rust.validate().unwrap_err();
        assert!(e.contains("gymnasium:<id>\" only"), "{e}");
        let mut zero = gym_spec();
        zero.gymnasium.as_mut().unwrap().act_dim = 0;
        let e = zero.validate().unwrap_err();
        assert!(e.contains("act_dim"), "{e}");
        let mut workers = gym_spec();
        workers.gymnasium.as_mut().unwrap().workers = 0;
        assert!(workers.validate().unwrap_err().contains("workers"));
        let typo = toml::from_str::<ContinuousDatasetSpec>(
            "env = \"gymnasium:Pendulum-v1\"\nunits = 4\nbehaviour = { kind = \"random\" }\n\
             [gymnasium]\nobs_dim = 3\nactions = 1",
        );
        assert!(typo.is_err(), "unknown fields are refused");
    }

    /// PrivORL's continuous variant reads the same specs but evaluates its utility in the
    /// aggregator (no Python there): a Gymnasium dataset is refused when the scenario loads.
    #[test]
    fn privorl_refuses_a_gymnasium_continuous_dataset() {
        use crate::task::TaskSpec;
        let scenario: toml::Value =
            toml::from_str(include_str!("../../../scenarios/pendulum-privorl.toml")).unwrap();
        let mut table = scenario["task"].clone();
        table.as_table_mut().expect("[task]").remove("kind");
        let mut task: crate::task::privorl::PrivorlTask = table.try_into().expect("privorl task");
        task.check().expect("the shipped scenario is valid");
        let c = task.continuous.as_mut().expect("continuous");
        c.dataset.env = "gymnasium:Pendulum-v1".into();
        c.dataset.gymnasium = gym_spec().gymnasium;
        let e = task.check().unwrap_err().to_string();
        assert!(
            e.contains("task.continuous.dataset.env") && e.contains("runs no Python"),
            "{e}"
        );
    }
}
