//! The per-round metrics files, split by who may read them (DESIGN §3, "What may be published").
//!
//! - `metrics.jsonl` (public): per round only what the release made public anyway: the round,
//!   its status, epsilon and delta as accounted by the ledger, the evaluation of the released
//!   model, and the time.
//! - `operator/metrics.jsonl` (operator-only): the same lines plus the exact counts (updates
//!   offered, accepted, clipped, rejected, contributions so far, quorum) and the reason a round
//!   was abandoned. Under Poisson sampling an exact accepted count is the size of the secret
//!   sample, which the amplification relies on; clipped counts are not noised.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use anyhow::Context;
use serde_json::{Value, json};

use crate::state;

/// A round whose ledger record is durable and whose model was updated.
pub(super) struct Released {
    pub round: u64,
    /// Seconds since the aggregator started.
    pub t_s: f64,
    /// The released model's evaluation, if it has one.
    pub eval: Option<Value>,
    /// Contributions in released rounds so far, this one included (operator-only).
    pub users: u64,
    pub accepted: u64,
    pub clipped: u64,
    pub offered: u64,
    pub rejected: u64,
    /// Rounds completed and abandoned so far, this one included.
    pub rounds_completed: u64,
    pub rounds_abandoned: u64,
}

/// A round closed without a release (nothing left the aggregator).
pub(super) struct Abandoned {
    pub round: u64,
    /// Seconds since the aggregator started.
    pub t_s: f64,
    pub accepted: u64,
    pub quorum: u64,
    pub offered: u64,
    pub rounds_completed: u64,
    pub rounds_abandoned: u64,
    /// Why (it quotes exact counts: operator-only).
    pub reason: String,
}

/// The two metrics files of a state directory, and the released round whose line waits for its
/// epsilon.
pub(super) struct RoundMetrics {
    public: File,
    operator: File,
    /// The round just released: its line is written once the next round's offers are out, because
    /// its epsilon is a full accounting of the ledger (tens of ms) that would otherwise delay
    /// every round.
    pending: Option<Released>,
}

fn append(path: &Path) -> anyhow::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))
}

fn write_line(f: &mut File, line: &Value) -> std::io::Result<()> {
    writeln!(f, "{line}")?;
    f.flush()
}

impl RoundMetrics {
    /// Opens (appending) `metrics.jsonl` and `operator/metrics.jsonl` in the state directory.
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let op = dir.join(state::OPERATOR_DIR);
        std::fs::create_dir_all(&op).with_context(|| format!("creating {}", op.display()))?;
        Ok(RoundMetrics {
            public: append(&dir.join(state::METRICS_FILE))?,
            operator: append(&op.join(state::METRICS_FILE))?,
            pending: None,
        })
    }

    /// Records a released round; its lines are written by the next [`flush`](Self::flush).
    pub fn released(&mut self, r: Released) {
        self.pending = Some(r);
    }

    /// Gives the pending line of `round` its evaluation (a pipelined one arrives after the
    /// release); false when no line of that round is pending.
    pub fn evaluated(&mut self, round: u64, eval: Value) -> bool {
        match self.pending.as_mut() {
            Some(r) if r.round == round => {
                r.eval = Some(eval);
                true
            }
            _ => false,
        }
    }

    /// The pending released round, if any, and whether it carries an evaluation.
    pub fn pending(&self) -> Option<(u64, bool)> {
        self.pending.as_ref().map(|r| (r.round, r.eval.is_some()))
    }

    /// Writes the pending released round, if any, with `privacy()`'s (epsilon, delta): `None`
    /// for a non-private twin (written as null). `privacy` is only called when a line is
    /// pending.
    pub fn flush(
        &mut self,
        privacy: impl FnOnce() -> Option<(Option<f64>, f64)>,
    ) -> anyhow::Result<()> {
        let Some(r) = self.pending.take() else {
            return Ok(());
        };
        let (epsilon, delta) = match privacy() {
            Some((e, d)) => (e, Some(d)),
            None => (None, None),
        };
        let public = json!({
            "round": r.round,
            "status": "released",
            "epsilon": epsilon,
            "delta": delta,
            "eval": r.eval,
            "t_s": r.t_s,
        });
        let mut operator = public.clone();
        operator["users"] = r.users.into();
        operator["accepted"] = r.accepted.into();
        operator["clipped"] = r.clipped.into();
        operator["offered"] = r.offered.into();
        operator["rejected"] = r.rejected.into();
        operator["rounds_completed"] = r.rounds_completed.into();
        operator["rounds_abandoned"] = r.rounds_abandoned.into();
        write_line(&mut self.public, &public).context("writing metrics.jsonl")?;
        write_line(&mut self.operator, &operator).context("writing operator/metrics.jsonl")?;
        Ok(())
    }

    /// Writes an abandoned round at once. The caller flushes the pending released round first,
    /// so lines stay in round order.
    pub fn abandoned(&mut self, a: Abandoned) -> anyhow::Result<()> {
        let public = json!({
            "round": a.round,
            "status": "abandoned",
            "t_s": a.t_s,
        });
        let mut operator = public.clone();
        operator["accepted"] = a.accepted.into();
        operator["quorum"] = a.quorum.into();
        operator["offered"] = a.offered.into();
        operator["rounds_completed"] = a.rounds_completed.into();
        operator["rounds_abandoned"] = a.rounds_abandoned.into();
        operator["reason"] = a.reason.into();
        write_line(&mut self.public, &public).context("writing metrics.jsonl")?;
        write_line(&mut self.operator, &operator).context("writing operator/metrics.jsonl")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(p: &Path) -> Vec<Value> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn public_lines_hold_no_exact_counts() {
        let dir = tempfile::tempdir().unwrap();
        let mut m = RoundMetrics::open(dir.path()).unwrap();
        m.released(Released {
            round: 1,
            t_s: 0.5,
            eval: Some(json!({"eval_return": 20.0})),
            users: 9,
            accepted: 9,
            clipped: 4,
            offered: 10,
            rejected: 1,
            rounds_completed: 1,
            rounds_abandoned: 0,
        });
        // Nothing is written before the flush (the epsilon is not known yet).
        assert!(lines(&dir.path().join(state::METRICS_FILE)).is_empty());
        m.flush(|| Some((Some(0.7), 1e-5))).unwrap();
        m.flush(|| panic!("nothing pending: privacy must not be computed"))
            .unwrap();
        m.abandoned(Abandoned {
            round: 2,
            t_s: 1.0,
            accepted: 3,
            quorum: 5,
            offered: 10,
            rounds_completed: 1,
            rounds_abandoned: 1,
            reason: "3 of 5 accepted".into(),
        })
        .unwrap();
        let public = lines(&dir.path().join(state::METRICS_FILE));
        let keys = |v: &Value| {
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k
        };
        assert_eq!(
            keys(&public[0]),
            ["delta", "epsilon", "eval", "round", "status", "t_s"]
        );
        assert_eq!(public[0]["epsilon"], 0.7);
        assert_eq!(keys(&public[1]), ["round", "status", "t_s"]);
        let operator = lines(
            &dir.path()
                .join(state::OPERATOR_DIR)
                .join(state::METRICS_FILE),
        );
        assert_eq!(operator[0]["accepted"], 9);
        assert_eq!(operator[0]["clipped"], 4);
        assert_eq!(operator[0]["epsilon"], 0.7);
        assert_eq!(operator[1]["reason"], "3 of 5 accepted");
    }
}
