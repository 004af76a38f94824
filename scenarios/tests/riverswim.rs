//! The Riverswim log-linear DPPG scenarios (seed 004 §4.2.1): the shipped files, learning
//! in-process with the real client trainer and server model, and `fedrl run` end to end.

mod e2e_support;

use std::path::PathBuf;
use std::process::Command;

use e2e_support::*;
use fedrl_aggregator::ServerModel;
use fedrl_aggregator::engine::round_noise_seed;
use fedrl_common::privacy::clipping::{clip_l2, l2_norm};
use fedrl_common::privacy::fixed_point::{noisy_mean, non_private_mean};
use fedrl_common::privacy::noise::DiscreteGaussianNoise;
use fedrl_common::privacy::trust_region::TrustRegionBound;
use fedrl_common::protocol::RoundSpec;
use fedrl_common::scenario::{Scenario, Task};
use fedrl_rl::loglinear::riverswim_optimal_return;
use fedrl_sim::riverswim::RiverSwim;
use fedrl_tasks::LocalTrainer;
use fedrl_tasks::loglinear::LogLinearModel;
use fedrl_tasks::loglinear::LogLinearTrainer;
use fedrl_tasks::{TaskExt, scenario_from_file};

fn scenario_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(name)
}

#[test]
fn riverswim_scenarios_are_loglinear_with_a_twin() {
    let private = scenario_from_file(scenario_path("riverswim-dppg.toml")).unwrap();
    let twin = scenario_from_file(scenario_path("riverswim-dppg-nonprivate.toml")).unwrap();
    let (Task::LogLinearPg(tp), Task::LogLinearPg(tt)) = (&private.task, &twin.task) else {
        panic!("both riverswim scenarios use the loglinear_pg task");
    };
    assert_eq!(tp, tt, "the twin trains the same task");
    assert!(!private.non_private && twin.non_private);
    assert_eq!(
        (private.rounds, private.cohort_size, private.users),
        (twin.rounds, twin.cohort_size, twin.users)
    );
    // Fresh users, each contributing once: one Gaussian mechanism per user.
    let eps =
        fedrl_common::privacy::gaussian::epsilon(private.noise_multiplier, private.delta).unwrap();
    assert!(eps <= 1.0 && eps <= private.target_epsilon, "{eps}");
    assert!(private.rounds * private.cohort_size <= private.users);
    // Seed 004 C.3.
    assert_eq!(tp.trust_region.size, 3.5);
    assert_eq!(tp.trust_region.confidence, 0.6);
    assert_eq!(tp.trust_region.bound, TrustRegionBound::Quantile);
    assert_eq!(tp.lr_at(1), 12.0);
    // The clip norm is derived, not the default.
    let c = private.effective_clip_norm();
    let want = tp
        .trust_region
        .clip_norm(
            18,
            private.cohort_size as f64,
            private.noise_multiplier,
            1.0,
        )
        .unwrap();
    assert_eq!(c, want);
    assert_eq!(twin.effective_clip_norm(), f64::INFINITY);
}

/// Outcome of an in-process run.
struct InProcess {
    /// Mean return of the selected model on the final held-out users.
    final_return: f64,
    /// Largest squared step `||theta' - theta||^2` of the policy part over all rounds.
    max_step_sq: f64,
    /// Fraction of rounds whose policy step stayed inside the trust region.
    inside: f64,
}

/// Runs `s` in process: the real client trainer and server model, aggregated by the engine's
/// own noisy aggregation (`fixed_point::noisy_mean`, seeded per round as the engine seeds it;
/// the CLI test below runs the real engine).
fn run_in_process(s: &Scenario, rounds: u64, noise_seed: u64, verbose: bool) -> InProcess {
    let Task::LogLinearPg(task) = &s.task else {
        panic!("not a loglinear_pg scenario")
    };
    let mut trainer = LogLinearTrainer::new(task).unwrap();
    let mut model = LogLinearModel::new(task, s.users).unwrap();
    let c = s.effective_clip_norm();
    let z = s.effective_noise_multiplier();
    let n = s.cohort_size;
    let dim = s.task.dim().unwrap();
    let (mut max_step_sq, mut inside) = (0.0f64, 0u64);
    for round in 1..=rounds {
        let units: Vec<u64> = ((round - 1) * n..round * n).collect();
        let spec = RoundSpec {
            round,
            dim: dim as u32,
            offer_dim: dim as u32,
            clip_norm: c,
            deadline_s: 1.0,
        };
        let global = model.params().to_vec();
        let ups = trainer.local_updates(&spec, &global, &units);
        assert_eq!(ups.len(), n as usize);
        for (_, v) in &ups {
            let mut v = v.clone();
            clip_l2(&mut v, c);
            assert!(l2_norm(&v) <= c * (1.0 + 1e-6) || c.is_infinite());
        }
        let updates = ups.iter().map(|(_, v)| v.as_slice());
        // The engine's aggregation: the twin's plain mean, or the one noisy aggregation
        // (fixed point, exact discrete Gaussian noise from the round's seed).
        let mean = if z > 0.0 {
            let mut noise = DiscreteGaussianNoise::seeded(round_noise_seed(noise_seed, round));
            noisy_mean(updates, dim, c, z, n as f64, &mut noise)
                .unwrap()
                .mean
        } else {
            non_private_mean(updates, dim, n as f64).unwrap()
        };
        model.apply(&mean).unwrap();
        let step_sq: f64 = model.params()[..12]
            .iter()
            .zip(&global[..12])
            .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
            .sum();
        max_step_sq = max_step_sq.max(step_sq);
        if step_sq <= task.trust_region.size {
            inside += 1;
        }
        if let Some(e) = model.evaluate(round)
            && verbose
        {
            eprintln!("round {round}: step^2 {step_sq:.3} eval {e}");
        }
    }
    let fe = model.final_evaluation().unwrap();
    if verbose {
        eprintln!("final: {fe}");
    }
    InProcess {
        final_return: fe["final_eval_return"].as_f64().unwrap(),
        max_step_sq,
        inside: inside as f64 / rounds as f64,
    }
}

/// The shipped private scenario learns in process, every noisy step within the trust region
/// far more often than the promised confidence, and beats the left-bank policy (return 0.1)
/// by a wide margin.
#[test]
fn private_riverswim_learns_in_process() {
    let s = scenario_from_file(scenario_path("riverswim-dppg.toml")).unwrap();
    let r = run_in_process(
        &s,
        s.rounds,
        1,
        std::env::var_os("RIVERSWIM_VERBOSE").is_some(),
    );
    let opt = riverswim_optimal_return(&RiverSwim::new());
    eprintln!(
        "private in-process: final return {:.3} (optimum {opt:.3}), max step^2 {:.3}, inside {:.2}",
        r.final_return, r.max_step_sq, r.inside
    );
    assert!(r.inside >= 0.6, "{}", r.inside);
    assert!(
        r.final_return > 0.5 * opt,
        "{} vs optimum {opt}",
        r.final_return
    );
}

/// Parameter exploration: `RIVERSWIM_SCENARIO=path cargo test --test riverswim explore --
/// --ignored --nocapture`.
#[test]
#[ignore]
fn explore() {
    let path = std::env::var("RIVERSWIM_SCENARIO")
        .map(PathBuf::from)
        .unwrap_or_else(|_| scenario_path("riverswim-dppg.toml"));
    let s = scenario_from_file(&path).unwrap();
    eprintln!("clip norm {}", s.effective_clip_norm());
    for seed in 1..=3 {
        let r = run_in_process(&s, s.rounds, seed, seed == 1);
        eprintln!(
            "seed {seed}: final {:.3} max step^2 {:.3} inside {:.2}",
            r.final_return, r.max_step_sq, r.inside
        );
    }
}

const E2E_SCENARIO: &str = r#"
name = "riverswim-e2e"
seed = 5
rounds = 12
users = 4000
client_agents = 2
participation = { kind = "fresh" }
cohort_size = 256
quorum = 200
round_deadline_s = 60.0
noise_multiplier = 3.74
delta = 1e-5
target_epsilon = 1.0
checkpoint_every = 4

[task]
kind = "loglinear_pg"
population = "RiverSwim-v0"
episodes_per_user = 4
eval_every = 4
eval_users = 200
final_eval_users = 500
"#;

/// `fedrl run` end to end on a small private Riverswim scenario: the ledger records the derived
/// clip norm, the report holds epsilon <= 1 and a final return, and the log-linear policy is
/// exported.
#[test]
fn fedrl_run_trains_riverswim_loglinear() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = write(dir.path(), "s.toml", E2E_SCENARIO);
    let parsed = scenario_from_file(&scenario).unwrap();
    let out = dir.path().join("out");
    let o = Command::new(exe())
        .arg("run")
        .arg(&scenario)
        .arg("--out")
        .arg(&out)
        .arg("--timeout")
        .arg("120")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "fedrl run failed: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["rounds_completed"], 12, "{report}");
    check_report_schema(&report);
    let eps = report["epsilon"].as_f64().unwrap();
    assert!(eps <= 1.0, "{report}");
    // Fresh users, un-sampled rounds: beside the epsilon, the exact zCDP rho of one discrete
    // Gaussian with sigma / Delta at least z = 3.74 (the grid rounds sigma up, never down).
    let rho = report["zcdp_rho"].as_f64().unwrap();
    let rho_z = 1.0 / (2.0 * 3.74f64.powi(2));
    assert!(rho <= rho_z && rho > 0.999 * rho_z, "{report}");
    let fe = &report["final_evaluation"];
    let ret = fe["final_eval_return"].as_f64().unwrap();
    let (ret_sd, ret_n) = (
        fe["final_eval_return_std"].as_f64().unwrap(),
        fe["final_eval_episodes"].as_f64().unwrap(),
    );
    assert_eq!(ret_n, 500.0, "{report}");
    // The ledger lists unit ids: operator-only.
    let (_, records, _) = fedrl_common::privacy::ledger::PrivacyLedger::read(
        out.join(fedrl_aggregator::state::OPERATOR_DIR)
            .join(fedrl_aggregator::state::LEDGER_FILE),
    )
    .unwrap();
    assert_eq!(records.len(), 12);
    for r in &records {
        assert_eq!(r.clip_norm, Some(parsed.effective_clip_norm()));
    }
    let (spec, params) = fedrl_rl::loglinear::from_bytes(
        &std::fs::read(out.join(fedrl_tasks::dppg::POLICY_FILE)).unwrap(),
    )
    .unwrap();
    assert_eq!((spec.obs_dim, spec.n_actions, params.len()), (6, 2, 18));
    // The exported policy's exact expected return (sampled actions, dynamic programming over
    // RiverSwim's 20 steps); the report's final return (500 held-out episodes of the same
    // policy) must estimate it: within 5 standard errors, and never above the optimum.
    let env = RiverSwim::new();
    let n_states = env.n_states;
    let exact = fedrl_rl::loglinear::riverswim_expected_return(&env, 1.0, |s| {
        let mut obs = vec![0.0f32; n_states];
        obs[s] = 1.0;
        let mut p = [0.0f64; 2];
        spec.probs(&params, &obs, &mut p);
        p
    })
    .1;
    assert!(exact <= riverswim_optimal_return(&env) + 1e-9, "{exact}");
    assert!(
        (ret - exact).abs() <= 5.0 * ret_sd / ret_n.sqrt() + 1e-6,
        "report's final return {ret} (sd {ret_sd}) vs the exported policy's exact {exact}"
    );
    // `fedrl eval` reads the log-linear export too.
    let o = Command::new(exe())
        .args([
            "eval",
            "--env",
            "RiverSwim-v0",
            "--episodes",
            "200",
            "--stochastic",
            "--json",
            "--policy",
        ])
        .arg(out.join(fedrl_tasks::dppg::POLICY_FILE))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let e: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(e["episodes"], 200, "{e}");
    // It reads the same policy: its sampled-action mean estimates the exact return too.
    let (mean, sd) = (
        e["mean_return"].as_f64().unwrap(),
        e["std_return"].as_f64().unwrap(),
    );
    assert!(
        (mean - exact).abs() <= 5.0 * sd / 200f64.sqrt() + 1e-6,
        "fedrl eval's mean {mean} (sd {sd}) vs the exact {exact}"
    );
}
