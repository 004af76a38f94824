//! User populations: how each user's environment differs.
//!
//! User `i`'s parameters are a pure function of (population name, seed, `i`): a ChaCha8 stream
//! keyed by a hash of the three (counter-based, no shared state), so the same user gets the same
//! simulator on every machine and in every process, in any order of creation.
//!
//! Populations (see [`list`]):
//! - `cartpole-b1`: seed 000 appendix B.1 — gravity in linspace(8.75, 11.0, 10) m/s^2, push
//!   force in linspace(9.0, 11.25, 10) N, cart mass in linspace(0.8, 1.25, 10) kg; each user
//!   draws one of the 1,000 grid cells uniformly.
//! - `acrobot-b1`: seed 000 B.1 — both link lengths in linspace(0.8, 1.2, 10) m, link masses in
//!   linspace(0.9, 1.1, 10) kg each; 1,000 cells. As in Gymnasium (whose attributes the paper
//!   changed), link length 1 enters the dynamics and link length 2 does not.
//! - `pendulum-gml`: Pendulum-v1 with other physics (PrivORL's public data of the same domain,
//!   seed 003 appendix D): gravity in {8, 9, 11, 12} m/s^2, mass in {0.8, 0.9, 1.1, 1.2} kg and
//!   length in {0.8, 0.9, 1.1, 1.2} m (Gymnasium's 10, 1 and 1 left out, so no user has
//!   Pendulum-v1's value of any of the three); each user draws one of the 64 cells uniformly.
//! - `hiv-b1`: seed 000 B.1 — HIV treatment (20-day steps x 50) with the drug-1 penalty in
//!   linspace(18750, 21250, 50), the drug-2 penalty in linspace(1850, 2150, 20) and efficacy
//!   noise off or N(0, 0.01); each user draws one of the 2,000 settings.
//! - `uva-padova`, `uva-padova-adolescents`, `uva-padova-adults`, `uva-padova-children`: each
//!   user is one of simglucose's 30 (or 10) virtual patients, drawn uniformly, scored by minus
//!   the day's summed risk index (`UvaReward::DayRisk`, not simglucose's telescoping risk_diff).
//! - `uva-padova-pump`, `uva-padova-pump-meals`: the same 30 patients behind a closed-loop pump
//!   (`UvaPadovaOptions::pump`): a decision every 30 minutes on an hour of noisy CGM, insulin on
//!   board and the time of day, acting relative to the programmed therapy; the first also sees
//!   that therapy (correction factor, carbohydrate ratio, age), the second instead sees
//!   announced meals and sets a pre-meal bolus.
//! - `dosing-fixed-meals`: each user eats the same personal day every day, drawn once from
//!   Dosing-v1's meal generator (seed 004: "each patient has a different meal pattern").
//! - `dosing-meal-habits`: each user has personal habits (meal times shifted by N(0, 0.5 h),
//!   meal sizes scaled by U(0.8, 1.2), meal probabilities scaled by U(0.8, 1.2)) and a new random
//!   day every episode.
//! - any environment id (e.g. `CartPole-v1`): every user gets the default environment.
//! - `gymnasium:<id>`: any Gymnasium environment; its users' environments (and their drawn
//!   keyword arguments) come from the client agent's Python workers ([`crate::gym_bridge`]),
//!   so [`Population::user_env`] refuses them with a message saying so.

use rand::rngs::ChaCha8Rng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};

use rand::RngExt;
use rand_distr::{Distribution, StandardNormal};

use crate::classic::{Acrobot, CartPole, Pendulum};
use crate::dosing::{DosingEnv, DosingMeals, DosingOptions, MealGenerator};
use crate::env::{Env, SimError};
use crate::hiv::{HivEnv, HivParams};

/// What [`list`] tells about one population.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PopulationInfo {
    /// The name [`Population::new`] accepts.
    pub name: &'static str,
    /// The environment every user runs (with user-specific parameters).
    pub env_id: &'static str,
    /// Number of distinct user settings (0 = continuous or unbounded).
    pub settings: u64,
    pub summary: &'static str,
}

/// Every named population (environment ids are accepted too, as homogeneous populations).
pub fn list() -> Vec<PopulationInfo> {
    vec![
        PopulationInfo {
            name: "cartpole-b1",
            env_id: "CartPole-v1",
            settings: 1000,
            summary: "seed 000 B.1: gravity x push force x cart mass, 10 values each",
        },
        PopulationInfo {
            name: "acrobot-b1",
            env_id: "Acrobot-v1",
            settings: 1000,
            summary: "seed 000 B.1: link length (both) x mass 1 x mass 2, 10 values each",
        },
        PopulationInfo {
            name: "pendulum-gml",
            env_id: "Pendulum-v1",
            settings: PENDULUM_GML_CELLS,
            summary: "Pendulum-v1 with gravity x mass x length off Gymnasium's values, 4 each",
        },
        PopulationInfo {
            name: "hiv-b1",
            env_id: "HIVTreatment20d-v0",
            settings: 2000,
            summary: "seed 000 B.1: drug penalties (50 x 20) x efficacy noise (off, 0.01)",
        },
        PopulationInfo {
            name: "uva-padova",
            env_id: "UvaPadova-v0",
            settings: 30,
            summary: "simglucose's 30 virtual patients (adolescents, adults, children)",
        },
        PopulationInfo {
            name: "uva-padova-adolescents",
            env_id: "UvaPadova-v0",
            settings: 10,
            summary: "simglucose's 10 virtual adolescents",
        },
        PopulationInfo {
            name: "uva-padova-adults",
            env_id: "UvaPadova-v0",
            settings: 10,
            summary: "simglucose's 10 virtual adults",
        },
        PopulationInfo {
            name: "uva-padova-children",
            env_id: "UvaPadova-v0",
            settings: 10,
            summary: "simglucose's 10 virtual children",
        },
        PopulationInfo {
            name: "uva-padova-pump",
            env_id: "UvaPadova-v0",
            settings: 30,
            summary: "the 30 patients behind a closed-loop pump (CGM hour, insulin on board, time of day, therapy)",
        },
        PopulationInfo {
            name: "uva-padova-pump-meals",
            env_id: "UvaPadova-v0",
            settings: 30,
            summary: "uva-padova-pump with announced meals and a pre-meal bolus",
        },
        PopulationInfo {
            name: "dosing-fixed-meals",
            env_id: "Dosing-v0",
            settings: 0,
            summary: "seed 004 Dosing: a personal fixed meal day per user",
        },
        PopulationInfo {
            name: "dosing-meal-habits",
            env_id: "Dosing-v1",
            settings: 0,
            summary: "seed 004 Dosing: personal meal times, sizes and probabilities, random days",
        },
    ]
}

#[derive(Clone, Debug, PartialEq)]
enum Kind {
    Homogeneous(String),
    CartPoleB1,
    AcrobotB1,
    PendulumGml,
    HivB1,
    UvaPadova(Option<&'static str>, PumpSetting),
    DosingFixedMeals,
    DosingMealHabits,
}

/// A population of users with their own simulator parameters. Cheap to clone and share.
#[derive(Clone, Debug, PartialEq)]
pub struct Population {
    name: String,
    seed: u64,
    kind: Kind,
    pump: PumpOverrides,
}

/// A scenario's changes to the pump setting of the `uva-padova-pump*` populations
/// ([`crate::uva_padova::UvaPadovaOptions::pump`]); `None` keeps the setting's own value.
/// The reward weight and the decision interval concern the policy only (the baseline
/// controllers decide every CGM sample and are scored on blood glucose); the low-glucose
/// suspend and the insulin-on-board limit are the pump's, so the baselines run behind them too
/// ([`Self::apply_pump_rules`], [`crate::controllers::user_env`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PumpOverrides {
    /// Weight of the low branch of the risk index in the reward (1 = Kovatchev's symmetric
    /// index; the setting's own is [`crate::uva_padova::PUMP_LOW_RISK_WEIGHT`]).
    pub low_risk_weight: Option<f64>,
    /// Minutes per decision, a multiple of the 3-minute CGM sample (the setting's own: 30).
    pub decision_min: Option<u32>,
    /// The pump's predictive low-glucose suspend
    /// ([`crate::uva_padova::LowGlucoseSuspend`]; the setting's own: off).
    pub low_glucose_suspend: Option<bool>,
    /// The pump's insulin-on-board limit ([`crate::uva_padova::IobLimit`]; the setting's own:
    /// off).
    pub iob_limit: Option<bool>,
    /// Exponent in [0, 1] of the patient's insulin sensitivity by which the policy's basal
    /// above the programmed rate is scaled ([`crate::uva_padova::sensitivity_scale`]; the
    /// setting's own: 0, none). The policy's action only: the baselines set U/min.
    pub sensitivity_scaling: Option<f64>,
}

impl PumpOverrides {
    /// Sets the pump's own safety rules (low-glucose suspend, insulin-on-board limit) on any
    /// controller's options; the policy-only fields are left to the caller.
    pub fn apply_pump_rules(&self, opts: &mut crate::uva_padova::UvaPadovaOptions) {
        if let Some(on) = self.low_glucose_suspend {
            opts.low_glucose_suspend = on;
        }
        if let Some(on) = self.iob_limit {
            opts.iob_limit = on;
        }
    }
}

/// One user's parameters.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum UserParams {
    /// The environment's defaults.
    Default { env_id: String },
    /// CartPole with seed 000 B.1 parameters; `cell` = grid indices (gravity, force, mass).
    CartPole {
        gravity: f64,
        force_mag: f64,
        masscart: f64,
        cell: [u32; 3],
    },
    /// Acrobot with seed 000 B.1 parameters; `cell` = grid indices (length, mass 1, mass 2).
    Acrobot {
        link_length: f64,
        link_mass_1: f64,
        link_mass_2: f64,
        cell: [u32; 3],
    },
    /// Pendulum-v1 with other physics (`pendulum-gml`); `cell` = indices (gravity, mass,
    /// length) into the population's four values of each.
    Pendulum {
        /// Gravitational acceleration (m/s^2).
        g: f64,
        /// Mass (kg).
        m: f64,
        /// Length (m).
        l: f64,
        cell: [u32; 3],
    },
    /// HIV treatment with seed 000 B.1 settings; `setting` indexes
    /// [`HivParams::expert_variation`].
    Hiv {
        eps1_penalty: f64,
        eps2_penalty: f64,
        efficacy_noise_sd: f64,
        setting: u32,
    },
    /// A UVA/Padova virtual patient behind the given pump.
    Patient { name: String, pump: PumpSetting },
    /// Dosing with a personal fixed day: the disturbance at every grid point.
    DosingFixedMeals { disturbance: Vec<f64> },
    /// Dosing with personal meal habits (Dosing-v1's generator, adjusted).
    DosingMealHabits {
        /// Meal time means (hours after midnight).
        time_mu_h: [f64; 6],
        /// Meal size means (disturbance units).
        amount_mu: [f64; 6],
        /// Probabilities of taking each meal.
        prob: [f64; 6],
    },
}

/// What a UVA/Padova user's controller sees and sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PumpSetting {
    /// The CGM reading in, a basal rate (U/min) out, a decision every 3 minutes.
    #[default]
    Basal,
    /// `UvaPadovaOptions::pump(false)`.
    Pump,
    /// `UvaPadovaOptions::pump(true)`.
    PumpMeals,
}

/// numpy's `linspace(lo, hi, n)[k]` (the last point is exactly `hi`).
fn linspace(lo: f64, hi: f64, n: u32, k: u32) -> f64 {
    if k + 1 == n {
        return hi;
    }
    lo + f64::from(k) * ((hi - lo) / f64::from(n - 1))
}

/// SplitMix64's finaliser: a bijective 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform integer in `0..n` from 64 random bits (multiply-shift; bias below 2^-50 here).
fn below(rng: &mut ChaCha8Rng, n: u64) -> u64 {
    ((u128::from(rng.next_u64()) * u128::from(n)) >> 64) as u64
}

/// Cells of `pendulum-gml`: four values of each of gravity, mass and length.
const PENDULUM_GML_CELLS: u64 = 64;

/// Dosing's grid: 24 h at 10-minute intervals, both ends included.
const DOSING_GRID_POINTS: usize = 24 * 60 / 10 + 1;

const PATIENT_GROUPS: [&str; 3] = ["adolescent", "adult", "child"];

impl Population {
    /// A named population (see [`list`]) or, for an environment id, a homogeneous one.
    pub fn new(name: &str, seed: u64) -> Result<Self, SimError> {
        let kind = match name {
            "cartpole-b1" => Kind::CartPoleB1,
            "acrobot-b1" => Kind::AcrobotB1,
            "pendulum-gml" => Kind::PendulumGml,
            "hiv-b1" => Kind::HivB1,
            "uva-padova" => Kind::UvaPadova(None, PumpSetting::Basal),
            "uva-padova-adolescents" => Kind::UvaPadova(Some("adolescent"), PumpSetting::Basal),
            "uva-padova-adults" => Kind::UvaPadova(Some("adult"), PumpSetting::Basal),
            "uva-padova-children" => Kind::UvaPadova(Some("child"), PumpSetting::Basal),
            "uva-padova-pump" => Kind::UvaPadova(None, PumpSetting::Pump),
            "uva-padova-pump-meals" => Kind::UvaPadova(None, PumpSetting::PumpMeals),
            "dosing-fixed-meals" => Kind::DosingFixedMeals,
            "dosing-meal-habits" => Kind::DosingMealHabits,
            // A Gymnasium environment: its users are made by the client agent's bridge workers
            // (`crate::gym_bridge`), never one at a time here (see `crate::make`).
            id if crate::gym_bridge::env_id_of(id).is_some_and(|e| !e.is_empty()) => {
                Kind::Homogeneous(id.to_string())
            }
            id => {
                // Fails early for unknown names.
                crate::make(id).map_err(|_| {
                    SimError::Invalid(format!(
                        "unknown population {id:?}: expected one of {} or an environment id",
                        list().iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
                    ))
                })?;
                Kind::Homogeneous(id.to_string())
            }
        };
        Ok(Population {
            name: name.to_string(),
            seed,
            kind,
            pump: PumpOverrides::default(),
        })
    }

    /// This population with the pump setting changed as `pump` says. Only the
    /// `uva-padova-pump*` populations have a pump setting to change: anything else asking for
    /// an override is an error (a scenario would otherwise silently train something else).
    pub fn with_pump_overrides(mut self, pump: PumpOverrides) -> Result<Self, SimError> {
        if pump == PumpOverrides::default() {
            return Ok(self);
        }
        if !matches!(
            self.kind,
            Kind::UvaPadova(_, PumpSetting::Pump | PumpSetting::PumpMeals)
        ) {
            return Err(SimError::Invalid(format!(
                "population {:?} has no pump setting: low_risk_weight, decision_min, \
                 low_glucose_suspend, iob_limit and sensitivity_scaling apply to \
                 uva-padova-pump and uva-padova-pump-meals",
                self.name
            )));
        }
        if let Some(w) = pump.low_risk_weight
            && !(w.is_finite() && w > 0.0)
        {
            return Err(SimError::Invalid(format!(
                "low_risk_weight must be a positive number, got {w}"
            )));
        }
        self.pump = pump;
        // Builds one user's environment so a bad decision_min fails here, not on a client.
        self.user_env(0)?;
        Ok(self)
    }

    /// Every user gets `env_id` with default parameters.
    pub fn homogeneous(env_id: &str) -> Result<Self, SimError> {
        crate::make(env_id)?;
        Ok(Population {
            name: env_id.to_string(),
            seed: 0,
            kind: Kind::Homogeneous(env_id.to_string()),
            pump: PumpOverrides::default(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The pump overrides [`Self::with_pump_overrides`] set (all `None` by default).
    pub fn pump_overrides(&self) -> PumpOverrides {
        self.pump
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The environment id every user of this population runs.
    pub fn env_id(&self) -> &str {
        match &self.kind {
            Kind::Homogeneous(id) => id,
            Kind::CartPoleB1 => "CartPole-v1",
            Kind::AcrobotB1 => "Acrobot-v1",
            Kind::PendulumGml => "Pendulum-v1",
            Kind::HivB1 => HivEnv::ID_20D,
            Kind::UvaPadova(..) => "UvaPadova-v0",
            Kind::DosingFixedMeals => "Dosing-v0",
            Kind::DosingMealHabits => "Dosing-v1",
        }
    }

    /// The generator of user `user`: keyed by (population name, seed, user) only.
    fn user_rng(&self, user: u64) -> ChaCha8Rng {
        // FNV-1a over the name, then SplitMix over the three words, fill a 256-bit key.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.name.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        let mut key = [0u8; 32];
        let words = [
            mix64(h),
            mix64(self.seed ^ 0x6a09_e667_f3bc_c908),
            mix64(user ^ 0xbb67_ae85_84ca_a73b),
            mix64(h ^ self.seed.rotate_left(17) ^ user.rotate_left(41)),
        ];
        for (chunk, w) in key.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        ChaCha8Rng::from_seed(key)
    }

    /// The parameters of grid cell `setting` of a B.1 population: cell `c` of CartPole and
    /// Acrobot has grid indices `[c / 100, (c / 10) % 10, c % 10]`; HIV's cell is
    /// [`HivParams::expert_variation`]'s index.
    fn cell_params(&self, setting: u64) -> Result<UserParams, SimError> {
        let cell3 = |c: u64| [(c / 100) as u32, ((c / 10) % 10) as u32, (c % 10) as u32];
        Ok(match &self.kind {
            Kind::CartPoleB1 => {
                let cell = cell3(setting);
                UserParams::CartPole {
                    gravity: linspace(8.75, 11.0, 10, cell[0]),
                    force_mag: linspace(9.0, 11.25, 10, cell[1]),
                    masscart: linspace(0.8, 1.25, 10, cell[2]),
                    cell,
                }
            }
            Kind::AcrobotB1 => {
                let cell = cell3(setting);
                UserParams::Acrobot {
                    link_length: linspace(0.8, 1.2, 10, cell[0]),
                    link_mass_1: linspace(0.9, 1.1, 10, cell[1]),
                    link_mass_2: linspace(0.9, 1.1, 10, cell[2]),
                    cell,
                }
            }
            Kind::PendulumGml => {
                let cell = [
                    (setting / 16) as u32,
                    ((setting / 4) % 4) as u32,
                    (setting % 4) as u32,
                ];
                let pick = |values: [f64; 4], i: u32| values[i as usize];
                UserParams::Pendulum {
                    g: pick([8.0, 9.0, 11.0, 12.0], cell[0]),
                    m: pick([0.8, 0.9, 1.1, 1.2], cell[1]),
                    l: pick([0.8, 0.9, 1.1, 1.2], cell[2]),
                    cell,
                }
            }
            Kind::HivB1 => {
                let p = HivParams::expert_variation(setting as usize)?;
                UserParams::Hiv {
                    eps1_penalty: p.eps1_penalty,
                    eps2_penalty: p.eps2_penalty,
                    efficacy_noise_sd: p.efficacy_noise_sd,
                    setting: setting as u32,
                }
            }
            _ => {
                return Err(SimError::Invalid(format!(
                    "population {:?} has no grid of settings",
                    self.name
                )));
            }
        })
    }

    /// Number of grid settings of a B.1 population (`cartpole-b1`, `acrobot-b1`: 1,000;
    /// `hiv-b1`: 2,000); `None` for populations whose users are not cells of a finite grid.
    pub fn grid_settings(&self) -> Option<u64> {
        match self.kind {
            Kind::CartPoleB1 | Kind::AcrobotB1 => Some(1000),
            Kind::PendulumGml => Some(PENDULUM_GML_CELLS),
            Kind::HivB1 => Some(HivParams::EXPERT_SETTINGS as u64),
            _ => None,
        }
    }

    /// The parameters of grid setting `setting` (`0..grid_settings()`, in grid order; users draw
    /// these cells at random, experts of seed 000 B.1 take them in order). An error for other
    /// populations and out-of-range settings.
    pub fn setting_params(&self, setting: u64) -> Result<UserParams, SimError> {
        match self.grid_settings() {
            Some(n) if setting < n => self.cell_params(setting),
            Some(n) => Err(SimError::Invalid(format!(
                "setting {setting} out of range 0..{n} of population {:?}",
                self.name
            ))),
            None => self.cell_params(setting),
        }
    }

    /// The environment of grid setting `setting` (see [`Population::setting_params`]).
    pub fn setting_env(&self, setting: u64) -> Result<Box<dyn Env>, SimError> {
        self.params_env(self.setting_params(setting)?)
    }

    /// User `user`'s parameters.
    pub fn user_params(&self, user: u64) -> Result<UserParams, SimError> {
        let mut rng = self.user_rng(user);
        Ok(match &self.kind {
            Kind::Homogeneous(id) => UserParams::Default { env_id: id.clone() },
            Kind::CartPoleB1 | Kind::AcrobotB1 => self.cell_params(below(&mut rng, 1000))?,
            Kind::PendulumGml => self.cell_params(below(&mut rng, PENDULUM_GML_CELLS))?,
            Kind::HivB1 => self.cell_params(below(&mut rng, HivParams::EXPERT_SETTINGS as u64))?,
            Kind::UvaPadova(group, pump) => {
                let groups: &[&str] = match group {
                    Some(g) => std::slice::from_ref(g),
                    None => &PATIENT_GROUPS,
                };
                let k = below(&mut rng, 10 * groups.len() as u64);
                let g = groups[(k / 10) as usize];
                UserParams::Patient {
                    name: format!("{g}#{:03}", k % 10 + 1),
                    pump: *pump,
                }
            }
            Kind::DosingFixedMeals => {
                let generator = MealGenerator::default();
                UserParams::DosingFixedMeals {
                    disturbance: generator.sample(&mut rng, DOSING_GRID_POINTS, 10),
                }
            }
            Kind::DosingMealHabits => {
                let base = MealGenerator::default();
                let mut time_mu_h = base.time_mu_h;
                let mut amount_mu = base.amount_mu;
                let mut prob = base.prob;
                for i in 0..6 {
                    let shift: f64 = StandardNormal.sample(&mut rng);
                    time_mu_h[i] =
                        (time_mu_h[i] + 0.5 * shift).clamp(base.time_lb_h[i], base.time_ub_h[i]);
                    amount_mu[i] *= rng.random_range(0.8..1.2);
                    prob[i] = (prob[i] * rng.random_range(0.8..1.2)).min(1.0);
                }
                UserParams::DosingMealHabits {
                    time_mu_h,
                    amount_mu,
                    prob,
                }
            }
        })
    }

    /// User `user`'s environment, built with that user's parameters.
    pub fn user_env(&self, user: u64) -> Result<Box<dyn Env>, SimError> {
        self.params_env(self.user_params(user)?)
    }

    /// The environment of one set of parameters.
    fn params_env(&self, params: UserParams) -> Result<Box<dyn Env>, SimError> {
        Ok(match params {
            UserParams::Default { env_id } => crate::make(&env_id)?,
            UserParams::CartPole {
                gravity,
                force_mag,
                masscart,
                ..
            } => {
                let mut e = CartPole::new();
                e.gravity = gravity;
                e.force_mag = force_mag;
                e.masscart = masscart;
                Box::new(e)
            }
            UserParams::Acrobot {
                link_length,
                link_mass_1,
                link_mass_2,
                ..
            } => {
                let mut e = Acrobot::new();
                e.link_length_1 = link_length;
                e.link_length_2 = link_length;
                e.link_mass_1 = link_mass_1;
                e.link_mass_2 = link_mass_2;
                Box::new(e)
            }
            UserParams::Pendulum { g, m, l, .. } => {
                let mut e = Pendulum::new();
                e.g = g;
                e.m = m;
                e.l = l;
                Box::new(e)
            }
            UserParams::DosingFixedMeals { disturbance } => {
                let mut opts = DosingOptions::v0();
                opts.meals = DosingMeals::Fixed {
                    base: disturbance.first().copied().unwrap_or(1000.0),
                    start: 0,
                    profile: disturbance,
                };
                Box::new(DosingEnv::new(opts)?)
            }
            UserParams::DosingMealHabits {
                time_mu_h,
                amount_mu,
                prob,
            } => {
                let mut opts = DosingOptions::v1();
                opts.meals = DosingMeals::Random(MealGenerator {
                    time_mu_h,
                    amount_mu,
                    prob,
                    ..MealGenerator::default()
                });
                Box::new(DosingEnv::new(opts)?)
            }
            UserParams::Hiv { setting, .. } => {
                Box::new(HivEnv::new(HivParams::expert_variation(setting as usize)?)?)
            }
            // Users are scored on the whole day's risk (see `UvaReward::DayRisk`).
            UserParams::Patient { name, pump } => {
                use crate::uva_padova::{UvaPadovaEnv, UvaPadovaOptions, UvaReward};
                let mut opts = match pump {
                    PumpSetting::Basal => UvaPadovaOptions {
                        reward: UvaReward::DayRisk,
                        ..Default::default()
                    },
                    PumpSetting::Pump => UvaPadovaOptions::pump(false),
                    PumpSetting::PumpMeals => UvaPadovaOptions::pump(true),
                };
                if let Some(w) = self.pump.low_risk_weight {
                    opts.low_risk_weight = w;
                }
                if let Some(d) = self.pump.decision_min {
                    opts.decision_min = d;
                }
                if let Some(k) = self.pump.sensitivity_scaling {
                    opts.sensitivity_scaling = k;
                }
                self.pump.apply_pump_rules(&mut opts);
                Box::new(UvaPadovaEnv::new(&name, opts)?)
            }
        })
    }

    /// User `user` in JSON: population, seed, user index, environment id and parameters.
    pub fn describe_user(&self, user: u64) -> Result<Value, SimError> {
        let params = self.user_params(user)?;
        Ok(json!({
            "population": self.name,
            "seed": self.seed,
            "user": user,
            "env_id": self.env_id(),
            "params": params,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::GlucoseSample;

    #[test]
    fn pendulum_gml_users_have_other_physics_than_pendulum_v1() {
        let p = Population::new("pendulum-gml", 0).unwrap();
        assert_eq!(p.env_id(), "Pendulum-v1");
        assert_eq!(p.grid_settings(), Some(64));
        match p.setting_params(16 + 8 + 3).unwrap() {
            UserParams::Pendulum { g, m, l, cell } => {
                assert_eq!(cell, [1, 2, 3]);
                assert_eq!((g, m, l), (9.0, 1.1, 1.2));
            }
            other => panic!("{other:?}"),
        }
        let mut cells = std::collections::BTreeSet::new();
        for u in 0..400 {
            let UserParams::Pendulum { g, m, l, cell } = p.user_params(u).unwrap() else {
                panic!("not a pendulum");
            };
            assert!(g != 10.0 && m != 1.0 && l != 1.0, "{g} {m} {l}");
            cells.insert(cell);
        }
        // 400 uniform draws of 64 cells miss one with probability below 1e-2.
        assert!(cells.len() >= 60, "{}", cells.len());
        // The physics differ: the same torque from the same state moves a heavier, longer
        // pendulum under weaker gravity differently.
        let step = |mut env: Box<dyn Env>| {
            let mut obs = vec![0.0f32; 3];
            env.reset(1, &mut obs);
            env.step(crate::Action::Continuous(&[1.0]), &mut obs)
                .unwrap();
            obs
        };
        let a = step(p.setting_env(0).unwrap());
        let b = step(crate::make("Pendulum-v1").unwrap());
        assert_ne!(a, b);
    }

    #[test]
    fn settings_follow_the_grid_order() {
        let p = Population::new("cartpole-b1", 7).unwrap();
        assert_eq!(p.grid_settings(), Some(1000));
        match p.setting_params(123).unwrap() {
            UserParams::CartPole { cell, gravity, .. } => {
                assert_eq!(cell, [1, 2, 3]);
                assert_eq!(gravity, linspace(8.75, 11.0, 10, 1));
            }
            other => panic!("{other:?}"),
        }
        assert!(p.setting_params(1000).is_err());
        let h = Population::new("hiv-b1", 0).unwrap();
        assert_eq!(h.grid_settings(), Some(2000));
        match h.setting_params(1999).unwrap() {
            UserParams::Hiv {
                setting,
                efficacy_noise_sd,
                ..
            } => {
                assert_eq!(setting, 1999);
                assert_eq!(efficacy_noise_sd, 0.01);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(h.setting_env(5).unwrap().id(), HivEnv::ID_20D);
        let c = Population::new("CartPole-v1", 0).unwrap();
        assert_eq!(c.grid_settings(), None);
        assert!(c.setting_env(0).is_err());
    }

    #[test]
    fn users_draw_grid_cells() {
        // A user's parameters are the parameters of the grid cell it drew.
        let p = Population::new("acrobot-b1", 3).unwrap();
        for u in 0..20 {
            let UserParams::Acrobot { cell, .. } = p.user_params(u).unwrap() else {
                panic!("acrobot user");
            };
            let c = u64::from(cell[0]) * 100 + u64::from(cell[1]) * 10 + u64::from(cell[2]);
            assert_eq!(p.setting_params(c).unwrap(), p.user_params(u).unwrap());
        }
    }

    /// Runs user 0 of `pop` for `steps` decisions at `action` (multiples of the programmed
    /// basal): the rewards and the glucose log.
    /// `uva-padova-pump` (population seed 1) without and with `pump` overrides.
    fn pump_pair(pump: PumpOverrides) -> (Population, Population) {
        let base = Population::new("uva-padova-pump", 1).unwrap();
        let with = base.clone().with_pump_overrides(pump).unwrap();
        (base, with)
    }

    /// Lowest blood glucose of a day's log (mg/dL).
    fn min_bg(log: &[GlucoseSample]) -> f64 {
        log.iter().map(|s| s.bg_mg_dl).fold(f64::INFINITY, f64::min)
    }

    fn pump_day(pop: &Population, action: f32, steps: usize) -> (Vec<f64>, Vec<GlucoseSample>) {
        let mut env = pop.user_env(0).unwrap();
        let mut obs = vec![0.0; env.observation_space().dim()];
        env.reset(3, &mut obs);
        let rewards = (0..steps)
            .map(|_| {
                env.step(crate::Action::Continuous(&[action]), &mut obs)
                    .unwrap()
                    .reward
            })
            .collect();
        (rewards, env.glucose_log().unwrap().to_vec())
    }

    #[test]
    fn pump_overrides_change_the_reward_and_the_decision_interval_only() {
        let base = Population::new("uva-padova-pump", 1).unwrap();
        let heavy = base
            .clone()
            .with_pump_overrides(PumpOverrides {
                low_risk_weight: Some(6.0),
                ..PumpOverrides::default()
            })
            .unwrap();
        // Five times the programmed basal for 8 hours drives glucose low.
        let (r3, log3) = pump_day(&base, 5.0, 16);
        let (r6, log6) = pump_day(&heavy, 5.0, 16);
        assert_eq!(log3, log6, "the weight must not change the patient");
        assert!(
            log3.iter().any(|s| s.cgm_mg_dl < 112.5),
            "no low risk to weigh"
        );
        let mut heavier = false;
        for (a, b) in r3.iter().zip(&r6) {
            assert!(b <= a, "weight 6 rewards {b} > weight 3 rewards {a}");
            heavier |= b < a;
        }
        assert!(heavier);

        let fast = base
            .clone()
            .with_pump_overrides(PumpOverrides {
                decision_min: Some(15),
                ..PumpOverrides::default()
            })
            .unwrap();
        // One decision: 15 minutes of 3-minute CGM samples after the reading at reset.
        assert_eq!(pump_day(&fast, 1.0, 1).1.len(), 1 + 5);
        assert_eq!(pump_day(&base, 1.0, 1).1.len(), 1 + 10);

        for bad in [
            PumpOverrides {
                low_risk_weight: Some(0.0),
                ..PumpOverrides::default()
            },
            PumpOverrides {
                decision_min: Some(10),
                ..PumpOverrides::default()
            },
        ] {
            assert!(base.clone().with_pump_overrides(bad).is_err(), "{bad:?}");
        }
        let err = Population::new("uva-padova", 0)
            .unwrap()
            .with_pump_overrides(PumpOverrides {
                low_risk_weight: Some(2.0),
                ..PumpOverrides::default()
            })
            .unwrap_err();
        assert!(err.to_string().contains("no pump setting"), "{err}");
    }
    #[test]
    fn low_glucose_suspend_predicts_lows_from_the_last_15_minutes() {
        use crate::uva_padova::LowGlucoseSuspend as Lgs;
        // Readings newest first, 3 minutes apart.
        let line = |now: f64, per_min: f64| -> Vec<f64> {
            (0..6).map(|k| now - per_min * 3.0 * k as f64).collect()
        };
        assert!(!Lgs::suspends(&line(100.0, 0.0), 3.0));
        // Falling 1 mg/dL/min from 115: 85 in 30 minutes, no suspend; from 105: 75, suspend.
        assert!(!Lgs::suspends(&line(115.0, -1.0), 3.0));
        assert!(Lgs::suspends(&line(105.0, -1.0), 3.0));
        // Below 70 suspends even when rising; rising from 75 does not.
        assert!(Lgs::suspends(&line(69.0, 2.0), 3.0));
        assert!(!Lgs::suspends(&line(75.0, 1.0), 3.0));
        // The fit, not the last two readings: a reading 10 mg/dL down on a flat trace at 120
        // (a 3-minute slope of -3.3 mg/dL/min) predicts 100.
        let mut noisy = line(120.0, 0.0);
        noisy[0] = 110.0;
        assert!(!Lgs::suspends(&noisy, 3.0));
    }

    #[test]
    fn iob_limit_subtracts_insulin_on_board_from_the_correction() {
        use crate::uva_padova::IobLimit;
        let (b, cf) = (0.02, 40.0); // 1.2 U/h, 40 mg/dL per U
        let ss = IobLimit::steady_state_iob(b);
        assert!((ss - b * 120.5).abs() < 1e-12);
        // At 192.5 mg/dL the correction is 2 U: 1.9 U above steady state allows 4x, 2.1 U not.
        assert_eq!(IobLimit::limit(4.0 * b, 192.5, ss + 1.9, b, cf), 4.0 * b);
        assert_eq!(IobLimit::limit(4.0 * b, 192.5, ss + 2.1, b, cf), b);
        // At or below target nothing above basal; asking less than basal is never raised.
        assert_eq!(IobLimit::limit(2.0 * b, 110.0, ss, b, cf), b);
        assert_eq!(IobLimit::limit(0.5 * b, 300.0, ss, b, cf), 0.5 * b);
    }

    #[test]
    fn the_iob_limit_is_the_pumps_and_cuts_stacking() {
        let (base, limited) = pump_pair(PumpOverrides {
            iob_limit: Some(true),
            ..PumpOverrides::default()
        });
        // Five times the programmed basal for 8 hours: the limit caps it once insulin stacks.
        let (_, plain) = pump_day(&base, 5.0, 16);
        let (_, capped) = pump_day(&limited, 5.0, 16);
        let total = |log: &[GlucoseSample]| log.iter().map(|s| s.insulin_u).sum::<f64>();
        assert!(
            total(&capped) < 0.8 * total(&plain),
            "{} vs {}",
            total(&capped),
            total(&plain)
        );
        assert!(
            min_bg(&capped) > min_bg(&plain) + 5.0,
            "{} vs {}",
            min_bg(&capped),
            min_bg(&plain)
        );
        assert!(
            crate::controllers::user_env(&limited, 0)
                .unwrap()
                .options()
                .iob_limit
        );
        assert!(
            !crate::controllers::user_env(&base, 0)
                .unwrap()
                .options()
                .iob_limit
        );
    }

    #[test]
    fn the_suspend_is_the_pumps_and_the_controllers_run_behind_it() {
        let (base, lgs) = pump_pair(PumpOverrides {
            low_glucose_suspend: Some(true),
            ..PumpOverrides::default()
        });
        // Five times the programmed basal for 8 hours: the suspend cuts basal before the low.
        let (_, plain) = pump_day(&base, 5.0, 16);
        let (_, guarded) = pump_day(&lgs, 5.0, 16);
        assert!(
            min_bg(&guarded) > min_bg(&plain) + 5.0,
            "{} vs {}",
            min_bg(&guarded),
            min_bg(&plain)
        );
        assert!(guarded[1..].iter().any(|s| s.insulin_u == 0.0));
        assert!(plain[1..].iter().all(|s| s.insulin_u > 0.0));
        let pid_env = crate::controllers::user_env(&lgs, 0).unwrap();
        assert!(pid_env.options().low_glucose_suspend);
        let pid_env = crate::controllers::user_env(&base, 0).unwrap();
        assert!(!pid_env.options().low_glucose_suspend);
    }
}
