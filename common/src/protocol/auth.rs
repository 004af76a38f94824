//! Enrolment tokens and certificate fingerprints.
//!
//! **Tokens.** The aggregator holds a 32-byte enrolment secret (created on first start in its
//! state directory). The token of client id `c` is `c.` followed by the hex HMAC-SHA256 of
//! `"fedrl-enrol-v1:" || c` under that secret. A client presents its token in [`super::Join`]; the
//! server recomputes and compares it with `ring::hmac::verify` (constant time). Why this scheme
//! rather than a challenge-response: the token only ever travels inside the TLS 1.3 channel to a
//! server whose certificate fingerprint the client pinned, so it cannot be observed or replayed
//! to a different server; and the server needs no per-client database: issuing a token is one
//! HMAC, revoking all of them is rotating the secret.
//!
//! **Fingerprints.** Clients pin the aggregator's self-signed certificate by the SHA-256 of its
//! DER encoding, written as 64 lowercase hex digits (colons and case are ignored when parsing).

use ring::{digest, hmac};
use thiserror::Error;

const TOKEN_CONTEXT: &[u8] = b"fedrl-enrol-v1:";
/// Length of an enrolment secret, in bytes.
pub const SECRET_BYTES: usize = 32;
/// Longest accepted client id, in bytes.
pub const MAX_CLIENT_ID_BYTES: usize = 128;

#[derive(Debug, Error, PartialEq)]
pub enum AuthError {
    #[error("malformed token (expected <client-id>.<64 hex digits>)")]
    Malformed,
    #[error("invalid token for client {0:?}")]
    Invalid(String),
    #[error("malformed SHA-256 fingerprint {0:?} (expected 64 hex digits)")]
    BadFingerprint(String),
}

/// Issues the token of `client_id` under `secret`. Client ids may not contain `.`.
pub fn issue_token(secret: &[u8], client_id: &str) -> Result<String, AuthError> {
    if client_id.is_empty() || client_id.contains('.') || client_id.len() > MAX_CLIENT_ID_BYTES {
        return Err(AuthError::Malformed);
    }
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let tag = hmac::sign(&key, &[TOKEN_CONTEXT, client_id.as_bytes()].concat());
    Ok(format!("{client_id}.{}", to_hex(tag.as_ref())))
}

/// Verifies `token` under `secret` in constant time; returns the client id it names.
pub fn verify_token(secret: &[u8], token: &str) -> Result<String, AuthError> {
    let (id, mac_hex) = token.rsplit_once('.').ok_or(AuthError::Malformed)?;
    if id.is_empty() || id.len() > MAX_CLIENT_ID_BYTES {
        return Err(AuthError::Malformed);
    }
    let mac = from_hex(mac_hex).ok_or(AuthError::Malformed)?;
    if mac.len() != 32 {
        return Err(AuthError::Malformed);
    }
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    hmac::verify(&key, &[TOKEN_CONTEXT, id.as_bytes()].concat(), &mac)
        .map_err(|_| AuthError::Invalid(id.to_string()))?;
    Ok(id.to_string())
}

/// SHA-256 of `der` as 64 lowercase hex digits.
pub fn sha256_fingerprint(der: &[u8]) -> String {
    to_hex(digest::digest(&digest::SHA256, der).as_ref())
}

/// Parses a fingerprint (hex, optional `:` separators, any case) into 32 bytes.
pub fn parse_fingerprint(text: &str) -> Result<[u8; 32], AuthError> {
    let clean: String = text.chars().filter(|c| *c != ':').collect();
    let bytes = from_hex(clean.trim()).ok_or_else(|| AuthError::BadFingerprint(text.into()))?;
    bytes
        .try_into()
        .map_err(|_| AuthError::BadFingerprint(text.into()))
}

/// Lowercase hex.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses hex (any case); `None` on odd length or a non-hex digit.
pub fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    text.as_bytes()
        .chunks_exact(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_round_trip_and_rejections() {
        let secret = [7u8; 32];
        let token = issue_token(&secret, "agent-3").unwrap();
        assert_eq!(verify_token(&secret, &token).unwrap(), "agent-3");
        assert_eq!(
            verify_token(&[8u8; 32], &token),
            Err(AuthError::Invalid("agent-3".into()))
        );
        // Changing the id invalidates the MAC.
        let forged = token.replacen("agent-3", "agent-4", 1);
        assert!(verify_token(&secret, &forged).is_err());
        assert_eq!(verify_token(&secret, "nonsense"), Err(AuthError::Malformed));
        assert_eq!(verify_token(&secret, "a.zz"), Err(AuthError::Malformed));
        assert!(issue_token(&secret, "a.b").is_err());
    }

    #[test]
    fn fingerprint_parse() {
        let fp = sha256_fingerprint(b"cert");
        assert_eq!(fp.len(), 64);
        let with_colons: String = fp
            .as_bytes()
            .chunks(2)
            .map(|c| std::str::from_utf8(c).unwrap().to_uppercase())
            .collect::<Vec<_>>()
            .join(":");
        assert_eq!(
            parse_fingerprint(&with_colons).unwrap(),
            parse_fingerprint(&fp).unwrap()
        );
        assert!(parse_fingerprint("abc").is_err());
    }
}
