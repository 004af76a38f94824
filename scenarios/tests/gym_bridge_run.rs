//! `fedrl run` of a `gymnasium:<id>` DPPG scenario: the aggregator runs no Python, so it keeps
//! each model released at an evaluation round as a snapshot and `fedrl run` evaluates them
//! through the bridge after it ended (scenarios/src/deferred_eval.rs). The target: a short seeded
//! run on `gymnasium:CartPole-v1` ends with the same periodic evaluations, the same exported
//! (best-evaluated) policy and the same final evaluation, to float tolerance, as the same
//! scenario on fedrl's own CartPole-v1 (whose traces match Gymnasium's), whose aggregator
//! evaluates in Rust. The scenario's task is the in-process equality test's
//! (tasks/tests/gym_bridge_dppg.rs). Then `--resume` of the finished run ends as it did;
//! `--replicates 2` gives each replicate its final evaluation and learning curve; a run stopped
//! by SIGTERM mid-training resumes with every released round evaluated; a standalone
//! `fedrl aggregator` says how to evaluate its run, and `fedrl eval --deferred` does it with the
//! same figures.
//!
//! Needs `.venv-bridge` (`scripts/install-python-bridge.sh`; `.ci/run` runs it first); without
//! it the test says so and passes without checking anything.

mod e2e_support;

use std::path::Path;
use std::process::Command;

use e2e_support::*;
use fedrl_sim::gym_bridge::default_python;
use serde_json::Value;

fn venv() -> bool {
    if default_python().exists() || std::env::var_os("FEDRL_PYTHON").is_some() {
        return true;
    }
    eprintln!("SKIPPED: no .venv-bridge (run scripts/install-python-bridge.sh)");
    false
}

/// The scenario on `population`; `gymnasium` adds the `[task.gymnasium]` table.
fn scenario(population: &str, gymnasium: bool, rounds: u64) -> String {
    let table = if gymnasium {
        "\n[task.gymnasium]\nobs_dim = 4\nactions = 2\nworkers = 2\n"
    } else {
        ""
    };
    format!(
        r#"
name = "gym-run"
seed = 7
rounds = {rounds}
users = 60
client_agents = 1
participation = {{ kind = "fresh" }}
cohort_size = 6
quorum = 6
round_deadline_s = 120.0
start_timeout_s = 120.0
clip_norm = 1.0
noise_multiplier = 2.0
target_epsilon = 1000.0

[task]
kind = "dppg"
population = "{population}"
episode_seed = 11
model_seed = 5
server_lr = 20.0
eval_every = 1
eval_users = 4
final_eval_users = 6
{table}
[task.local]
episodes_per_user = 2
max_episode_steps = 30
epochs = 2
minibatches = 2
hidden = [16]
threads = 2
lr = 0.003
"#
    )
}

fn fedrl_run(args: &[&str]) -> String {
    let o = Command::new(exe()).arg("run").args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        o.status.success(),
        "fedrl run {args:?} failed: {stderr}\n{}",
        String::from_utf8_lossy(&o.stdout)
    );
    stderr
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// The released rows of a metrics file.
fn released(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["status"] == "released")
        .collect()
}

fn close(a: &Value, b: &Value, what: &str) {
    let (x, y) = (a.as_f64(), b.as_f64());
    let (Some(x), Some(y)) = (x, y) else {
        panic!("{what}: {a} vs {b}");
    };
    assert!(
        (x - y).abs() <= 1e-6 * (1.0 + x.abs()),
        "{what}: {x} vs {y}"
    );
}

fn policy(out: &Path) -> Vec<f32> {
    fedrl_rl::io::load(&out.join("policy.safetensors"))
        .unwrap()
        .1
}

/// The evaluation fields of a run (rows, final evaluation, policy) equal the reference run's.
fn same_evaluations(gym: &Path, own: &Path) {
    let (g, o) = (
        released(&gym.join("metrics.jsonl")),
        released(&own.join("metrics.jsonl")),
    );
    assert_eq!(g.len(), o.len());
    for (a, b) in g.iter().zip(&o) {
        assert_eq!(a["round"], b["round"]);
        // Published by `fedrl run`, marked so; the aggregator's own rows have no mark.
        assert_eq!(a["eval"]["deferred"], true, "{a}");
        assert!(b["eval"].get("deferred").is_none(), "{b}");
        let r = &a["round"];
        close(
            &a["eval"]["eval_return"],
            &b["eval"]["eval_return"],
            &format!("round {r} eval_return"),
        );
        close(
            &a["eval"]["eval_return_std"],
            &b["eval"]["eval_return_std"],
            &format!("round {r} eval_return_std"),
        );
        assert_eq!(a["eval"]["eval_episodes"], 4, "{a}");
        assert_eq!(b["eval"]["eval_episodes"], 4, "{b}");
    }
    let (fg, fo) = (
        &read_json(&gym.join("report.json"))["final_evaluation"],
        &read_json(&own.join("report.json"))["final_evaluation"],
    );
    for k in [
        "final_eval_return",
        "final_eval_return_std",
        "selected_model_eval_return",
    ] {
        close(&fg[k], &fo[k], k);
    }
    assert_eq!(fg["final_eval_episodes"], 6, "{fg}");
    assert_eq!(fo["final_eval_episodes"], 6, "{fo}");
    assert_eq!(fg["deferred"], true, "{fg}");
    // The exported policy is the same best-evaluated model.
    let (pg, po) = (policy(gym), policy(own));
    assert_eq!(pg.len(), po.len());
    let worst = pg
        .iter()
        .zip(&po)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= 1e-5, "exported policies differ by {worst}");
}

#[test]
fn a_gymnasium_run_is_evaluated_as_fedrls_own_population_is() {
    if !venv() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let rounds = 6;
    let own_file = write(
        dir.path(),
        "own.toml",
        &scenario("CartPole-v1", false, rounds),
    );
    let gym_file = write(
        dir.path(),
        "gym.toml",
        &scenario("gymnasium:CartPole-v1", true, rounds),
    );
    let (own, gym) = (dir.path().join("own"), dir.path().join("gym"));
    fedrl_run(&[own_file.to_str().unwrap(), "--out", own.to_str().unwrap()]);
    let stderr = fedrl_run(&[gym_file.to_str().unwrap(), "--out", gym.to_str().unwrap()]);
    // Progress lines while it evaluates.
    assert!(
        stderr.contains("through the Gymnasium bridge") && stderr.contains("round 6 (6/6)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("final evaluation on users 64..70"),
        "{stderr}"
    );
    same_evaluations(&gym, &own);
    // The comparison has teeth: the evaluations differ between rounds, and the exported model
    // is the best-evaluated one, not the last.
    let evals: Vec<f64> = released(&gym.join("metrics.jsonl"))
        .iter()
        .map(|r| r["eval"]["eval_return"].as_f64().unwrap())
        .collect();
    let best = evals.iter().cloned().fold(f64::MIN, f64::max);
    assert!(evals.iter().any(|e| *e != best), "{evals:?}");
    assert!(evals[evals.len() - 1] < best, "{evals:?}");
    let report = read_json(&gym.join("report.json"));
    close(
        &report["final_evaluation"]["selected_model_eval_return"],
        &serde_json::json!(best),
        "selected",
    );
    let last = fedrl_rl::io::load(
        &gym.join("state/eval-snapshots")
            .join(format!("round-{rounds:08}.safetensors")),
    )
    .unwrap()
    .1;
    assert_ne!(policy(&gym), last, "the last model was exported");
    check_report_schema(&report);
    // Every model released at an evaluation round was kept in the state directory.
    for r in 1..=rounds {
        let snap = gym
            .join("state/eval-snapshots")
            .join(format!("round-{r:08}.safetensors"));
        assert!(snap.is_file(), "{}", snap.display());
    }
    // The aggregator's own lines stay as it wrote them; the operator's copy is filled too.
    for row in released(&gym.join("state/metrics.jsonl")) {
        assert_eq!(
            row["eval"],
            serde_json::json!({ "deferred": true }),
            "{row}"
        );
    }
    for (a, b) in released(&gym.join("operator/metrics.jsonl"))
        .iter()
        .zip(released(&gym.join("metrics.jsonl")))
    {
        assert_eq!(a["eval"], b["eval"]);
        assert!(
            a.get("accepted").is_some(),
            "operator rows keep their counts"
        );
    }
    let csv = std::fs::read_to_string(gym.join("metrics.csv")).unwrap();
    assert!(
        csv.lines().next().unwrap().contains("eval.eval_return"),
        "{csv}"
    );
    // The learning curve (with its band) is drawn.
    let png = std::fs::read(gym.join("learning_curve.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    // TensorBoard gets the evaluations too, once each, even after a resume completes them again.
    let tb_evals = |out: &Path| {
        let mut got = Vec::new();
        for e in std::fs::read_dir(out.join("tensorboard")).unwrap() {
            let p = e.unwrap().path();
            if !p.to_string_lossy().ends_with(".deferred-eval") {
                continue;
            }
            let events =
                fedrl_aggregator::tensorboard::decode::read(&std::fs::read(&p).unwrap()).unwrap();
            for ev in &events[1..] {
                for (tag, v) in &ev.scalars {
                    if tag == "eval/eval_return" {
                        got.push((ev.step as u64, *v));
                    }
                }
            }
        }
        got.sort_by_key(|a| a.0);
        got
    };
    let want: Vec<(u64, f32)> = released(&gym.join("metrics.jsonl"))
        .iter()
        .filter_map(|r| {
            Some((
                r["round"].as_u64()?,
                r["eval"]["eval_return"].as_f64()? as f32,
            ))
        })
        .collect();
    assert!(!want.is_empty());
    assert_eq!(tb_evals(&gym), want);

    // A resume of the finished run (nothing left to train) ends with the same evaluations.
    fedrl_run(&["--out", gym.to_str().unwrap(), "--resume"]);
    same_evaluations(&gym, &own);
    assert_eq!(tb_evals(&gym), want);
    check_report_schema(&read_json(&gym.join("report.json")));
}

#[test]
fn gymnasium_replicates_each_have_their_evaluations() {
    if !venv() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "gym.toml",
        &scenario("gymnasium:CartPole-v1", true, 2),
    );
    let out = dir.path().join("out");
    fedrl_run(&[
        file.to_str().unwrap(),
        "--replicates",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    for rep in ["rep-0", "rep-1"] {
        let d = out.join(rep);
        let report = read_json(&d.join("report.json"));
        check_report_schema(&report);
        assert!(
            report["final_evaluation"]["final_eval_return"].is_f64(),
            "{report}"
        );
        let rows = released(&d.join("metrics.jsonl"));
        assert_eq!(rows.len(), 2);
        assert!(
            rows.iter().all(|r| r["eval"]["eval_return"].is_f64()),
            "{rows:?}"
        );
        assert!(d.join("learning_curve.png").is_file());
    }
    let summary = read_json(&out.join("report.json"));
    check_report_schema(&summary);
    assert_eq!(
        summary["final_return"]["values"].as_array().unwrap().len(),
        2,
        "{summary}"
    );
    assert!(summary["final_return"]["mean"].is_f64(), "{summary}");
    assert!(out.join("learning_curve.png").is_file());
}

/// A `gymnasium:` run stopped by SIGTERM mid-training resumes with `--resume`: the snapshots
/// kept before the signal survive, every released round of both processes is evaluated, and the
/// exported model is the best of them all.
#[test]
fn a_gymnasium_run_stopped_by_sigterm_resumes_with_its_evaluations() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    if !venv() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let rounds = 10u64;
    // 0.5 s of added latency per round leaves time for the signal to land mid-run.
    let text = scenario("gymnasium:CartPole-v1", true, rounds)
        .replace("users = 60", "users = 120")
        .replace(
            "target_epsilon = 1000.0",
            "target_epsilon = 1000.0\ncheckpoint_every = 1",
        )
        + "\n[churn]\nadded_latency_s = 0.5\n";
    let file = write(dir.path(), "gym.toml", &text);
    let out = dir.path().join("out");
    let err_log = dir.path().join("run.err");
    let mut p = Proc {
        name: "fedrl run".into(),
        child: Command::new(exe())
            .arg("run")
            .arg(&file)
            .arg("--out")
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&err_log).unwrap()))
            .spawn()
            .unwrap(),
        log: err_log,
    };
    let released_in_state = || {
        metrics(&out.join("state"))
            .iter()
            .filter(|m| m["status"] == "released")
            .count()
    };
    let t0 = Instant::now();
    while released_in_state() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(120), "{}", p.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill(2) on our child, not yet reaped.
    assert_eq!(unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) }, 0);
    let status = p.wait(Duration::from_secs(120));
    assert_eq!(status.code(), Some(143), "{status}:\n{}", p.log_text());
    let before = released_in_state();
    assert!(before < rounds as usize, "the signal landed after the run");

    fedrl_run(&["--out", out.to_str().unwrap(), "--resume"]);
    let report = read_json(&out.join("report.json"));
    check_report_schema(&report);
    assert_eq!(report["outcome"], "finished", "{report}");
    let rows = released(&out.join("metrics.jsonl"));
    assert!(rows.len() > before, "{rows:?}");
    let mut best = f64::MIN;
    for r in &rows {
        let e = r["eval"]["eval_return"].as_f64();
        assert!(e.is_some(), "{r}");
        best = best.max(e.unwrap_or(f64::MIN));
        let snap = out.join("state/eval-snapshots").join(format!(
            "round-{:08}.safetensors",
            r["round"].as_u64().unwrap()
        ));
        assert!(snap.is_file(), "{}", snap.display());
    }
    let fe = &report["final_evaluation"];
    close(
        &fe["selected_model_eval_return"],
        &serde_json::json!(best),
        "selected",
    );
    assert!(fe["final_eval_return"].is_f64(), "{fe}");
    assert!(out.join("learning_curve.png").is_file());
}

/// A standalone `fedrl aggregator` (not under `fedrl run`) of a `gymnasium:` run ends with its
/// evaluations deferred and says how to complete them; `fedrl eval --deferred STATE_DIR
/// --scenario FILE` then fills its rows, exports the best model and writes the final evaluation,
/// equal to fedrl's own CartPole-v1 run's (so to what `fedrl run` computes). A running or
/// unfinished state directory and another scenario are refused.
#[test]
fn a_standalone_aggregators_deferred_evaluations_are_completed_by_fedrl_eval() {
    use std::time::Duration;
    if !venv() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let rounds = 4;
    let own_file = write(
        dir.path(),
        "own.toml",
        &scenario("CartPole-v1", false, rounds),
    );
    let gym_file = write(
        dir.path(),
        "gym.toml",
        &scenario("gymnasium:CartPole-v1", true, rounds),
    );
    let own = dir.path().join("own");
    fedrl_run(&[own_file.to_str().unwrap(), "--out", own.to_str().unwrap()]);

    let state_dir = dir.path().join("state");
    let eval_deferred = |extra: &[&str]| {
        let mut args = vec![
            "eval",
            "--deferred",
            state_dir.to_str().unwrap(),
            "--scenario",
            gym_file.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        fedrl_output(&args)
    };
    // Before the aggregator ran: nothing to evaluate, said clearly.
    let secret = prepare_state(&state_dir);
    let (code, _, err) = eval_deferred(&[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("has not ended"), "{err}");

    let (mut agg, addr) = aggregator(
        &gym_file,
        &state_dir,
        "127.0.0.1:0",
        &dir.path().join("agg.log"),
    );
    // While it runs, its state directory is refused (the lock).
    let (code, _, err) = eval_deferred(&[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("lock") || err.contains("in use"), "{err}");
    let mut c = client(
        "c1",
        &addr,
        &token(&secret, "c1"),
        "0..60",
        &dir.path().join("c1.log"),
    );
    let status = agg.wait(Duration::from_secs(300));
    assert!(status.success(), "{status}:\n{}", agg.log_text());
    c.wait(Duration::from_secs(60));
    let log = agg.log_text();
    assert!(
        log.contains("held-out evaluations deferred")
            && log.contains(&format!(
                "fedrl eval --deferred {} --scenario {}",
                state_dir.display(),
                gym_file.display()
            )),
        "{log}"
    );
    assert!(
        report(&state_dir)["final_evaluation"]["deferred"] == true,
        "{log}"
    );
    assert!(
        released(&state_dir.join("metrics.jsonl"))
            .iter()
            .all(|r| r["eval"] == serde_json::json!({ "deferred": true }))
    );

    // Another scenario's name is refused.
    let other = write(
        dir.path(),
        "other.toml",
        &scenario("gymnasium:CartPole-v1", true, rounds).replace("gym-run", "gym-other"),
    );
    let (code, _, err) = fedrl_output(&[
        "eval",
        "--deferred",
        state_dir.to_str().unwrap(),
        "--scenario",
        other.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("gym-other") && err.contains("gym-run"),
        "{err}"
    );

    let (code, out, err) = eval_deferred(&["--json"]);
    assert_eq!(code, 0, "{err}");
    let fe: Value = serde_json::from_str(&out).unwrap();
    assert!(fe["final_eval_return"].is_f64(), "{fe}");
    assert!(
        err.contains(&format!("round {rounds} ({rounds}/{rounds})")),
        "{err}"
    );
    // The state directory now reads as `fedrl run`'s output does, with the same figures as
    // the Rust population's run.
    same_evaluations(&state_dir, &own);
    for (a, b) in released(&state_dir.join("operator/metrics.jsonl"))
        .iter()
        .zip(released(&state_dir.join("metrics.jsonl")))
    {
        assert_eq!(a["eval"], b["eval"]);
    }
    let op = read_json(&state_dir.join("operator/report.json"));
    assert_eq!(op["final_evaluation"], fe);
    check_report_schema(&report(&state_dir));
    // Again: recomputed from the snapshots, the same figures.
    let (code, _, err) = eval_deferred(&[]);
    assert_eq!(code, 0, "{err}");
    same_evaluations(&state_dir, &own);
}
