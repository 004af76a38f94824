//! The state directory's safety checks, with the real `fedrl aggregator` processes: one
//! aggregator per state directory (finding 2 of the privacy review), and a resume that would
//! misreport epsilon is refused (finding 1): a checkpoint ahead of its ledger, or a larger
//! `target_epsilon` than the ledger was created with unless `--allow-budget-increase`.

mod e2e_support;

use std::path::Path;
use std::time::Duration;

use e2e_support::*;
use fedrl_common::privacy::ledger::PrivacyLedger;

fn scenario(rounds: u64, target_epsilon: f64) -> String {
    format!(
        r#"
name = "e2e-state-dir"
seed = 11
rounds = {rounds}
users = 20
participation = {{ kind = "sampled", rate = 0.5 }}
quorum = 3
round_deadline_s = 5.0
start_timeout_s = 60.0
clip_norm = 1.0
noise_multiplier = 2.0
target_epsilon = {target_epsilon}
checkpoint_every = 1

[task]
kind = "mean_estimation"
dim = 8
"#
    )
}

fn ledger_rounds(state_dir: &Path) -> Vec<u64> {
    let (_, records, _) =
        PrivacyLedger::read(state_dir.join(fedrl_aggregator::state::LEDGER_FILE)).unwrap();
    records.iter().map(|r| r.round).collect()
}

/// Runs 4 rounds to completion in `dir/state`; returns the state directory.
fn finished_run(dir: &Path) -> std::path::PathBuf {
    let s = write(dir, "s.toml", &scenario(4, 20.0));
    let state_dir = dir.join("state");
    let secret = prepare_state(&state_dir);
    let (mut agg, addr) = aggregator(&s, &state_dir, "127.0.0.1:0", &dir.join("agg.log"));
    let mut c = client(
        "c",
        &addr,
        &token(&secret, "c"),
        "0..20",
        &dir.join("c.log"),
    );
    assert!(
        agg.wait(Duration::from_secs(90)).success(),
        "{}",
        agg.log_text()
    );
    assert!(
        c.wait(Duration::from_secs(30)).success(),
        "{}",
        c.log_text()
    );
    assert_eq!(ledger_rounds(&state_dir), [1, 2, 3, 4]);
    state_dir
}

/// Waits for a start that must fail; returns its log.
fn refused(mut p: Proc) -> String {
    let status = p.wait(Duration::from_secs(30));
    assert!(
        !status.success(),
        "the start was not refused:\n{}",
        p.log_text()
    );
    p.log_text()
}

#[test]
fn a_second_aggregator_on_one_state_dir_fails_and_the_first_is_unaffected() {
    let dir = tempfile::tempdir().unwrap();
    let s = write(dir.path(), "s.toml", &scenario(4, 20.0));
    let state_dir = dir.path().join("state");
    let secret = prepare_state(&state_dir);
    let (mut first, addr) = aggregator(&s, &state_dir, "127.0.0.1:0", &dir.path().join("agg1.log"));
    let log = refused(spawn_aggregator(
        &s,
        &state_dir,
        &[],
        &dir.path().join("agg2.log"),
    ));
    assert!(log.contains("in use by another aggregator"), "{log}");
    assert!(
        log.contains(&state_dir.display().to_string()),
        "the error names the directory: {log}"
    );
    assert!(
        log.contains(&format!("pid {}", first.child.id())),
        "the error names the holder: {log}"
    );
    // The first one still listens at its address and runs its clients to the end.
    let mut c = client(
        "c",
        &addr,
        &token(&secret, "c"),
        "0..20",
        &dir.path().join("c.log"),
    );
    assert!(
        first.wait(Duration::from_secs(90)).success(),
        "{}",
        first.log_text()
    );
    assert!(
        c.wait(Duration::from_secs(30)).success(),
        "{}",
        c.log_text()
    );
    assert_eq!(ledger_rounds(&state_dir), [1, 2, 3, 4]);
}

#[test]
fn a_checkpoint_ahead_of_its_ledger_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = finished_run(dir.path());
    // The reproduced finding: the ledger deleted, the run resumed with more rounds.
    std::fs::remove_file(state_dir.join(fedrl_aggregator::state::LEDGER_FILE)).unwrap();
    let more = write(dir.path(), "more.toml", &scenario(8, 20.0));
    let log = refused(spawn_aggregator(
        &more,
        &state_dir,
        &[],
        &dir.path().join("resume.log"),
    ));
    assert!(
        log.contains("the checkpointed model's privacy history is not in the ledger"),
        "{log}"
    );
    assert!(log.contains("covers 4 ledger records"), "{log}");
}

#[test]
fn a_larger_target_epsilon_on_resume_needs_the_operators_flag() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = finished_run(dir.path());
    let raised = write(dir.path(), "raised.toml", &scenario(8, 40.0));
    let log = refused(spawn_aggregator(
        &raised,
        &state_dir,
        &[],
        &dir.path().join("refused.log"),
    ));
    assert!(
        log.contains("asks for target epsilon 40, above the 20 the ledger allows"),
        "{log}"
    );
    assert!(log.contains("--allow-budget-increase"), "{log}");
    assert_eq!(ledger_rounds(&state_dir), [1, 2, 3, 4]);
    // With the flag it resumes, and says so in its log.
    let (agg, _) = aggregator_with(
        &raised,
        &state_dir,
        "127.0.0.1:0",
        &["--allow-budget-increase"],
        &dir.path().join("allowed.log"),
    );
    let t0 = std::time::Instant::now();
    while !agg.log_text().contains("resuming from checkpoint") {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", agg.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = agg.log_text();
    assert!(
        log.contains("privacy budget raised by the operator (--allow-budget-increase): target epsilon 20 -> 40 (recorded in the ledger)"),
        "{log}"
    );
    // A lower target needs no flag (it only makes the budget check stricter).
    drop(agg);
    let lower = write(dir.path(), "lower.toml", &scenario(8, 10.0));
    let (agg, _) = aggregator(
        &lower,
        &state_dir,
        "127.0.0.1:0",
        &dir.path().join("lower.log"),
    );
    drop(agg);
}

/// Issue 59, item 5: a run that stops short of its rounds for lack of units says so and ends
/// as failed (exit non-zero, `outcome: failed`) unless the scenario sets `allow_fewer_rounds`.
/// A scenario that cannot reach its rounds is refused at load, so the case arises here from a
/// resume with a smaller cohort after the first process used every unit.
#[test]
fn a_run_short_of_units_fails_unless_the_scenario_allows_it() {
    let dir = tempfile::tempdir().unwrap();
    let text = |cohort: u64, rounds: u64, allow: bool| {
        format!(
            "name = \"short\"\nseed = 5\nrounds = {rounds}\nusers = 40\nparticipation = {{ kind = \"fresh\" }}\ncohort_size = {cohort}\nquorum = 5\nround_deadline_s = 10.0\nstart_timeout_s = 60.0\nnoise_multiplier = 2.0\ntarget_epsilon = 50.0\ncheckpoint_every = 1\nallow_fewer_rounds = {allow}\n[task]\nkind = \"mean_estimation\"\ndim = 4\n"
        )
    };
    let state_dir = dir.path().join("state");
    let secret = prepare_state(&state_dir);
    // Two rounds of 20 use all 40 units.
    let s1 = write(dir.path(), "s1.toml", &text(20, 2, false));
    let (mut agg, addr) = aggregator(&s1, &state_dir, "127.0.0.1:0", &dir.path().join("a1.log"));
    let mut c = client(
        "c",
        &addr,
        &token(&secret, "c"),
        "0..40",
        &dir.path().join("c1.log"),
    );
    assert!(
        agg.wait(Duration::from_secs(90)).success(),
        "{}",
        agg.log_text()
    );
    c.wait(Duration::from_secs(30));
    assert_eq!(ledger_rounds(&state_dir), [1, 2]);
    // Four rounds of 10 (40 users are enough at load), resumed at round 3: no unit is left.
    let s2 = write(dir.path(), "s2.toml", &text(10, 4, false));
    let p = spawn_aggregator(&s2, &state_dir, &[], &dir.path().join("a2.log"));
    let log = refused(p);
    assert!(
        log.contains("stopped short of its 4 rounds") && log.contains("allow_fewer_rounds"),
        "{log}"
    );
    let r = report(&state_dir);
    assert_eq!(r["outcome"], "failed", "{r}");
    // Allowed: the same end is a finished run.
    let s3 = write(dir.path(), "s3.toml", &text(10, 4, true));
    let mut p = spawn_aggregator(&s3, &state_dir, &[], &dir.path().join("a3.log"));
    assert!(
        p.wait(Duration::from_secs(60)).success(),
        "{}",
        p.log_text()
    );
    let r = report(&state_dir);
    assert_eq!(r["outcome"], "finished", "{r}");
    assert!(
        r["finished"]
            .as_str()
            .unwrap()
            .contains("never contributed"),
        "{r}"
    );
}

/// Issue 59, item 7: restarting a finished run whose checkpoint was deleted trained a fresh
/// model and overwrote `report.json` (the final evaluation was lost); now it is refused and the
/// report is kept byte for byte.
#[test]
fn a_finished_run_without_its_checkpoint_is_refused_and_its_report_kept() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = finished_run(dir.path());
    std::fs::remove_file(state_dir.join(fedrl_aggregator::checkpoint::CHECKPOINT_FILE)).unwrap();
    let report = state_dir.join(fedrl_aggregator::state::REPORT_FILE);
    let operator = state_dir
        .join(fedrl_aggregator::state::OPERATOR_DIR)
        .join(fedrl_aggregator::state::REPORT_FILE);
    let before = (
        std::fs::read(&report).unwrap(),
        std::fs::read(&operator).unwrap(),
    );
    let s = write(dir.path(), "again.toml", &scenario(4, 20.0));
    let log = refused(spawn_aggregator(
        &s,
        &state_dir,
        &[],
        &dir.path().join("again.log"),
    ));
    assert!(log.contains("says this run finished"), "{log}");
    assert!(log.contains("checkpoint"), "{log}");
    assert!(
        !log.contains("listening"),
        "refused before listening: {log}"
    );
    let after = (
        std::fs::read(&report).unwrap(),
        std::fs::read(&operator).unwrap(),
    );
    assert!(before == after, "the reports are untouched");
    assert_eq!(ledger_rounds(&state_dir), [1, 2, 3, 4]);
}

/// Issue 59, item 4: the last ledger record cut off (a whole frame: the chain stays valid) is
/// caught against the ledger head the run's report recorded, even with the checkpoint gone.
#[test]
fn a_ledger_cut_at_its_end_is_refused_against_the_reports_head() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = finished_run(dir.path());
    let ledger = state_dir.join(fedrl_aggregator::state::LEDGER_FILE);
    let file = PrivacyLedger::read_file(&ledger).unwrap();
    assert_eq!(file.head().entries, 4);
    let bytes = std::fs::read(&ledger).unwrap();
    // The last frame: a 48-byte chained frame header, then its payload.
    let mut at = 0;
    let mut last = 0;
    while at < bytes.len() {
        let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
        last = at;
        at += 48 + len;
    }
    std::fs::write(&ledger, &bytes[..last]).unwrap();
    std::fs::remove_file(state_dir.join(fedrl_aggregator::checkpoint::CHECKPOINT_FILE)).unwrap();
    let s = write(dir.path(), "more.toml", &scenario(8, 20.0));
    let log = refused(spawn_aggregator(
        &s,
        &state_dir,
        &[],
        &dir.path().join("resume.log"),
    ));
    assert!(
        log.contains("holds 3 entries, but 4 were recorded"),
        "{log}"
    );
    assert!(log.contains("operator/report.json"), "{log}");
}

/// Issue 59, item 7: non-zero garbage at the end of `events.journal` blocked a resume but was
/// reported only after "listening"; now the start stops before listening, naming the file and
/// what to do.
#[test]
fn garbage_at_the_end_of_the_journal_stops_the_start_before_listening() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = finished_run(dir.path());
    let journal = state_dir.join("events.journal");
    let mut bytes = std::fs::read(&journal).unwrap();
    bytes.extend_from_slice(&[0xab; 100]);
    std::fs::write(&journal, &bytes).unwrap();
    let s = write(dir.path(), "more.toml", &scenario(8, 20.0));
    let log = refused(spawn_aggregator(
        &s,
        &state_dir,
        &[],
        &dir.path().join("resume.log"),
    ));
    assert!(
        !log.contains("listening"),
        "refused before listening: {log}"
    );
    assert!(log.contains(&journal.display().to_string()), "{log}");
    assert!(log.contains("move it away"), "{log}");
    assert_eq!(std::fs::read(&journal).unwrap(), bytes, "nothing was cut");
}
