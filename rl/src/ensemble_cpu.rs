//! The per-trajectory local update of a dynamics ensemble (seed 001, Algorithm 3's `EnsClipGD`)
//! as one fused loop per ensemble member on the CPU: forward, Gaussian NLL, backward, the SGD
//! step with weight decay and the projection onto the member's clip ball, all on one member's
//! weights while they sit in the core's cache.
//!
//! Written by hand on purpose. The batched tensor path of [`crate::ensemble`] spends most of a
//! step on whole-stack elementwise passes (the SGD update, the delta, its norm, the projection:
//! each a trip through every copy's weights in memory), because the minibatches are tiny (16
//! rows) and the weights are not; candle cannot fuse them. Members are independent (each has its
//! own clip segment and its trajectory's minibatches), so each is trained alone, the members of
//! all trajectories in parallel. `bench/README.md` ("The ensemble's local update") has the
//! measured speed-up; `rl/tests/ensemble.rs` checks this path against the tensor path.
//!
//! Results are the same on every x86-64 CPU: the AVX2 build and the portable build run the same
//! operations in the same order (Rust never fuses a multiply and an add on its own).

use rayon::prelude::*;

use crate::ensemble::{EnsembleClipping, MAX_LOGVAR, MIN_LOGVAR};

/// One member's result.
pub(crate) struct MemberRun {
    /// The member's parameters after training, in the flat layout (`[out, in]` weights).
    pub flat: Vec<f32>,
    /// Sum of the minibatch NLLs over the first epoch.
    pub first_epoch_nll: f64,
    /// After each step's projection: the largest ratio of a segment's delta norm to its bound
    /// (only with `trace`).
    pub ratios: Vec<f64>,
}

/// What every member of a call shares.
pub(crate) struct Job<'a> {
    /// Layer widths, input first (`[in, hidden.., 2 out]`).
    pub widths: &'a [usize],
    pub lr: f32,
    pub weight_decay: f32,
    /// `None`: no projection.
    pub clipping: Option<EnsembleClipping>,
    /// The bound of one clip segment (a member, or a member's layer).
    pub bound: f64,
    pub trace: bool,
}

/// One member of one trajectory: its starting parameters, the trajectory's rows and minibatches.
pub(crate) struct MemberTask<'a> {
    pub start: &'a [f32],
    pub inputs: &'a [f32],
    pub targets: &'a [f32],
    pub plan: &'a [Vec<usize>],
    /// Steps of the first epoch (their NLL is summed).
    pub first_epoch_steps: usize,
}

/// Trains every task, in parallel across the available cores; results in task order.
pub(crate) fn train_members(job: &Job<'_>, tasks: &[MemberTask<'_>]) -> Vec<MemberRun> {
    tasks.par_iter().map(|t| train_member(job, t)).collect()
}

fn train_member(job: &Job<'_>, task: &MemberTask<'_>) -> MemberRun {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { train_member_avx2(job, task) };
    }
    train_member_body(job, task)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn train_member_avx2(job: &Job<'_>, task: &MemberTask<'_>) -> MemberRun {
    train_member_body(job, task)
}

/// One layer of a member: weights kept `[in, out]` so that the forward pass and the weight
/// gradient are sums of scaled rows (loops the compiler vectorises across outputs).
struct Layer {
    fan_in: usize,
    fan_out: usize,
    wt: Vec<f32>,
    b: Vec<f32>,
    wt0: Vec<f32>,
    b0: Vec<f32>,
}

impl Layer {
    /// A member's layers from its flat parameters (`[out, in]` weights, then biases), with
    /// weights transposed to `[in, out]`; `wt0`/`b0` keep the start for the projection.
    fn unpack(widths: &[usize], flat: &[f32]) -> Vec<Layer> {
        let mut layers = Vec::with_capacity(widths.len() - 1);
        let mut off = 0;
        for p in widths.windows(2) {
            let (fan_in, fan_out) = (p[0], p[1]);
            let w = &flat[off..off + fan_in * fan_out];
            let mut wt = vec![0.0f32; fan_in * fan_out];
            for o in 0..fan_out {
                for i in 0..fan_in {
                    wt[i * fan_out + o] = w[o * fan_in + i];
                }
            }
            let b = flat[off + fan_in * fan_out..off + fan_in * fan_out + fan_out].to_vec();
            off += fan_in * fan_out + fan_out;
            layers.push(Layer {
                fan_in,
                fan_out,
                wt0: wt.clone(),
                b0: b.clone(),
                wt,
                b,
            });
        }
        layers
    }
}

#[inline(always)]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// `y += a[0] x[0] + a[1] x[1] + a[2] x[2] + a[3] x[3]`, added in that order (so equal to
/// four [`axpy`] calls).
#[inline(always)]
fn axpy4(a: [f32; 4], x: [&[f32]; 4], y: &mut [f32]) {
    let n = y.len();
    let (x0, x1, x2, x3) = (&x[0][..n], &x[1][..n], &x[2][..n], &x[3][..n]);
    for j in 0..n {
        y[j] = (((y[j] + a[0] * x0[j]) + a[1] * x1[j]) + a[2] * x2[j]) + a[3] * x3[j];
    }
}

/// `term(a[i], b[i])` summed into eight fixed lanes over the whole chunks of eight (a fixed
/// order, so the result does not depend on the vector width the compiler picks); the caller
/// adds the remainder past `a.len() / 8 * 8`.
#[inline(always)]
fn lanes8(a: &[f32], b: &[f32], term: impl Fn(f32, f32) -> f32) -> [f32; 8] {
    let mut acc = [0.0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for j in 0..8 {
            acc[j] += term(x[j], y[j]);
        }
    }
    acc
}

/// Dot product over [`lanes8`].
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let acc = lanes8(a, b, |x, y| x * y);
    let whole = a.len() / 8 * 8;
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in a[whole..].iter().zip(&b[whole..]) {
        s += x * y;
    }
    s
}

/// Squared distance over [`lanes8`], the lanes and the remainder added in f64.
#[inline(always)]
fn sq_dist(a: &[f32], b: &[f32]) -> f64 {
    let acc = lanes8(a, b, |x, y| (x - y) * (x - y));
    let whole = a.len() / 8 * 8;
    let mut s: f64 = acc.iter().map(|v| f64::from(*v)).sum();
    for (x, y) in a[whole..].iter().zip(&b[whole..]) {
        let d = f64::from(x - y);
        s += d * d;
    }
    s
}

/// `softplus(x) = max(x, 0) + ln(1 + exp(-|x|))`.
#[inline(always)]
fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline(always)]
fn train_member_body(job: &Job<'_>, task: &MemberTask<'_>) -> MemberRun {
    let widths = job.widths;
    let n_layers = widths.len() - 1;
    let din = widths[0];
    let dout = widths[n_layers] / 2;
    let mut layers = Layer::unpack(widths, task.start);
    let rows_max = task.plan.iter().map(Vec::len).max().unwrap_or(0);
    let mut bufs = Buffers::new(widths, rows_max);
    let wmax = widths.iter().copied().max().unwrap_or(0);
    let mut dz = vec![0.0f32; rows_max * wmax];
    let mut dz_prev = vec![0.0f32; rows_max * wmax];
    let mut grad_row = vec![0.0f32; wmax];
    let mut y = vec![0.0f32; rows_max * dout];
    let mut sq = vec![0.0f64; n_layers];
    let mut first_epoch_nll = 0.0f64;
    let mut ratios = Vec::new();

    for (step, batch) in task.plan.iter().enumerate() {
        let nb = batch.len();
        for (k, &r) in batch.iter().enumerate() {
            bufs.acts[0][k * din..(k + 1) * din]
                .copy_from_slice(&task.inputs[r * din..(r + 1) * din]);
            y[k * dout..(k + 1) * dout].copy_from_slice(&task.targets[r * dout..(r + 1) * dout]);
        }
        forward(&layers, &mut bufs, nb);
        // Loss: per row, the mean over components of (mu - y)^2 exp(-logvar) + logvar, with
        // logvar softly bounded; the minibatch NLL is the mean over rows. Its gradient with
        // respect to the output layer goes into dz.
        let out = &bufs.acts[n_layers][..nb * 2 * dout];
        let k_scale = 1.0 / (dout * nb) as f32;
        let mut nll = 0.0f64;
        for k in 0..nb {
            let mut per = 0.0f64;
            for c in 0..dout {
                let mu = out[k * 2 * dout + c];
                let raw = out[k * 2 * dout + dout + c];
                let a1 = MAX_LOGVAR - raw;
                let lv1 = MAX_LOGVAR - softplus(a1);
                let b2 = lv1 - MIN_LOGVAR;
                let lv = MIN_LOGVAR + softplus(b2);
                let e = (-lv).exp();
                let d = mu - y[k * dout + c];
                let d2e = d * d * e;
                per += f64::from(d2e + lv);
                dz[k * 2 * dout + c] = 2.0 * d * e * k_scale;
                dz[k * 2 * dout + dout + c] = (1.0 - d2e) * k_scale * sigmoid(b2) * sigmoid(a1);
            }
            nll += per / dout as f64;
        }
        if step < task.first_epoch_steps {
            first_epoch_nll += nll / nb.max(1) as f64;
        }
        // Backward and SGD, last layer first; each layer's input gradient is taken with its
        // weights before their update.
        for l in (0..n_layers).rev() {
            let layer = &mut layers[l];
            let (fi, fo) = (layer.fan_in, layer.fan_out);
            let x = &bufs.acts[l][..nb * fi];
            let d = &dz[..nb * fo];
            if l > 0 {
                let (z, s) = (&bufs.pre[l - 1][..nb * fi], &bufs.sig[l - 1][..nb * fi]);
                for i in 0..fi {
                    let wrow = &layer.wt[i * fo..(i + 1) * fo];
                    for k in 0..nb {
                        let da = dot(&d[k * fo..(k + 1) * fo], wrow);
                        let (zv, sv) = (z[k * fi + i], s[k * fi + i]);
                        dz_prev[k * fi + i] = da * sv * (1.0 + zv * (1.0 - sv));
                    }
                }
            }
            let mut layer_sq = 0.0f64;
            for i in 0..fi {
                let g = &mut grad_row[..fo];
                let wrow = &mut layer.wt[i * fo..(i + 1) * fo];
                for (gv, wv) in g.iter_mut().zip(wrow.iter()) {
                    *gv = job.weight_decay * wv;
                }
                let mut k = 0;
                while k + 4 <= nb {
                    let a = [
                        x[k * fi + i],
                        x[(k + 1) * fi + i],
                        x[(k + 2) * fi + i],
                        x[(k + 3) * fi + i],
                    ];
                    let r = |j: usize| &d[(k + j) * fo..(k + j + 1) * fo];
                    axpy4(a, [r(0), r(1), r(2), r(3)], g);
                    k += 4;
                }
                for k in k..nb {
                    axpy(x[k * fi + i], &d[k * fo..(k + 1) * fo], g);
                }
                for (wv, gv) in wrow.iter_mut().zip(g.iter()) {
                    *wv -= job.lr * gv;
                }
                layer_sq += sq_dist(wrow, &layer.wt0[i * fo..(i + 1) * fo]);
            }
            let g = &mut grad_row[..fo];
            g.fill(0.0);
            for k in 0..nb {
                axpy(1.0, &d[k * fo..(k + 1) * fo], g);
            }
            for (bv, gv) in layer.b.iter_mut().zip(g.iter()) {
                *bv -= job.lr * gv;
            }
            layer_sq += sq_dist(&layer.b, &layer.b0);
            sq[l] = layer_sq;
            if l > 0 {
                std::mem::swap(&mut dz, &mut dz_prev);
            }
        }
        // Projection of the member's delta onto its clip ball (flat) or each layer's.
        if let Some(clipping) = job.clipping {
            let factors: Vec<f32> = match clipping {
                EnsembleClipping::Flat => {
                    let f = shrink(sq.iter().sum::<f64>().sqrt(), job.bound);
                    vec![f; n_layers]
                }
                EnsembleClipping::PerLayer => {
                    sq.iter().map(|s| shrink(s.sqrt(), job.bound)).collect()
                }
            };
            for (layer, &f) in layers.iter_mut().zip(&factors) {
                if f < 1.0 {
                    scale_towards(&mut layer.wt, &layer.wt0, f);
                    scale_towards(&mut layer.b, &layer.b0, f);
                }
            }
            if job.trace {
                let seg: Vec<f64> = layers
                    .iter()
                    .map(|l| sq_dist(&l.wt, &l.wt0) + sq_dist(&l.b, &l.b0))
                    .collect();
                let worst = match clipping {
                    EnsembleClipping::Flat => seg.iter().sum::<f64>().sqrt(),
                    EnsembleClipping::PerLayer => {
                        seg.iter().map(|s| s.sqrt()).fold(0.0f64, f64::max)
                    }
                };
                ratios.push(worst / job.bound);
            }
        }
    }
    // Back to the flat `[out, in]` layout.
    let mut flat = Vec::with_capacity(task.start.len());
    for layer in &layers {
        let (fi, fo) = (layer.fan_in, layer.fan_out);
        for o in 0..fo {
            for i in 0..fi {
                flat.push(layer.wt[i * fo + o]);
            }
        }
        flat.extend_from_slice(&layer.b);
    }
    MemberRun {
        flat,
        first_epoch_nll,
        ratios,
    }
}

/// Activations of one minibatch: `acts[l]` is layer l's input (`acts[0]` the rows), `pre[l]` and
/// `sig[l]` hidden layer l's pre-activation and its sigmoid (for swish's derivative).
struct Buffers {
    acts: Vec<Vec<f32>>,
    pre: Vec<Vec<f32>>,
    sig: Vec<Vec<f32>>,
}

impl Buffers {
    fn new(widths: &[usize], rows: usize) -> Self {
        let acts: Vec<Vec<f32>> = widths.iter().map(|w| vec![0.0; rows * w]).collect();
        let pre: Vec<Vec<f32>> = widths[1..widths.len() - 1]
            .iter()
            .map(|w| vec![0.0; rows * w])
            .collect();
        Buffers {
            acts,
            sig: pre.clone(),
            pre,
        }
    }
}

/// The forward pass of the first `nb` rows of `bufs.acts[0]`; the output layer's values end in
/// the last `acts`.
#[inline(always)]
fn forward(layers: &[Layer], bufs: &mut Buffers, nb: usize) {
    for (l, layer) in layers.iter().enumerate() {
        let (fi, fo) = (layer.fan_in, layer.fan_out);
        let (head, tail) = bufs.acts.split_at_mut(l + 1);
        let x = &head[l][..nb * fi];
        let out = &mut tail[0][..nb * fo];
        for k in 0..nb {
            out[k * fo..(k + 1) * fo].copy_from_slice(&layer.b);
        }
        // Four weight rows per pass over the outputs (same order of additions as one at
        // a time, a quarter of the loads and stores).
        let mut i = 0;
        while i + 4 <= fi {
            let w = |j: usize| &layer.wt[(i + j) * fo..(i + j + 1) * fo];
            let rows = [w(0), w(1), w(2), w(3)];
            for k in 0..nb {
                let a = [
                    x[k * fi + i],
                    x[k * fi + i + 1],
                    x[k * fi + i + 2],
                    x[k * fi + i + 3],
                ];
                axpy4(a, rows, &mut out[k * fo..(k + 1) * fo]);
            }
            i += 4;
        }
        for i in i..fi {
            let wrow = &layer.wt[i * fo..(i + 1) * fo];
            for k in 0..nb {
                axpy(x[k * fi + i], wrow, &mut out[k * fo..(k + 1) * fo]);
            }
        }
        if l + 1 < layers.len() {
            let (z, s) = (&mut bufs.pre[l][..nb * fo], &mut bufs.sig[l][..nb * fo]);
            for ((o, zv), sv) in out.iter_mut().zip(z.iter_mut()).zip(s.iter_mut()) {
                *zv = *o;
                *sv = sigmoid(*o);
                *o *= *sv;
            }
        }
    }
}

/// The factor that brings a delta of norm `norm` inside the ball of radius `bound` (1 if it is
/// already inside).
fn shrink(norm: f64, bound: f64) -> f32 {
    if norm > bound {
        (bound / norm) as f32
    } else {
        1.0
    }
}

/// `v = v0 + f (v - v0)`.
#[inline(always)]
fn scale_towards(v: &mut [f32], v0: &[f32], f: f32) {
    for (x, x0) in v.iter_mut().zip(v0) {
        *x = x0 + (*x - x0) * f;
    }
}
