//! Descriptions of the mechanisms that ran, independent of how they are accounted (as
//! dp_accounting's `DpEvent` tree). The ledger stores these, so a better accountant can later
//! re-account an old run without re-running it.

use serde::{Deserialize, Serialize};

/// One differentially private computation, as run. Sensitivities are normalised to 1: a Gaussian
/// with noise multiplier z adds N(0, (z C)^2) to a sum of contributions clipped to L2 norm C.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DpEvent {
    /// Gaussian mechanism with noise standard deviation `noise_multiplier` x sensitivity.
    Gaussian { noise_multiplier: f64 },
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
