//! `fedrl ledger DIR [--json]`: reads a privacy ledger and accounts it.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use fedrl_common::privacy::ledger::{LEDGER_FILE_NAME, PrivacyLedger};

use super::UsageError;

#[derive(clap::Args)]
pub struct Args {
    /// An output or state directory holding `privacy.ledger`, or the ledger file itself.
    pub path: PathBuf,
    /// Print one JSON object (with every unit's epsilon) instead of text.
    #[arg(long)]
    pub json: bool,
    /// In text mode, list every unit's epsilon (default: a summary and the 10 largest).
    #[arg(long)]
    pub all_units: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let file = if args.path.is_dir() {
        args.path.join(LEDGER_FILE_NAME)
    } else {
        args.path.clone()
    };
    if !file.exists() {
        return Err(UsageError(format!("no ledger at {}", file.display())).into());
    }
    let (config, records, recovery) = PrivacyLedger::read(&file)?;
    let report = PrivacyLedger::report_of(&config, &records)
        .with_context(|| format!("accounting {}", file.display()))?;
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        v["ledger"] = serde_json::json!(file.display().to_string());
        v["torn_bytes"] = serde_json::json!(recovery.torn_bytes);
        v["private"] = serde_json::json!(report.noise_sources.iter().all(|s| s.is_private()));
        println!("{v}");
        return Ok(ExitCode::SUCCESS);
    }
    println!("ledger        {}", file.display());
    println!("recovery      {recovery}");
    println!("unit kind     {}", report.unit_kind);
    println!("participation {:?}", report.participation);
    println!("rounds        {}", report.rounds);
    println!("units         {}", report.units);
    println!(
        "epsilon       {:.6} at delta {:e} ({}; RDP cross-check {:.6}; target {})",
        report.epsilon, report.delta, report.accountant, report.epsilon_rdp, report.target_epsilon
    );
    for s in &report.noise_sources {
        println!("noise source  {s}");
    }
    let mut units = report.per_unit.clone();
    if !units.is_empty() {
        units.sort_by(|a, b| b.epsilon.total_cmp(&a.epsilon).then(a.unit.cmp(&b.unit)));
        let shown = if args.all_units {
            units.len()
        } else {
            units.len().min(10)
        };
        println!("per unit (largest first, {shown} of {}):", units.len());
        for u in &units[..shown] {
            println!(
                "  unit {:>10}  participations {:>5}  epsilon {:.6}",
                u.unit, u.participations, u.epsilon
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
