//! PrivORL-j, the trajectory synthesizer (seed 003, section VI): trajectories cut into fragments
//! of `H` transitions, a conditional EDM denoiser over fragments, generation fragment by
//! fragment, and the per-trajectory DP contribution ([`dp`]).
//!
//! **Fragments** (section VI-A). A trajectory of `n` encoded, normalised transitions (rows of
//! [`TransitionLayout::dim`] = `d` values) becomes fragments of `H` consecutive transitions,
//! starting at `0, H, 2H, ...`. Each fragment is conditioned on its **link transition**, the
//! transition just before its first one; the first fragment's link is all zeros. The condition
//! row is `[link (d values), flag]` with `flag = 1` for a real link and `0` for the first
//! fragment, so that "no link" cannot be confused with a link at the public mean (which is 0
//! after normalisation). Where `n` is not a multiple of `H`, the paper pads the last
//! sub-trajectory; fedrl instead takes the last fragment as the *final* `H` transitions (it
//! overlaps the one before it, its link is the transition before its start), so no made-up
//! transition is trained on. Only a trajectory shorter than `H` is padded, by repeating its last
//! transition (for a terminated trajectory, a repeated terminal transition: generation stops at
//! the first terminal, so the repeats are never emitted).
//!
//! **Networks** ([`FragmentNetConfig`]): the conditional residual MLP ([`mlp`], fedrl's CPU
//! default, the paper's PrivORL-j-U-style baseline: the condition is projected into the first
//! hidden layer) and the paper's transformer ([`transformer`]: 6 layers, 4 heads, width 256,
//! tokens per transition component, as the authors' `TasksAug`). Both are [`CondNet`]s, and
//! [`Conditioned`] binds one to its condition rows so that EDM's preconditioning, loss and Heun
//! sampler ([`super::edm`]) drive it unchanged.
//!
//! **Generation** (section VI-C, [`TrajectorySynthesizer::generate`]): the first fragment of
//! every trajectory is sampled with the zero condition; each next one is conditioned on the last
//! transition of the one before (as sampled, in normalised units); transitions are appended
//! until one is terminal (decoded `done`, threshold 0.5) or the maximum length is reached.
//!
//! Invariants: the normaliser is fitted on public rows only and fixed for the synthesizer's
//! life; a fragment row has `H d` values and a condition row `d + 1`; every random draw comes
//! from the seed given to the constructor (per-trajectory DP draws from `(data_seed, round,
//! unit)`, see [`dp`]). Units: model-side values are normalised; [`TrajectorySynthesizer::generate`]
//! returns environment units.

pub mod dp;
pub mod mlp;
pub mod transformer;

use candle_core::{Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

use super::denoiser::{DenoiserConfig, ParamShape};
use super::edm::{self, EdmConfig, EdmNet};
use super::ema::Ema;
use super::encode::{TransitionLayout, Transitions};
use super::normalize::{Normalizer, PublicRows, PublicSupport};
use super::synth::{TrainConfig, Weights};
use crate::{NnError, Result};

pub use dp::{
    TrajectoryContributions, draw_fragments, summed_trajectory_contributions,
    trajectory_contributions,
};
pub use mlp::CondMlp;
pub use transformer::{CondTransformer, TransformerConfig};

/// Default fragment length `H` (the authors' `horizon`, `PrivORL-J/config/locomotion.py`).
pub const DEFAULT_HORIZON: usize = 64;
/// Most fragments of one trajectory in its DP contribution (issue 56, section VI-B).
pub const MAX_FRAGMENTS_PER_TRAJECTORY: usize = 32;

/// Fragments of one or more trajectories: `x` holds `len` rows of `horizon * tdim` values,
/// `cond` `len` rows of `tdim + 1` (link transition, flag), both normalised, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Fragments {
    /// Values per transition (`d`).
    pub tdim: usize,
    /// Transitions per fragment (`H`).
    pub horizon: usize,
    pub x: Vec<f32>,
    pub cond: Vec<f32>,
}

impl Fragments {
    /// No fragments, for rows of `tdim` and fragments of `horizon`.
    pub fn empty(tdim: usize, horizon: usize) -> Self {
        Fragments {
            tdim,
            horizon,
            x: Vec::new(),
            cond: Vec::new(),
        }
    }

    /// Values per fragment row.
    pub fn row_dim(&self) -> usize {
        self.tdim * self.horizon
    }

    /// Values per condition row.
    pub fn cond_dim(&self) -> usize {
        self.tdim + 1
    }

    pub fn len(&self) -> usize {
        self.x.len().checked_div(self.row_dim()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.x.is_empty()
    }

    /// Fragment `i`'s values.
    pub fn row(&self, i: usize) -> &[f32] {
        let d = self.row_dim();
        &self.x[i * d..(i + 1) * d]
    }

    /// Fragment `i`'s condition.
    pub fn cond_row(&self, i: usize) -> &[f32] {
        let c = self.cond_dim();
        &self.cond[i * c..(i + 1) * c]
    }

    /// Appends `other`'s fragments (same sizes).
    pub fn extend(&mut self, other: &Fragments) -> Result<()> {
        if other.tdim != self.tdim || other.horizon != self.horizon {
            return Err(NnError::Invalid("fragments of different sizes".into()));
        }
        self.x.extend_from_slice(&other.x);
        self.cond.extend_from_slice(&other.cond);
        Ok(())
    }

    /// The fragments `idx` (in that order), as a new set.
    pub fn select(&self, idx: &[usize]) -> Fragments {
        let mut out = Fragments::empty(self.tdim, self.horizon);
        for &i in idx {
            out.x.extend_from_slice(self.row(i));
            out.cond.extend_from_slice(self.cond_row(i));
        }
        out
    }
}

/// Cuts one trajectory, `rows` (its transitions as encoded, normalised rows of `tdim` values,
/// in time order), into fragments of `horizon` transitions with their link conditions (see the
/// module docs for the last fragment and short trajectories).
pub fn split_fragments(rows: &[f32], tdim: usize, horizon: usize) -> Result<Fragments> {
    if tdim == 0 || horizon == 0 || rows.is_empty() || !rows.len().is_multiple_of(tdim) {
        return Err(NnError::Invalid(format!(
            "trajectory: {} values are not a non-empty list of rows of {tdim} (horizon {horizon})",
            rows.len()
        )));
    }
    let n = rows.len() / tdim;
    let mut out = Fragments::empty(tdim, horizon);
    let push_cond = |out: &mut Fragments, start: usize| {
        if start == 0 {
            out.cond.extend(std::iter::repeat_n(0.0, tdim + 1));
        } else {
            out.cond
                .extend_from_slice(&rows[(start - 1) * tdim..start * tdim]);
            out.cond.push(1.0);
        }
    };
    if n < horizon {
        out.x.extend_from_slice(rows);
        let last = &rows[(n - 1) * tdim..];
        for _ in n..horizon {
            out.x.extend_from_slice(last);
        }
        push_cond(&mut out, 0);
        return Ok(out);
    }
    let mut starts: Vec<usize> = (0..n / horizon).map(|k| k * horizon).collect();
    if !n.is_multiple_of(horizon) {
        starts.push(n - horizon);
    }
    for s in starts {
        out.x
            .extend_from_slice(&rows[s * tdim..(s + horizon) * tdim]);
        push_cond(&mut out, s);
    }
    Ok(out)
}

/// A conditional denoiser `F(x, t; c)` over fragment rows.
pub trait CondNet {
    /// Values per fragment row (`H d`).
    fn data_dim(&self) -> usize;
    /// Values per condition row (`d + 1`).
    fn cond_dim(&self) -> usize;
    fn device(&self) -> &Device;
    /// The trainable tensors in flat order, with the shapes they have in `params` (weights
    /// `[in, out]`); the flat layout is each tensor row-major in this order.
    fn param_shapes(&self) -> &[ParamShape];
    /// `F(x, t; c)` for `x` `[B, data_dim]`, `t` `[B]` (EDM's `c_noise`) and `cond`
    /// `[B, cond_dim]`.
    fn forward_cond(
        &self,
        params: &[Tensor],
        x: &Tensor,
        t: &Tensor,
        cond: &Tensor,
    ) -> Result<Tensor>;

    /// Number of trainable values.
    fn num_params(&self) -> usize {
        self.param_shapes().iter().map(ParamShape::numel).sum()
    }
}

/// A [`CondNet`] bound to condition rows `cond` (`[B, cond_dim]`): an [`EdmNet`] for batches of
/// exactly those `B` rows.
pub struct Conditioned<'a, N: CondNet + ?Sized> {
    pub net: &'a N,
    pub cond: &'a Tensor,
}

impl<N: CondNet + ?Sized> EdmNet for Conditioned<'_, N> {
    fn data_dim(&self) -> usize {
        self.net.data_dim()
    }

    fn device(&self) -> &Device {
        self.net.device()
    }

    fn forward(&self, params: &[Tensor], x: &Tensor, t: &Tensor) -> Result<Tensor> {
        if self.cond.dim(0)? != x.dim(0)? {
            return Err(NnError::Invalid(format!(
                "conditional denoiser: {} condition rows for {} rows",
                self.cond.dim(0)?,
                x.dim(0)?
            )));
        }
        self.net.forward_cond(params, x, t, self.cond)
    }
}

/// Device tensors from flat values in `shapes`' layout.
pub fn tensors_from_flat(
    shapes: &[ParamShape],
    flat: &[f32],
    device: &Device,
) -> Result<Vec<Tensor>> {
    let expected: usize = shapes.iter().map(ParamShape::numel).sum();
    if flat.len() != expected {
        return Err(NnError::ParamLength {
            got: flat.len(),
            expected,
        });
    }
    let mut at = 0;
    let mut out = Vec::with_capacity(shapes.len());
    for s in shapes {
        let n = s.numel();
        out.push(Tensor::from_slice(
            &flat[at..at + n],
            s.shape.as_slice(),
            device,
        )?);
        at += n;
    }
    Ok(out)
}

/// Flat values of `params` (each tensor row-major, in order).
pub fn flat_from_tensors(params: &[Tensor]) -> Result<Vec<f32>> {
    let mut flat = Vec::new();
    for p in params {
        flat.extend(p.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(flat)
}

/// Seeded initial values, tensor by tensor (PyTorch's defaults: `nn.Linear` `U(-k, k)` with
/// `k = 1/sqrt(in)` for weight and bias, `nn.LayerNorm` ones and zeros).
pub(crate) struct Init {
    rng: Xoshiro256PlusPlus,
    pub shapes: Vec<ParamShape>,
    pub flat: Vec<f32>,
}

impl Init {
    pub fn new(seed: u64) -> Self {
        Init {
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
            shapes: Vec::new(),
            flat: Vec::new(),
        }
    }

    /// A linear layer `name` (`name.weight` `[in, out]`, `name.bias` `[out]`).
    pub fn linear(&mut self, name: &str, i: usize, o: usize) {
        let k = 1.0 / (i as f32).sqrt();
        for _ in 0..(i * o + o) {
            self.flat.push(self.rng.random_range(-k..k));
        }
        self.push_shape(format!("{name}.weight"), vec![i, o]);
        self.push_shape(format!("{name}.bias"), vec![o]);
    }

    /// A layer norm `name` over `n` values.
    pub fn layer_norm(&mut self, name: &str, n: usize) {
        self.flat.extend(std::iter::repeat_n(1.0, n));
        self.flat.extend(std::iter::repeat_n(0.0, n));
        self.push_shape(format!("{name}.weight"), vec![n]);
        self.push_shape(format!("{name}.bias"), vec![n]);
    }

    fn push_shape(&mut self, name: String, shape: Vec<usize>) {
        self.shapes.push(ParamShape { name, shape });
    }

    /// `n` standard normal values (fixed buffers such as Fourier frequencies).
    pub fn normals(&mut self, n: usize) -> Vec<f32> {
        use rand_distr::{Distribution, StandardNormal};
        (0..n)
            .map(|_| StandardNormal.sample(&mut self.rng))
            .collect()
    }
}

/// `x W + b` for `x` `[.., in]` (any leading dimensions), `W` `[in, out]`.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let (lead, i) = dims.split_at(dims.len() - 1);
    let rows: usize = lead.iter().product();
    let y = x.reshape((rows, i[0]))?.matmul(w)?.broadcast_add(b)?;
    let mut out = lead.to_vec();
    out.push(w.dim(1)?);
    y.reshape(out)
}

/// Random Fourier features of the noise level, `[t, sin(2 pi t w), cos(2 pi t w)]` (`[B, 1 + 2
/// len(w)]`), as SynthER's time embedding.
pub(crate) fn fourier(t: &Tensor, freqs: &Tensor) -> candle_core::Result<Tensor> {
    let b = t.dim(0)?;
    let t = t.reshape((b, 1))?.to_dtype(candle_core::DType::F32)?;
    let angles = (t.broadcast_mul(freqs)? * (2.0 * std::f64::consts::PI))?;
    Tensor::cat(&[&t, &angles.sin()?, &angles.cos()?], 1)
}

/// Which fragment denoiser, and its sizes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FragmentNetConfig {
    /// The conditional residual MLP (fedrl's CPU default).
    Mlp(DenoiserConfig),
    /// The paper's transformer (meant for a GPU).
    Transformer(TransformerConfig),
}

impl Default for FragmentNetConfig {
    fn default() -> Self {
        FragmentNetConfig::Mlp(DenoiserConfig::default())
    }
}

/// Everything that configures a trajectory synthesizer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrajectoryConfig {
    /// Transitions per fragment `H`.
    pub horizon: usize,
    pub net: FragmentNetConfig,
    pub edm: EdmConfig,
    pub train: TrainConfig,
}

impl Default for TrajectoryConfig {
    fn default() -> Self {
        TrajectoryConfig {
            horizon: DEFAULT_HORIZON,
            net: FragmentNetConfig::default(),
            edm: EdmConfig::default(),
            train: TrainConfig::default(),
        }
    }
}

/// One of the two fragment denoisers.
#[derive(Clone, Debug)]
pub enum FragmentNet {
    Mlp(CondMlp),
    Transformer(CondTransformer),
}

impl FragmentNet {
    /// A fresh network for `layout` and `horizon` with its seeded initial flat parameters.
    pub fn new(
        layout: &TransitionLayout,
        horizon: usize,
        cfg: &FragmentNetConfig,
        seed: u64,
        device: &Device,
    ) -> Result<(Self, Vec<f32>)> {
        layout.check()?;
        let tdim = layout.dim();
        Ok(match cfg {
            FragmentNetConfig::Mlp(c) => {
                let (n, flat) = CondMlp::new(horizon * tdim, tdim + 1, *c, seed, device)?;
                (FragmentNet::Mlp(n), flat)
            }
            FragmentNetConfig::Transformer(c) => {
                let (n, flat) = CondTransformer::new(layout, horizon, *c, seed, device)?;
                (FragmentNet::Transformer(n), flat)
            }
        })
    }

    fn inner(&self) -> &dyn CondNet {
        match self {
            FragmentNet::Mlp(n) => n,
            FragmentNet::Transformer(n) => n,
        }
    }
}

impl CondNet for FragmentNet {
    fn data_dim(&self) -> usize {
        self.inner().data_dim()
    }

    fn cond_dim(&self) -> usize {
        self.inner().cond_dim()
    }

    fn device(&self) -> &Device {
        self.inner().device()
    }

    fn param_shapes(&self) -> &[ParamShape] {
        self.inner().param_shapes()
    }

    fn forward_cond(
        &self,
        params: &[Tensor],
        x: &Tensor,
        t: &Tensor,
        cond: &Tensor,
    ) -> Result<Tensor> {
        self.inner().forward_cond(params, x, t, cond)
    }
}

/// A conditional EDM model over fragments: the network, AdamW, the EMA of the weights and the
/// random stream of training and sampling (the counterpart of [`super::DiffusionModel`]).
pub struct FragmentModel {
    edm: EdmConfig,
    train: TrainConfig,
    net: FragmentNet,
    vars: Vec<Var>,
    ema: Ema,
    opt: AdamW,
    rng: Xoshiro256PlusPlus,
    steps: u64,
}

impl FragmentModel {
    /// A fresh model, all randomness from `seed`.
    pub fn new(
        layout: &TransitionLayout,
        cfg: &TrajectoryConfig,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        Self::build(layout, cfg, seed, seed, device, None)
    }

    /// A model with given weights: the network's fixed parts (Fourier frequencies) from
    /// `net_seed` (the seed the weights were trained with, so they mean the same function),
    /// the online weights `online` (flat, [`CondNet::param_shapes`] layout), the EMA resumed
    /// from `ema` = `(weights, calls)` or restarted from `online`, fresh AdamW moments, and the
    /// training and sampling stream from `rng_seed`. For a new training phase (fine-tuning
    /// from pre-trained weights) and for checkpoints.
    pub fn from_weights(
        layout: &TransitionLayout,
        cfg: &TrajectoryConfig,
        net_seed: u64,
        rng_seed: u64,
        device: &Device,
        online: &[f32],
        ema: Option<(&[f32], u64)>,
    ) -> Result<Self> {
        Self::build(layout, cfg, net_seed, rng_seed, device, Some((online, ema)))
    }

    #[allow(clippy::type_complexity)]
    fn build(
        layout: &TransitionLayout,
        cfg: &TrajectoryConfig,
        seed: u64,
        rng_seed: u64,
        device: &Device,
        weights: Option<(&[f32], Option<(&[f32], u64)>)>,
    ) -> Result<Self> {
        cfg.edm.check()?;
        super::synth::SynthesizerConfig {
            train: cfg.train,
            edm: cfg.edm,
            ..Default::default()
        }
        .check()?;
        if cfg.horizon == 0 {
            return Err(NnError::Invalid(
                "trajectory horizon must be positive".into(),
            ));
        }
        let (net, init) = FragmentNet::new(layout, cfg.horizon, &cfg.net, seed, device)?;
        let (flat, ema_from) = match weights {
            Some((online, ema)) => (online, ema),
            None => (init.as_slice(), None),
        };
        let vars: Vec<Var> = tensors_from_flat(net.param_shapes(), flat, device)?
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<_>>()?;
        let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let ema = match ema_from {
            Some((avg, calls)) => Ema::resume(
                cfg.train.ema,
                calls,
                tensors_from_flat(net.param_shapes(), avg, device)?,
            )?,
            None => Ema::new(cfg.train.ema, &tensors)?,
        };
        let t = &cfg.train;
        let opt = AdamW::new(
            vars.clone(),
            ParamsAdamW {
                lr: t.lr,
                beta1: t.beta1,
                beta2: t.beta2,
                eps: t.eps,
                weight_decay: t.weight_decay,
            },
        )?;
        Ok(FragmentModel {
            edm: cfg.edm,
            train: cfg.train,
            net,
            vars,
            ema,
            opt,
            rng: Xoshiro256PlusPlus::seed_from_u64(rng_seed ^ 0x7a1e_c70e_0000_0001),
            steps: 0,
        })
    }

    pub fn net(&self) -> &FragmentNet {
        &self.net
    }

    pub fn edm(&self) -> &EdmConfig {
        &self.edm
    }

    /// Optimiser steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn rng_mut(&mut self) -> &mut Xoshiro256PlusPlus {
        &mut self.rng
    }

    /// The online weights (sharing storage with the optimiser's variables).
    pub fn online_params(&self) -> Vec<Tensor> {
        self.vars.iter().map(|v| v.as_tensor().clone()).collect()
    }

    pub fn ema_params(&self) -> &[Tensor] {
        self.ema.params()
    }

    /// The online weights as one flat vector ([`CondNet::param_shapes`] layout).
    pub fn online_flat(&self) -> Result<Vec<f32>> {
        flat_from_tensors(&self.online_params())
    }

    pub fn ema_flat(&self) -> Result<Vec<f32>> {
        flat_from_tensors(self.ema.params())
    }

    /// EMA updates so far (what [`Self::from_weights`] resumes the average with).
    pub fn ema_calls(&self) -> u64 {
        self.ema.calls()
    }

    fn check_batch(&self, x: &[f32], cond: &[f32]) -> Result<usize> {
        let (d, c) = (self.net.data_dim(), self.net.cond_dim());
        let b = x.len() / d;
        if x.is_empty() || !x.len().is_multiple_of(d) || cond.len() != b * c {
            return Err(NnError::Invalid(format!(
                "fragment batch: {} values and {} condition values do not make rows of {d} and {c}",
                x.len(),
                cond.len()
            )));
        }
        Ok(b)
    }

    fn batch_loss(&mut self, params: &[Tensor], x: &[f32], cond: &[f32]) -> Result<Tensor> {
        let b = self.check_batch(x, cond)?;
        let (d, c) = (self.net.data_dim(), self.net.cond_dim());
        let dev = self.net.device().clone();
        let x0 = Tensor::from_slice(x, (b, d), &dev)?;
        let ct = Tensor::from_slice(cond, (b, c), &dev)?;
        let sigmas: Vec<f64> = (0..b).map(|_| self.edm.draw_sigma(&mut self.rng)).collect();
        let noise = edm::normal_tensor(b, d, &mut self.rng, &dev)?;
        let net = Conditioned {
            net: &self.net,
            cond: &ct,
        };
        Ok(edm::per_example_loss(&self.edm, &net, params, &x0, &sigmas, &noise)?.mean_all()?)
    }

    /// Mean EDM loss of a batch at fresh noise, without training.
    pub fn loss(&mut self, x: &[f32], cond: &[f32], weights: Weights) -> Result<f32> {
        let params = match weights {
            Weights::Online => self.online_params(),
            Weights::Ema => self.ema.params().to_vec(),
        };
        Ok(self.batch_loss(&params, x, cond)?.to_scalar::<f32>()?)
    }

    /// One non-private step on fragments `x` with conditions `cond` (mean EDM loss, backward,
    /// global-norm clip, AdamW, EMA). Returns the loss before the step.
    pub fn train_step(&mut self, x: &[f32], cond: &[f32]) -> Result<f32> {
        let params = self.online_params();
        let loss = self.batch_loss(&params, x, cond)?;
        let mut grads = loss.backward()?;
        if let Some(c) = self.train.grad_clip {
            let mut sq = 0.0f64;
            for v in &self.vars {
                if let Some(g) = grads.get(v) {
                    sq += f64::from(g.sqr()?.sum_all()?.to_scalar::<f32>()?);
                }
            }
            let coef = c / (sq.sqrt() + 1e-6);
            if coef < 1.0 {
                for v in &self.vars {
                    if let Some(g) = grads.remove(v) {
                        grads.insert(v, (g * coef)?);
                    }
                }
            }
        }
        self.opt.step(&grads)?;
        self.ema.update(&self.online_params())?;
        self.steps += 1;
        Ok(loss.to_scalar::<f32>()?)
    }

    /// Applies an already computed gradient (flat layout; e.g. DP-SGD's noisy mean of the
    /// trajectories' clipped contributions) with AdamW, then updates the EMA.
    pub fn apply_gradient(&mut self, grad: &[f32]) -> Result<()> {
        let dev = self.net.device().clone();
        let tensors = tensors_from_flat(self.net.param_shapes(), grad, &dev)?;
        // d/dv sum(v * g) = g exactly: a gradient store holding `grad` (candle's store has
        // no public constructor).
        let mut surrogate: Option<Tensor> = None;
        for (v, g) in self.vars.iter().zip(&tensors) {
            let term = (v.as_tensor() * g)?.sum_all()?;
            surrogate = Some(match surrogate {
                None => term,
                Some(acc) => (acc + term)?,
            });
        }
        let Some(surrogate) = surrogate else {
            return Err(NnError::Invalid("fragment model without parameters".into()));
        };
        self.opt.step(&surrogate.backward()?)?;
        self.ema.update(&self.online_params())?;
        self.steps += 1;
        Ok(())
    }

    /// One normalised fragment per condition row of `cond` (row-major), from the chosen
    /// weights.
    pub fn sample_normalized(&mut self, cond: &[f32], weights: Weights) -> Result<Vec<f32>> {
        let (d, c) = (self.net.data_dim(), self.net.cond_dim());
        if !cond.len().is_multiple_of(c) {
            return Err(NnError::Invalid(format!(
                "{} condition values are not rows of {c}",
                cond.len()
            )));
        }
        let n = cond.len() / c;
        let params: Vec<Tensor> = match weights {
            Weights::Online => self.vars.iter().map(|v| v.as_tensor().detach()).collect(),
            Weights::Ema => self.ema.params().to_vec(),
        };
        let dev = self.net.device().clone();
        let mut out = Vec::with_capacity(n * d);
        let mut at = 0;
        while at < n {
            let m = (n - at).min(self.train.sample_chunk);
            let ct = Tensor::from_slice(&cond[at * c..(at + m) * c], (m, c), &dev)?;
            let net = Conditioned {
                net: &self.net,
                cond: &ct,
            };
            let x = edm::heun_sample(&self.edm, &net, &params, m, &mut self.rng)?;
            out.extend(x.flatten_all()?.to_vec1::<f32>()?);
            at += m;
        }
        Ok(out)
    }
}

/// The trajectory synthesizer: a [`FragmentModel`] with the transition layout and the
/// public-data normaliser.
pub struct TrajectorySynthesizer {
    layout: TransitionLayout,
    horizon: usize,
    normalizer: Normalizer,
    model: FragmentModel,
}

impl TrajectorySynthesizer {
    /// A fresh synthesizer for `layout`, its normaliser fitted on the public transitions
    /// `public`, all randomness from `seed`.
    pub fn new(
        layout: TransitionLayout,
        public: &PublicRows,
        cfg: TrajectoryConfig,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        layout.check()?;
        let normalizer = Normalizer::fit_public(&layout, public)?;
        let model = FragmentModel::new(&layout, &cfg, seed, device)?;
        Ok(TrajectorySynthesizer {
            layout,
            horizon: cfg.horizon,
            normalizer,
            model,
        })
    }

    pub fn layout(&self) -> &TransitionLayout {
        &self.layout
    }

    pub fn horizon(&self) -> usize {
        self.horizon
    }

    pub fn normalizer(&self) -> &Normalizer {
        &self.normalizer
    }

    pub fn model(&self) -> &FragmentModel {
        &self.model
    }

    pub fn model_mut(&mut self) -> &mut FragmentModel {
        &mut self.model
    }

    /// The fragments of one trajectory `t` (its transitions in time order): encoded,
    /// normalised with the public statistics, split ([`split_fragments`]).
    pub fn fragments(&self, t: &Transitions) -> Result<Fragments> {
        let mut rows = self.layout.encode(t)?;
        self.normalizer.normalize(&mut rows);
        split_fragments(&rows, self.layout.dim(), self.horizon)
    }

    /// `n` synthetic trajectories from the EMA weights, each generated fragment by fragment
    /// until a terminal transition or `max_len` transitions (environment units).
    pub fn generate(&mut self, n: usize, max_len: usize) -> Result<Vec<Transitions>> {
        self.generate_snapped(n, max_len, None)
    }

    /// [`Self::generate`] with the entries of `support` snapped to their public values before
    /// decoding (the conditioning on the previous fragment uses the model's own values).
    pub fn generate_snapped(
        &mut self,
        n: usize,
        max_len: usize,
        support: Option<&PublicSupport>,
    ) -> Result<Vec<Transitions>> {
        let d = self.layout.dim();
        if max_len == 0 {
            return Err(NnError::Invalid(
                "maximum trajectory length must be positive".into(),
            ));
        }
        let done_at = self.layout.model_terminal.then(|| d - 1);
        let mut rows: Vec<Vec<f32>> = vec![Vec::new(); n];
        let mut active: Vec<usize> = (0..n).collect();
        let mut cond = vec![0.0f32; n * (d + 1)];
        while !active.is_empty() {
            let mut c = Vec::with_capacity(active.len() * (d + 1));
            for &i in &active {
                c.extend_from_slice(&cond[i * (d + 1)..(i + 1) * (d + 1)]);
            }
            let frags = self.model.sample_normalized(&c, Weights::Ema)?;
            let mut still = Vec::with_capacity(active.len());
            for (j, &i) in active.iter().enumerate() {
                let frag = &frags[j * self.horizon * d..(j + 1) * self.horizon * d];
                let mut finished = false;
                for tr in frag.chunks_exact(d) {
                    let mut raw = tr.to_vec();
                    self.normalizer.unnormalize(&mut raw);
                    rows[i].extend_from_slice(&raw);
                    let terminal = done_at.is_some_and(|k| raw[k] > 0.5);
                    if terminal || rows[i].len() / d >= max_len {
                        finished = true;
                        break;
                    }
                }
                if !finished {
                    let last = &frag[(self.horizon - 1) * d..];
                    cond[i * (d + 1)..i * (d + 1) + d].copy_from_slice(last);
                    cond[i * (d + 1) + d] = 1.0;
                    still.push(i);
                }
            }
            active = still;
        }
        if let Some(sp) = support {
            for r in &mut rows {
                sp.snap(r);
            }
        }
        rows.iter().map(|r| self.layout.decode(r)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_cover_the_trajectory_with_their_links() {
        // 7 transitions of 2 values (row k = [k, -k]), H = 3: fragments at 0, 3 and the last 3.
        let rows: Vec<f32> = (0..7).flat_map(|k| [k as f32, -(k as f32)]).collect();
        let f = split_fragments(&rows, 2, 3).unwrap();
        assert_eq!(f.len(), 3);
        assert_eq!(f.row(0), &[0., 0., 1., -1., 2., -2.]);
        assert_eq!(f.cond_row(0), &[0., 0., 0.]);
        assert_eq!(f.row(1), &[3., -3., 4., -4., 5., -5.]);
        assert_eq!(f.cond_row(1), &[2., -2., 1.]);
        assert_eq!(f.row(2), &[4., -4., 5., -5., 6., -6.]);
        assert_eq!(f.cond_row(2), &[3., -3., 1.]);
        // A multiple of H: no overlap.
        let f = split_fragments(&rows[..12], 2, 3).unwrap();
        assert_eq!(f.len(), 2);
        assert_eq!(f.cond_row(1), &[2., -2., 1.]);
        // Shorter than H: padded with the last transition, zero link.
        let f = split_fragments(&rows[..4], 2, 3).unwrap();
        assert_eq!(f.len(), 1);
        assert_eq!(f.row(0), &[0., 0., 1., -1., 1., -1.]);
        assert_eq!(f.cond_row(0), &[0., 0., 0.]);
        assert!(split_fragments(&rows[..3], 2, 3).is_err());
        assert!(split_fragments(&[], 2, 3).is_err());
    }
}
