//! `fedrl ledger DIR [--json] [--accountant pld|rdp]`: reads a privacy ledger, lists what it
//! recorded (each record's event, phase, sampling flag, units count, noise source; budget raises)
//! and re-accounts it: the total, each phase, their basic composition, and every unit.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use fedrl_common::privacy::accountant::AccountantKind;
use fedrl_common::privacy::ledger::{Entry, LEDGER_FILE_NAME, PrivacyLedger};
use serde_json::json;

use super::UsageError;

#[derive(clap::Args)]
pub struct Args {
    /// A state directory holding `privacy.ledger`, a `fedrl run` output directory (its ledger is
    /// in `operator/`), or the ledger file itself.
    pub path: PathBuf,
    /// Print one JSON document (every record's event, the accounting, every unit's epsilon)
    /// instead of text.
    #[arg(long)]
    pub json: bool,
    /// The accountant to re-account with: `pld` (the reported figure: exact analytic Gaussian
    /// where a unit's events allow it, else PLD) or `rdp` (Rényi DP, looser).
    #[arg(long, default_value = "pld")]
    pub accountant: String,
    /// In text mode, list every unit's epsilon (default: a summary and the 10 largest).
    #[arg(long)]
    pub all_units: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let kind: AccountantKind = args.accountant.parse().map_err(|_| {
        UsageError(format!(
            "--accountant must be pld or rdp, got {:?}",
            args.accountant
        ))
    })?;
    // A state directory holds the ledger at its top; a `fedrl run` output directory keeps it
    // with the other operator-only files under `operator/`.
    let file = if args.path.is_dir() {
        let top = args.path.join(LEDGER_FILE_NAME);
        let operator = args.path.join("operator").join(LEDGER_FILE_NAME);
        if !top.exists() && operator.exists() {
            operator
        } else {
            top
        }
    } else {
        args.path.clone()
    };
    if !file.exists() {
        return Err(UsageError(format!("no ledger at {}", file.display())).into());
    }
    let ledger = PrivacyLedger::read_file(&file)?;
    let report = ledger
        .report(kind)
        .with_context(|| format!("accounting {} with {kind}", file.display()))?;
    let private = report.noise_sources.iter().all(|s| s.is_private());
    if args.json {
        // Records without their unit lists (counts only): the lists are operator-only and
        // already in the ledger file; the per-unit accounting is in the report.
        let entries: Vec<serde_json::Value> = ledger
            .entries
            .iter()
            .map(|e| match e {
                Entry::Round(r) => json!({
                    "entry": "round",
                    "round": r.round,
                    "phase": r.phase,
                    "event": r.event,
                    "sampled_by_aggregator": r.sampled_by_aggregator,
                    "unit_count": r.units.len(),
                    "clip_norm": r.clip_norm,
                    "expected_cohort": r.expected_cohort,
                    "noise_source": r.noise_source,
                    "unix_time_s": r.unix_time_s,
                }),
                Entry::BudgetChange(b) => json!({
                    "entry": "budget_change",
                    "from": b.from,
                    "to": b.to,
                    "unix_time_s": b.unix_time_s,
                }),
            })
            .collect();
        let mut v = serde_json::to_value(&report)?;
        v["ledger"] = json!(file.display().to_string());
        v["format_version"] = json!(ledger.version);
        v["recovery"] = serde_json::to_value(&ledger.recovery)?;
        v["torn_bytes"] = json!(ledger.recovery.torn_bytes);
        v["private"] = json!(private);
        v["entries"] = json!(entries);
        println!("{v}");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "ledger        {} (format version {})",
        file.display(),
        ledger.version
    );
    println!("recovery      {}", ledger.recovery);
    println!("unit kind     {}", report.unit_kind);
    println!("participation {:?}", report.participation);
    println!("records       {}", report.rounds);
    println!("units         {}", report.units);
    println!("entries:");
    for e in &ledger.entries {
        match e {
            Entry::Round(r) => println!(
                "  round {:>6}  {:<10} sampled {:<3}  units {:>6}  noise {:<6}  {}",
                r.round,
                r.phase,
                if r.sampled_by_aggregator { "yes" } else { "no" },
                r.units.len(),
                if r.noise_source.is_private() {
                    "os"
                } else {
                    "seeded"
                },
                r.event
            ),
            Entry::BudgetChange(b) => println!(
                "  budget change: target epsilon {} -> {} (at unix time {:.0})",
                b.from, b.to, b.unix_time_s
            ),
        }
    }
    println!("phases (each at delta / {}):", report.phases.len().max(1));
    for p in &report.phases {
        println!(
            "  {:<10} records {:>6}  epsilon {:.6} at delta {:e} ({})",
            p.phase, p.rounds, p.epsilon, p.delta, p.accountant
        );
    }
    println!(
        "epsilon       {:.6} at delta {:e} ({}; every phase composed; target {})",
        report.epsilon, report.delta, report.accountant, report.target_epsilon
    );
    match report.zcdp_rho {
        Some(rho) => println!(
            "zCDP rho      {rho:.6} (worst unit, every round un-sampled Gaussian: exact, also for \
             the discrete Gaussian)"
        ),
        None => println!("zCDP rho      none (the worst unit has sampled or non-Gaussian events)"),
    }
    println!(
        "basic sum     {:.6} (sum of the phases above; a looser cross-check)",
        report.epsilon_basic
    );
    match &report.rdp_note {
        None => println!("RDP check     {:.6}", report.epsilon_rdp),
        Some(why) => println!("RDP check     none ({why})"),
    }
    for s in &report.noise_sources {
        println!("noise source  {s}");
    }
    if !private {
        println!("NOT PRIVATE: seeded noise is reproducible by anyone who knows the seed");
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
