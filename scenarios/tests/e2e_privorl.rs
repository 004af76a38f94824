//! PrivORL-n end to end on a tiny scenario (seconds in a debug build): `fedrl run` pre-trains
//! the synthesizer on public data, fine-tunes it by transition-level DP-SGD in the central mode
//! (summed path), samples and evaluates the synthetic dataset, and publishes it with its
//! epsilon and delta; the report carries fidelity and utility, the released dataset opens and
//! `fedrl data list` lists it. Its plan is one of the reference vectors of Google's
//! dp_accounting (`testdata/dp_accounting_vectors.json`: z = 4.045, q = 0.494044, 64 steps,
//! delta 1e-6), so the ledger's epsilon is checked against that independent accountant.

mod e2e_support;

use std::path::Path;
use std::process::Command;

use e2e_support::*;
use fedrl_common::privacy::ledger::PrivacyLedger;

fn scenario(mode: &str) -> String {
    format!(
        r#"
name = "e2e-privorl-{mode}"
seed = 5
rounds = 64
users = 120
client_agents = 2
participation = {{ kind = "sampled", rate = 0.494044 }}
round_deadline_s = 60.0
start_timeout_s = 120.0
clip_norm = 1.0
noise_multiplier = 4.045
delta = 1e-6
target_epsilon = 10.0
unit_kind = "transition"
checkpoint_every = 20

[task]
kind = "privorl"
mode = "{mode}"
transitions = 120
holdout_transitions = 80
synthetic_transitions = 60
eval_every = 16

[task.dataset]
env = "CartPole-v1"
units = 20
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
eval_episodes = 2
eval_max_steps = 50
cql = {{ hidden = [8], batch_size = 16 }}
"#
    )
}

fn run(dir: &Path, data: &Path, mode: &str) -> std::path::PathBuf {
    let file = write(dir, &format!("{mode}.toml"), &scenario(mode));
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
    out
}

#[test]
fn a_tiny_privorl_run_releases_an_evaluated_synthetic_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let out = run(dir.path(), &data, "central");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    check_report_schema(&r);
    let fe = &r["final_evaluation"];
    assert!(fe.get("final_eval_error").is_none(), "{fe}");
    let m = r["fidelity"]["marginal"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&m), "{m}");
    assert!(r["fidelity"]["correlation"].as_f64().is_some(), "{r}");
    assert!(r["utility"]["synthetic"]["return"].as_f64().unwrap() > 0.0);
    // Three CQL trainings per dataset by default, their mean the utility.
    let seeds = r["utility"]["synthetic"]["return_per_seed"]
        .as_array()
        .unwrap();
    assert_eq!(seeds.len(), 3, "{r}");
    let mean = seeds.iter().map(|x| x.as_f64().unwrap()).sum::<f64>() / 3.0;
    assert!((mean - r["utility"]["synthetic"]["return"].as_f64().unwrap()).abs() < 1e-9);
    assert!(r["utility"]["real_reference"]["return"].as_f64().unwrap() > 0.0);
    assert!(r["utility"]["percent_of_real"].as_f64().is_some());
    assert_eq!(
        fe["finetune"]["steps"], 64,
        "every released round is applied"
    );
    // Every phase has its wall clock, and together they fit in the run's.
    let phases = &fe["phase_seconds"];
    let mut total = 0.0;
    for phase in ["pretraining", "finetuning", "sampling", "downstream"] {
        let s = phases[phase].as_f64().unwrap_or(-1.0);
        assert!(s > 0.0, "phase {phase}: {phases}");
        total += s;
    }
    let wall = r["wall_seconds"].as_f64().unwrap();
    assert!(
        total <= wall + 1.0,
        "phases {total} s, run {wall} s: {phases}"
    );
    // Every round went through the summed path, accounted at transition level.
    let ledger = PrivacyLedger::read_file(out.join("operator").join("privacy.ledger")).unwrap();
    assert_eq!(ledger.records().len(), 64);
    assert!(ledger.records().iter().all(|x| x.sampled_by_aggregator));
    assert_eq!(ledger.config.unit_kind.to_string(), "transition");
    // The ledger's epsilon against dp_accounting's PLD for the same plan (its exact noise is
    // calibrated to a sensitivity a few grid units larger than C: relative ~1e-6).
    assert!(out.join("privorl_curve.png").exists(), "the run's plot");
    let eps = r["epsilon"].as_f64().unwrap();
    let reference = 4.965254094152048;
    assert!(
        ((eps - reference) / reference).abs() < 5e-3,
        "ledger epsilon {eps}, dp_accounting {reference}"
    );

    // The release: a Minari dataset with the run's epsilon and delta, listed and readable.
    let syn = &r["synthetic_dataset"];
    assert_eq!(syn["privacy"]["epsilon"].as_f64(), Some(eps));
    assert_eq!(syn["privacy"]["unit"], "transition");
    let id = syn["ids"][0].as_str().unwrap();
    let root = out.join("synthetic");
    let listed = fedrl_json(&[
        "data",
        "list",
        "--json",
        "--data-dir",
        root.to_str().unwrap(),
    ]);
    assert!(listed.to_string().contains(id), "{listed}");
    let d = fedrl_rl::offline::minari::read(&root.join(id))
        .unwrap()
        .dataset;
    assert_eq!(d.episodes.len(), 60);
    assert_eq!(d.n_actions, 2);
    // CartPole's reward is 1 on every public transition: the release snaps it there (the
    // model's raw values scatter around 1), and reports which entry it snapped and each
    // entry's marginal score ([s (4), a (2), r, s' (4), done]: the reward is entry 6).
    assert_eq!(
        r["fidelity"]["snapped_entries"],
        serde_json::json!([6]),
        "{r}"
    );
    assert!(
        d.episodes
            .iter()
            .all(|e| e.rewards.iter().all(|&x| x == 1.0)),
        "every released reward is the public value 1"
    );
    let per = r["fidelity"]["marginal_per_entry"].as_array().unwrap();
    assert_eq!(per.len(), 12);
    assert_eq!(
        per[6].as_f64(),
        Some(1.0),
        "the snapped reward matches exactly"
    );
    let meta: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root.join(id).join("data").join("metadata.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(meta["fedrl_privacy"]["epsilon"].as_f64(), Some(eps));
    assert_eq!(meta["fedrl_privacy"]["delta"], r["delta"]);

    // The membership audit (on by default in the central mode) scores the units' own
    // transitions: in the operator's report only.
    assert!(r.get("model_audit").is_none(), "{r}");
    let op: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("operator").join("report.json")).unwrap())
            .unwrap();
    let mia = &op["model_audit"]["membership"];
    assert!(mia["members"].as_u64().unwrap() > 0, "{op}");
    assert_eq!(mia["members"], mia["non_members"]);
    for k in ["tpr_at_10pct_fpr", "tpr_at_1pct_fpr", "auc"] {
        let v = mia[k].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&v), "{k} {v}");
    }
}

/// The federated mode: the agents compute the sampled units' clipped gradients themselves (the
/// same function as the central mode's per-unit path) and send them; the run releases and
/// evaluates a synthetic dataset the same way, accounted round by round.
#[test]
fn the_federated_mode_fine_tunes_on_the_agents() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let out = run(dir.path(), &data, "federated");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    assert!(
        r["final_evaluation"].get("final_eval_error").is_none(),
        "{r}"
    );
    assert_eq!(r["final_evaluation"]["finetune"]["steps"], 64);
    assert!(r["fidelity"]["marginal"].as_f64().is_some());
    let ledger = PrivacyLedger::read_file(out.join("operator").join("privacy.ledger")).unwrap();
    assert_eq!(ledger.records().len(), 64);
    assert_eq!(r["synthetic_dataset"]["privacy"]["unit"], "transition");
    // Off by default here: the units' transitions live on the agents.
    let op: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("operator").join("report.json")).unwrap())
            .unwrap();
    assert!(op.get("model_audit").is_none(), "{op}");
}
