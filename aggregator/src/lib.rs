//! fedrl-aggregator: the QUIC server, the sans-IO round engine, server-side clipping and noise,
//! the privacy ledger, central training and checkpoints.
//!
//! - [`engine`]: the round engine, a pure state machine (events in, actions out).
//! - [`journal`]: the append-only journal of the events fed to the engine, and their replay.
//! - [`model`]: the [`ServerModel`] trait (the central model and its server optimizer) and the
//!   mean-estimation model; [`tasks::server_model`] picks one for a scenario ([`dppg`]: the PPO
//!   policy; [`loglinear`]: the log-linear policy with the L2 trust-region clip).
//! - [`service`]: the QUIC service that drives the engine ([`service::run`]).
//! - [`checkpoint`], [`state`], [`tls`]: durable state, TLS identity (frame I/O is
//!   `fedrl_common::protocol::quic_io`).

pub mod checkpoint;
pub mod cql;
pub mod dppg;
pub mod engine;
pub mod journal;
pub mod loglinear;
pub mod model;
pub mod primorl;
pub mod service;
pub mod state;
pub mod tasks;
pub mod tls;

pub use model::{ModelError, ModelState, ServerModel, ServerOptimizer, ServerRule};
pub use service::{AggregatorOptions, RunReport};
