//! The bridge's wire format, version 1 (its Python twin: `python/fedrl_bridge/protocol.py`).
//!
//! A frame is a 24-byte header (magic `FRGB`, version u16, message type u16, count u32,
//! reserved u32, payload length u64, all little-endian) and a payload of raw little-endian
//! arrays laid end to end. Only the set-up messages (INIT, MAKE, SPACES, ERROR) carry JSON or
//! text. Invariant: nothing read from a worker is trusted — every length is checked against
//! what the request implies before a byte of it is used, and payloads are capped.

use std::io::{Read, Write};

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"FRGB";
/// Protocol version this side speaks; a worker answering another version is refused.
pub const VERSION: u16 = 1;
/// Header length in bytes.
pub const HEADER_LEN: usize = 24;
/// Largest payload accepted from a worker (bytes): 1 GiB, far above any batch.
pub const MAX_PAYLOAD: u64 = 1 << 30;

/// Request: JSON `{"env_id", "module", "probe_kwargs", "reuse_envs"}`; the reply is [`SPACES`].
pub const INIT: u16 = 1;
/// Request: JSON list of `count` kwargs objects; the worker replaces its environments with one
/// per object (slots `0..count`), reusing the previous ones with equal kwargs when INIT said
/// `reuse_envs` (reset with a seed before use, they play the episodes new ones would); the
/// reply is [`OK`].
pub const MAKE: u16 = 2;
/// Request: i64 slots\[count\], u64 seeds\[count\]; the reply is [`OBS`].
pub const RESET: u16 = 3;
/// Request: i64 slots\[count\], then i64 actions\[count\] (Discrete) or f32
/// actions\[count x dim\] (Box); the reply is [`STEP_RESULT`].
pub const STEP: u16 = 4;
/// Request: close every environment and exit 0 (no reply).
pub const CLOSE: u16 = 5;
/// Reply to [`INIT`]: JSON spaces.
pub const SPACES: u16 = 101;
/// Reply to [`MAKE`]: count = environments made.
pub const OK: u16 = 102;
/// Reply to [`RESET`]: f32 obs\[count x obs_dim\].
pub const OBS: u16 = 103;
/// Reply to [`STEP`]: f32 obs\[count x obs_dim\], f64 reward\[count\], u8
/// terminated\[count\], u8 truncated\[count\].
pub const STEP_RESULT: u16 = 104;
/// Reply: a UTF-8 error message (an exception in the worker).
pub const ERROR: u16 = 199;

/// One decoded frame.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    pub kind: u16,
    pub count: u32,
    pub payload: Vec<u8>,
}

/// Writes one frame (header then payload) and flushes.
pub fn write_frame(
    w: &mut impl Write,
    kind: u16,
    count: u32,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut head = [0u8; HEADER_LEN];
    head[0..4].copy_from_slice(&MAGIC);
    head[4..6].copy_from_slice(&VERSION.to_le_bytes());
    head[6..8].copy_from_slice(&kind.to_le_bytes());
    head[8..12].copy_from_slice(&count.to_le_bytes());
    head[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    w.write_all(&head)?;
    w.write_all(payload)?;
    w.flush()
}

/// Reads one frame; `Ok(None)` at a clean end of stream (before a header's first byte).
pub fn read_frame(r: &mut impl Read) -> Result<Option<Frame>, String> {
    let mut head = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(format!("stream ended inside a header ({got} of 24 bytes)")),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    if head[0..4] != MAGIC {
        return Err(format!("bad magic {:?}", &head[0..4]));
    }
    let version = u16::from_le_bytes([head[4], head[5]]);
    if version != VERSION {
        return Err(format!(
            "worker speaks protocol version {version}, this agent {VERSION}"
        ));
    }
    let kind = u16::from_le_bytes([head[6], head[7]]);
    let count = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&head[16..24]);
    let len = u64::from_le_bytes(len8);
    if len > MAX_PAYLOAD {
        return Err(format!("payload of {len} bytes exceeds {MAX_PAYLOAD}"));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)
        .map_err(|e| format!("payload of {len} bytes: {e}"))?;
    Ok(Some(Frame {
        kind,
        count,
        payload,
    }))
}

/// Appends `v` as little-endian i64s.
pub fn put_i64(out: &mut Vec<u8>, v: impl IntoIterator<Item = i64>) {
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Appends `v` as little-endian u64s.
pub fn put_u64(out: &mut Vec<u8>, v: impl IntoIterator<Item = u64>) {
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Appends `v` as little-endian f32s.
pub fn put_f32(out: &mut Vec<u8>, v: &[f32]) {
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Reads `out.len()` little-endian f32s from the front of `b`; the caller checked the length.
pub fn get_f32(b: &[u8], out: &mut [f32]) {
    for (x, c) in out.iter_mut().zip(b.chunks_exact(4)) {
        *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// Reads `out.len()` little-endian f64s from the front of `b`; the caller checked the length.
pub fn get_f64(b: &[u8], out: &mut [f64]) {
    for (x, c) in out.iter_mut().zip(b.chunks_exact(8)) {
        let mut a = [0u8; 8];
        a.copy_from_slice(c);
        *x = f64::from_le_bytes(a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_ones_are_refused() {
        let mut buf = Vec::new();
        write_frame(&mut buf, STEP, 3, &[1, 2, 3]).unwrap();
        assert_eq!(buf.len(), HEADER_LEN + 3);
        let f = read_frame(&mut buf.as_slice()).unwrap().unwrap();
        assert_eq!((f.kind, f.count, f.payload), (STEP, 3, vec![1, 2, 3]));
        assert_eq!(read_frame(&mut [].as_slice()).unwrap(), None);

        let mut bad = buf.clone();
        bad[0] = b'X';
        assert!(
            read_frame(&mut bad.as_slice())
                .unwrap_err()
                .contains("magic")
        );
        let mut v2 = buf.clone();
        v2[4] = 2;
        assert!(
            read_frame(&mut v2.as_slice())
                .unwrap_err()
                .contains("version")
        );
        let mut huge = buf.clone();
        huge[16..24].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        assert!(
            read_frame(&mut huge.as_slice())
                .unwrap_err()
                .contains("exceeds")
        );
        assert!(read_frame(&mut &buf[..HEADER_LEN + 1]).is_err());
        assert!(read_frame(&mut &buf[..5]).is_err());
    }

    #[test]
    fn arrays_are_little_endian() {
        let mut b = Vec::new();
        put_f32(&mut b, &[1.5, -2.0]);
        put_i64(&mut b, [-1]);
        assert_eq!(&b[0..4], &1.5f32.to_le_bytes());
        assert_eq!(&b[8..16], &(-1i64).to_le_bytes());
        let mut f = [0.0f32; 2];
        get_f32(&b, &mut f);
        assert_eq!(f, [1.5, -2.0]);
    }
}
