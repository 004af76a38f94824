//! Resume: where a run continues from its state directory, and the checks that refuse to
//! continue when continuing would misreport privacy.
//!
//! The ledger is the privacy history of the model; the checkpoint is the model. A checkpoint
//! that covers more ledger records than the ledger holds (the ledger was deleted, truncated or
//! replaced) carries noise-protected releases the ledger no longer accounts for: resuming would
//! report an epsilon below the released model's real one. (A resumed run that asks for a larger
//! `target_epsilon` than the ledger allows is refused by the ledger itself unless the operator
//! says so explicitly: `PrivacyLedger::open_with`.)

use std::path::{Path, PathBuf};

use fedrl_common::privacy::ledger::{LedgerError, Participation, PrivacyLedger};
use thiserror::Error;

use crate::checkpoint::CheckpointMeta;
use crate::engine::Resume;

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

/// The checks start-up makes before it resumes from an opened ledger and the checkpoint, if any.
/// (A larger target epsilon than the ledger's is refused by the ledger itself unless the
/// operator allowed it, and an allowed raise is recorded there: `PrivacyLedger::open_with`.)
pub fn check_state(
    ledger: &PrivacyLedger,
    checkpoint: Option<&CheckpointMeta>,
) -> Result<(), ResumeError> {
    if let Some(meta) = checkpoint {
        check_checkpoint(meta, ledger.path(), ledger.records().len() as u64)?;
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
