//! Log-linear DP policy gradient (seed 004 §4.2.1, Riverswim), server side: the global
//! log-linear policy and linear baseline, evaluation on held-out users, best-model selection and
//! the exported policy.
//!
//! The released noisy mean update already contains the policy learning rate (clients send
//! `eta_t g`), so the server adds it with learning rate 1 and no momentum: that is exactly the
//! noisy step `theta' = theta + eta_t/n (sum clip_C(g_i) + sigma C z)` whose size the trust region
//! bounds. Evaluation and model selection only touch released models and simulated held-out
//! users: post-processing, no privacy cost.

use std::path::Path;

use super::LogLinearTaskExt;
use fedrl_common::scenario::LogLinearTask;
use fedrl_rl::loglinear::{self, LogLinearSpec};
use fedrl_sim::Env;
use fedrl_sim::population::Population;

use crate::dppg::POLICY_FILE;
use crate::server::{
    BestModel, ModelError, ModelState, ServerModel, ServerOptimizer, final_evaluation_json,
    keep_best, restore_with_best, state_with_best,
};

/// The server model of [`fedrl_common::scenario::Task::LogLinearPg`].
pub struct LogLinearModel {
    task: LogLinearTask,
    spec: LogLinearSpec,
    sgd: ServerOptimizer,
    population: Population,
    /// First held-out user id (the scenario's number of training users).
    first_eval_user: u64,
    /// The best periodically evaluated parameters and their mean return.
    best: BestModel,
}

/// Mean return of one evaluation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// Mean undiscounted return with actions sampled from the policy.
    pub mean: f64,
    /// Its standard deviation across users.
    pub std: f64,
    /// Mean undiscounted return with greedy actions.
    pub greedy_mean: f64,
    /// Users (one episode each).
    pub episodes: u64,
}

impl Evaluation {
    /// The metrics fields (`eval_*`).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "eval_return": self.mean,
            "eval_return_std": self.std,
            "eval_return_greedy": self.greedy_mean,
            "eval_episodes": self.episodes,
        })
    }
}

impl LogLinearModel {
    /// `training_users`: held-out evaluation users get ids from there on.
    pub fn new(task: &LogLinearTask, training_users: u64) -> anyhow::Result<Self> {
        let spec = task.spec()?;
        Ok(Self {
            task: task.clone(),
            // Server learning rate 1, no momentum: the clients' updates carry eta_t.
            sgd: ServerOptimizer::new(spec.init(), 1.0, 0.0),
            spec,
            population: Population::new(&task.population, task.population_seed)?,
            first_eval_user: training_users,
            best: None,
        })
    }

    /// The policy's shape.
    pub fn spec(&self) -> &LogLinearSpec {
        &self.spec
    }

    /// Mean return of `params` over held-out users `first..first + n`, one episode each, seeded
    /// by the user id (the same episodes whichever model is evaluated).
    pub fn evaluate_on(&self, params: &[f32], first: u64, n: u64) -> anyhow::Result<Evaluation> {
        let mut envs: Vec<Box<dyn Env>> = (0..n)
            .map(|j| self.population.user_env(first + j))
            .collect::<Result<_, _>>()?;
        let seeds: Vec<u64> = (0..n).map(|j| 0xE7A1_0000_0000 ^ (first + j)).collect();
        let (mean, std) = loglinear::evaluate(&self.spec, params, &mut envs, &seeds, false)?;
        let (greedy_mean, _) = loglinear::evaluate(&self.spec, params, &mut envs, &seeds, true)?;
        Ok(Evaluation {
            mean,
            std,
            greedy_mean,
            episodes: n,
        })
    }

    /// The parameters that will be exported: the best evaluated ones, else the current ones.
    fn chosen(&self) -> &[f32] {
        self.best.as_ref().map_or(&self.sgd.params, |(_, p)| p)
    }
}

impl ServerModel for LogLinearModel {
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
            "model": "loglinear_pg",
            "population": self.task.population,
            "obs_dim": self.spec.obs_dim,
            "n_actions": self.spec.n_actions,
        });
        state_with_best(&self.sgd, meta, &self.best)
    }

    fn restore(&mut self, state: ModelState) -> Result<(), ModelError> {
        self.best = restore_with_best(&mut self.sgd, state)?;
        Ok(())
    }

    fn evaluate(&mut self, round: u64) -> Option<serde_json::Value> {
        if !round.is_multiple_of(self.task.eval_every.max(1)) {
            return None;
        }
        let n = self.task.eval_users.max(1);
        match self.evaluate_on(&self.sgd.params, self.first_eval_user, n) {
            Ok(e) => {
                keep_best(&mut self.best, e.mean, &self.sgd.params);
                let mut line = e.to_json();
                line["policy_lr"] = serde_json::json!(self.task.lr_at(round));
                Some(line)
            }
            Err(e) => Some(serde_json::json!({ "eval_error": e.to_string() })),
        }
    }

    fn final_evaluation(&mut self) -> Option<serde_json::Value> {
        let first = self.first_eval_user + self.task.eval_users.max(1);
        let n = self.task.final_eval_users.max(1);
        let eval = self.evaluate_on(self.chosen(), first, n);
        Some(final_evaluation_json(eval.map(|e| e.to_json()), &self.best))
    }

    /// Writes `policy.safetensors` in the log-linear layout (`policy.theta`, `baseline.w`; see
    /// `fedrl_rl::loglinear::to_bytes`), not the MLP layout `fedrl eval` reads.
    fn export(&self, dir: &Path) -> anyhow::Result<()> {
        loglinear::save(&dir.join(POLICY_FILE), &self.spec, self.chosen())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task() -> LogLinearTask {
        let s = crate::scenario_from_toml_str(
            "[task]\nkind = \"loglinear_pg\"\neval_every = 2\neval_users = 20\nfinal_eval_users = 30\n",
        )
        .unwrap();
        match s.task {
            fedrl_common::scenario::Task::LogLinearPg(t) => t,
            _ => unreachable!(),
        }
    }

    #[test]
    fn applies_with_unit_rate_selects_the_best_and_exports() {
        let mut m = LogLinearModel::new(&task(), 100).unwrap();
        assert_eq!(m.params().len(), 18);
        let mut u = vec![0.0f32; 18];
        // Swim right everywhere: a much better policy than the uniform one.
        for s in 0..6 {
            u[2 * s + 1] = 3.0;
        }
        m.apply(&u).unwrap();
        assert_eq!(m.params()[1], 3.0);
        assert!(m.evaluate(1).is_none());
        let e = m.evaluate(2).unwrap();
        let good = e["eval_return"].as_f64().unwrap();
        // A worse update afterwards does not replace the selected model.
        let back: Vec<f32> = u.iter().map(|x| -2.0 * x).collect();
        m.apply(&back).unwrap();
        let worse = m.evaluate(4).unwrap()["eval_return"].as_f64().unwrap();
        assert!(worse < good, "{worse} vs {good}");
        let f = m.final_evaluation().unwrap();
        assert_eq!(f["selected_model_eval_return"].as_f64().unwrap(), good);
        let dir = tempfile::tempdir().unwrap();
        m.export(dir.path()).unwrap();
        let (spec, params) =
            loglinear::from_bytes(&std::fs::read(dir.path().join(POLICY_FILE)).unwrap()).unwrap();
        assert_eq!(spec, *m.spec());
        assert_eq!(params[1], 3.0);
        // Checkpoints round-trip.
        let st = m.state();
        let mut m2 = LogLinearModel::new(&task(), 100).unwrap();
        m2.restore(st).unwrap();
        assert_eq!(m2.params(), m.params());
    }
}
