//! The task a scenario trains: plain serde data whose shape never changes with cargo features.
//!
//! What needs the model built for a task's environment (its parameter count, the checks that
//! build it) lives in `fedrl-tasks`, which implements [`TaskModels`]; a scenario is validated against
//! the implementation it is handed ([`crate::scenario::Scenario::from_toml_str_with`]). This crate
//! alone knows [`PlainTasks`]: tasks whose dimension is one of their parameters.

use rand::SeedableRng;
use rand::rngs::ChaCha20Rng;
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::privacy::ledger::UnitKind;
use crate::protocol::TaskConfig;

/// Why a task is invalid, has no known dimension, or cannot be encoded.
#[derive(Debug, Error)]
pub enum TaskError {
    /// A parameter is out of range; the message names the field (`task.server_lr`, ...).
    #[error("{0}")]
    Invalid(String),
    /// Building the task's model failed; `field` names the scenario field at fault.
    #[error("{field}: {source}")]
    Model {
        field: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The task's dimension depends on its model, which this [`TaskModels`] cannot build.
    #[error(
        "task `{kind}`: its parameter count depends on the model built for its environment; \
         load the scenario through fedrl-tasks (fedrl_tasks::scenario_from_toml_str or \
         scenario_from_file)"
    )]
    NeedsModel { kind: &'static str },
    /// The JSON form carried on the wire did not encode or decode.
    #[error("task specification: {0}")]
    Json(#[from] serde_json::Error),
}

/// What only the crate that builds a task's model knows (`fedrl_tasks::Models` for every
/// task).
pub trait TaskModels {
    /// Length of the model and of every update (number of f32). Building the model is also the
    /// validation of the fields it reads (environment, hidden sizes, preprocessing).
    fn dim(&self, task: &Task) -> Result<usize, TaskError>;
}

/// [`TaskModels`] for tasks whose dimension is one of their parameters
/// ([`Task::MeanEstimation`]); any other task is a [`TaskError::NeedsModel`], never a guess.
#[derive(Clone, Copy, Debug, Default)]
pub struct PlainTasks;

impl TaskModels for PlainTasks {
    fn dim(&self, task: &Task) -> Result<usize, TaskError> {
        match task {
            Task::MeanEstimation(t) => Ok(t.dim),
            other => Err(TaskError::NeedsModel {
                kind: other.kind_name(),
            }),
        }
    }
}

/// What every task kind's parameters (its spec) say about the kind; implemented once, beside the
/// spec. `task_kinds!` reads it, so [`Task`]'s methods need no per-kind match.
pub trait TaskSpec {
    /// The `kind` written in TOML and carried on the wire (the variant's serde tag).
    const KIND: &'static str;
    /// Version of this kind's configuration as carried on the wire ([`TaskConfig`]). Bump it
    /// when the spec changes in a way an agent built before would misread; the protocol version
    /// stays (a new kind, or a new version of one, travels as data).
    const CONFIG_VERSION: u32;
    /// What one clipped contribution holds, hence what a privacy unit is. `user` unless the
    /// kind says otherwise: calling a unit a trajectory or an expert would print a level of
    /// protection nothing enforces.
    fn unit_kind(&self) -> UnitKind {
        UnitKind::User
    }
    /// How many model-sized vectors a round offer carries (1 unless the offer also carries
    /// public state derived from earlier releases).
    fn offer_copies(&self) -> usize {
        1
    }
    /// Checks every parameter that needs no model; the message names the field.
    fn check(&self) -> Result<(), TaskError>;
}

/// Declares [`Task`] from its list of kinds (one line per kind, its doc and serde attributes
/// above it) and derives every per-kind dispatch from the kinds' [`TaskSpec`]s.
macro_rules! task_kinds {
    ($($(#[$m:meta])* $variant:ident($spec:ty),)*) => {
        /// The task: a tagged enum (`kind = "..."` in TOML), one variant per kind.
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "kind", rename_all = "snake_case")]
        // A scenario holds one task, parsed once: the size difference between variants costs
        // nothing.
        #[allow(clippy::large_enum_variant)]
        pub enum Task {
            $($(#[$m])* $variant($spec),)*
        }

        impl Task {
            /// The `kind` written in TOML.
            pub fn kind_name(&self) -> &'static str {
                match self {
                    $(Task::$variant(_) => <$spec as TaskSpec>::KIND,)*
                }
            }

            /// The version of this kind's configuration on the wire.
            pub fn config_version(&self) -> u32 {
                match self {
                    $(Task::$variant(_) => <$spec as TaskSpec>::CONFIG_VERSION,)*
                }
            }

            /// The configuration version this build reads for `kind`; `None` for a kind it
            /// does not know.
            pub fn config_version_of(kind: &str) -> Option<u32> {
                $(if kind == <$spec as TaskSpec>::KIND {
                    return Some(<$spec as TaskSpec>::CONFIG_VERSION);
                })*
                None
            }

            /// What one clipped contribution of this task holds, hence what a privacy unit is
            /// ([`TaskSpec::unit_kind`]).
            pub fn unit_kind(&self) -> UnitKind {
                match self {
                    $(Task::$variant(t) => TaskSpec::unit_kind(t),)*
                }
            }

            /// How many model-sized vectors a round offer carries ([`TaskSpec::offer_copies`]).
            pub fn offer_copies(&self) -> usize {
                match self {
                    $(Task::$variant(t) => TaskSpec::offer_copies(t),)*
                }
            }

            /// Checks every parameter that needs no model; the message names the field.
            pub fn validate(&self) -> Result<(), TaskError> {
                match self {
                    $(Task::$variant(t) => TaskSpec::check(t),)*
                }
            }
        }
    };
}

task_kinds! {
    /// DP federated mean estimation: each user holds a private vector; the aggregator learns
    /// their mean (needs no RL; proves the transport, engine and ledger on their own).
    MeanEstimation(MeanEstimationTask),
    /// User-level DP policy gradient (seed 004): users play episodes in their own simulators
    /// and send clipped local PPO updates.
    Dppg(DppgTask),
    /// User-level DP log-linear policy gradient with the L2 trust-region clipping rule (seed 004
    /// §4.2.1, its Riverswim experiments): the scenario's clip norm is derived from the trust
    /// region (see [`crate::scenario::Scenario::derived_clip_norm`]).
    #[serde(rename = "loglinear_pg")]
    LogLinearPg(LogLinearTask),
    /// Discrete CQL trained by per-unit DP-SGD on an offline dataset held by its units (DESIGN
    /// §2.3-2.5): one round is one DP-SGD step over a Poisson sample of units drawn by the
    /// aggregator.
    OfflineCql(OfflineCqlTask),
    /// PriMORL (seed 001): a dynamics-model ensemble trained by DP-FedAvg over trajectories of a
    /// continuous-action dataset (each round: a Poisson sample of trajectories drawn by the
    /// aggregator), then SAC inside the pessimistic private model on the aggregator.
    Primorl(crate::primorl::PrimorlTask),
}

impl Task {
    /// The task as the protocol carries it: its kind, the kind's configuration version and the
    /// configuration.
    pub fn to_wire(&self) -> Result<TaskConfig, TaskError> {
        Ok(TaskConfig {
            kind: self.kind_name().into(),
            config_version: self.config_version(),
            config_json: self.to_json()?,
        })
    }

    /// Reads a task carried by the protocol. A kind this build does not know, or another
    /// version of a known kind's configuration, is refused with a message naming both (before
    /// the configuration is parsed, so a newer configuration is never half-read).
    pub fn from_wire(wire: &TaskConfig) -> Result<Self, TaskError> {
        let kind = &wire.kind;
        match Self::config_version_of(kind) {
            None => Err(TaskError::Invalid(format!(
                "task kind `{kind}` (configuration version {}) is not known to this build",
                wire.config_version
            ))),
            Some(v) if v != wire.config_version => Err(TaskError::Invalid(format!(
                "task `{kind}`: configuration version {} was sent, this build reads version {v}",
                wire.config_version
            ))),
            Some(_) => {
                let task = Self::from_json(&wire.config_json)?;
                if task.kind_name() != kind {
                    return Err(TaskError::Invalid(format!(
                        "task configuration of kind `{}` sent as `{kind}`",
                        task.kind_name()
                    )));
                }
                Ok(task)
            }
        }
    }

    /// The JSON form carried on the wire.
    pub fn to_json(&self) -> Result<String, TaskError> {
        Ok(serde_json::to_string(self)?)
    }

    /// Parses the JSON form carried on the wire.
    pub fn from_json(text: &str) -> Result<Self, TaskError> {
        Ok(serde_json::from_str(text)?)
    }
}

/// Parameters of [`Task::Dppg`]: the population of simulated users, the policy, the local update
/// and the server side.
///
/// Training users are ids `0..users`; evaluation uses held-out users `users..users + eval_users`
/// of the same population, never a training user.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DppgTask {
    /// Population name or environment id (`fedrl sim list`). Default `CartPole-v1`.
    #[serde(default = "d_population")]
    pub population: String,
    /// Seed of the population's per-user parameters. Default 0.
    #[serde(default)]
    pub population_seed: u64,
    /// `uva-padova-pump*` populations only: weight of the low (hypoglycaemic) branch of the
    /// risk index in the reward, 1 being Kovatchev's symmetric index. Default: the pump
    /// setting's own (3).
    #[serde(default)]
    pub low_risk_weight: Option<f64>,
    /// `uva-padova-pump*` populations only: minutes per decision, a multiple of the 3-minute
    /// CGM sample. Default: the pump setting's own (30).
    #[serde(default)]
    pub decision_min: Option<u32>,
    /// `uva-padova-pump*` populations only: the pump's predictive low-glucose suspend (basal
    /// stops while a low is predicted; the baseline controllers run behind it too). Default:
    /// the pump setting's own (off).
    #[serde(default)]
    pub low_glucose_suspend: Option<bool>,
    /// `uva-padova-pump*` populations only: the pump's insulin-on-board limit (no basal above
    /// the programmed rate while the insulin on board covers the reading's correction; the
    /// baseline controllers run behind it too). Default: the pump setting's own (off).
    #[serde(default)]
    pub iob_limit: Option<bool>,
    /// `uva-padova-pump*` populations only: exponent k in [0, 1]; the policy's basal above the
    /// programmed rate is scaled by (14 mg/dL / (correction factor x basal per hour))^k, the
    /// patient's programmed insulin sensitivity (1: one action lowers glucose alike on every
    /// patient). Default: the pump setting's own (0, no scaling).
    #[serde(default)]
    pub sensitivity_scaling: Option<f64>,
    /// Seed of the initial global parameters. Default 0.
    #[serde(default)]
    pub model_seed: u64,
    /// Base seed of the users' episodes (simulation randomness, not privacy noise). Default 0.
    #[serde(default)]
    pub episode_seed: u64,
    /// Server learning rate applied to the released noisy mean update. Default 1.
    #[serde(default = "d_one_f")]
    pub server_lr: f64,
    /// When set, the server learning rate decays from `server_lr` at the first released round
    /// to this value at the scenario's last (`rounds`) along a half cosine; after `rounds`
    /// (a resumed run given more) it stays here. Default: none, a constant `server_lr`.
    /// Post-processing of released updates: no privacy cost.
    #[serde(default)]
    pub server_lr_final: Option<f64>,
    /// Server momentum in [0, 1) of the `sgd` server optimizer. Default 0.
    #[serde(default)]
    pub server_momentum: f64,
    /// How the server applies each released noisy mean update: `sgd` (default; `theta +=
    /// server_lr * velocity`, with `server_momentum`) or `adam` (DP-FedAdam: Adam with
    /// `server_adam_beta1`, `server_adam_beta2` and `server_adam_eps`, step size `server_lr`
    /// in parameter units per round). Post-processing of released updates: no privacy cost.
    #[serde(default)]
    pub server_optimizer: ServerOptimizerKind,
    /// Adam's first-moment decay. Default 0.9.
    #[serde(default = "d_server_adam_beta1")]
    pub server_adam_beta1: f64,
    /// Adam's second-moment decay. Default 0.99.
    #[serde(default = "d_server_adam_beta2")]
    pub server_adam_beta2: f64,
    /// Adam's denominator floor (update units; Reddi et al.'s adaptivity tau). Default 1e-3.
    #[serde(default = "d_server_adam_eps")]
    pub server_adam_eps: f64,
    /// Evaluate on held-out users every K released rounds (and at the end). Default 5.
    #[serde(default = "d_eval_every")]
    pub eval_every: u64,
    /// Held-out users evaluated during training. Default 20.
    #[serde(default = "d_eval_users")]
    pub eval_users: u64,
    /// Held-out users (one episode each) in the final evaluation. Default 100.
    #[serde(default = "d_final_eval_users")]
    pub final_eval_users: u64,
    /// Episodes per held-out user in periodic evaluations. Default 1.
    #[serde(default = "d_one_usize")]
    pub eval_episodes: usize,
    /// Stop training once a periodic evaluation on held-out users reaches this mean return (a
    /// non-private diagnostic on simulated users: post-processing, no privacy cost). Default:
    /// never; train for `rounds`.
    #[serde(default)]
    pub stop_at_return: Option<f64>,
    /// The local PPO update (episodes per user, epochs, learning rate, hidden sizes, ...); its
    /// `clip_norm` is replaced by the scenario's `clip_norm`.
    #[serde(default)]
    pub local: LocalUpdateConfig,
}

impl TaskSpec for DppgTask {
    const KIND: &'static str = "dppg";
    const CONFIG_VERSION: u32 = 1;
    fn check(&self) -> Result<(), TaskError> {
        self.validate()
    }
}

impl DppgTask {
    /// Checks the fields that need no model (`fedrl_tasks` builds the model).
    fn validate(&self) -> Result<(), TaskError> {
        let bad = |m: String| Err(TaskError::Invalid(m));
        if !(self.server_lr.is_finite() && self.server_lr > 0.0) {
            return bad(format!(
                "task.server_lr must be > 0, got {}",
                self.server_lr
            ));
        }
        if let Some(f) = self.server_lr_final
            && !(f.is_finite() && f >= 0.0)
        {
            return bad(format!("task.server_lr_final must be >= 0, got {f}"));
        }
        if !(0.0..1.0).contains(&self.server_momentum) {
            return bad(format!(
                "task.server_momentum must be in [0, 1), got {}",
                self.server_momentum
            ));
        }
        if self.server_optimizer == ServerOptimizerKind::Adam {
            if self.server_momentum != 0.0 {
                return bad(
                    "task.server_momentum applies to the sgd server optimizer; Adam's is \
                     task.server_adam_beta1"
                        .into(),
                );
            }
            for (name, b) in [
                ("server_adam_beta1", self.server_adam_beta1),
                ("server_adam_beta2", self.server_adam_beta2),
            ] {
                if !(0.0..1.0).contains(&b) {
                    return bad(format!("task.{name} must be in [0, 1), got {b}"));
                }
            }
            if !(self.server_adam_eps.is_finite() && self.server_adam_eps > 0.0) {
                return bad(format!(
                    "task.server_adam_eps must be > 0, got {}",
                    self.server_adam_eps
                ));
            }
        }
        if self.eval_every == 0 || self.eval_users == 0 || self.final_eval_users == 0 {
            return bad(
                "task.eval_every, task.eval_users and task.final_eval_users must be >= 1".into(),
            );
        }
        let l = &self.local;
        if l.episodes_per_user == 0 || l.epochs == 0 || l.minibatches == 0 || l.hidden.is_empty() {
            return bad(
                "task.local: episodes_per_user, epochs, minibatches >= 1 and hidden non-empty"
                    .into(),
            );
        }
        if !(l.lr.is_finite() && l.lr > 0.0) {
            return bad(format!("task.local.lr must be > 0, got {}", l.lr));
        }
        Ok(())
    }
}

/// Parameters of [`Task::OfflineCql`]: the dataset the units hold, the CQL loss, where the
/// per-unit gradients are computed, and the held-out evaluation.
///
/// Round `r` is one DP-SGD step: every unit sampled by the aggregator contributes the gradient
/// of the CQL loss averaged over `transitions_per_unit` of its own transitions (drawn with a
/// generator seeded by `(data_seed, r, unit)`, the same in both modes), clipped to the scenario's
/// `clip_norm`; the aggregator sums, adds the noise, divides by the expected batch
/// `rate x users` and takes one Adam step. The scenario's `users` is the dataset's number of
/// units.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OfflineCqlTask {
    /// The dataset, generated (or loaded from the cache) by every client agent for its units.
    #[serde(default)]
    pub dataset: crate::offline::DatasetSpec,
    /// Q-network and loss. `batch_size` is unused here (the batch is the sample of units).
    #[serde(default)]
    pub cql: crate::offline::CqlConfig,
    /// `federated` (default) or `central` (DESIGN §2.5).
    #[serde(default)]
    pub mode: crate::offline::UpdateMode,
    /// Central mode only: `summed` (default; the sum of the clipped gradients, quantised once)
    /// or `per_unit` (each unit's clipped gradient quantised, as in the federated mode).
    #[serde(default)]
    pub central_path: crate::offline::CentralPath,
    /// Transitions each sampled unit draws from its own data per step. Default 1.
    #[serde(default = "d_one_u32")]
    pub transitions_per_unit: u32,
    /// Seed of the transitions drawn each step (not privacy noise). Default 0.
    #[serde(default)]
    pub data_seed: u64,
    /// Greedy evaluation every K released steps (and at the end). Default 500.
    #[serde(default = "d_cql_eval_every")]
    pub eval_every: u64,
    /// Episodes of a periodic evaluation. Default 10.
    #[serde(default = "d_cql_eval_episodes")]
    pub eval_episodes: usize,
    /// Episodes of the final evaluation. Default 100.
    #[serde(default = "d_cql_final_eval_episodes")]
    pub final_eval_episodes: usize,
    /// Seed of the evaluation episodes (held out: disjoint from the dataset's seeds). Default
    /// 1_000_000.
    #[serde(default = "d_cql_eval_seed")]
    pub eval_seed: u64,
    /// Step limit of an evaluation episode; 0 (default): the environment's own limit. Seed
    /// 000 evaluates CartPole at 1,000 steps and Acrobot at 200.
    #[serde(default)]
    pub eval_max_steps: u64,
    /// Expert-level Selective DP-SGD (seed 000/002): a DataRelease of stable prefixes, then a
    /// public schedule of DP and free steps. Absent: every round is one DP-SGD step.
    #[serde(default)]
    pub selective: Option<crate::selective::SelectiveConfig>,
}

impl TaskSpec for OfflineCqlTask {
    const KIND: &'static str = "offline_cql";
    const CONFIG_VERSION: u32 = 1;
    /// A unit owns its episodes: one episode makes it a trajectory, several (an expert's
    /// demonstrations) an expert.
    fn unit_kind(&self) -> UnitKind {
        if self.dataset.episodes_per_unit == 1 {
            UnitKind::Trajectory
        } else {
            UnitKind::Expert
        }
    }
    /// The offer also carries the target network (a copy of an earlier released model, so
    /// public): online parameters, then target parameters.
    fn offer_copies(&self) -> usize {
        2
    }
    fn check(&self) -> Result<(), TaskError> {
        self.validate()
    }
}

impl OfflineCqlTask {
    fn validate(&self) -> Result<(), TaskError> {
        let bad = |m: String| Err(TaskError::Invalid(m));
        let d = &self.dataset;
        if d.units == 0 || d.episodes_per_unit == 0 {
            return bad(
                "task.dataset.units and task.dataset.episodes_per_unit must be >= 1".into(),
            );
        }
        if let crate::offline::Behaviour::PpoMixed {
            checkpoints,
            epsilon,
            ..
        } = &d.behaviour
            && (*checkpoints == 0 || !(0.0..=1.0).contains(epsilon))
        {
            return bad(format!(
                "task.dataset.behaviour: checkpoints must be >= 1 and epsilon in [0, 1], got {checkpoints} and {epsilon}"
            ));
        }
        let c = &self.cql;
        if c.hidden.is_empty() || c.hidden.contains(&0) {
            return bad("task.cql.hidden must be non-empty widths >= 1".into());
        }
        if !(0.0..=1.0).contains(&c.gamma) {
            return bad(format!("task.cql.gamma must be in [0, 1], got {}", c.gamma));
        }
        if !(c.alpha.is_finite() && c.alpha >= 0.0) {
            return bad(format!("task.cql.alpha must be >= 0, got {}", c.alpha));
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(c.learning_rate) || !positive(c.adam_eps) {
            return bad("task.cql.learning_rate and task.cql.adam_eps must be > 0".into());
        }
        if c.target_update_interval == 0 || c.batch_size == 0 {
            return bad(
                "task.cql.target_update_interval and task.cql.batch_size must be >= 1".into(),
            );
        }
        if self.transitions_per_unit == 0 {
            return bad("task.transitions_per_unit must be >= 1".into());
        }
        if self.eval_every == 0 || self.eval_episodes == 0 || self.final_eval_episodes == 0 {
            return bad(
                "task.eval_every, task.eval_episodes and task.final_eval_episodes must be >= 1"
                    .into(),
            );
        }
        if let Some(sel) = &self.selective {
            sel.validate().map_err(TaskError::Invalid)?;
        }
        Ok(())
    }
}

fn d_one_u32() -> u32 {
    1
}
fn d_cql_eval_every() -> u64 {
    500
}
fn d_cql_eval_episodes() -> usize {
    10
}
fn d_cql_final_eval_episodes() -> usize {
    100
}
fn d_cql_eval_seed() -> u64 {
    1_000_000
}

fn d_population() -> String {
    "CartPole-v1".into()
}
fn d_eval_every() -> u64 {
    5
}
fn d_eval_users() -> u64 {
    20
}
fn d_final_eval_users() -> u64 {
    100
}
fn d_one_usize() -> usize {
    1
}

/// Parameters of [`Task::LogLinearPg`]: a log-linear policy with a linear baseline
/// (`fedrl_rl::loglinear`), one REINFORCE step per user, the policy learning-rate
/// schedule of seed 004 C.2.2 and the L2 trust region of §4.2.1.
///
/// The learning rate is folded into the client's update (`u = eta_t g_theta`, plus
/// `baseline_lr g_w`) and the server applies the noisy mean with learning rate 1, so the clip
/// norm `C' = eta_t C` the engine enforces is the same every round (`privacy::trust_region`).
/// The schedule counts rounds (policy updates): the paper updates after every episode of one
/// user, so its "every 50 episodes" is every 50 updates. Training users are `0..users`;
/// evaluation uses held-out users `users..`, never a training user.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogLinearTask {
    /// Population name or environment id; needs a box observation and discrete actions.
    /// Default `RiverSwim-v0`.
    #[serde(default = "d_loglinear_population")]
    pub population: String,
    /// Seed of the population's per-user parameters. Default 0.
    #[serde(default)]
    pub population_seed: u64,
    /// Base seed of the users' episodes (simulation randomness, not privacy noise). Default 0.
    #[serde(default)]
    pub episode_seed: u64,
    /// Episodes each user plays per contribution. Default 1.
    #[serde(default = "d_one_usize")]
    pub episodes_per_user: usize,
    /// Discount factor gamma in [0, 1]. Seed 004 C.3: 0.99.
    #[serde(default = "d_gamma")]
    pub gamma: f64,
    /// Policy learning rate eta at the first round. Seed 004 C.3: 12.
    #[serde(default = "d_loglinear_lr")]
    pub lr: f64,
    /// The policy learning rate is divided by `lr_decay_factor` every this many rounds.
    /// Seed 004 C.3: 50.
    #[serde(default = "d_lr_decay_every")]
    pub lr_decay_every: u64,
    /// Divisor of the policy learning rate at each decay (>= 1). Seed 004 C.3: 5.
    #[serde(default = "d_lr_decay_factor")]
    pub lr_decay_factor: f64,
    /// Floor of the policy learning rate. Seed 004 C.3: 0.06.
    #[serde(default = "d_lr_min")]
    pub lr_min: f64,
    /// Learning rate of the baseline's regression step (the paper gives none). Default 0.5.
    #[serde(default = "d_baseline_lr")]
    pub baseline_lr: f64,
    /// The L2 trust region the clip norm is derived from. Default: seed 004 C.3's Riverswim
    /// values, size 3.5 at confidence 0.6, exact quantile rule.
    #[serde(default = "d_trust_region")]
    pub trust_region: crate::privacy::trust_region::TrustRegion,
    /// Evaluate on held-out users every K released rounds (and at the end). Default 5.
    #[serde(default = "d_eval_every")]
    pub eval_every: u64,
    /// Held-out users (one sampled episode each) in periodic evaluations. Default 200.
    #[serde(default = "d_loglinear_eval_users")]
    pub eval_users: u64,
    /// Held-out users (one sampled episode each) in the final evaluation. Default 1000.
    #[serde(default = "d_loglinear_final_eval_users")]
    pub final_eval_users: u64,
}

impl TaskSpec for LogLinearTask {
    const KIND: &'static str = "loglinear_pg";
    const CONFIG_VERSION: u32 = 1;
    fn check(&self) -> Result<(), TaskError> {
        self.validate()
    }
}

impl LogLinearTask {
    /// The policy learning rate eta_t of `round` (rounds count from 1):
    /// `max(lr_min, lr / lr_decay_factor^floor((round - 1) / lr_decay_every))`.
    pub fn lr_at(&self, round: u64) -> f64 {
        let k = round.saturating_sub(1) / self.lr_decay_every.max(1);
        let k = i32::try_from(k).unwrap_or(i32::MAX);
        (self.lr / self.lr_decay_factor.powi(k)).max(self.lr_min)
    }

    /// Checks the fields that need no model (`fedrl_tasks` builds the model).
    fn validate(&self) -> Result<(), TaskError> {
        let bad = |m: String| Err(TaskError::Invalid(m));
        let pos = |x: f64| x.is_finite() && x > 0.0;
        if self.episodes_per_user == 0 {
            return bad("task.episodes_per_user must be >= 1".into());
        }
        if !(0.0..=1.0).contains(&self.gamma) {
            return bad(format!("task.gamma must be in [0, 1], got {}", self.gamma));
        }
        if !pos(self.lr) || !pos(self.lr_min) || self.lr_min > self.lr {
            return bad(format!(
                "task.lr and task.lr_min must be > 0 with lr_min <= lr, got {} and {}",
                self.lr, self.lr_min
            ));
        }
        if self.lr_decay_every == 0
            || !(self.lr_decay_factor.is_finite() && self.lr_decay_factor >= 1.0)
        {
            return bad(format!(
                "task.lr_decay_every must be >= 1 and task.lr_decay_factor >= 1, got {} and {}",
                self.lr_decay_every, self.lr_decay_factor
            ));
        }
        if !(self.baseline_lr.is_finite() && self.baseline_lr >= 0.0) {
            return bad(format!(
                "task.baseline_lr must be >= 0, got {}",
                self.baseline_lr
            ));
        }
        self.trust_region
            .validate()
            .map_err(|e| TaskError::Invalid(format!("task.trust_region: {e}")))?;
        if self.eval_every == 0 || self.eval_users == 0 || self.final_eval_users == 0 {
            return bad(
                "task.eval_every, task.eval_users and task.final_eval_users must be >= 1".into(),
            );
        }
        Ok(())
    }
}

fn d_loglinear_population() -> String {
    "RiverSwim-v0".into()
}
fn d_gamma() -> f64 {
    0.99
}
fn d_loglinear_lr() -> f64 {
    12.0
}
fn d_lr_decay_every() -> u64 {
    50
}
fn d_lr_decay_factor() -> f64 {
    5.0
}
fn d_lr_min() -> f64 {
    0.06
}
fn d_baseline_lr() -> f64 {
    0.5
}
fn d_trust_region() -> crate::privacy::trust_region::TrustRegion {
    crate::privacy::trust_region::TrustRegion {
        size: 3.5,
        confidence: 0.6,
        bound: crate::privacy::trust_region::TrustRegionBound::Quantile,
    }
}
fn d_loglinear_eval_users() -> u64 {
    200
}
fn d_loglinear_final_eval_users() -> u64 {
    1000
}

/// Parameters of [`Task::MeanEstimation`].
///
/// User `u` holds `x_u = mu + user_std * g_u`, with `g_u` standard normal from a generator seeded
/// by `(data_seed, u)` and `mu` a fixed vector of norm `mean_norm` derived from `data_seed`. Its
/// update in a round is `x_u - theta` (theta: the global estimate); the server applies
/// `theta += server_lr * noisy_mean_update`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeanEstimationTask {
    /// Dimension of the vectors. Default 16.
    #[serde(default = "d_dim")]
    pub dim: usize,
    /// L2 norm of the true mean. Default 0.5.
    #[serde(default = "d_mean_norm")]
    pub mean_norm: f64,
    /// Per-coordinate standard deviation of users around the mean. Default 0.1.
    #[serde(default = "d_user_std")]
    pub user_std: f64,
    /// Server learning rate. Default 1.
    #[serde(default = "d_one_f")]
    pub server_lr: f64,
    /// Seed of the simulated users' data (public: it is the simulation, not the noise).
    /// Default 0.
    #[serde(default)]
    pub data_seed: u64,
}

impl TaskSpec for MeanEstimationTask {
    const KIND: &'static str = "mean_estimation";
    const CONFIG_VERSION: u32 = 1;
    fn check(&self) -> Result<(), TaskError> {
        self.validate()
    }
}

impl MeanEstimationTask {
    /// The true mean `mu` (simulation ground truth).
    pub fn true_mean(&self) -> Vec<f32> {
        let mut rng = ChaCha20Rng::seed_from_u64(self.data_seed ^ 0x6d65_616e_6d75_0000);
        let g: Vec<f64> = (0..self.dim)
            .map(|_| StandardNormal.sample(&mut rng))
            .collect();
        let norm = g
            .iter()
            .map(|x| x * x)
            .sum::<f64>()
            .sqrt()
            .max(f64::MIN_POSITIVE);
        g.iter()
            .map(|x| (x / norm * self.mean_norm) as f32)
            .collect()
    }

    /// User `unit`'s private vector, given the true mean from [`Self::true_mean`].
    pub fn user_vector(&self, mu: &[f32], unit: u64) -> Vec<f32> {
        let mut rng =
            ChaCha20Rng::seed_from_u64(self.data_seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ unit);
        mu.iter()
            .map(|m| {
                let g: f64 = StandardNormal.sample(&mut rng);
                (*m as f64 + self.user_std * g) as f32
            })
            .collect()
    }

    fn validate(&self) -> Result<(), TaskError> {
        if !(self.mean_norm.is_finite() && self.user_std.is_finite() && self.user_std >= 0.0) {
            return Err(TaskError::Invalid(
                "task.mean_norm and task.user_std must be finite, user_std >= 0".into(),
            ));
        }
        if !self.server_lr.is_finite() {
            return Err(TaskError::Invalid("task.server_lr must be finite".into()));
        }
        Ok(())
    }
}

/// The server optimizer of [`DppgTask`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerOptimizerKind {
    /// SGD with momentum (FedAvg at momentum 0).
    #[default]
    Sgd,
    /// Adam on the released updates (DP-FedAdam).
    Adam,
}

fn d_server_adam_beta1() -> f64 {
    0.9
}

fn d_server_adam_beta2() -> f64 {
    0.99
}

fn d_server_adam_eps() -> f64 {
    1e-3
}

fn d_one_f() -> f64 {
    1.0
}
fn d_dim() -> usize {
    16
}
fn d_mean_norm() -> f64 {
    0.5
}
fn d_user_std() -> f64 {
    0.1
}

/// Hyper-parameters of the local update. Every field has a default; the defaults are the ones
/// that reached a greedy evaluation return of 475 on CartPole-v1 at user-level epsilon 1
/// (cohort 1024 fresh users, server lr 1.5; see `rl/examples/fedavg_cartpole.rs`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocalUpdateConfig {
    /// Episodes each user plays per round.
    pub episodes_per_user: usize,
    /// Cap on steps per episode, 0 for the environment's own limit (a capped episode is
    /// truncated and bootstrapped).
    pub max_episode_steps: usize,
    /// Local PPO epochs over the user's data (E).
    pub epochs: usize,
    /// Minibatches per epoch (each user's steps are split into this many).
    pub minibatches: usize,
    /// Adam learning rate.
    pub lr: f64,
    /// Normalise each user's advantages to zero mean and unit variance (over the user's own
    /// steps). Default true. With one short episode per user and a policy that no longer
    /// fails, a user's advantages are mostly value-estimate noise, and normalising blows that
    /// noise up to full-size updates; false keeps advantages in (scaled) reward units.
    pub normalize_advantages: bool,
    /// Adam beta1.
    pub adam_beta1: f64,
    /// Adam beta2.
    pub adam_beta2: f64,
    /// Adam epsilon.
    pub adam_eps: f64,
    /// Per-step gradient L2 clip inside the local optimisation (0: off). Not the DP clip.
    pub max_grad_norm: f64,
    /// PPO ratio clip.
    pub clip_eps: f64,
    /// Discount factor.
    pub gamma: f64,
    /// GAE lambda.
    pub gae_lambda: f64,
    /// Value loss weight.
    pub vf_coef: f64,
    /// Entropy bonus weight.
    pub ent_coef: f64,
    /// Rewards are multiplied by this before GAE (the value network works in these units).
    pub reward_scale: f64,
    /// DP clip norm C of each user's delta (policy and value together), L2.
    pub clip_norm: f64,
    /// Hidden layer widths of the policy and of the value network.
    pub hidden: Vec<usize>,
    /// Users whose PPO steps run as one batched tensor operation.
    pub group_size: usize,
    /// Worker threads (users are split across them).
    pub threads: usize,
    /// Initial log standard deviation of Gaussian policies (nats).
    pub init_log_std: f32,
    /// Fixed public observation offsets (see `fedrl_rl::ModelSpec::obs_offset`); empty: none.
    pub obs_offset: Vec<f32>,
    /// Fixed public observation scales (see `fedrl_rl::ModelSpec::obs_scale`); empty: none.
    pub obs_scale: Vec<f32>,
    /// Action range the Gaussian policy's `[-1, 1]` maps to (see `fedrl_rl::ModelSpec::action_low`);
    /// empty: raw samples clipped to the environment's box.
    pub action_low: Vec<f32>,
    /// See `action_low`.
    pub action_high: Vec<f32>,
    /// Environment steps per policy decision (see `fedrl_rl::ModelSpec::action_repeat`); default 1.
    pub action_repeat: usize,
}

impl Default for LocalUpdateConfig {
    fn default() -> Self {
        Self {
            episodes_per_user: 1,
            max_episode_steps: 0,
            epochs: 4,
            minibatches: 2,
            lr: 2.5e-3,
            normalize_advantages: true,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_eps: 1e-5,
            max_grad_norm: 0.5,
            clip_eps: 0.2,
            gamma: 0.99,
            gae_lambda: 0.95,
            vf_coef: 0.5,
            ent_coef: 0.0,
            reward_scale: 0.1,
            clip_norm: 0.3,
            hidden: vec![32, 32],
            group_size: 64,
            threads: 2,
            init_log_std: 0.0,
            obs_offset: Vec::new(),
            obs_scale: Vec::new(),
            action_low: Vec::new(),
            action_high: Vec::new(),
            action_repeat: 1,
        }
    }
}
