//! PrivORL-n's transition synthesizer (seed 003, section IV-B, appendix F-A): the EDM denoiser,
//! its AdamW optimiser, the EMA of its weights and the public-data normaliser, with one training
//! step and the sampler.
//!
//! Training data are **normalised encoded rows** (rows of [`TransitionLayout::dim`] values; see
//! [`TransitionSynthesizer::encode`]). Samples are drawn from the EMA weights, unnormalised and
//! decoded ([`TransitionSynthesizer::sample`]).
//!
//! Optimiser settings (defaults of [`TrainConfig`]): AdamW with learning rate 3e-4, weight
//! decay 0 (gin lines 35 and 37, `Trainer.train_lr`, `Trainer.weight_decay`),
//! betas (0.9, 0.99) (`Trainer.adam_betas` default, `synther/diffusion/elucidated_diffusion.py:
//! 324` in PrivORL), the gradient's global L2 norm clipped to 1.0 before each step (`:568`,
//! PyTorch's `clip_grad_norm_`: factor `1 / (norm + 1e-6)`), batches of 128 (PrivORL's gin line 34,
//! `Trainer.train_batch_size`). PrivORL steps its cosine schedule once per epoch over
//! `T_max = 100000` (`:601-602`), which leaves the rate constant in practice: fedrl keeps it
//! constant.
//!
//! Invariants: the normaliser is the one fitted on public data at construction (or read back
//! with the weights it was trained with) and never changes; every random draw (initial weights,
//! training noise, sampling noise) comes from the seed given to the constructor.

use candle_core::{Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use serde::{Deserialize, Serialize};

use super::denoiser::{Denoiser, DenoiserConfig, DenoiserSpec};
use super::edm::{self, EdmConfig};
use super::ema::{Ema, EmaConfig};
use super::encode::{TransitionLayout, Transitions};
use super::normalize::{Normalizer, PublicRows, PublicSupport};
use crate::tensor_io;
use crate::{NnError, Result};

/// Optimiser, batch and EMA settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// AdamW learning rate.
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Global gradient-norm clip before each non-private step (`None`: no clip).
    pub grad_clip: Option<f64>,
    /// Rows per training batch.
    pub batch_size: usize,
    /// Rows per sampler call (bounds memory; the sampler's result does not depend on it
    /// except through the order of random draws).
    pub sample_chunk: usize,
    pub ema: EmaConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            grad_clip: Some(1.0),
            batch_size: 128,
            sample_chunk: 10_000,
            ema: EmaConfig::default(),
        }
    }
}

/// Everything that configures a synthesizer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SynthesizerConfig {
    pub denoiser: DenoiserConfig,
    pub edm: EdmConfig,
    pub train: TrainConfig,
}

impl SynthesizerConfig {
    pub fn check(&self) -> Result<()> {
        self.edm.check()?;
        self.train.ema.check()?;
        let t = &self.train;
        let ok = t.lr.is_finite()
            && t.lr > 0.0
            && (0.0..1.0).contains(&t.beta1)
            && (0.0..1.0).contains(&t.beta2)
            && t.eps.is_finite()
            && t.eps > 0.0
            && t.weight_decay.is_finite()
            && t.weight_decay >= 0.0
            && t.grad_clip.is_none_or(|c| c.is_finite() && c > 0.0)
            && t.batch_size > 0
            && t.sample_chunk > 0;
        if !ok {
            return Err(NnError::Invalid(format!(
                "synthesizer training settings out of range: {t:?}"
            )));
        }
        Ok(())
    }
}

/// Which weights a sampler call uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weights {
    /// The optimiser's current weights (PrivORL's curiosity samples, `elucidated_diffusion.py:542`).
    Online,
    /// The moving average (released samples).
    Ema,
}

/// An EDM diffusion model over rows of `data_dim` normalised values: the denoiser, its AdamW
/// optimiser, the EMA of its weights and the random stream of training and sampling.
pub struct DiffusionModel {
    cfg: SynthesizerConfig,
    net: Denoiser,
    vars: Vec<Var>,
    ema: Ema,
    opt: AdamW,
    rng: Xoshiro256PlusPlus,
    steps: u64,
}

impl DiffusionModel {
    /// A fresh model over rows of `data_dim` values, all randomness from `seed`.
    pub fn new(
        data_dim: usize,
        cfg: SynthesizerConfig,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        let spec = DenoiserSpec {
            data_dim,
            config: cfg.denoiser,
        };
        let (flat, freqs) = spec.init(seed)?;
        Self::from_parts(data_dim, cfg, &flat, None, &freqs, seed, device)
    }

    /// A model from saved weights: the online weights `online` (flat PyTorch layout), their
    /// average `ema` (`None`: a fresh average, a copy of `online`, with `ema_calls = 0`), the
    /// Fourier frequencies, a fresh AdamW and a random stream seeded with `seed`.
    pub fn from_parts(
        data_dim: usize,
        cfg: SynthesizerConfig,
        online: &[f32],
        ema: Option<(&[f32], u64)>,
        freqs: &[f32],
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        cfg.check()?;
        let spec = DenoiserSpec {
            data_dim,
            config: cfg.denoiser,
        };
        let net = Denoiser::new(spec, freqs, device)?;
        let vars: Vec<Var> = net
            .tensors_from_flat(online)?
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<_>>()?;
        let ema = match ema {
            Some((flat, calls)) => Ema::resume(cfg.train.ema, calls, net.tensors_from_flat(flat)?)?,
            None => {
                let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                Ema::new(cfg.train.ema, &tensors)?
            }
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
        // The training and sampling stream is separate from the initialisation stream.
        let rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x5eed_d1ff_0000_0001);
        Ok(DiffusionModel {
            cfg,
            net,
            vars,
            ema,
            opt,
            rng,
            steps: 0,
        })
    }

    pub fn config(&self) -> &SynthesizerConfig {
        &self.cfg
    }

    pub fn denoiser(&self) -> &Denoiser {
        &self.net
    }

    /// Values per row.
    pub fn dim(&self) -> usize {
        self.net.spec().data_dim
    }

    /// Optimiser steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The model's random stream (curiosity draws from it too, so one seed fixes a run).
    pub fn rng_mut(&mut self) -> &mut Xoshiro256PlusPlus {
        &mut self.rng
    }

    /// The online weights as tensors (they share storage with the optimiser's variables).
    pub fn online_params(&self) -> Vec<Tensor> {
        self.vars.iter().map(|v| v.as_tensor().clone()).collect()
    }

    /// The EMA weights.
    pub fn ema_params(&self) -> &[Tensor] {
        self.ema.params()
    }

    /// The online weights as one flat PyTorch-layout vector.
    pub fn online_flat(&self) -> Result<Vec<f32>> {
        self.net.flat_from_tensors(&self.online_params())
    }

    /// The EMA weights as one flat PyTorch-layout vector.
    pub fn ema_flat(&self) -> Result<Vec<f32>> {
        self.net.flat_from_tensors(self.ema.params())
    }

    /// EMA updates so far (what [`Self::from_parts`] resumes the average with).
    pub fn ema_calls(&self) -> u64 {
        self.ema.calls()
    }

    /// Mean EDM loss of a batch of normalised rows at freshly drawn noise, without training
    /// (diagnostics).
    pub fn loss(&mut self, rows: &[f32], weights: Weights) -> Result<f32> {
        let params = match weights {
            Weights::Online => self.online_params(),
            Weights::Ema => self.ema.params().to_vec(),
        };
        let loss = self.batch_loss(&params, rows)?;
        Ok(loss.to_scalar::<f32>()?)
    }

    fn batch_loss(&mut self, params: &[Tensor], rows: &[f32]) -> Result<Tensor> {
        let d = self.dim();
        if rows.is_empty() || !rows.len().is_multiple_of(d) {
            return Err(NnError::Invalid(format!(
                "diffusion batch: {} values are not rows of {d}",
                rows.len()
            )));
        }
        let b = rows.len() / d;
        let dev = self.net.device().clone();
        let x0 = Tensor::from_slice(rows, (b, d), &dev)?;
        let sigmas: Vec<f64> = (0..b)
            .map(|_| self.cfg.edm.draw_sigma(&mut self.rng))
            .collect();
        let noise = edm::normal_tensor(b, d, &mut self.rng, &dev)?;
        Ok(
            edm::per_example_loss(&self.cfg.edm, &self.net, params, &x0, &sigmas, &noise)?
                .mean_all()?,
        )
    }

    /// One non-private training step on a batch of normalised rows: the mean EDM loss,
    /// backward, global-norm clip, AdamW, EMA update. Returns the batch's loss before the step.
    pub fn train_step(&mut self, rows: &[f32]) -> Result<f32> {
        let params = self.online_params();
        let loss = self.batch_loss(&params, rows)?;
        let mut grads = loss.backward()?;
        if let Some(c) = self.cfg.train.grad_clip {
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

    /// One optimiser step with a given gradient (flat PyTorch layout, e.g. DP fine-tuning's
    /// released noisy mean gradient: everything done with it is post-processing): AdamW, then
    /// the EMA update. No global-norm clip (the gradient is what it is).
    pub fn apply_gradient(&mut self, flat_grad: &[f32]) -> Result<()> {
        let tensors = self.net.tensors_from_flat(flat_grad)?;
        let mut grads = candle_core::backprop::GradStore::default();
        for (v, g) in self.vars.iter().zip(tensors) {
            grads.insert(v.as_tensor(), g);
        }
        self.opt.step(&grads)?;
        self.ema.update(&self.online_params())?;
        self.steps += 1;
        Ok(())
    }

    /// `n` normalised samples (rows of [`Self::dim`], row-major) from the chosen weights.
    pub fn sample_normalized(&mut self, n: usize, weights: Weights) -> Result<Vec<f32>> {
        let params: Vec<Tensor> = match weights {
            Weights::Online => self.vars.iter().map(|v| v.as_tensor().detach()).collect(),
            Weights::Ema => self.ema.params().to_vec(),
        };
        let mut out = Vec::with_capacity(n * self.dim());
        let mut left = n;
        while left > 0 {
            let m = left.min(self.cfg.train.sample_chunk);
            let x = edm::heun_sample(&self.cfg.edm, &self.net, &params, m, &mut self.rng)?;
            out.extend(x.flatten_all()?.to_vec1::<f32>()?);
            left -= m;
        }
        Ok(out)
    }
}

/// The transition synthesizer: a [`DiffusionModel`] over encoded transitions with the
/// public-data normaliser.
pub struct TransitionSynthesizer {
    layout: TransitionLayout,
    normalizer: Normalizer,
    model: DiffusionModel,
}

impl TransitionSynthesizer {
    /// A fresh synthesizer for `layout`, its normaliser fitted on `public`, all randomness from
    /// `seed`.
    pub fn new(
        layout: TransitionLayout,
        public: &PublicRows,
        cfg: SynthesizerConfig,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        layout.check()?;
        let normalizer = Normalizer::fit_public(&layout, public)?;
        let model = DiffusionModel::new(layout.dim(), cfg, seed, device)?;
        Ok(TransitionSynthesizer {
            layout,
            normalizer,
            model,
        })
    }

    pub fn layout(&self) -> &TransitionLayout {
        &self.layout
    }

    /// The public-data normaliser (fixed for the synthesizer's life).
    pub fn normalizer(&self) -> &Normalizer {
        &self.normalizer
    }

    pub fn model(&self) -> &DiffusionModel {
        &self.model
    }

    /// The model, to train or sample in normalised units.
    pub fn model_mut(&mut self) -> &mut DiffusionModel {
        &mut self.model
    }

    /// Entries of an encoded row.
    pub fn dim(&self) -> usize {
        self.layout.dim()
    }

    /// Encodes and normalises `t` (with the public statistics): training rows.
    pub fn encode(&self, t: &Transitions) -> Result<Vec<f32>> {
        let mut rows = self.layout.encode(t)?;
        self.normalizer.normalize(&mut rows);
        Ok(rows)
    }

    /// Normalised encoded rows of public data.
    pub fn encode_public(&self, public: &PublicRows) -> Result<Vec<f32>> {
        if public.dim() != self.dim() {
            return Err(NnError::Invalid("public rows do not fit the layout".into()));
        }
        let mut rows = public.values().to_vec();
        self.normalizer.normalize(&mut rows);
        Ok(rows)
    }

    /// `n` synthetic transitions from the EMA weights: sampled, unnormalised, decoded.
    pub fn sample(&mut self, n: usize) -> Result<Transitions> {
        self.sample_snapped(n, None)
    }

    /// [`Self::sample`] with the entries of `support` snapped to their public values before
    /// decoding ([`PublicSupport::snap`]).
    pub fn sample_snapped(
        &mut self,
        n: usize,
        support: Option<&PublicSupport>,
    ) -> Result<Transitions> {
        let mut rows = self.model.sample_normalized(n, Weights::Ema)?;
        self.normalizer.unnormalize(&mut rows);
        if let Some(s) = support {
            s.snap(&mut rows);
        }
        self.layout.decode(&rows)
    }

    /// Safetensors bytes: the online weights under SynthER's state-dict names (`net.proj.weight`,
    /// ..., PyTorch shapes), the EMA weights under `ema.net.*`, the Fourier frequencies
    /// (`net.time_mlp.0.weights`), and [`SYNTH_META_KEY`] = JSON of the layout, normaliser,
    /// configuration and EMA call count. The optimiser's moments and the random stream are not
    /// saved: a loaded synthesizer starts a fresh AdamW (as a new training phase does).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let spec = self.model.denoiser().spec();
        let shapes = spec.param_shapes();
        let mut tensors = Vec::with_capacity(2 * shapes.len() + 1);
        for (prefix, flat) in [
            ("net.", self.model.online_flat()?),
            ("ema.net.", self.model.ema_flat()?),
        ] {
            let mut at = 0;
            for p in &shapes {
                tensors.push(tensor_io::Tensor::f32(
                    format!("{prefix}{}", p.name),
                    p.shape.clone(),
                    &flat[at..at + p.numel()],
                ));
                at += p.numel();
            }
        }
        let freqs = self.model.denoiser().freqs()?;
        tensors.push(tensor_io::Tensor::f32(
            FREQS_NAME,
            vec![freqs.len()],
            &freqs,
        ));
        let meta = SavedMeta {
            layout: self.layout,
            normalizer: self.normalizer.clone(),
            config: *self.model.config(),
            ema_calls: self.model.ema.calls(),
        };
        let json = serde_json::to_string(&meta)
            .map_err(|e| NnError::Invalid(format!("synthesizer metadata: {e}")))?;
        tensor_io::serialize(&tensors, SYNTH_META_KEY, json)
    }

    /// Reads [`Self::to_bytes`]' output (every tensor's dtype and shape checked against the
    /// stored configuration); the random stream is seeded with `seed`.
    pub fn from_bytes(bytes: &[u8], seed: u64, device: &Device) -> Result<Self> {
        let json = tensor_io::metadata_entry(bytes, SYNTH_META_KEY)?
            .ok_or_else(|| NnError::Invalid(format!("no {SYNTH_META_KEY} metadata")))?;
        let meta: SavedMeta = serde_json::from_str(&json)
            .map_err(|e| NnError::Invalid(format!("synthesizer metadata: {e}")))?;
        meta.layout.check()?;
        meta.normalizer.check()?;
        if meta.normalizer.dim() != meta.layout.dim() {
            return Err(NnError::Invalid(
                "synthesizer file: the normaliser does not fit the layout".into(),
            ));
        }
        let spec = DenoiserSpec {
            data_dim: meta.layout.dim(),
            config: meta.config.denoiser,
        };
        spec.check()?;
        let st = tensor_io::parse(bytes)?;
        let mut flats = Vec::with_capacity(2);
        for prefix in ["net.", "ema.net."] {
            let mut flat = Vec::with_capacity(spec.num_params());
            for p in spec.param_shapes() {
                flat.extend(tensor_io::read_f32(
                    &st,
                    &format!("{prefix}{}", p.name),
                    &p.shape,
                )?);
            }
            flats.push(flat);
        }
        let freqs = tensor_io::read_f32(&st, FREQS_NAME, &[spec.config.fourier_dim / 2])?;
        let model = DiffusionModel::from_parts(
            spec.data_dim,
            meta.config,
            &flats[0],
            Some((&flats[1], meta.ema_calls)),
            &freqs,
            seed,
            device,
        )?;
        Ok(TransitionSynthesizer {
            layout: meta.layout,
            normalizer: meta.normalizer,
            model,
        })
    }
}

/// Metadata key of a saved [`TransitionSynthesizer`].
pub const SYNTH_META_KEY: &str = "fedrl.privorl_synthesizer";
/// Name of the Fourier frequencies in a saved synthesizer (SynthER's buffer name).
const FREQS_NAME: &str = "net.time_mlp.0.weights";

#[derive(Serialize, Deserialize)]
struct SavedMeta {
    layout: TransitionLayout,
    normalizer: Normalizer,
    config: SynthesizerConfig,
    ema_calls: u64,
}
