//! Glucose controllers against simglucose 0.2.11 (`testdata/simglucose_bb_reference.json`: its
//! basal-bolus controller in closed loop for a day on three patients), and the PID and
//! proportional controllers against hand computation.

use fedrl_sim::controllers::{
    BasalBolus, Controller, Dose, Pid, PidGains, Proportional, SimglucosePump,
};
use fedrl_sim::uva_padova;

/// The reference file as written by Python's json module: the last insulin and CHO entries of
/// each run are `NaN` (no action after the last reading), which JSON proper lacks; read them as
/// null.
fn reference() -> serde_json::Value {
    let text = include_str!("../../testdata/simglucose_bb_reference.json").replace("NaN", "null");
    serde_json::from_str(&text).expect("reference file parses")
}

fn series(run: &serde_json::Value, key: &str) -> Vec<Option<f64>> {
    run[key]
        .as_array()
        .unwrap_or_else(|| panic!("run lacks {key}"))
        .iter()
        .map(serde_json::Value::as_f64)
        .collect()
}

#[test]
fn basal_bolus_emits_simglucoses_recorded_doses() {
    let data = reference();
    let runs = data["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 3);
    let pump = SimglucosePump::insulet();
    let sample_time = 3.0;
    for run in runs {
        let name = run["patient"].as_str().expect("patient name");
        let params = uva_padova::patient(name).expect("patient in table");
        let mut ctl = BasalBolus::for_patient(params).expect("Quest row");
        let cgm = series(run, "cgm");
        let insulin = series(run, "insulin_u_per_min");
        let cho = series(run, "cho_g_per_min");
        assert_eq!(cgm.len(), 481);
        let (mut steps, mut boluses, mut worst) = (0, 0, 0.0f64);
        for i in 0..cgm.len() {
            // The last reading has no action after it.
            let Some(want) = insulin[i] else {
                assert_eq!(i, cgm.len() - 1, "{name}: missing insulin at step {i}");
                continue;
            };
            // insulin[i] is simglucose's action on cgm[i]; the meal it is told about is the
            // carbohydrate eaten during the step that ended at that reading, cho[i - 1].
            let meal = if i == 0 {
                0.0
            } else {
                cho[i - 1].expect("cho")
            };
            let dose = ctl.act(cgm[i].expect("cgm"), meal, sample_time);
            if dose.bolus_u > 0.0 {
                boluses += 1;
            }
            let got = pump.delivered_u_per_min(dose, sample_time);
            let err = (got - want).abs();
            worst = worst.max(err);
            assert!(
                err <= 1e-6,
                "{name} step {i}: dose {got} U/min, simglucose {want} U/min"
            );
            steps += 1;
        }
        eprintln!("{name}: {steps} steps, {boluses} boluses, max |error| {worst:.2e} U/min");
        assert_eq!(steps, 480);
        assert_eq!(boluses, 4, "{name}: one bolus per meal");
    }
}

#[test]
fn basal_bolus_corrects_only_at_meals_and_only_above_150() {
    let params = uva_padova::patient("adult#001").expect("patient");
    let mut ctl = BasalBolus::for_patient(params).expect("Quest row");
    // adult#001: CR 10 g/U, CF 8.77310657487 mg/dL per U.
    let no_meal = ctl.act(300.0, 0.0, 3.0);
    assert_eq!(no_meal.bolus_u, 0.0);
    assert!((no_meal.basal_u_per_min - 1.2386244136 * 102.32 / 6000.0).abs() < 1e-15);
    let at_150 = ctl.act(150.0, 10.0, 3.0);
    assert!((at_150.bolus_u - 3.0).abs() < 1e-12, "{at_150:?}");
    let high = ctl.act(200.0, 10.0, 3.0);
    assert!((high.bolus_u - (3.0 + 60.0 / 8.77310657487)).abs() < 1e-12);
}

#[test]
fn pid_follows_simglucoses_update_order() {
    let g = PidGains {
        p: 1e-3,
        i: 1e-5,
        d: 2e-3,
    };
    let mut pid = Pid::new(g, 140.0);
    // Step 1: integral 0, last reading 0 (simglucose's initial state).
    let d1 = pid.act(160.0, 0.0, 3.0);
    let want1 = 1e-3 * 20.0 + 0.0 + 2e-3 * 160.0 / 3.0;
    assert!((d1.basal_u_per_min - want1).abs() < 1e-15, "{d1:?}");
    assert_eq!(d1.bolus_u, 0.0);
    assert!((pid.integral() - 60.0).abs() < 1e-12);
    // Step 2: integral 20 * 3 = 60 from step 1, derivative (130 - 160) / 3.
    let d2 = pid.act(130.0, 5.0, 3.0);
    let want2 = 1e-3 * -10.0 + 1e-5 * 60.0 + 2e-3 * -30.0 / 3.0;
    assert!((d2.basal_u_per_min - want2).abs() < 1e-15, "{d2:?}");
    assert!((pid.integral() - 30.0).abs() < 1e-12);
    // Step 3: integral 60 - 30 = 30.
    let d3 = pid.act(140.0, 0.0, 3.0);
    let want3 = 0.0 + 1e-5 * 30.0 + 2e-3 * 10.0 / 3.0;
    assert!((d3.basal_u_per_min - want3).abs() < 1e-15, "{d3:?}");
    // Reset forgets the integral and the last reading.
    pid.reset();
    let again = pid.act(160.0, 0.0, 3.0);
    assert!((again.basal_u_per_min - want1).abs() < 1e-15);
}

#[test]
fn proportional_is_linear_above_zero_and_clipped_at_zero() {
    let mut c = Proportional::default();
    let at = |c: &mut Proportional, g: f64| c.act(g, 0.0, 3.0);
    assert!((at(&mut c, 140.0).basal_u_per_min - 0.02).abs() < 1e-15);
    assert!((at(&mut c, 240.0).basal_u_per_min - 0.04).abs() < 1e-15);
    assert!((at(&mut c, 90.0).basal_u_per_min - 0.01).abs() < 1e-15);
    assert_eq!(at(&mut c, 40.0).basal_u_per_min, 0.0);
    assert_eq!(at(&mut c, 240.0).bolus_u, 0.0);
    // A meal changes nothing: the proportional controller is not told about meals.
    assert_eq!(c.act(200.0, 20.0, 3.0), at(&mut c, 200.0));
}

#[test]
fn dose_rate_spreads_the_bolus_over_the_sample() {
    let d = Dose {
        basal_u_per_min: 0.02,
        bolus_u: 3.0,
    };
    assert!((d.rate_u_per_min(3.0) - 1.02).abs() < 1e-15);
}
