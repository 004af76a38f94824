//! RiverSwim (Strehl & Littman 2008) with the transition probabilities and rewards of Osband,
//! Russo & Van Roy 2013, "(More) efficient reinforcement learning via posterior sampling", as
//! seed 004 uses it: 6 states, 2 actions, episodes of 20 steps.

use crate::env::{Action, Env, SimError, Space, Step};
use crate::np_rng::NpPcg64;

const ID: &str = "RiverSwim-v0";

/// A swimmer in a chain of states, starting at the left bank (state 0).
///
/// Action 0 (swim left, with the current) always moves one state left (staying at the left bank)
/// and pays `left_reward` when taken at the left bank. Action 1 (swim right, against the current)
/// is stochastic: see the `p_*` fields. Taking it at the right bank (last state) pays
/// `right_reward` with probability `right_reward_prob`.
///
/// Observation: the state one-hot encoded (f32). Never terminates; truncated after
/// `horizon` steps.
#[derive(Clone, Debug)]
pub struct RiverSwim {
    /// Number of states; Osband et al.: 6.
    pub n_states: usize,
    /// Episode length (steps); seed 004: 20.
    pub horizon: u32,
    /// Swim right at the left bank: probability of moving right (else stay); Osband: 0.6.
    pub p_right_at_left_bank: f64,
    /// Swim right mid-river: probability of moving right; Osband: 0.35.
    pub p_right: f64,
    /// Swim right mid-river: probability of being pushed left (else stay); Osband: 0.05.
    pub p_left: f64,
    /// Swim right at the right bank: probability of being pushed left (else stay); Osband: 0.4.
    pub p_left_at_right_bank: f64,
    /// Reward for swimming left at the left bank; Osband: 5/1000.
    pub left_reward: f64,
    /// Reward for swimming right at the right bank; Osband: 1.
    pub right_reward: f64,
    /// Probability that `right_reward` is paid (1 = deterministic, as in Osband et al.; seed 004
    /// varies it to change the difficulty).
    pub right_reward_prob: f64,
    state: usize,
    elapsed: u32,
    rng: NpPcg64,
    obs_space: Space,
    act_space: Space,
}

impl Default for RiverSwim {
    fn default() -> Self {
        Self::new()
    }
}

impl RiverSwim {
    /// The 6-state RiverSwim of Osband et al. with horizon 20.
    pub fn new() -> Self {
        Self::with_states(6)
    }

    /// RiverSwim with `n_states >= 2` states (Osband's probabilities and rewards).
    pub fn with_states(n_states: usize) -> Self {
        let n = n_states.max(2);
        RiverSwim {
            n_states: n,
            horizon: 20,
            p_right_at_left_bank: 0.6,
            p_right: 0.35,
            p_left: 0.05,
            p_left_at_right_bank: 0.4,
            left_reward: 5.0 / 1000.0,
            right_reward: 1.0,
            right_reward_prob: 1.0,
            state: 0,
            elapsed: 0,
            rng: NpPcg64::from_seed(0),
            obs_space: Space::Box {
                low: vec![0.0; n],
                high: vec![1.0; n],
            },
            act_space: Space::Discrete { n: 2 },
        }
    }

    /// The state index (0 = left bank).
    pub fn position(&self) -> usize {
        self.state
    }

    /// (left, stay, right) probabilities of `action` (0 left, 1 right) in state `s`.
    fn move_probs(&self, s: usize, action: usize) -> (f64, f64, f64) {
        let last = self.n_states - 1;
        if action == 0 {
            if s == 0 {
                (0.0, 1.0, 0.0)
            } else {
                (1.0, 0.0, 0.0)
            }
        } else if s == 0 {
            (
                0.0,
                1.0 - self.p_right_at_left_bank,
                self.p_right_at_left_bank,
            )
        } else if s == last {
            (
                self.p_left_at_right_bank,
                1.0 - self.p_left_at_right_bank,
                0.0,
            )
        } else {
            (self.p_left, 1.0 - self.p_left - self.p_right, self.p_right)
        }
    }

    /// The probability of moving from `s` to `s2` under `action` (0 left, 1 right).
    pub fn transition_prob(&self, s: usize, action: usize, s2: usize) -> f64 {
        let (left, stay, right) = self.move_probs(s, action);
        if s2 + 1 == s {
            left
        } else if s2 == s {
            stay
        } else if s2 == s + 1 {
            right
        } else {
            0.0
        }
    }

    /// Expected reward of taking `action` in `s`.
    pub fn expected_reward(&self, s: usize, action: usize) -> f64 {
        if action == 0 && s == 0 {
            self.left_reward
        } else if action == 1 && s == self.n_states - 1 {
            self.right_reward * self.right_reward_prob
        } else {
            0.0
        }
    }

    fn write(&self, obs: &mut [f32]) -> Result<(), SimError> {
        let got = obs.len();
        let out = obs.get_mut(..self.n_states).ok_or(SimError::ObsBuffer {
            env: ID,
            got,
            expected: self.n_states,
        })?;
        out.fill(0.0);
        out[self.state] = 1.0;
        Ok(())
    }
}

impl Env for RiverSwim {
    fn id(&self) -> &'static str {
        ID
    }

    fn observation_space(&self) -> &Space {
        &self.obs_space
    }

    fn action_space(&self) -> &Space {
        &self.act_space
    }

    fn reset(&mut self, seed: u64, obs: &mut [f32]) {
        self.rng = NpPcg64::from_seed(seed);
        self.state = 0;
        self.elapsed = 0;
        self.write(obs)
            .expect("RiverSwim: observation buffer shorter than the number of states");
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<Step, SimError> {
        let a = crate::classic::discrete_action(ID, action, 2)?;
        let s = self.state;
        let last = self.n_states - 1;
        let mut reward = 0.0;
        if a == 0 {
            if s == 0 {
                reward = self.left_reward;
            }
            self.state = s.saturating_sub(1);
        } else {
            if s == last {
                // Drawn before the move so the stream does not depend on the reward setting.
                let u = self.rng.next_f64();
                if u < self.right_reward_prob {
                    reward = self.right_reward;
                }
            }
            let u = self.rng.next_f64();
            let (p_left, _, p_right) = self.move_probs(s, 1);
            self.state = if u < p_right {
                s + 1
            } else if u < p_right + p_left {
                s - 1
            } else {
                s
            };
        }
        self.write(obs)?;
        self.elapsed = self.elapsed.saturating_add(1);
        Ok(Step {
            reward,
            terminated: false,
            truncated: self.elapsed >= self.horizon,
        })
    }

    /// `[state index, elapsed steps]` (the random stream is not part of it).
    fn state(&self) -> Vec<f64> {
        vec![self.state as f64, f64::from(self.elapsed)]
    }

    fn set_state(&mut self, state: &[f64], obs: &mut [f32]) -> Result<(), SimError> {
        let (s, elapsed) = match state {
            [s] => (*s, 0.0),
            [s, e] => (*s, *e),
            _ => {
                return Err(SimError::StateLength {
                    env: ID,
                    got: state.len(),
                    expected: 2,
                });
            }
        };
        let ok_int = |v: f64, max: f64| v >= 0.0 && v <= max && v.fract() == 0.0;
        if !ok_int(s, (self.n_states - 1) as f64) || !ok_int(elapsed, f64::from(u32::MAX)) {
            return Err(SimError::Invalid(format!(
                "{ID}: state {state:?} is not [state in 0..{}, elapsed steps]",
                self.n_states
            )));
        }
        self.state = s as usize;
        self.elapsed = elapsed as u32;
        self.write(obs)
    }
}
