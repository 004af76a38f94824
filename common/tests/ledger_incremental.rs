//! The ledger's incremental accounting (grouped histories, cached count limits) against the
//! plain full recomputation it replaced: every unit's events rebuilt from every record and
//! accounted from scratch. Refusals must fall on the same rounds with the same figures, and
//! every reported epsilon must be the same, bit for bit.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use fedrl_common::privacy::accountant::{self, AccountantKind};
use fedrl_common::privacy::ledger::{
    LedgerConfig, LedgerError, OpenPolicy, Participation, PrivacyLedger, RoundRecord, UnitKind,
};
use fedrl_common::privacy::noise::NoiseSource;
use fedrl_common::privacy::{Delta, DpEvent};
use proptest::prelude::*;

fn delta() -> Delta {
    Delta::try_from(1e-5).unwrap()
}

fn config(participation: Participation, target: f64) -> LedgerConfig {
    LedgerConfig {
        target_epsilon: target,
        delta: delta(),
        unit_kind: UnitKind::User,
        participation,
    }
}

fn gaussian(z: f64) -> DpEvent {
    DpEvent::Gaussian {
        noise_multiplier: z,
    }
}

fn poisson(q: f64, z: f64) -> DpEvent {
    DpEvent::PoissonSampled {
        sampling_rate: q,
        event: Box::new(gaussian(z)),
    }
}

fn record(round: u64, units: Vec<u64>, event: DpEvent, sampled: bool) -> RoundRecord {
    RoundRecord {
        round,
        phase: if sampled { "dp-sgd" } else { "release" }.into(),
        event,
        sampled_by_aggregator: sampled,
        units,
        clip_norm: Some(1.0),
        expected_cohort: Some(4.0),
        noise_source: NoiseSource::Seeded { seed: 1 },
        unix_time_s: 1.0e9,
    }
}

/// The plain full recomputation: for every unit (and a unit that never took part), the events
/// of every sampled record followed by its own un-sampled ones, accounted from scratch.
/// Identical event lists are accounted once (a pure function; the memo only saves time).
struct Reference {
    memo: HashMap<String, f64>,
}

impl Reference {
    fn new() -> Self {
        Self {
            memo: HashMap::new(),
        }
    }

    fn unit(&mut self, records: &[RoundRecord], unit: Option<u64>) -> f64 {
        let mut events: Vec<DpEvent> = records
            .iter()
            .filter(|r| r.sampled_by_aggregator)
            .map(|r| r.event.clone())
            .collect();
        if let Some(u) = unit {
            events.extend(
                records
                    .iter()
                    .filter(|r| !r.sampled_by_aggregator && r.units.contains(&u))
                    .map(|r| r.event.clone()),
            );
        }
        let key = serde_json::to_string(&events).unwrap();
        if let Some(&e) = self.memo.get(&key) {
            return e;
        }
        let e = accountant::unit_epsilon(&events, delta(), AccountantKind::Pld)
            .unwrap()
            .0;
        self.memo.insert(key, e);
        e
    }

    /// Every unit's epsilon, and the worst (the never-seen unit included).
    fn account(&mut self, records: &[RoundRecord]) -> (f64, BTreeMap<u64, f64>) {
        let units: BTreeSet<u64> = records.iter().flat_map(|r| r.units.clone()).collect();
        let mut worst = self.unit(records, None);
        let mut per_unit = BTreeMap::new();
        for u in units {
            let e = self.unit(records, Some(u));
            if e > worst {
                worst = e;
            }
            per_unit.insert(u, e);
        }
        (worst, per_unit)
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// An aggregator-sampled record: event kind, units drawn.
    Sampled(usize, BTreeSet<u64>),
    /// A record charged to its units only.
    Unsampled(usize, BTreeSet<u64>),
    /// Close and reopen with the target scaled by this factor of the reference epsilon now
    /// (a raise is allowed explicitly and recorded as a budget change).
    Reopen(f64),
}

fn sampled_event(kind: usize) -> DpEvent {
    match kind {
        0 => poisson(0.2, 1.5),
        1 => poisson(0.5, 3.0),
        // Rate 1: every unit, a plain Gaussian.
        _ => gaussian(4.0),
    }
}

fn unsampled_event(kind: usize) -> DpEvent {
    match kind {
        0 => gaussian(3.0),
        1 => gaussian(5.0),
        _ => DpEvent::Laplace { scale: 4.0 },
    }
}

fn op() -> impl Strategy<Value = Op> {
    let units = prop::collection::btree_set(0u64..8, 1..4);
    prop_oneof![
        4 => (0usize..3, units.clone()).prop_map(|(k, u)| Op::Sampled(k, u)),
        4 => (0usize..3, units).prop_map(|(k, u)| Op::Unsampled(k, u)),
        1 => prop_oneof![Just(0.8), Just(1.0), Just(1.2), Just(2.0)].prop_map(Op::Reopen),
    ]
}

/// Runs `ops` on a ledger and on the reference side by side.
fn run(fresh: bool, initial_target: f64, ops: &[Op]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let participation = if fresh {
        Participation::Fresh
    } else {
        Participation::sampled(0.5).unwrap()
    };
    let mut target = initial_target;
    let (mut l, _) = PrivacyLedger::open(&path, config(participation, target)).unwrap();
    let mut reference = Reference::new();
    let mut records: Vec<RoundRecord> = Vec::new();
    let mut round = 0u64;
    let mut next_fresh_unit = 100u64;
    let mut refusals = 0;
    for op in ops {
        let candidate = match op {
            Op::Reopen(factor) => {
                drop(l);
                let (now, _) = reference.account(&records);
                let asked = (now * factor).max(0.05);
                let raise = asked > target;
                let policy = OpenPolicy {
                    allow_budget_increase: raise,
                };
                let (reopened, rec) =
                    PrivacyLedger::open_with(&path, config(participation, asked), policy).unwrap();
                prop_assert_eq!(rec.records, records.len());
                l = reopened;
                target = asked;
                prop_assert_eq!(l.epsilon().unwrap(), now);
                continue;
            }
            Op::Sampled(k, units) => {
                let units = if fresh {
                    // At most once ever: new units stand in for the drawn ones.
                    let n = units.len() as u64;
                    next_fresh_unit += n;
                    (next_fresh_unit - n..next_fresh_unit).collect()
                } else {
                    units.iter().copied().collect()
                };
                record(round, units, sampled_event(*k), true)
            }
            Op::Unsampled(k, units) => {
                let units = if fresh {
                    let n = units.len() as u64;
                    next_fresh_unit += n;
                    (next_fresh_unit - n..next_fresh_unit).collect()
                } else {
                    units.iter().copied().collect()
                };
                record(round, units, unsampled_event(*k), false)
            }
        };
        records.push(candidate.clone());
        let (with, _) = reference.account(&records);
        let got = l.append(candidate);
        if with > target {
            records.pop();
            refusals += 1;
            match got {
                Err(LedgerError::BudgetExceeded {
                    round: r,
                    epsilon,
                    target: t,
                    ..
                }) => {
                    prop_assert_eq!(r, round);
                    prop_assert_eq!(epsilon, with);
                    prop_assert_eq!(t, target);
                }
                other => prop_assert!(false, "round {round}: expected a refusal, got {other:?}"),
            }
        } else {
            prop_assert!(
                got.is_ok(),
                "round {round}: {got:?} (reference {with} <= {target})"
            );
            round += 1;
        }
        let (now, per_unit) = reference.account(&records);
        prop_assert_eq!(l.epsilon().unwrap(), now);
        for (&u, &e) in &per_unit {
            prop_assert_eq!(l.unit_epsilon(u).unwrap(), e, "unit {}", u);
        }
    }
    // The report and a read-only re-account agree with the reference too.
    let (now, per_unit) = reference.account(&records);
    let report = l.report().unwrap();
    prop_assert_eq!(report.epsilon, now);
    prop_assert_eq!(report.per_unit.len(), per_unit.len());
    for p in &report.per_unit {
        prop_assert_eq!(Some(&p.epsilon), per_unit.get(&p.unit));
    }
    drop(l);
    let file = PrivacyLedger::read_file(&path).unwrap();
    prop_assert_eq!(file.report(AccountantKind::Pld).unwrap().epsilon, now);
    let _ = refusals;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Random ledgers of sampled and un-sampled records, budget raises and cuts: the
    /// incremental ledger refuses exactly where the full recomputation does, with its figure,
    /// and reports the same epsilons.
    #[test]
    fn incremental_accounting_matches_the_full_recomputation(
        fresh in any::<bool>(),
        target in prop_oneof![Just(1.0), Just(2.5), Just(6.0)],
        ops in prop::collection::vec(op(), 1..16),
    ) {
        run(fresh, target, &ops)?;
    }
}

/// A long run of one DP-SGD event with the target set exactly to the epsilon after `n` rounds:
/// appends 1..=n pass, round n + 1 is refused with the figure the accountant gives n + 1
/// rounds, and so is every retry (the cached limit answers without accounting again).
#[test]
fn a_long_run_is_refused_exactly_at_the_first_round_above_the_target() {
    let event = poisson(1.0 / 16.0, 1.0);
    let eps = |n: u64| {
        accountant::unit_epsilon(
            &[DpEvent::SelfComposed {
                event: Box::new(event.clone()),
                count: n,
            }],
            delta(),
            AccountantKind::Pld,
        )
        .unwrap()
        .0
    };
    let n = 300;
    let target = eps(n);
    let above = eps(n + 1);
    assert!(above > target);
    let dir = tempfile::tempdir().unwrap();
    let (mut l, _) = PrivacyLedger::open(
        dir.path().join("ledger"),
        config(Participation::sampled(1.0 / 16.0).unwrap(), target),
    )
    .unwrap();
    for r in 0..n {
        l.append(record(r, vec![r % 7, 100 + r % 5], event.clone(), true))
            .unwrap_or_else(|e| panic!("round {r}: {e}"));
    }
    assert_eq!(l.epsilon().unwrap(), target);
    for _ in 0..2 {
        match l.append(record(n, vec![3], event.clone(), true)) {
            Err(LedgerError::BudgetExceeded { round, epsilon, .. }) => {
                assert_eq!(round, n);
                assert_eq!(epsilon, above);
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    // An un-sampled record of the same units still fits nowhere: every unit is at the target.
    assert!(matches!(
        l.append(record(n, vec![3], gaussian(50.0), false)),
        Err(LedgerError::BudgetExceeded { .. })
    ));
    assert_eq!(l.records().len() as u64, n);
}

/// The cached limits rest on epsilon growing with the count of a repeated event; check it for
/// the DP-SGD event over a window of consecutive counts (the PLD's pessimistic discretisation
/// and FFT self-composition must not break it).
#[test]
fn accountant_is_monotone_in_the_count_near_the_budget() {
    let event = poisson(1.0 / 16.0, 1.0);
    let mut last = 0.0;
    for n in 1..=64u64 {
        let count = if n <= 32 { n } else { 970 + n };
        let (e, _) = accountant::unit_epsilon(
            &[DpEvent::SelfComposed {
                event: Box::new(event.clone()),
                count,
            }],
            delta(),
            AccountantKind::Pld,
        )
        .unwrap();
        assert!(e > last, "count {count}: {e} after {last}");
        last = e;
    }
}

/// A target lowered on reopen below what units already spent refuses the next record even
/// when that record charges other units only (the whole ledger is checked after opening).
#[test]
fn a_lowered_target_refuses_records_of_other_units() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let cfg = |t| config(Participation::sampled(0.5).unwrap(), t);
    let (mut l, _) = PrivacyLedger::open(&path, cfg(10.0)).unwrap();
    for r in 0..4 {
        l.append(record(r, vec![1], gaussian(2.0), false)).unwrap();
    }
    let spent = l.epsilon().unwrap();
    drop(l);
    let (mut l, _) = PrivacyLedger::open(&path, cfg(spent * 0.9)).unwrap();
    // Unit 2 alone would be far within the target; unit 1 is already above it.
    let err = l
        .append(record(4, vec![2], gaussian(20.0), false))
        .unwrap_err();
    match err {
        LedgerError::BudgetExceeded { epsilon, .. } => assert_eq!(epsilon, spent),
        other => panic!("{other}"),
    }
    drop(l);
    // With the old target it fits.
    let (mut l, _) = PrivacyLedger::open(&path, cfg(10.0)).unwrap();
    l.append(record(4, vec![2], gaussian(20.0), false)).unwrap();
}
