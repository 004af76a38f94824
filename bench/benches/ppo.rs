//! Throughput of the batched DPPG client step (`fedrl_rl::local_updates`).
//!
//! `cargo bench -p fedrl-bench --bench ppo [-- --users 512 --threads 2 --device cpu]`
//!
//! Cases (CartPole-v1, 2 x `--hidden` (64) tanh policy and value, 4 epochs x 2 minibatches, fresh Adam):
//! - `client_step`: rollout + local PPO + clip with the initial policy (short episodes);
//! - `train_only_500`: the local PPO update alone on 500-step users (a solved CartPole's
//!   episode length), synthetic data.
//!
//! Prints env-steps/s and users/s, one JSON line per case.

use fedrl_bench::arg_usize as arg;
use std::time::Instant;

use fedrl_rl::{
    LocalUpdateConfig, ModelSpec, UserBatch, local_updates, local_updates_from_batches,
};
use fedrl_sim::Env;

fn report(case: &str, users: usize, steps: usize, secs: f64, cfg: &LocalUpdateConfig) {
    println!(
        "{}",
        serde_json::json!({
            "case": case,
            "users": users,
            "env_steps": steps,
            "seconds": secs,
            "users_per_s": users as f64 / secs,
            "env_steps_per_s": steps as f64 / secs,
            "threads": cfg.threads,
            "group_size": cfg.group_size,
            "epochs": cfg.epochs,
            "minibatches": cfg.minibatches,
        })
    );
}

fn main() -> anyhow::Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    let device_name = argv
        .iter()
        .position(|a| a == "--device")
        .and_then(|i| argv.get(i + 1))
        .map_or("cpu", String::as_str);
    let device = fedrl_rl::device::parse(device_name)?;
    let users = arg("--users", 512);
    let cfg = LocalUpdateConfig {
        threads: arg("--threads", 2),
        group_size: arg("--group", LocalUpdateConfig::default().group_size),
        hidden: vec![arg("--hidden", 64); 2],
        ..LocalUpdateConfig::default()
    };
    let probe = fedrl_sim::make("CartPole-v1")?;
    let spec =
        ModelSpec::from_spaces(probe.observation_space(), probe.action_space(), &cfg.hidden)?;
    let global = spec.init(0);
    let seeds: Vec<u64> = (0..users as u64).collect();

    let mut envs: Vec<Box<dyn Env>> = (0..users)
        .map(|_| fedrl_sim::make("CartPole-v1"))
        .collect::<Result<_, _>>()?;
    // Warm-up, then time.
    local_updates(
        &spec,
        &global,
        &mut envs[..16.min(users)],
        &seeds[..16.min(users)],
        &cfg,
        &device,
    )?;
    let t = Instant::now();
    let ups = local_updates(&spec, &global, &mut envs, &seeds, &cfg, &device)?;
    let secs = t.elapsed().as_secs_f64();
    report(
        "client_step",
        users,
        ups.iter().map(|u| u.steps).sum(),
        secs,
        &cfg,
    );

    let n = 500;
    let train_users = (users / 4).max(1);
    let batches: Vec<UserBatch> = (0..train_users)
        .map(|u| {
            let f = |k: usize, s: f32| -> Vec<f32> {
                (0..k)
                    .map(|i| (((i * 7919 + u * 104729) % 1000) as f32 / 1000.0 - 0.5) * s)
                    .collect()
            };
            UserBatch {
                obs: f(n * 4, 0.4),
                actions: (0..n).map(|i| ((i + u) % 2) as f32).collect(),
                logp: vec![-std::f32::consts::LN_2; n],
                values: f(n, 1.0),
                rewards: vec![1.0; n],
                terminated: vec![false; n],
                truncated: (0..n).map(|i| i + 1 == n).collect(),
                bootstrap: vec![0.0; n],
                episode_returns: vec![n as f64],
            }
        })
        .collect();
    let t = Instant::now();
    local_updates_from_batches(
        &spec,
        &global,
        &batches,
        &seeds[..train_users],
        &cfg,
        &device,
    )?;
    let secs = t.elapsed().as_secs_f64();
    report("train_only_500", train_users, train_users * n, secs, &cfg);
    Ok(())
}
