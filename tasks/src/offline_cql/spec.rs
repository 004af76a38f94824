//! Offline CQL's parameters ([`Task::OfflineCql`]), with its expert-level Selective variant.
//!
//! This is the kind's spec: plain serde data, checked without a model. It sits in the kind's
//! folder with the rest of the kind, but `common/src/task.rs` compiles it into `fedrl-common`
//! (as `fedrl_common::task::offline_cql`): `Task`, which the protocol, the scenario loader and the
//! engine read without candle, names it. So `crate` here is `fedrl_common`. Adding a kind:
//! docs/adding-a-task-kind.md.

use serde::{Deserialize, Serialize};

use crate::privacy::ledger::UnitKind;
use crate::task::{TaskError, TaskSpec};
// Named by the docs only.
#[cfg(doc)]
use crate::task::Task;

/// Parameters of [`Task::OfflineCql`]: the dataset the units hold, the CQL loss, where the
/// per-unit gradients are computed, and the held-out evaluation.
///
/// Round `r` is one DP-SGD step: every unit sampled by the aggregator contributes the gradient
/// of the CQL loss averaged over `transitions_per_unit` of its own transitions (drawn with a
/// generator seeded by `(data_seed, r, unit)`, the same in both modes), clipped to the scenario's
/// `clip_norm`; the aggregator sums, adds the noise, divides by the expected batch
/// `rate x users` and takes one Adam step. The scenario's `users` is the dataset's number of
/// units.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OfflineCqlTask {
    /// The dataset: a generation spec (generated, or loaded from the cache, by every client
    /// agent for its units), or a stored dataset named by its id with its episodes' mapping to
    /// privacy units ([`crate::offline::StoredDataset`]).
    #[serde(default)]
    pub dataset: crate::offline::DatasetSource,
    /// Q-network and loss. `batch_size` is unused here (the batch is the sample of units).
    #[serde(default)]
    pub cql: crate::offline::CqlConfig,
    /// `federated` (default) or `central` (DESIGN §2.5).
    #[serde(default)]
    pub mode: crate::offline::UpdateMode,
    /// Central mode only: `summed` (default; the sum of the clipped gradients, quantised once)
    /// or `per_unit` (each unit's clipped gradient quantised, as in the federated mode).
    #[serde(default)]
    pub central_path: crate::offline::CentralPath,
    /// Transitions each sampled unit draws from its own data per step. Default 1.
    #[serde(default = "d_one_u32")]
    pub transitions_per_unit: u32,
    /// Seed of the transitions drawn each step (not privacy noise). Default 0.
    #[serde(default)]
    pub data_seed: u64,
    /// Greedy evaluation every K released steps (and at the end). Default 500.
    #[serde(default = "d_cql_eval_every")]
    pub eval_every: u64,
    /// Episodes of a periodic evaluation. Default 10.
    #[serde(default = "d_cql_eval_episodes")]
    pub eval_episodes: usize,
    /// Episodes of the final evaluation. Default 100.
    #[serde(default = "d_cql_final_eval_episodes")]
    pub final_eval_episodes: usize,
    /// Seed of the evaluation episodes (held out: disjoint from the dataset's seeds). Default
    /// 1_000_000.
    #[serde(default = "d_cql_eval_seed")]
    pub eval_seed: u64,
    /// Step limit of an evaluation episode; 0 (default): the environment's own limit. Seed
    /// 000 evaluates CartPole at 1,000 steps and Acrobot at 200.
    #[serde(default)]
    pub eval_max_steps: u64,
    /// Expert-level Selective DP-SGD (seed 000/002): a DataRelease of stable prefixes, then a
    /// public schedule of DP and free steps. Absent: every round is one DP-SGD step.
    #[serde(default)]
    pub selective: Option<crate::selective::SelectiveConfig>,
}

impl TaskSpec for OfflineCqlTask {
    const KIND: &'static str = "offline_cql";
    const CONFIG_VERSION: u32 = 1;
    /// A unit owns its episodes: one episode makes it a trajectory, several (an expert's
    /// demonstrations) an expert.
    /// A stored dataset: one episode per unit is a trajectory; units grouping episodes by a
    /// stored id or a metadata key (an owner) are users.
    fn unit_kind(&self) -> UnitKind {
        use crate::offline::{DatasetSource, UnitMap};
        match &self.dataset {
            DatasetSource::Generated(d) if d.episodes_per_unit == 1 => UnitKind::Trajectory,
            DatasetSource::Generated(_) => UnitKind::Expert,
            DatasetSource::Stored(s) if s.units == UnitMap::Episode => UnitKind::Trajectory,
            DatasetSource::Stored(_) => UnitKind::User,
        }
    }
    /// The offer also carries the target network (a copy of an earlier released model, so
    /// public): online parameters, then target parameters.
    fn offer_copies(&self) -> usize {
        2
    }
    fn central_summed_rows(&self) -> Option<u64> {
        (self.mode == crate::offline::UpdateMode::Central
            && self.central_path == crate::offline::CentralPath::Summed)
            .then_some(u64::from(self.transitions_per_unit))
    }
    fn check(&self) -> Result<(), TaskError> {
        self.validate()
    }
}

impl OfflineCqlTask {
    fn validate(&self) -> Result<(), TaskError> {
        let bad = |m: String| Err(TaskError::Invalid(m));
        let d = match &self.dataset {
            crate::offline::DatasetSource::Generated(d) => d,
            crate::offline::DatasetSource::Stored(s) => {
                s.check()?;
                if s.units == crate::offline::UnitMap::Transition {
                    return bad(
                        "task.dataset.units = \"transition\" is PrivORL-n's unit; offline_cql clips one unit's episodes together: use \"episode\", \"stored\" or { metadata_key = ... }"
                            .into(),
                    );
                }
                &crate::offline::DatasetSpec::default()
            }
        };
        if d.units == 0 || d.episodes_per_unit == 0 {
            return bad(
                "task.dataset.units and task.dataset.episodes_per_unit must be >= 1".into(),
            );
        }
        d.check_gymnasium().map_err(TaskError::Invalid)?;
        if let crate::offline::Behaviour::PpoMixed {
            checkpoints,
            epsilon,
            ..
        } = &d.behaviour
            && (*checkpoints == 0 || !(0.0..=1.0).contains(epsilon))
        {
            return bad(format!(
                "task.dataset.behaviour: checkpoints must be >= 1 and epsilon in [0, 1], got {checkpoints} and {epsilon}"
            ));
        }
        let c = &self.cql;
        if c.hidden.is_empty() || c.hidden.contains(&0) {
            return bad("task.cql.hidden must be non-empty widths >= 1".into());
        }
        if !(0.0..=1.0).contains(&c.gamma) {
            return bad(format!("task.cql.gamma must be in [0, 1], got {}", c.gamma));
        }
        if !(c.alpha.is_finite() && c.alpha >= 0.0) {
            return bad(format!("task.cql.alpha must be >= 0, got {}", c.alpha));
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(c.learning_rate) || !positive(c.adam_eps) {
            return bad("task.cql.learning_rate and task.cql.adam_eps must be > 0".into());
        }
        if c.target_update_interval == 0 || c.batch_size == 0 {
            return bad(
                "task.cql.target_update_interval and task.cql.batch_size must be >= 1".into(),
            );
        }
        if self.transitions_per_unit == 0 {
            return bad("task.transitions_per_unit must be >= 1".into());
        }
        if self.eval_every == 0 || self.eval_episodes == 0 || self.final_eval_episodes == 0 {
            return bad(
                "task.eval_every, task.eval_episodes and task.final_eval_episodes must be >= 1"
                    .into(),
            );
        }
        if let Some(sel) = &self.selective {
            sel.validate().map_err(TaskError::Invalid)?;
        }
        Ok(())
    }
}

fn d_one_u32() -> u32 {
    1
}

fn d_cql_eval_every() -> u64 {
    500
}

fn d_cql_eval_episodes() -> usize {
    10
}

fn d_cql_final_eval_episodes() -> usize {
    100
}

fn d_cql_eval_seed() -> u64 {
    1_000_000
}
