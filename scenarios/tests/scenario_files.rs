//! Every scenario file shipped in `scenarios/` parses and validates, and each DPPG scenario has
//! its non-private twin.

use std::path::PathBuf;

use fedrl_common::scenario::Task;
use fedrl_rl::task::{scenario_from_file, scenario_from_toml_str};

fn scenario_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .filter(|p| p.file_name().is_some_and(|n| n != "Cargo.toml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_scenario_file_is_valid() {
    let files = scenario_files();
    assert!(files.len() >= 11, "{files:?}");
    for f in &files {
        let s = scenario_from_file(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let stem = f.file_stem().unwrap().to_string_lossy().to_string();
        assert_eq!(s.name, stem, "{}: name should match the file", f.display());
        if matches!(s.task, Task::Dppg(_) | Task::LogLinearPg(_)) {
            if stem.ends_with("-nonprivate") {
                assert!(s.non_private, "{stem} must be non-private");
            } else {
                assert!(!s.non_private, "{stem} must be private");
                assert!(
                    s.target_epsilon <= 1.0,
                    "{stem}: the DPPG targets are epsilon <= 1"
                );
                let twin = f.with_file_name(format!("{stem}-nonprivate.toml"));
                assert!(twin.exists(), "{stem} has no twin {}", twin.display());
            }
        }
    }
}

#[test]
fn the_default_scenario_is_cartpole_dppg_at_epsilon_below_one() {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cartpole-dppg.toml"),
    )
    .unwrap();
    let s = scenario_from_toml_str(&text).unwrap();
    let eps = fedrl_common::privacy::gaussian::epsilon(s.noise_multiplier, s.delta).unwrap();
    assert!(eps <= 1.0, "one fresh user's epsilon is {eps}");
    assert!(eps <= s.target_epsilon);
}
