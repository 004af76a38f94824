//! The membership-inference audit (`fedrl_rl::audit::membership`) on real models: the
//! denoising-loss attack detects the members of a deliberately over-fitted, non-private
//! diffusion model (a tiny training set, many full-batch steps), and is near chance against a
//! model trained on independent data from the same distribution.
//!
//! `cargo test -p fedrl-rl --test membership` (a few seconds in the dev profile).

use fedrl_rl::audit::{AttackConfig, MembershipReport, denoising_loss_scores};
use fedrl_rl::candle_core::Device;
use fedrl_rl::diffusion::{DenoiserConfig, DiffusionModel, SynthesizerConfig, TrainConfig};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand_distr::{Distribution, StandardNormal};

const DIM: usize = 4;
const N: usize = 40;
const STEPS: usize = 700;

fn normal_rows(n: usize, rng: &mut Xoshiro256PlusPlus) -> Vec<f32> {
    (0..n * DIM).map(|_| StandardNormal.sample(rng)).collect()
}

/// A non-private model trained full-batch on `rows` for `STEPS` steps.
fn overfit(rows: &[f32], seed: u64) -> DiffusionModel {
    let cfg = SynthesizerConfig {
        denoiser: DenoiserConfig {
            width: 128,
            blocks: 2,
            dim_t: 32,
            fourier_dim: 16,
        },
        train: TrainConfig {
            lr: 2e-3,
            grad_clip: None,
            ..TrainConfig::default()
        },
        ..SynthesizerConfig::default()
    };
    let mut m = DiffusionModel::new(DIM, cfg, seed, &Device::Cpu).unwrap();
    for _ in 0..STEPS {
        m.train_step(rows).unwrap();
    }
    m
}

fn report(m: &DiffusionModel, members: &[f32], non_members: &[f32]) -> MembershipReport {
    let cfg = AttackConfig::default();
    let edm = &m.config().edm;
    let params = m.online_params();
    let a = denoising_loss_scores(edm, m.denoiser(), &params, members, &cfg).unwrap();
    let b = denoising_loss_scores(edm, m.denoiser(), &params, non_members, &cfg).unwrap();
    MembershipReport::new(&a, &b).unwrap()
}

#[test]
fn the_attack_finds_an_overfitted_models_members_and_not_an_independent_ones() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(56);
    let members = normal_rows(N, &mut rng);
    let non_members = normal_rows(N, &mut rng);
    let independent = normal_rows(N, &mut rng);
    let t = std::time::Instant::now();
    let m = overfit(&members, 1);
    let r = report(&m, &members, &non_members);
    eprintln!("over-fitted: {r:?} ({:.1} s)", t.elapsed().as_secs_f64());
    assert!(r.tpr_at_10pct_fpr >= 0.5, "over-fitted model: {r:?}");
    assert!(r.auc >= 0.8, "over-fitted model: {r:?}");
    // A model of the same size trained the same way on other rows: the "members" are as new
    // to it as the non-members.
    let m2 = overfit(&independent, 2);
    let r2 = report(&m2, &members, &non_members);
    eprintln!("independent: {r2:?}");
    assert!(r2.tpr_at_10pct_fpr <= 0.35, "independent model: {r2:?}");
    assert!((0.3..=0.7).contains(&r2.auc), "independent model: {r2:?}");
}
