//! Exponential moving average of the denoiser's weights, from which samples are drawn: the
//! schedule of `ema-pytorch` 0.4.2 (the version PrivORL pins, `requirements.txt`), with the
//! trainers' settings `beta = 0.995`, `update_every = 10` (SynthER/PrivORL `Trainer`,
//! `elucidated_diffusion.py`) and the library's defaults `update_after_step = 100`,
//! `inv_gamma = 1`, `power = 2/3`, `min_value = 0`.
//!
//! [`Ema::update`] is called once per optimiser step. With `k` the number of earlier calls:
//! nothing happens unless `k % update_every == 0`; while `k <= update_after_step` the average
//! is a copy of the weights; afterwards `avg <- avg + (1 - decay) (w - avg)` with
//! `decay = clamp(1 - (1 + e / inv_gamma)^-power, min_value, beta)`, `e = k - update_after_step`
//! (0 when `e <= 0`).

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::{NnError, Result};

/// The EMA schedule's constants.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EmaConfig {
    /// Largest decay.
    pub beta: f64,
    /// Average only every this many calls.
    pub update_every: u64,
    /// Copy the weights (no averaging) up to this many calls.
    pub update_after_step: u64,
    pub inv_gamma: f64,
    pub power: f64,
    pub min_value: f64,
}

impl Default for EmaConfig {
    fn default() -> Self {
        EmaConfig {
            beta: 0.995,
            update_every: 10,
            update_after_step: 100,
            inv_gamma: 1.0,
            power: 2.0 / 3.0,
            min_value: 0.0,
        }
    }
}

impl EmaConfig {
    pub fn check(&self) -> Result<()> {
        let ok = (0.0..=1.0).contains(&self.beta)
            && self.update_every > 0
            && self.inv_gamma.is_finite()
            && self.inv_gamma > 0.0
            && self.power.is_finite()
            && self.power > 0.0
            && (0.0..=self.beta).contains(&self.min_value);
        if !ok {
            return Err(NnError::Invalid(format!(
                "EMA constants out of range: {self:?}"
            )));
        }
        Ok(())
    }

    /// The decay used by the call made after `calls` earlier calls.
    pub fn decay(&self, calls: u64) -> f64 {
        let e = calls as f64 - self.update_after_step as f64;
        if e <= 0.0 {
            return 0.0;
        }
        (1.0 - (1.0 + e / self.inv_gamma).powf(-self.power)).clamp(self.min_value, self.beta)
    }
}

/// The moving average of a list of tensors.
#[derive(Clone, Debug)]
pub struct Ema {
    cfg: EmaConfig,
    calls: u64,
    params: Vec<Tensor>,
}

impl Ema {
    /// Starts as a copy of `params`.
    pub fn new(cfg: EmaConfig, params: &[Tensor]) -> Result<Self> {
        cfg.check()?;
        Ok(Ema {
            cfg,
            calls: 0,
            params: copies(params)?,
        })
    }

    /// Continues an average saved after `calls` updates.
    pub fn resume(cfg: EmaConfig, calls: u64, params: Vec<Tensor>) -> Result<Self> {
        cfg.check()?;
        Ok(Ema { cfg, calls, params })
    }

    /// The averaged tensors.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// Calls to [`Self::update`] so far.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// One call after an optimiser step of `online` (same shapes as the average).
    pub fn update(&mut self, online: &[Tensor]) -> Result<()> {
        if online.len() != self.params.len() {
            return Err(NnError::Invalid("EMA: parameter lists differ".into()));
        }
        let k = self.calls;
        self.calls += 1;
        if !k.is_multiple_of(self.cfg.update_every) {
            return Ok(());
        }
        if k <= self.cfg.update_after_step {
            self.params = copies(online)?;
            return Ok(());
        }
        let decay = self.cfg.decay(k);
        for (avg, w) in self.params.iter_mut().zip(online) {
            let w = w.detach();
            *avg = (&*avg + ((w - &*avg)? * (1.0 - decay))?)?;
        }
        Ok(())
    }
}

/// Detached copies (new storage) of `params`.
fn copies(params: &[Tensor]) -> Result<Vec<Tensor>> {
    Ok(params
        .iter()
        .map(|t| t.detach().copy())
        .collect::<candle_core::Result<_>>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn follows_the_ema_pytorch_schedule() {
        let cfg = EmaConfig {
            update_every: 2,
            update_after_step: 2,
            ..EmaConfig::default()
        };
        let dev = Device::Cpu;
        let mut ema = Ema::new(cfg, &[Tensor::new(&[0.0f32], &dev).unwrap()]).unwrap();
        let val = |e: &Ema| e.params()[0].to_vec1::<f32>().unwrap()[0] as f64;
        // Calls 0..=2: copy on even calls (0 and 2); call 1 skipped.
        for (k, w) in [(0, 1.0f32), (1, 5.0), (2, 2.0)] {
            ema.update(&[Tensor::new(&[w], &dev).unwrap()]).unwrap();
            assert_eq!(ema.calls(), k + 1);
        }
        assert_eq!(val(&ema), 2.0);
        // Call 3 skipped; call 4: e = 2, decay = 1 - 3^(-2/3).
        ema.update(&[Tensor::new(&[9.0f32], &dev).unwrap()])
            .unwrap();
        assert_eq!(val(&ema), 2.0);
        ema.update(&[Tensor::new(&[4.0f32], &dev).unwrap()])
            .unwrap();
        let decay = 1.0 - 3f64.powf(-2.0 / 3.0);
        assert!((val(&ema) - (2.0 + (1.0 - decay) * 2.0)).abs() < 1e-6);
        // The decay saturates at beta.
        assert_eq!(cfg.decay(10_000_000), 0.995);
    }
}
