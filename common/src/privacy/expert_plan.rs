//! The expert-level privacy plan of Selective DP-SGD (seed 002, Theorem 5.6): the DataRelease
//! (Algorithm 2) followed by the DP-SGD steps of Algorithm 3, both charged to every expert, and
//! accounted together by the ledger's accountant ([`accountant::unit_epsilon_grouped`]).
//!
//! **How the DP-SGD steps are charged (a decision of fedrl, not the paper's).** The paper
//! (appendix B.2) accounts each of the N training steps as a Poisson-sampled Gaussian at rate
//! q = p b/m, treating the Bernoulli(p) choice between a DP step on D_unst and a free step on
//! D_stable as amplification. That is not sound when the step type can be told from the released
//! iterates, and here it can: a free step is noise-free, a DP step adds Gaussian noise. Per step
//! the privacy profile is then p x delta_{b/m}(epsilon) (the step type is visible, only a DP
//! step sees the data), which is worse than delta_{p b/m}(epsilon). fedrl instead draws the step
//! types from a public seeded schedule and charges exactly the K DP steps that run, each a
//! Poisson-sampled Gaussian at q = b/m (the coordinator samples experts at b/m, one transition
//! per sampled expert). This is sound and conservative, and close to the paper's figure for p
//! near 1. The free steps cost nothing: D_stable is already public after the release.
//!
//! The events this module builds are the ones the ledger must record, so that the ledger's
//! figure and [`ExpertPlan::epsilon`] agree bit for bit: one record with
//! [`ExpertPlan::release_event`] (the whole release, charging every expert), then one record per
//! DP step with [`ExpertPlan::dp_step_event`], both with `sampled_by_aggregator = true` (the
//! coordinator queries every expert and draws the Poisson sample itself).

use super::accountant::{self, AccountantKind};
use super::expert_release::{
    Calibration, ReleaseParameters, calibrated_epsilon_prime, epsilon_prime, passes_event,
};
use super::ledger::training_event;
use super::params::{Delta, SamplingRate};
use super::{DpEvent, PrivacyError};

/// The budget of a DataRelease run (Algorithm 2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReleaseBudget {
    /// epsilon_1 (nats), the budget the release's parameters are derived from (Theorem 5.5).
    pub epsilon_1: f64,
    /// delta_1: the release's delta (Theorem 5.5).
    pub delta_1: f64,
    /// T: trajectories examined.
    pub trajectories: u64,
    /// epsilon' (nats), the per-query budget of PrefixQuery, resolved from the three above by
    /// the budget's [`Calibration`] when it was made ([`Self::new`]).
    pub epsilon_prime: f64,
}

impl ReleaseBudget {
    /// The budget (`epsilon_1`, `delta_1`) over T = `trajectories` passes, epsilon' by
    /// `calibration` (the accountant's search runs here, once).
    pub fn new(
        epsilon_1: f64,
        delta_1: f64,
        trajectories: u64,
        calibration: Calibration,
    ) -> Result<Self, PrivacyError> {
        let epsilon_prime = match calibration {
            Calibration::Theorem => epsilon_prime(epsilon_1, delta_1, trajectories)?,
            Calibration::Accountant => calibrated_epsilon_prime(epsilon_1, delta_1, trajectories)?,
        };
        Ok(Self {
            epsilon_1,
            delta_1,
            trajectories,
            epsilon_prime,
        })
    }

    /// The parameters of Algorithm 2 for this budget, experts' minimum action probability
    /// `p_min` and horizon L = `horizon` (steps).
    pub fn parameters(&self, p_min: f64, horizon: u64) -> Result<ReleaseParameters, PrivacyError> {
        ReleaseParameters::with_epsilon_prime(
            self.epsilon_prime,
            self.delta_1,
            p_min,
            self.trajectories,
            horizon,
        )
    }

    /// The release as an accounting event: T passes, each (2 epsilon', delta_1/(2T))-DP
    /// (Theorem 5.3), composed by the accountant (tighter than Theorem 5.5's advanced
    /// composition).
    pub fn event(&self) -> Result<DpEvent, PrivacyError> {
        passes_event(self.epsilon_prime, self.delta_1, self.trajectories)
    }
}

/// The privacy events of one expert over a Selective DP-SGD run: the release, if any, then
/// `dp_steps` DP-SGD steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertPlan {
    /// The DataRelease, or `None` when there is none (epsilon_1 = 0: DP-SGD only, Algorithm 4).
    pub release: Option<ReleaseBudget>,
    /// K: the DP-SGD steps that run (not the total training steps: free steps on D_stable cost
    /// nothing).
    pub dp_steps: u64,
    /// q = b/m: the rate at which the coordinator Poisson-samples experts for one DP step.
    pub rate: f64,
    /// z: Gaussian noise standard deviation / clip norm of a DP step.
    pub noise_multiplier: f64,
}

impl ExpertPlan {
    /// The release's event (`None` without a release).
    pub fn release_event(&self) -> Result<Option<DpEvent>, PrivacyError> {
        self.release.as_ref().map(ReleaseBudget::event).transpose()
    }

    /// The event of one DP-SGD step: Gaussian(z) on a Poisson sample at rate q (at q = 1, the
    /// plain Gaussian, as the ledger records it).
    pub fn dp_step_event(&self) -> Result<DpEvent, PrivacyError> {
        SamplingRate::try_from(self.rate)?;
        if !(self.noise_multiplier.is_finite() && self.noise_multiplier > 0.0) {
            return Err(PrivacyError::InvalidParameter(format!(
                "noise multiplier must be positive and finite, got {}",
                self.noise_multiplier
            )));
        }
        Ok(training_event(self.noise_multiplier, Some(self.rate)))
    }

    /// The plan grouped as the ledger groups one expert's history: the release once, then the
    /// DP step K times (parts that do not occur left out).
    fn groups(&self) -> Result<Vec<(DpEvent, u64)>, PrivacyError> {
        let mut groups = Vec::with_capacity(2);
        if let Some(r) = self.release_event()? {
            groups.push((r, 1));
        }
        if self.dp_steps > 0 {
            groups.push((self.dp_step_event()?, self.dp_steps));
        }
        Ok(groups)
    }

    /// The composed event of one expert: the release, then K DP steps. An empty plan is an
    /// error (there is no event to describe).
    pub fn event(&self) -> Result<DpEvent, PrivacyError> {
        let mut parts: Vec<DpEvent> = self
            .groups()?
            .into_iter()
            .map(|(e, n)| {
                if n == 1 {
                    e
                } else {
                    DpEvent::SelfComposed {
                        event: Box::new(e),
                        count: n,
                    }
                }
            })
            .collect();
        match parts.len() {
            0 => Err(PrivacyError::InvalidParameter(
                "the plan has neither a release nor a DP step".into(),
            )),
            1 => Ok(parts.remove(0)),
            _ => Ok(DpEvent::Composed { events: parts }),
        }
    }

    /// Expert-level epsilon (nats) at `delta` of the whole plan, by the ledger's accounting
    /// policy (PLD; 0 for an empty plan). A ledger holding one release record and K DP-step
    /// records (see the module's doc) reports the same figure.
    pub fn epsilon(&self, delta: f64) -> Result<f64, PrivacyError> {
        let delta = Delta::try_from(delta)?;
        let groups = self.groups()?;
        let refs: Vec<(&DpEvent, u64)> = groups.iter().map(|(e, n)| (e, *n)).collect();
        Ok(accountant::unit_epsilon_grouped(&refs, delta, AccountantKind::Pld)?.0)
    }
}

fn check_target(target_epsilon: f64) -> Result<(), PrivacyError> {
    if !(target_epsilon.is_finite() && target_epsilon > 0.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "target epsilon must be positive and finite, got {target_epsilon}"
        )));
    }
    Ok(())
}

/// The plan's epsilon, with an accountant that cannot handle it (a PLD grid too large) read as
/// "above any target": the searches below then only stop earlier, never later.
fn epsilon_or_infinite(plan: &ExpertPlan, delta: f64) -> Result<f64, PrivacyError> {
    match plan.epsilon(delta) {
        Err(PrivacyError::Unsupported(_)) => Ok(f64::INFINITY),
        other => other,
    }
}

/// The largest K <= `cap` such that the plan (`release`, K DP steps at rate `rate` with noise
/// multiplier `noise_multiplier`) has epsilon <= `target_epsilon` at `delta`; 0 when the release
/// alone exceeds it. Epsilon grows with K (composing one more mechanism never lowers it), so
/// this is a doubling search and a bisection on the same figure the ledger accounts: a ledger
/// with that target accepts exactly K DP steps after the release and refuses the next.
pub fn max_dp_steps(
    release: Option<ReleaseBudget>,
    rate: f64,
    noise_multiplier: f64,
    target_epsilon: f64,
    delta: f64,
    cap: u64,
) -> Result<u64, PrivacyError> {
    check_target(target_epsilon)?;
    let plan = |k: u64| ExpertPlan {
        release,
        dp_steps: k,
        rate,
        noise_multiplier,
    };
    // Validates the step's parameters even when the release alone decides.
    plan(1).dp_step_event()?;
    let fits = |k: u64| -> Result<bool, PrivacyError> {
        Ok(epsilon_or_infinite(&plan(k), delta)? <= target_epsilon)
    };
    if cap == 0 || !fits(0)? || !fits(1)? {
        return Ok(0);
    }
    // Invariant: lo fits, hi does not (or hi = cap + 1, past the cap).
    let (mut lo, mut hi) = (1u64, cap.saturating_add(1));
    let mut probe = 2u64;
    while probe < hi {
        if fits(probe)? {
            lo = probe;
            probe = probe.saturating_mul(2);
        } else {
            hi = probe;
        }
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// The smallest noise multiplier z such that the plan (`release`, `dp_steps` DP steps at rate
/// `rate`) has epsilon <= `target_epsilon` at `delta`, to the relative tolerance of the
/// crate's noise search ([`accountant::NOISE_RELATIVE_TOLERANCE`]; the same search as
/// [`accountant::noise_multiplier`], which it reuses). The returned z always fits.
/// `NoSolution` when the release alone exceeds the target, or no z up to
/// [`accountant::MAX_NOISE_MULTIPLIER`] fits.
pub fn noise_for_plan(
    release: Option<ReleaseBudget>,
    rate: f64,
    dp_steps: u64,
    target_epsilon: f64,
    delta: f64,
) -> Result<f64, PrivacyError> {
    check_target(target_epsilon)?;
    if dp_steps == 0 {
        return Err(PrivacyError::InvalidParameter(
            "a noise multiplier is needed only for at least one DP step".into(),
        ));
    }
    let plan = |z: f64| ExpertPlan {
        release,
        dp_steps,
        rate,
        noise_multiplier: z,
    };
    // Validates rate and delta before searching.
    plan(1.0).dp_step_event()?;
    Delta::try_from(delta)?;
    let release_alone = ExpertPlan {
        dp_steps: 0,
        ..plan(1.0)
    }
    .epsilon(delta)?;
    if release_alone >= target_epsilon {
        return Err(PrivacyError::NoSolution(format!(
            "the release alone has epsilon {release_alone} at delta {delta}, not below the \
             target {target_epsilon}: no DP step fits"
        )));
    }
    // The DP steps alone under the whole target (RDP, cheap) need less noise than the plan
    // does: an infeasible or nearly feasible start, from which the search walks up.
    let start =
        accountant::noise_multiplier(target_epsilon, delta, rate, dp_steps, AccountantKind::Rdp)
            .unwrap_or(1.0);
    let gap = |z: f64| -> Result<f64, PrivacyError> {
        Ok(epsilon_or_infinite(&plan(z), delta)? - target_epsilon)
    };
    accountant::smallest_noise_multiplier(gap, start, 0.8).map_err(|e| match e {
        PrivacyError::NoSolution(_) => PrivacyError::NoSolution(format!(
            "no noise multiplier up to {} fits {dp_steps} DP steps at rate {rate} beside the \
             release ({release_alone} alone) within epsilon {target_epsilon} at delta {delta}",
            accountant::MAX_NOISE_MULTIPLIER
        )),
        other => other,
    })
}
