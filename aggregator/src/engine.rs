//! The round engine: a sans-IO state machine (DESIGN §1).
//!
//! Events go in ([`Event`]: a client joined or left, an update arrived, time passed, the driver
//! committed a round), actions come out ([`Action`]: send an offer, acknowledge or reject an
//! update, commit a round, abandon a round, finish). The engine never touches a socket, a file or
//! the clock: the caller passes the time (seconds on any monotonic clock) with every event. The
//! QUIC service ([`crate::service`]) drives it; tests feed it seeded event logs and replay runs
//! exactly.
//!
//! Privacy rules enforced here (DESIGN §3):
//! - every update is re-clipped to C ([`clip_l2`]); non-finite or wrong-length vectors are
//!   rejected; a unit contributes at most once per round, and only if it is in the cohort and
//!   hosted by the client that sends it;
//! - the cohort is drawn by the engine: `fresh` picks units that never contributed to a released
//!   round (across restarts: the caller seeds [`Resume::used_units`] from the ledger); `sampled`
//!   draws a Poisson sample of the whole population with rate q;
//! - the noisy aggregate is `(sum of clipped updates + N(0, (zC)^2 I)) / expected_cohort`, where
//!   the denominator is the fixed public expected cohort size, never the realised count;
//! - a round with fewer than `quorum` accepted updates at its deadline is abandoned: nothing
//!   leaves the engine, so nothing needs accounting (the noise that was never drawn or released
//!   protects nobody and costs nothing);
//! - a released round is handed to the driver as [`Action::Commit`]: the driver appends the
//!   ledger record (fsync) and only then applies and publishes the model, and tells the engine
//!   with [`Event::Committed`]. Offers for the next round are only emitted after that, so no
//!   model can leave before its ledger record.
//!
//! Updates are accumulated as they arrive into one f64 sum of the model's length: memory grows
//! with the model size, not with the number of clients.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use fedrl_common::privacy::clipping::clip_l2;
use fedrl_common::privacy::ledger::{Participation, RoundRecord};
use fedrl_common::privacy::noise::GaussianNoise;
use fedrl_common::protocol::{ErrorCode, RoundSpec, UnitId, UnitRange};
use rand::rngs::ChaCha20Rng;
use rand::{RngExt, SeedableRng};

/// A connection (session) id assigned by the driver.
pub type ClientId = u64;

/// The fixed parameters of a run.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Model and update length (number of f32).
    pub dim: usize,
    /// Last round index to attempt (rounds are numbered from 1).
    pub rounds: u64,
    /// The population: units `0..population`.
    pub population: u64,
    pub participation: Participation,
    /// Units per round under `fresh`.
    pub cohort_size: u64,
    /// The fixed public denominator.
    pub expected_cohort: f64,
    /// Minimum accepted updates for a release.
    pub quorum: u64,
    /// Seconds from offer to close.
    pub deadline_s: f64,
    /// Seconds to wait for the whole population before opening a round with fewer units.
    pub start_timeout_s: f64,
    /// C.
    pub clip_norm: f64,
    /// z.
    pub noise_multiplier: f64,
    /// `Some`: seeded (reproducible, not private) noise and cohorts.
    pub seed: Option<u64>,
    /// The task specification sent with every offer (JSON).
    pub task_json: String,
}

/// Where a restarted engine continues from (read from the ledger and the checkpoint).
#[derive(Clone, Debug, Default)]
pub struct Resume {
    /// The first round index to attempt.
    pub next_round: u64,
    /// Units that contributed to a released round (enforces `fresh` across restarts).
    pub used_units: HashSet<UnitId>,
    /// Released rounds so far.
    pub rounds_completed: u64,
    /// Abandoned rounds so far.
    pub rounds_abandoned: u64,
}

/// Inputs of the engine.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// An authenticated client hosts `units`.
    ClientJoined {
        client: ClientId,
        units: Vec<UnitRange>,
    },
    /// The client's connection is gone.
    ClientLeft { client: ClientId },
    /// A unit's update (already decoded; the engine validates and clips it).
    UpdateArrived {
        client: ClientId,
        round: u64,
        unit: UnitId,
        update: Vec<f32>,
    },
    /// Time passed (deadlines, start timeout).
    Tick,
    /// The driver appended the ledger record of `round` and released the model.
    Committed { round: u64 },
    /// The driver could not commit `round` (e.g. budget exhausted, ledger I/O): nothing was
    /// released and the run stops.
    CommitFailed { round: u64, reason: String },
}

/// What a commit carries.
#[derive(Clone, Debug, PartialEq)]
pub struct Commit {
    /// The ledger record (`unix_time_s` is left 0 for the driver to fill in).
    pub record: RoundRecord,
    /// `(sum of clipped updates + noise) / expected_cohort`, length `dim`.
    pub noisy_mean: Vec<f32>,
    /// Accepted updates.
    pub accepted: u64,
    /// Of which the server had to clip.
    pub clipped: u64,
    /// Units offered.
    pub offered: u64,
    /// Updates rejected this round.
    pub rejected: u64,
}

/// Outputs of the engine, to be executed in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send the current model with this spec to `client` for `units`.
    SendOffer {
        client: ClientId,
        spec: RoundSpec,
        units: Vec<UnitId>,
    },
    /// The update was accepted into the sum.
    Accepted {
        client: ClientId,
        round: u64,
        unit: UnitId,
        norm: f64,
        clipped: bool,
    },
    /// Refuse something from `client` (an update or a join). The connection stays open unless
    /// `code` is [`ErrorCode::UnitsInUse`] (a refused join).
    Rejected {
        client: ClientId,
        round: Option<u64>,
        unit: Option<UnitId>,
        code: ErrorCode,
        message: String,
    },
    /// Append `record` to the ledger (fsync), then apply `noisy_mean` to the model and release
    /// it, then feed [`Event::Committed`] (or [`Event::CommitFailed`]).
    Commit(Box<Commit>),
    /// The round closed below quorum; nothing is released or recorded.
    Abandoned {
        round: u64,
        accepted: u64,
        quorum: u64,
        offered: u64,
        reason: String,
    },
    /// The run is over.
    Finished { reason: String },
}

#[derive(Debug)]
struct OpenRound {
    round: u64,
    deadline: f64,
    spec: RoundSpec,
    /// Cohort units -> true once resolved (contributed, rejected, or host gone).
    cohort: BTreeMap<UnitId, bool>,
    contributed: BTreeSet<UnitId>,
    sum: Vec<f64>,
    clipped: u64,
    rejected: u64,
    sampling_rate: Option<f64>,
}

#[derive(Debug)]
enum Phase {
    /// Waiting to open the next round (since the given time).
    Waiting {
        since: Option<f64>,
    },
    Open(OpenRound),
    /// A commit is with the driver.
    Committing {
        round: u64,
        units: Vec<UnitId>,
    },
    Finished,
}

/// The round engine. See the module documentation.
pub struct Engine {
    cfg: EngineConfig,
    phase: Phase,
    next_round: u64,
    used: HashSet<UnitId>,
    /// start -> (end, client): who hosts which units.
    hosted: BTreeMap<UnitId, (UnitId, ClientId)>,
    clients: HashMap<ClientId, Vec<UnitRange>>,
    rounds_completed: u64,
    rounds_abandoned: u64,
    /// Whether this process opened a round yet (the first waits for the whole population).
    opened_any: bool,
}

/// The seed of round `round`'s noise in a seeded run (public so tests can reproduce a release).
pub fn round_noise_seed(seed: u64, round: u64) -> u64 {
    splitmix64(seed ^ splitmix64(round.wrapping_add(0x006e_6f69_7365)))
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Engine {
    /// A new engine; `resume` is `Resume::default()` for a fresh run.
    pub fn new(cfg: EngineConfig, resume: Resume) -> Self {
        Engine {
            next_round: resume.next_round.max(1),
            used: resume.used_units,
            rounds_completed: resume.rounds_completed,
            rounds_abandoned: resume.rounds_abandoned,
            cfg,
            phase: Phase::Waiting { since: None },
            hosted: BTreeMap::new(),
            clients: HashMap::new(),
            opened_any: false,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }
    /// Released rounds so far (including before a restart).
    pub fn rounds_completed(&self) -> u64 {
        self.rounds_completed
    }
    /// Abandoned rounds so far.
    pub fn rounds_abandoned(&self) -> u64 {
        self.rounds_abandoned
    }
    /// The round that is open, if any.
    pub fn open_round(&self) -> Option<u64> {
        match &self.phase {
            Phase::Open(o) => Some(o.round),
            _ => None,
        }
    }
    pub fn is_finished(&self) -> bool {
        matches!(self.phase, Phase::Finished)
    }
    /// Number of units hosted by connected clients.
    pub fn hosted_units(&self) -> u64 {
        self.hosted.iter().map(|(s, (e, _))| e - s).sum()
    }

    /// Feeds one event at time `now` (seconds) and returns the actions to execute, in order.
    pub fn handle(&mut self, now: f64, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::ClientJoined { client, units } => self.on_join(now, client, units, &mut out),
            Event::ClientLeft { client } => self.on_leave(now, client, &mut out),
            Event::UpdateArrived {
                client,
                round,
                unit,
                mut update,
            } => self.on_update(now, client, round, unit, &mut update, &mut out),
            Event::Tick => self.on_tick(now, &mut out),
            Event::Committed { round } => self.on_committed(now, round, &mut out),
            Event::CommitFailed { round, reason } => {
                if matches!(self.phase, Phase::Committing { round: r, .. } if r == round) {
                    self.phase = Phase::Finished;
                    out.push(Action::Finished {
                        reason: format!("round {round} not released: {reason}"),
                    });
                }
            }
        }
        out
    }

    /// The same as [`Event::UpdateArrived`], for an update in a caller-owned buffer (the service
    /// reuses its receive buffers instead of allocating one per update). `update` is clipped in
    /// place.
    pub fn handle_update(
        &mut self,
        now: f64,
        client: ClientId,
        round: u64,
        unit: UnitId,
        update: &mut [f32],
    ) -> Vec<Action> {
        let mut out = Vec::new();
        self.on_update(now, client, round, unit, update, &mut out);
        out
    }

    fn host_of(&self, unit: UnitId) -> Option<ClientId> {
        let (_, (end, client)) = self.hosted.range(..=unit).next_back()?;
        (unit < *end).then_some(*client)
    }

    fn on_join(
        &mut self,
        now: f64,
        client: ClientId,
        units: Vec<UnitRange>,
        out: &mut Vec<Action>,
    ) {
        let reject = |message: String| Action::Rejected {
            client,
            round: None,
            unit: None,
            code: ErrorCode::UnitsInUse,
            message,
        };
        if self.clients.contains_key(&client) {
            out.push(reject(format!("session {client} already joined")));
            return;
        }
        let mut sorted = units.clone();
        if sorted.is_empty() {
            // No units named: host every unit nobody else hosts.
            let mut next = 0;
            for (s, (e, _)) in &self.hosted {
                if *s > next {
                    sorted.push(UnitRange {
                        start: next,
                        end: *s,
                    });
                }
                next = next.max(*e);
            }
            if next < self.cfg.population {
                sorted.push(UnitRange {
                    start: next,
                    end: self.cfg.population,
                });
            }
            if sorted.is_empty() {
                out.push(reject(
                    "every unit is already hosted by another client".into(),
                ));
                return;
            }
        }
        sorted.sort_by_key(|r| r.start);
        for (i, r) in sorted.iter().enumerate() {
            if r.is_empty() || r.end > self.cfg.population {
                out.push(reject(format!(
                    "unit range {r} is empty or outside the population 0..{}",
                    self.cfg.population
                )));
                return;
            }
            if i > 0 && sorted[i - 1].end > r.start {
                out.push(reject(format!(
                    "unit ranges {} and {r} overlap",
                    sorted[i - 1]
                )));
                return;
            }
            let before = self.hosted.range(..r.end).next_back();
            if let Some((s, (e, other))) = before
                && *e > r.start
            {
                out.push(reject(format!(
                    "units {r} overlap units {s}..{e} hosted by another client (session {other})"
                )));
                return;
            }
        }
        for r in &sorted {
            self.hosted.insert(r.start, (r.end, client));
        }
        self.clients.insert(client, sorted.clone());
        match &mut self.phase {
            Phase::Waiting { since } => {
                since.get_or_insert(now);
                self.try_open(now, out);
            }
            Phase::Open(open) => {
                // A (re)joining client gets the offer for its cohort units that did not
                // contribute yet, so a reconnect within the deadline can still count.
                let mine: Vec<UnitId> = open
                    .cohort
                    .iter_mut()
                    .filter(|(u, _)| sorted.iter().any(|r| r.contains(**u)))
                    .filter(|(u, _)| !open.contributed.contains(*u))
                    .map(|(u, done)| {
                        *done = false;
                        *u
                    })
                    .collect();
                if !mine.is_empty() {
                    let mut spec = open.spec.clone();
                    spec.deadline_s = (open.deadline - now).max(0.0);
                    out.push(Action::SendOffer {
                        client,
                        spec,
                        units: mine,
                    });
                }
            }
            _ => {}
        }
    }

    fn on_leave(&mut self, now: f64, client: ClientId, out: &mut Vec<Action>) {
        let Some(ranges) = self.clients.remove(&client) else {
            return;
        };
        for r in &ranges {
            self.hosted.remove(&r.start);
        }
        if let Phase::Open(open) = &mut self.phase {
            for (u, done) in open.cohort.iter_mut() {
                if ranges.iter().any(|r| r.contains(*u)) {
                    *done = true;
                }
            }
            self.maybe_close(now, out);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_update(
        &mut self,
        now: f64,
        client: ClientId,
        round: u64,
        unit: UnitId,
        update: &mut [f32],
        out: &mut Vec<Action>,
    ) {
        let host = self.host_of(unit);
        let dim = self.cfg.dim;
        let clip_norm = self.cfg.clip_norm;
        let reject = |code, message: String| Action::Rejected {
            client,
            round: Some(round),
            unit: Some(unit),
            code,
            message,
        };
        let open = match &mut self.phase {
            Phase::Open(o) if o.round == round => o,
            Phase::Open(o) => {
                let msg = if round < o.round {
                    format!(
                        "round {round} is closed (round {} is open); update discarded",
                        o.round
                    )
                } else {
                    format!(
                        "round {round} is not open (round {} is); update discarded",
                        o.round
                    )
                };
                out.push(reject(ErrorCode::LateUpdate, msg));
                return;
            }
            _ => {
                out.push(reject(
                    ErrorCode::LateUpdate,
                    format!("round {round} is not open; update discarded"),
                ));
                return;
            }
        };
        if host != Some(client) || !open.cohort.contains_key(&unit) {
            open.rejected += 1;
            out.push(reject(
                ErrorCode::NotInCohort,
                format!("unit {unit} is not in round {round}'s cohort for this client"),
            ));
            return;
        }
        if open.contributed.contains(&unit) {
            open.rejected += 1;
            out.push(reject(
                ErrorCode::DuplicateUnit,
                format!("unit {unit} already contributed to round {round}; duplicate discarded"),
            ));
            return;
        }
        let resolve = |open: &mut OpenRound| {
            if let Some(done) = open.cohort.get_mut(&unit) {
                *done = true;
            }
            open.rejected += 1;
        };
        if update.len() != dim {
            resolve(open);
            out.push(reject(
                ErrorCode::WrongLength,
                format!(
                    "update of unit {unit} has {} values, the model has {dim}",
                    update.len()
                ),
            ));
            self.maybe_close(now, out);
            return;
        }
        if let Some(i) = first_non_finite(update) {
            resolve(open);
            out.push(reject(
                ErrorCode::NonFinite,
                format!(
                    "update of unit {unit} has a non-finite value ({}) at index {i}",
                    update[i]
                ),
            ));
            self.maybe_close(now, out);
            return;
        }
        let clipped = clip_l2(update, clip_norm);
        for (s, x) in open.sum.iter_mut().zip(update.iter()) {
            *s += *x as f64;
        }
        open.contributed.insert(unit);
        if let Some(done) = open.cohort.get_mut(&unit) {
            *done = true;
        }
        if clipped.was_clipped() {
            open.clipped += 1;
        }
        out.push(Action::Accepted {
            client,
            round,
            unit,
            norm: clipped.norm,
            clipped: clipped.was_clipped(),
        });
        self.maybe_close(now, out);
    }

    fn on_tick(&mut self, now: f64, out: &mut Vec<Action>) {
        match &self.phase {
            Phase::Waiting { .. } => self.try_open(now, out),
            Phase::Open(_) => self.maybe_close(now, out),
            _ => {}
        }
    }

    fn on_committed(&mut self, now: f64, round: u64, out: &mut Vec<Action>) {
        let Phase::Committing { round: r, units } = &self.phase else {
            return;
        };
        if *r != round {
            return;
        }
        if matches!(self.cfg.participation, Participation::Fresh) {
            self.used.extend(units.iter().copied());
        }
        self.rounds_completed += 1;
        self.phase = Phase::Waiting { since: Some(now) };
        self.try_open(now, out);
    }

    /// Closes the open round if its deadline passed or every cohort unit is resolved.
    fn maybe_close(&mut self, now: f64, out: &mut Vec<Action>) {
        let Phase::Open(open) = &self.phase else {
            return;
        };
        let all_resolved = open.cohort.values().all(|d| *d);
        if now < open.deadline && !all_resolved {
            return;
        }
        let Phase::Open(open) =
            std::mem::replace(&mut self.phase, Phase::Waiting { since: Some(now) })
        else {
            return;
        };
        let accepted = open.contributed.len() as u64;
        if accepted < self.cfg.quorum {
            self.rounds_abandoned += 1;
            let why = if all_resolved && now < open.deadline {
                "every cohort unit answered, dropped or was rejected"
            } else {
                "deadline passed"
            };
            out.push(Action::Abandoned {
                round: open.round,
                accepted,
                quorum: self.cfg.quorum,
                offered: open.cohort.len() as u64,
                reason: format!(
                    "{why} with {accepted} accepted updates, quorum {}",
                    self.cfg.quorum
                ),
            });
            self.try_open(now, out);
            return;
        }
        let mut noise = match self.cfg.seed {
            Some(seed) => GaussianNoise::seeded(round_noise_seed(seed, open.round)),
            None => match GaussianNoise::from_os() {
                Ok(n) => n,
                Err(e) => {
                    self.phase = Phase::Finished;
                    out.push(Action::Finished {
                        reason: format!("no noise source: {e}"),
                    });
                    return;
                }
            },
        };
        let mut noisy: Vec<f32> = open.sum.iter().map(|s| *s as f32).collect();
        // z = 0 (a non-private twin, whose C is infinite) means no noise, not 0 x inf = NaN.
        let std = if self.cfg.noise_multiplier == 0.0 {
            0.0
        } else {
            self.cfg.noise_multiplier * self.cfg.clip_norm
        };
        if let Err(e) = noise.add_to(&mut noisy, std) {
            self.phase = Phase::Finished;
            out.push(Action::Finished {
                reason: format!("noise failed: {e}"),
            });
            return;
        }
        let denom = self.cfg.expected_cohort;
        for x in noisy.iter_mut() {
            *x = (*x as f64 / denom) as f32;
        }
        let units: Vec<UnitId> = open.contributed.iter().copied().collect();
        let record = RoundRecord::gaussian_round(
            open.round,
            units.clone(),
            self.cfg.noise_multiplier,
            self.cfg.clip_norm,
            open.sampling_rate,
            denom,
            noise.source(),
        );
        self.phase = Phase::Committing {
            round: open.round,
            units,
        };
        out.push(Action::Commit(Box::new(Commit {
            record,
            noisy_mean: noisy,
            accepted,
            clipped: open.clipped,
            offered: open.cohort.len() as u64,
            rejected: open.rejected,
        })));
    }

    fn cohort_rng(&self, round: u64) -> ChaCha20Rng {
        match self.cfg.seed {
            Some(seed) => {
                ChaCha20Rng::seed_from_u64(splitmix64(round_noise_seed(seed, round) ^ 0xc0))
            }
            None => rand::make_rng::<ChaCha20Rng>(),
        }
    }

    /// Opens the next round if the population allows it.
    fn try_open(&mut self, now: f64, out: &mut Vec<Action>) {
        let Phase::Waiting { since } = self.phase else {
            return;
        };
        if self.next_round > self.cfg.rounds {
            self.phase = Phase::Finished;
            out.push(Action::Finished {
                reason: format!(
                    "all {} rounds attempted: {} released, {} abandoned",
                    self.cfg.rounds, self.rounds_completed, self.rounds_abandoned
                ),
            });
            return;
        }
        let waited = since.map(|s| now - s).unwrap_or(0.0);
        let timed_out = since.is_some() && waited >= self.cfg.start_timeout_s;
        let round = self.next_round;
        let (cohort, sampling_rate): (Vec<UnitId>, Option<f64>) = match self.cfg.participation {
            Participation::Fresh => {
                let unused_total = self.cfg.population - self.used.len() as u64;
                if unused_total < self.cfg.quorum.max(1) {
                    self.phase = Phase::Finished;
                    out.push(Action::Finished {
                        reason: format!(
                            "participation is fresh and only {unused_total} units never contributed (quorum {})",
                            self.cfg.quorum
                        ),
                    });
                    return;
                }
                let mut eligible: Vec<UnitId> = self
                    .hosted
                    .iter()
                    .flat_map(|(s, (e, _))| *s..*e)
                    .filter(|u| !self.used.contains(u))
                    .collect();
                let want = self.cfg.cohort_size as usize;
                let enough = eligible.len() >= want;
                if !(enough || timed_out && eligible.len() as u64 >= self.cfg.quorum) {
                    return;
                }
                // Wait for the whole population at the very start (so round 1 is not drawn
                // from whoever connected first), unless the start timeout passed.
                if !self.opened_any && self.hosted_units() < self.cfg.population && !timed_out {
                    return;
                }
                let mut rng = self.cohort_rng(round);
                let k = want.min(eligible.len());
                // Partial Fisher-Yates: a uniformly random k-subset.
                for i in 0..k {
                    let j = rng.random_range(i..eligible.len());
                    eligible.swap(i, j);
                }
                eligible.truncate(k);
                (eligible, None)
            }
            Participation::Sampled { rate } => {
                let hosted = self.hosted_units();
                let ready = hosted >= self.cfg.population || timed_out || self.opened_any;
                if !ready {
                    return;
                }
                let mut rng = self.cohort_rng(round);
                let q = rate.get();
                let sample: Vec<UnitId> = (0..self.cfg.population)
                    .filter(|_| rng.random::<f64>() < q)
                    .collect();
                (sample, Some(q))
            }
        };
        self.next_round += 1;
        self.opened_any = true;
        let spec = RoundSpec {
            round,
            dim: self.cfg.dim as u32,
            clip_norm: self.cfg.clip_norm,
            deadline_s: self.cfg.deadline_s,
            task_json: self.cfg.task_json.clone(),
        };
        let mut by_client: BTreeMap<ClientId, Vec<UnitId>> = BTreeMap::new();
        let mut cohort_map = BTreeMap::new();
        for u in cohort {
            // Units whose host is not connected are resolved from the start (dropouts).
            cohort_map.insert(u, self.host_of(u).is_none());
        }
        for u in cohort_map.keys() {
            if let Some(c) = self.host_of(*u) {
                by_client.entry(c).or_default().push(*u);
            }
        }
        for (client, units) in by_client {
            out.push(Action::SendOffer {
                client,
                spec: spec.clone(),
                units,
            });
        }
        self.phase = Phase::Open(OpenRound {
            round,
            deadline: now + self.cfg.deadline_s,
            spec,
            cohort: cohort_map,
            contributed: BTreeSet::new(),
            sum: vec![0.0; self.cfg.dim],
            clipped: 0,
            rejected: 0,
            sampling_rate,
        });
        // An empty cohort (possible under sampling) closes at once.
        self.maybe_close(now, out);
    }
}

/// Index of the first non-finite value. Scans in fixed blocks with a branch-free test (the
/// compiler vectorises it) and only searches inside a block that has one: a plain
/// `position(!is_finite)` is a branch per value and about 4x slower on 10^6 values.
fn first_non_finite(v: &[f32]) -> Option<usize> {
    const BLOCK: usize = 1024;
    const EXP: u32 = 0x7f80_0000;
    for (b, block) in v.chunks(BLOCK).enumerate() {
        let bad = block
            .iter()
            .fold(false, |acc, x| acc | (x.to_bits() & EXP == EXP));
        if bad {
            return block
                .iter()
                .position(|x| !x.is_finite())
                .map(|i| b * BLOCK + i);
        }
    }
    None
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod scan_tests {
    use super::first_non_finite;

    #[test]
    fn first_non_finite_finds_the_first_bad_value_in_any_block() {
        let mut v = vec![0.5f32; 5000];
        assert_eq!(first_non_finite(&v), None);
        for (i, bad) in [
            (0, f32::NAN),
            (1023, f32::INFINITY),
            (1024, f32::NEG_INFINITY),
        ] {
            let mut w = v.clone();
            w[i] = bad;
            w[4999] = f32::NAN;
            assert_eq!(first_non_finite(&w), Some(i));
        }
        v[4999] = f32::NAN;
        assert_eq!(first_non_finite(&v), Some(4999));
        assert_eq!(first_non_finite(&[]), None);
        assert_eq!(first_non_finite(&[f32::MAX, f32::MIN_POSITIVE, -0.0]), None);
    }
}
