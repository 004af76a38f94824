//! `fedrl sim`: replay exit codes (0 pass, 1 mismatch, 2 unreadable), bench and list.

use std::process::{Command, Output};

const FEDRL: &str = env!("CARGO_BIN_EXE_fedrl");
const GYM_TRACES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/gymnasium_traces.json"
);

fn fedrl(args: &[&str]) -> Output {
    Command::new(FEDRL).args(args).output().expect("run fedrl")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn replay_of_the_gymnasium_traces_passes() {
    let o = fedrl(&["sim", "replay", "--trace", GYM_TRACES, "--json"]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("json");
    assert_eq!(v["pass"], true);
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 4);
    for r in results {
        assert_eq!(r["mismatched_flags"], 0);
        assert!(r["max_error"].as_f64().unwrap() <= 1e-5);
        assert!(r["steps"].as_u64().unwrap() > 0);
    }
    let o = fedrl(&["sim", "replay", "--trace", GYM_TRACES]);
    assert_eq!(o.status.code(), Some(0));
    let text = stdout(&o);
    assert!(
        text.contains("CartPole-v1") && text.contains("PASS"),
        "{text}"
    );
}

#[test]
fn a_tampered_trace_fails_with_exit_code_1() {
    let text = std::fs::read_to_string(GYM_TRACES).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    // Shift one observation by 1e-3 and flip one flag.
    let step = &mut v["envs"]["CartPole-v1"][0]["steps"][0];
    let x = step["obs"][0].as_f64().unwrap();
    step["obs"][0] = serde_json::json!(x + 1e-3);
    v["envs"]["MountainCar-v0"][0]["steps"][5]["truncated"] = serde_json::json!(true);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tampered.json");
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let o = fedrl(&["sim", "replay", "--trace", path.to_str().unwrap(), "--json"]);
    assert_eq!(o.status.code(), Some(1));
    let out: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(out["pass"], false);
    let by_name = |n: &str| {
        out["results"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == n)
            .cloned()
            .unwrap()
    };
    assert!(by_name("CartPole-v1")["max_error"].as_f64().unwrap() > 9e-4);
    assert_eq!(by_name("MountainCar-v0")["mismatched_flags"], 1);
    assert_eq!(by_name("Acrobot-v1")["pass"], true);
}

#[test]
fn unreadable_files_exit_with_code_2() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.json");
    let o = fedrl(&["sim", "replay", "--trace", missing.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    let garbage = dir.path().join("garbage.json");
    std::fs::write(&garbage, "not json").unwrap();
    let o = fedrl(&[
        "sim",
        "replay",
        "--trace",
        garbage.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not JSON"));
}

#[test]
fn bench_and_list() {
    let o = fedrl(&[
        "sim",
        "bench",
        "--env",
        "CartPole-v1",
        "--steps",
        "20000",
        "--json",
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["steps"], 20000);
    assert!(v["steps_per_second"].as_f64().unwrap() > 0.0);
    let o = fedrl(&["sim", "bench", "--env", "Pendulum-v1", "--steps", "1000"]);
    assert!(stdout(&o).contains("steps/s"));
    let o = fedrl(&["sim", "bench", "--env", "NoSuchEnv-v0"]);
    assert_eq!(o.status.code(), Some(2));
    let o = fedrl(&["sim", "list"]);
    assert_eq!(o.status.code(), Some(0));
    let text = stdout(&o);
    for name in [
        "CartPole-v1",
        "Acrobot-v1",
        "RiverSwim-v0",
        "cartpole-swingup",
        "cartpole-b1",
    ] {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
    let o = fedrl(&["sim", "list", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert!(v["environments"].as_array().unwrap().len() >= 10);
    assert!(v["populations"].as_array().unwrap().len() >= 3);
}
