//! The DPPG client step (seed 004, Algorithms 2 and 3): each user plays its episode(s) with the
//! current global policy, runs E epochs of PPO over minibatches of its own data with a fresh
//! Adam, and returns its delta (local minus global, policy and value) clipped to L2 norm C.
//!
//! Users are trained together: a group of U users' parameter copies is stacked into `[U, ...]`
//! tensors and every PPO step is one batched forward/backward (3-D matmuls), with per-user Adam
//! moments. Each user's gradient comes only from its own loss term, so one user's update never
//! depends on another user's data; Adam state lives for one call and is never carried between
//! users or rounds (seed 004, appendix C.2.3).

use candle_core::{DType, Device, Tensor, Var};
use fedrl_sim::Env;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;

use crate::mlp::{ModelSpec, ParamLayout};
use crate::ppo::{Minibatch, PpoCoefs, gae, normalize, ppo_loss};
use crate::rollout::{RolloutConfig, UserBatch, action_dim, mix, run_users};
use crate::{NnError, Result, policy};
use fedrl_common::privacy::clipping::clip_l2;

/// The local update's hyper-parameters are plain scenario data (they travel in the task JSON);
/// this crate adds what needs the model ([`LocalUpdateExt`]).
pub use fedrl_common::task::LocalUpdateConfig;

/// What a [`LocalUpdateConfig`] implies for the model and the rollouts.
pub trait LocalUpdateExt {
    /// The rollout part.
    fn rollout(&self) -> RolloutConfig;

    /// The policy/value model for an environment's spaces with this config's hidden sizes,
    /// initial log-std, observation normalisation and action range (checked).
    fn model_spec(&self, obs: &fedrl_sim::Space, action: &fedrl_sim::Space) -> Result<ModelSpec>;
}

impl LocalUpdateExt for LocalUpdateConfig {
    fn rollout(&self) -> RolloutConfig {
        RolloutConfig {
            episodes_per_user: self.episodes_per_user,
            max_episode_steps: self.max_episode_steps,
        }
    }

    fn model_spec(&self, obs: &fedrl_sim::Space, action: &fedrl_sim::Space) -> Result<ModelSpec> {
        let mut spec = ModelSpec::from_spaces(obs, action, &self.hidden)?;
        spec.init_log_std = self.init_log_std;
        spec.obs_offset = self.obs_offset.clone();
        spec.obs_scale = self.obs_scale.clone();
        spec.action_low = self.action_low.clone();
        spec.action_high = self.action_high.clone();
        spec.action_repeat = self.action_repeat.max(1);
        spec.check_preprocessing()?;
        Ok(spec)
    }
}

/// The PPO loss coefficients of a local update configuration.
fn ppo_coefs(cfg: &LocalUpdateConfig) -> PpoCoefs {
    PpoCoefs {
        clip_eps: cfg.clip_eps,
        vf_coef: cfg.vf_coef,
        ent_coef: cfg.ent_coef,
    }
}

/// One user's contribution.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalUpdate {
    /// Local minus global parameters (layout order), clipped to L2 norm `clip_norm`.
    pub delta: Vec<f32>,
    /// L2 norm of the delta before clipping.
    pub norm_before_clip: f64,
    /// Environment steps the user took.
    pub steps: usize,
    /// Undiscounted return of each of the user's episodes (a non-private diagnostic).
    pub episode_returns: Vec<f64>,
}

/// The full client step for many users: collect each user's episodes in its own environment
/// (`envs[u]`, seeded by `seeds[u]`) with the `global` parameters, then run the batched local
/// PPO update. Returns one clipped delta per user, in input order. Tensors live on `device`
/// (every worker thread uses it); the deltas come back as `Vec<f32>`.
pub fn local_updates(
    spec: &ModelSpec,
    global: &[f32],
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    cfg: &LocalUpdateConfig,
    device: &Device,
) -> Result<Vec<LocalUpdate>> {
    let layout = spec.layout();
    layout.check(global)?;
    if envs.len() != seeds.len() {
        return Err(NnError::Invalid(format!(
            "{} environments but {} seeds",
            envs.len(),
            seeds.len()
        )));
    }
    let threads = cfg.threads.max(1).min(envs.len().max(1));
    let per = envs.len().div_ceil(threads);
    let mut one = cfg.clone();
    one.threads = 1;
    let rollout = cfg.rollout();
    std::thread::scope(|s| {
        let handles: Vec<_> = envs
            .chunks_mut(per.max(1))
            .zip(seeds.chunks(per.max(1)))
            .map(|(envs, seeds)| {
                let (layout, one, rollout) = (&layout, &one, &rollout);
                s.spawn(move || {
                    let batches = run_users(
                        spec, layout, global, envs, seeds, rollout, false, true, device,
                    )?;
                    let starts = vec![global; batches.len()];
                    train_users(spec, layout, &starts, &batches, seeds, one, device, None)
                })
            })
            .collect();
        join_in_order(handles)
    })
}

/// [`local_updates`] where every user has parameters of its own (e.g. an expert that keeps
/// learning across iterations): user `u` plays its episodes in `envs[u]` with `params[u]` and
/// runs the local PPO update from `params[u]`; its delta is relative to `params[u]` and clipped
/// to `cfg.clip_norm` (pass infinity for no clip). With every `params[u]` equal to one global
/// vector the training is that of [`local_updates`]; the acting differs only in the
/// floating-point order of the forward pass (plain `f32` on the CPU instead of `device`).
pub fn local_updates_own(
    spec: &ModelSpec,
    params: &[&[f32]],
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    cfg: &LocalUpdateConfig,
    device: &Device,
) -> Result<Vec<LocalUpdate>> {
    let layout = spec.layout();
    if envs.len() != seeds.len() || envs.len() != params.len() {
        return Err(NnError::Invalid(format!(
            "{} environments, {} seeds and {} parameter vectors",
            envs.len(),
            seeds.len(),
            params.len()
        )));
    }
    for p in params {
        layout.check(p)?;
    }
    let threads = cfg.threads.max(1).min(envs.len().max(1));
    let per = envs.len().div_ceil(threads).max(1);
    let mut one = cfg.clone();
    one.threads = 1;
    let rollout = cfg.rollout();
    std::thread::scope(|s| {
        let handles: Vec<_> = envs
            .chunks_mut(per)
            .zip(seeds.chunks(per))
            .zip(params.chunks(per))
            .map(|((envs, seeds), params)| {
                let (layout, one, rollout) = (&layout, &one, &rollout);
                s.spawn(move || {
                    let batches = crate::rollout::run_users_own(
                        spec, layout, params, envs, seeds, rollout, false, true,
                    )?;
                    train_users(spec, layout, params, &batches, seeds, one, device, None)
                })
            })
            .collect();
        join_in_order(handles)
    })
}

/// The local update from already collected data (`batches[u]` is user `u`'s data collected with
/// `global`; `seeds[u]` drives its minibatch shuffles). One clipped delta per user; tensors
/// live on `device`.
pub fn local_updates_from_batches(
    spec: &ModelSpec,
    global: &[f32],
    batches: &[UserBatch],
    seeds: &[u64],
    cfg: &LocalUpdateConfig,
    device: &Device,
) -> Result<Vec<LocalUpdate>> {
    local_updates_from_batches_adam_init(spec, global, batches, seeds, cfg, device, None)
}

/// [`local_updates_from_batches`] with every user's Adam started from a public gradient
/// estimate instead of zeros (seed 004, appendix C.2.3): first moment `g0`, second moment
/// `g0^2`, no bias correction (as a long-running optimizer whose statistics are replaced). `g0`
/// must be public, e.g. derived from the last released noisy mean update: anything one user's
/// data put there would reach every later user. Measured in `bench/README.md` (not adopted).
pub fn local_updates_from_batches_adam_init(
    spec: &ModelSpec,
    global: &[f32],
    batches: &[UserBatch],
    seeds: &[u64],
    cfg: &LocalUpdateConfig,
    device: &Device,
    adam_init: Option<&[f32]>,
) -> Result<Vec<LocalUpdate>> {
    let layout = spec.layout();
    layout.check(global)?;
    if let Some(g0) = adam_init {
        layout.check(g0)?;
    }
    if batches.len() != seeds.len() {
        return Err(NnError::Invalid(format!(
            "{} batches but {} seeds",
            batches.len(),
            seeds.len()
        )));
    }
    let threads = cfg.threads.max(1).min(batches.len().max(1));
    if threads == 1 {
        let starts = vec![global; batches.len()];
        return train_users(
            spec, &layout, &starts, batches, seeds, cfg, device, adam_init,
        );
    }
    let per = batches.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = batches
            .chunks(per)
            .zip(seeds.chunks(per))
            .map(|(b, sd)| {
                let layout = &layout;
                s.spawn(move || {
                    let starts = vec![global; b.len()];
                    train_users(spec, layout, &starts, b, sd, cfg, device, adam_init)
                })
            })
            .collect();
        join_in_order(handles)
    })
}

/// Joins the worker threads (every one, so none is left behind), in spawn order, and
/// concatenates their users' updates; a panicked worker becomes an error instead of taking the
/// caller down.
fn join_in_order(
    handles: Vec<std::thread::ScopedJoinHandle<'_, Result<Vec<LocalUpdate>>>>,
) -> Result<Vec<LocalUpdate>> {
    let parts: Vec<Result<Vec<LocalUpdate>>> = handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(NnError::Invalid("worker thread panicked".into())))
        })
        .collect();
    let mut out = Vec::new();
    for part in parts {
        out.extend(part?);
    }
    Ok(out)
}

/// One user's prepared data.
struct Prepared<'a> {
    b: &'a UserBatch,
    adv: Vec<f32>,
    ret: Vec<f32>,
    seed: u64,
}

/// Trains users on the current thread, grouping users of similar length to limit padding; user
/// `u` starts from `starts[u]` and its delta is relative to it. `adam_init`: an optional public
/// Adam initialisation (see [`local_updates_from_batches_adam_init`]).
#[allow(clippy::too_many_arguments)] // internal
pub(crate) fn train_users(
    spec: &ModelSpec,
    layout: &ParamLayout,
    starts: &[&[f32]],
    batches: &[UserBatch],
    seeds: &[u64],
    cfg: &LocalUpdateConfig,
    device: &Device,
    adam_init: Option<&[f32]>,
) -> Result<Vec<LocalUpdate>> {
    let prepared: Vec<Prepared> = batches
        .iter()
        .zip(seeds)
        .map(|(b, &seed)| {
            let (mut adv, ret) = gae(b, cfg.gamma, cfg.gae_lambda, cfg.reward_scale);
            if cfg.normalize_advantages {
                normalize(&mut adv);
            }
            Prepared { b, adv, ret, seed }
        })
        .collect();
    let mut order: Vec<usize> = (0..batches.len()).collect();
    order.sort_by_key(|&u| batches[u].len());
    let mut out: Vec<Option<LocalUpdate>> = vec![None; batches.len()];
    for group in order.chunks(cfg.group_size.max(1)) {
        let users: Vec<&Prepared> = group.iter().map(|&u| &prepared[u]).collect();
        let group_starts: Vec<&[f32]> = group.iter().map(|&u| starts[u]).collect();
        let deltas = train_group(spec, layout, &group_starts, &users, cfg, device, adam_init)?;
        for (&u, mut delta) in group.iter().zip(deltas) {
            let norm = clip_l2(&mut delta, cfg.clip_norm).norm;
            out[u] = Some(LocalUpdate {
                delta,
                norm_before_clip: norm,
                steps: batches[u].len(),
                episode_returns: batches[u].episode_returns.clone(),
            });
        }
    }
    out.into_iter()
        .map(|o| o.ok_or_else(|| NnError::Invalid("user left untrained".into())))
        .collect()
}

/// E epochs of minibatch PPO with per-user Adam for a group of users, user `u` starting from
/// `starts[u]`; unclipped deltas (local minus start).
fn train_group(
    spec: &ModelSpec,
    layout: &ParamLayout,
    starts: &[&[f32]],
    users: &[&Prepared],
    cfg: &LocalUpdateConfig,
    device: &Device,
    adam_init: Option<&[f32]>,
) -> Result<Vec<Vec<f32>>> {
    let copies = starts;
    // All of a user's parameters in one row: Adam and the gradient clip are a few whole-tensor
    // operations instead of a dozen per parameter tensor.
    let theta = Var::from_tensor(&layout.stack_flat(copies, device)?)?;
    let (mut m, mut v, bias_correct) = match adam_init {
        Some(g0) => {
            let row = Tensor::from_slice(g0, (1, g0.len()), device)?;
            let m = row.broadcast_as(theta.as_tensor().shape())?.contiguous()?;
            let v = m.sqr()?;
            (m, v, false)
        }
        None => {
            let m = theta.as_tensor().zeros_like()?;
            (m.clone(), m, true)
        }
    };
    let obs_dim = spec.obs_dim;
    let a_dim = action_dim(&spec.action);
    let coefs = ppo_coefs(cfg);
    let mb_count = cfg.minibatches.max(1);
    let mut rngs: Vec<Xoshiro256PlusPlus> = users
        .iter()
        .map(|p| Xoshiro256PlusPlus::seed_from_u64(mix(p.seed, 1 << 40)))
        .collect();
    let mut perms: Vec<Vec<usize>> = users.iter().map(|p| (0..p.b.len()).collect()).collect();
    let mut step = 0i32;
    for _epoch in 0..cfg.epochs {
        for (perm, rng) in perms.iter_mut().zip(rngs.iter_mut()) {
            perm.shuffle(rng);
        }
        for k in 0..mb_count {
            // User u's minibatch k: the k-th of mb_count near-equal slices of its permutation.
            let slices: Vec<&[usize]> = perms
                .iter()
                .map(|p| {
                    let n = p.len();
                    &p[k * n / mb_count..(k + 1) * n / mb_count]
                })
                .collect();
            let width = slices.iter().map(|s| s.len()).max().unwrap_or(0).max(1);
            let mb = build_minibatch(spec, users, &slices, width, obs_dim, a_dim, device)?;
            let params = layout.split(theta.as_tensor())?;
            let loss = ppo_loss(spec, layout, &params, &mb, &coefs)?.sum_all()?;
            let grads = loss.backward()?;
            let mut g = match grads.get(theta.as_tensor()) {
                Some(t) => t.clone(),
                None => theta.as_tensor().zeros_like()?,
            };
            if cfg.max_grad_norm > 0.0 {
                // Per-user scale min(1, max / |g_u|).
                let norm = g.sqr()?.sum_keepdim(1)?.sqrt()?;
                let scale = (norm + 1e-6)?
                    .recip()?
                    .affine(cfg.max_grad_norm, 0.0)?
                    .clamp(0.0, 1.0)?;
                g = g.broadcast_mul(&scale)?;
            }
            step += 1;
            let (bc1, bc2) = if bias_correct {
                (
                    1.0 - cfg.adam_beta1.powi(step),
                    1.0 - cfg.adam_beta2.powi(step),
                )
            } else {
                (1.0, 1.0)
            };
            m = ((&m * cfg.adam_beta1)? + (&g * (1.0 - cfg.adam_beta1))?)?;
            v = ((&v * cfg.adam_beta2)? + (g.sqr()? * (1.0 - cfg.adam_beta2))?)?;
            let denom = ((&v * (1.0 / bc2))?.sqrt()? + cfg.adam_eps)?;
            let upd = ((&m * (cfg.lr / bc1))? / denom)?;
            let new = (theta.as_tensor() - upd)?;
            theta.set(&new)?;
        }
    }
    let local = layout.unstack_flat(theta.as_tensor())?;
    Ok(local
        .into_iter()
        .zip(starts)
        .map(|(l, s)| l.iter().zip(s.iter()).map(|(a, b)| a - b).collect())
        .collect())
}

/// Pads the chosen steps of every user to `width` and builds the minibatch tensors.
fn build_minibatch(
    spec: &ModelSpec,
    users: &[&Prepared],
    slices: &[&[usize]],
    width: usize,
    obs_dim: usize,
    a_dim: usize,
    device: &Device,
) -> Result<Minibatch> {
    let u_n = users.len();
    let mut obs = vec![0.0f32; u_n * width * obs_dim];
    let mut act = vec![0.0f32; u_n * width * a_dim];
    let mut logp = vec![0.0f32; u_n * width];
    let mut adv = vec![0.0f32; u_n * width];
    let mut ret = vec![0.0f32; u_n * width];
    let mut mask = vec![0.0f32; u_n * width];
    let mut inv = vec![0.0f32; u_n];
    for (u, (p, idx)) in users.iter().zip(slices).enumerate() {
        for (j, &t) in idx.iter().enumerate() {
            let r = u * width + j;
            obs[r * obs_dim..(r + 1) * obs_dim]
                .copy_from_slice(&p.b.obs[t * obs_dim..(t + 1) * obs_dim]);
            act[r * a_dim..(r + 1) * a_dim]
                .copy_from_slice(&p.b.actions[t * a_dim..(t + 1) * a_dim]);
            logp[r] = p.b.logp[t];
            adv[r] = p.adv[t];
            ret[r] = p.ret[t];
            mask[r] = 1.0;
        }
        inv[u] = 1.0 / (idx.len().max(1) as f32);
    }
    Ok(Minibatch {
        obs: Tensor::from_vec(obs, (u_n, width, obs_dim), device)?,
        actions: policy::actions_tensor(&spec.action, act, u_n, width, device)?,
        logp_old: Tensor::from_vec(logp, (u_n, width), device)?,
        adv: Tensor::from_vec(adv, (u_n, width), device)?,
        returns: Tensor::from_vec(ret, (u_n, width), device)?,
        mask: Tensor::from_vec(mask, (u_n, width), device)?.to_dtype(DType::F32)?,
        inv_count: Tensor::from_vec(inv, (u_n, 1), device)?,
    })
}
