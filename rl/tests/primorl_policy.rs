//! PriMORL's policy phase (seed 001, Algorithm 4) is post-processing of the released ensemble:
//! it must complete after the dataset is gone, and its rollouts must stay in the public
//! plausible box even when the model is poor.

use std::collections::HashSet;

use fedrl_common::task::primorl::{
    ContinuousBehaviour, ContinuousDatasetSpec, EnsembleClipping, PolicyPhaseConfig, Uncertainty,
};
use fedrl_rl::candle_core::Device;
use fedrl_rl::ensemble::{self, Ensemble, EnsembleSpec, LocalModelConfig, local_updates};
use fedrl_rl::offline::continuous::{ContinuousEpisode, load_or_generate};
use fedrl_rl::primorl::{
    StartData, normalized_return, policy_phase, public_start_states, real_transitions,
    rollout_starts,
};
use fedrl_rl::sac::ReplayBuffer;

fn tiny_policy(seed: u64) -> PolicyPhaseConfig {
    PolicyPhaseConfig {
        uncertainty: Uncertainty::MaxPairwiseDiff,
        uncertainty_in_learned_units: false,
        lambda: 1.0,
        rollout_length: 5,
        epochs: 2,
        updates_per_epoch: 20,
        rollout_batch: 32,
        rollout_every: 10,
        model_start_fraction: 0.5,
        hidden: vec![32, 32],
        lr: 3e-4,
        gamma: 0.99,
        batch_size: 32,
        target_entropy: -1.0,
        eval_episodes: 1,
        seed,
        real_ratio: 0.0,
        data_start_fraction: 0.0,
        public_start_fraction: 0.0,
    }
}

#[test]
fn the_policy_phase_completes_with_the_dataset_deleted() {
    let dir = tempfile::tempdir().expect("tmp");
    let data_root = dir.path().join("data");
    let spec_d = ContinuousDatasetSpec {
        env: "Pendulum-v1".into(),
        units: 24,
        public: 4,
        seed: 11,
        behaviour: ContinuousBehaviour::Random,
        gymnasium: None,
    };
    let model_file = dir.path().join("ensemble.safetensors");
    // Half the rollouts branch from the public split's states, kept in memory from the start as
    // the aggregator keeps them: public data, not a dataset read by the policy phase.
    let policy = PolicyPhaseConfig {
        public_start_fraction: 0.5,
        ..tiny_policy(3)
    };
    let public_starts;
    {
        let data = load_or_generate(&spec_d, &data_root, &mut |_| {}).expect("dataset");
        public_starts = public_start_states(&policy, &data, spec_d.units)
            .expect("public split")
            .expect("a positive fraction keeps the public states");
        let (public, private) = data.split(spec_d.units);

        // Model phase, in process and without noise: a few averaged rounds over every trajectory.
        let mut spec = EnsembleSpec::new(3, 1, vec![16, 16], 2);
        let (mean, std) = data.input_stats(&public);
        spec.input_offset = mean;
        spec.input_scale = std;
        let rows: Vec<_> = private
            .iter()
            .map(|e| e.model_rows(&spec).expect("rows"))
            .collect();
        let refs: Vec<_> = rows.iter().collect();
        let cfg = LocalModelConfig {
            clip_norm: 1.0,
            clipping: EnsembleClipping::PerLayer,
            ..LocalModelConfig::default()
        };
        let mut params = spec.init(5);
        for round in 0..3u64 {
            let seeds: Vec<u64> = (0..refs.len() as u64).map(|u| round * 1000 + u).collect();
            let (updates, _) =
                local_updates(&spec, &cfg, &params, &refs, &seeds, &Device::Cpu, false)
                    .expect("local updates");
            for u in &updates {
                for (p, d) in params.iter_mut().zip(&u.delta) {
                    *p += d / updates.len() as f32;
                }
            }
        }
        ensemble::save(&spec, &params, &model_file).expect("save");
    }

    // The data is gone: nothing below may need it.
    std::fs::remove_dir_all(&data_root).expect("delete dataset");
    assert!(!data_root.exists());

    let (spec2, params2) = ensemble::load(&model_file).expect("load");
    let ens = Ensemble::new(&spec2, &params2, &Device::Cpu).expect("ensemble");
    let mut seen = Vec::new();
    let (agent, curve) = policy_phase(
        &ens,
        "Pendulum-v1",
        &policy,
        StartData {
            real: None,
            public: Some(&public_starts),
        },
        &Device::Cpu,
        &mut |e| seen.push(e.epoch),
    )
    .expect("policy phase");
    assert_eq!(seen, vec![1, 2]);
    assert_eq!(curve.len(), 2);
    assert_eq!(curve[1].updates, 40);
    assert_eq!(agent.updates(), 40);
    for e in &curve {
        // Pendulum-v1 returns lie in [-16.27 * 200, 0].
        assert!(e.eval_return <= 0.0 && e.eval_return > -3300.0, "{e:?}");
        assert!(e.model_reward.is_finite() && e.penalty >= 0.0, "{e:?}");
        assert!(
            (e.normalized_return - normalized_return("Pendulum-v1", e.eval_return)).abs() < 1e-9
        );
    }
}

/// An untrained 3-member Pendulum ensemble (inputs scaled to Pendulum's ranges) and its
/// parameters.
fn untrained_pendulum_model() -> (EnsembleSpec, Vec<f32>) {
    let mut spec = EnsembleSpec::new(3, 1, vec![16, 16], 3);
    spec.input_scale = vec![1.0, 1.0, 8.0, 2.0];
    let params = spec.init(9);
    (spec, params)
}

#[test]
fn rollouts_stay_in_the_plausible_box_or_the_model_is_refused() {
    // An untrained ensemble predicts poor steps; rollouts leaving the observation box are cut,
    // so SAC never trains on exploding states.
    let (spec, params) = untrained_pendulum_model();
    let ens = Ensemble::new(&spec, &params, &Device::Cpu).expect("ensemble");
    let (_, curve) = policy_phase(
        &ens,
        "Pendulum-v1",
        &tiny_policy(4),
        StartData::default(),
        &Device::Cpu,
        &mut |_| {},
    )
    .expect("policy phase");
    // Pendulum-v1 observes (cos, sin, angular velocity) in [-1, 1] x [-1, 1] x [-8, 8]; the box
    // adds 5% of each range. Every model state SAC was given lies inside it.
    let bounds = [(-1.1f32, 1.1f32), (-1.1, 1.1), (-8.8, 8.8)];
    for e in &curve {
        assert!(e.q_loss.is_finite(), "{e:?}");
        assert_eq!(e.model_obs_range.len(), 3, "{e:?}");
        for (&(lo, hi), &(min, max)) in bounds.iter().zip(&e.model_obs_range) {
            assert!(lo <= min && min <= max && max <= hi, "{e:?}");
        }
    }
    // A wildly wrong one sends every rollout out of the box at once: a clear error, not a
    // policy trained on garbage.
    let wild: Vec<f32> = params.iter().map(|w| w * 1000.0).collect();
    let ens = Ensemble::new(&spec, &wild, &Device::Cpu).expect("ensemble");
    let Err(err) = policy_phase(
        &ens,
        "Pendulum-v1",
        &tiny_policy(4),
        StartData::default(),
        &Device::Cpu,
        &mut |_| {},
    ) else {
        panic!("a model whose rollouts all diverge must be refused");
    };
    assert!(err.to_string().contains("too poor to plan in"), "{err}");
}

/// The MOPO baseline draws `real_ratio` of each minibatch from the real transitions; asking
/// for real data without passing it is an error, not a silent model-only run.
#[test]
fn mopo_mixes_real_transitions_into_each_minibatch() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_d = ContinuousDatasetSpec {
        env: "Pendulum-v1".into(),
        units: 6,
        public: 2,
        seed: 3,
        behaviour: ContinuousBehaviour::Random,
        gymnasium: None,
    };
    let data = load_or_generate(&spec_d, dir.path(), &mut |_| {}).expect("dataset");
    let steps: usize = data.episodes.iter().map(|e| e.len()).sum();
    let real = real_transitions(3, 1, &data.episodes).expect("real buffer");
    assert_eq!(real.len(), steps);
    // Pendulum only truncates: no transition is terminal.
    let mut rng = <rand::rngs::Xoshiro256PlusPlus as rand::SeedableRng>::seed_from_u64(1);
    let b = real.sample(64, &mut rng).expect("sample");
    assert!(b.done.iter().all(|&d| d == 0.0));

    let (spec, params) = untrained_pendulum_model();
    let ens = Ensemble::new(&spec, &params, &Device::Cpu).expect("ensemble");
    let cfg = PolicyPhaseConfig {
        real_ratio: 0.25,
        ..tiny_policy(5)
    };
    let (agent, curve) = policy_phase(
        &ens,
        "Pendulum-v1",
        &cfg,
        StartData {
            real: Some(&real),
            public: None,
        },
        &Device::Cpu,
        &mut |_| {},
    )
    .expect("MOPO policy phase");
    assert_eq!(agent.updates(), 40);
    assert!(curve.iter().all(|e| e.q_loss.is_finite()));
    // The real rows do reach the minibatch: the same transitions with a reward of 1e4 make the
    // critic's loss explode (8 of 32 rows with a target near 1e4), while at real_ratio = 0 the
    // same buffer changes nothing.
    let mut poisoned = ReplayBuffer::new(3, 1, real.len()).expect("buffer");
    let all = real.sample(real.len(), &mut rng).expect("sample");
    for k in 0..real.len() {
        poisoned
            .push(
                &all.obs[k * 3..(k + 1) * 3],
                &all.act[k..k + 1],
                1e4,
                &all.next_obs[k * 3..(k + 1) * 3],
                false,
            )
            .expect("push");
    }
    let q_loss = |ratio: f64| {
        let cfg = PolicyPhaseConfig {
            real_ratio: ratio,
            ..tiny_policy(5)
        };
        let starts = StartData {
            real: Some(&poisoned),
            public: None,
        };
        let (_, c) = policy_phase(&ens, "Pendulum-v1", &cfg, starts, &Device::Cpu, &mut |_| {})
            .expect("policy phase");
        c.last().expect("epochs").q_loss
    };
    let clean = curve.last().expect("epochs").q_loss;
    let (mixed, unmixed) = (q_loss(0.25), q_loss(0.0));
    assert!(clean < 1e4 && unmixed < 1e4, "{clean} {unmixed}");
    assert!(
        mixed > 1e6,
        "real rows with reward 1e4 left the critic's loss at {mixed}"
    );
    let Err(err) = policy_phase(
        &ens,
        "Pendulum-v1",
        &cfg,
        StartData::default(),
        &Device::Cpu,
        &mut |_| {},
    ) else {
        panic!("real_ratio without real data must be refused");
    };
    assert!(
        err.to_string().contains("need the real transitions"),
        "{err}"
    );
}

/// Every state a transition of `episodes` starts from (Pendulum: 3 components), bit for bit.
fn states_of(episodes: &[&ContinuousEpisode]) -> HashSet<Vec<u32>> {
    episodes
        .iter()
        .flat_map(|e| {
            e.observations[..e.len() * 3]
                .chunks(3)
                .map(|o| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// How many of the concatenated start states `starts` are in `set`.
fn count_in(set: &HashSet<Vec<u32>>, starts: &[f32]) -> usize {
    starts
        .chunks(3)
        .filter(|o| set.contains(&o.iter().map(|x| x.to_bits()).collect::<Vec<_>>()))
        .count()
}

/// MOPO branches `data_start_fraction` of its rollouts from dataset states; PriMORL's start
/// from the public initial distribution (or earlier model states) and never from the data.
#[test]
fn rollouts_branch_from_dataset_states_only_when_asked() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_d = ContinuousDatasetSpec {
        env: "Pendulum-v1".into(),
        units: 4,
        public: 1,
        seed: 11,
        behaviour: ContinuousBehaviour::Random,
        gymnasium: None,
    };
    let data = load_or_generate(&spec_d, dir.path(), &mut |_| {}).expect("dataset");
    let real = real_transitions(3, 1, &data.episodes).expect("real buffer");
    let data_states = states_of(&data.episodes.iter().collect::<Vec<_>>());
    let in_data = |starts: &[f32]| count_in(&data_states, starts);
    let model = ReplayBuffer::new(3, 1, 8).expect("model buffer");
    let mut env = fedrl_sim::make("Pendulum-v1").expect("env");
    let mut rng = <rand::rngs::Xoshiro256PlusPlus as rand::SeedableRng>::seed_from_u64(2);
    let n = 400;
    let with = |f: f64| PolicyPhaseConfig {
        rollout_batch: n,
        data_start_fraction: f,
        ..tiny_policy(0)
    };
    let from_real = StartData {
        real: Some(&real),
        public: None,
    };
    let all =
        rollout_starts(&with(1.0), from_real, &model, &mut rng, env.as_mut()).expect("starts");
    assert_eq!(all.len(), n * 3);
    assert_eq!(in_data(&all), n);
    let half =
        rollout_starts(&with(0.5), from_real, &model, &mut rng, env.as_mut()).expect("starts");
    let k = in_data(&half);
    // Binomial(400, 0.5): 5.5 standard deviations either side.
    assert!((145..=255).contains(&k), "{k} of {n} from the data");
    let none =
        rollout_starts(&with(0.0), from_real, &model, &mut rng, env.as_mut()).expect("starts");
    assert_eq!(in_data(&none), 0);
    // Without the real transitions nothing can come from the data.
    let private = rollout_starts(
        &with(1.0),
        StartData::default(),
        &model,
        &mut rng,
        env.as_mut(),
    )
    .expect("starts");
    assert_eq!(private.len(), n * 3);
    assert_eq!(in_data(&private), 0);
}

/// `public_start_fraction` branches rollouts from the public split's states and never from a
/// private trajectory's; a policy phase that asks for them without the public split is refused.
#[test]
fn public_starts_come_from_the_public_split_only() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_d = ContinuousDatasetSpec {
        env: "Pendulum-v1".into(),
        units: 4,
        public: 2,
        seed: 13,
        behaviour: ContinuousBehaviour::Random,
        gymnasium: None,
    };
    let data = load_or_generate(&spec_d, dir.path(), &mut |_| {}).expect("dataset");
    let (public, private) = data.split(spec_d.units);
    let (public_states, private_states) = (states_of(&public), states_of(&private));
    let n = 400;
    let with = |f: f64| PolicyPhaseConfig {
        rollout_batch: n,
        public_start_fraction: f,
        ..tiny_policy(0)
    };
    assert!(
        public_start_states(&with(0.0), &data, spec_d.units)
            .expect("no states")
            .is_none(),
        "a zero fraction keeps nothing"
    );
    let buffer = public_start_states(&with(0.5), &data, spec_d.units)
        .expect("public states")
        .expect("kept");
    let public_steps: usize = public.iter().map(|e| e.len()).sum();
    assert_eq!(buffer.len(), public_steps);
    let model = ReplayBuffer::new(3, 1, 8).expect("model buffer");
    let mut env = fedrl_sim::make("Pendulum-v1").expect("env");
    let mut rng = <rand::rngs::Xoshiro256PlusPlus as rand::SeedableRng>::seed_from_u64(5);
    let from_public = StartData {
        real: None,
        public: Some(&buffer),
    };
    let all =
        rollout_starts(&with(1.0), from_public, &model, &mut rng, env.as_mut()).expect("starts");
    assert_eq!(count_in(&public_states, &all), n);
    assert_eq!(count_in(&private_states, &all), 0);
    let half =
        rollout_starts(&with(0.5), from_public, &model, &mut rng, env.as_mut()).expect("starts");
    let k = count_in(&public_states, &half);
    // Binomial(400, 0.5): 5.5 standard deviations either side.
    assert!((145..=255).contains(&k), "{k} of {n} from the public split");
    assert_eq!(count_in(&private_states, &half), 0);

    let (spec, params) = untrained_pendulum_model();
    let ens = Ensemble::new(&spec, &params, &Device::Cpu).expect("ensemble");
    let Err(err) = policy_phase(
        &ens,
        "Pendulum-v1",
        &with(0.5),
        StartData::default(),
        &Device::Cpu,
        &mut |_| {},
    ) else {
        panic!("public_start_fraction without the public split must be refused");
    };
    assert!(err.to_string().contains("public split"), "{err}");
}

#[test]
fn normalised_pendulum_scores_follow_appendix_c() {
    assert_eq!(normalized_return("Pendulum-v1", -1500.0), 0.0);
    assert_eq!(normalized_return("Pendulum-v1", 0.0), 1000.0);
    assert!((normalized_return("Pendulum-v1", -150.0) - 900.0).abs() < 1e-9);
    assert_eq!(normalized_return("cartpole-balance", 812.5), 812.5);
}
