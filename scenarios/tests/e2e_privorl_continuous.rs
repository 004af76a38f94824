//! PrivORL-n on continuous control end to end, on a tiny Pendulum scenario (seconds in a debug
//! build): the sensitive data a Pendulum-v1 dataset of the continuous format, the public data
//! Pendulum with other gravity, mass and length (`pendulum-gml`); `fedrl run` pre-trains,
//! fine-tunes in the central mode's summed path with the continuous transitions packed on the
//! data plane, and releases a continuous-format dataset with the run's epsilon and delta that
//! `fedrl data list` lists; the report's utility is TD3+BC's.

mod e2e_support;

use std::process::Command;

use e2e_support::*;
use fedrl_rl::offline::continuous::ContinuousDataset;

const SCENARIO: &str = r#"
name = "e2e-privorl-pendulum"
seed = 7
rounds = 16
users = 120
client_agents = 2
participation = { kind = "sampled", rate = 0.25 }
round_deadline_s = 60.0
start_timeout_s = 120.0
clip_norm = 1.0
noise_multiplier = 2.0
delta = 1e-5
target_epsilon = 10.0
unit_kind = "transition"

[task]
kind = "privorl"
mode = "central"
transitions = 120
holdout_transitions = 80
synthetic_transitions = 60
eval_every = 8

[task.continuous.dataset]
env = "Pendulum-v1"
units = 2
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
seeds = 2
eval_episodes = 2
td3bc = { steps = 20, batch = 16, hidden = [8] }
"#;

#[test]
fn a_tiny_pendulum_run_releases_a_continuous_dataset_evaluated_by_td3bc() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let file = write(dir.path(), "pendulum.toml", SCENARIO);
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
    assert!(err.contains("privorl: pre-training"), "{err}");
    // The run's summary (stdout) names the learner; the aggregator's own TD3+BC progress goes
    // to its log, which `fedrl run`'s stderr does not always carry.
    let out_text = String::from_utf8_lossy(&o.stdout);
    assert!(out_text.contains("TD3+BC"), "{out_text}\n{err}");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    check_report_schema(&r);
    let fe = &r["final_evaluation"];
    assert!(fe.get("final_eval_error").is_none(), "{fe}");
    assert_eq!(
        fe["finetune"]["steps"], 16,
        "every released round is applied"
    );
    for k in ["marginal", "correlation"] {
        let v = r["fidelity"][k].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&v), "{k} {v}");
    }
    // The utility is TD3+BC's: two trainings per dataset, Pendulum's (negative) returns, and
    // the share of the reference normalised by random actions' return.
    let u = &r["utility"];
    assert!(u["learner"].as_str().unwrap().starts_with("TD3+BC"), "{u}");
    let syn = &u["synthetic"];
    assert_eq!(syn["td3bc_seeds"], 2, "{u}");
    let per_seed: Vec<f64> = syn["return_per_seed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(per_seed.len(), 2);
    let mean = per_seed.iter().sum::<f64>() / 2.0;
    assert!((mean - syn["return"].as_f64().unwrap()).abs() < 1e-9);
    // Pendulum's reward is in [-16.3, 0] a step, 200 steps an episode.
    for ret in per_seed {
        assert!((-3300.0..=0.0).contains(&ret), "{ret}");
    }
    let real = u["real_reference"]["return"].as_f64().unwrap();
    let random = u["random_return"].as_f64().unwrap();
    assert!((-3300.0..0.0).contains(&random), "{random}");
    let pct = u["percent_of_real"].as_f64().unwrap();
    assert!(
        (pct - 100.0 * (mean - random) / (real - random)).abs() < 1e-6,
        "{u}"
    );
    assert_eq!(u["synthetic"]["transitions"], 60);
    assert_eq!(u["real_reference"]["transitions"], 80);

    // The release: a continuous-format file listed by `fedrl data list`, with the run's epsilon
    // and delta in its metadata and beside it.
    let eps = r["epsilon"].as_f64().unwrap();
    assert!(eps > 0.0 && eps <= 10.0, "{eps}");
    let s = &r["synthetic_dataset"];
    assert_eq!(s["privacy"]["epsilon"].as_f64(), Some(eps));
    assert_eq!(s["privacy"]["unit"], "transition");
    let id = s["ids"][0].as_str().unwrap();
    assert_eq!(id, "continuous/privorl-pendulum-v1-synthetic-v0");
    let root = out.join("synthetic");
    let listed = fedrl_json(&[
        "data",
        "list",
        "--json",
        "--data-dir",
        root.to_str().unwrap(),
    ]);
    assert!(listed.to_string().contains(id), "{listed}");
    let path = root
        .join("continuous")
        .join("privorl-pendulum-v1-synthetic-v0.safetensors");
    assert!(
        fedrl_rl::offline::continuous::verify_content(&path).unwrap(),
        "its digest is recorded"
    );
    let d = ContinuousDataset::load(&path).unwrap();
    assert_eq!(d.meta.env_id, "Pendulum-v1");
    assert_eq!((d.meta.obs_dim, d.meta.act_dim), (3, 1));
    assert_eq!(d.episodes.len(), 60);
    for e in &d.episodes {
        assert_eq!(e.len(), 1);
        assert_eq!(e.observations.len(), 6);
        // Actions are clipped into Pendulum's box.
        assert!((-2.0..=2.0).contains(&e.actions[0]), "{:?}", e.actions);
    }
    let p = &d.meta.procedure["fedrl_privacy"];
    assert_eq!(p["epsilon"].as_f64(), Some(eps));
    assert_eq!(p["delta"], r["delta"]);
    let summary = fedrl_json(&["data", "summary", "--json", path.to_str().unwrap()]);
    assert_eq!(summary["summary"]["act_dim"], 1, "{summary}");

    // The membership audit runs on the continuous rows as on discrete ones (operator-only).
    let op: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("operator").join("report.json")).unwrap())
            .unwrap();
    let mia = &op["model_audit"]["membership"];
    assert!(mia["members"].as_u64().unwrap() > 0, "{op}");
    assert!((0.0..=1.0).contains(&mia["tpr_at_10pct_fpr"].as_f64().unwrap()));
}
