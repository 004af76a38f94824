//! The client-side task trait and the mean-estimation trainer.

use std::sync::Arc;

use fedrl_common::protocol::{ReleasedPrefix, RoundSpec, UnitId, UnitRange, Welcome};
use fedrl_common::scenario::{MeanEstimationTask, Task};
use fedrl_rl::candle_core::Device;

/// Computes local updates for the units a client agent hosts.
///
/// Called once per round offer with every offered unit of this agent, so implementations can
/// batch many users into one tensor job. It runs on a blocking thread (`spawn_blocking`), never on
/// a tokio worker. Rules (DESIGN §3): a unit's update may depend only on that unit's data and the
/// global model (no optimizer state carried from one unit to another). The agent clips every
/// returned update to `round.clip_norm` before sending; returning fewer units than asked simply
/// means those units do not contribute this round.
pub trait LocalTrainer: Send {
    /// `global` has `round.offer_dim` values (the model, then any public state the task's offer
    /// carries); each returned vector must have `round.dim` values.
    fn local_updates(
        &mut self,
        round: &RoundSpec,
        global: &[f32],
        units: &[UnitId],
    ) -> Vec<(UnitId, Vec<f32>)>;

    /// The units' data to upload once after joining, for tasks in the central update mode
    /// (DESIGN §2.5: the aggregator then computes the units' clipped updates itself). Empty (the
    /// default) in the federated mode: the data never leaves the agent.
    fn unit_data(&self) -> Vec<UnitUpload> {
        Vec::new()
    }

    /// DataRelease (seed 002): episode `episode` of unit `unit`, as an upload (its `payload` in
    /// `encode_rows` layout) and the row of its first transition among the unit's transitions.
    fn episode_rows(&self, unit: UnitId, episode: u32) -> Result<(UnitUpload, u32), String> {
        let _ = (unit, episode);
        Err("this task holds no expert demonstrations".into())
    }

    /// DataRelease: for h = 1..=L, the sum over this agent's experts of the probability of
    /// playing the trajectory's first h actions (`obs`: L rows of `obs_dim` raw observations).
    fn prefix_counts(&self, obs: &[f32], actions: &[u32]) -> Result<Vec<f64>, String> {
        let _ = (obs, actions);
        Err("this task has no expert policies".into())
    }

    /// DataRelease: these prefixes of this agent's units are public now; DP-SGD steps draw from
    /// the rest.
    fn stable_released(&mut self, prefixes: &[ReleasedPrefix]) {
        let _ = prefixes;
    }
}

/// One unit's data for a `UnitData` frame: `rows` rows of f32 (layout:
/// `fedrl_rl::offline::dpsgd::encode_rows`).
#[derive(Clone, Debug, PartialEq)]
pub struct UnitUpload {
    pub unit: UnitId,
    pub obs_dim: u32,
    pub rows: u32,
    pub payload: Vec<f32>,
}

/// Builds an agent's trainer from the server's welcome (task JSON, dimension, seed) and the unit
/// ranges the agent hosts. Called once per agent process, at the first successful join.
pub type TrainerFactory =
    Arc<dyn Fn(&Welcome, &[UnitRange]) -> anyhow::Result<Box<dyn LocalTrainer>> + Send + Sync>;

/// The factory for the built-in tasks, computing on `device` (`fedrl client --device`); add an
/// arm per task.
pub fn default_factory(device: Device) -> TrainerFactory {
    Arc::new(move |welcome: &Welcome, units: &[UnitRange]| {
        let task = Task::from_json(&welcome.task_json)?;
        match task {
            Task::MeanEstimation(t) => {
                Ok(Box::new(MeanEstimationTrainer::new(t)) as Box<dyn LocalTrainer>)
            }
            Task::Dppg(t) => Ok(Box::new(crate::dppg::DppgTrainer::new(&t, device.clone())?)
                as Box<dyn LocalTrainer>),
            Task::LogLinearPg(t) => {
                Ok(Box::new(crate::loglinear::LogLinearTrainer::new(&t)?) as Box<dyn LocalTrainer>)
            }
            Task::OfflineCql(t) => Ok(Box::new(crate::cql::CqlTrainer::new(
                &t,
                units,
                device.clone(),
            )?) as Box<dyn LocalTrainer>),
            Task::Primorl(t) => Ok(Box::new(crate::primorl::PrimorlTrainer::new(
                &t,
                units,
                device.clone(),
            )?) as Box<dyn LocalTrainer>),
        }
    })
}

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
