//! The engine thread: feeds the sans-IO engine with network inputs and ticks, journals every
//! event it feeds ([`crate::journal`]), and executes the engine's actions (offers,
//! acknowledgements, ledger appends, releases applied to the model, metrics, checkpoints, the
//! end-of-run report). It holds no privacy logic: the order ledger append -> release -> next
//! offers, the non-private twin and stopping at the model's target are the engine's decisions;
//! the driver only reports what happened (`LedgerAppended`/`LedgerRefused`, `Released` with the
//! model's `finished()`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use anyhow::Context;
use bytes::Bytes;
use fedrl_common::privacy::ledger::{LedgerError, PrivacyLedger};
use fedrl_common::protocol::{
    Ack, ErrorCode, Leave, LeaveReason, Message, PrefixCounts, StableReleased, TrajectoryData,
    UnitData, UnitId, UnitRange, close_code, encode_payload,
};
use fedrl_common::scenario::Scenario;
use tokio::sync::mpsc;

use super::central::{Central, CentralSum, CentralUpdate, ExcludedUnit};
use super::connection::{OutTx, Outbound, Shared, UpdateBody};
use super::metrics::{Abandoned, Released, RoundMetrics};
use super::report::{OperatorCounts, Outcome, PublicReport, RunReport, Timings};
use crate::checkpoint::{self, CheckpointMeta};
use crate::engine::{Action, ClientId, Engine, Event, StableRelease};
use crate::journal::JournalWriter;
use fedrl_tasks::server::{EvaluationDone, EvaluationJob, ServerModel};

/// Inputs of the engine thread.
pub(super) enum Input {
    Join {
        session: ClientId,
        client_id: String,
        units: Vec<UnitRange>,
        out: OutTx,
    },
    Left {
        session: ClientId,
    },
    Update {
        session: ClientId,
        round: u64,
        unit: UnitId,
        body: UpdateBody,
    },
    /// A protocol violation on an update stream: forwarded to the connection's writer by the
    /// engine thread, so acknowledgements of earlier updates go out first.
    ProtocolError {
        session: ClientId,
        message: Message,
        reason: String,
    },
    /// Central update mode: one unit's uploaded transitions (DESIGN §2.5), in a body that holds
    /// its read permit until it is checked.
    UnitData {
        session: ClientId,
        header: UnitData,
        body: UpdateBody,
    },
    /// Central update mode: the client uploaded all its `units` units.
    DataComplete {
        session: ClientId,
        units: u64,
    },
    /// DataRelease: a candidate trajectory from its owner.
    TrajectoryData {
        session: ClientId,
        header: TrajectoryData,
        payload: Vec<f32>,
    },
    /// DataRelease: a client's prefix counts.
    PrefixCounts {
        session: ClientId,
        counts: PrefixCounts,
    },
    Tick,
    Shutdown,
}

pub(super) struct EngineThread {
    pub(super) engine: Engine,
    /// Every event fed to the engine, in order (operator-only).
    pub(super) journal: JournalWriter,
    pub(super) ledger: PrivacyLedger,
    pub(super) model: Box<dyn ServerModel>,
    pub(super) dir: PathBuf,
    pub(super) scenario: Scenario,
    pub(super) sessions: HashMap<ClientId, OutTx>,
    /// The released model, encoded once as raw little-endian bytes, shared by every offer.
    pub(super) snapshot: Bytes,
    pub(super) started: Instant,
    pub(super) accepted: u64,
    pub(super) rejected: u64,
    pub(super) last_eval: Option<serde_json::Value>,
    /// The model's end-of-run evaluation (e.g. held-out users' mean return).
    pub(super) final_eval: Option<serde_json::Value>,
    /// The model's operator-only end-of-run findings (`ServerModel::operator_evaluation`).
    pub(super) model_audit: Option<serde_json::Value>,
    /// Contributions in released rounds so far (users, for fresh participation).
    pub(super) users_released: u64,
    pub(super) shared: Arc<Shared>,
    /// The last round closed (released or abandoned): a checkpoint's round. A round still open
    /// when the run stops released nothing and runs again after a restart.
    pub(super) last_round: u64,
    /// The central update mode's data and work, when the task runs in it.
    pub(super) central: Option<Central>,
    /// What the release produced (public), for the report.
    pub(super) selective_report: Option<serde_json::Value>,
    /// The engine ended the run (rounds done, budget, population), not a signal.
    pub(super) ended_by_engine: bool,
    /// Set when the driver told the engine of an error (a ledger write or a release that
    /// failed): the engine then finishes, but the run ends as failed, not finished.
    pub(super) failure: Option<String>,
    /// Test hook ([`FAIL_LEDGER_AFTER_ENV`]): once the ledger holds this many round records,
    /// every further append fails as a write error would.
    pub(super) ledger_fault: Option<u64>,
    pub(super) timings: Timings,
    /// The pipelined evaluation of the last released model, while it runs.
    pub(super) pending_eval: Option<PendingEval>,
    /// A checkpoint fell due while an evaluation was running: it is written once the
    /// evaluation is in, so it holds the model selection an uninterrupted run would make.
    pub(super) checkpoint_due: bool,
    /// Per open round, the statistics of its accepted updates for the operator's diagnostics
    /// (operator-only); taken when the round closes.
    pub(super) round_stats: BTreeMap<u64, RoundStats>,
}

/// What the operator's diagnostics of one round gather from its accepted updates.
#[derive(Clone, Debug, Default)]
pub(super) struct RoundStats {
    /// Accepted updates, the sum and the largest of their L2 norms before the server's clip.
    accepted: u64,
    norm_sum: f64,
    norm_max: f64,
    /// The central summed path's mean training loss on the round's rows.
    loss: Option<f64>,
}

impl RoundStats {
    /// The operator-only diagnostics of a released round (`clipped` of `accepted` clipped).
    fn operator_diagnostics(
        &self,
        accepted: u64,
        clipped: u64,
    ) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        if self.accepted > 0 {
            m.insert(
                "unit_norm_mean".into(),
                (self.norm_sum / self.accepted as f64).into(),
            );
            m.insert("unit_norm_max".into(), self.norm_max.into());
        }
        if accepted > 0 {
            m.insert(
                "clipped_fraction".into(),
                (clipped as f64 / accepted as f64).into(),
            );
        }
        if let Some(l) = self.loss.filter(|l| l.is_finite()) {
            m.insert("train_loss".into(), l.into());
        }
        m
    }
}

/// L2 norm, accumulated in f64.
fn l2(v: impl IntoIterator<Item = f64>) -> f64 {
    v.into_iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// A JSON number, or null for a non-finite value (JSON has no infinities).
fn finite(x: f64) -> serde_json::Value {
    if x.is_finite() {
        x.into()
    } else {
        serde_json::Value::Null
    }
}

/// An evaluation running on its own thread (the round pipeline): the next round trains
/// meanwhile.
pub(super) struct PendingEval {
    round: u64,
    /// The result and the seconds the evaluation ran.
    done: std::sync::mpsc::Receiver<(EvaluationDone, f64)>,
}

/// Test only (not a user setting): `FEDRL_TEST_FAIL_LEDGER_AFTER=N` makes the aggregator's ledger
/// appends fail, as a full disk would, once the ledger holds N round records. End-to-end tests
/// use it to check how a run that stops for an error ends (exit status, messages, clients);
/// nothing else reads it.
pub(super) const FAIL_LEDGER_AFTER_ENV: &str = "FEDRL_TEST_FAIL_LEDGER_AFTER";

/// The value of [`FAIL_LEDGER_AFTER_ENV`], if set to a number.
pub(super) fn ledger_fault_from_env() -> Option<u64> {
    std::env::var(FAIL_LEDGER_AFTER_ENV)
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// What the clients are told when a run ends with `outcome` (`reason`: why it ended): the QUIC
/// close code, the close reason, and the message sent on the control stream first, if any.
pub(super) fn close_for(outcome: Outcome, reason: &str) -> (u32, String, Option<Message>) {
    match outcome {
        Outcome::Finished => (
            close_code::FINISHED,
            reason.to_string(),
            Some(Message::Leave(Leave {
                reason: LeaveReason::Finished,
                message: reason.to_string(),
            })),
        ),
        // "Come back": the clients reconnect with backoff and find the restarted aggregator.
        Outcome::Interrupted => {
            let why = "aggregator shutting down; the run resumes when it restarts".to_string();
            (
                close_code::SHUTDOWN,
                why.clone(),
                Some(Message::Leave(Leave {
                    reason: LeaveReason::Shutdown,
                    message: why,
                })),
            )
        }
        // No Leave: both of its reasons would tell the client something untrue.
        Outcome::Failed => (close_code::ERROR, reason.to_string(), None),
    }
}

impl EngineThread {
    /// Runs the engine until the run ends, writes the checkpoint and the report, then tells the
    /// connected clients how it ended (only then: a client told "finished" must not see the
    /// aggregator fail afterwards). A run that stopped for an error returns its report with
    /// [`Outcome::Failed`] when the report could be made, else the error.
    pub(super) fn run(mut self, mut rx: mpsc::Receiver<Input>) -> anyhow::Result<RunReport> {
        let result = self.run_to_end(&mut rx);
        match &result {
            Ok(r) => self.close_sessions(r.public.outcome, &r.public.finished),
            Err(e) => self.close_sessions(Outcome::Failed, &format!("{e:#}")),
        }
        result
    }

    fn close_sessions(&self, outcome: Outcome, reason: &str) {
        let (code, reason, message) = close_for(outcome, reason);
        for out in self.sessions.values() {
            let _ = out.send(Outbound::Close {
                code,
                message: message.clone(),
                reason: reason.clone(),
            });
        }
    }

    fn run_to_end(&mut self, rx: &mut mpsc::Receiver<Input>) -> anyhow::Result<RunReport> {
        self.snapshot = Bytes::from(encode_payload(self.model.params()));
        let mut metrics = RoundMetrics::open(&self.dir)?;
        let (outcome, reason) = match self.serve(rx, &mut metrics) {
            Ok((Outcome::Finished, reason)) if self.failure.is_some() => (Outcome::Failed, reason),
            Ok(end) => end,
            Err(e) => (Outcome::Failed, format!("{e:#}")),
        };
        if outcome == Outcome::Failed {
            return self.failed_report(reason, &mut metrics);
        }
        // A run that ended before its rounds because the units ran out did not do what its
        // scenario planned: it is wrapped up as usual (checkpoint, final evaluation, report)
        // but ends as failed, unless the scenario allows fewer rounds.
        let short = outcome == Outcome::Finished
            && self.ended_by_engine
            && self.engine.ran_out_of_units()
            && !self.scenario.allow_fewer_rounds;
        let reason = if short {
            format!(
                "the run stopped short of its {} rounds for lack of units ({} released, {} abandoned): {reason}; the scenario does not allow fewer rounds (set allow_fewer_rounds = true to accept this end, or give it more users)",
                self.scenario.rounds,
                self.engine.rounds_completed(),
                self.engine.rounds_abandoned()
            )
        } else {
            reason
        };
        match self.wrap_up(outcome, reason, short, &mut metrics) {
            Ok(report) => Ok(report),
            // E.g. the checkpoint cannot be written: the run did not end as it says.
            Err(e) => self.failed_report(format!("{e:#}"), &mut metrics),
        }
    }

    /// The end of a run that finished or was interrupted: the model's last scheduled steps, the
    /// checkpoint, the evaluation, the export and the report.
    /// `short`: the run is over but stopped short of its rounds, which the scenario does not
    /// allow: its report says failed.
    fn wrap_up(
        &mut self,
        outcome: Outcome,
        reason: String,
        short: bool,
        metrics: &mut RoundMetrics,
    ) -> anyhow::Result<RunReport> {
        // The last released model's evaluation belongs in its metrics line and the report.
        self.settle_evaluation(metrics, true)?;
        self.flush_metrics_line(metrics)?;
        if self.ended_by_engine {
            // What the model scheduled after its last round (a selective schedule's last free
            // steps) runs before the final checkpoint and evaluation.
            self.model
                .finish()
                .context("finishing the model's schedule")?;
            self.snapshot = Bytes::from(encode_payload(self.model.params()));
        }
        self.save_checkpoint()?;
        // An interrupted run is not over: its end-of-run evaluation comes when it is.
        if outcome == Outcome::Finished {
            self.final_eval = self.model.final_evaluation();
            self.model_audit = self.model.operator_evaluation();
        }
        self.model
            .export(&self.dir)
            .context("exporting the trained model")?;
        let outcome = if short { Outcome::Failed } else { outcome };
        let report = self.report(reason, outcome)?;
        report.write(&self.dir)?;
        Ok(report)
    }

    /// The run stopped for `reason`: keeps what can be kept (metrics, checkpoint, model, report),
    /// each step on its own, so that a second failure (the same full disk) neither hides the
    /// first nor stops the others.
    fn failed_report(
        &mut self,
        reason: String,
        metrics: &mut RoundMetrics,
    ) -> anyhow::Result<RunReport> {
        let also = |what: &str, r: anyhow::Result<()>| {
            if let Err(e) = r {
                eprintln!("after the error, {what} failed too: {e:#}");
            }
        };
        also(
            "waiting for the evaluation",
            self.settle_evaluation(metrics, true).map(|_| ()),
        );
        also("writing the metrics", self.flush_metrics_line(metrics));
        also("saving the checkpoint", self.save_checkpoint());
        also(
            "exporting the model",
            self.model
                .export(&self.dir)
                .context("exporting the trained model"),
        );
        let report = match self.report(reason.clone(), Outcome::Failed) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("after the error, accounting the report failed too: {e:#}");
                return Err(anyhow::Error::msg(reason));
            }
        };
        also("writing the report", report.write(&self.dir));
        Ok(report)
    }

    /// Feeds the engine until the run ends; how and why it ended.
    fn serve(
        &mut self,
        rx: &mut mpsc::Receiver<Input>,
        metrics: &mut RoundMetrics,
    ) -> anyhow::Result<(Outcome, String)> {
        let mut queue: VecDeque<Event> = VecDeque::new();
        let finished_reason;
        let mut outcome = Outcome::Finished;
        loop {
            // With central work pending the engine thread computes it between inputs instead
            // of waiting for one.
            let input = if self.central.as_ref().is_some_and(Central::has_work) {
                match rx.try_recv() {
                    Ok(i) => Some(i),
                    Err(mpsc::error::TryRecvError::Empty) => None,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        finished_reason = "all connections to the engine closed".to_string();
                        outcome = Outcome::Interrupted;
                        break;
                    }
                }
            } else {
                match rx.blocking_recv() {
                    Some(i) => Some(i),
                    None => {
                        finished_reason = "all connections to the engine closed".to_string();
                        outcome = Outcome::Interrupted;
                        break;
                    }
                }
            };
            let now = self.started.elapsed().as_secs_f64();
            let Some(input) = input else {
                if let Some(reason) = self.run_central(now, &mut queue, metrics)? {
                    finished_reason = reason;
                    break;
                }
                self.flush_metrics_line(metrics)?;
                continue;
            };
            match input {
                Input::Join {
                    session,
                    client_id,
                    units,
                    out,
                } => {
                    tracing::info!(session, client_id = %client_id, units = units.len(), "client joined");
                    self.sessions.insert(session, out);
                    match self.central.as_mut() {
                        // Its units join the population once their data is here; units the
                        // engine would refuse (outside the population, hosted or claimed by
                        // another session) refuse the join now, before any upload.
                        Some(c) => {
                            if let Err(m) = c.hold_join(session, units, self.engine.hosted()) {
                                self.rejected += 1;
                                tracing::warn!(session, message = %m, "join refused");
                                self.send(
                                    session,
                                    Outbound::Close {
                                        code: close_code::REFUSED,
                                        message: Some(Message::error(
                                            ErrorCode::UnitsInUse,
                                            &m,
                                            None,
                                            None,
                                        )),
                                        reason: m,
                                    },
                                );
                            }
                        }
                        None => self.admit(session, units, &mut queue)?,
                    }
                }
                Input::Left { session } => {
                    self.sessions.remove(&session);
                    let held = match self.central.as_mut() {
                        Some(c) => {
                            let held = c.is_pending(session);
                            c.left(session);
                            held
                        }
                        None => false,
                    };
                    if !held {
                        queue.push_back(Event::ClientLeft { client: session });
                    }
                }
                Input::TrajectoryData {
                    session,
                    header,
                    payload,
                } => {
                    queue.push_back(Event::StepsArrived {
                        client: session,
                        query: header.query,
                        unit: header.unit,
                        episode: header.episode,
                        first_row: header.first_row,
                        from_step: header.from_step,
                        ended: header.ended,
                        rows: payload,
                    });
                }
                Input::PrefixCounts { session, counts } => {
                    queue.push_back(Event::CountsArrived {
                        client: session,
                        query: counts.query,
                        from_step: counts.from_step,
                        counts: counts.counts,
                    });
                }
                Input::UnitData {
                    session,
                    header,
                    body,
                } => {
                    let unit = header.unit;
                    let result = match self.central.as_mut() {
                        Some(c) => c.unit_data(session, &header, &body.data),
                        None => Err("unit data, but this run is not in the central update mode (the data stays with the clients)".into()),
                    };
                    // The buffer and the permit go back.
                    drop(body);
                    match result {
                        Ok(()) => self.central_ready(&mut queue)?,
                        Err(m) => {
                            self.rejected += 1;
                            tracing::warn!(session, unit, message = %m, "unit data refused");
                            self.send(
                                session,
                                Outbound::Control(Message::error(
                                    ErrorCode::Unexpected,
                                    &m,
                                    None,
                                    Some(unit),
                                )),
                            );
                        }
                    }
                }
                Input::DataComplete { session, units } => {
                    let result = match self.central.as_mut() {
                        Some(c) => c.data_complete(session, units),
                        None => Err(
                            "data complete, but this run is not in the central update mode".into(),
                        ),
                    };
                    match result {
                        Ok(()) => self.central_ready(&mut queue)?,
                        Err(m) => self.send(
                            session,
                            Outbound::Close {
                                code: close_code::PROTOCOL,
                                message: Some(Message::error(
                                    ErrorCode::Unexpected,
                                    &m,
                                    None,
                                    None,
                                )),
                                reason: m,
                            },
                        ),
                    }
                }
                Input::Update {
                    session,
                    round,
                    unit,
                    mut body,
                } => {
                    if self.central.is_some() {
                        // The central mode computes every update here; one from a client is
                        // refused like any update for a unit it was not offered.
                        self.rejected += 1;
                        self.send(
                            session,
                            Outbound::Control(Message::error(
                                ErrorCode::NotInCohort,
                                "central update mode: the aggregator computes the units' updates",
                                Some(round),
                                Some(unit),
                            )),
                        );
                        continue;
                    }
                    let stop = self.feed_update(
                        now,
                        session,
                        round,
                        unit,
                        &mut body.data,
                        Some(&body.sha256),
                        &mut queue,
                        metrics,
                    )?;
                    // The engine has summed it: the buffer and the permit go back.
                    drop(body);
                    if let Some(reason) = stop {
                        finished_reason = reason;
                        break;
                    }
                }
                Input::ProtocolError {
                    session,
                    message,
                    reason,
                } => {
                    self.rejected += 1;
                    self.send(
                        session,
                        Outbound::Close {
                            code: close_code::PROTOCOL,
                            message: Some(message),
                            reason,
                        },
                    );
                }
                Input::Tick => queue.push_back(Event::Tick),
                Input::Shutdown => {
                    finished_reason =
                        "interrupted by the operator; a restart on the same state directory resumes the run"
                            .to_string();
                    outcome = Outcome::Interrupted;
                    break;
                }
            }
            if let Some(round) = self.settle_evaluation(metrics, false)? {
                queue.push_back(Event::TargetReached { round });
            }
            let stop = self.drain(now, &mut queue, metrics)?;
            self.flush_metrics_line(metrics)?;
            if let Some(reason) = stop {
                finished_reason = reason;
                break;
            }
        }
        Ok((outcome, finished_reason))
    }

    /// Journals one update (`sha256` is its digest when the connection computed it already) and
    /// feeds it to the engine, then executes the actions; `Some(reason)` when the run is over.
    #[allow(clippy::too_many_arguments)]
    fn feed_update(
        &mut self,
        now: f64,
        client: ClientId,
        round: u64,
        unit: UnitId,
        data: &mut [f32],
        sha256: Option<&[u8; 32]>,
        queue: &mut VecDeque<Event>,
        metrics: &mut RoundMetrics,
    ) -> anyhow::Result<Option<String>> {
        let digest = match sha256 {
            Some(d) => *d,
            None => crate::journal::update_digest(data),
        };
        let t = Instant::now();
        self.journal
            .record_digested_update(now, client, round, unit, data, &digest)
            .context("journalling an update")?;
        let actions = self.engine.handle_update(now, client, round, unit, data);
        self.timings.updates_s += t.elapsed().as_secs_f64();
        self.execute(now, actions, queue, metrics)
    }

    /// Central mode: gives the engine the joins of clients whose data is complete.
    fn central_ready(&mut self, queue: &mut VecDeque<Event>) -> anyhow::Result<()> {
        let Some(c) = self.central.as_mut() else {
            return Ok(());
        };
        for (client, units) in c.ready() {
            tracing::info!(
                client,
                "unit data complete; the client's units join the population"
            );
            self.admit(client, units, queue)?;
        }
        Ok(())
    }

    /// A client's units ask to enter the population (the engine checks them, during a
    /// DataRelease as during rounds).
    fn admit(
        &mut self,
        client: ClientId,
        units: Vec<UnitRange>,
        queue: &mut VecDeque<Event>,
    ) -> anyhow::Result<()> {
        queue.push_back(Event::ClientJoined { client, units });
        Ok(())
    }

    /// The release is accounted (the engine saw `LedgerAppended`): D_stable is published,
    /// handed to the model and the central mode's data, and each owner is told which of its
    /// prefixes are public. Errors are returned to the engine as a failed publication.
    fn publish_stable(&mut self, release: &StableRelease) -> anyhow::Result<()> {
        use fedrl_tasks::offline_cql::OfflineCqlTaskExt;
        let fedrl_common::scenario::Task::OfflineCql(task) = &self.scenario.task else {
            anyhow::bail!("a DataRelease ran for a task without expert demonstrations");
        };
        let spec = task.qnet_spec()?;
        let rows = super::release::stable_rows(&spec, release)?;
        let (stable, published) = super::release::publish(&rows, &spec, &self.scenario, &self.dir)?;
        let transitions = stable.len();
        self.model
            .stable_data()
            .context("this task trains on no released data")?
            .set_stable_data(stable)
            .context("handing D_stable to the model")?;
        self.snapshot = Bytes::from(encode_payload(self.model.params()));
        let prefixes: Vec<_> = release.prefixes.iter().map(|(p, _)| *p).collect();
        if let Some(c) = self.central.as_mut() {
            c.release_prefixes(&prefixes);
        }
        for (client, mine) in &release.owners {
            self.send(
                *client,
                Outbound::Control(Message::StableReleased(StableReleased {
                    prefixes: mine.clone(),
                })),
            );
        }
        let started = release.started_at.unwrap_or(release.done_at);
        let walk_s = (release.done_at - started).max(0.0);
        self.timings.data_release_s += walk_s;
        let spec = self.engine.config().release.clone();
        let p = spec.as_ref().map(|s| s.params);
        let p_min = fedrl_common::selective::expert_p_min(&task.dataset);
        // Informational: a bound that cannot be computed leaves the fields null.
        let (longest, bound) = match (&spec, p_min) {
            (Some(s), Some(p_min)) => super::release::stable_bound(s, self.scenario.users, p_min)
                .ok()
                .unzip(),
            _ => (None, None),
        };
        let cfg = self.scenario.selective().and_then(|s| s.release.as_ref());
        self.selective_report = Some(serde_json::json!({
            "release": {
                "epsilon_1": cfg.map(|r| r.epsilon),
                "delta_1": cfg.map(|r| r.delta),
                "chunk": cfg.map(|r| r.chunk),
                "trajectories_walked": release.walked,
                "prefixes_released": prefixes.len(),
                "stable_transitions": transitions,
                // The paper's derived ceiling (T x L*): how far the experts' disagreement kept
                // the release from it.
                "max_stable_prefix": longest,
                "stable_transitions_bound": bound,
                "epsilon_prime": p.map(|p| p.epsilon_prime),
                "delta_prime": p.map(|p| p.delta_prime),
                "c_min": p.map(|p| p.c_min),
                "theta": p.map(|p| p.theta),
                "theta_hat_offset": p.map(|p| p.theta_hat_offset),
                "noise": "discrete Laplace on a count grid of 2^-16 (exact, integer arithmetic)",
                "release_seconds": walk_s,
                // Of release_seconds: waiting for the agents to load their data and experts
                // (federated mode) before the first chunk's counts were all in.
                "agents_ready_seconds": release
                    .first_counts_at
                    .map_or(0.0, |f| (f - started).max(0.0)),
                "started_after_seconds": started,
                "published": published,
            },
        }));
        if let Some(summary) = &self.selective_report {
            super::release::write_summary(&self.dir, summary)
                .context("writing the release's summary beside D_stable")?;
        }
        tracing::info!(
            prefixes = prefixes.len(),
            transitions,
            walked = release.walked,
            refused = release.refused,
            dropped = release.dropped,
            "DataRelease accounted and published; training starts"
        );
        // A checkpoint right away: the state directory agrees with the ledger if the process
        // dies before the first round.
        self.save_checkpoint()?;
        Ok(())
    }

    /// Central mode: computes the pending offers' updates and feeds them to the engine, then
    /// drains the events that follow; `Some(reason)` when the run is over.
    fn run_central(
        &mut self,
        now: f64,
        queue: &mut VecDeque<Event>,
        metrics: &mut RoundMetrics,
    ) -> anyhow::Result<Option<String>> {
        let Some(c) = self.central.as_mut() else {
            return Ok(None);
        };
        let t = Instant::now();
        if c.summed() {
            // The summed path: one pre-summed contribution per round, journalled and fed as
            // one event (the engine quantises it once).
            let (sums, excluded) = c
                .compute_summed(self.model.params())
                .context("computing the units' clipped gradient sum (central mode)")?;
            self.timings.central_compute_s += t.elapsed().as_secs_f64();
            // The units left out first: the sum then closes a round that waits for nobody.
            if let Some(reason) = self.exclude(now, excluded, queue, metrics)? {
                return Ok(Some(reason));
            }
            for CentralSum {
                round,
                units,
                sum,
                loss,
            } in sums
            {
                self.round_stats.entry(round).or_default().loss = loss;
                self.journal
                    .record_sum(now, round, &units, &sum)
                    .context("journalling a summed contribution")?;
                let t = Instant::now();
                let actions = self.engine.handle_sum(now, round, &units, &sum);
                self.timings.updates_s += t.elapsed().as_secs_f64();
                if let Some(reason) = self.execute(now, actions, queue, metrics)? {
                    return Ok(Some(reason));
                }
            }
            return self.drain(now, queue, metrics);
        }
        let (updates, excluded) = c
            .compute(self.model.params())
            .context("computing the units' gradients (central mode)")?;
        self.timings.central_compute_s += t.elapsed().as_secs_f64();
        if let Some(reason) = self.exclude(now, excluded, queue, metrics)? {
            return Ok(Some(reason));
        }
        for CentralUpdate {
            client,
            round,
            unit,
            mut data,
        } in updates
        {
            if let Some(reason) =
                self.feed_update(now, client, round, unit, &mut data, None, queue, metrics)?
            {
                return Ok(Some(reason));
            }
        }
        self.drain(now, queue, metrics)
    }

    /// Central mode: units left out of a step because their gradient is not finite. Each is
    /// logged by unit id and client (operator-only) and fed to the engine, which resolves it
    /// as rejected; the run goes on. `Some(reason)` when the run is over.
    fn exclude(
        &mut self,
        now: f64,
        excluded: Vec<ExcludedUnit>,
        queue: &mut VecDeque<Event>,
        metrics: &mut RoundMetrics,
    ) -> anyhow::Result<Option<String>> {
        for ExcludedUnit {
            client,
            round,
            unit,
            reason,
        } in excluded
        {
            tracing::warn!(
                unit,
                client,
                round,
                reason = %reason,
                "unit left out of this step"
            );
            let actions = self.feed(
                now,
                Event::UnitExcluded {
                    client,
                    round,
                    unit,
                    reason,
                },
            )?;
            if let Some(reason) = self.execute(now, actions, queue, metrics)? {
                return Ok(Some(reason));
            }
        }
        Ok(None)
    }

    /// Feeds the queued events to the engine and executes their actions (which may queue more);
    /// `Some(reason)` when the run is over.
    fn drain(
        &mut self,
        now: f64,
        queue: &mut VecDeque<Event>,
        metrics: &mut RoundMetrics,
    ) -> anyhow::Result<Option<String>> {
        while let Some(ev) = queue.pop_front() {
            let actions = self.feed(now, ev)?;
            if let Some(reason) = self.execute(now, actions, queue, metrics)? {
                return Ok(Some(reason));
            }
        }
        Ok(None)
    }

    /// Journals `event` and feeds it to the engine. A tick is journalled only when it did
    /// something: a tick that yields no action leaves the engine unchanged, so a replay without
    /// it is the same (the engine's replay test drives it the same way).
    fn feed(&mut self, now: f64, event: Event) -> anyhow::Result<Vec<Action>> {
        if matches!(event, Event::Tick) {
            let actions = self.engine.handle(now, Event::Tick);
            if !actions.is_empty() {
                self.journal
                    .record(now, &Event::Tick)
                    .context("journalling an event")?;
            }
            return Ok(actions);
        }
        self.journal
            .record(now, &event)
            .context("journalling an event")?;
        let release = matches!(event, Event::LedgerAppended { .. });
        let t = Instant::now();
        let actions = self.engine.handle(now, event);
        if release {
            self.timings.release_s += t.elapsed().as_secs_f64();
        }
        Ok(actions)
    }

    /// Writes the pending metrics lines, with the ledger's epsilon as of now (nothing was
    /// appended since its round: the next commit flushes first).
    ///
    /// The epsilon is a full accounting (one PLD composition, up to half a second after 100,000
    /// DP-SGD steps), so a line carries it on every `max(1, rounds / 100)`-th round, on rounds
    /// with an evaluation and on the last round, and null in between; the end-of-run report
    /// always has it.
    fn flush_metrics_line(&mut self, metrics: &mut RoundMetrics) -> anyhow::Result<()> {
        if self.pending_eval.is_some() {
            // The pending line waits for its round's evaluation.
            return Ok(());
        }
        let (non_private, ledger) = (self.engine.config().non_private, &self.ledger);
        let rounds = self.scenario.rounds;
        let every = (rounds / 100).max(1);
        let ask = metrics.pending().is_some_and(|(round, evaluated)| {
            evaluated || round.is_multiple_of(every) || round >= rounds
        });
        let t = Instant::now();
        let r = metrics.flush(|| {
            (!non_private).then(|| {
                let eps = if ask { ledger.epsilon().ok() } else { None };
                (eps, ledger.config().delta.get())
            })
        });
        self.timings.metrics_epsilon_s += t.elapsed().as_secs_f64();
        r
    }

    /// Runs a pipelined evaluation on its own thread; the next round goes on meanwhile.
    fn start_evaluation(
        &mut self,
        job: EvaluationJob,
        metrics: &mut RoundMetrics,
    ) -> anyhow::Result<()> {
        // One at a time: every commit waits for the previous one, so none is pending here.
        self.settle_evaluation(metrics, true)?;
        let round = job.round();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("fedrl-evaluation".into())
            .spawn(move || {
                let t = Instant::now();
                let done = job.run();
                let _ = tx.send((done, t.elapsed().as_secs_f64()));
            })
            .context("starting an evaluation thread")?;
        self.pending_eval = Some(PendingEval { round, done: rx });
        Ok(())
    }

    /// Takes the pipelined evaluation's result if it is in (`wait`: waits for it), hands it to
    /// the model and to its round's metrics line, and writes a checkpoint that fell due
    /// meanwhile. `Some(round)`: the model released in `round` reached its target.
    fn settle_evaluation(
        &mut self,
        metrics: &mut RoundMetrics,
        wait: bool,
    ) -> anyhow::Result<Option<u64>> {
        let Some(pending) = &self.pending_eval else {
            return Ok(None);
        };
        let got = if wait {
            let t = Instant::now();
            let got = pending.done.recv().ok();
            self.timings.evaluation_wait_s += t.elapsed().as_secs_f64();
            got
        } else {
            match pending.done.try_recv() {
                Ok(got) => Some(got),
                Err(std::sync::mpsc::TryRecvError::Empty) => return Ok(None),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => None,
            }
        };
        let round = pending.round;
        self.pending_eval = None;
        let value = match got {
            Some((done, seconds)) => {
                self.timings.evaluation_s += seconds;
                self.model.evaluated(done)
            }
            // The evaluation thread panicked: its round's line says so, and training goes on.
            None => {
                serde_json::json!({ "eval_error": "the evaluation thread stopped without a result" })
            }
        };
        metrics.evaluated(round, value.clone());
        self.last_eval = Some(value);
        if std::mem::take(&mut self.checkpoint_due) {
            self.save_checkpoint()?;
        }
        Ok(self.model.finished().then_some(round))
    }

    /// Before anything of a later round is committed (its ledger record, its release, or an
    /// abandonment's line), the running evaluation must be in: when it reached the target, the
    /// engine is told instead and the run stops there, as with a synchronous evaluation.
    fn evaluation_before_commit(
        &mut self,
        metrics: &mut RoundMetrics,
        queue: &mut VecDeque<Event>,
    ) -> anyhow::Result<bool> {
        match self.settle_evaluation(metrics, true)? {
            Some(round) => {
                queue.push_back(Event::TargetReached { round });
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn send(&self, client: ClientId, out: Outbound) {
        if let Some(tx) = self.sessions.get(&client) {
            let _ = tx.send(out);
        }
    }

    /// Executes actions in order; returns `Some(reason)` when the run is over.
    fn execute(
        &mut self,
        now: f64,
        actions: Vec<Action>,
        queue: &mut VecDeque<Event>,
        metrics: &mut RoundMetrics,
    ) -> anyhow::Result<Option<String>> {
        for action in actions {
            match action {
                Action::SendOffer {
                    client,
                    spec,
                    units,
                } => match self.central.as_mut() {
                    Some(c) => c.offer(client, spec, units),
                    None => self.send(
                        client,
                        Outbound::Offer {
                            spec,
                            units,
                            model: self.snapshot.clone(),
                        },
                    ),
                },
                Action::Accepted {
                    client,
                    round,
                    unit,
                    norm,
                    clipped,
                } => {
                    self.accepted += 1;
                    let st = self.round_stats.entry(round).or_default();
                    st.accepted += 1;
                    st.norm_sum += norm;
                    st.norm_max = st.norm_max.max(norm);
                    // In the central mode the aggregator computed the update itself: nothing to
                    // acknowledge to the client.
                    if self.central.is_none() {
                        self.send(
                            client,
                            Outbound::Control(Message::Ack(Ack {
                                round,
                                unit,
                                norm,
                                clipped,
                            })),
                        );
                    }
                }
                Action::Rejected {
                    client,
                    round,
                    unit,
                    code,
                    message,
                } => {
                    self.rejected += 1;
                    tracing::warn!(client, ?code, message = %message, "rejected");
                    let msg = Message::error(code, &message, round, unit);
                    if code == ErrorCode::UnitsInUse {
                        self.send(
                            client,
                            Outbound::Close {
                                code: close_code::REFUSED,
                                message: Some(msg),
                                reason: message,
                            },
                        );
                    } else {
                        self.send(client, Outbound::Control(msg));
                    }
                }
                Action::AppendLedger { round, record } => {
                    if self.evaluation_before_commit(metrics, queue)? {
                        // Not appended: nothing of this round is recorded or released.
                        continue;
                    }
                    self.flush_metrics_line(metrics)?;
                    let mut record = *record;
                    record.unix_time_s = SystemTime::now()
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .map(|d| d.as_secs_f64())
                        .unwrap_or(0.0);
                    // Checked against the budget, appended and fsynced; the engine releases the
                    // round only after hearing so.
                    let t = Instant::now();
                    let appended = match self.ledger_fault {
                        Some(n) if self.ledger.records().len() as u64 >= n => {
                            Err(LedgerError::Io {
                                path: self.ledger.path().to_path_buf(),
                                source: std::io::Error::other(format!(
                                    "write refused by the test hook {FAIL_LEDGER_AFTER_ENV}={n}"
                                )),
                            })
                        }
                        _ => self.ledger.append(record),
                    };
                    self.timings.ledger_append_s += t.elapsed().as_secs_f64();
                    match appended {
                        Ok(()) => queue.push_back(Event::LedgerAppended { round }),
                        Err(e) => {
                            eprintln!("round {round} not released: {e}");
                            // An exhausted budget ends the run; anything else (a write that
                            // failed, a record the ledger refuses) is an error.
                            if !matches!(e, LedgerError::BudgetExceeded { .. }) {
                                self.failure = Some(e.to_string());
                            }
                            queue.push_back(Event::LedgerRefused {
                                round,
                                reason: e.to_string(),
                            });
                        }
                    }
                }
                Action::Release(release) => {
                    // A twin's round comes here without a ledger record: its evaluation check.
                    if self.evaluation_before_commit(metrics, queue)? {
                        continue;
                    }
                    let round = release.round;
                    self.last_round = self.last_round.max(round);
                    self.flush_metrics_line(metrics)?;
                    let t = Instant::now();
                    // Public diagnostics: the released update and the step it caused in the
                    // offered parameters (post-processing of the release).
                    let update_norm = l2(release.noisy_mean.iter().map(|&x| f64::from(x)));
                    let before = self.model.params().to_vec();
                    if let Err(e) = self.model.apply(&release.noisy_mean) {
                        self.failure = Some(e.to_string());
                        queue.push_back(Event::ReleaseFailed {
                            round,
                            reason: e.to_string(),
                        });
                        continue;
                    }
                    self.snapshot = Bytes::from(encode_payload(self.model.params()));
                    let after = self.model.params();
                    let mut diagnostics = serde_json::Map::new();
                    diagnostics.insert("update_norm".into(), finite(update_norm));
                    if after.len() == before.len() {
                        let step = l2(after
                            .iter()
                            .zip(&before)
                            .map(|(&a, &b)| f64::from(a) - f64::from(b)));
                        diagnostics.insert("step_norm".into(), finite(step));
                    }
                    diagnostics.insert(
                        "param_norm".into(),
                        finite(l2(after.iter().map(|&x| f64::from(x)))),
                    );
                    diagnostics.extend(self.model.diagnostics());
                    self.timings.apply_s += t.elapsed().as_secs_f64();
                    let stats = self.round_stats.remove(&round).unwrap_or_default();
                    self.round_stats.retain(|&r, _| r > round);
                    let operator_diagnostics =
                        stats.operator_diagnostics(release.accepted, release.clipped);
                    match self.model.evaluation_job(round) {
                        // Pipelined: the next round's offers go out while it runs.
                        Some(job) => {
                            self.last_eval = None;
                            self.start_evaluation(job, metrics)?;
                        }
                        None => {
                            let t = Instant::now();
                            self.last_eval = self.model.evaluate(round);
                            self.timings.evaluation_s += t.elapsed().as_secs_f64();
                        }
                    }
                    self.users_released += release.accepted;
                    // The epsilon is filled in by `flush_metrics_line`.
                    metrics.released(Released {
                        round,
                        t_s: now,
                        eval: self.last_eval.clone(),
                        diagnostics,
                        operator_diagnostics,
                        users: self.users_released,
                        accepted: release.accepted,
                        clipped: release.clipped,
                        offered: release.offered,
                        rejected: release.rejected,
                        rounds_completed: self.engine.rounds_completed() + 1,
                        rounds_abandoned: self.engine.rounds_abandoned(),
                    });
                    if (self.engine.rounds_completed() + 1)
                        .is_multiple_of(self.scenario.checkpoint_every)
                    {
                        if self.pending_eval.is_some() {
                            self.checkpoint_due = true;
                        } else {
                            self.save_checkpoint()?;
                        }
                    }
                    // The engine decides whether reaching the target ends the run.
                    queue.push_back(Event::Released {
                        round,
                        target_reached: self.model.finished(),
                    });
                }
                Action::Abandoned {
                    round,
                    accepted,
                    quorum,
                    offered,
                    reason,
                } => {
                    eprintln!("round {round} abandoned: {reason}");
                    self.last_round = self.last_round.max(round);
                    self.round_stats.retain(|&r, _| r > round);
                    // Lines stay in round order: the released round's line, with its
                    // evaluation, goes first (the engine may already have opened the next
                    // round; a target reached stops it).
                    self.evaluation_before_commit(metrics, queue)?;
                    self.flush_metrics_line(metrics)?;
                    metrics.abandoned(Abandoned {
                        round,
                        t_s: now,
                        accepted,
                        quorum,
                        offered,
                        rounds_completed: self.engine.rounds_completed(),
                        rounds_abandoned: self.engine.rounds_abandoned(),
                        reason,
                    })?;
                }
                Action::RequestSteps { client, request } => {
                    self.send(
                        client,
                        Outbound::Control(Message::TrajectoryRequest(request)),
                    );
                }
                Action::QueryPrefix {
                    client,
                    query,
                    payload,
                } => {
                    self.send(
                        client,
                        Outbound::ControlWithPayload(Message::PrefixQuery(query), payload),
                    );
                }
                Action::DropClient { client, message } => {
                    self.rejected += 1;
                    tracing::warn!(client, message = %message, "DataRelease: client dropped");
                    self.send(
                        client,
                        Outbound::Close {
                            code: close_code::PROTOCOL,
                            message: Some(Message::error(
                                ErrorCode::Unexpected,
                                &message,
                                None,
                                None,
                            )),
                            reason: message,
                        },
                    );
                }
                Action::PublishStable(release) => {
                    let failed = match self.publish_stable(&release) {
                        Ok(()) => None,
                        Err(e) => {
                            let m = format!("{e:#}");
                            self.failure = Some(m.clone());
                            Some(m)
                        }
                    };
                    queue.push_back(Event::StablePublished { failed });
                }
                Action::Finished { reason } => {
                    self.ended_by_engine = true;
                    return Ok(Some(reason));
                }
            }
        }
        Ok(None)
    }

    fn save_checkpoint(&self) -> anyhow::Result<()> {
        let meta = CheckpointMeta {
            round: self.ledger.last_round().unwrap_or(0).max(self.last_round),
            rounds_completed: self.engine.rounds_completed(),
            rounds_abandoned: self.engine.rounds_abandoned(),
            ledger_records: self.ledger.records().len() as u64,
            ledger_head: Some(self.ledger.head()),
            model_meta: serde_json::Value::Null,
            tensors: 0,
            tensors_sha256: String::new(),
        };
        checkpoint::save(&self.dir, meta, &self.model.state())?;
        Ok(())
    }

    fn report(&self, finished: String, outcome: Outcome) -> anyhow::Result<RunReport> {
        let rep = self.ledger.report().context("accounting the ledger")?;
        let non_private = self.engine.config().non_private;
        Ok(RunReport {
            public: PublicReport {
                scenario: self.scenario.name.clone(),
                rounds_completed: self.engine.rounds_completed(),
                rounds_abandoned: self.engine.rounds_abandoned(),
                rounds_attempted: self.engine.rounds_completed() + self.engine.rounds_abandoned(),
                report_version: super::report::REPORT_VERSION,
                // A twin has no epsilon: null, not an infinite number or a string.
                epsilon: (!non_private).then_some(rep.epsilon),
                epsilon_rdp: (!non_private).then_some(rep.epsilon_rdp),
                zcdp_rho: if self.engine.config().non_private {
                    None
                } else {
                    rep.zcdp_rho
                },
                delta: rep.delta,
                target_epsilon: rep.target_epsilon,
                seeded: rep.noise_sources.iter().any(|s| !s.is_private()),
                noise_source: super::report::describe_noise(
                    &rep.noise_sources,
                    self.scenario.seed,
                    non_private,
                ),
                accountant: if self.engine.config().non_private {
                    // The engine neither re-clips nor adds noise; a task may still project
                    // each local update (PriMORL's `nonprivate_clip_norm`), so say "server".
                    "none (non-private twin: no server-side clipping, no noise)".into()
                } else {
                    rep.accountant.clone()
                },
                wall_seconds: self.started.elapsed().as_secs_f64(),
                finished,
                outcome,
                // The one final evaluation: the model's own end-of-run one, else (a task
                // without one) its last periodic evaluation.
                final_evaluation: self.final_eval.clone().or_else(|| self.last_eval.clone()),
                non_private: self.engine.config().non_private,
                selective: self.selective_report.clone(),
            },
            operator: OperatorCounts {
                units: rep.units,
                updates_accepted: self.accepted,
                updates_rejected: self.rejected,
                bytes_ingested: self.shared.bytes_ingested.load(Ordering::Relaxed),
                update_buffers_allocated: self.shared.pool.allocated.load(Ordering::Relaxed),
                timings: self.timings.clone(),
                connections: self.shared.stats.snapshot(),
                ledger_head: Some(self.ledger.head()),
                model_audit: self.model_audit.clone(),
            },
        })
    }
}
