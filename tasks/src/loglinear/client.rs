//! Log-linear DP policy gradient (seed 004 §4.2.1, Riverswim), client side: each offered user
//! plays its episode(s) with the current global log-linear policy in its own simulator and
//! computes one REINFORCE step with the linear baseline, on its own data only.
//!
//! The update carries the round's policy learning rate: `u = [eta_t g_theta ; beta g_w]` with
//! `eta_t` from the task's public schedule and the round index of the offer. It is clipped to
//! the round's clip norm `C' = eta_t C` (the agent and the aggregator clip again), which the
//! scenario derived from the L2 trust region (`fedrl_common::privacy::trust_region`).

use super::LogLinearTaskExt;
use fedrl_common::privacy::clipping::clip_l2;
use fedrl_common::protocol::{RoundSpec, UnitId};
use fedrl_common::scenario::LogLinearTask;
use fedrl_rl::loglinear::{self, LogLinearSpec};
use fedrl_sim::population::Population;

use crate::client::LocalTrainer;
use crate::dppg::episode_seed;

/// The log-linear local trainer of one client agent.
pub struct LogLinearTrainer {
    task: LogLinearTask,
    spec: LogLinearSpec,
    population: Population,
}

impl LogLinearTrainer {
    pub fn new(task: &LogLinearTask) -> anyhow::Result<Self> {
        Ok(Self {
            spec: task.spec()?,
            population: Population::new(&task.population, task.population_seed)?,
            task: task.clone(),
        })
    }

    /// The update of one user in `round` (unclipped), from the global parameters `global`.
    pub fn user_update(
        &self,
        round: u64,
        global: &[f32],
        unit: UnitId,
    ) -> anyhow::Result<Vec<f32>> {
        let mut env = self.population.user_env(unit)?;
        let base = episode_seed(self.task.episode_seed, round, unit);
        let episodes = (0..self.task.episodes_per_user as u64)
            .map(|k| {
                loglinear::rollout(
                    &self.spec,
                    global,
                    env.as_mut(),
                    base.wrapping_add(k),
                    false,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let grad = loglinear::reinforce_gradient(&self.spec, global, &episodes, self.task.gamma)?;
        Ok(loglinear::local_update(
            &grad,
            self.task.lr_at(round),
            self.task.baseline_lr,
        ))
    }
}

impl LocalTrainer for LogLinearTrainer {
    fn local_updates(
        &mut self,
        round: &RoundSpec,
        global: &[f32],
        units: &[UnitId],
    ) -> Vec<(UnitId, Vec<f32>)> {
        units
            .iter()
            .filter_map(|&u| match self.user_update(round.round, global, u) {
                Ok(mut v) => {
                    // The aggregator's C is authoritative (it clips again).
                    clip_l2(&mut v, round.clip_norm);
                    Some((u, v))
                }
                Err(e) => {
                    tracing::warn!(unit = u, round = round.round, error = %e, "log-linear update failed; skipping the user");
                    None
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fedrl_common::privacy::clipping::l2_norm;
    use fedrl_common::scenario::Task;

    #[test]
    fn updates_are_clipped_deterministic_and_carry_the_learning_rate() {
        let s = crate::scenario_from_toml_str("[task]\nkind = \"loglinear_pg\"\n").unwrap();
        let Task::LogLinearPg(task) = s.task.clone() else {
            unreachable!()
        };
        let mut t = LogLinearTrainer::new(&task).unwrap();
        let global = vec![0.0f32; 18];
        let spec = RoundSpec {
            round: 1,
            dim: 18,
            offer_dim: 18,
            clip_norm: s.effective_clip_norm(),
            deadline_s: 1.0,
        };
        let units: Vec<UnitId> = (0..50).collect();
        let a = t.local_updates(&spec, &global, &units);
        let b = t.local_updates(&spec, &global, &units);
        assert_eq!(a, b);
        assert_eq!(a.len(), 50);
        for (_, v) in &a {
            assert_eq!(v.len(), 18);
            assert!(l2_norm(v) <= spec.clip_norm * (1.0 + 1e-6));
        }
        // The policy half scales with the round's learning rate.
        let r1 = t.user_update(1, &global, 7).unwrap();
        let mut task51 = task.clone();
        task51.lr = task.lr_at(51);
        let t51 = LogLinearTrainer::new(&task51).unwrap();
        let same_round = t51.user_update(1, &global, 7).unwrap();
        for i in 0..12 {
            let want = r1[i] as f64 * task.lr_at(51) / task.lr_at(1);
            assert!((same_round[i] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()));
        }
    }
}
