//! The noise generator of releases: exact discrete Gaussian noise ([`DiscreteGaussianNoise`]),
//! integers drawn exactly (see [`super::discrete_gaussian`]) and added to a fixed-point sum
//! ([`super::fixed_point`]). There is deliberately no floating-point Gaussian sampler here:
//! such samplers leave gaps that can reveal the exact value being noised (Mironov 2012).
//!
//! Production noise comes from ChaCha20 seeded by the operating system (a CSPRNG). A `--seed` run
//! uses the same generator seeded from a number, for reproducible research; every place that
//! records the noise ([`NoiseSource`]) says which one ran, so a seeded run is never mistaken for a
//! private one.
//!
//! # Noise for a vector, in parallel ([`DiscreteGaussianNoise::add_to`])
//!
//! A model of a million parameters needs a million exact samples per release, so a vector's
//! noise is drawn on all of rayon's threads. The vector is cut into chunks of the FIXED size
//! [`NOISE_CHUNK`]; for each chunk, in order, the generator yields 256 bits that key a fresh
//! ChaCha20 generator, and that generator draws the chunk's samples (on whichever thread).
//! Why this keeps the guarantees (DESIGN §3):
//! - **Exact noise.** Each chunk runs the same exact sampler on its own stream of bits, and the
//!   streams are independent of each other and of the data, so every coordinate is an
//!   independent exact `N_Z(0, sigma^2)` sample, as with one stream.
//! - **A CSPRNG drawn by the engine.** The keys are consecutive outputs of the generator the
//!   engine was given (OS-seeded ChaCha20 in a private run): ChaCha20 keyed with uniform 256-bit
//!   keys is the same pseudorandom function the single stream relied on, so the chunks' streams
//!   are indistinguishable from independent uniform bits exactly when the single stream was
//!   indistinguishable from uniform (the standard key-derivation argument; no new assumption).
//!   No key is reused: every release draws fresh keys from its own generator.
//! - **Reproducible.** The chunk boundaries and the order in which keys are drawn depend only on
//!   the vector's length, never on the number of threads or on scheduling, and each chunk's
//!   samples depend only on its key; so a seeded run, and the journal replay of any run, gives
//!   the same noise bit for bit on any machine.

use rand::rngs::{ChaCha20Rng, SysRng};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
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

    /// Adds an independent sample of `noise` to every component of `v`, in parallel on rayon's
    /// threads with one ChaCha20 stream per chunk of [`NOISE_CHUNK`] coordinates, each keyed by
    /// 256 bits of this generator drawn in chunk order (see the module docs: the result does not
    /// depend on the number of threads). On error (an overflow of i64, see
    /// [`super::fixed_point::Grid::max_contributions`] for why it cannot happen with the
    /// fixed-point sum) `v` is partly noised and must be discarded.
    pub fn add_to(
        &mut self,
        v: &mut [i64],
        noise: &DiscreteGaussian,
    ) -> Result<(), DiscreteGaussianError> {
        let keys: Vec<[u8; 32]> = v
            .chunks(NOISE_CHUNK)
            .map(|_| {
                let mut key = [0u8; 32];
                self.rng.fill_bytes(&mut key);
                key
            })
            .collect();
        v.par_chunks_mut(NOISE_CHUNK)
            .zip(keys.par_iter())
            .try_for_each(|(chunk, key)| noise.add_to(&mut ChaCha20Rng::from_seed(*key), chunk))
    }
}

/// Coordinates per independent noise stream in [`DiscreteGaussianNoise::add_to`]. Fixed (part
/// of what a seeded run reproduces): changing it changes every seeded release's noise. Large
/// enough that keying a generator (one ChaCha20 block) is negligible next to the chunk's
/// samples, small enough that a 70 k-parameter model still spreads over a few threads.
pub const NOISE_CHUNK: usize = 4096;

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
