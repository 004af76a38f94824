//! Hand-written glucose controllers, the baselines a dosing policy is measured against:
//! simglucose 0.2.11's basal-bolus controller (`BBController`) and PID controller
//! (`PIDController`), and the README's proportional controller.
//!
//! Every controller reads what simglucose's controllers read: the CGM reading (mg/dL), the
//! announced carbohydrate rate over the last CGM sample (g/min, simglucose's `info["meal"]`) and
//! the sample time (minutes); it answers a [`Dose`]: a basal rate (U/min) and a bolus (U).
//!
//! simglucose's pump rounds what it is asked to deliver to its increments; [`SimglucosePump`]
//! does the same, so a dose can be compared with what simglucose recorded.
//!
//! [`run_episode`] runs a controller in closed loop on [`UvaPadovaEnv`]; [`tune_pid`] picks PID
//! gains per age group on training users by grid search.

use std::ops::Range;

use crate::clinical::{GlucoseMetrics, glucose_metrics, group_of};
use crate::env::{Env, GlucoseSample, SimError};
use crate::population::{Population, PumpSetting, UserParams};
use crate::uva_padova::{PatientParams, UvaAction, UvaObservation, UvaPadovaEnv, UvaPadovaOptions};
use crate::uva_padova::{UvaReward, therapy};

/// simglucose's basal-bolus target (mg/dL).
pub const BB_TARGET_MG_DL: f64 = 140.0;

/// Above this CGM reading (mg/dL) simglucose's basal-bolus controller adds a correction bolus.
pub const BB_CORRECTION_ABOVE_MG_DL: f64 = 150.0;

/// What a controller asks the pump for at one decision.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Dose {
    /// Basal rate (U/min), held until the next decision.
    pub basal_u_per_min: f64,
    /// Bolus (U), delivered over the next CGM sample.
    pub bolus_u: f64,
}

impl Dose {
    /// The dose as simglucose's single insulin rate over one sample (U/min): basal plus the
    /// bolus spread over `sample_time_min` minutes.
    pub fn rate_u_per_min(&self, sample_time_min: f64) -> f64 {
        self.basal_u_per_min + self.bolus_u / sample_time_min
    }
}

/// A glucose controller: one decision per CGM sample.
pub trait Controller: Send {
    /// A short name for reports (`basal-bolus`, `pid`, `proportional`).
    fn name(&self) -> &'static str;
    /// The dose for the current CGM reading `cgm_mg_dl` (mg/dL), given the carbohydrate rate
    /// announced over the last sample `meal_g_per_min` (g/min) and the sample time (minutes).
    fn act(&mut self, cgm_mg_dl: f64, meal_g_per_min: f64, sample_time_min: f64) -> Dose;
    /// Forgets the state of an episode (PID's integral and last reading).
    fn reset(&mut self);
}

/// simglucose's basal-bolus controller: the patient's steady-state basal rate all the time, and
/// at an announced meal a bolus covering its carbohydrate plus a correction when the CGM reads
/// above 150 mg/dL.
#[derive(Clone, Debug, PartialEq)]
pub struct BasalBolus {
    /// Basal rate (U/min): simglucose's u2ss * BW / 6000.
    pub basal_u_per_min: f64,
    /// Carbohydrate ratio (g/U).
    pub cr_g_per_u: f64,
    /// Correction factor (mg/dL per U).
    pub cf_mg_dl_per_u: f64,
    /// Correction target (mg/dL).
    pub target_mg_dl: f64,
}

impl BasalBolus {
    /// The controller of one virtual patient: basal from the patient table, CR and CF from
    /// simglucose's Quest table, target 140 mg/dL.
    pub fn for_patient(params: &PatientParams) -> Result<Self, SimError> {
        let q = therapy(&params.name)?;
        Ok(Self {
            basal_u_per_min: params.basal_u_per_min(),
            cr_g_per_u: q.cr_g_per_u,
            cf_mg_dl_per_u: q.cf_mg_dl_per_u,
            target_mg_dl: BB_TARGET_MG_DL,
        })
    }
}

impl Controller for BasalBolus {
    fn name(&self) -> &'static str {
        "basal-bolus"
    }

    fn act(&mut self, cgm_mg_dl: f64, meal_g_per_min: f64, sample_time_min: f64) -> Dose {
        // simglucose boluses only when the last sample carried a meal, and corrects only then.
        let bolus_u = if meal_g_per_min > 0.0 {
            let carbs_g = meal_g_per_min * sample_time_min;
            let correction = if cgm_mg_dl > BB_CORRECTION_ABOVE_MG_DL {
                (cgm_mg_dl - self.target_mg_dl) / self.cf_mg_dl_per_u
            } else {
                0.0
            };
            carbs_g / self.cr_g_per_u + correction
        } else {
            0.0
        };
        Dose {
            basal_u_per_min: self.basal_u_per_min,
            bolus_u,
        }
    }

    fn reset(&mut self) {}
}

/// simglucose's PID controller: basal = P (cgm - target) + I integral + D (cgm - last) / dt,
/// no bolus, no basal offset. Its state starts at zero (so the first derivative term sees a
/// jump from 0 mg/dL, as simglucose's does) and is updated after the output is computed.
#[derive(Clone, Debug, PartialEq)]
pub struct Pid {
    /// Proportional gain (U/min per mg/dL).
    pub p: f64,
    /// Integral gain (U/min per mg/dL min).
    pub i: f64,
    /// Derivative gain (U per mg/dL).
    pub d: f64,
    /// Target (mg/dL); simglucose's default is 140.
    pub target_mg_dl: f64,
    integrated: f64,
    prev_mg_dl: f64,
}

/// PID gains (P, I, D), see [`Pid`].
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct PidGains {
    pub p: f64,
    pub i: f64,
    pub d: f64,
}

impl Pid {
    /// A PID controller with gains `g` and target `target_mg_dl` (mg/dL).
    pub fn new(g: PidGains, target_mg_dl: f64) -> Self {
        Self {
            p: g.p,
            i: g.i,
            d: g.d,
            target_mg_dl,
            integrated: 0.0,
            prev_mg_dl: 0.0,
        }
    }

    /// The integral of (cgm - target) so far (mg/dL min).
    pub fn integral(&self) -> f64 {
        self.integrated
    }
}

impl Controller for Pid {
    fn name(&self) -> &'static str {
        "pid"
    }

    fn act(&mut self, cgm_mg_dl: f64, _meal_g_per_min: f64, sample_time_min: f64) -> Dose {
        let err = cgm_mg_dl - self.target_mg_dl;
        let u = self.p * err
            + self.i * self.integrated
            + self.d * (cgm_mg_dl - self.prev_mg_dl) / sample_time_min;
        // simglucose's order: output first, then the last reading and the integral.
        self.prev_mg_dl = cgm_mg_dl;
        self.integrated += err * sample_time_min;
        Dose {
            basal_u_per_min: u,
            bolus_u: 0.0,
        }
    }

    fn reset(&mut self) {
        self.integrated = 0.0;
        self.prev_mg_dl = 0.0;
    }
}

/// The README's hand-written proportional controller: 0.02 U/min plus 0.0002 U/min per mg/dL
/// above 140 (less below it), never negative; no bolus.
#[derive(Clone, Debug, PartialEq)]
pub struct Proportional {
    /// Rate at the target (U/min).
    pub base_u_per_min: f64,
    /// Gain (U/min per mg/dL).
    pub gain: f64,
    /// Target (mg/dL).
    pub target_mg_dl: f64,
}

impl Default for Proportional {
    fn default() -> Self {
        Self {
            base_u_per_min: 0.02,
            gain: 0.0002,
            target_mg_dl: 140.0,
        }
    }
}

impl Controller for Proportional {
    fn name(&self) -> &'static str {
        "proportional"
    }

    fn act(&mut self, cgm_mg_dl: f64, _meal_g_per_min: f64, _sample_time_min: f64) -> Dose {
        Dose {
            basal_u_per_min: (self.base_u_per_min + self.gain * (cgm_mg_dl - self.target_mg_dl))
                .max(0.0),
            bolus_u: 0.0,
        }
    }

    fn reset(&mut self) {}
}

/// simglucose's `InsulinPump`: each requested rate (U/min) is converted to pmol/min (x 6000),
/// rounded to the pump's increment, converted back and clipped to the pump's range. Basal and
/// bolus rates are rounded separately, as simglucose does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimglucosePump {
    /// Basal increment (pmol/min).
    pub inc_basal: f64,
    /// Bolus increment (pmol/min).
    pub inc_bolus: f64,
    /// Basal range (U/min).
    pub min_basal: f64,
    pub max_basal: f64,
    /// Bolus rate range (U/min).
    pub min_bolus: f64,
    pub max_bolus: f64,
}

impl SimglucosePump {
    /// simglucose's unit conversion (pmol per U).
    pub const U2PMOL: f64 = 6000.0;

    /// The Insulet row of simglucose's `pump_params.csv`.
    pub fn insulet() -> Self {
        Self {
            inc_basal: 0.05,
            inc_bolus: 0.05,
            min_basal: 0.0,
            max_basal: 30.0,
            min_bolus: 0.0,
            max_bolus: 30.0,
        }
    }

    fn round(rate_u_per_min: f64, inc: f64, lo: f64, hi: f64) -> f64 {
        // numpy rounds half to even; Rust's round_ties_even matches it.
        let pmol = (rate_u_per_min * Self::U2PMOL / inc).round_ties_even() * inc;
        (pmol / Self::U2PMOL).min(hi).max(lo)
    }

    /// The basal rate (U/min) the pump delivers when asked for `rate_u_per_min`.
    pub fn basal(&self, rate_u_per_min: f64) -> f64 {
        Self::round(
            rate_u_per_min,
            self.inc_basal,
            self.min_basal,
            self.max_basal,
        )
    }

    /// The bolus rate (U/min) the pump delivers when asked for `rate_u_per_min`.
    pub fn bolus(&self, rate_u_per_min: f64) -> f64 {
        Self::round(
            rate_u_per_min,
            self.inc_bolus,
            self.min_bolus,
            self.max_bolus,
        )
    }

    /// simglucose's insulin rate over one sample (U/min) for `dose`: rounded basal plus the
    /// rounded bolus rate (bolus spread over `sample_time_min` minutes).
    pub fn delivered_u_per_min(&self, dose: Dose, sample_time_min: f64) -> f64 {
        self.basal(dose.basal_u_per_min) + self.bolus(dose.bolus_u / sample_time_min)
    }
}

/// Runs `ctl` in closed loop for one episode of `env`: reset with `seed`, then one decision per
/// CGM sample ([`UvaPadovaEnv::step_insulin`]) until the episode ends. Returns the episode's
/// glucose log (one sample per CGM period, the first at reset). The env must decide every CGM
/// sample (`decision_min == sample_time_min`), as simglucose's controllers do.
pub fn run_episode(
    env: &mut UvaPadovaEnv,
    ctl: &mut dyn Controller,
    seed: u64,
) -> Result<Vec<GlucoseSample>, SimError> {
    let o = env.options();
    if o.decision_min != o.sample_time_min {
        return Err(SimError::Invalid(format!(
            "run_episode: the env decides every {} min, the controller every {} min CGM sample",
            o.decision_min, o.sample_time_min
        )));
    }
    let sample_time = f64::from(o.sample_time_min);
    let mut obs = vec![0.0f32; env.observation_space().dim()];
    env.reset(seed, &mut obs);
    ctl.reset();
    loop {
        let dose = ctl.act(env.cgm(), env.last_cho_g_per_min(), sample_time);
        let step = env.step_insulin(dose.basal_u_per_min, dose.bolus_u)?;
        if step.terminated || step.truncated {
            break;
        }
    }
    Ok(env.glucose_log().unwrap_or_default().to_vec())
}

/// The options a controller runs under for a user of a `uva-padova*` population: the
/// population's patient, meals, sensor and episode, with a decision every CGM sample and the
/// basal-rate action (controllers dose in U/min and U through `step_insulin`).
pub fn controller_options(pump: PumpSetting) -> UvaPadovaOptions {
    let base = match pump {
        PumpSetting::Basal => UvaPadovaOptions {
            reward: UvaReward::DayRisk,
            ..UvaPadovaOptions::default()
        },
        PumpSetting::Pump => UvaPadovaOptions::pump(false),
        PumpSetting::PumpMeals => UvaPadovaOptions::pump(true),
    };
    UvaPadovaOptions {
        decision_min: base.sample_time_min,
        observation: UvaObservation::default(),
        action: UvaAction::BasalRate,
        ..base
    }
}

/// User `user` of a `uva-padova*` population as a controller's environment (see
/// [`controller_options`]), behind the population's low-glucose suspend if it has one.
pub fn user_env(population: &Population, user: u64) -> Result<UvaPadovaEnv, SimError> {
    match population.user_params(user)? {
        UserParams::Patient { name, pump } => {
            let mut opts = controller_options(pump);
            // The suspend and the IOB limit are the pump's: a controller behind it gets them.
            population.pump_overrides().apply_pump_rules(&mut opts);
            UvaPadovaEnv::new(&name, opts)
        }
        _ => Err(SimError::Invalid(format!(
            "population {:?} is not a UVA/Padova population",
            population.name()
        ))),
    }
}

/// The consensus target for time below 70 mg/dL (Battelino et al. 2019): at most 4%.
pub const MAX_TIME_BELOW_70: f64 = 0.04;

/// The grid [`tune_pid`] searches: every combination of the listed gains.
#[derive(Clone, Debug, PartialEq)]
pub struct PidGrid {
    pub p: Vec<f64>,
    pub i: Vec<f64>,
    pub d: Vec<f64>,
    /// Target (mg/dL).
    pub target_mg_dl: f64,
}

/// `n` log-spaced values from `lo` to `hi` (both included; `n == 1`: `lo`).
pub fn logspace(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if n <= 1 {
        return vec![lo];
    }
    let (a, b) = (lo.ln(), hi.ln());
    (0..n)
        .map(|k| (a + (b - a) * k as f64 / (n - 1) as f64).exp())
        .collect()
}

impl Default for PidGrid {
    /// 5 x 3 x 3 = 45 gains around simglucose's example (P 1e-3, I 1e-5, D 1e-3): with 30
    /// training users (about 10 per age group), about 450 closed-loop days per group.
    fn default() -> Self {
        Self {
            p: logspace(1e-4, 1e-2, 5),
            i: logspace(1e-7, 1e-5, 3),
            d: logspace(1e-3, 1e-1, 3),
            target_mg_dl: BB_TARGET_MG_DL,
        }
    }
}

impl PidGrid {
    /// Every gain of the grid.
    pub fn gains(&self) -> Vec<PidGains> {
        let mut out = Vec::with_capacity(self.p.len() * self.i.len() * self.d.len());
        for &p in &self.p {
            for &i in &self.i {
                for &d in &self.d {
                    out.push(PidGains { p, i, d });
                }
            }
        }
        out
    }
}

/// The age groups of the UVA/Padova patients (the prefix of their names).
pub const AGE_GROUPS: [&str; 3] = ["adult", "adolescent", "child"];

/// What [`tune_pid`] chose for one age group.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PidTuning {
    pub group: String,
    pub gains: PidGains,
    /// Mean over the group's training days of the chosen gains' figures.
    pub stats: GlucoseMetrics,
    /// The chosen gains keep mean time below 70 within [`MAX_TIME_BELOW_70`] (otherwise they
    /// are the grid's least hypoglycaemic gains).
    pub meets_hypo_target: bool,
    /// Training users (one day each) of the group.
    pub users: usize,
    /// Closed-loop days run for the group (gains x users).
    pub days: usize,
}

/// Grid search of PID gains per age group on the training users `users` of a `uva-padova*`
/// population, one day each (reset seed `seed + user`): the gains with the highest mean time in
/// range among those with mean time below 70 within [`MAX_TIME_BELOW_70`], or, when none is,
/// the gains with the least mean time below 70. Groups without training users are left out.
/// Only training users are run: held-out users never inform the gains.
pub fn tune_pid(
    population: &Population,
    users: Range<u64>,
    grid: &PidGrid,
    seed: u64,
) -> Result<Vec<PidTuning>, SimError> {
    let gains = grid.gains();
    if gains.is_empty() {
        return Err(SimError::Invalid("tune_pid: empty grid".into()));
    }
    let mut envs: Vec<UvaPadovaEnv> = users
        .clone()
        .map(|u| user_env(population, u))
        .collect::<Result<_, _>>()?;
    let seeds: Vec<u64> = users.map(|u| seed.wrapping_add(u)).collect();
    let mut out = Vec::new();
    for group in AGE_GROUPS {
        let members: Vec<usize> = (0..envs.len())
            .filter(|&k| group_of(&envs[k].patient().params().name) == group)
            .collect();
        if members.is_empty() {
            continue;
        }
        // (gains, mean stats) for every grid point.
        let mut scored = Vec::with_capacity(gains.len());
        for &g in &gains {
            let mut days = Vec::with_capacity(members.len());
            for &k in &members {
                let mut pid = Pid::new(g, grid.target_mg_dl);
                let log = run_episode(&mut envs[k], &mut pid, seeds[k])?;
                let bg: Vec<f64> = log.iter().map(|s| s.bg_mg_dl).collect();
                days.push(
                    glucose_metrics(&bg).map_err(|e| SimError::Invalid(format!("PID day: {e}")))?,
                );
            }
            scored.push((g, GlucoseMetrics::mean_of(&days)));
        }
        let feasible = scored
            .iter()
            .filter(|(_, s)| s.time_below_70 <= MAX_TIME_BELOW_70)
            .max_by(|a, b| a.1.time_in_range.total_cmp(&b.1.time_in_range));
        let (chosen, meets) = match feasible {
            Some(c) => (c, true),
            None => {
                let least = scored
                    .iter()
                    .min_by(|a, b| {
                        a.1.time_below_70
                            .total_cmp(&b.1.time_below_70)
                            .then(b.1.time_in_range.total_cmp(&a.1.time_in_range))
                    })
                    .expect("grid is not empty");
                (least, false)
            }
        };
        out.push(PidTuning {
            group: group.to_string(),
            gains: chosen.0,
            stats: chosen.1,
            meets_hypo_target: meets,
            users: members.len(),
            days: members.len() * gains.len(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pump_rounds_to_its_increment_in_pmol_and_clips() {
        let p = SimglucosePump::insulet();
        // adult#001's basal, 126.736 pmol/min, is delivered as 126.75 pmol/min.
        let basal = 1.2386244136 * 102.32 / 6000.0;
        assert!((p.basal(basal) - 126.75 / 6000.0).abs() < 1e-15);
        assert!((p.bolus(0.01 / 6000.0)).abs() < 1e-15);
        assert_eq!(p.basal(-1.0), 0.0);
        assert_eq!(p.bolus(100.0), 30.0);
    }
}
