//! Acrobot-v1 (Sutton 1996; Sutton & Barto's book dynamics) as Gymnasium 1.4.0 implements it.

use std::f64::consts::PI;

use super::{discrete_action, split_state, write_obs};
use crate::env::{Action, Env, SimError, Space, Step};
use crate::np_rng::NpPcg64;

const ID: &str = "Acrobot-v1";

/// Which equations of motion to integrate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcrobotDynamics {
    /// Sutton & Barto's book (Gymnasium's default `book_or_nips = "book"`).
    Book,
    /// The NeurIPS 1995 paper, which misses a term of the book's equations.
    Nips,
}

/// Two links hanging from a fixed pivot; a torque of -1, 0 or +1 N m on the middle joint
/// (actions 0, 1, 2). Integrated with one classical RK4 step of `dt` per action.
///
/// Observation (f32): cos and sin of both angles (rad; 0 = hanging down, the second relative to
/// the first), then both angular velocities (rad/s). Reward -1 per step, 0 on reaching the goal
/// height (`-cos(t1) - cos(t1 + t2) > 1`, which terminates).
#[derive(Clone, Debug)]
pub struct Acrobot {
    /// Length of link 1 (m); Gymnasium: 1.0. Enters the dynamics.
    pub link_length_1: f64,
    /// Length of link 2 (m); Gymnasium: 1.0. Like Gymnasium, only kept for completeness: neither
    /// the dynamics nor the goal test read it.
    pub link_length_2: f64,
    /// Mass of link 1 (kg); Gymnasium: 1.0.
    pub link_mass_1: f64,
    /// Mass of link 2 (kg); Gymnasium: 1.0.
    pub link_mass_2: f64,
    /// Position of link 1's centre of mass from the pivot (m); Gymnasium: 0.5.
    pub link_com_pos_1: f64,
    /// Position of link 2's centre of mass from the joint (m); Gymnasium: 0.5.
    pub link_com_pos_2: f64,
    /// Moment of inertia of each link (kg m^2); Gymnasium: 1.0.
    pub link_moi: f64,
    /// Gravitational acceleration (m/s^2); Gymnasium: 9.8.
    pub gravity: f64,
    /// Time per action (s); Gymnasium: 0.2.
    pub dt: f64,
    /// Bound on the first joint's angular velocity (rad/s); Gymnasium: 4 pi.
    pub max_vel_1: f64,
    /// Bound on the second joint's angular velocity (rad/s); Gymnasium: 9 pi.
    pub max_vel_2: f64,
    /// Torque of each action (N m); Gymnasium: [-1, 0, 1].
    pub avail_torque: [f64; 3],
    /// Gymnasium: book.
    pub dynamics: AcrobotDynamics,
    /// Truncation horizon (steps); Acrobot-v1: 500.
    pub max_episode_steps: u32,
    state: [f64; 4],
    elapsed: u32,
    obs_space: Space,
    act_space: Space,
}

impl Default for Acrobot {
    fn default() -> Self {
        Self::new()
    }
}

impl Acrobot {
    /// Acrobot-v1 with Gymnasium's parameters.
    pub fn new() -> Self {
        let max_vel_1 = 4.0 * PI;
        let max_vel_2 = 9.0 * PI;
        let high = [1.0, 1.0, 1.0, 1.0, max_vel_1 as f32, max_vel_2 as f32];
        Acrobot {
            link_length_1: 1.0,
            link_length_2: 1.0,
            link_mass_1: 1.0,
            link_mass_2: 1.0,
            link_com_pos_1: 0.5,
            link_com_pos_2: 0.5,
            link_moi: 1.0,
            gravity: 9.8,
            dt: 0.2,
            max_vel_1,
            max_vel_2,
            avail_torque: [-1.0, 0.0, 1.0],
            dynamics: AcrobotDynamics::Book,
            max_episode_steps: 500,
            state: [0.0; 4],
            elapsed: 0,
            obs_space: Space::Box {
                low: high.iter().map(|h| -h).collect(),
                high: high.to_vec(),
            },
            act_space: Space::Discrete { n: 3 },
        }
    }

    fn write(&self, obs: &mut [f32]) -> Result<(), SimError> {
        let s = &self.state;
        write_obs(
            ID,
            obs,
            [s[0].cos(), s[0].sin(), s[1].cos(), s[1].sin(), s[2], s[3]],
        )
    }

    /// Time derivative of (theta1, theta2, dtheta1, dtheta2) under torque `a` (N m).
    #[inline]
    fn dsdt(&self, s: [f64; 4], a: f64) -> [f64; 4] {
        let m1 = self.link_mass_1;
        let m2 = self.link_mass_2;
        let l1 = self.link_length_1;
        let lc1 = self.link_com_pos_1;
        let lc2 = self.link_com_pos_2;
        let i1 = self.link_moi;
        let i2 = self.link_moi;
        let g = self.gravity;
        let [theta1, theta2, dtheta1, dtheta2] = s;
        // Gymnasium's operation order, kept so the chaotic trajectories stay close to its own.
        let sin2 = theta2.sin();
        let cos2 = theta2.cos();
        let d1 = m1 * (lc1 * lc1) + m2 * (l1 * l1 + lc2 * lc2 + 2.0 * l1 * lc2 * cos2) + i1 + i2;
        let d2 = m2 * (lc2 * lc2 + l1 * lc2 * cos2) + i2;
        let phi2 = m2 * lc2 * g * (theta1 + theta2 - PI / 2.0).cos();
        let phi1 = -m2 * l1 * lc2 * (dtheta2 * dtheta2) * sin2
            - 2.0 * m2 * l1 * lc2 * dtheta2 * dtheta1 * sin2
            + (m1 * lc1 + m2 * l1) * g * (theta1 - PI / 2.0).cos()
            + phi2;
        let ddtheta2 = match self.dynamics {
            AcrobotDynamics::Nips => {
                (a + d2 / d1 * phi1 - phi2) / (m2 * (lc2 * lc2) + i2 - (d2 * d2) / d1)
            }
            AcrobotDynamics::Book => {
                (a + d2 / d1 * phi1 - m2 * l1 * lc2 * (dtheta1 * dtheta1) * sin2 - phi2)
                    / (m2 * (lc2 * lc2) + i2 - (d2 * d2) / d1)
            }
        };
        let ddtheta1 = -(d2 * ddtheta2 + phi1) / d1;
        [dtheta1, dtheta2, ddtheta1, ddtheta2]
    }

    /// One classical RK4 step of length `dt` (s), as Gymnasium's `rk4` over `[0, dt]`.
    #[inline]
    fn rk4(&self, y0: [f64; 4], a: f64) -> [f64; 4] {
        let dt = self.dt;
        let dt2 = dt / 2.0;
        let add = |y: [f64; 4], h: f64, k: [f64; 4]| std::array::from_fn(|i| y[i] + h * k[i]);
        let k1 = self.dsdt(y0, a);
        let k2 = self.dsdt(add(y0, dt2, k1), a);
        let k3 = self.dsdt(add(y0, dt2, k2), a);
        let k4 = self.dsdt(add(y0, dt, k3), a);
        std::array::from_fn(|i| y0[i] + dt / 6.0 * (k1[i] + 2.0 * k2[i] + 2.0 * k3[i] + k4[i]))
    }
}

/// Wraps `x` into `[lo, hi]` by whole periods, as Gymnasium's `wrap`.
#[inline]
fn wrap(mut x: f64, lo: f64, hi: f64) -> f64 {
    let diff = hi - lo;
    // Loops like Gymnasium's; a non-finite x would never leave them, so it passes through.
    if !x.is_finite() {
        return x;
    }
    while x > hi {
        x -= diff;
    }
    while x < lo {
        x += diff;
    }
    x
}

impl Env for Acrobot {
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
            // Gymnasium stores the initial state as float32.
            *s = f64::from(rng.uniform(-0.1, 0.1) as f32);
        }
        self.elapsed = 0;
        self.write(obs)
            .expect("Acrobot-v1: observation buffer shorter than 6");
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<Step, SimError> {
        let a = discrete_action(ID, action, 3)?;
        let torque = self.avail_torque[a];
        let mut ns = self.rk4(self.state, torque);
        ns[0] = wrap(ns[0], -PI, PI);
        ns[1] = wrap(ns[1], -PI, PI);
        ns[2] = ns[2].max(-self.max_vel_1).min(self.max_vel_1);
        ns[3] = ns[3].max(-self.max_vel_2).min(self.max_vel_2);
        self.state = ns;
        self.write(obs)?;
        let terminated = -ns[0].cos() - (ns[1] + ns[0]).cos() > 1.0;
        self.elapsed = self.elapsed.saturating_add(1);
        Ok(Step {
            reward: if terminated { 0.0 } else { -1.0 },
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
        self.write(obs)
    }
}
