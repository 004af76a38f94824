//! Frame I/O over quinn streams: the async edge of [`super::codec`], shared by the aggregator and
//! the client agent (feature `quic`; the privacy core never needs it).

use std::time::Duration;

use super::codec::{F32Decoder, FIXED_BODY_BYTES, check_payload_len, decode_header, parse_fixed};
use super::{
    DecodeError, Frame, Message, PREFIX_BYTES, PROTOCOL_VERSION, encode_frame, parse_length,
};
use quinn::{ReadExactError, RecvStream, SendStream};

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadFrameError {
    /// The bytes were not a valid frame (the peer's fault: answer with a protocol error).
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The stream ended in the middle of a frame or broke.
    #[error("stream: {0}")]
    Stream(String),
    #[error("timed out reading a frame")]
    Timeout,
}

/// Reads the next frame; `Ok(None)` when the stream ends cleanly between frames. The length
/// prefix is checked against `max_frame_bytes` before anything is allocated.
pub async fn read_frame(
    recv: &mut RecvStream,
    max_frame_bytes: u64,
    timeout: Duration,
) -> Result<Option<Frame>, ReadFrameError> {
    let Some(body_len) = read_prefix(recv, max_frame_bytes).await? else {
        return Ok(None);
    };
    let mut payload = Vec::new();
    let message =
        read_body_into(recv, body_len, timeout, timeout, &mut payload, &mut |_| {}).await?;
    Ok(Some(Frame {
        version: PROTOCOL_VERSION,
        message,
        payload,
    }))
}

/// Reads a frame body of `body_len` bytes (already checked against the maximum) and returns its
/// message; the payload is decoded straight from QUIC's receive chunks into `payload` (cleared
/// first; its capacity is reused), so a body is copied once and never held as bytes.
///
/// `total` bounds the whole body; `stall` bounds each wait for more bytes (a peer that stops
/// sending mid-body is dropped after `stall` even when `total` is long). Header errors are
/// reported as soon as the header is in, before the payload is read. `progress` is called after
/// every chunk with the body bytes still to read (the aggregator shrinks the connection's flow
/// control window with it).
pub async fn read_body_into(
    recv: &mut RecvStream,
    body_len: usize,
    total: Duration,
    stall: Duration,
    payload: &mut Vec<f32>,
    progress: &mut (dyn FnMut(usize) + Send),
) -> Result<Message, ReadFrameError> {
    let body = async {
        let mut fixed = [0u8; FIXED_BODY_BYTES];
        read_exact_within(recv, &mut fixed, stall, 0, body_len).await?;
        let header_len = parse_fixed(fixed, body_len)?;
        let mut header = vec![0u8; header_len];
        read_exact_within(recv, &mut header, stall, FIXED_BODY_BYTES, body_len).await?;
        let message = decode_header(&header)?;
        let payload_len = body_len - FIXED_BODY_BYTES - header_len;
        check_payload_len(payload_len)?;
        payload.clear();
        payload.reserve(payload_len / 4);
        let mut decoder = F32Decoder::new();
        let mut left = payload_len;
        while left > 0 {
            let chunk = match tokio::time::timeout(stall, recv.read_chunk(left, true)).await {
                Err(_) => return Err(ReadFrameError::Timeout),
                Ok(Ok(Some(c))) => c,
                Ok(Ok(None)) => {
                    return Err(ReadFrameError::Stream(format!(
                        "stream ended after {} of {body_len} body bytes",
                        body_len - left
                    )));
                }
                Ok(Err(e)) => return Err(ReadFrameError::Stream(e.to_string())),
            };
            decoder.push(&chunk.bytes, payload);
            left -= chunk.bytes.len();
            progress(left);
        }
        Ok(message)
    };
    match tokio::time::timeout(total, body).await {
        Err(_) => Err(ReadFrameError::Timeout),
        Ok(r) => r,
    }
}

/// `read_exact` with a timeout; `done` bytes of a `body_len`-byte body were read before.
async fn read_exact_within(
    recv: &mut RecvStream,
    buf: &mut [u8],
    timeout: Duration,
    done: usize,
    body_len: usize,
) -> Result<(), ReadFrameError> {
    match tokio::time::timeout(timeout, recv.read_exact(buf)).await {
        Err(_) => Err(ReadFrameError::Timeout),
        Ok(Ok(())) => Ok(()),
        Ok(Err(ReadExactError::FinishedEarly(n))) => Err(ReadFrameError::Stream(format!(
            "stream ended after {} of {body_len} body bytes",
            done + n
        ))),
        Ok(Err(ReadExactError::ReadError(e))) => Err(ReadFrameError::Stream(e.to_string())),
    }
}

/// Reads and checks a length prefix; `Ok(None)` at a clean end of stream.
pub async fn read_prefix(
    recv: &mut RecvStream,
    max_frame_bytes: u64,
) -> Result<Option<usize>, ReadFrameError> {
    let mut prefix = [0u8; PREFIX_BYTES];
    match recv.read_exact(&mut prefix).await {
        Ok(()) => {}
        Err(ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(ReadExactError::FinishedEarly(n)) => {
            return Err(ReadFrameError::Stream(format!(
                "stream ended inside a length prefix ({n} of 4 bytes)"
            )));
        }
        Err(ReadExactError::ReadError(e)) => return Err(ReadFrameError::Stream(e.to_string())),
    }
    Ok(Some(parse_length(prefix, max_frame_bytes)?))
}

/// Reads a frame body of `body_len` bytes (already checked against the maximum).
pub async fn read_body(
    recv: &mut RecvStream,
    body_len: usize,
    timeout: Duration,
) -> Result<Vec<u8>, ReadFrameError> {
    let mut body = vec![0u8; body_len];
    match tokio::time::timeout(timeout, recv.read_exact(&mut body)).await {
        Err(_) => Err(ReadFrameError::Timeout),
        Ok(Ok(())) => Ok(body),
        Ok(Err(ReadExactError::FinishedEarly(n))) => Err(ReadFrameError::Stream(format!(
            "stream ended after {n} of {body_len} body bytes"
        ))),
        Ok(Err(ReadExactError::ReadError(e))) => Err(ReadFrameError::Stream(e.to_string())),
    }
}

/// Why a frame could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteFrameError {
    /// The message could not be encoded (e.g. it exceeds the frame limit): the writer's own
    /// fault, retrying cannot help.
    #[error("encoding the frame: {0}")]
    Encode(#[from] DecodeError),
    /// The stream was stopped by the peer or the connection was lost.
    #[error("writing the frame: {0}")]
    Write(#[from] quinn::WriteError),
}

/// Writes one frame.
pub async fn write_frame(
    send: &mut SendStream,
    message: &Message,
    payload: &[f32],
) -> Result<(), WriteFrameError> {
    let bytes = encode_frame(message, payload)?;
    send.write_all(&bytes).await?;
    Ok(())
}
