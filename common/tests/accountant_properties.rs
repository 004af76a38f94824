//! Property tests of the accountants: epsilon grows with the number of steps and the sampling
//! rate and shrinks with the noise; PLD (the reported figure) never exceeds RDP (its
//! cross-check) beyond the discretisation; the noise search round-trips through epsilon.
//!
//! PLD cases are few and small (each is an FFT over up to ~10^5 points); RDP cases are cheap.

use fedrl_common::privacy::accountant::{self, AccountantKind, sampled_gaussian_rounds};
use proptest::prelude::*;

const DELTA: f64 = 1e-5;

fn eps(z: f64, q: f64, t: u64, kind: AccountantKind) -> f64 {
    accountant::epsilon(&sampled_gaussian_rounds(z, q, t), DELTA, kind)
        .unwrap_or_else(|e| panic!("z={z} q={q} t={t} {kind}: {e}"))
}

/// The PLD grid is 1e-4 nats wide; figures may wobble by about that much.
const PLD_SLACK: f64 = 2e-4;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    // q stays below 0.5: with q near 1 and little noise the fractional-order series of
    // dp_accounting (which we follow) stops converging, those orders drop out (+inf) and the
    // bound at q = 0.9 can exceed the exact one at q = 1.
    fn rdp_is_monotone(z in 0.8f64..8.0, q in 0.001f64..0.5, t in 1u64..20_000, k in 1u64..5_000) {
        let base = eps(z, q, t, AccountantKind::Rdp);
        prop_assert!(eps(z, q, t + k, AccountantKind::Rdp) >= base);
        prop_assert!(eps(z, q * 1.5, t, AccountantKind::Rdp) >= base);
        prop_assert!(eps(z * 1.2, q, t, AccountantKind::Rdp) <= base);
    }

    #[test]
    fn rdp_noise_round_trips(target in 0.2f64..20.0, q in 0.001f64..1.0, t in 1u64..5_000) {
        let z = accountant::noise_multiplier(target, DELTA, q, t, AccountantKind::Rdp)
            .unwrap_or_else(|e| panic!("{e}"));
        let e = eps(z, q, t, AccountantKind::Rdp);
        prop_assert!(e <= target, "z={} gives {} > {}", z, e, target);
        // Minimal to the search tolerance: a slightly smaller z misses the target.
        prop_assert!(eps(z * (1.0 - 1e-4), q, t, AccountantKind::Rdp) > target);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4))]

    #[test]
    fn pld_is_monotone_and_below_rdp(z in 1.2f64..6.0, q in 0.001f64..0.1, t in 1u64..1_000) {
        let base = eps(z, q, t, AccountantKind::Pld);
        prop_assert!(eps(z, q, t * 2, AccountantKind::Pld) >= base - PLD_SLACK);
        prop_assert!(eps(z, q * 1.5, t, AccountantKind::Pld) >= base - PLD_SLACK);
        prop_assert!(eps(z * 1.2, q, t, AccountantKind::Pld) <= base + PLD_SLACK);
        let rdp = eps(z, q, t, AccountantKind::Rdp);
        prop_assert!(base <= rdp + PLD_SLACK, "PLD {} > RDP {}", base, rdp);
    }

    #[test]
    fn pld_noise_round_trips(target in 1.0f64..8.0, q in 0.005f64..0.05, t in 10u64..100) {
        let z = accountant::noise_multiplier(target, DELTA, q, t, AccountantKind::Pld)
            .unwrap_or_else(|e| panic!("{e}"));
        let e = eps(z, q, t, AccountantKind::Pld);
        prop_assert!(e <= target, "z={} gives {} > {}", z, e, target);
        prop_assert!(e >= target * 0.99 - PLD_SLACK, "z={} gives {} << {}", z, e, target);
    }
}
