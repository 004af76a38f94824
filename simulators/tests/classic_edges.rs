//! Termination, truncation, reward and action-validation edge cases of the classic-control
//! environments, including Gymnasium 1.4.0 episodes that reach the goals and limits.

use fedrl_sim::classic::{Acrobot, CartPole, MountainCar, Pendulum};
use fedrl_sim::replay::replay_file;
use fedrl_sim::{Action, Env, SimError};

const EDGE_TRACES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/gymnasium_edge_traces.json"
);

#[test]
fn gymnasium_edge_traces_replay_exactly() {
    // Acrobot and MountainCar reaching their goals, CartPole truncated at 500 and stepped past
    // termination (reward 0), Pendulum actions in [-6, 6] clipped to [-2, 2].
    let results = replay_file(EDGE_TRACES).expect("replay edge traces");
    assert_eq!(results.len(), 4);
    for r in &results {
        assert!(r.pass, "{r:?}");
        assert_eq!(r.max_reward_error, 0.0, "{r:?}");
    }
}

#[test]
fn cartpole_terminates_at_the_thresholds_and_pays_zero_after() {
    let mut env = CartPole::new();
    let mut obs = [0f32; 4];
    // Moving right fast just inside the track: the next step leaves it.
    env.set_state(&[2.39, 2.0, 0.0, 0.0], &mut obs).unwrap();
    let s = env.step(Action::Discrete(1), &mut obs).unwrap();
    assert!(s.terminated && !s.truncated);
    assert_eq!(s.reward, 1.0);
    let s = env.step(Action::Discrete(1), &mut obs).unwrap();
    assert!(s.terminated);
    assert_eq!(s.reward, 0.0, "Gymnasium pays 0 after termination");
    // Angle threshold (12 degrees) from the other side.
    env.set_state(&[0.0, 0.0, -0.2094, -1.0], &mut obs).unwrap();
    assert!(env.step(Action::Discrete(0), &mut obs).unwrap().terminated);
}

#[test]
fn time_limits_truncate_at_the_gymnasium_horizons() {
    let cases: Vec<(Box<dyn Env>, u32, Action<'static>)> = vec![
        (Box::new(CartPole::new()), 500, Action::Discrete(0)),
        (Box::new(Acrobot::new()), 500, Action::Discrete(1)),
        (Box::new(Pendulum::new()), 200, Action::Continuous(&[0.0])),
        (Box::new(MountainCar::new()), 200, Action::Discrete(1)),
    ];
    for (mut env, horizon, action) in cases {
        let mut obs = vec![0f32; env.observation_space().dim()];
        env.reset(1, &mut obs);
        let mut state = env.state();
        // Jump to one step before the limit by setting the elapsed-steps component.
        let n = state.len();
        state[n - 1] = f64::from(horizon - 2);
        env.set_state(&state, &mut obs).unwrap();
        assert!(
            !env.step(action, &mut obs).unwrap().truncated,
            "{}",
            env.id()
        );
        assert!(
            env.step(action, &mut obs).unwrap().truncated,
            "{}",
            env.id()
        );
        assert_eq!(env.state()[n - 1], f64::from(horizon));
        // A bare Gymnasium state restarts the episode clock.
        env.set_state(&state[..n - 1], &mut obs).unwrap();
        assert_eq!(env.state()[n - 1], 0.0);
    }
}

#[test]
fn acrobot_reward_and_termination() {
    let mut env = Acrobot::new();
    let mut obs = [0f32; 6];
    env.reset(3, &mut obs);
    let s = env.step(Action::Discrete(2), &mut obs).unwrap();
    assert_eq!(s.reward, -1.0);
    // Both links pointing up: far above the goal line.
    env.set_state(&[3.1, 0.0, 0.0, 0.0], &mut obs).unwrap();
    let s = env.step(Action::Discrete(1), &mut obs).unwrap();
    assert!(s.terminated);
    assert_eq!(s.reward, 0.0);
    // Angles are wrapped into [-pi, pi] and velocities bounded.
    env.set_state(&[0.0, 0.0, 100.0, -100.0], &mut obs).unwrap();
    env.step(Action::Discrete(0), &mut obs).unwrap();
    let st = env.state();
    assert!(st[0].abs() <= std::f64::consts::PI && st[1].abs() <= std::f64::consts::PI);
    assert!(st[2].abs() <= 4.0 * std::f64::consts::PI + 1e-12);
    assert!(st[3].abs() <= 9.0 * std::f64::consts::PI + 1e-12);
}

#[test]
fn pendulum_clips_torque_to_two() {
    let start = [0.5, -0.3];
    let run = |u: f32| {
        let mut env = Pendulum::new();
        let mut obs = [0f32; 3];
        env.set_state(&start, &mut obs).unwrap();
        let s = env.step(Action::Continuous(&[u]), &mut obs).unwrap();
        (s.reward, obs, env.state())
    };
    assert_eq!(run(2.0), run(7.5));
    assert_eq!(run(-2.0), run(-100.0));
    assert_ne!(run(1.0), run(2.0));
    // Reward is -(theta^2 + 0.1 omega^2 + 0.001 u^2) before the update.
    let (r, _, _) = run(0.0);
    assert!((r + (0.25 + 0.1 * 0.09)).abs() < 1e-12);
    // Speed is bounded to 8 rad/s and the pendulum never terminates.
    let mut env = Pendulum::new();
    let mut obs = [0f32; 3];
    env.set_state(&[0.0, 7.99], &mut obs).unwrap();
    let s = env.step(Action::Continuous(&[2.0]), &mut obs).unwrap();
    assert!(!s.terminated);
    assert_eq!(env.state()[1], 8.0);
}

#[test]
fn mountain_car_wall_goal_and_bounds() {
    let mut env = MountainCar::new();
    let mut obs = [0f32; 2];
    // Hitting the left wall stops the car.
    env.set_state(&[-1.19, -0.07], &mut obs).unwrap();
    let s = env.step(Action::Discrete(0), &mut obs).unwrap();
    assert_eq!(env.state()[..2], [-1.2, 0.0]);
    assert_eq!(s.reward, -1.0);
    assert!(!s.terminated);
    // Reaching the flag terminates.
    env.set_state(&[0.49, 0.03], &mut obs).unwrap();
    let s = env.step(Action::Discrete(2), &mut obs).unwrap();
    assert!(s.terminated);
    assert_eq!(s.reward, -1.0);
    // Speed is clipped to 0.07.
    env.set_state(&[-0.5, 0.07], &mut obs).unwrap();
    env.step(Action::Discrete(2), &mut obs).unwrap();
    assert!(env.state()[1] <= 0.07);
}

#[test]
fn invalid_actions_states_and_buffers_are_errors() {
    let mut obs = [0f32; 6];
    let mut cp = CartPole::new();
    cp.reset(0, &mut obs[..4]);
    assert!(matches!(
        cp.step(Action::Discrete(2), &mut obs[..4]),
        Err(SimError::InvalidAction { .. })
    ));
    assert!(cp.step(Action::Continuous(&[1.0]), &mut obs[..4]).is_err());
    assert!(matches!(
        cp.step(Action::Discrete(1), &mut obs[..3]),
        Err(SimError::ObsBuffer { .. })
    ));
    assert!(matches!(
        cp.set_state(&[0.0; 3], &mut obs[..4]),
        Err(SimError::StateLength { .. })
    ));
    assert!(
        cp.set_state(&[0.0, f64::NAN, 0.0, 0.0], &mut obs[..4])
            .is_err()
    );
    assert!(
        cp.set_state(&[0.0, 0.0, 0.0, 0.0, -1.0], &mut obs[..4])
            .is_err()
    );
    let mut ac = Acrobot::new();
    assert!(ac.step(Action::Discrete(3), &mut obs).is_err());
    let mut pe = Pendulum::new();
    assert!(
        pe.step(Action::Continuous(&[f32::NAN]), &mut obs[..3])
            .is_err()
    );
    assert!(
        pe.step(Action::Continuous(&[1.0, 2.0]), &mut obs[..3])
            .is_err()
    );
    assert!(pe.step(Action::Discrete(0), &mut obs[..3]).is_err());
    let mut mc = MountainCar::new();
    assert!(mc.step(Action::Discrete(3), &mut obs[..2]).is_err());
}

#[test]
fn state_round_trips_and_replays_identically() {
    for id in ["CartPole-v1", "Acrobot-v1", "Pendulum-v1", "MountainCar-v0"] {
        let mut a = fedrl_sim::make(id).unwrap();
        let mut b = fedrl_sim::make(id).unwrap();
        let dim = a.observation_space().dim();
        let (mut oa, mut ob) = (vec![0f32; dim], vec![0f32; dim]);
        a.reset(42, &mut oa);
        let act = |t: usize| {
            if id == "Pendulum-v1" {
                Action::Continuous(if t.is_multiple_of(2) { &[1.5] } else { &[-0.5] })
            } else {
                Action::Discrete(t % 2)
            }
        };
        for t in 0..5 {
            a.step(act(t), &mut oa).unwrap();
        }
        b.set_state(&a.state(), &mut ob).unwrap();
        assert_eq!(oa, ob, "{id}");
        for t in 0..20 {
            let sa = a.step(act(t), &mut oa).unwrap();
            let sb = b.step(act(t), &mut ob).unwrap();
            assert_eq!((sa, &oa), (sb, &ob), "{id}");
        }
    }
}

#[test]
fn physical_parameters_change_the_dynamics() {
    let mut obs = [0f32; 4];
    let mut a = CartPole::new();
    let mut b = CartPole::new();
    b.gravity = 11.0;
    b.force_mag = 9.0;
    b.masscart = 1.25;
    a.set_state(&[0.0, 0.0, 0.05, 0.0], &mut obs).unwrap();
    b.set_state(&[0.0, 0.0, 0.05, 0.0], &mut obs).unwrap();
    for _ in 0..3 {
        a.step(Action::Discrete(1), &mut obs).unwrap();
        b.step(Action::Discrete(1), &mut obs).unwrap();
    }
    assert_ne!(a.state(), b.state());
}
