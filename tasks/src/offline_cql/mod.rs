//! Discrete CQL trained by per-unit DP-SGD on an offline dataset held by its units (DESIGN
//! §2.3-2.5), with its expert-level Selective variant (seeds 000/002): the units' gradients and,
//! for expert-level runs, the experts' DataRelease answers ([`client`]); the Q-network, its
//! target network and the selective schedule ([`server`]). The shape: [`OfflineCqlTaskExt`].
//! The central update mode and the DataRelease walk themselves are the aggregator's service
//! (`aggregator/src/service/{central,release}.rs`).

/// The kind's parameters: `spec.rs` in this folder, compiled into `fedrl-common` as
/// `fedrl_common::task::offline_cql` (its doc says why).
pub use fedrl_common::task::offline_cql as spec;

pub mod client;
pub mod server;

pub use client::CqlTrainer;
pub use server::{CqlModel, QNET_FILE};

use fedrl_common::offline::DatasetSource;
use fedrl_common::protocol::{UnitId, UnitRange};
use fedrl_common::scenario::Scenario;
use fedrl_common::task::{OfflineCqlTask, TaskError};
use fedrl_rl::candle_core::Device;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::per_example::SummedGradient;
use fedrl_rl::offline::qnet::QNetSpec;
use fedrl_sim::population::Population;

use crate::central::CentralGradients;
use crate::client::LocalTrainer;
use crate::registry::{TaskKind, model_error};
use crate::server::ServerModel;

/// The offline CQL kind in the registry.
pub struct OfflineCql;

impl TaskKind for OfflineCql {
    type Spec = OfflineCqlTask;

    fn dim(spec: &OfflineCqlTask) -> Result<usize, TaskError> {
        Ok(spec.qnet_spec()?.dim())
    }

    fn trainer(
        spec: &OfflineCqlTask,
        units: &[UnitRange],
        device: &Device,
    ) -> anyhow::Result<Box<dyn LocalTrainer>> {
        Ok(Box::new(CqlTrainer::new(spec, units, device.clone())?))
    }

    // The server model only applies released gradients (flat vectors) and evaluates on the
    // CPU; the central mode's gradients run on the scenario's device (service::central).
    fn server_model(
        spec: &OfflineCqlTask,
        scenario: &Scenario,
    ) -> anyhow::Result<Box<dyn ServerModel>> {
        // A stored dataset on this machine: `users` must be its unit count, as `fedrl run`
        // checks before starting anything, so a standalone aggregator cannot sample from a
        // different population than the data holds (an agent hosting a unit without data
        // refuses to start on its side; a federated aggregator need not hold the data).
        if let Some(s) = spec.dataset.stored()
            && crate::stored::resolve_if_present(s)?.is_some()
        {
            crate::stored::check_units(s, scenario.users)?;
        }
        Ok(Box::new(CqlModel::new(spec)?))
    }

    fn transition_shape(spec: &OfflineCqlTask) -> Result<Option<(usize, u32)>, TaskError> {
        let q = spec.qnet_spec()?;
        Ok(Some((q.obs_dim, q.n_actions as u32)))
    }

    fn central(
        spec: &OfflineCqlTask,
        scenario: &Scenario,
    ) -> anyhow::Result<Option<Box<dyn CentralGradients>>> {
        if spec.mode != fedrl_common::offline::UpdateMode::Central {
            return Ok(None);
        }
        Ok(Some(Box::new(CqlCentral {
            qnet: spec.qnet_spec()?,
            max_unit_rows: spec.max_unit_rows()?,
            task: spec.clone(),
            device: fedrl_rl::device::open(scenario.device)?,
        })))
    }
}

/// Offline CQL's central computation: the same per-unit gradients a federated agent computes
/// ([`fedrl_rl::offline::dpsgd`]), on the uploaded data.
struct CqlCentral {
    task: OfflineCqlTask,
    qnet: QNetSpec,
    max_unit_rows: u64,
    device: Device,
}

impl CentralGradients for CqlCentral {
    fn row_spec(&self) -> &QNetSpec {
        &self.qnet
    }

    fn max_unit_rows(&self) -> u64 {
        self.max_unit_rows
    }

    fn summed(
        &self,
        offer: &[f32],
        units: &[(UnitId, &TransitionBatch)],
        round: u64,
        clip_norm: f64,
    ) -> fedrl_rl::Result<SummedGradient> {
        fedrl_rl::offline::dpsgd::summed_unit_gradients(
            &self.qnet,
            &self.task.cql,
            offer,
            units,
            round,
            self.task.data_seed,
            self.task.transitions_per_unit,
            clip_norm,
            &self.device,
        )
    }

    fn per_unit(
        &self,
        offer: &[f32],
        units: &[(UnitId, &TransitionBatch)],
        round: u64,
        clip_norm: f64,
    ) -> fedrl_rl::Result<Vec<(UnitId, Vec<f32>)>> {
        fedrl_rl::offline::dpsgd::unit_gradients(
            &self.qnet,
            &self.task.cql,
            offer,
            units,
            round,
            self.task.data_seed,
            self.task.transitions_per_unit,
            clip_norm,
            &self.device,
        )
    }
}

/// The Q-network an [`OfflineCqlTask`] trains.
pub trait OfflineCqlTaskExt {
    /// `obs_dim -> cql.hidden -> n_actions` for the dataset's environment, which must have a
    /// box observation and discrete actions.
    fn qnet_spec(&self) -> Result<QNetSpec, TaskError>;
    /// The most transitions one unit's data can hold: `episodes_per_unit` episodes of at most
    /// the environment's step limit each (an expert's `max_steps` when it is smaller), or
    /// [`FALLBACK_EPISODE_STEPS`] per episode for an environment whose limit is not registered.
    /// A public bound from the dataset's shape: the central mode refuses larger uploads.
    fn max_unit_rows(&self) -> Result<u64, TaskError>;
}

/// Steps per episode assumed by [`OfflineCqlTaskExt::max_unit_rows`] for an environment whose
/// step limit is not in the simulator registry.
pub const FALLBACK_EPISODE_STEPS: u64 = 100_000;

impl OfflineCqlTaskExt for OfflineCqlTask {
    fn qnet_spec(&self) -> Result<QNetSpec, TaskError> {
        // A Gymnasium dataset's spaces are its declaration: the aggregator runs no Python; the
        // generator checks the workers against it.
        if let DatasetSource::Generated(d) = &self.dataset
            && let Some(g) = gymnasium_table(d)?
        {
            return Ok(QNetSpec {
                obs_dim: g.obs_dim,
                hidden: self.cql.hidden.clone(),
                n_actions: g.actions,
            });
        }
        let resolved = match &self.dataset {
            DatasetSource::Stored(s) => crate::stored::resolve_if_present(s)?,
            DatasetSource::Generated(_) => None,
        };
        let (env_id, population_seed) = match &resolved {
            Some(r) => (r.env.clone(), 0),
            None => crate::stored::source_env(&self.dataset)?,
        };
        let env = Population::new(&env_id, population_seed)
            .and_then(|p| p.user_env(0))
            .map_err(|e| model_error("task.dataset.env", e))?;
        let obs_dim = match env.observation_space() {
            fedrl_sim::Space::Box { low, .. } => low.len(),
            other => {
                return Err(TaskError::Invalid(format!(
                    "task.dataset.env: offline CQL needs a box observation space, `{env_id}` has {other:?}"
                )));
            }
        };
        let n_actions = match env.action_space() {
            fedrl_sim::Space::Discrete { n } => *n,
            other => {
                return Err(TaskError::Invalid(format!(
                    "task.dataset.env: discrete CQL needs discrete actions, `{env_id}` has {other:?}"
                )));
            }
        };
        if let (Some(r), DatasetSource::Stored(s)) = (&resolved, &self.dataset) {
            crate::stored::check_discrete(r, &s.name, "offline_cql", obs_dim, n_actions)?;
        }
        Ok(QNetSpec {
            obs_dim,
            hidden: self.cql.hidden.clone(),
            n_actions,
        })
    }

    fn max_unit_rows(&self) -> Result<u64, TaskError> {
        let d = match &self.dataset {
            DatasetSource::Generated(d) => d,
            // A unit of a stored dataset holds at most the whole dataset: its recorded step
            // count bounds every upload (the header's, checked against the episodes on read).
            // The central mode's aggregator receives the data anyway, so it must hold the
            // dataset to know the bound (an absent one is refused, naming it).
            DatasetSource::Stored(s) => return Ok(crate::stored::resolve(s)?.header.total_steps),
        };
        if gymnasium_table(d)?.is_some() {
            // A Gymnasium environment's step limit is not in the registry.
            let mut steps = FALLBACK_EPISODE_STEPS;
            if let fedrl_common::offline::Behaviour::Experts { max_steps, .. } = &d.behaviour
                && *max_steps > 0
            {
                steps = steps.min(*max_steps);
            }
            return Ok(d.episodes_per_unit.saturating_mul(steps));
        }
        let env = Population::new(&d.env, d.population_seed)
            .and_then(|p| p.user_env(0))
            .map_err(|e| model_error("task.dataset.env", e))?;
        let id = env.id();
        let mut steps = fedrl_sim::list()
            .into_iter()
            .find(|e| e.id == id)
            .map_or(FALLBACK_EPISODE_STEPS, |e| u64::from(e.max_episode_steps));
        if let fedrl_common::offline::Behaviour::Experts { max_steps, .. } = &d.behaviour
            && *max_steps > 0
        {
            steps = steps.min(*max_steps);
        }
        Ok(d.episodes_per_unit.saturating_mul(steps))
    }
}

/// The `[task.dataset.gymnasium]` table of a generation spec whose `env` is `gymnasium:<id>`
/// (`None` for fedrl's own environments); an inconsistent spec is an error.
pub fn gymnasium_table(
    d: &fedrl_common::offline::DatasetSpec,
) -> Result<Option<&fedrl_common::offline::DatasetGymnasium>, TaskError> {
    d.check_gymnasium().map_err(TaskError::Invalid)?;
    Ok(d.gymnasium.as_deref())
}

/// Whether the task's greedy evaluations run in a Gymnasium environment: the aggregator runs no
/// Python (DESIGN §2.6), so its server model keeps the networks of its evaluation steps as
/// snapshots and leaves the evaluations to `fedrl run` (or `fedrl eval --deferred`), which
/// evaluates them and the exported Q-network through the bridge once the aggregator ended
/// ([`server`]'s module doc).
pub fn evaluates_in_gymnasium(task: &OfflineCqlTask) -> bool {
    matches!(&task.dataset, DatasetSource::Generated(d) if d.gymnasium.is_some())
}
