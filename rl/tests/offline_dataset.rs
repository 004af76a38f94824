//! Offline datasets: Minari parquet round trip, a fixture written by real Python minari,
//! deterministic generation, the on-disk cache, and clear errors on corrupt files.

use std::path::{Path, PathBuf};

use fedrl_common::offline::{Behaviour, DatasetSpec};
use fedrl_rl::offline::cache::{self, Source};
use fedrl_rl::offline::generate::{Progress, generate};
use fedrl_rl::offline::minari::{self, MinariError, WriteOptions};
use fedrl_rl::offline::{Dataset, Episode};

fn tiny_spec(behaviour: Behaviour) -> DatasetSpec {
    DatasetSpec {
        env: "CartPole-v1".into(),
        population_seed: 0,
        behaviour,
        units: 6,
        episodes_per_unit: 2,
        seed: 3,
        gymnasium: None,
    }
}

fn tiny_ppo() -> Behaviour {
    Behaviour::PpoMixed {
        iterations: 2,
        checkpoints: 2,
        epsilon: 0.3,
    }
}

fn quiet() -> impl FnMut(Progress) {
    |_| {}
}

fn write_tmp(d: &Dataset) -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let dir = minari::dataset_dir(root.path(), &d.id).unwrap();
    minari::write(d, &dir, &WriteOptions::default()).unwrap();
    (root, dir)
}

#[test]
fn round_trip_write_then_read_is_equal() {
    let d = generate(&tiny_spec(Behaviour::Random), &mut quiet()).unwrap();
    let (_root, dir) = write_tmp(&d);
    let back = minari::read(&dir).unwrap();
    assert_eq!(back.units_assigned, 0);
    assert_eq!(back.minari_version, minari::MINARI_VERSION);
    assert_eq!(back.dataset, d);
    // The layout Minari expects: one folder per episode with a parquet part and metadata.
    assert!(dir.join("data/0/part-0.parquet").is_file());
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("data/3/metadata.json")).unwrap())
            .unwrap();
    assert_eq!(meta["unit"], 1);
    assert_eq!(meta["total_steps"], d.episodes[3].len());
    let top: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("data/metadata.json")).unwrap())
            .unwrap();
    assert_eq!(top["data_format"], "parquet");
    assert_eq!(top["total_episodes"], 12);
    assert!(
        top["env_spec"]
            .as_str()
            .unwrap()
            .contains("\"id\": \"CartPole-v1\"")
    );
    // The simulator's bounds (f32::MAX for CartPole's velocities) in a form Python parses.
    assert!(
        top["observation_space"]
            .as_str()
            .unwrap()
            .contains("-3.4028234663852886e38"),
        "{}",
        top["observation_space"]
    );
}

#[test]
fn round_trip_keeps_arbitrary_units_and_flags() {
    let ep = |id: u64, unit: u64, n: usize, truncated: bool| Episode {
        id,
        unit,
        observations: (0..(n + 1) * 3).map(|i| i as f32 * 0.5 - 1e-7).collect(),
        actions: (0..n).map(|i| (i % 4) as u32).collect(),
        rewards: (0..n).map(|i| -(i as f32) / 3.0).collect(),
        terminations: (0..n).map(|i| !truncated && i + 1 == n).collect(),
        truncations: (0..n).map(|i| truncated && i + 1 == n).collect(),
    };
    let d = Dataset {
        id: "tests/odd-units-v2".into(),
        env_id: "NotAGymEnv-v0".into(),
        obs_dim: 3,
        n_actions: 4,
        episodes: vec![
            ep(0, 9_000_000_000, 5, true),
            ep(1, 7, 1, false),
            ep(2, 7, 3, false),
        ],
    };
    let (_root, dir) = write_tmp(&d);
    assert_eq!(minari::read(&dir).unwrap().dataset, d);
    // No Gymnasium spec for an environment Gymnasium does not know; unknown bounds are
    // infinite, written as Python's json writes them.
    let top = std::fs::read_to_string(dir.join("data/metadata.json")).unwrap();
    assert!(!top.contains("env_spec"), "{top}");
    assert!(
        top.contains(r#"\"low\": [-Infinity, -Infinity, -Infinity]"#),
        "{top}"
    );
}

#[test]
fn reads_a_dataset_written_by_python_minari() {
    check_python_fixture("pyfix/cartpole-random-v0", "expected.json");
}

/// Issue 58: Minari's arrow backend (Arrow IPC files), written by Python minari 0.5.4 from the
/// same episodes as the parquet fixture.
#[test]
fn reads_a_dataset_written_by_python_minari_with_the_arrow_backend() {
    check_python_fixture("pyfix/cartpole-random-arrow-v0", "expected-arrow.json");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minari");
    let parquet = minari::read(&fixtures.join("pyfix/cartpole-random-v0")).unwrap();
    let arrow = minari::read(&fixtures.join("pyfix/cartpole-random-arrow-v0")).unwrap();
    assert_eq!(arrow.dataset.episodes, parquet.dataset.episodes);
}

fn check_python_fixture(id: &str, expected: &str) {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minari");
    let read = minari::read(&fixtures.join(id)).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join(expected)).unwrap()).unwrap();
    let d = &read.dataset;
    assert_eq!(d.id, id);
    assert_eq!(d.env_id, "CartPole-v1");
    assert_eq!((d.obs_dim, d.n_actions), (4, 2));
    let expected = expected.as_array().unwrap();
    assert_eq!(d.episodes.len(), expected.len());
    for (e, x) in d.episodes.iter().zip(expected) {
        assert_eq!(e.id, x["id"].as_u64().unwrap());
        assert_eq!(e.len() as u64, x["steps"].as_u64().unwrap());
        assert_eq!(e.total_return(), x["return"].as_f64().unwrap());
        assert_eq!(e.actions[0] as u64, x["first_action"].as_u64().unwrap());
        assert_eq!(
            *e.terminations.last().unwrap(),
            x["terminated"].as_bool().unwrap()
        );
        for (a, b) in e.observations[..4]
            .iter()
            .zip(x["first_obs"].as_array().unwrap())
        {
            assert_eq!(*a as f64, b.as_f64().unwrap());
        }
        assert_eq!(e.observations.len(), (e.len() + 1) * 4);
    }
    // Episodes 0 and 1 carry units 11 and 12 in their metadata; episode 2 has none and becomes
    // a unit of its own after the largest id present.
    let units: Vec<u64> = d.episodes.iter().map(|e| e.unit).collect();
    assert_eq!(units, vec![11, 12, 13]);
    assert_eq!(read.units_assigned, 1);
}

#[test]
fn reading_some_units_gives_their_episodes_as_a_full_read_does() {
    // Python's fixture: units 11 and 12 from metadata, 13 assigned (no unit key).
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minari");
    let dir = fixtures.join("pyfix/cartpole-random-v0");
    let full = minari::read(&dir).unwrap();
    for keep in [vec![12], vec![13], vec![11, 13], vec![]] {
        let part = minari::read_units(&dir, &|u| keep.contains(&u)).unwrap();
        let expected: Vec<_> = full
            .dataset
            .episodes
            .iter()
            .filter(|e| keep.contains(&e.unit))
            .cloned()
            .collect();
        assert_eq!(part.dataset.episodes, expected, "keep {keep:?}");
        assert_eq!(part.units_assigned, 1);
    }
    // fedrl's own layout: several episodes per unit.
    let d = generate(&tiny_spec(Behaviour::Random), &mut quiet()).unwrap();
    let (_root, dir) = write_tmp(&d);
    let unit = d.episodes[0].unit;
    let part = minari::read_units(&dir, &|u| u == unit).unwrap().dataset;
    assert!(!part.episodes.is_empty());
    assert!(part.episodes.len() < d.episodes.len());
    assert!(part.episodes.iter().all(|e| e.unit == unit));
    assert_eq!(
        part.episodes,
        d.episodes
            .iter()
            .filter(|e| e.unit == unit)
            .cloned()
            .collect::<Vec<_>>()
    );
    // An episode not read still counts through its metadata: a wrong total_steps there breaks
    // the dataset's total.
    let other = d.episodes.iter().find(|e| e.unit != unit).unwrap().id;
    edit_json(&dir.join(format!("data/{other}/metadata.json")), |v| {
        v["total_steps"] = serde_json::json!(v["total_steps"].as_u64().unwrap() + 1)
    });
    let err = minari::read_units(&dir, &|u| u == unit).unwrap_err();
    assert!(layout_message(err).contains("total_steps"));
}

#[test]
fn generation_is_deterministic_and_seeded() {
    for b in [Behaviour::Random, tiny_ppo()] {
        let spec = tiny_spec(b);
        let a = generate(&spec, &mut quiet()).unwrap();
        let again = generate(&spec, &mut quiet()).unwrap();
        assert_eq!(a, again);
        let mut other = spec.clone();
        other.seed += 1;
        assert_ne!(a.episodes, generate(&other, &mut quiet()).unwrap().episodes);
    }
}

#[test]
fn generated_units_and_episode_ids_follow_the_spec() {
    let spec = tiny_spec(tiny_ppo());
    let mut checkpoints = Vec::new();
    let mut training = 0;
    let d = generate(&spec, &mut |p| match p {
        Progress::Checkpoint {
            index, iteration, ..
        } => checkpoints.push((index, iteration)),
        Progress::Training { .. } => training += 1,
        Progress::Recording { .. } => {}
    })
    .unwrap();
    assert_eq!(d.id, spec.minari_id());
    assert_eq!(d.env_id, "CartPole-v1");
    assert_eq!(d.episodes.len(), 12);
    for (i, e) in d.episodes.iter().enumerate() {
        assert_eq!(e.id, i as u64);
        assert_eq!(e.unit, i as u64 / 2);
        let last = e.len() - 1;
        assert!(e.terminations[last] || e.truncations[last]);
        assert!(e.terminations[..last].iter().all(|t| !t));
    }
    // The first checkpoint is the untrained policy, the last the final one.
    assert_eq!(checkpoints, vec![(0, 0), (1, 2)]);
    assert_eq!(training, 2);
    let per_unit = d.unit_transitions();
    assert_eq!(per_unit.len(), 6);
    assert_eq!(
        per_unit.values().map(|b| b.len()).sum::<usize>(),
        d.transitions().len()
    );
}

#[test]
fn impossible_specs_are_refused() {
    let mut spec = tiny_spec(Behaviour::Random);
    spec.units = u64::MAX / 2;
    spec.episodes_per_unit = 3;
    assert!(generate(&spec, &mut quiet()).is_err());
    spec.units = 0;
    assert!(generate(&spec, &mut quiet()).is_err());
    let mut spec = tiny_spec(Behaviour::PpoMixed {
        iterations: 1,
        checkpoints: 0,
        epsilon: 0.1,
    });
    assert!(generate(&spec, &mut quiet()).is_err());
    spec.env = "Pendulum-v1".into();
    spec.behaviour = Behaviour::Random;
    let err = generate(&spec, &mut quiet()).unwrap_err();
    assert!(err.to_string().contains("Discrete"), "{err}");
}

#[test]
fn population_users_differ_per_unit() {
    // cartpole-b1 gives each unit its own physics: a unit's episodes do not depend on the
    // other units, so generating fewer units yields a prefix of the same data.
    let mut spec = tiny_spec(Behaviour::Random);
    spec.env = "cartpole-b1".into();
    let big = generate(&spec, &mut quiet()).unwrap();
    spec.units = 3;
    let small = generate(&spec, &mut quiet()).unwrap();
    assert_eq!(small.episodes[..], big.episodes[..6]);
    assert_eq!(big.env_id, "CartPole-v1");
}

#[test]
fn cache_generates_once_then_loads() {
    let root = tempfile::tempdir().unwrap();
    let spec = tiny_spec(Behaviour::Random);
    let mut calls = 0;
    let (first, src) = cache::load_or_generate(&spec, root.path(), &mut |_| calls += 1).unwrap();
    assert_eq!(src, Source::Generated);
    assert!(calls > 0);
    let dir = minari::dataset_dir(root.path(), &spec.minari_id()).unwrap();
    assert!(dir.join(cache::SPEC_FILE).is_file());
    // Only the final folder and Minari's namespace file remain: no temporary folder.
    let names: Vec<String> = std::fs::read_dir(root.path().join("fedrl"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut names = names;
    names.sort();
    let want_name = spec.minari_id().split('/').nth(1).unwrap().to_string();
    assert_eq!(names, vec![want_name, "namespace_metadata.json".into()]);

    let mut calls_again = 0;
    let (second, src) =
        cache::load_or_generate(&spec, root.path(), &mut |_| calls_again += 1).unwrap();
    assert_eq!(src, Source::Cache);
    assert_eq!(calls_again, 0, "a cache hit must not generate");
    assert_eq!(first, second);
    // A client agent's share: only its units, whether generated here or read from the cache.
    let keep = |u: u64| u % 2 == 1;
    let mine: Vec<_> = first
        .episodes
        .iter()
        .filter(|e| keep(e.unit))
        .cloned()
        .collect();
    assert!(!mine.is_empty() && mine.len() < first.episodes.len());
    let (cached, src) =
        cache::load_or_generate_units(&spec, root.path(), &mut quiet(), &keep).unwrap();
    assert_eq!((src, &cached.episodes), (Source::Cache, &mine));
    let elsewhere = tempfile::tempdir().unwrap();
    let (generated, src) =
        cache::load_or_generate_units(&spec, elsewhere.path(), &mut quiet(), &keep).unwrap();
    assert_eq!((src, &generated.episodes), (Source::Generated, &mine));
    let (episodes, _) =
        minari::totals(&minari::dataset_dir(elsewhere.path(), &spec.minari_id()).unwrap()).unwrap();
    assert_eq!(episodes, 12, "stored whole");

    let listed = cache::list(root.path()).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, spec.minari_id());
    assert!(listed[0].generated);
    assert_eq!(listed[0].total_episodes, 12);
}

#[test]
fn cache_refuses_a_folder_made_by_another_spec() {
    let root = tempfile::tempdir().unwrap();
    let spec = tiny_spec(Behaviour::Random);
    cache::load_or_generate(&spec, root.path(), &mut quiet()).unwrap();
    let dir = minari::dataset_dir(root.path(), &spec.minari_id()).unwrap();
    let mut other = spec.clone();
    other.units = 7;
    std::fs::write(
        dir.join(cache::SPEC_FILE),
        serde_json::to_string(&other).unwrap(),
    )
    .unwrap();
    let err = cache::load_or_generate(&spec, root.path(), &mut quiet()).unwrap_err();
    assert!(
        matches!(err, cache::CacheError::SpecMismatch { .. }),
        "{err}"
    );
}

#[test]
fn store_refuses_to_overwrite_and_list_skips_temporary_folders() {
    let root = tempfile::tempdir().unwrap();
    let d = generate(&tiny_spec(Behaviour::Random), &mut quiet()).unwrap();
    cache::store(&d, root.path(), None).unwrap();
    assert!(cache::store(&d, root.path(), None).is_err());
    // A crashed writer's temporary folder, complete or not, is never listed.
    let tmp = root.path().join("fedrl/.tmp-crashed-1");
    minari::write(
        &Dataset {
            id: "fedrl/crashed-v0".into(),
            ..d.clone()
        },
        &tmp,
        &WriteOptions::default(),
    )
    .unwrap();
    let ids: Vec<String> = cache::list(root.path())
        .unwrap()
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(ids, vec![d.id.clone()]);
}

/// Writes a small dataset and returns (root guard, dataset folder).
fn written() -> (tempfile::TempDir, PathBuf) {
    let d = generate(&tiny_spec(Behaviour::Random), &mut quiet()).unwrap();
    write_tmp(&d)
}

fn layout_message(err: MinariError) -> String {
    match err {
        MinariError::Layout { message, .. } => message,
        other => panic!("expected a layout error, got {other}"),
    }
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}

#[test]
fn missing_files_are_named() {
    let (_r, dir) = written();
    std::fs::remove_file(dir.join("data/2/part-0.parquet")).unwrap();
    let err = minari::read(&dir).unwrap_err();
    assert!(err.to_string().contains("data/2"), "{err}");

    let (_r, dir) = written();
    std::fs::remove_file(dir.join("data/metadata.json")).unwrap();
    let err = minari::read(&dir).unwrap_err();
    assert!(err.to_string().contains("missing file"), "{err}");

    let empty = tempfile::tempdir().unwrap();
    let err = minari::read(empty.path()).unwrap_err();
    assert!(err.to_string().contains("no data/ subfolder"), "{err}");
}

#[test]
fn corrupt_parquet_is_an_error() {
    let (_r, dir) = written();
    let part = dir.join("data/1/part-0.parquet");
    let bytes = std::fs::read(&part).unwrap();
    std::fs::write(&part, &bytes[..bytes.len() / 2]).unwrap();
    let err = minari::read(&dir).unwrap_err();
    assert!(matches!(err, MinariError::Parquet { .. }), "{err}");
    assert!(err.to_string().contains("part-0.parquet"), "{err}");
}

#[test]
fn length_mismatches_are_errors() {
    let (_r, dir) = written();
    edit_json(&dir.join("data/0/metadata.json"), |v| {
        v["total_steps"] = serde_json::json!(1_000_000)
    });
    assert!(layout_message(minari::read(&dir).unwrap_err()).contains("total_steps"));

    let (_r, dir) = written();
    edit_json(&dir.join("data/metadata.json"), |v| {
        let n = v["total_steps"].as_u64().unwrap();
        v["total_steps"] = serde_json::json!(n + 1)
    });
    assert!(layout_message(minari::read(&dir).unwrap_err()).contains("total_steps"));

    let (_r, dir) = written();
    edit_json(&dir.join("data/metadata.json"), |v| {
        v["total_episodes"] = serde_json::json!(13)
    });
    assert!(
        minari::read(&dir)
            .unwrap_err()
            .to_string()
            .contains("data/12")
    );
}

#[test]
fn wrong_spaces_are_errors() {
    let (_r, dir) = written();
    edit_json(&dir.join("data/metadata.json"), |v| {
        v["action_space"] = serde_json::json!(
            r#"{"type": "Box", "dtype": "float32", "shape": [1], "low": [-1.0], "high": [1.0]}"#
        )
    });
    assert!(layout_message(minari::read(&dir).unwrap_err()).contains("Discrete"));

    let (_r, dir) = written();
    edit_json(&dir.join("data/metadata.json"), |v| {
        v["observation_space"] = serde_json::json!(
            r#"{"type": "Box", "dtype": "float32", "shape": [5], "low": [-Infinity, 0, 0, 0, 0], "high": [Infinity, 1, 1, 1, 1]}"#
        )
    });
    // The files hold 4 values per observation.
    assert!(layout_message(minari::read(&dir).unwrap_err()).contains("values per row"));

    let (_r, dir) = written();
    edit_json(&dir.join("data/metadata.json"), |v| {
        v["action_space"] =
            serde_json::json!(r#"{"type": "Discrete", "dtype": "int64", "start": 0, "n": 1}"#)
    });
    assert!(layout_message(minari::read(&dir).unwrap_err()).contains("outside Discrete(1)"));

    let (_r, dir) = written();
    edit_json(&dir.join("data/metadata.json"), |v| {
        v["data_format"] = serde_json::json!("hdf5")
    });
    let m = layout_message(minari::read(&dir).unwrap_err());
    // Without the `hdf5` feature the error names it and the conversion; with it, the HDF5
    // reader looks for the main file this parquet dataset lacks.
    #[cfg(not(feature = "hdf5"))]
    assert!(
        m.contains("`hdf5` feature") && m.contains("data_format=\"parquet\""),
        "{m}"
    );
    #[cfg(feature = "hdf5")]
    assert!(m.contains("missing file"), "{m}");
}

#[test]
fn unit_ids_must_be_integers() {
    let (_r, dir) = written();
    edit_json(&dir.join("data/4/metadata.json"), |v| {
        v["unit"] = serde_json::json!("alice")
    });
    assert!(layout_message(minari::read(&dir).unwrap_err()).contains("unit"));
}

#[test]
fn ids_are_checked() {
    for bad in [
        "",
        "a",
        "ns/",
        "../x-v0",
        "ns/../x-v0",
        "ns/x y-v0",
        "ns/x-vv",
    ] {
        assert!(minari::check_id(bad).is_err(), "{bad:?}");
    }
    for good in ["x-v0", "ns/x-v12", "a/b/c.d_e-v1"] {
        minari::check_id(good).unwrap();
    }
}

#[test]
fn summary_counts_and_quantiles() {
    let ep = |id: u64, unit: u64, r: &[f32]| Episode {
        id,
        unit,
        observations: vec![0.0; r.len() + 1],
        actions: vec![0; r.len()],
        rewards: r.to_vec(),
        terminations: vec![false; r.len()],
        truncations: vec![false; r.len()],
    };
    let d = Dataset {
        id: "t/s-v0".into(),
        env_id: "X".into(),
        obs_dim: 1,
        n_actions: 1,
        episodes: vec![
            ep(0, 0, &[1.0]),
            ep(1, 0, &[1.0, 1.0]),
            ep(2, 5, &[4.0]),
            ep(3, 6, &[1.0, 1.0, 8.0]),
        ],
    };
    let s = d.summary();
    assert_eq!((s.episodes, s.steps, s.units), (4, 7, 3));
    assert_eq!((s.episodes_per_unit_min, s.episodes_per_unit_max), (1, 2));
    // Returns 1, 2, 4, 10: numpy's quantiles.
    assert_eq!(s.return_mean, 4.25);
    assert_eq!((s.return_min, s.return_max), (1.0, 10.0));
    assert_eq!(s.return_q25, 1.75);
    assert_eq!(s.return_median, 3.0);
    assert_eq!(s.return_q75, 5.5);
}

/// Issue 59, item 7: bits flipped inside a cached parquet (or experts) file were used silently;
/// the SHA-256 recorded at generation is checked once per load, and a mismatch names the file
/// and says what to do.
#[test]
fn flipped_bits_in_a_cached_file_are_an_error_naming_it() {
    let root = tempfile::tempdir().unwrap();
    let spec = tiny_spec(Behaviour::Random);
    cache::load_or_generate(&spec, root.path(), &mut quiet()).unwrap();
    let dir = minari::dataset_dir(root.path(), &spec.minari_id()).unwrap();
    assert!(dir.join(cache::CONTENT_FILE).is_file());
    assert!(cache::verify_content(&dir).unwrap(), "sums were recorded");
    // Minari's layout: one folder per episode, `data/<id>/part-0.parquet`.
    let parquet = dir.join("data/3/part-0.parquet");
    assert!(parquet.is_file());
    let clean = std::fs::read(&parquet).unwrap();
    let (clean_ds, _) = cache::load_or_generate(&spec, root.path(), &mut quiet()).unwrap();
    // The first byte whose flip the parquet reader alone does not notice (it reads other
    // values): what every load used silently before the sums were checked.
    let bytes = (4..clean.len())
        .find_map(|at| {
            let mut b = clean.clone();
            b[at] ^= 0x10;
            std::fs::write(&parquet, &b).unwrap();
            let read = minari::read(&dir).ok()?;
            (read.dataset.episodes != clean_ds.episodes).then_some(b)
        })
        .expect("a flip the parquet reader does not notice");
    std::fs::write(&parquet, &bytes).unwrap();
    let err = cache::load_or_generate(&spec, root.path(), &mut quiet()).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, cache::CacheError::ContentMismatch { .. }),
        "{msg}"
    );
    assert!(msg.contains(&parquet.display().to_string()), "{msg}");
    assert!(
        msg.contains("SHA-256") && msg.contains("Delete its folder"),
        "{msg}"
    );
    std::fs::write(&parquet, &clean).unwrap();
    cache::load_or_generate(&spec, root.path(), &mut quiet()).unwrap();

    // Any file stored with the dataset (an experts file) is covered the same way.
    let d = generate(&tiny_spec(Behaviour::Random), &mut quiet()).unwrap();
    let other = tempfile::tempdir().unwrap();
    let stored = cache::store_with(&d, other.path(), None, &|tmp| {
        std::fs::write(tmp.join("experts.safetensors"), [7u8; 64]).unwrap();
        Ok(())
    })
    .unwrap();
    cache::verify_content(&stored).unwrap();
    std::fs::write(stored.join("experts.safetensors"), [7u8; 63]).unwrap();
    let err = cache::verify_content(&stored).unwrap_err();
    assert!(err.to_string().contains("experts.safetensors"), "{err}");
    // A folder stored before sums were recorded loads unchecked.
    std::fs::remove_file(stored.join(cache::CONTENT_FILE)).unwrap();
    assert!(!cache::verify_content(&stored).unwrap());
}

/// Issue 58: a Box-action dataset written by real Python minari (`make_minari_fixture.py box`)
/// is refused by the discrete reader with a message naming the space, read by
/// [`minari::read_box`], and imported into the continuous format with its SHA-256 sidecar and
/// the same numbers Python read.
#[test]
fn a_box_action_minari_dataset_imports_into_the_continuous_format() {
    use fedrl_rl::offline::continuous::{self, ContinuousDataset};
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minari");
    let dir = fixtures.join("pyfix/pendulum-random-v0");
    let e = minari::read(&dir).unwrap_err().to_string();
    assert!(
        e.contains("Discrete(n)") && e.contains("\"type\": \"Box\""),
        "{e}"
    );
    let h = minari::header(&dir).unwrap();
    assert_eq!(h.action, minari::ActionSpace::Box(1));
    assert_eq!(h.env_id, "Pendulum-v1");

    let root = tempfile::tempdir().unwrap();
    let imported = continuous::import_minari(&dir, "myorg/pendulum-v0", root.path()).unwrap();
    assert_eq!(
        imported.path,
        root.path().join("continuous/myorg-pendulum-v0.safetensors")
    );
    // Units 11 and 12 stored by Python, the third episode gets the next one.
    assert_eq!(imported.units_assigned, 1);
    assert!(continuous::verify_content(&imported.path).unwrap());
    let back = ContinuousDataset::load(&imported.path).unwrap();
    assert_eq!(back, imported.dataset);
    assert_eq!(
        back.episodes.iter().map(|e| e.unit).collect::<Vec<_>>(),
        [11, 12, 13]
    );
    assert_eq!((back.meta.obs_dim, back.meta.act_dim), (3, 1));
    let expected: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("expected-box.json")).unwrap())
            .unwrap();
    assert_eq!(back.episodes.len(), expected.len());
    for (e, x) in back.episodes.iter().zip(&expected) {
        assert_eq!(e.len() as u64, x["steps"].as_u64().unwrap());
        assert!((e.total_return() - x["return"].as_f64().unwrap()).abs() < 1e-4);
        assert_eq!(e.terminated, x["terminated"].as_bool().unwrap());
        let f32s = |v: &serde_json::Value| -> Vec<f32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        };
        assert_eq!(e.observations[..3], f32s(&x["first_obs"])[..]);
        assert_eq!(
            e.observations[e.observations.len() - 3..],
            f32s(&x["last_obs"])[..]
        );
        assert_eq!(e.actions[..1], f32s(&x["first_action"])[..]);
    }
    // Listed with the other datasets; a second import of the same name is refused.
    let listed = cache::list(root.path()).unwrap();
    assert!(
        listed
            .iter()
            .any(|l| l.id == "continuous/myorg-pendulum-v0" && l.total_steps == 15),
        "{listed:?}"
    );
    let again = continuous::import_minari(&dir, "myorg/pendulum-v0", root.path()).unwrap_err();
    assert!(again.to_string().contains("exists already"), "{again}");
}

/// Issue 58: a stored dataset's episodes map to units by episode, by the stored unit, or by an
/// episode metadata key; the numbering is the order of first appearance, the same whichever
/// units a reader keeps, and a unit is never split.
#[test]
fn stored_datasets_map_episodes_to_units_deterministically() {
    use fedrl_common::offline::UnitMap;
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minari");
    let src = fixtures.join("pyfix/cartpole-random-v0");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pyfix/cartpole-random-v0");
    for rel in ["0", "1", "2"] {
        std::fs::create_dir_all(dir.join("data").join(rel)).unwrap();
        for f in ["metadata.json", "part-0.parquet"] {
            std::fs::copy(
                src.join("data").join(rel).join(f),
                dir.join("data").join(rel).join(f),
            )
            .unwrap();
        }
    }
    std::fs::copy(
        src.join("data/metadata.json"),
        dir.join("data/metadata.json"),
    )
    .unwrap();
    // Owners: episodes 0 and 2 are one person's (one as a number, one as the string spelling
    // it: still one owner), episode 1 another's.
    let set = |i: u64, owner: serde_json::Value| {
        let p = dir.join("data").join(i.to_string()).join("metadata.json");
        let mut m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        m["owner"] = owner;
        std::fs::write(&p, m.to_string()).unwrap();
    };
    set(0, 7.into());
    set(1, "zed".into());
    set(2, "7".into());
    let units = |map: &UnitMap, keep: &dyn Fn(u64) -> bool| {
        let m = minari::read_mapped(&dir, map, keep).unwrap();
        (
            m.units,
            m.dataset
                .episodes
                .iter()
                .map(|e| (e.id, e.unit))
                .collect::<Vec<_>>(),
        )
    };
    let all = |_: u64| true;
    assert_eq!(
        units(&UnitMap::Episode, &all),
        (3, vec![(0, 0), (1, 1), (2, 2)])
    );
    // Stored units 11 and 12, the third has none: a unit of its own.
    assert_eq!(
        units(&UnitMap::Stored, &all),
        (3, vec![(0, 0), (1, 1), (2, 2)])
    );
    let owner = UnitMap::MetadataKey("owner".into());
    assert_eq!(units(&owner, &all), (2, vec![(0, 0), (1, 1), (2, 0)]));
    // A reader keeping one unit sees the same numbers and all of that unit's episodes.
    assert_eq!(units(&owner, &|u| u == 0), (2, vec![(0, 0), (2, 0)]));
    assert_eq!(units(&owner, &|u| u == 1), (2, vec![(1, 1)]));
    // A key missing on one episode is refused, naming the episode's file and the key.
    let e = minari::read_mapped(&dir, &UnitMap::MetadataKey("team".into()), &all).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("\"team\"") && msg.contains("0/metadata.json"),
        "{msg}"
    );
}
