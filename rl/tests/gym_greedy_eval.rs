//! Greedy Q-network evaluations through the Gymnasium bridge (`GreedyGymEvaluator`, what
//! `fedrl run` uses to fill an offline CQL run's deferred evaluations): one evaluator, its
//! workers started once, evaluates several networks each as a fresh `evaluate_greedy_gym` call
//! would, and as fedrl's own CartPole-v1 does (`evaluate_greedy_for`) on the same seeds.
//!
//! Needs the bridge's virtual environment (`scripts/install-python-bridge.sh`; `.ci/run` runs it
//! first); without it the test says so and passes without checking anything.

use fedrl_common::offline::{Behaviour, DatasetSpec};
use fedrl_rl::offline::QNetSpec;
use fedrl_rl::offline::gym::{GreedyGymEvaluator, evaluate_greedy_gym};
use fedrl_rl::offline::train::evaluate_greedy_for;
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

#[test]
fn one_evaluator_plays_each_network_as_fedrls_own_cartpole_does() {
    if !venv() {
        return;
    }
    let dataset = DatasetSpec {
        env: "gymnasium:CartPole-v1".into(),
        population_seed: 0,
        behaviour: Behaviour::Random,
        units: 2,
        episodes_per_unit: 1,
        seed: 1,
        gymnasium: Some(Box::new(
            serde_json::from_value(json!({ "obs_dim": 4, "actions": 2, "workers": 2 })).unwrap(),
        )),
    };
    let spec = QNetSpec {
        obs_dim: 4,
        hidden: vec![16],
        n_actions: 2,
    };
    let mut ev = GreedyGymEvaluator::start(&dataset).unwrap();
    let mut means = Vec::new();
    for (k, net) in (0..3u64).enumerate() {
        // Networks that act differently: random weights, scaled up.
        let params: Vec<f32> = spec.init(net).iter().map(|x| 5.0 * x).collect();
        let (episodes, seed, max_steps) = (7, 40 + k as u64, 300);
        let got = ev
            .evaluate(&spec, &params, episodes, seed, max_steps)
            .unwrap();
        let rust =
            evaluate_greedy_for(&spec, &params, "CartPole-v1", episodes, seed, max_steps).unwrap();
        assert_eq!(got.returns, rust.returns, "network {net}");
        let fresh =
            evaluate_greedy_gym(&dataset, &spec, &params, episodes, seed, max_steps).unwrap();
        assert_eq!(got.returns, fresh.returns, "network {net}");
        means.push(got.mean);
    }
    // The comparison has teeth: the networks' returns differ.
    assert!(means.iter().any(|m| *m != means[0]), "{means:?}");
}
