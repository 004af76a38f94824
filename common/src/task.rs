//! The task a scenario trains: plain serde data whose shape never changes with cargo features.
//!
//! What needs the model built for a task's environment (its parameter count, the checks that
//! build it) lives in `fedrl-tasks`, which implements [`TaskModels`]; a scenario is validated against
//! the implementation it is handed ([`crate::scenario::Scenario::from_toml_str_with`]). This crate
//! alone knows [`PlainTasks`]: tasks whose dimension is one of their parameters.
//!
//! Each kind's parameters (its spec) live in the kind's folder in `fedrl-tasks`
//! (`tasks/src/<kind>/spec.rs`), with everything else of the kind, and are compiled here by a
//! `#[path]` module: [`Task`] names them, and it must stay readable without candle.

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
    /// Rows (per-example loss terms) one unit contributes when its rounds go through the
    /// central mode's summed path (the engine's `SummedBound` counts them); `None` (the
    /// default): the task does not use that path.
    fn central_summed_rows(&self) -> Option<u64> {
        None
    }
    /// Checks every parameter that needs no model; the message names the field.
    fn check(&self) -> Result<(), TaskError>;
}

/// Declares [`Task`] from its list of kinds (one line per kind, `Variant(module::Spec)`, its doc
/// and serde attributes above it), derives every per-kind dispatch from the kinds' [`TaskSpec`]s,
/// and exports the list to `fedrl-tasks` as [`for_each_task_kind!`](crate::for_each_task_kind).
macro_rules! task_kinds {
    ($($(#[$attr:meta])* $variant:ident($module:ident::$spec:ident),)*) => {
        /// Calls the macro `cb` with every task kind, `cb! { Variant module, ... }`: how
        /// `fedrl-tasks` builds its registry from the one list of kinds in
        /// `fedrl_common::task` (each kind's `TaskKind` type is `fedrl_tasks::<module>::<Variant>`).
        #[macro_export]
        macro_rules! for_each_task_kind {
            ($cb:ident) => {
                $cb! { $($variant $module,)* }
            };
        }

        /// The task: a tagged enum (`kind = "..."` in TOML), one variant per kind.
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "kind", rename_all = "snake_case")]
        // A scenario holds one task, parsed once: the size difference between variants costs
        // nothing.
        #[allow(clippy::large_enum_variant)]
        pub enum Task {
            $($(#[$attr])* $variant($module::$spec),)*
        }

        impl Task {
            /// The `kind` written in TOML.
            pub fn kind_name(&self) -> &'static str {
                match self {
                    $(Task::$variant(_) => <$module::$spec as TaskSpec>::KIND,)*
                }
            }

            /// The version of this kind's configuration on the wire.
            pub fn config_version(&self) -> u32 {
                match self {
                    $(Task::$variant(_) => <$module::$spec as TaskSpec>::CONFIG_VERSION,)*
                }
            }

            /// The configuration version this build reads for `kind`; `None` for a kind it
            /// does not know.
            pub fn config_version_of(kind: &str) -> Option<u32> {
                $(if kind == <$module::$spec as TaskSpec>::KIND {
                    return Some(<$module::$spec as TaskSpec>::CONFIG_VERSION);
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

            /// Rows per unit on the central summed path ([`TaskSpec::central_summed_rows`]).
            pub fn central_summed_rows(&self) -> Option<u64> {
                match self {
                    $(Task::$variant(t) => TaskSpec::central_summed_rows(t),)*
                }
            }

            /// Checks every parameter that needs no model; the message names the field.
            pub fn validate(&self) -> Result<(), TaskError> {
                match self {
                    $(Task::$variant(t) => TaskSpec::check(t),)*
                }
            }

            /// Parses `text` (a `[task]` table's fields, without `kind`) as `kind`'s spec
            /// alone: its error carries the span of the field at fault, where the tagged
            /// enum's own error can only point at `[task]`. `None` for a kind this build does
            /// not know.
            pub fn parse_spec_alone(kind: &str, text: &str) -> Option<Result<(), toml::de::Error>> {
                $(if kind == <$module::$spec as TaskSpec>::KIND {
                    return Some(toml::from_str::<$module::$spec>(text).map(|_| ()));
                })*
                None
            }
        }
    };
}

// Each kind's spec, compiled into this crate from the kind's folder (see the module doc).
#[path = "../../tasks/src/dppg/spec.rs"]
pub mod dppg;
#[path = "../../tasks/src/loglinear/spec.rs"]
pub mod loglinear;
#[path = "../../tasks/src/mean_estimation/spec.rs"]
pub mod mean_estimation;
#[path = "../../tasks/src/offline_cql/spec.rs"]
pub mod offline_cql;
#[path = "../../tasks/src/primorl/spec.rs"]
pub mod primorl;
#[path = "../../tasks/src/privorl/spec.rs"]
pub mod privorl;

pub use dppg::DppgTask;
pub use loglinear::LogLinearTask;
pub use mean_estimation::MeanEstimationTask;
pub use offline_cql::OfflineCqlTask;

task_kinds! {
    /// DP federated mean estimation: each user holds a private vector; the aggregator learns
    /// their mean (needs no RL; proves the transport, engine and ledger on their own).
    MeanEstimation(mean_estimation::MeanEstimationTask),
    /// User-level DP policy gradient (seed 004): users play episodes in their own simulators
    /// and send clipped local PPO updates.
    Dppg(dppg::DppgTask),
    /// User-level DP log-linear policy gradient with the L2 trust-region clipping rule (seed 004
    /// §4.2.1, its Riverswim experiments): the scenario's clip norm is derived from the trust
    /// region (see [`crate::scenario::Scenario::derived_clip_norm`]).
    #[serde(rename = "loglinear_pg")]
    LogLinearPg(loglinear::LogLinearTask),
    /// Discrete CQL trained by per-unit DP-SGD on an offline dataset held by its units (DESIGN
    /// §2.3-2.5): one round is one DP-SGD step over a Poisson sample of units drawn by the
    /// aggregator.
    OfflineCql(offline_cql::OfflineCqlTask),
    /// PriMORL (seed 001): a dynamics-model ensemble trained by DP-FedAvg over trajectories of a
    /// continuous-action dataset (each round: a Poisson sample of trajectories drawn by the
    /// aggregator), then SAC inside the pessimistic private model on the aggregator.
    Primorl(primorl::PrimorlTask),
    /// PrivORL-n (seed 003): a diffusion synthesizer pre-trained on public data, fine-tuned by
    /// DP-SGD with each transition a privacy unit (a Poisson sample drawn by the aggregator),
    /// sampled into a released synthetic dataset.
    Privorl(privorl::PrivorlTask),
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
