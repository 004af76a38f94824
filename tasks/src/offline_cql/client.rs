//! Offline discrete CQL by DP-SGD, client side: the agent holds its units' transitions (loaded
//! from the dataset cache, generated there by the named procedure if missing) and, for each
//! offer, computes every offered unit's clipped gradient on its own data
//! ([`fedrl_rl::offline::dpsgd::unit_gradients`]). In the central mode it uploads the units'
//! data once instead, and the aggregator computes the same gradients.
//!
//! Expert-level runs (seed 002): the agent also hosts its experts' policies. During the
//! DataRelease it sends a demonstration the coordinator asks for, and answers each candidate
//! trajectory with the summed prefix probabilities of its experts; the policies themselves never
//! leave the agent. Released prefixes are then dropped from the units' data (D_unst).

use std::collections::BTreeMap;

use anyhow::Context;
use fedrl_common::offline::UpdateMode;
use fedrl_common::privacy::expert_answers::check_expert_prefix_probabilities;
use fedrl_common::protocol::{ReleasedPrefix, RoundSpec, UnitId, UnitRange};
use fedrl_common::task::OfflineCqlTask;
use fedrl_rl::candle_core::Device;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::dpsgd::{encode_rows, unit_gradients, without_non_finite_units};
use fedrl_rl::offline::qnet::QNetSpec;

use super::OfflineCqlTaskExt;
use crate::client::{CentralData, ExpertHost, LocalTrainer, UnitUpload};

/// The CQL trainer of one client agent: its units' data and the Q-network's shape.
pub struct CqlTrainer {
    task: OfflineCqlTask,
    spec: QNetSpec,
    /// Transitions of every hosted unit (its episodes in order).
    units: BTreeMap<UnitId, TransitionBatch>,
    /// (first row, length) of every hosted unit's episodes, in order.
    episodes: BTreeMap<UnitId, Vec<(u32, u32)>>,
    /// The hosted experts' policies, for expert-level runs with a DataRelease.
    experts: Option<fedrl_rl::offline::experts::ExpertSet>,
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
        let t0 = std::time::Instant::now();
        // Only the hosted units' episodes are read (an agent hosts a share of the units).
        let is_hosted = |u: UnitId| hosted.iter().any(|r| r.contains(u));
        // A stored dataset: its SHA-256 sums are checked and its episodes mapped to units as
        // the scenario states, the same way on every agent.
        let (dataset, _) =
            fedrl_rl::offline::load_source_units(&task.dataset, &root, &mut |_| {}, &is_hosted)
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
        let mut bounds: BTreeMap<UnitId, Vec<(u32, u32)>> = BTreeMap::new();
        for e in &dataset.episodes {
            let b = bounds.entry(e.unit).or_default();
            let first = b.last().map_or(0, |(f, n)| f + n);
            b.push((first, e.len() as u32));
        }
        let mut units = BTreeMap::new();
        let mut episodes = BTreeMap::new();
        for r in hosted {
            for u in r.start..r.end {
                let data = all.remove(&u).with_context(|| {
                    format!("unit {u} is hosted here but owns no data in {}", dataset.id)
                })?;
                units.insert(u, data);
                episodes.insert(u, bounds.remove(&u).unwrap_or_default());
            }
        }
        // The dataset is in the cache now (just loaded): its experts file sits beside it.
        let experts = match task.selective.as_ref().and_then(|s| s.release.as_ref()) {
            Some(_) => {
                let spec = task.dataset.generated().context(
                    "a DataRelease queries expert policies, which only a generated experts dataset has",
                )?;
                let dir = fedrl_rl::offline::minari::dataset_dir(&root, &spec.minari_id())?;
                Some(
                    fedrl_rl::offline::experts::ExpertSet::read_for(spec, &dir).with_context(
                        || format!("loading the expert policies of {}", dataset.id),
                    )?,
                )
            }
            None => None,
        };
        tracing::info!(
            dataset = %dataset.id,
            units = units.len(),
            seconds = t0.elapsed().as_secs_f64(),
            "the hosted units' data is loaded"
        );
        Ok(CqlTrainer {
            task: task.clone(),
            spec,
            units,
            episodes,
            experts,
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
        // A unit whose gradient is not finite sends no update (a dropout for the aggregator);
        // the other units' updates still go.
        match without_non_finite_units(&chosen, |c| {
            unit_gradients(
                &self.spec,
                &self.task.cql,
                global,
                c,
                round.round,
                self.task.data_seed,
                self.task.transitions_per_unit,
                round.clip_norm,
                &self.device,
            )
        }) {
            Ok((g, left_out)) => {
                for unit in left_out {
                    tracing::warn!(
                        round = round.round,
                        unit,
                        "unit left out of this step: its gradient is not finite"
                    );
                }
                g
            }
            Err(e) => {
                tracing::error!(round = round.round, error = %e, "CQL gradients failed");
                Vec::new()
            }
        }
    }

    fn central_data(&self) -> Option<&dyn CentralData> {
        (self.task.mode == UpdateMode::Central).then_some(self as &dyn CentralData)
    }

    fn expert_host(&mut self) -> Option<&mut dyn ExpertHost> {
        Some(self)
    }
}

impl ExpertHost for CqlTrainer {
    fn episode_rows(
        &self,
        unit: UnitId,
        episode: u32,
        from_step: u32,
        steps: u32,
    ) -> Result<(UnitUpload, u32, bool), String> {
        let (Some(data), Some(bounds)) = (self.units.get(&unit), self.episodes.get(&unit)) else {
            return Err(format!("unit {unit} is not hosted here"));
        };
        let Some(&(first, len)) = bounds.get(episode as usize) else {
            return Err(format!(
                "unit {unit} has {} episodes, not episode {episode}",
                bounds.len()
            ));
        };
        if from_step >= len || steps == 0 {
            return Err(format!(
                "steps {from_step}..{} of episode {episode} of unit {unit}, which has {len}",
                from_step as u64 + steps as u64
            ));
        }
        let end = len.min(from_step.saturating_add(steps));
        if (first + len) as usize > data.len() {
            return Err(format!(
                "episode {episode} of unit {unit} is no longer held whole (released already)"
            ));
        }
        // Only the steps asked for leave the agent.
        let rows: Vec<usize> = ((first + from_step) as usize..(first + end) as usize).collect();
        let part = data.select(&rows);
        Ok((
            UnitUpload {
                unit,
                obs_dim: part.obs_dim as u32,
                rows: part.len() as u32,
                payload: encode_rows(&part),
            },
            first,
            end == len,
        ))
    }

    fn prefix_counts(
        &self,
        running: &mut Vec<f64>,
        obs: &[f32],
        actions: &[u32],
    ) -> Result<Vec<f64>, String> {
        let Some(experts) = &self.experts else {
            return Err("this run has no DataRelease: no expert policy is loaded".into());
        };
        let hosted: Vec<u64> = self.units.keys().copied().collect();
        if running.is_empty() {
            running.resize(hosted.len(), 1.0);
        }
        if running.len() != hosted.len() {
            return Err(format!(
                "{} running probabilities for {} hosted experts",
                running.len(),
                hosted.len()
            ));
        }
        // The chunk's own probabilities (from 1 at its first step), then scaled by the prefix
        // before it: a product of per-step probabilities, as for the whole prefix at once.
        let per_expert = experts
            .prefix_probabilities(&hosted, obs, actions)
            .map_err(|e| e.to_string())?;
        // Each expert's answer is a probability (the count's sensitivity is 1 per expert); one
        // that is not is a bug here, and nothing is sent.
        let mut counts = vec![0.0f64; actions.len()];
        for ((unit, p), before) in hosted.iter().zip(&per_expert).zip(running.iter_mut()) {
            let p: Vec<f64> = p.iter().map(|x| x * *before).collect();
            check_expert_prefix_probabilities(&p).map_err(|e| format!("expert {unit}: {e}"))?;
            for (c, x) in counts.iter_mut().zip(&p) {
                *c += x;
            }
            if let Some(last) = p.last() {
                *before = *last;
            }
        }
        Ok(counts)
    }

    fn stable_released(&mut self, prefixes: &[ReleasedPrefix]) {
        for (unit, ranges) in ReleasedPrefix::ranges_by_unit(prefixes) {
            if let Some(d) = self.units.get_mut(&unit) {
                *d = d.without_ranges(&ranges);
            }
        }
        tracing::info!(
            prefixes = prefixes.len(),
            "released prefixes dropped from the units' DP-SGD data"
        );
    }
}

impl CentralData for CqlTrainer {
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
