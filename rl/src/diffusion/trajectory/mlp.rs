//! The conditional residual-MLP fragment denoiser (fedrl's CPU default for PrivORL-j; the
//! paper's PrivORL-j-U baseline swaps the transformer for a non-sequential network in the same
//! way). It is SynthER's residual MLP ([`crate::diffusion::denoiser`]) over a whole fragment
//! row with the condition projected into the first hidden layer:
//!
//! ```text
//! e(t)  = [t, sin(2 pi t w), cos(2 pi t w)]                random Fourier features (fixed w)
//! h0    = proj(x) + cond(c) + time_mlp.3(silu(time_mlp.1(e(t))))     all: -> dim_t
//! h     = in(h0);  h <- h + lin_l(relu(h)), l = 1..L                 in: dim_t -> width
//! F     = out(relu(h))                                              out: width -> H d
//! ```
//!
//! Parameters (flat order, weights `[in, out]` row-major, then the bias): `proj`, `cond`,
//! `time_mlp.1`, `time_mlp.3`, `residual_mlp.network.0`, the `L` blocks, `residual_mlp.final_linear`.
//! The Fourier frequencies are a fixed buffer drawn with the initial weights.

use candle_core::{Device, Tensor};

use super::{CondNet, Init, fourier, linear};
use crate::diffusion::denoiser::{DenoiserConfig, ParamShape};
use crate::{NnError, Result};

/// The conditional residual MLP's fixed parts (sizes, Fourier frequencies).
#[derive(Clone, Debug)]
pub struct CondMlp {
    data_dim: usize,
    cond_dim: usize,
    config: DenoiserConfig,
    shapes: Vec<ParamShape>,
    /// `[1, fourier_dim / 2]`.
    freqs: Tensor,
    device: Device,
}

impl CondMlp {
    /// The network for rows of `data_dim` and conditions of `cond_dim`, with its seeded initial
    /// flat parameters.
    pub fn new(
        data_dim: usize,
        cond_dim: usize,
        config: DenoiserConfig,
        seed: u64,
        device: &Device,
    ) -> Result<(Self, Vec<f32>)> {
        let c = &config;
        if data_dim == 0
            || cond_dim == 0
            || c.width == 0
            || c.dim_t == 0
            || c.fourier_dim == 0
            || !c.fourier_dim.is_multiple_of(2)
        {
            return Err(NnError::Invalid(format!(
                "conditional MLP: data_dim {data_dim}, cond_dim {cond_dim}, {config:?}"
            )));
        }
        let mut init = Init::new(seed);
        init.linear("proj", data_dim, c.dim_t);
        init.linear("cond", cond_dim, c.dim_t);
        init.linear("time_mlp.1", c.fourier_dim + 1, c.dim_t);
        init.linear("time_mlp.3", c.dim_t, c.dim_t);
        init.linear("residual_mlp.network.0", c.dim_t, c.width);
        for b in 0..c.blocks {
            init.linear(
                &format!("residual_mlp.network.{}.linear", b + 1),
                c.width,
                c.width,
            );
        }
        init.linear("residual_mlp.final_linear", c.width, data_dim);
        let freqs = init.normals(c.fourier_dim / 2);
        let n = freqs.len();
        Ok((
            CondMlp {
                data_dim,
                cond_dim,
                config,
                shapes: init.shapes,
                freqs: Tensor::from_vec(freqs, (1, n), device)?,
                device: device.clone(),
            },
            init.flat,
        ))
    }

    pub fn config(&self) -> &DenoiserConfig {
        &self.config
    }
}

impl CondNet for CondMlp {
    fn data_dim(&self) -> usize {
        self.data_dim
    }

    fn cond_dim(&self) -> usize {
        self.cond_dim
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn param_shapes(&self) -> &[ParamShape] {
        &self.shapes
    }

    fn forward_cond(
        &self,
        params: &[Tensor],
        x: &Tensor,
        t: &Tensor,
        cond: &Tensor,
    ) -> Result<Tensor> {
        if params.len() != self.shapes.len() {
            return Err(NnError::Invalid(format!(
                "conditional MLP: {} parameter tensors, expected {}",
                params.len(),
                self.shapes.len()
            )));
        }
        let lin = |h: &Tensor, l: usize| linear(h, &params[2 * l], &params[2 * l + 1]);
        let emb = fourier(t, &self.freqs)?;
        let temb = lin(&lin(&emb, 2)?.silu()?, 3)?;
        let h0 = ((lin(x, 0)? + lin(cond, 1)?)? + temb)?;
        let mut h = lin(&h0, 4)?;
        for l in 0..self.config.blocks {
            h = (&h + lin(&h.relu()?, 5 + l)?)?;
        }
        Ok(lin(&h.relu()?, 5 + self.config.blocks)?)
    }
}
