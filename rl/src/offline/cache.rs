//! The on-disk cache of generated datasets: a dataset is stored once under the Minari id of its
//! spec ([`DatasetSpec::minari_id`], which embeds [`DatasetSpec::cache_key`]) in a Minari root
//! (`root/<namespace>/<name>/data/`, so `MINARI_DATASETS_PATH=root` finds it), with the spec
//! beside it (`root/<namespace>/<name>/fedrl_spec.json`). A second request loads it instead of
//! generating it again.
//!
//! A [`Behaviour::Experts`] dataset keeps its experts' policies beside it
//! (`root/<namespace>/<name>/experts.safetensors`, [`super::experts::EXPERTS_FILE`]), written
//! inside the same temporary folder; a cached experts dataset without that file is an error
//! ([`CacheError::MissingExperts`]), never silently regenerated.
//!
//! A dataset is written into a temporary folder next to its final place (a name starting with
//! `.`, which Minari's listing and [`list`] skip) and renamed into place: a crash leaves at most
//! a stray temporary folder, never a half dataset under the real id.
//!
//! Integrity: the last file written into that folder is [`CONTENT_FILE`], the SHA-256 of every
//! other file (the parquet data, the metadata, the spec, the experts); a load from the cache
//! checks it once ([`verify_content`]), so bits flipped on disk are an error naming the file,
//! never silently trained on. Folders stored before this file existed load unchecked.
//!
//! A scenario can also name a stored dataset instead of a spec ([`DatasetSource::Stored`]):
//! [`load_stored_units`] finds it ([`stored_dir`]: a missing one is an error saying how to list
//! and import), checks its recorded sums, and maps its episodes to units as the scenario states
//! ([`minari::read_mapped`]); [`load_source_units`] takes either source.
//!
//! [`list`] never fails for one bad dataset: it lists the others and marks that one with its
//! problem ([`Listed::problem`]).

use std::path::{Path, PathBuf};

use fedrl_common::offline::{Behaviour, DatasetSource, DatasetSpec, StoredDataset};
use thiserror::Error;

use super::continuous::ContinuousDataset;
use super::dataset::Dataset;
use super::experts::{EXPERTS_FILE, generate_experts};
use super::generate::{Progress, generate};
use super::minari::{self, MinariError, WriteOptions};

/// The environment variable naming the dataset root when `--data-dir` is not given.
pub const DATA_DIR_ENV: &str = "FEDRL_DATA_DIR";

/// The file beside `data/` holding the generating spec (JSON).
pub const SPEC_FILE: &str = "fedrl_spec.json";

/// The file beside `data/` holding the SHA-256 of every other file of the dataset folder
/// (JSON: `{"sha256": {"relative/path": "hex", ...}}`), written last at generation.
pub const CONTENT_FILE: &str = "fedrl_content.json";

/// Errors of the cache.
#[derive(Debug, Error)]
pub enum CacheError {
    #[error(transparent)]
    Minari(#[from] MinariError),
    #[error("generating the dataset: {0}")]
    Generate(#[from] crate::NnError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path}: the cached dataset was made by a different spec ({found}); expected {expected}"
    )]
    SpecMismatch {
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error(
        "{path}: the cached experts dataset has no experts file (delete its folder to generate it \
         again)"
    )]
    MissingExperts { path: PathBuf },
    #[error("{message}")]
    Unreadable { path: PathBuf, message: String },
    #[error(
        "{path}: {problem}; the cached dataset is damaged (bits flipped on disk, or the file was edited or cut short). Delete its folder {dir} to generate it again"
    )]
    ContentMismatch {
        path: PathBuf,
        dir: PathBuf,
        problem: String,
    },
    #[error(
        "task.dataset.name: no dataset {name:?} under the data root {root} (see `fedrl data list`; bring one with `fedrl data import PATH --id {name}`)"
    )]
    NotStored { name: String, root: PathBuf },
    #[error(
        "task.dataset: dataset {name:?} holds Box (continuous) actions, in fedrl's continuous format; this task needs a discrete-action Minari dataset (PriMORL's continuous datasets cannot be named by a scenario yet)"
    )]
    Continuous { name: String },
    #[error("task.dataset: dataset {name:?}: {source}")]
    Stored {
        name: String,
        #[source]
        source: MinariError,
    },
    #[error(
        "no dataset root: pass --data-dir, set {DATA_DIR_ENV} or {MINARI_ENV}, or set HOME (for ~/.fedrl/datasets)"
    )]
    NoRoot,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Minari's own root variable: where `minari.load_dataset(id)` looks (else
/// `~/.minari/datasets`).
pub const MINARI_ENV: &str = "MINARI_DATASETS_PATH";

/// The dataset root: `explicit` (`--data-dir`) if given, else `$FEDRL_DATA_DIR`, else
/// `$MINARI_DATASETS_PATH` (so that fedrl and `minari.load_dataset` share a root without
/// further configuration), else `$HOME/.fedrl/datasets`.
pub fn data_root(explicit: Option<&Path>) -> Result<PathBuf, CacheError> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    for var in [DATA_DIR_ENV, MINARI_ENV] {
        if let Some(p) = std::env::var_os(var).filter(|p| !p.is_empty()) {
            return Ok(PathBuf::from(p));
        }
    }
    match std::env::var_os("HOME").filter(|p| !p.is_empty()) {
        Some(h) => Ok(PathBuf::from(h).join(".fedrl").join("datasets")),
        None => Err(CacheError::NoRoot),
    }
}

fn spec_to_json(spec: &DatasetSpec) -> Result<serde_json::Value, CacheError> {
    serde_json::to_value(spec)
        .map_err(|e| CacheError::Generate(crate::NnError::Invalid(format!("spec to JSON: {e}"))))
}

/// Minari's root as Minari resolves it: `$MINARI_DATASETS_PATH`, else `~/.minari/datasets`
/// (`None` without either).
pub fn minari_root() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(MINARI_ENV).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("HOME")
        .filter(|p| !p.is_empty())
        .map(|h| PathBuf::from(h).join(".minari").join("datasets"))
}

/// Whether the dataset was loaded from the cache or generated now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Cache,
    Generated,
}

/// Loads the dataset of `spec` from `root`, or generates it (reporting through `progress`),
/// stores it atomically and returns it. The stored spec must equal `spec` (a different spec
/// under the same id would be a hash collision or a tampered folder: an error, not a reuse).
pub fn load_or_generate(
    spec: &DatasetSpec,
    root: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<(Dataset, Source), CacheError> {
    load_or_generate_units(spec, root, progress, &|_| true)
}

/// [`load_or_generate`] keeping only the episodes of the units `keep` accepts: a cached dataset
/// decodes no other episode ([`minari::read_units`]); a generated one is generated and stored
/// whole, then filtered.
pub fn load_or_generate_units(
    spec: &DatasetSpec,
    root: &Path,
    progress: &mut dyn FnMut(Progress),
    keep: &dyn Fn(u64) -> bool,
) -> Result<(Dataset, Source), CacheError> {
    match prepare(spec, root, progress)? {
        Some(mut dataset) => {
            dataset.episodes.retain(|e| keep(e.unit));
            Ok((dataset, Source::Generated))
        }
        None => {
            let dir = minari::dataset_dir(root, &spec.minari_id())?;
            verify_content(&dir)?;
            Ok((minari::read_units(&dir, keep)?.dataset, Source::Cache))
        }
    }
}

/// The folder of the stored dataset `name` under `root`; [`CacheError::NotStored`] when there
/// is none (an invalid id is one).
pub fn stored_dir(root: &Path, name: &str) -> Result<PathBuf, CacheError> {
    let missing = || CacheError::NotStored {
        name: name.to_string(),
        root: root.to_path_buf(),
    };
    if super::continuous::named_file(root, name).is_some_and(|p| p.is_file()) {
        return Err(CacheError::Continuous {
            name: name.to_string(),
        });
    }
    let dir = minari::dataset_dir(root, name).map_err(|_| missing())?;
    if !dir.join("data").join("metadata.json").is_file() {
        return Err(missing());
    }
    Ok(dir)
}

/// Reads the stored dataset `stored` under `root` with its episodes mapped to units
/// ([`minari::read_mapped`]), keeping the units `keep` accepts; the folder's recorded SHA-256
/// sums are checked first ([`verify_content`]; `fedrl data import` and generation record them).
pub fn load_stored_units(
    stored: &StoredDataset,
    root: &Path,
    keep: &dyn Fn(u64) -> bool,
) -> Result<minari::MappedDataset, CacheError> {
    let dir = stored_dir(root, &stored.name)?;
    verify_content(&dir)?;
    minari::read_mapped(&dir, &stored.units, keep).map_err(|source| CacheError::Stored {
        name: stored.name.clone(),
        source,
    })
}

/// [`load_or_generate_units`] for either source: a generation spec's dataset (generated if
/// missing), or a stored dataset read with its unit mapping ([`load_stored_units`]).
pub fn load_source_units(
    source: &DatasetSource,
    root: &Path,
    progress: &mut dyn FnMut(Progress),
    keep: &dyn Fn(u64) -> bool,
) -> Result<(Dataset, Source), CacheError> {
    match source {
        DatasetSource::Generated(spec) => load_or_generate_units(spec, root, progress, keep),
        DatasetSource::Stored(s) => Ok((load_stored_units(s, root, keep)?.dataset, Source::Cache)),
    }
}

/// Makes sure the dataset of `spec` is stored under `root`: a cached one is checked against its
/// stored spec (and its experts file) without reading any episode, a missing one is generated
/// (reporting through `progress`) and stored atomically, and then returned (`None` when it was
/// cached). `fedrl run` prepares the dataset before the client agents each read their units.
pub fn prepare(
    spec: &DatasetSpec,
    root: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<Option<Dataset>, CacheError> {
    let id = spec.minari_id();
    let dir = minari::dataset_dir(root, &id)?;
    let spec_json = spec_to_json(spec)?;
    if dir.join("data").join("metadata.json").exists() {
        let spec_path = dir.join(SPEC_FILE);
        let text = std::fs::read_to_string(&spec_path).map_err(io_err(&spec_path))?;
        let stored: DatasetSpec =
            serde_json::from_str(&text).map_err(|e| CacheError::SpecMismatch {
                path: spec_path.clone(),
                found: format!("unreadable: {e}"),
                expected: spec_json.to_string(),
            })?;
        // The interpreter, workers and deadlines of a Gymnasium dataset do not change the data.
        if stored.data_identity() != spec.data_identity() {
            return Err(CacheError::SpecMismatch {
                path: spec_path,
                found: text,
                expected: spec_json.to_string(),
            });
        }
        if let Behaviour::Experts { .. } = spec.behaviour {
            let path = dir.join(EXPERTS_FILE);
            if !path.is_file() {
                return Err(CacheError::MissingExperts { path });
            }
        }
        return Ok(None);
    }
    let (dataset, experts) = match spec.behaviour {
        Behaviour::Experts { .. } => {
            let g = generate_experts(spec, progress)?;
            (g.dataset, Some(g.experts))
        }
        _ => (generate(spec, progress)?, None),
    };
    let stored = match &experts {
        Some(e) => store_with(&dataset, root, Some(spec), &|tmp| {
            Ok(e.save(&tmp.join(EXPERTS_FILE))?)
        }),
        None => store(&dataset, root, Some(spec)),
    };
    match stored {
        Ok(_) => Ok(Some(dataset)),
        // A concurrent run of the same spec stored it first: generation is deterministic, so
        // its copy equals ours.
        Err(CacheError::Minari(MinariError::Layout { .. }))
            if dir.join("data").join("metadata.json").is_file() =>
        {
            Ok(Some(dataset))
        }
        Err(e) => Err(e),
    }
}

/// Writes `dataset` under `root` at its id, atomically (temporary folder, then rename), with
/// `spec` beside it when given. Fails if a dataset with that id exists.
pub fn store(
    dataset: &Dataset,
    root: &Path,
    spec: Option<&DatasetSpec>,
) -> Result<PathBuf, CacheError> {
    store_with(dataset, root, spec, &|_| Ok(()))
}

/// [`store`] with `extra` writing more files into the temporary folder (given as its argument)
/// before the rename, e.g. a dataset's experts: they appear together with the data or not at
/// all.
pub fn store_with(
    dataset: &Dataset,
    root: &Path,
    spec: Option<&DatasetSpec>,
    extra: &dyn Fn(&Path) -> Result<(), CacheError>,
) -> Result<PathBuf, CacheError> {
    let dir = minari::dataset_dir(root, &dataset.id)?;
    if dir.exists() {
        return Err(CacheError::Minari(MinariError::Layout {
            path: dir,
            message: "a dataset with this id exists already".into(),
        }));
    }
    let parent = dir
        .parent()
        .ok_or_else(|| CacheError::NoRoot)?
        .to_path_buf();
    std::fs::create_dir_all(&parent).map_err(io_err(&parent))?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = parent.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        // A leftover of a crashed run of a process with the same id: never read, safe to drop.
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    let spec_json = spec.map(spec_to_json).transpose()?;
    let opts = WriteOptions {
        algorithm_name: spec.map(|s| algorithm_name(&s.behaviour)),
        description: spec.map(|s| {
            format!(
                "fedrl dataset: {} units x {} episodes in {} (population seed {}), seed {}",
                s.units, s.episodes_per_unit, s.env, s.population_seed, s.seed
            )
        }),
        spec: spec_json.clone(),
    };
    let written = (|| -> Result<(), CacheError> {
        minari::write(dataset, &tmp, &opts)?;
        if let Some(j) = &spec_json {
            let p = tmp.join(SPEC_FILE);
            let text = serde_json::to_string_pretty(j).map_err(|source| MinariError::Json {
                path: p.clone(),
                source,
            })?;
            std::fs::write(&p, text).map_err(io_err(&p))?;
        }
        extra(&tmp)?;
        write_content(&tmp)
    })();
    if let Err(e) = written {
        // Best effort: the temporary folder is invisible to readers either way.
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&tmp, &dir) {
        // Another process stored the same id meanwhile (rename never replaces a non-empty
        // folder): keep theirs, which is complete since it was renamed into place too.
        let _ = std::fs::remove_dir_all(&tmp);
        if dir.join("data").join("metadata.json").is_file() {
            return Err(CacheError::Minari(MinariError::Layout {
                path: dir,
                message: "a dataset with this id exists already (stored concurrently)".into(),
            }));
        }
        return Err(io_err(&dir)(e));
    }
    Ok(dir)
}

/// Every regular file under `dir` but [`CONTENT_FILE`], as sorted relative paths with `/`.
fn content_files(dir: &Path) -> Result<Vec<String>, CacheError> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(io_err(&d))? {
            let path = entry.map_err(io_err(&d))?.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(rel) = path.strip_prefix(dir) {
                let rel = rel.to_string_lossy().replace('\\', "/");
                if rel != CONTENT_FILE {
                    out.push(rel);
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

/// SHA-256 (hex) of the file at `path`, read in 1 MiB pieces.
pub(crate) fn sha256_file(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        ctx.update(&buf[..n]);
    }
    Ok(ctx
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Writes [`CONTENT_FILE`] into the dataset folder `dir`: the SHA-256 of every other file.
fn write_content(dir: &Path) -> Result<(), CacheError> {
    let mut sums = serde_json::Map::new();
    for rel in content_files(dir)? {
        let path = dir.join(&rel);
        sums.insert(rel, sha256_file(&path).map_err(io_err(&path))?.into());
    }
    let p = dir.join(CONTENT_FILE);
    let text =
        serde_json::to_string_pretty(&serde_json::json!({ "sha256": sums })).map_err(|source| {
            MinariError::Json {
                path: p.clone(),
                source,
            }
        })?;
    std::fs::write(&p, text).map_err(io_err(&p))
}

/// Checks every file of the dataset folder `dir` against the SHA-256 recorded at generation
/// ([`CONTENT_FILE`]): each recorded file must exist and match. Returns `false` when no sums
/// were recorded (a folder stored before they were, or imported). Reads every file once.
pub fn verify_content(dir: &Path) -> Result<bool, CacheError> {
    let p = dir.join(CONTENT_FILE);
    let text = match std::fs::read_to_string(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err(&p)(e)),
    };
    let mismatch = |path: PathBuf, problem: String| CacheError::ContentMismatch {
        path,
        dir: dir.to_path_buf(),
        problem,
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| mismatch(p.clone(), format!("unreadable: {e}")))?;
    let Some(sums) = v.get("sha256").and_then(|s| s.as_object()) else {
        return Err(mismatch(p, "no \"sha256\" table".into()));
    };
    for (rel, want) in sums {
        if rel.split('/').any(|c| c == ".." || c.is_empty()) {
            return Err(mismatch(p, format!("a path outside the folder: {rel:?}")));
        }
        let path = dir.join(rel);
        let got = match sha256_file(&path) {
            Ok(h) => h,
            Err(e) => return Err(mismatch(path, format!("cannot be read: {e}"))),
        };
        if Some(got.as_str()) != want.as_str() {
            return Err(mismatch(
                path,
                format!(
                    "its SHA-256 is {got}, but {want} was recorded at generation (in {CONTENT_FILE})"
                ),
            ));
        }
    }
    Ok(true)
}

/// One dataset found under a root.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Listed {
    /// Minari id (`namespace/name-vN`).
    pub id: String,
    pub path: PathBuf,
    pub total_episodes: u64,
    pub total_steps: u64,
    /// Whether fedrl generated it (a spec file lies beside it).
    pub generated: bool,
    /// Why it cannot be used as it is (unreadable metadata or header, a truncated file), when
    /// it cannot; its counts are then 0 or what its header claims.
    pub problem: Option<String>,
}

/// Every dataset under `root`, sorted by id: the Minari folders (holding `data/metadata.json`,
/// at any depth, skipping names that start with `.`) and the continuous-action datasets of
/// PriMORL (`root/continuous/<name>.safetensors`, listed as `continuous/<name>`). Reads only
/// the top-level metadata and the safetensors headers.
pub fn list(root: &Path) -> Result<Vec<Listed>, CacheError> {
    let mut out = Vec::new();
    if !root.exists() {
        return Ok(out);
    }
    let continuous = root.join("continuous");
    if continuous.is_dir() {
        for entry in std::fs::read_dir(&continuous).map_err(io_err(&continuous))? {
            let path = entry.map_err(io_err(&continuous))?.path();
            // A crashed writer leaves `<name>.safetensors.tmp`, never a partial `.safetensors`; the
            // digest sidecar is `<name>.safetensors.sha256`.
            if path.extension().is_none_or(|e| e != "safetensors") {
                continue;
            }
            let Some(stem) = path.file_stem().map(|s| s.to_string_lossy().into_owned()) else {
                continue;
            };
            // One damaged file is listed with its problem; the others are listed as usual.
            let (episodes, steps, problem) = match ContinuousDataset::read_header(&path) {
                Ok(h) => (h.episodes, h.steps, None),
                Err(e) => (0, 0, Some(e.to_string())),
            };
            out.push(Listed {
                id: format!("continuous/{stem}"),
                path,
                total_episodes: episodes,
                total_steps: steps,
                generated: true,
                problem,
            });
        }
    }
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let meta = d.join("data").join("metadata.json");
        if meta.is_file() {
            let rel = d
                .strip_prefix(root)
                .map(|p| p.to_string_lossy().replace('\\', "/"))
                .unwrap_or_default();
            let read = std::fs::read_to_string(&meta)
                .map_err(|e| format!("{}: {e}", meta.display()))
                .and_then(|text| {
                    serde_json::from_str::<serde_json::Value>(&text)
                        .map_err(|e| format!("{}: {e}", meta.display()))
                });
            let (v, problem) = match read {
                Ok(v) => (v, None),
                Err(e) => (serde_json::Value::Null, Some(e)),
            };
            out.push(Listed {
                id: v
                    .get("dataset_id")
                    .and_then(|x| x.as_str())
                    .map_or(rel, str::to_string),
                path: d.clone(),
                total_episodes: v
                    .get("total_episodes")
                    .and_then(|x| x.as_u64())
                    .unwrap_or(0),
                total_steps: v.get("total_steps").and_then(|x| x.as_u64()).unwrap_or(0),
                generated: d.join(SPEC_FILE).is_file(),
                problem,
            });
            continue;
        }
        for entry in std::fs::read_dir(&d).map_err(io_err(&d))? {
            let entry = entry.map_err(io_err(&d))?;
            let is_hidden = entry.file_name().to_string_lossy().starts_with('.');
            if !is_hidden && entry.path().is_dir() {
                stack.push(entry.path());
            }
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// Minari's `algorithm_name` of a generated dataset: the behaviour's kind as the scenario
/// writes it and its parameters, e.g. `fedrl ppo_mixed (checkpoints 4, epsilon 0.2, iterations
/// 60)` (not a Rust debug string).
pub fn algorithm_name(b: &fedrl_common::offline::Behaviour) -> String {
    let v = serde_json::to_value(b).unwrap_or_default();
    let kind = v["kind"].as_str().unwrap_or("unknown").to_string();
    let params: Vec<String> = v
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| k.as_str() != "kind")
                .map(|(k, x)| format!("{k} {}", x.as_str().map_or(x.to_string(), str::to_string)))
                .collect()
        })
        .unwrap_or_default();
    if params.is_empty() {
        format!("fedrl {kind}")
    } else {
        format!("fedrl {kind} ({})", params.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithm_name_is_the_behaviour_as_written() {
        let b: fedrl_common::offline::Behaviour =
            serde_json::from_value(serde_json::json!({"kind": "random"})).unwrap();
        assert_eq!(algorithm_name(&b), "fedrl random");
        let b: fedrl_common::offline::Behaviour =
            serde_json::from_value(serde_json::json!({"kind": "ppo_mixed"})).unwrap();
        let name = algorithm_name(&b);
        assert!(
            name.starts_with("fedrl ppo_mixed (") && name.contains("iterations 60"),
            "{name}"
        );
        assert!(!name.contains('{') && !name.contains("PpoMixed"), "{name}");
    }
}
