//! The ledger's hash chain (issue 59, item 4): whole frames removed, reordered or inserted are
//! corruption; frames cut from the end are caught by the head a checkpoint or report recorded;
//! ledgers of the unchained format (version 2, written by the code before the chain) still open
//! and say they are unchained.

use fedrl_common::privacy::ledger::{
    LedgerConfig, LedgerError, Participation, PrivacyLedger, RoundRecord, UnitKind,
};
use fedrl_common::privacy::noise::NoiseSource;
use fedrl_common::privacy::{Delta, DpEvent};

fn config() -> LedgerConfig {
    config_at(20.0)
}

fn config_at(target_epsilon: f64) -> LedgerConfig {
    LedgerConfig {
        target_epsilon,
        delta: Delta::try_from(1e-5).unwrap(),
        unit_kind: UnitKind::Expert,
        participation: Participation::sampled(0.5).unwrap(),
    }
}

/// An expert run's shape: a release record, then DP-SGD steps.
fn expert_run(path: &std::path::Path) {
    expert_run_with(path, config());
}

fn expert_run_with(path: &std::path::Path, config: LedgerConfig) {
    let (mut l, _) = PrivacyLedger::open(path, config).unwrap();
    l.append(RoundRecord {
        round: 1,
        phase: "release".into(),
        event: DpEvent::EpsilonDelta {
            epsilon: 1.5,
            delta: 0.0,
        },
        sampled_by_aggregator: true,
        units: (0..6).collect(),
        clip_norm: None,
        expected_cohort: None,
        noise_source: NoiseSource::Os,
        unix_time_s: 1.0e9,
    })
    .unwrap();
    for round in 2..=6 {
        let mut r = RoundRecord::gaussian_round(
            round,
            vec![round % 6],
            2.0,
            1.0,
            Some(0.5),
            3.0,
            NoiseSource::Os,
        );
        r.phase = "dp-sgd".into();
        r.unix_time_s = 1.0e9 + round as f64;
        l.append(r).unwrap();
    }
}

/// The byte ranges of a ledger's frames, read from their own length fields (both the unchained
/// `FRL1` frames, 16-byte header, and the chained `FRLC` ones, 48-byte header), so this test
/// cuts whole frames the way an editor would, whatever the format.
fn frames(bytes: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = match &bytes[at..at + 4] {
            b"FRL1" => 16,
            b"FRLC" => 48,
            other => panic!("unknown magic {other:?} at {at}"),
        };
        let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
        out.push(at..at + header + len);
        at += header + len;
    }
    out
}

fn without(bytes: &[u8], cut: &std::ops::Range<usize>) -> Vec<u8> {
    let mut b = bytes[..cut.start].to_vec();
    b.extend_from_slice(&bytes[cut.end..]);
    b
}

/// Issue 59, item 4: cutting the release record (or any whole frame but the last) out of an
/// expert run's ledger, or swapping two frames, was read without a word (epsilon 8.66 instead
/// of 10); now it is corruption, on reading and on opening, and the file is left as it is.
#[test]
fn whole_frames_removed_or_reordered_are_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.ledger");
    expert_run(&good);
    let bytes = std::fs::read(&good).unwrap();
    let fr = frames(&bytes);
    assert_eq!(fr.len(), 7, "header, release, five steps");
    let path = dir.path().join("edited.ledger");
    // Every frame but the last (cutting the last is a valid shorter chain: see the head test).
    for (i, cut) in fr[..fr.len() - 1].iter().enumerate() {
        let edited = without(&bytes, cut);
        std::fs::write(&path, &edited).unwrap();
        let err = PrivacyLedger::read_file(&path).expect_err(&format!("frame {i} removed"));
        assert!(
            err.to_string().contains("removed, reordered or inserted") || i == 0,
            "frame {i}: {err}"
        );
        assert!(
            PrivacyLedger::open(&path, config()).is_err(),
            "frame {i} removed: open"
        );
        assert_eq!(
            std::fs::read(&path).unwrap(),
            edited,
            "nothing is discarded"
        );
    }
    // The release record is frame 1: its removal names the frame after it.
    std::fs::write(&path, without(&bytes, &fr[1])).unwrap();
    let err = PrivacyLedger::read_file(&path).unwrap_err();
    assert!(
        matches!(err, LedgerError::ChainBroken { entry: 1, offset, .. } if offset == fr[1].start as u64),
        "{err}"
    );
    // Two frames swapped.
    for i in 1..fr.len() - 1 {
        let mut b = bytes[..fr[i].start].to_vec();
        b.extend_from_slice(&bytes[fr[i + 1].clone()]);
        b.extend_from_slice(&bytes[fr[i].clone()]);
        b.extend_from_slice(&bytes[fr[i + 1].end..]);
        std::fs::write(&path, &b).unwrap();
        assert!(
            PrivacyLedger::read_file(&path).is_err(),
            "frames {i} and {} swapped",
            i + 1
        );
    }
    // A frame duplicated (inserted again after itself).
    let mut b = bytes[..fr[3].end].to_vec();
    b.extend_from_slice(&bytes[fr[3].clone()]);
    b.extend_from_slice(&bytes[fr[3].end..]);
    std::fs::write(&path, &b).unwrap();
    assert!(PrivacyLedger::read_file(&path).is_err(), "a frame repeated");
    // The untouched file still reads.
    assert_eq!(PrivacyLedger::read_file(&good).unwrap().entries.len(), 6);
}

/// Frames cut from the end leave a valid chain: the head recorded beside the ledger (by the
/// checkpoint and the report) catches them; a ledger that grew since is fine; a different
/// ledger of the same length is caught by the hash.
#[test]
fn a_cut_tail_is_caught_by_the_recorded_head() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("privacy.ledger");
    expert_run(&path);
    let (mut l, _) = PrivacyLedger::open(&path, config()).unwrap();
    let head = l.head();
    assert_eq!(head.entries, 6);
    assert_eq!(head.sha256.len(), 64);
    let ckpt = dir.path().join("checkpoint");
    l.check_head(&head, &ckpt).unwrap();
    // The ledger grows past the recorded head (appended before the next checkpoint): fine.
    let mut r = RoundRecord::gaussian_round(7, vec![1], 2.0, 1.0, Some(0.5), 3.0, NoiseSource::Os);
    r.phase = "dp-sgd".into();
    l.append(r).unwrap();
    l.check_head(&head, &ckpt).unwrap();
    assert_eq!(l.head().entries, 7);
    drop(l);
    let file = PrivacyLedger::read_file(&path).unwrap();
    file.check_head(&path, &head, &ckpt).unwrap();

    // Cut the last two frames: a valid chain, but short of the recorded head.
    let bytes = std::fs::read(&path).unwrap();
    let fr = frames(&bytes);
    std::fs::write(&path, &bytes[..fr[fr.len() - 2].start]).unwrap();
    let (l, _) = PrivacyLedger::open(&path, config()).unwrap();
    let err = l.check_head(&head, &ckpt).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, LedgerError::HeadMismatch { .. }), "{err:?}");
    assert!(
        msg.contains("holds 5 entries, but 6 were recorded"),
        "{msg}"
    );
    assert!(msg.contains(&ckpt.display().to_string()), "{msg}");
    let file = PrivacyLedger::read_file(&path).unwrap();
    assert!(file.check_head(&path, &head, &ckpt).is_err());

    // Another ledger as long as the recorded one (the same records, another header): the hash
    // differs.
    let other = dir.path().join("other.ledger");
    expert_run_with(&other, config_at(21.0));
    let file = PrivacyLedger::read_file(&other).unwrap();
    let err = file.check_head(&other, &head, &ckpt).unwrap_err();
    assert!(err.to_string().contains("rewritten or replaced"), "{err}");
}

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A version-2 ledger written by the code before the chain (`fixtures/ledger-v2.ledger`, see
/// `fixtures/README.md`) opens, accounts exactly as that code reported, says it is unchained,
/// and continues as a chain: entries appended to it are chained to its last old frame.
#[test]
fn unchained_version_two_ledgers_open_say_so_and_continue_chained() {
    let landed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("ledger-v2.report.json")).unwrap())
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("privacy.ledger");
    std::fs::copy(fixture("ledger-v2.ledger"), &path).unwrap();
    let read = PrivacyLedger::read_file(&path).unwrap();
    assert_eq!(read.version, 2);
    assert_eq!(
        read.recovery.unchained_entries,
        Some(8),
        "7 rounds, 1 raise"
    );
    assert!(
        read.recovery.to_string().contains("UNCHAINED"),
        "{}",
        read.recovery
    );
    let rep = read.report(Default::default()).unwrap();
    assert_eq!(rep.epsilon, landed["epsilon"].as_f64().unwrap());
    assert_eq!(rep.epsilon_rdp, landed["epsilon_rdp"].as_f64().unwrap());
    assert_eq!(rep.rounds, landed["rounds"].as_u64().unwrap());
    assert_eq!(rep.target_epsilon, 12.0);
    assert_eq!(rep.phases.len(), 3);

    let (mut l, rec) = PrivacyLedger::open(&path, read.config.clone()).unwrap();
    assert_eq!(rec.unchained_entries, Some(8));
    let mut r = RoundRecord::gaussian_round(8, vec![3], 3.0, 1.0, None, 2.0, NoiseSource::Os);
    r.unix_time_s = 1.0e9;
    l.append(r.clone()).unwrap();
    r.round = 9;
    l.append(r).unwrap();
    let head = l.head();
    drop(l);
    let again = PrivacyLedger::read_file(&path).unwrap();
    assert_eq!(again.version, 2);
    assert_eq!(again.records().len(), 9);
    assert_eq!(again.recovery.unchained_entries, Some(8));
    again.check_head(&path, &head, &path).unwrap();

    let bytes = std::fs::read(&path).unwrap();
    let fr = frames(&bytes);
    assert_eq!(fr.len(), 11, "header, 8 old entries, 2 new");
    assert_eq!(&bytes[fr[8].start..fr[8].start + 4], b"FRL1");
    assert_eq!(&bytes[fr[9].start..fr[9].start + 4], b"FRLC");
    // Removing the last old frame or the first new one breaks the chain...
    for i in [8, 9] {
        std::fs::write(&path, without(&bytes, &fr[i])).unwrap();
        assert!(PrivacyLedger::read_file(&path).is_err(), "frame {i}");
    }
    // ... and so does moving an old, unchained frame after the chained ones.
    let mut b = bytes[..fr[7].start].to_vec();
    b.extend_from_slice(&bytes[fr[8].start..]);
    b.extend_from_slice(&bytes[fr[7].clone()]);
    std::fs::write(&path, &b).unwrap();
    assert!(PrivacyLedger::read_file(&path).is_err());
    // Among the old frames a removal cannot be seen (which is why reading one says so).
    std::fs::write(&path, without(&bytes, &fr[3])).unwrap();
    let cut = PrivacyLedger::read_file(&path);
    assert!(cut.is_ok() || matches!(cut, Err(LedgerError::ChainBroken { .. })));
}
