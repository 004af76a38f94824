//! The aggregator service: QUIC endpoint, connection handling, and the engine thread that drives
//! the sans-IO [`Engine`](crate::engine::Engine), the ledger and the
//! [`ServerModel`](fedrl_tasks::server::ServerModel).
//!
//! Modules, by concern:
//! - [`transport`]: QUIC transport tuning (MTU, GSO cap, receive windows) and endpoint creation.
//! - [`gate`]: admission of new connections (caps on open and unauthenticated connections, in
//!   all and per source address) and the live connection counters.
//! - [`connection`]: one connection's protocol (handshake and authentication under one deadline,
//!   update streams, the writer task, flow-control admission, the update buffer pool).
//! - [`driver`]: the engine thread (feeds the engine, executes its actions: ledger, model,
//!   metrics, checkpoints, the report).
//! - [`startup`]: state directory, identity, ledger and checkpoint, the resume point, and
//!   spawning everything ([`run`]); [`resume`]: where a run continues and when it must not.
//! - [`metrics`], [`report`]: the per-round metrics and the end-of-run report, each split into a
//!   public file (DP outputs) and an operator-only one (exact counts) under `operator/`.
//!
//! Threads: tokio tasks do network I/O only (one per connection, one per update stream, one
//! writer per connection). The engine, the ledger and the model live on one dedicated OS thread
//! that receives [`Input`]s over a bounded channel, so model training never blocks a tokio worker
//! and a slow engine pushes back on the network (QUIC flow control) instead of buffering.
//!
//! Memory: an update body is read only after taking one of `max_inflight_updates` permits, into
//! one of as many reusable f32 buffers, straight from QUIC's receive chunks; the permit and the
//! buffer come back once the engine has added the update to its running sum. Offers are sent at
//! most 16 at a time, all from one shared encoded model (`Bytes`: QUIC's send buffers reference
//! it, they do not copy it). What a client may push before it is admitted is bounded by flow
//! control: a connection's receive window stays at [`IDLE_RECEIVE_WINDOW`] (16 KiB) and is
//! opened (to `tuning.receive_window`, and only as far as the body being read still needs) while
//! one of its bodies holds a permit; each connection has at most one update stream open. Peak
//! memory is therefore about `(max_inflight_updates x 4 + 2 x 4 + 8) x dim` bytes (update
//! buffers, the encoded model of this and of the previous round, the f64 sum) plus
//! `max_inflight_updates x tuning.receive_window`, plus QUIC's state per connected client: the
//! bodies do not grow with the number of clients ([`RunReport::update_buffers_allocated`]). QUIC's
//! state is not small: about 150-170 KB per client under load on loopback (`bench/run_load.sh`
//! fit over 16-1,024 clients, the same at d = 10^4 and 10^6). heaptrack puts it in quinn: a
//! queue event per received datagram, receive batches kept alive by buffered stream chunks, a
//! transmit buffer of one GSO batch (capped here at `transport::MAX_GSO_SEGMENTS` x MTU), and
//! per-stream send and receive buffers.
//!
//! Strangers: a connection must present a verified join within [`AUTH_TIMEOUT_S`] of its first
//! packet, and at most `max_unauthenticated` connections (`max_unauthenticated_per_address` per
//! source address) wait for theirs at once, so what unauthenticated peers can make the server
//! hold is bounded by that many connections' QUIC state, however many they attempt ([`gate`]).

mod central;
mod connection;
mod driver;
pub mod gate;
mod metrics;
mod release;
pub mod report;
pub mod resume;
mod startup;
mod transport;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use fedrl_common::scenario::Scenario;
use serde::Serialize;

use crate::state;
use crate::tls::TransportTuning;

pub use gate::{
    AUTH_TIMEOUT_S, ConnectionCounts, ConnectionStats, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_UNAUTHENTICATED, DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS,
};
pub use release::{STABLE_DIR, STABLE_SUMMARY_FILE};
pub use report::{
    OperatorCounts, Outcome, PublicReport, REPORT_VERSION, RunFailed, RunReport, describe_noise,
};
pub use resume::ResumeError;
pub use startup::run;
pub use transport::{
    DEFAULT_SEND_UDP_PAYLOAD, IDLE_RECEIVE_WINDOW, MAX_UPDATE_STREAMS_PER_CONNECTION,
};

/// How to run an aggregator.
pub struct AggregatorOptions {
    pub scenario: Scenario,
    /// Address to listen on (port 0: OS-assigned; the real address goes to `address.json`).
    pub listen: SocketAddr,
    pub state_dir: PathBuf,
    /// Updates read concurrently (each holds a reusable buffer of `4 x dim` bytes). Default 8.
    pub max_inflight_updates: usize,
    /// Transport tuning. `receive_window` is the window an admitted connection gets (idle
    /// connections get [`IDLE_RECEIVE_WINDOW`]); `max_uni_streams` is superseded by
    /// [`MAX_UPDATE_STREAMS_PER_CONNECTION`].
    pub tuning: TransportTuning,
    /// Seconds to wait for clients to acknowledge the end of the run before closing. Default 2.
    pub drain_s: f64,
    /// Upper bound of the UDP payload that MTU discovery probes for when sending, bytes (the
    /// path and the client's limit decide the real size). Default [`DEFAULT_SEND_UDP_PAYLOAD`].
    pub send_udp_payload: u16,
    /// Segmentation offload (GSO) for sending. Default true. Above 6.5 KB of
    /// `send_udp_payload` it must be off (see [`DEFAULT_SEND_UDP_PAYLOAD`]); it is turned off
    /// automatically then.
    pub segmentation_offload: bool,
    /// Resume even though this run's `target_epsilon` is larger than the one the ledger allows
    /// (the operator's explicit decision; the raise is recorded in the ledger). Default false:
    /// such a resume is refused (`LedgerError::BudgetIncrease`).
    pub allow_budget_increase: bool,
    /// Connections open at once, authenticated or not; further attempts are refused from their
    /// first packet. Default [`DEFAULT_MAX_CONNECTIONS`] (honest clients are one connection per
    /// agent process).
    pub max_connections: usize,
    /// Connections that have not presented a verified join yet, at once (each for at most
    /// [`AUTH_TIMEOUT_S`]). Default [`DEFAULT_MAX_UNAUTHENTICATED`]. When they are all taken, a
    /// newcomer from a less busy source address takes the oldest slot of the busiest one (see
    /// [`gate`]), so an attacker cannot keep honest clients out from a few addresses.
    pub max_unauthenticated: usize,
    /// Unauthenticated connections of one source address (IPv6: one /64) at once. Default
    /// [`DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS`].
    pub max_unauthenticated_per_address: usize,
    /// Live connection counters: keep a clone to watch them during the run; the final values go
    /// to the operator's report.
    pub connection_stats: std::sync::Arc<ConnectionStats>,
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
            send_udp_payload: DEFAULT_SEND_UDP_PAYLOAD,
            segmentation_offload: true,
            allow_budget_increase: false,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_unauthenticated: DEFAULT_MAX_UNAUTHENTICATED,
            max_unauthenticated_per_address: DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS,
            connection_stats: Default::default(),
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

/// Reads `address.json` from a state directory.
pub fn read_address_file(dir: &Path) -> anyhow::Result<AddressFile> {
    let p = dir.join(state::ADDRESS_FILE);
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
}
