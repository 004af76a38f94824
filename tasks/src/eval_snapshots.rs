//! Released models kept in the aggregator's state directory for evaluations it cannot make
//! itself: a task whose evaluation environment is a Gymnasium one (`gymnasium:<id>` DPPG
//! populations, offline CQL on a `gymnasium:<id>` dataset) needs Python, which the aggregator
//! never starts (DESIGN §2.6). Its server model keeps each model it would have evaluated as a
//! file here and marks the evaluation `{"deferred": true}`; `fedrl run` (or, for a standalone
//! aggregator, `fedrl eval --deferred`) evaluates the files once the aggregator has ended
//! (`scenarios/src/deferred_eval.rs`). Each kind names its files ([`crate::dppg::held_out`]:
//! `round-R`, [`crate::offline_cql::server`]: `step-S`).
//!
//! Invariants: only released models are kept (DP outputs: the caller writes a model only after
//! the ledger record of the release that produced it is durable). A file is written to a
//! temporary name, synced and renamed, so a crash leaves either the whole snapshot or none.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Folder of the evaluation snapshots in the aggregator's state directory.
pub const SNAPSHOT_DIR: &str = "eval-snapshots";

/// Where the snapshot `name` (without extension) lives in the state directory `dir`.
pub fn path(dir: &Path, name: &str) -> PathBuf {
    dir.join(SNAPSHOT_DIR).join(format!("{name}.safetensors"))
}

/// Keeps the snapshot `name` in the state directory `dir`: `write` writes it to the path it is
/// given (a temporary file), which is then synced and renamed over any earlier file of that
/// name. Returns the snapshot's path.
pub fn keep(
    dir: &Path,
    name: &str,
    write: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<PathBuf> {
    let path = path(dir, name);
    let folder = dir.join(SNAPSHOT_DIR);
    std::fs::create_dir_all(&folder).with_context(|| format!("creating {}", folder.display()))?;
    let tmp = path.with_extension("safetensors.tmp");
    write(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("syncing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    // The rename itself is durable once the folder is synced.
    if let Ok(d) = std::fs::File::open(&folder) {
        let _ = d.sync_all();
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_snapshot_replaces_the_earlier_one_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = keep(dir.path(), "step-00000003", |t| {
            Ok(std::fs::write(t, b"one")?)
        })
        .unwrap();
        assert_eq!(p, path(dir.path(), "step-00000003"));
        keep(dir.path(), "step-00000003", |t| {
            Ok(std::fs::write(t, b"two")?)
        })
        .unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let files: Vec<_> = std::fs::read_dir(dir.path().join(SNAPSHOT_DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(files.len(), 1, "{files:?}");
        // A failed write keeps nothing under the snapshot's name.
        assert!(keep(dir.path(), "bad", |_| anyhow::bail!("disk full")).is_err());
        assert!(!path(dir.path(), "bad").exists());
    }
}
