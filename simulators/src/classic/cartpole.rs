//! CartPole-v1 (Barto, Sutton & Anderson 1983) as Gymnasium 1.4.0 implements it.

use super::{discrete_action, split_state, write_obs};
use crate::env::{Action, Env, SimError, Space, Step};
use crate::np_rng::NpPcg64;

const ID: &str = "CartPole-v1";

/// How positions are advanced from the accelerations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CartPoleIntegrator {
    /// Explicit Euler (Gymnasium's default `"euler"`): positions use the old velocities.
    Euler,
    /// Semi-implicit Euler: velocities first, positions from the new velocities.
    SemiImplicitEuler,
}

/// A pole hinged on a cart moving on a frictionless track; action 0 pushes left, 1 pushes right.
///
/// Observation (f32): cart position (m), cart velocity (m/s), pole angle (rad, 0 = upright),
/// pole angular velocity (rad/s). Reward 1 per step including the terminating one.
#[derive(Clone, Debug)]
pub struct CartPole {
    /// Gravitational acceleration (m/s^2); Gymnasium: 9.8.
    pub gravity: f64,
    /// Cart mass (kg); Gymnasium: 1.0.
    pub masscart: f64,
    /// Pole mass (kg); Gymnasium: 0.1.
    pub masspole: f64,
    /// Half the pole's length (m); Gymnasium: 0.5.
    pub length: f64,
    /// Magnitude of the push (N); Gymnasium: 10.0.
    pub force_mag: f64,
    /// Time step (s); Gymnasium: 0.02.
    pub tau: f64,
    /// Gymnasium: explicit Euler.
    pub integrator: CartPoleIntegrator,
    /// The episode terminates when |angle| exceeds this (rad); Gymnasium: 12 degrees.
    pub theta_threshold_radians: f64,
    /// The episode terminates when |position| exceeds this (m); Gymnasium: 2.4.
    pub x_threshold: f64,
    /// Truncation horizon (steps); CartPole-v1: 500.
    pub max_episode_steps: u32,
    state: [f64; 4],
    elapsed: u32,
    terminated_before: bool,
    obs_space: Space,
    act_space: Space,
}

impl Default for CartPole {
    fn default() -> Self {
        Self::new()
    }
}

impl CartPole {
    /// CartPole-v1 with Gymnasium's parameters.
    pub fn new() -> Self {
        let theta_threshold_radians = 12.0 * 2.0 * std::f64::consts::PI / 360.0;
        let x_threshold = 2.4;
        let high = [
            (x_threshold * 2.0) as f32,
            f32::MAX,
            (theta_threshold_radians * 2.0) as f32,
            f32::MAX,
        ];
        CartPole {
            gravity: 9.8,
            masscart: 1.0,
            masspole: 0.1,
            length: 0.5,
            force_mag: 10.0,
            tau: 0.02,
            integrator: CartPoleIntegrator::Euler,
            theta_threshold_radians,
            x_threshold,
            max_episode_steps: 500,
            state: [0.0; 4],
            elapsed: 0,
            terminated_before: false,
            obs_space: Space::Box {
                low: high.iter().map(|h| -h).collect(),
                high: high.to_vec(),
            },
            act_space: Space::Discrete { n: 2 },
        }
    }

    fn write(&self, obs: &mut [f32]) -> Result<(), SimError> {
        write_obs(ID, obs, self.state)
    }
}

impl Env for CartPole {
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
        for s in &mut self.state {
            *s = rng.uniform(-0.05, 0.05);
        }
        self.elapsed = 0;
        self.terminated_before = false;
        self.write(obs)
            .expect("CartPole-v1: observation buffer shorter than 4");
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<Step, SimError> {
        let a = discrete_action(ID, action, 2)?;
        let [mut x, mut x_dot, mut theta, mut theta_dot] = self.state;
        let force = if a == 1 {
            self.force_mag
        } else {
            -self.force_mag
        };
        let total_mass = self.masspole + self.masscart;
        let polemass_length = self.masspole * self.length;
        let costheta = theta.cos();
        let sintheta = theta.sin();
        // Same operation order as Gymnasium so that results agree to the last bit where libm does.
        let temp = (force + polemass_length * (theta_dot * theta_dot) * sintheta) / total_mass;
        let thetaacc = (self.gravity * sintheta - costheta * temp)
            / (self.length * (4.0 / 3.0 - self.masspole * (costheta * costheta) / total_mass));
        let xacc = temp - polemass_length * thetaacc * costheta / total_mass;
        match self.integrator {
            CartPoleIntegrator::Euler => {
                x += self.tau * x_dot;
                x_dot += self.tau * xacc;
                theta += self.tau * theta_dot;
                theta_dot += self.tau * thetaacc;
            }
            CartPoleIntegrator::SemiImplicitEuler => {
                x_dot += self.tau * xacc;
                x += self.tau * x_dot;
                theta_dot += self.tau * thetaacc;
                theta += self.tau * theta_dot;
            }
        }
        self.state = [x, x_dot, theta, theta_dot];
        self.write(obs)?;
        let terminated = x < -self.x_threshold
            || x > self.x_threshold
            || theta < -self.theta_threshold_radians
            || theta > self.theta_threshold_radians;
        // Gymnasium pays 1 on the terminating step and 0 on steps taken after it.
        let reward = if terminated && self.terminated_before {
            0.0
        } else {
            1.0
        };
        self.terminated_before |= terminated;
        self.elapsed = self.elapsed.saturating_add(1);
        Ok(Step {
            reward,
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
        let (s, elapsed) = split_state::<4>(ID, state)?;
        self.state = s;
        self.elapsed = elapsed;
        self.terminated_before = false;
        self.write(obs)
    }
}
