//! Policy heads: categorical (logits) and diagonal Gaussian with a state-independent log-std.
//!
//! Two halves: tensor log-probabilities and entropies for the PPO loss (differentiable, batched
//! over users), and per-row sampling on plain slices for acting.

use candle_core::{D, DType, Tensor};
use rand::RngExt;
use rand_distr::{Distribution, StandardNormal};

use crate::Result;
use crate::mlp::ActionKind;

/// ln(2 pi) / 2.
const HALF_LN_2PI: f64 = 0.918_938_533_204_672_8;

/// Log-probability `[users, n]` and entropy `[users, n]` (nats) of `actions` under the policy.
///
/// - `head`: policy network output `[users, n, A]` (logits, or Gaussian means);
/// - `log_std`: `[users, A]` for Gaussian policies;
/// - `actions`: `[users, n, 1]` u32 indices (discrete) or `[users, n, A]` f32 (Gaussian).
pub fn log_prob_entropy(
    kind: &ActionKind,
    head: &Tensor,
    log_std: Option<&Tensor>,
    actions: &Tensor,
) -> Result<(Tensor, Tensor)> {
    match kind {
        ActionKind::Discrete { .. } => {
            let logp_all = candle_nn::ops::log_softmax(head, D::Minus1)?;
            let logp = logp_all.gather(actions, D::Minus1)?.squeeze(D::Minus1)?;
            let entropy = (logp_all.exp()? * &logp_all)?.sum(D::Minus1)?.neg()?;
            Ok((logp, entropy))
        }
        ActionKind::Gaussian { .. } => {
            let log_std = log_std
                .ok_or_else(|| crate::NnError::Invalid("Gaussian policy without log_std".into()))?;
            let ls = log_std.unsqueeze(1)?; // [U, 1, A]
            let z = actions.sub(head)?.broadcast_mul(&ls.neg()?.exp()?)?;
            let per_dim = (z.sqr()?.affine(-0.5, -HALF_LN_2PI))?.broadcast_sub(&ls)?;
            let logp = per_dim.sum(D::Minus1)?;
            // Entropy does not depend on the state: sum_a (log_std + ln(2 pi e)/2).
            let ent = log_std
                .affine(1.0, HALF_LN_2PI + 0.5)?
                .sum_keepdim(D::Minus1)?; // [U, 1]
            let entropy = ent.broadcast_as(logp.shape())?.contiguous()?;
            Ok((logp, entropy))
        }
    }
}

/// Picks an action from one row of the policy head and returns its log-probability.
///
/// `head` is the row of logits (discrete) or means (Gaussian); `log_std` the Gaussian log-stds.
/// `greedy` takes the most likely action (argmax, or the mean). The action is written into
/// `action` (one value, the index as f32, for discrete policies).
pub fn sample<R: rand::Rng + ?Sized>(
    kind: &ActionKind,
    head: &[f32],
    log_std: &[f32],
    greedy: bool,
    rng: &mut R,
    action: &mut [f32],
) -> f32 {
    match kind {
        ActionKind::Discrete { .. } => {
            let max = head.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = head.iter().map(|&l| (l - max).exp()).sum();
            let log_z = max + sum.ln();
            let a = if greedy {
                let mut best = 0;
                for (i, &l) in head.iter().enumerate() {
                    if l > head[best] {
                        best = i;
                    }
                }
                best
            } else {
                let u: f32 = rng.random::<f32>() * sum;
                let mut acc = 0.0;
                let mut pick = head.len() - 1;
                for (i, &l) in head.iter().enumerate() {
                    acc += (l - max).exp();
                    if u < acc {
                        pick = i;
                        break;
                    }
                }
                pick
            };
            action[0] = a as f32;
            head[a] - log_z
        }
        ActionKind::Gaussian { .. } => {
            let mut logp = 0.0f64;
            for i in 0..head.len() {
                let z: f64 = if greedy {
                    0.0
                } else {
                    StandardNormal.sample(rng)
                };
                let std = (log_std[i] as f64).exp();
                action[i] = (head[i] as f64 + std * z) as f32;
                logp += -0.5 * z * z - log_std[i] as f64 - HALF_LN_2PI;
            }
            logp as f32
        }
    }
}

/// Converts stored actions (f32 per component) to the tensor [`log_prob_entropy`] expects.
pub fn actions_tensor(
    kind: &ActionKind,
    actions: Vec<f32>,
    users: usize,
    n: usize,
    device: &candle_core::Device,
) -> Result<Tensor> {
    Ok(match kind {
        ActionKind::Discrete { .. } => {
            let idx: Vec<u32> = actions.iter().map(|&a| a as u32).collect();
            Tensor::from_vec(idx, (users, n, 1), device)?
        }
        ActionKind::Gaussian { dim } => {
            Tensor::from_vec(actions, (users, n, *dim), device)?.to_dtype(DType::F32)?
        }
    })
}
