//! A run that stops for an error (here: the ledger cannot be written, as on a full disk) ends
//! every process with a non-zero status and the reason on the terminal: the aggregator, its
//! client agents and `fedrl run` (issue 15, item 3). The write failure is injected with the
//! aggregator's test-only `FEDRL_TEST_FAIL_LEDGER_AFTER=N` (the appends after N round records
//! fail as a write error): a full filesystem that fills at the right moment needs root.

mod e2e_support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use e2e_support::*;
use fedrl_aggregator::service::read_address_file;
use fedrl_aggregator::state;
use fedrl_common::privacy::ledger::PrivacyLedger;

const FAIL_AFTER: &str = "FEDRL_TEST_FAIL_LEDGER_AFTER";

const SCENARIO: &str = r#"
name = "e2e-failure"
seed = 3
rounds = 8
users = 20
client_agents = 2
participation = { kind = "sampled", rate = 0.5 }
quorum = 3
round_deadline_s = 5.0
start_timeout_s = 60.0
clip_norm = 1.0
noise_multiplier = 2.0
target_epsilon = 1000.0
checkpoint_every = 1

[task]
kind = "mean_estimation"
dim = 8
"#;

fn ledger_records(state_dir: &Path) -> usize {
    let (_, records, _) = PrivacyLedger::read(state_dir.join(state::LEDGER_FILE)).unwrap();
    records.len()
}

#[test]
fn a_ledger_write_failure_stops_the_aggregator_and_its_clients_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = write(dir.path(), "s.toml", SCENARIO);
    let state_dir = dir.path().join("state");
    let secret = prepare_state(&state_dir);
    let log = dir.path().join("agg.log");
    let f = std::fs::File::create(&log).unwrap();
    let child = Command::new(exe())
        .args(["aggregator", "--scenario"])
        .arg(&scenario)
        .arg("--state-dir")
        .arg(&state_dir)
        .env(FAIL_AFTER, "3")
        .stdout(Stdio::from(f.try_clone().unwrap()))
        .stderr(Stdio::from(f))
        .spawn()
        .unwrap();
    let mut agg = Proc {
        name: "aggregator".into(),
        child,
        log,
    };
    let t0 = Instant::now();
    let addr = loop {
        if let Ok(a) = read_address_file(&state_dir)
            && a.pid == agg.child.id()
        {
            break a;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{}", agg.log_text());
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut clients = [
        client(
            "c1",
            &addr,
            &token(&secret, "c1"),
            "0..10",
            &dir.path().join("c1.log"),
        ),
        client(
            "c2",
            &addr,
            &token(&secret, "c2"),
            "10..20",
            &dir.path().join("c2.log"),
        ),
    ];

    let ledger = state_dir.join(state::LEDGER_FILE).display().to_string();
    let status = agg.wait(Duration::from_secs(60));
    let log = agg.log_text();
    assert_eq!(status.code(), Some(1), "{status}:\n{log}");
    assert!(
        log.contains("error: the run stopped with an error"),
        "{log}"
    );
    assert!(log.contains("not released"), "{log}");
    assert!(log.contains(&ledger), "the error names the ledger: {log}");
    let report = report(&state_dir);
    assert_eq!(report["outcome"], "failed", "{report}");
    assert!(
        report["finished"].as_str().unwrap().contains(&ledger),
        "{report}"
    );
    assert_eq!(ledger_records(&state_dir), 3);
    assert!(!state_dir.join("checkpoint.tmp").exists());
    for c in clients.iter_mut() {
        let status = c.wait(Duration::from_secs(30));
        let log = c.log_text();
        assert_eq!(status.code(), Some(1), "{}: {status}\n{log}", c.name);
        assert!(log.contains("aggregator stopped: "), "{log}");
        assert!(log.contains(&ledger), "{log}");
    }
}

#[test]
fn fedrl_run_exits_non_zero_with_the_reason_when_the_ledger_fails() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = write(dir.path(), "s.toml", SCENARIO);
    let out = dir.path().join("out");
    let o = Command::new(exe())
        .arg("run")
        .arg(&scenario)
        .arg("--out")
        .arg(&out)
        .env(FAIL_AFTER, "2")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}\n{stdout}");
    assert!(
        stderr.contains("the run stopped with an error")
            && stderr.contains("not released")
            && stderr.contains(
                &out.join("state")
                    .join(state::LEDGER_FILE)
                    .display()
                    .to_string()
            ),
        "{stderr}"
    );
    // No normal short run is printed, and no report.json as if the run had ended.
    assert!(!stdout.contains("rounds released"), "{stdout}");
    assert!(!out.join(state::REPORT_FILE).exists());
    assert!(!out.join("state").join("checkpoint.tmp").exists());
    assert_eq!(ledger_records(&out.join("state")), 2);
}

/// Issue 59, item 7: a client agent whose own dataset cannot be loaded said "refused by the
/// aggregator"; it now says the failure is its own (here: its dataset root is a file, so the
/// dataset can be neither read nor stored).
#[test]
fn a_clients_own_dataset_failure_is_not_called_a_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let s = write(
        dir.path(),
        "s.toml",
        r#"
name = "e2e-client-dataset"
seed = 3
rounds = 3
users = 8
participation = { kind = "sampled", rate = 0.5 }
round_deadline_s = 5.0
start_timeout_s = 60.0
clip_norm = 1.0
noise_multiplier = 1.0
target_epsilon = 1000.0
unit_kind = "trajectory"

[task]
kind = "offline_cql"
transitions_per_unit = 2

[task.dataset]
env = "CartPole-v1"
units = 8
behaviour = { kind = "random" }

[task.cql]
hidden = [8]
"#,
    );
    let state_dir = dir.path().join("state");
    let secret = prepare_state(&state_dir);
    let (_agg, addr) = aggregator(&s, &state_dir, "127.0.0.1:0", &dir.path().join("agg.log"));
    let not_a_dir = write(
        dir.path(),
        "not-a-dir",
        "a file where the dataset root should be",
    );
    let mut cmd = Command::new(exe());
    cmd.args([
        "client",
        "--server",
        &addr.addr.to_string(),
        "--server-cert-sha256",
        &addr.fingerprint,
        "--token",
        &token(&secret, "c"),
        "--users",
        "0..8",
    ])
    .env("FEDRL_DATA_DIR", &not_a_dir);
    let mut c = spawn_command("c", &dir.path().join("c.log"), cmd);
    let status = c.wait(Duration::from_secs(60));
    let log = c.log_text();
    assert!(!status.success(), "{log}");
    assert!(log.contains("cannot build the trainer"), "{log}");
    assert!(
        log.contains("not-a-dir"),
        "the error names the dataset root: {log}"
    );
    assert!(!log.contains("refused by the aggregator"), "{log}");
    assert!(log.contains("the aggregator did not refuse it"), "{log}");
}
