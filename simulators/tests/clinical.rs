//! The clinical metric functions against simglucose 0.2.11's own numbers: its basal-bolus
//! controller in closed loop for a day on adult#001, adolescent#003 and child#005
//! (`testdata/simglucose_bb_reference.json`, per-step BG and simglucose's LBGI, HBGI, risk index
//! and time in / below / above range on BG).

use fedrl_sim::clinical::{ClinicalReport, ClinicalSummary, glucose_metrics, risk_indices};

struct Run {
    patient: String,
    bg: Vec<f64>,
    cgm: Vec<f64>,
    expected: serde_json::Value,
}

fn runs() -> Vec<Run> {
    let text = include_str!("../../testdata/simglucose_bb_reference.json");
    // Python's json wrote the last step's insulin and CHO (no action after the last reading) as
    // the bare token NaN, which is not JSON: read it as null. BG and CGM have no NaN.
    let text = text.replace("NaN", "null");
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference JSON parses");
    let series = |r: &serde_json::Value, k: &str| -> Vec<f64> {
        r[k].as_array()
            .unwrap_or_else(|| panic!("{k} is an array"))
            .iter()
            .map(|x| x.as_f64().expect("a number"))
            .collect()
    };
    v["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .map(|r| Run {
            patient: r["patient"].as_str().expect("patient").to_string(),
            bg: series(r, "bg"),
            cgm: series(r, "cgm"),
            expected: r.clone(),
        })
        .collect()
}

fn close(got: f64, want: &serde_json::Value, what: &str, patient: &str) {
    let want = want.as_f64().unwrap_or_else(|| panic!("{what} recorded"));
    assert!(
        (got - want).abs() <= 1e-9,
        "{patient} {what}: fedrl {got}, simglucose {want}"
    );
}

#[test]
fn metrics_on_recorded_bg_equal_simglucose() {
    let runs = runs();
    assert_eq!(runs.len(), 3);
    for r in &runs {
        assert_eq!(r.bg.len(), 481, "{}: one day at 3 minutes", r.patient);
        let m = glucose_metrics(&r.bg).unwrap();
        let e = &r.expected;
        let p = &r.patient;
        close(m.lbgi, &e["bg_lbgi"], "LBGI", p);
        close(m.hbgi, &e["bg_hbgi"], "HBGI", p);
        close(m.risk_index, &e["bg_risk_index"], "risk index", p);
        close(m.time_in_range, &e["bg_time_in_range_70_180"], "TIR", p);
        close(m.time_below_70, &e["bg_time_below_70"], "below 70", p);
        close(m.time_above_180, &e["bg_time_above_180"], "above 180", p);
        let (l, h, ri) = risk_indices(&r.bg);
        assert_eq!((l, h, ri), (m.lbgi, m.hbgi, m.risk_index));
    }
}

#[test]
fn the_documented_time_in_range_levels() {
    // The README's level a private policy is measured against: 0.956 / 0.859 / 0.854.
    let tir: Vec<f64> = runs()
        .iter()
        .map(|r| glucose_metrics(&r.bg).unwrap().time_in_range)
        .collect();
    for (got, want) in tir.iter().zip([0.956, 0.859, 0.854]) {
        assert!((got - want).abs() < 5e-4, "{got} vs {want}");
    }
}

#[test]
fn report_of_the_three_runs() {
    let days: Vec<ClinicalSummary> = runs()
        .iter()
        .map(|r| ClinicalSummary::new(&r.patient, &r.bg, &r.cgm).unwrap())
        .collect();
    let rep = ClinicalReport::new(days).unwrap();
    assert_eq!(rep.pooled.patients, 3);
    assert_eq!(
        rep.groups.keys().collect::<Vec<_>>(),
        ["adolescent", "adult", "child"]
    );
    // child#005 has the lowest TIR (0.854) and spends 14.6% below 70.
    assert_eq!(rep.pooled.worst.patient, "child#005");
    assert!((rep.pooled.spread_bg.max.time_in_range - 0.9563409563409564).abs() < 1e-12);
    for d in &rep.patient_days {
        for m in [d.bg, d.cgm] {
            let sum = m.time_in_range + m.time_below_70 + m.time_above_180;
            assert!(
                (sum - 1.0).abs() < 1e-12,
                "{}: fractions sum to {sum}",
                d.patient
            );
            assert!(m.time_below_54 <= m.time_below_70 && m.time_above_250 <= m.time_above_180);
        }
        // The BG extremes the file shows: a day between 54 and 206 mg/dL at most.
        assert!(d.cvga_bg.min_mg_dl >= 53.9 && d.cvga_bg.max_mg_dl <= 205.1);
        assert!(d.cvga_bg.x_mg_dl >= d.cvga_bg.min_mg_dl);
        assert!(d.cvga_bg.y_mg_dl <= d.cvga_bg.max_mg_dl);
    }
    let json = serde_json::to_value(&rep).unwrap();
    assert_eq!(json["pooled"]["worst"]["patient"], "child#005");
    assert!(json["groups"]["adult"]["bg"]["time_in_range"].is_f64());
}

#[test]
fn dosing_logs_one_sample_per_grid_point() {
    use fedrl_sim::dosing::{DosingEnv, OBS_DIM};
    use fedrl_sim::{Action, Env};
    let mut env = DosingEnv::v1();
    let mut obs = [0.0f32; OBS_DIM];
    env.reset(7, &mut obs);
    let ep = env.draw_episode(7);
    // Reset ran the first interval: the initial state and the grid point after it.
    let log = env.glucose_log().expect("Dosing logs glucose");
    assert_eq!(log.len(), 2);
    assert_eq!(log[0].minute, 0.0);
    assert_eq!(log[0].bg_mg_dl, ep.initial_state[0]);
    assert!((log[1].insulin_u - ep.first_dose * 10.0 / 1000.0).abs() < 1e-12);
    for _ in 0..143 {
        env.step(Action::Continuous(&[3.0]), &mut obs).unwrap();
        let last = *env.glucose_log().unwrap().last().unwrap();
        assert_eq!(last.bg_mg_dl as f32, obs[0], "BG is the observed G");
        assert_eq!(last.cgm_mg_dl, last.bg_mg_dl, "no sensor: CGM = G");
        assert!((last.insulin_u - 0.03).abs() < 1e-12, "3 mU/min for 10 min");
        assert_eq!(last.cho_g, 0.0);
    }
    let log = env.glucose_log().unwrap();
    assert_eq!(log.len(), env.grid_points());
    for (k, s) in log.iter().enumerate() {
        assert!((s.minute - 10.0 * k as f64).abs() < 1e-9);
    }
    let bg: Vec<f64> = log.iter().map(|s| s.bg_mg_dl).collect();
    let cgm: Vec<f64> = log.iter().map(|s| s.cgm_mg_dl).collect();
    let day = ClinicalSummary::new("Dosing-v1 user 0", &bg, &cgm).unwrap();
    assert_eq!(day.group, "all");
    assert_eq!(day.bg, day.cgm);
    // A new episode starts a new log.
    env.reset(8, &mut obs);
    assert_eq!(env.glucose_log().unwrap().len(), 2);
}
