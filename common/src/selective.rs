//! Expert-level Selective DP-SGD (seed 000/002, Algorithms 2-4) as plain scenario data: the
//! DataRelease budget and the public schedule of training steps.
//!
//! A run first releases the stable prefixes of T sampled expert trajectories (DataRelease,
//! budget (epsilon_1, delta_1)), then trains for `steps` steps. Step n is a DP-SGD step on the
//! unstable data when the public coin c_n ~ Bernoulli(p) says so, else a noise-free step on the
//! released prefixes (Algorithm 3). The coins come from a seeded generator, not from the
//! aggregator's noise: they are public, so the number K of DP steps is known before the run and
//! the plan (release + K Poisson-sampled Gaussians at q = b/m) is checked against the budget up
//! front.
//!
//! Accounting note (a deliberate departure from the paper): the paper accounts the DP steps at
//! q = p b/m, counting the coin as amplification. A free step is noise-free and a DP step is
//! Gaussian, so the released iterates tell which kind each step was; the coin then amplifies
//! nothing (each step's privacy profile is p * delta_{b/m}, worse than delta_{p b/m}). fedrl
//! charges every expert with exactly the K DP steps that run, each at q = b/m: sound whatever
//! an observer sees, and close to the paper's figure for p near 1.

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

/// The DataRelease budget (Algorithm 2).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseConfig {
    /// epsilon_1 (nats): the release's share of the budget.
    pub epsilon: f64,
    /// delta_1: the release's share of delta.
    pub delta: f64,
    /// T: candidate trajectories walked (the unstable query cutoff). Default 25 (the paper's
    /// choice for CartPole and Acrobot at epsilon 10).
    #[serde(default = "d_trajectories")]
    pub trajectories: u64,
    /// L: the trajectory length the accounting assumes (steps). Every candidate must be at most
    /// this long. Default 200 (the demonstrations' cap for CartPole and Acrobot).
    #[serde(default = "d_horizon")]
    pub horizon: u64,
    /// How the per-query budget epsilon' follows from (epsilon, delta, trajectories):
    /// `"theorem"` (default), Algorithm 2's formula by advanced composition; `"accountant"`,
    /// the largest epsilon' whose T passes the ledger's PLD accountant composes to at most
    /// `epsilon` at `delta` (the same guarantee, measured tightly: a lower threshold, longer
    /// stable prefixes). See `privacy::expert_release`.
    #[serde(default)]
    pub calibration: crate::privacy::expert_release::Calibration,
    /// k: steps a candidate's owner reveals at a time (default 1). Step h+1 leaves the owner
    /// only once the prefix of length h passed the test, so nobody but the owner ever receives
    /// more of a candidate than its released prefix plus k steps. A larger k trades that bound
    /// for fewer round trips (the walk of one candidate takes about L/k of them).
    #[serde(default = "d_chunk")]
    pub chunk: u32,
    /// Seconds an agent has to answer a request of the release (a candidate's next steps, or
    /// the counts of a chunk) before it is dropped and the walk goes on without it (default
    /// 120; see the aggregator's `engine::release` for why dropping is sound).
    #[serde(default = "d_answer_deadline")]
    pub answer_deadline_s: f64,
}

fn d_chunk() -> u32 {
    1
}
fn d_answer_deadline() -> f64 {
    120.0
}

/// Selective DP-SGD (Algorithm 3); with `release` absent and `unstable_probability = 1` it is
/// expert-level DP-SGD (Algorithm 4).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectiveConfig {
    /// N: training steps in all, DP and free.
    pub steps: u64,
    /// p: probability that a step is a DP-SGD step on the unstable data, in [0, 1]. 0 trains on
    /// the released prefixes alone (no DP step, no epsilon_2), 1 is DP-SGD only.
    pub unstable_probability: f64,
    /// Transitions of a free step's batch, drawn uniformly from the released prefixes. Default
    /// 256 (the paper's batch for CartPole and Acrobot).
    #[serde(default = "d_stable_batch")]
    pub stable_batch: u32,
    /// Seed of the public step-type coins and of the free steps' batches. Default 0.
    #[serde(default)]
    pub schedule_seed: u64,
    /// The DataRelease budget; absent: no release (DP-SGD only, Algorithm 4).
    #[serde(default)]
    pub release: Option<ReleaseConfig>,
}

/// The minimum action probability of a dataset's expert policies (Assumption 1 of seed 002),
/// if its behaviour is made of experts.
pub fn expert_p_min(source: &crate::offline::DatasetSource) -> Option<f64> {
    match &source.generated()?.behaviour {
        crate::offline::Behaviour::Experts { p_min, .. } => Some(*p_min),
        _ => None,
    }
}

fn d_trajectories() -> u64 {
    25
}
fn d_horizon() -> u64 {
    200
}
fn d_stable_batch() -> u32 {
    256
}

/// The public step schedule: where the K DP steps fall among the N steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// `gaps[k]` free steps run before DP step k + 1 (k < K); `gaps[K]` after the last one.
    pub gaps: Vec<u64>,
}

impl Schedule {
    /// The schedule of `cfg`: N coins from a generator seeded by `schedule_seed`.
    pub fn new(cfg: &SelectiveConfig) -> Schedule {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(cfg.schedule_seed ^ 0x5E1E_C7D0_C011_5EED);
        let p = cfg.unstable_probability;
        let mut gaps = vec![0u64];
        for _ in 0..cfg.steps {
            // Exactly 0 and 1 are deterministic (no draw can land on the wrong side).
            let dp = p >= 1.0 || (p > 0.0 && rng.random::<f64>() < p);
            if dp {
                gaps.push(0);
            } else if let Some(g) = gaps.last_mut() {
                *g += 1;
            }
        }
        Schedule { gaps }
    }

    /// K: the DP-SGD steps of the run.
    pub fn dp_steps(&self) -> u64 {
        self.gaps.len() as u64 - 1
    }

    /// N - K: the free steps of the run.
    pub fn free_steps(&self) -> u64 {
        self.gaps.iter().sum()
    }

    /// Free steps to run after `dp_done` DP steps were applied, before the next (or, once all
    /// K are done, to the end).
    pub fn gap_after(&self, dp_done: u64) -> u64 {
        self.gaps.get(dp_done as usize).copied().unwrap_or(0)
    }
}

impl SelectiveConfig {
    /// Checks the fields (the message names the field).
    pub fn validate(&self) -> Result<(), String> {
        if self.steps == 0 {
            return Err("task.selective.steps must be >= 1".into());
        }
        if !(0.0..=1.0).contains(&self.unstable_probability) {
            return Err(format!(
                "task.selective.unstable_probability must be in [0, 1], got {}",
                self.unstable_probability
            ));
        }
        if self.stable_batch == 0 {
            return Err("task.selective.stable_batch must be >= 1".into());
        }
        match &self.release {
            Some(r) => {
                if !(r.epsilon.is_finite() && r.epsilon > 0.0) {
                    return Err(format!(
                        "task.selective.release.epsilon must be > 0, got {}",
                        r.epsilon
                    ));
                }
                if !(r.delta > 0.0 && r.delta < 1.0) {
                    return Err(format!(
                        "task.selective.release.delta must be in (0, 1), got {}",
                        r.delta
                    ));
                }
                if r.trajectories == 0 || r.horizon == 0 {
                    return Err(
                        "task.selective.release.trajectories and .horizon must be >= 1".into(),
                    );
                }
                if r.chunk == 0 {
                    return Err("task.selective.release.chunk must be >= 1".into());
                }
                if !(r.answer_deadline_s.is_finite() && r.answer_deadline_s > 0.0) {
                    return Err(format!(
                        "task.selective.release.answer_deadline_s must be finite and > 0, got {}",
                        r.answer_deadline_s
                    ));
                }
            }
            None if self.unstable_probability < 1.0 => {
                return Err(format!(
                    "task.selective.unstable_probability = {} asks for free steps on released prefixes, but there is no [task.selective.release]",
                    self.unstable_probability
                ));
            }
            None => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(p: f64, steps: u64) -> SelectiveConfig {
        SelectiveConfig {
            steps,
            unstable_probability: p,
            stable_batch: 4,
            schedule_seed: 3,
            release: Some(ReleaseConfig {
                epsilon: 7.5,
                delta: 3e-4,
                trajectories: 25,
                horizon: 200,
                calibration: Default::default(),
                chunk: 1,
                answer_deadline_s: 120.0,
            }),
        }
    }

    #[test]
    fn the_schedule_counts_every_step_once_and_is_reproducible() {
        for p in [0.0, 0.1, 0.5, 0.9, 1.0] {
            let s = Schedule::new(&cfg(p, 10_000));
            assert_eq!(s.dp_steps() + s.free_steps(), 10_000, "p = {p}");
            assert_eq!(s, Schedule::new(&cfg(p, 10_000)));
            let frac = s.dp_steps() as f64 / 10_000.0;
            assert!((frac - p).abs() < 0.02, "p = {p}: {frac}");
        }
        assert_eq!(Schedule::new(&cfg(0.0, 7)).gaps, vec![7]);
        assert_eq!(Schedule::new(&cfg(1.0, 3)).gaps, vec![0, 0, 0, 0]);
        let s = Schedule::new(&cfg(0.5, 100));
        assert_eq!(s.gap_after(s.dp_steps() + 5), 0);
    }

    #[test]
    fn validation_names_the_field() {
        assert!(cfg(0.5, 10).validate().is_ok());
        assert!(
            cfg(1.5, 10)
                .validate()
                .unwrap_err()
                .contains("unstable_probability")
        );
        assert!(cfg(0.5, 0).validate().unwrap_err().contains("steps"));
        let mut c = cfg(0.5, 10);
        c.release = None;
        assert!(c.validate().unwrap_err().contains("release"));
        c.unstable_probability = 1.0;
        assert!(c.validate().is_ok(), "DP-SGD only needs no release");
    }
}
