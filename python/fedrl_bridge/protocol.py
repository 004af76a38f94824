"""The Gymnasium bridge's wire format (version 1), shared with `simulators/src/gym_bridge/protocol.rs`.

Every message is a 24-byte header followed by a payload:

    offset  size  field
    0       4     magic b"FRGB"
    4       2     protocol version (u16, little-endian)
    6       2     message type (u16)
    8       4     count: number of environments the message is about (u32)
    12      4     reserved, 0
    16      8     payload length in bytes (u64)

Payloads are raw little-endian arrays (f32, f64, i64, u64, u8) laid end to end, never
per-element serialisation; only the rare set-up messages (INIT, MAKE, SPACES, ERROR) carry UTF-8
JSON or text. The Rust side is authoritative: it checks every length and every value it reads.
"""

import struct

MAGIC = b"FRGB"
VERSION = 1
HEADER = struct.Struct("<4sHHIIQ")
assert HEADER.size == 24

# Requests (Rust -> worker).
INIT = 1  # JSON {"env_id", "module", "probe_kwargs", "reuse_envs"}: import, make one env, answer SPACES.
# JSON list of kwargs dicts: replace the worker's envs with one per dict (slots 0..n); with
# INIT's "reuse_envs", environments of the previous MAKE with equal kwargs are reused (worker.py).
MAKE = 2
RESET = 3  # i64 slots[n], u64 seeds[n] -> OBS
STEP = 4  # i64 slots[n], actions (i64[n] for Discrete, f32[n * dim] for Box) -> STEP_RESULT
CLOSE = 5  # close every env and exit 0

# Replies (worker -> Rust).
SPACES = 101  # JSON {"observation": space, "action": space, "gymnasium": version, "protocol": 1}
OK = 102  # count = number of envs made
OBS = 103  # f32 obs[n * obs_dim]
STEP_RESULT = 104  # f32 obs[n * obs_dim], f64 reward[n], u8 terminated[n], u8 truncated[n]
ERROR = 199  # UTF-8 message; the worker stays usable unless it says otherwise


class ProtocolError(Exception):
    """A frame that does not follow this format."""


def pack(msg_type: int, count: int, payload: bytes) -> bytes:
    """One frame: header then payload."""
    return HEADER.pack(MAGIC, VERSION, msg_type, count, 0, len(payload)) + payload


def read_exact(stream, n: int) -> bytes | None:
    """Exactly `n` bytes, or None at end of stream (before the first byte)."""
    chunks = []
    got = 0
    while got < n:
        b = stream.read(n - got)
        if not b:
            if got == 0:
                return None
            raise ProtocolError(f"stream ended inside a frame ({got} of {n} bytes)")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def read_frame(stream, max_payload: int = 1 << 30):
    """(type, count, payload) of the next frame, or None at end of stream."""
    head = read_exact(stream, HEADER.size)
    if head is None:
        return None
    magic, version, msg_type, count, _reserved, length = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this worker speaks {VERSION}")
    if length > max_payload:
        raise ProtocolError(f"payload of {length} bytes exceeds {max_payload}")
    payload = read_exact(stream, length) if length else b""
    if payload is None:
        raise ProtocolError("stream ended before the payload")
    return msg_type, count, payload
