//! The privacy ledger: durability, crash recovery, budget refusal and raises, per-unit and
//! per-phase accounting, and ledgers written by the first release.

use fedrl_common::privacy::accountant::{self, AccountantKind, Method};
use fedrl_common::privacy::gaussian;
use fedrl_common::privacy::ledger::{
    Entry, FORMAT_VERSION, LedgerConfig, LedgerError, OpenPolicy, Participation, PrivacyLedger,
    RoundRecord, UnitKind,
};
use fedrl_common::privacy::noise::NoiseSource;
use fedrl_common::privacy::{Delta, DpEvent};

fn delta() -> Delta {
    Delta::try_from(1e-5).unwrap()
}

fn sampled(rate: f64) -> Participation {
    Participation::sampled(rate).unwrap()
}

fn config(participation: Participation, target: f64) -> LedgerConfig {
    LedgerConfig {
        target_epsilon: target,
        delta: delta(),
        unit_kind: UnitKind::User,
        participation,
    }
}

fn record(round: u64, units: Vec<u64>, z: f64, q: Option<f64>) -> RoundRecord {
    let mut r = RoundRecord::gaussian_round(
        round,
        units,
        z,
        1.0,
        q,
        10.0,
        NoiseSource::Seeded { seed: 3 },
    );
    r.unix_time_s = 1.0e9;
    r
}

/// A record of another phase with any event.
fn event_record(
    round: u64,
    phase: &str,
    units: Vec<u64>,
    event: DpEvent,
    by_agg: bool,
) -> RoundRecord {
    RoundRecord {
        round,
        phase: phase.into(),
        event,
        sampled_by_aggregator: by_agg,
        units,
        clip_norm: None,
        expected_cohort: None,
        noise_source: NoiseSource::Os,
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
    let (mut l, _) = PrivacyLedger::open(&path, config(sampled(0.5), 50.0)).unwrap();
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
    let (mut l, _) = PrivacyLedger::open(&path, config(sampled(0.01), 50.0)).unwrap();
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
    let (mut l, _) = PrivacyLedger::open(&path, config(sampled(1.0), 1e6)).unwrap();
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
    let (mut l, _) = PrivacyLedger::open(&path, config(sampled(0.5), 1e3)).unwrap();
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
    let (mut l, _) = PrivacyLedger::open(&path, config(sampled(0.5), target)).unwrap();
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
}

/// Finding 3: a complete last record whose checksum fails was written in full, so its append may
/// have returned and its round been released: corruption, never a torn write.
#[test]
fn a_flipped_bit_in_the_last_complete_record_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let cfg = config(Participation::Fresh, 10.0);
    let before_last;
    {
        let (mut l, _) = PrivacyLedger::open(&path, cfg.clone()).unwrap();
        l.append(record(0, vec![1], 3.0, None)).unwrap();
        before_last = std::fs::metadata(&path).unwrap().len();
        l.append(record(1, vec![2, 3], 3.0, None)).unwrap();
    }
    let full = std::fs::read(&path).unwrap();
    // One bit in the payload, one in the stored checksum: both are complete frames.
    for at in [full.len() - 3, before_last as usize + 9] {
        let mut flipped = full.clone();
        flipped[at] ^= 0x04;
        std::fs::write(&path, &flipped).unwrap();
        let err = PrivacyLedger::open(&path, cfg.clone())
            .err()
            .expect("must fail");
        assert!(
            matches!(err, LedgerError::Corrupt { offset, .. } if offset == before_last),
            "{err}"
        );
        assert!(err.to_string().contains("checksum"), "{err}");
        assert!(PrivacyLedger::read(&path).is_err());
        // Nothing was truncated.
        assert_eq!(std::fs::read(&path).unwrap(), flipped);
    }
}

/// Issue 15: a power loss can leave the ledger longer than its data, the tail filled with
/// zeros (the last append's fsync never returned, so nothing was released). That is a torn
/// write, said in those words; zeros followed by data, or a wholly zeroed file, stay corruption.
#[test]
fn a_zero_filled_tail_is_a_torn_write_not_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let cfg = config(Participation::Fresh, 10.0);
    {
        let (mut l, _) = PrivacyLedger::open(&path, cfg.clone()).unwrap();
        l.append(record(0, vec![1], 3.0, None)).unwrap();
        l.append(record(1, vec![2], 3.0, None)).unwrap();
    }
    let full = std::fs::read(&path).unwrap();
    for zeros in [1usize, 3, 16, 17, 4096, 10_000] {
        let mut padded = full.clone();
        padded.resize(full.len() + zeros, 0);
        std::fs::write(&path, &padded).unwrap();
        let (_, records, rec) = PrivacyLedger::read(&path).unwrap();
        assert_eq!(records.len(), 2, "{zeros} zeros");
        assert_eq!(rec.torn_at, Some(full.len() as u64));
        assert_eq!(rec.torn_bytes, zeros as u64);
        assert!(rec.zero_filled);
        let text = rec.to_string();
        assert!(
            text.contains("zero-filled") && text.contains("power loss"),
            "{text}"
        );
        let (mut l, _) = PrivacyLedger::open(&path, cfg.clone()).unwrap();
        l.append(record(2, vec![3], 3.0, None)).unwrap();
        drop(l);
        let (_, records, rec) = PrivacyLedger::read(&path).unwrap();
        assert_eq!((records.len(), rec.torn_at), (3, None));
        std::fs::write(&path, &full).unwrap();
        // Zeros that data follows were not left by a power loss.
        let mut bad = padded.clone();
        bad.extend_from_slice(b"FRL");
        std::fs::write(&path, &bad).unwrap();
        assert!(matches!(
            PrivacyLedger::read(&path),
            Err(LedgerError::Corrupt { .. })
        ));
    }
    // A whole ledger of zeros is not a power loss after the synced header: never a fresh start.
    std::fs::write(&path, vec![0u8; full.len()]).unwrap();
    assert!(matches!(
        PrivacyLedger::open(&path, cfg.clone()),
        Err(LedgerError::Corrupt { .. })
    ));
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
    other.delta = Delta::try_from(1e-6).unwrap();
    assert!(matches!(
        PrivacyLedger::open(&path, other),
        Err(LedgerError::ConfigMismatch { .. })
    ));
    // A lower or equal budget is always allowed.
    assert!(PrivacyLedger::open(&path, config(Participation::Fresh, 0.5)).is_ok());
    assert!(PrivacyLedger::open(&path, config(Participation::Fresh, 1.0)).is_ok());
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
                config(sampled(0.5), 1e6),
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

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The figures the landed release reported for a fixture (`*.report.json`).
fn landed_report(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(name)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Ledgers written by the first release (format 1: z, C, q per record) open, account exactly as
/// it reported them, and take version-2 appends.
#[test]
fn version_one_ledgers_open_account_identically_and_take_appends() {
    for (file, report) in [
        ("ledger-v1.ledger", "ledger-v1.report.json"),
        ("ledger-v1-fresh.ledger", "ledger-v1-fresh.report.json"),
    ] {
        let landed = landed_report(report);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(file);
        std::fs::copy(fixture(file), &path).unwrap();
        let read = PrivacyLedger::read_file(&path).unwrap();
        assert_eq!(read.version, 1);
        let cfg = read.config.clone();
        let (mut l, rec) = PrivacyLedger::open(&path, cfg.clone()).unwrap();
        assert_eq!(rec.torn_at, None);
        let rep = l.report().unwrap();
        let f = |v: &serde_json::Value| v.as_f64().unwrap();
        assert!(rel(rep.epsilon, f(&landed["epsilon"])) < 1e-12, "{file}");
        assert!(
            rel(rep.epsilon_rdp, f(&landed["epsilon_rdp"])) < 1e-12,
            "{file}"
        );
        assert_eq!(rep.accountant, landed["accountant"].as_str().unwrap());
        assert_eq!(rep.rounds, landed["rounds"].as_u64().unwrap());
        let per_unit = landed["per_unit"].as_array().unwrap();
        assert_eq!(rep.per_unit.len(), per_unit.len());
        for (mine, theirs) in rep.per_unit.iter().zip(per_unit) {
            assert_eq!(mine.unit, theirs["unit"].as_u64().unwrap());
            assert_eq!(
                mine.participations,
                theirs["participations"].as_u64().unwrap()
            );
            assert!(
                rel(mine.epsilon, f(&theirs["epsilon"])) < 1e-12,
                "{file} {mine:?}"
            );
        }
        // One phase: its basic composition is the figure itself.
        assert_eq!(rep.phases.len(), 1);
        assert_eq!(rep.phases[0].phase, "training");
        assert_eq!(rep.epsilon_basic, rep.epsilon);
        // The converted events: rate-1 rounds are plain Gaussians, charged to everybody.
        for r in l.records() {
            assert_eq!(r.phase, "training");
            assert_eq!(r.clip_norm, Some(1.5));
        }

        // A version-2 record appended to the version-1 file reads back with the rest.
        let last = l.last_round().unwrap();
        l.append(record(last + 1, vec![900], 6.0, None)).unwrap();
        let eps = l.epsilon().unwrap();
        drop(l);
        let again = PrivacyLedger::read_file(&path).unwrap();
        assert_eq!(again.version, 1);
        assert_eq!(again.records().len() as u64, rep.rounds + 1);
        let (l, _) = PrivacyLedger::open(&path, cfg).unwrap();
        assert_eq!(l.report().unwrap().epsilon, eps);
        assert_eq!(l.participations(900), 1);
    }
}

#[test]
fn new_ledgers_are_version_three() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let (mut l, _) = PrivacyLedger::open(&path, config(sampled(0.5), 10.0)).unwrap();
    l.append(record(1, vec![1], 3.0, Some(0.5))).unwrap();
    drop(l);
    let file = PrivacyLedger::read_file(&path).unwrap();
    assert_eq!(file.version, FORMAT_VERSION);
    assert_eq!(FORMAT_VERSION, 3);
    assert_eq!(file.recovery.unchained_entries, None);
    let Entry::Round(r) = &file.entries[0] else {
        panic!("{:?}", file.entries)
    };
    assert!(r.sampled_by_aggregator);
    assert_eq!(r.sampling_rate(), Some(0.5));
    assert_eq!(
        r.event,
        DpEvent::PoissonSampled {
            sampling_rate: 0.5,
            event: Box::new(DpEvent::Gaussian {
                noise_multiplier: 3.0
            })
        }
    );
    // A later format is refused with its number, not misread (a valid frame of version 9).
    let dir2 = tempfile::tempdir().unwrap();
    let p2 = dir2.path().join("ledger");
    let header = br#"{"version":9,"target_epsilon":1.0,"delta":1e-5,"unit_kind":"user","participation":{"kind":"fresh"}}"#;
    let digest = ring::digest::digest(&ring::digest::SHA256, header);
    let mut frame = b"FRL1".to_vec();
    frame.extend_from_slice(&(header.len() as u32).to_le_bytes());
    frame.extend_from_slice(&digest.as_ref()[..8]);
    frame.extend_from_slice(header);
    std::fs::write(&p2, &frame).unwrap();
    let err = PrivacyLedger::read_file(&p2).expect_err("must fail");
    assert!(
        matches!(err, LedgerError::UnsupportedVersion { version: 9, .. }),
        "{err}"
    );
}

/// Finding 1 (ledger half): a larger target epsilon is refused unless allowed explicitly; an
/// allowed raise is recorded and stays in force.
#[test]
fn budget_raises_are_refused_unless_allowed_and_then_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let (mut l, _) = PrivacyLedger::open(&path, config(sampled(0.5), 2.0)).unwrap();
    l.append(record(1, vec![1], 3.0, Some(0.5))).unwrap();
    drop(l);
    let size = std::fs::metadata(&path).unwrap().len();
    let err = PrivacyLedger::open(&path, config(sampled(0.5), 3.0))
        .err()
        .expect("a raise without permission");
    assert!(
        matches!(err, LedgerError::BudgetIncrease { stored, requested, .. } if stored == 2.0 && requested == 3.0),
        "{err}"
    );
    assert!(err.to_string().contains("must be explicit"), "{err}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), size);

    let allow = OpenPolicy {
        allow_budget_increase: true,
    };
    let (l, _) = PrivacyLedger::open_with(&path, config(sampled(0.5), 3.0), allow).unwrap();
    assert_eq!(l.config().target_epsilon, 3.0);
    assert_eq!(l.budget_changes().len(), 1);
    let change = l.budget_changes()[0].clone();
    assert_eq!((change.from, change.to), (2.0, 3.0));
    assert!(change.unix_time_s > 1.6e9);
    drop(l);
    // The raise is in the file, in force for later opens and reported.
    let file = PrivacyLedger::read_file(&path).unwrap();
    assert!(matches!(file.entries.last(), Some(Entry::BudgetChange(_))));
    assert_eq!(file.config.target_epsilon, 3.0);
    assert_eq!(PrivacyLedger::read(&path).unwrap().0.target_epsilon, 3.0);
    let (l, _) = PrivacyLedger::open(&path, config(sampled(0.5), 3.0)).unwrap();
    assert_eq!(l.report().unwrap().budget_changes, vec![change.clone()]);
    drop(l);
    // Lower is always allowed and records nothing; an equal reopen with permission records
    // nothing either.
    let (l, _) = PrivacyLedger::open(&path, config(sampled(0.5), 1.0)).unwrap();
    assert_eq!(l.config().target_epsilon, 1.0);
    drop(l);
    let (l, _) = PrivacyLedger::open_with(&path, config(sampled(0.5), 3.0), allow).unwrap();
    assert_eq!(l.budget_changes().len(), 1);
    drop(l);
    // Above the raised budget: refused again.
    assert!(matches!(
        PrivacyLedger::open(&path, config(sampled(0.5), 3.5)),
        Err(LedgerError::BudgetIncrease { stored, .. }) if stored == 3.0
    ));
}

fn laplace(b: f64) -> DpEvent {
    DpEvent::Laplace { scale: b }
}

fn sampled_gaussian(q: f64, z: f64) -> DpEvent {
    DpEvent::PoissonSampled {
        sampling_rate: q,
        event: Box::new(DpEvent::Gaussian {
            noise_multiplier: z,
        }),
    }
}

/// Several phases and kinds of event in one ledger: a unit's epsilon composes every event that
/// charges it (PLD), each phase is reported at delta / P, and their basic composition is
/// printed beside the tight figure and is larger.
#[test]
fn phases_compose_tightly_and_their_basic_sum_is_never_smaller() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let (mut l, _) = PrivacyLedger::open(&path, config(sampled(0.2), 100.0)).unwrap();
    for r in 0..5 {
        l.append(record(r, vec![r, r + 1], 1.5, Some(0.2))).unwrap();
    }
    // A release phase: every expert answers a Laplace count query (charges the units listed),
    // then one SVT pass known only by its guarantee.
    l.append(event_record(
        5,
        "release",
        vec![1, 2, 3],
        laplace(4.0),
        false,
    ))
    .unwrap();
    l.append(event_record(
        6,
        "release",
        vec![1, 2],
        DpEvent::EpsilonDelta {
            epsilon: 0.3,
            delta: 0.0,
        },
        false,
    ))
    .unwrap();
    // A DP-SGD phase on aggregator-drawn samples, charged to everybody.
    l.append(event_record(
        7,
        "dp-sgd",
        vec![4],
        DpEvent::SelfComposed {
            event: Box::new(sampled_gaussian(0.05, 0.9)),
            count: 50,
        },
        true,
    ))
    .unwrap();
    let rep = l.report().unwrap();
    let d = 1e-5;
    let pld = |events: Vec<DpEvent>, delta: f64| {
        accountant::epsilon(&DpEvent::Composed { events }, delta, AccountantKind::Pld).unwrap()
    };
    let training = DpEvent::SelfComposed {
        event: Box::new(sampled_gaussian(0.2, 1.5)),
        count: 5,
    };
    let dpsgd = DpEvent::SelfComposed {
        event: Box::new(sampled_gaussian(0.05, 0.9)),
        count: 50,
    };
    let svt = DpEvent::EpsilonDelta {
        epsilon: 0.3,
        delta: 0.0,
    };
    // Units 1 and 2 carry both release events: they are the worst.
    let worst = pld(
        vec![training.clone(), laplace(4.0), svt.clone(), dpsgd.clone()],
        d,
    );
    assert!(rel(rep.epsilon, worst) < 1e-9, "{} vs {worst}", rep.epsilon);
    assert_eq!(rep.accountant, "pld");
    let eps = |u: u64| rep.per_unit.iter().find(|p| p.unit == u).unwrap().epsilon;
    assert!(
        rel(
            eps(3),
            pld(vec![training.clone(), laplace(4.0), dpsgd.clone()], d)
        ) < 1e-9
    );
    assert!(rel(eps(5), pld(vec![training.clone(), dpsgd.clone()], d)) < 1e-9);
    assert!(rel(l.unit_epsilon(2).unwrap(), worst) < 1e-9);
    assert_eq!(l.epsilon().unwrap(), rep.epsilon);

    // Phases in order of first appearance, each at delta / 3.
    let names: Vec<&str> = rep.phases.iter().map(|p| p.phase.as_str()).collect();
    assert_eq!(names, ["training", "release", "dp-sgd"]);
    let split = d / 3.0;
    let p = &rep.phases;
    assert_eq!(p[0].rounds, 5);
    assert!(rel(p[0].delta, split) < 1e-15);
    assert!(rel(p[0].epsilon, pld(vec![training.clone()], split)) < 1e-9);
    assert!(rel(p[1].epsilon, pld(vec![laplace(4.0), svt.clone()], split)) < 1e-9);
    assert!(rel(p[2].epsilon, pld(vec![dpsgd.clone()], split)) < 1e-9);
    let sum: f64 = p.iter().map(|p| p.epsilon).sum();
    assert_eq!(rep.epsilon_basic, sum);
    assert!(rep.epsilon_basic > rep.epsilon, "{rep:?}");
    // RDP cannot bound an (epsilon, delta) event with delta > 0 everywhere, but this one is
    // pure: the cross-check is finite and above the tight figure.
    assert!(rep.epsilon_rdp >= rep.epsilon && rep.epsilon_rdp.is_finite());
    assert_eq!(rep.rdp_note, None);
    // Re-accounting with RDP reports RDP itself.
    let rdp = l.report_with(AccountantKind::Rdp).unwrap();
    assert_eq!(rdp.accountant, "rdp");
    assert!(rdp.epsilon >= rep.epsilon);
    assert!(rdp.epsilon_basic >= rdp.epsilon);
}

/// An (epsilon, delta) event with delta > 0: PLD accounts it, RDP cannot, and the report says so
/// instead of failing or inventing a number.
#[test]
fn rdp_cross_check_says_when_it_cannot_bound_an_event() {
    let dir = tempfile::tempdir().unwrap();
    let (mut l, _) = PrivacyLedger::open(
        dir.path().join("ledger"),
        config(Participation::Fresh, 10.0),
    )
    .unwrap();
    l.append(event_record(
        1,
        "release",
        vec![1],
        DpEvent::EpsilonDelta {
            epsilon: 0.5,
            delta: 1e-7,
        },
        false,
    ))
    .unwrap();
    let rep = l.report().unwrap();
    assert!(
        rep.epsilon > 0.5 - 1e-3 && rep.epsilon.is_finite(),
        "{}",
        rep.epsilon
    );
    assert_eq!(rep.epsilon_rdp, f64::INFINITY);
    assert!(rep.rdp_note.as_deref().unwrap_or("").contains("delta > 0"));
    assert!(l.report_with(AccountantKind::Rdp).is_err());
}

/// The discrete Gaussian is accounted as the continuous Gaussian with the same sigma /
/// sensitivity, and the ledger refuses sigma below 10 grid units and any sigma whose proven gap
/// to the continuous Gaussian exceeds 1e-12 (`tests/discrete_gaussian_gap.rs`).
#[test]
fn discrete_gaussian_counts_as_its_continuous_twin() {
    let dir = tempfile::tempdir().unwrap();
    let (mut l, _) =
        PrivacyLedger::open(dir.path().join("ledger"), config(sampled(0.5), 100.0)).unwrap();
    let dg = |sigma: f64, l2: f64| DpEvent::DiscreteGaussian {
        sigma,
        l2_sensitivity: l2,
    };
    let err = l
        .append(event_record(1, "training", vec![1], dg(9.5, 1.0), false))
        .unwrap_err();
    assert!(err.to_string().contains("at least 10"), "{err}");
    // sigma = 40, Delta = 16 was accepted before the gap bound: its gap bound is ~2e-4.
    let err = l
        .append(event_record(1, "training", vec![1], dg(40.0, 16.0), false))
        .unwrap_err();
    assert!(
        err.to_string().contains("may exceed the continuous"),
        "{err}"
    );
    let (sigma, l2) = (40.0 * 2f64.powi(20), 16.0 * 2f64.powi(20));
    l.append(event_record(1, "training", vec![1], dg(sigma, l2), false))
        .unwrap();
    l.append(record(2, vec![1], 2.5, None)).unwrap();
    // Two Gaussians with z = 2.5: exact analytic composition, z = 2.5 / sqrt 2.
    let exact = gaussian::epsilon(2.5 / 2f64.sqrt(), 1e-5).unwrap();
    let rep = l.report().unwrap();
    assert!(rel(rep.epsilon, exact) < 1e-12);
    assert_eq!(rep.accountant, "analytic_gaussian");
    // Beside it, the exact zCDP rho: 2 x 1 / (2 * 2.5^2).
    assert!((rep.zcdp_rho.unwrap() - 0.16).abs() < 1e-15);
    // Sampled, PLD and RDP treat it as Gaussian(z = 2.5) too.
    let sampled_dg = DpEvent::PoissonSampled {
        sampling_rate: 0.3,
        event: Box::new(dg(sigma, l2)),
    };
    for kind in [AccountantKind::Pld, AccountantKind::Rdp] {
        let a = accountant::epsilon(&sampled_dg, 1e-5, kind).unwrap();
        let b = accountant::epsilon(&sampled_gaussian(0.3, 2.5), 1e-5, kind).unwrap();
        assert_eq!(a, b, "{kind}");
    }
}

#[test]
fn records_are_validated_on_append() {
    let dir = tempfile::tempdir().unwrap();
    let (mut l, _) =
        PrivacyLedger::open(dir.path().join("ledger"), config(sampled(0.5), 100.0)).unwrap();
    // Amplification only when the aggregator drew the sample.
    let err = l
        .append(event_record(
            1,
            "dp-sgd",
            vec![1],
            sampled_gaussian(0.1, 1.0),
            false,
        ))
        .unwrap_err();
    assert!(
        err.to_string().contains("aggregator drew the sample"),
        "{err}"
    );
    let mut nested = event_record(
        1,
        "dp-sgd",
        vec![1],
        DpEvent::Composed {
            events: vec![laplace(1.0), sampled_gaussian(0.1, 1.0)],
        },
        false,
    );
    assert!(l.append(nested.clone()).is_err());
    nested.sampled_by_aggregator = true;
    l.append(nested).unwrap();
    // Unnamed phase, bad clip norm, bad event parameters.
    assert!(
        l.append(event_record(2, " ", vec![1], laplace(1.0), false))
            .is_err()
    );
    let mut r = record(2, vec![1], 1.0, None);
    r.clip_norm = Some(f64::INFINITY);
    assert!(l.append(r).unwrap_err().to_string().contains("clip norm"));
    assert!(
        l.append(event_record(2, "release", vec![1], laplace(0.0), false))
            .is_err()
    );
    assert_eq!(l.records().len(), 1);
}

#[test]
fn unit_epsilon_is_exact_for_gaussians_and_pld_otherwise() {
    let d = delta();
    let g = |z: f64| DpEvent::Gaussian {
        noise_multiplier: z,
    };
    assert_eq!(
        accountant::unit_epsilon(&[], d, AccountantKind::Pld).unwrap(),
        (0.0, Method::None)
    );
    // Gaussians, nested compositions and rate-1 "sampling" compose as one Gaussian.
    let events = [
        g(3.0),
        DpEvent::SelfComposed {
            event: Box::new(g(3.0)),
            count: 2,
        },
        DpEvent::PoissonSampled {
            sampling_rate: 1.0,
            event: Box::new(g(3.0)),
        },
    ];
    let (e, m) = accountant::unit_epsilon(&events, d, AccountantKind::Pld).unwrap();
    assert_eq!(m, Method::AnalyticGaussian);
    assert!(rel(e, gaussian::epsilon(1.5, 1e-5).unwrap()) < 1e-12);
    // Anything else goes to PLD, grouped.
    let mixed = [g(3.0), laplace(2.0), g(3.0)];
    let (e, m) = accountant::unit_epsilon(&mixed, d, AccountantKind::Pld).unwrap();
    assert_eq!(m, Method::Pld);
    let direct = accountant::epsilon(
        &DpEvent::Composed {
            events: vec![g(3.0), g(3.0), laplace(2.0)],
        },
        1e-5,
        AccountantKind::Pld,
    )
    .unwrap();
    assert!(rel(e, direct) < 1e-9);
    let (r, m) = accountant::unit_epsilon(&mixed, d, AccountantKind::Rdp).unwrap();
    assert_eq!(m, Method::Rdp);
    assert!(r >= e);
    // A non-private event is infinite, not an error.
    let (e, _) = accountant::unit_epsilon(&[g(0.0)], d, AccountantKind::Pld).unwrap();
    assert_eq!(e, f64::INFINITY);
}

mod phase_invariants {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10))]

        /// Whatever the phases and events, the basic composition of phases is never below the
        /// tight figure, and one phase alone equals it.
        #[test]
        fn basic_composition_is_never_smaller(
            rounds in prop::collection::vec(
                (0usize..3, 0usize..4, prop::collection::btree_set(0u64..5, 1..3)),
                1..6,
            )
        ) {
            let dir = tempfile::tempdir().unwrap();
            let (mut l, _) = PrivacyLedger::open(
                dir.path().join("ledger"),
                config(sampled(0.3), 1e6),
            )
            .unwrap();
            for (r, (phase, kind, units)) in rounds.iter().enumerate() {
                let (event, by_agg) = match kind {
                    0 => (DpEvent::Gaussian { noise_multiplier: 2.0 }, false),
                    1 => (sampled_gaussian(0.3, 1.2), true),
                    2 => (laplace(3.0), false),
                    _ => (DpEvent::EpsilonDelta { epsilon: 0.2, delta: 1e-7 }, false),
                };
                let phase = ["training", "release", "dp-sgd"][*phase];
                l.append(event_record(r as u64, phase, units.iter().copied().collect(), event, by_agg))
                    .unwrap();
            }
            let rep = l.report().unwrap();
            prop_assert!(rep.epsilon_basic >= rep.epsilon, "{:?}", rep);
            if rep.phases.len() == 1 {
                prop_assert_eq!(rep.epsilon_basic, rep.epsilon);
            }
            prop_assert_eq!(l.epsilon().unwrap(), rep.epsilon);
        }
    }
}
