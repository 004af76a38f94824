//! The central update mode's per-kind computation (DESIGN §2.5): what the aggregator, as the
//! trusted curator, asks of a task kind whose units upload their transitions. The service
//! (`aggregator/src/service/central.rs`) keeps the uploads, their bounds and the rounds' work;
//! a kind only says how its uploads look and how a round's units become clipped gradients.
//!
//! Rules (DESIGN §3), the same as for a federated agent's [`crate::LocalTrainer`]: a unit's
//! gradient depends only on that unit's data, the offered vector and public numbers (round,
//! seeds), never on the other units of the batch; each is clipped to the round's clip norm.

use fedrl_common::protocol::UnitId;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::per_example::SummedGradient;
use fedrl_rl::offline::qnet::QNetSpec;

/// A kind's central computation, built once per run from its scenario.
pub trait CentralGradients: Send {
    /// The shape uploads are checked against when decoded (`obs_dim`, `n_actions`; the hidden
    /// widths are not read).
    fn row_spec(&self) -> &QNetSpec;
    /// The most transitions one unit's upload may hold (a public bound from the dataset's
    /// shape).
    fn max_unit_rows(&self) -> u64;
    /// The summed path: the sum of the given units' clipped gradients in f64, their norms and
    /// clip factors in the order of the units with data (see
    /// `fedrl_rl::offline::per_example::summed_clipped`). `clip_norm` is finite.
    fn summed(
        &self,
        offer: &[f32],
        units: &[(UnitId, &TransitionBatch)],
        round: u64,
        clip_norm: f64,
    ) -> fedrl_rl::Result<SummedGradient>;
    /// The per-unit path: every given unit's clipped gradient (`clip_norm` may be +inf for a
    /// non-private twin).
    fn per_unit(
        &self,
        offer: &[f32],
        units: &[(UnitId, &TransitionBatch)],
        round: u64,
        clip_norm: f64,
    ) -> fedrl_rl::Result<Vec<(UnitId, Vec<f32>)>>;
}
