//! DPPG's held-out evaluation, shared by the two places that run it: the aggregator's server
//! model (Rust populations, [`super::server`]) and `fedrl run` after the aggregator ended
//! (`gymnasium:<id>` populations, whose environments live in Python workers that the aggregator
//! may not start: [`GymEvaluator`]).
//!
//! Invariants:
//! - Which users and which episodes: periodic evaluations play users
//!   [`periodic_users`] (`users..users + eval_users`), the final one [`final_users`] (the next
//!   `final_eval_users` ids), never a training user; user `u`'s episodes reset from
//!   [`eval_seed`]`(u)`, whichever model is evaluated and wherever it runs
//!   ([`evaluate_envs`] is the one place that sets seeds and settings). So a Gymnasium
//!   population evaluated through the bridge plays the same episodes as the aggregator would
//!   have.
//! - Only released models are evaluated (DP outputs: post-processing, no privacy cost). A
//!   Gymnasium population's server model keeps each model it releases at an evaluation round as
//!   a snapshot in its state directory ([`write_snapshot`]: written to a temporary file, synced
//!   and renamed, so a crash leaves either the whole snapshot or none) and `fedrl run` evaluates
//!   the snapshots once the aggregator has ended.

use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::Context;
use fedrl_common::task::DppgTask;
use fedrl_rl::candle_core::Device;
use fedrl_rl::evaluate::ValueTarget;
use fedrl_rl::{EvalConfig, ModelSpec, evaluate, io};
use fedrl_sim::Env;
use fedrl_sim::gym_bridge::GymPool;

use super::{DppgTaskExt, declared_spaces, gym_config};

/// Folder of a Gymnasium population's evaluation snapshots in the aggregator's state directory.
pub use crate::eval_snapshots::SNAPSHOT_DIR;

/// The seed of held-out user `user`'s evaluation episodes.
pub fn eval_seed(user: u64) -> u64 {
    0xE7A1_0000_0000 ^ user
}

/// The held-out users of periodic evaluations: the `eval_users` ids after the
/// `training_users` training users.
pub fn periodic_users(task: &DppgTask, training_users: u64) -> Range<u64> {
    training_users..training_users + task.eval_users.max(1)
}

/// The held-out users of the final evaluation: the `final_eval_users` ids after the periodic
/// ones.
pub fn final_users(task: &DppgTask, training_users: u64) -> Range<u64> {
    let first = periodic_users(task, training_users).end;
    first..first + task.final_eval_users.max(1)
}

/// What an evaluation measured (returns in the environment's reward units): functions of the
/// released parameters and of episodes the server (or `fedrl run`) plays on held-out users, so
/// all of it is public (DESIGN §3).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    pub mean: f64,
    /// Population standard deviation of the episodes' returns.
    pub std: f64,
    pub episodes: usize,
    /// Mean policy entropy (nats) on the states the evaluation episodes visited.
    pub policy_entropy: Option<f64>,
    /// RMS error of the value network against the episodes' discounted returns (scaled
    /// reward units, `local.reward_scale`).
    pub value_rmse: Option<f64>,
}

impl Evaluation {
    /// The metrics fields (`eval_*`; the entropy and value error only where measured).
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "eval_return": self.mean,
            "eval_return_std": self.std,
            "eval_episodes": self.episodes,
        });
        if let Some(h) = self.policy_entropy {
            v["eval_policy_entropy"] = h.into();
        }
        if let Some(e) = self.value_rmse {
            v["eval_value_rmse"] = e.into();
        }
        v
    }
}

/// The value targets of `task`'s evaluations' value error (its discount and reward scale).
pub fn value_target(task: &DppgTask) -> ValueTarget {
    ValueTarget {
        gamma: task.local.gamma,
        reward_scale: task.local.reward_scale,
    }
}

/// Reset seeds and settings of an evaluation on `users` (`episodes_per_env` episodes each;
/// with `diagnostics`, the policy's entropy and the value network's error are measured too).
pub fn eval_setup(
    users: Range<u64>,
    episodes_per_env: usize,
    diagnostics: Option<ValueTarget>,
) -> (Vec<u64>, EvalConfig) {
    // Resets of evaluation episodes are seeded by the user id: the same users, the same
    // episodes, whichever model is evaluated.
    let seeds = users.map(eval_seed).collect();
    let cfg = EvalConfig {
        episodes_per_env: episodes_per_env.max(1),
        diagnostics,
        ..EvalConfig::default()
    };
    (seeds, cfg)
}

/// Mean return of `params` in `envs`, the environments of `users` in user order, one batched
/// rollout of greedy actions.
pub fn evaluate_envs(
    spec: &ModelSpec,
    params: &[f32],
    envs: &mut [Box<dyn Env>],
    users: Range<u64>,
    episodes_per_env: usize,
    diagnostics: Option<ValueTarget>,
    device: &Device,
) -> anyhow::Result<Evaluation> {
    anyhow::ensure!(
        envs.len() as u64 == users.end.saturating_sub(users.start),
        "{} environments for users {users:?}",
        envs.len()
    );
    let (seeds, cfg) = eval_setup(users, episodes_per_env, diagnostics);
    let r = evaluate(spec, params, envs, &seeds, &cfg, device)?;
    Ok(Evaluation {
        mean: r.mean,
        std: r.std,
        episodes: r.returns.len(),
        policy_entropy: r.policy_entropy,
        value_rmse: r.value_rmse,
    })
}

/// The name of the snapshot of the model released in `round` (its file: `round-R.safetensors`
/// in [`SNAPSHOT_DIR`]).
pub fn snapshot_name(round: u64) -> String {
    format!("round-{round:08}")
}

/// Where the snapshot of the model released in `round` lives in the state directory `dir`.
pub fn snapshot_path(dir: &Path, round: u64) -> PathBuf {
    crate::eval_snapshots::path(dir, &snapshot_name(round))
}

/// Keeps `params` (the model released in `round`) as its snapshot in the state directory
/// `dir`, atomically ([`crate::eval_snapshots::keep`]; a resumed run never reuses a round
/// number, so a file is only replaced when the same round is written twice).
pub fn write_snapshot(
    dir: &Path,
    round: u64,
    spec: &ModelSpec,
    params: &[f32],
) -> anyhow::Result<PathBuf> {
    let bytes = io::to_bytes(spec, params)?;
    crate::eval_snapshots::keep(dir, &snapshot_name(round), |tmp| {
        Ok(std::fs::write(tmp, &bytes)?)
    })
}

/// Reads the snapshot of `round` from the state directory `dir`.
pub fn read_snapshot(dir: &Path, round: u64) -> anyhow::Result<Vec<f32>> {
    read_snapshot_named(dir, &snapshot_name(round))
}

/// Reads the snapshot `name` ([`snapshot_name`]) from the state directory `dir`.
pub fn read_snapshot_named(dir: &Path, name: &str) -> anyhow::Result<Vec<f32>> {
    let path = crate::eval_snapshots::path(dir, name);
    let (_, params) =
        io::load(&path).with_context(|| format!("reading the snapshot {}", path.display()))?;
    Ok(params)
}

/// Evaluates released models of a `gymnasium:<id>` DPPG task on its held-out users, in
/// environments made by the bridge's Python workers (the process that builds it starts and
/// owns them; they end when it is dropped). Never built in the aggregator.
pub struct GymEvaluator {
    pool: GymPool,
    spec: ModelSpec,
    episodes_per_env: usize,
    value_target: ValueTarget,
    device: Device,
}

impl GymEvaluator {
    /// Starts the task's workers (as `[task.gymnasium]` says; spaces checked against its
    /// declaration). Fails for a task whose population is not `gymnasium:<id>`.
    pub fn start(task: &DppgTask, device: Device) -> anyhow::Result<Self> {
        let cfg = gym_config(task).with_context(|| {
            format!(
                "population {:?} is not a gymnasium:<id> population with its [task.gymnasium] table",
                task.population
            )
        })?;
        let declared = task.gymnasium.as_ref().map(declared_spaces);
        let pool = GymPool::start(cfg, declared)
            .with_context(|| format!("starting the Gymnasium workers of {}", task.population))?;
        Ok(Self {
            pool,
            spec: task.model_spec()?,
            episodes_per_env: task.eval_episodes,
            value_target: value_target(task),
            device,
        })
    }

    /// The policy/value model the task trains.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Mean return of `params` over `users`, as [`evaluate_envs`] plays them.
    pub fn evaluate(&mut self, params: &[f32], users: Range<u64>) -> anyhow::Result<Evaluation> {
        anyhow::ensure!(
            params.len() == self.spec.layout().len(),
            "a model of {} values, the task's has {}",
            params.len(),
            self.spec.layout().len()
        );
        let ids: Vec<u64> = users.clone().collect();
        let (groups, dropped) = self.pool.envs_for(&ids);
        if let Some((user, why)) = dropped.first() {
            anyhow::bail!("held-out user {user}: {why}");
        }
        // The workers hold contiguous shares in order: concatenated, the groups are in user
        // order.
        let mut envs: Vec<Box<dyn Env>> = groups.into_iter().flat_map(|g| g.envs).collect();
        evaluate_envs(
            &self.spec,
            params,
            &mut envs,
            users,
            self.episodes_per_env,
            Some(self.value_target),
            &self.device,
        )
    }
}
