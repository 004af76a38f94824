//! Bring your own data (issue 58): a dataset imported with `fedrl data import` is the data of a
//! private offline CQL run by name (`[task.dataset] name = ...`), its episodes mapped to
//! privacy units one per episode, by the unit stored with each episode, or by an episode
//! metadata key naming the owner; and every refusal before the run starts names the dataset and
//! the field at fault.

mod e2e_support;

use std::path::{Path, PathBuf};
use std::process::Command;

use e2e_support::*;
use fedrl_common::privacy::ledger::{PrivacyLedger, UnitKind};

/// 12 random CartPole episodes in 6 stored units of 2 episodes, each episode tagged with an
/// `owner` (3 owners of 2 stored units each), imported as `myorg/cartpole-v0` under
/// `dir/root`. Returns the root.
fn imported(dir: &Path) -> PathBuf {
    let src = dir.join("src");
    let root = dir.join("root");
    let (code, out, err) = fedrl_output(&[
        "data",
        "generate",
        "--data-dir",
        src.to_str().unwrap(),
        "--env",
        "CartPole-v1",
        "--behaviour",
        "random",
        "--units",
        "6",
        "--episodes-per-unit",
        "2",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let path = PathBuf::from(v["path"].as_str().unwrap());
    // The data holder's own episode metadata: who the episode belongs to.
    let owners = ["ann", "bob", "cy"];
    for i in 0..12 {
        let p = path.join("data").join(i.to_string()).join("metadata.json");
        let mut m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        let unit = m["unit"].as_u64().unwrap();
        m["owner"] = owners[(unit % 3) as usize].into();
        std::fs::write(&p, m.to_string()).unwrap();
    }
    let (code, out, err) = fedrl_output(&[
        "data",
        "import",
        path.to_str().unwrap(),
        "--id",
        "myorg/cartpole-v0",
        "--data-dir",
        root.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    // A Box-action dataset beside it (the continuous format), for the spaces refusal.
    let pendulum = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../rl/tests/fixtures/minari/pyfix/pendulum-random-v0");
    let (code, out, err) = fedrl_output(&[
        "data",
        "import",
        pendulum.to_str().unwrap(),
        "--data-dir",
        root.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    root
}

fn scenario(users: u64, unit_kind: &str, mode: &str, dataset: &str) -> String {
    format!(
        r#"
name = "e2e-stored"
seed = 5
rounds = 6
users = {users}
client_agents = 2
participation = {{ kind = "sampled", rate = 0.5 }}
round_deadline_s = 60.0
start_timeout_s = 120.0
clip_norm = 1.0
noise_multiplier = 1.0
target_epsilon = 1000.0
unit_kind = "{unit_kind}"

[task]
kind = "offline_cql"
mode = "{mode}"
eval_every = 1000
eval_episodes = 1
final_eval_episodes = 2

[task.dataset]
{dataset}

[task.cql]
hidden = [8]
"#
    )
}

/// `fedrl run` of `text` with the data root `root`: (success, stderr).
fn run(dir: &Path, root: &Path, name: &str, text: &str) -> (bool, String, PathBuf) {
    let file = write(dir, &format!("{name}.toml"), text);
    let out = dir.join(name);
    let o = Command::new(exe())
        .arg("run")
        .arg(&file)
        .arg("--out")
        .arg(&out)
        .env("FEDRL_DATA_DIR", root)
        .output()
        .unwrap();
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stderr),
            String::from_utf8_lossy(&o.stdout)
        ),
        out,
    )
}

/// Every round's sampled units lie in 0..users, and together they reach past the first few.
fn check_ledger(out: &Path, users: u64, kind: UnitKind) {
    let l = PrivacyLedger::read_file(out.join("operator").join("privacy.ledger")).unwrap();
    assert_eq!(l.config.unit_kind, kind);
    let records = l.records();
    assert_eq!(records.len(), 6);
    let mut seen = std::collections::BTreeSet::new();
    for r in &records {
        for u in &r.units {
            assert!(*u < users, "unit {u} outside 0..{users}");
            seen.insert(*u);
        }
    }
    assert!(seen.len() as u64 > users / 2, "sampled units: {seen:?}");
}

#[test]
fn a_private_cql_run_reads_an_imported_dataset_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let root = imported(dir.path());

    // One unit per episode (the default), federated: 12 units.
    let (ok, log, out) = run(
        dir.path(),
        &root,
        "episode",
        &scenario(
            12,
            "trajectory",
            "federated",
            "name = \"myorg/cartpole-v0\"",
        ),
    );
    assert!(ok, "{log}");
    check_ledger(&out, 12, UnitKind::Trajectory);
    let report = std::fs::read_to_string(out.join("report.json")).unwrap();
    // The exact unit count stays out of the public files (the scenario's users is public).
    assert!(!report.contains("in 12 units"), "{report}");
    // The stored scenario says which dataset and mapping ran.
    let stored = std::fs::read_to_string(out.join("scenario.toml")).unwrap();
    assert!(stored.contains("myorg/cartpole-v0"), "{stored}");

    // By owner, in the central mode: 3 users, each all of its 4 episodes.
    let (ok, log, out) = run(
        dir.path(),
        &root,
        "owner",
        &scenario(
            3,
            "user",
            "central",
            "name = \"myorg/cartpole-v0\"\nunits = { metadata_key = \"owner\" }",
        ),
    );
    assert!(ok, "{log}");
    check_ledger(&out, 3, UnitKind::User);
}

#[test]
fn stored_dataset_refusals_name_the_dataset_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let root = imported(dir.path());
    let refused = |name: &str, text: String, wants: &[&str]| {
        let (ok, log, _) = run(dir.path(), &root, name, &text);
        assert!(!ok, "{name} ran");
        for w in wants {
            assert!(log.contains(w), "{name}: no {w:?} in:\n{log}");
        }
    };
    let base = |users: u64, kind: &str, dataset: &str| scenario(users, kind, "federated", dataset);
    refused(
        "missing",
        base(12, "trajectory", "name = \"myorg/absent-v0\""),
        &["myorg/absent-v0", "fedrl data list", "fedrl data import"],
    );
    // With its environment named, the scenario loads without the data (an aggregator's
    // machine need not hold it), and `fedrl run` still refuses before starting anything.
    refused(
        "missing-with-env",
        base(
            12,
            "trajectory",
            "name = \"myorg/absent-v0\"\nenv = \"CartPole-v1\"",
        ),
        &["myorg/absent-v0", "fedrl data list", "fedrl data import"],
    );
    // Users must equal the unit count under the mapping: 12 episodes, 6 stored units, 3 owners.
    refused(
        "users-episode",
        base(6, "trajectory", "name = \"myorg/cartpole-v0\""),
        &[
            "users (6)",
            "myorg/cartpole-v0",
            "units = \"episode\"",
            "(12",
        ],
    );
    refused(
        "users-stored",
        base(
            12,
            "user",
            "name = \"myorg/cartpole-v0\"\nunits = \"stored\"",
        ),
        &["users (12)", "units = \"stored\"", "(6"],
    );
    refused(
        "users-owner",
        base(
            6,
            "user",
            "name = \"myorg/cartpole-v0\"\nunits = { metadata_key = \"owner\" }",
        ),
        &["users (6)", "metadata_key = \"owner\"", "(3"],
    );
    refused(
        "no-key",
        base(
            3,
            "user",
            "name = \"myorg/cartpole-v0\"\nunits = { metadata_key = \"team\" }",
        ),
        &["myorg/cartpole-v0", "\"team\"", "every episode"],
    );
    // The label must say what one contribution holds.
    refused(
        "kind",
        base(
            3,
            "trajectory",
            "name = \"myorg/cartpole-v0\"\nunits = { metadata_key = \"owner\" }",
        ),
        &["unit_kind", "user"],
    );
    refused(
        "both",
        base(
            12,
            "trajectory",
            "name = \"myorg/cartpole-v0\"\nbehaviour = { kind = \"random\" }",
        ),
        &["`name` names a stored dataset", "behaviour", "not both"],
    );
    refused(
        "neither",
        base(12, "trajectory", "units = \"episode\""),
        &["only a stored dataset takes", "name ="],
    );
    refused(
        "typo",
        base(
            12,
            "trajectory",
            "name = \"myorg/cartpole-v0\"\nunit = \"episode\"",
        ),
        &["unknown field `unit`"],
    );
    // The evaluation environment must have the dataset's spaces.
    refused(
        "spaces",
        base(
            12,
            "trajectory",
            "name = \"myorg/cartpole-v0\"\nenv = \"Acrobot-v1\"",
        ),
        &["myorg/cartpole-v0", "Discrete(2)", "Acrobot-v1"],
    );
    refused(
        "box",
        base(
            3,
            "trajectory",
            "name = \"continuous/pyfix-pendulum-random-v0\"",
        ),
        &[
            "continuous/pyfix-pendulum-random-v0",
            "Box",
            "discrete-action",
        ],
    );
    // A dataset that records no environment fedrl simulates needs `env`.
    let meta = root.join("myorg/cartpole-v0/data/metadata.json");
    let text = std::fs::read_to_string(&meta).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    m["fedrl_env_id"] = "Unknown-v9".into();
    std::fs::write(&meta, m.to_string()).unwrap();
    refused(
        "env",
        base(12, "trajectory", "name = \"myorg/cartpole-v0\""),
        &["task.dataset.env", "Unknown-v9", "fedrl sim list"],
    );
    // Naming the environment gets past that, and then the SHA-256 check sees the edited file.
    refused(
        "sha",
        base(
            12,
            "trajectory",
            "name = \"myorg/cartpole-v0\"\nenv = \"CartPole-v1\"",
        ),
        &["metadata.json", "SHA-256", "damaged"],
    );
    std::fs::write(&meta, text).unwrap();

    // A standalone aggregator (no `fedrl run` in front) holds users to the unit count as well.
    for mode in ["federated", "central"] {
        let file = write(
            dir.path(),
            &format!("standalone-{mode}.toml"),
            &scenario(6, "trajectory", mode, "name = \"myorg/cartpole-v0\""),
        );
        let o = Command::new(exe())
            .args(["aggregator", "--scenario"])
            .arg(&file)
            .arg("--state-dir")
            .arg(dir.path().join(format!("standalone-{mode}")))
            .env("FEDRL_DATA_DIR", &root)
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{mode}: {log}");
        assert!(
            log.contains("users (6)") && log.contains("(12"),
            "{mode}: {log}"
        );
    }
}

fn privorl(units: &str) -> String {
    format!(
        r#"
name = "e2e-stored-privorl"
seed = 5
rounds = 8
users = 100
client_agents = 2
participation = {{ kind = "sampled", rate = 0.2 }}
round_deadline_s = 60.0
start_timeout_s = 120.0
clip_norm = 1.0
noise_multiplier = 1.0
target_epsilon = 1000.0
unit_kind = "transition"

[task]
kind = "privorl"
mode = "central"
transitions = 100
holdout_transitions = 40
synthetic_transitions = 30
eval_every = 4

[task.dataset]
name = "myorg/cartpole-v0"
units = "{units}"

[task.public]
env = "cartpole-b1"
units = 10
seed = 3
behaviour = {{ kind = "random" }}

[task.synth]
width = 16
blocks = 1
dim_t = 8
fourier_dim = 4
sample_steps = 4
batch_size = 32

[task.pretrain]
epochs = 1
pool_size = 16

[task.utility]
steps = 10
seeds = 1
eval_episodes = 2
eval_max_steps = 50
cql = {{ hidden = [8], batch_size = 16 }}
"#
    )
}

/// PrivORL-n's sensitive data can be a stored dataset, with transition-level units stated as
/// such; any coarser mapping is refused (one contribution is one transition).
#[test]
fn privorl_fine_tunes_on_a_stored_dataset_with_transition_units() {
    let dir = tempfile::tempdir().unwrap();
    let root = imported(dir.path());
    let (ok, log, _) = run(dir.path(), &root, "privorl-episode", &privorl("episode"));
    assert!(!ok, "ran");
    assert!(
        log.contains("PrivORL-n's privacy unit is one transition"),
        "{log}"
    );
    let (ok, log, out) = run(dir.path(), &root, "privorl", &privorl("transition"));
    assert!(ok, "{log}");
    let l = PrivacyLedger::read_file(out.join("operator").join("privacy.ledger")).unwrap();
    assert_eq!(l.config.unit_kind, UnitKind::Transition);
    assert_eq!(l.records().len(), 8);
    assert!(l.records().iter().flat_map(|r| &r.units).all(|u| *u < 100));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert!(report["synthetic_dataset"].is_object(), "{report}");
}

/// A PriMORL scenario over the stored continuous dataset `name` (`public` episodes public).
fn primorl_scenario(users: u64, dataset: &str) -> String {
    format!(
        r#"
name = "e2e-stored-primorl"
seed = 5
rounds = 4
users = {users}
client_agents = 2
participation = {{ kind = "sampled", rate = 0.5 }}
round_deadline_s = 60.0
start_timeout_s = 120.0
clip_norm = 0.5
noise_multiplier = 1.0
target_epsilon = 1000.0
unit_kind = "trajectory"

[task]
kind = "primorl"
eval_every = 2
patience = 10

[task.dataset]
{dataset}

[task.ensemble]
hidden = [8]
members = 2
clipping = "flat"
epochs = 1
batch_size = 32

[task.policy]
uncertainty = "max-pairwise-diff"
lambda = 1.0
rollout_length = 2
epochs = 1
updates_per_epoch = 4
rollout_batch = 8
batch_size = 8
hidden = [8]
eval_episodes = 1
public_start_fraction = 0.5
"#
    )
}

/// Issue 58: PriMORL reads a stored continuous dataset by name, its last `public` episodes the
/// public split and every other episode one trajectory unit; a standalone check holds `users`
/// to that count, and the mapping, the public split and the name are checked with messages
/// naming the field.
#[test]
fn primorl_reads_a_stored_continuous_dataset_by_name() {
    use fedrl_common::task::primorl::{ContinuousBehaviour, ContinuousDatasetSpec};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    // 12 random Pendulum episodes (a generated file: `fedrl data list` names it
    // `continuous/<file stem>`, as it does an imported one).
    let spec = ContinuousDatasetSpec {
        env: "Pendulum-v1".into(),
        units: 12,
        public: 0,
        seed: 3,
        behaviour: ContinuousBehaviour::Random,
        gymnasium: None,
    };
    fedrl_rl::offline::continuous::load_or_generate(&spec, &root, &mut |_| {}).unwrap();
    let stem = spec
        .file_name()
        .trim_end_matches(".safetensors")
        .to_string();
    let name = format!("name = \"continuous/{stem}\"\npublic = 2");

    let (ok, log, out) = run(dir.path(), &root, "primorl", &primorl_scenario(10, &name));
    assert!(ok, "{log}");
    let l = PrivacyLedger::read_file(out.join("operator").join("privacy.ledger")).unwrap();
    assert_eq!(l.config.unit_kind, UnitKind::Trajectory);
    let sampled: std::collections::BTreeSet<u64> =
        l.records().iter().flat_map(|r| r.units.clone()).collect();
    assert!(!sampled.is_empty());
    assert!(sampled.iter().all(|u| *u < 10), "{sampled:?}");
    assert!(out.join("report.json").is_file());
    let stored = std::fs::read_to_string(out.join("scenario.toml")).unwrap();
    assert!(stored.contains(&stem), "{stored}");

    let refused = |what: &str, text: String, wants: &[&str]| {
        let (ok, log, _) = run(dir.path(), &root, what, &text);
        assert!(!ok, "{what} ran");
        for w in wants {
            assert!(log.contains(w), "{what}: no {w:?} in:\n{log}");
        }
    };
    refused(
        "primorl-users",
        primorl_scenario(12, &name),
        &["users (12)", "(10", "public"],
    );
    refused(
        "primorl-public",
        primorl_scenario(10, &format!("name = \"continuous/{stem}\"\npublic = 12")),
        &["task.dataset.public = 12", "too few episodes"],
    );
    refused(
        "primorl-no-public",
        primorl_scenario(10, &format!("name = \"continuous/{stem}\"\npublic = 0")),
        &["task.dataset.public must be >= 1"],
    );
    refused(
        "primorl-stored-units",
        primorl_scenario(10, &format!("{name}\nunits = \"stored\"")),
        &["task.dataset.units", "trajectory"],
    );
    refused(
        "primorl-minari-name",
        primorl_scenario(10, "name = \"myorg/cartpole-v0\"\npublic = 2"),
        &["continuous/<name>", "myorg/cartpole-v0"],
    );
    refused(
        "primorl-absent",
        primorl_scenario(10, "name = \"continuous/absent\"\npublic = 2"),
        &["continuous/absent", "fedrl data list"],
    );
    refused(
        "primorl-both",
        primorl_scenario(10, &format!("{name}\nseed = 1")),
        &["`name` names a stored dataset", "seed", "not both"],
    );

    // A standalone aggregator (no `fedrl run` in front) holds users to the count too.
    let file = write(dir.path(), "standalone.toml", &primorl_scenario(11, &name));
    let o = Command::new(exe())
        .arg("aggregator")
        .arg("--scenario")
        .arg(&file)
        .arg("--state-dir")
        .arg(dir.path().join("standalone-state"))
        .env("FEDRL_DATA_DIR", &root)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{log}");
    assert!(log.contains("users (11)"), "{log}");
}
