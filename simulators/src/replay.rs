//! Replaying reference trace files (Gymnasium, simglucose, HIV, Dosing, dm_control) against the simulators.
//!
//! [`replay_file`] recognises the format from the file's contents (its `meta.source` text and
//! layout). Gymnasium traces are replayed here; the healthcare formats are handed to
//! [`crate::uva_padova::replay_traces`], [`crate::hiv::replay_traces`],
//! [`crate::dosing::replay_traces`] and [`crate::dmc_cartpole::replay_traces`].

use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use crate::env::{Action, SimError};

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

/// The trace formats [`replay_file`] understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum TraceFormat {
    /// Gymnasium classic control (`meta.source` mentions gymnasium, `envs` maps ids to episodes).
    Gymnasium,
    /// simglucose's UVA/Padova `T1DPatient`.
    Simglucose,
    /// The Ernst et al. 2006 HIV treatment model.
    Hiv,
    /// The dosing-rl-gym "Diabetic" model of seed 004.
    Dosing,
    /// The DeepMind Control Suite cart-pole (top-level `source` naming dm_control).
    DmControl,
}

/// Observation tolerance for Gymnasium traces (absolute, on float32 observations).
pub const GYMNASIUM_OBS_TOLERANCE: f64 = 1e-5;

/// Tells the format of a parsed trace file.
pub fn detect_format(trace: &Value) -> Result<TraceFormat, SimError> {
    let source = trace
        .get("meta")
        .and_then(|m| m.get("source"))
        .or_else(|| trace.get("source"))
        .and_then(Value::as_str)
        .ok_or_else(|| SimError::Trace("no meta.source text: not a fedrl trace file".into()))?
        .to_ascii_lowercase();
    let format = if source.contains("gymnasium") && trace.get("envs").is_some() {
        TraceFormat::Gymnasium
    } else if source.contains("simglucose") {
        TraceFormat::Simglucose
    } else if source.contains("hiv") {
        TraceFormat::Hiv
    } else if source.contains("dm_control") && trace.get("episodes").is_some() {
        TraceFormat::DmControl
    } else if source.contains("dosing") || source.contains("diabetic") {
        TraceFormat::Dosing
    } else {
        return Err(SimError::Trace(format!(
            "unrecognised trace format (meta.source: {:?})",
            source.chars().take(80).collect::<String>()
        )));
    };
    Ok(format)
}

/// Reads a trace file and replays every environment or patient in it.
///
/// Errors only when the file cannot be read, parsed or recognised; mismatches are reported in
/// the results (`pass == false`).
pub fn replay_file(path: impl AsRef<Path>) -> Result<Vec<ReplayResult>, SimError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path)
        .map_err(|e| SimError::Trace(format!("cannot read {}: {e}", path.display())))?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| SimError::Trace(format!("{} is not JSON: {e}", path.display())))?;
    replay_value(&value)
}

/// Replays an already parsed trace file (see [`replay_file`]).
pub fn replay_value(trace: &Value) -> Result<Vec<ReplayResult>, SimError> {
    match detect_format(trace)? {
        TraceFormat::Gymnasium => replay_gymnasium(trace),
        TraceFormat::Simglucose => crate::uva_padova::replay_traces(trace),
        TraceFormat::Dosing => crate::dosing::replay_traces(trace),
        TraceFormat::Hiv => crate::hiv::replay_traces(trace),
        TraceFormat::DmControl => crate::dmc_cartpole::replay_traces(trace),
    }
}

fn field<'a>(v: &'a Value, key: &str, ctx: &str) -> Result<&'a Value, SimError> {
    v.get(key)
        .ok_or_else(|| SimError::Trace(format!("{ctx}: missing field {key:?}")))
}

fn f64_vec(v: &Value, ctx: &str) -> Result<Vec<f64>, SimError> {
    v.as_array()
        .ok_or_else(|| SimError::Trace(format!("{ctx}: expected an array of numbers")))?
        .iter()
        .map(|x| {
            x.as_f64()
                .ok_or_else(|| SimError::Trace(format!("{ctx}: {x} is not a number")))
        })
        .collect()
}

fn as_bool(v: &Value, ctx: &str) -> Result<bool, SimError> {
    v.as_bool()
        .ok_or_else(|| SimError::Trace(format!("{ctx}: expected true/false")))
}

/// Replays a Gymnasium trace file: per episode, set `initial_state`, step the recorded actions,
/// compare observations (absolute, [`GYMNASIUM_OBS_TOLERANCE`]) and rewards and flags (exactly).
pub fn replay_gymnasium(trace: &Value) -> Result<Vec<ReplayResult>, SimError> {
    let envs = field(trace, "envs", "gymnasium trace")?
        .as_object()
        .ok_or_else(|| SimError::Trace("gymnasium trace: `envs` is not an object".into()))?;
    let mut results = Vec::with_capacity(envs.len());
    for (id, episodes) in envs {
        let mut env =
            crate::make(id).map_err(|e| SimError::Trace(format!("gymnasium trace: {e}")))?;
        let episodes = episodes
            .as_array()
            .ok_or_else(|| SimError::Trace(format!("{id}: episodes are not an array")))?;
        let dim = env.observation_space().dim();
        let mut obs = vec![0f32; dim];
        let mut act = [0f32; 1];
        let mut r = ReplayResult {
            name: id.clone(),
            episodes: episodes.len(),
            error_kind: "obs_abs".into(),
            tolerance: GYMNASIUM_OBS_TOLERANCE,
            ..ReplayResult::default()
        };
        for (k, ep) in episodes.iter().enumerate() {
            let ctx = format!("{id} episode {k}");
            let init = f64_vec(field(ep, "initial_state", &ctx)?, &ctx)?;
            env.set_state(&init, &mut obs)
                .map_err(|e| SimError::Trace(format!("{ctx}: {e}")))?;
            if let Some(init_obs) = ep.get("initial_obs") {
                let want = f64_vec(init_obs, &ctx)?;
                r.max_error = r.max_error.max(obs_error(&obs, &want));
            }
            let steps = field(ep, "steps", &ctx)?
                .as_array()
                .ok_or_else(|| SimError::Trace(format!("{ctx}: steps are not an array")))?;
            for (t, s) in steps.iter().enumerate() {
                let ctx = format!("{ctx} step {t}");
                let a = field(s, "action", &ctx)?;
                let action = if let Some(i) = a.as_u64() {
                    Action::Discrete(i as usize)
                } else if let Some(x) = a.as_f64() {
                    act[0] = x as f32;
                    Action::Continuous(&act)
                } else if let Some(v) = a.as_array() {
                    let x = v.first().and_then(Value::as_f64).ok_or_else(|| {
                        SimError::Trace(format!("{ctx}: action {a} is not a number"))
                    })?;
                    act[0] = x as f32;
                    Action::Continuous(&act)
                } else {
                    return Err(SimError::Trace(format!("{ctx}: bad action {a}")));
                };
                let step = env
                    .step(action, &mut obs)
                    .map_err(|e| SimError::Trace(format!("{ctx}: {e}")))?;
                let want_obs = f64_vec(field(s, "obs", &ctx)?, &ctx)?;
                let reward = field(s, "reward", &ctx)?
                    .as_f64()
                    .ok_or_else(|| SimError::Trace(format!("{ctx}: reward is not a number")))?;
                let terminated = as_bool(field(s, "terminated", &ctx)?, &ctx)?;
                let truncated = as_bool(field(s, "truncated", &ctx)?, &ctx)?;
                r.max_error = r.max_error.max(obs_error(&obs, &want_obs));
                r.max_reward_error = r.max_reward_error.max((step.reward - reward).abs());
                if step.reward != reward
                    || step.terminated != terminated
                    || step.truncated != truncated
                {
                    r.mismatched_flags += 1;
                }
                r.steps += 1;
            }
        }
        r.pass = r.max_error <= r.tolerance && r.mismatched_flags == 0;
        results.push(r);
    }
    Ok(results)
}

/// Largest absolute difference; a length mismatch or a NaN counts as infinite.
fn obs_error(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            let d = (f64::from(*g) - w).abs();
            if d.is_nan() { f64::INFINITY } else { d }
        })
        .fold(0.0, f64::max)
}
