//! Discrete CQL, per-example gradients and per-unit clipping (issue 12, Build §3 and the
//! per-unit gradient core of §2).

use fedrl_common::offline::CqlConfig;
use fedrl_rl::candle_core::Device;
use fedrl_rl::offline::{
    Adam, CqlTrainer, QNetSpec, TransitionBatch, clipped_sum, evaluate_greedy, loss_and_grad,
    per_unit_clipped, train_cql,
};
use fedrl_sim::{Action, Env};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

const CPU: Device = Device::Cpu;

fn small_spec() -> QNetSpec {
    QNetSpec {
        obs_dim: 4,
        hidden: vec![16, 8],
        n_actions: 3,
    }
}

fn cfg_for(spec: &QNetSpec) -> CqlConfig {
    CqlConfig {
        hidden: spec.hidden.clone(),
        alpha: 0.7,
        gamma: 0.95,
        ..CqlConfig::default()
    }
}

/// `n` random transitions; rewards of either sign and size, so both Huber regimes occur, and a
/// mix of terminal and non-terminal rows.
fn random_batch(spec: &QNetSpec, n: usize, seed: u64, scale: f32) -> TransitionBatch {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut b = TransitionBatch::new(spec.obs_dim);
    for _ in 0..n {
        for _ in 0..spec.obs_dim {
            b.obs.push(scale * rng.random_range(-2.0f32..2.0));
            b.next_obs.push(scale * rng.random_range(-2.0f32..2.0));
        }
        b.actions.push(rng.random_range(0..spec.n_actions as u32));
        b.rewards.push(rng.random_range(-3.0f32..3.0));
        b.terminals
            .push(if rng.random_bool(0.3) { 1.0 } else { 0.0 });
    }
    b
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt()
}

/// `|a - b| <= rel * |b|` (L2), with a message naming `what`.
fn assert_close(a: &[f32], b: &[f32], rel: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let diff: Vec<f32> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    let (d, n) = (norm(&diff), norm(b));
    assert!(d <= rel * n + 1e-12, "{what}: |a-b| = {d:e}, |b| = {n:e}");
}

/// Per-example gradients (one row per unit, no clipping) equal `loss_and_grad` on each row
/// alone; multi-row units equal `loss_and_grad` on the unit's rows (the mean), and every
/// unit's norm is its gradient's norm.
#[test]
fn per_example_gradients_match_single_example_loop() {
    let spec = small_spec();
    let cfg = cfg_for(&spec);
    let params = spec.init(1);
    let target = spec.init(2);
    let batch = random_batch(&spec, 12, 3, 1.0);
    let units: Vec<u32> = (0..12).collect();
    let out =
        per_unit_clipped(&spec, &cfg, &params, &target, &batch, &units, 12, 1e9, &CPU).unwrap();
    for i in 0..12 {
        let (_, g) =
            loss_and_grad(&spec, &cfg, &params, &target, &batch.select(&[i]), &CPU).unwrap();
        assert_close(&out.grads[i], &g, 1e-5, &format!("row {i}"));
        assert!(
            (out.norms[i] - norm(&g)).abs() <= 1e-5 * norm(&g),
            "norm of row {i}"
        );
    }
    // Multi-row units, units of one row next to an empty one, uniform units of 3 rows, and a
    // unit large enough for the batched-matmul Gram path (a unit without rows gets a zero
    // gradient).
    for counts in [
        vec![10, 2],
        vec![3usize, 0, 5, 4],
        vec![1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        vec![3; 4],
    ] {
        check_groups(&spec, &cfg, &params, &target, &batch, &counts);
    }
}

fn check_groups(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    params: &[f32],
    target: &[f32],
    batch: &TransitionBatch,
    counts: &[usize],
) {
    let units: Vec<u32> = counts
        .iter()
        .enumerate()
        .flat_map(|(u, &k)| std::iter::repeat_n(u as u32, k))
        .collect();
    let n_units = counts.len();
    let out =
        per_unit_clipped(spec, cfg, params, target, batch, &units, n_units, 1e9, &CPU).unwrap();
    let mut start = 0;
    for (u, &k) in counts.iter().enumerate() {
        if k == 0 {
            assert!(out.grads[u].iter().all(|&x| x == 0.0));
            assert_eq!(out.norms[u], 0.0);
            continue;
        }
        let rows: Vec<usize> = (start..start + k).collect();
        let (_, g) = loss_and_grad(spec, cfg, params, target, &batch.select(&rows), &CPU).unwrap();
        assert_close(&out.grads[u], &g, 1e-5, &format!("unit {u} of {counts:?}"));
        assert!(
            (out.norms[u] - norm(&g)).abs() <= 1e-4 * norm(&g),
            "norm of unit {u}"
        );
        start += k;
    }
}

/// An independent f64 implementation of the CQL loss (module docs of `cql`), with the target
/// `y` computed once from `y_params` and frozen.
struct Reference<'a> {
    spec: &'a QNetSpec,
    batch: &'a TransitionBatch,
    alpha: f64,
    y: Vec<f64>,
}

fn forward64(spec: &QNetSpec, p: &[f64], x: &[f32]) -> Vec<f64> {
    let mut h: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let layers = spec.layers();
    for (l, s) in layers.iter().enumerate() {
        let mut z: Vec<f64> = (0..s.fan_out)
            .map(|o| {
                p[s.bias + o]
                    + (0..s.fan_in)
                        .map(|i| p[s.weight + o * s.fan_in + i] * h[i])
                        .sum::<f64>()
            })
            .collect();
        if l + 1 < layers.len() {
            z.iter_mut().for_each(|v| *v = v.max(0.0));
        }
        h = z;
    }
    h
}

impl<'a> Reference<'a> {
    fn new(
        spec: &'a QNetSpec,
        batch: &'a TransitionBatch,
        cfg: &CqlConfig,
        params: &[f64],
        target: &[f64],
    ) -> Self {
        let d = spec.obs_dim;
        let y = (0..batch.len())
            .map(|i| {
                let next = &batch.next_obs[i * d..(i + 1) * d];
                let qo = forward64(spec, params, next);
                let qt = forward64(spec, target, next);
                let mut a = 0;
                for j in 1..qo.len() {
                    if qo[j] > qo[a] {
                        a = j;
                    }
                }
                f64::from(batch.rewards[i])
                    + cfg.gamma * (1.0 - f64::from(batch.terminals[i])) * qt[a]
            })
            .collect();
        Reference {
            spec,
            batch,
            alpha: cfg.alpha,
            y,
        }
    }

    /// Mean loss and how many rows are in the quadratic Huber regime.
    fn loss(&self, p: &[f64]) -> (f64, usize) {
        let d = self.spec.obs_dim;
        let n = self.batch.len();
        let mut total = 0.0;
        let mut quadratic = 0;
        for i in 0..n {
            let q = forward64(self.spec, p, &self.batch.obs[i * d..(i + 1) * d]);
            let qa = q[self.batch.actions[i] as usize];
            let diff = qa - self.y[i];
            let huber = if diff.abs() < 1.0 {
                quadratic += 1;
                0.5 * diff * diff
            } else {
                diff.abs() - 0.5
            };
            let m = q.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + q.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            total += huber + self.alpha * (lse - qa);
        }
        (total / n as f64, quadratic)
    }
}

/// The loss equals an independent f64 implementation, and the gradient equals its central
/// finite differences (target frozen), coordinate by coordinate.
#[test]
fn cql_loss_and_gradient_match_finite_differences() {
    let spec = QNetSpec {
        obs_dim: 3,
        hidden: vec![6, 5],
        n_actions: 3,
    };
    let cfg = cfg_for(&spec);
    let params = spec.init(11);
    let target = spec.init(12);
    let batch = random_batch(&spec, 8, 13, 1.0);
    let (loss, grad) = loss_and_grad(&spec, &cfg, &params, &target, &batch, &CPU).unwrap();
    let p64: Vec<f64> = params.iter().map(|&v| f64::from(v)).collect();
    let t64: Vec<f64> = target.iter().map(|&v| f64::from(v)).collect();
    let reference = Reference::new(&spec, &batch, &cfg, &p64, &t64);
    let (ref_loss, quadratic) = reference.loss(&p64);
    assert!(
        quadratic > 0 && quadratic < batch.len(),
        "both Huber regimes must occur ({quadratic} of {} quadratic)",
        batch.len()
    );
    assert!(
        (loss - ref_loss).abs() <= 1e-5 * ref_loss.abs(),
        "{loss} vs {ref_loss}"
    );
    let h = 1e-6;
    let mut worst: f64 = 0.0;
    for k in 0..p64.len() {
        let mut plus = p64.clone();
        let mut minus = p64.clone();
        plus[k] += h;
        minus[k] -= h;
        let fd = (reference.loss(&plus).0 - reference.loss(&minus).0) / (2.0 * h);
        let err = (f64::from(grad[k]) - fd).abs();
        worst = worst.max(err);
        assert!(
            err <= 2e-5 + 1e-3 * fd.abs(),
            "coordinate {k}: {} vs {fd}",
            grad[k]
        );
    }
    assert!(norm(&grad) > 0.1, "a gradient that is not trivially zero");
    eprintln!("finite differences: worst abs error {worst:e}");
}

/// Every unit's clipped gradient has norm <= C (to the f32 rounding of the materialised
/// vector), is the unclipped gradient scaled down (same direction), and small gradients pass
/// unchanged; over many seeds, groupings and clip norms.
#[test]
fn every_unit_is_clipped_to_c() {
    let spec = small_spec();
    let cfg = cfg_for(&spec);
    let mut clipped = 0;
    let mut kept = 0;
    for seed in 0..40u64 {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(1000 + seed);
        let n_units = rng.random_range(1..8usize);
        let counts: Vec<usize> = (0..n_units).map(|_| rng.random_range(1..5usize)).collect();
        let units: Vec<u32> = counts
            .iter()
            .enumerate()
            .flat_map(|(u, &k)| std::iter::repeat_n(u as u32, k))
            .collect();
        let scale = [0.1f32, 1.0, 5.0][seed as usize % 3];
        let batch = random_batch(&spec, units.len(), seed, scale);
        let c = [0.05, 0.5, 3.0, 20.0][seed as usize % 4];
        let params = spec.init(seed);
        let target = spec.init(seed + 77);
        let free = per_unit_clipped(
            &spec, &cfg, &params, &target, &batch, &units, n_units, 1e12, &CPU,
        )
        .unwrap();
        let out = per_unit_clipped(
            &spec, &cfg, &params, &target, &batch, &units, n_units, c, &CPU,
        )
        .unwrap();
        for u in 0..n_units {
            let n = norm(&out.grads[u]);
            assert!(n <= c * (1.0 + 1e-5), "seed {seed} unit {u}: {n} > {c}");
            assert_eq!(out.norms[u], free.norms[u]);
            let want = (c / free.norms[u]).min(1.0) as f32;
            let scaled: Vec<f32> = free.grads[u].iter().map(|&x| x * want).collect();
            assert_close(&out.grads[u], &scaled, 1e-4, "direction");
            if free.norms[u] > c {
                clipped += 1;
            } else if free.norms[u] < 0.99 * c {
                kept += 1;
                assert_close(&out.grads[u], &free.grads[u], 1e-4, "unclipped unit");
            }
        }
    }
    assert!(clipped > 20 && kept > 20, "{clipped} clipped, {kept} kept");
}

/// A unit's clipped gradient does not change when another unit's data changes, nor does the
/// clipped sum of the other units.
#[test]
fn a_units_contribution_ignores_other_units_data() {
    let spec = small_spec();
    let cfg = cfg_for(&spec);
    let params = spec.init(5);
    let target = spec.init(6);
    let units: Vec<u32> = (0..5u32).flat_map(|u| [u, u]).collect();
    let batch = random_batch(&spec, 10, 21, 1.0);
    let mut changed = batch.clone();
    let other = random_batch(&spec, 10, 22, 4.0);
    for i in [6usize, 7] {
        let d = spec.obs_dim;
        changed.obs[i * d..(i + 1) * d].copy_from_slice(&other.obs[i * d..(i + 1) * d]);
        changed.next_obs[i * d..(i + 1) * d].copy_from_slice(&other.next_obs[i * d..(i + 1) * d]);
        changed.actions[i] = (batch.actions[i] + 1) % 3;
        changed.rewards[i] = 10.0 - batch.rewards[i];
        changed.terminals[i] = 1.0 - batch.terminals[i];
    }
    let c = 0.5;
    let a = per_unit_clipped(&spec, &cfg, &params, &target, &batch, &units, 5, c, &CPU).unwrap();
    let b = per_unit_clipped(&spec, &cfg, &params, &target, &changed, &units, 5, c, &CPU).unwrap();
    for u in [0usize, 1, 2, 4] {
        assert_eq!(a.grads[u], b.grads[u], "unit {u} changed");
        assert_eq!(a.norms[u], b.norms[u]);
    }
    assert_ne!(a.grads[3], b.grads[3], "the changed unit must change");
    // The sum minus unit 3's contribution is the same.
    let (sa, _) = clipped_sum(&spec, &cfg, &params, &target, &batch, &units, 5, c, &CPU).unwrap();
    let (sb, _) = clipped_sum(&spec, &cfg, &params, &target, &changed, &units, 5, c, &CPU).unwrap();
    let rest_a: Vec<f32> = sa.iter().zip(&a.grads[3]).map(|(s, g)| s - g).collect();
    let rest_b: Vec<f32> = sb.iter().zip(&b.grads[3]).map(|(s, g)| s - g).collect();
    assert_close(&rest_a, &rest_b, 1e-5, "others' sum");
}

/// `clipped_sum` (one weighted matmul per layer) equals the sum of `per_unit_clipped`, for
/// one-row units, multi-row units and a unit without rows.
#[test]
fn clipped_sum_equals_sum_of_per_unit() {
    let spec = small_spec();
    let cfg = cfg_for(&spec);
    let params = spec.init(8);
    let target = spec.init(9);
    let one_each: Vec<u32> = (0..16).collect();
    let grouped: Vec<u32> = [0u32, 0, 0, 2, 2, 3, 4, 4, 4, 4, 4, 5, 6, 6, 7, 7].to_vec();
    for (units, n_units) in [(one_each, 16usize), (grouped, 9)] {
        let batch = random_batch(&spec, 16, 31, 2.0);
        for c in [0.1, 1.0, 100.0] {
            let per = per_unit_clipped(
                &spec, &cfg, &params, &target, &batch, &units, n_units, c, &CPU,
            )
            .unwrap();
            let (sum, norms) = clipped_sum(
                &spec, &cfg, &params, &target, &batch, &units, n_units, c, &CPU,
            )
            .unwrap();
            let mut want = vec![0f32; spec.dim()];
            for g in &per.grads {
                want.iter_mut().zip(g).for_each(|(w, x)| *w += x);
            }
            assert_close(&sum, &want, 1e-5, "clipped sum");
            assert_eq!(norms, per.norms);
        }
    }
}

#[test]
fn bad_groupings_and_inputs_are_errors() {
    let spec = small_spec();
    let cfg = cfg_for(&spec);
    let p = spec.init(0);
    let batch = random_batch(&spec, 4, 0, 1.0);
    let run = |units: &[u32], n: usize, c: f64, b: &TransitionBatch| {
        clipped_sum(&spec, &cfg, &p, &p, b, units, n, c, &CPU)
    };
    assert!(run(&[0, 1, 1], 2, 1.0, &batch).is_err(), "length");
    assert!(run(&[0, 1, 0, 1], 2, 1.0, &batch).is_err(), "not grouped");
    assert!(
        run(&[0, 1, 2, 3], 3, 1.0, &batch).is_err(),
        "unit out of range"
    );
    assert!(run(&[0, 1, 2, 3], 4, 0.0, &batch).is_err(), "clip 0");
    assert!(run(&[0, 1, 2, 3], 4, f64::NAN, &batch).is_err(), "clip NaN");
    let mut bad = batch.clone();
    bad.actions[2] = 3;
    assert!(
        run(&[0, 1, 2, 3], 4, 1.0, &bad).is_err(),
        "action out of range"
    );
    let mut bad = batch.clone();
    bad.rewards[1] = f32::NAN;
    assert!(
        run(&[0, 1, 2, 3], 4, 1.0, &bad).is_err(),
        "non-finite reward"
    );
    assert!(loss_and_grad(&spec, &cfg, &p[1..], &p, &batch, &CPU).is_err());
}

/// Adam against steps computed by hand (PyTorch's formula, in f64 with Python), and its state
/// round trip.
#[test]
fn adam_matches_hand_computed_steps() {
    let mut adam = Adam::new(2, 0.1, 1e-8);
    let mut p = [0.5f32, -0.25];
    let want = [
        [0.400000001, -0.1500000005],
        [0.3067820382981611, -0.10305318370133484],
        [0.3415043888066561, -0.06676315830549237],
    ];
    let grads = [[1.0f32, -2.0], [0.5, 0.5], [-3.0, 0.0]];
    for (t, (g, w)) in grads.iter().zip(&want).enumerate() {
        adam.step(&mut p, g);
        for k in 0..2 {
            assert!(
                (f64::from(p[k]) - w[k]).abs() < 1e-6,
                "step {t}: {p:?} vs {w:?}"
            );
        }
        if t == 0 {
            // Restoring the state into a fresh optimizer continues identically.
            let mut other = Adam::new(2, 0.1, 1e-8);
            other.restore(&adam.state()).unwrap();
            let mut a = p;
            let mut b = p;
            let mut adam2 = adam.clone();
            adam2.step(&mut a, &grads[1]);
            other.step(&mut b, &grads[1]);
            assert_eq!(a, b);
            assert_eq!(other.steps(), 2);
        }
    }
    let mut fresh = Adam::new(2, 0.1, 1e-8);
    assert!(fresh.restore(&[0.0; 5]).is_err(), "length");
    assert!(
        fresh.restore(&[0.0, 1.5, 0.0, 0.0, 0.0, 0.0]).is_err(),
        "fractional step"
    );
    assert!(
        fresh.restore(&[0.0, 1.0, 0.0, 0.0, -1.0, 0.0]).is_err(),
        "negative v"
    );
    let big = Adam::new(1, 0.1, 1e-8);
    let mut s = big.state();
    s[0] = 3.0;
    s[1] = 5.0;
    let mut r = Adam::new(1, 0.1, 1e-8);
    r.restore(&s).unwrap();
    assert_eq!(r.steps(), 3 * (1 << 24) + 5);
    assert_eq!(r.state(), s);
}

/// A CartPole-v1 dataset from a noisy balancing heuristic (pole angle and angular velocity),
/// as units of one episode each.
fn heuristic_cartpole(episodes: usize, epsilon: f64, seed: u64) -> (TransitionBatch, f64) {
    let mut env = fedrl_sim::make("CartPole-v1").unwrap();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut data = TransitionBatch::new(4);
    let mut obs = [0f32; 4];
    let mut next = [0f32; 4];
    let mut total = 0.0;
    for e in 0..episodes {
        env.reset(seed * 1000 + e as u64, &mut obs);
        loop {
            let a = if rng.random_bool(epsilon) {
                rng.random_range(0..2usize)
            } else {
                usize::from(obs[2] + 0.5 * obs[3] > 0.0)
            };
            let step = env.step(Action::Discrete(a), &mut next).unwrap();
            data.obs.extend_from_slice(&obs);
            data.next_obs.extend_from_slice(&next);
            data.actions.push(a as u32);
            data.rewards.push(step.reward as f32);
            data.terminals.push(if step.terminated { 1.0 } else { 0.0 });
            total += step.reward;
            obs = next;
            if step.terminated || step.truncated {
                break;
            }
        }
    }
    (data, total / episodes as f64)
}

fn random_policy_return(episodes: usize) -> f64 {
    let mut env: Box<dyn Env> = fedrl_sim::make("CartPole-v1").unwrap();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(99);
    let mut obs = [0f32; 4];
    let mut total = 0.0;
    for e in 0..episodes {
        env.reset(500 + e as u64, &mut obs);
        loop {
            let step = env
                .step(Action::Discrete(rng.random_range(0..2usize)), &mut obs)
                .unwrap();
            total += step.reward;
            if step.terminated || step.truncated {
                break;
            }
        }
    }
    total / episodes as f64
}

/// Non-private CQL on a small heuristic CartPole dataset plays far better than random.
#[test]
fn train_cql_beats_random_on_cartpole() {
    let (data, behaviour) = heuristic_cartpole(30, 0.3, 4);
    let spec = QNetSpec {
        obs_dim: 4,
        hidden: vec![64, 64],
        n_actions: 2,
    };
    let cfg = CqlConfig {
        hidden: spec.hidden.clone(),
        learning_rate: 1e-3,
        batch_size: 64,
        target_update_interval: 200,
        ..CqlConfig::default()
    };
    let mut calls = 0u64;
    let mut last = f64::NAN;
    let params = train_cql(&spec, &cfg, &data, 3000, 7, &CPU, &mut |step, loss| {
        calls += 1;
        assert_eq!(step, calls);
        assert!(loss.is_finite());
        last = loss;
    })
    .unwrap();
    assert_eq!(calls, 3000);
    let eval = evaluate_greedy(&spec, &params, "CartPole-v1", 20, 123).unwrap();
    let random = random_policy_return(50);
    eprintln!(
        "behaviour {behaviour:.1}, random {random:.1}, CQL greedy {:.1} +- {:.1}, last loss {last:.3}",
        eval.mean, eval.std
    );
    assert_eq!(eval.returns.len(), 20);
    assert!(
        eval.mean > 100.0 && eval.mean > 4.0 * random,
        "{eval:?} vs random {random}"
    );
    // Same seeds, same evaluation.
    assert_eq!(
        evaluate_greedy(&spec, &params, "CartPole-v1", 20, 123).unwrap(),
        eval
    );
    assert!(evaluate_greedy(&spec, &params, "Acrobot-v1", 2, 0).is_err());
}

/// The target network is copied after steps 1, 1 + n, 1 + 2n (d3rlpy's schedule) and only then.
#[test]
fn target_copies_follow_the_interval() {
    let spec = small_spec();
    let cfg = CqlConfig {
        target_update_interval: 3,
        learning_rate: 1e-2,
        ..cfg_for(&spec)
    };
    let mut t = CqlTrainer::new(&spec, &cfg);
    assert_eq!(t.params, spec.init(cfg.model_seed));
    assert_eq!(t.target, t.params);
    let grad = vec![0.5f32; spec.dim()];
    let mut copied = Vec::new();
    for step in 1..=8u64 {
        let before = t.target.clone();
        t.apply(&grad);
        assert_eq!(t.steps(), step);
        if t.target != before {
            assert_eq!(t.target, t.params);
            copied.push(step);
        }
    }
    assert_eq!(copied, [1, 4, 7]);
}

/// fedrl's loss, gradient, Adam and target schedule against d3rlpy 2.8.1's own `DiscreteCQL`
/// run from the same parameters on the same batches
/// (`rl/tests/fixtures/d3rlpy_discrete_cql.json`, written by `bench/peers/d3rlpy_cql_vectors.py`).
#[test]
fn matches_d3rlpy_discrete_cql() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/d3rlpy_discrete_cql.json"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let meta = &doc["meta"];
    let floats = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let spec = QNetSpec {
        obs_dim: meta["obs_dim"].as_u64().unwrap() as usize,
        hidden: meta["hidden"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap() as usize)
            .collect(),
        n_actions: meta["n_actions"].as_u64().unwrap() as usize,
    };
    let cfg = CqlConfig {
        hidden: spec.hidden.clone(),
        gamma: meta["gamma"].as_f64().unwrap(),
        alpha: meta["alpha"].as_f64().unwrap(),
        learning_rate: meta["learning_rate"].as_f64().unwrap(),
        adam_eps: meta["adam_eps"].as_f64().unwrap(),
        target_update_interval: meta["target_update_interval"].as_u64().unwrap(),
        ..CqlConfig::default()
    };
    let mut t = CqlTrainer::from_params(floats(&doc["init"]), &cfg);
    let steps = doc["steps"].as_array().unwrap();
    assert!(steps.len() > 2 * cfg.target_update_interval as usize - 1);
    for (k, step) in steps.iter().enumerate() {
        let batch = TransitionBatch {
            obs_dim: spec.obs_dim,
            obs: floats(&step["obs"]),
            next_obs: floats(&step["next_obs"]),
            actions: step["actions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_u64().unwrap() as u32)
                .collect(),
            rewards: floats(&step["rewards"]),
            terminals: floats(&step["terminals"]),
        };
        let (loss, grad) = loss_and_grad(&spec, &cfg, &t.params, &t.target, &batch, &CPU).unwrap();
        let want_loss = step["loss"].as_f64().unwrap();
        assert!(
            (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
            "step {k}: loss {loss} vs d3rlpy {want_loss}"
        );
        assert_close(
            &grad,
            &floats(&step["grad"]),
            1e-5,
            &format!("step {k} gradient"),
        );
        t.apply(&grad);
        assert_close(
            &t.params,
            &floats(&step["params_after"]),
            1e-5,
            &format!("step {k} params"),
        );
        assert_close(
            &t.target,
            &floats(&step["target_after"]),
            1e-5,
            &format!("step {k} target"),
        );
    }
}

/// `clipped_sum` (one row per unit) against Opacus 1.6's per-sample clipping of the same loss
/// from the same parameters (`rl/tests/fixtures/opacus_clipped_cql.json`, written by
/// `bench/peers/opacus_clip_vectors.py`). Opacus divides by `|g_i| + 1e-6` and fedrl by a
/// rounding-safe upper bound of `|g_i|`: both differ from `|g_i|` by well under 1e-4 relative.
#[test]
fn clipped_sum_matches_opacus() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/opacus_clipped_cql.json"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let floats = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let meta = &doc["meta"];
    let spec = QNetSpec {
        obs_dim: meta["obs_dim"].as_u64().unwrap() as usize,
        hidden: vec![6, 5],
        n_actions: meta["n_actions"].as_u64().unwrap() as usize,
    };
    assert_eq!(meta["hidden"], serde_json::json!([6, 5]));
    let cfg = CqlConfig {
        hidden: spec.hidden.clone(),
        gamma: meta["gamma"].as_f64().unwrap(),
        alpha: meta["alpha"].as_f64().unwrap(),
        ..CqlConfig::default()
    };
    let batch = TransitionBatch {
        obs_dim: spec.obs_dim,
        obs: floats(&doc["obs"]),
        next_obs: floats(&doc["next_obs"]),
        actions: doc["actions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_u64().unwrap() as u32)
            .collect(),
        rewards: floats(&doc["rewards"]),
        terminals: floats(&doc["terminals"]),
    };
    let (params, target) = (floats(&doc["params"]), floats(&doc["target"]));
    let n = batch.len();
    let units: Vec<u32> = (0..n as u32).collect();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for case in cases {
        let c = case["clip_norm"].as_f64().unwrap();
        let (sum, _) =
            clipped_sum(&spec, &cfg, &params, &target, &batch, &units, n, c, &CPU).unwrap();
        assert_close(
            &sum,
            &floats(&case["clipped_sum"]),
            1e-4,
            &format!("C = {c}"),
        );
    }
}
