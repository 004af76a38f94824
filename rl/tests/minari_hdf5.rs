//! Minari's HDF5 storage, read by the `hdf5` feature: the fixture `testdata/minari_hdf5/` was
//! written by Python minari's `DataCollector(env, data_format="hdf5")`
//! (`bench/peers/minari_hdf5_fixture.py`), and `expected.json` beside it is what Minari itself
//! reads back. Run with `cargo test -p fedrl-rl --features hdf5 --test minari_hdf5` (needs the
//! system HDF5 library: `apt-get install libhdf5-dev`).
#![cfg(feature = "hdf5")]

use std::path::{Path, PathBuf};

use fedrl_rl::offline::minari::{self, MinariError};

fn fixture_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/minari_hdf5")
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture_root().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A writable copy of the fixture dataset (the tests that damage it work on this).
fn copy() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture_root().join("peer/cartpole-tiny-v0/data");
    let dst = tmp.path().join("peer/cartpole-tiny-v0/data");
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["metadata.json", "main_data.hdf5"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let dir = dst.parent().unwrap().to_path_buf();
    (tmp, dir)
}

fn layout_message(e: MinariError) -> String {
    match e {
        MinariError::Layout { message, .. } => message,
        other => panic!("expected a layout error, got {other}"),
    }
}

#[test]
fn reads_every_value_minari_reads() {
    let want = expected();
    let read = minari::read(&fixture_root().join("peer/cartpole-tiny-v0")).unwrap();
    let d = &read.dataset;
    assert_eq!(d.id, want["id"]);
    assert_eq!(d.env_id, "CartPole-v1");
    assert_eq!((d.obs_dim, d.n_actions), (4, 2));
    assert_eq!(read.minari_version, "0.5.4");
    let eps = want["episodes"].as_array().unwrap();
    assert_eq!(d.episodes.len(), eps.len());
    let steps: usize = d.episodes.iter().map(|e| e.len()).sum();
    assert_eq!(steps as u64, want["total_steps"].as_u64().unwrap());
    for (i, (got, w)) in d.episodes.iter().zip(eps).enumerate() {
        assert_eq!(got.id, i as u64);
        let f32s = |k: &str| -> Vec<f32> {
            w[k].as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        };
        let bools = |k: &str| -> Vec<bool> {
            w[k].as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_bool().unwrap())
                .collect()
        };
        // float32 values round-trip exactly through JSON's f64.
        assert_eq!(got.observations, f32s("observations"), "episode {i}");
        assert_eq!(got.rewards, f32s("rewards"), "episode {i}");
        let actions: Vec<u32> = w["actions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(got.actions, actions, "episode {i}");
        assert_eq!(got.terminations, bools("terminations"), "episode {i}");
        assert_eq!(got.truncations, bools("truncations"), "episode {i}");
    }
    // Units 7 and 3 are named; episode 1 names none and becomes unit 8 (after the largest).
    let units: Vec<u64> = d.episodes.iter().map(|e| e.unit).collect();
    assert_eq!(units, vec![7, 8, 3]);
    assert_eq!(read.units_assigned, 1);
    // A random CartPole episode ends by termination, never by the time limit.
    assert!(d.episodes.iter().all(|e| *e.terminations.last().unwrap()));
}

#[test]
fn a_client_reads_only_its_units() {
    let dir = fixture_root().join("peer/cartpole-tiny-v0");
    let read = minari::read_units(&dir, &|u| u == 3).unwrap();
    assert_eq!(read.dataset.episodes.len(), 1);
    assert_eq!(read.dataset.episodes[0].id, 2);
    assert_eq!(read.dataset.episodes[0].unit, 3);
}

#[test]
fn counts_that_disagree_with_the_file_are_refused() {
    let (_tmp, dir) = copy();
    let meta_path = dir.join("data/metadata.json");
    let mut meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta_path).unwrap()).unwrap();
    meta["total_steps"] = (meta["total_steps"].as_u64().unwrap() + 1).into();
    std::fs::write(&meta_path, meta.to_string()).unwrap();
    let m = layout_message(minari::read(&dir).unwrap_err());
    assert!(m.contains("total_steps"), "{m}");

    // An episode group the metadata counts but the file lacks.
    let (_tmp, dir) = copy();
    let meta_path = dir.join("data/metadata.json");
    let mut meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta_path).unwrap()).unwrap();
    meta["total_episodes"] = 4.into();
    std::fs::write(&meta_path, meta.to_string()).unwrap();
    let m = layout_message(minari::read(&dir).unwrap_err());
    assert!(m.contains("episode_3"), "{m}");
}

#[test]
fn damaged_episodes_are_refused() {
    use hdf5_metno as h5;
    // An action outside Discrete(2).
    let (_tmp, dir) = copy();
    {
        let f = h5::File::open_rw(dir.join("data/main_data.hdf5")).unwrap();
        let ds = f.dataset("episode_1/actions").unwrap();
        let mut a: Vec<i64> = ds.read_raw().unwrap();
        a[0] = 5;
        ds.write_raw(&a).unwrap();
    }
    let m = layout_message(minari::read(&dir).unwrap_err());
    assert!(m.contains("action 5 outside Discrete(2)"), "{m}");

    // An episode's own step count that disagrees with its data.
    let (_tmp, dir) = copy();
    {
        let f = h5::File::open_rw(dir.join("data/main_data.hdf5")).unwrap();
        let g = f.group("episode_0").unwrap();
        g.attr("total_steps")
            .unwrap()
            .write_scalar(&1_000i64)
            .unwrap();
    }
    let m = layout_message(minari::read(&dir).unwrap_err());
    assert!(m.contains("total_steps is 1000"), "{m}");

    // A unit id that is not an unsigned integer.
    let (_tmp, dir) = copy();
    {
        let f = h5::File::open_rw(dir.join("data/main_data.hdf5")).unwrap();
        let g = f.group("episode_0").unwrap();
        g.attr("unit").unwrap().write_scalar(&-4i64).unwrap();
    }
    let m = layout_message(minari::read(&dir).unwrap_err());
    assert!(m.contains("unit is not an unsigned integer"), "{m}");

    // A missing main file.
    let (_tmp, dir) = copy();
    std::fs::remove_file(dir.join("data/main_data.hdf5")).unwrap();
    let m = layout_message(minari::read(&dir).unwrap_err());
    assert!(m.contains("missing file"), "{m}");
}
