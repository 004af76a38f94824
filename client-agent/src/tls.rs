//! Certificate pinning: the client trusts exactly one certificate, identified by its SHA-256
//! fingerprint. The TLS handshake signature is still verified (with the ring provider's
//! algorithms), so a peer must hold the private key of the pinned certificate.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use quinn::crypto::rustls::QuicClientConfig;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// The server presented a certificate other than the pinned one: a configuration error (or an
/// impostor), never worth retrying.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "server certificate fingerprint mismatch: expected {}, got {}",
    fedrl_common::protocol::auth::to_hex(expected),
    fedrl_common::protocol::auth::to_hex(got)
)]
pub struct FingerprintMismatch {
    /// The pinned SHA-256.
    pub expected: [u8; 32],
    /// The SHA-256 of the certificate the server presented.
    pub got: [u8; 32],
}

/// Where a [`PinnedCertVerifier`] reports a rejected certificate, so a failed handshake can be
/// classified by type: quinn turns the verifier's error into a transport error carrying only
/// text. Shared by clones; the agent drains it around each handshake.
#[derive(Clone, Debug, Default)]
pub struct PinReport(Arc<Mutex<Option<FingerprintMismatch>>>);

impl PinReport {
    /// The last mismatch since the previous call, if any.
    pub fn take(&self) -> Option<FingerprintMismatch> {
        // A poisoned lock only means another handshake panicked mid-report; the value is whole.
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn record(&self, mismatch: FingerprintMismatch) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(mismatch);
    }
}

/// Accepts the server certificate whose SHA-256 is `fingerprint`, and nothing else.
#[derive(Debug)]
pub struct PinnedCertVerifier {
    fingerprint: [u8; 32],
    algorithms: WebPkiSupportedAlgorithms,
    report: PinReport,
}

impl PinnedCertVerifier {
    pub fn new(fingerprint: [u8; 32]) -> Self {
        let algorithms = rustls::crypto::ring::default_provider().signature_verification_algorithms;
        PinnedCertVerifier {
            fingerprint,
            algorithms,
            report: PinReport::default(),
        }
    }

    /// Where this verifier reports rejected certificates.
    pub fn report(&self) -> PinReport {
        self.report.clone()
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
        let digest = ring::digest::digest(&ring::digest::SHA256, end_entity.as_ref());
        if digest.as_ref() == self.fingerprint {
            return Ok(ServerCertVerified::assertion());
        }
        let mut got = [0u8; 32];
        got.copy_from_slice(digest.as_ref());
        let mismatch = FingerprintMismatch {
            expected: self.fingerprint,
            got,
        };
        let text = mismatch.to_string();
        self.report.record(mismatch);
        Err(rustls::Error::General(text))
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
    Ok(pinned_client_config(fingerprint)?.0)
}

/// The quinn client configuration pinning `fingerprint`, with the report its verifier writes
/// rejected certificates to (see [`PinReport`]).
pub fn pinned_client_config(
    fingerprint: [u8; 32],
) -> anyhow::Result<(quinn::ClientConfig, PinReport)> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = PinnedCertVerifier::new(fingerprint);
    let report = verifier.report();
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the ring provider")?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
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
    Ok((cfg, report))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn verify(v: &PinnedCertVerifier, cert: &[u8]) -> Result<ServerCertVerified, rustls::Error> {
        let name = ServerName::try_from("localhost").unwrap();
        v.verify_server_cert(
            &CertificateDer::from(cert.to_vec()),
            &[],
            &name,
            &[],
            UnixTime::now(),
        )
    }

    #[test]
    fn a_mismatch_is_reported_by_type_and_a_match_is_not() {
        let good = b"the pinned certificate".as_slice();
        let bad = b"another certificate".as_slice();
        let mut fp = [0u8; 32];
        fp.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, good).as_ref());
        let v = PinnedCertVerifier::new(fp);
        let report = v.report();
        assert!(verify(&v, good).is_ok());
        assert_eq!(report.take(), None);
        assert!(verify(&v, bad).is_err());
        let m = report.take().expect("the mismatch is reported");
        assert_eq!(m.expected, fp);
        assert_eq!(
            m.got.as_slice(),
            ring::digest::digest(&ring::digest::SHA256, bad).as_ref()
        );
        // Taken once.
        assert_eq!(report.take(), None);
    }
}
