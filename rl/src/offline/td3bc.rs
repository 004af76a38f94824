//! TD3+BC (Fujimoto and Gu 2021, "A minimalist approach to offline reinforcement learning"):
//! TD3 with a behaviour-cloning term in the actor loss, for continuous-action offline datasets
//! (issue 56: PrivORL's downstream learner for continuous control, on synthetic and on real
//! data).
//!
//! As the paper (Algorithm 1 and section 5) and the authors' `TD3_BC.py` run it:
//! - states are standardised with the dataset's mean and standard deviation (`+ 1e-3`), both
//!   kept with the agent and applied when it acts;
//! - twin critics `Q1, Q2`, target networks updated by Polyak averaging with `tau = 0.005`;
//!   critic target `r + gamma (1 - done) min(Q1', Q2')(s', a~)` with `a~ = clip(pi'(s') + clip(
//!   N(0, (0.2 h)^2), -0.5 h, 0.5 h), box)` (target policy smoothing, `h` the half-width of the
//!   action box: the paper's `max_action`), loss `MSE(Q1, y) + MSE(Q2, y)`;
//! - every `policy_freq = 2` critic updates, the actor minimises
//!   `-lambda mean Q1(s, pi(s)) + mean (pi(s) - a)^2` with `lambda = alpha / mean |Q1(s, pi(s))|`
//!   (`alpha = 2.5`, the mean over the batch, `lambda` treated as a constant), and the targets
//!   move ([`actor_loss`]);
//! - ReLU MLPs of 256-256, the actor's output `center + h tanh(.)`; Adam with 3e-4 for both;
//!   batches of 256 drawn uniformly with replacement; `gamma = 0.99`.
//!
//! Units: actions in environment units (critic inputs and the BC term alike, as the paper's
//! code); states normalised inside the networks only.
//!
//! Invariants: the normalisation statistics are fixed at construction; every random draw
//! (initial weights, batches, smoothing noise) comes from the constructor's seed.

use candle_core::{D, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

use super::continuous::ContinuousEpisode;
use crate::diffusion::encode::{Actions, Transitions};
use crate::diffusion::trajectory::{Init, linear};
use crate::{NnError, Result};

/// TD3+BC's hyperparameters (defaults: the paper's, section 5 and appendix C).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Td3BcConfig {
    /// Hidden widths of the actor and of each critic (ReLU after each).
    pub hidden: Vec<usize>,
    pub actor_lr: f64,
    pub critic_lr: f64,
    /// Discount per step.
    pub gamma: f64,
    /// Polyak coefficient of the targets.
    pub tau: f64,
    /// Target smoothing noise's standard deviation, in half-widths of the action box.
    pub policy_noise: f64,
    /// Its clip, in half-widths.
    pub noise_clip: f64,
    /// Critic updates per actor (and target) update.
    pub policy_freq: u64,
    /// The BC trade-off `alpha` of `lambda = alpha / mean |Q|`.
    pub alpha: f64,
    pub batch_size: usize,
    /// Standardise states with the dataset's statistics.
    pub normalize_states: bool,
}

impl Default for Td3BcConfig {
    fn default() -> Self {
        Td3BcConfig {
            hidden: vec![256, 256],
            actor_lr: 3e-4,
            critic_lr: 3e-4,
            gamma: 0.99,
            tau: 0.005,
            policy_noise: 0.2,
            noise_clip: 0.5,
            policy_freq: 2,
            alpha: 2.5,
            batch_size: 256,
            normalize_states: true,
        }
    }
}

impl Td3BcConfig {
    pub fn check(&self) -> Result<()> {
        let pos = |v: f64| v.is_finite() && v > 0.0;
        let ok = !self.hidden.is_empty()
            && self.hidden.iter().all(|&w| w > 0)
            && pos(self.actor_lr)
            && pos(self.critic_lr)
            && (0.0..=1.0).contains(&self.gamma)
            && self.tau > 0.0
            && self.tau <= 1.0
            && self.policy_noise >= 0.0
            && self.noise_clip >= 0.0
            && self.policy_freq > 0
            && self.alpha >= 0.0
            && self.alpha.is_finite()
            && self.batch_size > 0;
        if ok {
            Ok(())
        } else {
            Err(NnError::Invalid(format!(
                "TD3+BC settings out of range: {self:?}"
            )))
        }
    }
}

/// TD3+BC's actor loss `-lambda mean(q) + mean((pi - a)^2)` with `lambda = alpha / mean|q|`
/// held constant (detached), for `q` `[B, 1]` (`Q1(s, pi(s))`) and `pi`, `a` `[B, act_dim]`.
pub fn actor_loss(q: &Tensor, pi: &Tensor, a: &Tensor, alpha: f64) -> Result<Tensor> {
    let mean_abs = q.abs()?.mean_all()?.detach().to_scalar::<f32>()? as f64;
    // The authors divide by the raw mean; guard only the degenerate all-zero case.
    let lambda = alpha / mean_abs.max(1e-12);
    let bc = (pi - a)?.sqr()?.mean_all()?;
    Ok(((q.mean_all()? * -lambda)? + bc)?)
}

/// A ReLU MLP as a list of `(weight [in, out], bias [out])` variables.
struct Mlp {
    vars: Vec<Var>,
}

impl Mlp {
    fn new(widths: &[usize], seed: u64, device: &Device) -> Result<Self> {
        let mut init = Init::new(seed);
        for (l, p) in widths.windows(2).enumerate() {
            init.linear(&format!("{l}"), p[0], p[1]);
        }
        let mut vars = Vec::new();
        let mut at = 0;
        for s in &init.shapes {
            let n = s.numel();
            let t = Tensor::from_slice(&init.flat[at..at + n], s.shape.as_slice(), device)?;
            vars.push(Var::from_tensor(&t)?);
            at += n;
        }
        Ok(Mlp { vars })
    }

    fn copy(&self) -> Result<Self> {
        Ok(Mlp {
            vars: self
                .vars
                .iter()
                .map(|v| Var::from_tensor(&v.as_tensor().copy()?))
                .collect::<candle_core::Result<_>>()?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let layers = self.vars.len() / 2;
        let mut h = x.clone();
        for l in 0..layers {
            h = linear(&h, &self.vars[2 * l], &self.vars[2 * l + 1])?;
            if l + 1 < layers {
                h = h.relu()?;
            }
        }
        Ok(h)
    }

    /// `self = (1 - tau) self + tau online`.
    fn polyak(&self, online: &Mlp, tau: f64) -> Result<()> {
        for (t, o) in self.vars.iter().zip(&online.vars) {
            let v = ((t.as_tensor() * (1.0 - tau))? + (o.as_tensor().detach() * tau)?)?;
            t.set(&v)?;
        }
        Ok(())
    }
}

/// What one update reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Td3BcStats {
    pub critic_loss: f32,
    /// The actor loss when the actor moved at this update.
    pub actor_loss: Option<f32>,
}

/// A TD3+BC agent and its dataset (flat arrays on the device).
pub struct Td3Bc {
    cfg: Td3BcConfig,
    obs_dim: usize,
    act_dim: usize,
    center: Tensor,
    half: Tensor,
    half_v: Vec<f32>,
    center_v: Vec<f32>,
    mean: Vec<f32>,
    std: Vec<f32>,
    actor: Mlp,
    actor_t: Mlp,
    q1: Mlp,
    q2: Mlp,
    q1_t: Mlp,
    q2_t: Mlp,
    actor_opt: AdamW,
    critic_opt: AdamW,
    data: Transitions,
    act_values: Vec<f32>,
    rng: Xoshiro256PlusPlus,
    updates: u64,
    device: Device,
}

fn adam(vars: Vec<Var>, lr: f64) -> Result<AdamW> {
    Ok(AdamW::new(
        vars,
        ParamsAdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
    )?)
}

impl Td3Bc {
    /// An agent over `data` (continuous actions inside the box `[low, high]`), all randomness
    /// from `seed`.
    pub fn new(
        data: Transitions,
        low: &[f32],
        high: &[f32],
        cfg: Td3BcConfig,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        cfg.check()?;
        let Actions::Continuous { dim, values } = &data.actions else {
            return Err(NnError::Invalid("TD3+BC needs continuous actions".into()));
        };
        let (act_dim, obs_dim, n) = (*dim, data.obs_dim, data.len());
        if n == 0
            || act_dim == 0
            || obs_dim == 0
            || values.len() != n * act_dim
            || data.obs.len() != n * obs_dim
            || data.next_obs.len() != n * obs_dim
            || data.terminals.len() != n
            || low.len() != act_dim
            || high.len() != act_dim
            || low
                .iter()
                .zip(high)
                .any(|(l, h)| !(l.is_finite() && h.is_finite() && l < h))
        {
            return Err(NnError::Invalid(format!(
                "TD3+BC: inconsistent dataset ({n} transitions, obs {obs_dim}, act {act_dim}) \
                 or action box"
            )));
        }
        let act_values = values.clone();
        let (mut mean, mut std) = (vec![0f32; obs_dim], vec![1f32; obs_dim]);
        if cfg.normalize_states {
            for j in 0..obs_dim {
                let col = data
                    .obs
                    .iter()
                    .skip(j)
                    .step_by(obs_dim)
                    .map(|&v| f64::from(v));
                let m = col.clone().sum::<f64>() / n as f64;
                let var = col.map(|v| (v - m) * (v - m)).sum::<f64>() / n as f64;
                mean[j] = m as f32;
                std[j] = (var.sqrt() + 1e-3) as f32;
            }
        }
        let center_v: Vec<f32> = low.iter().zip(high).map(|(l, h)| (l + h) / 2.0).collect();
        let half_v: Vec<f32> = low.iter().zip(high).map(|(l, h)| (h - l) / 2.0).collect();
        let mut aw = vec![obs_dim];
        aw.extend(&cfg.hidden);
        aw.push(act_dim);
        let mut cw = vec![obs_dim + act_dim];
        cw.extend(&cfg.hidden);
        cw.push(1);
        let actor = Mlp::new(&aw, seed, device)?;
        let q1 = Mlp::new(&cw, seed ^ 0x51, device)?;
        let q2 = Mlp::new(&cw, seed ^ 0x52, device)?;
        let (actor_t, q1_t, q2_t) = (actor.copy()?, q1.copy()?, q2.copy()?);
        let actor_opt = adam(actor.vars.clone(), cfg.actor_lr)?;
        let mut cv = q1.vars.clone();
        cv.extend(q2.vars.iter().cloned());
        let critic_opt = adam(cv, cfg.critic_lr)?;
        Ok(Td3Bc {
            obs_dim,
            act_dim,
            center: Tensor::from_slice(&center_v, (1, act_dim), device)?,
            half: Tensor::from_slice(&half_v, (1, act_dim), device)?,
            half_v,
            center_v,
            mean,
            std,
            actor,
            actor_t,
            q1,
            q2,
            q1_t,
            q2_t,
            actor_opt,
            critic_opt,
            data,
            act_values,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x7d3b_c000),
            updates: 0,
            device: device.clone(),
            cfg,
        })
    }

    pub fn config(&self) -> &Td3BcConfig {
        &self.cfg
    }

    /// Updates so far.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// The state normalisation `(mean, std)`.
    pub fn state_stats(&self) -> (&[f32], &[f32]) {
        (&self.mean, &self.std)
    }

    fn norm_obs(&self, obs: &[f32]) -> Result<Tensor> {
        let d = self.obs_dim;
        if obs.is_empty() || !obs.len().is_multiple_of(d) {
            return Err(NnError::Invalid(format!(
                "TD3+BC: {} observation values are not rows of {d}",
                obs.len()
            )));
        }
        let v: Vec<f32> = obs
            .iter()
            .enumerate()
            .map(|(i, &x)| (x - self.mean[i % d]) / self.std[i % d])
            .collect();
        Ok(Tensor::from_vec(v, (obs.len() / d, d), &self.device)?)
    }

    fn policy(&self, actor: &Mlp, s: &Tensor) -> Result<Tensor> {
        Ok(actor
            .forward(s)?
            .tanh()?
            .broadcast_mul(&self.half)?
            .broadcast_add(&self.center)?)
    }

    fn q(net: &Mlp, s: &Tensor, a: &Tensor) -> Result<Tensor> {
        net.forward(&Tensor::cat(&[s, a], D::Minus1)?)
    }

    /// Deterministic actions (`rows x act_dim`, environment units) for raw observations.
    pub fn act(&self, obs: &[f32]) -> Result<Vec<f32>> {
        let s = self.norm_obs(obs)?;
        Ok(self
            .policy(&self.actor, &s)?
            .detach()
            .flatten_all()?
            .to_vec1()?)
    }

    /// One TD3+BC update on a uniformly drawn batch.
    pub fn update(&mut self) -> Result<Td3BcStats> {
        let (d, k, n, b) = (
            self.obs_dim,
            self.act_dim,
            self.data.len(),
            self.cfg.batch_size,
        );
        let idx: Vec<usize> = (0..b).map(|_| self.rng.random_range(0..n)).collect();
        let (mut s, mut a, mut r, mut s2, mut nd) = (
            Vec::with_capacity(b * d),
            Vec::with_capacity(b * k),
            Vec::with_capacity(b),
            Vec::with_capacity(b * d),
            Vec::with_capacity(b),
        );
        for &i in &idx {
            s.extend_from_slice(&self.data.obs[i * d..(i + 1) * d]);
            a.extend_from_slice(&self.act_values[i * k..(i + 1) * k]);
            r.push(self.data.rewards[i]);
            s2.extend_from_slice(&self.data.next_obs[i * d..(i + 1) * d]);
            nd.push(1.0 - self.data.terminals[i]);
        }
        let dev = self.device.clone();
        let s = self.norm_obs(&s)?;
        let s2 = self.norm_obs(&s2)?;
        let a = Tensor::from_vec(a, (b, k), &dev)?;
        let r = Tensor::from_vec(r, (b, 1), &dev)?;
        let nd = Tensor::from_vec(nd, (b, 1), &dev)?;
        // Target policy smoothing, in half-widths of the box.
        let noise: Vec<f32> = (0..b * k)
            .map(|i| {
                let z: f64 = StandardNormal.sample(&mut self.rng);
                let h = f64::from(self.half_v[i % k]);
                (z * self.cfg.policy_noise * h)
                    .clamp(-self.cfg.noise_clip * h, self.cfg.noise_clip * h) as f32
            })
            .collect();
        let noise = Tensor::from_vec(noise, (b, k), &dev)?;
        let lo: Vec<f32> = self
            .center_v
            .iter()
            .zip(&self.half_v)
            .map(|(c, h)| c - h)
            .collect();
        let hi: Vec<f32> = self
            .center_v
            .iter()
            .zip(&self.half_v)
            .map(|(c, h)| c + h)
            .collect();
        let lo = Tensor::from_vec(lo, (1, k), &dev)?;
        let hi = Tensor::from_vec(hi, (1, k), &dev)?;
        let a2 = (self.policy(&self.actor_t, &s2)? + noise)?
            .broadcast_maximum(&lo)?
            .broadcast_minimum(&hi)?;
        let tq = Self::q(&self.q1_t, &s2, &a2)?.minimum(&Self::q(&self.q2_t, &s2, &a2)?)?;
        let y = (r + (nd * tq)? * self.cfg.gamma)?.detach();
        let c1 = (Self::q(&self.q1, &s, &a)? - &y)?.sqr()?.mean_all()?;
        let c2 = (Self::q(&self.q2, &s, &a)? - &y)?.sqr()?.mean_all()?;
        let critic_loss = (c1 + c2)?;
        self.critic_opt.backward_step(&critic_loss)?;
        self.updates += 1;
        let mut stats = Td3BcStats {
            critic_loss: critic_loss.to_scalar()?,
            actor_loss: None,
        };
        if self.updates.is_multiple_of(self.cfg.policy_freq) {
            let pi = self.policy(&self.actor, &s)?;
            let q = Self::q(&self.q1, &s, &pi)?;
            let loss = actor_loss(&q, &pi, &a, self.cfg.alpha)?;
            // Only the actor's variables are stepped; the critic's gradients are dropped.
            self.actor_opt.backward_step(&loss)?;
            stats.actor_loss = Some(loss.to_scalar()?);
            let tau = self.cfg.tau;
            self.actor_t.polyak(&self.actor, tau)?;
            self.q1_t.polyak(&self.q1, tau)?;
            self.q2_t.polyak(&self.q2, tau)?;
        }
        Ok(stats)
    }

    /// Mean undiscounted return of the deterministic policy over `episodes` episodes of
    /// `env_id` (episode `i` reset with seed `seed + i`), all played in lockstep.
    pub fn evaluate(&self, env_id: &str, episodes: usize, seed: u64) -> Result<f64> {
        evaluate_policy(env_id, episodes, seed, self.obs_dim, &mut |obs| {
            self.act(obs)
        })
    }
}

/// Mean undiscounted return of `policy` (rows of observations to rows of actions) over
/// `episodes` episodes of `env_id` (episode `i` reset with seed `seed + i`), in lockstep.
pub fn evaluate_policy(
    env_id: &str,
    episodes: usize,
    seed: u64,
    obs_dim: usize,
    policy: &mut dyn FnMut(&[f32]) -> Result<Vec<f32>>,
) -> Result<f64> {
    if episodes == 0 {
        return Err(NnError::Invalid(
            "evaluation needs at least one episode".into(),
        ));
    }
    let mut envs = Vec::with_capacity(episodes);
    let mut obs = vec![0f32; episodes * obs_dim];
    for i in 0..episodes {
        let mut e = fedrl_sim::make(env_id)?;
        e.reset(seed + i as u64, &mut obs[i * obs_dim..(i + 1) * obs_dim]);
        envs.push(e);
    }
    let mut total = vec![0f64; episodes];
    let mut live: Vec<usize> = (0..episodes).collect();
    let mut o = vec![0f32; obs_dim];
    while !live.is_empty() {
        let mut rows = Vec::with_capacity(live.len() * obs_dim);
        for &i in &live {
            rows.extend_from_slice(&obs[i * obs_dim..(i + 1) * obs_dim]);
        }
        let acts = policy(&rows)?;
        let k = acts.len() / live.len();
        let mut still = Vec::with_capacity(live.len());
        for (j, &i) in live.iter().enumerate() {
            let step = envs[i].step(
                fedrl_sim::Action::Continuous(&acts[j * k..(j + 1) * k]),
                &mut o,
            )?;
            total[i] += step.reward;
            obs[i * obs_dim..(i + 1) * obs_dim].copy_from_slice(&o);
            if !(step.terminated || step.truncated) {
                still.push(i);
            }
        }
        live = still;
    }
    Ok(total.iter().sum::<f64>() / episodes as f64)
}

/// The transitions of continuous-dataset episodes (each step's `s`, `a`, `r`, `s'`; terminal on
/// the last step of an episode that terminated, not on one a time limit cut).
pub fn transitions_from_episodes(
    episodes: &[&ContinuousEpisode],
    obs_dim: usize,
    act_dim: usize,
) -> Transitions {
    let mut t = Transitions {
        obs_dim,
        obs: Vec::new(),
        actions: Actions::Continuous {
            dim: act_dim,
            values: Vec::new(),
        },
        rewards: Vec::new(),
        next_obs: Vec::new(),
        terminals: Vec::new(),
    };
    for e in episodes {
        let n = e.len();
        t.obs.extend_from_slice(&e.observations[..n * obs_dim]);
        t.next_obs
            .extend_from_slice(&e.observations[obs_dim..(n + 1) * obs_dim]);
        if let Actions::Continuous { values, .. } = &mut t.actions {
            values.extend_from_slice(&e.actions);
        }
        t.rewards.extend_from_slice(&e.rewards);
        t.terminals
            .extend((0..n).map(|i| if e.terminated && i + 1 == n { 1.0 } else { 0.0 }));
    }
    t
}
