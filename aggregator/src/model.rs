//! The server-side model trait, its SGD server optimizer, and the mean-estimation model.

use fedrl_common::scenario::MeanEstimationTask;
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
    /// Optional evaluation after the release of `round` (written to `metrics.jsonl`).
    fn evaluate(&mut self, round: u64) -> Option<serde_json::Value> {
        let _ = round;
        None
    }
    /// True once the model wants training to stop (e.g. an evaluation reached its target).
    fn finished(&self) -> bool {
        false
    }
    /// The final evaluation at the end of the run (written into the report).
    fn final_evaluation(&mut self) -> Option<serde_json::Value> {
        None
    }
    /// Expert-level runs: D_stable, the released prefixes, for the noise-free steps of the
    /// schedule. Called once the release is accounted in the ledger. Other models refuse it.
    fn set_stable_data(&mut self, _data: fedrl_rl::offline::TransitionBatch) -> anyhow::Result<()> {
        anyhow::bail!("this task trains on no released data")
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

/// Server SGD with momentum: `v = momentum * v + u; theta += lr * v` where `u` is the released
/// noisy mean update (client updates point in the direction to move, so the server adds).
#[derive(Clone, Debug)]
pub struct ServerSgd {
    pub params: Vec<f32>,
    pub velocity: Vec<f32>,
    /// Server learning rate.
    pub lr: f64,
    /// Momentum in [0, 1); 0 is plain FedAvg/FedSGD.
    pub momentum: f64,
}

impl ServerSgd {
    pub fn new(params: Vec<f32>, lr: f64, momentum: f64) -> Self {
        let velocity = vec![0.0; params.len()];
        ServerSgd {
            params,
            velocity,
            lr,
            momentum,
        }
    }

    pub fn step(&mut self, update: &[f32]) -> Result<(), ModelError> {
        if update.len() != self.params.len() {
            return Err(ModelError::Length {
                expected: self.params.len(),
                got: update.len(),
            });
        }
        for ((p, v), u) in self
            .params
            .iter_mut()
            .zip(self.velocity.iter_mut())
            .zip(update)
        {
            *v = (self.momentum * *v as f64 + *u as f64) as f32;
            *p = (*p as f64 + self.lr * *v as f64) as f32;
        }
        Ok(())
    }

    pub fn state(&self, meta: serde_json::Value) -> ModelState {
        let mut tensors = self.params.clone();
        tensors.extend_from_slice(&self.velocity);
        ModelState { meta, tensors }
    }

    pub fn restore(&mut self, state: &ModelState) -> Result<(), ModelError> {
        let n = self.params.len();
        if state.tensors.len() != 2 * n {
            return Err(ModelError::Restore(format!(
                "checkpoint holds {} values, expected {} (params + velocity)",
                state.tensors.len(),
                2 * n
            )));
        }
        self.params.copy_from_slice(&state.tensors[..n]);
        self.velocity.copy_from_slice(&state.tensors[n..]);
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
    sgd: &ServerSgd,
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
    sgd: &mut ServerSgd,
    mut state: ModelState,
) -> Result<BestModel, ModelError> {
    let n = sgd.params.len();
    let best_return = state.meta.get("best_eval_return").and_then(|v| v.as_f64());
    let best = match best_return {
        Some(r) if state.tensors.len() == 3 * n => Some((r, state.tensors.split_off(2 * n))),
        None if state.tensors.len() == 2 * n => None,
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

/// DP federated mean estimation, server side: theta starts at 0 and follows the released noisy
/// mean of `x_u - theta`. Evaluation compares with the simulation's true mean (known only
/// because this is a simulation; it is not derived from any user's data beyond the seed).
pub struct MeanEstimationModel {
    sgd: ServerSgd,
    truth: Vec<f32>,
}

impl MeanEstimationModel {
    pub fn new(task: &MeanEstimationTask) -> Self {
        MeanEstimationModel {
            sgd: ServerSgd::new(vec![0.0; task.dim], task.server_lr, 0.0),
            truth: task.true_mean(),
        }
    }
}

impl ServerModel for MeanEstimationModel {
    fn params(&self) -> &[f32] {
        &self.sgd.params
    }
    fn apply(&mut self, noisy_mean_update: &[f32]) -> Result<(), ModelError> {
        self.sgd.step(noisy_mean_update)
    }
    fn state(&self) -> ModelState {
        self.sgd
            .state(serde_json::json!({"model": "mean_estimation", "dim": self.truth.len()}))
    }
    fn restore(&mut self, state: ModelState) -> Result<(), ModelError> {
        self.sgd.restore(&state)
    }
    fn evaluate(&mut self, _round: u64) -> Option<serde_json::Value> {
        let err: f64 = self
            .sgd
            .params
            .iter()
            .zip(&self.truth)
            .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        Some(serde_json::json!({ "l2_error": err }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgd_state_round_trips() {
        let mut a = ServerSgd::new(vec![0.0; 3], 0.5, 0.9);
        a.step(&[1.0, 2.0, 3.0]).unwrap();
        a.step(&[1.0, 0.0, -1.0]).unwrap();
        let st = a.state(serde_json::Value::Null);
        let mut b = ServerSgd::new(vec![0.0; 3], 0.5, 0.9);
        b.restore(&st).unwrap();
        a.step(&[0.5; 3]).unwrap();
        b.step(&[0.5; 3]).unwrap();
        assert_eq!(a.params, b.params);
        assert!(a.step(&[1.0]).is_err());
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
