//! Minari's on-disk layout with its Arrow/Parquet backend (minari 0.5.4,
//! `minari/dataset/_storages/arrow_storage.py` and `minari_storage.py`), read and written without
//! Python, so that `minari.load_dataset(id)` opens what fedrl writes and fedrl imports what
//! Minari writes.
//!
//! A dataset with id `ns/name-v0` under a root (`MINARI_DATASETS_PATH`) is the folder
//! `root/ns/name-v0/data/` holding:
//! - `metadata.json`: `total_episodes`, `total_steps`, `data_format` (`"parquet"`),
//!   `observation_space` and `action_space` (each a JSON *string* in Minari's serialisation,
//!   infinite bounds written as `Infinity` as Python's `json` does), `env_spec` (Gymnasium's
//!   `EnvSpec.to_json()`, only for environments Gymnasium knows), `dataset_id`,
//!   `minari_version`, and fedrl's own keys (`fedrl_env_id`, optional `fedrl_spec`);
//! - one folder per episode, `data/<episode id>/`, with `part-0.parquet` (pyarrow's
//!   `write_dataset` with directory partitioning on the episode id, which removes that column)
//!   and `metadata.json` (`{"id", "total_steps", ...}`).
//!
//! Every column of an episode's table has `steps + 1` rows: `observations` (a fixed-size list of
//! `obs_dim` float32), `actions` (int64, padded with a 0), `rewards` (float64), `terminations` and
//! `truncations` (bool), the last three padded with a zero row that Minari drops on reading.
//!
//! **Unit ids.** Minari's arrow storage keeps per-episode metadata in that episode's
//! `metadata.json` (`update_episode_metadata` merges keys into it), so the privacy unit owning an
//! episode rides along as the key `"unit"` there; Python reads it with
//! `dataset.storage.get_episode_metadata([i])`.
//!
//! **Stored datasets as a scenario's data.** [`read_mapped`] reads a dataset with its episodes
//! mapped to privacy units as the scenario states ([`UnitMap`]: one per episode, the stored
//! `unit`, or equal values of an episode metadata key such as an owner). Units are numbered by
//! the first appearance of their key in episode-id order, so every reader derives the same
//! numbers from the same files, and episodes with one key are always one unit (never split).
//!
//! **Box actions.** [`header`] reports the action space; [`read_box`] reads a 1-D float32 Box
//! dataset (Minari stores those actions as fixed-size lists of float32, padded like the rest),
//! which `fedrl data import` stores in fedrl's continuous format ([`super::continuous`]).

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{
    Array, ArrayRef, BooleanArray, FixedSizeListArray, Float32Array, Float64Array, Int32Array,
    Int64Array, RecordBatch,
};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use serde_json::{Map, Value, json};
use thiserror::Error;

use fedrl_common::offline::UnitMap;

use super::dataset::{Dataset, Episode};

/// The Minari release whose layout this module writes (it must be in the reader's
/// `supported_dataset_versions`).
pub const MINARI_VERSION: &str = "0.5.4";

/// The episode metadata key holding the owning privacy unit.
pub const UNIT_KEY: &str = "unit";

/// Errors reading or writing a Minari dataset. Every variant names the file at fault.
#[derive(Debug, Error)]
pub enum MinariError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: parquet: {source}")]
    Parquet {
        path: PathBuf,
        source: parquet::errors::ParquetError,
    },
    #[error("{path}: arrow: {source}")]
    Arrow {
        path: PathBuf,
        source: arrow_schema::ArrowError,
    },
    /// The files exist but do not describe a dataset fedrl can hold (missing keys, unsupported
    /// spaces, lengths that disagree).
    #[error("{path}: {message}")]
    Layout { path: PathBuf, message: String },
    /// A dataset id that is not `namespace/name-vN` with safe characters.
    #[error(
        "invalid dataset id {0:?}: expected namespace/name-vN (letters, digits, '_', '-', '.')"
    )]
    Id(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> MinariError + '_ {
    move |source| MinariError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(super) fn layout(path: &Path, message: impl Into<String>) -> MinariError {
    MinariError::Layout {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Checks a dataset id: one or more `/`-separated components of letters, digits, `_`, `-`, `.`,
/// none empty, `.` or `..`, the last ending in `-v<digits>` (Minari's naming rule).
pub fn check_id(id: &str) -> Result<(), MinariError> {
    let bad = || MinariError::Id(id.to_string());
    let parts: Vec<&str> = id.split('/').collect();
    for p in &parts {
        if p.is_empty()
            || *p == "."
            || *p == ".."
            || !p
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        {
            return Err(bad());
        }
    }
    let last = parts.last().ok_or_else(bad)?;
    match last.rsplit_once("-v") {
        Some((name, v)) if !name.is_empty() && !v.is_empty() => {
            if v.chars().all(|c| c.is_ascii_digit()) {
                Ok(())
            } else {
                Err(bad())
            }
        }
        _ => Err(bad()),
    }
}

/// The folder of dataset `id` under `root` (`root/<id>`, which holds `data/`), as Minari's
/// `get_dataset_path` computes it.
pub fn dataset_dir(root: &Path, id: &str) -> Result<PathBuf, MinariError> {
    check_id(id)?;
    Ok(root.join(id))
}

/// Gymnasium's `EnvSpec.to_json()` (gymnasium 1.0.0) of the environments whose fedrl simulator
/// matches Gymnasium's, so that `dataset.recover_environment()` and the peers can evaluate in
/// the real Gymnasium environment. Other environments get no `env_spec` (Minari then relies on
/// the stored spaces).
fn gymnasium_env_spec(env_id: &str) -> Option<&'static str> {
    match env_id {
        "CartPole-v1" => Some(
            r#"{"id": "CartPole-v1", "entry_point": "gymnasium.envs.classic_control.cartpole:CartPoleEnv", "reward_threshold": 475.0, "nondeterministic": false, "max_episode_steps": 500, "order_enforce": true, "disable_env_checker": false, "kwargs": {}, "additional_wrappers": [], "vector_entry_point": "gymnasium.envs.classic_control.cartpole:CartPoleVectorEnv"}"#,
        ),
        "Acrobot-v1" => Some(
            r#"{"id": "Acrobot-v1", "entry_point": "gymnasium.envs.classic_control.acrobot:AcrobotEnv", "reward_threshold": -100.0, "nondeterministic": false, "max_episode_steps": 500, "order_enforce": true, "disable_env_checker": false, "kwargs": {}, "additional_wrappers": [], "vector_entry_point": null}"#,
        ),
        _ => None,
    }
}

/// A float as Python's `json.dumps` writes it (`Infinity`, `-Infinity`, `NaN`; otherwise the
/// shortest round-trip decimal of the value as f64, as Python's `repr`).
fn py_float(x: f32) -> String {
    let x = f64::from(x);
    if x.is_nan() {
        "NaN".into()
    } else if x == f64::INFINITY {
        "Infinity".into()
    } else if x == f64::NEG_INFINITY {
        "-Infinity".into()
    } else if x.abs() >= 1e16 {
        // Rust's `Display` would print every digit of 3.4e38; JSON (and Python) take exponents.
        format!("{x:e}")
    } else if x.fract() == 0.0 {
        format!("{x:.1}")
    } else {
        format!("{x}")
    }
}

/// Minari's serialisation of `Box(low, high, (n,), float32)`.
fn box_space_json(low: &[f32], high: &[f32]) -> String {
    let list = |v: &[f32]| {
        v.iter()
            .map(|&x| py_float(x))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        r#"{{"type": "Box", "dtype": "float32", "shape": [{}], "low": [{}], "high": [{}]}}"#,
        low.len(),
        list(low),
        list(high)
    )
}

/// Minari's serialisation of `Discrete(n)`.
fn discrete_space_json(n: usize) -> String {
    format!(r#"{{"type": "Discrete", "dtype": "int64", "start": 0, "n": {n}}}"#)
}

/// The observation bounds written for a dataset: the simulator's when `env_id` names one with a
/// box of the right size, unbounded otherwise (Minari only needs the shape and dtype).
fn observation_bounds(d: &Dataset) -> (Vec<f32>, Vec<f32>) {
    if let Ok(env) = fedrl_sim::make(&d.env_id)
        && let fedrl_sim::Space::Box { low, high } = env.observation_space()
        && low.len() == d.obs_dim
    {
        return (low.clone(), high.clone());
    }
    (
        vec![f32::NEG_INFINITY; d.obs_dim],
        vec![f32::INFINITY; d.obs_dim],
    )
}

/// What [`write`] puts in `metadata.json` besides the layout's own keys.
#[derive(Clone, Debug, Default)]
pub struct WriteOptions {
    /// Minari's `algorithm_name` (e.g. the behaviour policy).
    pub algorithm_name: Option<String>,
    /// Minari's `description`.
    pub description: Option<String>,
    /// Extra keys stored verbatim under `fedrl_spec` (the generating spec).
    pub spec: Option<Value>,
}

fn episode_schema(obs_dim: usize) -> Result<Arc<Schema>, MinariError> {
    let obs_dim = i32::try_from(obs_dim).map_err(|_| MinariError::Layout {
        path: PathBuf::new(),
        message: format!("observation dimension {obs_dim} is too large"),
    })?;
    Ok(Arc::new(Schema::new(vec![
        Field::new(
            "observations",
            DataType::FixedSizeList(
                Arc::new(Field::new("element", DataType::Float32, true)),
                obs_dim,
            ),
            true,
        ),
        Field::new("actions", DataType::Int64, true),
        Field::new("rewards", DataType::Float64, true),
        Field::new("terminations", DataType::Boolean, true),
        Field::new("truncations", DataType::Boolean, true),
    ])))
}

/// Checks an episode's array lengths against `obs_dim`.
fn check_episode(e: &Episode, obs_dim: usize, path: &Path) -> Result<(), MinariError> {
    let n = e.len();
    if e.observations.len() != (n + 1) * obs_dim
        || e.rewards.len() != n
        || e.terminations.len() != n
        || e.truncations.len() != n
    {
        return Err(layout(
            path,
            format!(
                "episode {}: {} actions, {} rewards, {} terminations, {} truncations and {} \
                 observation values (expected {} = (steps + 1) x {obs_dim})",
                e.id,
                n,
                e.rewards.len(),
                e.terminations.len(),
                e.truncations.len(),
                e.observations.len(),
                (n + 1) * obs_dim
            ),
        ));
    }
    Ok(())
}

/// `v` with Minari's padding row appended (every column has steps + 1 rows).
fn pad<T>(mut v: Vec<T>, z: T) -> Vec<T> {
    v.push(z);
    v
}

fn write_json(path: &Path, v: &Value) -> Result<(), MinariError> {
    let text = serde_json::to_string(v).map_err(|source| MinariError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    fs::write(path, text).map_err(io_err(path))
}

/// Writes `d` into `dir` (the dataset folder, `root/<id>`; it must not hold a dataset yet) in
/// Minari's parquet layout. Not atomic by itself: the cache writes into a temporary folder and
/// renames it.
pub fn write(d: &Dataset, dir: &Path, opts: &WriteOptions) -> Result<(), MinariError> {
    check_id(&d.id)?;
    let data = dir.join("data");
    let meta_path = data.join("metadata.json");
    if meta_path.exists() {
        return Err(layout(&meta_path, "a dataset already exists here"));
    }
    fs::create_dir_all(&data).map_err(io_err(&data))?;
    let schema = episode_schema(d.obs_dim)?;
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let mut total_steps = 0u64;
    let mut seen = std::collections::BTreeSet::new();
    for e in &d.episodes {
        let ep_dir = data.join(e.id.to_string());
        check_episode(e, d.obs_dim, &ep_dir)?;
        if !seen.insert(e.id) {
            return Err(layout(
                &ep_dir,
                format!("episode id {} appears twice", e.id),
            ));
        }
        if let Some(&a) = e.actions.iter().find(|&&a| a as usize >= d.n_actions) {
            return Err(layout(
                &ep_dir,
                format!("action {a} outside Discrete({})", d.n_actions),
            ));
        }
        fs::create_dir_all(&ep_dir).map_err(io_err(&ep_dir))?;
        let n = e.len();
        let obs = FixedSizeListArray::try_new(
            Arc::new(Field::new("element", DataType::Float32, true)),
            d.obs_dim as i32,
            Arc::new(Float32Array::from(e.observations.clone())),
            None,
        )
        .map_err(|source| MinariError::Arrow {
            path: ep_dir.clone(),
            source,
        })?;
        let actions: Vec<i64> = pad(e.actions.iter().map(|&a| i64::from(a)).collect(), 0);
        let rewards: Vec<f64> = pad(e.rewards.iter().map(|&r| f64::from(r)).collect(), 0.0);
        let columns: Vec<ArrayRef> = vec![
            Arc::new(obs),
            Arc::new(Int64Array::from(actions)),
            Arc::new(Float64Array::from(rewards)),
            Arc::new(BooleanArray::from(pad(e.terminations.clone(), false))),
            // Written as "truncated and not terminated": a step that both ends the episode and
            // hits a time limit is a termination (d3rlpy's MDPDataset refuses an episode with
            // both flags; Minari and Gymnasium read it the same way).
            Arc::new(BooleanArray::from(pad(
                e.truncations
                    .iter()
                    .zip(&e.terminations)
                    .map(|(&tr, &te)| tr && !te)
                    .collect(),
                false,
            ))),
        ];
        let part = ep_dir.join("part-0.parquet");
        let batch =
            RecordBatch::try_new(schema.clone(), columns).map_err(|source| MinariError::Arrow {
                path: part.clone(),
                source,
            })?;
        let file = File::create(&part).map_err(io_err(&part))?;
        let pq = |source| MinariError::Parquet {
            path: part.clone(),
            source,
        };
        let mut w = ArrowWriter::try_new(file, schema.clone(), Some(props.clone())).map_err(pq)?;
        w.write(&batch).map_err(pq)?;
        w.close().map_err(pq)?;
        let mut em = Map::new();
        em.insert("id".into(), json!(e.id));
        em.insert("total_steps".into(), json!(n));
        em.insert(UNIT_KEY.into(), json!(e.unit));
        write_json(&ep_dir.join("metadata.json"), &Value::Object(em))?;
        total_steps += n as u64;
    }
    let (low, high) = observation_bounds(d);
    let mut m = Map::new();
    // Minari counts episodes as max id + 1 and reads ids 0..total_episodes.
    let total_episodes = d.episodes.iter().map(|e| e.id + 1).max().unwrap_or(0);
    if total_episodes != d.episodes.len() as u64 {
        return Err(layout(
            &data,
            format!(
                "episode ids must be 0..{} (Minari reads episodes by index), got {} episodes \
                 with ids up to {}",
                d.episodes.len(),
                d.episodes.len(),
                total_episodes.saturating_sub(1)
            ),
        ));
    }
    m.insert("total_episodes".into(), json!(total_episodes));
    m.insert("total_steps".into(), json!(total_steps));
    m.insert("data_format".into(), json!("parquet"));
    m.insert("jpeg_encoding".into(), json!(true));
    m.insert(
        "observation_space".into(),
        json!(box_space_json(&low, &high)),
    );
    m.insert(
        "action_space".into(),
        json!(discrete_space_json(d.n_actions)),
    );
    if let Some(spec) = gymnasium_env_spec(&d.env_id) {
        m.insert("env_spec".into(), json!(spec));
    }
    m.insert("dataset_id".into(), json!(d.id));
    m.insert("minari_version".into(), json!(MINARI_VERSION));
    m.insert("author".into(), json!(["fedrl"]));
    if let Some(a) = &opts.algorithm_name {
        m.insert("algorithm_name".into(), json!(a));
    }
    if let Some(s) = &opts.description {
        m.insert("description".into(), json!(s));
    }
    m.insert("fedrl_env_id".into(), json!(d.env_id));
    if let Some(spec) = &opts.spec {
        m.insert("fedrl_spec".into(), spec.clone());
    }
    write_json(&meta_path, &Value::Object(m))?;
    // Minari's namespace listing reads this file when present; an empty object is what
    // `create_namespace` writes without a description.
    if let Some((ns, _)) = d.id.rsplit_once('/') {
        let root = dir
            .ancestors()
            .nth(d.id.split('/').count())
            .map(Path::to_path_buf);
        if let Some(root) = root {
            let ns_file = root.join(ns).join("namespace_metadata.json");
            if !ns_file.exists() {
                write_json(&ns_file, &json!({}))?;
            }
        }
    }
    Ok(())
}

/// Which of Minari's columnar backends holds the episode tables (`data_format`): the same
/// tables, in parquet files or Arrow IPC files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StorageFormat {
    Parquet,
    Arrow,
}

/// A dataset read from disk and what had to be filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadDataset {
    pub dataset: Dataset,
    /// Episodes whose metadata named no unit: each became a unit of its own, with ids after the
    /// largest unit id present (0 when none), in episode order.
    pub units_assigned: usize,
    /// The `minari_version` that wrote the file (empty when absent).
    pub minari_version: String,
}

fn read_json(path: &Path) -> Result<Value, MinariError> {
    if !path.exists() {
        return Err(layout(path, "missing file"));
    }
    let text = fs::read_to_string(path).map_err(io_err(path))?;
    serde_json::from_str(&text).map_err(|source| MinariError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// Parses one of Minari's space strings. Python writes infinite bounds as bare `Infinity`
/// tokens, which JSON (and serde_json) lacks; only the bounds can hold them, and fedrl needs
/// only the shape, so they become `null` before parsing.
fn parse_space(text: &str, path: &Path, what: &str) -> Result<Value, MinariError> {
    let cleaned = text
        .replace("-Infinity", "null")
        .replace("Infinity", "null")
        .replace("NaN", "null");
    serde_json::from_str(&cleaned)
        .map_err(|source| MinariError::Json {
            path: path.to_path_buf(),
            source,
        })
        .and_then(|v: Value| {
            if v.is_object() {
                Ok(v)
            } else {
                Err(layout(path, format!("{what} is not an object")))
            }
        })
}

/// The spaces fedrl holds: a flat float32 Box and `Discrete(n)` starting at 0.
pub(super) fn read_spaces(meta: &Value, path: &Path) -> Result<(usize, usize), MinariError> {
    let get = |k: &str| {
        meta.get(k).and_then(Value::as_str).ok_or_else(|| {
            layout(
                path,
                format!("{k} is missing (fedrl needs the spaces stored in the metadata)"),
            )
        })
    };
    match parse_spaces(meta, path)? {
        (obs_dim, ActionSpace::Discrete(n)) => Ok((obs_dim, n)),
        _ => Err(layout(
            path,
            format!(
                "action_space must be Discrete(n) starting at 0, got {}",
                get("action_space")?
            ),
        )),
    }
}

/// An action space as a dataset's metadata declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ActionSpace {
    /// `Discrete(n)` starting at 0.
    Discrete(usize),
    /// A 1-D float32 `Box` of this many dimensions.
    Box(usize),
    /// Anything else, as Minari serialised it.
    Other(String),
}

impl std::fmt::Display for ActionSpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ActionSpace::Discrete(n) => write!(f, "Discrete({n})"),
            ActionSpace::Box(d) => write!(f, "a float32 Box of {d} dimensions"),
            ActionSpace::Other(s) => f.write_str(s),
        }
    }
}

/// The observation size (a flat float32 Box, required) and the action space of `meta`.
fn parse_spaces(meta: &Value, path: &Path) -> Result<(usize, ActionSpace), MinariError> {
    let get = |k: &str| {
        meta.get(k).and_then(Value::as_str).ok_or_else(|| {
            layout(
                path,
                format!("{k} is missing (fedrl needs the spaces stored in the metadata)"),
            )
        })
    };
    let obs = parse_space(get("observation_space")?, path, "observation_space")?;
    let act = parse_space(get("action_space")?, path, "action_space")?;
    let shape_of = |v: &Value| -> Option<Vec<u64>> {
        v.get("shape").and_then(|s| {
            s.as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
        })
    };
    let obs_dim = match (
        obs.get("type").and_then(Value::as_str),
        obs.get("dtype").and_then(Value::as_str),
        shape_of(&obs).as_deref(),
    ) {
        (Some("Box"), Some("float32"), Some([n])) if *n > 0 => *n as usize,
        _ => {
            return Err(layout(
                path,
                format!(
                    "observation_space must be a 1-D float32 Box, got {}",
                    get("observation_space")?
                ),
            ));
        }
    };
    let action = match (
        act.get("type").and_then(Value::as_str),
        act.get("start").and_then(Value::as_i64),
        act.get("n").and_then(Value::as_u64),
    ) {
        (Some("Discrete"), Some(0), Some(n)) if n > 0 => ActionSpace::Discrete(n as usize),
        _ => match (
            act.get("type").and_then(Value::as_str),
            act.get("dtype").and_then(Value::as_str),
            shape_of(&act).as_deref(),
        ) {
            (Some("Box"), Some("float32"), Some([n])) if *n > 0 => ActionSpace::Box(*n as usize),
            _ => ActionSpace::Other(get("action_space")?.to_string()),
        },
    };
    Ok((obs_dim, action))
}

/// The episode's data files: every file of its folder that pyarrow's dataset reader would
/// read (Minari ignores names starting with `_` or `.` and `metadata.json`), in name order.
fn part_files(ep_dir: &Path) -> Result<Vec<PathBuf>, MinariError> {
    if !ep_dir.is_dir() {
        return Err(layout(ep_dir, "missing episode folder"));
    }
    let mut parts = Vec::new();
    for entry in fs::read_dir(ep_dir).map_err(io_err(ep_dir))? {
        let entry = entry.map_err(io_err(ep_dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('_') || name.starts_with('.') || name == "metadata.json" {
            continue;
        }
        parts.push(entry.path());
    }
    parts.sort();
    if parts.is_empty() {
        return Err(layout(ep_dir, "no data file in the episode folder"));
    }
    Ok(parts)
}

fn column<'a>(b: &'a RecordBatch, name: &str, path: &Path) -> Result<&'a ArrayRef, MinariError> {
    b.column_by_name(name)
        .ok_or_else(|| layout(path, format!("column {name:?} is missing")))
}

fn no_nulls(a: &dyn Array, name: &str, path: &Path) -> Result<(), MinariError> {
    if a.null_count() > 0 {
        return Err(layout(path, format!("column {name:?} holds nulls")));
    }
    Ok(())
}

/// Rows of one episode file appended to the column buffers.
#[derive(Default)]
struct Columns {
    obs: Vec<f32>,
    /// Discrete actions; for a Box action space, one 0 per row (so its length counts rows).
    actions: Vec<i64>,
    /// Box actions, `act_dim` values per row (empty for a discrete space).
    box_actions: Vec<f32>,
    /// Size of a Box action; 0 for a discrete space.
    act_dim: usize,
    rewards: Vec<f64>,
    terminations: Vec<bool>,
    truncations: Vec<bool>,
}

fn append_batch(
    b: &RecordBatch,
    obs_dim: usize,
    out: &mut Columns,
    path: &Path,
) -> Result<(), MinariError> {
    let obs = column(b, "observations", path)?;
    no_nulls(obs.as_ref(), "observations", path)?;
    let list = obs
        .as_any()
        .downcast_ref::<FixedSizeListArray>()
        .ok_or_else(|| {
            layout(
                path,
                format!(
                    "observations are {}, expected fixed-size lists",
                    obs.data_type()
                ),
            )
        })?;
    if list.value_length() as usize != obs_dim {
        return Err(layout(
            path,
            format!(
                "observations have {} values per row, the observation space {obs_dim}",
                list.value_length()
            ),
        ));
    }
    let values = list.values();
    // arrow-rs slices a fixed-size list's child with the list, so the child starts at row 0.
    let len = list.len() * obs_dim;
    let vals = values
        .as_any()
        .downcast_ref::<Float32Array>()
        .ok_or_else(|| {
            layout(
                path,
                format!("observations hold {}, expected float32", values.data_type()),
            )
        })?;
    no_nulls(vals, "observations", path)?;
    if vals.len() < len {
        return Err(layout(path, "observation values shorter than their lists"));
    }
    out.obs.extend_from_slice(&vals.values()[..len]);

    let actions = column(b, "actions", path)?;
    no_nulls(actions.as_ref(), "actions", path)?;
    if out.act_dim > 0 {
        // Minari's encoding of a 1-D Box: a fixed-size list of float32 per row.
        let list = actions
            .as_any()
            .downcast_ref::<FixedSizeListArray>()
            .filter(|l| l.value_length() as usize == out.act_dim)
            .ok_or_else(|| {
                layout(
                    path,
                    format!(
                        "actions are {}, expected lists of {} float32 (the Box action space)",
                        actions.data_type(),
                        out.act_dim
                    ),
                )
            })?;
        let vals = list
            .values()
            .as_any()
            .downcast_ref::<Float32Array>()
            .ok_or_else(|| layout(path, "Box actions do not hold float32"))?;
        no_nulls(vals, "actions", path)?;
        let len = list.len() * out.act_dim;
        if vals.len() < len {
            return Err(layout(path, "action values shorter than their lists"));
        }
        out.box_actions.extend_from_slice(&vals.values()[..len]);
        out.actions.extend(std::iter::repeat_n(0, list.len()));
    } else if let Some(a) = actions.as_any().downcast_ref::<Int64Array>() {
        out.actions.extend_from_slice(a.values());
    } else if let Some(a) = actions.as_any().downcast_ref::<Int32Array>() {
        out.actions.extend(a.values().iter().map(|&x| i64::from(x)));
    } else {
        return Err(layout(
            path,
            format!(
                "actions are {}, expected int64 (a Discrete space)",
                actions.data_type()
            ),
        ));
    }

    let rewards = column(b, "rewards", path)?;
    // The padding row of `rewards` is a 0 from np.pad, never a null; nulls elsewhere are errors.
    no_nulls(rewards.as_ref(), "rewards", path)?;
    if let Some(r) = rewards.as_any().downcast_ref::<Float64Array>() {
        out.rewards.extend_from_slice(r.values());
    } else if let Some(r) = rewards.as_any().downcast_ref::<Float32Array>() {
        out.rewards.extend(r.values().iter().map(|&x| f64::from(x)));
    } else {
        return Err(layout(
            path,
            format!("rewards are {}, expected float64", rewards.data_type()),
        ));
    }

    for (name, dst) in [
        ("terminations", &mut out.terminations),
        ("truncations", &mut out.truncations),
    ] {
        let c = column(b, name, path)?;
        no_nulls(c.as_ref(), name, path)?;
        let c = c
            .as_any()
            .downcast_ref::<BooleanArray>()
            .ok_or_else(|| layout(path, format!("{name} are {}, expected bool", c.data_type())))?;
        dst.extend(c.iter().map(|v| v.unwrap_or(false)));
    }
    Ok(())
}

/// What an episode's `metadata.json` says: its unit (if any) and `total_steps` (if given).
fn episode_meta(data: &Path, id: u64) -> Result<(Option<u64>, Option<u64>), MinariError> {
    let meta_path = data.join(id.to_string()).join("metadata.json");
    let meta = read_json(&meta_path)?;
    // An absent or null key is None; anything but an unsigned integer is an error.
    let opt_u64 = |key: &str| match meta.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            layout(
                &meta_path,
                format!("{key} is {v}, expected an unsigned integer"),
            )
        }),
    };
    let (unit, total_steps) = (opt_u64(UNIT_KEY)?, opt_u64("total_steps")?);
    Ok((unit, total_steps))
}

/// The columns of episode `id` (`act_dim` 0: discrete actions, else a Box of that size), with
/// their row counts checked against each other and against `total_steps` when given. Returns
/// the columns and the number of steps (rows less Minari's padding row).
fn read_columns(
    data: &Path,
    format: StorageFormat,
    id: u64,
    obs_dim: usize,
    act_dim: usize,
    total_steps: Option<u64>,
) -> Result<(Columns, usize), MinariError> {
    let ep_dir = data.join(id.to_string());
    let mut cols = Columns {
        act_dim,
        ..Columns::default()
    };
    for part in part_files(&ep_dir)? {
        let file = File::open(&part).map_err(io_err(&part))?;
        let arrow = |source| MinariError::Arrow {
            path: part.clone(),
            source,
        };
        let batches: Box<dyn Iterator<Item = Result<RecordBatch, arrow_schema::ArrowError>>> =
            match format {
                StorageFormat::Parquet => {
                    let pq = |source| MinariError::Parquet {
                        path: part.clone(),
                        source,
                    };
                    Box::new(
                        ParquetRecordBatchReaderBuilder::try_new(file)
                            .map_err(pq)?
                            .build()
                            .map_err(pq)?,
                    )
                }
                // pyarrow's `write_dataset(format="arrow")`: the Arrow IPC file format.
                StorageFormat::Arrow => Box::new(
                    arrow_ipc::reader::FileReader::try_new(std::io::BufReader::new(file), None)
                        .map_err(arrow)?,
                ),
            };
        for batch in batches {
            append_batch(&batch.map_err(arrow)?, obs_dim, &mut cols, &part)?;
        }
    }
    let rows = cols.actions.len();
    if rows == 0 {
        return Err(layout(&ep_dir, "the episode has no rows"));
    }
    if cols.obs.len() != rows * obs_dim
        || cols.box_actions.len() != rows * act_dim
        || cols.rewards.len() != rows
        || cols.terminations.len() != rows
        || cols.truncations.len() != rows
    {
        return Err(layout(
            &ep_dir,
            "the episode's columns have different lengths",
        ));
    }
    let steps = rows - 1;
    if let Some(t) = total_steps
        && t != steps as u64
    {
        return Err(layout(
            &ep_dir.join("metadata.json"),
            format!("total_steps is {t} but the episode file has {steps} steps"),
        ));
    }
    if let Some(r) = cols.rewards[..steps].iter().find(|r| !r.is_finite()) {
        return Err(layout(&ep_dir, format!("non-finite reward {r}")));
    }
    if let Some(x) = cols.obs.iter().find(|x| !x.is_finite()) {
        return Err(layout(&ep_dir, format!("non-finite observation value {x}")));
    }
    if let Some(x) = cols.box_actions[..steps * act_dim]
        .iter()
        .find(|x| !x.is_finite())
    {
        return Err(layout(&ep_dir, format!("non-finite action value {x}")));
    }
    Ok((cols, steps))
}

/// Decodes episode `id` (its unit left at 0), checking it against its metadata's
/// `total_steps` when given.
fn read_episode(
    data: &Path,
    format: StorageFormat,
    id: u64,
    obs_dim: usize,
    n_actions: usize,
    total_steps: Option<u64>,
) -> Result<Episode, MinariError> {
    let ep_dir = data.join(id.to_string());
    let (mut cols, steps) = read_columns(data, format, id, obs_dim, 0, total_steps)?;
    let mut actions = Vec::with_capacity(steps);
    for &a in &cols.actions[..steps] {
        if a < 0 || a as u64 >= n_actions as u64 {
            return Err(layout(
                &ep_dir,
                format!("action {a} outside Discrete({n_actions})"),
            ));
        }
        actions.push(a as u32);
    }
    let mut rewards = Vec::with_capacity(steps);
    for &r in &cols.rewards[..steps] {
        if !r.is_finite() {
            return Err(layout(&ep_dir, format!("non-finite reward {r}")));
        }
        rewards.push(r as f32);
    }
    if let Some(x) = cols.obs.iter().find(|x| !x.is_finite()) {
        return Err(layout(&ep_dir, format!("non-finite observation value {x}")));
    }
    cols.terminations.truncate(steps);
    cols.truncations.truncate(steps);
    Ok(Episode {
        id,
        unit: 0,
        observations: cols.obs,
        actions,
        rewards,
        terminations: cols.terminations,
        truncations: cols.truncations,
    })
}

/// The episode and step counts that the dataset in `dir` declares in `data/metadata.json`
/// (nothing else is read).
pub fn totals(dir: &Path) -> Result<(u64, u64), MinariError> {
    let meta_path = dir.join("data").join("metadata.json");
    let meta = read_json(&meta_path)?;
    let get = |k: &str| {
        meta.get(k)
            .and_then(Value::as_u64)
            .ok_or_else(|| layout(&meta_path, format!("{k} is missing")))
    };
    Ok((get("total_episodes")?, get("total_steps")?))
}

/// Reads the dataset in `dir` (`root/<id>`, holding `data/`), written by fedrl or by Python
/// Minari with the parquet or the arrow backend, or the HDF5 one with the `hdf5` feature
/// ([`super::hdf5`]; without it, HDF5 gets an error naming the feature). Checks the
/// spaces (1-D float32 Box, Discrete from 0), the episode count and every episode's lengths
/// against the metadata, actions in range, finite values.
pub fn read(dir: &Path) -> Result<ReadDataset, MinariError> {
    read_units(dir, &|_| true)
}

/// What a dataset's `data/metadata.json` declares, read without any episode.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    /// `dataset_id`.
    pub id: String,
    /// Size of the flat float32 observation.
    pub obs_dim: usize,
    pub action: ActionSpace,
    pub total_episodes: u64,
    pub total_steps: u64,
    /// The environment the dataset records: fedrl's `fedrl_env_id`, else the id of Gymnasium's
    /// `env_spec`; empty when neither is stored.
    pub env_id: String,
    /// The `minari_version` that wrote the file (empty when absent).
    pub minari_version: String,
    /// The columnar backend; `None` for HDF5.
    format: Option<StorageFormat>,
}

impl Header {
    /// The columnar backend the episode readers here need; HDF5 is an error saying what to do
    /// (`what` says which reader).
    fn columnar(
        &self,
        meta_path: &Path,
        what: &str,
        fix: &str,
    ) -> Result<StorageFormat, MinariError> {
        self.format.ok_or_else(|| {
            layout(
                meta_path,
                format!(
                    "data_format is \"hdf5\": {what} reads Minari's \"parquet\" and \"arrow\" \
                     backends; {fix}"
                ),
            )
        })
    }
}

/// The counts, id, writer and environment of a dataset's `metadata.json` (`meta`, read from
/// `meta_path`), which every reader checks the same way.
pub(super) struct Fields {
    pub id: String,
    pub minari_version: String,
    pub total_episodes: u64,
    pub total_steps: u64,
    /// fedrl's `fedrl_env_id`, else the id of Gymnasium's `env_spec` (Minari stores the
    /// EnvSpec as a JSON string); empty when neither is stored.
    pub env_id: String,
}

pub(super) fn fields(meta: &Value, meta_path: &Path) -> Result<Fields, MinariError> {
    let text = |k: &str| meta.get(k).and_then(Value::as_str);
    let count = |k: &str| {
        meta.get(k)
            .and_then(Value::as_u64)
            .ok_or_else(|| layout(meta_path, format!("{k} is missing")))
    };
    let env_id = match (text("fedrl_env_id"), text("env_spec")) {
        (Some(e), _) => e.to_string(),
        (None, Some(spec)) => serde_json::from_str::<Value>(spec)
            .ok()
            .and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_string))
            .ok_or_else(|| layout(meta_path, "env_spec has no id"))?,
        (None, None) => String::new(),
    };
    Ok(Fields {
        id: text("dataset_id")
            .ok_or_else(|| layout(meta_path, "dataset_id is missing"))?
            .to_string(),
        minari_version: text("minari_version").unwrap_or("").to_string(),
        total_episodes: count("total_episodes")?,
        total_steps: count("total_steps")?,
        env_id,
    })
}

/// The episodes of the units `keep` accepts, given every episode's (unit, step count) metadata
/// in id order, and how many units were assigned here: an episode without a unit gets the next
/// id after the largest stored one. `read(i, total)` decodes episode `i`; an episode not kept
/// is decoded only when its metadata gives no step count. The steps must add up to
/// `total_steps` (a layout error at `meta_path` otherwise).
pub(super) fn kept_episodes(
    metas: Vec<(Option<u64>, Option<u64>)>,
    total_steps: u64,
    meta_path: &Path,
    keep: &dyn Fn(u64) -> bool,
    mut read: impl FnMut(u64, Option<u64>) -> Result<Episode, MinariError>,
) -> Result<(Vec<Episode>, usize), MinariError> {
    let mut next = metas.iter().filter_map(|m| m.0).max().map_or(0, |m| m + 1);
    let mut units_assigned = 0;
    let mut episodes = Vec::new();
    let mut steps = 0u64;
    for (i, (unit, total)) in (0u64..).zip(metas) {
        let unit = unit.unwrap_or_else(|| {
            units_assigned += 1;
            next += 1;
            next - 1
        });
        match (keep(unit), total) {
            // Saturating: a corrupt count then fails the total check instead of wrapping.
            (false, Some(t)) => steps = steps.saturating_add(t),
            (kept, _) => {
                let mut e = read(i, total)?;
                steps = steps.saturating_add(e.len() as u64);
                if kept {
                    e.unit = unit;
                    episodes.push(e);
                }
            }
        }
    }
    if steps != total_steps {
        return Err(layout(
            meta_path,
            format!("total_steps is {total_steps} but the episodes hold {steps} steps"),
        ));
    }
    Ok((episodes, units_assigned))
}

/// Reads `dir/data/metadata.json` (`dir` = `root/<id>`): the storage format (parquet, arrow
/// or HDF5), the spaces (a 1-D float32 Box observation; any action
/// space, reported in [`Header::action`]), the counts and the recorded environment.
pub fn header(dir: &Path) -> Result<Header, MinariError> {
    let data = dir.join("data");
    if !data.is_dir() {
        return Err(layout(
            dir,
            "not a Minari dataset folder: it has no data/ subfolder",
        ));
    }
    let meta_path = data.join("metadata.json");
    let meta = read_json(&meta_path)?;
    // HDF5 is named here, not refused: only the episode readers need the columnar backends
    // (`read` handles HDF5 its own way).
    let format = match meta.get("data_format").and_then(Value::as_str) {
        Some("parquet") => Some(StorageFormat::Parquet),
        Some("arrow") => Some(StorageFormat::Arrow),
        Some("hdf5") => None,
        other => {
            return Err(layout(
                &meta_path,
                format!(
                    "data_format is {}; fedrl reads Minari's \"parquet\", \"arrow\" and \"hdf5\" backends",
                    other.map_or_else(|| "missing".to_string(), |f| format!("{f:?}"))
                ),
            ));
        }
    };
    let (obs_dim, action) = parse_spaces(&meta, &meta_path)?;
    let Fields {
        id,
        minari_version,
        total_episodes,
        total_steps,
        env_id,
    } = fields(&meta, &meta_path)?;
    Ok(Header {
        id,
        obs_dim,
        action,
        total_episodes,
        total_steps,
        env_id,
        minari_version,
        format,
    })
}

/// [`read`], keeping only the episodes of the units `keep` accepts (a client agent hosting a
/// share of the units). Every episode's metadata is read, so units are assigned as [`read`]
/// assigns them; an episode not kept is decoded only if its metadata gives no `total_steps`
/// (the dataset's total is checked against the sum either way).
pub fn read_units(dir: &Path, keep: &dyn Fn(u64) -> bool) -> Result<ReadDataset, MinariError> {
    let data = dir.join("data");
    if !data.is_dir() {
        return Err(layout(
            dir,
            "not a Minari dataset folder: it has no data/ subfolder",
        ));
    }
    let meta_path = data.join("metadata.json");
    let meta = read_json(&meta_path)?;
    let format = match meta.get("data_format").and_then(Value::as_str) {
        Some("parquet") => StorageFormat::Parquet,
        Some("arrow") => StorageFormat::Arrow,
        #[cfg(feature = "hdf5")]
        Some("hdf5") => return super::hdf5::read_units(dir, &meta, &meta_path, keep),
        #[cfg(not(feature = "hdf5"))]
        Some("hdf5") => {
            return Err(layout(
                &meta_path,
                "data_format is \"hdf5\": this fedrl was built without its `hdf5` feature \
                 (it links the system HDF5 library): rebuild with `cargo build --release \
                 --features hdf5` (Debian: `apt-get install libhdf5-dev` first), or re-record \
                 the dataset with minari.DataCollector(env, data_format=\"parquet\"), or copy \
                 its episodes into one with minari.create_dataset_from_buffers(..., \
                 data_format=\"parquet\")",
            ));
        }
        other => {
            return Err(layout(
                &meta_path,
                format!(
                    "data_format is {}; fedrl reads Minari's \"parquet\" and \"arrow\" backends",
                    other.map_or_else(|| "missing".to_string(), |f| format!("{f:?}"))
                ),
            ));
        }
    };
    let (obs_dim, n_actions) = read_spaces(&meta, &meta_path)?;
    let Fields {
        id,
        minari_version,
        total_episodes,
        total_steps,
        env_id,
    } = fields(&meta, &meta_path)?;
    let mut metas = Vec::with_capacity(total_episodes as usize);
    for i in 0..total_episodes {
        metas.push(episode_meta(&data, i)?);
    }
    let (episodes, units_assigned) =
        kept_episodes(metas, total_steps, &meta_path, keep, |i, total| {
            read_episode(&data, format, i, obs_dim, n_actions, total)
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

/// A stored dataset read with its episodes mapped to privacy units ([`read_mapped`]).
#[derive(Clone, Debug, PartialEq)]
pub struct MappedDataset {
    /// The kept episodes, each with its unit (0-based, dense).
    pub dataset: Dataset,
    /// Units in the whole dataset (kept or not). Operator-only: an exact count.
    pub units: u64,
}

/// The key under which [`UnitMap`] groups an episode: equal keys, one unit. `None` for an
/// episode that is a unit of its own.
fn unit_key(map: &UnitMap, meta: &Value, meta_path: &Path) -> Result<Option<String>, MinariError> {
    match map {
        // Transition-level units are numbered by the task (PrivORL-n); episodes stay apart.
        UnitMap::Episode | UnitMap::Transition => Ok(None),
        UnitMap::Stored => match meta.get(UNIT_KEY) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|u| Some(u.to_string())).ok_or_else(|| {
                layout(
                    meta_path,
                    format!("{UNIT_KEY} is {v}, expected an unsigned integer"),
                )
            }),
        },
        UnitMap::MetadataKey(key) => match meta.get(key) {
            None | Some(Value::Null) => Err(layout(
                meta_path,
                format!(
                    "the episode has no {key:?} in its metadata, and units = {{ metadata_key = \
                     {key:?} }} needs it on every episode (an episode without an owner cannot \
                     be put in the right unit)"
                ),
            )),
            // A string and the number it spells are one owner: merging two spellings makes
            // a larger unit (more protection), splitting them would make an owner two units.
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Ok(Some(v.to_string())),
        },
    }
}

/// Reads the dataset in `dir` as [`read_units`] does, with episodes mapped to privacy units by
/// `map`: units are numbered 0, 1, ... in the order of their first episode (episodes in id
/// order), so the numbering is a function of the files alone and every reader (the aggregator,
/// each client agent) gets the same. `keep` sees those numbers. Episodes with equal keys are one
/// unit, never split; with [`UnitMap::Stored`] an episode without a stored unit is a unit of
/// its own.
pub fn read_mapped(
    dir: &Path,
    map: &UnitMap,
    keep: &dyn Fn(u64) -> bool,
) -> Result<MappedDataset, MinariError> {
    let h = header(dir)?;
    let data = dir.join("data");
    let meta_path = data.join("metadata.json");
    let format = h.columnar(
        &meta_path,
        "a scenario's stored dataset",
        "copy it into the data root with `fedrl data import PATH --id NEW_ID` (stored as \
         parquet) and name NEW_ID",
    )?;
    let n_actions = match &h.action {
        ActionSpace::Discrete(n) => *n,
        other => {
            return Err(layout(
                &meta_path,
                format!("action_space must be Discrete(n) starting at 0, got {other}"),
            ));
        }
    };
    let mut ids = std::collections::HashMap::<String, u64>::new();
    let mut units = 0u64;
    let mut episodes = Vec::new();
    let mut steps = 0u64;
    for i in 0..h.total_episodes {
        let ep_meta_path = data.join(i.to_string()).join("metadata.json");
        let meta = read_json(&ep_meta_path)?;
        let total = match meta.get("total_steps") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                layout(
                    &ep_meta_path,
                    format!("total_steps is {v}, expected an unsigned integer"),
                )
            })?),
        };
        let unit = match unit_key(map, &meta, &ep_meta_path)? {
            Some(k) => *ids.entry(k).or_insert_with(|| {
                units += 1;
                units - 1
            }),
            None => {
                units += 1;
                units - 1
            }
        };
        match (keep(unit), total) {
            (false, Some(t)) => steps = steps.saturating_add(t),
            (kept, _) => {
                let mut e = read_episode(&data, format, i, h.obs_dim, n_actions, total)?;
                steps = steps.saturating_add(e.len() as u64);
                if kept {
                    e.unit = unit;
                    episodes.push(e);
                }
            }
        }
    }
    if steps != h.total_steps {
        return Err(layout(
            &meta_path,
            format!(
                "total_steps is {} but the episodes hold {steps} steps",
                h.total_steps
            ),
        ));
    }
    Ok(MappedDataset {
        dataset: Dataset {
            id: h.id,
            env_id: h.env_id,
            obs_dim: h.obs_dim,
            n_actions,
            episodes,
        },
        units,
    })
}

/// Episode `id`'s metadata keys other than the ones fedrl writes itself (`id`, `total_steps`,
/// `unit`): e.g. an `owner` a data holder recorded, kept through `fedrl data import` so that a
/// scenario can map units by it.
pub fn extra_episode_metadata(dir: &Path, id: u64) -> Result<Map<String, Value>, MinariError> {
    let path = dir.join("data").join(id.to_string()).join("metadata.json");
    let mut m = match read_json(&path)? {
        Value::Object(m) => m,
        other => return Err(layout(&path, format!("not a JSON object: {other}"))),
    };
    for k in ["id", "total_steps", UNIT_KEY] {
        m.remove(k);
    }
    Ok(m)
}

/// Adds `extra` to episode `id`'s metadata in the dataset folder `dir` (keys already there are
/// kept: fedrl's own win).
pub fn add_episode_metadata(
    dir: &Path,
    id: u64,
    extra: &Map<String, Value>,
) -> Result<(), MinariError> {
    if extra.is_empty() {
        return Ok(());
    }
    let path = dir.join("data").join(id.to_string()).join("metadata.json");
    let mut m = match read_json(&path)? {
        Value::Object(m) => m,
        other => return Err(layout(&path, format!("not a JSON object: {other}"))),
    };
    for (k, v) in extra {
        m.entry(k.clone()).or_insert_with(|| v.clone());
    }
    write_json(&path, &Value::Object(m))
}

/// One episode of a Box-action dataset as Minari stores it ([`read_box`]).
#[derive(Clone, Debug, PartialEq)]
pub struct BoxEpisode {
    /// Episode id (its folder).
    pub id: u64,
    /// The unit stored with it (episode metadata `unit`), if any.
    pub unit: Option<u64>,
    /// `len + 1` rows of `obs_dim`.
    pub observations: Vec<f32>,
    /// `len` rows of `act_dim`.
    pub actions: Vec<f32>,
    pub rewards: Vec<f32>,
    /// Whether the last step terminated the episode (else a time limit cut it).
    pub terminated: bool,
}

/// Reads every episode of a dataset whose action space is a 1-D float32 Box, with the same
/// checks as [`read`] (episode count, lengths against the metadata, finite values). Returns
/// the header and the episodes in id order.
pub fn read_box(dir: &Path) -> Result<(Header, Vec<BoxEpisode>), MinariError> {
    let h = header(dir)?;
    let data = dir.join("data");
    let meta_path = data.join("metadata.json");
    let format = h.columnar(
        &meta_path,
        "the Box-action import",
        "re-record the dataset with minari.DataCollector(env, data_format=\"parquet\"), or \
         copy its episodes into one with minari.create_dataset_from_buffers(..., \
         data_format=\"parquet\")",
    )?;
    let act_dim = match h.action {
        ActionSpace::Box(d) => d,
        ref other => {
            return Err(layout(
                &meta_path,
                format!("action_space must be a 1-D float32 Box, got {other}"),
            ));
        }
    };
    let mut episodes = Vec::with_capacity(h.total_episodes as usize);
    let mut steps_sum = 0u64;
    for i in 0..h.total_episodes {
        let (unit, total) = episode_meta(&data, i)?;
        let (cols, steps) = read_columns(&data, format, i, h.obs_dim, act_dim, total)?;
        steps_sum = steps_sum.saturating_add(steps as u64);
        episodes.push(BoxEpisode {
            id: i,
            unit,
            observations: cols.obs,
            actions: cols.box_actions[..steps * act_dim].to_vec(),
            rewards: cols.rewards[..steps].iter().map(|&r| r as f32).collect(),
            terminated: steps > 0 && cols.terminations[steps - 1],
        });
    }
    if steps_sum != h.total_steps {
        return Err(layout(
            &meta_path,
            format!(
                "total_steps is {} but the episodes hold {steps_sum} steps",
                h.total_steps
            ),
        ));
    }
    Ok((h, episodes))
}
