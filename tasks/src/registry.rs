//! What a scenario's task needs the model for: its dimension, the checks that build the model,
//! and loading a scenario with them.
//!
//! The task types are plain data in `fedrl_common::task`; the length of a DPPG or log-linear
//! parameter vector depends on the environment's spaces, which only this crate (with the
//! simulators) can build. [`Models`] is the [`TaskModels`] that knows every task, and
//! [`scenario_from_toml_str`] / [`scenario_from_file`] load a scenario with it: the CLI loads
//! scenarios through them, so a task whose model cannot be built fails at load time.

use std::path::Path;

use fedrl_common::primorl::PrimorlTask;
use fedrl_common::scenario::{Scenario, ScenarioError};
use fedrl_common::task::{DppgTask, LogLinearTask, OfflineCqlTask, Task, TaskError, TaskModels};
use fedrl_sim::population::{Population, PumpOverrides};

use crate::local_update::LocalUpdateExt;
use crate::loglinear::LogLinearSpec;
use crate::mlp::ModelSpec;
use crate::offline::qnet::QNetSpec;

/// [`TaskModels`] for every task: builds the model to know its dimension.
#[derive(Clone, Copy, Debug, Default)]
pub struct Models;

impl TaskModels for Models {
    fn dim(&self, task: &Task) -> Result<usize, TaskError> {
        match task {
            Task::MeanEstimation(t) => Ok(t.dim),
            Task::Dppg(t) => Ok(t.model_spec()?.layout().len()),
            Task::LogLinearPg(t) => Ok(t.spec()?.dim()),
            Task::OfflineCql(t) => Ok(t.qnet_spec()?.dim()),
            Task::Primorl(t) => Ok(t.ensemble_shape()?.len()),
        }
    }
}

/// The length of `task`'s model and of every update (number of f32).
pub trait TaskExt {
    /// See [`TaskModels::dim`].
    fn dim(&self) -> Result<usize, TaskError>;
    /// Length of the model vector every round offer carries: [`dim`](Self::dim), except for
    /// offline CQL, whose offer also carries the target network (a copy of an earlier released
    /// model, so public): online parameters, then target parameters.
    fn offer_dim(&self) -> Result<usize, TaskError>;
}

impl TaskExt for Task {
    fn dim(&self) -> Result<usize, TaskError> {
        Models.dim(self)
    }

    fn offer_dim(&self) -> Result<usize, TaskError> {
        Ok(Models.dim(self)? * self.offer_copies())
    }
}

/// The Q-network an [`OfflineCqlTask`] trains.
pub trait OfflineCqlTaskExt {
    /// `obs_dim -> cql.hidden -> n_actions` for the dataset's environment, which must have a
    /// box observation and discrete actions.
    fn qnet_spec(&self) -> Result<QNetSpec, TaskError>;
}

impl OfflineCqlTaskExt for OfflineCqlTask {
    fn qnet_spec(&self) -> Result<QNetSpec, TaskError> {
        let env = Population::new(&self.dataset.env, self.dataset.population_seed)
            .and_then(|p| p.user_env(0))
            .map_err(|e| model_error("task.dataset.env", e))?;
        let obs_dim = match env.observation_space() {
            fedrl_sim::Space::Box { low, .. } => low.len(),
            other => {
                return Err(TaskError::Invalid(format!(
                    "task.dataset.env: offline CQL needs a box observation space, `{}` has {other:?}",
                    self.dataset.env
                )));
            }
        };
        let n_actions = match env.action_space() {
            fedrl_sim::Space::Discrete { n } => *n,
            other => {
                return Err(TaskError::Invalid(format!(
                    "task.dataset.env: discrete CQL needs discrete actions, `{}` has {other:?}",
                    self.dataset.env
                )));
            }
        };
        Ok(QNetSpec {
            obs_dim,
            hidden: self.cql.hidden.clone(),
            n_actions,
        })
    }
}

/// The dynamics ensemble a [`PrimorlTask`] trains.
pub trait PrimorlTaskExt {
    /// The ensemble for the dataset's environment (box observations and actions), with identity
    /// input normalisation: the shape only. The normalisation comes from the public split once
    /// the dataset is loaded.
    fn ensemble_shape(&self) -> Result<crate::ensemble::EnsembleSpec, TaskError>;
}

impl PrimorlTaskExt for PrimorlTask {
    fn ensemble_shape(&self) -> Result<crate::ensemble::EnsembleSpec, TaskError> {
        let env =
            fedrl_sim::make(&self.dataset.env).map_err(|e| model_error("task.dataset.env", e))?;
        let (obs_dim, act_dim) = match (env.observation_space(), env.action_space()) {
            (fedrl_sim::Space::Box { low: o, .. }, fedrl_sim::Space::Box { low: a, .. }) => {
                (o.len(), a.len())
            }
            (o, a) => {
                return Err(TaskError::Invalid(format!(
                    "task.dataset.env: PriMORL needs box observations and actions, `{}` has {o:?} and {a:?}",
                    self.dataset.env
                )));
            }
        };
        let spec = crate::ensemble::EnsembleSpec::new(
            obs_dim,
            act_dim,
            self.ensemble.hidden.clone(),
            self.ensemble.members,
        );
        spec.check().map_err(|e| model_error("task.ensemble", e))?;
        Ok(spec)
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
        let env = self
            .population()?
            .user_env(0)
            .map_err(|e| model_error("task.population", e))?;
        self.local
            .model_spec(env.observation_space(), env.action_space())
            .map_err(|e| model_error("task.local", e))
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

fn model_error(
    field: &'static str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> TaskError {
    TaskError::Model {
        field,
        source: Box::new(e),
    }
}

/// Parses and validates scenario TOML, building the task's model ([`Models`]).
pub fn scenario_from_toml_str(text: &str) -> Result<Scenario, ScenarioError> {
    Scenario::from_toml_str_with(text, &Models)
}

/// Reads, parses and validates a scenario file, building the task's model ([`Models`]).
pub fn scenario_from_file(path: impl AsRef<Path>) -> Result<Scenario, ScenarioError> {
    Scenario::from_file_with(path, &Models)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dimension comes from the model built for the environment: CartPole's default
    /// 4-64-64-2 policy and 4-64-64-1 value network; no silent 0.
    #[test]
    fn dppg_dimension_is_the_models() {
        let s =
            scenario_from_toml_str("[task]\nkind = \"dppg\"\nlocal = { hidden = [8] }\n").unwrap();
        // policy 4*8+8 + 8*2+2, value 4*8+8 + 8*1+1
        assert_eq!(s.task.dim().unwrap(), 40 + 18 + 40 + 9);
        let err = scenario_from_toml_str("[task]\nkind = \"dppg\"\npopulation = \"Nope-v0\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("task.population") && err.contains("Nope-v0"),
            "{err}"
        );
        let Task::Dppg(t) = Task::from_json(r#"{"kind":"dppg","population":"Nope-v0"}"#).unwrap()
        else {
            unreachable!()
        };
        assert!(matches!(
            t.model_spec(),
            Err(TaskError::Model {
                field: "task.population",
                ..
            })
        ));
    }

    #[test]
    fn loglinear_task_derives_its_clip_norm() {
        use fedrl_common::privacy::trust_region::{TrustRegion, TrustRegionBound};
        let text = "cohort_size = 8\nusers = 100\nnoise_multiplier = 3.74\n\
                    [task]\nkind = \"loglinear_pg\"\n";
        let s = scenario_from_toml_str(text).unwrap();
        let Task::LogLinearPg(t) = &s.task else {
            panic!("{:?}", s.task)
        };
        assert_eq!(s.task.dim().unwrap(), 18);
        let want = TrustRegion {
            size: 3.5,
            confidence: 0.6,
            bound: TrustRegionBound::Quantile,
        }
        .clip_norm(18, 8.0, 3.74, 1.0)
        .unwrap();
        assert_eq!(s.clip_norm, want);
        assert_eq!(s.derived_clip_norm(18).unwrap(), Some(want));
        assert_eq!(s.effective_clip_norm(), want);
        // The resolved scenario round-trips (the derived value is accepted back).
        let again = scenario_from_toml_str(&s.to_toml_string().unwrap()).unwrap();
        assert_eq!(again, s);
        // The learning-rate schedule of seed 004 C.3, counted in rounds.
        assert_eq!(t.lr_at(1), 12.0);
        assert_eq!(t.lr_at(50), 12.0);
        assert!((t.lr_at(51) - 2.4).abs() < 1e-12);
        assert!((t.lr_at(101) - 0.48).abs() < 1e-12);
        assert_eq!(t.lr_at(10_000), 0.06);
        // An explicit, different clip norm is refused with a message naming the field.
        let err = scenario_from_toml_str(&format!("clip_norm = 0.5\n{text}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("clip_norm"), "{err}");
        // The twin is unclipped and noiseless.
        let twin = scenario_from_toml_str(&format!("non_private = true\n{text}")).unwrap();
        assert_eq!(twin.effective_clip_norm(), f64::INFINITY);
        // Markov is more conservative; a bad region is named.
        let mk = scenario_from_toml_str(&format!(
            "{text}[task.trust_region]\nsize = 3.5\nconfidence = 0.6\nbound = \"markov\"\n"
        ))
        .unwrap();
        assert!(mk.clip_norm < s.clip_norm);
        let err = scenario_from_toml_str(&format!(
            "{text}[task.trust_region]\nsize = 3.5\nconfidence = 1.5\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("trust_region"), "{err}");
        let err = scenario_from_toml_str(&format!("{text}population = \"Pendulum-v1\"\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("population"), "{err}");
    }

    /// Finding 7 holds for the RL tasks too: they clip one user's episodes per contribution.
    #[test]
    fn rl_tasks_refuse_another_unit_kind() {
        for kind in ["dppg", "loglinear_pg"] {
            let err = scenario_from_toml_str(&format!(
                "unit_kind = \"trajectory\"\n[task]\nkind = \"{kind}\"\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains("unit_kind") && err.contains(kind), "{err}");
        }
    }
}
