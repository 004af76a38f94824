//! DP-FedAvg of PPO local updates (seed 004, Algorithm 2) on CartPole-v1 users, in one process:
//! the learning half without the network. Each round a cohort of *fresh* users (each user
//! contributes once, so per-user epsilon is one Gaussian mechanism) plays with the current
//! policy, computes its clipped local update, and the server sums them in fixed point, adds
//! exact discrete Gaussian noise of standard deviation z C (`fixed_point::noisy_mean`, as the
//! aggregator does), divides by the fixed cohort size and steps. Every `--eval-every` rounds the policy is
//! evaluated greedily on 100 held-out users (never trained on): a non-private diagnostic.
//!
//! ```text
//! cargo run --release -p fedrl-rl --example fedavg_cartpole -- \
//!     [--epsilon 1] [--delta 1e-5] [--cohort 1000] [--rounds 60] [--clip 0.5] [--device cpu] ...
//! ```
//! `--epsilon 0` runs without noise. Noise here comes from a seeded generator (reproducible
//! research run; the real aggregator uses a CSPRNG).

use std::time::Instant;

use fedrl_common::device::DeviceSpec;
use fedrl_common::privacy::fixed_point::{noisy_mean, non_private_mean};
use fedrl_common::privacy::gaussian;
use fedrl_common::privacy::noise::DiscreteGaussianNoise;
use fedrl_rl::server_rule::ServerRule;
use fedrl_rl::{
    EvalConfig, LocalUpdateConfig, LocalUpdateExt, ModelSpec, collect_rollouts, device, evaluate,
    io, local_updates, local_updates_from_batches_adam_init,
};
use fedrl_sim::Env;

struct Args {
    env: String,
    epsilon: f64,
    delta: f64,
    cohort: usize,
    rounds: usize,
    server_lr: f64,
    server_momentum: f64,
    /// `sgd` (with momentum) or `adam` (DP-FedAdam: Adam on the released noisy mean update).
    server_opt: String,
    server_beta2: f64,
    server_eps: f64,
    /// Linear server learning-rate decay: `lr * max(lr_floor, 1 - round / decay_rounds)`
    /// (0: constant).
    decay_rounds: usize,
    lr_floor: f64,
    /// Time the rollouts and the local PPO updates separately (same results as together).
    split: bool,
    /// Seed 004's appendix C.2.3: every user's local Adam starts from the last released noisy
    /// mean update `u` as the gradient estimate `g0 = -S u` (first moment `g0`, second `g0^2`, no
    /// bias correction); `S` is this scale, 0 turns it off. Implies the split path.
    adam_init: f64,
    /// Clip schedule: the clip norm moves linearly from `clip` to `clip_final` over
    /// `clip_rounds` rounds (0: constant). Each user is in one round only (fresh), and the
    /// noise is z times that round's clip norm, so every user's epsilon stays the same.
    clip_final: f64,
    clip_rounds: usize,
    eval_every: usize,
    eval_users: usize,
    target: f64,
    seed: u64,
    save: Option<String>,
    device: DeviceSpec,
    cfg: LocalUpdateConfig,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        env: "CartPole-v1".into(),
        epsilon: 1.0,
        delta: 1e-5,
        cohort: 1024,
        rounds: 80,
        server_lr: 1.5,
        server_momentum: 0.0,
        server_opt: "sgd".into(),
        server_beta2: 0.99,
        server_eps: 1e-3,
        decay_rounds: 0,
        lr_floor: 0.1,
        split: false,
        adam_init: 0.0,
        clip_final: 0.0,
        clip_rounds: 0,
        eval_every: 2,
        eval_users: 100,
        target: 475.0,
        seed: 0,
        save: None,
        device: DeviceSpec::Cpu,
        cfg: LocalUpdateConfig::default(),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let key = argv[i].trim_start_matches("--").to_string();
        let val = argv
            .get(i + 1)
            .ok_or(format!("--{key} needs a value"))?
            .clone();
        let f = || val.parse::<f64>().map_err(|e| format!("--{key}: {e}"));
        let u = || val.parse::<usize>().map_err(|e| format!("--{key}: {e}"));
        let c = &mut a.cfg;
        match key.as_str() {
            "env" => a.env = val.clone(),
            "epsilon" => a.epsilon = f()?,
            "delta" => a.delta = f()?,
            "cohort" => a.cohort = u()?,
            "rounds" => a.rounds = u()?,
            "server-lr" => a.server_lr = f()?,
            "server-momentum" => a.server_momentum = f()?,
            "server-opt" => a.server_opt = val.clone(),
            "server-beta2" => a.server_beta2 = f()?,
            "server-eps" => a.server_eps = f()?,
            "decay-rounds" => a.decay_rounds = u()?,
            "lr-floor" => a.lr_floor = f()?,
            "split" => a.split = val == "1" || val == "true",
            "adam-init" => a.adam_init = f()?,
            "clip-final" => a.clip_final = f()?,
            "clip-rounds" => a.clip_rounds = u()?,
            "eval-every" => a.eval_every = u()?,
            "eval-users" => a.eval_users = u()?,
            "target" => a.target = f()?,
            "seed" => a.seed = u()? as u64,
            "save" => a.save = Some(val.clone()),
            "device" => a.device = val.parse().map_err(|e| format!("--device: {e}"))?,
            "clip" => c.clip_norm = f()?,
            "lr" => c.lr = f()?,
            "epochs" => c.epochs = u()?,
            "minibatches" => c.minibatches = u()?,
            "episodes" => c.episodes_per_user = u()?,
            "max-steps" => c.max_episode_steps = u()?,
            "ent" => c.ent_coef = f()?,
            "vf" => c.vf_coef = f()?,
            "gamma" => c.gamma = f()?,
            "lambda" => c.gae_lambda = f()?,
            "reward-scale" => c.reward_scale = f()?,
            "max-grad-norm" => c.max_grad_norm = f()?,
            "norm-adv" => c.normalize_advantages = val == "1" || val == "true",
            "hidden" => {
                c.hidden = val
                    .split(',')
                    .map(|s| s.parse::<usize>().map_err(|e| format!("--hidden: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "group" => c.group_size = u()?,
            "threads" => c.threads = u()?,
            _ => return Err(format!("unknown option --{key}")),
        }
        i += 2;
    }
    Ok(a)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: first statement of main, before any thread exists. Small MLPs run faster with
        // one candle thread per worker; parallelism comes from our own threads.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    fedrl_rl::alloc::tune_for_training();
    let a = parse()?;
    let dev = device::open(a.device)?;
    let make = |n: usize| -> Result<Vec<Box<dyn Env>>, fedrl_sim::SimError> {
        (0..n).map(|_| fedrl_sim::make(&a.env)).collect()
    };
    let probe = fedrl_sim::make(&a.env)?;
    let spec = ModelSpec::from_spaces(
        probe.observation_space(),
        probe.action_space(),
        &a.cfg.hidden,
    )?;
    let layout = spec.layout();
    let mut global = spec.init(a.seed);
    let z = if a.epsilon > 0.0 {
        gaussian::sigma(a.epsilon, a.delta)?
    } else {
        0.0
    };
    let eps_check = if z > 0.0 {
        gaussian::epsilon(z, a.delta)?
    } else {
        f64::INFINITY
    };
    println!(
        "env {} params {} cohort {} z {:.4} (user-level epsilon {:.4} at delta {:e}, fresh users) \
         noise std on the mean {:.3e}",
        a.env,
        layout.len(),
        a.cohort,
        z,
        eps_check,
        a.delta,
        z * a.cfg.clip_norm / a.cohort as f64
    );
    println!("config {:?}", a.cfg);
    let mut noise = DiscreteGaussianNoise::seeded(a.seed ^ 0xA5A5_5A5A);
    let mut envs = make(a.cohort)?;
    let mut eval_envs = make(a.eval_users)?;
    // Held-out users: seeds in a range training users never use.
    let eval_seeds: Vec<u64> = (0..a.eval_users as u64).map(|i| (1 << 62) + i).collect();
    let eval_cfg = EvalConfig::default();
    let mut momentum = vec![0.0f32; layout.len()];
    let mut second = vec![0.0f32; layout.len()];
    let rule = if a.server_opt == "adam" {
        ServerRule::Adam {
            beta1: a.server_momentum,
            beta2: a.server_beta2,
            eps: a.server_eps,
        }
    } else {
        ServerRule::Sgd {
            momentum: a.server_momentum,
        }
    };
    let start = Instant::now();
    let mut users = 0usize;
    let mut steps = 0usize;
    let mut solved = None;
    // The last released noisy mean update (public), for --adam-init.
    let mut last_mean: Option<Vec<f32>> = None;
    let (mut t_rollout, mut t_train, mut t_noise, mut t_eval) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let clip0 = a.cfg.clip_norm;
    for round in 0..a.rounds {
        let mut cfg = a.cfg.clone();
        if a.clip_rounds > 0 {
            let f = (round as f64 / a.clip_rounds as f64).min(1.0);
            cfg.clip_norm = clip0 + (a.clip_final - clip0) * f;
        }
        let seeds: Vec<u64> = (0..a.cohort as u64)
            .map(|i| a.seed.wrapping_mul(1 << 40) + (round * a.cohort) as u64 + i)
            .collect();
        let t0 = Instant::now();
        let ups = if a.split || a.adam_init > 0.0 {
            // The same work as `local_updates`, in two timed phases: rollouts on the worker
            // threads, then the batched local PPO updates.
            let per = envs.len().div_ceil(a.cfg.threads.max(1)).max(1);
            let rollout = a.cfg.rollout();
            let parts: Vec<_> = std::thread::scope(|s| {
                let hs: Vec<_> = envs
                    .chunks_mut(per)
                    .zip(seeds.chunks(per))
                    .map(|(e, sd)| {
                        let (spec, global, rollout, dev) = (&spec, &global, &rollout, &dev);
                        s.spawn(move || collect_rollouts(spec, global, e, sd, rollout, dev))
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().expect("rollout thread"))
                    .collect()
            });
            let mut batches = Vec::new();
            for p in parts {
                batches.extend(p?);
            }
            let t_roll = t0.elapsed().as_secs_f64();
            let g0: Option<Vec<f32>> = last_mean
                .as_ref()
                .filter(|_| a.adam_init > 0.0)
                .map(|m| m.iter().map(|x| -x * a.adam_init as f32).collect());
            let ups = local_updates_from_batches_adam_init(
                &spec,
                &global,
                &batches,
                &seeds,
                &cfg,
                &dev,
                g0.as_deref(),
            )?;
            t_rollout += t_roll;
            t_train += t0.elapsed().as_secs_f64() - t_roll;
            ups
        } else {
            local_updates(&spec, &global, &mut envs, &seeds, &cfg, &dev)?
        };
        let t_local = t0.elapsed().as_secs_f64();
        users += ups.len();
        let round_steps: usize = ups.iter().map(|u| u.steps).sum();
        steps += round_steps;
        let train_ret = ups.iter().flat_map(|u| &u.episode_returns).sum::<f64>()
            / ups
                .iter()
                .map(|u| u.episode_returns.len())
                .sum::<usize>()
                .max(1) as f64;
        let clipped = ups
            .iter()
            .filter(|u| u.norm_before_clip > cfg.clip_norm)
            .count();
        // The project's one noisy aggregation (fixed point, exact discrete Gaussian noise over
        // the fixed cohort size), or the plain mean without noise. `local_updates` clipped the
        // deltas already; `noisy_mean` re-clips, as the aggregator does.
        let t_agg = Instant::now();
        let deltas = ups.iter().map(|u| u.delta.as_slice());
        let mean = if z > 0.0 {
            noisy_mean(
                deltas,
                layout.len(),
                cfg.clip_norm,
                z,
                a.cohort as f64,
                &mut noise,
            )?
            .mean
        } else {
            non_private_mean(deltas, layout.len(), a.cohort as f64)?
        };
        t_noise += t_agg.elapsed().as_secs_f64();
        last_mean = Some(mean.clone());
        let lr = if a.decay_rounds > 0 {
            a.server_lr * (1.0 - round as f64 / a.decay_rounds as f64).max(a.lr_floor)
        } else {
            a.server_lr
        };
        // The aggregator's rule (`fedrl_rl::server_rule`), with this example's decay of lr.
        rule.apply(
            lr,
            round as u64 + 1,
            &mut global,
            &mut momentum,
            &mut second,
            &mean,
        );
        let mean_norm: f64 = mean.iter().map(|u| (*u as f64).powi(2)).sum();
        let mut line = format!(
            "round {round:3} users {users:7} steps {steps:9} train-return {train_ret:7.1} \
             clipped {clipped:4}/{} noisy-mean-norm {:.4} local {t_local:6.2}s elapsed {:6.1}s",
            ups.len(),
            mean_norm.sqrt(),
            start.elapsed().as_secs_f64()
        );
        if (round + 1) % a.eval_every.max(1) == 0 || round + 1 == a.rounds {
            let t_e = Instant::now();
            let r = evaluate(&spec, &global, &mut eval_envs, &eval_seeds, &eval_cfg, &dev)?;
            t_eval += t_e.elapsed().as_secs_f64();
            line += &format!(" | eval {:.1} +- {:.1}", r.mean, r.std);
            if r.mean >= a.target && solved.is_none() {
                solved = Some((round + 1, users, steps, start.elapsed().as_secs_f64()));
            }
        }
        println!("{line}");
        if solved.is_some() {
            break;
        }
    }
    // One machine-readable line for the variant sweep (bench/run_dppg_variants.sh).
    let (r, u, s, t) = solved.unwrap_or((a.rounds, users, steps, start.elapsed().as_secs_f64()));
    println!(
        "TIMES rollouts {t_rollout:.2} s, local PPO {t_train:.2} s (with --split 1), noisy \
         aggregation {t_noise:.2} s, evaluation {t_eval:.2} s"
    );
    println!(
        "RESULT {{\"solved\":{},\"rounds\":{r},\"users\":{u},\"env_steps\":{s},\"seconds\":{t:.2}}}",
        solved.is_some()
    );
    match solved {
        Some((r, u, s, t)) => println!(
            "SOLVED: eval >= {} after {r} rounds, {u} users, {s} env steps, {t:.1} s, \
             epsilon {eps_check:.4} (delta {:e})",
            a.target, a.delta
        ),
        None => println!(
            "not solved in {} rounds ({:.1} s)",
            a.rounds,
            start.elapsed().as_secs_f64()
        ),
    }
    if let Some(path) = &a.save {
        io::save(std::path::Path::new(path), &spec, &global)?;
        println!("saved {path}");
    }
    Ok(())
}
