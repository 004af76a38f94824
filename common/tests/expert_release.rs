//! Expert-level DP offline RL (seed 002): DataRelease's parameters and its per-trajectory walk,
//! Lemma 5.2 by Monte Carlo, and the expert-level plan (Theorem 5.6) against independent
//! compositions and against the ledger.

use fedrl_common::privacy::accountant::{self, AccountantKind};
use fedrl_common::privacy::expert_plan::{ExpertPlan, ReleaseBudget, max_dp_steps, noise_for_plan};
use fedrl_common::privacy::expert_release::{
    Calibration, ReleaseParameters, max_stable_prefix, prefix_query, stable_prefix, theta_hat,
};
use fedrl_common::privacy::ledger::{
    LedgerConfig, LedgerError, Participation, PrivacyLedger, RoundRecord, UnitKind,
};
use fedrl_common::privacy::noise::NoiseSource;
use fedrl_common::privacy::pld::DEFAULT_DISCRETIZATION;
use fedrl_common::privacy::{Delta, DpEvent, PrivacyError};
use rand::SeedableRng;
use rand::rngs::ChaCha20Rng;

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-300)
}

/// The paper's CartPole setting (appendix B.3): epsilon = 10, epsilon_1 = 3/4 epsilon,
/// delta = 1/m with m = 3000, delta_1 = 9/10 delta, T = 25, L = 200, p_min = 0.02.
const M: u64 = 3000;
const EPSILON: f64 = 10.0;
const T: u64 = 25;
const L: u64 = 200;
const P_MIN: f64 = 0.02;

fn delta() -> f64 {
    1.0 / M as f64
}

fn cartpole_release() -> ReleaseBudget {
    ReleaseBudget::new(0.75 * EPSILON, 0.9 * delta(), T, Calibration::Theorem).expect("budget")
}

fn cartpole_parameters() -> ReleaseParameters {
    let p = cartpole_release().parameters(P_MIN, L).expect("parameters");
    let r = cartpole_release();
    assert_eq!(
        ReleaseParameters::new(r.epsilon_1, r.delta_1, P_MIN, T, L).ok(),
        Some(p)
    );
    p
}

#[test]
fn cartpole_release_parameters_follow_algorithm_2() {
    let p = cartpole_parameters();
    let (eps1, delta1): (f64, f64) = (7.5, 0.9 / 3000.0);
    // Algorithm 2, lines 2-3 and 7, written out again.
    let eps_prime = eps1 / (32.0 * 25.0 * (2.0 / delta1).ln()).sqrt();
    let delta_prime = delta1 / (2.0 * 25.0 * 200.0);
    let c_min = eps_prime.exp() / (eps_prime.exp() - 1.0);
    let theta = c_min / 0.02;
    let offset = theta + 4.0 / eps_prime * (1.0 / delta_prime).ln();
    for (name, got, want) in [
        ("epsilon'", p.epsilon_prime, eps_prime),
        ("delta'", p.delta_prime, delta_prime),
        ("c_min", p.c_min, c_min),
        ("theta", p.theta, theta),
        ("theta-hat offset", p.theta_hat_offset, offset),
    ] {
        assert!(rel(got, want) < 1e-9, "{name}: {got} vs {want}");
    }
    assert_eq!((p.trajectories, p.horizon), (T, L));
    // The numbers themselves, so a change of formula shows: epsilon' ~ 0.0894, theta ~ 585,
    // theta-hat offset ~ 1360 expected experts.
    assert!((0.089..0.090).contains(&p.epsilon_prime), "{p:?}");
    assert!((580.0..590.0).contains(&p.theta), "{p:?}");
    assert!((1350.0..1370.0).contains(&p.theta_hat_offset), "{p:?}");
}

#[test]
fn cartpole_stable_transitions_are_bounded_near_one_thousand() {
    let p = cartpole_parameters();
    let h = max_stable_prefix(M, 2, P_MIN, &p).expect("bound");
    // Independently: the longest h with m (1 - p_min)^h above the offset.
    let mut want = 0u64;
    while (M as f64) * (1.0 - P_MIN).powi(want as i32 + 1) > p.theta_hat_offset {
        want += 1;
    }
    assert_eq!(h, want);
    let transitions = h * T;
    println!(
        "CartPole, epsilon = 10: a stable prefix has at most {h} steps (noise-free), so \
         |D_stable| <= about {transitions} transitions over T = {T} trajectories"
    );
    // The paper's derived bound: about 1,000 transitions.
    assert!((900..=1100).contains(&transitions), "{transitions}");
    // More experts, longer prefixes; capped at L; none when m is below the offset.
    assert!(max_stable_prefix(30_000, 2, P_MIN, &p).expect("bound") > h);
    assert_eq!(max_stable_prefix(u64::MAX, 2, P_MIN, &p).expect("bound"), L);
    assert_eq!(max_stable_prefix(1000, 2, P_MIN, &p).expect("bound"), 0);
    // Assumption 3: p_min <= 1/|A|.
    assert!(max_stable_prefix(M, 2, 0.6, &p).is_err());
    // Uniform experts (p_min = 1/|A|): each step halves the count.
    let uniform = max_stable_prefix(M, 2, 0.5, &p).expect("uniform experts");
    assert!(uniform < h && (M as f64) * 0.5f64.powi(uniform as i32) > p.theta_hat_offset);
    assert!((M as f64) * 0.5f64.powi(uniform as i32 + 1) <= p.theta_hat_offset);
    assert!(max_stable_prefix(M, 1, P_MIN, &p).is_err());
}

/// P(Lap(4/eps') - Lap(2/eps') > (4/eps') ln(1/delta')): the chance that a prefix whose count
/// is exactly theta passes (the supremum over counts below theta). The tail of a sum of
/// independent Laplace variables with scales b1 != b2 at t > 0 is
/// (b1^2 e^{-t/b1} - b2^2 e^{-t/b2}) / (2 (b1^2 - b2^2)); with b1 = 4, b2 = 2 (in units of
/// 1/eps') and t = 4 ln(1/delta') it is 2/3 delta' - delta'^2 / 6 < delta' (Lemma 5.2).
fn pass_probability_at_theta(delta_prime: f64) -> f64 {
    let (b1, b2) = (4.0_f64, 2.0_f64);
    let t = 4.0 * (1.0 / delta_prime).ln();
    (b1 * b1 * (-t / b1).exp() - b2 * b2 * (-t / b2).exp()) / (2.0 * (b1 * b1 - b2 * b2))
}

#[test]
fn lemma_5_2_a_prefix_below_theta_passes_with_frequency_below_delta_prime() {
    // Large epsilon_1 and T L = 1 make delta' = 0.05 measurable.
    let p = ReleaseParameters::new(10.0, 0.1, P_MIN, 1, 1).expect("parameters");
    assert!(rel(p.delta_prime, 0.05) < 1e-12);
    let exact = pass_probability_at_theta(p.delta_prime);
    assert!(exact < p.delta_prime);
    let mut rng = ChaCha20Rng::seed_from_u64(52);
    let trials = 200_000u32;
    let sd = (exact * (1.0 - exact) / trials as f64).sqrt();
    for count in [p.theta, 0.999 * p.theta] {
        let passed = (0..trials)
            .filter(|_| stable_prefix(&[count], &p, &mut rng).expect("walk") == 1)
            .count();
        let freq = passed as f64 / trials as f64;
        println!(
            "count {count:.2} (theta {:.2}): passed {freq:.5}, exact at theta {exact:.5}, \
             delta' {}",
            p.theta, p.delta_prime
        );
        // The lemma, with power: delta' - exact is about 40 standard deviations here.
        assert!(freq < p.delta_prime, "{freq} >= delta' {}", p.delta_prime);
        // And the mechanism is the one analysed (not, say, one that never passes).
        assert!(freq <= exact + 5.0 * sd, "{freq} vs {exact}");
        assert!(
            freq > exact - 0.05 * p.delta_prime - 5.0 * sd,
            "{freq} vs {exact}"
        );
    }
    // A prefix far above theta-hat passes almost always.
    let high = p.theta_hat_offset + 20.0 / p.epsilon_prime * 4.0;
    let passed = (0..20_000)
        .filter(|_| stable_prefix(&[high], &p, &mut rng).expect("walk") == 1)
        .count();
    assert!(passed > 19_000, "{passed}");
}

#[test]
fn prefix_query_and_theta_hat_match_the_closed_form() {
    // The two draws of Algorithms 1-2 directly, at another delta'.
    let p = ReleaseParameters::new(5.0, 0.2, 0.1, 1, 2).expect("parameters");
    let exact = pass_probability_at_theta(p.delta_prime);
    let mut rng = ChaCha20Rng::seed_from_u64(53);
    let trials = 200_000u32;
    let passed = (0..trials)
        .filter(|_| {
            let th = theta_hat(p.theta, p.epsilon_prime, p.delta_prime, &mut rng).expect("th");
            prefix_query(p.theta, th, p.epsilon_prime, &mut rng).expect("query")
        })
        .count();
    let freq = passed as f64 / trials as f64;
    let sd = (exact * (1.0 - exact) / trials as f64).sqrt();
    assert!((freq - exact).abs() < 5.0 * sd, "{freq} vs {exact}");
    assert!(freq < p.delta_prime);
}

#[test]
fn stable_prefix_releases_up_to_the_first_failure() {
    // epsilon' ~ 1 (noise scales 2 and 4), offset ~ 100: a count of 1e6 passes and 0 fails
    // except with probability below 1e-10.
    let p = ReleaseParameters::new(10.0, 0.1, P_MIN, 1, 10).expect("parameters");
    assert!(p.theta_hat_offset > 90.0 && p.epsilon_prime > 0.9, "{p:?}");
    let (hi, lo) = (1e6, 0.0);
    let mut rng = ChaCha20Rng::seed_from_u64(7);
    for _ in 0..200 {
        let walk = |c: &[f64], rng: &mut ChaCha20Rng| stable_prefix(c, &p, rng).expect("walk");
        assert_eq!(walk(&[hi; 10], &mut rng), 10, "all pass: released whole");
        assert_eq!(
            walk(&[hi; 4], &mut rng),
            4,
            "shorter than L: its own length"
        );
        assert_eq!(
            walk(&[hi, hi, lo, hi], &mut rng),
            2,
            "fails at 3: prefix of 2"
        );
        assert_eq!(walk(&[hi, hi, hi, lo], &mut rng), 3);
        assert_eq!(walk(&[lo, hi, hi], &mut rng), 0, "fails at 1: nothing");
        assert_eq!(walk(&[lo], &mut rng), 0);
    }
    let mut rng = ChaCha20Rng::seed_from_u64(8);
    for bad in [
        vec![],
        vec![hi; 11],
        vec![hi, f64::NAN],
        vec![hi, -1.0],
        vec![f64::INFINITY],
    ] {
        match stable_prefix(&bad, &p, &mut rng) {
            Err(PrivacyError::InvalidAnswer(_)) => {}
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

/// Delta at which k adaptive runs of an (eps, d)-DP mechanism are (e_total, delta)-DP, exactly
/// (Kairouz, Oh & Viswanath 2015, Theorem 3.3, for any e_total): the hockey-stick divergence of
/// the k-fold product of the worst-case pair P = (d, (1-d) e^eps/(1+e^eps), (1-d)/(1+e^eps), 0),
/// Q = its mirror image: 1 - (1-d)^k + (1-d)^k sum_l C(k,l) [e^{(k-l) eps} - e^{e_total + l eps}]_+
/// / (1+e^eps)^k.
fn kov_delta(eps: f64, d: f64, k: u64, e_total: f64) -> f64 {
    let kf = k as f64;
    let log_norm = kf * eps.exp().ln_1p();
    let mut sum = 0.0;
    let mut log_binom = 0.0_f64; // ln C(k, l)
    for l in 0..=k {
        if l > 0 {
            log_binom += ((k - l + 1) as f64).ln() - (l as f64).ln();
        }
        let lf = l as f64;
        let gap = (kf - 2.0 * lf) * eps - e_total;
        if gap > 0.0 {
            sum += (log_binom + (kf - lf) * eps - log_norm).exp() * -(-gap).exp_m1();
        }
    }
    let keep = (1.0 - d).powf(kf);
    1.0 - keep + keep * sum
}

/// The smallest e_total with kov_delta <= delta (bisection; kov_delta decreases in e_total).
fn kov_epsilon(eps: f64, d: f64, k: u64, delta: f64) -> f64 {
    if kov_delta(eps, d, k, 0.0) <= delta {
        return 0.0;
    }
    let (mut lo, mut hi) = (0.0, k as f64 * eps);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if kov_delta(eps, d, k, mid) <= delta {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

#[test]
fn kov_closed_form_matches_known_values() {
    // One run: (eps, d) itself.
    assert!(rel(kov_epsilon(0.7, 1e-6, 1, 1e-6), 0.7) < 1e-9);
    // Two pure runs at delta 0: 2 eps; and the KOV point i = 1 of k = 2: (0, delta_1) with
    // delta_1 = (e^{2 eps} - 1) / (1 + e^eps)^2.
    assert!(rel(kov_epsilon(0.5, 0.0, 2, 0.0), 1.0) < 1e-9);
    let e = 0.5_f64;
    let d1 = ((2.0 * e).exp() - 1.0) / (1.0 + e.exp()).powi(2);
    assert!(rel(kov_delta(e, 0.0, 2, 0.0), d1) < 1e-12);
}

#[test]
fn release_only_plan_matches_the_optimal_composition() {
    for (budget, delta) in [
        (cartpole_release(), delta()),
        (
            ReleaseBudget::new(1.0, 1e-5, 5, Calibration::Theorem).expect("budget"),
            2e-5,
        ),
    ] {
        let plan = ExpertPlan {
            release: Some(budget),
            dp_steps: 0,
            rate: 0.1,
            noise_multiplier: 1.0,
        };
        let got = plan.epsilon(delta).expect("plan epsilon");
        let (pass_eps, pass_delta) = (
            2.0 * fedrl_common::privacy::expert_release::epsilon_prime(
                budget.epsilon_1,
                budget.delta_1,
                budget.trajectories,
            )
            .expect("eps'"),
            budget.delta_1 / (2.0 * budget.trajectories as f64),
        );
        let want = kov_epsilon(pass_eps, pass_delta, budget.trajectories, delta);
        println!(
            "release (eps_1 {}, delta_1 {:e}, T {}) at delta {delta:e}: PLD {got:.6}, optimal \
             composition {want:.6}",
            budget.epsilon_1, budget.delta_1, budget.trajectories
        );
        // PLD is pessimistic: never below the exact figure, and above it by at most its
        // discretisation (one grid step of DEFAULT_DISCRETIZATION nats per composed pass).
        assert!(got >= want - 1e-9, "{got} < {want}");
        let bound = budget.trajectories as f64 * DEFAULT_DISCRETIZATION;
        assert!(
            got - want <= bound,
            "{got} vs {want}: above by more than {bound}"
        );
        assert!(rel(got, want) < 2e-3, "{got} vs {want}");
        // Both far below the release's nominal epsilon_1 in the CartPole setting, where
        // Theorem 5.5's advanced composition is loose (epsilon_1 > 1).
        assert!(got <= budget.epsilon_1);
    }
}

#[test]
fn plan_with_dp_steps_is_bounded_by_rdp_and_basic_composition() {
    // DP steps only: PLD <= RDP, and RDP within a sane factor.
    let steps_only = ExpertPlan {
        release: None,
        dp_steps: 2000,
        rate: 256.0 / 3000.0,
        noise_multiplier: 5.0,
    };
    let pld = steps_only.epsilon(delta()).expect("pld");
    let event = steps_only.event().expect("event");
    let rdp = accountant::epsilon(&event, delta(), AccountantKind::Rdp).expect("rdp");
    println!("2000 DP steps, q = 256/3000, z = 5: PLD {pld:.4}, RDP {rdp:.4}");
    assert!(pld <= rdp && rdp < 1.5 * pld, "{pld} {rdp}");
    // With the release: below the basic composition of the optimal release composition and the
    // RDP bound of the steps at delta/2 each, and above each part alone.
    let plan = ExpertPlan {
        release: Some(cartpole_release()),
        ..steps_only
    };
    let both = plan.epsilon(delta()).expect("plan");
    let r = cartpole_release();
    let pass_eps = 2.0
        * fedrl_common::privacy::expert_release::epsilon_prime(r.epsilon_1, r.delta_1, T)
            .expect("eps'");
    let release_half = kov_epsilon(pass_eps, r.delta_1 / (2.0 * T as f64), T, 0.5 * delta());
    let steps_half = accountant::epsilon(&event, 0.5 * delta(), AccountantKind::Rdp).expect("rdp");
    println!(
        "release + 2000 steps: PLD {both:.4} <= basic {:.4}",
        release_half + steps_half
    );
    assert!(both <= release_half + steps_half, "{both}");
    assert!(both > pld);
    let release_only = ExpertPlan {
        dp_steps: 0,
        ..plan
    };
    assert!(both > release_only.epsilon(delta()).expect("release"));
    // The event tree is the release then the K steps.
    match plan.event().expect("event") {
        DpEvent::Composed { events } => {
            assert_eq!(events.len(), 2);
            assert_eq!(events[0], r.event().expect("release event"));
            assert_eq!(
                events[1],
                accountant::sampled_gaussian_rounds(5.0, 256.0 / 3000.0, 2000)
            );
        }
        other => panic!("{other}"),
    }
    // An empty plan costs nothing and has no event.
    let empty = ExpertPlan {
        release: None,
        dp_steps: 0,
        ..steps_only
    };
    assert_eq!(empty.epsilon(delta()).ok(), Some(0.0));
    assert!(empty.event().is_err());
}

#[test]
fn max_dp_steps_is_the_largest_count_that_fits() {
    let (q, z) = (256.0 / 3000.0, 1.2);
    let target = EPSILON;
    let k = max_dp_steps(Some(cartpole_release()), q, z, target, delta(), 1_000_000).expect("k");
    let plan = |k: u64| ExpertPlan {
        release: Some(cartpole_release()),
        dp_steps: k,
        rate: q,
        noise_multiplier: z,
    };
    let at = plan(k).epsilon(delta()).expect("eps");
    let next = plan(k + 1).epsilon(delta()).expect("eps");
    println!(
        "CartPole release + DP steps at q = {q:.4}, z = {z}: K = {k} ({at:.6} <= {target} < {next:.6})"
    );
    assert!(k > 10 && at <= target && next > target, "{k}: {at} {next}");
    // The cap binds; a release alone above the target leaves no step; bad input is refused.
    assert_eq!(
        max_dp_steps(Some(cartpole_release()), q, z, target, delta(), 7).expect("k"),
        7
    );
    assert_eq!(
        max_dp_steps(Some(cartpole_release()), q, z, 1.0, delta(), 1000).expect("k"),
        0
    );
    assert!(max_dp_steps(None, 0.0, z, target, delta(), 10).is_err());
    assert!(max_dp_steps(None, q, -1.0, target, delta(), 10).is_err());
    assert!(max_dp_steps(None, q, z, f64::NAN, delta(), 10).is_err());
}

#[test]
fn noise_for_plan_is_the_smallest_that_fits() {
    let (q, k) = (256.0 / 3000.0, 500);
    let target = EPSILON;
    let z = noise_for_plan(Some(cartpole_release()), q, k, target, delta()).expect("z");
    let plan = |z: f64| ExpertPlan {
        release: Some(cartpole_release()),
        dp_steps: k,
        rate: q,
        noise_multiplier: z,
    };
    let at = plan(z).epsilon(delta()).expect("eps");
    let less = plan(0.99 * z).epsilon(delta()).expect("eps");
    println!(
        "CartPole release + {k} DP steps at q = {q:.4}: z = {z:.4} ({at:.4} <= {target} < {less:.4})"
    );
    assert!(at <= target && less > target, "{z}: {at} {less}");
    // Without the release the same steps need less noise.
    let alone = noise_for_plan(None, q, k, target, delta()).expect("z");
    assert!(alone < z, "{alone} {z}");
    // A release above the target leaves no noise level that fits.
    match noise_for_plan(Some(cartpole_release()), q, k, 1.0, delta()) {
        Err(PrivacyError::NoSolution(m)) => assert!(m.contains("release alone"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(noise_for_plan(None, q, 0, target, delta()).is_err());
}

fn expert_record(round: u64, phase: &str, event: DpEvent) -> RoundRecord {
    RoundRecord {
        round,
        phase: phase.into(),
        event,
        sampled_by_aggregator: true,
        units: vec![],
        clip_norm: Some(1.0),
        expected_cohort: Some(256.0),
        noise_source: NoiseSource::Seeded { seed: 1 },
        unix_time_s: 1.0e9,
    }
}

#[test]
fn a_ledger_of_the_plan_reports_its_epsilon_and_stops_at_max_dp_steps() {
    let (q, z) = (256.0 / 3000.0, 1.2);
    let target = EPSILON;
    let k = max_dp_steps(Some(cartpole_release()), q, z, target, delta(), 100_000).expect("k");
    let plan = ExpertPlan {
        release: Some(cartpole_release()),
        dp_steps: k,
        rate: q,
        noise_multiplier: z,
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let config = LedgerConfig {
        target_epsilon: target,
        delta: Delta::try_from(delta()).expect("delta"),
        unit_kind: UnitKind::Expert,
        participation: Participation::sampled(q).expect("rate"),
    };
    let (mut ledger, _) =
        PrivacyLedger::open(dir.path().join("privacy.ledger"), config).expect("open");
    let release = plan.release_event().expect("event").expect("a release");
    ledger
        .append(expert_record(0, "release", release))
        .expect("release fits");
    let step = plan.dp_step_event().expect("step");
    for round in 1..=k {
        ledger
            .append(expert_record(round, "dp-sgd", step.clone()))
            .expect("within the plan");
    }
    let report = ledger.report().expect("report");
    let want = plan.epsilon(delta()).expect("plan");
    println!(
        "ledger: release + {k} DP steps: {} (plan {want})",
        report.epsilon
    );
    assert_eq!(report.epsilon, want, "the same accounting, bit for bit");
    assert_eq!(report.phases.len(), 2);
    // The next DP step is refused, exactly where max_dp_steps stopped.
    match ledger.append(expert_record(k + 1, "dp-sgd", step)) {
        Err(LedgerError::BudgetExceeded { epsilon, .. }) => {
            let next = ExpertPlan {
                dp_steps: k + 1,
                ..plan
            };
            assert_eq!(epsilon, next.epsilon(delta()).expect("next"));
        }
        other => panic!("step {} should be refused: {other:?}", k + 1),
    }
}

/// `calibration = "accountant"`: epsilon' is the largest whose T passes the PLD accountant
/// composes to epsilon_1 at delta_1; it is above the formula's (advanced composition is
/// loose), fits, is tight, and lowers the threshold the release walks against.
#[test]
fn accountant_calibration_spends_the_release_budget_tightly() {
    let (eps1, delta1) = (0.75 * EPSILON, 0.9 * delta());
    let theorem = ReleaseBudget::new(eps1, delta1, T, Calibration::Theorem).expect("budget");
    let tight = ReleaseBudget::new(eps1, delta1, T, Calibration::Accountant).expect("budget");
    assert!(
        tight.epsilon_prime > 1.5 * theorem.epsilon_prime,
        "{} vs {}",
        tight.epsilon_prime,
        theorem.epsilon_prime
    );
    let composed = |b: &ReleaseBudget| {
        accountant::epsilon(&b.event().expect("event"), delta1, AccountantKind::Pld)
            .expect("epsilon")
    };
    // The formula's release composes to well under epsilon_1; the calibrated one to epsilon_1.
    assert!(composed(&theorem) < 0.7 * eps1, "{}", composed(&theorem));
    let e = composed(&tight);
    assert!(e <= eps1 && e > eps1 * (1.0 - 1e-4), "{e} vs {eps1}");
    // A slightly larger epsilon' no longer fits.
    let over = ReleaseBudget {
        epsilon_prime: tight.epsilon_prime * (1.0 + 1e-4),
        ..tight
    };
    assert!(composed(&over) > eps1);
    let (pt, pc) = (
        theorem.parameters(P_MIN, L).expect("parameters"),
        tight.parameters(P_MIN, L).expect("parameters"),
    );
    assert!(pc.theta_hat_offset < pt.theta_hat_offset);
    assert_eq!(pc.delta_prime, pt.delta_prime);
    // The same parameters as Algorithm 2's formulas evaluated at the calibrated epsilon'.
    assert_eq!(
        ReleaseParameters::with_epsilon_prime(tight.epsilon_prime, delta1, P_MIN, T, L).ok(),
        Some(pc)
    );
}
