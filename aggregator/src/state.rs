//! The state directory: file names and small durable-write helpers.
//!
//! Public files are DP outputs (they may be published); operator-only files hold exact counts,
//! unit ids, secrets or logs (DESIGN §3, "What may be published"). [`FILES_GUIDE`] (written as
//! `FILES.md` into the directory) says the same to whoever opens it.
//!
//! | file | who | what |
//! | --- | --- | --- |
//! | `metrics.jsonl` | public | per round: round, status, epsilon, delta, evaluation of the released model, public training diagnostics (`diagnostics`: norms of the released update and of the model step, server step size), time |
//! | `tensorboard/events.out.tfevents.*` | public | the numbers of `metrics.jsonl`'s released lines as TensorBoard scalars, step = round (one file per aggregator process) |
//! | `d_stable/` | public | expert-level runs: the prefixes released by the DataRelease (Minari layout) |
//! | `eval-snapshots/` | public | runs evaluated in Gymnasium environments: the models released at evaluation rounds (`gymnasium:<id>` DPPG, `round-R`) or evaluation steps (offline CQL on a `gymnasium:<id>` dataset, `step-S`), kept for `fedrl run` (standalone: `fedrl eval --deferred`) to evaluate (the aggregator runs no Python) |
//! | `d_stable.json` | public | expert-level runs: the release's summary (the report's `selective` section), read back on resume |
//! | `report.json` | public | end of run: epsilon/delta (null for a non-private twin), accountant, noise source, the final evaluation of the released model (the scenario's name only: the configuration is the scenario file) |
//! | the model export (e.g. `policy.safetensors`) | public | the released model |
//! | `operator/metrics.jsonl` | operator | the same lines plus exact counts (offered, accepted, clipped, rejected) and `operator_diagnostics` (the accepted updates' norms before clipping, the clipped fraction, the central mode's training loss on the units' data) |
//! | `operator/report.json` | operator | the report plus exact counts (units, updates, bytes, buffers), the ledger head and the model's audits that read units' data (`model_audit`, e.g. PrivORL's membership inference) |
//! | `privacy.ledger` | operator | the privacy ledger (`fedrl_common::privacy::ledger`): unit ids of every round |
//! | `checkpoint` | operator | model, optimizer state, round counters, ledger position and head (entry count, last hash) |
//! | `cert.der`, `key.der` | operator (secret key) | the self-signed TLS identity (created on first start) |
//! | `enrolment.key` | operator (secret) | the enrolment secret (hex, 32 bytes), created on first start |
//! | `address.json` | operator | `{"addr", "fingerprint", "pid"}` once the server listens (for `fedrl run`) |
//! | `lock` | operator | locked by the running aggregator; holds its pid |

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use fedrl_common::protocol::auth::{SECRET_BYTES, from_hex, to_hex};
use ring::rand::{SecureRandom, SystemRandom};
use thiserror::Error;

pub const LEDGER_FILE: &str = fedrl_common::privacy::ledger::LEDGER_FILE_NAME;
pub const METRICS_FILE: &str = "metrics.jsonl";
/// Sub-directory of the TensorBoard event files (public).
pub const TENSORBOARD_DIR: &str = "tensorboard";
pub const ADDRESS_FILE: &str = "address.json";
pub const REPORT_FILE: &str = "report.json";
pub const SECRET_FILE: &str = "enrolment.key";
/// Sub-directory of the operator-only files (exact counts).
pub const OPERATOR_DIR: &str = "operator";
/// The guide to a directory's files.
pub const FILES_GUIDE_FILE: &str = "FILES.md";

/// `FILES.md` of a state directory: which file may be published and which is operator-only.
pub const FILES_GUIDE: &str = "\
# Files in this aggregator state directory

Public files are differentially private outputs: they may be published. Operator-only files hold
exact counts, unit ids, keys or logs: under Poisson sampling the units drawn each round (and how
many) must stay secret, because the privacy amplification relies on it. Do not publish them.

| file | who | what |
| --- | --- | --- |
| `metrics.jsonl` | public | per round: round, status, epsilon, delta, evaluation of the released model, public training diagnostics (`diagnostics`: norms of the released update and of the model step, server step size), time |
| `tensorboard/events.out.tfevents.*` | public | the numbers of `metrics.jsonl`'s released lines as TensorBoard scalars, step = round (one file per aggregator process) |
| `d_stable/` | public | expert-level runs: the prefixes released by the DataRelease (Minari layout) |
| `eval-snapshots/` | public | runs evaluated in Gymnasium environments: the models released at evaluation rounds (`gymnasium:<id>` DPPG, `round-R`) or evaluation steps (offline CQL on a `gymnasium:<id>` dataset, `step-S`), kept for `fedrl run` (or, for a standalone aggregator, `fedrl eval --deferred STATE_DIR --scenario FILE`) to evaluate (the aggregator runs no Python; their rows say `\"eval\": {\"deferred\": true}` until then) |
| `d_stable.json` | public | expert-level runs: the release's summary (the report's `selective` section) |
| `report.json` | public | end of run: epsilon/delta (null for a non-private twin), accountant, noise source, the final evaluation of the released model (the scenario's name only: the configuration is the scenario file) |
| model export (e.g. `policy.safetensors`) | public | the released model |
| `operator/metrics.jsonl` | operator | the same lines plus exact counts (offered, accepted, clipped, rejected) and `operator_diagnostics` (the accepted updates' norms before clipping, the clipped fraction, the central mode's training loss on the units' data) |
| `operator/report.json` | operator | the report plus exact counts (units, updates, bytes, buffers), the ledger head and the model's audits that read units' data (`model_audit`, e.g. PrivORL's membership inference) |
| `privacy.ledger` | operator | the privacy ledger: every released round and its unit ids |
| `checkpoint` | operator | model, optimizer state, round counters, ledger position and head (entry count, last hash) |
| `cert.der`, `key.der` | operator (secret key) | the aggregator's TLS identity |
| `enrolment.key` | operator (secret) | the enrolment secret clients' tokens derive from |
| `address.json` | operator | listening address, certificate fingerprint, pid |
| `lock` | operator | held by the running aggregator; holds its pid |
";

/// The training diagnostics section of `FILES.md` (this directory's and `fedrl run`'s): which
/// per-round diagnostic is public and which operator-only, by task kind (the same table as
/// `service::metrics`'s module doc).
pub const DIAGNOSTICS_GUIDE: &str = "\
## Training diagnostics, per released round

Public diagnostics (`diagnostics` and `eval` in `metrics.jsonl`, the CSV and TensorBoard) are
functions of the released noisy update, the model it produced, public settings and episodes the
server plays itself on held-out users: post-processing, no privacy cost. Operator-only ones
(`operator_diagnostics` in `operator/metrics.jsonl`) are statistics of the units' own updates or
data, exact and not noised: do not publish them. Clients send no losses (a client's loss is a
statistic of its units' data that the update does not release).

| kind (mode) | public | operator-only |
| --- | --- | --- |
| every kind | `update_norm` (L2 of the released noisy mean update), `step_norm` (of the change it made to the offered parameters), `param_norm` | `unit_norm_mean`, `unit_norm_max` (accepted updates before the server's clip), `clipped_fraction` |
| dppg | `server_lr`; on evaluated rounds `eval.eval_policy_entropy`, `eval.eval_value_rmse` (on the held-out evaluation episodes) | as every kind |
| offline_cql (federated, central) | `server_lr`, `dp_steps`, `free_steps` (Selective) | central mode: `train_loss` (mean CQL loss of the round's rows) |
| privorl (federated, central) | `server_lr` | central mode: `train_loss` (mean denoising loss of the round's rows) |
| primorl, loglinear, mean_estimation | the generic norms (`server_lr` for the last two) | as every kind |
";

/// Writes [`FILES_GUIDE`] and [`DIAGNOSTICS_GUIDE`] into a state directory.
pub fn write_files_guide(dir: &Path) -> anyhow::Result<()> {
    let guide = format!("{FILES_GUIDE}\n{DIAGNOSTICS_GUIDE}");
    write_atomic(&dir.join(FILES_GUIDE_FILE), guide.as_bytes())
}
/// Held locked (an exclusive advisory lock on the open file) by the one aggregator that uses the
/// directory; holds that aggregator's pid.
pub const LOCK_FILE: &str = "lock";

/// Why a state directory could not be taken.
#[derive(Debug, Error)]
pub enum StateLockError {
    /// Another process holds the lock: two aggregators on one directory would both append to
    /// the same ledger (round numbers 1, 1, 2, 2, ...) and under-report epsilon.
    #[error(
        "state directory {dir} is in use by another aggregator (pid {pid}, holding {lock}); one state directory serves one aggregator at a time"
    )]
    InUse {
        dir: PathBuf,
        lock: PathBuf,
        /// The holder's pid as it wrote it, or a note that it has not written it yet.
        pid: String,
    },
    #[error("locking state directory {dir}: {source}")]
    Io {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// An exclusive lock on a state directory, held until dropped. The operating system releases it
/// when the process ends in any way (`kill -9` included), so a crashed aggregator never leaves a
/// stale lock behind; the pid left in the file after that is only informative.
#[derive(Debug)]
pub struct StateLock {
    _file: File,
    path: PathBuf,
}

impl StateLock {
    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Takes the exclusive lock on `dir` (creating [`LOCK_FILE`]) and writes this process's pid
/// into it. Fails at once, without waiting, if another process holds it.
pub fn lock_state_dir(dir: &Path) -> Result<StateLock, StateLockError> {
    let path = dir.join(LOCK_FILE);
    let io = |source| StateLockError::Io {
        dir: dir.to_path_buf(),
        source,
    };
    // Not truncated on open: the holder's pid must stay readable for the error message.
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut text = String::new();
            file.read_to_string(&mut text).map_err(io)?;
            let pid = match text.trim() {
                "" => "unknown: it has not written its pid yet".to_string(),
                p => p.to_string(),
            };
            return Err(StateLockError::InUse {
                dir: dir.to_path_buf(),
                lock: path,
                pid,
            });
        }
        Err(TryLockError::Error(e)) => return Err(io(e)),
    }
    file.set_len(0).map_err(io)?;
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    writeln!(file, "{}", std::process::id()).map_err(io)?;
    file.flush().map_err(io)?;
    Ok(StateLock { _file: file, path })
}

/// Writes `bytes` to `path` atomically (temporary file, fsync, rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// Like [`write_atomic`], with mode 0600 for secrets.
pub fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut opts = OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// Loads the enrolment secret from `dir`, creating a random one on first start.
pub fn load_or_create_secret(dir: &Path) -> anyhow::Result<Vec<u8>> {
    let path = dir.join(SECRET_FILE);
    if path.exists() {
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let secret = from_hex(text.trim())
            .filter(|s| s.len() >= 16)
            .with_context(|| format!("{} must hold at least 16 bytes as hex", path.display()))?;
        return Ok(secret);
    }
    let mut secret = vec![0u8; SECRET_BYTES];
    SystemRandom::new()
        .fill(&mut secret)
        .map_err(|_| anyhow::anyhow!("the OS random source failed"))?;
    write_private(&path, to_hex(&secret).as_bytes())?;
    Ok(secret)
}

/// Writes a given secret (used by `fedrl run`, which issues the tokens itself).
pub fn store_secret(dir: &Path, secret: &[u8]) -> anyhow::Result<()> {
    write_private(&dir.join(SECRET_FILE), to_hex(secret).as_bytes())
}

/// A fresh random secret.
pub fn random_secret() -> anyhow::Result<Vec<u8>> {
    let mut secret = vec![0u8; SECRET_BYTES];
    SystemRandom::new()
        .fill(&mut secret)
        .map_err(|_| anyhow::anyhow!("the OS random source failed"))?;
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_one_directory_fails_and_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock_state_dir(dir.path()).unwrap();
        let pid = std::process::id().to_string();
        assert_eq!(fs::read_to_string(first.path()).unwrap().trim(), pid);
        // flock-style locks belong to the open file, so a second open in the same process
        // conflicts exactly as another process would.
        match lock_state_dir(dir.path()) {
            Err(StateLockError::InUse { dir: d, pid: p, .. }) => {
                assert_eq!(d, dir.path());
                assert_eq!(p, pid);
            }
            other => panic!("expected InUse, got {other:?}"),
        }
        let msg = lock_state_dir(dir.path()).unwrap_err().to_string();
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        assert!(msg.contains(&format!("pid {pid}")), "{msg}");
        // Released on drop: the directory can be taken again (a restart after the run ends).
        drop(first);
        let again = lock_state_dir(dir.path()).unwrap();
        assert_eq!(fs::read_to_string(again.path()).unwrap().trim(), pid);
    }
}
