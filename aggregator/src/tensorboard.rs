//! TensorBoard event files of the public per-round scalars (`tensorboard/` in the state
//! directory; `tensorboard --logdir OUT/tensorboard` shows them).
//!
//! Hand-written, on purpose: the only Rust crate for this, `tensorboard-rs` (0.5.9, 2022), is
//! marked inactive by its author and pulls protobuf 2 and an old `image`; what fedrl writes is
//! a handful of scalars, which needs two protobuf messages and the TFRecord framing, about a
//! hundred lines. The CRC is the `crc32c` crate's.
//!
//! Format (TensorFlow's `tensorflow/core/util/event.proto`, `summary.proto`, and TFRecord):
//! every record is `u64 LE length`, `u32 LE masked CRC-32C of those 8 bytes`, the data,
//! `u32 LE masked CRC-32C of the data`, where `masked(c) = ((c >> 15) | (c << 17)) +
//! 0xa282ead8`. Each record is one `Event` (`wall_time` = field 1, double; `step` = 2, int64;
//! `file_version` = 3, string; `summary` = 5, message); a `Summary` holds repeated `value`
//! (field 1), each a `tag` (1, string) and a `simple_value` (2, float).
//!
//! Invariants: the first record of a file is the `brain.Event:2` version event; every record
//! is flushed once written (a crashed run keeps its curve up to its last line); a writer never
//! appends to another writer's file: each aggregator process opens a new file, named
//! `events.out.tfevents.<unix seconds>.<host>[.<n>]` so that files sort by start time, and
//! TensorBoard merges a directory's files by step (a resumed run adds a file, it does not
//! rewrite the old one). Every event of a file carries the file's start time as its
//! `wall_time`, not the time it was written: per-round times reveal how much work a round was
//! (the secret sample's size), which the published `t_s` already warns about; TensorBoard's
//! wall-time axis is flat on purpose, its step axis is the round. What is written is the
//! caller's business: the service writes only the numbers of the public `metrics.jsonl` lines
//! (see `service::metrics`).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// The `file_version` of the first event, which TensorBoard reads as "events of format 2".
pub const FILE_VERSION: &str = "brain.Event:2";
/// Prefix of event file names (TensorBoard loads files whose name contains `tfevents`).
pub const FILE_PREFIX: &str = "events.out.tfevents.";

/// One event file being written.
pub struct EventWriter {
    file: File,
    path: PathBuf,
    /// The file's start time (seconds since the epoch), every event's `wall_time`.
    wall_time: f64,
}

/// TFRecord's masked CRC-32C (masking keeps CRCs of data holding CRCs well distributed).
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Protobuf varint.
fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(field: u32, data: &[u8], out: &mut Vec<u8>) {
    varint(u64::from(field << 3 | 2), out);
    varint(data.len() as u64, out);
    out.extend_from_slice(data);
}

/// An `Event` with its wall time (seconds since the epoch), step, and either a file version or
/// a summary of scalars.
fn event(
    wall_time: f64,
    step: i64,
    file_version: Option<&str>,
    scalars: &[(String, f32)],
) -> Vec<u8> {
    let mut out = Vec::new();
    out.push(1 << 3 | 1); // wall_time, fixed64
    out.extend_from_slice(&wall_time.to_le_bytes());
    out.push(2 << 3); // step, varint (int64: two's complement as u64)
    varint(step as u64, &mut out);
    if let Some(v) = file_version {
        bytes_field(3, v.as_bytes(), &mut out);
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::new();
            bytes_field(1, tag.as_bytes(), &mut v);
            v.push(2 << 3 | 5); // simple_value, fixed32
            v.extend_from_slice(&value.to_le_bytes());
            bytes_field(1, &v, &mut summary);
        }
        bytes_field(5, &summary, &mut out);
    }
    out
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The host name for the file name (as TensorFlow names its files), letters, digits, `-` and
/// `_` only; `localhost` when unknown.
fn host() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let h: String = raw
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_' || *c == '.')
        .collect();
    if h.is_empty() { "localhost".into() } else { h }
}

impl EventWriter {
    /// Creates `dir` if needed and a new event file in it, and writes the version event.
    pub fn create(dir: &Path) -> io::Result<Self> {
        Self::create_tagged(dir, None)
    }

    /// [`Self::create`] with `.{tag}` after the host in the file name (TensorBoard reads every
    /// file whose name holds `tfevents`), so that a writer can find and replace its own files.
    pub fn create_tagged(dir: &Path, tag: Option<&str>) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let wall = now();
        let mut base = format!("{FILE_PREFIX}{}.{}", wall as u64, host());
        if let Some(t) = tag {
            base = format!("{base}.{t}");
        }
        // Two processes started in the same second (a quick resume): the later gets a suffix
        // and still sorts after the first.
        let mut n = 0u32;
        let (file, path) = loop {
            let name = if n == 0 {
                base.clone()
            } else {
                format!("{base}.{n}")
            };
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(f) => break (f, path),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(e),
            }
        };
        let mut w = EventWriter {
            file,
            path,
            wall_time: wall,
        };
        w.record(&event(wall, 0, Some(FILE_VERSION), &[]))?;
        Ok(w)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one event holding `scalars` (tag, value) at `step`, and flushes it.
    pub fn scalars(&mut self, step: i64, scalars: &[(String, f32)]) -> io::Result<()> {
        if scalars.is_empty() {
            return Ok(());
        }
        self.record(&event(self.wall_time, step, None, scalars))
    }

    fn record(&mut self, data: &[u8]) -> io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut buf = Vec::with_capacity(data.len() + 16);
        buf.extend_from_slice(&len);
        buf.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        buf.extend_from_slice(data);
        buf.extend_from_slice(&masked_crc32c(data).to_le_bytes());
        self.file.write_all(&buf)?;
        self.file.flush()
    }
}

/// The TensorBoard scalars of a public line: every number in it but the round (the step) and
/// `t_s` (a timing, not DP: see the event file's wall time above), tagged
/// by its path (`eval/eval_return`); booleans, strings, arrays and nulls are left out.
pub fn scalars(line: &Value) -> Vec<(String, f32)> {
    fn walk(prefix: &str, v: &Value, out: &mut Vec<(String, f32)>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    let tag = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}/{k}")
                    };
                    walk(&tag, x, out);
                }
            }
            Value::Number(n) => {
                if let Some(x) = n.as_f64() {
                    out.push((prefix.to_string(), x as f32));
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk("", line, &mut out);
    out.retain(|(tag, _)| tag != "round" && tag != "t_s");
    out
}

/// A reader of event files for checks (the tests, `fedrl`'s end-to-end tests), written from
/// the format's definition and sharing nothing with the writer (its own bit-by-bit CRC, its own
/// protobuf parsing), so that a writer bug is not mirrored by the reader. It reads what
/// [`EventWriter`] writes (the fields above) and refuses anything else.
pub mod decode {
    use thiserror::Error;

    /// A malformed event file.
    #[derive(Debug, Error, PartialEq)]
    pub enum ReadError {
        #[error("record at byte {0}: truncated")]
        Truncated(usize),
        #[error("record at byte {0}: the length's CRC does not match")]
        LengthCrc(usize),
        #[error("record at byte {0}: the data's CRC does not match")]
        DataCrc(usize),
        #[error("record at byte {at}: {what}")]
        Protobuf { at: usize, what: String },
    }

    /// One decoded event.
    #[derive(Debug, Default, PartialEq)]
    pub struct Event {
        /// Seconds since the epoch.
        pub wall_time: f64,
        pub step: i64,
        pub file_version: Option<String>,
        /// (tag, simple_value) pairs of its summary.
        pub scalars: Vec<(String, f32)>,
    }

    /// CRC-32C by the bit-by-bit definition (reflected polynomial 0x82f63b78).
    pub fn crc32c_bitwise(data: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in data {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = if c & 1 == 1 {
                    (c >> 1) ^ 0x82f6_3b78
                } else {
                    c >> 1
                };
            }
        }
        !c
    }

    fn masked(data: &[u8]) -> u32 {
        let c = crc32c_bitwise(data);
        c.rotate_right(15).wrapping_add(0xa282_ead8)
    }

    fn take<'a>(b: &'a [u8], i: &mut usize, n: usize) -> Result<&'a [u8], String> {
        let end = i
            .checked_add(n)
            .filter(|&e| e <= b.len())
            .ok_or("truncated field")?;
        let out = &b[*i..end];
        *i = end;
        Ok(out)
    }

    fn varint(b: &[u8], i: &mut usize) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let x = take(b, i, 1)?[0];
            v |= u64::from(x & 0x7f) << shift;
            if x & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("varint longer than 10 bytes".into())
    }

    /// (field, wire type, payload) of each field of a message.
    fn fields(b: &[u8]) -> Result<Vec<(u64, u64, Vec<u8>)>, String> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            let key = varint(b, &mut i)?;
            let (field, wire) = (key >> 3, key & 7);
            let payload = match wire {
                0 => varint(b, &mut i)?.to_le_bytes().to_vec(),
                1 => take(b, &mut i, 8)?.to_vec(),
                2 => {
                    let n = usize::try_from(varint(b, &mut i)?).map_err(|e| e.to_string())?;
                    take(b, &mut i, n)?.to_vec()
                }
                5 => take(b, &mut i, 4)?.to_vec(),
                w => return Err(format!("wire type {w}")),
            };
            out.push((field, wire, payload));
        }
        Ok(out)
    }

    fn array<const N: usize>(p: Vec<u8>) -> Result<[u8; N], String> {
        p.try_into()
            .map_err(|_| "bad fixed-width field".to_string())
    }

    fn event(data: &[u8]) -> Result<Event, String> {
        let mut e = Event::default();
        for (field, wire, p) in fields(data)? {
            match (field, wire) {
                (1, 1) => e.wall_time = f64::from_le_bytes(array(p)?),
                (2, 0) => e.step = u64::from_le_bytes(array(p)?) as i64,
                (3, 2) => e.file_version = Some(String::from_utf8(p).map_err(|e| e.to_string())?),
                (5, 2) => {
                    for (f, w, v) in fields(&p)? {
                        if (f, w) != (1, 2) {
                            return Err(format!("unexpected Summary field {f} (wire {w})"));
                        }
                        let (mut tag, mut value) = (None, None);
                        for (f, w, x) in fields(&v)? {
                            match (f, w) {
                                (1, 2) => {
                                    tag = Some(String::from_utf8(x).map_err(|e| e.to_string())?)
                                }
                                (2, 5) => value = Some(f32::from_le_bytes(array(x)?)),
                                _ => return Err(format!("unexpected Summary.Value field {f}")),
                            }
                        }
                        match (tag, value) {
                            (Some(t), Some(v)) => e.scalars.push((t, v)),
                            _ => return Err("a Summary.Value without tag or simple_value".into()),
                        }
                    }
                }
                _ => return Err(format!("unexpected Event field {field} (wire {wire})")),
            }
        }
        Ok(e)
    }

    /// Every record of an event file, both CRCs checked.
    pub fn read(bytes: &[u8]) -> Result<Vec<Event>, ReadError> {
        let mut events = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            let at = i;
            let head = bytes.get(i..i + 12).ok_or(ReadError::Truncated(at))?;
            let (len_bytes, crc) = head.split_at(8);
            let mut l = [0u8; 8];
            l.copy_from_slice(len_bytes);
            let mut c = [0u8; 4];
            c.copy_from_slice(crc);
            if u32::from_le_bytes(c) != masked(len_bytes) {
                return Err(ReadError::LengthCrc(at));
            }
            let len =
                usize::try_from(u64::from_le_bytes(l)).map_err(|_| ReadError::Truncated(at))?;
            let end = (i + 12).checked_add(len).ok_or(ReadError::Truncated(at))?;
            let data = bytes.get(i + 12..end).ok_or(ReadError::Truncated(at))?;
            let crc = bytes.get(end..end + 4).ok_or(ReadError::Truncated(at))?;
            c.copy_from_slice(crc);
            if u32::from_le_bytes(c) != masked(data) {
                return Err(ReadError::DataCrc(at));
            }
            events.push(event(data).map_err(|what| ReadError::Protobuf { at, what })?);
            i = end + 4;
        }
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use super::decode::{self, crc32c_bitwise, read};
    use super::*;

    #[test]
    fn events_decode_to_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        let long_tag = "t".repeat(200); // a two-byte length varint
        w.scalars(3, &[("a/b".into(), 1.5), (long_tag.clone(), -2.0)])
            .unwrap();
        w.scalars(300, &[("a/b".into(), f32::MAX)]).unwrap();
        w.scalars(301, &[]).unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let events = read(&bytes).unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].file_version.as_deref(), Some(FILE_VERSION));
        assert_eq!(
            events[1].scalars,
            [("a/b".to_string(), 1.5), (long_tag, -2.0)]
        );
        assert_eq!((events[1].step, events[2].step), (3, 300));
        // A flipped bit in a record's data, or in a length, is caught by its CRC; a cut file
        // is truncated.
        let mut bad = bytes.clone();
        let last = bad.len() - 6;
        bad[last] ^= 1;
        assert!(matches!(read(&bad), Err(decode::ReadError::DataCrc(_))));
        let mut bad = bytes.clone();
        bad[0] ^= 1;
        assert_eq!(read(&bad), Err(decode::ReadError::LengthCrc(0)));
        assert!(matches!(
            read(&bytes[..bytes.len() - 1]),
            Err(decode::ReadError::Truncated(_))
        ));
        // One wall time for the whole file: no per-round timing.
        assert!(events.iter().all(|e| e.wall_time == events[0].wall_time));
        assert!(events[0].wall_time > 1e9);
    }

    #[test]
    fn crc_matches_the_definition_and_the_check_value() {
        // The standard check value of CRC-32C.
        assert_eq!(crc32c_bitwise(b"123456789"), 0xe306_9283);
        for data in [&b""[..], b"a", b"brain.Event:2", &[0u8; 37]] {
            let c = crc32c_bitwise(data);
            let want = c.rotate_right(15).wrapping_add(0xa282_ead8);
            assert_eq!(masked_crc32c(data), want);
        }
    }

    #[test]
    fn files_do_not_collide_and_start_with_the_version() {
        let dir = tempfile::tempdir().unwrap();
        let a = EventWriter::create(dir.path()).unwrap();
        let b = EventWriter::create(dir.path()).unwrap();
        assert_ne!(a.path(), b.path());
        let name = a.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with(FILE_PREFIX), "{name}");
        let bytes = std::fs::read(a.path()).unwrap();
        let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(bytes.len(), 8 + 4 + len + 4);
        let data = &bytes[12..12 + len];
        // file_version is field 3, after wall_time (9 bytes) and step 0 (2 bytes).
        assert_eq!(&data[11..13], &[3 << 3 | 2, FILE_VERSION.len() as u8]);
        assert_eq!(&data[13..], FILE_VERSION.as_bytes());
    }
}
