//! The event journal: every event the driver feeds the round engine, in order, with its time, in
//! an append-only file of the state directory ([`JOURNAL_FILE`]). It is an **operator-only**
//! file: it holds the exact realised cohorts and counts, and with `journal = "full"` the users'
//! raw updates.
//!
//! By default ([`JournalMode::Digest`]) an update is recorded only by its round, unit, client,
//! length and SHA-256 digest: no user data reaches the disk, and the journal still tells what
//! arrived when. [`JournalMode::Full`] (the operator's explicit choice) keeps the bodies, which
//! makes [`replay`] possible: fed through a fresh engine with the same configuration and the
//! same (seeded) entropy, the journal reproduces the run's releases bit for bit. The same holds
//! for the DataRelease's candidate steps ([`Event::StepsArrived`], an expert's demonstration):
//! digest mode records them without their rows (and such a segment refuses to replay), full
//! mode keeps them. The agents' prefix counts are recorded in both modes (operator-only, like
//! the realised cohorts).
//!
//! # File layout
//! A sequence of frames; each process start opens a segment with a `start` entry.
//!
//! ```text
//! frame  := b"FRJ1" | header_len: u32 LE | body_len: u32 LE | SHA-256(lengths)[..4]
//!           | SHA-256(lengths, header)[..8] | header | body
//! header := JSON of the entry, without update values; an update's header carries the SHA-256
//!           of its body (the raw little-endian f32 values), so the 8-byte frame checksum covers
//!           the body too while every byte is hashed once
//! body   := the update's values as raw little-endian f32 (full mode), else empty; for a
//!           pre-summed contribution ([`Event::SumArrived`], the central mode's summed path),
//!           the sum as raw little-endian f64, with its digest and units in the header
//! ```
//!
//! Frames are written with one `write` each and are not fsynced (the privacy ledger is the
//! durable record; the journal is for inspection and replay). A crash can only cut the last frame
//! short: reading reports such a tail as torn, and reopening for appending truncates it. A
//! complete frame whose checksum or body digest does not match is corruption, and an error.

use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use fedrl_common::protocol::UnitId;
pub use fedrl_common::scenario::JournalMode;
use ring::digest::{self, SHA256};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::engine::{Action, ClientId, Engine, Event, SummedUnit};

/// The journal's file name inside a state directory.
pub const JOURNAL_FILE: &str = "events.journal";

const MAGIC: &[u8; 4] = b"FRJ1";
/// Magic, header length, body length, length check, checksum.
const FRAME_PREFIX: usize = 4 + 4 + 4 + 4 + 8;
/// The journal's format version, written in every segment's start entry.
pub const FORMAT_VERSION: u32 = 1;
/// No honest header comes near this; a larger length means corruption.
const MAX_HEADER: usize = 1 << 20;

#[derive(Debug, Error)]
pub enum JournalError {
    #[error("journal {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("journal {path} is corrupt at byte {offset}: {reason}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("journal {path}: an entry of {bytes} bytes does not fit the frame format")]
    TooLarge { path: PathBuf, bytes: usize },
}

/// One journal entry as read back.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    /// A process started writing (the start of a segment).
    Start { format: u32, mode: JournalMode },
    /// An event fed to the engine at `t` (engine seconds). Updates appear here only when their
    /// body was kept (full mode).
    Event { t: f64, event: Event },
    /// An update recorded by its digest only (digest mode).
    UpdateDigest {
        t: f64,
        client: ClientId,
        round: u64,
        unit: UnitId,
        /// Number of f32 values.
        len: u64,
        /// SHA-256 of the values as raw little-endian f32.
        sha256: [u8; 32],
    },
    /// A pre-summed contribution recorded by its digest only (digest mode).
    SumDigest {
        t: f64,
        round: u64,
        units: Vec<SummedUnit>,
        /// Number of f64 values.
        len: u64,
        /// SHA-256 of the values as raw little-endian f64.
        sha256: [u8; 32],
    },
}

/// The JSON header of a frame.
#[derive(Serialize, Deserialize)]
#[serde(tag = "entry", rename_all = "snake_case")]
enum Header {
    Start {
        format: u32,
        mode: JournalMode,
    },
    Event {
        #[serde(rename = "t_bits", with = "f64_bits")]
        t: f64,
        event: Event,
    },
    Update {
        #[serde(rename = "t_bits", with = "f64_bits")]
        t: f64,
        client: ClientId,
        round: u64,
        unit: UnitId,
        len: u64,
        /// Hex SHA-256 of the values as raw little-endian f32.
        sha256: String,
        /// Whether the body follows the header.
        body: bool,
    },
    Sum {
        #[serde(rename = "t_bits", with = "f64_bits")]
        t: f64,
        round: u64,
        /// `(client, unit, norm as f64 bits, clipped)` of every unit in the sum.
        units: Vec<(ClientId, UnitId, u64, bool)>,
        len: u64,
        /// Hex SHA-256 of the sum as raw little-endian f64.
        sha256: String,
        body: bool,
    },
}

/// An f64 as its IEEE-754 bit pattern: JSON's decimal form need not parse back to the same
/// bits, and a replay compares times against deadlines exactly.
mod f64_bits {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(v.to_bits())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        u64::deserialize(d).map(f64::from_bits)
    }
}

/// Appends events to a journal file.
pub struct JournalWriter {
    path: PathBuf,
    file: File,
    mode: JournalMode,
    /// Reused conversion buffer on big-endian machines (unused on little-endian ones).
    buf: Vec<u8>,
}

impl JournalWriter {
    /// Opens (or creates) the journal at `path` for appending and writes a segment start. A
    /// torn last frame left by a crash is truncated first; frames are walked by their lengths,
    /// not re-hashed (reading verifies them).
    pub fn open(path: impl AsRef<Path>, mode: JournalMode) -> Result<Self, JournalError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| JournalError::Io {
            path: path.clone(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut at = 0u64;
        while at < len {
            file.seek(SeekFrom::Start(at)).map_err(io)?;
            match read_frame_head(&path, &mut file, at, len)? {
                Some(head) => at += head.frame_len(),
                None => break,
            }
        }
        if at < len {
            file.set_len(at).map_err(io)?;
        }
        file.seek(SeekFrom::Start(at)).map_err(io)?;
        let mut w = JournalWriter {
            path,
            file,
            mode,
            buf: Vec::new(),
        };
        w.write_frame(
            &Header::Start {
                format: FORMAT_VERSION,
                mode,
            },
            None,
        )?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn mode(&self) -> JournalMode {
        self.mode
    }

    /// Records `event`, fed to the engine at `t` seconds. An [`Event::UpdateArrived`] goes
    /// through [`record_update`](Self::record_update) (its body is never written as JSON).
    pub fn record(&mut self, t: f64, event: &Event) -> Result<(), JournalError> {
        if let Event::UpdateArrived {
            client,
            round,
            unit,
            update,
        } = event
        {
            return self.record_update(t, *client, *round, *unit, update);
        }
        if let Event::StepsArrived { rows, .. } = event
            && self.mode == JournalMode::Digest
            && !rows.is_empty()
        {
            // A candidate's steps are an expert's demonstration: in digest mode they do not
            // reach the disk (the segment's mode tells a replay they are missing).
            let mut kept = event.clone();
            if let Event::StepsArrived { rows, .. } = &mut kept {
                rows.clear();
            }
            return self.write_frame(&Header::Event { t, event: kept }, None);
        }
        if let Event::SumArrived { round, units, sum } = event {
            return self.record_sum(t, *round, units, sum);
        }
        self.write_frame(
            &Header::Event {
                t,
                event: event.clone(),
            },
            None,
        )
    }

    /// Records an update as it arrived (before the engine clips it): its digest, and its body
    /// in full mode.
    pub fn record_update(
        &mut self,
        t: f64,
        client: ClientId,
        round: u64,
        unit: UnitId,
        update: &[f32],
    ) -> Result<(), JournalError> {
        let sha256 = update_digest(update);
        self.record_digested_update(t, client, round, unit, update, &sha256)
    }

    /// [`record_update`](Self::record_update) with the body's digest computed by the caller
    /// ([`update_digest`]; the service hashes on the connection's task, off the engine thread).
    pub fn record_digested_update(
        &mut self,
        t: f64,
        client: ClientId,
        round: u64,
        unit: UnitId,
        update: &[f32],
        sha256: &[u8; 32],
    ) -> Result<(), JournalError> {
        let full = self.mode == JournalMode::Full;
        let mut scratch = std::mem::take(&mut self.buf);
        let bytes = le_bytes(update, &mut scratch);
        let header = Header::Update {
            t,
            client,
            round,
            unit,
            len: update.len() as u64,
            sha256: hex(sha256),
            body: full,
        };
        let r = self.write_frame(&header, full.then_some(bytes));
        self.buf = scratch;
        r
    }

    /// Records a pre-summed contribution ([`Event::SumArrived`]): its units and digest, and the
    /// sum as raw little-endian f64 in full mode.
    pub fn record_sum(
        &mut self,
        t: f64,
        round: u64,
        units: &[SummedUnit],
        sum: &[f64],
    ) -> Result<(), JournalError> {
        let bytes: Vec<u8> = sum.iter().flat_map(|x| x.to_le_bytes()).collect();
        let full = self.mode == JournalMode::Full;
        let header = Header::Sum {
            t,
            round,
            units: units
                .iter()
                .map(|u| (u.client, u.unit, u.norm.to_bits(), u.clipped))
                .collect(),
            len: sum.len() as u64,
            sha256: hex(digest::digest(&SHA256, &bytes).as_ref()),
            body: full,
        };
        self.write_frame(&header, full.then_some(&bytes[..]))
    }

    fn write_frame(&mut self, header: &Header, body: Option<&[u8]>) -> Result<(), JournalError> {
        let h = serde_json::to_vec(header).map_err(|e| JournalError::Corrupt {
            path: self.path.clone(),
            offset: 0,
            reason: format!("cannot encode an entry: {e}"),
        })?;
        let body = body.unwrap_or(&[]);
        let too_large = |bytes| JournalError::TooLarge {
            path: self.path.clone(),
            bytes,
        };
        let hl = u32::try_from(h.len()).map_err(|_| too_large(h.len()))?;
        let bl = u32::try_from(body.len()).map_err(|_| too_large(body.len()))?;
        let sum = frame_checksum(hl, bl, &h);
        let mut prefix = [0u8; FRAME_PREFIX];
        prefix[..4].copy_from_slice(MAGIC);
        prefix[4..8].copy_from_slice(&hl.to_le_bytes());
        prefix[8..12].copy_from_slice(&bl.to_le_bytes());
        prefix[12..16].copy_from_slice(&length_check(hl, bl));
        prefix[16..].copy_from_slice(&sum);
        let io = |source| JournalError::Io {
            path: self.path.clone(),
            source,
        };
        // Small frames in one write; a body is written after its prefix and header without
        // copying it again.
        let mut head = Vec::with_capacity(FRAME_PREFIX + h.len());
        head.extend_from_slice(&prefix);
        head.extend_from_slice(&h);
        if body.is_empty() {
            self.file.write_all(&head).map_err(io)
        } else {
            self.file.write_all(&head).map_err(io)?;
            self.file.write_all(body).map_err(io)
        }
    }
}

/// SHA-256 over the frame's lengths and header, first 8 bytes: a flipped bit in a length is
/// caught like one in the header.
fn frame_checksum(header_len: u32, body_len: u32, header: &[u8]) -> [u8; 8] {
    let mut ctx = digest::Context::new(&SHA256);
    ctx.update(&header_len.to_le_bytes());
    ctx.update(&body_len.to_le_bytes());
    ctx.update(header);
    let mut out = [0u8; 8];
    out.copy_from_slice(&ctx.finish().as_ref()[..8]);
    out
}

/// SHA-256 over the two lengths, first 4 bytes: a flipped bit in a length must not pass for a
/// frame that the file merely ends inside.
fn length_check(header_len: u32, body_len: u32) -> [u8; 4] {
    let mut ctx = digest::Context::new(&SHA256);
    ctx.update(&header_len.to_le_bytes());
    ctx.update(&body_len.to_le_bytes());
    let mut out = [0u8; 4];
    out.copy_from_slice(&ctx.finish().as_ref()[..4]);
    out
}

/// A frame's prefix and verified header.
struct FrameHead {
    header: Vec<u8>,
    body_len: usize,
}

impl FrameHead {
    fn frame_len(&self) -> u64 {
        (FRAME_PREFIX + self.header.len() + self.body_len) as u64
    }
}

/// Reads the frame starting at `at` (the reader is positioned there) up to its body, in a file
/// of `len` bytes. `None`: the frame was cut short (a torn last write). Only a frame that the
/// file ends inside may be treated as torn, and only when what is there is consistent: a prefix
/// cut short, or verified lengths with a header or body cut short. Any check that fails on
/// bytes that are all there is corruption, even in the last frame.
fn read_frame_head(
    path: &Path,
    r: &mut impl Read,
    at: u64,
    len: u64,
) -> Result<Option<FrameHead>, JournalError> {
    let corrupt = |reason: String| JournalError::Corrupt {
        path: path.to_path_buf(),
        offset: at,
        reason,
    };
    let io = |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    };
    let left = len - at;
    if left < FRAME_PREFIX as u64 {
        // Too short for a frame's prefix: a torn write only if it is what a cut-short frame
        // begins with (its magic, then lengths that match their check when those are all
        // there), or zeros. Anything else was never written by this journal.
        let mut tail = vec![0u8; left as usize];
        r.read_exact(&mut tail).map_err(io)?;
        let n = tail.len().min(MAGIC.len());
        let lengths_ok = tail.len() < 16 || {
            let hl = u32::from_le_bytes([tail[4], tail[5], tail[6], tail[7]]);
            let bl = u32::from_le_bytes([tail[8], tail[9], tail[10], tail[11]]);
            length_check(hl, bl) == tail[12..16]
        };
        if tail.iter().all(|&b| b == 0) || (tail[..n] == MAGIC[..n] && lengths_ok) {
            return Ok(None);
        }
        return Err(corrupt(format!(
            "{left} bytes after the last frame that do not begin a frame (not a torn write)"
        )));
    }
    let mut prefix = [0u8; FRAME_PREFIX];
    r.read_exact(&mut prefix).map_err(io)?;
    // Zeros from a frame boundary to the end of the file are what a power loss leaves when the
    // file's size reached the disk before the appended bytes: a torn write, not corruption.
    if prefix.iter().all(|&b| b == 0) && zeros_to_end(r, left - FRAME_PREFIX as u64).map_err(io)? {
        return Ok(None);
    }
    if &prefix[..4] != MAGIC {
        return Err(corrupt("bad frame magic".into()));
    }
    let hl = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]);
    let bl = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]);
    if length_check(hl, bl) != prefix[12..16] {
        return Err(corrupt(
            "the frame's lengths do not match their check".into(),
        ));
    }
    if hl as usize > MAX_HEADER {
        return Err(corrupt(format!("header length {hl} exceeds {MAX_HEADER}")));
    }
    if left < (FRAME_PREFIX as u64 + hl as u64) {
        // The header itself is cut short: nothing after it can exist, so this is the tail.
        return Ok(None);
    }
    let mut header = vec![0u8; hl as usize];
    r.read_exact(&mut header).map_err(io)?;
    if frame_checksum(hl, bl, &header) != prefix[16..] {
        return Err(corrupt(
            "checksum mismatch in a frame whose header is complete (not a torn write)".into(),
        ));
    }
    if left < FRAME_PREFIX as u64 + hl as u64 + bl as u64 {
        return Ok(None);
    }
    Ok(Some(FrameHead {
        header,
        body_len: bl as usize,
    }))
}

/// Whether the next `left` bytes of `r` are all zero (stops reading at the first that is not).
fn zeros_to_end(r: &mut impl Read, mut left: u64) -> std::io::Result<bool> {
    let mut buf = [0u8; 8192];
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        r.read_exact(&mut buf[..n])?;
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        left -= n as u64;
    }
    Ok(true)
}

/// Reads a journal front to back, verifying every frame.
pub struct JournalReader {
    path: PathBuf,
    file: BufReader<File>,
    /// File length when opened, bytes (the journal is not read while it is written).
    len: u64,
    offset: u64,
    /// Byte offset of a frame cut short at the end, once the reader has reached it.
    torn_at: Option<u64>,
}

impl JournalReader {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, JournalError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| JournalError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        Ok(JournalReader {
            path,
            file: BufReader::with_capacity(1 << 16, file),
            len,
            offset: 0,
            torn_at: None,
        })
    }

    /// Where a torn last frame began, once [`next_entry`](Self::next_entry) returned `None`
    /// because of it.
    pub fn torn_at(&self) -> Option<u64> {
        self.torn_at
    }

    /// Reads everything: the entries and the offset of a torn tail, if any.
    pub fn read_all(path: impl AsRef<Path>) -> Result<(Vec<Entry>, Option<u64>), JournalError> {
        let mut r = Self::open(path)?;
        let mut entries = Vec::new();
        while let Some(e) = r.next_entry()? {
            entries.push(e);
        }
        Ok((entries, r.torn_at))
    }

    /// The next entry, or `None` at the end (clean, or a torn last frame: see
    /// [`torn_at`](Self::torn_at)).
    pub fn next_entry(&mut self) -> Result<Option<Entry>, JournalError> {
        let at = self.offset;
        if at == self.len || self.torn_at.is_some() {
            return Ok(None);
        }
        let Some(head) = read_frame_head(&self.path, &mut self.file, at, self.len)? else {
            self.torn_at = Some(at);
            return Ok(None);
        };
        let bl = head.body_len;
        let mut body = vec![0u8; bl];
        self.file
            .read_exact(&mut body)
            .map_err(|source| JournalError::Io {
                path: self.path.clone(),
                source,
            })?;
        self.offset = at + head.frame_len();
        let h = head.header;
        let corrupt = |reason: String| JournalError::Corrupt {
            path: self.path.clone(),
            offset: at,
            reason,
        };
        let header: Header = serde_json::from_slice(&h).map_err(|e| corrupt(e.to_string()))?;
        Ok(Some(match header {
            Header::Start { format, mode } => {
                if format != FORMAT_VERSION {
                    return Err(corrupt(format!(
                        "journal format {format}, this build reads {FORMAT_VERSION}"
                    )));
                }
                if bl != 0 {
                    return Err(corrupt("a start entry with a body".into()));
                }
                Entry::Start { format, mode }
            }
            Header::Event { t, event } => {
                if bl != 0
                    || matches!(
                        event,
                        Event::UpdateArrived { .. } | Event::SumArrived { .. }
                    )
                {
                    return Err(corrupt("an update outside an update entry".into()));
                }
                Entry::Event { t, event }
            }
            Header::Update {
                t,
                client,
                round,
                unit,
                len,
                sha256,
                body: has_body,
            } => {
                let want = parse_hex32(&sha256)
                    .ok_or_else(|| corrupt(format!("bad digest {sha256:?}")))?;
                if has_body {
                    if bl as u64 != len * 4 {
                        return Err(corrupt(format!(
                            "an update of {len} values with a body of {bl} bytes"
                        )));
                    }
                    if digest::digest(&SHA256, &body).as_ref() != want {
                        return Err(corrupt("an update body does not match its digest".into()));
                    }
                    let update = body
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect();
                    Entry::Event {
                        t,
                        event: Event::UpdateArrived {
                            client,
                            round,
                            unit,
                            update,
                        },
                    }
                } else {
                    if bl != 0 {
                        return Err(corrupt("a digest-only update with a body".into()));
                    }
                    Entry::UpdateDigest {
                        t,
                        client,
                        round,
                        unit,
                        len,
                        sha256: want,
                    }
                }
            }
            Header::Sum {
                t,
                round,
                units,
                len,
                sha256,
                body: has_body,
            } => {
                let want = parse_hex32(&sha256)
                    .ok_or_else(|| corrupt(format!("bad digest {sha256:?}")))?;
                let units: Vec<SummedUnit> = units
                    .into_iter()
                    .map(|(client, unit, norm, clipped)| SummedUnit {
                        client,
                        unit,
                        norm: f64::from_bits(norm),
                        clipped,
                    })
                    .collect();
                if has_body {
                    if bl as u64 != len * 8 {
                        return Err(corrupt(format!(
                            "a sum of {len} values with a body of {bl} bytes"
                        )));
                    }
                    if digest::digest(&SHA256, &body).as_ref() != want {
                        return Err(corrupt("a sum body does not match its digest".into()));
                    }
                    let sum = body
                        .chunks_exact(8)
                        .map(|b| {
                            f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
                        })
                        .collect();
                    Entry::Event {
                        t,
                        event: Event::SumArrived { round, units, sum },
                    }
                } else {
                    if bl != 0 {
                        return Err(corrupt("a digest-only sum with a body".into()));
                    }
                    Entry::SumDigest {
                        t,
                        round,
                        units,
                        len,
                        sha256: want,
                    }
                }
            }
        }))
    }
}

/// Why a journal cannot be replayed.
#[derive(Debug, Error)]
pub enum ReplayError {
    #[error(
        "entry {index}: the update of unit {unit} in round {round} was journalled by its digest only (journal = \"digest\"); an exact replay needs journal = \"full\""
    )]
    MissingBody {
        index: usize,
        round: u64,
        unit: UnitId,
    },
    #[error(
        "entry {index}: a DataRelease chunk of candidate {query} was journalled without its steps (journal = \"digest\"); an exact replay needs journal = \"full\""
    )]
    MissingSteps { index: usize, query: u64 },
    #[error(
        "entry {index}: the summed contribution to round {round} was journalled by its digest only (journal = \"digest\"); an exact replay needs journal = \"full\""
    )]
    MissingSumBody { index: usize, round: u64 },
    #[error(
        "entry {index}: a second segment (the aggregator restarted); replay each segment with an engine resumed as that process was"
    )]
    SecondSegment { index: usize },
}

/// Feeds one segment of journal entries to `engine`, in order, and returns every action it
/// emitted with the time of the event that caused it. The engine must be built with the
/// configuration, resume state and entropy of the run that wrote the journal.
pub fn replay(
    engine: &mut Engine,
    entries: impl IntoIterator<Item = Entry>,
) -> Result<Vec<(f64, Action)>, ReplayError> {
    let mut out = Vec::new();
    let mut events = 0usize;
    let mut mode = JournalMode::Full;
    for (index, entry) in entries.into_iter().enumerate() {
        match entry {
            Entry::Start { mode: m, .. } => {
                if events > 0 {
                    return Err(ReplayError::SecondSegment { index });
                }
                mode = m;
            }
            Entry::Event {
                event: Event::StepsArrived { query, .. },
                ..
            } if mode == JournalMode::Digest => {
                return Err(ReplayError::MissingSteps { index, query });
            }
            Entry::Event { t, event } => {
                events += 1;
                out.extend(engine.handle(t, event).into_iter().map(|a| (t, a)));
            }
            Entry::UpdateDigest { round, unit, .. } => {
                return Err(ReplayError::MissingBody { index, round, unit });
            }
            Entry::SumDigest { round, .. } => {
                return Err(ReplayError::MissingSumBody { index, round });
            }
        }
    }
    Ok(out)
}

/// The values as raw little-endian f32 bytes: on little-endian machines the memory itself (no
/// copy: hashing and writing a 10^6-value update touch its 4 MB once), elsewhere a converted
/// copy in `scratch`.
/// SHA-256 of an update's little-endian f32 bytes: what the journal records of it.
pub fn update_digest(update: &[f32]) -> [u8; 32] {
    let mut scratch = Vec::new();
    let mut out = [0u8; 32];
    out.copy_from_slice(digest::digest(&SHA256, le_bytes(update, &mut scratch)).as_ref());
    out
}

fn le_bytes<'a>(v: &'a [f32], scratch: &'a mut Vec<u8>) -> &'a [u8] {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice(v)
    } else {
        scratch.clear();
        scratch.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        scratch
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests;
