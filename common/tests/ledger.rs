//! The privacy ledger: durability, crash recovery, budget refusal and per-unit accounting.

use fedrl_common::privacy::DpEvent;
use fedrl_common::privacy::accountant::{self, AccountantKind};
use fedrl_common::privacy::gaussian;
use fedrl_common::privacy::ledger::{
    LedgerConfig, LedgerError, Participation, PrivacyLedger, RoundRecord, UnitKind,
};
use fedrl_common::privacy::noise::NoiseSource;

fn config(participation: Participation, target: f64) -> LedgerConfig {
    LedgerConfig {
        target_epsilon: target,
        delta: 1e-5,
        unit_kind: UnitKind::User,
        participation,
    }
}

fn record(round: u64, units: Vec<u64>, z: f64, q: Option<f64>) -> RoundRecord {
    RoundRecord {
        round,
        units,
        noise_multiplier: z,
        clip_norm: 1.0,
        sampling_rate: q,
        expected_cohort: 10.0,
        noise_source: NoiseSource::Seeded { seed: 3 },
        unix_time_s: 1.0e9,
    }
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-300)
}

#[test]
fn fresh_units_each_spend_one_gaussian_and_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let cfg = config(Participation::Fresh, 2.0);
    {
        let (mut l, rec) = PrivacyLedger::open(&path, cfg.clone()).unwrap();
        assert_eq!(rec.records, 0);
        l.append(record(0, vec![1, 2, 3], 5.0, None)).unwrap();
        l.append(record(1, vec![4, 5], 4.0, None)).unwrap();
    }
    let (l, rec) = PrivacyLedger::open(&path, cfg).unwrap();
    assert_eq!(rec.records, 2);
    assert_eq!(rec.torn_at, None);
    let report = l.report().unwrap();
    assert_eq!(report.rounds, 2);
    assert_eq!(report.units, 5);
    let e5 = gaussian::epsilon(5.0, 1e-5).unwrap();
    let e4 = gaussian::epsilon(4.0, 1e-5).unwrap();
    assert!(
        rel(report.epsilon, e4) < 1e-12,
        "worst unit is one of round 1"
    );
    assert!(rel(l.unit_epsilon(1).unwrap(), e5) < 1e-12);
    assert!(rel(l.unit_epsilon(5).unwrap(), e4) < 1e-12);
    assert_eq!(l.unit_epsilon(99).unwrap(), 0.0);
    assert_eq!(report.accountant, "analytic_gaussian");
    assert!(report.epsilon_rdp >= report.epsilon);
    // Reopened: nothing appended yet, so epsilon() accounts the records itself.
    assert_eq!(l.epsilon().unwrap(), report.epsilon);
    assert_eq!(report.noise_sources, vec![NoiseSource::Seeded { seed: 3 }]);
}

#[test]
fn repeated_unsampled_participation_composes_gaussians_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    // Participation chosen outside the aggregator: no amplification is claimed.
    let (mut l, _) =
        PrivacyLedger::open(&path, config(Participation::Sampled { rate: 0.5 }, 50.0)).unwrap();
    for r in 0..4 {
        l.append(record(r, vec![7], 3.0, None)).unwrap();
    }
    l.append(record(4, vec![8], 3.0, None)).unwrap();
    // Four Gaussians with z = 3 are one Gaussian with z = 3 / sqrt(4).
    let expected = gaussian::epsilon(1.5, 1e-5).unwrap();
    assert!(rel(l.unit_epsilon(7).unwrap(), expected) < 1e-12);
    assert_eq!(l.participations(7), 4);
    let report = l.report().unwrap();
    assert!(rel(report.epsilon, expected) < 1e-12);
    assert_eq!(report.per_unit.len(), 2);
}

#[test]
fn sampled_rounds_are_accounted_with_pld_for_every_unit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let (mut l, _) =
        PrivacyLedger::open(&path, config(Participation::Sampled { rate: 0.01 }, 50.0)).unwrap();
    for r in 0..100 {
        l.append(record(r, vec![r % 7], 1.1, Some(0.01))).unwrap();
    }
    let report = l.report().unwrap();
    let event = DpEvent::SelfComposed {
        event: Box::new(DpEvent::PoissonSampled {
            sampling_rate: 0.01,
            event: Box::new(DpEvent::Gaussian {
                noise_multiplier: 1.1,
            }),
        }),
        count: 100,
    };
    let pld = accountant::epsilon(&event, 1e-5, AccountantKind::Pld).unwrap();
    assert!(rel(report.epsilon, pld) < 1e-9);
    assert_eq!(report.accountant, "pld");
    // The figure accounted by the last append is the report's.
    assert_eq!(l.epsilon().unwrap(), report.epsilon);
    // A unit never drawn is still accounted: the sample is what amplification relies on.
    assert!(rel(l.unit_epsilon(12345).unwrap(), pld) < 1e-9);
    assert!(report.epsilon_rdp >= report.epsilon * 0.99);
}

#[test]
fn rounds_sampled_at_rate_one_are_accounted_as_plain_gaussians() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let (mut l, _) =
        PrivacyLedger::open(&path, config(Participation::Sampled { rate: 1.0 }, 1e6)).unwrap();
    for r in 0..400 {
        l.append(record(r, vec![r % 3], 2.0, Some(1.0))).unwrap();
    }
    let report = l.report().unwrap();
    // Every unit is in every round: 400 Gaussians with z = 2 are one with z = 2 / 20.
    let exact = gaussian::epsilon(0.1, 1e-5).unwrap();
    assert!(rel(report.epsilon, exact) < 1e-12, "{}", report.epsilon);
    assert_eq!(report.accountant, "analytic_gaussian");
    // The PLD of the same sampled event agrees, from above (its discretisation is pessimistic).
    let event = DpEvent::SelfComposed {
        event: Box::new(DpEvent::PoissonSampled {
            sampling_rate: 1.0,
            event: Box::new(DpEvent::Gaussian {
                noise_multiplier: 2.0,
            }),
        }),
        count: 40,
    };
    let pld = accountant::epsilon(&event, 1e-5, AccountantKind::Pld).unwrap();
    let exact40 = gaussian::epsilon(2.0 / 40f64.sqrt(), 1e-5).unwrap();
    assert!(
        pld >= exact40 && rel(pld, exact40) < 1e-3,
        "{pld} vs {exact40}"
    );
}

#[test]
fn units_with_their_own_unsampled_rounds_are_accounted_apart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let (mut l, _) =
        PrivacyLedger::open(&path, config(Participation::Sampled { rate: 0.5 }, 1e3)).unwrap();
    for r in 0..3 {
        l.append(record(r, vec![1, 2, 3], 2.0, Some(0.5))).unwrap();
    }
    l.append(record(3, vec![1], 4.0, None)).unwrap();
    l.append(record(4, vec![2], 4.0, None)).unwrap();
    l.append(record(5, vec![2], 3.0, None)).unwrap();
    let sampled = DpEvent::SelfComposed {
        event: Box::new(DpEvent::PoissonSampled {
            sampling_rate: 0.5,
            event: Box::new(DpEvent::Gaussian {
                noise_multiplier: 2.0,
            }),
        }),
        count: 3,
    };
    let pld = |extra: Vec<f64>| {
        let mut events = vec![sampled.clone()];
        events.extend(extra.into_iter().map(|z| DpEvent::Gaussian {
            noise_multiplier: z,
        }));
        accountant::epsilon(&DpEvent::Composed { events }, 1e-5, AccountantKind::Pld).unwrap()
    };
    let report = l.report().unwrap();
    let eps = |u: u64| {
        report
            .per_unit
            .iter()
            .find(|p| p.unit == u)
            .unwrap()
            .epsilon
    };
    assert!(rel(eps(1), pld(vec![4.0])) < 1e-9);
    assert!(rel(eps(2), pld(vec![4.0, 3.0])) < 1e-9);
    assert!(rel(eps(3), pld(vec![])) < 1e-9);
    assert!(rel(report.epsilon, eps(2)) < 1e-12);
    assert!(rel(l.unit_epsilon(2).unwrap(), eps(2)) < 1e-9);
    assert!(eps(3) < eps(1) && eps(1) < eps(2));
    // The last append accounted unit 2's newest round as a candidate; the report reads it from
    // the index: both must agree.
    assert_eq!(l.epsilon().unwrap(), report.epsilon);
    let rounds = |u: u64| {
        report
            .per_unit
            .iter()
            .find(|p| p.unit == u)
            .unwrap()
            .participations
    };
    assert_eq!((rounds(1), rounds(2), rounds(3)), (4, 5, 3));
    assert_eq!(l.participations(2), 5);
}

#[test]
fn budget_is_enforced_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let target = gaussian::epsilon(2.0, 1e-5).unwrap() * 1.0001;
    let (mut l, _) =
        PrivacyLedger::open(&path, config(Participation::Sampled { rate: 0.5 }, target)).unwrap();
    l.append(record(0, vec![1], 2.0, None)).unwrap();
    let size = std::fs::metadata(&path).unwrap().len();
    let err = l.append(record(1, vec![1], 2.0, None)).unwrap_err();
    assert!(
        matches!(err, LedgerError::BudgetExceeded { round: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("budget exceeded"));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), size);
    // Another unit still fits.
    l.append(record(1, vec![2], 2.0, None)).unwrap();
}

#[test]
fn fresh_rule_duplicates_and_order_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let (mut l, _) = PrivacyLedger::open(&path, config(Participation::Fresh, 10.0)).unwrap();
    l.append(record(0, vec![1, 2], 2.0, None)).unwrap();
    assert!(matches!(
        l.append(record(1, vec![3, 2], 2.0, None)),
        Err(LedgerError::UnitReused { unit: 2, .. })
    ));
    assert!(matches!(
        l.append(record(1, vec![4, 4], 2.0, None)),
        Err(LedgerError::DuplicateUnit { unit: 4, .. })
    ));
    assert!(matches!(
        l.append(record(0, vec![5], 2.0, None)),
        Err(LedgerError::RoundOrder { .. })
    ));
    assert!(l.append(record(1, vec![5], f64::NAN, None)).is_err());
    assert!(l.append(record(1, vec![5], 2.0, Some(1.5))).is_err());
    assert_eq!(l.records().len(), 1);
}

#[test]
fn a_torn_last_record_is_recovered_at_every_byte_offset() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let cfg = config(Participation::Fresh, 10.0);
    let before_last;
    {
        let (mut l, _) = PrivacyLedger::open(&path, cfg.clone()).unwrap();
        l.append(record(0, vec![1], 3.0, None)).unwrap();
        l.append(record(1, vec![2], 3.0, None)).unwrap();
        before_last = std::fs::metadata(&path).unwrap().len();
        l.append(record(2, vec![3, 4, 5], 3.0, None)).unwrap();
    }
    let full = std::fs::read(&path).unwrap();
    for cut in before_last..full.len() as u64 {
        let p = dir.path().join(format!("cut{cut}"));
        std::fs::write(&p, &full[..cut as usize]).unwrap();
        let (l, rec) = PrivacyLedger::open(&p, cfg.clone()).unwrap();
        assert_eq!(rec.records, 2, "cut at {cut}");
        assert_eq!(l.records().len(), 2);
        if cut == before_last {
            assert_eq!(rec.torn_at, None);
        } else {
            assert_eq!(rec.torn_at, Some(before_last), "cut at {cut}");
            assert_eq!(rec.torn_bytes, cut - before_last);
            assert!(rec.to_string().contains("torn"));
        }
        // The torn bytes are gone, and the ledger keeps working.
        drop(l);
        let (mut l, _) = PrivacyLedger::open(&p, cfg.clone()).unwrap();
        l.append(record(2, vec![3], 3.0, None)).unwrap();
        drop(l);
        let (_, records, rec) = PrivacyLedger::read(&p).unwrap();
        assert_eq!(records.len(), 3);
        assert_eq!(rec.torn_at, None);
        std::fs::remove_file(&p).unwrap();
    }
    // A flipped byte in the last record's payload is a torn write too (never released).
    let mut flipped = full.clone();
    let last = flipped.len() - 3;
    flipped[last] ^= 0x55;
    let p = dir.path().join("flipped");
    std::fs::write(&p, &flipped).unwrap();
    let (l, rec) = PrivacyLedger::open(&p, cfg.clone()).unwrap();
    assert_eq!((l.records().len(), rec.torn_at), (2, Some(before_last)));
}

#[test]
fn a_torn_header_starts_a_fresh_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let cfg = config(Participation::Fresh, 10.0);
    drop(PrivacyLedger::open(&path, cfg.clone()).unwrap());
    let full = std::fs::read(&path).unwrap();
    for cut in 1..full.len() {
        std::fs::write(&path, &full[..cut]).unwrap();
        let (mut l, rec) = PrivacyLedger::open(&path, cfg.clone()).unwrap();
        assert_eq!(rec.torn_at, Some(0));
        l.append(record(0, vec![1], 3.0, None)).unwrap();
        drop(l);
        assert_eq!(PrivacyLedger::read(&path).unwrap().1.len(), 1);
    }
}

#[test]
fn corruption_before_the_last_record_is_an_error_not_a_silent_loss() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let cfg = config(Participation::Fresh, 10.0);
    let first_end;
    {
        let (mut l, _) = PrivacyLedger::open(&path, cfg.clone()).unwrap();
        l.append(record(0, vec![1], 3.0, None)).unwrap();
        first_end = std::fs::metadata(&path).unwrap().len() as usize;
        l.append(record(1, vec![2], 3.0, None)).unwrap();
    }
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[first_end - 2] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let err = PrivacyLedger::open(&path, cfg).err().expect("must fail");
    assert!(matches!(err, LedgerError::Corrupt { .. }), "{err}");
}

#[test]
fn a_different_configuration_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    drop(PrivacyLedger::open(&path, config(Participation::Fresh, 1.0)).unwrap());
    let mut other = config(Participation::Fresh, 1.0);
    other.delta = 1e-6;
    assert!(matches!(
        PrivacyLedger::open(&path, other),
        Err(LedgerError::ConfigMismatch { .. })
    ));
    // Raising the budget is allowed.
    assert!(PrivacyLedger::open(&path, config(Participation::Fresh, 3.0)).is_ok());
}

mod index_invariants {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// Whatever mix of sampled and un-sampled rounds, the three ways to the same figure
        /// agree exactly: the epsilon the last append accounted (its record as a candidate),
        /// the report (from the per-unit index), and one unit at a time.
        #[test]
        fn append_report_and_unit_epsilon_agree(
            rounds in prop::collection::vec(
                (any::<bool>(), 0usize..3, prop::collection::btree_set(0u64..6, 1..4)),
                1..7,
            )
        ) {
            let dir = tempfile::tempdir().unwrap();
            let (mut l, _) = PrivacyLedger::open(
                dir.path().join("ledger"),
                config(Participation::Sampled { rate: 0.5 }, 1e6),
            )
            .unwrap();
            for (r, (sampled, z, units)) in rounds.iter().enumerate() {
                let z = [2.0, 3.0, 4.0][*z];
                let q = sampled.then_some(0.5);
                l.append(record(r as u64, units.iter().copied().collect(), z, q)).unwrap();
            }
            let report = l.report().unwrap();
            prop_assert_eq!(l.epsilon().unwrap(), report.epsilon);
            for p in &report.per_unit {
                prop_assert_eq!(l.unit_epsilon(p.unit).unwrap(), p.epsilon);
                let took_part = rounds.iter().filter(|(_, _, u)| u.contains(&p.unit)).count();
                prop_assert_eq!(p.participations, took_part as u64);
                prop_assert_eq!(l.participations(p.unit), took_part as u64);
                prop_assert!(p.epsilon <= report.epsilon);
            }
        }
    }
}
