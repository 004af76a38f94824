//! PPO: GAE on hand-computed cases, the loss gradient against central finite differences (f64),
//! and the batched local update: clip bound, independence between users, batched == alone.

use candle_core::{DType, Device, Tensor};
use fedrl_rl::ppo::{Minibatch, PpoCoefs, gae, ppo_loss};
use fedrl_rl::{
    ActionKind, LocalUpdateConfig, LocalUpdateExt, ModelSpec, UserBatch, collect_rollouts,
    local_updates, local_updates_from_batches, local_updates_from_batches_adam_init,
};
use fedrl_sim::{Action, Env, SimError, Space, Step};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

#[test]
fn gae_terminated_vs_truncated() {
    // Two episodes: one terminated after 2 steps, one truncated after 1 step.
    let b = UserBatch {
        rewards: vec![1.0, 1.0, 1.0],
        values: vec![0.5, 0.4, 0.3],
        terminated: vec![false, true, false],
        truncated: vec![false, false, true],
        bootstrap: vec![0.0, 0.0, 2.0],
        logp: vec![0.0; 3],
        ..Default::default()
    };
    let (g, l) = (0.9, 0.8);
    let (adv, ret) = gae(&b, g, l, 1.0);
    let d1 = 1.0 - 0.4; // terminal: no bootstrap
    let d0 = 1.0 + g * 0.4 - 0.5;
    let d2 = 1.0 + g * 2.0 - 0.3; // truncated: bootstrap from the stored value
    let want = [d0 + g * l * d1, d1, d2];
    for (a, w) in adv.iter().zip(want) {
        assert!((*a as f64 - w).abs() < 1e-6, "{adv:?} vs {want:?}");
    }
    assert!((ret[2] - (d2 as f32 + 0.3)).abs() < 1e-6);
    // Reward scaling applies before the recursion.
    let (adv_s, _) = gae(&b, g, l, 0.5);
    assert!((adv_s[1] as f64 - (0.5 - 0.4)).abs() < 1e-6);
}

/// Loss of `params` (f64 stacked tensors) as f64.
fn loss_at(spec: &ModelSpec, params: &[Tensor], mb: &Minibatch, c: &PpoCoefs) -> f64 {
    let l = spec.layout();
    ppo_loss(spec, &l, params, mb, c)
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

fn random_minibatch(
    spec: &ModelSpec,
    users: usize,
    n: usize,
    rng: &mut Xoshiro256PlusPlus,
) -> Minibatch {
    let d = Device::Cpu;
    let f = |k: usize, rng: &mut Xoshiro256PlusPlus, s: f64| -> Vec<f64> {
        (0..k).map(|_| (rng.random::<f64>() - 0.5) * s).collect()
    };
    let obs = Tensor::from_vec(
        f(users * n * spec.obs_dim, rng, 2.0),
        (users, n, spec.obs_dim),
        &d,
    )
    .unwrap();
    let actions = match spec.action {
        ActionKind::Discrete { n: a } => {
            let v: Vec<u32> = (0..users * n)
                .map(|_| rng.random_range(0..a as u32))
                .collect();
            Tensor::from_vec(v, (users, n, 1), &d).unwrap()
        }
        ActionKind::Gaussian { dim } => {
            Tensor::from_vec(f(users * n * dim, rng, 2.0), (users, n, dim), &d).unwrap()
        }
    };
    // Old log-probs near the current ones so some ratios fall inside and some outside the clip.
    let logp_old = Tensor::from_vec(f(users * n, rng, 0.6), (users, n), &d).unwrap();
    let logp_old = match spec.action {
        ActionKind::Discrete { n: a } => (logp_old - (a as f64).ln()).unwrap(),
        ActionKind::Gaussian { dim } => (logp_old - 1.0 * dim as f64).unwrap(),
    };
    let mut mask = vec![1.0f64; users * n];
    mask[n - 1] = 0.0; // user 0 has one padded step
    Minibatch {
        obs,
        actions,
        logp_old,
        adv: Tensor::from_vec(f(users * n, rng, 3.0), (users, n), &d).unwrap(),
        returns: Tensor::from_vec(f(users * n, rng, 3.0), (users, n), &d).unwrap(),
        mask: Tensor::from_vec(mask, (users, n), &d).unwrap(),
        inv_count: Tensor::from_vec(
            (0..users)
                .map(|u| {
                    if u == 0 {
                        1.0 / (n - 1) as f64
                    } else {
                        1.0 / n as f64
                    }
                })
                .collect(),
            (users, 1),
            &d,
        )
        .unwrap(),
    }
}

#[test]
fn ppo_loss_gradient_matches_finite_differences() {
    let coefs = PpoCoefs {
        clip_eps: 0.2,
        vf_coef: 0.5,
        ent_coef: 0.05,
    };
    for spec in [
        ModelSpec {
            obs_dim: 3,
            action: ActionKind::Discrete { n: 3 },
            hidden: vec![5, 4],
            init_log_std: 0.0,
            obs_offset: vec![],
            obs_scale: vec![],
            action_low: vec![],
            action_high: vec![],
            action_repeat: 1,
        },
        ModelSpec {
            obs_dim: 2,
            action: ActionKind::Gaussian { dim: 2 },
            hidden: vec![4],
            init_log_std: -0.3,
            obs_offset: vec![],
            obs_scale: vec![],
            action_low: vec![],
            action_high: vec![],
            action_repeat: 1,
        },
    ] {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(5);
        let l = spec.layout();
        let users = 2;
        // Perturb the init so that the heads are not ~0 (the policy head starts at gain 0.01).
        let flats: Vec<Vec<f32>> = (0..users)
            .map(|u| {
                spec.init(u as u64)
                    .iter()
                    .map(|x| x + (rng.random::<f32>() - 0.5) * 0.6)
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = flats.iter().map(|f| f.as_slice()).collect();
        let params: Vec<Tensor> = l
            .stack(&refs, &Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|t| t.to_dtype(DType::F64).unwrap())
            .collect();
        let mb = random_minibatch(&spec, users, 6, &mut rng);
        let vars: Vec<candle_core::Var> = params
            .iter()
            .map(|t| candle_core::Var::from_tensor(t).unwrap())
            .collect();
        let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let loss = ppo_loss(&spec, &l, &tensors, &mb, &coefs)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let h = 1e-6;
        let mut checked = 0;
        for (i, v) in vars.iter().enumerate() {
            let g = grads
                .get(v.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let base = params[i].flatten_all().unwrap().to_vec1::<f64>().unwrap();
            // A few coordinates of every tensor, both users.
            for k in (0..base.len()).step_by(base.len().div_ceil(4).max(1)) {
                let at = |delta: f64| {
                    let mut p = base.clone();
                    p[k] += delta;
                    let mut ps = params.clone();
                    ps[i] = Tensor::from_vec(p, params[i].shape(), &Device::Cpu).unwrap();
                    loss_at(&spec, &ps, &mb, &coefs)
                };
                let fd = (at(h) - at(-h)) / (2.0 * h);
                assert!(
                    (fd - g[k]).abs() <= 1e-5 * (1.0 + fd.abs()),
                    "{:?} {} [{k}]: autograd {} vs finite difference {fd}",
                    spec.action,
                    l.params[i].name,
                    g[k]
                );
                checked += 1;
            }
        }
        assert!(checked > 20);
    }
}

fn cartpoles(n: usize) -> Vec<Box<dyn Env>> {
    (0..n)
        .map(|_| fedrl_sim::make("CartPole-v1").unwrap())
        .collect()
}

fn small_cfg() -> LocalUpdateConfig {
    LocalUpdateConfig {
        hidden: vec![16, 16],
        epochs: 2,
        minibatches: 2,
        max_episode_steps: 60,
        clip_norm: 0.05,
        group_size: 3,
        threads: 1,
        ..Default::default()
    }
}

fn spec_for(cfg: &LocalUpdateConfig) -> ModelSpec {
    let env = fedrl_sim::make("CartPole-v1").unwrap();
    ModelSpec::from_spaces(env.observation_space(), env.action_space(), &cfg.hidden).unwrap()
}

#[test]
fn clip_bound_holds_on_every_update() {
    for (clip, lr) in [(0.05, 2.5e-3), (1e-4, 1e-2), (100.0, 1e-3)] {
        let cfg = LocalUpdateConfig {
            clip_norm: clip,
            lr,
            threads: 2,
            ..small_cfg()
        };
        let spec = spec_for(&cfg);
        let global = spec.init(1);
        let seeds: Vec<u64> = (0..7).collect();
        let ups = local_updates(
            &spec,
            &global,
            &mut cartpoles(7),
            &seeds,
            &cfg,
            &Device::Cpu,
        )
        .unwrap();
        assert_eq!(ups.len(), 7);
        for u in &ups {
            let norm = u
                .delta
                .iter()
                .map(|&x| (x as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            assert!(norm <= clip, "norm {norm} > {clip}");
            assert!(u.norm_before_clip > 0.0);
            assert_eq!(u.delta.len(), spec.layout().len());
            assert!(u.steps > 0 && u.steps <= 60);
        }
    }
}

#[test]
fn users_are_independent_and_batched_equals_alone() {
    let cfg = LocalUpdateConfig {
        clip_norm: 1e9, // compare raw deltas
        ..small_cfg()
    };
    let spec = spec_for(&cfg);
    let global = spec.init(2);
    let seeds: Vec<u64> = vec![10, 11, 12, 13, 14];
    let batches = collect_rollouts(
        &spec,
        &global,
        &mut cartpoles(5),
        &seeds,
        &cfg.rollout(),
        &Device::Cpu,
    )
    .unwrap();
    let all =
        local_updates_from_batches(&spec, &global, &batches, &seeds, &cfg, &Device::Cpu).unwrap();

    // User 0 alone.
    let alone = local_updates_from_batches(
        &spec,
        &global,
        &batches[..1],
        &seeds[..1],
        &cfg,
        &Device::Cpu,
    )
    .unwrap();
    let close = |a: &[f32], b: &[f32]| {
        let scale = a.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
        a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-4 * scale.max(1e-6))
    };
    assert!(close(&all[0].delta, &alone[0].delta), "batched != alone");

    // Change every other user's data: user 0's update does not move.
    let mut other = batches.clone();
    for b in other.iter_mut().skip(1) {
        for r in b.rewards.iter_mut() {
            *r *= -3.0;
        }
        for o in b.obs.iter_mut() {
            *o += 0.5;
        }
    }
    let all2 =
        local_updates_from_batches(&spec, &global, &other, &seeds, &cfg, &Device::Cpu).unwrap();
    assert!(
        close(&all[0].delta, &all2[0].delta),
        "user 0 depends on the others"
    );
    assert!(
        !close(&all[1].delta, &all2[1].delta),
        "user 1's own data had no effect"
    );

    // Threads do not change results either.
    let two = LocalUpdateConfig {
        threads: 2,
        ..cfg.clone()
    };
    let all3 =
        local_updates_from_batches(&spec, &global, &batches, &seeds, &two, &Device::Cpu).unwrap();
    for (a, b) in all.iter().zip(&all3) {
        assert!(close(&a.delta, &b.delta));
    }
}

/// A 1-D point pushed by a continuous action; reward -x^2; 15 steps.
struct Point {
    x: f32,
    t: usize,
    obs: Space,
    act: Space,
}

impl Point {
    fn boxed() -> Box<dyn Env> {
        Box::new(Point {
            x: 0.0,
            t: 0,
            obs: Space::Box {
                low: vec![-10.0],
                high: vec![10.0],
            },
            act: Space::Box {
                low: vec![-1.0],
                high: vec![1.0],
            },
        })
    }
}

impl Env for Point {
    fn id(&self) -> &'static str {
        "Point"
    }
    fn observation_space(&self) -> &Space {
        &self.obs
    }
    fn action_space(&self) -> &Space {
        &self.act
    }
    fn reset(&mut self, seed: u64, obs: &mut [f32]) {
        self.x = (seed % 7) as f32 / 7.0 - 0.5;
        self.t = 0;
        obs[0] = self.x;
    }
    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<Step, SimError> {
        let Action::Continuous(a) = action else {
            return Err(SimError::Invalid("continuous".into()));
        };
        assert!(a[0].abs() <= 1.0, "actions are clipped to the box");
        self.x += 0.3 * a[0];
        self.t += 1;
        obs[0] = self.x;
        Ok(Step {
            reward: -(self.x as f64).powi(2),
            terminated: false,
            truncated: self.t >= 15,
        })
    }
    fn state(&self) -> Vec<f64> {
        vec![self.x as f64]
    }
    fn set_state(&mut self, s: &[f64], obs: &mut [f32]) -> Result<(), SimError> {
        self.x = s[0] as f32;
        obs[0] = self.x;
        Ok(())
    }
}

#[test]
fn gaussian_policy_local_update() {
    let cfg = LocalUpdateConfig {
        hidden: vec![8],
        episodes_per_user: 2,
        clip_norm: 0.1,
        threads: 1,
        ..Default::default()
    };
    let mut envs: Vec<Box<dyn Env>> = (0..4).map(|_| Point::boxed()).collect();
    let spec = ModelSpec::from_spaces(
        envs[0].observation_space(),
        envs[0].action_space(),
        &cfg.hidden,
    )
    .unwrap();
    let global = spec.init(0);
    let ups = local_updates(&spec, &global, &mut envs, &[1, 2, 3, 4], &cfg, &Device::Cpu).unwrap();
    for u in &ups {
        assert_eq!(u.steps, 30);
        assert_eq!(u.episode_returns.len(), 2);
        let norm = u
            .delta
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(norm <= 0.1 && norm > 0.0);
    }
    // log_std moves (it is in the update).
    let l = spec.layout();
    let p = &l.params[l.log_std.unwrap()];
    assert!(ups.iter().any(|u| u.delta[p.offset] != 0.0));
}

/// The networks see normalised observations and the environment gets actions in the
/// scenario's range: the stored batch holds `(obs - offset) / scale`, and every action the
/// environment receives lies in `[action_low, action_high]`.
#[test]
fn rollouts_apply_observation_normalisation_and_action_range() {
    let cfg = LocalUpdateConfig {
        hidden: vec![4],
        threads: 1,
        obs_offset: vec![0.25],
        obs_scale: vec![2.0],
        action_low: vec![0.1],
        action_high: vec![0.3],
        ..Default::default()
    };
    let mut envs: Vec<Box<dyn Env>> = (0..3).map(|_| Point::boxed()).collect();
    let spec = cfg
        .model_spec(envs[0].observation_space(), envs[0].action_space())
        .unwrap();
    let global = spec.init(3);
    let batches = collect_rollouts(
        &spec,
        &global,
        &mut envs,
        &[4, 5, 6],
        &cfg.rollout(),
        &Device::Cpu,
    )
    .unwrap();
    for (b, seed) in batches.iter().zip([4u64, 5, 6]) {
        // Point starts at x0 = (seed' % 7) / 7 - 0.5 and moves by 0.3 a with a in [0.1, 0.3]:
        // x only grows, by 0.03 to 0.09 a step.
        let xs: Vec<f32> = b.obs.iter().map(|o| o * 2.0 + 0.25).collect();
        for w in xs.windows(2) {
            let dx = w[1] - w[0];
            assert!(
                (0.03 - 1e-5..=0.09 + 1e-5).contains(&dx),
                "{seed}: step {dx}"
            );
        }
    }
    // A mismatched normalisation is refused when the spec is built.
    let bad = LocalUpdateConfig {
        obs_scale: vec![1.0, 1.0],
        ..cfg
    };
    assert!(
        bad.model_spec(envs[0].observation_space(), envs[0].action_space())
            .is_err()
    );
}

/// With `action_repeat = k` the policy decides every k environment steps: a user's batch holds
/// ceil(15 / k) decisions for Point's 15-step episode, and the return is still the sum of all
/// 15 rewards.
#[test]
fn action_repeat_holds_actions_and_sums_rewards() {
    let base = LocalUpdateConfig {
        hidden: vec![4],
        threads: 1,
        ..Default::default()
    };
    let mut envs: Vec<Box<dyn Env>> = (0..2).map(|_| Point::boxed()).collect();
    for (k, decisions) in [(1usize, 15usize), (4, 4), (5, 3)] {
        let cfg = LocalUpdateConfig {
            action_repeat: k,
            ..base.clone()
        };
        let spec = cfg
            .model_spec(envs[0].observation_space(), envs[0].action_space())
            .unwrap();
        let global = spec.init(1);
        let b = collect_rollouts(
            &spec,
            &global,
            &mut envs,
            &[8, 9],
            &cfg.rollout(),
            &Device::Cpu,
        )
        .unwrap();
        for ub in &b {
            assert_eq!(ub.len(), decisions, "repeat {k}");
            let r: f64 = ub.rewards.iter().map(|&r| r as f64).sum();
            assert!((r - ub.episode_returns[0]).abs() < 1e-4);
        }
    }
}

/// Seed 004's public Adam initialisation (appendix C.2.3): without it the same numbers as the
/// plain entry point; with a large `g0` the first moment decays from `g0` (0.9 per step) while
/// the second stays near `g0^2`, so step k moves each parameter by about `lr * 0.9^k` against
/// `g0`'s sign; users stay independent of each other's data.
#[test]
fn adam_initialised_from_a_public_gradient() {
    let cfg = LocalUpdateConfig {
        clip_norm: 1e9,
        ..small_cfg()
    };
    let spec = spec_for(&cfg);
    let global = spec.init(3);
    let seeds: Vec<u64> = vec![20, 21, 22];
    let batches = collect_rollouts(
        &spec,
        &global,
        &mut cartpoles(3),
        &seeds,
        &cfg.rollout(),
        &Device::Cpu,
    )
    .unwrap();
    let dev = Device::Cpu;
    let plain = local_updates_from_batches(&spec, &global, &batches, &seeds, &cfg, &dev).unwrap();
    let none =
        local_updates_from_batches_adam_init(&spec, &global, &batches, &seeds, &cfg, &dev, None)
            .unwrap();
    for (a, b) in plain.iter().zip(&none) {
        assert_eq!(a.delta, b.delta);
    }
    let g0 = vec![1e3f32; global.len()];
    let init = local_updates_from_batches_adam_init(
        &spec,
        &global,
        &batches,
        &seeds,
        &cfg,
        &dev,
        Some(&g0),
    )
    .unwrap();
    let steps = (cfg.epochs * cfg.minibatches) as i32;
    let want: f64 = (1..=steps)
        .map(|k| cfg.adam_beta1.powi(k) / cfg.adam_beta2.powi(k).sqrt())
        .sum::<f64>()
        * cfg.lr;
    for u in &init {
        for d in &u.delta {
            let moved = -(*d as f64);
            assert!((moved - want).abs() < 0.02 * want, "{moved} against {want}");
        }
    }
    // User 0 does not see the others' data through its (public) initialisation.
    let alone = local_updates_from_batches_adam_init(
        &spec,
        &global,
        &batches[..1],
        &seeds[..1],
        &cfg,
        &dev,
        Some(&g0),
    )
    .unwrap();
    let scale = init[0].delta.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
    for (x, y) in init[0].delta.iter().zip(&alone[0].delta) {
        assert!((x - y).abs() <= 1e-4 * scale);
    }
    // A wrong length is refused.
    assert!(
        local_updates_from_batches_adam_init(
            &spec,
            &global,
            &batches,
            &seeds,
            &cfg,
            &dev,
            Some(&g0[1..]),
        )
        .is_err()
    );
}
