//! Offline RL (DESIGN §2.2-2.5): datasets held by privacy units, discrete CQL, and the per-unit
//! clipped gradients of DP-SGD shared by the federated and the central update modes.
//!
//! - [`dataset`]: episodes owned by units and their summary; [`generate`]: their generation by
//!   a named, seeded procedure; [`cache`]: the on-disk cache keyed by that procedure;
//!   [`minari`]: Minari's Arrow/Parquet layout (read and write), and with the `hdf5` feature
//!   `hdf5`: its HDF5 storage (read); [`experts`]: seed 000/002's
//!   experts (trained, softened, stored with their demonstrations) and their count queries;
//! - [`batch`]: transitions as flat arrays, the unit of every loss;
//! - [`qnet`], [`cql`]: the Q-network and the discrete CQL loss; [`per_example`]: per-example
//!   gradients and per-unit clipping; [`adam`]: the flat-vector Adam both trainers use;
//!   [`train`]: the non-private CQL trainer and the greedy evaluation; [`dpsgd`]: one DP-SGD
//!   step's per-unit work, shared by the federated agent and the central aggregator;
//!   [`td3bc`]: TD3+BC for continuous-action datasets (PrivORL's downstream learner).
//! - stored datasets a scenario names (`[task.dataset] name = ...`): [`cache::load_source_units`]
//!   (found, checked, episodes mapped to units by [`minari::read_mapped`]); Box-action Minari
//!   datasets are read by [`minari::read_box`] and imported by [`continuous::import_minari`].

pub mod adam;
pub mod batch;
pub mod cache;
pub mod continuous;
pub mod cql;
pub mod dataset;
pub mod dpsgd;
pub mod experts;
pub mod generate;
pub mod gym;
#[cfg(feature = "hdf5")]
pub mod hdf5;
pub mod minari;
pub mod per_example;
pub mod qnet;
pub mod td3bc;
pub mod train;

pub use adam::Adam;
pub use batch::TransitionBatch;
pub use cache::{data_root, load_or_generate, load_or_generate_units, load_source_units};
pub use cql::loss_and_grad;
pub use dataset::{Dataset, DatasetSummary, Episode};
pub use experts::{ExpertReturns, ExpertSet};
pub use generate::generate;
pub use per_example::{
    SummedGradient, UnitGradients, clipped_sum, per_unit_clipped, summed_clipped,
};
pub use qnet::QNetSpec;
pub use train::{CqlTrainer, evaluate_greedy, evaluate_greedy_for, evaluate_greedy_in, train_cql};
