//! A seeded `fedrl run` with `journal = "full"`: its event journal, replayed through a fresh
//! engine with the same configuration and entropy, reproduces every ledger record, and its
//! releases, applied to a fresh model, reproduce the final model bit for bit. The default
//! (digest) journal of the same run holds no update values and refuses to replay.

mod e2e_support;

use std::path::Path;
use std::process::Command;

use e2e_support::*;
use fedrl_aggregator::checkpoint;
use fedrl_aggregator::engine::{Action, Engine, Resume, for_seed};
use fedrl_aggregator::journal::{JOURNAL_FILE, JournalReader, ReplayError, replay};
use fedrl_common::privacy::ledger::PrivacyLedger;
use fedrl_common::scenario::Scenario;

const SCENARIO: &str = r#"
name = "e2e-journal"
seed = 4
rounds = 5
users = 30
client_agents = 2
participation = { kind = "sampled", rate = 0.5 }
round_deadline_s = 10.0
clip_norm = 1.0
noise_multiplier = 1.0
target_epsilon = 50.0
checkpoint_every = 1

[task]
kind = "mean_estimation"
dim = 16
"#;

fn run(dir: &Path, journal: &str) -> std::path::PathBuf {
    let scenario = write(
        dir,
        "s.toml",
        &format!("journal = \"{journal}\"\n{SCENARIO}"),
    );
    let out = dir.join("out");
    let o = Command::new(exe())
        .arg("run")
        .arg(&scenario)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "fedrl run failed: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    out
}

fn fresh_engine(scenario: &Scenario) -> Engine {
    Engine::new(
        fedrl_aggregator::engine_config(scenario).unwrap(),
        Resume::default(),
        for_seed(scenario.seed),
    )
    .unwrap()
}

#[test]
fn a_full_journal_of_a_real_run_replays_its_releases_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(dir.path(), "full");
    let scenario = Scenario::from_file(out.join("scenario.toml")).unwrap();
    let state = out.join("state");
    let (entries, torn) = JournalReader::read_all(state.join(JOURNAL_FILE)).unwrap();
    assert_eq!(torn, None);
    let actions = replay(&mut fresh_engine(&scenario), entries).unwrap();

    // The same ledger records (the driver stamps the wall-clock time on append).
    let (_, ledger, _) =
        PrivacyLedger::read(state.join(fedrl_aggregator::state::LEDGER_FILE)).unwrap();
    assert_eq!(ledger.len(), 5);
    let replayed: Vec<_> = actions
        .iter()
        .filter_map(|(_, a)| match a {
            Action::AppendLedger { record, .. } => Some((**record).clone()),
            _ => None,
        })
        .collect();
    let stamped: Vec<_> = ledger
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.unix_time_s = 0.0;
            r
        })
        .collect();
    assert_eq!(replayed, stamped);

    // The releases, applied to a fresh model, give the run's final model to the bit.
    let mut model = fedrl_tasks::server_model(&scenario).unwrap();
    let mut releases = 0;
    for (_, a) in &actions {
        if let Action::Release(r) = a {
            model.apply(&r.noisy_mean).unwrap();
            releases += 1;
        }
    }
    assert_eq!(releases, 5);
    let (_, saved) = checkpoint::load(&state)
        .unwrap()
        .expect("a final checkpoint");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&model.state().tensors), bits(&saved.tensors));
}

#[test]
fn the_default_journal_holds_digests_only() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(dir.path(), "digest");
    let scenario = Scenario::from_file(out.join("scenario.toml")).unwrap();
    let (entries, _) = JournalReader::read_all(out.join("state").join(JOURNAL_FILE)).unwrap();
    assert!(
        matches!(
            replay(&mut fresh_engine(&scenario), entries),
            Err(ReplayError::MissingBody { .. })
        ),
        "a digest journal must not replay"
    );
}
