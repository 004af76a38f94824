//! User-level DP policy gradient's parameters ([`Task::Dppg`], seed 004).
//!
//! This is the kind's spec: plain serde data, checked without a model. It sits in the kind's
//! folder with the rest of the kind, but `common/src/task.rs` compiles it into `fedrl-common`
//! (as `fedrl_common::task::dppg`): `Task`, which the protocol, the scenario loader and the
//! engine read without candle, names it. So `crate` here is `fedrl_common`. Adding a kind:
//! docs/adding-a-task-kind.md.

use serde::{Deserialize, Serialize};

use crate::task::{LocalUpdateConfig, ServerOptimizerKind, TaskError, TaskSpec};
// Named by the docs only.
#[cfg(doc)]
use crate::task::Task;

/// Parameters of [`Task::Dppg`]: the population of simulated users, the policy, the local update
/// and the server side.
///
/// Training users are ids `0..users`; evaluation uses held-out users `users..users + eval_users`
/// of the same population, never a training user.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DppgTask {
    /// Population name or environment id (`fedrl sim list`), or `gymnasium:<id>` for any
    /// Gymnasium environment stepped by the client agents' Python workers (then
    /// [`Self::gymnasium`] is required). Default `CartPole-v1`.
    #[serde(default = "d_population")]
    pub population: String,
    /// `gymnasium:<id>` populations only: the module to import, the users' keyword arguments,
    /// the interpreter, the workers and the spaces the task expects ([`GymnasiumSpec`]).
    #[serde(default)]
    pub gymnasium: Option<GymnasiumSpec>,
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
    /// never; train for `rounds`. Refused for `gymnasium:<id>` populations, whose evaluations
    /// run after the aggregator ended.
    #[serde(default)]
    pub stop_at_return: Option<f64>,
    /// The local PPO update (episodes per user, epochs, learning rate, hidden sizes, ...); its
    /// `clip_norm` is replaced by the scenario's `clip_norm`.
    #[serde(default)]
    pub local: LocalUpdateConfig,
}

/// How the client agents make a `gymnasium:<id>` population's environments (the Gymnasium
/// bridge, `fedrl_sim::gym_bridge`), and the spaces the task expects: the aggregator builds the
/// model from these without running Python, and every worker's spaces are checked against them
/// when it starts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GymnasiumSpec {
    /// Observation length, flattened (a Discrete observation of `n` values counts `n`: it
    /// arrives one-hot).
    pub obs_dim: usize,
    /// Discrete actions: how many. Exactly one of `actions` and `action_dim` is set.
    #[serde(default)]
    pub actions: Option<usize>,
    /// Box actions: their length (a Gaussian policy; actions are clipped to the environment's
    /// bounds, or mapped by `task.local.action_low`/`action_high`).
    #[serde(default)]
    pub action_dim: Option<usize>,
    /// A Python module imported before `gymnasium.make` (it may register the user's own
    /// environment); it must be importable by the interpreter (installed, or on `PYTHONPATH`).
    #[serde(default)]
    pub module: Option<String>,
    /// The Python interpreter. Default: `FEDRL_PYTHON`, else `.venv-bridge/bin/python` made by
    /// `scripts/install-python-bridge.sh`.
    #[serde(default)]
    pub python: Option<String>,
    /// Keyword arguments of `gymnasium.make` that every user gets.
    #[serde(default)]
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    /// Keyword arguments drawn per user (the personalisation), by name, each
    /// `{ uniform = [low, high] }`, `{ linspace = [low, high, n] }` (one of the n grid values)
    /// or `{ choice = [v1, v2, ...] }`; a pure function of `population_seed` and the user id.
    /// Drawn in name order; they override `kwargs`.
    #[serde(default)]
    pub user_kwargs: std::collections::BTreeMap<String, KwargDraw>,
    /// Worker processes per client agent; each steps its share of a round's users. Default 1.
    #[serde(default = "d_one_usize")]
    pub workers: usize,
    /// Seconds a worker may take for one batched reset or step before it is a fault (the
    /// worker is restarted and its users dropped from the round). Default 30.
    #[serde(default = "d_step_timeout_s")]
    pub step_timeout_s: f64,
    /// Seconds a worker may take to start (import, first environment) or to make a round's
    /// environments. Default 120.
    #[serde(default = "d_start_timeout_s")]
    pub start_timeout_s: f64,
    /// Workers keep their environment objects for the run: a user gets the environment an
    /// earlier user with the same keyword arguments had, reset with its own episode seed
    /// (Gymnasium's reset contract makes that the episode a new environment plays), instead of
    /// a new `gymnasium.make` every round. Default true; set false for an environment that
    /// keeps state across seeded resets.
    #[serde(default = "d_true")]
    pub reuse_envs: bool,
}

/// One drawn keyword argument of [`GymnasiumSpec::user_kwargs`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum KwargDraw {
    /// Uniform real in `[low, high)`.
    Uniform([f64; 2]),
    /// One of `n` evenly spaced values from `low` to `high`, both included.
    Linspace(f64, f64, u32),
    /// One of these values.
    Choice(Vec<serde_json::Value>),
}

impl GymnasiumSpec {
    fn validate(&self) -> Result<(), TaskError> {
        let bad = |m: String| Err(TaskError::Invalid(m));
        match (self.actions, self.action_dim) {
            (Some(n), None) if n >= 2 => {}
            (None, Some(d)) if d >= 1 => {}
            _ => {
                return bad(
                    "task.gymnasium: set exactly one of actions (>= 2 discrete actions) and \
                     action_dim (>= 1, a Box)"
                        .into(),
                );
            }
        }
        if self.obs_dim == 0 || self.workers == 0 {
            return bad("task.gymnasium: obs_dim and workers must be >= 1".into());
        }
        for (name, t) in [
            ("step_timeout_s", self.step_timeout_s),
            ("start_timeout_s", self.start_timeout_s),
        ] {
            if !(t.is_finite() && t > 0.0) {
                return bad(format!("task.gymnasium.{name} must be > 0, got {t}"));
            }
        }
        for (name, d) in &self.user_kwargs {
            let ok = match d {
                KwargDraw::Uniform([lo, hi]) => lo.is_finite() && hi.is_finite() && lo <= hi,
                KwargDraw::Linspace(lo, hi, n) => lo.is_finite() && hi.is_finite() && *n >= 1,
                KwargDraw::Choice(v) => !v.is_empty(),
            };
            if !ok {
                return bad(format!(
                    "task.gymnasium.user_kwargs.{name}: {d:?} is not a draw"
                ));
            }
        }
        Ok(())
    }
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
        match (self.population.starts_with("gymnasium:"), &self.gymnasium) {
            (true, Some(g)) => {
                g.validate()?;
                // The aggregator has no Python: its evaluations of a Gymnasium population run
                // in `fedrl run` after it ended, too late to stop training.
                if self.stop_at_return.is_some() {
                    return bad(
                        "task.stop_at_return needs evaluations during training, which a \
                         gymnasium:<id> population only gets after the run (the aggregator runs \
                         no Python); leave it out"
                            .into(),
                    );
                }
            }
            (true, None) => {
                return bad(format!(
                    "task.population = {:?} needs a [task.gymnasium] table (obs_dim, actions or \
                     action_dim, ...)",
                    self.population
                ));
            }
            (false, Some(_)) => {
                return bad("task.gymnasium applies to gymnasium:<id> populations only".into());
            }
            (false, None) => {}
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

fn d_step_timeout_s() -> f64 {
    30.0
}

fn d_true() -> bool {
    true
}

fn d_start_timeout_s() -> f64 {
    120.0
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
