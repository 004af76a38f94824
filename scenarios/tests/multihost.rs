//! A deployment across hosts (issue 15): the aggregator and three client agents, each in its
//! own network namespace, joined to the aggregator's namespace by a veth pair with real
//! addresses, every process started with the commands the README's "Deploying across machines"
//! documents. Faults: 5% random UDP loss on one client's link (nftables, both directions), another
//! client's link cut for 30 s and restored, and the aggregator killed (`kill -9`) and restarted on
//! its state directory while that link is down.
//!
//! Checked: rounds keep completing (the fraction is printed), the ledger never under-reports
//! (every round any process reported released is in it, and its epsilon is the report's), no unit
//! contributes twice (`fresh` participation across the restart), and every process exits with a
//! clear status.
//!
//! Needs root (namespaces) and `ip` and `nft`:
//! `scripts/install-netns-tools.sh && cargo test -p fedrl-scenarios --test multihost -- --ignored --nocapture`
//! (`.ci/run` runs it when it is root and the machine allows namespaces).

mod e2e_support;

use std::collections::HashSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use e2e_support::*;
use fedrl_aggregator::service::read_address_file;
use fedrl_aggregator::state;
use fedrl_common::privacy::ledger::PrivacyLedger;

const PORT: u16 = 47_433;
const CLIENTS: u32 = 3;
const USERS: u64 = 6_000;

const SCENARIO: &str = r#"
name = "multihost"
rounds = 90
users = 6000
participation = { kind = "fresh" }
cohort_size = 30
quorum = 10
round_deadline_s = 3.0
# The restarted aggregator starts without the host whose link is down.
start_timeout_s = 5.0
clip_norm = 1.0
noise_multiplier = 3.0
target_epsilon = 10.0
checkpoint_every = 5

[churn]
# Rounds last a while, so that the faults land in the middle of the run.
added_latency_s = 0.35

[task]
kind = "mean_estimation"
dim = 16
"#;

/// Runs the command line `cmd` (words split at whitespace; no shell), which must succeed.
fn sh(cmd: &str) {
    let words: Vec<&str> = cmd.split_whitespace().collect();
    let out = Command::new(words[0])
        .args(&words[1..])
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The namespaces of one test: `{prefix}a` (the aggregator's host) and `{prefix}c1..` (the
/// clients'), client k reaching the aggregator at 10.77.k.1 over the veth pair `{prefix}a{k}`
/// (in the aggregator's namespace) / `{prefix}c{k}` (in client k's, named like it). Deleted
/// when dropped.
struct Hosts {
    prefix: String,
}

impl Hosts {
    fn new() -> Hosts {
        let h = Hosts {
            prefix: format!("fr{}", std::process::id() % 1_000_000),
        };
        let agg = h.agg();
        sh(&format!("ip netns add {agg}"));
        sh(&format!("ip -n {agg} link set lo up"));
        for k in 1..=CLIENTS {
            let ns = h.client(k);
            let a_end = format!("{}a{k}", h.prefix);
            sh(&format!("ip netns add {ns}"));
            sh(&format!("ip -n {ns} link set lo up"));
            sh(&format!(
                "ip link add {a_end} netns {agg} type veth peer name {ns} netns {ns}"
            ));
            sh(&format!("ip -n {agg} addr add 10.77.{k}.1/24 dev {a_end}"));
            sh(&format!("ip -n {ns} addr add 10.77.{k}.2/24 dev {ns}"));
            sh(&format!("ip -n {agg} link set {a_end} up"));
            sh(&format!("ip -n {ns} link set {ns} up"));
        }
        h
    }

    fn agg(&self) -> String {
        format!("{}a", self.prefix)
    }

    /// Client k's namespace, and its end of the link.
    fn client(&self, k: u32) -> String {
        format!("{}c{k}", self.prefix)
    }

    /// Drops `percent`% of the UDP datagrams client k sends and receives, at random.
    fn random_loss(&self, k: u32, percent: u32) {
        let nft = format!("ip netns exec {} nft", self.client(k));
        sh(&format!("{nft} add table inet loss"));
        for (chain, hook) in [("in", "input"), ("out", "output")] {
            sh(&format!(
                "{nft} add chain inet loss {chain} {{ type filter hook {hook} priority 0 ; }}"
            ));
            sh(&format!(
                "{nft} add rule inet loss {chain} meta l4proto udp numgen random mod 100 < {percent} drop"
            ));
        }
    }

    fn set_link(&self, k: u32, up: bool) {
        let ns = self.client(k);
        let state = if up { "up" } else { "down" };
        sh(&format!("ip -n {ns} link set {ns} {state}"));
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth ends in it (and so the pairs).
        for ns in std::iter::once(self.agg()).chain((1..=CLIENTS).map(|k| self.client(k))) {
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        }
    }
}

/// `fedrl ARGS` inside namespace `ns`, output to `log`.
fn spawn_in(ns: &str, name: &str, args: &[String], log: &Path) -> Proc {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns]).arg(exe()).args(args);
    spawn_command(name, log, cmd)
}

fn start_aggregator(hosts: &Hosts, scenario: &Path, state_dir: &Path, log: &Path) -> Proc {
    let _ = std::fs::remove_file(state_dir.join(state::ADDRESS_FILE));
    let args: Vec<String> = [
        "aggregator",
        "--scenario",
        &scenario.display().to_string(),
        "--listen",
        &format!("0.0.0.0:{PORT}"),
        "--state-dir",
        &state_dir.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut p = spawn_in(&hosts.agg(), "aggregator", &args, log);
    let t0 = Instant::now();
    while read_address_file(state_dir).is_err() {
        if let Some(s) = p.child.try_wait().unwrap() {
            panic!("aggregator exited early ({s}):\n{}", p.log_text());
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{}", p.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    p
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn released_rounds(state_dir: &Path) -> Vec<u64> {
    metrics(state_dir)
        .iter()
        .filter(|m| m["status"] == "released")
        .map(|m| m["round"].as_u64().unwrap())
        .collect()
}

#[test]
#[ignore = "needs root: network namespaces (see the module docs for the command)"]
fn across_hosts_with_loss_a_cut_link_and_an_aggregator_restart() {
    let hosts = Hosts::new();
    hosts.random_loss(1, 5);
    let dir = tempfile::tempdir().unwrap();
    let scenario = write(dir.path(), "multihost.toml", SCENARIO);
    let state_dir = dir.path().join("state");

    // The operator issues one token per client agent (README: "Deploying across machines").
    let mut args = vec![
        "aggregator".to_string(),
        "--scenario".into(),
        scenario.display().to_string(),
        "--state-dir".into(),
        state_dir.display().to_string(),
    ];
    for k in 1..=CLIENTS {
        args.push("--issue-token".into());
        args.push(format!("host-c{k}"));
    }
    let out = Command::new(exe()).args(&args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tokens: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(tokens.len(), CLIENTS as usize);

    let mut agg = start_aggregator(&hosts, &scenario, &state_dir, &dir.path().join("agg1.log"));
    let fingerprint = read_address_file(&state_dir).unwrap().fingerprint;
    let per = USERS / CLIENTS as u64;
    let mut clients: Vec<Proc> = (1..=CLIENTS)
        .map(|k| {
            let k64 = k as u64;
            let args: Vec<String> = [
                "client",
                "--server",
                &format!("10.77.{k}.1:{PORT}"),
                "--server-cert-sha256",
                &fingerprint,
                "--token",
                &tokens[k as usize - 1],
                "--users",
                &format!("{}..{}", (k64 - 1) * per, k64 * per),
                "--give-up-after",
                "120",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            spawn_in(
                &hosts.client(k),
                &format!("client-{k}"),
                &args,
                &dir.path().join(format!("c{k}.log")),
            )
        })
        .collect();

    let wait_released = |n: usize, what: &str, agg: &Proc| {
        let t0 = Instant::now();
        while released_rounds(&state_dir).len() < n {
            assert!(
                t0.elapsed() < Duration::from_secs(90),
                "{what}: fewer than {n} rounds released:\n{}",
                agg.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_released(5, "start", &agg);

    // Client 2's link goes down for 30 s; while it is down the aggregator is killed and
    // restarted on its state directory (same port, same certificate).
    let cut_at = Instant::now();
    let cut_unix = now_s();
    hosts.set_link(2, false);
    let released_before_cut = released_rounds(&state_dir).len();
    wait_released(released_before_cut + 5, "during the cut", &agg);
    agg.child.kill().unwrap();
    let killed = agg.child.wait().unwrap();
    let before_kill = released_rounds(&state_dir);
    let (_, ledger_at_kill, _) = PrivacyLedger::read(state_dir.join(state::LEDGER_FILE)).unwrap();
    for r in &before_kill {
        assert!(
            ledger_at_kill.iter().any(|x| x.round == *r),
            "round {r} was released but is not in the ledger"
        );
    }
    let mut agg2 = start_aggregator(&hosts, &scenario, &state_dir, &dir.path().join("agg2.log"));
    let elapsed = cut_at.elapsed();
    std::thread::sleep(Duration::from_secs(30).saturating_sub(elapsed));
    hosts.set_link(2, true);
    let restored_at = now_s();

    let status = agg2.wait(Duration::from_secs(180));
    assert!(
        status.success(),
        "restarted aggregator: {status}\n{}",
        agg2.log_text()
    );
    let mut summaries = Vec::new();
    for c in clients.iter_mut() {
        let s = c.wait(Duration::from_secs(60));
        assert!(s.success(), "{} exited with {s}:\n{}", c.name, c.log_text());
        let text = c.log_text();
        let summary: serde_json::Value = text
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| panic!("{}: no summary:\n{text}", c.name));
        summaries.push(summary);
    }

    let (_, records, _) = PrivacyLedger::read(state_dir.join(state::LEDGER_FILE)).unwrap();
    let report = report(&state_dir);
    let completed = report["rounds_completed"].as_u64().unwrap();
    let abandoned = report["rounds_abandoned"].as_u64().unwrap();
    let released = released_rounds(&state_dir);
    println!(
        "multihost: {} rounds in the ledger; after the restart {completed} completed, {abandoned} abandoned ({:.1}% completed); first aggregator ended by {killed}",
        records.len(),
        100.0 * completed as f64 / (completed + abandoned).max(1) as f64,
    );
    println!("client summaries: {summaries:?}");
    let during_cut = records
        .iter()
        .filter(|r| r.unix_time_s > cut_unix && r.unix_time_s < restored_at)
        .count();
    println!(
        "multihost: {during_cut} rounds released while client 2's link was down (30 s, aggregator restarted in it)"
    );
    assert!(
        during_cut >= 10,
        "{during_cut} rounds released during the cut"
    );
    // Rounds kept completing: the whole plan ran, across the kill.
    assert_eq!(records.len(), 90, "{} rounds in the ledger", records.len());
    assert!(
        completed as f64 >= 0.5 * (completed + abandoned) as f64,
        "{completed} completed, {abandoned} abandoned"
    );
    // Never under-reports: every round reported released is in the ledger, once.
    for r in &released {
        assert_eq!(
            records.iter().filter(|x| x.round == *r).count(),
            1,
            "round {r}"
        );
    }
    let ledger_json = fedrl_json(&["ledger", &state_dir.display().to_string(), "--json"]);
    let eps_ledger = ledger_json["epsilon"].as_f64().unwrap();
    let eps_report = report["epsilon"].as_f64().unwrap();
    assert!(
        (eps_ledger - eps_report).abs() <= 1e-9 * eps_ledger.max(1.0),
        "ledger {eps_ledger} vs report {eps_report}"
    );
    // No unit contributes twice, across the restart.
    let mut seen = HashSet::new();
    for r in &records {
        for u in &r.units {
            assert!(
                seen.insert(*u),
                "unit {u} contributed twice (round {})",
                r.round
            );
        }
    }
    // Every client contributed: the lossy one, and the cut one after its link came back.
    for k in 1..=CLIENTS as u64 {
        let range = (k - 1) * per..k * per;
        assert!(
            records
                .iter()
                .any(|r| r.units.iter().any(|u| range.contains(u))),
            "client {k} never contributed"
        );
    }
    let range2 = per..2 * per;
    assert!(
        records
            .iter()
            .any(|r| r.unix_time_s > restored_at && r.units.iter().any(|u| range2.contains(u))),
        "client 2 did not contribute after its link came back"
    );
}
