//! Descriptions of the mechanisms that ran, independent of how they are accounted (as
//! dp_accounting's `DpEvent` tree). The ledger stores these, so a better accountant can later
//! re-account an old run without re-running it.

use serde::{Deserialize, Serialize};

use super::PrivacyError;

/// The smallest discrete Gaussian standard deviation, in grid units, the ledger accepts: from
/// there on the slack term of Canonne-Kamath-Steinke's multivariate bound is below f64 resolution
/// (see [`DpEvent::DiscreteGaussian`]).
pub const DISCRETE_GAUSSIAN_MIN_SIGMA: f64 = 10.0;

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
    /// Accounted exactly as `Gaussian { noise_multiplier: sigma / l2_sensitivity }`: Canonne,
    /// Kamath and Steinke (NeurIPS 2020) show the multivariate discrete Gaussian has the
    /// concentrated-DP curve of the continuous one up to a slack term
    /// tau = 10 sum_k exp(-2 pi^2 sigma^2 k / (k + 1)) <= 10 d exp(-pi^2 sigma^2). For sigma >= 10
    /// ([`DISCRETE_GAUSSIAN_MIN_SIGMA`], which the ledger enforces) that is below
    /// exp(-980): far below f64 resolution, so the equivalence is exact in the arithmetic the
    /// accountants use.
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
    /// multiplier positive and finite, discrete Gaussian sigma >= [`DISCRETE_GAUSSIAN_MIN_SIGMA`]
    /// and sensitivity positive (both finite), Laplace scale positive and finite, epsilon >= 0
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
                DpEvent::DiscreteGaussian {
                    sigma: 10.0,
                    l2_sensitivity: 4.0,
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
