//! `fedrl eval` through the Gymnasium bridge: a policy evaluated on `gymnasium:CartPole-v1`
//! (workers made from a scenario's `[task.gymnasium]` table) returns what it returns on fedrl's
//! own CartPole-v1, episode for episode; `gymnasium:` without `--scenario` is a usage error;
//! `fedrl sim bench` steps a Gymnasium environment through a worker.
//!
//! Needs `.venv-bridge` (`scripts/install-python-bridge.sh`; `.ci/run` runs it first); without
//! it the evaluation part says so and passes.

use std::process::Command;

use fedrl_rl::{ModelSpec, io};
use fedrl_sim::Space;
use fedrl_sim::gym_bridge::default_python;

const FEDRL: &str = env!("CARGO_BIN_EXE_fedrl");

const SCENARIO: &str = r#"
name = "gym-eval"
rounds = 1
users = 10
client_agents = 1
participation = { kind = "fresh" }
cohort_size = 4
quorum = 4
clip_norm = 1.0
noise_multiplier = 1.0
target_epsilon = 10.0

[task]
kind = "dppg"
population = "gymnasium:CartPole-v1"

[task.gymnasium]
obs_dim = 4
actions = 2
workers = 2
"#;

fn eval_json(args: &[&str]) -> serde_json::Value {
    let o = Command::new(FEDRL)
        .arg("eval")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn eval_through_the_bridge_matches_fedrls_cartpole() {
    let dir = tempfile::tempdir().unwrap();
    let obs = Space::Box {
        low: vec![f32::NEG_INFINITY; 4],
        high: vec![f32::INFINITY; 4],
    };
    let spec = ModelSpec::from_spaces(&obs, &Space::Discrete { n: 2 }, &[8]).unwrap();
    // A policy that is not trivial: random initial weights, scaled up.
    let params: Vec<f32> = spec.init(3).iter().map(|x| 4.0 * x).collect();
    let policy = dir.path().join("policy.safetensors");
    io::save(&policy, &spec, &params).unwrap();
    let scenario = dir.path().join("s.toml");
    std::fs::write(&scenario, SCENARIO).unwrap();
    let p = policy.to_str().unwrap();

    let o = Command::new(FEDRL)
        .args(["eval", "--policy", p, "--env", "gymnasium:CartPole-v1"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--scenario"));

    if !default_python().exists() && std::env::var_os("FEDRL_PYTHON").is_none() {
        eprintln!("SKIPPED: no .venv-bridge (run scripts/install-python-bridge.sh)");
        return;
    }
    let common = [
        "--policy",
        p,
        "--episodes",
        "6",
        "--seed",
        "17",
        "--stochastic",
    ];
    let own = eval_json(&[&common[..], &["--env", "CartPole-v1"]].concat());
    let s = scenario.to_str().unwrap();
    let bridged = eval_json(
        &[
            &common[..],
            &["--env", "gymnasium:CartPole-v1", "--scenario", s],
        ]
        .concat(),
    );
    assert_eq!(bridged["episodes"], 6);
    for k in ["mean_return", "std_return", "min_return", "max_return"] {
        let (a, b) = (own[k].as_f64().unwrap(), bridged[k].as_f64().unwrap());
        assert!((a - b).abs() < 1e-9, "{k}: {a} vs {b}");
    }
}

#[test]
fn sim_bench_steps_a_gymnasium_environment() {
    if !default_python().exists() && std::env::var_os("FEDRL_PYTHON").is_none() {
        eprintln!("SKIPPED: no .venv-bridge (run scripts/install-python-bridge.sh)");
        return;
    }
    let o = Command::new(FEDRL)
        .args([
            "sim",
            "bench",
            "--env",
            "gymnasium:FedrlTest/Counter-v0",
            "--module",
            "fedrl_bridge.test_envs",
            "--steps",
            "300",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["steps"], 300);
    // Counter-v0 episodes last 10 steps: 30 ended, the 31st started.
    assert_eq!(v["episodes"], 31);
    assert!(v["steps_per_second"].as_f64().unwrap() > 0.0);
}
