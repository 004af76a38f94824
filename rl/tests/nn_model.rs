//! Models: layout, flatten/unflatten and stack/unstack round trips, orthogonal init,
//! safetensors round trip.

use fedrl_rl::io;
use fedrl_rl::mlp::orthogonal;
use fedrl_rl::{ActionKind, ModelSpec};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;

fn discrete() -> ModelSpec {
    ModelSpec {
        obs_dim: 4,
        action: ActionKind::Discrete { n: 2 },
        hidden: vec![8, 6],
        init_log_std: 0.0,
        obs_offset: vec![],
        obs_scale: vec![],
        action_low: vec![],
        action_high: vec![],
        action_repeat: 1,
    }
}

fn gaussian() -> ModelSpec {
    ModelSpec {
        obs_dim: 3,
        action: ActionKind::Gaussian { dim: 2 },
        hidden: vec![5],
        init_log_std: -0.5,
        obs_offset: vec![],
        obs_scale: vec![],
        action_low: vec![],
        action_high: vec![],
        action_repeat: 1,
    }
}

#[test]
fn layout_names_and_sizes() {
    let l = discrete().layout();
    let names: Vec<&str> = l.params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "policy.0.weight",
            "policy.0.bias",
            "policy.2.weight",
            "policy.2.bias",
            "policy.4.weight",
            "policy.4.bias",
            "value.0.weight",
            "value.0.bias",
            "value.2.weight",
            "value.2.bias",
            "value.4.weight",
            "value.4.bias"
        ]
    );
    assert_eq!(l.params[0].shape, vec![8, 4]);
    let policy = 8 * 4 + 8 + 6 * 8 + 6 + 2 * 6 + 2;
    assert_eq!(l.policy_len, policy);
    assert_eq!(l.len(), policy + 8 * 4 + 8 + 6 * 8 + 6 + 6 + 1);
    let g = gaussian().layout();
    assert!(
        g.params
            .iter()
            .any(|p| p.name == "policy.log_std" && p.shape == vec![2])
    );
}

#[test]
fn flatten_unflatten_round_trip() {
    for spec in [discrete(), gaussian()] {
        let l = spec.layout();
        let flat = spec.init(7);
        let named = l.unflatten(&flat).unwrap();
        assert_eq!(l.flatten(&named).unwrap(), flat);
        // Order of the named tensors does not matter; a missing one is an error.
        let mut rev = named.clone();
        rev.reverse();
        assert_eq!(l.flatten(&rev).unwrap(), flat);
        assert!(l.flatten(&named[1..]).is_err());
        assert!(l.unflatten(&flat[1..]).is_err());
    }
}

#[test]
fn stack_unstack_round_trip() {
    let spec = gaussian();
    let l = spec.layout();
    let a = spec.init(1);
    let b = spec.init(2);
    let t = l.stack(&[&a, &b], &candle_core::Device::Cpu).unwrap();
    // Weights are stored [users, in, out].
    assert_eq!(t[0].dims(), &[2, 3, 5]);
    assert_eq!(l.unstack(&t).unwrap(), vec![a, b]);
}

#[test]
fn init_is_seeded_and_gaussian_log_std_set() {
    let spec = gaussian();
    assert_eq!(spec.init(3), spec.init(3));
    assert_ne!(spec.init(3), spec.init(4));
    let l = spec.layout();
    let p = &l.params[l.log_std.unwrap()];
    assert!(
        spec.init(3)[p.offset..p.offset + 2]
            .iter()
            .all(|&x| x == -0.5)
    );
}

#[test]
fn orthogonal_rows_or_columns() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(0);
    for (r, c) in [(3, 7), (7, 3), (5, 5)] {
        let w = orthogonal(r, c, 2.0, &mut rng);
        // The shorter side is orthogonal with squared norm gain^2.
        let (k, n) = (r.min(c), r.max(c));
        let get = |i: usize, j: usize| if r <= c { w[i * c + j] } else { w[j * c + i] };
        for i in 0..k {
            for j in 0..k {
                let d: f32 = (0..n).map(|t| get(i, t) * get(j, t)).sum();
                let want = if i == j { 4.0 } else { 0.0 };
                assert!((d - want).abs() < 1e-4, "{r}x{c} ({i},{j}) {d}");
            }
        }
    }
}

#[test]
fn safetensors_round_trip() {
    let mut scaled = gaussian();
    scaled.obs_offset = vec![1.0, 2.0, 3.0];
    scaled.obs_scale = vec![0.5, 4.0, 10.0];
    scaled.action_low = vec![0.0, -2.0];
    scaled.action_high = vec![0.05, 2.0];
    for spec in [discrete(), gaussian(), scaled] {
        let flat = spec.init(11);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        io::save(&path, &spec, &flat).unwrap();
        let (spec2, flat2) = io::load(&path).unwrap();
        assert_eq!(spec2, spec);
        assert_eq!(flat2, flat);
        // Readable by the generic safetensors reader with PyTorch names and shapes.
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            st.tensor("policy.0.weight").unwrap().shape(),
            &[spec.hidden[0], spec.obs_dim]
        );
    }
    // A layout mismatch is an error, not a panic.
    let bytes = io::to_bytes(&discrete(), &discrete().init(0)).unwrap();
    assert!(io::from_bytes_with_layout(&bytes, &gaussian().layout()).is_err());
    assert!(io::from_bytes(&bytes[..bytes.len() - 3]).is_err());
    assert!(io::to_bytes(&discrete(), &[0.0; 3]).is_err());
}

#[test]
fn stack_flat_split_matches_stack() {
    let spec = discrete();
    let l = spec.layout();
    let a = spec.init(1);
    let b = spec.init(2);
    let d = candle_core::Device::Cpu;
    let theta = l.stack_flat(&[&a, &b], &d).unwrap();
    let split = l.split(&theta).unwrap();
    let stacked = l.stack(&[&a, &b], &d).unwrap();
    for (x, y) in split.iter().zip(&stacked) {
        assert_eq!(x.dims(), y.dims());
        assert_eq!(
            x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
    assert_eq!(l.unstack_flat(&theta).unwrap(), vec![a, b]);
}

#[test]
fn preprocessing_maps_and_checks() {
    let mut spec = gaussian();
    spec.obs_offset = vec![1.0, 2.0, 3.0];
    spec.obs_scale = vec![0.5, 4.0, 10.0];
    spec.action_low = vec![0.0, -2.0];
    spec.action_high = vec![0.05, 2.0];
    spec.check_preprocessing().unwrap();
    let mut obs = [2.0, 2.0, 13.0, 1.0, 6.0, 3.0];
    spec.normalize_obs(&mut obs);
    assert_eq!(obs, [2.0, 0.0, 1.0, 0.0, 1.0, 0.0]);
    let mut a = [-1.0, 0.5];
    spec.rescale_action(&mut a);
    assert_eq!(a, [0.0, 1.0]);
    // Samples beyond [-1, 1] saturate at the range's ends.
    let mut a = [7.0, -3.0];
    spec.rescale_action(&mut a);
    assert_eq!(a, [0.05, -2.0]);
    // Wrong lengths, non-positive scales, empty ranges and ranges on discrete policies fail.
    let mut bad = spec.clone();
    bad.obs_scale = vec![1.0, 0.0, 1.0];
    assert!(bad.check_preprocessing().is_err());
    let mut bad = spec.clone();
    bad.obs_offset = vec![1.0];
    assert!(bad.check_preprocessing().is_err());
    let mut bad = spec.clone();
    bad.action_high = vec![0.0, 2.0];
    assert!(bad.check_preprocessing().is_err());
    let mut bad = discrete();
    bad.action_low = vec![0.0];
    bad.action_high = vec![1.0];
    assert!(bad.check_preprocessing().is_err());
    // A spec without preprocessing leaves values alone.
    let plain = gaussian();
    let mut obs = [5.0, 6.0, 7.0];
    plain.normalize_obs(&mut obs);
    assert_eq!(obs, [5.0, 6.0, 7.0]);
}
