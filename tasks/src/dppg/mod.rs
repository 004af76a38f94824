//! User-level DP policy gradient (seed 004): users play episodes in their own simulators and
//! send clipped local PPO updates ([`client`]); the aggregator applies the released noisy mean
//! update with its server optimizer, evaluates on held-out users and exports the policy
//! ([`server`]). Which held-out users and reset seeds, and the evaluation of `gymnasium:<id>`
//! populations that `fedrl run` does after the aggregator ended (the aggregator runs no
//! Python): [`held_out`]. The shapes: [`DppgTaskExt`] builds the population and the
//! policy/value model.

/// The kind's parameters: `spec.rs` in this folder, compiled into `fedrl-common` as
/// `fedrl_common::task::dppg` (its doc says why).
pub use fedrl_common::task::dppg as spec;

pub mod client;
pub mod held_out;
pub mod server;

pub use client::{DppgTrainer, episode_seed};
pub use held_out::{Evaluation, GymEvaluator};
pub use server::{DppgModel, PID_TUNING_USERS, POLICY_FILE};

use anyhow::Context;
use fedrl_common::protocol::UnitRange;
use fedrl_common::scenario::Scenario;
use fedrl_common::task::dppg::{GymnasiumSpec, KwargDraw};
use fedrl_common::task::{DppgTask, TaskError};
use fedrl_rl::ModelSpec;
use fedrl_rl::candle_core::Device;
use fedrl_rl::local_update::LocalUpdateExt;
use fedrl_sim::Space;
use fedrl_sim::gym_bridge::{self, DeclaredAction, DeclaredSpaces, Draw, GymConfig};
use fedrl_sim::population::{Population, PumpOverrides};

use crate::client::LocalTrainer;
use crate::registry::{TaskKind, model_error};
use crate::server::ServerModel;

/// The DPPG kind in the registry.
pub struct Dppg;

impl TaskKind for Dppg {
    type Spec = DppgTask;

    fn dim(spec: &DppgTask) -> Result<usize, TaskError> {
        Ok(spec.model_spec()?.layout().len())
    }

    fn trainer(
        spec: &DppgTask,
        _units: &[UnitRange],
        device: &Device,
    ) -> anyhow::Result<Box<dyn LocalTrainer>> {
        Ok(Box::new(DppgTrainer::new(spec, device.clone())?))
    }

    fn server_model(spec: &DppgTask, scenario: &Scenario) -> anyhow::Result<Box<dyn ServerModel>> {
        let device = fedrl_rl::device::open(scenario.device).context("scenario device")?;
        Ok(Box::new(DppgModel::new(
            spec,
            scenario.users,
            scenario.rounds,
            device,
        )?))
    }
}

/// The MLP a [`DppgTask`] trains.
pub trait DppgTaskExt {
    /// The task's population with its pump overrides (`low_risk_weight`, `decision_min`,
    /// `low_glucose_suspend`, `iob_limit`, `sensitivity_scaling`).
    fn population(&self) -> Result<Population, TaskError>;
    /// The policy/value model for the population's environment.
    fn model_spec(&self) -> Result<ModelSpec, TaskError>;
}

impl DppgTaskExt for DppgTask {
    fn population(&self) -> Result<Population, TaskError> {
        Population::new(&self.population, self.population_seed)
            .and_then(|p| {
                p.with_pump_overrides(PumpOverrides {
                    low_risk_weight: self.low_risk_weight,
                    decision_min: self.decision_min,
                    low_glucose_suspend: self.low_glucose_suspend,
                    iob_limit: self.iob_limit,
                    sensitivity_scaling: self.sensitivity_scaling,
                })
            })
            .map_err(|e| model_error("task.population", e))
    }

    fn model_spec(&self) -> Result<ModelSpec, TaskError> {
        // A Gymnasium population's spaces are the task's declaration (no Python here: the
        // aggregator builds its model from them; the agents check their workers against them).
        if let Some(g) = gymnasium_of(self) {
            let declared = declared_spaces(g);
            let obs = Space::Box {
                low: vec![f32::NEG_INFINITY; declared.obs_dim],
                high: vec![f32::INFINITY; declared.obs_dim],
            };
            let act = match declared.action {
                DeclaredAction::Discrete { n } => Space::Discrete { n },
                DeclaredAction::Box { dim } => Space::Box {
                    low: vec![f32::NEG_INFINITY; dim],
                    high: vec![f32::INFINITY; dim],
                },
            };
            return self
                .local
                .model_spec(&obs, &act)
                .map_err(|e| model_error("task.local", e));
        }
        let env = self
            .population()?
            .user_env(0)
            .map_err(|e| model_error("task.population", e))?;
        self.local
            .model_spec(env.observation_space(), env.action_space())
            .map_err(|e| model_error("task.local", e))
    }
}

/// The task's `[task.gymnasium]` table when its population is `gymnasium:<id>` (the spec's
/// check guarantees the table is there).
pub fn gymnasium_of(task: &DppgTask) -> Option<&GymnasiumSpec> {
    gym_bridge::env_id_of(&task.population).and(task.gymnasium.as_ref())
}

/// The spaces a Gymnasium task declares.
pub fn declared_spaces(g: &GymnasiumSpec) -> DeclaredSpaces {
    DeclaredSpaces {
        obs_dim: g.obs_dim,
        action: match (g.actions, g.action_dim) {
            (Some(n), _) => DeclaredAction::Discrete { n },
            (None, dim) => DeclaredAction::Box {
                dim: dim.unwrap_or(0),
            },
        },
    }
}

/// The bridge's configuration of a `gymnasium:<id>` DPPG task (`None` for other populations).
pub fn gym_config(task: &DppgTask) -> Option<GymConfig> {
    let g = gymnasium_of(task)?;
    let env_id = gym_bridge::env_id_of(&task.population)?;
    let mut cfg = GymConfig::new(env_id);
    cfg.module = g.module.clone();
    cfg.python = g.python.as_ref().map(std::path::PathBuf::from);
    cfg.kwargs = g.kwargs.clone();
    cfg.user_kwargs = g
        .user_kwargs
        .iter()
        .map(|(k, d)| {
            let draw = match d {
                KwargDraw::Uniform([low, high]) => Draw::Uniform {
                    low: *low,
                    high: *high,
                },
                KwargDraw::Linspace(low, high, n) => Draw::Linspace {
                    low: *low,
                    high: *high,
                    n: *n,
                },
                KwargDraw::Choice(v) => Draw::Choice(v.clone()),
            };
            (k.clone(), draw)
        })
        .collect();
    cfg.seed = task.population_seed;
    cfg.workers = g.workers;
    cfg.step_timeout = std::time::Duration::from_secs_f64(g.step_timeout_s);
    cfg.start_timeout = std::time::Duration::from_secs_f64(g.start_timeout_s);
    cfg.reuse_envs = g.reuse_envs;
    Some(cfg)
}
