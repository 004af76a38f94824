//! Frame I/O over quinn streams: the async edge of [`super::codec`], shared by the aggregator and
//! the client agent (feature `quic`; the privacy core never needs it).

use std::time::Duration;

use super::{DecodeError, Frame, Message, PREFIX_BYTES, decode_body, encode_frame, parse_length};
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
    let body = read_body(recv, body_len, timeout).await?;
    Ok(Some(decode_body(&body)?))
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

/// Writes one frame.
pub async fn write_frame(
    send: &mut SendStream,
    message: &Message,
    payload: &[f32],
) -> Result<(), String> {
    let bytes = encode_frame(message, payload).map_err(|e| e.to_string())?;
    send.write_all(&bytes).await.map_err(|e| e.to_string())
}
