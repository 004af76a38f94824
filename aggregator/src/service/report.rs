//! The end-of-run report, split by who may read it: [`PublicReport`] (DP outputs and the run's
//! configuration, `report.json`) and [`OperatorCounts`] (exact counts, `operator/report.json`
//! together with the public part).

use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::state;

/// What may be published about a run: its configuration and DP outputs (epsilon and delta, the
/// evaluations of released models). No exact counts of units or updates.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PublicReport {
    pub scenario: String,
    /// Rounds released, over this process and its predecessors (the public metrics list them).
    pub rounds_completed: u64,
    /// Rounds closed without a release.
    pub rounds_abandoned: u64,
    /// Rounds attempted by this process and its predecessors (released + abandoned).
    pub rounds_attempted: u64,
    /// Version of this report's layout, the `report_version` of the JSON Schema that
    /// describes it (`scenarios/report.schema.json`). Bumped when a field is renamed, removed
    /// or changes meaning.
    #[serde(default)]
    pub report_version: u32,
    /// Epsilon of the worst unit at `delta`, by the reported accountant; `None` (JSON `null`)
    /// for a non-private twin, which has no epsilon.
    pub epsilon: Option<f64>,
    /// The RDP cross-check at `delta` (never smaller than a valid bound needs to be); `None`
    /// for a non-private twin.
    pub epsilon_rdp: Option<f64>,
    /// The worst unit's zCDP rho when every round charging it was an un-sampled (discrete)
    /// Gaussian: exact, where `epsilon` counts the discrete Gaussian as continuous up to a
    /// proven gap (`fedrl_common::privacy::event`). `None` otherwise and for a non-private twin.
    #[serde(default)]
    pub zcdp_rho: Option<f64>,
    pub delta: f64,
    pub target_epsilon: f64,
    /// True when the noise was seeded (reproducible, not private).
    pub seeded: bool,
    /// Where the noise came from, in one sentence ([`describe_noise`]).
    #[serde(default)]
    pub noise_source: String,
    pub accountant: String,
    /// Seconds this aggregator process ran.
    pub wall_seconds: f64,
    /// Why the run ended.
    pub finished: String,
    /// How it ended: finished, interrupted (resumable) or failed. Reports written before this
    /// field existed read as `finished`.
    #[serde(default)]
    pub outcome: Outcome,
    /// The released model's end-of-run evaluation: its return is `final_eval_return` (the one
    /// place a report gives the final return), with the task's other final figures beside it
    /// (episodes, spread, clinical metrics, curves). A task without an end-of-run evaluation
    /// (mean estimation) puts its last periodic evaluation here; `None` when there is neither.
    pub final_evaluation: Option<serde_json::Value>,
    /// True for a non-private twin: no server-side clipping, no noise, epsilon = infinity (a
    /// task may still project its local updates, e.g. PriMORL's `nonprivate_clip_norm`).
    pub non_private: bool,
    /// Expert-level runs: the DataRelease (its parameters, the candidates walked, |D_stable|;
    /// all public, D_stable itself is published) and the step schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selective: Option<serde_json::Value>,
}

/// The layout version this code writes ([`PublicReport::report_version`]).
pub const REPORT_VERSION: u32 = 2;

/// One sentence saying where a run's noise came from, from the distinct sources its ledger
/// recorded (`sources`): the OS generator (private), seeded generators (one derived seed per
/// round from the scenario's `seed`: reproducible, not private), or both after a resume that
/// changed the seed; `non_private` twins have none.
pub fn describe_noise(
    sources: &[fedrl_common::privacy::noise::NoiseSource],
    scenario_seed: Option<u64>,
    non_private: bool,
) -> String {
    if non_private {
        return "none (non-private twin: no noise)".into();
    }
    let seeded = sources.iter().filter(|s| !s.is_private()).count();
    let os = sources.len() - seeded;
    let seeded_text = || match scenario_seed {
        Some(seed) => format!(
            "seeded ChaCha20, one seed per round derived from the scenario's seed {seed} \
             (reproducible, NOT private)"
        ),
        None => "seeded ChaCha20 (reproducible, NOT private)".into(),
    };
    match (os > 0, seeded > 0) {
        (_, false) => fedrl_common::privacy::noise::NoiseSource::Os.to_string(),
        (false, true) => seeded_text(),
        (true, true) => format!(
            "mixed: some rounds {}, others {}",
            fedrl_common::privacy::noise::NoiseSource::Os,
            seeded_text()
        ),
    }
}

/// How a run ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The run is over: its rounds were attempted, the budget or the population is exhausted,
    /// or the model reached its target.
    #[default]
    Finished,
    /// Stopped by the operator (a signal): restarting on the same state directory resumes it.
    Interrupted,
    /// Stopped by an error (the report's `finished` says which): the run is not over.
    Failed,
}

/// The run stopped for an error (`reason`, which names the file when a write failed). What the
/// aggregator could write of its report is in the state directory.
#[derive(Debug, thiserror::Error)]
#[error("the run stopped with an error: {reason}")]
pub struct RunFailed {
    pub reason: String,
}

/// Exact counts of a run, for the operator only: under Poisson sampling the number of units and
/// updates is the size of the secret sample, which the amplification relies on.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OperatorCounts {
    /// Units that contributed to at least one released round.
    pub units: u64,
    /// Updates accepted/rejected by this process.
    pub updates_accepted: u64,
    pub updates_rejected: u64,
    /// Bytes of update frames read by this process.
    pub bytes_ingested: u64,
    /// Update buffers (4 x dim bytes each) this process allocated: at most
    /// `max_inflight_updates`, however many clients and updates there are, because every body is
    /// read under a permit into a pooled buffer.
    pub update_buffers_allocated: u64,
    /// Where the engine thread's time went (seconds, whole run).
    #[serde(default)]
    pub timings: Timings,
    /// Connection attempts, refusals, authentication timeouts (this process).
    #[serde(default)]
    pub connections: super::gate::ConnectionCounts,
    /// The ledger's head when the report was written (entry count, hash of the last frame):
    /// `fedrl ledger` and a restart refuse a ledger that no longer holds it. Operator-only, as
    /// the ledger is. `None` in reports written before ledgers were chained.
    #[serde(default)]
    pub ledger_head: Option<fedrl_common::privacy::ledger::LedgerHead>,
    /// The model's operator-only end-of-run findings (`ServerModel::operator_evaluation`; e.g.
    /// PrivORL's membership-inference audit, which scores the units' own transitions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_audit: Option<serde_json::Value>,
}

/// Seconds the engine thread spent in each kind of work over the run; the rest of the wall
/// clock is waiting for the network and the clients (or idle).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Timings {
    /// Re-clipping, quantising and summing updates (and journalling them).
    pub updates_s: f64,
    /// Ledger appends: the budget check (accounting) plus the write and fsync.
    pub ledger_append_s: f64,
    /// Adding the noise and releasing (after the ledger append).
    pub release_s: f64,
    /// Applying releases to the model (the server optimizer) and encoding the next offer.
    pub apply_s: f64,
    /// Evaluations of released models (a pipelined evaluation's own running time, on its
    /// thread).
    pub evaluation_s: f64,
    /// The engine thread's waits for pipelined evaluations (before committing the next round,
    /// or at the end): the part of `evaluation_s` the pipeline did not hide.
    #[serde(default)]
    pub evaluation_wait_s: f64,
    /// Accounting the epsilon printed on metrics lines (a full PLD composition each time; see
    /// the driver's `flush_metrics_line` for how often).
    pub metrics_epsilon_s: f64,
    /// Central mode: computing the units' clipped gradients.
    pub central_compute_s: f64,
    /// DataRelease (expert-level runs): from the first candidate to the accounted release,
    /// waiting for the clients included.
    #[serde(default)]
    pub data_release_s: f64,
}

/// The end-of-run report: serialised flat (both parts' fields side by side), as written to
/// `operator/report.json`; `report.json` holds only [`RunReport::public`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunReport {
    #[serde(flatten)]
    pub public: PublicReport,
    #[serde(flatten)]
    pub operator: OperatorCounts,
}

impl RunReport {
    /// Writes `report.json` (public part) and `operator/report.json` (everything) into the
    /// state directory, each atomically.
    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        let op = dir.join(state::OPERATOR_DIR);
        std::fs::create_dir_all(&op).with_context(|| format!("creating {}", op.display()))?;
        state::write_atomic(
            &dir.join(state::REPORT_FILE),
            &serde_json::to_vec_pretty(&self.public)?,
        )?;
        state::write_atomic(
            &op.join(state::REPORT_FILE),
            &serde_json::to_vec_pretty(self)?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_public_report_file_holds_no_counts() {
        let dir = tempfile::tempdir().unwrap();
        let report = RunReport {
            public: PublicReport {
                scenario: "s".into(),
                rounds_completed: 3,
                rounds_abandoned: 1,
                rounds_attempted: 4,
                report_version: REPORT_VERSION,
                epsilon: Some(0.9),
                epsilon_rdp: Some(1.0),
                zcdp_rho: None,
                delta: 1e-5,
                target_epsilon: 2.0,
                seeded: false,
                noise_source: describe_noise(&[], None, false),
                accountant: "pld".into(),
                wall_seconds: 1.0,
                finished: "done".into(),
                outcome: Outcome::Finished,
                final_evaluation: None,
                non_private: false,
                selective: None,
            },
            operator: OperatorCounts {
                units: 31,
                updates_accepted: 37,
                updates_rejected: 2,
                bytes_ingested: 1234,
                update_buffers_allocated: 3,
                timings: Timings::default(),
                connections: Default::default(),
                ledger_head: None,
                model_audit: Some(serde_json::json!({ "membership": { "auc": 0.5 } })),
            },
        };
        report.write(dir.path()).unwrap();
        let public: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(state::REPORT_FILE)).unwrap())
                .unwrap();
        for key in [
            "units",
            "updates_accepted",
            "updates_rejected",
            "bytes_ingested",
            "update_buffers_allocated",
            "model_audit",
        ] {
            assert!(public.get(key).is_none(), "{key} in {public}");
        }
        assert_eq!(public["epsilon"], 0.9);
        let operator: serde_json::Value = serde_json::from_slice(
            &std::fs::read(
                dir.path()
                    .join(state::OPERATOR_DIR)
                    .join(state::REPORT_FILE),
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(operator["units"], 31);
        assert_eq!(operator["update_buffers_allocated"], 3);
        assert_eq!(operator["model_audit"]["membership"]["auc"], 0.5);
        assert_eq!(operator["epsilon"], 0.9);
        // Flat, so readers of the old single file find every field where it was.
        let back: RunReport = serde_json::from_value(operator).unwrap();
        assert_eq!(back.operator.updates_accepted, 37);
    }

    #[test]
    fn a_twin_has_a_null_epsilon_and_one_noise_sentence() {
        use fedrl_common::privacy::noise::NoiseSource;
        let seeded: Vec<NoiseSource> = (0..5).map(|seed| NoiseSource::Seeded { seed }).collect();
        let text = describe_noise(&seeded, Some(3), false);
        assert!(
            text.contains("seed 3") && text.contains("NOT private"),
            "{text}"
        );
        // One sentence, not one entry per round.
        assert!(!text.contains("seed 4"), "{text}");
        assert!(describe_noise(&[NoiseSource::Os], None, false).starts_with("os-csprng"));
        assert!(describe_noise(&[NoiseSource::Os, seeded[0]], Some(1), false).starts_with("mixed"));
        assert!(describe_noise(&[], None, true).starts_with("none"));
        // JSON null, and read back as None (an infinite f64 would be written as null and then
        // fail to read).
        let mut r: PublicReport = serde_json::from_value(serde_json::json!({
            "scenario": "s", "rounds_completed": 1, "rounds_abandoned": 0,
            "rounds_attempted": 1, "epsilon": null, "epsilon_rdp": null, "delta": 1e-5,
            "target_epsilon": 1.0, "seeded": false, "accountant": "none",
            "wall_seconds": 1.0, "finished": "done", "final_evaluation": null,
            "non_private": true
        }))
        .unwrap();
        assert_eq!(r.epsilon, None);
        r.epsilon = Some(1.5);
        assert_eq!(serde_json::to_value(&r).unwrap()["epsilon"], 1.5);
    }
}
