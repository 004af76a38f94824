//! The privacy ledger: an append-only, checksummed, fsynced file of released rounds.
//!
//! Each record says what ran (noise multiplier, clip norm, sampling model, noise source) and who
//! took part (privacy-unit ids). The ledger stores mechanisms, not epsilons, so it can always be
//! re-accounted; [`PrivacyLedger::report`] accounts it now (PLD reported, RDP as a cross-check,
//! the exact analytic Gaussian where no sampling is involved).
//!
//! File layout: a header frame holding the [`LedgerConfig`], then one frame per record. A frame is
//! `b"FRL1"`, the payload length (u32 LE), the first 8 bytes of SHA-256(payload), then the JSON
//! payload. A crash can only tear the last frame; reopening keeps every complete frame, reports
//! the torn bytes and truncates them before the next append. Records are written and fsynced
//! before the model they describe is released, so after a crash the ledger can only over-report.

use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use ring::digest;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::accountant::{self, AccountantKind};
use super::noise::NoiseSource;
use super::{DpEvent, PrivacyError, gaussian};

/// The ledger's file name inside a state or output directory.
pub const LEDGER_FILE_NAME: &str = "privacy.ledger";

const MAGIC: &[u8; 4] = b"FRL1";
const FRAME_HEADER: usize = 4 + 4 + 8;
/// No honest record comes near this; a larger length means corruption, not a big record.
const MAX_PAYLOAD: usize = 256 << 20;

/// What a privacy unit is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnitKind {
    Trajectory,
    User,
    Expert,
}

impl std::fmt::Display for UnitKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            UnitKind::Trajectory => "trajectory",
            UnitKind::User => "user",
            UnitKind::Expert => "expert",
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
    Sampled { rate: f64 },
}

/// The fixed parameters of a ledger, stored in its header.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LedgerConfig {
    /// Budget: an append that would push the reported epsilon above this is refused.
    pub target_epsilon: f64,
    /// The delta at which every epsilon of this ledger is reported.
    pub delta: f64,
    pub unit_kind: UnitKind,
    pub participation: Participation,
}

/// One released round.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoundRecord {
    pub round: u64,
    /// Privacy units whose (clipped) contributions are in the released aggregate.
    pub units: Vec<u64>,
    /// z: the noise standard deviation is z x `clip_norm` on the sum.
    pub noise_multiplier: f64,
    /// C: the L2 bound each unit's contribution was (re-)clipped to by the aggregator.
    pub clip_norm: f64,
    /// `Some(q)` only when the aggregator itself drew a Poisson sample with rate q this round;
    /// only then is amplification by sampling claimed.
    pub sampling_rate: Option<f64>,
    /// The fixed public denominator the noisy sum was divided by.
    pub expected_cohort: f64,
    pub noise_source: NoiseSource,
    /// Wall-clock time of the append, seconds since the Unix epoch.
    pub unix_time_s: f64,
}

impl RoundRecord {
    /// The mechanism as seen by one unit (sensitivity normalised to C). Sampling at rate 1
    /// includes every unit every round: that is the plain Gaussian, which composes exactly
    /// (a PLD of it would widen with every round: the ledger's memory and time grew linearly with
    /// the rounds, 250 MB by round 300 of the load bench).
    pub fn event(&self) -> DpEvent {
        let g = DpEvent::Gaussian {
            noise_multiplier: self.noise_multiplier,
        };
        match self.sampling_rate {
            Some(q) if q < 1.0 => DpEvent::PoissonSampled {
                sampling_rate: q,
                event: Box::new(g),
            },
            Some(_) | None => g,
        }
    }
}

#[derive(Debug, Error)]
pub enum LedgerError {
    #[error("ledger {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "ledger {path} is corrupt at byte {offset}: {reason} (a torn write can only affect the last record, so this is not a crash)"
    )]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("ledger {path} was created with {stored:?}, but this run asks for {requested:?}")]
    ConfigMismatch {
        path: PathBuf,
        stored: Box<LedgerConfig>,
        requested: Box<LedgerConfig>,
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

/// What reopening found.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Recovery {
    /// Complete records read.
    pub records: usize,
    /// Byte offset where an incomplete last frame began, if there was one.
    pub torn_at: Option<u64>,
    /// Bytes of that incomplete frame (removed before the next append).
    pub torn_bytes: u64,
}

impl std::fmt::Display for Recovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.torn_at {
            None => write!(f, "{} records, no torn write", self.records),
            Some(at) => write!(
                f,
                "{} complete records; a torn last record of {} bytes at offset {at} was discarded (it was never released)",
                self.records, self.torn_bytes
            ),
        }
    }
}

/// Epsilon of one unit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UnitEpsilon {
    pub unit: u64,
    /// Rounds whose released aggregate contains this unit's contribution.
    pub participations: u64,
    /// Epsilon at the ledger's delta.
    pub epsilon: f64,
}

/// The ledger accounted.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LedgerReport {
    pub unit_kind: UnitKind,
    pub participation: Participation,
    pub rounds: u64,
    /// Distinct units that contributed.
    pub units: u64,
    /// The reported epsilon (worst unit) at `delta`: PLD, or the exact analytic Gaussian when no
    /// round claimed sampling amplification.
    pub epsilon: f64,
    /// The RDP accountant's epsilon for the same events (a cross-check; never smaller than the
    /// exact figure, up to PLD discretisation).
    pub epsilon_rdp: f64,
    pub delta: f64,
    pub target_epsilon: f64,
    /// How `epsilon` was computed.
    pub accountant: String,
    /// Every unit's realised epsilon, ascending by unit id.
    pub per_unit: Vec<UnitEpsilon>,
    /// Noise sources used by the records (any `seeded` source means the run was not private).
    pub noise_sources: Vec<NoiseSource>,
}

/// The append-only ledger file, with an in-memory index of participations.
pub struct PrivacyLedger {
    path: PathBuf,
    file: File,
    config: LedgerConfig,
    records: Vec<RoundRecord>,
    /// What each unit's accounting needs of `records`.
    participations: UnitIndex,
    /// Worst-unit epsilon of `records`, as accounted by the last [`append`](Self::append).
    epsilon: Option<f64>,
}

impl PrivacyLedger {
    /// Opens the ledger at `path`, creating it with `config` if it does not exist. An existing
    /// ledger must have the same delta, unit kind and participation model; its target epsilon is
    /// replaced by the requested one (raising a budget is the operator's decision, and the
    /// ledger still reports everything spent).
    pub fn open(
        path: impl AsRef<Path>,
        config: LedgerConfig,
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
            write_frame(&mut file, &serde_json::to_vec(&config).map_err(json_err)?).map_err(io)?;
            sync_parent(&path);
            let ledger = Self {
                path,
                file,
                config,
                records: Vec::new(),
                participations: UnitIndex::new(),
                epsilon: None,
            };
            return Ok((ledger, Recovery::default()));
        }

        let (frames, recovery) = scan(&path, &bytes)?;
        let Some((header, rest)) = frames.split_first() else {
            // Only a torn header: nothing was ever recorded, so starting over loses nothing.
            file.set_len(0).map_err(io)?;
            file.seek(SeekFrom::Start(0)).map_err(io)?;
            drop(file);
            std::fs::remove_file(&path).map_err(io)?;
            let (ledger, _) = Self::open(&path, config)?;
            return Ok((ledger, recovery));
        };
        let stored: LedgerConfig =
            serde_json::from_slice(header).map_err(|e| LedgerError::Corrupt {
                path: path.clone(),
                offset: 0,
                reason: e.to_string(),
            })?;
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
        let mut ledger = Self {
            path,
            file,
            config,
            records: Vec::new(),
            participations: UnitIndex::new(),
            epsilon: None,
        };
        for payload in rest {
            let record: RoundRecord =
                serde_json::from_slice(payload).map_err(|e| LedgerError::Corrupt {
                    path: ledger.path.clone(),
                    offset: 0,
                    reason: e.to_string(),
                })?;
            ledger.index(record);
        }
        if let Some(at) = recovery.torn_at {
            let io = |source| LedgerError::Io {
                path: ledger.path.clone(),
                source,
            };
            ledger.file.set_len(at).map_err(io)?;
            ledger.file.sync_all().map_err(io)?;
        }
        let records = ledger.records.len();
        Ok((
            ledger,
            Recovery {
                records,
                ..recovery
            },
        ))
    }

    /// Accounts a ledger read with [`read`](Self::read), without opening it for writing.
    pub fn report_of(
        config: &LedgerConfig,
        records: &[RoundRecord],
    ) -> Result<LedgerReport, LedgerError> {
        let mut index = UnitIndex::new();
        for (i, r) in records.iter().enumerate() {
            index_record(&mut index, i, r);
        }
        accounting(config, records, &index, None, true)
    }

    /// Reads a ledger without modifying it (torn bytes are reported, not removed).
    pub fn read(
        path: impl AsRef<Path>,
    ) -> Result<(LedgerConfig, Vec<RoundRecord>, Recovery), LedgerError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| LedgerError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let (frames, recovery) = scan(path, &bytes)?;
        let corrupt = |reason: String| LedgerError::Corrupt {
            path: path.to_path_buf(),
            offset: 0,
            reason,
        };
        let Some((header, rest)) = frames.split_first() else {
            return Err(corrupt("no complete header".into()));
        };
        let config: LedgerConfig =
            serde_json::from_slice(header).map_err(|e| corrupt(e.to_string()))?;
        let records = rest
            .iter()
            .map(|p| serde_json::from_slice(p).map_err(|e| corrupt(e.to_string())))
            .collect::<Result<Vec<RoundRecord>, _>>()?;
        Ok((
            config,
            records.clone(),
            Recovery {
                records: records.len(),
                ..recovery
            },
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn config(&self) -> &LedgerConfig {
        &self.config
    }

    pub fn records(&self) -> &[RoundRecord] {
        &self.records
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

    /// Checks that `record` may be appended (order, units, budget) without writing anything.
    pub fn check(&self, record: &RoundRecord) -> Result<(), LedgerError> {
        self.epsilon_with(record).map(|_| ())
    }

    /// [`check`](Self::check), returning the worst-unit epsilon with `record` appended.
    fn epsilon_with(&self, record: &RoundRecord) -> Result<f64, LedgerError> {
        self.validate(record)?;
        let report = accounting(
            &self.config,
            &self.records,
            &self.participations,
            Some(record),
            false,
        )?;
        if report.epsilon > self.config.target_epsilon {
            return Err(LedgerError::BudgetExceeded {
                round: record.round,
                epsilon: report.epsilon,
                target: self.config.target_epsilon,
                delta: self.config.delta,
            });
        }
        Ok(report.epsilon)
    }

    /// Appends `record` after [`check`](Self::check), and fsyncs it: when this returns `Ok`, the
    /// round is durably accounted and its model may be released.
    pub fn append(&mut self, record: RoundRecord) -> Result<(), LedgerError> {
        let epsilon = self.epsilon_with(&record)?;
        let payload = serde_json::to_vec(&record).map_err(json_err)?;
        let io = |source| LedgerError::Io {
            path: self.path.clone(),
            source,
        };
        write_frame(&mut self.file, &payload).map_err(io)?;
        self.index(record);
        self.epsilon = Some(epsilon);
        Ok(())
    }

    /// Worst-unit epsilon of every record at the ledger's delta: the same figure as
    /// [`report`](Self::report)'s, without its per-unit list and RDP bound, and free right after
    /// an [`append`](Self::append) (which accounted it already).
    pub fn epsilon(&self) -> Result<f64, LedgerError> {
        match self.epsilon {
            Some(e) => Ok(e),
            None => Ok(accounting(
                &self.config,
                &self.records,
                &self.participations,
                None,
                false,
            )?
            .epsilon),
        }
    }

    /// Accounts every record: total and per-unit epsilon at the ledger's delta.
    pub fn report(&self) -> Result<LedgerReport, LedgerError> {
        accounting(
            &self.config,
            &self.records,
            &self.participations,
            None,
            true,
        )
    }

    /// The realised epsilon of one unit at the ledger's delta.
    pub fn unit_epsilon(&self, unit: u64) -> Result<f64, LedgerError> {
        let events = unit_events(
            &self.records,
            self.participations
                .get(&unit)
                .map(|p| p.unsampled.as_slice()),
        );
        Ok(exact_or_pld(&events, self.config.delta)?.0)
    }

    fn validate(&self, record: &RoundRecord) -> Result<(), LedgerError> {
        let bad = |m: String| {
            Err(LedgerError::InvalidRecord(format!(
                "round {}: {m}",
                record.round
            )))
        };
        if !(record.noise_multiplier.is_finite() && record.noise_multiplier > 0.0) {
            return bad(format!(
                "noise multiplier must be > 0, got {}",
                record.noise_multiplier
            ));
        }
        if !(record.clip_norm.is_finite() && record.clip_norm > 0.0) {
            return bad(format!("clip norm must be > 0, got {}", record.clip_norm));
        }
        if !(record.expected_cohort.is_finite() && record.expected_cohort > 0.0) {
            return bad(format!(
                "expected cohort must be > 0, got {}",
                record.expected_cohort
            ));
        }
        if let Some(q) = record.sampling_rate
            && !(q > 0.0 && q <= 1.0)
        {
            return bad(format!("sampling rate must be in (0, 1], got {q}"));
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
        index_record(&mut self.participations, self.records.len(), &record);
        self.records.push(record);
    }
}

/// What one unit's accounting needs of the records it took part in.
#[derive(Clone, Debug, Default)]
struct UnitRounds {
    /// Rounds it contributed to.
    rounds: u64,
    /// Indices of those rounds that were not Poisson-sampled by the aggregator: they add to its
    /// events (a sampled round counts for every unit, drawn or not).
    unsampled: Vec<usize>,
}

/// unit -> its rounds. Kept up to date by every append, so an accounting costs one pass over
/// the units, not over units x rounds.
type UnitIndex = HashMap<u64, UnitRounds>;

fn index_record(index: &mut UnitIndex, i: usize, record: &RoundRecord) {
    for &u in &record.units {
        let e = index.entry(u).or_default();
        e.rounds += 1;
        if record.sampling_rate.is_none() {
            e.unsampled.push(i);
        }
    }
}

/// The events one unit is subject to: every round that claimed Poisson sampling (whether or not
/// the unit was drawn — that is what amplification accounts for), plus the un-sampled rounds it
/// took part in.
fn unit_events<R: Borrow<RoundRecord>>(records: &[R], own: Option<&[usize]>) -> Vec<DpEvent> {
    let mut events: Vec<DpEvent> = records
        .iter()
        .map(Borrow::borrow)
        .filter(|r| r.sampling_rate.is_some())
        .map(RoundRecord::event)
        .collect();
    for &i in own.unwrap_or(&[]) {
        let r = records[i].borrow();
        if r.sampling_rate.is_none() {
            events.push(r.event());
        }
    }
    events
}

/// Groups identical events into self-compositions so accountants can use fast composition.
fn grouped(events: &[DpEvent]) -> DpEvent {
    let mut counts: Vec<(DpEvent, u64)> = Vec::new();
    for e in events {
        match counts.iter_mut().find(|(g, _)| g == e) {
            Some((_, n)) => *n += 1,
            None => counts.push((e.clone(), 1)),
        }
    }
    let parts: Vec<DpEvent> = counts
        .into_iter()
        .map(|(e, n)| {
            if n == 1 {
                e
            } else {
                DpEvent::SelfComposed {
                    event: Box::new(e),
                    count: n,
                }
            }
        })
        .collect();
    if parts.len() == 1 {
        parts
            .into_iter()
            .next()
            .unwrap_or(DpEvent::Composed { events: vec![] })
    } else {
        DpEvent::Composed { events: parts }
    }
}

/// Epsilon of a unit's events at `delta`, and the name of the method. Compositions of plain
/// Gaussians are one Gaussian with 1/sigma^2 = sum 1/z_i^2, accounted exactly (analytic
/// Gaussian); anything with sampling (below rate 1, see [`RoundRecord::event`]) goes to the PLD
/// accountant.
fn exact_or_pld(events: &[DpEvent], delta: f64) -> Result<(f64, &'static str), PrivacyError> {
    if events.is_empty() {
        return Ok((0.0, "none"));
    }
    let mut inv_var = 0.0;
    let mut all_gaussian = true;
    for e in events {
        match e {
            DpEvent::Gaussian { noise_multiplier } => inv_var += noise_multiplier.powi(-2),
            _ => all_gaussian = false,
        }
    }
    if all_gaussian {
        return Ok((
            gaussian::epsilon(inv_var.powf(-0.5), delta)?,
            "analytic_gaussian",
        ));
    }
    Ok((
        accountant::epsilon(&grouped(events), delta, AccountantKind::Pld)?,
        "pld",
    ))
}

fn rdp_epsilon(events: &[DpEvent], delta: f64) -> Result<f64, PrivacyError> {
    if events.is_empty() {
        return Ok(0.0);
    }
    accountant::epsilon(&grouped(events), delta, AccountantKind::Rdp)
}

/// Accounts `records` (indexed by `index`) and, if given, `candidate` after them: every unit's
/// epsilon and the worst case. A unit's events are every sampled round plus its own un-sampled
/// rounds, so units are grouped by those un-sampled rounds first (one group in sampled runs, one
/// per round in fresh runs), then by identical event lists (rounds with the same noise): the work
/// per call grows with the units, the rounds and the groups, not with units x rounds.
fn accounting(
    config: &LedgerConfig,
    records: &[RoundRecord],
    index: &UnitIndex,
    candidate: Option<&RoundRecord>,
    with_rdp: bool,
) -> Result<LedgerReport, LedgerError> {
    let records: Vec<&RoundRecord> = records.iter().chain(candidate).collect();
    // The candidate's units and its index, when it adds to their own events.
    let cand_units: HashSet<u64> = candidate
        .map(|c| c.units.iter().copied().collect())
        .unwrap_or_default();
    let cand_unsampled = candidate.is_some_and(|c| c.sampling_rate.is_none());
    let cand_i = records.len().saturating_sub(1);
    let mut units: Vec<u64> = index.keys().copied().collect();
    units.extend(cand_units.iter().filter(|u| !index.contains_key(u)));
    units.sort_unstable();
    let delta = config.delta;
    let mut by_events: HashMap<String, (f64, &'static str)> = HashMap::new();
    let mut by_history: HashMap<Vec<usize>, (f64, &'static str)> = HashMap::new();
    let mut account = |history: &[usize]| -> Result<(f64, &'static str), LedgerError> {
        if let Some(v) = by_history.get(history) {
            return Ok(*v);
        }
        let events = unit_events(&records, Some(history));
        let key = serde_json::to_string(&events).map_err(json_err)?;
        let v = match by_events.get(&key) {
            Some(v) => *v,
            None => {
                let v = exact_or_pld(&events, delta)?;
                by_events.insert(key, v);
                v
            }
        };
        by_history.insert(history.to_vec(), v);
        Ok(v)
    };
    // A unit that never took part still spends every sampled round.
    let (mut worst, mut method) = account(&[])?;
    let mut worst_history: Vec<usize> = Vec::new();
    let mut per_unit = Vec::with_capacity(units.len());
    let none = UnitRounds::default();
    for &unit in &units {
        let past = index.get(&unit).unwrap_or(&none);
        let in_cand = cand_units.contains(&unit);
        let extended;
        let history: &[usize] = if in_cand && cand_unsampled {
            extended = [past.unsampled.as_slice(), &[cand_i]].concat();
            &extended
        } else {
            &past.unsampled
        };
        let (eps, m) = account(history)?;
        if eps > worst {
            worst = eps;
            method = m;
            worst_history = history.to_vec();
        }
        per_unit.push(UnitEpsilon {
            unit,
            participations: past.rounds + u64::from(in_cand),
            epsilon: eps,
        });
    }
    let worst_events = unit_events(&records, Some(&worst_history));
    let epsilon_rdp = if with_rdp {
        rdp_epsilon(&worst_events, delta)?
    } else {
        f64::NAN
    };
    let mut noise_sources: Vec<NoiseSource> = Vec::new();
    for r in &records {
        if !noise_sources.contains(&r.noise_source) {
            noise_sources.push(r.noise_source);
        }
    }
    Ok(LedgerReport {
        unit_kind: config.unit_kind,
        participation: config.participation,
        rounds: records.len() as u64,
        units: units.len() as u64,
        epsilon: worst,
        epsilon_rdp,
        delta,
        target_epsilon: config.target_epsilon,
        accountant: method.to_string(),
        per_unit,
        noise_sources,
    })
}

fn validate_config(c: &LedgerConfig) -> Result<(), LedgerError> {
    let bad = |m: String| Err(LedgerError::InvalidRecord(m));
    if !(c.delta > 0.0 && c.delta < 1.0) {
        return bad(format!("delta must be in (0, 1), got {}", c.delta));
    }
    if c.target_epsilon.is_nan() || c.target_epsilon <= 0.0 {
        return bad(format!(
            "target epsilon must be > 0, got {}",
            c.target_epsilon
        ));
    }
    if let Participation::Sampled { rate } = c.participation
        && !(rate > 0.0 && rate <= 1.0)
    {
        return bad(format!("sampling rate must be in (0, 1], got {rate}"));
    }
    Ok(())
}

fn checksum(payload: &[u8]) -> [u8; 8] {
    let d = digest::digest(&digest::SHA256, payload);
    let mut out = [0u8; 8];
    out.copy_from_slice(&d.as_ref()[..8]);
    out
}

/// Writes one frame with a single `write_all` and fsyncs the file.
fn write_frame(file: &mut File, payload: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(FRAME_HEADER + payload.len());
    frame.extend_from_slice(MAGIC);
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(&checksum(payload));
    frame.extend_from_slice(payload);
    file.write_all(&frame)?;
    file.sync_all()
}

/// Makes the creation of a new file durable (best effort: not every platform allows it).
fn sync_parent(path: &Path) {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && let Ok(d) = File::open(dir)
    {
        let _ = d.sync_all();
    }
}

/// Splits `bytes` into complete frames. An incomplete or mismatching frame is accepted as a torn
/// write only if it is the last thing in the file; anywhere else it is corruption.
fn scan<'a>(path: &Path, bytes: &'a [u8]) -> Result<(Vec<&'a [u8]>, Recovery), LedgerError> {
    let mut frames = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let torn = |frames: Vec<&'a [u8]>| {
            let n = frames.len().saturating_sub(1);
            Ok((
                frames,
                Recovery {
                    records: n,
                    torn_at: Some(at as u64),
                    torn_bytes: (bytes.len() - at) as u64,
                },
            ))
        };
        if rest.len() < FRAME_HEADER {
            if MAGIC.starts_with(&rest[..rest.len().min(4)]) {
                return torn(frames);
            }
            return Err(corrupt(path, at, "bad frame magic"));
        }
        if &rest[..4] != MAGIC {
            return Err(corrupt(path, at, "bad frame magic"));
        }
        let len = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(corrupt(path, at, "frame length out of range"));
        }
        if rest.len() < FRAME_HEADER + len {
            return torn(frames);
        }
        let payload = &rest[FRAME_HEADER..FRAME_HEADER + len];
        if checksum(payload) != rest[8..16] {
            if rest.len() == FRAME_HEADER + len {
                // The last frame was written but its contents did not all reach the disk.
                return torn(frames);
            }
            return Err(corrupt(path, at, "checksum mismatch"));
        }
        frames.push(payload);
        at += FRAME_HEADER + len;
    }
    let n = frames.len().saturating_sub(1);
    Ok((
        frames,
        Recovery {
            records: n,
            torn_at: None,
            torn_bytes: 0,
        },
    ))
}

fn corrupt(path: &Path, at: usize, reason: &str) -> LedgerError {
    LedgerError::Corrupt {
        path: path.to_path_buf(),
        offset: at as u64,
        reason: reason.into(),
    }
}

fn json_err(e: serde_json::Error) -> LedgerError {
    LedgerError::InvalidRecord(format!("cannot encode: {e}"))
}
