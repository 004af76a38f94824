//! Exact sampling of the discrete Gaussian N_Z(0, sigma^2) with integer arithmetic only.
//!
//! `N_Z(0, sigma^2)` puts probability proportional to `exp(-x^2 / (2 sigma^2))` on every integer
//! `x`. The sampler follows Canonne, Kamath and Steinke, "The Discrete Gaussian for Differential
//! Privacy" (NeurIPS 2020, arXiv 2004.00010), Algorithms 1-3:
//!
//! 1. [`bernoulli_exp`]: Bernoulli(exp(-gamma)) for a rational `gamma = n / d`, by von Neumann's
//!    method (for `gamma <= 1`: draw Bernoulli(gamma / k) for k = 1, 2, ... until the first
//!    failure and answer whether the last k is odd; for `gamma > 1`: floor(gamma) independent
//!    Bernoulli(exp(-1)) and one Bernoulli(exp(-(gamma - floor(gamma)))), all of which must be 1).
//! 2. [`discrete_laplace`]: the discrete Laplace with scale `t` (probability proportional to
//!    `exp(-|x| / t)`), as `U + t V` with `U` uniform on `{0..t-1}` accepted with probability
//!    `exp(-U / t)`, `V` geometric (a run of Bernoulli(exp(-1))), a fair sign, and `-0` rejected.
//! 3. [`DiscreteGaussian::sample`]: with `t = floor(sigma) + 1`, a discrete Laplace candidate `Y`
//!    is accepted with probability `exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2))`.
//!
//! Every random choice is made from the generator's bits with integer arithmetic ([`Bits`]):
//! a uniform integer by rejection, and a Bernoulli(n / d) by comparing a uniform in `[0, 1)`
//! with `n / d` one binary digit at a time, both expansions generated lazily (exact, two bits
//! on average, no division). So the output distribution is exactly `N_Z(0, sigma^2)` for the
//! rational `sigma^2 = num / den`: no floating-point number is in the sampling path
//! (floating-point samplers leave gaps that can reveal the exact value being noised, Mironov
//! 2012).
//!
//! # Cost
//!
//! At the project's sigma (about `2^24` grid units) a sample takes about 2.4 64-bit words of
//! ChaCha20 (`tests/discrete_gaussian.rs` counts them) and no u128 division on the common path:
//! the acceptance exponent's integer part is found by subtraction while its Bernoulli(exp(-1))
//! factors are drawn (it is rarely above 2). A vector's samples are drawn on several threads by
//! [`super::noise::DiscreteGaussianNoise::add_to`].
//!
//! # Why a discrete Gaussian is accounted as a Gaussian with `z = sigma / Delta`
//!
//! Noise is added once, centrally, to an integer vector `q(x)` in `Z^d`, with independent
//! `N_Z(0, sigma^2)` coordinates. CKS20's multivariate theorem (the multivariate discrete
//! Gaussian satisfies concentrated DP): if `sum_j (q_j(x) - q_j(x'))^2 / sigma^2 <= eps^2` for
//! all neighbours, the mechanism is `eps^2 / 2`-zCDP. The proof is short and exact, and is
//! repeated here so it can be checked: for integer shifts `mu, nu` the normalising constants
//! cancel; completing the square, the Renyi divergence of order `alpha` of one coordinate is
//! `alpha (mu - nu)^2 / (2 sigma^2)` plus `log(theta(c) / theta(0)) / (alpha - 1)` where
//! `theta(c) = sum_x exp(-(x - c)^2 / (2 sigma^2))` is largest at integer `c`, so the second
//! term is `<= 0`; divergences of independent coordinates add. With `Delta` the L2 sensitivity
//! in grid units this is `Delta^2 / (2 sigma^2)` at every order: the Renyi curve of the
//! continuous Gaussian with noise multiplier `z = sigma / Delta`, **with no additive slack**.
//! Accounting that uses only the Gaussian's Renyi curve (the RDP accountant for unsampled
//! rounds, zCDP conversions) is therefore exactly valid.
//!
//! The central theorem has no (eps, delta) slack term. Slack appears in two other places:
//! - **PLD and subsampling.** The privacy-loss-distribution accountant, and the RDP bound for
//!   *Poisson-sampled* rounds, are computed for the continuous Gaussian, not from its Renyi curve
//!   alone. For (eps, delta) the discrete mechanism is *not* equivalent: its delta(eps) exceeds
//!   the continuous one's by up to ~1.7e-4 at `sigma = Delta = 10` (exact hockey-stick sums,
//!   `tests/discrete_gaussian_gap.rs`), a lattice effect of order `1 / sigma^2`. `super::event`
//!   proves a bound on that gap (Poisson summation) and the ledger refuses any event whose bound
//!   exceeds 1e-12; at this project's sigma of order `2^24` grid units
//!   ([`super::fixed_point::DEFAULT_GRID_BITS`]) it is ~1e-15.
//! - **Sums of discrete Gaussians.** Were the noise ever split among `n` parties (secure
//!   aggregation), the sum is no longer a discrete Gaussian. Kairouz, Liu and Steinke (ICML 2021,
//!   "The Distributed Discrete Gaussian Mechanism", Theorem 1, as we read it) then bound the zCDP
//!   parameter with a slack `tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))` per
//!   coordinate (it enters as `sqrt(Delta^2 / (n sigma^2) + tau d / 2)`). Here `n = 1` (one
//!   central draw), so `tau = 0`; with per-party `sigma >= 10`, `tau <= 10 n exp(-987)`,
//!   negligible for any model size `d`.
//!
//! # Integer bounds
//!
//! `sigma^2 = num / den` with `1 <= num <= 2^62` and `den >= 1`. With `t = floor(sigma) + 1` the
//! acceptance exponent is `(|Y| t den - num)^2 / D` with `D = 2 num t^2 den`. Since
//! `t^2 den <= (sqrt(num) + sqrt(den))^2`, `D <= 2^126` whenever `sigma >= 10`
//! (`t^2 den <= 1.21 num`, so `D <= 2.42 num^2 < 2^126`); the constructor checks `D < 2^126`
//! exactly and refuses other parameters ([`DiscreteGaussianError::TooLarge`]) instead of
//! overflowing. The candidate's magnitude is held in `u128` with checked arithmetic; its square
//! is formed in 256 bits when it does not fit 128 ([`wide`]). The only conditions under which a
//! sample returns an error are events of probability below `exp(-2^64)`.

use rand::Rng;
use thiserror::Error;

/// Largest accepted numerator of `sigma^2 = num / den`.
pub const MAX_VARIANCE_NUMERATOR: u64 = 1 << 62;

/// Errors of the exact sampler. Parameter errors are reported at construction; a sample fails
/// only on events of probability below `exp(-2^64)` (see the module docs).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DiscreteGaussianError {
    /// `sigma^2 = num / den` must have `1 <= num <= 2^62` and `den >= 1`.
    #[error(
        "the variance {num}/{den} must be a positive rational with numerator in [1, 2^62] and denominator >= 1"
    )]
    InvalidVariance { num: u64, den: u64 },
    /// The acceptance test's denominator `2 num t^2 den` would not fit the proven bound `2^126`.
    #[error(
        "the variance {num}/{den} is outside the range the integer sampler supports (2 num t^2 den must be < 2^126)"
    )]
    TooLarge { num: u64, den: u64 },
    /// A value exceeded its integer type; only reachable with probability below `exp(-2^64)`.
    #[error("integer overflow while {0}")]
    Overflow(&'static str),
}

/// A uniform integer in `{0, ..., m - 1}` (`m >= 1`) from the generator, by rejection: draw as
/// many random bits as `m - 1` has and retry when the value is `>= m` (fewer than 2 draws on
/// average, and exactly uniform).
pub fn uniform_below<R: Rng + ?Sized>(rng: &mut R, m: u128) -> u128 {
    debug_assert!(m >= 1);
    if m <= 1 {
        return 0;
    }
    let bits = 128 - (m - 1).leading_zeros();
    if bits <= 64 {
        let shift = 64 - bits;
        loop {
            let x = (rng.next_u64() >> shift) as u128;
            if x < m {
                return x;
            }
        }
    }
    let shift = 128 - bits;
    loop {
        let x = (((rng.next_u64() as u128) << 64) | rng.next_u64() as u128) >> shift;
        if x < m {
            return x;
        }
    }
}

/// Random bits from a generator, handed out a few at a time. The sampler's random choices are
/// mostly comparisons that are decided after two bits on average (below); a whole `next_u64`
/// per choice would make the generator (ChaCha20, a few ns per word) the sampler's main cost.
/// Every bit handed out is a fresh bit of the generator's output, used once, so the choices
/// are exactly as random as the generator's words.
pub struct Bits<'a, R: Rng + ?Sized> {
    rng: &'a mut R,
    buf: u64,
    left: u32,
    /// Words drawn from the generator so far (for tests and benchmarks).
    words: u64,
}

impl<'a, R: Rng + ?Sized> Bits<'a, R> {
    /// A bit reader over `rng` with nothing buffered.
    pub fn new(rng: &'a mut R) -> Self {
        Self {
            rng,
            buf: 0,
            left: 0,
            words: 0,
        }
    }

    /// Words (`u64`) drawn from the generator so far.
    pub fn words_drawn(&self) -> u64 {
        self.words
    }

    #[inline]
    fn refill(&mut self) -> u64 {
        self.words += 1;
        self.rng.next_u64()
    }

    /// One uniform bit.
    #[inline]
    pub fn bit(&mut self) -> bool {
        if self.left == 0 {
            self.buf = self.refill();
            self.left = 64;
        }
        let b = self.buf & 1 == 1;
        self.buf >>= 1;
        self.left -= 1;
        b
    }

    /// `n` uniform bits (`1 <= n <= 64`) as the low bits of a `u64`.
    #[inline]
    pub fn take(&mut self, n: u32) -> u64 {
        debug_assert!((1..=64).contains(&n));
        let mask = |k: u32| if k >= 64 { u64::MAX } else { (1u64 << k) - 1 };
        if n <= self.left {
            let v = self.buf & mask(n);
            self.buf = if n >= 64 { 0 } else { self.buf >> n };
            self.left -= n;
            return v;
        }
        // The buffered bits (fewer than n, so fewer than 64) below, fresh ones above.
        let (have, low) = (self.left, self.buf);
        let need = n - have;
        let w = self.refill();
        self.buf = if need >= 64 { 0 } else { w >> need };
        self.left = 64 - need;
        low | ((w & mask(need)) << have)
    }

    /// A uniform integer in `{0, ..., m - 1}` (`m >= 1`). For `m < 2^64`, Lemire's
    /// multiply-shift with rejection ("Fast random integer generation in an interval", 2019):
    /// `floor(x m / 2^64)` for a uniform 64-bit `x`, rejecting the `2^64 mod m` values of the low
    /// word that would bias it, so exactly uniform, and the rejection branch is almost never
    /// taken (probability below `m / 2^64`). Larger `m`: rejection on the bit length of `m - 1`
    /// (fewer than 2 tries on average).
    #[inline]
    pub fn below(&mut self, m: u128) -> u128 {
        if m <= 1 {
            return 0;
        }
        if let Ok(s) = u64::try_from(m) {
            let mut p = u128::from(self.take(64)) * u128::from(s);
            if (p as u64) < s {
                // 2^64 mod s: the low words below it are the surplus of the uneven split.
                let surplus = s.wrapping_neg() % s;
                while (p as u64) < surplus {
                    p = u128::from(self.take(64)) * u128::from(s);
                }
            }
            return p >> 64;
        }
        let bits = 128 - (m - 1).leading_zeros();
        loop {
            let x = if bits <= 64 {
                self.take(bits) as u128
            } else {
                let lo = self.take(64) as u128;
                ((self.take(bits - 64) as u128) << 64) | lo
            };
            if x < m {
                return x;
            }
        }
    }

    /// Bernoulli(n / d) for `d >= 1` (`n >= d` is certain), exactly, by comparing a uniform
    /// `U` in `[0, 1)` with `p = n / d` one binary digit at a time, both generated lazily: the
    /// answer is `U < p`, decided at the first digit where they differ (after 2 digits on
    /// average, whatever `d`). `p`'s digits come from the long division `r -> 2r mod d`,
    /// written so that `2r` is never formed (no overflow for any `d`), and no division is
    /// needed. When `p`'s expansion ends (`r = 0`) with `U`'s digits equal so far, `U >= p`
    /// unless every later digit of `U` is 0, an event of probability 0.
    #[inline]
    pub fn ratio(&mut self, n: u128, d: u128) -> bool {
        if n >= d {
            return true;
        }
        let mut r = n;
        loop {
            // Next digit of p: 1 iff 2r >= d, i.e. r >= d - r.
            let gap = d - r;
            let p_bit = r >= gap;
            r = if p_bit { r - gap } else { r << 1 };
            let u_bit = self.bit();
            if u_bit != p_bit {
                return p_bit;
            }
            if r == 0 {
                return false;
            }
        }
    }

    /// Bernoulli(exp(-n / d)) for `0 <= n <= d` (CKS20 Algorithm 1, von Neumann's method):
    /// draw Bernoulli(n / (d k)) for k = 1, 2, ... until the first failure and answer whether
    /// the last k is odd. Bernoulli(n / (d k)) is one lazy comparison with denominator `d k`
    /// (one random decision, not two); should `d k` not fit in u128 it is drawn as
    /// Bernoulli(1 / k) and Bernoulli(n / d), independent. k grows past j with probability
    /// below 1 / j!.
    #[inline]
    pub fn exp_at_most_one(&mut self, n: u128, d: u128) -> bool {
        debug_assert!(n <= d && d >= 1);
        let mut k: u128 = 1;
        loop {
            let success = match d.checked_mul(k) {
                Some(dk) => self.ratio(n, dk),
                None => self.ratio(1, k) && self.ratio(n, d),
            };
            if !success {
                return k % 2 == 1;
            }
            k += 1;
        }
    }

    /// Bernoulli(exp(-1)): [`Self::exp_at_most_one`] with `n = d = 1`, whose first round
    /// always succeeds.
    #[inline]
    pub fn exp_minus_one(&mut self) -> bool {
        let mut k: u128 = 2;
        while self.ratio(1, k) {
            k += 1;
        }
        k % 2 == 1
    }

    /// Bernoulli(exp(-(whole + frac_num / frac_den))) with `frac_num < frac_den`; `whole` is a
    /// 256-bit integer `(whole_hi, whole_lo)`: `whole` independent Bernoulli(exp(-1)), all of
    /// which must succeed (stopping at the first failure, after 1.58 draws on average), then
    /// the fraction.
    fn exp_split(
        &mut self,
        whole_hi: u128,
        whole_lo: u128,
        frac_num: u128,
        frac_den: u128,
    ) -> Result<bool, DiscreteGaussianError> {
        let mut done: u128 = 0;
        while whole_hi != 0 || done < whole_lo {
            if !self.exp_minus_one() {
                return Ok(false);
            }
            // Reaching 2^128 successes has probability exp(-2^128).
            done = done.checked_add(1).ok_or(DiscreteGaussianError::Overflow(
                "counting Bernoulli(exp(-1)) successes",
            ))?;
        }
        Ok(self.exp_at_most_one(frac_num, frac_den))
    }

    /// The discrete Laplace with integer scale `t >= 1` as (sign, magnitude) (CKS20
    /// Algorithm 2 with `s = 1`): `U` uniform on `{0..t-1}` accepted with probability
    /// `exp(-U / t)`, plus `t V` with `V` geometric (`P(V >= v) = exp(-v)`), a fair sign, `-0`
    /// rejected.
    fn laplace_parts(&mut self, t: u128) -> Result<(bool, u128), DiscreteGaussianError> {
        debug_assert!(t >= 1);
        loop {
            let u = self.below(t);
            if !self.exp_at_most_one(u, t) {
                continue;
            }
            let mut v: u128 = 0;
            while self.exp_minus_one() {
                v = v.checked_add(1).ok_or(DiscreteGaussianError::Overflow(
                    "drawing the geometric part",
                ))?;
            }
            let x = v.checked_mul(t).and_then(|tv| tv.checked_add(u)).ok_or(
                DiscreteGaussianError::Overflow("forming the discrete Laplace magnitude"),
            )?;
            let negative = self.bit();
            if negative && x == 0 {
                continue;
            }
            return Ok((negative, x));
        }
    }
}

/// Bernoulli(exp(-n / d)) for any rational `n / d >= 0` (`d >= 1`), exactly.
pub fn bernoulli_exp<R: Rng + ?Sized>(
    rng: &mut R,
    n: u128,
    d: u128,
) -> Result<bool, DiscreteGaussianError> {
    if d == 0 {
        return Err(DiscreteGaussianError::Overflow(
            "drawing Bernoulli(exp(-n/d)) with d = 0",
        ));
    }
    Bits::new(rng).exp_split(0, n / d, n % d, d)
}

/// A sample of the discrete Laplace distribution with integer scale `t >= 1`: probability
/// proportional to `exp(-|x| / t)` on the integers (CKS20 Algorithm 2 with `s = 1`).
pub fn discrete_laplace<R: Rng + ?Sized>(
    rng: &mut R,
    t: u128,
) -> Result<i128, DiscreteGaussianError> {
    let (negative, magnitude) = Bits::new(rng).laplace_parts(t)?;
    let m = i128::try_from(magnitude)
        .map_err(|_| DiscreteGaussianError::Overflow("returning a discrete Laplace sample"))?;
    Ok(if negative { -m } else { m })
}

/// The distribution `N_Z(0, sigma^2)` for a rational `sigma^2 = num / den`, with its constants
/// precomputed. Sample it with a generator: [`DiscreteGaussian::sample`], or through
/// [`super::noise::DiscreteGaussianNoise`], which owns a cryptographically secure one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiscreteGaussian {
    num: u128,
    den: u128,
    /// `t = floor(sigma) + 1`, the scale of the discrete Laplace proposal.
    t: u128,
    /// `t den`.
    t_den: u128,
    /// `2 num t^2 den < 2^126`.
    accept_den: u128,
}

impl DiscreteGaussian {
    /// `N_Z(0, num / den)` (grid units squared). Any positive variance whose constants fit the
    /// proven bounds; the privacy mechanism additionally requires `sigma >= 10`
    /// ([`super::fixed_point::NoiseCalibration`]), not the sampler.
    pub fn new(num: u64, den: u64) -> Result<Self, DiscreteGaussianError> {
        if num == 0 || den == 0 || num > MAX_VARIANCE_NUMERATOR {
            return Err(DiscreteGaussianError::InvalidVariance { num, den });
        }
        let (n, d) = (num as u128, den as u128);
        // floor(sqrt(num / den)) = isqrt(floor(num / den)): sqrt is monotone and the floors of
        // both sides only change at perfect squares.
        let t = (n / d).isqrt() + 1;
        let too_large = DiscreteGaussianError::TooLarge { num, den };
        let t_den = t.checked_mul(d).ok_or(too_large.clone())?;
        let accept_den = t
            .checked_mul(t_den)
            .and_then(|x| x.checked_mul(2 * n))
            .filter(|&x| x < (1u128 << 126))
            .ok_or(too_large)?;
        Ok(Self {
            num: n,
            den: d,
            t,
            t_den,
            accept_den,
        })
    }

    /// Numerator of `sigma^2` (grid units squared).
    pub fn variance_numerator(&self) -> u64 {
        self.num as u64
    }

    /// Denominator of `sigma^2`.
    pub fn variance_denominator(&self) -> u64 {
        self.den as u64
    }

    /// `sigma^2 = num / den` as f64 (for reports and tests, never for sampling).
    pub fn variance(&self) -> f64 {
        self.num as f64 / self.den as f64
    }

    /// One exact sample (CKS20 Algorithm 3).
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> Result<i64, DiscreteGaussianError> {
        self.sample_bits(&mut Bits::new(rng))
    }

    /// Adds an independent exact sample to every element of `v`, drawing from one bit reader
    /// (no bits are discarded between samples). On error `v` is partly noised and must be
    /// discarded; an error is an overflow of i64 (see [`super::noise`]) or an event of
    /// probability below `exp(-2^64)`.
    pub fn add_to<R: Rng + ?Sized>(
        &self,
        rng: &mut R,
        v: &mut [i64],
    ) -> Result<(), DiscreteGaussianError> {
        let mut bits = Bits::new(rng);
        for x in v.iter_mut() {
            let e = self.sample_bits(&mut bits)?;
            *x = x.checked_add(e).ok_or(DiscreteGaussianError::Overflow(
                "adding noise to an i64 sum",
            ))?;
        }
        Ok(())
    }

    /// One exact sample (CKS20 Algorithm 3) from a bit reader.
    pub fn sample_bits<R: Rng + ?Sized>(
        &self,
        bits: &mut Bits<'_, R>,
    ) -> Result<i64, DiscreteGaussianError> {
        loop {
            let (negative, y) = bits.laplace_parts(self.t)?;
            // |Y| - sigma^2 / t = (|Y| t den - num) / (t den), so the acceptance exponent
            // (|Y| - sigma^2/t)^2 / (2 sigma^2) is a^2 / D with D = 2 num t^2 den.
            let a = y
                .checked_mul(self.t_den)
                .ok_or(DiscreteGaussianError::Overflow(
                    "scaling the Laplace candidate",
                ))?
                .abs_diff(self.num);
            let accepted = if a >> 64 == 0 {
                // exp(-a^2 / D) = exp(-1)^q exp(-r / D) with a^2 = q D + r: one Bernoulli(
                // exp(-1)) per unit of q, stopping at the first failure, with q and r found by
                // subtraction as the draws go (q is small: a^2 / D is about (|Y|/sigma - 1)^2 / 2),
                // so no u128 division (a slow software routine) is needed.
                let mut rem = a * a;
                let mut ok = true;
                while rem >= self.accept_den {
                    if !bits.exp_minus_one() {
                        ok = false;
                        break;
                    }
                    rem -= self.accept_den;
                }
                ok && bits.exp_at_most_one(rem, self.accept_den)
            } else {
                // Rare (|Y| far in the tail): the exponent in 256 bits.
                let (hi, lo) = wide::mul(a, a);
                let (whole_hi, whole_lo, rem) = wide::div_rem(hi, lo, self.accept_den);
                bits.exp_split(whole_hi, whole_lo, rem, self.accept_den)?
            };
            if accepted {
                let m = i64::try_from(y).map_err(|_| {
                    DiscreteGaussianError::Overflow("returning a discrete Gaussian sample")
                })?;
                return Ok(if negative { -m } else { m });
            }
        }
    }
}

/// 256-bit unsigned helpers as `(hi, lo)` pairs of u128, enough for the rare wide products of
/// the sampler and for exact comparisons in the noise calibration.
pub(crate) mod wide {
    /// `a * b` as `(hi, lo)`.
    pub(crate) fn mul(a: u128, b: u128) -> (u128, u128) {
        const MASK: u128 = (1 << 64) - 1;
        let (a1, a0) = (a >> 64, a & MASK);
        let (b1, b0) = (b >> 64, b & MASK);
        let p00 = a0 * b0;
        let p01 = a0 * b1;
        let p10 = a1 * b0;
        let p11 = a1 * b1;
        // middle = p01 + p10 + (p00 >> 64) may carry into bit 128.
        let (mid, carry1) = p01.overflowing_add(p10);
        let (mid, carry2) = mid.overflowing_add(p00 >> 64);
        let carries = (carry1 as u128 + carry2 as u128) << 64;
        let lo = (mid << 64) | (p00 & MASK);
        let hi = p11 + (mid >> 64) + carries;
        (hi, lo)
    }

    /// `(hi, lo) / d` as `(quotient_hi, quotient_lo, remainder)`, for `1 <= d < 2^127`
    /// (restoring long division, one bit at a time; the remainder stays below `d`, so shifting it
    /// left by one never overflows).
    pub(crate) fn div_rem(hi: u128, lo: u128, d: u128) -> (u128, u128, u128) {
        debug_assert!((1..(1 << 127)).contains(&d));
        let (mut q_hi, mut q_lo, mut r) = (0u128, 0u128, 0u128);
        for i in (0..256).rev() {
            let bit = if i >= 128 {
                (hi >> (i - 128)) & 1
            } else {
                (lo >> i) & 1
            };
            r = (r << 1) | bit;
            if r >= d {
                r -= d;
                if i >= 128 {
                    q_hi |= 1 << (i - 128);
                } else {
                    q_lo |= 1 << i;
                }
            }
        }
        (q_hi, q_lo, r)
    }

    /// `(hi, lo) << s` for `s < 256`, as `Some` when no bit is lost.
    pub(crate) fn shl(hi: u128, lo: u128, s: u32) -> Option<(u128, u128)> {
        match s {
            0 => Some((hi, lo)),
            1..=127 => (hi.leading_zeros() >= s).then(|| ((hi << s) | (lo >> (128 - s)), lo << s)),
            128..=255 => (hi == 0 && lo.leading_zeros() >= s - 128).then(|| (lo << (s - 128), 0)),
            _ => (hi == 0 && lo == 0).then_some((0, 0)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::ChaCha20Rng;

    #[test]
    fn wide_mul_and_div_agree_with_u128_where_it_fits_and_with_identities_where_not() {
        let cases = [
            (0u128, 5u128),
            (1, u128::MAX),
            (u64::MAX as u128, u64::MAX as u128),
            (u128::MAX, u128::MAX),
            (
                0x1234_5678_9abc_def0_1122_3344_5566_7788,
                0xffff_0000_ffff_0000_1234,
            ),
        ];
        for (a, b) in cases {
            let (hi, lo) = wide::mul(a, b);
            if let Some(p) = a.checked_mul(b) {
                assert_eq!((hi, lo), (0, p));
            }
            // (a b) / b = a, remainder 0, for b < 2^127.
            if (1..(1 << 127)).contains(&b) {
                let (q_hi, q_lo, r) = wide::div_rem(hi, lo, b);
                assert_eq!((q_hi, q_lo, r), (0, a, 0), "a {a} b {b}");
            }
        }
        // (2^128 - 1)^2 = 2^256 - 2^129 + 1.
        assert_eq!(wide::mul(u128::MAX, u128::MAX), (u128::MAX - 1, 1));
        // (a b + r) / b with a remainder.
        let (hi, lo) = wide::mul(u128::MAX, 1_000_003);
        let (q_hi, q_lo, r) = wide::div_rem(hi, lo + 17, 1_000_003);
        assert_eq!((q_hi, q_lo, r), (0, u128::MAX, 17));
        assert_eq!(wide::shl(0, 1, 127), Some((0, 1 << 127)));
        assert_eq!(wide::shl(0, 1 << 127, 1), Some((1, 0)));
        assert_eq!(wide::shl(1 << 127, 0, 1), None);
        assert_eq!(wide::shl(0, 3, 130), Some((12, 0)));
        assert_eq!(wide::shl(0, 1 << 126, 130), None);
        assert_eq!(wide::shl(1, 0, 128), None);
    }

    #[test]
    fn uniform_below_is_in_range_and_covers_small_ranges_evenly() {
        let mut rng = ChaCha20Rng::seed_from_u64(1);
        let mut counts = [0u32; 6];
        for _ in 0..60_000 {
            counts[uniform_below(&mut rng, 6) as usize] += 1;
        }
        for c in counts {
            assert!((9_500..10_500).contains(&c), "{counts:?}");
        }
        let big = (1u128 << 100) + 3;
        for _ in 0..1000 {
            assert!(uniform_below(&mut rng, big) < big);
        }
        assert_eq!(uniform_below(&mut rng, 1), 0);
    }

    #[test]
    fn bits_hand_out_the_generator_words_in_order_and_below_is_uniform() {
        // take() across word boundaries reassembles exactly the generator's words.
        let words: Vec<u64> = {
            let mut rng = ChaCha20Rng::seed_from_u64(4);
            (0..8).map(|_| rng.next_u64()).collect()
        };
        let mut rng = ChaCha20Rng::seed_from_u64(4);
        let mut bits = Bits::new(&mut rng);
        let mut acc: Vec<bool> = Vec::new();
        for n in [13u32, 64, 1, 50, 64, 7, 63, 2, 100 - 64, 64] {
            let v = bits.take(n);
            assert!(n == 64 || v >> n == 0);
            acc.extend((0..n).map(|i| (v >> i) & 1 == 1));
        }
        let want: Vec<bool> = words
            .iter()
            .flat_map(|w| (0..64).map(move |i| (w >> i) & 1 == 1))
            .take(acc.len())
            .collect();
        assert_eq!(acc, want);
        assert_eq!(bits.words_drawn(), acc.len().div_ceil(64) as u64);
        // below(): Lemire's path (m < 2^64) and the wide path, in range and even.
        let mut counts = [0u32; 6];
        for _ in 0..60_000 {
            counts[bits.below(6) as usize] += 1;
        }
        for c in counts {
            assert!((9_500..10_500).contains(&c), "{counts:?}");
        }
        let big = (1u128 << 100) + 3;
        let mut high = 0;
        for _ in 0..1000 {
            let x = bits.below(big);
            assert!(x < big);
            high += usize::from(x >= big / 2);
        }
        assert!(
            (420..580).contains(&high),
            "{high} of 1000 in the upper half"
        );
        assert_eq!(bits.below(1), 0);
    }

    #[test]
    fn rejects_variances_outside_the_proven_bounds() {
        assert!(matches!(
            DiscreteGaussian::new(0, 1),
            Err(DiscreteGaussianError::InvalidVariance { .. })
        ));
        assert!(matches!(
            DiscreteGaussian::new(1, 0),
            Err(DiscreteGaussianError::InvalidVariance { .. })
        ));
        assert!(matches!(
            DiscreteGaussian::new(MAX_VARIANCE_NUMERATOR + 1, 1),
            Err(DiscreteGaussianError::InvalidVariance { .. })
        ));
        // sigma = 2^31 is fine (the module's bound); a tiny sigma with a huge denominator makes
        // 2 num t^2 den too large and is refused rather than overflowing.
        assert!(DiscreteGaussian::new(MAX_VARIANCE_NUMERATOR, 1).is_ok());
        assert!(matches!(
            DiscreteGaussian::new(MAX_VARIANCE_NUMERATOR, MAX_VARIANCE_NUMERATOR / 4),
            Err(DiscreteGaussianError::TooLarge { .. })
        ));
    }

    #[test]
    fn large_candidates_take_the_wide_path_and_are_rejected_or_accepted_exactly() {
        // sigma^2 = 2^62: a = |Y| t den - num exceeds 2^64 for |Y| > ~2^33 = 4 sigma, so the wide
        // path runs on a fraction of the candidates; the samples stay plausible.
        let g = DiscreteGaussian::new(MAX_VARIANCE_NUMERATOR, 1).unwrap();
        let mut rng = ChaCha20Rng::seed_from_u64(3);
        let sigma = (MAX_VARIANCE_NUMERATOR as f64).sqrt();
        let n = 4000;
        let mut sum_sq = 0.0;
        for _ in 0..n {
            let x = g.sample(&mut rng).unwrap() as f64;
            assert!(x.abs() < 8.0 * sigma);
            sum_sq += x * x;
        }
        let var = sum_sq / n as f64 / (sigma * sigma);
        assert!((var - 1.0).abs() < 0.1, "variance ratio {var}");
        // The exponent a^2 / D for a = 2^70, computed wide, matches a direct check.
        let a: u128 = 1 << 70;
        let (hi, lo) = wide::mul(a, a);
        let (q_hi, q_lo, r) = wide::div_rem(hi, lo, g.accept_den);
        let (back_hi, back_lo) = wide::mul(q_lo, g.accept_den);
        assert_eq!(q_hi, 0);
        let (sum_lo, carry) = back_lo.overflowing_add(r);
        assert_eq!((back_hi + carry as u128, sum_lo), (hi, lo));
    }
}
