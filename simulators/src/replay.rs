//! Replaying reference trace files (Gymnasium, simglucose, HIV, Dosing) against the simulators.

use serde::Serialize;

/// The outcome of replaying one environment (or one patient) of a trace file.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReplayResult {
    /// Environment id or patient name.
    pub name: String,
    pub episodes: usize,
    pub steps: usize,
    /// Largest deviation from the trace: observation (absolute or relative, as `error_kind` says)
    /// or blood glucose in mg/dL.
    pub max_error: f64,
    /// What `max_error` measures, e.g. "obs_abs", "obs_rel", "bg_mg_dl".
    pub error_kind: String,
    /// The tolerance the deviation must stay within.
    pub tolerance: f64,
    /// Steps whose reward/terminated/truncated/done differ from the trace.
    pub mismatched_flags: usize,
    /// Largest reward deviation (absolute; 0 when rewards must match exactly and do).
    pub max_reward_error: f64,
    pub pass: bool,
}
