//! An interrupted aggregator (SIGTERM, SIGINT) with the real `fedrl` processes: it tells its
//! clients "shutting down, come back", writes its report and exits with the signal's status; the
//! clients keep reconnecting; a restart on the same state directory runs the remaining rounds with
//! the same clients, and every round is attempted exactly once (issue 15, item 2).

mod e2e_support;

use std::path::Path;
use std::time::{Duration, Instant};

use e2e_support::*;
use fedrl_common::privacy::ledger::PrivacyLedger;

const ROUNDS: u64 = 10;

const SCENARIO: &str = r#"
name = "e2e-shutdown"
seed = 7
rounds = 10
users = 40
participation = { kind = "sampled", rate = 0.5 }
quorum = 5
round_deadline_s = 5.0
start_timeout_s = 60.0
clip_norm = 1.0
noise_multiplier = 2.0
target_epsilon = 1000.0
checkpoint_every = 1

[churn]
# Rounds last a little while, so the signal lands inside one.
added_latency_s = 0.2

[task]
kind = "mean_estimation"
dim = 16
"#;

/// Rounds of `metrics.jsonl` lines with `status`.
fn rounds_with(state_dir: &Path, status: &str) -> Vec<u64> {
    metrics(state_dir)
        .iter()
        .filter(|m| m["status"] == status)
        .map(|m| m["round"].as_u64().unwrap())
        .collect()
}

fn wait_released(agg: &Proc, state_dir: &Path, n: usize) {
    let t0 = Instant::now();
    while rounds_with(state_dir, "released").len() < n {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "fewer than {n} rounds released:\n{}",
            agg.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `signal` to the aggregator, checks its exit status, its message and its report, and that
/// the clients are still running 2 s later (reconnecting, not finished).
fn interrupt(agg: &mut Proc, signal: i32, clients: &mut [&mut Proc], state_dir: &Path) {
    let pid = agg.child.id() as i32;
    // SAFETY: kill(2) on a child we spawned and have not reaped.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    let status = agg.wait(Duration::from_secs(30));
    let log = agg.log_text();
    assert_eq!(status.code(), Some(128 + signal), "{status}:\n{log}");
    assert!(log.contains("interrupted"), "{log}");
    assert!(log.contains("resume with the same --state-dir"), "{log}");
    let report = report(state_dir);
    assert_eq!(report["outcome"], "interrupted", "{report}");
    std::thread::sleep(Duration::from_secs(2));
    for c in clients.iter_mut() {
        assert!(
            c.child.try_wait().unwrap().is_none(),
            "{} exited after the aggregator's shutdown:\n{}",
            c.name,
            c.log_text()
        );
    }
}

#[test]
fn an_interrupted_aggregator_resumes_with_the_same_clients() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = write(dir.path(), "s.toml", SCENARIO);
    let state_dir = dir.path().join("state");
    let secret = prepare_state(&state_dir);
    let (mut agg, addr) = aggregator(
        &scenario,
        &state_dir,
        "127.0.0.1:0",
        &dir.path().join("agg1.log"),
    );
    let listen = addr.addr.to_string();
    let mut c1 = client(
        "c1",
        &addr,
        &token(&secret, "c1"),
        "0..20",
        &dir.path().join("c1.log"),
    );
    let mut c2 = client(
        "c2",
        &addr,
        &token(&secret, "c2"),
        "20..40",
        &dir.path().join("c2.log"),
    );

    // SIGTERM mid-run, then a restart on the same state directory and address.
    wait_released(&agg, &state_dir, 3);
    interrupt(&mut agg, libc::SIGTERM, &mut [&mut c1, &mut c2], &state_dir);
    let (mut agg, _) = aggregator(&scenario, &state_dir, &listen, &dir.path().join("agg2.log"));

    // SIGINT (Ctrl-C) a little later, then the restart that finishes the run.
    wait_released(&agg, &state_dir, 6);
    interrupt(&mut agg, libc::SIGINT, &mut [&mut c1, &mut c2], &state_dir);
    let (mut agg, _) = aggregator(&scenario, &state_dir, &listen, &dir.path().join("agg3.log"));
    let status = agg.wait(Duration::from_secs(90));
    assert!(status.success(), "{status}:\n{}", agg.log_text());
    assert_eq!(report(&state_dir)["outcome"], "finished");
    for c in [&mut c1, &mut c2] {
        let status = c.wait(Duration::from_secs(30));
        assert!(status.success(), "{}: {status}\n{}", c.name, c.log_text());
    }

    // Every round attempted exactly once over the three processes (the round open at each
    // interrupt was not released, and ran again after the restart); the ledger holds each
    // released round once.
    let released = rounds_with(&state_dir, "released");
    let mut attempted = released.clone();
    attempted.extend(rounds_with(&state_dir, "abandoned"));
    attempted.sort_unstable();
    assert_eq!(attempted, (1..=ROUNDS).collect::<Vec<_>>());
    let (_, records, recovery) =
        PrivacyLedger::read(state_dir.join(fedrl_aggregator::state::LEDGER_FILE)).unwrap();
    assert_eq!(recovery.torn_bytes, 0);
    let ledger: Vec<u64> = records.iter().map(|r| r.round).collect();
    assert_eq!(ledger, released);
}
