//! A stored dataset (`[task.dataset] name = "..."`) as an offline task's data: where its
//! evaluation environment comes from and the checks made before any unit's data is read.
//!
//! Invariants:
//! - every reader (the scenario loader, `fedrl run`, the aggregator, each client agent) resolves
//!   a stored dataset from the same data root ([`fedrl_rl::offline::data_root`]) and maps its
//!   episodes to units by the same pure function of its files
//!   ([`fedrl_rl::offline::minari::read_mapped`]), so they agree on every unit;
//! - a refusal names the dataset and the scenario field at fault, and says what to do;
//! - nothing here prints or returns exact unit counts except [`check_units`]'s error to the
//!   operator who ran the command (the count is operator-only: DESIGN §3).

use std::path::PathBuf;

use fedrl_common::offline::{DatasetSource, StoredDataset, UnitMap};
use fedrl_common::task::TaskError;
use fedrl_rl::offline::cache::{self, CacheError};
use fedrl_rl::offline::minari::{self, ActionSpace, Header};

/// A stored dataset found under the data root, with the environment its policies are
/// evaluated in.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The dataset folder (`root/<name>`).
    pub dir: PathBuf,
    /// Its `metadata.json` as read (no episode).
    pub header: Header,
    /// The evaluation environment: the scenario's `task.dataset.env`, else the dataset's.
    pub env: String,
}

fn invalid(m: String) -> TaskError {
    TaskError::Invalid(m)
}

fn cache_error(e: CacheError) -> TaskError {
    invalid(e.to_string())
}

/// Finds `stored` under the data root and picks its evaluation environment: the scenario's
/// `env` when given, else the environment the dataset records, which must be one fedrl
/// simulates. Reads only the dataset's top-level metadata.
pub fn resolve(stored: &StoredDataset) -> Result<Resolved, TaskError> {
    let root = fedrl_rl::offline::data_root(None).map_err(cache_error)?;
    let dir = cache::stored_dir(&root, &stored.name).map_err(cache_error)?;
    let header = minari::header(&dir).map_err(|e| {
        invalid(format!(
            "task.dataset: dataset {:?} cannot be read: {e}",
            stored.name
        ))
    })?;
    let env = match &stored.env {
        Some(e) => e.clone(),
        None if header.env_id.is_empty() => {
            return Err(invalid(format!(
                "task.dataset.env: dataset {:?} records no environment; name the one its \
                 policies are evaluated in with task.dataset.env = \"...\" (see `fedrl sim list`)",
                stored.name
            )));
        }
        None => {
            if fedrl_sim::population::Population::new(&header.env_id, 0)
                .and_then(|p| p.user_env(0))
                .is_err()
            {
                return Err(invalid(format!(
                    "task.dataset.env: dataset {:?} records environment {:?}, which fedrl does \
                     not simulate; name the fedrl environment its policies are evaluated in with \
                     task.dataset.env = \"...\" (see `fedrl sim list`)",
                    stored.name, header.env_id
                )));
            }
            header.env_id.clone()
        }
    };
    Ok(Resolved { dir, header, env })
}

/// [`resolve`], except that a dataset absent from this machine's data root is `None` when the
/// scenario names its `env`: a federated aggregator never reads the units' data, so its
/// machine need not hold it (the client agents, which read it, check the spaces against the
/// network they are sent, and `fedrl run` checks everything up front).
pub fn resolve_if_present(stored: &StoredDataset) -> Result<Option<Resolved>, TaskError> {
    if stored.env.is_some() {
        let root = fedrl_rl::offline::data_root(None).map_err(cache_error)?;
        if cache::stored_dir(&root, &stored.name).is_err() {
            return Ok(None);
        }
    }
    resolve(stored).map(Some)
}

/// The environment and population seed an offline task evaluates in and builds its network
/// for: a generation spec's own, or a stored dataset's: the scenario's `env`, else the one the
/// dataset records ([`resolve`]; population seed 0).
pub fn source_env(source: &DatasetSource) -> Result<(String, u64), TaskError> {
    match source {
        DatasetSource::Generated(d) => Ok((d.env.clone(), d.population_seed)),
        DatasetSource::Stored(s) => match &s.env {
            Some(e) => Ok((e.clone(), 0)),
            None => Ok((resolve(s)?.env, 0)),
        },
    }
}

/// Checks that the stored dataset holds what a discrete-action task (`kind`) needs:
/// `Discrete(n_actions)` actions and observations of `obs_dim` values (the evaluation
/// environment's).
pub fn check_discrete(
    r: &Resolved,
    name: &str,
    kind: &str,
    obs_dim: usize,
    n_actions: usize,
) -> Result<(), TaskError> {
    match &r.header.action {
        ActionSpace::Discrete(n) if *n == n_actions => {}
        ActionSpace::Discrete(n) => {
            return Err(invalid(format!(
                "task.dataset: dataset {name:?} has Discrete({n}) actions, but its evaluation \
                 environment {:?} has {n_actions} (set task.dataset.env to the environment the \
                 data was recorded in)",
                r.env
            )));
        }
        other => {
            return Err(invalid(format!(
                "task.dataset: dataset {name:?} has {other} actions; task `{kind}` needs \
                 discrete actions (a continuous dataset is PriMORL's)"
            )));
        }
    }
    if r.header.obs_dim != obs_dim {
        return Err(invalid(format!(
            "task.dataset: dataset {name:?} has observations of {} values, but its evaluation \
             environment {:?} has {obs_dim} (set task.dataset.env to the environment the data was \
             recorded in)",
            r.header.obs_dim, r.env
        )));
    }
    Ok(())
}

/// Privacy units of the stored dataset under its mapping (reads every episode's metadata,
/// decodes no episode that records its length). Operator-only: an exact count.
pub fn unit_count(stored: &StoredDataset) -> Result<u64, TaskError> {
    let root = fedrl_rl::offline::data_root(None).map_err(cache_error)?;
    let dir = cache::stored_dir(&root, &stored.name).map_err(cache_error)?;
    minari::read_mapped(&dir, &stored.units, &|_| false)
        .map(|m| m.units)
        .map_err(|e| invalid(format!("task.dataset: dataset {:?}: {e}", stored.name)))
}

/// How `units` reads in a message.
pub fn describe(map: &UnitMap) -> String {
    match map {
        UnitMap::Episode => "units = \"episode\"".into(),
        UnitMap::Stored => "units = \"stored\"".into(),
        UnitMap::MetadataKey(k) => format!("units = {{ metadata_key = {k:?} }}"),
        UnitMap::Transition => "units = \"transition\"".into(),
    }
}

/// The scenario's `users` must equal the stored dataset's unit count under its mapping: the
/// DP-SGD batch's public denominator is `rate x users`, so the operator states the count
/// rather than having it derived (and written) from the data. The error gives the count to
/// the operator who ran the command only.
pub fn check_units(stored: &StoredDataset, users: u64) -> Result<u64, TaskError> {
    let units = unit_count(stored)?;
    if units != users {
        return Err(invalid(format!(
            "users ({users}) must equal the number of privacy units of dataset {:?} under {} \
             ({units}; an exact count: keep it out of anything you publish)",
            stored.name,
            describe(&stored.units)
        )));
    }
    Ok(units)
}

/// An expert-level scenario (`offline_cql` with `task.selective.release`) naming a stored
/// dataset: a DataRelease queries each expert's policy, which only a dataset generated by
/// fedrl's `experts` behaviour holds beside its episodes (`experts.safetensors`, with the
/// generation spec in `fedrl_spec.json`). Such a dataset named by its id runs as its generation
/// spec: the scenario's `[task.dataset]` is replaced by the recorded spec (the same data, read
/// from the cache and checked against the spec, the experts file and the SHA-256 sums as a
/// generated dataset is), so the release, the schedule and the experts line up by
/// construction. `Ok(None)`: nothing to replace (not such a scenario, or TOML the scenario
/// parser will report on); an error names the dataset and says why it cannot serve.
pub fn expand_expert_release(text: &str) -> Result<Option<String>, TaskError> {
    let Ok(mut doc) = text.parse::<toml::Table>() else {
        return Ok(None);
    };
    let Some(task) = doc.get_mut("task").and_then(toml::Value::as_table_mut) else {
        return Ok(None);
    };
    let releases = task.get("kind").and_then(toml::Value::as_str) == Some("offline_cql")
        && task
            .get("selective")
            .and_then(|s| s.get("release"))
            .is_some();
    let Some(dataset) = task.get("dataset").and_then(toml::Value::as_table) else {
        return Ok(None);
    };
    let Some(name) = dataset.get("name").and_then(toml::Value::as_str) else {
        return Ok(None);
    };
    if !releases {
        return Ok(None);
    }
    let name = name.to_string();
    match dataset.get("units").and_then(toml::Value::as_str) {
        None | Some("stored") => {}
        Some(_) => {
            return Err(invalid(format!(
                "task.dataset.units: a DataRelease pairs each unit with its expert's policy, so \
                 dataset {name:?} must be read with units = \"stored\" (the expert ids fedrl \
                 recorded)"
            )));
        }
    }
    let no_policies = |why: &str| {
        invalid(format!(
            "task.selective.release: a DataRelease queries the experts' policies, and dataset \
             {name:?} {why}; only a dataset generated by fedrl with behaviour = {{ kind = \
             \"experts\", ... }} holds them (experts.safetensors). Without a release, expert-level \
             DP-SGD runs on any dataset: remove task.selective.release"
        ))
    };
    let root = fedrl_rl::offline::data_root(None).map_err(cache_error)?;
    let dir = cache::stored_dir(&root, &name).map_err(cache_error)?;
    let spec_path = dir.join(cache::SPEC_FILE);
    let spec: fedrl_common::offline::DatasetSpec = match std::fs::read_to_string(&spec_path) {
        Ok(t) => serde_json::from_str(&t).map_err(|e| {
            invalid(format!(
                "{}: not a generation spec: {e}",
                spec_path.display()
            ))
        })?,
        Err(_) => return Err(no_policies("records no generation spec (fedrl_spec.json)")),
    };
    if !matches!(
        spec.behaviour,
        fedrl_common::offline::Behaviour::Experts { .. }
    ) {
        return Err(no_policies("was not generated by experts"));
    }
    if !dir.join(fedrl_rl::offline::experts::EXPERTS_FILE).is_file() {
        return Err(no_policies("has no experts file beside it"));
    }
    if spec.minari_id() != name {
        return Err(invalid(format!(
            "task.dataset.name: dataset {name:?} records the spec of {:?}; an experts dataset is \
             read under the id it was generated as",
            spec.minari_id()
        )));
    }
    if let Some(env) = dataset.get("env").and_then(toml::Value::as_str)
        && env != spec.env
    {
        return Err(invalid(format!(
            "task.dataset.env = {env:?}, but dataset {name:?} was generated in {:?}",
            spec.env
        )));
    }
    let table = toml::Value::try_from(&spec)
        .map_err(|e| invalid(format!("dataset {name:?}: its spec as TOML: {e}")))?;
    task.insert("dataset".into(), table);
    toml::to_string(&doc)
        .map(Some)
        .map_err(|e| invalid(format!("the scenario as TOML: {e}")))
}
