//! Per-output error of a released PriMORL ensemble on the public split: for each component of
//! the model's target `(s' - s, r)`, the RMSE of the members' mean prediction, the spread (std)
//! of the target itself, and their ratio. The early-stopping MSE averages the components, so a
//! model can look good while the small components (cart-pole's per-step position changes at
//! dt = 0.01 s) are predicted no better than "no change"; this tool shows which. The public split
//! is public (seed 001): reading it costs no privacy.
//!
//! ```text
//! cargo build --release -p fedrl-bench --bin primorl_model_error
//! target/release/primorl_model_error runs/primorl/balance-primorl-mopo-c1.0-e50-s0 [--episodes 50]
//! ```

use std::path::PathBuf;

use anyhow::bail;
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Output directory of a finished `primorl` run.
    run: PathBuf,
    /// Public episodes to evaluate on.
    #[arg(long, default_value_t = 50)]
    episodes: usize,
}

fn main() -> anyhow::Result<()> {
    fedrl_bench::train_like_fedrl();
    let args = Args::parse();
    let run = fedrl_bench::load_primorl_run(&args.run)?;
    let (task, ens) = (&run.task, &run.ensemble);
    let spec = ens.spec();
    let root = fedrl_rl::offline::data_root(None)?;
    // Only the public split is read.
    let (data, private_units) = fedrl_rl::offline::continuous::load_source_units(
        &task.dataset,
        &root,
        &mut |_| {},
        &|_| false,
    )?;
    let (public, _) = data.split(private_units);
    let public = &public[..args.episodes.min(public.len())];
    let (d, a) = (spec.obs_dim, spec.act_dim);
    let dout = d + 1;
    let mut err = vec![0.0f64; dout];
    let mut rows = 0usize;
    for e in public {
        let n = e.len();
        let p = ens.predict(&e.observations[..n * d], &e.actions[..n * a])?;
        for r in 0..n {
            let target: Vec<f64> = (0..d)
                .map(|k| f64::from(e.observations[(r + 1) * d + k] - e.observations[r * d + k]))
                .chain(std::iter::once(f64::from(e.rewards[r])))
                .collect();
            for (k, t) in target.iter().enumerate() {
                let m = (0..p.members)
                    .map(|i| f64::from(p.mean_of(i, r)[k]))
                    .sum::<f64>()
                    / p.members as f64;
                err[k] += (m - t).powi(2);
            }
            rows += 1;
        }
    }
    if rows == 0 {
        bail!("no public rows");
    }
    let stds = fedrl_rl::primorl::target_scales(public, d)?;
    println!("{} public rows of {}", rows, run.name);
    println!("component   rmse         target std   rmse / std");
    for (k, &std) in stds.iter().enumerate() {
        let rmse = (err[k] / rows as f64).sqrt();
        let std = f64::from(std);
        let name = if k < d {
            format!("ds[{k}]")
        } else {
            "reward".into()
        };
        println!("{name:<10}  {rmse:<11.3e}  {std:<11.3e}  {:.3}", rmse / std);
    }
    Ok(())
}
