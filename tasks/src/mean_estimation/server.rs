//! DP mean estimation, server side: the mean follows the released noisy mean updates.

use fedrl_common::scenario::MeanEstimationTask;

use crate::server::{ModelError, ModelState, ServerModel, ServerOptimizer};

/// DP federated mean estimation, server side: theta starts at 0 and follows the released noisy
/// mean of `x_u - theta`. Evaluation compares with the simulation's true mean (known only
/// because this is a simulation; it is not derived from any user's data beyond the seed).
pub struct MeanEstimationModel {
    sgd: ServerOptimizer,
    truth: Vec<f32>,
}

impl MeanEstimationModel {
    pub fn new(task: &MeanEstimationTask) -> Self {
        MeanEstimationModel {
            sgd: ServerOptimizer::new(vec![0.0; task.dim], task.server_lr, 0.0),
            truth: task.true_mean(),
        }
    }
}

impl ServerModel for MeanEstimationModel {
    fn params(&self) -> &[f32] {
        &self.sgd.params
    }
    fn apply(&mut self, noisy_mean_update: &[f32]) -> Result<(), ModelError> {
        self.sgd.step(noisy_mean_update)
    }

    fn diagnostics(&self) -> serde_json::Map<String, serde_json::Value> {
        self.sgd.diagnostics()
    }
    fn state(&self) -> ModelState {
        self.sgd
            .state(serde_json::json!({"model": "mean_estimation", "dim": self.truth.len()}))
    }
    fn restore(&mut self, state: ModelState) -> Result<(), ModelError> {
        self.sgd.restore(&state)
    }
    fn evaluate(&mut self, _round: u64) -> Option<serde_json::Value> {
        let err: f64 = self
            .sgd
            .params
            .iter()
            .zip(&self.truth)
            .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        Some(serde_json::json!({ "l2_error": err }))
    }
}
