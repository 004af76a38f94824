//! Model description, flat parameter layout, seeded orthogonal initialisation and the batched
//! tanh-MLP forward pass over many users' stacked parameter copies.

use candle_core::{DType, Device, Tensor};
use fedrl_sim::Space;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

use crate::{NnError, Result};

/// What the policy outputs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ActionKind {
    /// Categorical over `n` actions (logits head).
    Discrete { n: usize },
    /// Diagonal Gaussian over `dim` reals with a state-independent log-std parameter.
    Gaussian { dim: usize },
}

impl ActionKind {
    /// Width of the policy network's output layer.
    pub fn head_width(&self) -> usize {
        match *self {
            ActionKind::Discrete { n } => n,
            ActionKind::Gaussian { dim } => dim,
        }
    }
}

/// A policy network and a value network, both tanh MLPs with the same hidden sizes
/// (separate networks, as in CleanRL's PPO).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Observation length.
    pub obs_dim: usize,
    pub action: ActionKind,
    /// Hidden layer widths, e.g. `[64, 64]`.
    pub hidden: Vec<usize>,
    /// Initial log standard deviation of Gaussian policies (nats; ignored for discrete).
    pub init_log_std: f32,
    /// Fixed public observation normalisation: the networks see `(obs - offset) / scale`,
    /// per observation entry (environment units). Empty: the raw observation. These are
    /// constants of the scenario, never statistics of users' data (running normalisers would
    /// leak users' observations through the released model).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub obs_offset: Vec<f32>,
    /// See `obs_offset`; empty means 1 for every entry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub obs_scale: Vec<f32>,
    /// Gaussian policies only: when set, the policy acts in `[-1, 1]` per action entry and a
    /// sample `a` becomes the environment action `low + (clamp(a, -1, 1) + 1) / 2 * (high -
    /// low)` (environment units), so the initial policy starts in the middle of a range the
    /// scenario chose. Empty: the sample is used as is (clipped to the environment's box).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub action_low: Vec<f32>,
    /// See `action_low`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub action_high: Vec<f32>,
    /// The policy decides every `action_repeat` environment steps and holds its action in
    /// between (rewards summed): a slow system gets decisions whose effect is visible. 1 (the
    /// default, also for 0): every step. A rollout's `max_episode_steps` then counts decisions.
    #[serde(default = "one_usize", skip_serializing_if = "is_one")]
    pub action_repeat: usize,
}

fn one_usize() -> usize {
    1
}

fn is_one(v: &usize) -> bool {
    *v == 1
}

impl ModelSpec {
    /// The model for an environment's spaces.
    pub fn from_spaces(obs: &Space, action: &Space, hidden: &[usize]) -> Result<Self> {
        let obs_dim = match obs {
            Space::Box { low, .. } => low.len(),
            Space::Discrete { .. } => {
                return Err(NnError::Invalid(
                    "discrete observation spaces are not supported (one-hot them in the env)"
                        .into(),
                ));
            }
        };
        let action = match action {
            Space::Discrete { n } => ActionKind::Discrete { n: *n },
            Space::Box { low, .. } => ActionKind::Gaussian { dim: low.len() },
        };
        Ok(Self {
            obs_dim,
            action,
            hidden: hidden.to_vec(),
            init_log_std: 0.0,
            obs_offset: Vec::new(),
            obs_scale: Vec::new(),
            action_low: Vec::new(),
            action_high: Vec::new(),
            action_repeat: 1,
        })
    }

    /// Checks the preprocessing fields against the dimensions: lengths, finite values,
    /// positive scales, `low < high`, and action ranges only on Gaussian policies.
    pub fn check_preprocessing(&self) -> Result<()> {
        let bad = |m: String| Err(NnError::Invalid(m));
        for (name, v) in [
            ("obs_offset", &self.obs_offset),
            ("obs_scale", &self.obs_scale),
        ] {
            if !v.is_empty() && v.len() != self.obs_dim {
                return bad(format!(
                    "{name} has {} entries but the observation has {}",
                    v.len(),
                    self.obs_dim
                ));
            }
            if v.iter().any(|x| !x.is_finite()) {
                return bad(format!("{name} must be finite"));
            }
        }
        if self.obs_scale.iter().any(|&s| s <= 0.0) {
            return bad("obs_scale entries must be > 0".into());
        }
        if self.action_low.is_empty() && self.action_high.is_empty() {
            return Ok(());
        }
        let dim = match self.action {
            ActionKind::Gaussian { dim } => dim,
            ActionKind::Discrete { .. } => {
                return bad("action_low/action_high apply to continuous actions only".into());
            }
        };
        if self.action_low.len() != dim || self.action_high.len() != dim {
            return bad(format!(
                "action_low and action_high need {dim} entries each, got {} and {}",
                self.action_low.len(),
                self.action_high.len()
            ));
        }
        for (lo, hi) in self.action_low.iter().zip(&self.action_high) {
            if !(lo.is_finite() && hi.is_finite() && lo < hi) {
                return bad(format!(
                    "action range [{lo}, {hi}] must be finite with low < high"
                ));
            }
        }
        Ok(())
    }

    /// Normalises observations in place (`obs` holds whole observations back to back).
    pub fn normalize_obs(&self, obs: &mut [f32]) {
        if self.obs_offset.is_empty() && self.obs_scale.is_empty() {
            return;
        }
        for row in obs.chunks_mut(self.obs_dim.max(1)) {
            for (i, x) in row.iter_mut().enumerate() {
                let off = self.obs_offset.get(i).copied().unwrap_or(0.0);
                let sc = self.obs_scale.get(i).copied().unwrap_or(1.0);
                *x = (*x - off) / sc;
            }
        }
    }

    /// Maps a policy sample to the scenario's action range (see `action_low`); a no-op when
    /// no range is set.
    pub fn rescale_action(&self, a: &mut [f32]) {
        if self.action_low.is_empty() {
            return;
        }
        for ((x, lo), hi) in a.iter_mut().zip(&self.action_low).zip(&self.action_high) {
            *x = lo + (x.clamp(-1.0, 1.0) + 1.0) * 0.5 * (hi - lo);
        }
    }

    /// Layer widths of one network, input to output.
    fn widths(&self, out: usize) -> Vec<usize> {
        let mut w = Vec::with_capacity(self.hidden.len() + 2);
        w.push(self.obs_dim);
        w.extend_from_slice(&self.hidden);
        w.push(out);
        w
    }

    /// The ordered parameter layout: policy layers, `policy.log_std` (Gaussian only), value layers.
    pub fn layout(&self) -> ParamLayout {
        let mut params = Vec::new();
        let mut offset = 0;
        let mut push = |name: String, shape: Vec<usize>, params: &mut Vec<ParamSpec>| {
            let n: usize = shape.iter().product();
            params.push(ParamSpec {
                name,
                shape,
                offset,
            });
            offset += n;
        };
        let mut policy_layers = Vec::new();
        let pw = self.widths(self.action.head_width());
        for (i, w) in pw.windows(2).enumerate() {
            policy_layers.push(params.len());
            push(
                format!("policy.{}.weight", 2 * i),
                vec![w[1], w[0]],
                &mut params,
            );
            push(format!("policy.{}.bias", 2 * i), vec![w[1]], &mut params);
        }
        let log_std = match self.action {
            ActionKind::Gaussian { dim } => {
                let idx = params.len();
                push("policy.log_std".into(), vec![dim], &mut params);
                Some(idx)
            }
            ActionKind::Discrete { .. } => None,
        };
        let policy_len = params
            .last()
            .map_or(0, |p: &ParamSpec| p.offset + p.numel());
        let mut value_layers = Vec::new();
        let vw = self.widths(1);
        for (i, w) in vw.windows(2).enumerate() {
            value_layers.push(params.len());
            push(
                format!("value.{}.weight", 2 * i),
                vec![w[1], w[0]],
                &mut params,
            );
            push(format!("value.{}.bias", 2 * i), vec![w[1]], &mut params);
        }
        ParamLayout {
            params,
            len: offset,
            policy_len,
            policy_layers,
            log_std,
            value_layers,
        }
    }

    /// Fresh parameters: orthogonal weights (gain sqrt 2 in hidden layers, 0.01 on the policy
    /// head, 1 on the value head, as in common PPO practice), zero biases, `init_log_std`.
    /// Deterministic in `seed` (candle's own initialisers are unseeded).
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let layout = self.layout();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut flat = vec![0.0f32; layout.len];
        let n_p = layout.policy_layers.len();
        let n_v = layout.value_layers.len();
        let gains = (0..n_p)
            .map(|i| (layout.policy_layers[i], i + 1 == n_p, 0.01f64))
            .chain((0..n_v).map(|i| (layout.value_layers[i], i + 1 == n_v, 1.0f64)));
        for (idx, last, head_gain) in gains {
            let p = &layout.params[idx];
            let gain = if last { head_gain } else { 2f64.sqrt() };
            let w = orthogonal(p.shape[0], p.shape[1], gain, &mut rng);
            flat[p.offset..p.offset + w.len()].copy_from_slice(&w);
        }
        if let Some(idx) = layout.log_std {
            let p = &layout.params[idx];
            flat[p.offset..p.offset + p.shape[0]].fill(self.init_log_std);
        }
        flat
    }
}

/// A named tensor outside the flat vector: (name, PyTorch shape, row-major values).
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);

/// One named tensor inside the flat vector.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// PyTorch-style name, e.g. `policy.0.weight`.
    pub name: String,
    /// PyTorch shape (`[out, in]` for weights).
    pub shape: Vec<usize>,
    /// Start index in the flat vector.
    pub offset: usize,
}

impl ParamSpec {
    /// Number of values.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Ordered names and shapes of all parameters (policy first, then value).
#[derive(Clone, Debug, PartialEq)]
pub struct ParamLayout {
    pub params: Vec<ParamSpec>,
    /// Total number of values (policy and value).
    pub len: usize,
    /// Values `0..policy_len` belong to the policy (including `log_std`).
    pub policy_len: usize,
    /// Index in `params` of each policy layer's weight (its bias follows it).
    pub policy_layers: Vec<usize>,
    /// Index in `params` of `policy.log_std`, for Gaussian policies.
    pub log_std: Option<usize>,
    /// Index in `params` of each value layer's weight (its bias follows it).
    pub value_layers: Vec<usize>,
}

impl ParamLayout {
    /// Total number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the layout has no parameters.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks the length of a flat vector.
    pub fn check(&self, flat: &[f32]) -> Result<()> {
        if flat.len() != self.len {
            return Err(NnError::ParamLength {
                got: flat.len(),
                expected: self.len,
            });
        }
        Ok(())
    }

    /// Splits a flat vector into named tensors (PyTorch shapes).
    pub fn unflatten(&self, flat: &[f32]) -> Result<Vec<NamedTensor>> {
        self.check(flat)?;
        Ok(self
            .params
            .iter()
            .map(|p| {
                (
                    p.name.clone(),
                    p.shape.clone(),
                    flat[p.offset..p.offset + p.numel()].to_vec(),
                )
            })
            .collect())
    }

    /// Concatenates named tensors back into one flat vector; names and shapes must match.
    pub fn flatten(&self, tensors: &[NamedTensor]) -> Result<Vec<f32>> {
        let mut flat = vec![0.0f32; self.len];
        let mut seen = vec![false; self.params.len()];
        for (name, shape, data) in tensors {
            let (i, p) = self
                .params
                .iter()
                .enumerate()
                .find(|(_, p)| &p.name == name)
                .ok_or_else(|| NnError::Invalid(format!("unknown parameter {name}")))?;
            if &p.shape != shape || data.len() != p.numel() {
                return Err(NnError::Invalid(format!(
                    "parameter {name}: shape {shape:?}, expected {:?}",
                    p.shape
                )));
            }
            flat[p.offset..p.offset + p.numel()].copy_from_slice(data);
            seen[i] = true;
        }
        if let Some(i) = seen.iter().position(|s| !s) {
            return Err(NnError::Invalid(format!(
                "missing parameter {}",
                self.params[i].name
            )));
        }
        Ok(flat)
    }

    /// Internal (stacked) shape of one parameter for `users` copies: weights become
    /// `[users, in, out]` so that `x @ w` needs no transpose.
    fn stacked_shape(&self, idx: usize, users: usize) -> Vec<usize> {
        let p = &self.params[idx];
        let mut s = vec![users];
        if p.shape.len() == 2 {
            s.extend([p.shape[1], p.shape[0]]);
        } else {
            s.extend_from_slice(&p.shape);
        }
        s
    }

    /// Stacks flat parameter vectors (one per user) into tensors in layout order.
    pub fn stack(&self, flats: &[&[f32]], device: &Device) -> Result<Vec<Tensor>> {
        for f in flats {
            self.check(f)?;
        }
        let users = flats.len();
        let mut out = Vec::with_capacity(self.params.len());
        for (idx, p) in self.params.iter().enumerate() {
            let n = p.numel();
            let mut buf = Vec::with_capacity(users * n);
            for f in flats {
                let src = &f[p.offset..p.offset + n];
                if p.shape.len() == 2 {
                    // [out, in] -> [in, out]
                    let (o, i) = (p.shape[0], p.shape[1]);
                    for c in 0..i {
                        for r in 0..o {
                            buf.push(src[r * i + c]);
                        }
                    }
                } else {
                    buf.extend_from_slice(src);
                }
            }
            out.push(Tensor::from_vec(
                buf,
                self.stacked_shape(idx, users),
                device,
            )?);
        }
        Ok(out)
    }

    /// Stacks flat vectors into one `[users, len]` tensor in the internal order (weights
    /// transposed to `[in, out]`); [`ParamLayout::split`] views it as per-parameter tensors.
    pub fn stack_flat(&self, flats: &[&[f32]], device: &Device) -> Result<Tensor> {
        let mut buf = Vec::with_capacity(flats.len() * self.len);
        for f in flats {
            self.check(f)?;
            for p in &self.params {
                let src = &f[p.offset..p.offset + p.numel()];
                if p.shape.len() == 2 {
                    let (o, i) = (p.shape[0], p.shape[1]);
                    for c in 0..i {
                        for r in 0..o {
                            buf.push(src[r * i + c]);
                        }
                    }
                } else {
                    buf.extend_from_slice(src);
                }
            }
        }
        Ok(Tensor::from_vec(buf, (flats.len(), self.len), device)?)
    }

    /// Per-parameter stacked tensors (as [`ParamLayout::stack`]) cut from a `[users, len]`
    /// tensor made by [`ParamLayout::stack_flat`]; differentiable.
    pub fn split(&self, theta: &Tensor) -> Result<Vec<Tensor>> {
        let users = theta.dim(0)?;
        self.params
            .iter()
            .enumerate()
            .map(|(idx, p)| {
                Ok(theta
                    .narrow(1, p.offset, p.numel())?
                    .reshape(self.stacked_shape(idx, users))?)
            })
            .collect()
    }

    /// Inverse of [`ParamLayout::stack_flat`].
    pub fn unstack_flat(&self, theta: &Tensor) -> Result<Vec<Vec<f32>>> {
        let data = theta
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let users = theta.dim(0)?;
        let mut flats = vec![vec![0.0f32; self.len]; users];
        for (u, flat) in flats.iter_mut().enumerate() {
            let row = &data[u * self.len..(u + 1) * self.len];
            for p in &self.params {
                let n = p.numel();
                let src = &row[p.offset..p.offset + n];
                let dst = &mut flat[p.offset..p.offset + n];
                if p.shape.len() == 2 {
                    let (o, i) = (p.shape[0], p.shape[1]);
                    for c in 0..i {
                        for r in 0..o {
                            dst[r * i + c] = src[c * o + r];
                        }
                    }
                } else {
                    dst.copy_from_slice(src);
                }
            }
        }
        Ok(flats)
    }

    /// Inverse of [`ParamLayout::stack`]: one flat vector per user.
    pub fn unstack(&self, tensors: &[Tensor]) -> Result<Vec<Vec<f32>>> {
        if tensors.len() != self.params.len() {
            return Err(NnError::Invalid("wrong number of stacked tensors".into()));
        }
        let users = tensors.first().map(|t| t.dim(0)).transpose()?.unwrap_or(0);
        let mut flats = vec![vec![0.0f32; self.len]; users];
        for (p, t) in self.params.iter().zip(tensors) {
            let n = p.numel();
            let data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            for (u, flat) in flats.iter_mut().enumerate() {
                let src = &data[u * n..(u + 1) * n];
                let dst = &mut flat[p.offset..p.offset + n];
                if p.shape.len() == 2 {
                    let (o, i) = (p.shape[0], p.shape[1]);
                    for c in 0..i {
                        for r in 0..o {
                            dst[r * i + c] = src[c * o + r];
                        }
                    }
                } else {
                    dst.copy_from_slice(src);
                }
            }
        }
        Ok(flats)
    }
}

/// A `rows x cols` matrix (row-major) with orthonormal rows or columns (whichever are fewer),
/// scaled by `gain`, from a seeded Gaussian matrix by modified Gram-Schmidt (as
/// `torch.nn.init.orthogonal_`, which uses QR with the sign of R's diagonal made positive).
pub fn orthogonal(rows: usize, cols: usize, gain: f64, rng: &mut Xoshiro256PlusPlus) -> Vec<f32> {
    // Orthonormalise the `k` shorter-side vectors of length `n`.
    let (k, n) = if rows <= cols {
        (rows, cols)
    } else {
        (cols, rows)
    };
    let mut v: Vec<Vec<f64>> = (0..k)
        .map(|_| (0..n).map(|_| StandardNormal.sample(rng)).collect())
        .collect();
    for i in 0..k {
        for j in 0..i {
            let (a, b) = v.split_at_mut(i);
            let d: f64 = a[j].iter().zip(b[0].iter()).map(|(x, y)| x * y).sum();
            for (x, y) in b[0].iter_mut().zip(a[j].iter()) {
                *x -= d * y;
            }
        }
        let norm = v[i].iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
        for x in v[i].iter_mut() {
            *x /= norm;
        }
    }
    let mut out = vec![0.0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let x = if rows <= cols { v[r][c] } else { v[c][r] };
            out[r * cols + c] = (gain * x) as f32;
        }
    }
    out
}

/// Batched MLP: `x` is `[users, n, in]`, `layers` are (weight `[users, in, out]`, bias
/// `[users, out]`) pairs; tanh between layers, linear output `[users, n, out]`.
pub fn forward(x: &Tensor, layers: &[(&Tensor, &Tensor)]) -> Result<Tensor> {
    let mut h = x.clone();
    for (i, (w, b)) in layers.iter().enumerate() {
        h = h.matmul(w)?.broadcast_add(&b.unsqueeze(1)?)?;
        if i + 1 < layers.len() {
            h = crate::activation::tanh(&h)?;
        }
    }
    Ok(h)
}

/// The (weight, bias) pairs of the policy network in stacked tensors.
pub fn policy_layers<'a>(layout: &ParamLayout, t: &'a [Tensor]) -> Vec<(&'a Tensor, &'a Tensor)> {
    layout
        .policy_layers
        .iter()
        .map(|&i| (&t[i], &t[i + 1]))
        .collect()
}

/// The (weight, bias) pairs of the value network in stacked tensors.
pub fn value_layers<'a>(layout: &ParamLayout, t: &'a [Tensor]) -> Vec<(&'a Tensor, &'a Tensor)> {
    layout
        .value_layers
        .iter()
        .map(|&i| (&t[i], &t[i + 1]))
        .collect()
}

/// One parameter vector's policy and value networks for plain `f32` forward passes of one
/// observation at a time: weights copied to `[in, out]` order, so each layer is a sum of input-
/// scaled weight rows (a loop the compiler vectorises across outputs).
#[derive(Clone, Debug)]
pub struct RowMlp {
    /// Per policy layer, then per value layer: (`[in, out]` weights, bias, in, out).
    layers: Vec<(Vec<f32>, Vec<f32>, usize, usize)>,
    n_policy: usize,
}

/// Reusable buffers of [`RowMlp`]'s forward passes.
#[derive(Clone, Debug, Default)]
pub struct RowScratch {
    a: Vec<f32>,
    b: Vec<f32>,
}

impl RowMlp {
    /// The networks of `flat` (layout order, checked by the caller).
    pub fn new(layout: &ParamLayout, flat: &[f32]) -> Self {
        let mut layers = Vec::new();
        for &wi in layout.policy_layers.iter().chain(&layout.value_layers) {
            let (w, b) = (&layout.params[wi], &layout.params[wi + 1]);
            let (out, inp) = (w.shape[0], w.shape[1]);
            let src = &flat[w.offset..w.offset + out * inp];
            let mut t = vec![0.0f32; out * inp];
            for o in 0..out {
                for i in 0..inp {
                    t[i * out + o] = src[o * inp + i];
                }
            }
            layers.push((t, flat[b.offset..b.offset + out].to_vec(), inp, out));
        }
        Self {
            layers,
            n_policy: layout.policy_layers.len(),
        }
    }

    /// Tanh MLP over `layers`; the result is in `s.a`.
    fn run(layers: &[(Vec<f32>, Vec<f32>, usize, usize)], x: &[f32], s: &mut RowScratch) {
        s.a.clear();
        s.a.extend_from_slice(x);
        let n = layers.len();
        for (l, (w, b, inp, out)) in layers.iter().enumerate() {
            s.b.clear();
            s.b.extend_from_slice(b);
            for (i, &xi) in s.a.iter().enumerate().take(*inp) {
                let row = &w[i * out..(i + 1) * out];
                for (acc, &wv) in s.b.iter_mut().zip(row) {
                    *acc += xi * wv;
                }
            }
            if l + 1 < n {
                crate::activation::tanh_in_place(&mut s.b);
            }
            std::mem::swap(&mut s.a, &mut s.b);
        }
    }

    /// The policy head (logits or Gaussian means) at the (normalised) observation `x`.
    pub fn policy<'s>(&self, x: &[f32], s: &'s mut RowScratch) -> &'s [f32] {
        Self::run(&self.layers[..self.n_policy], x, s);
        &s.a
    }

    /// The value at the (normalised) observation `x`.
    pub fn value(&self, x: &[f32], s: &mut RowScratch) -> f32 {
        Self::run(&self.layers[self.n_policy..], x, s);
        s.a[0]
    }
}
