//! Fixed-point aggregation on a public grid, released with exact discrete Gaussian noise.
//!
//! The private sum of clipped updates is held as integers on a grid of step `gamma` (a power of
//! two derived only from the public clip norm, [`Grid`]), and the noise added to it is an exact
//! discrete Gaussian in grid units ([`super::discrete_gaussian`]). Only the noisy integer vector
//! is turned back into floating point, which is post-processing. This replaces summing in f64,
//! rounding to f32 and adding floating-point Gaussian noise, whose gaps can reveal the exact sum
//! (Mironov 2012). Integers are also what secure aggregation needs.
//!
//! The L2 sensitivity in grid units is exactly `Delta = sqrt(floor((C / gamma)^2))`: each
//! coordinate is rounded toward zero (so the integer vector is never longer than the float one)
//! and the squared integer norm is then checked exactly against `floor((C / gamma)^2)`.
//!
//! Typical use (the round engine, or [`noisy_mean`] for tests and examples):
//! ```
//! use fedrl_common::privacy::fixed_point::{FixedPointSum, Grid, NoiseCalibration, DEFAULT_GRID_BITS};
//! use fedrl_common::privacy::noise::DiscreteGaussianNoise;
//! let grid = Grid::for_clip_norm(1.0, DEFAULT_GRID_BITS)?;
//! let calibration = NoiseCalibration::new(&grid, 1.1)?; // noise multiplier z = 1.1
//! let mut sum = FixedPointSum::new(grid, 3);
//! sum.add_clipping(&[0.5, -0.25, 2.0])?; // clipped to norm 1 on the way in
//! sum.add_clipping(&[0.1, 0.2, 0.3])?;
//! let mut noise = DiscreteGaussianNoise::seeded(7);
//! let mean = sum.release(&mut noise, &calibration, 100.0)?; // divided by the public cohort size
//! assert_eq!(mean.len(), 3);
//! // What the ledger records: a discrete Gaussian with these two numbers (grid units).
//! assert!(calibration.sigma() / calibration.l2_sensitivity() >= 1.1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::BinaryHeap;

use thiserror::Error;

use super::clipping::{Clipped, clip_l2};
use super::discrete_gaussian::{DiscreteGaussian, DiscreteGaussianError, wide};
use super::noise::DiscreteGaussianNoise;

/// Default grid resolution: `gamma = 2^(floor(log2 C) - 24)`, so `C / gamma` is in
/// `[2^24, 2^25)`. Rounding toward zero then loses at most `gamma <= C 2^-24` per coordinate
/// and contribution, far below any useful noise (`z C` with `z` of order 1), while sums of up to
/// `2^36` contributions and sigma up to `2^31` grid units (z up to 64) stay within i64.
pub const DEFAULT_GRID_BITS: u32 = 24;

/// Largest accepted grid resolution (`C / gamma < 2^31`).
pub const MAX_GRID_BITS: u32 = 30;

/// Smallest noise standard deviation the mechanism accepts, in grid units. At `sigma >= 10`
/// the discrete Gaussian's deviations from the continuous one are negligible (see
/// [`super::discrete_gaussian`]); with the default grid sigma is of order `2^24` anyway.
pub const MIN_SIGMA_GRID_UNITS: u64 = 10;

/// Bound on the magnitude of every coordinate of a fixed-point sum before noise: half of the
/// i64 range, the other half being headroom for the noise (see [`Grid::max_contributions`]).
const SUM_BOUND: u64 = 1 << 62;

/// Relative overshoot of the squared norm (above `floor((C/gamma)^2)`) that quantisation
/// repairs by shrinking coordinates: about 5e-7 in norm, a few f32 ulps of a float clip. More
/// than that means the input was not clipped to `C`, which is an error, not something to fix.
const OVERSHOOT_SHIFT: u32 = 20;

/// Errors of fixed-point aggregation.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum FixedPointError {
    /// The clip norm must be a finite, normal, positive number.
    #[error("clip norm must be finite and > 0 (a normal f64), got {0}")]
    InvalidClipNorm(f64),
    /// The grid resolution must be in `1..=MAX_GRID_BITS`.
    #[error("grid bits must be in 1..={max}, got {bits}")]
    InvalidBits { bits: u32, max: u32 },
    /// An update has the wrong number of coordinates.
    #[error("update has {got} coordinates, the sum has {expected}")]
    WrongLength { expected: usize, got: usize },
    /// An update has a NaN or infinite coordinate.
    #[error("update coordinate {index} is not finite")]
    NonFinite { index: usize },
    /// An update passed as clipped is longer than the clip norm by more than rounding explains.
    #[error(
        "update is not clipped to the grid's clip norm: squared norm {norm_sq} > {bound_sq} grid units squared"
    )]
    NotClipped { norm_sq: u128, bound_sq: u128 },
    /// The sum already holds the most contributions its i64 coordinates can take.
    #[error("the fixed-point sum holds its maximum of {max} contributions")]
    TooManyContributions { max: u64 },
    /// The noise multiplier must be finite and > 0.
    #[error("noise multiplier must be finite and > 0, got {0}")]
    InvalidNoiseMultiplier(f64),
    /// The noise would be below `MIN_SIGMA_GRID_UNITS` grid units.
    #[error(
        "noise standard deviation of sqrt({variance}) grid units is below the minimum of {min} grid units"
    )]
    NoiseTooSmall { variance: u64, min: u64 },
    /// The noise variance in grid units would exceed the sampler's bound of `2^62`.
    #[error("noise variance of {variance:e} grid units squared exceeds 2^62 (use fewer grid bits)")]
    NoiseTooLarge { variance: f64 },
    /// The calibration was made for another grid.
    #[error("the noise calibration was made for a different grid")]
    GridMismatch,
    /// The divisor of the release must be finite and > 0.
    #[error("denominator must be finite and > 0, got {0}")]
    InvalidDenominator(f64),
    /// The sampler failed (an event of probability below `exp(-2^64)`).
    #[error(transparent)]
    Noise(#[from] DiscreteGaussianError),
}

/// The public grid: step `gamma = 2^(floor(log2 C) - bits)` and the exact squared L2 sensitivity
/// `floor((C / gamma)^2)` in grid units. Depends only on the clip norm `C` and `bits`, both
/// public scenario constants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Grid {
    clip_norm: f64,
    bits: u32,
    /// log2 of gamma.
    log2_gamma: i32,
    /// `floor((C / gamma)^2)`, in `[2^(2 bits), 2^(2 bits + 2))`.
    sensitivity_sq: u128,
}

/// `2^e` as f64, for `e` in the normal range.
fn pow2(e: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&e));
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// `(M, k)` with `x = M 2^k` exactly, `M` an integer below `2^53`, for a finite normal `x > 0`.
fn decompose(x: f64) -> (u64, i32) {
    let bits = x.to_bits();
    let exp = ((bits >> 52) & 0x7ff) as i32;
    let mantissa = (bits & ((1 << 52) - 1)) | (1 << 52);
    (mantissa, exp - 1075)
}

impl Grid {
    /// The grid for clip norm `clip_norm` (`C`, the L2 bound of one unit's update) with
    /// `C / gamma` in `[2^bits, 2^(bits+1))`. Use [`DEFAULT_GRID_BITS`] unless there is a reason.
    pub fn for_clip_norm(clip_norm: f64, bits: u32) -> Result<Self, FixedPointError> {
        if !(clip_norm.is_finite() && clip_norm.is_normal() && clip_norm > 0.0) {
            return Err(FixedPointError::InvalidClipNorm(clip_norm));
        }
        if !(1..=MAX_GRID_BITS).contains(&bits) {
            return Err(FixedPointError::InvalidBits {
                bits,
                max: MAX_GRID_BITS,
            });
        }
        let (_, k) = decompose(clip_norm);
        let floor_log2 = k + 52;
        let log2_gamma = floor_log2 - bits as i32;
        if log2_gamma < -1022 || bits as i32 - floor_log2 > 1023 {
            return Err(FixedPointError::InvalidClipNorm(clip_norm));
        }
        // C / gamma = C 2^(bits - floor_log2): a power-of-two scaling, exact, in [2^bits, 2^(bits+1)).
        let ratio = clip_norm * pow2(bits as i32 - floor_log2);
        let (m, k) = decompose(ratio);
        let m_sq = (m as u128) * (m as u128);
        // ratio^2 = m^2 2^(2k) < 2^62: shift left exactly, or right (a floor) when k < 0.
        let sensitivity_sq = if k >= 0 {
            m_sq << (2 * k)
        } else {
            m_sq >> (-2 * k)
        };
        Ok(Self {
            clip_norm,
            bits,
            log2_gamma,
            sensitivity_sq,
        })
    }

    /// The clip norm `C` this grid was made for.
    pub fn clip_norm(&self) -> f64 {
        self.clip_norm
    }

    /// The resolution: `C / gamma` is in `[2^bits, 2^(bits+1))`.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// The grid step `gamma` (update units per grid unit), an exact power of two.
    pub fn gamma(&self) -> f64 {
        pow2(self.log2_gamma)
    }

    /// `1 / gamma`, exact.
    fn inverse_gamma(&self) -> f64 {
        pow2(-self.log2_gamma)
    }

    /// Squared L2 sensitivity of one contribution in grid units: exactly `floor((C / gamma)^2)`.
    pub fn l2_sensitivity_sq(&self) -> u128 {
        self.sensitivity_sq
    }

    /// L2 sensitivity in grid units, `sqrt(floor((C / gamma)^2)) <= C / gamma`, rounded up.
    pub fn l2_sensitivity(&self) -> f64 {
        sqrt_up(self.sensitivity_sq)
    }

    /// Most contributions a [`FixedPointSum`] on this grid accepts: every coordinate of a
    /// contribution is below `2^(bits+1)` in magnitude, so the sum stays within `2^62`, leaving
    /// the other half of the i64 range to the noise (whose standard deviation is at most `2^31`
    /// grid units: exceeding `2^62` would be a `2^31`-sigma event). With the default 24 bits this
    /// is `2^36`, about 6.9e10.
    pub fn max_contributions(&self) -> u64 {
        SUM_BOUND >> (self.bits + 1)
    }

    /// Quantises an update already clipped to L2 norm `C` into `out` (grid units): every
    /// coordinate is rounded toward zero (`|q_i| <= |x_i| / gamma`), then the squared norm is
    /// checked exactly; if rounding in the float clip overshot `floor((C/gamma)^2)` by a hair,
    /// the largest `|q_i|` is shrunk by one until it holds. Non-finite coordinates, a wrong
    /// length and an unclipped update are errors.
    pub fn quantize(&self, clipped: &[f32], out: &mut [i64]) -> Result<(), FixedPointError> {
        if clipped.len() != out.len() {
            return Err(FixedPointError::WrongLength {
                expected: out.len(),
                got: clipped.len(),
            });
        }
        let scale = self.inverse_gamma();
        // A clipped coordinate is at most C / gamma < 2^(bits+1) grid units; twice that bounds
        // anything rounding can produce and keeps every square below 2^64.
        let limit = (1u64 << (self.bits + 2)) as f64;
        let mut norm_sq: u128 = 0;
        for (i, (&x, q)) in clipped.iter().zip(out.iter_mut()).enumerate() {
            if !x.is_finite() {
                return Err(FixedPointError::NonFinite { index: i });
            }
            // f32 -> f64 is exact and scaling by a power of two is exact in the normal range
            // (below it the value is < 1 and truncates to 0), so this truncates the exact x/gamma.
            let scaled = (x as f64 * scale).trunc();
            if scaled.abs() >= limit {
                return Err(FixedPointError::NotClipped {
                    norm_sq: u128::MAX,
                    bound_sq: self.sensitivity_sq,
                });
            }
            *q = scaled as i64;
            norm_sq += (q.unsigned_abs() as u128).pow(2);
        }
        if norm_sq > self.sensitivity_sq {
            if norm_sq - self.sensitivity_sq > self.sensitivity_sq >> OVERSHOOT_SHIFT {
                return Err(FixedPointError::NotClipped {
                    norm_sq,
                    bound_sq: self.sensitivity_sq,
                });
            }
            shrink_largest(out, norm_sq, self.sensitivity_sq);
        }
        Ok(())
    }
}

/// Shrinks the largest `|q_i|` by one toward zero until `sum q_i^2 <= bound`.
fn shrink_largest(q: &mut [i64], mut norm_sq: u128, bound: u128) {
    let mut heap: BinaryHeap<(u64, usize)> = q
        .iter()
        .enumerate()
        .filter(|(_, x)| **x != 0)
        .map(|(i, x)| (x.unsigned_abs(), i))
        .collect();
    while norm_sq > bound {
        // norm_sq > 0, so a non-zero coordinate remains.
        let Some((m, i)) = heap.pop() else { break };
        // m^2 - (m - 1)^2 = 2m - 1.
        norm_sq -= 2 * m as u128 - 1;
        q[i] -= q[i].signum();
        if m > 1 {
            heap.push((m - 1, i));
        }
    }
}

/// `sqrt(x)` as f64, rounded up (relative error of the float ops < 2^-52, covered by 2^-50).
fn sqrt_up(x: u128) -> f64 {
    (x as f64).sqrt() * (1.0 + f64::EPSILON * 4.0)
}

/// `sqrt(x)` as f64, rounded down.
fn sqrt_down(x: u128) -> f64 {
    (x as f64).sqrt() * (1.0 - f64::EPSILON * 4.0)
}

/// The discrete Gaussian noise of a release and the two numbers the ledger records about it:
/// `sigma` and the L2 sensitivity, both in grid units (the mechanism is accounted as a Gaussian
/// with noise multiplier `sigma / l2_sensitivity`, see [`super::discrete_gaussian`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NoiseCalibration {
    grid: Grid,
    noise: DiscreteGaussian,
}

impl NoiseCalibration {
    /// Noise for noise multiplier `z` on `grid`: the variance (an integer number of grid units
    /// squared) is `z^2 Delta^2` rounded **up**, verified exactly in integer arithmetic, so
    /// `sigma / Delta >= z` holds with `Delta^2 = floor((C / gamma)^2)`. Refuses a standard
    /// deviation below [`MIN_SIGMA_GRID_UNITS`] or a variance above `2^62`.
    pub fn new(grid: &Grid, noise_multiplier: f64) -> Result<Self, FixedPointError> {
        let z = noise_multiplier;
        if !(z.is_finite() && z > 0.0) {
            return Err(FixedPointError::InvalidNoiseMultiplier(z));
        }
        let s = grid.sensitivity_sq;
        // Three roundings of relative size 2^-53 each (s to f64, two products); the 2^-40 margin
        // covers them, and the exact check below proves it.
        let estimate = z * z * (s as f64) * (1.0 + 2f64.powi(-40));
        let max = super::discrete_gaussian::MAX_VARIANCE_NUMERATOR;
        if estimate > max as f64 {
            return Err(FixedPointError::NoiseTooLarge { variance: estimate });
        }
        let variance = estimate.ceil() as u64;
        let min = MIN_SIGMA_GRID_UNITS * MIN_SIGMA_GRID_UNITS;
        if variance < min || !z.is_normal() {
            return Err(FixedPointError::NoiseTooSmall {
                variance,
                min: MIN_SIGMA_GRID_UNITS,
            });
        }
        if !variance_covers(variance, z, s) {
            // The margin makes this unreachable; refusing is the conservative answer.
            return Err(FixedPointError::NoiseTooLarge { variance: estimate });
        }
        let noise = DiscreteGaussian::new(variance, 1)?;
        Ok(Self { grid: *grid, noise })
    }

    /// The grid this calibration is for.
    pub fn grid(&self) -> &Grid {
        &self.grid
    }

    /// The noise distribution, `N_Z(0, sigma^2)` in grid units.
    pub fn distribution(&self) -> &DiscreteGaussian {
        &self.noise
    }

    /// Noise variance in grid units squared (an integer).
    pub fn variance(&self) -> u64 {
        self.noise.variance_numerator()
    }

    /// Noise standard deviation in grid units, rounded down (what the ledger records as `sigma`).
    pub fn sigma(&self) -> f64 {
        sqrt_down(self.noise.variance_numerator() as u128)
    }

    /// L2 sensitivity in grid units, rounded up (what the ledger records as `l2_sensitivity`).
    pub fn l2_sensitivity(&self) -> f64 {
        self.grid.l2_sensitivity()
    }

    /// `sigma / l2_sensitivity` rounded down: at least the requested noise multiplier.
    pub fn noise_multiplier(&self) -> f64 {
        self.sigma() / self.l2_sensitivity() * (1.0 - f64::EPSILON * 4.0)
    }

    /// Noise standard deviation in update units (`sigma gamma`), for reports.
    pub fn noise_std(&self) -> f64 {
        self.sigma() * self.grid.gamma()
    }
}

/// Exactly: `variance >= z^2 s`. With `z = m 2^k` (`m < 2^53`), this is
/// `variance 2^(-2k) >= m^2 s` for `k < 0` (256-bit integers), `variance >= m^2 s 2^(2k)` else.
fn variance_covers(variance: u64, z: f64, s: u128) -> bool {
    let (m, k) = decompose(z);
    let rhs = wide::mul((m as u128) * (m as u128), s);
    if k < 0 {
        match wide::shl(0, variance as u128, (-2 * k) as u32) {
            Some(lhs) => lhs >= rhs,
            // variance 2^(-2k) does not fit 256 bits, while m^2 s < 2^106 2^62 does.
            None => true,
        }
    } else {
        match wide::shl(rhs.0, rhs.1, (2 * k) as u32) {
            Some(rhs) => (0, variance as u128) >= rhs,
            None => false,
        }
    }
}

/// The sum of quantised, clipped updates on a [`Grid`] (grid units, exact), until it is
/// released with noise.
#[derive(Clone, Debug)]
pub struct FixedPointSum {
    grid: Grid,
    sum: Vec<i64>,
    count: u64,
    quantized: Vec<i64>,
    clipped: Vec<f32>,
}

impl FixedPointSum {
    /// An empty sum of `dim` coordinates.
    pub fn new(grid: Grid, dim: usize) -> Self {
        Self {
            grid,
            sum: vec![0; dim],
            count: 0,
            quantized: vec![0; dim],
            clipped: Vec::new(),
        }
    }

    /// Number of coordinates.
    pub fn dim(&self) -> usize {
        self.sum.len()
    }

    /// Number of contributions added.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The grid.
    pub fn grid(&self) -> &Grid {
        &self.grid
    }

    /// The exact, un-noised sum in grid units. Operator-only: never publish it.
    pub fn sum(&self) -> &[i64] {
        &self.sum
    }

    /// Adds an update already clipped to the grid's clip norm (see [`Grid::quantize`]). On
    /// error the sum is unchanged.
    pub fn add(&mut self, clipped: &[f32]) -> Result<(), FixedPointError> {
        if clipped.len() != self.sum.len() {
            return Err(FixedPointError::WrongLength {
                expected: self.sum.len(),
                got: clipped.len(),
            });
        }
        let max = self.grid.max_contributions();
        if self.count >= max {
            return Err(FixedPointError::TooManyContributions { max });
        }
        self.grid.quantize(clipped, &mut self.quantized)?;
        // |sum| <= count 2^(bits+1) <= 2^62 by max_contributions: no overflow.
        for (s, q) in self.sum.iter_mut().zip(&self.quantized) {
            *s += *q;
        }
        self.count += 1;
        Ok(())
    }

    /// Clips a copy of `update` to the grid's clip norm ([`clip_l2`]) and adds it; returns what
    /// clipping did. Non-finite coordinates are an error (not zeroed). On error the sum is
    /// unchanged.
    pub fn add_clipping(&mut self, update: &[f32]) -> Result<Clipped, FixedPointError> {
        if let Some(index) = update.iter().position(|x| !x.is_finite()) {
            return Err(FixedPointError::NonFinite { index });
        }
        let mut buf = std::mem::take(&mut self.clipped);
        buf.clear();
        buf.extend_from_slice(update);
        let clipped = clip_l2(&mut buf, self.grid.clip_norm);
        let added = self.add(&buf);
        self.clipped = buf;
        added.map(|()| clipped)
    }

    /// Releases `(sum + noise) gamma / denominator` as f32, with one independent discrete
    /// Gaussian sample from `calibration` per coordinate. `denominator` is the public divisor
    /// (the fixed expected cohort size, never the realised count). Everything after the noise
    /// is added is post-processing of the noisy integers.
    pub fn release(
        mut self,
        noise: &mut DiscreteGaussianNoise,
        calibration: &NoiseCalibration,
        denominator: f64,
    ) -> Result<Vec<f32>, FixedPointError> {
        if calibration.grid != self.grid {
            return Err(FixedPointError::GridMismatch);
        }
        if !(denominator.is_finite() && denominator > 0.0) {
            return Err(FixedPointError::InvalidDenominator(denominator));
        }
        noise.add_to(&mut self.sum, calibration.distribution())?;
        let gamma = self.grid.gamma();
        Ok(self
            .sum
            .iter()
            .map(|&v| (v as f64 * gamma / denominator) as f32)
            .collect())
    }
}

/// The result of [`noisy_mean`].
#[derive(Clone, Debug)]
pub struct NoisyMean {
    /// `(sum of clipped updates + discrete Gaussian noise) / denominator`.
    pub mean: Vec<f32>,
    /// The noise that was added (sigma and sensitivity in grid units, for the ledger).
    pub calibration: NoiseCalibration,
    /// Number of updates summed (operator-only: exact counts are not DP outputs).
    pub contributions: u64,
    /// How many of them were longer than the clip norm (operator-only).
    pub clipped: u64,
}

/// The project's one noisy aggregation in a single call: clips each update to L2 norm
/// `clip_norm`, sums them in fixed point on the default grid ([`DEFAULT_GRID_BITS`]), adds exact
/// discrete Gaussian noise for noise multiplier `noise_multiplier` and divides by the public
/// `denominator`. The round engine does the same with [`FixedPointSum`] as updates arrive.
pub fn noisy_mean<'a, I>(
    updates: I,
    dim: usize,
    clip_norm: f64,
    noise_multiplier: f64,
    denominator: f64,
    noise: &mut DiscreteGaussianNoise,
) -> Result<NoisyMean, FixedPointError>
where
    I: IntoIterator<Item = &'a [f32]>,
{
    let grid = Grid::for_clip_norm(clip_norm, DEFAULT_GRID_BITS)?;
    let calibration = NoiseCalibration::new(&grid, noise_multiplier)?;
    let mut sum = FixedPointSum::new(grid, dim);
    let mut clipped = 0;
    for u in updates {
        if sum.add_clipping(u)?.was_clipped() {
            clipped += 1;
        }
    }
    let contributions = sum.count();
    let mean = sum.release(noise, &calibration, denominator)?;
    Ok(NoisyMean {
        mean,
        calibration,
        contributions,
        clipped,
    })
}

/// The mean of a non-private twin run (noise multiplier 0, no clipping): `sum / denominator`,
/// summed in f64. Not a DP mechanism and never to be used for a private release; it exists so
/// twin runs, tests and examples do not keep their own copies. Wrong lengths and non-finite
/// coordinates are errors, as in [`FixedPointSum::add`].
pub fn non_private_mean<'a, I>(
    updates: I,
    dim: usize,
    denominator: f64,
) -> Result<Vec<f32>, FixedPointError>
where
    I: IntoIterator<Item = &'a [f32]>,
{
    if !(denominator.is_finite() && denominator > 0.0) {
        return Err(FixedPointError::InvalidDenominator(denominator));
    }
    let mut sum = vec![0f64; dim];
    for u in updates {
        if u.len() != dim {
            return Err(FixedPointError::WrongLength {
                expected: dim,
                got: u.len(),
            });
        }
        if let Some(index) = u.iter().position(|x| !x.is_finite()) {
            return Err(FixedPointError::NonFinite { index });
        }
        for (s, x) in sum.iter_mut().zip(u) {
            *s += *x as f64;
        }
    }
    Ok(sum.iter().map(|s| (s / denominator) as f32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::privacy::clipping::l2_norm;
    use proptest::prelude::*;

    fn norm_sq(q: &[i64]) -> u128 {
        q.iter().map(|x| (x.unsigned_abs() as u128).pow(2)).sum()
    }

    #[test]
    fn grid_step_is_a_power_of_two_below_the_clip_norm() {
        let g = Grid::for_clip_norm(1.0, 24).unwrap();
        assert_eq!(g.gamma(), 2f64.powi(-24));
        assert_eq!(g.l2_sensitivity_sq(), 1u128 << 48);
        // C = 0.75: floor(log2 C) = -1, gamma = 2^-25, C / gamma = 0.75 2^25 = 3 2^23.
        let g = Grid::for_clip_norm(0.75, 24).unwrap();
        assert_eq!(g.gamma(), 2f64.powi(-25));
        assert_eq!(g.l2_sensitivity_sq(), 9u128 << 46);
        // C = 0.1 is not a dyadic rational: (C / gamma)^2 is floored, exactly.
        let g = Grid::for_clip_norm(0.1, 24).unwrap();
        let r = 0.1 / g.gamma();
        assert!((2f64.powi(24)..2f64.powi(25)).contains(&r));
        let s = g.l2_sensitivity_sq();
        assert!((s as f64) <= r * r && r * r < s as f64 + 1.0 + 1e-3 * r);
        assert!(g.l2_sensitivity() >= (s as f64).sqrt());
        assert!(g.l2_sensitivity() <= r * (1.0 + 1e-12));
    }

    #[test]
    fn grid_rejects_bad_parameters() {
        for c in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e-310] {
            assert!(matches!(
                Grid::for_clip_norm(c, 24),
                Err(FixedPointError::InvalidClipNorm(_))
            ));
        }
        for bits in [0, MAX_GRID_BITS + 1] {
            assert!(matches!(
                Grid::for_clip_norm(1.0, bits),
                Err(FixedPointError::InvalidBits { .. })
            ));
        }
    }

    #[test]
    fn quantisation_rounds_toward_zero() {
        let g = Grid::for_clip_norm(1.0, 4).unwrap(); // gamma = 1/16
        let mut q = [0i64; 5];
        g.quantize(&[0.5, -0.5, 0.06, -0.07, 0.124], &mut q)
            .unwrap();
        assert_eq!(q, [8, -8, 0, -1, 1]);
    }

    #[test]
    fn quantisation_errors_are_typed() {
        let g = Grid::for_clip_norm(1.0, 24).unwrap();
        let mut q = [0i64; 2];
        assert_eq!(
            g.quantize(&[0.1], &mut q),
            Err(FixedPointError::WrongLength {
                expected: 2,
                got: 1
            })
        );
        assert_eq!(
            g.quantize(&[0.1, f32::NAN], &mut q),
            Err(FixedPointError::NonFinite { index: 1 })
        );
        assert!(matches!(
            g.quantize(&[0.8, 0.8], &mut q),
            Err(FixedPointError::NotClipped { .. })
        ));
        assert!(matches!(
            g.quantize(&[1e30, 0.0], &mut q),
            Err(FixedPointError::NotClipped { .. })
        ));
    }

    #[test]
    fn an_overshoot_of_a_few_ulps_is_shrunk_to_the_exact_bound() {
        // (0.6, 0.8) has norm 1 in reals; in f32 both round up, so the float norm exceeds 1 and
        // the truncated integers on a fine grid exceed floor((C/gamma)^2) = 2^60.
        let g = Grid::for_clip_norm(1.0, 30).unwrap();
        let x = [0.6f32 * (1.0 + 2.0 * f32::EPSILON), 0.8f32];
        assert!(l2_norm(&x) > 1.0);
        let mut q = [0i64; 2];
        let raw: Vec<i64> = x
            .iter()
            .map(|&v| (v as f64 * 2f64.powi(30)) as i64)
            .collect();
        assert!(
            norm_sq(&raw) > g.l2_sensitivity_sq(),
            "the test must overshoot"
        );
        g.quantize(&x, &mut q).unwrap();
        assert!(norm_sq(&q) <= g.l2_sensitivity_sq());
        // Only the larger coordinate moved, by the few units needed.
        assert_eq!(q[0], raw[0]);
        assert!(q[1] < raw[1] && raw[1] - q[1] < 1000, "{q:?} {raw:?}");
    }

    #[test]
    fn calibration_rounds_the_variance_up_and_refuses_tiny_or_huge_noise() {
        let g = Grid::for_clip_norm(1.0, 24).unwrap();
        for z in [0.3, 0.7, 1.0, 1.1, 2.5, 9.87654321] {
            let c = NoiseCalibration::new(&g, z).unwrap();
            let v = c.variance() as u128;
            // v >= z^2 S, checked in f64 with a margin only in the direction that could fail.
            assert!(v as f64 >= z * z * (g.l2_sensitivity_sq() as f64) * (1.0 - 1e-15));
            assert!(variance_covers(v as u64, z, g.l2_sensitivity_sq()));
            // ... and it is not much larger than needed.
            assert!((v as f64) < z * z * (g.l2_sensitivity_sq() as f64) * (1.0 + 1e-10) + 2.0);
            assert!(
                c.noise_multiplier() >= z,
                "z {z} -> {}",
                c.noise_multiplier()
            );
            assert!(c.sigma() <= (v as f64).sqrt());
        }
        // The exact check catches a variance one below the bound: 2^48 z^2 with z = 1.5 is an
        // integer, 2^48 * 2.25.
        let s = g.l2_sensitivity_sq();
        let exact = (s * 9 / 4) as u64;
        assert!(variance_covers(exact, 1.5, s));
        assert!(!variance_covers(exact - 1, 1.5, s));
        assert!(matches!(
            NoiseCalibration::new(&g, 1e-7),
            Err(FixedPointError::NoiseTooSmall { .. })
        ));
        assert!(matches!(
            NoiseCalibration::new(&g, 1e5),
            Err(FixedPointError::NoiseTooLarge { .. })
        ));
        for z in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                NoiseCalibration::new(&g, z),
                Err(FixedPointError::InvalidNoiseMultiplier(_))
            ));
        }
    }

    #[test]
    fn sum_rejects_bad_updates_without_changing() {
        let g = Grid::for_clip_norm(1.0, 24).unwrap();
        let mut s = FixedPointSum::new(g, 3);
        s.add(&[0.5, 0.5, 0.5]).unwrap();
        let before = s.sum().to_vec();
        assert!(s.add(&[0.5, 0.5]).is_err());
        assert!(s.add(&[0.5, f32::INFINITY, 0.0]).is_err());
        assert!(s.add_clipping(&[0.5, f32::NAN, 0.0]).is_err());
        assert!(s.add(&[1.0, 1.0, 0.0]).is_err());
        assert_eq!(s.sum(), &before[..]);
        assert_eq!(s.count(), 1);
        let c = s.add_clipping(&[3.0, 4.0, 0.0]).unwrap();
        assert!(c.was_clipped());
        assert_eq!(s.count(), 2);
    }

    #[test]
    fn the_contribution_cap_keeps_i64_sums_from_overflowing() {
        let g = Grid::for_clip_norm(1.0, MAX_GRID_BITS).unwrap();
        assert_eq!(g.max_contributions(), 1 << 31);
        // Worst case: every contribution at the per-coordinate maximum.
        let per = (g.l2_sensitivity_sq() as f64).sqrt() as i64;
        assert!((g.max_contributions() as i128) * (per as i128) <= SUM_BOUND as i128);
        let mut s = FixedPointSum::new(Grid::for_clip_norm(1.0, MAX_GRID_BITS).unwrap(), 1);
        s.count = g.max_contributions();
        assert_eq!(
            s.add(&[0.1]),
            Err(FixedPointError::TooManyContributions {
                max: g.max_contributions()
            })
        );
    }

    #[test]
    fn release_checks_its_inputs() {
        let g = Grid::for_clip_norm(1.0, 24).unwrap();
        let other = Grid::for_clip_norm(2.0, 24).unwrap();
        let c = NoiseCalibration::new(&other, 1.0).unwrap();
        let mut noise = DiscreteGaussianNoise::seeded(1);
        assert_eq!(
            FixedPointSum::new(g, 2).release(&mut noise, &c, 10.0),
            Err(FixedPointError::GridMismatch)
        );
        let c = NoiseCalibration::new(&g, 1.0).unwrap();
        for d in [0.0, -3.0, f64::NAN] {
            assert!(matches!(
                FixedPointSum::new(g, 2).release(&mut noise, &c, d),
                Err(FixedPointError::InvalidDenominator(_))
            ));
        }
    }

    #[test]
    fn release_adds_noise_of_the_calibrated_scale_around_the_mean() {
        // 4 identical updates of 0.25 per coordinate, z = 1, C = 1: noise std on the sum is
        // ~1 (update units), so on the mean (divided by 4) ~0.25 around 0.25.
        let g = Grid::for_clip_norm(1.0, 24).unwrap();
        let d = 20_000;
        let u = vec![0.25f32 / (d as f32).sqrt(); d];
        let mut s = FixedPointSum::new(g, d);
        for _ in 0..4 {
            s.add(&u).unwrap();
        }
        let c = NoiseCalibration::new(&g, 1.0).unwrap();
        let mut noise = DiscreteGaussianNoise::seeded(5);
        let mean = s.release(&mut noise, &c, 4.0).unwrap();
        let m = u[0] as f64;
        let err: Vec<f64> = mean.iter().map(|&x| x as f64 - m).collect();
        let avg = err.iter().sum::<f64>() / d as f64;
        let var = err.iter().map(|e| e * e).sum::<f64>() / d as f64;
        assert!(avg.abs() < 0.01, "bias {avg}");
        assert!((var.sqrt() - 0.25).abs() < 0.01, "std {}", var.sqrt());
    }

    #[test]
    fn the_non_private_mean_is_the_plain_mean_and_checks_its_inputs() {
        let a = [1.0f32, -2.0, 100.0];
        let b = [3.0f32, 2.0, -50.0];
        assert_eq!(
            non_private_mean([&a[..], &b[..]], 3, 4.0).unwrap(),
            vec![1.0, 0.0, 12.5]
        );
        assert!(matches!(
            non_private_mean([&a[..2]], 3, 4.0),
            Err(FixedPointError::WrongLength { .. })
        ));
        assert!(matches!(
            non_private_mean([&[f32::NAN, 0.0, 0.0][..]], 3, 4.0),
            Err(FixedPointError::NonFinite { index: 0 })
        ));
        assert!(matches!(
            non_private_mean([&a[..]], 3, 0.0),
            Err(FixedPointError::InvalidDenominator(_))
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any update clipped by the project's clip quantises without error to an integer vector
        /// within the exact sensitivity, each coordinate rounded toward zero.
        #[test]
        fn clipped_updates_quantise_within_the_sensitivity(
            raw in prop::collection::vec(-1e3f32..1e3, 1..64),
            clip in 1e-3f64..1e3,
            bits in 1u32..=MAX_GRID_BITS,
        ) {
            let g = Grid::for_clip_norm(clip, bits).unwrap();
            let mut x = raw.clone();
            clip_l2(&mut x, clip);
            let mut q = vec![0i64; x.len()];
            g.quantize(&x, &mut q).unwrap();
            prop_assert!(norm_sq(&q) <= g.l2_sensitivity_sq());
            for (&xi, &qi) in x.iter().zip(&q) {
                let exact = xi as f64 / g.gamma();
                prop_assert!((qi as f64).abs() <= exact.abs());
                prop_assert!(qi == 0 || (qi > 0) == (xi > 0.0));
                // Toward zero: never more than one grid step below |x|.
                prop_assert!(exact.abs() - (qi as f64).abs() < 1.0 + 1e-9 * exact.abs());
            }
        }

        /// Updates up to a few ulps too long are repaired to the bound; longer ones are refused.
        #[test]
        fn slightly_long_updates_are_shrunk_and_long_ones_refused(
            raw in prop::collection::vec(-1.0f32..1.0, 1..32),
            stretch in 0.0f64..2e-7,
            bits in 16u32..=MAX_GRID_BITS,
        ) {
            let n = l2_norm(&raw);
            prop_assume!(n > 1e-3);
            let x: Vec<f32> = raw.iter().map(|&v| (v as f64 / n * (1.0 + stretch)) as f32).collect();
            let g = Grid::for_clip_norm(1.0, bits).unwrap();
            let mut q = vec![0i64; x.len()];
            g.quantize(&x, &mut q).unwrap();
            prop_assert!(norm_sq(&q) <= g.l2_sensitivity_sq());
            let y: Vec<f32> = x.iter().map(|&v| v * 1.01).collect();
            let refused = matches!(g.quantize(&y, &mut q), Err(FixedPointError::NotClipped { .. }));
            prop_assert!(refused);
        }
    }
}
