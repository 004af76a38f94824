//! The server optimizer's rule: how a released noisy mean update moves the global parameters.
//! Post-processing of released updates, so any rule costs no privacy. The aggregator's
//! `ServerOptimizer` (state, checkpoints) and the in-process example both apply it from here.

/// A rule for applying released updates `u` (client updates point in the direction to move, so
/// the server adds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ServerRule {
    /// SGD with momentum: `v = momentum * v + u; theta += lr * v`.
    Sgd { momentum: f64 },
    /// Adam on the released update (DP-FedAdam, Reddi et al. 2021, "Adaptive Federated
    /// Optimization"): `m = b1 m + (1 - b1) u`, `v = b2 v + (1 - b2) u^2`, `theta += lr *
    /// m_hat / (sqrt(v_hat) + eps)` with bias-corrected `m_hat`, `v_hat`. With noisy updates
    /// `v` tracks the noise variance, so each coordinate moves about `lr` per round in the
    /// direction the signal keeps; `eps` is the adaptivity floor (update units).
    Adam { beta1: f64, beta2: f64, eps: f64 },
}

impl ServerRule {
    /// Whether the rule keeps a second moment.
    pub fn has_second_moment(&self) -> bool {
        matches!(self, ServerRule::Adam { .. })
    }

    /// Applies update `update` as the `step`-th (1-based, for Adam's bias correction) with step
    /// size `lr`: `first` is SGD's velocity or Adam's first moment, `second` Adam's second
    /// moment (ignored by SGD). Arithmetic in f64, stored as f32. All slices have one length
    /// (the caller checks).
    pub fn apply(
        &self,
        lr: f64,
        step: u64,
        params: &mut [f32],
        first: &mut [f32],
        second: &mut [f32],
        update: &[f32],
    ) {
        match *self {
            ServerRule::Sgd { momentum } => {
                for ((p, v), u) in params.iter_mut().zip(first.iter_mut()).zip(update) {
                    *v = (momentum * *v as f64 + *u as f64) as f32;
                    *p = (*p as f64 + lr * *v as f64) as f32;
                }
            }
            ServerRule::Adam { beta1, beta2, eps } => {
                let t = step.clamp(1, i32::MAX as u64) as i32;
                let (bc1, bc2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
                for (((p, m), v), u) in params
                    .iter_mut()
                    .zip(first.iter_mut())
                    .zip(second.iter_mut())
                    .zip(update)
                {
                    let u = *u as f64;
                    let m_new = beta1 * *m as f64 + (1.0 - beta1) * u;
                    let v_new = beta2 * *v as f64 + (1.0 - beta2) * u * u;
                    *m = m_new as f32;
                    *v = v_new as f32;
                    let s = lr * (m_new / bc1) / ((v_new / bc2).sqrt() + eps);
                    *p = (*p as f64 + s) as f32;
                }
            }
        }
    }
}
