//! The privacy ledger: an append-only, checksummed, fsynced file of released mechanisms.
//!
//! Each record stores the mechanism as run, from one unit's point of view ([`DpEvent`]), whether
//! the aggregator drew the sample itself, the phase it belongs to and who took part. The ledger
//! stores mechanisms, not epsilons, so it can always be re-accounted: one accounting policy
//! ([`accountant::unit_epsilon`]) turns every unit's events into its epsilon, and
//! [`PrivacyLedger::report`] reports the worst unit (tight), the RDP cross-check, each phase and
//! the basic composition of the phases.
//!
//! Cost: a run appends one record per step (100,000 steps and more), so nothing per append may
//! walk the history. Records are folded, as they are appended or read, into grouped histories
//! (`grouped.rs`: the shared sampled events and each unit's own un-sampled ones as
//! (event, count) lists, the form the accountant reads), and the budget check compares the
//! grown count with limits cached per history shape (`budget.rs`), so most appends make no
//! accountant call and the others one (a bisection once per shape near the budget). Refusals
//! fall on the same round, and every figure is the same bit for bit, as accounting every unit
//! from all records (`tests/ledger_incremental.rs` checks both against that recomputation).
//! [`PrivacyLedger::epsilon`] accounts when asked: one accountant call per distinct history.
//!
//! File layout: a header frame (format version, [`LedgerConfig`]), then one frame per entry (a
//! [`RoundRecord`] or a [`BudgetChange`]). A frame (format version 3) is `b"FRLC"`, the payload
//! length (u32 LE), the first 8 bytes of SHA-256(prev || payload), `prev` (32 bytes), then the
//! JSON payload, where `prev` is the SHA-256 of the whole frame before it (for the header, the
//! fixed [`genesis`] value). The frames form a hash chain, as certificate-transparency logs do:
//! a frame removed, reordered or inserted anywhere inside the file breaks the chain and is
//! corruption ([`LedgerError::ChainBroken`]). Frames cut from the end leave a valid chain, so
//! whatever records the ledger's position (the checkpoint, the operator's `report.json`) also
//! records its [`LedgerHead`] (entry count and the hash of the last frame), and start-up and
//! `fedrl ledger` check that the ledger still holds that head ([`PrivacyLedger::check_head`]).
//! Records are written and fsynced before the model they describe is released, so after a crash
//! the ledger can only over-report. A crash can only cut the last frame short: reopening keeps
//! every complete frame, reports the cut bytes and truncates them before the next append. A
//! complete frame that fails its checksum was written in full and may have been released, so it
//! is corruption wherever it is, never silently dropped.
//!
//! Versions: 1 (the first release) stored (z, C, q) per record; its records are converted to
//! events when read ([`RoundRecord::gaussian_round`]) and account identically. Versions 1 and 2
//! are unchained: their frames are `b"FRL1"`, the length, the first 8 bytes of SHA-256(payload)
//! and the payload, so a whole frame removed from them goes unnoticed ([`Recovery`] says so when
//! one is read). An old file still opens, and the entries this code appends to it are chained
//! frames linked to the last old one (from there on the chain holds); a version-3 file holds
//! only chained frames.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use ring::digest;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::accountant::{self, AccountantKind, Method};
use super::noise::NoiseSource;
use super::params::{ClipNorm, Delta, ParamError, SamplingRate};
use super::{DpEvent, PrivacyError};
use crate::protocol::auth::to_hex;

mod budget;
mod grouped;

use budget::BudgetCache;
use grouped::{EventId, GroupedHistories, Groups, HistoryId};

/// The ledger's file name inside a state or output directory.
pub const LEDGER_FILE_NAME: &str = "privacy.ledger";

/// The format this code writes (3: hash-chained frames).
pub const FORMAT_VERSION: u32 = 3;

/// The first format whose frames are hash-chained.
const CHAINED_VERSION: u32 = 3;

/// The phase of the federated training rounds ([`RoundRecord::gaussian_round`]).
pub const TRAINING_PHASE: &str = "training";

/// An unchained frame (format versions 1 and 2).
const MAGIC: &[u8; 4] = b"FRL1";
/// A chained frame (format version 3).
const CHAINED_MAGIC: &[u8; 4] = b"FRLC";
const FRAME_HEADER: usize = 4 + 4 + 8;
const CHAINED_HEADER: usize = FRAME_HEADER + 32;
/// No honest record comes near this; a larger length means corruption, not a big record.
const MAX_PAYLOAD: usize = 256 << 20;

/// What a privacy unit is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnitKind {
    Trajectory,
    User,
    Expert,
    /// One transition of an offline dataset (PrivORL-n, seed 003): weaker than trajectory-level.
    Transition,
}

impl std::fmt::Display for UnitKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            UnitKind::Trajectory => "trajectory",
            UnitKind::User => "user",
            UnitKind::Expert => "expert",
            UnitKind::Transition => "transition",
        })
    }
}

/// How units take part in rounds (DESIGN §3).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Participation {
    /// Each unit contributes at most once ever.
    Fresh,
    /// The aggregator samples each unit with probability `rate` every round (Poisson).
    Sampled { rate: SamplingRate },
}

impl Participation {
    /// `Sampled` at `rate`, checked to be in (0, 1].
    pub fn sampled(rate: f64) -> Result<Self, ParamError> {
        Ok(Participation::Sampled {
            rate: SamplingRate::try_from(rate)?,
        })
    }

    /// The Poisson rate under `Sampled`, `None` under `Fresh`.
    pub fn sampling_rate(&self) -> Option<SamplingRate> {
        match self {
            Participation::Fresh => None,
            Participation::Sampled { rate } => Some(*rate),
        }
    }
}

/// The fixed parameters of a ledger, stored in its header.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LedgerConfig {
    /// Budget (epsilon at `delta`): an append that would push the reported epsilon above this is
    /// refused. Reopening with a larger one needs [`OpenPolicy::allow_budget_increase`].
    pub target_epsilon: f64,
    /// The delta at which every epsilon of this ledger is reported.
    pub delta: Delta,
    pub unit_kind: UnitKind,
    pub participation: Participation,
}

/// The header frame as stored. Version 1 had no `version` field.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Header {
    #[serde(default = "version_one")]
    version: u32,
    target_epsilon: f64,
    delta: Delta,
    unit_kind: UnitKind,
    participation: Participation,
}

fn version_one() -> u32 {
    1
}

impl Header {
    fn config(&self) -> LedgerConfig {
        LedgerConfig {
            target_epsilon: self.target_epsilon,
            delta: self.delta,
            unit_kind: self.unit_kind,
            participation: self.participation,
        }
    }
}

/// One released mechanism: what ran, on whom, in which phase.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoundRecord {
    /// Sequence number; strictly increasing over the whole ledger, whatever the phase.
    pub round: u64,
    /// The part of the pipeline it belongs to (`training`, `release`, `dp-sgd`, ...). Phases
    /// are composed into one epsilon; their basic composition is reported beside it.
    pub phase: String,
    /// The mechanism as run, from one unit's point of view (sensitivity normalised to one
    /// unit's contribution).
    pub event: DpEvent,
    /// True when the aggregator itself chose who takes part (a Poisson sample, or everybody):
    /// the event then charges every unit of the population, drawn or not, and only then may it
    /// contain [`DpEvent::PoissonSampled`] (amplification by sampling is claimed only when the
    /// aggregator drew the sample). False: it charges exactly the units in `units`.
    pub sampled_by_aggregator: bool,
    /// Privacy units whose contributions are in the released output. **Operator-only**: under
    /// Poisson sampling this is the secret sample the amplification relies on. It enforces the
    /// `fresh` rule across restarts and gives participation counts.
    pub units: Vec<u64>,
    /// C: the L2 bound each unit's contribution was (re-)clipped to by the aggregator, when the
    /// mechanism has one (a Laplace count query has none).
    pub clip_norm: Option<f64>,
    /// The fixed public denominator the noisy sum was divided by, when there is one.
    pub expected_cohort: Option<f64>,
    pub noise_source: NoiseSource,
    /// Wall-clock time of the append, seconds since the Unix epoch.
    pub unix_time_s: f64,
}

impl RoundRecord {
    /// A federated training round (phase [`TRAINING_PHASE`]): the sum of contributions clipped
    /// to `clip_norm` plus N(0, (z C)^2), divided by `expected_cohort`. With `sampling_rate` =
    /// `Some(q)` the aggregator drew a Poisson sample at rate q: the event is
    /// `PoissonSampled(q, Gaussian(z))`, except at q = 1, which includes every unit every round
    /// and is the plain Gaussian (it composes exactly; a PLD of it would widen with every
    /// round). `unix_time_s` is left 0 for the caller to set when it appends.
    pub fn gaussian_round(
        round: u64,
        units: Vec<u64>,
        noise_multiplier: f64,
        clip_norm: f64,
        sampling_rate: Option<f64>,
        expected_cohort: f64,
        noise_source: NoiseSource,
    ) -> RoundRecord {
        let base = DpEvent::Gaussian { noise_multiplier };
        Self::training_round(
            round,
            units,
            base,
            clip_norm,
            sampling_rate,
            expected_cohort,
            noise_source,
        )
    }

    /// [`gaussian_round`](Self::gaussian_round) for any per-round mechanism `base` (the round
    /// engine's exact [`DpEvent::DiscreteGaussian`]): Poisson-sampled at `sampling_rate` when it
    /// is below 1, as [`training_event`] does for the Gaussian.
    pub fn training_round(
        round: u64,
        units: Vec<u64>,
        base: DpEvent,
        clip_norm: f64,
        sampling_rate: Option<f64>,
        expected_cohort: f64,
        noise_source: NoiseSource,
    ) -> RoundRecord {
        RoundRecord {
            round,
            phase: TRAINING_PHASE.to_string(),
            event: sampled_event(base, sampling_rate),
            sampled_by_aggregator: sampling_rate.is_some(),
            units,
            clip_norm: Some(clip_norm),
            expected_cohort: Some(expected_cohort),
            noise_source,
            unix_time_s: 0.0,
        }
    }

    /// The rate at which the aggregator sampled units for this record: q for a
    /// `PoissonSampled(q, ..)` event, 1 for an aggregator-chosen event without sampling (every
    /// unit was included), `None` when the aggregator did not choose the units.
    pub fn sampling_rate(&self) -> Option<f64> {
        if !self.sampled_by_aggregator {
            return None;
        }
        match &self.event {
            DpEvent::PoissonSampled { sampling_rate, .. } => Some(*sampling_rate),
            _ => Some(1.0),
        }
    }
}

/// The event of one training round at noise multiplier `z`, Poisson-sampled at `sampling_rate`
/// (rate 1 is no sampling: see [`RoundRecord::gaussian_round`]).
pub fn training_event(z: f64, sampling_rate: Option<f64>) -> DpEvent {
    sampled_event(
        DpEvent::Gaussian {
            noise_multiplier: z,
        },
        sampling_rate,
    )
}

/// `base` run on a Poisson sample at `sampling_rate` (rate 1, or no sampling, is `base` itself).
fn sampled_event(base: DpEvent, sampling_rate: Option<f64>) -> DpEvent {
    match sampling_rate {
        // An invalid rate stays in the event, so the ledger refuses the record.
        Some(q) if q != 1.0 => DpEvent::PoissonSampled {
            sampling_rate: q,
            event: Box::new(base),
        },
        Some(_) | None => base,
    }
}

/// A raise of the ledger's budget, allowed explicitly by the operator and recorded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BudgetChange {
    /// The target epsilon in force before.
    pub from: f64,
    /// The new target epsilon.
    pub to: f64,
    /// When it was recorded, seconds since the Unix epoch.
    pub unix_time_s: f64,
}

/// SHA-256 of one whole frame, as the next frame of a chained ledger carries it.
pub type FrameHash = [u8; 32];

/// The `prev` of a chained ledger's header frame: SHA-256 of a fixed string, so that a file
/// whose first frames were cut off (its new first frame names a predecessor) is corrupt.
pub fn genesis() -> FrameHash {
    sha256(b"fedrl privacy ledger: genesis")
}

/// A ledger's position as recorded elsewhere (the checkpoint, the operator's `report.json`):
/// how many entries it held and the hash of its last frame then. The ledger only grows, so a
/// later ledger must still hold this head at this position; one that does not lost entries
/// from its end or was replaced ([`PrivacyLedger::check_head`]). Operator-only, like the
/// ledger it summarises.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerHead {
    /// Entries after the header (round records and budget changes).
    pub entries: u64,
    /// SHA-256 (hex) of the frame of the last of those entries (of the header when
    /// `entries` is 0).
    pub sha256: String,
}

/// One entry after the header.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "entry", rename_all = "snake_case")]
pub enum Entry {
    Round(RoundRecord),
    BudgetChange(BudgetChange),
}

/// A record as the first release (format version 1) wrote it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RoundRecordV1 {
    round: u64,
    units: Vec<u64>,
    noise_multiplier: f64,
    clip_norm: f64,
    sampling_rate: Option<f64>,
    expected_cohort: f64,
    noise_source: NoiseSource,
    unix_time_s: f64,
}

impl From<RoundRecordV1> for RoundRecord {
    /// Version 1 accounted each record as the event [`RoundRecord::gaussian_round`] builds.
    fn from(v: RoundRecordV1) -> Self {
        let mut r = RoundRecord::gaussian_round(
            v.round,
            v.units,
            v.noise_multiplier,
            v.clip_norm,
            v.sampling_rate,
            v.expected_cohort,
            v.noise_source,
        );
        r.unix_time_s = v.unix_time_s;
        r
    }
}

/// How [`PrivacyLedger::open_with`] treats an existing ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenPolicy {
    /// Accept a target epsilon larger than the one in force (the operator's explicit decision);
    /// the raise is appended to the ledger as a [`BudgetChange`].
    pub allow_budget_increase: bool,
}

#[derive(Debug, Error)]
pub enum LedgerError {
    #[error("ledger {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "ledger {path} is corrupt at byte {offset}: {reason} (only a record cut short by a crash is a torn write; a complete record that fails its checksum was written in full and may have been released, so nothing is discarded)"
    )]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error(
        "ledger {path} is corrupt at byte {offset}: entry {entry} names a predecessor with SHA-256 {named}, but the frame before it hashes to {found}: whole records were removed, reordered or inserted before it (every frame carries the hash of the one before). Nothing is discarded; restore the ledger from a copy (the run's state directory, the `fedrl run` output's operator/ folder), never from a shortened file"
    )]
    ChainBroken {
        path: PathBuf,
        offset: u64,
        /// The entry's index after the header (0 = the header itself).
        entry: u64,
        named: String,
        found: String,
    },
    #[error(
        "ledger {path} does not hold the head that {recorded_in} recorded: {reason}. Its epsilon would be under-reported; refusing. Restore the ledger that belongs to {recorded_in}"
    )]
    HeadMismatch {
        path: PathBuf,
        recorded_in: PathBuf,
        reason: String,
    },
    #[error(
        "ledger {path} has format version {version}; this program reads versions 1 to {FORMAT_VERSION}"
    )]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("ledger {path} was created with {stored:?}, but this run asks for {requested:?}")]
    ConfigMismatch {
        path: PathBuf,
        stored: Box<LedgerConfig>,
        requested: Box<LedgerConfig>,
    },
    #[error(
        "ledger {path}: this run asks for target epsilon {requested}, above the {stored} the ledger allows; raising a privacy budget must be explicit (allow it, e.g. --allow-budget-increase, and the raise is recorded in the ledger)"
    )]
    BudgetIncrease {
        path: PathBuf,
        stored: f64,
        requested: f64,
    },
    #[error(
        "privacy budget exceeded: round {round} would bring epsilon to {epsilon:.6} (delta {delta:e}), above the target {target}; nothing was released"
    )]
    BudgetExceeded {
        round: u64,
        epsilon: f64,
        target: f64,
        delta: f64,
    },
    #[error(
        "round {round}: unit {unit} already contributed (participation is `fresh`: at most once ever)"
    )]
    UnitReused { round: u64, unit: u64 },
    #[error("round {round}: unit {unit} appears twice in one round")]
    DuplicateUnit { round: u64, unit: u64 },
    #[error("round {round} is not after the last recorded round {last}")]
    RoundOrder { round: u64, last: u64 },
    #[error("invalid record: {0}")]
    InvalidRecord(String),
    #[error(transparent)]
    Privacy(#[from] PrivacyError),
}

impl From<ParamError> for LedgerError {
    fn from(e: ParamError) -> Self {
        LedgerError::InvalidRecord(e.to_string())
    }
}

/// What reopening found.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Recovery {
    /// Complete round records read.
    pub records: usize,
    /// Byte offset where a frame cut short began, if there was one.
    pub torn_at: Option<u64>,
    /// Bytes of that frame (removed before the next append).
    pub torn_bytes: u64,
    /// The torn tail was all zero bytes: what a power loss leaves when the file's new size
    /// reached the disk before its data did (the append's fsync never returned).
    pub zero_filled: bool,
    /// `Some(n)` for a ledger written in an unchained format (versions 1 and 2): its first `n`
    /// entries carry no hash of their predecessor, so whole records removed or reordered among
    /// them cannot be detected. `None` for a chained ledger (format version 3).
    pub unchained_entries: Option<u64>,
}

impl std::fmt::Display for Recovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.fmt_torn(f)?;
        if let Some(n) = self.unchained_entries {
            write!(
                f,
                "; UNCHAINED: written in an old format (versions 1-2), whose {n} entries carry no hash of the record before them, so whole records removed or reordered among them would go unnoticed (entries appended by this version are chained)"
            )?;
        }
        Ok(())
    }
}

impl Recovery {
    fn fmt_torn(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.torn_at {
            None => write!(f, "{} records, no torn write", self.records),
            Some(at) if self.zero_filled => write!(
                f,
                "{} complete records; a zero-filled tail ({} zero bytes at offset {at}, what a power loss leaves when the file grew but its data never reached the disk) was discarded as a torn write (its append never returned, so it was never released)",
                self.records, self.torn_bytes
            ),
            Some(at) => write!(
                f,
                "{} complete records; a torn last record (cut short: {} bytes at offset {at}) was discarded (its append never returned, so it was never released)",
                self.records, self.torn_bytes
            ),
        }
    }
}

/// Epsilon of one unit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UnitEpsilon {
    pub unit: u64,
    /// Records whose released output contains this unit's contribution.
    pub participations: u64,
    /// Epsilon at the ledger's delta, every phase composed.
    pub epsilon: f64,
}

/// One phase accounted on its own.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PhaseEpsilon {
    pub phase: String,
    /// Records of this phase.
    pub rounds: u64,
    /// Worst-unit epsilon of this phase alone at `delta`.
    pub epsilon: f64,
    /// The ledger's delta divided by the number of phases (the basic composition's split).
    pub delta: f64,
    /// How `epsilon` was computed.
    pub accountant: String,
}

/// The ledger accounted.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LedgerReport {
    pub unit_kind: UnitKind,
    pub participation: Participation,
    /// Round records.
    pub rounds: u64,
    /// Distinct units that contributed.
    pub units: u64,
    /// The reported epsilon at `delta`: the worst unit, every event that charges it composed,
    /// by the chosen accountant (with PLD: the exact analytic Gaussian when a unit's events are
    /// all un-sampled Gaussians, else PLD).
    pub epsilon: f64,
    /// How `epsilon` was computed (`analytic_gaussian`, `pld`, `rdp` or `none`).
    pub accountant: String,
    /// The RDP accountant's epsilon for the worst unit's events (a cross-check, never smaller
    /// than the PLD/exact figure up to PLD discretisation); +inf when RDP cannot bound one of
    /// them (`rdp_note` says why).
    pub epsilon_rdp: f64,
    /// Why `epsilon_rdp` is +inf, if it is.
    pub rdp_note: Option<String>,
    /// The worst unit's zCDP parameter rho when every event charging it is an un-sampled
    /// Gaussian or discrete Gaussian (sum of `Delta^2 / (2 sigma^2)`): exact for both, where
    /// `epsilon` treats a discrete Gaussian as continuous up to a proven gap (see
    /// [`super::event`]). `None` when the worst unit was charged anything else (a sampled
    /// round, Laplace, the sparse-vector test), where no rho would be exact.
    pub zcdp_rho: Option<f64>,
    /// Each phase on its own at delta / P (P phases), in order of first appearance.
    pub phases: Vec<PhaseEpsilon>,
    /// Basic composition of the phases: the sum of their epsilons at delta / P each. A valid
    /// but looser bound, printed as a cross-check; never smaller than `epsilon`.
    pub epsilon_basic: f64,
    pub delta: f64,
    pub target_epsilon: f64,
    /// Budget raises recorded in the ledger, oldest first.
    pub budget_changes: Vec<BudgetChange>,
    /// Every unit's realised epsilon, ascending by unit id.
    pub per_unit: Vec<UnitEpsilon>,
    /// Noise sources used by the records (any `seeded` source means the run was not private).
    pub noise_sources: Vec<NoiseSource>,
}

/// A ledger file as read, without opening it for writing.
#[derive(Clone, Debug, PartialEq)]
pub struct LedgerFile {
    /// The format version of its header.
    pub version: u32,
    /// The header's configuration, with the target epsilon in force (the last recorded raise).
    pub config: LedgerConfig,
    /// Every entry in file order.
    pub entries: Vec<Entry>,
    pub recovery: Recovery,
    /// The SHA-256 of every complete frame, the header's first.
    hashes: Vec<FrameHash>,
}

impl LedgerFile {
    /// The round records, in order.
    pub fn records(&self) -> Vec<RoundRecord> {
        self.entries
            .iter()
            .filter_map(|e| match e {
                Entry::Round(r) => Some(r.clone()),
                Entry::BudgetChange(_) => None,
            })
            .collect()
    }

    /// The recorded budget raises, in order.
    pub fn budget_changes(&self) -> Vec<BudgetChange> {
        self.entries
            .iter()
            .filter_map(|e| match e {
                Entry::BudgetChange(b) => Some(b.clone()),
                Entry::Round(_) => None,
            })
            .collect()
    }

    /// The ledger's head: its entry count and the hash of its last frame.
    pub fn head(&self) -> LedgerHead {
        head_of(&self.hashes)
    }

    /// Checks that this ledger still holds `expected` (recorded in the file `recorded_in`):
    /// see [`PrivacyLedger::check_head`].
    pub fn check_head(
        &self,
        path: &Path,
        expected: &LedgerHead,
        recorded_in: &Path,
    ) -> Result<(), LedgerError> {
        check_head(path, &self.hashes, expected, recorded_in)
    }

    /// Accounts every record with accountant `kind`.
    pub fn report(&self, kind: AccountantKind) -> Result<LedgerReport, LedgerError> {
        let records = self.records();
        let mut index = UnitIndex::new();
        for r in &records {
            index_record(&mut index, r);
        }
        let grouped = GroupedHistories::from_records(&records, |_| true);
        let mut cache = BudgetCache::default();
        full_report(
            &self.config,
            &records,
            &index,
            &grouped,
            &self.budget_changes(),
            kind,
            &mut cache,
        )
    }
}

/// The append-only ledger file, with an in-memory index of participations and the records
/// grouped for accounting.
///
/// Accounting cost does not grow with the history: records are folded into grouped histories
/// as they are appended (shared sampled events and each unit's own un-sampled ones, as
/// (event, count) lists), and the budget check of a record compares counts with limits cached
/// per history shape (see `budget.rs`), so most appends make no accountant call at all.
pub struct PrivacyLedger {
    path: PathBuf,
    file: File,
    config: LedgerConfig,
    records: Vec<RoundRecord>,
    budget_changes: Vec<BudgetChange>,
    /// Each unit's participation count.
    participations: UnitIndex,
    /// `records` grouped for accounting, updated by every append.
    grouped: GroupedHistories,
    /// True when every unit's epsilon is known to be within the target of this process (after
    /// a successful append; not yet after opening, when the target may have been lowered).
    verified: bool,
    /// What the budget checks and epsilon queries learnt; `check` and `epsilon` take `&self`.
    cache: Mutex<BudgetCache>,
    /// The SHA-256 of every frame, the header's first; the last is the next frame's `prev`.
    hashes: Vec<FrameHash>,
}

impl PrivacyLedger {
    /// [`open_with`](Self::open_with) with the default policy: a budget raise is refused.
    pub fn open(
        path: impl AsRef<Path>,
        config: LedgerConfig,
    ) -> Result<(Self, Recovery), LedgerError> {
        Self::open_with(path, config, OpenPolicy::default())
    }

    /// Opens the ledger at `path`, creating it with `config` if it does not exist. An existing
    /// ledger must have the same delta, unit kind and participation model. A target epsilon
    /// lower than or equal to the one in force is used as asked (for this process; the file
    /// keeps the larger one it allowed); a larger one is refused with
    /// [`LedgerError::BudgetIncrease`] unless `policy` allows it, and then the raise is appended
    /// as a [`BudgetChange`] before this returns.
    pub fn open_with(
        path: impl AsRef<Path>,
        config: LedgerConfig,
        policy: OpenPolicy,
    ) -> Result<(Self, Recovery), LedgerError> {
        let path = path.as_ref().to_path_buf();
        validate_config(&config)?;
        let io = |source| LedgerError::Io {
            path: path.clone(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(io)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io)?;

        if bytes.is_empty() {
            let header = Header {
                version: FORMAT_VERSION,
                target_epsilon: config.target_epsilon,
                delta: config.delta,
                unit_kind: config.unit_kind,
                participation: config.participation,
            };
            let first = write_frame(
                &mut file,
                &genesis(),
                &serde_json::to_vec(&header).map_err(json_err)?,
            )
            .map_err(io)?;
            sync_parent(&path);
            let ledger = Self {
                path,
                file,
                config,
                records: Vec::new(),
                budget_changes: Vec::new(),
                participations: UnitIndex::new(),
                grouped: GroupedHistories::default(),
                verified: false,
                cache: Mutex::default(),
                hashes: vec![first],
            };
            return Ok((ledger, Recovery::default()));
        }

        let (frames, recovery) = scan(&path, &bytes)?;
        if frames.is_empty() {
            // Only a header cut short: nothing was ever recorded, so starting over loses nothing.
            file.set_len(0).map_err(io)?;
            file.seek(SeekFrom::Start(0)).map_err(io)?;
            drop(file);
            std::fs::remove_file(&path).map_err(io)?;
            let (ledger, _) = Self::open_with(&path, config, policy)?;
            return Ok((ledger, recovery));
        }
        let parsed = parse(&path, &frames, recovery)?;
        let stored = parsed.config.clone();
        let same = stored.delta == config.delta
            && stored.unit_kind == config.unit_kind
            && stored.participation == config.participation;
        if !same {
            return Err(LedgerError::ConfigMismatch {
                path,
                stored: Box::new(stored),
                requested: Box::new(config),
            });
        }
        // Decide on the budget before touching the file, so a refusal changes nothing.
        let raise = config.target_epsilon > stored.target_epsilon;
        if raise && !policy.allow_budget_increase {
            return Err(LedgerError::BudgetIncrease {
                path,
                stored: stored.target_epsilon,
                requested: config.target_epsilon,
            });
        }
        let mut ledger = Self {
            path,
            file,
            config,
            records: Vec::new(),
            budget_changes: Vec::new(),
            participations: UnitIndex::new(),
            grouped: GroupedHistories::default(),
            verified: false,
            cache: Mutex::default(),
            hashes: parsed.hashes,
        };
        for entry in parsed.entries {
            match entry {
                Entry::Round(r) => ledger.index(r),
                Entry::BudgetChange(b) => ledger.budget_changes.push(b),
            }
        }
        if let Some(at) = parsed.recovery.torn_at {
            let io = |source| LedgerError::Io {
                path: ledger.path.clone(),
                source,
            };
            ledger.file.set_len(at).map_err(io)?;
            ledger.file.sync_all().map_err(io)?;
        }
        if raise {
            let change = BudgetChange {
                from: stored.target_epsilon,
                to: ledger.config.target_epsilon,
                unix_time_s: now_s(),
            };
            ledger.write_entry(&Entry::BudgetChange(change.clone()))?;
            ledger.budget_changes.push(change);
        }
        let records = ledger.records.len();
        Ok((
            ledger,
            Recovery {
                records,
                ..parsed.recovery
            },
        ))
    }

    /// Reads a ledger without modifying it (torn bytes are reported, not removed): its
    /// configuration (with the target epsilon in force), its round records and what was found.
    pub fn read(
        path: impl AsRef<Path>,
    ) -> Result<(LedgerConfig, Vec<RoundRecord>, Recovery), LedgerError> {
        let file = Self::read_file(path)?;
        let records = file.records();
        Ok((file.config, records, file.recovery))
    }

    /// Reads every entry of a ledger without modifying it.
    pub fn read_file(path: impl AsRef<Path>) -> Result<LedgerFile, LedgerError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| LedgerError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let (frames, recovery) = scan(path, &bytes)?;
        if frames.is_empty() {
            return Err(corrupt(path, 0, "no complete header"));
        }
        parse(path, &frames, recovery)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The configuration this process runs under (its target epsilon is the one asked for).
    pub fn config(&self) -> &LedgerConfig {
        &self.config
    }

    pub fn records(&self) -> &[RoundRecord] {
        &self.records
    }

    /// Budget raises recorded in the ledger, oldest first.
    pub fn budget_changes(&self) -> &[BudgetChange] {
        &self.budget_changes
    }

    /// The last recorded round, if any.
    pub fn last_round(&self) -> Option<u64> {
        self.records.last().map(|r| r.round)
    }

    /// True if `unit` contributed to any recorded round.
    pub fn has_participated(&self, unit: u64) -> bool {
        self.participations.contains_key(&unit)
    }

    /// Number of recorded rounds `unit` contributed to.
    pub fn participations(&self, unit: u64) -> u64 {
        self.participations.get(&unit).map_or(0, |p| p.rounds)
    }

    /// Checks that `record` may be appended (order, units, event, budget) without writing
    /// anything. The budget is exceeded when the worst unit's epsilon with `record` appended
    /// (at the ledger's delta, by the reported accountant) is above the target.
    pub fn check(&self, record: &RoundRecord) -> Result<(), LedgerError> {
        self.validate(record)?;
        self.check_budget(record)
    }

    /// The caches, whatever a panicking holder left in them: every entry is a fact about the
    /// records (an epsilon, a count verified within or over the target), written whole.
    fn cache(&self) -> MutexGuard<'_, BudgetCache> {
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// [`check`](Self::check) without the record's validation: is every unit's epsilon, with
    /// `record` appended, within the target? Decides exactly as accounting every unit would
    /// (the worst unit above the target refuses), but only accounts the histories the record
    /// changes, and those through the cached limits.
    fn check_budget(&self, record: &RoundRecord) -> Result<(), LedgerError> {
        let g = &self.grouped;
        let cand = g.events.peek(&record.event);
        let target = self.config.target_epsilon;
        let delta = self.config.delta;
        let mut cache = self.cache();
        // Every unit's grouped history once `record` is in (the histories it does not change
        // are left out when they were verified already), each with the event whose count
        // grew.
        let mut after: Vec<(Groups, EventId)> = Vec::new();
        if record.sampled_by_aggregator {
            let mut shared = g.shared().clone();
            grouped::push(&mut shared, cand.id);
            for h in g.live() {
                after.push((grouped::merge(&shared, g.own(h)), cand.id));
            }
        } else {
            let mut moving: HashMap<HistoryId, u64> = HashMap::new();
            for &u in &record.units {
                *moving.entry(g.history_of(u)).or_default() += 1;
            }
            let mut moved: Vec<HistoryId> = moving.keys().copied().collect();
            moved.sort_unstable();
            for &h in &moved {
                let mut own = g.own(h).clone();
                grouped::push(&mut own, cand.id);
                after.push((grouped::merge(g.shared(), &own), cand.id));
            }
            if !self.verified {
                for h in g.live() {
                    let stays = h == 0 || g.members(h) > moving.get(&h).copied().unwrap_or(0);
                    if stays {
                        let groups = g.combined(h);
                        if let Some(&(last, _)) = groups.last() {
                            after.push((groups, last));
                        }
                    }
                }
            }
        }
        for (groups, vary) in &after {
            if !cache.within(groups, *vary, &cand, delta, target)? {
                drop(cache);
                return Err(self.refusal(record));
            }
        }
        Ok(())
    }

    /// The refusal of `record`, with the worst unit's epsilon had it been appended (a refusal
    /// is rare: this accounts every history once).
    fn refusal(&self, record: &RoundRecord) -> LedgerError {
        let mut with = self.grouped.clone();
        with.add(record);
        // A new event's id exists only in this copy: nothing about it may enter the cache.
        let known = self.grouped.events.find(&record.event).is_some();
        let delta = self.config.delta;
        let mut cache = self.cache();
        let mut worst = 0.0f64;
        for h in with.live() {
            let groups = with.combined(h);
            let eps = if known {
                cache.epsilon(&with.events, &groups, delta)
            } else {
                let resolved = with.events.resolve(&groups);
                accountant::unit_epsilon_grouped(&resolved, delta, AccountantKind::Pld)
            };
            match eps {
                Ok((e, _)) => {
                    if e > worst {
                        worst = e;
                    }
                }
                Err(e) => return e.into(),
            }
        }
        LedgerError::BudgetExceeded {
            round: record.round,
            epsilon: worst,
            target: self.config.target_epsilon,
            delta: self.config.delta.get(),
        }
    }

    /// Appends `record` after [`check`](Self::check), and fsyncs it: when this returns `Ok`, the
    /// round is durably accounted and its output may be released.
    pub fn append(&mut self, record: RoundRecord) -> Result<(), LedgerError> {
        self.check(&record)?;
        let entry = Entry::Round(record);
        self.write_entry(&entry)?;
        if let Entry::Round(record) = entry {
            self.index(record);
        }
        self.verified = true;
        Ok(())
    }

    fn write_entry(&mut self, entry: &Entry) -> Result<(), LedgerError> {
        let payload = serde_json::to_vec(entry).map_err(json_err)?;
        let prev = *self
            .hashes
            .last()
            .expect("a ledger always has its header frame");
        let hash =
            write_frame(&mut self.file, &prev, &payload).map_err(|source| LedgerError::Io {
                path: self.path.clone(),
                source,
            })?;
        self.hashes.push(hash);
        Ok(())
    }

    /// The ledger's head: its entry count and the hash of its last frame. Recorded beside
    /// anything that records the ledger's position (the checkpoint, the report).
    pub fn head(&self) -> LedgerHead {
        head_of(&self.hashes)
    }

    /// Checks that this ledger still holds `expected`, a head recorded in the file
    /// `recorded_in` (a checkpoint or report written when the ledger was at that position):
    /// at least `expected.entries` entries, the last of them hashing to `expected.sha256`. A
    /// ledger only grows (appends come before the checkpoint and the report that record them),
    /// so one that fails lost entries from its end or was replaced:
    /// [`LedgerError::HeadMismatch`].
    pub fn check_head(&self, expected: &LedgerHead, recorded_in: &Path) -> Result<(), LedgerError> {
        check_head(&self.path, &self.hashes, expected, recorded_in)
    }

    /// Worst-unit epsilon of every record at the ledger's delta: the same figure as
    /// [`report`](Self::report)'s, without its per-unit list, phases and RDP bound. Accounted
    /// when asked (one accountant call per distinct unit history, usually one) and kept until
    /// the next append.
    pub fn epsilon(&self) -> Result<f64, LedgerError> {
        let mut cache = self.cache();
        if let Some(e) = cache.worst {
            return Ok(e);
        }
        let g = &self.grouped;
        let mut worst = 0.0f64;
        for h in g.live() {
            let (e, _) = cache.epsilon(&g.events, &g.combined(h), self.config.delta)?;
            if e > worst {
                worst = e;
            }
        }
        cache.worst = Some(worst);
        Ok(worst)
    }

    /// Accounts every record with the reported accountant (PLD, exact where possible).
    pub fn report(&self) -> Result<LedgerReport, LedgerError> {
        self.report_with(AccountantKind::Pld)
    }

    /// Accounts every record with accountant `kind`: total, per-phase and per-unit epsilon.
    pub fn report_with(&self, kind: AccountantKind) -> Result<LedgerReport, LedgerError> {
        let mut cache = self.cache();
        full_report(
            &self.config,
            &self.records,
            &self.participations,
            &self.grouped,
            &self.budget_changes,
            kind,
            &mut cache,
        )
    }

    /// The realised epsilon of one unit at the ledger's delta.
    pub fn unit_epsilon(&self, unit: u64) -> Result<f64, LedgerError> {
        let g = &self.grouped;
        let groups = g.combined(g.history_of(unit));
        Ok(self
            .cache()
            .epsilon(&g.events, &groups, self.config.delta)?
            .0)
    }

    fn validate(&self, record: &RoundRecord) -> Result<(), LedgerError> {
        let bad = |m: String| {
            Err(LedgerError::InvalidRecord(format!(
                "round {}: {m}",
                record.round
            )))
        };
        if record.phase.trim().is_empty() {
            return bad("the phase must be named".into());
        }
        if let Err(e) = record.event.validate() {
            return bad(e.to_string());
        }
        if record.event.contains_sampling() && !record.sampled_by_aggregator {
            return bad(
                "a Poisson-sampled event needs sampled_by_aggregator: amplification by sampling \
                 is claimed only when the aggregator drew the sample"
                    .into(),
            );
        }
        if let Some(c) = record.clip_norm
            && let Err(e) = ClipNorm::try_from(c)
        {
            return bad(e.to_string());
        }
        if let Some(n) = record.expected_cohort
            && !(n.is_finite() && n > 0.0)
        {
            return bad(format!("expected cohort must be > 0, got {n}"));
        }
        if let Some(last) = self.last_round()
            && record.round <= last
        {
            return Err(LedgerError::RoundOrder {
                round: record.round,
                last,
            });
        }
        let mut seen = HashSet::with_capacity(record.units.len());
        for &u in &record.units {
            if !seen.insert(u) {
                return Err(LedgerError::DuplicateUnit {
                    round: record.round,
                    unit: u,
                });
            }
            if self.config.participation == Participation::Fresh && self.has_participated(u) {
                return Err(LedgerError::UnitReused {
                    round: record.round,
                    unit: u,
                });
            }
        }
        Ok(())
    }

    fn index(&mut self, record: RoundRecord) {
        index_record(&mut self.participations, &record);
        self.grouped.add(&record);
        self.cache().appended();
        self.records.push(record);
    }
}

fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Decodes the header and the entries of a scanned file.
fn parse(path: &Path, frames: &[Frame<'_>], recovery: Recovery) -> Result<LedgerFile, LedgerError> {
    let Some((header, rest)) = frames.split_first() else {
        return Err(corrupt(path, 0, "no complete header"));
    };
    let header: Header = serde_json::from_slice(header.payload)
        .map_err(|e| corrupt(path, header.offset, &format!("header: {e}")))?;
    if header.version == 0 || header.version > FORMAT_VERSION {
        return Err(LedgerError::UnsupportedVersion {
            path: path.to_path_buf(),
            version: header.version,
        });
    }
    // The header's frame kind and its version agree: a chained header (version 3) starts a
    // chain every later frame continues; an unchained one (versions 1-2) may be followed by
    // chained frames this code appended, never the other way round (see `scan`).
    let first = &frames[0];
    if first.chained != (header.version >= CHAINED_VERSION) {
        return Err(corrupt(
            path,
            first.offset,
            &format!(
                "a version-{} header in {} frame",
                header.version,
                if first.chained {
                    "a chained"
                } else {
                    "an unchained"
                }
            ),
        ));
    }
    let mut config = header.config();
    let mut entries = Vec::with_capacity(rest.len());
    for frame in rest {
        let entry = decode_entry(frame.payload, header.version)
            .map_err(|e| corrupt(path, frame.offset, &e.to_string()))?;
        if let Entry::BudgetChange(b) = &entry {
            config.target_epsilon = b.to;
        }
        entries.push(entry);
    }
    let records = entries
        .iter()
        .filter(|e| matches!(e, Entry::Round(_)))
        .count();
    let chained = frames.iter().filter(|f| f.chained).count();
    Ok(LedgerFile {
        version: header.version,
        config,
        entries,
        recovery: Recovery {
            records,
            unchained_entries: (header.version < CHAINED_VERSION)
                .then(|| (frames.len() - chained - 1) as u64),
            ..recovery
        },
        hashes: frames.iter().map(|f| f.hash).collect(),
    })
}

/// One entry's payload. A version-1 file holds version-1 records and, after this code appended
/// to it, version-2 entries (which carry an `entry` tag); a version-2 file only the latter.
fn decode_entry(payload: &[u8], version: u32) -> Result<Entry, serde_json::Error> {
    #[derive(Deserialize)]
    struct Probe {
        #[serde(default)]
        entry: Option<serde::de::IgnoredAny>,
    }
    if version == 1 && serde_json::from_slice::<Probe>(payload)?.entry.is_none() {
        let v1: RoundRecordV1 = serde_json::from_slice(payload)?;
        return Ok(Entry::Round(v1.into()));
    }
    serde_json::from_slice(payload)
}

/// What the ledger keeps per unit besides its grouped history.
#[derive(Clone, Debug, Default)]
struct UnitRounds {
    /// Rounds it contributed to.
    rounds: u64,
}

/// unit -> its rounds.
type UnitIndex = HashMap<u64, UnitRounds>;

fn index_record(index: &mut UnitIndex, record: &RoundRecord) {
    for &u in &record.units {
        index.entry(u).or_default().rounds += 1;
    }
}

/// Every unit's epsilon and the worst case.
struct UnitsAccount {
    worst: f64,
    method: Method,
    /// The worst unit's grouped history.
    worst_groups: Groups,
    per_unit: Vec<UnitEpsilon>,
}

/// Accounts every unit of `index` (ascending by id) and a unit that never took part, with the
/// histories of `grouped`, by accountant `kind`: one accountant call per distinct history. The
/// worst is the first largest in that order (the never-seen unit first). `cache` is the
/// ledger's, for its own `grouped` and delta only.
fn account_units(
    grouped: &GroupedHistories,
    index: &UnitIndex,
    delta: Delta,
    kind: AccountantKind,
    mut cache: Option<&mut BudgetCache>,
) -> Result<UnitsAccount, LedgerError> {
    let mut by_history: HashMap<HistoryId, (f64, Method)> = HashMap::new();
    let mut account = |h: HistoryId| -> Result<(f64, Method), LedgerError> {
        if let Some(v) = by_history.get(&h) {
            return Ok(*v);
        }
        let groups = grouped.combined(h);
        let v = match (kind, cache.as_deref_mut()) {
            (AccountantKind::Pld, Some(cache)) => cache.epsilon(&grouped.events, &groups, delta)?,
            _ => accountant::unit_epsilon_grouped(&grouped.events.resolve(&groups), delta, kind)?,
        };
        by_history.insert(h, v);
        Ok(v)
    };
    let (mut worst, mut method) = account(0)?;
    let mut worst_history = 0;
    let mut units: Vec<u64> = index.keys().copied().collect();
    units.sort_unstable();
    let mut per_unit = Vec::with_capacity(units.len());
    for unit in units {
        let h = grouped.history_of(unit);
        let (eps, m) = account(h)?;
        if eps > worst {
            worst = eps;
            method = m;
            worst_history = h;
        }
        per_unit.push(UnitEpsilon {
            unit,
            participations: index.get(&unit).map_or(0, |p| p.rounds),
            epsilon: eps,
        });
    }
    Ok(UnitsAccount {
        worst,
        method,
        worst_groups: grouped.combined(worst_history),
        per_unit,
    })
}

/// The full report: worst unit by `kind`, the RDP cross-check, each phase at delta / P and
/// their basic composition. `grouped` holds every record.
fn full_report(
    config: &LedgerConfig,
    records: &[RoundRecord],
    index: &UnitIndex,
    grouped: &GroupedHistories,
    budget_changes: &[BudgetChange],
    kind: AccountantKind,
    cache: &mut BudgetCache,
) -> Result<LedgerReport, LedgerError> {
    let delta = config.delta;
    let total = account_units(grouped, index, delta, kind, Some(cache))?;
    let (epsilon_rdp, rdp_note) = if total.worst_groups.is_empty() {
        (0.0, None)
    } else {
        let groups = grouped.events.resolve(&total.worst_groups);
        match accountant::unit_epsilon_grouped(&groups, delta, AccountantKind::Rdp) {
            Ok((e, _)) => (e, None),
            Err(PrivacyError::Unsupported(why)) => (f64::INFINITY, Some(why)),
            Err(e) => return Err(e.into()),
        }
    };
    let zcdp_rho = grouped
        .events
        .resolve(&total.worst_groups)
        .into_iter()
        .map(|(e, count)| e.zcdp_rho().map(|rho| rho * count as f64))
        .sum::<Option<f64>>();
    let mut names: Vec<&str> = Vec::new();
    for r in records {
        if !names.contains(&r.phase.as_str()) {
            names.push(&r.phase);
        }
    }
    let mut phases = Vec::with_capacity(names.len());
    let split = Delta::try_from(delta.get() / names.len().max(1) as f64)?;
    for name in &names {
        let rounds = records.iter().filter(|r| r.phase == *name).count() as u64;
        // One phase: the split is the whole delta and the phase is the whole ledger.
        let (epsilon, method) = if names.len() == 1 {
            (total.worst, total.method)
        } else {
            let phase = GroupedHistories::from_records(records, |r| r.phase == *name);
            let a = account_units(&phase, index, split, kind, None)?;
            (a.worst, a.method)
        };
        phases.push(PhaseEpsilon {
            phase: name.to_string(),
            rounds,
            epsilon,
            delta: split.get(),
            accountant: method.to_string(),
        });
    }
    let epsilon_basic = phases.iter().map(|p| p.epsilon).sum();
    let mut noise_sources: Vec<NoiseSource> = Vec::new();
    for r in records {
        if !noise_sources.contains(&r.noise_source) {
            noise_sources.push(r.noise_source);
        }
    }
    Ok(LedgerReport {
        unit_kind: config.unit_kind,
        participation: config.participation,
        rounds: records.len() as u64,
        units: total.per_unit.len() as u64,
        epsilon: total.worst,
        accountant: total.method.to_string(),
        epsilon_rdp,
        rdp_note,
        zcdp_rho,
        phases,
        epsilon_basic,
        delta: delta.get(),
        target_epsilon: config.target_epsilon,
        budget_changes: budget_changes.to_vec(),
        per_unit: total.per_unit,
        noise_sources,
    })
}

fn validate_config(c: &LedgerConfig) -> Result<(), LedgerError> {
    // Delta and the sampling rate are valid by construction (their types).
    if c.target_epsilon.is_nan() || c.target_epsilon <= 0.0 {
        return Err(LedgerError::InvalidRecord(format!(
            "target epsilon must be > 0, got {}",
            c.target_epsilon
        )));
    }
    Ok(())
}

fn sha256(bytes: &[u8]) -> FrameHash {
    let d = digest::digest(&digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// The unchained frames' checksum: the first 8 bytes of SHA-256(payload).
fn checksum(payload: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(&sha256(payload)[..8]);
    out
}

/// The chained frames' checksum: the first 8 bytes of SHA-256(prev || payload), so that a
/// flipped bit in `prev` reads as a damaged frame, not as a removed one.
fn chained_checksum(prev: &FrameHash, payload: &[u8]) -> [u8; 8] {
    let mut ctx = digest::Context::new(&digest::SHA256);
    ctx.update(prev);
    ctx.update(payload);
    let mut out = [0u8; 8];
    out.copy_from_slice(&ctx.finish().as_ref()[..8]);
    out
}

/// Writes one chained frame after the frame hashing to `prev` with a single `write_all`, and
/// fsyncs the file. Returns the new frame's hash.
fn write_frame(file: &mut File, prev: &FrameHash, payload: &[u8]) -> std::io::Result<FrameHash> {
    let mut frame = Vec::with_capacity(CHAINED_HEADER + payload.len());
    frame.extend_from_slice(CHAINED_MAGIC);
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(&chained_checksum(prev, payload));
    frame.extend_from_slice(prev);
    frame.extend_from_slice(payload);
    file.write_all(&frame)?;
    file.sync_all()?;
    Ok(sha256(&frame))
}

/// The head of a ledger whose frames hash to `hashes` (the header's first).
fn head_of(hashes: &[FrameHash]) -> LedgerHead {
    LedgerHead {
        entries: hashes.len().saturating_sub(1) as u64,
        sha256: hashes.last().map_or_else(String::new, |h| to_hex(h)),
    }
}

/// [`PrivacyLedger::check_head`] on the frame hashes of the ledger at `path`.
fn check_head(
    path: &Path,
    hashes: &[FrameHash],
    expected: &LedgerHead,
    recorded_in: &Path,
) -> Result<(), LedgerError> {
    let held = hashes.len().saturating_sub(1) as u64;
    let mismatch = |reason: String| {
        Err(LedgerError::HeadMismatch {
            path: path.to_path_buf(),
            recorded_in: recorded_in.to_path_buf(),
            reason,
        })
    };
    let Some(hash) = usize::try_from(expected.entries)
        .ok()
        .and_then(|i| hashes.get(i))
    else {
        return mismatch(format!(
            "it holds {held} entries, but {} were recorded there: entries were cut from its end (or the ledger was replaced by an older or another run's)",
            expected.entries
        ));
    };
    if to_hex(hash) != expected.sha256 {
        return mismatch(format!(
            "its entry {} hashes to {}, but {} was recorded: the ledger was rewritten or replaced",
            expected.entries,
            to_hex(hash),
            expected.sha256
        ));
    }
    Ok(())
}

/// Makes the creation of a new file durable (best effort: not every platform allows it).
fn sync_parent(path: &Path) {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && let Ok(d) = File::open(dir)
    {
        let _ = d.sync_all();
    }
}

/// A complete frame: where it starts in the file, its verified payload and its hash.
struct Frame<'a> {
    offset: u64,
    payload: &'a [u8],
    /// SHA-256 of the whole frame.
    hash: FrameHash,
    /// A chained frame (its `prev` was verified against the frame before it).
    chained: bool,
}

/// Splits `bytes` into complete, verified frames. Only a frame cut short (its header or its
/// payload running past the end of the file) is a torn write, and only at the end; a complete
/// frame that fails its checksum is corruption wherever it is (it was written in full, so its
/// append may have returned and its output been released). Every chained frame must name the
/// frame before it (the [`genesis`] value when it is the first), and no unchained frame may
/// follow a chained one: a frame removed, reordered or inserted is [`LedgerError::ChainBroken`].
fn scan<'a>(path: &Path, bytes: &'a [u8]) -> Result<(Vec<Frame<'a>>, Recovery), LedgerError> {
    let mut frames: Vec<Frame<'a>> = Vec::new();
    let mut chain_started = false;
    let mut at = 0usize;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let torn = |frames: Vec<Frame<'a>>| {
            Ok((
                frames,
                Recovery {
                    records: 0,
                    torn_at: Some(at as u64),
                    torn_bytes: (bytes.len() - at) as u64,
                    zero_filled: rest.iter().all(|&b| b == 0),
                    unchained_entries: None,
                },
            ))
        };
        // Zeros to the end of the file: a power loss after the file grew but before the
        // appended bytes were written (the append's fsync never returned, so nothing was
        // released). Every append is synced before the next, so such a tail follows the durable
        // header and is at most one frame (rounded up to a filesystem block) long; zeros
        // elsewhere, longer, or followed by anything else are corruption (below: bad magic).
        if at > 0
            && rest.len() <= CHAINED_HEADER + MAX_PAYLOAD + 4096
            && rest.iter().all(|&b| b == 0)
        {
            return torn(frames);
        }
        if rest.len() < 4 {
            if MAGIC.starts_with(rest) || CHAINED_MAGIC.starts_with(rest) {
                return torn(frames);
            }
            return Err(corrupt(path, at as u64, "bad frame magic"));
        }
        let chained = match &rest[..4] {
            m if m == MAGIC => false,
            m if m == CHAINED_MAGIC => true,
            _ => return Err(corrupt(path, at as u64, "bad frame magic")),
        };
        let header_len = if chained {
            CHAINED_HEADER
        } else {
            FRAME_HEADER
        };
        if rest.len() < header_len {
            return torn(frames);
        }
        let len = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(corrupt(path, at as u64, "frame length out of range"));
        }
        if rest.len() < header_len + len {
            return torn(frames);
        }
        let payload = &rest[header_len..header_len + len];
        let whole = &rest[..header_len + len];
        if chained {
            let mut prev = [0u8; 32];
            prev.copy_from_slice(&rest[FRAME_HEADER..CHAINED_HEADER]);
            if chained_checksum(&prev, payload) != rest[8..16] {
                return Err(corrupt(
                    path,
                    at as u64,
                    "checksum mismatch in a complete record",
                ));
            }
            let expected = frames.last().map_or_else(genesis, |f| f.hash);
            if prev != expected {
                return Err(LedgerError::ChainBroken {
                    path: path.to_path_buf(),
                    offset: at as u64,
                    entry: frames.len() as u64,
                    named: to_hex(&prev),
                    found: if frames.is_empty() {
                        "nothing (it is the first frame: it must name the fixed genesis value)"
                            .into()
                    } else {
                        to_hex(&expected)
                    },
                });
            }
        } else {
            if checksum(payload) != rest[8..16] {
                return Err(corrupt(
                    path,
                    at as u64,
                    "checksum mismatch in a complete record",
                ));
            }
            if chain_started {
                return Err(corrupt(
                    path,
                    at as u64,
                    "an unchained record after chained ones (this program appends only chained records, so it was moved here or inserted)",
                ));
            }
        }
        chain_started |= chained;
        frames.push(Frame {
            offset: at as u64,
            payload,
            hash: sha256(whole),
            chained,
        });
        at += header_len + len;
    }
    Ok((frames, Recovery::default()))
}

fn corrupt(path: &Path, offset: u64, reason: &str) -> LedgerError {
    LedgerError::Corrupt {
        path: path.to_path_buf(),
        offset,
        reason: reason.into(),
    }
}

fn json_err(e: serde_json::Error) -> LedgerError {
    LedgerError::InvalidRecord(format!("cannot encode: {e}"))
}
