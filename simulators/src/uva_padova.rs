//! The UVA/Padova type-1 diabetes simulator (Dalla Man et al. 2007, the 2008 FDA-accepted model)
//! as simglucose 0.2.11 implements it in `T1DPatient`: 13 states, one-minute steps, insulin in
//! U/min and carbohydrate in g/min, blood glucose read as subcutaneous glucose Gsub (mg/dL).
//!
//! On top of the patient model, [`UvaPadovaEnv`] is a basal-insulin dosing environment in which
//! each simulated user is one of the 30 virtual patients: a random daily meal scenario
//! (simglucose's `RandomScenario` shape, parameterisable per user), a CGM sensor with optional
//! Johnson-SU noise, and Kovatchev's risk index as the reward.

use crate::trace_json::{field, num};
use std::sync::OnceLock;

use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

use crate::env::{Action, Env, SimError, Space, Step};
use crate::ode::{Dopri5, OdeOptions};
use crate::replay::ReplayResult;

/// simglucose's parameter table (MIT licence), embedded unchanged from `testdata/`.
pub const PATIENT_CSV: &str = include_str!("../../testdata/uva_padova_vpatient_params.csv");

/// Number of model states.
pub const N_STATES: usize = 13;

/// A patient eats at most this much per minute (g/min); larger meals are spread out.
pub const EAT_RATE_G_PER_MIN: f64 = 5.0;

/// Parameters of one virtual patient (units of simglucose's table: masses per kg of body weight,
/// rates per minute).
#[derive(Clone, Debug, PartialEq)]
pub struct PatientParams {
    pub name: String,
    /// Steady-state initial condition of the 13 states.
    pub x0: [f64; N_STATES],
    /// Body weight (kg).
    pub bw: f64,
    pub kabs: f64,
    pub kmax: f64,
    pub kmin: f64,
    pub b: f64,
    pub d: f64,
    /// Glucose distribution volume (dL/kg).
    pub vg: f64,
    /// Insulin distribution volume (L/kg).
    pub vi: f64,
    pub vmx: f64,
    pub km0: f64,
    pub k1: f64,
    pub k2: f64,
    pub p2u: f64,
    pub m1: f64,
    pub m2: f64,
    pub m4: f64,
    pub m30: f64,
    pub ki: f64,
    pub kp1: f64,
    pub kp2: f64,
    pub kp3: f64,
    pub f: f64,
    pub ke1: f64,
    pub ke2: f64,
    pub fsnc: f64,
    pub vm0: f64,
    pub kd: f64,
    pub ksc: f64,
    pub ka1: f64,
    pub ka2: f64,
    /// Basal plasma insulin (pmol/L).
    pub ib: f64,
    /// Steady-state basal insulin rate (pmol/kg/min).
    pub u2ss: f64,
}

impl PatientParams {
    /// The basal insulin rate that keeps this patient at steady state (U/min).
    pub fn basal_u_per_min(&self) -> f64 {
        self.u2ss * self.bw / 6000.0
    }
}

fn parse_table(csv: &str) -> Result<Vec<PatientParams>, String> {
    let mut lines = csv.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines
        .next()
        .ok_or("empty patient table")?
        .split(',')
        .map(str::trim)
        .collect();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .ok_or_else(|| format!("patient table lacks column {name}"))
    };
    let mut out = Vec::new();
    for line in lines {
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        if cells.len() != header.len() {
            return Err(format!("patient table row has {} cells", cells.len()));
        }
        let get = |name: &str| -> Result<f64, String> {
            let c = col(name)?;
            cells[c].parse::<f64>().map_err(|e| format!("{name}: {e}"))
        };
        let mut x0 = [0.0; N_STATES];
        for (i, x) in x0.iter_mut().enumerate() {
            *x = get(&format!("x0_{:>2}", i + 1))?;
        }
        out.push(PatientParams {
            name: cells[col("Name")?].to_string(),
            x0,
            bw: get("BW")?,
            kabs: get("kabs")?,
            kmax: get("kmax")?,
            kmin: get("kmin")?,
            b: get("b")?,
            d: get("d")?,
            vg: get("Vg")?,
            vi: get("Vi")?,
            vmx: get("Vmx")?,
            km0: get("Km0")?,
            k1: get("k1")?,
            k2: get("k2")?,
            p2u: get("p2u")?,
            m1: get("m1")?,
            m2: get("m2")?,
            m4: get("m4")?,
            m30: get("m30")?,
            ki: get("ki")?,
            kp1: get("kp1")?,
            kp2: get("kp2")?,
            kp3: get("kp3")?,
            f: get("f")?,
            ke1: get("ke1")?,
            ke2: get("ke2")?,
            fsnc: get("Fsnc")?,
            vm0: get("Vm0")?,
            kd: get("kd")?,
            ksc: get("ksc")?,
            ka1: get("ka1")?,
            ka2: get("ka2")?,
            ib: get("Ib")?,
            u2ss: get("u2ss")?,
        });
    }
    Ok(out)
}

/// The 30 virtual patients (10 adolescents, 10 adults, 10 children), in table order.
pub fn patients() -> Result<&'static [PatientParams], SimError> {
    static TABLE: OnceLock<Result<Vec<PatientParams>, String>> = OnceLock::new();
    match TABLE.get_or_init(|| parse_table(PATIENT_CSV)) {
        Ok(v) => Ok(v),
        Err(e) => Err(SimError::Invalid(format!("UVA/Padova patient table: {e}"))),
    }
}

/// A patient by name (`adult#001`) or by 0-based index into [`patients`] (`"12"`).
pub fn patient(name_or_index: &str) -> Result<&'static PatientParams, SimError> {
    let all = patients()?;
    if let Some(p) = all.iter().find(|p| p.name == name_or_index) {
        return Ok(p);
    }
    match name_or_index.parse::<usize>() {
        Ok(i) if i < all.len() => Ok(&all[i]),
        _ => Err(SimError::Invalid(format!(
            "unknown UVA/Padova patient {name_or_index:?} (names like adult#001 or an index 0..{})",
            all.len()
        ))),
    }
}

/// Inputs held constant over one minute.
#[derive(Clone, Copy, Debug, Default)]
struct Inputs {
    /// Carbohydrate ingestion (mg/min).
    cho_mg: f64,
    /// Subcutaneous insulin (pmol/kg/min).
    insulin: f64,
    /// Stomach content at the start of the last meal plus what was eaten since (mg).
    dbar: f64,
}

/// Right-hand side of the model (time in minutes), simglucose's `T1DPatient.model`.
fn derivatives(p: &PatientParams, u: &Inputs, x: &[f64], dx: &mut [f64]) {
    // Guards of the reference: a compartment that went negative stops changing.
    let pos = |v: f64| if v >= 0.0 { 1.0 } else { 0.0 };
    let qsto = x[0] + x[1];
    dx[0] = -p.kmax * x[0] + u.cho_mg;
    // Gastric emptying slows down between the fractions b and d of the meal.
    let kgut = if u.dbar > 0.0 {
        let aa = 5.0 / 2.0 / (1.0 - p.b) / u.dbar;
        let cc = 5.0 / 2.0 / p.d / u.dbar;
        p.kmin
            + (p.kmax - p.kmin) / 2.0
                * ((aa * (qsto - p.b * u.dbar)).tanh() - (cc * (qsto - p.d * u.dbar)).tanh() + 2.0)
    } else {
        p.kmax
    };
    dx[1] = p.kmax * x[0] - x[1] * kgut;
    dx[2] = kgut * x[1] - p.kabs * x[2];
    let rat = p.f * p.kabs * x[2] / p.bw;
    let egp = p.kp1 - p.kp2 * x[3] - p.kp3 * x[8];
    let uii = p.fsnc;
    let et = if x[3] > p.ke2 {
        p.ke1 * (x[3] - p.ke2)
    } else {
        0.0
    };
    dx[3] = pos(x[3]) * (egp.max(0.0) + rat - uii - et - p.k1 * x[3] + p.k2 * x[4]);
    let vmt = p.vm0 + p.vmx * x[6];
    let uid = vmt * x[4] / (p.km0 + x[4]);
    dx[4] = pos(x[4]) * (-uid + p.k1 * x[3] - p.k2 * x[4]);
    dx[5] = pos(x[5]) * (-(p.m2 + p.m4) * x[5] + p.m1 * x[9] + p.ka1 * x[10] + p.ka2 * x[11]);
    let it = x[5] / p.vi;
    dx[6] = -p.p2u * x[6] + p.p2u * (it - p.ib);
    dx[7] = -p.ki * (x[7] - it);
    dx[8] = -p.ki * (x[8] - x[7]);
    dx[9] = pos(x[9]) * (-(p.m1 + p.m30) * x[9] + p.m2 * x[5]);
    dx[10] = pos(x[10]) * (u.insulin - (p.ka1 + p.kd) * x[10]);
    dx[11] = pos(x[11]) * (p.kd * x[10] - p.ka2 * x[11]);
    dx[12] = pos(x[12]) * (-p.ksc * x[12] + p.ksc * x[3]);
}

/// Length of [`T1dPatient::state`]: the 13 model states, then time (min), last stomach content
/// (mg), food taken in the current meal (g), last carbohydrate input (g/min), eating flag and
/// the announced carbohydrate still to eat (g).
pub const PATIENT_STATE_LEN: usize = N_STATES + 6;

/// One virtual patient, stepped one minute at a time (simglucose's `T1DPatient`).
#[derive(Clone, Debug)]
pub struct T1dPatient {
    params: PatientParams,
    x: [f64; N_STATES],
    /// Minutes since the start.
    t: f64,
    last_qsto: f64,
    last_foodtaken: f64,
    last_cho: f64,
    is_eating: bool,
    planned_meal: f64,
    solver: Dopri5,
}

impl T1dPatient {
    /// A patient at its steady state `x0`.
    pub fn new(params: PatientParams) -> Self {
        // rtol 1e-8 keeps Gsub within 1e-4 mg/dL of a much tighter solve at a fraction of the
        // cost; simglucose itself runs dopri5 at rtol 1e-6.
        let opts = OdeOptions {
            rtol: 1e-8,
            atol: 1e-10,
            ..OdeOptions::default()
        };
        let x = params.x0;
        let mut p = Self {
            params,
            x,
            t: 0.0,
            last_qsto: 0.0,
            last_foodtaken: 0.0,
            last_cho: 0.0,
            is_eating: false,
            planned_meal: 0.0,
            solver: Dopri5::new(N_STATES, opts),
        };
        p.reset_to(x);
        p
    }

    pub fn params(&self) -> &PatientParams {
        &self.params
    }

    /// Restarts from the given 13 states at t = 0 with no meal in progress.
    pub fn reset_to(&mut self, x: [f64; N_STATES]) {
        self.x = x;
        self.t = 0.0;
        self.last_qsto = x[0] + x[1];
        self.last_foodtaken = 0.0;
        self.last_cho = 0.0;
        self.is_eating = false;
        self.planned_meal = 0.0;
    }

    /// The 13 model states.
    pub fn x(&self) -> &[f64; N_STATES] {
        &self.x
    }

    /// Minutes since the start.
    pub fn t(&self) -> f64 {
        self.t
    }

    /// Blood glucose as the model reports it: subcutaneous glucose Gsub (mg/dL).
    pub fn bg(&self) -> f64 {
        self.x[12] / self.params.vg
    }

    /// Full state, [`PATIENT_STATE_LEN`] values.
    pub fn state(&self) -> Vec<f64> {
        let mut v = self.x.to_vec();
        v.extend_from_slice(&[
            self.t,
            self.last_qsto,
            self.last_foodtaken,
            self.last_cho,
            if self.is_eating { 1.0 } else { 0.0 },
            self.planned_meal,
        ]);
        v
    }

    pub fn set_state(&mut self, s: &[f64]) -> Result<(), SimError> {
        if s.len() != PATIENT_STATE_LEN {
            return Err(SimError::StateLength {
                env: "T1dPatient",
                got: s.len(),
                expected: PATIENT_STATE_LEN,
            });
        }
        if s.iter().any(|v| !v.is_finite()) {
            return Err(SimError::Invalid("T1dPatient: non-finite state".into()));
        }
        self.x.copy_from_slice(&s[..N_STATES]);
        self.t = s[N_STATES];
        self.last_qsto = s[N_STATES + 1];
        self.last_foodtaken = s[N_STATES + 2];
        self.last_cho = s[N_STATES + 3];
        self.is_eating = s[N_STATES + 4] != 0.0;
        self.planned_meal = s[N_STATES + 5];
        Ok(())
    }

    /// Advances one minute. `cho_g` is the carbohydrate announced this minute (g; eaten at up to
    /// [`EAT_RATE_G_PER_MIN`]), `insulin_u_per_min` the insulin delivered (U/min).
    pub fn step(&mut self, cho_g: f64, insulin_u_per_min: f64) -> Result<(), SimError> {
        if !cho_g.is_finite() || cho_g < 0.0 {
            return Err(SimError::Invalid(format!(
                "T1dPatient: carbohydrate {cho_g} g is not a finite non-negative amount"
            )));
        }
        if !insulin_u_per_min.is_finite() || insulin_u_per_min < 0.0 {
            return Err(SimError::Invalid(format!(
                "T1dPatient: insulin {insulin_u_per_min} U/min is not a finite non-negative rate"
            )));
        }
        // Announced meals are eaten at a bounded rate.
        self.planned_meal += cho_g;
        let to_eat = if self.planned_meal > 0.0 {
            let e = EAT_RATE_G_PER_MIN.min(self.planned_meal);
            self.planned_meal = (self.planned_meal - e).max(0.0);
            e
        } else {
            0.0
        };
        // A new meal resets the reference stomach content of the gastric-emptying law.
        if to_eat > 0.0 && self.last_cho <= 0.0 {
            self.last_qsto = self.x[0] + self.x[1];
            self.last_foodtaken = 0.0;
            self.is_eating = true;
        }
        if self.is_eating {
            self.last_foodtaken += to_eat;
        }
        if to_eat <= 0.0 && self.last_cho > 0.0 {
            self.is_eating = false;
        }
        self.last_cho = to_eat;

        let u = Inputs {
            cho_mg: to_eat * 1000.0,
            insulin: insulin_u_per_min * 6000.0 / self.params.bw,
            // Stomach content is in mg and food taken in g (simglucose issue #41 fix).
            dbar: self.last_qsto + self.last_foodtaken * 1000.0,
        };
        let p = &self.params;
        self.solver
            .integrate(
                |_, x, dx| derivatives(p, &u, x, dx),
                self.t,
                self.t + 1.0,
                &mut self.x,
            )
            .map_err(|e| SimError::Invalid(format!("{}: {e}", self.params.name)))?;
        self.t += 1.0;
        Ok(())
    }
}

/// One day's meals: up to six (time in minutes after midnight, carbohydrate in g).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DayMeals {
    pub meals: [(u32, f64); 6],
    pub count: usize,
}

impl DayMeals {
    /// Carbohydrate announced at minute `minute_of_day` (g).
    pub fn at(&self, minute_of_day: u32) -> f64 {
        self.meals[..self.count]
            .iter()
            .filter(|m| m.0 == minute_of_day)
            .map(|m| m.1)
            .sum()
    }
}

/// A random daily meal scenario with simglucose's `RandomScenario` shape: six candidate meals
/// (breakfast, snack, lunch, snack, dinner, snack), each taken with a probability, at a
/// truncated-normal time and a normal amount. Defaults are simglucose's values; populations can
/// vary them per user.
#[derive(Clone, Debug, PartialEq)]
pub struct MealScenario {
    /// Probability of each meal.
    pub prob: [f64; 6],
    /// Time window lower bound (hours after midnight).
    pub time_lb_h: [f64; 6],
    /// Time window upper bound (hours).
    pub time_ub_h: [f64; 6],
    /// Mean time (hours).
    pub time_mu_h: [f64; 6],
    /// Time standard deviation (minutes).
    pub time_sigma_min: [f64; 6],
    /// Mean amount (g of carbohydrate).
    pub amount_mu_g: [f64; 6],
    /// Amount standard deviation (g).
    pub amount_sigma_g: [f64; 6],
}

impl Default for MealScenario {
    fn default() -> Self {
        Self {
            prob: [0.95, 0.3, 0.95, 0.3, 0.95, 0.3],
            time_lb_h: [5.0, 9.0, 10.0, 14.0, 16.0, 20.0],
            time_ub_h: [9.0, 10.0, 14.0, 16.0, 20.0, 23.0],
            time_mu_h: [7.0, 9.5, 12.0, 15.0, 18.0, 21.5],
            time_sigma_min: [60.0, 30.0, 60.0, 30.0, 60.0, 30.0],
            amount_mu_g: [45.0, 10.0, 70.0, 10.0, 80.0, 10.0],
            amount_sigma_g: [10.0, 5.0, 10.0, 5.0, 10.0, 5.0],
        }
    }
}

/// A normal sample truncated to `[lb, ub]` by rejection (the windows used here are within a few
/// standard deviations, so this terminates quickly; after many rejections it clamps).
pub(crate) fn truncated_normal(rng: &mut ChaCha8Rng, mu: f64, sd: f64, lb: f64, ub: f64) -> f64 {
    if sd <= 0.0 || lb >= ub {
        return mu.clamp(lb.min(ub), ub.max(lb));
    }
    for _ in 0..10_000 {
        let z: f64 = StandardNormal.sample(rng);
        let v = mu + sd * z;
        if (lb..=ub).contains(&v) {
            return v;
        }
    }
    mu.clamp(lb, ub)
}

impl MealScenario {
    /// Draws one day of meals.
    pub fn sample_day(&self, rng: &mut ChaCha8Rng) -> DayMeals {
        let mut day = DayMeals::default();
        for i in 0..6 {
            if rng.random::<f64>() < self.prob[i] {
                let t = truncated_normal(
                    rng,
                    self.time_mu_h[i] * 60.0,
                    self.time_sigma_min[i],
                    self.time_lb_h[i] * 60.0,
                    self.time_ub_h[i] * 60.0,
                )
                .round()
                .clamp(0.0, 1439.0);
                let z: f64 = StandardNormal.sample(rng);
                let amount = (self.amount_mu_g[i] + self.amount_sigma_g[i] * z)
                    .round()
                    .max(0.0);
                day.meals[day.count] = (t as u32, amount);
                day.count += 1;
            }
        }
        day
    }
}

/// CGM sensor (simglucose's Dexcom defaults): Johnson-SU distributed error with AR(1)
/// correlation between samples, clipped to the sensor range.
#[derive(Clone, Debug, PartialEq)]
pub struct CgmSensor {
    /// Add sensor noise; without it the CGM reads Gsub exactly (still clipped).
    pub noise: bool,
    /// Lag-one autocorrelation of the underlying normal process.
    pub pacf: f64,
    pub gamma: f64,
    pub lambda: f64,
    pub delta: f64,
    pub xi: f64,
    /// Sensor range (mg/dL).
    pub min_mg_dl: f64,
    pub max_mg_dl: f64,
}

impl Default for CgmSensor {
    fn default() -> Self {
        Self {
            noise: false,
            pacf: 0.7,
            gamma: -0.5444,
            lambda: 15.9574,
            delta: 1.6898,
            xi: -5.47,
            min_mg_dl: 39.0,
            max_mg_dl: 400.0,
        }
    }
}

impl CgmSensor {
    /// Johnson-SU error (mg/dL) for the normal state `z`.
    fn error(&self, z: f64) -> f64 {
        self.xi + self.lambda * ((z - self.gamma) / self.delta).sinh()
    }
}

/// Kovatchev's blood-glucose risk index of one reading: 10 f(BG)^2 with
/// f = 1.509 (ln(BG)^1.084 - 5.381); returns (LBGI, HBGI, risk).
pub fn risk_index(bg_mg_dl: f64) -> (f64, f64, f64) {
    let bg = bg_mg_dl.max(1.0);
    let f = 1.509 * (bg.ln().powf(1.084) - 5.381);
    let r = 10.0 * f * f;
    if f < 0.0 { (r, 0.0, r) } else { (0.0, r, r) }
}

/// Reward of [`UvaPadovaEnv`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum UvaReward {
    /// simglucose's default: risk of the previous CGM reading minus risk of the current one.
    #[default]
    RiskDiff,
    /// Minus the risk index of the current CGM reading.
    NegRisk,
    /// Minus the risk index of the current CGM reading, and a terminated episode is charged
    /// that last reading's risk for every step left in the episode, so ending the day early
    /// (a glucose excursion out of the survivable range) never pays. The undiscounted return
    /// is minus the day's summed risk: a training signal about the whole day, where
    /// `RiskDiff` telescopes to the first reading's risk minus the last one's.
    DayRisk,
}

/// Options of [`UvaPadovaEnv`].
#[derive(Clone, Debug, PartialEq)]
pub struct UvaPadovaOptions {
    /// Minutes per environment step (the CGM sample time; simglucose's Dexcom: 3).
    pub sample_time_min: u32,
    /// Episode length (minutes); the episode is truncated after it.
    pub episode_minutes: u32,
    /// Largest basal rate the pump delivers (U/min); larger actions are clipped.
    pub max_basal_u_per_min: f64,
    pub meals: MealScenario,
    pub sensor: CgmSensor,
    /// Perturb the initial glucose states as simglucose's `random_init_bg` does.
    pub random_init_bg: bool,
    pub reward: UvaReward,
    /// The episode terminates when blood glucose leaves [low, high] (mg/dL).
    pub terminate_below_mg_dl: f64,
    pub terminate_above_mg_dl: f64,
}

impl Default for UvaPadovaOptions {
    fn default() -> Self {
        Self {
            sample_time_min: 3,
            episode_minutes: 24 * 60,
            max_basal_u_per_min: 0.5,
            meals: MealScenario::default(),
            sensor: CgmSensor::default(),
            random_init_bg: false,
            reward: UvaReward::RiskDiff,
            terminate_below_mg_dl: 10.0,
            terminate_above_mg_dl: 600.0,
        }
    }
}

/// Length of [`UvaPadovaEnv`]'s state: the patient's [`PATIENT_STATE_LEN`] values, then the
/// last CGM reading (mg/dL), the sensor's normal noise state and the step count.
pub const ENV_STATE_LEN: usize = PATIENT_STATE_LEN + 3;

/// Basal-insulin dosing for one virtual patient (`UvaPadova-v0`).
///
/// Observation: the CGM reading (mg/dL). Action: a basal insulin rate (U/min), clipped to
/// `[0, max_basal_u_per_min]`, held for `sample_time_min` minutes. Meals come from the user's
/// [`MealScenario`], drawn per day from the reset seed.
pub struct UvaPadovaEnv {
    patient: T1dPatient,
    opts: UvaPadovaOptions,
    obs_space: Space,
    act_space: Space,
    rng: ChaCha8Rng,
    day: DayMeals,
    day_index: u64,
    cgm: f64,
    noise_z: f64,
    steps: u64,
}

impl UvaPadovaEnv {
    pub const ID: &'static str = "UvaPadova-v0";

    /// An environment for the patient named `adult#001` etc., or with a 0-based table index.
    pub fn new(patient_name_or_index: &str, opts: UvaPadovaOptions) -> Result<Self, SimError> {
        if opts.sample_time_min == 0 || opts.episode_minutes == 0 {
            return Err(SimError::Invalid(
                "UvaPadova-v0: sample time and episode length must be positive".into(),
            ));
        }
        if !(opts.max_basal_u_per_min.is_finite() && opts.max_basal_u_per_min > 0.0) {
            return Err(SimError::Invalid(
                "UvaPadova-v0: max basal must be a positive rate".into(),
            ));
        }
        let params = patient(patient_name_or_index)?.clone();
        let mut env = Self {
            patient: T1dPatient::new(params),
            obs_space: Space::Box {
                low: vec![opts.sensor.min_mg_dl as f32],
                high: vec![opts.sensor.max_mg_dl as f32],
            },
            act_space: Space::Box {
                low: vec![0.0],
                high: vec![opts.max_basal_u_per_min as f32],
            },
            opts,
            rng: ChaCha8Rng::seed_from_u64(0),
            day: DayMeals::default(),
            day_index: 0,
            cgm: 0.0,
            noise_z: 0.0,
            steps: 0,
        };
        let mut obs = [0.0f32];
        env.reset(0, &mut obs);
        Ok(env)
    }

    pub fn patient(&self) -> &T1dPatient {
        &self.patient
    }

    pub fn options(&self) -> &UvaPadovaOptions {
        &self.opts
    }

    /// Today's meals (minutes after midnight, g).
    pub fn meals_today(&self) -> &DayMeals {
        &self.day
    }

    fn measure(&mut self) -> f64 {
        let bg = self.patient.bg();
        let s = &self.opts.sensor;
        let v = if s.noise {
            let e: f64 = StandardNormal.sample(&mut self.rng);
            self.noise_z = s.pacf * self.noise_z + (1.0 - s.pacf * s.pacf).sqrt() * e;
            bg + s.error(self.noise_z)
        } else {
            bg
        };
        v.clamp(s.min_mg_dl, s.max_mg_dl)
    }
}

impl Env for UvaPadovaEnv {
    fn id(&self) -> &'static str {
        Self::ID
    }

    fn observation_space(&self) -> &Space {
        &self.obs_space
    }

    fn action_space(&self) -> &Space {
        &self.act_space
    }

    fn reset(&mut self, seed: u64, obs: &mut [f32]) {
        self.rng = ChaCha8Rng::seed_from_u64(seed);
        let mut x = self.patient.params().x0;
        if self.opts.random_init_bg {
            // simglucose: Gp, Gt and Gsub drawn around steady state with variance 0.1 x.
            for i in [3usize, 4, 12] {
                let z: f64 = StandardNormal.sample(&mut self.rng);
                x[i] = (x[i] + (0.1 * x[i]).sqrt() * z).max(0.0);
            }
        }
        self.patient.reset_to(x);
        self.day_index = 0;
        self.day = self.opts.meals.sample_day(&mut self.rng);
        self.steps = 0;
        self.noise_z = if self.opts.sensor.noise {
            StandardNormal.sample(&mut self.rng)
        } else {
            0.0
        };
        self.cgm = self.measure();
        obs[0] = self.cgm as f32;
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<Step, SimError> {
        let rate = match action {
            Action::Continuous([a]) if a.is_finite() => f64::from(*a),
            other => {
                return Err(SimError::InvalidAction {
                    env: Self::ID,
                    action: format!("{other:?}"),
                    expected: "one finite basal rate (U/min)".into(),
                });
            }
        };
        let insulin = rate.clamp(0.0, self.opts.max_basal_u_per_min);
        for _ in 0..self.opts.sample_time_min {
            let minute = self.patient.t() as u64;
            let day = minute / 1440;
            if day != self.day_index {
                self.day_index = day;
                self.day = self.opts.meals.sample_day(&mut self.rng);
            }
            let cho = self.day.at((minute % 1440) as u32);
            self.patient.step(cho, insulin)?;
        }
        self.steps += 1;
        let prev_cgm = self.cgm;
        self.cgm = self.measure();
        obs[0] = self.cgm as f32;
        let reward = match self.opts.reward {
            UvaReward::RiskDiff => risk_index(prev_cgm).2 - risk_index(self.cgm).2,
            UvaReward::NegRisk | UvaReward::DayRisk => -risk_index(self.cgm).2,
        };
        let bg = self.patient.bg();
        let terminated =
            bg < self.opts.terminate_below_mg_dl || bg > self.opts.terminate_above_mg_dl;
        let mut reward = reward;
        if terminated && self.opts.reward == UvaReward::DayRisk {
            let step_min = f64::from(self.opts.sample_time_min);
            let left = ((f64::from(self.opts.episode_minutes) - self.patient.t()) / step_min)
                .ceil()
                .max(0.0);
            reward -= left * risk_index(self.cgm).2;
        }
        let truncated =
            !terminated && self.patient.t() >= f64::from(self.opts.episode_minutes) - 1e-9;
        Ok(Step {
            reward,
            terminated,
            truncated,
        })
    }

    fn state(&self) -> Vec<f64> {
        let mut v = self.patient.state();
        v.extend_from_slice(&[self.cgm, self.noise_z, self.steps as f64]);
        v
    }

    fn set_state(&mut self, state: &[f64], obs: &mut [f32]) -> Result<(), SimError> {
        if state.len() != ENV_STATE_LEN {
            return Err(SimError::StateLength {
                env: Self::ID,
                got: state.len(),
                expected: ENV_STATE_LEN,
            });
        }
        self.patient.set_state(&state[..PATIENT_STATE_LEN])?;
        self.cgm = state[PATIENT_STATE_LEN];
        self.noise_z = state[PATIENT_STATE_LEN + 1];
        self.steps = state[PATIENT_STATE_LEN + 2].max(0.0) as u64;
        self.day_index = (self.patient.t().max(0.0) as u64) / 1440;
        obs[0] = self.cgm as f32;
        Ok(())
    }
}

/// Replays a simglucose trace file (`testdata/simglucose_traces.json`): per episode, the patient
/// starts from `initial_state` and receives each minute's insulin (U/min) and carbohydrate
/// (g/min); Gsub after each minute is compared with `bg`. One result per patient episode,
/// error kind `bg_mg_dl`, tolerance 0.5 mg/dL.
pub fn replay_traces(traces: &serde_json::Value) -> Result<Vec<ReplayResult>, SimError> {
    const TOL: f64 = 0.5;
    let episodes = field(traces, "episodes")?
        .as_array()
        .ok_or_else(|| SimError::Invalid("episodes is not an array".into()))?;
    let mut out = Vec::with_capacity(episodes.len());
    for ep in episodes {
        let name = field(ep, "patient")?
            .as_str()
            .ok_or_else(|| SimError::Invalid("patient is not a string".into()))?;
        let mut p = T1dPatient::new(patient(name)?.clone());
        let init = field(ep, "initial_state")?
            .as_array()
            .ok_or_else(|| SimError::Invalid("initial_state is not an array".into()))?;
        if init.len() != N_STATES {
            return Err(SimError::StateLength {
                env: "simglucose trace",
                got: init.len(),
                expected: N_STATES,
            });
        }
        let mut x0 = [0.0; N_STATES];
        for (x, v) in x0.iter_mut().zip(init) {
            *x = v
                .as_f64()
                .ok_or_else(|| SimError::Invalid("initial_state holds a non-number".into()))?;
        }
        p.reset_to(x0);
        let steps = field(ep, "steps")?
            .as_array()
            .ok_or_else(|| SimError::Invalid("steps is not an array".into()))?;
        let mut max_err: f64 = 0.0;
        for s in steps {
            p.step(num(s, "cho_g_per_min")?, num(s, "insulin_U_per_min")?)?;
            let e = (p.bg() - num(s, "bg")?).abs();
            max_err = if e.is_nan() {
                f64::INFINITY
            } else {
                max_err.max(e)
            };
        }
        out.push(ReplayResult {
            name: name.to_string(),
            episodes: 1,
            steps: steps.len(),
            max_error: max_err,
            error_kind: "bg_mg_dl".into(),
            tolerance: TOL,
            mismatched_flags: 0,
            max_reward_error: 0.0,
            pass: max_err <= TOL,
        });
    }
    Ok(out)
}
