//! Soft Actor-Critic (Haarnoja et al. 2018, with the learned temperature of their follow-up
//! "SAC: Algorithms and Applications"; the update order of OpenAI Spinning Up): a tanh-squashed
//! Gaussian actor, twin Q-critics with Polyak-averaged targets, an online trainer over any
//! continuous-action [`Env`] and a replay buffer. This is the learning agent whose checkpoints
//! generate offline datasets, and the policy optimiser of seed 001's Algorithm 4.
//!
//! Networks are ReLU MLPs. The actor maps an observation to `2 * act_dim` values, the means
//! then the log standard deviations of the pre-squash Gaussian; the environment action is
//! `center + half * tanh(u)` per entry with `center = (low + high) / 2`, `half = (high - low) / 2`.
//! The critics see the observation followed by the squashed action in `[-1, 1]` (not environment
//! units), so their input scale does not depend on the action box.
//!
//! Parameters travel as flat `Vec<f32>` in PyTorch's layout: for every linear layer `l` of an
//! `nn.Sequential` of `Linear`/`ReLU` (so indices `0, 2, 4, ...`), `{net}.{2l}.weight` (`[out,
//! in]`) then `{net}.{2l}.bias` (`[out]`). Inside, the actor keeps weights as `[in, out]` and the
//! two critics are stacked (`[2, in, out]`) so one batched matmul serves both.

use std::path::Path;

use candle_core::{Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use fedrl_sim::{Action, Env, Space};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, StandardNormal, Uniform};
use serde::{Deserialize, Serialize};

use crate::offline::adam::Adam;
use crate::tensor_io::{self, read_f32};
use crate::{NnError, Result};

/// Metadata key of a saved agent: JSON of the dimensions, action box and [`SacConfig`].
pub const SAC_META_KEY: &str = "fedrl.sac";

/// Hyperparameters of SAC (defaults: Spinning Up / Haarnoja et al. 2018b).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SacConfig {
    /// Hidden layer widths of the actor and of each critic, input side first (ReLU after each).
    pub hidden: Vec<usize>,
    /// Adam step size of the actor.
    pub actor_lr: f64,
    /// Adam step size of the critics.
    pub critic_lr: f64,
    /// Adam step size of the log temperature.
    pub alpha_lr: f64,
    /// Discount factor per environment step.
    pub gamma: f64,
    /// Polyak coefficient: `target = (1 - tau) target + tau online` after every update.
    pub tau: f64,
    /// Transitions per update.
    pub batch_size: usize,
    /// Initial temperature alpha (nats of reward per nat of entropy); stored as its log.
    pub init_alpha: f64,
    /// Entropy the temperature steers towards (nats, of the action density in environment
    /// units). `None`: `-act_dim` (seed 001 uses -3).
    pub target_entropy: Option<f64>,
    /// Lower clamp of the actor's log standard deviation (pre-squash, nats).
    pub log_std_min: f64,
    /// Upper clamp of the actor's log standard deviation.
    pub log_std_max: f64,
}

impl Default for SacConfig {
    fn default() -> Self {
        SacConfig {
            hidden: vec![256, 256],
            actor_lr: 3e-4,
            critic_lr: 3e-4,
            alpha_lr: 3e-4,
            gamma: 0.99,
            tau: 0.005,
            batch_size: 256,
            init_alpha: 1.0,
            target_entropy: None,
            log_std_min: -20.0,
            log_std_max: 2.0,
        }
    }
}

impl SacConfig {
    /// Checks ranges: positive widths, learning rates and batch size, `gamma` and `tau` in
    /// `[0, 1]`, `init_alpha > 0`, `log_std_min < log_std_max`, everything finite.
    pub fn check(&self) -> Result<()> {
        let bad = |m: &str| Err(NnError::Invalid(format!("SAC config: {m}")));
        if self.hidden.is_empty() || self.hidden.contains(&0) {
            return bad("hidden widths must be positive (and at least one layer)");
        }
        for (name, v) in [
            ("actor_lr", self.actor_lr),
            ("critic_lr", self.critic_lr),
            ("alpha_lr", self.alpha_lr),
            ("init_alpha", self.init_alpha),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(&format!("{name} must be finite and > 0, got {v}"));
            }
        }
        if !(0.0..=1.0).contains(&self.gamma) || !(0.0..=1.0).contains(&self.tau) {
            return bad("gamma and tau must lie in [0, 1]");
        }
        if self.batch_size == 0 {
            return bad("batch_size must be > 0");
        }
        if self.target_entropy.is_some_and(|h| !h.is_finite()) {
            return bad("target_entropy must be finite");
        }
        if !(self.log_std_min.is_finite()
            && self.log_std_max.is_finite()
            && self.log_std_min < self.log_std_max)
        {
            return bad("log_std bounds must be finite with min < max");
        }
        Ok(())
    }
}

/// Soft TD target `y = r + gamma (1 - d) (min(q1', q2') - alpha logp')` per transition, on plain
/// slices: `reward` (reward units), `done` (1 terminal, 0 not), the target critics' values at
/// `(s', a')` and the log density of `a'` (nats). All slices must have the same length.
pub fn td_target(
    reward: &[f32],
    done: &[f32],
    q1_next: &[f32],
    q2_next: &[f32],
    logp_next: &[f32],
    alpha: f32,
    gamma: f32,
) -> Result<Vec<f32>> {
    let n = reward.len();
    if [done.len(), q1_next.len(), q2_next.len(), logp_next.len()]
        .iter()
        .any(|&l| l != n)
    {
        return Err(NnError::Invalid(
            "td_target: slices differ in length".into(),
        ));
    }
    Ok((0..n)
        .map(|i| {
            let soft_v = q1_next[i].min(q2_next[i]) - alpha * logp_next[i];
            reward[i] + gamma * (1.0 - done[i]) * soft_v
        })
        .collect())
}

/// The tensor twin of [`td_target`] (same formula, same argument meaning; tensors of equal
/// shape), used inside [`SacAgent::update`].
pub fn td_target_tensor(
    reward: &Tensor,
    done: &Tensor,
    q1_next: &Tensor,
    q2_next: &Tensor,
    logp_next: &Tensor,
    alpha: f64,
    gamma: f64,
) -> Result<Tensor> {
    let soft_v = (q1_next.minimum(q2_next)? - (logp_next * alpha)?)?;
    // gamma (1 - d) = -gamma d + gamma: one affine op.
    let discount = done.affine(-gamma, gamma)?;
    Ok((reward + (discount * soft_v)?)?)
}

/// Log density (nats) of the squashed, rescaled action given the pre-squash sample
/// `u = mean + exp(log_std) eps` of one action entry: the Gaussian density of `u` minus
/// `log |d tanh(u)/du|` minus `log half`. Scalar reference of the tensor code (tests use it).
pub fn squashed_log_prob_1d(eps: f64, log_std: f64, u: f64, half: f64) -> f64 {
    let gauss = -0.5 * eps * eps - log_std - 0.5 * (2.0 * std::f64::consts::PI).ln();
    let softplus = |x: f64| x.max(0.0) + (-x.abs()).exp().ln_1p();
    // log(1 - tanh(u)^2) in the stable form 2 (log 2 - u - softplus(-2u)).
    let log_dtanh = 2.0 * (std::f64::consts::LN_2 - u - softplus(-2.0 * u));
    gauss - log_dtanh - half.ln()
}

/// A batch of transitions, row-major: row `i` of `obs` is `obs[i * obs_dim..(i + 1) * obs_dim]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SacBatch {
    /// Observations `s` (`n * obs_dim`).
    pub obs: Vec<f32>,
    /// Actions taken, in environment units (`n * act_dim`).
    pub act: Vec<f32>,
    /// Rewards (`n`).
    pub reward: Vec<f32>,
    /// Next observations `s'` (`n * obs_dim`).
    pub next_obs: Vec<f32>,
    /// 1 where `s'` is terminal (the MDP ended; a time limit is not terminal), else 0 (`n`).
    pub done: Vec<f32>,
}

impl SacBatch {
    /// Number of transitions.
    pub fn len(&self) -> usize {
        self.reward.len()
    }

    /// Appends `other`'s transitions (same dimensions) after this batch's.
    pub fn append(&mut self, other: SacBatch) {
        self.obs.extend(other.obs);
        self.act.extend(other.act);
        self.reward.extend(other.reward);
        self.next_obs.extend(other.next_obs);
        self.done.extend(other.done);
    }

    /// No transitions.
    pub fn is_empty(&self) -> bool {
        self.reward.is_empty()
    }
}

/// What one [`SacAgent::update`] measured (all means over the batch).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SacStats {
    /// Critic loss: MSE of Q1 to y plus MSE of Q2 to y (reward units squared).
    pub q_loss: f64,
    /// Mean of Q1 and Q2 on the batch (reward units).
    pub q_mean: f64,
    /// Actor loss `alpha logp - min(Q1, Q2)`.
    pub actor_loss: f64,
    /// Temperature used in this update (before its own step).
    pub alpha: f64,
    /// Entropy estimate `-mean logp` of fresh policy samples (nats, environment units).
    pub entropy: f64,
}

/// Fixed-capacity ring buffer of transitions; the oldest is overwritten when full.
#[derive(Clone, Debug)]
pub struct ReplayBuffer {
    obs_dim: usize,
    act_dim: usize,
    capacity: usize,
    obs: Vec<f32>,
    act: Vec<f32>,
    reward: Vec<f32>,
    next_obs: Vec<f32>,
    done: Vec<f32>,
    /// Slot the next push writes.
    head: usize,
    len: usize,
}

impl ReplayBuffer {
    /// An empty buffer for `capacity` transitions (all positive).
    pub fn new(obs_dim: usize, act_dim: usize, capacity: usize) -> Result<Self> {
        if obs_dim == 0 || act_dim == 0 || capacity == 0 {
            return Err(NnError::Invalid(
                "replay buffer: dimensions and capacity must be > 0".into(),
            ));
        }
        Ok(ReplayBuffer {
            obs_dim,
            act_dim,
            capacity,
            obs: Vec::new(),
            act: Vec::new(),
            reward: Vec::new(),
            next_obs: Vec::new(),
            done: Vec::new(),
            head: 0,
            len: 0,
        })
    }

    /// Stored transitions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Nothing stored yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Most transitions held.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Stores one transition. `act` is in environment units; `terminated` is the MDP's end only
    /// (a time-limit truncation must pass `false`: its target still bootstraps).
    pub fn push(
        &mut self,
        obs: &[f32],
        act: &[f32],
        reward: f32,
        next_obs: &[f32],
        terminated: bool,
    ) -> Result<()> {
        if obs.len() != self.obs_dim || next_obs.len() != self.obs_dim || act.len() != self.act_dim
        {
            return Err(NnError::Invalid(format!(
                "replay buffer: transition lengths {}/{}/{}, expected {}/{}/{}",
                obs.len(),
                act.len(),
                next_obs.len(),
                self.obs_dim,
                self.act_dim,
                self.obs_dim
            )));
        }
        let d = if terminated { 1.0 } else { 0.0 };
        if self.len < self.capacity {
            // Grow lazily: a large capacity costs nothing until it is used.
            self.obs.extend_from_slice(obs);
            self.act.extend_from_slice(act);
            self.reward.push(reward);
            self.next_obs.extend_from_slice(next_obs);
            self.done.push(d);
            self.len += 1;
        } else {
            let (i, o, a) = (self.head, self.obs_dim, self.act_dim);
            self.obs[i * o..(i + 1) * o].copy_from_slice(obs);
            self.act[i * a..(i + 1) * a].copy_from_slice(act);
            self.reward[i] = reward;
            self.next_obs[i * o..(i + 1) * o].copy_from_slice(next_obs);
            self.done[i] = d;
        }
        self.head = (self.head + 1) % self.capacity;
        Ok(())
    }

    /// `batch` transitions drawn uniformly with replacement.
    pub fn sample(&self, batch: usize, rng: &mut impl rand::Rng) -> Result<SacBatch> {
        if self.is_empty() {
            return Err(NnError::Invalid("replay buffer: sample from empty".into()));
        }
        let (o, a) = (self.obs_dim, self.act_dim);
        let mut out = SacBatch {
            obs: Vec::with_capacity(batch * o),
            act: Vec::with_capacity(batch * a),
            reward: Vec::with_capacity(batch),
            next_obs: Vec::with_capacity(batch * o),
            done: Vec::with_capacity(batch),
        };
        for _ in 0..batch {
            let i = rng.random_range(0..self.len);
            out.obs.extend_from_slice(&self.obs[i * o..(i + 1) * o]);
            out.act.extend_from_slice(&self.act[i * a..(i + 1) * a]);
            out.reward.push(self.reward[i]);
            out.next_obs
                .extend_from_slice(&self.next_obs[i * o..(i + 1) * o]);
            out.done.push(self.done[i]);
        }
        Ok(out)
    }
}

/// Layer widths input to output.
fn widths(input: usize, hidden: &[usize], output: usize) -> Vec<usize> {
    let mut w = Vec::with_capacity(hidden.len() + 2);
    w.push(input);
    w.extend_from_slice(hidden);
    w.push(output);
    w
}

/// Number of parameters of an MLP with these widths.
fn mlp_dim(w: &[usize]) -> usize {
    w.windows(2).map(|p| p[0] * p[1] + p[1]).sum()
}

/// PyTorch's `nn.Linear` default initialisation (weight and bias uniform in `±1/sqrt(fan_in)`),
/// flat in PyTorch order, from `rng`.
fn torch_init(w: &[usize], rng: &mut Xoshiro256PlusPlus) -> Vec<f32> {
    let mut out = Vec::with_capacity(mlp_dim(w));
    for p in w.windows(2) {
        let bound = 1.0 / (p[0] as f32).sqrt();
        // Widths are checked positive, so the range is non-empty.
        let u = Uniform::new(-bound, bound).expect("bound > 0");
        out.extend((0..p[1] * (p[0] + 1)).map(|_| u.sample(rng)));
    }
    out
}

/// `copies` stacked MLPs in device layout: per layer a weight `[copies, in, out]` and a bias
/// `[copies, 1, out]` (for one copy the leading dimension is dropped: `[in, out]`, `[1, out]`).
fn to_device_layout(
    flats: &[&[f32]],
    w: &[usize],
    device: &Device,
) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let mut weights = Vec::new();
    let mut biases = Vec::new();
    let mut off = 0;
    for p in w.windows(2) {
        let (fi, fo) = (p[0], p[1]);
        let mut ws = Vec::new();
        let mut bs = Vec::new();
        for flat in flats {
            let wt = Tensor::from_slice(&flat[off..off + fi * fo], (fo, fi), device)?
                .t()?
                .contiguous()?;
            ws.push(wt);
            bs.push(Tensor::from_slice(
                &flat[off + fi * fo..off + fi * fo + fo],
                (1, fo),
                device,
            )?);
        }
        off += fi * fo + fo;
        if flats.len() == 1 {
            weights.push(ws.remove(0));
            biases.push(bs.remove(0));
        } else {
            weights.push(Tensor::stack(&ws, 0)?);
            biases.push(Tensor::stack(&bs, 0)?);
        }
    }
    Ok((weights, biases))
}

/// Inverse of [`to_device_layout`] for copy `c` (or the single copy when `stacked` is false).
fn from_device_layout(
    weights: &[Tensor],
    biases: &[Tensor],
    stacked: Option<usize>,
) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for (wt, bt) in weights.iter().zip(biases) {
        let (wt, bt) = match stacked {
            Some(c) => (wt.get(c)?, bt.get(c)?),
            None => (wt.clone(), bt.clone()),
        };
        out.extend(wt.t()?.flatten_all()?.to_vec1::<f32>()?);
        out.extend(bt.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// ReLU MLP forward pass: `x` is `[n, in]` (or `[c, n, in]` for stacked weights).
fn mlp_forward(x: &Tensor, weights: &[Tensor], biases: &[Tensor]) -> Result<Tensor> {
    let last = weights.len() - 1;
    let mut h = x.clone();
    for (l, (w, b)) in weights.iter().zip(biases).enumerate() {
        let z = h.matmul(w)?.broadcast_add(b)?;
        h = if l < last { z.relu()? } else { z };
    }
    Ok(h)
}

fn var_tensors(vars: &[Var], detach: bool) -> Vec<Tensor> {
    vars.iter()
        .map(|v| {
            if detach {
                v.as_tensor().detach()
            } else {
                v.as_tensor().clone()
            }
        })
        .collect()
}

fn rows_tensor(values: &[f32], width: usize, what: &str, device: &Device) -> Result<Tensor> {
    if width == 0 || !values.len().is_multiple_of(width) {
        return Err(NnError::Invalid(format!(
            "{what}: {} values are not a whole number of rows of {width}",
            values.len()
        )));
    }
    Ok(Tensor::from_slice(
        values,
        (values.len() / width, width),
        device,
    )?)
}

/// Shapes and action box of an agent (saved with it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct SacMeta {
    obs_dim: usize,
    act_low: Vec<f32>,
    act_high: Vec<f32>,
    config: SacConfig,
}

/// A SAC agent: actor, twin critics, their targets, the temperature and the optimisers' state.
pub struct SacAgent {
    obs_dim: usize,
    act_dim: usize,
    act_low: Vec<f32>,
    act_high: Vec<f32>,
    cfg: SacConfig,
    target_entropy: f64,
    device: Device,
    actor_widths: Vec<usize>,
    critic_widths: Vec<usize>,
    /// Actor weights `[in, out]` and biases `[1, out]`.
    actor_w: Vec<Var>,
    actor_b: Vec<Var>,
    /// Critics stacked: weights `[2, in, out]`, biases `[2, 1, out]`; copy 0 is Q1.
    critic_w: Vec<Var>,
    critic_b: Vec<Var>,
    target_w: Vec<Tensor>,
    target_b: Vec<Tensor>,
    /// `[1, act_dim]` rows of the action box's centre and half-width.
    center: Tensor,
    half: Tensor,
    /// `sum_j log half_j`: the log-determinant of the rescaling (nats).
    log_half_sum: f64,
    log_alpha: f32,
    actor_opt: AdamW,
    critic_opt: AdamW,
    alpha_opt: Adam,
    rng: Xoshiro256PlusPlus,
    updates: u64,
}

fn adam_params(lr: f64) -> ParamsAdamW {
    // weight_decay 0: plain Adam with PyTorch's defaults.
    ParamsAdamW {
        lr,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    }
}

impl SacAgent {
    /// A fresh agent for observations of `obs_dim` entries and actions in the box `[act_low,
    /// act_high]` (environment units, finite, `low < high` per entry). Initial weights (PyTorch's
    /// `nn.Linear` default) and all later sampling noise come from `seed`.
    pub fn new(
        obs_dim: usize,
        act_low: &[f32],
        act_high: &[f32],
        cfg: &SacConfig,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let act_dim = act_low.len();
        let aw = widths(obs_dim, &cfg.hidden, 2 * act_dim.max(1));
        let cw = widths(obs_dim + act_dim, &cfg.hidden, 1);
        let actor = torch_init(&aw, &mut rng);
        let q1 = torch_init(&cw, &mut rng);
        let q2 = torch_init(&cw, &mut rng);
        Self::from_parts(
            obs_dim, act_low, act_high, cfg, &actor, &q1, &q2, None, rng, device,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn from_parts(
        obs_dim: usize,
        act_low: &[f32],
        act_high: &[f32],
        cfg: &SacConfig,
        actor: &[f32],
        q1: &[f32],
        q2: &[f32],
        targets_and_log_alpha: Option<(&[f32], &[f32], f32)>,
        rng: Xoshiro256PlusPlus,
        device: &Device,
    ) -> Result<Self> {
        cfg.check()?;
        let act_dim = act_low.len();
        if obs_dim == 0 || act_dim == 0 || act_high.len() != act_dim {
            return Err(NnError::Invalid(format!(
                "SAC: obs_dim {obs_dim}, action box of {act_dim}/{} entries (need > 0, equal)",
                act_high.len()
            )));
        }
        if act_low
            .iter()
            .zip(act_high)
            .any(|(l, h)| !(l.is_finite() && h.is_finite() && l < h))
        {
            return Err(NnError::Invalid(
                "SAC: the action box must be finite with low < high".into(),
            ));
        }
        let aw = widths(obs_dim, &cfg.hidden, 2 * act_dim);
        let cw = widths(obs_dim + act_dim, &cfg.hidden, 1);
        for (name, p, w) in [("actor", actor, &aw), ("q1", q1, &cw), ("q2", q2, &cw)] {
            check_flat(name, p, mlp_dim(w))?;
        }
        let (aw_t, ab_t) = to_device_layout(&[actor], &aw, device)?;
        let (cw_t, cb_t) = to_device_layout(&[q1, q2], &cw, device)?;
        let (target_w, target_b, log_alpha) = match targets_and_log_alpha {
            Some((t1, t2, la)) => {
                check_flat("q1_target", t1, mlp_dim(&cw))?;
                check_flat("q2_target", t2, mlp_dim(&cw))?;
                let (tw, tb) = to_device_layout(&[t1, t2], &cw, device)?;
                (tw, tb, la)
            }
            None => (
                cw_t.iter()
                    .map(|t| t.copy())
                    .collect::<candle_core::Result<_>>()?,
                cb_t.iter()
                    .map(|t| t.copy())
                    .collect::<candle_core::Result<_>>()?,
                cfg.init_alpha.ln() as f32,
            ),
        };
        let to_vars = |ts: Vec<Tensor>| -> Result<Vec<Var>> {
            Ok(ts
                .into_iter()
                .map(|t| Var::from_tensor(&t))
                .collect::<candle_core::Result<_>>()?)
        };
        let actor_w = to_vars(aw_t)?;
        let actor_b = to_vars(ab_t)?;
        let critic_w = to_vars(cw_t)?;
        let critic_b = to_vars(cb_t)?;
        let mut actor_vars = actor_w.clone();
        actor_vars.extend(actor_b.iter().cloned());
        let mut critic_vars = critic_w.clone();
        critic_vars.extend(critic_b.iter().cloned());
        let center: Vec<f32> = act_low
            .iter()
            .zip(act_high)
            .map(|(l, h)| 0.5 * (l + h))
            .collect();
        let half: Vec<f32> = act_low
            .iter()
            .zip(act_high)
            .map(|(l, h)| 0.5 * (h - l))
            .collect();
        let log_half_sum = half.iter().map(|h| f64::from(*h).ln()).sum();
        Ok(SacAgent {
            obs_dim,
            act_dim,
            act_low: act_low.to_vec(),
            act_high: act_high.to_vec(),
            target_entropy: cfg.target_entropy.unwrap_or(-(act_dim as f64)),
            actor_opt: AdamW::new(actor_vars, adam_params(cfg.actor_lr))?,
            critic_opt: AdamW::new(critic_vars, adam_params(cfg.critic_lr))?,
            alpha_opt: Adam::new(1, cfg.alpha_lr, 1e-8),
            cfg: cfg.clone(),
            device: device.clone(),
            actor_widths: aw,
            critic_widths: cw,
            actor_w,
            actor_b,
            critic_w,
            critic_b,
            target_w,
            target_b,
            center: Tensor::from_vec(center, (1, act_dim), device)?,
            half: Tensor::from_vec(half, (1, act_dim), device)?,
            log_half_sum,
            log_alpha,
            rng,
            updates: 0,
        })
    }

    /// Observation length.
    pub fn obs_dim(&self) -> usize {
        self.obs_dim
    }

    /// Action length.
    pub fn act_dim(&self) -> usize {
        self.act_dim
    }

    /// Lower bounds of the action box (environment units).
    pub fn act_low(&self) -> &[f32] {
        &self.act_low
    }

    /// Upper bounds of the action box (environment units).
    pub fn act_high(&self) -> &[f32] {
        &self.act_high
    }

    /// The hyperparameters.
    pub fn config(&self) -> &SacConfig {
        &self.cfg
    }

    /// The entropy the temperature steers towards (nats).
    pub fn target_entropy(&self) -> f64 {
        self.target_entropy
    }

    /// Current temperature `exp(log_alpha)`.
    pub fn alpha(&self) -> f64 {
        f64::from(self.log_alpha).exp()
    }

    /// Updates taken so far.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Sets the temperature (e.g. to test the temperature step from a known point). `alpha > 0`.
    pub fn set_alpha(&mut self, alpha: f64) -> Result<()> {
        if !(alpha.is_finite() && alpha > 0.0) {
            return Err(NnError::Invalid(format!("alpha must be > 0, got {alpha}")));
        }
        self.log_alpha = alpha.ln() as f32;
        Ok(())
    }

    /// `n` standard-normal draws as an `[n / act_dim, act_dim]` tensor, and per row the constant
    /// part of the log density: `sum_j (-eps_j^2 / 2 - log(2 pi) / 2) - sum_j log half_j`, plus
    /// `2 log 2` per entry of the tanh correction (see [`Self::sample`]).
    fn noise(&mut self, rows: usize) -> Result<(Tensor, Tensor)> {
        let a = self.act_dim;
        let eps: Vec<f32> = (0..rows * a)
            .map(|_| StandardNormal.sample(&mut self.rng))
            .collect();
        let per_entry = -0.5 * (2.0 * std::f64::consts::PI).ln() - 2.0 * std::f64::consts::LN_2;
        let c: Vec<f32> = eps
            .chunks_exact(a)
            .map(|e| {
                let sq: f64 = e.iter().map(|x| 0.5 * f64::from(*x).powi(2)).sum();
                (-sq + a as f64 * per_entry - self.log_half_sum) as f32
            })
            .collect();
        Ok((
            Tensor::from_vec(eps, (rows, a), &self.device)?,
            Tensor::from_vec(c, rows, &self.device)?,
        ))
    }

    /// Actor head: `(mean, log_std)`, each `[n, act_dim]`, log_std clamped.
    fn actor_head(&self, obs: &Tensor, detach: bool) -> Result<(Tensor, Tensor)> {
        let out = mlp_forward(
            obs,
            &var_tensors(&self.actor_w, detach),
            &var_tensors(&self.actor_b, detach),
        )?;
        let a = self.act_dim;
        let mean = out.narrow(1, 0, a)?;
        let log_std = out
            .narrow(1, a, a)?
            .clamp(self.cfg.log_std_min as f32, self.cfg.log_std_max as f32)?;
        Ok((mean, log_std))
    }

    /// A reparameterised policy sample at `obs`: the squashed action `tanh(u)` in `[-1, 1]`
    /// (`[n, act_dim]`) and its log density in environment units (`[n]`, nats).
    ///
    /// `log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u))`, and with softplus written out
    /// (`softplus(x) = max(x, 0) + log(1 + exp(-|x|))`) this equals `2 log 2 - 2|u| - 2 log(1 +
    /// exp(-2|u|))`: the same stable formula in fewer tensor ops. The constants are in `konst`.
    fn sample(
        &self,
        obs: &Tensor,
        eps: &Tensor,
        konst: &Tensor,
        detach: bool,
    ) -> Result<(Tensor, Tensor)> {
        let (mean, log_std) = self.actor_head(obs, detach)?;
        let u = (mean + (log_std.exp()? * eps)?)?;
        let abs_u = u.abs()?;
        let log1p = abs_u.affine(-2.0, 0.0)?.exp()?.affine(1.0, 1.0)?.log()?;
        // logp = konst - sum_j (log_std - 2|u| - 2 log1p(exp(-2|u|))).
        let per = (((abs_u + log1p)? * 2.0)? - log_std)?;
        let logp = (konst + per.sum(1)?)?;
        Ok((u.tanh()?, logp))
    }

    /// Squashed `[-1, 1]` actions to environment units.
    fn rescale(&self, squashed: &Tensor) -> Result<Tensor> {
        Ok(squashed
            .broadcast_mul(&self.half)?
            .broadcast_add(&self.center)?)
    }

    /// Actions for `obs` (`n * obs_dim` values, one row per environment): `n * act_dim` values in
    /// environment units. `deterministic`: `center + half * tanh(mean)`; otherwise a sample of the
    /// policy (noise from the agent's seeded generator).
    pub fn act(&mut self, obs: &[f32], deterministic: bool) -> Result<Vec<f32>> {
        let x = rows_tensor(obs, self.obs_dim, "SAC act", &self.device)?;
        let squashed = if deterministic {
            self.actor_head(&x, true)?.0.tanh()?
        } else {
            let (eps, konst) = self.noise(x.dim(0)?)?;
            self.sample(&x, &eps, &konst, true)?.0
        };
        Ok(self.rescale(&squashed)?.flatten_all()?.to_vec1()?)
    }

    /// Policy samples with their log densities: `(actions, logp)` with `n * act_dim` actions in
    /// environment units and `n` log densities (nats, environment units).
    pub fn sample_with_log_prob(&mut self, obs: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let x = rows_tensor(obs, self.obs_dim, "SAC sample", &self.device)?;
        let (eps, konst) = self.noise(x.dim(0)?)?;
        let (a, logp) = self.sample(&x, &eps, &konst, true)?;
        Ok((self.rescale(&a)?.flatten_all()?.to_vec1()?, logp.to_vec1()?))
    }

    /// Both critics at `x` = `[n, obs_dim + act_dim]` (squashed actions): `[2, n]`.
    fn critics(&self, x: &Tensor, weights: &[Tensor], biases: &[Tensor]) -> Result<Tensor> {
        let (n, d) = x.dims2()?;
        // A stride-0 batch dimension: both critics read the same input without a copy.
        let x2 = x.unsqueeze(0)?.broadcast_as((2, n, d))?;
        Ok(mlp_forward(&x2, weights, biases)?.squeeze(2)?)
    }

    /// One SAC update on `batch`: a critic step (MSE of both critics to the soft TD target), an
    /// actor step (`alpha logp - min(Q1, Q2)`), a temperature step (`-log_alpha (logp +
    /// target_entropy)`, logp held fixed), then the Polyak update of the target critics.
    pub fn update(&mut self, batch: &SacBatch) -> Result<SacStats> {
        let n = batch.len();
        let (o, a) = (self.obs_dim, self.act_dim);
        if n == 0
            || batch.obs.len() != n * o
            || batch.next_obs.len() != n * o
            || batch.act.len() != n * a
            || batch.done.len() != n
        {
            return Err(NnError::Invalid(format!(
                "SAC update: inconsistent batch of {n} transitions"
            )));
        }
        let dev = self.device.clone();
        let obs = Tensor::from_slice(&batch.obs, (n, o), &dev)?;
        let next_obs = Tensor::from_slice(&batch.next_obs, (n, o), &dev)?;
        // Stored actions are in environment units; the critics see them squashed to [-1, 1].
        let act = Tensor::from_slice(&batch.act, (n, a), &dev)?
            .broadcast_sub(&self.center)?
            .broadcast_div(&self.half)?;
        let reward = Tensor::from_slice(&batch.reward, n, &dev)?;
        let done = Tensor::from_slice(&batch.done, n, &dev)?;
        let alpha = self.alpha();

        // Critic step.
        let (eps2, k2) = self.noise(n)?;
        let (a2, logp2) = self.sample(&next_obs, &eps2, &k2, true)?;
        let q_next = self.critics(
            &Tensor::cat(&[&next_obs, &a2], 1)?,
            &self.target_w,
            &self.target_b,
        )?;
        let y = td_target_tensor(
            &reward,
            &done,
            &q_next.get(0)?,
            &q_next.get(1)?,
            &logp2,
            alpha,
            self.cfg.gamma,
        )?
        .detach();
        let q = self.critics(
            &Tensor::cat(&[&obs, &act], 1)?,
            &var_tensors(&self.critic_w, false),
            &var_tensors(&self.critic_b, false),
        )?;
        let q_loss = (q.broadcast_sub(&y.unsqueeze(0)?)?.sqr()?.sum_all()? / n as f64)?;
        let grads = q_loss.backward()?;
        self.critic_opt.step(&grads)?;

        // Actor step against the updated critics (their weights detached: no gradient for them).
        let (eps, k) = self.noise(n)?;
        let (a_pi, logp) = self.sample(&obs, &eps, &k, false)?;
        let q_pi = self.critics(
            &Tensor::cat(&[&obs, &a_pi], 1)?,
            &var_tensors(&self.critic_w, true),
            &var_tensors(&self.critic_b, true),
        )?;
        let min_q = q_pi.get(0)?.minimum(&q_pi.get(1)?)?;
        let actor_loss = ((&logp * alpha)? - min_q)?.mean_all()?;
        let grads = actor_loss.backward()?;
        self.actor_opt.step(&grads)?;

        // Temperature step: d/d log_alpha of -log_alpha (logp + H_target) is -(logp + H_target).
        let mean_logp = f64::from(logp.mean_all()?.to_scalar::<f32>()?);
        let grad = -(mean_logp + self.target_entropy) as f32;
        let mut la = [self.log_alpha];
        self.alpha_opt.step(&mut la, &[grad]);
        self.log_alpha = la[0];

        self.polyak()?;
        self.updates += 1;
        Ok(SacStats {
            q_loss: f64::from(q_loss.to_scalar::<f32>()?),
            q_mean: f64::from(q.mean_all()?.to_scalar::<f32>()?),
            actor_loss: f64::from(actor_loss.to_scalar::<f32>()?),
            alpha,
            entropy: -mean_logp,
        })
    }

    /// `target = (1 - tau) target + tau online` for every critic tensor.
    fn polyak(&mut self) -> Result<()> {
        let tau = self.cfg.tau;
        for (t, v) in self
            .target_w
            .iter_mut()
            .chain(self.target_b.iter_mut())
            .zip(self.critic_w.iter().chain(self.critic_b.iter()))
        {
            // Detached: otherwise each new target records the op that made it, keeping every
            // earlier target (and critic snapshot) alive: memory grew by the critics' size
            // per update.
            *t = ((&*t * (1.0 - tau))? + (v.as_tensor().detach() * tau)?)?.detach();
        }
        Ok(())
    }

    /// Number of actor parameters.
    pub fn actor_dim(&self) -> usize {
        mlp_dim(&self.actor_widths)
    }

    /// Number of parameters of one critic.
    pub fn critic_dim(&self) -> usize {
        mlp_dim(&self.critic_widths)
    }

    /// The actor's parameters, flat in PyTorch order (`actor.0.weight`, `actor.0.bias`, ...).
    pub fn actor_params(&self) -> Result<Vec<f32>> {
        from_device_layout(
            &var_tensors(&self.actor_w, true),
            &var_tensors(&self.actor_b, true),
            None,
        )
    }

    /// Replaces the actor's parameters (layout of [`actor_params`](Self::actor_params); length
    /// and finiteness checked). The actor's optimiser state is kept.
    pub fn set_actor_params(&mut self, params: &[f32]) -> Result<()> {
        check_flat("actor", params, self.actor_dim())?;
        let (w, b) = to_device_layout(&[params], &self.actor_widths, &self.device)?;
        for (var, t) in self
            .actor_w
            .iter()
            .zip(&w)
            .chain(self.actor_b.iter().zip(&b))
        {
            var.set(t)?;
        }
        Ok(())
    }

    /// Online critics' parameters: Q1 then Q2, each flat in PyTorch order.
    pub fn critic_params(&self) -> Result<Vec<f32>> {
        self.stacked_params(
            &var_tensors(&self.critic_w, true),
            &var_tensors(&self.critic_b, true),
        )
    }

    /// Target critics' parameters: Q1 target then Q2 target, each flat in PyTorch order.
    pub fn target_critic_params(&self) -> Result<Vec<f32>> {
        self.stacked_params(&self.target_w, &self.target_b)
    }

    fn stacked_params(&self, w: &[Tensor], b: &[Tensor]) -> Result<Vec<f32>> {
        let mut out = from_device_layout(w, b, Some(0))?;
        out.extend(from_device_layout(w, b, Some(1))?);
        Ok(out)
    }

    /// Writes every network to `path` as safetensors: `actor.*`, `q1.*`, `q2.*`, `q1_target.*`,
    /// `q2_target.*` (PyTorch `nn.Sequential` names, `weight` `[out, in]`), `log_alpha` (`[1]`),
    /// and the dimensions, action box and config as JSON under [`SAC_META_KEY`]. Optimiser state
    /// is not saved.
    pub fn save(&self, path: &Path) -> Result<()> {
        let critics = self.critic_params()?;
        let targets = self.target_critic_params()?;
        let cd = self.critic_dim();
        let actor = self.actor_params()?;
        let log_alpha = [self.log_alpha];
        let nets: [(&str, &[f32], &[usize]); 5] = [
            ("actor", &actor, &self.actor_widths),
            ("q1", &critics[..cd], &self.critic_widths),
            ("q2", &critics[cd..], &self.critic_widths),
            ("q1_target", &targets[..cd], &self.critic_widths),
            ("q2_target", &targets[cd..], &self.critic_widths),
        ];
        let mut named: Vec<(String, Vec<usize>, &[f32])> = Vec::new();
        for (net, flat, w) in nets {
            named.extend(
                param_names(net, w)
                    .into_iter()
                    .zip(split(flat, w))
                    .map(|((name, shape), vals)| (name, shape, vals)),
            );
        }
        named.push(("log_alpha".into(), vec![1], &log_alpha));
        let tensors: Vec<tensor_io::Tensor> = named
            .into_iter()
            .map(|(name, shape, v)| tensor_io::Tensor::f32(name, shape, v))
            .collect();
        let meta = SacMeta {
            obs_dim: self.obs_dim,
            act_low: self.act_low.clone(),
            act_high: self.act_high.clone(),
            config: self.cfg.clone(),
        };
        let json =
            serde_json::to_string(&meta).map_err(|e| NnError::Invalid(format!("SAC meta: {e}")))?;
        std::fs::write(path, tensor_io::serialize(&tensors, SAC_META_KEY, json)?)?;
        Ok(())
    }

    /// Reads an agent written by [`save`](Self::save) onto `device`. Optimiser state starts
    /// fresh; later sampling noise comes from `seed`.
    pub fn load(path: &Path, seed: u64, device: &Device) -> Result<Self> {
        let bytes = std::fs::read(path)?;
        let json = tensor_io::metadata_entry(&bytes, SAC_META_KEY)?.ok_or_else(|| {
            NnError::Invalid(format!("{}: no {SAC_META_KEY} metadata", path.display()))
        })?;
        let meta: SacMeta =
            serde_json::from_str(&json).map_err(|e| NnError::Invalid(format!("SAC meta: {e}")))?;
        meta.config.check()?;
        let st = tensor_io::parse(&bytes)?;
        let act_dim = meta.act_low.len();
        let aw = widths(meta.obs_dim, &meta.config.hidden, 2 * act_dim);
        let cw = widths(meta.obs_dim + act_dim, &meta.config.hidden, 1);
        let read = |net: &str, w: &[usize]| -> Result<Vec<f32>> {
            let mut out = Vec::with_capacity(mlp_dim(w));
            for (name, shape) in param_names(net, w) {
                out.extend(read_f32(&st, &name, &shape)?);
            }
            Ok(out)
        };
        let actor = read("actor", &aw)?;
        let q1 = read("q1", &cw)?;
        let q2 = read("q2", &cw)?;
        let t1 = read("q1_target", &cw)?;
        let t2 = read("q2_target", &cw)?;
        let log_alpha = read_f32(&st, "log_alpha", &[1])?[0];
        if !log_alpha.is_finite() {
            return Err(NnError::Invalid("SAC load: log_alpha is not finite".into()));
        }
        Self::from_parts(
            meta.obs_dim,
            &meta.act_low,
            &meta.act_high,
            &meta.config,
            &actor,
            &q1,
            &q2,
            Some((&t1, &t2, log_alpha)),
            Xoshiro256PlusPlus::seed_from_u64(seed),
            device,
        )
    }
}

fn check_flat(name: &str, params: &[f32], expected: usize) -> Result<()> {
    if params.len() != expected {
        return Err(NnError::ParamLength {
            got: params.len(),
            expected,
        });
    }
    if params.iter().any(|p| !p.is_finite()) {
        return Err(NnError::Invalid(format!(
            "{name} parameters must be finite"
        )));
    }
    Ok(())
}

/// `{net}.{2l}.weight` `[out, in]` and `{net}.{2l}.bias` `[out]` per layer, in flat order.
fn param_names(net: &str, w: &[usize]) -> Vec<(String, Vec<usize>)> {
    w.windows(2)
        .enumerate()
        .flat_map(|(l, p)| {
            [
                (format!("{net}.{}.weight", 2 * l), vec![p[1], p[0]]),
                (format!("{net}.{}.bias", 2 * l), vec![p[1]]),
            ]
        })
        .collect()
}

/// The flat vector cut into the tensors of [`param_names`].
fn split<'a>(flat: &'a [f32], w: &[usize]) -> Vec<&'a [f32]> {
    let mut out = Vec::new();
    let mut off = 0;
    for p in w.windows(2) {
        out.push(&flat[off..off + p[0] * p[1]]);
        off += p[0] * p[1];
        out.push(&flat[off..off + p[1]]);
        off += p[1];
    }
    out
}

/// Schedule of [`train_online`] (counts are environment steps).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OnlineOptions {
    /// Steps at the start that take uniformly random actions from the box (exploration).
    pub start_steps: u64,
    /// No updates before this many steps have been stored.
    pub update_after: u64,
    /// Every `update_every` steps, `update_every` updates (1: one update per step).
    pub update_every: u64,
    /// Call the checkpoint callback after every `checkpoint_every` steps (0: never).
    pub checkpoint_every: u64,
    /// Replay buffer capacity (transitions).
    pub replay_capacity: usize,
    /// Cut episodes after this many steps (time-limit truncation, still bootstrapped). `None`:
    /// only the environment's own termination and truncation end episodes.
    pub max_episode_steps: Option<u64>,
}

impl Default for OnlineOptions {
    fn default() -> Self {
        OnlineOptions {
            start_steps: 5_000,
            update_after: 1_000,
            update_every: 1,
            checkpoint_every: 0,
            replay_capacity: 1_000_000,
            max_episode_steps: None,
        }
    }
}

/// Every finished training episode, in order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EpisodeLog {
    /// Undiscounted return (reward units).
    pub returns: Vec<f64>,
    /// Length (environment steps).
    pub lengths: Vec<u64>,
    /// Total environment steps taken when the episode ended.
    pub end_steps: Vec<u64>,
}

impl EpisodeLog {
    /// Mean return of the last `k` finished episodes (fewer if fewer finished; `None` if none).
    pub fn mean_last(&self, k: usize) -> Option<f64> {
        let n = self.returns.len().min(k);
        (n > 0).then(|| self.returns[self.returns.len() - n..].iter().sum::<f64>() / n as f64)
    }
}

/// Trains a fresh SAC agent online in `env` for `steps` environment steps: random actions for
/// the first `opts.start_steps`, then policy samples; updates from a replay buffer once
/// `opts.update_after` steps are stored; `on_checkpoint(step, agent, log)` every
/// `opts.checkpoint_every` steps. Episodes are reset with seeds drawn from `seed`. Returns the
/// agent and every finished episode's return.
pub fn train_online(
    env: &mut dyn Env,
    steps: u64,
    cfg: &SacConfig,
    opts: &OnlineOptions,
    seed: u64,
    device: &Device,
    mut on_checkpoint: impl FnMut(u64, &SacAgent, &EpisodeLog) -> Result<()>,
) -> Result<(SacAgent, EpisodeLog)> {
    let obs_dim = env.observation_space().dim();
    let (low, high) = match env.action_space() {
        Space::Box { low, high } => (low.clone(), high.clone()),
        Space::Discrete { .. } => {
            return Err(NnError::Invalid(
                "SAC needs a continuous (Box) action space".into(),
            ));
        }
    };
    let act_dim = low.len();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut agent = SacAgent::new(obs_dim, &low, &high, cfg, rng.random(), device)?;
    let mut buffer = ReplayBuffer::new(obs_dim, act_dim, opts.replay_capacity)?;
    let mut log = EpisodeLog::default();
    let update_every = opts.update_every.max(1);

    let mut obs = vec![0.0f32; obs_dim];
    let mut next_obs = vec![0.0f32; obs_dim];
    let mut act = vec![0.0f32; act_dim];
    env.reset(rng.random(), &mut obs);
    let (mut ep_return, mut ep_len) = (0.0f64, 0u64);
    for t in 1..=steps {
        if t <= opts.start_steps {
            for ((x, l), h) in act.iter_mut().zip(&low).zip(&high) {
                *x = rng.random_range(*l..*h);
            }
        } else {
            act.copy_from_slice(&agent.act(&obs, false)?);
        }
        let step = env.step(Action::Continuous(&act), &mut next_obs)?;
        ep_return += step.reward;
        ep_len += 1;
        buffer.push(&obs, &act, step.reward as f32, &next_obs, step.terminated)?;
        let cut = opts.max_episode_steps.is_some_and(|m| ep_len >= m);
        if step.terminated || step.truncated || cut {
            log.returns.push(ep_return);
            log.lengths.push(ep_len);
            log.end_steps.push(t);
            ep_return = 0.0;
            ep_len = 0;
            env.reset(rng.random(), &mut obs);
        } else {
            std::mem::swap(&mut obs, &mut next_obs);
        }
        if t >= opts.update_after && t % update_every == 0 {
            for _ in 0..update_every {
                let batch = buffer.sample(cfg.batch_size, &mut rng)?;
                agent.update(&batch)?;
            }
        }
        if opts.checkpoint_every > 0 && t % opts.checkpoint_every == 0 {
            on_checkpoint(t, &agent, &log)?;
        }
    }
    Ok((agent, log))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn td_target_tensor_matches_slices() {
        let r = [1.0f32, -0.5, 2.0, 0.0];
        let d = [0.0f32, 1.0, 0.0, 0.0];
        let q1 = [3.0f32, 1.0, -2.0, 0.5];
        let q2 = [2.5f32, 4.0, -1.0, 0.7];
        let lp = [-1.0f32, 0.3, 2.0, -0.2];
        let want = td_target(&r, &d, &q1, &q2, &lp, 0.2, 0.9).unwrap();
        let t = |v: &[f32]| Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap();
        let got = td_target_tensor(&t(&r), &t(&d), &t(&q1), &t(&q2), &t(&lp), 0.2, 0.9)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn params_round_trip_and_targets_start_equal() {
        let cfg = SacConfig {
            hidden: vec![5, 4],
            ..SacConfig::default()
        };
        let mut agent = SacAgent::new(3, &[-2.0, 0.0], &[2.0, 1.0], &cfg, 7, &Device::Cpu).unwrap();
        let p = agent.actor_params().unwrap();
        assert_eq!(p.len(), agent.actor_dim());
        assert_eq!(p.len(), 3 * 5 + 5 + 5 * 4 + 4 + 4 * 4 + 4);
        let q: Vec<f32> = p.iter().map(|x| x * 0.5 + 0.01).collect();
        agent.set_actor_params(&q).unwrap();
        assert_eq!(agent.actor_params().unwrap(), q);
        assert_eq!(
            agent.critic_params().unwrap(),
            agent.target_critic_params().unwrap()
        );
        assert!(agent.set_actor_params(&q[1..]).is_err());
    }

    /// The target critics are plain values after updates: a target that recorded the op that
    /// made it would keep every earlier target alive (memory grew by the critics' size per
    /// update, 11 GB after 20,000 updates of 256-wide critics).
    #[test]
    fn targets_hold_no_graph_after_updates() {
        let cfg = SacConfig {
            hidden: vec![8, 8],
            batch_size: 4,
            ..SacConfig::default()
        };
        let mut agent = SacAgent::new(2, &[-1.0], &[1.0], &cfg, 3, &Device::Cpu).unwrap();
        let batch = SacBatch {
            obs: vec![0.1, 0.2, 0.3, 0.4, -0.1, 0.0, 0.5, 0.5],
            act: vec![0.5, -0.5, 0.0, 0.9],
            reward: vec![1.0, 0.0, -1.0, 0.5],
            next_obs: vec![0.2, 0.2, 0.3, 0.5, 0.0, 0.0, 0.4, 0.5],
            done: vec![0.0; 4],
        };
        for _ in 0..3 {
            agent.update(&batch).unwrap();
        }
        for t in agent.target_w.iter().chain(&agent.target_b) {
            assert!(!t.track_op(), "a target critic tensor still tracks its op");
        }
    }

    #[test]
    fn replay_buffer_wraps() {
        let mut b = ReplayBuffer::new(1, 1, 3).unwrap();
        for i in 0..5 {
            let x = i as f32;
            b.push(&[x], &[x], x, &[x + 1.0], i == 4).unwrap();
        }
        assert_eq!(b.len(), 3);
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
        let s = b.sample(50, &mut rng).unwrap();
        // Transitions 0 and 1 were overwritten by 3 and 4.
        assert!(s.reward.iter().all(|&r| r >= 2.0));
        for i in 0..50 {
            assert_eq!(s.done[i], if s.reward[i] == 4.0 { 1.0 } else { 0.0 });
            assert_eq!(s.next_obs[i], s.obs[i] + 1.0);
        }
        assert!(b.push(&[0.0, 1.0], &[0.0], 0.0, &[0.0], false).is_err());
    }
}
