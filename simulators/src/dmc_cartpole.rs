//! Cart-pole balance and swing-up with a continuous force, after the DeepMind Control Suite's
//! `cartpole` domain (Tassa et al. 2018; `cartpole.xml` and `cartpole.py`), as seed 001 uses
//! them: 1,000 steps of 0.01 s, smooth reward in [0, 1].
//!
//! # Deviations from MuJoCo
//! MuJoCo is not linked here. The model is the same 2-DOF tree (slider + hinge) with the
//! constants of `cartpole.xml`, integrated like MuJoCo's `RK4` option (classical RK4 over
//! positions and velocities with the control held, constraint forces recomputed at every stage):
//! - The equations of motion are the closed-form Lagrangian ones MuJoCo's recursive algorithms
//!   produce for this tree; passive joint damping is applied explicitly (as MuJoCo does under
//!   RK4). Results differ from MuJoCo only by floating-point rounding, except:
//! - The slider's joint limit (`range=-1.8 1.8`, `solreflimit=.08 1`, default `solimp`) uses
//!   MuJoCo's soft-constraint model: reference acceleration `-b v - k d(r) r`, impedance `d(r)`,
//!   regulariser `R = (1 - d) / d * dof_invweight0` where `dof_invweight0` is the slider's
//!   entry of the inverse mass matrix at `qpos0` (MuJoCo's `efc_diagApprox` for a joint limit,
//!   computed once at model compile time, not at the current pose). The constrained
//!   acceleration is found the way MuJoCo finds it, by its Newton solver warm-started from the
//!   previous step's acceleration ([`crate::mujoco_newton`]): MuJoCo stops that solver early,
//!   which leaves the pole's angular acceleration up to about 1e-3 rad/s^2 from the exact
//!   minimiser on some steps at the rail, and the port reproduces those stops.
//! - The pole's inertia is computed from the capsule geometry (radius 0.045 m, cylinder 1 m,
//!   mass 0.1 kg) with MuJoCo's capsule formula.
//! - Initial states use this crate's seeded generator, not dm_control's `RandomState` streams;
//!   the distributions are the same.
//!
//! [`replay_traces`] checks the port against dm_control 1.0.50 on MuJoCo 3.17.0
//! (`testdata/dmc_cartpole_traces.json`): one step from each recorded state agrees to 4.2e-9
//! at most, at the rail as in free motion (the actions pass through `f32`), whole episodes to
//! 1.1e-5.

use std::f64::consts::PI;

use crate::env::{Action, Env, SimError, Space, Step};
use crate::mujoco_newton::LimitProblem;
use crate::np_rng::NpPcg64;
use crate::replay::ReplayResult;
use crate::trace_json::{field, num, nums};

/// Which Control Suite task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CartpoleTask {
    /// Start near upright, keep it there (`cartpole-balance`).
    Balance,
    /// Start hanging down, swing up and balance (`cartpole-swingup`).
    Swingup,
}

/// A cart on a rail with an unactuated pole; the action in [-1, 1] is scaled by `gear` to a force
/// on the cart (N).
///
/// Observation (f32): cart position (m), cos and sin of the pole angle (rad; 0 = upright), cart
/// velocity (m/s), pole angular velocity (rad/s) — dm_control's `position` then `velocity`.
/// Reward (smooth): `upright * centered * small_control * small_velocity`, see
/// [`DmcCartpole::reward`]; sparse: 1 inside the cart and angle bounds, else 0.
#[derive(Clone, Debug)]
pub struct DmcCartpole {
    /// Balance or swing-up.
    pub task: CartpoleTask,
    /// Sparse (0/1) instead of smooth reward.
    pub sparse: bool,
    /// Cart mass (kg); cartpole.xml: 1.
    pub cart_mass: f64,
    /// Pole mass (kg); cartpole.xml: 0.1.
    pub pole_mass: f64,
    /// Length of the pole's cylinder, hinge to far end cap centre (m); cartpole.xml: 1.
    pub pole_length: f64,
    /// Pole capsule radius (m); cartpole.xml: 0.045.
    pub pole_radius: f64,
    /// Gravitational acceleration (m/s^2); MuJoCo default: 9.81.
    pub gravity: f64,
    /// Actuator gear: force per unit action (N); cartpole.xml: 10.
    pub gear: f64,
    /// Slider damping (N s/m); cartpole.xml: 5e-4.
    pub slider_damping: f64,
    /// Hinge damping (N m s/rad); cartpole.xml: 2e-6.
    pub hinge_damping: f64,
    /// Rail limit: the cart stays in [-limit, limit] (m); cartpole.xml: 1.8.
    pub rail_limit: f64,
    /// Joint-limit time constant (s) and damping ratio; cartpole.xml `solreflimit`: 0.08, 1.
    pub solref_limit: [f64; 2],
    /// MuJoCo `solimp` (dmin, dmax, width m, midpoint, power); MuJoCo default.
    pub solimp: [f64; 5],
    /// Integration and control step (s); cartpole.xml: 0.01.
    pub timestep: f64,
    /// Episode length (steps); dm_control: 10 s / 0.01 s = 1000.
    pub max_episode_steps: u32,
    /// [x (m), theta (rad), x_dot (m/s), theta_dot (rad/s)].
    state: [f64; 4],
    /// The constraint solver's warm start (m/s^2, rad/s^2): the last RK4 stage's acceleration
    /// of the previous step, zero after a reset or `set_state` (see [`crate::mujoco_newton`]).
    warmstart: [f64; 2],
    elapsed: u32,
    obs_space: Space,
    act_space: Space,
}

/// dm_control's `rewards.tolerance` with bounds `(lo, hi)` and a Gaussian sigmoid.
fn tolerance_gaussian(x: f64, lo: f64, hi: f64, margin: f64, value_at_margin: f64) -> f64 {
    if lo <= x && x <= hi {
        return 1.0;
    }
    if margin == 0.0 {
        return 0.0;
    }
    let d = if x < lo { lo - x } else { x - hi } / margin;
    let scale = (-2.0 * value_at_margin.ln()).sqrt();
    (-0.5 * (d * scale) * (d * scale)).exp()
}

/// dm_control's `rewards.tolerance(x, margin=m, value_at_margin=0, sigmoid='quadratic')`.
fn tolerance_quadratic(x: f64, margin: f64) -> f64 {
    if x == 0.0 {
        return 1.0;
    }
    let d = x.abs() / margin;
    if d < 1.0 { 1.0 - d * d } else { 0.0 }
}

impl DmcCartpole {
    /// The Control Suite task with cartpole.xml's constants.
    pub fn new(task: CartpoleTask, sparse: bool) -> Self {
        DmcCartpole {
            task,
            sparse,
            cart_mass: 1.0,
            pole_mass: 0.1,
            pole_length: 1.0,
            pole_radius: 0.045,
            gravity: 9.81,
            gear: 10.0,
            slider_damping: 5e-4,
            hinge_damping: 2e-6,
            rail_limit: 1.8,
            solref_limit: [0.08, 1.0],
            solimp: [0.9, 0.95, 0.001, 0.5, 2.0],
            timestep: 0.01,
            max_episode_steps: 1000,
            state: [0.0; 4],
            warmstart: [0.0; 2],
            elapsed: 0,
            obs_space: Space::Box {
                low: vec![f32::NEG_INFINITY; 5],
                high: vec![f32::INFINITY; 5],
            },
            act_space: Space::Box {
                low: vec![-1.0],
                high: vec![1.0],
            },
        }
    }

    /// `cartpole-balance`.
    pub fn balance() -> Self {
        Self::new(CartpoleTask::Balance, false)
    }

    /// `cartpole-swingup`.
    pub fn swingup() -> Self {
        Self::new(CartpoleTask::Swingup, false)
    }

    /// Transverse moment of inertia of the pole about its centre of mass (kg m^2), MuJoCo's
    /// capsule formula (cylinder plus two hemispherical caps).
    pub fn pole_inertia(&self) -> f64 {
        let r = self.pole_radius;
        let h = self.pole_length;
        let v_cyl = PI * r * r * h;
        let v_sph = 4.0 / 3.0 * PI * r * r * r;
        let density = self.pole_mass / (v_cyl + v_sph);
        let m_cyl = density * v_cyl;
        let m_sph = density * v_sph;
        m_cyl * (3.0 * r * r + h * h) / 12.0
            + m_sph * (2.0 * r * r / 5.0 + h * h / 4.0 + 3.0 * h * r / 8.0)
    }

    /// MuJoCo's `dof_invweight0` of the slider: the slider's entry of the inverse mass matrix
    /// at `qpos0` (pole upright), in 1/kg.
    fn slider_invweight0(&self, inertia: f64) -> f64 {
        let l = self.pole_length / 2.0;
        let a = self.cart_mass + self.pole_mass;
        let b = self.pole_mass * l;
        let c = inertia + self.pole_mass * l * l;
        c / (a * c - b * b)
    }

    /// MuJoCo's constraint impedance d(r) for a violation `r` (m).
    fn impedance(&self, r: f64) -> f64 {
        let [dmin, dmax, width, mid, power] = self.solimp;
        let x = r.abs() / width;
        if x >= 1.0 {
            return dmax;
        }
        if x <= 0.0 {
            return dmin;
        }
        let y = if x <= mid {
            x.powf(power) / mid.powf(power - 1.0)
        } else {
            1.0 - (1.0 - x).powf(power) / (1.0 - mid).powf(power - 1.0)
        };
        dmin + y * (dmax - dmin)
    }

    /// Accelerations (m/s^2, rad/s^2) at `s = [x, theta, x_dot, theta_dot]` under force `f` (N);
    /// `warm` is the constraint solver's warm start (MuJoCo's `qacc_warmstart`).
    #[inline]
    fn accel(&self, s: [f64; 4], f: f64, inertia: f64, warm: [f64; 2]) -> [f64; 2] {
        let [x, th, xd, thd] = s;
        let mc = self.cart_mass;
        let mp = self.pole_mass;
        let l = self.pole_length / 2.0;
        let (sin, cos) = th.sin_cos();
        // Mass matrix [[a, b], [b, c]] and generalised forces.
        let a = mc + mp;
        let b = mp * l * cos;
        let c = inertia + mp * l * l;
        let tau_x = f - self.slider_damping * xd + mp * l * sin * thd * thd;
        let tau_th = mp * self.gravity * l * sin - self.hinge_damping * thd;
        let det = a * c - b * b;
        let xdd = (c * tau_x - b * tau_th) / det;
        let thdd = (a * tau_th - b * tau_x) / det;
        // Soft joint limit on the slider (see the module docs).
        let (r, j) = if x > self.rail_limit {
            (self.rail_limit - x, -1.0)
        } else if x < -self.rail_limit {
            (x + self.rail_limit, 1.0)
        } else {
            return [xdd, thdd];
        };
        let [timeconst, dampratio] = self.solref_limit;
        let timeconst = timeconst.max(2.0 * self.timestep);
        let dmax = self.solimp[1];
        let d = self.impedance(r);
        let k = 1.0 / (dmax * dmax * timeconst * timeconst * dampratio * dampratio);
        let bb = 2.0 / (dmax * timeconst);
        let aref = -bb * (j * xd) - k * d * r;
        let regulariser = ((1.0 - d) / d * self.slider_invweight0(inertia)).max(1e-15);
        let problem = LimitProblem {
            mass: [[a, b], [b, c]],
            qfrc_smooth: [tau_x, tau_th],
            jac: [j, 0.0],
            aref,
            d: 1.0 / regulariser,
            // The trace of the mass matrix does not depend on the pole angle.
            scale: 1.0 / (a + c),
        };
        problem.solve(warm)
    }

    /// The reward of the current state under control `u` (already clipped to [-1, 1]).
    pub fn reward(&self, u: f64) -> f64 {
        let [x, th, _, thd] = self.state;
        let cos = th.cos();
        if self.sparse {
            let cart = if (-0.25..=0.25).contains(&x) {
                1.0
            } else {
                0.0
            };
            let angle = if (0.995..=1.0).contains(&cos) {
                1.0
            } else {
                0.0
            };
            return cart * angle;
        }
        let upright = (cos + 1.0) / 2.0;
        let centered = (1.0 + tolerance_gaussian(x, 0.0, 0.0, 2.0, 0.1)) / 2.0;
        let small_control = (4.0 + tolerance_quadratic(u, 1.0)) / 5.0;
        let small_velocity = (1.0 + tolerance_gaussian(thd, 0.0, 0.0, 5.0, 0.1)) / 2.0;
        upright * small_control * small_velocity * centered
    }

    fn write(&self, obs: &mut [f32]) -> Result<(), SimError> {
        let [x, th, xd, thd] = self.state;
        let got = obs.len();
        let out = obs.get_mut(..5).ok_or(SimError::ObsBuffer {
            env: self.id(),
            got,
            expected: 5,
        })?;
        let vals = [x, th.cos(), th.sin(), xd, thd];
        for (o, v) in out.iter_mut().zip(vals) {
            *o = v as f32;
        }
        Ok(())
    }
}

impl Env for DmcCartpole {
    fn id(&self) -> &'static str {
        match (self.task, self.sparse) {
            (CartpoleTask::Balance, false) => "cartpole-balance",
            (CartpoleTask::Balance, true) => "cartpole-balance_sparse",
            (CartpoleTask::Swingup, false) => "cartpole-swingup",
            (CartpoleTask::Swingup, true) => "cartpole-swingup_sparse",
        }
    }

    fn observation_space(&self) -> &Space {
        &self.obs_space
    }

    fn action_space(&self) -> &Space {
        &self.act_space
    }

    fn reset(&mut self, seed: u64, obs: &mut [f32]) {
        let mut rng = NpPcg64::from_seed(seed);
        let (x, th) = match self.task {
            CartpoleTask::Swingup => (
                0.01 * rng.standard_normal(),
                PI + 0.01 * rng.standard_normal(),
            ),
            CartpoleTask::Balance => (rng.uniform(-0.1, 0.1), rng.uniform(-0.034, 0.034)),
        };
        let xd = 0.01 * rng.standard_normal();
        let thd = 0.01 * rng.standard_normal();
        self.state = [x, th, xd, thd];
        self.warmstart = [0.0; 2];
        self.elapsed = 0;
        self.write(obs)
            .expect("cartpole: observation buffer shorter than 5");
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<Step, SimError> {
        let u = match action {
            Action::Continuous([u]) if !u.is_nan() => f64::from(*u).clamp(-1.0, 1.0),
            other => {
                return Err(SimError::InvalidAction {
                    env: self.id(),
                    action: format!("{other:?}"),
                    expected: "Continuous([u]) with u in [-1, 1]".into(),
                });
            }
        };
        let f = self.gear * u;
        let inertia = self.pole_inertia();
        let h = self.timestep;
        let s = self.state;
        // MuJoCo warm-starts all four stages from the acceleration saved at the end of the
        // previous step, and saves the last stage's acceleration for the next one.
        let warm = self.warmstart;
        let mut last = warm;
        let mut deriv = |s: [f64; 4]| {
            let [xdd, thdd] = self.accel(s, f, inertia, warm);
            last = [xdd, thdd];
            [s[2], s[3], xdd, thdd]
        };
        let add = |y: [f64; 4], k: [f64; 4], c: f64| std::array::from_fn(|i| y[i] + c * k[i]);
        let k1 = deriv(s);
        let k2 = deriv(add(s, k1, h / 2.0));
        let k3 = deriv(add(s, k2, h / 2.0));
        let k4 = deriv(add(s, k3, h));
        self.warmstart = last;
        self.state =
            std::array::from_fn(|i| s[i] + h / 6.0 * (k1[i] + 2.0 * k2[i] + 2.0 * k3[i] + k4[i]));
        self.write(obs)?;
        self.elapsed = self.elapsed.saturating_add(1);
        Ok(Step {
            reward: self.reward(u),
            terminated: false,
            truncated: self.elapsed >= self.max_episode_steps,
        })
    }

    /// `[x (m), theta (rad), x_dot (m/s), theta_dot (rad/s), elapsed steps]`.
    fn state(&self) -> Vec<f64> {
        let mut v = self.state.to_vec();
        v.push(f64::from(self.elapsed));
        v
    }

    fn set_state(&mut self, state: &[f64], obs: &mut [f32]) -> Result<(), SimError> {
        let (s, elapsed) = crate::classic::split_state::<4>(self.id(), state)?;
        self.state = s;
        self.warmstart = [0.0; 2];
        self.elapsed = elapsed;
        self.write(obs)
    }
}

/// Tolerance of one step from a recorded dm_control state (largest absolute error over
/// position (m, rad) and velocity (m/s, rad/s)). The port reaches 4.2e-9 on the 6,000 recorded
/// steps; before it followed MuJoCo's solver iterations, 1.2e-6 at the rail.
pub const ONE_STEP_TOLERANCE: f64 = 1e-6;
/// Tolerance of a whole episode replayed from the recorded reset state with the recorded
/// actions (same units as [`ONE_STEP_TOLERANCE`]).
pub const EPISODE_TOLERANCE: f64 = 1e-4;
/// Tolerance on the smooth reward (absolute).
pub const REWARD_TOLERANCE: f64 = 1e-6;

/// Replays dm_control cart-pole traces (`testdata/dmc_cartpole_traces.json`): per episode, the
/// MuJoCo state after reset (`qpos0`, `qvel0`), then each action with the state and reward after
/// the step. Two results per episode: `one_step` (the port stepped once from every recorded
/// state) and `episode` (the port run through the whole episode from the reset state); error
/// kind `state_abs`. A step whose reward is off by more than [`REWARD_TOLERANCE`] counts as a
/// mismatched flag.
pub fn replay_traces(traces: &serde_json::Value) -> Result<Vec<ReplayResult>, SimError> {
    let episodes = field(traces, "episodes")?
        .as_array()
        .ok_or_else(|| SimError::Trace("episodes is not an array".into()))?;
    let mut results = Vec::new();
    for ep in episodes {
        let task = match field(ep, "task")?.as_str() {
            Some("balance") => CartpoleTask::Balance,
            Some("swingup") => CartpoleTask::Swingup,
            other => {
                return Err(SimError::Trace(format!(
                    "unknown cart-pole task {other:?}: expected \"balance\" or \"swingup\""
                )));
            }
        };
        let kind = field(ep, "actions_kind")?.as_str().unwrap_or("?");
        let seed = num(ep, "seed")?;
        let pair = |v: &serde_json::Value, key: &str| -> Result<[f64; 2], SimError> {
            let x = nums(v, key)?;
            x.as_slice()
                .try_into()
                .map_err(|_| SimError::Trace(format!("{key} has {} values, expected 2", x.len())))
        };
        let state_of = |v: &serde_json::Value, p: &str, q: &str| -> Result<[f64; 4], SimError> {
            let (pos, vel) = (pair(v, p)?, pair(v, q)?);
            Ok([pos[0], pos[1], vel[0], vel[1]])
        };
        let steps = field(ep, "steps")?
            .as_array()
            .ok_or_else(|| SimError::Trace("steps is not an array".into()))?;
        let reset = state_of(ep, "qpos0", "qvel0")?;
        let mut whole = DmcCartpole::new(task, false);
        let mut single = DmcCartpole::new(task, false);
        whole.max_episode_steps = u32::try_from(steps.len()).unwrap_or(u32::MAX);
        single.max_episode_steps = whole.max_episode_steps;
        let mut obs = [0.0f32; 5];
        whole.set_state(&[reset[0], reset[1], reset[2], reset[3], 0.0], &mut obs)?;
        let mut before = reset;
        let (mut one_err, mut ep_err, mut rew_err, mut flags): (f64, f64, f64, usize) =
            (0.0, 0.0, 0.0, 0);
        let worst = |acc: f64, got: [f64; 4], want: [f64; 4]| {
            got.iter().zip(want).fold(acc, |m, (g, w)| {
                let e = (g - w).abs();
                if e.is_nan() { f64::INFINITY } else { m.max(e) }
            })
        };
        for (k, s) in steps.iter().enumerate() {
            let u = num(s, "action")? as f32;
            let after = state_of(s, "qpos", "qvel")?;
            let k = k as f64;
            // MuJoCo's solver memory is not in the trace: carry the port's own, from the step
            // it took from the previous recorded state (zero at the first step, as after reset).
            let warm = single.warmstart;
            single.set_state(&[before[0], before[1], before[2], before[3], k], &mut obs)?;
            single.warmstart = warm;
            let st = single.step(Action::Continuous(&[u]), &mut obs)?;
            one_err = worst(one_err, single.state, after);
            let e = (st.reward - num(s, "reward")?).abs();
            let e = if e.is_nan() { f64::INFINITY } else { e };
            rew_err = rew_err.max(e);
            if e > REWARD_TOLERANCE || st.terminated {
                flags += 1;
            }
            whole.step(Action::Continuous(&[u]), &mut obs)?;
            ep_err = worst(ep_err, whole.state, after);
            before = after;
        }
        let name = format!("{}/{kind}/seed {seed}", whole.id());
        for (mode, err, tol) in [
            ("one_step", one_err, ONE_STEP_TOLERANCE),
            ("episode", ep_err, EPISODE_TOLERANCE),
        ] {
            results.push(ReplayResult {
                name: format!("{name} ({mode})"),
                episodes: 1,
                steps: steps.len(),
                max_error: err,
                error_kind: "state_abs".into(),
                tolerance: tol,
                mismatched_flags: flags,
                max_reward_error: rew_err,
                pass: err <= tol && flags == 0,
            });
        }
    }
    Ok(results)
}
