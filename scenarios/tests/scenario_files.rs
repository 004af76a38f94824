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

/// The expert-level scenarios of seed 000/002: m = 3000 experts, delta = 1/m, epsilon 10; the
/// selective run and its DP-SGD twin plan within the budget (the release included), the rounds
/// are the schedule's DP steps, and each has its non-private twin.
#[test]
fn expert_scenarios_plan_within_the_budget_and_have_their_twins() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for env in ["cartpole", "acrobot", "hiv"] {
        let main = scenario_from_file(dir.join(format!("{env}-expert.toml"))).unwrap();
        let dpsgd = scenario_from_file(dir.join(format!("{env}-expert-dpsgd.toml"))).unwrap();
        let twin = scenario_from_file(dir.join(format!("{env}-expert-nonprivate.toml"))).unwrap();
        assert!(twin.non_private && twin.selective().is_none(), "{env}");
        for s in [&main, &dpsgd] {
            assert_eq!(s.users, 3000, "{env}");
            assert!((s.delta - 1.0 / 3000.0).abs() < 1e-15, "{env}: delta = 1/m");
            assert_eq!(s.target_epsilon, 10.0);
            let sel = s.selective().unwrap();
            let k = fedrl_common::selective::Schedule::new(sel).dp_steps();
            assert_eq!(s.rounds, k, "{env}: one round per DP step");
            let eps = s.planned_epsilon(s.noise_multiplier).unwrap();
            assert!(eps <= 10.0, "{env}: the plan costs {eps}");
        }
        assert!(main.release_event().unwrap().is_some(), "{env}");
        assert!(dpsgd.release_event().unwrap().is_none(), "{env}");
        assert_eq!(
            dpsgd.rounds,
            dpsgd.selective().unwrap().steps,
            "{env}: p = 1"
        );
    }
    // Appendix B.3: epsilon_1 = 3/4 epsilon for CartPole and HIV, epsilon for Acrobot.
    let release = |env: &str| {
        let s = scenario_from_file(dir.join(format!("{env}-expert.toml"))).unwrap();
        s.selective().unwrap().release.clone().unwrap().epsilon
    };
    assert_eq!(release("cartpole"), 7.5);
    assert_eq!(release("hiv"), 7.5);
    assert_eq!(release("acrobot"), 10.0);
}

/// A plan whose epsilon exceeds the target is refused before anything runs, with how many DP
/// steps would fit.
#[test]
fn an_expert_plan_over_the_budget_is_refused_up_front() {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cartpole-expert.toml"),
    )
    .unwrap()
    .replace("noise_multiplier = \"auto\"", "noise_multiplier = 0.3");
    let e = scenario_from_toml_str(&text).unwrap_err().to_string();
    assert!(
        e.contains("above target_epsilon") && e.contains("DP-SGD steps fit"),
        "{e}"
    );
}
