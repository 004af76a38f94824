//! fedrl-aggregator: the QUIC server, the sans-IO round engine, server-side clipping and noise,
//! the privacy ledger, central training and checkpoints.
//!
//! - [`engine`]: the round engine, a pure state machine (events in, actions out).
//! - [`journal`]: the append-only journal of the events fed to the engine, and their replay.
//! - The task kinds (the [`ServerModel`] trait, its server optimizer, each kind's model, and
//!   `fedrl_tasks::server_model`, which picks one for a scenario) live in `fedrl-tasks`; the
//!   engine and the service know no particular kind.
//! - [`service`]: the QUIC service that drives the engine ([`service::run`]).
//! - [`checkpoint`], [`state`], [`tls`]: durable state, TLS identity (frame I/O is
//!   `fedrl_common::protocol::quic_io`).

pub mod checkpoint;
pub mod engine;
pub mod journal;
pub mod service;
pub mod state;
pub mod tls;

pub use fedrl_tasks::server::{ModelError, ModelState, ServerModel, ServerOptimizer, ServerRule};
pub use service::{AggregatorOptions, RunReport};
