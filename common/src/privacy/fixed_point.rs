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
//! **The summed path** (central mode, DESIGN §2.5): a caller that computes the sum of the
//! clipped contributions itself (in f64, without materialising them) hands the engine that sum,
//! quantised once ([`Grid::quantize_sum`], [`FixedPointSum::add_quantized`]). Its sensitivity is
//! larger: `C / gamma + sqrt(d) + 2 e C / gamma` grid units, with `e` the proven relative bound
//! on the summation's floating-point error ([`SummedBound`]), and the noise is calibrated to that
//! larger sensitivity ([`NoiseCalibration::for_summed`]), so `sigma / Delta >= z` still holds for
//! the sensitivity the ledger records.
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

/// Smallest noise standard deviation the mechanism accepts, in grid units. Not by itself enough
/// for the (epsilon, delta) accounting: the ledger also requires the discrete Gaussian's proven
/// gap to the continuous one to be at most 1e-12 per event
/// ([`crate::privacy::event::discrete_gaussian_gap_bound`]), about 1.2e-15 / z^2 at the default
/// grid, where sigma is of order `z 2^24`.
pub const MIN_SIGMA_GRID_UNITS: u64 = 10;

/// Bound on the magnitude of every coordinate of a fixed-point sum before noise: half of the
/// i64 range, the other half being headroom for the noise (see [`Grid::max_contributions`]).
const SUM_BOUND: u64 = 1 << 62;

/// Relative overshoot of the squared norm (above `floor((C/gamma)^2)`) that quantisation
/// repairs by shrinking coordinates: about 5e-7 in norm, a few f32 ulps of a float clip. More
/// than that means the input was not clipped to `C`, which is an error, not something to fix.
const OVERSHOOT_SHIFT: u32 = 20;

/// Row-norm cap `R` of the summed path (see [`SummedBound`]): a unit's clip factor `s_u` is also
/// held to `s_u mean_{i in u} |g_i| <= R C`, where `g_i` are its rows' per-example gradients. A
/// unit of one row never reaches it (there `mean |g_i| = |g_u|` and `s_u |g_u| <= C`); a unit
/// of several rows reaches it only when its rows cancel to less than `1/R` of their mean norm.
/// It bounds what the floating-point error of the sum can depend on by public numbers.
pub const SUMMED_ROW_NORM_CAP: f64 = 64.0;

/// Public bounds on one round of the summed path, from which its floating-point error and so
/// its sensitivity follow: at most `max_units` units (the population under `sampled`, the
/// cohort under `fresh`: never the realised sample, which is secret) and `max_rows` rows in all
/// (`max_units` times the rows per unit).
///
/// # The rounding bound (relative to `C`)
/// The caller computes `S = sum_i w_i d_i a~_i^T` per layer in f64 (`fedrl_rl::offline::
/// per_example::summed_clipped`): `d_i`, `a~_i = [a_i, 1]` are f32 values converted exactly,
/// `w_i = s_u / k_u` rounded once (relative error `<= u = 2^-53`), `w_i d_i` rounded once, and
/// every output coordinate is a dot product over the `B <= max_rows` rows in any order (with or
/// without FMA). The standard bound for a dot product of `n` terms in any order
/// (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1, eq. 3.5),
/// `|fl - exact| <= gamma_n sum |x_i y_i|` with `gamma_n = n u / (1 - n u)`, and the two
/// roundings before it give, coordinate by coordinate,
/// `|S^ - S| <= gamma_{B+2} sum_i (s_u / k_u) |d_i| |a~_i|^T` (`(1 + u)^2 (1 + gamma_B) <= 1 +
/// gamma_{B+2}`). Over all coordinates of all layers, with the triangle inequality on the
/// rank-one terms (`|x y^T|_F = |x| |y|`):
/// `|S^ - S|_2 <= gamma_{B+2} sum_u s_u mean_{i in u} |g_i|`, where `|g_i|` is row `i`'s whole
/// per-example gradient norm. Each unit's term is at most `R C` (for one-row units `s_u |g_u| <=
/// C` from the clip itself; for others the cap [`SUMMED_ROW_NORM_CAP`], enforced with the
/// norm rounded up and the products rounded with a `2^-50` relative slack), so
/// `|S^ - S|_2 <= e C` with `e = gamma_{max_rows + 2} max_units R (1 + 2^-50)`
/// ([`Self::rounding_relative`]).
///
/// # The sensitivity
/// Removing (or adding) unit `k` changes the exact sum by its clipped contribution, at most `C`
/// in norm, and each of the two computed sums is within `e C` of its exact sum. Quantising
/// toward zero moves a coordinate by less than one grid unit, and for any reals `x, y`,
/// `|trunc(x) - trunc(y)| < |x - y| + 1` (same sign: a floor or ceiling difference; opposite
/// signs: `|trunc(x) - trunc(y)| <= |x - y|`). So the two quantised sums differ in L2 by less
/// than `|S^ - S^'|_2 / gamma + sqrt(d) <= (1 + 2 e) C / gamma + sqrt(d)` grid units:
/// [`Self::sensitivity_sq`] returns the square of that, rounded up to an integer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SummedBound {
    /// Most units one sum can hold (public).
    pub max_units: u64,
    /// Most rows (per-example gradients) one sum can hold (public).
    pub max_rows: u64,
}

impl SummedBound {
    /// `e`: the bound on `|computed sum - exact sum|_2 / C` (see the type's documentation),
    /// rounded up. `+inf` when `max_rows` is so large that `gamma_n` is undefined.
    pub fn rounding_relative(&self) -> f64 {
        let u = f64::EPSILON / 2.0; // 2^-53
        let n = self.max_rows as f64 + 2.0;
        let nu = n * u;
        if nu.is_nan() || nu >= 0.5 {
            return f64::INFINITY;
        }
        // gamma_n = n u / (1 - n u); every f64 op below rounds by at most u relative: the
        // final factor (1 + 2^-40) covers them many times over.
        let gamma = nu / (1.0 - nu);
        gamma
            * self.max_units as f64
            * SUMMED_ROW_NORM_CAP
            * (1.0 + 2f64.powi(-50))
            * (1.0 + 2f64.powi(-40))
    }

    /// The squared L2 sensitivity in grid units of a quantised sum of `dim` coordinates on
    /// `grid`, rounded up: `ceil(((1 + 2 e) C / gamma + sqrt(dim))^2)`. Refuses a bound whose
    /// rounding term is not small (`e > 2^-10`): the sum would then need far more noise than the
    /// per-unit path, and the caller should use that path instead.
    pub fn sensitivity_sq(&self, grid: &Grid, dim: usize) -> Result<u128, FixedPointError> {
        let e = self.rounding_relative();
        if e.is_nan() || e > 2f64.powi(-10) {
            return Err(FixedPointError::RoundingTooLarge { relative: e });
        }
        // C / gamma exactly (a power-of-two scaling), below 2^31.
        let ratio = grid.clip_norm * grid.inverse_gamma();
        let root = (ratio * (1.0 + 2.0 * e) + (dim as f64).sqrt()) * (1.0 + 2f64.powi(-45));
        Ok((root * root * (1.0 + 2f64.powi(-45))).ceil() as u128)
    }
}

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
    /// The summed path's floating-point bound is not small next to the clip norm.
    #[error(
        "the summed path's rounding bound is {relative:e} of the clip norm (more than 2^-10): too many rows or units for one sum"
    )]
    RoundingTooLarge { relative: f64 },
    /// A pre-summed vector is larger than its number of contributions allows.
    #[error("a sum of {contributions} contributions has a coordinate of {value} grid units")]
    SumOutOfRange { contributions: u64, value: f64 },
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
        // Squares are below 2^(2 bits + 4): a chunk of 2^(60 - 2 bits) of them sums below 2^64
        // in u64, so the inner loop needs no u128 arithmetic and no branch per coordinate (what
        // made it the largest part of the aggregator's time per update in the load benchmark).
        let chunk = 1usize << (60 - 2 * self.bits.min(30)).min(12);
        let mut norm_sq: u128 = 0;
        for (c, (xs, qs)) in clipped.chunks(chunk).zip(out.chunks_mut(chunk)).enumerate() {
            let mut ok = true;
            let mut chunk_sq: u64 = 0;
            for (&x, q) in xs.iter().zip(qs.iter_mut()) {
                // f32 -> f64 is exact and scaling by a power of two is exact in the normal range
                // (below it the value is < 1 and truncates to 0), so `scaled` is the exact
                // x/gamma.
                let scaled = x as f64 * scale;
                // False for NaN as for |x/gamma| >= limit (`limit` is an integer, so that holds
                // exactly when its truncation is >= limit).
                ok &= scaled.abs() < limit;
                // `as` rounds toward zero, exactly `trunc` for |scaled| < 2^63 (here below
                // 2^(bits+2)), without the libm call `f64::trunc` is on baseline x86-64.
                let v = scaled as i64;
                *q = v;
                // Wrapping only matters for a coordinate already refused by `ok`.
                chunk_sq = chunk_sq.wrapping_add(v.unsigned_abs().wrapping_mul(v.unsigned_abs()));
            }
            if !ok {
                // The slow scan names the first offending coordinate.
                let start = c * chunk;
                for (i, &x) in xs.iter().enumerate() {
                    if !x.is_finite() {
                        return Err(FixedPointError::NonFinite { index: start + i });
                    }
                    if (x as f64 * scale).abs() >= limit {
                        return Err(FixedPointError::NotClipped {
                            norm_sq: u128::MAX,
                            bound_sq: self.sensitivity_sq,
                        });
                    }
                }
            }
            norm_sq += chunk_sq as u128;
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

impl Grid {
    /// [`Self::quantize`]'s rounding, added straight into `sum`, returning the contribution's
    /// exact squared norm in grid units; the caller checks it against the bound (and undoes it
    /// with [`Self::unquantize_from_sum`] when over). A coordinate that is not finite or beyond
    /// the grid is an error, with `sum` unchanged. `sum` is added to with wrapping arithmetic
    /// so that undoing is exact whatever was added; an accepted contribution never wraps
    /// (`FixedPointSum::add` keeps `|sum| <= 2^62`).
    fn quantize_into_sum(&self, clipped: &[f32], sum: &mut [i64]) -> Result<u128, FixedPointError> {
        debug_assert_eq!(clipped.len(), sum.len());
        let scale = self.inverse_gamma();
        let limit = (1u64 << (self.bits + 2)) as f64;
        let chunk = 1usize << (60 - 2 * self.bits.min(30)).min(12);
        let mut norm_sq: u128 = 0;
        for (c, xs) in clipped.chunks(chunk).enumerate() {
            let start = c * chunk;
            let ss = &mut sum[start..start + xs.len()];
            let mut ok = true;
            let mut chunk_sq: u64 = 0;
            for (&x, s) in xs.iter().zip(ss.iter_mut()) {
                // As in `quantize`: exact scaling, NaN fails `ok`, `as` truncates.
                let scaled = x as f64 * scale;
                ok &= scaled.abs() < limit;
                let v = scaled as i64;
                *s = s.wrapping_add(v);
                chunk_sq = chunk_sq.wrapping_add(v.unsigned_abs().wrapping_mul(v.unsigned_abs()));
            }
            if !ok {
                // Undo this chunk and the ones before it, then name the problem.
                self.unquantize_from_sum(
                    &clipped[..start + xs.len()],
                    &mut sum[..start + xs.len()],
                );
                let mut q = vec![0; xs.len()];
                return match self.quantize(xs, &mut q) {
                    Err(FixedPointError::NonFinite { index }) => Err(FixedPointError::NonFinite {
                        index: start + index,
                    }),
                    Err(e) => Err(e),
                    // Unreachable: `ok` failed on one of these coordinates.
                    Ok(()) => Err(FixedPointError::NotClipped {
                        norm_sq: u128::MAX,
                        bound_sq: self.sensitivity_sq,
                    }),
                };
            }
            norm_sq += chunk_sq as u128;
        }
        Ok(norm_sq)
    }

    /// Subtracts from `sum` exactly what [`Self::quantize_into_sum`] added for `clipped` (the
    /// same rounding, wrapping arithmetic).
    fn unquantize_from_sum(&self, clipped: &[f32], sum: &mut [i64]) {
        let scale = self.inverse_gamma();
        for (&x, s) in clipped.iter().zip(sum.iter_mut()) {
            *s = s.wrapping_sub((x as f64 * scale) as i64);
        }
    }
}

impl Grid {
    /// Quantises a pre-summed vector (the summed path: the sum of up to `contributions` clipped
    /// contributions, computed by the caller in f64) into `out`, every coordinate rounded toward
    /// zero (`x / gamma` is exact in f64, a power-of-two scaling). Its sensitivity is
    /// [`SummedBound::sensitivity_sq`], not this grid's. Refuses non-finite coordinates, a wrong
    /// length, and a coordinate beyond [`Self::summed_limit`] (more than that many clipped
    /// contributions can reach, even with the rounding that [`SummedBound`] allows; it also
    /// keeps the i64 sums of [`FixedPointSum`] far from overflowing).
    pub fn quantize_sum(
        &self,
        sum: &[f64],
        contributions: u64,
        out: &mut [i64],
    ) -> Result<(), FixedPointError> {
        if sum.len() != out.len() {
            return Err(FixedPointError::WrongLength {
                expected: out.len(),
                got: sum.len(),
            });
        }
        let scale = self.inverse_gamma();
        let limit = self.summed_limit(contributions) as f64;
        for (i, (&x, q)) in sum.iter().zip(out.iter_mut()).enumerate() {
            if !x.is_finite() {
                return Err(FixedPointError::NonFinite { index: i });
            }
            let scaled = (x * scale).trunc();
            if scaled.abs() > limit {
                return Err(FixedPointError::SumOutOfRange {
                    contributions,
                    value: scaled,
                });
            }
            *q = scaled as i64;
        }
        Ok(())
    }

    /// Largest coordinate magnitude (grid units) a pre-summed vector of `contributions`
    /// contributions may have: `c 2^(bits+1) (1 + 2^-9) + 1`, above the `c C / gamma (1 + 2e)`
    /// an honest sum reaches (`C / gamma < 2^(bits+1)`, `e <= 2^-10`). With at most
    /// [`Self::max_contributions`] in a sum, every coordinate stays below `2^62 (1 + 2^-9)`.
    pub fn summed_limit(&self, contributions: u64) -> u128 {
        let base = contributions as u128 * (1u128 << (self.bits + 1));
        base + (base >> 9) + 1
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
    /// The squared L2 sensitivity the noise is calibrated to (grid units): the grid's own for
    /// per-contribution quantisation, the summed path's larger one otherwise.
    sensitivity_sq: u128,
    noise: DiscreteGaussian,
}

impl NoiseCalibration {
    /// Noise for noise multiplier `z` on `grid`: the variance (an integer number of grid units
    /// squared) is `z^2 Delta^2` rounded **up**, verified exactly in integer arithmetic, so
    /// `sigma / Delta >= z` holds with `Delta^2 = floor((C / gamma)^2)`. Refuses a standard
    /// deviation below [`MIN_SIGMA_GRID_UNITS`] or a variance above `2^62`.
    pub fn new(grid: &Grid, noise_multiplier: f64) -> Result<Self, FixedPointError> {
        Self::with_sensitivity_sq(grid, grid.sensitivity_sq, noise_multiplier)
    }

    /// Noise for noise multiplier `z` on `grid` for a pre-summed contribution of `dim`
    /// coordinates (the summed path): calibrated, as [`Self::new`] is, to the larger
    /// sensitivity [`SummedBound::sensitivity_sq`], so `sigma / l2_sensitivity >= z` holds for
    /// the sensitivity it reports (and the ledger records). It covers per-contribution
    /// quantisation too (that sensitivity is smaller).
    pub fn for_summed(
        grid: &Grid,
        bound: &SummedBound,
        dim: usize,
        noise_multiplier: f64,
    ) -> Result<Self, FixedPointError> {
        let s = bound.sensitivity_sq(grid, dim)?;
        Self::with_sensitivity_sq(grid, s.max(grid.sensitivity_sq), noise_multiplier)
    }

    fn with_sensitivity_sq(
        grid: &Grid,
        s: u128,
        noise_multiplier: f64,
    ) -> Result<Self, FixedPointError> {
        let z = noise_multiplier;
        if !(z.is_finite() && z > 0.0) {
            return Err(FixedPointError::InvalidNoiseMultiplier(z));
        }
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
        Ok(Self {
            grid: *grid,
            sensitivity_sq: s,
            noise,
        })
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
        sqrt_up(self.sensitivity_sq)
    }

    /// Squared L2 sensitivity in grid units the noise is calibrated to (an integer).
    pub fn l2_sensitivity_sq(&self) -> u128 {
        self.sensitivity_sq
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
            quantized: Vec::new(),
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
        // The common case in one pass: quantise straight into the sum (no intermediate vector:
        // at 10^6 coordinates the second pass over 8 MB was most of the cost). A coordinate
        // that is not finite or beyond the grid, or a norm over the bound, is undone exactly.
        let norm_sq = self.grid.quantize_into_sum(clipped, &mut self.sum)?;
        if norm_sq > self.grid.sensitivity_sq {
            // Rare (a float clip that overshot by a hair, or an unclipped update): undo, then
            // quantise into a buffer, where the largest coordinates can be shrunk.
            self.grid.unquantize_from_sum(clipped, &mut self.sum);
            self.quantized.resize(self.sum.len(), 0);
            self.grid.quantize(clipped, &mut self.quantized)?;
            // |sum| <= count 2^(bits+1) <= 2^62 by max_contributions: no overflow.
            for (s, q) in self.sum.iter_mut().zip(&self.quantized) {
                *s += *q;
            }
        }
        self.count += 1;
        Ok(())
    }

    /// Adds a pre-summed, quantised vector standing for `contributions` contributions (the
    /// summed path, [`Grid::quantize_sum`]). Its sensitivity is the caller's to account
    /// ([`NoiseCalibration::for_summed`]). On error the sum is unchanged.
    pub fn add_quantized(&mut self, q: &[i64], contributions: u64) -> Result<(), FixedPointError> {
        if q.len() != self.sum.len() {
            return Err(FixedPointError::WrongLength {
                expected: self.sum.len(),
                got: q.len(),
            });
        }
        let max = self.grid.max_contributions();
        let count = self.count.saturating_add(contributions);
        if count > max {
            return Err(FixedPointError::TooManyContributions { max });
        }
        let limit = self.grid.summed_limit(contributions);
        if let Some(&v) = q.iter().find(|v| v.unsigned_abs() as u128 > limit) {
            return Err(FixedPointError::SumOutOfRange {
                contributions,
                value: v as f64,
            });
        }
        // Every coordinate stays below count 2^(bits+1) (1 + 2^-9) + count <= 2^62 (1 + 2^-8),
        // leaving the rest of the i64 range to the noise: no overflow.
        for (s, v) in self.sum.iter_mut().zip(q) {
            *s += *v;
        }
        self.count = count;
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
    fn every_coordinate_is_the_truncation_of_x_over_gamma() {
        // Quantising rounds with `as i64`, not `f64::trunc`: both must agree on each
        // coordinate, whatever its sign, size (subnormal, below one grid unit, exact multiples)
        // or position in a vector whose norm stays within the clip norm.
        let g = Grid::for_clip_norm(1.0, 24).unwrap();
        let scale = g.inverse_gamma();
        let mut xs: Vec<f32> = vec![
            0.0,
            -0.0,
            f32::MIN_POSITIVE / 4.0,
            -f32::MIN_POSITIVE,
            1.0 / scale as f32,
            -1.0 / scale as f32,
            0.999 / scale as f32,
            -1.5 / scale as f32,
            0.3,
            -0.3,
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1000 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (state >> 11) as f64 / (1u64 << 53) as f64;
            xs.push(((u - 0.5) * 2e-2) as f32);
        }
        let mut q = vec![0i64; xs.len()];
        g.quantize(&xs, &mut q).unwrap();
        for (&x, &qi) in xs.iter().zip(&q) {
            assert_eq!(qi, (x as f64 * scale).trunc() as i64, "x = {x:e}");
        }
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

    #[test]
    fn the_summed_sensitivity_adds_sqrt_d_and_the_rounding_bound() {
        let g = Grid::for_clip_norm(1.0, 24).unwrap();
        let ratio = 2f64.powi(24);
        let b = SummedBound {
            max_units: 256,
            max_rows: 256,
        };
        let e = b.rounding_relative();
        // gamma_258 x 256 x R: about 258 x 2^-53 x 256 x 64.
        assert!(e > 258.0 * 2f64.powi(-53) * 256.0 * 64.0 && e < 1e-9, "{e}");
        let s = b.sensitivity_sq(&g, 10_000).unwrap();
        let want = ratio * (1.0 + 2.0 * e) + 100.0;
        assert!((s as f64).sqrt() >= want, "{} < {want}", (s as f64).sqrt());
        assert!((s as f64).sqrt() <= want * (1.0 + 1e-12) + 1.0);
        // The noise is calibrated to it: sigma / Delta >= z for the recorded Delta.
        let c = NoiseCalibration::for_summed(&g, &b, 10_000, 1.1).unwrap();
        assert_eq!(c.l2_sensitivity_sq(), s);
        assert!(c.l2_sensitivity() >= want);
        assert!(c.noise_multiplier() >= 1.1);
        assert!(c.sigma() > NoiseCalibration::new(&g, 1.1).unwrap().sigma());
        // A bound whose rounding is not small next to C is refused.
        let huge = SummedBound {
            max_units: 1 << 40,
            max_rows: 1 << 40,
        };
        assert!(matches!(
            huge.sensitivity_sq(&g, 10),
            Err(FixedPointError::RoundingTooLarge { .. })
        ));
    }

    #[test]
    fn a_pre_summed_vector_is_quantised_toward_zero_and_checked() {
        let g = Grid::for_clip_norm(1.0, 4).unwrap(); // gamma = 1/16, C / gamma = 16
        let mut q = [0i64; 4];
        g.quantize_sum(&[1.5, -1.53, 0.06, -0.0], 2, &mut q)
            .unwrap();
        assert_eq!(q, [24, -24, 0, 0]);
        // 2 contributions reach at most 2 x 2^5 (1 + 2^-9) + 1 grid units.
        assert!(g.quantize_sum(&[4.0, 0.0, 0.0, 0.0], 2, &mut q).is_ok());
        assert!(matches!(
            g.quantize_sum(&[4.2, 0.0, 0.0, 0.0], 2, &mut q),
            Err(FixedPointError::SumOutOfRange { .. })
        ));
        assert!(matches!(
            g.quantize_sum(&[0.2, 0.0, 0.0, 0.0], 0, &mut q),
            Err(FixedPointError::SumOutOfRange { .. })
        ));
        assert!(matches!(
            g.quantize_sum(&[0.0, f64::INFINITY, 0.0, 0.0], 2, &mut q),
            Err(FixedPointError::NonFinite { index: 1 })
        ));
        assert!(g.quantize_sum(&[0.0; 3], 2, &mut q).is_err());
        let mut s = FixedPointSum::new(g, 4);
        s.add_quantized(&[24, -24, 0, 0], 2).unwrap();
        s.add(&[0.5, 0.0, 0.0, 0.0]).unwrap();
        assert_eq!(s.sum(), &[32, -24, 0, 0]);
        assert_eq!(s.count(), 3);
        let before = s.sum().to_vec();
        assert!(s.add_quantized(&[200, 0, 0, 0], 1).is_err());
        assert!(s.add_quantized(&[1, 0], 1).is_err());
        assert_eq!(s.sum(), &before[..]);
        assert_eq!(s.count(), 3);
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

        /// `FixedPointSum::add` quantises into the sum in one pass: its result is the sum of
        /// `Grid::quantize`'s vectors (long vectors cross its chunks, a stretched update takes
        /// the shrinking path), and a refused update (a bad coordinate anywhere, or too long)
        /// leaves the sum as it was.
        #[test]
        fn one_pass_add_is_quantise_then_sum(
            raws in prop::collection::vec(prop::collection::vec(-1.0f32..1.0, 9000), 1..4),
            stretch in prop::sample::select(vec![0.0f64, 1e-7, 0.05]),
            bad in prop::option::of((0usize..9000, prop::sample::select(vec![f32::NAN, f32::INFINITY, 1e30]))),
            bits in prop::sample::select(vec![16u32, 24, 30]),
        ) {
            let g = Grid::for_clip_norm(1.0, bits).unwrap();
            let mut sum = FixedPointSum::new(g, 9000);
            let mut want = vec![0i64; 9000];
            let mut q = vec![0i64; 9000];
            for raw in &raws {
                let n = l2_norm(raw);
                let mut x: Vec<f32> =
                    raw.iter().map(|&v| (v as f64 / n * (1.0 + stretch)) as f32).collect();
                if let Some((i, v)) = bad {
                    x[i] = v;
                }
                let before = sum.sum().to_vec();
                let expected = g.quantize(&x, &mut q);
                let got = sum.add(&x);
                prop_assert_eq!(got.is_ok(), expected.is_ok());
                match expected {
                    Ok(()) => want.iter_mut().zip(&q).for_each(|(w, v)| *w += v),
                    Err(e) => {
                        prop_assert_eq!(got.unwrap_err().to_string(), e.to_string());
                        prop_assert_eq!(sum.sum(), &before[..]);
                    }
                }
                prop_assert_eq!(sum.sum(), &want[..]);
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
