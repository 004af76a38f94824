//! PriMORL (seed 001): a dynamics-model ensemble trained by DP-FedAvg over the trajectories of a
//! continuous-action dataset ([`client`]: each sampled trajectory's clipped ensemble delta),
//! then SAC inside the pessimistic private model on the aggregator ([`server`]). The shape is
//! `fedrl_rl::primorl::PrimorlTaskExt` (the learner in `fedrl-rl` needs it too).

/// The kind's parameters: `spec.rs` in this folder, compiled into `fedrl-common` as
/// `fedrl_common::task::primorl` (its doc says why).
pub use fedrl_common::task::primorl as spec;

pub mod client;
pub mod server;

pub use client::PrimorlTrainer;
pub use fedrl_rl::primorl::PrimorlTaskExt;
pub use server::{ENSEMBLE_FILE, POLICY_FILE, POLICY_SNAPSHOTS_FILE, PrimorlModel};

use anyhow::Context;
use fedrl_common::protocol::UnitRange;
use fedrl_common::scenario::Scenario;
use fedrl_common::task::TaskError;
use fedrl_common::task::primorl::PrimorlTask;
use fedrl_rl::candle_core::Device;

use crate::client::LocalTrainer;
use crate::registry::TaskKind;
use crate::server::ServerModel;

/// Whether the task's policy phase is evaluated in a Gymnasium environment: the aggregator then
/// runs it without evaluations and `fedrl run` evaluates each epoch's actor through the bridge
/// (the aggregator runs no Python).
pub fn evaluates_in_gymnasium(task: &PrimorlTask) -> bool {
    task.dataset
        .generated()
        .is_some_and(|s| s.gymnasium.is_some())
}

/// The PriMORL kind in the registry.
pub struct Primorl;

impl TaskKind for Primorl {
    type Spec = PrimorlTask;

    fn dim(spec: &PrimorlTask) -> Result<usize, TaskError> {
        Ok(spec.ensemble_shape()?.len())
    }

    fn trainer(
        spec: &PrimorlTask,
        units: &[UnitRange],
        device: &Device,
    ) -> anyhow::Result<Box<dyn LocalTrainer>> {
        Ok(Box::new(PrimorlTrainer::new(spec, units, device.clone())?))
    }

    fn server_model(
        spec: &PrimorlTask,
        scenario: &Scenario,
    ) -> anyhow::Result<Box<dyn ServerModel>> {
        let device = fedrl_rl::device::open(scenario.device).context("scenario device")?;
        let model = PrimorlModel::new(spec, device)?;
        // The batch's public denominator is `rate x users`: a standalone aggregator must hold
        // the operator to the dataset's count as `fedrl run` does.
        if model.private_units() != scenario.users {
            anyhow::bail!(
                "users ({}) must equal the dataset's private trajectories ({}; an exact count, operator-only)",
                scenario.users,
                model.private_units()
            );
        }
        Ok(Box::new(model))
    }
}
