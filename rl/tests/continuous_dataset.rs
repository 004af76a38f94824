//! Continuous-action datasets (PriMORL): generation is deterministic and independent of
//! batching, the file round-trips exactly, corrupt files are refused, and the public split is
//! the episodes past the private units; `cache::list` shows stored datasets from their headers.

use fedrl_common::task::primorl::{ContinuousBehaviour, ContinuousDatasetSpec};
use fedrl_rl::offline::cache;
use fedrl_rl::offline::continuous::{
    ContinuousDataset, generate, load_or_generate, load_or_generate_units, prepare,
};

fn spec(units: u64, public: u64) -> ContinuousDatasetSpec {
    ContinuousDatasetSpec {
        env: "Pendulum-v1".into(),
        units,
        public,
        seed: 3,
        behaviour: ContinuousBehaviour::Random,
        gymnasium: None,
    }
}

#[test]
fn random_pendulum_dataset_is_deterministic_and_round_trips() {
    let a = generate(&spec(300, 4), &mut |_| {}).expect("generate");
    let b = generate(&spec(300, 4), &mut |_| {}).expect("generate");
    assert_eq!(a, b);
    assert_eq!(a.episodes.len(), 304);
    for (k, e) in a.episodes.iter().enumerate() {
        assert_eq!(e.unit, k as u64);
        // Pendulum-v1 truncates at 200 steps and never terminates.
        assert_eq!(e.len(), 200);
        assert!(!e.terminated);
        assert!(e.actions.iter().all(|x| (-2.0..=2.0).contains(x)));
    }
    // Episode 7 is the same in a smaller dataset: unit u's episode depends on (seed, u) only.
    let small = generate(&spec(10, 0), &mut |_| {}).expect("generate");
    assert_eq!(small.episodes[7].observations, a.episodes[7].observations);
    assert_eq!(small.episodes[7].actions, a.episodes[7].actions);

    let bytes = a.to_bytes().expect("bytes");
    let back = ContinuousDataset::from_bytes(&bytes).expect("parse");
    assert_eq!(back, a);
    let (public, private) = a.split(300);
    assert_eq!(public.len(), 4);
    assert_eq!(private.len(), 300);
    assert!(public.iter().all(|e| e.unit >= 300));
}

#[test]
fn a_truncated_or_mismatched_file_is_refused() {
    let a = generate(&spec(5, 1), &mut |_| {}).expect("generate");
    let bytes = a.to_bytes().expect("bytes");
    assert!(ContinuousDataset::from_bytes(&bytes[..bytes.len() - 10]).is_err());

    let dir = tempfile::tempdir().expect("tmp");
    let s = spec(5, 1);
    let first = load_or_generate(&s, dir.path(), &mut |_| {}).expect("generate");
    let again = load_or_generate(&s, dir.path(), &mut |_| {}).expect("cache");
    assert_eq!(first, again);
    // A file under this spec's name made by another procedure is an error, not a reuse.
    let other = generate(&spec(6, 1), &mut |_| {}).expect("generate");
    other
        .save(&dir.path().join("continuous").join(s.file_name()))
        .expect("save");
    let err = load_or_generate(&s, dir.path(), &mut |_| {}).expect_err("mismatch");
    assert!(err.to_string().contains("expected"), "{err}");
    // `prepare` checks a stored file from its header alone, and generates a missing one.
    let err = prepare(&s, dir.path(), &mut |_| {}).expect_err("mismatch");
    assert!(err.to_string().contains("expected"), "{err}");
    let fresh = tempfile::tempdir().expect("tmp");
    let made = prepare(&s, fresh.path(), &mut |_| {}).expect("generate");
    let path = fresh.path().join("continuous").join(s.file_name());
    assert_eq!(made, ContinuousDataset::read_header(&path).expect("header"));
    assert_eq!(
        made,
        prepare(&s, fresh.path(), &mut |_| {}).expect("cached")
    );
    assert_eq!(made.meta, first.meta);
    assert_eq!(made.episodes, first.episodes.len() as u64);

    // A client agent's share, read from the file or filtered after generation: the episodes of
    // the kept units, as the whole dataset has them.
    let keep = |u: u64| u % 3 == 1 || u >= 5;
    let mine: Vec<_> = first
        .episodes
        .iter()
        .filter(|e| keep(e.unit))
        .cloned()
        .collect();
    assert!(!mine.is_empty() && mine.len() < first.episodes.len());
    let part = ContinuousDataset::load_units(&path, &keep).expect("part");
    assert_eq!((&part.meta, &part.episodes), (&first.meta, &mine));
    let other = tempfile::tempdir().expect("tmp");
    let generated = load_or_generate_units(&s, other.path(), &mut |_| {}, &keep).expect("gen");
    assert_eq!(generated.episodes, mine);
    let cached = load_or_generate_units(&s, other.path(), &mut |_| {}, &keep).expect("cached");
    assert_eq!(cached, generated);
    assert_eq!(
        ContinuousDataset::load_units(&path, &|_| true).expect("all"),
        first
    );
}

#[test]
fn stored_datasets_are_listed_from_their_headers() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = spec(5, 1);
    let ds = load_or_generate(&s, dir.path(), &mut |_| {}).expect("generate");
    let path = dir.path().join("continuous").join(s.file_name());
    let h = ContinuousDataset::read_header(&path).expect("header");
    assert_eq!(h.meta, ds.meta);
    assert_eq!(h.episodes, 6);
    assert_eq!(
        h.steps,
        ds.episodes.iter().map(|e| e.len() as u64).sum::<u64>()
    );
    // The summary read from the file's rewards and lengths alone is the loaded dataset's.
    assert_eq!(
        ContinuousDataset::summarize_file(&path).expect("summary"),
        ds.summary()
    );
    // A file whose lengths claim more steps than its rewards hold is refused, naming it.
    let mut bad = ds.clone();
    let n = bad.episodes[0].rewards.len();
    bad.episodes[0].rewards.truncate(n - 1);
    bad.episodes[0].actions.truncate((n - 1) * bad.meta.act_dim);
    bad.episodes[0].observations.truncate(n * bad.meta.obs_dim);
    let mut bytes = bad.to_bytes().expect("bytes");
    let lengths_at = {
        let hlen = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let h: serde_json::Value = serde_json::from_slice(&bytes[8..8 + hlen]).unwrap();
        8 + hlen + h["lengths"]["data_offsets"][0].as_u64().unwrap() as usize
    };
    bytes[lengths_at..lengths_at + 8].copy_from_slice(&(n as i64 + 5000).to_le_bytes());
    let broken = dir.path().join("broken.safetensors");
    std::fs::write(&broken, &bytes).expect("write");
    let err = ContinuousDataset::summarize_file(&broken)
        .expect_err("lengths")
        .to_string();
    assert!(
        err.contains("broken.safetensors") && err.contains("exceed"),
        "{err}"
    );
    // Reading a share of it is refused too, even when the bad episode is not kept.
    let err = ContinuousDataset::load_units(&broken, &|u| u != 0)
        .expect_err("lengths")
        .to_string();
    assert!(
        err.contains("broken.safetensors") && err.contains("exceed"),
        "{err}"
    );

    // A crashed writer's temporary file is not listed.
    std::fs::write(dir.path().join("continuous").join("x.tmp"), b"partial").expect("write");
    let listed = cache::list(dir.path()).expect("list");
    assert_eq!(listed.len(), 1);
    let stem = s.file_name().trim_end_matches(".safetensors").to_string();
    assert_eq!(listed[0].id, format!("continuous/{stem}"));
    assert_eq!(
        (listed[0].total_episodes, listed[0].total_steps),
        (6, h.steps)
    );

    // A file that is not a dataset is listed with its problem naming it, not silently omitted,
    // and does not stop the others from being listed (issue 59, item 7).
    let junk = dir.path().join("continuous").join("junk.safetensors");
    std::fs::write(&junk, b"\x10\0\0\0\0\0\0\0{}").expect("write");
    let listed = cache::list(dir.path()).expect("list");
    assert_eq!(listed.len(), 2);
    let bad = listed
        .iter()
        .find(|l| l.id == "continuous/junk")
        .expect("junk");
    let problem = bad.problem.as_deref().expect("marked");
    assert!(problem.contains("junk.safetensors"), "{problem}");
    assert!(
        listed
            .iter()
            .any(|l| l.problem.is_none() && l.total_episodes == 6)
    );
    std::fs::write(&junk, [0xff; 8]).expect("write");
    let err = ContinuousDataset::read_header(&junk)
        .expect_err("length")
        .to_string();
    assert!(err.contains("not plausible"), "{err}");
}

/// Issue 59: a bit flipped inside a stored dataset (where its own checks cannot see it: a value
/// in the arrays) is refused by every path that uses the file, naming the file; a file stored
/// before digests were is still used.
#[test]
fn a_flipped_bit_in_a_stored_dataset_is_refused() {
    use fedrl_rl::offline::continuous::{content_path, verify_content};
    let dir = tempfile::tempdir().expect("tmp");
    let s = spec(3, 1);
    let first = load_or_generate(&s, dir.path(), &mut |_| {}).expect("generate");
    let path = dir.path().join("continuous").join(s.file_name());
    assert!(verify_content(&path).expect("verify"));
    let mut bytes = std::fs::read(&path).expect("read");
    // The last byte belongs to the arrays (the header comes first), e.g. a reward or a flag.
    let n = bytes.len();
    bytes[n - 5] ^= 0x01;
    std::fs::write(&path, &bytes).expect("write");
    for err in [
        load_or_generate(&s, dir.path(), &mut |_| {}).map(|_| ()),
        load_or_generate_units(&s, dir.path(), &mut |_| {}, &|u| u == 0).map(|_| ()),
        prepare(&s, dir.path(), &mut |_| {}).map(|_| ()),
    ] {
        let err = err.expect_err("flipped bit").to_string();
        assert!(
            err.contains("SHA-256") && err.contains(&s.file_name()),
            "{err}"
        );
    }
    // Without a recorded digest (a file from before), the restored bytes are used as before.
    bytes[n - 5] ^= 0x01;
    std::fs::write(&path, &bytes).expect("write");
    std::fs::remove_file(content_path(&path)).expect("rm sidecar");
    assert!(!verify_content(&path).expect("verify"));
    assert_eq!(
        load_or_generate(&s, dir.path(), &mut |_| {}).expect("load"),
        first
    );
}
