//! HIV treatment (Ernst, Stan, Gonçalves & Wehenkel 2006) as RLPy's `HIVTreatment` domain
//! implements it: six state variables (T1, T2, T1*, T2*, V, E in cells or copies per mL),
//! integrated over each treatment interval, reward
//! -0.1 V - 20000 eps1^2 - 2000 eps2^2 + 1000 E on the post-step state, observations log10 of
//! the state. RLPy's action table lists (0.3, 0) for "PI only"; the corrected table used here
//! (and in the reference traces) is (0, 0), (0.7, 0), (0, 0.3), (0.7, 0.3).
//!
//! [`HivParams`] carries the settings that differ between RLPy (5-day steps x 200) and seed 000
//! (20-day steps x 50), and the per-expert variations of seed 000's appendix B.1: penalty
//! weights and Gaussian noise on the drug efficacy.

use crate::trace_json::{field, num, nums};
use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

use crate::env::{Action, Env, SimError, Space, Step};
use crate::ode::{Dopri5, OdeOptions};
use crate::replay::ReplayResult;

/// Number of state variables.
pub const N_STATES: usize = 6;

/// RLPy's starting point: the non-healthy stable state (T1, T2, T1*, T2*, V, E).
pub const INITIAL_STATE: [f64; N_STATES] = [163573.0, 5.0, 11945.0, 46.0, 63919.0, 24.0];

/// Drug efficacies (eps1 = reverse-transcriptase inhibitor, eps2 = protease inhibitor) of the
/// four actions, with the "PI only" entry corrected.
pub const ACTIONS: [(f64, f64); 4] = [(0.0, 0.0), (0.7, 0.0), (0.0, 0.3), (0.7, 0.3)];

/// Settings of one HIV environment.
#[derive(Clone, Debug, PartialEq)]
pub struct HivParams {
    /// Length of one treatment interval (days).
    pub days_per_step: f64,
    /// Steps per episode (then truncated).
    pub steps_per_episode: usize,
    /// Reward penalty on eps1^2 (RTI side effects).
    pub eps1_penalty: f64,
    /// Reward penalty on eps2^2 (PI side effects).
    pub eps2_penalty: f64,
    /// Standard deviation of Gaussian noise added to the efficacy of each administered drug
    /// at every step (0 for none); the noisy efficacy is clipped to [0, 1]. The reward
    /// penalises the prescribed (noise-free) dose.
    pub efficacy_noise_sd: f64,
    pub initial_state: [f64; N_STATES],
}

impl Default for HivParams {
    fn default() -> Self {
        Self::rlpy()
    }
}

impl HivParams {
    /// RLPy's setting: 5-day steps, 200 steps (1000 days).
    pub fn rlpy() -> Self {
        Self {
            days_per_step: 5.0,
            steps_per_episode: 200,
            eps1_penalty: 2e4,
            eps2_penalty: 2e3,
            efficacy_noise_sd: 0.0,
            initial_state: INITIAL_STATE,
        }
    }

    /// Seed 000's default: 20-day steps, 50 steps.
    pub fn seed000() -> Self {
        Self {
            days_per_step: 20.0,
            steps_per_episode: 50,
            ..Self::rlpy()
        }
    }

    /// Number of expert settings of seed 000 appendix B.1 (50 x 20 x 2).
    pub const EXPERT_SETTINGS: usize = 2000;

    /// Seed 000's expert setting `index` (0..2000) on top of [`HivParams::seed000`]: the
    /// drug-1 penalty over 50 equally spaced values in [18750, 21250], the drug-2 penalty over
    /// 20 values in [1850, 2150], efficacy noise off or with standard deviation 0.01.
    /// Index order: penalty 1 slowest, noise fastest.
    pub fn expert_variation(index: usize) -> Result<Self, SimError> {
        if index >= Self::EXPERT_SETTINGS {
            return Err(SimError::Invalid(format!(
                "HIV expert setting {index} out of range 0..{}",
                Self::EXPERT_SETTINGS
            )));
        }
        let noise = index % 2;
        let i2 = (index / 2) % 20;
        let i1 = index / 40;
        Ok(Self {
            eps1_penalty: 18750.0 + (21250.0 - 18750.0) * i1 as f64 / 49.0,
            eps2_penalty: 1850.0 + (2150.0 - 1850.0) * i2 as f64 / 19.0,
            efficacy_noise_sd: if noise == 1 { 0.01 } else { 0.0 },
            ..Self::seed000()
        })
    }

    fn validate(&self) -> Result<(), SimError> {
        let ok = self.days_per_step.is_finite()
            && self.days_per_step > 0.0
            && self.steps_per_episode > 0
            && self.eps1_penalty.is_finite()
            && self.eps2_penalty.is_finite()
            && self.efficacy_noise_sd.is_finite()
            && self.efficacy_noise_sd >= 0.0
            && self.initial_state.iter().all(|v| v.is_finite() && *v > 0.0);
        if ok {
            Ok(())
        } else {
            Err(SimError::Invalid(format!(
                "HIV: invalid parameters {self:?}"
            )))
        }
    }
}

/// The model's right-hand side (per day).
fn derivatives(eps1: f64, eps2: f64, s: &[f64], ds: &mut [f64]) {
    const LAMBDA1: f64 = 1e4;
    const LAMBDA2: f64 = 31.98;
    const D1: f64 = 0.01;
    const D2: f64 = 0.01;
    const F: f64 = 0.34;
    const K1: f64 = 8e-7;
    const K2: f64 = 1e-4;
    const DELTA: f64 = 0.7;
    const M1: f64 = 1e-5;
    const M2: f64 = 1e-5;
    const NT: f64 = 100.0;
    const C: f64 = 13.0;
    const RHO1: f64 = 1.0;
    const RHO2: f64 = 1.0;
    const LAMBDA_E: f64 = 1.0;
    const B_E: f64 = 0.3;
    const K_B: f64 = 100.0;
    const D_E: f64 = 0.25;
    const K_D: f64 = 500.0;
    const DELTA_E: f64 = 0.1;
    let (t1, t2, t1s, t2s, v, e) = (s[0], s[1], s[2], s[3], s[4], s[5]);
    let inf1 = (1.0 - eps1) * K1 * v * t1;
    let inf2 = (1.0 - F * eps1) * K2 * v * t2;
    ds[0] = LAMBDA1 - D1 * t1 - inf1;
    ds[1] = LAMBDA2 - D2 * t2 - inf2;
    ds[2] = inf1 - DELTA * t1s - M1 * e * t1s;
    ds[3] = inf2 - DELTA * t2s - M2 * e * t2s;
    ds[4] = (1.0 - eps2) * NT * DELTA * (t1s + t2s)
        - C * v
        - ((1.0 - eps1) * RHO1 * K1 * t1 + (1.0 - F * eps1) * RHO2 * K2 * t2) * v;
    let infected = t1s + t2s;
    ds[5] = LAMBDA_E + B_E * infected / (infected + K_B) * e
        - D_E * infected / (infected + K_D) * e
        - DELTA_E * e;
}

/// The HIV treatment environment.
///
/// Observation: log10 of (T1, T2, T1*, T2*, V, E). Actions: 4 (none, RTI, PI, both). No
/// terminal states; truncated after `steps_per_episode` steps.
pub struct HivEnv {
    id: &'static str,
    params: HivParams,
    obs_space: Space,
    act_space: Space,
    s: [f64; N_STATES],
    t: usize,
    rng: ChaCha8Rng,
    solver: Dopri5,
}

impl HivEnv {
    /// RLPy's setting (5-day steps x 200).
    pub const ID: &'static str = "HIVTreatment-v0";
    /// Seed 000's setting (20-day steps x 50).
    pub const ID_20D: &'static str = "HIVTreatment20d-v0";
    /// Any other step length.
    pub const ID_CUSTOM: &'static str = "HIVTreatment-custom-v0";

    /// `HIVTreatment-v0`.
    pub fn rlpy() -> Self {
        Self::build(Self::ID, HivParams::rlpy())
    }

    /// `HIVTreatment20d-v0`.
    pub fn seed000() -> Self {
        Self::build(Self::ID_20D, HivParams::seed000())
    }

    /// An environment with the given settings; its id follows the step length (5 days:
    /// `HIVTreatment-v0`, 20 days: `HIVTreatment20d-v0`, otherwise `HIVTreatment-custom-v0`).
    pub fn new(params: HivParams) -> Result<Self, SimError> {
        params.validate()?;
        let id = if params.days_per_step == 5.0 {
            Self::ID
        } else if params.days_per_step == 20.0 {
            Self::ID_20D
        } else {
            Self::ID_CUSTOM
        };
        Ok(Self::build(id, params))
    }

    fn build(id: &'static str, params: HivParams) -> Self {
        Self {
            id,
            obs_space: Space::Box {
                low: vec![-5.0; N_STATES],
                high: vec![8.0; N_STATES],
            },
            act_space: Space::Discrete { n: 4 },
            s: params.initial_state,
            params,
            t: 0,
            rng: ChaCha8Rng::seed_from_u64(0),
            // Tolerances 15x tighter than odeint's defaults (1.49e-8): replay errors are the
            // same as at 1e-12, i.e. the reference's own error dominates, at 2x the speed.
            solver: Dopri5::new(
                N_STATES,
                OdeOptions {
                    rtol: 1e-9,
                    atol: 1e-9,
                    max_steps: 200_000,
                    ..OdeOptions::default()
                },
            ),
        }
    }

    pub fn params(&self) -> &HivParams {
        &self.params
    }

    /// The state (T1, T2, T1*, T2*, V, E).
    pub fn raw_state(&self) -> &[f64; N_STATES] {
        &self.s
    }

    fn write_obs(&self, obs: &mut [f32]) {
        for (o, v) in obs.iter_mut().zip(self.s.iter()) {
            *o = v.log10() as f32;
        }
    }

    /// Reward of the current (post-step) state for prescribed efficacies.
    pub fn reward(&self, eps1: f64, eps2: f64) -> f64 {
        -0.1 * self.s[4]
            - self.params.eps1_penalty * eps1 * eps1
            - self.params.eps2_penalty * eps2 * eps2
            + 1e3 * self.s[5]
    }

    fn noisy(&mut self, eps: f64) -> f64 {
        if self.params.efficacy_noise_sd > 0.0 && eps > 0.0 {
            let z: f64 = StandardNormal.sample(&mut self.rng);
            (eps + self.params.efficacy_noise_sd * z).clamp(0.0, 1.0)
        } else {
            eps
        }
    }
}

impl Env for HivEnv {
    fn id(&self) -> &'static str {
        self.id
    }

    fn observation_space(&self) -> &Space {
        &self.obs_space
    }

    fn action_space(&self) -> &Space {
        &self.act_space
    }

    /// The start state is deterministic; the seed only drives the efficacy noise.
    fn reset(&mut self, seed: u64, obs: &mut [f32]) {
        self.rng = ChaCha8Rng::seed_from_u64(seed);
        self.s = self.params.initial_state;
        self.t = 0;
        self.write_obs(obs);
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<Step, SimError> {
        let (eps1, eps2) = match action {
            Action::Discrete(a) if a < ACTIONS.len() => ACTIONS[a],
            other => {
                return Err(SimError::InvalidAction {
                    env: self.id,
                    action: format!("{other:?}"),
                    expected: "Discrete(0..4)".into(),
                });
            }
        };
        let (e1, e2) = (self.noisy(eps1), self.noisy(eps2));
        self.solver
            .integrate(
                |_, s, ds| derivatives(e1, e2, s, ds),
                0.0,
                self.params.days_per_step,
                &mut self.s,
            )
            .map_err(|e| SimError::Invalid(format!("{}: {e}", self.id)))?;
        self.t += 1;
        self.write_obs(obs);
        Ok(Step {
            reward: self.reward(eps1, eps2),
            terminated: false,
            truncated: self.t >= self.params.steps_per_episode,
        })
    }

    /// (T1, T2, T1*, T2*, V, E, steps taken).
    fn state(&self) -> Vec<f64> {
        let mut v = self.s.to_vec();
        v.push(self.t as f64);
        v
    }

    /// Accepts the 7 values of [`HivEnv::state`], or just the 6 model states (step count 0).
    fn set_state(&mut self, state: &[f64], obs: &mut [f32]) -> Result<(), SimError> {
        if state.len() != N_STATES && state.len() != N_STATES + 1 {
            return Err(SimError::StateLength {
                env: self.id,
                got: state.len(),
                expected: N_STATES + 1,
            });
        }
        if state[..N_STATES]
            .iter()
            .any(|v| !v.is_finite() || *v <= 0.0)
        {
            return Err(SimError::Invalid(format!(
                "{}: states must be positive and finite (log10 observations)",
                self.id
            )));
        }
        let t = state.get(N_STATES).copied().unwrap_or(0.0);
        if !(t >= 0.0 && t.fract() == 0.0) {
            return Err(SimError::Invalid(format!(
                "{}: bad step count {t}",
                self.id
            )));
        }
        self.s.copy_from_slice(&state[..N_STATES]);
        self.t = t as usize;
        self.write_obs(obs);
        Ok(())
    }
}

/// Observation tolerance of the HIV replay (absolute, in log10 units).
pub const OBS_ABS_TOLERANCE: f64 = 1e-4;
/// Reward tolerance of the HIV replay (relative).
pub const REWARD_REL_TOLERANCE: f64 = 1e-4;

/// Replays an HIV trace file (`testdata/hiv_traces.json`): per episode, the setting's step
/// length, the initial state, then each action; log10 observations are compared absolutely and
/// rewards relatively. One result per setting (`HIVTreatment-v0/rlpy-5day`, ...), error kind
/// `obs_abs`, tolerance 1e-4; a step whose reward is off by more than 1e-4 relative counts as a
/// mismatched flag.
pub fn replay_traces(traces: &serde_json::Value) -> Result<Vec<ReplayResult>, SimError> {
    let episodes = field(traces, "episodes")?
        .as_array()
        .ok_or_else(|| SimError::Trace("episodes is not an array".into()))?;
    let mut results: Vec<ReplayResult> = Vec::new();
    for ep in episodes {
        let setting = field(ep, "setting")?
            .as_str()
            .ok_or_else(|| SimError::Trace("setting is not a string".into()))?;
        let days = num(ep, "days_per_step")?;
        let n_steps = num(ep, "steps_per_episode")?;
        let init = nums(ep, "initial_state")?;
        let initial_state: [f64; N_STATES] = init.as_slice().try_into().map_err(|_| {
            SimError::Trace(format!(
                "initial_state has {} values, expected 6",
                init.len()
            ))
        })?;
        if !(n_steps >= 1.0 && n_steps.fract() == 0.0) {
            return Err(SimError::Trace(format!("bad steps_per_episode {n_steps}")));
        }
        let mut env = HivEnv::new(HivParams {
            days_per_step: days,
            steps_per_episode: n_steps as usize,
            initial_state,
            ..HivParams::rlpy()
        })?;
        let mut obs = [0.0f32; N_STATES];
        env.reset(0, &mut obs);
        let steps = field(ep, "steps")?
            .as_array()
            .ok_or_else(|| SimError::Trace("steps is not an array".into()))?;
        let mut max_err: f64 = 0.0;
        let mut max_rew: f64 = 0.0;
        let mut flags = 0usize;
        for (k, s) in steps.iter().enumerate() {
            let a = num(s, "action")?;
            if !(0.0..4.0).contains(&a) || a.fract() != 0.0 {
                return Err(SimError::Trace(format!("bad HIV action {a}")));
            }
            let st = env.step(Action::Discrete(a as usize), &mut obs)?;
            let want = nums(s, "obs")?;
            if want.len() != N_STATES {
                return Err(SimError::Trace("obs must have 6 values".into()));
            }
            for (x, y) in env.raw_state().iter().zip(&want) {
                let e = (x.log10() - y).abs();
                max_err = if e.is_nan() {
                    f64::INFINITY
                } else {
                    max_err.max(e)
                };
            }
            let r = num(s, "reward")?;
            let e = (st.reward - r).abs() / r.abs().max(1e-12);
            let e = if e.is_nan() { f64::INFINITY } else { e };
            max_rew = max_rew.max(e);
            let last = k + 1 == steps.len();
            if e > REWARD_REL_TOLERANCE || st.terminated || st.truncated != last {
                flags += 1;
            }
        }
        let name = format!("{}/{setting}", env.id());
        let idx = match results.iter().position(|r| r.name == name) {
            Some(i) => i,
            None => {
                results.push(ReplayResult {
                    name,
                    error_kind: "obs_abs".into(),
                    tolerance: OBS_ABS_TOLERANCE,
                    ..Default::default()
                });
                results.len() - 1
            }
        };
        let r = &mut results[idx];
        r.episodes += 1;
        r.steps += steps.len();
        r.max_error = r.max_error.max(max_err);
        r.max_reward_error = r.max_reward_error.max(max_rew);
        r.mismatched_flags += flags;
        r.pass = r.max_error <= OBS_ABS_TOLERANCE && r.mismatched_flags == 0;
    }
    Ok(results)
}
