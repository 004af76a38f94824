//! Populations: user parameters are a pure function of (population, seed, user).

use fedrl_sim::population::{Population, UserParams, list};
use fedrl_sim::{Action, Env};

#[test]
fn same_population_seed_and_user_give_the_same_parameters() {
    for info in list() {
        let a = Population::new(info.name, 17).unwrap();
        let b = Population::new(info.name, 17).unwrap();
        // Created in a different order: still the same users.
        for user in [5u64, 0, 123_456_789, u64::MAX] {
            assert_eq!(
                a.describe_user(user).unwrap(),
                b.describe_user(user).unwrap(),
                "{}",
                info.name
            );
        }
    }
}

#[test]
fn different_users_and_seeds_differ() {
    for name in [
        "cartpole-b1",
        "acrobot-b1",
        "dosing-fixed-meals",
        "dosing-meal-habits",
    ] {
        let p = Population::new(name, 1).unwrap();
        let users: Vec<UserParams> = (0..20).map(|u| p.user_params(u).unwrap()).collect();
        let distinct = users
            .iter()
            .enumerate()
            .filter(|(i, u)| !users[..*i].contains(u))
            .count();
        assert!(
            distinct >= 18,
            "{name}: only {distinct} distinct users of 20"
        );
        let q = Population::new(name, 2).unwrap();
        assert_ne!(
            p.user_params(0).unwrap(),
            q.user_params(0).unwrap(),
            "{name}"
        );
    }
    let p = Population::new("uva-padova", 1).unwrap();
    let names: std::collections::BTreeSet<String> = (0..200)
        .map(|u| match p.user_params(u).unwrap() {
            UserParams::Patient { name, .. } => name,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(names.len(), 30, "200 users cover all 30 patients");
}

#[test]
fn cartpole_b1_values_lie_on_the_paper_grid() {
    let p = Population::new("cartpole-b1", 9).unwrap();
    let mut cells = std::collections::HashSet::new();
    for u in 0..3000 {
        match p.user_params(u).unwrap() {
            UserParams::CartPole {
                gravity,
                force_mag,
                masscart,
                cell,
            } => {
                let g = 8.75 + f64::from(cell[0]) * 0.25;
                let f = 9.0 + f64::from(cell[1]) * 0.25;
                let m = 0.8 + f64::from(cell[2]) * 0.05;
                assert!((gravity - g).abs() < 1e-12);
                assert!((force_mag - f).abs() < 1e-12);
                assert!((masscart - m).abs() < 1e-12);
                cells.insert(cell);
            }
            other => panic!("{other:?}"),
        }
    }
    // 3000 uniform draws from 1000 cells leave about 50 unseen.
    assert!(cells.len() > 900, "{}", cells.len());
    let mut env = p.user_env(0).unwrap();
    let mut obs = [0f32; 4];
    env.reset(0, &mut obs);
    env.step(Action::Discrete(1), &mut obs).unwrap();
}

#[test]
fn acrobot_b1_extremes_are_in_range_and_every_user_env_runs() {
    let p = Population::new("acrobot-b1", 3).unwrap();
    for u in 0..200 {
        if let UserParams::Acrobot {
            link_length,
            link_mass_1,
            link_mass_2,
            ..
        } = p.user_params(u).unwrap()
        {
            assert!((0.8..=1.2).contains(&link_length));
            assert!((0.9..=1.1).contains(&link_mass_1));
            assert!((0.9..=1.1).contains(&link_mass_2));
        } else {
            panic!("not an acrobot");
        }
    }
    for info in list() {
        let pop = Population::new(info.name, 4).unwrap();
        let mut env: Box<dyn Env> = pop.user_env(7).unwrap();
        assert_eq!(env.id(), pop.env_id());
        let mut obs = vec![0f32; env.observation_space().dim()];
        env.reset(1, &mut obs);
        let act = vec![0.01f32; env.action_space().dim()];
        let action = match env.action_space() {
            fedrl_sim::Space::Discrete { .. } => Action::Discrete(0),
            fedrl_sim::Space::Box { .. } => Action::Continuous(&act),
        };
        env.step(action, &mut obs).unwrap();
    }
}

#[test]
fn homogeneous_and_unknown_populations() {
    let p = Population::homogeneous("CartPole-v1").unwrap();
    assert_eq!(p.user_params(3).unwrap(), p.user_params(4).unwrap());
    assert_eq!(
        Population::new("RiverSwim-v0", 1).unwrap().env_id(),
        "RiverSwim-v0"
    );
    assert!(Population::new("no-such-population", 1).is_err());
    assert!(Population::homogeneous("Nope-v0").is_err());
    let d = Population::new("cartpole-b1", 5)
        .unwrap()
        .describe_user(2)
        .unwrap();
    assert_eq!(d["population"], "cartpole-b1");
    assert_eq!(d["user"], 2);
    assert_eq!(d["params"]["kind"], "cart_pole");
}
