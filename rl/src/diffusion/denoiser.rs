//! The residual-MLP denoiser network `F(x, t)` of SynthER (`synther/diffusion/denoiser_network.py`),
//! which PrivORL-n uses unchanged (seed 003, appendix F-A):
//!
//! ```text
//! e(t)  = [t, sin(2 pi t w), cos(2 pi t w)]              random Fourier features, w ~ N(0, 1)
//!                                                        fixed (fourier_dim / 2 of them)
//! h0    = proj(x) + L2(silu(L1(e(t))))                   proj: data_dim -> dim_t
//! h     = in(h0);  h <- h + lin_l(relu(h)), l = 1..L     in: dim_t -> width
//! F     = out(relu(h))                                   out: width -> data_dim
//! ```
//!
//! No layer norm (`ResidualMLPDenoiser.layer_norm = False`, gin line 22).
//! Every linear layer sees exactly one input row per example, which is what the per-example
//! gradient norms of DP fine-tuning need (`|g_i|^2 = sum_layers |d_i|^2 (|a_i|^2 + 1)`).
//!
//! Parameters travel as one flat `Vec<f32>`: the tensors of [`DenoiserSpec::param_shapes`] in
//! order, each in PyTorch's row-major layout (`weight` is `[out, in]`) under PyTorch's names
//! (`proj.weight`, `time_mlp.1.weight`, ...). Inside, weights are kept as `[in, out]` so the
//! forward pass needs no transpose. The Fourier frequencies are a fixed buffer, not a parameter
//! (`random_fourier_features = True` makes them `requires_grad = False`), seeded with the
//! initial weights.

use candle_core::{DType, Device, Tensor};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

use crate::{NnError, Result};

/// Sizes of the denoiser (defaults: fedrl's CPU size; the paper's is width 1024, 6 blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DenoiserConfig {
    /// Width of the residual blocks.
    pub width: usize,
    /// Number of residual blocks `L`.
    pub blocks: usize,
    /// Width of the input projection and time embedding (`dim_t`, gin line 15: 128).
    pub dim_t: usize,
    /// Random Fourier features (`learned_sinusoidal_dim`, gin line 20: 16; even).
    pub fourier_dim: usize,
}

impl Default for DenoiserConfig {
    fn default() -> Self {
        DenoiserConfig {
            width: 256,
            blocks: 4,
            dim_t: 128,
            fourier_dim: 16,
        }
    }
}

/// A denoiser's configuration for data of `data_dim` entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenoiserSpec {
    pub data_dim: usize,
    pub config: DenoiserConfig,
}

/// One parameter tensor: its PyTorch name and shape (`[out, in]` for a weight).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamShape {
    pub name: String,
    pub shape: Vec<usize>,
}

impl ParamShape {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

impl DenoiserSpec {
    /// Checks the sizes are usable.
    pub fn check(&self) -> Result<()> {
        let c = &self.config;
        if self.data_dim == 0
            || c.width == 0
            || c.dim_t == 0
            || c.fourier_dim == 0
            || !c.fourier_dim.is_multiple_of(2)
        {
            return Err(NnError::Invalid(format!(
                "denoiser: data_dim {}, width {}, dim_t {} must be positive and fourier_dim {} \
                 positive and even",
                self.data_dim, c.width, c.dim_t, c.fourier_dim
            )));
        }
        Ok(())
    }

    /// `(in, out)` of every linear layer, in parameter order.
    pub fn linears(&self) -> Vec<(usize, usize)> {
        let c = &self.config;
        let mut l = vec![
            (self.data_dim, c.dim_t),
            (c.fourier_dim + 1, c.dim_t),
            (c.dim_t, c.dim_t),
            (c.dim_t, c.width),
        ];
        l.extend(std::iter::repeat_n((c.width, c.width), c.blocks));
        l.push((c.width, self.data_dim));
        l
    }

    /// Names and PyTorch shapes of the trainable tensors, in the flat order (a weight, then its
    /// bias, per linear layer).
    pub fn param_shapes(&self) -> Vec<ParamShape> {
        let mut names = vec![
            "proj".to_string(),
            "time_mlp.1".into(),
            "time_mlp.3".into(),
            "residual_mlp.network.0".into(),
        ];
        for b in 0..self.config.blocks {
            names.push(format!("residual_mlp.network.{}.linear", b + 1));
        }
        names.push("residual_mlp.final_linear".into());
        let mut out = Vec::new();
        for (name, (i, o)) in names.into_iter().zip(self.linears()) {
            out.push(ParamShape {
                name: format!("{name}.weight"),
                shape: vec![o, i],
            });
            out.push(ParamShape {
                name: format!("{name}.bias"),
                shape: vec![o],
            });
        }
        out
    }

    /// Total number of trainable values.
    pub fn num_params(&self) -> usize {
        self.param_shapes().iter().map(ParamShape::numel).sum()
    }

    /// Seeded initial values: the flat parameters (PyTorch's `nn.Linear` default, `U(-k, k)`
    /// with `k = 1/sqrt(in)` for weights and biases) and the Fourier frequencies (`N(0, 1)`).
    pub fn init(&self, seed: u64) -> Result<(Vec<f32>, Vec<f32>)> {
        self.check()?;
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut flat = Vec::with_capacity(self.num_params());
        for (i, o) in self.linears() {
            let k = 1.0 / (i as f32).sqrt();
            for _ in 0..(i * o + o) {
                flat.push(rng.random_range(-k..k));
            }
        }
        let freqs = (0..self.config.fourier_dim / 2)
            .map(|_| StandardNormal.sample(&mut rng))
            .collect();
        Ok((flat, freqs))
    }
}

/// The denoiser's fixed parts (sizes, Fourier frequencies) on a device; the parameters are
/// passed to [`Denoiser::forward`] so that the online weights, their EMA and per-example probes
/// share one forward pass.
#[derive(Clone, Debug)]
pub struct Denoiser {
    spec: DenoiserSpec,
    /// `[1, fourier_dim / 2]`.
    freqs: Tensor,
    device: Device,
}

impl Denoiser {
    /// The fixed parts for `spec` with Fourier frequencies `freqs` (`fourier_dim / 2` values).
    pub fn new(spec: DenoiserSpec, freqs: &[f32], device: &Device) -> Result<Self> {
        spec.check()?;
        if freqs.len() != spec.config.fourier_dim / 2 || freqs.iter().any(|f| !f.is_finite()) {
            return Err(NnError::Invalid(format!(
                "denoiser: {} finite Fourier frequencies needed, got {}",
                spec.config.fourier_dim / 2,
                freqs.len()
            )));
        }
        Ok(Denoiser {
            spec,
            freqs: Tensor::from_vec(freqs.to_vec(), (1, freqs.len()), device)?,
            device: device.clone(),
        })
    }

    pub fn spec(&self) -> &DenoiserSpec {
        &self.spec
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The Fourier frequencies.
    pub fn freqs(&self) -> Result<Vec<f32>> {
        Ok(self.freqs.flatten_all()?.to_vec1()?)
    }

    /// Device tensors (weights `[in, out]`, biases `[out]`) from flat PyTorch-layout values.
    pub fn tensors_from_flat(&self, flat: &[f32]) -> Result<Vec<Tensor>> {
        let expected = self.spec.num_params();
        if flat.len() != expected {
            return Err(NnError::ParamLength {
                got: flat.len(),
                expected,
            });
        }
        let mut out = Vec::new();
        let mut at = 0;
        for (i, o) in self.spec.linears() {
            let w = Tensor::from_slice(&flat[at..at + i * o], (o, i), &self.device)?
                .t()?
                .contiguous()?;
            at += i * o;
            let b = Tensor::from_slice(&flat[at..at + o], o, &self.device)?;
            at += o;
            out.push(w);
            out.push(b);
        }
        Ok(out)
    }

    /// Flat PyTorch-layout values of device tensors in [`Self::tensors_from_flat`]'s layout.
    pub fn flat_from_tensors(&self, params: &[Tensor]) -> Result<Vec<f32>> {
        self.check_params(params)?;
        let mut flat = Vec::with_capacity(self.spec.num_params());
        for pair in params.chunks_exact(2) {
            flat.extend(pair[0].t()?.flatten_all()?.to_vec1::<f32>()?);
            flat.extend(pair[1].to_vec1::<f32>()?);
        }
        Ok(flat)
    }

    fn check_params(&self, params: &[Tensor]) -> Result<()> {
        let n = 2 * self.spec.linears().len();
        if params.len() != n {
            return Err(NnError::Invalid(format!(
                "denoiser: {} parameter tensors, expected {n}",
                params.len()
            )));
        }
        Ok(())
    }

    /// `F(x, t)` for `x` `[B, data_dim]` and noise levels `t` `[B]` (EDM's `c_noise(sigma)`).
    pub fn forward(&self, params: &[Tensor], x: &Tensor, t: &Tensor) -> Result<Tensor> {
        self.check_params(params)?;
        let lin = |h: &Tensor, l: usize| -> candle_core::Result<Tensor> {
            h.matmul(&params[2 * l])?.broadcast_add(&params[2 * l + 1])
        };
        let b = x.dim(0)?;
        let t = t.reshape((b, 1))?.to_dtype(DType::F32)?;
        let angles = (t.broadcast_mul(&self.freqs)? * (2.0 * std::f64::consts::PI))?;
        let emb = Tensor::cat(&[&t, &angles.sin()?, &angles.cos()?], 1)?;
        let temb = lin(&lin(&emb, 1)?.silu()?, 2)?;
        let mut h = lin(&(lin(x, 0)? + temb)?, 3)?;
        for l in 0..self.spec.config.blocks {
            h = (&h + lin(&h.relu()?, 4 + l)?)?;
        }
        Ok(lin(&h.relu()?, 4 + self.spec.config.blocks)?)
    }
}
