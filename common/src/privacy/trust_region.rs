//! The L2 trust-region clipping rule of seed 004 §4.2.1 (Propositions 4.4 and 4.5), generalised
//! from one user per update to a cohort of `n` users, and the non-central chi-square
//! distribution it needs.
//!
//! # The rule
//!
//! One DP policy-gradient update with `n` users per round (seed 004 update (1); the paper has
//! `n = 1`):
//!
//! ```text
//! theta' = theta + eta/n * (sum_i clip_C(g_i) + sigma C z),   z ~ N(0, I_d)
//! ```
//!
//! Write `S = sum_i clip_C(g_i)`. Then
//! `||theta' - theta||^2 = (eta sigma C / n)^2 ||S/(sigma C) + z||^2`, and
//! `||S/(sigma C) + z||^2` is non-central chi-square with `d` degrees of freedom and
//! non-centrality `lambda = ||S||^2 / (sigma C)^2 <= n^2 / sigma^2` (each clipped term has norm
//! at most `C`). The quantile of order `p` of `ncx2(d, lambda)` increases with `lambda`, so with
//! `q = quantile_p(ncx2(d, n^2/sigma^2))`, the update stays inside the trust region
//! `||theta' - theta||^2 <= delta_TR` with probability at least `p` when
//!
//! ```text
//! C = n sqrt(delta_TR) / (eta sigma sqrt(q))                          (quantile rule)
//! ```
//!
//! For `n = 1` this is Proposition 4.4. The Markov form (Proposition 4.5 analogue) uses
//! `E||theta' - theta||^2 = (eta/n)^2 (||S||^2 + sigma^2 C^2 d) <= (eta C / n)^2 (sigma^2 d + n^2)`
//! and `P(X > delta_TR) <= E X / delta_TR`:
//!
//! ```text
//! C = n sqrt((1 - p) delta_TR) / (eta sqrt(sigma^2 d + n^2))          (Markov rule, smaller)
//! ```
//!
//! The guarantee is exact for a fixed public denominator `n` and at most `n` contributions per
//! round (fresh participation); under Poisson sampling more than `n` units can arrive and the
//! bound only holds approximately.
//!
//! With `eta = 1` the functions return `C' = eta C`, the clip norm of a client update that already
//! includes its learning rate (`clip_{eta C}(eta g) = eta clip_C(g)`): `C'` does not depend on
//! `eta`, which lets a learning-rate schedule live on the client while the engine's clip norm
//! stays constant.
//!
//! # The distribution
//!
//! The CDF of `ncx2(k, lambda)` is the Poisson(`lambda/2`)-weighted mixture of central
//! chi-square CDFs `P(k/2 + j, x/2)` (regularised lower incomplete gamma); the quantile inverts it
//! by bisection. Beyond `lambda/2 > 1e7` (millions of Poisson terms) a fourth-order
//! Cornish-Fisher expansion replaces the mixture; its error there is below 1e-9 relative.

use serde::{Deserialize, Serialize};

use super::PrivacyError;
use super::gaussian::normal_quantile;

/// How the clip norm is derived from the trust region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrustRegionBound {
    /// Exact non-central chi-square quantile (Proposition 4.4): the largest valid clip norm.
    #[default]
    Quantile,
    /// Markov inequality on the expected squared step (Proposition 4.5): simpler, more
    /// conservative (smaller clip norm for the same guarantee).
    Markov,
}

/// An L2 trust region on the parameter step: `||theta' - theta||^2 <= size` with probability at
/// least `confidence`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustRegion {
    /// `delta_TR`: bound on the *squared* L2 norm of one parameter step (parameter units
    /// squared). Seed 004 C.3, Riverswim: 3.5.
    pub size: f64,
    /// Probability `p` that a noisy step stays inside the region, in (0, 1). Seed 004 C.3: 0.6.
    pub confidence: f64,
    /// Which bound turns the region into a clip norm. Default `quantile`.
    #[serde(default)]
    pub bound: TrustRegionBound,
}

impl TrustRegion {
    /// Checks the ranges of the fields.
    pub fn validate(&self) -> Result<(), PrivacyError> {
        if !(self.size.is_finite() && self.size > 0.0) {
            return Err(PrivacyError::InvalidParameter(format!(
                "trust region size must be > 0, got {}",
                self.size
            )));
        }
        if !(self.confidence > 0.0 && self.confidence < 1.0) {
            return Err(PrivacyError::InvalidParameter(format!(
                "trust region confidence must be in (0, 1), got {}",
                self.confidence
            )));
        }
        Ok(())
    }

    /// The clip norm `C` of one user's gradient (see the module documentation) for `dim`
    /// parameters, `cohort` users per update (the fixed public denominator `n`), noise multiplier
    /// `sigma` (0 = no noise) and learning rate `lr` (`eta`). With `lr = 1` this is the clip norm
    /// `C' = eta C` of updates that already include the learning rate. Units: those of the
    /// clipped vector.
    pub fn clip_norm(
        &self,
        dim: usize,
        cohort: f64,
        sigma: f64,
        lr: f64,
    ) -> Result<f64, PrivacyError> {
        self.validate()?;
        let bad = |m: String| Err(PrivacyError::InvalidParameter(m));
        if dim == 0 {
            return bad("trust region: dim must be >= 1".into());
        }
        if !(cohort.is_finite() && cohort > 0.0) {
            return bad(format!("trust region: cohort must be > 0, got {cohort}"));
        }
        if !(sigma.is_finite() && sigma >= 0.0) {
            return bad(format!(
                "trust region: noise multiplier must be >= 0, got {sigma}"
            ));
        }
        if !(lr.is_finite() && lr > 0.0) {
            return bad(format!("trust region: learning rate must be > 0, got {lr}"));
        }
        let n = cohort;
        let d = dim as f64;
        let c = match self.bound {
            // Without noise the step is (eta/n) S with ||S|| <= nC: C = sqrt(size)/eta holds
            // surely (the limit of the quantile rule as sigma -> 0).
            TrustRegionBound::Quantile if sigma == 0.0 => self.size.sqrt() / lr,
            TrustRegionBound::Quantile => {
                let lambda = (n / sigma).powi(2);
                let q = ncx2_quantile(self.confidence, d, lambda)?;
                n * self.size.sqrt() / (lr * sigma * q.sqrt())
            }
            TrustRegionBound::Markov => {
                n * ((1.0 - self.confidence) * self.size).sqrt()
                    / (lr * (sigma * sigma * d + n * n).sqrt())
            }
        };
        if !(c.is_finite() && c > 0.0) {
            return Err(PrivacyError::NoSolution(format!(
                "trust region gives clip norm {c} (dim {dim}, cohort {n}, sigma {sigma}, lr {lr})"
            )));
        }
        Ok(c)
    }
}

/// Relative precision of the series and continued fractions.
const EPS: f64 = 1e-16;
/// Poisson weights below this are dropped from the mixture (the CDF is a convex combination, so
/// the truncation error is at most the dropped mass, about 1e-18 per side).
const WEIGHT_CUTOFF: f64 = 1e-20;
/// Above this Poisson mean (lambda/2) the Cornish-Fisher expansion replaces the mixture.
const MIXTURE_MAX_HALF_LAMBDA: f64 = 1e7;

/// `ln x^a e^-x / Gamma(a)`: the common prefactor of the incomplete gamma series.
fn ln_gamma_prefactor(a: f64, x: f64) -> f64 {
    a * x.ln() - x - libm::lgamma(a)
}

/// Regularised lower incomplete gamma `P(a, x) = gamma(a, x) / Gamma(a)` for `a > 0`, `x >= 0`:
/// the power series below `x < a + 1`, Lentz's continued fraction for `Q = 1 - P` above.
pub fn regularized_gamma_p(a: f64, x: f64) -> f64 {
    if a.is_nan() || x.is_nan() || a <= 0.0 {
        return f64::NAN;
    }
    if x <= 0.0 {
        return 0.0;
    }
    if x == f64::INFINITY {
        return 1.0;
    }
    if x < a + 1.0 {
        // P = x^a e^-x / Gamma(a+1) * sum_n x^n / ((a+1)...(a+n)).
        let mut ap = a;
        let mut term = 1.0 / a;
        let mut sum = term;
        // Terms shrink geometrically once a + n > x; sqrt(a)-many terms suffice near x = a.
        for _ in 0..10_000_000 {
            ap += 1.0;
            term *= x / ap;
            sum += term;
            if term < sum * EPS {
                break;
            }
        }
        (sum * ln_gamma_prefactor(a, x).exp()).clamp(0.0, 1.0)
    } else {
        (1.0 - gamma_q_continued_fraction(a, x)).clamp(0.0, 1.0)
    }
}

/// `Q(a, x)` for `x >= a + 1` by the modified Lentz method on the Legendre continued fraction.
fn gamma_q_continued_fraction(a: f64, x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let mut b = x + 1.0 - a;
    let mut c = 1.0 / TINY;
    let mut d = 1.0 / b;
    let mut h = d;
    for i in 1..10_000_000u64 {
        let fi = i as f64;
        let an = -fi * (fi - a);
        b += 2.0;
        d = an * d + b;
        if d.abs() < TINY {
            d = TINY;
        }
        c = b + an / c;
        if c.abs() < TINY {
            c = TINY;
        }
        d = 1.0 / d;
        let delta = d * c;
        h *= delta;
        if (delta - 1.0).abs() < EPS {
            break;
        }
    }
    (ln_gamma_prefactor(a, x).exp() * h).clamp(0.0, 1.0)
}

/// CDF of the central chi-square distribution with `k > 0` degrees of freedom at `x`.
pub fn chi2_cdf(x: f64, k: f64) -> f64 {
    regularized_gamma_p(k / 2.0, x / 2.0)
}

/// CDF of the non-central chi-square distribution `ncx2(k, lambda)` at `x` (`k > 0`,
/// `lambda >= 0`), as a Poisson(`lambda/2`) mixture of central chi-square CDFs, accurate to about
/// 1e-14 absolute. Neighbouring mixture terms follow from the one at the Poisson mode by the
/// recurrence `P(a+1, y) = P(a, y) - y^a e^-y / Gamma(a+1)`.
pub fn ncx2_cdf(x: f64, k: f64, lambda: f64) -> f64 {
    if x.is_nan() || k.is_nan() || lambda.is_nan() || k <= 0.0 || lambda < 0.0 {
        return f64::NAN;
    }
    if x <= 0.0 {
        return 0.0;
    }
    if x == f64::INFINITY {
        return 1.0;
    }
    if lambda == 0.0 {
        return chi2_cdf(x, k);
    }
    let h = lambda / 2.0;
    if h > MIXTURE_MAX_HALF_LAMBDA {
        return ncx2_cdf_cornish_fisher(x, k, lambda);
    }
    let y = x / 2.0;
    let a0 = k / 2.0;
    let ln_h = h.ln();
    let weight = |j: f64| (-h + j * ln_h - libm::lgamma(j + 1.0)).exp();
    // y^(a0+j-1) e^-y / Gamma(a0+j): the step between mixture terms j-1 and j.
    let step = |j: f64| ((a0 + j - 1.0) * y.ln() - y - libm::lgamma(a0 + j)).exp();
    let mode = h.floor();
    let p_mode = regularized_gamma_p(a0 + mode, y);
    let mut total = weight(mode) * p_mode;
    // Upwards from the mode.
    let mut p = p_mode;
    let mut j = mode + 1.0;
    loop {
        p = (p - step(j)).max(0.0);
        let w = weight(j);
        total += w * p;
        if w < WEIGHT_CUTOFF || p == 0.0 {
            break;
        }
        j += 1.0;
    }
    // Downwards from the mode.
    let mut p = p_mode;
    let mut j = mode;
    while j >= 1.0 {
        p = (p + step(j)).min(1.0);
        let w = weight(j - 1.0);
        total += w * p;
        if w < WEIGHT_CUTOFF {
            break;
        }
        j -= 1.0;
    }
    total.clamp(0.0, 1.0)
}

/// The cumulants of `ncx2(k, lambda)`: `kappa_r = 2^(r-1) (r-1)! (k + r lambda)`, r = 1..4.
fn ncx2_cumulants(k: f64, lambda: f64) -> [f64; 4] {
    [
        k + lambda,
        2.0 * (k + 2.0 * lambda),
        8.0 * (k + 3.0 * lambda),
        48.0 * (k + 4.0 * lambda),
    ]
}

/// Cornish-Fisher quantile of `ncx2(k, lambda)` (for very large `lambda`, where the
/// distribution is nearly normal: skewness about `3/sqrt(lambda)`).
fn ncx2_quantile_cornish_fisher(p: f64, k: f64, lambda: f64) -> f64 {
    let [k1, k2, k3, k4] = ncx2_cumulants(k, lambda);
    let g1 = k3 / k2.powf(1.5);
    let g2 = k4 / (k2 * k2);
    let z = normal_quantile(p);
    let w = z + (z * z - 1.0) * g1 / 6.0 + (z.powi(3) - 3.0 * z) * g2 / 24.0
        - (2.0 * z.powi(3) - 5.0 * z) * g1 * g1 / 36.0;
    k1 + k2.sqrt() * w
}

/// CDF matching [`ncx2_quantile_cornish_fisher`] (inverted by bisection on its monotone part).
fn ncx2_cdf_cornish_fisher(x: f64, k: f64, lambda: f64) -> f64 {
    let (mut lo, mut hi) = (1e-300_f64, 1.0 - 1e-16);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if ncx2_quantile_cornish_fisher(mid, k, lambda) < x {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Quantile of order `p` in (0, 1) of `ncx2(k, lambda)` (`k > 0` degrees of freedom,
/// non-centrality `lambda >= 0`): the `x` with `ncx2_cdf(x, k, lambda) = p`, by bisection to
/// 1e-13 relative.
pub fn ncx2_quantile(p: f64, k: f64, lambda: f64) -> Result<f64, PrivacyError> {
    if !(p > 0.0 && p < 1.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "quantile order must be in (0, 1), got {p}"
        )));
    }
    if !(k.is_finite() && k > 0.0 && lambda.is_finite() && lambda >= 0.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "ncx2 needs k > 0 and lambda >= 0, got k = {k}, lambda = {lambda}"
        )));
    }
    if lambda / 2.0 > MIXTURE_MAX_HALF_LAMBDA {
        return Ok(ncx2_quantile_cornish_fisher(p, k, lambda));
    }
    let [mean, var, _, _] = ncx2_cumulants(k, lambda);
    let mut lo = 0.0_f64;
    let mut hi = mean + 10.0 * var.sqrt() + 10.0;
    while ncx2_cdf(hi, k, lambda) < p {
        lo = hi;
        hi *= 2.0;
        if !hi.is_finite() {
            return Err(PrivacyError::NoSolution(format!(
                "ncx2 quantile {p} (k = {k}, lambda = {lambda}) did not bracket"
            )));
        }
    }
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if ncx2_cdf(mid, k, lambda) < p {
            lo = mid;
        } else {
            hi = mid;
        }
        if hi - lo <= 1e-13 * hi {
            break;
        }
    }
    Ok(0.5 * (lo + hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::ChaCha8Rng;
    use rand_distr::{Distribution, StandardNormal};

    fn close(got: f64, want: f64, rel: f64) {
        assert!(
            (got - want).abs() <= rel * want.abs().max(1e-300),
            "got {got}, want {want} (relative tolerance {rel})"
        );
    }

    /// scipy.special.gammainc(a, x) (scipy 1.17.1).
    #[test]
    fn incomplete_gamma_matches_scipy() {
        for (a, x, want) in [
            (0.5, 0.2, 0.47291074313446196),
            (3.0, 2.5, 0.45618688411667035),
            (10.0, 15.0, 0.9301463393005901),
            (100.0, 90.0, 0.15822098918643007),
            (1e4, 1.01e4, 0.8413487504471796),
            (2.5, 0.001, 9.50853459860793e-09),
        ] {
            close(regularized_gamma_p(a, x), want, 1e-11);
        }
        // Closed forms: P(1, x) = 1 - e^-x; chi-square with 2 dof: 1 - e^(-x/2).
        for x in [0.01, 0.5, 3.0, 40.0] {
            close(regularized_gamma_p(1.0, x), -(-x).exp_m1(), 1e-13);
            close(chi2_cdf(x, 2.0), -(-x / 2.0).exp_m1(), 1e-13);
        }
    }

    /// scipy.stats.ncx2.cdf(x, k, lambda) (scipy 1.17.1).
    #[test]
    fn ncx2_cdf_matches_scipy() {
        for (k, lambda, x, want) in [
            (18.0, 74964.68300494723, 75000.0, 0.5133405256358298),
            (4.0, 3.0, 2.5, 0.13415847715495308),
            (1.0, 0.1, 0.01, 0.07578343373481647),
            (50.0, 20.0, 60.0, 0.23577033899467492),
            (18.0, 0.07149189281935428, 7.0, 0.009641913874690931),
            (10.0, 1.0, 7.0, 0.21501083775859706),
        ] {
            close(ncx2_cdf(x, k, lambda), want, 1e-9);
        }
    }

    /// scipy.stats.ncx2.ppf(p, k, lambda), chi2.ppf for lambda = 0 (scipy 1.17.1).
    #[test]
    fn ncx2_quantile_matches_scipy() {
        for (k, lambda, p, want) in [
            (18.0, 0.07149189281935428, 0.6, 18.942851461071587),
            (12.0, 0.07149189281935428, 0.6, 12.658830463139875),
            (18.0, 74964.68300494723, 0.6, 75120.48633788996),
            (1.0, 0.5, 0.9, 4.031182480262083),
            (5.0, 10.0, 0.5, 14.058412027994969),
            (18.0, 0.0, 0.6, 18.86790412124849),
            (3.0, 2.0, 0.01, 0.22191879101074652),
            (30.0, 100.0, 0.99, 184.02892255211665),
            (2.0, 0.0, 0.95, 5.991464547107979),
            (18.0, 4685.292687809201, 0.6, 4737.071694779973),
            (10.0, 1.0, 0.999, 32.3678938506429),
            (18.0, 1e6, 0.6, 1000523.760547123),
            // Cornish-Fisher range.
            (18.0, 3e7, 0.6, 30002792.34304333),
            (18.0, 2e7, 0.9, 20011481.19047902),
            (7.0, 5e7, 0.1, 49981883.76578194),
        ] {
            close(ncx2_quantile(p, k, lambda).unwrap(), want, 1e-9);
        }
        // Exact central case: chi-square with 2 dof has quantile -2 ln(1 - p).
        for p in [0.05, 0.6, 0.99] {
            close(
                ncx2_quantile(p, 2.0, 0.0).unwrap(),
                -2.0 * (-p).ln_1p(),
                1e-11,
            );
        }
        assert!(ncx2_quantile(1.0, 2.0, 1.0).is_err());
        assert!(ncx2_quantile(0.5, 0.0, 1.0).is_err());
    }

    #[test]
    fn mixture_and_cornish_fisher_agree_at_the_switch() {
        let lambda = 2.0 * MIXTURE_MAX_HALF_LAMBDA;
        let below = ncx2_quantile(0.6, 18.0, lambda * (1.0 - 1e-12)).unwrap();
        let above = ncx2_quantile_cornish_fisher(0.6, 18.0, lambda);
        close(below, above, 1e-10);
    }

    /// Monte Carlo: the empirical frequency below the quantile is the order.
    #[test]
    fn ncx2_quantile_matches_monte_carlo() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let (k, lambda, p) = (6usize, 3.0, 0.6);
        let q = ncx2_quantile(p, k as f64, lambda).unwrap();
        let mu = lambda.sqrt(); // all the non-centrality on the first coordinate
        let n = 200_000;
        let below = (0..n)
            .filter(|_| {
                let x: f64 = (0..k)
                    .map(|i| {
                        let z: f64 = StandardNormal.sample(&mut rng);
                        let m = if i == 0 { mu } else { 0.0 };
                        (z + m).powi(2)
                    })
                    .sum();
                x <= q
            })
            .count();
        let freq = below as f64 / n as f64;
        // Binomial standard error ~ 0.0011.
        assert!((freq - p).abs() < 0.005, "{freq}");
    }

    #[test]
    fn one_user_is_proposition_4_4() {
        let tr = TrustRegion {
            size: 3.5,
            confidence: 0.6,
            bound: TrustRegionBound::Quantile,
        };
        let (d, sigma, eta) = (18usize, 3.74_f64, 12.0);
        let q: f64 = 18.942851461071587; // scipy ncx2.ppf(0.6, 18, 1/3.74^2)
        let want = 3.5_f64.sqrt() / (eta * sigma * q.sqrt());
        close(tr.clip_norm(d, 1.0, sigma, eta).unwrap(), want, 1e-9);
        // Folding the learning rate in: C' = eta C.
        close(
            tr.clip_norm(d, 1.0, sigma, 1.0).unwrap(),
            eta * tr.clip_norm(d, 1.0, sigma, eta).unwrap(),
            1e-12,
        );
    }

    #[test]
    fn clip_norm_shrinks_with_noise_and_dimension() {
        let tr = TrustRegion {
            size: 3.5,
            confidence: 0.6,
            bound: TrustRegionBound::Quantile,
        };
        let mk = TrustRegion {
            bound: TrustRegionBound::Markov,
            ..tr
        };
        for rule in [tr, mk] {
            for n in [1.0, 64.0, 1024.0] {
                let mut last = f64::INFINITY;
                for sigma in [0.1, 0.5, 1.0, 3.74, 10.0] {
                    let c = rule.clip_norm(18, n, sigma, 1.0).unwrap();
                    assert!(
                        c < last,
                        "{rule:?} n {n}: sigma {sigma} gives {c} >= {last}"
                    );
                    last = c;
                }
                let mut last = f64::INFINITY;
                for d in [1, 2, 6, 18, 100, 10_000] {
                    let c = rule.clip_norm(d, n, 3.74, 1.0).unwrap();
                    assert!(c < last, "{rule:?} n {n}: dim {d} gives {c} >= {last}");
                    last = c;
                }
            }
            // A higher confidence needs a smaller clip norm.
            let hi = TrustRegion {
                confidence: 0.95,
                ..rule
            };
            assert!(
                hi.clip_norm(18, 8.0, 1.0, 1.0).unwrap()
                    < rule.clip_norm(18, 8.0, 1.0, 1.0).unwrap()
            );
        }
        // Markov is the conservative one.
        for (n, sigma) in [(1.0, 3.74), (1024.0, 3.74), (8.0, 0.5)] {
            assert!(
                mk.clip_norm(18, n, sigma, 1.0).unwrap() < tr.clip_norm(18, n, sigma, 1.0).unwrap()
            );
        }
        // Large cohorts: the noise vanishes from the mean, C' tends to sqrt(size).
        let c = tr.clip_norm(18, 1e6, 3.74, 1.0).unwrap();
        close(c, 3.5_f64.sqrt(), 1e-3);
        close(
            tr.clip_norm(18, 4.0, 0.0, 1.0).unwrap(),
            3.5_f64.sqrt(),
            1e-15,
        );
    }

    /// The rule's promise, checked by simulation: the noisy step of clipped updates, each of norm
    /// exactly C in the same direction (the worst case), stays inside with probability >= p.
    #[test]
    fn noisy_steps_stay_inside_with_the_promised_probability() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for bound in [TrustRegionBound::Quantile, TrustRegionBound::Markov] {
            let tr = TrustRegion {
                size: 3.5,
                confidence: 0.6,
                bound,
            };
            for (d, n, sigma, eta) in [
                (18usize, 1usize, 3.74, 12.0),
                (18, 64, 3.74, 2.0),
                (5, 16, 1.0, 0.5),
            ] {
                let c = tr.clip_norm(d, n as f64, sigma, eta).unwrap();
                let trials = 20_000;
                let mut inside = 0;
                for _ in 0..trials {
                    // sum of n clipped gradients of norm C along e_0, plus noise.
                    let sq: f64 = (0..d)
                        .map(|i| {
                            let z: f64 = StandardNormal.sample(&mut rng);
                            let s = if i == 0 { n as f64 * c } else { 0.0 };
                            (eta / n as f64 * (s + sigma * c * z)).powi(2)
                        })
                        .sum();
                    if sq <= tr.size {
                        inside += 1;
                    }
                }
                let freq = inside as f64 / trials as f64;
                // Standard error ~0.0035; the quantile rule is tight in this worst case.
                assert!(freq >= 0.6 - 0.012, "{bound:?} d {d} n {n}: {freq}");
                if bound == TrustRegionBound::Quantile {
                    assert!(freq < 0.6 + 0.012, "quantile rule is tight: {freq}");
                }
            }
        }
    }

    #[test]
    fn bad_regions_are_refused() {
        let ok = TrustRegion {
            size: 3.5,
            confidence: 0.6,
            bound: TrustRegionBound::Quantile,
        };
        assert!(
            TrustRegion { size: 0.0, ..ok }
                .clip_norm(2, 1.0, 1.0, 1.0)
                .is_err()
        );
        assert!(
            TrustRegion {
                confidence: 1.0,
                ..ok
            }
            .clip_norm(2, 1.0, 1.0, 1.0)
            .is_err()
        );
        assert!(ok.clip_norm(0, 1.0, 1.0, 1.0).is_err());
        assert!(ok.clip_norm(2, 0.0, 1.0, 1.0).is_err());
        assert!(ok.clip_norm(2, 1.0, -1.0, 1.0).is_err());
        assert!(ok.clip_norm(2, 1.0, 1.0, 0.0).is_err());
    }
}
