//! fedrl-tasks: every task kind in one place. Each kind's folder holds what is specific to it
//! (its shapes, its client trainer, its server model, their tests); the traits the client agent
//! and the aggregator drive live beside the one registry that maps a scenario's task to a kind.
//! The transport, the round engine and the drivers (`fedrl-client`, `fedrl-aggregator`) know no
//! particular kind.
//!
//! - [`client`]: [`LocalTrainer`] (a client agent's local updates) and its optional
//!   capabilities ([`CentralData`], [`ExpertHost`]).
//! - [`server`]: [`ServerModel`] (the aggregator's model), its optional capability
//!   ([`TrainsOnStableData`]) and the shared server optimizer.
//! - [`eval_snapshots`]: released models kept in the state directory for the evaluations the
//!   aggregator leaves to `fedrl run` (Gymnasium environments: no Python in the aggregator).
//! - [`registry`]: the table of kinds: dimensions, [`default_factory`], [`server_model`],
//!   scenario loading.
//! - One folder per kind: [`mean_estimation`], [`dppg`], [`loglinear`], [`offline_cql`],
//!   [`primorl`], [`privorl`]. Adding one: docs/adding-a-task-kind.md.

pub mod central;
pub mod client;
pub mod eval_snapshots;
pub mod registry;
pub mod server;
pub mod stored;

pub mod dppg;
pub mod loglinear;
pub mod mean_estimation;
pub mod offline_cql;
pub mod primorl;
pub mod privorl;

pub use central::CentralGradients;
pub use client::{CentralData, ExpertHost, LocalTrainer, TrainerFactory, UnitUpload};
pub use registry::{
    Models, TaskExt, TaskKind, central_gradients, default_factory, scenario_from_file,
    scenario_from_toml_str, server_model,
};
pub use server::{
    EvaluationDone, EvaluationJob, ModelError, ModelState, ServerModel, ServerOptimizer,
    ServerRule, TrainsOnStableData,
};
