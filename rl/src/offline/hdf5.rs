//! Minari's HDF5 storage (minari 0.5.4, `minari/dataset/_storages/hdf5_storage.py`: the format
//! `minari.DataCollector` writes by default), read into the same [`ReadDataset`] the parquet and
//! arrow readers of [`super::minari`] produce. Compiled with the `hdf5` feature only: it links
//! the system HDF5 library through `hdf5-metno` (Debian: `libhdf5-dev`).
//!
//! A dataset folder `root/<id>/data/` holds `metadata.json` (the same dataset metadata as the
//! columnar backends, with `data_format: "hdf5"`) and `main_data.hdf5`, with one group
//! `episode_{i}` per episode:
//! - datasets `observations` (`[steps + 1, obs_dim]`: the last row is the state after the final
//!   step), `actions` (`[steps]`), `rewards`, `terminations` and `truncations` (`[steps]`; h5py
//!   stores numpy's bool as an int8 enum `FALSE`/`TRUE`, which `hdf5-metno`'s `bool` reads), and
//!   an optional `infos` group (not read);
//! - the episode's metadata as attributes: `id`, `total_steps`, `seed`, and whatever
//!   `update_episode_metadata` merged in, such as the privacy unit under [`UNIT_KEY`].
//!
//! Invariants: the checks of the columnar reader (1-D float32 Box observations, `Discrete(n)`
//! actions in range, every episode's lengths against its `total_steps` and the dataset's totals,
//! finite values), and the same unit assignment: an episode whose metadata names no unit becomes
//! a unit of its own, numbered after the largest unit present (0 when none), in episode order.

use std::path::{Path, PathBuf};

use hdf5_metno as h5;
use serde_json::Value;

use super::dataset::{Dataset, Episode};
use super::minari::{
    Fields, MinariError, ReadDataset, UNIT_KEY, fields, kept_episodes, layout, read_spaces,
};

/// The file holding every episode (Minari's `_MAIN_FILE_NAME`).
pub const MAIN_FILE: &str = "main_data.hdf5";

/// An HDF5 error as a layout error naming the file.
fn h5_err<'a>(path: &'a Path, what: &'a str) -> impl Fn(h5::Error) -> MinariError + 'a {
    move |e| layout(path, format!("HDF5 {what}: {e}"))
}

/// [`super::minari::read_units`] for a dataset whose `metadata.json` (`meta`, read from
/// `meta_path`) says `data_format: "hdf5"`.
pub(super) fn read_units(
    dir: &Path,
    meta: &Value,
    meta_path: &Path,
    keep: &dyn Fn(u64) -> bool,
) -> Result<ReadDataset, MinariError> {
    let (obs_dim, n_actions) = read_spaces(meta, meta_path)?;
    let Fields {
        id,
        minari_version,
        total_episodes,
        total_steps,
        env_id,
    } = fields(meta, meta_path)?;

    let file = Hdf5File::open(&dir.join("data"))?;
    let mut metas = Vec::with_capacity(total_episodes as usize);
    for i in 0..total_episodes {
        metas.push(file.episode_meta(i)?);
    }
    let (episodes, units_assigned) =
        kept_episodes(metas, total_steps, meta_path, keep, |i, total| {
            file.read_episode(i, obs_dim, n_actions, total)
        })?;
    Ok(ReadDataset {
        dataset: Dataset {
            id,
            env_id,
            obs_dim,
            n_actions,
            episodes,
        },
        units_assigned,
        minari_version,
    })
}

/// An open `data/main_data.hdf5`: per-episode metadata and episodes, by episode id (the
/// primitives [`read_units`] is made of, for the other readers of a dataset's episodes).
pub(super) struct Hdf5File {
    path: PathBuf,
    file: h5::File,
}

impl Hdf5File {
    /// Opens `data/main_data.hdf5` (`data` is the dataset's `data/` folder).
    pub(super) fn open(data: &Path) -> Result<Self, MinariError> {
        let path = data.join(MAIN_FILE);
        if !path.is_file() {
            return Err(layout(&path, "missing file"));
        }
        let file = h5::File::open(&path).map_err(h5_err(&path, "open"))?;
        Ok(Self { path, file })
    }

    fn group(&self, id: u64) -> Result<(h5::Group, PathBuf), MinariError> {
        let name = format!("episode_{id}");
        let g = self
            .file
            .group(&name)
            .map_err(|e| layout(&self.path, format!("HDF5 group {name}: {e}")))?;
        // Errors about the episode name the file and the group.
        Ok((g, PathBuf::from(format!("{}: {name}", self.path.display()))))
    }

    /// What episode `id`'s attributes say: its unit ([`UNIT_KEY`], if any) and `total_steps`
    /// (if given).
    pub(super) fn episode_meta(&self, id: u64) -> Result<(Option<u64>, Option<u64>), MinariError> {
        let (g, at) = self.group(id)?;
        Ok((
            attr_u64(&g, UNIT_KEY, &at)?,
            attr_u64(&g, "total_steps", &at)?,
        ))
    }

    /// Decodes episode `id` (its unit left at 0), checked against `total_steps` when given.
    pub(super) fn read_episode(
        &self,
        id: u64,
        obs_dim: usize,
        n_actions: usize,
        total_steps: Option<u64>,
    ) -> Result<Episode, MinariError> {
        let (g, at) = self.group(id)?;
        read_episode(&g, &at, id, obs_dim, n_actions, total_steps)
    }
}

/// An optional unsigned integer attribute of an episode group (h5py writes Python ints as
/// int64 scalars): `None` when absent, an error when it is not a non-negative integer.
fn attr_u64(g: &h5::Group, key: &str, path: &Path) -> Result<Option<u64>, MinariError> {
    let names = g.attr_names().map_err(h5_err(path, "attributes"))?;
    if !names.iter().any(|n| n == key) {
        return Ok(None);
    }
    let a = g.attr(key).map_err(h5_err(path, key))?;
    let bad = || layout(path, format!("{key} is not an unsigned integer"));
    let td = a
        .dtype()
        .and_then(|t| t.to_descriptor())
        .map_err(|_| bad())?;
    if !matches!(
        td,
        h5::types::TypeDescriptor::Integer(_) | h5::types::TypeDescriptor::Unsigned(_)
    ) || a.ndim() != 0
    {
        return Err(bad());
    }
    if matches!(td, h5::types::TypeDescriptor::Unsigned(_)) {
        return a.read_scalar::<u64>().map(Some).map_err(|_| bad());
    }
    let v = a.read_scalar::<i64>().map_err(|_| bad())?;
    u64::try_from(v).map(Some).map_err(|_| bad())
}

/// A dataset of the episode group, flattened, with its shape.
fn read_flat<T: h5::H5Type>(
    g: &h5::Group,
    key: &str,
    at: &Path,
) -> Result<(Vec<usize>, Vec<T>), MinariError> {
    let ds = g.dataset(key).map_err(h5_err(at, key))?;
    let v = ds.read_raw::<T>().map_err(h5_err(at, key))?;
    Ok((ds.shape(), v))
}

/// Decodes one episode group (its unit left at 0), checking it against its `total_steps`
/// attribute when given. `at` names the group in errors.
fn read_episode(
    g: &h5::Group,
    at: &Path,
    id: u64,
    obs_dim: usize,
    n_actions: usize,
    total_steps: Option<u64>,
) -> Result<Episode, MinariError> {
    let (a_shape, raw_actions) = read_flat::<i64>(g, "actions", at)?;
    let steps = raw_actions.len();
    // Discrete actions are `[steps]` (h5py may keep a trailing 1).
    if a_shape.first() != Some(&steps) {
        return Err(layout(
            at,
            format!("actions have shape {a_shape:?}, expected [{steps}]"),
        ));
    }
    if steps == 0 {
        return Err(layout(at, "the episode has no steps"));
    }
    if let Some(t) = total_steps
        && t != steps as u64
    {
        return Err(layout(
            at,
            format!("total_steps is {t} but the episode holds {steps} steps"),
        ));
    }
    let (o_shape, observations) = read_flat::<f32>(g, "observations", at)?;
    if o_shape != [steps + 1, obs_dim] {
        return Err(layout(
            at,
            format!(
                "observations have shape {o_shape:?}, expected [{}, {obs_dim}] (steps + 1 rows \
                 of the observation space's {obs_dim} values)",
                steps + 1
            ),
        ));
    }
    let (_, raw_rewards) = read_flat::<f64>(g, "rewards", at)?;
    let (_, terminations) = read_flat::<bool>(g, "terminations", at)?;
    let (_, truncations) = read_flat::<bool>(g, "truncations", at)?;
    if raw_rewards.len() != steps || terminations.len() != steps || truncations.len() != steps {
        return Err(layout(
            at,
            format!(
                "{steps} actions but {} rewards, {} terminations and {} truncations",
                raw_rewards.len(),
                terminations.len(),
                truncations.len()
            ),
        ));
    }
    let mut actions = Vec::with_capacity(steps);
    for &a in &raw_actions {
        if a < 0 || a as u64 >= n_actions as u64 {
            return Err(layout(
                at,
                format!("action {a} outside Discrete({n_actions})"),
            ));
        }
        actions.push(a as u32);
    }
    let mut rewards = Vec::with_capacity(steps);
    for &r in &raw_rewards {
        if !r.is_finite() {
            return Err(layout(at, format!("non-finite reward {r}")));
        }
        rewards.push(r as f32);
    }
    if let Some(x) = observations.iter().find(|x| !x.is_finite()) {
        return Err(layout(at, format!("non-finite observation value {x}")));
    }
    Ok(Episode {
        id,
        unit: 0,
        observations,
        actions,
        rewards,
        terminations,
        truncations,
    })
}
