//! Evaluation of a policy on held-out users (never the training users): a non-private
//! diagnostic of the released model.

use candle_core::Device;
use fedrl_sim::Env;
use serde::{Deserialize, Serialize};

use crate::Result;
use crate::mlp::ModelSpec;
use crate::rollout::{RolloutConfig, run_users};

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
    let rollout = RolloutConfig {
        episodes_per_user: cfg.episodes_per_env,
        max_episode_steps: cfg.max_episode_steps,
    };
    let out = run_users(
        spec, &layout, params, envs, seeds, &rollout, cfg.greedy, false, device,
    )?;
    let returns: Vec<f64> = out.into_iter().flat_map(|b| b.episode_returns).collect();
    let n = returns.len().max(1) as f64;
    let mean = returns.iter().sum::<f64>() / n;
    let std = (returns.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt();
    Ok(EvalResult { returns, mean, std })
}
