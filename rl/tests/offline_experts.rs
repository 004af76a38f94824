//! Seed 000/002's experts: softening, count queries, PPO training that improves, deterministic
//! generation, the cache round trip of data and experts, and clear errors.

use fedrl_common::offline::{Behaviour, DatasetSpec};
use fedrl_rl::candle_core::{Device, Tensor};
use fedrl_rl::mlp::{RowMlp, RowScratch, forward, policy_layers};
use fedrl_rl::offline::cache::{self, CacheError, Source};
use fedrl_rl::offline::experts::{
    EXPERTS_FILE, ExpertReturns, ExpertSet, generate_experts, plan, softened_probs, train_experts,
};
use fedrl_rl::offline::generate::Progress;
use fedrl_rl::{LocalUpdateConfig, LocalUpdateExt, ModelSpec, local_updates_own};

fn experts_spec(units: u64, episodes: u64, iterations: u64, p_min: f64) -> DatasetSpec {
    DatasetSpec {
        env: "CartPole-v1".into(),
        population_seed: 0,
        behaviour: Behaviour::Experts {
            population: "cartpole-b1".into(),
            per_setting: 3,
            iterations,
            hidden: vec![8, 8],
            p_min,
            max_steps: 60,
            shared_iterations: 0,
            expert_lr: None,
        },
        units,
        episodes_per_unit: episodes,
        seed: 5,
        gymnasium: None,
    }
}

fn quiet() -> impl FnMut(Progress) {
    |_| {}
}

/// Random (untrained) experts for query tests: 2-action CartPole models.
fn random_set(m: usize, p_min: f64) -> ExpertSet {
    let env = fedrl_sim::make("CartPole-v1").unwrap();
    let cfg = LocalUpdateConfig {
        hidden: vec![16, 16],
        ..LocalUpdateConfig::default()
    };
    let model = cfg
        .model_spec(env.observation_space(), env.action_space())
        .unwrap();
    let policy_len = model.layout().policy_len;
    let policies = (0..m as u64)
        .map(|u| {
            // Larger head weights than the orthogonal init's 0.01 gain so that argmaxes vary.
            let mut p = model.init(u)[..policy_len].to_vec();
            for x in p.iter_mut() {
                *x *= 30.0;
            }
            p
        })
        .collect();
    ExpertSet::new(model, p_min, policies).unwrap()
}

/// A CartPole-like trajectory of `len` observations with varied values, and actions.
fn trajectory(len: usize) -> (Vec<f32>, Vec<u32>) {
    let obs = (0..len * 4)
        .map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i % 4) as f32))
        .collect();
    let actions = (0..len).map(|t| ((t * 7 + 3) % 5 % 2) as u32).collect();
    (obs, actions)
}

#[test]
fn softened_probabilities_sum_to_one_with_floor_p_min() {
    for (a, p_min) in [(2usize, 0.02), (3, 0.02), (4, 0.25), (4, 0.1)] {
        for best in 0..a {
            let p = softened_probs(best, a, p_min);
            assert_eq!(p.len(), a);
            assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12, "{p:?}");
            let min = p.iter().copied().fold(f64::INFINITY, f64::min);
            assert!((min - p_min).abs() < 1e-15 || a as f64 * p_min == 1.0);
            assert_eq!(p[best], 1.0 - (a as f64 - 1.0) * p_min);
            for (i, &x) in p.iter().enumerate() {
                if i != best {
                    assert_eq!(x, p_min);
                }
            }
        }
    }
    let set = random_set(5, 0.02);
    let (obs, _) = trajectory(10);
    for u in 0..5 {
        for row in obs.chunks(4) {
            let p = set.action_probs(u, row).unwrap();
            assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
            assert!(p.iter().all(|&x| x == 0.02 || x == 0.98), "{p:?}");
        }
    }
}

#[test]
fn prefix_probabilities_match_a_hand_computation() {
    let set = random_set(12, 0.05);
    let (obs, actions) = trajectory(30);
    let units: Vec<u64> = vec![3, 0, 11, 3, 7];
    let probs = set.prefix_probabilities(&units, &obs, &actions).unwrap();
    assert_eq!(probs.len(), units.len());
    let mut saw_both = [false, false];
    for (k, &u) in units.iter().enumerate() {
        let mut p = 1.0f64;
        for (h, (row, &a)) in obs.chunks(4).zip(&actions).enumerate() {
            let pi = set.action_probs(u, row).unwrap()[a as usize];
            saw_both[usize::from(pi == 0.05)] = true;
            p *= pi;
            assert_eq!(probs[k][h], p, "unit {u} prefix {}", h + 1);
            assert!(probs[k][h] > 0.0 && probs[k][h] <= 1.0);
            if h > 0 {
                assert!(probs[k][h] <= probs[k][h - 1]);
            }
        }
    }
    // The experts do disagree with the trajectory somewhere and agree elsewhere.
    assert!(saw_both[0] && saw_both[1]);
    let counts = set.prefix_counts(&units, &obs, &actions).unwrap();
    assert_eq!(counts.len(), actions.len());
    for h in 0..actions.len() {
        let sum: f64 = probs.iter().map(|p| p[h]).sum();
        assert!((counts[h] - sum).abs() < 1e-12);
        assert!(counts[h] >= 0.0 && counts[h] <= units.len() as f64);
    }
    // Every expert's answer is bounded by one: a count over all experts at most m.
    let all: Vec<u64> = (0..12).collect();
    let c = set.prefix_counts(&all, &obs, &actions).unwrap();
    assert!(c.iter().all(|&x| x > 0.0 && x <= 12.0));
}

#[test]
fn bad_queries_are_errors() {
    let set = random_set(4, 0.02);
    let (obs, actions) = trajectory(5);
    assert!(
        set.prefix_counts(&[4], &obs, &actions).is_err(),
        "unknown unit"
    );
    assert!(set.action_probs(99, &obs[..4]).is_err(), "unknown unit");
    assert!(
        set.prefix_counts(&[0], &obs[..19], &actions).is_err(),
        "short obs"
    );
    assert!(
        set.prefix_counts(&[0], &obs, &actions[..4]).is_err(),
        "length mismatch"
    );
    let mut bad_a = actions.clone();
    bad_a[2] = 2;
    assert!(set.prefix_counts(&[0], &obs, &bad_a).is_err(), "action 2");
    let mut bad_o = obs.clone();
    bad_o[7] = f32::NAN;
    assert!(set.prefix_counts(&[0], &bad_o, &actions).is_err(), "NaN");
    bad_o[7] = f32::INFINITY;
    assert!(set.action_probs(0, &bad_o[4..8]).is_err(), "inf");
    assert!(set.action_probs(0, &obs[..3]).is_err(), "obs_dim");
    // An empty trajectory asks nothing.
    assert_eq!(
        set.prefix_counts(&[0, 1], &[], &[]).unwrap(),
        Vec::<f64>::new()
    );
}

#[test]
fn row_forward_matches_the_batched_forward() {
    let env = fedrl_sim::make("Acrobot-v1").unwrap();
    let model =
        ModelSpec::from_spaces(env.observation_space(), env.action_space(), &[16, 8]).unwrap();
    let layout = model.layout();
    let flat = model.init(9);
    let net = RowMlp::new(&layout, &flat);
    let x: Vec<f32> = (0..6).map(|i| (i as f32 * 0.7).cos() * 2.0).collect();
    let t = layout.stack(&[&flat], &Device::Cpu).unwrap();
    let xt = Tensor::from_slice(&x, (1, 1, 6), &Device::Cpu).unwrap();
    let head = forward(&xt, &policy_layers(&layout, &t))
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let mut s = RowScratch::default();
    let row = net.policy(&x, &mut s).to_vec();
    assert_eq!(row.len(), 3);
    for (a, b) in row.iter().zip(&head) {
        assert!((a - b).abs() < 1e-5, "{row:?} vs {head:?}");
    }
}

#[test]
fn own_parameters_make_independent_updates() {
    // Each user's delta depends on its own parameters, environment and seed only.
    let pop = fedrl_sim::Population::new("cartpole-b1", 0).unwrap();
    let cfg = LocalUpdateConfig {
        hidden: vec![8, 8],
        threads: 2,
        clip_norm: f64::INFINITY,
        ..LocalUpdateConfig::default()
    };
    let probe = pop.setting_env(0).unwrap();
    let model = cfg
        .model_spec(probe.observation_space(), probe.action_space())
        .unwrap();
    let params: Vec<Vec<f32>> = (0..3).map(|u| model.init(100 + u)).collect();
    let refs: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let mut envs: Vec<_> = (0..3).map(|s| pop.setting_env(s * 111).unwrap()).collect();
    let seeds = [1u64, 2, 3];
    let all = local_updates_own(&model, &refs, &mut envs, &seeds, &cfg, &Device::Cpu).unwrap();
    let mut one_env = vec![pop.setting_env(111).unwrap()];
    let alone = local_updates_own(
        &model,
        &refs[1..2],
        &mut one_env,
        &seeds[1..2],
        &cfg,
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(all[1].episode_returns, alone[0].episode_returns);
    let diff = all[1]
        .delta
        .iter()
        .zip(&alone[0].delta)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(diff < 1e-5, "delta differs by {diff}");
    assert!(all[0].delta != all[1].delta && all[0].norm_before_clip > 0.0);
    // Different parameters act differently: the users did not share one policy.
    assert!(
        local_updates_own(
            &model,
            &refs[..1],
            &mut one_env,
            &seeds[1..2],
            &cfg,
            &Device::Cpu
        )
        .unwrap()[0]
            .delta
            != alone[0].delta
    );
}

#[test]
fn ppo_improves_a_small_expert_set() {
    let spec = DatasetSpec {
        units: 8,
        ..experts_spec(8, 1, 15, 0.02)
    };
    let mut spec = spec;
    if let Behaviour::Experts {
        max_steps, hidden, ..
    } = &mut spec.behaviour
    {
        *max_steps = 200;
        *hidden = vec![32, 32];
    }
    let p = plan(&spec).unwrap();
    let mut iterations = 0;
    let (params, curve) = train_experts(&p, 8, 0, &mut |e| {
        if let Progress::Training { done, total, .. } = e {
            assert_eq!(total, 15);
            iterations = done;
        }
    })
    .unwrap();
    assert_eq!(iterations, 15);
    assert_eq!(params.len(), 8);
    let c = &curve.mean_return;
    let before = c[0];
    let after = c[c.len() - 3..].iter().sum::<f64>() / 3.0;
    assert!(
        after > before * 2.0,
        "mean training return {before} before, {after} at the end: {c:?}"
    );
}

/// The shared start (`shared_iterations`): every expert begins from one policy that PPO on
/// 64-episode cohorts improved, the experts' own iterations then run at `expert_lr` and make
/// them differ, the progress counts both phases, and the result does not depend on the
/// thread count.
#[test]
fn shared_start_is_common_learned_and_deterministic() {
    let with = |shared: u64, own: u64, lr: Option<f64>| {
        let mut spec = experts_spec(70, 1, own, 0.02);
        if let Behaviour::Experts {
            max_steps,
            hidden,
            shared_iterations,
            expert_lr,
            ..
        } = &mut spec.behaviour
        {
            *max_steps = 200;
            *hidden = vec![32, 32];
            *shared_iterations = shared;
            *expert_lr = lr;
        }
        plan(&spec).unwrap()
    };
    // Trains 70 experts; also returns the last (done, total) of the training progress.
    let train = |p: &fedrl_rl::offline::experts::ExpertsPlan| {
        let mut last = (0, 0);
        let (params, curve) = train_experts(p, 70, 0, &mut |e| {
            if let Progress::Training { done, total, .. } = e {
                last = (done, total);
            }
        })
        .unwrap();
        (params, curve, last)
    };
    // Shared iterations only: identical experts, a curve of cohort means that rises.
    let (params, curve, last) = train(&with(12, 0, None));
    assert_eq!(last, (12, 12));
    assert!(params.iter().all(|q| q == &params[0]), "one shared policy");
    let c = &curve.mean_return;
    assert_eq!(c.len(), 12);
    let late = c[c.len() - 3..].iter().sum::<f64>() / 3.0;
    assert!(late > c[0] * 2.0, "shared training improves: {c:?}");
    // Then own iterations at a given learning rate: progress counts both phases, the experts
    // differ, and a larger learning rate moves them further from the shared start.
    let (own, _, last) = train(&with(12, 2, Some(1e-4)));
    assert_eq!(last, (14, 14));
    assert_ne!(own[0], own[1]);
    let (fast, _) = train_experts(&with(12, 2, Some(1e-2)), 70, 0, &mut quiet()).unwrap();
    let dist = |a: &[Vec<f32>]| -> f64 {
        a.iter()
            .flat_map(|q| {
                q.iter()
                    .zip(&params[0])
                    .map(|(x, y)| f64::from(x - y).powi(2))
            })
            .sum()
    };
    assert!(
        dist(&fast) > dist(&own),
        "expert_lr is the own iterations' step"
    );
    // Any thread count: the same experts.
    same_on_one_and_three_threads(with(3, 1, None));
}

/// Trains `plan`'s 70 experts on one and on three threads and checks that the results agree.
fn same_on_one_and_three_threads(mut p1: fedrl_rl::offline::experts::ExpertsPlan) {
    p1.threads = 1;
    let mut p3 = p1.clone();
    p3.threads = 3;
    assert_eq!(
        train_experts(&p1, 70, 1, &mut quiet()).unwrap(),
        train_experts(&p3, 70, 1, &mut quiet()).unwrap()
    );
}

#[test]
fn generation_is_deterministic_and_demonstrations_follow_the_softened_experts() {
    let spec = experts_spec(6, 10, 2, 0.2);
    let a = generate_experts(&spec, &mut quiet()).unwrap();
    let b = generate_experts(&spec, &mut quiet()).unwrap();
    // The thread count changes nothing (70 experts: two rollout chunks, two PPO groups).
    same_on_one_and_three_threads(plan(&experts_spec(70, 1, 2, 0.2)).unwrap());
    assert_eq!(a.dataset, b.dataset);
    assert_eq!(a.curve, b.curve);
    for u in 0..6 {
        assert_eq!(a.experts.policy(u).unwrap(), b.experts.policy(u).unwrap());
    }
    let d = &a.dataset;
    assert_eq!(d.env_id, "CartPole-v1");
    assert_eq!(d.id, spec.minari_id());
    assert_eq!(d.episodes.len(), 60);
    let (mut agree, mut steps) = (0usize, 0usize);
    for (i, e) in d.episodes.iter().enumerate() {
        assert_eq!(e.id, i as u64);
        assert_eq!(e.unit, i as u64 / 10);
        assert!(e.len() <= 60, "capped at max_steps");
        if e.len() == 60 && !e.terminations[59] {
            assert!(e.truncations[59], "a capped episode is truncated");
        }
        for (t, &act) in e.actions.iter().enumerate() {
            let p = a
                .experts
                .action_probs(e.unit, &e.observations[t * 4..(t + 1) * 4])
                .unwrap();
            agree += usize::from(p[act as usize] == 0.8);
            steps += 1;
        }
    }
    // With p_min = 0.2 and two actions the expert's choice is taken 80% of the time.
    let f = agree as f64 / steps as f64;
    assert!(steps > 500 && (f - 0.8).abs() < 0.05, "{agree}/{steps}");
    let r = ExpertReturns::of(d);
    assert_eq!(r.experts, 6);
    assert!(r.min <= r.q25 && r.q25 <= r.median && r.median <= r.q75 && r.q75 <= r.max);
    // A different seed gives different experts.
    let mut other = spec.clone();
    other.seed = 6;
    let c = generate_experts(&other, &mut quiet()).unwrap();
    assert_ne!(c.experts.policy(0).unwrap(), a.experts.policy(0).unwrap());
}

#[test]
fn cache_round_trip_keeps_data_and_experts() {
    let root = tempfile::tempdir().unwrap();
    let spec = experts_spec(4, 3, 2, 0.02);
    let (d1, s1) = cache::load_or_generate(&spec, root.path(), &mut quiet()).unwrap();
    assert_eq!(s1, Source::Generated);
    let dir = fedrl_rl::offline::minari::dataset_dir(root.path(), &spec.minari_id()).unwrap();
    assert!(dir.join(EXPERTS_FILE).is_file());
    let (d2, s2) = cache::load_or_generate(&spec, root.path(), &mut quiet()).unwrap();
    assert_eq!(s2, Source::Cache);
    assert_eq!(d1, d2);
    let fresh = generate_experts(&spec, &mut quiet()).unwrap();
    assert_eq!(fresh.dataset, d1);
    let set = ExpertSet::load(&spec, root.path()).unwrap();
    assert_eq!(set.experts(), 4);
    assert_eq!(set.n_actions(), 2);
    assert_eq!(set.p_min(), 0.02);
    for u in 0..4 {
        assert_eq!(set.policy(u).unwrap(), fresh.experts.policy(u).unwrap());
    }
    let (obs, actions) = trajectory(8);
    assert_eq!(
        set.prefix_counts(&[0, 1, 2, 3], &obs, &actions).unwrap(),
        fresh
            .experts
            .prefix_counts(&[0, 1, 2, 3], &obs, &actions)
            .unwrap()
    );
    // The experts file is part of the dataset: without it the cache refuses.
    std::fs::remove_file(dir.join(EXPERTS_FILE)).unwrap();
    assert!(matches!(
        cache::load_or_generate(&spec, root.path(), &mut quiet()),
        Err(CacheError::MissingExperts { .. })
    ));
    assert!(matches!(
        ExpertSet::load(&spec, root.path()),
        Err(CacheError::MissingExperts { .. })
    ));
    // A corrupt experts file is an error too.
    std::fs::write(dir.join(EXPERTS_FILE), b"not safetensors").unwrap();
    assert!(ExpertSet::load(&spec, root.path()).is_err());
}

#[test]
fn experts_file_is_byte_stable_and_format_1_still_reads() {
    use safetensors::tensor::{SafeTensors, TensorView};
    let dir = tempfile::tempdir().unwrap();
    let set = random_set(5, 0.02);
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    set.save(&a).unwrap();
    // Several saves, each with a freshly seeded metadata map: the bytes never change.
    for _ in 0..8 {
        set.save(&b).unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    }
    let back = ExpertSet::read(&a).unwrap();
    assert_eq!(back.p_min(), 0.02);
    for u in 0..5 {
        assert_eq!(back.policy(u).unwrap(), set.policy(u).unwrap());
    }
    // The same tensors under format 1's four metadata keys (caches written before format 2).
    let bytes = std::fs::read(&a).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                TensorView::new(t.dtype(), t.shape().to_vec(), t.data()).unwrap(),
            )
        })
        .collect();
    let model = serde_json::to_string(back.model()).unwrap();
    let v1 = |format: &str| {
        std::collections::HashMap::from([
            ("fedrl.model_spec".to_string(), model.clone()),
            ("fedrl.p_min".to_string(), "0.02".to_string()),
            ("fedrl.experts".to_string(), "5".to_string()),
            ("fedrl.experts_format".to_string(), format.to_string()),
        ])
    };
    let old = dir.path().join("old");
    std::fs::write(
        &old,
        safetensors::serialize(views.clone(), Some(v1("1"))).unwrap(),
    )
    .unwrap();
    let back1 = ExpertSet::read(&old).unwrap();
    for u in 0..5 {
        assert_eq!(back1.policy(u).unwrap(), set.policy(u).unwrap());
    }
    std::fs::write(&old, safetensors::serialize(views, Some(v1("7"))).unwrap()).unwrap();
    let err = ExpertSet::read(&old).unwrap_err().to_string();
    assert!(err.contains("unknown experts format 7"), "{err}");
}

#[test]
fn expert_specs_are_validated() {
    let ok = experts_spec(30, 1, 1, 0.02);
    let p = plan(&ok).unwrap();
    assert_eq!((p.setting(0), p.setting(2), p.setting(3)), (0, 0, 1));
    // Units beyond settings x per_setting walk the grid again.
    assert_eq!(p.setting(3000), 0);
    let mut s = ok.clone();
    s.behaviour = Behaviour::Experts {
        population: "cartpole-b1".into(),
        per_setting: 3,
        iterations: 1,
        hidden: vec![8],
        p_min: 0.6,
        max_steps: 0,
        shared_iterations: 0,
        expert_lr: None,
    };
    assert!(plan(&s).is_err(), "p_min x n_actions > 1");
    let mut s = ok.clone();
    s.behaviour = Behaviour::experts("acrobot-b1");
    assert!(
        plan(&s).is_err(),
        "Acrobot experts for CartPole demonstrations"
    );
    s.behaviour = Behaviour::experts("CartPole-v1");
    assert!(plan(&s).is_err(), "not a B.1 grid");
    let mut s = ok.clone();
    s.env = "cartpole-b1".into();
    assert!(
        plan(&s).is_err(),
        "the default environment must be an environment id"
    );
    let mut s = ok.clone();
    s.population_seed = 1;
    assert!(plan(&s).is_err(), "population_seed is meaningless here");
    let mut s = ok.clone();
    s.behaviour = Behaviour::experts("hiv-b1");
    s.env = "HIVTreatment20d-v0".into();
    let h = plan(&s).unwrap();
    assert_eq!((h.n_actions, h.obs_dim, h.settings), (4, 6, 2000));
    let mut s = ok;
    s.units = 0;
    assert!(plan(&s).is_err());
}
