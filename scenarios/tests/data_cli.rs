//! `fedrl data`: generate a tiny dataset, list it, summarise it as JSON, import it under a new
//! id, and the errors a user sees.

use std::path::Path;
use std::process::Command;

fn fedrl(root: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_fedrl"))
        .args(args)
        .arg("--data-dir")
        .arg(root)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("run fedrl")
}

fn json_of(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not one JSON document ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

const TINY: &[&str] = &[
    "data",
    "generate",
    "--env",
    "CartPole-v1",
    "--behaviour",
    "ppo_mixed",
    "--iterations",
    "2",
    "--checkpoints",
    "2",
    "--units",
    "5",
    "--episodes-per-unit",
    "2",
    "--seed",
    "9",
    "--json",
];

#[test]
fn generate_list_summary_import() {
    let root = tempfile::tempdir().unwrap();
    let gen_out = json_of(&fedrl(root.path(), TINY));
    let id = gen_out["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("fedrl/cartpole-ppo_mixed-"), "{id}");
    assert_eq!(gen_out["source"], "generated");
    assert_eq!(gen_out["summary"]["episodes"], 10);
    assert_eq!(gen_out["summary"]["units"], 5);
    assert_eq!(gen_out["checkpoints"].as_array().unwrap().len(), 2);
    assert!(
        Path::new(gen_out["path"].as_str().unwrap())
            .join("data")
            .is_dir()
    );

    // The same spec again comes from the cache.
    let again = json_of(&fedrl(root.path(), TINY));
    assert_eq!(again["source"], "cache");
    assert_eq!(again["id"], gen_out["id"]);
    assert_eq!(again["summary"], gen_out["summary"]);

    let listed = json_of(&fedrl(root.path(), &["data", "list", "--json"]));
    let ds = listed["datasets"].as_array().unwrap();
    assert_eq!(ds.len(), 1);
    assert_eq!(ds[0]["id"], id.as_str());
    assert_eq!(ds[0]["total_episodes"], 10);

    let summary = json_of(&fedrl(root.path(), &["data", "summary", &id, "--json"]));
    assert_eq!(summary["summary"], gen_out["summary"]);
    let steps = summary["summary"]["steps"].as_u64().unwrap();
    assert!(steps >= 10);
    assert!(
        summary["summary"]["return_min"].as_f64().unwrap()
            <= summary["summary"]["return_median"].as_f64().unwrap()
    );

    // Import the folder under a new id (into a second root), then summarise it by path.
    let other = tempfile::tempdir().unwrap();
    let imported = json_of(&fedrl(
        other.path(),
        &[
            "data",
            "import",
            gen_out["path"].as_str().unwrap(),
            "--id",
            "mine/copy-v1",
            "--json",
        ],
    ));
    assert_eq!(imported["id"], "mine/copy-v1");
    assert_eq!(imported["units_assigned"], 0);
    let by_path = json_of(&fedrl(
        other.path(),
        &[
            "data",
            "summary",
            imported["path"].as_str().unwrap(),
            "--json",
        ],
    ));
    let mut want = gen_out["summary"].clone();
    want["id"] = "mine/copy-v1".into();
    assert_eq!(by_path["summary"], want);

    // Importing twice under the same id is refused.
    let out = fedrl(
        other.path(),
        &[
            "data",
            "import",
            gen_out["path"].as_str().unwrap(),
            "--id",
            "mine/copy-v1",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("exists already"));
}

#[test]
fn import_of_a_python_minari_dataset_assigns_missing_units() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../rl/tests/fixtures/minari/pyfix/cartpole-random-v0");
    let root = tempfile::tempdir().unwrap();
    let out = json_of(&fedrl(
        root.path(),
        &["data", "import", fixture.to_str().unwrap(), "--json"],
    ));
    assert_eq!(out["id"], "pyfix/cartpole-random-v0");
    assert_eq!(out["units_assigned"], 1);
    assert_eq!(out["summary"]["episodes"], 3);
    assert_eq!(out["summary"]["steps"], 40);
    assert_eq!(out["summary"]["units"], 3);
}

/// Issue 58: a Minari dataset with Box actions imports into the continuous format (PriMORL's),
/// listed and summarised as `continuous/<id with / as ->`; the discrete path is unchanged.
#[test]
fn import_of_a_box_action_dataset_goes_to_the_continuous_format() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../rl/tests/fixtures/minari/pyfix/pendulum-random-v0");
    let root = tempfile::tempdir().unwrap();
    let out = json_of(&fedrl(
        root.path(),
        &["data", "import", fixture.to_str().unwrap(), "--json"],
    ));
    assert_eq!(out["id"], "continuous/pyfix-pendulum-random-v0");
    assert_eq!(out["units_assigned"], 1);
    assert_eq!(out["summary"]["act_dim"], 1);
    assert_eq!(out["summary"]["steps"], 15);
    assert!(
        root.path()
            .join("continuous/pyfix-pendulum-random-v0.safetensors.sha256")
            .is_file()
    );
    let list = json_of(&fedrl(root.path(), &["data", "list", "--json"]));
    let ids: Vec<&str> = list["datasets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["continuous/pyfix-pendulum-random-v0"]);
    let s = json_of(&fedrl(
        root.path(),
        &[
            "data",
            "summary",
            "continuous/pyfix-pendulum-random-v0",
            "--json",
        ],
    ));
    assert_eq!(s["summary"]["env_id"], "Pendulum-v1");
    assert_eq!(s["summary"]["episodes"], 3);
}

/// Issue 58: episode metadata keys a data holder recorded survive the import (a scenario maps
/// units by them), beside the unit fedrl stores.
#[test]
fn import_keeps_the_episodes_own_metadata() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../rl/tests/fixtures/minari/pyfix/cartpole-random-v0");
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    copy_dir(&fixture, &src);
    let p = src.join("data/1/metadata.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    m["owner"] = "ann".into();
    std::fs::write(&p, m.to_string()).unwrap();
    let root = tmp.path().join("root");
    json_of(&fedrl(
        &root,
        &[
            "data",
            "import",
            src.to_str().unwrap(),
            "--id",
            "myorg/c-v0",
            "--json",
        ],
    ));
    let stored: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("myorg/c-v0/data/1/metadata.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(stored["owner"], "ann");
    assert_eq!(stored["unit"], 12);
    // The SHA-256 sums cover the merged metadata.
    assert!(fedrl_rl::offline::cache::verify_content(&root.join("myorg/c-v0")).unwrap());
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.path().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// Issue 58: a Minari dataset is imported by its id from Minari's root
/// (`$MINARI_DATASETS_PATH`), in Minari's arrow backend too; without `--data-dir` or
/// `$FEDRL_DATA_DIR`, fedrl stores into that same root.
#[test]
fn import_by_id_from_minari_root_in_the_arrow_format() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rl/tests/fixtures/minari");
    let minari_root = tempfile::tempdir().unwrap();
    let src = fixtures.join("pyfix/cartpole-random-arrow-v0");
    let dst = minari_root.path().join("pyfix/cartpole-random-arrow-v0");
    for entry in walk(&src) {
        let rel = entry.strip_prefix(&src).unwrap();
        std::fs::create_dir_all(dst.join(rel).parent().unwrap()).unwrap();
        std::fs::copy(&entry, dst.join(rel)).unwrap();
    }
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_fedrl"))
            .args(args)
            .env("MINARI_DATASETS_PATH", minari_root.path())
            .env_remove("FEDRL_DATA_DIR")
            .env("RAYON_NUM_THREADS", "1")
            .output()
            .expect("run fedrl")
    };
    let out = json_of(&run(&[
        "data",
        "import",
        "pyfix/cartpole-random-arrow-v0",
        "--id",
        "mine/cartpole-v0",
        "--json",
    ]));
    assert_eq!(out["summary"]["episodes"], 3);
    assert_eq!(out["summary"]["steps"], 40);
    assert!(
        minari_root
            .path()
            .join("mine/cartpole-v0/data/metadata.json")
            .is_file()
    );
    let out = run(&["data", "import", "pyfix/absent-v0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Minari's root"));
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn user_errors_are_clear() {
    let root = tempfile::tempdir().unwrap();
    let out = fedrl(root.path(), &["data", "summary", "nope/missing-v0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no dataset"));

    let out = fedrl(
        root.path(),
        &["data", "import", root.path().to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no data/ subfolder"));

    let out = fedrl(
        root.path(),
        &[
            "data",
            "generate",
            "--behaviour",
            "random",
            "--epsilon",
            "0.1",
        ],
    );
    assert_eq!(out.status.code(), Some(2));

    let spec = root.path().join("bad.toml");
    std::fs::write(&spec, "units = 3\ncolour = \"red\"\n").unwrap();
    let out = fedrl(
        root.path(),
        &["data", "generate", "--spec", spec.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("colour"));
}

#[test]
fn generate_from_a_spec_file() {
    let root = tempfile::tempdir().unwrap();
    let spec = root.path().join("spec.toml");
    std::fs::write(
        &spec,
        "env = \"acrobot-b1\"\nunits = 3\nseed = 1\n[behaviour]\nkind = \"random\"\n",
    )
    .unwrap();
    let out = json_of(&fedrl(
        root.path(),
        &[
            "data",
            "generate",
            "--spec",
            spec.to_str().unwrap(),
            "--json",
        ],
    ));
    assert!(
        out["id"]
            .as_str()
            .unwrap()
            .starts_with("fedrl/acrobot-b1-random-")
    );
    assert_eq!(out["summary"]["env_id"], "Acrobot-v1");
    assert_eq!(out["summary"]["units"], 3);
    assert_eq!(out["summary"]["n_actions"], 3);
}

/// `--continuous`: a PriMORL dataset spec (as a scenario's `[task.dataset]`) generated into the
/// continuous format, then found in the cache under the same name.
#[test]
fn generate_a_continuous_dataset_from_a_spec_file() {
    let root = tempfile::tempdir().unwrap();
    let spec = root.path().join("spec.toml");
    std::fs::write(
        &spec,
        "env = \"Pendulum-v1\"\nunits = 3\npublic = 1\nseed = 4\nbehaviour = { kind = \"random\" }\n",
    )
    .unwrap();
    let args = [
        "data",
        "generate",
        "--continuous",
        "--spec",
        spec.to_str().unwrap(),
        "--json",
    ];
    let out = json_of(&fedrl(root.path(), &args));
    assert_eq!(out["source"], "generated");
    let id = out["id"].as_str().unwrap();
    assert!(id.starts_with("continuous/pendulum_v1-"), "{id}");
    assert_eq!(out["summary"]["episodes"], 4);
    assert_eq!(out["summary"]["act_dim"], 1);
    let again = json_of(&fedrl(root.path(), &args));
    assert_eq!(again["source"], "cache");
    assert_eq!(again["summary"], out["summary"]);
    // A gymnasium: spec without its table is refused before anything starts.
    std::fs::write(
        &spec,
        "env = \"gymnasium:Pendulum-v1\"\nunits = 3\npublic = 1\nbehaviour = { kind = \"random\" }\n",
    )
    .unwrap();
    let bad = fedrl(root.path(), &args);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("[task.dataset.gymnasium]"), "{err}");
}

#[test]
fn experts_generate_and_summarise_with_their_return_spread() {
    let root = tempfile::tempdir().unwrap();
    let args = [
        "data",
        "generate",
        "--env",
        "CartPole-v1",
        "--behaviour",
        "experts",
        "--population",
        "cartpole-b1",
        "--iterations",
        "2",
        "--hidden",
        "8,8",
        "--max-steps",
        "50",
        "--units",
        "4",
        "--episodes-per-unit",
        "3",
        "--json",
    ];
    let g = json_of(&fedrl(root.path(), &args));
    let id = g["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("fedrl/cartpole-experts-"), "{id}");
    assert_eq!(g["summary"]["units"], 4);
    assert_eq!(g["summary"]["episodes"], 12);
    assert_eq!(g["training_returns"].as_array().unwrap().len(), 2);
    assert_eq!(g["expert_returns"]["experts"], 4);
    assert!(g["expert_returns"]["max"].as_f64().unwrap() <= 50.0);
    let s = json_of(&fedrl(root.path(), &["data", "summary", &id, "--json"]));
    assert_eq!(s["expert_returns"], g["expert_returns"]);
    // Expert flags without the experts behaviour are a usage error.
    let bad = fedrl(
        root.path(),
        &[
            "data",
            "generate",
            "--behaviour",
            "random",
            "--p-min",
            "0.1",
        ],
    );
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--behaviour experts"));
    // A shared start is another dataset (another key), and its iterations are in the curve.
    let mut warm: Vec<&str> = args[..args.len() - 1].to_vec();
    warm.extend(["--shared-iterations", "3", "--expert-lr", "1e-3", "--json"]);
    let w = json_of(&fedrl(root.path(), &warm));
    assert_ne!(w["id"], g["id"]);
    assert_eq!(w["training_returns"].as_array().unwrap().len(), 5);
}

#[test]
fn continuous_datasets_are_listed_and_summarised() {
    use fedrl_common::task::primorl::{ContinuousBehaviour, ContinuousDatasetSpec};
    let root = tempfile::tempdir().unwrap();
    let spec = ContinuousDatasetSpec {
        env: "Pendulum-v1".into(),
        units: 4,
        public: 1,
        seed: 2,
        behaviour: ContinuousBehaviour::Random,
        gymnasium: None,
    };
    let ds =
        fedrl_rl::offline::continuous::load_or_generate(&spec, root.path(), &mut |_| {}).unwrap();
    let listed = json_of(&fedrl(root.path(), &["data", "list", "--json"]));
    let listed = listed["datasets"].as_array().unwrap();
    assert_eq!(listed.len(), 1);
    let id = listed[0]["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("continuous/pendulum"), "{id}");
    assert_eq!(listed[0]["total_episodes"], 5);
    assert_eq!(listed[0]["total_steps"], 1000);

    let s = json_of(&fedrl(root.path(), &["data", "summary", &id, "--json"]));
    assert_eq!(s["summary"]["episodes"], 5);
    assert_eq!(s["summary"]["act_dim"], 1);
    let best = ds
        .episodes
        .iter()
        .map(|e| e.total_return())
        .fold(f64::NEG_INFINITY, f64::max);
    assert!((s["summary"]["return_max"].as_f64().unwrap() - best).abs() < 1e-9);
    // By path too; an unknown name is a clear error.
    let by_path = json_of(&fedrl(
        root.path(),
        &[
            "data",
            "summary",
            listed[0]["path"].as_str().unwrap(),
            "--json",
        ],
    ));
    assert_eq!(by_path["summary"], s["summary"]);
    let missing = fedrl(root.path(), &["data", "summary", "continuous/nothing"]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("fedrl data list"));
}

/// Issue 59, item 7: one corrupt cached dataset made `fedrl data list` fail entirely, and a
/// truncated continuous file was listed as complete; now the others are listed and each damaged
/// one is marked with its problem.
#[test]
fn damaged_datasets_are_marked_and_the_others_listed() {
    use fedrl_common::offline::{Behaviour, DatasetSpec};
    use fedrl_common::task::primorl::{ContinuousBehaviour, ContinuousDatasetSpec};
    let root = tempfile::tempdir().unwrap();
    let spec = DatasetSpec {
        env: "CartPole-v1".into(),
        population_seed: 0,
        behaviour: Behaviour::Random,
        units: 3,
        episodes_per_unit: 1,
        seed: 1,
        gymnasium: None,
    };
    fedrl_rl::offline::cache::load_or_generate(&spec, root.path(), &mut |_| {}).unwrap();
    let mut bad_spec = spec.clone();
    bad_spec.seed = 2;
    fedrl_rl::offline::cache::load_or_generate(&bad_spec, root.path(), &mut |_| {}).unwrap();
    let bad_dir =
        fedrl_rl::offline::minari::dataset_dir(root.path(), &bad_spec.minari_id()).unwrap();
    std::fs::write(bad_dir.join("data/metadata.json"), b"{ not json").unwrap();
    let cspec = ContinuousDatasetSpec {
        env: "Pendulum-v1".into(),
        units: 2,
        public: 1,
        seed: 2,
        behaviour: ContinuousBehaviour::Random,
        gymnasium: None,
    };
    fedrl_rl::offline::continuous::load_or_generate(&cspec, root.path(), &mut |_| {}).unwrap();
    let good = root.path().join("continuous").join(cspec.file_name());
    let cut = root.path().join("continuous/pendulum-cut.safetensors");
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();

    let listed = json_of(&fedrl(root.path(), &["data", "list", "--json"]));
    let ds = listed["datasets"].as_array().unwrap();
    assert_eq!(ds.len(), 4, "{listed}");
    let by_id = |id: &str| {
        ds.iter()
            .find(|d| d["id"] == id)
            .unwrap_or_else(|| panic!("{id} missing: {listed}"))
    };
    assert!(by_id(&spec.minari_id())["problem"].is_null());
    let bad = &by_id(&bad_spec.minari_id())["problem"];
    assert!(bad.as_str().unwrap().contains("metadata.json"), "{bad}");
    let cut_problem = by_id("continuous/pendulum-cut")["problem"]
        .as_str()
        .unwrap();
    assert!(cut_problem.contains("truncated"), "{cut_problem}");
    let stem = good.file_stem().unwrap().to_string_lossy();
    assert!(by_id(&format!("continuous/{stem}"))["problem"].is_null());

    let text = fedrl(root.path(), &["data", "list"]);
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    assert_eq!(text.matches("DAMAGED").count(), 2, "{text}");
}
