//! The server-side model trait ([`ServerModel`]), its optional capability
//! ([`TrainsOnStableData`]), and the pieces every kind's server model shares: the server
//! optimizer (SGD with momentum, or Adam), model selection on held-out evaluations, and
//! checkpoints that keep the selected model.
//!
//! Per-round diagnostics ([`ServerModel::diagnostics`], [`ServerOptimizer::diagnostics`]) are
//! computed from released updates and the model they produce only (post-processing): they go
//! to the public `metrics.jsonl`. Statistics of units' data never come through this trait.

use serde::{Deserialize, Serialize};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("update has {got} values, the model has {expected}")]
    Length { expected: usize, got: usize },
    #[error("cannot restore the model: {0}")]
    Restore(String),
    #[error("{0}")]
    Other(String),
}

/// Everything needed to resume a model: JSON metadata plus one flat f32 vector (parameters and
/// optimizer state, in an order the model defines).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelState {
    /// Free-form metadata (hyper-parameters, layout, the model's name).
    pub meta: serde_json::Value,
    /// Parameters followed by optimizer state.
    #[serde(skip)]
    pub tensors: Vec<f32>,
}

/// The central model as the aggregator sees it. Implementations hold the server optimizer.
///
/// The engine never sees the model: the service asks it for its parameters (sent with every
/// offer), gives it each released noisy mean update, checkpoints it every K rounds and at
/// shutdown, and restores it after a crash. All calls run on the aggregator's dedicated engine
/// thread, never on a tokio worker, so implementations may do heavy (e.g. candle) work.
pub trait ServerModel: Send {
    /// The current global parameters (what the next round's offer carries); their length is the
    /// scenario's `dim`.
    fn params(&self) -> &[f32];
    /// Applies one released update: `noisy_mean_update` is `(sum of clipped client updates +
    /// noise) / expected cohort`, already private; everything done with it is post-processing.
    fn apply(&mut self, noisy_mean_update: &[f32]) -> Result<(), ModelError>;
    /// A checkpointable snapshot (parameters and optimizer state).
    fn state(&self) -> ModelState;
    /// Restores a snapshot produced by [`ServerModel::state`].
    fn restore(&mut self, state: ModelState) -> Result<(), ModelError>;
    /// Public diagnostics of the last [`ServerModel::apply`], for the round's line in
    /// `metrics.jsonl` (e.g. `server_lr`, the step size the server optimizer used). Only
    /// functions of released updates, the model and public settings belong here (they are
    /// published); the service adds the norms of the update and of the model step itself.
    /// Default: none.
    fn diagnostics(&self) -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }
    /// Called once by the aggregator before its first round with its state directory: where a
    /// model may keep files that must outlive the process (they survive a crash and a resume).
    fn set_state_dir(&mut self, dir: &std::path::Path) -> anyhow::Result<()> {
        let _ = dir;
        Ok(())
    }
    /// Optional evaluation after the release of `round` (written to `metrics.jsonl`).
    fn evaluate(&mut self, round: u64) -> Option<serde_json::Value> {
        let _ = round;
        None
    }
    /// The evaluation of the model as released in `round`, as a job that may run on another
    /// thread while the next round trains (issue 16's round pipeline); `None` when the model
    /// evaluates synchronously in [`ServerModel::evaluate`] or not after this round. The driver
    /// hands the job's result back through [`ServerModel::evaluated`] before it commits anything
    /// of a later round, so the run stops at the same round as a synchronous evaluation would.
    fn evaluation_job(&self, round: u64) -> Option<EvaluationJob> {
        let _ = round;
        None
    }
    /// Takes the result of a job from [`ServerModel::evaluation_job`] (model selection, the
    /// stop at a target) and returns what goes into the round's metrics line.
    fn evaluated(&mut self, done: EvaluationDone) -> serde_json::Value {
        done.value
    }
    /// True once the model wants training to stop (e.g. an evaluation reached its target).
    fn finished(&self) -> bool {
        false
    }
    /// The final evaluation at the end of the run (written into the report).
    fn final_evaluation(&mut self) -> Option<serde_json::Value> {
        None
    }
    /// Operator-only findings at the end of the run, after [`Self::final_evaluation`]: what
    /// reads the units' own data beyond their released contributions (e.g. an empirical privacy
    /// audit, which needs the members of the training set). It goes into
    /// `operator/report.json` (`model_audit`) only, never into the public report. `None` (the
    /// default): nothing.
    fn operator_evaluation(&mut self) -> Option<serde_json::Value> {
        None
    }
    /// Expert-level runs' capability: a model that also trains on D_stable (the prefixes
    /// DataRelease published). `None` (the default): this task trains on no released data.
    fn stable_data(&mut self) -> Option<&mut dyn TrainsOnStableData> {
        None
    }

    /// The run ended normally (not by a signal): finish anything the model has scheduled after
    /// its last round (e.g. the free steps of a selective schedule).
    fn finish(&mut self) -> anyhow::Result<()> {
        Ok(())
    }

    /// Writes the trained model into `dir` (e.g. `policy.safetensors`) at the end of the run.
    fn export(&self, dir: &std::path::Path) -> anyhow::Result<()> {
        let _ = dir;
        Ok(())
    }
}

/// Optional capability of a [`ServerModel`]: training on DataRelease's D_stable.
pub trait TrainsOnStableData {
    /// D_stable, the released prefixes, for the noise-free steps of the schedule. Called once
    /// the release is accounted in the ledger.
    fn set_stable_data(&mut self, data: fedrl_rl::offline::TransitionBatch) -> anyhow::Result<()>;
}

/// An evaluation of released parameters that can run off the engine thread: a copy of the
/// parameters and a closure over what the evaluation needs (held-out users, device).
pub struct EvaluationJob {
    round: u64,
    params: Vec<f32>,
    #[allow(clippy::type_complexity)]
    run: Box<dyn FnOnce(&[f32]) -> serde_json::Value + Send>,
}

/// What an [`EvaluationJob`] measured, with the parameters it evaluated.
pub struct EvaluationDone {
    /// The released round whose model was evaluated.
    pub round: u64,
    pub params: Vec<f32>,
    /// The metrics fields (e.g. `eval_return`), or `eval_error`.
    pub value: serde_json::Value,
}

impl EvaluationJob {
    /// A job evaluating `params` (the model as released in `round`) with `run`.
    pub fn new(
        round: u64,
        params: Vec<f32>,
        run: impl FnOnce(&[f32]) -> serde_json::Value + Send + 'static,
    ) -> Self {
        Self {
            round,
            params,
            run: Box::new(run),
        }
    }

    /// The released round this job evaluates.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// Runs the evaluation (on whichever thread calls it).
    pub fn run(self) -> EvaluationDone {
        let value = (self.run)(&self.params);
        EvaluationDone {
            round: self.round,
            params: self.params,
            value,
        }
    }
}

/// The server optimizer's rule (post-processing of released updates: any rule costs no privacy);
/// its arithmetic lives in `fedrl-rl`, shared with the in-process example.
pub use fedrl_rl::server_rule::ServerRule;

/// The server optimizer: applies each released noisy mean update `u` (client updates point in
/// the direction to move, so the server adds) by the [`ServerRule`].
#[derive(Clone, Debug)]
pub struct ServerOptimizer {
    pub params: Vec<f32>,
    /// SGD velocity, or Adam's first moment.
    pub velocity: Vec<f32>,
    /// Adam's second moment (empty for SGD).
    pub second: Vec<f32>,
    /// Updates applied so far (Adam's bias correction).
    pub steps: u64,
    /// Server learning rate (of the first update when `decay` is set).
    pub lr: f64,
    pub rule: ServerRule,
    /// Optional decay of the learning rate over the run.
    pub decay: Option<CosineDecay>,
    /// The learning rate of the last update (`None` before the first; not checkpointed: a
    /// diagnostic of the step just taken).
    pub last_lr: Option<f64>,
}

/// A half-cosine decay of the server learning rate from its initial value to `final_lr` over
/// `steps` updates: update `t` (1-based) uses `final_lr + (lr - final_lr) (1 + cos(pi (t - 1) /
/// (steps - 1))) / 2`, so the first update uses `lr` and update `steps` and later ones
/// `final_lr`. Meant for runs whose released models peak and then get worse under a constant
/// step; measured once on the dosing scenario, where decaying to 0 over 95 rounds left the policy
/// under-trained (bench/README.md, "Sensitivity-scaled basal"), so no shipped scenario uses it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CosineDecay {
    pub final_lr: f64,
    pub steps: u64,
}

impl CosineDecay {
    /// The learning rate of update `step` (1-based) when the first uses `lr`.
    pub fn lr_at(&self, lr: f64, step: u64) -> f64 {
        if self.steps <= 1 || step >= self.steps {
            return self.final_lr;
        }
        let x = step.saturating_sub(1) as f64 / (self.steps - 1) as f64;
        self.final_lr + (lr - self.final_lr) * 0.5 * (1.0 + (std::f64::consts::PI * x).cos())
    }
}

/// Metadata key of the applied-update count in a checkpoint.
const STEPS_KEY: &str = "server_steps";

impl ServerOptimizer {
    /// Plain FedAvg/FedSGD with momentum in [0, 1) (0: none).
    pub fn new(params: Vec<f32>, lr: f64, momentum: f64) -> Self {
        Self::with_rule(params, lr, ServerRule::Sgd { momentum })
    }

    pub fn with_rule(params: Vec<f32>, lr: f64, rule: ServerRule) -> Self {
        let n = params.len();
        let second = if rule.has_second_moment() {
            vec![0.0; n]
        } else {
            Vec::new()
        };
        ServerOptimizer {
            params,
            velocity: vec![0.0; n],
            second,
            steps: 0,
            lr,
            rule,
            decay: None,
            last_lr: None,
        }
    }

    /// The same optimizer with its learning rate decaying by `decay`.
    pub fn with_decay(mut self, decay: Option<CosineDecay>) -> Self {
        self.decay = decay;
        self
    }

    /// The learning rate of the next update.
    pub fn next_lr(&self) -> f64 {
        let step = self.steps + 1;
        self.decay.map_or(self.lr, |d| d.lr_at(self.lr, step))
    }

    /// Values of [`Self::state`]'s tensors: parameters, then the optimizer's moments.
    pub fn state_len(&self) -> usize {
        self.params.len() + self.velocity.len() + self.second.len()
    }

    pub fn step(&mut self, update: &[f32]) -> Result<(), ModelError> {
        if update.len() != self.params.len() {
            return Err(ModelError::Length {
                expected: self.params.len(),
                got: update.len(),
            });
        }
        let lr = self.next_lr();
        self.last_lr = Some(lr);
        self.steps += 1;
        self.rule.apply(
            lr,
            self.steps,
            &mut self.params,
            &mut self.velocity,
            &mut self.second,
            update,
        );
        Ok(())
    }

    /// Public diagnostics of the last step: `server_lr`, the learning rate it used (a public
    /// setting, or its decay at a public step count). Empty before the first step.
    pub fn diagnostics(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        if let Some(lr) = self.last_lr {
            m.insert("server_lr".into(), lr.into());
        }
        m
    }

    /// The parameters and moments, and the update count in `meta` (an object) under
    /// `server_steps`.
    pub fn state(&self, mut meta: serde_json::Value) -> ModelState {
        if let Some(obj) = meta.as_object_mut() {
            obj.insert(STEPS_KEY.into(), serde_json::json!(self.steps));
        }
        let mut tensors = Vec::with_capacity(self.state_len());
        tensors.extend_from_slice(&self.params);
        tensors.extend_from_slice(&self.velocity);
        tensors.extend_from_slice(&self.second);
        ModelState { meta, tensors }
    }

    pub fn restore(&mut self, state: &ModelState) -> Result<(), ModelError> {
        let n = self.params.len();
        if state.tensors.len() != self.state_len() {
            return Err(ModelError::Restore(format!(
                "checkpoint holds {} values, expected {} (params and the {} moments)",
                state.tensors.len(),
                self.state_len(),
                match self.rule {
                    ServerRule::Sgd { .. } => "server SGD's velocity",
                    ServerRule::Adam { .. } => "server Adam's two",
                }
            )));
        }
        let steps = state.meta.get(STEPS_KEY).and_then(|v| v.as_u64());
        if matches!(self.rule, ServerRule::Adam { .. }) && steps.is_none() {
            // Adam's bias correction needs the count; SGD checkpoints of older runs lack it.
            return Err(ModelError::Restore(format!(
                "checkpoint has no `{STEPS_KEY}`, which server Adam needs"
            )));
        }
        self.steps = steps.unwrap_or(0);
        self.params.copy_from_slice(&state.tensors[..n]);
        self.velocity.copy_from_slice(&state.tensors[n..2 * n]);
        self.second.copy_from_slice(&state.tensors[2 * n..]);
        Ok(())
    }
}

/// The best periodically evaluated parameters and their mean return (model selection on
/// held-out users: post-processing of released models, no privacy cost).
pub type BestModel = Option<(f64, Vec<f32>)>;

/// Keeps `params` as the best model when `eval_return` beats the one kept so far.
pub fn keep_best(best: &mut BestModel, eval_return: f64, params: &[f32]) {
    if best.as_ref().is_none_or(|(b, _)| eval_return > *b) {
        *best = Some((eval_return, params.to_vec()));
    }
}

/// The end-of-run evaluation of an RL model: the fields of `eval` (an evaluation in the periodic
/// `eval_*` keys) renamed `final_eval_*`, plus the periodic return that selected the model
/// (`selected_model_eval_return`); or `final_eval_error`.
pub fn final_evaluation_json(
    eval: anyhow::Result<serde_json::Value>,
    best: &BestModel,
) -> serde_json::Value {
    match eval {
        Ok(serde_json::Value::Object(fields)) => {
            let mut out: serde_json::Map<String, serde_json::Value> = fields
                .into_iter()
                .map(|(k, v)| (format!("final_{k}"), v))
                .collect();
            out.insert(
                "selected_model_eval_return".into(),
                serde_json::json!(best.as_ref().map(|(r, _)| *r)),
            );
            serde_json::Value::Object(out)
        }
        Ok(other) => other,
        Err(e) => serde_json::json!({ "final_eval_error": e.to_string() }),
    }
}

/// A checkpoint of `sgd` that also holds the best model: its parameters after the server
/// optimizer's state, its return in the metadata (`best_eval_return`), so a resumed run
/// exports the same model selection as an uninterrupted one.
pub fn state_with_best(
    sgd: &ServerOptimizer,
    mut meta: serde_json::Value,
    best: &BestModel,
) -> ModelState {
    if let Some(obj) = meta.as_object_mut() {
        obj.insert(
            "best_eval_return".into(),
            serde_json::json!(best.as_ref().map(|(r, _)| *r)),
        );
    }
    let mut st = sgd.state(meta);
    if let Some((_, p)) = best {
        st.tensors.extend_from_slice(p);
    }
    st
}

/// Restores a checkpoint written by [`state_with_best`] into `sgd` and returns the best model.
/// Checkpoints without one (older ones, or before any evaluation) restore with none.
pub fn restore_with_best(
    sgd: &mut ServerOptimizer,
    mut state: ModelState,
) -> Result<BestModel, ModelError> {
    let n = sgd.params.len();
    let opt = sgd.state_len();
    let best_return = state.meta.get("best_eval_return").and_then(|v| v.as_f64());
    let best = match best_return {
        Some(r) if state.tensors.len() == opt + n => Some((r, state.tensors.split_off(opt))),
        None if state.tensors.len() == opt => None,
        _ => {
            return Err(ModelError::Restore(format!(
                "checkpoint holds {} values for a model of {n} (best return {best_return:?})",
                state.tensors.len()
            )));
        }
    };
    sgd.restore(&state)?;
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgd_state_round_trips() {
        let mut a = ServerOptimizer::new(vec![0.0; 3], 0.5, 0.9);
        a.step(&[1.0, 2.0, 3.0]).unwrap();
        a.step(&[1.0, 0.0, -1.0]).unwrap();
        let st = a.state(serde_json::Value::Null);
        let mut b = ServerOptimizer::new(vec![0.0; 3], 0.5, 0.9);
        b.restore(&st).unwrap();
        a.step(&[0.5; 3]).unwrap();
        b.step(&[0.5; 3]).unwrap();
        assert_eq!(a.params, b.params);
        assert!(a.step(&[1.0]).is_err());
    }

    #[test]
    fn cosine_decay_goes_from_lr_to_final_and_survives_a_restore() {
        let d = CosineDecay {
            final_lr: 0.5,
            steps: 5,
        };
        // t = 1..=5 at x = 0, 1/4, 1/2, 3/4, 1: 0.5 + 2.5 (1 + cos(pi x)) / 2.
        let want = [
            3.0,
            0.5 + 1.25 * (1.0 + 0.5f64.sqrt()),
            1.75,
            0.5 + 1.25 * (1.0 - 0.5f64.sqrt()),
            0.5,
        ];
        for (t, w) in (1..=5).zip(want) {
            assert!(
                (d.lr_at(3.0, t) - w).abs() < 1e-12,
                "step {t}: {}",
                d.lr_at(3.0, t)
            );
        }
        assert_eq!(d.lr_at(3.0, 9), 0.5);
        // Plain SGD with a unit update moves each parameter by the step's learning rate.
        let mut a = ServerOptimizer::new(vec![0.0], 3.0, 0.0).with_decay(Some(d));
        a.step(&[1.0]).unwrap();
        a.step(&[1.0]).unwrap();
        let st = a.state(serde_json::json!({}));
        let mut b = ServerOptimizer::new(vec![0.0], 3.0, 0.0).with_decay(Some(d));
        b.restore(&st).unwrap();
        assert_eq!(b.next_lr(), want[2]);
        assert!(
            b.diagnostics().is_empty(),
            "no step taken since the restore"
        );
        for (t, w) in (3..=5).zip(&want[2..]) {
            b.step(&[1.0]).unwrap();
            let lr = b.diagnostics()["server_lr"].as_f64().unwrap();
            assert!((lr - w).abs() < 1e-12, "step {t}: {lr} vs {w}");
        }
        let total: f64 = want.iter().sum();
        assert!((b.params[0] as f64 - total).abs() < 1e-5, "{}", b.params[0]);
    }

    #[test]
    fn adam_matches_a_hand_computation_and_round_trips() {
        let rule = ServerRule::Adam {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-3,
        };
        let mut a = ServerOptimizer::with_rule(vec![1.0, -1.0], 0.01, rule);
        a.step(&[0.002, -0.5]).unwrap();
        // First step: m_hat = u, v_hat = u^2, so each coordinate moves lr * u / (|u| + eps).
        let want0 = 1.0 + 0.01 * 0.002 / (0.002 + 1e-3);
        let want1 = -1.0 + 0.01 * -0.5 / (0.5 + 1e-3);
        assert!((a.params[0] as f64 - want0).abs() < 1e-6, "{}", a.params[0]);
        assert!((a.params[1] as f64 - want1).abs() < 1e-6, "{}", a.params[1]);
        // Second step by hand for coordinate 0.
        let (m, v) = (0.9 * 0.1 * 0.002 + 0.1 * 0.004, 0.01 * 0.002f64.powi(2));
        let v = 0.99 * v + 0.01 * 0.004f64.powi(2);
        let step = 0.01 * (m / (1.0 - 0.81)) / ((v / (1.0 - 0.9801)).sqrt() + 1e-3);
        let before = a.params[0] as f64;
        a.step(&[0.004, 0.0]).unwrap();
        assert!((a.params[0] as f64 - (before + step)).abs() < 1e-6);
        // A checkpoint restores the moments and the step count (bias correction).
        let st = a.state(serde_json::json!({}));
        assert_eq!(st.tensors.len(), 6);
        let mut b = ServerOptimizer::with_rule(vec![0.0; 2], 0.01, rule);
        b.restore(&st).unwrap();
        assert_eq!(b.steps, 2);
        a.step(&[0.1, 0.1]).unwrap();
        b.step(&[0.1, 0.1]).unwrap();
        assert_eq!(a.params, b.params);
        // An SGD checkpoint (no second moment, no count) is refused with a message.
        let sgd = ServerOptimizer::new(vec![0.0; 2], 1.0, 0.0).state(serde_json::Value::Null);
        let err = b.restore(&sgd).unwrap_err().to_string();
        assert!(err.contains("expected 6"), "{err}");
    }

    #[test]
    fn final_evaluation_renames_fields_and_names_the_selection() {
        let eval = serde_json::json!({ "eval_return": 2.5, "eval_episodes": 4 });
        let best: BestModel = Some((3.0, vec![0.0]));
        let f = final_evaluation_json(Ok(eval), &best);
        assert_eq!(
            f,
            serde_json::json!({
                "final_eval_return": 2.5,
                "final_eval_episodes": 4,
                "selected_model_eval_return": 3.0,
            })
        );
        let f = final_evaluation_json(Err(anyhow::anyhow!("no env")), &None);
        assert_eq!(f, serde_json::json!({ "final_eval_error": "no env" }));
    }
}
