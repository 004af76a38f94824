//! Evaluation of a policy on held-out users (never the training users): a non-private
//! diagnostic of the released model. For glucose simulators, [`evaluate_logged`] also returns
//! every episode's glucose log, from which a clinical report is computed.
//!
//! With [`EvalConfig::diagnostics`] set, [`evaluate`] also measures the released model on the
//! states its own evaluation episodes visit: the policy's mean entropy and the value network's
//! error against the Monte-Carlo returns of those episodes. Both are functions of the released
//! parameters and of episodes the server simulates itself (no unit's data), so they may be
//! published like the return.

use candle_core::{D, DType, Device, Tensor};
use candle_nn::ops::log_softmax;
use fedrl_sim::{Env, GlucoseSample};
use serde::{Deserialize, Serialize};

use crate::Result;

use crate::mlp::{ActionKind, ModelSpec, forward, policy_layers};
use crate::rollout::{RolloutConfig, UserBatch, run_users, run_users_logged};

/// How to evaluate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EvalConfig {
    /// Episodes per evaluation environment.
    pub episodes_per_env: usize,
    /// Greedy actions (argmax of the logits, or the Gaussian mean) when true; sampled from the
    /// policy otherwise. Default: greedy, as SB3's `evaluate_policy(deterministic=True)`.
    pub greedy: bool,
    /// Cap on steps per episode (0: the environment's own limit).
    pub max_episode_steps: usize,
    /// Also measure the policy's entropy and the value network's error on the evaluation
    /// episodes ([`EvalResult::policy_entropy`], [`EvalResult::value_rmse`]); `None`: returns
    /// only (the episodes' steps are then not kept).
    pub diagnostics: Option<ValueTarget>,
}

/// The discounting the value network was trained for, so its error can be measured against
/// the returns of the evaluation episodes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ValueTarget {
    /// Discount factor of the value targets.
    pub gamma: f64,
    /// Rewards are multiplied by this before discounting (the value network's units).
    pub reward_scale: f64,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            episodes_per_env: 1,
            greedy: true,
            max_episode_steps: 0,
            diagnostics: None,
        }
    }
}

/// Returns of an evaluation.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalResult {
    /// Every episode's undiscounted return, env by env.
    pub returns: Vec<f64>,
    /// Their mean.
    pub mean: f64,
    /// Their (population) standard deviation.
    pub std: f64,
    /// With [`EvalConfig::diagnostics`]: the policy's mean entropy (nats) over every state the
    /// evaluation episodes visited (for a Gaussian policy the state-independent entropy of its
    /// `log_std`).
    pub policy_entropy: Option<f64>,
    /// With [`EvalConfig::diagnostics`]: root mean square of `V(s_t) - G_t` over those states,
    /// `G_t` the discounted return-to-go of the episode in the value network's scaled units
    /// (bootstrapped from `V` where an episode was cut by its time limit, as the training
    /// targets are). The episodes follow the evaluation's (greedy) policy.
    pub value_rmse: Option<f64>,
}

/// Runs `cfg.episodes_per_env` episodes in each of `envs` (all at once, one batched forward per
/// step) with the policy in `params`; `seeds[i]` seeds env `i`'s resets (and sampling). The
/// policy runs on `device`.
pub fn evaluate(
    spec: &ModelSpec,
    params: &[f32],
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    cfg: &EvalConfig,
    device: &Device,
) -> Result<EvalResult> {
    let layout = spec.layout();
    let out = run_users(
        spec,
        &layout,
        params,
        envs,
        seeds,
        &rollout_config(cfg),
        cfg.greedy,
        cfg.diagnostics.is_some(),
        device,
    )?;
    let diagnostics = cfg
        .diagnostics
        .map(|target| diagnose(spec, params, &out, target, device))
        .transpose()?;
    let mut r = summarize(out);
    if let Some((entropy, rmse)) = diagnostics {
        r.policy_entropy = entropy;
        r.value_rmse = rmse;
    }
    Ok(r)
}

/// The policy's mean entropy and the value network's RMS error over the recorded steps of
/// `out` (`None` each when no step was recorded). The entropy of a discrete policy is one
/// batched forward pass over every recorded observation on `device`.
fn diagnose(
    spec: &ModelSpec,
    params: &[f32],
    out: &[UserBatch],
    target: ValueTarget,
    device: &Device,
) -> Result<(Option<f64>, Option<f64>)> {
    let steps: usize = out.iter().map(UserBatch::len).sum();
    if steps == 0 {
        return Ok((None, None));
    }
    let layout = spec.layout();
    let entropy = match spec.action {
        ActionKind::Gaussian { .. } => layout.log_std.map(|i| {
            let p = &layout.params[i];
            params[p.offset..p.offset + p.numel()]
                .iter()
                .map(|&l| l as f64 + 0.5 * (2.0 * std::f64::consts::PI * std::f64::consts::E).ln())
                .sum::<f64>()
        }),
        ActionKind::Discrete { .. } => {
            let obs: Vec<f32> = out.iter().flat_map(|b| b.obs.iter().copied()).collect();
            let x = Tensor::from_vec(obs, (1, steps, spec.obs_dim), device)?;
            let t = layout.stack(&[params], device)?;
            let head = forward(&x, &policy_layers(&layout, &t))?;
            let logp = log_softmax(&head, D::Minus1)?;
            let h = (logp.exp()? * &logp)?.sum(D::Minus1)?.neg()?;
            Some(h.to_dtype(DType::F64)?.mean_all()?.to_scalar::<f64>()?)
        }
    };
    let mut sq = 0.0f64;
    for b in out {
        // lambda = 1: the Monte-Carlo return, with PPO's own treatment of episode ends.
        let (_, returns) = crate::ppo::gae(b, target.gamma, 1.0, target.reward_scale);
        for (v, g) in b.values.iter().zip(&returns) {
            sq += (*v as f64 - *g as f64).powi(2);
        }
    }
    Ok((entropy, Some((sq / steps as f64).sqrt())))
}

/// One evaluation episode per env and repetition, as a rollout.
fn rollout_config(cfg: &EvalConfig) -> RolloutConfig {
    RolloutConfig {
        episodes_per_user: cfg.episodes_per_env,
        max_episode_steps: cfg.max_episode_steps,
    }
}

/// Every episode's return, env by env, with their mean and standard deviation.
fn summarize(out: Vec<UserBatch>) -> EvalResult {
    let returns: Vec<f64> = out.into_iter().flat_map(|b| b.episode_returns).collect();
    let n = returns.len().max(1) as f64;
    let mean = returns.iter().sum::<f64>() / n;
    let std = (returns.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt();
    EvalResult {
        returns,
        mean,
        std,
        policy_entropy: None,
        value_rmse: None,
    }
}

/// The glucose log of one evaluation episode.
#[derive(Clone, Debug, PartialEq)]
pub struct EpisodeGlucose {
    /// Index of the environment in the evaluated slice.
    pub env: usize,
    /// Episode number within that environment (0-based).
    pub episode: usize,
    /// Every CGM sample of the episode, the first at reset.
    pub samples: Vec<GlucoseSample>,
}

/// [`evaluate`], and the glucose log of every episode whose environment keeps one (none for
/// other environments, at no cost to them), env by env in episode order.
pub fn evaluate_logged(
    spec: &ModelSpec,
    params: &[f32],
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    cfg: &EvalConfig,
    device: &Device,
) -> Result<(EvalResult, Vec<EpisodeGlucose>)> {
    let layout = spec.layout();
    let (out, logs) = run_users_logged(
        spec,
        &layout,
        params,
        envs,
        seeds,
        &rollout_config(cfg),
        cfg.greedy,
        device,
    )?;
    let glucose = logs
        .into_iter()
        .enumerate()
        .flat_map(|(env, episodes)| {
            episodes
                .into_iter()
                .enumerate()
                .map(move |(episode, samples)| EpisodeGlucose {
                    env,
                    episode,
                    samples,
                })
        })
        .collect();
    Ok((summarize(out), glucose))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mlp::ActionKind;

    fn spec(obs_dim: usize, action: ActionKind) -> ModelSpec {
        ModelSpec {
            obs_dim,
            action,
            hidden: vec![4],
            init_log_std: 0.0,
            obs_offset: vec![],
            obs_scale: vec![],
            action_low: vec![],
            action_high: vec![],
            action_repeat: 1,
        }
    }

    #[test]
    fn diagnostics_measure_entropy_and_value_error_without_changing_returns() {
        let target = ValueTarget {
            gamma: 1.0,
            reward_scale: 1.0,
        };
        let plain_cfg = EvalConfig {
            episodes_per_env: 3,
            ..EvalConfig::default()
        };
        let cfg = EvalConfig {
            diagnostics: Some(target),
            ..plain_cfg.clone()
        };
        let s = spec(4, ActionKind::Discrete { n: 2 });
        let params = s.init(5);
        let envs = || -> Vec<Box<dyn Env>> {
            vec![
                fedrl_sim::make("CartPole-v1").unwrap(),
                fedrl_sim::make("CartPole-v1").unwrap(),
            ]
        };
        let plain = evaluate(&s, &params, &mut envs(), &[4, 9], &plain_cfg, &Device::Cpu).unwrap();
        let r = evaluate(&s, &params, &mut envs(), &[4, 9], &cfg, &Device::Cpu).unwrap();
        assert_eq!(plain.policy_entropy, None);
        assert_eq!(plain.value_rmse, None);
        assert_eq!(r.returns, plain.returns);
        // A fresh policy head (gain 0.01) is close to uniform over two actions.
        let h = r.policy_entropy.unwrap();
        assert!(h <= 2f64.ln() + 1e-9 && h > 2f64.ln() - 0.01, "{h}");
        // CartPole pays 1 per step and an untrained greedy policy falls (terminates): with
        // gamma 1 the target at step t of a T-step episode is T - t, and a fresh value head is
        // small, so the error is close to the RMS of those targets.
        let (mut sq, mut n) = (0.0, 0.0);
        for &t in &r.returns {
            assert!(t < 500.0, "the episode was cut by the time limit");
            for k in 1..=(t as usize) {
                sq += (k * k) as f64;
                n += 1.0;
            }
        }
        let rms_targets = (sq / n).sqrt();
        let rmse = r.value_rmse.unwrap();
        assert!((rmse - rms_targets).abs() < 2.0, "{rmse} vs {rms_targets}");

        // A Gaussian policy's entropy is that of its log-std: 0 here, ln(2 pi e) / 2 per dim.
        let s = spec(9, ActionKind::Gaussian { dim: 1 });
        let params = s.init(3);
        let mut envs = vec![fedrl_sim::make("Dosing-v1").unwrap()];
        let r = evaluate(&s, &params, &mut envs, &[1], &cfg, &Device::Cpu).unwrap();
        let want = 0.5 * (2.0 * std::f64::consts::PI * std::f64::consts::E).ln();
        assert!((r.policy_entropy.unwrap() - want).abs() < 1e-6);
        assert!(r.value_rmse.unwrap().is_finite());
    }

    #[test]
    fn glucose_envs_return_one_log_per_episode_others_none() {
        let cfg = EvalConfig {
            episodes_per_env: 2,
            ..EvalConfig::default()
        };
        let s = spec(9, ActionKind::Gaussian { dim: 1 });
        let params = s.init(3);
        let make = || -> Vec<Box<dyn Env>> {
            vec![
                fedrl_sim::make("Dosing-v1").unwrap(),
                fedrl_sim::make("Dosing-v1").unwrap(),
            ]
        };
        let mut envs = make();
        let (r, logs) =
            evaluate_logged(&s, &params, &mut envs, &[1, 2], &cfg, &Device::Cpu).unwrap();
        // The same returns as the unlogged evaluation.
        let plain = evaluate(&s, &params, &mut make(), &[1, 2], &cfg, &Device::Cpu).unwrap();
        assert_eq!(r, plain);
        assert_eq!(logs.len(), 4);
        let order: Vec<(usize, usize)> = logs.iter().map(|l| (l.env, l.episode)).collect();
        assert_eq!(order, [(0, 0), (0, 1), (1, 0), (1, 1)]);
        // A whole Dosing day: 145 grid points.
        assert!(logs.iter().all(|l| l.samples.len() == 145));
        // Different seeds, different episodes.
        assert_ne!(logs[0].samples, logs[1].samples);

        let s = spec(4, ActionKind::Discrete { n: 2 });
        let params = s.init(3);
        let mut envs = vec![fedrl_sim::make("CartPole-v1").unwrap()];
        let (r, logs) = evaluate_logged(&s, &params, &mut envs, &[1], &cfg, &Device::Cpu).unwrap();
        assert_eq!(r.returns.len(), 2);
        assert!(logs.is_empty());
    }
}
