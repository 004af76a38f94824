//! Offline CQL by DP-SGD end to end, in both update modes (DESIGN §2.5): the same seeded
//! scenario run `federated` (the agents compute the sampled units' clipped gradients and send
//! them over QUIC) and `central` (the agents upload their units' data once; the aggregator
//! computes the gradients) draws the same Poisson samples, records the same ledger and releases
//! the same Q-network to float tolerance after 50 DP-SGD steps, when the central mode takes the
//! per-unit path (`central_path = "per_unit"`). Its default, the summed path (issue 55 §3),
//! draws the same samples and records the same mechanism with the summed path's slightly larger
//! sensitivity, its noise calibrated to it.

mod e2e_support;

use std::path::Path;
use std::process::Command;

use e2e_support::*;
use fedrl_common::privacy::ledger::PrivacyLedger;
use fedrl_rl::candle_core::{Device, safetensors};

fn scenario(mode: &str, central_path: &str) -> String {
    format!(
        r#"
name = "e2e-offline-{mode}-{central_path}"
seed = 11
rounds = 50
users = 24
client_agents = 2
participation = {{ kind = "sampled", rate = 0.25 }}
round_deadline_s = 60.0
start_timeout_s = 120.0
clip_norm = 1.0
noise_multiplier = 1.0
target_epsilon = 1000.0
unit_kind = "trajectory"
checkpoint_every = 20

[task]
kind = "offline_cql"
mode = "{mode}"
central_path = "{central_path}"
transitions_per_unit = 2
eval_every = 1000
eval_episodes = 1
final_eval_episodes = 2

[task.dataset]
env = "CartPole-v1"
units = 24
behaviour = {{ kind = "random" }}

[task.cql]
hidden = [16]
learning_rate = 1e-3
target_update_interval = 10
"#
    )
}

/// Runs the scenario in `mode` (and `central_path`) into `dir/mode-path` with the dataset cache
/// at `data`.
fn run(dir: &Path, data: &Path, mode: &str, central_path: &str) -> std::path::PathBuf {
    let name = format!("{mode}-{central_path}");
    let file = write(dir, &format!("{name}.toml"), &scenario(mode, central_path));
    let out = dir.join(&name);
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
    out
}

fn q_network(out: &Path) -> Vec<(String, Vec<f32>)> {
    let tensors = safetensors::load(out.join("q_network.safetensors"), &Device::Cpu).unwrap();
    let mut named: Vec<(String, Vec<f32>)> = tensors
        .into_iter()
        .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

#[test]
fn federated_and_central_modes_release_the_same_q_network() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let fed = run(dir.path(), &data, "federated", "summed");
    let cen = run(dir.path(), &data, "central", "per_unit");
    let sum = run(dir.path(), &data, "central", "summed");

    // The same 50 rounds, the same Poisson samples (operator-only unit lists), the same events.
    let lf = PrivacyLedger::read_file(fed.join("operator").join("privacy.ledger")).unwrap();
    let lc = PrivacyLedger::read_file(cen.join("operator").join("privacy.ledger")).unwrap();
    let (rf, rc) = (lf.records(), lc.records());
    assert_eq!(rf.len(), 50);
    assert_eq!(rc.len(), 50);
    for (a, b) in rf.iter().zip(&rc) {
        assert_eq!(a.round, b.round);
        assert_eq!(a.units, b.units, "round {}: different samples", a.round);
        assert_eq!(a.event, b.event);
        assert!(a.sampled_by_aggregator && b.sampled_by_aggregator);
    }
    assert!(
        rf.iter().map(|r| r.units.len()).sum::<usize>() > 100,
        "the samples must not be empty"
    );

    // The same released parameters up to float rounding (the gradients are batched differently).
    let (qf, qc) = (q_network(&fed), q_network(&cen));
    assert_eq!(
        qf.iter().map(|(k, v)| (k, v.len())).collect::<Vec<_>>(),
        qc.iter().map(|(k, v)| (k, v.len())).collect::<Vec<_>>()
    );
    let mut worst = 0f32;
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fed.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["rounds_completed"], 50, "{report}");
    check_report_schema(&report);
    // Issue 58: `fedrl eval RUN_DIR` finds the run's Q-network and its environment.
    let v = fedrl_json(&["eval", fed.to_str().unwrap(), "--episodes", "2", "--json"]);
    assert_eq!(v["episodes"], 2, "{v}");
    assert!(
        v["policy"]
            .as_str()
            .unwrap()
            .ends_with("q_network.safetensors"),
        "{v}"
    );
    for ((_, a), (_, b)) in qf.iter().zip(&qc) {
        for (x, y) in a.iter().zip(b) {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(
        worst < 1e-4,
        "federated and central differ by up to {worst}"
    );

    // The central run refused nothing and its report names the mode's work.
    let op: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(cen.join("operator").join("report.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(op["updates_rejected"], 0, "{op}");
    assert!(
        op["timings"]["central_compute_s"].as_f64().unwrap() > 0.0,
        "{op}"
    );

    // The summed path: the same samples, the same mechanism with a slightly larger recorded
    // sensitivity (the rounding of the one quantised sum), and sigma calibrated to it.
    let ls = PrivacyLedger::read_file(sum.join("operator").join("privacy.ledger")).unwrap();
    let rs = ls.records();
    assert_eq!(rs.len(), 50);
    let leaf = |e: &fedrl_common::privacy::DpEvent| match e {
        fedrl_common::privacy::DpEvent::PoissonSampled { event, .. } => match **event {
            fedrl_common::privacy::DpEvent::DiscreteGaussian {
                sigma,
                l2_sensitivity,
            } => (sigma, l2_sensitivity),
            ref other => panic!("not a discrete Gaussian: {other:?}"),
        },
        other => panic!("not a sampled event: {other:?}"),
    };
    for (a, b) in rf.iter().zip(&rs) {
        assert_eq!(a.units, b.units, "round {}: different samples", a.round);
        let ((sf, df), (ss, ds)) = (leaf(&a.event), leaf(&b.event));
        assert!(ds > df && ds < df * (1.0 + 1e-3), "{df} vs {ds}");
        assert!(
            ss / ds >= 1.0 && sf / df >= 1.0,
            "z = 1 holds for the recorded sensitivity"
        );
    }
    let op: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(sum.join("operator").join("report.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(op["updates_rejected"], 0, "{op}");
    let qs = q_network(&sum);
    assert!(qs.iter().all(|(_, v)| v.iter().all(|x| x.is_finite())));
    assert_ne!(qs, qc, "the summed path's noise is calibrated differently");

    // Issue 58: the summed path's training loss (a statistic of the units' data) is in the
    // operator's lines only; the federated run has none (clients send no losses), but both
    // have the accepted updates' norms, operator-only too.
    let rows = |out: &Path, operator: bool| -> Vec<serde_json::Value> {
        let dir = if operator {
            out.join("operator")
        } else {
            out.to_path_buf()
        };
        metrics(&dir)
            .into_iter()
            .filter(|r| r["status"] == "released")
            .collect()
    };
    let summed_op = rows(&sum, true);
    assert_eq!(summed_op.len(), 50);
    for r in &summed_op {
        let loss = r["operator_diagnostics"]["train_loss"].as_f64();
        assert!(loss.is_some_and(|l| l.is_finite() && l > 0.0), "{r}");
        assert!(
            r["operator_diagnostics"]["unit_norm_mean"]
                .as_f64()
                .is_some(),
            "{r}"
        );
    }
    for r in rows(&fed, true) {
        assert!(r["operator_diagnostics"].get("train_loss").is_none(), "{r}");
        assert!(
            r["operator_diagnostics"]["unit_norm_mean"]
                .as_f64()
                .is_some(),
            "{r}"
        );
    }
    for out in [&fed, &cen, &sum] {
        for r in rows(out, false) {
            assert!(r.get("operator_diagnostics").is_none(), "{r}");
            let d = r["diagnostics"].as_object().unwrap();
            assert!(d["update_norm"].as_f64().is_some(), "{r}");
            assert!(!d.contains_key("train_loss") && !d.contains_key("unit_norm_mean"));
            // One DP step per released round (all 50 released), at the Adam learning rate.
            assert_eq!(d["dp_steps"], r["round"], "{r}");
            assert!(d["server_lr"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
}

/// Issue 59, item 7: `fedrl eval` could not read offline CQL's `q_network.safetensors` ("no
/// fedrl.model_spec"); it now reads its shape from the tensors and acts greedily in it.
#[test]
fn fedrl_eval_reads_an_offline_cql_q_network() {
    use fedrl_rl::offline::qnet::QNetSpec;
    let dir = tempfile::tempdir().unwrap();
    let spec = QNetSpec {
        obs_dim: 4,
        hidden: vec![8, 6],
        n_actions: 2,
    };
    let params: Vec<f32> = (0..spec.dim())
        .map(|i| ((i * 37 % 17) as f32 - 8.0) / 20.0)
        .collect();
    let path = dir.path().join("q_network.safetensors");
    spec.save(&path, &params).unwrap();
    let (read, back) = QNetSpec::load_file(&path).unwrap();
    assert_eq!((read, back), (spec.clone(), params.clone()));
    let v = fedrl_json(&[
        "eval",
        "--policy",
        path.to_str().unwrap(),
        "--env",
        "CartPole-v1",
        "--episodes",
        "3",
        "--json",
    ]);
    assert_eq!(v["episodes"], 3, "{v}");
    let want =
        fedrl_rl::offline::train::evaluate_greedy_for(&spec, &params, "CartPole-v1", 3, 0, 0)
            .unwrap();
    assert!(
        (v["mean_return"].as_f64().unwrap() - want.mean).abs() < 1e-9,
        "{v}"
    );
    // A file that is none of the three kinds still says what it expected.
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a policy").unwrap();
    let (code, _, stderr) = fedrl_output(&[
        "eval",
        "--policy",
        junk.to_str().unwrap(),
        "--env",
        "CartPole-v1",
    ]);
    assert_ne!(code, 0);
    assert!(stderr.contains("offline CQL Q-network"), "{stderr}");
}
