//! Engine tests of pre-summed contributions (the central mode's summed path): the record's
//! larger sensitivity and the noise calibrated to it, the commit order, whole-sum refusals, and
//! the journal.

use super::*;
use crate::journal::{self, JournalMode, JournalReader, JournalWriter, ReplayError};
use fedrl_common::privacy::noise::DiscreteGaussianNoise;

const DIM: usize = 3;
const C: f64 = 1.0;
const Z: f64 = 0.5;

fn cfg(summed: Option<SummedBound>) -> EngineConfig {
    EngineConfig {
        dim: DIM,
        offer_dim: DIM,
        rounds: 3,
        population: 6,
        participation: Participation::Fresh,
        cohort_size: 4,
        expected_cohort: 4.0,
        quorum: 1,
        deadline_s: 10.0,
        start_timeout_s: 5.0,
        clip_norm: C,
        noise_multiplier: Z,
        non_private: false,
        release: None,
        summed,
    }
}

fn bound() -> SummedBound {
    SummedBound {
        max_units: 6,
        max_rows: 6,
    }
}

fn engine(c: EngineConfig) -> Engine {
    Engine::new(c, Resume::default(), Box::new(SeededEntropy::new(42))).unwrap()
}

/// Joins one client hosting every unit; returns round 1's offered units.
fn opened(e: &mut Engine) -> Vec<UnitId> {
    let a = e.handle(
        0.0,
        Event::ClientJoined {
            client: 1,
            units: vec![UnitRange { start: 0, end: 6 }],
        },
    );
    a.iter()
        .find_map(|a| match a {
            Action::SendOffer { units, .. } => Some(units.clone()),
            _ => None,
        })
        .expect("round 1 offered")
}

fn unit(u: UnitId) -> SummedUnit {
    SummedUnit {
        client: 1,
        unit: u,
        norm: 0.5,
        clipped: u.is_multiple_of(2),
    }
}

fn rejected(a: &[Action]) -> Vec<ErrorCode> {
    a.iter()
        .filter_map(|a| match a {
            Action::Rejected { code, .. } => Some(*code),
            _ => None,
        })
        .collect()
}

/// A summed round: accepted per unit, recorded with the summed sensitivity (larger than the
/// grid's, noise calibrated so sigma / Delta >= z for it), released only after the append,
/// and the release is exactly the sum quantised once plus round 1's seeded discrete Gaussian.
#[test]
fn a_sum_is_recorded_with_its_larger_sensitivity_and_released_after_the_ledger() {
    let mut e = engine(cfg(Some(bound())));
    let cohort = opened(&mut e);
    assert_eq!(cohort.len(), 4);
    let units: Vec<SummedUnit> = cohort.iter().map(|&u| unit(u)).collect();
    let sum = vec![0.75, -1.5, 2.25e-3];
    let a = e.handle_sum(1.0, 1, &units, &sum);
    let accepted = a
        .iter()
        .filter(|a| matches!(a, Action::Accepted { .. }))
        .count();
    assert_eq!(accepted, 4);
    assert!(
        !a.iter().any(|a| matches!(a, Action::Release(_))),
        "nothing leaves before the ledger"
    );
    let rec = a
        .iter()
        .find_map(|a| match a {
            Action::AppendLedger { record, .. } => Some(record.clone()),
            _ => None,
        })
        .expect("every cohort unit resolved: the round closes");
    let grid = Grid::for_clip_norm(C, DEFAULT_GRID_BITS).unwrap();
    let DpEvent::DiscreteGaussian {
        sigma,
        l2_sensitivity,
    } = rec.event.clone()
    else {
        panic!("a discrete Gaussian record: {rec:?}");
    };
    let ratio = C / grid.gamma();
    assert!(
        l2_sensitivity >= ratio + (DIM as f64).sqrt(),
        "{l2_sensitivity}"
    );
    assert!(l2_sensitivity <= (ratio + (DIM as f64).sqrt()) * (1.0 + 1e-6));
    assert!(sigma / l2_sensitivity >= Z, "{sigma} / {l2_sensitivity}");
    let a = e.handle(1.5, Event::LedgerAppended { round: 1 });
    let rel = a
        .iter()
        .find_map(|a| match a {
            Action::Release(r) => Some(r.clone()),
            _ => None,
        })
        .expect("released after the append");
    assert_eq!((rel.accepted, rel.clipped), (4, 2));
    // The same by hand: quantise once, add, noise of round 1 (seed 42), divide by 4.
    let cal = NoiseCalibration::for_summed(&grid, &bound(), DIM, Z).unwrap();
    assert_eq!(cal.sigma(), sigma);
    let mut q = vec![0i64; DIM];
    grid.quantize_sum(&sum, 4, &mut q).unwrap();
    let mut s = FixedPointSum::new(grid, DIM);
    s.add_quantized(&q, 4).unwrap();
    let mut noise = DiscreteGaussianNoise::seeded(round_noise_seed(42, 1));
    let want = s.release(&mut noise, &cal, 4.0).unwrap();
    assert_eq!(rel.noisy_mean, want);
}

#[test]
fn a_sum_with_one_bad_unit_or_value_is_refused_whole() {
    let c = cfg(Some(bound()));
    let base = {
        let mut e = engine(c.clone());
        opened(&mut e)
    };
    let outside = (0..6).find(|u| !base.contains(u)).unwrap();
    let good: Vec<SummedUnit> = base.iter().map(|&u| unit(u)).collect();
    let cases: Vec<(Vec<SummedUnit>, Vec<f64>, ErrorCode)> = vec![
        (
            [good[..2].to_vec(), vec![unit(outside)]].concat(),
            vec![0.1; DIM],
            ErrorCode::NotInCohort,
        ),
        (
            [good[..2].to_vec(), vec![good[0]]].concat(),
            vec![0.1; DIM],
            ErrorCode::DuplicateUnit,
        ),
        (good.clone(), vec![0.1; DIM + 1], ErrorCode::WrongLength),
        (good.clone(), vec![0.1, f64::NAN, 0.0], ErrorCode::NonFinite),
        // Far beyond what 4 clipped units can sum to.
        (good.clone(), vec![1e3, 0.0, 0.0], ErrorCode::Internal),
        (
            vec![SummedUnit {
                client: 9,
                ..good[0]
            }],
            vec![0.1; DIM],
            ErrorCode::NotInCohort,
        ),
    ];
    for (units, sum, code) in cases {
        let mut e = engine(c.clone());
        assert_eq!(opened(&mut e), base);
        let a = e.handle_sum(1.0, 1, &units, &sum);
        assert!(
            !a.iter().any(|a| matches!(a, Action::Accepted { .. })),
            "{code:?}: nothing of a refused sum is accepted"
        );
        assert!(rejected(&a).contains(&code), "{code:?}: {a:?}");
        // The round is still open for the rest (or closed with nothing from the sum).
        if let Some(Action::AppendLedger { .. }) = a.last() {
            panic!("{code:?}: a refused sum resolved every unit: {a:?}");
        }
    }
    // A sum for a round that is not open.
    let mut e = engine(c);
    opened(&mut e);
    let a = e.handle_sum(1.0, 2, &good, &[0.1; DIM]);
    assert_eq!(rejected(&a), vec![ErrorCode::LateUpdate]);
}

/// The federated mode is unchanged: its engine refuses pre-summed contributions (its noise is
/// calibrated to per-update quantisation), and records the grid's own sensitivity.
#[test]
fn an_engine_without_the_summed_path_refuses_sums() {
    let mut e = engine(cfg(None));
    let cohort = opened(&mut e);
    let units: Vec<SummedUnit> = cohort.iter().map(|&u| unit(u)).collect();
    let a = e.handle_sum(1.0, 1, &units, &[0.1; DIM]);
    assert_eq!(rejected(&a), vec![ErrorCode::Internal]);
    assert!(!a.iter().any(|a| matches!(a, Action::Accepted { .. })));
}

/// A run with sums replays bit for bit from a full journal; a digest journal keeps no value of
/// the sum and cannot replay.
#[test]
fn sums_are_journalled_and_replay_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    for mode in [JournalMode::Full, JournalMode::Digest] {
        let path = dir.path().join(format!("{mode:?}.journal"));
        // Three fresh rounds of 4 units need 12 units.
        let mut c = cfg(Some(bound()));
        c.population = 12;
        let mut e = engine(c.clone());
        let mut w = JournalWriter::open(&path, mode).unwrap();
        let mut actions = Vec::new();
        let mut feed = |e: &mut Engine, w: &mut JournalWriter, t: f64, ev: Event| {
            w.record(t, &ev).unwrap();
            let a = e.handle(t, ev);
            actions.extend(a.iter().cloned().map(|x| (t, x)));
            a
        };
        let marker = 1_234.567_891_f64;
        let mut a = feed(
            &mut e,
            &mut w,
            0.0,
            Event::ClientJoined {
                client: 1,
                units: vec![UnitRange { start: 0, end: 12 }],
            },
        );
        for round in 1..=3u64 {
            let units: Vec<SummedUnit> = a
                .iter()
                .find_map(|a| match a {
                    Action::SendOffer { units, .. } => Some(units.clone()),
                    _ => None,
                })
                .unwrap()
                .into_iter()
                .map(unit)
                .collect();
            let t = round as f64;
            let sum = vec![marker * 1e-4 * round as f64, -0.25, 0.125];
            feed(&mut e, &mut w, t, Event::SumArrived { round, units, sum });
            feed(&mut e, &mut w, t, Event::LedgerAppended { round });
            a = feed(
                &mut e,
                &mut w,
                t,
                Event::Released {
                    round,
                    target_reached: false,
                },
            );
        }
        drop(w);
        let releases = actions
            .iter()
            .filter(|(_, a)| matches!(a, Action::Release(_)))
            .count();
        assert_eq!(releases, 3);
        let (entries, torn) = JournalReader::read_all(&path).unwrap();
        assert_eq!(torn, None);
        let mut fresh = engine(c);
        match mode {
            JournalMode::Full => {
                assert_eq!(journal::replay(&mut fresh, entries).unwrap(), actions);
            }
            JournalMode::Digest => {
                let bytes = std::fs::read(&path).unwrap();
                let needle = (marker * 1e-4).to_le_bytes();
                assert!(!bytes.windows(8).any(|w| w == needle));
                assert!(matches!(
                    journal::replay(&mut fresh, entries),
                    Err(ReplayError::MissingSumBody { round: 1, .. })
                ));
            }
        }
    }
}
