//! fedrl-sim: the environments of the seed papers behind one object-safe [`Env`] trait, and user
//! populations (per-user parameters as a pure function of population, seed and user index).
//! No networking and no candle: simulators are plain, fast Rust.

pub mod env;
pub mod replay;

pub use env::{Action, Env, SimError, Space, Step};
