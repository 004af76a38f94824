//! Shared helpers of the process-level end-to-end tests: they run the real `fedrl` binary
//! (`CARGO_BIN_EXE_fedrl`, which is why these tests live in the `fedrl-scenarios` crate) as
//! separate aggregator and client processes talking QUIC on 127.0.0.1.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use fedrl_aggregator::service::{AddressFile, read_address_file};
use fedrl_aggregator::state;
use fedrl_common::protocol::auth::issue_token;

pub mod schema;

pub fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_fedrl"))
}

/// Runs `fedrl ARGS` to completion: (exit code, stdout, stderr).
pub fn fedrl_output(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(exe()).args(args).output().expect("fedrl runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `fedrl ARGS`, which must succeed and print exactly one JSON document.
pub fn fedrl_json(args: &[&str]) -> serde_json::Value {
    let (code, stdout, stderr) = fedrl_output(args);
    assert_eq!(code, 0, "{args:?}: {stderr}");
    assert_eq!(stdout.lines().count(), 1, "one JSON document: {stdout}");
    serde_json::from_str(&stdout).expect("valid JSON")
}

/// Kills the process when dropped (failed assertions must not leak processes).
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s;
            }
            if t0.elapsed() > timeout {
                panic!(
                    "{} did not exit within {timeout:?}; log:\n{}",
                    self.name,
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, text).unwrap();
    p
}

/// Prepares a state directory with a known enrolment secret; returns the secret.
pub fn prepare_state(state_dir: &Path) -> Vec<u8> {
    fs::create_dir_all(state_dir).unwrap();
    let secret = vec![0x5a; 32];
    state::store_secret(state_dir, &secret).unwrap();
    secret
}

pub fn token(secret: &[u8], id: &str) -> String {
    issue_token(secret, id).unwrap()
}

fn spawn(name: &str, log: &Path, args: &[String]) -> Proc {
    let mut cmd = Command::new(exe());
    cmd.args(args);
    spawn_command(name, log, cmd)
}

/// Starts `cmd` with its stdout and stderr in `log` (e.g. `fedrl` wrapped in `ip netns exec`).
pub fn spawn_command(name: &str, log: &Path, mut cmd: Command) -> Proc {
    let f = fs::File::create(log).unwrap();
    let child = cmd
        .stdout(Stdio::from(f.try_clone().unwrap()))
        .stderr(Stdio::from(f))
        .spawn()
        .unwrap();
    Proc {
        name: name.into(),
        child,
        log: log.to_path_buf(),
    }
}

/// Starts `fedrl aggregator` and waits until it listens.
pub fn aggregator(
    scenario: &Path,
    state_dir: &Path,
    listen: &str,
    log: &Path,
) -> (Proc, AddressFile) {
    aggregator_with(scenario, state_dir, listen, &[], log)
}

/// Starts `fedrl aggregator` with `extra` arguments, without waiting for anything (for starts
/// that are expected to fail).
pub fn spawn_aggregator(scenario: &Path, state_dir: &Path, extra: &[&str], log: &Path) -> Proc {
    let mut args = vec![
        "aggregator".into(),
        "--scenario".into(),
        scenario.display().to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--state-dir".into(),
        state_dir.display().to_string(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    spawn("aggregator", log, &args)
}

/// Starts `fedrl aggregator` with `extra` arguments and waits until it listens.
pub fn aggregator_with(
    scenario: &Path,
    state_dir: &Path,
    listen: &str,
    extra: &[&str],
    log: &Path,
) -> (Proc, AddressFile) {
    let _ = fs::remove_file(state_dir.join(state::ADDRESS_FILE));
    let mut args = vec![
        "aggregator".into(),
        "--scenario".into(),
        scenario.display().to_string(),
        "--listen".into(),
        listen.into(),
        "--state-dir".into(),
        state_dir.display().to_string(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let mut p = spawn("aggregator", log, &args);
    let t0 = Instant::now();
    loop {
        if let Ok(a) = read_address_file(state_dir)
            && a.pid == p.child.id()
        {
            return (p, a);
        }
        if let Some(s) = p.child.try_wait().unwrap() {
            panic!("aggregator exited early ({s}):\n{}", p.log_text());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "aggregator did not start:\n{}",
            p.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `fedrl client`.
pub fn client(name: &str, addr: &AddressFile, token: &str, users: &str, log: &Path) -> Proc {
    let args = vec![
        "client".into(),
        "--server".into(),
        addr.addr.to_string(),
        "--server-cert-sha256".into(),
        addr.fingerprint.clone(),
        "--token".into(),
        token.into(),
        "--users".into(),
        users.into(),
        "--churn-seed".into(),
        "17".into(),
    ];
    spawn(name, log, &args)
}

/// Lines of `metrics.jsonl` as JSON.
pub fn metrics(state_dir: &Path) -> Vec<serde_json::Value> {
    fs::read_to_string(state_dir.join(state::METRICS_FILE))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

pub fn report(state_dir: &Path) -> serde_json::Value {
    let text = fs::read_to_string(state_dir.join(state::REPORT_FILE)).expect("report.json");
    serde_json::from_str(&text).unwrap()
}

/// Checks a `report.json` against the JSON Schema in the repository
/// (`scenarios/report.schema.json`, issue 58): every e2e test that reads a report checks it, so
/// the schema describes what runs write.
pub fn check_report_schema(report: &serde_json::Value) {
    let schema: serde_json::Value =
        serde_json::from_str(include_str!("../../report.schema.json")).expect("schema is JSON");
    let errors = schema::violations(&schema, report);
    assert!(
        errors.is_empty(),
        "report.json does not match scenarios/report.schema.json: {errors:#?}\n{report:#}"
    );
}
