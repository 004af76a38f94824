//! The parameter formulas of DataRelease, Algorithm 2 of seed 002 ("expert-level differentially
//! private offline RL": experts are the privacy units; stable trajectory prefixes, found with a
//! sparse-vector style test, are released without noise).
//!
//! Inputs: the release budget (epsilon_1, delta_1) in nats, the minimum action probability
//! p_min of every expert policy (Assumption 1), the number T of trajectories examined (unstable
//! query cutoff) and the trajectory length L. Algorithm 2, line 2-3 and 7:
//!
//! ```text
//! epsilon' = epsilon_1 / sqrt(32 T ln(2/delta_1))      delta' = delta_1 / (2 T L)
//! c_min    = e^epsilon' / (e^epsilon' - 1)             theta  = c_min / p_min
//! theta^   = theta + (4/epsilon') ln(1/delta') + Lap(2/epsilon')     (per trajectory)
//! ```
//!
//! PrefixQuery (Algorithm 1) then answers "stable" when count + Lap(4/epsilon') > theta^;
//! [`stable_prefix`] walks one candidate trajectory's prefixes as the coordinator does
//! (lines 7-16), and [`max_stable_prefix`] bounds what can pass.
//! Theorem 5.3: one trajectory's pass is (2 epsilon', delta_1/(2T))-DP; Theorem 5.5 composes the
//! T passes with advanced composition (Dwork & Roth, Corollary 3.21) into (epsilon_1,
//! delta_1)-DP. That corollary assumes epsilon_1 <= 1: [`release_guarantee`] evaluates the
//! advanced-composition bound exactly, and [`release_event`] lets the PLD accountant compose the
//! T passes tightly instead.
//!
//! Advanced composition is loose: at epsilon_1 = 10, T = 25 the PLD accountant composes the T
//! passes of the formula's epsilon' to about 4.3, not 10. [`Calibration::Accountant`] instead
//! takes the largest epsilon' whose T passes the accountant composes to at most epsilon_1 at
//! delta_1 ([`calibrated_epsilon_prime`]): the same guarantee, as the ledger measures it, with a
//! lower threshold theta^ and so longer stable prefixes. Theorem 5.3 (one pass is
//! (2 epsilon', delta_1/(2T))-DP) holds for any epsilon' > 0; only the composition changes.

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::accountant::{self, AccountantKind};
use super::{DpEvent, PrivacyError, composition, laplace};

/// How DataRelease's per-query budget epsilon' follows from its budget (epsilon_1, delta_1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Calibration {
    /// Algorithm 2's formula, epsilon' = epsilon_1 / sqrt(32 T ln(2/delta_1)) (Theorem 5.5's
    /// advanced composition). The default: the paper's parameters.
    #[default]
    Theorem,
    /// The largest epsilon' whose T passes, each (2 epsilon', delta_1/(2T))-DP, the ledger's
    /// PLD accountant composes to at most epsilon_1 at delta_1 ([`calibrated_epsilon_prime`]).
    Accountant,
}

/// Checks a budget `epsilon` > 0 (epsilon_1, or epsilon' as `name` says), delta_1 in (0, 1)
/// and T >= 1.
fn check(name: &str, epsilon: f64, delta1: f64, trajectories: u64) -> Result<(), PrivacyError> {
    let valid =
        epsilon.is_finite() && epsilon > 0.0 && delta1 > 0.0 && delta1 < 1.0 && trajectories > 0;
    if !valid {
        return Err(PrivacyError::InvalidParameter(format!(
            "need {name} > 0, delta_1 in (0, 1) and T >= 1, got ({epsilon}, {delta1}, {trajectories})"
        )));
    }
    Ok(())
}

/// epsilon' = epsilon_1 / sqrt(32 T ln(2/delta_1)) (nats): the per-query budget of PrefixQuery.
pub fn epsilon_prime(epsilon_1: f64, delta_1: f64, trajectories: u64) -> Result<f64, PrivacyError> {
    check("epsilon_1", epsilon_1, delta_1, trajectories)?;
    Ok(epsilon_1 / (32.0 * trajectories as f64 * (2.0 / delta_1).ln()).sqrt())
}

/// The largest epsilon' (nats, to a relative 1e-6, rounded down) such that T passes, each
/// (2 epsilon', delta_1/(2T))-DP ([`passes_event`]), compose under the PLD accountant to at most
/// `epsilon_1` at `delta_1`. At least the formula's [`epsilon_prime`] whenever the accountant
/// confirms that one (it always has: PLD composition is tighter than advanced composition).
pub fn calibrated_epsilon_prime(
    epsilon_1: f64,
    delta_1: f64,
    trajectories: u64,
) -> Result<f64, PrivacyError> {
    check("epsilon_1", epsilon_1, delta_1, trajectories)?;
    let fits = |e: f64| -> Result<bool, PrivacyError> {
        let event = passes_event(e, delta_1, trajectories)?;
        Ok(accountant::epsilon(&event, delta_1, AccountantKind::Pld)? <= epsilon_1)
    };
    // One pass alone is (2 epsilon')-DP: epsilon' above epsilon_1 / 2 cannot fit.
    let mut hi = epsilon_1 / 2.0;
    if fits(hi)? {
        return Ok(hi);
    }
    let mut lo = epsilon_prime(epsilon_1, delta_1, trajectories)?;
    if !fits(lo)? {
        lo = 0.0;
    }
    // Invariant: lo fits (or is 0), hi does not.
    while hi - lo > 1e-6 * hi {
        let mid = 0.5 * (lo + hi);
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    if lo <= 0.0 {
        return Err(PrivacyError::NoSolution(format!(
            "no epsilon' fits T = {trajectories} passes into epsilon_1 = {epsilon_1} at delta_1 = \
             {delta_1}"
        )));
    }
    Ok(lo)
}

/// delta' = delta_1 / (2 T L): the chance budget of one unstable prefix passing the test.
pub fn delta_prime(delta_1: f64, trajectories: u64, horizon: u64) -> Result<f64, PrivacyError> {
    if !(delta_1 > 0.0 && delta_1 < 1.0) || trajectories == 0 || horizon == 0 {
        return Err(PrivacyError::InvalidParameter(format!(
            "need delta_1 in (0, 1), T >= 1 and L >= 1, got ({delta_1}, {trajectories}, {horizon})"
        )));
    }
    Ok(delta_1 / (2.0 * trajectories as f64 * horizon as f64))
}

/// c_min = e^epsilon' / (e^epsilon' - 1): the smallest expected count (sum over experts of the
/// prefix probability) for which removing one expert changes the prefix's sampling probability
/// by at most e^epsilon' (Lemma 5.1).
pub fn c_min(epsilon_prime: f64) -> Result<f64, PrivacyError> {
    if !(epsilon_prime.is_finite() && epsilon_prime > 0.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "epsilon' must be positive, got {epsilon_prime}"
        )));
    }
    // e^x / (e^x - 1) = 1 / (1 - e^-x), stable for small x.
    Ok(-1.0 / (-epsilon_prime).exp_m1())
}

/// theta = c_min / p_min: the count threshold of a stable prefix (p_min in (0, 1]).
pub fn theta(c_min: f64, p_min: f64) -> Result<f64, PrivacyError> {
    let valid = p_min > 0.0 && p_min <= 1.0 && c_min.is_finite() && c_min > 0.0;
    if !valid {
        return Err(PrivacyError::InvalidParameter(format!(
            "need c_min > 0 and p_min in (0, 1], got ({c_min}, {p_min})"
        )));
    }
    Ok(c_min / p_min)
}

/// The noise-free part of theta^: theta + (4/epsilon') ln(1/delta').
pub fn theta_hat_offset(
    theta: f64,
    epsilon_prime: f64,
    delta_prime: f64,
) -> Result<f64, PrivacyError> {
    let valid =
        epsilon_prime.is_finite() && epsilon_prime > 0.0 && delta_prime > 0.0 && delta_prime < 1.0;
    if !valid {
        return Err(PrivacyError::InvalidParameter(format!(
            "need epsilon' > 0 and delta' in (0, 1), got ({epsilon_prime}, {delta_prime})"
        )));
    }
    Ok(theta + 4.0 / epsilon_prime * (1.0 / delta_prime).ln())
}

/// Scale of the Laplace noise on the threshold, 2/epsilon' (Algorithm 2, line 7).
pub fn threshold_noise_scale(epsilon_prime: f64) -> f64 {
    2.0 / epsilon_prime
}

/// Scale of the Laplace noise on each prefix count, 4/epsilon' (Algorithm 1, line 4).
pub fn query_noise_scale(epsilon_prime: f64) -> f64 {
    4.0 / epsilon_prime
}

/// One draw of theta^ = theta + (4/epsilon') ln(1/delta') + Lap(2/epsilon'), redrawn per
/// trajectory.
pub fn theta_hat<R: Rng + ?Sized>(
    theta: f64,
    epsilon_prime: f64,
    delta_prime: f64,
    rng: &mut R,
) -> Result<f64, PrivacyError> {
    let offset = theta_hat_offset(theta, epsilon_prime, delta_prime)?;
    Ok(offset + laplace::sample(threshold_noise_scale(epsilon_prime), rng)?)
}

/// PrefixQuery (Algorithm 1): true ("stable") when count + Lap(4/epsilon') > theta^.
pub fn prefix_query<R: Rng + ?Sized>(
    count: f64,
    theta_hat: f64,
    epsilon_prime: f64,
    rng: &mut R,
) -> Result<bool, PrivacyError> {
    Ok(count + laplace::sample(query_noise_scale(epsilon_prime), rng)? > theta_hat)
}

/// Counts are compared on an integer grid of step 2^-[`COUNT_GRID_BITS`] count units (see
/// [`ExactPrefixTest`]).
pub const COUNT_GRID_BITS: u32 = 16;

/// The sparse vector test of Algorithms 1-2 with exact noise: every number it compares is an
/// integer and every noise draw is a discrete Laplace sample drawn with integer arithmetic only
/// ([`super::discrete_gaussian::discrete_laplace`], CKS20 Algorithm 2 over exact Bernoulli
/// samplers). A floating-point Laplace sampler leaves gaps in its output that can reveal the
/// exact count (Mironov 2012); this one has none.
///
/// # The grid and the sensitivity
/// A client's summed answer `c` (a real count in `[0, hosted]`) enters as
/// `floor(min(c, hosted) * 2^k)` grid units, `k = COUNT_GRID_BITS` (exact in f64: a product by
/// a power of two and a floor); the aggregator sums the clients' integers in i128. One expert
/// moves its client's real count by at most 1 (a probability), plus the client's floating-point
/// rounding of the sum, below `hosted x 2^-52` and so far below one grid step `2^-k` for any
/// population this project runs; clamping to `[0, hosted]` is 1-Lipschitz. Since
/// `|floor(a) - floor(b)| <= ceil(|a - b|)`, the integer count moves by at most
/// `Delta = 2^k + 1` grid units ([`Self::sensitivity`]).
///
/// # The noise and why the proof carries over
/// The threshold `theta^ = theta + (4/epsilon') ln(1/delta')` enters as `ceil(theta^ 2^k)`
/// (a public, data-independent rounding) plus `DLap(t_thr)`, and each prefix query adds
/// `DLap(t_q)`, where `DLap(t)` has probability proportional to `exp(-|x| / t)` on the integers,
/// `t_thr = ceil(2 Delta / epsilon')` and `t_q = ceil(4 Delta / epsilon')` (each with a relative
/// margin of 1e-9 against the rounding of the division, so that `t >= 2 Delta / epsilon'` holds
/// for the exact rational value). The privacy proof of AboveThreshold (Dwork & Roth 2014,
/// Theorem 3.23, on which seed 002's Theorem 5.3 builds) uses only two facts about the noise:
/// its probability ratio under a shift by `c` is at most `exp(|c| / t)`, and a shift of the
/// threshold noise by `Delta` and of the query noise by `2 Delta` maps the accepting set of one
/// dataset into the other's. Both hold for the discrete Laplace on the integers when the
/// queries, the threshold and `Delta` are integers (the change of variables is a bijection of Z,
/// sums replace integrals). So each pass stays `2 epsilon'` plus the paper's delta, with
/// `Delta` in grid units: no slack is added to delta. The grid's rounding is in `Delta` (the
/// `+ 1`), and the integer threshold `ceil(theta^ 2^k)` only raises the bar (the stability
/// argument of Lemma 5.1 needs counts above theta, never below).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExactPrefixTest {
    /// ceil((theta + (4/epsilon') ln(1/delta')) 2^k): the threshold before its noise.
    threshold: i128,
    /// Scale of the threshold's discrete Laplace noise (grid units).
    threshold_scale: u128,
    /// Scale of each query's discrete Laplace noise (grid units).
    query_scale: u128,
}

impl ExactPrefixTest {
    /// The integer test for `params`.
    pub fn new(params: &ReleaseParameters) -> Result<Self, PrivacyError> {
        let offset = params.theta_hat_offset;
        let eps = params.epsilon_prime;
        if !(offset.is_finite() && eps.is_finite() && eps > 0.0) {
            return Err(PrivacyError::InvalidParameter(format!(
                "an exact prefix test needs a finite threshold and epsilon' > 0, got ({offset}, {eps})"
            )));
        }
        let grid = (1u64 << COUNT_GRID_BITS) as f64;
        let threshold = (offset * grid).ceil();
        let delta = Self::sensitivity() as f64;
        // ceil with a relative margin: the f64 division may round the exact quotient down.
        let scale = |mult: f64| -> Result<u128, PrivacyError> {
            let t = (mult * delta / eps * (1.0 + 1e-9)).ceil();
            if !(t.is_finite() && t >= 1.0 && t < 2f64.powi(100)) {
                return Err(PrivacyError::InvalidParameter(format!(
                    "epsilon' = {eps} gives a discrete Laplace scale of {t} grid units, outside the sampler's range"
                )));
            }
            Ok(t as u128)
        };
        if threshold.abs() >= 2f64.powi(100) {
            return Err(PrivacyError::InvalidParameter(format!(
                "the threshold {offset} is too large for the count grid"
            )));
        }
        Ok(Self {
            threshold: threshold as i128,
            threshold_scale: scale(2.0)?,
            query_scale: scale(4.0)?,
        })
    }

    /// Delta: how far one expert can move the integer count (grid units), `2^k + 1`.
    pub fn sensitivity() -> u128 {
        (1u128 << COUNT_GRID_BITS) + 1
    }

    /// One client's summed answer on the grid: `floor(min(count, hosted) 2^k)`. `None` for a
    /// count that is negative or not finite (refused before it gets here).
    pub fn count_on_grid(count: f64, hosted: u64) -> Option<i128> {
        if !(count.is_finite() && count >= 0.0) {
            return None;
        }
        let c = count.min(hosted as f64) * (1u64 << COUNT_GRID_BITS) as f64;
        Some(c.floor() as i128)
    }

    /// The threshold before its noise (grid units).
    pub fn threshold(&self) -> i128 {
        self.threshold
    }

    /// (threshold noise scale, query noise scale), grid units.
    pub fn scales(&self) -> (u128, u128) {
        (self.threshold_scale, self.query_scale)
    }

    /// theta^ for one candidate trajectory (Algorithm 2, line 7): the threshold plus its
    /// discrete Laplace noise, drawn once per trajectory.
    pub fn noisy_threshold<R: rand::Rng + ?Sized>(
        &self,
        rng: &mut R,
    ) -> Result<i128, PrivacyError> {
        let z = super::discrete_gaussian::discrete_laplace(rng, self.threshold_scale)
            .map_err(|e| PrivacyError::InvalidParameter(e.to_string()))?;
        Ok(self.threshold + z)
    }

    /// PrefixQuery (Algorithm 1) on the grid: "stable" when the summed count plus its discrete
    /// Laplace noise exceeds `noisy_threshold`.
    pub fn passes<R: rand::Rng + ?Sized>(
        &self,
        count: i128,
        noisy_threshold: i128,
        rng: &mut R,
    ) -> Result<bool, PrivacyError> {
        let z = super::discrete_gaussian::discrete_laplace(rng, self.query_scale)
            .map_err(|e| PrivacyError::InvalidParameter(e.to_string()))?;
        Ok(count + z > noisy_threshold)
    }
}

/// All parameters of one DataRelease run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReleaseParameters {
    /// epsilon' (nats).
    pub epsilon_prime: f64,
    /// delta'.
    pub delta_prime: f64,
    /// c_min (expected number of experts).
    pub c_min: f64,
    /// theta = c_min / p_min.
    pub theta: f64,
    /// theta + (4/epsilon') ln(1/delta'), before the per-trajectory Laplace noise.
    pub theta_hat_offset: f64,
    /// T: the number of trajectories the release examines (each costs one pass).
    pub trajectories: u64,
    /// L: the accounting horizon, the longest trajectory the release may walk (steps).
    pub horizon: u64,
}

impl ReleaseParameters {
    /// The parameters for budget (`epsilon_1`, `delta_1`), minimum action probability `p_min`,
    /// `trajectories` examined (T) of length `horizon` (L).
    pub fn new(
        epsilon_1: f64,
        delta_1: f64,
        p_min: f64,
        trajectories: u64,
        horizon: u64,
    ) -> Result<Self, PrivacyError> {
        let epsilon_prime = epsilon_prime(epsilon_1, delta_1, trajectories)?;
        Self::with_epsilon_prime(epsilon_prime, delta_1, p_min, trajectories, horizon)
    }

    /// The parameters for a given per-query budget `epsilon_prime` (e.g. from
    /// [`calibrated_epsilon_prime`]) and delta_1, `p_min`, T and L as in [`Self::new`].
    pub fn with_epsilon_prime(
        epsilon_prime: f64,
        delta_1: f64,
        p_min: f64,
        trajectories: u64,
        horizon: u64,
    ) -> Result<Self, PrivacyError> {
        let delta_prime = delta_prime(delta_1, trajectories, horizon)?;
        let c_min = c_min(epsilon_prime)?;
        let theta = theta(c_min, p_min)?;
        let theta_hat_offset = theta_hat_offset(theta, epsilon_prime, delta_prime)?;
        Ok(Self {
            epsilon_prime,
            delta_prime,
            c_min,
            theta,
            theta_hat_offset,
            trajectories,
            horizon,
        })
    }
}

/// Algorithm 2, lines 7-16, for one candidate trajectory as the coordinator runs it: draws
/// theta^ (line 7), then runs PrefixQuery on the prefix counts h = 1, 2, ... in order, and
/// returns the number k of leading steps released: `counts.len()` when every prefix passes
/// (lines 11-12: the trajectory is released whole), otherwise the length of the prefix before
/// the first failing query (lines 13-16; 0 when the first query fails, nothing is released).
///
/// `counts[h-1]` is the count of the prefix of length h: the sum over all experts of the
/// probability that the expert takes the prefix's actions in its states (sensitivity 1 per
/// expert). A trajectory shorter than the horizon L is walked over its own length; L stays the
/// accounting horizon (delta' = delta_1 / (2 T L) already covers L queries). Releasing such a
/// trajectory whole when all its prefixes pass is the paper's k = L case of Lemma 5.4: an
/// episode that ended has no longer extension, so the released prefix is the whole event
/// E_tau. (Candidates must be drawn at random from the experts' demonstrations, Algorithm 2
/// line 4, and which ones were examined stays secret.) Noise comes from
/// `rng` (the aggregator's CSPRNG): theta^'s Laplace draw first, then one draw per query, and no
/// draw after the first failure.
///
/// This is the floating-point reference of the walk (tests compare against it); the
/// aggregator runs the integer version, [`ExactPrefixTest`], whose noise has no gaps.
///
/// Refuses (`InvalidAnswer`) an empty walk, one longer than L, and counts that are negative or
/// not finite (a NaN would silently fail every comparison); answers should have passed
/// [`super::expert_answers::check_prefix_counts`] before they were summed.
pub fn stable_prefix<R: Rng + ?Sized>(
    counts: &[f64],
    params: &ReleaseParameters,
    rng: &mut R,
) -> Result<usize, PrivacyError> {
    let len = counts.len();
    if len == 0 || len as u64 > params.horizon {
        return Err(PrivacyError::InvalidAnswer(format!(
            "a release walks 1 to L = {} prefix counts, got {len}",
            params.horizon
        )));
    }
    if let Some((i, c)) = counts
        .iter()
        .enumerate()
        .find(|(_, c)| !(c.is_finite() && **c >= 0.0))
    {
        return Err(PrivacyError::InvalidAnswer(format!(
            "prefix count of length {} is {c}: counts must be finite and >= 0",
            i + 1
        )));
    }
    let threshold = theta_hat(params.theta, params.epsilon_prime, params.delta_prime, rng)?;
    for (i, &count) in counts.iter().enumerate() {
        if !prefix_query(count, threshold, params.epsilon_prime, rng)? {
            return Ok(i);
        }
    }
    Ok(len)
}

/// The longest prefix (in steps, at most L) that can pass the noise-free threshold
/// theta + (4/epsilon') ln(1/delta') when `experts` experts (m) choose among `n_actions` actions
/// (|A|) with every action at least `p_min` likely (Assumption 3): a prefix of length h has
/// count at most m (1 - (|A|-1) p_min)^h, since each step's action has probability at most
/// 1 - (|A|-1) p_min for every expert. So over T trajectories the release holds at most about
/// T x this many transitions. The Laplace noise on theta^ and on each count can move the real
/// bound a few steps either way (it is the noise-free crossing, not a hard cap). 0 when even
/// the empty prefix's count m is below the offset.
pub fn max_stable_prefix(
    experts: u64,
    n_actions: u64,
    p_min: f64,
    params: &ReleaseParameters,
) -> Result<u64, PrivacyError> {
    // p_min = 1/|A| is the uniform policy (every count is m |A|^-h): allowed.
    if n_actions < 2 || !(p_min > 0.0 && p_min * (n_actions as f64) <= 1.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "need |A| >= 2 and p_min in (0, 1/|A|], got |A| = {n_actions}, p_min = {p_min}"
        )));
    }
    let top = 1.0 - (n_actions - 1) as f64 * p_min;
    let m = experts as f64;
    if m <= params.theta_hat_offset {
        return Ok(0);
    }
    // m top^h > offset  <=>  h < ln(m / offset) / ln(1/top).
    let crossing = (m / params.theta_hat_offset).ln() / (-top.ln());
    let mut h = crossing.floor();
    if h == crossing {
        // The count must exceed the offset strictly.
        h -= 1.0;
    }
    Ok((h.max(0.0) as u64).min(params.horizon))
}

/// Theorem 5.3: the guarantee of one trajectory's pass, (2 epsilon', delta_1 / (2T)).
pub fn per_trajectory_guarantee(
    epsilon_1: f64,
    delta_1: f64,
    trajectories: u64,
) -> Result<(f64, f64), PrivacyError> {
    Ok(pass_guarantee(
        epsilon_prime(epsilon_1, delta_1, trajectories)?,
        delta_1,
        trajectories,
    ))
}

/// Theorem 5.3 at per-query budget `epsilon_prime`: one pass is (2 epsilon', delta_1/(2T))-DP.
fn pass_guarantee(epsilon_prime: f64, delta_1: f64, trajectories: u64) -> (f64, f64) {
    (2.0 * epsilon_prime, delta_1 / (2.0 * trajectories as f64))
}

/// The guarantee of the whole release by advanced composition of the T passes with slack
/// delta_1/2, evaluated exactly: delta is delta_1, epsilon is at most epsilon_1 when
/// epsilon_1 <= 1 (Theorem 5.5) and may exceed it above.
pub fn release_guarantee(
    epsilon_1: f64,
    delta_1: f64,
    trajectories: u64,
) -> Result<(f64, f64), PrivacyError> {
    let (e, d) = per_trajectory_guarantee(epsilon_1, delta_1, trajectories)?;
    composition::advanced(e, d, trajectories, delta_1 / 2.0)
}

/// The release as an accounting event: T passes, each (2 epsilon', delta_1/(2T))-DP. The PLD
/// accountant composes it more tightly than advanced composition.
pub fn release_event(
    epsilon_1: f64,
    delta_1: f64,
    trajectories: u64,
) -> Result<DpEvent, PrivacyError> {
    passes_event(
        epsilon_prime(epsilon_1, delta_1, trajectories)?,
        delta_1,
        trajectories,
    )
}

/// The release of per-query budget `epsilon_prime` as an accounting event: T passes, each
/// (2 epsilon', delta_1/(2T))-DP (Theorem 5.3).
pub fn passes_event(
    epsilon_prime: f64,
    delta_1: f64,
    trajectories: u64,
) -> Result<DpEvent, PrivacyError> {
    check("epsilon'", epsilon_prime, delta_1, trajectories)?;
    let (epsilon, delta) = pass_guarantee(epsilon_prime, delta_1, trajectories);
    Ok(DpEvent::SelfComposed {
        event: Box::new(DpEvent::EpsilonDelta { epsilon, delta }),
        count: trajectories,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formulas_follow_algorithm_2() {
        let p = ReleaseParameters::new(1.0, 1e-5, 0.02, 100, 50).unwrap_or_else(|e| panic!("{e}"));
        let eps = 1.0 / (3200.0 * (2e5_f64).ln()).sqrt();
        assert!((p.epsilon_prime - eps).abs() < 1e-15);
        assert!((p.delta_prime - 1e-5 / 10_000.0).abs() < 1e-20);
        assert!((p.c_min - eps.exp() / (eps.exp() - 1.0)).abs() < 1e-9 * p.c_min);
        assert!((p.theta - p.c_min / 0.02).abs() < 1e-9 * p.theta);
        assert!(
            (p.theta_hat_offset - (p.theta + 4.0 / eps * (1.0 / p.delta_prime).ln())).abs()
                < 1e-9 * p.theta_hat_offset
        );
    }

    #[test]
    fn the_exact_test_works_on_integers_with_the_stated_scales() {
        use rand::SeedableRng;
        let p = ReleaseParameters::new(10.0, 1e-3, 0.05, 25, 200).unwrap_or_else(|e| panic!("{e}"));
        let t = ExactPrefixTest::new(&p).unwrap_or_else(|e| panic!("{e}"));
        let grid = (1u64 << COUNT_GRID_BITS) as f64;
        let delta = ExactPrefixTest::sensitivity() as f64;
        let (tt, tq) = t.scales();
        // At least 2 Delta / epsilon' and 4 Delta / epsilon', and not much more.
        assert!(tt as f64 * p.epsilon_prime >= 2.0 * delta);
        assert!(tq as f64 * p.epsilon_prime >= 4.0 * delta);
        assert!((tq as f64 * p.epsilon_prime) < 4.0 * delta + 2.0 * p.epsilon_prime);
        assert_eq!(t.threshold(), (p.theta_hat_offset * grid).ceil() as i128);
        // Grid counts: floored, clamped to the client's experts, refused when not a count.
        assert_eq!(
            ExactPrefixTest::count_on_grid(1.5, 3),
            Some((1.5 * grid) as i128)
        );
        assert_eq!(
            ExactPrefixTest::count_on_grid(7.0, 3),
            Some((3.0 * grid) as i128)
        );
        assert_eq!(ExactPrefixTest::count_on_grid(f64::NAN, 3), None);
        assert_eq!(ExactPrefixTest::count_on_grid(-1e-9, 3), None);
        // The noise is the discrete Laplace of the stated scale: integer, mean |x| near t.
        let mut rng = rand::rngs::ChaCha20Rng::seed_from_u64(1);
        let n = 4000;
        let mut abs = 0.0;
        for _ in 0..n {
            abs += (t.noisy_threshold(&mut rng).unwrap_or(0) - t.threshold()).abs() as f64;
        }
        let mean = abs / n as f64;
        assert!(
            (mean / tt as f64 - 1.0).abs() < 0.1,
            "E|Z| = {mean}, t = {tt}"
        );
        // Far above the threshold a count passes, far below it fails.
        let far = (t.threshold_scale as i128) * 60;
        assert!(
            t.passes(t.threshold() + far, t.threshold(), &mut rng)
                .unwrap_or(false)
        );
        assert!(
            !t.passes(t.threshold() - far, t.threshold(), &mut rng)
                .unwrap_or(true)
        );
    }

    #[test]
    fn the_exact_test_passes_as_often_as_the_float_reference() {
        use rand::SeedableRng;
        let p = ReleaseParameters::new(10.0, 1e-3, 0.05, 25, 200).unwrap_or_else(|e| panic!("{e}"));
        let t = ExactPrefixTest::new(&p).unwrap_or_else(|e| panic!("{e}"));
        let b = query_noise_scale(p.epsilon_prime);
        let mut rng = rand::rngs::ChaCha20Rng::seed_from_u64(5);
        let n = 6000;
        for x in [-2.0, 0.0, 2.0] {
            let count = p.theta_hat_offset + x * b;
            let grid = ExactPrefixTest::count_on_grid(count, 1_000_000).unwrap_or(0);
            let exact = (0..n)
                .filter(|_| {
                    let thr = t.noisy_threshold(&mut rng).unwrap_or(i128::MAX);
                    t.passes(grid, thr, &mut rng).unwrap_or(false)
                })
                .count() as f64
                / n as f64;
            let float = (0..n)
                .filter(|_| stable_prefix(&[count], &p, &mut rng).unwrap_or(0) == 1)
                .count() as f64
                / n as f64;
            assert!((exact - float).abs() < 0.03, "x = {x}: {exact} vs {float}");
        }
    }

    #[test]
    fn theorem_5_5_holds_for_epsilon_at_most_one() {
        for t in [1, 10, 1000] {
            let (e, d) = release_guarantee(1.0, 1e-5, t).unwrap_or((f64::NAN, 0.0));
            assert!(e <= 1.0 && (d - 1e-5).abs() < 1e-18, "T={t}: ({e}, {d})");
        }
    }
}
