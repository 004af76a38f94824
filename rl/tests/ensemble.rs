//! The dynamics ensemble of PriMORL (seed 001): the NLL gradient against finite differences, the
//! ensemble clip bound after every local step (flat and per-layer), the local update against
//! hand-run SGD, the independence of trajectories trained together, the fused CPU update against
//! the batched tensor path, and the two uncertainty measures on hand-built ensembles.

use candle_core::{DType, Device};
use fedrl_common::privacy::clipping::l2_norm;
use fedrl_rl::ensemble::{
    Ensemble, EnsembleClipping, EnsembleSpec, LocalModelConfig, MAX_LOGVAR, MIN_LOGVAR, ModelRows,
    Prediction, Uncertainty, local_updates, local_updates_on_tensors, nll_and_grad,
};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

fn spec() -> EnsembleSpec {
    let mut s = EnsembleSpec::new(3, 1, vec![8, 6], 3);
    s.input_offset = vec![0.1, -0.2, 0.0, 0.5];
    s.input_scale = vec![1.0, 2.0, 0.5, 1.5];
    s
}

/// `n` random transitions of a smooth made-up system.
fn rows(spec: &EnsembleSpec, n: usize, seed: u64) -> ModelRows {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let (d, a) = (spec.obs_dim, spec.act_dim);
    let obs: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1.0..1.0)).collect();
    let act: Vec<f32> = (0..n * a).map(|_| rng.random_range(-2.0..2.0)).collect();
    let mut next = Vec::new();
    let mut rew = Vec::new();
    for t in 0..n {
        let s = &obs[t * d..(t + 1) * d];
        let u = act[t];
        next.push(s[0] + 0.1 * s[1]);
        next.push(s[1] + 0.2 * u - 0.1 * s[0].sin());
        next.push(0.9 * s[2] + 0.05 * rng.random_range(-1.0f32..1.0));
        rew.push(-(s[0] * s[0] + 0.1 * u * u));
    }
    ModelRows::from_transitions(spec, &obs, &act, &rew, &next).expect("rows")
}

#[test]
fn nll_gradient_matches_finite_differences() {
    let spec = spec();
    let params = spec.init(7);
    let data = rows(&spec, 20, 1);
    let wd = 0.01;
    let dev = Device::Cpu;
    let (f0, grad) = nll_and_grad(&spec, &params, &data, wd, DType::F64, &dev).expect("grad");
    assert!(f0.is_finite());
    // Check a spread of coordinates of every member and layer in f64 (the parameters are f32,
    // so perturb by an exactly representable step and evaluate in f64).
    let h = 1.0f32 / 1024.0;
    let stride = (spec.len() / 60).max(1);
    let mut checked = 0;
    for k in (0..spec.len()).step_by(stride) {
        let mut plus = params.clone();
        let mut minus = params.clone();
        plus[k] += h;
        minus[k] -= h;
        let fp = nll_and_grad(&spec, &plus, &data, wd, DType::F64, &dev)
            .expect("f+")
            .0;
        let fm = nll_and_grad(&spec, &minus, &data, wd, DType::F64, &dev)
            .expect("f-")
            .0;
        let fd = (fp - fm) / (2.0 * f64::from(h));
        let tol = 1e-4 * (1.0 + grad[k].abs());
        assert!(
            (fd - grad[k]).abs() < tol,
            "component {k}: finite difference {fd} vs gradient {}",
            grad[k]
        );
        checked += 1;
    }
    assert!(checked >= 50);
}

#[test]
fn the_loss_is_the_gaussian_nll_with_bounded_log_variance() {
    // All-zero parameters: mean 0 and raw log-variance 0, bounded to 0.5 - softplus(0.5) and
    // then barely moved by the lower bound; the loss is then mean_k (y_k^2 e^{-lv} + lv) per
    // member, summed over members.
    let spec = spec();
    let params = vec![0.0f32; spec.len()];
    let data = rows(&spec, 5, 2);
    let (f, _) = nll_and_grad(&spec, &params, &data, 0.0, DType::F64, &Device::Cpu).expect("f");
    let sp = |x: f64| x.max(0.0) + (-x.abs()).exp().ln_1p();
    let lv = f64::from(MAX_LOGVAR) - sp(f64::from(MAX_LOGVAR));
    let lv = f64::from(MIN_LOGVAR) + sp(lv - f64::from(MIN_LOGVAR));
    let dout = spec.out_dim();
    let per_row: f64 = data
        .targets
        .chunks(dout)
        .map(|y| {
            y.iter()
                .map(|&v| f64::from(v).powi(2) * (-lv).exp() + lv)
                .sum::<f64>()
                / dout as f64
        })
        .sum::<f64>()
        / 5.0;
    assert!((f - 3.0 * per_row).abs() < 1e-9, "{f} vs {}", 3.0 * per_row);
    // The soft bounds hold on extreme inputs: the upper one is reached as
    // MIN + softplus(MAX - MIN), a hair above MAX.
    let upper = (f64::from(MIN_LOGVAR) + sp(f64::from(MAX_LOGVAR - MIN_LOGVAR)) + 1e-6) as f32;
    let mut big = spec.init(3);
    for v in big.iter_mut() {
        *v *= 40.0;
    }
    let ens = Ensemble::new(&spec, &big, &Device::Cpu).expect("ensemble");
    let p = ens
        .predict(&[5.0, -5.0, 3.0, 9.0, 9.0, -9.0], &[10.0, -10.0])
        .expect("predict");
    for &lv in &p.logvar {
        assert!((MIN_LOGVAR..=upper).contains(&lv), "log-variance {lv}");
    }
}

fn check_bound_after_every_step(clipping: EnsembleClipping) {
    let spec = spec();
    let global = spec.init(11);
    let trajs: Vec<ModelRows> = (0..4)
        .map(|k| rows(&spec, 40 + 7 * k, 20 + k as u64))
        .collect();
    let refs: Vec<&ModelRows> = trajs.iter().collect();
    let cfg = LocalModelConfig {
        epochs: 2,
        batch_size: 8,
        lr: 0.05,
        weight_decay: 1e-4,
        clip_norm: 0.05,
        clipping,
    };
    let seeds = [1, 2, 3, 4];
    let (out, trace) =
        local_updates(&spec, &cfg, &global, &refs, &seeds, &Device::Cpu, true).expect("local");
    // 40..61 rows in batches of 8, two epochs: the longest trajectory takes 2 x 8 steps.
    assert_eq!(trace.max_ratio_per_step.len(), 16);
    for (s, r) in trace.max_ratio_per_step.iter().enumerate() {
        assert!(*r <= 1.0 + 1e-5, "step {s}: a segment is {r} x its bound");
    }
    // The bound binds (else the test would prove nothing).
    assert!(trace.max_ratio_per_step.iter().any(|r| *r > 0.999));
    let n = spec.members;
    let layers = spec.layer_sizes();
    for u in &out {
        assert_eq!(u.delta.len(), spec.len());
        let per_member = spec.member_len();
        for m in 0..n {
            let member = &u.delta[m * per_member..(m + 1) * per_member];
            match clipping {
                EnsembleClipping::Flat => {
                    assert!(l2_norm(member) <= 0.05 / (n as f64).sqrt() * (1.0 + 1e-12));
                }
                EnsembleClipping::PerLayer => {
                    let bound = 0.05 / ((n * layers.len()) as f64).sqrt();
                    let mut off = 0;
                    for size in &layers {
                        assert!(l2_norm(&member[off..off + size]) <= bound * (1.0 + 1e-12));
                        off += size;
                    }
                }
            }
        }
        assert!(l2_norm(&u.delta) <= 0.05 * (1.0 + 1e-12));
        assert!(u.first_epoch_loss.is_finite());
    }
    assert_eq!(out[0].steps, 10);
    assert_eq!(out[3].steps, 16);
}

#[test]
fn flat_ensemble_clip_holds_after_every_local_step() {
    check_bound_after_every_step(EnsembleClipping::Flat);
}

#[test]
fn per_layer_ensemble_clip_holds_after_every_local_step() {
    check_bound_after_every_step(EnsembleClipping::PerLayer);
}

#[test]
fn one_full_batch_step_is_one_sgd_step_on_the_nll() {
    let spec = spec();
    let global = spec.init(5);
    let data = rows(&spec, 24, 9);
    let cfg = LocalModelConfig {
        epochs: 1,
        batch_size: 24,
        lr: 1e-3,
        weight_decay: 1e-3,
        clip_norm: 1e6,
        clipping: EnsembleClipping::Flat,
    };
    let (out, _) =
        local_updates(&spec, &cfg, &global, &[&data], &[0], &Device::Cpu, false).expect("local");
    let (_, grad) = nll_and_grad(&spec, &global, &data, 1e-3, DType::F64, &Device::Cpu).expect("g");
    for (k, (d, g)) in out[0].delta.iter().zip(&grad).enumerate() {
        let want = -1e-3 * g;
        assert!(
            (f64::from(*d) - want).abs() < 1e-6 * (1.0 + want.abs() * 1e3),
            "component {k}: delta {d} vs -lr grad {want}"
        );
    }
}

#[test]
fn trajectories_trained_together_equal_trained_alone() {
    let spec = spec();
    let global = spec.init(8);
    let a = rows(&spec, 33, 40);
    let b = rows(&spec, 17, 41);
    let cfg = LocalModelConfig {
        clip_norm: 0.3,
        lr: 0.01,
        ..LocalModelConfig::default()
    };
    let dev = Device::Cpu;
    let (both, _) =
        local_updates(&spec, &cfg, &global, &[&a, &b], &[1, 2], &dev, false).expect("both");
    let (alone_a, _) = local_updates(&spec, &cfg, &global, &[&a], &[1], &dev, false).expect("a");
    let (alone_b, _) = local_updates(&spec, &cfg, &global, &[&b], &[2], &dev, false).expect("b");
    for (x, y) in both[0].delta.iter().zip(&alone_a[0].delta) {
        assert!((x - y).abs() < 1e-6, "{x} vs {y}");
    }
    for (x, y) in both[1].delta.iter().zip(&alone_b[0].delta) {
        assert!((x - y).abs() < 1e-6, "{x} vs {y}");
    }
}

/// The fused CPU loop and the batched tensor path train the same copies: equal up to f32
/// rounding after many steps, with the projection binding, weight decay, a short last
/// minibatch and trajectories of different lengths.
fn fused_equals_tensor_path(clipping: EnsembleClipping, clip_norm: f64) {
    let spec = spec();
    let global = spec.init(3);
    let trajs: Vec<ModelRows> = (0..3)
        .map(|k| rows(&spec, 30 + 11 * k, 60 + k as u64))
        .collect();
    let refs: Vec<&ModelRows> = trajs.iter().collect();
    let cfg = LocalModelConfig {
        epochs: 2,
        batch_size: 8,
        lr: 0.03,
        weight_decay: 1e-3,
        clip_norm,
        clipping,
    };
    let seeds = [7, 8, 9];
    let dev = Device::Cpu;
    let (fused, ft) = local_updates(&spec, &cfg, &global, &refs, &seeds, &dev, true).expect("f");
    let (tensor, tt) =
        local_updates_on_tensors(&spec, &cfg, &global, &refs, &seeds, &dev, true).expect("t");
    assert_eq!(ft.max_ratio_per_step.len(), tt.max_ratio_per_step.len());
    for (a, b) in ft.max_ratio_per_step.iter().zip(&tt.max_ratio_per_step) {
        assert!((a - b).abs() < 1e-4, "trace {a} vs {b}");
    }
    let mut moved = 0.0f64;
    for (f, t) in fused.iter().zip(&tensor) {
        assert_eq!(f.steps, t.steps);
        let rel = (f.first_epoch_loss - t.first_epoch_loss).abs() / t.first_epoch_loss.abs();
        assert!(
            rel < 1e-5,
            "first-epoch loss {} vs {}",
            f.first_epoch_loss,
            t.first_epoch_loss
        );
        let diff: Vec<f32> = f.delta.iter().zip(&t.delta).map(|(a, b)| a - b).collect();
        assert!(
            l2_norm(&diff) <= 1e-4 * l2_norm(&t.delta),
            "delta differs by {} of {}",
            l2_norm(&diff),
            l2_norm(&t.delta)
        );
        moved += l2_norm(&t.delta);
    }
    assert!(moved > 0.0);
}

#[test]
fn fused_cpu_update_equals_the_tensor_path_flat() {
    fused_equals_tensor_path(EnsembleClipping::Flat, 0.05);
}

#[test]
fn fused_cpu_update_equals_the_tensor_path_per_layer() {
    fused_equals_tensor_path(EnsembleClipping::PerLayer, 0.05);
}

#[test]
fn fused_cpu_update_equals_the_tensor_path_unclipped() {
    fused_equals_tensor_path(EnsembleClipping::Flat, f64::INFINITY);
}

#[test]
fn uncertainty_measures_on_a_hand_built_ensemble() {
    // Three members, two rows, out_dim 2.
    let mean = vec![
        0.0, 0.0, 1.0, 1.0, // member 0: rows 0 and 1
        3.0, 4.0, 1.0, 1.0, // member 1
        0.0, 1.0, 1.0, 2.0, // member 2
    ];
    let ln = |v: f64| v.ln() as f32;
    let logvar = vec![
        ln(1.0),
        ln(1.0),
        ln(0.25),
        ln(0.25), // sigma = (1, 1), (0.5, 0.5)
        ln(4.0),
        ln(0.0009),
        ln(0.01),
        ln(0.01), // (2, 0.03), (0.1, 0.1)
        ln(0.09),
        ln(0.16),
        ln(1.0),
        ln(1.0), // (0.3, 0.4), (1, 1)
    ];
    let p = Prediction {
        members: 3,
        rows: 2,
        out_dim: 2,
        mean,
        logvar,
    };
    let ma = p.uncertainty(Uncertainty::MaxAleatoric);
    // Row 0: max(|(1, 1)|, |(2, 0.03)|, |(0.3, 0.4)|) = sqrt(4.0009); row 1: sqrt(2).
    assert!((ma[0] - 4.0009f64.sqrt()).abs() < 1e-5, "{}", ma[0]);
    assert!((ma[1] - 2f64.sqrt()).abs() < 1e-5, "{}", ma[1]);
    let mpd = p.uncertainty(Uncertainty::MaxPairwiseDiff);
    // Row 0: |(3, 4)| = 5 between members 0 and 1; row 1: |(0, 1)| = 1.
    assert!((mpd[0] - 5.0).abs() < 1e-9);
    assert!((mpd[1] - 1.0).abs() < 1e-9);
    // Component 0 counted in units of 2, component 1 in units of 0.5.
    let scale = [2.0f32, 0.5];
    let ma = p.uncertainty_scaled(Uncertainty::MaxAleatoric, &scale);
    // Row 0: max(|(0.5, 2)|, |(1, 0.06)|, |(0.15, 0.8)|) = sqrt(4.25); row 1: sqrt(4.25).
    assert!((ma[0] - 4.25f64.sqrt()).abs() < 1e-5, "{}", ma[0]);
    assert!((ma[1] - 4.25f64.sqrt()).abs() < 1e-5, "{}", ma[1]);
    let mpd = p.uncertainty_scaled(Uncertainty::MaxPairwiseDiff, &scale);
    // Row 0: |(3/2, 4/0.5)| = sqrt(66.25) between members 0 and 1; row 1: |(0, 2)| = 2.
    assert!((mpd[0] - 66.25f64.sqrt()).abs() < 1e-5, "{}", mpd[0]);
    assert!((mpd[1] - 2.0).abs() < 1e-5, "{}", mpd[1]);
}

#[test]
fn the_model_step_penalises_the_reward_by_lambda_u() {
    let spec = spec();
    let params = spec.init(2);
    let ens = Ensemble::new(&spec, &params, &Device::Cpu).expect("ensemble");
    let obs = [0.1f32, 0.2, 0.3, -0.5, 0.0, 0.4];
    let act = [0.5f32, -1.0];
    let mut r1 = Xoshiro256PlusPlus::seed_from_u64(4);
    let mut r2 = Xoshiro256PlusPlus::seed_from_u64(4);
    let plain = ens
        .step(
            &obs,
            &act,
            Uncertainty::MaxPairwiseDiff,
            false,
            0.0,
            &mut r1,
        )
        .expect("step");
    let pess = ens
        .step(
            &obs,
            &act,
            Uncertainty::MaxPairwiseDiff,
            false,
            2.0,
            &mut r2,
        )
        .expect("step");
    assert_eq!(plain.next_obs, pess.next_obs);
    for r in 0..2 {
        let want = f64::from(plain.reward[r]) - 2.0 * pess.uncertainty[r];
        assert!((f64::from(pess.reward[r]) - want).abs() < 1e-5);
        assert!(pess.uncertainty[r] > 0.0);
    }
}

#[test]
fn normalised_targets_are_learned_scaled_and_answered_in_raw_units() {
    let raw_spec = spec();
    let mut scaled = spec();
    scaled.output_scale = vec![0.5, 4.0, 0.01, 2.0];
    scaled.check().expect("valid scales");
    let raw = rows(&raw_spec, 20, 3);
    let norm = rows(&scaled, 20, 3);
    assert_eq!(raw.inputs, norm.inputs);
    for (i, (r, n)) in raw.targets.iter().zip(&norm.targets).enumerate() {
        let s = scaled.output_scale[i % 4];
        assert!(
            (r / s - n).abs() <= 1e-6 * (r / s).abs().max(1.0),
            "{r} / {s} vs {n}"
        );
    }
    // The same weights answer in raw units: means times the scale, log-variances plus 2 ln s
    // (before MOPO's soft bounds, which act on what the members output).
    let params = raw_spec.init(9);
    let a = Ensemble::new(&raw_spec, &params, &Device::Cpu).expect("ensemble");
    let b = Ensemble::new(&scaled, &params, &Device::Cpu).expect("ensemble");
    let obs = [0.3f32, -0.4, 0.8, -0.1, 0.2, 0.5];
    let act = [1.0f32, -0.5];
    let (pa, pb) = (
        a.predict(&obs, &act).expect("a"),
        b.predict(&obs, &act).expect("b"),
    );
    for m in 0..pa.members {
        for r in 0..pa.rows {
            for k in 0..4 {
                let s = scaled.output_scale[k];
                let (ma, mb) = (pa.mean_of(m, r)[k], pb.mean_of(m, r)[k]);
                assert!((ma * s - mb).abs() <= 1e-5 * (ma * s).abs().max(1e-3));
                let (la, lb) = (pa.logvar_of(m, r)[k], pb.logvar_of(m, r)[k]);
                assert!((la + 2.0 * s.ln() - lb).abs() <= 1e-4);
            }
        }
    }
    // The early-stopping MSE is measured in the learned (scaled) units.
    let mse_raw = a.mse(&raw).expect("mse");
    let mse_norm = b.mse(&norm).expect("mse");
    assert!(mse_raw.is_finite() && mse_norm.is_finite() && mse_raw != mse_norm);
    let mut bad = spec();
    bad.output_scale = vec![1.0, 0.0, 1.0, 1.0];
    assert!(bad.check().is_err());
    bad.output_scale = vec![1.0; 3];
    assert!(bad.check().is_err());
}

#[test]
fn the_public_mse_in_chunks_equals_one_pass() {
    let spec = spec();
    let ens = Ensemble::new(&spec, &spec.init(4), &Device::Cpu).expect("ensemble");
    let data = rows(&spec, 50, 8);
    // One pass over all 50 rows, by hand, against the chunked evaluation at several sizes
    // (50 is not a multiple of 7 or 16: the last chunk is short).
    let p = ens.predict_rows(&data).expect("prediction");
    let dout = spec.out_dim();
    let mut sum = 0.0f64;
    for i in 0..p.members {
        for r in 0..p.rows {
            for (m, t) in p.mean_of(i, r).iter().zip(&data.targets[r * dout..]) {
                sum += (f64::from(*m) - f64::from(*t)).powi(2);
            }
        }
    }
    let whole = sum / (p.members * p.rows * dout) as f64;
    for chunk in [1, 7, 16, 50, 1000] {
        let m = ens.mse_in_chunks(&data, chunk).expect("mse");
        assert!(
            (m - whole).abs() <= 1e-12 * whole,
            "chunk {chunk}: {m} vs {whole}"
        );
    }
    assert!((ens.mse(&data).expect("mse") - whole).abs() <= 1e-12 * whole);
    assert!(ens.mse_in_chunks(&data, 0).is_err());
}
