//! PriMORL (seed 001), server side: the dynamics ensemble, updated by each released noisy mean
//! of the trajectories' clipped ensemble deltas (Algorithm 1 line 9: `theta += mean + noise`,
//! server learning rate 1), early stopping on the public split's MSE, and at the end the policy
//! phase: SAC inside the pessimistic released model, which reads no dataset (post-processing).
//!
//! A Gymnasium environment (`task.dataset.env = "gymnasium:<id>"`) cannot be stepped here: the
//! aggregator runs no Python (DESIGN §2.6). Its policy phase then runs without real-environment
//! evaluations ([`fedrl_rl::primorl::PhaseEnv::Recorded`]: the spaces the dataset recorded,
//! rollouts from the public split's initial states instead of the environment's resets), keeps
//! each epoch's actor (post-processing of the released ensemble and the public split: a DP
//! output) in [`POLICY_SNAPSHOTS_FILE`], and reports its curve `deferred`; `fedrl run` evaluates
//! the snapshots through the bridge on the episodes this model would have used
//! (`scenarios/src/deferred_eval/primorl.rs`).
//!
//! The public split: in this simulation every party generates the dataset from its public,
//! seeded procedure; the aggregator keeps only the public episodes (ids from `dataset.units` on,
//! owned by no unit) and drops the rest at once. In a deployment the public split is data
//! published as such.

use std::path::Path;

use anyhow::Context;
use fedrl_common::task::primorl::PrimorlTask;
use fedrl_rl::candle_core::Device;
use fedrl_rl::ensemble::{self, Ensemble, EnsembleSpec, ModelRows};
use fedrl_rl::offline::continuous::RecordedSpaces;
use fedrl_rl::primorl::{
    PhaseEnv, PolicyData, PolicyEpoch, ensemble_spec, initial_states, policy_phase_in, public_rows,
};
use fedrl_rl::sac::SacAgent;

use crate::server::{ModelError, ModelState, ServerModel};

/// File name of the exported (early-stopping selected) ensemble in the output directory.
pub const ENSEMBLE_FILE: &str = "ensemble.safetensors";
/// File name of the SAC agent of the policy phase (actor, critics, temperature).
pub const POLICY_FILE: &str = "sac_policy.safetensors";
/// File name of each policy-phase epoch's actor, kept when the evaluations are deferred to
/// `fedrl run` (a Gymnasium environment): [`fedrl_rl::primorl::save_actor_snapshots`]'s layout;
/// the agent's other settings are [`POLICY_FILE`]'s.
pub const POLICY_SNAPSHOTS_FILE: &str = "policy_actors.safetensors";

pub struct PrimorlModel {
    task: PrimorlTask,
    /// The environment the policy phase runs in (the dataset's, or the scenario's `env`).
    env: String,
    /// Private trajectories (units `0..private_units`); an exact count, operator-only.
    private_units: u64,
    spec: EnsembleSpec,
    params: Vec<f32>,
    /// The public split's rows (early stopping).
    public: ModelRows,
    /// Best public MSE so far, the parameters that reached it, the round, and evaluations since.
    best_mse: f64,
    best: Vec<f32>,
    best_round: Option<u64>,
    since_best: u64,
    device: Device,
    /// The policy phase's agent, once it ran.
    policy: Option<SacAgent>,
    /// A Gymnasium environment's recorded spaces and the public split's initial states: the
    /// policy phase runs without evaluations ([`fedrl_rl::primorl::PhaseEnv::Recorded`]).
    recorded: Option<(RecordedSpaces, Vec<f32>)>,
    /// Each epoch's actor, kept when the evaluations are deferred.
    actors: Vec<Vec<f32>>,
    /// The MOPO baseline's real transitions (every episode of the dataset; only a non-private
    /// scenario with `task.policy.real_ratio > 0` or `data_start_fraction > 0` keeps them, the
    /// scenario refuses it otherwise) and the public split's start states
    /// (`task.policy.public_start_fraction > 0`), kept from the start so the policy phase reads
    /// no dataset.
    data: PolicyData,
}

impl PrimorlModel {
    /// The model of `task`, its dataset loaded (or generated) under `$FEDRL_DATA_DIR`.
    pub fn new(task: &PrimorlTask, device: Device) -> anyhow::Result<Self> {
        Self::with_data_root(task, None, device)
    }

    /// The model of `task`, its dataset under `root` (`None`: `$FEDRL_DATA_DIR` or
    /// `~/.fedrl/datasets`). Everything the policy phase needs (the public split's start
    /// states, MOPO's real transitions) is kept from here on, so nothing later reads the data.
    pub fn with_data_root(
        task: &PrimorlTask,
        root: Option<&Path>,
        device: Device,
    ) -> anyhow::Result<Self> {
        let root = fedrl_rl::offline::data_root(root)?;
        let gym = super::evaluates_in_gymnasium(task);
        if let Some(spec) = task.dataset.generated().filter(|_| gym) {
            // Generating it would start Python workers here: `fedrl run` and `fedrl data
            // generate` make it first.
            let path = root.join("continuous").join(spec.file_name());
            if !path.is_file() {
                anyhow::bail!(
                    "the dataset of {} is not under {} (continuous/{}): the aggregator runs no \
                     Python, so a Gymnasium dataset must be generated first (`fedrl run` does; \
                     or `fedrl data generate` the scenario)",
                    spec.env,
                    root.display(),
                    spec.file_name()
                );
            }
        }
        // The public split sets the normalisation, early stopping and public starts; only the
        // MOPO baseline (not private) reads the private trajectories too.
        let reads = task.policy.reads_data();
        let (dataset, private_units) = fedrl_rl::offline::continuous::load_source_units(
            &task.dataset,
            &root,
            &mut |_| {},
            &|_| reads,
        )
        .with_context(|| format!("loading the task's dataset under {}", root.display()))?;
        let env = fedrl_rl::offline::continuous::source_env(&task.dataset, &root)?;
        let spec = ensemble_spec(task, &dataset, private_units)?;
        let public = public_rows(&dataset, private_units, &spec)?;
        let data = PolicyData::from_dataset(
            &task.policy,
            &dataset,
            private_units,
            task.policy.reads_data(),
        )?;
        let recorded = if gym {
            let spaces = dataset.meta.spaces.clone().with_context(|| {
                format!(
                    "the dataset of {} records no spaces (made before datasets recorded them?)",
                    env
                )
            })?;
            let (public, _) = dataset.split(private_units);
            let initial = initial_states(dataset.meta.obs_dim, public);
            Some((spaces, initial))
        } else {
            None
        };
        drop(dataset);
        let params = spec.init(task.model_seed);
        Ok(PrimorlModel {
            task: task.clone(),
            env,
            private_units,
            best: params.clone(),
            spec,
            params,
            public,
            best_mse: f64::INFINITY,
            best_round: None,
            since_best: 0,
            device,
            policy: None,
            recorded,
            actors: Vec::new(),
            data,
        })
    }

    /// Private trajectories of the dataset (an exact count: operator-only).
    pub fn private_units(&self) -> u64 {
        self.private_units
    }

    /// The ensemble selected by early stopping (the latest before any evaluation).
    pub fn selected(&self) -> &[f32] {
        if self.best_round.is_some() {
            &self.best
        } else {
            &self.params
        }
    }

    /// SAC in the selected ensemble (seed 001, Algorithm 4), with progress on stderr.
    fn run_policy_phase(&mut self) -> anyhow::Result<Vec<PolicyEpoch>> {
        let ens = Ensemble::new(&self.spec, self.selected(), &self.device)?;
        let p = &self.task.policy;
        let mopo = match &self.data.real {
            Some(r) => format!(
                "; MOPO: {:.0}% of each minibatch from {} real transitions, {:.0}% of rollouts branched from their states",
                100.0 * p.real_ratio,
                r.len(),
                100.0 * p.data_start_fraction
            ),
            None => String::new(),
        };
        let public = match &self.data.public {
            Some(b) => format!(
                "; {:.0}% of the other rollouts branched from {} public-split transitions",
                100.0 * p.public_start_fraction,
                b.len()
            ),
            None => String::new(),
        };
        eprintln!(
            "policy phase: SAC in the {} model ({} epochs of {} updates, rollouts of {} steps, {:?} penalty x {}{mopo}{public})",
            if self.data.real.is_some() {
                "non-private"
            } else {
                "private"
            },
            p.epochs,
            p.updates_per_epoch,
            p.rollout_length,
            p.uncertainty,
            p.lambda,
        );
        let env = match &self.recorded {
            Some((spaces, initial)) => {
                eprintln!(
                    "  {}: no Python here, so no epoch is evaluated now (fedrl run evaluates each \
                     epoch's actor through the Gymnasium bridge); rollouts start from the {} \
                     public episodes' initial states",
                    self.env,
                    initial.len() / self.spec.obs_dim.max(1)
                );
                PhaseEnv::Recorded {
                    spaces: spaces.clone(),
                    initial: initial.clone(),
                }
            }
            None => PhaseEnv::Sim(fedrl_sim::make(&self.env)?),
        };
        let deferred = self.recorded.is_some();
        let (agent, curve, actors) = policy_phase_in(
            &ens,
            &self.env,
            env,
            p,
            self.data.starts(),
            &self.device,
            &mut |e| {
                if deferred {
                    eprintln!(
                        "  SAC epoch {:>3}/{}: (evaluation deferred), model reward {:7.3}, penalty {:6.3}, alpha {:.3}, {:.0} s",
                        e.epoch, p.epochs, e.model_reward, e.penalty, e.alpha, e.seconds
                    );
                    return;
                }
                eprintln!(
                    "  SAC epoch {:>3}/{}: return {:9.2} (normalised {:7.1}), model reward {:7.3}, penalty {:6.3}, alpha {:.3}, {:.0} s",
                    e.epoch,
                    p.epochs,
                    e.eval_return,
                    e.normalized_return,
                    e.model_reward,
                    e.penalty,
                    e.alpha,
                    e.seconds
                );
                tracing::info!(epoch = e.epoch, eval_return = e.eval_return, "policy epoch");
            },
        )?;
        self.policy = Some(agent);
        self.actors = actors;
        Ok(curve)
    }

    fn public_mse(&self, params: &[f32]) -> anyhow::Result<f64> {
        let ens = Ensemble::new(&self.spec, params, &self.device)?;
        Ok(ens.mse(&self.public)?)
    }
}

impl ServerModel for PrimorlModel {
    fn params(&self) -> &[f32] {
        &self.params
    }

    fn apply(&mut self, noisy_mean_update: &[f32]) -> Result<(), ModelError> {
        if noisy_mean_update.len() != self.params.len() {
            return Err(ModelError::Length {
                expected: self.params.len(),
                got: noisy_mean_update.len(),
            });
        }
        for (p, u) in self.params.iter_mut().zip(noisy_mean_update) {
            *p += u;
        }
        Ok(())
    }

    /// Parameters, then the selected (best) parameters.
    fn state(&self) -> ModelState {
        let mut tensors = self.params.clone();
        tensors.extend_from_slice(&self.best);
        ModelState {
            meta: serde_json::json!({
                "model": "primorl",
                "best_mse": if self.best_mse.is_finite() { Some(self.best_mse) } else { None },
                "best_round": self.best_round,
                "since_best": self.since_best,
            }),
            tensors,
        }
    }

    fn restore(&mut self, state: ModelState) -> Result<(), ModelError> {
        let n = self.params.len();
        if state.tensors.len() != 2 * n {
            return Err(ModelError::Restore(format!(
                "the checkpoint has {} values, the ensemble and its selected copy need {}",
                state.tensors.len(),
                2 * n
            )));
        }
        self.params.copy_from_slice(&state.tensors[..n]);
        self.best.copy_from_slice(&state.tensors[n..]);
        self.best_mse = state.meta["best_mse"].as_f64().unwrap_or(f64::INFINITY);
        self.best_round = state.meta["best_round"].as_u64();
        self.since_best = state.meta["since_best"].as_u64().unwrap_or(0);
        Ok(())
    }

    /// Every `eval_every` rounds: the public split's MSE; the best ensemble is kept, and after
    /// `patience` evaluations without improvement training stops.
    fn evaluate(&mut self, round: u64) -> Option<serde_json::Value> {
        if !(round + 1).is_multiple_of(self.task.eval_every) {
            return None;
        }
        Some(match self.public_mse(&self.params) {
            Ok(mse) => {
                if mse < self.best_mse {
                    self.best_mse = mse;
                    self.best.copy_from_slice(&self.params);
                    self.best_round = Some(round);
                    self.since_best = 0;
                } else {
                    self.since_best += 1;
                }
                serde_json::json!({
                    "public_mse": mse,
                    "best_public_mse": self.best_mse,
                    "evaluations_since_best": self.since_best,
                })
            }
            Err(e) => serde_json::json!({ "eval_error": e.to_string() }),
        })
    }

    fn finished(&self) -> bool {
        self.since_best >= self.task.patience
    }

    /// The policy phase: SAC in the pessimistic selected ensemble (no dataset is read), each
    /// epoch evaluated in the real environment.
    fn final_evaluation(&mut self) -> Option<serde_json::Value> {
        let mse = self.public_mse(self.selected()).ok();
        let mut out = serde_json::json!({
            "public_mse": mse,
            "selected_round": self.best_round,
        });
        match self.run_policy_phase() {
            Ok(curve) if self.recorded.is_some() => {
                // `fedrl run` fills the evaluations in (scenarios/src/deferred_eval/primorl.rs).
                let mut c = serde_json::to_value(&curve).unwrap_or_default();
                for e in c.as_array_mut().into_iter().flatten() {
                    for k in DEFERRED_FIELDS {
                        e[k] = serde_json::Value::Null;
                    }
                }
                out["policy_curve"] = c;
                out["deferred"] = true.into();
            }
            Ok(curve) => {
                let last = curve.last();
                out["policy_curve"] = serde_json::to_value(&curve).unwrap_or_default();
                out["final_eval_return"] = last.map(|e| e.eval_return).into();
                out["final_eval_return_std"] = last.map(|e| e.eval_return_std).into();
                out["final_normalized_return"] = last.map(|e| e.normalized_return).into();
                out["final_eval_episodes"] = self.task.policy.eval_episodes.into();
            }
            Err(e) => out["policy_error"] = format!("{e:#}").into(),
        }
        Some(out)
    }

    fn export(&self, dir: &Path) -> anyhow::Result<()> {
        ensemble::save(&self.spec, self.selected(), &dir.join(ENSEMBLE_FILE))?;
        if let Some(agent) = &self.policy {
            agent.save(&dir.join(POLICY_FILE))?;
        }
        if !self.actors.is_empty() {
            fedrl_rl::primorl::save_actor_snapshots(
                &self.actors,
                &dir.join(POLICY_SNAPSHOTS_FILE),
            )?;
        }
        Ok(())
    }
}

/// The fields of a policy-curve epoch that a deferred evaluation fills in (null until then).
pub const DEFERRED_FIELDS: [&str; 5] = [
    "eval_return",
    "eval_return_std",
    "normalized_return",
    "normalized_return_std",
    "eval_episodes",
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The policy phase runs after the dataset is gone, its rollouts branched from the public
    /// split's states kept at start (the swing-up scenarios' setting).
    #[test]
    fn the_policy_phase_branches_from_public_states_without_the_dataset() {
        let task: PrimorlTask = serde_json::from_value(serde_json::json!({
            "dataset": {"env": "Pendulum-v1", "units": 6, "public": 2, "seed": 4,
                        "behaviour": {"kind": "random"}},
            "ensemble": {"hidden": [16, 16], "members": 2, "clipping": "per-layer"},
            "policy": {"uncertainty": "max-aleatoric", "lambda": 1.0, "rollout_length": 5,
                       "epochs": 1, "updates_per_epoch": 10, "rollout_batch": 16,
                       "rollout_every": 5, "hidden": [16, 16], "batch_size": 16,
                       "eval_episodes": 1, "public_start_fraction": 0.5},
        }))
        .expect("task");
        task.validate().expect("valid task");
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path().join("data");
        let mut model =
            PrimorlModel::with_data_root(&task, Some(&root), Device::Cpu).expect("model");
        let kept = model.data.public.as_ref().map(|b| b.len());
        assert_eq!(
            kept,
            Some(2 * 200),
            "the 2 public Pendulum episodes' transitions"
        );
        // From the cache, only the public split is read (a private run): the same
        // normalisation, early-stopping rows and start states as from the generated dataset.
        let cached = PrimorlModel::with_data_root(&task, Some(&root), Device::Cpu).expect("cached");
        assert_eq!(cached.spec, model.spec);
        assert_eq!(cached.public, model.public);
        assert_eq!(cached.data.public.as_ref().map(|b| b.len()), kept);
        std::fs::remove_dir_all(&root).expect("delete dataset");
        let out = model.final_evaluation().expect("evaluation");
        assert!(out.get("policy_error").is_none(), "{out}");
        assert_eq!(
            out["policy_curve"].as_array().map(Vec::len),
            Some(1),
            "{out}"
        );
        assert!(model.policy.is_some());
    }

    /// The aggregator never starts Python: a `gymnasium:` dataset it does not find is refused
    /// with what to do, not generated.
    #[test]
    fn the_aggregator_does_not_generate_a_gymnasium_dataset() {
        let task: PrimorlTask = serde_json::from_value(serde_json::json!({
            "dataset": {"env": "gymnasium:Pendulum-v1", "units": 6, "public": 2, "seed": 4,
                        "behaviour": {"kind": "random"},
                        "gymnasium": {"obs_dim": 3, "act_dim": 1,
                                      "python": "/nonexistent/python"}},
            "ensemble": {"hidden": [16, 16], "members": 2, "clipping": "per-layer"},
            "policy": {"uncertainty": "max-aleatoric", "lambda": 1.0, "rollout_length": 5,
                       "epochs": 1, "updates_per_epoch": 10, "eval_episodes": 1},
        }))
        .expect("task");
        task.validate().expect("valid task");
        assert!(super::super::evaluates_in_gymnasium(&task));
        // The shape comes from the declared spaces, without Python.
        let shape = fedrl_rl::primorl::PrimorlTaskExt::ensemble_shape(&task).expect("shape");
        assert_eq!((shape.obs_dim, shape.act_dim), (3, 1));
        let dir = tempfile::tempdir().expect("tmp");
        let e = PrimorlModel::with_data_root(&task, Some(dir.path()), Device::Cpu)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("runs no") && e.contains("fedrl run"), "{e}");
        assert!(!dir.path().join("continuous").exists());
    }
}
