//! The privacy core: what ran ([`event::DpEvent`]), how it is accounted (analytic Gaussian, RDP,
//! PLD), clipping, noise and the append-only ledger. No candle, no tokio.

pub mod accountant;
pub mod clipping;
pub mod composition;
pub mod discrete_gaussian;
pub mod error;
pub mod event;
pub mod expert_answers;
pub mod expert_plan;
pub mod expert_release;
pub mod fixed_point;
pub mod gaussian;
pub mod laplace;
pub mod ledger;
pub mod noise;
pub mod params;
pub mod pld;
pub mod rdp;
pub mod svt;
pub mod trust_region;

pub use error::PrivacyError;
pub use event::DpEvent;
pub use params::{ClipNorm, Delta, NoiseMultiplier, ParamError, SamplingRate};
