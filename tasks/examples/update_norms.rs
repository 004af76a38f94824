//! The L2 norms of DPPG local updates before clipping, from the initial model, on simulated
//! users of a scenario's population: the public evidence for choosing a scenario's clip norm
//! (clipping near the typical norm keeps the signal while the noise, scaled to the clip norm,
//! stays fixed). Simulated users only; never run on real users' data.
//!
//!     cargo run --release -p fedrl-tasks --example update_norms -- SCENARIO.toml [USERS] [FIRST_USER]

use fedrl_common::scenario::Scenario;
use fedrl_common::task::Task;
use fedrl_rl::candle_core::Device;
use fedrl_rl::local_updates;
use fedrl_tasks::dppg::DppgTaskExt;
use fedrl_tasks::scenario_from_toml_str;

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .ok_or("usage: update_norms SCENARIO.toml [USERS] [FIRST_USER]")?;
    let users: u64 = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(256);
    let first: u64 = args
        .get(2)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(10_000_000);
    let scenario: Scenario = scenario_from_toml_str(&std::fs::read_to_string(path)?)?;
    let Task::Dppg(task) = &scenario.task else {
        return Err(format!("{path}: not a dppg scenario").into());
    };
    let spec = task.model_spec()?;
    let global = spec.init(task.model_seed);
    let population = task.population()?;
    let mut envs = (first..first + users)
        .map(|u| population.user_env(u))
        .collect::<Result<Vec<_>, _>>()?;
    let seeds: Vec<u64> = (first..first + users).collect();
    let mut cfg = task.local.clone();
    cfg.clip_norm = f64::INFINITY;
    let ups = local_updates(&spec, &global, &mut envs, &seeds, &cfg, &Device::Cpu)?;
    let mut norms: Vec<f64> = ups.iter().map(|u| u.norm_before_clip).collect();
    norms.sort_by(f64::total_cmp);
    let q = |p: f64| norms[((norms.len() - 1) as f64 * p).round() as usize];
    let mean: Vec<f32> = (0..global.len())
        .map(|i| ups.iter().map(|u| u.delta[i]).sum::<f32>() / ups.len() as f32)
        .collect();
    let mean_norm = mean
        .iter()
        .map(|x| f64::from(*x).powi(2))
        .sum::<f64>()
        .sqrt();
    println!(
        "{} users, {} parameters: norm quantiles 10% {:.4} 25% {:.4} 50% {:.4} 75% {:.4} 90% {:.4} max {:.4}; norm of the mean update {:.4}; scenario clip {}",
        users,
        global.len(),
        q(0.1),
        q(0.25),
        q(0.5),
        q(0.75),
        q(0.9),
        q(1.0),
        mean_norm,
        scenario.clip_norm
    );
    Ok(())
}
