//! MountainCar-v0 (Moore 1990) as Gymnasium 1.4.0 implements it.

use super::{discrete_action, split_state, write_obs};
use crate::env::{Action, Env, SimError, Space, Step};
use crate::np_rng::NpPcg64;

const ID: &str = "MountainCar-v0";

/// An under-powered car in a valley: accelerate left, not at all, or right (actions 0, 1, 2).
///
/// Observation (f32): position (m) and velocity (m per step). Reward -1 per step; terminates at
/// `position >= goal_position` with `velocity >= goal_velocity`; truncated after 200 steps.
#[derive(Clone, Debug)]
pub struct MountainCar {
    /// Left wall (m); Gymnasium: -1.2. Hitting it stops the car.
    pub min_position: f64,
    /// Right bound (m); Gymnasium: 0.6.
    pub max_position: f64,
    /// Speed bound (m per step); Gymnasium: 0.07.
    pub max_speed: f64,
    /// Goal position (m); Gymnasium: 0.5.
    pub goal_position: f64,
    /// Minimum velocity at the goal (m per step); Gymnasium: 0.
    pub goal_velocity: f64,
    /// Engine acceleration per step (m per step^2); Gymnasium: 0.001.
    pub force: f64,
    /// Gravity factor (m per step^2); Gymnasium: 0.0025.
    pub gravity: f64,
    /// Truncation horizon (steps); MountainCar-v0: 200.
    pub max_episode_steps: u32,
    state: [f64; 2],
    elapsed: u32,
    obs_space: Space,
    act_space: Space,
}

impl Default for MountainCar {
    fn default() -> Self {
        Self::new()
    }
}

impl MountainCar {
    /// MountainCar-v0 with Gymnasium's parameters.
    pub fn new() -> Self {
        MountainCar {
            min_position: -1.2,
            max_position: 0.6,
            max_speed: 0.07,
            goal_position: 0.5,
            goal_velocity: 0.0,
            force: 0.001,
            gravity: 0.0025,
            max_episode_steps: 200,
            state: [0.0; 2],
            elapsed: 0,
            obs_space: Space::Box {
                low: vec![-1.2, -0.07],
                high: vec![0.6, 0.07],
            },
            act_space: Space::Discrete { n: 3 },
        }
    }
}

impl Env for MountainCar {
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
        let mut rng = NpPcg64::from_seed(seed);
        self.state = [rng.uniform(-0.6, -0.4), 0.0];
        self.elapsed = 0;
        write_obs(ID, obs, self.state).expect("MountainCar-v0: observation buffer shorter than 2");
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<Step, SimError> {
        let a = discrete_action(ID, action, 3)?;
        let [mut position, mut velocity] = self.state;
        velocity += (a as f64 - 1.0) * self.force + (3.0 * position).cos() * (-self.gravity);
        velocity = velocity.clamp(-self.max_speed, self.max_speed);
        position += velocity;
        position = position.clamp(self.min_position, self.max_position);
        // The left wall is inelastic.
        if position == self.min_position && velocity < 0.0 {
            velocity = 0.0;
        }
        let terminated = position >= self.goal_position && velocity >= self.goal_velocity;
        self.state = [position, velocity];
        write_obs(ID, obs, self.state)?;
        self.elapsed = self.elapsed.saturating_add(1);
        Ok(Step {
            reward: -1.0,
            terminated,
            truncated: self.elapsed >= self.max_episode_steps,
        })
    }

    fn state(&self) -> Vec<f64> {
        let mut v = self.state.to_vec();
        v.push(f64::from(self.elapsed));
        v
    }

    fn set_state(&mut self, state: &[f64], obs: &mut [f32]) -> Result<(), SimError> {
        let (s, elapsed) = split_state::<2>(ID, state)?;
        self.state = s;
        self.elapsed = elapsed;
        write_obs(ID, obs, self.state)
    }
}
