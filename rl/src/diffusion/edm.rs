//! EDM (Karras et al. 2022, "Elucidating the design space of diffusion-based generative models")
//! as SynthER runs it (`synther/diffusion/elucidated_diffusion.py`, lucidrains' port): the
//! preconditioning of Table 1, the log-normal training noise and loss weight, and the stochastic
//! Heun sampler (Algorithm 2) with the rho-schedule of Eq. 5.
//!
//! With `s = sigma` and `sd = sigma_data` (constants: [`EdmConfig`]):
//!
//! ```text
//! c_skip = sd^2 / (s^2 + sd^2)      c_out = s sd / sqrt(s^2 + sd^2)
//! c_in   = 1 / sqrt(s^2 + sd^2)     c_noise = ln(s) / 4
//! D(x, s) = c_skip x + c_out F(c_in x, c_noise)                          (denoised estimate)
//! training: ln s ~ N(P_mean, P_std^2), n ~ N(0, I),
//!   loss_i = (s^2 + sd^2) / (s sd)^2 * mean_j (D(x_i + s n_i, s)_j - x_ij)^2,  loss = mean_i
//! ```
//!
//! (SynthER `elucidated_diffusion.py:96-106` for the `c`s, `:240` `loss_weight`, `:243`
//! `noise_distribution`, `:246-263` `forward`: the squared error is averaged over the entries of
//! a row, weighted, then averaged over rows.)
//!
//! Sampling (`:145-193`): `sigma_i = (smax^(1/rho) + i/(N-1) (smin^(1/rho) - smax^(1/rho)))^rho`
//! for `i < N`, then 0; `gamma_i = min(S_churn / N, sqrt(2) - 1)` where `S_tmin <= sigma_i <=
//! S_tmax`, else 0; `x ~ sigma_0 N(0, I)`; per step: `s_hat = sigma (1 + gamma)`, `x_hat = x +
//! sqrt(s_hat^2 - sigma^2) S_noise eps`, Euler step with `d = (x_hat - D(x_hat, s_hat)) / s_hat`,
//! and Heun's correction unless the next sigma is 0. The noise `eps` is drawn at every step (also
//! where `gamma = 0`), as SynthER does.
//!
//! All of this runs on normalised data; the callers normalise and unnormalise.

use candle_core::{Device, Tensor};
use rand::Rng;
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

use super::denoiser::Denoiser;
use crate::{NnError, Result};

/// EDM's constants. Defaults: SynthER's, which PrivORL uses (gin lines 25-30
/// and `ElucidatedDiffusion.__init__` defaults, `elucidated_diffusion.py:58-68`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EdmConfig {
    /// Standard deviation of the (normalised) data.
    pub sigma_data: f64,
    /// Mean of ln sigma during training.
    pub p_mean: f64,
    /// Standard deviation of ln sigma during training.
    pub p_std: f64,
    /// Smallest sampling noise level.
    pub sigma_min: f64,
    /// Largest sampling noise level (the initial noise's standard deviation).
    pub sigma_max: f64,
    /// Curvature of the sampling schedule.
    pub rho: f64,
    /// Heun steps `N` (128: appendix F-A, gin line 25).
    pub sample_steps: usize,
    /// Stochasticity `S_churn` (gin line 27: 80).
    pub s_churn: f64,
    /// Churn applies where `s_tmin <= sigma <= s_tmax` (gin lines 28-29: 0.05, 50).
    pub s_tmin: f64,
    pub s_tmax: f64,
    /// Scale of the churn noise (gin line 30: 1.003).
    pub s_noise: f64,
    /// Clamp the denoised estimates and the final samples to `[-c, c]` (normalised units), as
    /// SynthER's `clamp=True` does with `c = 1` (`elucidated_diffusion.py:125-126, 191-192`);
    /// `None` (the default) as SynthER's generator for the standard normaliser
    /// (`train_diffuser.py:29-30`).
    pub clamp: Option<f64>,
}

impl Default for EdmConfig {
    fn default() -> Self {
        EdmConfig {
            sigma_data: 1.0,
            p_mean: -1.2,
            p_std: 1.2,
            sigma_min: 0.002,
            sigma_max: 80.0,
            rho: 7.0,
            sample_steps: 128,
            s_churn: 80.0,
            s_tmin: 0.05,
            s_tmax: 50.0,
            s_noise: 1.003,
            clamp: None,
        }
    }
}

/// The four preconditioning coefficients at one noise level.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Precond {
    pub c_skip: f64,
    pub c_out: f64,
    pub c_in: f64,
    pub c_noise: f64,
}

impl EdmConfig {
    /// Checks the constants are usable.
    pub fn check(&self) -> Result<()> {
        let pos = [
            self.sigma_data,
            self.p_std,
            self.sigma_min,
            self.sigma_max,
            self.rho,
            self.s_noise,
        ];
        if pos.iter().any(|v| !(v.is_finite() && *v > 0.0))
            || !self.p_mean.is_finite()
            || self.sigma_min >= self.sigma_max
            || self.sample_steps < 2
            || !(self.s_churn.is_finite() && self.s_churn >= 0.0)
            || self.clamp.is_some_and(|c| !(c.is_finite() && c > 0.0))
        {
            return Err(NnError::Invalid(format!(
                "EDM constants out of range: {self:?}"
            )));
        }
        Ok(())
    }

    /// Table 1's coefficients at `sigma > 0` (`c_noise` uses `ln max(sigma, 1e-20)`, as
    /// SynthER's `log` helper).
    pub fn precond(&self, sigma: f64) -> Precond {
        let sd2 = self.sigma_data * self.sigma_data;
        let r = (sigma * sigma + sd2).sqrt();
        Precond {
            c_skip: sd2 / (sigma * sigma + sd2),
            c_out: sigma * self.sigma_data / r,
            c_in: 1.0 / r,
            c_noise: sigma.max(1e-20).ln() * 0.25,
        }
    }

    /// The training loss weight `(sigma^2 + sd^2) / (sigma sd)^2`.
    pub fn loss_weight(&self, sigma: f64) -> f64 {
        let sd2 = self.sigma_data * self.sigma_data;
        (sigma * sigma + sd2) / (sigma * sigma * sd2)
    }

    /// Draws a training noise level, `exp(P_mean + P_std z)`.
    pub fn draw_sigma<R: Rng + ?Sized>(&self, rng: &mut R) -> f64 {
        let z: f64 = StandardNormal.sample(rng);
        (self.p_mean + self.p_std * z).exp()
    }

    /// The sampling noise levels `sigma_0 > ... > sigma_{N-1}`, then 0 (`N + 1` values).
    pub fn schedule(&self) -> Vec<f64> {
        let n = self.sample_steps;
        let inv = 1.0 / self.rho;
        let (a, b) = (self.sigma_max.powf(inv), self.sigma_min.powf(inv));
        let mut s: Vec<f64> = (0..n)
            .map(|i| (a + i as f64 / (n - 1) as f64 * (b - a)).powf(self.rho))
            .collect();
        s.push(0.0);
        s
    }

    /// The churn `gamma` at noise level `sigma`.
    pub fn gamma(&self, sigma: f64) -> f64 {
        if sigma >= self.s_tmin && sigma <= self.s_tmax {
            (self.s_churn / self.sample_steps as f64).min(std::f64::consts::SQRT_2 - 1.0)
        } else {
            0.0
        }
    }
}

/// A network `F(x, t)` that EDM's preconditioning, loss and sampler drive: rows of
/// [`EdmNet::data_dim`] normalised values and their `c_noise` levels in, rows of the same width
/// out. The unconditional [`Denoiser`] is one; a conditional network bound to its condition rows
/// (`diffusion::trajectory::Conditioned`) is another.
pub trait EdmNet {
    /// Values per row.
    fn data_dim(&self) -> usize;
    /// Where the network's tensors live.
    fn device(&self) -> &Device;
    /// `F(x, t)` for `x` `[B, data_dim]` and `t` `[B]`.
    fn forward(&self, params: &[Tensor], x: &Tensor, t: &Tensor) -> Result<Tensor>;
}

impl EdmNet for Denoiser {
    fn data_dim(&self) -> usize {
        self.spec().data_dim
    }

    fn device(&self) -> &Device {
        Denoiser::device(self)
    }

    fn forward(&self, params: &[Tensor], x: &Tensor, t: &Tensor) -> Result<Tensor> {
        Denoiser::forward(self, params, x, t)
    }
}

/// `[n, 1]` column of `values` as f32 on `device`.
fn column(values: impl Iterator<Item = f64>, device: &Device) -> Result<Tensor> {
    let v: Vec<f32> = values.map(|x| x as f32).collect();
    let n = v.len();
    Ok(Tensor::from_vec(v, (n, 1), device)?)
}

/// `n` standard normal values as an `[rows, cols]` tensor.
pub fn normal_tensor<R: Rng + ?Sized>(
    rows: usize,
    cols: usize,
    rng: &mut R,
    device: &Device,
) -> Result<Tensor> {
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| StandardNormal.sample(rng))
        .collect();
    Ok(Tensor::from_vec(v, (rows, cols), device)?)
}

/// The denoised estimate `D(x, sigma_i)` of every row `i` of `x` (`[B, d]`, normalised).
pub fn denoise<N: EdmNet + ?Sized>(
    cfg: &EdmConfig,
    net: &N,
    params: &[Tensor],
    x: &Tensor,
    sigmas: &[f64],
) -> Result<Tensor> {
    let dev = net.device();
    let pc: Vec<Precond> = sigmas.iter().map(|&s| cfg.precond(s)).collect();
    let c_in = column(pc.iter().map(|p| p.c_in), dev)?;
    let c_skip = column(pc.iter().map(|p| p.c_skip), dev)?;
    let c_out = column(pc.iter().map(|p| p.c_out), dev)?;
    let t = column(pc.iter().map(|p| p.c_noise), dev)?.flatten_all()?;
    let f = net.forward(params, &x.broadcast_mul(&c_in)?, &t)?;
    Ok((x.broadcast_mul(&c_skip)? + f.broadcast_mul(&c_out)?)?)
}

/// Per-row weighted denoising losses `[B]` of clean rows `x0` (`[B, d]`, normalised) at noise
/// levels `sigmas` with standard normal `noise` (`[B, d]`): the terms whose mean is the EDM
/// training loss. Fixed `sigmas` and `noise` make it deterministic (per-example gradients and
/// the membership attack reuse it).
pub fn per_example_loss<N: EdmNet + ?Sized>(
    cfg: &EdmConfig,
    net: &N,
    params: &[Tensor],
    x0: &Tensor,
    sigmas: &[f64],
    noise: &Tensor,
) -> Result<Tensor> {
    let dev = net.device();
    let (b, _) = x0.dims2()?;
    if sigmas.len() != b || noise.dims() != x0.dims() {
        return Err(NnError::Invalid(format!(
            "EDM loss: {} sigmas and noise {:?} for a batch {:?}",
            sigmas.len(),
            noise.dims(),
            x0.dims()
        )));
    }
    let s = column(sigmas.iter().copied(), dev)?;
    let noisy = (x0 + noise.broadcast_mul(&s)?)?;
    let d = denoise(cfg, net, params, &noisy, sigmas)?;
    let w = column(sigmas.iter().map(|&s| cfg.loss_weight(s)), dev)?.flatten_all()?;
    Ok(((d - x0)?.sqr()?.mean(1)? * w)?)
}

/// Draws `n` normalised samples (`[n, d]`) with the stochastic Heun sampler.
pub fn heun_sample<N: EdmNet + ?Sized, R: Rng + ?Sized>(
    cfg: &EdmConfig,
    net: &N,
    params: &[Tensor],
    n: usize,
    rng: &mut R,
) -> Result<Tensor> {
    cfg.check()?;
    let d = net.data_dim();
    let dev = net.device();
    let sigmas = cfg.schedule();
    let clamp = |x: Tensor| -> Result<Tensor> {
        match cfg.clamp {
            Some(c) => Ok(x.clamp(-c, c)?),
            None => Ok(x),
        }
    };
    let slope = |x: &Tensor, s: f64| -> Result<Tensor> {
        let den = clamp(denoise(cfg, net, params, x, &vec![s; n])?)?;
        Ok(((x - den)? / s)?)
    };
    let mut x = (normal_tensor(n, d, rng, dev)? * sigmas[0])?;
    for w in sigmas.windows(2) {
        let (sigma, next) = (w[0], w[1]);
        let gamma = cfg.gamma(sigma);
        let eps = (normal_tensor(n, d, rng, dev)? * cfg.s_noise)?;
        let s_hat = sigma + gamma * sigma;
        let x_hat = (&x + (eps * (s_hat * s_hat - sigma * sigma).sqrt())?)?;
        let d_hat = slope(&x_hat, s_hat)?;
        let mut x_next = (&x_hat + (&d_hat * (next - s_hat))?)?;
        if next != 0.0 {
            let d_next = slope(&x_next, next)?;
            x_next = (&x_hat + ((d_hat + d_next)? * (0.5 * (next - s_hat)))?)?;
        }
        x = x_next;
    }
    clamp(x)
}
