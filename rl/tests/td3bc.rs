//! TD3+BC (`fedrl_rl::offline::td3bc`): the actor loss against a hand computation (including
//! that `lambda` is held constant), the update schedule, and learning on a Pendulum dataset
//! recorded with the project's simulator and dataset recorder.
//!
//! `cargo test -p fedrl-rl --test td3bc` (about a second); the learning test is ignored:
//! `cargo test -p fedrl-rl --test td3bc -- --ignored --nocapture` (about 30 s on 2 shared
//! cores in the dev profile, whose dependencies are optimised).

use fedrl_rl::candle_core::{Device, Tensor, Var};
use fedrl_rl::diffusion::{Actions, Transitions};
use fedrl_rl::offline::continuous::{BehaviourPolicy, RandomPolicy, record};
use fedrl_rl::offline::td3bc::{
    Td3Bc, Td3BcConfig, actor_loss, evaluate_policy, transitions_from_episodes,
};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Normal};

#[test]
fn actor_loss_matches_a_hand_computation() {
    let dev = Device::Cpu;
    let q = Var::from_tensor(&Tensor::new(&[[1.0f32], [-3.0]], &dev).unwrap()).unwrap();
    let pi = Var::from_tensor(&Tensor::new(&[[0.5f32], [1.0]], &dev).unwrap()).unwrap();
    let a = Tensor::new(&[[0.0f32], [2.0]], &dev).unwrap();
    // mean|q| = 2, lambda = 2.5 / 2 = 1.25; -lambda mean(q) = 1.25; BC = (0.25 + 1) / 2.
    let loss = actor_loss(q.as_tensor(), pi.as_tensor(), &a, 2.5).unwrap();
    assert!((loss.to_scalar::<f32>().unwrap() - 1.875).abs() < 1e-6);
    let g = loss.backward().unwrap();
    // lambda is a constant: d/dq_i = -lambda / B for each i (no gradient through mean|q|).
    let gq: Vec<f32> = g.get(&q).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert!(gq.iter().all(|v| (v + 0.625).abs() < 1e-6), "{gq:?}");
    // d/dpi_i = 2 (pi_i - a_i) / B.
    let gp: Vec<f32> = g
        .get(&pi)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert!(
        (gp[0] - 0.5).abs() < 1e-6 && (gp[1] + 1.0).abs() < 1e-6,
        "{gp:?}"
    );
}

fn toy_data(n: usize) -> Transitions {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
    let obs: Vec<f32> = (0..2 * n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let acts: Vec<f32> = (0..n).map(|i| obs[2 * i].clamp(-1.0, 1.0)).collect();
    Transitions {
        obs_dim: 2,
        next_obs: obs.iter().map(|v| v * 0.9).collect(),
        rewards: acts.iter().map(|a| -a * a).collect(),
        terminals: (0..n)
            .map(|i| if i % 10 == 9 { 1.0 } else { 0.0 })
            .collect(),
        actions: Actions::Continuous {
            dim: 1,
            values: acts,
        },
        obs,
    }
}

#[test]
fn the_actor_moves_every_second_update_and_actions_stay_in_the_box() {
    let cfg = Td3BcConfig {
        hidden: vec![32, 32],
        batch_size: 16,
        ..Td3BcConfig::default()
    };
    let mut agent = Td3Bc::new(toy_data(100), &[-1.0], &[3.0], cfg, 4, &Device::Cpu).unwrap();
    let (mean, std) = agent.state_stats();
    assert!(mean.iter().all(|m| m.abs() < 0.3) && std.iter().all(|s| *s > 0.4));
    for k in 1..=6 {
        let s = agent.update().unwrap();
        assert!(s.critic_loss.is_finite());
        assert_eq!(s.actor_loss.is_some(), k % 2 == 0, "update {k}");
    }
    assert_eq!(agent.updates(), 6);
    let acts = agent.act(&[0.3, -0.2, 50.0, 50.0, -50.0, 0.0]).unwrap();
    assert_eq!(acts.len(), 3);
    assert!(acts.iter().all(|a| (-1.0..=3.0).contains(a)));
    let mut bad = toy_data(10);
    bad.terminals.pop();
    assert!(
        Td3Bc::new(
            bad,
            &[-1.0],
            &[1.0],
            Td3BcConfig::default(),
            0,
            &Device::Cpu
        )
        .is_err()
    );
}

/// A decent Pendulum controller with noise: energy shaping (`E = w^2 / 2 + 15 (cos theta - 1)`,
/// 0 upright at rest, for Pendulum's `theta'' = 15 sin theta + 3 u`) far from the top, a PD law
/// near it; Gaussian noise of standard deviation 0.3 on every action.
struct SwingUp;

impl BehaviourPolicy for SwingUp {
    fn count(&self) -> usize {
        1
    }

    fn act(
        &mut self,
        _index: usize,
        obs: &[f32],
        rngs: &mut [Xoshiro256PlusPlus],
    ) -> fedrl_rl::Result<Vec<f32>> {
        let noise = Normal::new(0.0f32, 0.3).unwrap();
        Ok(obs
            .chunks(3)
            .zip(rngs.iter_mut())
            .map(|(o, rng)| {
                let (c, s, w) = (o[0], o[1], o[2]);
                let theta = s.atan2(c);
                let u = if c > 0.9 {
                    -10.0 * theta - 2.0 * w
                } else {
                    let e = 0.5 * w * w + 15.0 * (c - 1.0);
                    -w * e
                };
                (u.clamp(-2.0, 2.0) + noise.sample(rng)).clamp(-2.0, 2.0)
            })
            .collect())
    }
}

#[test]
#[ignore = "long: cargo test -p fedrl-rl --test td3bc -- --ignored --nocapture"]
fn td3bc_learns_pendulum_from_a_recorded_dataset() {
    let ds = record(
        "Pendulum-v1",
        50,
        7,
        &mut SwingUp,
        serde_json::json!("test"),
        &mut |_| {},
    )
    .unwrap();
    let eps: Vec<_> = ds.episodes.iter().collect();
    let behaviour = eps.iter().map(|e| e.total_return()).sum::<f64>() / eps.len() as f64;
    let data = transitions_from_episodes(&eps, 3, 1);
    assert_eq!(data.len(), 50 * 200);
    let mut random = RandomPolicy {
        low: vec![-2.0],
        high: vec![2.0],
    };
    let mut rngs = vec![Xoshiro256PlusPlus::seed_from_u64(3); 10];
    let random_return = evaluate_policy("Pendulum-v1", 10, 1000, 3, &mut |obs| {
        let n = obs.len() / 3;
        random.act(0, obs, &mut rngs[..n])
    })
    .unwrap();
    // The paper's settings except narrower networks (64-64), so that 3,000 updates fit a
    // short run on a shared CPU.
    let cfg = Td3BcConfig {
        hidden: vec![64, 64],
        ..Td3BcConfig::default()
    };
    let mut agent = Td3Bc::new(data, &[-2.0], &[2.0], cfg, 11, &Device::Cpu).unwrap();
    let t = std::time::Instant::now();
    let steps = 3000;
    for _ in 0..steps {
        agent.update().unwrap();
    }
    let secs = t.elapsed().as_secs_f64();
    let learned = agent.evaluate("Pendulum-v1", 10, 1000).unwrap();
    eprintln!(
        "behaviour {behaviour:.0}, random {random_return:.0}, TD3+BC after {steps} updates \
         {learned:.0} ({:.0} updates/s)",
        steps as f64 / secs
    );
    assert!(
        learned > random_return + 400.0,
        "{learned} vs random {random_return}"
    );
}
