//! Acting in many environments at once: every step, one batched forward pass over all active
//! users' observations under the shared global parameters, then each user's own RNG samples its
//! action and its own environment steps.

use candle_core::{Device, Tensor};
use fedrl_sim::{Action, Env, GlucoseSample, Space};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use serde::{Deserialize, Serialize};

use crate::mlp::{
    ActionKind, ModelSpec, ParamLayout, RowMlp, RowScratch, forward, policy_layers, value_layers,
};
use crate::{NnError, Result, policy};

/// How a user's data is collected.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RolloutConfig {
    /// Episodes each user plays with the current policy.
    pub episodes_per_user: usize,
    /// Cap on steps per episode (0: only the environment's own limit). A capped episode is
    /// *truncated*: GAE bootstraps from the value of its last observation.
    pub max_episode_steps: usize,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            episodes_per_user: 1,
            max_episode_steps: 0,
        }
    }
}

/// One user's on-policy data (all episodes concatenated), `n` steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UserBatch {
    /// `n * obs_dim` observations, normalised as the model spec says (what the networks see).
    pub obs: Vec<f32>,
    /// `n * action_dim` actions (the index as f32 for discrete policies; the unclipped sample
    /// for Gaussian policies).
    pub actions: Vec<f32>,
    /// Log-probability of each action under the acting policy (nats).
    pub logp: Vec<f32>,
    /// Value estimates of the acting value network.
    pub values: Vec<f32>,
    /// Rewards (environment units).
    pub rewards: Vec<f32>,
    /// The step ended the episode in a terminal state (no bootstrap).
    pub terminated: Vec<bool>,
    /// The step ended the episode by a time limit (bootstrap from `bootstrap`).
    pub truncated: Vec<bool>,
    /// Value of the observation after a truncated step (0 elsewhere).
    pub bootstrap: Vec<f32>,
    /// Undiscounted return of each episode.
    pub episode_returns: Vec<f64>,
}

impl UserBatch {
    /// Number of steps.
    pub fn len(&self) -> usize {
        self.logp.len()
    }

    /// Whether the batch holds no step.
    pub fn is_empty(&self) -> bool {
        self.logp.is_empty()
    }
}

/// Action vector length stored per step.
pub(crate) fn action_dim(kind: &ActionKind) -> usize {
    match kind {
        ActionKind::Discrete { .. } => 1,
        ActionKind::Gaussian { dim } => *dim,
    }
}

/// A seed for episode `k` of a user, from the user's seed (SplitMix64 finaliser): episode `k`
/// of a rollout or evaluation seeded `seed` resets its environment with `mix(seed, k)`, so a
/// hand-written controller given the same reset seed plays the same day.
pub fn mix(seed: u64, k: u64) -> u64 {
    let mut z = seed
        ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Actor<'a> {
    layout: &'a ParamLayout,
    params: Vec<Tensor>,
    log_std: Vec<f32>,
    device: Device,
}

impl<'a> Actor<'a> {
    fn new(layout: &'a ParamLayout, global: &[f32], device: &Device) -> Result<Self> {
        let device = device.clone();
        let params = layout.stack(&[global], &device)?;
        let log_std = match layout.log_std {
            Some(i) => {
                let p = &layout.params[i];
                global[p.offset..p.offset + p.numel()].to_vec()
            }
            None => Vec::new(),
        };
        Ok(Self {
            layout,
            params,
            log_std,
            device,
        })
    }

    /// Policy head rows `[n, A]` and (optionally) values `[n]` for `n` observations.
    fn run(&self, obs: &[f32], n: usize, with_value: bool) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        let obs_dim = obs.len() / n.max(1);
        let x = Tensor::from_slice(obs, (1, n, obs_dim), &self.device)?;
        let head = forward(&x, &policy_layers(self.layout, &self.params))?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let v = if with_value {
            Some(self.values(&x)?)
        } else {
            None
        };
        Ok((head, v))
    }

    fn values(&self, x: &Tensor) -> Result<Vec<f32>> {
        Ok(forward(x, &value_layers(self.layout, &self.params))?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }
}

/// What acts in [`run_users`]: policy head rows and values for the active users' observations.
trait Heads {
    /// Policy head rows `[n, A]` and (optionally) values `[n]` for the observations `obs` (`n`
    /// rows) of users `users` (`users[row]` is the user of row `row`).
    fn heads(
        &self,
        users: &[usize],
        obs: &[f32],
        with_value: bool,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>)>;

    /// Values of the observations `obs` of users `users`.
    fn values_of(&self, users: &[usize], obs: &[f32]) -> Result<Vec<f32>>;

    /// The Gaussian log-stds of user `u` (empty for discrete policies).
    fn log_std(&self, u: usize) -> &[f32];
}

impl Heads for Actor<'_> {
    fn heads(
        &self,
        users: &[usize],
        obs: &[f32],
        with_value: bool,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        self.run(obs, users.len(), with_value)
    }

    fn values_of(&self, users: &[usize], obs: &[f32]) -> Result<Vec<f32>> {
        let obs_dim = obs.len() / users.len().max(1);
        let x = Tensor::from_slice(obs, (1, users.len(), obs_dim), &self.device)?;
        self.values(&x)
    }

    fn log_std(&self, _u: usize) -> &[f32] {
        &self.log_std
    }
}

/// Every user acts with its own parameters: plain `f32` forward passes, one user's row at a
/// time (with one observation per user per step a batched matmul has nothing to batch).
struct OwnActors {
    nets: Vec<RowMlp>,
    log_stds: Vec<Vec<f32>>,
}

impl OwnActors {
    fn new(layout: &ParamLayout, params: &[&[f32]]) -> Result<Self> {
        let mut nets = Vec::with_capacity(params.len());
        let mut log_stds = Vec::with_capacity(params.len());
        for p in params {
            layout.check(p)?;
            nets.push(RowMlp::new(layout, p));
            log_stds.push(match layout.log_std {
                Some(i) => {
                    let s = &layout.params[i];
                    p[s.offset..s.offset + s.numel()].to_vec()
                }
                None => Vec::new(),
            });
        }
        Ok(Self { nets, log_stds })
    }
}

impl Heads for OwnActors {
    fn heads(
        &self,
        users: &[usize],
        obs: &[f32],
        with_value: bool,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        let obs_dim = obs.len() / users.len().max(1);
        let mut head = Vec::new();
        let mut vals = with_value.then(|| Vec::with_capacity(users.len()));
        let mut scratch = RowScratch::default();
        for (row, &u) in users.iter().enumerate() {
            let x = &obs[row * obs_dim..(row + 1) * obs_dim];
            head.extend_from_slice(self.nets[u].policy(x, &mut scratch));
            if let Some(v) = vals.as_mut() {
                v.push(self.nets[u].value(x, &mut scratch));
            }
        }
        Ok((head, vals))
    }

    fn values_of(&self, users: &[usize], obs: &[f32]) -> Result<Vec<f32>> {
        let obs_dim = obs.len() / users.len().max(1);
        let mut scratch = RowScratch::default();
        Ok(users
            .iter()
            .enumerate()
            .map(|(row, &u)| {
                self.nets[u].value(&obs[row * obs_dim..(row + 1) * obs_dim], &mut scratch)
            })
            .collect())
    }

    fn log_std(&self, u: usize) -> &[f32] {
        &self.log_stds[u]
    }
}

/// Writes a policy sample into the environment's action: Gaussian samples are mapped to the
/// spec's action range (if any), then clipped to the environment's box.
fn env_action<'b>(
    spec: &ModelSpec,
    space: &Space,
    a: &[f32],
    clipped: &'b mut Vec<f32>,
) -> Action<'b> {
    match spec.action {
        ActionKind::Discrete { .. } => Action::Discrete(a[0] as usize),
        ActionKind::Gaussian { .. } => {
            clipped.clear();
            clipped.extend_from_slice(a);
            spec.rescale_action(clipped);
            if let Space::Box { low, high } = space {
                for ((x, lo), hi) in clipped.iter_mut().zip(low).zip(high) {
                    *x = x.clamp(*lo, *hi);
                }
            }
            Action::Continuous(clipped)
        }
    }
}

/// Runs every user's episodes in lockstep and returns each user's data.
///
/// `seeds[u]` drives user `u`'s episode resets and action sampling, so a user's data depends
/// only on its seed, its environment and `global`. `greedy` acts with the most likely action
/// (for evaluation). When `record` is false only episode returns are kept. The forward passes
/// run on `device`; observations go to it and head outputs come back every step.
#[allow(clippy::too_many_arguments)] // internal; the public entry points take fewer
pub(crate) fn run_users(
    spec: &ModelSpec,
    layout: &ParamLayout,
    global: &[f32],
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    cfg: &RolloutConfig,
    greedy: bool,
    record: bool,
    device: &Device,
) -> Result<Vec<UserBatch>> {
    layout.check(global)?;
    let actor = Actor::new(layout, global, device)?;
    run_with(spec, &actor, envs, seeds, cfg, greedy, record, None)
}

/// Glucose logs of finished episodes: `logs[u]` holds user `u`'s, in episode order (empty for
/// environments without a glucose log).
pub(crate) type GlucoseLogs = Vec<Vec<Vec<GlucoseSample>>>;

/// [`run_users`] without recording steps that also keeps each finished episode's glucose log
/// (for evaluation; training rollouts never copy logs).
#[allow(clippy::too_many_arguments)] // internal; the public entry points take fewer
pub(crate) fn run_users_logged(
    spec: &ModelSpec,
    layout: &ParamLayout,
    global: &[f32],
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    cfg: &RolloutConfig,
    greedy: bool,
    device: &Device,
) -> Result<(Vec<UserBatch>, GlucoseLogs)> {
    layout.check(global)?;
    let actor = Actor::new(layout, global, device)?;
    let mut logs: GlucoseLogs = vec![Vec::new(); envs.len()];
    let out = run_with(
        spec,
        &actor,
        envs,
        seeds,
        cfg,
        greedy,
        false,
        Some(&mut logs),
    )?;
    Ok((out, logs))
}

/// [`run_users`] where user `u` acts with its own parameters `params[u]` (plain `f32` forward
/// passes on the CPU).
#[allow(clippy::too_many_arguments)] // internal; the public entry points take fewer
pub(crate) fn run_users_own(
    spec: &ModelSpec,
    layout: &ParamLayout,
    params: &[&[f32]],
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    cfg: &RolloutConfig,
    greedy: bool,
    record: bool,
) -> Result<Vec<UserBatch>> {
    if params.len() != envs.len() {
        return Err(NnError::Invalid(format!(
            "{} parameter vectors but {} environments",
            params.len(),
            envs.len()
        )));
    }
    let actor = OwnActors::new(layout, params)?;
    run_with(spec, &actor, envs, seeds, cfg, greedy, record, None)
}

/// Starts episode `episode[u]` of every user in `users` (seed `mix(seeds[u], episode[u])`) and
/// writes its normalised first observation into the user's row of `cur_obs`. Two passes, like a
/// step: batching environments (the Gymnasium bridge) reset a whole worker's users in one
/// message; every other environment resets in the first pass.
fn reset_users(
    spec: &ModelSpec,
    envs: &mut [Box<dyn Env>],
    users: &[usize],
    seeds: &[u64],
    episode: &[usize],
    cur_obs: &mut [f32],
) -> Result<()> {
    let d = spec.obs_dim;
    let mut done = Vec::with_capacity(users.len());
    for &u in users {
        let o = &mut cur_obs[u * d..(u + 1) * d];
        done.push(envs[u].reset_queue(mix(seeds[u], episode[u] as u64), o));
    }
    for (&u, done) in users.iter().zip(done) {
        let o = &mut cur_obs[u * d..(u + 1) * d];
        if !done {
            envs[u].reset_collect(o)?;
        }
        spec.normalize_obs(o);
    }
    Ok(())
}

/// The rollout loop of [`run_users`] and [`run_users_own`]; with `logs`, each finished
/// episode's glucose log (if its environment keeps one) is copied before the next reset.
#[allow(clippy::too_many_arguments)] // private
fn run_with(
    spec: &ModelSpec,
    actor: &dyn Heads,
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    cfg: &RolloutConfig,
    greedy: bool,
    record: bool,
    mut logs: Option<&mut GlucoseLogs>,
) -> Result<Vec<UserBatch>> {
    if envs.len() != seeds.len() {
        return Err(NnError::Invalid(format!(
            "{} environments but {} seeds",
            envs.len(),
            seeds.len()
        )));
    }
    let users = envs.len();
    let obs_dim = spec.obs_dim;
    let a_dim = action_dim(&spec.action);
    let head_w = spec.action.head_width();
    for env in envs.iter() {
        if env.observation_space().dim() != obs_dim {
            return Err(NnError::Invalid(format!(
                "{}: observation length {} but the model expects {obs_dim}",
                env.id(),
                env.observation_space().dim()
            )));
        }
    }
    let spaces: Vec<Space> = envs.iter().map(|e| e.action_space().clone()).collect();
    let mut rngs: Vec<Xoshiro256PlusPlus> = seeds
        .iter()
        .map(|&s| Xoshiro256PlusPlus::seed_from_u64(mix(s, u64::MAX)))
        .collect();
    let mut out: Vec<UserBatch> = (0..users).map(|_| UserBatch::default()).collect();
    let mut cur_obs = vec![0.0f32; users * obs_dim];
    let mut episode = vec![0usize; users];
    let mut ep_steps = vec![0usize; users];
    let mut ep_return = vec![0.0f64; users];
    spec.check_preprocessing()?;
    let all: Vec<usize> = (0..users).collect();
    reset_users(spec, envs, &all, seeds, &episode, &mut cur_obs)?;
    let mut to_reset: Vec<usize> = Vec::with_capacity(users);
    let mut active: Vec<usize> = if cfg.episodes_per_user == 0 {
        Vec::new()
    } else {
        (0..users).collect()
    };
    // (user, step index, observation) of truncated steps awaiting their bootstrap value.
    let mut pending: Vec<(usize, usize)> = Vec::new();
    let mut pending_obs: Vec<f32> = Vec::new();
    let mut batch_obs = Vec::with_capacity(users * obs_dim);
    let mut act = vec![0.0f32; a_dim];
    let mut clipped = Vec::with_capacity(a_dim);
    let mut next_obs = vec![0.0f32; obs_dim];
    let mut next_rows = vec![0.0f32; users * obs_dim];
    let mut acts: Vec<f32> = Vec::with_capacity(users * a_dim);
    let mut logps: Vec<f32> = Vec::with_capacity(users);
    let mut queued: Vec<Option<fedrl_sim::Step>> = Vec::with_capacity(users);
    while !active.is_empty() {
        batch_obs.clear();
        for &u in &active {
            batch_obs.extend_from_slice(&cur_obs[u * obs_dim..(u + 1) * obs_dim]);
        }
        let (head, vals) = actor.heads(&active, &batch_obs, record)?;
        let mut still = Vec::with_capacity(active.len());
        // Two passes so that batching environments (the Gymnasium bridge) step every active
        // user of a worker in one message: first each user's action is sampled and handed to
        // its environment (a Rust simulator steps right there), then the queued steps are
        // collected. Each user's randomness is its own generator, so the order changes nothing.
        acts.clear();
        logps.clear();
        queued.clear();
        for (row, &u) in active.iter().enumerate() {
            let logp = policy::sample(
                &spec.action,
                &head[row * head_w..(row + 1) * head_w],
                actor.log_std(u),
                greedy,
                &mut rngs[u],
                &mut act,
            );
            logps.push(logp);
            acts.extend_from_slice(&act);
            let action = env_action(spec, &spaces[u], &act, &mut clipped);
            let o = &mut next_rows[row * obs_dim..(row + 1) * obs_dim];
            queued.push(envs[u].step_queue(action, o)?);
        }
        for (row, &u) in active.iter().enumerate() {
            let logp = logps[row];
            act.copy_from_slice(&acts[row * a_dim..(row + 1) * a_dim]);
            let action = env_action(spec, &spaces[u], &act, &mut clipped);
            next_obs.copy_from_slice(&next_rows[row * obs_dim..(row + 1) * obs_dim]);
            let mut step = match queued[row] {
                Some(s) => s,
                None => envs[u].step_collect(&mut next_obs)?,
            };
            for _ in 1..spec.action_repeat.max(1) {
                if step.terminated || step.truncated {
                    break;
                }
                let more = envs[u].step(action, &mut next_obs)?;
                step = fedrl_sim::Step {
                    reward: step.reward + more.reward,
                    ..more
                };
            }
            // Every observation the networks see, stored or bootstrapped, is normalised.
            spec.normalize_obs(&mut next_obs);
            ep_steps[u] += 1;
            ep_return[u] += step.reward;
            let capped = cfg.max_episode_steps > 0 && ep_steps[u] >= cfg.max_episode_steps;
            let terminated = step.terminated;
            let truncated = !terminated && (step.truncated || capped);
            if record {
                let b = &mut out[u];
                b.obs
                    .extend_from_slice(&cur_obs[u * obs_dim..(u + 1) * obs_dim]);
                b.actions.extend_from_slice(&act);
                b.logp.push(logp);
                b.values.push(vals.as_ref().map_or(0.0, |v| v[row]));
                b.rewards.push(step.reward as f32);
                b.terminated.push(terminated);
                b.truncated.push(truncated);
                b.bootstrap.push(0.0);
                if truncated {
                    pending.push((u, b.logp.len() - 1));
                    pending_obs.extend_from_slice(&next_obs);
                }
            }
            if terminated || truncated {
                if let Some(logs) = logs.as_deref_mut()
                    && let Some(g) = envs[u].glucose_log()
                {
                    logs[u].push(g.to_vec());
                }
                out[u].episode_returns.push(ep_return[u]);
                episode[u] += 1;
                ep_steps[u] = 0;
                ep_return[u] = 0.0;
                if episode[u] < cfg.episodes_per_user {
                    to_reset.push(u);
                    still.push(u);
                }
            } else {
                cur_obs[u * obs_dim..(u + 1) * obs_dim].copy_from_slice(&next_obs);
                still.push(u);
            }
        }
        reset_users(spec, envs, &to_reset, seeds, &episode, &mut cur_obs)?;
        to_reset.clear();
        active = still;
    }
    if !pending.is_empty() {
        let users: Vec<usize> = pending.iter().map(|&(u, _)| u).collect();
        let v = actor.values_of(&users, &pending_obs)?;
        for (&(u, t), v) in pending.iter().zip(v) {
            out[u].bootstrap[t] = v;
        }
    }
    Ok(out)
}

/// Collects each user's on-policy data with the global parameters, sampling actions.
/// `seeds[u]` makes user `u`'s data reproducible and independent of the other users. The
/// policy runs on `device`.
pub fn collect_rollouts(
    spec: &ModelSpec,
    global: &[f32],
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    cfg: &RolloutConfig,
    device: &Device,
) -> Result<Vec<UserBatch>> {
    let layout = spec.layout();
    run_users(spec, &layout, global, envs, seeds, cfg, false, true, device)
}

/// [`collect_rollouts`] where user `u` acts with its own parameters `params[u]` (plain `f32`
/// forward passes on the CPU, on the calling thread).
pub fn collect_rollouts_own(
    spec: &ModelSpec,
    params: &[&[f32]],
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    cfg: &RolloutConfig,
) -> Result<Vec<UserBatch>> {
    let layout = spec.layout();
    run_users_own(spec, &layout, params, envs, seeds, cfg, false, true)
}
