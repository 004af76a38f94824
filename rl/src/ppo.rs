//! PPO pieces: generalised advantage estimation and the clipped-surrogate loss over many users'
//! stacked parameter copies (each user's loss depends only on its own copy and its own data).

use candle_core::{D, Tensor};
use serde::{Deserialize, Serialize};

use crate::Result;
use crate::mlp::{ModelSpec, ParamLayout, forward, policy_layers};
use crate::rollout::UserBatch;
use crate::{policy, value};

/// Loss coefficients.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PpoCoefs {
    /// Ratio clip epsilon of the surrogate objective.
    pub clip_eps: f64,
    /// Weight of the value loss `0.5 (V - R)^2`.
    pub vf_coef: f64,
    /// Weight of the entropy bonus (nats).
    pub ent_coef: f64,
}

/// GAE(gamma, lambda) advantages and value targets (`advantage + value`) of one user's data.
///
/// Rewards are multiplied by `reward_scale` first (the value network works in scaled units).
/// At a terminated step the next value is 0; at a truncated step it is the stored bootstrap
/// value of the observation after the cut; either way the recursion restarts there.
pub fn gae(b: &UserBatch, gamma: f64, lambda: f64, reward_scale: f64) -> (Vec<f32>, Vec<f32>) {
    let n = b.len();
    let mut adv = vec![0.0f32; n];
    let mut next_adv = 0.0f64;
    for t in (0..n).rev() {
        let end = b.terminated[t] || b.truncated[t] || t + 1 == n;
        let next_v = if b.terminated[t] {
            0.0
        } else if b.truncated[t] || t + 1 == n {
            b.bootstrap[t] as f64
        } else {
            b.values[t + 1] as f64
        };
        if end {
            next_adv = 0.0;
        }
        let delta = b.rewards[t] as f64 * reward_scale + gamma * next_v - b.values[t] as f64;
        next_adv = delta + gamma * lambda * next_adv;
        adv[t] = next_adv as f32;
    }
    let ret = adv.iter().zip(&b.values).map(|(a, v)| a + v).collect();
    (adv, ret)
}

/// Normalises advantages to zero mean and unit standard deviation (within one user's batch).
pub fn normalize(adv: &mut [f32]) {
    let n = adv.len();
    if n < 2 {
        return;
    }
    let mean = adv.iter().map(|&a| a as f64).sum::<f64>() / n as f64;
    let var = adv.iter().map(|&a| (a as f64 - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let sd = var.sqrt() + 1e-8;
    for a in adv.iter_mut() {
        *a = ((*a as f64 - mean) / sd) as f32;
    }
}

/// A padded minibatch for `users` users of up to `n` steps each.
#[derive(Clone, Debug)]
pub struct Minibatch {
    /// `[users, n, obs_dim]`.
    pub obs: Tensor,
    /// See [`policy::log_prob_entropy`].
    pub actions: Tensor,
    /// Acting log-probabilities `[users, n]`.
    pub logp_old: Tensor,
    /// Advantages `[users, n]`.
    pub adv: Tensor,
    /// Value targets `[users, n]`.
    pub returns: Tensor,
    /// 1 for real steps, 0 for padding, `[users, n]`.
    pub mask: Tensor,
    /// `1 / max(1, real steps)` per user, `[users, 1]`.
    pub inv_count: Tensor,
}

/// Per-user PPO loss `[users]`: clipped surrogate + `vf_coef` * value loss - `ent_coef` *
/// entropy, each a mean over the user's real steps in the minibatch. Summing it and
/// back-propagating gives every user the gradient of its own loss only.
pub fn ppo_loss(
    spec: &ModelSpec,
    layout: &ParamLayout,
    params: &[Tensor],
    mb: &Minibatch,
    c: &PpoCoefs,
) -> Result<Tensor> {
    let head = forward(&mb.obs, &policy_layers(layout, params))?;
    let log_std = layout.log_std.map(|i| &params[i]);
    let (logp, entropy) = policy::log_prob_entropy(&spec.action, &head, log_std, &mb.actions)?;
    let ratio = (logp - &mb.logp_old)?.exp()?;
    let s1 = (&ratio * &mb.adv)?;
    let s2 = (ratio.clamp(1.0 - c.clip_eps, 1.0 + c.clip_eps)? * &mb.adv)?;
    let pg = s1.minimum(&s2)?.neg()?;
    let v = value::values(layout, params, &mb.obs)?;
    let vloss = ((v - &mb.returns)?.sqr()? * 0.5)?;
    let per_step = ((pg + (vloss * c.vf_coef)?)? - (entropy * c.ent_coef)?)?;
    let per_user = (per_step * &mb.mask)?
        .sum_keepdim(D::Minus1)?
        .mul(&mb.inv_count)?
        .squeeze(D::Minus1)?;
    Ok(per_user)
}
