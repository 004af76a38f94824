//! `fedrl ledger DIR [--json] [--accountant pld|rdp]`: reads a privacy ledger, lists what it
//! recorded (each record's event, phase, sampling flag, units count, noise source; budget raises)
//! and re-accounts it: the total, each phase, their basic composition, and every unit.
//!
//! Integrity: reading verifies every frame's checksum and the hash chain (entries removed,
//! reordered or inserted are an error); the ledger heads recorded beside it (the `checkpoint`,
//! the operator's `report.json`) must still be in it, or entries were cut from its end (an
//! error too: its epsilon would be under-reported). A ledger of the unchained format (versions
//! 1-2) is read with a note that removals in it cannot be detected.
//!
//! The output is written at once at the end; a reader that closed the pipe early (`| head`) ends
//! the command quietly (exit 0), as other Unix tools do.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use fedrl_aggregator::{checkpoint, state};
use fedrl_common::privacy::DpEvent;
use fedrl_common::privacy::accountant::AccountantKind;
use fedrl_common::privacy::ledger::{
    Entry, LEDGER_FILE_NAME, LedgerHead, Participation, PrivacyLedger,
};
use serde_json::json;

use super::UsageError;

/// Appends one line to the output being built.
macro_rules! say {
    ($out:expr, $($t:tt)*) => {{
        use std::fmt::Write as _;
        // Writing into a String cannot fail.
        let _ = writeln!($out, $($t)*);
    }};
}

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
    let mut out = String::new();
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
    // The heads first: a running aggregator appends to the ledger before it records a head,
    // so heads read before the ledger are never ahead of it.
    let heads = recorded_heads(&file)?;
    let ledger = PrivacyLedger::read_file(&file)?;
    for (recorded_in, head) in &heads {
        ledger.check_head(&file, head, recorded_in)?;
    }
    let checked: Vec<PathBuf> = heads.into_iter().map(|(p, _)| p).collect();
    let head = ledger.head();
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
        v["chain"] = json!({
            "chained": ledger.recovery.unchained_entries.is_none(),
            "unchained_entries": ledger.recovery.unchained_entries,
            "entries": head.entries,
            "head_sha256": head.sha256,
            "heads_checked": checked.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        });
        say!(out, "{v}");
        return emit(&out);
    }
    say!(
        out,
        "ledger        {} (format version {})",
        file.display(),
        ledger.version
    );
    say!(out, "recovery      {}", ledger.recovery);
    say!(
        out,
        "chain         {} entries, head SHA-256 {}; {}",
        head.entries,
        head.sha256,
        if checked.is_empty() {
            "no checkpoint or report beside it recorded a head to check".to_string()
        } else {
            format!(
                "holds the heads recorded in {}",
                checked
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
    say!(out, "unit kind     {}", report.unit_kind);
    say!(
        out,
        "participation {}",
        participation(&report.participation)
    );
    say!(out, "records       {}", report.rounds);
    say!(out, "units         {}", report.units);
    say!(out, "entries:");
    for e in &ledger.entries {
        match e {
            Entry::Round(r) => say!(
                out,
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
                describe_event(&r.event)
            ),
            Entry::BudgetChange(b) => say!(
                out,
                "  budget change: target epsilon {} -> {} (at unix time {:.0})",
                b.from,
                b.to,
                b.unix_time_s
            ),
        }
    }
    say!(
        out,
        "phases (each at delta / {}):",
        report.phases.len().max(1)
    );
    for p in &report.phases {
        say!(
            out,
            "  {:<10} records {:>6}  epsilon {:.6} at delta {:e} ({})",
            p.phase,
            p.rounds,
            p.epsilon,
            p.delta,
            p.accountant
        );
    }
    say!(
        out,
        "epsilon       {:.6} at delta {:e} ({}; every phase composed; target {})",
        report.epsilon,
        report.delta,
        report.accountant,
        report.target_epsilon
    );
    match report.zcdp_rho {
        Some(rho) => say!(
            out,
            "zCDP rho      {rho:.6} (worst unit, every round un-sampled Gaussian: exact, also for \
             the discrete Gaussian)"
        ),
        None => say!(
            out,
            "zCDP rho      none (the worst unit has sampled or non-Gaussian events)"
        ),
    }
    say!(
        out,
        "basic sum     {:.6} (sum of the phases above; a looser cross-check)",
        report.epsilon_basic
    );
    match &report.rdp_note {
        None => say!(out, "RDP check     {:.6}", report.epsilon_rdp),
        Some(why) => say!(out, "RDP check     none ({why})"),
    }
    for s in &report.noise_sources {
        say!(out, "noise source  {s}");
    }
    if !private {
        say!(
            out,
            "NOT PRIVATE: seeded noise is reproducible by anyone who knows the seed"
        );
    }
    let mut units = report.per_unit.clone();
    if !units.is_empty() {
        units.sort_by(|a, b| b.epsilon.total_cmp(&a.epsilon).then(a.unit.cmp(&b.unit)));
        let shown = if args.all_units {
            units.len()
        } else {
            units.len().min(10)
        };
        say!(out, "per unit (largest first, {shown} of {}):", units.len());
        for u in &units[..shown] {
            say!(
                out,
                "  unit {:>10}  participations {:>5}  epsilon {:.6}",
                u.unit,
                u.participations,
                u.epsilon
            );
        }
    }
    emit(&out)
}

/// How units take part, in words (not the type's debug name).
fn participation(p: &Participation) -> String {
    match p {
        Participation::Fresh => "fresh (each unit contributes at most once)".into(),
        Participation::Sampled { rate } => format!(
            "sampled (the aggregator draws each unit with probability {} every round)",
            rate.get()
        ),
    }
}

/// A recorded mechanism in words: every Gaussian by its noise multiplier z (noise standard
/// deviation over L2 sensitivity, the number the scenario sets), the discrete Gaussian's grid
/// units named as such.
fn describe_event(e: &DpEvent) -> String {
    match e {
        DpEvent::Gaussian { noise_multiplier } => format!("Gaussian z={noise_multiplier:.4}"),
        DpEvent::DiscreteGaussian {
            sigma,
            l2_sensitivity,
        } => format!(
            "discrete Gaussian z={:.4} (sigma {sigma:.4e} over L2 sensitivity \
             {l2_sensitivity:.4e}, in fixed-point grid units)",
            sigma / l2_sensitivity
        ),
        DpEvent::Laplace { scale } => format!("Laplace b={scale}"),
        DpEvent::EpsilonDelta { epsilon, delta } => {
            format!("(epsilon {epsilon}, delta {delta:e})-DP")
        }
        DpEvent::PoissonSampled {
            sampling_rate,
            event,
        } => format!(
            "Poisson-sampled q={sampling_rate}: {}",
            describe_event(event)
        ),
        DpEvent::SelfComposed { event, count } => {
            format!("{count} x [{}]", describe_event(event))
        }
        DpEvent::Composed { events } => events
            .iter()
            .map(describe_event)
            .collect::<Vec<_>>()
            .join(" + "),
    }
}

/// Writes the output; a closed pipe (the reader took what it wanted, e.g. `| head`) is no
/// error, and nothing is reported.
fn emit(text: &str) -> anyhow::Result<ExitCode> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(ExitCode::SUCCESS),
        Err(e) => Err(e).context("writing to standard output"),
    }
}

/// The ledger heads recorded beside the ledger `file`, with the files that recorded them: the
/// state directory's `checkpoint` and the operator's `report.json` (in a state directory
/// `operator/report.json`, in a `fedrl run` output's `operator/` folder the `report.json` next
/// to the ledger). The ledger must hold each of them, or entries were cut from its end (or it
/// was replaced).
fn recorded_heads(file: &Path) -> anyhow::Result<Vec<(PathBuf, LedgerHead)>> {
    let dir = file.parent().unwrap_or(Path::new("."));
    let mut heads: Vec<(PathBuf, LedgerHead)> = Vec::new();
    if let Some(meta) = checkpoint::load_meta(dir)?
        && let Some(head) = meta.ledger_head
    {
        heads.push((dir.join(checkpoint::CHECKPOINT_FILE), head));
    }
    for report in [
        dir.join(state::OPERATOR_DIR).join(state::REPORT_FILE),
        dir.join(state::REPORT_FILE),
    ] {
        let text = match std::fs::read(&report) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", report.display())),
        };
        let v: serde_json::Value = serde_json::from_slice(&text)
            .with_context(|| format!("parsing {}", report.display()))?;
        // The public report has no head (the ledger is operator-only, and so is its hash).
        if let Some(h) = v.get("ledger_head").filter(|h| !h.is_null()) {
            let head: LedgerHead = serde_json::from_value(h.clone())
                .with_context(|| format!("the ledger head in {}", report.display()))?;
            heads.push((report, head));
        }
    }
    Ok(heads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_and_participation_read_in_words() {
        let dg = DpEvent::DiscreteGaussian {
            sigma: 3.74e6,
            l2_sensitivity: 1.0e6,
        };
        let text = describe_event(&DpEvent::PoissonSampled {
            sampling_rate: 0.01,
            event: Box::new(dg),
        });
        assert!(
            text.starts_with("Poisson-sampled q=0.01: discrete Gaussian z=3.7400 ("),
            "{text}"
        );
        assert!(text.contains("grid units"), "{text}");
        assert_eq!(
            participation(&Participation::Fresh),
            "fresh (each unit contributes at most once)"
        );
        let p = participation(&Participation::sampled(0.25).unwrap());
        assert!(
            p.contains("probability 0.25") && !p.contains("Sampled"),
            "{p}"
        );
    }
}
