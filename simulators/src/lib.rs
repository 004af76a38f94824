//! fedrl-sim: the environments of the seed papers behind one object-safe [`Env`] trait, and user
//! populations (per-user parameters as a pure function of population, seed and user index).
//! No networking and no candle: simulators are plain, fast Rust.
//!
//! Start with [`make`] (an environment by id) and [`list`] (every id).

pub mod classic;
pub mod clinical;
pub mod controllers;
pub mod dmc_cartpole;
pub mod env;
pub mod gym_bridge;
pub mod mujoco_newton;
pub mod np_rng;
pub mod population;
pub mod registry;
pub mod replay;
pub mod riverswim;
mod trace_json;

// The healthcare simulators and their shared ODE solver (written by another helper).
pub mod dosing;
pub mod hiv;
pub mod ode;
pub mod uva_padova;

pub use env::{Action, Env, GlucoseSample, SimError, Space, Step};
pub use population::Population;
pub use registry::{EnvInfo, list, make};
