//! fedrl-rl: the learning side of fedrl, neural models (candle), RL losses, rollouts and local
//! updates, shared by the client agent and the aggregator. The privacy core and the wire protocol
//! (`fedrl-common`) stay free of candle and the simulators; this crate depends on both.
//!
//! Every tensor is made on a [`Device`](candle_core::Device) passed in ([`device::open`] turns the
//! scenario's `device` name into one); parameters travel as `Vec<f32>` and are moved to and from
//! the device at the edges of [`local_updates`], [`collect_rollouts`] and [`evaluate`].
//! Building each scenario task's model (its dimension, the checks that need it) is the task
//! kinds' business, in `fedrl-tasks`.
//!
//! The pieces of the DPPG client step (seed 004, Algorithms 2 and 3):
//! - [`mlp`]: the model description ([`ModelSpec`]), the flat parameter layout ([`ParamLayout`]),
//!   seeded orthogonal initialisation and the batched tanh-MLP forward pass;
//! - [`alloc`]: glibc allocator settings for training processes (call once in `main`);
//! - [`activation`]: the tanh of the MLPs (a fast rational approximation on the CPU);
//! - [`policy`] / [`value`]: categorical and diagonal-Gaussian policy heads, the value network;
//! - [`io`]: safetensors save/load with PyTorch-compatible names (`policy.0.weight`, ...);
//!   every safetensors file of this crate is written and read through [`tensor_io`];
//! - [`ppo`]: GAE and the PPO loss over many users' stacked parameter copies;
//! - [`rollout`]: acting in many environments at once with one forward pass per step;
//! - [`local_update`]: the per-user local PPO update, batched across users, clipped to C;
//! - [`evaluate`]: mean return of a policy on held-out users;
//! - [`loglinear`]: the log-linear policy, linear baseline and REINFORCE of seed 004's Riverswim
//!   experiments (plain f64, no candle).
//!
//! [`diffusion`] holds PrivORL's diffusion synthesizer (seed 003) and [`fidelity`] the marginal
//! and correlation scores of a synthetic table against real rows; [`audit`] the empirical
//! privacy audits (membership inference) any DP-SGD run can report.
//!
//! [`sac`] is Soft Actor-Critic (twin critics, learned temperature), its replay buffer and an
//! online trainer over continuous-action environments: the learning agent behind the offline
//! datasets and the policy optimiser of seed 001.
//!
//! Parameters travel as one `Vec<f32>`: every tensor of [`ParamLayout`] in order, each in
//! PyTorch's row-major layout (`weight` is `[out, in]`). Internally the stacked copies keep
//! weights as `[users, in, out]` so that the batched matmul needs no transpose.

pub mod activation;
pub mod alloc;
pub mod audit;
pub mod device;
pub mod diffusion;
pub mod ensemble;
mod ensemble_cpu;
pub mod evaluate;
pub mod fidelity;
pub mod io;
pub mod local_update;
pub mod loglinear;
pub mod mlp;
pub mod offline;
pub mod policy;
pub mod ppo;
pub mod primorl;
pub mod rollout;
pub mod sac;
pub mod server_rule;
pub mod tensor_io;
pub mod value;

pub use device::DeviceError;
pub use evaluate::{EvalConfig, EvalResult, evaluate};
pub use local_update::{
    LocalUpdate, LocalUpdateConfig, LocalUpdateExt, local_updates, local_updates_from_batches,
    local_updates_from_batches_adam_init, local_updates_own,
};
pub use mlp::{ActionKind, ModelSpec, ParamLayout, ParamSpec, RowMlp, RowScratch};
pub use rollout::{RolloutConfig, UserBatch, collect_rollouts, collect_rollouts_own};
pub use sac::{
    EpisodeLog, OnlineOptions, ReplayBuffer, SacAgent, SacBatch, SacConfig, SacStats, td_target,
    train_online,
};

// Callers name the device type through this crate, so they need no candle dependency of their own.
pub use candle_core;

use thiserror::Error;

/// Errors of the learning layer.
#[derive(Debug, Error)]
pub enum NnError {
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("simulator: {0}")]
    Sim(#[from] fedrl_sim::SimError),
    #[error("safetensors: {0}")]
    SafeTensors(#[from] safetensors::SafeTensorError),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("parameter vector has {got} values, the layout needs {expected}")]
    ParamLength { got: usize, expected: usize },
    #[error("{0}")]
    Invalid(String),
    /// Per-unit DP-SGD: the gradient norm of the units at these positions of the batch (the
    /// order of the units with rows) is not finite: their data (or the model) overflowed.
    #[error(
        "the gradient norm of the unit(s) at batch position(s) {units:?} is not finite (absurd data, or diverged parameters?)"
    )]
    NonFiniteUnits { units: Vec<usize> },
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, NnError>;
