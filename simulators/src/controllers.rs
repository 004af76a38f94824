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

use std::sync::OnceLock;

use crate::SimError;
use crate::uva_padova::PatientParams;

/// simglucose's `Quest.csv` (MIT licence; carbohydrate ratio, correction factor, age and total
/// daily insulin per virtual patient), embedded unchanged from `testdata/`.
pub const QUEST_CSV: &str = include_str!("../../testdata/uva_padova_quest.csv");

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

/// One row of simglucose's `Quest.csv`.
#[derive(Clone, Debug, PartialEq)]
pub struct QuestRow {
    pub name: String,
    /// Carbohydrate ratio (g of carbohydrate covered by 1 U).
    pub cr_g_per_u: f64,
    /// Correction factor (mg/dL lowered by 1 U).
    pub cf_mg_dl_per_u: f64,
    /// Age (years).
    pub age_years: f64,
    /// Total daily insulin (U/day).
    pub tdi_u: f64,
}

fn parse_quest(csv: &str) -> Result<Vec<QuestRow>, String> {
    let mut lines = csv.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines
        .next()
        .ok_or("empty Quest table")?
        .split(',')
        .map(str::trim)
        .collect();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .ok_or_else(|| format!("Quest table lacks column {name}"))
    };
    let (c_name, c_cr, c_cf, c_age, c_tdi) = (
        col("Name")?,
        col("CR")?,
        col("CF")?,
        col("Age")?,
        col("TDI")?,
    );
    let mut out = Vec::new();
    for line in lines {
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        if cells.len() != header.len() {
            return Err(format!("Quest table row has {} cells", cells.len()));
        }
        let get = |c: usize| -> Result<f64, String> {
            cells[c]
                .parse::<f64>()
                .map_err(|e| format!("{}: {}: {e}", cells[c_name], header[c]))
        };
        out.push(QuestRow {
            name: cells[c_name].to_string(),
            cr_g_per_u: get(c_cr)?,
            cf_mg_dl_per_u: get(c_cf)?,
            age_years: get(c_age)?,
            tdi_u: get(c_tdi)?,
        });
    }
    Ok(out)
}

/// The 30 rows of simglucose's `Quest.csv`, in table order.
pub fn quest_table() -> Result<&'static [QuestRow], SimError> {
    static TABLE: OnceLock<Result<Vec<QuestRow>, String>> = OnceLock::new();
    match TABLE.get_or_init(|| parse_quest(QUEST_CSV)) {
        Ok(v) => Ok(v),
        Err(e) => Err(SimError::Invalid(format!("Quest table: {e}"))),
    }
}

/// The Quest row of the patient named `name` (`adult#001`).
pub fn quest(name: &str) -> Result<&'static QuestRow, SimError> {
    quest_table()?
        .iter()
        .find(|r| r.name == name)
        .ok_or_else(|| SimError::Invalid(format!("Quest table has no patient {name:?}")))
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
        let q = quest(&params.name)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quest_table_has_thirty_patients_and_known_rows() {
        let t = quest_table().expect("parses");
        assert_eq!(t.len(), 30);
        let a = quest("adult#001").expect("row");
        assert_eq!(a.cr_g_per_u, 10.0);
        assert_eq!(a.cf_mg_dl_per_u, 8.77310657487);
        assert!(quest("adult#011").is_err());
    }

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
