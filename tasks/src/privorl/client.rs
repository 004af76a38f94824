//! PrivORL-n, client side: the agent holds its units, each one transition of the sensitive
//! dataset (loaded from the dataset cache, generated there if missing), and either uploads them
//! once (the central mode) or, for each offer, computes every offered unit's clipped gradient of
//! its own EDM loss (the federated mode; the same function the central aggregator runs,
//! [`super::PrivorlCentral`]).

use std::collections::BTreeMap;

use fedrl_common::offline::UpdateMode;
use fedrl_common::protocol::{RoundSpec, UnitId, UnitRange};
use fedrl_common::task::privorl::PrivorlTask;
use fedrl_rl::candle_core::Device;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::dpsgd::{encode_rows, without_non_finite_units};

use super::{PrivorlCentral, load_sensitive};
use crate::central::CentralGradients;
use crate::client::{CentralData, LocalTrainer, UnitUpload};

/// The PrivORL-n trainer of one client agent.
pub struct PrivorlTrainer {
    task: PrivorlTask,
    /// One transition per hosted unit.
    units: BTreeMap<UnitId, TransitionBatch>,
    /// The federated mode's computation, built at the first offer.
    compute: Option<PrivorlCentral>,
    device: Device,
}

impl PrivorlTrainer {
    /// Loads (or generates) the sensitive dataset and keeps the hosted units' transitions;
    /// every hosted unit must exist.
    pub fn new(task: &PrivorlTask, hosted: &[UnitRange], device: Device) -> anyhow::Result<Self> {
        let root = fedrl_rl::offline::data_root(None)?;
        let (all, _) = load_sensitive(task, &root)?;
        let mut units = BTreeMap::new();
        for r in hosted {
            for u in r.start..r.end {
                if u >= all.len() as u64 {
                    anyhow::bail!(
                        "unit {u} is hosted here but the dataset has {} unit transitions",
                        all.len()
                    );
                }
                units.insert(u, all.select(&[u as usize]));
            }
        }
        tracing::info!(units = units.len(), "PrivORL transitions hosted");
        Ok(PrivorlTrainer {
            task: task.clone(),
            units,
            compute: None,
            device,
        })
    }
}

impl LocalTrainer for PrivorlTrainer {
    fn local_updates(
        &mut self,
        round: &RoundSpec,
        global: &[f32],
        units: &[UnitId],
    ) -> Vec<(UnitId, Vec<f32>)> {
        if self.compute.is_none() {
            let root = match fedrl_rl::offline::data_root(None) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(error = %e, "no dataset root");
                    return Vec::new();
                }
            };
            match PrivorlCentral::new(&self.task, &root, &self.device) {
                Ok(c) => self.compute = Some(c),
                Err(e) => {
                    tracing::error!(error = %e, "building the synthesizer's network failed");
                    return Vec::new();
                }
            }
        }
        let Some(compute) = &self.compute else {
            return Vec::new();
        };
        let chosen: Vec<(UnitId, &TransitionBatch)> = units
            .iter()
            .filter_map(|u| self.units.get(u).map(|d| (*u, d)))
            .collect();
        match without_non_finite_units(&chosen, |c| {
            compute.per_unit(global, c, round.round, round.clip_norm)
        }) {
            Ok((g, left_out)) => {
                for unit in left_out {
                    tracing::warn!(
                        round = round.round,
                        unit,
                        "unit left out: gradient not finite"
                    );
                }
                g
            }
            Err(e) => {
                tracing::error!(round = round.round, error = %e, "PrivORL gradients failed");
                Vec::new()
            }
        }
    }

    fn central_data(&self) -> Option<&dyn CentralData> {
        (self.task.mode == UpdateMode::Central).then_some(self as &dyn CentralData)
    }
}

impl CentralData for PrivorlTrainer {
    fn unit_data(&self) -> Vec<UnitUpload> {
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
