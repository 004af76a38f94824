//! Evaluation of a policy on held-out users (never the training users): a non-private
//! diagnostic of the released model. For glucose simulators, [`evaluate_logged`] also returns
//! every episode's glucose log, from which a clinical report is computed.

use candle_core::Device;
use fedrl_sim::{Env, GlucoseSample};
use serde::{Deserialize, Serialize};

use crate::Result;
use crate::mlp::ModelSpec;
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
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            episodes_per_env: 1,
            greedy: true,
            max_episode_steps: 0,
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
        false,
        device,
    )?;
    Ok(summarize(out))
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
    EvalResult { returns, mean, std }
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
