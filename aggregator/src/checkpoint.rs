//! Checkpoints: model (parameters + optimizer state), round counters and ledger position (record
//! count and head: [`CheckpointMeta::ledger_head`]), in one file written atomically (temporary
//! file, fsync, rename, fsync of the directory).
//!
//! File layout: `b"FRCK"`, u32 LE length of a JSON header ([`CheckpointMeta`]), the header, then
//! the model's tensors as raw little-endian f32. The header stores the SHA-256 of the tensor bytes.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use fedrl_common::privacy::ledger::LedgerHead;
use fedrl_common::protocol::auth::sha256_fingerprint;
use fedrl_common::protocol::codec::decode_f32s;
use fedrl_common::protocol::encode_payload;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use fedrl_tasks::server::ModelState;

const MAGIC: &[u8; 4] = b"FRCK";
/// File name inside the state directory.
pub const CHECKPOINT_FILE: &str = "checkpoint";

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("checkpoint {path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
}

/// What a checkpoint records besides the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// The last round attempted when the checkpoint was taken (released or abandoned).
    pub round: u64,
    pub rounds_completed: u64,
    pub rounds_abandoned: u64,
    /// Number of ledger records covered by this model (the ledger position).
    pub ledger_records: u64,
    /// The ledger's head when the checkpoint was taken (its entry count and the hash of its
    /// last frame): start-up refuses a ledger that no longer holds it (entries cut from its
    /// end). `None` in checkpoints written before ledgers were chained.
    #[serde(default)]
    pub ledger_head: Option<LedgerHead>,
    /// The model's own metadata.
    pub model_meta: serde_json::Value,
    /// Number of f32 in the tensor section.
    pub tensors: u64,
    /// SHA-256 (hex) of the tensor bytes.
    pub tensors_sha256: String,
}

/// Writes a checkpoint atomically into `dir`.
pub fn save(
    dir: &Path,
    mut meta: CheckpointMeta,
    state: &ModelState,
) -> Result<(), CheckpointError> {
    let path = dir.join(CHECKPOINT_FILE);
    let tmp = dir.join(format!("{CHECKPOINT_FILE}.tmp"));
    let io = |source| CheckpointError::Io {
        path: path.clone(),
        source,
    };
    let bytes = encode_payload(&state.tensors);
    meta.tensors = state.tensors.len() as u64;
    meta.tensors_sha256 = sha256_fingerprint(&bytes);
    meta.model_meta = state.meta.clone();
    let header = serde_json::to_vec(&meta).map_err(|e| io(std::io::Error::other(e)))?;
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(MAGIC)?;
        f.write_all(&(header.len() as u32).to_le_bytes())?;
        f.write_all(&header)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, &path)
    };
    if let Err(e) = write() {
        // A half-written temporary file is of no use to anyone (the previous checkpoint is
        // intact) and, on a full disk, takes the space a retry needs.
        let _ = fs::remove_file(&tmp);
        return Err(io(e));
    }
    File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    Ok(())
}

/// Loads the checkpoint in `dir`, if there is one.
pub fn load(dir: &Path) -> Result<Option<(CheckpointMeta, ModelState)>, CheckpointError> {
    let path = dir.join(CHECKPOINT_FILE);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(CheckpointError::Io { path, source }),
    };
    decode(&path, &bytes).map(Some)
}

/// The metadata of the checkpoint in `dir`, if there is one (the whole file is read and
/// verified, the tensors are not decoded).
pub fn load_meta(dir: &Path) -> Result<Option<CheckpointMeta>, CheckpointError> {
    let path = dir.join(CHECKPOINT_FILE);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(CheckpointError::Io { path, source }),
    };
    verified_meta(&path, &bytes).map(|(meta, _)| Some(meta))
}

fn decode(path: &Path, bytes: &[u8]) -> Result<(CheckpointMeta, ModelState), CheckpointError> {
    let (meta, data) = verified_meta(path, bytes)?;
    let state = ModelState {
        meta: meta.model_meta.clone(),
        tensors: decode_f32s(data),
    };
    Ok((meta, state))
}

/// The header of a checkpoint file and its verified tensor bytes.
fn verified_meta<'a>(
    path: &Path,
    bytes: &'a [u8],
) -> Result<(CheckpointMeta, &'a [u8]), CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(corrupt("bad magic".into()));
    }
    let hlen = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize;
    let rest = &bytes[8..];
    if hlen > rest.len() {
        return Err(corrupt("truncated header".into()));
    }
    let meta: CheckpointMeta =
        serde_json::from_slice(&rest[..hlen]).map_err(|e| corrupt(format!("header: {e}")))?;
    let data = &rest[hlen..];
    if data.len() as u64 != meta.tensors * 4 || sha256_fingerprint(data) != meta.tensors_sha256 {
        return Err(corrupt(
            "tensor section does not match its length or checksum".into(),
        ));
    }
    Ok((meta, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_load_round_trip_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load(dir.path()).unwrap().is_none());
        let meta = CheckpointMeta {
            round: 7,
            rounds_completed: 6,
            rounds_abandoned: 1,
            ledger_records: 6,
            ledger_head: None,
            model_meta: serde_json::Value::Null,
            tensors: 0,
            tensors_sha256: String::new(),
        };
        let st = ModelState {
            meta: serde_json::json!({"m": 1}),
            tensors: vec![1.0, -2.0, 3.5],
        };
        save(dir.path(), meta, &st).unwrap();
        let (m, s) = load(dir.path()).unwrap().unwrap();
        assert_eq!(m.round, 7);
        assert_eq!(s, st);
        let p = dir.path().join(CHECKPOINT_FILE);
        let mut b = fs::read(&p).unwrap();
        let n = b.len();
        b[n - 1] ^= 1;
        fs::write(&p, b).unwrap();
        assert!(load(dir.path()).is_err());
    }

    #[test]
    fn a_failed_save_names_the_checkpoint_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        // The rename onto `checkpoint` fails (it is a non-empty directory), after the temporary
        // file was written in full: the failure the last step of a save can have.
        let path = dir.path().join(CHECKPOINT_FILE);
        fs::create_dir(&path).unwrap();
        fs::write(path.join("x"), b"x").unwrap();
        let meta = CheckpointMeta {
            round: 1,
            rounds_completed: 1,
            rounds_abandoned: 0,
            ledger_records: 1,
            ledger_head: None,
            model_meta: serde_json::Value::Null,
            tensors: 0,
            tensors_sha256: String::new(),
        };
        let st = ModelState {
            meta: serde_json::Value::Null,
            tensors: vec![1.0; 64],
        };
        let e = save(dir.path(), meta, &st).unwrap_err();
        assert!(
            e.to_string().contains(&path.display().to_string()),
            "the error names the checkpoint: {e}"
        );
        assert!(!dir.path().join(format!("{CHECKPOINT_FILE}.tmp")).exists());
    }
}
