//! PriMORL (seed 001), client side: the agent holds its trajectories (generated into, or loaded
//! from, the dataset cache) and, for each offer, trains the global dynamics ensemble on every
//! offered trajectory alone (`EnsClipGD`: E epochs of minibatch SGD, the ensemble delta projected
//! onto the clip ball after every step), batched across the offered trajectories. Public-split
//! units hold no private data and never contribute.

use std::collections::BTreeMap;

use anyhow::Context;
use fedrl_common::protocol::{RoundSpec, UnitId, UnitRange};
use fedrl_common::task::primorl::PrimorlTask;
use fedrl_rl::candle_core::Device;
use fedrl_rl::ensemble::{EnsembleSpec, ModelRows, local_updates};
use fedrl_rl::primorl::{ensemble_spec, local_config, private_rows, trajectory_seed};

use crate::client::LocalTrainer;

/// Trajectories trained in one batched call (bounds the stacked tensors' memory).
const GROUP: usize = 64;

/// The PriMORL trainer of one client agent.
pub struct PrimorlTrainer {
    task: PrimorlTask,
    spec: EnsembleSpec,
    units: BTreeMap<UnitId, ModelRows>,
    device: Device,
}

impl PrimorlTrainer {
    /// Loads (or generates) the task's dataset and keeps the rows of the hosted private units.
    pub fn new(task: &PrimorlTask, hosted: &[UnitRange], device: Device) -> anyhow::Result<Self> {
        let root = fedrl_rl::offline::data_root(None)?;
        let held = |u: u64| hosted.iter().any(|r| r.start <= u && u < r.end);
        // Only the hosted trajectories and the public split (the model's input normalisation)
        // are read from the file.
        let (dataset, private_units) = fedrl_rl::offline::continuous::load_source_units(
            &task.dataset,
            &root,
            &mut |_| {},
            &held,
        )
        .with_context(|| format!("loading the task's dataset under {}", root.display()))?;
        // A standalone agent started with more users than the dataset has trajectories would
        // otherwise answer for units it does not hold.
        if let Some(r) = hosted.iter().find(|r| r.end > private_units) {
            anyhow::bail!(
                "this agent hosts units up to {}, but the dataset has fewer private trajectories ({private_units}; an exact count, operator-only): the scenario's users must equal them",
                r.end - 1
            );
        }
        let spec = ensemble_spec(task, &dataset, private_units)?;
        let units = private_rows(
            private_units,
            &spec,
            dataset.episodes.iter().filter(|e| held(e.unit)),
        )?;
        tracing::info!(trajectories = units.len(), "PriMORL trajectories hosted");
        Ok(PrimorlTrainer {
            task: task.clone(),
            spec,
            units,
            device,
        })
    }
}

impl LocalTrainer for PrimorlTrainer {
    fn local_updates(
        &mut self,
        round: &RoundSpec,
        global: &[f32],
        units: &[UnitId],
    ) -> Vec<(UnitId, Vec<f32>)> {
        let cfg = local_config(&self.task, round.clip_norm);
        let chosen: Vec<(UnitId, &ModelRows)> = units
            .iter()
            .filter_map(|u| self.units.get(u).map(|d| (*u, d)))
            .collect();
        let mut out = Vec::with_capacity(chosen.len());
        for group in chosen.chunks(GROUP) {
            let rows: Vec<&ModelRows> = group.iter().map(|(_, d)| *d).collect();
            let seeds: Vec<u64> = group
                .iter()
                .map(|(u, _)| trajectory_seed(self.task.data_seed, round.round, *u))
                .collect();
            match local_updates(&self.spec, &cfg, global, &rows, &seeds, &self.device, false) {
                Ok((updates, _)) => {
                    out.extend(group.iter().zip(updates).map(|((u, _), up)| (*u, up.delta)));
                }
                Err(e) => {
                    tracing::error!(round = round.round, error = %e, "ensemble local updates failed");
                }
            }
        }
        out
    }
}
