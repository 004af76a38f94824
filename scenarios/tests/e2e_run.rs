//! `fedrl run` end to end: aggregator and client agents as separate processes on loopback;
//! report.json and metrics.jsonl (public) land in the output directory, the ledger and the exact
//! counts under `operator/`.

mod e2e_support;

use std::process::Command;

use e2e_support::*;
use fedrl_common::privacy::ledger::PrivacyLedger;

const SCENARIO: &str = r#"
name = "e2e-run"
seed = 3
rounds = 4
users = 60
client_agents = 2
participation = { kind = "fresh" }
cohort_size = 12
quorum = 8
round_deadline_s = 10.0
clip_norm = 1.0
noise_multiplier = 1.0
target_epsilon = 50.0
checkpoint_every = 2

[task]
kind = "mean_estimation"
dim = 16
"#;

#[test]
fn fedrl_run_writes_report_ledger_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = write(dir.path(), "s.toml", SCENARIO);
    let out = dir.path().join("out");
    let o = Command::new(exe())
        .arg("run")
        .arg(&scenario)
        .arg("--out")
        .arg(&out)
        // Logs at info, so the processes' log files have lines to check for escape codes.
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "fedrl run failed: {stderr}\n{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // Without a terminal the progress bar draws nothing; plain lines say how far it got.
    assert!(stderr.contains("round 4/4: "), "{stderr}");
    let progress: Vec<&str> = stderr.lines().filter(|l| l.starts_with("round ")).collect();
    // One line per tenth at most (4 rounds: each round), none repeated, no exact user count.
    assert!(progress.len() <= 4, "{stderr}");
    assert!(
        progress.iter().all(|l| !l.contains("users")),
        "an exact count in the log: {stderr}"
    );
    // Issue 15: log files are plain text (no ANSI colour codes).
    let agg_log = std::fs::read_to_string(out.join("operator").join("aggregator.log")).unwrap();
    assert!(agg_log.contains("INFO"), "{agg_log}");
    for entry in std::fs::read_dir(out.join("operator")).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(&p).unwrap();
            assert!(!text.contains('\u{1b}'), "{} has escape codes", p.display());
        }
    }
    let read_json = |p: std::path::PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
    };
    let report = read_json(out.join("report.json"));
    let operator = read_json(out.join("operator").join("report.json"));
    for key in [
        "rounds_completed",
        "rounds_abandoned",
        "epsilon",
        "delta",
        "wall_seconds",
    ] {
        assert!(
            report.get(key).is_some(),
            "report.json lacks {key}: {report}"
        );
    }
    assert_eq!(report["rounds_completed"], 4, "{report}");
    assert_eq!(report["rounds_abandoned"], 0, "{report}");
    assert_eq!(report["seeded"], true);
    let eps = report["epsilon"].as_f64().unwrap();
    assert!(eps.is_finite() && eps > 0.0, "{report}");
    // Bodies are read into pooled buffers, one per read permit (8 by default) at most, reused
    // from update to update: memory for bodies does not grow with the updates or the clients.
    assert!(
        operator["updates_accepted"].as_u64().unwrap() >= 32,
        "{operator}"
    );
    let buffers = operator["update_buffers_allocated"].as_u64().unwrap();
    assert!((1..=8).contains(&buffers), "{operator}");
    assert!(operator["users"].as_u64().unwrap() >= 32, "{operator}");
    let (_, records, _) = PrivacyLedger::read(
        out.join("operator")
            .join(fedrl_aggregator::state::LEDGER_FILE),
    )
    .unwrap();
    assert_eq!(records.len(), 4);
    // Fresh participation: no unit appears twice in the whole ledger.
    let mut all: Vec<u64> = records.iter().flat_map(|r| r.units.clone()).collect();
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), n);
    assert!(
        records
            .iter()
            .all(|r| r.expected_cohort == Some(12.0) && r.units.len() >= 8)
    );
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(
        metrics
            .lines()
            .filter(|l| l.contains("\"released\""))
            .count(),
        4
    );
    public_files_hold_no_exact_counts(&out, &report);
    check_report_schema(&report);
    // The estimate approaches the true mean (norm 0.5): the error is well below the mean's norm.
    let err = report["final_evaluation"]["l2_error"].as_f64().unwrap();
    assert!(err < 0.6, "l2 error {err}");
    // Issue 58: one final evaluation, one noise sentence, no duplicates.
    for gone in ["final_eval", "final_eval_return", "noise_sources"] {
        assert!(
            report.get(gone).is_none(),
            "report.json has {gone}: {report}"
        );
    }
    assert!(
        report["noise_source"]
            .as_str()
            .unwrap()
            .contains("scenario's seed 3"),
        "{report}"
    );
    // Every released row has its epsilon, and the CSV has the same rows.
    let rows: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        rows.iter()
            .all(|r| r["status"] != "released" || r["epsilon"].as_f64().is_some()),
        "{metrics}"
    );
    let csv = std::fs::read_to_string(out.join("metrics.csv")).unwrap();
    let header = csv.lines().next().unwrap();
    assert!(header.starts_with("round,status,epsilon,"), "{csv}");
    assert_eq!(csv.lines().count(), rows.len() + 1, "{csv}");
}

/// Issue 58: `--set` overrides a field (written into the stored scenario), a wrong one is a
/// usage error naming it, and `--replicates 2` runs two replicates into rep-0 and rep-1 with a
/// summary report (mean and interval, privacy per replicate) and the mean curve.
#[test]
fn set_and_replicates() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = write(dir.path(), "s.toml", SCENARIO);
    let out = dir.path().join("out");
    let bad = Command::new(exe())
        .args([
            "run",
            scenario.to_str().unwrap(),
            "--set",
            "task.dimm=3",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("--set task.dimm=3: the scenario has no field `task.dimm`"),
        "{stderr}"
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());
    let o = Command::new(exe())
        .args(["run", scenario.to_str().unwrap()])
        .args([
            "--set",
            "rounds=2",
            "--set",
            "task.dim=8",
            "--replicates",
            "2",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "fedrl run failed: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("privacy is per replicate"), "{stdout}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    check_report_schema(&summary);
    assert_eq!(summary["replicates"], 2, "{summary}");
    assert!(
        summary["privacy"]
            .as_str()
            .unwrap()
            .starts_with("per replicate")
    );
    // The scenario seeds its noise: replicate 1 runs on other seeds, replicate 0 on its own.
    assert!(
        summary["seeds"][0].as_object().unwrap().is_empty(),
        "{summary}"
    );
    assert!(summary["seeds"][1]["seed"].as_i64().is_some(), "{summary}");
    assert!(
        summary["seeds"][1]["task.data_seed"].as_i64().is_some(),
        "{summary}"
    );
    for i in 0..2 {
        let rep = out.join(format!("rep-{i}"));
        let stored = std::fs::read_to_string(rep.join("scenario.toml")).unwrap();
        let t: toml::Table = stored.parse().unwrap();
        assert_eq!(t["rounds"].as_integer(), Some(2), "{stored}");
        assert_eq!(t["task"]["dim"].as_integer(), Some(8), "{stored}");
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(rep.join("report.json")).unwrap())
                .unwrap();
        check_report_schema(&r);
        assert_eq!(r["rounds_completed"], 2, "{r}");
        assert_eq!(summary["epsilon"][i], r["epsilon"], "{summary}");
    }
    // The replicates' noise differs (different seeds), so their final errors do too.
    assert_ne!(
        std::fs::read_to_string(out.join("rep-0").join("metrics.jsonl")).unwrap(),
        std::fs::read_to_string(out.join("rep-1").join("metrics.jsonl")).unwrap()
    );
    // A non-private run (here by --set): epsilon is null, not "inf", and it says why.
    let twin = dir.path().join("twin");
    let o = Command::new(exe())
        .args(["run", scenario.to_str().unwrap()])
        .args(["--set", "non_private=true", "--set", "rounds=2", "--out"])
        .arg(&twin)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(twin.join("report.json")).unwrap()).unwrap();
    check_report_schema(&r);
    assert!(r["epsilon"].is_null() && r["epsilon_rdp"].is_null(), "{r}");
    assert!(
        r["noise_source"].as_str().unwrap().starts_with("none"),
        "{r}"
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("epsilon none (non-private)"), "{stdout}");
}

/// Issue 58: `--replicates 2 --twin` runs the twin in each replicate (rep-N/twin) and summarises
/// both; `--resume` reads back a finished replicate without re-running it, starts the missing
/// one, and refuses a changed scenario.
#[test]
fn replicates_with_a_twin_resume() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = write(dir.path(), "s.toml", SCENARIO);
    let twin = write(
        dir.path(),
        "twin.toml",
        &SCENARIO.replace(
            "name = \"e2e-run\"",
            "name = \"e2e-twin\"\nnon_private = true",
        ),
    );
    let out = dir.path().join("out");
    let run = |extra: &[&str]| {
        Command::new(exe())
            .args(["run", scenario.to_str().unwrap(), "--set", "rounds=2"])
            .args(["--replicates", "2", "--out"])
            .arg(&out)
            .args(extra)
            .output()
            .unwrap()
    };
    let o = run(&["--twin", twin.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&read(out.join("report.json"))).unwrap();
    check_report_schema(&summary);
    assert_eq!(summary["twins"][0]["scenario"], "e2e-twin", "{summary}");
    assert_eq!(
        summary["twins"][0]["replicate_dirs"],
        serde_json::json!(["rep-0/twin", "rep-1/twin"])
    );
    assert!(summary["twins"][0]["epsilon"][1].is_null(), "{summary}");
    assert!(summary["epsilon"][1].as_f64().is_some(), "{summary}");
    for i in 0..2 {
        let r: serde_json::Value =
            serde_json::from_str(&read(out.join(format!("rep-{i}/twin/report.json")))).unwrap();
        // --set is not applied to twins: the twin runs its own 4 rounds.
        assert_eq!(r["rounds_completed"], 4, "{r}");
    }
    // Replicate 1 lost (as if the machine stopped before it began); replicate 0 is kept.
    let rep0 = read(out.join("rep-0").join("metrics.jsonl"));
    std::fs::remove_dir_all(out.join("rep-1")).unwrap();
    std::fs::remove_file(out.join("report.json")).unwrap();
    let changed = run(&["--resume", "--set", "rounds=3"]);
    assert_eq!(changed.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&changed.stderr);
    assert!(stderr.contains("rounds"), "{stderr}");
    let with_twin = run(&["--resume", "--twin", twin.to_str().unwrap()]);
    assert_eq!(with_twin.status.code(), Some(2));
    let o = Command::new(exe())
        .args(["run", "--replicates", "2", "--resume", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("finished before"), "{stderr}");
    assert_eq!(read(out.join("rep-0").join("metrics.jsonl")), rep0);
    let summary: serde_json::Value = serde_json::from_str(&read(out.join("report.json"))).unwrap();
    check_report_schema(&summary);
    assert_eq!(
        summary["twins"][0]["replicate_dirs"][1], "rep-1/twin",
        "{summary}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&read(out.join("rep-1/twin/report.json"))).unwrap();
    assert_eq!(r["rounds_completed"], 4, "{r}");
    // rep-1 ran from the stored scenario: 2 rounds, as the set said at the start.
    let stored: toml::Table = read(out.join("rep-1/scenario.toml")).parse().unwrap();
    assert_eq!(stored["rounds"].as_integer(), Some(2));
}

#[test]
fn bad_scenario_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = write(
        dir.path(),
        "bad.toml",
        "roundz = 3\n[task]\nkind = \"mean_estimation\"\n",
    );
    let o = Command::new(exe())
        .arg("run")
        .arg(&scenario)
        .arg("--out")
        .arg(dir.path().join("o"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("roundz"));
}

/// Finding 4 of the privacy review: the files a user would publish (the output directory's top
/// level) hold DP outputs and configuration only: no exact counts, no unit ids, no ledger.
fn public_files_hold_no_exact_counts(out: &std::path::Path, report: &serde_json::Value) {
    const COUNTS: [&str; 12] = [
        "accepted",
        "clipped",
        "offered",
        "rejected",
        "quorum",
        "users",
        "units",
        "updates_accepted",
        "updates_rejected",
        "bytes_ingested",
        "update_buffers_allocated",
        "client_agents",
    ];
    for key in COUNTS {
        assert!(report.get(key).is_none(), "report.json has {key}: {report}");
    }
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for key in v.as_object().unwrap().keys() {
            assert!(
                [
                    "round",
                    "status",
                    "epsilon",
                    "epsilon_exact",
                    "delta",
                    "eval",
                    "diagnostics",
                    "t_s"
                ]
                .contains(&key.as_str()),
                "metrics.jsonl has {key}: {line}"
            );
        }
        // The public diagnostics are functions of the release only (issue 58).
        if let Some(d) = v.get("diagnostics") {
            for key in d.as_object().unwrap().keys() {
                assert!(
                    ["update_norm", "step_norm", "param_norm", "server_lr"].contains(&key.as_str()),
                    "metrics.jsonl has diagnostics.{key}: {line}"
                );
            }
        }
        if v["status"] == "released" {
            assert!(v["diagnostics"]["update_norm"].as_f64().is_some(), "{line}");
        }
    }
    let operator_metrics =
        std::fs::read_to_string(out.join("operator").join("metrics.jsonl")).unwrap();
    assert!(
        operator_metrics.contains("\"accepted\""),
        "{operator_metrics}"
    );
    // The accepted updates' norms before clipping are operator-only.
    assert!(
        operator_metrics.contains("\"unit_norm_mean\""),
        "{operator_metrics}"
    );
    assert!(!metrics.contains("unit_norm"), "{metrics}");
    // The event files hold the public lines' numbers (the aggregator's tests decode them).
    let events: Vec<_> = std::fs::read_dir(out.join("tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        events.len() == 1 && events[0].starts_with("events.out.tfevents."),
        "{events:?}"
    );
    // Everything at the top level is public, and no unit list is among it.
    let public: Vec<String> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for name in &public {
        assert!(
            [
                "report.json",
                "metrics.jsonl",
                "metrics.csv",
                "scenario.toml",
                "FILES.md",
                "tensorboard",
                "operator",
                "state"
            ]
            .contains(&name.as_str()),
            "unexpected file at the public top level: {name}"
        );
    }
    let guide = std::fs::read_to_string(out.join("FILES.md")).unwrap();
    assert!(guide.contains("operator/privacy.ledger"), "{guide}");
    // Which training diagnostic is public and which operator-only, by kind (issue 58).
    assert!(
        guide.contains("## Training diagnostics") && guide.contains("unit_norm_mean"),
        "{guide}"
    );
    let state_guide = std::fs::read_to_string(out.join("state").join("FILES.md")).unwrap();
    assert!(
        state_guide.contains("operator/metrics.jsonl"),
        "{state_guide}"
    );
}

/// A small private DPPG run on CartPole whose target (a greedy return of 1) any policy reaches.
const DPPG_TARGET: &str = r#"
name = "e2e-dppg-target"
seed = 4
rounds = 6
users = 200
client_agents = 1
participation = { kind = "fresh" }
cohort_size = 16
quorum = 12
round_deadline_s = 60.0
clip_norm = 0.3
noise_multiplier = 1.0
target_epsilon = 50.0
checkpoint_every = 1

[task]
kind = "dppg"
population = "CartPole-v1"
eval_every = 1
eval_users = 4
final_eval_users = 4
stop_at_return = 1.0

[task.local]
hidden = [8]
max_episode_steps = 32
threads = 1
"#;

/// Issue 16's round pipeline: the evaluation of a released model runs while the next round
/// trains, and a target it reaches stops the run at that round: the round opened meanwhile is
/// neither recorded nor released, and the metrics line and the report carry the evaluation.
#[test]
fn a_pipelined_evaluation_stops_the_run_at_the_round_that_reached_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = write(dir.path(), "s.toml", DPPG_TARGET);
    let out = dir.path().join("out");
    let o = Command::new(exe())
        .arg("run")
        .arg(&scenario)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "fedrl run failed: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["rounds_completed"], 1, "{report}");
    assert_eq!(report["outcome"], "finished", "{report}");
    assert!(
        report["finished"]
            .as_str()
            .unwrap()
            .contains("reached its target after round 1"),
        "{report}"
    );
    assert!(
        report["final_evaluation"]["final_eval_return"]
            .as_f64()
            .unwrap()
            >= 1.0
    );
    check_report_schema(&report);
    // Issue 58: `fedrl eval RUN_DIR` plays the run's policy behind the run's environment.
    let (code, stdout, stderr) =
        fedrl_output(&["eval", out.to_str().unwrap(), "--episodes", "2", "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let ev: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(ev["env"], "CartPole-v1", "{ev}");
    assert_eq!(ev["episodes"], 2, "{ev}");
    assert!(
        ev["policy"]
            .as_str()
            .unwrap()
            .ends_with("policy.safetensors"),
        "{ev}"
    );
    let (code, _, stderr) = fedrl_output(&["eval", dir.path().to_str().unwrap()]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("not a fedrl run output directory"),
        "{stderr}"
    );
    let (_, records, _) = PrivacyLedger::read(
        out.join("operator")
            .join(fedrl_aggregator::state::LEDGER_FILE),
    )
    .unwrap();
    assert_eq!(records.len(), 1, "round 2 is not recorded");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["round"], 1);
    assert!(lines[0]["eval"]["eval_return"].as_f64().unwrap() >= 1.0);
    assert!(lines[0]["epsilon"].as_f64().unwrap() > 0.0);
    // Issue 58: the released policy's entropy (two actions: at most ln 2) and its value
    // network's error, measured on the evaluation episodes the server played.
    let h = lines[0]["eval"]["eval_policy_entropy"].as_f64().unwrap();
    assert!(h > 0.0 && h <= 2f64.ln() + 1e-9, "{h}");
    assert!(lines[0]["eval"]["eval_value_rmse"].as_f64().unwrap() >= 0.0);
    assert!(lines[0]["diagnostics"]["server_lr"].as_f64().unwrap() > 0.0);
    let operator: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("operator").join("report.json")).unwrap(),
    )
    .unwrap();
    assert!(operator["timings"]["evaluation_s"].as_f64().unwrap() > 0.0);
    // The client agent counts the updates it uploaded at the clip norm (operator-only).
    let agent = &operator["client_agents"][0]["summary"];
    let clipped = agent["clipped"].as_u64().expect("a clipped count");
    assert!(
        clipped <= agent["updates_sent"].as_u64().unwrap(),
        "{agent}"
    );
}

/// Issue 59, item 5: plans the run cannot carry out are refused when the scenario is loaded,
/// with the numbers, before anything listens (and `--issue-token` refuses them too); a run the
/// scenario allows to end early (`allow_fewer_rounds`) stops when its units run out, says so,
/// and exits 0.
#[test]
fn infeasible_scenarios_are_refused_before_listening() {
    let dir = tempfile::tempdir().unwrap();
    let base = "name = \"short\"\nseed = 5\nclient_agents = 1\nparticipation = { kind = \"fresh\" }\nround_deadline_s = 10.0\nstart_timeout_s = 10.0\ntarget_epsilon = 50.0\n[task]\nkind = \"mean_estimation\"\ndim = 4\n";
    // 20 rounds of 10 under `fresh` need 200 users; 40 stop after 4 rounds.
    let few = write(
        dir.path(),
        "few.toml",
        &format!("rounds = 20\nusers = 40\ncohort_size = 10\nquorum = 5\n{base}"),
    );
    let out = dir.path().join("out-few");
    let (code, stdout, stderr) =
        fedrl_output(&["run", few.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert_ne!(code, 0, "{stderr}");
    assert!(
        stderr.contains("users (40)") && stderr.contains("= 200"),
        "{stderr}"
    );
    assert!(!stdout.contains("listening") && !stderr.contains("listening"));
    // "auto" with an epsilon out of the exact sampler's reach.
    let tiny = write(
        dir.path(),
        "tiny.toml",
        &format!("rounds = 2\nusers = 40\ncohort_size = 10\nnoise_multiplier = \"auto\"\n{base}")
            .replace("target_epsilon = 50.0", "target_epsilon = 0.001"),
    );
    let state_dir = dir.path().join("state");
    let (code, stdout, stderr) = fedrl_output(&[
        "aggregator",
        "--scenario",
        tiny.to_str().unwrap(),
        "--state-dir",
        state_dir.to_str().unwrap(),
        "--issue-token",
        "agent-0",
    ]);
    assert_ne!(code, 0, "a token was issued: {stdout}");
    assert!(stderr.contains("largest"), "{stderr}");
    let (code, stdout, stderr) = fedrl_output(&[
        "aggregator",
        "--scenario",
        tiny.to_str().unwrap(),
        "--state-dir",
        state_dir.to_str().unwrap(),
    ]);
    assert_ne!(code, 0);
    assert!(!stdout.contains("listening"), "{stdout}");
    assert!(stderr.contains("largest"), "{stderr}");

    // Allowed: 3 rounds of 10 from 30 users, then the run ends for lack of units, exit 0.
    let allowed = write(
        dir.path(),
        "allowed.toml",
        &format!(
            "rounds = 5\nusers = 30\ncohort_size = 10\nquorum = 5\nallow_fewer_rounds = true\n{base}"
        ),
    );
    let out = dir.path().join("out-allowed");
    let (code, _, stderr) = fedrl_output(&[
        "run",
        allowed.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["rounds_completed"], 3, "{report}");
    assert!(
        report["finished"]
            .as_str()
            .unwrap()
            .contains("never contributed"),
        "{report}"
    );
}
