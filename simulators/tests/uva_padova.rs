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

/// A day's log of a 3-minute controller and of a 30-minute one holding the same rate are the
/// same samples, and the 30-minute step's reward is the sum of its ten 3-minute rewards.
#[test]
fn a_long_decision_is_the_sum_of_its_cgm_samples() {
    let base = UvaPadovaOptions {
        reward: uva_padova::UvaReward::DayRisk,
        sensor: uva_padova::CgmSensor {
            noise: true,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut short = UvaPadovaEnv::new("adult#003", base.clone()).unwrap();
    let mut long = UvaPadovaEnv::new(
        "adult#003",
        UvaPadovaOptions {
            decision_min: 30,
            ..base
        },
    )
    .unwrap();
    let mut o = [0.0f32];
    short.reset(11, &mut o);
    long.reset(11, &mut o);
    let (mut r_short, mut r_long) = (0.0, 0.0);
    let mut long_steps = 0;
    loop {
        let rate = 0.01 + 0.005 * (long_steps % 3) as f32;
        let s = long.step(Action::Continuous(&[rate]), &mut o).unwrap();
        r_long += s.reward;
        long_steps += 1;
        let mut t = None;
        for _ in 0..10 {
            let s = short.step(Action::Continuous(&[rate]), &mut o).unwrap();
            r_short += s.reward;
            t = Some(s);
        }
        let t = t.unwrap();
        assert_eq!((s.terminated, s.truncated), (t.terminated, t.truncated));
        if s.terminated || s.truncated {
            break;
        }
    }
    assert_eq!(long_steps, 48);
    let (a, b) = (short.glucose_log().unwrap(), long.glucose_log().unwrap());
    assert_eq!(
        a.len(),
        481,
        "one day at 3 minutes, the reset reading included"
    );
    assert_eq!(a, b);
    assert!((r_short - r_long).abs() <= 1e-9 * r_short.abs());
    // The log accounts for every unit delivered and every gram announced.
    let insulin: f64 = a.iter().map(|s| s.insulin_u).sum();
    let carbs: f64 = a.iter().map(|s| s.cho_g).sum();
    let meals = long.meals_today();
    let announced: f64 = meals.meals[..meals.count].iter().map(|m| m.1).sum();
    assert!((carbs - announced).abs() < 1e-9, "{carbs} vs {announced}");
    assert!(insulin > 1440.0 * 0.01 && insulin < 1440.0 * 0.02);
    assert!(
        UvaPadovaEnv::new(
            "adult#003",
            UvaPadovaOptions {
                decision_min: 10,
                ..Default::default()
            }
        )
        .is_err(),
        "10 minutes is not a multiple of the 3-minute CGM sample"
    );
}

/// The pump observation: an hour of CGM, insulin on board in hours of programmed basal (2.008 h
/// at steady state under linear decay over 4 h), time of day, announced carbohydrate; the pump
/// action doses multiples of the programmed basal and of carbohydrate / CR.
#[test]
fn pump_observation_and_action() {
    let name = "adolescent#003";
    let basal = uva_padova::patient(name).unwrap().basal_u_per_min();
    let cr = uva_padova::therapy(name).unwrap().cr_g_per_u;
    assert_eq!(cr, 23.0);
    let mut opts = UvaPadovaOptions::pump(true);
    opts.sensor.noise = false;
    let mut env = UvaPadovaEnv::new(name, opts).unwrap();
    assert_eq!(env.observation_space().dim(), 20 + 1 + 2 + 1);
    assert_eq!(env.action_space().dim(), 2);
    let mut o = vec![0.0f32; 24];
    env.reset(5, &mut o);
    assert!(o[..20].iter().all(|&c| c == o[0]));
    let steady_iob = (IOB + 1) as f64 / 2.0 / 60.0;
    assert!((f64::from(o[20]) - steady_iob).abs() < 1e-5, "{}", o[20]);
    assert_eq!((o[21], o[22]), (0.0, 1.0), "midnight");
    let day = *env.meals_today();
    let mut total_bolus = 0.0;
    let mut announced_total = 0.0;
    for step in 0..48u32 {
        let start = step * 30;
        let due: f64 = day.meals[..day.count]
            .iter()
            .filter(|m| (start..start + 30).contains(&m.0))
            .map(|m| m.1)
            .sum();
        assert_eq!(
            f64::from(o[23]),
            due,
            "announced carbohydrate at minute {start}"
        );
        announced_total += due;
        total_bolus += due / cr;
        let s = env.step(Action::Continuous(&[1.0, 1.0]), &mut o).unwrap();
        assert!(!s.terminated);
        let phase = std::f64::consts::TAU * f64::from(start + 30) / 1440.0;
        assert!((f64::from(o[21]) - phase.sin()).abs() < 1e-5);
    }
    let log = env.glucose_log().unwrap();
    let insulin: f64 = log.iter().map(|s| s.insulin_u).sum();
    assert!(announced_total > 0.0);
    assert!(
        (insulin - (basal * 1440.0 + total_bolus)).abs() < 1e-9,
        "{insulin} vs basal {} + bolus {total_bolus}",
        basal * 1440.0
    );
    // Wrong action length and non-finite values are refused.
    let mut env = UvaPadovaEnv::new(name, UvaPadovaOptions::pump(true)).unwrap();
    env.reset(1, &mut o);
    assert!(env.step(Action::Continuous(&[1.0]), &mut o).is_err());
    assert!(
        env.step(Action::Continuous(&[1.0, f32::NAN]), &mut o)
            .is_err()
    );
}

const IOB: usize = uva_padova::IOB_DURATION_MIN;

/// Without meal announcements the pump shows its programmed therapy after the time of day:
/// CF x basal per hour, CR x basal per hour (from the Quest table and the patient's steady-state
/// basal) and the age, the same at every step of the day.
#[test]
fn pump_without_meals_sees_the_programmed_therapy() {
    let opts = UvaPadovaOptions::pump(false);
    assert!(opts.observation.therapy && !opts.observation.meal_announcement);
    assert!(!UvaPadovaOptions::pump(true).observation.therapy);
    for name in ["adolescent#008", "adult#004", "child#005"] {
        let basal_h = uva_padova::patient(name).unwrap().basal_u_per_min() * 60.0;
        let t = uva_padova::therapy(name).unwrap();
        let want = [
            t.cf_mg_dl_per_u * basal_h,
            t.cr_g_per_u * basal_h,
            t.age_years,
        ];
        let mut env = UvaPadovaEnv::new(name, opts.clone()).unwrap();
        assert_eq!(env.observation_space().dim(), 20 + 1 + 2 + 3);
        assert_eq!(env.action_space().dim(), 1);
        let mut o = vec![0.0f32; 26];
        env.reset(7, &mut o);
        for step in 0..48 {
            for (k, w) in want.iter().enumerate() {
                let got = f64::from(o[23 + k]);
                assert!(
                    (got - w).abs() <= 1e-5 * w,
                    "{name} step {step} [{k}]: {got} vs {w}"
                );
            }
            if env
                .step(Action::Continuous(&[1.0]), &mut o)
                .unwrap()
                .terminated
            {
                break;
            }
        }
    }
    // Fivefold spread of how far one basal hour lowers glucose: the reason the policy needs it.
    let cf_h = |n: &str| {
        uva_padova::therapy(n).unwrap().cf_mg_dl_per_u
            * uva_padova::patient(n).unwrap().basal_u_per_min()
            * 60.0
    };
    assert!(cf_h("adult#004") > 5.0 * cf_h("adolescent#008"));
}

/// With `sensitivity_scaling = k` the multiple above the programmed basal is scaled by (14 mg/dL
/// over the patient's CF x basal per hour)^k: at k = 1 the same action delivers, on a sensitive
/// and a resistant patient, the insulin above basal that lowers glucose by the same mg/dL per
/// hour beyond the basal; k = 0.5 scales by the square root; multiples up to 1 (suspend and
/// basal) are delivered as asked; exponents outside [0, 1] are refused.
#[test]
fn sensitivity_scaling_lowers_glucose_alike_on_every_patient() {
    let insulin = |name: &str, k: f64, multiple: f32| {
        let mut opts = UvaPadovaOptions::pump(false);
        opts.sensitivity_scaling = k;
        let mut env = UvaPadovaEnv::new(name, opts).unwrap();
        let mut o = vec![0.0f32; env.observation_space().dim()];
        env.reset(3, &mut o);
        // Two hours: long enough to measure, short of any low that would end the day.
        for _ in 0..4 {
            env.step(Action::Continuous(&[multiple]), &mut o).unwrap();
        }
        let log = env.glucose_log().unwrap();
        log.iter().map(|s| s.insulin_u).sum::<f64>()
    };
    let minutes = 120.0;
    let mut extra_effect = Vec::new();
    for name in ["adult#004", "adolescent#008"] {
        let basal = uva_padova::patient(name).unwrap().basal_u_per_min();
        let cf = uva_padova::therapy(name).unwrap().cf_mg_dl_per_u;
        let full = uva_padova::SENSITIVITY_REF_MG_DL / (cf * basal * 60.0);
        assert!((uva_padova::sensitivity_scale(cf, basal, 1.0) - full).abs() < 1e-12);
        assert!((uva_padova::sensitivity_scale(cf, basal, 0.5) - full.sqrt()).abs() < 1e-12);
        assert_eq!(uva_padova::sensitivity_scale(cf, basal, 0.0), 1.0);
        for m in [0.0f32, 0.5, 1.0] {
            let got = insulin(name, 1.0, m);
            assert!((got - insulin(name, 0.0, m)).abs() < 1e-12, "{name} x{m}");
            assert!(
                (got - f64::from(m) * basal * minutes).abs() < 1e-9,
                "{name} x{m}"
            );
        }
        for (k, s) in [(0.0, 1.0), (0.5, full.sqrt()), (1.0, full)] {
            let got = insulin(name, k, 3.0);
            let want = (1.0 + 2.0 * s) * basal * minutes;
            assert!((got - want).abs() < 1e-9, "{name} k {k}: {got} vs {want}");
        }
        // mg/dL per hour of the insulin above basal at k = 1: (units above basal / hours) x CF.
        extra_effect.push((insulin(name, 1.0, 3.0) - basal * minutes) / 2.0 * cf);
    }
    // Both are 2 x 14 mg/dL per hour, though the two patients' sensitivities differ fivefold.
    for e in &extra_effect {
        assert!(
            (e - 2.0 * uva_padova::SENSITIVITY_REF_MG_DL).abs() < 1e-9,
            "{e}"
        );
    }
    for bad in [-0.5, 1.5, f64::NAN] {
        let mut opts = UvaPadovaOptions::pump(false);
        opts.sensitivity_scaling = bad;
        assert!(UvaPadovaEnv::new("adult#001", opts).is_err(), "{bad}");
    }
}

/// The pump's reward is minus the day's risk with the low branch weighted
/// (`PUMP_LOW_RISK_WEIGHT`): every step's reward equals the weighted risk of its CGM samples in
/// the glucose log, and an overdose that drives glucose low costs that weight times more than
/// the symmetric index charges.
#[test]
fn pump_reward_weighs_low_glucose_risk() {
    let w = uva_padova::PUMP_LOW_RISK_WEIGHT;
    assert!(w > 1.0);
    let mut opts = UvaPadovaOptions::pump(false);
    opts.sensor.noise = false;
    assert_eq!(opts.low_risk_weight, w);
    let mut env = UvaPadovaEnv::new("adult#001", opts).unwrap();
    let mut o = vec![0.0f32; 26];
    env.reset(3, &mut o);
    let (mut total, mut weighted_low, mut high) = (0.0, 0.0, 0.0);
    for _ in 0..16 {
        // Double the programmed basal for 8 hours: glucose falls below 70 mg/dL.
        let s = env.step(Action::Continuous(&[2.0]), &mut o).unwrap();
        total += s.reward;
        if s.terminated {
            break;
        }
    }
    for s in &env.glucose_log().unwrap()[1..] {
        let (lo, hi, _) = uva_padova::risk_index(s.cgm_mg_dl);
        weighted_low += w * lo;
        high += hi;
    }
    assert!(weighted_low > 0.0, "the overdose reached low glucose");
    assert!(
        (total + weighted_low + high).abs() <= 1e-9 * total.abs(),
        "{total} vs -({weighted_low} + {high})"
    );
}
