//! Steps per second of every fedrl-sim environment with uniformly random actions (drawn
//! beforehand, so only `step` and the resets it triggers are timed), through `Box<dyn Env>` as
//! the client agent uses them.
//!
//! `cargo bench -p fedrl-bench --bench simulators [-- --json] [-- --env ID]`; with `--json` one
//! JSON object per line (what `bench/run_simulators.sh` reads). Time per environment:
//! `FEDRL_BENCH_SECONDS` (default 1).

use std::hint::black_box;
use std::time::{Duration, Instant};

use fedrl_sim::np_rng::NpPcg64;
use fedrl_sim::{Action, Env, Space};

/// Pre-drawn actions, reused cyclically (a power of two so the index is a mask).
const N_ACTIONS: usize = 1 << 16;

enum Actions {
    Discrete(Vec<usize>),
    Continuous(Vec<f32>, usize),
}

fn draw_actions(space: &Space, rng: &mut NpPcg64) -> Actions {
    match space {
        Space::Discrete { n } => Actions::Discrete(
            (0..N_ACTIONS)
                .map(|_| ((u128::from(rng.next_u64()) * (*n as u128)) >> 64) as usize)
                .collect(),
        ),
        Space::Box { low, high } => {
            let dim = low.len();
            let mut v = Vec::with_capacity(N_ACTIONS * dim);
            for _ in 0..N_ACTIONS {
                for (lo, hi) in low.iter().zip(high) {
                    let (lo, hi) = (finite(*lo), finite(*hi));
                    v.push(lo + (hi - lo) * rng.next_f64() as f32);
                }
            }
            Actions::Continuous(v, dim)
        }
    }
}

fn finite(v: f32) -> f32 {
    if v.is_finite() { v } else { v.signum() }
}

/// Runs `steps` steps; returns the number of episodes finished.
fn run(env: &mut dyn Env, actions: &Actions, obs: &mut [f32], steps: usize, seed: &mut u64) -> u64 {
    let mut episodes = 0;
    for t in 0..steps {
        let i = t & (N_ACTIONS - 1);
        let action = match actions {
            Actions::Discrete(a) => Action::Discrete(a[i]),
            Actions::Continuous(a, d) => Action::Continuous(&a[i * d..(i + 1) * d]),
        };
        let s = env.step(action, obs).expect("step");
        if s.terminated || s.truncated {
            episodes += 1;
            *seed += 1;
            env.reset(*seed, obs);
        }
        black_box(&*obs);
    }
    episodes
}

fn bench_env(id: &str, budget: Duration) -> (f64, u64, u64) {
    let mut env = fedrl_sim::make(id).expect("make");
    let mut obs = vec![0f32; env.observation_space().dim()];
    let mut rng = NpPcg64::from_seed(12345);
    let actions = draw_actions(env.action_space(), &mut rng);
    let mut seed = 0u64;
    env.reset(seed, &mut obs);
    // Calibrate: grow the batch until it takes about a tenth of the budget.
    let mut batch = 64usize;
    loop {
        let t = Instant::now();
        run(env.as_mut(), &actions, &mut obs, batch, &mut seed);
        if t.elapsed() * 10 >= budget || batch >= 1 << 30 {
            break;
        }
        batch *= 2;
    }
    let (mut steps, mut episodes) = (0u64, 0u64);
    let start = Instant::now();
    while start.elapsed() < budget {
        episodes += run(env.as_mut(), &actions, &mut obs, batch, &mut seed);
        steps += batch as u64;
    }
    (
        steps as f64 / start.elapsed().as_secs_f64(),
        steps,
        episodes,
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let only: Vec<&str> = args
        .windows(2)
        .filter(|w| w[0] == "--env")
        .map(|w| w[1].as_str())
        .collect();
    let secs: f64 = std::env::var("FEDRL_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    let budget = Duration::from_secs_f64(secs.max(0.01));
    for info in fedrl_sim::list() {
        if !only.is_empty() && !only.contains(&info.id) {
            continue;
        }
        let (rate, steps, episodes) = bench_env(info.id, budget);
        if json {
            println!(
                "{{\"env\":\"{}\",\"impl\":\"fedrl-sim\",\"steps_per_second\":{rate:.1},\"steps\":{steps},\"episodes\":{episodes}}}",
                info.id
            );
        } else {
            println!(
                "{:<24} {:>14.0} steps/s  ({steps} steps, {episodes} episodes)",
                info.id, rate
            );
        }
    }
}
