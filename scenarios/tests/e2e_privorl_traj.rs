//! PrivORL-j (`level = "trajectory"`) end to end on a tiny scenario (seconds in a debug build):
//! `fedrl run` pre-trains the fragment synthesizer on public episodes, fine-tunes it by
//! trajectory-level DP-SGD (each episode a unit, its fragments one clipped contribution) in the
//! central mode's summed path and in the federated mode, generates whole trajectories, evaluates
//! and publishes them with the run's epsilon and delta. The plan is the dp_accounting reference
//! vector of `e2e_privorl.rs` (z = 4.045, q = 0.494044, 64 steps, delta 1e-6), so the ledger's
//! epsilon is checked against that independent accountant at trajectory level too.

mod e2e_support;

use std::path::Path;
use std::process::Command;

use e2e_support::*;
use fedrl_common::privacy::ledger::PrivacyLedger;

fn scenario(mode: &str) -> String {
    format!(
        r#"
name = "e2e-privorl-traj-{mode}"
seed = 5
rounds = 64
users = 30
client_agents = 2
participation = {{ kind = "sampled", rate = 0.494044 }}
round_deadline_s = 60.0
start_timeout_s = 120.0
clip_norm = 1.0
noise_multiplier = 4.045
delta = 1e-6
target_epsilon = 10.0
unit_kind = "trajectory"
checkpoint_every = 20

[task]
kind = "privorl"
level = "trajectory"
mode = "{mode}"
eval_every = 16

[task.trajectory]
units = 30
holdout = 12
synthetic = 6
horizon = 8
max_length = 40

[task.dataset]
env = "CartPole-v1"
units = 45
behaviour = {{ kind = "random" }}

[task.public]
env = "cartpole-b1"
units = 10
seed = 3
behaviour = {{ kind = "random" }}

[task.synth]
width = 16
blocks = 1
dim_t = 8
fourier_dim = 4
sample_steps = 4
batch_size = 32

[task.pretrain]
epochs = 2
pool_size = 16

[task.utility]
steps = 20
seeds = 1
eval_episodes = 2
eval_max_steps = 50
cql = {{ hidden = [8], batch_size = 16 }}
"#
    )
}

fn run(dir: &Path, data: &Path, mode: &str) -> (std::path::PathBuf, serde_json::Value) {
    run_text(dir, data, mode, &scenario(mode))
}

/// Runs `text` (a variant of [`scenario`] in `mode`) and checks what every trajectory-level
/// run must give.
fn run_text(
    dir: &Path,
    data: &Path,
    mode: &str,
    text: &str,
) -> (std::path::PathBuf, serde_json::Value) {
    let file = write(dir, &format!("{mode}.toml"), text);
    let out = dir.join(mode);
    let o = Command::new(exe())
        .arg("run")
        .arg(&file)
        .arg("--out")
        .arg(&out)
        .env("FEDRL_DATA_DIR", data)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "fedrl run ({mode}) failed: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("privorl: pre-training"), "{err}");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    check_report_schema(&r);
    let fe = &r["final_evaluation"];
    assert!(fe.get("final_eval_error").is_none(), "{fe}");
    assert_eq!(fe["level"], "trajectory", "{fe}");
    assert_eq!(
        fe["finetune"]["steps"], 64,
        "every released round is applied"
    );
    let m = r["fidelity"]["marginal"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&m), "{m}");
    assert!(r["utility"]["synthetic"]["return"].as_f64().unwrap() > 0.0);
    assert!(r["utility"]["real_reference"]["return"].as_f64().unwrap() > 0.0);
    // Whole trajectories, each at most max_length transitions.
    let t = &fe["trajectories"];
    assert_eq!(t["synthetic"], 6, "{t}");
    let len = t["synthetic_mean_length"].as_f64().unwrap();
    assert!((1.0..=40.0).contains(&len), "{t}");
    for phase in ["pretraining", "finetuning", "sampling", "downstream"] {
        let s = fe["phase_seconds"][phase].as_f64().unwrap_or(-1.0);
        assert!(s > 0.0, "phase {phase}: {}", fe["phase_seconds"]);
    }
    // Accounted round by round at trajectory level; the epsilon against dp_accounting's PLD.
    let ledger = PrivacyLedger::read_file(out.join("operator").join("privacy.ledger")).unwrap();
    assert_eq!(ledger.records().len(), 64);
    assert!(ledger.records().iter().all(|x| x.sampled_by_aggregator));
    assert_eq!(ledger.config.unit_kind.to_string(), "trajectory");
    let eps = r["epsilon"].as_f64().unwrap();
    let reference = 4.965254094152048;
    assert!(
        ((eps - reference) / reference).abs() < 5e-3,
        "ledger epsilon {eps}, dp_accounting {reference}"
    );
    // The release: episodes (trajectories, not one-step transitions) with the run's privacy.
    let syn = &r["synthetic_dataset"];
    assert_eq!(syn["privacy"]["epsilon"].as_f64(), Some(eps));
    assert_eq!(syn["privacy"]["unit"], "trajectory");
    let id = syn["ids"][0].as_str().unwrap();
    let d = fedrl_rl::offline::minari::read(&out.join("synthetic").join(id))
        .unwrap()
        .dataset;
    assert_eq!(d.episodes.len(), 6);
    let steps: usize = d.episodes.iter().map(|e| e.len()).sum();
    assert!(d.episodes.iter().all(|e| (1..=40).contains(&e.len())));
    assert_eq!(
        steps as u64,
        r["fidelity"]["synthetic_transitions"].as_u64().unwrap(),
        "the evaluated transitions are the released ones"
    );
    (out, r)
}

#[test]
fn a_tiny_trajectory_level_run_releases_evaluated_trajectories() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let (out, r) = run(dir.path(), &data, "central");
    assert!(r["fidelity"]["correlation"].as_f64().is_some(), "{r}");
    assert!(out.join("privorl_curve.png").exists(), "the run's plot");
    // The membership audit (central mode default) scores trajectories: operator-only.
    assert!(r.get("model_audit").is_none(), "{r}");
    let op: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("operator").join("report.json")).unwrap())
            .unwrap();
    let mia = &op["model_audit"]["membership"];
    assert_eq!(mia["unit"], "trajectory", "{op}");
    assert_eq!(mia["members"], 12, "min(units, held-out episodes): {op}");
    assert_eq!(mia["members"], mia["non_members"]);
    let auc = mia["auc"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&auc));
}

/// The paper's fragment denoiser, a transformer over the fragment's transitions (here one tiny
/// layer): pre-trained, fine-tuned by trajectory-level DP-SGD and sampled end to end.
#[test]
fn the_transformer_fragment_denoiser_runs_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let text = scenario("central").replace(
        "[task.synth]\n",
        "[task.synth]\nnet = \"transformer\"\ntransformer = { width = 16, layers = 1, heads = 2, ff_mult = 2 }\n",
    );
    assert!(text.contains("transformer"));
    let (out, r) = run_text(dir.path(), &data, "transformer", &text);
    assert!(r["fidelity"]["correlation"].as_f64().is_some(), "{r}");
    assert!(out.join("privorl_curve.png").exists());
}

/// The federated mode: the agents compute each sampled trajectory's clipped contribution
/// themselves (the same computation as the central aggregator's per-unit path).
#[test]
fn the_federated_trajectory_mode_fine_tunes_on_the_agents() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let (out, _) = run(dir.path(), &data, "federated");
    let op: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("operator").join("report.json")).unwrap())
            .unwrap();
    assert!(op.get("model_audit").is_none(), "{op}");
}

/// Continuous actions at trajectory level: Pendulum episodes as units (packed on the data
/// plane), whole trajectories released in the continuous format, TD3+BC's utility.
#[test]
fn a_tiny_pendulum_trajectory_run_releases_continuous_trajectories() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let text = r#"
name = "e2e-privorl-traj-pendulum"
seed = 7
rounds = 8
users = 6
client_agents = 2
participation = { kind = "sampled", rate = 0.5 }
round_deadline_s = 60.0
start_timeout_s = 120.0
clip_norm = 1.0
noise_multiplier = 2.0
delta = 1e-5
target_epsilon = 10.0
unit_kind = "trajectory"

[task]
kind = "privorl"
level = "trajectory"
mode = "central"
eval_every = 4

[task.trajectory]
units = 6
holdout = 2
synthetic = 2
horizon = 16
max_length = 40

[task.continuous.dataset]
env = "Pendulum-v1"
units = 8
seed = 1
behaviour = { kind = "random" }

[task.continuous.public]
env = "pendulum-gml"
units = 2
seed = 2
behaviour = { kind = "random" }

[task.synth]
width = 16
blocks = 1
dim_t = 8
fourier_dim = 4
sample_steps = 4
batch_size = 32

[task.pretrain]
epochs = 2
pool_size = 16

[task.utility]
seeds = 1
eval_episodes = 2
td3bc = { steps = 20, batch = 16, hidden = [8] }
"#;
    let file = write(dir.path(), "pendulum.toml", text);
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
    // The run's summary (stdout) names the learner; the aggregator's own TD3+BC progress goes
    // to its log, which `fedrl run`'s stderr does not always carry.
    let out_text = String::from_utf8_lossy(&o.stdout);
    assert!(out_text.contains("TD3+BC"), "{out_text}\n{err}");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    let fe = &r["final_evaluation"];
    assert!(fe.get("final_eval_error").is_none(), "{fe}");
    assert_eq!(fe["trajectories"]["synthetic"], 2, "{fe}");
    assert!(r["utility"]["random_return"].as_f64().is_some(), "{r}");
    assert_eq!(r["synthetic_dataset"]["privacy"]["unit"], "trajectory");
    let id = r["synthetic_dataset"]["ids"][0].as_str().unwrap();
    assert!(id.starts_with("continuous/"), "{id}");
    let path = out.join("synthetic").join(format!("{id}.safetensors"));
    let d = fedrl_rl::offline::continuous::ContinuousDataset::load(&path).unwrap();
    assert_eq!(d.episodes.len(), 2);
    assert!(d.episodes.iter().all(|e| (1..=40).contains(&e.len())));
    assert!(
        d.episodes
            .iter()
            .flat_map(|e| &e.actions)
            .all(|a| (-2.0..=2.0).contains(a)),
        "actions clipped into the box"
    );
}
