//! User-level DP log-linear policy gradient with the L2 trust-region clipping rule (seed 004
//! §4.2.1, its Riverswim experiments): one REINFORCE step per user ([`client`]), the server's
//! learning-rate schedule and the exported policy ([`server`]). The shape: [`LogLinearTaskExt`].

/// The kind's parameters: `spec.rs` in this folder, compiled into `fedrl-common` as
/// `fedrl_common::task::loglinear` (its doc says why).
pub use fedrl_common::task::loglinear as spec;

pub mod client;
pub mod server;

pub use client::LogLinearTrainer;
pub use server::LogLinearModel;

use fedrl_common::protocol::UnitRange;
use fedrl_common::scenario::Scenario;
use fedrl_common::task::{LogLinearTask, TaskError};
use fedrl_rl::candle_core::Device;
use fedrl_rl::loglinear::LogLinearSpec;
use fedrl_sim::population::Population;

use crate::client::LocalTrainer;
use crate::registry::{TaskKind, model_error};
use crate::server::ServerModel;

/// The log-linear policy-gradient kind in the registry.
pub struct LogLinearPg;

impl TaskKind for LogLinearPg {
    type Spec = LogLinearTask;

    fn dim(spec: &LogLinearTask) -> Result<usize, TaskError> {
        Ok(spec.spec()?.dim())
    }

    fn trainer(
        spec: &LogLinearTask,
        _units: &[UnitRange],
        _device: &Device,
    ) -> anyhow::Result<Box<dyn LocalTrainer>> {
        Ok(Box::new(LogLinearTrainer::new(spec)?))
    }

    fn server_model(
        spec: &LogLinearTask,
        scenario: &Scenario,
    ) -> anyhow::Result<Box<dyn ServerModel>> {
        Ok(Box::new(LogLinearModel::new(spec, scenario.users)?))
    }
}

/// The log-linear policy a [`LogLinearTask`] trains.
pub trait LogLinearTaskExt {
    /// The policy's shape for the population's environment.
    fn spec(&self) -> Result<LogLinearSpec, TaskError>;
}

impl LogLinearTaskExt for LogLinearTask {
    fn spec(&self) -> Result<LogLinearSpec, TaskError> {
        let env = Population::new(&self.population, self.population_seed)
            .and_then(|p| p.user_env(0))
            .map_err(|e| model_error("task.population", e))?;
        LogLinearSpec::from_spaces(env.observation_space(), env.action_space())
            .map_err(|e| model_error("task.population", e))
    }
}
