//! fedrl-client: the client agent. It hosts many simulated users, answers the aggregator's round
//! offers for the users it hosts, computes and clips each user's local update, and talks QUIC.
//!
//! - [`trainer`]: the [`LocalTrainer`] trait (batched local updates for the hosted units) and the
//!   [`TrainerFactory`] that builds one from the server's welcome; mean estimation is built in.
//! - [`agent`]: the runtime ([`run_agent`]): pinned-certificate connection, token join,
//!   reconnection with backoff, churn model.
//! - [`tls`]: certificate pinning by SHA-256 fingerprint.

pub mod agent;
pub mod cql;
pub mod dppg;
pub mod loglinear;
pub mod primorl;
pub mod tls;
pub mod trainer;

pub use agent::{AgentError, AgentOptions, AgentSummary, parse_unit_ranges, run_agent};
pub use trainer::{LocalTrainer, MeanEstimationTrainer, TrainerFactory, default_factory};
