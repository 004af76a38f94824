//! The paper's transformer fragment denoiser (seed 003, section VI-B "Input Embeddings" and
//! "Sequence Processing", appendix F-A: 6 layers, 4 heads), laid out as the authors'
//! `TasksAug` with five condition tokens (`PrivORL-J/diffuser/models/temporal_dp.py`):
//!
//! - every transition of the fragment gives one token per component (`s`, `a`, `r`, `s'`, and
//!   `done` when the layout models it), each embedded by a two-layer MLP per component kind
//!   (`Linear, GELU, Linear`; `s` and `s'` share the state MLP, as the authors' `state_mlp`);
//! - the link transition gives one token per component through its own MLPs; the tokens are
//!   multiplied by the condition's flag, so the first fragment's condition is zero tokens (the
//!   authors' "zero condition");
//! - one time token: the noise level's random Fourier features (as the MLP denoiser, since EDM
//!   feeds `c_noise = ln(sigma)/4` rather than a step index) through `Linear, GELU, Linear`;
//! - tokens `[time, condition (K), fragment (H K)]` plus fixed sinusoidal position encodings,
//!   a layer norm, then `layers` post-norm encoder layers (PyTorch's `TransformerEncoderLayer`
//!   default: `x = LN(x + MHA(x)); x = LN(x + FF(x))`, `FF = Linear(w, 4w), GELU, Linear(4w, w)`),
//!   full (bidirectional) attention;
//! - each fragment token is decoded by its kind's head (`Linear, GELU, Linear`; the state head
//!   shared by `s` and `s'`) and the outputs are put back in the transition layout.
//!
//! Differences from the authors' module, on purpose: no dropout (the denoiser is deterministic,
//! so the per-trajectory contributions of [`super::dp`] and the membership attack's losses are
//! reproducible); the attention's input projection is initialised like every other linear
//! layer here (`U(-1/sqrt(in), 1/sqrt(in))`) rather than Xavier.
//!
//! Parameters (flat order, weights `[in, out]`): see [`CondTransformer::new`]'s names.

use candle_core::{D, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::{CondNet, Init, fourier, linear};
use crate::diffusion::denoiser::ParamShape;
use crate::diffusion::encode::TransitionLayout;
use crate::{NnError, Result};

/// The transformer's sizes (defaults: the paper's, appendix F-A, width 256 as `hidden_size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransformerConfig {
    /// Token width.
    pub width: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Attention heads (divides `width`).
    pub heads: usize,
    /// Feed-forward width as a multiple of `width`.
    pub ff_mult: usize,
    /// Random Fourier features of the noise level (even).
    pub fourier_dim: usize,
}

impl Default for TransformerConfig {
    fn default() -> Self {
        TransformerConfig {
            width: 256,
            layers: 6,
            heads: 4,
            ff_mult: 4,
            fourier_dim: 16,
        }
    }
}

/// Component kinds, each with its own embedding MLP and head.
const STATE: usize = 0;
const ACTION: usize = 1;
const REWARD: usize = 2;
const TERMINAL: usize = 3;

/// One component of a transition: where it sits in the row and its kind.
#[derive(Clone, Copy, Debug)]
struct Component {
    start: usize,
    len: usize,
    kind: usize,
}

/// Indices (into the parameter list) of a linear layer's weight; its bias follows.
type Lin = usize;

#[derive(Clone, Debug)]
struct LayerIdx {
    in_proj: Lin,
    out_proj: Lin,
    norm1: Lin,
    ff1: Lin,
    ff2: Lin,
    norm2: Lin,
}

/// The transformer denoiser's fixed parts.
#[derive(Clone, Debug)]
pub struct CondTransformer {
    cfg: TransformerConfig,
    tdim: usize,
    horizon: usize,
    comps: Vec<Component>,
    shapes: Vec<ParamShape>,
    time: (Lin, Lin),
    /// Per kind (`STATE..=TERMINAL`), `None` for a kind the layout lacks.
    embed: Vec<Option<(Lin, Lin)>>,
    cond: Vec<(Lin, Lin)>,
    embed_ln: Lin,
    layers: Vec<LayerIdx>,
    heads: Vec<Option<(Lin, Lin)>>,
    freqs: Tensor,
    /// `[tokens, width]`.
    pos: Tensor,
    device: Device,
}

impl CondTransformer {
    /// The network for fragments of `horizon` transitions of `layout`, with its seeded initial
    /// flat parameters.
    pub fn new(
        layout: &TransitionLayout,
        horizon: usize,
        cfg: TransformerConfig,
        seed: u64,
        device: &Device,
    ) -> Result<(Self, Vec<f32>)> {
        layout.check()?;
        let w = cfg.width;
        if horizon == 0
            || w == 0
            || cfg.layers == 0
            || cfg.heads == 0
            || !w.is_multiple_of(cfg.heads)
            || cfg.ff_mult == 0
            || cfg.fourier_dim == 0
            || !cfg.fourier_dim.is_multiple_of(2)
        {
            return Err(NnError::Invalid(format!(
                "transformer denoiser: horizon {horizon}, {cfg:?} (heads must divide width, \
                 fourier_dim even)"
            )));
        }
        let obs = layout.obs_dim;
        let act = layout.action_width();
        let mut comps = vec![
            Component {
                start: 0,
                len: obs,
                kind: STATE,
            },
            Component {
                start: obs,
                len: act,
                kind: ACTION,
            },
            Component {
                start: obs + act,
                len: 1,
                kind: REWARD,
            },
            Component {
                start: obs + act + 1,
                len: obs,
                kind: STATE,
            },
        ];
        if layout.model_terminal {
            comps.push(Component {
                start: 2 * obs + act + 1,
                len: 1,
                kind: TERMINAL,
            });
        }
        let kind_dim = [obs, act, 1, 1];
        let has_kind = [true, true, true, layout.model_terminal];
        let names = ["state", "action", "reward", "terminal"];

        let mut init = Init::new(seed);
        let lin = |init: &mut Init, name: &str, i: usize, o: usize| -> Lin {
            let at = init.shapes.len();
            init.linear(name, i, o);
            at
        };
        let time = (
            lin(&mut init, "time_mlp.1", cfg.fourier_dim + 1, w),
            lin(&mut init, "time_mlp.3", w, w),
        );
        let mut embed = Vec::new();
        for k in 0..4 {
            embed.push(has_kind[k].then(|| {
                (
                    lin(&mut init, &format!("{}_mlp.0", names[k]), kind_dim[k], w),
                    lin(&mut init, &format!("{}_mlp.2", names[k]), w, w),
                )
            }));
        }
        let mut cond = Vec::new();
        for (j, c) in comps.iter().enumerate() {
            cond.push((
                lin(&mut init, &format!("cond_mlp.{j}.0"), c.len, w),
                lin(&mut init, &format!("cond_mlp.{j}.2"), w, w),
            ));
        }
        let embed_ln = init.shapes.len();
        init.layer_norm("embed_ln", w);
        let mut layers = Vec::new();
        for l in 0..cfg.layers {
            let p = format!("transformer.layers.{l}");
            let in_proj = lin(&mut init, &format!("{p}.self_attn.in_proj"), w, 3 * w);
            let out_proj = lin(&mut init, &format!("{p}.self_attn.out_proj"), w, w);
            let norm1 = init.shapes.len();
            init.layer_norm(&format!("{p}.norm1"), w);
            let ff1 = lin(&mut init, &format!("{p}.linear1"), w, cfg.ff_mult * w);
            let ff2 = lin(&mut init, &format!("{p}.linear2"), cfg.ff_mult * w, w);
            let norm2 = init.shapes.len();
            init.layer_norm(&format!("{p}.norm2"), w);
            layers.push(LayerIdx {
                in_proj,
                out_proj,
                norm1,
                ff1,
                ff2,
                norm2,
            });
        }
        let mut heads = Vec::new();
        for k in 0..4 {
            heads.push(has_kind[k].then(|| {
                (
                    lin(&mut init, &format!("predict_{}.0", names[k]), w, w),
                    lin(
                        &mut init,
                        &format!("predict_{}.2", names[k]),
                        w,
                        kind_dim[k],
                    ),
                )
            }));
        }
        let freqs = init.normals(cfg.fourier_dim / 2);
        let nf = freqs.len();
        let tokens = 1 + comps.len() * (horizon + 1);
        let mut pe = vec![0f32; tokens * w];
        for p in 0..tokens {
            for i in 0..w / 2 {
                let div = (-((2 * i) as f64) * 10000f64.ln() / w as f64).exp();
                pe[p * w + 2 * i] = (p as f64 * div).sin() as f32;
                pe[p * w + 2 * i + 1] = (p as f64 * div).cos() as f32;
            }
        }
        Ok((
            CondTransformer {
                cfg,
                tdim: layout.dim(),
                horizon,
                comps,
                shapes: init.shapes,
                time,
                embed,
                cond,
                embed_ln,
                layers,
                heads,
                freqs: Tensor::from_vec(freqs, (1, nf), device)?,
                pos: Tensor::from_vec(pe, (tokens, w), device)?,
                device: device.clone(),
            },
            init.flat,
        ))
    }

    pub fn config(&self) -> &TransformerConfig {
        &self.cfg
    }

    /// Tokens per forward pass (`1 + K (H + 1)`, `K` components per transition).
    pub fn tokens(&self) -> usize {
        self.pos.dim(0).unwrap_or(0)
    }
}

fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?
        .broadcast_mul(g)?
        .broadcast_add(b)
}

impl CondNet for CondTransformer {
    fn data_dim(&self) -> usize {
        self.horizon * self.tdim
    }

    fn cond_dim(&self) -> usize {
        self.tdim + 1
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
                "transformer denoiser: {} parameter tensors, expected {}",
                params.len(),
                self.shapes.len()
            )));
        }
        let p = |i: usize| &params[i];
        let lin = |h: &Tensor, l: Lin| linear(h, p(l), p(l + 1));
        let mlp = |h: &Tensor, (a, b): (Lin, Lin)| -> candle_core::Result<Tensor> {
            lin(&lin(h, a)?.gelu_erf()?, b)
        };
        let missing = || NnError::Invalid("transformer denoiser: a component without MLP".into());
        let (b, h, d, w) = (x.dim(0)?, self.horizon, self.tdim, self.cfg.width);
        let k = self.comps.len();
        let xs = x.reshape((b, h, d))?;
        let mut data = Vec::with_capacity(k);
        for c in &self.comps {
            let e = self.embed[c.kind].ok_or_else(missing)?;
            data.push(mlp(&xs.narrow(2, c.start, c.len)?, e)?);
        }
        let data = Tensor::stack(&data, 2)?.reshape((b, h * k, w))?;
        let flag = cond.narrow(1, d, 1)?;
        let mut ctoks = Vec::with_capacity(k);
        for (c, &m) in self.comps.iter().zip(&self.cond) {
            ctoks.push(mlp(&cond.narrow(1, c.start, c.len)?, m)?.broadcast_mul(&flag)?);
        }
        let ctoks = Tensor::stack(&ctoks, 1)?;
        let time = mlp(&fourier(t, &self.freqs)?, self.time)?.unsqueeze(1)?;
        let mut z = Tensor::cat(&[&time, &ctoks, &data], 1)?.broadcast_add(&self.pos)?;
        z = layer_norm(&z, p(self.embed_ln), p(self.embed_ln + 1))?;
        let tokens = z.dim(1)?;
        let (nh, hd) = (self.cfg.heads, w / self.cfg.heads);
        let scale = 1.0 / (hd as f64).sqrt();
        for l in &self.layers {
            let qkv = lin(&z, l.in_proj)?;
            let split = |i: usize| -> candle_core::Result<Tensor> {
                qkv.narrow(2, i * w, w)?
                    .reshape((b, tokens, nh, hd))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let (q, kk, v) = (split(0)?, split(1)?, split(2)?);
            let att = (q.matmul(&kk.t()?.contiguous()?)? * scale)?;
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            let o = att.matmul(&v)?.transpose(1, 2)?.reshape((b, tokens, w))?;
            z = layer_norm(&(&z + lin(&o, l.out_proj)?)?, p(l.norm1), p(l.norm1 + 1))?;
            let ff = lin(&lin(&z, l.ff1)?.gelu_erf()?, l.ff2)?;
            z = layer_norm(&(&z + ff)?, p(l.norm2), p(l.norm2 + 1))?;
        }
        let out = z.narrow(1, 1 + k, h * k)?.reshape((b, h, k, w))?;
        let mut parts = Vec::with_capacity(k);
        for (j, c) in self.comps.iter().enumerate() {
            let head = self.heads[c.kind].ok_or_else(missing)?;
            parts.push(mlp(&out.narrow(2, j, 1)?.squeeze(2)?, head)?);
        }
        Ok(Tensor::cat(&parts, 2)?.reshape((b, h * d))?)
    }
}
