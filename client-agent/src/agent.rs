//! The client-agent runtime: connect (pinned certificate), join with the enrolment token, answer
//! round offers for the hosted users, reconnect with backoff, and misbehave on purpose when the
//! scenario's churn model says so.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fedrl_common::privacy::clipping::clip_l2;
use fedrl_common::protocol::{
    DataComplete, DecodeError, ErrorCode, Join, LeaveReason, MAX_CONTROL_FRAME_BYTES, Message,
    PrefixCounts, PrefixQuery, RoundOffer, TrajectoryData, TrajectoryRequest, UnitData, UnitId,
    UnitRange, Update, Welcome, encode_payload, frame_prefix,
};
use fedrl_common::scenario::Churn;
use quinn::{Connection, ConnectionError, VarInt};
use rand::rngs::ChaCha20Rng;
use rand::{RngExt, SeedableRng};
use tokio::sync::Semaphore;

use crate::tls;
use fedrl_common::protocol::close_code;
use fedrl_common::protocol::quic_io::{ReadFrameError, WriteFrameError, read_frame, write_frame};
use fedrl_tasks::{LocalTrainer, TrainerFactory, UnitUpload};

/// Why a DataRelease request is not answered when the task has no expert capability.
const NO_EXPERTS: &str = "this task hosts no experts";

/// How to run a client agent.
#[derive(Clone)]
pub struct AgentOptions {
    pub server: SocketAddr,
    /// SHA-256 of the aggregator's certificate.
    pub fingerprint: [u8; 32],
    /// Enrolment token (`<client-id>.<hex>`).
    pub token: String,
    /// Units hosted by this agent.
    pub units: Vec<UnitRange>,
    /// TLS server name (the aggregator's certificate names `fedrl-aggregator` and `localhost`;
    /// with pinning the name is not what is checked).
    pub server_name: String,
    /// Longest wait between reconnection attempts, seconds. Default 2.
    pub max_backoff_s: f64,
    /// Give up after this many seconds without a successful join, counted from the start or
    /// from the end of the last joined session; every wait (handshake, welcome, backoff) is cut
    /// at this bound. Infinite: never. Default 60.
    pub give_up_after_s: f64,
    /// Overrides the churn model the server announces (load generators, tests).
    pub churn_override: Option<Churn>,
    /// Share one endpoint among many agents (load generator); `None`: the agent makes its own.
    pub endpoint: Option<quinn::Endpoint>,
    /// Limits concurrent handshakes across agents sharing it (RUST-NOTES: 64 keeps thousands of
    /// connections from timing out).
    pub handshake_limit: Option<Arc<Semaphore>>,
    /// Updates per upload stream. Default 64.
    pub updates_per_stream: usize,
    /// Seed for the churn model's random choices (`None`: from the OS).
    pub churn_seed: Option<u64>,
    /// Replaces the QUIC transport configuration of [`tls::client_config`] (keep-alive 1 s, idle
    /// timeout 8 s, quinn's defaults otherwise), e.g. to send large datagrams on loopback. Set
    /// keep-alive and idle timeout too when using it.
    pub transport: Option<Arc<quinn::TransportConfig>>,
}

impl AgentOptions {
    pub fn new(
        server: SocketAddr,
        fingerprint: [u8; 32],
        token: String,
        units: Vec<UnitRange>,
    ) -> Self {
        AgentOptions {
            server,
            fingerprint,
            token,
            units,
            server_name: "fedrl-aggregator".into(),
            max_backoff_s: 2.0,
            give_up_after_s: 60.0,
            churn_override: None,
            endpoint: None,
            handshake_limit: None,
            updates_per_stream: 64,
            churn_seed: None,
            transport: None,
        }
    }
}

/// What an agent did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct AgentSummary {
    pub offers: u64,
    pub updates_sent: u64,
    pub acks: u64,
    /// Error messages received about single updates (the first 20).
    pub errors: Vec<String>,
    pub error_count: u64,
    pub dropped_by_churn: u64,
    pub disconnects_by_churn: u64,
    pub sessions: u64,
    /// Updates that were at the clip norm when uploaded (clipped by the trainer or here):
    /// whether C binds, for tuning it. Operator-only like every count here; the aggregator
    /// cannot see it, since it only re-clips what arrives already clipped.
    pub clipped: u64,
    /// Why the agent stopped.
    pub finished: String,
}

/// Why an agent stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The server refused us for good (bad token, wrong version, units in use, pinning failure).
    #[error("refused by the aggregator: {0}")]
    Refused(String),
    /// This agent failed on its own side (its trainer or dataset could not be built, its own
    /// message could not be encoded): the aggregator refused nothing.
    #[error("this client agent failed (the aggregator did not refuse it): {0}")]
    Local(String),
    /// No successful join for too long.
    #[error("gave up after {secs:.1} s without joining the aggregator; last error: {last}")]
    GaveUp { secs: f64, last: String },
    /// The aggregator stopped the run for an error (a ledger write that failed, ...): the run is
    /// not finished, and reconnecting would not help.
    #[error("aggregator stopped: {0}")]
    AggregatorFailed(String),
    #[error("{0}")]
    Other(String),
}

enum SessionEnd {
    /// The run is over: exit.
    Finished(String),
    /// Refused for good (authentication, protocol, units in use).
    Fatal(String),
    /// Failed here, for good: the agent's own trainer or dataset, not the aggregator.
    Local(String),
    /// The aggregator stopped the run for an error.
    Failed(String),
    /// Reconnect (with backoff, until the give-up limit): a lost connection, or an aggregator
    /// shutting down that will resume the run.
    Retry(String),
}

struct Agent {
    opts: AgentOptions,
    factory: TrainerFactory,
    trainer: Option<Arc<Mutex<Box<dyn LocalTrainer>>>>,
    churn: Churn,
    rng: ChaCha20Rng,
    summary: AgentSummary,
    /// Where the pinned-certificate verifier reports a mismatch (see `handshake_failed`).
    pin: tls::PinReport,
    /// This agent's instance, sent in every join: the aggregator lets a reconnect of this
    /// instance replace its old connection and refuses another instance with the same token
    /// while this one is connected.
    instance: u64,
    /// DataRelease: the candidate being walked, as this agent was sent it.
    walk: Option<CandidateWalk>,
}

/// What an agent keeps of the DataRelease's current candidate: its query, the number of steps
/// sent so far, and each hosted expert's probability of that prefix (the next chunk's counts
/// continue from it).
struct CandidateWalk {
    query: u64,
    steps: u32,
    running: Vec<f64>,
}

/// Runs an agent until the aggregator says the run is over. Reconnects with exponential backoff
/// (100 ms doubling to `max_backoff_s`, with jitter) after any connection loss.
pub async fn run_agent(
    opts: AgentOptions,
    factory: TrainerFactory,
) -> Result<AgentSummary, AgentError> {
    if opts.give_up_after_s.is_nan() || opts.give_up_after_s < 0.0 {
        return Err(AgentError::Other(format!(
            "the give-up limit must be a number of seconds >= 0, got {}",
            opts.give_up_after_s
        )));
    }
    let endpoint = match &opts.endpoint {
        Some(ep) => ep.clone(),
        None => {
            tls::client_endpoint(opts.server).map_err(|e| AgentError::Other(format!("{e:#}")))?
        }
    };
    let rng = match opts.churn_seed {
        Some(s) => ChaCha20Rng::seed_from_u64(s),
        None => rand::make_rng::<ChaCha20Rng>(),
    };
    let (mut client_cfg, pin) = tls::pinned_client_config(opts.fingerprint)
        .map_err(|e| AgentError::Other(format!("{e:#}")))?;
    let mut agent = Agent {
        // Drawn from the OS, never from the churn seed: agents started with one seed must
        // still be told apart.
        instance: rand::make_rng::<ChaCha20Rng>().random(),
        churn: opts.churn_override.clone().unwrap_or_default(),
        opts,
        factory,
        trainer: None,
        rng,
        summary: AgentSummary::default(),
        pin,
        walk: None,
    };
    if let Some(t) = &agent.opts.transport {
        client_cfg.transport_config(t.clone());
    }
    // Seconds are a real bound: every wait before a join (a handshake slot, the handshake, the
    // welcome, the backoff) is cut at the give-up time.
    let give_up = Duration::try_from_secs_f64(agent.opts.give_up_after_s).ok();
    let mut backoff = 0.1f64;
    // The start, or the end of the last joined session: the give-up limit counts from here.
    let mut since = Instant::now();
    loop {
        let give_up_at = give_up.and_then(|d| since.checked_add(d));
        let (end, joined) = agent.session(&endpoint, &client_cfg, give_up_at).await;
        if joined {
            since = Instant::now();
            backoff = 0.1;
        }
        let gave_up = |last: String| AgentError::GaveUp {
            secs: since.elapsed().as_secs_f64(),
            last,
        };
        match end {
            SessionEnd::Finished(why) => {
                agent.summary.finished = why;
                if agent.opts.endpoint.is_none() {
                    endpoint.close(VarInt::from_u32(0), b"done");
                    let _ =
                        tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
                }
                return Ok(agent.summary);
            }
            SessionEnd::Fatal(why) => return Err(AgentError::Refused(why)),
            SessionEnd::Local(why) => return Err(AgentError::Local(why)),
            SessionEnd::Failed(why) => return Err(AgentError::AggregatorFailed(why)),
            SessionEnd::Retry(why) => {
                let give_up_at = give_up.and_then(|d| since.checked_add(d));
                let left = give_up_at.map(|t| t.saturating_duration_since(Instant::now()));
                if left.is_some_and(|l| l.is_zero()) {
                    return Err(gave_up(why));
                }
                tracing::info!(reason = %why, backoff, "reconnecting");
                let jitter = 0.75 + 0.5 * agent.rng.random::<f64>();
                let mut wait = Duration::from_secs_f64(backoff * jitter);
                if let Some(l) = left {
                    wait = wait.min(l);
                }
                tokio::time::sleep(wait).await;
                if give_up_at.is_some_and(|t| Instant::now() >= t) {
                    return Err(gave_up(why));
                }
                backoff = (backoff * 2.0).min(agent.opts.max_backoff_s);
            }
        }
    }
}

/// Closes a client agent's endpoint and waits (up to 1 s) for the close to reach the aggregator.
/// `leaving`: the agent stops before the run is over (its operator stopped it), and says so with
/// [`close_code::SHUTDOWN`], so the aggregator drops its units at once instead of after the idle
/// timeout; otherwise the run is over (code 0). For endpoints passed in
/// [`AgentOptions::endpoint`], which [`run_agent`] leaves open.
pub async fn close_endpoint(endpoint: &quinn::Endpoint, leaving: bool) {
    if leaving {
        endpoint.close(
            VarInt::from_u32(close_code::SHUTDOWN),
            b"client agent leaving (stopped by its operator)",
        );
    } else {
        endpoint.close(VarInt::from_u32(0), b"done");
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
}

/// How a failed handshake ends the session: a certificate other than the pinned one (reported
/// by the verifier, by type) is fatal; anything else is judged by the connection error.
fn handshake_failed(e: &ConnectionError, mismatch: Option<tls::FingerprintMismatch>) -> SessionEnd {
    match mismatch {
        Some(m) => SessionEnd::Fatal(m.to_string()),
        None => close_end(e),
    }
}

/// Why the churn model the aggregator announced was refused.
#[derive(Debug, thiserror::Error)]
pub enum ChurnError {
    /// `churn_json` is not a churn model.
    #[error("the aggregator announced an unreadable churn model: {0}")]
    Json(#[from] serde_json::Error),
    /// A probability outside [0, 1] or a negative or non-finite latency.
    #[error("the aggregator announced an invalid churn model: {0}")]
    Invalid(String),
}

/// Parses the churn model of a welcome. Bad input is an error the agent reports, never
/// silently the default (which would run a stress test without its stress).
pub fn parse_churn(json: &str) -> Result<Churn, ChurnError> {
    let churn: Churn = serde_json::from_str(json)?;
    for (name, p) in [
        ("drop_before_upload", churn.drop_before_upload),
        ("disconnect_mid_upload", churn.disconnect_mid_upload),
    ] {
        if !(0.0..=1.0).contains(&p) {
            return Err(ChurnError::Invalid(format!(
                "{name} must be a probability in [0, 1], got {p}"
            )));
        }
    }
    if !(churn.added_latency_s.is_finite() && churn.added_latency_s >= 0.0) {
        return Err(ChurnError::Invalid(format!(
            "added_latency_s must be finite and >= 0, got {}",
            churn.added_latency_s
        )));
    }
    Ok(churn)
}

fn close_end(e: &ConnectionError) -> SessionEnd {
    match e {
        ConnectionError::ApplicationClosed(c) => {
            let reason = String::from_utf8_lossy(&c.reason).to_string();
            let code = c.error_code.into_inner();
            if code == u64::from(close_code::FINISHED) {
                SessionEnd::Finished(reason)
            } else if code == u64::from(close_code::ERROR) {
                SessionEnd::Failed(reason)
            } else if code == u64::from(close_code::SHUTDOWN) {
                SessionEnd::Retry(format!("the aggregator is shutting down: {reason}"))
            } else if code == u64::from(close_code::AUTH)
                || code == u64::from(close_code::REFUSED)
                || code == u64::from(close_code::PROTOCOL)
            {
                SessionEnd::Fatal(reason)
            } else {
                SessionEnd::Retry(format!("closed by the aggregator ({code}): {reason}"))
            }
        }
        other => SessionEnd::Retry(other.to_string()),
    }
}

impl Agent {
    /// One connection. Returns how it ended and whether the join succeeded. Everything before
    /// the welcome ends at `give_up_at`.
    async fn session(
        &mut self,
        endpoint: &quinn::Endpoint,
        cfg: &quinn::ClientConfig,
        give_up_at: Option<Instant>,
    ) -> (SessionEnd, bool) {
        let mut step = "waiting for a handshake slot";
        let joining = self.join(endpoint, cfg, &mut step);
        let joined = match give_up_at {
            Some(t) => tokio::time::timeout_at(t.into(), joining).await,
            None => Ok(joining.await),
        };
        let (conn, mut send, recv, welcome) = match joined {
            Ok(Ok(j)) => j,
            Ok(Err(end)) => return (end, false),
            Err(_) => {
                return (
                    SessionEnd::Retry(format!("timed out {step} at the give-up limit")),
                    false,
                );
            }
        };
        if self.trainer.is_none() {
            match (self.factory)(&welcome, &self.opts.units) {
                Ok(t) => self.trainer = Some(Arc::new(Mutex::new(t))),
                Err(e) => {
                    return (
                        SessionEnd::Local(format!("cannot build the trainer: {e:#}")),
                        true,
                    );
                }
            }
            if self.opts.churn_override.is_none() {
                match parse_churn(&welcome.churn_json) {
                    Ok(c) => self.churn = c,
                    Err(e) => return (SessionEnd::Fatal(e.to_string()), true),
                }
            }
        }
        // Central update mode: the units' data goes to the aggregator once per session, before
        // the agent's units can be sampled.
        let uploads = self
            .trainer
            .as_ref()
            .and_then(|t| {
                let t = t.lock().unwrap_or_else(|p| p.into_inner());
                t.central_data().map(|c| c.unit_data())
            })
            .unwrap_or_default();
        if !uploads.is_empty() {
            tracing::info!(units = uploads.len(), "uploading the units' data");
            if let Err(e) = upload_unit_data(&conn, &uploads).await {
                return (SessionEnd::Retry(format!("uploading unit data: {e}")), true);
            }
            let done = Message::DataComplete(DataComplete {
                units: uploads.len() as u64,
            });
            if let Err(e) = write_frame(&mut send, &done, &[]).await {
                return (SessionEnd::Retry(e.to_string()), true);
            }
        }
        let end = self.serve(&conn, recv, &welcome).await;
        (end, true)
    }

    /// Connects and joins: the connection, its control stream and the welcome, or how the
    /// attempt ended. `step` says what it is doing (for the give-up message).
    async fn join(
        &mut self,
        endpoint: &quinn::Endpoint,
        cfg: &quinn::ClientConfig,
        step: &mut &'static str,
    ) -> Result<(Connection, quinn::SendStream, quinn::RecvStream, Welcome), SessionEnd> {
        let conn = {
            *step = "waiting for a handshake slot";
            let _permit = match &self.opts.handshake_limit {
                Some(s) => s.clone().acquire_owned().await.ok(),
                None => None,
            };
            // A mismatch left over from an earlier attempt must not classify this one.
            let _ = self.pin.take();
            *step = "connecting (QUIC handshake)";
            let connecting = endpoint
                .connect_with(cfg.clone(), self.opts.server, &self.opts.server_name)
                .map_err(|e| SessionEnd::Retry(e.to_string()))?;
            match tokio::time::timeout(Duration::from_secs(10), connecting).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => return Err(handshake_failed(&e, self.pin.take())),
                Err(_) => return Err(SessionEnd::Retry("handshake timed out".into())),
            }
        };
        self.summary.sessions += 1;
        *step = "joining";
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| close_end(&e))?;
        let join = Message::Join(Join {
            token: self.opts.token.clone(),
            units: self.opts.units.clone(),
            agent: format!("fedrl-client {}", env!("CARGO_PKG_VERSION")),
            instance: self.instance,
        });
        match write_frame(&mut send, &join, &[]).await {
            Ok(()) => {}
            // Our own join does not encode: a bug or a misconfiguration, not a network problem.
            Err(e @ WriteFrameError::Encode(_)) => return Err(SessionEnd::Local(e.to_string())),
            Err(e @ WriteFrameError::Write(_)) => return Err(SessionEnd::Retry(e.to_string())),
        }
        *step = "waiting for the welcome";
        let welcome =
            match read_frame(&mut recv, MAX_CONTROL_FRAME_BYTES, Duration::from_secs(10)).await {
                Ok(Some(f)) => match f.message {
                    Message::Welcome(w) => w,
                    // Another process holds our token, or our own crashed predecessor's
                    // connection has not timed out yet: retry (with backoff, until the give-up
                    // limit, which then names this reason).
                    Message::Error(e) if e.code == ErrorCode::AlreadyConnected => {
                        tracing::error!(message = %e.message, "join refused");
                        return Err(SessionEnd::Retry(e.message));
                    }
                    Message::Error(e) => {
                        return Err(SessionEnd::Fatal(format!("{:?}: {}", e.code, e.message)));
                    }
                    other => {
                        return Err(SessionEnd::Fatal(format!(
                            "expected a welcome, got {}",
                            other.kind()
                        )));
                    }
                },
                Ok(None) => {
                    return Err(SessionEnd::Retry(
                        "control stream closed before the welcome".into(),
                    ));
                }
                Err(ReadFrameError::Decode(e)) => return Err(SessionEnd::Fatal(e.to_string())),
                Err(e) => {
                    // The server may have closed with a reason (e.g. authentication failed).
                    if let Some(reason) = conn.close_reason() {
                        return Err(close_end(&reason));
                    }
                    return Err(SessionEnd::Retry(e.to_string()));
                }
            };
        Ok((conn, send, recv, welcome))
    }

    async fn serve(
        &mut self,
        conn: &Connection,
        mut recv: quinn::RecvStream,
        welcome: &Welcome,
    ) -> SessionEnd {
        // The control stream is read by its own task (`read_frame` is not cancellation-safe and
        // must not sit in a `select!`).
        let (ctl_tx, mut ctl_rx) = tokio::sync::mpsc::channel(1024);
        let reader = tokio::spawn(async move {
            loop {
                let r = read_frame(
                    &mut recv,
                    MAX_CONTROL_FRAME_BYTES,
                    Duration::from_secs(3600),
                )
                .await;
                let end = !matches!(r, Ok(Some(_)));
                if ctl_tx.send(r).await.is_err() || end {
                    break;
                }
            }
        });
        let end = self.serve_inner(conn, &mut ctl_rx, welcome).await;
        reader.abort();
        end
    }

    async fn serve_inner(
        &mut self,
        conn: &Connection,
        ctl_rx: &mut tokio::sync::mpsc::Receiver<
            Result<Option<fedrl_common::protocol::Frame>, ReadFrameError>,
        >,
        welcome: &Welcome,
    ) -> SessionEnd {
        let mut control_open = true;
        loop {
            tokio::select! {
                frame = ctl_rx.recv(), if control_open => {
                    match frame {
                        Some(Ok(Some(f))) => match f.message {
                            Message::Ack(_) => self.summary.acks += 1,
                            Message::Error(e) => {
                                self.summary.error_count += 1;
                                if self.summary.errors.len() < 20 {
                                    self.summary.errors.push(format!("{:?}: {}", e.code, e.message));
                                }
                                tracing::warn!(code = ?e.code, message = %e.message, "aggregator error");
                                if matches!(e.code, ErrorCode::AuthFailed | ErrorCode::UnsupportedVersion | ErrorCode::UnitsInUse) {
                                    return SessionEnd::Fatal(format!("{:?}: {}", e.code, e.message));
                                }
                            }
                            Message::Leave(l) => match l.reason {
                                LeaveReason::Finished => return SessionEnd::Finished(l.message),
                                LeaveReason::Shutdown => return SessionEnd::Retry(l.message),
                            },
                            Message::TrajectoryRequest(r) => self.send_trajectory(conn, r).await,
                            Message::PrefixQuery(q) => self.answer_prefix_query(conn, q, f.payload).await,
                            Message::StableReleased(r) => {
                                if let Some(t) = &self.trainer
                                    && let Some(h) = t.lock().unwrap_or_else(|p| p.into_inner()).expert_host()
                                {
                                    h.stable_released(&r.prefixes);
                                }
                            }
                            _ => {}
                        },
                        _ => control_open = false,
                    }
                }
                stream = conn.accept_uni() => {
                    let mut s = match stream {
                        Ok(s) => s,
                        Err(e) => return close_end(&e),
                    };
                    let frame = match read_frame(&mut s, welcome.max_frame_bytes, Duration::from_secs(60)).await {
                        Ok(Some(f)) => f,
                        Ok(None) => continue,
                        Err(e) => {
                            tracing::warn!(error = %e, "unreadable offer stream; skipped");
                            continue;
                        }
                    };
                    tracing::debug!("offer frame received");
                    if let Message::RoundOffer(offer) = frame.message
                        && let Some(end) = self.answer(conn, offer, frame.payload).await
                    {
                        return end;
                    }
                }
            }
        }
    }

    /// DataRelease: sends the steps of a candidate the coordinator asked for on their own
    /// stream (and nothing more of the episode).
    async fn send_trajectory(&mut self, conn: &Connection, r: TrajectoryRequest) {
        let Some(trainer) = self.trainer.clone() else {
            return;
        };
        let rows = match trainer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .expert_host()
        {
            Some(h) => h.episode_rows(r.unit, r.episode, r.from_step, r.steps),
            None => Err(NO_EXPERTS.to_string()),
        };
        let (up, first_row, ended) = match rows {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(unit = r.unit, episode = r.episode, error = %e, "trajectory request not answered");
                return;
            }
        };
        let msg = Message::TrajectoryData(TrajectoryData {
            query: r.query,
            unit: r.unit,
            episode: r.episode,
            first_row,
            from_step: r.from_step,
            rows: up.rows,
            obs_dim: up.obs_dim,
            ended,
        });
        if let Err(e) = send_on_stream(conn, &msg, &up.payload).await {
            tracing::warn!(error = %e, "sending a trajectory failed");
        }
    }

    /// DataRelease: answers a chunk of a candidate trajectory with the summed prefix
    /// probabilities of this agent's experts (computed off the async runtime), continuing from
    /// the candidate's earlier chunks.
    async fn answer_prefix_query(&mut self, conn: &Connection, q: PrefixQuery, payload: Vec<f32>) {
        let Some(trainer) = self.trainer.clone() else {
            return;
        };
        let (steps, d) = (q.steps as usize, q.obs_dim as usize);
        if payload.len() != steps * (d + 1) || steps == 0 {
            tracing::warn!(
                query = q.query,
                "prefix query of the wrong length; not answered"
            );
            return;
        }
        let mut running = match self.walk.take() {
            _ if q.from_step == 0 => Vec::new(),
            Some(w) if w.query == q.query && w.steps == q.from_step => w.running,
            _ => {
                tracing::warn!(
                    query = q.query,
                    from_step = q.from_step,
                    "prefix query continuing a candidate this agent was not sent; not answered"
                );
                return;
            }
        };
        let mut obs = Vec::with_capacity(steps * d);
        let mut actions = Vec::with_capacity(steps);
        for row in payload.chunks_exact(d + 1) {
            obs.extend_from_slice(&row[..d]);
            let a = row[d];
            if !(a.is_finite() && a >= 0.0 && a.fract() == 0.0) {
                tracing::warn!(
                    query = q.query,
                    "prefix query with a bad action; not answered"
                );
                return;
            }
            actions.push(a as u32);
        }
        let counts = tokio::task::spawn_blocking(move || {
            let c = match trainer
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .expert_host()
            {
                Some(h) => h.prefix_counts(&mut running, &obs, &actions),
                None => Err(NO_EXPERTS.to_string()),
            };
            c.map(|c| (c, running))
        })
        .await;
        let counts = match counts {
            Ok(Ok((c, running))) => {
                self.walk = Some(CandidateWalk {
                    query: q.query,
                    steps: q.from_step + q.steps,
                    running,
                });
                c
            }
            Ok(Err(e)) => {
                tracing::warn!(query = q.query, error = %e, "prefix query not answered");
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "the prefix count task failed");
                return;
            }
        };
        let msg = Message::PrefixCounts(PrefixCounts {
            query: q.query,
            from_step: q.from_step,
            counts,
        });
        if let Err(e) = send_on_stream(conn, &msg, &[]).await {
            tracing::warn!(error = %e, "sending prefix counts failed");
        }
    }

    /// Computes, clips and uploads the offered units' updates. `Some` when the session must end
    /// (a simulated disconnect).
    async fn answer(
        &mut self,
        conn: &Connection,
        offer: RoundOffer,
        global: Vec<f32>,
    ) -> Option<SessionEnd> {
        self.summary.offers += 1;
        let spec = offer.spec;
        if global.len() != spec.offer_dim as usize || spec.offer_dim < spec.dim {
            tracing::warn!(
                round = spec.round,
                got = global.len(),
                expected = spec.offer_dim,
                "offer with a model of the wrong length; skipped"
            );
            return None;
        }
        let Some(trainer) = self.trainer.clone() else {
            tracing::warn!(
                round = spec.round,
                "offer before the trainer exists; skipped"
            );
            return None;
        };
        tracing::info!(
            round = spec.round,
            units = offer.units.len(),
            "computing local updates"
        );
        let units = offer.units;
        let spec2 = spec.clone();
        let updates = tokio::task::spawn_blocking(move || {
            let mut t = trainer.lock().unwrap_or_else(|p| p.into_inner());
            let mut ups = t.local_updates(&spec2, &global, &units);
            let mut clipped = 0u64;
            for (_, v) in ups.iter_mut() {
                let c = clip_l2(v, spec2.clip_norm);
                // A trainer's clip leaves the update on the bound (just inside it, by the
                // rounding margin); an unclipped update almost never lands within 1e-4 of it.
                if c.was_clipped() || c.norm >= spec2.clip_norm * (1.0 - 1e-4) {
                    clipped += 1;
                }
            }
            (ups, clipped)
        })
        .await;
        let updates = match updates {
            Ok((u, clipped)) => {
                self.summary.clipped += clipped;
                tracing::info!(round = spec.round, clipped, "updates at the clip norm");
                u
            }
            Err(e) => {
                tracing::error!(round = spec.round, error = %e, "the local trainer failed");
                return None;
            }
        };
        tracing::info!(round = spec.round, updates = updates.len(), "uploading");
        let mut kept: Vec<(UnitId, Vec<f32>)> = Vec::with_capacity(updates.len());
        for (u, v) in updates {
            if v.len() != spec.dim as usize {
                continue;
            }
            if self.churn.drop_before_upload > 0.0
                && self.rng.random::<f64>() < self.churn.drop_before_upload
            {
                self.summary.dropped_by_churn += 1;
                continue;
            }
            kept.push((u, v));
        }
        if self.churn.added_latency_s > 0.0 {
            let d = self.rng.random::<f64>() * self.churn.added_latency_s;
            tokio::time::sleep(Duration::from_secs_f64(d)).await;
        }
        let disconnect = self.churn.disconnect_mid_upload > 0.0
            && self.rng.random::<f64>() < self.churn.disconnect_mid_upload;
        if disconnect {
            // Upload half, then die in the middle of a frame.
            self.summary.disconnects_by_churn += 1;
            let half = kept.len() / 2;
            let (first, rest) = kept.split_at(half);
            let _ = upload(conn, spec.round, first).await;
            self.summary.updates_sent += first.len() as u64;
            if let Some((u, v)) = rest.first()
                && let Ok(mut s) = conn.open_uni().await
            {
                let msg = Message::Update(Update {
                    round: spec.round,
                    unit: *u,
                });
                if let Ok(prefix) = frame_prefix(&msg, v.len() * 4) {
                    let bytes = encode_payload(v);
                    let _ = s.write_all(&prefix).await;
                    let _ = s.write_all(&bytes[..bytes.len() / 2]).await;
                }
            }
            conn.close(
                VarInt::from_u32(close_code::SIMULATED_DISCONNECT),
                b"churn: simulated disconnect mid-upload",
            );
            return Some(SessionEnd::Retry(
                "churn: simulated disconnect mid-upload".into(),
            ));
        }
        // One update stream at a time. The aggregator reads a stream's body only once it holds
        // one of its bounded-memory permits; bytes of other streams of the same connection that
        // wait for a permit would sit in the shared connection window, and with enough parallel
        // streams they fill it and starve the stream that holds the permit (a deadlock seen
        // with 1,024 updates per round). A single stream per connection cannot starve itself,
        // and the aggregator now allows no more than one open update stream per connection.
        let per = self.opts.updates_per_stream.max(1);
        for chunk in kept.chunks(per) {
            match upload(conn, spec.round, chunk).await {
                Ok(n) => self.summary.updates_sent += n as u64,
                // An update that cannot be framed is this agent's bug; the rest of the round's
                // updates would fail alike.
                Err(e @ UploadError::Encode(_)) => {
                    tracing::error!(round = spec.round, error = %e, "update cannot be encoded");
                    break;
                }
                // The connection is going away; the session's reader sees why and reconnects.
                Err(e) => {
                    tracing::warn!(round = spec.round, error = %e, "upload failed");
                    break;
                }
            }
        }
        None
    }
}

/// Why an upload stream failed.
#[derive(Debug, thiserror::Error)]
enum UploadError {
    /// The connection could not open another stream.
    #[error("opening the update stream: {0}")]
    Open(#[from] ConnectionError),
    /// An update does not fit a frame.
    #[error("encoding an update: {0}")]
    Encode(#[from] DecodeError),
    /// The stream was stopped or the connection lost while writing.
    #[error("writing an update: {0}")]
    Write(#[from] quinn::WriteError),
    /// The stream was already closed when finishing it.
    #[error("finishing the update stream: {0}")]
    Finish(#[from] quinn::ClosedStream),
}

/// Uploads `updates` on one new stream, one frame each.
async fn upload(
    conn: &Connection,
    round: u64,
    updates: &[(UnitId, Vec<f32>)],
) -> Result<usize, UploadError> {
    if updates.is_empty() {
        return Ok(0);
    }
    let mut s = conn.open_uni().await?;
    for (u, v) in updates {
        let msg = Message::Update(Update { round, unit: *u });
        let prefix = frame_prefix(&msg, v.len() * 4)?;
        s.write_all(&prefix).await?;
        // Hand the encoded buffer to quinn as is (`write_all` would copy 4 bytes per value
        // again into quinn's own buffer).
        s.write_chunk(encode_payload(v).into()).await?;
    }
    s.finish()?;
    Ok(updates.len())
}

/// Sends one frame on a new stream.
async fn send_on_stream(
    conn: &Connection,
    msg: &Message,
    payload: &[f32],
) -> Result<(), UploadError> {
    let mut s = conn.open_uni().await?;
    let prefix = frame_prefix(msg, payload.len() * 4)?;
    s.write_all(&prefix).await?;
    if !payload.is_empty() {
        s.write_chunk(encode_payload(payload).into()).await?;
    }
    s.finish()?;
    Ok(())
}

/// Uploads every unit's data on one new stream, one `UnitData` frame per unit.
async fn upload_unit_data(conn: &Connection, units: &[UnitUpload]) -> Result<(), UploadError> {
    let mut s = conn.open_uni().await?;
    for u in units {
        let msg = Message::UnitData(UnitData {
            unit: u.unit,
            rows: u.rows,
            obs_dim: u.obs_dim,
        });
        let prefix = frame_prefix(&msg, u.payload.len() * 4)?;
        s.write_all(&prefix).await?;
        s.write_chunk(encode_payload(&u.payload).into()).await?;
    }
    s.finish()?;
    Ok(())
}

/// Parses `A..B[,C..D...]` into unit ranges.
pub fn parse_unit_ranges(text: &str) -> Result<Vec<UnitRange>, String> {
    text.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.parse())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn churn_json_is_parsed_validated_and_never_silently_defaulted() {
        let c = parse_churn(
            r#"{"drop_before_upload":0.25,"disconnect_mid_upload":0.0,"added_latency_s":0.5}"#,
        )
        .unwrap();
        assert_eq!(c.drop_before_upload, 0.25);
        assert_eq!(c.added_latency_s, 0.5);
        // Every field has a documented default, so an empty object is a valid (inactive) model.
        assert!(parse_churn("{}").unwrap().is_none());
        assert!(matches!(parse_churn("not json"), Err(ChurnError::Json(_))));
        assert!(matches!(
            parse_churn(r#"{"drop_before_upload":"high"}"#),
            Err(ChurnError::Json(_))
        ));
        assert!(matches!(
            parse_churn(r#"{"disconnect_mid_upload":1.5}"#),
            Err(ChurnError::Invalid(_))
        ));
        assert!(matches!(
            parse_churn(r#"{"added_latency_s":-1.0}"#),
            Err(ChurnError::Invalid(_))
        ));
    }

    #[test]
    fn a_fingerprint_mismatch_is_fatal_and_other_handshake_failures_are_retried() {
        let mismatch = tls::FingerprintMismatch {
            expected: [1; 32],
            got: [2; 32],
        };
        // quinn reports the verifier's rejection as a transport error carrying text only; the
        // classification uses the verifier's typed report, whatever the error says.
        let e = ConnectionError::TimedOut;
        match handshake_failed(&e, Some(mismatch.clone())) {
            SessionEnd::Fatal(why) => assert_eq!(why, mismatch.to_string()),
            _ => panic!("a fingerprint mismatch must be fatal"),
        }
        assert!(matches!(handshake_failed(&e, None), SessionEnd::Retry(_)));
    }

    fn closed_with(code: u32, reason: &str) -> SessionEnd {
        close_end(&ConnectionError::ApplicationClosed(
            quinn::ApplicationClose {
                error_code: VarInt::from_u32(code),
                reason: reason.as_bytes().to_vec().into(),
            },
        ))
    }

    #[test]
    fn the_close_code_says_whether_to_come_back() {
        // Shutting down: come back (the restarted aggregator resumes the run).
        assert!(matches!(
            closed_with(close_code::SHUTDOWN, "aggregator shutting down"),
            SessionEnd::Retry(_)
        ));
        assert!(matches!(
            closed_with(close_code::FINISHED, "all rounds attempted"),
            SessionEnd::Finished(_)
        ));
        // An error: stop, non-zero, with the aggregator's reason.
        match closed_with(close_code::ERROR, "ledger /s/privacy.ledger: disk full") {
            SessionEnd::Failed(why) => {
                let e = AgentError::AggregatorFailed(why);
                assert_eq!(
                    e.to_string(),
                    "aggregator stopped: ledger /s/privacy.ledger: disk full"
                );
            }
            _ => panic!("an error close must stop the agent as failed"),
        }
    }
}
