//! The one registry of task kinds: it maps a scenario's [`Task`] (plain serde data in
//! `fedrl_common::task`) to its kind's folder in this crate, for the model's dimension (which
//! needs the model built for the environment's spaces), the client agent's trainer
//! ([`default_factory`]) and the aggregator's server model ([`server_model`]).
//!
//! The kinds are listed once, in `fedrl_common::task` (docs/adding-a-task-kind.md). [`Models`] is
//! the [`TaskModels`] that knows every kind, and [`scenario_from_toml_str`] /
//! [`scenario_from_file`] load a scenario with it: the CLI loads scenarios through them, so a
//! task whose model cannot be built fails at load time.

use std::path::Path;
use std::sync::Arc;

use fedrl_common::protocol::{UnitRange, Welcome};
use fedrl_common::scenario::{Scenario, ScenarioError};
use fedrl_common::task::{Task, TaskError, TaskModels};
use fedrl_rl::candle_core::Device;

use crate::central::CentralGradients;
use crate::client::{LocalTrainer, TrainerFactory};
use crate::server::ServerModel;

/// What the registry needs from a task kind; implemented once, in the kind's folder.
pub trait TaskKind {
    /// The kind's parameters (its variant's payload in [`Task`]).
    type Spec;
    /// Length of the model and of every update (number of f32). Building the model is also the
    /// validation of the fields it reads (environment, hidden sizes, preprocessing).
    fn dim(spec: &Self::Spec) -> Result<usize, TaskError>;
    /// A client agent's trainer for the units it hosts (`units`), computing on `device`.
    fn trainer(
        spec: &Self::Spec,
        units: &[UnitRange],
        device: &Device,
    ) -> anyhow::Result<Box<dyn LocalTrainer>>;
    /// The aggregator's model for `scenario` (whose task is `spec`), freshly initialised.
    fn server_model(spec: &Self::Spec, scenario: &Scenario)
    -> anyhow::Result<Box<dyn ServerModel>>;
    /// Observation values per step and number of discrete actions of the transitions a
    /// DataRelease walks (what the aggregator's engine checks candidate steps against), for a
    /// kind that can run one; `None` (the default) otherwise.
    fn transition_shape(spec: &Self::Spec) -> Result<Option<(usize, u32)>, TaskError> {
        let _ = spec;
        Ok(None)
    }
    /// The central update mode's computation when this scenario's task runs in it; `None`
    /// (the default): the kind has no central mode, or the scenario does not use it.
    fn central(
        spec: &Self::Spec,
        scenario: &Scenario,
    ) -> anyhow::Result<Option<Box<dyn CentralGradients>>> {
        let _ = (spec, scenario);
        Ok(None)
    }
}

/// Defines `with_kind!`, the table of task kinds, from the one list of kinds in
/// `fedrl_common::task` (`task_kinds!`, exported as `for_each_task_kind!`):
/// `with_kind!(task, spec, K => body)` evaluates `body` with `spec` bound to the task's
/// parameters and `K` to its [`TaskKind`], `crate::<module>::<Variant>`. Nothing here names a
/// kind: a kind's folder declares its `TaskKind` type under its variant's name.
macro_rules! define_with_kind {
    ($($variant:ident $module:ident,)*) => {
        macro_rules! with_kind {
            ($task:expr, $spec:ident, $K:ident => $body:expr) => {
                match $task {
                    $(Task::$variant($spec) => {
                        type $K = crate::$module::$variant;
                        $body
                    })*
                }
            };
        }
    };
}
fedrl_common::for_each_task_kind!(define_with_kind);

/// [`TaskModels`] for every task: builds the model to know its dimension.
#[derive(Clone, Copy, Debug, Default)]
pub struct Models;

impl TaskModels for Models {
    fn dim(&self, task: &Task) -> Result<usize, TaskError> {
        with_kind!(task, t, K => K::dim(t))
    }
}

/// The factory for every registered kind, computing on `device` (`fedrl client --device`).
pub fn default_factory(device: Device) -> TrainerFactory {
    Arc::new(move |welcome: &Welcome, units: &[UnitRange]| {
        let task = Task::from_wire(&welcome.task)?;
        with_kind!(&task, t, K => K::trainer(t, units, &device))
    })
}

/// The server model for `scenario`'s task, freshly initialised; its tensors live on the
/// scenario's `device`.
pub fn server_model(scenario: &Scenario) -> anyhow::Result<Box<dyn ServerModel>> {
    with_kind!(&scenario.task, t, K => K::server_model(t, scenario))
}

/// The central update mode's computation for `scenario`'s task, when it runs in that mode.
pub fn central_gradients(scenario: &Scenario) -> anyhow::Result<Option<Box<dyn CentralGradients>>> {
    with_kind!(&scenario.task, t, K => K::central(t, scenario))
}

/// The length of `task`'s model and of every update (number of f32).
pub trait TaskExt {
    /// See [`TaskModels::dim`].
    fn dim(&self) -> Result<usize, TaskError>;
    /// Length of the model vector every round offer carries: [`dim`](Self::dim), except for
    /// offline CQL, whose offer also carries the target network (a copy of an earlier released
    /// model, so public): online parameters, then target parameters.
    fn offer_dim(&self) -> Result<usize, TaskError>;
    /// See [`TaskKind::transition_shape`].
    fn transition_shape(&self) -> Result<Option<(usize, u32)>, TaskError>;
}

impl TaskExt for Task {
    fn dim(&self) -> Result<usize, TaskError> {
        Models.dim(self)
    }

    fn offer_dim(&self) -> Result<usize, TaskError> {
        Ok(Models.dim(self)? * self.offer_copies())
    }

    fn transition_shape(&self) -> Result<Option<(usize, u32)>, TaskError> {
        with_kind!(self, t, K => K::transition_shape(t))
    }
}

pub(crate) fn model_error(
    field: &'static str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> TaskError {
    TaskError::Model {
        field,
        source: Box::new(e),
    }
}

/// Parses and validates scenario TOML, building the task's model ([`Models`]). An
/// expert-level scenario naming a stored experts dataset runs as that dataset's generation
/// spec ([`crate::stored::expand_expert_release`]).
pub fn scenario_from_toml_str(text: &str) -> Result<Scenario, ScenarioError> {
    match crate::stored::expand_expert_release(text)? {
        Some(expanded) => Scenario::from_toml_str_with(&expanded, &Models),
        None => Scenario::from_toml_str_with(text, &Models),
    }
}

/// Reads, parses and validates a scenario file, building the task's model ([`Models`]), as
/// [`scenario_from_toml_str`] does.
pub fn scenario_from_file(path: impl AsRef<Path>) -> Result<Scenario, ScenarioError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
        path: path.display().to_string(),
        source,
    })?;
    match crate::stored::expand_expert_release(&text)? {
        Some(expanded) => Scenario::from_toml_str_with(&expanded, &Models),
        None => Scenario::from_file_with(path, &Models),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dppg::DppgTaskExt;

    /// The registry builds both sides of a kind from the scenario (the client's from the
    /// welcome's task), the optional capabilities are absent unless a kind opts in, and a kind
    /// or configuration version this build does not know is refused by name.
    #[test]
    fn the_registry_builds_both_sides_and_capabilities_are_opt_in() {
        let s = scenario_from_toml_str("[task]\nkind = \"mean_estimation\"\ndim = 5\n").unwrap();
        let mut model = server_model(&s).unwrap();
        assert_eq!(model.params().len(), 5);
        assert!(model.stable_data().is_none());
        let welcome = |task| Welcome {
            session: 1,
            task,
            churn_json: "{}".into(),
            dim: 5,
            clip_norm: 1.0,
            max_frame_bytes: 1 << 20,
            seed: None,
        };
        let factory = default_factory(Device::Cpu);
        let units = [UnitRange { start: 0, end: 4 }];
        let mut trainer = factory(&welcome(s.task.to_wire().unwrap()), &units).unwrap();
        assert!(trainer.central_data().is_none());
        assert!(trainer.expert_host().is_none());
        let mut unknown = s.task.to_wire().unwrap();
        unknown.kind = "no_such_kind".into();
        let err = factory(&welcome(unknown), &units)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("no_such_kind"), "{err}");
        let mut newer = s.task.to_wire().unwrap();
        newer.config_version += 1;
        let err = factory(&welcome(newer), &units).err().unwrap().to_string();
        assert!(err.contains("version"), "{err}");
        // Offline CQL opts in to training on D_stable.
        let Task::OfflineCql(cql) = Task::from_json("{\"kind\":\"offline_cql\"}").unwrap() else {
            unreachable!()
        };
        let mut cql = crate::offline_cql::CqlModel::new(&cql).unwrap();
        assert!(ServerModel::stable_data(&mut cql).is_some());
    }

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
