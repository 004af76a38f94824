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
pub mod tensorboard;
pub mod tls;

/// The engine configuration of `scenario`: its task's [`engine::Shapes`] computed by the task's
/// kind (fedrl-tasks), then [`engine::EngineConfig::for_scenario`]. What the service runs with,
/// and what a replay of its journal must use.
pub fn engine_config(
    scenario: &fedrl_common::scenario::Scenario,
) -> anyhow::Result<engine::EngineConfig> {
    use fedrl_tasks::TaskExt;
    let shapes = engine::Shapes {
        dim: scenario.task.dim()?,
        offer_dim: scenario.task.offer_dim()?,
        transitions: scenario.task.transition_shape()?,
    };
    Ok(engine::EngineConfig::for_scenario(scenario, shapes)?)
}

pub use fedrl_tasks::server::{ModelError, ModelState, ServerModel, ServerOptimizer, ServerRule};
pub use service::{AggregatorOptions, RunReport};
