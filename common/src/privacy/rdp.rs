//! Rényi differential privacy (RDP) accounting, the cross-check of the PLD figure.
//!
//! - The Poisson-subsampled Gaussian at integer and fractional orders, following Mironov, Talwar
//!   & Zhang (2019, "Rényi differential privacy of the sampled Gaussian mechanism", Sec. 3.3) with
//!   the same log-space series and stopping rules as Google's `dp_accounting` 0.6.0, so the two
//!   agree to rounding: a fractional-order series that has not converged after
//!   [`MAX_FRACTIONAL_TERMS`] terms yields +inf (the order is then ignored), never a wrong
//!   finite number.
//! - The Laplace mechanism (Mironov 2017, Prop. 6) and pure epsilon-DP events
//!   (Bun & Steinke 2016: epsilon-DP implies epsilon^2/2-zCDP).
//! - Conversion to (epsilon, delta) with the improved bound of Canonne, Kamath & Steinke (2020)
//!   / Asoodeh et al. (2020), `eps = r + ln(1 - 1/a) - ln(delta a)/(a - 1)`, used for orders
//!   a > 1.01 only (it is numerically unstable towards 1).
//!
//! All RDP values are in nats (natural logarithms).

use super::{DpEvent, PrivacyError};

/// Terms of the fractional-order series before it is declared divergent (as dp_accounting).
pub const MAX_FRACTIONAL_TERMS: usize = 1000;

/// dp_accounting's default orders: 1.1, 1.2, ..., 10.9, then 11, ..., 63, then 128, 256, 512,
/// 1024. Built with the same floating-point expressions, so e.g. 2.0 is exactly an integer.
pub fn default_orders() -> Vec<f64> {
    let mut orders: Vec<f64> = (1..100).map(|x| 1.0 + f64::from(x) / 10.0).collect();
    orders.extend((11..64).map(f64::from));
    orders.extend([128.0, 256.0, 512.0, 1024.0]);
    orders
}

/// ln(e^a + e^b), exact when either is -inf.
pub fn log_add(a: f64, b: f64) -> f64 {
    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
    if lo == f64::NEG_INFINITY {
        return hi;
    }
    (lo - hi).exp().ln_1p() + hi
}

/// ln(e^a - e^b) for a >= b (-inf when they are equal); NaN when a < b.
pub fn log_sub(a: f64, b: f64) -> f64 {
    if b > a {
        return f64::NAN;
    }
    if b == a || b == f64::NEG_INFINITY {
        return if b == a { f64::NEG_INFINITY } else { a };
    }
    a + (-(b - a).exp()).ln_1p()
}

/// ln |binomial(n, k)| through log-gamma (for real n, as the fractional series needs).
fn log_comb(n: f64, k: f64) -> f64 {
    libm::lgamma(n + 1.0) - libm::lgamma(k + 1.0) - libm::lgamma(n - k + 1.0)
}

/// ln erfc(x), accurate for large x.
fn log_erfc(x: f64) -> f64 {
    std::f64::consts::LN_2 + super::gaussian::normal_log_cdf(-x * std::f64::consts::SQRT_2)
}

/// ln A_alpha for integer alpha and 0 < q < 1: the binomial expansion of
/// E[(1 - q + q e^{(2x - 1)/(2 sigma^2)})^alpha].
pub fn log_a_integer(q: f64, sigma: f64, alpha: u64) -> f64 {
    let mut log_a = f64::NEG_INFINITY;
    let log1mq = (-q).ln_1p();
    let ln_q = q.ln();
    let a = alpha as f64;
    for i in 0..=alpha {
        let i = i as f64;
        let log_coef = log_comb(a, i) + i * ln_q + (a - i) * log1mq;
        let s = log_coef + (i * i - i) / (2.0 * sigma * sigma);
        log_a = log_add(log_a, s);
    }
    log_a
}

/// ln A_alpha for fractional alpha and 0 < q < 1: the two-sided series of Mironov, Talwar &
/// Zhang (2019, Sec. 3.3), split at z0. Returns +inf when the series has not converged after
/// [`MAX_FRACTIONAL_TERMS`] terms.
pub fn log_a_fractional(q: f64, sigma: f64, alpha: f64) -> f64 {
    let (mut log_a0, mut log_a1) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    let z0 = sigma * sigma * (1.0 / q - 1.0).ln() + 0.5;
    let log1mq = (-q).ln_1p();
    let ln_q = q.ln();
    let ln_half = 0.5_f64.ln();
    let two_var = 2.0 * sigma * sigma;
    let scale = std::f64::consts::SQRT_2 * sigma;
    let (mut last_s0, mut last_s1) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    for i in 0..MAX_FRACTIONAL_TERMS {
        let i = i as f64;
        let log_coef = log_comb(alpha, i);
        let j = alpha - i;
        let log_t0 = log_coef + i * ln_q + j * log1mq;
        let log_t1 = log_coef + j * ln_q + i * log1mq;
        let log_e0 = ln_half + log_erfc((i - z0) / scale);
        let log_e1 = ln_half + log_erfc((z0 - j) / scale);
        let log_s0 = log_t0 + (i * i - i) / two_var + log_e0;
        let log_s1 = log_t1 + (j * j - j) / two_var + log_e1;
        log_a0 = log_add(log_a0, log_s0);
        log_a1 = log_add(log_a1, log_s1);
        let total = log_add(log_a0, log_a1);
        // Stop once both halves decrease and are negligible against the total.
        if log_s0 < last_s0 && log_s1 < last_s1 && log_s0.max(log_s1) < total - 30.0 {
            return total;
        }
        last_s0 = log_s0;
        last_s1 = log_s1;
    }
    f64::INFINITY
}

/// RDP (nats) at order `alpha` of one Poisson-subsampled Gaussian mechanism: sampling rate `q`,
/// noise multiplier `sigma` (noise std / L2 sensitivity). +inf for sigma = 0 or alpha = inf.
pub fn poisson_subsampled_gaussian(q: f64, sigma: f64, alpha: f64) -> f64 {
    if q == 0.0 {
        return 0.0;
    }
    if alpha.is_infinite() || sigma == 0.0 {
        return f64::INFINITY;
    }
    if q == 1.0 {
        return alpha / (2.0 * sigma * sigma);
    }
    let log_a = if alpha.fract() == 0.0 {
        log_a_integer(q, sigma, alpha as u64)
    } else {
        log_a_fractional(q, sigma, alpha)
    };
    log_a / (alpha - 1.0)
}

/// RDP (nats) at order `alpha` of the Laplace mechanism that is `eps`-DP (scale = sensitivity /
/// eps); exact (Mironov 2017, Prop. 6).
pub fn laplace(eps: f64, alpha: f64) -> f64 {
    let a = alpha;
    if a == 1.0 {
        // KL divergence.
        return eps + (-eps).exp_m1();
    }
    if a < 1.1 {
        // Series for ln(1 + x)/x near 1, stable as alpha -> 1.
        let c = (eps * (1.0 - 2.0 * a)).exp_m1() / (2.0 * a - 1.0);
        let v = -c * (a - 1.0);
        let mut sum = 0.0;
        let mut pow = 1.0;
        for k in 1..100 {
            sum += pow / f64::from(k);
            pow *= v;
        }
        return eps + c * sum;
    }
    eps + ((a - 1.0) * (eps * (1.0 - 2.0 * a)).exp_m1() / (2.0 * a - 1.0)).ln_1p() / (a - 1.0)
}

/// RDP (nats) at order `alpha` of a pure `eps`-DP mechanism: min(eps, alpha eps^2 / 2)
/// (Bun & Steinke 2016, Prop. 1.4, and the trivial bound D_alpha <= D_inf).
pub fn pure_dp(eps: f64, alpha: f64) -> f64 {
    eps.min(0.5 * alpha * eps * eps)
}

/// Smallest epsilon (nats) at `delta` from RDP values `rdp` at `orders`, with the improved
/// conversion; returns (epsilon, optimal order). Orders <= 1.01 only contribute through the
/// KL bound (delta <= sqrt(1 - e^-KL)).
pub fn epsilon_from_rdp(
    orders: &[f64],
    rdp: &[f64],
    delta: f64,
) -> Result<(f64, f64), PrivacyError> {
    if delta.is_nan() || delta < 0.0 {
        return Err(PrivacyError::InvalidParameter(format!(
            "delta must be >= 0, got {delta}"
        )));
    }
    if orders.len() != rdp.len() || orders.is_empty() {
        return Err(PrivacyError::InvalidParameter(
            "orders and RDP values must have the same, non-zero length".into(),
        ));
    }
    if delta == 0.0 {
        return Ok(if rdp.iter().all(|&r| r == 0.0) {
            (0.0, 0.0)
        } else {
            (f64::INFINITY, 0.0)
        });
    }
    let mut best = (f64::INFINITY, orders[0]);
    for (&a, &r) in orders.iter().zip(rdp) {
        if a.is_nan() || a < 1.0 {
            return Err(PrivacyError::InvalidParameter(format!(
                "RDP order must be >= 1, got {a}"
            )));
        }
        let eps = if r < 0.0 {
            // Only reachable through rounding in extreme events: treat as no loss.
            0.0
        } else if delta * delta + (-r).exp_m1() > 0.0 {
            0.0
        } else if a > 1.01 {
            r + (-1.0 / a).ln_1p() - (delta * a).ln() / (a - 1.0)
        } else {
            f64::INFINITY
        };
        // Strict comparison keeps the first minimum, as numpy's argmin.
        if eps < best.0 {
            best = (eps, a);
        }
    }
    Ok((best.0.max(0.0), best.1))
}

/// Smallest delta at `epsilon` (nats) from RDP values at `orders`, the improved conversion
/// combined with the KL bound; returns (delta, optimal order).
pub fn delta_from_rdp(
    orders: &[f64],
    rdp: &[f64],
    epsilon: f64,
) -> Result<(f64, f64), PrivacyError> {
    if epsilon.is_nan() || epsilon < 0.0 {
        return Err(PrivacyError::InvalidParameter(format!(
            "epsilon must be >= 0, got {epsilon}"
        )));
    }
    if orders.len() != rdp.len() || orders.is_empty() {
        return Err(PrivacyError::InvalidParameter(
            "orders and RDP values must have the same, non-zero length".into(),
        ));
    }
    let mut best = (f64::INFINITY, orders[0]);
    for (&a, &r) in orders.iter().zip(rdp) {
        if a.is_nan() || a < 1.0 {
            return Err(PrivacyError::InvalidParameter(format!(
                "RDP order must be >= 1, got {a}"
            )));
        }
        let mut log_delta = if r <= 0.0 {
            f64::NEG_INFINITY
        } else {
            0.5 * (-(-r).exp()).ln_1p()
        };
        if a > 1.01 {
            let bound = (a - 1.0) * (r - epsilon + (-1.0 / a).ln_1p()) - a.ln();
            log_delta = log_delta.min(bound);
        }
        if log_delta < best.0 {
            best = (log_delta, a);
        }
    }
    Ok((best.0.exp().min(1.0), best.1))
}

/// The noise multiplier of a single Gaussian equivalent to a composition of Gaussians on the same
/// data (1/sigma^2 adds up), or the first event that is not such a composition.
pub fn effective_gaussian_noise(event: &DpEvent) -> Result<f64, &DpEvent> {
    match event {
        DpEvent::Gaussian { noise_multiplier } => Ok(*noise_multiplier),
        DpEvent::DiscreteGaussian {
            sigma,
            l2_sensitivity,
        } => Ok(sigma / l2_sensitivity),
        DpEvent::Composed { events } => {
            let mut inv_var = 0.0;
            for e in events {
                let s = effective_gaussian_noise(e)?;
                inv_var += s.powi(-2);
            }
            Ok(inv_var.powf(-0.5))
        }
        DpEvent::SelfComposed {
            event: inner,
            count,
        } => Ok(effective_gaussian_noise(inner)? / (*count as f64).sqrt()),
        other => Err(other),
    }
}

/// Accumulates RDP of composed events at a fixed set of orders.
#[derive(Clone, Debug, PartialEq)]
pub struct RdpAccountant {
    orders: Vec<f64>,
    rdp: Vec<f64>,
}

impl Default for RdpAccountant {
    fn default() -> Self {
        Self::new(default_orders())
    }
}

impl RdpAccountant {
    /// An empty accountant over `orders` (each >= 1).
    pub fn new(orders: Vec<f64>) -> Self {
        let rdp = vec![0.0; orders.len()];
        Self { orders, rdp }
    }

    /// The orders.
    pub fn orders(&self) -> &[f64] {
        &self.orders
    }

    /// The accumulated RDP (nats) at each order.
    pub fn rdp(&self) -> &[f64] {
        &self.rdp
    }

    /// Adds `count` adaptive repetitions of `event`. Supports Gaussian, Laplace, pure-DP
    /// EpsilonDelta (delta = 0), Poisson-sampled compositions of Gaussians, and any
    /// composition of these. On error the accountant is unchanged.
    pub fn compose(&mut self, event: &DpEvent, count: u64) -> Result<(), PrivacyError> {
        let mut add = vec![0.0; self.orders.len()];
        self.accumulate(event, count as f64, &mut add)?;
        for (r, a) in self.rdp.iter_mut().zip(add) {
            *r += a;
        }
        Ok(())
    }

    fn accumulate(&self, event: &DpEvent, count: f64, add: &mut [f64]) -> Result<(), PrivacyError> {
        match event {
            DpEvent::Gaussian {
                noise_multiplier: z,
            } => {
                check_noise(*z)?;
                for (acc, &a) in add.iter_mut().zip(&self.orders) {
                    *acc += count * poisson_subsampled_gaussian(1.0, *z, a);
                }
            }
            DpEvent::DiscreteGaussian {
                sigma,
                l2_sensitivity,
            } => {
                // The continuous Gaussian's RDP curve (see `DpEvent::DiscreteGaussian`).
                super::pld::check_discrete_gaussian(*sigma, *l2_sensitivity)?;
                let z = sigma / l2_sensitivity;
                for (acc, &a) in add.iter_mut().zip(&self.orders) {
                    *acc += count * poisson_subsampled_gaussian(1.0, z, a);
                }
            }
            DpEvent::Laplace { scale } => {
                if !(scale.is_finite() && *scale >= 0.0) {
                    return Err(PrivacyError::InvalidParameter(format!(
                        "Laplace scale must be non-negative and finite, got {scale}"
                    )));
                }
                let eps = 1.0 / scale;
                for (acc, &a) in add.iter_mut().zip(&self.orders) {
                    *acc += if eps.is_infinite() {
                        f64::INFINITY
                    } else {
                        count * laplace(eps, a)
                    };
                }
            }
            DpEvent::EpsilonDelta { epsilon, delta } => {
                if *delta != 0.0 {
                    return Err(PrivacyError::Unsupported(
                        "RDP cannot account an (epsilon, delta) event with delta > 0".into(),
                    ));
                }
                if epsilon.is_nan() || *epsilon < 0.0 {
                    return Err(PrivacyError::InvalidParameter(format!(
                        "epsilon must be >= 0, got {epsilon}"
                    )));
                }
                for (acc, &a) in add.iter_mut().zip(&self.orders) {
                    *acc += count * pure_dp(*epsilon, a);
                }
            }
            DpEvent::PoissonSampled {
                sampling_rate: q,
                event: inner,
            } => {
                check_rate(*q)?;
                let z = effective_gaussian_noise(inner).map_err(|bad| {
                    PrivacyError::Unsupported(format!(
                        "RDP: a Poisson-sampled event must be a composition of Gaussians, got {bad:?}"
                    ))
                })?;
                check_noise(z)?;
                for (acc, &a) in add.iter_mut().zip(&self.orders) {
                    *acc += count * poisson_subsampled_gaussian(*q, z, a);
                }
            }
            DpEvent::SelfComposed {
                event: inner,
                count: c,
            } => {
                self.accumulate(inner, count * (*c as f64), add)?;
            }
            DpEvent::Composed { events } => {
                for e in events {
                    self.accumulate(e, count, add)?;
                }
            }
        }
        Ok(())
    }

    /// Epsilon (nats) at `delta` of everything composed so far.
    pub fn epsilon(&self, delta: f64) -> Result<f64, PrivacyError> {
        Ok(epsilon_from_rdp(&self.orders, &self.rdp, delta)?.0)
    }

    /// Delta at `epsilon` (nats) of everything composed so far.
    pub fn delta(&self, epsilon: f64) -> Result<f64, PrivacyError> {
        Ok(delta_from_rdp(&self.orders, &self.rdp, epsilon)?.0)
    }
}

pub(crate) fn check_noise(z: f64) -> Result<(), PrivacyError> {
    if z.is_nan() || z < 0.0 {
        return Err(PrivacyError::InvalidParameter(format!(
            "noise multiplier must be non-negative, got {z}"
        )));
    }
    Ok(())
}

pub(crate) fn check_rate(q: f64) -> Result<(), PrivacyError> {
    if !(0.0..=1.0).contains(&q) {
        return Err(PrivacyError::InvalidParameter(format!(
            "sampling rate must be in [0, 1], got {q}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_orders_match_dp_accounting() {
        let o = default_orders();
        assert_eq!(o.len(), 99 + 53 + 4);
        assert_eq!(o[0], 1.1);
        assert_eq!(o[9], 2.0);
        assert_eq!(o[98], 10.9);
        assert_eq!(o[99], 11.0);
        assert_eq!(*o.last().unwrap_or(&0.0), 1024.0);
    }

    #[test]
    fn log_space_helpers() {
        assert!((log_add(1.0_f64.ln(), 2.0_f64.ln()) - 3.0_f64.ln()).abs() < 1e-15);
        assert!((log_sub(3.0_f64.ln(), 1.0_f64.ln()) - 2.0_f64.ln()).abs() < 1e-15);
        assert_eq!(log_add(f64::NEG_INFINITY, 0.5), 0.5);
        assert_eq!(log_sub(0.5, 0.5), f64::NEG_INFINITY);
    }

    #[test]
    fn fractional_and_integer_series_agree_near_an_integer() {
        // A_alpha is continuous in alpha: the two routines must meet.
        let int = log_a_integer(0.01, 1.0, 3);
        let frac = log_a_fractional(0.01, 1.0, 3.0 + 1e-9);
        assert!((int - frac).abs() < 1e-6 * int.abs(), "{int} {frac}");
    }
}
