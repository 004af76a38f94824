//! Pendulum-v1 (inverted pendulum swing-up) as Gymnasium 1.4.0 implements it.

use std::f64::consts::PI;

use super::{split_state, write_obs};
use crate::env::{Action, Env, SimError, Space, Step};
use crate::np_rng::NpPcg64;

const ID: &str = "Pendulum-v1";

/// A pendulum on a fixed pivot driven by a torque in [-2, 2] N m (larger actions are clipped).
///
/// Observation (f32): cos(theta), sin(theta) (theta in rad, 0 = upright), angular velocity
/// (rad/s). Reward `-(angle^2 + 0.1 omega^2 + 0.001 u^2)` with the angle normalised to [-pi, pi).
/// Never terminates; truncated after 200 steps.
#[derive(Clone, Debug)]
pub struct Pendulum {
    /// Angular velocity bound (rad/s); Gymnasium: 8.
    pub max_speed: f64,
    /// Torque bound (N m); Gymnasium: 2.
    pub max_torque: f32,
    /// Time step (s); Gymnasium: 0.05.
    pub dt: f64,
    /// Gravitational acceleration (m/s^2); Gymnasium: 10.
    pub g: f64,
    /// Mass (kg); Gymnasium: 1.
    pub m: f64,
    /// Length (m); Gymnasium: 1.
    pub l: f64,
    /// Truncation horizon (steps); Pendulum-v1: 200.
    pub max_episode_steps: u32,
    state: [f64; 2],
    elapsed: u32,
    obs_space: Space,
    act_space: Space,
}

impl Default for Pendulum {
    fn default() -> Self {
        Self::new()
    }
}

impl Pendulum {
    /// Pendulum-v1 with Gymnasium's parameters.
    pub fn new() -> Self {
        Pendulum {
            max_speed: 8.0,
            max_torque: 2.0,
            dt: 0.05,
            g: 10.0,
            m: 1.0,
            l: 1.0,
            max_episode_steps: 200,
            state: [0.0; 2],
            elapsed: 0,
            obs_space: Space::Box {
                low: vec![-1.0, -1.0, -8.0],
                high: vec![1.0, 1.0, 8.0],
            },
            act_space: Space::Box {
                low: vec![-2.0],
                high: vec![2.0],
            },
        }
    }

    fn write(&self, obs: &mut [f32]) -> Result<(), SimError> {
        let [th, thdot] = self.state;
        write_obs(ID, obs, [th.cos(), th.sin(), thdot])
    }
}

/// Gymnasium's `angle_normalize`: into [-pi, pi) with a floored modulo.
#[inline]
fn angle_normalize(x: f64) -> f64 {
    (x + PI).rem_euclid(2.0 * PI) - PI
}

impl Env for Pendulum {
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
        self.state[0] = rng.uniform(-PI, PI);
        self.state[1] = rng.uniform(-1.0, 1.0);
        self.elapsed = 0;
        self.write(obs)
            .expect("Pendulum-v1: observation buffer shorter than 3");
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<Step, SimError> {
        let u = match action {
            Action::Continuous([u]) if !u.is_nan() => *u,
            other => {
                return Err(SimError::InvalidAction {
                    env: ID,
                    action: format!("{other:?}"),
                    expected: "Continuous([torque]) with one number".into(),
                });
            }
        };
        // Gymnasium clips the float32 action and keeps float32 arithmetic for the torque terms
        // (numpy's scalar promotion), which the rewards show to the last bit.
        let u = u.clamp(-self.max_torque, self.max_torque);
        let [th, thdot] = self.state;
        let an = angle_normalize(th);
        let costs = an * an + 0.1 * (thdot * thdot) + f64::from(0.001f32 * (u * u));
        let torque_term = f64::from((3.0 / (self.m * self.l * self.l)) as f32 * u);
        let newthdot = thdot + (3.0 * self.g / (2.0 * self.l) * th.sin() + torque_term) * self.dt;
        let newthdot = newthdot.clamp(-self.max_speed, self.max_speed);
        let newth = th + newthdot * self.dt;
        self.state = [newth, newthdot];
        self.write(obs)?;
        self.elapsed = self.elapsed.saturating_add(1);
        Ok(Step {
            reward: -costs,
            terminated: false,
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
        self.write(obs)
    }
}
