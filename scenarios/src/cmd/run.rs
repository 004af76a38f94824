//! `fedrl run`: a whole deployment on this machine (aggregator + client agents over QUIC on
//! loopback, as separate processes). The orchestration lives in [`crate::deploy`].

use std::path::PathBuf;
use std::process::ExitCode;

use crate::cmd::UsageError;
use crate::deploy::{self, LocalRun};

#[derive(clap::Args)]
pub struct Args {
    /// Scenario file (TOML); default: the built-in mean-estimation scenario.
    pub scenario: Option<PathBuf>,
    /// Output directory (report.json, ledger, metrics.jsonl, logs); default runs/NAME-UNIXTIME.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Give up (and stop every process) after this many seconds.
    #[arg(long, default_value_t = 3600.0)]
    pub timeout: f64,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let run = LocalRun::prepare(args.scenario.as_deref(), args.out.as_deref())
        .map_err(|e| UsageError(format!("{e:#}")))?;
    let exe = std::env::current_exe()?;
    let result = deploy::run_local(&run, &exe, args.timeout, true)?;
    println!(
        "{}: {} rounds released, {} abandoned, epsilon {:.4} at delta {:e}{} ({:.1} s); results in {}",
        run.scenario.name,
        result.report["rounds_completed"],
        result.report["rounds_abandoned"],
        result.report["epsilon"].as_f64().unwrap_or(f64::NAN),
        result.report["delta"].as_f64().unwrap_or(f64::NAN),
        if run.scenario.seed.is_some() {
            ", SEEDED noise (not private)"
        } else {
            ""
        },
        result.report["wall_seconds"].as_f64().unwrap_or(f64::NAN),
        run.out_dir.display()
    );
    Ok(ExitCode::SUCCESS)
}
