//! How far an expert dataset's experts agree, which is what the DataRelease of seed 000/002
//! needs: the histogram of the experts' greedy actions at the first recorded state, and the
//! count query's answer (the sum over all experts of each prefix's probability) along the first
//! steps of a few recorded episodes. Operator-side diagnostics on the cached experts: exact
//! counts, never to be published.
//!
//! ```text
//! cargo build --release -p fedrl-bench --bin expert_agreement
//! target/release/expert_agreement bench/results/datasets/fedrl/hivtreatment20d-experts-417f77dc-v0
//!     [--steps 12] [--episodes 0,20,40,1000,5000,30000]
//! ```

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use fedrl_rl::offline::{ExpertSet, minari};

#[derive(Parser)]
struct Args {
    /// A cached expert dataset (the folder holding `experts.safetensors` and `data/`).
    dataset: PathBuf,
    /// Prefix lengths to count.
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Episodes (by position) whose prefixes are counted.
    #[arg(long, value_delimiter = ',', default_value = "0,20,40,1000,5000,30000")]
    episodes: Vec<usize>,
}

fn main() -> anyhow::Result<()> {
    fedrl_bench::train_like_fedrl();
    let args = Args::parse();
    let path = args.dataset.join("experts.safetensors");
    let experts = ExpertSet::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let data = minari::read(&args.dataset)
        .with_context(|| format!("reading {}", args.dataset.display()))?
        .dataset;
    let units: Vec<u64> = (0..experts.experts()).collect();
    let first = data
        .episodes
        .first()
        .context("the dataset has no episodes")?;
    let obs0 = first
        .observations
        .get(..data.obs_dim)
        .context("the first episode has no observation")?;
    let mut greedy = vec![0usize; experts.n_actions()];
    for &u in &units {
        let p = experts.action_probs(u, obs0)?;
        let best = (0..p.len())
            .max_by(|&i, &j| p[i].total_cmp(&p[j]))
            .unwrap_or(0);
        greedy[best] += 1;
    }
    println!(
        "{} experts; greedy action at the first state, per action: {greedy:?}",
        units.len()
    );
    for &i in &args.episodes {
        let Some(e) = data.episodes.get(i) else {
            continue;
        };
        let l = e.actions.len().min(args.steps);
        let counts =
            experts.prefix_counts(&units, &e.observations[..l * data.obs_dim], &e.actions[..l])?;
        let counts: Vec<i64> = counts.iter().map(|c| c.round() as i64).collect();
        println!(
            "episode {i} (unit {}, return {:.3e}): actions {:?}, prefix counts {counts:?}",
            e.unit,
            e.total_return(),
            &e.actions[..l]
        );
    }
    Ok(())
}
