//! Offline datasets generated through the Gymnasium bridge (`env = "gymnasium:<id>"`):
//! - issue 57's equality target for offline data: `gymnasium:CartPole-v1` under a seed gives
//!   the dataset fedrl's own CartPole-v1 gives (same episodes, units, actions, rewards and
//!   flags; observations to float tolerance), for random and `ppo_mixed` behaviours;
//! - experts trained on a Gymnasium grid (a user's own environment, its kwargs the grid's) are
//!   deterministic and their demonstrations respect the cap;
//! - a missing interpreter is refused naming the install script.
//!
//! Needs the bridge's virtual environment (`scripts/install-python-bridge.sh`; `.ci/run` runs it
//! first); without it each test says so and passes without checking anything.

use fedrl_common::offline::{Behaviour, DatasetGymnasium, DatasetSpec};
use fedrl_common::task::dppg::KwargDraw;
use fedrl_rl::offline::dataset::Dataset;
use fedrl_rl::offline::experts::generate_experts;
use fedrl_rl::offline::generate;
use fedrl_sim::gym_bridge::default_python;
use serde_json::json;

fn venv() -> bool {
    let p = std::env::var_os("FEDRL_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(default_python);
    if p.exists() {
        return true;
    }
    eprintln!(
        "SKIPPED: no bridge interpreter at {} (run scripts/install-python-bridge.sh)",
        p.display()
    );
    false
}

fn table(obs_dim: usize, actions: usize) -> DatasetGymnasium {
    serde_json::from_value(json!({ "obs_dim": obs_dim, "actions": actions })).unwrap()
}

fn cartpole(behaviour: Behaviour, gym: bool) -> DatasetSpec {
    DatasetSpec {
        env: if gym {
            "gymnasium:CartPole-v1".into()
        } else {
            "CartPole-v1".into()
        },
        population_seed: 0,
        behaviour,
        units: 10,
        episodes_per_unit: 3,
        seed: 7,
        gymnasium: gym.then(|| Box::new(table(4, 2))),
    }
}

/// Same episodes; observations within `tol` (Gymnasium steps CartPole in float64 numpy, fedrl
/// in Rust: the traces agree to rounding).
fn assert_same(rust: &Dataset, gym: &Dataset, tol: f32) {
    assert_eq!(rust.obs_dim, gym.obs_dim);
    assert_eq!(rust.n_actions, gym.n_actions);
    assert_eq!(rust.episodes.len(), gym.episodes.len());
    for (a, b) in rust.episodes.iter().zip(&gym.episodes) {
        assert_eq!((a.id, a.unit), (b.id, b.unit));
        assert_eq!(a.actions, b.actions, "episode {}", a.id);
        assert_eq!(a.rewards, b.rewards, "episode {}", a.id);
        assert_eq!(a.terminations, b.terminations, "episode {}", a.id);
        assert_eq!(a.truncations, b.truncations, "episode {}", a.id);
        assert_eq!(a.observations.len(), b.observations.len());
        for (k, (x, y)) in a.observations.iter().zip(&b.observations).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + x.abs()),
                "episode {} value {k}: {x} vs {y}",
                a.id
            );
        }
    }
}

#[test]
fn random_cartpole_through_the_bridge_equals_fedrls_own() {
    if !venv() {
        return;
    }
    let rust = generate(&cartpole(Behaviour::Random, false), &mut |_| {}).unwrap();
    let gym = generate(&cartpole(Behaviour::Random, true), &mut |_| {}).unwrap();
    assert_eq!(gym.env_id, "gymnasium:CartPole-v1");
    assert!(gym.episodes.iter().all(|e| !e.actions.is_empty()));
    assert_same(&rust, &gym, 1e-5);
    // The worker count changes neither the data nor its key.
    let mut two = cartpole(Behaviour::Random, true);
    two.gymnasium.as_mut().unwrap().workers = 1;
    assert_eq!(
        two.cache_key(),
        cartpole(Behaviour::Random, true).cache_key()
    );
    let one = generate(&two, &mut |_| {}).unwrap();
    assert_eq!(one.episodes, gym.episodes);
}

#[test]
fn ppo_mixed_cartpole_through_the_bridge_equals_fedrls_own() {
    if !venv() {
        return;
    }
    let b = Behaviour::PpoMixed {
        iterations: 3,
        checkpoints: 2,
        epsilon: 0.2,
    };
    let rust = generate(&cartpole(b.clone(), false), &mut |_| {}).unwrap();
    let gym = generate(&cartpole(b, true), &mut |_| {}).unwrap();
    assert_same(&rust, &gym, 1e-5);
}

/// `MyOrg/Thermostat-v0` (python/examples/my_envs.py): its `setpoint` kwarg makes the grid.
fn thermostat_experts() -> DatasetSpec {
    let mut g = table(3, 3);
    g.module = Some("examples.my_envs".into());
    g.grid
        .insert("setpoint".into(), KwargDraw::Linspace(18.0, 24.0, 3));
    g.grid_kwargs.insert("insulation".into(), json!(0.8));
    DatasetSpec {
        env: "gymnasium:MyOrg/Thermostat-v0".into(),
        population_seed: 0,
        behaviour: Behaviour::Experts {
            population: "gymnasium:MyOrg/Thermostat-v0".into(),
            per_setting: 2,
            iterations: 2,
            hidden: vec![8],
            p_min: 0.05,
            max_steps: 20,
            shared_iterations: 1,
            expert_lr: None,
        },
        units: 6,
        episodes_per_unit: 2,
        seed: 3,
        gymnasium: Some(Box::new(g)),
    }
}

#[test]
fn experts_train_on_a_gymnasium_grid_deterministically() {
    if !venv() {
        return;
    }
    let spec = thermostat_experts();
    let a = generate_experts(&spec, &mut |_| {}).unwrap();
    assert_eq!(a.experts.experts(), 6);
    assert_eq!(a.dataset.episodes.len(), 12);
    assert_eq!(a.dataset.obs_dim, 3);
    assert_eq!(a.dataset.n_actions, 3);
    for (i, e) in a.dataset.episodes.iter().enumerate() {
        assert_eq!(e.unit, i as u64 / 2);
        assert!(!e.actions.is_empty() && e.actions.len() <= 20);
        assert_eq!(e.observations.len(), 3 * (e.actions.len() + 1));
    }
    // The shared iteration and the experts' own two.
    assert_eq!(a.curve.mean_return.len(), 3);
    let mut one_worker = spec.clone();
    one_worker.gymnasium.as_mut().unwrap().workers = 1;
    let b = generate_experts(&one_worker, &mut |_| {}).unwrap();
    assert_eq!(a.dataset.episodes, b.dataset.episodes);
    for u in 0..6 {
        assert_eq!(a.experts.policy(u).unwrap(), b.experts.policy(u).unwrap());
    }
    // Another grid is another training: other experts.
    let mut other = spec.clone();
    other
        .gymnasium
        .as_mut()
        .unwrap()
        .grid_kwargs
        .insert("insulation".into(), json!(0.5));
    assert_ne!(other.cache_key(), spec.cache_key());
    let c = generate_experts(&other, &mut |_| {}).unwrap();
    assert!((0..6).any(|u| a.experts.policy(u).unwrap() != c.experts.policy(u).unwrap()));
}

#[test]
fn a_missing_interpreter_names_the_install_script() {
    if std::env::var_os("FEDRL_PYTHON").is_some() {
        return; // it would override the table's interpreter
    }
    let mut spec = cartpole(Behaviour::Random, true);
    spec.gymnasium.as_mut().unwrap().python = Some("/nonexistent/python".into());
    let e = generate(&spec, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("install-python-bridge.sh"), "{e}");
    // A spec whose env and table disagree is refused before anything starts.
    let mut bad = cartpole(Behaviour::Random, false);
    bad.gymnasium = Some(Box::new(table(4, 2)));
    let e = generate(&bad, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("gymnasium:<id>"), "{e}");
}
