//! Descriptions of the mechanisms that ran, independent of how they are accounted (as
//! dp_accounting's `DpEvent` tree). The ledger stores these, so a better accountant can later
//! re-account an old run without re-running it.
//!
//! # The discrete Gaussian, accounted as a continuous one plus a proven gap
//!
//! A [`DpEvent::DiscreteGaussian`] is accounted as `Gaussian { noise_multiplier: sigma / Delta }`
//! (sigma and the L2 sensitivity Delta in grid units). That is exact for its Renyi/zCDP curve
//! (Canonne, Kamath & Steinke, "The Discrete Gaussian for Differential Privacy", NeurIPS 2020,
//! multivariate theorem: `rho = Delta^2 / (2 sigma^2)`, no slack; the proof is repeated in
//! `discrete_gaussian.rs`), but **not** for its (epsilon, delta) curve: an exact hockey-stick sum
//! shows the discrete one's delta(epsilon) above the continuous one's (1.7e-4 at
//! sigma = Delta = 10, see `tests/discrete_gaussian_gap.rs`). The ledger therefore refuses
//! every discrete Gaussian whose gap is not provably at most [`DISCRETE_GAUSSIAN_MAX_GAP`]
//! (we chose refusing over adding the gap to delta: with the project's grid the gap is ~1e-15,
//! and refusing keeps every accountant and the stored events unchanged).
//!
//! **The bound** ([`discrete_gaussian_gap_bound`]): for every real epsilon and every integer
//! shift `mu` with `||mu||_2 <= Delta`, on any number `d` of coordinates,
//! `delta_discrete(epsilon) <= delta_gauss(epsilon; z = sigma / Delta) + eta` with
//! `eta = (a^2 + K a) / (12 sigma^2) + 3 exp(-2 pi^2 sigma^2) + 3 d exp(-pi^2 sigma^2)`,
//! `a = Delta / sigma`, `K = (3 + 8 exp(-1/2)) / sqrt(2 pi) = 3.13259`. Why it holds (our
//! derivation; CKS20 give the privacy loss, we bound the lattice error by Poisson summation):
//! 1. The privacy loss of `N_Z(0, sigma^2)^d` against its shift by `mu` is
//!    `(||mu||^2 - 2 <X, mu>) / (2 sigma^2)` (CKS20: the normalisers cancel for integer
//!    shifts), the continuous one's formula, so `delta(epsilon) = E[g(<X, mu>)]` with the same
//!    `g(s) = (1 - exp((s - s0) / sigma^2))_+` (`s0 = ||mu||^2 / 2 - epsilon sigma^2`) for both.
//!    `0 <= g <= 1`, `|g'| <= 1 / sigma^2`, `|g''| <= 1 / sigma^4`, one kink at `s0`.
//! 2. Coordinates are replaced by continuous N(0, sigma^2) one at a time, the largest `|mu_j|`
//!    first. With the others fixed, `G(x) = g(mu_j x + r)` and `rho` the N_Z pmf written as a
//!    function on R (the Gaussian density over `theta = sum_m exp(-2 pi^2 sigma^2 m^2) >= 1`),
//!    Poisson summation of `F = (G - G(0)) rho` gives `E_Z[G] <= E_R[G] + (theta - 1) +
//!    sum_{m != 0} |F^(m)|`, and two integrations by parts `|F^(m)| <= (J + ||F''||_1) /
//!    (4 pi^2 m^2)` with the kink's jump `J <= a / (sqrt(2 pi) sigma^2)` and
//!    `||F''||_1 <= ||G'' rho|| + 2 ||G' rho'|| + ||(G - G(0)) rho''|| <= (a^2 + (4 / sqrt(2 pi)
//!    + 8 phi(1) - 2 phi(0)) a) / sigma^2` (`E|Z||Z^2 - 1| = 8 phi(1) - 2 phi(0)`); summing
//!    `1 / (4 pi^2 m^2)` over `m != 0` gives 1/12. `theta - 1 <= 3 exp(-2 pi^2 sigma^2)`.
//! 3. Every later coordinate `k` meets `g` already smoothed by `mu_j Y_j`, a Gaussian of standard
//!    deviation `sigma |mu_j| >= sigma |mu_k|`: as a function of `x_k` the summand is a Gaussian
//!    of variance `>= sigma^2 / 2` and total mass `<= 1`, so its Fourier coefficient at `m != 0`
//!    is at most `exp(-pi^2 sigma^2 m^2)`, at most `3 exp(-pi^2 sigma^2)` in all.
//! 4. With all coordinates continuous, `E[g] = delta_gauss(epsilon; sigma / ||mu||)`, which is
//!    increasing in `||mu|| <= Delta`.
//!
//! At `sigma >= DISCRETE_GAUSSIAN_MIN_SIGMA` the two exponential terms are below 1e-400 for any
//! `d < 2^64`, so the check is `(a^2 + K a) / (12 sigma^2) <= 1e-12`. The bound holds at every
//! real epsilon, which is what composition needs: a product pair's profile is
//! `delta_{A x B}(e) = E_{L_B}[delta_A(e - L_B)]`, and Poisson subsampling maps a profile affinely
//! with slope <= 1, so swapping each of `n` discrete events for its continuous twin costs at most
//! `eta` each: the true delta of a ledger is at most the reported delta plus `n eta` (adaptive
//! composition through dominating pairs, Zhu, Dong & Wang 2022). At the default grid
//! (`Delta ~ 2^24`, `sigma = z Delta`) `eta ~ 1.2e-15 / z^2` for z ~ 1, so 1e5 rounds add ~1e-10.

use serde::{Deserialize, Serialize};

use super::PrivacyError;

/// The smallest discrete Gaussian standard deviation, in grid units, the ledger accepts: from
/// there on the exponential terms of [`discrete_gaussian_gap_bound`] are below f64 resolution for
/// any dimension (see the module doc).
pub const DISCRETE_GAUSSIAN_MIN_SIGMA: f64 = 10.0;

/// The largest gap between the discrete Gaussian's delta(epsilon) and the continuous Gaussian's
/// (same sigma / Delta) that the ledger accepts for one event ([`discrete_gaussian_gap_bound`]).
pub const DISCRETE_GAUSSIAN_MAX_GAP: f64 = 1e-12;

/// `K` of the module doc: `(3 + 8 exp(-1/2)) / sqrt(2 pi)`.
const KINK_CONSTANT: f64 = 3.132_593;

/// A proven upper bound on `delta_discrete(epsilon) - delta_gauss(epsilon; sigma / Delta)`, at
/// every epsilon, for one discrete Gaussian with standard deviation `sigma` and L2 sensitivity
/// `l2_sensitivity` (both in grid units), when `sigma >= DISCRETE_GAUSSIAN_MIN_SIGMA` (the
/// exponential terms, below 1e-400 there, are left out). Derivation in the module doc.
pub fn discrete_gaussian_gap_bound(sigma: f64, l2_sensitivity: f64) -> f64 {
    let a = l2_sensitivity / sigma;
    (a * a + KINK_CONSTANT * a) / (12.0 * sigma * sigma)
}

/// One differentially private computation, as run. Sensitivities are normalised to 1: a Gaussian
/// with noise multiplier z adds N(0, (z C)^2) to a sum of contributions clipped to L2 norm C.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DpEvent {
    /// Gaussian mechanism with noise standard deviation `noise_multiplier` x sensitivity.
    Gaussian { noise_multiplier: f64 },
    /// Discrete Gaussian noise N_Z(0, sigma^2) on every coordinate of an integer vector (a sum in
    /// fixed point on a public grid) whose L2 sensitivity is `l2_sensitivity`; both in grid
    /// units (the grid's rounding is part of the sensitivity).
    ///
    /// Accounted as `Gaussian { noise_multiplier: sigma / l2_sensitivity }`: exactly for its
    /// zCDP curve (Canonne, Kamath & Steinke 2020), and for (epsilon, delta) up to a proven gap
    /// that the ledger requires to be at most [`DISCRETE_GAUSSIAN_MAX_GAP`] per event (module
    /// doc, [`discrete_gaussian_gap_bound`]).
    DiscreteGaussian { sigma: f64, l2_sensitivity: f64 },
    /// Laplace mechanism with scale `scale` x L1 sensitivity (epsilon = 1 / scale).
    Laplace { scale: f64 },
    /// A pure epsilon-DP (or (epsilon, delta)-DP) mechanism accounted by its parameters alone,
    /// e.g. the sparse vector technique.
    EpsilonDelta { epsilon: f64, delta: f64 },
    /// `event` run on a Poisson sample in which each unit is included with probability
    /// `sampling_rate`, drawn by the aggregator itself (only then is amplification claimed).
    PoissonSampled {
        sampling_rate: f64,
        event: Box<DpEvent>,
    },
    /// `event` run `count` times (adaptive composition).
    SelfComposed { event: Box<DpEvent>, count: u64 },
    /// Different events composed.
    Composed { events: Vec<DpEvent> },
}

impl DpEvent {
    /// The noise multiplier of the continuous Gaussian an accountant uses for this leaf: z for a
    /// Gaussian, sigma / l2_sensitivity for a discrete Gaussian (see
    /// [`DpEvent::DiscreteGaussian`]); `None` for any other event.
    pub fn gaussian_noise_multiplier(&self) -> Option<f64> {
        match self {
            DpEvent::Gaussian { noise_multiplier } => Some(*noise_multiplier),
            DpEvent::DiscreteGaussian {
                sigma,
                l2_sensitivity,
            } => Some(sigma / l2_sensitivity),
            _ => None,
        }
    }

    /// The zCDP parameter rho of the tree when it holds only un-sampled Gaussian and discrete
    /// Gaussian events: `1 / (2 z^2)` per Gaussian, `Delta^2 / (2 sigma^2)` per discrete
    /// Gaussian (exact for both: Bun & Steinke 2016, Canonne, Kamath & Steinke 2020), summed
    /// over compositions. `None` for a tree holding any other event (sampled, Laplace, ...),
    /// whose zCDP figure would not be exact.
    pub fn zcdp_rho(&self) -> Option<f64> {
        match self {
            DpEvent::Gaussian { .. } | DpEvent::DiscreteGaussian { .. } => {
                let z = self.gaussian_noise_multiplier()?;
                Some(1.0 / (2.0 * z * z))
            }
            DpEvent::SelfComposed { event, count } => Some(event.zcdp_rho()? * *count as f64),
            DpEvent::Composed { events } => events.iter().map(DpEvent::zcdp_rho).sum(),
            DpEvent::Laplace { .. }
            | DpEvent::EpsilonDelta { .. }
            | DpEvent::PoissonSampled { .. } => None,
        }
    }

    /// True when a Poisson sample appears anywhere in the tree.
    pub fn contains_sampling(&self) -> bool {
        match self {
            DpEvent::PoissonSampled { .. } => true,
            DpEvent::SelfComposed { event, .. } => event.contains_sampling(),
            DpEvent::Composed { events } => events.iter().any(DpEvent::contains_sampling),
            _ => false,
        }
    }

    /// Checks every parameter of the tree against what a ledger may record: Gaussian noise
    /// multiplier positive and finite, discrete Gaussian sigma >= [`DISCRETE_GAUSSIAN_MIN_SIGMA`],
    /// sensitivity positive (both finite) and a proven gap to the continuous Gaussian of at most
    /// [`DISCRETE_GAUSSIAN_MAX_GAP`] ([`discrete_gaussian_gap_bound`]), Laplace scale positive and finite, epsilon >= 0
    /// and finite with delta in [0, 1), sampling rate in (0, 1], counts >= 1 and compositions
    /// non-empty. (The accountants themselves accept the degenerate cases, e.g. z = 0 as a
    /// non-private event with epsilon = +inf; a ledger never records one.)
    pub fn validate(&self) -> Result<(), PrivacyError> {
        let bad = |m: String| Err(PrivacyError::InvalidParameter(m));
        let pos = |x: f64| x.is_finite() && x > 0.0;
        match self {
            DpEvent::Gaussian { noise_multiplier } => {
                if !pos(*noise_multiplier) {
                    return bad(format!(
                        "Gaussian noise multiplier must be positive and finite, got {noise_multiplier}"
                    ));
                }
            }
            DpEvent::DiscreteGaussian {
                sigma,
                l2_sensitivity,
            } => {
                if !(sigma.is_finite() && *sigma >= DISCRETE_GAUSSIAN_MIN_SIGMA) {
                    return bad(format!(
                        "discrete Gaussian sigma must be finite and at least \
                         {DISCRETE_GAUSSIAN_MIN_SIGMA} grid units, got {sigma}"
                    ));
                }
                if !pos(*l2_sensitivity) {
                    return bad(format!(
                        "discrete Gaussian L2 sensitivity must be positive and finite, got \
                         {l2_sensitivity}"
                    ));
                }
                let gap = discrete_gaussian_gap_bound(*sigma, *l2_sensitivity);
                if gap > DISCRETE_GAUSSIAN_MAX_GAP {
                    return bad(format!(
                        "discrete Gaussian with sigma {sigma} and L2 sensitivity \
                         {l2_sensitivity} (grid units): its delta may exceed the continuous \
                         Gaussian's by up to {gap:e}, above the accepted \
                         {DISCRETE_GAUSSIAN_MAX_GAP:e}; use a finer grid"
                    ));
                }
            }
            DpEvent::Laplace { scale } => {
                if !pos(*scale) {
                    return bad(format!(
                        "Laplace scale must be positive and finite, got {scale}"
                    ));
                }
            }
            DpEvent::EpsilonDelta { epsilon, delta } => {
                if !(epsilon.is_finite() && *epsilon >= 0.0) {
                    return bad(format!("epsilon must be finite and >= 0, got {epsilon}"));
                }
                if !(0.0..1.0).contains(delta) {
                    return bad(format!("delta must be in [0, 1), got {delta}"));
                }
            }
            DpEvent::PoissonSampled {
                sampling_rate,
                event,
            } => {
                super::params::SamplingRate::try_from(*sampling_rate)?;
                event.validate()?;
            }
            DpEvent::SelfComposed { event, count } => {
                if *count == 0 {
                    return bad("a self-composition must run at least once".into());
                }
                event.validate()?;
            }
            DpEvent::Composed { events } => {
                if events.is_empty() {
                    return bad("a composition must hold at least one event".into());
                }
                for e in events {
                    e.validate()?;
                }
            }
        }
        Ok(())
    }
}

/// A compact one-line form of the tree, e.g. `poisson(q=0.01, gaussian(z=1.1))`.
impl std::fmt::Display for DpEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DpEvent::Gaussian { noise_multiplier } => write!(f, "gaussian(z={noise_multiplier})"),
            DpEvent::DiscreteGaussian {
                sigma,
                l2_sensitivity,
            } => write!(f, "discrete_gaussian(sigma={sigma}, l2={l2_sensitivity})"),
            DpEvent::Laplace { scale } => write!(f, "laplace(b={scale})"),
            DpEvent::EpsilonDelta { epsilon, delta } => {
                write!(f, "epsilon_delta(eps={epsilon}, delta={delta})")
            }
            DpEvent::PoissonSampled {
                sampling_rate,
                event,
            } => write!(f, "poisson(q={sampling_rate}, {event})"),
            DpEvent::SelfComposed { event, count } => write!(f, "{count} x {event}"),
            DpEvent::Composed { events } => {
                f.write_str("compose[")?;
                for (i, e) in events.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{e}")?;
                }
                f.write_str("]")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(z: f64) -> DpEvent {
        DpEvent::Gaussian {
            noise_multiplier: z,
        }
    }

    #[test]
    fn validation_walks_the_tree() {
        let ok = DpEvent::Composed {
            events: vec![
                DpEvent::SelfComposed {
                    event: Box::new(DpEvent::PoissonSampled {
                        sampling_rate: 0.1,
                        event: Box::new(g(1.0)),
                    }),
                    count: 3,
                },
                // The default grid: Delta ~ 2^24, z ~ 1.
                DpEvent::DiscreteGaussian {
                    sigma: 2e7,
                    l2_sensitivity: 16_777_216.0,
                },
                DpEvent::Laplace { scale: 2.0 },
                DpEvent::EpsilonDelta {
                    epsilon: 0.5,
                    delta: 0.0,
                },
            ],
        };
        assert!(ok.validate().is_ok());
        assert!(ok.contains_sampling());
        for bad in [
            g(0.0),
            g(f64::INFINITY),
            DpEvent::DiscreteGaussian {
                sigma: 9.99,
                l2_sensitivity: 1.0,
            },
            // Far above 10 grid units, but its gap bound is ~3e-8.
            DpEvent::DiscreteGaussian {
                sigma: 1000.0,
                l2_sensitivity: 100.0,
            },
            DpEvent::DiscreteGaussian {
                sigma: 20.0,
                l2_sensitivity: 0.0,
            },
            DpEvent::Laplace { scale: 0.0 },
            DpEvent::EpsilonDelta {
                epsilon: 1.0,
                delta: 1.0,
            },
            DpEvent::PoissonSampled {
                sampling_rate: 0.0,
                event: Box::new(g(1.0)),
            },
            DpEvent::SelfComposed {
                event: Box::new(g(1.0)),
                count: 0,
            },
            DpEvent::Composed { events: vec![] },
            DpEvent::Composed {
                events: vec![g(1.0), g(-1.0)],
            },
        ] {
            assert!(bad.validate().is_err(), "{bad}");
        }
        assert!(!g(1.0).contains_sampling());
    }

    #[test]
    fn the_gap_bound_refuses_coarse_grids_only() {
        // z = 1: the bound is about 0.344 / sigma^2, so 1e-12 needs sigma >= ~5.9e5.
        assert!(discrete_gaussian_gap_bound(5.8e5, 5.8e5) > DISCRETE_GAUSSIAN_MAX_GAP);
        assert!(discrete_gaussian_gap_bound(5.9e5, 5.9e5) <= DISCRETE_GAUSSIAN_MAX_GAP);
        // The shipped grid, z from 0.3 to 64.
        let delta = (1u64 << 24) as f64;
        for z in [0.3, 1.0, 64.0] {
            assert!(
                discrete_gaussian_gap_bound(z * delta, delta) < 1e-13,
                "z = {z}"
            );
        }
    }

    #[test]
    fn zcdp_rho_is_reported_for_unsampled_gaussians_only() {
        let dg = DpEvent::DiscreteGaussian {
            sigma: 2e7,
            l2_sensitivity: 1e7,
        };
        let both = DpEvent::Composed {
            events: vec![
                DpEvent::SelfComposed {
                    event: Box::new(g(1.0)),
                    count: 3,
                },
                dg.clone(),
            ],
        };
        // 3 / 2 + 1 / (2 * 4)
        assert!((both.zcdp_rho().unwrap() - 1.625).abs() < 1e-15);
        let sampled = DpEvent::PoissonSampled {
            sampling_rate: 0.5,
            event: Box::new(dg),
        };
        assert_eq!(sampled.zcdp_rho(), None);
        assert_eq!(DpEvent::Laplace { scale: 1.0 }.zcdp_rho(), None);
    }

    #[test]
    fn display_is_compact() {
        let e = DpEvent::SelfComposed {
            event: Box::new(DpEvent::PoissonSampled {
                sampling_rate: 0.01,
                event: Box::new(g(1.1)),
            }),
            count: 5,
        };
        assert_eq!(e.to_string(), "5 x poisson(q=0.01, gaussian(z=1.1))");
    }
}
