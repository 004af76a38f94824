//! The aggregator service: QUIC endpoint, connection handling, and the engine thread that drives
//! the sans-IO [`Engine`], the ledger and the [`ServerModel`].
//!
//! Threads: tokio tasks do network I/O only (one per connection, one per update stream, one
//! writer per connection). The engine, the ledger and the model live on one dedicated OS thread
//! that receives [`Input`]s over a bounded channel, so model training never blocks a tokio worker
//! and a slow engine pushes back on the network (QUIC flow control) instead of buffering.
//!
//! Memory: an update is read only after taking one of `max_inflight_updates` permits, and the
//! permit is released once the engine has added the update to its running sum; offers are sent
//! at most 16 at a time. Peak memory is therefore about `(max_inflight_updates x 8 + 16 x 4 + 8)
//! x dim` bytes (update buffers, offer copies, the f64 sum) plus the per-connection QUIC receive
//! windows (512 KiB each by default), independent of how many updates a round receives.

use std::collections::{HashMap, VecDeque};
use std::fs::OpenOptions;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use fedrl_common::privacy::ledger::{Participation, PrivacyLedger};
use fedrl_common::protocol::auth::verify_token;
use fedrl_common::protocol::{
    Ack, DecodeError, ErrorCode, Leave, LeaveReason, MAX_CONTROL_FRAME_BYTES, Message, RoundOffer,
    RoundSpec, UnitId, UnitRange, Welcome, decode_body, encode_payload, frame_prefix,
};
use fedrl_common::scenario::Scenario;
use quinn::{Connection, SendStream, VarInt};
use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::checkpoint::{self, CheckpointMeta};
use crate::engine::{Action, ClientId, Engine, EngineConfig, Event, Resume};
use crate::model::ServerModel;
use crate::state;
use crate::tls::{self, TransportTuning};
use fedrl_common::protocol::quic_io::{
    ReadFrameError, read_body, read_frame, read_prefix, write_frame,
};

/// QUIC application close codes.
pub mod close_code {
    /// The run is over.
    pub const FINISHED: u32 = 0;
    /// A protocol violation (bad frame, oversized frame, wrong version, unexpected message).
    pub const PROTOCOL: u32 = 1;
    /// Authentication failed.
    pub const AUTH: u32 = 2;
    /// The join was refused (units in use).
    pub const REFUSED: u32 = 3;
    /// A newer connection of the same client replaced this one.
    pub const REPLACED: u32 = 4;
    /// The aggregator is shutting down.
    pub const SHUTDOWN: u32 = 5;
}

/// Offers transmitted concurrently.
const MAX_CONCURRENT_OFFERS: usize = 16;

/// How to run an aggregator.
pub struct AggregatorOptions {
    pub scenario: Scenario,
    /// Address to listen on (port 0: OS-assigned; the real address goes to `address.json`).
    pub listen: SocketAddr,
    pub state_dir: PathBuf,
    /// Updates read concurrently (each holds about `8 x dim` bytes). Default 8.
    pub max_inflight_updates: usize,
    pub tuning: TransportTuning,
    /// Seconds to wait for clients to acknowledge the end of the run before closing. Default 2.
    pub drain_s: f64,
}

impl AggregatorOptions {
    pub fn new(scenario: Scenario, listen: SocketAddr, state_dir: PathBuf) -> Self {
        AggregatorOptions {
            scenario,
            listen,
            state_dir,
            max_inflight_updates: 8,
            tuning: TransportTuning::default(),
            drain_s: 2.0,
        }
    }
}

/// What `address.json` holds.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct AddressFile {
    pub addr: SocketAddr,
    pub fingerprint: String,
    pub pid: u32,
}

/// The end-of-run report (also written to `report.json` in the state directory).
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct RunReport {
    pub scenario: String,
    pub rounds_completed: u64,
    pub rounds_abandoned: u64,
    /// Rounds attempted by this process and its predecessors (released + abandoned).
    pub rounds_attempted: u64,
    pub epsilon: f64,
    pub epsilon_rdp: f64,
    pub delta: f64,
    pub target_epsilon: f64,
    /// Units that contributed to at least one released round.
    pub units: u64,
    /// True when the noise was seeded (reproducible, not private).
    pub seeded: bool,
    pub noise_sources: Vec<String>,
    pub accountant: String,
    /// Seconds this aggregator process ran.
    pub wall_seconds: f64,
    /// Why the run ended.
    pub finished: String,
    /// The model's last periodic evaluation, if any.
    pub final_eval: Option<serde_json::Value>,
    /// The model's end-of-run evaluation, if it has one (e.g. `final_eval_return` on held-out
    /// users).
    pub final_evaluation: Option<serde_json::Value>,
    /// True for a non-private twin: no clipping, no noise, epsilon = infinity.
    pub non_private: bool,
    /// Updates accepted/rejected by this process.
    pub updates_accepted: u64,
    pub updates_rejected: u64,
    /// Bytes of update frames read by this process.
    pub bytes_ingested: u64,
}

/// Inputs of the engine thread.
enum Input {
    Join {
        session: ClientId,
        client_id: String,
        units: Vec<UnitRange>,
        out: mpsc::UnboundedSender<Outbound>,
    },
    Left {
        session: ClientId,
    },
    Update {
        session: ClientId,
        round: u64,
        unit: UnitId,
        data: Vec<f32>,
        _permit: OwnedSemaphorePermit,
    },
    /// A protocol violation on an update stream: forwarded to the connection's writer by the
    /// engine thread, so acknowledgements of earlier updates go out first.
    ProtocolError {
        session: ClientId,
        message: Message,
        reason: String,
    },
    Tick,
    Shutdown,
}

/// What the engine thread asks a connection's writer to do.
enum Outbound {
    Control(Message),
    Offer {
        spec: RoundSpec,
        units: Vec<UnitId>,
        model: Arc<Vec<u8>>,
    },
    /// Send the message (if any) on the control stream, then close with `code`.
    Close {
        code: u32,
        message: Option<Message>,
        reason: String,
    },
}

struct Shared {
    engine_tx: mpsc::Sender<Input>,
    secret: Vec<u8>,
    max_frame: u64,
    permits: Arc<Semaphore>,
    /// Offers being transmitted at once (each holds one model copy in QUIC buffers).
    offer_permits: Arc<Semaphore>,
    welcome: Welcome,
    next_session: AtomicU64,
    /// client id -> (session, connection) of its live connection.
    clients: Mutex<HashMap<String, (ClientId, Connection)>>,
    bytes_ingested: AtomicU64,
    update_timeout: Duration,
}

/// Runs an aggregator until the scenario's rounds are done (or the budget or population is
/// exhausted, or `shutdown` fires). Returns the report.
pub async fn run(
    opts: AggregatorOptions,
    model: Box<dyn ServerModel>,
    shutdown: Option<oneshot::Receiver<()>>,
) -> anyhow::Result<RunReport> {
    let scenario = opts.scenario.clone();
    let dir = opts.state_dir.clone();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let identity = tls::load_or_create_identity(&dir)?;
    let secret = state::load_or_create_secret(&dir)?;

    // The ledger and checkpoint decide where this run continues.
    let (ledger, recovery) =
        PrivacyLedger::open(dir.join(state::LEDGER_FILE), scenario.ledger_config())
            .context("opening the privacy ledger")?;
    if recovery.torn_bytes > 0 {
        eprintln!("ledger recovery: {recovery}");
    }
    let mut model = model;
    let ckpt = checkpoint::load(&dir)?;
    let mut resume = Resume::default();
    let last_ledger_round = ledger.last_round().unwrap_or(0);
    let mut ckpt_round = 0;
    if let Some((meta, st)) = ckpt {
        model
            .restore(st)
            .context("restoring the model from the checkpoint")?;
        ckpt_round = meta.round;
        resume.rounds_abandoned = meta.rounds_abandoned;
        eprintln!(
            "resuming from checkpoint at round {} ({} ledger records; the ledger has {})",
            meta.round,
            meta.ledger_records,
            ledger.records().len()
        );
    }
    resume.next_round = last_ledger_round.max(ckpt_round) + 1;
    resume.rounds_completed = ledger.records().len() as u64;
    if matches!(scenario.participation, Participation::Fresh) {
        resume.used_units = ledger
            .records()
            .iter()
            .flat_map(|r| r.units.iter().copied())
            .collect();
    }

    let cfg = EngineConfig {
        dim: scenario.task.dim(),
        rounds: scenario.rounds,
        population: scenario.users,
        participation: scenario.participation,
        cohort_size: scenario.cohort_size,
        expected_cohort: scenario.expected_cohort(),
        quorum: scenario.quorum(),
        deadline_s: scenario.round_deadline_s,
        start_timeout_s: scenario.start_timeout_s,
        // A non-private twin runs with C = inf and z = 0 (and records nothing in the ledger).
        clip_norm: scenario.effective_clip_norm(),
        noise_multiplier: scenario.effective_noise_multiplier(),
        seed: scenario.seed,
        task_json: scenario.task.to_json(),
    };
    if model.params().len() != cfg.dim {
        anyhow::bail!(
            "the model has {} parameters but the task's dim is {}",
            model.params().len(),
            cfg.dim
        );
    }

    let server_cfg = tls::server_config(&identity, &opts.tuning)?;
    let socket = tls::udp_socket(opts.listen)?;
    let runtime = quinn::default_runtime().context("no async runtime for quinn")?;
    // A stateless-reset key derived from the persistent secret: after a crash and restart on the
    // same address, clients of the dead process get a valid stateless reset and reconnect at
    // once instead of waiting for their idle timeout.
    let reset_key = ring::hmac::sign(
        &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret),
        b"fedrl-stateless-reset-v1",
    );
    let endpoint_cfg = quinn::EndpointConfig::new(Arc::new(ring::hmac::Key::new(
        ring::hmac::HMAC_SHA256,
        reset_key.as_ref(),
    )));
    let endpoint = quinn::Endpoint::new(endpoint_cfg, Some(server_cfg), socket, runtime)
        .context("creating the QUIC endpoint")?;
    let addr = endpoint.local_addr()?;
    println!("fedrl aggregator listening on {addr}");
    println!("certificate SHA-256: {}", identity.fingerprint);
    let addr_file = AddressFile {
        addr,
        fingerprint: identity.fingerprint.clone(),
        pid: std::process::id(),
    };
    state::write_atomic(
        &dir.join(state::ADDRESS_FILE),
        &serde_json::to_vec_pretty(&addr_file)?,
    )?;

    let (engine_tx, engine_rx) = mpsc::channel::<Input>(1024);
    let shared = Arc::new(Shared {
        engine_tx: engine_tx.clone(),
        secret,
        max_frame: scenario.max_frame_bytes,
        permits: Arc::new(Semaphore::new(opts.max_inflight_updates.max(1))),
        offer_permits: Arc::new(Semaphore::new(MAX_CONCURRENT_OFFERS)),
        welcome: Welcome {
            session: 0,
            task_json: scenario.task.to_json(),
            churn_json: serde_json::to_string(&scenario.churn)?,
            dim: cfg.dim as u32,
            clip_norm: scenario.clip_norm,
            max_frame_bytes: scenario.max_frame_bytes,
            seed: scenario.seed,
        },
        next_session: AtomicU64::new(1),
        clients: Mutex::new(HashMap::new()),
        bytes_ingested: AtomicU64::new(0),
        update_timeout: Duration::from_secs_f64(scenario.round_deadline_s.max(1.0) * 2.0),
    });

    let (done_tx, done_rx) = oneshot::channel::<anyhow::Result<RunReport>>();
    let engine_shared = shared.clone();
    let engine = Engine::new(cfg, resume);
    let ctx = EngineThread {
        engine,
        ledger,
        model,
        dir: dir.clone(),
        scenario: scenario.clone(),
        sessions: HashMap::new(),
        snapshot: Arc::new(Vec::new()),
        started: Instant::now(),
        accepted: 0,
        rejected: 0,
        last_eval: None,
        final_eval: None,
        users_released: 0,
        shared: engine_shared,
        last_round: last_ledger_round.max(ckpt_round),
    };
    std::thread::Builder::new()
        .name("fedrl-engine".into())
        .spawn(move || {
            let r = ctx.run(engine_rx);
            let _ = done_tx.send(r);
        })
        .context("starting the engine thread")?;

    // Ticks drive deadlines; a full channel just skips a tick.
    let tick_tx = engine_tx.clone();
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(Duration::from_millis(20));
        loop {
            iv.tick().await;
            match tick_tx.try_send(Input::Tick) {
                Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => {}
                Err(mpsc::error::TrySendError::Closed(_)) => break,
            }
        }
    });
    if let Some(sd) = shutdown {
        let tx = engine_tx.clone();
        tokio::spawn(async move {
            if sd.await.is_ok() {
                let _ = tx.send(Input::Shutdown).await;
            }
        });
    }

    let accept_ep = endpoint.clone();
    let accept_shared = shared.clone();
    let acceptor = tokio::spawn(async move {
        while let Some(incoming) = accept_ep.accept().await {
            let s = accept_shared.clone();
            tokio::spawn(async move {
                if let Ok(connecting) = incoming.accept()
                    && let Ok(conn) = connecting.await
                {
                    handle_connection(s, conn).await;
                }
            });
        }
    });

    let report = done_rx.await.context("the engine thread died")?;
    // Let the writers deliver the final Leave messages, then close.
    tokio::time::sleep(Duration::from_secs_f64(opts.drain_s.min(0.5))).await;
    let deadline = Instant::now() + Duration::from_secs_f64(opts.drain_s);
    while Instant::now() < deadline && endpoint.open_connections() > 0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    endpoint.close(VarInt::from_u32(close_code::FINISHED), b"run finished");
    acceptor.abort();
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
    report
}

fn decode_error_code(e: &DecodeError) -> ErrorCode {
    match e {
        DecodeError::TooLarge { .. } => ErrorCode::FrameTooLarge,
        DecodeError::Version { .. } => ErrorCode::UnsupportedVersion,
        _ => ErrorCode::BadFrame,
    }
}

/// Sends `msg` on the control stream, then closes the connection with `code` and `reason` (the
/// reason also reaches the peer in the QUIC close frame, in case the stream data does not).
async fn send_and_close(
    conn: &Connection,
    send: &mut SendStream,
    code: u32,
    msg: Option<&Message>,
    reason: &str,
) {
    if let Some(m) = msg {
        let _ = tokio::time::timeout(Duration::from_secs(1), write_frame(send, m, &[])).await;
    }
    let _ = send.finish();
    let _ = tokio::time::timeout(Duration::from_millis(500), send.stopped()).await;
    let reason: String = reason.chars().take(900).collect();
    conn.close(VarInt::from_u32(code), reason.as_bytes());
}

async fn handle_connection(shared: Arc<Shared>, conn: Connection) {
    let Ok(Ok((mut send, mut recv))) =
        tokio::time::timeout(Duration::from_secs(10), conn.accept_bi()).await
    else {
        conn.close(
            VarInt::from_u32(close_code::PROTOCOL),
            b"no control stream within 10 s",
        );
        return;
    };
    let join = match read_frame(&mut recv, MAX_CONTROL_FRAME_BYTES, Duration::from_secs(10)).await {
        Ok(Some(f)) => match f.message {
            Message::Join(j) => j,
            other => {
                let m = format!("expected a join, got {}", other.kind());
                let msg = Message::error(ErrorCode::Unexpected, &m, None, None);
                send_and_close(&conn, &mut send, close_code::PROTOCOL, Some(&msg), &m).await;
                return;
            }
        },
        Ok(None) => return,
        Err(ReadFrameError::Decode(e)) => {
            let m = e.to_string();
            let msg = Message::error(decode_error_code(&e), &m, None, None);
            send_and_close(&conn, &mut send, close_code::PROTOCOL, Some(&msg), &m).await;
            return;
        }
        Err(e) => {
            conn.close(
                VarInt::from_u32(close_code::PROTOCOL),
                e.to_string().as_bytes(),
            );
            return;
        }
    };
    let client_id = match verify_token(&shared.secret, &join.token) {
        Ok(id) => id,
        Err(e) => {
            let m = format!("authentication failed: {e}");
            let msg = Message::error(ErrorCode::AuthFailed, &m, None, None);
            send_and_close(&conn, &mut send, close_code::AUTH, Some(&msg), &m).await;
            return;
        }
    };
    let session = shared.next_session.fetch_add(1, Ordering::Relaxed);
    let old = {
        let mut clients = shared.clients.lock().unwrap_or_else(|p| p.into_inner());
        clients.insert(client_id.clone(), (session, conn.clone()))
    };
    if let Some((old_session, old_conn)) = old {
        // The engine forgets the old session before it hears the new join, so the same units
        // can be claimed again.
        let _ = shared
            .engine_tx
            .send(Input::Left {
                session: old_session,
            })
            .await;
        old_conn.close(
            VarInt::from_u32(close_code::REPLACED),
            b"replaced by a newer connection of the same client",
        );
    }
    let mut welcome = shared.welcome.clone();
    welcome.session = session;
    if write_frame(&mut send, &Message::Welcome(welcome), &[])
        .await
        .is_err()
    {
        return;
    }
    let (out_tx, out_rx) = mpsc::unbounded_channel();
    if shared
        .engine_tx
        .send(Input::Join {
            session,
            client_id: client_id.clone(),
            units: join.units,
            out: out_tx.clone(),
        })
        .await
        .is_err()
    {
        return;
    }
    let writer = tokio::spawn(writer_task(
        conn.clone(),
        send,
        out_rx,
        shared.offer_permits.clone(),
    ));

    // The control stream is read by its own task: `read_frame` is not cancellation-safe, so it
    // must not sit in a `select!` next to `accept_uni`.
    let (ctl_tx, mut ctl_rx) = mpsc::channel(16);
    let ctl_reader = tokio::spawn(async move {
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
    let mut control_done = false;
    loop {
        tokio::select! {
            frame = ctl_rx.recv(), if !control_done => {
                match frame {
                    Some(Ok(Some(f))) => match f.message {
                        Message::Leave(_) => control_done = true,
                        other => {
                            let m = format!("unexpected {} on the control stream", other.kind());
                            let _ = out_tx.send(Outbound::Close { code: close_code::PROTOCOL, message: Some(Message::error(ErrorCode::Unexpected, &m, None, None)), reason: m });
                        }
                    },
                    Some(Err(ReadFrameError::Decode(e))) => {
                        let m = e.to_string();
                        let _ = out_tx.send(Outbound::Close { code: close_code::PROTOCOL, message: Some(Message::error(decode_error_code(&e), &m, None, None)), reason: m });
                        control_done = true;
                    }
                    _ => control_done = true,
                }
            }
            stream = conn.accept_uni() => {
                match stream {
                    Ok(recv) => {
                        tokio::spawn(update_stream(shared.clone(), session, recv, out_tx.clone()));
                    }
                    Err(_) => break,
                }
            }
        }
    }
    ctl_reader.abort();
    let _ = shared.engine_tx.send(Input::Left { session }).await;
    {
        let mut clients = shared.clients.lock().unwrap_or_else(|p| p.into_inner());
        if clients.get(&client_id).is_some_and(|(s, _)| *s == session) {
            clients.remove(&client_id);
        }
    }
    writer.abort();
}

/// Reads update frames from one client-opened stream and hands them to the engine.
async fn update_stream(
    shared: Arc<Shared>,
    session: ClientId,
    mut recv: quinn::RecvStream,
    out: mpsc::UnboundedSender<Outbound>,
) {
    let _ = out;
    let protocol_error = |e: &DecodeError| {
        let m = e.to_string();
        let input = Input::ProtocolError {
            session,
            message: Message::error(decode_error_code(e), &m, None, None),
            reason: m,
        };
        let tx = shared.engine_tx.clone();
        tokio::spawn(async move {
            let _ = tx.send(input).await;
        });
    };
    loop {
        let body_len = match read_prefix(&mut recv, shared.max_frame).await {
            Ok(Some(n)) => n,
            Ok(None) => return,
            Err(ReadFrameError::Decode(e)) => {
                let _ = recv.stop(VarInt::from_u32(close_code::PROTOCOL));
                protocol_error(&e);
                return;
            }
            Err(_) => return,
        };
        // Bounded memory: no more than `max_inflight_updates` bodies are held at once.
        let Ok(permit) = shared.permits.clone().acquire_owned().await else {
            return;
        };
        let body = match read_body(&mut recv, body_len, shared.update_timeout).await {
            Ok(b) => b,
            Err(_) => return,
        };
        shared
            .bytes_ingested
            .fetch_add(body_len as u64 + 4, Ordering::Relaxed);
        let frame = match decode_body(&body) {
            Ok(f) => f,
            Err(e) => {
                protocol_error(&e);
                return;
            }
        };
        drop(body);
        match frame.message {
            Message::Update(u) => {
                let input = Input::Update {
                    session,
                    round: u.round,
                    unit: u.unit,
                    data: frame.payload,
                    _permit: permit,
                };
                if shared.engine_tx.send(input).await.is_err() {
                    return;
                }
            }
            other => {
                let m = format!("unexpected {} on an update stream", other.kind());
                let input = Input::ProtocolError {
                    session,
                    message: Message::error(ErrorCode::Unexpected, &m, None, None),
                    reason: m,
                };
                let _ = shared.engine_tx.send(input).await;
                return;
            }
        }
    }
}

/// Executes a connection's outbound queue: control messages, offers (each on its own stream),
/// and closing.
async fn writer_task(
    conn: Connection,
    mut send: SendStream,
    mut rx: mpsc::UnboundedReceiver<Outbound>,
    offer_permits: Arc<Semaphore>,
) {
    while let Some(out) = rx.recv().await {
        match out {
            Outbound::Control(m) => {
                if write_frame(&mut send, &m, &[]).await.is_err() {
                    return;
                }
            }
            Outbound::Offer { spec, units, model } => {
                let conn = conn.clone();
                let permits = offer_permits.clone();
                // Offers go out concurrently so one slow client stream does not delay acks, but
                // at most `MAX_CONCURRENT_OFFERS` at a time, each held until the client has read
                // it: the model copies buffered in QUIC send buffers do not grow with clients.
                tokio::spawn(async move {
                    let Ok(_permit) = permits.acquire_owned().await else {
                        return;
                    };
                    let msg = Message::RoundOffer(RoundOffer { spec, units });
                    let Ok(prefix) = frame_prefix(&msg, model.len()) else {
                        return;
                    };
                    let Ok(mut s) = conn.open_uni().await else {
                        return;
                    };
                    if s.write_all(&prefix).await.is_err() || s.write_all(&model).await.is_err() {
                        return;
                    }
                    let _ = s.finish();
                    let _ = tokio::time::timeout(Duration::from_secs(60), s.stopped()).await;
                });
            }
            Outbound::Close {
                code,
                message,
                reason,
            } => {
                send_and_close(&conn, &mut send, code, message.as_ref(), &reason).await;
                return;
            }
        }
    }
}

struct EngineThread {
    engine: Engine,
    ledger: PrivacyLedger,
    model: Box<dyn ServerModel>,
    dir: PathBuf,
    scenario: Scenario,
    sessions: HashMap<ClientId, mpsc::UnboundedSender<Outbound>>,
    /// The released model, encoded once as raw little-endian bytes, shared by every offer.
    snapshot: Arc<Vec<u8>>,
    started: Instant,
    accepted: u64,
    rejected: u64,
    last_eval: Option<serde_json::Value>,
    /// The model's end-of-run evaluation (e.g. held-out users' mean return).
    final_eval: Option<serde_json::Value>,
    /// Contributions in released rounds so far (users, for fresh participation).
    users_released: u64,
    shared: Arc<Shared>,
    last_round: u64,
}

impl EngineThread {
    fn run(mut self, mut rx: mpsc::Receiver<Input>) -> anyhow::Result<RunReport> {
        self.snapshot = Arc::new(encode_payload(self.model.params()));
        let mut metrics = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(state::METRICS_FILE))
            .context("opening metrics.jsonl")?;
        let mut queue: VecDeque<Event> = VecDeque::new();
        let finished_reason;
        loop {
            let Some(input) = rx.blocking_recv() else {
                finished_reason = "all connections to the engine closed".to_string();
                break;
            };
            let now = self.started.elapsed().as_secs_f64();
            match input {
                Input::Join {
                    session,
                    client_id,
                    units,
                    out,
                } => {
                    tracing::info!(session, client_id = %client_id, units = units.len(), "client joined");
                    self.sessions.insert(session, out);
                    queue.push_back(Event::ClientJoined {
                        client: session,
                        units,
                    });
                }
                Input::Left { session } => {
                    self.sessions.remove(&session);
                    queue.push_back(Event::ClientLeft { client: session });
                }
                Input::Update {
                    session,
                    round,
                    unit,
                    data,
                    _permit,
                } => {
                    // The permit is released when this arm ends, after the engine summed it.
                    let actions = self.engine.handle(
                        now,
                        Event::UpdateArrived {
                            client: session,
                            round,
                            unit,
                            update: data,
                        },
                    );
                    drop(_permit);
                    if let Some(reason) = self.execute(now, actions, &mut queue, &mut metrics)? {
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
                    finished_reason = "shut down by signal".to_string();
                    for out in self.sessions.values() {
                        let _ = out.send(Outbound::Close {
                            code: close_code::SHUTDOWN,
                            message: Some(Message::Leave(Leave {
                                reason: LeaveReason::Shutdown,
                                message: "aggregator shutting down".into(),
                            })),
                            reason: "aggregator shutting down".into(),
                        });
                    }
                    break;
                }
            }
            let mut stop = None;
            while let Some(ev) = queue.pop_front() {
                let actions = self.engine.handle(now, ev);
                if let Some(reason) = self.execute(now, actions, &mut queue, &mut metrics)? {
                    stop = Some(reason);
                    break;
                }
            }
            if let Some(reason) = stop {
                finished_reason = reason;
                break;
            }
        }
        self.save_checkpoint()?;
        self.final_eval = self.model.final_evaluation();
        self.model
            .export(&self.dir)
            .context("exporting the trained model")?;
        let report = self.report(finished_reason)?;
        state::write_atomic(
            &self.dir.join(state::REPORT_FILE),
            &serde_json::to_vec_pretty(&report)?,
        )?;
        Ok(report)
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
        metrics: &mut std::fs::File,
    ) -> anyhow::Result<Option<String>> {
        for action in actions {
            match action {
                Action::SendOffer {
                    client,
                    spec,
                    units,
                } => {
                    self.last_round = self.last_round.max(spec.round);
                    self.send(
                        client,
                        Outbound::Offer {
                            spec,
                            units,
                            model: self.snapshot.clone(),
                        },
                    );
                }
                Action::Accepted {
                    client,
                    round,
                    unit,
                    norm,
                    clipped,
                } => {
                    self.accepted += 1;
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
                Action::Commit(commit) => {
                    let mut record = commit.record.clone();
                    let round = record.round;
                    record.unix_time_s = SystemTime::now()
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .map(|d| d.as_secs_f64())
                        .unwrap_or(0.0);
                    // Ledger first (checked, appended, fsynced), then the model; the new model
                    // only leaves with the next round's offers, after `Committed`.
                    let appended = if self.scenario.non_private {
                        Ok(()) // nothing is private, so nothing is accounted (report: inf)
                    } else {
                        self.ledger.append(record)
                    };
                    if let Err(e) = appended {
                        eprintln!("round {round} not released: {e}");
                        queue.push_back(Event::CommitFailed {
                            round,
                            reason: e.to_string(),
                        });
                        continue;
                    }
                    if let Err(e) = self.model.apply(&commit.noisy_mean) {
                        queue.push_back(Event::CommitFailed {
                            round,
                            reason: format!("model update failed: {e}"),
                        });
                        continue;
                    }
                    self.snapshot = Arc::new(encode_payload(self.model.params()));
                    self.last_eval = self.model.evaluate(round);
                    self.users_released += commit.accepted;
                    let epsilon = if self.scenario.non_private {
                        None
                    } else {
                        self.ledger.report().ok().map(|r| r.epsilon)
                    };
                    let line = serde_json::json!({
                        "users": self.users_released,
                        "epsilon": epsilon,
                        "round": round,
                        "status": "released",
                        "accepted": commit.accepted,
                        "clipped": commit.clipped,
                        "offered": commit.offered,
                        "rejected": commit.rejected,
                        "t_s": now,
                        "rounds_completed": self.engine.rounds_completed() + 1,
                        "rounds_abandoned": self.engine.rounds_abandoned(),
                        "eval": self.last_eval,
                    });
                    writeln!(metrics, "{line}")?;
                    metrics.flush()?;
                    if (self.engine.rounds_completed() + 1)
                        .is_multiple_of(self.scenario.checkpoint_every)
                    {
                        self.save_checkpoint()?;
                    }
                    if self.model.finished() {
                        // Count the round as completed; whatever the engine would do next (open
                        // another round) is dropped: the run ends here.
                        let _ = self.engine.handle(now, Event::Committed { round });
                        let reason = format!("the model reached its target after round {round}");
                        for out in self.sessions.values() {
                            let _ = out.send(Outbound::Close {
                                code: close_code::FINISHED,
                                message: Some(Message::Leave(Leave {
                                    reason: LeaveReason::Finished,
                                    message: reason.clone(),
                                })),
                                reason: reason.clone(),
                            });
                        }
                        return Ok(Some(reason));
                    }
                    queue.push_back(Event::Committed { round });
                }
                Action::Abandoned {
                    round,
                    accepted,
                    quorum,
                    offered,
                    reason,
                } => {
                    eprintln!("round {round} abandoned: {reason}");
                    let line = serde_json::json!({
                        "round": round,
                        "status": "abandoned",
                        "accepted": accepted,
                        "quorum": quorum,
                        "offered": offered,
                        "t_s": now,
                        "rounds_completed": self.engine.rounds_completed(),
                        "rounds_abandoned": self.engine.rounds_abandoned(),
                        "reason": reason,
                    });
                    writeln!(metrics, "{line}")?;
                    metrics.flush()?;
                }
                Action::Finished { reason } => {
                    for out in self.sessions.values() {
                        let _ = out.send(Outbound::Close {
                            code: close_code::FINISHED,
                            message: Some(Message::Leave(Leave {
                                reason: LeaveReason::Finished,
                                message: reason.clone(),
                            })),
                            reason: reason.clone(),
                        });
                    }
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
            model_meta: serde_json::Value::Null,
            tensors: 0,
            tensors_sha256: String::new(),
        };
        checkpoint::save(&self.dir, meta, &self.model.state())?;
        Ok(())
    }

    fn report(&self, finished: String) -> anyhow::Result<RunReport> {
        let rep = self.ledger.report().context("accounting the ledger")?;
        let noise_sources: Vec<String> = rep.noise_sources.iter().map(|s| s.to_string()).collect();
        Ok(RunReport {
            scenario: self.scenario.name.clone(),
            rounds_completed: self.engine.rounds_completed(),
            rounds_abandoned: self.engine.rounds_abandoned(),
            rounds_attempted: self.engine.rounds_completed() + self.engine.rounds_abandoned(),
            epsilon: if self.scenario.non_private {
                f64::INFINITY
            } else {
                rep.epsilon
            },
            epsilon_rdp: if self.scenario.non_private {
                f64::INFINITY
            } else {
                rep.epsilon_rdp
            },
            delta: rep.delta,
            target_epsilon: rep.target_epsilon,
            units: rep.units,
            seeded: rep.noise_sources.iter().any(|s| !s.is_private()),
            noise_sources,
            accountant: if self.scenario.non_private {
                "none (non-private twin: no clipping, no noise)".into()
            } else {
                rep.accountant.clone()
            },
            wall_seconds: self.started.elapsed().as_secs_f64(),
            finished,
            final_eval: self.last_eval.clone(),
            final_evaluation: self.final_eval.clone(),
            non_private: self.scenario.non_private,
            updates_accepted: self.accepted,
            updates_rejected: self.rejected,
            bytes_ingested: self.shared.bytes_ingested.load(Ordering::Relaxed),
        })
    }
}

/// Reads `address.json` from a state directory.
pub fn read_address_file(dir: &Path) -> anyhow::Result<AddressFile> {
    let p = dir.join(state::ADDRESS_FILE);
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
}
