//! Tests of PrivORL's diffusion synthesizer (`fedrl_rl::diffusion`) and the fidelity metrics
//! (`fedrl_rl::fidelity`): EDM preconditioning and loss by hand, the sampler on a 1-D Gaussian
//! mixture, curiosity's batch replacement, public-only normalisation, and the fidelity scores
//! against scipy.
//!
//! `cargo test -p fedrl-rl --test diffusion` (about 30 s in the dev profile on the shared 2-core
//! machine, most of it the mixture test: 1,000 training steps and 2,000 samples of 255 network
//! calls; with `RAYON_NUM_THREADS=1` it is about twice as fast there).

use fedrl_rl::candle_core::{Device, Tensor};
use fedrl_rl::diffusion::curiosity::{novel_count, replace_with_most_novel};
use fedrl_rl::diffusion::edm::{self, EdmConfig};
use fedrl_rl::diffusion::{
    ActionCoding, Actions, Denoiser, DenoiserConfig, DenoiserSpec, DiffusionModel, EmaConfig,
    PublicRows, SynthesizerConfig, TrainConfig, TransitionLayout, TransitionSynthesizer,
    Transitions, Weights,
};
use fedrl_rl::fidelity;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand_distr::{Distribution, Normal, StandardNormal};

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol
}

#[test]
fn preconditioning_matches_table_1_by_hand() {
    let cfg = EdmConfig::default();
    // sigma = 0.5, sigma_data = 1: s^2 + sd^2 = 1.25.
    let p = cfg.precond(0.5);
    assert!(close(p.c_skip, 1.0 / 1.25, 1e-15));
    assert!(close(p.c_out, 0.5 / 1.25f64.sqrt(), 1e-15));
    assert!(close(p.c_in, 1.0 / 1.25f64.sqrt(), 1e-15));
    assert!(close(p.c_noise, -0.173_286_795_139_986_3, 1e-15)); // ln(0.5) / 4
    assert!(close(cfg.loss_weight(0.5), 5.0, 1e-12)); // 1.25 / 0.25
    // sigma = 2, sigma_data = 0.5: s^2 + sd^2 = 4.25.
    let cfg2 = EdmConfig {
        sigma_data: 0.5,
        ..cfg
    };
    let p = cfg2.precond(2.0);
    assert!(close(p.c_skip, 0.25 / 4.25, 1e-15));
    assert!(close(p.c_out, 1.0 / 4.25f64.sqrt(), 1e-15));
    assert!(close(p.c_in, 1.0 / 4.25f64.sqrt(), 1e-15));
    assert!(close(cfg2.loss_weight(2.0), 4.25 / 1.0, 1e-12)); // 4.25 / (2 * 0.5)^2
    // The schedule: 128 levels from 80 down to 0.002, then 0; churn sqrt(2) - 1 inside
    // [0.05, 50] (80 / 128 = 0.625 is larger), none outside.
    let s = cfg.schedule();
    assert_eq!(s.len(), 129);
    assert!(close(s[0], 80.0, 1e-9) && close(s[127], 0.002, 1e-12) && s[128] == 0.0);
    assert!(s.windows(2).all(|w| w[0] > w[1]));
    assert!(close(cfg.gamma(1.0), std::f64::consts::SQRT_2 - 1.0, 1e-15));
    assert_eq!(cfg.gamma(60.0), 0.0);
    assert_eq!(cfg.gamma(0.01), 0.0);
}

fn small_spec(data_dim: usize) -> DenoiserSpec {
    DenoiserSpec {
        data_dim,
        config: DenoiserConfig {
            width: 16,
            blocks: 2,
            dim_t: 8,
            fourier_dim: 4,
        },
    }
}

#[test]
fn denoised_estimate_and_loss_by_hand() {
    let dev = Device::Cpu;
    let spec = small_spec(2);
    let (mut flat, freqs) = spec.init(7).unwrap();
    let net = Denoiser::new(spec, &freqs, &dev).unwrap();
    let cfg = EdmConfig::default();

    // D(x, s) = c_skip x + c_out F(c_in x, c_noise): checked against the network called by hand.
    let params = net.tensors_from_flat(&flat).unwrap();
    let x = Tensor::new(&[[0.7f32, -1.1]], &dev).unwrap();
    let d = edm::denoise(&cfg, &net, &params, &x, &[0.5]).unwrap();
    let c_in = 1.0 / 1.25f64.sqrt();
    let f = net
        .forward(
            &params,
            &(&x * c_in).unwrap(),
            &Tensor::new(&[(0.5f64.ln() / 4.0) as f32], &dev).unwrap(),
        )
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let d = d.to_vec2::<f32>().unwrap();
    for j in 0..2 {
        let x_j = [0.7, -1.1][j];
        let want = 0.8 * x_j + 0.5 / 1.25f64.sqrt() * f64::from(f[0][j]);
        assert!(
            close(f64::from(d[0][j]), want, 1e-5),
            "{j}: {} vs {want}",
            d[0][j]
        );
    }

    // A network whose output layer is zero but for its bias b outputs b everywhere, so the loss
    // is a hand computation. The output layer is the last weight and bias of the flat vector.
    let n = flat.len();
    let (w_len, b_len) = (2 * 16, 2);
    for v in &mut flat[n - w_len - b_len..n - b_len] {
        *v = 0.0;
    }
    flat[n - 2] = 0.3;
    flat[n - 1] = -0.4;
    let params = net.tensors_from_flat(&flat).unwrap();
    let x0 = Tensor::new(&[[1.0f32, -2.0], [0.5, 0.0]], &dev).unwrap();
    let noise = Tensor::new(&[[0.1f32, 0.2], [-1.0, 0.5]], &dev).unwrap();
    let losses = edm::per_example_loss(&cfg, &net, &params, &x0, &[0.5, 2.0], &noise)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    // Row 1, sigma 0.5: x~ = (1.05, -1.9); D = 0.8 x~ + (0.5/sqrt 1.25)(0.3, -0.4)
    //   = (0.974164, -1.698885); weight 5; 5 * mean((-0.025836)^2, (0.301115)^2) = 0.228344.
    // Row 2, sigma 2: x~ = (-1.5, 1.0); D = 0.2 x~ + (2/sqrt 5)(0.3, -0.4) = (-0.031672, -0.157771);
    //   weight 1.25; 1.25 * mean((-0.531672)^2, (-0.157771)^2) = 0.192229.
    assert!(
        close(f64::from(losses[0]), 0.228_343_685_4, 2e-6),
        "{losses:?}"
    );
    assert!(
        close(f64::from(losses[1]), 0.192_229_123_6, 2e-6),
        "{losses:?}"
    );
}

#[test]
fn flat_parameters_round_trip_in_pytorch_layout() {
    let spec = small_spec(3);
    let (flat, freqs) = spec.init(1).unwrap();
    let net = Denoiser::new(spec, &freqs, &Device::Cpu).unwrap();
    let params = net.tensors_from_flat(&flat).unwrap();
    assert_eq!(net.flat_from_tensors(&params).unwrap(), flat);
    // proj.weight is [dim_t, data_dim] in the flat layout, [data_dim, dim_t] inside.
    assert_eq!(params[0].dims(), &[3, 8]);
    assert_eq!(spec.param_shapes()[0].shape, vec![8, 3]);
    assert_eq!(spec.param_shapes()[0].name, "proj.weight");
    // The paper's size: width 1024, 6 blocks, about 6 million parameters (appendix F-A).
    let paper = DenoiserSpec {
        data_dim: 11,
        config: DenoiserConfig {
            width: 1024,
            blocks: 6,
            ..DenoiserConfig::default()
        },
    };
    let p = paper.num_params();
    assert!((6_000_000..7_000_000).contains(&p), "{p}");
}

#[test]
fn curiosity_replaces_exactly_its_share_with_the_most_novel() {
    let dim = 2;
    // Ten real rows (values 100 + i) and six candidates with known scores.
    let mut batch: Vec<f32> = (0..10).flat_map(|i| [100.0 + i as f32, -1.0]).collect();
    let before = batch.clone();
    let candidates: Vec<f32> = (0..6).flat_map(|c| [c as f32, 50.0 + c as f32]).collect();
    let scores = [0.5f32, 3.0, 0.1, 2.0, 3.0, 1.0];
    let k = replace_with_most_novel(&mut batch, dim, &candidates, &scores, 0.3).unwrap();
    assert_eq!(k, 3, "floor(0.3 * 10)");
    // The first seven rows are untouched; the last three are candidates 1, 4 (tie at 3.0, in
    // candidate order) and 3 (score 2.0).
    assert_eq!(&batch[..14], &before[..14]);
    assert_eq!(&batch[14..], &[1.0, 51.0, 4.0, 54.0, 3.0, 53.0]);

    // The share is floor(r B) for any batch, capped by the candidates.
    assert_eq!(novel_count(128, 0.3), 38);
    assert_eq!(novel_count(100, 0.29), 29);
    assert_eq!(novel_count(7, 0.0), 0);
    assert_eq!(novel_count(7, 1.0), 7);
    let mut b2: Vec<f32> = vec![9.0; 2 * 128];
    let k = replace_with_most_novel(&mut b2, dim, &candidates, &scores, 1.0).unwrap();
    assert_eq!(k, 6);
    assert_eq!(b2.iter().filter(|&&v| v == 9.0).count(), 2 * 122);
    // Rate 0: nothing changes.
    let mut b3 = before.clone();
    assert_eq!(
        replace_with_most_novel(&mut b3, dim, &candidates, &scores, 0.0).unwrap(),
        0
    );
    assert_eq!(b3, before);
    assert!(replace_with_most_novel(&mut b3, dim, &candidates, &scores[..5], 0.3).is_err());
}

fn cartpole_layout() -> TransitionLayout {
    TransitionLayout {
        obs_dim: 4,
        action: ActionCoding::Discrete { n: 2 },
        model_terminal: true,
    }
}

/// `n` made-up CartPole-shaped transitions around `center`.
fn transitions(n: usize, center: f32, seed: u64) -> Transitions {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let normal = Normal::new(center, 0.5).unwrap();
    let obs: Vec<f32> = (0..4 * n).map(|_| normal.sample(&mut rng)).collect();
    let next_obs: Vec<f32> = obs.iter().map(|o| o + 0.01).collect();
    Transitions {
        obs_dim: 4,
        obs,
        actions: Actions::Discrete((0..n as u32).map(|i| i % 2).collect()),
        rewards: vec![1.0; n],
        next_obs,
        terminals: (0..n)
            .map(|i| if i % 10 == 9 { 1.0 } else { 0.0 })
            .collect(),
    }
}

#[test]
fn normalisation_uses_public_data_only() {
    let layout = cartpole_layout();
    let public_t = transitions(400, 0.0, 1);
    let sensitive_t = transitions(400, 10.0, 2);
    let public = PublicRows::new(layout.dim(), layout.encode(&public_t).unwrap()).unwrap();
    let cfg = SynthesizerConfig {
        denoiser: small_spec(layout.dim()).config,
        ..SynthesizerConfig::default()
    };
    let mut synth = TransitionSynthesizer::new(layout, &public, cfg, 3, &Device::Cpu).unwrap();
    let fitted = synth.normalizer().clone();
    // The statistics are the public data's: observation means near 0, not near 10.
    for j in 0..4 {
        assert!(fitted.mean[j].abs() < 0.2, "{:?}", fitted.mean);
        assert!((fitted.scale[j] - 0.5).abs() < 0.1, "{:?}", fitted.scale);
    }
    // One-hot and terminal entries are left as they are; the constant reward is only centred.
    assert_eq!((fitted.mean[4], fitted.scale[4]), (0.0, 1.0));
    assert_eq!((fitted.mean[5], fitted.scale[5]), (0.0, 1.0));
    assert_eq!((fitted.mean[11], fitted.scale[11]), (0.0, 1.0));
    assert_eq!((fitted.mean[6], fitted.scale[6]), (1.0, 1.0));
    // Sensitive rows are normalised with the public statistics (so they sit near 10 / 0.5, not near 0),
    // and training on them leaves the normaliser unchanged.
    let rows = synth.encode(&sensitive_t).unwrap();
    let mean0 = rows.chunks_exact(12).map(|r| f64::from(r[0])).sum::<f64>() / 400.0;
    let want = (10.0 - f64::from(fitted.mean[0])) / f64::from(fitted.scale[0]);
    assert!(want > 15.0 && close(mean0, want, 0.5), "{mean0} vs {want}");
    synth.model_mut().train_step(&rows[..12 * 64]).unwrap();
    assert_eq!(synth.normalizer(), &fitted);
    // Public rows must fit the layout.
    assert!(PublicRows::new(12, vec![0.0; 13]).is_err());
    let wrong = PublicRows::new(5, vec![0.0; 10]).unwrap();
    assert!(TransitionSynthesizer::new(layout, &wrong, cfg, 3, &Device::Cpu).is_err());
}

/// The mixture `0.3 N(-2, 0.3^2) + 0.7 N(1, 0.3^2)`: mean 0.1, variance 1.98.
fn mixture(n: usize, rng: &mut Xoshiro256PlusPlus) -> Vec<f32> {
    use rand::RngExt;
    (0..n)
        .map(|_| {
            let z: f64 = StandardNormal.sample(rng);
            let m = if rng.random::<f64>() < 0.3 { -2.0 } else { 1.0 };
            (m + 0.3 * z) as f32
        })
        .collect()
}

#[test]
fn heun_samples_recover_a_gaussian_mixture() {
    let (mean, var) = (0.1f64, 1.98f64);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(11);
    // Normalised with the mixture's own moments, as the public normaliser would.
    let data: Vec<f32> = mixture(20_000, &mut rng)
        .into_iter()
        .map(|x| ((f64::from(x) - mean) / var.sqrt()) as f32)
        .collect();
    let cfg = SynthesizerConfig {
        denoiser: DenoiserConfig {
            width: 64,
            blocks: 2,
            ..DenoiserConfig::default()
        },
        train: TrainConfig {
            lr: 1e-3,
            batch_size: 256,
            ema: EmaConfig {
                beta: 0.99,
                update_every: 1,
                ..EmaConfig::default()
            },
            ..TrainConfig::default()
        },
        ..SynthesizerConfig::default()
    };
    let mut model = DiffusionModel::new(1, cfg, 5, &Device::Cpu).unwrap();
    let t0 = std::time::Instant::now();
    let steps = 1000;
    for s in 0..steps {
        let at = (s * 256) % (data.len() - 256);
        model.train_step(&data[at..at + 256]).unwrap();
    }
    let t1 = std::time::Instant::now();
    let n = 2000;
    let xs: Vec<f64> = model
        .sample_normalized(n, Weights::Ema)
        .unwrap()
        .into_iter()
        .map(|z| f64::from(z) * var.sqrt() + mean)
        .collect();
    let m = xs.iter().sum::<f64>() / n as f64;
    let v = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1) as f64;
    let low = xs.iter().filter(|&&x| x < -0.5).count() as f64 / n as f64;
    eprintln!(
        "mixture: training {:.1} s, sampling {:.1} s; mean {m:.3}, variance {v:.3}, lower mode {low:.3}",
        (t1 - t0).as_secs_f64(),
        t1.elapsed().as_secs_f64()
    );
    assert!(close(m, mean, 0.12), "mean {m}");
    assert!(close(v, var, 0.2 * var), "variance {v}");
    assert!(close(low, 0.3, 0.05), "share of the lower mode {low}");
}

#[derive(serde::Deserialize)]
struct FixtureFile {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    dim: usize,
    real: Vec<f32>,
    synthetic: Vec<f32>,
    expected: Expected,
}

#[derive(serde::Deserialize)]
struct Expected {
    ks: Vec<f64>,
    marginal: f64,
    correlation: Option<f64>,
    undefined_pairs: usize,
}

/// The fixture `fixtures/fidelity_scipy.json` was generated once with
/// `/tmp/pv/bin/python rl/tests/fixtures/make_fidelity_fixture.py` (scipy 1.17.1, numpy; the
/// script's doc says how): `scipy.stats.ks_2samp(...).statistic` per column and
/// `scipy.stats.spearmanr` per pair.
#[test]
fn fidelity_matches_scipy() {
    let text = include_str!("fixtures/fidelity_scipy.json");
    let file: FixtureFile = serde_json::from_str(text).unwrap();
    assert_eq!(file.cases.len(), 3);
    for c in &file.cases {
        let f = fidelity::fidelity(&c.real, &c.synthetic, c.dim).unwrap();
        for (j, want) in c.expected.ks.iter().enumerate() {
            let col = |t: &[f32]| -> Vec<f64> {
                t.chunks_exact(c.dim).map(|r| f64::from(r[j])).collect()
            };
            let got = fidelity::ks_statistic(&col(&c.real), &col(&c.synthetic));
            assert!(
                close(got, *want, 1e-12),
                "{} ks[{j}]: {got} vs {want}",
                c.name
            );
        }
        assert!(close(f.marginal, c.expected.marginal, 1e-12), "{}", c.name);
        match (f.correlation, c.expected.correlation) {
            (Some(a), Some(b)) => assert!(close(a, b, 1e-9), "{}: {a} vs {b}", c.name),
            (a, b) => assert_eq!(a, b, "{}", c.name),
        }
        assert_eq!(f.undefined_pairs, c.expected.undefined_pairs, "{}", c.name);
    }
}

#[test]
fn rnd_scores_what_it_has_learned_lower() {
    use fedrl_rl::diffusion::{CuriosityConfig, Rnd};
    let cfg = CuriosityConfig {
        rnd_batch: 16,
        rnd_lr: 1e-2,
        ..CuriosityConfig::default()
    };
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(4);
    let normal = Normal::new(0.0f32, 0.3).unwrap();
    let seen: Vec<f32> = (0..3 * 200).map(|_| normal.sample(&mut rng)).collect();
    let novel: Vec<f32> = (0..3 * 200)
        .map(|_| 3.0 + normal.sample(&mut rng))
        .collect();
    let mut rnd = Rnd::new(3, &cfg, 9, &Device::Cpu).unwrap();
    let mean = |v: Vec<f32>| v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
    let before = mean(rnd.score(&seen).unwrap());
    for _ in 0..20 {
        rnd.learn(&seen).unwrap();
    }
    let (s, n) = (
        mean(rnd.score(&seen).unwrap()),
        mean(rnd.score(&novel).unwrap()),
    );
    assert!(
        s < 0.5 * before,
        "the predictor learned the seen rows: {before} -> {s}"
    );
    assert!(n > 2.0 * s, "novel rows score higher: {n} vs {s}");
}

#[test]
fn pretraining_mixes_the_configured_share_and_can_turn_curiosity_off() {
    use fedrl_rl::diffusion::{CuriosityConfig, PretrainConfig, pretrain};
    let layout = cartpole_layout();
    let public_t = transitions(300, 0.0, 5);
    let public = PublicRows::new(layout.dim(), layout.encode(&public_t).unwrap()).unwrap();
    let cfg = SynthesizerConfig {
        denoiser: small_spec(layout.dim()).config,
        ..SynthesizerConfig::default()
    };
    for enabled in [true, false] {
        let mut synth = TransitionSynthesizer::new(layout, &public, cfg, 3, &Device::Cpu).unwrap();
        let pre = PretrainConfig {
            epochs: 2,
            curiosity: CuriosityConfig {
                enabled,
                pool_size: 50,
                ..CuriosityConfig::default()
            },
        };
        let mut seen = 0;
        let reports = pretrain(&mut synth, &public, &pre, 1, &mut |_| seen += 1).unwrap();
        assert_eq!(seen, 2);
        assert_eq!(
            synth.model().steps(),
            6,
            "batches of 128, 128 and 44, twice"
        );
        for r in &reports {
            assert_eq!(r.steps, 3);
            assert!(r.mean_loss.is_finite());
            if enabled {
                // floor(0.3 * 128) twice and floor(0.3 * 44), each capped by the 50 candidates.
                assert_eq!(r.novel_rows, 38 + 38 + 13);
                assert!(r.pool_max_score.unwrap() >= r.pool_mean_score.unwrap());
            } else {
                assert_eq!(r.novel_rows, 0);
                assert_eq!(r.pool_mean_score, None);
            }
        }
        // Released samples decode into valid transitions.
        let out = synth.sample(20).unwrap();
        assert_eq!(out.len(), 20);
        match &out.actions {
            Actions::Discrete(a) => assert!(a.iter().all(|&x| x < 2)),
            _ => panic!("discrete layout"),
        }
        assert!(out.terminals.iter().all(|&t| t == 0.0 || t == 1.0));
    }
}

#[test]
fn a_saved_synthesizer_reads_back_with_its_weights_and_normaliser() {
    let layout = cartpole_layout();
    let public_t = transitions(200, 0.0, 6);
    let public = PublicRows::new(layout.dim(), layout.encode(&public_t).unwrap()).unwrap();
    let cfg = SynthesizerConfig {
        denoiser: small_spec(layout.dim()).config,
        ..SynthesizerConfig::default()
    };
    let mut synth = TransitionSynthesizer::new(layout, &public, cfg, 3, &Device::Cpu).unwrap();
    let rows = synth.encode_public(&public).unwrap();
    for k in 0..15 {
        synth
            .model_mut()
            .train_step(&rows[k * 12..(k + 64) * 12])
            .unwrap();
    }
    let bytes = synth.to_bytes().unwrap();
    let back = TransitionSynthesizer::from_bytes(&bytes, 8, &Device::Cpu).unwrap();
    assert_eq!(back.layout(), synth.layout());
    assert_eq!(back.normalizer(), synth.normalizer());
    assert_eq!(back.model().config(), synth.model().config());
    assert_eq!(
        back.model().online_flat().unwrap(),
        synth.model().online_flat().unwrap()
    );
    assert_eq!(
        back.model().ema_flat().unwrap(),
        synth.model().ema_flat().unwrap()
    );
    assert_ne!(
        back.model().ema_flat().unwrap(),
        back.model().online_flat().unwrap()
    );
    assert_eq!(
        back.model().denoiser().freqs().unwrap(),
        synth.model().denoiser().freqs().unwrap()
    );
    assert!(TransitionSynthesizer::from_bytes(&bytes[..bytes.len() / 2], 8, &Device::Cpu).is_err());
}
