//! HIV treatment against the RLPy-derived reference traces, plus edge cases.

use fedrl_sim::hiv::{self, HivEnv, HivParams};
use fedrl_sim::{Action, Env};

fn traces() -> serde_json::Value {
    let text = include_str!("../../testdata/hiv_traces.json");
    serde_json::from_str(text).expect("trace file parses")
}

#[test]
fn replays_hiv_traces() {
    let results = hiv::replay_traces(&traces()).expect("replay runs");
    assert_eq!(results.len(), 2);
    for r in &results {
        eprintln!(
            "{}: {} episodes, {} steps, obs err {:.3e}, rel reward err {:.3e}, flags {}",
            r.name, r.episodes, r.steps, r.max_error, r.max_reward_error, r.mismatched_flags
        );
        assert!(r.pass, "{r:?}");
    }
}

#[test]
fn actions_are_validated_and_episodes_truncate() {
    for (mut env, n) in [(HivEnv::rlpy(), 200), (HivEnv::seed000(), 50)] {
        let mut obs = [0.0f32; 6];
        env.reset(0, &mut obs);
        assert!(env.step(Action::Discrete(4), &mut obs).is_err());
        assert!(env.step(Action::Continuous(&[0.0]), &mut obs).is_err());
        for k in 0..n {
            let s = env.step(Action::Discrete(k % 4), &mut obs).expect("steps");
            assert_eq!(s.truncated, k + 1 == n, "{} step {k}", env.id());
            assert!(!s.terminated);
            assert!(obs.iter().all(|v| v.is_finite()));
        }
    }
    assert_eq!(HivEnv::rlpy().id(), "HIVTreatment-v0");
    assert_eq!(HivEnv::seed000().id(), "HIVTreatment20d-v0");
}

#[test]
fn reset_observes_the_log10_start_state_and_reward_formula_holds() {
    let mut env = HivEnv::rlpy();
    let mut obs = [0.0f32; 6];
    env.reset(3, &mut obs);
    for (o, s) in obs.iter().zip(hiv::INITIAL_STATE) {
        assert!((f64::from(*o) - s.log10()).abs() < 1e-6);
    }
    let s = env.step(Action::Discrete(3), &mut obs).expect("steps");
    let x = *env.raw_state();
    let expected = -0.1 * x[4] - 2e4 * 0.49 - 2e3 * 0.09 + 1e3 * x[5];
    assert!((s.reward - expected).abs() < 1e-9 * expected.abs());
    // The corrected table: action 2 is the protease inhibitor alone.
    assert_eq!(hiv::ACTIONS[2], (0.0, 0.3));
    let s0 = env.reward(0.0, 0.0);
    assert_eq!(env.reward(0.0, 0.3), s0 - 2e3 * 0.09);
}

#[test]
fn expert_variations_follow_appendix_b1() {
    let first = HivParams::expert_variation(0).expect("in range");
    assert_eq!((first.eps1_penalty, first.eps2_penalty), (18750.0, 1850.0));
    assert_eq!(first.efficacy_noise_sd, 0.0);
    assert_eq!((first.days_per_step, first.steps_per_episode), (20.0, 50));
    let second = HivParams::expert_variation(1).expect("in range");
    assert_eq!(second.efficacy_noise_sd, 0.01);
    let last = HivParams::expert_variation(1999).expect("in range");
    assert_eq!((last.eps1_penalty, last.eps2_penalty), (21250.0, 2150.0));
    assert!(HivParams::expert_variation(2000).is_err());
    let mut settings: Vec<(u64, u64, u64)> = (0..2000)
        .map(|i| {
            let p = HivParams::expert_variation(i).expect("in range");
            (
                p.eps1_penalty.to_bits(),
                p.eps2_penalty.to_bits(),
                p.efficacy_noise_sd.to_bits(),
            )
        })
        .collect();
    settings.sort();
    settings.dedup();
    assert_eq!(settings.len(), 2000);
}

#[test]
fn noisy_efficacy_is_seeded_and_penalties_change_rewards() {
    let noisy = HivParams::expert_variation(1).expect("in range");
    let run = |p: &HivParams, seed| {
        let mut env = HivEnv::new(p.clone()).expect("valid");
        let mut obs = [0.0f32; 6];
        env.reset(seed, &mut obs);
        (0..10)
            .map(|k| {
                env.step(Action::Discrete(3 - k % 2), &mut obs)
                    .expect("steps")
                    .reward
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(&noisy, 4), run(&noisy, 4));
    assert_ne!(run(&noisy, 4), run(&noisy, 5));
    let clean = HivParams::expert_variation(0).expect("in range");
    assert_eq!(run(&clean, 4), run(&clean, 5));
    let heavier = HivParams {
        eps1_penalty: 21250.0,
        ..clean.clone()
    };
    let (a, b) = (run(&clean, 0), run(&heavier, 0));
    assert!((a[0] - b[0] - (21250.0 - 18750.0) * 0.49).abs() < 1e-6);
    assert!(
        HivEnv::new(HivParams {
            days_per_step: 0.0,
            ..HivParams::rlpy()
        })
        .is_err()
    );
}

#[test]
fn state_round_trip_and_invalid_states() {
    let mut env = HivEnv::rlpy();
    let mut obs = [0.0f32; 6];
    env.reset(0, &mut obs);
    for k in 0..30 {
        env.step(Action::Discrete(k % 4), &mut obs).expect("steps");
    }
    let saved = env.state();
    assert_eq!(saved.len(), 7);
    let mut first = Vec::new();
    for k in 0..10 {
        let s = env.step(Action::Discrete(k % 4), &mut obs).expect("steps");
        first.push((obs, s));
    }
    env.set_state(&saved, &mut obs).expect("fits");
    for (k, (o, s)) in first.into_iter().enumerate() {
        let s2 = env.step(Action::Discrete(k % 4), &mut obs).expect("steps");
        assert_eq!((obs, s2), (o, s));
    }
    assert!(env.set_state(&saved[..6], &mut obs).is_ok());
    assert!(env.set_state(&saved[..5], &mut obs).is_err());
    assert!(
        env.set_state(&[1.0, 1.0, 1.0, 1.0, -1.0, 1.0], &mut obs)
            .is_err()
    );
}
