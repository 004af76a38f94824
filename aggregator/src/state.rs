//! The state directory: file names and small durable-write helpers.
//!
//! | file | what |
//! | --- | --- |
//! | `cert.der`, `key.der` | the self-signed TLS identity (created on first start) |
//! | `enrolment.key` | the enrolment secret (hex, 32 bytes), created on first start |
//! | `ledger` | the privacy ledger (`fedrl_common::privacy::ledger`) |
//! | `checkpoint` | model, optimizer state, round counters, ledger position |
//! | `metrics.jsonl` | one JSON line per round (released or abandoned) |
//! | `address.json` | `{"addr", "fingerprint"}` once the server listens (for `fedrl run`) |
//! | `report.json` | written when the run ends |

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::Path;

use anyhow::Context;
use fedrl_common::protocol::auth::{SECRET_BYTES, from_hex, to_hex};
use ring::rand::{SecureRandom, SystemRandom};

pub const LEDGER_FILE: &str = fedrl_common::privacy::ledger::LEDGER_FILE_NAME;
pub const METRICS_FILE: &str = "metrics.jsonl";
pub const ADDRESS_FILE: &str = "address.json";
pub const REPORT_FILE: &str = "report.json";
pub const SECRET_FILE: &str = "enrolment.key";

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
