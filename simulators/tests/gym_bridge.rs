//! The Gymnasium bridge against real Python workers: CartPole-v1 through the bridge is fedrl's
//! CartPole-v1, a user's own registered environment with per-user kwargs, a spaces mismatch
//! refused, every fault case (crash, hang, NaN, wrong shape, exception) contained and the worker
//! restarted, and no worker left behind by a dropped pool or a killed agent.
//!
//! Needs the bridge's virtual environment (`scripts/install-python-bridge.sh`, which `.ci/run`
//! runs first); without it every test here says so and passes without checking anything.

use std::time::{Duration, Instant};

use fedrl_sim::gym_bridge::{
    DeclaredAction, DeclaredSpaces, Draw, GymConfig, GymPool, default_python,
};
use fedrl_sim::{Action, Env, Space, make};
use serde_json::json;

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

fn alive(pid: u32) -> bool {
    // A zombie still answers kill(0); read its state instead.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

fn wait_gone(pid: u32, within: Duration) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if !alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    !alive(pid)
}

fn test_envs(env_id: &str) -> GymConfig {
    let mut cfg = GymConfig::new(env_id);
    cfg.module = Some("fedrl_bridge.test_envs".into());
    cfg
}

/// Steps `envs` in lockstep with `actions(t, u)`, queueing every action before collecting any
/// (one STEP message per worker), for `steps` steps; returns every observation and reward.
fn lockstep(
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    steps: usize,
    action: impl Fn(usize, usize) -> usize,
) -> Result<Vec<(Vec<f32>, f64, bool)>, fedrl_sim::SimError> {
    let d = envs[0].observation_space().dim();
    let mut out = Vec::new();
    let mut obs = vec![0.0f32; d];
    // Resets batched like steps: queue all, then collect.
    let mut first = vec![0.0f32; d * envs.len()];
    let queued: Vec<bool> = envs
        .iter_mut()
        .zip(seeds)
        .zip(first.chunks_mut(d))
        .map(|((e, &s), o)| e.reset_queue(s, o))
        .collect();
    for ((e, done), o) in envs.iter_mut().zip(queued).zip(first.chunks_mut(d)) {
        if !done {
            e.reset_collect(o)?;
        }
        out.push((o.to_vec(), 0.0, false));
    }
    let mut done = vec![false; envs.len()];
    for t in 0..steps {
        let mut queued = Vec::new();
        for (u, e) in envs.iter_mut().enumerate() {
            if done[u] {
                continue;
            }
            let r = e.step_queue(Action::Discrete(action(t, u)), &mut obs)?;
            queued.push((u, r, obs.clone()));
        }
        for (u, r, o) in queued {
            let (step, o) = match r {
                Some(s) => (s, o),
                None => {
                    let s = envs[u].step_collect(&mut obs)?;
                    (s, obs.clone())
                }
            };
            done[u] = step.terminated || step.truncated;
            out.push((o, step.reward, done[u]));
        }
    }
    Ok(out)
}

#[test]
fn cartpole_through_the_bridge_is_fedrls_cartpole() {
    if !venv() {
        return;
    }
    let mut cfg = GymConfig::new("CartPole-v1");
    cfg.workers = 2;
    let declared = DeclaredSpaces {
        obs_dim: 4,
        action: DeclaredAction::Discrete { n: 2 },
    };
    let mut pool = GymPool::start(cfg, Some(declared)).unwrap();
    assert_eq!(pool.action_space(), &Space::Discrete { n: 2 });
    let users: Vec<u64> = (0..6).collect();
    let (groups, dropped) = pool.envs_for(&users);
    assert!(dropped.is_empty(), "{dropped:?}");
    assert_eq!(groups.len(), 2);
    let seeds = [0u64, 1, 2, u64::MAX, 1 << 40, 12345];
    let act = |t: usize, u: usize| (t * 7 + u * 3 + t / 5) % 2;
    let mut bridged = Vec::new();
    let mut k = 0;
    for mut g in groups {
        let s: Vec<u64> = (0..g.users.len()).map(|i| seeds[k + i]).collect();
        let offset = k;
        bridged.extend(lockstep(&mut g.envs, &s, 60, |t, u| act(t, u + offset)).unwrap());
        k += g.users.len();
    }
    let mut own: Vec<Box<dyn Env>> = (0..3).map(|_| make("CartPole-v1").unwrap()).collect();
    let mut reference = lockstep(&mut own, &seeds[..3], 60, act).unwrap();
    let mut own2: Vec<Box<dyn Env>> = (0..3).map(|_| make("CartPole-v1").unwrap()).collect();
    reference.extend(lockstep(&mut own2, &seeds[3..], 60, |t, u| act(t, u + 3)).unwrap());
    assert_eq!(bridged.len(), reference.len());
    for (i, (b, r)) in bridged.iter().zip(&reference).enumerate() {
        for (x, y) in b.0.iter().zip(&r.0) {
            assert!((x - y).abs() <= 1e-6, "record {i}: {:?} vs {:?}", b.0, r.0);
        }
        assert_eq!((b.1, b.2), (r.1, r.2), "record {i}");
    }
}

#[test]
fn a_users_own_environment_with_per_user_kwargs() {
    if !venv() {
        return;
    }
    let mut cfg = test_envs("FedrlTest/Counter-v0");
    cfg.kwargs.insert("length".into(), json!(4));
    cfg.user_kwargs = vec![(
        "scale".into(),
        Draw::Choice(vec![json!(1.0), json!(2.0), json!(3.0)]),
    )];
    let mut pool = GymPool::start(cfg.clone(), None).unwrap();
    let users = [3u64, 9, 27];
    let (mut groups, dropped) = pool.envs_for(&users);
    assert!(dropped.is_empty());
    let g = &mut groups[0];
    let recs = lockstep(&mut g.envs, &[0, 0, 0], 4, |_, _| 1).unwrap();
    for (i, &u) in users.iter().enumerate() {
        let scale = cfg.user_kwargs(u)["scale"].as_f64().unwrap();
        // The observation carries the user's scale; a +1 step pays it.
        assert_eq!(f64::from(recs[i].0[1]), scale);
        assert_eq!(recs[3 + i].1, scale);
    }
    // The episode ends after `length` = 4 steps.
    assert!(recs[recs.len() - 1].2);
}

/// Workers keep their environments from round to round (`reuse_envs`, the default): in later
/// rounds, with other users drawing some of the same kwargs, every user still plays in an
/// environment with its own kwargs, from a fresh seeded reset, as with reuse off.
#[test]
fn kept_environments_still_give_each_user_their_own_kwargs() {
    if !venv() {
        return;
    }
    let mut cfg = test_envs("FedrlTest/Counter-v0");
    cfg.kwargs.insert("length".into(), json!(4));
    cfg.user_kwargs = vec![(
        "scale".into(),
        Draw::Choice(vec![json!(1.0), json!(2.0), json!(3.0)]),
    )];
    let rounds: [&[u64]; 3] = [&[3, 9, 27], &[27, 5, 3, 81, 9], &[1, 2]];
    let play = |cfg: &GymConfig| {
        let mut pool = GymPool::start(cfg.clone(), None).unwrap();
        let mut all = Vec::new();
        for users in rounds {
            let (mut groups, dropped) = pool.envs_for(users);
            assert!(dropped.is_empty());
            // Half an episode first (left unfinished, as a round may leave one), then a whole
            // one from a seeded reset.
            lockstep(&mut groups[0].envs, &vec![1; users.len()], 2, |_, _| 1).unwrap();
            let recs = lockstep(&mut groups[0].envs, &vec![7; users.len()], 4, |_, _| 1).unwrap();
            for (i, &u) in users.iter().enumerate() {
                let scale = cfg.user_kwargs(u)["scale"].as_f64().unwrap();
                assert_eq!(f64::from(recs[i].0[1]), scale, "user {u}");
                // The step counter starts at 0 again: a fresh episode.
                assert_eq!(recs[i].0[2], 0.0, "user {u}");
            }
            all.push(recs);
        }
        all
    };
    let kept = play(&cfg);
    let mut fresh = cfg.clone();
    fresh.reuse_envs = false;
    assert_eq!(kept, play(&fresh));
}

#[test]
fn a_spaces_mismatch_is_refused_at_start() {
    if !venv() {
        return;
    }
    let declared = DeclaredSpaces {
        obs_dim: 8,
        action: DeclaredAction::Discrete { n: 4 },
    };
    let e = GymPool::start(GymConfig::new("CartPole-v1"), Some(declared))
        .err()
        .expect("a mismatch must be refused")
        .to_string();
    assert!(
        e.contains("observations of 4 values") && e.contains("Discrete(2)"),
        "{e}"
    );
    let e = GymPool::start(GymConfig::new("NoSuchEnv-v0"), None)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("NoSuchEnv"), "{e}");
}

/// A worker misbehaving as `mode` on its third step: the step fails with a reason naming the
/// fault, the worker is killed, and the next round's environments come from a restarted worker.
fn fault_case(mode: &str, expect: &str) {
    if !venv() {
        return;
    }
    let mut cfg = test_envs("FedrlTest/Misbehave-v0");
    cfg.kwargs.insert("at_step".into(), json!(3));
    cfg.kwargs.insert("mode".into(), json!(mode));
    cfg.step_timeout = Duration::from_secs(1);
    let mut pool = GymPool::start(cfg, None).unwrap();
    let (mut groups, _) = pool.envs_for(&[0, 1]);
    let pid = pool.pid(0).unwrap();
    let started = Instant::now();
    let err = lockstep(&mut groups[0].envs, &[0, 1], 10, |_, _| 0)
        .err()
        .unwrap_or_else(|| panic!("{mode}: no fault reported"))
        .to_string();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{mode}: took {:?}",
        started.elapsed()
    );
    assert!(err.contains(expect), "{mode}: {err}");
    let fault = pool.fault(0).expect("the worker is marked faulted");
    assert!(fault.contains(expect), "{mode}: {fault}");
    assert!(
        wait_gone(pid, Duration::from_secs(5)),
        "{mode}: faulted worker {pid} still runs"
    );
    // The environments of the faulted worker keep failing; a new round restarts the worker.
    let mut o = [0.0f32; 3];
    assert!(groups[0].envs[0].step(Action::Discrete(0), &mut o).is_err());
    let (groups2, dropped) = pool.envs_for(&[0, 1]);
    assert!(dropped.is_empty(), "{dropped:?}");
    assert_ne!(pool.pid(0), Some(pid));
    assert_eq!(groups2[0].envs.len(), 2);
    assert!(pool.fault(0).is_none());
}

#[test]
fn fault_crash() {
    fault_case("crash", "crashed");
}

#[test]
fn fault_hang_past_the_deadline() {
    fault_case("hang", "did not answer within");
}

#[test]
fn fault_nan() {
    fault_case("nan", "non-finite");
}

#[test]
fn fault_wrong_shape() {
    fault_case("shape", "components");
}

#[test]
fn fault_exception() {
    fault_case("raise", "misbehaving on purpose");
}

#[test]
fn a_dropped_pool_leaves_no_worker() {
    if !venv() {
        return;
    }
    let mut cfg = GymConfig::new("CartPole-v1");
    cfg.workers = 2;
    let pool = GymPool::start(cfg, None).unwrap();
    let pids: Vec<u32> = (0..2).map(|w| pool.pid(w).unwrap()).collect();
    drop(pool);
    for pid in pids {
        assert!(
            wait_gone(pid, Duration::from_secs(5)),
            "worker {pid} survived its pool"
        );
    }
}

const HELPER: &str = "FEDRL_GYM_BRIDGE_AGENT_HELPER";

/// Not a test on its own: run by [`killed_agents_leave_no_worker`] as a stand-in agent (this
/// test binary again) that starts workers, prints their pids and waits to be killed.
#[test]
fn agent_helper() {
    if std::env::var_os(HELPER).is_none() {
        return;
    }
    let pool = GymPool::start(GymConfig::new("CartPole-v1"), None).unwrap();
    println!("PIDS {}", pool.pid(0).unwrap());
    std::thread::sleep(Duration::from_secs(60));
    drop(pool);
}

#[test]
fn killed_agents_leave_no_worker() {
    if !venv() {
        return;
    }
    for signal in ["KILL", "TERM", "INT"] {
        let exe = std::env::current_exe().unwrap();
        let mut child = std::process::Command::new(&exe)
            .args(["--exact", "agent_helper", "--nocapture", "--test-threads=1"])
            .env(HELPER, "1")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let mut line = String::new();
        let mut r = std::io::BufReader::new(out);
        let pids: Vec<u32> = loop {
            line.clear();
            let n = std::io::BufRead::read_line(&mut r, &mut line).unwrap();
            assert!(n > 0, "the helper agent ended without printing its workers");
            // libtest prints "test agent_helper ... " before the test's own output.
            if let Some((_, rest)) = line.trim().split_once("PIDS ") {
                break rest.split(' ').map(|p| p.parse().unwrap()).collect();
            }
        };
        for &p in &pids {
            assert!(alive(p));
        }
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let _ = child.wait();
        for &p in &pids {
            assert!(
                wait_gone(p, Duration::from_secs(5)),
                "worker {p} outlived its agent killed by SIG{signal}"
            );
        }
    }
}

/// Whether the bridge's interpreter can import `module` (optional extras such as Box2D).
fn has_module(module: &str) -> bool {
    let p = std::env::var_os("FEDRL_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(default_python);
    let ok = std::process::Command::new(p)
        .args(["-c", &format!("import {module}")])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIPPED: {module} is not installed (scripts/install-python-bridge.sh --extra)");
    }
    ok
}

#[test]
fn lunarlander_users_get_their_own_gravity_and_wind() {
    if !venv() || !has_module("Box2D") {
        return;
    }
    let mut cfg = GymConfig::new("LunarLander-v3");
    cfg.kwargs.insert("enable_wind".into(), json!(true));
    cfg.user_kwargs = vec![
        (
            "gravity".into(),
            Draw::Linspace {
                low: -11.0,
                high: -8.0,
                n: 4,
            },
        ),
        (
            "wind_power".into(),
            Draw::Uniform {
                low: 0.0,
                high: 15.0,
            },
        ),
    ];
    let declared = DeclaredSpaces {
        obs_dim: 8,
        action: DeclaredAction::Discrete { n: 4 },
    };
    let mut pool = GymPool::start(cfg.clone(), Some(declared)).unwrap();
    // Two users with different gravity, same seed and actions: different trajectories; the
    // same user twice: the same trajectory.
    let users: Vec<u64> = (0..40u64).collect();
    let g = |u: u64| cfg.user_kwargs(u)["gravity"].as_f64().unwrap();
    let a = users[0];
    let b = *users.iter().find(|&&u| g(u) != g(a)).unwrap();
    let (mut groups, _) = pool.envs_for(&[a, b, a]);
    let recs = lockstep(&mut groups[0].envs, &[5, 5, 5], 30, |t, _| t % 4).unwrap();
    let last = recs.len() - 3;
    assert_eq!(
        recs[last].0,
        recs[last + 2].0,
        "the same user, the same episode"
    );
    assert_ne!(
        recs[last].0,
        recs[last + 1].0,
        "another gravity, another episode"
    );
}
