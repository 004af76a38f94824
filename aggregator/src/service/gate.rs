//! Admission of new connections, decided from the first packet (quinn's `Incoming`) before the
//! server spends anything on a handshake: a cap on connections in all, a cap on connections that
//! have not authenticated yet, and a cap on those per source address. The counters are live
//! ([`ConnectionStats`]) and end up in the operator's report ([`ConnectionCounts`]).
//!
//! Honest clients are few (one connection per agent process) and authenticate within a round
//! trip or two of their handshake; an attacker can hold an unauthenticated slot for at most
//! [`AUTH_TIMEOUT_S`]. So that an attacker who fills every unauthenticated slot cannot keep
//! honest clients out, a newcomer from an address that holds fewer slots than the busiest address
//! takes the oldest slot of that address (fair share): to starve an honest address the attacker
//! would need as many source addresses as there are slots.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

/// Seconds from a connection's first packet to its verified join (TLS handshake, control
/// stream, join frame, token check). A connection that has not authenticated by then is closed
/// with `close_code::UNAUTHENTICATED`. Honest clients need a few round trips; 5 s leaves room for
/// slow links while an attacker's connection costs the server for 5 s at most.
pub const AUTH_TIMEOUT_S: f64 = 5.0;

/// Default of [`AggregatorOptions::max_connections`](super::AggregatorOptions::max_connections).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// Default of
/// [`AggregatorOptions::max_unauthenticated`](super::AggregatorOptions::max_unauthenticated).
pub const DEFAULT_MAX_UNAUTHENTICATED: usize = 256;

/// Default of [`AggregatorOptions::max_unauthenticated_per_address`](
/// super::AggregatorOptions::max_unauthenticated_per_address).
pub const DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS: usize = 64;

/// Live connection counters of a running aggregator. Create one, keep a clone of the `Arc` and
/// pass it in [`AggregatorOptions::connection_stats`](super::AggregatorOptions) to watch them
/// while the run goes on; the final values are in the operator's report.
#[derive(Debug, Default)]
pub struct ConnectionStats {
    open: AtomicU64,
    unauthenticated: AtomicU64,
    peak_open: AtomicU64,
    peak_unauthenticated: AtomicU64,
    attempts: AtomicU64,
    refused_at_capacity: AtomicU64,
    refused_unauthenticated: AtomicU64,
    evicted: AtomicU64,
    auth_timeouts: AtomicU64,
    duplicates_refused: AtomicU64,
}

impl ConnectionStats {
    /// Connections admitted and not yet ended (authenticated or not).
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections admitted that have not presented a verified join yet.
    pub fn unauthenticated(&self) -> u64 {
        self.unauthenticated.load(Ordering::Relaxed)
    }

    /// The counters now.
    pub fn snapshot(&self) -> ConnectionCounts {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConnectionCounts {
            attempts: get(&self.attempts),
            refused_at_capacity: get(&self.refused_at_capacity),
            refused_unauthenticated: get(&self.refused_unauthenticated),
            evicted: get(&self.evicted),
            auth_timeouts: get(&self.auth_timeouts),
            duplicates_refused: get(&self.duplicates_refused),
            peak_open: get(&self.peak_open),
            peak_unauthenticated: get(&self.peak_unauthenticated),
            open: get(&self.open),
            unauthenticated: get(&self.unauthenticated),
        }
    }

    pub(super) fn auth_timed_out(&self) {
        self.auth_timeouts.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn duplicate_refused(&self) {
        self.duplicates_refused.fetch_add(1, Ordering::Relaxed);
    }
}

/// Connection counts of a run (operator only: how many connections there were says how many
/// clients there are).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ConnectionCounts {
    /// Connection attempts (first packets of new connections) seen.
    pub attempts: u64,
    /// Refused because `max_connections` connections were open.
    pub refused_at_capacity: u64,
    /// Refused because the unauthenticated slots (in all, or of the source address) were taken.
    pub refused_unauthenticated: u64,
    /// Unauthenticated connections closed to give their slot to a newcomer from a less busy
    /// address.
    pub evicted: u64,
    /// Connections closed because they had not authenticated within [`AUTH_TIMEOUT_S`].
    pub auth_timeouts: u64,
    /// Joins refused because the client id was connected already from another agent instance.
    pub duplicates_refused: u64,
    /// Most connections open at once.
    pub peak_open: u64,
    /// Most unauthenticated connections at once.
    pub peak_unauthenticated: u64,
    /// Connections open when the counts were taken (at the end of a run: those still draining).
    pub open: u64,
    /// Unauthenticated connections when the counts were taken.
    pub unauthenticated: u64,
}

/// The caps a [`Gate`] enforces.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    pub(super) max_connections: usize,
    pub(super) max_unauthenticated: usize,
    pub(super) max_unauthenticated_per_address: usize,
}

/// Why a connection attempt was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// `max_connections` are open.
    AtCapacity,
    /// The source address holds its share of unauthenticated slots.
    AddressLimit,
    /// Every unauthenticated slot is taken by addresses no busier than this one.
    Full,
}

/// Source addresses as the caps count them: IPv6 by /64 (one host usually has a whole /64, so
/// per-address caps by single IPv6 addresses would not cap anyone), IPv4 (also mapped into IPv6)
/// by address.
fn address_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let mut seg = v6.segments();
            seg[4..].fill(0);
            IpAddr::V6(seg.into())
        }
        v4 => v4,
    }
}

struct Pending {
    id: u64,
    /// Dropping it tells the connection's task it was evicted.
    _evict: oneshot::Sender<()>,
}

#[derive(Default)]
struct GateState {
    open: usize,
    unauthenticated: usize,
    /// Unauthenticated connections of each source address, oldest first.
    by_address: HashMap<IpAddr, VecDeque<Pending>>,
    next_id: u64,
}

/// Admits or refuses connection attempts (see the module doc).
pub(super) struct Gate {
    limits: Limits,
    state: Mutex<GateState>,
    stats: Arc<ConnectionStats>,
}

/// Counts an admitted connection as open until dropped (at the end of the connection's task).
pub(super) struct OpenSlot {
    gate: Arc<Gate>,
}

/// Counts an admitted connection as unauthenticated until dropped (once its join is verified, or
/// when it is closed). `evicted` resolves (with an error) when its slot was given away.
pub(super) struct AuthSlot {
    gate: Arc<Gate>,
    key: IpAddr,
    id: u64,
    pub(super) evicted: oneshot::Receiver<()>,
}

impl Gate {
    pub(super) fn new(limits: Limits, stats: Arc<ConnectionStats>) -> Arc<Gate> {
        Arc::new(Gate {
            limits,
            state: Mutex::new(GateState::default()),
            stats,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        // The state stays consistent across a panic elsewhere: every update is done under the
        // lock in a few statements that cannot panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides on a new connection from `ip`: admitted (counted as open and unauthenticated) or
    /// refused. May evict the oldest unauthenticated connection of the busiest address.
    pub(super) fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<(OpenSlot, AuthSlot), Refusal> {
        self.stats.attempts.fetch_add(1, Ordering::Relaxed);
        let key = address_key(ip);
        let mut st = self.lock();
        let refused = |r: Refusal| {
            let counter = match r {
                Refusal::AtCapacity => &self.stats.refused_at_capacity,
                Refusal::AddressLimit | Refusal::Full => &self.stats.refused_unauthenticated,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            Err(r)
        };
        if st.open >= self.limits.max_connections.max(1) {
            return refused(Refusal::AtCapacity);
        }
        let mine = st.by_address.get(&key).map_or(0, VecDeque::len);
        if mine >= self.limits.max_unauthenticated_per_address.max(1) {
            return refused(Refusal::AddressLimit);
        }
        if st.unauthenticated >= self.limits.max_unauthenticated.max(1) {
            // Fair share: the busiest address gives up its oldest slot, if it holds at least two
            // more than the newcomer's address (so two addresses never take slots back and forth).
            let busiest = st
                .by_address
                .iter()
                .max_by_key(|(_, q)| q.len())
                .map(|(k, q)| (*k, q.len()));
            match busiest {
                Some((victim, n)) if n >= mine + 2 => {
                    let q = st.by_address.get_mut(&victim);
                    let gone = q.and_then(|q| q.pop_front());
                    if st.by_address.get(&victim).is_some_and(VecDeque::is_empty) {
                        st.by_address.remove(&victim);
                    }
                    if gone.is_some() {
                        st.unauthenticated -= 1;
                        self.stats.unauthenticated.fetch_sub(1, Ordering::Relaxed);
                        self.stats.evicted.fetch_add(1, Ordering::Relaxed);
                    }
                }
                _ => return refused(Refusal::Full),
            }
        }
        let id = st.next_id;
        st.next_id += 1;
        let (tx, rx) = oneshot::channel();
        st.by_address
            .entry(key)
            .or_default()
            .push_back(Pending { id, _evict: tx });
        st.unauthenticated += 1;
        st.open += 1;
        let (open, unauth) = (st.open as u64, st.unauthenticated as u64);
        drop(st);
        self.stats.open.store(open, Ordering::Relaxed);
        self.stats.unauthenticated.store(unauth, Ordering::Relaxed);
        self.stats.peak_open.fetch_max(open, Ordering::Relaxed);
        self.stats
            .peak_unauthenticated
            .fetch_max(unauth, Ordering::Relaxed);
        Ok((
            OpenSlot { gate: self.clone() },
            AuthSlot {
                gate: self.clone(),
                key,
                id,
                evicted: rx,
            },
        ))
    }
}

impl Drop for OpenSlot {
    fn drop(&mut self) {
        let mut st = self.gate.lock();
        st.open = st.open.saturating_sub(1);
        self.gate
            .stats
            .open
            .store(st.open as u64, Ordering::Relaxed);
    }
}

impl Drop for AuthSlot {
    fn drop(&mut self) {
        let mut st = self.gate.lock();
        let Some(q) = st.by_address.get_mut(&self.key) else {
            return;
        };
        // Not found: it was evicted, and uncounted then.
        let Some(pos) = q.iter().position(|p| p.id == self.id) else {
            return;
        };
        q.remove(pos);
        if q.is_empty() {
            st.by_address.remove(&self.key);
        }
        st.unauthenticated -= 1;
        self.gate
            .stats
            .unauthenticated
            .store(st.unauthenticated as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(max: usize, unauth: usize, per: usize) -> Arc<Gate> {
        Gate::new(
            Limits {
                max_connections: max,
                max_unauthenticated: unauth,
                max_unauthenticated_per_address: per,
            },
            Arc::new(ConnectionStats::default()),
        )
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn one_address_gets_its_share_and_no_more() {
        let g = gate(100, 10, 3);
        let held: Vec<_> = (0..3).map(|_| g.admit(ip("10.0.0.1")).unwrap()).collect();
        assert_eq!(g.admit(ip("10.0.0.1")).err(), Some(Refusal::AddressLimit));
        // IPv4 mapped into IPv6 is the same address.
        assert_eq!(
            g.admit(ip("::ffff:10.0.0.1")).err(),
            Some(Refusal::AddressLimit)
        );
        assert!(g.admit(ip("10.0.0.2")).is_ok());
        drop(held);
        assert!(g.admit(ip("10.0.0.1")).is_ok());
        let s = g.stats.snapshot();
        assert_eq!(s.refused_unauthenticated, 2);
        assert_eq!(s.peak_unauthenticated, 4);
        // Everything admitted above was dropped again.
        assert_eq!((s.open, s.unauthenticated), (0, 0));
    }

    #[test]
    fn ipv6_addresses_count_by_their_64_bit_prefix() {
        let g = gate(100, 10, 2);
        let _a = g.admit(ip("2001:db8:1:2::1")).unwrap();
        let _b = g.admit(ip("2001:db8:1:2:ffff::7")).unwrap();
        assert_eq!(
            g.admit(ip("2001:db8:1:2::99")).err(),
            Some(Refusal::AddressLimit)
        );
        assert!(g.admit(ip("2001:db8:1:3::1")).is_ok());
    }

    #[test]
    fn a_newcomer_takes_the_oldest_slot_of_the_busiest_address_when_full() {
        let g = gate(100, 4, 8);
        let mut attacker: Vec<_> = (0..4).map(|_| g.admit(ip("10.0.0.66")).unwrap()).collect();
        // Full, and the attacker's address is refused more.
        assert_eq!(g.admit(ip("10.0.0.66")).err(), Some(Refusal::Full));
        // An honest address gets in: the attacker's oldest connection is told to go.
        let (_open, mut honest) = g.admit(ip("10.0.0.1")).unwrap();
        assert!(matches!(
            attacker[0].1.evicted.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
        assert!(matches!(
            attacker[1].1.evicted.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        ));
        assert!(matches!(
            honest.evicted.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        ));
        let s = g.stats.snapshot();
        assert_eq!((s.evicted, s.unauthenticated, s.open), (1, 4, 5));
        // The evicted connection ends: its slots were already given back.
        attacker.remove(0);
        let s = g.stats.snapshot();
        assert_eq!((s.unauthenticated, s.open), (4, 4));
        // Two addresses with 3 and 1 slots: a third address takes from the busiest (3 >= 0 + 2);
        // then 2, 1, 1: a newcomer from the address with 1 is refused (2 < 1 + 2).
        let _c = g.admit(ip("10.0.0.3")).unwrap();
        assert_eq!(g.stats.snapshot().evicted, 2);
        assert_eq!(g.admit(ip("10.0.0.1")).err(), Some(Refusal::Full));
    }

    #[test]
    fn the_total_cap_counts_authenticated_connections_too() {
        let g = gate(3, 10, 10);
        let mut held = Vec::new();
        for _ in 0..3 {
            let (open, auth) = g.admit(ip("10.0.0.1")).unwrap();
            // Authenticated: the unauthenticated slot goes, the connection stays open.
            drop(auth);
            held.push(open);
        }
        assert_eq!(g.stats.snapshot().unauthenticated, 0);
        assert_eq!(g.admit(ip("10.0.0.2")).err(), Some(Refusal::AtCapacity));
        held.pop();
        assert!(g.admit(ip("10.0.0.2")).is_ok());
        assert_eq!(g.stats.snapshot().refused_at_capacity, 1);
    }
}
