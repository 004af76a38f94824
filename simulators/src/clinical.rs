//! Clinical glucose metrics of a patient-day, as a diabetes researcher reads them: time in and
//! out of range, mean glucose, Kovatchev's low/high blood glucose indices, and the control
//! variability grid (CVGA, Magni et al. 2008), all computed the way simglucose 0.2.11's analysis
//! computes them, plus pooling over patient-days, per-group summaries, the spread over patients
//! and the worst patient.
//!
//! All glucose values are in mg/dL; time fractions are fractions of samples (readings on a
//! regular grid, so a fraction of samples is a fraction of time).
//!
//! Boundaries, as in simglucose's `percent_stats`:
//! - in range: 70 <= BG <= 180 (both ends inclusive);
//! - below 70: BG < 70; below 54: BG < 54 (strict);
//! - above 180: BG > 180; above 250: BG > 250 (strict);
//!
//! so in range + below 70 + above 180 = 1 exactly (as counts).
//!
//! Risk indices, as simglucose's `risk_index`: f(BG) = 1.509 (ln(BG)^1.084 - 5.381),
//! r(BG) = 10 f(BG)^2; LBGI is the mean of r over the readings with f < 0 **only** (not over all
//! readings, as Kovatchev's LBGI is defined), HBGI the mean of r over the readings with f > 0
//! only, each 0 when there are no such readings; risk index = LBGI + HBGI. This reproduces
//! simglucose's own numbers in `testdata/simglucose_bb_reference.json` to 1e-12; Kovatchev's
//! mean-over-all-readings definition does not.

use std::collections::BTreeMap;

use serde::Serialize;
use thiserror::Error;

use crate::env::GlucoseSample;
use crate::population::{Population, UserParams};

/// Lower bound of the target range (mg/dL), inclusive.
pub const RANGE_LOW_MG_DL: f64 = 70.0;
/// Upper bound of the target range (mg/dL), inclusive.
pub const RANGE_HIGH_MG_DL: f64 = 180.0;
/// Level-2 hypoglycaemia threshold (mg/dL), strict.
pub const SEVERE_LOW_MG_DL: f64 = 54.0;
/// Level-2 hyperglycaemia threshold (mg/dL), strict.
pub const SEVERE_HIGH_MG_DL: f64 = 250.0;

/// Why metrics could not be computed.
#[derive(Debug, Error, PartialEq)]
pub enum ClinicalError {
    #[error("clinical metrics of an empty glucose series")]
    Empty,
    #[error("glucose reading {index} is {value} mg/dL (must be finite and positive)")]
    BadReading { index: usize, value: f64 },
    #[error("BG has {bg} samples but CGM has {cgm}")]
    LengthMismatch { bg: usize, cgm: usize },
}

/// Metrics of one glucose series (a patient-day of BG or of CGM), or their mean over
/// patient-days, or a component-wise min / median / max over patients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct GlucoseMetrics {
    /// Fraction of samples with 70 <= BG <= 180 mg/dL.
    pub time_in_range: f64,
    /// Fraction of samples with BG < 70 mg/dL.
    pub time_below_70: f64,
    /// Fraction of samples with BG < 54 mg/dL.
    pub time_below_54: f64,
    /// Fraction of samples with BG > 180 mg/dL.
    pub time_above_180: f64,
    /// Fraction of samples with BG > 250 mg/dL.
    pub time_above_250: f64,
    /// Mean glucose (mg/dL).
    pub mean_mg_dl: f64,
    /// Low blood glucose index (simglucose's: mean risk over the low readings only).
    pub lbgi: f64,
    /// High blood glucose index (simglucose's: mean risk over the high readings only).
    pub hbgi: f64,
    /// LBGI + HBGI.
    pub risk_index: f64,
}

impl GlucoseMetrics {
    /// The metrics as an array, in field order (for component-wise statistics).
    fn to_array(self) -> [f64; 9] {
        [
            self.time_in_range,
            self.time_below_70,
            self.time_below_54,
            self.time_above_180,
            self.time_above_250,
            self.mean_mg_dl,
            self.lbgi,
            self.hbgi,
            self.risk_index,
        ]
    }

    fn from_array(a: [f64; 9]) -> Self {
        Self {
            time_in_range: a[0],
            time_below_70: a[1],
            time_below_54: a[2],
            time_above_180: a[3],
            time_above_250: a[4],
            mean_mg_dl: a[5],
            lbgi: a[6],
            hbgi: a[7],
            risk_index: a[8],
        }
    }

    /// Component-wise mean of `items` (all zero when empty).
    pub fn mean_of(items: &[GlucoseMetrics]) -> GlucoseMetrics {
        let mut acc = [0.0; 9];
        for m in items {
            for (a, v) in acc.iter_mut().zip(m.to_array()) {
                *a += v;
            }
        }
        let n = items.len().max(1) as f64;
        GlucoseMetrics::from_array(acc.map(|a| a / n))
    }

    /// Component-wise quantile-like statistic: `pick` gets each metric's sorted values.
    fn componentwise(items: &[GlucoseMetrics], pick: impl Fn(&[f64]) -> f64) -> GlucoseMetrics {
        let mut out = [0.0; 9];
        for (k, o) in out.iter_mut().enumerate() {
            let mut v: Vec<f64> = items.iter().map(|m| m.to_array()[k]).collect();
            v.sort_by(f64::total_cmp);
            *o = if v.is_empty() { 0.0 } else { pick(&v) };
        }
        GlucoseMetrics::from_array(out)
    }
}

/// Kovatchev's symmetrised glucose scale f(BG) = 1.509 (ln(BG)^1.084 - 5.381); negative below
/// about 112.5 mg/dL.
pub fn risk_scale(bg_mg_dl: f64) -> f64 {
    1.509 * (bg_mg_dl.ln().powf(1.084) - 5.381)
}

/// (LBGI, HBGI, risk index) of `bg` (mg/dL) as simglucose 0.2.11's `risk_index(BG, horizon)`
/// with the whole series as horizon: rl averaged over the low readings only, rh over the high
/// readings only, 0 when there are none.
pub fn risk_indices(bg: &[f64]) -> (f64, f64, f64) {
    let (mut low_sum, mut low_n, mut high_sum, mut high_n) = (0.0, 0usize, 0.0, 0usize);
    for &g in bg {
        let f = risk_scale(g);
        let r = 10.0 * f * f;
        if f < 0.0 {
            low_sum += r;
            low_n += 1;
        } else if f > 0.0 {
            high_sum += r;
            high_n += 1;
        }
    }
    let lbgi = if low_n > 0 {
        low_sum / low_n as f64
    } else {
        0.0
    };
    let hbgi = if high_n > 0 {
        high_sum / high_n as f64
    } else {
        0.0
    };
    (lbgi, hbgi, lbgi + hbgi)
}

fn check(series: &[f64]) -> Result<(), ClinicalError> {
    if series.is_empty() {
        return Err(ClinicalError::Empty);
    }
    match series
        .iter()
        .enumerate()
        .find(|(_, g)| !(g.is_finite() && **g > 0.0))
    {
        Some((index, &value)) => Err(ClinicalError::BadReading { index, value }),
        None => Ok(()),
    }
}

/// The metrics of one glucose series (mg/dL, one value per sample).
pub fn glucose_metrics(bg: &[f64]) -> Result<GlucoseMetrics, ClinicalError> {
    check(bg)?;
    let n = bg.len() as f64;
    let frac = |pred: &dyn Fn(f64) -> bool| bg.iter().filter(|&&g| pred(g)).count() as f64 / n;
    let (lbgi, hbgi, risk_index) = risk_indices(bg);
    Ok(GlucoseMetrics {
        time_in_range: frac(&|g| (RANGE_LOW_MG_DL..=RANGE_HIGH_MG_DL).contains(&g)),
        time_below_70: frac(&|g| g < RANGE_LOW_MG_DL),
        time_below_54: frac(&|g| g < SEVERE_LOW_MG_DL),
        time_above_180: frac(&|g| g > RANGE_HIGH_MG_DL),
        time_above_250: frac(&|g| g > SEVERE_HIGH_MG_DL),
        mean_mg_dl: bg.iter().sum::<f64>() / n,
        lbgi,
        hbgi,
        risk_index,
    })
}

/// A zone of the control variability grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum CvgaZone {
    A,
    B,
    C,
    D,
    E,
}

impl CvgaZone {
    pub const ALL: [CvgaZone; 5] = [
        CvgaZone::A,
        CvgaZone::B,
        CvgaZone::C,
        CvgaZone::D,
        CvgaZone::E,
    ];

    /// The zone of a point with lower coordinate `x` and upper coordinate `y` (mg/dL), on
    /// simglucose's grid: columns min > 90 / 70 < min <= 90 / min <= 70, rows max < 180 /
    /// 180 <= max < 300 / max >= 300; A is (first, first), B the three cells next to it, C the
    /// (far, first) corners, D their neighbours, E (last, last).
    ///
    /// simglucose leaves points with min > 110 or max < 110 unclassified; Magni et al. plot them
    /// on the grid's edge (110), which is what this does, so such a well-controlled day is A.
    pub fn of(x_mg_dl: f64, y_mg_dl: f64) -> CvgaZone {
        let col = if x_mg_dl > 90.0 {
            0
        } else if x_mg_dl > 70.0 {
            1
        } else {
            2
        };
        let row = if y_mg_dl < 180.0 {
            0
        } else if y_mg_dl < 300.0 {
            1
        } else {
            2
        };
        match (col, row) {
            (0, 0) => CvgaZone::A,
            (1, 0) | (0, 1) | (1, 1) => CvgaZone::B,
            (2, 0) | (0, 2) => CvgaZone::C,
            (2, 1) | (1, 2) => CvgaZone::D,
            _ => CvgaZone::E,
        }
    }
}

/// A patient-day's point on the control variability grid.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CvgaPoint {
    /// Lowest reading (mg/dL).
    pub min_mg_dl: f64,
    /// Highest reading (mg/dL).
    pub max_mg_dl: f64,
    /// Horizontal coordinate as simglucose draws it: the 2.5th percentile (numpy's linear
    /// interpolation) clipped to [50, 400] mg/dL; the axis runs from 110 down to 50.
    pub x_mg_dl: f64,
    /// Vertical coordinate: the 97.5th percentile clipped to [50, 400] mg/dL.
    pub y_mg_dl: f64,
    pub zone: CvgaZone,
}

/// numpy's default (linear) percentile of sorted values, `p` in [0, 100].
fn percentile_sorted(sorted: &[f64], p: f64) -> f64 {
    let pos = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// The CVGA point of one patient-day's glucose series (mg/dL).
pub fn cvga_point(bg: &[f64]) -> Result<CvgaPoint, ClinicalError> {
    check(bg)?;
    let mut s = bg.to_vec();
    s.sort_by(f64::total_cmp);
    let x = percentile_sorted(&s, 2.5).clamp(50.0, 400.0);
    let y = percentile_sorted(&s, 97.5).clamp(50.0, 400.0);
    Ok(CvgaPoint {
        min_mg_dl: s[0],
        max_mg_dl: s[s.len() - 1],
        x_mg_dl: x,
        y_mg_dl: y,
        zone: CvgaZone::of(x.min(110.0), y.max(110.0)),
    })
}

/// The age group of a UVA/Padova patient name (`adult#001` -> `adult`); `all` for anything else
/// (other environments' users form one group).
pub fn group_of(patient: &str) -> &'static str {
    for g in ["adolescent", "adult", "child"] {
        if patient.starts_with(g) && patient[g.len()..].starts_with('#') {
            return g;
        }
    }
    "all"
}

/// Clinical summary of one patient-day (or one evaluation episode), on the true blood glucose
/// and on the sensor reading.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClinicalSummary {
    /// Patient name (`adult#001`) or user label.
    pub patient: String,
    /// The population's user id, when known (several users can share a virtual patient).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<u64>,
    /// Day of the episode (0-based) this summary covers.
    pub day: usize,
    /// [`group_of`] the patient.
    pub group: String,
    /// Number of glucose samples.
    pub samples: usize,
    /// Metrics on the true blood glucose.
    pub bg: GlucoseMetrics,
    /// Metrics on the CGM reading.
    pub cgm: GlucoseMetrics,
    /// CVGA point on the true blood glucose.
    pub cvga_bg: CvgaPoint,
    /// CVGA point on the CGM reading.
    pub cvga_cgm: CvgaPoint,
}

impl ClinicalSummary {
    /// Summarises one patient-day from its BG and CGM series (mg/dL, same sample grid).
    pub fn new(patient: &str, bg: &[f64], cgm: &[f64]) -> Result<Self, ClinicalError> {
        if bg.len() != cgm.len() {
            return Err(ClinicalError::LengthMismatch {
                bg: bg.len(),
                cgm: cgm.len(),
            });
        }
        Ok(Self {
            patient: patient.to_string(),
            user: None,
            day: 0,
            group: group_of(patient).to_string(),
            samples: bg.len(),
            bg: glucose_metrics(bg)?,
            cgm: glucose_metrics(cgm)?,
            cvga_bg: cvga_point(bg)?,
            cvga_cgm: cvga_point(cgm)?,
        })
    }
}

/// The label of a population's user in a clinical report: the virtual patient's name
/// (`adult#001`) for UVA/Padova users, `user N` otherwise.
pub fn patient_label(population: &Population, user: u64) -> String {
    match population.user_params(user) {
        Ok(UserParams::Patient { name, .. }) => name,
        _ => format!("user {user}"),
    }
}

/// Minutes in a patient-day.
pub const DAY_MIN: f64 = 24.0 * 60.0;

/// An episode's glucose log cut into patient-days at each midnight (minute 1440 k); the sample
/// at midnight ends one day and starts the next, as simglucose's day of 481 three-minute samples
/// holds both 00:00 readings. A day-long episode is one patient-day; one stopped early (glucose
/// out of the simulator's bounds) is a shorter one. Empty logs give no day.
pub fn split_days(samples: &[GlucoseSample]) -> Vec<&[GlucoseSample]> {
    let mut days = Vec::new();
    let mut start = 0;
    let mut day = 1.0;
    while start < samples.len() {
        let end_minute = day * DAY_MIN;
        // First sample strictly after this day's midnight.
        let end = samples[start..]
            .iter()
            .position(|s| s.minute > end_minute)
            .map_or(samples.len(), |k| start + k);
        days.push(&samples[start..end]);
        if end == samples.len() {
            break;
        }
        // The next day starts at the midnight sample when there is one.
        start = if end > start && samples[end - 1].minute == end_minute {
            end - 1
        } else {
            end
        };
        day += 1.0;
    }
    days
}

/// Patient-day summaries of one episode's glucose log.
pub fn summarize_episode(
    patient: &str,
    user: Option<u64>,
    samples: &[GlucoseSample],
) -> Result<Vec<ClinicalSummary>, ClinicalError> {
    split_days(samples)
        .into_iter()
        .enumerate()
        .map(|(day, s)| {
            let bg: Vec<f64> = s.iter().map(|x| x.bg_mg_dl).collect();
            let cgm: Vec<f64> = s.iter().map(|x| x.cgm_mg_dl).collect();
            let mut c = ClinicalSummary::new(patient, &bg, &cgm)?;
            c.user = user;
            c.day = day;
            Ok(c)
        })
        .collect()
}

/// Min, median and max over patients, component-wise (each patient's metrics first averaged
/// over that patient's days); the median of an even count is the mean of the middle two.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    pub min: GlucoseMetrics,
    pub median: GlucoseMetrics,
    pub max: GlucoseMetrics,
}

/// The patient with the lowest time in range on BG (averaged over their days).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorstPatient {
    pub patient: String,
    /// That patient's BG metrics, averaged over their days.
    pub bg: GlucoseMetrics,
}

/// Fractions of patient-days in each CVGA zone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ZoneFractions {
    pub a: f64,
    pub b: f64,
    pub c: f64,
    pub d: f64,
    pub e: f64,
}

impl ZoneFractions {
    fn of(zones: impl Iterator<Item = CvgaZone>) -> Self {
        let mut z = ZoneFractions::default();
        let mut n = 0usize;
        for zone in zones {
            n += 1;
            match zone {
                CvgaZone::A => z.a += 1.0,
                CvgaZone::B => z.b += 1.0,
                CvgaZone::C => z.c += 1.0,
                CvgaZone::D => z.d += 1.0,
                CvgaZone::E => z.e += 1.0,
            }
        }
        let n = n.max(1) as f64;
        ZoneFractions {
            a: z.a / n,
            b: z.b / n,
            c: z.c / n,
            d: z.d / n,
            e: z.e / n,
        }
    }
}

/// Summary of a set of patient-days (all of them, or one group's).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolSummary {
    pub patient_days: usize,
    /// Distinct patients.
    pub patients: usize,
    /// Mean over patient-days of the BG metrics.
    pub bg: GlucoseMetrics,
    /// Mean over patient-days of the CGM metrics.
    pub cgm: GlucoseMetrics,
    /// Fractions of patient-days per CVGA zone (on BG).
    pub cvga_bg_zones: ZoneFractions,
    /// Spread over patients of the BG metrics.
    pub spread_bg: Spread,
    /// The patient with the lowest BG time in range.
    pub worst: WorstPatient,
}

impl PoolSummary {
    /// Pools `days`; `None` when empty.
    pub fn of(days: &[&ClinicalSummary]) -> Option<Self> {
        if days.is_empty() {
            return None;
        }
        // Per patient: their days' BG metrics averaged.
        let mut per_patient: BTreeMap<&str, Vec<GlucoseMetrics>> = BTreeMap::new();
        for d in days {
            per_patient.entry(&d.patient).or_default().push(d.bg);
        }
        let patients: Vec<(&str, GlucoseMetrics)> = per_patient
            .iter()
            .map(|(p, ms)| (*p, GlucoseMetrics::mean_of(ms)))
            .collect();
        let metrics: Vec<GlucoseMetrics> = patients.iter().map(|(_, m)| *m).collect();
        // Lowest TIR; ties go to the first name (BTreeMap order), so the choice is reproducible.
        let worst = patients
            .iter()
            .min_by(|a, b| a.1.time_in_range.total_cmp(&b.1.time_in_range))
            .map(|(p, m)| WorstPatient {
                patient: p.to_string(),
                bg: *m,
            })?;
        let bg: Vec<GlucoseMetrics> = days.iter().map(|d| d.bg).collect();
        let cgm: Vec<GlucoseMetrics> = days.iter().map(|d| d.cgm).collect();
        Some(PoolSummary {
            patient_days: days.len(),
            patients: patients.len(),
            bg: GlucoseMetrics::mean_of(&bg),
            cgm: GlucoseMetrics::mean_of(&cgm),
            cvga_bg_zones: ZoneFractions::of(days.iter().map(|d| d.cvga_bg.zone)),
            spread_bg: Spread {
                min: GlucoseMetrics::componentwise(&metrics, |v| v[0]),
                median: GlucoseMetrics::componentwise(&metrics, |v| {
                    let n = v.len();
                    if n % 2 == 1 {
                        v[n / 2]
                    } else {
                        0.5 * (v[n / 2 - 1] + v[n / 2])
                    }
                }),
                max: GlucoseMetrics::componentwise(&metrics, |v| v[v.len() - 1]),
            },
            worst,
        })
    }
}

/// The clinical report of an evaluation: every patient-day, the pooled summary and one per
/// group (`adult`, `adolescent`, `child`, or `all` for non-UVA/Padova users).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClinicalReport {
    pub patient_days: Vec<ClinicalSummary>,
    pub pooled: PoolSummary,
    pub groups: BTreeMap<String, PoolSummary>,
}

impl ClinicalReport {
    /// The report of `days`; `None` when there are none.
    pub fn new(patient_days: Vec<ClinicalSummary>) -> Option<Self> {
        let all: Vec<&ClinicalSummary> = patient_days.iter().collect();
        let pooled = PoolSummary::of(&all)?;
        let mut by_group: BTreeMap<&str, Vec<&ClinicalSummary>> = BTreeMap::new();
        for d in &patient_days {
            by_group.entry(&d.group).or_default().push(d);
        }
        let groups = by_group
            .into_iter()
            .filter_map(|(g, days)| PoolSummary::of(&days).map(|s| (g.to_string(), s)))
            .collect();
        Some(Self {
            patient_days,
            pooled,
            groups,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries_are_those_of_simglucose() {
        let m = glucose_metrics(&[54.0, 70.0, 180.0, 250.0, 53.9, 250.1]).unwrap();
        // 70 and 180 in range; 54 is below 70 but not below 54; 250 above 180 not above 250.
        assert_eq!(m.time_in_range, 2.0 / 6.0);
        assert_eq!(m.time_below_70, 2.0 / 6.0);
        assert_eq!(m.time_below_54, 1.0 / 6.0);
        assert_eq!(m.time_above_180, 2.0 / 6.0);
        assert_eq!(m.time_above_250, 1.0 / 6.0);
    }

    #[test]
    fn risk_is_zero_at_the_scale_origin_and_one_sided_otherwise() {
        // All readings low: no HBGI; all high: no LBGI.
        let (l, h, r) = risk_indices(&[60.0, 80.0]);
        assert!(l > 0.0 && h == 0.0 && r == l);
        let (l, h, _) = risk_indices(&[200.0, 300.0]);
        assert!(l == 0.0 && h > 0.0);
        // f(112.5) is about 0: the low/high split point.
        assert!(risk_scale(112.5).abs() < 0.01);
    }

    #[test]
    fn cvga_zones_follow_the_grid() {
        assert_eq!(CvgaZone::of(100.0, 150.0), CvgaZone::A);
        assert_eq!(CvgaZone::of(80.0, 150.0), CvgaZone::B);
        assert_eq!(CvgaZone::of(100.0, 250.0), CvgaZone::B);
        assert_eq!(CvgaZone::of(80.0, 250.0), CvgaZone::B);
        assert_eq!(CvgaZone::of(60.0, 150.0), CvgaZone::C);
        assert_eq!(CvgaZone::of(100.0, 350.0), CvgaZone::C);
        assert_eq!(CvgaZone::of(60.0, 250.0), CvgaZone::D);
        assert_eq!(CvgaZone::of(80.0, 350.0), CvgaZone::D);
        assert_eq!(CvgaZone::of(60.0, 350.0), CvgaZone::E);
        // simglucose's boundaries: min 90 is in the B column, max 180 in the B row, min 70 in C.
        assert_eq!(CvgaZone::of(90.0, 150.0), CvgaZone::B);
        assert_eq!(CvgaZone::of(100.0, 180.0), CvgaZone::B);
        assert_eq!(CvgaZone::of(70.0, 150.0), CvgaZone::C);
        // A flat day at 120 mg/dL (min above the grid) is A.
        let p = cvga_point(&[120.0; 10]).unwrap();
        assert_eq!(p.zone, CvgaZone::A);
    }

    #[test]
    fn percentiles_match_numpy_linear() {
        // numpy.percentile([1..=5], 2.5) = 1.1, 97.5 -> 4.9 (then clipped to [50, 400]).
        let s = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert!((percentile_sorted(&s, 2.5) - 1.1).abs() < 1e-12);
        assert!((percentile_sorted(&s, 97.5) - 4.9).abs() < 1e-12);
        let p = cvga_point(&[60.0, 100.0, 500.0]).unwrap();
        assert_eq!((p.min_mg_dl, p.max_mg_dl), (60.0, 500.0));
        assert!((p.x_mg_dl - 62.0).abs() < 1e-12);
        assert_eq!(p.y_mg_dl, 400.0);
        assert_eq!(p.zone, CvgaZone::E);
    }

    #[test]
    fn bad_input_is_refused() {
        assert_eq!(glucose_metrics(&[]), Err(ClinicalError::Empty));
        assert!(matches!(
            glucose_metrics(&[100.0, f64::NAN]),
            Err(ClinicalError::BadReading { index: 1, .. })
        ));
        assert!(ClinicalSummary::new("adult#001", &[100.0], &[100.0, 90.0]).is_err());
    }

    fn log(minutes: &[f64]) -> Vec<GlucoseSample> {
        minutes
            .iter()
            .map(|&m| GlucoseSample {
                minute: m,
                bg_mg_dl: 100.0 + m,
                cgm_mg_dl: 100.0,
                insulin_u: 0.0,
                cho_g: 0.0,
            })
            .collect()
    }

    #[test]
    fn episodes_split_at_midnight() {
        let one_day = log(&(0..=480).map(|k| 3.0 * f64::from(k)).collect::<Vec<_>>());
        assert_eq!(split_days(&one_day).len(), 1);
        let two_days = log(&(0..=960).map(|k| 3.0 * f64::from(k)).collect::<Vec<_>>());
        let d = split_days(&two_days);
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].len(), d[1].len()), (481, 481));
        assert_eq!(d[1][0].minute, 1440.0);
        // A day stopped early, and a grid that skips midnight.
        assert_eq!(split_days(&log(&[0.0, 3.0, 6.0])).len(), 1);
        let skips = log(&[0.0, 1000.0, 1450.0, 2000.0]);
        let d = split_days(&skips);
        assert_eq!((d[0].len(), d[1].len()), (2, 2));
        assert!(split_days(&[]).is_empty());
        let s = summarize_episode("child#002", Some(7), &two_days).unwrap();
        assert_eq!(
            (s[1].user, s[1].day, s[1].group.as_str()),
            (Some(7), 1, "child")
        );
    }

    #[test]
    fn groups_by_name() {
        assert_eq!(group_of("adult#001"), "adult");
        assert_eq!(group_of("adolescent#010"), "adolescent");
        assert_eq!(group_of("child#003"), "child");
        assert_eq!(group_of("Diabetic-v0 user 3"), "all");
        assert_eq!(group_of("adultish"), "all");
    }

    #[test]
    fn pooling_spread_and_worst() {
        let a = ClinicalSummary::new("adult#001", &[100.0; 4], &[100.0; 4]).unwrap();
        let b =
            ClinicalSummary::new("adult#002", &[100.0, 200.0, 200.0, 200.0], &[100.0; 4]).unwrap();
        let c =
            ClinicalSummary::new("child#001", &[60.0, 100.0, 100.0, 100.0], &[100.0; 4]).unwrap();
        // adult#002 on two days: its TIR is their mean.
        let b2 = ClinicalSummary::new("adult#002", &[100.0; 4], &[100.0; 4]).unwrap();
        let r = ClinicalReport::new(vec![a, b, c, b2]).unwrap();
        assert_eq!(r.pooled.patient_days, 4);
        assert_eq!(r.pooled.patients, 3);
        assert!((r.pooled.bg.time_in_range - (1.0 + 0.25 + 0.75 + 1.0) / 4.0).abs() < 1e-12);
        assert_eq!(r.pooled.cgm.time_in_range, 1.0);
        // Per patient TIR: 1.0, 0.625, 0.75 -> min 0.625, median 0.75, max 1.
        assert_eq!(r.pooled.spread_bg.min.time_in_range, 0.625);
        assert_eq!(r.pooled.spread_bg.median.time_in_range, 0.75);
        assert_eq!(r.pooled.spread_bg.max.time_in_range, 1.0);
        assert_eq!(r.pooled.worst.patient, "adult#002");
        assert_eq!(r.groups.len(), 2);
        assert_eq!(r.groups["adult"].patient_days, 3);
        assert_eq!(r.groups["child"].worst.patient, "child#001");
        let z = r.pooled.cvga_bg_zones;
        assert!((z.a + z.b + z.c + z.d + z.e - 1.0).abs() < 1e-12);
        assert!(ClinicalReport::new(vec![]).is_none());
    }
}
