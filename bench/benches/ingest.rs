//! The aggregator's per-update work on the engine and connection threads, kernel by kernel, for
//! one update of d floats: the server-side re-clip's norm (`clip_l2` on an update already within
//! the bound, the honest case) and on one above it, quantising and adding it to the exact
//! fixed-point sum (`FixedPointSum::add`), and the journal's SHA-256 (`journal::update_digest`,
//! on the connection task). The load benchmark (`src/bin/load.rs`) measures them together with
//! QUIC; this separates them, in ns per coordinate.
//!
//! `cargo bench -p fedrl-bench --bench ingest [-- --dim N] [-- --json]`; each kernel runs
//! `FEDRL_BENCH_REPEATS` times (default 5) and the best run is reported.

use fedrl_bench::{arg_usize as arg, best_of};
use std::hint::black_box;

use fedrl_aggregator::journal::update_digest;
use fedrl_common::privacy::clipping::clip_l2;
use fedrl_common::privacy::fixed_point::{DEFAULT_GRID_BITS, FixedPointSum, Grid};

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let dim = arg("--dim", 1_000_000).max(1);
    let repeats: usize = std::env::var("FEDRL_BENCH_REPEATS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5)
        .max(1);
    let clip = 1.0;
    // A deterministic update of norm 0.9 (within the bound) with varied magnitudes.
    let mut update: Vec<f32> = (0..dim)
        .map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * if i % 7 == 0 { 5.0 } else { 1.0 })
        .collect();
    let norm = update
        .iter()
        .map(|&x| (x as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    update
        .iter_mut()
        .for_each(|x| *x = (*x as f64 * 0.9 / norm) as f32);
    let big: Vec<f32> = update.iter().map(|x| x * 3.0).collect();

    let grid = match Grid::for_clip_norm(clip, DEFAULT_GRID_BITS) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("grid: {e}");
            std::process::exit(1);
        }
    };
    let mut cases: Vec<(&str, f64)> = Vec::new();
    let mut v = update.clone();
    cases.push((
        "clip_l2_within",
        best_of(repeats, || {
            black_box(clip_l2(black_box(&mut v), clip));
        }),
    ));
    let mut scratch = big.clone();
    cases.push((
        "clip_l2_above",
        best_of(repeats, || {
            scratch.copy_from_slice(&big);
            black_box(clip_l2(black_box(&mut scratch), clip));
        }),
    ));
    let mut sum = FixedPointSum::new(grid, dim);
    let mut failed = None;
    cases.push((
        "fixed_point_add",
        best_of(repeats, || {
            if let Err(e) = sum.add(black_box(&update)) {
                failed = Some(e);
            }
        }),
    ));
    if let Some(e) = failed {
        eprintln!("fixed_point_add failed: {e}");
        std::process::exit(1);
    }
    cases.push((
        "sha256_digest",
        best_of(repeats, || {
            black_box(update_digest(black_box(&update)));
        }),
    ));
    for (name, s) in cases {
        let ns = s * 1e9 / dim as f64;
        if json {
            println!(
                "{}",
                serde_json::json!({"bench": "ingest", "kernel": name, "dim": dim, "ns_per_coord": ns, "s_per_gb": ns / 4.0})
            );
        } else {
            println!("{name:<18} {ns:>7.3} ns/coord  {:>6.3} CPU s/GB", ns / 4.0);
        }
    }
}
