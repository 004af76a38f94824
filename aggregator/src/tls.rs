//! The aggregator's TLS identity: a self-signed certificate created on first start in the state
//! directory (`cert.der`, `key.der`), and the QUIC server configuration (rustls with ring).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use fedrl_common::protocol::auth::sha256_fingerprint;
use quinn::crypto::rustls::QuicServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// The certificate and key of the aggregator.
pub struct Identity {
    pub cert_der: Vec<u8>,
    pub key_der: Vec<u8>,
    /// SHA-256 of `cert_der`, 64 hex digits: what clients pin.
    pub fingerprint: String,
}

/// Loads `cert.der`/`key.der` from `dir`, or creates them (self-signed, names `fedrl-aggregator`
/// and `localhost`) on first start.
pub fn load_or_create_identity(dir: &Path) -> anyhow::Result<Identity> {
    let cert_path = dir.join("cert.der");
    let key_path = dir.join("key.der");
    if cert_path.exists() && key_path.exists() {
        let cert_der = std::fs::read(&cert_path)
            .with_context(|| format!("reading {}", cert_path.display()))?;
        let key_der =
            std::fs::read(&key_path).with_context(|| format!("reading {}", key_path.display()))?;
        let fingerprint = sha256_fingerprint(&cert_der);
        return Ok(Identity {
            cert_der,
            key_der,
            fingerprint,
        });
    }
    let ck = rcgen::generate_simple_self_signed(vec![
        "fedrl-aggregator".to_string(),
        "localhost".to_string(),
    ])
    .context("generating the self-signed certificate")?;
    let cert_der = ck.cert.der().to_vec();
    let key_der = ck.signing_key.serialize_der();
    crate::state::write_private(&key_path, &key_der)?;
    crate::state::write_atomic(&cert_path, &cert_der)?;
    let fingerprint = sha256_fingerprint(&cert_der);
    Ok(Identity {
        cert_der,
        key_der,
        fingerprint,
    })
}

/// Transport tuning shared by the server.
#[derive(Clone, Debug)]
pub struct TransportTuning {
    /// Per-stream receive window, bytes. Small windows bound the memory a slow server spends per
    /// client; on loopback and LANs they do not limit throughput.
    pub stream_receive_window: u32,
    /// Per-connection receive window, bytes. The aggregator service gives this window only to a
    /// connection whose update body holds a read permit; idle connections get 16 KiB (see
    /// `service.rs`), so memory does not grow with waiting clients.
    pub receive_window: u32,
    /// Concurrent unidirectional streams a client may open. The aggregator service overrides it
    /// with one update stream per connection, so a greedy client cannot hold several permits.
    pub max_uni_streams: u32,
    /// Idle timeout, seconds.
    pub idle_timeout_s: u64,
}

impl Default for TransportTuning {
    fn default() -> Self {
        TransportTuning {
            stream_receive_window: 256 << 10,
            receive_window: 512 << 10,
            max_uni_streams: 256,
            idle_timeout_s: 20,
        }
    }
}

/// The quinn server configuration for `identity`.
pub fn server_config(
    identity: &Identity,
    tuning: &TransportTuning,
) -> anyhow::Result<quinn::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = vec![CertificateDer::from(identity.cert_der.clone())];
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(identity.key_der.clone()));
    let tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the ring provider")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("loading the aggregator certificate")?;
    let crypto = QuicServerConfig::try_from(tls).context("QUIC TLS configuration")?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let mut transport = quinn::TransportConfig::default();
    transport
        .stream_receive_window(tuning.stream_receive_window.into())
        .receive_window(tuning.receive_window.into())
        .max_concurrent_uni_streams(tuning.max_uni_streams.into())
        .max_concurrent_bidi_streams(4u32.into())
        .keep_alive_interval(Some(Duration::from_secs(2)))
        .max_idle_timeout(Some(
            quinn::IdleTimeout::try_from(Duration::from_secs(tuning.idle_timeout_s))
                .context("idle timeout")?,
        ));
    cfg.transport_config(Arc::new(transport));
    Ok(cfg)
}

/// A UDP socket with large buffers (RUST-NOTES: default buffers make many simultaneous
/// handshakes time out).
pub fn udp_socket(addr: std::net::SocketAddr) -> anyhow::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    // Best effort: the kernel may cap the sizes.
    let _ = socket.set_recv_buffer_size(4 << 20);
    let _ = socket.set_send_buffer_size(4 << 20);
    socket
        .bind(&addr.into())
        .with_context(|| format!("binding UDP {addr}"))?;
    Ok(socket.into())
}
