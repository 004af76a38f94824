//! The per-round metrics files, split by who may read them (DESIGN §3, "What may be published").
//!
//! - `metrics.jsonl` (public): per round only what the release made public anyway: the round,
//!   its status, epsilon and delta as accounted by the ledger, the evaluation of the released
//!   model, the public training diagnostics (`diagnostics`, below), and the time.
//! - `tensorboard/events.out.tfevents.*` (public): the numbers of the released rounds' public
//!   lines but the time `t_s`, one tag per field (`epsilon`, `eval/eval_return`,
//!   `diagnostics/update_norm`, ...), step = round, written and flushed with each line
//!   ([`crate::tensorboard`]). Nothing else goes there, so it holds nothing `metrics.jsonl`
//!   does not.
//! - `operator/metrics.jsonl` (operator-only): the same lines plus the exact counts (updates
//!   offered, accepted, clipped, rejected, contributions so far, quorum), the reason a round
//!   was abandoned, and `operator_diagnostics`. Under Poisson sampling an exact accepted count
//!   is the size of the secret sample, which the amplification relies on; clipped counts are
//!   not noised.
//!
//! ## Training diagnostics, public and operator-only
//!
//! Public (`diagnostics` and the evaluation's fields) are functions of the released noisy
//! update, the model it produced, public settings, and episodes or data the server holds
//! itself (held-out users, held-out data): post-processing of DP outputs. Operator-only
//! (`operator_diagnostics`) are statistics of the units' own data or updates, exact and not
//! noised.
//!
//! | kind (mode) | public, per released round | operator-only, per released round |
//! | --- | --- | --- |
//! | every kind | `diagnostics.update_norm` (L2 of the released noisy mean update), `step_norm` (L2 of the change of the offered parameters it caused), `param_norm` (L2 of the offered parameters after it) | `unit_norm_mean`, `unit_norm_max` (the accepted updates' L2 norms before the server's clip), `clipped_fraction` (clipped / accepted) |
//! | dppg (federated) | `server_lr`; on evaluated rounds `eval.eval_policy_entropy` (mean entropy of the released policy on the states of its held-out evaluation episodes), `eval.eval_value_rmse` (its value network against those episodes' discounted returns) | as every kind (no client loss: see below) |
//! | offline_cql (federated, central) | `server_lr` (Adam), `dp_steps`, `free_steps` (Selective schedule) | central summed path: `train_loss` (mean CQL loss of the round's rows at the offered parameters) |
//! | privorl (federated, central) | `server_lr` (AdamW fine-tuning); its evaluation curve (held-out loss, CQL returns) | central summed path: `train_loss` (mean EDM denoising loss of the round's rows) |
//! | primorl (federated) | the generic three (the server adds the update: the step is the update) | as every kind |
//! | loglinear, mean_estimation | `server_lr` | as every kind |
//!
//! Why no losses from clients: a client's PPO or CQL losses are statistics of its units' data
//! that the update does not release. Sending them would add per-unit data to the protocol next
//! to the clipped update, unverifiable by the server and with no role in training; they could
//! only ever be operator-only. The server already sees each accepted update's norm and whether
//! it clipped it (the operator's view of the clipping), and it computes losses itself where it
//! holds the data (the central mode's summed path, from the forward pass the gradient needs
//! anyway). The update path and the privacy accounting are unchanged.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use anyhow::Context;
use serde_json::{Map, Value, json};

use crate::state;
use crate::tensorboard::EventWriter;

/// A round whose ledger record is durable and whose model was updated.
pub(super) struct Released {
    pub round: u64,
    /// Seconds since the aggregator started.
    pub t_s: f64,
    /// The released model's evaluation, if it has one.
    pub eval: Option<Value>,
    /// Public training diagnostics (functions of the release: see the module doc).
    pub diagnostics: Map<String, Value>,
    /// Operator-only training diagnostics (statistics of the units' updates or data).
    pub operator_diagnostics: Map<String, Value>,
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
    /// This process's TensorBoard event file of the public lines.
    tensorboard: EventWriter,
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
    /// Opens (appending) `metrics.jsonl` and `operator/metrics.jsonl` in the state directory,
    /// and a new event file under `tensorboard/` (a resumed run adds one).
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let op = dir.join(state::OPERATOR_DIR);
        std::fs::create_dir_all(&op).with_context(|| format!("creating {}", op.display()))?;
        let tb = dir.join(state::TENSORBOARD_DIR);
        Ok(RoundMetrics {
            public: append(&dir.join(state::METRICS_FILE))?,
            operator: append(&op.join(state::METRICS_FILE))?,
            tensorboard: EventWriter::create(&tb)
                .with_context(|| format!("creating an event file in {}", tb.display()))?,
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
        let mut public = json!({
            "round": r.round,
            "status": "released",
            "epsilon": epsilon,
            "delta": delta,
            "eval": r.eval,
            "t_s": r.t_s,
        });
        if !r.diagnostics.is_empty() {
            public["diagnostics"] = Value::Object(r.diagnostics);
        }
        let mut operator = public.clone();
        if !r.operator_diagnostics.is_empty() {
            operator["operator_diagnostics"] = Value::Object(r.operator_diagnostics);
        }
        operator["users"] = r.users.into();
        operator["accepted"] = r.accepted.into();
        operator["clipped"] = r.clipped.into();
        operator["offered"] = r.offered.into();
        operator["rejected"] = r.rejected.into();
        operator["rounds_completed"] = r.rounds_completed.into();
        operator["rounds_abandoned"] = r.rounds_abandoned.into();
        write_line(&mut self.public, &public).context("writing metrics.jsonl")?;
        write_line(&mut self.operator, &operator).context("writing operator/metrics.jsonl")?;
        // From the public line itself, so the event file can hold nothing else.
        self.tensorboard
            .scalars(r.round as i64, &crate::tensorboard::scalars(&public))
            .context("writing the TensorBoard event file")?;
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
            diagnostics: json!({"update_norm": 0.25}).as_object().unwrap().clone(),
            operator_diagnostics: json!({"unit_norm_mean": 1.5}).as_object().unwrap().clone(),
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
            [
                "delta",
                "diagnostics",
                "epsilon",
                "eval",
                "round",
                "status",
                "t_s"
            ]
        );
        assert_eq!(public[0]["epsilon"], 0.7);
        assert_eq!(public[0]["diagnostics"]["update_norm"], 0.25);
        assert_eq!(keys(&public[1]), ["round", "status", "t_s"]);
        let operator = lines(
            &dir.path()
                .join(state::OPERATOR_DIR)
                .join(state::METRICS_FILE),
        );
        assert_eq!(operator[0]["accepted"], 9);
        assert_eq!(operator[0]["clipped"], 4);
        assert_eq!(operator[0]["epsilon"], 0.7);
        assert_eq!(operator[0]["operator_diagnostics"]["unit_norm_mean"], 1.5);
        assert_eq!(operator[1]["reason"], "3 of 5 accepted");
    }

    /// The event files, read back by an independent decoder (framing, both CRCs, protobuf
    /// fields), hold exactly the numbers of the released rounds' public lines, step = round;
    /// nothing of the operator's lines; and a second process (a resume) adds a file.
    #[test]
    fn tensorboard_holds_the_public_lines_numbers_and_nothing_else() {
        use crate::tensorboard::decode;
        let dir = tempfile::tempdir().unwrap();
        let released = |round: u64, eval: Option<Value>| Released {
            round,
            t_s: round as f64 * 0.5,
            eval,
            diagnostics: json!({"update_norm": 0.1 * round as f64, "server_lr": 0.01})
                .as_object()
                .unwrap()
                .clone(),
            operator_diagnostics: json!({"unit_norm_mean": 7.0, "train_loss": 3.0})
                .as_object()
                .unwrap()
                .clone(),
            users: 100,
            accepted: 10,
            clipped: 3,
            offered: 12,
            rejected: 0,
            rounds_completed: round,
            rounds_abandoned: 0,
        };
        let mut m = RoundMetrics::open(dir.path()).unwrap();
        m.released(released(0, None));
        m.flush(|| Some((None, 1e-5))).unwrap();
        m.released(released(
            1,
            Some(json!({"eval_return": 12.5, "eval_episodes": 4})),
        ));
        m.flush(|| Some((Some(0.3), 1e-5))).unwrap();
        m.abandoned(Abandoned {
            round: 2,
            t_s: 1.0,
            accepted: 1,
            quorum: 5,
            offered: 10,
            rounds_completed: 2,
            rounds_abandoned: 1,
            reason: "1 of 5".into(),
        })
        .unwrap();
        drop(m);
        // A resumed aggregator opens the files again.
        let mut m = RoundMetrics::open(dir.path()).unwrap();
        m.released(released(3, None));
        m.flush(|| Some((Some(0.4), 1e-5))).unwrap();

        let tb = dir.path().join(state::TENSORBOARD_DIR);
        let mut files: Vec<_> = std::fs::read_dir(&tb)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert_eq!(files.len(), 2, "one event file per process");
        let mut got: Vec<(i64, String, f32)> = Vec::new();
        for f in &files {
            let events = decode::read(&std::fs::read(f).unwrap()).unwrap();
            assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
            for e in &events[1..] {
                assert!(e.file_version.is_none());
                got.extend(e.scalars.iter().map(|(t, v)| (e.step, t.clone(), *v)));
            }
        }
        // What metrics.jsonl says, by hand: every number of each released line but the round
        // and the time.
        let mut want: Vec<(i64, String, f32)> = Vec::new();
        for line in lines(&dir.path().join(state::METRICS_FILE)) {
            if line["status"] != "released" {
                continue;
            }
            let step = line["round"].as_i64().unwrap();
            let num = |v: &Value| v.as_f64().map(|x| x as f32);
            for (tag, v) in [
                ("delta", num(&line["delta"])),
                ("epsilon", num(&line["epsilon"])),
                (
                    "diagnostics/update_norm",
                    num(&line["diagnostics"]["update_norm"]),
                ),
                (
                    "diagnostics/server_lr",
                    num(&line["diagnostics"]["server_lr"]),
                ),
                ("eval/eval_return", num(&line["eval"]["eval_return"])),
                ("eval/eval_episodes", num(&line["eval"]["eval_episodes"])),
            ] {
                if let Some(v) = v {
                    want.push((step, tag.to_string(), v));
                }
            }
        }
        got.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        want.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        assert_eq!(got, want);
        // Spot checks that the comparison is not vacuous.
        assert!(got.contains(&(1, "eval/eval_return".into(), 12.5)));
        assert!(got.contains(&(3, "epsilon".into(), 0.4)));
        assert!(!got.iter().any(|(s, t, _)| *s == 0 && t == "epsilon"));
        assert!(
            !got.iter()
                .any(|(_, t, _)| t.contains("unit_norm") || t.contains("loss"))
        );
        assert!(!got.iter().any(|(_, t, _)| t == "t_s"));
        assert!(
            !got.iter().any(|(s, _, _)| *s == 2),
            "abandoned rounds release nothing"
        );
    }
}
