//! fedrl-client: the client agent. It hosts many simulated users, answers the aggregator's round
//! offers for the users it hosts, computes and clips each user's local update, and talks QUIC.
//!
//! - The task kinds (the [`LocalTrainer`] trait, the [`TrainerFactory`] that builds one from the
//!   server's welcome, each kind's trainer) live in `fedrl-tasks`; this crate knows none of them.
//! - [`agent`]: the runtime ([`run_agent`]): pinned-certificate connection, token join,
//!   reconnection with backoff, churn model.
//! - [`tls`]: certificate pinning by SHA-256 fingerprint.

pub mod agent;
pub mod tls;

pub use agent::{AgentError, AgentOptions, AgentSummary, parse_unit_ranges, run_agent};
pub use fedrl_tasks::{LocalTrainer, TrainerFactory, default_factory};
