//! Probabilistic dynamics-model ensembles of PriMORL (seed 001, section 4.2 and appendix F.2):
//! N Gaussian models N(mu, Sigma) of `(s' - s, r)` given `(s, a)`, swish MLPs trained by negative
//! log-likelihood with weight decay; the per-trajectory local update of TDP Model Ensemble
//! Training (Algorithms 1-3: E epochs of minibatch SGD from the global ensemble, the ensemble's
//! delta projected onto the clip ball after every step); and the two uncertainty measures of the
//! pessimistic model (section 4.3: max aleatoric, max pairwise mean difference).
//!
//! Parameters travel as one `Vec<f32>`: member 0's layers, then member 1's, ...; each layer is
//! its `[out, in]` weight (PyTorch's row-major layout) then its `[out]` bias. The output layer
//! has `2 (obs_dim + 1)` units: the mean of `(s' - s, r)`, then the raw log-variance, which is
//! softly bounded to `[MIN_LOGVAR, MAX_LOGVAR]` as in MOPO's reference implementation (the
//! bounds are constants here, not learned: they would be extra private parameters for no gain).
//!
//! Local training runs on the CPU as one fused loop per member and trajectory
//! (`crate::ensemble_cpu`); on other devices it stacks many trajectories' copies of the ensemble
//! into `[copies, in, out]` tensors (`copies` = trajectories x members) so that one batched
//! forward/backward serves every trajectory of a round. Either way each copy's gradient comes
//! only from its own trajectory's rows.

use candle_core::{D, DType, Device, Tensor, Var};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

use crate::{NnError, Result};
use fedrl_common::privacy::clipping::{clip_ensemble_flat, clip_ensemble_per_layer};

/// Upper soft bound of a member's predicted log-variance (MOPO's initial `max_logvar`).
pub const MAX_LOGVAR: f32 = 0.5;
/// Lower soft bound of a member's predicted log-variance (MOPO's initial `min_logvar`).
pub const MIN_LOGVAR: f32 = -10.0;

/// Rows per forward pass of [`Ensemble::mse`] (memory, not results: see
/// [`Ensemble::mse_in_chunks`]).
pub const MSE_CHUNK_ROWS: usize = 8192;

/// Shape of a dynamics ensemble and the public normalisation of its inputs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EnsembleSpec {
    /// Observation length.
    pub obs_dim: usize,
    /// Action length.
    pub act_dim: usize,
    /// Hidden layer widths (swish after each), input side first.
    pub hidden: Vec<usize>,
    /// Number of members N.
    pub members: usize,
    /// Input normalisation `(x - offset) / scale` over `obs ++ action` (length
    /// `obs_dim + act_dim`), computed from public data only (the public split or the
    /// environment's documented ranges), never from the private trajectories.
    pub input_offset: Vec<f32>,
    /// See `input_offset`; every scale must be positive.
    pub input_scale: Vec<f32>,
    /// Target normalisation: the members learn `(s' - s, r) / output_scale` per component
    /// (length `obs_dim + 1`), and [`Ensemble::predict`] and [`Ensemble::step`] answer in raw
    /// units. Computed from public data only. Empty (the default, and in files written before
    /// it existed): raw targets.
    #[serde(default)]
    pub output_scale: Vec<f32>,
}

pub use fedrl_common::task::primorl::{EnsembleClipping, Uncertainty};

impl EnsembleSpec {
    /// An ensemble with identity input normalisation.
    pub fn new(obs_dim: usize, act_dim: usize, hidden: Vec<usize>, members: usize) -> Self {
        EnsembleSpec {
            obs_dim,
            act_dim,
            hidden,
            members,
            input_offset: vec![0.0; obs_dim + act_dim],
            input_scale: vec![1.0; obs_dim + act_dim],
            output_scale: Vec::new(),
        }
    }

    /// Input width: `obs_dim + act_dim`.
    pub fn in_dim(&self) -> usize {
        self.obs_dim + self.act_dim
    }

    /// Width of the predicted target `(s' - s, r)`: `obs_dim + 1`.
    pub fn out_dim(&self) -> usize {
        self.obs_dim + 1
    }

    /// Layer widths of one member, input to output (the last is `2 out_dim`).
    pub fn widths(&self) -> Vec<usize> {
        let mut w = Vec::with_capacity(self.hidden.len() + 2);
        w.push(self.in_dim());
        w.extend_from_slice(&self.hidden);
        w.push(2 * self.out_dim());
        w
    }

    /// Parameter count of each of one member's linear layers (weight and bias together).
    pub fn layer_sizes(&self) -> Vec<usize> {
        self.widths()
            .windows(2)
            .map(|p| p[0] * p[1] + p[1])
            .collect()
    }

    /// Parameters of one member.
    pub fn member_len(&self) -> usize {
        self.layer_sizes().iter().sum()
    }

    /// Parameters of the whole ensemble.
    pub fn len(&self) -> usize {
        self.members * self.member_len()
    }

    /// Whether the ensemble has no parameters (never true for a checked spec).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks the dimensions and the normalisation.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(NnError::Invalid(format!("ensemble: {m}")));
        if self.obs_dim == 0 || self.act_dim == 0 {
            return bad("observation and action lengths must be positive".into());
        }
        if self.members == 0 {
            return bad("at least one member".into());
        }
        if self.hidden.contains(&0) {
            return bad(format!(
                "hidden widths must be positive, got {:?}",
                self.hidden
            ));
        }
        let n = self.in_dim();
        if self.input_offset.len() != n || self.input_scale.len() != n {
            return bad(format!(
                "input normalisation needs {n} offsets and scales, got {} and {}",
                self.input_offset.len(),
                self.input_scale.len()
            ));
        }
        if self.input_offset.iter().any(|v| !v.is_finite())
            || self
                .input_scale
                .iter()
                .any(|v| !(v.is_finite() && *v > 0.0))
        {
            return bad("input offsets must be finite and scales finite and positive".into());
        }
        if !self.output_scale.is_empty() && self.output_scale.len() != self.out_dim() {
            return bad(format!(
                "output normalisation needs {} scales, got {}",
                self.out_dim(),
                self.output_scale.len()
            ));
        }
        if self
            .output_scale
            .iter()
            .any(|v| !(v.is_finite() && *v > 0.0))
        {
            return bad("output scales must be finite and positive".into());
        }
        Ok(())
    }

    /// Seeded initial parameters: weights from a normal of standard deviation `1 / (2
    /// sqrt(fan_in))` truncated at two standard deviations (MOPO's initialiser), biases zero.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut out = Vec::with_capacity(self.len());
        for _ in 0..self.members {
            for p in self.widths().windows(2) {
                let std = 1.0 / (2.0 * (p[0] as f64).sqrt());
                for _ in 0..p[0] * p[1] {
                    let z = loop {
                        let z: f64 = StandardNormal.sample(&mut rng);
                        if z.abs() <= 2.0 {
                            break z;
                        }
                    };
                    out.push((z * std) as f32);
                }
                out.extend(std::iter::repeat_n(0.0f32, p[1]));
            }
        }
        out
    }

    /// Normalised model input of one `(obs, action)` pair, appended to `out`.
    fn push_input(&self, obs: &[f32], act: &[f32], out: &mut Vec<f32>) {
        let raw = obs.iter().chain(act);
        for ((x, o), s) in raw.zip(&self.input_offset).zip(&self.input_scale) {
            out.push((x - o) / s);
        }
    }
}

/// One trajectory's training rows: normalised inputs `(s, a)` and targets `(s' - s, r)`
/// (divided by the spec's `output_scale` when it has one).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelRows {
    /// `rows x in_dim`, normalised with the spec's public offsets and scales.
    pub inputs: Vec<f32>,
    /// `rows x out_dim`, in the units the members learn (see `EnsembleSpec::output_scale`).
    pub targets: Vec<f32>,
}

impl ModelRows {
    /// The rows of transitions `(obs[t], act[t], reward[t], next_obs[t])`, given as flat arrays
    /// of `n` rows each.
    pub fn from_transitions(
        spec: &EnsembleSpec,
        obs: &[f32],
        act: &[f32],
        rewards: &[f32],
        next_obs: &[f32],
    ) -> Result<Self> {
        let (d, a) = (spec.obs_dim, spec.act_dim);
        let n = rewards.len();
        if obs.len() != n * d || next_obs.len() != n * d || act.len() != n * a {
            return Err(NnError::Invalid(format!(
                "ensemble rows: {n} rewards need {} observation and {} action values, got {}, {} and {}",
                n * d,
                n * a,
                obs.len(),
                next_obs.len(),
                act.len()
            )));
        }
        let mut rows = ModelRows {
            inputs: Vec::with_capacity(n * spec.in_dim()),
            targets: Vec::with_capacity(n * spec.out_dim()),
        };
        for t in 0..n {
            let s = &obs[t * d..(t + 1) * d];
            spec.push_input(s, &act[t * a..(t + 1) * a], &mut rows.inputs);
            let s2 = &next_obs[t * d..(t + 1) * d];
            let start = rows.targets.len();
            rows.targets.extend(s2.iter().zip(s).map(|(x2, x)| x2 - x));
            rows.targets.push(rewards[t]);
            for (y, sc) in rows.targets[start..].iter_mut().zip(&spec.output_scale) {
                *y /= sc;
            }
        }
        Ok(rows)
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// Number of rows given the spec's widths.
    pub fn rows(&self, spec: &EnsembleSpec) -> usize {
        self.targets.len() / spec.out_dim()
    }
}

/// Hyper-parameters of a trajectory's local update (seed 001, Table 5).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LocalModelConfig {
    /// Local epochs E over the trajectory.
    pub epochs: usize,
    /// Minibatch size B (rows).
    pub batch_size: usize,
    /// SGD step size eta.
    pub lr: f64,
    /// L2 weight decay: `weight_decay / 2 * |W|^2` summed over weight matrices joins the loss.
    pub weight_decay: f64,
    /// Ensemble clip norm C (L2, over the whole ensemble's delta).
    pub clip_norm: f64,
    pub clipping: EnsembleClipping,
}

impl Default for LocalModelConfig {
    /// Seed 001's Table 5 for CartPole and Pendulum (E = 1, B = 16, eta = 1e-3), flat clipping.
    fn default() -> Self {
        LocalModelConfig {
            epochs: 1,
            batch_size: 16,
            lr: 1e-3,
            weight_decay: 5e-5,
            clip_norm: 1.0,
            clipping: EnsembleClipping::Flat,
        }
    }
}

/// One trajectory's local result.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalModelUpdate {
    /// The ensemble delta (local minus global), already within the clip ball.
    pub delta: Vec<f32>,
    /// SGD steps taken.
    pub steps: usize,
    /// Mean NLL of the trajectory's minibatches over its first epoch (per output component).
    pub first_epoch_loss: f64,
}

/// Stacked weights `[copies, in, out]` and biases `[copies, 1, out]` of many ensemble copies.
struct Stack {
    w: Vec<Var>,
    b: Vec<Var>,
}

impl Stack {
    /// Copies `c = g N + i` hold member `i` of `flats[g]`.
    fn new(spec: &EnsembleSpec, flats: &[&[f32]], dtype: DType, device: &Device) -> Result<Self> {
        let widths = spec.widths();
        let n = spec.members;
        let copies = flats.len() * n;
        let member = spec.member_len();
        let mut w = Vec::new();
        let mut b = Vec::new();
        let mut off = 0;
        for p in widths.windows(2) {
            let (fan_in, fan_out) = (p[0], p[1]);
            let mut wv = Vec::with_capacity(copies * fan_in * fan_out);
            let mut bv = Vec::with_capacity(copies * fan_out);
            for flat in flats {
                for i in 0..n {
                    let base = i * member + off;
                    wv.extend_from_slice(&flat[base..base + fan_in * fan_out]);
                    let bb = base + fan_in * fan_out;
                    bv.extend_from_slice(&flat[bb..bb + fan_out]);
                }
            }
            off += fan_in * fan_out + fan_out;
            // Flat weights are [out, in]; the stack keeps [in, out] for x W.
            let wt = Tensor::from_vec(wv, (copies, fan_out, fan_in), device)?
                .transpose(1, 2)?
                .contiguous()?
                .to_dtype(dtype)?;
            let bt = Tensor::from_vec(bv, (copies, 1, fan_out), device)?.to_dtype(dtype)?;
            w.push(Var::from_tensor(&wt)?);
            b.push(Var::from_tensor(&bt)?);
        }
        Ok(Stack { w, b })
    }

    /// Copy `g`'s whole ensemble as a flat vector (members `g N .. (g + 1) N`).
    fn flats(&self, spec: &EnsembleSpec, groups: usize) -> Result<Vec<Vec<f32>>> {
        let n = spec.members;
        let layers: Vec<(Vec<f32>, Vec<f32>)> = self
            .w
            .iter()
            .zip(&self.b)
            .map(|(w, b)| {
                let wv = w
                    .as_tensor()
                    .transpose(1, 2)?
                    .contiguous()?
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let bv = b
                    .as_tensor()
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                Ok((wv, bv))
            })
            .collect::<candle_core::Result<_>>()?;
        let widths = spec.widths();
        let mut out = vec![Vec::with_capacity(spec.len()); groups];
        for (g, flat) in out.iter_mut().enumerate() {
            for i in 0..n {
                let c = g * n + i;
                for (p, (wv, bv)) in widths.windows(2).zip(&layers) {
                    let (wl, bl) = (p[0] * p[1], p[1]);
                    flat.extend_from_slice(&wv[c * wl..(c + 1) * wl]);
                    flat.extend_from_slice(&bv[c * bl..(c + 1) * bl]);
                }
            }
        }
        Ok(out)
    }
}

/// `softplus(x) = max(x, 0) + log(1 + exp(-|x|))`, stable for any x.
fn softplus(x: &Tensor) -> candle_core::Result<Tensor> {
    x.relu()?
        .add(&x.abs()?.neg()?.exp()?.affine(1.0, 1.0)?.log()?)
}

/// Mean and bounded log-variance `[copies, rows, out_dim]` of every copy on its inputs
/// `[copies, rows, in_dim]`.
fn forward(
    stack_w: &[Tensor],
    stack_b: &[Tensor],
    x: &Tensor,
    out_dim: usize,
) -> candle_core::Result<(Tensor, Tensor)> {
    let mut h = x.clone();
    let last = stack_w.len() - 1;
    for (l, (w, b)) in stack_w.iter().zip(stack_b).enumerate() {
        h = h.matmul(w)?.broadcast_add(b)?;
        if l < last {
            h = h.silu()?;
        }
    }
    let mean = h.narrow(D::Minus1, 0, out_dim)?;
    let raw = h.narrow(D::Minus1, out_dim, out_dim)?;
    let logvar =
        softplus(&raw.affine(-1.0, f64::from(MAX_LOGVAR))?)?.affine(-1.0, f64::from(MAX_LOGVAR))?;
    let logvar = softplus(&logvar.affine(1.0, -f64::from(MIN_LOGVAR))?)?
        .affine(1.0, f64::from(MIN_LOGVAR))?;
    Ok((mean, logvar))
}

/// The training loss summed over copies: each copy's weighted mean over rows of the Gaussian
/// NLL (up to constants, `mean over components of (mu - y)^2 exp(-logvar) + logvar`), plus
/// `weight_decay / 2 |W|^2` over its weight matrices when the copy is active.
///
/// `row_w` is `[copies, rows, 1]` (0 for padding), `active` is `[copies]` (1 for a copy with a
/// minibatch this step). Returns the total and each copy's NLL (`[copies]`, no weight decay).
#[allow(clippy::too_many_arguments)]
fn loss(
    w: &[Tensor],
    b: &[Tensor],
    x: &Tensor,
    y: &Tensor,
    row_w: &Tensor,
    active: &Tensor,
    out_dim: usize,
    weight_decay: f64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (mean, logvar) = forward(w, b, x, out_dim)?;
    let per = mean
        .sub(y)?
        .sqr()?
        .mul(&logvar.neg()?.exp()?)?
        .add(&logvar)?
        .mean_keepdim(D::Minus1)?; // [copies, rows, 1]
    let count = row_w.sum(1)?.squeeze(D::Minus1)?.maximum(1.0)?; // [copies]
    let nll = per.mul(row_w)?.sum(1)?.squeeze(D::Minus1)?.div(&count)?; // [copies]
    let mut total = nll.sum_all()?;
    if weight_decay > 0.0 {
        let mut sq = w[0].sqr()?.sum((1, 2))?;
        for wl in &w[1..] {
            sq = sq.add(&wl.sqr()?.sum((1, 2))?)?;
        }
        total = total.add(&sq.mul(active)?.sum_all()?.affine(0.5 * weight_decay, 0.0)?)?;
    }
    Ok((total, nll))
}

/// The mean loss of one ensemble on `rows` (all rows in one batch) and its gradient with respect
/// to `params`, computed in `dtype` (F64 for finite-difference checks). The loss is summed over
/// members, as in training.
pub fn nll_and_grad(
    spec: &EnsembleSpec,
    params: &[f32],
    rows: &ModelRows,
    weight_decay: f64,
    dtype: DType,
    device: &Device,
) -> Result<(f64, Vec<f64>)> {
    spec.check()?;
    check_params(spec, params)?;
    let n_rows = rows.rows(spec);
    let n = spec.members;
    let stack = Stack::new(spec, &[params], dtype, device)?;
    let x = Tensor::from_vec(rows.inputs.clone(), (1, n_rows, spec.in_dim()), device)?
        .to_dtype(dtype)?
        .broadcast_as((n, n_rows, spec.in_dim()))?
        .contiguous()?;
    let y = Tensor::from_vec(rows.targets.clone(), (1, n_rows, spec.out_dim()), device)?
        .to_dtype(dtype)?
        .broadcast_as((n, n_rows, spec.out_dim()))?
        .contiguous()?;
    let row_w = Tensor::ones((n, n_rows, 1), dtype, device)?;
    let active = Tensor::ones(n, dtype, device)?;
    let w: Vec<Tensor> = stack.w.iter().map(|v| v.as_tensor().clone()).collect();
    let b: Vec<Tensor> = stack.b.iter().map(|v| v.as_tensor().clone()).collect();
    let (total, _) = loss(
        &w,
        &b,
        &x,
        &y,
        &row_w,
        &active,
        spec.out_dim(),
        weight_decay,
    )?;
    let grads = total.backward()?;
    // Gradient in the flat layout: per member, per layer, weight [out, in] then bias.
    let mut layer_grads = Vec::new();
    for (wv, bv) in stack.w.iter().zip(&stack.b) {
        let gw = grads
            .get(wv.as_tensor())
            .ok_or_else(|| NnError::Invalid("ensemble: missing weight gradient".into()))?
            .transpose(1, 2)?
            .contiguous()?
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1::<f64>()?;
        let gb = grads
            .get(bv.as_tensor())
            .ok_or_else(|| NnError::Invalid("ensemble: missing bias gradient".into()))?
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1::<f64>()?;
        layer_grads.push((gw, gb));
    }
    let widths = spec.widths();
    let mut flat = Vec::with_capacity(spec.len());
    for i in 0..n {
        for (p, (gw, gb)) in widths.windows(2).zip(&layer_grads) {
            let (wl, bl) = (p[0] * p[1], p[1]);
            flat.extend_from_slice(&gw[i * wl..(i + 1) * wl]);
            flat.extend_from_slice(&gb[i * bl..(i + 1) * bl]);
        }
    }
    let value = total.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok((value, flat))
}

fn check_params(spec: &EnsembleSpec, params: &[f32]) -> Result<()> {
    if params.len() != spec.len() {
        return Err(NnError::Invalid(format!(
            "ensemble: expected {} parameters, got {}",
            spec.len(),
            params.len()
        )));
    }
    Ok(())
}

/// Per-step record of the projection, for tests and diagnostics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClipTrace {
    /// After every SGD step's projection: the largest ratio, over every trajectory's segments
    /// (members for flat clipping, member layers for per-layer), of the segment's delta norm to
    /// its bound. At most 1 (up to f32 rounding) when the projection works.
    pub max_ratio_per_step: Vec<f64>,
}

/// The local updates of a group of trajectories (seed 001, Algorithm 2's `EnsClipGD`), trained
/// together: each starts from `global`, runs `cfg.epochs` epochs of minibatch SGD over its own
/// rows (shuffled by its own seed), and after every step its ensemble delta is projected onto
/// the clip ball. The final deltas are clipped once more with the exact f64 clip of
/// `fedrl-common` (a hard bound whatever f32 rounding did in the loop).
///
/// With `trace`, also returns the projection's per-step bound ratios.
///
/// On the CPU this runs the fused per-member loop of [`crate::ensemble_cpu`]; on other devices
/// the batched tensor path ([`local_updates_on_tensors`]). The two agree up to f32 rounding.
pub fn local_updates(
    spec: &EnsembleSpec,
    cfg: &LocalModelConfig,
    global: &[f32],
    trajectories: &[&ModelRows],
    seeds: &[u64],
    device: &Device,
    trace: bool,
) -> Result<(Vec<LocalModelUpdate>, ClipTrace)> {
    if !device.is_cpu() {
        return local_updates_on_tensors(spec, cfg, global, trajectories, seeds, device, trace);
    }
    let Some(plan) = LocalPlan::new(spec, cfg, global, trajectories, seeds)? else {
        return Ok((Vec::new(), ClipTrace::default()));
    };
    let n = spec.members;
    let member = spec.member_len();
    let widths = spec.widths();
    let job = crate::ensemble_cpu::Job {
        widths: &widths,
        lr: cfg.lr as f32,
        weight_decay: cfg.weight_decay as f32,
        clipping: cfg.clip_norm.is_finite().then_some(cfg.clipping),
        bound: segment_bound(spec, cfg),
        trace,
    };
    let tasks: Vec<crate::ensemble_cpu::MemberTask<'_>> = trajectories
        .iter()
        .zip(&plan.batches)
        .zip(&plan.first_epoch_batches)
        .flat_map(|((t, batches), &fe)| {
            (0..n).map(move |i| crate::ensemble_cpu::MemberTask {
                start: &global[i * member..(i + 1) * member],
                inputs: &t.inputs,
                targets: &t.targets,
                plan: batches,
                first_epoch_steps: fe,
            })
        })
        .collect();
    let runs = crate::ensemble_cpu::train_members(&job, &tasks);
    let mut clip_trace = ClipTrace::default();
    if trace && job.clipping.is_some() {
        // A copy that has run out of minibatches keeps its last ratio, as in the tensor path.
        clip_trace.max_ratio_per_step = (0..plan.steps)
            .map(|s| {
                runs.iter()
                    .filter_map(|r| r.ratios.get(s.min(r.ratios.len().saturating_sub(1))))
                    .fold(0.0f64, |a, &b| a.max(b))
            })
            .collect();
    }
    let mut flats = Vec::with_capacity(trajectories.len());
    let mut loss_sums = Vec::with_capacity(trajectories.len());
    for group in runs.chunks(n) {
        flats.push(group.iter().flat_map(|r| r.flat.iter().copied()).collect());
        loss_sums.push(group.iter().map(|r| r.first_epoch_nll).sum::<f64>() / n as f64);
    }
    Ok((
        plan.finish(spec, cfg, global, flats, &loss_sums)?,
        clip_trace,
    ))
}

/// Each trajectory's minibatches for one call of the local update.
struct LocalPlan {
    /// Per trajectory: E epochs of its own shuffled rows, split into B-row batches.
    batches: Vec<Vec<Vec<usize>>>,
    /// Per trajectory: the number of batches in its first epoch.
    first_epoch_batches: Vec<usize>,
    /// The longest trajectory's number of steps.
    steps: usize,
}

impl LocalPlan {
    /// Checks the arguments and draws the minibatches; `None` when there is no trajectory.
    fn new(
        spec: &EnsembleSpec,
        cfg: &LocalModelConfig,
        global: &[f32],
        trajectories: &[&ModelRows],
        seeds: &[u64],
    ) -> Result<Option<Self>> {
        spec.check()?;
        check_params(spec, global)?;
        if seeds.len() != trajectories.len() {
            return Err(NnError::Invalid(format!(
                "ensemble: {} trajectories but {} seeds",
                trajectories.len(),
                seeds.len()
            )));
        }
        if cfg.epochs == 0 || cfg.batch_size == 0 || !(cfg.lr.is_finite() && cfg.lr > 0.0) {
            return Err(NnError::Invalid(
                "ensemble: epochs, batch size and learning rate must be positive".into(),
            ));
        }
        // +inf: no projection (seed 001's "No Clip" variant, or a non-private twin).
        if cfg.clip_norm.is_nan() || cfg.clip_norm <= 0.0 {
            return Err(NnError::Invalid(
                "ensemble: the clip norm must be positive".into(),
            ));
        }
        if trajectories.is_empty() {
            return Ok(None);
        }
        let (din, dout, bsz) = (spec.in_dim(), spec.out_dim(), cfg.batch_size);
        for t in trajectories {
            if t.inputs.len() % din != 0
                || t.rows(spec) * din != t.inputs.len()
                || t.targets.len() % dout != 0
            {
                return Err(NnError::Invalid(
                    "ensemble: a trajectory's inputs and targets do not match the spec".into(),
                ));
            }
        }
        // Each trajectory's minibatches: E epochs of its own shuffled rows, split into B-row batches.
        let plans: Vec<Vec<Vec<usize>>> = trajectories
            .iter()
            .zip(seeds)
            .map(|(t, &seed)| {
                let rows = t.rows(spec);
                let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
                let mut batches = Vec::new();
                for _ in 0..cfg.epochs {
                    let mut perm: Vec<usize> = (0..rows).collect();
                    perm.shuffle(&mut rng);
                    batches.extend(perm.chunks(bsz).map(<[usize]>::to_vec));
                }
                batches
            })
            .collect();
        let steps = plans.iter().map(Vec::len).max().unwrap_or(0);
        let first_epoch_batches: Vec<usize> = trajectories
            .iter()
            .map(|t| t.rows(spec).div_ceil(bsz))
            .collect();
        Ok(Some(LocalPlan {
            batches: plans,
            first_epoch_batches,
            steps,
        }))
    }

    /// Each trajectory's delta (trained minus `global`), clipped once more with the exact f64
    /// clip of `fedrl-common` (a hard bound whatever f32 rounding did in the loop).
    fn finish(
        &self,
        spec: &EnsembleSpec,
        cfg: &LocalModelConfig,
        global: &[f32],
        flats: Vec<Vec<f32>>,
        loss_sums: &[f64],
    ) -> Result<Vec<LocalModelUpdate>> {
        let n = spec.members;
        let mut out = Vec::with_capacity(flats.len());
        for (g, flat) in flats.into_iter().enumerate() {
            let mut delta: Vec<f32> = flat.iter().zip(global).map(|(a, b)| a - b).collect();
            if cfg.clip_norm.is_finite() {
                match cfg.clipping {
                    EnsembleClipping::Flat => clip_ensemble_flat(&mut delta, n, cfg.clip_norm),
                    EnsembleClipping::PerLayer => {
                        clip_ensemble_per_layer(&mut delta, n, &spec.layer_sizes(), cfg.clip_norm)
                    }
                }
                .map_err(|e| NnError::Invalid(format!("ensemble clip: {e}")))?;
            }
            out.push(LocalModelUpdate {
                delta,
                steps: self.batches[g].len(),
                first_epoch_loss: loss_sums[g] / self.first_epoch_batches[g].max(1) as f64,
            });
        }
        Ok(out)
    }
}

/// [`local_updates`] as batched tensor operations on any device: every trajectory's copy of the
/// ensemble stacked into `[copies, in, out]` tensors (`copies` = trajectories x members), one
/// batched forward/backward per step. The path for accelerators, and the CPU path's reference
/// in tests.
pub fn local_updates_on_tensors(
    spec: &EnsembleSpec,
    cfg: &LocalModelConfig,
    global: &[f32],
    trajectories: &[&ModelRows],
    seeds: &[u64],
    device: &Device,
    trace: bool,
) -> Result<(Vec<LocalModelUpdate>, ClipTrace)> {
    let Some(plan) = LocalPlan::new(spec, cfg, global, trajectories, seeds)? else {
        return Ok((Vec::new(), ClipTrace::default()));
    };
    let clipped = cfg.clip_norm.is_finite();
    let groups = trajectories.len();
    let (n, dout, bsz) = (spec.members, spec.out_dim(), cfg.batch_size);
    let din = spec.in_dim();
    let copies = groups * n;
    let (plans, steps) = (&plan.batches, plan.steps);
    let first_epoch_batches = &plan.first_epoch_batches;
    let max_first_epoch = first_epoch_batches.iter().copied().max().unwrap_or(0);

    let start = Stack::new(spec, &vec![global; groups], DType::F32, device)?;
    let w0: Vec<Tensor> = start.w.iter().map(|v| v.as_tensor().clone()).collect();
    let b0: Vec<Tensor> = start.b.iter().map(|v| v.as_tensor().clone()).collect();
    let stack = Stack::new(spec, &vec![global; groups], DType::F32, device)?;
    let n_layers = w0.len();
    let bounds = segment_bound(spec, cfg);
    let mut clip_trace = ClipTrace::default();
    let mut loss_sums = vec![0.0f64; groups];

    let mut xs = vec![0.0f32; groups * bsz * din];
    let mut ys = vec![0.0f32; groups * bsz * dout];
    let mut ws = vec![0.0f32; groups * bsz];
    let mut act = vec![0.0f32; groups];
    for step in 0..steps {
        xs.fill(0.0);
        ys.fill(0.0);
        ws.fill(0.0);
        act.fill(0.0);
        for (g, (plan, t)) in plans.iter().zip(trajectories).enumerate() {
            let Some(batch) = plan.get(step) else {
                continue;
            };
            act[g] = 1.0;
            for (k, &r) in batch.iter().enumerate() {
                let o = g * bsz + k;
                xs[o * din..(o + 1) * din].copy_from_slice(&t.inputs[r * din..(r + 1) * din]);
                ys[o * dout..(o + 1) * dout].copy_from_slice(&t.targets[r * dout..(r + 1) * dout]);
                ws[o] = 1.0;
            }
        }
        // Every member of a trajectory sees the same minibatch.
        let expand = |v: &[f32], width: usize| -> candle_core::Result<Tensor> {
            Tensor::from_slice(v, (groups, 1, bsz, width), device)?
                .broadcast_as((groups, n, bsz, width))?
                .reshape((copies, bsz, width))
        };
        let x = expand(&xs, din)?;
        let y = expand(&ys, dout)?;
        let row_w = expand(&ws, 1)?;
        let active = Tensor::from_slice(&act, (groups, 1), device)?
            .broadcast_as((groups, n))?
            .reshape(copies)?;
        let w: Vec<Tensor> = stack.w.iter().map(|v| v.as_tensor().clone()).collect();
        let b: Vec<Tensor> = stack.b.iter().map(|v| v.as_tensor().clone()).collect();
        let (total, nll) = loss(&w, &b, &x, &y, &row_w, &active, dout, cfg.weight_decay)?;
        if step < max_first_epoch {
            let nll = nll.to_dtype(DType::F64)?.to_vec1::<f64>()?;
            for (g, &fe) in first_epoch_batches.iter().enumerate() {
                if step < fe {
                    loss_sums[g] += nll[g * n..(g + 1) * n].iter().sum::<f64>() / n as f64;
                }
            }
        }
        let grads = total.backward()?;
        // SGD, then projection of each copy's delta onto its clip ball.
        let mut new_w = Vec::with_capacity(n_layers);
        let mut new_b = Vec::with_capacity(n_layers);
        for (wv, bv) in stack.w.iter().zip(&stack.b) {
            let gw = grads.get(wv.as_tensor());
            let gb = grads.get(bv.as_tensor());
            let w1 = match gw {
                Some(g) => wv.as_tensor().sub(&g.affine(cfg.lr, 0.0)?)?,
                None => wv.as_tensor().clone(),
            };
            let b1 = match gb {
                Some(g) => bv.as_tensor().sub(&g.affine(cfg.lr, 0.0)?)?,
                None => bv.as_tensor().clone(),
            };
            new_w.push(w1);
            new_b.push(b1);
        }
        if !clipped {
            for l in 0..n_layers {
                stack.w[l].set(&new_w[l])?;
                stack.b[l].set(&new_b[l])?;
            }
            continue;
        }
        let dw: Vec<Tensor> = new_w
            .iter()
            .zip(&w0)
            .map(|(a, b)| a.sub(b))
            .collect::<candle_core::Result<_>>()?;
        let db: Vec<Tensor> = new_b
            .iter()
            .zip(&b0)
            .map(|(a, b)| a.sub(b))
            .collect::<candle_core::Result<_>>()?;
        // Squared norm of every (copy, layer) segment: [copies, L].
        let layer_sq: Vec<Tensor> = dw
            .iter()
            .zip(&db)
            .map(|(w, b)| w.sqr()?.sum((1, 2))?.add(&b.sqr()?.sum((1, 2))?))
            .collect::<candle_core::Result<_>>()?;
        let layer_sq = Tensor::stack(&layer_sq, 1)?;
        let factors = match cfg.clipping {
            EnsembleClipping::Flat => {
                let norm = layer_sq.sum_keepdim(1)?.sqrt()?; // [copies, 1]
                let f = norm
                    .maximum(1e-30)?
                    .recip()?
                    .affine(bounds, 0.0)?
                    .minimum(1.0)?;
                f.broadcast_as((copies, n_layers))?.contiguous()?
            }
            EnsembleClipping::PerLayer => {
                let norm = layer_sq.sqrt()?;
                norm.maximum(1e-30)?
                    .recip()?
                    .affine(bounds, 0.0)?
                    .minimum(1.0)?
            }
        };
        for l in 0..n_layers {
            let f = factors.narrow(1, l, 1)?.reshape((copies, 1, 1))?;
            stack.w[l].set(&w0[l].add(&dw[l].broadcast_mul(&f)?)?)?;
            stack.b[l].set(&b0[l].add(&db[l].broadcast_mul(&f)?)?)?;
        }
        if trace {
            let mut sq = Vec::with_capacity(n_layers);
            for l in 0..n_layers {
                let d_w = stack.w[l].as_tensor().sub(&w0[l])?;
                let d_b = stack.b[l].as_tensor().sub(&b0[l])?;
                sq.push(d_w.sqr()?.sum((1, 2))?.add(&d_b.sqr()?.sum((1, 2))?)?);
            }
            let sq = Tensor::stack(&sq, 1)?.to_dtype(DType::F64)?;
            let seg = match cfg.clipping {
                EnsembleClipping::Flat => sq.sum(1)?.sqrt()?.flatten_all()?,
                EnsembleClipping::PerLayer => sq.sqrt()?.flatten_all()?,
            };
            let max = seg.to_vec1::<f64>()?.into_iter().fold(0.0f64, f64::max);
            clip_trace.max_ratio_per_step.push(max / bounds);
        }
    }

    let flats = stack.flats(spec, groups)?;
    Ok((
        plan.finish(spec, cfg, global, flats, &loss_sums)?,
        clip_trace,
    ))
}

/// The bound of one clip segment: C / sqrt(N) (flat) or C / sqrt(N L) (per layer).
fn segment_bound(spec: &EnsembleSpec, cfg: &LocalModelConfig) -> f64 {
    let segs = match cfg.clipping {
        EnsembleClipping::Flat => spec.members,
        EnsembleClipping::PerLayer => spec.members * spec.layer_sizes().len(),
    };
    cfg.clip_norm / (segs as f64).sqrt()
}

/// An ensemble's predictions for a batch of rows: `mean` and `logvar` are laid out
/// `[member][row][out_dim]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    pub members: usize,
    pub rows: usize,
    pub out_dim: usize,
    pub mean: Vec<f32>,
    pub logvar: Vec<f32>,
}

impl Prediction {
    fn at<'a>(&self, v: &'a [f32], member: usize, row: usize) -> &'a [f32] {
        let o = (member * self.rows + row) * self.out_dim;
        &v[o..o + self.out_dim]
    }

    /// Member `i`'s mean of `(s' - s, r)` at row `r`.
    pub fn mean_of(&self, member: usize, row: usize) -> &[f32] {
        self.at(&self.mean, member, row)
    }

    /// Member `i`'s bounded log-variance at row `r`.
    pub fn logvar_of(&self, member: usize, row: usize) -> &[f32] {
        self.at(&self.logvar, member, row)
    }

    /// The uncertainty `u` of every row, in the prediction's units.
    pub fn uncertainty(&self, kind: Uncertainty) -> Vec<f64> {
        self.uncertainty_scaled(kind, &[])
    }

    /// The uncertainty `u` of every row with component `k` divided by `scale[k]` (means) and
    /// `scale[k]^2` (variances) before the norms are taken; an empty `scale` divides by 1.
    pub fn uncertainty_scaled(&self, kind: Uncertainty, scale: &[f32]) -> Vec<f64> {
        let inv: Vec<f64> = (0..self.out_dim)
            .map(|k| scale.get(k).map_or(1.0, |s| 1.0 / f64::from(*s)))
            .collect();
        (0..self.rows)
            .map(|r| match kind {
                Uncertainty::MaxAleatoric => (0..self.members)
                    .map(|i| {
                        self.logvar_of(i, r)
                            .iter()
                            .zip(&inv)
                            .map(|(&lv, w)| f64::from(lv).exp() * w * w) // sigma^2
                            .sum::<f64>()
                            .sqrt()
                    })
                    .fold(0.0, f64::max),
                Uncertainty::MaxPairwiseDiff => {
                    let mut best = 0.0f64;
                    for i in 0..self.members {
                        for j in i + 1..self.members {
                            let d: f64 = self
                                .mean_of(i, r)
                                .iter()
                                .zip(self.mean_of(j, r))
                                .zip(&inv)
                                .map(|((a, b), w)| ((f64::from(*a) - f64::from(*b)) * w).powi(2))
                                .sum();
                            best = best.max(d.sqrt());
                        }
                    }
                    best
                }
            })
            .collect()
    }
}

/// A released ensemble, stacked on a device for prediction.
pub struct Ensemble {
    spec: EnsembleSpec,
    w: Vec<Tensor>,
    b: Vec<Tensor>,
    device: Device,
}

/// One step of the pessimistic model for a batch of rows.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelStep {
    /// `rows x obs_dim`: `s + (sampled s' - s)` from one uniformly drawn member per row.
    pub next_obs: Vec<f32>,
    /// The sampled reward minus `lambda u(s, a)`.
    pub reward: Vec<f32>,
    /// The uncertainty `u(s, a)` of each row.
    pub uncertainty: Vec<f64>,
}

impl Ensemble {
    /// The ensemble with flat parameters `params` on `device`.
    pub fn new(spec: &EnsembleSpec, params: &[f32], device: &Device) -> Result<Self> {
        spec.check()?;
        check_params(spec, params)?;
        let stack = Stack::new(spec, &[params], DType::F32, device)?;
        Ok(Ensemble {
            spec: spec.clone(),
            w: stack.w.iter().map(|v| v.as_tensor().clone()).collect(),
            b: stack.b.iter().map(|v| v.as_tensor().clone()).collect(),
            device: device.clone(),
        })
    }

    pub fn spec(&self) -> &EnsembleSpec {
        &self.spec
    }

    /// Every member's prediction on `rows`' inputs, in one forward pass (in the units the
    /// members learn, like the rows' targets).
    pub fn predict_rows(&self, rows: &ModelRows) -> Result<Prediction> {
        self.predict_inputs(rows.inputs.clone())
    }

    /// Every member's prediction on normalised `inputs` (`rows x in_dim`).
    fn predict_inputs(&self, inputs: Vec<f32>) -> Result<Prediction> {
        let (n, din, dout) = (self.spec.members, self.spec.in_dim(), self.spec.out_dim());
        let rows = inputs.len() / din;
        let x = Tensor::from_vec(inputs, (1, rows, din), &self.device)?
            .broadcast_as((n, rows, din))?
            .contiguous()?;
        let (mean, logvar) = forward(&self.w, &self.b, &x, dout)?;
        Ok(Prediction {
            members: n,
            rows,
            out_dim: dout,
            mean: mean.flatten_all()?.to_vec1::<f32>()?,
            logvar: logvar.flatten_all()?.to_vec1::<f32>()?,
        })
    }

    /// Every member's prediction of `(s' - s, r)` for rows of raw observations and actions, in
    /// raw units.
    pub fn predict(&self, obs: &[f32], act: &[f32]) -> Result<Prediction> {
        let (d, a) = (self.spec.obs_dim, self.spec.act_dim);
        let rows = obs.len() / d;
        if obs.len() != rows * d || act.len() != rows * a {
            return Err(NnError::Invalid(format!(
                "ensemble: {} observation and {} action values do not make rows of {d} and {a}",
                obs.len(),
                act.len()
            )));
        }
        let mut inputs = Vec::with_capacity(rows * self.spec.in_dim());
        for r in 0..rows {
            self.spec.push_input(
                &obs[r * d..(r + 1) * d],
                &act[r * a..(r + 1) * a],
                &mut inputs,
            );
        }
        let mut p = self.predict_inputs(inputs)?;
        // Back to raw units: a mean scales with the component, a log-variance shifts by twice
        // the log of the scale.
        if !self.spec.output_scale.is_empty() {
            let shift: Vec<f32> = self
                .spec
                .output_scale
                .iter()
                .map(|s| 2.0 * s.ln())
                .collect();
            for (m, s) in p.mean.iter_mut().zip(self.spec.output_scale.iter().cycle()) {
                *m *= s;
            }
            for (l, s) in p.logvar.iter_mut().zip(shift.iter().cycle()) {
                *l += s;
            }
        }
        Ok(p)
    }

    /// Mean squared error of the members' means on `rows` (averaged over members, rows and
    /// components, in the units the members learn): the early-stopping criterion on the public
    /// split. Evaluated [`MSE_CHUNK_ROWS`] rows at a time.
    pub fn mse(&self, rows: &ModelRows) -> Result<f64> {
        self.mse_in_chunks(rows, MSE_CHUNK_ROWS)
    }

    /// [`Ensemble::mse`] with at most `chunk` rows per forward pass. The forward pass holds
    /// `members x rows x width` activations per layer, so the public split of a 30,000-episode
    /// dataset (300,000 rows) in one pass took the aggregator to 5.6 GB and the kernel's OOM
    /// killer ended a run; chunks bound that to a few tens of MB at no cost in the result.
    pub fn mse_in_chunks(&self, rows: &ModelRows, chunk: usize) -> Result<f64> {
        if chunk == 0 {
            return Err(NnError::Invalid(
                "ensemble mse: chunk must be > 0 rows".into(),
            ));
        }
        let (din, dout) = (self.spec.in_dim(), self.spec.out_dim());
        let n = rows.rows(&self.spec);
        if n == 0 {
            return Ok(0.0);
        }
        let mut sum = 0.0f64;
        for (inputs, targets) in rows
            .inputs
            .chunks(chunk * din)
            .zip(rows.targets.chunks(chunk * dout))
        {
            let p = self.predict_inputs(inputs.to_vec())?;
            for i in 0..p.members {
                for (r, y) in targets.chunks(dout).enumerate() {
                    sum += p
                        .mean_of(i, r)
                        .iter()
                        .zip(y)
                        .map(|(m, t)| (f64::from(*m) - f64::from(*t)).powi(2))
                        .sum::<f64>();
                }
            }
        }
        Ok(sum / (self.spec.members * n * dout) as f64)
    }

    /// One step of the pessimistic MDP (seed 001, Algorithm 4 line 7) for every row: a member
    /// drawn uniformly per row, `s' = s + mu + sigma eps` and `r = r_sampled - lambda u(s, a)`.
    /// `u` is taken in raw units, or with `learned_units` in the units the members learn (each
    /// component over the spec's `output_scale`; the same as raw without one).
    pub fn step<R: rand::Rng>(
        &self,
        obs: &[f32],
        act: &[f32],
        uncertainty: Uncertainty,
        learned_units: bool,
        lambda: f64,
        rng: &mut R,
    ) -> Result<ModelStep> {
        let p = self.predict(obs, act)?;
        let d = self.spec.obs_dim;
        let u = if learned_units {
            p.uncertainty_scaled(uncertainty, &self.spec.output_scale)
        } else {
            p.uncertainty(uncertainty)
        };
        let mut next_obs = Vec::with_capacity(obs.len());
        let mut reward = Vec::with_capacity(p.rows);
        for r in 0..p.rows {
            let i = ((u128::from(rng.next_u64()) * p.members as u128) >> 64) as usize;
            let (mu, lv) = (p.mean_of(i, r), p.logvar_of(i, r));
            let mut sample = |k: usize| -> f64 {
                let z: f64 = StandardNormal.sample(rng);
                f64::from(mu[k]) + (0.5 * f64::from(lv[k])).exp() * z
            };
            for k in 0..d {
                next_obs.push((f64::from(obs[r * d + k]) + sample(k)) as f32);
            }
            reward.push((sample(d) - lambda * u[r]) as f32);
        }
        Ok(ModelStep {
            next_obs,
            reward,
            uncertainty: u,
        })
    }
}

/// Metadata key holding the ensemble's spec as JSON in its safetensors file.
pub const ENSEMBLE_SPEC_KEY: &str = "fedrl.ensemble_spec";

/// Writes `params` of `spec` as safetensors (`member.{i}.{l}.weight` `[out, in]` and
/// `member.{i}.{l}.bias`), the spec as JSON metadata.
pub fn save(spec: &EnsembleSpec, params: &[f32], path: &std::path::Path) -> Result<()> {
    use crate::tensor_io::{self, Tensor};
    spec.check()?;
    check_params(spec, params)?;
    let widths = spec.widths();
    let mut tensors = Vec::new();
    let mut off = 0;
    for i in 0..spec.members {
        for (l, p) in widths.windows(2).enumerate() {
            for (kind, n, shape) in [
                ("weight", p[0] * p[1], vec![p[1], p[0]]),
                ("bias", p[1], vec![p[1]]),
            ] {
                tensors.push(Tensor::f32(
                    format!("member.{i}.{l}.{kind}"),
                    shape,
                    &params[off..off + n],
                ));
                off += n;
            }
        }
    }
    let json =
        serde_json::to_string(spec).map_err(|e| NnError::Invalid(format!("ensemble spec: {e}")))?;
    let out = tensor_io::serialize(&tensors, ENSEMBLE_SPEC_KEY, json)?;
    std::fs::write(path, out)?;
    Ok(())
}

/// Reads an ensemble written by [`save`]: its spec and flat parameters.
pub fn load(path: &std::path::Path) -> Result<(EnsembleSpec, Vec<f32>)> {
    use crate::tensor_io;
    use safetensors::tensor::Dtype;
    let bytes = std::fs::read(path)?;
    let json = tensor_io::metadata_entry(&bytes, ENSEMBLE_SPEC_KEY)?.ok_or_else(|| {
        NnError::Invalid(format!(
            "{}: no {ENSEMBLE_SPEC_KEY} metadata",
            path.display()
        ))
    })?;
    let spec: EnsembleSpec =
        serde_json::from_str(&json).map_err(|e| NnError::Invalid(format!("ensemble spec: {e}")))?;
    spec.check()?;
    let st = tensor_io::parse(&bytes)?;
    let widths = spec.widths();
    let mut params = Vec::with_capacity(spec.len());
    for i in 0..spec.members {
        for l in 0..widths.len() - 1 {
            for kind in ["weight", "bias"] {
                let name = format!("member.{i}.{l}.{kind}");
                params.extend(tensor_io::le_f32s(tensor_io::tensor_bytes(
                    &st,
                    &name,
                    Dtype::F32,
                    None,
                )?));
            }
        }
    }
    check_params(&spec, &params)?;
    Ok((spec, params))
}
