//! The Gymnasium bridge: any Gymnasium environment as a population of users
//! (`population = "gymnasium:<id>"`), stepped in Python worker processes in batches.
//!
//! The client agent's trainer owns a [`GymPool`]: `workers` processes of
//! `python -m fedrl_bridge.worker` (the Python side lives in the repository's `python/` folder and
//! is installed by `scripts/install-python-bridge.sh`). Each round it asks the pool for its
//! offered users' environments ([`GymPool::envs_for`]): every worker makes its share with
//! `gymnasium.make(id, **kwargs)`, where a user's kwargs are the scenario's fixed ones plus the
//! ones drawn for that user ([`GymConfig::user_kwargs`], a pure function of the population seed
//! and the user id, like every other population). Workers keep their environment objects from
//! round to round ([`GymConfig::reuse_envs`]): a slot whose kwargs an earlier slot had gets that
//! environment back, reset with the round's seed, so only new kwargs cost a `gymnasium.make`. The environments come back as ordinary
//! [`Env`]s ([`GymEnv`]) that queue their actions ([`Env::step_queue`]) so that the rollout
//! loop's one step of every active user becomes one STEP message per worker.
//!
//! Invariants:
//! - Nothing read from a worker is trusted: lengths are checked against the request, values must
//!   be finite, the spaces must be the task's; any breach is a fault of that worker.
//! - A faulted worker (crash, reply past its deadline, error, non-finite or misshapen output) is
//!   never used again: its process is killed at once, every environment on it fails its next
//!   call with the reason ([`GymPool::fault`]), and the next [`GymPool::envs_for`] restarts it.
//!   The caller drops the affected users from the round; no request waits past its deadline.
//! - No Python runs outside the process that builds a pool (the client agent): the aggregator
//!   works from the task's declared spaces.

mod process;
pub mod protocol;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rand::rngs::ChaCha8Rng;
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value, json};
use thiserror::Error;

use crate::env::{Action, Env, SimError, Space, Step};
pub use process::WorkerProcess;

/// The prefix of a population name that selects the bridge: `gymnasium:<id>`.
pub const PREFIX: &str = "gymnasium:";

/// The Gymnasium id of a `gymnasium:<id>` population name, `None` for any other name.
pub fn env_id_of(population: &str) -> Option<&str> {
    population.strip_prefix(PREFIX)
}

/// What can go wrong between the agent and a worker.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum BridgeError {
    #[error("cannot start the Python worker {python}: {reason}")]
    Start { python: String, reason: String },
    #[error("worker {pid} crashed: {reason}")]
    Crashed { pid: u32, reason: String },
    #[error("worker {pid} did not answer within {after:?}")]
    Timeout { pid: u32, after: Duration },
    /// An exception in the worker (its message).
    #[error("worker error: {0}")]
    Worker(String),
    #[error("bad reply from a worker: {0}")]
    Protocol(String),
    /// The environment's spaces are not the ones the task declares, or not carried.
    #[error("spaces: {0}")]
    Spaces(String),
    #[error("{0}")]
    Config(String),
}

/// How one keyword argument is drawn for each user.
#[derive(Clone, Debug, PartialEq)]
pub enum Draw {
    /// Uniform real in `[low, high)`.
    Uniform { low: f64, high: f64 },
    /// One of `n` evenly spaced values from `low` to `high` (both included), uniformly: the
    /// grids of seed 000's appendix B.1.
    Linspace { low: f64, high: f64, n: u32 },
    /// One of these values, uniformly.
    Choice(Vec<Value>),
}

/// A `gymnasium:<id>` population and how its workers run.
#[derive(Clone, Debug, PartialEq)]
pub struct GymConfig {
    /// The Gymnasium id passed to `gymnasium.make`.
    pub env_id: String,
    /// A Python module imported before `make` (it may register the user's own environment).
    pub module: Option<String>,
    /// The interpreter; `FEDRL_PYTHON` overrides it; `None`: the install script's
    /// `.venv-bridge`.
    pub python: Option<PathBuf>,
    /// Keyword arguments every user gets.
    pub kwargs: Map<String, Value>,
    /// Keyword arguments drawn per user (after `kwargs`, so they win), in this order.
    pub user_kwargs: Vec<(String, Draw)>,
    /// The population seed the draws are keyed by.
    pub seed: u64,
    /// Worker processes.
    pub workers: usize,
    /// Deadline of starting a worker and of making a round's environments.
    pub start_timeout: Duration,
    /// Deadline of one batched reset or step.
    pub step_timeout: Duration,
    /// Keep the environment objects from round to round: a worker hands a round's user the
    /// environment an earlier user with the same keyword arguments had (reset with the new
    /// round's seed) instead of making a new one. Default true; false for an environment that
    /// keeps state across seeded resets (it breaks Gymnasium's reset contract).
    pub reuse_envs: bool,
}

impl GymConfig {
    /// A config for `env_id` with no module or kwargs, one worker and generous deadlines.
    pub fn new(env_id: &str) -> Self {
        Self {
            env_id: env_id.to_string(),
            module: None,
            python: None,
            kwargs: Map::new(),
            user_kwargs: Vec::new(),
            seed: 0,
            workers: 1,
            start_timeout: Duration::from_secs(120),
            step_timeout: Duration::from_secs(30),
            reuse_envs: true,
        }
    }

    /// The interpreter the workers run: `FEDRL_PYTHON` on this machine (agents on other
    /// machines may keep their Python elsewhere), else the config's, else
    /// `.venv-bridge/bin/python` in this source tree.
    pub fn python_path(&self) -> PathBuf {
        if let Some(p) = std::env::var_os("FEDRL_PYTHON").filter(|p| !p.is_empty()) {
            return PathBuf::from(p);
        }
        if let Some(p) = &self.python {
            return p.clone();
        }
        default_python()
    }

    /// User `user`'s keyword arguments: the fixed ones, then each drawn one from a ChaCha8
    /// stream keyed by (population seed, user), so a user gets the same environment on every
    /// machine, in every process and round.
    pub fn user_kwargs(&self, user: u64) -> Map<String, Value> {
        let mut out = self.kwargs.clone();
        if self.user_kwargs.is_empty() {
            return out;
        }
        let key = mix64(self.seed ^ 0x6779_6d6e_6173_6975) ^ mix64(user.wrapping_add(0x9E37));
        let mut rng = ChaCha8Rng::seed_from_u64(mix64(key));
        for (name, draw) in &self.user_kwargs {
            let v = match draw {
                Draw::Uniform { low, high } => {
                    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                    json!(low + (high - low) * u)
                }
                Draw::Linspace { low, high, n } => {
                    let k = below(&mut rng, u64::from((*n).max(1)));
                    let v = if *n <= 1 {
                        *low
                    } else {
                        low + (high - low) * k as f64 / f64::from(n - 1)
                    };
                    json!(v)
                }
                Draw::Choice(vals) => vals
                    .get(below(&mut rng, vals.len().max(1) as u64) as usize)
                    .cloned()
                    .unwrap_or(Value::Null),
            };
            out.insert(name.clone(), v);
        }
        out
    }
}

/// `.venv-bridge/bin/python` at the root of the source tree this crate was built from.
pub fn default_python() -> PathBuf {
    repo_root().join(".venv-bridge/bin/python")
}

/// The repository root (this crate's parent folder).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The repository's `python/` folder when it exists (put first on the workers' `PYTHONPATH`,
/// so a venv made by hand with Gymnasium in it also finds `fedrl_bridge`).
fn bridge_pythonpath() -> Option<PathBuf> {
    let p = repo_root().join("python");
    p.join("fedrl_bridge").is_dir().then_some(p)
}

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn below(rng: &mut ChaCha8Rng, n: u64) -> u64 {
    ((u128::from(rng.next_u64()) * u128::from(n)) >> 64) as u64
}

/// The spaces a worker reported, in fedrl's terms: a Discrete observation becomes a one-hot
/// box of `n` values in \[0, 1\]; a Discrete action is an index `0..n` (the worker adds the
/// space's `start`); infinite bounds arrive as JSON `null`.
fn parse_space(v: &Value, observation: bool) -> Result<Space, BridgeError> {
    let bad = |m: String| BridgeError::Spaces(m);
    match v.get("kind").and_then(Value::as_str) {
        Some("discrete") => {
            let n = v
                .get("n")
                .and_then(Value::as_u64)
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(format!("discrete space without n: {v}")))?
                as usize;
            Ok(if observation {
                Space::Box {
                    low: vec![0.0; n],
                    high: vec![1.0; n],
                }
            } else {
                Space::Discrete { n }
            })
        }
        Some("box") => {
            let bound = |key: &str, inf: f32| -> Result<Vec<f32>, BridgeError> {
                v.get(key)
                    .and_then(Value::as_array)
                    .ok_or_else(|| bad(format!("box space without {key}: {v}")))?
                    .iter()
                    .map(|x| match x {
                        Value::Null => Ok(inf),
                        x => x
                            .as_f64()
                            .map(|f| f as f32)
                            .ok_or_else(|| bad(format!("box bound {x} is not a number"))),
                    })
                    .collect()
            };
            let low = bound("low", f32::NEG_INFINITY)?;
            let high = bound("high", f32::INFINITY)?;
            if low.len() != high.len() || low.is_empty() {
                return Err(bad(format!(
                    "box bounds of lengths {} and {}",
                    low.len(),
                    high.len()
                )));
            }
            Ok(Space::Box { low, high })
        }
        other => Err(bad(format!("unsupported space kind {other:?}"))),
    }
}

/// Describes a space for error messages.
pub fn describe(space: &Space) -> String {
    match space {
        Space::Discrete { n } => format!("Discrete({n})"),
        Space::Box { low, .. } => format!("Box({} values)", low.len()),
    }
}

/// What the task says the environment's spaces are; checked against every worker at start.
#[derive(Clone, Debug, PartialEq)]
pub struct DeclaredSpaces {
    /// Observation length (a Discrete observation of `n` values counts `n`, one-hot).
    pub obs_dim: usize,
    /// The action space: Discrete `n`, or a Box of `dim` values (its bounds come from the
    /// environment).
    pub action: DeclaredAction,
}

/// The action part of [`DeclaredSpaces`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DeclaredAction {
    Discrete { n: usize },
    Box { dim: usize },
}

impl DeclaredSpaces {
    /// Checks the spaces a worker reported; the error names both sides.
    pub fn check(&self, env_id: &str, obs: &Space, act: &Space) -> Result<(), BridgeError> {
        let act_ok = match (self.action, act) {
            (DeclaredAction::Discrete { n }, Space::Discrete { n: m }) => n == *m,
            (DeclaredAction::Box { dim }, Space::Box { low, .. }) => dim == low.len(),
            _ => false,
        };
        if obs.dim() != self.obs_dim || !act_ok {
            return Err(BridgeError::Spaces(format!(
                "{env_id} has observations of {} values and actions {}, but the task declares \
                 observations of {} values and actions {} (task.gymnasium.obs_dim / action)",
                obs.dim(),
                describe(act),
                self.obs_dim,
                match self.action {
                    DeclaredAction::Discrete { n } => format!("Discrete({n})"),
                    DeclaredAction::Box { dim } => format!("Box({dim} values)"),
                }
            )));
        }
        Ok(())
    }
}

/// One worker's state, shared by the pool and the environments living on it.
struct Shared {
    proc: Option<WorkerProcess>,
    /// Why this worker may not be used again (until restarted).
    fault: Option<String>,
    obs_dim: usize,
    step_timeout: Duration,
    /// Per slot: the action queued for the next batched step.
    pending: Vec<Option<PendingAction>>,
    /// Per slot: the result of a batched step not yet collected.
    ready: Vec<Option<(Vec<f32>, Step)>>,
    /// Per slot: the seed of a reset queued for the next batched reset.
    pending_reset: Vec<Option<u64>>,
    /// Per slot: the first observation of a batched reset not yet collected.
    reset_ready: Vec<Option<Vec<f32>>>,
    /// Bumped whenever the slots are remade: environments of an older round fail cleanly.
    generation: u64,
}

#[derive(Clone, Debug)]
enum PendingAction {
    Discrete(i64),
    Continuous(Vec<f32>),
}

impl Shared {
    /// Marks the worker faulted and kills it; returns the error environments report.
    fn fail(&mut self, e: &BridgeError) -> SimError {
        let reason = e.to_string();
        if self.fault.is_none() {
            tracing::warn!(fault = %reason, "gymnasium worker faulted; it is killed and restarted before its next use");
            self.fault = Some(reason.clone());
        }
        self.proc = None; // drop: kill and reap
        for p in &mut self.pending {
            *p = None;
        }
        for r in &mut self.ready {
            *r = None;
        }
        for r in &mut self.pending_reset {
            *r = None;
        }
        for r in &mut self.reset_ready {
            *r = None;
        }
        SimError::Invalid(format!("gymnasium worker fault: {reason}"))
    }

    fn faulted(&self) -> Option<SimError> {
        self.fault
            .as_ref()
            .map(|r| SimError::Invalid(format!("gymnasium worker fault: {r}")))
    }

    fn request(
        &mut self,
        kind: u16,
        count: u32,
        payload: &[u8],
        expect: u16,
        timeout: Duration,
    ) -> Result<protocol::Frame, SimError> {
        if let Some(e) = self.faulted() {
            return Err(e);
        }
        let Some(proc) = self.proc.as_mut() else {
            return Err(self.fail(&BridgeError::Config("worker not running".into())));
        };
        match proc.request(kind, count, payload, expect, timeout) {
            Ok(f) if f.count == count => Ok(f),
            Ok(f) => Err(self.fail(&BridgeError::Protocol(format!(
                "reply about {} environments to a request about {count}",
                f.count
            )))),
            Err(e) => Err(self.fail(&e)),
        }
    }

    fn reset(&mut self, slot: usize, seed: u64, obs: &mut [f32]) -> Result<(), SimError> {
        let mut pl = Vec::with_capacity(16);
        protocol::put_i64(&mut pl, [slot as i64]);
        protocol::put_u64(&mut pl, [seed]);
        let t = self.step_timeout;
        let f = self.request(protocol::RESET, 1, &pl, protocol::OBS, t)?;
        if f.payload.len() != 4 * self.obs_dim {
            return Err(self.fail(&BridgeError::Protocol(format!(
                "reset observation of {} bytes, expected {}",
                f.payload.len(),
                4 * self.obs_dim
            ))));
        }
        let mut o = vec![0.0f32; self.obs_dim];
        protocol::get_f32(&f.payload, &mut o);
        if o.iter().any(|x| !x.is_finite()) {
            return Err(self.fail(&BridgeError::Protocol(format!(
                "non-finite observation at reset of slot {slot}"
            ))));
        }
        obs[..self.obs_dim].copy_from_slice(&o);
        self.pending[slot] = None;
        self.ready[slot] = None;
        self.pending_reset[slot] = None;
        self.reset_ready[slot] = None;
        Ok(())
    }

    /// Resets every slot with a queued reset in one RESET message.
    fn flush_resets(&mut self) -> Result<(), SimError> {
        let slots: Vec<usize> = (0..self.pending_reset.len())
            .filter(|&s| self.pending_reset[s].is_some())
            .collect();
        if slots.is_empty() {
            return Ok(());
        }
        let n = slots.len();
        let mut pl = Vec::with_capacity(16 * n);
        protocol::put_i64(&mut pl, slots.iter().map(|&s| s as i64));
        protocol::put_u64(
            &mut pl,
            slots
                .iter()
                .map(|&s| self.pending_reset[s].take().unwrap_or(0)),
        );
        let t = self.step_timeout;
        let f = self.request(protocol::RESET, n as u32, &pl, protocol::OBS, t)?;
        let d = self.obs_dim;
        if f.payload.len() != 4 * n * d {
            return Err(self.fail(&BridgeError::Protocol(format!(
                "reset observations of {} bytes for {n} environments, expected {}",
                f.payload.len(),
                4 * n * d
            ))));
        }
        let mut obs = vec![0.0f32; n * d];
        protocol::get_f32(&f.payload, &mut obs);
        if obs.iter().any(|x| !x.is_finite()) {
            return Err(self.fail(&BridgeError::Protocol(
                "non-finite observation at reset".into(),
            )));
        }
        for (i, &s) in slots.iter().enumerate() {
            self.pending[s] = None;
            self.ready[s] = None;
            self.reset_ready[s] = Some(obs[i * d..(i + 1) * d].to_vec());
        }
        Ok(())
    }

    /// Steps every slot with a queued action in one STEP message.
    fn flush(&mut self) -> Result<(), SimError> {
        let slots: Vec<usize> = (0..self.pending.len())
            .filter(|&s| self.pending[s].is_some())
            .collect();
        if slots.is_empty() {
            return Ok(());
        }
        let n = slots.len();
        let mut pl = Vec::with_capacity(16 * n);
        protocol::put_i64(&mut pl, slots.iter().map(|&s| s as i64));
        for &s in &slots {
            match self.pending[s].take() {
                Some(PendingAction::Discrete(a)) => protocol::put_i64(&mut pl, [a]),
                Some(PendingAction::Continuous(a)) => protocol::put_f32(&mut pl, &a),
                None => {}
            }
        }
        let t = self.step_timeout;
        let f = self.request(protocol::STEP, n as u32, &pl, protocol::STEP_RESULT, t)?;
        let d = self.obs_dim;
        let want = n * (4 * d + 8 + 2);
        if f.payload.len() != want {
            return Err(self.fail(&BridgeError::Protocol(format!(
                "step result of {} bytes for {n} environments, expected {want}",
                f.payload.len()
            ))));
        }
        let mut obs = vec![0.0f32; n * d];
        protocol::get_f32(&f.payload, &mut obs);
        let mut rew = vec![0.0f64; n];
        protocol::get_f64(&f.payload[4 * n * d..], &mut rew);
        let flags = &f.payload[4 * n * d + 8 * n..];
        for (i, &s) in slots.iter().enumerate() {
            let o = &obs[i * d..(i + 1) * d];
            if !rew[i].is_finite() || o.iter().any(|x| !x.is_finite()) {
                return Err(self.fail(&BridgeError::Protocol(format!(
                    "non-finite observation or reward from slot {s}"
                ))));
            }
            let (te, tr) = (flags[i], flags[n + i]);
            if te > 1 || tr > 1 {
                return Err(self.fail(&BridgeError::Protocol(format!(
                    "terminated/truncated flags {te}/{tr} from slot {s}"
                ))));
            }
            self.ready[s] = Some((
                o.to_vec(),
                Step {
                    reward: rew[i],
                    terminated: te == 1,
                    truncated: tr == 1,
                },
            ));
        }
        Ok(())
    }
}

/// One user's environment on a worker (slot `slot`). Stepping through [`Env::step_queue`] and
/// [`Env::step_collect`] batches it with every other queued environment of its worker.
pub struct GymEnv {
    shared: Arc<Mutex<Shared>>,
    slot: usize,
    generation: u64,
    id: &'static str,
    obs_space: Space,
    act_space: Space,
}

impl GymEnv {
    fn lock(&self) -> Result<MutexGuard<'_, Shared>, SimError> {
        let g = self
            .shared
            .lock()
            .map_err(|_| SimError::Invalid("gymnasium worker state poisoned".into()))?;
        if g.generation != self.generation {
            return Err(SimError::Invalid(
                "gymnasium environment of an earlier round (its worker was remade)".into(),
            ));
        }
        Ok(g)
    }

    fn pending_action(&self, action: Action<'_>) -> Result<PendingAction, SimError> {
        let invalid = |expected: String| SimError::InvalidAction {
            env: self.id,
            action: format!("{action:?}"),
            expected,
        };
        match (&self.act_space, action) {
            (Space::Discrete { n }, Action::Discrete(a)) if a < *n => {
                Ok(PendingAction::Discrete(a as i64))
            }
            (Space::Box { low, .. }, Action::Continuous(a))
                if a.len() == low.len() && a.iter().all(|x| x.is_finite()) =>
            {
                Ok(PendingAction::Continuous(a.to_vec()))
            }
            (s, _) => Err(invalid(describe(s))),
        }
    }
}

impl Env for GymEnv {
    fn id(&self) -> &'static str {
        self.id
    }

    fn observation_space(&self) -> &Space {
        &self.obs_space
    }

    fn action_space(&self) -> &Space {
        &self.act_space
    }

    /// A failed reset leaves zeros in `obs` and the worker faulted: the next step reports it.
    fn reset(&mut self, seed: u64, obs: &mut [f32]) {
        let r = self.lock().and_then(|mut g| g.reset(self.slot, seed, obs));
        if r.is_err() {
            let d = self.obs_space.dim().min(obs.len());
            obs[..d].fill(0.0);
        }
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<Step, SimError> {
        match self.step_queue(action, obs)? {
            Some(s) => Ok(s),
            None => self.step_collect(obs),
        }
    }

    fn reset_queue(&mut self, seed: u64, obs: &mut [f32]) -> bool {
        let queued = match self.lock() {
            Ok(mut g) if g.fault.is_none() => {
                g.reset_ready[self.slot] = None;
                g.pending_reset[self.slot] = Some(seed);
                true
            }
            _ => false,
        };
        if !queued {
            // Faulted: reset() fills zeros and the next step reports the fault.
            self.reset(seed, obs);
        }
        !queued
    }

    fn reset_collect(&mut self, obs: &mut [f32]) -> Result<(), SimError> {
        let mut g = self.lock()?;
        if let Some(e) = g.faulted() {
            return Err(e);
        }
        if g.reset_ready[self.slot].is_none() {
            g.flush_resets()?;
        }
        let d = g.obs_dim;
        match g.reset_ready[self.slot].take() {
            Some(o) if obs.len() >= d => {
                obs[..d].copy_from_slice(&o);
                Ok(())
            }
            Some(_) => Err(SimError::ObsBuffer {
                env: self.id,
                got: obs.len(),
                expected: d,
            }),
            None => Err(SimError::Invalid(format!(
                "{}: reset_collect without a queued reset",
                self.id
            ))),
        }
    }

    fn step_queue(
        &mut self,
        action: Action<'_>,
        _obs: &mut [f32],
    ) -> Result<Option<Step>, SimError> {
        let a = self.pending_action(action)?;
        let mut g = self.lock()?;
        if let Some(e) = g.faulted() {
            return Err(e);
        }
        g.ready[self.slot] = None;
        g.pending[self.slot] = Some(a);
        Ok(None)
    }

    fn step_collect(&mut self, obs: &mut [f32]) -> Result<Step, SimError> {
        let mut g = self.lock()?;
        if let Some(e) = g.faulted() {
            return Err(e);
        }
        if g.ready[self.slot].is_none() {
            g.flush()?;
        }
        let d = g.obs_dim;
        if obs.len() < d {
            return Err(SimError::ObsBuffer {
                env: self.id,
                got: obs.len(),
                expected: d,
            });
        }
        match g.ready[self.slot].take() {
            Some((o, s)) => {
                obs[..d].copy_from_slice(&o);
                Ok(s)
            }
            None => Err(SimError::Invalid(format!(
                "{}: step_collect without a queued action",
                self.id
            ))),
        }
    }

    fn state(&self) -> Vec<f64> {
        Vec::new()
    }

    fn set_state(&mut self, _state: &[f64], _obs: &mut [f32]) -> Result<(), SimError> {
        Err(SimError::Invalid(format!(
            "{}: a Gymnasium environment's state cannot be set from fedrl",
            self.id
        )))
    }
}

/// The users of one round that live on one worker, with their environments.
pub struct WorkerGroup {
    /// Index of the worker in the pool.
    pub worker: usize,
    /// The users, in the order of `envs`.
    pub users: Vec<u64>,
    pub envs: Vec<Box<dyn Env>>,
}

/// The worker processes of one `gymnasium:<id>` population, owned by a client agent's trainer.
pub struct GymPool {
    cfg: GymConfig,
    declared: Option<DeclaredSpaces>,
    id: &'static str,
    obs_space: Space,
    act_space: Space,
    workers: Vec<Arc<Mutex<Shared>>>,
}

impl GymPool {
    /// Starts `cfg.workers` workers, each importing the module and making one probe environment
    /// (user 0's kwargs); their spaces must agree with each other and with `declared` (when
    /// given). Fails with a clear error otherwise.
    pub fn start(cfg: GymConfig, declared: Option<DeclaredSpaces>) -> Result<Self, BridgeError> {
        if cfg.workers == 0 {
            return Err(BridgeError::Config("gymnasium workers must be >= 1".into()));
        }
        // Env::id is &'static: one small leak per pool (pools live as long as their agent).
        let id: &'static str = Box::leak(format!("{PREFIX}{}", cfg.env_id).into_boxed_str());
        let mut pool = Self {
            cfg,
            declared,
            id,
            obs_space: Space::Discrete { n: 0 },
            act_space: Space::Discrete { n: 0 },
            workers: Vec::new(),
        };
        let mut spaces: Option<(Space, Space)> = None;
        for _ in 0..pool.cfg.workers {
            let (proc, obs, act) = pool.spawn_checked()?;
            if let Some((o, a)) = &spaces
                && (o != &obs || a != &act)
            {
                return Err(BridgeError::Spaces(
                    "two workers report different spaces for the same environment".into(),
                ));
            }
            pool.workers.push(Arc::new(Mutex::new(Shared {
                proc: Some(proc),
                fault: None,
                obs_dim: obs.dim(),
                step_timeout: pool.cfg.step_timeout,
                pending: Vec::new(),
                ready: Vec::new(),
                pending_reset: Vec::new(),
                reset_ready: Vec::new(),
                generation: 0,
            })));
            spaces = Some((obs, act));
        }
        if let Some((o, a)) = spaces {
            pool.obs_space = o;
            pool.act_space = a;
        }
        Ok(pool)
    }

    /// Starts one worker and checks its spaces.
    fn spawn_checked(&self) -> Result<(WorkerProcess, Space, Space), BridgeError> {
        let python = self.cfg.python_path();
        let mut proc = WorkerProcess::spawn(&python, bridge_pythonpath().as_deref())?;
        let req = json!({
            "env_id": self.cfg.env_id,
            "module": self.cfg.module,
            "probe_kwargs": Value::Object(self.cfg.user_kwargs(0)),
            "reuse_envs": self.cfg.reuse_envs,
        });
        let f = proc
            .request(
                protocol::INIT,
                0,
                req.to_string().as_bytes(),
                protocol::SPACES,
                self.cfg.start_timeout,
            )
            .map_err(|e| match e {
                // The usual cause: an interpreter without Gymnasium or without fedrl_bridge.
                BridgeError::Crashed { pid, reason } => BridgeError::Crashed {
                    pid,
                    reason: format!(
                        "{reason} while starting (can {} import gymnasium and fedrl_bridge? \
                         scripts/install-python-bridge.sh makes one that can; the worker's \
                         stderr above says why)",
                        python.display()
                    ),
                },
                e => e,
            })?;
        let v: Value = serde_json::from_slice(&f.payload)
            .map_err(|e| BridgeError::Protocol(format!("SPACES is not JSON: {e}")))?;
        if v.get("protocol").and_then(Value::as_u64) != Some(u64::from(protocol::VERSION)) {
            return Err(BridgeError::Protocol(format!(
                "worker reports protocol {:?}, this agent speaks {}",
                v.get("protocol"),
                protocol::VERSION
            )));
        }
        let obs = parse_space(v.get("observation").unwrap_or(&Value::Null), true)?;
        let act = parse_space(v.get("action").unwrap_or(&Value::Null), false)?;
        if let Some(d) = &self.declared {
            d.check(&self.cfg.env_id, &obs, &act)?;
        }
        Ok((proc, obs, act))
    }

    /// The observation space (flattened; Discrete observations one-hot).
    pub fn observation_space(&self) -> &Space {
        &self.obs_space
    }

    /// The action space (Discrete actions are indices `0..n`).
    pub fn action_space(&self) -> &Space {
        &self.act_space
    }

    /// The config the pool runs.
    pub fn config(&self) -> &GymConfig {
        &self.cfg
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Worker `w`'s process id (`None` while it is down).
    pub fn pid(&self, w: usize) -> Option<u32> {
        let g = self.workers.get(w)?.lock().ok()?;
        g.proc.as_ref().map(WorkerProcess::pid)
    }

    /// Why worker `w` is faulted, if it is.
    pub fn fault(&self, w: usize) -> Option<String> {
        self.workers.get(w)?.lock().ok()?.fault.clone()
    }

    /// Restarts worker `w` (a new process, spaces checked again).
    pub fn restart(&mut self, w: usize) -> Result<(), BridgeError> {
        let Some(shared) = self.workers.get(w).cloned() else {
            return Err(BridgeError::Config(format!("no worker {w}")));
        };
        // Kill the old one first: a hung worker must not keep its CPU while the new one starts.
        if let Ok(mut g) = shared.lock() {
            g.proc = None;
        }
        let (proc, obs, act) = self.spawn_checked()?;
        if obs != self.obs_space || act != self.act_space {
            return Err(BridgeError::Spaces(
                "the restarted worker reports other spaces than before".into(),
            ));
        }
        let mut g = shared
            .lock()
            .map_err(|_| BridgeError::Config("worker state poisoned".into()))?;
        g.proc = Some(proc);
        g.fault = None;
        g.generation += 1;
        g.pending.clear();
        g.ready.clear();
        g.pending_reset.clear();
        g.reset_ready.clear();
        Ok(())
    }

    /// The environments of `users` for one round, split over the workers in contiguous
    /// shares. Faulted workers are restarted first. Users whose worker cannot be restarted or
    /// cannot make their environments are returned in the second list with the reason (the
    /// caller drops them from the round).
    pub fn envs_for(&mut self, users: &[u64]) -> (Vec<WorkerGroup>, Vec<(u64, String)>) {
        let kwargs: Vec<Map<String, Value>> =
            users.iter().map(|&u| self.cfg.user_kwargs(u)).collect();
        self.envs_with_kwargs(users, &kwargs)
    }

    /// [`GymPool::envs_for`] with each user's keyword arguments given (`kwargs[i]` for
    /// `users[i]`) instead of drawn from the population: e.g. the grid settings an offline
    /// dataset's experts train on. `kwargs` must be as long as `users` (else every user is
    /// returned as dropped).
    pub fn envs_with_kwargs(
        &mut self,
        users: &[u64],
        kwargs: &[Map<String, Value>],
    ) -> (Vec<WorkerGroup>, Vec<(u64, String)>) {
        if kwargs.len() != users.len() {
            let why = format!("{} keyword sets for {} users", kwargs.len(), users.len());
            return (
                Vec::new(),
                users.iter().map(|&u| (u, why.clone())).collect(),
            );
        }
        let w_count = self.workers.len();
        let mut groups = Vec::new();
        let mut dropped = Vec::new();
        for w in 0..w_count {
            let lo = users.len() * w / w_count;
            let hi = users.len() * (w + 1) / w_count;
            let share = &users[lo..hi];
            if share.is_empty() {
                continue;
            }
            let down = self.fault(w).or_else(|| {
                self.pid(w)
                    .is_none()
                    .then(|| "worker not running".to_string())
            });
            if let Some(reason) = down {
                tracing::info!(worker = w, reason = %reason, "restarting gymnasium worker");
                if let Err(e) = self.restart(w) {
                    let why = format!("worker {w} could not be restarted: {e}");
                    dropped.extend(share.iter().map(|&u| (u, why.clone())));
                    continue;
                }
            }
            match self.make_on(w, &kwargs[lo..hi]) {
                Ok(envs) => groups.push(WorkerGroup {
                    worker: w,
                    users: share.to_vec(),
                    envs,
                }),
                Err(e) => {
                    let why = format!("worker {w}: {e}");
                    dropped.extend(share.iter().map(|&u| (u, why.clone())));
                }
            }
        }
        (groups, dropped)
    }

    /// Makes one environment per keyword set of `kwargs` on worker `w` (slots
    /// `0..kwargs.len()`).
    fn make_on(
        &self,
        w: usize,
        kwargs: &[Map<String, Value>],
    ) -> Result<Vec<Box<dyn Env>>, SimError> {
        let shared = &self.workers[w];
        let mut g = shared
            .lock()
            .map_err(|_| SimError::Invalid("worker state poisoned".into()))?;
        let kws: Vec<Value> = kwargs.iter().cloned().map(Value::Object).collect();
        let payload = Value::Array(kws).to_string();
        let t = self.cfg.start_timeout;
        g.request(
            protocol::MAKE,
            kwargs.len() as u32,
            payload.as_bytes(),
            protocol::OK,
            t,
        )?;
        g.generation += 1;
        g.pending = vec![None; kwargs.len()];
        g.ready = vec![None; kwargs.len()];
        g.pending_reset = vec![None; kwargs.len()];
        g.reset_ready = vec![None; kwargs.len()];
        let generation = g.generation;
        drop(g);
        Ok((0..kwargs.len())
            .map(|slot| {
                Box::new(GymEnv {
                    shared: Arc::clone(shared),
                    slot,
                    generation,
                    id: self.id,
                    obs_space: self.obs_space.clone(),
                    act_space: self.act_space.clone(),
                }) as Box<dyn Env>
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_kwargs_are_a_pure_function_of_seed_and_user() {
        let mut cfg = GymConfig::new("LunarLander-v3");
        cfg.kwargs.insert("continuous".into(), json!(false));
        cfg.user_kwargs = vec![
            (
                "gravity".into(),
                Draw::Uniform {
                    low: -11.0,
                    high: -9.0,
                },
            ),
            (
                "wind_power".into(),
                Draw::Linspace {
                    low: 0.0,
                    high: 20.0,
                    n: 5,
                },
            ),
            (
                "enable_wind".into(),
                Draw::Choice(vec![json!(true), json!(false)]),
            ),
        ];
        let a = cfg.user_kwargs(7);
        assert_eq!(a, cfg.user_kwargs(7));
        assert_eq!(a["continuous"], json!(false));
        let g = a["gravity"].as_f64().unwrap();
        assert!((-11.0..-9.0).contains(&g));
        let w = a["wind_power"].as_f64().unwrap();
        assert!([0.0, 5.0, 10.0, 15.0, 20.0].contains(&w));
        // Users differ, and so does another population seed.
        let gs: Vec<f64> = (0..50)
            .map(|u| cfg.user_kwargs(u)["gravity"].as_f64().unwrap())
            .collect();
        assert!(gs.windows(2).any(|p| p[0] != p[1]));
        let mut other = cfg.clone();
        other.seed = 1;
        assert_ne!(other.user_kwargs(7)["gravity"], a["gravity"]);
        // Every grid value is reached.
        let mut seen: Vec<f64> = (0..200)
            .map(|u| cfg.user_kwargs(u)["wind_power"].as_f64().unwrap())
            .collect();
        seen.sort_by(f64::total_cmp);
        seen.dedup();
        assert_eq!(seen.len(), 5);
    }

    #[test]
    fn spaces_parse_and_are_checked_against_the_declaration() {
        let obs = parse_space(
            &json!({"kind": "box", "low": [null, -1.0], "high": [null, 1.0]}),
            true,
        )
        .unwrap();
        assert_eq!(
            obs,
            Space::Box {
                low: vec![f32::NEG_INFINITY, -1.0],
                high: vec![f32::INFINITY, 1.0]
            }
        );
        let onehot = parse_space(&json!({"kind": "discrete", "n": 16, "start": 0}), true).unwrap();
        assert_eq!(onehot.dim(), 16);
        let act = parse_space(&json!({"kind": "discrete", "n": 4, "start": 0}), false).unwrap();
        assert!(parse_space(&json!({"kind": "multi_discrete"}), false).is_err());
        let ok = DeclaredSpaces {
            obs_dim: 2,
            action: DeclaredAction::Discrete { n: 4 },
        };
        ok.check("X", &obs, &act).unwrap();
        let bad = DeclaredSpaces {
            obs_dim: 2,
            action: DeclaredAction::Box { dim: 4 },
        };
        let e = bad.check("X", &obs, &act).unwrap_err().to_string();
        assert!(
            e.contains("Discrete(4)") && e.contains("Box(4 values)"),
            "{e}"
        );
    }

    #[test]
    fn an_interpreter_without_the_bridge_says_what_to_install() {
        if std::env::var_os("FEDRL_PYTHON").is_some() {
            return;
        }
        // /bin/sh is an interpreter that cannot run `-m fedrl_bridge.worker`: it exits at once.
        let mut cfg = GymConfig::new("CartPole-v1");
        cfg.python = Some(PathBuf::from("/bin/sh"));
        let e = GymPool::start(cfg, None).err().unwrap().to_string();
        assert!(
            e.contains("crashed") && e.contains("install-python-bridge.sh"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_interpreter_is_a_clear_start_error() {
        if std::env::var_os("FEDRL_PYTHON").is_some() {
            return; // it would override the config's interpreter
        }
        let mut cfg = GymConfig::new("CartPole-v1");
        cfg.python = Some(PathBuf::from("/nonexistent/python"));
        let e = GymPool::start(cfg, None).err().unwrap().to_string();
        assert!(e.contains("install-python-bridge.sh"), "{e}");
    }
}
