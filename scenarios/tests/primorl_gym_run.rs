//! `fedrl run` of a PriMORL scenario whose dataset is recorded through the Gymnasium bridge
//! (`task.dataset.env = "gymnasium:Pendulum-v1"`): `fedrl run` generates the dataset in the
//! bridge's workers, the aggregator (no Python) trains the ensemble and runs the policy phase
//! without real-environment evaluations, keeping each epoch's actor, and `fedrl run` evaluates
//! them through the bridge afterwards (scenarios/src/deferred_eval/primorl.rs): the curve is filled,
//! the final figures are the last epoch's, and the report says `deferred`.
//!
//! Needs `.venv-bridge` (`scripts/install-python-bridge.sh`; `.ci/run` runs it first); without
//! it the test says so and passes without checking anything.

mod e2e_support;

use std::process::Command;

use e2e_support::*;
use fedrl_sim::gym_bridge::default_python;

fn venv() -> bool {
    if default_python().exists() || std::env::var_os("FEDRL_PYTHON").is_some() {
        return true;
    }
    eprintln!("SKIPPED: no .venv-bridge (run scripts/install-python-bridge.sh)");
    false
}

const SCENARIO: &str = r#"
name = "primorl-gym"
seed = 5
rounds = 4
users = 12
client_agents = 2
participation = { kind = "sampled", rate = 0.5 }
round_deadline_s = 60.0
start_timeout_s = 120.0
clip_norm = 0.5
noise_multiplier = 1.0
target_epsilon = 1000.0
unit_kind = "trajectory"

[task]
kind = "primorl"
eval_every = 2
patience = 10

[task.dataset]
env = "gymnasium:Pendulum-v1"
units = 12
public = 2
seed = 3
behaviour = { kind = "random" }

[task.dataset.gymnasium]
obs_dim = 3
act_dim = 1
workers = 2

[task.ensemble]
hidden = [8]
members = 2
clipping = "flat"
epochs = 1
batch_size = 32

[task.policy]
uncertainty = "max-pairwise-diff"
lambda = 1.0
rollout_length = 2
epochs = 2
updates_per_epoch = 4
rollout_batch = 8
batch_size = 8
hidden = [8]
eval_episodes = 2
"#;

#[test]
fn a_gymnasium_primorl_run_has_its_policy_curve_evaluated_by_fedrl_run() {
    if !venv() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let file = write(dir.path(), "primorl-gym.toml", SCENARIO);
    let out = dir.path().join("out");
    let o = Command::new(exe())
        .arg("run")
        .arg(&file)
        .arg("--out")
        .arg(&out)
        .env("FEDRL_DATA_DIR", &data)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "fedrl run failed: {err}\n{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(err.contains("through the Gymnasium bridge"), "{err}");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    check_report_schema(&r);
    let fe = &r["final_evaluation"];
    assert_eq!(fe["deferred"], true, "{fe}");
    assert!(fe.get("final_eval_error").is_none(), "{fe}");
    assert!(fe.get("policy_error").is_none(), "{fe}");
    let curve = fe["policy_curve"].as_array().unwrap();
    assert_eq!(curve.len(), 2, "{fe}");
    for e in curve {
        // Pendulum's reward is in [-16.3, 0] a step, 200 steps an episode.
        let ret = e["eval_return"].as_f64().unwrap();
        assert!((-3300.0..=0.0).contains(&ret), "{e}");
        assert_eq!(e["eval_episodes"], 2, "{e}");
        let norm = e["normalized_return"].as_f64().unwrap();
        assert!(
            (norm - (ret + 1500.0) / 1.5).abs() < 1e-6,
            "Pendulum's normalisation: {e}"
        );
        assert!(e["eval_return_std"].as_f64().unwrap() >= 0.0);
    }
    // The aggregator's rule: the last epoch's policy is the result.
    assert_eq!(fe["final_eval_return"], curve[1]["eval_return"], "{fe}");
    assert_eq!(fe["final_eval_return_std"], curve[1]["eval_return_std"]);
    assert_eq!(fe["final_normalized_return"], curve[1]["normalized_return"]);
    assert_eq!(fe["final_eval_episodes"], 2);
    // The operator's report carries the same figures; the snapshots stay in the state folder.
    let op: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("operator").join("report.json")).unwrap())
            .unwrap();
    assert_eq!(
        op["final_evaluation"]["final_eval_return"],
        fe["final_eval_return"]
    );
    assert!(
        out.join("state")
            .join("policy_actors.safetensors")
            .is_file()
    );
    // The dataset was made through the bridge and records the workers' spaces.
    let stored: Vec<_> = std::fs::read_dir(data.join("continuous"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert!(
        stored[0].starts_with("gymnasium_pendulum_v1-"),
        "{stored:?}"
    );
}
