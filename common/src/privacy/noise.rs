//! Noise generators: exact discrete Gaussian noise for releases ([`DiscreteGaussianNoise`]) and
//! floating-point Gaussian noise ([`GaussianNoise`]).
//!
//! [`DiscreteGaussianNoise`] is the private mechanism: integer noise drawn exactly (see
//! [`super::discrete_gaussian`]) and added to a fixed-point sum ([`super::fixed_point`]).
//! [`GaussianNoise`] is a floating-point sampler; such samplers leave gaps that can reveal the
//! exact value being noised (Mironov 2012), so it is for simulations only. It stays while the
//! round engine is moved onto the fixed-point path.
//!
//! Production noise comes from ChaCha20 seeded by the operating system (a CSPRNG). A `--seed` run
//! uses the same generator seeded from a number, for reproducible research; every place that
//! records the noise ([`NoiseSource`]) says which one ran, so a seeded run is never mistaken for a
//! private one.

use rand::SeedableRng;
use rand::rngs::{ChaCha20Rng, SysRng};
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

use super::PrivacyError;
use super::discrete_gaussian::{DiscreteGaussian, DiscreteGaussianError};

/// Where the noise of a release came from. Recorded in the ledger and in reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum NoiseSource {
    /// ChaCha20 seeded from the operating system: the private setting.
    Os,
    /// ChaCha20 seeded from `seed`: reproducible, and therefore **not** private against anyone
    /// who knows the seed.
    Seeded { seed: u64 },
}

impl NoiseSource {
    /// True when an adversary cannot reproduce the noise.
    pub fn is_private(&self) -> bool {
        matches!(self, NoiseSource::Os)
    }
}

impl std::fmt::Display for NoiseSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoiseSource::Os => write!(f, "os-csprng (ChaCha20 seeded by the OS)"),
            NoiseSource::Seeded { seed } => {
                write!(
                    f,
                    "seeded (ChaCha20, seed {seed}; reproducible, not private)"
                )
            }
        }
    }
}

/// ChaCha20 seeded by the operating system.
fn os_chacha() -> Result<ChaCha20Rng, PrivacyError> {
    ChaCha20Rng::try_from_rng(&mut SysRng)
        .map_err(|e| PrivacyError::InvalidParameter(format!("the OS random source failed: {e}")))
}

/// A generator of exact discrete Gaussian noise `N_Z(0, sigma^2)` on integer vectors (grid units),
/// driven by ChaCha20. Only integer arithmetic touches the random stream.
pub struct DiscreteGaussianNoise {
    rng: ChaCha20Rng,
    source: NoiseSource,
}

impl DiscreteGaussianNoise {
    /// A generator seeded by the operating system's random source: the private setting.
    pub fn from_os() -> Result<Self, PrivacyError> {
        Ok(Self {
            rng: os_chacha()?,
            source: NoiseSource::Os,
        })
    }

    /// A reproducible generator; it identifies itself as seeded wherever it is recorded.
    pub fn seeded(seed: u64) -> Self {
        Self {
            rng: ChaCha20Rng::seed_from_u64(seed),
            source: NoiseSource::Seeded { seed },
        }
    }

    /// `from_os()` when `seed` is `None`, else `seeded(seed)`.
    pub fn new(seed: Option<u64>) -> Result<Self, PrivacyError> {
        match seed {
            Some(s) => Ok(Self::seeded(s)),
            None => Self::from_os(),
        }
    }

    /// Where the noise comes from (recorded in the ledger).
    pub fn source(&self) -> NoiseSource {
        self.source
    }

    /// One sample of `noise` (grid units).
    pub fn sample(&mut self, noise: &DiscreteGaussian) -> Result<i64, DiscreteGaussianError> {
        noise.sample(&mut self.rng)
    }

    /// Adds an independent sample of `noise` to every component of `v`. On error (an overflow of
    /// i64, see [`super::fixed_point::Grid::max_contributions`] for why it cannot happen with
    /// the fixed-point sum) `v` is partly noised and must be discarded.
    pub fn add_to(
        &mut self,
        v: &mut [i64],
        noise: &DiscreteGaussian,
    ) -> Result<(), DiscreteGaussianError> {
        for x in v.iter_mut() {
            let e = noise.sample(&mut self.rng)?;
            *x = x.checked_add(e).ok_or(DiscreteGaussianError::Overflow(
                "adding noise to an i64 sum",
            ))?;
        }
        Ok(())
    }
}

/// A generator of floating-point Gaussian noise vectors (simulations only; see the module docs).
pub struct GaussianNoise {
    rng: ChaCha20Rng,
    source: NoiseSource,
}

impl GaussianNoise {
    /// A generator seeded by the operating system's random source.
    pub fn from_os() -> Result<Self, PrivacyError> {
        Ok(Self {
            rng: os_chacha()?,
            source: NoiseSource::Os,
        })
    }

    /// A reproducible generator; it identifies itself as seeded wherever it is recorded.
    pub fn seeded(seed: u64) -> Self {
        Self {
            rng: ChaCha20Rng::seed_from_u64(seed),
            source: NoiseSource::Seeded { seed },
        }
    }

    /// `from_os()` when `seed` is `None`, else `seeded(seed)`.
    pub fn new(seed: Option<u64>) -> Result<Self, PrivacyError> {
        match seed {
            Some(s) => Ok(Self::seeded(s)),
            None => Self::from_os(),
        }
    }

    pub fn source(&self) -> NoiseSource {
        self.source
    }

    /// Adds independent N(0, std^2) noise to every component of `v`. The sample is drawn in f64
    /// and rounded once when added.
    pub fn add_to(&mut self, v: &mut [f32], std: f64) -> Result<(), PrivacyError> {
        if !(std.is_finite() && std >= 0.0) {
            return Err(PrivacyError::InvalidParameter(format!(
                "noise standard deviation must be finite and >= 0, got {std}"
            )));
        }
        for x in v.iter_mut() {
            let n: f64 = StandardNormal.sample(&mut self.rng);
            *x = (*x as f64 + std * n) as f32;
        }
        Ok(())
    }

    /// One standard normal sample (for mechanisms other than vector noise).
    pub fn standard_normal(&mut self) -> f64 {
        StandardNormal.sample(&mut self.rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_noise_is_reproducible_and_says_so() {
        let mut a = GaussianNoise::seeded(7);
        let mut b = GaussianNoise::seeded(7);
        let (mut va, mut vb) = (vec![0f32; 100], vec![0f32; 100]);
        a.add_to(&mut va, 2.0).unwrap();
        b.add_to(&mut vb, 2.0).unwrap();
        assert_eq!(va, vb);
        assert!(!a.source().is_private());
        assert!(a.source().to_string().contains("not private"));
    }

    #[test]
    fn os_noise_differs_between_generators_and_has_the_right_scale() {
        let mut a = GaussianNoise::from_os().unwrap();
        let mut b = GaussianNoise::from_os().unwrap();
        let n = 200_000;
        let (mut va, mut vb) = (vec![0f32; n], vec![0f32; n]);
        a.add_to(&mut va, 3.0).unwrap();
        b.add_to(&mut vb, 3.0).unwrap();
        assert_ne!(va, vb);
        assert!(a.source().is_private());
        let mean = va.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let var = va.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        // Standard error of the variance estimate is ~ 9 * sqrt(2/n) = 0.03.
        assert!((var - 9.0).abs() < 0.2, "variance {var}");
        assert!(mean.abs() < 0.05, "mean {mean}");
    }

    #[test]
    fn discrete_noise_is_reproducible_when_seeded_and_differs_from_the_os() {
        let g = DiscreteGaussian::new(10_000, 1).unwrap();
        let (mut a, mut b) = (
            DiscreteGaussianNoise::seeded(9),
            DiscreteGaussianNoise::seeded(9),
        );
        let (mut va, mut vb) = (vec![5i64; 200], vec![5i64; 200]);
        a.add_to(&mut va, &g).unwrap();
        b.add_to(&mut vb, &g).unwrap();
        assert_eq!(va, vb);
        assert!(va.iter().any(|&x| x != 5));
        assert!(!a.source().is_private());
        let mut os = DiscreteGaussianNoise::from_os().unwrap();
        assert!(os.source().is_private());
        let mut vo = vec![5i64; 200];
        os.add_to(&mut vo, &g).unwrap();
        assert_ne!(vo, va);
    }

    #[test]
    fn discrete_noise_reports_overflow_instead_of_wrapping() {
        let g = DiscreteGaussian::new(10_000, 1).unwrap();
        let mut a = DiscreteGaussianNoise::seeded(1);
        // Half of the samples are positive, so some addition overflows i64::MAX.
        let mut v = vec![i64::MAX; 64];
        assert!(matches!(
            a.add_to(&mut v, &g),
            Err(DiscreteGaussianError::Overflow(_))
        ));
    }

    #[test]
    fn rejects_bad_std() {
        let mut a = GaussianNoise::seeded(1);
        assert!(a.add_to(&mut [0.0], f64::NAN).is_err());
        assert!(a.add_to(&mut [0.0], -1.0).is_err());
    }
}
