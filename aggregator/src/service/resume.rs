//! Resume: where a run continues from its state directory, and the checks that refuse to
//! continue when continuing would misreport privacy.
//!
//! The ledger is the privacy history of the model; the checkpoint is the model. A checkpoint
//! that covers more ledger records than the ledger holds (the ledger was deleted, truncated or
//! replaced) carries noise-protected releases the ledger no longer accounts for: resuming would
//! report an epsilon below the released model's real one. (A resumed run that asks for a larger
//! `target_epsilon` than the ledger allows is refused by the ledger itself unless the operator
//! says so explicitly: `PrivacyLedger::open_with`.)
//!
//! The ledger is hash-chained, so entries removed or reordered inside it are corruption when it
//! opens; entries cut from its end are caught here, against the ledger head the checkpoint and
//! the operator's `report.json` recorded when they were written (the ledger only grows after
//! them). A finished run whose checkpoint is gone is refused too: restarting it would train a
//! fresh model and overwrite the report, and with it the final evaluation.

use std::path::{Path, PathBuf};

use fedrl_common::privacy::ledger::{LedgerError, LedgerHead, Participation, PrivacyLedger};
use thiserror::Error;

use super::report::Outcome;
use crate::checkpoint::{CHECKPOINT_FILE, CheckpointMeta};
use crate::engine::Resume;
use crate::state;

/// Why a state directory cannot be resumed.
#[derive(Debug, Error)]
pub enum ResumeError {
    #[error(
        "the checkpoint (round {checkpoint_round}) covers {checkpoint_records} ledger records, but the ledger {ledger} holds only {ledger_records}: the checkpointed model's privacy history is not in the ledger (was it deleted, truncated or replaced?), so resuming would under-report epsilon. Refusing to start: restore the ledger that belongs to this checkpoint, or start a new run in an empty state directory"
    )]
    CheckpointAheadOfLedger {
        checkpoint_round: u64,
        checkpoint_records: u64,
        ledger: PathBuf,
        ledger_records: u64,
    },
    #[error("reading the ledger's header: {0}")]
    Ledger(#[from] LedgerError),
    /// The ledger no longer holds the head a checkpoint or report recorded.
    #[error(transparent)]
    HeadLost(LedgerError),
    #[error(
        "{report} says this run finished, but its checkpoint {checkpoint} is missing: restarting would train a fresh model and overwrite the report and its final evaluation. Refusing to start: the run is over (its model and report are in the state directory); restore the checkpoint to continue it, or start a new run in an empty state directory"
    )]
    FinishedWithoutCheckpoint {
        report: PathBuf,
        checkpoint: PathBuf,
    },
    #[error(
        "cannot read the previous report {path}: {reason}. It records the ledger head this restart must check; restore it, or move it away to restart without that check"
    )]
    Report { path: PathBuf, reason: String },
}

/// What start-up needs of the report a previous process of this run wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct PreviousReport {
    /// The file read (`operator/report.json`, else `report.json`).
    pub path: PathBuf,
    pub outcome: Outcome,
    /// The ledger's head then (operator report only; `None` before ledgers were chained).
    pub ledger_head: Option<LedgerHead>,
}

/// Reads the report a previous process left in the state directory `dir`, if any: the
/// operator's `report.json` (it has the ledger head), else the public one.
pub fn previous_report(dir: &Path) -> Result<Option<PreviousReport>, ResumeError> {
    #[derive(serde::Deserialize)]
    struct Fields {
        #[serde(default)]
        outcome: Outcome,
        #[serde(default)]
        ledger_head: Option<LedgerHead>,
    }
    let operator = dir.join(state::OPERATOR_DIR).join(state::REPORT_FILE);
    let public = dir.join(state::REPORT_FILE);
    for path in [operator, public] {
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(ResumeError::Report {
                    path,
                    reason: e.to_string(),
                });
            }
        };
        let f: Fields = serde_json::from_slice(&text).map_err(|e| ResumeError::Report {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        return Ok(Some(PreviousReport {
            path,
            outcome: f.outcome,
            ledger_head: f.ledger_head,
        }));
    }
    Ok(None)
}

/// Refuses a checkpoint ahead of its ledger: one that covers more ledger records than the ledger
/// holds. A ledger ahead of the checkpoint is normal (a crash between the ledger append, which
/// comes first, and the next checkpoint) and only over-reports.
pub fn check_checkpoint(
    meta: &CheckpointMeta,
    ledger: &Path,
    ledger_records: u64,
) -> Result<(), ResumeError> {
    if meta.ledger_records > ledger_records {
        return Err(ResumeError::CheckpointAheadOfLedger {
            checkpoint_round: meta.round,
            checkpoint_records: meta.ledger_records,
            ledger: ledger.to_path_buf(),
            ledger_records,
        });
    }
    Ok(())
}

/// The checks start-up makes before it resumes from an opened ledger, the checkpoint and the
/// previous report in the state directory `dir`, if any: the checkpoint is not ahead of the
/// ledger, the ledger still holds the heads they recorded, and a finished run still has its
/// checkpoint. (A larger target epsilon than the ledger's is refused by the ledger itself
/// unless the operator allowed it, and an allowed raise is recorded there:
/// `PrivacyLedger::open_with`.)
pub fn check_state(
    dir: &Path,
    ledger: &PrivacyLedger,
    checkpoint: Option<&CheckpointMeta>,
    previous: Option<&PreviousReport>,
) -> Result<(), ResumeError> {
    if let Some(meta) = checkpoint {
        check_checkpoint(meta, ledger.path(), ledger.records().len() as u64)?;
        if let Some(head) = &meta.ledger_head {
            ledger
                .check_head(head, &dir.join(CHECKPOINT_FILE))
                .map_err(ResumeError::HeadLost)?;
        }
    }
    if let Some(report) = previous {
        if let Some(head) = &report.ledger_head {
            ledger
                .check_head(head, &report.path)
                .map_err(ResumeError::HeadLost)?;
        }
        if report.outcome == Outcome::Finished && checkpoint.is_none() {
            return Err(ResumeError::FinishedWithoutCheckpoint {
                report: report.path.clone(),
                checkpoint: dir.join(CHECKPOINT_FILE),
            });
        }
    }
    Ok(())
}

/// Where the engine continues: after the later of the ledger's last round and the checkpoint's
/// last attempted round; completed rounds are the ledger's records (it can only over-report);
/// under `fresh` participation every unit in the ledger is used up.
pub fn resume_point(
    ledger: &PrivacyLedger,
    checkpoint: Option<&CheckpointMeta>,
    participation: Participation,
) -> Resume {
    let last_ledger_round = ledger.last_round().unwrap_or(0);
    let ckpt_round = checkpoint.map_or(0, |m| m.round);
    let mut resume = Resume {
        next_round: last_ledger_round.max(ckpt_round) + 1,
        // Training rounds only: the DataRelease's record is not a round.
        rounds_completed: ledger
            .records()
            .iter()
            .filter(|r| r.phase != crate::engine::RELEASE_PHASE)
            .count() as u64,
        release_done: ledger
            .records()
            .iter()
            .any(|r| r.phase == crate::engine::RELEASE_PHASE),
        ..Resume::default()
    };
    if let Some(meta) = checkpoint {
        resume.rounds_abandoned = meta.rounds_abandoned;
    }
    if matches!(participation, Participation::Fresh) {
        resume.used_units = ledger
            .records()
            .iter()
            .flat_map(|r| r.units.iter().copied())
            .collect();
    }
    resume
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(round: u64, ledger_records: u64) -> CheckpointMeta {
        CheckpointMeta {
            round,
            rounds_completed: ledger_records,
            rounds_abandoned: 0,
            ledger_records,
            ledger_head: None,
            model_meta: serde_json::Value::Null,
            tensors: 0,
            tensors_sha256: String::new(),
        }
    }

    #[test]
    fn a_checkpoint_ahead_of_its_ledger_is_refused() {
        let p = Path::new("/s/privacy.ledger");
        // The reproduced case: a 12-round checkpoint, the ledger deleted (recreated empty).
        let e = check_checkpoint(&meta(12, 12), p, 0).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                ResumeError::CheckpointAheadOfLedger {
                    checkpoint_records: 12,
                    ledger_records: 0,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(
            msg.contains("privacy history is not in the ledger"),
            "{msg}"
        );
        assert!(msg.contains("/s/privacy.ledger"), "{msg}");
        // Truncated by one record: still refused.
        assert!(check_checkpoint(&meta(12, 12), p, 11).is_err());
        // Ledger level with or ahead of the checkpoint (a crash after an append): fine.
        check_checkpoint(&meta(12, 12), p, 12).unwrap();
        check_checkpoint(&meta(12, 12), p, 13).unwrap();
        // Abandoned rounds advance the checkpoint's round, not its ledger position.
        check_checkpoint(&meta(15, 12), p, 12).unwrap();
    }

    /// Issue 59, item 6: the DataRelease's ledger record is not a round: a resumed expert-level
    /// run counts only its training records as released rounds.
    #[test]
    fn the_release_record_is_not_counted_as_a_round() {
        use fedrl_common::privacy::DpEvent;
        use fedrl_common::privacy::ledger::{LedgerConfig, RoundRecord, UnitKind, training_event};
        use fedrl_common::privacy::noise::NoiseSource;
        let dir = tempfile::tempdir().unwrap();
        let participation = Participation::Sampled {
            rate: fedrl_common::privacy::params::SamplingRate::try_from(0.5).unwrap(),
        };
        let config = LedgerConfig {
            target_epsilon: 1000.0,
            delta: fedrl_common::privacy::params::Delta::try_from(1e-5).unwrap(),
            unit_kind: UnitKind::Expert,
            participation,
        };
        let (mut ledger, _) = PrivacyLedger::open(dir.path().join("l"), config).unwrap();
        let seeded = NoiseSource::Seeded { seed: 1 };
        ledger
            .append(RoundRecord {
                round: crate::engine::RELEASE_ROUND,
                phase: crate::engine::RELEASE_PHASE.into(),
                event: DpEvent::Laplace { scale: 1.0 },
                sampled_by_aggregator: true,
                units: (0..4).collect(),
                clip_norm: None,
                expected_cohort: None,
                noise_source: seeded,
                unix_time_s: 0.0,
            })
            .unwrap();
        for round in 1..=2 {
            ledger
                .append(RoundRecord::training_round(
                    round,
                    vec![0, 1],
                    training_event(5.0, None),
                    1.0,
                    Some(0.5),
                    2.0,
                    seeded,
                ))
                .unwrap();
        }
        let r = resume_point(&ledger, None, participation);
        assert_eq!(
            r.rounds_completed, 2,
            "the release record counted as a round"
        );
        assert_eq!(r.next_round, 3);
        assert!(r.release_done);
    }
}
