//! Log-linear policy gradient's parameters ([`Task::LogLinearPg`], seed 004 §4.2.1).
//!
//! This is the kind's spec: plain serde data, checked without a model. It sits in the kind's
//! folder with the rest of the kind, but `common/src/task.rs` compiles it into `fedrl-common`
//! (as `fedrl_common::task::loglinear`): `Task`, which the protocol, the scenario loader and the
//! engine read without candle, names it. So `crate` here is `fedrl_common`. Adding a kind:
//! docs/adding-a-task-kind.md.

use serde::{Deserialize, Serialize};

use crate::task::{TaskError, TaskSpec};
// Named by the docs only.
#[cfg(doc)]
use crate::task::Task;

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

fn d_eval_every() -> u64 {
    5
}

fn d_one_usize() -> usize {
    1
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
