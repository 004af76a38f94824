//! The Laplace mechanism: noise with density e^{-|x|/b} / (2b). With L1 sensitivity `s` and
//! scale `b` it is (s/b)-DP (pure DP); its exact (epsilon, delta) curve is
//! delta(epsilon) = max(0, 1 - e^{(epsilon - epsilon_0)/2}) with epsilon_0 = s/b.
//!
//! Sampling uses the inverse CDF on a uniform double. Like every floating-point Laplace sampler
//! it leaks through the low-order bits of the output (Mironov 2012); it is meant for the
//! thresholds of the sparse vector technique on counts, not for releasing exact values.

use rand::{Rng, RngExt};

use super::PrivacyError;

fn check_positive(name: &str, v: f64) -> Result<(), PrivacyError> {
    if !(v.is_finite() && v > 0.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "{name} must be positive and finite, got {v}"
        )));
    }
    Ok(())
}

/// Scale b (in the units of the query) for which the Laplace mechanism with L1 sensitivity
/// `sensitivity` is `epsilon`-DP (epsilon in nats): b = sensitivity / epsilon.
pub fn scale_for_epsilon(epsilon: f64, sensitivity: f64) -> Result<f64, PrivacyError> {
    check_positive("epsilon", epsilon)?;
    check_positive("sensitivity", sensitivity)?;
    Ok(sensitivity / epsilon)
}

/// Epsilon (nats, pure DP) of the Laplace mechanism with scale `scale` and L1 sensitivity
/// `sensitivity`.
pub fn epsilon(scale: f64, sensitivity: f64) -> Result<f64, PrivacyError> {
    check_positive("scale", scale)?;
    check_positive("sensitivity", sensitivity)?;
    Ok(sensitivity / scale)
}

/// Exact delta at which the Laplace mechanism (scale `scale`, L1 sensitivity `sensitivity`) is
/// (`epsilon`, delta)-DP, epsilon in nats: max(0, 1 - exp((epsilon - s/b)/2)).
pub fn delta(scale: f64, sensitivity: f64, epsilon: f64) -> Result<f64, PrivacyError> {
    let eps0 = self::epsilon(scale, sensitivity)?;
    if epsilon.is_nan() || epsilon < 0.0 {
        return Err(PrivacyError::InvalidParameter(format!(
            "epsilon must be non-negative, got {epsilon}"
        )));
    }
    Ok((-(0.5 * (epsilon - eps0)).exp_m1()).max(0.0))
}

/// One draw of Laplace(0, `scale`) noise from `rng`.
pub fn sample<R: Rng + ?Sized>(scale: f64, rng: &mut R) -> Result<f64, PrivacyError> {
    check_positive("scale", scale)?;
    loop {
        // u uniform in [-1/2, 1/2); the endpoint -1/2 maps to -inf and is redrawn.
        let u: f64 = rng.random::<f64>() - 0.5;
        let tail = 1.0 - 2.0 * u.abs();
        if tail > 0.0 {
            return Ok(-scale * u.signum() * tail.ln());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::ChaCha20Rng;

    #[test]
    fn samples_have_the_laplace_spread() {
        let mut rng = ChaCha20Rng::seed_from_u64(7);
        let n = 200_000;
        let b = 2.0;
        let mut abs_sum = 0.0;
        let mut sum = 0.0;
        for _ in 0..n {
            let x = sample(b, &mut rng).unwrap_or(f64::NAN);
            abs_sum += x.abs();
            sum += x;
        }
        // E|X| = b, E X = 0.
        assert!(
            (abs_sum / n as f64 - b).abs() < 0.02,
            "{}",
            abs_sum / n as f64
        );
        assert!((sum / n as f64).abs() < 0.03);
    }

    #[test]
    fn delta_curve_ends_at_pure_epsilon() {
        assert_eq!(delta(0.5, 1.0, 2.0).ok(), Some(0.0));
        let d0 = delta(0.5, 1.0, 0.0).unwrap_or(f64::NAN);
        assert!((d0 - (1.0 - (-1.0_f64).exp())).abs() < 1e-15);
        assert!(scale_for_epsilon(-1.0, 1.0).is_err());
    }
}
