//! Offline CQL on a dataset recorded in a Gymnasium environment (`task.dataset.env =
//! "gymnasium:CartPole-v1"`): the aggregator runs no Python, so at each evaluation step its
//! model keeps the released Q-network as a snapshot and marks the evaluation deferred, and
//! `fedrl run` (or `fedrl eval --deferred` for a standalone aggregator) evaluates the snapshots
//! and the exported network through the bridge (scenarios/src/deferred_eval.rs). The targets:
//! every filled evaluation equals the evaluation of the same snapshot in fedrl's own
//! CartPole-v1 on the episodes the aggregator would have played (`eval_seed`,
//! `eval_episodes`, `eval_max_steps`), and the whole run equals the same scenario on fedrl's own
//! CartPole-v1 (whose traces match Gymnasium's, as does the random dataset: rl/tests/
//! gym_offline.rs), whose aggregator evaluates in Rust: the learning curve, the metrics rows
//! and the final evaluation. `fedrl eval RUN_DIR` evaluates its exported Q-network through the
//! bridge; without the bridge's interpreter it says how to install it.
//!
//! Needs `.venv-bridge` (`scripts/install-python-bridge.sh`; `.ci/run` runs it first); without
//! it the tests say so and pass after checking the missing-interpreter error.

mod e2e_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use e2e_support::*;
use fedrl_rl::offline::QNetSpec;
use fedrl_rl::offline::train::evaluate_greedy_for;
use fedrl_sim::gym_bridge::default_python;
use serde_json::Value;

fn venv() -> bool {
    if default_python().exists() || std::env::var_os("FEDRL_PYTHON").is_some() {
        return true;
    }
    eprintln!("SKIPPED: no .venv-bridge (run scripts/install-python-bridge.sh)");
    false
}

const EVAL_SEED: u64 = 5;
const EVAL_EPISODES: usize = 3;
const EVAL_MAX_STEPS: u64 = 200;
const FINAL_EPISODES: usize = 4;
/// Rounds (one DP-SGD step each) and the evaluation interval in steps.
const ROUNDS: u64 = 30;
const EVAL_EVERY: u64 = 5;

/// The scenario on `env`; `gymnasium` adds the `[task.dataset.gymnasium]` table.
fn scenario(env: &str, gymnasium: bool) -> String {
    let table = if gymnasium {
        "\n[task.dataset.gymnasium]\nobs_dim = 4\nactions = 2\nworkers = 2\n"
    } else {
        ""
    };
    format!(
        r#"
name = "gym-cql"
seed = 11
rounds = {ROUNDS}
users = 24
client_agents = 1
participation = {{ kind = "sampled", rate = 0.5 }}
round_deadline_s = 60.0
start_timeout_s = 120.0
clip_norm = 1.0
noise_multiplier = 0.3
target_epsilon = 1000.0
unit_kind = "trajectory"

[task]
kind = "offline_cql"
transitions_per_unit = 4
eval_every = {EVAL_EVERY}
eval_episodes = {EVAL_EPISODES}
eval_seed = {EVAL_SEED}
final_eval_episodes = {FINAL_EPISODES}
eval_max_steps = {EVAL_MAX_STEPS}

[task.dataset]
env = "{env}"
units = 24
seed = 3
behaviour = {{ kind = "ppo_mixed", iterations = 10, checkpoints = 2, epsilon = 0.2 }}
{table}
[task.cql]
hidden = [16]
learning_rate = 3e-2
target_update_interval = 2
"#
    )
}

/// `fedrl ARGS` with the dataset cache at `data`; its stderr.
fn fedrl(data: &Path, args: &[&str]) -> String {
    let o = Command::new(exe())
        .args(args)
        .env("FEDRL_DATA_DIR", data)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        o.status.success(),
        "fedrl {args:?} failed: {stderr}\n{}",
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
    let (Some(x), Some(y)) = (a.as_f64(), b.as_f64()) else {
        panic!("{what}: {a} vs {b}");
    };
    assert!(
        (x - y).abs() <= 1e-6 * (1.0 + x.abs()),
        "{what}: {x} vs {y}"
    );
}

/// The filled evaluations of a run's rows and curve (in `dir`, its state directory `state`)
/// each equal the Rust evaluation of the snapshot they name, on the aggregator's episodes; the
/// curve has an evaluation at each of `steps` and the rows `rows` of them; the final evaluation
/// is the Rust one of the exported network on the final evaluation's episodes.
fn filled_as_in_rust(dir: &Path, state: &Path, steps: &[u64], rows: usize) {
    let fe = &read_json(&dir.join("report.json"))["final_evaluation"];
    let curve = fe["curve"].as_array().unwrap();
    let evaluated: Vec<Value> = released(&dir.join("metrics.jsonl"))
        .into_iter()
        .filter(|r| !r["eval"].is_null())
        .collect();
    assert_eq!(
        curve
            .iter()
            .map(|e| e["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        steps,
        "{fe}"
    );
    assert_eq!(evaluated.len(), rows, "{evaluated:?}");
    for e in curve.iter().chain(evaluated.iter().map(|r| &r["eval"])) {
        assert_eq!(e["deferred"], true, "{e}");
        let name = e["snapshot"].as_str().unwrap();
        assert_eq!(name, format!("step-{:08}", e["step"].as_u64().unwrap()));
        let (spec, params) = QNetSpec::load_file(
            &state
                .join("eval-snapshots")
                .join(format!("{name}.safetensors")),
        )
        .unwrap();
        let r = evaluate_greedy_for(
            &spec,
            &params,
            "CartPole-v1",
            EVAL_EPISODES,
            EVAL_SEED,
            EVAL_MAX_STEPS,
        )
        .unwrap();
        close(&e["eval_return"], &r.mean.into(), name);
        close(&e["eval_return_std"], &r.std.into(), name);
        assert_eq!(e["eval_episodes"], EVAL_EPISODES, "{e}");
    }
    // The final evaluation: the exported network on the final evaluation's own episodes.
    let (spec, params) = QNetSpec::load_file(&state.join("q_network.safetensors")).unwrap();
    let final_seed = EVAL_SEED.wrapping_add(0x5EED_F1A1);
    let r = evaluate_greedy_for(
        &spec,
        &params,
        "CartPole-v1",
        FINAL_EPISODES,
        final_seed,
        EVAL_MAX_STEPS,
    )
    .unwrap();
    close(
        &fe["final_eval_return"],
        &r.mean.into(),
        "final_eval_return",
    );
    close(
        &fe["final_eval_return_std"],
        &r.std.into(),
        "final_eval_return_std",
    );
    assert_eq!(fe["final_eval_episodes"], FINAL_EPISODES, "{fe}");
}

/// The evaluation steps of the plain scenario.
fn every_eval_step() -> Vec<u64> {
    (1..=ROUNDS / EVAL_EVERY).map(|k| k * EVAL_EVERY).collect()
}

/// A run's evaluations (rows, curve, final evaluation) equal the reference run's.
fn same_evaluations(gym: &Path, own: &Path) {
    let with_eval = |d: &Path| -> Vec<Value> {
        released(&d.join("metrics.jsonl"))
            .into_iter()
            .filter(|r| !r["eval"].is_null())
            .collect()
    };
    let (g, o) = (with_eval(gym), with_eval(own));
    assert_eq!(g.len(), o.len());
    for (a, b) in g.iter().zip(&o) {
        assert_eq!(a["round"], b["round"]);
        assert_eq!(a["eval"]["step"], b["eval"]["step"]);
        assert!(b["eval"].get("deferred").is_none(), "{b}");
        let r = &a["round"];
        for k in ["eval_return", "eval_return_std"] {
            close(&a["eval"][k], &b["eval"][k], &format!("round {r} {k}"));
        }
    }
    let (fg, fo) = (
        &read_json(&gym.join("report.json"))["final_evaluation"],
        &read_json(&own.join("report.json"))["final_evaluation"],
    );
    for k in ["final_eval_return", "final_eval_return_std"] {
        close(&fg[k], &fo[k], k);
    }
    assert_eq!(fg["final_eval_episodes"], 4, "{fg}");
    assert_eq!(fg["deferred"], true, "{fg}");
    let (cg, co) = (
        fg["curve"].as_array().unwrap(),
        fo["curve"].as_array().unwrap(),
    );
    assert_eq!(cg.len(), co.len());
    for (a, b) in cg.iter().zip(co) {
        assert_eq!(a["step"], b["step"]);
        close(
            &a["eval_return"],
            &b["eval_return"],
            &format!("curve step {}", a["step"]),
        );
    }
}

/// `fedrl eval ARGS --json`'s mean return.
fn eval_mean(data: &Path, args: &[&str]) -> Value {
    let o = Command::new(exe())
        .arg("eval")
        .args(args)
        .arg("--json")
        .env("FEDRL_DATA_DIR", data)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice::<Value>(&o.stdout).unwrap()["mean_return"].clone()
}

/// A Q-network's evaluation through the bridge refuses to start without the interpreter, naming
/// the script that installs it (checked with or without the bridge installed).
#[test]
fn fedrl_eval_without_the_bridge_names_the_install_script() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "gym.toml",
        &scenario("gymnasium:CartPole-v1", true),
    );
    let spec = QNetSpec {
        obs_dim: 4,
        hidden: vec![8],
        n_actions: 2,
    };
    let q = dir.path().join("q_network.safetensors");
    spec.save(&q, &spec.init(1)).unwrap();
    let o = Command::new(exe())
        .args(["eval", "--policy", q.to_str().unwrap()])
        .args(["--env", "gymnasium:CartPole-v1", "--scenario"])
        .arg(&file)
        .env("FEDRL_PYTHON", dir.path().join("no-python"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("scripts/install-python-bridge.sh") && err.contains("no-python"),
        "{err}"
    );
    // A policy that is not a Q-network is refused by name in a dataset's environment.
    let obs = fedrl_sim::Space::Box {
        low: vec![f32::NEG_INFINITY; 4],
        high: vec![f32::INFINITY; 4],
    };
    let mlp =
        fedrl_rl::ModelSpec::from_spaces(&obs, &fedrl_sim::Space::Discrete { n: 2 }, &[8]).unwrap();
    let p = dir.path().join("policy.safetensors");
    fedrl_rl::io::save(&p, &mlp, &mlp.init(1)).unwrap();
    let (code, _, err) = fedrl_output(&[
        "eval",
        "--policy",
        p.to_str().unwrap(),
        "--env",
        "gymnasium:CartPole-v1",
        "--scenario",
        file.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is not a Q-network"), "{err}");
}

#[test]
fn an_offline_cql_run_on_a_gymnasium_dataset_is_evaluated_as_on_fedrls_own() {
    if !venv() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let own_file = write(dir.path(), "own.toml", &scenario("CartPole-v1", false));
    let gym_file = write(
        dir.path(),
        "gym.toml",
        &scenario("gymnasium:CartPole-v1", true),
    );
    let (own, gym) = (dir.path().join("own"), dir.path().join("gym"));
    fedrl(
        &data,
        &[
            "run",
            own_file.to_str().unwrap(),
            "--out",
            own.to_str().unwrap(),
        ],
    );
    let stderr = fedrl(
        &data,
        &[
            "run",
            gym_file.to_str().unwrap(),
            "--out",
            gym.to_str().unwrap(),
        ],
    );
    // Progress lines while it evaluates: each snapshot once, then the exported network.
    assert!(
        stderr.contains("evaluating 6 released models through the Gymnasium bridge")
            && stderr.contains("step 30 (6/6)")
            && stderr.contains("final evaluation of the exported Q-network"),
        "{stderr}"
    );
    let steps = every_eval_step();
    filled_as_in_rust(&gym, &gym.join("state"), &steps, steps.len());
    same_evaluations(&gym, &own);
    // The comparison has teeth: the networks evaluated differ from step to step, and so do
    // their returns.
    let curve = read_json(&gym.join("report.json"))["final_evaluation"]["curve"].clone();
    let returns: Vec<f64> = curve
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["eval_return"].as_f64().unwrap())
        .collect();
    assert!(returns.iter().any(|r| *r != returns[0]), "{returns:?}");
    let snaps: Vec<Vec<f32>> = curve
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            QNetSpec::load_file(
                &gym.join("state/eval-snapshots")
                    .join(format!("{}.safetensors", e["snapshot"].as_str().unwrap())),
            )
            .unwrap()
            .1
        })
        .collect();
    assert!(snaps.windows(2).all(|w| w[0] != w[1]));
    // The export is the final network (offline CQL selects none, even where an earlier one
    // evaluated better): the last snapshot's.
    let exported = QNetSpec::load_file(&gym.join("q_network.safetensors"))
        .unwrap()
        .1;
    assert_eq!(Some(&exported), snaps.last());
    check_report_schema(&read_json(&gym.join("report.json")));
    // The aggregator's own lines stay as it wrote them; the operator's copy is filled too.
    for row in released(&gym.join("state/metrics.jsonl")) {
        if !row["eval"].is_null() {
            assert!(row["eval"].get("eval_return").is_none(), "{row}");
            assert_eq!(row["eval"]["deferred"], true, "{row}");
        }
    }
    for (a, b) in released(&gym.join("operator/metrics.jsonl"))
        .iter()
        .zip(released(&gym.join("metrics.jsonl")))
    {
        assert_eq!(a["eval"], b["eval"]);
    }
    // The learning curve is drawn by training step.
    let png = std::fs::read(gym.join("learning_curve.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");

    // `fedrl eval RUN_DIR` plays the exported Q-network through the bridge, as fedrl's own
    // CartPole-v1 plays the reference run's (and its own network: the same figure).
    let args = |d: &PathBuf| {
        vec![
            d.to_str().unwrap().to_string(),
            "--episodes".into(),
            "5".into(),
            "--seed".into(),
            "9".into(),
        ]
    };
    let a = args(&gym);
    let gm = eval_mean(&data, &a.iter().map(String::as_str).collect::<Vec<_>>());
    let o = args(&own);
    let om = eval_mean(&data, &o.iter().map(String::as_str).collect::<Vec<_>>());
    close(&gm, &om, "fedrl eval RUN_DIR");
    let (spec, params) = QNetSpec::load_file(&gym.join("q_network.safetensors")).unwrap();
    let rust = evaluate_greedy_for(&spec, &params, "CartPole-v1", 5, 9, 0).unwrap();
    close(&gm, &rust.mean.into(), "fedrl eval RUN_DIR vs Rust");

    // A resume of the finished run (nothing left to train) ends with the same evaluations.
    fedrl(&data, &["run", "--out", gym.to_str().unwrap(), "--resume"]);
    let steps = every_eval_step();
    filled_as_in_rust(&gym, &gym.join("state"), &steps, steps.len());
    same_evaluations(&gym, &own);
}

/// A standalone `fedrl aggregator` of an offline CQL Gymnasium run ends with its evaluations
/// deferred and says how to complete them; `fedrl eval --deferred STATE_DIR --scenario FILE`
/// fills its rows, curve and final evaluation with the figures `fedrl run` gives.
#[test]
fn a_standalone_aggregators_offline_cql_evaluations_are_completed_by_fedrl_eval() {
    if !venv() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let gym_file = write(
        dir.path(),
        "gym.toml",
        &scenario("gymnasium:CartPole-v1", true),
    );
    // The reference, and the dataset in the cache for the client agent.
    let run = dir.path().join("run");
    fedrl(
        &data,
        &[
            "run",
            gym_file.to_str().unwrap(),
            "--out",
            run.to_str().unwrap(),
        ],
    );

    let state_dir = dir.path().join("state");
    let secret = prepare_state(&state_dir);
    let (mut agg, addr) = aggregator(
        &gym_file,
        &state_dir,
        "127.0.0.1:0",
        &dir.path().join("agg.log"),
    );
    let mut cmd = Command::new(exe());
    cmd.args(["client", "--server", &addr.addr.to_string()])
        .args(["--server-cert-sha256", &addr.fingerprint])
        .args(["--token", &token(&secret, "c1"), "--users", "0..24"])
        .env("FEDRL_DATA_DIR", &data);
    let mut c = spawn_command("c1", &dir.path().join("c1.log"), cmd);
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
    let fe = &report(&state_dir)["final_evaluation"];
    assert!(
        fe["deferred"] == true && fe.get("final_eval_return").is_none(),
        "{fe}"
    );

    let (code, out, err) = fedrl_output(&[
        "eval",
        "--deferred",
        state_dir.to_str().unwrap(),
        "--scenario",
        gym_file.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let fe: Value = serde_json::from_str(&out).unwrap();
    assert!(fe["final_eval_return"].is_f64(), "{fe}");
    assert!(err.contains("step 30 (6/6)"), "{err}");
    // The state directory reads as `fedrl run`'s output does, with its figures.
    let steps = every_eval_step();
    filled_as_in_rust(&state_dir, &state_dir, &steps, steps.len());
    let (a, b) = (
        read_json(&state_dir.join("report.json")),
        read_json(&run.join("report.json")),
    );
    for k in ["final_eval_return", "final_eval_return_std"] {
        close(&a["final_evaluation"][k], &b["final_evaluation"][k], k);
    }
    assert_eq!(
        read_json(&state_dir.join("operator/report.json"))["final_evaluation"],
        fe
    );
    check_report_schema(&a);
}

/// A Selective DP-SGD run (seed 000/002) on a Gymnasium dataset: its free steps, noise-free
/// steps on the released prefixes, have evaluation steps of their own. Each evaluation step's
/// network is kept and filled as in Rust, in the learning curve (by training step) and on the
/// round lines that carry it.
#[test]
fn a_selective_runs_free_step_evaluations_are_filled_too() {
    if !venv() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    // 48 experts on a one-setting grid (Gymnasium's CartPole-v1 takes no physics keywords);
    // 20 steps, about half of them DP steps.
    let text = format!(
        r#"
name = "gym-cql-selective"
seed = 5
users = 48
client_agents = 1
participation = {{ kind = "sampled", rate = 0.5 }}
round_deadline_s = 60.0
start_timeout_s = 300.0
clip_norm = 1.0
noise_multiplier = 1.0
delta = 0.01
target_epsilon = 1000.0
unit_kind = "expert"

[task]
kind = "offline_cql"
eval_every = 3
eval_episodes = {EVAL_EPISODES}
eval_seed = {EVAL_SEED}
final_eval_episodes = {FINAL_EPISODES}
eval_max_steps = {EVAL_MAX_STEPS}

[task.selective]
steps = 20
unstable_probability = 0.5
stable_batch = 8
schedule_seed = 2
release = {{ epsilon = 200.0, delta = 0.005, trajectories = 4, horizon = 40 }}

[task.dataset]
env = "gymnasium:CartPole-v1"
units = 48
episodes_per_unit = 2
behaviour = {{ kind = "experts", population = "gymnasium:CartPole-v1", per_setting = 3, iterations = 2, hidden = [8], p_min = 0.5, max_steps = 40 }}

[task.dataset.gymnasium]
obs_dim = 4
actions = 2
grid = {{ sutton_barto_reward = {{ choice = [false] }} }}

[task.cql]
hidden = [16]
learning_rate = 1e-2
target_update_interval = 5
"#
    );
    let file = write(dir.path(), "sel.toml", &text);
    let out = dir.path().join("out");
    fedrl(
        &data,
        &[
            "run",
            file.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
    );
    let report = read_json(&out.join("report.json"));
    check_report_schema(&report);
    let fe = &report["final_evaluation"];
    let curve = fe["curve"].as_array().unwrap();
    // Some evaluation steps fall on free steps (fewer DP steps than training steps so far).
    assert!(
        curve
            .iter()
            .any(|e| e["dp_steps"].as_u64() < e["step"].as_u64()),
        "{fe}"
    );
    assert!(fe["free_steps"].as_u64().unwrap() > 0, "{fe}");
    let steps: Vec<u64> = curve.iter().map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=20 / 3).map(|k| 3 * k).collect::<Vec<_>>());
    let rows = released(&out.join("metrics.jsonl"))
        .iter()
        .filter(|r| !r["eval"].is_null())
        .count();
    assert!(rows > 0 && rows <= steps.len(), "{rows}");
    filled_as_in_rust(&out, &out.join("state"), &steps, rows);
}
