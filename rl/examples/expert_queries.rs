//! Times the count queries of a cached (or newly generated) experts dataset: `prefix_counts`
//! over every expert for demonstrations of length up to L.
//!
//! `cargo run --release -p fedrl-rl --example expert_queries -- DATA_DIR [ENV POPULATION]`
//! (defaults `CartPole-v1 cartpole-b1`, the default `Behaviour::Experts` with 3000 experts x 20
//! demonstrations, the dataset `fedrl data generate --behaviour experts` makes).

use std::time::Instant;

use fedrl_common::offline::{Behaviour, DatasetSpec};
use fedrl_rl::offline::cache;
use fedrl_rl::offline::experts::ExpertSet;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // As the `fedrl` binary does: the experts' blocks run on threads of their own.
        // SAFETY: first statement of main, before any thread exists.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    let args: Vec<String> = std::env::args().collect();
    let root = args
        .get(1)
        .ok_or("usage: expert_queries DATA_DIR [ENV POPULATION]")?;
    let env = args.get(2).map_or("CartPole-v1", String::as_str);
    let population = args.get(3).map_or("cartpole-b1", String::as_str);
    let spec = DatasetSpec {
        env: env.into(),
        behaviour: Behaviour::experts(population),
        units: 3000,
        episodes_per_unit: 20,
        ..DatasetSpec::default()
    };
    let root = std::path::Path::new(root);
    let t = Instant::now();
    let (data, _) = cache::load_or_generate(&spec, root, &mut |_| {})?;
    let set = ExpertSet::load(&spec, root)?;
    println!(
        "loaded {} experts and {} episodes in {:.2} s",
        set.experts(),
        data.episodes.len(),
        t.elapsed().as_secs_f64()
    );
    let units: Vec<u64> = (0..set.experts()).collect();
    let longest = data
        .episodes
        .iter()
        .max_by_key(|e| e.len())
        .ok_or("empty dataset")?;
    let l = longest.len();
    let obs = &longest.observations[..l * data.obs_dim];
    let mut best = f64::INFINITY;
    let mut counts = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        counts = set.prefix_counts(&units, obs, &longest.actions)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "prefix_counts over {} experts, L = {l}: best of 5 {:.3} s; count of the first prefix \
         {:.1}, of the whole trajectory {:.3e}",
        units.len(),
        best,
        counts[0],
        counts[l - 1]
    );
    Ok(())
}
