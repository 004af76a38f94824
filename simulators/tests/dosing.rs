//! Dosing-v0 / Dosing-v1 against the dosing-rl-gym reference traces, plus edge cases.

use fedrl_sim::dosing::{self, DosingEnv, DosingMeals, DosingOptions, MealGenerator};
use fedrl_sim::{Action, Env};

fn traces() -> serde_json::Value {
    let text = include_str!("../../testdata/dosing_traces.json");
    serde_json::from_str(text).expect("trace file parses")
}

#[test]
fn replays_dosing_traces() {
    let results = dosing::replay_traces(&traces()).expect("replay runs");
    assert_eq!(results.len(), 2);
    for r in &results {
        eprintln!(
            "{}: {} episodes, {} steps, max rel obs err {:.3e}, max reward err {:.3e}, flags {}",
            r.name, r.episodes, r.steps, r.max_error, r.max_reward_error, r.mismatched_flags
        );
        assert!(r.pass, "{r:?}");
    }
}

#[test]
fn reward_formula_spots() {
    assert_eq!(dosing::reward(80.0), 1.0);
    let t = (10.0f64 / 0.7 * 0.1).tanh();
    assert!((dosing::reward(90.0) - (1.0 - t * t)).abs() < 1e-15);
    assert_eq!(dosing::reward(70.0), dosing::reward(90.0));
    assert!(dosing::reward(65.0) > 0.0 && dosing::reward(105.0) > 0.0);
    assert_eq!(dosing::reward(64.999), -1.0);
    assert_eq!(dosing::reward(105.001), -1.0);
    assert_eq!(dosing::reward(f64::NAN), -1.0);
}

#[test]
fn episode_has_143_steps_then_truncates_and_refuses_more() {
    for mut env in [DosingEnv::v0(), DosingEnv::v1()] {
        let mut obs = [0.0f32; dosing::OBS_DIM];
        env.reset(4, &mut obs);
        assert_eq!(env.grid_points(), 145);
        for k in 0..143 {
            let s = env
                .step(Action::Continuous(&[3.0]), &mut obs)
                .expect("steps");
            assert_eq!(s.truncated, k == 142, "{} step {k}", env.id());
            assert!(!s.terminated);
            assert!(obs.iter().all(|v| v.is_finite()));
        }
        assert!(env.step(Action::Continuous(&[3.0]), &mut obs).is_err());
        env.reset(5, &mut obs);
        assert!(env.step(Action::Continuous(&[3.0]), &mut obs).is_ok());
    }
}

#[test]
fn invalid_actions_are_rejected() {
    let mut env = DosingEnv::v0();
    let mut obs = [0.0f32; dosing::OBS_DIM];
    env.reset(0, &mut obs);
    assert!(env.step(Action::Discrete(1), &mut obs).is_err());
    assert!(env.step(Action::Continuous(&[1.0, 2.0]), &mut obs).is_err());
    assert!(
        env.step(Action::Continuous(&[f32::INFINITY]), &mut obs)
            .is_err()
    );
    assert!(env.step(Action::Continuous(&[f32::NAN]), &mut obs).is_err());
    assert!(env.step(Action::Continuous(&[2.5]), &mut obs).is_ok());
}

#[test]
fn v0_meals_are_fixed_and_v1_meals_vary_per_seed() {
    let v0 = DosingEnv::v0();
    let a = v0.draw_episode(1);
    let b = v0.draw_episode(2);
    assert_eq!(a.meal_disturbance, b.meal_disturbance);
    assert_eq!(a.first_dose, 3.0);
    assert_eq!(a.meal_disturbance[43], 1259.0);
    assert_ne!(a.initial_state, b.initial_state);
    assert!((65.0..105.0).contains(&a.initial_state[0]));

    let v1 = DosingEnv::v1();
    let a = v1.draw_episode(1);
    let b = v1.draw_episode(2);
    assert_ne!(a.meal_disturbance, b.meal_disturbance);
    assert_eq!(a, v1.draw_episode(1));
    for ep in [&a, &b] {
        let base = ep.meal_disturbance[0];
        assert!((800.0..1200.0).contains(&base));
        assert!(ep.meal_disturbance.iter().all(|&v| v >= base));
        assert!(ep.meal_disturbance.iter().cloned().fold(0.0, f64::max) > base + 200.0);
        assert!([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0].contains(&ep.first_dose));
    }
}

#[test]
fn per_user_meal_patterns() {
    // A user who always eats three big meals at fixed times on a fixed base.
    let g = MealGenerator {
        prob: [1.0, 0.0, 1.0, 0.0, 1.0, 0.0],
        time_sigma_steps: [0.0; 6],
        base_low: 900.0,
        base_high: 900.0,
        ..Default::default()
    };
    let env = DosingEnv::new(DosingOptions {
        meals: DosingMeals::Random(g),
        ..DosingOptions::v1()
    })
    .expect("valid options");
    assert_eq!(env.id(), "Dosing-v1");
    let ep = env.draw_episode(9);
    let d = &ep.meal_disturbance;
    // Breakfast at 7 h -> grid index 7*6+1 = 43: the smoothed peak sits there.
    let peak = (38..48)
        .max_by(|&i, &j| d[i].total_cmp(&d[j]))
        .expect("non-empty");
    assert_eq!(peak, 43);
    assert!(d.iter().all(|&v| v >= 900.0));
    assert_eq!(d[0], 900.0);

    let fixed = DosingEnv::new(DosingOptions {
        meals: DosingMeals::Fixed {
            base: 950.0,
            start: 10,
            profile: vec![1500.0, 1200.0],
        },
        ..DosingOptions::v0()
    })
    .expect("valid options");
    assert_eq!(fixed.id(), "Dosing-v0");
    let ep = fixed.draw_episode(0);
    assert_eq!(&ep.meal_disturbance[9..13], &[950.0, 1500.0, 1200.0, 950.0]);
    assert!(
        DosingEnv::new(DosingOptions {
            minute_interval: 0,
            ..DosingOptions::v0()
        })
        .is_err()
    );
}

#[test]
fn savgol_keeps_cubics_and_has_the_scipy_kernel() {
    let cubic: Vec<f64> = (0..30)
        .map(|i| {
            let x = i as f64;
            1.0 - 2.0 * x + 0.5 * x * x - 0.01 * x * x * x
        })
        .collect();
    for (a, b) in dosing::savgol_11_3(&cubic).iter().zip(&cubic) {
        assert!((a - b).abs() < 1e-9, "{a} vs {b}");
    }
    let mut spike = vec![0.0; 41];
    spike[20] = 429.0;
    let s = dosing::savgol_11_3(&spike);
    for (off, c) in [
        (0, 89.0),
        (1, 84.0),
        (2, 69.0),
        (3, 44.0),
        (4, 9.0),
        (5, -36.0),
    ] {
        assert!((s[20 + off] - c).abs() < 1e-9 && (s[20 - off] - c).abs() < 1e-9);
    }
    assert!(s[26].abs() < 1e-9);
}

#[test]
fn state_round_trip_replays_exactly() {
    let mut env = DosingEnv::v1();
    let mut obs = [0.0f32; dosing::OBS_DIM];
    env.reset(21, &mut obs);
    for _ in 0..40 {
        env.step(Action::Continuous(&[4.0]), &mut obs)
            .expect("steps");
    }
    let saved = env.state();
    let mut first = Vec::new();
    for k in 0..10 {
        let a = [k as f32];
        let s = env.step(Action::Continuous(&a), &mut obs).expect("steps");
        first.push((obs, s));
    }
    let mut restored = DosingEnv::v1();
    restored.set_state(&saved, &mut obs).expect("state fits");
    for (k, (o, s)) in first.into_iter().enumerate() {
        let a = [k as f32];
        let s2 = restored
            .step(Action::Continuous(&a), &mut obs)
            .expect("steps");
        assert_eq!(obs, o);
        assert_eq!(s2, s);
    }
    assert!(restored.set_state(&saved[..10], &mut obs).is_err());
}
