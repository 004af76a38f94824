//! What one privacy-ledger append costs as the history grows (a 100,000-step DP-SGD run appends
//! one record per step), split into accounting and write+fsync, plus the time to open a long
//! ledger and its size on disk.
//!
//! `cargo bench -p fedrl-bench --bench ledger [-- --json] [-- --sizes 1000,10000,100000]
//! [-- --appends N]`. Each ledger holds `n` records `training_round(r, 256 units,
//! PoissonSampled(q = 256/4096, Gaussian(z = 1.0)))` (the shape of a DP-SGD run with 256 expected
//! units out of 4,096), written straight into the file format (frames as the ledger writes them,
//! one fsync at the end) so that building a long history does not take n fsyncs. The target
//! epsilon is large enough never to refuse. Then, per size:
//! - `open_s`: [`PrivacyLedger::open`] of the file (read, verify checksums, decode, index);
//! - `append`: `--appends` consecutive [`PrivacyLedger::append`]s of new records, each timed
//!   (what the aggregator pays per step: budget check, write, fsync);
//! - `check`: [`PrivacyLedger::check`] of a record not yet seen, each followed by its append
//!   (accounting alone, cold);
//! - `write_fsync`: one frame of the same size written and fsynced to a file beside the ledger
//!   (the I/O part of an append alone);
//! - `first_epsilon_s`: the first [`PrivacyLedger::epsilon`] after opening.
//!
//! Times are medians (and maxima) in milliseconds; this is a measurement, not a timed assertion.

use std::fs::File;
use std::hint::black_box;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::Instant;

use fedrl_common::privacy::ledger::{
    Entry, LedgerConfig, Participation, PrivacyLedger, RoundRecord, UnitKind,
};
use fedrl_common::privacy::noise::NoiseSource;
use fedrl_common::privacy::{Delta, SamplingRate};

const POPULATION: u64 = 4096;
const UNITS_PER_ROUND: u64 = 256;
const Z: f64 = 1.0;
const TARGET_EPSILON: f64 = 1e6;

fn rate() -> f64 {
    UNITS_PER_ROUND as f64 / POPULATION as f64
}

fn arg(name: &str) -> Option<String> {
    let argv: Vec<String> = std::env::args().collect();
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1))
        .cloned()
}

/// Record `round`: 256 distinct units (a window of the population that moves every round).
fn record(round: u64) -> RoundRecord {
    let units = (0..UNITS_PER_ROUND)
        .map(|i| (round * UNITS_PER_ROUND + i) % POPULATION)
        .collect();
    let mut r = RoundRecord::gaussian_round(
        round,
        units,
        Z,
        1.0,
        Some(rate()),
        UNITS_PER_ROUND as f64,
        NoiseSource::Os,
    );
    r.unix_time_s = 1.8e9 + round as f64;
    r
}

fn config() -> anyhow::Result<LedgerConfig> {
    Ok(LedgerConfig {
        target_epsilon: TARGET_EPSILON,
        delta: Delta::try_from(1e-5)?,
        unit_kind: UnitKind::Trajectory,
        participation: Participation::Sampled {
            rate: SamplingRate::try_from(rate())?,
        },
    })
}

/// One frame as the ledger writes it: magic, payload length (u32 LE), the first 8 bytes of
/// SHA-256(payload), the payload.
fn frame(payload: &[u8]) -> Vec<u8> {
    let digest = ring::digest::digest(&ring::digest::SHA256, payload);
    let mut f = Vec::with_capacity(16 + payload.len());
    f.extend_from_slice(b"FRL1");
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(&digest.as_ref()[..8]);
    f.extend_from_slice(payload);
    f
}

/// Creates the ledger through the library (header), then appends `n` record frames directly.
fn write_ledger(path: &Path, n: u64) -> anyhow::Result<()> {
    drop(PrivacyLedger::open(path, config()?)?);
    let file = std::fs::OpenOptions::new().append(true).open(path)?;
    let mut out = BufWriter::new(file);
    for r in 0..n {
        let payload = serde_json::to_vec(&Entry::Round(record(r)))?;
        out.write_all(&frame(&payload))?;
    }
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(())
}

fn median_max(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    let median = if v.len() % 2 == 1 {
        v[mid]
    } else {
        0.5 * (v[mid - 1] + v[mid])
    };
    (median, v.last().copied().unwrap_or(f64::NAN))
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

struct Row {
    records: u64,
    file_bytes: u64,
    open_s: f64,
    first_epsilon_s: f64,
    epsilon: f64,
    append_ms: (f64, f64),
    check_ms: (f64, f64),
    write_fsync_ms: (f64, f64),
}

fn measure(dir: &Path, n: u64, appends: u64) -> anyhow::Result<Row> {
    let path = dir.join(format!("ledger-{n}"));
    write_ledger(&path, n)?;
    let file_bytes = std::fs::metadata(&path)?.len();

    let t = Instant::now();
    let (mut ledger, recovery) = PrivacyLedger::open(&path, config()?)?;
    let open_s = t.elapsed().as_secs_f64();
    anyhow::ensure!(
        recovery.records as u64 == n,
        "read {} records",
        recovery.records
    );
    let t = Instant::now();
    let epsilon = ledger.epsilon()?;
    let first_epsilon_s = t.elapsed().as_secs_f64();

    let mut append = Vec::new();
    let mut round = n;
    for _ in 0..appends {
        let r = record(round);
        let t = Instant::now();
        ledger.append(black_box(r))?;
        append.push(ms(t));
        round += 1;
    }
    let mut check = Vec::new();
    for _ in 0..appends {
        let r = record(round);
        let t = Instant::now();
        ledger.check(black_box(&r))?;
        check.push(ms(t));
        ledger.append(r)?;
        round += 1;
    }
    // The I/O of an append alone: one frame of the same size, written and fsynced.
    let payload = serde_json::to_vec(&Entry::Round(record(round)))?;
    let bytes = frame(&payload);
    let mut io = Vec::new();
    let mut side = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("side-{n}")))?;
    for _ in 0..appends {
        let t = Instant::now();
        side.write_all(&bytes)?;
        side.sync_all()?;
        io.push(ms(t));
    }
    drop(ledger);
    std::fs::remove_file(&path)?;
    Ok(Row {
        records: n,
        file_bytes,
        open_s,
        first_epsilon_s,
        epsilon,
        append_ms: median_max(append),
        check_ms: median_max(check),
        write_fsync_ms: median_max(io),
    })
}

fn main() -> anyhow::Result<()> {
    let json = std::env::args().any(|a| a == "--json");
    let sizes: Vec<u64> = match arg("--sizes") {
        Some(s) => s
            .split(',')
            .map(|x| x.trim().parse::<u64>())
            .collect::<Result<_, _>>()?,
        None => vec![1_000, 10_000, 100_000],
    };
    let appends: u64 = match arg("--appends") {
        Some(s) => s.parse()?,
        None => 20,
    }
    .max(1);
    let dir = tempfile::tempdir()?;
    // Not a file we wrote above: a sibling in the same temporary directory, so the fsync goes
    // to the same file system as the ledger's.
    let _ = File::create(dir.path().join("probe"))?;
    if !json {
        println!(
            "ledger append cost, q = {}/{}, z = {Z}, {UNITS_PER_ROUND} units per record, \
             {appends} appends per size (median / max ms)",
            UNITS_PER_ROUND, POPULATION
        );
        println!(
            "| records | file MB | open s | first epsilon() s | epsilon | append ms | check ms \
             | write+fsync ms |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    }
    for n in sizes {
        let row = measure(dir.path(), n, appends)?;
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "records": row.records,
                    "file_bytes": row.file_bytes,
                    "open_s": row.open_s,
                    "first_epsilon_s": row.first_epsilon_s,
                    "epsilon": row.epsilon,
                    "appends": appends,
                    "append_ms_median": row.append_ms.0,
                    "append_ms_max": row.append_ms.1,
                    "check_ms_median": row.check_ms.0,
                    "check_ms_max": row.check_ms.1,
                    "write_fsync_ms_median": row.write_fsync_ms.0,
                    "write_fsync_ms_max": row.write_fsync_ms.1,
                })
            );
        } else {
            println!(
                "| {} | {:.1} | {:.3} | {:.3} | {:.4} | {:.3} / {:.3} | {:.3} / {:.3} | {:.3} / {:.3} |",
                row.records,
                row.file_bytes as f64 / 1e6,
                row.open_s,
                row.first_epsilon_s,
                row.epsilon,
                row.append_ms.0,
                row.append_ms.1,
                row.check_ms.0,
                row.check_ms.1,
                row.write_fsync_ms.0,
                row.write_fsync_ms.1,
            );
        }
    }
    Ok(())
}
