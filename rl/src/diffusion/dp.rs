//! Per-unit clipped gradients of the EDM denoising loss for DP fine-tuning (seed 003, Eq. 2,
//! section V-C): what a PrivORL fine-tuning step adds noise to.
//!
//! A unit (PrivORL-n: one transition) contributes the gradient of its own loss: the mean over
//! its rows and `draws` noise draws of the weighted EDM loss
//! `w(sigma) |D(x + sigma n, sigma) - x|^2 / d`, where every `(sigma, n)` comes from a generator
//! seeded by `(data_seed, round, unit)` alone ([`unit_noise`]): nothing is carried from one unit
//! to another, and the central and the federated mode draw the same noise for the same unit.
//!
//! **Exact per-example norms.** Every parameter of the residual-MLP denoiser belongs to a linear
//! layer that sees exactly one input row per example (the Fourier frequencies are a fixed
//! buffer). The forward pass here adds a zero probe variable to every layer's pre-activation;
//! one backward pass of the summed losses then gives each row's pre-activation gradient `d_i`
//! (the probe's gradient) next to the layer input `a_i` recorded on the way, and row `i`'s
//! gradient of that layer is `d_i [a_i, 1]^T`. The clip factors, the materialised per-unit
//! vectors and the f64 sum of the summed path are [`crate::offline::per_example`]'s, shared
//! with discrete CQL, with the same rounding guarantees (a unit's clipped contribution is at
//! most `C` in exact arithmetic; the summed path's error bound of
//! `fedrl_common::privacy::fixed_point::SummedBound`).
//!
//! Units: rows are normalised encoded transitions ([`super::TransitionSynthesizer::encode`]);
//! gradients are in loss units per parameter unit, in the flat PyTorch layout of
//! [`super::DenoiserSpec::param_shapes`].

use candle_core::{DType, Tensor, Var};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand_distr::{Distribution, StandardNormal};

use super::denoiser::Denoiser;
use super::edm::EdmConfig;
use crate::offline::cql::PerExample;
use crate::offline::per_example::{
    SummedGradient, UnitGradients, per_unit_clipped_of, summed_clipped_of,
};
use crate::rollout::mix;
use crate::{NnError, Result};

/// The noise levels and standard normal noise of `rows x draws` loss terms of unit `unit` at
/// step `round`: `(sigmas, noise)` with `rows * draws` sigmas (row-major: row 0's draws first)
/// and `rows * draws * dim` noise values, from a generator seeded by `(data_seed, round, unit)`
/// alone.
pub fn unit_noise(
    edm: &EdmConfig,
    data_seed: u64,
    round: u64,
    unit: u64,
    terms: usize,
    dim: usize,
) -> (Vec<f64>, Vec<f32>) {
    let mut rng =
        Xoshiro256PlusPlus::seed_from_u64(mix(mix(data_seed ^ 0xd1ff_0000_0000_0003, round), unit));
    let sigmas: Vec<f64> = (0..terms).map(|_| edm.draw_sigma(&mut rng)).collect();
    let noise: Vec<f32> = (0..terms * dim)
        .map(|_| StandardNormal.sample(&mut rng))
        .collect();
    (sigmas, noise)
}

/// Per-example EDM losses of `x0` (`[B, d]` normalised rows, row-major) at `sigmas` with
/// `noise`, under the flat parameters `params`, with every linear layer's input and
/// pre-activation gradient (layers in [`super::DenoiserSpec::linears`] order).
pub(crate) fn per_example(
    net: &Denoiser,
    edm: &EdmConfig,
    params: &[f32],
    x0: &[f32],
    sigmas: &[f64],
    noise: &[f32],
) -> Result<PerExample> {
    let spec = *net.spec();
    let d = spec.data_dim;
    let b = sigmas.len();
    if b == 0 || x0.len() != b * d || noise.len() != b * d {
        return Err(NnError::Invalid(format!(
            "EDM per-example loss: {} rows of {d}, {} sigmas, {} noise values",
            x0.len() / d.max(1),
            b,
            noise.len()
        )));
    }
    let dev = net.device().clone();
    let w = net.tensors_from_flat(params)?;
    let linears = spec.linears();
    let probes: Vec<Var> = linears
        .iter()
        .map(|&(_, o)| Var::zeros((b, o), DType::F32, &dev))
        .collect::<candle_core::Result<_>>()?;
    let mut inputs: Vec<Option<Tensor>> = vec![None; linears.len()];
    let mut lin = |h: &Tensor, l: usize| -> candle_core::Result<Tensor> {
        inputs[l] = Some(h.detach());
        h.matmul(&w[2 * l])?
            .broadcast_add(&w[2 * l + 1])?
            .add(probes[l].as_tensor())
    };
    let col = |v: Vec<f32>| Tensor::from_vec(v, (b, 1), &dev);
    let pc: Vec<_> = sigmas.iter().map(|&s| edm.precond(s)).collect();
    let c_in = col(pc.iter().map(|p| p.c_in as f32).collect())?;
    let c_skip = col(pc.iter().map(|p| p.c_skip as f32).collect())?;
    let c_out = col(pc.iter().map(|p| p.c_out as f32).collect())?;
    let t = col(pc.iter().map(|p| p.c_noise as f32).collect())?;
    let s = col(sigmas.iter().map(|&s| s as f32).collect())?;
    let lw = Tensor::from_vec(
        sigmas.iter().map(|&s| edm.loss_weight(s) as f32).collect(),
        b,
        &dev,
    )?;
    let x0 = Tensor::from_slice(x0, (b, d), &dev)?;
    let n = Tensor::from_slice(noise, (b, d), &dev)?;
    let noisy = (&x0 + n.broadcast_mul(&s)?)?;
    // The denoiser's forward pass (`Denoiser::forward`), each layer through `lin`.
    let freqs = Tensor::from_vec(net.freqs()?, (1, spec.config.fourier_dim / 2), &dev)?;
    let xin = noisy.broadcast_mul(&c_in)?;
    let angles = (t.broadcast_mul(&freqs)? * (2.0 * std::f64::consts::PI))?;
    let emb = Tensor::cat(&[&t, &angles.sin()?, &angles.cos()?], 1)?;
    let t1 = lin(&emb, 1)?.silu()?;
    let temb = lin(&t1, 2)?;
    let proj = lin(&xin, 0)?;
    let mut h = lin(&(proj + temb)?, 3)?;
    for l in 0..spec.config.blocks {
        h = (&h + lin(&h.relu()?, 4 + l)?)?;
    }
    let f = lin(&h.relu()?, 4 + spec.config.blocks)?;
    let den = (noisy.broadcast_mul(&c_skip)? + f.broadcast_mul(&c_out)?)?;
    let losses = ((den - &x0)?.sqr()?.mean(1)? * lw)?;
    let grads = losses.sum_all()?.backward()?;
    let mut deltas = Vec::with_capacity(probes.len());
    for p in &probes {
        deltas.push(
            grads
                .get(p.as_tensor())
                .cloned()
                .ok_or_else(|| NnError::Invalid("a denoiser layer got no gradient".into()))?,
        );
    }
    let inputs = inputs
        .into_iter()
        .map(|i| i.ok_or_else(|| NnError::Invalid("a denoiser layer was not run".into())))
        .collect::<Result<Vec<_>>>()?;
    Ok(PerExample {
        inputs,
        deltas,
        losses: losses.detach(),
    })
}

/// One fine-tuning step's units: each unit's normalised rows (`rows x d`, row-major).
pub struct UnitRows<'a> {
    pub unit: u64,
    pub rows: &'a [f32],
}

/// The batch of every given unit with rows: `draws` copies of each row with their noise, the
/// unit index of each term, and the ids of the units with rows in batch order.
#[allow(clippy::type_complexity)]
fn gather(
    edm: &EdmConfig,
    d: usize,
    units: &[UnitRows<'_>],
    round: u64,
    data_seed: u64,
    draws: u32,
) -> (Vec<f32>, Vec<f64>, Vec<f32>, Vec<u32>, Vec<u64>) {
    let (mut x0, mut sigmas, mut noise, mut unit_of_row, mut ids) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for u in units {
        let rows = u.rows.len() / d;
        if rows == 0 {
            continue;
        }
        let idx = ids.len() as u32;
        let terms = rows * draws as usize;
        let (s, n) = unit_noise(edm, data_seed, round, u.unit, terms, d);
        for r in 0..rows {
            for _ in 0..draws {
                x0.extend_from_slice(&u.rows[r * d..(r + 1) * d]);
                unit_of_row.push(idx);
            }
        }
        sigmas.extend(s);
        noise.extend(n);
        ids.push(u.unit);
    }
    (x0, sigmas, noise, unit_of_row, ids)
}

fn check_rows(d: usize, units: &[UnitRows<'_>]) -> Result<()> {
    if let Some(u) = units.iter().find(|u| !u.rows.len().is_multiple_of(d)) {
        return Err(NnError::Invalid(format!(
            "unit {}: {} values are not rows of {d}",
            u.unit,
            u.rows.len()
        )));
    }
    Ok(())
}

/// Every given unit's mean EDM-loss gradient (over its rows and `draws` noise draws each),
/// clipped to L2 norm `clip_norm` (`f64::INFINITY`: no clipping, for a non-private twin),
/// materialised. A unit without rows gets a zero gradient.
#[allow(clippy::too_many_arguments)]
pub fn unit_gradients(
    net: &Denoiser,
    edm: &EdmConfig,
    params: &[f32],
    units: &[UnitRows<'_>],
    round: u64,
    data_seed: u64,
    draws: u32,
    clip_norm: f64,
) -> Result<Vec<(u64, Vec<f32>)>> {
    let d = net.spec().data_dim;
    check_rows(d, units)?;
    let dim = net.spec().num_params();
    let mut out: Vec<(u64, Vec<f32>)> = units
        .iter()
        .filter(|u| u.rows.is_empty())
        .map(|u| (u.unit, vec![0.0; dim]))
        .collect();
    let (x0, sigmas, noise, unit_of_row, ids) = gather(edm, d, units, round, data_seed, draws);
    if ids.is_empty() {
        return Ok(out);
    }
    let clip = if clip_norm.is_finite() {
        clip_norm
    } else {
        f64::MAX
    };
    let pe = per_example(net, edm, params, &x0, &sigmas, &noise)?;
    let UnitGradients { grads, .. } =
        per_unit_clipped_of(&pe, &unit_of_row, ids.len(), clip, net.device())?;
    out.extend(ids.into_iter().zip(grads));
    Ok(out)
}

/// The summed path of [`unit_gradients`]: the sum of the units' clipped gradients, accumulated
/// in f64, without materialising them; `norms` and `clip_factors` follow the units with rows
/// in order. `clip_norm` must be finite.
#[allow(clippy::too_many_arguments)]
pub fn summed_unit_gradients(
    net: &Denoiser,
    edm: &EdmConfig,
    params: &[f32],
    units: &[UnitRows<'_>],
    round: u64,
    data_seed: u64,
    draws: u32,
    clip_norm: f64,
) -> Result<SummedGradient> {
    let d = net.spec().data_dim;
    check_rows(d, units)?;
    let (x0, sigmas, noise, unit_of_row, ids) = gather(edm, d, units, round, data_seed, draws);
    if ids.is_empty() {
        return Ok(SummedGradient {
            sum: vec![0.0; net.spec().num_params()],
            norms: Vec::new(),
            clip_factors: Vec::new(),
            mean_loss: None,
        });
    }
    let pe = per_example(net, edm, params, &x0, &sigmas, &noise)?;
    summed_clipped_of(&pe, &unit_of_row, ids.len(), clip_norm, net.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diffusion::denoiser::{DenoiserConfig, DenoiserSpec};
    use crate::diffusion::edm;
    use candle_core::Device;

    fn net() -> (Denoiser, Vec<f32>) {
        let spec = DenoiserSpec {
            data_dim: 5,
            config: DenoiserConfig {
                width: 8,
                blocks: 2,
                dim_t: 6,
                fourier_dim: 4,
            },
        };
        let (flat, freqs) = spec.init(3).unwrap();
        (Denoiser::new(spec, &freqs, &Device::Cpu).unwrap(), flat)
    }

    /// The probed forward pass gives the library's EDM losses, and each unit's gradient (from
    /// probes and layer inputs) equals autograd's gradient of that unit's loss alone with
    /// respect to the weights; clipping scales it to norm C, and the summed path adds the
    /// clipped vectors.
    #[test]
    fn per_unit_gradients_match_autograd_and_clip_exactly() {
        let (net, flat) = net();
        let cfg = EdmConfig::default();
        let rows: Vec<Vec<f32>> = (0..4)
            .map(|u| (0..5).map(|j| ((u * 5 + j) as f32 * 0.37).sin()).collect())
            .collect();
        let units: Vec<UnitRows> = rows
            .iter()
            .enumerate()
            .map(|(u, r)| UnitRows {
                unit: 10 + u as u64,
                rows: r,
            })
            .collect();
        let draws = 2;
        let free = unit_gradients(&net, &cfg, &flat, &units, 7, 1, draws, f64::INFINITY).unwrap();
        for (u, g) in &free {
            let r = &rows[(*u - 10) as usize];
            let (sigmas, noise) = unit_noise(&cfg, 1, 7, *u, draws as usize, 5);
            let mut x0 = r.clone();
            x0.extend_from_slice(r);
            let vars: Vec<Var> = net
                .tensors_from_flat(&flat)
                .unwrap()
                .iter()
                .map(|t| Var::from_tensor(t).unwrap())
                .collect();
            let params: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let x = Tensor::from_slice(&x0, (2, 5), &Device::Cpu).unwrap();
            let n = Tensor::from_slice(&noise, (2, 5), &Device::Cpu).unwrap();
            let loss = edm::per_example_loss(&cfg, &net, &params, &x, &sigmas, &n)
                .unwrap()
                .mean_all()
                .unwrap();
            let grads = loss.backward().unwrap();
            let tensors: Vec<Tensor> = vars
                .iter()
                .map(|v| grads.get(v.as_tensor()).unwrap().clone())
                .collect();
            let want = net.flat_from_tensors(&tensors).unwrap();
            let scale = want.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
            for (a, b) in g.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-4 * scale, "unit {u}: {a} vs {b}");
            }
        }
        let norms: Vec<f64> = free
            .iter()
            .map(|(_, g)| g.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt())
            .collect();
        let c = norms.iter().copied().fold(f64::INFINITY, f64::min) * 0.5;
        let clipped = unit_gradients(&net, &cfg, &flat, &units, 7, 1, draws, c).unwrap();
        for ((_, g), n0) in clipped.iter().zip(&norms) {
            let n = g.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            assert!(
                n <= c * (1.0 + 1e-6) && n >= c * 0.999,
                "{n} vs C = {c} (was {n0})"
            );
        }
        let sum = summed_unit_gradients(&net, &cfg, &flat, &units, 7, 1, draws, c).unwrap();
        assert_eq!(sum.norms.len(), 4);
        for (i, s) in sum.sum.iter().enumerate() {
            let want: f64 = clipped.iter().map(|(_, g)| f64::from(g[i])).sum();
            assert!(
                (s - want).abs() <= 1e-5 * c,
                "coordinate {i}: {s} vs {want}"
            );
        }
        // A unit's draws depend on (seed, round, unit) only, not on the other units.
        let alone = unit_gradients(&net, &cfg, &flat, &units[1..2], 7, 1, draws, c).unwrap();
        assert_eq!(alone[0], clipped[1]);
    }
}
