//! Server-side task registry: which [`ServerModel`] a scenario's task uses. Add an arm per task.

use anyhow::Context;
use fedrl_common::scenario::{Scenario, Task};

use crate::model::{MeanEstimationModel, ServerModel};

/// The server model for `scenario`'s task, freshly initialised; its tensors live on the
/// scenario's `device`.
pub fn server_model(scenario: &Scenario) -> anyhow::Result<Box<dyn ServerModel>> {
    match &scenario.task {
        Task::MeanEstimation(t) => Ok(Box::new(MeanEstimationModel::new(t))),
        Task::Dppg(t) => {
            let device = fedrl_rl::device::open(scenario.device).context("scenario device")?;
            Ok(Box::new(crate::dppg::DppgModel::new(
                t,
                scenario.users,
                scenario.rounds,
                device,
            )?))
        }
        Task::LogLinearPg(t) => Ok(Box::new(crate::loglinear::LogLinearModel::new(
            t,
            scenario.users,
        )?)),
        // The server model only applies released gradients (flat vectors) and evaluates on the
        // CPU; the central mode's gradients run on the scenario's device (service::central).
        Task::OfflineCql(t) => Ok(Box::new(crate::cql::CqlModel::new(t)?)),
        Task::Primorl(t) => {
            let device = fedrl_rl::device::open(scenario.device).context("scenario device")?;
            Ok(Box::new(crate::primorl::PrimorlModel::new(t, device)?))
        }
    }
}
