//! The engine's randomness, injected by whoever builds it (DESIGN §1: entropy is injected).
//!
//! The engine draws two things per round: the cohort (which units are offered the round) and
//! the noise of the release; and, once per run, the DataRelease's generator (its candidates and
//! its sparse-vector noise, [`EntropySource::release_rng`]). It asks an [`EntropySource`] for a fresh generator of each, per
//! round, so that the same source always gives the same round the same randomness no matter
//! what happened in earlier rounds (a replay of round r does not depend on how many values
//! round r - 1 consumed). Private runs use [`OsEntropy`] (ChaCha20 seeded by the operating
//! system for every round); `seed = ...` runs use [`SeededEntropy`] (reproducible, and recorded
//! as not private by the noise source in every ledger record).

use fedrl_common::privacy::noise::{DiscreteGaussianNoise, NoiseSource};
use rand::SeedableRng;
use rand::rngs::{ChaCha20Rng, SysRng};
use thiserror::Error;

/// The engine could not get randomness: nothing is drawn, and the run stops.
#[derive(Debug, Error)]
#[error("the operating system's random source failed: {0}")]
pub struct EntropyError(pub String);

/// Where the engine's per-round randomness comes from.
pub trait EntropySource: Send {
    /// The generator that draws round `round`'s cohort (fresh: a uniform subset; sampled: the
    /// Poisson sample). Called once per opened round.
    fn cohort_rng(&mut self, round: u64) -> Result<ChaCha20Rng, EntropyError>;
    /// The noise generator of round `round`'s release; its [`DiscreteGaussianNoise::source`] is what
    /// the ledger record says about the noise. Called once per closed private round.
    fn noise(&mut self, round: u64) -> Result<DiscreteGaussianNoise, EntropyError>;
    /// The generator of the DataRelease (candidates, threshold and query noise), with what the
    /// release's ledger record says about it. Called once, when the walk starts.
    fn release_rng(&mut self) -> Result<(ChaCha20Rng, NoiseSource), EntropyError>;
}

/// The private setting: every generator is ChaCha20 seeded from the operating system.
#[derive(Clone, Copy, Debug, Default)]
pub struct OsEntropy;

impl EntropySource for OsEntropy {
    fn cohort_rng(&mut self, _round: u64) -> Result<ChaCha20Rng, EntropyError> {
        ChaCha20Rng::try_from_rng(&mut SysRng).map_err(|e| EntropyError(e.to_string()))
    }

    fn noise(&mut self, _round: u64) -> Result<DiscreteGaussianNoise, EntropyError> {
        DiscreteGaussianNoise::from_os().map_err(|e| EntropyError(e.to_string()))
    }

    fn release_rng(&mut self) -> Result<(ChaCha20Rng, NoiseSource), EntropyError> {
        let rng =
            ChaCha20Rng::try_from_rng(&mut SysRng).map_err(|e| EntropyError(e.to_string()))?;
        Ok((rng, NoiseSource::Os))
    }
}

/// Reproducible randomness from one seed: round r's noise is `DiscreteGaussianNoise::seeded(
/// round_noise_seed(seed, r))` and its cohort generator is derived from the same round seed.
/// Anyone who knows the seed can subtract the noise: **not private**, for research runs only.
#[derive(Clone, Copy, Debug)]
pub struct SeededEntropy {
    seed: u64,
}

impl SeededEntropy {
    pub fn new(seed: u64) -> Self {
        SeededEntropy { seed }
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }
}

impl EntropySource for SeededEntropy {
    fn cohort_rng(&mut self, round: u64) -> Result<ChaCha20Rng, EntropyError> {
        Ok(ChaCha20Rng::seed_from_u64(splitmix64(
            round_noise_seed(self.seed, round) ^ 0xc0,
        )))
    }

    fn noise(&mut self, round: u64) -> Result<DiscreteGaussianNoise, EntropyError> {
        Ok(DiscreteGaussianNoise::seeded(round_noise_seed(
            self.seed, round,
        )))
    }

    /// Derived from the seed apart from every round's generators; recorded as
    /// `Seeded { seed }` (the run's seed), as the rounds' records are.
    fn release_rng(&mut self) -> Result<(ChaCha20Rng, NoiseSource), EntropyError> {
        let rng = ChaCha20Rng::seed_from_u64(splitmix64(self.seed ^ 0xDA7A_2E1E_A5E0_0002));
        Ok((rng, NoiseSource::Seeded { seed: self.seed }))
    }
}

/// [`SeededEntropy`] for `Some(seed)`, [`OsEntropy`] for `None` (a scenario's `seed` field).
pub fn for_seed(seed: Option<u64>) -> Box<dyn EntropySource> {
    match seed {
        Some(s) => Box::new(SeededEntropy::new(s)),
        None => Box::new(OsEntropy),
    }
}

/// The seed of round `round`'s noise in a seeded run (public so tests can reproduce a release).
pub fn round_noise_seed(seed: u64, round: u64) -> u64 {
    splitmix64(seed ^ splitmix64(round.wrapping_add(0x006e_6f69_7365)))
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fedrl_common::privacy::noise::NoiseSource;
    use rand::RngExt;

    #[test]
    fn seeded_rounds_are_reproducible_and_independent_of_call_order() {
        let mut a = SeededEntropy::new(3);
        let mut b = SeededEntropy::new(3);
        // b asks for round 2 first: round 1 must not change.
        let b2: u64 = b.cohort_rng(2).unwrap().random();
        let a1: u64 = a.cohort_rng(1).unwrap().random();
        let b1: u64 = b.cohort_rng(1).unwrap().random();
        assert_eq!(a1, b1);
        assert_ne!(a1, b2);
        assert_eq!(
            a.noise(5).unwrap().source(),
            NoiseSource::Seeded {
                seed: round_noise_seed(3, 5)
            }
        );
    }

    #[test]
    fn os_entropy_is_private_and_not_repeated() {
        let mut os = OsEntropy;
        assert_eq!(os.noise(1).unwrap().source(), NoiseSource::Os);
        let x: u64 = os.cohort_rng(1).unwrap().random();
        let y: u64 = os.cohort_rng(1).unwrap().random();
        assert_ne!(x, y, "two OS-seeded generators gave the same first value");
    }
}
