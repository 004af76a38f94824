//! PriMORL (seed 001) glue shared by the client agent and the aggregator: the ensemble a task
//! trains with its public input normalisation, the local-update settings, and the per-round
//! minibatch seeds. The ensemble itself is [`crate::ensemble`]; the data,
//! [`crate::offline::continuous`].

use fedrl_common::primorl::PrimorlTask;
use fedrl_common::task::TaskError;

use crate::ensemble::{EnsembleSpec, LocalModelConfig, ModelRows};
use crate::offline::continuous::{ContinuousDataset, ContinuousEpisode};
use crate::task::PrimorlTaskExt;
use crate::{NnError, Result};

/// The task's ensemble for `dataset`, its inputs normalised by the mean and standard deviation
/// of the public split's steps (public by the task's definition, so nothing private shapes the
/// model before the DP rounds).
pub fn ensemble_spec(task: &PrimorlTask, dataset: &ContinuousDataset) -> Result<EnsembleSpec> {
    let mut spec = task
        .ensemble_shape()
        .map_err(|e: TaskError| NnError::Invalid(e.to_string()))?;
    if dataset.meta.obs_dim != spec.obs_dim || dataset.meta.act_dim != spec.act_dim {
        return Err(NnError::Invalid(format!(
            "dataset of {} has observations of {} and actions of {}; the task's ensemble expects {} and {}",
            dataset.meta.env_id,
            dataset.meta.obs_dim,
            dataset.meta.act_dim,
            spec.obs_dim,
            spec.act_dim
        )));
    }
    let (public, _) = dataset.split(task.dataset.units);
    if public.is_empty() {
        return Err(NnError::Invalid(format!(
            "the dataset's public split is empty ({} episodes, {} private)",
            dataset.episodes.len(),
            task.dataset.units
        )));
    }
    let (mean, std) = dataset.input_stats(&public);
    spec.input_offset = mean;
    spec.input_scale = std;
    spec.check()?;
    Ok(spec)
}

/// The public split's rows, concatenated (the early-stopping set).
pub fn public_rows(
    task: &PrimorlTask,
    dataset: &ContinuousDataset,
    spec: &EnsembleSpec,
) -> Result<ModelRows> {
    let (public, _) = dataset.split(task.dataset.units);
    let mut rows = ModelRows::default();
    for e in public {
        let r = e.model_rows(spec)?;
        rows.inputs.extend_from_slice(&r.inputs);
        rows.targets.extend_from_slice(&r.targets);
    }
    Ok(rows)
}

/// Whether unit `unit` is a private trajectory of `task` (public units never train).
pub fn is_private_unit(task: &PrimorlTask, unit: u64) -> bool {
    !task.dataset.is_public(unit)
}

/// The local update of a trajectory under the scenario's clip norm C.
pub fn local_config(task: &PrimorlTask, clip_norm: f64) -> LocalModelConfig {
    let e = &task.ensemble;
    LocalModelConfig {
        epochs: e.epochs,
        batch_size: e.batch_size,
        lr: e.lr,
        weight_decay: e.weight_decay,
        clip_norm,
        clipping: e.clipping,
    }
}

/// The minibatch-order seed of `unit` in `round` (not privacy noise: any fixed rule will do).
pub fn trajectory_seed(data_seed: u64, round: u64, unit: u64) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64 ^ data_seed;
    for w in [round, unit] {
        h ^= w.wrapping_add(0x9e37_79b9_7f4a_7c15);
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 31;
    }
    h
}

/// The training rows of every private episode among `episodes`, by unit.
pub fn private_rows<'a>(
    task: &PrimorlTask,
    spec: &EnsembleSpec,
    episodes: impl IntoIterator<Item = &'a ContinuousEpisode>,
) -> Result<std::collections::BTreeMap<u64, ModelRows>> {
    let mut out = std::collections::BTreeMap::new();
    for e in episodes {
        if is_private_unit(task, e.unit) {
            out.insert(e.unit, e.model_rows(spec)?);
        }
    }
    Ok(out)
}
