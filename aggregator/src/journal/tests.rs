//! Journal format tests: round trips, torn tails, corruption, digests.

use super::*;
use fedrl_common::protocol::UnitRange;
use fedrl_common::scenario::Scenario;

fn events() -> Vec<(f64, Event)> {
    vec![
        (
            0.5,
            Event::ClientJoined {
                client: 1,
                units: vec![UnitRange { start: 0, end: 5 }],
            },
        ),
        (
            1.25,
            Event::UpdateArrived {
                client: 1,
                round: 1,
                unit: 3,
                update: vec![1.0, -0.0, f32::MIN_POSITIVE, 3.5e7, -2.25],
            },
        ),
        // Times round-trip to the bit (deadlines are compared exactly in a replay).
        (0.1 + 0.2, Event::Tick),
        (1.0 / 3.0 + 1e-12, Event::LedgerAppended { round: 1 }),
        (
            2.0,
            Event::LedgerRefused {
                round: 2,
                reason: "budget \"exceeded\"".into(),
            },
        ),
        (
            2.5,
            Event::Released {
                round: 1,
                target_reached: true,
            },
        ),
        (
            2.5,
            Event::ReleaseFailed {
                round: 3,
                reason: "x".into(),
            },
        ),
        (3.0, Event::ClientLeft { client: 1 }),
    ]
}

fn write(path: &Path, mode: JournalMode) {
    let mut w = JournalWriter::open(path, mode).unwrap();
    for (t, e) in events() {
        w.record(t, &e).unwrap();
    }
}

fn sha256(v: &[f32]) -> [u8; 32] {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = [0u8; 32];
    out.copy_from_slice(digest::digest(&SHA256, &bytes).as_ref());
    out
}

#[test]
fn full_mode_round_trips_every_event_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(JOURNAL_FILE);
    write(&path, JournalMode::Full);
    let (entries, torn) = JournalReader::read_all(&path).unwrap();
    assert_eq!(torn, None);
    assert_eq!(
        entries[0],
        Entry::Start {
            format: FORMAT_VERSION,
            mode: JournalMode::Full
        }
    );
    let want: Vec<Entry> = events()
        .into_iter()
        .map(|(t, event)| Entry::Event { t, event })
        .collect();
    assert_eq!(entries[1..], want[..]);
    // -0.0 == 0.0 in f32 comparisons: check the bits of the update too.
    let Entry::Event {
        event: Event::UpdateArrived { update, .. },
        ..
    } = &entries[2]
    else {
        panic!("{:?}", entries[2])
    };
    assert_eq!(update[1].to_bits(), (-0.0f32).to_bits());
}

#[test]
fn digest_mode_keeps_the_digest_and_no_values() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(JOURNAL_FILE);
    write(&path, JournalMode::Digest);
    let (entries, _) = JournalReader::read_all(&path).unwrap();
    let v = vec![1.0, -0.0, f32::MIN_POSITIVE, 3.5e7, -2.25];
    assert_eq!(
        entries[2],
        Entry::UpdateDigest {
            t: 1.25,
            client: 1,
            round: 1,
            unit: 3,
            len: 5,
            sha256: sha256(&v),
        }
    );
    // Everything else is recorded in full.
    assert_eq!(entries.len(), events().len() + 1);
    assert_eq!(
        entries[3],
        Entry::Event {
            t: 0.1 + 0.2,
            event: Event::Tick
        }
    );
    // The digest covers more than one hashing chunk the same way as a one-shot hash.
    let big: Vec<f32> = (0..10_000).map(|i| i as f32 * 0.5).collect();
    let mut w = JournalWriter::open(&path, JournalMode::Digest).unwrap();
    w.record_update(9.0, 2, 4, 7, &big).unwrap();
    drop(w);
    let (entries, _) = JournalReader::read_all(&path).unwrap();
    assert!(matches!(
        entries.last(),
        Some(Entry::UpdateDigest { len: 10_000, sha256, .. }) if *sha256 == sha256_of(&big)
    ));
}

fn sha256_of(v: &[f32]) -> [u8; 32] {
    sha256(v)
}

#[test]
fn a_torn_tail_is_reported_and_truncated_before_appending() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(JOURNAL_FILE);
    write(&path, JournalMode::Full);
    let full = std::fs::read(&path).unwrap();
    let (entries, _) = JournalReader::read_all(&path).unwrap();
    // Cut inside the last frame at every possible point: the entries before it survive.
    let last_start = {
        let mut r = JournalReader::open(&path).unwrap();
        let mut at = 0;
        while r.next_entry().unwrap().is_some() {
            if r.offset < full.len() as u64 {
                at = r.offset;
            }
        }
        at as usize
    };
    for cut in last_start + 1..full.len() {
        std::fs::write(&path, &full[..cut]).unwrap();
        let (got, torn) = JournalReader::read_all(&path).unwrap();
        assert_eq!(torn, Some(last_start as u64), "cut at {cut}");
        assert_eq!(got[..], entries[..entries.len() - 1], "cut at {cut}");
    }
    // Reopening truncates the torn frame and appends a new segment after the good ones.
    let mut w = JournalWriter::open(&path, JournalMode::Digest).unwrap();
    w.record(9.0, &Event::Tick).unwrap();
    drop(w);
    let (got, torn) = JournalReader::read_all(&path).unwrap();
    assert_eq!(torn, None);
    assert_eq!(got.len(), entries.len() + 1);
    assert_eq!(
        got[entries.len() - 1],
        Entry::Start {
            format: FORMAT_VERSION,
            mode: JournalMode::Digest
        }
    );
    assert_eq!(
        got.last(),
        Some(&Entry::Event {
            t: 9.0,
            event: Event::Tick
        })
    );
}

/// Issue 15: a power loss can leave the file longer than its data, the tail filled with zeros.
/// That is a torn write (reported, truncated on reopening), not corruption; zeros followed by
/// anything else still are.
#[test]
fn a_zero_filled_tail_is_a_torn_write() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(JOURNAL_FILE);
    write(&path, JournalMode::Full);
    let full = std::fs::read(&path).unwrap();
    let (entries, _) = JournalReader::read_all(&path).unwrap();
    for zeros in [1usize, 15, 16, 17, 300, 20_000] {
        let mut padded = full.clone();
        padded.resize(full.len() + zeros, 0);
        std::fs::write(&path, &padded).unwrap();
        let (got, torn) = JournalReader::read_all(&path).unwrap();
        assert_eq!(torn, Some(full.len() as u64), "{zeros} zeros");
        assert_eq!(got, entries, "{zeros} zeros");
        drop(JournalWriter::open(&path, JournalMode::Full).unwrap());
        let (got, torn) = JournalReader::read_all(&path).unwrap();
        assert_eq!(
            (got.len(), torn),
            (entries.len() + 1, None),
            "{zeros} zeros"
        );
        // Zeros that something follows were not left by a power loss.
        let mut bad = padded.clone();
        bad.push(1);
        std::fs::write(&path, &bad).unwrap();
        {
            assert!(
                matches!(
                    JournalReader::read_all(&path),
                    Err(JournalError::Corrupt { .. })
                ),
                "{zeros} zeros then a byte"
            );
        }
    }
}

/// Issue 59: a few bytes of garbage after the last frame (shorter than a frame's prefix) are not
/// a torn write: only a cut-short frame's own beginning is.
#[test]
fn short_garbage_after_the_last_frame_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(JOURNAL_FILE);
    write(&path, JournalMode::Full);
    let full = std::fs::read(&path).unwrap();
    let (entries, _) = JournalReader::read_all(&path).unwrap();
    for tail in [
        &b"x"[..],
        b"garbage",
        b"FRJ",
        b"FRJ1\xff\xff\xff\xff\0\0\0\0\0\0\0\0",
    ] {
        let mut bad = full.clone();
        bad.extend_from_slice(tail);
        std::fs::write(&path, &bad).unwrap();
        let got = JournalReader::read_all(&path);
        let torn_ok = tail.len() < 16 && tail.starts_with(&b"FRJ1"[..tail.len().min(4)]);
        if torn_ok {
            assert_eq!(got.unwrap(), (entries.clone(), Some(full.len() as u64)));
        } else {
            assert!(
                matches!(got, Err(JournalError::Corrupt { .. })),
                "{tail:?}: {got:?}"
            );
            // And a writer refuses to truncate it away.
            assert!(JournalWriter::open(&path, JournalMode::Full).is_err());
        }
    }
}

#[test]
fn a_flipped_bit_in_a_complete_frame_is_corruption_not_a_torn_write() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(JOURNAL_FILE);
    write(&path, JournalMode::Full);
    let full = std::fs::read(&path).unwrap();
    // Every byte of the file, including the whole last (complete) frame: lengths, checksum,
    // header and update body.
    for i in 0..full.len() {
        let mut bad = full.clone();
        bad[i] ^= 0x10;
        std::fs::write(&path, &bad).unwrap();
        let r = JournalReader::read_all(&path);
        assert!(
            matches!(r, Err(JournalError::Corrupt { .. })),
            "flipping byte {i} of {} gave {r:?}",
            full.len()
        );
        // Nor may a writer reopen it as if the tail were torn and cut a complete frame off.
        // (It walks lengths and headers; a flipped body byte is found on reading.)
        if JournalWriter::open(&path, JournalMode::Full).is_ok() {
            let now = std::fs::read(&path).unwrap();
            assert_eq!(
                now[..bad.len()],
                bad[..],
                "reopening after flipping byte {i}"
            );
        }
    }
}

#[test]
fn the_scenario_chooses_the_mode_and_defaults_to_digest() {
    let base = "[task]\nkind = \"mean_estimation\"\n";
    let s = Scenario::from_toml_str(base).unwrap();
    assert_eq!(s.journal, JournalMode::Digest);
    let s = Scenario::from_toml_str(&format!("journal = \"full\"\n{base}")).unwrap();
    assert_eq!(s.journal, JournalMode::Full);
    assert!(Scenario::from_toml_str(&format!("journal = \"everything\"\n{base}")).is_err());
}

#[test]
fn a_million_float_update_is_one_frame_of_raw_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(JOURNAL_FILE);
    let v: Vec<f32> = (0..1_000_000).map(|i| (i as f32).sin()).collect();
    let mut w = JournalWriter::open(&path, JournalMode::Full).unwrap();
    w.record_update(1.0, 1, 1, 1, &v).unwrap();
    drop(w);
    let size = std::fs::metadata(&path).unwrap().len();
    // 4 bytes per value plus two small headers: raw, not JSON.
    assert!(size > 4_000_000 && size < 4_000_000 + 1024, "{size} bytes");
    let (entries, _) = JournalReader::read_all(&path).unwrap();
    let Entry::Event {
        event: Event::UpdateArrived { update, .. },
        ..
    } = &entries[1]
    else {
        panic!("{:?}", entries[1])
    };
    assert!(
        update
            .iter()
            .zip(&v)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
}
