//! DP mean estimation, client side: user `u`'s update is its private vector minus the global
//! mean.

use fedrl_common::protocol::{RoundSpec, UnitId};
use fedrl_common::scenario::MeanEstimationTask;

use crate::client::LocalTrainer;

/// DP mean estimation, client side: user `u`'s update is `x_u - global`.
pub struct MeanEstimationTrainer {
    task: MeanEstimationTask,
    mu: Vec<f32>,
}

impl MeanEstimationTrainer {
    pub fn new(task: MeanEstimationTask) -> Self {
        let mu = task.true_mean();
        MeanEstimationTrainer { task, mu }
    }
}

impl LocalTrainer for MeanEstimationTrainer {
    fn local_updates(
        &mut self,
        _round: &RoundSpec,
        global: &[f32],
        units: &[UnitId],
    ) -> Vec<(UnitId, Vec<f32>)> {
        units
            .iter()
            .map(|u| {
                let x = self.task.user_vector(&self.mu, *u);
                let delta = x.iter().zip(global).map(|(a, b)| a - b).collect();
                (*u, delta)
            })
            .collect()
    }
}
