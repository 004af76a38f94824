//! Environments by id: [`make`] builds one, [`list`] describes them all.

use serde::Serialize;

use crate::classic;
use crate::env::{Env, SimError};

/// What [`list`] tells about one environment.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EnvInfo {
    /// The id [`make`] accepts, e.g. `CartPole-v1`.
    pub id: &'static str,
    /// One line: what it simulates and where it comes from.
    pub summary: &'static str,
    /// Steps after which an episode is truncated.
    pub max_episode_steps: u32,
}

struct Entry {
    info: EnvInfo,
    make: fn() -> Result<Box<dyn Env>, SimError>,
}

fn boxed<E: Env + 'static>(e: E) -> Result<Box<dyn Env>, SimError> {
    Ok(Box::new(e))
}

fn entries() -> Vec<Entry> {
    vec![
        Entry {
            info: EnvInfo {
                id: "CartPole-v1",
                summary: "Gymnasium 1.4.0 cart-pole balancing, 2 discrete pushes of 10 N",
                max_episode_steps: 500,
            },
            make: || boxed(classic::CartPole::new()),
        },
        Entry {
            info: EnvInfo {
                id: "Acrobot-v1",
                summary: "Gymnasium 1.4.0 two-link acrobot swing-up (book dynamics, RK4), torques -1/0/+1 N m",
                max_episode_steps: 500,
            },
            make: || boxed(classic::Acrobot::new()),
        },
        Entry {
            info: EnvInfo {
                id: "Pendulum-v1",
                summary: "Gymnasium 1.4.0 pendulum swing-up, continuous torque clipped to [-2, 2] N m",
                max_episode_steps: 200,
            },
            make: || boxed(classic::Pendulum::new()),
        },
        Entry {
            info: EnvInfo {
                id: "MountainCar-v0",
                summary: "Gymnasium 1.4.0 mountain car, 3 discrete accelerations",
                max_episode_steps: 200,
            },
            make: || boxed(classic::MountainCar::new()),
        },
    ]
}

/// Builds the environment `id` with its default parameters.
pub fn make(id: &str) -> Result<Box<dyn Env>, SimError> {
    match entries().into_iter().find(|e| e.info.id == id) {
        Some(e) => (e.make)(),
        None => Err(SimError::Invalid(format!(
            "unknown environment {id:?}; known: {}",
            list().iter().map(|i| i.id).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// Every environment [`make`] knows, in a stable order.
pub fn list() -> Vec<EnvInfo> {
    entries().into_iter().map(|e| e.info).collect()
}
