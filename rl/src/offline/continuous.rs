//! Continuous-action offline datasets (PriMORL, seed 001, appendix D and F.1): episodes of a
//! Box-action environment, each owned by one privacy unit (a trajectory), with the split into the
//! private training part and the small public part used for early stopping and for the model's
//! input normalisation (the paper: 1% of the episodes, "considered public").
//!
//! A dataset is stored as one safetensors file: `observations` (`[rows, obs_dim]`, every
//! episode's `len + 1` observations in turn), `actions` (`[steps, act_dim]`), `rewards`
//! (`[steps]`), and per episode `units`, `lengths` (I64) and `terminated` (U8); the environment
//! id, the dimensions and the generating procedure are JSON metadata. The discrete datasets of
//! the CQL tasks keep Minari's layout ([`super::minari`]); this one is fedrl's own. A Minari
//! dataset with a 1-D float32 Box action space (parquet or arrow) is imported into it by
//! [`import_minari`] (`fedrl data import`), its SHA-256 sidecar written as for a generated one.
//!
//! A `gymnasium:<id>` spec (`[task.dataset.gymnasium]`) is generated through the Gymnasium
//! bridge ([`generate_gym`]): unit `u` in its user's environment, the behaviour's SAC learning
//! run in the default one, every step of a batch one message per worker with the workers
//! stepping concurrently ([`record_in`]); the file then records the workers' spaces
//! ([`ContinuousMeta::spaces`]) for the processes that run no Python.
//!
//! Invariants: a spec's data does not depend on the batching, the worker count or the machine
//! (every episode is reset with its own seed and explores with its own stream; the cache key and
//! the recorded procedure leave the interpreter, the worker count and the deadlines out); fedrl's
//! own environments step at once through [`fedrl_sim::Env::step_queue`]'s default, so their
//! datasets are the ones earlier versions generated, byte for byte; a worker fault fails the
//! generation with its reason, never a dataset with units missing.

use std::path::Path;

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use rand_distr::Distribution;
use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};

use super::dataset::spread;
use crate::ensemble::{EnsembleSpec, ModelRows};
use crate::tensor_io::{self, Tensor, le_f32s, le_i64s};
use crate::{NnError, Result};
use fedrl_common::task::primorl::{ContinuousBehaviour, ContinuousDatasetSpec, ContinuousSource};

/// Metadata key of the dataset's description (JSON of [`ContinuousMeta`]).
pub const META_KEY: &str = "fedrl.continuous_dataset";

/// One episode: `observations` holds `len + 1` rows (the last is the state after the final
/// step), `actions` `len` rows of `act_dim`, `rewards` `len` values.
#[derive(Clone, Debug, PartialEq)]
pub struct ContinuousEpisode {
    /// The privacy unit owning the episode (one trajectory per unit in PriMORL's datasets).
    pub unit: u64,
    pub observations: Vec<f32>,
    pub actions: Vec<f32>,
    pub rewards: Vec<f32>,
    /// Whether the episode ended in a terminal state (else a time limit cut it).
    pub terminated: bool,
}

impl ContinuousEpisode {
    /// Number of steps.
    pub fn len(&self) -> usize {
        self.rewards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rewards.is_empty()
    }

    /// Undiscounted return.
    pub fn total_return(&self) -> f64 {
        self.rewards.iter().map(|&r| f64::from(r)).sum()
    }

    /// The episode's model-training rows `(s, a) -> (s' - s, r)` under `spec`'s normalisation.
    pub fn model_rows(&self, spec: &EnsembleSpec) -> Result<ModelRows> {
        let d = spec.obs_dim;
        let n = self.len();
        if self.observations.len() != (n + 1) * d {
            return Err(NnError::Invalid(format!(
                "episode of unit {}: {} observation values for {n} steps of {d}",
                self.unit,
                self.observations.len()
            )));
        }
        ModelRows::from_transitions(
            spec,
            &self.observations[..n * d],
            &self.actions,
            &self.rewards,
            &self.observations[d..],
        )
    }
}

/// What a dataset file says about itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContinuousMeta {
    /// The fedrl-sim environment id the episodes were recorded in, or the population whose
    /// users' environments they were recorded in (`pendulum-gml`).
    pub env_id: String,
    pub obs_dim: usize,
    pub act_dim: usize,
    /// How the episodes were made (free-form JSON: the generating procedure and its settings).
    pub procedure: serde_json::Value,
    /// The spaces of the environment, as the Gymnasium bridge's workers reported them: recorded
    /// for `gymnasium:<id>` datasets only (absent, and not written, for fedrl's own
    /// environments, whose spaces `fedrl_sim` knows), so that a process without Python (the
    /// aggregator's policy phase) knows the action box and the observation bounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spaces: Option<RecordedSpaces>,
}

/// An environment's Box spaces as a dataset records them ([`ContinuousMeta::spaces`]); an
/// infinite observation bound is `null`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecordedSpaces {
    pub obs_low: Vec<Option<f32>>,
    pub obs_high: Vec<Option<f32>>,
    pub act_low: Vec<f32>,
    pub act_high: Vec<f32>,
}

impl RecordedSpaces {
    /// The record of Box spaces `obs` and `act`; an error for other spaces or unbounded actions.
    pub fn of(obs: &fedrl_sim::Space, act: &fedrl_sim::Space) -> Result<Self> {
        let (fedrl_sim::Space::Box { low: ol, high: oh }, fedrl_sim::Space::Box { low, high }) =
            (obs, act)
        else {
            return Err(invalid(format!(
                "a continuous dataset needs box observations and actions, got {obs:?} and {act:?}"
            )));
        };
        if !low.iter().chain(high).all(|x| x.is_finite()) {
            return Err(invalid(format!(
                "the action box must be bounded, got [{low:?}, {high:?}]"
            )));
        }
        let finite = |v: &[f32]| v.iter().map(|x| x.is_finite().then_some(*x)).collect();
        Ok(RecordedSpaces {
            obs_low: finite(ol),
            obs_high: finite(oh),
            act_low: low.clone(),
            act_high: high.clone(),
        })
    }

    /// The observation space (infinite where no bound was recorded).
    pub fn observation_space(&self) -> fedrl_sim::Space {
        fedrl_sim::Space::Box {
            low: self
                .obs_low
                .iter()
                .map(|x| x.unwrap_or(f32::NEG_INFINITY))
                .collect(),
            high: self
                .obs_high
                .iter()
                .map(|x| x.unwrap_or(f32::INFINITY))
                .collect(),
        }
    }
}

/// What a stored dataset's header says: [`ContinuousDataset::read_header`].
#[derive(Clone, Debug, PartialEq)]
pub struct ContinuousHeader {
    pub meta: ContinuousMeta,
    /// Episodes (one per privacy unit, the public split included).
    pub episodes: u64,
    /// Environment steps over all episodes.
    pub steps: u64,
}

/// Sizes and return quantiles of a continuous dataset (`fedrl data summary`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ContinuousSummary {
    pub env_id: String,
    pub obs_dim: usize,
    pub act_dim: usize,
    /// Episodes, one per privacy unit (the public split included).
    pub episodes: usize,
    /// Environment steps over all episodes.
    pub steps: usize,
    /// Episodes that ended by termination rather than the time limit.
    pub terminated: usize,
    /// Undiscounted episode returns (reward units): mean and the quantiles min, 25%, median,
    /// 75%, max (numpy's linear interpolation). All 0 for an empty dataset.
    pub return_mean: f64,
    pub return_min: f64,
    pub return_q25: f64,
    pub return_median: f64,
    pub return_q75: f64,
    pub return_max: f64,
    /// The generating procedure, as stored.
    pub procedure: serde_json::Value,
}

/// A continuous-action dataset held by privacy units.
#[derive(Clone, Debug, PartialEq)]
pub struct ContinuousDataset {
    pub meta: ContinuousMeta,
    pub episodes: Vec<ContinuousEpisode>,
}

fn invalid(m: impl Into<String>) -> NnError {
    NnError::Invalid(m.into())
}

impl ContinuousDataset {
    /// Checks every episode's array lengths against the dimensions and that values are finite.
    pub fn check(&self) -> Result<()> {
        let (d, a) = (self.meta.obs_dim, self.meta.act_dim);
        if d == 0 || a == 0 {
            return Err(invalid(
                "a continuous dataset needs positive observation and action lengths",
            ));
        }
        for (k, e) in self.episodes.iter().enumerate() {
            let n = e.len();
            if e.observations.len() != (n + 1) * d || e.actions.len() != n * a {
                return Err(invalid(format!(
                    "episode {k}: {} observation and {} action values for {n} steps ({d} and {a} per step)",
                    e.observations.len(),
                    e.actions.len()
                )));
            }
            let finite = |v: &[f32]| v.iter().all(|x| x.is_finite());
            if !(finite(&e.observations) && finite(&e.actions) && finite(&e.rewards)) {
                return Err(invalid(format!("episode {k}: non-finite values")));
            }
        }
        Ok(())
    }

    /// Serialises the dataset to safetensors bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        self.check()?;
        let (d, a) = (self.meta.obs_dim, self.meta.act_dim);
        let steps: usize = self.episodes.iter().map(ContinuousEpisode::len).sum();
        let rows = steps + self.episodes.len();
        let mut obs = Vec::with_capacity(rows * d);
        let mut act = Vec::with_capacity(steps * a);
        let mut rew = Vec::with_capacity(steps);
        let mut units = Vec::with_capacity(self.episodes.len() * 8);
        let mut lengths = Vec::with_capacity(self.episodes.len() * 8);
        let mut term = Vec::with_capacity(self.episodes.len());
        for e in &self.episodes {
            obs.extend_from_slice(&e.observations);
            act.extend_from_slice(&e.actions);
            rew.extend_from_slice(&e.rewards);
            units.extend_from_slice(&(e.unit as i64).to_le_bytes());
            lengths.extend_from_slice(&(e.len() as i64).to_le_bytes());
            term.push(u8::from(e.terminated));
        }
        let k = self.episodes.len();
        let raw = |name: &str, dtype: Dtype, bytes: Vec<u8>| Tensor {
            name: name.into(),
            dtype,
            shape: vec![k],
            bytes,
        };
        let tensors = [
            Tensor::f32("observations", vec![rows, d], &obs),
            Tensor::f32("actions", vec![steps, a], &act),
            Tensor::f32("rewards", vec![steps], &rew),
            raw("units", Dtype::I64, units),
            raw("lengths", Dtype::I64, lengths),
            raw("terminated", Dtype::U8, term),
        ];
        let meta = serde_json::to_string(&self.meta)
            .map_err(|e| invalid(format!("dataset metadata: {e}")))?;
        tensor_io::serialize(&tensors, META_KEY, meta)
    }

    /// Parses bytes written by [`ContinuousDataset::to_bytes`], checking every length.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let json = tensor_io::metadata_entry(bytes, META_KEY)?
            .ok_or_else(|| invalid(format!("not a continuous dataset: no {META_KEY} metadata")))?;
        let meta: ContinuousMeta =
            serde_json::from_str(&json).map_err(|e| invalid(format!("dataset metadata: {e}")))?;
        let st = tensor_io::parse(bytes)?;
        // Borrowed from `bytes`: the arrays are converted once, not copied first.
        let get = |name: &str, dtype: Dtype| tensor_io::tensor_bytes(&st, name, dtype, None);
        let obs = le_f32s(get("observations", Dtype::F32)?);
        let act = le_f32s(get("actions", Dtype::F32)?);
        let rew = le_f32s(get("rewards", Dtype::F32)?);
        let units = le_i64s(get("units", Dtype::I64)?);
        let lengths = le_i64s(get("lengths", Dtype::I64)?);
        let term = get("terminated", Dtype::U8)?;
        let (d, a) = (meta.obs_dim, meta.act_dim);
        if units.len() != lengths.len() || term.len() != units.len() {
            return Err(invalid("dataset: per-episode arrays differ in length"));
        }
        let (mut o, mut s) = (0usize, 0usize);
        let mut episodes = Vec::with_capacity(units.len());
        for ((&u, &n), &t) in units.iter().zip(&lengths).zip(term) {
            let (Ok(u), Ok(n)) = (u64::try_from(u), usize::try_from(n)) else {
                return Err(invalid("dataset: negative unit id or episode length"));
            };
            let (o2, s2) = (o + (n + 1) * d, s + n);
            if o2 > obs.len() || s2 > rew.len() || s2 * a > act.len() {
                return Err(invalid("dataset: episode lengths exceed the stored arrays"));
            }
            episodes.push(ContinuousEpisode {
                unit: u,
                observations: obs[o..o2].to_vec(),
                actions: act[s * a..s2 * a].to_vec(),
                rewards: rew[s..s2].to_vec(),
                terminated: t != 0,
            });
            (o, s) = (o2, s2);
        }
        if o != obs.len() || s != rew.len() || s * a != act.len() {
            return Err(invalid(
                "dataset: stored arrays are longer than the episodes",
            ));
        }
        let ds = ContinuousDataset { meta, episodes };
        ds.check()?;
        Ok(ds)
    }

    /// Writes the dataset to `path` atomically (a temporary file renamed into place, fsynced),
    /// with its SHA-256 in the sidecar [`content_path`] written first: a dataset file in place
    /// always has the digest of its bytes beside it, so bits flipped later are detected
    /// ([`verify_content`]).
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes = self.to_bytes()?;
        let digest: String = ring::digest::digest(&ring::digest::SHA256, &bytes)
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        write_synced(&content_path(path), format!("{digest}\n").as_bytes())?;
        write_synced(path, &bytes)
    }

    /// Sizes and return quantiles.
    pub fn summary(&self) -> ContinuousSummary {
        summary_of(
            &self.meta,
            self.episodes
                .iter()
                .map(ContinuousEpisode::total_return)
                .collect(),
            self.episodes.iter().map(ContinuousEpisode::len).sum(),
            self.episodes.iter().filter(|e| e.terminated).count(),
        )
    }

    /// Reads what a file written by [`ContinuousDataset::save`] says of itself, from its
    /// safetensors header alone (the arrays of a 30,000-episode dataset are hundreds of MB):
    /// the metadata and the episode and step counts.
    pub fn read_header(path: &Path) -> Result<ContinuousHeader> {
        let f = StoredFile::open(path)?;
        Ok(ContinuousHeader {
            episodes: f.count("lengths")?,
            steps: f.count("rewards")?,
            meta: f.meta,
        })
    }

    /// [`ContinuousDataset::summary`] of a stored dataset, reading only its header, the rewards
    /// and the per-episode lengths and flags (for cart-pole balance, 5 observation and 1 action
    /// values a step, about a seventh of the file), and holding no episode in memory.
    pub fn summarize_file(path: &Path) -> Result<ContinuousSummary> {
        let mut f = StoredFile::open(path)?;
        let rewards = le_f32s(&f.read_tensor("rewards", Dtype::F32)?);
        let lengths = le_i64s(&f.read_tensor("lengths", Dtype::I64)?);
        let terminated = f.read_tensor("terminated", Dtype::U8)?;
        if lengths.len() != terminated.len() {
            return Err(f.bad("per-episode arrays differ in length".into()));
        }
        let mut returns = Vec::with_capacity(terminated.len());
        let mut s = 0usize;
        for &n in &lengths {
            let end = usize::try_from(n)
                .ok()
                .and_then(|n| s.checked_add(n))
                .filter(|&e| e <= rewards.len())
                .ok_or_else(|| f.bad("episode lengths exceed the stored rewards".into()))?;
            let r = &rewards[s..end];
            if !r.iter().all(|x| x.is_finite()) {
                return Err(f.bad(format!("episode {}: non-finite rewards", returns.len())));
            }
            returns.push(r.iter().map(|&x| f64::from(x)).sum());
            s = end;
        }
        if s != rewards.len() {
            return Err(f.bad("stored rewards are longer than the episodes".into()));
        }
        let done = terminated.iter().filter(|&&t| t != 0).count();
        Ok(summary_of(&f.meta, returns, s, done))
    }

    /// [`ContinuousDataset::load`] keeping only the episodes of the units `keep` accepts, and
    /// reading only theirs from the file (a client agent hosts a share of the units, plus the
    /// public split). Lengths and offsets are checked as `load` checks them.
    pub fn load_units(path: &Path, keep: &dyn Fn(u64) -> bool) -> Result<Self> {
        Self::load_mapped(path, &|_, u| keep(u).then_some(u))
    }

    /// [`ContinuousDataset::load_units`] with the units renumbered: `map(i, unit)` gives the
    /// unit id episode `i` (file order) holding stored id `unit` gets, or `None` to skip it
    /// unread.
    pub fn load_mapped(path: &Path, map: &dyn Fn(u64, u64) -> Option<u64>) -> Result<Self> {
        let mut f = StoredFile::open(path)?;
        let units = le_i64s(&f.read_tensor("units", Dtype::I64)?);
        let lengths = le_i64s(&f.read_tensor("lengths", Dtype::I64)?);
        let term = f.read_tensor("terminated", Dtype::U8)?;
        if units.len() != lengths.len() || term.len() != units.len() {
            return Err(f.bad("per-episode arrays differ in length".into()));
        }
        let (d, a) = (f.meta.obs_dim, f.meta.act_dim);
        let obs = f.locate("observations", Dtype::F32, d)?;
        let act = f.locate("actions", Dtype::F32, a)?;
        let rew = f.locate("rewards", Dtype::F32, 1)?;
        let (mut o, mut s) = (0u64, 0u64);
        let mut episodes = Vec::new();
        for (i, ((&u, &n), &t)) in units.iter().zip(&lengths).zip(&term).enumerate() {
            let (Ok(u), Ok(n)) = (u64::try_from(u), u64::try_from(n)) else {
                return Err(f.bad("negative unit id or episode length".into()));
            };
            let (o2, s2) = (o + n + 1, s + n);
            if o2 > obs.rows || s2 > rew.rows || s2 > act.rows {
                return Err(f.bad("episode lengths exceed the stored arrays".into()));
            }
            if let Some(unit) = map(i as u64, u) {
                episodes.push(ContinuousEpisode {
                    unit,
                    observations: f.read_rows(&obs, o, o2)?,
                    actions: f.read_rows(&act, s, s2)?,
                    rewards: f.read_rows(&rew, s, s2)?,
                    terminated: t != 0,
                });
            }
            (o, s) = (o2, s2);
        }
        if o != obs.rows || s != rew.rows || s != act.rows {
            return Err(f.bad("stored arrays are longer than the episodes".into()));
        }
        let ds = ContinuousDataset {
            meta: f.meta,
            episodes,
        };
        ds.check()
            .map_err(|e| invalid(format!("{}: {e}", path.display())))?;
        Ok(ds)
    }

    /// Reads a dataset written by [`ContinuousDataset::save`].
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_units(path, &|_| true)
    }

    /// The episodes of the public split (ids `>= private_units`) and of the private part, in
    /// dataset order.
    pub fn split(&self, private_units: u64) -> (Vec<&ContinuousEpisode>, Vec<&ContinuousEpisode>) {
        self.episodes.iter().partition(|e| e.unit >= private_units)
    }

    /// Mean and standard deviation (floored at 1e-6) of every model input component (`obs ++
    /// action`) over `episodes`' steps: the public normalisation of [`EnsembleSpec`].
    pub fn input_stats(&self, episodes: &[&ContinuousEpisode]) -> (Vec<f32>, Vec<f32>) {
        let (d, a) = (self.meta.obs_dim, self.meta.act_dim);
        let mut sum = vec![0.0f64; d + a];
        let mut sq = vec![0.0f64; d + a];
        let mut n = 0.0f64;
        for e in episodes {
            for t in 0..e.len() {
                let row = e.observations[t * d..(t + 1) * d]
                    .iter()
                    .chain(&e.actions[t * a..(t + 1) * a]);
                for (k, &x) in row.enumerate() {
                    sum[k] += f64::from(x);
                    sq[k] += f64::from(x) * f64::from(x);
                }
                n += 1.0;
            }
        }
        let n = n.max(1.0);
        let mean: Vec<f32> = sum.iter().map(|s| (s / n) as f32).collect();
        let std: Vec<f32> = sum
            .iter()
            .zip(&sq)
            .map(|(s, q)| ((q / n - (s / n).powi(2)).max(0.0).sqrt().max(1e-6)) as f32)
            .collect();
        (mean, std)
    }
}

/// The summary of a dataset with `meta`, episode `returns`, `steps` and `terminated` episodes.
fn summary_of(
    meta: &ContinuousMeta,
    returns: Vec<f64>,
    steps: usize,
    terminated: usize,
) -> ContinuousSummary {
    let episodes = returns.len();
    let [mean, min, q25, median, q75, max] = spread(returns);
    ContinuousSummary {
        env_id: meta.env_id.clone(),
        obs_dim: meta.obs_dim,
        act_dim: meta.act_dim,
        episodes,
        steps,
        terminated,
        return_mean: mean,
        return_min: min,
        return_q25: q25,
        return_median: median,
        return_q75: q75,
        return_max: max,
        procedure: meta.procedure.clone(),
    }
}

/// Where a row-major f32 tensor lies in a stored file.
struct RowRange {
    /// Byte offset of its first row in the file.
    start: u64,
    rows: u64,
    row_bytes: u64,
}

/// A stored dataset opened for reading parts of it: its parsed safetensors header.
struct StoredFile<'p> {
    path: &'p Path,
    file: std::fs::File,
    /// The header JSON (tensor names to dtype, shape and data offsets).
    header: serde_json::Value,
    /// Where the data section starts: after the 8-byte length and the header.
    data_start: u64,
    meta: ContinuousMeta,
}

impl<'p> StoredFile<'p> {
    fn open(path: &'p Path) -> Result<Self> {
        use std::io::Read;
        let bad = |m: String| invalid(format!("{}: {m}", path.display()));
        let mut file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len)
            .map_err(|e| bad(format!("no safetensors header: {e}")))?;
        let n = u64::from_le_bytes(len);
        // safetensors' own bound on a header; also keeps a corrupt length from allocating.
        if n > 100_000_000 {
            return Err(bad(format!("header length {n} is not plausible")));
        }
        let mut bytes = vec![0u8; n as usize];
        file.read_exact(&mut bytes)
            .map_err(|e| bad(format!("truncated safetensors header: {e}")))?;
        let header: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("header: {e}")))?;
        let json = header["__metadata__"][META_KEY]
            .as_str()
            .ok_or_else(|| bad(format!("not a continuous dataset: no {META_KEY} metadata")))?;
        let meta: ContinuousMeta =
            serde_json::from_str(json).map_err(|e| bad(format!("dataset metadata: {e}")))?;
        // A file cut short (a copy or a disk that filled up) keeps a valid header: its length
        // must reach the end of the last tensor the header describes.
        let data_end = header
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, _)| k.as_str() != "__metadata__")
            .filter_map(|(_, t)| t["data_offsets"][1].as_u64())
            .max()
            .unwrap_or(0);
        let want = (8 + n).saturating_add(data_end);
        let have = file.metadata().map_err(|e| bad(e.to_string()))?.len();
        if have < want {
            return Err(bad(format!(
                "truncated: {have} bytes, the header describes {want}; delete the file to \
                 generate it again"
            )));
        }
        Ok(StoredFile {
            path,
            file,
            header,
            data_start: 8 + n,
            meta,
        })
    }

    fn bad(&self, m: String) -> NnError {
        invalid(format!("{}: {m}", self.path.display()))
    }

    /// The first dimension of a one-dimensional tensor.
    fn count(&self, name: &str) -> Result<u64> {
        self.header[name]["shape"][0]
            .as_u64()
            .ok_or_else(|| self.bad(format!("no one-dimensional {name} tensor")))
    }

    /// Where tensor `name` of `dtype` with `width` values a row lies in the file, checked
    /// against its shape (`[rows, width]`, or `[rows]` for width 1) and the file's length.
    fn locate(&self, name: &str, dtype: Dtype, width: usize) -> Result<RowRange> {
        let t = &self.header[name];
        let size = match dtype {
            Dtype::U8 => 1,
            Dtype::F32 => 4,
            Dtype::I64 => 8,
            _ => return Err(self.bad(format!("{name}: unexpected dtype {dtype:?}"))),
        };
        if t["dtype"].as_str() != Some(&format!("{dtype:?}")) {
            return Err(self.bad(format!("{name}: dtype {}, expected {dtype:?}", t["dtype"])));
        }
        let rows = self.count(name)?;
        let shape_ok = match t["shape"].as_array().map(Vec::len) {
            Some(1) => width == 1,
            Some(2) => t["shape"][1].as_u64() == Some(width as u64),
            _ => false,
        };
        let (Some(a), Some(b)) = (t["data_offsets"][0].as_u64(), t["data_offsets"][1].as_u64())
        else {
            return Err(self.bad(format!("{name}: no data offsets")));
        };
        let row_bytes = width as u64 * size;
        let file_len = self.file.metadata()?.len();
        // Checked: the header is input; a corrupt count must be an error, not a wrap.
        if !shape_ok
            || b < a
            || Some(b - a) != rows.checked_mul(row_bytes)
            || self
                .data_start
                .checked_add(b)
                .is_none_or(|end| end > file_len)
        {
            return Err(self.bad(format!(
                "{name}: shape {} and data offsets {a}..{b} do not fit rows of {width}",
                t["shape"]
            )));
        }
        Ok(RowRange {
            start: self.data_start + a,
            rows,
            row_bytes,
        })
    }

    /// The raw bytes of rows `from..to` of a tensor located by [`StoredFile::locate`].
    fn read_bytes(&mut self, r: &RowRange, from: u64, to: u64) -> Result<Vec<u8>> {
        use std::io::{Read, Seek, SeekFrom};
        self.file
            .seek(SeekFrom::Start(r.start + from * r.row_bytes))?;
        let mut bytes = vec![0u8; ((to - from) * r.row_bytes) as usize];
        self.file
            .read_exact(&mut bytes)
            .map_err(|e| self.bad(e.to_string()))?;
        Ok(bytes)
    }

    /// Rows `from..to` of an f32 tensor located by [`StoredFile::locate`].
    fn read_rows(&mut self, r: &RowRange, from: u64, to: u64) -> Result<Vec<f32>> {
        Ok(le_f32s(&self.read_bytes(r, from, to)?))
    }

    /// The raw little-endian bytes of the one-dimensional tensor `name` of `dtype`.
    fn read_tensor(&mut self, name: &str, dtype: Dtype) -> Result<Vec<u8>> {
        let r = self.locate(name, dtype, 1)?;
        self.read_bytes(&r, 0, r.rows)
    }
}

/// What [`record`] reports while it runs.
#[derive(Clone, Debug, PartialEq)]
pub enum ContinuousProgress {
    /// The behaviour's learning run: `step` of `total` environment steps, with the mean return of
    /// the last finished training episodes.
    Learning {
        step: u64,
        total: u64,
        recent_return: f64,
    },
    /// Episodes recorded so far.
    Recording { done: u64, total: u64 },
}

/// The behaviour's actors, and how to act with them on a batch of observations.
pub trait BehaviourPolicy {
    /// Number of actors (checkpoints); unit `u` plays with actor `u % count`.
    fn count(&self) -> usize;
    /// Actions (`rows.len() x act_dim`, inside the action box) of actor `index` for `obs`
    /// (`rows.len() x obs_dim`); row `k` draws its exploration from `rngs[k]` only, so an
    /// episode does not depend on which others share its batch.
    fn act(
        &mut self,
        index: usize,
        obs: &[f32],
        rngs: &mut [Xoshiro256PlusPlus],
    ) -> Result<Vec<f32>>;
}

/// Uniformly random actions in the box `[low, high]`.
pub struct RandomPolicy {
    pub low: Vec<f32>,
    pub high: Vec<f32>,
}

impl BehaviourPolicy for RandomPolicy {
    fn count(&self) -> usize {
        1
    }

    fn act(
        &mut self,
        _index: usize,
        _obs: &[f32],
        rngs: &mut [Xoshiro256PlusPlus],
    ) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(rngs.len() * self.low.len());
        for rng in rngs.iter_mut() {
            for (lo, hi) in self.low.iter().zip(&self.high) {
                out.push(lo + (hi - lo) * rng.random::<f32>());
            }
        }
        Ok(out)
    }
}

/// The actors of [`ContinuousBehaviour::SacCheckpoints`]: actor 0 is the uniform random policy
/// the learning run starts with (its `start_steps`); actors `1..checkpoints` are SAC's actor
/// snapshotted evenly over the run, the last being the final one. Each plays its deterministic
/// action plus Gaussian noise of `noise_std` half-widths, clipped to the box.
pub struct SacCheckpoints {
    agent: crate::sac::SacAgent,
    actors: Vec<Vec<f32>>,
    loaded: Option<usize>,
    noise_std: f64,
    /// Actor 0, which also holds the action box.
    random: RandomPolicy,
}

impl SacCheckpoints {
    /// Runs SAC on `env_id` (the simulator: nobody's data) for `steps` environment steps. A
    /// population name (`pendulum-gml`) learns in its user [`BEHAVIOUR_USER`]'s environment
    /// ([`user_env`]).
    pub fn learn(
        env_id: &str,
        steps: u64,
        checkpoints: u32,
        noise_std: f64,
        seed: u64,
        progress: &mut dyn FnMut(ContinuousProgress),
    ) -> Result<Self> {
        let mut env = user_env(env_id, seed, BEHAVIOUR_USER)?;
        Self::learn_in(
            env.as_mut(),
            env_id,
            steps,
            checkpoints,
            noise_std,
            seed,
            progress,
        )
    }

    /// [`SacCheckpoints::learn`] in `env` (named `env_id` in errors): a Gymnasium dataset's
    /// default environment, stepped by the bridge.
    pub fn learn_in(
        env: &mut dyn fedrl_sim::Env,
        env_id: &str,
        steps: u64,
        checkpoints: u32,
        noise_std: f64,
        seed: u64,
        progress: &mut dyn FnMut(ContinuousProgress),
    ) -> Result<Self> {
        use crate::sac::{OnlineOptions, SacConfig, train_online};
        let fedrl_sim::Space::Box { low, high } = env.action_space().clone() else {
            return Err(invalid(format!("{env_id}: actions are not a box")));
        };
        let snapshots = u64::from(checkpoints.max(2) - 1);
        let every = (steps / snapshots).max(1);
        let opts = OnlineOptions {
            start_steps: (steps / 10).clamp(1, 5_000),
            update_after: (steps / 20).clamp(1, 1_000),
            checkpoint_every: every,
            replay_capacity: steps.min(1_000_000) as usize,
            ..OnlineOptions::default()
        };
        let mut actors = Vec::new();
        let (agent, _) = train_online(
            env,
            every * snapshots,
            &SacConfig::default(),
            &opts,
            mix(&[seed, 0x5AC]),
            &candle_core::Device::Cpu,
            |step, agent, log| {
                actors.push(agent.actor_params()?);
                progress(ContinuousProgress::Learning {
                    step,
                    total: every * snapshots,
                    recent_return: log.mean_last(10).unwrap_or(f64::NAN),
                });
                Ok(())
            },
        )?;
        Ok(SacCheckpoints {
            agent,
            actors,
            loaded: None,
            noise_std,
            random: RandomPolicy { low, high },
        })
    }
}

impl BehaviourPolicy for SacCheckpoints {
    fn count(&self) -> usize {
        self.actors.len() + 1
    }

    fn act(
        &mut self,
        index: usize,
        obs: &[f32],
        rngs: &mut [Xoshiro256PlusPlus],
    ) -> Result<Vec<f32>> {
        if index == 0 {
            return self.random.act(0, obs, rngs);
        }
        if self.loaded != Some(index) {
            self.agent.set_actor_params(&self.actors[index - 1])?;
            self.loaded = Some(index);
        }
        let mut a = self.agent.act(obs, true)?;
        let (low, high) = (&self.random.low, &self.random.high);
        let k = low.len();
        for (row, rng) in rngs.iter_mut().enumerate() {
            for j in 0..k {
                let half = f64::from(high[j] - low[j]) / 2.0;
                let z: f64 = rand_distr::StandardNormal.sample(rng);
                let x = f64::from(a[row * k + j]) + self.noise_std * half * z;
                a[row * k + j] = (x as f32).clamp(low[j], high[j]);
            }
        }
        Ok(a)
    }
}

/// Episodes recorded per batch (one policy forward per step for all of them).
const RECORD_BATCH: usize = 256;

/// The population user whose environment a behaviour learns in: far above any unit id, so the
/// learning run is nobody's episode.
pub const BEHAVIOUR_USER: u64 = 1 << 62;

/// The environment of unit `unit` of `env_id` generated with `seed`: an environment id gives
/// every unit the same default environment; a population name (`fedrl sim populations`, e.g.
/// `pendulum-gml`) gives each unit its own user's physics (population seed `seed`).
pub fn user_env(env_id: &str, seed: u64, unit: u64) -> Result<Box<dyn fedrl_sim::Env>> {
    Ok(fedrl_sim::population::Population::new(env_id, seed)?.user_env(unit)?)
}

/// A 64-bit mix of several words (SplitMix64's finaliser, chained).
fn mix(words: &[u64]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for &w in words {
        let mut z = h ^ w.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h = z ^ (z >> 31);
    }
    h
}

/// Where a recording's environments come from.
pub enum RecordEnvs<'a> {
    /// fedrl's own: unit `u` gets [`user_env`]`(env_id, seed, u)`.
    Rust,
    /// The Gymnasium bridge's workers: unit `u` gets the population's drawn kwargs for user `u`
    /// ([`super::gym::user_envs`]); the workers step concurrently, one thread each.
    Gym(&'a mut fedrl_sim::gym_bridge::GymPool),
}

/// Records `units` episodes of `env_id` (ids `0..units`; a population name gives unit `u` its
/// user `u`'s environment, [`user_env`]), unit `u` playing one episode with actor `u % count`,
/// reset with seed `mix(seed, u)` and exploring with a generator seeded by `mix(seed, u, 1)`:
/// the same dataset whatever the batching. Episodes end when the environment terminates or
/// truncates them.
pub fn record(
    env_id: &str,
    units: u64,
    seed: u64,
    policy: &mut dyn BehaviourPolicy,
    procedure: serde_json::Value,
    progress: &mut dyn FnMut(ContinuousProgress),
) -> Result<ContinuousDataset> {
    record_in(
        RecordEnvs::Rust,
        env_id,
        units,
        seed,
        policy,
        procedure,
        progress,
    )
}

/// [`record`] in `envs`: fedrl's own environments, or a Gymnasium pool's (`env_id` is then
/// `gymnasium:<id>`, and the dataset records the workers' spaces, [`ContinuousMeta::spaces`]).
/// The episodes are the same whatever the number of workers: each is reset with its own seed
/// and explores with its own stream. A worker fault fails the recording with its reason.
pub fn record_in(
    mut envs: RecordEnvs<'_>,
    env_id: &str,
    units: u64,
    seed: u64,
    policy: &mut dyn BehaviourPolicy,
    procedure: serde_json::Value,
    progress: &mut dyn FnMut(ContinuousProgress),
) -> Result<ContinuousDataset> {
    let (obs_space, act_space, spaces) = match &envs {
        RecordEnvs::Rust => {
            let probe = user_env(env_id, seed, BEHAVIOUR_USER)?;
            (
                probe.observation_space().clone(),
                probe.action_space().clone(),
                None,
            )
        }
        RecordEnvs::Gym(pool) => {
            let (o, a) = (
                pool.observation_space().clone(),
                pool.action_space().clone(),
            );
            let rec = RecordedSpaces::of(&o, &a).map_err(|e| invalid(format!("{env_id}: {e}")))?;
            (o, a, Some(rec))
        }
    };
    let (obs_dim, act_dim) = match (&obs_space, &act_space) {
        (fedrl_sim::Space::Box { low: o, .. }, fedrl_sim::Space::Box { low: a, .. }) => {
            (o.len(), a.len())
        }
        (o, a) => {
            return Err(invalid(format!(
                "{env_id}: a continuous dataset needs box observations and actions, got {o:?} and {a:?}"
            )));
        }
    };
    let count = policy.count().max(1) as u64;
    let mut episodes = Vec::with_capacity(units as usize);
    // Units of one actor are recorded together so each batch needs one actor.
    let mut done = 0u64;
    for actor in 0..count {
        let mine: Vec<u64> = (actor..units).step_by(count as usize).collect();
        for chunk in mine.chunks(RECORD_BATCH) {
            let (mut batch, shares) = match &mut envs {
                RecordEnvs::Rust => (
                    chunk
                        .iter()
                        .map(|&u| user_env(env_id, seed, u))
                        .collect::<Result<Vec<_>>>()?,
                    1,
                ),
                RecordEnvs::Gym(pool) => {
                    let shares = pool.workers();
                    (super::gym::user_envs(pool, chunk)?, shares)
                }
            };
            episodes.extend(record_batch(
                &mut batch,
                shares,
                chunk,
                seed,
                actor as usize,
                obs_dim,
                act_dim,
                policy,
            )?);
            done += chunk.len() as u64;
            progress(ContinuousProgress::Recording { done, total: units });
        }
    }
    episodes.sort_by_key(|e| e.unit);
    let ds = ContinuousDataset {
        meta: ContinuousMeta {
            env_id: env_id.to_string(),
            obs_dim,
            act_dim,
            procedure,
            spaces,
        },
        episodes,
    };
    ds.check()?;
    Ok(ds)
}

/// Plays one episode for each unit of `units` (all with actor `actor`, unit `units[k]` in
/// `envs[k]`) in lockstep: each step, one policy forward for every running episode, then
/// every episode's action queued before any result is collected, the environments stepped
/// in `shares` contiguous parts by one thread each ([`super::gym::step_shares`]): with a
/// Gymnasium pool's environments and its worker count, every worker steps its share of the
/// batch in one message, concurrently with the others. Rust environments (`shares` 1) step at
/// once in this thread, exactly as `step` would.
#[allow(clippy::too_many_arguments)]
fn record_batch(
    envs: &mut [Box<dyn fedrl_sim::Env>],
    shares: usize,
    units: &[u64],
    seed: u64,
    actor: usize,
    obs_dim: usize,
    act_dim: usize,
    policy: &mut dyn BehaviourPolicy,
) -> Result<Vec<ContinuousEpisode>> {
    let n = units.len();
    if envs.len() != n {
        return Err(invalid(format!(
            "{} environments for {n} episodes",
            envs.len()
        )));
    }
    let d = obs_dim;
    let mut obs = vec![0.0f32; n * d];
    let seeds: Vec<u64> = units.iter().map(|&u| mix(&[seed, u])).collect();
    super::gym::reset_shares(envs, &seeds, &mut obs, d, shares)?;
    let mut eps = Vec::with_capacity(n);
    let mut rngs = Vec::with_capacity(n);
    for (k, &u) in units.iter().enumerate() {
        rngs.push(Xoshiro256PlusPlus::seed_from_u64(mix(&[seed, u, 1])));
        eps.push(ContinuousEpisode {
            unit: u,
            observations: obs[k * d..(k + 1) * d].to_vec(),
            actions: Vec::new(),
            rewards: Vec::new(),
            terminated: false,
        });
    }
    let mut live: Vec<usize> = (0..n).collect();
    while !live.is_empty() {
        let mut batch_obs = Vec::with_capacity(live.len() * d);
        for &k in &live {
            batch_obs.extend_from_slice(&obs[k * d..(k + 1) * d]);
        }
        let mut batch_rngs: Vec<Xoshiro256PlusPlus> =
            live.iter().map(|&k| rngs[k].clone()).collect();
        let actions = policy.act(actor, &batch_obs, &mut batch_rngs)?;
        if actions.len() != live.len() * act_dim {
            return Err(invalid(format!(
                "behaviour policy returned {} action values for {} rows of {act_dim}",
                actions.len(),
                live.len()
            )));
        }
        let steps = super::gym::step_shares(envs, &live, &actions, act_dim, &mut obs, d, shares)?;
        let mut still = Vec::with_capacity(live.len());
        for (j, (&k, step)) in live.iter().zip(steps).enumerate() {
            rngs[k] = batch_rngs[j].clone();
            let e = &mut eps[k];
            e.actions
                .extend_from_slice(&actions[j * act_dim..(j + 1) * act_dim]);
            e.rewards.push(step.reward as f32);
            e.observations.extend_from_slice(&obs[k * d..(k + 1) * d]);
            if step.terminated {
                e.terminated = true;
            } else if !step.truncated {
                still.push(k);
            }
        }
        live = still;
    }
    Ok(eps)
}

/// Generates the dataset `spec` names (see [`ContinuousBehaviour`]); a `gymnasium:<id>` spec
/// through the Gymnasium bridge ([`generate_gym`]).
pub fn generate(
    spec: &ContinuousDatasetSpec,
    progress: &mut dyn FnMut(ContinuousProgress),
) -> Result<ContinuousDataset> {
    spec.validate().map_err(invalid)?;
    if spec.gymnasium_env().is_some() {
        return generate_gym(spec, progress);
    }
    let procedure = procedure_of(spec)?;
    let mut policy: Box<dyn BehaviourPolicy> = match &spec.behaviour {
        ContinuousBehaviour::Random => {
            let env = user_env(&spec.env, spec.seed, BEHAVIOUR_USER)?;
            let fedrl_sim::Space::Box { low, high } = env.action_space() else {
                return Err(invalid(format!("{}: actions are not a box", spec.env)));
            };
            Box::new(RandomPolicy {
                low: low.clone(),
                high: high.clone(),
            })
        }
        ContinuousBehaviour::SacCheckpoints {
            steps,
            checkpoints,
            noise_std,
        } => Box::new(SacCheckpoints::learn(
            &spec.env,
            *steps,
            *checkpoints,
            *noise_std,
            spec.seed,
            progress,
        )?),
    };
    record(
        &spec.env,
        spec.units + spec.public,
        spec.seed,
        policy.as_mut(),
        procedure,
        progress,
    )
}

/// The procedure a dataset of `spec` records: its data identity (a Gymnasium table without the
/// interpreter, worker count and deadlines; fedrl's own environments' specs as they are).
fn procedure_of(spec: &ContinuousDatasetSpec) -> Result<serde_json::Value> {
    serde_json::to_value(spec.data_identity()).map_err(|e| invalid(format!("dataset spec: {e}")))
}

/// Generates a `gymnasium:<id>` dataset through the bridge: the workers of
/// `[task.dataset.gymnasium]` (their spaces checked against `obs_dim` and `act_dim` at
/// start), unit `u` playing in its user's environment (the drawn `user_kwargs` for user `u`,
/// population seed `spec.seed`), the `sac_checkpoints` behaviour learning in the default
/// environment (`kwargs` only) as user [`BEHAVIOUR_USER`]. A missing interpreter is refused
/// naming the install script; a worker fault fails the generation with its reason (a dataset
/// with a unit missing would be another dataset under the same key).
pub fn generate_gym(
    spec: &ContinuousDatasetSpec,
    progress: &mut dyn FnMut(ContinuousProgress),
) -> Result<ContinuousDataset> {
    use fedrl_sim::gym_bridge::{DeclaredAction, DeclaredSpaces};
    spec.validate().map_err(invalid)?;
    let Some((id, g)) = spec.gymnasium_env() else {
        return Err(invalid(format!(
            "{:?} is not a gymnasium:<id> dataset",
            spec.env
        )));
    };
    let procedure = procedure_of(spec)?;
    let mut pool = super::gym::start_declared(
        super::gym::bridge_config(id, g.bridge(), spec.seed),
        DeclaredSpaces {
            obs_dim: g.obs_dim,
            action: DeclaredAction::Box { dim: g.act_dim },
        },
    )?;
    let mut policy: Box<dyn BehaviourPolicy> = match &spec.behaviour {
        ContinuousBehaviour::Random => {
            let fedrl_sim::Space::Box { low, high } = pool.action_space() else {
                return Err(invalid(format!("{}: actions are not a box", spec.env)));
            };
            Box::new(RandomPolicy {
                low: low.clone(),
                high: high.clone(),
            })
        }
        ContinuousBehaviour::SacCheckpoints {
            steps,
            checkpoints,
            noise_std,
        } => {
            let mut env = super::gym::make_envs(
                &mut pool,
                &[BEHAVIOUR_USER],
                std::slice::from_ref(&g.kwargs),
            )?
            .pop()
            .ok_or_else(|| invalid("no environment for the behaviour's learning run"))?;
            Box::new(SacCheckpoints::learn_in(
                env.as_mut(),
                &spec.env,
                *steps,
                *checkpoints,
                *noise_std,
                spec.seed,
                progress,
            )?)
        }
    };
    record_in(
        RecordEnvs::Gym(&mut pool),
        &spec.env,
        spec.units + spec.public,
        spec.seed,
        policy.as_mut(),
        procedure,
        progress,
    )
}

/// Writes `bytes` to `path` through a fsynced temporary file renamed into place.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The sidecar holding the SHA-256 (hex) of the stored dataset `path`: `<path>.sha256`.
pub fn content_path(path: &Path) -> std::path::PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".sha256");
    p.into()
}

/// Checks the stored dataset `path` against the SHA-256 recorded beside it at generation
/// ([`content_path`]); reads the file once. `Ok(false)` when nothing was recorded (a file
/// stored before digests were); a mismatch is an error naming the file and what to do.
pub fn verify_content(path: &Path) -> Result<bool> {
    let sidecar = content_path(path);
    let want = match std::fs::read_to_string(&sidecar) {
        Ok(t) => t.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(invalid(format!("{}: {e}", sidecar.display()))),
    };
    let got =
        super::cache::sha256_file(path).map_err(|e| invalid(format!("{}: {e}", path.display())))?;
    if got != want {
        return Err(invalid(format!(
            "{}: its SHA-256 is {got}, but {want} was recorded at generation (in {}): the file \
             changed on disk; delete both to generate it again",
            path.display(),
            sidecar.display()
        )));
    }
    Ok(true)
}

/// [`verify_content`] of a dataset about to be used: a file without a recorded digest is used
/// with a warning (it predates them).
fn check_content(path: &Path) -> Result<()> {
    if !verify_content(path)? {
        tracing::warn!(
            path = %path.display(),
            "no content digest recorded beside this dataset (stored before digests were): its \
             bytes cannot be checked"
        );
    }
    Ok(())
}

/// Loads the dataset of `spec` from `root/continuous/`, or generates and stores it atomically.
/// A stored file whose recorded procedure differs from `spec` is an error, never reused.
pub fn load_or_generate(
    spec: &ContinuousDatasetSpec,
    root: &Path,
    progress: &mut dyn FnMut(ContinuousProgress),
) -> Result<ContinuousDataset> {
    load_or_generate_units(spec, root, progress, &|_| true)
}

/// [`load_or_generate`] keeping only the episodes of the units `keep` accepts: a stored file is
/// read for those episodes alone ([`ContinuousDataset::load_units`]); a missing one is
/// generated and stored whole, then filtered.
pub fn load_or_generate_units(
    spec: &ContinuousDatasetSpec,
    root: &Path,
    progress: &mut dyn FnMut(ContinuousProgress),
    keep: &dyn Fn(u64) -> bool,
) -> Result<ContinuousDataset> {
    let path = root.join("continuous").join(spec.file_name());
    if path.is_file() {
        check_content(&path)?;
        let ds = ContinuousDataset::load_units(&path, keep)?;
        check_procedure(spec, &path, &ds.meta)?;
        return Ok(ds);
    }
    let mut ds = generate_and_save(spec, &path, progress)?;
    ds.episodes.retain(|e| keep(e.unit));
    Ok(ds)
}

/// Where the continuous dataset named `name` (`continuous/<file>`, as `fedrl data list` shows
/// it) lives under `root`, whether or not it exists; `None` for any other name (one that could
/// leave `root/continuous`).
pub fn named_file(root: &Path, name: &str) -> Option<std::path::PathBuf> {
    let file = name
        .strip_prefix("continuous/")
        .filter(|f| !f.is_empty() && !f.contains(['/', '\\']) && !f.starts_with('.'))?;
    Some(root.join("continuous").join(format!("{file}.safetensors")))
}

/// The file of the stored continuous dataset `name` under `root` ([`named_file`]), which must
/// exist.
pub fn stored_path(root: &Path, name: &str) -> Result<std::path::PathBuf> {
    let path = named_file(root, name).ok_or_else(|| {
        invalid(format!(
            "task.dataset.name: {name:?} is not a continuous dataset's name (`continuous/<name>`, as `fedrl data list` shows it)"
        ))
    })?;
    if !path.is_file() {
        return Err(invalid(format!(
            "task.dataset.name: no continuous dataset {name:?} under {} (`fedrl data list` shows what is there; `fedrl data import` brings a Box-action Minari dataset in)",
            root.display()
        )));
    }
    Ok(path)
}

/// The private units and the public split of a stored dataset of `episodes` episodes whose
/// last `public` are public: the count of private units (the first episodes, one unit each).
fn stored_private_units(name: &str, episodes: u64, public: u64) -> Result<u64> {
    if public >= episodes {
        return Err(invalid(format!(
            "task.dataset.public = {public}: dataset {name:?} has too few episodes for a public split of that size and at least one private unit"
        )));
    }
    Ok(episodes - public)
}

/// The environment `source`'s policies run in: the scenario's (a generation spec's `env`, a
/// stored dataset's `env`), else the one the stored dataset records (read from its header).
pub fn source_env(source: &ContinuousSource, root: &Path) -> Result<String> {
    match (source.env(), source) {
        (Some(e), _) => Ok(e.to_string()),
        (None, ContinuousSource::Stored(s)) => {
            let h = ContinuousDataset::read_header(&stored_path(root, &s.name)?)?;
            Ok(h.meta.env_id)
        }
        (None, ContinuousSource::Generated(g)) => Ok(g.env.clone()),
    }
}

/// The dataset of `source` with its private units numbered `0..private_units` and the public
/// split from `private_units` on (as a generation spec numbers them), keeping the public split
/// and the private units `keep` accepts; returns it with `private_units`. A generation spec's
/// dataset is generated if missing ([`load_or_generate_units`]); a stored one is read from
/// `root/continuous/` after its content digest is checked, its last `public` episodes being the
/// public split
/// ([`fedrl_common::task::primorl::StoredContinuous`]).
pub fn load_source_units(
    source: &ContinuousSource,
    root: &Path,
    progress: &mut dyn FnMut(ContinuousProgress),
    keep: &dyn Fn(u64) -> bool,
) -> Result<(ContinuousDataset, u64)> {
    match source {
        ContinuousSource::Generated(spec) => {
            let private = spec.units;
            let ds = load_or_generate_units(spec, root, progress, &|u| u >= private || keep(u))?;
            Ok((ds, private))
        }
        ContinuousSource::Stored(s) => {
            let path = stored_path(root, &s.name)?;
            check_content(&path)?;
            let h = ContinuousDataset::read_header(&path)?;
            let private = stored_private_units(&s.name, h.episodes, s.public)?;
            let ds = ContinuousDataset::load_mapped(&path, &|i, _| {
                (i >= private || keep(i)).then_some(i)
            })?;
            Ok((ds, private))
        }
    }
}

/// [`prepare`] for either source: a stored dataset is found, its digest checked and its header
/// read (nothing generated), and its public split checked against its episode count. Returns
/// the header and the private unit count.
pub fn prepare_source(
    source: &ContinuousSource,
    root: &Path,
    progress: &mut dyn FnMut(ContinuousProgress),
) -> Result<(ContinuousHeader, u64)> {
    match source {
        ContinuousSource::Generated(spec) => Ok((prepare(spec, root, progress)?, spec.units)),
        ContinuousSource::Stored(s) => {
            let path = stored_path(root, &s.name)?;
            check_content(&path)?;
            let h = ContinuousDataset::read_header(&path)?;
            let private = stored_private_units(&s.name, h.episodes, s.public)?;
            Ok((h, private))
        }
    }
}

/// Makes sure the dataset of `spec` is stored under `root` (generating it if missing) and
/// returns its header. A stored one is checked against its recorded digest (one sequential
/// read) and its header, without parsing its arrays (hundreds of MB): `fedrl run` prepares the dataset before its processes load it.
pub fn prepare(
    spec: &ContinuousDatasetSpec,
    root: &Path,
    progress: &mut dyn FnMut(ContinuousProgress),
) -> Result<ContinuousHeader> {
    let path = root.join("continuous").join(spec.file_name());
    if path.is_file() {
        check_content(&path)?;
        let h = ContinuousDataset::read_header(&path)?;
        check_procedure(spec, &path, &h.meta)?;
        return Ok(h);
    }
    let ds = generate_and_save(spec, &path, progress)?;
    Ok(ContinuousHeader {
        episodes: ds.episodes.len() as u64,
        steps: ds.episodes.iter().map(|e| e.len() as u64).sum(),
        meta: ds.meta,
    })
}

/// A stored dataset must have been made by `spec`'s procedure (same file name, other settings
/// would be a hash collision or a tampered file).
fn check_procedure(spec: &ContinuousDatasetSpec, path: &Path, meta: &ContinuousMeta) -> Result<()> {
    let want = procedure_of(spec)?;
    if meta.procedure != want {
        return Err(invalid(format!(
            "{}: made by {}, expected {want}",
            path.display(),
            meta.procedure
        )));
    }
    Ok(())
}

fn generate_and_save(
    spec: &ContinuousDatasetSpec,
    path: &Path,
    progress: &mut dyn FnMut(ContinuousProgress),
) -> Result<ContinuousDataset> {
    let ds = generate(spec, progress)?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    ds.save(path)?;
    Ok(ds)
}

/// A Box-action Minari dataset imported into this format ([`import_minari`]).
#[derive(Clone, Debug)]
pub struct Imported {
    /// The stored file, `root/continuous/<name>.safetensors` (listed as `continuous/<name>`).
    pub path: std::path::PathBuf,
    pub dataset: ContinuousDataset,
    /// Episodes whose metadata named no unit: each became a unit of its own, numbered after
    /// the largest unit present, in episode order.
    pub units_assigned: usize,
}

/// The name a Minari dataset `id` is stored under in `root/continuous/`: the id with each `/`
/// replaced by `-` (a file name; `fedrl data list` shows `continuous/<name>`).
pub fn imported_name(id: &str) -> String {
    id.replace('/', "-")
}

/// Imports the Minari dataset folder `dir` (a 1-D float32 Box action space, parquet or arrow)
/// as a continuous dataset stored under `root/continuous/` by [`imported_name`] of `id`, with
/// its SHA-256 sidecar ([`ContinuousDataset::save`]). The environment is the one the dataset
/// records; the procedure says where it came from. An existing file of that name is an error,
/// never overwritten.
pub fn import_minari(dir: &Path, id: &str, root: &Path) -> Result<Imported> {
    super::minari::check_id(id).map_err(|e| invalid(e.to_string()))?;
    let (h, eps) = super::minari::read_box(dir).map_err(|e| invalid(e.to_string()))?;
    let act_dim = match h.action {
        super::minari::ActionSpace::Box(d) => d,
        ref other => return Err(invalid(format!("not a Box action space: {other}"))),
    };
    let mut next = eps.iter().filter_map(|e| e.unit).max().map_or(0, |u| u + 1);
    let mut units_assigned = 0;
    let episodes = eps
        .into_iter()
        .map(|e| {
            let unit = e.unit.unwrap_or_else(|| {
                units_assigned += 1;
                next += 1;
                next - 1
            });
            ContinuousEpisode {
                unit,
                observations: e.observations,
                actions: e.actions,
                rewards: e.rewards,
                terminated: e.terminated,
            }
        })
        .collect();
    let dataset = ContinuousDataset {
        meta: ContinuousMeta {
            env_id: h.env_id.clone(),
            obs_dim: h.obs_dim,
            act_dim,
            procedure: serde_json::json!({
                "imported_from": h.id,
                "minari_version": h.minari_version,
            }),
            spaces: None,
        },
        episodes,
    };
    let path = root
        .join("continuous")
        .join(format!("{}.safetensors", imported_name(id)));
    if path.exists() {
        return Err(invalid(format!(
            "{}: a continuous dataset with this name exists already",
            path.display()
        )));
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    dataset.save(&path)?;
    Ok(Imported {
        path,
        dataset,
        units_assigned,
    })
}
