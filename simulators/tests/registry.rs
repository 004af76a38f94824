//! Every registered environment builds, resets, steps through a whole episode and reports the
//! horizon `list()` promises.

use fedrl_sim::{Action, Space};

#[test]
fn every_listed_environment_runs_an_episode() {
    let infos = fedrl_sim::list();
    assert!(infos.len() >= 10);
    for info in infos {
        let mut env = fedrl_sim::make(info.id).unwrap();
        assert_eq!(env.id(), info.id);
        let dim = env.observation_space().dim();
        let mut obs = vec![f32::NAN; dim];
        env.reset(11, &mut obs);
        assert!(obs.iter().all(|v| v.is_finite()), "{}: {obs:?}", info.id);
        let mut u = [0f32];
        let mut steps = 0u32;
        loop {
            let action = match env.action_space() {
                Space::Discrete { n } => Action::Discrete(steps as usize % n),
                Space::Box { low, high } => {
                    u[0] = 0.5 * (low[0] + high[0]);
                    Action::Continuous(&u)
                }
            };
            let s = env.step(action, &mut obs).unwrap();
            steps += 1;
            assert!(s.reward.is_finite(), "{}", info.id);
            if s.terminated || s.truncated {
                if s.truncated {
                    assert_eq!(steps, info.max_episode_steps, "{}", info.id);
                }
                break;
            }
            assert!(
                steps < info.max_episode_steps,
                "{} ran past its horizon",
                info.id
            );
        }
    }
}

#[test]
fn unknown_ids_are_errors_naming_the_known_ones() {
    let err = fedrl_sim::make("CartPole-v0").err().unwrap().to_string();
    assert!(err.contains("CartPole-v1"), "{err}");
}
