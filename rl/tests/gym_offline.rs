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

// ---- Continuous-action (PriMORL) datasets through the bridge ----

use fedrl_common::task::primorl::{
    ContinuousBehaviour, ContinuousDatasetSpec, ContinuousGymnasium, PolicyPhaseConfig,
};
use fedrl_rl::offline::continuous::{self, ContinuousDataset};

fn continuous_table(obs_dim: usize, act_dim: usize) -> ContinuousGymnasium {
    serde_json::from_value(json!({ "obs_dim": obs_dim, "act_dim": act_dim })).unwrap()
}

fn pendulum(behaviour: ContinuousBehaviour, gym: bool) -> ContinuousDatasetSpec {
    ContinuousDatasetSpec {
        env: if gym {
            "gymnasium:Pendulum-v1".into()
        } else {
            "Pendulum-v1".into()
        },
        units: 5,
        public: 2,
        seed: 11,
        behaviour,
        gymnasium: gym.then(|| Box::new(continuous_table(3, 1))),
    }
}

/// Same units, lengths, flags and actions; observations and rewards within `tol` (Gymnasium
/// steps Pendulum in float64 numpy, fedrl in Rust: the traces agree to rounding).
fn assert_same_continuous(rust: &ContinuousDataset, gym: &ContinuousDataset, tol: f32) {
    assert_eq!(
        (rust.meta.obs_dim, rust.meta.act_dim),
        (gym.meta.obs_dim, gym.meta.act_dim)
    );
    assert_eq!(rust.episodes.len(), gym.episodes.len());
    let close = |a: &[f32], b: &[f32], what: &str, unit: u64| {
        assert_eq!(a.len(), b.len(), "unit {unit} {what}");
        for (k, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + x.abs()),
                "unit {unit} {what} value {k}: {x} vs {y}"
            );
        }
    };
    for (a, b) in rust.episodes.iter().zip(&gym.episodes) {
        assert_eq!(a.unit, b.unit);
        assert_eq!(a.terminated, b.terminated, "unit {}", a.unit);
        close(&a.actions, &b.actions, "actions", a.unit);
        close(&a.rewards, &b.rewards, "rewards", a.unit);
        close(&a.observations, &b.observations, "observations", a.unit);
    }
}

#[test]
fn random_pendulum_through_the_bridge_equals_fedrls_own() {
    if !venv() {
        return;
    }
    let rust =
        continuous::generate(&pendulum(ContinuousBehaviour::Random, false), &mut |_| {}).unwrap();
    let spec = pendulum(ContinuousBehaviour::Random, true);
    let gym = continuous::generate(&spec, &mut |_| {}).unwrap();
    assert_eq!(gym.meta.env_id, "gymnasium:Pendulum-v1");
    // Pendulum-v1's time limit: 200 steps, truncated.
    assert!(gym.episodes.iter().all(|e| e.len() == 200 && !e.terminated));
    assert_same_continuous(&rust, &gym, 1e-5);
    // The workers' spaces are recorded (the aggregator's policy phase reads them); fedrl's
    // own environments record none (their files are unchanged).
    let spaces = gym.meta.spaces.as_ref().expect("recorded spaces");
    assert_eq!(
        (spaces.act_low.clone(), spaces.act_high.clone()),
        (vec![-2.0], vec![2.0])
    );
    assert_eq!(spaces.obs_high, vec![Some(1.0), Some(1.0), Some(8.0)]);
    assert!(rust.meta.spaces.is_none());
    // The worker count changes neither the data nor its key; the procedure recorded is the
    // data identity (no interpreter path or worker count).
    let mut one = spec.clone();
    let g = one.gymnasium.as_mut().unwrap();
    g.workers = 1;
    g.step_timeout_s = 30.0;
    assert_eq!(one.cache_key(), spec.cache_key());
    let b = continuous::generate(&one, &mut |_| {}).unwrap();
    assert_eq!(b.episodes, gym.episodes);
    assert_eq!(b.meta, gym.meta);
}

#[test]
fn sac_checkpoints_through_the_bridge_match_fedrls_own_pendulum() {
    if !venv() {
        return;
    }
    // A short learning run in the default environment (user BEHAVIOUR_USER), then the mixture
    // recorded in the users' environments: both ways give the same data to rounding, since
    // fedrl's Pendulum-v1 matches Gymnasium's trace for trace.
    let b = ContinuousBehaviour::SacCheckpoints {
        steps: 150,
        checkpoints: 3,
        noise_std: 0.3,
    };
    let rust = continuous::generate(&pendulum(b.clone(), false), &mut |_| {}).unwrap();
    let mut learning = Vec::new();
    let gym = continuous::generate(&pendulum(b, true), &mut |p| {
        if let continuous::ContinuousProgress::Learning { step, .. } = p {
            learning.push(step);
        }
    })
    .unwrap();
    assert!(
        !learning.is_empty(),
        "the learning run reported its checkpoints"
    );
    assert_same_continuous(&rust, &gym, 1e-4);
}

#[test]
fn declared_spaces_are_checked_and_a_worker_fault_fails_generation() {
    if !venv() {
        return;
    }
    let mut wrong = pendulum(ContinuousBehaviour::Random, true);
    wrong.gymnasium.as_mut().unwrap().act_dim = 2;
    let e = continuous::generate(&wrong, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("declares") && e.contains("Box(1 values)"), "{e}");
    // FedrlTest/Continuous-v0 exits at step 5 of every episode: the recording fails with the
    // worker's reason instead of storing a dataset with units missing.
    let mut g = continuous_table(2, 2);
    g.module = Some("fedrl_bridge.test_envs".into());
    g.kwargs.insert("crash_at".into(), json!(5));
    let crash = ContinuousDatasetSpec {
        env: "gymnasium:FedrlTest/Continuous-v0".into(),
        units: 4,
        public: 1,
        seed: 0,
        behaviour: ContinuousBehaviour::Random,
        gymnasium: Some(Box::new(g)),
    };
    let dir = tempfile::tempdir().unwrap();
    let e = continuous::load_or_generate(&crash, dir.path(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("crashed") || e.contains("fault"), "{e}");
    assert!(
        !dir.path()
            .join("continuous")
            .join(crash.file_name())
            .exists()
    );
}

#[test]
fn a_missing_interpreter_is_refused_for_continuous_data_too() {
    if std::env::var_os("FEDRL_PYTHON").is_some() {
        return;
    }
    let mut spec = pendulum(ContinuousBehaviour::Random, true);
    spec.gymnasium.as_mut().unwrap().python = Some("/nonexistent/python".into());
    let e = continuous::generate(&spec, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("install-python-bridge.sh"), "{e}");
}

#[test]
fn deferred_policy_evaluation_equals_the_aggregators_on_pendulum() {
    if !venv() {
        return;
    }
    use fedrl_rl::candle_core::Device;
    use fedrl_rl::sac::{SacAgent, SacConfig};
    let cfg: PolicyPhaseConfig = serde_json::from_value(json!({
        "uncertainty": "max-aleatoric", "lambda": 1.0, "rollout_length": 5, "epochs": 2,
        "updates_per_epoch": 1, "hidden": [16, 16], "eval_episodes": 3, "seed": 4,
    }))
    .unwrap();
    let sac = SacConfig {
        hidden: vec![16, 16],
        ..SacConfig::default()
    };
    // Two actors (two untrained agents' weights), evaluated as the aggregator does in
    // fedrl's own Pendulum-v1 and as `fedrl run` does through the bridge.
    let mut actors = Vec::new();
    let mut own = Vec::new();
    for seed in [1, 2] {
        let mut a = SacAgent::new(3, &[-2.0], &[2.0], &sac, seed, &Device::Cpu).unwrap();
        let mut env = fedrl_sim::make("Pendulum-v1").unwrap();
        own.push(fedrl_rl::primorl::evaluate_actor(&mut a, env.as_mut(), &cfg).unwrap());
        actors.push(a.actor_params().unwrap());
    }
    let mut agent = SacAgent::new(3, &[-2.0], &[2.0], &sac, 9, &Device::Cpu).unwrap();
    let spec = pendulum(ContinuousBehaviour::Random, true);
    let mut seen = Vec::new();
    let bridged =
        fedrl_rl::primorl::evaluate_actors_gym(&spec, &mut agent, &actors, &cfg, &mut |i, m, _| {
            seen.push((i, m))
        })
        .unwrap();
    assert_eq!(seen.len(), 2);
    for ((m1, s1), (m2, s2)) in own.iter().zip(&bridged) {
        assert!((m1 - m2).abs() <= 1e-3 * (1.0 + m1.abs()), "{m1} vs {m2}");
        assert!((s1 - s2).abs() <= 1e-3 * (1.0 + s1.abs()), "{s1} vs {s2}");
    }
    assert_ne!(own[0].0, own[1].0, "two different actors");
}
