//! UVA/Padova patient model against simglucose 0.2.11 traces, and the dosing environment.

use fedrl_sim::uva_padova::{self, UvaPadovaEnv, UvaPadovaOptions};
use fedrl_sim::{Action, Env};

fn traces() -> serde_json::Value {
    let text = include_str!("../../testdata/simglucose_traces.json");
    serde_json::from_str(text).expect("trace file parses")
}

#[test]
fn replays_simglucose_traces_within_half_mg_dl() {
    let results = uva_padova::replay_traces(&traces()).expect("replay runs");
    assert_eq!(results.len(), 4);
    for r in &results {
        eprintln!(
            "{}: max |dBG| = {:.3e} mg/dL over {} steps",
            r.name, r.max_error, r.steps
        );
        assert!(r.pass, "{r:?}");
        assert_eq!(r.steps, 600);
    }
}

#[test]
fn all_thirty_patients_load_and_hold_steady_at_basal_without_meals() {
    let all = uva_padova::patients().expect("table parses");
    assert_eq!(all.len(), 30);
    for p in all {
        let opts = UvaPadovaOptions {
            meals: uva_padova::MealScenario {
                prob: [0.0; 6],
                ..Default::default()
            },
            episode_minutes: 120,
            ..Default::default()
        };
        let mut env = UvaPadovaEnv::new(&p.name, opts).expect("patient exists");
        let mut obs = [0.0f32];
        env.reset(7, &mut obs);
        let bg0 = env.patient().bg();
        let basal = [p.basal_u_per_min() as f32];
        for _ in 0..40 {
            env.step(Action::Continuous(&basal), &mut obs)
                .expect("steps");
        }
        let drift = (env.patient().bg() - bg0).abs();
        assert!(drift < 1.0, "{}: drift {drift} mg/dL at basal", p.name);
    }
}

#[test]
fn patients_by_name_or_index_and_unknown_names_fail() {
    assert_eq!(uva_padova::patient("10").expect("index").name, "adult#001");
    assert_eq!(
        uva_padova::patient("child#010").expect("name").name,
        "child#010"
    );
    assert!(uva_padova::patient("adult#011").is_err());
    assert!(uva_padova::patient("30").is_err());
    assert!(UvaPadovaEnv::new("nobody", UvaPadovaOptions::default()).is_err());
}

#[test]
fn invalid_actions_are_rejected() {
    let mut env = UvaPadovaEnv::new("adult#001", UvaPadovaOptions::default()).expect("env");
    let mut obs = [0.0f32];
    env.reset(1, &mut obs);
    assert!(env.step(Action::Discrete(0), &mut obs).is_err());
    assert!(env.step(Action::Continuous(&[]), &mut obs).is_err());
    assert!(env.step(Action::Continuous(&[0.1, 0.2]), &mut obs).is_err());
    assert!(env.step(Action::Continuous(&[f32::NAN]), &mut obs).is_err());
    // Out-of-range rates are clipped to the pump's range, not rejected.
    assert!(env.step(Action::Continuous(&[-1.0]), &mut obs).is_ok());
}

#[test]
fn episode_truncates_after_its_length_and_terminates_on_extreme_glucose() {
    let opts = UvaPadovaOptions {
        episode_minutes: 60,
        ..Default::default()
    };
    let mut env = UvaPadovaEnv::new("adult#001", opts).expect("env");
    let mut obs = [0.0f32];
    env.reset(3, &mut obs);
    let basal = [env.patient().params().basal_u_per_min() as f32];
    for k in 0..20 {
        let s = env
            .step(Action::Continuous(&basal), &mut obs)
            .expect("steps");
        assert_eq!(s.truncated, k == 19, "step {k}");
        assert!(!s.terminated);
    }
    // Massive insulin for hours drives glucose below the termination threshold.
    let opts = UvaPadovaOptions {
        episode_minutes: 24 * 60,
        terminate_below_mg_dl: 70.0,
        ..Default::default()
    };
    let mut env = UvaPadovaEnv::new("child#003", opts).expect("env");
    env.reset(3, &mut obs);
    let mut terminated = false;
    for _ in 0..480 {
        let s = env
            .step(Action::Continuous(&[0.5]), &mut obs)
            .expect("steps");
        if s.terminated {
            terminated = true;
            break;
        }
    }
    assert!(terminated);
}

#[test]
fn risk_index_spots() {
    // Kovatchev's symmetrised scale is zero near 112.5 mg/dL.
    assert!(uva_padova::risk_index(112.5).2 < 0.01);
    let (lbgi, hbgi, r) = uva_padova::risk_index(50.0);
    assert!(hbgi == 0.0 && (lbgi - r).abs() < 1e-12);
    assert!((r - 22.5).abs() < 0.2, "{r}");
    let (lbgi, hbgi, _) = uva_padova::risk_index(300.0);
    assert!(lbgi == 0.0 && hbgi > 10.0);
}

#[test]
fn state_round_trip_replays_exactly_and_seeds_are_deterministic() {
    let opts = UvaPadovaOptions {
        sensor: uva_padova::CgmSensor {
            noise: false,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut env = UvaPadovaEnv::new("adolescent#003", opts).expect("env");
    let mut obs = [0.0f32];
    env.reset(11, &mut obs);
    let a = [0.02f32];
    for _ in 0..150 {
        env.step(Action::Continuous(&a), &mut obs).expect("steps");
    }
    let saved = env.state();
    let mut first = Vec::new();
    for _ in 0..20 {
        env.step(Action::Continuous(&a), &mut obs).expect("steps");
        first.push(obs[0]);
    }
    env.set_state(&saved, &mut obs).expect("state fits");
    for v in first {
        env.step(Action::Continuous(&a), &mut obs).expect("steps");
        assert_eq!(obs[0], v);
    }
    assert!(env.set_state(&saved[1..], &mut obs).is_err());

    let noisy = UvaPadovaOptions {
        sensor: uva_padova::CgmSensor {
            noise: true,
            ..Default::default()
        },
        ..Default::default()
    };
    let run = |seed| {
        let mut env = UvaPadovaEnv::new("adult#002", noisy.clone()).expect("env");
        let mut obs = [0.0f32];
        env.reset(seed, &mut obs);
        let mut v = vec![obs[0]];
        for _ in 0..50 {
            env.step(Action::Continuous(&a), &mut obs).expect("steps");
            v.push(obs[0]);
        }
        v
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5), run(6));
}
