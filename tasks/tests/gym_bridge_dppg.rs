//! DPPG through the Gymnasium bridge, in process (trainer and server model, no transport):
//! - the equality target of issue 57: a short seeded run on `gymnasium:CartPole-v1` releases
//!   the same models (to float tolerance) as on fedrl's own CartPole-v1;
//! - a worker that faults costs only its own users that round (dropped, reason logged), no
//!   round hangs, and the worker is back for the next round;
//! - a task whose declared spaces are not the environment's is refused when the agent starts.
//!
//! Needs the bridge's virtual environment (`scripts/install-python-bridge.sh`; `.ci/run` runs it
//! first); without it each test says so and passes without checking anything.

use std::time::{Duration, Instant};

use fedrl_common::protocol::{RoundSpec, UnitId};
use fedrl_common::task::DppgTask;
use fedrl_common::task::TaskSpec;
use fedrl_rl::candle_core::Device;
use fedrl_sim::gym_bridge::default_python;
use fedrl_tasks::LocalTrainer;
use fedrl_tasks::ServerModel;
use fedrl_tasks::dppg::{DppgModel, DppgTrainer, gym_config};
use rand::rngs::ChaCha8Rng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

fn venv() -> bool {
    let p = std::env::var_os("FEDRL_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(default_python);
    if p.exists() {
        return true;
    }
    eprintln!(
        "SKIPPED: no bridge interpreter at {} (run scripts/install-python-bridge.sh)",
        p.display()
    );
    false
}

fn task(extra: Value) -> DppgTask {
    let mut t = json!({
        "population": "CartPole-v1",
        "episode_seed": 11,
        "model_seed": 5,
        "server_lr": 1.0,
        "local": {
            "episodes_per_user": 2,
            "max_episode_steps": 30,
            "epochs": 2,
            "minibatches": 2,
            "hidden": [16],
            "threads": 2,
            "lr": 0.003
        }
    });
    for (k, v) in extra.as_object().unwrap() {
        t[k] = v.clone();
    }
    let task: DppgTask = serde_json::from_value(t).unwrap();
    task.check().unwrap();
    task
}

/// A standard normal draw (Box-Muller): the test's stand-in for the aggregator's noise, the same
/// both ways.
fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u = |r: &mut ChaCha8Rng| ((r.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let (a, b) = (u(rng), u(rng));
    (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
}

fn spec(round: u64, dim: usize) -> RoundSpec {
    RoundSpec {
        round,
        dim: dim as u32,
        offer_dim: dim as u32,
        clip_norm: 1.0,
        deadline_s: 60.0,
    }
}

/// `rounds` rounds of `cohort` fresh users: local updates, sum, the same seeded Gaussian noise
/// (z = 0.5, C = 1), the fixed cohort as denominator, the server step. Returns every released
/// model and the users that contributed each round.
fn run(task: &DppgTask, rounds: u64, cohort: u64) -> (Vec<Vec<f32>>, Vec<Vec<UnitId>>) {
    let mut trainer = DppgTrainer::new(task, Device::Cpu).unwrap();
    let mut model = DppgModel::new(task, 1000, rounds, Device::Cpu).unwrap();
    let dim = model.params().len();
    let mut noise = ChaCha8Rng::seed_from_u64(99);
    let mut released = Vec::new();
    let mut contributors = Vec::new();
    for r in 0..rounds {
        let units: Vec<UnitId> = (r * cohort..(r + 1) * cohort).collect();
        let global = model.params().to_vec();
        let mut ups = trainer.local_updates(&spec(r, dim), &global, &units);
        ups.sort_by_key(|(u, _)| *u);
        let mut sum = vec![0.0f64; dim];
        for (_, up) in &ups {
            for (s, x) in sum.iter_mut().zip(up) {
                *s += f64::from(*x);
            }
        }
        let mean: Vec<f32> = sum
            .iter()
            .map(|s| {
                let z = normal(&mut noise);
                ((s + 0.5 * z) / cohort as f64) as f32
            })
            .collect();
        model.apply(&mean).unwrap();
        released.push(model.params().to_vec());
        contributors.push(ups.iter().map(|(u, _)| *u).collect());
    }
    (released, contributors)
}

#[test]
fn gymnasium_cartpole_releases_the_same_models_as_fedrls_cartpole() {
    if !venv() {
        return;
    }
    let own = task(json!({}));
    let bridged = task(json!({
        "population": "gymnasium:CartPole-v1",
        "gymnasium": { "obs_dim": 4, "actions": 2 }
    }));
    let (a, ua) = run(&own, 3, 6);
    let (b, ub) = run(&bridged, 3, 6);
    assert_eq!(ua, ub, "the same users contribute");
    assert!(ua.iter().all(|u| u.len() == 6));
    for (r, (x, y)) in a.iter().zip(&b).enumerate() {
        let worst = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 1e-5,
            "round {r}: released models differ by {worst}"
        );
    }
    // The models did move (the comparison is not between two untouched initialisations).
    let init = DppgModel::new(&own, 1000, 3, Device::Cpu).unwrap();
    assert_ne!(init.params(), a[2].as_slice());
}

/// The aggregator's model of a Gymnasium population evaluates nothing itself (no Python): at
/// an evaluation round it keeps the released model as a snapshot in its state directory and
/// marks the metrics line deferred; `fedrl run` evaluates the snapshot through the bridge on the
/// held-out users and seeds of the Rust evaluation, which gives what fedrl's own CartPole gives.
#[test]
fn a_deferred_evaluation_keeps_a_snapshot_that_evaluates_as_the_rust_one() {
    use fedrl_tasks::dppg::GymEvaluator;
    use fedrl_tasks::dppg::held_out::{final_users, periodic_users, read_snapshot};
    let bridged = task(json!({
        "population": "gymnasium:CartPole-v1",
        "eval_users": 3,
        "final_eval_users": 4,
        "eval_episodes": 2,
        "gymnasium": { "obs_dim": 4, "actions": 2, "workers": 2 }
    }));
    let own = task(json!({ "eval_users": 3, "final_eval_users": 4, "eval_episodes": 2 }));
    let dir = tempfile::tempdir().unwrap();
    let mut m = DppgModel::new(&bridged, 50, 10, Device::Cpu).unwrap();
    // Without a state directory the mark says why there is nothing to evaluate.
    // (eval_every is 5: rounds 4, 9, ... are evaluated.)
    assert!(m.evaluate(3).is_none());
    assert!(m.evaluate(4).unwrap()["eval_error"].is_string());
    m.set_state_dir(dir.path()).unwrap();
    assert!(
        m.evaluation_job(4).is_none(),
        "no job: nothing runs off the engine thread"
    );
    // Move the model away from its initialisation, so that the snapshot is a trained model.
    let step: Vec<f32> = (0..m.params().len())
        .map(|i| ((i % 7) as f32 - 3.0) * 0.2)
        .collect();
    m.apply(&step).unwrap();
    assert_eq!(m.evaluate(9).unwrap(), json!({ "deferred": true }));
    assert_eq!(m.final_evaluation().unwrap(), json!({ "deferred": true }));
    let snap = read_snapshot(dir.path(), 9).unwrap();
    assert_eq!(snap, m.params());
    assert!(read_snapshot(dir.path(), 4).is_err());
    // A deferred run cannot stop at a target: refused by name.
    let mut stop = bridged.clone();
    stop.stop_at_return = Some(100.0);
    assert!(
        stop.check()
            .unwrap_err()
            .to_string()
            .contains("stop_at_return")
    );
    if !venv() {
        return;
    }
    let rust = DppgModel::new(&own, 50, 10, Device::Cpu).unwrap();
    let mut ev = GymEvaluator::start(&bridged, Device::Cpu).unwrap();
    for users in [periodic_users(&bridged, 50), final_users(&bridged, 50)] {
        let want = rust
            .evaluate_on(&snap, users.start, users.end - users.start)
            .unwrap();
        let got = ev.evaluate(&snap, users.clone()).unwrap();
        assert_eq!(got.episodes, want.episodes, "{users:?}");
        assert_eq!(got.episodes as u64, 2 * (users.end - users.start));
        assert!((got.mean - want.mean).abs() < 1e-9, "{got:?} vs {want:?}");
        assert!((got.std - want.std).abs() < 1e-9, "{got:?} vs {want:?}");
    }
    assert_eq!(periodic_users(&bridged, 50), 50..53);
    assert_eq!(final_users(&bridged, 50), 53..57);
}

#[test]
fn a_faulting_worker_drops_only_its_users_and_comes_back() {
    if !venv() {
        return;
    }
    // NaN, wrong shapes and exceptions are faults of the same kind (simulators/tests/gym_bridge.rs
    // has each); here the two that end or stall the process.
    for mode in ["crash", "hang"] {
        let t = task(json!({
            "population": "gymnasium:FedrlTest/Misbehave-v0",
            "population_seed": 3,
            "gymnasium": {
                "obs_dim": 3,
                "actions": 2,
                "module": "fedrl_bridge.test_envs",
                "workers": 2,
                "step_timeout_s": 1.0,
                "kwargs": { "at_step": 2, "length": 8 },
                "user_kwargs": { "mode": { "choice": ["none", "none", "none", mode] } }
            }
        }));
        let cfg = gym_config(&t).unwrap();
        let mut trainer = DppgTrainer::new(&t, Device::Cpu).unwrap();
        let dim = DppgModel::new(&t, 100, 1, Device::Cpu)
            .unwrap()
            .params()
            .len();
        let global = vec![0.01f32; dim];
        for round in 0..2u64 {
            let units: Vec<UnitId> = (round * 8..round * 8 + 8).collect();
            // Contiguous halves go to workers 0 and 1; a half with a misbehaving user is lost.
            let bad = |half: &[u64]| {
                half.iter()
                    .any(|&u| cfg.user_kwargs(u)["mode"] != json!("none"))
            };
            let mut expected: Vec<UnitId> = Vec::new();
            for half in units.chunks(4) {
                if !bad(half) {
                    expected.extend(half);
                }
            }
            let started = Instant::now();
            let mut got: Vec<UnitId> = trainer
                .local_updates(&spec(round, dim), &global, &units)
                .into_iter()
                .map(|(u, _)| u)
                .collect();
            got.sort();
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{mode}: round {round} took {:?}",
                started.elapsed()
            );
            assert_eq!(got, expected, "{mode}: round {round}");
            let pool = trainer.gym_pool().unwrap();
            for (w, half) in units.chunks(4).enumerate() {
                assert_eq!(pool.fault(w).is_some(), bad(half), "{mode}: worker {w}");
            }
        }
        // Units 0..16 hold at least one misbehaving user for this seed, or the test proves
        // nothing: check it.
        assert!(
            (0..16u64).any(|u| cfg.user_kwargs(u)["mode"] != json!("none")),
            "{mode}: no misbehaving user drawn"
        );
    }
}

#[test]
fn declared_spaces_that_are_not_the_environments_stop_the_agent() {
    if !venv() {
        return;
    }
    let t = task(json!({
        "population": "gymnasium:CartPole-v1",
        "gymnasium": { "obs_dim": 4, "action_dim": 2 }
    }));
    let e = DppgTrainer::new(&t, Device::Cpu).err().unwrap().to_string();
    assert!(
        e.contains("Discrete(2)") && e.contains("Box(2 values)"),
        "{e}"
    );
}

#[test]
fn a_gymnasium_population_needs_its_table_and_no_other_does() {
    let no_table: DppgTask =
        serde_json::from_value(json!({ "population": "gymnasium:CartPole-v1" })).unwrap();
    assert!(
        no_table
            .check()
            .unwrap_err()
            .to_string()
            .contains("[task.gymnasium]")
    );
    let stray: DppgTask = serde_json::from_value(json!({
        "population": "CartPole-v1",
        "gymnasium": { "obs_dim": 4, "actions": 2 }
    }))
    .unwrap();
    assert!(stray.check().is_err());
    let both: DppgTask = serde_json::from_value(json!({
        "population": "gymnasium:CartPole-v1",
        "gymnasium": { "obs_dim": 4, "actions": 2, "action_dim": 1 }
    }))
    .unwrap();
    assert!(
        both.check()
            .unwrap_err()
            .to_string()
            .contains("exactly one")
    );
    // The aggregator builds the model from the declaration alone (no Python).
    let ok: DppgTask = serde_json::from_value(json!({
        "population": "gymnasium:CartPole-v1",
        "gymnasium": { "obs_dim": 4, "actions": 2 }
    }))
    .unwrap();
    ok.check().unwrap();
    let own: DppgTask = serde_json::from_value(json!({ "population": "CartPole-v1" })).unwrap();
    let a = DppgModel::new(&ok, 10, 1, Device::Cpu).unwrap();
    let b = DppgModel::new(&own, 10, 1, Device::Cpu).unwrap();
    assert_eq!(a.params(), b.params());
}

#[test]
fn the_readme_example_a_users_own_environment_trains() {
    // python/examples/own-env-dppg.toml: the scenario parses and checks without Python.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let scenario =
        fedrl_tasks::scenario_from_file(root.join("python/examples/own-env-dppg.toml")).unwrap();
    let fedrl_common::task::Task::Dppg(mut t) = scenario.task else {
        panic!("the example is a DPPG scenario");
    };
    if !venv() {
        return;
    }
    // The README runs it with PYTHONPATH=python/examples; here the workers find the module as
    // a namespace package under python/, which is on their path.
    t.gymnasium.as_mut().unwrap().module = Some("examples.my_envs".into());
    t.local.max_episode_steps = 12;
    let cfg = gym_config(&t).unwrap();
    let mut trainer = DppgTrainer::new(&t, Device::Cpu).unwrap();
    let dim = DppgModel::new(&t, 100, 1, Device::Cpu)
        .unwrap()
        .params()
        .len();
    let units: Vec<UnitId> = (0..6).collect();
    let ups = trainer.local_updates(&spec(0, dim), &vec![0.0; dim], &units);
    assert_eq!(ups.len(), 6);
    assert!(
        ups.iter()
            .all(|(_, d)| d.len() == dim && d.iter().any(|x| *x != 0.0))
    );
    // The users are personalised.
    let setpoints: std::collections::BTreeSet<String> = (0..20u64)
        .map(|u| cfg.user_kwargs(u)["setpoint"].to_string())
        .collect();
    assert!(setpoints.len() > 1);
}
