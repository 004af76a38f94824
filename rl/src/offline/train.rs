//! The non-private discrete CQL trainer (d3rlpy's `DiscreteCQL.fit` loop: uniform minibatches,
//! Adam, hard target copies) and the greedy evaluation of a Q-network in the simulators.

use candle_core::Device;
use fedrl_common::offline::CqlConfig;
use fedrl_sim::{Action, Space};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use super::adam::Adam;
use super::batch::TransitionBatch;
use super::cql::{check_batch, check_config, loss_and_grad};
use super::qnet::{DeviceNet, QNetSpec, obs_tensor};
use crate::rollout::mix;
use crate::{EvalResult, NnError, Result};

/// Steps after which an evaluation episode that has not ended is an error (every registered
/// environment has a time limit far below this).
const MAX_EVAL_STEPS: usize = 1_000_000;

/// Trains a Q-network on `data` for `steps` gradient steps without privacy and returns its
/// parameters. The network starts from `spec.init(cfg.model_seed)` and the target network from
/// a copy of it; each step draws `cfg.batch_size` transitions uniformly with replacement
/// (seeded by `seed`), takes one Adam step (`cfg.learning_rate`, `cfg.adam_eps`) on the mean
/// CQL loss, and copies the network into the target on [`CqlTrainer::apply`]'s schedule.
/// `progress(step, loss)` is called after every step (1-based) with that step's mean loss.
pub fn train_cql(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    data: &TransitionBatch,
    steps: u64,
    seed: u64,
    device: &Device,
    progress: &mut dyn FnMut(u64, f64),
) -> Result<Vec<f32>> {
    check_config(cfg)?;
    check_batch(spec, data)?;
    if spec.hidden != cfg.hidden {
        return Err(NnError::Invalid(format!(
            "Q-network hidden widths {:?} differ from the CQL config's {:?}",
            spec.hidden, cfg.hidden
        )));
    }
    if cfg.batch_size == 0 || cfg.target_update_interval == 0 {
        return Err(NnError::Invalid(
            "batch_size and target_update_interval must be positive".into(),
        ));
    }
    let mut state = CqlTrainer::new(spec, cfg);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut rows = vec![0usize; cfg.batch_size];
    for step in 1..=steps {
        rows.iter_mut()
            .for_each(|r| *r = rng.random_range(0..data.len()));
        let batch = data.select(&rows);
        let (loss, grad) = loss_and_grad(spec, cfg, &state.params, &state.target, &batch, device)?;
        if !loss.is_finite() {
            return Err(NnError::Invalid(format!(
                "CQL loss is not finite at step {step} (learning rate too high?)"
            )));
        }
        state.apply(&grad);
        progress(step, loss);
    }
    Ok(state.params)
}

/// The state of a CQL learner between gradient steps: online and target parameters, Adam, and
/// the target-copy schedule. The non-private trainer feeds it mean gradients; a DP-SGD server
/// feeds it noised, clipped sums divided by the expected batch (post-processing: the state holds
/// nothing but released quantities).
#[derive(Clone, Debug, PartialEq)]
pub struct CqlTrainer {
    /// Online Q-network parameters (flat layout of [`QNetSpec`]).
    pub params: Vec<f32>,
    /// Target network parameters.
    pub target: Vec<f32>,
    /// The optimizer.
    pub adam: Adam,
    /// Gradient steps between target copies (`cfg.target_update_interval`, at least 1).
    pub target_update_interval: u64,
}

impl CqlTrainer {
    /// Starts from `spec.init(cfg.model_seed)`, the target a copy of it, fresh Adam
    /// (`cfg.learning_rate`, `cfg.adam_eps`).
    pub fn new(spec: &QNetSpec, cfg: &CqlConfig) -> Self {
        Self::from_params(spec.init(cfg.model_seed), cfg)
    }

    /// Starts from the given parameters (e.g. a checkpoint or another library's initialisation),
    /// the target a copy of them, fresh Adam.
    pub fn from_params(params: Vec<f32>, cfg: &CqlConfig) -> Self {
        CqlTrainer {
            target: params.clone(),
            adam: Adam::new(params.len(), cfg.learning_rate, cfg.adam_eps),
            params,
            target_update_interval: cfg.target_update_interval.max(1),
        }
    }

    /// Gradient steps taken.
    pub fn steps(&self) -> u64 {
        self.adam.steps()
    }

    /// One Adam descent step with `grad`, then the target copy when it is due: after steps
    /// `1, 1 + n, 1 + 2n, ...` (1-based, `n` the interval), d3rlpy's schedule (it syncs after the
    /// update whose 0-based index is a multiple of the interval).
    pub fn apply(&mut self, grad: &[f32]) {
        self.adam.step(&mut self.params, grad);
        if (self.adam.steps() - 1).is_multiple_of(self.target_update_interval) {
            self.target.copy_from_slice(&self.params);
        }
    }
}

/// Plays `episodes` episodes of `env_id` (a `fedrl_sim` environment id) greedily with the
/// Q-network `params` (argmax of the Q-values, ties to the lowest action), all episodes at once
/// with one forward pass per step on the CPU. Episode `i` is reset with a seed derived from
/// `(seed, i)`, so evaluations are reproducible and differ from training seeds chosen elsewhere.
/// Returns the undiscounted returns.
pub fn evaluate_greedy(
    spec: &QNetSpec,
    params: &[f32],
    env_id: &str,
    episodes: usize,
    seed: u64,
) -> Result<EvalResult> {
    evaluate_greedy_for(spec, params, env_id, episodes, seed, 0)
}

/// [`evaluate_greedy`] with the evaluation's own horizon: an episode ends when it terminates or
/// after `max_steps` steps, whatever the environment's time limit (seed 000 evaluates CartPole
/// at 1,000 steps, past CartPole-v1's 500, like Gymnasium's `max_episode_steps=1000`). 0: the
/// environment's own limit.
pub fn evaluate_greedy_for(
    spec: &QNetSpec,
    params: &[f32],
    env_id: &str,
    episodes: usize,
    seed: u64,
    max_steps: u64,
) -> Result<EvalResult> {
    let mut envs = (0..episodes)
        .map(|_| fedrl_sim::make(env_id))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    evaluate_greedy_in(spec, params, &mut envs, env_id, seed, max_steps)
}

/// [`evaluate_greedy_for`] in the given environments, one episode each (episode `i` in
/// `envs[i]`, reset with the seed derived from `(seed, i)`): e.g. Gymnasium environments made
/// by the bridge's workers, which the loop steps in batches (every episode's action is queued
/// before any result is collected). `env_id` names the environment in errors.
pub fn evaluate_greedy_in(
    spec: &QNetSpec,
    params: &[f32],
    envs: &mut [Box<dyn fedrl_sim::Env>],
    env_id: &str,
    seed: u64,
    max_steps: u64,
) -> Result<EvalResult> {
    let episodes = envs.len();
    let device = Device::Cpu;
    let net = DeviceNet::upload(spec, params, &device)?;
    if let Some(env) = envs.first() {
        let obs_ok =
            matches!(env.observation_space(), Space::Box { low, .. } if low.len() == spec.obs_dim);
        let act_ok = matches!(env.action_space(), Space::Discrete { n } if *n == spec.n_actions);
        if !(obs_ok && act_ok) {
            return Err(NnError::Invalid(format!(
                "{env_id} does not match a Q-network for {}-dimensional observations and {} \
                 discrete actions",
                spec.obs_dim, spec.n_actions
            )));
        }
    }
    let d = spec.obs_dim;
    let mut obs = vec![0f32; episodes * d];
    let mut now = Vec::with_capacity(episodes);
    for (i, env) in envs.iter_mut().enumerate() {
        now.push(env.reset_queue(mix(seed, i as u64), &mut obs[i * d..(i + 1) * d]));
    }
    for (i, (env, now)) in envs.iter_mut().zip(now).enumerate() {
        if !now {
            env.reset_collect(&mut obs[i * d..(i + 1) * d])?;
        }
    }
    let mut returns = vec![0f64; episodes];
    let mut active: Vec<usize> = (0..episodes).collect();
    let mut batch_obs = Vec::with_capacity(episodes * d);
    let horizon = if max_steps > 0 {
        max_steps
    } else {
        MAX_EVAL_STEPS as u64
    };
    for t in 0..horizon {
        if active.is_empty() {
            break;
        }
        batch_obs.clear();
        for &i in &active {
            batch_obs.extend_from_slice(&obs[i * d..(i + 1) * d]);
        }
        let (_, q) = net.forward(&obs_tensor(d, &batch_obs, &device)?)?;
        let q: Vec<Vec<f32>> = q.to_vec2()?;
        let mut still = Vec::with_capacity(active.len());
        let mut queued = Vec::with_capacity(active.len());
        for (&i, qi) in active.iter().zip(&q) {
            let a = greedy(qi);
            queued.push(envs[i].step_queue(Action::Discrete(a), &mut obs[i * d..(i + 1) * d])?);
        }
        for (&i, queued) in active.iter().zip(queued) {
            let step = match queued {
                Some(s) => s,
                None => envs[i].step_collect(&mut obs[i * d..(i + 1) * d])?,
            };
            returns[i] += step.reward;
            let ended = if max_steps > 0 {
                step.terminated || t + 1 >= max_steps
            } else {
                step.terminated || step.truncated
            };
            if !ended {
                still.push(i);
            }
        }
        active = still;
    }
    if !active.is_empty() && max_steps == 0 {
        return Err(NnError::Invalid(format!(
            "{env_id}: evaluation episodes did not end within {MAX_EVAL_STEPS} steps"
        )));
    }
    let n = returns.len().max(1) as f64;
    let mean = returns.iter().sum::<f64>() / n;
    let std = (returns.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt();
    Ok(EvalResult {
        returns,
        mean,
        std,
        policy_entropy: None,
        value_rmse: None,
    })
}

/// Index of the largest value, the lowest on ties (NaN never wins).
fn greedy(q: &[f32]) -> usize {
    let mut best = 0;
    for (a, &v) in q.iter().enumerate() {
        if v > q[best] {
            best = a;
        }
    }
    best
}
