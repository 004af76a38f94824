//! PrivORL, client side: the agent holds its units, each one transition of the sensitive
//! dataset (PrivORL-n) or one episode (PrivORL-j; loaded from the dataset cache, generated there
//! if missing), and either uploads them once (the central mode) or, for each offer, computes
//! every offered unit's clipped gradient (the federated mode; the same function the central
//! aggregator runs, [`super::PrivorlCentral`] or `TrajectoryCentral`: one trainer, generic over
//! the level's [`UnitCompute`]).

use std::collections::BTreeMap;
use std::path::Path;

use fedrl_common::offline::UpdateMode;
use fedrl_common::protocol::{RoundSpec, UnitId, UnitRange};
use fedrl_common::task::privorl::PrivorlTask;
use fedrl_rl::candle_core::Device;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::dpsgd::{encode_rows, without_non_finite_units};

use super::{PrivorlCentral, load_sensitive};
use crate::central::CentralGradients;
use crate::client::{CentralData, LocalTrainer, UnitUpload};

/// A level's per-unit computation, built from public numbers at the first offer
/// ([`super::PrivorlCentral`] for transitions, `TrajectoryCentral` for trajectories).
pub trait UnitCompute: CentralGradients + Sized {
    /// What fails to build, for the log ("the synthesizer's network").
    const WHAT: &'static str;
    fn build(task: &PrivorlTask, root: &Path, device: &Device) -> anyhow::Result<Self>;
}

impl UnitCompute for PrivorlCentral {
    const WHAT: &'static str = "the synthesizer's network";
    fn build(task: &PrivorlTask, root: &Path, device: &Device) -> anyhow::Result<Self> {
        PrivorlCentral::new(task, root, device)
    }
}

/// The PrivORL trainer of one client agent: its hosted units' data (one transition each at
/// transition level, one episode each at trajectory level) and, in the federated mode, the
/// level's per-unit computation `C`.
pub struct PrivorlTrainer<C = PrivorlCentral> {
    task: PrivorlTask,
    units: BTreeMap<UnitId, TransitionBatch>,
    /// The federated mode's computation, built at the first offer.
    compute: Option<C>,
    device: Device,
}

impl<C: UnitCompute> PrivorlTrainer<C> {
    /// A trainer hosting `units` (each unit's data).
    pub fn hosting(
        task: &PrivorlTask,
        units: BTreeMap<UnitId, TransitionBatch>,
        device: Device,
    ) -> Self {
        PrivorlTrainer {
            task: task.clone(),
            units,
            compute: None,
            device,
        }
    }
}

impl PrivorlTrainer<PrivorlCentral> {
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
        Ok(Self::hosting(task, units, device))
    }
}

impl<C: UnitCompute + 'static> LocalTrainer for PrivorlTrainer<C> {
    fn local_updates(
        &mut self,
        round: &RoundSpec,
        global: &[f32],
        units: &[UnitId],
    ) -> Vec<(UnitId, Vec<f32>)> {
        if self.compute.is_none() {
            let built = fedrl_rl::offline::data_root(None)
                .map_err(anyhow::Error::from)
                .and_then(|root| C::build(&self.task, &root, &self.device));
            match built {
                Ok(c) => self.compute = Some(c),
                Err(e) => {
                    tracing::error!(error = %e, "building {} failed", C::WHAT);
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

impl<C: UnitCompute + 'static> CentralData for PrivorlTrainer<C> {
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
