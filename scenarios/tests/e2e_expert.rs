//! Expert-level Selective DP-SGD end to end (seed 000/002): `fedrl run` trains a small set of
//! experts, runs the DataRelease over QUIC (the agents answer prefix-count queries for the
//! experts they host), publishes D_stable, and trains with the public schedule of DP and free
//! steps, in both update modes. The ledger holds the release and exactly the schedule's DP
//! steps; the report names what was released.

mod e2e_support;

use std::path::Path;
use std::process::Command;

use e2e_support::*;
use fedrl_aggregator::engine::{Action, Engine, Resume, for_seed};
use fedrl_aggregator::journal::{JOURNAL_FILE, JournalReader, replay};
use fedrl_common::privacy::ledger::PrivacyLedger;
use fedrl_common::selective::{Schedule, SelectiveConfig};

/// 48 experts of 2 demonstrations each; p_min = 0.5 makes every expert the uniform policy, so
/// every prefix of length h has count 48 / 2^h, and the first one or two steps pass the sparse
/// vector test (theta-hat is about 8 at this large, test-only, release budget).
fn scenario(mode: &str, p: f64) -> String {
    format!(
        r#"
name = "e2e-expert-{mode}"
seed = 5
journal = "full"
users = 48
client_agents = 2
participation = {{ kind = "sampled", rate = 0.5 }}
round_deadline_s = 60.0
start_timeout_s = 300.0
clip_norm = 1.0
noise_multiplier = 1.0
delta = 0.01
target_epsilon = 1000.0
unit_kind = "expert"
checkpoint_every = 5

[task]
kind = "offline_cql"
mode = "{mode}"
eval_every = 5
eval_episodes = 1
final_eval_episodes = 2
eval_max_steps = 30

[task.selective]
steps = 20
unstable_probability = {p}
stable_batch = 8
schedule_seed = 2
release = {{ epsilon = 200.0, delta = 0.005, trajectories = 4, horizon = 40 }}

[task.dataset]
env = "CartPole-v1"
units = 48
episodes_per_unit = 2
behaviour = {{ kind = "experts", population = "cartpole-b1", per_setting = 3, iterations = 2, hidden = [8], p_min = 0.5, max_steps = 40 }}

[task.cql]
hidden = [16]
learning_rate = 1e-3
target_update_interval = 5
"#
    )
}

fn run(dir: &Path, data: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let file = write(dir, &format!("{name}.toml"), text);
    let out = dir.join(name);
    let o = Command::new(exe())
        .arg("run")
        .arg(&file)
        .arg("--out")
        .arg(&out)
        .env("FEDRL_DATA_DIR", data)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "fedrl run ({name}) failed: {}\n{stdout}",
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(stdout.contains("DataRelease:"), "{stdout}");
    out
}

fn schedule(p: f64) -> Schedule {
    Schedule::new(&SelectiveConfig {
        steps: 20,
        unstable_probability: p,
        stable_batch: 8,
        schedule_seed: 2,
        release: None,
    })
}

/// The run's full journal, replayed through a fresh engine with the scenario's configuration and
/// seed, reproduces the DataRelease and every round: the same ledger records (release first) and
/// the same D_stable, transition for transition.
fn replays_bit_for_bit(out: &Path, published: &fedrl_rl::offline::TransitionBatch) {
    let scenario = fedrl_tasks::scenario_from_file(out.join("scenario.toml")).unwrap();
    let state = out.join("state");
    let (entries, torn) = JournalReader::read_all(state.join(JOURNAL_FILE)).unwrap();
    assert_eq!(torn, None);
    let mut engine = Engine::new(
        fedrl_aggregator::engine_config(&scenario).unwrap(),
        Resume::default(),
        for_seed(scenario.seed),
    )
    .unwrap();
    let actions = replay(&mut engine, entries).unwrap();
    let replayed: Vec<_> = actions
        .iter()
        .filter_map(|(_, a)| match a {
            Action::AppendLedger { record, .. } => Some((**record).clone()),
            _ => None,
        })
        .collect();
    let (_, ledger, _) =
        PrivacyLedger::read(state.join(fedrl_aggregator::state::LEDGER_FILE)).unwrap();
    let stamped: Vec<_> = ledger
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.unix_time_s = 0.0;
            r
        })
        .collect();
    assert_eq!(replayed, stamped);
    assert_eq!(replayed[0].phase, "release");
    let stable: Vec<f32> = actions
        .iter()
        .find_map(|(_, a)| match a {
            Action::PublishStable(s) => {
                Some(s.prefixes.iter().flat_map(|(_, r)| r.clone()).collect())
            }
            _ => None,
        })
        .expect("the replay publishes D_stable");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&stable),
        bits(&fedrl_rl::offline::dpsgd::encode_rows(published))
    );
}

#[test]
fn selective_dp_sgd_releases_prefixes_then_charges_exactly_the_scheduled_dp_steps() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    for (mode, p) in [("federated", 0.5), ("central", 0.5)] {
        let out = run(dir.path(), &data, mode, &scenario(mode, p));
        let k = schedule(p).dp_steps();
        assert!(
            k > 0 && k < 20,
            "the schedule mixes both kinds of step: {k}"
        );
        let ledger = PrivacyLedger::read_file(out.join("operator").join("privacy.ledger")).unwrap();
        let recs = ledger.records();
        assert_eq!(
            recs.len() as u64,
            1 + k,
            "{mode}: the release, then K DP steps"
        );
        assert_eq!(recs[0].phase, "release");
        assert_eq!(recs[0].units.len(), 48, "the release charges every expert");
        assert!(recs[1..].iter().all(|r| r.phase != "release"));
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap())
                .unwrap();
        assert_eq!(report["rounds_completed"].as_u64(), Some(k), "{report}");
        check_report_schema(&report);
        let rel = &report["selective"]["release"];
        assert_eq!(rel["trajectories_walked"], 4, "{report}");
        let stable = rel["stable_transitions"].as_u64().unwrap();
        assert!(stable > 0, "uniform experts give stable prefixes: {report}");
        // The derived ceiling T x L*, beside what was released.
        let longest = rel["max_stable_prefix"].as_u64().unwrap();
        assert_eq!(rel["stable_transitions_bound"].as_u64(), Some(4 * longest));
        // The wait for the agents' data is part of the release's time, and said apart.
        let (total, wait) = (
            rel["release_seconds"].as_f64().unwrap(),
            rel["agents_ready_seconds"].as_f64().unwrap(),
        );
        assert!(wait >= 0.0 && wait <= total, "{report}");
        // D_stable is published in Minari's layout, with no expert id in it.
        let path = out.join(rel["published"].as_str().unwrap());
        let published = fedrl_rl::offline::minari::read(&path).unwrap();
        assert_eq!(published.dataset.transitions().len() as u64, stable);
        replays_bit_for_bit(&out, &published.dataset.transitions());
        assert!(
            report["final_evaluation"]["final_eval_return"]
                .as_f64()
                .is_some()
        );
        // Evaluations every 5 training steps, DP and free alike, drawn against steps.
        let steps: Vec<u64> = report["final_evaluation"]["curve"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, vec![5, 10, 15, 20], "{report}");
        assert!(out.join("learning_curve.png").is_file());
        // Seed 000's normalised score beside it (CartPole: return / the evaluation horizon).
        let fe = &report["final_evaluation"];
        assert_eq!(
            fe["final_normalized_score"].as_f64(),
            fe["final_eval_return"].as_f64().map(|r| r / 30.0),
            "{report}"
        );
        let op: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("operator").join("report.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(op["updates_rejected"], 0, "{op}");
        assert!(
            op["timings"]["data_release_s"].as_f64().unwrap() > 0.0,
            "{op}"
        );
    }
}

#[test]
fn released_prefixes_alone_need_no_dp_step() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let out = run(
        dir.path(),
        &data,
        "stable-only",
        &scenario("federated", 0.0),
    );
    let ledger = PrivacyLedger::read_file(out.join("operator").join("privacy.ledger")).unwrap();
    assert_eq!(ledger.records().len(), 1, "only the release is charged");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["rounds_completed"], 0, "{report}");
    check_report_schema(&report);
    assert!(report["epsilon"].as_f64().unwrap() > 0.0);
    // No round, yet a learning curve: the free steps are evaluated by step.
    let curve = report["final_evaluation"]["curve"].as_array().unwrap();
    assert_eq!(curve.len(), 4, "{report}");
    assert!(curve.iter().all(|e| e["dp_steps"] == 0));
    assert!(out.join("learning_curve.png").is_file());
}

/// `fedrl ARGS` with the datasets in `data` and `RUST_LOG=info`, output to `log`.
fn spawn_fedrl(name: &str, data: &Path, log: &Path, args: &[String]) -> Proc {
    let mut cmd = Command::new(exe());
    cmd.args(args)
        .env("FEDRL_DATA_DIR", data)
        .env("RUST_LOG", "info");
    spawn_command(name, log, cmd)
}

fn agent_args(
    addr: &fedrl_aggregator::service::AddressFile,
    token: &str,
    users: &str,
) -> Vec<String> {
    [
        "client",
        "--server",
        &addr.addr.to_string(),
        "--server-cert-sha256",
        &addr.fingerprint,
        "--token",
        token,
        "--users",
        users,
        "--give-up-after",
        "60",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Issue 55's probe over QUIC: beside two honest agents, one claiming experts 0..3000 and a
/// fifth honest agent whose experts overlap one already hosted are refused at their join,
/// before the release can start (so before anything is published); none of them is ever sent a
/// candidate, and D_stable is the one of a run without them, transition for transition.
#[test]
fn agents_with_out_of_range_or_overlapping_experts_are_refused_before_the_release() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    // The clean run (two agents, 0..24 and 24..48) also generates and caches the dataset.
    let clean = run(dir.path(), &data, "clean", &scenario("federated", 0.0));
    let clean_rel = fedrl_tasks::scenario_from_file(clean.join("scenario.toml")).unwrap();
    let (entries, _) = JournalReader::read_all(clean.join("state").join(JOURNAL_FILE)).unwrap();
    let mut engine = Engine::new(
        fedrl_aggregator::engine_config(&clean_rel).unwrap(),
        Resume::default(),
        for_seed(clean_rel.seed),
    )
    .unwrap();
    let stable_of = |actions: &[(f64, Action)]| -> Vec<(u64, u32, u32, Vec<u32>)> {
        actions
            .iter()
            .find_map(|(_, a)| match a {
                Action::PublishStable(s) => Some(
                    s.prefixes
                        .iter()
                        .map(|(p, r)| {
                            (
                                p.unit,
                                p.episode,
                                p.steps,
                                r.iter().map(|x| x.to_bits()).collect(),
                            )
                        })
                        .collect(),
                ),
                _ => None,
            })
            .expect("D_stable published")
    };
    let clean_stable = stable_of(&replay(&mut engine, entries).unwrap());

    let state = dir.path().join("probe");
    let secret = prepare_state(&state);
    let file = write(dir.path(), "probe.toml", &scenario("federated", 0.0));
    let log = |n: &str| dir.path().join(format!("{n}.log"));
    let (mut agg, addr) = {
        let _ = std::fs::remove_file(state.join(fedrl_aggregator::state::ADDRESS_FILE));
        let args: Vec<String> = [
            "aggregator",
            "--scenario",
            &file.display().to_string(),
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            &state.display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let p = spawn_fedrl("aggregator", &data, &log("agg"), &args);
        let t0 = std::time::Instant::now();
        loop {
            if let Ok(a) = fedrl_aggregator::service::read_address_file(&state)
                && a.pid == p.child.id()
            {
                break (p, a);
            }
            assert!(t0.elapsed().as_secs() < 60, "{}", p.log_text());
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let joined = |agg: &Proc, n: usize| {
        let t0 = std::time::Instant::now();
        while agg.log_text().matches("client joined").count() < n {
            assert!(t0.elapsed().as_secs() < 60, "{}", agg.log_text());
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let tok = |id: &str| token(&secret, id);
    let _a = spawn_fedrl(
        "a",
        &data,
        &log("a"),
        &agent_args(&addr, &tok("a"), "0..24"),
    );
    joined(&agg, 1);
    let mut hostile = spawn_fedrl(
        "hostile",
        &data,
        &log("hostile"),
        &agent_args(&addr, &tok("hostile"), "0..3000"),
    );
    let mut overlap = spawn_fedrl(
        "overlap",
        &data,
        &log("overlap"),
        &agent_args(&addr, &tok("overlap"), "20..30"),
    );
    let d = std::time::Duration::from_secs(90);
    assert!(!hostile.wait(d).success(), "{}", hostile.log_text());
    assert!(!overlap.wait(d).success(), "{}", overlap.log_text());
    assert!(
        overlap.log_text().contains("overlap units 0..24"),
        "{}",
        overlap.log_text()
    );
    // Only now can every expert be hosted and the release start.
    let _b = spawn_fedrl(
        "b",
        &data,
        &log("b"),
        &agent_args(&addr, &tok("b"), "24..48"),
    );
    assert!(
        agg.wait(std::time::Duration::from_secs(300)).success(),
        "{}",
        agg.log_text()
    );

    let scenario = fedrl_tasks::scenario_from_file(&file).unwrap();
    let (entries, _) = JournalReader::read_all(state.join(JOURNAL_FILE)).unwrap();
    let mut engine = Engine::new(
        fedrl_aggregator::engine_config(&scenario).unwrap(),
        Resume::default(),
        for_seed(scenario.seed),
    )
    .unwrap();
    let actions = replay(&mut engine, entries).unwrap();
    let publish = actions
        .iter()
        .position(|(_, a)| matches!(a, Action::PublishStable(_)))
        .expect("published");
    let refused: Vec<(usize, u64)> = actions
        .iter()
        .enumerate()
        .filter_map(|(i, (_, a))| match a {
            Action::Rejected { client, code, .. }
                if *code == fedrl_common::protocol::ErrorCode::UnitsInUse =>
            {
                Some((i, *client))
            }
            _ => None,
        })
        .collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(refused.iter().all(|(i, _)| *i < publish));
    for (_, a) in &actions {
        if let Action::QueryPrefix { client, .. } | Action::RequestSteps { client, .. } = a {
            assert!(
                refused.iter().all(|(_, c)| c != client),
                "a refused agent was queried"
            );
        }
    }
    assert_eq!(stable_of(&actions), clean_stable);
}

/// Issue 59, item 6: resuming an expert-level run keeps the report's `selective` section and
/// does not count the release's ledger record as a round; with the published D_stable gone,
/// the resume is refused with a clear message (it used to go on with "0 released transitions
/// read back").
#[test]
fn a_resumed_expert_run_keeps_its_release_or_refuses_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let out = run(dir.path(), &data, "resumed", &scenario("federated", 0.0));
    let read = |p: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let before = read(&out.join("report.json"));
    assert!(before["selective"]["release"].is_object(), "{before}");
    assert_eq!(before["rounds_completed"], 0, "{before}");
    let resume = |out: &Path| {
        Command::new(exe())
            .arg("run")
            .arg("--out")
            .arg(out)
            .arg("--resume")
            .env("FEDRL_DATA_DIR", &data)
            .output()
            .unwrap()
    };
    // The run is over: its resume attempts nothing, and reports what the run did.
    let o = resume(&out);
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{stderr}");
    let after = read(&out.join("report.json"));
    assert_eq!(
        after["rounds_completed"], 0,
        "the release counted as a round: {after}"
    );
    assert_eq!(after["selective"], before["selective"], "{after}");
    // D_stable deleted from the state directory: the resume is refused, saying what is missing.
    std::fs::remove_dir_all(out.join("state").join("d_stable")).unwrap();
    let o = resume(&out);
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "resumed without D_stable: {stderr}");
    assert!(
        stderr.contains("d_stable") && stderr.contains("missing"),
        "{stderr}"
    );
}

/// Issue 58: an experts dataset fedrl generated, named by its id (`[task.dataset] name = ...,
/// units = "stored"`), serves a DataRelease as its generation spec does (the same release and
/// schedule: the ledger and D_stable agree); a dataset without expert policies, or read with
/// another unit mapping, is refused before anything starts, saying why.
#[test]
fn a_stored_experts_dataset_serves_a_data_release_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("datasets");
    let text = scenario("federated", 0.5);
    let generated = run(dir.path(), &data, "generated", &text);
    let fedrl_common::scenario::Task::OfflineCql(task) =
        fedrl_tasks::scenario_from_toml_str(&text).unwrap().task
    else {
        unreachable!()
    };
    let id = task.dataset.generated().unwrap().minari_id();
    let (head, _) = text.split_once("[task.dataset]").unwrap();
    let (_, tail) = text.split_once("[task.cql]").unwrap();
    let by_name = |dataset: &str| format!("{head}[task.dataset]\n{dataset}\n\n[task.cql]{tail}");
    let named = run(
        dir.path(),
        &data,
        "named",
        &by_name(&format!("name = \"{id}\"\nunits = \"stored\"")),
    );
    let records = |out: &Path| {
        PrivacyLedger::read_file(out.join("operator").join("privacy.ledger"))
            .unwrap()
            .records()
            .iter()
            .map(|r| (r.phase.clone(), r.units.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(records(&generated), records(&named));
    let stable = |out: &Path| {
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap())
                .unwrap();
        r["selective"]["release"]["stable_transitions"].clone()
    };
    assert_eq!(stable(&generated), stable(&named));

    let refused = |name: &str, dataset: &str, wants: &[&str]| {
        let file = write(dir.path(), &format!("{name}.toml"), &by_name(dataset));
        let o = Command::new(exe())
            .arg("run")
            .arg(&file)
            .arg("--out")
            .arg(dir.path().join(name))
            .env("FEDRL_DATA_DIR", &data)
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{name} ran");
        for w in wants {
            assert!(log.contains(w), "{name}: no {w:?} in:\n{log}");
        }
    };
    refused(
        "episode-units",
        &format!("name = \"{id}\"\nunits = \"episode\""),
        &["task.dataset.units", "units = \"stored\""],
    );
    // A dataset without policies: random CartPole episodes in 48 units of 2.
    let random = fedrl_common::offline::DatasetSpec {
        behaviour: fedrl_common::offline::Behaviour::Random,
        units: 48,
        episodes_per_unit: 2,
        ..Default::default()
    };
    fedrl_rl::offline::load_or_generate(&random, &data, &mut |_| {}).unwrap();
    refused(
        "no-policies",
        &format!("name = \"{}\"\nunits = \"stored\"", random.minari_id()),
        &[
            "task.selective.release",
            "was not generated by experts",
            "remove task.selective.release",
        ],
    );
}
