//! The accountants against Google's dp_accounting 0.6.0 (every case of
//! `testdata/dp_accounting_vectors.json`) and against published values.

use fedrl_common::privacy::DpEvent;
use fedrl_common::privacy::accountant::{self, AccountantKind, sampled_gaussian_rounds};
use fedrl_common::privacy::gaussian;
use fedrl_common::privacy::pld::{DEFAULT_DISCRETIZATION, PrivacyLossDistribution};
use fedrl_common::privacy::rdp::RdpAccountant;
use fedrl_common::privacy::{expert_release, laplace};
use serde_json::Value;

fn vectors() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/dp_accounting_vectors.json"
    );
    let text = std::fs::read_to_string(path).expect("reference vectors present");
    serde_json::from_str(&text).expect("valid JSON")
}

/// The cases of one section of the reference vectors, checked to be all there: an emptied or
/// truncated fixture would otherwise pass every loop over it without checking anything. The
/// counts are those of `testdata/dp_accounting_vectors.json` as generated (update them with it).
fn cases(section: &str) -> Vec<Value> {
    let expected = match section {
        "subsampled_gaussian" => 20,
        "gaussian_mechanism" => 17,
        other => panic!("no section {other} in the reference vectors"),
    };
    let cases = vectors()[section]
        .as_array()
        .unwrap_or_else(|| panic!("section {section} missing from the reference vectors"))
        .clone();
    assert_eq!(
        cases.len(),
        expected,
        "{section}: {} cases in the reference vectors, expected {expected}",
        cases.len()
    );
    cases
}

fn rel(a: f64, b: f64) -> f64 {
    ((a - b) / b).abs()
}

fn field(v: &Value, name: &str) -> f64 {
    v[name]
        .as_f64()
        .unwrap_or_else(|| panic!("field {name} in {v}"))
}

/// Every subsampled-Gaussian case, RDP within relative 1e-6.
#[test]
fn rdp_matches_dp_accounting_on_every_vector() {
    let mut worst = 0.0_f64;
    for case in &cases("subsampled_gaussian") {
        let (z, q, t, d) = (
            field(case, "noise_multiplier"),
            field(case, "sampling_rate"),
            field(case, "steps") as u64,
            field(case, "delta"),
        );
        let eps = accountant::epsilon(&sampled_gaussian_rounds(z, q, t), d, AccountantKind::Rdp)
            .expect("rdp epsilon");
        let err = rel(eps, field(case, "epsilon_rdp"));
        worst = worst.max(err);
        assert!(
            err < 1e-6,
            "z={z} q={q} T={t} delta={d}: {eps} vs {}",
            case["epsilon_rdp"]
        );
    }
    eprintln!("RDP worst relative error: {worst:e}");
}

/// Every subsampled-Gaussian case, PLD within relative 1e-3 (the issue asks for 1e-2).
#[test]
fn pld_matches_dp_accounting_on_every_vector() {
    let mut worst = 0.0_f64;
    for case in &cases("subsampled_gaussian") {
        let (z, q, t, d) = (
            field(case, "noise_multiplier"),
            field(case, "sampling_rate"),
            field(case, "steps") as u64,
            field(case, "delta"),
        );
        let eps = accountant::epsilon(&sampled_gaussian_rounds(z, q, t), d, AccountantKind::Pld)
            .expect("pld epsilon");
        let err = rel(eps, field(case, "epsilon_pld"));
        eprintln!(
            "z={z} q={q} T={t} delta={d}: {eps} vs {} ({err:e})",
            case["epsilon_pld"]
        );
        worst = worst.max(err);
        assert!(
            err < 1e-3,
            "z={z} q={q} T={t} delta={d}: {eps} vs {}",
            case["epsilon_pld"]
        );
    }
    eprintln!("PLD worst relative error: {worst:e}");
}

/// Every single-Gaussian case, analytic Gaussian within relative 1e-6.
#[test]
fn analytic_gaussian_matches_every_vector() {
    let mut worst = 0.0_f64;
    for case in &cases("gaussian_mechanism") {
        let (s, d) = (field(case, "sigma"), field(case, "delta"));
        let eps = gaussian::epsilon(s, d).expect("epsilon");
        let err = rel(eps, field(case, "epsilon"));
        worst = worst.max(err);
        assert!(
            err < 1e-6,
            "sigma={s} delta={d}: {eps} vs {}",
            case["epsilon"]
        );
        // And back: sigma for that epsilon is the sigma we started from.
        let back = gaussian::sigma(eps, d).expect("sigma");
        assert!(rel(back, s) < 1e-6, "sigma={s}: back {back}");
    }
    eprintln!("analytic Gaussian worst relative error: {worst:e}");
}

fn sampled(q: f64, z: f64) -> DpEvent {
    DpEvent::PoissonSampled {
        sampling_rate: q,
        event: Box::new(DpEvent::Gaussian {
            noise_multiplier: z,
        }),
    }
}

fn times(event: DpEvent, count: u64) -> DpEvent {
    DpEvent::SelfComposed {
        event: Box::new(event),
        count,
    }
}

/// dp_accounting's own RDP test: q = 0.01, sigma = 2.5, 50 steps (rtol 1e-4).
#[test]
fn published_rdp_values_of_dp_accounting() {
    let orders = vec![1.5, 2.5, 5.0, 50.0, 100.0];
    let expected = [
        6.70579741e-4,
        1.08548710e-3,
        2.18075656e-3,
        2.38460375e-2,
        167.416308,
    ];
    let mut acc = RdpAccountant::new(orders);
    acc.compose(&sampled(0.01, 2.5), 50).expect("compose");
    for (got, want) in acc.rdp().iter().zip(expected) {
        assert!(rel(*got, want) < 1e-4, "{got} vs {want}");
    }
}

/// "sigma = 4.530877117, q = 1, one step gives exactly (1, 1e-6)-DP" (testdata/README.md). That
/// is the figure of the RDP accountant (dp_accounting gives 1.0000003); the exact analytic
/// Gaussian is tighter: (0.927, 1e-6), and (1, 1e-6) already holds at sigma = 4.2246789.
#[test]
fn published_gaussian_value() {
    let sigma = 4.530877117;
    let event = DpEvent::Gaussian {
        noise_multiplier: sigma,
    };
    let rdp = accountant::epsilon(&event, 1e-6, AccountantKind::Rdp).expect("rdp");
    assert!(rel(rdp, 1.0) < 1e-6, "{rdp}");
    let exact = gaussian::epsilon(sigma, 1e-6).expect("epsilon");
    assert!(rel(exact, 0.9273923379974407) < 1e-9, "{exact}");
    assert!(
        rel(
            gaussian::sigma(1.0, 1e-6).expect("sigma"),
            4.224678889326836
        ) < 1e-9
    );
    assert!(
        rel(
            gaussian::delta(4.224678889326836, 1.0).expect("delta"),
            1e-6
        ) < 1e-8
    );
    // PLD of the same single Gaussian: a pessimistic upper bound within the grid of the exact.
    let pld = accountant::epsilon(&event, 1e-6, AccountantKind::Pld).expect("pld");
    assert!(
        pld >= exact - 1e-12 && pld < exact + 1e-3,
        "{pld} vs {exact}"
    );
}

/// dp_accounting's PLD tests: Gaussian sigma = sqrt(3) composed 3 times has delta(1) = 0.126936;
/// Poisson q = 0.2, sigma = 0.5, 3 compositions has delta(1) = 0.15594 (tolerance 1e-3).
#[test]
fn published_pld_values_of_dp_accounting() {
    let g = times(
        DpEvent::Gaussian {
            noise_multiplier: 3f64.sqrt(),
        },
        3,
    );
    let d = accountant::delta(&g, 1.0, AccountantKind::Pld).expect("delta");
    assert!(rel(d, 0.126936) < 1e-4, "{d}");
    // Composing three Gaussians is exactly one with sigma = 1 (analytic Gaussian).
    let exact = gaussian::delta(1.0, 1.0).expect("exact");
    assert!(d >= exact - 1e-12 && rel(d, exact) < 1e-4, "{d} vs {exact}");
    let p = times(sampled(0.2, 0.5), 3);
    let d = accountant::delta(&p, 1.0, AccountantKind::Pld).expect("delta");
    assert!((d - 0.15594).abs() < 1e-3, "{d}");
}

/// Opacus: sigma = 1.5, q = 0.04, 2250 steps, delta = 1e-5: RDP epsilon 7.32911117143. Opacus
/// evaluates the fractional orders slightly differently; dp_accounting (and we) get 7.3293347,
/// 3e-5 away.
#[test]
fn published_opacus_value() {
    let e = accountant::epsilon(
        &sampled_gaussian_rounds(1.5, 0.04, 2250),
        1e-5,
        AccountantKind::Rdp,
    )
    .expect("rdp");
    assert!(rel(e, 7.32911117143) < 1e-4, "{e}");
    assert!(rel(e, 7.329334702381698) < 1e-9, "{e}");
}

/// TF Privacy: n = 60000, batch 150, sigma = 1.3, 15 epochs, delta = 1e-5: RDP epsilon
/// 0.7242234026109595 at order 19 with TF Privacy's orders (1.1..10.9, 12..63).
#[test]
fn published_tf_privacy_value() {
    let mut orders: Vec<f64> = (1..100).map(|x| 1.0 + f64::from(x) / 10.0).collect();
    orders.extend((12..64).map(f64::from));
    let mut acc = RdpAccountant::new(orders.clone());
    acc.compose(&sampled(150.0 / 60000.0, 1.3), 15 * 60000 / 150)
        .expect("compose");
    let (eps, order) =
        fedrl_common::privacy::rdp::epsilon_from_rdp(&orders, acc.rdp(), 1e-5).expect("epsilon");
    assert!(rel(eps, 0.7242234026109595) < 1e-9, "{eps}");
    assert_eq!(order, 19.0);
}

/// Heterogeneous rounds compose: the PLD of a Composed event equals composing the parts, and
/// grouping identical rounds changes nothing.
#[test]
fn heterogeneous_rounds_compose() {
    let a = sampled(0.01, 1.0);
    let b = sampled(0.02, 1.5);
    let mixed = DpEvent::Composed {
        events: vec![times(a.clone(), 300), times(b.clone(), 200)],
    };
    let interleaved = DpEvent::Composed {
        events: (0..500)
            .map(|i| if i % 5 < 3 { a.clone() } else { b.clone() })
            .collect(),
    };
    let e1 = accountant::epsilon(&mixed, 1e-5, AccountantKind::Pld).expect("pld");
    let e2 = accountant::epsilon(&interleaved, 1e-5, AccountantKind::Pld).expect("pld");
    assert_eq!(e1, e2);
    let parts = PrivacyLossDistribution::gaussian(1.0, 0.01, DEFAULT_DISCRETIZATION)
        .and_then(|p| p.self_compose(300))
        .and_then(|p| {
            PrivacyLossDistribution::gaussian(1.5, 0.02, DEFAULT_DISCRETIZATION)
                .and_then(|q| q.self_compose(200))
                .and_then(|q| p.compose(&q))
        })
        .expect("pld");
    assert!(rel(parts.epsilon_for_delta(1e-5), e1) < 1e-9);
    // Each part alone is cheaper; RDP is looser but close.
    let ea = accountant::epsilon(&times(a, 300), 1e-5, AccountantKind::Pld).expect("pld");
    assert!(ea < e1);
    let r = accountant::epsilon(&mixed, 1e-5, AccountantKind::Rdp).expect("rdp");
    assert!(r >= e1 && r < 1.3 * e1, "{r} vs {e1}");
}

/// Laplace: PLD reproduces the exact delta curve of the Laplace mechanism; RDP handles it too;
/// pure-DP events (SVT) compose.
#[test]
fn laplace_and_pure_dp_events() {
    let lap = DpEvent::Laplace { scale: 2.0 };
    for eps in [0.0, 0.1, 0.3, 0.49] {
        let d = accountant::delta(&lap, eps, AccountantKind::Pld).expect("pld");
        let exact = laplace::delta(2.0, 1.0, eps).expect("exact");
        assert!(
            d >= exact - 1e-12 && (d - exact).abs() < 1e-4,
            "{eps}: {d} vs {exact}"
        );
    }
    let e = accountant::epsilon(&lap, 1e-9, AccountantKind::Pld).expect("pld");
    assert!((e - 0.5).abs() < 1e-3, "{e}");
    let r = accountant::epsilon(&times(lap, 10), 1e-5, AccountantKind::Rdp).expect("rdp");
    assert!(r < 5.0, "{r}");
    let svt = times(
        DpEvent::EpsilonDelta {
            epsilon: 0.1,
            delta: 0.0,
        },
        20,
    );
    let p = accountant::epsilon(&svt, 1e-6, AccountantKind::Pld).expect("pld");
    let r = accountant::epsilon(&svt, 1e-6, AccountantKind::Rdp).expect("rdp");
    // Basic composition gives 2.0; PLD is well below, RDP about there.
    assert!(p < 2.0 && p <= r && r < 2.1, "{p} {r}");
    assert!(
        accountant::epsilon(
            &DpEvent::EpsilonDelta {
                epsilon: 1.0,
                delta: 1e-7
            },
            1e-6,
            AccountantKind::Rdp
        )
        .is_err()
    );
}

/// Zero noise is not private; zero steps or zero sampling cost nothing.
#[test]
fn degenerate_events() {
    let free = accountant::epsilon(
        &sampled_gaussian_rounds(0.0, 0.1, 10),
        1e-5,
        AccountantKind::Pld,
    );
    assert_eq!(free.ok(), Some(f64::INFINITY));
    let free = accountant::epsilon(
        &sampled_gaussian_rounds(0.0, 0.1, 10),
        1e-5,
        AccountantKind::Rdp,
    );
    assert_eq!(free.ok(), Some(f64::INFINITY));
    for kind in [AccountantKind::Pld, AccountantKind::Rdp] {
        assert_eq!(
            accountant::epsilon(&sampled_gaussian_rounds(1.0, 0.1, 0), 1e-5, kind).ok(),
            Some(0.0)
        );
        assert_eq!(
            accountant::epsilon(&sampled_gaussian_rounds(1.0, 0.0, 9), 1e-5, kind).ok(),
            Some(0.0)
        );
        assert!(accountant::epsilon(&sampled_gaussian_rounds(-1.0, 0.1, 9), 1e-5, kind).is_err());
        assert!(accountant::epsilon(&sampled_gaussian_rounds(1.0, 1.5, 9), 1e-5, kind).is_err());
        assert!(
            accountant::epsilon(&sampled_gaussian_rounds(1.0, 0.1, 9), f64::NAN, kind).is_err()
        );
    }
}

/// The noise search returns a feasible, nearly minimal multiplier, and fails cleanly when no
/// noise can help.
#[test]
fn noise_multiplier_meets_the_target() {
    for kind in [AccountantKind::Pld, AccountantKind::Rdp] {
        let z = accountant::noise_multiplier(2.0, 1e-5, 0.01, 1000, kind).expect("z");
        let e =
            accountant::epsilon(&sampled_gaussian_rounds(z, 0.01, 1000), 1e-5, kind).expect("eps");
        assert!(e <= 2.0 && e > 1.99, "{kind}: z={z} eps={e}");
        let below = accountant::epsilon(
            &sampled_gaussian_rounds(z * (1.0 - 1e-4), 0.01, 1000),
            1e-5,
            kind,
        )
        .expect("eps");
        assert!(below > 2.0, "{kind}: not minimal");
    }
    assert!(accountant::noise_multiplier(0.0, 1e-5, 0.01, 10, AccountantKind::Rdp).is_err());
}

/// Expert-level release (seed 002): the PLD composition of the T passes is tighter than the
/// advanced composition of Theorem 5.5.
#[test]
fn expert_release_accounting() {
    let event = expert_release::release_event(1.0, 1e-5, 50).expect("event");
    let (adv, delta) = expert_release::release_guarantee(1.0, 1e-5, 50).expect("adv");
    let pld = accountant::epsilon(&event, delta, AccountantKind::Pld).expect("pld");
    assert!(pld <= adv && adv <= 1.0, "{pld} {adv}");
}
