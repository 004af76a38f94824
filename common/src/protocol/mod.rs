//! Versioned wire messages and the single codec (bincode 2 header + raw little-endian f32 payloads).
//!
//! - [`messages`]: every type that crosses the wire ([`Message`] and its parts).
//! - [`codec`]: the one codec: length-prefixed frames, a fixed protocol-version field, a bincode
//!   header and an optional raw f32 payload, with a hard maximum size checked before allocation.
//! - [`auth`]: enrolment tokens (HMAC-SHA256) and certificate fingerprints (SHA-256).
//!
//! Connection layout (QUIC): the client opens **one** bidirectional control stream and sends
//! [`Message::Join`]; the server answers [`Message::Welcome`] or [`Message::Error`], and later
//! sends acknowledgements, errors and [`Message::Leave`] on it. Model parameters travel on a
//! server-opened unidirectional stream per round offer; updates travel on client-opened
//! unidirectional streams (one or more [`Message::Update`] frames each). Large payloads therefore
//! never block the control stream.

pub mod auth;
pub mod codec;
pub mod messages;
#[cfg(feature = "quic")]
pub mod quic_io;

pub use codec::{
    DEFAULT_MAX_FRAME_BYTES, DecodeError, Frame, MAX_CONTROL_FRAME_BYTES, MAX_HEADER_BYTES,
    PREFIX_BYTES, decode_body, decode_frame, encode_frame, encode_payload, frame_prefix,
    parse_length,
};
pub use messages::*;

/// The protocol version every frame carries. A peer speaking another version gets
/// [`ErrorCode::UnsupportedVersion`] and is disconnected.
///
/// Version 2: round specs carry `offer_dim`; units can upload their data (`UnitData`,
/// `DataComplete`) for the central update mode.
/// Version 3: DataRelease of expert-level runs (`TrajectoryRequest`, `TrajectoryData`,
/// `PrefixQuery`, `PrefixCounts`, `StableReleased`).
/// Version 4: `Join` carries the agent's `instance` (one token on two agent processes is refused
/// instead of the two replacing each other); `ErrorCode::AlreadyConnected`.
/// Version 5: the DPPG task in `Welcome` may carry `normalize_advantages` (local update) and the
/// server optimizer's fields (`server_optimizer`, `server_adam_*`). A version-4 agent would
/// refuse such a task as unknown fields; the version says why instead.
/// Version 6: the `primorl` task (seed 001) in `Welcome`.
/// Version 7: the DataRelease reveals a candidate in chunks (`TrajectoryRequest::from_step` and
/// `steps`, `TrajectoryData::from_step` and `ended`, `PrefixQuery::from_step`,
/// `PrefixCounts::from_step`); `Welcome` carries the task as a `TaskConfig` (kind, the kind's
/// own configuration version, the configuration) and round specs no longer repeat the task.
/// From this version on, a new task kind or a change of one kind's configuration travels as
/// data and is versioned by the task (`TaskSpec::CONFIG_VERSION`), not by this number.
pub const PROTOCOL_VERSION: u16 = 7;

/// QUIC application close codes, shared by the aggregator (which closes with them) and the
/// client agent (which decides from them whether to reconnect).
pub mod close_code {
    /// The run is over (its rounds were attempted, or the budget or the population is
    /// exhausted): do not reconnect.
    pub const FINISHED: u32 = 0;
    /// A protocol violation (bad frame, oversized frame, wrong version, unexpected message).
    pub const PROTOCOL: u32 = 1;
    /// Authentication failed.
    pub const AUTH: u32 = 2;
    /// The join was refused (units in use).
    pub const REFUSED: u32 = 3;
    /// A newer connection of the same client (the same agent instance, reconnecting) replaced
    /// this one.
    pub const REPLACED: u32 = 4;
    /// The aggregator is shutting down (interrupted by its operator) and will resume the run:
    /// reconnect with backoff.
    pub const SHUTDOWN: u32 = 5;
    /// The run stopped for an error on the aggregator (the close reason says which): do not
    /// reconnect; the run is not finished.
    pub const ERROR: u32 = 6;
    /// Sent by a client agent whose churn model simulates a disconnect in the middle of an
    /// upload (the aggregator treats it like any lost connection).
    pub const SIMULATED_DISCONNECT: u32 = 7;
    /// The join was refused: the client id is connected already from another agent instance
    /// (another process holds the same token). Not fatal: the holder may be this agent's own
    /// crashed predecessor, whose connection the server has not timed out yet, so the agent
    /// retries with backoff and gives up after its limit with this reason.
    pub const DUPLICATE: u32 = 8;
    /// The connection did not present a valid join within the aggregator's authentication
    /// deadline, or its unauthenticated slot was given to a connection from another address while
    /// the aggregator was full. Not fatal: a client retries with backoff.
    pub const UNAUTHENTICATED: u32 = 9;
}
