//! The one environment interface every simulator implements.

use thiserror::Error;

/// An observation or action space.
#[derive(Clone, Debug, PartialEq)]
pub enum Space {
    /// Actions `0..n`.
    Discrete { n: usize },
    /// A box of `low.len()` reals; bounds may be infinite.
    Box { low: Vec<f32>, high: Vec<f32> },
}

impl Space {
    /// Number of components of a vector in this space (1 for a discrete space).
    pub fn dim(&self) -> usize {
        match self {
            Space::Discrete { .. } => 1,
            Space::Box { low, .. } => low.len(),
        }
    }
}

/// An action, borrowed so that stepping does not allocate.
#[derive(Clone, Copy, Debug)]
pub enum Action<'a> {
    Discrete(usize),
    Continuous(&'a [f32]),
}

/// What one step produced besides the observation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    pub reward: f64,
    /// The MDP reached a terminal state (no bootstrapping past it).
    pub terminated: bool,
    /// The episode was cut by a time limit (bootstrapping is still valid).
    pub truncated: bool,
}

#[derive(Debug, Error, PartialEq)]
pub enum SimError {
    #[error("{env}: action {action} is not valid (expected {expected})")]
    InvalidAction {
        env: &'static str,
        action: String,
        expected: String,
    },
    #[error("{env}: state has {got} components, expected {expected}")]
    StateLength {
        env: &'static str,
        got: usize,
        expected: usize,
    },
    /// The caller's observation buffer is shorter than `observation_space().dim()`.
    #[error("{env}: observation buffer has {got} slots, expected {expected}")]
    ObsBuffer {
        env: &'static str,
        got: usize,
        expected: usize,
    },
    /// A trace file could not be read, parsed or recognised.
    #[error("trace: {0}")]
    Trace(String),
    #[error("{0}")]
    Invalid(String),
}

/// One CGM sample of a glucose simulator's episode (UVA/Padova, Dosing): what a clinical report
/// is computed from.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct GlucoseSample {
    /// Minutes since the episode's start (0: the reading at reset).
    pub minute: f64,
    /// True blood glucose (mg/dL); for UVA/Padova the model's Gsub, as simglucose's `BG`.
    pub bg_mg_dl: f64,
    /// The sensor reading a controller saw (mg/dL).
    pub cgm_mg_dl: f64,
    /// Insulin delivered during the sample period ending here (U).
    pub insulin_u: f64,
    /// Carbohydrate announced during that period (g).
    pub cho_g: f64,
}

/// A simulator. Object-safe, so one client agent can host users of different environments.
///
/// Observations are written into caller-provided buffers of length
/// `observation_space().dim()`: stepping never allocates.
pub trait Env: Send {
    /// Identifier, e.g. `CartPole-v1`.
    fn id(&self) -> &'static str;
    fn observation_space(&self) -> &Space;
    fn action_space(&self) -> &Space;
    /// Starts an episode with the given seed and writes the first observation.
    fn reset(&mut self, seed: u64, obs: &mut [f32]);
    /// Applies `action`, writes the next observation.
    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<Step, SimError>;
    /// The first half of a batched step: hands `action` to the environment. An environment
    /// that steps at once (every Rust simulator: this default) writes the next observation
    /// into `obs` and returns its step; one that batches (the Gymnasium bridge's
    /// [`crate::gym_bridge::GymEnv`]) queues the action and returns `None`, and the step's
    /// result comes from [`Env::step_collect`]. A rollout loop that queues every active user's
    /// action before collecting any steps a whole batch per worker message.
    fn step_queue(
        &mut self,
        action: Action<'_>,
        obs: &mut [f32],
    ) -> Result<Option<Step>, SimError> {
        self.step(action, obs).map(Some)
    }
    /// The second half of a batched step whose [`Env::step_queue`] returned `None`: writes the
    /// next observation and returns the step.
    fn step_collect(&mut self, _obs: &mut [f32]) -> Result<Step, SimError> {
        Err(SimError::Invalid(format!(
            "{}: step_collect without a queued action",
            self.id()
        )))
    }
    /// The first half of a batched reset, like [`Env::step_queue`]: returns `true` when the
    /// environment reset at once and wrote `obs` (every Rust simulator: this default), `false`
    /// when it queued the reset for [`Env::reset_collect`].
    fn reset_queue(&mut self, seed: u64, obs: &mut [f32]) -> bool {
        self.reset(seed, obs);
        true
    }
    /// The second half of a batched reset whose [`Env::reset_queue`] returned `false`: writes
    /// the first observation.
    fn reset_collect(&mut self, _obs: &mut [f32]) -> Result<(), SimError> {
        Err(SimError::Invalid(format!(
            "{}: reset_collect without a queued reset",
            self.id()
        )))
    }
    /// The full internal state (for replay and checkpoints).
    fn state(&self) -> Vec<f64>;
    /// Sets the internal state (e.g. a trace's initial state) and writes the matching observation.
    fn set_state(&mut self, state: &[f64], obs: &mut [f32]) -> Result<(), SimError>;
    /// Glucose simulators: every CGM sample since the last reset, the first taken at reset.
    /// Other environments: `None`.
    fn glucose_log(&self) -> Option<&[GlucoseSample]> {
        None
    }
}
