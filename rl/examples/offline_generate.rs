//! Generates one offline dataset (no cache) and prints the behaviour quality of every PPO
//! checkpoint and the dataset summary: how the `ppo_mixed` settings were chosen.
//!
//! ```text
//! cargo run --release -p fedrl-rl --example offline_generate -- ENV UNITS [ITERATIONS] [CHECKPOINTS] [EPSILON] [SEED]
//! ```

use fedrl_common::offline::{Behaviour, DatasetSpec};
use fedrl_rl::offline::generate::{Progress, generate};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: first statement of main, before any thread exists.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    let a: Vec<String> = std::env::args().skip(1).collect();
    let get = |i: usize, d: &str| a.get(i).cloned().unwrap_or_else(|| d.to_string());
    let spec = DatasetSpec {
        env: get(0, "CartPole-v1"),
        units: get(1, "200").parse()?,
        behaviour: Behaviour::PpoMixed {
            iterations: get(2, "60").parse()?,
            checkpoints: get(3, "4").parse()?,
            epsilon: get(4, "0.2").parse()?,
        },
        seed: get(5, "0").parse()?,
        ..DatasetSpec::default()
    };
    let t0 = std::time::Instant::now();
    let d = generate(&spec, &mut |p| match p {
        Progress::Training {
            done, train_return, ..
        } => {
            if done % 5 == 0 {
                println!(
                    "iteration {done:4} train return {train_return:8.1} ({:.1} s)",
                    t0.elapsed().as_secs_f64()
                )
            }
        }
        Progress::Checkpoint {
            index,
            iteration,
            mean_return,
            episodes,
        } => println!(
            "checkpoint {index} after {iteration} iterations: mean return {mean_return:.1} \
             ({episodes} episodes, epsilon included)"
        ),
        Progress::Recording { .. } => {}
    })?;
    println!("{}", serde_json::to_string(&d.summary())?);
    println!("{:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}
