//! The Q-network of discrete CQL: a ReLU MLP `obs_dim -> hidden.. -> n_actions` (d3rlpy's default
//! vector encoder followed by a linear head), its flat parameter layout and its forward pass.
//!
//! Parameters travel as one `Vec<f32>`: for every layer `l`, `q.{l}.weight` (`[out, in]`,
//! PyTorch's row-major layout) then `q.{l}.bias` (`[out]`).

use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rand::distr::{Distribution, Uniform};
use rand::rngs::Xoshiro256PlusPlus;
use serde::{Deserialize, Serialize};

use crate::{NnError, Result};

/// Shape of a Q-network: ReLU after every hidden layer, none after the output layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QNetSpec {
    /// Observation length.
    pub obs_dim: usize,
    /// Hidden layer widths, input side first (d3rlpy's default: `[256, 256]`).
    pub hidden: Vec<usize>,
    /// Number of discrete actions (width of the output layer).
    pub n_actions: usize,
}

/// One linear layer inside the flat parameter vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSlot {
    /// Input width.
    pub fan_in: usize,
    /// Output width.
    pub fan_out: usize,
    /// Offset of the `[fan_out, fan_in]` weight in the flat vector.
    pub weight: usize,
    /// Offset of the `[fan_out]` bias in the flat vector (right after the weight).
    pub bias: usize,
}

impl QNetSpec {
    /// Layer widths, input to output.
    pub fn widths(&self) -> Vec<usize> {
        let mut w = Vec::with_capacity(self.hidden.len() + 2);
        w.push(self.obs_dim);
        w.extend_from_slice(&self.hidden);
        w.push(self.n_actions);
        w
    }

    /// The linear layers in flat-vector order.
    pub fn layers(&self) -> Vec<LayerSlot> {
        let w = self.widths();
        let mut off = 0;
        w.windows(2)
            .map(|p| {
                let slot = LayerSlot {
                    fan_in: p[0],
                    fan_out: p[1],
                    weight: off,
                    bias: off + p[0] * p[1],
                };
                off = slot.bias + p[1];
                slot
            })
            .collect()
    }

    /// Names and shapes of the parameter tensors in flat-vector order (`q.0.weight`, ...).
    pub fn param_names(&self) -> Vec<(String, Vec<usize>)> {
        self.layers()
            .iter()
            .enumerate()
            .flat_map(|(l, s)| {
                [
                    (format!("q.{l}.weight"), vec![s.fan_out, s.fan_in]),
                    (format!("q.{l}.bias"), vec![s.fan_out]),
                ]
            })
            .collect()
    }

    /// Number of parameters.
    pub fn dim(&self) -> usize {
        self.layers().last().map_or(0, |s| s.bias + s.fan_out)
    }

    /// Checks the widths (all positive) and a parameter vector's length and finiteness.
    pub fn check(&self, params: &[f32]) -> Result<()> {
        if self.widths().contains(&0) {
            return Err(NnError::Invalid(format!(
                "Q-network widths must be positive, got {:?}",
                self.widths()
            )));
        }
        if params.len() != self.dim() {
            return Err(NnError::ParamLength {
                got: params.len(),
                expected: self.dim(),
            });
        }
        if params.iter().any(|p| !p.is_finite()) {
            return Err(NnError::Invalid(
                "Q-network parameters must be finite".into(),
            ));
        }
        Ok(())
    }

    /// Writes `params` to `path` as safetensors with the names of [`param_names`](Self::param_names)
    /// (`q.0.weight`, `q.0.bias`, ...), readable by PyTorch's `safetensors.torch.load_file`.
    pub fn save(&self, path: &std::path::Path, params: &[f32]) -> Result<()> {
        self.check(params)?;
        let mut tensors = std::collections::HashMap::new();
        let mut offset = 0;
        for (name, shape) in self.param_names() {
            let n: usize = shape.iter().product();
            let t =
                Tensor::from_slice(&params[offset..offset + n], shape.as_slice(), &Device::Cpu)?;
            tensors.insert(name, t);
            offset += n;
        }
        candle_core::safetensors::save(&tensors, path)?;
        Ok(())
    }

    /// [`from_safetensors`](Self::from_safetensors) of the file at `path`.
    pub fn load_file(path: &std::path::Path) -> Result<(Self, Vec<f32>)> {
        let bytes = std::fs::read(path)
            .map_err(|e| NnError::Invalid(format!("{}: {e}", path.display())))?;
        Self::from_safetensors(&bytes)
            .map_err(|e| NnError::Invalid(format!("{}: {e}", path.display())))
    }

    /// A Q-network written by [`save`](Self::save) (offline CQL's `q_network.safetensors`),
    /// its shape read from the tensors themselves (`q.L.weight` is `[fan_out, fan_in]`): the
    /// spec and the flat parameters. The layers must chain (each one's input is the previous
    /// one's output) and the values be finite.
    pub fn from_safetensors(bytes: &[u8]) -> Result<(Self, Vec<f32>)> {
        let tensors = candle_core::safetensors::load_buffer(bytes, &Device::Cpu)?;
        let mut widths: Vec<usize> = Vec::new();
        for l in 0.. {
            let Some(w) = tensors.get(&format!("q.{l}.weight")) else {
                break;
            };
            let &[fan_out, fan_in] = w.dims() else {
                return Err(NnError::Invalid(format!(
                    "`q.{l}.weight` has shape {:?}, expected [outputs, inputs]",
                    w.dims()
                )));
            };
            match widths.last() {
                None => widths.push(fan_in),
                Some(&prev) if prev != fan_in => {
                    return Err(NnError::Invalid(format!(
                        "`q.{l}.weight` takes {fan_in} inputs, the layer before gives {prev}"
                    )));
                }
                Some(_) => {}
            }
            widths.push(fan_out);
        }
        if widths.len() < 2 || tensors.len() != 2 * (widths.len() - 1) {
            return Err(NnError::Invalid(format!(
                "not a fedrl Q-network (tensors `q.0.weight`, `q.0.bias`, ...): {} tensors, {} \
                 layers found",
                tensors.len(),
                widths.len().saturating_sub(1)
            )));
        }
        let spec = QNetSpec {
            obs_dim: widths[0],
            hidden: widths[1..widths.len() - 1].to_vec(),
            n_actions: widths[widths.len() - 1],
        };
        let mut out = Vec::with_capacity(spec.dim());
        for (name, shape) in spec.param_names() {
            let t = tensors
                .get(&name)
                .ok_or_else(|| NnError::Invalid(format!("no tensor `{name}`")))?;
            if t.dims() != shape.as_slice() {
                return Err(NnError::Invalid(format!(
                    "`{name}` has shape {:?}, the network needs {shape:?}",
                    t.dims()
                )));
            }
            out.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        spec.check(&out)?;
        Ok((spec, out))
    }

    /// Reads parameters written by [`save`](Self::save) for this spec.
    pub fn load(&self, path: &std::path::Path) -> Result<Vec<f32>> {
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)?;
        let mut out = Vec::with_capacity(self.dim());
        for (name, shape) in self.param_names() {
            let t = tensors.get(&name).ok_or_else(|| {
                NnError::Invalid(format!("{}: no tensor `{name}`", path.display()))
            })?;
            if t.dims() != shape.as_slice() {
                return Err(NnError::Invalid(format!(
                    "{}: `{name}` has shape {:?}, the network needs {shape:?}",
                    path.display(),
                    t.dims()
                )));
            }
            out.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        self.check(&out)?;
        Ok(out)
    }

    /// Seeded initial parameters with PyTorch's `nn.Linear` default (what d3rlpy uses): weight
    /// and bias uniform in `[-1/sqrt(fan_in), 1/sqrt(fan_in)]`. Same seed, same vector.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut out = Vec::with_capacity(self.dim());
        for s in self.layers() {
            let bound = 1.0 / (s.fan_in.max(1) as f32).sqrt();
            // A non-empty symmetric range: Uniform::new only fails when low >= high.
            let u = Uniform::new(-bound, bound).expect("bound > 0");
            out.extend((0..s.fan_out * (s.fan_in + 1)).map(|_| u.sample(&mut rng)));
        }
        out
    }

    /// Q-values of `obs` (`n * obs_dim` values, row-major) under `params`: `n * n_actions`
    /// values, row `i` holding `Q(obs_i, .)`. Computed on `device`.
    pub fn q_values(&self, params: &[f32], obs: &[f32], device: &Device) -> Result<Vec<f32>> {
        let net = DeviceNet::upload(self, params, device)?;
        let x = obs_tensor(self.obs_dim, obs, device)?;
        let (_, q) = net.forward(&x)?;
        Ok(q.flatten_all()?.to_vec1()?)
    }
}

/// `n * obs_dim` values as an `[n, obs_dim]` tensor; a length that is not a multiple of
/// `obs_dim` is an error.
pub(crate) fn obs_tensor(obs_dim: usize, obs: &[f32], device: &Device) -> Result<Tensor> {
    if obs_dim == 0 || !obs.len().is_multiple_of(obs_dim) {
        return Err(NnError::Invalid(format!(
            "{} observation values are not a whole number of {obs_dim}-dimensional rows",
            obs.len()
        )));
    }
    Ok(Tensor::from_slice(
        obs,
        (obs.len() / obs_dim, obs_dim),
        device,
    )?)
}

/// A Q-network's parameters on a device: per layer a `[out, in]` weight and a `[1, out]` bias.
pub(crate) struct DeviceNet {
    pub weights: Vec<Tensor>,
    pub biases: Vec<Tensor>,
}

impl DeviceNet {
    /// Checks `params` against `spec` and moves them to `device` (one transfer).
    pub fn upload(spec: &QNetSpec, params: &[f32], device: &Device) -> Result<Self> {
        spec.check(params)?;
        let flat = Tensor::from_slice(params, params.len(), device)?;
        let mut weights = Vec::new();
        let mut biases = Vec::new();
        for s in spec.layers() {
            weights.push(
                flat.narrow(0, s.weight, s.fan_in * s.fan_out)?
                    .reshape((s.fan_out, s.fan_in))?,
            );
            biases.push(flat.narrow(0, s.bias, s.fan_out)?.reshape((1, s.fan_out))?);
        }
        Ok(DeviceNet { weights, biases })
    }

    /// Forward pass of `x` (`[n, obs_dim]`). Returns the input of every layer (`inputs[0]` is
    /// `x`, `inputs[l]` the ReLU output of layer `l - 1`) and the Q-values `[n, n_actions]`.
    pub fn forward(&self, x: &Tensor) -> Result<(Vec<Tensor>, Tensor)> {
        let n_layers = self.weights.len();
        let mut inputs = Vec::with_capacity(n_layers);
        let mut h = x.clone();
        for (l, (w, b)) in self.weights.iter().zip(&self.biases).enumerate() {
            let z = h.matmul(&w.t()?)?.broadcast_add(b)?;
            inputs.push(h);
            h = if l + 1 < n_layers { z.relu()? } else { z };
        }
        Ok((inputs, h))
    }
}

/// `1` where `a > 0`, `0` elsewhere, as f32: the derivative of ReLU given its output.
pub(crate) fn relu_mask(a: &Tensor) -> Result<Tensor> {
    Ok(a.gt(0f32)?.to_dtype(DType::F32)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> QNetSpec {
        QNetSpec {
            obs_dim: 3,
            hidden: vec![5, 4],
            n_actions: 2,
        }
    }

    #[test]
    fn layout_is_pytorch_order() {
        let s = spec();
        assert_eq!(s.dim(), 3 * 5 + 5 + 5 * 4 + 4 + 4 * 2 + 2);
        let l = s.layers();
        assert_eq!((l[1].weight, l[1].bias), (20, 40));
        assert_eq!(s.param_names()[5].0, "q.2.bias");
    }

    #[test]
    fn init_is_seeded_and_bounded() {
        let s = spec();
        let a = s.init(7);
        assert_eq!(a, s.init(7));
        assert_ne!(a, s.init(8));
        let bound = 1.0 / 3f32.sqrt();
        assert!(a[..20].iter().all(|w| w.abs() <= bound));
        assert!(a[..20].iter().any(|w| w.abs() > 0.3 * bound));
    }

    /// The forward pass against a hand-written loop over rows.
    #[test]
    fn q_values_match_a_plain_loop() {
        let s = spec();
        let p = s.init(1);
        let obs = [0.5f32, -1.0, 2.0, 0.1, 0.2, -0.3];
        let q = s.q_values(&p, &obs, &Device::Cpu).unwrap();
        for (row, x) in obs.chunks(3).enumerate() {
            let mut h: Vec<f32> = x.to_vec();
            for (l, sl) in s.layers().iter().enumerate() {
                let mut z: Vec<f32> = (0..sl.fan_out)
                    .map(|o| {
                        p[sl.bias + o]
                            + (0..sl.fan_in)
                                .map(|i| p[sl.weight + o * sl.fan_in + i] * h[i])
                                .sum::<f32>()
                    })
                    .collect();
                if l < 2 {
                    z.iter_mut().for_each(|v| *v = v.max(0.0));
                }
                h = z;
            }
            for a in 0..2 {
                assert!((q[row * 2 + a] - h[a]).abs() < 1e-5, "{q:?} vs {h:?}");
            }
        }
        assert!(s.q_values(&p, &obs[..4], &Device::Cpu).is_err());
        assert!(matches!(
            s.q_values(&p[1..], &obs, &Device::Cpu),
            Err(NnError::ParamLength { .. })
        ));
    }
}
