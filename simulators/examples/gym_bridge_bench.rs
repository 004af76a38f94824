//! Users' environment steps per second through the Gymnasium bridge (issue 57's overhead
//! target; `bench/run_gym_bridge.sh` runs it beside Gymnasium's own vector environments).
//!
//! `cargo run -p fedrl-sim --example gym_bridge_bench -- ENV_ID BATCH WORKERS STEPS`
//! makes BATCH environments on WORKERS workers and steps all of them in lockstep STEPS times with
//! random actions (one thread per worker, each queueing its users' actions and collecting: one
//! STEP message per worker per lockstep step), resetting the environments whose episodes ended
//! (one RESET message per worker per lockstep step, as the rollout loop does).
//! Prints one JSON line: environment steps per second over the stepping only (not the start).

use std::time::Instant;

use fedrl_sim::gym_bridge::{GymConfig, GymPool};
use fedrl_sim::{Action, Space};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let env_id = args.get(1).map_or("CartPole-v1", String::as_str);
    let batch: u64 = args.get(2).map_or(Ok(64), |s| s.parse())?;
    let workers: usize = args.get(3).map_or(Ok(1), |s| s.parse())?;
    let steps: usize = args.get(4).map_or(Ok(200), |s| s.parse())?;
    let mut cfg = GymConfig::new(env_id);
    cfg.workers = workers;
    let mut pool = GymPool::start(cfg, None)?;
    let users: Vec<u64> = (0..batch).collect();
    let (groups, dropped) = pool.envs_for(&users);
    if !dropped.is_empty() {
        return Err(format!("users dropped: {dropped:?}").into());
    }
    let act_space = pool.action_space().clone();
    let obs_dim = pool.observation_space().dim();
    let started = Instant::now();
    let counts: Vec<usize> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|mut g| {
                let act_space = act_space.clone();
                s.spawn(move || -> Result<usize, String> {
                    let mut obs = vec![0.0f32; obs_dim];
                    for (i, e) in g.envs.iter_mut().enumerate() {
                        e.reset(i as u64, &mut obs);
                    }
                    let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ g.worker as u64;
                    let mut next = move || {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng
                    };
                    let mut cont = Vec::new();
                    let mut n = 0usize;
                    let mut episodes = vec![0u64; g.envs.len()];
                    for _ in 0..steps {
                        for e in g.envs.iter_mut() {
                            let r = match &act_space {
                                Space::Discrete { n } => e.step_queue(
                                    Action::Discrete((next() % *n as u64) as usize),
                                    &mut obs,
                                ),
                                Space::Box { low, high } => {
                                    cont.clear();
                                    cont.extend(low.iter().zip(high).map(|(l, h)| {
                                        let u = (next() >> 40) as f32 / (1u64 << 24) as f32;
                                        l.max(-1.0) + (h.min(1.0) - l.max(-1.0)) * u
                                    }));
                                    e.step_queue(Action::Continuous(&cont), &mut obs)
                                }
                            };
                            r.map_err(|e| e.to_string())?;
                        }
                        let mut ended = Vec::new();
                        for (i, e) in g.envs.iter_mut().enumerate() {
                            let st = e.step_collect(&mut obs).map_err(|e| e.to_string())?;
                            n += 1;
                            if st.terminated || st.truncated {
                                episodes[i] += 1;
                                ended.push(i);
                            }
                        }
                        // Resets batched as the rollout loop does: queue all, then collect.
                        let mut queued = Vec::new();
                        for &i in &ended {
                            let seed = ((i as u64) << 32) | episodes[i];
                            queued.push(g.envs[i].reset_queue(seed, &mut obs));
                        }
                        for (&i, done) in ended.iter().zip(queued) {
                            if !done {
                                g.envs[i]
                                    .reset_collect(&mut obs)
                                    .map_err(|e| e.to_string())?;
                            }
                        }
                    }
                    Ok(n)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())))
            .collect::<Result<Vec<usize>, String>>()
    })?;
    let secs = started.elapsed().as_secs_f64();
    let total: usize = counts.iter().sum();
    println!(
        "{}",
        serde_json::json!({
            "impl": "fedrl_bridge",
            "env": env_id,
            "batch": batch,
            "processes": workers,
            "lockstep_steps": steps,
            "env_steps": total,
            "seconds": secs,
            "steps_per_s": total as f64 / secs,
        })
    );
    Ok(())
}
