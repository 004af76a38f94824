//! The wire messages. They are serde types encoded by [`super::codec`] (bincode 2, standard
//! configuration); vectors (model parameters, updates) never appear here: they travel as the raw
//! little-endian f32 payload of the frame that carries the message.
//!
//! A task crosses the wire once, in the [`Welcome`], as a [`TaskConfig`]: its kind, the version of
//! that kind's configuration and the configuration as JSON text (the scenario's task enum is
//! internally tagged for TOML, which bincode cannot decode). A new task kind, or a new version of
//! one kind's configuration, is data in that message and needs no protocol version.

use serde::{Deserialize, Serialize};

/// A privacy unit (user, trajectory or expert) id.
pub type UnitId = u64;

/// A half-open range of unit ids `[start, end)` hosted by one client agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitRange {
    pub start: UnitId,
    pub end: UnitId,
}

impl UnitRange {
    /// Number of units in the range (0 if `end <= start`).
    pub fn len(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn contains(&self, unit: UnitId) -> bool {
        unit >= self.start && unit < self.end
    }
}

impl std::fmt::Display for UnitRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

impl std::str::FromStr for UnitRange {
    type Err = String;
    /// Parses `A..B` (half-open) or a single id `A`.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let parse = |t: &str| {
            t.trim()
                .parse::<u64>()
                .map_err(|e| format!("bad unit id {t:?} in range {s:?}: {e}"))
        };
        match s.split_once("..") {
            Some((a, b)) => {
                let (start, end) = (parse(a)?, parse(b)?);
                if end <= start {
                    return Err(format!("empty unit range {s:?} (expected A..B with A < B)"));
                }
                Ok(UnitRange { start, end })
            }
            None => {
                let start = parse(s)?;
                Ok(UnitRange {
                    start,
                    end: start + 1,
                })
            }
        }
    }
}

/// Client -> server, first message on the control stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Join {
    /// The enrolment token, `<client_id>.<hex HMAC-SHA256>` (see [`super::auth`]).
    pub token: String,
    /// The units this agent hosts. They must not overlap units hosted by another client id.
    pub units: Vec<UnitRange>,
    /// Free text identifying the agent software (logged only).
    pub agent: String,
    /// Random, drawn once per agent process. A join with the same client id and the same
    /// instance replaces that client's connection (a reconnect); a join from another instance
    /// while the first connection is open is refused ([`ErrorCode::AlreadyConnected`]): two
    /// processes holding one token would otherwise replace each other forever.
    pub instance: u64,
}

/// A task as the protocol carries it (`fedrl_common::task::Task::to_wire` / `from_wire`). The
/// task versions its own configuration: an agent that does not know `kind`, or reads another
/// `config_version` of it, refuses the task with a message naming both.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskConfig {
    /// The task's kind (`kind` in the scenario's TOML).
    pub kind: String,
    /// The version of that kind's configuration (`fedrl_common::task::TaskSpec::CONFIG_VERSION`).
    pub config_version: u32,
    /// The configuration: JSON of `fedrl_common::scenario::Task` (its `kind` tag is `kind`).
    pub config_json: String,
}

/// Server -> client, answer to an accepted [`Join`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Welcome {
    /// The session id the server assigned to this connection.
    pub session: u64,
    /// The scenario's task.
    pub task: TaskConfig,
    /// The scenario's churn model (JSON of `fedrl_common::scenario::Churn`), applied by client
    /// agents in stress tests.
    pub churn_json: String,
    /// Length of model and update vectors (number of f32).
    pub dim: u32,
    /// The L2 bound C every update is clipped to (by the client, and again by the server).
    pub clip_norm: f64,
    /// The largest frame the server accepts, in bytes (length prefix included).
    pub max_frame_bytes: u64,
    /// The scenario seed, when the run is seeded (clients derive their users' data from it).
    pub seed: Option<u64>,
}

/// What a round asks of the units it selected.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoundSpec {
    pub round: u64,
    /// Length of every update (number of f32).
    pub dim: u32,
    /// Length of the model vector the offer carries: `dim`, or more for tasks whose offer also
    /// carries public state derived from earlier releases (offline CQL: the target network).
    pub offer_dim: u32,
    /// The L2 bound C.
    pub clip_norm: f64,
    /// Seconds from the offer until the round closes; later updates are discarded.
    pub deadline_s: f64,
}

/// Server -> client on its own unidirectional stream; the frame's payload is the current global
/// model (`spec.dim` f32).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoundOffer {
    pub spec: RoundSpec,
    /// Units hosted by this client that are in the round's cohort.
    pub units: Vec<UnitId>,
}

/// Client -> server on an update stream; the frame's payload is the unit's clipped update.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Update {
    pub round: u64,
    pub unit: UnitId,
}

/// Client -> server on its own unidirectional stream, central update mode only (DESIGN §2.5):
/// one unit's transitions, uploaded once after joining. The frame's payload is `rows` rows of
/// `2 * obs_dim + 3` f32: observation, next observation, action index, reward, terminal (0 or 1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnitData {
    pub unit: UnitId,
    pub rows: u32,
    pub obs_dim: u32,
}

/// Client -> server on the control stream, central update mode only: every hosted unit's
/// [`UnitData`] has been sent; the client's units may now be sampled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataComplete {
    /// Number of units uploaded.
    pub units: u64,
}

/// Server -> client on the control stream: an update was accepted into the round's sum.
/// DataRelease (seed 002, Algorithm 2), aggregator to the client hosting `unit`: send steps
/// `from_step..from_step + steps` of episode `episode` of that expert's demonstrations, the
/// candidate trajectory `query`. A candidate is revealed `chunk` steps at a time, and the next
/// steps are asked for only after the prefix before them passed the sparse vector test.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrajectoryRequest {
    pub query: u64,
    pub unit: UnitId,
    pub episode: u32,
    /// The first step asked for (0 at a candidate's start).
    pub from_step: u32,
    /// How many steps at most (the episode may end sooner).
    pub steps: u32,
}

/// The answer to a [`TrajectoryRequest`], on its own stream: `rows` transitions (1 to the
/// steps asked for) of `fedrl_rl::offline::dpsgd::encode_rows`' layout follow as the payload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrajectoryData {
    pub query: u64,
    pub unit: UnitId,
    pub episode: u32,
    /// Row of the episode's first transition among the unit's transitions (episodes in
    /// order): where a released prefix sits in the unit's data.
    pub first_row: u32,
    /// The step these rows start at (the request's `from_step`).
    pub from_step: u32,
    pub rows: u32,
    pub obs_dim: u32,
    /// The episode ends with these rows (there is no step `from_step + rows`).
    pub ended: bool,
}

/// DataRelease, aggregator to every client: steps `from_step..from_step + steps` of the
/// candidate trajectory `query` (payload: `steps` rows of `obs_dim` observation values then the
/// action index, as f32). A client keeps what it was sent of the candidate (`from_step` = 0
/// starts a new one) and answers with [`PrefixCounts`] for the prefixes ending in these steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefixQuery {
    pub query: u64,
    pub from_step: u32,
    pub steps: u32,
    pub obs_dim: u32,
}

/// A client's answer to [`PrefixQuery`] `query`: for h = from_step + 1..=from_step + steps,
/// the sum over the client's experts of the probability that the expert plays the prefix's
/// first h actions (each expert's term is a probability, so at most 1: the sensitivity of the
/// count is 1 per expert).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefixCounts {
    pub query: u64,
    pub from_step: u32,
    pub counts: Vec<f64>,
}

/// One released prefix: the first `steps` transitions of episode `episode` of expert `unit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleasedPrefix {
    pub unit: UnitId,
    pub episode: u32,
    /// Row of the episode's first transition among the unit's transitions.
    pub first_row: u32,
    pub steps: u32,
}

impl ReleasedPrefix {
    /// The released rows of each unit, as `(first_row, count)` ranges.
    pub fn ranges_by_unit(
        prefixes: &[ReleasedPrefix],
    ) -> std::collections::BTreeMap<UnitId, Vec<(usize, usize)>> {
        let mut by_unit = std::collections::BTreeMap::<UnitId, Vec<(usize, usize)>>::new();
        for p in prefixes {
            by_unit
                .entry(p.unit)
                .or_default()
                .push((p.first_row as usize, p.steps as usize));
        }
        by_unit
    }
}

/// DataRelease done, aggregator to each client: the released prefixes of the client's own
/// experts. They are public now; DP-SGD steps draw only from the rest (D_unst).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StableReleased {
    pub prefixes: Vec<ReleasedPrefix>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ack {
    pub round: u64,
    pub unit: UnitId,
    /// The L2 norm the server measured before its own clipping.
    pub norm: f64,
    /// True if the server had to scale the update down to the clip norm.
    pub clipped: bool,
}

/// Why something was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// Bytes that do not decode as a frame or message.
    BadFrame,
    /// A length prefix above the hard maximum.
    FrameTooLarge,
    /// A protocol version this server does not speak.
    UnsupportedVersion,
    /// The enrolment token was not valid.
    AuthFailed,
    /// A message that is not allowed in the current state (e.g. an update before joining).
    Unexpected,
    /// The join claimed units hosted by another client.
    UnitsInUse,
    /// The unit is not hosted by this client, or not in this round's cohort.
    NotInCohort,
    /// A second contribution of the same unit in the same round.
    DuplicateUnit,
    /// The update is for a round that is closed (or not open yet).
    LateUpdate,
    /// The update does not have the model's length.
    WrongLength,
    /// The update contains NaN or infinity.
    NonFinite,
    /// The server is shutting down or the run is over.
    Closing,
    /// Anything else on the server's side.
    Internal,
    /// The client id is connected already from another agent instance (another process holds
    /// the same token); followed by closing with `close_code::DUPLICATE`.
    AlreadyConnected,
}

/// An error report. Errors about one update leave the connection open; protocol errors
/// (bad frames, versions, authentication) are followed by closing the connection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorMsg {
    pub code: ErrorCode,
    pub message: String,
    pub round: Option<u64>,
    pub unit: Option<UnitId>,
}

/// Why a peer leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaveReason {
    /// The run is over (server -> client): do not reconnect.
    Finished,
    /// The peer is shutting down; a client may reconnect later.
    Shutdown,
}

/// Either side, on the control stream, before closing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Leave {
    pub reason: LeaveReason,
    pub message: String,
}

/// Every message of the protocol. The protocol version is carried by every frame
/// ([`super::codec`]), outside the bincode header, so a version mismatch is detected before the
/// header is decoded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Message {
    Join(Join),
    Welcome(Welcome),
    RoundOffer(RoundOffer),
    Update(Update),
    Ack(Ack),
    Error(ErrorMsg),
    Leave(Leave),
    UnitData(UnitData),
    DataComplete(DataComplete),
    TrajectoryRequest(TrajectoryRequest),
    TrajectoryData(TrajectoryData),
    PrefixQuery(PrefixQuery),
    PrefixCounts(PrefixCounts),
    StableReleased(StableReleased),
}

impl Message {
    /// A short name for logs and errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Join(_) => "join",
            Message::Welcome(_) => "welcome",
            Message::RoundOffer(_) => "round offer",
            Message::Update(_) => "update",
            Message::Ack(_) => "ack",
            Message::Error(_) => "error",
            Message::Leave(_) => "leave",
            Message::UnitData(_) => "unit data",
            Message::DataComplete(_) => "data complete",
            Message::TrajectoryRequest(_) => "trajectory request",
            Message::TrajectoryData(_) => "trajectory data",
            Message::PrefixQuery(_) => "prefix query",
            Message::PrefixCounts(_) => "prefix counts",
            Message::StableReleased(_) => "stable released",
        }
    }

    /// Shorthand for an error message.
    pub fn error(
        code: ErrorCode,
        message: impl Into<String>,
        round: Option<u64>,
        unit: Option<UnitId>,
    ) -> Self {
        Message::Error(ErrorMsg {
            code,
            message: message.into(),
            round,
            unit,
        })
    }
}
