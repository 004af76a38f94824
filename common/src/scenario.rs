//! Scenario configuration (TOML). Every field has a documented default.
//!
//! A scenario says who takes part (users, client agents, participation model), how rounds run
//! (cohort, quorum, deadline), the privacy parameters (clip norm C, noise multiplier z, delta,
//! budget), the stress model (churn) and the task. The task is a tagged enum ([`Task`]): adding a
//! task is adding a variant and its parameter struct.
//!
//! ```toml
//! name = "mean-estimation"
//! seed = 7                       # optional: seeded noise, reproducible, NOT private
//! rounds = 20
//! users = 400
//! client_agents = 2
//! participation = { kind = "fresh" }        # or { kind = "sampled", rate = 0.05 }
//! cohort_size = 20
//! quorum = 15
//! round_deadline_s = 5.0
//! clip_norm = 1.0
//! noise_multiplier = 1.0
//! delta = 1e-5
//! target_epsilon = 10.0
//!
//! [churn]
//! drop_before_upload = 0.1
//!
//! [task]
//! kind = "mean_estimation"
//! dim = 16
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use crate::device::DeviceSpec;
use crate::privacy::accountant::{self, AccountantKind};
use crate::privacy::fixed_point::{
    DEFAULT_GRID_BITS, FixedPointError, Grid, NoiseCalibration, SummedBound,
};
use crate::privacy::ledger::{LedgerConfig, Participation, UnitKind, training_event};
use crate::privacy::params::{ClipNorm, Delta, NoiseMultiplier};
use crate::privacy::{DpEvent, PrivacyError};
use crate::protocol::DEFAULT_MAX_FRAME_BYTES;
// The task types live in `crate::task`; re-exported here because a scenario holds one.
pub use crate::task::{
    DppgTask, LocalUpdateConfig, LogLinearTask, MeanEstimationTask, PlainTasks, Task, TaskError,
    TaskModels,
};

/// Why a scenario could not be loaded.
#[derive(Debug, Error)]
pub enum ScenarioError {
    #[error("cannot read scenario {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid scenario{}: {message}", .path.as_ref().map(|p| format!(" {p}")).unwrap_or_default())]
    Parse {
        path: Option<String>,
        message: String,
    },
    #[error("invalid scenario: {0}")]
    Invalid(String),
    #[error("invalid scenario: {0}")]
    Task(#[from] TaskError),
}

/// A whole deployment: see the module documentation for an example.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Name used in reports. Default `"unnamed"`.
    #[serde(default = "d_name")]
    pub name: String,
    /// When set, noise is drawn from a seeded generator (reproducible, **not private**; the ledger
    /// and report say so) and cohorts and simulated data are reproducible. Default: none (noise
    /// from the OS CSPRNG).
    #[serde(default)]
    pub seed: Option<u64>,
    /// Number of rounds to attempt (released plus abandoned). Default 10.
    #[serde(default = "d_rounds")]
    pub rounds: u64,
    /// Size of the population: units `0..users`. Default 100.
    #[serde(default = "d_users")]
    pub users: u64,
    /// Client-agent processes `fedrl run` starts; the users are split evenly. Default 1.
    #[serde(default = "d_one")]
    pub client_agents: u32,
    /// `fresh` (each unit contributes at most once ever) or `sampled` with `rate` (the
    /// aggregator draws a Poisson sample every round). Default `fresh`.
    #[serde(default = "d_participation")]
    pub participation: Participation,
    /// Units per round under `fresh` participation; this is also the fixed public denominator.
    /// Ignored under `sampled` (the denominator is `rate x users`). Default 10.
    #[serde(default = "d_cohort")]
    pub cohort_size: u64,
    /// Minimum number of accepted updates for a round to be released; fewer at the deadline and
    /// the round is abandoned. Default: half the expected cohort, rounded up (at least 1).
    #[serde(default)]
    pub quorum: Option<u64>,
    /// Seconds from the round offer to its close. Default 10.
    #[serde(default = "d_deadline")]
    pub round_deadline_s: f64,
    /// Seconds the aggregator waits for the whole population to be connected before the first
    /// round (it starts earlier if everybody is there). Default 30.
    #[serde(default = "d_start_timeout")]
    pub start_timeout_s: f64,
    /// L2 clip norm C of one unit's update. Default 1.
    #[serde(default = "d_clip")]
    pub clip_norm: f64,
    /// Noise multiplier z: the sum gets N(0, (z C)^2 I). Default 1. `"auto"`: the smallest z
    /// whose reported epsilon at `delta` after `rounds` rounds is at most `target_epsilon`
    /// (one analytic Gaussian per unit under `fresh`, PLD over `rounds` Poisson-sampled rounds
    /// under `sampled`); resolved when the scenario is loaded, so reports and the resolved
    /// scenario file show the number used.
    #[serde(default = "d_noise", deserialize_with = "noise_or_auto")]
    pub noise_multiplier: f64,
    /// The delta every epsilon is reported at. Default 1e-5.
    #[serde(default = "d_delta")]
    pub delta: f64,
    /// Budget: a round that would push the reported epsilon above it is refused and the run
    /// stops. Default 10.
    #[serde(default = "d_target_epsilon")]
    pub target_epsilon: f64,
    /// What a unit is: `user`, `trajectory` or `expert`. Default `user`. It must be what the
    /// task groups into one clipped contribution ([`Task::unit_kind`]); another value is refused.
    #[serde(default = "d_unit_kind")]
    pub unit_kind: UnitKind,
    /// Whether the run may end before its `rounds` because the population ran out of units
    /// (`fresh` participation: every unit contributes at most once, so `users` below `rounds x
    /// cohort_size`, or units lost to dropouts, end the run early). Default false: such a
    /// scenario is refused when it is loaded, and a run that still stops short for lack of units
    /// says so and ends as failed (the aggregator and `fedrl run` exit non-zero). Set it for a
    /// run meant to use up its population.
    #[serde(default)]
    pub allow_fewer_rounds: bool,
    /// Checkpoint every K released rounds (and at shutdown). Default 10.
    #[serde(default = "d_checkpoint")]
    pub checkpoint_every: u64,
    /// Hard maximum frame size in bytes, checked before allocation. Default 64 MiB.
    #[serde(default = "d_max_frame")]
    pub max_frame_bytes: u64,
    /// A non-private baseline ("twin"): no clipping and no noise anywhere, nothing recorded in
    /// the ledger, and every report says epsilon = infinity. For comparison runs only.
    /// Default false.
    #[serde(default)]
    pub non_private: bool,
    /// What the aggregator's event journal (in its state directory; operator-only) keeps of each
    /// update: `"digest"` (every event, an update only by round, unit, client, length and
    /// SHA-256 digest: no user data on disk) or `"full"` (the update bodies too: users' raw,
    /// unclipped updates on disk, sensitive, for the operator's exact replay of a run only).
    /// Default `"digest"`.
    #[serde(default)]
    pub journal: JournalMode,
    /// Where the aggregator's (and, under `fedrl run`, the client agents') tensors live: `cpu`
    /// or `cuda:N` (GPU N; needs a build with the `cuda` feature). `--device` on the command
    /// line overrides it. Default `cpu`.
    #[serde(default)]
    pub device: DeviceSpec,
    /// Stress-test misbehaviour of client agents. Default: none.
    #[serde(default)]
    pub churn: Churn,
    /// What is trained.
    pub task: Task,
}

/// What the event journal keeps of each update (see [`Scenario::journal`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JournalMode {
    /// Updates by their digest only (no user data on disk).
    #[default]
    Digest,
    /// Updates with their bodies (operator-only, sensitive; makes an exact replay possible).
    Full,
}

/// Churn model applied by client agents to each offered unit independently (stress tests).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Churn {
    /// Probability that a unit computes its update but never uploads it. Default 0.
    #[serde(default)]
    pub drop_before_upload: f64,
    /// Probability, per round offer, that the agent drops its connection half-way through
    /// uploading (it reconnects with backoff). Default 0.
    #[serde(default)]
    pub disconnect_mid_upload: f64,
    /// Extra delay before each upload, uniform in `[0, added_latency_s]` seconds. Default 0.
    #[serde(default)]
    pub added_latency_s: f64,
}

impl Churn {
    /// True when the model does nothing.
    pub fn is_none(&self) -> bool {
        self.drop_before_upload == 0.0
            && self.disconnect_mid_upload == 0.0
            && self.added_latency_s == 0.0
    }
}

fn d_name() -> String {
    "unnamed".into()
}
fn d_rounds() -> u64 {
    10
}
fn d_users() -> u64 {
    100
}
fn d_one() -> u32 {
    1
}
fn d_participation() -> Participation {
    Participation::Fresh
}
fn d_cohort() -> u64 {
    10
}
fn d_deadline() -> f64 {
    10.0
}
fn d_start_timeout() -> f64 {
    30.0
}
fn d_clip() -> f64 {
    1.0
}
fn d_noise() -> f64 {
    1.0
}

/// A number, or the string `"auto"` (kept as NaN until [`Scenario::resolve_noise_multiplier`]
/// replaces it; a NaN never reaches validation or the engine).
fn noise_or_auto<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum NoiseOrAuto {
        Number(f64),
        Word(String),
    }
    match NoiseOrAuto::deserialize(d)? {
        NoiseOrAuto::Number(z) if z.is_nan() => Err(serde::de::Error::custom(
            "noise_multiplier must be a number or \"auto\", got NaN",
        )),
        NoiseOrAuto::Number(z) => Ok(z),
        NoiseOrAuto::Word(w) if w == "auto" => Ok(f64::NAN),
        NoiseOrAuto::Word(w) => Err(serde::de::Error::custom(format!(
            "noise_multiplier must be a number or \"auto\", got \"{w}\""
        ))),
    }
}
fn d_delta() -> f64 {
    1e-5
}
fn d_target_epsilon() -> f64 {
    10.0
}
fn d_unit_kind() -> UnitKind {
    UnitKind::User
}
fn d_checkpoint() -> u64 {
    10
}
fn d_max_frame() -> u64 {
    DEFAULT_MAX_FRAME_BYTES
}

impl Scenario {
    /// Parses and validates TOML text whose task's dimension is one of its parameters
    /// ([`PlainTasks`]); a task that needs its model built is an error here (load it through
    /// `fedrl_tasks::scenario_from_toml_str`).
    pub fn from_toml_str(text: &str) -> Result<Self, ScenarioError> {
        Self::from_toml_str_with(text, &PlainTasks)
    }

    /// Parses and validates TOML text; `models` builds the task's model (its dimension and the
    /// checks that need it).
    pub fn from_toml_str_with(text: &str, models: &dyn TaskModels) -> Result<Self, ScenarioError> {
        let s: Scenario = toml::from_str(text).map_err(|e| ScenarioError::Parse {
            path: None,
            message: parse_message(text, &e),
        })?;
        s.resolve(models)
    }

    /// Reads, parses and validates a TOML file (see [`Self::from_toml_str`]).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ScenarioError> {
        Self::from_file_with(path, &PlainTasks)
    }

    /// Reads, parses and validates a TOML file; `models` builds the task's model.
    pub fn from_file_with(
        path: impl AsRef<Path>,
        models: &dyn TaskModels,
    ) -> Result<Self, ScenarioError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let s: Scenario = toml::from_str(&text).map_err(|e| ScenarioError::Parse {
            path: Some(path.display().to_string()),
            message: parse_message(&text, &e),
        })?;
        s.resolve(models)
    }

    /// The automatic noise multiplier, validation and the derived clip norm, in that order.
    fn resolve(mut self, models: &dyn TaskModels) -> Result<Self, ScenarioError> {
        self.resolve_selective_rounds()?;
        self.resolve_noise_multiplier()?;
        self.validate(models)?;
        let dim = models.dim(&self.task)?;
        self.resolve_clip_norm(dim)?;
        self.check_exact_noise(dim)?;
        Ok(self)
    }

    /// The central mode's summed path's public bounds, when the aggregator computes the units'
    /// gradients and sums them (a task in the central mode with `central_path = "summed"`, the
    /// default, private: offline CQL, PrivORL): at most the population (`sampled`) or the
    /// cohort (`fresh`) per round, each with the task's rows per unit
    /// ([`Task::central_summed_rows`]). `None` for every other run.
    pub fn summed_bound(&self) -> Option<SummedBound> {
        let rows_per_unit = self.task.central_summed_rows()?;
        if self.non_private {
            return None;
        }
        let max_units = match self.participation {
            Participation::Fresh => self.cohort_size.min(self.users),
            Participation::Sampled { .. } => self.users,
        };
        Some(SummedBound {
            max_units,
            max_rows: max_units.saturating_mul(rows_per_unit),
        })
    }

    /// The exact noise the aggregator will draw (a discrete Gaussian on the clip norm's grid,
    /// `fixed_point`) for a model of `dim` values, as the engine calibrates it.
    fn exact_noise(&self, dim: usize, z: f64) -> Result<NoiseCalibration, FixedPointError> {
        let grid = Grid::for_clip_norm(self.clip_norm, DEFAULT_GRID_BITS)?;
        match self.summed_bound() {
            Some(b) => NoiseCalibration::for_summed(&grid, &b, dim, z),
            None => NoiseCalibration::new(&grid, z),
        }
    }

    /// Refuses, at load, a noise multiplier the exact sampler cannot draw at this clip norm
    /// (its variance in grid units is capped): otherwise the aggregator would refuse it only
    /// when it builds its engine, after it started listening. The message gives the largest
    /// multiplier that fits and the smallest epsilon it reaches.
    fn check_exact_noise(&self, dim: usize) -> Result<(), ScenarioError> {
        if self.non_private {
            return Ok(());
        }
        let z = self.noise_multiplier;
        let Err(e) = self.exact_noise(dim, z) else {
            return Ok(());
        };
        if !matches!(e, FixedPointError::NoiseTooLarge { .. }) {
            return Err(ScenarioError::Invalid(format!(
                "no exact noise for clip_norm {} and noise_multiplier {z}: {e}",
                self.clip_norm
            )));
        }
        // The largest multiplier that still fits, by bisection (the limit is monotone in z).
        let (mut lo, mut hi) = (0.0f64, z);
        for _ in 0..80 {
            let mid = 0.5 * (lo + hi);
            if self.exact_noise(dim, mid).is_ok() {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let reach = self
            .planned_epsilon(lo)
            .map(|eps| format!("{eps:.4}"))
            .unwrap_or_else(|e| format!("unknown ({e})"));
        Err(ScenarioError::Invalid(format!(
            "noise_multiplier {z} (for target_epsilon {} at delta {}) is above the largest the exact discrete Gaussian can draw at clip_norm {} ({lo:.4}: {e}); with it the plan reaches epsilon {reach} at the least: raise target_epsilon (or take fewer rounds, or a lower sampling rate) or lower noise_multiplier",
            self.target_epsilon, self.delta, self.clip_norm
        )))
    }

    /// The TOML form (for writing a resolved scenario next to a run's results). An error (a
    /// value TOML cannot hold) is reported, never replaced by an empty file.
    pub fn to_toml_string(&self) -> Result<String, ScenarioError> {
        toml::to_string(self).map_err(|e| ScenarioError::Parse {
            path: None,
            message: format!("cannot write the scenario as TOML: {e}"),
        })
    }

    /// The fixed public denominator: `cohort_size` under `fresh`, `rate x users` under `sampled`.
    pub fn expected_cohort(&self) -> f64 {
        match self.participation {
            Participation::Fresh => self.cohort_size as f64,
            Participation::Sampled { rate } => rate.get() * self.users as f64,
        }
    }

    /// The quorum, with its default resolved.
    pub fn quorum(&self) -> u64 {
        self.quorum
            .unwrap_or_else(|| ((self.expected_cohort() / 2.0).ceil() as u64).max(1))
    }

    /// The L2 bound every update is clipped to: `clip_norm` (which loading replaced by the
    /// clip norm derived from the task's trust region, [`Self::derived_clip_norm`], when the
    /// task has one), or +inf for a non-private twin.
    pub fn effective_clip_norm(&self) -> f64 {
        if self.non_private {
            f64::INFINITY
        } else {
            self.clip_norm
        }
    }

    /// The clip norm a task derives from its own rule instead of `clip_norm`, if any.
    ///
    /// [`Task::LogLinearPg`]: the L2 trust-region rule of seed 004 §4.2.1 for updates that
    /// include their learning rate (`C' = eta C`, independent of eta), with `d = dim` (the task's
    /// dimension: the
    /// policy and the baseline: the baseline shares the clipped vector and its noise, so
    /// counting it in `d` is conservative for the policy's trust region), `n` the expected
    /// cohort (the fixed public denominator) and `sigma` the effective noise multiplier (a
    /// non-private twin derives `sqrt(size)` but is not clipped at all).
    pub fn derived_clip_norm(&self, dim: usize) -> Result<Option<f64>, ScenarioError> {
        match &self.task {
            Task::LogLinearPg(t) => t
                .trust_region
                .clip_norm(
                    dim,
                    self.expected_cohort(),
                    self.effective_noise_multiplier(),
                    1.0,
                )
                .map(Some)
                .map_err(|e| ScenarioError::Invalid(format!("task.trust_region: {e}"))),
            _ => Ok(None),
        }
    }

    /// Replaces `clip_norm` by the derived clip norm when the task has one, so that every
    /// reader (reports, the welcome message, the resolved scenario file) sees the value used.
    fn resolve_clip_norm(&mut self, dim: usize) -> Result<(), ScenarioError> {
        if let Some(c) = self.derived_clip_norm(dim)? {
            self.clip_norm = c;
        }
        Ok(())
    }

    /// The selective task's configuration, if the scenario runs one.
    pub fn selective(&self) -> Option<&crate::selective::SelectiveConfig> {
        match &self.task {
            Task::OfflineCql(t) => t.selective.as_ref(),
            _ => None,
        }
    }

    /// Selective DP-SGD: `rounds` is the number K of DP steps of the public schedule (every
    /// round is one DP step), whatever the file said.
    fn resolve_selective_rounds(&mut self) -> Result<(), ScenarioError> {
        if let Some(sel) = self.selective() {
            sel.validate().map_err(ScenarioError::Invalid)?;
            self.rounds = crate::selective::Schedule::new(sel).dp_steps();
        }
        Ok(())
    }

    /// The DataRelease budget of a selective task, if it has one.
    pub fn release_budget(
        &self,
    ) -> Result<Option<crate::privacy::expert_plan::ReleaseBudget>, ScenarioError> {
        self.selective()
            .and_then(|s| s.release.as_ref())
            .map(|r| {
                crate::privacy::expert_plan::ReleaseBudget::new(
                    r.epsilon,
                    r.delta,
                    r.trajectories,
                    r.calibration,
                )
            })
            .transpose()
            .map_err(|e| ScenarioError::Invalid(format!("task.selective.release: {e}")))
    }

    /// The DataRelease event every unit is charged with before training, if the task has one
    /// (seed 002, Theorem 5.3: T passes, each (2 epsilon', delta_1 / 2T)-DP).
    pub fn release_event(&self) -> Result<Option<DpEvent>, ScenarioError> {
        self.release_budget()?
            .map(|r| r.event())
            .transpose()
            .map_err(|e| ScenarioError::Invalid(format!("task.selective.release: {e}")))
    }

    /// The events one unit is charged with over the whole run at noise multiplier `z`, as the
    /// ledger will record them: under `fresh` one Gaussian (a unit takes part at most once);
    /// under `sampled` one Poisson-sampled Gaussian per round (every unit is charged with every
    /// sampled round, drawn or not), after the DataRelease of a selective task.
    pub fn planned_unit_events(&self, z: f64) -> Vec<DpEvent> {
        let q = self.participation.sampling_rate().map(|q| q.get());
        let mut events: Vec<DpEvent> = self.release_event().ok().flatten().into_iter().collect();
        match self.participation {
            Participation::Fresh => events.push(training_event(z, None)),
            Participation::Sampled { .. } => events.extend(std::iter::repeat_n(
                training_event(z, q),
                self.rounds as usize,
            )),
        }
        events
    }

    /// The epsilon the ledger will report at the end of the run (at `delta`), for noise
    /// multiplier `z`.
    pub fn planned_epsilon(&self, z: f64) -> Result<f64, ScenarioError> {
        let delta =
            Delta::try_from(self.delta).map_err(|e| ScenarioError::Invalid(e.to_string()))?;
        accountant::unit_epsilon(&self.planned_unit_events(z), delta, AccountantKind::Pld)
            .map(|e| e.0)
            .map_err(|e| ScenarioError::Invalid(format!("accounting the planned run: {e}")))
    }

    /// Replaces `noise_multiplier = "auto"` by the smallest noise multiplier whose epsilon, as
    /// the ledger will report it ([`accountant::unit_epsilon`] on
    /// [`planned_unit_events`](Self::planned_unit_events)), stays within `target_epsilon` for
    /// the whole run. A non-private twin needs no noise and keeps the default.
    fn resolve_noise_multiplier(&mut self) -> Result<(), ScenarioError> {
        if !self.noise_multiplier.is_nan() {
            return Ok(());
        }
        if self.non_private {
            self.noise_multiplier = d_noise();
            return Ok(());
        }
        let (target, delta) = (self.target_epsilon, self.delta);
        let bad = |e: PrivacyError| {
            ScenarioError::Invalid(format!(
                "noise_multiplier = \"auto\" for epsilon {target} at delta {delta}: {e}"
            ))
        };
        let checked_delta = Delta::try_from(delta).map_err(|e| bad(e.into()))?;
        // The ledger's own figure for this z: the one accounting policy.
        let reported = |z: f64| -> Result<f64, PrivacyError> {
            Ok(accountant::unit_epsilon(
                &self.planned_unit_events(z),
                checked_delta,
                AccountantKind::Pld,
            )?
            .0)
        };
        // A selective run: the DataRelease shares the budget, and a plan without DP steps
        // needs no noise at all.
        let release = self.release_budget()?;
        if self.selective().is_some() && self.rounds == 0 {
            self.noise_multiplier = d_noise();
            return Ok(());
        }
        // A starting point from the accountants' searches (they keep the feasible end); rate 1
        // is no sampling, so its rounds compose as one Gaussian.
        let mut z = match self.participation.sampling_rate().map(|q| q.get()) {
            Some(q) if release.is_some() => {
                crate::privacy::expert_plan::noise_for_plan(release, q, self.rounds, target, delta)
            }
            None => crate::privacy::gaussian::sigma(target, delta),
            Some(q) if q >= 1.0 => crate::privacy::gaussian::sigma(target, delta)
                .map(|z| z * (self.rounds.max(1) as f64).sqrt()),
            Some(q) => accountant::noise_multiplier(
                target,
                delta,
                q,
                self.rounds.max(1),
                AccountantKind::Pld,
            ),
        }
        .map_err(bad)?;
        // Round-off in the ledger's own evaluation could still put it a hair above the budget,
        // which would refuse the last round. Step up until the ledger's figure fits.
        for _ in 0..64 {
            if reported(z).map_err(bad)? <= target {
                self.noise_multiplier = z;
                return Ok(());
            }
            z *= 1.0 + 1e-9;
        }

        Err(ScenarioError::Invalid(format!(
            "noise_multiplier = \"auto\": no noise multiplier near {z} meets epsilon {target}"
        )))
    }

    /// The noise multiplier applied: `noise_multiplier`, or 0 for a non-private twin.
    pub fn effective_noise_multiplier(&self) -> f64 {
        if self.non_private {
            0.0
        } else {
            self.noise_multiplier
        }
    }

    /// The ledger header this scenario runs under (`delta` checked again: the fields are
    /// public and may have changed since [`validate`](Self::validate)).
    pub fn ledger_config(&self) -> Result<LedgerConfig, ScenarioError> {
        Ok(LedgerConfig {
            target_epsilon: self.target_epsilon,
            delta: Delta::try_from(self.delta)
                .map_err(|e| ScenarioError::Invalid(e.to_string()))?,
            unit_kind: self.unit_kind,
            participation: self.participation,
        })
    }

    /// The unit range client agent `index` of `client_agents` hosts (an even split).
    pub fn agent_units(&self, index: u32) -> crate::protocol::UnitRange {
        let n = self.client_agents.max(1) as u64;
        let i = index as u64;
        crate::protocol::UnitRange {
            start: self.users * i / n,
            end: self.users * (i + 1) / n,
        }
    }

    /// Checks every field; the message names the field and the allowed values. `models` builds
    /// the task's model (its dimension bounds the frame size).
    pub fn validate(&self, models: &dyn TaskModels) -> Result<(), ScenarioError> {
        let bad = |m: String| Err(ScenarioError::Invalid(m));
        let finite_pos = |x: f64| x.is_finite() && x > 0.0;
        // A selective run may have no DP step at all (p = 0: released prefixes only).
        if self.rounds == 0 && self.selective().is_none() {
            return bad("rounds must be at least 1".into());
        }
        if self.users == 0 {
            return bad("users must be at least 1".into());
        }
        if self.client_agents == 0 || self.client_agents as u64 > self.users {
            return bad(format!(
                "client_agents must be between 1 and users ({}), got {}",
                self.users, self.client_agents
            ));
        }
        match self.participation {
            Participation::Fresh => {
                if self.cohort_size == 0 || self.cohort_size > self.users {
                    return bad(format!(
                        "cohort_size must be between 1 and users ({}), got {}",
                        self.users, self.cohort_size
                    ));
                }
                // Every released round uses up to cohort_size units that never contributed:
                // fewer users than that for all rounds stops the run part-way.
                let needed = self.rounds.saturating_mul(self.cohort_size);
                if self.users < needed && !self.allow_fewer_rounds {
                    return bad(format!(
                        "users ({}) is below what `fresh` participation needs: {} rounds x cohort_size {} = {needed} units that never contributed, so the run would stop after about {} rounds; raise users, lower rounds or cohort_size, or set allow_fewer_rounds = true to let the run end when the units run out",
                        self.users,
                        self.rounds,
                        self.cohort_size,
                        self.users / self.cohort_size
                    ));
                }
            }
            // The rate's type checked it when the scenario was read.
            Participation::Sampled { .. } => {}
        }
        if let Some(q) = self.quorum
            && (q == 0 || q > self.users)
        {
            return bad(format!(
                "quorum must be between 1 and users ({}), got {q}",
                self.users
            ));
        }
        // A quorum no round can reach abandons every round: refused at load, with the numbers.
        if let Some(q) = self.quorum {
            match self.participation {
                Participation::Fresh if q > self.cohort_size => {
                    return bad(format!(
                        "quorum ({q}) is above cohort_size ({}): a round offers at most {} units, so no round could ever reach its quorum; set quorum <= cohort_size",
                        self.cohort_size, self.cohort_size
                    ));
                }
                // A Poisson cohort exceeds its mean about half of the time; a quorum above the
                // expected cohort would abandon most rounds (and, under `fresh`-like budgets,
                // waste them), so it is refused too.
                Participation::Sampled { .. } if q as f64 > self.expected_cohort() => {
                    return bad(format!(
                        "quorum ({q}) is above the expected cohort (rate x users = {}): most rounds would be abandoned; set quorum <= {}",
                        self.expected_cohort(),
                        self.expected_cohort().floor()
                    ));
                }
                _ => {}
            }
        }
        if !finite_pos(self.round_deadline_s) {
            return bad(format!(
                "round_deadline_s must be > 0, got {}",
                self.round_deadline_s
            ));
        }
        if !(self.start_timeout_s.is_finite() && self.start_timeout_s >= 0.0) {
            return bad(format!(
                "start_timeout_s must be >= 0, got {}",
                self.start_timeout_s
            ));
        }
        if let Err(e) = ClipNorm::try_from(self.clip_norm) {
            return bad(format!("clip_norm: {e}"));
        }
        if let Err(e) = NoiseMultiplier::try_from(self.noise_multiplier) {
            return bad(format!("noise_multiplier: {e}"));
        }
        if let Err(e) = Delta::try_from(self.delta) {
            return bad(format!("delta: {e}"));
        }
        if !finite_pos(self.target_epsilon) {
            return bad(format!(
                "target_epsilon must be > 0, got {}",
                self.target_epsilon
            ));
        }
        if self.checkpoint_every == 0 {
            return bad("checkpoint_every must be at least 1".into());
        }
        for (name, p) in [
            ("churn.drop_before_upload", self.churn.drop_before_upload),
            (
                "churn.disconnect_mid_upload",
                self.churn.disconnect_mid_upload,
            ),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return bad(format!("{name} must be a probability in [0, 1], got {p}"));
            }
        }
        if !(self.churn.added_latency_s.is_finite() && self.churn.added_latency_s >= 0.0) {
            return bad(format!(
                "churn.added_latency_s must be >= 0, got {}",
                self.churn.added_latency_s
            ));
        }
        // Under `fresh` a unit's whole epsilon is known now (one analytic Gaussian at z): a plan
        // above the budget could not run a single round, so it is refused at load.
        if matches!(self.participation, Participation::Fresh) && !self.non_private {
            let eps = self.planned_epsilon(self.noise_multiplier)?;
            if eps > self.target_epsilon {
                return bad(format!(
                    "noise_multiplier {} gives each unit epsilon {eps:.4} at delta {} under `fresh` participation (one analytic Gaussian), above target_epsilon = {}: raise noise_multiplier (or set it to \"auto\") or raise target_epsilon",
                    self.noise_multiplier, self.delta, self.target_epsilon
                ));
            }
        }
        self.task.validate()?;
        if let Task::Primorl(t) = &self.task {
            // DP-FedAvg over trajectories: the aggregator Poisson-samples them (seed 001,
            // Algorithm 1), one unit per episode of the dataset.
            if !matches!(self.participation, Participation::Sampled { .. }) {
                return bad(
                    "task `primorl` samples trajectories: set participation = { kind = \"sampled\", rate = q }"
                        .into(),
                );
            }
            // A stored dataset's count is checked where it is read (`fedrl run` before any
            // process starts, the aggregator and each agent as they load it).
            if let Some(g) = t.dataset.generated()
                && self.users != g.units
            {
                return bad(format!(
                    "users ({}) must equal task.dataset.units ({}): every episode of the dataset is a privacy unit",
                    self.users, g.units
                ));
            }
            if t.policy.reads_data() && !self.non_private {
                return bad(format!(
                    "task.policy.real_ratio = {} / data_start_fraction = {} train the policy on the real dataset (the MOPO baseline), which no privacy accounting covers: only a `non_private = true` scenario may set them",
                    t.policy.real_ratio, t.policy.data_start_fraction
                ));
            }
        }
        if let Task::Privorl(t) = &self.task {
            // DP-SGD over transitions: the aggregator Poisson-samples them (seed 003, Eq. 2).
            if !matches!(self.participation, Participation::Sampled { .. }) {
                return bad(
                    "task `privorl` fine-tunes by DP-SGD: set participation = { kind = \"sampled\", rate = q }"
                        .into(),
                );
            }
            if t.level == crate::task::privorl::PrivorlLevel::Trajectory {
                if self.users != t.trajectory.units {
                    return bad(format!(
                        "users ({}) must equal task.trajectory.units ({}): every trajectory is a privacy unit",
                        self.users, t.trajectory.units
                    ));
                }
            } else if self.users != t.transitions {
                return bad(format!(
                    "users ({}) must equal task.transitions ({}): every transition is a privacy unit",
                    self.users, t.transitions
                ));
            }
            if !t.finetune && self.rounds != 1 {
                return bad(format!(
                    "task.finetune = false (pre-training only) applies no round: set rounds = 1 (the one round is accounted but not applied), not {}",
                    self.rounds
                ));
            }
        }
        if let Task::OfflineCql(t) = &self.task {
            // DP-SGD: the batch is a Poisson sample the aggregator draws, one unit per dataset
            // unit.
            if !matches!(self.participation, Participation::Sampled { .. }) {
                return bad(
                    "task `offline_cql` trains by DP-SGD: set participation = { kind = \"sampled\", rate = q }"
                        .into(),
                );
            }
            // A stored dataset's unit count needs its files: `fedrl run` and the agents check
            // it where they read them (fedrl_tasks::stored).
            if let Some(d) = t.dataset.generated()
                && self.users != d.units
            {
                return bad(format!(
                    "users ({}) must equal task.dataset.units ({}): every unit of the dataset is a privacy unit",
                    self.users, d.units
                ));
            }
            if let Some(r) = t.selective.as_ref().and_then(|s| s.release.as_ref()) {
                let Some(crate::offline::Behaviour::Experts { max_steps, .. }) =
                    t.dataset.generated().map(|d| &d.behaviour)
                else {
                    return bad(
                        "[task.selective.release] queries expert policies: set task.dataset.behaviour = { kind = \"experts\", ... }"
                            .into(),
                    );
                };
                if *max_steps > r.horizon {
                    return bad(format!(
                        "task.selective.release.horizon ({}) is shorter than the demonstrations (task.dataset.behaviour.max_steps = {max_steps}): L must bound every trajectory",
                        r.horizon
                    ));
                }
            }
            if t.selective.is_some() && self.non_private {
                return bad(
                    "a non-private twin trains CQL on all the data, without a DataRelease: remove [task.selective]"
                        .into(),
                );
            }
            // The plan (DataRelease + the schedule's DP steps) must fit the budget before
            // anything runs; the ledger would otherwise stop DP steps part-way.
            if t.selective.is_some() && !self.non_private {
                let eps = self.planned_epsilon(self.noise_multiplier)?;
                if eps > self.target_epsilon {
                    let q = self.participation.sampling_rate().map_or(1.0, |q| q.get());
                    let fit = crate::privacy::expert_plan::max_dp_steps(
                        self.release_budget()?,
                        q,
                        self.noise_multiplier,
                        self.target_epsilon,
                        self.delta,
                        self.rounds,
                    )
                    .map(|k| format!("at most {k} DP-SGD steps fit"))
                    .unwrap_or_else(|e| format!("no DP-SGD step fits ({e})"));
                    return bad(format!(
                        "the plan (DataRelease + {} DP-SGD steps at q = {q} and noise multiplier {}) costs epsilon {eps:.4} at delta {}, above target_epsilon = {} ({fit}): raise the noise multiplier (or \"auto\"), lower the release's epsilon or unstable_probability, or take fewer steps",
                        self.rounds, self.noise_multiplier, self.delta, self.target_epsilon
                    ));
                }
            }
        }
        // The label must be what one clipped contribution actually holds: the ledger and every
        // report print it as the level of protection.
        if self.unit_kind != self.task.unit_kind() {
            return bad(format!(
                "unit_kind = \"{}\" but task `{}` clips one {}'s data per contribution: its \
                 epsilon is {}-level; set unit_kind = \"{}\"",
                self.unit_kind,
                self.task.kind_name(),
                self.task.unit_kind(),
                self.task.unit_kind(),
                self.task.unit_kind()
            ));
        }
        let dim = models.dim(&self.task)?;
        if dim == 0 || dim > (u32::MAX / 4) as usize {
            return bad(format!(
                "task dim must be between 1 and {}, got {dim}",
                u32::MAX / 4
            ));
        }
        // A derived clip norm replaces `clip_norm`: an explicit different value is a mistake.
        if let Some(c) = self.derived_clip_norm(dim)?
            && self.clip_norm != d_clip()
            && (self.clip_norm - c).abs() > 1e-12 * c
        {
            return bad(format!(
                "clip_norm ({}) is derived from task.trust_region here ({c}); remove clip_norm",
                self.clip_norm
            ));
        }
        let need = (dim * self.task.offer_copies()) as u64 * 4 + 4096;
        if self.max_frame_bytes < need {
            return bad(format!(
                "max_frame_bytes ({}) is too small for vectors of dim {dim} (need at least {need})",
                self.max_frame_bytes
            ));
        }
        Ok(())
    }
}

/// The message of a TOML error in a scenario. serde reads `[task]` (a tagged enum) through a
/// buffer that has lost the fields' positions, so a wrong value inside it would point at the
/// `[task]` header; the task's fields are then parsed again as the kind's spec alone, and the
/// message names the field (`task.server_lr`, `task.local.epochs`) and its line.
fn parse_message(text: &str, err: &toml::de::Error) -> String {
    task_field_error(text).unwrap_or_else(|| err.to_string())
}

/// `task.FIELD (line N): MESSAGE` for an error inside `[task]`, or `None` when the task's
/// fields parse on their own (the error is elsewhere) or cannot be isolated.
fn task_field_error(text: &str) -> Option<String> {
    let doc: toml::Table = text.parse().ok()?;
    let mut task = doc.get("task")?.as_table()?.clone();
    let kind = task.remove("kind")?.as_str()?.to_string();
    let alone = toml::to_string(&task).ok()?;
    let err = crate::task::Task::parse_spec_alone(&kind, &alone)?.err()?;
    let span = err.span()?;
    // The field at fault: its `key =` line in the re-written table, under its `[sub.table]`.
    let before = &alone[..span.start.min(alone.len())];
    let line = alone[before.rfind('\n').map_or(0, |i| i + 1)..]
        .lines()
        .next()
        .unwrap_or("");
    let header = before
        .lines()
        .rev()
        .find_map(|l| {
            let l = l.trim();
            (l.starts_with('[') && l.ends_with(']')).then(|| l.trim_matches(['[', ']']).to_string())
        })
        .filter(|_| !line.trim_start().starts_with('['));
    let key = line
        .split_once('=')
        .map(|(k, _)| k.trim().trim_matches('"').to_string());
    let mut path = String::from("task");
    for part in header.iter().map(String::as_str).chain(key.as_deref()) {
        path.push('.');
        path.push_str(part);
    }
    let message = err.message().trim();
    match key
        .as_deref()
        .and_then(|k| line_of(text, header.as_deref(), k))
    {
        Some(n) => Some(format!("{path} (line {n}): {message}")),
        None => Some(format!("{path}: {message}")),
    }
}

/// The 1-based line of `key = ...` in the scenario text's `[task]` table (or its
/// `[task.SUB]` table), if it is written there as a plain key.
fn line_of(text: &str, sub: Option<&str>, key: &str) -> Option<usize> {
    let header = match sub {
        Some(sub) => format!("[task.{sub}]"),
        None => "[task]".to_string(),
    };
    let mut inside = false;
    for (i, l) in text.lines().enumerate() {
        let t = l.trim();
        if t.starts_with('[') {
            inside = t.replace(' ', "") == header;
            continue;
        }
        if inside
            && let Some((k, _)) = t.split_once('=')
            && k.trim().trim_matches('"') == key
        {
            return Some(i + 1);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_scenario_gets_defaults() {
        let s = Scenario::from_toml_str("[task]\nkind = \"mean_estimation\"\n").unwrap();
        assert_eq!(s.rounds, 10);
        assert_eq!(s.participation, Participation::Fresh);
        assert_eq!(s.quorum(), 5);
        assert_eq!(PlainTasks.dim(&s.task).unwrap(), 16);
        assert_eq!(s.expected_cohort(), 10.0);
    }

    /// Issue 58: a wrong value inside `[task]` names the field and its line, not `[task]`.
    #[test]
    fn task_type_errors_name_the_field() {
        let text = "name = \"x\"\n\n[task]\nkind = \"dppg\"\nserver_lr = \"fast\"\n";
        let err = Scenario::from_toml_str(text).unwrap_err().to_string();
        assert!(err.contains("task.server_lr (line 5)"), "{err}");
        assert!(err.contains("expected f64"), "{err}");
        let nested = "[task]\nkind = \"dppg\"\n\n[task.local]\nepochs = \"many\"\n";
        let err = Scenario::from_toml_str(nested).unwrap_err().to_string();
        assert!(err.contains("task.local.epochs (line 5)"), "{err}");
        let unknown = "[task]\nkind = \"mean_estimation\"\ndimm = 3\n";
        let err = Scenario::from_toml_str(unknown).unwrap_err().to_string();
        assert!(
            err.contains("task.dimm (line 3)") && err.contains("unknown field"),
            "{err}"
        );
        // An error outside [task] keeps TOML's own message and position.
        let top = "rounds = \"ten\"\n[task]\nkind = \"mean_estimation\"\n";
        let err = Scenario::from_toml_str(top).unwrap_err().to_string();
        assert!(
            err.contains("rounds = \"ten\"") && !err.contains("task."),
            "{err}"
        );
    }

    /// Issue 15: plans that cannot run are refused at load, with the numbers: a `fresh` unit's
    /// epsilon above the target, a quorum above the cohort.
    #[test]
    fn infeasible_plans_are_refused_at_load() {
        let task = "[task]\nkind = \"mean_estimation\"\n";
        let err = |text: String| Scenario::from_toml_str(&text).unwrap_err().to_string();
        // z = 1 at delta 1e-5: epsilon about 4.4 for one analytic Gaussian.
        let e = err(format!(
            "noise_multiplier = 1.0\ntarget_epsilon = 1.0\ndelta = 1e-5\n{task}"
        ));
        assert!(
            e.contains("epsilon 4.") && e.contains("target_epsilon = 1") && e.contains("auto"),
            "{e}"
        );
        let eps = crate::privacy::gaussian::epsilon(1.0, 1e-5).unwrap();
        assert!(e.contains(&format!("{eps:.4}")), "{e} vs {eps}");
        // Within the budget it loads; a non-private twin has no budget to exceed.
        assert!(
            Scenario::from_toml_str(&format!(
                "noise_multiplier = 1.0\ntarget_epsilon = 5.0\ndelta = 1e-5\n{task}"
            ))
            .is_ok()
        );
        assert!(
            Scenario::from_toml_str(&format!(
                "non_private = true\nnoise_multiplier = 1.0\ntarget_epsilon = 1.0\n{task}"
            ))
            .is_ok()
        );
        let e = err(format!(
            "users = 100\ncohort_size = 10\nquorum = 11\n{task}"
        ));
        assert!(
            e.contains("quorum (11)") && e.contains("cohort_size (10)"),
            "{e}"
        );
        assert!(
            Scenario::from_toml_str(&format!(
                "users = 100\ncohort_size = 10\nquorum = 10\n{task}"
            ))
            .is_ok()
        );
        let e = err(format!(
            "users = 100\nparticipation = {{ kind = \"sampled\", rate = 0.1 }}\nquorum = 11\n{task}"
        ));
        assert!(
            e.contains("quorum (11)") && e.contains("expected cohort"),
            "{e}"
        );
    }

    /// `noise_multiplier = "auto"` gives the smallest z that keeps the ledger's reported
    /// epsilon within the budget: the analytic Gaussian under `fresh`, PLD under `sampled`.
    #[test]
    fn automatic_noise_multiplier_meets_the_target() {
        let fresh = Scenario::from_toml_str(
            "noise_multiplier = \"auto\"\ntarget_epsilon = 1.0\ndelta = 1e-5\n\
             [task]\nkind = \"mean_estimation\"\n",
        )
        .unwrap();
        let z = fresh.noise_multiplier;
        let eps = crate::privacy::gaussian::epsilon(z, 1e-5).unwrap();
        assert!(eps <= 1.0 && eps > 1.0 - 1e-6, "z {z} eps {eps}");
        // The scenarios' hand-set z = 3.74 is a little above the exact 3.73.
        assert!((3.72..3.74).contains(&z), "{z}");
        // The resolved file carries the number and parses to the same scenario.
        let again = Scenario::from_toml_str(&fresh.to_toml_string().unwrap()).unwrap();
        assert_eq!(again, fresh);

        let sampled = Scenario::from_toml_str(
            "noise_multiplier = \"auto\"\ntarget_epsilon = 2.0\nrounds = 200\nusers = 1000\n\
             participation = { kind = \"sampled\", rate = 0.01 }\n\
             [task]\nkind = \"mean_estimation\"\n",
        )
        .unwrap();
        let z = sampled.noise_multiplier;
        let event = crate::privacy::accountant::sampled_gaussian_rounds(z, 0.01, 200);
        let pld = crate::privacy::accountant::AccountantKind::Pld;
        let eps = crate::privacy::accountant::epsilon(&event, 1e-5, pld).unwrap();
        assert!(eps <= 2.0 && eps > 1.99, "z {z} eps {eps}");

        // A twin ignores it; a word other than "auto" is an error that names the field.
        let twin = Scenario::from_toml_str(
            "non_private = true\nnoise_multiplier = \"auto\"\n[task]\nkind = \"mean_estimation\"\n",
        )
        .unwrap();
        assert_eq!(twin.effective_noise_multiplier(), 0.0);
        let e = Scenario::from_toml_str(
            "noise_multiplier = \"lots\"\n[task]\nkind = \"mean_estimation\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("noise_multiplier"), "{e}");
    }

    /// The resolved z is the ledger's: a ledger fed the planned rounds accepts every one of
    /// them, and its reported figure is the one `accountant::unit_epsilon` gave the scenario
    /// (rate 1 included, where the rounds compose as one exact Gaussian).
    #[test]
    fn automatic_noise_multiplier_is_what_the_ledger_accepts() {
        use crate::privacy::ledger::{PrivacyLedger, RoundRecord};
        use crate::privacy::noise::NoiseSource;
        for (participation, rounds) in [
            ("{ kind = \"sampled\", rate = 0.2 }", 30u64),
            ("{ kind = \"sampled\", rate = 1.0 }", 50),
        ] {
            let s = Scenario::from_toml_str(&format!(
                "noise_multiplier = \"auto\"\ntarget_epsilon = 3.0\nrounds = {rounds}\n\
                 users = 50\nparticipation = {participation}\n\
                 [task]\nkind = \"mean_estimation\"\n"
            ))
            .unwrap();
            let z = s.noise_multiplier;
            let (planned, _) = accountant::unit_epsilon(
                &s.planned_unit_events(z),
                Delta::try_from(s.delta).unwrap(),
                AccountantKind::Pld,
            )
            .unwrap();
            assert!(
                planned <= 3.0 && planned > 3.0 - 1e-3,
                "{participation}: {planned}"
            );
            let dir = tempfile::tempdir().unwrap();
            let (mut l, _) =
                PrivacyLedger::open(dir.path().join("l"), s.ledger_config().unwrap()).unwrap();
            let q = s.participation.sampling_rate().map(|q| q.get());
            for r in 1..=rounds {
                let rec = RoundRecord::gaussian_round(
                    r,
                    vec![r % 50],
                    z,
                    1.0,
                    q,
                    s.expected_cohort(),
                    NoiseSource::Os,
                );
                l.append(rec).unwrap();
            }
            assert_eq!(l.epsilon().unwrap(), planned, "{participation}");
            let method = l.report().unwrap().accountant;
            let exact = if q == Some(1.0) {
                "analytic_gaussian"
            } else {
                "pld"
            };
            assert_eq!(method, exact);
        }
    }

    #[test]
    fn sampled_and_round_trip() {
        let text = r#"
            name = "t"
            seed = 3
            users = 200
            participation = { kind = "sampled", rate = 0.1 }
            [churn]
            drop_before_upload = 0.3
            [task]
            kind = "mean_estimation"
            dim = 4
        "#;
        let s = Scenario::from_toml_str(text).unwrap();
        assert_eq!(s.expected_cohort(), 20.0);
        assert_eq!(s.quorum(), 10);
        let again = Scenario::from_toml_str(&s.to_toml_string().unwrap()).unwrap();
        assert_eq!(again, s);
        assert_eq!(Task::from_json(&s.task.to_json().unwrap()).unwrap(), s.task);
    }

    #[test]
    fn unknown_fields_and_bad_values_are_named() {
        let err = Scenario::from_toml_str("roundz = 3\n[task]\nkind = \"mean_estimation\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("roundz"), "{err}");
        let err = Scenario::from_toml_str("[task]\nkind = \"mean_estimation\"\ndimm = 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("dimm"), "{err}");
        let err = Scenario::from_toml_str("[task]\nkind = \"nope\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("nope"), "{err}");
        let err = Scenario::from_toml_str("clip_norm = -1.0\n[task]\nkind = \"mean_estimation\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("clip_norm"), "{err}");
        // The privacy parameters' newtypes name the rule.
        let err = Scenario::from_toml_str(
            "participation = { kind = \"sampled\", rate = 1.5 }\n[task]\nkind = \"mean_estimation\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("sampling rate must be in (0, 1], got 1.5"),
            "{err}"
        );
        let err = Scenario::from_toml_str("delta = 1.0\n[task]\nkind = \"mean_estimation\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("delta: delta must be in (0, 1), got 1"),
            "{err}"
        );
        let err =
            Scenario::from_toml_str("noise_multiplier = 0.0\n[task]\nkind = \"mean_estimation\"\n")
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("noise_multiplier: noise multiplier must be positive"),
            "{err}"
        );
    }

    #[test]
    fn agents_split_users_evenly() {
        let mut s =
            Scenario::from_toml_str("users = 10\nrounds = 1\n[task]\nkind = \"mean_estimation\"\n")
                .unwrap();
        s.client_agents = 3;
        let ranges: Vec<_> = (0..3).map(|i| s.agent_units(i)).collect();
        assert_eq!(ranges[0].start, 0);
        assert_eq!(ranges[2].end, 10);
        assert_eq!(ranges.iter().map(|r| r.len()).sum::<u64>(), 10);
    }

    /// Finding 7: `unit_kind` is what one clipped contribution holds, not a free label. Every
    /// task here clips one user's data, so `trajectory` or `expert` is refused by name.
    #[test]
    fn unit_kind_must_match_what_the_task_clips() {
        let task = "[task]\nkind = \"mean_estimation\"\n";
        let s = Scenario::from_toml_str(&format!("unit_kind = \"user\"\n{task}")).unwrap();
        assert_eq!(s.unit_kind, UnitKind::User);
        assert_eq!(s.task.unit_kind(), UnitKind::User);
        for wrong in ["expert", "trajectory"] {
            let err = Scenario::from_toml_str(&format!("unit_kind = \"{wrong}\"\n{task}"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("unit_kind") && err.contains(wrong) && err.contains("user"),
                "{err}"
            );
        }
        // The RL tasks are user-level too (their dimension needs fedrl-rl; the label does not).
        for kind in ["dppg", "loglinear_pg"] {
            let t = Task::from_json(&format!("{{\"kind\":\"{kind}\"}}")).unwrap();
            assert_eq!(t.unit_kind(), UnitKind::User, "{kind}");
        }
    }

    /// Without the crate that builds models, a task whose dimension needs one is an error that
    /// says where to load it, never a dimension of 0.
    #[test]
    fn a_task_needing_its_model_is_refused_without_one() {
        let err = Scenario::from_toml_str("[task]\nkind = \"dppg\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("dppg") && err.contains("fedrl-tasks"), "{err}");
        let t = Task::from_json("{\"kind\":\"loglinear_pg\"}").unwrap();
        assert!(matches!(
            PlainTasks.dim(&t),
            Err(TaskError::NeedsModel {
                kind: "loglinear_pg"
            })
        ));
    }

    /// Every kind's declared name is its serde tag, and the task travels on the wire as its
    /// kind, its configuration version and its configuration; an unknown kind or another
    /// version is refused by name before the configuration is read.
    #[test]
    fn tasks_travel_as_kind_version_and_config() {
        use crate::protocol::TaskConfig;
        // PriMORL has no defaults for its dataset and model: take a shipped scenario's task.
        let primorl: toml::Value = toml::from_str(
            &std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../scenarios/pendulum-primorl.toml"
            ))
            .unwrap(),
        )
        .unwrap();
        let primorl: Task = primorl["task"].clone().try_into().unwrap();
        let tasks = [
            "mean_estimation",
            "dppg",
            "loglinear_pg",
            "offline_cql",
            "privorl",
        ]
        .map(|kind| Task::from_json(&format!("{{\"kind\":\"{kind}\"}}")).unwrap());
        for t in tasks.into_iter().chain([primorl]) {
            let kind = t.kind_name();
            // The declared name is the serde tag.
            let json: serde_json::Value = serde_json::from_str(&t.to_json().unwrap()).unwrap();
            assert_eq!(json["kind"], kind);
            let wire = t.to_wire().unwrap();
            assert_eq!(wire.kind, kind);
            assert_eq!(Some(wire.config_version), Task::config_version_of(kind));
            assert_eq!(Task::from_wire(&wire).unwrap(), t);
        }
        let t = Task::from_json("{\"kind\":\"dppg\"}").unwrap();
        let wire = t.to_wire().unwrap();
        let newer = TaskConfig {
            config_version: wire.config_version + 1,
            // A configuration this build could not parse: the version check comes first.
            config_json: "{\"kind\":\"dppg\",\"field_of_the_future\":1}".into(),
            ..wire.clone()
        };
        let err = Task::from_wire(&newer).unwrap_err().to_string();
        assert!(err.contains("dppg") && err.contains("version"), "{err}");
        let unknown = TaskConfig {
            kind: "no_such_kind".into(),
            config_version: 1,
            config_json: "{\"kind\":\"no_such_kind\"}".into(),
        };
        let err = Task::from_wire(&unknown).unwrap_err().to_string();
        assert!(
            err.contains("no_such_kind") && err.contains("not known"),
            "{err}"
        );
        let mislabelled = TaskConfig {
            kind: "mean_estimation".into(),
            config_version: Task::config_version_of("mean_estimation").unwrap(),
            ..wire
        };
        assert!(Task::from_wire(&mislabelled).is_err());
    }

    /// The device is a plain string in TOML with default `cpu`; a bad one is named.
    #[test]
    fn device_field_defaults_to_cpu_and_round_trips() {
        let task = "[task]\nkind = \"mean_estimation\"\n";
        let s = Scenario::from_toml_str(task).unwrap();
        assert_eq!(s.device, DeviceSpec::Cpu);
        let s = Scenario::from_toml_str(&format!("device = \"cuda:1\"\n{task}")).unwrap();
        assert_eq!(s.device, DeviceSpec::Cuda(1));
        assert!(s.to_toml_string().unwrap().contains("device = \"cuda:1\""));
        assert_eq!(
            Scenario::from_toml_str(&s.to_toml_string().unwrap()).unwrap(),
            s
        );
        let err = Scenario::from_toml_str(&format!("device = \"gpu\"\n{task}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("gpu") && err.contains("cuda:N"), "{err}");
    }

    #[test]
    fn mean_estimation_data_is_deterministic() {
        let t = MeanEstimationTask {
            dim: 5,
            mean_norm: 2.0,
            user_std: 0.1,
            server_lr: 1.0,
            data_seed: 9,
        };
        let mu = t.true_mean();
        let n: f64 = mu.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        assert!((n - 2.0).abs() < 1e-5);
        assert_eq!(t.user_vector(&mu, 3), t.user_vector(&mu, 3));
        assert_ne!(t.user_vector(&mu, 3), t.user_vector(&mu, 4));
    }

    /// Issue 59, item 5: plans the run cannot carry out are refused when the scenario is
    /// loaded (before any aggregator listens, and for `--issue-token` too), with the numbers.
    #[test]
    fn infeasible_plans_are_refused_at_load_with_the_numbers() {
        let task = "[task]\nkind = \"mean_estimation\"\n";
        // `fresh`: 20 rounds of 10 need 200 units that never contributed; 40 run out after 4.
        let e = Scenario::from_toml_str(&format!(
            "users = 40\nrounds = 20\ncohort_size = 10\nquorum = 5\nnoise_multiplier = 5.0\n{task}"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("users (40)")
                && e.contains("20 rounds x cohort_size 10 = 200")
                && e.contains("allow_fewer_rounds"),
            "{e}"
        );
        // Allowed explicitly: the run may end when the units run out.
        let s = Scenario::from_toml_str(&format!(
            "users = 40\nrounds = 20\ncohort_size = 10\nquorum = 5\nnoise_multiplier = 5.0\nallow_fewer_rounds = true\n{task}"
        ))
        .unwrap();
        assert!(s.allow_fewer_rounds);
        // Enough users: accepted, and the field defaults to false.
        let s = Scenario::from_toml_str(&format!(
            "users = 200\nrounds = 20\ncohort_size = 10\nnoise_multiplier = 5.0\n{task}"
        ))
        .unwrap();
        assert!(!s.allow_fewer_rounds);

        // "auto" with an epsilon so small that the noise it needs is beyond what the exact
        // discrete Gaussian can draw at this clip norm: refused now, not after "listening".
        let e = Scenario::from_toml_str(&format!(
            "noise_multiplier = \"auto\"\ntarget_epsilon = 0.001\n{task}"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("noise_multiplier") && e.contains("largest") && e.contains("epsilon"),
            "{e}"
        );
        // The same for an explicit multiplier that large.
        let e = Scenario::from_toml_str(&format!("noise_multiplier = 5000.0\n{task}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("5000") && e.contains("largest"), "{e}");
        // A multiplier the sampler can draw still loads.
        Scenario::from_toml_str(&format!("noise_multiplier = 50.0\n{task}")).unwrap();
    }
}
