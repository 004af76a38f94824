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
//!
//! On the CPU the bias of every layer is added by [`add_bias`]: the same sums as candle's
//! `broadcast_add`, bit for bit, forward and backward, with the bias gradient (the column sums
//! of the incoming gradient) summed row after row instead of through candle's generic reduction
//! over the batch dimension, which spends a division per element (12% of a training step at
//! batch 256 in `perf`).

use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};
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

/// `x + b` for `x` `[B, n]` and a bias `b` `[n]`: candle's `x.broadcast_add(b)` with a faster
/// backward on the CPU (see the module doc); elsewhere `broadcast_add` itself.
pub fn add_bias(x: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let ok = x.device().is_cpu()
        && x.dtype() == DType::F32
        && b.dtype() == DType::F32
        && x.rank() == 2
        && b.dims() == [x.dim(1)?];
    if ok {
        // Contiguous operands (a no-op for the layers' outputs) for the op's flat loops.
        x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
    } else {
        x.broadcast_add(b)
    }
}

/// The custom op behind [`add_bias`] (f32, CPU).
struct BiasAdd;

/// Row-major f32 values of a contiguous CPU tensor's storage under `layout`.
fn f32_values<'a>(s: &'a CpuStorage, layout: &Layout) -> candle_core::Result<&'a [f32]> {
    let v = s.as_slice::<f32>()?;
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fedrl-bias-add: strided operand".into()))?;
    Ok(&v[a..b])
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "fedrl-bias-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_values(s1, l1)?;
        let b = f32_values(s2, l2)?;
        let n = b.len();
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks_exact(n.max(1)) {
            // The same f32 sum `x + b` as candle's broadcast add.
            out.extend(row.iter().zip(b.iter()).map(|(v, c)| v + c));
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = b.dim(0)?;
        let g = grad.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        // Column sums from 0, adding rows in order: candle's `sum_keepdim(0)` does the same
        // additions in the same order for every column, so the result is identical.
        let mut sum = vec![0f32; n];
        for row in g.chunks_exact(n.max(1)) {
            for (s, v) in sum.iter_mut().zip(row) {
                *s += v;
            }
        }
        Ok((
            Some(grad.clone()),
            Some(Tensor::from_vec(sum, n, b.device())?),
        ))
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
            add_bias(&h.matmul(&params[2 * l])?, &params[2 * l + 1])
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    /// `add_bias` is candle's `broadcast_add` bit for bit: the sums, and the gradients of both
    /// arguments through a nonlinear loss (with a strided input too).
    #[test]
    fn add_bias_matches_broadcast_add_bit_for_bit() {
        let dev = Device::Cpu;
        let (rows, n) = (37, 11);
        let xs: Vec<f32> = (0..rows * n)
            .map(|k| ((k as f32) * 0.731).sin() * 3.7)
            .collect();
        let bs: Vec<f32> = (0..n).map(|k| ((k as f32) * 1.37).cos() * 1e-3).collect();
        let x = Var::from_vec(xs, (rows, n), &dev).unwrap();
        let b = Var::from_vec(bs, n, &dev).unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        for transposed in [false, true] {
            let input = if transposed {
                // A strided view of the same shape.
                x.as_tensor().t().unwrap().t().unwrap()
            } else {
                x.as_tensor().clone()
            };
            let ours = add_bias(&input, b.as_tensor()).unwrap();
            let theirs = input.broadcast_add(b.as_tensor()).unwrap();
            assert_eq!(bits(&ours), bits(&theirs));
            let loss = |y: &Tensor| y.tanh().unwrap().sqr().unwrap().sum_all().unwrap();
            let g1 = loss(&ours).backward().unwrap();
            let g2 = loss(&theirs).backward().unwrap();
            for v in [&x, &b] {
                let a = g1.get(v.as_tensor()).unwrap();
                let c = g2.get(v.as_tensor()).unwrap();
                assert_eq!(bits(a), bits(c));
            }
        }
    }
}
