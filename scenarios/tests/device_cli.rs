//! `--device` on the command line and scenario loading through the model builder: a bad device
//! name, a GPU asked of a CPU-only build, and a task whose model cannot be built all fail at
//! start-up with a message that names the cause (exit code 2), before any process is started.

use std::path::Path;
use std::process::{Command, Output};

const FEDRL: &str = env!("CARGO_BIN_EXE_fedrl");
const NO_CUDA: &str = "cuda:0 requested but fedrl was built without the `cuda` feature";

fn fedrl(args: &[&str]) -> Output {
    Command::new(FEDRL).args(args).output().expect("run fedrl")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

const MEAN: &str = "name = \"m\"\nrounds = 1\nusers = 4\ncohort_size = 2\n\
                    [task]\nkind = \"mean_estimation\"\ndim = 2\n";

#[test]
fn a_bad_device_name_is_refused_by_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let s = write(dir.path(), "m.toml", MEAN);
    let out = dir.path().join("out").display().to_string();
    let state = dir.path().join("state").display().to_string();
    let fp = "00".repeat(32);
    for args in [
        vec!["run", &s, "--out", &out, "--device", "gpu"],
        vec![
            "aggregator",
            "--scenario",
            &s,
            "--state-dir",
            &state,
            "--device",
            "cuda",
        ],
        vec![
            "client",
            "--server",
            "127.0.0.1:9",
            "--server-cert-sha256",
            &fp,
            "--token",
            "t",
            "--device",
            "cuda:x",
        ],
        vec![
            "eval",
            "--policy",
            "p.safetensors",
            "--env",
            "CartPole-v1",
            "--device",
            "CPU",
        ],
    ] {
        let o = fedrl(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("cuda:N"), "{args:?}: {}", stderr(&o));
    }
    // In the scenario file too, naming the field.
    let bad = write(dir.path(), "bad.toml", &format!("device = \"tpu\"\n{MEAN}"));
    let o = fedrl(&["run", &bad, "--out", &out]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("tpu") && stderr(&o).contains("cuda:N"),
        "{}",
        stderr(&o)
    );
}

/// A CPU-only build asked for a GPU says so, from the flag and from the scenario, instead of
/// quietly computing on the CPU.
#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let s = write(dir.path(), "m.toml", MEAN);
    let gpu = write(
        dir.path(),
        "gpu.toml",
        &format!("device = \"cuda:0\"\n{MEAN}"),
    );
    let out = dir.path().join("out").display().to_string();
    let state = dir.path().join("state").display().to_string();
    let fp = "00".repeat(32);
    for args in [
        vec!["run", &s, "--out", &out, "--device", "cuda:0"],
        vec!["run", &gpu, "--out", &out],
        vec![
            "aggregator",
            "--scenario",
            &s,
            "--state-dir",
            &state,
            "--device",
            "cuda:0",
        ],
        vec!["aggregator", "--scenario", &gpu, "--state-dir", &state],
        vec![
            "client",
            "--server",
            "127.0.0.1:9",
            "--server-cert-sha256",
            &fp,
            "--token",
            "t",
            "--device",
            "cuda:0",
        ],
        vec![
            "eval",
            "--policy",
            "p.safetensors",
            "--env",
            "CartPole-v1",
            "--device",
            "cuda:0",
        ],
    ] {
        let o = fedrl(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(NO_CUDA), "{args:?}: {}", stderr(&o));
    }
    // `--device cpu` overrides a scenario's GPU (the run then fails later for other reasons
    // or not at all; what matters is that the device is not the error).
    let o = fedrl(&[
        "aggregator",
        "--scenario",
        &gpu,
        "--state-dir",
        &state,
        "--device",
        "cpu",
        "--issue-token",
        "a",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

/// A task whose model cannot be built fails when the scenario is loaded, naming the field.
#[test]
fn a_task_whose_model_cannot_be_built_fails_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out").display().to_string();
    let state = dir.path().join("state").display().to_string();
    for (task, field) in [
        (
            "kind = \"dppg\"\npopulation = \"Nope-v0\"\n",
            "task.population",
        ),
        (
            "kind = \"dppg\"\nlocal = { obs_scale = [1.0] }\n",
            "task.local",
        ),
        (
            "kind = \"loglinear_pg\"\npopulation = \"Pendulum-v1\"\n",
            "task.population",
        ),
    ] {
        let s = write(dir.path(), "t.toml", &format!("[task]\n{task}"));
        for args in [
            vec!["run", &s, "--out", &out],
            vec!["aggregator", "--scenario", &s, "--state-dir", &state],
        ] {
            let o = fedrl(&args);
            assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
            assert!(stderr(&o).contains(field), "{args:?}: {}", stderr(&o));
        }
    }
}
