//! The Gaussian mechanism, accounted exactly: the analytic characterisation of Balle & Wang
//! (2018, "Improving the Gaussian mechanism for differential privacy", Theorem 8).
//!
//! A Gaussian mechanism with L2 sensitivity 1 and noise standard deviation `sigma` is
//! (epsilon, delta)-DP exactly when
//!
//! ```text
//! delta >= Phi(1/(2 sigma) - epsilon sigma) - e^epsilon Phi(-1/(2 sigma) - epsilon sigma)
//! ```
//!
//! This is tight for every epsilon, unlike the classic `sigma = sqrt(2 ln(1.25/delta))/epsilon`,
//! which only holds for epsilon < 1 and is loose even there. We therefore never use the classic
//! formula.
//!
//! The module also hosts the standard normal distribution functions the accountants need
//! (CDF, log-CDF accurate far into the lower tail, quantile).

use super::PrivacyError;

const SQRT_2: f64 = std::f64::consts::SQRT_2;
/// ln(2 pi) / 2.
const HALF_LN_2PI: f64 = 0.918_938_533_204_672_8;

/// Standard normal CDF, Phi(x), with full relative accuracy in the lower tail (via erfc).
pub fn normal_cdf(x: f64) -> f64 {
    0.5 * libm::erfc(-x / SQRT_2)
}

/// ln Phi(x) of the standard normal, accurate for any x (as scipy's `log_ndtr`): erfc where it
/// has full relative precision, an asymptotic series below -20 (where Phi underflows long
/// before its logarithm does), log1p above 6.
pub fn normal_log_cdf(x: f64) -> f64 {
    if x.is_nan() {
        return f64::NAN;
    }
    if x > 6.0 {
        return (-normal_cdf(-x)).ln_1p();
    }
    if x >= -20.0 {
        return normal_cdf(x).ln();
    }
    if x == f64::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    // Phi(x) = phi(x)/(-x) * (1 - 1/x^2 + 3/x^4 - 15/x^6 + ...); at |x| >= 20 the terms fall by
    // at least (2k-1)/400 each, so a dozen terms reach double precision.
    let inv_x2 = 1.0 / (x * x);
    let mut term = 1.0;
    let mut sum = 1.0;
    for k in 1..16 {
        term *= -((2 * k - 1) as f64) * inv_x2;
        sum += term;
        if term.abs() < 1e-17 {
            break;
        }
    }
    -0.5 * x * x - (-x).ln() - HALF_LN_2PI + sum.ln()
}

/// Inverse of the standard normal CDF: the x with Phi(x) = p, for p in (0, 1). Accurate to a few
/// ulps, including deep tails (p = 1e-300).
pub fn normal_quantile(p: f64) -> f64 {
    if p.is_nan() || !(0.0..=1.0).contains(&p) {
        return f64::NAN;
    }
    if p == 0.0 {
        return f64::NEG_INFINITY;
    }
    if p == 1.0 {
        return f64::INFINITY;
    }
    if p > 0.5 {
        // Symmetry keeps the refinement in the accurate lower tail.
        return -normal_quantile_lower(1.0 - p, (-p).ln_1p());
    }
    normal_quantile_lower(p, p.ln())
}

/// Quantile for p <= 0.5 given p and ln p; Acklam's rational start, then Newton steps on
/// ln Phi(x) = ln p (well conditioned in the tail, where Phi itself has no relative precision
/// left to offer the usual Newton step).
fn normal_quantile_lower(p: f64, ln_p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let mut x = if p < 0.02425 {
        let q = (-2.0 * ln_p).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    };
    for _ in 0..4 {
        let log_cdf = normal_log_cdf(x);
        // d/dx ln Phi(x) = phi(x) / Phi(x).
        let slope = (-0.5 * x * x - HALF_LN_2PI - log_cdf).exp();
        let step = (log_cdf - ln_p) / slope;
        x -= step;
        if step.abs() <= 1e-15 * x.abs().max(1.0) {
            break;
        }
    }
    x
}

fn check_sigma(sigma: f64) -> Result<(), PrivacyError> {
    if !(sigma.is_finite() && sigma > 0.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "noise standard deviation must be positive and finite, got {sigma}"
        )));
    }
    Ok(())
}

fn check_delta(delta: f64) -> Result<(), PrivacyError> {
    super::params::Delta::try_from(delta)?;
    Ok(())
}

/// Hockey-stick divergence without argument checks: the delta at which N(0, sigma^2) with
/// sensitivity 1 is epsilon-DP.
fn delta_unchecked(sigma: f64, epsilon: f64) -> f64 {
    let a = 0.5 / sigma;
    let b = epsilon * sigma;
    // The second term in log space: e^epsilon can overflow while Phi underflows.
    let d = normal_cdf(a - b) - (epsilon + normal_log_cdf(-a - b)).exp();
    d.clamp(0.0, 1.0)
}

/// Exact delta (dimensionless probability) at which the Gaussian mechanism with L2 sensitivity 1
/// and noise standard deviation `sigma` (in units of the sensitivity) is (`epsilon`, delta)-DP.
pub fn delta(sigma: f64, epsilon: f64) -> Result<f64, PrivacyError> {
    check_sigma(sigma)?;
    if epsilon.is_nan() || epsilon < 0.0 {
        return Err(PrivacyError::InvalidParameter(format!(
            "epsilon must be non-negative, got {epsilon}"
        )));
    }
    if epsilon == f64::INFINITY {
        return Ok(0.0);
    }
    Ok(delta_unchecked(sigma, epsilon))
}

/// Smallest epsilon (natural-log units) at which the Gaussian mechanism with L2 sensitivity 1 and
/// noise standard deviation `sigma` is (epsilon, `delta`)-DP; exact (Balle & Wang 2018), solved
/// by bisection to within a few ulps.
pub fn epsilon(sigma: f64, delta: f64) -> Result<f64, PrivacyError> {
    check_sigma(sigma)?;
    check_delta(delta)?;
    if delta_unchecked(sigma, 0.0) <= delta {
        return Ok(0.0);
    }
    // delta(epsilon) decreases strictly to 0; bracket, then bisect.
    let mut hi = 1.0;
    while delta_unchecked(sigma, hi) > delta {
        hi *= 2.0;
        if hi > 1e12 {
            return Err(PrivacyError::NoSolution(format!(
                "no finite epsilon reaches delta = {delta} with sigma = {sigma}"
            )));
        }
    }
    let mut lo = 0.0;
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if delta_unchecked(sigma, mid) > delta {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    // `hi` always satisfies the guarantee.
    Ok(hi)
}

/// Smallest noise standard deviation (in units of the L2 sensitivity) for which one Gaussian
/// mechanism is (`epsilon`, `delta`)-DP; exact (Balle & Wang 2018).
pub fn sigma(epsilon: f64, delta: f64) -> Result<f64, PrivacyError> {
    if !(epsilon.is_finite() && epsilon > 0.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "epsilon must be positive and finite, got {epsilon}"
        )));
    }
    check_delta(delta)?;
    // delta(sigma) decreases in sigma (from 1 at sigma -> 0 to 0 at infinity): bracket in log
    // space, then bisect on log sigma.
    let (mut lo, mut hi) = (1.0, 1.0);
    while delta_unchecked(hi, epsilon) > delta {
        hi *= 2.0;
        if hi > 1e300 {
            return Err(PrivacyError::NoSolution(format!(
                "no noise level reaches ({epsilon}, {delta})-DP"
            )));
        }
    }
    if hi == 1.0 {
        while delta_unchecked(lo, epsilon) <= delta {
            lo *= 0.5;
            if lo < 1e-300 {
                return Ok(lo);
            }
        }
    } else {
        lo = hi * 0.5;
    }
    for _ in 0..200 {
        let mid = (lo * hi).sqrt();
        if mid <= lo || mid >= hi {
            break;
        }
        if delta_unchecked(mid, epsilon) > delta {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_cdf_is_continuous_across_its_branches() {
        for &x in &[-20.0_f64, 6.0] {
            let below = normal_log_cdf(x - 1e-9);
            let above = normal_log_cdf(x + 1e-9);
            assert!((below - above).abs() < 1e-7 * below.abs().max(1e-12), "{x}");
        }
        // scipy.special.log_ndtr(-30) = -454.32124395634327.
        assert!((normal_log_cdf(-30.0) + 454.321_243_956_343_27).abs() < 1e-10);
    }

    #[test]
    fn quantile_inverts_the_cdf() {
        for &p in &[1e-300, 1e-23, 1e-5, 0.01, 0.3, 0.5, 0.77, 0.999_999] {
            let x = normal_quantile(p);
            let back = normal_log_cdf(x).exp();
            assert!(((back - p) / p).abs() < 1e-12, "p={p} x={x} back={back}");
        }
    }
}
