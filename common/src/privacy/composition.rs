//! Composition theorems for (epsilon, delta)-DP mechanisms accounted by their parameters alone
//! (epsilons in nats). For Gaussian and subsampled mechanisms use the accountants instead: they
//! are much tighter.
//!
//! - Basic composition: epsilons and deltas add.
//! - Advanced composition (Dwork, Rothblum & Vadhan 2010; Dwork & Roth 2014, Theorem 3.20):
//!   k adaptive runs of an (epsilon, delta)-DP mechanism are
//!   (sqrt(2k ln(1/delta')) epsilon + k epsilon (e^epsilon - 1), k delta + delta')-DP
//!   for any slack delta' > 0.

use super::PrivacyError;

fn check_eps_delta(epsilon: f64, delta: f64) -> Result<(), PrivacyError> {
    let valid = epsilon.is_finite() && epsilon >= 0.0 && (0.0..=1.0).contains(&delta);
    if !valid {
        return Err(PrivacyError::InvalidParameter(format!(
            "need finite epsilon >= 0 and delta in [0, 1], got ({epsilon}, {delta})"
        )));
    }
    Ok(())
}

/// Basic composition of mechanisms with guarantees `parts` (epsilon, delta): (sum eps, sum delta),
/// delta capped at 1.
pub fn basic(parts: &[(f64, f64)]) -> Result<(f64, f64), PrivacyError> {
    let mut total = (0.0, 0.0);
    for &(e, d) in parts {
        check_eps_delta(e, d)?;
        total.0 += e;
        total.1 += d;
    }
    Ok((total.0, total.1.min(1.0)))
}

/// Advanced composition: the (epsilon, delta) guarantee of `k` adaptive runs of an
/// (`epsilon`, `delta`)-DP mechanism with slack `delta_slack` in (0, 1). Never worse than basic
/// composition is not guaranteed by the theorem; use [`best`] for the minimum of both.
pub fn advanced(
    epsilon: f64,
    delta: f64,
    k: u64,
    delta_slack: f64,
) -> Result<(f64, f64), PrivacyError> {
    check_eps_delta(epsilon, delta)?;
    if !(delta_slack > 0.0 && delta_slack < 1.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "delta slack must be in (0, 1), got {delta_slack}"
        )));
    }
    let kf = k as f64;
    let eps =
        (2.0 * kf * (1.0 / delta_slack).ln()).sqrt() * epsilon + kf * epsilon * epsilon.exp_m1();
    Ok((eps, (kf * delta + delta_slack).min(1.0)))
}

/// The better (smaller epsilon) of basic and advanced composition for `k` runs; the advanced
/// bound pays `delta_slack` extra delta, the basic one does not.
pub fn best(
    epsilon: f64,
    delta: f64,
    k: u64,
    delta_slack: f64,
) -> Result<(f64, f64), PrivacyError> {
    let adv = advanced(epsilon, delta, k, delta_slack)?;
    let kf = k as f64;
    let basic = (kf * epsilon, (kf * delta).min(1.0));
    Ok(if adv.0 < basic.0 { adv } else { basic })
}

/// The per-run epsilon of Dwork & Roth's Corollary 3.21: target / (2 sqrt(2k ln(1/delta_slack))).
/// With it, k runs are (target, k delta + delta_slack)-DP **when target <= 1**; for larger targets
/// check the result with [`advanced`] (or use [`per_run_epsilon`]).
pub fn corollary_per_run_epsilon(
    target_epsilon: f64,
    k: u64,
    delta_slack: f64,
) -> Result<f64, PrivacyError> {
    if !(target_epsilon.is_finite() && target_epsilon > 0.0) || k == 0 {
        return Err(PrivacyError::InvalidParameter(format!(
            "need a positive target epsilon and k >= 1, got ({target_epsilon}, {k})"
        )));
    }
    if !(delta_slack > 0.0 && delta_slack < 1.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "delta slack must be in (0, 1), got {delta_slack}"
        )));
    }
    Ok(target_epsilon / (2.0 * (2.0 * k as f64 * (1.0 / delta_slack).ln()).sqrt()))
}

/// Largest per-run epsilon (to relative 1e-12) whose `k`-fold advanced composition with slack
/// `delta_slack` stays within `target_epsilon`, for any target (exact inversion, unlike the
/// corollary).
pub fn per_run_epsilon(target_epsilon: f64, k: u64, delta_slack: f64) -> Result<f64, PrivacyError> {
    let guess = corollary_per_run_epsilon(target_epsilon, k, delta_slack)?;
    let total = |e: f64| advanced(e, 0.0, k, delta_slack).map(|r| r.0);
    // The advanced bound is increasing in epsilon; bracket around the corollary's value.
    let (mut lo, mut hi) = (0.0, guess.max(f64::MIN_POSITIVE));
    while total(hi)? <= target_epsilon {
        lo = hi;
        hi *= 2.0;
    }
    for _ in 0..200 {
        if hi - lo <= 1e-12 * hi {
            break;
        }
        let mid = 0.5 * (lo + hi);
        if total(mid)? <= target_epsilon {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corollary_meets_its_target_below_one() {
        let (k, slack) = (100, 1e-6);
        let e = corollary_per_run_epsilon(0.8, k, slack).unwrap_or(f64::NAN);
        let (total, _) = advanced(e, 0.0, k, slack).unwrap_or((f64::NAN, 0.0));
        assert!(total <= 0.8, "{total}");
        let exact = per_run_epsilon(0.8, k, slack).unwrap_or(f64::NAN);
        assert!(exact >= e);
        let (at_exact, _) = advanced(exact, 0.0, k, slack).unwrap_or((f64::NAN, 0.0));
        assert!((at_exact - 0.8).abs() < 1e-9);
    }

    #[test]
    fn basic_adds_up_and_best_never_exceeds_it() {
        assert_eq!(basic(&[(1.0, 1e-6), (0.5, 0.0)]).ok(), Some((1.5, 1e-6)));
        let (e, _) = best(0.5, 0.0, 3, 1e-5).unwrap_or((f64::NAN, 0.0));
        assert!(e <= 1.5);
        assert!(advanced(-1.0, 0.0, 3, 1e-5).is_err());
    }
}
