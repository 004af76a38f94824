//! RiverSwim: Osband et al. 2013 transition probabilities and rewards, horizon 20, one-hot
//! observations.

use fedrl_sim::riverswim::RiverSwim;
use fedrl_sim::{Action, Env};

#[test]
fn transition_matrix_is_osbands() {
    let env = RiverSwim::new();
    let n = env.n_states;
    assert_eq!(n, 6);
    for s in 0..n {
        for a in 0..2 {
            let total: f64 = (0..n).map(|s2| env.transition_prob(s, a, s2)).sum();
            assert!((total - 1.0).abs() < 1e-12, "row {s},{a} sums to {total}");
        }
    }
    assert_eq!(env.transition_prob(0, 0, 0), 1.0);
    assert_eq!(env.transition_prob(3, 0, 2), 1.0);
    assert_eq!(env.transition_prob(0, 1, 1), 0.6);
    assert_eq!(env.transition_prob(0, 1, 0), 0.4);
    assert_eq!(env.transition_prob(2, 1, 3), 0.35);
    assert_eq!(env.transition_prob(2, 1, 1), 0.05);
    assert!((env.transition_prob(2, 1, 2) - 0.6).abs() < 1e-12);
    assert_eq!(env.transition_prob(5, 1, 4), 0.4);
    assert!((env.transition_prob(5, 1, 5) - 0.6).abs() < 1e-12);
    assert_eq!(env.expected_reward(0, 0), 0.005);
    assert_eq!(env.expected_reward(5, 1), 1.0);
    assert_eq!(env.expected_reward(3, 1), 0.0);
}

#[test]
fn episodes_are_twenty_steps_with_one_hot_observations() {
    let mut env = RiverSwim::new();
    let mut obs = [0f32; 6];
    env.reset(7, &mut obs);
    assert_eq!(obs, [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    let mut total = 0.0;
    for t in 1..=20 {
        let s = env.step(Action::Discrete(0), &mut obs).unwrap();
        assert_eq!(s.truncated, t == 20);
        assert!(!s.terminated);
        total += s.reward;
        assert_eq!(obs.iter().sum::<f32>(), 1.0);
    }
    // Always swimming left stays on the left bank and collects 5/1000 each step.
    assert!((total - 20.0 * 0.005).abs() < 1e-12);
}

#[test]
fn empirical_right_swim_frequencies_match() {
    let mut env = RiverSwim::new();
    let mut obs = [0f32; 6];
    env.reset(1, &mut obs);
    let (mut right, mut left, n) = (0u32, 0u32, 40_000u32);
    for _ in 0..n {
        env.set_state(&[2.0], &mut obs).unwrap();
        env.step(Action::Discrete(1), &mut obs).unwrap();
        match env.position() {
            3 => right += 1,
            1 => left += 1,
            _ => {}
        }
    }
    let (pr, pl) = (
        f64::from(right) / f64::from(n),
        f64::from(left) / f64::from(n),
    );
    assert!((pr - 0.35).abs() < 0.01, "{pr}");
    assert!((pl - 0.05).abs() < 0.005, "{pl}");
}

#[test]
fn same_seed_same_episode_and_bad_input_errors() {
    let run = |seed| {
        let mut env = RiverSwim::new();
        let mut obs = [0f32; 6];
        env.reset(seed, &mut obs);
        (0..20)
            .map(|_| {
                env.step(Action::Discrete(1), &mut obs).unwrap();
                env.position()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(5), run(5));
    let mut env = RiverSwim::new();
    let mut obs = [0f32; 6];
    assert!(env.step(Action::Discrete(2), &mut obs).is_err());
    assert!(env.set_state(&[6.0], &mut obs).is_err());
    assert!(env.set_state(&[1.5], &mut obs).is_err());
    assert!(env.step(Action::Discrete(1), &mut obs[..5]).is_err());
}
