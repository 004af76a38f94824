//! The accountants behind one interface: epsilon of any [`DpEvent`], and the noise multiplier
//! that meets a target. PLD ([`super::pld`]) gives the reported figure; RDP ([`super::rdp`]) is
//! the cross-check (it is always a little larger).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::params::{Delta, SamplingRate};
use super::pld::{DEFAULT_DISCRETIZATION, PrivacyLossDistribution};
use super::rdp::RdpAccountant;
use super::{DpEvent, PrivacyError, gaussian};

/// Which accountant turns events into (epsilon, delta).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AccountantKind {
    /// Privacy loss distributions, pessimistic connect-the-dots at 1e-4 nats (the reported
    /// figure; tight up to the discretisation).
    #[default]
    Pld,
    /// Rényi DP at dp_accounting's default orders with the improved conversion (an upper bound,
    /// looser than PLD).
    Rdp,
}

impl fmt::Display for AccountantKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AccountantKind::Pld => "pld",
            AccountantKind::Rdp => "rdp",
        })
    }
}

impl FromStr for AccountantKind {
    type Err = PrivacyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "pld" => Ok(AccountantKind::Pld),
            "rdp" => Ok(AccountantKind::Rdp),
            other => Err(PrivacyError::InvalidParameter(format!(
                "unknown accountant {other:?} (expected \"pld\" or \"rdp\")"
            ))),
        }
    }
}

fn check_delta(delta: f64) -> Result<(), PrivacyError> {
    if !(0.0..1.0).contains(&delta) {
        return Err(PrivacyError::InvalidParameter(format!(
            "delta must be in [0, 1), got {delta}"
        )));
    }
    Ok(())
}

/// Smallest epsilon (nats) such that `event` is (epsilon, `delta`)-DP under the add-or-remove-one
/// relation, as computed by accountant `kind`; +inf when the event contains a non-private part.
///
/// Handles Gaussian, Laplace, Poisson-sampled Gaussian (and Laplace, PLD only), pure-DP
/// EpsilonDelta (RDP) or any EpsilonDelta (PLD), and any self-composition or heterogeneous
/// composition of them.
pub fn epsilon(event: &DpEvent, delta: f64, kind: AccountantKind) -> Result<f64, PrivacyError> {
    check_delta(delta)?;
    match kind {
        AccountantKind::Pld => Ok(
            match PrivacyLossDistribution::from_event(event, DEFAULT_DISCRETIZATION)? {
                Some(pld) => pld.epsilon_for_delta(delta),
                None => f64::INFINITY,
            },
        ),
        AccountantKind::Rdp => {
            let mut acc = RdpAccountant::default();
            acc.compose(event, 1)?;
            acc.epsilon(delta)
        }
    }
}

/// Delta at which `event` is (`epsilon`, delta)-DP (epsilon in nats), as computed by `kind`;
/// 1 when the event contains a non-private part.
pub fn delta(event: &DpEvent, epsilon: f64, kind: AccountantKind) -> Result<f64, PrivacyError> {
    if epsilon.is_nan() || epsilon < 0.0 {
        return Err(PrivacyError::InvalidParameter(format!(
            "epsilon must be non-negative, got {epsilon}"
        )));
    }
    match kind {
        AccountantKind::Pld => Ok(
            match PrivacyLossDistribution::from_event(event, DEFAULT_DISCRETIZATION)? {
                Some(pld) => pld.delta_for_epsilon(epsilon).clamp(0.0, 1.0),
                None => 1.0,
            },
        ),
        AccountantKind::Rdp => {
            let mut acc = RdpAccountant::default();
            acc.compose(event, 1)?;
            acc.delta(epsilon)
        }
    }
}

/// The event of `steps` rounds of a Gaussian mechanism with noise multiplier `z` on Poisson
/// samples of rate `sampling_rate` (DP-SGD / DP-FedAvg).
pub fn sampled_gaussian_rounds(noise_multiplier: f64, sampling_rate: f64, steps: u64) -> DpEvent {
    DpEvent::SelfComposed {
        event: Box::new(DpEvent::PoissonSampled {
            sampling_rate,
            event: Box::new(DpEvent::Gaussian { noise_multiplier }),
        }),
        count: steps,
    }
}

/// How [`unit_epsilon`] computed a figure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// No event: epsilon 0.
    None,
    /// Every event is an un-sampled (discrete) Gaussian: one Gaussian with
    /// 1/sigma^2 = sum 1/z_i^2, accounted exactly (analytic Gaussian, Balle & Wang 2018).
    AnalyticGaussian,
    /// Privacy loss distributions ([`AccountantKind::Pld`]).
    Pld,
    /// Rényi DP ([`AccountantKind::Rdp`]).
    Rdp,
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Method::None => "none",
            Method::AnalyticGaussian => "analytic_gaussian",
            Method::Pld => "pld",
            Method::Rdp => "rdp",
        })
    }
}

/// The noise multiplier of one Gaussian equivalent to `event` when it is an un-sampled
/// (discrete) Gaussian or a composition of them; sampling at rate 1 is no sampling. `None` for
/// anything else.
fn plain_gaussian(event: &DpEvent) -> Option<f64> {
    match event {
        DpEvent::Gaussian { .. } | DpEvent::DiscreteGaussian { .. } => {
            event.gaussian_noise_multiplier()
        }
        DpEvent::PoissonSampled {
            sampling_rate,
            event,
        } if *sampling_rate == 1.0 => plain_gaussian(event),
        DpEvent::SelfComposed { event, count } => {
            Some(plain_gaussian(event)? / (*count as f64).sqrt())
        }
        DpEvent::Composed { events } => {
            let mut inv_var = 0.0;
            for e in events {
                inv_var += plain_gaussian(e)?.powi(-2);
            }
            Some(inv_var.powf(-0.5))
        }
        _ => None,
    }
}

/// Groups identical events (`==`) into (event, count) pairs, in order of first appearance: the
/// canonical form [`unit_epsilon`] accounts.
pub fn group_counts(events: &[DpEvent]) -> Vec<(&DpEvent, u64)> {
    let mut counts: Vec<(&DpEvent, u64)> = Vec::new();
    for e in events {
        match counts.iter_mut().find(|(g, _)| *g == e) {
            Some((_, n)) => *n += 1,
            None => counts.push((e, 1)),
        }
    }
    counts
}

/// The event tree of grouped events: each group a self-composition (a lone event as itself),
/// several groups composed.
fn composed(groups: &[(&DpEvent, u64)]) -> DpEvent {
    let mut parts: Vec<DpEvent> = groups
        .iter()
        .map(|&(e, n)| {
            if n == 1 {
                e.clone()
            } else {
                DpEvent::SelfComposed {
                    event: Box::new(e.clone()),
                    count: n,
                }
            }
        })
        .collect();
    if parts.len() == 1 {
        parts.remove(0)
    } else {
        DpEvent::Composed { events: parts }
    }
}

/// Groups identical events into self-compositions, in order of first appearance, so the
/// accountants compose each group by fast self-composition instead of one event at a time.
pub fn grouped(events: &[DpEvent]) -> DpEvent {
    composed(&group_counts(events))
}

/// The one accounting policy of fedrl: epsilon (nats) at `delta` of everything one unit was
/// charged with (`events`, composed adaptively), and how it was computed. The ledger calls it for
/// every unit, and `noise_multiplier = "auto"` calls it with the planned events of one unit.
///
/// With [`AccountantKind::Pld`] (the reported figure) it gives the tightest valid bound this
/// crate has: when every event is an un-sampled (discrete) Gaussian, the exact analytic Gaussian
/// of their composition (1/sigma^2 adds up, Dong-Roth-Su's Gaussian composition); otherwise the
/// PLD of all events (Gaussian, discrete Gaussian, Laplace, (epsilon, delta) and Poisson-sampled
/// Gaussian or Laplace events). With [`AccountantKind::Rdp`], the RDP bound (the cross-check;
/// `Unsupported` for an (epsilon, delta) event with delta > 0 or a sampled Laplace).
/// +inf when an event is non-private (e.g. z = 0).
///
/// It is [`unit_epsilon_grouped`] of [`group_counts`]`(events)`: the figure depends only on the
/// grouped form, so a caller that keeps its history grouped (the ledger) gets the same bits.
pub fn unit_epsilon(
    events: &[DpEvent],
    delta: Delta,
    kind: AccountantKind,
) -> Result<(f64, Method), PrivacyError> {
    unit_epsilon_grouped(&group_counts(events), delta, kind)
}

/// [`unit_epsilon`] of a history already grouped: `groups` holds distinct events with how many
/// times each was charged (counts >= 1), in order of first appearance.
pub fn unit_epsilon_grouped(
    groups: &[(&DpEvent, u64)],
    delta: Delta,
    kind: AccountantKind,
) -> Result<(f64, Method), PrivacyError> {
    if groups.is_empty() {
        return Ok((0.0, Method::None));
    }
    if let Some(&(e, _)) = groups.iter().find(|(_, n)| *n == 0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "a grouped history counts {e} zero times"
        )));
    }
    let delta = delta.get();
    match kind {
        AccountantKind::Pld => {
            // 1/sigma^2 of the composition: count x 1/z^2 per group (one rounding per group,
            // whatever the count).
            let mut inv_var = 0.0;
            let mut all_gaussian = true;
            for &(e, n) in groups {
                match plain_gaussian(e) {
                    Some(z) => inv_var += n as f64 * z.powi(-2),
                    None => all_gaussian = false,
                }
            }
            if all_gaussian {
                if inv_var.is_infinite() {
                    return Ok((f64::INFINITY, Method::AnalyticGaussian));
                }
                let sigma = inv_var.powf(-0.5);
                return Ok((gaussian::epsilon(sigma, delta)?, Method::AnalyticGaussian));
            }
            Ok((epsilon(&composed(groups), delta, kind)?, Method::Pld))
        }
        AccountantKind::Rdp => Ok((epsilon(&composed(groups), delta, kind)?, Method::Rdp)),
    }
}

/// Relative tolerance of [`noise_multiplier`] on z.
pub const NOISE_RELATIVE_TOLERANCE: f64 = 1e-6;
/// Largest noise multiplier [`noise_multiplier`] considers.
pub const MAX_NOISE_MULTIPLIER: f64 = 1e6;

/// Smallest noise multiplier z (noise std / L2 sensitivity), to relative tolerance
/// [`NOISE_RELATIVE_TOLERANCE`], such that `steps` Poisson-sampled Gaussian rounds at rate
/// `sampling_rate` are (`target_epsilon`, `delta`)-DP by accountant `kind`. The returned z always
/// meets the target (bisection keeps the feasible end). `NoSolution` when even
/// [`MAX_NOISE_MULTIPLIER`] does not.
pub fn noise_multiplier(
    target_epsilon: f64,
    delta: f64,
    sampling_rate: f64,
    steps: u64,
    kind: AccountantKind,
) -> Result<f64, PrivacyError> {
    if !(target_epsilon.is_finite() && target_epsilon > 0.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "target epsilon must be positive and finite, got {target_epsilon}"
        )));
    }
    Delta::try_from(delta)?;
    SamplingRate::try_from(sampling_rate)?;
    if steps == 0 {
        return Err(PrivacyError::InvalidParameter(
            "steps must be at least 1".into(),
        ));
    }
    // The gap eps(z) - target; too little noise can make the PLD grid exceed its limit, and that
    // z is then far from meeting the target: +inf.
    let gap = |z: f64| -> Result<f64, PrivacyError> {
        match epsilon(
            &sampled_gaussian_rounds(z, sampling_rate, steps),
            delta,
            kind,
        ) {
            Ok(e) => Ok(e - target_epsilon),
            Err(PrivacyError::Unsupported(_)) if kind == AccountantKind::Pld => Ok(f64::INFINITY),
            Err(e) => Err(e),
        }
    };
    // PLD starts from the RDP answer (cheap, and PLD is tighter, so it is feasible or nearly
    // so), which also spares PLD the huge grids of tiny noise levels; RDP starts from z = 1.
    let (start, factor) = match kind {
        AccountantKind::Pld => {
            match noise_multiplier(
                target_epsilon,
                delta,
                sampling_rate,
                steps,
                AccountantKind::Rdp,
            ) {
                Ok(z) => (z, 0.8),
                Err(_) => (1.0, 0.5),
            }
        }
        AccountantKind::Rdp => (1.0, 0.5),
    };
    smallest_noise_multiplier(gap, start, factor).map_err(|e| match e {
        PrivacyError::NoSolution(_) => PrivacyError::NoSolution(format!(
            "no noise multiplier up to {MAX_NOISE_MULTIPLIER} reaches epsilon {target_epsilon} \
             at delta {delta} over {steps} steps at rate {sampling_rate}"
        )),
        other => other,
    })
}

/// The search behind [`noise_multiplier`], for any plan: the smallest z in (0,
/// [`MAX_NOISE_MULTIPLIER`]], to relative tolerance [`NOISE_RELATIVE_TOLERANCE`], with
/// `gap(z) <= 0`, where `gap(z)` is epsilon(z) - target (non-increasing in z; +inf where the
/// accountant cannot account z, which is then treated as infeasible). The search starts at
/// `start` and walks down by `factor` in (0, 1) or up by 2 to bracket the answer. The returned z
/// always has `gap(z) <= 0` (the bracket keeps its feasible end). `NoSolution` when even
/// [`MAX_NOISE_MULTIPLIER`] is infeasible.
pub(crate) fn smallest_noise_multiplier(
    mut gap: impl FnMut(f64) -> Result<f64, PrivacyError>,
    start: f64,
    factor: f64,
) -> Result<f64, PrivacyError> {
    if !(start.is_finite() && start > 0.0 && factor > 0.0 && factor < 1.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "noise search needs a positive start and a factor in (0, 1), got ({start}, {factor})"
        )));
    }
    // Bracket [lo, hi] with lo infeasible (gap > 0) and hi feasible (gap <= 0).
    let (mut lo, mut hi, mut g_lo, mut g_hi);
    let g_start = gap(start)?;
    if g_start <= 0.0 {
        (hi, g_hi) = (start, g_start);
        lo = start * factor;
        g_lo = gap(lo)?;
        while g_lo <= 0.0 {
            (hi, g_hi) = (lo, g_lo);
            lo *= factor;
            if lo < 1e-6 {
                return Ok(hi);
            }
            g_lo = gap(lo)?;
        }
    } else {
        (lo, g_lo) = (start, g_start);
        hi = start * 2.0;
        g_hi = gap(hi)?;
        while g_hi > 0.0 {
            (lo, g_lo) = (hi, g_hi);
            hi *= 2.0;
            if hi > MAX_NOISE_MULTIPLIER {
                return Err(PrivacyError::NoSolution(format!(
                    "no noise multiplier up to {MAX_NOISE_MULTIPLIER} meets the target"
                )));
            }
            g_hi = gap(hi)?;
        }
    }
    // Shrink the bracket on log z by regula falsi with the Illinois correction (epsilon is
    // smooth in z, so this converges in a handful of steps), bisecting every third step and
    // whenever interpolation is impossible; `hi` stays feasible throughout.
    let mut kept = 0i8;
    let mut step = 0u32;
    while hi - lo > NOISE_RELATIVE_TOLERANCE * hi {
        step += 1;
        let (a, b) = (lo.ln(), hi.ln());
        let mut x = 0.5 * (a + b);
        if !step.is_multiple_of(3) && g_lo.is_finite() && g_lo > g_hi {
            let interpolated = b - g_hi * (b - a) / (g_hi - g_lo);
            if interpolated > a && interpolated < b {
                x = interpolated;
            }
        }
        let z = x.exp();
        if z <= lo || z >= hi {
            break;
        }
        let g = gap(z)?;
        if g <= 0.0 {
            (hi, g_hi) = (z, g);
            if kept == -1 {
                g_lo *= 0.5;
            }
            kept = -1;
        } else {
            (lo, g_lo) = (z, g);
            if kept == 1 {
                g_hi *= 0.5;
            }
            kept = 1;
        }
    }
    Ok(hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_round_trips_through_strings_and_serde() {
        for k in [AccountantKind::Pld, AccountantKind::Rdp] {
            assert_eq!(k.to_string().parse::<AccountantKind>().ok(), Some(k));
            let json = serde_json::to_string(&k).unwrap_or_default();
            assert_eq!(json, format!("\"{k}\""));
        }
        assert!("moments".parse::<AccountantKind>().is_err());
    }
}
