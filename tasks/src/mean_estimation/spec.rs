//! DP federated mean estimation's parameters ([`Task::MeanEstimation`]).
//!
//! This is the kind's spec: plain serde data, checked without a model. It sits in the kind's
//! folder with the rest of the kind, but `common/src/task.rs` compiles it into `fedrl-common`
//! (as `fedrl_common::task::mean_estimation`): `Task`, which the protocol, the scenario loader and the
//! engine read without candle, names it. So `crate` here is `fedrl_common`. Adding a kind:
//! docs/adding-a-task-kind.md.

use rand::SeedableRng;
use rand::rngs::ChaCha20Rng;
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

use crate::task::{TaskError, TaskSpec};
// Named by the docs only.
#[cfg(doc)]
use crate::task::Task;

/// Parameters of [`Task::MeanEstimation`].
///
/// User `u` holds `x_u = mu + user_std * g_u`, with `g_u` standard normal from a generator seeded
/// by `(data_seed, u)` and `mu` a fixed vector of norm `mean_norm` derived from `data_seed`. Its
/// update in a round is `x_u - theta` (theta: the global estimate); the server applies
/// `theta += server_lr * noisy_mean_update`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeanEstimationTask {
    /// Dimension of the vectors. Default 16.
    #[serde(default = "d_dim")]
    pub dim: usize,
    /// L2 norm of the true mean. Default 0.5.
    #[serde(default = "d_mean_norm")]
    pub mean_norm: f64,
    /// Per-coordinate standard deviation of users around the mean. Default 0.1.
    #[serde(default = "d_user_std")]
    pub user_std: f64,
    /// Server learning rate. Default 1.
    #[serde(default = "d_one_f")]
    pub server_lr: f64,
    /// Seed of the simulated users' data (public: it is the simulation, not the noise).
    /// Default 0.
    #[serde(default)]
    pub data_seed: u64,
}

impl TaskSpec for MeanEstimationTask {
    const KIND: &'static str = "mean_estimation";
    const CONFIG_VERSION: u32 = 1;
    fn check(&self) -> Result<(), TaskError> {
        self.validate()
    }
}

impl MeanEstimationTask {
    /// The true mean `mu` (simulation ground truth).
    pub fn true_mean(&self) -> Vec<f32> {
        let mut rng = ChaCha20Rng::seed_from_u64(self.data_seed ^ 0x6d65_616e_6d75_0000);
        let g: Vec<f64> = (0..self.dim)
            .map(|_| StandardNormal.sample(&mut rng))
            .collect();
        let norm = g
            .iter()
            .map(|x| x * x)
            .sum::<f64>()
            .sqrt()
            .max(f64::MIN_POSITIVE);
        g.iter()
            .map(|x| (x / norm * self.mean_norm) as f32)
            .collect()
    }

    /// User `unit`'s private vector, given the true mean from [`Self::true_mean`].
    pub fn user_vector(&self, mu: &[f32], unit: u64) -> Vec<f32> {
        let mut rng =
            ChaCha20Rng::seed_from_u64(self.data_seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ unit);
        mu.iter()
            .map(|m| {
                let g: f64 = StandardNormal.sample(&mut rng);
                (*m as f64 + self.user_std * g) as f32
            })
            .collect()
    }

    fn validate(&self) -> Result<(), TaskError> {
        if !(self.mean_norm.is_finite() && self.user_std.is_finite() && self.user_std >= 0.0) {
            return Err(TaskError::Invalid(
                "task.mean_norm and task.user_std must be finite, user_std >= 0".into(),
            ));
        }
        if !self.server_lr.is_finite() {
            return Err(TaskError::Invalid("task.server_lr must be finite".into()));
        }
        Ok(())
    }
}

fn d_one_f() -> f64 {
    1.0
}

fn d_dim() -> usize {
    16
}

fn d_mean_norm() -> f64 {
    0.5
}

fn d_user_std() -> f64 {
    0.1
}
