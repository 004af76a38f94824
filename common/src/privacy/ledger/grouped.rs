//! The ledger's records folded into grouped histories as they are appended, so that accounting
//! a unit never walks the records again.
//!
//! A unit is charged with every record the aggregator sampled (the *shared* events, the same for
//! every unit) plus the records it took part in that the aggregator did not sample (its *own*
//! events). The accountant
//! ([`unit_epsilon`](crate::privacy::accountant::unit_epsilon)) depends only on the grouped form
//! of that list: distinct events with their counts, in order of first appearance. Shared events
//! come first, so a unit's grouped list is [`merge`]`(shared, own)` of the two grouped lists
//! kept here: the shared one (one per ledger) and the own ones, interned (units with the same own
//! history share one entry; a sampled DP-SGD run has a single, empty one). Appending a record is
//! O(its units), whatever the length of the history.

use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use crate::privacy::DpEvent;

use super::RoundRecord;

/// Index of a distinct event in an [`EventTable`].
pub(super) type EventId = u32;

/// A grouped history: (event, count >= 1) pairs with distinct events, in order of first
/// appearance.
pub(super) type Groups = Vec<(EventId, u64)>;

/// Index of an own history in a [`GroupedHistories`]; 0 is the empty history.
pub(super) type HistoryId = usize;

/// Distinct events, each stored once. Two events are the same exactly when they are `==`, as
/// [`group_counts`](crate::privacy::accountant::group_counts) decides, so the grouped lists
/// here are the ones it would build.
#[derive(Clone, Debug, Default)]
pub(super) struct EventTable {
    events: Vec<DpEvent>,
    /// Structural hash -> the ids with that hash (compared with `==`).
    by_hash: HashMap<u64, Vec<EventId>>,
}

impl EventTable {
    /// The id of `event` if it was seen.
    pub(super) fn find(&self, event: &DpEvent) -> Option<EventId> {
        self.by_hash
            .get(&event_hash(event))?
            .iter()
            .copied()
            .find(|&id| self.events[id as usize] == *event)
    }

    /// The id of `event`, added if new.
    pub(super) fn intern(&mut self, event: &DpEvent) -> EventId {
        if let Some(id) = self.find(event) {
            return id;
        }
        let id = self.events.len() as EventId;
        self.events.push(event.clone());
        self.by_hash.entry(event_hash(event)).or_default().push(id);
        id
    }

    /// The id `event` would get, and the event itself, without adding it: a candidate record
    /// is accounted before it is appended.
    pub(super) fn peek<'a>(&'a self, event: &'a DpEvent) -> Candidate<'a> {
        match self.find(event) {
            Some(id) => Candidate {
                table: self,
                id,
                extra: None,
            },
            None => Candidate {
                table: self,
                id: self.events.len() as EventId,
                extra: Some(event),
            },
        }
    }

    pub(super) fn get(&self, id: EventId) -> &DpEvent {
        &self.events[id as usize]
    }

    /// `groups` as the accountant takes them.
    pub(super) fn resolve(&self, groups: &[(EventId, u64)]) -> Vec<(&DpEvent, u64)> {
        groups.iter().map(|&(id, n)| (self.get(id), n)).collect()
    }
}

/// A candidate record's event: its id in the table, or the next free id when it is new.
pub(super) struct Candidate<'a> {
    table: &'a EventTable,
    pub(super) id: EventId,
    extra: Option<&'a DpEvent>,
}

impl<'a> Candidate<'a> {
    /// True when the event is not in the table yet.
    pub(super) fn is_new(&self) -> bool {
        self.extra.is_some()
    }

    /// Any id of the table, or the candidate's.
    pub(super) fn get(&self, id: EventId) -> &'a DpEvent {
        match self.extra {
            Some(e) if id == self.id => e,
            _ => self.table.get(id),
        }
    }

    pub(super) fn resolve(&self, groups: &[(EventId, u64)]) -> Vec<(&'a DpEvent, u64)> {
        groups.iter().map(|&(id, n)| (self.get(id), n)).collect()
    }
}

/// A hash of the event tree consistent with `==` (+0.0 and -0.0 hash alike).
fn event_hash(event: &DpEvent) -> u64 {
    fn float(x: f64, h: &mut DefaultHasher) {
        let x = if x == 0.0 { 0.0 } else { x };
        x.to_bits().hash(h);
    }
    fn walk(e: &DpEvent, h: &mut DefaultHasher) {
        std::mem::discriminant(e).hash(h);
        match e {
            DpEvent::Gaussian { noise_multiplier } => float(*noise_multiplier, h),
            DpEvent::DiscreteGaussian {
                sigma,
                l2_sensitivity,
            } => {
                float(*sigma, h);
                float(*l2_sensitivity, h);
            }
            DpEvent::Laplace { scale } => float(*scale, h),
            DpEvent::EpsilonDelta { epsilon, delta } => {
                float(*epsilon, h);
                float(*delta, h);
            }
            DpEvent::PoissonSampled {
                sampling_rate,
                event,
            } => {
                float(*sampling_rate, h);
                walk(event, h);
            }
            DpEvent::SelfComposed { event, count } => {
                count.hash(h);
                walk(event, h);
            }
            DpEvent::Composed { events } => {
                events.len().hash(h);
                for e in events {
                    walk(e, h);
                }
            }
        }
    }
    let mut h = DefaultHasher::new();
    walk(event, &mut h);
    h.finish()
}

/// `groups` with one more `event`.
pub(super) fn push(groups: &mut Groups, event: EventId) {
    match groups.iter_mut().find(|(e, _)| *e == event) {
        Some((_, n)) => *n += 1,
        None => groups.push((event, 1)),
    }
}

/// The grouped form of `first` followed by `then`: what grouping the concatenated event lists
/// gives (distinct events in order of first appearance, counts added).
pub(super) fn merge(first: &[(EventId, u64)], then: &[(EventId, u64)]) -> Groups {
    let mut out = first.to_vec();
    for &(e, n) in then {
        match out.iter_mut().find(|(x, _)| *x == e) {
            Some((_, m)) => *m += n,
            None => out.push((e, n)),
        }
    }
    out
}

#[derive(Clone, Debug)]
struct History {
    groups: Groups,
    /// Units whose own history this is (unused for the empty history, which always counts: a
    /// unit that never took part is charged with the shared events).
    members: u64,
}

/// The records of a ledger (or of one phase of it), grouped: the shared events and every unit's
/// own history.
#[derive(Clone, Debug)]
pub(super) struct GroupedHistories {
    pub(super) events: EventTable,
    /// Events of the records the aggregator sampled, grouped.
    shared: Groups,
    histories: Vec<History>,
    ids: HashMap<Groups, HistoryId>,
    /// (history, event) -> the history with that event added: moving a unit is O(1).
    next: HashMap<(HistoryId, EventId), HistoryId>,
    /// Units with a non-empty own history (no entry: the empty one).
    unit_history: HashMap<u64, HistoryId>,
}

impl Default for GroupedHistories {
    fn default() -> Self {
        let empty = History {
            groups: Vec::new(),
            members: 0,
        };
        Self {
            events: EventTable::default(),
            shared: Vec::new(),
            histories: vec![empty],
            ids: HashMap::from([(Vec::new(), 0)]),
            next: HashMap::new(),
            unit_history: HashMap::new(),
        }
    }
}

impl GroupedHistories {
    /// `records` in order, keeping those `keep` accepts.
    pub(super) fn from_records<'a>(
        records: impl IntoIterator<Item = &'a RoundRecord>,
        keep: impl Fn(&RoundRecord) -> bool,
    ) -> Self {
        let mut g = Self::default();
        for r in records {
            if keep(r) {
                g.add(r);
            }
        }
        g
    }

    /// Folds `record` in: a sampled record's event is charged to everybody, an un-sampled one
    /// to its units.
    pub(super) fn add(&mut self, record: &RoundRecord) {
        let event = self.events.intern(&record.event);
        if record.sampled_by_aggregator {
            push(&mut self.shared, event);
            return;
        }
        for &u in &record.units {
            let from = self.unit_history.get(&u).copied().unwrap_or(0);
            let to = self.child(from, event);
            self.histories[from].members = self.histories[from].members.saturating_sub(1);
            self.histories[to].members += 1;
            self.unit_history.insert(u, to);
        }
    }

    fn child(&mut self, from: HistoryId, event: EventId) -> HistoryId {
        if let Some(&to) = self.next.get(&(from, event)) {
            return to;
        }
        let mut groups = self.histories[from].groups.clone();
        push(&mut groups, event);
        let to = match self.ids.get(&groups) {
            Some(&id) => id,
            None => {
                let id = self.histories.len();
                self.histories.push(History {
                    groups: groups.clone(),
                    members: 0,
                });
                self.ids.insert(groups, id);
                id
            }
        };
        self.next.insert((from, event), to);
        to
    }

    pub(super) fn shared(&self) -> &Groups {
        &self.shared
    }

    /// The own history of `unit` (0, the empty one, for a unit without un-sampled records).
    pub(super) fn history_of(&self, unit: u64) -> HistoryId {
        self.unit_history.get(&unit).copied().unwrap_or(0)
    }

    pub(super) fn own(&self, h: HistoryId) -> &Groups {
        &self.histories[h].groups
    }

    pub(super) fn members(&self, h: HistoryId) -> u64 {
        self.histories[h].members
    }

    /// Histories some unit has, the empty one always included.
    pub(super) fn live(&self) -> impl Iterator<Item = HistoryId> + '_ {
        (0..self.histories.len()).filter(|&h| h == 0 || self.histories[h].members > 0)
    }

    /// Everything a unit with own history `h` is charged with, grouped.
    pub(super) fn combined(&self, h: HistoryId) -> Groups {
        merge(&self.shared, &self.histories[h].groups)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::privacy::accountant::group_counts;

    fn g(z: f64) -> DpEvent {
        DpEvent::Gaussian {
            noise_multiplier: z,
        }
    }

    #[test]
    fn interning_follows_equality() {
        let mut t = EventTable::default();
        let a = t.intern(&g(1.0));
        let b = t.intern(&DpEvent::PoissonSampled {
            sampling_rate: 0.5,
            event: Box::new(g(1.0)),
        });
        assert_ne!(a, b);
        assert_eq!(t.intern(&g(1.0)), a);
        // -0.0 == 0.0, so they are one event, as grouping decides.
        let z0 = t.intern(&DpEvent::EpsilonDelta {
            epsilon: 0.0,
            delta: 0.0,
        });
        let z1 = t.intern(&DpEvent::EpsilonDelta {
            epsilon: -0.0,
            delta: 0.0,
        });
        assert_eq!(z0, z1);
        assert_eq!(t.peek(&g(2.0)).id, 3);
        assert_eq!(t.peek(&g(1.0)).id, a);
    }

    #[test]
    fn merged_groups_are_the_grouping_of_the_concatenation() {
        let events = [g(1.0), g(2.0), g(3.0), g(4.0)];
        let mut t = EventTable::default();
        let ids: Vec<EventId> = events.iter().map(|e| t.intern(e)).collect();
        let first = [0usize, 1, 0, 0, 2];
        let then = [3usize, 1, 3, 2, 0];
        let mut a = Groups::new();
        first.iter().for_each(|&i| push(&mut a, ids[i]));
        let mut b = Groups::new();
        then.iter().for_each(|&i| push(&mut b, ids[i]));
        let flat: Vec<DpEvent> = first
            .iter()
            .chain(&then)
            .map(|&i| events[i].clone())
            .collect();
        let expected = group_counts(&flat);
        let merged = merge(&a, &b);
        let got = t.resolve(&merged);
        assert_eq!(got, expected);
    }

    #[test]
    fn units_move_between_shared_histories() {
        let mut h = GroupedHistories::default();
        let rec = |units: Vec<u64>, z: f64, sampled: bool| RoundRecord {
            round: 0,
            phase: "training".into(),
            event: g(z),
            sampled_by_aggregator: sampled,
            units,
            clip_norm: None,
            expected_cohort: None,
            noise_source: crate::privacy::noise::NoiseSource::Os,
            unix_time_s: 0.0,
        };
        h.add(&rec(vec![1, 2, 3], 2.0, false));
        h.add(&rec(vec![1, 2], 3.0, true));
        h.add(&rec(vec![3], 3.0, false));
        assert_eq!(h.history_of(1), h.history_of(2));
        assert_ne!(h.history_of(1), h.history_of(3));
        assert_eq!(h.history_of(9), 0);
        assert_eq!(h.members(h.history_of(1)), 2);
        // Live: the empty history, units 1 and 2's, unit 3's.
        assert_eq!(h.live().count(), 3);
        h.add(&rec(vec![1, 2], 5.0, false));
        // Units 1 and 2 left their history together: it is no longer live.
        assert_eq!(h.live().count(), 3);
        assert_eq!(h.members(h.history_of(1)), 2);
        let three = h.combined(h.history_of(3));
        assert_eq!(
            h.events.resolve(&three),
            vec![(&g(3.0), 2), (&g(2.0), 1)],
            "shared first, then own"
        );
    }
}
