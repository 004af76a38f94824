//! Engine tests: no network, seeded event logs.

use super::*;
use fedrl_common::privacy::clipping::l2_norm;
use fedrl_common::privacy::noise::NoiseSource;

fn cfg(participation: Participation) -> EngineConfig {
    EngineConfig {
        dim: 3,
        rounds: 5,
        population: 10,
        participation,
        cohort_size: 4,
        expected_cohort: 4.0,
        quorum: 2,
        deadline_s: 10.0,
        start_timeout_s: 5.0,
        clip_norm: 1.0,
        noise_multiplier: 0.5,
        seed: Some(42),
        task_json: "{}".into(),
    }
}

fn r(start: u64, end: u64) -> UnitRange {
    UnitRange { start, end }
}

fn offers(actions: &[Action]) -> Vec<(ClientId, u64, Vec<UnitId>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::SendOffer {
                client,
                spec,
                units,
            } => Some((*client, spec.round, units.clone())),
            _ => None,
        })
        .collect()
}

fn commit(actions: &[Action]) -> Option<Commit> {
    actions.iter().find_map(|a| match a {
        Action::Commit(c) => Some((**c).clone()),
        _ => None,
    })
}

/// Two clients hosting 0..5 and 5..10; returns the engine and the offers of round 1.
fn started(c: EngineConfig) -> (Engine, Vec<(ClientId, u64, Vec<UnitId>)>) {
    let mut e = Engine::new(c, Resume::default());
    let a = e.handle(
        0.0,
        Event::ClientJoined {
            client: 1,
            units: vec![r(0, 5)],
        },
    );
    assert!(
        offers(&a).is_empty(),
        "round 1 waits for the whole population"
    );
    let a = e.handle(
        0.1,
        Event::ClientJoined {
            client: 2,
            units: vec![r(5, 10)],
        },
    );
    let o = offers(&a);
    assert!(!o.is_empty());
    (e, o)
}

fn host(u: UnitId) -> ClientId {
    if u < 5 { 1 } else { 2 }
}

#[test]
fn fresh_round_releases_exact_noisy_mean_over_fixed_denominator() {
    let (mut e, o) = started(cfg(Participation::Fresh));
    let cohort: Vec<UnitId> = o.iter().flat_map(|(_, _, u)| u.clone()).collect();
    assert_eq!(cohort.len(), 4);
    // Three of four answer; one is far outside the clip norm.
    let vecs = [
        vec![0.3f32, 0.0, 0.4],
        vec![300.0, 400.0, 0.0],
        vec![0.1, 0.1, 0.1],
    ];
    let mut all = Vec::new();
    for (u, v) in cohort.iter().zip(&vecs) {
        all.extend(e.handle(
            1.0,
            Event::UpdateArrived {
                client: host(*u),
                round: 1,
                unit: *u,
                update: v.clone(),
            },
        ));
    }
    assert!(
        commit(&all).is_none(),
        "not all answered and deadline not passed"
    );
    let a = e.handle(10.5, Event::Tick);
    let c = commit(&a).expect("quorum reached at the deadline");
    assert_eq!(c.accepted, 3);
    assert_eq!(c.clipped, 1);
    assert_eq!(c.record.units.len(), 3);
    assert_eq!(c.record.expected_cohort, Some(4.0));
    assert_eq!(c.record.sampling_rate(), None);
    let seed = round_noise_seed(42, 1);
    assert_eq!(c.record.noise_source, NoiseSource::Seeded { seed });
    // Reproduce: sum of clipped updates, noise from the same seed, divide by 4 (not 3).
    let mut sum = [0.0f64; 3];
    for v in &vecs {
        let mut v = v.clone();
        clip_l2(&mut v, 1.0);
        for i in 0..3 {
            sum[i] += v[i] as f64;
        }
    }
    let mut expected: Vec<f32> = sum.iter().map(|s| *s as f32).collect();
    GaussianNoise::seeded(seed)
        .add_to(&mut expected, 0.5)
        .unwrap();
    let expected: Vec<f32> = expected.iter().map(|x| (*x as f64 / 4.0) as f32).collect();
    assert_eq!(c.noisy_mean, expected);
    // Nothing is offered for round 2 until the driver has committed round 1.
    assert!(offers(&a).is_empty());
    let a = e.handle(10.6, Event::Committed { round: 1 });
    let o2 = offers(&a);
    assert!(!o2.is_empty());
    assert!(o2.iter().all(|(_, round, _)| *round == 2));
    // Fresh: no unit of round 1's contributors is offered again.
    for (_, _, units) in &o2 {
        for u in units {
            assert!(!c.record.units.contains(u), "unit {u} reused");
        }
    }
}

#[test]
fn below_quorum_is_abandoned_and_nothing_is_committed() {
    let (mut e, o) = started(cfg(Participation::Fresh));
    let u = o[0].2[0];
    let a = e.handle(
        1.0,
        Event::UpdateArrived {
            client: host(u),
            round: 1,
            unit: u,
            update: vec![0.1; 3],
        },
    );
    assert!(matches!(a[0], Action::Accepted { .. }));
    let a = e.handle(11.0, Event::Tick);
    assert!(commit(&a).is_none());
    assert!(a.iter().any(|x| matches!(
        x,
        Action::Abandoned {
            round: 1,
            accepted: 1,
            quorum: 2,
            ..
        }
    )));
    // The next round opens right away (the unit that answered was not consumed).
    assert!(offers(&a).iter().all(|(_, r, _)| *r == 2));
    assert_eq!(e.rounds_abandoned(), 1);
    // A late update for round 1 is discarded with a clear error.
    let a = e.handle(
        11.5,
        Event::UpdateArrived {
            client: host(u),
            round: 1,
            unit: u,
            update: vec![0.1; 3],
        },
    );
    assert!(matches!(
        &a[0],
        Action::Rejected {
            code: ErrorCode::LateUpdate,
            ..
        }
    ));
}

#[test]
fn bad_updates_get_clear_errors_and_do_not_count() {
    let (mut e, o) = started(cfg(Participation::Fresh));
    let cohort: Vec<UnitId> = o.iter().flat_map(|(_, _, u)| u.clone()).collect();
    let (u0, u1, u2) = (cohort[0], cohort[1], cohort[2]);
    let code = |a: &[Action]| match &a[0] {
        Action::Rejected { code, message, .. } => {
            assert!(!message.is_empty());
            Some(*code)
        }
        _ => None,
    };
    let a = e.handle(
        1.0,
        Event::UpdateArrived {
            client: host(u0),
            round: 1,
            unit: u0,
            update: vec![f32::NAN, 0.0, 0.0],
        },
    );
    assert_eq!(code(&a), Some(ErrorCode::NonFinite));
    let a = e.handle(
        1.0,
        Event::UpdateArrived {
            client: host(u1),
            round: 1,
            unit: u1,
            update: vec![0.0; 4],
        },
    );
    assert_eq!(code(&a), Some(ErrorCode::WrongLength));
    let a = e.handle(
        1.0,
        Event::UpdateArrived {
            client: host(u2),
            round: 1,
            unit: u2,
            update: vec![0.1; 3],
        },
    );
    assert!(matches!(a[0], Action::Accepted { .. }));
    let a = e.handle(
        1.0,
        Event::UpdateArrived {
            client: host(u2),
            round: 1,
            unit: u2,
            update: vec![0.1; 3],
        },
    );
    assert_eq!(code(&a), Some(ErrorCode::DuplicateUnit));
    // A unit not in the cohort, and a unit hosted by the other client.
    let outsider = (0..10).find(|u| !cohort.contains(u)).unwrap();
    let a = e.handle(
        1.0,
        Event::UpdateArrived {
            client: host(outsider),
            round: 1,
            unit: outsider,
            update: vec![0.1; 3],
        },
    );
    assert_eq!(code(&a), Some(ErrorCode::NotInCohort));
    let other = if host(cohort[3]) == 1 { 2 } else { 1 };
    let a = e.handle(
        1.0,
        Event::UpdateArrived {
            client: other,
            round: 1,
            unit: cohort[3],
            update: vec![0.1; 3],
        },
    );
    assert_eq!(code(&a), Some(ErrorCode::NotInCohort));
    // A future round.
    let a = e.handle(
        1.0,
        Event::UpdateArrived {
            client: 1,
            round: 9,
            unit: 0,
            update: vec![0.1; 3],
        },
    );
    assert_eq!(code(&a), Some(ErrorCode::LateUpdate));
    let a = e.handle(
        1.0,
        Event::UpdateArrived {
            client: host(cohort[3]),
            round: 1,
            unit: cohort[3],
            update: vec![0.2; 3],
        },
    );
    // All four resolved (2 rejected, 2 accepted): the round closes early with quorum 2.
    let c = commit(&a).expect("closes once every cohort unit is resolved");
    assert_eq!(c.accepted, 2);
    assert_eq!(c.rejected, 5);
    assert!(c.noisy_mean.iter().all(|x| x.is_finite()));
}

#[test]
fn overlapping_joins_are_refused() {
    let mut e = Engine::new(cfg(Participation::Fresh), Resume::default());
    e.handle(
        0.0,
        Event::ClientJoined {
            client: 1,
            units: vec![r(0, 5)],
        },
    );
    let a = e.handle(
        0.0,
        Event::ClientJoined {
            client: 2,
            units: vec![r(4, 8)],
        },
    );
    assert!(
        matches!(
            &a[0],
            Action::Rejected {
                code: ErrorCode::UnitsInUse,
                ..
            }
        ),
        "{a:?}"
    );
    let a = e.handle(
        0.0,
        Event::ClientJoined {
            client: 3,
            units: vec![r(8, 11)],
        },
    );
    assert!(
        matches!(
            &a[0],
            Action::Rejected {
                code: ErrorCode::UnitsInUse,
                ..
            }
        ),
        "{a:?}"
    );
    let a = e.handle(
        0.0,
        Event::ClientJoined {
            client: 3,
            units: vec![r(6, 8), r(7, 9)],
        },
    );
    assert!(
        matches!(
            &a[0],
            Action::Rejected {
                code: ErrorCode::UnitsInUse,
                ..
            }
        ),
        "{a:?}"
    );
    // After client 1 leaves its units are free.
    e.handle(0.0, Event::ClientLeft { client: 1 });
    let a = e.handle(
        0.0,
        Event::ClientJoined {
            client: 2,
            units: vec![r(0, 5)],
        },
    );
    assert!(a.iter().all(|x| !matches!(x, Action::Rejected { .. })));
}

#[test]
fn fresh_is_enforced_across_restarts_and_exhaustion_finishes() {
    let mut c = cfg(Participation::Fresh);
    c.rounds = 100;
    let used: HashSet<UnitId> = (0..7).collect();
    let mut e = Engine::new(
        c,
        Resume {
            next_round: 4,
            used_units: used,
            rounds_completed: 3,
            rounds_abandoned: 0,
        },
    );
    e.handle(
        0.0,
        Event::ClientJoined {
            client: 1,
            units: vec![r(0, 10)],
        },
    );
    // Only 3 unused units: fewer than the cohort of 4; after the start timeout a round opens
    // with the 3 (>= quorum), numbered after the ledger's last round.
    let a = e.handle(6.0, Event::Tick);
    let o = offers(&a);
    assert_eq!(o.len(), 1);
    assert_eq!(o[0].1, 4);
    assert_eq!(o[0].2, vec![7, 8, 9]);
    let mut all = Vec::new();
    for u in [7, 8, 9] {
        all.extend(e.handle(
            6.5,
            Event::UpdateArrived {
                client: 1,
                round: 4,
                unit: u,
                update: vec![0.0; 3],
            },
        ));
    }
    let c = commit(&all).unwrap();
    assert_eq!(c.record.round, 4);
    let a = e.handle(6.6, Event::Committed { round: 4 });
    assert!(matches!(&a[0], Action::Finished { .. }), "{a:?}");
    assert!(e.is_finished());
}

#[test]
fn sampled_draws_poisson_sample_of_whole_population() {
    let mut c = cfg(Participation::sampled(0.3).unwrap());
    c.population = 2000;
    c.expected_cohort = 600.0;
    c.quorum = 1;
    c.rounds = 3;
    let mut e = Engine::new(c, Resume::default());
    // Only half the population is connected; after the start timeout the round opens anyway.
    let a = e.handle(
        0.0,
        Event::ClientJoined {
            client: 1,
            units: vec![r(0, 1000)],
        },
    );
    assert!(offers(&a).is_empty());
    let a = e.handle(5.0, Event::Tick);
    let o = offers(&a);
    assert_eq!(o.len(), 1);
    let n = o[0].2.len();
    // Half of an expected 600 are hosted: about 300 (sd ~14.5).
    assert!((200..400).contains(&n), "sample size {n}");
    let mut all = Vec::new();
    for u in &o[0].2 {
        all.extend(e.handle(
            5.1,
            Event::UpdateArrived {
                client: 1,
                round: 1,
                unit: *u,
                update: vec![0.01; 3],
            },
        ));
    }
    // The unconnected half counts as dropped: every reachable unit answered, so it closes.
    let c = commit(&all).unwrap();
    assert_eq!(c.record.sampling_rate(), Some(0.3));
    assert_eq!(c.record.expected_cohort, Some(600.0));
    // Sampled: the same units may be drawn again.
    let a = e.handle(5.2, Event::Committed { round: 1 });
    let o2 = offers(&a);
    let again = o2[0].2.iter().filter(|u| o[0].2.contains(u)).count();
    assert!(again > 0);
}

#[test]
fn client_leaving_resolves_its_units_and_rejoin_gets_reoffer() {
    let (mut e, o) = started(cfg(Participation::Fresh));
    let cohort: Vec<UnitId> = o.iter().flat_map(|(_, _, u)| u.clone()).collect();
    // Client 2 leaves then comes back (with a new session id) before the deadline.
    e.handle(1.0, Event::ClientLeft { client: 2 });
    let a = e.handle(
        2.0,
        Event::ClientJoined {
            client: 3,
            units: vec![r(5, 10)],
        },
    );
    let mine: Vec<UnitId> = cohort.iter().copied().filter(|u| *u >= 5).collect();
    if !mine.is_empty() {
        let o = offers(&a);
        assert_eq!(o.len(), 1);
        assert_eq!(o[0].0, 3);
        assert_eq!(o[0].2, mine);
        assert!((o[0].1 == 1) && a.iter().any(|x| matches!(x, Action::SendOffer { spec, .. } if (spec.deadline_s - 8.1).abs() < 1e-9)));
    }
}

#[test]
fn budget_refusal_finishes_without_release() {
    let (mut e, o) = started(cfg(Participation::Fresh));
    let mut all = Vec::new();
    for (c, _, units) in &o {
        for u in units {
            all.extend(e.handle(
                1.0,
                Event::UpdateArrived {
                    client: *c,
                    round: 1,
                    unit: *u,
                    update: vec![0.1; 3],
                },
            ));
        }
    }
    assert!(commit(&all).is_some());
    let a = e.handle(
        1.1,
        Event::CommitFailed {
            round: 1,
            reason: "budget".into(),
        },
    );
    assert!(matches!(&a[0], Action::Finished { .. }));
    assert_eq!(e.rounds_completed(), 0);
}

/// Replaying the same seeded event log gives the same actions (the churn simulator and tests rely
/// on it).
#[test]
fn replay_is_deterministic() {
    let run = || {
        let (mut e, o) = started(cfg(Participation::Fresh));
        let mut log = Vec::new();
        let mut t = 1.0;
        let mut pending = o;
        for round in 1..=5u64 {
            for (c, _, units) in &pending {
                for u in units.iter().skip(1) {
                    let v = vec![*u as f32, 1.0, -(round as f32)];
                    log.extend(e.handle(
                        t,
                        Event::UpdateArrived {
                            client: *c,
                            round,
                            unit: *u,
                            update: v,
                        },
                    ));
                }
            }
            t += 11.0;
            let a = e.handle(t, Event::Tick);
            log.extend(a.clone());
            let a2 = e.handle(t, Event::Committed { round });
            pending = offers(&a2);
            log.extend(a2);
        }
        log
    };
    let a = run();
    assert_eq!(a, run());
    let released: Vec<&Commit> = a
        .iter()
        .filter_map(|x| match x {
            Action::Commit(c) => Some(&**c),
            _ => None,
        })
        .collect();
    assert!(released.len() >= 2);
    for c in released {
        // Sensitivity: every accepted update was clipped to norm <= C before summing, so the
        // noiseless part has norm <= accepted * C.
        assert!(l2_norm(&c.noisy_mean).is_finite());
    }
}

#[test]
fn join_without_units_hosts_every_unhosted_unit() {
    let mut e = Engine::new(cfg(Participation::Fresh), Resume::default());
    e.handle(
        0.0,
        Event::ClientJoined {
            client: 1,
            units: vec![r(2, 4)],
        },
    );
    let a = e.handle(
        0.0,
        Event::ClientJoined {
            client: 2,
            units: vec![],
        },
    );
    assert_eq!(e.hosted_units(), 10, "{a:?}");
    // Everything is hosted now: the first round opens.
    assert!(!offers(&a).is_empty());
    let a = e.handle(
        0.0,
        Event::ClientJoined {
            client: 3,
            units: vec![],
        },
    );
    assert!(matches!(
        &a[0],
        Action::Rejected {
            code: ErrorCode::UnitsInUse,
            ..
        }
    ));
}

#[test]
fn non_private_twin_releases_the_exact_unclipped_mean() {
    // A non-private twin runs the engine with C = inf and z = 0 (Scenario::effective_*).
    let mut c = cfg(Participation::Fresh);
    c.clip_norm = f64::INFINITY;
    c.noise_multiplier = 0.0;
    let (mut e, o) = started(c);
    let cohort: Vec<UnitId> = o.iter().flat_map(|(_, _, u)| u.clone()).collect();
    let vecs = [
        vec![300.0f32, 400.0, 0.0],
        vec![1.0, 2.0, 3.0],
        vec![-1.0, 0.5, 0.25],
        vec![0.0, 0.0, 8.0],
    ];
    let mut all = Vec::new();
    for (u, v) in cohort.iter().zip(&vecs) {
        all.extend(e.handle(
            1.0,
            Event::UpdateArrived {
                client: host(*u),
                round: 1,
                unit: *u,
                update: v.clone(),
            },
        ));
    }
    let c = commit(&all).expect("every cohort unit answered");
    assert_eq!(c.clipped, 0);
    for (i, x) in c.noisy_mean.iter().enumerate() {
        let expected = vecs.iter().map(|v| v[i] as f64).sum::<f64>() / 4.0;
        assert!((*x as f64 - expected).abs() < 1e-4, "{x} vs {expected}");
    }
}
