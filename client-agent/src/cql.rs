//! Offline discrete CQL by DP-SGD, client side: the agent holds its units' transitions (loaded
//! from the dataset cache, generated there by the named procedure if missing) and, for each
//! offer, computes every offered unit's clipped gradient on its own data
//! ([`fedrl_rl::offline::dpsgd::unit_gradients`]). In the central mode it uploads the units'
//! data once instead, and the aggregator computes the same gradients.

use std::collections::BTreeMap;

use anyhow::Context;
use fedrl_common::offline::UpdateMode;
use fedrl_common::protocol::{RoundSpec, UnitId, UnitRange};
use fedrl_common::task::OfflineCqlTask;
use fedrl_rl::candle_core::Device;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::dpsgd::{encode_rows, unit_gradients};
use fedrl_rl::offline::qnet::QNetSpec;
use fedrl_rl::task::OfflineCqlTaskExt;

use crate::trainer::{LocalTrainer, UnitUpload};

/// The CQL trainer of one client agent: its units' data and the Q-network's shape.
pub struct CqlTrainer {
    task: OfflineCqlTask,
    spec: QNetSpec,
    /// Transitions of every hosted unit.
    units: BTreeMap<UnitId, TransitionBatch>,
    device: Device,
}

impl CqlTrainer {
    /// Loads (or generates) the task's dataset and keeps the transitions of the units in
    /// `hosted`; every hosted unit must exist in the dataset.
    pub fn new(
        task: &OfflineCqlTask,
        hosted: &[UnitRange],
        device: Device,
    ) -> anyhow::Result<Self> {
        let spec = task.qnet_spec()?;
        let root = fedrl_rl::offline::data_root(None)?;
        let (dataset, _) =
            fedrl_rl::offline::load_or_generate(&task.dataset, &root, &mut |_| {})
                .with_context(|| format!("loading the task's dataset under {}", root.display()))?;
        if dataset.obs_dim != spec.obs_dim || dataset.n_actions != spec.n_actions {
            anyhow::bail!(
                "dataset {} has observations of {} values and {} actions; the task's Q-network \
                 expects {} and {}",
                dataset.id,
                dataset.obs_dim,
                dataset.n_actions,
                spec.obs_dim,
                spec.n_actions
            );
        }
        let mut all = dataset.unit_transitions();
        let mut units = BTreeMap::new();
        for r in hosted {
            for u in r.start..r.end {
                let data = all.remove(&u).with_context(|| {
                    format!("unit {u} is hosted here but owns no data in {}", dataset.id)
                })?;
                units.insert(u, data);
            }
        }
        Ok(CqlTrainer {
            task: task.clone(),
            spec,
            units,
            device,
        })
    }
}

impl LocalTrainer for CqlTrainer {
    fn local_updates(
        &mut self,
        round: &RoundSpec,
        global: &[f32],
        units: &[UnitId],
    ) -> Vec<(UnitId, Vec<f32>)> {
        let chosen: Vec<(u64, &TransitionBatch)> = units
            .iter()
            .filter_map(|u| self.units.get(u).map(|d| (*u, d)))
            .collect();
        match unit_gradients(
            &self.spec,
            &self.task.cql,
            global,
            &chosen,
            round.round,
            self.task.data_seed,
            self.task.transitions_per_unit,
            round.clip_norm,
            &self.device,
        ) {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(round = round.round, error = %e, "CQL gradients failed");
                Vec::new()
            }
        }
    }

    fn unit_data(&self) -> Vec<UnitUpload> {
        if self.task.mode != UpdateMode::Central {
            return Vec::new();
        }
        self.units
            .iter()
            .map(|(u, d)| UnitUpload {
                unit: *u,
                obs_dim: d.obs_dim as u32,
                rows: d.len() as u32,
                payload: encode_rows(d),
            })
            .collect()
    }
}
