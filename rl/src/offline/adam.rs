//! Adam on a flat parameter vector, as PyTorch's `torch.optim.Adam` with its defaults
//! (`betas = (0.9, 0.999)`, no weight decay, no AMSGrad) and bias correction: what d3rlpy's
//! `AdamFactory` builds, used by both the non-private trainer and the DP-SGD server optimizer
//! (which only ever sees the noised gradient, so its state is post-processing).

use crate::{NnError, Result};

/// First-moment decay (PyTorch default).
pub const BETA1: f64 = 0.9;
/// Second-moment decay (PyTorch default).
pub const BETA2: f64 = 0.999;

/// Largest integer an f32 holds exactly; the step count is stored as two such halves.
const HALF: u64 = 1 << 24;

/// Adam state for one flat vector of `dim` parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Adam {
    lr: f64,
    eps: f64,
    /// Steps taken.
    t: u64,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl Adam {
    /// Fresh state (zero moments) for `dim` parameters; `lr` is the step size, `eps` the
    /// denominator's additive term (PyTorch's `eps`).
    pub fn new(dim: usize, lr: f64, eps: f64) -> Self {
        Adam {
            lr,
            eps,
            t: 0,
            m: vec![0.0; dim],
            v: vec![0.0; dim],
        }
    }

    /// Number of steps taken.
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// One descent step on `params` with gradient `grad` (same length as `dim`), in PyTorch's
    /// order: `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g^2`, `p -= lr / (1-b1^t) * m /
    /// (sqrt(v) / sqrt(1-b2^t) + eps)`.
    ///
    /// # Panics
    /// If `params` or `grad` does not have `dim` values (a programming error: lengths are
    /// checked where vectors enter the process).
    pub fn step(&mut self, params: &mut [f32], grad: &[f32]) {
        assert_eq!(params.len(), self.m.len(), "Adam: parameter length");
        assert_eq!(grad.len(), self.m.len(), "Adam: gradient length");
        self.t += 1;
        let t = self.t as i32;
        let bc1 = 1.0 - BETA1.powi(t);
        let bc2_sqrt = (1.0 - BETA2.powi(t)).sqrt();
        let step_size = (self.lr / bc1) as f32;
        let bc2_sqrt = bc2_sqrt as f32;
        // 1 - beta in f64 first, as PyTorch does (0.999f32 is not exactly 0.999).
        let (b1, b2, eps) = (BETA1 as f32, BETA2 as f32, self.eps as f32);
        let (c1, c2) = ((1.0 - BETA1) as f32, (1.0 - BETA2) as f32);
        for (((p, &g), m), v) in params
            .iter_mut()
            .zip(grad)
            .zip(self.m.iter_mut())
            .zip(self.v.iter_mut())
        {
            *m = b1 * *m + c1 * g;
            *v = b2 * *v + c2 * g * g;
            let denom = v.sqrt() / bc2_sqrt + eps;
            *p -= step_size * *m / denom;
        }
    }

    /// The state as `2 + 2 dim` values: the step count as two exact f32 halves (`t / 2^24`,
    /// `t % 2^24`), then `m`, then `v`. Survives any f32 serialisation.
    pub fn state(&self) -> Vec<f32> {
        let mut s = Vec::with_capacity(2 + 2 * self.m.len());
        s.push((self.t / HALF) as f32);
        s.push((self.t % HALF) as f32);
        s.extend_from_slice(&self.m);
        s.extend_from_slice(&self.v);
        s
    }

    /// Restores a state written by [`Adam::state`] for the same `dim`; the learning rate and
    /// `eps` stay those of `self`.
    pub fn restore(&mut self, state: &[f32]) -> Result<()> {
        let dim = self.m.len();
        let bad = |m: String| Err(NnError::Invalid(format!("Adam state: {m}")));
        if state.len() != 2 + 2 * dim {
            return bad(format!(
                "{} values, expected {} for {dim} parameters",
                state.len(),
                2 + 2 * dim
            ));
        }
        let half = |x: f32| {
            (x.is_finite() && x >= 0.0 && x.fract() == 0.0 && (x as u64) < HALF).then_some(x as u64)
        };
        let (Some(hi), Some(lo)) = (half(state[0]), half(state[1])) else {
            return bad(format!(
                "step count halves {} and {} are not integers in [0, 2^24)",
                state[0], state[1]
            ));
        };
        let (m, v) = state[2..].split_at(dim);
        if m.iter().any(|x| !x.is_finite()) || v.iter().any(|x| !(x.is_finite() && *x >= 0.0)) {
            return bad("moments must be finite and second moments >= 0".into());
        }
        self.t = hi * HALF + lo;
        self.m.copy_from_slice(m);
        self.v.copy_from_slice(v);
        Ok(())
    }
}
