//! The noise generator of releases: exact discrete Gaussian noise ([`DiscreteGaussianNoise`]),
//! integers drawn exactly (see [`super::discrete_gaussian`]) and added to a fixed-point sum
//! ([`super::fixed_point`]). There is deliberately no floating-point Gaussian sampler here:
//! such samplers leave gaps that can reveal the exact value being noised (Mironov 2012).
//!
//! Production noise comes from ChaCha20 seeded by the operating system (a CSPRNG). A `--seed` run
//! uses the same generator seeded from a number, for reproducible research; every place that
//! records the noise ([`NoiseSource`]) says which one ran, so a seeded run is never mistaken for a
//! private one.

use rand::SeedableRng;
use rand::rngs::{ChaCha20Rng, SysRng};
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(a.source().to_string().contains("not private"));
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
}
