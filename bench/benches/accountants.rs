//! Time to compute epsilon of T Poisson-sampled Gaussian rounds with the PLD and RDP accountants
//! (z = 1.1, q = 0.004, T = 100 000, delta = 1e-5 by default), the figure compared with
//! dp_accounting 0.6.0 by `bench/run_accountants.sh`.
//!
//! `cargo bench -p fedrl-bench --bench accountants [-- --json]`; with `--json` one JSON object
//! per accountant and line. Each accountant runs once cold (first call in the process: FFT plans
//! not cached yet) and then `FEDRL_BENCH_REPEATS` times (default 5); the minimum of the repeats
//! is reported beside the cold time.

use std::hint::black_box;
use std::time::Instant;

use fedrl_common::privacy::accountant::{self, AccountantKind, sampled_gaussian_rounds};

const Z: f64 = 1.1;
const Q: f64 = 0.004;
const T: u64 = 100_000;
const DELTA: f64 = 1e-5;

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let repeats: usize = std::env::var("FEDRL_BENCH_REPEATS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5)
        .max(1);
    let event = sampled_gaussian_rounds(Z, Q, T);
    for kind in [AccountantKind::Pld, AccountantKind::Rdp] {
        let time = || {
            let start = Instant::now();
            let eps = accountant::epsilon(black_box(&event), DELTA, kind);
            (start.elapsed().as_secs_f64(), eps)
        };
        let (cold, eps) = time();
        let eps = match eps {
            Ok(e) => e,
            Err(e) => {
                eprintln!("{kind}: {e}");
                std::process::exit(1);
            }
        };
        let best = (0..repeats).map(|_| time().0).fold(f64::INFINITY, f64::min);
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "accountant": kind.to_string(),
                    "epsilon": eps,
                    "seconds_cold": cold,
                    "seconds_min": best,
                    "repeats": repeats,
                    "noise_multiplier": Z,
                    "sampling_rate": Q,
                    "steps": T,
                    "delta": DELTA,
                })
            );
        } else {
            println!(
                "{kind}: epsilon {eps:.6} at delta {DELTA:e}; cold {:.2} ms, best of {repeats} {:.2} ms",
                cold * 1e3,
                best * 1e3
            );
        }
    }
}
