//! Offline RL (DESIGN §2.2-2.5): datasets held by privacy units, discrete CQL, and the per-unit
//! clipped gradients of DP-SGD shared by the federated and the central update modes.
//!
//! - [`dataset`]: episodes owned by units, their generation by a seeded procedure, the on-disk
//!   cache; [`minari`]: Minari's Arrow/Parquet layout (read and write);
//! - [`batch`]: transitions as flat arrays, the unit of every loss;
//! - [`qnet`], [`cql`]: the Q-network and the discrete CQL loss; [`per_example`]: per-example
//!   gradients and per-unit clipping; [`adam`]: the flat-vector Adam both trainers use;
//!   [`train`]: the non-private CQL trainer and the greedy evaluation.

pub mod adam;
pub mod batch;
pub mod cql;
pub mod dataset;
pub mod dpsgd;
pub mod generate;
pub mod per_example;
pub mod qnet;
pub mod train;

pub use adam::Adam;
pub use batch::TransitionBatch;
pub use cql::loss_and_grad;
pub use dataset::{Dataset, Episode};
pub use per_example::{UnitGradients, clipped_sum, per_unit_clipped};
pub use qnet::QNetSpec;
pub use train::{CqlTrainer, evaluate_greedy, train_cql};
