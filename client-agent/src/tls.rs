//! Certificate pinning: the client trusts exactly one certificate, identified by its SHA-256
//! fingerprint. The TLS handshake signature is still verified (with the ring provider's
//! algorithms), so a peer must hold the private key of the pinned certificate.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use quinn::crypto::rustls::QuicClientConfig;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// Accepts the server certificate whose SHA-256 is `fingerprint`, and nothing else.
#[derive(Debug)]
pub struct PinnedCertVerifier {
    fingerprint: [u8; 32],
    algorithms: WebPkiSupportedAlgorithms,
}

impl PinnedCertVerifier {
    pub fn new(fingerprint: [u8; 32]) -> Self {
        let algorithms = rustls::crypto::ring::default_provider().signature_verification_algorithms;
        PinnedCertVerifier {
            fingerprint,
            algorithms,
        }
    }
}

impl ServerCertVerifier for PinnedCertVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let got = ring::digest::digest(&ring::digest::SHA256, end_entity.as_ref());
        if got.as_ref() == self.fingerprint {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "server certificate fingerprint mismatch: expected {}, got {}",
                fedrl_common::protocol::auth::to_hex(&self.fingerprint),
                fedrl_common::protocol::auth::to_hex(got.as_ref())
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The quinn client configuration pinning `fingerprint`.
pub fn client_config(fingerprint: [u8; 32]) -> anyhow::Result<quinn::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the ring provider")?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedCertVerifier::new(fingerprint)))
        .with_no_client_auth();
    let crypto = QuicClientConfig::try_from(tls).context("QUIC TLS configuration")?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    let mut transport = quinn::TransportConfig::default();
    transport
        // A dead aggregator is noticed within 8 s even without a stateless reset.
        .keep_alive_interval(Some(Duration::from_secs(1)))
        .max_idle_timeout(Some(
            quinn::IdleTimeout::try_from(Duration::from_secs(8)).context("idle timeout")?,
        ));
    cfg.transport_config(Arc::new(transport));
    Ok(cfg)
}

/// A client endpoint on an ephemeral port with large UDP buffers (many connections can share it).
pub fn client_endpoint(server: std::net::SocketAddr) -> anyhow::Result<quinn::Endpoint> {
    use socket2::{Domain, Protocol, Socket, Type};
    let bind: std::net::SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()
    .context("bind address")?;
    let socket = Socket::new(Domain::for_address(bind), Type::DGRAM, Some(Protocol::UDP))?;
    let _ = socket.set_recv_buffer_size(4 << 20);
    let _ = socket.set_send_buffer_size(4 << 20);
    socket.bind(&bind.into())?;
    let runtime = quinn::default_runtime().context("no async runtime for quinn")?;
    let ep = quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        None,
        socket.into(),
        runtime,
    )?;
    Ok(ep)
}
