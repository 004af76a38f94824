//! Curiosity-driven pre-training (seed 003, sections V-A/B, appendices C and F-B): random
//! network distillation (RND, Burda et al. 2019) scores how novel the synthesizer's own samples
//! are, and the most novel replace a share `r` (the curiosity rate) of each training batch.
//!
//! **RND.** A frozen, randomly initialised target `f` and a trained predictor `g`; a sample's
//! curiosity score is `mean_j (g(x)_j - f(x)_j)^2` over the 32 outputs (Eq. 4; output width 32,
//! appendix F-B). Sizes and initialisation from the authors' `synther/diffusion/rnd.py`: target
//! `d -> 128 -> 64 -> 32` (ReLU) with weights `N(0, 0.1^2)` and zero biases (lines 7-24),
//! predictor `d -> 64 -> 32` with PyTorch's default initialisation (lines 30-41), Adam at
//! `3e-4` (line 50). Samples are scored in normalised units (the space the denoiser works in).
//!
//! **Schedule** (the authors' `Trainer.train`, `synther/diffusion/elucidated_diffusion.py:525-608`
//! in PrivORL): once per epoch the current (online, not EMA) model generates a pool of 1,000
//! samples (line 542) and RND scores them (lines 543-547). The paper (section V-B) replaces the
//! top `r B` of `B` fresh synthetic samples into each batch of `B`; generating `B` samples with
//! 255 network calls for every step would multiply the cost of training by hundreds, so, like the
//! code, fedrl generates the pool once per epoch (`refresh_every_epochs`) and, for each batch,
//! takes `B` random candidates from the pool and puts the `floor(r B)` highest-scored of them in
//! place of `floor(r B)` of the batch's (randomly ordered) rows. (The code instead keeps the
//! top 30% of the pool and *appends* 16 random ones to each batch of 128, lines 548-559; fedrl
//! follows the paper's replacement.) The predictor learns the pool after scoring it, one Adam
//! step per sample: what the code's scoring loop does (`rnd.py:52-58` steps the optimiser on
//! every call, called per sample at lines 544-546), after rather than interleaved with the
//! scoring; its extra full-pool step every second epoch (lines 596-599) is left out.
//!
//! Curiosity is for pre-training on **public** data only: the replaced rows and the RND state
//! never see sensitive data (the paper, Table V, found it hurts during DP fine-tuning).

use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Normal};
use serde::{Deserialize, Serialize};

use super::normalize::PublicRows;
use super::synth::{TransitionSynthesizer, Weights};
use crate::{NnError, Result};

/// Curiosity settings (defaults: the paper's and the authors' code's).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CuriosityConfig {
    /// Off: plain pre-training (the paper's NonCurPrivORL ablation).
    pub enabled: bool,
    /// Share `r` of each batch replaced by novel samples (0.3: section IX, appendix F-B).
    pub rate: f64,
    /// Samples generated per refresh (1,000: `elucidated_diffusion.py:542`).
    pub pool_size: usize,
    /// Regenerate and rescore the pool every this many epochs (1: every epoch, line 541-542).
    pub refresh_every_epochs: usize,
    /// RND output width (32: appendix F-B, `rnd.py:16`).
    pub out_dim: usize,
    /// Predictor Adam learning rate (`rnd.py:50`).
    pub rnd_lr: f64,
    /// Rows per predictor step when it learns a pool (1: the code's per-sample steps).
    pub rnd_batch: usize,
}

impl Default for CuriosityConfig {
    fn default() -> Self {
        CuriosityConfig {
            enabled: true,
            rate: 0.3,
            pool_size: 1000,
            refresh_every_epochs: 1,
            out_dim: 32,
            rnd_lr: 3e-4,
            rnd_batch: 1,
        }
    }
}

impl CuriosityConfig {
    pub fn check(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.rate)
            || self.pool_size == 0
            || self.refresh_every_epochs == 0
            || self.out_dim == 0
            || !(self.rnd_lr.is_finite() && self.rnd_lr > 0.0)
            || self.rnd_batch == 0
        {
            return Err(NnError::Invalid(format!(
                "curiosity settings out of range: {self:?}"
            )));
        }
        Ok(())
    }
}

/// Rows of a batch of `batch_rows` that curiosity replaces: `floor(rate * batch_rows)` (the
/// code's `int(n * rate)`), with a 1e-9 allowance so that e.g. `0.29 * 100` gives 29.
pub fn novel_count(batch_rows: usize, rate: f64) -> usize {
    ((rate * batch_rows as f64 + 1e-9).floor() as usize).min(batch_rows)
}

/// Replaces the last `floor(rate * B)` rows of `batch` (`B` rows of `dim`, row-major; rows are
/// in random order, so these are random rows) with the highest-`scores` rows of `candidates`
/// (rows of `dim`, one score each), most novel first; ties go to the earlier candidate. At most
/// as many rows as there are candidates are replaced. Returns the number replaced.
pub fn replace_with_most_novel(
    batch: &mut [f32],
    dim: usize,
    candidates: &[f32],
    scores: &[f32],
    rate: f64,
) -> Result<usize> {
    if dim == 0
        || !batch.len().is_multiple_of(dim)
        || candidates.len() != scores.len() * dim
        || !(0.0..=1.0).contains(&rate)
    {
        return Err(NnError::Invalid(
            "curiosity: batch, candidates and scores do not fit together (or rate outside [0, 1])"
                .into(),
        ));
    }
    let b = batch.len() / dim;
    let k = novel_count(b, rate).min(scores.len());
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // Highest score first; NaN scores last; stable, so ties keep candidate order.
    order.sort_by(|&i, &j| {
        let (a, c) = (scores[i], scores[j]);
        c.partial_cmp(&a)
            .unwrap_or_else(|| a.is_nan().cmp(&c.is_nan()))
    });
    for (slot, &c) in order[..k].iter().enumerate() {
        let row = b - k + slot;
        batch[row * dim..(row + 1) * dim].copy_from_slice(&candidates[c * dim..(c + 1) * dim]);
    }
    Ok(k)
}

/// One linear layer, weights `[in, out]`.
struct Lin {
    w: Tensor,
    b: Tensor,
}

impl Lin {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(&self.w)?.broadcast_add(&self.b)
    }
}

/// Random network distillation: a frozen target and a trained predictor.
pub struct Rnd {
    target: Vec<Lin>,
    predictor: Vec<Lin>,
    opt: AdamW,
    batch: usize,
    device: Device,
    dim: usize,
}

fn mlp(x: &Tensor, layers: &[Lin]) -> candle_core::Result<Tensor> {
    let mut h = x.clone();
    for (i, l) in layers.iter().enumerate() {
        h = l.forward(&h)?;
        if i + 1 < layers.len() {
            h = h.relu()?;
        }
    }
    Ok(h)
}

impl Rnd {
    /// RND over rows of `dim`, seeded.
    pub fn new(dim: usize, cfg: &CuriosityConfig, seed: u64, device: &Device) -> Result<Self> {
        cfg.check()?;
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let normal = Normal::new(0.0f32, 0.1).map_err(|e| NnError::Invalid(e.to_string()))?;
        let mut target = Vec::new();
        for (i, o) in [(dim, 128), (128, 64), (64, cfg.out_dim)] {
            let w: Vec<f32> = (0..i * o).map(|_| normal.sample(&mut rng)).collect();
            target.push(Lin {
                w: Tensor::from_vec(w, (i, o), device)?,
                b: Tensor::zeros(o, candle_core::DType::F32, device)?,
            });
        }
        let mut predictor = Vec::new();
        let mut vars = Vec::new();
        for (i, o) in [(dim, 64), (64, cfg.out_dim)] {
            let k = 1.0 / (i as f32).sqrt();
            let w: Vec<f32> = (0..i * o).map(|_| rng.random_range(-k..k)).collect();
            let b: Vec<f32> = (0..o).map(|_| rng.random_range(-k..k)).collect();
            let wv = Var::from_tensor(&Tensor::from_vec(w, (i, o), device)?)?;
            let bv = Var::from_tensor(&Tensor::from_vec(b, o, device)?)?;
            predictor.push(Lin {
                w: wv.as_tensor().clone(),
                b: bv.as_tensor().clone(),
            });
            vars.push(wv);
            vars.push(bv);
        }
        let opt = AdamW::new(
            vars,
            ParamsAdamW {
                lr: cfg.rnd_lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        )?;
        Ok(Rnd {
            target,
            predictor,
            opt,
            batch: cfg.rnd_batch,
            device: device.clone(),
            dim,
        })
    }

    fn errors(&self, rows: &[f32]) -> Result<Tensor> {
        if rows.is_empty() || !rows.len().is_multiple_of(self.dim) {
            return Err(NnError::Invalid(format!(
                "RND: {} values are not rows of {}",
                rows.len(),
                self.dim
            )));
        }
        let x = Tensor::from_slice(rows, (rows.len() / self.dim, self.dim), &self.device)?;
        let t = mlp(&x, &self.target)?;
        let p = mlp(&x, &self.predictor)?;
        Ok((p - t)?.sqr()?.mean(1)?)
    }

    /// Curiosity score of every row (rows of the RND's `dim`): the predictor's mean squared
    /// error against the target.
    pub fn score(&self, rows: &[f32]) -> Result<Vec<f32>> {
        Ok(self.errors(rows)?.detach().to_vec1()?)
    }

    /// One pass of Adam steps over `rows` in order, `rnd_batch` rows per step. Returns the mean
    /// loss before each step.
    pub fn learn(&mut self, rows: &[f32]) -> Result<f32> {
        let mut total = 0.0f64;
        let mut steps = 0usize;
        for chunk in rows.chunks(self.batch * self.dim) {
            let loss = self.errors(chunk)?.mean_all()?;
            total += f64::from(loss.to_scalar::<f32>()?);
            steps += 1;
            let grads = loss.backward()?;
            self.opt.step(&grads)?;
        }
        Ok((total / steps.max(1) as f64) as f32)
    }
}

/// Pre-training settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PretrainConfig {
    /// Passes over the public data (10: section IX-A, `Trainer.train_epochs`).
    pub epochs: usize,
    pub curiosity: CuriosityConfig,
}

impl Default for PretrainConfig {
    fn default() -> Self {
        PretrainConfig {
            epochs: 10,
            curiosity: CuriosityConfig::default(),
        }
    }
}

/// What one pre-training epoch did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochReport {
    /// 0-based.
    pub epoch: usize,
    /// Optimiser steps in this epoch.
    pub steps: usize,
    /// Mean training loss over the epoch's batches.
    pub mean_loss: f64,
    /// Rows replaced by novel synthetic samples in this epoch.
    pub novel_rows: usize,
    /// Mean and largest curiosity score of the pool scored this epoch (`None` when none was).
    pub pool_mean_score: Option<f64>,
    pub pool_max_score: Option<f64>,
    /// Wall-clock seconds (sampling the pool included).
    pub seconds: f64,
}

/// Pre-trains `synth` on public rows for `cfg.epochs` epochs (shuffled batches of the
/// synthesizer's `batch_size`, the last one possibly smaller), with curiosity when enabled.
/// `on_epoch` sees each epoch's report as it ends (progress).
pub fn pretrain(
    synth: &mut TransitionSynthesizer,
    public: &PublicRows,
    cfg: &PretrainConfig,
    seed: u64,
    on_epoch: &mut dyn FnMut(&EpochReport),
) -> Result<Vec<EpochReport>> {
    let d = synth.dim();
    let rows = synth.encode_public(public)?;
    let n = rows.len() / d;
    let bsz = synth.model().config().train.batch_size;
    let cur = cfg.curiosity;
    let mut rnd = if cur.enabled {
        cur.check()?;
        Some(Rnd::new(d, &cur, seed, synth.model().denoiser().device())?)
    } else {
        None
    };
    let mut pool: Vec<f32> = Vec::new();
    let mut scores: Vec<f32> = Vec::new();
    let mut reports = Vec::with_capacity(cfg.epochs);
    let mut order: Vec<usize> = (0..n).collect();
    for epoch in 0..cfg.epochs {
        let start = Instant::now();
        let (mut pool_mean, mut pool_max) = (None, None);
        if let Some(rnd) = rnd.as_mut()
            && epoch % cur.refresh_every_epochs == 0
        {
            pool = synth
                .model_mut()
                .sample_normalized(cur.pool_size, Weights::Online)?;
            scores = rnd.score(&pool)?;
            rnd.learn(&pool)?;
            let m = scores.iter().map(|&s| f64::from(s)).sum::<f64>() / scores.len() as f64;
            pool_mean = Some(m);
            pool_max = scores.iter().map(|&s| f64::from(s)).reduce(f64::max);
        }
        order.shuffle(synth.model_mut().rng_mut());
        let (mut loss_sum, mut steps, mut novel) = (0.0f64, 0usize, 0usize);
        let mut batch = Vec::with_capacity(bsz * d);
        let mut cand_rows = Vec::new();
        let mut cand_scores = Vec::new();
        for chunk in order.chunks(bsz) {
            batch.clear();
            for &i in chunk {
                batch.extend_from_slice(&rows[i * d..(i + 1) * d]);
            }
            if rnd.is_some() && !scores.is_empty() {
                let m = chunk.len().min(scores.len());
                let picks = rand::seq::index::sample(synth.model_mut().rng_mut(), scores.len(), m);
                cand_rows.clear();
                cand_scores.clear();
                for c in picks.iter() {
                    cand_rows.extend_from_slice(&pool[c * d..(c + 1) * d]);
                    cand_scores.push(scores[c]);
                }
                novel +=
                    replace_with_most_novel(&mut batch, d, &cand_rows, &cand_scores, cur.rate)?;
            }
            loss_sum += f64::from(synth.model_mut().train_step(&batch)?);
            steps += 1;
        }
        let report = EpochReport {
            epoch,
            steps,
            mean_loss: loss_sum / steps.max(1) as f64,
            novel_rows: novel,
            pool_mean_score: pool_mean,
            pool_max_score: pool_max,
            seconds: start.elapsed().as_secs_f64(),
        };
        on_epoch(&report);
        reports.push(report);
    }
    Ok(reports)
}
