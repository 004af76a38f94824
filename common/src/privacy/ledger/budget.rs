//! What the ledger remembers between budget checks, so that a long run does not re-account its
//! history on every append.
//!
//! A check asks, for each unit history a record changes, whether epsilon at the ledger's delta
//! stays within the target once the record's event is counted once more. Epsilon grows with the
//! count of a repeated event (composing one more mechanism never lowers it), so for a history
//! *shape* (its grouped events with the count of the event that grows left open) the counts
//! within the target are 1..=N for one N. Per shape this cache keeps the largest count verified
//! within and the smallest verified above, and widens them by probing ahead with growing steps
//! and by bisection once a count above is found: over a run of T appends of one shape it makes
//! O(log T) accountant calls, and refuses at exactly the first count above the target, as
//! accounting every append in full would. Every figure it holds is an accountant result for a
//! complete grouped history, never an estimate.
//!
//! The one assumption is that monotonicity. It holds mathematically (composing one more
//! mechanism never shrinks the privacy curve); the computed figure could only break it where two
//! consecutive counts differ by less than the PLD's floating-point rounding, far below the step
//! one more DP-SGD round adds. `accountant_is_monotone_in_the_count_near_the_budget`
//! (`tests/ledger_incremental.rs`) checks consecutive counts of the DP-SGD event, and
//! `a_long_run_is_refused_exactly_at_the_first_round_above_the_target` the refusal round.

use std::collections::HashMap;

use crate::privacy::PrivacyError;
use crate::privacy::accountant::{self, AccountantKind, Method};
use crate::privacy::params::Delta;

use super::LedgerError;
use super::grouped::{Candidate, EventId, EventTable, Groups};

/// Entries of the epsilon cache before it is emptied (each is a short grouped history and a
/// figure; a run asking for epsilon every step adds one per step).
const MAX_EPSILONS: usize = 4096;
/// Shapes kept before the limits are emptied (a history whose other counts keep changing makes
/// a new shape per append). Forgetting only costs accountant calls, never a wrong answer.
const MAX_LIMITS: usize = 4096;

/// What is known of one shape: counts up to `within` are within the target, from `over` on
/// above it.
#[derive(Clone, Copy, Debug)]
struct Limit {
    /// Largest count verified within the target (0: none yet).
    within: u64,
    /// Smallest count verified above it.
    over: Option<u64>,
    /// How far past the asked count the next probe looks (doubles after each probe that
    /// verifies, up to the asked count itself).
    ahead: u64,
}

/// The caches of one ledger, for its event table and delta only.
#[derive(Debug, Default)]
pub(super) struct BudgetCache {
    /// Worst-unit epsilon of the records as they are (until the next append).
    pub(super) worst: Option<f64>,
    /// Epsilon of complete grouped histories.
    epsilons: HashMap<Groups, (f64, Method)>,
    /// Per shape (a grouped history with the count of one event set to 0) and that event.
    limits: HashMap<(Groups, EventId), Limit>,
}

impl BudgetCache {
    /// A record was appended: the worst figure is stale; the rest are facts about grouped
    /// histories and stay true.
    pub(super) fn appended(&mut self) {
        self.worst = None;
    }

    /// Epsilon (PLD, exact where possible) at `delta` of `groups`, whose ids are `events`'.
    pub(super) fn epsilon(
        &mut self,
        events: &EventTable,
        groups: &Groups,
        delta: Delta,
    ) -> Result<(f64, Method), PrivacyError> {
        if let Some(v) = self.epsilons.get(groups) {
            return Ok(*v);
        }
        let v =
            accountant::unit_epsilon_grouped(&events.resolve(groups), delta, AccountantKind::Pld)?;
        self.remember(groups.clone(), v);
        Ok(v)
    }

    fn remember(&mut self, groups: Groups, v: (f64, Method)) {
        if self.epsilons.len() >= MAX_EPSILONS {
            self.epsilons.clear();
        }
        self.epsilons.insert(groups, v);
    }

    /// Is epsilon at `delta` of `groups` (ids resolved by `cand`) at most `target`? `vary` is
    /// an event of `groups`, the one whose count grew. Nothing about the candidate's event is
    /// kept when it is new to the table: its id would be reused by another event if the record
    /// were not appended.
    pub(super) fn within(
        &mut self,
        groups: &Groups,
        vary: EventId,
        cand: &Candidate<'_>,
        delta: Delta,
        target: f64,
    ) -> Result<bool, LedgerError> {
        let Some(at) = groups.iter().position(|(e, _)| *e == vary) else {
            return Err(LedgerError::InvalidRecord(
                "internal: the growing event is not in the history".into(),
            ));
        };
        let count = groups[at].1;
        let keep = !cand.is_new() || !groups.iter().any(|(e, _)| *e == cand.id);
        let eps_at = |this: &mut Self, n: u64| -> Result<f64, PrivacyError> {
            let mut g = groups.clone();
            g[at].1 = n;
            if let Some(v) = this.epsilons.get(&g) {
                return Ok(v.0);
            }
            let v =
                accountant::unit_epsilon_grouped(&cand.resolve(&g), delta, AccountantKind::Pld)?;
            if keep {
                this.remember(g, v);
            }
            Ok(v.0)
        };
        if !keep {
            return Ok(eps_at(self, count)? <= target);
        }
        let mut shape = groups.clone();
        shape[at].1 = 0;
        let key = (shape, vary);
        let mut limit = self.limits.get(&key).copied().unwrap_or(Limit {
            within: 0,
            over: None,
            ahead: 1,
        });
        let verdict = self.decide(&mut limit, count, eps_at, target);
        if self.limits.len() >= MAX_LIMITS && !self.limits.contains_key(&key) {
            self.limits.clear();
        }
        self.limits.insert(key, limit);
        verdict
    }

    /// Whether `count` is within the target, updating what `limit` knows; `eps_at` accounts
    /// the shape at a count.
    fn decide(
        &mut self,
        limit: &mut Limit,
        count: u64,
        mut eps_at: impl FnMut(&mut Self, u64) -> Result<f64, PrivacyError>,
        target: f64,
    ) -> Result<bool, LedgerError> {
        if count <= limit.within {
            return Ok(true);
        }
        if limit.over.is_some_and(|o| count >= o) {
            return Ok(false);
        }
        // Probe ahead: one verified count covers every smaller one.
        let mut probe = count.saturating_add(limit.ahead - 1);
        if let Some(o) = limit.over {
            probe = probe.min(o - 1);
        }
        if probe > count {
            match eps_at(self, probe) {
                Ok(e) if e <= target => {
                    limit.within = probe;
                    limit.ahead = limit.ahead.saturating_mul(2).min(count).max(1);
                    return Ok(true);
                }
                Ok(_) => {
                    limit.over = Some(probe);
                    // The probe is above: settle `count` itself, then bisect (count, probe)
                    // for the exact boundary, once for this shape.
                    if eps_at(self, count)? > target {
                        limit.over = Some(count);
                        return Ok(false);
                    }
                    let (mut lo, mut hi) = (count, probe);
                    while hi - lo > 1 {
                        let mid = lo + (hi - lo) / 2;
                        match eps_at(self, mid) {
                            Ok(e) if e <= target => lo = mid,
                            Ok(_) => hi = mid,
                            // Both ends are verified; stop narrowing.
                            Err(_) => break,
                        }
                    }
                    limit.within = lo;
                    limit.over = Some(hi);
                    return Ok(true);
                }
                // A probe the accountant cannot do (e.g. a grid too large) says nothing about
                // `count`: account `count` itself, as a full check would, and stop probing.
                Err(_) => limit.ahead = 1,
            }
        }
        let e = eps_at(self, count)?;
        if e <= target {
            limit.within = count;
            limit.ahead = limit.ahead.saturating_mul(2).min(count).max(1);
            Ok(true)
        } else {
            limit.over = Some(count);
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asks every count from 1 on, as a run appending one event per step does, against a
    /// monotone epsilon: the verdict is always `f(count) <= target`, and the calls stay
    /// logarithmic in the run length.
    fn run(f: impl Fn(u64) -> f64, target: f64, steps: u64) -> u64 {
        let mut cache = BudgetCache::default();
        let mut limit = Limit {
            within: 0,
            over: None,
            ahead: 1,
        };
        let calls = std::cell::Cell::new(0u64);
        for count in 1..=steps {
            let verdict = cache
                .decide(
                    &mut limit,
                    count,
                    |_, n| {
                        calls.set(calls.get() + 1);
                        Ok(f(n))
                    },
                    target,
                )
                .unwrap();
            assert_eq!(verdict, f(count) <= target, "count {count}");
            // Retrying a refused count asks nothing new.
            if !verdict {
                let before = calls.get();
                let again = cache.decide(&mut limit, count, |_, n| Ok(f(n)), target);
                assert!(!again.unwrap());
                assert_eq!(calls.get(), before);
            }
        }
        calls.get()
    }

    #[test]
    fn limits_decide_exactly_with_logarithmically_many_calls() {
        let f = |n: u64| (n as f64).sqrt();
        // Never refused in 100,000 steps.
        let calls = run(f, 1e9, 100_000);
        assert!(calls <= 40, "{calls} calls");
        // A boundary inside the run: sqrt(n) <= 100 up to n = 10,000 exactly.
        let calls = run(f, 100.0, 20_000);
        assert!(calls <= 80, "{calls} calls");
        // A boundary at the first count.
        run(f, 0.5, 10);
    }

    #[test]
    fn a_failing_probe_falls_back_to_the_asked_count() {
        let mut cache = BudgetCache::default();
        let mut limit = Limit {
            within: 5,
            over: None,
            ahead: 8,
        };
        // Counts above 6 cannot be accounted; 6 itself can, and is within.
        let eps = |_: &mut BudgetCache, n: u64| {
            if n > 6 {
                Err(PrivacyError::Unsupported("grid too large".into()))
            } else {
                Ok(n as f64)
            }
        };
        assert!(cache.decide(&mut limit, 6, eps, 10.0).unwrap());
        assert_eq!(limit.within, 6);
        // The asked count's own failure is the full check's failure.
        assert!(cache.decide(&mut limit, 7, eps, 10.0).is_err());
    }
}
