//! One connection's protocol: handshake and authentication, update streams read under a
//! bounded-memory permit into pooled buffers, flow-control admission, and the writer task that
//! executes the engine thread's outbound queue.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use fedrl_common::protocol::auth::verify_token;
use fedrl_common::protocol::quic_io::{
    ReadFrameError, read_body_into, read_frame, read_prefix, write_frame,
};
use fedrl_common::protocol::{
    DecodeError, ErrorCode, Join, MAX_CONTROL_FRAME_BYTES, Message, RoundOffer, RoundSpec, UnitId,
    Welcome, close_code, frame_prefix,
};
use quinn::{Connection, Incoming, SendStream, VarInt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::driver::Input;
use super::gate::{AuthSlot, ConnectionStats, OpenSlot};
use crate::engine::ClientId;
use crate::journal;

/// Offers transmitted concurrently.
pub(super) const MAX_CONCURRENT_OFFERS: usize = 16;

/// Longest wait for more bytes of an admitted body, seconds: a client that stalls mid-body gives
/// its read permit back after this (the whole body is bounded by twice the round deadline).
pub(super) const STALL_TIMEOUT_S: f64 = 10.0;

/// The connection window is lowered in steps of at least this many bytes (each change takes the
/// connection's lock and wakes its driver).
const WINDOW_STEP: u64 = 64 << 10;

/// What the engine thread asks a connection's writer to do.
pub(super) enum Outbound {
    Control(Message),
    /// A control message with a small payload (a DataRelease prefix query).
    ControlWithPayload(Message, Vec<f32>),
    Offer {
        spec: RoundSpec,
        units: Vec<UnitId>,
        /// The shared encoded model: every offer sends this buffer itself (no per-connection
        /// copy in QUIC's send buffers).
        model: Bytes,
    },
    /// Send the message (if any) on the control stream, then close with `code`.
    Close {
        code: u32,
        message: Option<Message>,
        reason: String,
    },
}

/// A connection's outbound queue. Items are boxed: an unbounded channel allocates its slots in
/// blocks of 32, and a [`Message`] is large, so unboxed every connection would hold tens of KB of
/// mostly empty queue.
#[derive(Clone)]
pub(super) struct OutTx(pub(super) mpsc::UnboundedSender<Box<Outbound>>);

impl OutTx {
    pub(super) fn send(&self, out: Outbound) -> Result<(), mpsc::error::SendError<Box<Outbound>>> {
        self.0.send(Box::new(out))
    }
}

/// An update read under a permit. Dropping it returns the buffer to the pool, then the permit.
pub(super) struct UpdateBody {
    pub(super) data: Vec<f32>,
    /// SHA-256 of the body as received, for the journal: computed here, on the connection's
    /// task, so that the engine thread (whose work at a round's close delays the next offer)
    /// does not hash every update itself.
    pub(super) sha256: [u8; 32],
    pub(super) pool: Arc<BufferPool>,
    pub(super) _permit: OwnedSemaphorePermit,
}

impl Drop for UpdateBody {
    fn drop(&mut self) {
        self.pool.put(std::mem::take(&mut self.data));
    }
}

/// Reusable update buffers, one per read permit: bodies land in memory that is already mapped
/// (a fresh 4 MB allocation per update cost page faults and zeroing, about a third of the
/// server's time in a profile).
pub(super) struct BufferPool {
    pub(super) free: Mutex<Vec<Vec<f32>>>,
    pub(super) keep: usize,
    /// Buffers created because none was free.
    pub(super) allocated: AtomicU64,
}

impl BufferPool {
    fn take(&self) -> Vec<f32> {
        let free = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        free.unwrap_or_else(|| {
            self.allocated.fetch_add(1, Ordering::Relaxed);
            Vec::new()
        })
    }

    fn put(&self, mut v: Vec<f32>) {
        v.clear();
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < self.keep {
            free.push(v);
        }
    }
}

/// Opens a connection's flow-control window for one admitted body and closes it again as the
/// body is read, so that after the body the client has only [`IDLE_RECEIVE_WINDOW`] bytes of
/// credit left (quinn keeps `window` bytes of credit beyond what was read; lowering the window
/// by what was just read cancels the credit that reading returned).
struct Admission {
    conn: Connection,
    idle: u64,
    cap: u64,
    current: u64,
}

impl Admission {
    fn open(conn: Connection, idle: u64, cap: u64, body_len: usize) -> Self {
        let mut a = Admission {
            conn,
            idle,
            cap,
            current: idle,
        };
        a.set_for(body_len);
        a
    }

    /// Sets the window for `left` body bytes still to read.
    fn set_for(&mut self, left: usize) {
        let target = self.idle + (left as u64).min(self.cap);
        let lower_now = target == self.idle || self.current >= target + WINDOW_STEP;
        if target > self.current || (target < self.current && lower_now) {
            self.set(target);
        }
    }

    fn set(&mut self, window: u64) {
        if let Ok(w) = VarInt::from_u64(window) {
            self.conn.set_receive_window(w);
            self.current = window;
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if self.current != self.idle {
            self.set(self.idle);
        }
    }
}

pub(super) struct Shared {
    pub(super) engine_tx: mpsc::Sender<Input>,
    pub(super) secret: Vec<u8>,
    pub(super) max_frame: u64,
    pub(super) permits: Arc<Semaphore>,
    pub(super) pool: Arc<BufferPool>,
    /// Receive window of a connection without an admitted body, bytes.
    pub(super) idle_window: u64,
    /// Extra receive window while a body is admitted, bytes.
    pub(super) admitted_window: u64,
    pub(super) stall_timeout: Duration,
    /// Offers being transmitted at once (each holds one model copy in QUIC buffers).
    pub(super) offer_permits: Arc<Semaphore>,
    pub(super) welcome: Welcome,
    pub(super) next_session: AtomicU64,
    /// client id -> its live connection.
    pub(super) clients: Mutex<HashMap<String, LiveClient>>,
    pub(super) bytes_ingested: AtomicU64,
    pub(super) update_timeout: Duration,
    /// From a connection's first packet to its verified join
    /// ([`AUTH_TIMEOUT_S`](super::gate::AUTH_TIMEOUT_S)).
    pub(super) auth_timeout: Duration,
    /// Live connection counters (the caller's, from `AggregatorOptions::connection_stats`).
    pub(super) stats: Arc<ConnectionStats>,
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

/// What a connection presented before it counts as authenticated.
struct Joined {
    conn: Connection,
    send: SendStream,
    recv: quinn::RecvStream,
    join: Join,
    client_id: String,
}

/// How the authentication of a connection ended.
enum AuthEnd {
    Joined(Joined),
    /// Refused and closed already (bad frame, bad token, broken connection).
    Closed,
    /// No verified join within the deadline.
    TimedOut,
    /// Its unauthenticated slot was given to a connection from a less busy address.
    Evicted,
}

/// One connection, from its first packet: authentication under one deadline
/// ([`AUTH_TIMEOUT_S`](super::gate::AUTH_TIMEOUT_S)), then the session. `open` and `auth` are the
/// connection's slots from the [`Gate`](super::gate::Gate).
pub(super) async fn serve_connection(
    shared: Arc<Shared>,
    incoming: Incoming,
    open: OpenSlot,
    auth: AuthSlot,
) {
    let Some(joined) = authenticate(&shared, incoming, auth).await else {
        return;
    };
    handle_session(shared, joined).await;
    drop(open);
}

/// Handshake, control stream, join frame and token check, all within `shared.auth_timeout`;
/// the connection's unauthenticated slot is given back when this returns.
async fn authenticate(shared: &Shared, incoming: Incoming, mut slot: AuthSlot) -> Option<Joined> {
    // The connection, once there is one, so that an expired or evicted attempt is closed with
    // a code that tells a client to come back (dropping it would close with code 0, which
    // clients read as "run finished").
    let mut conn: Option<Connection> = None;
    let end = {
        let steps = auth_steps(shared, incoming, &mut conn);
        tokio::select! {
            r = tokio::time::timeout(shared.auth_timeout, steps) => r.unwrap_or(AuthEnd::TimedOut),
            _ = &mut slot.evicted => AuthEnd::Evicted,
        }
    };
    let reason = match end {
        AuthEnd::Joined(j) => return Some(j),
        AuthEnd::Closed => return None,
        AuthEnd::TimedOut => {
            shared.stats.auth_timed_out();
            format!(
                "no valid join within {} s of the first packet",
                shared.auth_timeout.as_secs_f64()
            )
        }
        AuthEnd::Evicted => "not authenticated yet while the aggregator's unauthenticated \
                             connections were full; its slot went to another address"
            .to_string(),
    };
    if let Some(c) = conn {
        c.close(
            VarInt::from_u32(close_code::UNAUTHENTICATED),
            reason.as_bytes(),
        );
    }
    None
}

/// The steps of [`authenticate`]; `conn` gets the connection as soon as it exists.
async fn auth_steps(
    shared: &Shared,
    incoming: Incoming,
    conn_out: &mut Option<Connection>,
) -> AuthEnd {
    let Ok(connecting) = incoming.accept() else {
        return AuthEnd::Closed;
    };
    // The connection handle before the handshake completes (0.5-RTT on a server), so that the
    // deadline can close it with a code of ours. Nothing is sent before the join is read, and
    // the client is authenticated by its token, not by TLS, so nothing relies on the handshake
    // being complete: the client's stream data itself only arrives once it is.
    let conn = match connecting.into_0rtt() {
        Ok((c, _)) => c,
        Err(connecting) => match connecting.await {
            Ok(c) => c,
            Err(_) => return AuthEnd::Closed,
        },
    };
    *conn_out = Some(conn.clone());
    let close = |why: &str| {
        conn.close(VarInt::from_u32(close_code::PROTOCOL), why.as_bytes());
        AuthEnd::Closed
    };
    let (mut send, mut recv) = match conn.accept_bi().await {
        Ok(s) => s,
        Err(_) => return AuthEnd::Closed,
    };
    // The whole authentication has one deadline (the caller's); this one never fires first.
    let frame = read_frame(&mut recv, MAX_CONTROL_FRAME_BYTES, shared.auth_timeout).await;
    let join = match frame {
        Ok(Some(f)) => match f.message {
            Message::Join(j) => j,
            other => {
                let m = format!("expected a join, got {}", other.kind());
                let msg = Message::error(ErrorCode::Unexpected, &m, None, None);
                send_and_close(&conn, &mut send, close_code::PROTOCOL, Some(&msg), &m).await;
                return AuthEnd::Closed;
            }
        },
        Ok(None) => return close("the control stream ended before a join"),
        Err(ReadFrameError::Decode(e)) => {
            let m = e.to_string();
            let msg = Message::error(decode_error_code(&e), &m, None, None);
            send_and_close(&conn, &mut send, close_code::PROTOCOL, Some(&msg), &m).await;
            return AuthEnd::Closed;
        }
        Err(e) => return close(&e.to_string()),
    };
    match verify_token(&shared.secret, &join.token) {
        Ok(client_id) => AuthEnd::Joined(Joined {
            conn,
            send,
            recv,
            join,
            client_id,
        }),
        Err(e) => {
            let m = format!("authentication failed: {e}");
            let msg = Message::error(ErrorCode::AuthFailed, &m, None, None);
            send_and_close(&conn, &mut send, close_code::AUTH, Some(&msg), &m).await;
            AuthEnd::Closed
        }
    }
}

/// A client id's live connection.
pub(super) struct LiveClient {
    session: ClientId,
    conn: Connection,
    /// The agent instance that joined (see `Join::instance`).
    instance: u64,
}

/// An authenticated connection: registers the client (refusing a second agent instance with the
/// same id), welcomes it, and serves it until it ends.
async fn handle_session(shared: Arc<Shared>, joined: Joined) {
    let Joined {
        conn,
        mut send,
        recv,
        join,
        client_id,
    } = joined;
    let session = shared.next_session.fetch_add(1, Ordering::Relaxed);
    let registered = {
        let mut clients = shared.clients.lock().unwrap_or_else(|p| p.into_inner());
        match clients.get(&client_id) {
            // Another agent process holds this token and its connection is alive: refuse the
            // newcomer, leave the holder alone (replacing it would make the two replace each
            // other forever).
            Some(live) if live.instance != join.instance && live.conn.close_reason().is_none() => {
                Err(live.conn.remote_address())
            }
            // The same agent reconnecting (its old connection may not have timed out yet), or
            // a holder that is gone: the new connection replaces the old one.
            _ => Ok(clients.insert(
                client_id.clone(),
                LiveClient {
                    session,
                    conn: conn.clone(),
                    instance: join.instance,
                },
            )),
        }
    };
    let old = match registered {
        Ok(old) => old,
        Err(holder) => {
            shared.stats.duplicate_refused();
            let m = format!(
                "client id {client_id} is already connected from {holder} (another agent process holds this token)"
            );
            tracing::warn!(client_id = %client_id, from = %conn.remote_address(), holder = %holder, "second agent instance refused");
            let msg = Message::error(ErrorCode::AlreadyConnected, &m, None, None);
            send_and_close(&conn, &mut send, close_code::DUPLICATE, Some(&msg), &m).await;
            return;
        }
    };
    if let Some(LiveClient {
        session: old_session,
        conn: old_conn,
        ..
    }) = old
    {
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
    let out_tx = OutTx(out_tx);
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
    let mut recv = recv;
    let ctl_reader = tokio::spawn(async move {
        loop {
            let r = read_frame(
                &mut recv,
                MAX_CONTROL_FRAME_BYTES,
                Duration::from_secs(3600),
            )
            .await;
            let end = !matches!(r, Ok(Some(_)));
            // Boxed: the channel's slot block would otherwise hold 32 whole frames.
            if ctl_tx.send(r.map(|f| f.map(Box::new))).await.is_err() || end {
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
                        Message::DataComplete(d) => {
                            if shared.engine_tx.send(Input::DataComplete { session, units: d.units }).await.is_err() {
                                break;
                            }
                        }
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
                        tokio::spawn(update_stream(shared.clone(), session, conn.clone(), recv));
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
        if clients
            .get(&client_id)
            .is_some_and(|c| c.session == session)
        {
            clients.remove(&client_id);
        }
    }
    writer.abort();
}

/// Reads update frames from one client-opened stream and hands them to the engine.
async fn update_stream(
    shared: Arc<Shared>,
    session: ClientId,
    conn: Connection,
    mut recv: quinn::RecvStream,
) {
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
        // Bounded memory: no more than `max_inflight_updates` bodies are held at once, and a
        // client's bytes beyond the idle window are only asked for now.
        let Ok(permit) = shared.permits.clone().acquire_owned().await else {
            return;
        };
        let mut body = UpdateBody {
            sha256: [0; 32],
            data: shared.pool.take(),
            pool: shared.pool.clone(),
            _permit: permit,
        };
        let mut admission = Admission::open(
            conn.clone(),
            shared.idle_window,
            shared.admitted_window,
            body_len,
        );
        let read = read_body_into(
            &mut recv,
            body_len,
            shared.update_timeout,
            shared.stall_timeout,
            &mut body.data,
            &mut |left| admission.set_for(left),
        )
        .await;
        drop(admission);
        let message = match read {
            Ok(m) => m,
            Err(ReadFrameError::Decode(e)) => {
                let _ = recv.stop(VarInt::from_u32(close_code::PROTOCOL));
                protocol_error(&e);
                return;
            }
            Err(_) => return,
        };
        shared
            .bytes_ingested
            .fetch_add(body_len as u64 + 4, Ordering::Relaxed);
        match message {
            Message::Update(u) => {
                body.sha256 = journal::update_digest(&body.data);
                let input = Input::Update {
                    session,
                    round: u.round,
                    unit: u.unit,
                    body,
                };
                if shared.engine_tx.send(input).await.is_err() {
                    return;
                }
            }
            Message::UnitData(header) => {
                // The body keeps its read permit until the engine thread has checked it: at
                // most `max_inflight_updates` uploads are held in flight, however many
                // clients send.
                let input = Input::UnitData {
                    session,
                    header,
                    body,
                };
                if shared.engine_tx.send(input).await.is_err() {
                    return;
                }
            }
            Message::TrajectoryData(header) => {
                let input = Input::TrajectoryData {
                    session,
                    header,
                    payload: std::mem::take(&mut body.data),
                };
                if shared.engine_tx.send(input).await.is_err() {
                    return;
                }
            }
            Message::PrefixCounts(counts) => {
                if shared
                    .engine_tx
                    .send(Input::PrefixCounts { session, counts })
                    .await
                    .is_err()
                {
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
    mut rx: mpsc::UnboundedReceiver<Box<Outbound>>,
    offer_permits: Arc<Semaphore>,
) {
    while let Some(out) = rx.recv().await {
        match *out {
            Outbound::Control(m) => {
                if write_frame(&mut send, &m, &[]).await.is_err() {
                    return;
                }
            }
            Outbound::ControlWithPayload(m, payload) => {
                if write_frame(&mut send, &m, &payload).await.is_err() {
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
                    if s.write_all(&prefix).await.is_err() || s.write_chunk(model).await.is_err() {
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
