//! DP federated mean estimation: each user holds a private vector and the aggregator learns
//! their mean. It needs no RL: it proves the transport, the engine and the ledger on their own.
//! The dimension is one of the task's parameters.

/// The kind's parameters: `spec.rs` in this folder, compiled into `fedrl-common` as
/// `fedrl_common::task::mean_estimation` (its doc says why).
pub use fedrl_common::task::mean_estimation as spec;

pub mod client;
pub mod server;

pub use client::MeanEstimationTrainer;
pub use server::MeanEstimationModel;

use fedrl_common::protocol::UnitRange;
use fedrl_common::scenario::{MeanEstimationTask, Scenario};
use fedrl_common::task::TaskError;
use fedrl_rl::candle_core::Device;

use crate::client::LocalTrainer;
use crate::registry::TaskKind;
use crate::server::ServerModel;

/// The mean-estimation kind in the registry.
pub struct MeanEstimation;

impl TaskKind for MeanEstimation {
    type Spec = MeanEstimationTask;

    fn dim(spec: &MeanEstimationTask) -> Result<usize, TaskError> {
        Ok(spec.dim)
    }

    fn trainer(
        spec: &MeanEstimationTask,
        _units: &[UnitRange],
        _device: &Device,
    ) -> anyhow::Result<Box<dyn LocalTrainer>> {
        Ok(Box::new(MeanEstimationTrainer::new(spec.clone())))
    }

    fn server_model(
        spec: &MeanEstimationTask,
        _scenario: &Scenario,
    ) -> anyhow::Result<Box<dyn ServerModel>> {
        Ok(Box::new(MeanEstimationModel::new(spec)))
    }
}
