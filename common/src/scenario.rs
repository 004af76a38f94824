//! Scenario configuration (TOML). Every field has a documented default.
//!
//! A scenario says who takes part (users, client agents, participation model), how rounds run
//! (cohort, quorum, deadline), the privacy parameters (clip norm C, noise multiplier z, delta,
//! budget), the stress model (churn) and the task. The task is a tagged enum ([`Task`]): adding a
//! task is adding a variant and its parameter struct.
//!
//! ```toml
//! name = "mean-estimation"
//! seed = 7                       # optional: seeded noise, reproducible, NOT private
//! rounds = 20
//! users = 400
//! client_agents = 2
//! participation = { kind = "fresh" }        # or { kind = "sampled", rate = 0.05 }
//! cohort_size = 20
//! quorum = 15
//! round_deadline_s = 5.0
//! clip_norm = 1.0
//! noise_multiplier = 1.0
//! delta = 1e-5
//! target_epsilon = 10.0
//!
//! [churn]
//! drop_before_upload = 0.1
//!
//! [task]
//! kind = "mean_estimation"
//! dim = 16
//! ```

use std::path::Path;

use rand::SeedableRng;
use rand::rngs::ChaCha20Rng;
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::privacy::accountant::{self, AccountantKind};
use crate::privacy::ledger::{LedgerConfig, Participation, UnitKind, training_event};
use crate::privacy::params::{ClipNorm, Delta, NoiseMultiplier};
use crate::privacy::{DpEvent, PrivacyError};
use crate::protocol::DEFAULT_MAX_FRAME_BYTES;

/// Why a scenario could not be loaded.
#[derive(Debug, Error)]
pub enum ScenarioError {
    #[error("cannot read scenario {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid scenario{}: {message}", .path.as_ref().map(|p| format!(" {p}")).unwrap_or_default())]
    Parse {
        path: Option<String>,
        message: String,
    },
    #[error("invalid scenario: {0}")]
    Invalid(String),
}

/// A whole deployment: see the module documentation for an example.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Name used in reports. Default `"unnamed"`.
    #[serde(default = "d_name")]
    pub name: String,
    /// When set, noise is drawn from a seeded generator (reproducible, **not private**; the ledger
    /// and report say so) and cohorts and simulated data are reproducible. Default: none (noise
    /// from the OS CSPRNG).
    #[serde(default)]
    pub seed: Option<u64>,
    /// Number of rounds to attempt (released plus abandoned). Default 10.
    #[serde(default = "d_rounds")]
    pub rounds: u64,
    /// Size of the population: units `0..users`. Default 100.
    #[serde(default = "d_users")]
    pub users: u64,
    /// Client-agent processes `fedrl run` starts; the users are split evenly. Default 1.
    #[serde(default = "d_one")]
    pub client_agents: u32,
    /// `fresh` (each unit contributes at most once ever) or `sampled` with `rate` (the
    /// aggregator draws a Poisson sample every round). Default `fresh`.
    #[serde(default = "d_participation")]
    pub participation: Participation,
    /// Units per round under `fresh` participation; this is also the fixed public denominator.
    /// Ignored under `sampled` (the denominator is `rate x users`). Default 10.
    #[serde(default = "d_cohort")]
    pub cohort_size: u64,
    /// Minimum number of accepted updates for a round to be released; fewer at the deadline and
    /// the round is abandoned. Default: half the expected cohort, rounded up (at least 1).
    #[serde(default)]
    pub quorum: Option<u64>,
    /// Seconds from the round offer to its close. Default 10.
    #[serde(default = "d_deadline")]
    pub round_deadline_s: f64,
    /// Seconds the aggregator waits for the whole population to be connected before the first
    /// round (it starts earlier if everybody is there). Default 30.
    #[serde(default = "d_start_timeout")]
    pub start_timeout_s: f64,
    /// L2 clip norm C of one unit's update. Default 1.
    #[serde(default = "d_clip")]
    pub clip_norm: f64,
    /// Noise multiplier z: the sum gets N(0, (z C)^2 I). Default 1. `"auto"`: the smallest z
    /// whose reported epsilon at `delta` after `rounds` rounds is at most `target_epsilon`
    /// (one analytic Gaussian per unit under `fresh`, PLD over `rounds` Poisson-sampled rounds
    /// under `sampled`); resolved when the scenario is loaded, so reports and the resolved
    /// scenario file show the number used.
    #[serde(default = "d_noise", deserialize_with = "noise_or_auto")]
    pub noise_multiplier: f64,
    /// The delta every epsilon is reported at. Default 1e-5.
    #[serde(default = "d_delta")]
    pub delta: f64,
    /// Budget: a round that would push the reported epsilon above it is refused and the run
    /// stops. Default 10.
    #[serde(default = "d_target_epsilon")]
    pub target_epsilon: f64,
    /// What a unit is: `user`, `trajectory` or `expert`. Default `user`.
    #[serde(default = "d_unit_kind")]
    pub unit_kind: UnitKind,
    /// Checkpoint every K released rounds (and at shutdown). Default 10.
    #[serde(default = "d_checkpoint")]
    pub checkpoint_every: u64,
    /// Hard maximum frame size in bytes, checked before allocation. Default 64 MiB.
    #[serde(default = "d_max_frame")]
    pub max_frame_bytes: u64,
    /// A non-private baseline ("twin"): no clipping and no noise anywhere, nothing recorded in
    /// the ledger, and every report says epsilon = infinity. For comparison runs only.
    /// Default false.
    #[serde(default)]
    pub non_private: bool,
    /// What the aggregator's event journal (in its state directory; operator-only) keeps of each
    /// update: `"digest"` (every event, an update only by round, unit, client, length and
    /// SHA-256 digest: no user data on disk) or `"full"` (the update bodies too: users' raw,
    /// unclipped updates on disk, sensitive, for the operator's exact replay of a run only).
    /// Default `"digest"`.
    #[serde(default)]
    pub journal: JournalMode,
    /// Stress-test misbehaviour of client agents. Default: none.
    #[serde(default)]
    pub churn: Churn,
    /// What is trained.
    pub task: Task,
}

/// What the event journal keeps of each update (see [`Scenario::journal`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JournalMode {
    /// Updates by their digest only (no user data on disk).
    #[default]
    Digest,
    /// Updates with their bodies (operator-only, sensitive; makes an exact replay possible).
    Full,
}

/// Churn model applied by client agents to each offered unit independently (stress tests).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Churn {
    /// Probability that a unit computes its update but never uploads it. Default 0.
    #[serde(default)]
    pub drop_before_upload: f64,
    /// Probability, per round offer, that the agent drops its connection half-way through
    /// uploading (it reconnects with backoff). Default 0.
    #[serde(default)]
    pub disconnect_mid_upload: f64,
    /// Extra delay before each upload, uniform in `[0, added_latency_s]` seconds. Default 0.
    #[serde(default)]
    pub added_latency_s: f64,
}

impl Churn {
    /// True when the model does nothing.
    pub fn is_none(&self) -> bool {
        self.drop_before_upload == 0.0
            && self.disconnect_mid_upload == 0.0
            && self.added_latency_s == 0.0
    }
}

/// The task: a tagged enum (`kind = "..."` in TOML). Add a variant per task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
// A scenario holds one task, parsed once: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Task {
    /// DP federated mean estimation: each user holds a private vector; the aggregator learns
    /// their mean (needs no RL; proves the transport, engine and ledger on their own).
    MeanEstimation(MeanEstimationTask),
    /// User-level DP policy gradient (seed 004): users play episodes in their own simulators
    /// and send clipped local PPO updates. Needs fedrl-common's `nn` feature.
    #[cfg(feature = "nn")]
    Dppg(DppgTask),
    /// User-level DP log-linear policy gradient with the L2 trust-region clipping rule (seed 004
    /// §4.2.1, its Riverswim experiments): the scenario's clip norm is derived from the trust
    /// region (see [`Scenario::derived_clip_norm`]). Needs fedrl-common's `nn` feature.
    #[cfg(feature = "nn")]
    #[serde(rename = "loglinear_pg")]
    LogLinearPg(LogLinearTask),
}

impl Task {
    /// Length of the model and of every update (number of f32).
    pub fn dim(&self) -> usize {
        match self {
            Task::MeanEstimation(t) => t.dim,
            #[cfg(feature = "nn")]
            Task::Dppg(t) => t.model_spec().map(|m| m.layout().len()).unwrap_or(0),
            #[cfg(feature = "nn")]
            Task::LogLinearPg(t) => t.spec().map(|s| s.dim()).unwrap_or(0),
        }
    }

    /// The JSON form carried on the wire.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{}".into())
    }

    /// Parses the JSON form carried on the wire.
    pub fn from_json(text: &str) -> Result<Self, ScenarioError> {
        serde_json::from_str(text).map_err(|e| ScenarioError::Parse {
            path: None,
            message: format!("task specification: {e}"),
        })
    }
}

/// Parameters of [`Task::Dppg`]: the population of simulated users, the policy, the local update
/// and the server side.
///
/// Training users are ids `0..users`; evaluation uses held-out users `users..users + eval_users`
/// of the same population, never a training user.
#[cfg(feature = "nn")]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DppgTask {
    /// Population name or environment id (`fedrl sim list`). Default `CartPole-v1`.
    #[serde(default = "d_population")]
    pub population: String,
    /// Seed of the population's per-user parameters. Default 0.
    #[serde(default)]
    pub population_seed: u64,
    /// Seed of the initial global parameters. Default 0.
    #[serde(default)]
    pub model_seed: u64,
    /// Base seed of the users' episodes (simulation randomness, not privacy noise). Default 0.
    #[serde(default)]
    pub episode_seed: u64,
    /// Server learning rate applied to the released noisy mean update. Default 1.
    #[serde(default = "d_one_f")]
    pub server_lr: f64,
    /// Server momentum in [0, 1). Default 0.
    #[serde(default)]
    pub server_momentum: f64,
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
    pub local: crate::nn::LocalUpdateConfig,
}

#[cfg(feature = "nn")]
impl DppgTask {
    /// The policy/value model for the population's environment.
    pub fn model_spec(&self) -> Result<crate::nn::ModelSpec, ScenarioError> {
        let pop = fedrl_sim::population::Population::new(&self.population, self.population_seed)
            .map_err(|e| ScenarioError::Invalid(format!("task.population: {e}")))?;
        let env = pop
            .user_env(0)
            .map_err(|e| ScenarioError::Invalid(format!("task.population: {e}")))?;
        self.local
            .model_spec(env.observation_space(), env.action_space())
            .map_err(|e| ScenarioError::Invalid(format!("task.local: {e}")))
    }

    fn validate(&self) -> Result<(), ScenarioError> {
        let bad = |m: String| Err(ScenarioError::Invalid(m));
        self.model_spec()?;
        if !(self.server_lr.is_finite() && self.server_lr > 0.0) {
            return bad(format!(
                "task.server_lr must be > 0, got {}",
                self.server_lr
            ));
        }
        if !(0.0..1.0).contains(&self.server_momentum) {
            return bad(format!(
                "task.server_momentum must be in [0, 1), got {}",
                self.server_momentum
            ));
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

#[cfg(feature = "nn")]
fn d_population() -> String {
    "CartPole-v1".into()
}
#[cfg(feature = "nn")]
fn d_eval_every() -> u64 {
    5
}
#[cfg(feature = "nn")]
fn d_eval_users() -> u64 {
    20
}
#[cfg(feature = "nn")]
fn d_final_eval_users() -> u64 {
    100
}
#[cfg(feature = "nn")]
fn d_one_usize() -> usize {
    1
}

/// Parameters of [`Task::LogLinearPg`]: a log-linear policy with a linear baseline
/// (`fedrl_common::nn::loglinear`), one REINFORCE step per user, the policy learning-rate
/// schedule of seed 004 C.2.2 and the L2 trust region of §4.2.1.
///
/// The learning rate is folded into the client's update (`u = eta_t g_theta`, plus
/// `baseline_lr g_w`) and the server applies the noisy mean with learning rate 1, so the clip
/// norm `C' = eta_t C` the engine enforces is the same every round (`privacy::trust_region`).
/// The schedule counts rounds (policy updates): the paper updates after every episode of one
/// user, so its "every 50 episodes" is every 50 updates. Training users are `0..users`;
/// evaluation uses held-out users `users..`, never a training user.
#[cfg(feature = "nn")]
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

#[cfg(feature = "nn")]
impl LogLinearTask {
    /// The policy's shape for the population's environment.
    pub fn spec(&self) -> Result<crate::nn::loglinear::LogLinearSpec, ScenarioError> {
        let pop = fedrl_sim::population::Population::new(&self.population, self.population_seed)
            .map_err(|e| ScenarioError::Invalid(format!("task.population: {e}")))?;
        let env = pop
            .user_env(0)
            .map_err(|e| ScenarioError::Invalid(format!("task.population: {e}")))?;
        crate::nn::loglinear::LogLinearSpec::from_spaces(
            env.observation_space(),
            env.action_space(),
        )
        .map_err(|e| ScenarioError::Invalid(format!("task.population: {e}")))
    }

    /// The policy learning rate eta_t of `round` (rounds count from 1):
    /// `max(lr_min, lr / lr_decay_factor^floor((round - 1) / lr_decay_every))`.
    pub fn lr_at(&self, round: u64) -> f64 {
        let k = round.saturating_sub(1) / self.lr_decay_every.max(1);
        let k = i32::try_from(k).unwrap_or(i32::MAX);
        (self.lr / self.lr_decay_factor.powi(k)).max(self.lr_min)
    }

    fn validate(&self) -> Result<(), ScenarioError> {
        let bad = |m: String| Err(ScenarioError::Invalid(m));
        let pos = |x: f64| x.is_finite() && x > 0.0;
        self.spec()?;
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
            .map_err(|e| ScenarioError::Invalid(format!("task.trust_region: {e}")))?;
        if self.eval_every == 0 || self.eval_users == 0 || self.final_eval_users == 0 {
            return bad(
                "task.eval_every, task.eval_users and task.final_eval_users must be >= 1".into(),
            );
        }
        Ok(())
    }
}

#[cfg(feature = "nn")]
fn d_loglinear_population() -> String {
    "RiverSwim-v0".into()
}
#[cfg(feature = "nn")]
fn d_gamma() -> f64 {
    0.99
}
#[cfg(feature = "nn")]
fn d_loglinear_lr() -> f64 {
    12.0
}
#[cfg(feature = "nn")]
fn d_lr_decay_every() -> u64 {
    50
}
#[cfg(feature = "nn")]
fn d_lr_decay_factor() -> f64 {
    5.0
}
#[cfg(feature = "nn")]
fn d_lr_min() -> f64 {
    0.06
}
#[cfg(feature = "nn")]
fn d_baseline_lr() -> f64 {
    0.5
}
#[cfg(feature = "nn")]
fn d_trust_region() -> crate::privacy::trust_region::TrustRegion {
    crate::privacy::trust_region::TrustRegion {
        size: 3.5,
        confidence: 0.6,
        bound: crate::privacy::trust_region::TrustRegionBound::Quantile,
    }
}
#[cfg(feature = "nn")]
fn d_loglinear_eval_users() -> u64 {
    200
}
#[cfg(feature = "nn")]
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
}

fn d_name() -> String {
    "unnamed".into()
}
fn d_rounds() -> u64 {
    10
}
fn d_users() -> u64 {
    100
}
fn d_one() -> u32 {
    1
}
fn d_one_f() -> f64 {
    1.0
}
fn d_participation() -> Participation {
    Participation::Fresh
}
fn d_cohort() -> u64 {
    10
}
fn d_deadline() -> f64 {
    10.0
}
fn d_start_timeout() -> f64 {
    30.0
}
fn d_clip() -> f64 {
    1.0
}
fn d_noise() -> f64 {
    1.0
}

/// A number, or the string `"auto"` (kept as NaN until [`Scenario::resolve_noise_multiplier`]
/// replaces it; a NaN never reaches validation or the engine).
fn noise_or_auto<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum NoiseOrAuto {
        Number(f64),
        Word(String),
    }
    match NoiseOrAuto::deserialize(d)? {
        NoiseOrAuto::Number(z) if z.is_nan() => Err(serde::de::Error::custom(
            "noise_multiplier must be a number or \"auto\", got NaN",
        )),
        NoiseOrAuto::Number(z) => Ok(z),
        NoiseOrAuto::Word(w) if w == "auto" => Ok(f64::NAN),
        NoiseOrAuto::Word(w) => Err(serde::de::Error::custom(format!(
            "noise_multiplier must be a number or \"auto\", got \"{w}\""
        ))),
    }
}
fn d_delta() -> f64 {
    1e-5
}
fn d_target_epsilon() -> f64 {
    10.0
}
fn d_unit_kind() -> UnitKind {
    UnitKind::User
}
fn d_checkpoint() -> u64 {
    10
}
fn d_max_frame() -> u64 {
    DEFAULT_MAX_FRAME_BYTES
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

impl Scenario {
    /// Parses and validates TOML text.
    pub fn from_toml_str(text: &str) -> Result<Self, ScenarioError> {
        let mut s: Scenario = toml::from_str(text).map_err(|e| ScenarioError::Parse {
            path: None,
            message: e.to_string(),
        })?;
        s.resolve_noise_multiplier()?;
        s.validate()?;
        s.resolve_clip_norm()?;
        Ok(s)
    }

    /// Reads, parses and validates a TOML file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ScenarioError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let mut s: Scenario = toml::from_str(&text).map_err(|e| ScenarioError::Parse {
            path: Some(path.display().to_string()),
            message: e.to_string(),
        })?;
        s.resolve_noise_multiplier()?;
        s.validate()?;
        s.resolve_clip_norm()?;
        Ok(s)
    }

    /// The TOML form (for writing a resolved scenario next to a run's results).
    pub fn to_toml_string(&self) -> String {
        toml::to_string(self).unwrap_or_default()
    }

    /// The fixed public denominator: `cohort_size` under `fresh`, `rate x users` under `sampled`.
    pub fn expected_cohort(&self) -> f64 {
        match self.participation {
            Participation::Fresh => self.cohort_size as f64,
            Participation::Sampled { rate } => rate.get() * self.users as f64,
        }
    }

    /// The quorum, with its default resolved.
    pub fn quorum(&self) -> u64 {
        self.quorum
            .unwrap_or_else(|| ((self.expected_cohort() / 2.0).ceil() as u64).max(1))
    }

    /// The L2 bound every update is clipped to: `clip_norm` (or the clip norm derived from the
    /// task's trust region, [`Self::derived_clip_norm`]), or +inf for a non-private twin.
    pub fn effective_clip_norm(&self) -> f64 {
        if self.non_private {
            f64::INFINITY
        } else {
            // Validation has checked that the derivation succeeds.
            self.derived_clip_norm()
                .ok()
                .flatten()
                .unwrap_or(self.clip_norm)
        }
    }

    /// The clip norm a task derives from its own rule instead of `clip_norm`, if any.
    ///
    /// [`Task::LogLinearPg`]: the L2 trust-region rule of seed 004 §4.2.1 for updates that
    /// include their learning rate (`C' = eta C`, independent of eta), with `d = task.dim()` (the
    /// policy and the baseline: the baseline shares the clipped vector and its noise, so
    /// counting it in `d` is conservative for the policy's trust region), `n` the expected
    /// cohort (the fixed public denominator) and `sigma` the effective noise multiplier (a
    /// non-private twin derives `sqrt(size)` but is not clipped at all).
    pub fn derived_clip_norm(&self) -> Result<Option<f64>, ScenarioError> {
        match &self.task {
            #[cfg(feature = "nn")]
            Task::LogLinearPg(t) => t
                .trust_region
                .clip_norm(
                    self.task.dim(),
                    self.expected_cohort(),
                    self.effective_noise_multiplier(),
                    1.0,
                )
                .map(Some)
                .map_err(|e| ScenarioError::Invalid(format!("task.trust_region: {e}"))),
            _ => Ok(None),
        }
    }

    /// Replaces `clip_norm` by the derived clip norm when the task has one, so that every
    /// reader (reports, the welcome message, the resolved scenario file) sees the value used.
    fn resolve_clip_norm(&mut self) -> Result<(), ScenarioError> {
        if let Some(c) = self.derived_clip_norm()? {
            self.clip_norm = c;
        }
        Ok(())
    }

    /// The events one unit is charged with over the whole run at noise multiplier `z`, as the
    /// ledger will record them: under `fresh` one Gaussian (a unit takes part at most once);
    /// under `sampled` one Poisson-sampled Gaussian per round (every unit is charged with every
    /// sampled round, drawn or not).
    pub fn planned_unit_events(&self, z: f64) -> Vec<DpEvent> {
        let q = self.participation.sampling_rate().map(|q| q.get());
        match self.participation {
            Participation::Fresh => vec![training_event(z, None)],
            Participation::Sampled { .. } => vec![training_event(z, q); self.rounds as usize],
        }
    }

    /// Replaces `noise_multiplier = "auto"` by the smallest noise multiplier whose epsilon, as
    /// the ledger will report it ([`accountant::unit_epsilon`] on
    /// [`planned_unit_events`](Self::planned_unit_events)), stays within `target_epsilon` for
    /// the whole run. A non-private twin needs no noise and keeps the default.
    fn resolve_noise_multiplier(&mut self) -> Result<(), ScenarioError> {
        if !self.noise_multiplier.is_nan() {
            return Ok(());
        }
        if self.non_private {
            self.noise_multiplier = d_noise();
            return Ok(());
        }
        let (target, delta) = (self.target_epsilon, self.delta);
        let bad = |e: PrivacyError| {
            ScenarioError::Invalid(format!(
                "noise_multiplier = \"auto\" for epsilon {target} at delta {delta}: {e}"
            ))
        };
        let checked_delta = Delta::try_from(delta).map_err(|e| bad(e.into()))?;
        // The ledger's own figure for this z: the one accounting policy.
        let reported = |z: f64| -> Result<f64, PrivacyError> {
            Ok(accountant::unit_epsilon(
                &self.planned_unit_events(z),
                checked_delta,
                AccountantKind::Pld,
            )?
            .0)
        };
        // A starting point from the accountants' searches (they keep the feasible end); rate 1
        // is no sampling, so its rounds compose as one Gaussian.
        let mut z = match self.participation.sampling_rate().map(|q| q.get()) {
            None => crate::privacy::gaussian::sigma(target, delta),
            Some(q) if q >= 1.0 => crate::privacy::gaussian::sigma(target, delta)
                .map(|z| z * (self.rounds.max(1) as f64).sqrt()),
            Some(q) => accountant::noise_multiplier(
                target,
                delta,
                q,
                self.rounds.max(1),
                AccountantKind::Pld,
            ),
        }
        .map_err(bad)?;
        // Round-off in the ledger's own evaluation could still put it a hair above the budget,
        // which would refuse the last round. Step up until the ledger's figure fits.
        for _ in 0..64 {
            if reported(z).map_err(bad)? <= target {
                self.noise_multiplier = z;
                return Ok(());
            }
            z *= 1.0 + 1e-9;
        }
        Err(ScenarioError::Invalid(format!(
            "noise_multiplier = \"auto\": no noise multiplier near {z} meets epsilon {target}"
        )))
    }

    /// The noise multiplier applied: `noise_multiplier`, or 0 for a non-private twin.
    pub fn effective_noise_multiplier(&self) -> f64 {
        if self.non_private {
            0.0
        } else {
            self.noise_multiplier
        }
    }

    /// The ledger header this scenario runs under (`delta` checked again: the fields are
    /// public and may have changed since [`validate`](Self::validate)).
    pub fn ledger_config(&self) -> Result<LedgerConfig, ScenarioError> {
        Ok(LedgerConfig {
            target_epsilon: self.target_epsilon,
            delta: Delta::try_from(self.delta)
                .map_err(|e| ScenarioError::Invalid(e.to_string()))?,
            unit_kind: self.unit_kind,
            participation: self.participation,
        })
    }

    /// The unit range client agent `index` of `client_agents` hosts (an even split).
    pub fn agent_units(&self, index: u32) -> crate::protocol::UnitRange {
        let n = self.client_agents.max(1) as u64;
        let i = index as u64;
        crate::protocol::UnitRange {
            start: self.users * i / n,
            end: self.users * (i + 1) / n,
        }
    }

    /// Checks every field; the message names the field and the allowed values.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        let bad = |m: String| Err(ScenarioError::Invalid(m));
        let finite_pos = |x: f64| x.is_finite() && x > 0.0;
        if self.rounds == 0 {
            return bad("rounds must be at least 1".into());
        }
        if self.users == 0 {
            return bad("users must be at least 1".into());
        }
        if self.client_agents == 0 || self.client_agents as u64 > self.users {
            return bad(format!(
                "client_agents must be between 1 and users ({}), got {}",
                self.users, self.client_agents
            ));
        }
        match self.participation {
            Participation::Fresh => {
                if self.cohort_size == 0 || self.cohort_size > self.users {
                    return bad(format!(
                        "cohort_size must be between 1 and users ({}), got {}",
                        self.users, self.cohort_size
                    ));
                }
            }
            // The rate's type checked it when the scenario was read.
            Participation::Sampled { .. } => {}
        }
        if let Some(q) = self.quorum
            && (q == 0 || q > self.users)
        {
            return bad(format!(
                "quorum must be between 1 and users ({}), got {q}",
                self.users
            ));
        }
        if !finite_pos(self.round_deadline_s) {
            return bad(format!(
                "round_deadline_s must be > 0, got {}",
                self.round_deadline_s
            ));
        }
        if !(self.start_timeout_s.is_finite() && self.start_timeout_s >= 0.0) {
            return bad(format!(
                "start_timeout_s must be >= 0, got {}",
                self.start_timeout_s
            ));
        }
        if let Err(e) = ClipNorm::try_from(self.clip_norm) {
            return bad(format!("clip_norm: {e}"));
        }
        if let Err(e) = NoiseMultiplier::try_from(self.noise_multiplier) {
            return bad(format!("noise_multiplier: {e}"));
        }
        if let Err(e) = Delta::try_from(self.delta) {
            return bad(format!("delta: {e}"));
        }
        if !finite_pos(self.target_epsilon) {
            return bad(format!(
                "target_epsilon must be > 0, got {}",
                self.target_epsilon
            ));
        }
        if self.checkpoint_every == 0 {
            return bad("checkpoint_every must be at least 1".into());
        }
        for (name, p) in [
            ("churn.drop_before_upload", self.churn.drop_before_upload),
            (
                "churn.disconnect_mid_upload",
                self.churn.disconnect_mid_upload,
            ),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return bad(format!("{name} must be a probability in [0, 1], got {p}"));
            }
        }
        if !(self.churn.added_latency_s.is_finite() && self.churn.added_latency_s >= 0.0) {
            return bad(format!(
                "churn.added_latency_s must be >= 0, got {}",
                self.churn.added_latency_s
            ));
        }
        match &self.task {
            #[cfg(feature = "nn")]
            Task::Dppg(t) => t.validate()?,
            #[cfg(feature = "nn")]
            Task::LogLinearPg(t) => t.validate()?,
            Task::MeanEstimation(t) => {
                if !(t.mean_norm.is_finite() && t.user_std.is_finite() && t.user_std >= 0.0) {
                    return bad(
                        "task.mean_norm and task.user_std must be finite, user_std >= 0".into(),
                    );
                }
                if !t.server_lr.is_finite() {
                    return bad("task.server_lr must be finite".into());
                }
            }
        }
        let dim = self.task.dim();
        if dim == 0 || dim > (u32::MAX / 4) as usize {
            return bad(format!(
                "task dim must be between 1 and {}, got {dim}",
                u32::MAX / 4
            ));
        }
        // A derived clip norm replaces `clip_norm`: an explicit different value is a mistake.
        if let Some(c) = self.derived_clip_norm()?
            && self.clip_norm != d_clip()
            && (self.clip_norm - c).abs() > 1e-12 * c
        {
            return bad(format!(
                "clip_norm ({}) is derived from task.trust_region here ({c}); remove clip_norm",
                self.clip_norm
            ));
        }
        let need = dim as u64 * 4 + 4096;
        if self.max_frame_bytes < need {
            return bad(format!(
                "max_frame_bytes ({}) is too small for vectors of dim {dim} (need at least {need})",
                self.max_frame_bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_scenario_gets_defaults() {
        let s = Scenario::from_toml_str("[task]\nkind = \"mean_estimation\"\n").unwrap();
        assert_eq!(s.rounds, 10);
        assert_eq!(s.participation, Participation::Fresh);
        assert_eq!(s.quorum(), 5);
        assert_eq!(s.task.dim(), 16);
        assert_eq!(s.expected_cohort(), 10.0);
    }

    /// `noise_multiplier = "auto"` gives the smallest z that keeps the ledger's reported
    /// epsilon within the budget: the analytic Gaussian under `fresh`, PLD under `sampled`.
    #[test]
    fn automatic_noise_multiplier_meets_the_target() {
        let fresh = Scenario::from_toml_str(
            "noise_multiplier = \"auto\"\ntarget_epsilon = 1.0\ndelta = 1e-5\n\
             [task]\nkind = \"mean_estimation\"\n",
        )
        .unwrap();
        let z = fresh.noise_multiplier;
        let eps = crate::privacy::gaussian::epsilon(z, 1e-5).unwrap();
        assert!(eps <= 1.0 && eps > 1.0 - 1e-6, "z {z} eps {eps}");
        // The scenarios' hand-set z = 3.74 is a little above the exact 3.73.
        assert!((3.72..3.74).contains(&z), "{z}");
        // The resolved file carries the number and parses to the same scenario.
        let again = Scenario::from_toml_str(&fresh.to_toml_string()).unwrap();
        assert_eq!(again, fresh);

        let sampled = Scenario::from_toml_str(
            "noise_multiplier = \"auto\"\ntarget_epsilon = 2.0\nrounds = 200\nusers = 1000\n\
             participation = { kind = \"sampled\", rate = 0.01 }\n\
             [task]\nkind = \"mean_estimation\"\n",
        )
        .unwrap();
        let z = sampled.noise_multiplier;
        let event = crate::privacy::accountant::sampled_gaussian_rounds(z, 0.01, 200);
        let pld = crate::privacy::accountant::AccountantKind::Pld;
        let eps = crate::privacy::accountant::epsilon(&event, 1e-5, pld).unwrap();
        assert!(eps <= 2.0 && eps > 1.99, "z {z} eps {eps}");

        // A twin ignores it; a word other than "auto" is an error that names the field.
        let twin = Scenario::from_toml_str(
            "non_private = true\nnoise_multiplier = \"auto\"\n[task]\nkind = \"mean_estimation\"\n",
        )
        .unwrap();
        assert_eq!(twin.effective_noise_multiplier(), 0.0);
        let e = Scenario::from_toml_str(
            "noise_multiplier = \"lots\"\n[task]\nkind = \"mean_estimation\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("noise_multiplier"), "{e}");
    }

    /// The resolved z is the ledger's: a ledger fed the planned rounds accepts every one of
    /// them, and its reported figure is the one `accountant::unit_epsilon` gave the scenario
    /// (rate 1 included, where the rounds compose as one exact Gaussian).
    #[test]
    fn automatic_noise_multiplier_is_what_the_ledger_accepts() {
        use crate::privacy::ledger::{PrivacyLedger, RoundRecord};
        use crate::privacy::noise::NoiseSource;
        for (participation, rounds) in [
            ("{ kind = \"sampled\", rate = 0.2 }", 30u64),
            ("{ kind = \"sampled\", rate = 1.0 }", 50),
        ] {
            let s = Scenario::from_toml_str(&format!(
                "noise_multiplier = \"auto\"\ntarget_epsilon = 3.0\nrounds = {rounds}\n\
                 users = 50\nparticipation = {participation}\n\
                 [task]\nkind = \"mean_estimation\"\n"
            ))
            .unwrap();
            let z = s.noise_multiplier;
            let (planned, _) = accountant::unit_epsilon(
                &s.planned_unit_events(z),
                Delta::try_from(s.delta).unwrap(),
                AccountantKind::Pld,
            )
            .unwrap();
            assert!(
                planned <= 3.0 && planned > 3.0 - 1e-3,
                "{participation}: {planned}"
            );
            let dir = tempfile::tempdir().unwrap();
            let (mut l, _) =
                PrivacyLedger::open(dir.path().join("l"), s.ledger_config().unwrap()).unwrap();
            let q = s.participation.sampling_rate().map(|q| q.get());
            for r in 1..=rounds {
                let rec = RoundRecord::gaussian_round(
                    r,
                    vec![r % 50],
                    z,
                    1.0,
                    q,
                    s.expected_cohort(),
                    NoiseSource::Os,
                );
                l.append(rec).unwrap();
            }
            assert_eq!(l.epsilon().unwrap(), planned, "{participation}");
            let method = l.report().unwrap().accountant;
            let exact = if q == Some(1.0) {
                "analytic_gaussian"
            } else {
                "pld"
            };
            assert_eq!(method, exact);
        }
    }

    #[test]
    fn sampled_and_round_trip() {
        let text = r#"
            name = "t"
            seed = 3
            users = 200
            participation = { kind = "sampled", rate = 0.1 }
            [churn]
            drop_before_upload = 0.3
            [task]
            kind = "mean_estimation"
            dim = 4
        "#;
        let s = Scenario::from_toml_str(text).unwrap();
        assert_eq!(s.expected_cohort(), 20.0);
        assert_eq!(s.quorum(), 10);
        let again = Scenario::from_toml_str(&s.to_toml_string()).unwrap();
        assert_eq!(again, s);
        assert_eq!(Task::from_json(&s.task.to_json()).unwrap(), s.task);
    }

    #[test]
    fn unknown_fields_and_bad_values_are_named() {
        let err = Scenario::from_toml_str("roundz = 3\n[task]\nkind = \"mean_estimation\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("roundz"), "{err}");
        let err = Scenario::from_toml_str("[task]\nkind = \"mean_estimation\"\ndimm = 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("dimm"), "{err}");
        let err = Scenario::from_toml_str("[task]\nkind = \"nope\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("nope"), "{err}");
        let err = Scenario::from_toml_str("clip_norm = -1.0\n[task]\nkind = \"mean_estimation\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("clip_norm"), "{err}");
        // The privacy parameters' newtypes name the rule.
        let err = Scenario::from_toml_str(
            "participation = { kind = \"sampled\", rate = 1.5 }\n[task]\nkind = \"mean_estimation\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("sampling rate must be in (0, 1], got 1.5"),
            "{err}"
        );
        let err = Scenario::from_toml_str("delta = 1.0\n[task]\nkind = \"mean_estimation\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("delta: delta must be in (0, 1), got 1"),
            "{err}"
        );
        let err =
            Scenario::from_toml_str("noise_multiplier = 0.0\n[task]\nkind = \"mean_estimation\"\n")
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("noise_multiplier: noise multiplier must be positive"),
            "{err}"
        );
    }

    #[test]
    fn agents_split_users_evenly() {
        let mut s =
            Scenario::from_toml_str("users = 10\n[task]\nkind = \"mean_estimation\"\n").unwrap();
        s.client_agents = 3;
        let ranges: Vec<_> = (0..3).map(|i| s.agent_units(i)).collect();
        assert_eq!(ranges[0].start, 0);
        assert_eq!(ranges[2].end, 10);
        assert_eq!(ranges.iter().map(|r| r.len()).sum::<u64>(), 10);
    }

    #[cfg(feature = "nn")]
    #[test]
    fn loglinear_task_derives_its_clip_norm() {
        use crate::privacy::trust_region::{TrustRegion, TrustRegionBound};
        let text = "cohort_size = 8\nusers = 100\nnoise_multiplier = 3.74\n\
                    [task]\nkind = \"loglinear_pg\"\n";
        let s = Scenario::from_toml_str(text).unwrap();
        let Task::LogLinearPg(t) = &s.task else {
            panic!("{:?}", s.task)
        };
        assert_eq!(s.task.dim(), 18);
        let want = TrustRegion {
            size: 3.5,
            confidence: 0.6,
            bound: TrustRegionBound::Quantile,
        }
        .clip_norm(18, 8.0, 3.74, 1.0)
        .unwrap();
        assert_eq!(s.clip_norm, want);
        assert_eq!(s.effective_clip_norm(), want);
        // The resolved scenario round-trips (the derived value is accepted back).
        let again = Scenario::from_toml_str(&s.to_toml_string()).unwrap();
        assert_eq!(again, s);
        // The learning-rate schedule of seed 004 C.3, counted in rounds.
        assert_eq!(t.lr_at(1), 12.0);
        assert_eq!(t.lr_at(50), 12.0);
        assert!((t.lr_at(51) - 2.4).abs() < 1e-12);
        assert!((t.lr_at(101) - 0.48).abs() < 1e-12);
        assert_eq!(t.lr_at(10_000), 0.06);
        // An explicit, different clip norm is refused with a message naming the field.
        let err = Scenario::from_toml_str(&format!("clip_norm = 0.5\n{text}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("clip_norm"), "{err}");
        // The twin is unclipped and noiseless.
        let twin = Scenario::from_toml_str(&format!("non_private = true\n{text}")).unwrap();
        assert_eq!(twin.effective_clip_norm(), f64::INFINITY);
        // Markov is more conservative; a bad region is named.
        let mk = Scenario::from_toml_str(&format!(
            "{text}[task.trust_region]\nsize = 3.5\nconfidence = 0.6\nbound = \"markov\"\n"
        ))
        .unwrap();
        assert!(mk.clip_norm < s.clip_norm);
        let err = Scenario::from_toml_str(&format!(
            "{text}[task.trust_region]\nsize = 3.5\nconfidence = 1.5\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("trust_region"), "{err}");
        let err = Scenario::from_toml_str(&format!("{text}population = \"Pendulum-v1\"\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("population"), "{err}");
    }

    #[test]
    fn mean_estimation_data_is_deterministic() {
        let t = MeanEstimationTask {
            dim: 5,
            mean_norm: 2.0,
            user_std: 0.1,
            server_lr: 1.0,
            data_seed: 9,
        };
        let mu = t.true_mean();
        let n: f64 = mu.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        assert!((n - 2.0).abs() < 1e-5);
        assert_eq!(t.user_vector(&mu, 3), t.user_vector(&mu, 3));
        assert_ne!(t.user_vector(&mu, 3), t.user_vector(&mu, 4));
    }
}
