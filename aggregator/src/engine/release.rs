//! DataRelease (seed 002, Algorithms 1-2) as engine logic: the sparse-vector walk over candidate
//! trajectories, driven by events like a round (DESIGN §1, §2.3).
//!
//! Before any training step the engine walks T candidate trajectories drawn uniformly without
//! replacement from all experts' demonstrations. Events in: a client joined or left
//! ([`Event::ClientJoined`], [`Event::ClientLeft`]), a chunk of a candidate arrived from its
//! owner ([`Event::StepsArrived`]), a client's counts arrived ([`Event::CountsArrived`]), time
//! passed ([`Event::Tick`]), the ledger answered ([`Event::LedgerAppended`] /
//! [`Event::LedgerRefused`] for round [`RELEASE_ROUND`]), D_stable was published
//! ([`Event::StablePublished`]). Actions out: append the release's ledger record
//! ([`Action::AppendLedger`], the same path as every round: one ledger writer), ask an owner for
//! a candidate's next steps ([`Action::RequestSteps`]), send a chunk to the agents
//! ([`Action::QueryPrefix`]), drop an agent ([`Action::DropClient`]), publish D_stable
//! ([`Action::PublishStable`]). All randomness (the candidates, the threshold and query noise)
//! comes from one generator of the engine's [`EntropySource`](super::EntropySource), so a
//! journalled run replays bit for bit.
//!
//! # Invariants
//! - **Who may answer.** A client takes part only after the engine accepted its join under the
//!   rules of a round: its unit ranges lie inside the population and are disjoint from every
//!   other client's. Its count limit is the number of units it was admitted with (its experts),
//!   and an answer above it, negative, not finite or rising with the prefix is refused and the
//!   client dropped. A join refused for overlap or range never reaches the walk: such a client is
//!   never queried, and anything it sends is ignored. A client that joins during a candidate's
//!   walk is queried from the next candidate on (it never saw the candidate's earlier steps).
//! - **What leaves a candidate's owner.** The owner reveals the candidate `chunk` (k) steps at a
//!   time ([`ReleaseSpec::chunk`], the scenario's `task.selective.release.chunk`, default 1).
//!   Steps `h+1..h+k` are asked for only after the prefix of length h passed the test, and the
//!   engine sends the agents only that new chunk. So nobody but the owner ever receives more of a
//!   candidate than its released prefix plus k steps (the steps of the chunk that failed). The
//!   rows beyond the observation and action (rewards, next observations) reach only the
//!   engine, and leave it only inside D_stable.
//! - **Charged before anything of it leaves.** With step-by-step reveal the walk's outputs start
//!   during the walk: each chunk sent tells the agents that the prefix before it passed. So the
//!   release's ledger record (the full T passes) is appended as soon as every expert is hosted,
//!   and the first candidate is asked for only after [`Event::LedgerAppended`]; a refused
//!   record ends the run before any candidate is drawn. A run that stops mid-walk is charged for
//!   the whole release (the ledger may over-report, never under-report) and a restart does not
//!   walk it again (the resumed engine starts with `Resume::release_done`; what was not
//!   published stays unpublished). D_stable is published when the walk ends, and the first
//!   training round opens only after [`Event::StablePublished`].
//!
//! # The answer deadline: drop the agent, keep the walk (and always account it)
//! Every request has a deadline ([`ReleaseSpec::answer_deadline_s`]). An owner that does not
//! send its steps in time, or an agent whose counts are not in, is dropped (its connection is
//! closed, its units leave the population) and the walk goes on with the agents that remain. A
//! candidate whose owner is gone before its walk ended releases nothing. Why this rule is sound:
//! - The sparse vector technique allows its queries to be chosen adaptively, as long as each
//!   has sensitivity 1 in one expert. After a drop, a count sums over the remaining agents'
//!   experts only: still at most 1 per expert, so every pass keeps its (2 epsilon', delta)
//!   guarantee. Who is dropped depends on timing and connectivity, which (as for the dropouts
//!   of a round) are treated as public, not on the values of anyone's answers.
//! - The stability argument that lets a passing prefix be released without noise (Lemma 5.1)
//!   needs the *true* count, over all experts, to be above theta. A count over fewer experts is
//!   never larger than the true one (every term is >= 0), so a prefix that passes on the subset
//!   would pass on the whole population: dropping can only make the release more conservative.
//! - Abandoning the release *unaccounted* when too few agents answer would not be sound here:
//!   with step-by-step reveal each chunk sent tells every agent that the prefix before it
//!   passed, so outcomes of the test have left the engine as soon as a second chunk of any
//!   candidate was sent. The release is therefore charged before its walk (its record composes
//!   the full T passes, an upper bound for a shorter walk: the ledger may over-report, never
//!   under-report). If every agent is gone the walk simply finds no owner for the remaining
//!   candidates and ends, and what passed is published.
//!
//! # Exact noise
//! The test runs on integers: [`ExactPrefixTest`] (counts on a grid of 2^-16, sensitivity
//! 2^16 + 1 grid units, discrete Laplace noise from integer arithmetic and exact Bernoulli
//! samplers). Its documentation carries the argument that the sparse vector proof holds as is on
//! the integers: no slack is added to delta.

use std::collections::BTreeSet;

use fedrl_common::privacy::DpEvent;
use fedrl_common::privacy::expert_answers::check_prefix_counts;
use fedrl_common::privacy::expert_release::{ExactPrefixTest, ReleaseParameters};
use fedrl_common::privacy::ledger::RoundRecord;
use fedrl_common::protocol::{PrefixQuery, ReleasedPrefix, TrajectoryRequest, UnitId};
use fedrl_common::scenario::{Scenario, Task};
use rand::RngExt;
use rand::rngs::ChaCha20Rng;

use super::{Action, ClientId, Engine, EngineError, Phase};

/// The ledger phase of the DataRelease (charged to every expert, before any DP-SGD step).
pub const RELEASE_PHASE: &str = "release";

/// The round number of the release's ledger record and of its ledger answers (training rounds
/// count from 1).
pub const RELEASE_ROUND: u64 = 0;

/// The fixed parameters of a DataRelease.
#[derive(Clone, Debug, PartialEq)]
pub struct ReleaseSpec {
    /// epsilon', delta', theta and the rest (for the report).
    pub params: ReleaseParameters,
    /// The integer test the walk runs.
    pub test: ExactPrefixTest,
    /// What the ledger records: T passes, each (2 epsilon', delta_1 / 2T)-DP.
    pub event: DpEvent,
    /// T: candidates walked.
    pub trajectories: u64,
    /// L: the longest prefix walked (steps).
    pub horizon: u64,
    /// k: steps an owner reveals at a time.
    pub chunk: u32,
    /// Seconds an agent has to answer a request before it is dropped.
    pub answer_deadline_s: f64,
    /// Demonstrations per expert.
    pub episodes_per_unit: u64,
    /// Observation values per step.
    pub obs_dim: usize,
    /// Number of discrete actions.
    pub n_actions: u32,
}

impl ReleaseSpec {
    /// The release of `scenario`'s task, if it has one.
    /// `transitions`: observation values per step and discrete actions of the task's
    /// transitions (the caller's, from the task kind: [`super::Shapes::transitions`]).
    pub fn for_scenario(
        scenario: &Scenario,
        transitions: Option<(usize, u32)>,
    ) -> Result<Option<Self>, EngineError> {
        let Task::OfflineCql(task) = &scenario.task else {
            return Ok(None);
        };
        let Some(cfg) = task.selective.as_ref().and_then(|s| s.release.as_ref()) else {
            return Ok(None);
        };
        let bad = |m: String| EngineError::InvalidConfig(format!("task.selective.release: {m}"));
        let p_min = fedrl_common::selective::expert_p_min(&task.dataset).ok_or_else(|| {
            bad("a DataRelease needs expert policies with a minimum action probability: set task.dataset.behaviour to { kind = \"experts\", ... }".into())
        })?;
        let budget = scenario
            .release_budget()
            .map_err(|e| bad(e.to_string()))?
            .ok_or_else(|| bad("no release budget".into()))?;
        let params = budget
            .parameters(p_min, cfg.horizon)
            .map_err(|e| bad(e.to_string()))?;
        let (obs_dim, n_actions) = transitions.ok_or_else(|| {
            bad("the caller gave no transition shape for the task's DataRelease".into())
        })?;
        // expert_p_min above found a generated experts dataset.
        let episodes_per_unit = task.dataset.generated().map_or(1, |d| d.episodes_per_unit);
        if cfg.trajectories > scenario.users.saturating_mul(episodes_per_unit) {
            return Err(bad(format!(
                "trajectories ({}) exceeds the {} demonstrations of the dataset",
                cfg.trajectories,
                scenario.users.saturating_mul(episodes_per_unit)
            )));
        }
        if cfg.chunk == 0 || !(cfg.answer_deadline_s.is_finite() && cfg.answer_deadline_s > 0.0) {
            return Err(bad("chunk must be >= 1 and answer_deadline_s > 0".into()));
        }
        Ok(Some(ReleaseSpec {
            test: ExactPrefixTest::new(&params).map_err(|e| bad(e.to_string()))?,
            event: budget.event().map_err(|e| bad(e.to_string()))?,
            params,
            trajectories: cfg.trajectories,
            horizon: cfg.horizon,
            chunk: cfg.chunk,
            answer_deadline_s: cfg.answer_deadline_s,
            episodes_per_unit,
            obs_dim,
            n_actions,
        }))
    }

    /// Values per transition row (`encode_rows`: obs, next obs, action, reward, terminal).
    pub fn row_width(&self) -> usize {
        2 * self.obs_dim + 3
    }
}

/// What the engine publishes once the release is accounted (public: D_stable; the counts are
/// operator-only).
#[derive(Clone, Debug, PartialEq)]
pub struct StableRelease {
    /// The released prefixes with their rows (`encode_rows` layout, `prefix.steps` rows each).
    pub prefixes: Vec<(ReleasedPrefix, Vec<f32>)>,
    /// Each connected client's own released prefixes (it drops them from its D_unst).
    pub owners: Vec<(ClientId, Vec<ReleasedPrefix>)>,
    /// Candidates walked (each charged in the record).
    pub walked: u64,
    /// Answers refused (operator-only).
    pub refused: u64,
    /// Agents dropped for a missed deadline or a refused message (operator-only).
    pub dropped: u64,
    /// Engine time the walk started (every expert hosted).
    pub started_at: Option<f64>,
    /// Engine time every agent had answered the first chunk (the agents' loading is before).
    pub first_counts_at: Option<f64>,
    /// Engine time the walk ended.
    pub done_at: f64,
}

/// One candidate trajectory being walked.
struct Candidate {
    query: u64,
    unit: UnitId,
    episode: u32,
    owner: ClientId,
    /// The owner left or was dropped: nothing of the candidate is released.
    owner_gone: bool,
    first_row: Option<u32>,
    /// The clients that receive this candidate's chunks (those present at its first chunk).
    audience: BTreeSet<ClientId>,
    /// theta^ of this candidate, drawn before its first test.
    threshold: Option<i128>,
    /// The rows of the prefix that passed so far.
    passed_rows: Vec<f32>,
    passed: u32,
}

enum Stage {
    /// Waiting until the joined clients host every expert.
    Gathering,
    /// The owner was asked for `asked` steps.
    Steps {
        deadline: f64,
        asked: u32,
    },
    /// The audience was sent a chunk of `len` steps.
    Counts {
        deadline: f64,
        rows: Vec<f32>,
        len: u32,
        ended: bool,
        waiting: BTreeSet<ClientId>,
        sums: Vec<i128>,
    },
    Done,
}

/// The walk's state (inside [`Phase::Release`]).
pub(super) struct Walk {
    spec: ReleaseSpec,
    rng: Option<ChaCha20Rng>,
    drawn: BTreeSet<(UnitId, u32)>,
    walked: u64,
    next_query: u64,
    cand: Option<Candidate>,
    stage: Stage,
    stable: Vec<(ReleasedPrefix, Vec<f32>)>,
    refused: u64,
    dropped: u64,
    started_at: Option<f64>,
    first_counts_at: Option<f64>,
    done_at: f64,
}

impl Walk {
    pub(super) fn new(spec: ReleaseSpec) -> Self {
        Walk {
            spec,
            rng: None,
            drawn: BTreeSet::new(),
            walked: 0,
            next_query: 1,
            cand: None,
            stage: Stage::Gathering,
            stable: Vec::new(),
            refused: 0,
            dropped: 0,
            started_at: None,
            first_counts_at: None,
            done_at: 0.0,
        }
    }

    fn is_done(&self) -> bool {
        matches!(self.stage, Stage::Done)
    }
}

/// A chunk of a candidate as its owner sent it ([`Event::StepsArrived`]).
pub(super) struct Steps {
    pub(super) client: ClientId,
    pub(super) query: u64,
    pub(super) unit: UnitId,
    pub(super) episode: u32,
    pub(super) first_row: u32,
    pub(super) from_step: u32,
    pub(super) ended: bool,
    pub(super) rows: Vec<f32>,
}

/// Why a chunk is refused, or `Ok` with the number of rows.
fn check_rows(spec: &ReleaseSpec, rows: &[f32]) -> Result<u32, String> {
    let w = spec.row_width();
    if rows.is_empty() || !rows.len().is_multiple_of(w) {
        return Err(format!(
            "{} values are not a whole number of rows of {w} values",
            rows.len()
        ));
    }
    for (i, row) in rows.chunks_exact(w).enumerate() {
        if let Some(x) = row.iter().find(|x| !x.is_finite()) {
            return Err(format!("row {i} holds a non-finite value ({x})"));
        }
        let a = row[2 * spec.obs_dim];
        if !(a >= 0.0 && a.fract() == 0.0 && (a as u32) < spec.n_actions) {
            return Err(format!(
                "row {i} has action {a}, not one of the {} actions",
                spec.n_actions
            ));
        }
    }
    Ok((rows.len() / w) as u32)
}

impl Engine {
    /// The units `client` was admitted with (its count limit), 0 if it is not joined.
    fn admitted_units(&self, client: ClientId) -> u64 {
        self.clients
            .get(&client)
            .map_or(0, |r| r.iter().map(|r| r.len()).sum())
    }

    /// Removes `client` from the population (a left or dropped client).
    fn detach(&mut self, client: ClientId) -> bool {
        let Some(ranges) = self.clients.remove(&client) else {
            return false;
        };
        for r in &ranges {
            self.hosted.remove(&r.start);
        }
        true
    }

    /// Runs `f` on the walk, then records the release when the walk is done. `Err` from `f`
    /// ends the run (no randomness, a broken invariant).
    fn with_walk(
        &mut self,
        now: f64,
        out: &mut Vec<Action>,
        f: impl FnOnce(&mut Engine, &mut Walk, &mut Vec<Action>) -> Result<(), String>,
    ) {
        let Phase::Release(mut w) = std::mem::replace(&mut self.phase, Phase::Finished) else {
            return;
        };
        if let Err(reason) = f(self, &mut w, out) {
            self.finish(format!("DataRelease stopped: {reason}"), out);
            return;
        }
        if !w.is_done() {
            self.phase = Phase::Release(w);
            return;
        }
        w.done_at = now;
        self.publish(*w, out);
    }

    /// The walk is over (its record is in the ledger already): D_stable goes out.
    fn publish(&mut self, w: Walk, out: &mut Vec<Action>) {
        let mut owners = Vec::new();
        for (client, ranges) in &self.clients {
            let mine: Vec<ReleasedPrefix> = w
                .stable
                .iter()
                .map(|(p, _)| *p)
                .filter(|p| ranges.iter().any(|r| r.contains(p.unit)))
                .collect();
            owners.push((*client, mine));
        }
        owners.sort_by_key(|(c, _)| *c);
        self.phase = Phase::ReleasePublishing;
        out.push(Action::PublishStable(Box::new(StableRelease {
            prefixes: w.stable,
            owners,
            walked: w.walked,
            refused: w.refused,
            dropped: w.dropped,
            started_at: w.started_at,
            first_counts_at: w.first_counts_at,
            done_at: w.done_at,
        })));
    }

    /// A client joined (already checked and hosted): once every expert is, the release is
    /// charged ([`Action::AppendLedger`]); its walk starts when the record is durable.
    pub(super) fn release_on_join(&mut self, now: f64, out: &mut Vec<Action>) {
        if self.hosted_units() < self.cfg.population {
            return;
        }
        let Phase::Release(mut w) = std::mem::replace(&mut self.phase, Phase::Finished) else {
            return;
        };
        if !matches!(w.stage, Stage::Gathering) || w.rng.is_some() {
            self.phase = Phase::Release(w);
            return;
        }
        let (rng, noise_source) = match self.entropy.release_rng() {
            Ok(r) => r,
            Err(e) => {
                self.finish(format!("DataRelease not started: {e}"), out);
                return;
            }
        };
        w.rng = Some(rng);
        w.started_at = Some(now);
        let record = RoundRecord {
            round: RELEASE_ROUND,
            phase: RELEASE_PHASE.into(),
            event: w.spec.event.clone(),
            // Every expert is queried: the release charges the whole population.
            sampled_by_aggregator: true,
            units: (0..self.cfg.population).collect(),
            clip_norm: None,
            expected_cohort: None,
            noise_source,
            unix_time_s: 0.0,
        };
        self.phase = Phase::ReleaseRecording(w);
        out.push(Action::AppendLedger {
            round: RELEASE_ROUND,
            record: Box::new(record),
        });
    }

    /// A client left (already removed from the population).
    pub(super) fn release_on_leave(&mut self, now: f64, client: ClientId, out: &mut Vec<Action>) {
        self.with_walk(now, out, |e, w, out| {
            client_gone(w, client);
            e.progress(w, now, out)
        });
    }

    /// Time passed: a request past its deadline drops whoever did not answer.
    pub(super) fn release_on_tick(&mut self, now: f64, out: &mut Vec<Action>) {
        self.with_walk(now, out, |e, w, out| {
            let late: Vec<ClientId> = match (&w.stage, &w.cand) {
                (Stage::Steps { deadline, .. }, Some(c)) if now >= *deadline => vec![c.owner],
                (
                    Stage::Counts {
                        deadline, waiting, ..
                    },
                    _,
                ) if now >= *deadline => waiting.iter().copied().collect(),
                _ => return Ok(()),
            };
            let s = w.spec.answer_deadline_s;
            for c in late {
                e.drop_client(
                    w,
                    c,
                    format!("no answer to the DataRelease within {s} s"),
                    out,
                );
            }
            e.progress(w, now, out)
        });
    }

    /// A chunk of the candidate from its owner.
    pub(super) fn release_on_steps(&mut self, now: f64, s: Steps, out: &mut Vec<Action>) {
        if !self.clients.contains_key(&s.client) {
            // A message of a client already gone (dropped or left): nothing of it counts.
            return;
        }
        self.with_walk(now, out, |e, w, out| {
            let asked = match (&w.stage, &w.cand) {
                (Stage::Steps { asked, .. }, Some(c))
                    if c.owner == s.client
                        && c.query == s.query
                        && c.unit == s.unit
                        && c.episode == s.episode
                        && c.passed == s.from_step
                        && c.first_row.is_none_or(|f| f == s.first_row) =>
                {
                    *asked
                }
                _ => {
                    let m = format!(
                        "trajectory steps nobody asked for (query {}, unit {}, episode {}, from step {})",
                        s.query, s.unit, s.episode, s.from_step
                    );
                    e.drop_client(w, s.client, m, out);
                    return e.progress(w, now, out);
                }
            };
            let len = match check_rows(&w.spec, &s.rows) {
                Ok(n) if n > asked => Err(format!("{n} steps sent, {asked} asked for")),
                Ok(n) if n < asked && !s.ended => Err(format!(
                    "{n} steps sent of {asked} asked for, and the episode does not end there"
                )),
                other => other,
            };
            let len = match len {
                Ok(n) => n,
                Err(m) => {
                    w.refused += 1;
                    e.drop_client(w, s.client, format!("trajectory steps: {m}"), out);
                    return e.progress(w, now, out);
                }
            };
            let Some(c) = w.cand.as_mut() else {
                return Err("a chunk arrived with no candidate".into());
            };
            if s.from_step == 0 {
                // Charged from here on: the candidate's answers decide its release.
                w.walked += 1;
                c.first_row = Some(s.first_row);
                c.audience = e.clients.keys().copied().collect();
            }
            // Only the observation and the action of each step go to the agents.
            let (d, width) = (w.spec.obs_dim, w.spec.row_width());
            let mut payload = Vec::with_capacity(len as usize * (d + 1));
            for row in s.rows.chunks_exact(width) {
                payload.extend_from_slice(&row[..d]);
                payload.push(row[2 * d]);
            }
            let msg = PrefixQuery {
                query: c.query,
                from_step: s.from_step,
                steps: len,
                obs_dim: d as u32,
            };
            for client in &c.audience {
                out.push(Action::QueryPrefix {
                    client: *client,
                    query: msg.clone(),
                    payload: payload.clone(),
                });
            }
            w.stage = Stage::Counts {
                deadline: now + w.spec.answer_deadline_s,
                rows: s.rows,
                len,
                ended: s.ended,
                waiting: c.audience.clone(),
                sums: vec![0; len as usize],
            };
            Ok(())
        });
    }

    /// One client's counts for the chunk.
    pub(super) fn release_on_counts(
        &mut self,
        now: f64,
        client: ClientId,
        query: u64,
        from_step: u32,
        counts: Vec<f64>,
        out: &mut Vec<Action>,
    ) {
        if !self.clients.contains_key(&client) {
            // Refused at its join, dropped or gone: none of its answers counts.
            return;
        }
        let hosted = self.admitted_units(client);
        self.with_walk(now, out, |e, w, out| {
            let horizon = w.spec.horizon;
            let expected = match (&w.stage, &w.cand) {
                (Stage::Counts { waiting, len, .. }, Some(c))
                    if c.query == query && c.passed == from_step && waiting.contains(&client) =>
                {
                    *len as usize
                }
                _ => {
                    let m = format!(
                        "prefix counts nobody asked for (query {query}, from step {from_step})"
                    );
                    e.drop_client(w, client, m, out);
                    return e.progress(w, now, out);
                }
            };
            let checked = if counts.len() != expected {
                Err(format!(
                    "{} prefix counts for a chunk of {expected} steps",
                    counts.len()
                ))
            } else {
                check_prefix_counts(&counts, hosted, horizon).map_err(|e| e.to_string())
            };
            if let Err(m) = checked {
                w.refused += 1;
                e.drop_client(w, client, format!("prefix counts: {m}"), out);
                return e.progress(w, now, out);
            }
            let Stage::Counts { waiting, sums, .. } = &mut w.stage else {
                return Err("counts outside a count stage".into());
            };
            for (s, c) in sums.iter_mut().zip(&counts) {
                let g = ExactPrefixTest::count_on_grid(*c, hosted)
                    .ok_or_else(|| format!("a checked count {c} is off the grid"))?;
                *s += g;
            }
            waiting.remove(&client);
            e.progress(w, now, out)
        });
    }

    /// The ledger answered the release's record: the walk starts, or the run stops.
    pub(super) fn release_ledger_answer(
        &mut self,
        now: f64,
        refused: Option<String>,
        out: &mut Vec<Action>,
    ) {
        let Phase::ReleaseRecording(w) = std::mem::replace(&mut self.phase, Phase::Finished) else {
            return;
        };
        if let Some(reason) = refused {
            self.finish(format!("the DataRelease was not accounted: {reason}"), out);
            return;
        }
        self.phase = Phase::Release(w);
        self.with_walk(now, out, |e, w, out| e.next_candidate(w, now, out));
    }

    /// The driver published D_stable (or could not): training may start.
    pub(super) fn release_published(
        &mut self,
        now: f64,
        failed: Option<String>,
        out: &mut Vec<Action>,
    ) {
        if !matches!(self.phase, Phase::ReleasePublishing) {
            self.out_of_order("publication of D_stable", RELEASE_ROUND, out);
            return;
        }
        if let Some(reason) = failed {
            self.finish(format!("D_stable could not be published: {reason}"), out);
            return;
        }
        self.phase = Phase::Waiting { since: Some(now) };
        self.try_open(now, out);
    }

    /// Closes `client` and takes its units out of the population.
    fn drop_client(
        &mut self,
        w: &mut Walk,
        client: ClientId,
        message: String,
        out: &mut Vec<Action>,
    ) {
        if self.detach(client) {
            w.dropped += 1;
            out.push(Action::DropClient { client, message });
        }
        client_gone(w, client);
    }

    /// Moves the walk on after a change: a candidate whose owner is gone ends, a chunk whose
    /// counts are all in is decided.
    fn progress(&mut self, w: &mut Walk, now: f64, out: &mut Vec<Action>) -> Result<(), String> {
        match &w.stage {
            Stage::Steps { .. } if w.cand.as_ref().is_some_and(|c| c.owner_gone) => {
                self.end_candidate(w, now, out)
            }
            Stage::Counts { waiting, .. } if waiting.is_empty() => self.decide(w, now, out),
            _ => Ok(()),
        }
    }

    /// Every answer of the chunk is in (or its client gone): the test decides its steps.
    fn decide(&mut self, w: &mut Walk, now: f64, out: &mut Vec<Action>) -> Result<(), String> {
        let Stage::Counts {
            rows,
            len,
            ended,
            sums,
            ..
        } = std::mem::replace(&mut w.stage, Stage::Gathering)
        else {
            return Err("decide outside a count stage".into());
        };
        w.first_counts_at.get_or_insert(now);
        let test = w.spec.test;
        let (width, horizon) = (w.spec.row_width(), w.spec.horizon);
        let (Some(c), Some(rng)) = (w.cand.as_mut(), w.rng.as_mut()) else {
            return Err("a chunk decided with no candidate".into());
        };
        let threshold = match c.threshold {
            Some(t) => t,
            None => {
                let t = test.noisy_threshold(rng).map_err(|e| e.to_string())?;
                c.threshold = Some(t);
                t
            }
        };
        debug_assert_eq!(sums.len(), len as usize);
        let mut failed = false;
        for (i, sum) in sums.iter().enumerate() {
            if !test
                .passes(*sum, threshold, rng)
                .map_err(|e| e.to_string())?
            {
                // The first failure ends the candidate: the prefix before it is released, and
                // no noise is drawn for the rest of the chunk.
                failed = true;
                break;
            }
            c.passed += 1;
            c.passed_rows
                .extend_from_slice(&rows[i * width..(i + 1) * width]);
        }
        if failed || ended || c.passed as u64 >= horizon {
            // A failure, or every prefix passed up to the episode's end or L: released whole.
            return self.end_candidate(w, now, out);
        }
        self.request_steps(w, now, out)
    }

    /// Asks the candidate's owner for its next chunk.
    fn request_steps(
        &mut self,
        w: &mut Walk,
        now: f64,
        out: &mut Vec<Action>,
    ) -> Result<(), String> {
        let Some(c) = w.cand.as_ref() else {
            return Err("steps asked for with no candidate".into());
        };
        if c.owner_gone || !self.clients.contains_key(&c.owner) {
            return self.end_candidate(w, now, out);
        }
        let left = w.spec.horizon.saturating_sub(c.passed as u64);
        let steps = (w.spec.chunk as u64).min(left) as u32;
        out.push(Action::RequestSteps {
            client: c.owner,
            request: TrajectoryRequest {
                query: c.query,
                unit: c.unit,
                episode: c.episode,
                from_step: c.passed,
                steps,
            },
        });
        w.stage = Stage::Steps {
            deadline: now + w.spec.answer_deadline_s,
            asked: steps,
        };
        Ok(())
    }

    /// The candidate's walk is over: its passed prefix joins D_stable (unless its owner is
    /// gone), and the next candidate is drawn.
    fn end_candidate(
        &mut self,
        w: &mut Walk,
        now: f64,
        out: &mut Vec<Action>,
    ) -> Result<(), String> {
        if let Some(c) = w.cand.take()
            && !c.owner_gone
            && c.passed > 0
            && let Some(first_row) = c.first_row
        {
            w.stable.push((
                ReleasedPrefix {
                    unit: c.unit,
                    episode: c.episode,
                    first_row,
                    steps: c.passed,
                },
                c.passed_rows,
            ));
        }
        self.next_candidate(w, now, out)
    }

    /// Draws the next candidate and asks its owner, or ends the walk after T.
    fn next_candidate(
        &mut self,
        w: &mut Walk,
        now: f64,
        out: &mut Vec<Action>,
    ) -> Result<(), String> {
        let total = self.cfg.population.saturating_mul(w.spec.episodes_per_unit);
        let Some(rng) = w.rng.as_mut() else {
            return Err("a candidate drawn before the walk started".into());
        };
        while w.walked < w.spec.trajectories && (w.drawn.len() as u64) < total {
            let k = rng.random_range(0..total);
            let (unit, episode) = (
                k / w.spec.episodes_per_unit,
                (k % w.spec.episodes_per_unit) as u32,
            );
            if !w.drawn.insert((unit, episode)) {
                continue;
            }
            let Some(owner) = self.host_of(unit) else {
                // Its client is gone: nothing of it can be asked (no budget spent).
                continue;
            };
            let query = w.next_query;
            w.next_query += 1;
            w.cand = Some(Candidate {
                query,
                unit,
                episode,
                owner,
                owner_gone: false,
                first_row: None,
                audience: BTreeSet::new(),
                threshold: None,
                passed_rows: Vec::new(),
                passed: 0,
            });
            return self.request_steps(w, now, out);
        }
        w.stage = Stage::Done;
        Ok(())
    }
}

/// `client` is no longer in the population: it owes nothing, and a candidate it owned ends.
fn client_gone(w: &mut Walk, client: ClientId) {
    if let Some(c) = w.cand.as_mut() {
        c.audience.remove(&client);
        if c.owner == client {
            c.owner_gone = true;
        }
    }
    if let Stage::Counts { waiting, .. } = &mut w.stage {
        waiting.remove(&client);
    }
}

/// Serde helpers: floats as their bit patterns, so a journalled chunk or count replays to the
/// bit (JSON's decimal form need not parse back to the same value).
pub(super) mod bits {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub mod f32s {
        use super::*;
        pub fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
            v.iter()
                .map(|x| x.to_bits())
                .collect::<Vec<u32>>()
                .serialize(s)
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
            Ok(Vec::<u32>::deserialize(d)?
                .into_iter()
                .map(f32::from_bits)
                .collect())
        }
    }

    pub mod f64s {
        use super::*;
        pub fn serialize<S: Serializer>(v: &[f64], s: S) -> Result<S::Ok, S::Error> {
            v.iter()
                .map(|x| x.to_bits())
                .collect::<Vec<u64>>()
                .serialize(s)
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
            Ok(Vec::<u64>::deserialize(d)?
                .into_iter()
                .map(f64::from_bits)
                .collect())
        }
    }
}

#[cfg(test)]
mod tests;
