//! The discrete CQL loss (Kumar et al. 2020, CQL(H) on a double-DQN target, as d3rlpy 2.8's
//! `DiscreteCQL` computes it) and its gradient: one implementation for the non-private minibatch
//! trainer and the per-unit DP-SGD path.
//!
//! Per transition `i` (the loss of a batch is the mean over its rows):
//!
//! ```text
//! y_i    = r_i + gamma (1 - terminal_i) Q_target(s'_i, argmax_a' Q(s'_i, a'))   (no gradient)
//! l_i    = huber(Q(s_i, a_i) - y_i) + alpha (logsumexp_a Q(s_i, a) - Q(s_i, a_i))
//! huber(d) = d^2 / 2 if |d| < 1, |d| - 1/2 otherwise                            (d3rlpy, beta 1)
//! ```
//!
//! The backward pass is written out (it is three matmuls for an MLP): it yields every example's
//! gradient with respect to every layer's pre-activation (`delta`), from which the mean gradient
//! ([`loss_and_grad`]) and the per-unit clipped gradients ([`super::per_example`]) are one matmul
//! per layer each. Everything runs on the `Device` passed in, with ops that the CUDA backend has.

use candle_core::{D, DType, Device, Tensor};
use fedrl_common::offline::CqlConfig;

use super::batch::TransitionBatch;
use super::qnet::{DeviceNet, QNetSpec, relu_mask};
use crate::{NnError, Result};

/// Forward and backward of a batch, kept on the device: what every gradient is built from.
pub(crate) struct PerExample {
    /// `inputs[l]`: the `[B, fan_in]` input of layer `l`.
    pub inputs: Vec<Tensor>,
    /// `deltas[l]`: `[B, fan_out]`, row `i` = d l_i / d z_l(i) (the per-example gradient of the
    /// loss with respect to layer `l`'s pre-activation).
    pub deltas: Vec<Tensor>,
    /// `[B]` per-example losses `l_i`.
    pub losses: Tensor,
}

/// Checks the hyper-parameters the loss reads.
pub(crate) fn check_config(cfg: &CqlConfig) -> Result<()> {
    if !(cfg.gamma.is_finite() && (0.0..=1.0).contains(&cfg.gamma)) {
        return Err(NnError::Invalid(format!(
            "gamma must be in [0, 1], got {}",
            cfg.gamma
        )));
    }
    if !(cfg.alpha.is_finite() && cfg.alpha >= 0.0) {
        return Err(NnError::Invalid(format!(
            "alpha must be finite and >= 0, got {}",
            cfg.alpha
        )));
    }
    Ok(())
}

/// Checks that a batch fits the network: observation width, action range, lengths and finite
/// values (the data comes from outside the process).
pub(crate) fn check_batch(spec: &QNetSpec, batch: &TransitionBatch) -> Result<()> {
    let n = batch.len();
    let d = spec.obs_dim;
    let bad = |m: String| Err(NnError::Invalid(m));
    if batch.obs_dim != d {
        return bad(format!(
            "batch observations have {} values, the Q-network takes {d}",
            batch.obs_dim
        ));
    }
    if batch.obs.len() != n * d
        || batch.next_obs.len() != n * d
        || batch.rewards.len() != n
        || batch.terminals.len() != n
    {
        return bad(format!(
            "batch arrays disagree on the number of transitions ({n} actions)"
        ));
    }
    if n == 0 {
        return bad("empty batch".into());
    }
    if let Some(a) = batch
        .actions
        .iter()
        .find(|&&a| a as usize >= spec.n_actions)
    {
        return bad(format!(
            "action {a} out of range for {} actions",
            spec.n_actions
        ));
    }
    let finite = |v: &[f32]| v.iter().all(|x| x.is_finite());
    if !(finite(&batch.obs) && finite(&batch.next_obs) && finite(&batch.rewards)) {
        return bad("batch holds non-finite observations or rewards".into());
    }
    if batch.terminals.iter().any(|&t| t != 0.0 && t != 1.0) {
        return bad("terminal flags must be 0 or 1".into());
    }
    Ok(())
}

/// Runs the forward and backward pass of the CQL loss on `batch`; see the module docs.
pub(crate) fn per_example(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    params: &[f32],
    target: &[f32],
    batch: &TransitionBatch,
    device: &Device,
) -> Result<PerExample> {
    check_config(cfg)?;
    check_batch(spec, batch)?;
    let n = batch.len();
    let d = spec.obs_dim;
    let k = spec.n_actions;
    let online = DeviceNet::upload(spec, params, device)?;
    let target_net = DeviceNet::upload(spec, target, device)?;

    // s and s' through the online network in one pass (fewer, larger ops).
    let mut both = Vec::with_capacity(2 * n * d);
    both.extend_from_slice(&batch.obs);
    both.extend_from_slice(&batch.next_obs);
    let both = Tensor::from_vec(both, (2 * n, d), device)?;
    let (inputs_both, q_both) = online.forward(&both)?;
    let inputs: Vec<Tensor> = inputs_both
        .iter()
        .map(|t| t.narrow(0, 0, n))
        .collect::<candle_core::Result<_>>()?;
    let q = q_both.narrow(0, 0, n)?;
    let q_next_online = q_both.narrow(0, n, n)?;
    let next = both.narrow(0, n, n)?;
    let (_, q_next_target) = target_net.forward(&next)?;

    // Double DQN target, treated as a constant.
    let a_star = q_next_online.argmax_keepdim(D::Minus1)?;
    let v_next = q_next_target.gather(&a_star, D::Minus1)?;
    let discount: Vec<f32> = batch
        .terminals
        .iter()
        .map(|t| (cfg.gamma * (1.0 - f64::from(*t))) as f32)
        .collect();
    let discount = Tensor::from_vec(discount, (n, 1), device)?;
    let rewards = Tensor::from_slice(&batch.rewards, (n, 1), device)?;
    let rewards = if cfg.reward_scale == 1.0 {
        rewards
    } else {
        rewards.affine(cfg.reward_scale, 0.0)?
    };
    let y = rewards.add(&discount.mul(&v_next)?)?;

    let mut one_hot = vec![0f32; n * k];
    for (i, &a) in batch.actions.iter().enumerate() {
        one_hot[i * k + a as usize] = 1.0;
    }
    let one_hot = Tensor::from_vec(one_hot, (n, k), device)?;
    let q_data = q.mul(&one_hot)?.sum_keepdim(D::Minus1)?;

    // Huber(1): with c = clamp(diff, -1, 1), huber = c (diff - c/2) and d huber / d diff = c.
    let diff = q_data.sub(&y)?;
    let c = diff.clamp(-1f32, 1f32)?;
    let td = c.mul(&diff.sub(&c.affine(0.5, 0.0)?)?)?;

    let m = q.max_keepdim(D::Minus1)?;
    let lse = q
        .broadcast_sub(&m)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        .add(&m)?;
    let alpha = cfg.alpha;
    let losses = td
        .add(&lse.sub(&q_data)?.affine(alpha, 0.0)?)?
        .squeeze(D::Minus1)?;

    // d l_i / d Q(s_i, .) = c_i one_hot_i + alpha (softmax(Q(s_i, .)) - one_hot_i).
    let softmax = q.broadcast_sub(&lse)?.exp()?;
    let dq = one_hot
        .broadcast_mul(&c)?
        .add(&softmax.sub(&one_hot)?.affine(alpha, 0.0)?)?;

    let n_layers = inputs.len();
    let mut deltas = vec![dq];
    for l in (1..n_layers).rev() {
        let back = deltas[deltas.len() - 1].matmul(&online.weights[l])?;
        deltas.push(back.mul(&relu_mask(&inputs[l])?)?);
    }
    deltas.reverse();
    Ok(PerExample {
        inputs,
        deltas,
        losses,
    })
}

/// Flattens per-layer `[out, in]` weight and `[out]` bias gradients into the flat layout.
pub(crate) fn flatten_layers(grads: &[(Tensor, Tensor)]) -> Result<Vec<f32>> {
    let parts: Vec<Tensor> = grads
        .iter()
        .flat_map(|(w, b)| [w.flatten_all(), b.flatten_all()])
        .collect::<candle_core::Result<_>>()?;
    Ok(Tensor::cat(&parts, 0)?.to_dtype(DType::F32)?.to_vec1()?)
}

/// The mean CQL loss over `batch` and its gradient with respect to `params` (flat layout of
/// [`QNetSpec`]); `target` holds the target network's parameters. The target `y` carries no
/// gradient. Computed on `device`.
pub fn loss_and_grad(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    params: &[f32],
    target: &[f32],
    batch: &TransitionBatch,
    device: &Device,
) -> Result<(f64, Vec<f32>)> {
    let pe = per_example(spec, cfg, params, target, batch, device)?;
    let inv_n = 1.0 / batch.len() as f64;
    let grads: Vec<(Tensor, Tensor)> = pe
        .deltas
        .iter()
        .zip(&pe.inputs)
        .map(|(delta, input)| {
            let delta = delta.affine(inv_n, 0.0)?;
            Ok((delta.t()?.matmul(input)?, delta.sum(0)?))
        })
        .collect::<candle_core::Result<_>>()?;
    let loss = pe.losses.mean_all()?.to_scalar::<f32>()? as f64;
    Ok((loss, flatten_layers(&grads)?))
}
