//! Samples per second of the exact discrete Gaussian (`DiscreteGaussianNoise::add_to` on i64,
//! ChaCha20 and integer arithmetic only) next to the floating-point path it replaces
//! (`rand_distr::Normal` in f64 on the same ChaCha20, added to f32, as the engine did before
//! exact noise), in the same run. A model of 10^6 parameters needs 10^6 samples per release.
//!
//! `cargo bench -p fedrl-bench --bench noise [-- --json] [-- --samples N]`. Cases: sigma = 1e5
//! grid units, and sigma = 1.1 x 2^24 (noise multiplier 1.1 on the default grid, what a release
//! draws). Each case runs `FEDRL_BENCH_REPEATS` times (default 3); the best run is reported.

use fedrl_bench::{arg_usize as arg, best_of};
use std::hint::black_box;

use fedrl_common::privacy::discrete_gaussian::DiscreteGaussian;
use fedrl_common::privacy::fixed_point::{DEFAULT_GRID_BITS, Grid, NoiseCalibration};
use fedrl_common::privacy::noise::DiscreteGaussianNoise;
use rand::SeedableRng;
use rand::rngs::ChaCha20Rng;
use rand_distr::{Distribution, Normal};

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let samples = arg("--samples", 1_000_000).max(1);
    let repeats: usize = std::env::var("FEDRL_BENCH_REPEATS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
        .max(1);
    let default_grid = match Grid::for_clip_norm(1.0, DEFAULT_GRID_BITS)
        .and_then(|g| NoiseCalibration::new(&g, 1.1))
    {
        Ok(c) => *c.distribution(),
        Err(e) => {
            eprintln!("calibration failed: {e}");
            std::process::exit(1);
        }
    };
    let cases = [
        ("sigma_1e5", DiscreteGaussian::new(10_000_000_000, 1)),
        ("default_grid_z1.1", Ok(default_grid)),
    ];
    for (case, dist) in cases {
        let dist = match dist {
            Ok(d) => d,
            Err(e) => {
                eprintln!("{case}: {e}");
                std::process::exit(1);
            }
        };
        let sigma = dist.variance().sqrt();
        let mut ints = vec![0i64; samples];
        let mut noise = DiscreteGaussianNoise::seeded(1);
        let mut failed = None;
        let exact_s = best_of(repeats, || {
            ints.iter_mut().for_each(|x| *x = 0);
            if let Err(e) = noise.add_to(black_box(&mut ints), &dist) {
                failed = Some(e);
            }
        });
        if let Some(e) = failed {
            eprintln!("{case}: sampling failed: {e}");
            std::process::exit(1);
        }
        let normal = match Normal::new(0.0, sigma) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("{case}: {e}");
                std::process::exit(1);
            }
        };
        let mut rng = ChaCha20Rng::seed_from_u64(1);
        let mut floats = vec![0f32; samples];
        let float_s = best_of(repeats, || {
            for x in black_box(&mut floats).iter_mut() {
                *x = (*x as f64 + normal.sample(&mut rng)) as f32;
            }
        });
        let exact_rate = samples as f64 / exact_s;
        let float_rate = samples as f64 / float_s;
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "case": case,
                    "sigma_grid_units": sigma,
                    "samples": samples,
                    "repeats": repeats,
                    "discrete_gaussian_samples_per_s": exact_rate,
                    "float_normal_samples_per_s": float_rate,
                    "slowdown": float_rate / exact_rate,
                })
            );
        } else {
            println!(
                "{case} (sigma {sigma:.4e} grid units, {samples} samples, best of {repeats}): \
                 discrete Gaussian {:.3e}/s ({:.1} ns each), float Normal {:.3e}/s \
                 ({:.1} ns each), {:.1}x slower",
                exact_rate,
                1e9 / exact_rate,
                float_rate,
                1e9 / float_rate,
                float_rate / exact_rate
            );
        }
    }
}
