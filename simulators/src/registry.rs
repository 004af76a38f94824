//! Environments by id: [`make`] builds one, [`list`] describes them all.

use serde::Serialize;

use crate::classic;
use crate::dmc_cartpole::{CartpoleTask, DmcCartpole};
use crate::dosing::DosingEnv;
use crate::env::{Env, SimError};
use crate::hiv::HivEnv;
use crate::riverswim::RiverSwim;
use crate::uva_padova::{UvaPadovaEnv, UvaPadovaOptions};

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
        Entry {
            info: EnvInfo {
                id: "RiverSwim-v0",
                summary: "Osband et al. 2013 RiverSwim: 6 states, 2 actions, one-hot observation",
                max_episode_steps: 20,
            },
            make: || boxed(RiverSwim::new()),
        },
        Entry {
            info: EnvInfo {
                id: "cartpole-balance",
                summary: "DeepMind Control Suite cart-pole balance, force in [-1, 1] x 10 N, smooth reward",
                max_episode_steps: 1000,
            },
            make: || boxed(DmcCartpole::new(CartpoleTask::Balance, false)),
        },
        Entry {
            info: EnvInfo {
                id: "cartpole-swingup",
                summary: "DeepMind Control Suite cart-pole swing-up, force in [-1, 1] x 10 N, smooth reward",
                max_episode_steps: 1000,
            },
            make: || boxed(DmcCartpole::new(CartpoleTask::Swingup, false)),
        },
        Entry {
            info: EnvInfo {
                id: "cartpole-balance_sparse",
                summary: "DeepMind Control Suite cart-pole balance, sparse 0/1 reward",
                max_episode_steps: 1000,
            },
            make: || boxed(DmcCartpole::new(CartpoleTask::Balance, true)),
        },
        Entry {
            info: EnvInfo {
                id: "cartpole-swingup_sparse",
                summary: "DeepMind Control Suite cart-pole swing-up, sparse 0/1 reward",
                max_episode_steps: 1000,
            },
            make: || boxed(DmcCartpole::new(CartpoleTask::Swingup, true)),
        },
        Entry {
            info: EnvInfo {
                id: HivEnv::ID,
                summary: "HIV treatment (Ernst et al. 2006, as RLPy): 4 drug combinations, 5-day steps",
                max_episode_steps: 200,
            },
            make: || boxed(HivEnv::rlpy()),
        },
        Entry {
            info: EnvInfo {
                id: HivEnv::ID_20D,
                summary: "HIV treatment, seed 000 setting: 20-day steps, 50 per episode",
                max_episode_steps: 50,
            },
            make: || boxed(HivEnv::seed000()),
        },
        Entry {
            info: EnvInfo {
                id: DosingEnv::ID_V0,
                summary: "seed 004 Dosing (dosing-rl-gym Diabetic-v0): insulin in mU/min, fixed meals, 10-minute steps",
                max_episode_steps: 143,
            },
            make: || boxed(DosingEnv::v0()),
        },
        Entry {
            info: EnvInfo {
                id: DosingEnv::ID_V1,
                summary: "seed 004 Dosing (dosing-rl-gym Diabetic-v1): insulin in mU/min, random meals per episode",
                max_episode_steps: 143,
            },
            make: || boxed(DosingEnv::v1()),
        },
        Entry {
            info: EnvInfo {
                id: UvaPadovaEnv::ID,
                summary: "UVA/Padova T1D patient (simglucose 0.2.11), basal insulin in U/min, patient adolescent#001",
                max_episode_steps: 480,
            },
            make: || {
                Ok(Box::new(UvaPadovaEnv::new(
                    "adolescent#001",
                    UvaPadovaOptions::default(),
                )?))
            },
        },
    ]
}

/// Builds the environment `id` with its default parameters.
pub fn make(id: &str) -> Result<Box<dyn Env>, SimError> {
    if let Some(gym) = crate::gym_bridge::env_id_of(id) {
        return Err(SimError::Invalid(format!(
            "{id}: Gymnasium environments run in the client agent's Python workers \
             (fedrl_sim::gym_bridge::GymPool, made in batches by the DPPG trainer); they cannot \
             be built one at a time here, so this program (aggregator, `fedrl sim`, evaluation) \
             cannot step {gym:?}"
        )));
    }
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
