//! Per-unit clipped gradients of the CQL loss for DP-SGD (DESIGN §2.3, §2.5), without a loop over
//! examples.
//!
//! Rows of a batch are grouped by privacy unit (`unit_of_row`, non-decreasing). A unit's
//! gradient is the MEAN of its rows' per-example gradients, clipped to L2 norm `C`:
//! `g_u = (1/k_u) sum_{i in u} grad l_i`, `clip(g_u) = g_u min(1, C / |g_u|)`.
//!
//! The backward pass ([`super::cql`]) gives, per layer, every row's pre-activation gradient
//! `d_i` and input `a_i`; row `i`'s weight gradient is `d_i a_i^T` and its bias gradient `d_i`.
//! So, with `ã_i = [a_i, 1]`,
//!
//! ```text
//! |sum_{i in u} grad_l l_i|^2 = sum_{i,j in u} (d_i . d_j) (ã_i . ã_j)
//! ```
//!
//! computed with one batched Gram product per layer over units padded to the largest unit
//! (zero rows add nothing), or row norms alone when every unit has one row. The clipped sum is
//! then ONE weighted matmul per layer, `sum_u s_u g_u = (W D)^T A` with `W = diag(s_u(i) / k_u(i))`;
//! [`per_unit_clipped`] materialises the `U` clipped vectors with batched matmuls instead.
//!
//! **Rounding is accounted for.** The norms are computed in f32, and for a unit whose rows'
//! gradients cancel, the Gram sum can be off by far more than f32's relative precision. The clip
//! factor therefore uses a rigorous upper bound on the norm, `|g_u|^2 + gamma_n (sum_i |g_i|)^2 /
//! k_u^2` per layer, with the standard floating-point summation bound `gamma_n = 2 n 2^-24`
//! (`n` = the longest chain of additions: a dot product over a layer's widths plus the `k^2`
//! Gram terms). For a one-row unit this inflates the norm by about `n 2^-24` (~3e-5 relative at
//! width 256): a unit's clipped gradient is then at most `C` in exact arithmetic, whatever
//! the rounding, which is what the sensitivity of the Gaussian mechanism needs. The `norms`
//! returned are the plain estimates (before clipping, without the margin). This relies on
//! IEEE f32 matmuls: candle's CUDA backend must keep `set_gemm_reduced_precision_f32(false)`
//! (its default: no TF32).
//!
//! # The summed path (central mode)
//! [`summed_clipped`] gives the central aggregator what DP-SGD adds noise to, the sum of the
//! units' clipped gradients, without materialising them, **accumulated in f64**: `d_i` and
//! `a_i` (f32) are converted exactly, the row weights `w_i = s_u / k_u` are rounded once, and
//! the product `sum_i w_i d_i a~_i^T` is one f64 matmul per layer. That keeps the floating-point
//! error of the sum provably tiny next to `C` for any public bound on the round's rows and
//! units (an f32 product's worst-case error grows with the number of units times the rows, and
//! would cost several percent of `C` at ten thousand units). The bound and the sensitivity it
//! gives after quantising the sum once are proven in
//! [`SummedBound`](fedrl_common::privacy::fixed_point::SummedBound); what that proof needs from
//! this computation:
//! - each unit's exact clipped contribution `s_u g_u` (exact arithmetic on the f32 `d_i`,
//!   `a_i`) has norm at most `C`: the clip factor from [`unit_clip`]'s rounding-safe norm bound
//!   (above);
//! - `s_u mean_{i in u} |g_i| <= R C` ([`SUMMED_ROW_NORM_CAP`]): automatic for one-row units,
//!   enforced for larger ones by lowering `s_u` where needed, with the row norms computed in f64
//!   and rounded up;
//! - every output coordinate is an ordinary f64 dot product over the rows in some order (the
//!   CPU gemm and cuBLAS DGEMM are; no reduced-precision mode exists for f64).
//!
//! One assumption is shared with the per-unit path and not proven here: a row's `d_i` and `a_i`
//! do not depend on the other rows of the batch (each is computed from its own row; a matmul
//! kernel whose reduction order over the inner dimension changed with the number of rows could
//! change them in the last bits).

use candle_core::{D, DType, Device, Tensor};
use fedrl_common::offline::CqlConfig;
use fedrl_common::privacy::fixed_point::SUMMED_ROW_NORM_CAP;

use super::batch::TransitionBatch;
use super::cql::{PerExample, flatten_layers, per_example};
use super::qnet::QNetSpec;
use crate::{NnError, Result};

/// Every unit's clipped gradient, materialised.
#[derive(Clone, Debug, PartialEq)]
pub struct UnitGradients {
    /// One flat gradient per unit (layout of [`QNetSpec`]), each of L2 norm at most `C`.
    pub grads: Vec<Vec<f32>>,
    /// Each unit's gradient norm before clipping (L2, loss units per parameter unit).
    pub norms: Vec<f64>,
}

/// How the rows of a batch fall into units.
struct Grouping {
    /// Rows of each unit (0 for a unit without rows: its gradient is zero).
    counts: Vec<usize>,
    /// First row of each unit.
    starts: Vec<usize>,
    /// Largest count.
    kmax: usize,
    /// Every unit has exactly `kmax` rows: the regrouping is a reshape, no padding needed.
    uniform: bool,
}

impl Grouping {
    fn new(unit_of_row: &[u32], n_rows: usize, n_units: usize) -> Result<Self> {
        if unit_of_row.len() != n_rows {
            return Err(NnError::Invalid(format!(
                "unit_of_row has {} entries for {n_rows} rows",
                unit_of_row.len()
            )));
        }
        if n_units == 0 {
            return Err(NnError::Invalid("no units".into()));
        }
        let mut counts = vec![0usize; n_units];
        let mut prev = 0u32;
        for &u in unit_of_row {
            if u < prev {
                return Err(NnError::Invalid(
                    "unit_of_row must be non-decreasing (rows grouped by unit)".into(),
                ));
            }
            prev = u;
            let slot = counts.get_mut(u as usize).ok_or_else(|| {
                NnError::Invalid(format!("unit {u} out of range for {n_units} units"))
            })?;
            *slot += 1;
        }
        let mut starts = Vec::with_capacity(n_units);
        let mut at = 0;
        for &c in &counts {
            starts.push(at);
            at += c;
        }
        let kmax = counts.iter().copied().max().unwrap_or(0);
        Ok(Grouping {
            uniform: counts.iter().all(|&c| c == kmax),
            counts,
            starts,
            kmax,
        })
    }

    fn n_units(&self) -> usize {
        self.counts.len()
    }

    /// `[U * kmax]` row indices; padding slots point at row `n_rows` (a zero row appended).
    fn pad_index(&self, n_rows: usize, device: &Device) -> Result<Tensor> {
        let mut idx = Vec::with_capacity(self.n_units() * self.kmax);
        for (&s, &c) in self.starts.iter().zip(&self.counts) {
            idx.extend((0..self.kmax).map(|j| if j < c { (s + j) as u32 } else { n_rows as u32 }));
        }
        let len = idx.len();
        Ok(Tensor::from_vec(idx, len, device)?)
    }

    /// `[B, w]` rows regrouped as `[U, kmax, w]`, zero-padded through `idx`
    /// ([`Self::pad_index`]); `None` when the units are uniform (a reshape).
    fn pad(&self, t: &Tensor, idx: Option<&Tensor>) -> Result<Tensor> {
        let (_, w) = t.dims2()?;
        let Some(idx) = idx else {
            return Ok(t.reshape((self.n_units(), self.kmax, w))?);
        };
        let zero = Tensor::zeros((1, w), t.dtype(), t.device())?;
        Ok(Tensor::cat(&[t, &zero], 0)?
            .index_select(idx, 0)?
            .reshape((self.n_units(), self.kmax, w))?)
    }
}

/// The clip factor of every unit and its gradient norm before clipping.
struct Clip {
    scales: Vec<f64>,
    norms: Vec<f64>,
}

fn check_clip(clip_norm: f64) -> Result<()> {
    if !(clip_norm.is_finite() && clip_norm > 0.0) {
        return Err(NnError::Invalid(format!(
            "clip norm must be finite and > 0, got {clip_norm}"
        )));
    }
    Ok(())
}

/// Norms of the units' mean gradients (Gram form, see the module docs) and the clip factors
/// from their rounding-safe upper bounds.
fn unit_clip(pe: &PerExample, g: &Grouping, idx: Option<&Tensor>, clip_norm: f64) -> Result<Clip> {
    let mut norm2: Option<Tensor> = None;
    let mut abs2: Option<Tensor> = None;
    let mut longest_dot = 0usize;
    for (delta, input) in pe.deltas.iter().zip(&pe.inputs) {
        let (_, fan_out) = delta.dims2()?;
        let (_, fan_in) = input.dims2()?;
        longest_dot = longest_dot.max(fan_out + fan_in + 1);
        // Row norms: |d_i|^2 and |ã_i|^2 = |a_i|^2 + 1.
        let dn = delta.sqr()?.sum_keepdim(D::Minus1)?;
        let an = (input.sqr()?.sum_keepdim(D::Minus1)? + 1.0)?;
        let (n2, a2) = match (g.uniform, g.kmax) {
            (true, 1) => {
                // Unit u is row u: |g_u|^2 = |d|^2 |ã|^2 and (sum |g_i|)^2 is the same.
                let t = dn.mul(&an)?.squeeze(D::Minus1)?;
                (t.clone(), t)
            }
            _ => {
                let dp = g.pad(delta, idx)?;
                let ones = Tensor::ones(input.dims2()?.0, input.dtype(), input.device())?
                    .unsqueeze(D::Minus1)?;
                let ap = g.pad(&Tensor::cat(&[input, &ones], 1)?, idx)?;
                let gd = gram(&dp)?;
                let ga = gram(&ap)?;
                let n2 = gd.mul(&ga)?.sum((1, 2))?;
                let row_abs = g.pad(&dn.mul(&an)?.sqrt()?, idx)?; // [U, k, 1]
                let a2 = row_abs.sum((1, 2))?.sqr()?;
                (n2, a2)
            }
        };
        norm2 = Some(match norm2 {
            None => n2,
            Some(acc) => acc.add(&n2)?,
        });
        abs2 = Some(match abs2 {
            None => a2,
            Some(acc) => acc.add(&a2)?,
        });
    }
    let (Some(norm2), Some(abs2)) = (norm2, abs2) else {
        return Err(NnError::Invalid("Q-network without layers".into()));
    };
    let norm2: Vec<f32> = norm2.to_vec1()?;
    let abs2: Vec<f32> = abs2.to_vec1()?;
    // Additions along the longest chain: a dot product, the k^2 Gram terms, the layer sum.
    let n_chain = longest_dot + g.kmax * g.kmax + pe.deltas.len() + 4;
    let gamma = 2.0 * n_chain as f64 * f64::powi(2.0, -24);
    let mut scales = Vec::with_capacity(g.n_units());
    let mut norms = Vec::with_capacity(g.n_units());
    let mut bad = Vec::new();
    for (u, &k) in g.counts.iter().enumerate() {
        if k == 0 {
            scales.push(1.0);
            norms.push(0.0);
            continue;
        }
        let inv_k2 = 1.0 / (k * k) as f64;
        let est = f64::from(norm2[u]).max(0.0) * inv_k2;
        let upper = est + gamma * f64::from(abs2[u]) * inv_k2;
        // NaN fails this test too. Every such unit is named, so the caller can leave them all
        // out at once (`dpsgd::without_non_finite_units`).
        if !upper.is_finite() {
            bad.push(u);
            scales.push(0.0);
            norms.push(f64::NAN);
            continue;
        }
        let upper = upper.sqrt();
        scales.push(if upper > clip_norm {
            clip_norm / upper
        } else {
            1.0
        });
        norms.push(est.sqrt());
    }
    if !bad.is_empty() {
        return Err(NnError::NonFiniteUnits { units: bad });
    }
    Ok(Clip { scales, norms })
}

/// Largest unit size for which [`gram`] uses broadcast products instead of batched matmuls:
/// the product holds `B k w` floats (`B` rows, width `w`), which stays small for `k <= 8`.
const BROADCAST_GRAM_MAX_ROWS: usize = 8;

/// `[U, k, w]` -> `[U, k, k]` Gram matrices of every unit's rows. For small `k` a broadcast
/// product and a sum (`U k^2 w` element operations, a few large ops) beats `U` tiny matmuls,
/// each of which pays a thread dispatch on the CPU.
fn gram(p: &Tensor) -> Result<Tensor> {
    let (_, k, _) = p.dims3()?;
    if k <= BROADCAST_GRAM_MAX_ROWS {
        Ok(p.unsqueeze(2)?.broadcast_mul(&p.unsqueeze(1)?)?.sum(3)?)
    } else {
        Ok(p.matmul(&p.transpose(1, 2)?.contiguous()?)?)
    }
}

/// Shared start of both entry points: forward/backward, grouping, clip factors.
#[allow(clippy::too_many_arguments)]
fn prepare(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    params: &[f32],
    target: &[f32],
    batch: &TransitionBatch,
    unit_of_row: &[u32],
    n_units: usize,
    clip_norm: f64,
    device: &Device,
) -> Result<(PerExample, Grouping, Option<Tensor>, Clip)> {
    check_clip(clip_norm)?;
    let pe = per_example(spec, cfg, params, target, batch, device)?;
    let (g, idx, clip) = group_and_clip(&pe, unit_of_row, n_units, clip_norm, device)?;
    Ok((pe, g, idx, clip))
}

/// Grouping and clip factors of a forward/backward result `pe` of any network of linear
/// layers (one input row per example and layer).
fn group_and_clip(
    pe: &PerExample,
    unit_of_row: &[u32],
    n_units: usize,
    clip_norm: f64,
    device: &Device,
) -> Result<(Grouping, Option<Tensor>, Clip)> {
    check_clip(clip_norm)?;
    let n_rows = pe.losses.dim(0)?;
    let g = Grouping::new(unit_of_row, n_rows, n_units)?;
    let idx = if g.uniform {
        None
    } else {
        Some(g.pad_index(n_rows, device)?)
    };
    let clip = unit_clip(pe, &g, idx.as_ref(), clip_norm)?;
    Ok((g, idx, clip))
}

/// Every unit's mean CQL gradient over its rows, clipped to L2 norm `clip_norm`, materialised
/// (`n_units` flat vectors). `unit_of_row[i]` (in `0..n_units`, non-decreasing) names the unit of
/// row `i` of `batch`; a unit with no rows gets a zero gradient. See the module docs for the
/// computation and its rounding margin.
#[allow(clippy::too_many_arguments)]
pub fn per_unit_clipped(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    params: &[f32],
    target: &[f32],
    batch: &TransitionBatch,
    unit_of_row: &[u32],
    n_units: usize,
    clip_norm: f64,
    device: &Device,
) -> Result<UnitGradients> {
    let (pe, g, idx, clip) = prepare(
        spec,
        cfg,
        params,
        target,
        batch,
        unit_of_row,
        n_units,
        clip_norm,
        device,
    )?;
    per_unit_from(&pe, &g, idx.as_ref(), clip)
}

/// [`per_unit_clipped`] for a forward/backward result of any network of linear layers whose
/// flat layout is every layer's `[out, in]` weight then its bias, in `pe`'s layer order
/// (the diffusion denoiser's DP fine-tuning uses it too).
pub(crate) fn per_unit_clipped_of(
    pe: &PerExample,
    unit_of_row: &[u32],
    n_units: usize,
    clip_norm: f64,
    device: &Device,
) -> Result<UnitGradients> {
    let (g, idx, clip) = group_and_clip(pe, unit_of_row, n_units, clip_norm, device)?;
    per_unit_from(pe, &g, idx.as_ref(), clip)
}

fn per_unit_from(
    pe: &PerExample,
    g: &Grouping,
    idx: Option<&Tensor>,
    clip: Clip,
) -> Result<UnitGradients> {
    let device = pe.losses.device();
    let u = g.n_units();
    let weights: Vec<f32> = clip
        .scales
        .iter()
        .zip(&g.counts)
        .map(|(&s, &k)| if k == 0 { 0.0 } else { (s / k as f64) as f32 })
        .collect();
    let weights = Tensor::from_vec(weights, (u, 1, 1), device)?;
    let mut parts = Vec::with_capacity(2 * pe.deltas.len());
    for (delta, input) in pe.deltas.iter().zip(&pe.inputs) {
        let (dp, ap) = (g.pad(delta, idx)?, g.pad(input, idx)?);
        let dw = dp.broadcast_mul(&weights)?; // [U, k, out]
        let gw = if g.kmax == 1 {
            // Outer products as one broadcast product: U tiny matmuls would each pay a dispatch.
            dw.transpose(1, 2)?.broadcast_mul(&ap)?
        } else {
            dw.transpose(1, 2)?.matmul(&ap)?
        }; // [U, out, in]
        parts.push(gw.flatten_from(1)?);
        parts.push(dw.sum(1)?);
    }
    let grads: Vec<Vec<f32>> = Tensor::cat(&parts, 1)?.to_vec2()?;
    Ok(UnitGradients {
        grads,
        norms: clip.norms,
    })
}

/// The sum over units of their clipped mean gradients (what DP-SGD adds noise to), computed as
/// one weighted matmul per layer without materialising the per-unit vectors, and every unit's
/// norm before clipping. Same arguments and semantics as [`per_unit_clipped`]; the two agree to
/// float rounding.
#[allow(clippy::too_many_arguments)]
pub fn clipped_sum(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    params: &[f32],
    target: &[f32],
    batch: &TransitionBatch,
    unit_of_row: &[u32],
    n_units: usize,
    clip_norm: f64,
    device: &Device,
) -> Result<(Vec<f32>, Vec<f64>)> {
    let (pe, g, _, clip) = prepare(
        spec,
        cfg,
        params,
        target,
        batch,
        unit_of_row,
        n_units,
        clip_norm,
        device,
    )?;
    // Row weight s_u / k_u for the row's unit.
    let mut w = Vec::with_capacity(batch.len());
    for (u, &k) in g.counts.iter().enumerate() {
        w.extend(std::iter::repeat_n((clip.scales[u] / k as f64) as f32, k));
    }
    let n = w.len();
    let w = Tensor::from_vec(w, (n, 1), device)?;
    let grads: Vec<(Tensor, Tensor)> = pe
        .deltas
        .iter()
        .zip(&pe.inputs)
        .map(|(delta, input)| {
            let dw = delta.broadcast_mul(&w)?;
            Ok((dw.t()?.matmul(input)?, dw.sum(0)?))
        })
        .collect::<candle_core::Result<_>>()?;
    Ok((flatten_layers(&grads)?, clip.norms))
}

/// The summed path's result ([`summed_clipped`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SummedGradient {
    /// `sum_u s_u g_u` in f64 (flat layout of [`QNetSpec`]): to be quantised once onto the
    /// public grid ([`Grid::quantize_sum`](fedrl_common::privacy::fixed_point::Grid::quantize_sum)).
    /// Operator-only: an exact sum of private gradients.
    pub sum: Vec<f64>,
    /// Each unit's gradient norm before clipping (plain estimate, as in [`UnitGradients`]).
    pub norms: Vec<f64>,
    /// Each unit's clip factor `s_u` in `(0, 1]` (below 1: clipped). Operator-only.
    pub clip_factors: Vec<f64>,
    /// The mean per-row training loss of the batch at the offered parameters (the forward
    /// pass computes it anyway); `None` without rows or where a path does not compute it (the
    /// trajectory model). Operator-only: a statistic of the units' data, not noised.
    pub mean_loss: Option<f64>,
}

/// The sum over units of their clipped mean CQL gradients, accumulated in f64 (see "The summed
/// path" in the module docs): per-example norms, then one weighted f64 matmul per layer. Same
/// arguments as [`per_unit_clipped`]; agrees with the sum of its vectors to f32 rounding, except
/// for a unit of several rows whose rows cancel to below `1/R` of their mean norm, which the
/// row-norm cap clips harder ([`SUMMED_ROW_NORM_CAP`]).
#[allow(clippy::too_many_arguments)]
pub fn summed_clipped(
    spec: &QNetSpec,
    cfg: &CqlConfig,
    params: &[f32],
    target: &[f32],
    batch: &TransitionBatch,
    unit_of_row: &[u32],
    n_units: usize,
    clip_norm: f64,
    device: &Device,
) -> Result<SummedGradient> {
    let (pe, g, _, clip) = prepare(
        spec,
        cfg,
        params,
        target,
        batch,
        unit_of_row,
        n_units,
        clip_norm,
        device,
    )?;
    summed_from(&pe, &g, clip, batch.len(), clip_norm, device)
}

/// [`summed_clipped`] for a forward/backward result of any network of linear layers whose flat
/// layout is every layer's `[out, in]` weight then its bias, in `pe`'s layer order (the
/// diffusion denoiser's DP fine-tuning uses it too). The same guarantees: see "The summed
/// path" in the module docs.
pub(crate) fn summed_clipped_of(
    pe: &PerExample,
    unit_of_row: &[u32],
    n_units: usize,
    clip_norm: f64,
    device: &Device,
) -> Result<SummedGradient> {
    let (g, _, clip) = group_and_clip(pe, unit_of_row, n_units, clip_norm, device)?;
    summed_from(pe, &g, clip, pe.losses.dim(0)?, clip_norm, device)
}

fn summed_from(
    pe: &PerExample,
    g: &Grouping,
    clip: Clip,
    n_rows: usize,
    clip_norm: f64,
    device: &Device,
) -> Result<SummedGradient> {
    let mut scales = clip.scales;
    let deltas: Vec<Tensor> = pe
        .deltas
        .iter()
        .map(|t| t.to_dtype(DType::F64))
        .collect::<candle_core::Result<_>>()?;
    let inputs: Vec<Tensor> = pe
        .inputs
        .iter()
        .map(|t| t.to_dtype(DType::F64))
        .collect::<candle_core::Result<_>>()?;
    if g.kmax > 1 {
        row_norm_cap(&deltas, &inputs, g, clip_norm, &mut scales)?;
    }
    // Row weight s_u / k_u (f64, one rounding) for the row's unit.
    let mut w = Vec::with_capacity(n_rows);
    for (u, &k) in g.counts.iter().enumerate() {
        w.extend(std::iter::repeat_n(scales[u] / k as f64, k));
    }
    let n = w.len();
    let w = Tensor::from_vec(w, (n, 1), device)?;
    let mut parts = Vec::with_capacity(2 * deltas.len());
    for (delta, input) in deltas.iter().zip(&inputs) {
        let dw = delta.broadcast_mul(&w)?;
        parts.push(dw.t()?.matmul(input)?.flatten_all()?);
        parts.push(dw.sum(0)?);
    }
    let sum: Vec<f64> = Tensor::cat(&parts, 0)?.to_vec1()?;
    let mean_loss = (n_rows > 0)
        .then(|| -> Result<f64> {
            Ok(pe
                .losses
                .to_dtype(DType::F64)?
                .mean_all()?
                .to_scalar::<f64>()?)
        })
        .transpose()?;
    Ok(SummedGradient {
        sum,
        norms: clip.norms,
        clip_factors: scales,
        mean_loss,
    })
}

/// Lowers `scales[u]` so that `s_u mean_{i in u} |g_i| <= R C` ([`SUMMED_ROW_NORM_CAP`]), with
/// the row norms `|g_i|^2 = sum_l |d_i|^2 (|a_i|^2 + 1)` computed in f64 from the exact f64
/// copies and rounded up: a chain of at most `n = w + 2 L + 4` f64 roundings of relative size
/// `2^-53` per row (`w` the widest layer's fan-in plus fan-out, `L` layers), covered by the
/// factor `1 + 2 n 2^-53`; the square root, mean and division by a further `1 + 2^-40`.
fn row_norm_cap(
    deltas: &[Tensor],
    inputs: &[Tensor],
    g: &Grouping,
    clip_norm: f64,
    scales: &mut [f64],
) -> Result<()> {
    let mut sq: Option<Tensor> = None;
    for (delta, input) in deltas.iter().zip(inputs) {
        let dn = delta.sqr()?.sum(D::Minus1)?;
        let an = (input.sqr()?.sum(D::Minus1)? + 1.0)?;
        let t = dn.mul(&an)?;
        sq = Some(match sq {
            None => t,
            Some(acc) => acc.add(&t)?,
        });
    }
    let Some(sq) = sq else {
        return Err(NnError::Invalid("Q-network without layers".into()));
    };
    let sq: Vec<f64> = sq.to_vec1()?;
    let widest = deltas
        .iter()
        .zip(inputs)
        .map(|(d, a)| d.dim(1).unwrap_or(0) + a.dim(1).unwrap_or(0))
        .max()
        .unwrap_or(0);
    let chain = widest + 2 * deltas.len() + 4;
    let sq_up = 1.0 + 2.0 * chain as f64 * 2f64.powi(-53);
    let up = 1.0 + 2f64.powi(-40);
    let mut bad = Vec::new();
    for (u, (&start, &k)) in g.starts.iter().zip(&g.counts).enumerate() {
        if k == 0 {
            continue;
        }
        let mean = sq[start..start + k]
            .iter()
            .map(|x| (x * sq_up).sqrt())
            .sum::<f64>()
            / k as f64
            * up;
        if !mean.is_finite() {
            bad.push(u);
            continue;
        }
        // The cap with a 2^-50 relative slack for the division and product roundings.
        let cap = SUMMED_ROW_NORM_CAP * clip_norm / mean * (1.0 - 2f64.powi(-50));
        if scales[u] * mean > SUMMED_ROW_NORM_CAP * clip_norm * (1.0 - 2f64.powi(-50)) {
            scales[u] = scales[u].min(cap);
        }
    }
    if !bad.is_empty() {
        return Err(NnError::NonFiniteUnits { units: bad });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::Xoshiro256PlusPlus;
    use rand::{RngExt, SeedableRng};

    /// A unit whose two rows' gradients almost cancel: the f32 Gram estimate of its norm can be
    /// far below the true norm (even clamped to 0), so a clip factor from the estimate alone
    /// would let more than `C` through. With the rounding margin, the unit's clipped gradient
    /// is at most `C` in exact (f64) arithmetic, every time.
    #[test]
    fn clip_factor_is_safe_under_cancellation() {
        let mut under_estimated = 0;
        for seed in 0..200u64 {
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
            let (out, fan_in) = (64usize, 48usize);
            let v: Vec<f32> = (0..out).map(|_| rng.random_range(-300f32..300.0)).collect();
            let e: Vec<f32> = (0..out).map(|_| rng.random_range(-0.01f32..0.01)).collect();
            let a: Vec<f32> = (0..fan_in).map(|_| rng.random_range(-1f32..1.0)).collect();
            let d2: Vec<f32> = v.iter().zip(&e).map(|(x, y)| -x + y).collect();
            // Exact mean gradient of the unit from the f32 inputs: ((v + d2) / 2) [a, 1]^T.
            let sum_d: Vec<f64> = v
                .iter()
                .zip(&d2)
                .map(|(&x, &y)| (f64::from(x) + f64::from(y)) / 2.0)
                .collect();
            let a2: f64 = a.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() + 1.0;
            let true_norm = (sum_d.iter().map(|x| x * x).sum::<f64>() * a2).sqrt();
            let mut rows_d = v.clone();
            rows_d.extend_from_slice(&d2);
            let mut rows_a = a.clone();
            rows_a.extend_from_slice(&a);
            let pe = PerExample {
                inputs: vec![Tensor::from_vec(rows_a, (2, fan_in), &Device::Cpu).unwrap()],
                deltas: vec![Tensor::from_vec(rows_d, (2, out), &Device::Cpu).unwrap()],
                losses: Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu).unwrap(),
            };
            let g = Grouping::new(&[0, 0], 2, 1).unwrap();
            let idx = g.pad_index(2, &Device::Cpu).unwrap();
            let c = 0.5 * true_norm;
            let clip = unit_clip(&pe, &g, Some(&idx), c).unwrap();
            if clip.norms[0] < true_norm * 0.99 {
                under_estimated += 1;
            }
            assert!(
                clip.scales[0] * true_norm <= c,
                "seed {seed}: clipped norm {} > C = {c} (estimate {}, true {true_norm})",
                clip.scales[0] * true_norm,
                clip.norms[0]
            );
        }
        // The scenario is real: the plain estimate is often too small.
        assert!(
            under_estimated > 10,
            "only {under_estimated} under-estimates"
        );
    }
}
