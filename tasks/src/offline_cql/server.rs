//! Offline discrete CQL by DP-SGD, server side: the Q-network, its target network, the Adam
//! server optimizer that takes one step per released noisy mean gradient, and the greedy
//! evaluation on held-out simulator episodes.
//!
//! Every round's offer carries the online parameters and then the target network's. The target
//! is a copy of an earlier released online network (refreshed every
//! `cql.target_update_interval` steps), so sending it is post-processing of released outputs.
//! Evaluations run the released greedy policy in the simulator with seeds disjoint from the
//! dataset's: a diagnostic that touches no unit's data. The exported network is the final one
//! (no selection by evaluation, which would tune on the environment).
//!
//! A dataset recorded in a Gymnasium environment (`task.dataset.env = "gymnasium:<id>"`) is
//! evaluated there, and the aggregator runs no Python (DESIGN §2.6): at each evaluation step
//! this model keeps the network as a snapshot in the state directory
//! (`eval-snapshots/step-S.safetensors`, [`write_snapshot`]) and records the evaluation as
//! `{"deferred": true, "snapshot": "step-S", "step": S, "dp_steps": D}`; its final evaluation
//! is `{"deferred": true, "curve": [...]}`. `fedrl run` (or `fedrl eval --deferred`) evaluates
//! the snapshots and the exported network through the bridge on the episodes this model would
//! have played (`scenarios/src/deferred_eval.rs`). A snapshot is written right after its step,
//! which is applied only once its release is durable in the ledger (free steps are
//! post-processing of released data), so only released networks are kept. A step number can
//! come back after a crash (the model resumes from its checkpoint, the ledger's later rounds
//! stay released), so a file is never replaced: the second network of a step is `step-S.1`,
//! and each evaluation names its own file.
//!
//! Selective DP-SGD (seed 000/002, Algorithm 3): the task's public schedule interleaves free
//! steps, noise-free CQL steps on a batch of D_stable (the released prefixes: public, so these
//! steps are post-processing), with the DP rounds. The free steps that precede DP step k + 1 run
//! right after step k is applied (so round k + 1's offer carries their result); those before
//! the first DP step run when D_stable arrives, and the last ones when the run ends.

use std::path::{Path, PathBuf};

use fedrl_common::selective::Schedule;
use fedrl_common::task::OfflineCqlTask;
use fedrl_rl::candle_core::Device;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::cql::loss_and_grad;
use fedrl_rl::offline::qnet::QNetSpec;
use fedrl_rl::offline::train::{CqlTrainer, evaluate_greedy_for};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use super::OfflineCqlTaskExt;
use crate::server::{ModelError, ModelState, ServerModel, TrainsOnStableData};

/// File name of the exported Q-network in the output directory.
pub const QNET_FILE: &str = "q_network.safetensors";

pub struct CqlModel {
    task: OfflineCqlTask,
    /// The environment the greedy policy is evaluated in: the generation spec's, or the stored
    /// dataset's (`task.dataset.env`, else the one it records).
    env: String,
    spec: QNetSpec,
    /// Online and target networks, Adam, the target schedule: the same learner the non-private
    /// trainer uses.
    learner: CqlTrainer,
    /// Online parameters, then the target network's: what every offer carries.
    offer: Vec<f32>,
    /// Selective DP-SGD: the public step schedule.
    schedule: Option<Schedule>,
    /// D_stable, once released.
    stable: Option<TransitionBatch>,
    /// DP steps applied, and free steps run (checkpointed).
    dp_done: u64,
    free_done: u64,
    /// Seconds spent in free steps by this process.
    free_s: f64,
    /// The periodic evaluations by training step (DP and free steps together: a Selective run
    /// with p = 0 has no DP round to hang them on), checkpointed with the model.
    curve: Vec<serde_json::Value>,
    /// How many of `curve`'s evaluations the rounds' metrics lines have seen.
    reported: usize,
    /// A Gymnasium environment: evaluations are deferred to `fedrl run` (no Python here), which
    /// evaluates the snapshots kept in the state directory.
    deferred: bool,
    /// The aggregator's state directory (where deferred evaluations' snapshots are kept).
    state_dir: Option<PathBuf>,
}

impl CqlModel {
    pub fn new(task: &OfflineCqlTask) -> anyhow::Result<Self> {
        let spec = task.qnet_spec()?;
        let learner = CqlTrainer::new(&spec, &task.cql);
        let (env, _) = crate::stored::source_env(&task.dataset)?;
        let mut m = CqlModel {
            task: task.clone(),
            env,
            spec,
            learner,
            offer: Vec::new(),
            schedule: task.selective.as_ref().map(Schedule::new),
            stable: None,
            dp_done: 0,
            free_done: 0,
            free_s: 0.0,
            curve: Vec::new(),
            reported: 0,
            deferred: super::evaluates_in_gymnasium(task),
            state_dir: None,
        };
        m.refresh_offer();
        Ok(m)
    }

    fn refresh_offer(&mut self) {
        self.offer.clear();
        self.offer.extend_from_slice(&self.learner.params);
        self.offer.extend_from_slice(&self.learner.target);
    }

    /// The online Q-network's parameters.
    pub fn online(&self) -> &[f32] {
        &self.learner.params
    }

    /// DP-SGD steps applied so far.
    pub fn steps(&self) -> u64 {
        self.learner.steps()
    }

    /// After a training step (DP or free): every `eval_every` steps, the greedy policy's return
    /// on held-out episodes, recorded in the curve.
    fn after_step(&mut self) {
        let step = self.dp_done + self.free_done;
        if !step.is_multiple_of(self.task.eval_every.max(1)) {
            return;
        }
        let mut e = if self.deferred {
            // A Gymnasium environment's evaluations cannot run here (no Python in the
            // aggregator): the network is kept for `fedrl run` to evaluate.
            self.keep_snapshot(step)
        } else {
            self.evaluate_with(self.task.eval_episodes, self.task.eval_seed)
                .unwrap_or_else(|e| serde_json::json!({ "eval_error": e.to_string() }))
        };
        e["step"] = step.into();
        e["dp_steps"] = self.dp_done.into();
        self.curve.push(e);
    }

    /// Free steps the schedule has run before `dp_done` DP steps are applied, counting the ones
    /// after the last DP step only when `to_end`.
    fn free_due(&self, to_end: bool) -> u64 {
        let Some(s) = &self.schedule else {
            return 0;
        };
        let k = s.dp_steps();
        let upto = if to_end { k } else { self.dp_done.min(k) };
        (0..=upto).map(|i| s.gap_after(i)).sum()
    }

    /// Runs the free steps due: noise-free CQL steps on uniform batches of D_stable with the
    /// same Adam and target schedule as the DP steps.
    fn run_free_steps(&mut self, to_end: bool) -> anyhow::Result<()> {
        let due = self.free_due(to_end);
        if self.free_done >= due {
            return Ok(());
        }
        let Some(sel) = &self.task.selective else {
            return Ok(());
        };
        let Some(stable) = self.stable.take() else {
            anyhow::bail!("free steps are due but D_stable has not been released");
        };
        let result = self.free_steps_on(&stable, due, sel.stable_batch as usize, sel.schedule_seed);
        self.stable = Some(stable);
        result
    }

    /// [`CqlModel::run_free_steps`] with D_stable in hand.
    fn free_steps_on(
        &mut self,
        stable: &TransitionBatch,
        due: u64,
        batch_n: usize,
        seed: u64,
    ) -> anyhow::Result<()> {
        if stable.is_empty() {
            // Nothing was released: a free step has no data; skip them (recorded as run).
            tracing::warn!(
                skipped = due - self.free_done,
                "D_stable is empty: the schedule's free steps are skipped"
            );
            self.free_done = due;
            return Ok(());
        }
        let device = Device::Cpu;
        let started = std::time::Instant::now();
        let first = self.free_done;
        while self.free_done < due {
            let mut rng =
                Xoshiro256PlusPlus::seed_from_u64(seed ^ self.free_done.wrapping_mul(0x9E37_79B9));
            let rows: Vec<usize> = (0..batch_n)
                .map(|_| rng.random_range(0..stable.len()))
                .collect();
            let batch = stable.select(&rows);
            let (_, grad) = loss_and_grad(
                &self.spec,
                &self.task.cql,
                &self.learner.params,
                &self.learner.target,
                &batch,
                &device,
            )?;
            self.learner.apply(&grad);
            self.free_done += 1;
            self.after_step();
            if (self.free_done - first).is_multiple_of(1000) {
                tracing::info!(
                    free_steps = self.free_done,
                    of = self.free_due(true),
                    seconds = started.elapsed().as_secs_f64(),
                    "free steps on D_stable"
                );
            }
        }
        self.refresh_offer();
        self.free_s += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// A deferred evaluation (Gymnasium environment): keeps the online network after training
    /// step `step` as a snapshot and returns the evaluation's mark, `{"deferred": true,
    /// "snapshot": NAME}` (`eval_error` instead of the name when it could not be kept).
    fn keep_snapshot(&self, step: u64) -> serde_json::Value {
        let kept = match &self.state_dir {
            Some(dir) => {
                write_snapshot(dir, step, &self.spec, self.online()).map_err(|e| format!("{e:#}"))
            }
            None => Err("no state directory to keep the snapshot in".to_string()),
        };
        match kept {
            Ok(name) => serde_json::json!({ "deferred": true, "snapshot": name }),
            Err(e) => serde_json::json!({
                "deferred": true,
                "eval_error": format!("the released network could not be kept for its evaluation: {e}"),
            }),
        }
    }

    fn evaluate_with(&self, episodes: usize, seed: u64) -> anyhow::Result<serde_json::Value> {
        let r = evaluate_greedy_for(
            &self.spec,
            self.online(),
            &self.env,
            episodes,
            seed,
            self.task.eval_max_steps,
        )?;
        Ok(serde_json::json!({
            "eval_return": r.mean,
            "eval_return_std": r.std,
            "eval_episodes": r.returns.len(),
        }))
    }
}

impl ServerModel for CqlModel {
    fn params(&self) -> &[f32] {
        &self.offer
    }

    /// One Adam descent step on the online network with the released noisy mean gradient, then
    /// the target refresh when its interval is reached.
    fn apply(&mut self, noisy_mean_gradient: &[f32]) -> Result<(), ModelError> {
        let dim = self.spec.dim();
        if noisy_mean_gradient.len() != dim {
            return Err(ModelError::Length {
                expected: dim,
                got: noisy_mean_gradient.len(),
            });
        }
        self.learner.apply(noisy_mean_gradient);
        self.dp_done += 1;
        self.after_step();
        if self.schedule.is_some() {
            self.run_free_steps(false)
                .map_err(|e| ModelError::Other(format!("free steps after a DP step: {e}")))?;
        }
        self.refresh_offer();
        Ok(())
    }

    /// The Adam learning rate (a public setting) and the steps taken so far (public counts:
    /// one DP step per released round, free steps by the public schedule).
    fn diagnostics(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert("server_lr".into(), self.task.cql.learning_rate.into());
        m.insert("dp_steps".into(), self.dp_done.into());
        if self.schedule.is_some() {
            m.insert("free_steps".into(), self.free_done.into());
        }
        m
    }

    /// The offer (online, then target) followed by Adam's state.
    fn state(&self) -> ModelState {
        let mut tensors = self.offer.clone();
        tensors.extend(self.learner.adam.state());
        ModelState {
            meta: serde_json::json!({
                "model": "offline_cql",
                "steps": self.steps(),
                "dp_steps": self.dp_done,
                "free_steps": self.free_done,
                "curve": self.curve,
            }),
            tensors,
        }
    }

    fn restore(&mut self, state: ModelState) -> Result<(), ModelError> {
        let dim = self.spec.dim();
        if state.tensors.len() < 2 * dim {
            return Err(ModelError::Restore(format!(
                "the checkpoint has {} values, the Q-networks alone need {}",
                state.tensors.len(),
                2 * dim
            )));
        }
        self.learner
            .adam
            .restore(&state.tensors[2 * dim..])
            .map_err(|e| ModelError::Restore(e.to_string()))?;
        self.learner.params.copy_from_slice(&state.tensors[..dim]);
        self.learner
            .target
            .copy_from_slice(&state.tensors[dim..2 * dim]);
        self.dp_done = state.meta["dp_steps"].as_u64().unwrap_or(0);
        self.free_done = state.meta["free_steps"].as_u64().unwrap_or(0);
        self.curve = state.meta["curve"].as_array().cloned().unwrap_or_default();
        self.reported = self.curve.len();
        self.refresh_offer();
        Ok(())
    }

    fn stable_data(&mut self) -> Option<&mut dyn TrainsOnStableData> {
        Some(self)
    }

    fn set_state_dir(&mut self, dir: &Path) -> anyhow::Result<()> {
        self.state_dir = Some(dir.to_path_buf());
        Ok(())
    }

    fn finish(&mut self) -> anyhow::Result<()> {
        if self.schedule.is_some() && self.stable.is_some() {
            self.run_free_steps(true)?;
        }
        Ok(())
    }

    /// The evaluation made at the last `eval_every` boundary of training steps since the
    /// previous round, if any (the curve has them all).
    fn evaluate(&mut self, _round: u64) -> Option<serde_json::Value> {
        let new = self.curve.len() > self.reported;
        self.reported = self.curve.len();
        new.then(|| self.curve.last().cloned()).flatten()
    }

    fn final_evaluation(&mut self) -> Option<serde_json::Value> {
        // Other episodes than the periodic evaluations'.
        let seed = final_eval_seed(&self.task);
        if self.deferred {
            // `fedrl run` fills it in from the exported network, and the curve's evaluations
            // from their snapshots (the aggregator runs no Python).
            let mut out = serde_json::json!({ "deferred": true, "curve": self.curve });
            if self.schedule.is_some() {
                out["dp_steps"] = self.dp_done.into();
                out["free_steps"] = self.free_done.into();
                out["free_steps_seconds"] = self.free_s.into();
            }
            return Some(out);
        }
        let mut out = match self.evaluate_with(self.task.final_eval_episodes, seed) {
            Ok(e) => serde_json::json!({
                "final_eval_return": e["eval_return"],
                "final_eval_return_std": e["eval_return_std"],
                "final_eval_episodes": e["eval_episodes"],
            }),
            Err(e) => serde_json::json!({ "final_eval_error": e.to_string() }),
        };
        if let Some(mean) = out["final_eval_return"].as_f64() {
            let horizon = match self.task.eval_max_steps {
                0 => fedrl_sim::list()
                    .into_iter()
                    .find(|e| e.id == self.env)
                    .map_or(0, |e| u64::from(e.max_episode_steps)),
                h => h,
            };
            if let Some((score, how)) = normalized_score(&self.env, mean, horizon) {
                out["final_normalized_score"] = score.into();
                out["normalization"] = how.into();
            }
        }
        out["curve"] = self.curve.clone().into();
        if self.schedule.is_some() {
            // The schedule is public; so are the step counts it produced.
            out["dp_steps"] = self.dp_done.into();
            out["free_steps"] = self.free_done.into();
            out["free_steps_seconds"] = self.free_s.into();
        }
        Some(out)
    }

    fn export(&self, dir: &Path) -> anyhow::Result<()> {
        self.spec.save(&dir.join(QNET_FILE), self.online())?;
        Ok(())
    }
}

impl TrainsOnStableData for CqlModel {
    fn set_stable_data(&mut self, data: TransitionBatch) -> anyhow::Result<()> {
        if self.schedule.is_none() {
            anyhow::bail!("released data for a task without a selective schedule");
        }
        if data.obs_dim != self.spec.obs_dim {
            anyhow::bail!(
                "D_stable has observations of {} values, the Q-network expects {}",
                data.obs_dim,
                self.spec.obs_dim
            );
        }
        self.stable = Some(data);
        // The free steps before the first DP step (all of them when there is none).
        self.run_free_steps(false)
    }
}

/// Where the snapshot `name` of a deferred evaluation lives in the state directory `dir`.
pub fn snapshot_path(dir: &Path, name: &str) -> PathBuf {
    crate::eval_snapshots::path(dir, name)
}

/// Keeps `params`, the online network after training step `step`, as a snapshot in the state
/// directory `dir` ([`crate::eval_snapshots::keep`]) and returns its name: `step-S`, or
/// `step-S.K` (the first K free) when an earlier network of that step is kept already (a step
/// number comes back after a crash; the rows that name the earlier file keep their network).
pub fn write_snapshot(
    dir: &Path,
    step: u64,
    spec: &QNetSpec,
    params: &[f32],
) -> anyhow::Result<String> {
    let base = format!("step-{step:08}");
    let name = std::iter::once(base.clone())
        .chain((1..).map(|k| format!("{base}.{k}")))
        .find(|n| !snapshot_path(dir, n).exists())
        .unwrap_or(base);
    crate::eval_snapshots::keep(dir, &name, |tmp| Ok(spec.save(tmp, params)?))?;
    Ok(name)
}

/// Reads the snapshot `name` from the state directory `dir`: the network's shape and
/// parameters.
pub fn read_snapshot(dir: &Path, name: &str) -> anyhow::Result<(QNetSpec, Vec<f32>)> {
    let path = snapshot_path(dir, name);
    Ok(QNetSpec::load_file(&path)?)
}

/// The reset seeds' base of a task's final evaluation: other episodes than the periodic
/// evaluations'.
pub fn final_eval_seed(task: &OfflineCqlTask) -> u64 {
    task.eval_seed.wrapping_add(0x5EED_F1A1)
}

/// Seed 000/002's normalised score of a mean evaluation return at an evaluation horizon of
/// `horizon` steps: CartPole return / horizon (reward 1 a step), Acrobot (return + horizon) /
/// horizon (reward -1 a step until the goal), HIV return / 1e6. `None` for other environments,
/// and the formula in words beside the score.
fn normalized_score(env: &str, mean_return: f64, horizon: u64) -> Option<(f64, String)> {
    let h = horizon as f64;
    match env {
        "CartPole-v1" if horizon > 0 => Some((
            mean_return / h,
            format!("return / {horizon}, {horizon} the evaluation horizon"),
        )),
        "Acrobot-v1" if horizon > 0 => Some((
            (mean_return + h) / h,
            format!("(return + {horizon}) / {horizon}, {horizon} the evaluation horizon"),
        )),
        e if e.starts_with("HIVTreatment") => Some((mean_return / 1e6, "return / 1e6".into())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_follow_seed_000s_normalisation() {
        let s = |env, r, h| normalized_score(env, r, h).map(|(x, _)| x);
        assert_eq!(s("CartPole-v1", 663.5, 1000), Some(0.6635));
        assert_eq!(s("Acrobot-v1", -83.0, 200), Some(0.585));
        assert_eq!(s("Acrobot-v1", -200.0, 200), Some(0.0));
        assert_eq!(s("HIVTreatment20d-v0", 2_500_000.0, 0), Some(2.5));
        assert_eq!(s("Pendulum-v1", -150.0, 200), None);
        assert_eq!(s("CartPole-v1", 10.0, 0), None);
    }

    fn model() -> CqlModel {
        let task: OfflineCqlTask = serde_json::from_value(serde_json::json!({
            "dataset": { "env": "CartPole-v1", "units": 4, "behaviour": { "kind": "random" } },
            "cql": { "hidden": [8], "target_update_interval": 2 },
            "eval_every": 1,
            "eval_episodes": 1,
            "eval_max_steps": 5,
        }))
        .unwrap();
        CqlModel::new(&task).unwrap()
    }

    #[test]
    fn the_offer_carries_online_then_target_and_a_checkpoint_resumes_exactly() {
        let mut m = model();
        let dim = m.spec.dim();
        assert_eq!(m.params().len(), 2 * dim);
        let g: Vec<f32> = (0..dim).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect();
        m.apply(&g).unwrap(); // step 1: the target is refreshed (d3rlpy's schedule)
        assert_eq!(&m.params()[dim..], m.online());
        m.apply(&g).unwrap(); // step 2: the target keeps step 1's network
        assert_ne!(&m.params()[dim..], m.online());
        assert!(m.apply(&g[1..]).is_err(), "a gradient of the wrong length");
        let st = m.state();
        let mut r = model();
        r.restore(st.clone()).unwrap();
        assert_eq!(r.params(), m.params());
        assert_eq!(m.curve.len(), 2, "an evaluation after each step");
        assert_eq!(
            m.evaluate(2).unwrap()["step"],
            2,
            "the round's line gets the latest"
        );
        assert_eq!(r.curve, m.curve, "the evaluations so far come back too");
        assert_eq!(r.steps(), 2);
        // The next step is the same from the resumed model (Adam's moments came back too).
        m.apply(&g).unwrap();
        r.apply(&g).unwrap();
        assert_eq!(r.params(), m.params());
        let mut short = st;
        short.tensors.truncate(dim);
        assert!(model().restore(short).is_err());
    }

    /// A dataset recorded in Gymnasium: the aggregator runs no Python, so each evaluation step
    /// keeps the network as a snapshot and marks the evaluation deferred; a step number that
    /// comes back (a run resumed from an earlier checkpoint after a crash) gets a file of its
    /// own, and the earlier network stays for the rows that name it.
    #[test]
    fn a_gymnasium_dataset_keeps_a_snapshot_at_each_evaluation_step() {
        let task: OfflineCqlTask = serde_json::from_value(serde_json::json!({
            "dataset": {
                "env": "gymnasium:CartPole-v1",
                "units": 4,
                "behaviour": { "kind": "random" },
                "gymnasium": { "obs_dim": 4, "actions": 2 },
            },
            "cql": { "hidden": [8], "target_update_interval": 2 },
            "eval_every": 2,
            "eval_episodes": 3,
            "eval_max_steps": 5,
        }))
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut m = CqlModel::new(&task).unwrap();
        m.set_state_dir(dir.path()).unwrap();
        let dim = m.spec.dim();
        let g: Vec<f32> = (0..dim).map(|i| ((i % 5) as f32 - 2.0) * 0.01).collect();
        m.apply(&g).unwrap();
        assert_eq!(m.evaluate(0), None, "step 1 is no evaluation step");
        m.apply(&g).unwrap();
        let mark = serde_json::json!({
            "deferred": true,
            "snapshot": "step-00000002",
            "step": 2,
            "dp_steps": 2,
        });
        assert_eq!(m.evaluate(1), Some(mark.clone()));
        let (spec, params) = read_snapshot(dir.path(), "step-00000002").unwrap();
        assert_eq!(spec, m.spec);
        assert_eq!(params, m.online());
        let fe = m.final_evaluation().unwrap();
        assert_eq!(fe, serde_json::json!({ "deferred": true, "curve": [mark] }));

        // The same step again, from another network: a file of its own.
        let mut again = CqlModel::new(&task).unwrap();
        again.set_state_dir(dir.path()).unwrap();
        let h: Vec<f32> = g.iter().map(|x| -x).collect();
        again.apply(&h).unwrap();
        again.apply(&h).unwrap();
        assert_eq!(again.evaluate(1).unwrap()["snapshot"], "step-00000002.1");
        assert_eq!(
            read_snapshot(dir.path(), "step-00000002").unwrap().1,
            params
        );
        assert_eq!(
            read_snapshot(dir.path(), "step-00000002.1").unwrap().1,
            again.online()
        );
        // Without a state directory the evaluation says why it has no snapshot.
        let mut lost = CqlModel::new(&task).unwrap();
        lost.apply(&g).unwrap();
        lost.apply(&g).unwrap();
        let e = lost.evaluate(1).unwrap();
        assert_eq!(e["deferred"], true);
        assert!(
            e["eval_error"]
                .as_str()
                .unwrap()
                .contains("state directory"),
            "{e}"
        );
        assert!(e.get("snapshot").is_none(), "{e}");
    }
}
