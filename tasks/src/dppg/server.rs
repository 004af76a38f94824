//! DPPG (seed 004), server side: the global policy and value network, the server optimizer that
//! applies each released noisy mean update, evaluation on held-out users, and the exported policy.
//!
//! Held-out users are never training users: periodic evaluations use ids
//! `users..users + eval_users`, the final evaluation the next `final_eval_users` ids, so the
//! reported return is measured on users that played no part in choosing the model. Evaluation
//! and model selection only touch released models and simulated users: post-processing, no
//! privacy cost. Which users and which reset seeds: [`super::held_out`].
//!
//! A `gymnasium:<id>` population's environments live in Python workers, which the aggregator
//! never starts: its model evaluates nothing itself. At each evaluation round it keeps the
//! released model as a snapshot in the state directory and marks the metrics line
//! `"eval": {"deferred": true}`; its final evaluation is `{"deferred": true}` and it exports the
//! last model. `fedrl run` then evaluates every snapshot through the bridge on the same users
//! and seeds, fills the lines, exports the best-evaluated snapshot and runs the final
//! evaluation (`scenarios/src/deferred_eval.rs`). `stop_at_return` is refused for them.
//!
//! For glucose simulators (UVA/Padova, Dosing) the final evaluation also reports the clinical
//! metrics of every held-out patient-day (time in range, hypo- and hyperglycaemia, LBGI/HBGI,
//! CVGA) on BG and CGM, pooled, per age group, their spread and the worst patient
//! (`final_evaluation.clinical`, see [`fedrl_sim::clinical`]). For UVA/Padova it also runs the
//! baseline controllers on the same held-out users and days (`final_evaluation.baselines`):
//! simglucose's basal-bolus controller, a PID controller with gains tuned per age group, and
//! the proportional controller. The PID is tuned on [`PID_TUNING_USERS`] simulated users drawn
//! after the held-out ones, never on training users (whose data only reaches the model through
//! the DP mechanism) nor on the users it is evaluated on.

use std::path::{Path, PathBuf};

use super::DppgTaskExt;
pub use super::held_out::Evaluation;
use super::held_out::{eval_seed, eval_setup, evaluate_envs, write_snapshot};
use fedrl_common::scenario::DppgTask;
use fedrl_common::task::ServerOptimizerKind;
use fedrl_rl::candle_core::Device;
use fedrl_rl::evaluate::ValueTarget;
use fedrl_rl::evaluate::evaluate_logged;
use fedrl_rl::{EvalConfig, ModelSpec, io};
use fedrl_sim::Env;
use fedrl_sim::clinical::{ClinicalReport, patient_label, summarize_episode};
use fedrl_sim::population::Population;

use crate::server::{
    BestModel, CosineDecay, EvaluationDone, EvaluationJob, ModelError, ModelState, ServerModel,
    ServerOptimizer, ServerRule, final_evaluation_json, keep_best, restore_with_best,
    state_with_best,
};

/// Simulated users the baseline PID is tuned on (about 10 per age group).
pub const PID_TUNING_USERS: u64 = 30;

/// File name of the exported policy in the output directory.
pub const POLICY_FILE: &str = "policy.safetensors";

/// The server optimizer's rule a task asks for.
fn server_rule(task: &DppgTask) -> ServerRule {
    match task.server_optimizer {
        ServerOptimizerKind::Sgd => ServerRule::Sgd {
            momentum: task.server_momentum,
        },
        ServerOptimizerKind::Adam => ServerRule::Adam {
            beta1: task.server_adam_beta1,
            beta2: task.server_adam_beta2,
            eps: task.server_adam_eps,
        },
    }
}

/// Environments, reset seeds and settings of one evaluation.
type EvalSetup = (Vec<Box<dyn Env>>, Vec<u64>, EvalConfig);

pub struct DppgModel {
    task: DppgTask,
    sgd: ServerOptimizer,
    /// The network, the users and the device of evaluations.
    held: HeldOut,
    /// First held-out user id (the scenario's number of training users).
    first_eval_user: u64,
    /// The best periodically evaluated parameters and their return.
    best: BestModel,
    reached_target: bool,
    /// A `gymnasium:<id>` population: evaluations are deferred to `fedrl run` (no Python here),
    /// which evaluates the snapshots kept in the state directory.
    deferred: bool,
    /// The aggregator's state directory (where deferred evaluations' snapshots are kept).
    state_dir: Option<PathBuf>,
}

/// What an evaluation on held-out users needs. Cheap to clone: a pipelined evaluation takes a
/// copy to its own thread.
#[derive(Clone)]
struct HeldOut {
    spec: ModelSpec,
    population: Population,
    episodes_per_env: usize,
    /// The value network's discounting, for the evaluation's value error.
    value_target: ValueTarget,
    /// Where evaluations run.
    device: Device,
}

impl HeldOut {
    /// The environments of users `first..first + n`.
    fn envs(&self, first: u64, n: u64) -> anyhow::Result<Vec<Box<dyn Env>>> {
        Ok((0..n)
            .map(|j| self.population.user_env(first + j))
            .collect::<Result<_, _>>()?)
    }

    /// Environments, reset seeds and settings of an evaluation on users `first..first + n`
    /// (the seeds and settings are [`eval_setup`]'s, as every DPPG evaluation's).
    fn setup(&self, first: u64, n: u64) -> anyhow::Result<EvalSetup> {
        let (seeds, cfg) = eval_setup(
            first..first + n,
            self.episodes_per_env,
            Some(self.value_target),
        );
        Ok((self.envs(first, n)?, seeds, cfg))
    }

    /// Mean return of `params` over held-out users `first..first + n`, one batched rollout.
    fn evaluate_on(&self, params: &[f32], first: u64, n: u64) -> anyhow::Result<Evaluation> {
        let mut envs = self.envs(first, n)?;
        evaluate_envs(
            &self.spec,
            params,
            &mut envs,
            first..first + n,
            self.episodes_per_env,
            Some(self.value_target),
            &self.device,
        )
    }
}

impl DppgModel {
    /// `training_users`: held-out evaluation users get ids from there on; `rounds`: the
    /// scenario's rounds, over which `server_lr_final` decays the server step; evaluations run
    /// on `device`.
    pub fn new(
        task: &DppgTask,
        training_users: u64,
        rounds: u64,
        device: Device,
    ) -> anyhow::Result<Self> {
        let spec = task.model_spec()?;
        let params = spec.init(task.model_seed);
        let decay = task.server_lr_final.map(|final_lr| CosineDecay {
            final_lr,
            steps: rounds,
        });
        Ok(Self {
            task: task.clone(),
            sgd: ServerOptimizer::with_rule(params, task.server_lr, server_rule(task))
                .with_decay(decay),
            held: HeldOut {
                spec,
                population: task.population()?,
                episodes_per_env: task.eval_episodes.max(1),
                value_target: super::held_out::value_target(task),
                device,
            },
            first_eval_user: training_users,
            best: None,
            reached_target: false,
            deferred: super::gymnasium_of(task).is_some(),
            state_dir: None,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.held.spec
    }

    /// Mean return of `params` over held-out users `first..first + n`, one batched rollout.
    pub fn evaluate_on(&self, params: &[f32], first: u64, n: u64) -> anyhow::Result<Evaluation> {
        self.held.evaluate_on(params, first, n)
    }

    /// [`Self::evaluate_on`], and for glucose simulators the clinical report of every
    /// patient-day played (`None` for other environments; an error message if a log could not
    /// be summarised, which leaves the return evaluation standing).
    pub fn evaluate_clinical(
        &self,
        params: &[f32],
        first: u64,
        n: u64,
    ) -> anyhow::Result<(Evaluation, Option<Result<ClinicalReport, String>>)> {
        let (mut envs, seeds, cfg) = self.held.setup(first, n)?;
        let h = &self.held;
        let (r, logs) = evaluate_logged(&h.spec, params, &mut envs, &seeds, &cfg, &h.device)?;
        let eval = Evaluation {
            mean: r.mean,
            std: r.std,
            episodes: r.returns.len(),
            policy_entropy: r.policy_entropy,
            value_rmse: r.value_rmse,
        };
        let mut days = Vec::new();
        for ep in &logs {
            let user = first + ep.env as u64;
            let label = patient_label(&self.held.population, user);
            match summarize_episode(&label, Some(user), &ep.samples) {
                Ok(d) => days.extend(d),
                Err(e) => return Ok((eval, Some(Err(format!("{label} (user {user}): {e}"))))),
            }
        }
        Ok((eval, ClinicalReport::new(days).map(Ok)))
    }

    /// The baseline controllers' clinical reports on held-out users `first..first + n`, on the
    /// days the policy's evaluation played (same users, same reset seeds); `None` for
    /// populations that are not UVA/Padova.
    pub fn baselines(&self, first: u64, n: u64) -> anyhow::Result<Option<serde_json::Value>> {
        use fedrl_sim::controllers::{
            self, BasalBolus, Controller, Pid, PidGrid, Proportional, tune_pid,
        };
        use fedrl_sim::population::UserParams;
        if !matches!(
            self.held.population.user_params(first)?,
            UserParams::Patient { .. }
        ) {
            return Ok(None);
        }
        let tuning_users = first + n..first + n + PID_TUNING_USERS;
        let started = std::time::Instant::now();
        let tuning = tune_pid(
            &self.held.population,
            tuning_users.clone(),
            &PidGrid::default(),
            0,
        )?;
        let tuning_s = started.elapsed().as_secs_f64();
        let mut out = serde_json::Map::new();
        for kind in ["basal-bolus", "pid", "proportional"] {
            let mut days = Vec::new();
            for j in 0..n {
                let user = first + j;
                let mut env = controllers::user_env(&self.held.population, user)?;
                let params = env.patient().params().clone();
                let group = fedrl_sim::clinical::group_of(&params.name);
                let mut ctl: Box<dyn Controller> = match kind {
                    "basal-bolus" => Box::new(BasalBolus::for_patient(&params)?),
                    "pid" => {
                        let g = tuning.iter().find(|t| t.group == group).ok_or_else(|| {
                            anyhow::anyhow!("no PID tuning user of age group {group}")
                        })?;
                        Box::new(Pid::new(g.gains, controllers::BB_TARGET_MG_DL))
                    }
                    _ => Box::new(Proportional::default()),
                };
                let seed = fedrl_rl::rollout::mix(eval_seed(user), 0);
                let log = controllers::run_episode(&mut env, ctl.as_mut(), seed)?;
                days.extend(summarize_episode(&params.name, Some(user), &log)?);
            }
            let report = ClinicalReport::new(days);
            out.insert(kind.into(), serde_json::to_value(&report)?);
        }
        out.insert(
            "pid_tuning".into(),
            serde_json::json!({
                "users": [tuning_users.start, tuning_users.end],
                "seconds": tuning_s,
                "groups": tuning,
            }),
        );
        Ok(Some(serde_json::Value::Object(out)))
    }

    /// The parameters that will be exported: the best evaluated ones, else the current ones.
    fn chosen(&self) -> &[f32] {
        self.best.as_ref().map_or(&self.sgd.params, |(_, p)| p)
    }

    /// Whether the model released in `round` is evaluated.
    fn evaluates_after(&self, round: u64) -> bool {
        (round + 1).is_multiple_of(self.task.eval_every.max(1))
    }

    /// A deferred evaluation (Gymnasium population): keeps the model released in `round` as
    /// its snapshot and returns the metrics line's mark, `{"deferred": true}` (with
    /// `eval_error` when the snapshot could not be kept).
    fn keep_snapshot(&self, round: u64) -> serde_json::Value {
        let kept = match &self.state_dir {
            Some(dir) => write_snapshot(dir, round, &self.held.spec, &self.sgd.params)
                .map(|_| ())
                .map_err(|e| format!("{e:#}")),
            None => Err("no state directory to keep the snapshot in".to_string()),
        };
        match kept {
            Ok(()) => serde_json::json!({ "deferred": true }),
            Err(e) => serde_json::json!({
                "deferred": true,
                "eval_error": format!("the released model could not be kept for its evaluation: {e}"),
            }),
        }
    }
}

impl ServerModel for DppgModel {
    fn params(&self) -> &[f32] {
        &self.sgd.params
    }

    fn apply(&mut self, noisy_mean_update: &[f32]) -> Result<(), ModelError> {
        self.sgd.step(noisy_mean_update)
    }

    fn diagnostics(&self) -> serde_json::Map<String, serde_json::Value> {
        self.sgd.diagnostics()
    }

    fn state(&self) -> ModelState {
        let meta = serde_json::json!({
            "model": "dppg",
            "population": self.task.population,
            "reached_target": self.reached_target,
        });
        state_with_best(&self.sgd, meta, &self.best)
    }

    fn restore(&mut self, state: ModelState) -> Result<(), ModelError> {
        self.reached_target = state
            .meta
            .get("reached_target")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        self.best = restore_with_best(&mut self.sgd, state)?;
        Ok(())
    }

    fn set_state_dir(&mut self, dir: &Path) -> anyhow::Result<()> {
        self.state_dir = Some(dir.to_path_buf());
        Ok(())
    }

    fn evaluate(&mut self, round: u64) -> Option<serde_json::Value> {
        if self.deferred {
            return self
                .evaluates_after(round)
                .then(|| self.keep_snapshot(round));
        }
        let job = self.evaluation_job(round)?;
        Some(self.evaluated(job.run()))
    }

    fn evaluation_job(&self, round: u64) -> Option<EvaluationJob> {
        // A deferred evaluation is a snapshot kept at once ([`Self::evaluate`]), no job.
        if self.deferred || !self.evaluates_after(round) {
            return None;
        }
        let (held, first) = (self.held.clone(), self.first_eval_user);
        let n = self.task.eval_users.max(1);
        Some(EvaluationJob::new(
            round,
            self.sgd.params.clone(),
            move |params| match held.evaluate_on(params, first, n) {
                Ok(e) => e.to_json(),
                Err(e) => serde_json::json!({ "eval_error": e.to_string() }),
            },
        ))
    }

    fn evaluated(&mut self, done: EvaluationDone) -> serde_json::Value {
        if let Some(mean) = done.value.get("eval_return").and_then(|v| v.as_f64()) {
            keep_best(&mut self.best, mean, &done.params);
            if self.task.stop_at_return.is_some_and(|t| mean >= t) {
                self.reached_target = true;
            }
        }
        done.value
    }

    fn finished(&self) -> bool {
        self.reached_target
    }

    fn final_evaluation(&mut self) -> Option<serde_json::Value> {
        if self.deferred {
            // `fedrl run` evaluates the exported model (the best snapshot) on the final users.
            return Some(serde_json::json!({ "deferred": true }));
        }
        let first = self.first_eval_user + self.task.eval_users.max(1);
        let n = self.task.final_eval_users.max(1);
        let (eval, clinical) = match self.evaluate_clinical(self.chosen(), first, n) {
            Ok((e, c)) => (Ok(e.to_json()), c),
            Err(e) => (Err(e), None),
        };
        let mut out = final_evaluation_json(eval, &self.best);
        if let (Some(c), Some(obj)) = (clinical, out.as_object_mut()) {
            let value = c
                .and_then(|c| serde_json::to_value(&c).map_err(|e| e.to_string()))
                .unwrap_or_else(|e| serde_json::json!({ "error": e }));
            obj.insert("clinical".into(), value);
            match self.baselines(first, n) {
                Ok(Some(b)) => {
                    obj.insert("baselines".into(), b);
                }
                Ok(None) => {}
                Err(e) => {
                    obj.insert(
                        "baselines".into(),
                        serde_json::json!({ "error": e.to_string() }),
                    );
                }
            }
        }
        Some(out)
    }

    fn export(&self, dir: &Path) -> anyhow::Result<()> {
        io::save(&dir.join(POLICY_FILE), &self.held.spec, self.chosen())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> DppgModel {
        let task: DppgTask = serde_json::from_value(serde_json::json!({
            "population": "CartPole-v1",
            "eval_every": 1,
            "eval_users": 2,
            "final_eval_users": 2,
            "local": { "hidden": [4] },
        }))
        .unwrap();
        DppgModel::new(&task, 10, 100, Device::Cpu).unwrap()
    }

    #[test]
    fn final_evaluation_of_uva_padova_reports_clinical_metrics() {
        let task: DppgTask = serde_json::from_value(serde_json::json!({
            "population": "uva-padova",
            "eval_users": 1,
            "final_eval_users": 3,
            "local": {
                "hidden": [4],
                "obs_offset": [140.0],
                "obs_scale": [60.0],
                "action_low": [0.0],
                "action_high": [0.04],
                "init_log_std": -1.0,
                "action_repeat": 10,
            },
        }))
        .unwrap();
        let mut m = DppgModel::new(&task, 10, 100, Device::Cpu).unwrap();
        let f = m.final_evaluation().unwrap();
        assert!(f["final_eval_return"].is_f64(), "{f}");
        let c = &f["clinical"];
        let days = c["patient_days"].as_array().expect("patient days");
        assert_eq!(days.len(), 3, "one day per held-out user");
        for (j, d) in days.iter().enumerate() {
            // Held-out users 11, 12, 13 (10 training users, 1 periodic evaluation user).
            assert_eq!(d["user"], 11 + j as u64);
            let name = d["patient"].as_str().unwrap();
            assert_eq!(
                d["group"].as_str().unwrap(),
                fedrl_sim::clinical::group_of(name)
            );
            assert_ne!(d["group"], "all", "{name} is a UVA/Padova patient");
            // A day at 3 minutes unless the patient left the simulator's range.
            assert!(d["samples"].as_u64().unwrap() <= 481);
            for series in ["bg", "cgm"] {
                let g = &d[series];
                let x = |k: &str| g[k].as_f64().unwrap();
                let sum = x("time_in_range") + x("time_below_70") + x("time_above_180");
                assert!((sum - 1.0).abs() < 1e-9, "{series}: {sum}");
                assert!(x("time_below_54") <= x("time_below_70"));
                assert!(x("time_above_250") <= x("time_above_180"));
                assert!(x("mean_mg_dl") > 10.0 && x("mean_mg_dl") < 600.0);
                assert!((x("lbgi") + x("hbgi") - x("risk_index")).abs() < 1e-9);
            }
            let p = &d["cvga_bg"];
            assert!(p["min_mg_dl"].as_f64() <= p["max_mg_dl"].as_f64());
            assert!(["A", "B", "C", "D", "E"].contains(&p["zone"].as_str().unwrap()));
        }
        let pooled = &c["pooled"];
        assert_eq!(pooled["patient_days"], 3);
        let tir = pooled["bg"]["time_in_range"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&tir));
        let z = &pooled["cvga_bg_zones"];
        let zsum: f64 = ["a", "b", "c", "d", "e"]
            .iter()
            .map(|k| z[*k].as_f64().unwrap())
            .sum();
        assert!((zsum - 1.0).abs() < 1e-9);
        let worst = pooled["worst"]["bg"]["time_in_range"].as_f64().unwrap();
        assert_eq!(
            worst,
            pooled["spread_bg"]["min"]["time_in_range"]
                .as_f64()
                .unwrap()
        );
        // The baselines ran on the same held-out users; PID gains were tuned on others.
        let b = &f["baselines"];
        for kind in ["basal-bolus", "pid", "proportional"] {
            let bdays = b[kind]["patient_days"].as_array().expect(kind);
            assert_eq!(bdays.len(), 3, "{kind}");
            for (d, bd) in days.iter().zip(bdays) {
                assert_eq!((&d["user"], &d["patient"]), (&bd["user"], &bd["patient"]));
            }
            let tir = b[kind]["pooled"]["bg"]["time_in_range"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&tir), "{kind}: {tir}");
        }
        let tuned = b["pid_tuning"]["users"].as_array().unwrap();
        assert_eq!(tuned[0], 14, "tuning users start after the held-out ones");
        let groups = c["groups"].as_object().unwrap();
        let in_groups: u64 = groups
            .values()
            .map(|g| g["patient_days"].as_u64().unwrap())
            .sum();
        assert_eq!(in_groups, 3);
    }

    #[test]
    fn final_evaluation_of_other_envs_has_no_clinical_report() {
        let mut m = model();
        let f = m.final_evaluation().unwrap();
        assert!(f["final_eval_return"].is_f64());
        assert!(f.get("clinical").is_none());
        assert!(f.get("baselines").is_none());
    }

    /// `server_optimizer = "adam"` in a scenario's task runs Adam on the released updates, and
    /// its checkpoint (both moments and the step count) resumes the same trajectory.
    #[test]
    fn server_adam_from_the_task_steps_and_resumes() {
        let adam = || {
            let task: DppgTask = serde_json::from_value(serde_json::json!({
                "population": "CartPole-v1",
                "server_optimizer": "adam",
                "server_lr": 0.01,
                "local": { "hidden": [4] },
            }))
            .unwrap();
            fedrl_common::task::Task::Dppg(task.clone())
                .validate()
                .unwrap();
            DppgModel::new(&task, 10, 100, Device::Cpu).unwrap()
        };
        let mut m = adam();
        let start = m.params().to_vec();
        let u: Vec<f32> = (0..start.len()).map(|i| (i as f32 - 7.0) * 1e-3).collect();
        m.apply(&u).unwrap();
        // Adam's first step moves every coordinate by lr * u / (|u| + eps) (bias-corrected).
        for ((a, b), ui) in m.params().iter().zip(&start).zip(&u) {
            let want = 0.01 * *ui as f64 / (ui.abs() as f64 + 1e-3);
            assert!(((a - b) as f64 - want).abs() < 1e-6);
        }
        let st = m.state();
        assert_eq!(st.tensors.len(), 3 * start.len());
        let mut r = adam();
        r.restore(st).unwrap();
        m.apply(&u).unwrap();
        r.apply(&u).unwrap();
        assert_eq!(m.params(), r.params());
        // A plain-SGD checkpoint cannot resume an Adam run.
        assert!(adam().restore(model().state()).is_err());
        // Momentum is the SGD rule's; with Adam it is refused by name.
        let t: DppgTask = serde_json::from_value(serde_json::json!({
            "server_optimizer": "adam",
            "server_momentum": 0.9,
        }))
        .unwrap();
        let err = fedrl_common::task::Task::Dppg(t)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("server_adam_beta1"), "{err}");
    }

    /// A pipelined evaluation (its job run on another thread, the result handed back later)
    /// measures, selects and stops exactly as the synchronous one.
    #[test]
    fn a_pipelined_evaluation_equals_the_synchronous_one() {
        let target = |t: f64| {
            let mut m = model();
            m.task.stop_at_return = Some(t);
            m
        };
        for t in [1.0, 1e9] {
            let (mut sync, mut piped) = (target(t), target(t));
            let want = sync.evaluate(0).unwrap();
            let job = piped.evaluation_job(0).unwrap();
            assert_eq!(job.round(), 0);
            let done = std::thread::spawn(move || job.run()).join().unwrap();
            assert_eq!(done.params, piped.params());
            assert!(
                !piped.finished(),
                "nothing is decided before the result is in"
            );
            assert_eq!(piped.evaluated(done), want);
            assert_eq!(piped.finished(), sync.finished());
            assert_eq!(piped.finished(), t == 1.0);
            assert_eq!(piped.state().meta, sync.state().meta);
            assert_eq!(piped.state().tensors, sync.state().tensors);
        }
        // Rounds without an evaluation have no job.
        let mut m = model();
        m.task.eval_every = 2;
        assert!(m.evaluation_job(0).is_none());
        assert!(m.evaluation_job(1).is_some());
    }

    #[test]
    fn checkpoint_keeps_the_best_model() {
        let mut m = model();
        assert!(m.evaluate(0).is_some());
        let best = m.best.clone().expect("an evaluation selects a model");
        // Move away from the evaluated parameters so current and best differ.
        let step = vec![0.5f32; m.params().len()];
        m.apply(&step).unwrap();
        let st = m.state();
        let mut resumed = model();
        resumed.restore(st.clone()).unwrap();
        assert_eq!(resumed.params(), m.params());
        assert_eq!(resumed.best, Some(best.clone()));
        assert_eq!(resumed.chosen(), best.1.as_slice());
        // A checkpoint from before any evaluation, and one without the best model (the older
        // format), restore with no selection; a truncated one is refused.
        let fresh = model().state();
        let mut r = model();
        r.restore(fresh).unwrap();
        assert!(r.best.is_none());
        let mut short = st;
        short.tensors.truncate(short.tensors.len() - 1);
        assert!(model().restore(short).is_err());
    }
}
