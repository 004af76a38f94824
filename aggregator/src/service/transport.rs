//! QUIC transport tuning: datagram sizes, the GSO batch cap, receive windows, and creating the
//! server endpoint.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;

use super::AggregatorOptions;
use crate::tls;

/// A connection's receive window while none of its update bodies is admitted, bytes: what a
/// client can push before the server asks for it. Small, because every connected client may hold
/// this much in the server's memory; large enough for control messages and update headers.
pub const IDLE_RECEIVE_WINDOW: u32 = 16 << 10;

/// Update streams a client may have open at once. One: a client's second stream could only wait
/// for the first (bodies of one connection are read one at a time), and while it waited its
/// bytes would eat the connection window the first one needs (the deadlock behind commit
/// 4fd0610). A client that opens streams in parallel gets them one after another, so it can never
/// hold more than one of the `max_inflight_updates` read permits that honest clients share.
pub const MAX_UPDATE_STREAMS_PER_CONNECTION: u32 = 1;

/// Largest UDP payload accepted from clients (the maximum): a client on loopback or a
/// jumbo-frame link may send big datagrams, which divide QUIC's per-packet costs.
const MAX_UDP_PAYLOAD: u16 = 65_527;

/// Largest UDP payload the aggregator probes for when sending, by default, bytes. quinn sends
/// up to 10 datagrams per system call with segmentation offload (GSO), and Linux refuses a
/// batch over 64 KiB; quinn counts that refusal as a lost MTU probe, so with datagrams over
/// about 6.5 KB whole batches would vanish. 6,400 keeps GSO batches legal.
pub const DEFAULT_SEND_UDP_PAYLOAD: u16 = 6_400;

/// Largest datagram with which a batch of 10 still fits in 64 KiB, bytes.
const MAX_GSO_UDP_PAYLOAD: u16 = 6_500;

/// Datagrams per GSO send. quinn keeps, per connection, a transmit buffer as large as its
/// largest batch (up to 10 datagrams), so once a connection has sent a large offer it holds
/// 10 x MTU bytes (64 KB at 6,400-byte datagrams) for the rest of its life. Three datagrams per
/// batch cut peak RSS by 10-14 MB at 256 clients with no measured loss of ingest throughput.
const MAX_GSO_SEGMENTS: usize = 3;

/// The runtime's UDP socket, sending at most `cap` datagrams per GSO batch.
#[derive(Debug)]
struct CappedGso {
    inner: Arc<dyn quinn::AsyncUdpSocket>,
    cap: usize,
}

impl quinn::AsyncUdpSocket for CappedGso {
    fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
        self.inner.clone().create_io_poller()
    }
    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        self.inner.try_send(transmit)
    }
    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }
    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }
    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments().min(self.cap)
    }
    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }
    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

/// Creates the server endpoint on `opts.listen`: TLS with `identity`, connections starting at
/// [`IDLE_RECEIVE_WINDOW`] with one update stream, MTU discovery up to `opts.send_udp_payload`,
/// GSO batches capped at [`MAX_GSO_SEGMENTS`], and a stateless-reset key derived from `secret`.
pub(super) fn create_endpoint(
    opts: &AggregatorOptions,
    identity: &tls::Identity,
    secret: &[u8],
) -> anyhow::Result<quinn::Endpoint> {
    // Connections start with the idle window; a body's admission opens it (see `Admission`).
    let mut tuning = opts.tuning.clone();
    tuning.receive_window = IDLE_RECEIVE_WINDOW;
    tuning.max_uni_streams = MAX_UPDATE_STREAMS_PER_CONNECTION;
    let mut server_cfg = tls::server_config(identity, &tuning)?;
    let transport = Arc::get_mut(&mut server_cfg.transport)
        .context("the transport configuration is not shared yet")?;
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(opts.send_udp_payload.max(1200));
    transport
        .mtu_discovery_config(Some(mtu))
        .enable_segmentation_offload(
            opts.segmentation_offload && opts.send_udp_payload <= MAX_GSO_UDP_PAYLOAD,
        );
    let socket = tls::udp_socket(opts.listen)?;
    let runtime = quinn::default_runtime().context("no async runtime for quinn")?;
    // A stateless-reset key derived from the persistent secret: after a crash and restart on the
    // same address, clients of the dead process get a valid stateless reset and reconnect at
    // once instead of waiting for their idle timeout.
    let reset_key = ring::hmac::sign(
        &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret),
        b"fedrl-stateless-reset-v1",
    );
    let mut endpoint_cfg = quinn::EndpointConfig::new(Arc::new(ring::hmac::Key::new(
        ring::hmac::HMAC_SHA256,
        reset_key.as_ref(),
    )));
    endpoint_cfg
        .max_udp_payload_size(MAX_UDP_PAYLOAD)
        .context("maximum UDP payload")?;
    let socket: Arc<dyn quinn::AsyncUdpSocket> = Arc::new(CappedGso {
        inner: runtime.wrap_udp_socket(socket)?,
        cap: MAX_GSO_SEGMENTS,
    });
    quinn::Endpoint::new_with_abstract_socket(endpoint_cfg, Some(server_cfg), socket, runtime)
        .context("creating the QUIC endpoint")
}
