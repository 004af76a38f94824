//! Every scenario file shipped in `scenarios/` parses and validates, and each DPPG scenario has
//! its non-private twin.

use std::path::PathBuf;

use fedrl_common::scenario::Task;
use fedrl_tasks::{scenario_from_file, scenario_from_toml_str};

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
                // Seed 004 trains its MuJoCo tasks at "weaker privacy levels" (issue 57).
                let bound = if MUJOCO_DPPG.contains(&stem.as_str()) {
                    10.0
                } else {
                    1.0
                };
                assert!(
                    s.target_epsilon <= bound,
                    "{stem}: the DPPG targets are epsilon <= {bound}"
                );
                let twin = f.with_file_name(format!("{stem}-nonprivate.toml"));
                assert!(twin.exists(), "{stem} has no twin {}", twin.display());
            }
        }
    }
}

/// Seed 004's MuJoCo tasks through the Gymnasium bridge (issue 57), at a weaker privacy level
/// than the other DPPG scenarios (epsilon <= 10 rather than <= 1).
const MUJOCO_DPPG: [&str; 2] = ["halfcheetah-dppg", "hopper-dppg"];

/// The MuJoCo DPPG scenarios: personalised `fedrl/<env>` users of the bridge's
/// `mujoco_users` module, one fresh Gaussian mechanism per user within the stated budget, and
/// twins that differ only in privacy (same users, cohort, rounds and task), as the issue's
/// "same number of users" comparison needs. Loading needs no Python (declared spaces).
#[test]
fn mujoco_dppg_scenarios_and_their_twins() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for (stem, env, obs, act) in [
        ("halfcheetah-dppg", "HalfCheetah-v5", 17, 6),
        ("hopper-dppg", "Hopper-v5", 11, 3),
    ] {
        let s = scenario_from_file(dir.join(format!("{stem}.toml"))).unwrap();
        let twin = scenario_from_file(dir.join(format!("{stem}-nonprivate.toml"))).unwrap();
        let Task::Dppg(t) = &s.task else {
            panic!("{stem} is not DPPG");
        };
        assert_eq!(t.population, format!("gymnasium:fedrl/{env}"));
        let g = t.gymnasium.as_ref().unwrap();
        assert_eq!(g.module.as_deref(), Some("fedrl_bridge.mujoco_users"));
        assert_eq!((g.obs_dim, g.action_dim, g.actions), (obs, Some(act), None));
        assert!(g.user_kwargs.contains_key("mass_scale"), "{stem}");
        assert!(g.user_kwargs.contains_key("friction_scale"), "{stem}");
        let eps = fedrl_common::privacy::gaussian::epsilon(s.noise_multiplier, s.delta).unwrap();
        assert!(eps <= s.target_epsilon, "{stem}: epsilon {eps}");
        assert!(
            s.rounds * s.cohort_size <= s.users,
            "{stem}: fresh users run out"
        );
        assert!(twin.non_private && !s.non_private);
        assert_eq!(twin.task, s.task, "{stem}: the twin trains otherwise alike");
        assert_eq!(
            (twin.rounds, twin.users, twin.cohort_size, twin.quorum),
            (s.rounds, s.users, s.cohort_size, s.quorum),
            "{stem}"
        );
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

/// Issue 57's LunarLander (seeds 000/002's fourth environment, through the Gymnasium bridge):
/// m = 3000 experts (steps reduced, see the file's header), delta = 1/m, epsilon 10; the three files
/// share one dataset (the same generation spec, so the same cache key) recorded in
/// `gymnasium:LunarLander-v3` on a B.1 grid of gravity, wind and turbulence; the private plans
/// fit the budget; the Q-network's shape is the declared spaces' (no Python needed to load them).
#[test]
fn lunarlander_expert_scenarios_share_their_gymnasium_dataset_and_plan_within_the_budget() {
    use fedrl_common::offline::DatasetSource;
    use fedrl_tasks::offline_cql::OfflineCqlTaskExt;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let load = |f: &str| scenario_from_file(dir.join(f)).unwrap();
    let main = load("lunarlander-expert.toml");
    let dpsgd = load("lunarlander-expert-dpsgd.toml");
    let twin = load("lunarlander-expert-nonprivate.toml");
    assert!(twin.non_private && twin.selective().is_none());
    let dataset = |s: &fedrl_common::scenario::Scenario| match &s.task {
        Task::OfflineCql(t) => match &t.dataset {
            DatasetSource::Generated(d) => (d.clone(), t.qnet_spec().unwrap()),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    };
    let (d, q) = dataset(&main);
    assert_eq!(d.env, "gymnasium:LunarLander-v3");
    let g = d.gymnasium.as_ref().unwrap();
    assert_eq!(g.grid_settings(), 1000);
    for axis in ["gravity", "wind_power", "turbulence_power"] {
        assert!(g.grid.contains_key(axis), "{axis}");
    }
    assert_eq!((q.obs_dim, q.n_actions), (8, 4));
    for s in [&dpsgd, &twin] {
        assert_eq!(dataset(s).0.cache_key(), d.cache_key(), "{}", s.name);
    }
    for s in [&main, &dpsgd] {
        assert_eq!(s.users, d.units);
        assert!(
            (s.delta - 1.0 / d.units as f64).abs() < 1e-15,
            "delta = 1/m"
        );
        assert_eq!(s.target_epsilon, 10.0);
        let k = fedrl_common::selective::Schedule::new(s.selective().unwrap()).dp_steps();
        assert_eq!(s.rounds, k, "one round per DP step");
        let eps = s.planned_epsilon(s.noise_multiplier).unwrap();
        assert!(eps <= 10.0, "{}: the plan costs {eps}", s.name);
    }
    assert!(main.release_event().unwrap().is_some());
    assert!(dpsgd.release_event().unwrap().is_none());
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

/// PriMORL (seed 001): each task has the high-privacy scenario at the paper's epsilon (delta
/// 1e-5), a low-privacy twin, the No Privacy twin and the MOPO baseline, all on the same
/// 30,000-episode dataset with 1% public, q = 1e-3, and the same ensemble and policy phase; only
/// the MOPO baseline reads real data in the policy phase, and a private scenario may not.
#[test]
fn primorl_scenarios_plan_within_the_papers_budgets_and_have_their_twins() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for (env, high, low) in [
        ("pendulum", 5.1, 22.3),
        ("balance", 8.2, 85.0),
        ("swingup", 17.0, 94.2),
    ] {
        let load = |suffix: &str| {
            scenario_from_file(dir.join(format!("{env}-primorl{suffix}.toml")))
                .unwrap_or_else(|e| panic!("{env}-primorl{suffix}: {e}"))
        };
        let (h, l, np, mopo) = (load(""), load("-low"), load("-nonprivate"), load("-mopo"));
        let task = |s: &fedrl_common::scenario::Scenario| match &s.task {
            Task::Primorl(t) => t.clone(),
            other => panic!("{}: not primorl: {other:?}", s.name),
        };
        for (s, target) in [(&h, high), (&l, low)] {
            assert!(!s.non_private, "{}", s.name);
            assert_eq!(s.target_epsilon, target, "{}", s.name);
            assert_eq!(s.delta, 1e-5);
            let eps = s.planned_epsilon(s.noise_multiplier).unwrap();
            assert!(eps <= target, "{}: the plan costs {eps}", s.name);
            assert_eq!(task(s).policy.real_ratio, 0.0);
        }
        assert!(l.noise_multiplier < h.noise_multiplier, "{env}");
        assert!(np.non_private && mopo.non_private, "{env}");
        assert_eq!(task(&mopo).policy.real_ratio, 0.05, "{env}");
        let base = task(&h);
        let data = base.dataset.generated().expect("a generation spec");
        assert_eq!(data.units + data.public, 30_000, "{env}");
        assert_eq!(data.public, 300, "{env}: 1% public");
        for s in [&l, &np, &mopo] {
            let t = task(s);
            assert_eq!(t.dataset, base.dataset, "{}: same dataset", s.name);
            assert_eq!(t.ensemble.hidden, base.ensemble.hidden, "{}", s.name);
            assert_eq!(t.ensemble.clipping, base.ensemble.clipping, "{}", s.name);
            assert_eq!(
                t.ensemble.normalize_targets, base.ensemble.normalize_targets,
                "{}",
                s.name
            );
            assert_eq!(
                t.policy.rollout_length, base.policy.rollout_length,
                "{}",
                s.name
            );
            assert_eq!(s.rounds, h.rounds, "{}", s.name);
        }
        // Every variant branches the same share of its rollouts from real states: the public
        // split for the private twins and No Privacy, the dataset for MOPO (as MOPO does).
        let share = base.policy.public_start_fraction;
        assert_eq!(base.policy.data_start_fraction, 0.0, "{env}");
        for s in [&l, &np] {
            assert_eq!(task(s).policy.public_start_fraction, share, "{}", s.name);
            assert_eq!(task(s).policy.data_start_fraction, 0.0, "{}", s.name);
        }
        assert_eq!(task(&mopo).policy.data_start_fraction, share, "{env}");
        assert_eq!(task(&mopo).policy.public_start_fraction, 0.0, "{env}");
        assert_eq!(share > 0.0, env == "swingup", "{env}: swing-up only");
        if share > 0.0 {
            let text = std::fs::read_to_string(dir.join(format!("{env}-primorl.toml")))
                .unwrap()
                .replace("public_start_fraction = 0.5", "public_start_fraction = 1.5");
            let e = scenario_from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains("public_start_fraction"), "{e}");
        }
        // The No Privacy twins clip at the private scenarios' norm.
        for s in [&np, &mopo] {
            assert_eq!(task(s).ensemble.nonprivate_clip_norm, Some(h.clip_norm));
        }
        // A private scenario reading real data in its policy phase is refused at load.
        let text = std::fs::read_to_string(dir.join(format!("{env}-primorl.toml")))
            .unwrap()
            .replace(
                "updates_per_epoch = 1000",
                "updates_per_epoch = 1000\nreal_ratio = 0.05",
            );
        let e = scenario_from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("real_ratio") && e.contains("non_private"), "{e}");
        // So is one branching its rollouts from dataset states.
        let text = text.replace("\nreal_ratio = 0.05", "\ndata_start_fraction = 1.0");
        let e = scenario_from_toml_str(&text).unwrap_err().to_string();
        assert!(
            e.contains("data_start_fraction") && e.contains("non_private"),
            "{e}"
        );
    }
}

/// Issue 58: a scenario's comment that says "z = Z gives epsilon E at delta D" states what the
/// project's accountant computes (the analytic Gaussian of one fresh contribution), to the
/// digits written.
#[test]
fn comments_state_the_accountants_epsilon() {
    let mut checked = 0;
    for f in scenario_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        // Comments only, joined: a sentence may wrap.
        let comments: String = text
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix('#'))
            .collect::<Vec<_>>()
            .join(" ");
        let words: Vec<&str> = comments.split_whitespace().collect();
        for w in words.windows(9) {
            // z = 3.74 gives epsilon 0.9972 at delta 1e-5
            if w[0] == "z" && w[1] == "=" && w[3] == "gives" && w[4] == "epsilon" && w[6] == "at" {
                let z: f64 = w[2].parse().unwrap();
                let stated = w[5].trim_end_matches([',', '.']);
                let delta: f64 = w[8].trim_end_matches([',', '.']).parse().unwrap();
                let eps = fedrl_common::privacy::gaussian::epsilon(z, delta).unwrap();
                let decimals = stated.split('.').nth(1).map_or(0, str::len);
                assert_eq!(
                    format!("{eps:.decimals$}"),
                    stated,
                    "{}: z = {z} gives epsilon {eps} at delta {delta}",
                    f.display()
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 3, "{checked} comments checked");
}

/// PrivORL-n (seed 003): the scenario at epsilon 10 and 1 (delta 1e-5) and its twins (non-private
/// fine-tuning, no pre-training, curiosity at the paper's rate, pre-training only) differ only where they should,
/// plan within their budgets, and the loader refuses the combinations that make no sense.
#[test]
fn privorl_scenarios_and_their_twins() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let load = |suffix: &str| {
        let s = scenario_from_file(dir.join(format!("cartpole-privorl{suffix}.toml")))
            .unwrap_or_else(|e| panic!("cartpole-privorl{suffix}: {e}"));
        let Task::Privorl(t) = s.task.clone() else {
            panic!("{}: not privorl", s.name)
        };
        (s, t)
    };
    let (main, mt) = load("");
    assert_eq!(main.target_epsilon, 10.0);
    assert_eq!(main.delta, 1e-5);
    assert_eq!(main.users, mt.transitions);
    assert_eq!(
        main.unit_kind,
        fedrl_common::privacy::ledger::UnitKind::Transition
    );
    assert!(
        main.summed_bound().is_some(),
        "central private runs sum on the aggregator"
    );
    for (suffix, eps) in [("", 10.0), ("-eps1", 1.0)] {
        let (s, _) = load(suffix);
        assert_eq!(s.target_epsilon, eps);
        let planned = s.planned_epsilon(s.noise_multiplier).unwrap();
        assert!(planned <= eps, "{suffix}: the plan costs {planned}");
    }
    let (np, npt) = load("-nonprivate");
    assert!(np.non_private && npt == mt);
    let (_, t) = load("-nopretrain");
    assert!(!t.pretrain.enabled && !t.pretrain.curiosity);
    // The curiosity rate was tuned on public data to 0 (the scenario's header): the main file
    // pre-trains without it, the -curiosity twin at the paper's default rate.
    assert!(mt.pretrain.enabled && !mt.pretrain.curiosity);
    let (_, t) = load("-curiosity");
    assert!(t.pretrain.enabled && t.pretrain.curiosity && t.pretrain.curiosity_rate == 0.3);
    let (po, t) = load("-pretrainonly");
    assert!(!t.finetune && t.pretrain.enabled && po.rounds == 1);

    // A fixed noise multiplier: the refusals come from validation, not the noise search.
    let text = std::fs::read_to_string(dir.join("cartpole-privorl.toml"))
        .unwrap()
        .replacen("noise_multiplier = 0.79", "noise_multiplier = 1.0", 1);
    let refused = |from: &str, to: &str, field: &str| {
        assert!(text.contains(from), "{from}");
        let err = scenario_from_toml_str(&text.replacen(from, to, 1))
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{to}: {err}");
    };
    refused("users = 5000", "users = 4000", "task.transitions");
    refused(
        "participation = { kind = \"sampled\", rate = 0.0512 }",
        "participation = { kind = \"fresh\" }\ncohort_size = 10",
        "sampled",
    );
    refused(
        "enabled = true\nepochs = 10\ncuriosity = false",
        "enabled = false\nepochs = 10\ncuriosity = true",
        "curiosity",
    );
    refused(
        "kind = \"privorl\"",
        "kind = \"privorl\"\nfinetune = false",
        "rounds = 1",
    );
    refused(
        "unit_kind = \"transition\"",
        "unit_kind = \"trajectory\"",
        "unit_kind",
    );
    // The utility is measured in the aggregator, which runs no Python: no Gymnasium data.
    refused(
        "[task.dataset]\nenv = \"CartPole-v1\"",
        "[task.dataset]\nenv = \"gymnasium:CartPole-v1\"\ngymnasium = { obs_dim = 4, actions = 2 }",
        "runs no Python",
    );
}

/// PrivORL-n on continuous control (issue 56): `pendulum-privorl` and `swingup-privorl` at
/// epsilon 10 and 1 (delta 1e-5) and their twins (non-private fine-tuning, no pre-training, no
/// curiosity, pre-training only) read continuous-format datasets (public data of the same
/// domain, another task), evaluate with TD3+BC, differ only where they should and plan within
/// their budgets; the loader refuses discrete datasets beside `[task.continuous]`.
#[test]
fn continuous_privorl_scenarios_and_their_twins() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for (stem, env, public) in [
        ("pendulum-privorl", "Pendulum-v1", "pendulum-gml"),
        ("swingup-privorl", "cartpole-swingup", "cartpole-balance"),
    ] {
        let load = |suffix: &str| {
            let s = scenario_from_file(dir.join(format!("{stem}{suffix}.toml")))
                .unwrap_or_else(|e| panic!("{stem}{suffix}: {e}"));
            let Task::Privorl(t) = s.task.clone() else {
                panic!("{}: not privorl", s.name)
            };
            (s, t)
        };
        let (main, mt) = load("");
        let c = mt.continuous.clone().expect("continuous data");
        assert_eq!(c.dataset.env, env);
        assert_eq!(c.public.env, public);
        assert_eq!(main.users, mt.transitions);
        assert_eq!(mt.utility.td3bc.alpha, 2.5);
        assert_eq!(
            main.unit_kind,
            fedrl_common::privacy::ledger::UnitKind::Transition
        );
        assert!(main.summed_bound().is_some(), "{stem}: the summed path");
        // The spec builds the continuous layout from the environments.
        let dim = fedrl_tasks::privorl::PrivorlTaskExt::layout(&mt).unwrap();
        assert!(matches!(
            dim.action,
            fedrl_rl::diffusion::ActionCoding::Continuous { dim: 1 }
        ));
        for (suffix, eps) in [("", 10.0), ("-eps1", 1.0)] {
            let (s, _) = load(suffix);
            assert_eq!(s.target_epsilon, eps);
            let planned = s.planned_epsilon(s.noise_multiplier).unwrap();
            assert!(planned <= eps, "{stem}{suffix}: the plan costs {planned}");
            assert!(
                planned > 0.9 * eps,
                "{stem}{suffix}: {planned} wastes the budget"
            );
        }
        let (np, npt) = load("-nonprivate");
        assert!(np.non_private && npt == mt);
        let (_, t) = load("-nopretrain");
        assert!(!t.pretrain.enabled && !t.pretrain.curiosity);
        assert_eq!(t.continuous, mt.continuous);
        let (_, t) = load("-nocuriosity");
        assert!(t.pretrain.enabled && !t.pretrain.curiosity);
        let (po, t) = load("-pretrainonly");
        assert!(!t.finetune && t.pretrain.enabled && po.rounds == 1);
    }
    let text = std::fs::read_to_string(dir.join("pendulum-privorl.toml")).unwrap();
    let refused = |from: &str, to: &str, field: &str| {
        assert!(text.contains(from), "{from}");
        let err = scenario_from_toml_str(&text.replacen(from, to, 1))
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{to}: {err}");
    };
    refused(
        "[task.continuous.dataset]",
        "[task.dataset]\nenv = \"CartPole-v1\"\nunits = 3\n\n[task.continuous.dataset]",
        "leave task.dataset and task.public unset",
    );
    refused(
        "env = \"pendulum-gml\"\nunits = 100\nseed = 1\nbehaviour = { kind = \"sac_checkpoints\", steps = 10000, checkpoints = 5, noise_std = 0.3 }",
        "env = \"Pendulum-v1\"\nunits = 29700\npublic = 300\nseed = 0\nbehaviour = { kind = \"sac_checkpoints\", steps = 20000, checkpoints = 10, noise_std = 0.3 }",
        "task.continuous.public is the sensitive dataset itself",
    );
    refused(
        "env = \"pendulum-gml\"",
        "env = \"cartpole-balance\"",
        "task.continuous.public",
    );
    refused("hidden = [64, 64] }", "hidden = [] }", "task.utility.td3bc");
}

/// PrivORL-j (issue 56, `level = "trajectory"`): each trajectory scenario accounts trajectories
/// (`unit_kind`, `users` = the trajectory units) and plans within epsilon 10.
#[test]
fn privorl_trajectory_scenarios_plan_within_epsilon_ten() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for name in ["cartpole-privorl-traj", "pendulum-privorl-traj"] {
        let s = scenario_from_file(dir.join(format!("{name}.toml")))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let Task::Privorl(t) = &s.task else {
            panic!("{name}: not privorl")
        };
        assert_eq!(
            t.level,
            fedrl_common::task::privorl::PrivorlLevel::Trajectory,
            "{name}"
        );
        assert_eq!(s.unit_kind.to_string(), "trajectory", "{name}");
        assert_eq!(s.users, t.trajectory.units, "{name}");
        assert!(!s.non_private, "{name}");
        let eps = s.planned_epsilon(s.noise_multiplier).unwrap();
        assert!(eps <= 10.0 && eps > 9.5, "{name}: the plan costs {eps}");
    }
}
