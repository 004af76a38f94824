//! Privacy loss distributions (PLD): the accountant whose figure the system reports.
//!
//! A mechanism's privacy loss is discretised on a grid of spacing `discretization` (nats) with
//! the *pessimistic connect-the-dots* algorithm of Doroshenko, Ghazi, Kamath, Kumar & Manurangsi
//! (2022, "Connect the dots", Algorithm 1): the resulting distribution dominates the true one, so
//! every epsilon it reports is an upper bound. Composition is convolution (FFT); T-fold
//! self-composition raises the Fourier transform to the T-th power after sizing the output with
//! a Chernoff bound, so its cost does not grow with T.
//!
//! We follow Google's `dp_accounting` 0.6.0 `PLDAccountant` step for step (grid bounds, tail
//! truncation at ln-mass -50 for Gaussian noise, tail mass 1e-15 per composition moved to the
//! infinite loss, add/remove adjacency for Poisson subsampling), so the figures agree with it to
//! rounding, not merely to the discretisation error.
//!
//! Conventions: losses and epsilons in nats; "remove" and "add" are the two directions of the
//! add-or-remove-one neighbouring relation (a subsampled mechanism is asymmetric, and the reported
//! epsilon is the worse of the two).

use std::sync::{Arc, Mutex};

use rustfft::num_complex::Complex;
use rustfft::{Fft, FftPlanner};

use super::gaussian::{normal_cdf, normal_log_cdf, normal_quantile};
use super::rdp::{effective_gaussian_noise, log_add, log_sub};
use super::{DpEvent, PrivacyError};

/// Default grid spacing of privacy losses (nats), as dp_accounting.
pub const DEFAULT_DISCRETIZATION: f64 = 1e-4;
/// Probability mass each composition may move from the far tails to the infinite loss.
pub const TAIL_MASS_TRUNCATION: f64 = 1e-15;
/// ln of the Gaussian noise mass left out of the discretised range (and counted as infinite
/// loss), as dp_accounting.
const LOG_MASS_TRUNCATION_BOUND: f64 = -50.0;
/// Largest grid (points) we agree to build: about 0.5 GB of FFT buffers. Beyond it the event
/// needs far less noise than anyone would deploy; the error says so instead of exhausting memory.
pub const MAX_GRID_POINTS: usize = 1 << 25;

/// ln(a e^b + c), the workhorse of subsampled privacy losses.
fn log_a_times_exp_b_plus_c(a: f64, b: f64, c: f64) -> f64 {
    if a == 0.0 {
        return c.ln();
    }
    if a < 0.0 {
        return log_sub(c.ln(), (-a).ln() + b);
    }
    if b == 0.0 {
        return (a + c).ln();
    }
    let d = b + a.ln();
    if c == 0.0 {
        d
    } else if c < 0.0 {
        log_sub(d, (-c).ln())
    } else {
        log_add(d, c.ln())
    }
}

/// Python's `math.isclose` with its default relative tolerance, used where dp_accounting uses it.
fn is_close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

fn too_large(points: u128) -> PrivacyError {
    PrivacyError::Unsupported(format!(
        "the privacy loss grid would need {points} points (limit {MAX_GRID_POINTS}); the noise \
         is too small for PLD accounting at this resolution (use the RDP accountant)"
    ))
}

/// Additive noise with sensitivity 1.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Noise {
    Gaussian { sigma: f64 },
    Laplace { scale: f64 },
}

impl Noise {
    fn cdf(self, x: f64) -> f64 {
        match self {
            Noise::Gaussian { sigma } => normal_cdf(x / sigma),
            Noise::Laplace { scale } => {
                if x > 0.0 {
                    1.0 - 0.5 * (-x / scale).exp()
                } else {
                    0.5 * (x / scale).exp()
                }
            }
        }
    }

    fn log_cdf(self, x: f64) -> f64 {
        match self {
            Noise::Gaussian { sigma } => normal_log_cdf(x / sigma),
            Noise::Laplace { scale } => {
                if x < 0.0 {
                    0.5_f64.ln() + x / scale
                } else {
                    (-0.5 * (-x / scale).exp()).ln_1p()
                }
            }
        }
    }

    /// (CDF, ln CDF) at x, sharing the one erfc where the logarithm of the CDF is exact.
    fn cdf_and_log_cdf(self, x: f64) -> (f64, f64) {
        let c = self.cdf(x);
        match self {
            Noise::Gaussian { sigma } => {
                let t = x / sigma;
                if (-20.0..=6.0).contains(&t) {
                    (c, c.ln())
                } else {
                    (c, self.log_cdf(x))
                }
            }
            Noise::Laplace { .. } => (c, self.log_cdf(x)),
        }
    }

    /// Privacy loss without subsampling, "remove" direction: ln(mu(x + 1) / mu(x)).
    fn loss_remove(self, x: f64) -> f64 {
        match self {
            Noise::Gaussian { sigma } => (-0.5 - x) / (sigma * sigma),
            Noise::Laplace { scale } => (x.abs() - (x + 1.0).abs()) / scale,
        }
    }

    /// Largest x whose unsubsampled "remove" loss is at least `loss`.
    fn inverse_loss_remove(self, loss: f64) -> f64 {
        match self {
            Noise::Gaussian { sigma } => -0.5 - loss * sigma * sigma,
            Noise::Laplace { scale } => {
                let t = loss * scale;
                if t > 1.0 {
                    f64::NEG_INFINITY
                } else if t <= -1.0 {
                    f64::INFINITY
                } else {
                    0.5 * (-1.0 - t)
                }
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    /// mu_upper = q mu(x + 1) + (1 - q) mu(x), mu_lower = mu(x).
    Remove,
    /// mu_upper = mu(x), mu_lower = q mu(x - 1) + (1 - q) mu(x).
    Add,
}

/// The (monotone decreasing in x) privacy loss of an additive-noise mechanism with Poisson
/// subsampling rate `q`, in one direction.
#[derive(Clone, Copy, Debug)]
struct MonotoneLoss {
    noise: Noise,
    q: f64,
    direction: Direction,
    /// Logarithms used at every grid point, computed once (same expressions as dp_accounting,
    /// hence the same values): ln(1/q), ln(1/q - 1), ln(1 - q).
    ln_inv_q: f64,
    ln_inv_q_minus_1: f64,
    ln_1mq: f64,
}

impl MonotoneLoss {
    fn new(noise: Noise, q: f64, direction: Direction) -> Self {
        Self {
            noise,
            q,
            direction,
            ln_inv_q: (1.0 / q).ln(),
            ln_inv_q_minus_1: (-(1.0 - 1.0 / q)).ln(),
            ln_1mq: (1.0 - q).ln(),
        }
    }

    /// ln((1/q) e^loss + 1 - 1/q): the unsubsampled loss behind a subsampled one (q < 1).
    fn unsampled_loss(&self, loss: f64) -> f64 {
        if loss == 0.0 {
            return (1.0 / self.q + (1.0 - 1.0 / self.q)).ln();
        }
        log_sub(loss + self.ln_inv_q, self.ln_inv_q_minus_1)
    }

    fn loss_remove_sampled(&self, x: f64) -> f64 {
        let l = self.noise.loss_remove(x);
        if self.q == 1.0 {
            return l;
        }
        log_a_times_exp_b_plus_c(self.q, l, 1.0 - self.q)
    }

    fn privacy_loss(&self, x: f64) -> f64 {
        match self.direction {
            Direction::Remove => self.loss_remove_sampled(x),
            // By symmetry of the noise.
            Direction::Add => -self.loss_remove_sampled(-x),
        }
    }

    fn inverse_privacy_loss(&self, loss: f64) -> f64 {
        let q = self.q;
        match self.direction {
            Direction::Remove => {
                if q == 1.0 {
                    return self.noise.inverse_loss_remove(loss);
                }
                if is_close(loss, self.ln_1mq) {
                    return self.noise.inverse_loss_remove(f64::NEG_INFINITY);
                }
                self.noise.inverse_loss_remove(self.unsampled_loss(loss))
            }
            Direction::Add => {
                if q == 1.0 {
                    return 1.0 + self.noise.inverse_loss_remove(loss);
                }
                if is_close(loss, -self.ln_1mq) {
                    return 1.0 + self.noise.inverse_loss_remove(f64::INFINITY);
                }
                1.0 + self.noise.inverse_loss_remove(-self.unsampled_loss(-loss))
            }
        }
    }

    /// Exact hockey-stick divergence of the (continuous) mechanism at `epsilon`.
    fn delta_for_epsilon(&self, epsilon: f64) -> f64 {
        let q = self.q;
        if q != 1.0 {
            match self.direction {
                Direction::Add if epsilon >= -(-q).ln_1p() => return 0.0,
                Direction::Remove if epsilon <= (-q).ln_1p() => {
                    return (-epsilon.exp_m1()).clamp(0.0, 1.0);
                }
                _ => {}
            }
        }
        let x = self.inverse_privacy_loss(epsilon);
        // mu_upper_cdf(x) - e^epsilon mu_lower_cdf(x), sharing the CDF at x between both.
        let (c, log_c) = self.noise.cdf_and_log_cdf(x);
        let (upper, log_lower) = match self.direction {
            Direction::Remove => {
                let upper = if q == 1.0 {
                    self.noise.cdf(x + 1.0)
                } else {
                    (1.0 - q) * c + q * self.noise.cdf(x + 1.0)
                };
                (upper, log_c)
            }
            Direction::Add => {
                let log_lower = if q == 1.0 {
                    self.noise.log_cdf(x - 1.0)
                } else {
                    log_add((-q).ln_1p() + log_c, q.ln() + self.noise.log_cdf(x - 1.0))
                };
                (c, log_lower)
            }
        };
        let d = upper - (epsilon + log_lower).exp();
        d.clamp(0.0, 1.0)
    }

    /// Range of losses the connect-the-dots grid must cover: (lowest, highest).
    fn connect_dots_bounds(&self) -> (f64, f64) {
        match self.noise {
            Noise::Gaussian { sigma } => {
                let mut lower_x = sigma * normal_quantile(0.5 * LOG_MASS_TRUNCATION_BOUND.exp());
                let mut upper_x = -lower_x;
                match self.direction {
                    Direction::Add => upper_x += 1.0,
                    Direction::Remove => lower_x -= 1.0,
                }
                (self.privacy_loss(upper_x), self.privacy_loss(lower_x))
            }
            Noise::Laplace { scale } => {
                let max_eps = 1.0 / scale;
                let q = self.q;
                if q == 1.0 {
                    return (-max_eps, max_eps);
                }
                let up = (1.0 - q + q * max_eps.exp()).ln();
                let down = (1.0 - q + q * (-max_eps).exp()).ln();
                match self.direction {
                    Direction::Add => (-up, -down),
                    Direction::Remove => (down, up),
                }
            }
        }
    }

    /// The pessimistic connect-the-dots PMF on the grid `discretization` (fixed-gap variant).
    fn connect_dots_pmf(&self, discretization: f64) -> Result<Pmf, PrivacyError> {
        let (eps_lower, eps_upper) = self.connect_dots_bounds();
        let r_upper = (eps_upper / discretization).ceil();
        let r_lower = (eps_lower / discretization).floor();
        if !(r_upper.is_finite() && r_lower.is_finite()) {
            return Err(PrivacyError::InvalidParameter(format!(
                "privacy loss range [{eps_lower}, {eps_upper}] is not finite"
            )));
        }
        let points = (r_upper - r_lower) as u128 + 1;
        if points > MAX_GRID_POINTS as u128 {
            return Err(too_large(points));
        }
        let (r_lower, n) = (r_lower as i64, points as usize);
        let mut deltas: Vec<f64> = (0..n)
            .map(|k| self.delta_for_epsilon((r_lower + k as i64) as f64 * discretization))
            .collect();
        if n == 1 {
            return Ok(Pmf {
                discretization,
                lower: r_lower,
                probs: vec![1.0 - deltas[0]],
                infinity_mass: deltas[0],
            });
        }
        // delta(epsilon) is non-increasing; enforce it against rounding.
        for k in 1..n {
            deltas[k] = deltas[k].min(deltas[k - 1]);
        }
        let em1 = discretization.exp_m1();
        let e = discretization.exp();
        let mut probs = vec![0.0; n];
        probs[0] = 1.0 - deltas[0] + (deltas[1] - deltas[0]) / em1;
        for k in 1..n - 1 {
            let next = deltas[k + 1] - deltas[k];
            let prev = deltas[k] - deltas[k - 1];
            probs[k] = (next - prev * e) / em1;
        }
        probs[n - 1] = (deltas[n - 1] - deltas[n - 2]) / (-discretization).exp_m1();
        for p in &mut probs {
            *p = p.max(0.0);
        }
        Ok(Pmf {
            discretization,
            lower: r_lower,
            probs,
            infinity_mass: deltas[n - 1],
        })
    }
}

/// A discretised privacy loss distribution in one direction: mass `probs[i]` at loss
/// `(lower + i) * discretization` nats, plus `infinity_mass` at +inf.
#[derive(Clone, Debug, PartialEq)]
pub struct Pmf {
    discretization: f64,
    lower: i64,
    probs: Vec<f64>,
    infinity_mass: f64,
}

impl Pmf {
    /// The loss of a mechanism that reveals nothing: all mass at 0.
    pub fn identity(discretization: f64) -> Self {
        Pmf {
            discretization,
            lower: 0,
            probs: vec![1.0],
            infinity_mass: 0.0,
        }
    }

    fn is_identity(&self) -> bool {
        self.lower == 0 && self.probs == [1.0] && self.infinity_mass == 0.0
    }

    /// Number of grid points.
    pub fn len(&self) -> usize {
        self.probs.len()
    }

    /// True when there are no finite grid points (never for a valid PMF).
    pub fn is_empty(&self) -> bool {
        self.probs.is_empty()
    }

    /// Mass at +inf (the probability of an unbounded loss).
    pub fn infinity_mass(&self) -> f64 {
        self.infinity_mass
    }

    /// Delta (hockey-stick divergence) at `epsilon` nats.
    pub fn delta_for_epsilon(&self, epsilon: f64) -> f64 {
        let mut delta = self.infinity_mass;
        for (i, &p) in self.probs.iter().enumerate() {
            let loss = (self.lower + i as i64) as f64 * self.discretization;
            if loss > epsilon {
                delta += -(epsilon - loss).exp_m1() * p;
            }
        }
        delta
    }

    /// Smallest epsilon (nats) whose delta is at most `delta`; +inf when the infinite-loss mass
    /// alone exceeds it.
    pub fn epsilon_for_delta(&self, delta: f64) -> f64 {
        if self.infinity_mass > delta {
            return f64::INFINITY;
        }
        let mut mass_upper = self.infinity_mass;
        let mut mass_lower = 0.0;
        // Walk down from the largest loss, accumulating the hockey-stick sums.
        for (i, &p) in self.probs.iter().enumerate().rev() {
            let loss = (self.lower + i as i64) as f64 * self.discretization;
            if mass_upper > delta
                && mass_lower > 0.0
                && ((mass_upper - delta) / mass_lower).ln() >= loss
            {
                break;
            }
            mass_upper += p;
            mass_lower += (-loss).exp() * p;
            if mass_upper >= delta && mass_lower == 0.0 {
                // exp(-loss) underflowed: the loss itself is the answer.
                return loss.max(0.0);
            }
        }
        if mass_upper <= mass_lower + delta {
            return 0.0;
        }
        ((mass_upper - delta) / mass_lower).ln()
    }

    /// The distribution of the sum of the losses of `self` and `other` (composition), with up to
    /// `tail_mass_truncation` of far-tail mass moved pessimistically (left tail onto the first
    /// point, right tail to +inf).
    pub fn compose(&self, other: &Pmf, tail_mass_truncation: f64) -> Result<Pmf, PrivacyError> {
        let len = self.probs.len() as u128 + other.probs.len() as u128 - 1;
        if len > MAX_GRID_POINTS as u128 {
            return Err(too_large(len));
        }
        // Composing with "nothing" (the accountant's starting point) only truncates.
        let probs = if other.is_identity() {
            self.probs.clone()
        } else if self.is_identity() {
            other.probs.clone()
        } else {
            convolve(&self.probs, &other.probs)
        };
        let inf =
            self.infinity_mass + other.infinity_mass - self.infinity_mass * other.infinity_mass;
        let (offset, probs, right_mass) = truncate_tails(probs, tail_mass_truncation);
        Ok(Pmf {
            discretization: self.discretization,
            lower: self.lower + other.lower + offset as i64,
            probs,
            infinity_mass: inf + right_mass,
        })
    }

    /// `times`-fold composition with itself: the T-th power of the Fourier transform, on an
    /// output window sized by a Chernoff bound so that at most `tail_mass_truncation` falls
    /// outside it (that mass is counted as infinite loss).
    pub fn self_compose(&self, times: u64, tail_mass_truncation: f64) -> Result<Pmf, PrivacyError> {
        if times == 0 {
            return Ok(Pmf::identity(self.discretization));
        }
        let (lo, hi) = self_convolve_bounds(&self.probs, times, tail_mass_truncation);
        let out_len = (hi - lo) as u128 + 1;
        if out_len > MAX_GRID_POINTS as u128 {
            return Err(too_large(out_len));
        }
        let out_len = out_len as usize;
        let fft_len = next_fast_even_len(out_len.max(self.probs.len()));
        // The window starts at index `lo` of the (virtual) full convolution; aliases from the
        // circular wrap-around lie outside it and carry less than the truncated mass.
        let start = lo.rem_euclid(fft_len as i128) as usize;
        let probs = self_convolve_window(&self.probs, fft_len, times, start, out_len);
        let lower = i128::from(self.lower) * i128::from(times) + lo;
        let lower = i64::try_from(lower).map_err(|_| too_large(u128::MAX))?;
        let inf = tail_mass_truncation - (times as f64 * (-self.infinity_mass).ln_1p()).exp_m1();
        Ok(Pmf {
            discretization: self.discretization,
            lower,
            probs,
            infinity_mass: inf,
        })
    }
}

/// dp_accounting's `_truncate_tails` (pessimistic): drops the longest prefix and suffix each of
/// mass <= truncation/2; the prefix mass goes onto the first kept point, the suffix mass is
/// returned to be counted at +inf. Returns (offset, kept probabilities, suffix mass).
fn truncate_tails(probs: Vec<f64>, truncation: f64) -> (usize, Vec<f64>, f64) {
    if truncation == 0.0 || probs.is_empty() {
        return (0, probs, 0.0);
    }
    let half = truncation / 2.0;
    let prefix = |it: &mut dyn Iterator<Item = f64>| -> usize {
        let mut s = 0.0;
        let mut n = 0;
        for v in it {
            s += v;
            if s > half {
                return n;
            }
            n += 1;
        }
        n
    };
    let n = probs.len();
    let left = prefix(&mut probs.iter().copied()).min(n - 1);
    let right = (n - prefix(&mut probs.iter().rev().copied())).max(left + 1);
    let left_mass: f64 = probs[..left].iter().sum();
    let right_mass: f64 = probs[right..].iter().sum();
    let mut kept = probs[left..right].to_vec();
    kept[0] += left_mass;
    (left, kept, right_mass)
}

/// Chernoff bounds (in index units of the T-fold sum) outside of which the T-fold convolution of
/// `probs` has at most `truncation` mass; dp_accounting's `compute_self_convolve_bounds` with its
/// orders +-1..20 / len.
fn self_convolve_bounds(probs: &[f64], times: u64, truncation: f64) -> (i128, i128) {
    let n = probs.len();
    let mut upper = (n as i128 - 1) * i128::from(times);
    let mut lower: i128 = 0;
    if truncation == 0.0 {
        return (lower, upper);
    }
    // Moment generating function at orders k/n, k = +-1..20, in one pass: with t = e^{i/n},
    // the terms are p_i t^k and p_i t^-k, all within e^{+-20} (no overflow, no log-sum-exp
    // needed).
    let mut mgf_pos = [0.0_f64; 20];
    let mut mgf_neg = [0.0_f64; 20];
    let inv_n = 1.0 / n as f64;
    for (i, &p) in probs.iter().enumerate() {
        if p == 0.0 {
            continue;
        }
        let t = (i as f64 * inv_n).exp();
        let ti = 1.0 / t;
        let (mut up, mut down) = (p, p);
        for k in 0..20 {
            up *= t;
            down *= ti;
            mgf_pos[k] += up;
            mgf_neg[k] += down;
        }
    }
    let log_2_over_t = (2.0 / truncation).ln();
    let t = times as f64;
    for k in 0..20 {
        let order = (k + 1) as f64 * inv_n;
        let up = (t * mgf_pos[k].ln() + log_2_over_t) / order;
        if up.is_finite() {
            upper = upper.min(up.ceil() as i128);
        }
        let down = (t * mgf_neg[k].ln() + log_2_over_t) / -order;
        if down.is_finite() {
            lower = lower.max(down.floor() as i128);
        }
    }
    (lower, upper)
}

/// Smallest n >= target whose prime factors are 2, 3, 5, 7 (fast FFT sizes).
fn next_fast_len(target: usize) -> usize {
    if target <= 8 {
        return target.max(1);
    }
    let mut best = target.next_power_of_two();
    let mut p7 = 1usize;
    while p7 < best {
        let mut p5 = p7;
        while p5 < best {
            let mut p3 = p5;
            while p3 < best {
                // Smallest power of two taking p3 to at least target.
                let mut n = p3;
                while n < target {
                    n *= 2;
                }
                best = best.min(n);
                p3 *= 3;
            }
            p5 *= 5;
        }
        p7 *= 7;
    }
    best
}

/// Smallest even n >= target whose prime factors are 2, 3, 5, 7 (the real FFT halves it).
fn next_fast_even_len(target: usize) -> usize {
    2 * next_fast_len(target.div_ceil(2).max(1))
}

/// Plans kept by [`fft_plan`]. Bounded on purpose: a long-running aggregator accounts a longer
/// composition every round, hence new transform lengths, and rustfft's own planner keeps every
/// plan (with its twiddles) for the life of the process: about 6 MB more per round at the
/// ledger's sizes (heaptrack, `bench` load run of 12 rounds).
const FFT_PLAN_CACHE: usize = 2;

/// A transform length and its plan.
type FftPlanEntry = (usize, Arc<dyn Fft<f64>>);

/// Lengths and plans of [`fft_plan`], most recently used last.
static FFT_PLANS: Mutex<Vec<FftPlanEntry>> = Mutex::new(Vec::new());

/// The forward complex FFT of length `len`. The last [`FFT_PLAN_CACHE`] lengths are kept, most
/// recently used last: planning costs about as much as running the transform, and a noise search
/// or one ledger check reuses a few sizes many times.
fn fft_plan(len: usize) -> Arc<dyn Fft<f64>> {
    // A panic while planning cannot leave the list half-updated in a harmful way.
    let lock = || {
        FFT_PLANS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    };
    {
        let mut plans = lock();
        if let Some(i) = plans.iter().position(|(n, _)| *n == len) {
            let hit = plans.remove(i);
            let fft = hit.1.clone();
            plans.push(hit);
            return fft;
        }
    }
    // A fresh planner per length: its internal cache of sub-transforms dies with it.
    let fft = FftPlanner::new().plan_fft_forward(len);
    let mut plans = lock();
    if plans.len() >= FFT_PLAN_CACHE {
        plans.remove(0);
    }
    plans.push((len, fft.clone()));
    fft
}

/// FFT of real input of even length `n`, computed with one complex FFT of length n/2 (the
/// classic even/odd packing), in place: the spectrum is kept for frequencies 0..=n/2 only, and
/// the inverse runs the same forward plan on the conjugate.
struct RealFft {
    n: usize,
    fft: Arc<dyn Fft<f64>>,
    scratch: Vec<Complex<f64>>,
    /// e^{-2 pi i j FINE / n} and e^{-2 pi i k / n} for k < FINE: twiddle k is one product.
    coarse: Vec<Complex<f64>>,
    fine: Vec<Complex<f64>>,
}

const FINE: usize = 64;

impl RealFft {
    fn new(n: usize) -> Self {
        debug_assert!(n >= 2 && n.is_multiple_of(2));
        let m = n / 2;
        let fft = fft_plan(m);
        let scratch = vec![Complex::new(0.0, 0.0); fft.get_inplace_scratch_len()];
        let angle = |k: usize| -2.0 * std::f64::consts::PI * k as f64 / n as f64;
        let fine = (0..FINE)
            .map(|k| Complex::from_polar(1.0, angle(k)))
            .collect();
        let coarse = (0..=m / FINE)
            .map(|j| Complex::from_polar(1.0, angle(j * FINE)))
            .collect();
        Self {
            n,
            fft,
            scratch,
            coarse,
            fine,
        }
    }

    /// e^{-2 pi i k / n}.
    fn twiddle(&self, k: usize) -> Complex<f64> {
        self.coarse[k / FINE] * self.fine[k % FINE]
    }

    /// Spectrum X[0..=n/2] of `x` zero-padded to n.
    fn forward(&mut self, x: &[f64]) -> Vec<Complex<f64>> {
        let m = self.n / 2;
        let mut z = Vec::with_capacity(m + 1);
        let pairs = x.chunks_exact(2);
        let odd_tail = pairs.remainder().first().copied();
        z.extend(pairs.map(|p| Complex::new(p[0], p[1])));
        if let Some(last) = odd_tail {
            z.push(Complex::new(last, 0.0));
        }
        z.resize(m, Complex::new(0.0, 0.0));
        self.fft.process_with_scratch(&mut z, &mut self.scratch);
        z.push(z[0]);
        // Unpack pairs (k, m - k) together so the transform stays in place.
        let unpack = |zk: Complex<f64>, zj: Complex<f64>, w: Complex<f64>| {
            let zc = zj.conj();
            let even = (zk + zc) * 0.5;
            let odd = (zk - zc) * Complex::new(0.0, -0.5);
            even + w * odd
        };
        for k in 0..=m / 2 {
            let j = m - k;
            let (zk, zj) = (z[k], z[j]);
            z[k] = unpack(zk, zj, self.twiddle(k));
            z[j] = unpack(zj, zk, self.twiddle(j));
        }
        z
    }

    /// The n real samples whose spectrum is `spec` (frequencies 0..=n/2, Hermitian), returned
    /// packed: sample 2k is `re` of element k, sample 2k + 1 its `im`.
    fn inverse(&mut self, mut spec: Vec<Complex<f64>>) -> Vec<Complex<f64>> {
        let m = self.n / 2;
        // Repack into the half-length spectrum Z = E + iO, conjugated so the forward plan
        // computes the inverse transform.
        let pack = |xk: Complex<f64>, xj: Complex<f64>, w: Complex<f64>| {
            let xc = xj.conj();
            let even = (xk + xc) * 0.5;
            let odd = (xk - xc) * 0.5 * w.conj();
            (even + Complex::new(0.0, 1.0) * odd).conj()
        };
        for k in 0..=m / 2 {
            let j = m - k;
            let (xk, xj) = (spec[k], spec[j]);
            spec[k] = pack(xk, xj, self.twiddle(k));
            spec[j] = pack(xj, xk, self.twiddle(j));
        }
        spec.truncate(m);
        self.fft.process_with_scratch(&mut spec, &mut self.scratch);
        let scale = 1.0 / m as f64;
        for c in spec.iter_mut() {
            *c = Complex::new(c.re * scale, -c.im * scale);
        }
        spec
    }
}

/// Appends the real samples `from..to` of a signal packed two per complex value (see
/// [`RealFft::inverse`]) to `out`.
fn extend_packed(out: &mut Vec<f64>, z: &[Complex<f64>], from: usize, to: usize) {
    let mut i = from;
    if i < to && i % 2 == 1 {
        out.push(z[i / 2].im);
        i += 1;
    }
    let whole = (to - i) / 2;
    for c in &z[i / 2..i / 2 + whole] {
        out.push(c.re);
        out.push(c.im);
    }
    i += 2 * whole;
    if i < to {
        out.push(z[i / 2].re);
    }
}

/// Linear convolution; direct for small inputs, FFT otherwise.
fn convolve(a: &[f64], b: &[f64]) -> Vec<f64> {
    let n = a.len() + b.len() - 1;
    if a.len().min(b.len()) <= 64 {
        let mut out = vec![0.0; n];
        for (i, &x) in a.iter().enumerate() {
            if x == 0.0 {
                continue;
            }
            for (j, &y) in b.iter().enumerate() {
                out[i + j] += x * y;
            }
        }
        return out;
    }
    let mut fft = RealFft::new(next_fast_even_len(n));
    let mut fa = fft.forward(a);
    let fb = fft.forward(b);
    for (x, y) in fa.iter_mut().zip(&fb) {
        *x *= *y;
    }
    let z = fft.inverse(fa);
    let mut out = Vec::with_capacity(n);
    extend_packed(&mut out, &z, 0, n);
    out
}

/// `times`-fold self-convolution of `a` computed circularly on `len` (even) points; returns the
/// `out_len` values starting at circular index `start`.
fn self_convolve_window(
    a: &[f64],
    len: usize,
    times: u64,
    start: usize,
    out_len: usize,
) -> Vec<f64> {
    let mut fft = RealFft::new(len);
    let mut spec = fft.forward(a);
    if times < 100 {
        for c in spec.iter_mut() {
            *c = complex_pow_by_squaring(*c, times);
        }
    } else {
        // |c|^times underflows to exactly 0 below this squared modulus: skip the transcendental
        // functions for the (many) decayed frequencies.
        let tiny = (-2.0 * 746.0 / times as f64).exp();
        let t = times as f64;
        for c in spec.iter_mut() {
            let r2 = c.norm_sqr();
            *c = if r2 < tiny {
                Complex::new(0.0, 0.0)
            } else {
                // Polar form, as numpy's complex power for large exponents.
                Complex::from_polar((0.5 * t * r2.ln()).exp(), t * c.arg())
            };
        }
    }
    let z = fft.inverse(spec);
    // The window may wrap around the end of the circular buffer.
    let mut out = Vec::with_capacity(out_len);
    let first = out_len.min(len - start);
    extend_packed(&mut out, &z, start, start + first);
    extend_packed(&mut out, &z, 0, out_len - first);
    out
}

/// z^n by repeated squaring (exact to rounding for small n).
fn complex_pow_by_squaring(z: Complex<f64>, n: u64) -> Complex<f64> {
    let mut result = Complex::new(1.0, 0.0);
    let mut base = z;
    let mut e = n;
    while e > 0 {
        if e & 1 == 1 {
            result *= base;
        }
        base *= base;
        e >>= 1;
    }
    result
}

/// A privacy loss distribution for the add-or-remove-one relation: one PMF per direction (one
/// shared PMF when the mechanism is symmetric).
#[derive(Clone, Debug, PartialEq)]
pub struct PrivacyLossDistribution {
    remove: Pmf,
    /// `None` when the "add" direction equals the "remove" one.
    add: Option<Pmf>,
}

impl PrivacyLossDistribution {
    /// The mechanism that reveals nothing.
    pub fn identity(discretization: f64) -> Self {
        Self {
            remove: Pmf::identity(discretization),
            add: None,
        }
    }

    /// The PLD of an additive-noise mechanism at sampling rate `q`, self-composed `times` times
    /// when given; the two directions are built on two threads.
    fn from_loss(
        noise: Noise,
        q: f64,
        discretization: f64,
        times: Option<u64>,
    ) -> Result<Self, PrivacyError> {
        check_discretization(discretization)?;
        let build = |direction| -> Result<Pmf, PrivacyError> {
            let pmf = MonotoneLoss::new(noise, q, direction).connect_dots_pmf(discretization)?;
            match times {
                Some(t) => pmf.self_compose(t, TAIL_MASS_TRUNCATION),
                None => Ok(pmf),
            }
        };
        if q == 1.0 {
            return Ok(Self {
                remove: build(Direction::Remove)?,
                add: None,
            });
        }
        let (remove, add) = both(|| build(Direction::Remove), || build(Direction::Add));
        Ok(Self {
            remove: remove?,
            add: Some(add?),
        })
    }

    /// One Gaussian mechanism (L2 sensitivity 1, noise std `sigma`) run on a Poisson sample of
    /// rate `sampling_rate` in (0, 1] (1 = no sampling).
    pub fn gaussian(
        sigma: f64,
        sampling_rate: f64,
        discretization: f64,
    ) -> Result<Self, PrivacyError> {
        if !(sigma.is_finite() && sigma > 0.0) {
            return Err(PrivacyError::InvalidParameter(format!(
                "noise standard deviation must be positive and finite, got {sigma}"
            )));
        }
        check_rate_open(sampling_rate)?;
        Self::from_loss(
            Noise::Gaussian { sigma },
            sampling_rate,
            discretization,
            None,
        )
    }

    /// One Laplace mechanism (L1 sensitivity 1, scale `scale`) on a Poisson sample of rate
    /// `sampling_rate` in (0, 1].
    pub fn laplace(
        scale: f64,
        sampling_rate: f64,
        discretization: f64,
    ) -> Result<Self, PrivacyError> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(PrivacyError::InvalidParameter(format!(
                "Laplace scale must be positive and finite, got {scale}"
            )));
        }
        check_rate_open(sampling_rate)?;
        Self::from_loss(
            Noise::Laplace { scale },
            sampling_rate,
            discretization,
            None,
        )
    }

    /// The pessimistic PLD of any (epsilon, delta)-DP mechanism: loss +inf w.p. delta, +epsilon
    /// w.p. (1 - delta)/(1 + e^-epsilon), -epsilon otherwise.
    pub fn from_epsilon_delta(
        epsilon: f64,
        delta: f64,
        discretization: f64,
    ) -> Result<Self, PrivacyError> {
        check_discretization(discretization)?;
        let valid = epsilon.is_finite() && epsilon >= 0.0 && (0.0..=1.0).contains(&delta);
        if !valid {
            return Err(PrivacyError::InvalidParameter(format!(
                "need finite epsilon >= 0 and delta in [0, 1], got ({epsilon}, {delta})"
            )));
        }
        let hi = (epsilon / discretization).ceil();
        let lo = (-epsilon / discretization).ceil();
        let points = (hi - lo) as u128 + 1;
        if points > MAX_GRID_POINTS as u128 {
            return Err(too_large(points));
        }
        let mut probs = vec![0.0; points as usize];
        probs[points as usize - 1] += (1.0 - delta) / (1.0 + (-epsilon).exp());
        probs[0] += (1.0 - delta) / (1.0 + epsilon.exp());
        let remove = Pmf {
            discretization,
            lower: lo as i64,
            probs,
            infinity_mass: delta,
        };
        Ok(Self { remove, add: None })
    }

    /// The PMF of the "remove" direction.
    pub fn remove_pmf(&self) -> &Pmf {
        &self.remove
    }

    /// The PMF of the "add" direction.
    pub fn add_pmf(&self) -> &Pmf {
        self.add.as_ref().unwrap_or(&self.remove)
    }

    /// Composition with `other` (both on the same grid).
    pub fn compose(&self, other: &Self) -> Result<Self, PrivacyError> {
        if self.add.is_none() && other.add.is_none() {
            let remove = self.remove.compose(&other.remove, TAIL_MASS_TRUNCATION)?;
            return Ok(Self { remove, add: None });
        }
        let (remove, add) = both(
            || self.remove.compose(&other.remove, TAIL_MASS_TRUNCATION),
            || {
                self.add_pmf()
                    .compose(other.add_pmf(), TAIL_MASS_TRUNCATION)
            },
        );
        Ok(Self {
            remove: remove?,
            add: Some(add?),
        })
    }

    /// `times`-fold composition with itself (cost independent of `times`).
    pub fn self_compose(&self, times: u64) -> Result<Self, PrivacyError> {
        match &self.add {
            None => Ok(Self {
                remove: self.remove.self_compose(times, TAIL_MASS_TRUNCATION)?,
                add: None,
            }),
            Some(add) => {
                let (remove, add) = both(
                    || self.remove.self_compose(times, TAIL_MASS_TRUNCATION),
                    || add.self_compose(times, TAIL_MASS_TRUNCATION),
                );
                Ok(Self {
                    remove: remove?,
                    add: Some(add?),
                })
            }
        }
    }

    /// Smallest epsilon (nats) at which the composed mechanism is (epsilon, `delta`)-DP
    /// (worst of both directions); +inf if none.
    pub fn epsilon_for_delta(&self, delta: f64) -> f64 {
        let e = self.remove.epsilon_for_delta(delta);
        match &self.add {
            Some(a) => e.max(a.epsilon_for_delta(delta)),
            None => e,
        }
    }

    /// Delta at `epsilon` nats (worst of both directions).
    pub fn delta_for_epsilon(&self, epsilon: f64) -> f64 {
        let d = self.remove.delta_for_epsilon(epsilon);
        match &self.add {
            Some(a) => d.max(a.delta_for_epsilon(epsilon)),
            None => d,
        }
    }

    /// The PLD of `event` on grid `discretization`, or `None` when the event contains a
    /// non-private part (zero noise: epsilon is then infinite).
    ///
    /// Identical parts are grouped first and each group is self-composed by FFT power, then the
    /// groups are convolved, so long heterogeneous histories stay fast. As dp_accounting, a
    /// self-composed plain Gaussian is one Gaussian with sigma / sqrt(count), a Poisson-sampled
    /// one is self-composed.
    pub fn from_event(event: &DpEvent, discretization: f64) -> Result<Option<Self>, PrivacyError> {
        check_discretization(discretization)?;
        let mut leaves: Vec<(Leaf, u64)> = Vec::new();
        let mut non_private = false;
        flatten(event, 1, &mut leaves, &mut non_private)?;
        if non_private {
            return Ok(None);
        }
        let mut pld = Self::identity(discretization);
        for (leaf, count) in leaves {
            let part = match leaf {
                Leaf::Gaussian(z) => {
                    Self::gaussian(z / (count as f64).sqrt(), 1.0, discretization)?
                }
                Leaf::Laplace(b) => Self::from_loss(
                    Noise::Laplace { scale: b },
                    1.0,
                    discretization,
                    Some(count),
                )?,
                Leaf::EpsilonDelta(e, d) => {
                    Self::from_epsilon_delta(e, d, discretization)?.self_compose(count)?
                }
                Leaf::SampledGaussian(q, z) => {
                    Self::from_loss(Noise::Gaussian { sigma: z }, q, discretization, Some(count))?
                }
                Leaf::SampledLaplace(q, b) => {
                    Self::from_loss(Noise::Laplace { scale: b }, q, discretization, Some(count))?
                }
            };
            pld = pld.compose(&part)?;
        }
        Ok(Some(pld))
    }
}

/// Runs two independent jobs, the second on a scoped thread: the two directions of a subsampled
/// mechanism are independent and equally expensive.
fn both<A: Send, B: Send>(a: impl FnOnce() -> A + Send, b: impl FnOnce() -> B + Send) -> (A, B) {
    std::thread::scope(|s| {
        let second = s.spawn(b);
        let first = a();
        match second.join() {
            Ok(v) => (first, v),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// A discrete Gaussian's parameters: both positive and finite (the ledger additionally asks
/// sigma >= 10 grid units, see `DpEvent::DiscreteGaussian`).
pub(crate) fn check_discrete_gaussian(sigma: f64, l2: f64) -> Result<(), PrivacyError> {
    if !(sigma.is_finite() && sigma > 0.0 && l2.is_finite() && l2 > 0.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "discrete Gaussian sigma and L2 sensitivity must be positive and finite, got \
             sigma {sigma}, sensitivity {l2}"
        )));
    }
    Ok(())
}

fn check_discretization(d: f64) -> Result<(), PrivacyError> {
    if !(d.is_finite() && d > 0.0) {
        return Err(PrivacyError::InvalidParameter(format!(
            "discretization must be positive and finite, got {d}"
        )));
    }
    Ok(())
}

fn check_rate_open(q: f64) -> Result<(), PrivacyError> {
    super::params::SamplingRate::try_from(q)?;
    Ok(())
}

/// An elementary mechanism of an event tree.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Leaf {
    Gaussian(f64),
    Laplace(f64),
    EpsilonDelta(f64, f64),
    SampledGaussian(f64, f64),
    SampledLaplace(f64, f64),
}

/// Collects the leaves of `event` with their multiplicities, merging identical leaves (bitwise
/// equal parameters) in order of first appearance.
fn flatten(
    event: &DpEvent,
    count: u64,
    out: &mut Vec<(Leaf, u64)>,
    non_private: &mut bool,
) -> Result<(), PrivacyError> {
    if count == 0 {
        return Ok(());
    }
    let mut push = |leaf: Leaf| -> Result<(), PrivacyError> {
        if let Some(slot) = out.iter_mut().find(|(l, _)| same_leaf(l, &leaf)) {
            slot.1 = slot.1.checked_add(count).ok_or_else(|| {
                PrivacyError::InvalidParameter("composition count overflows u64".into())
            })?;
        } else {
            out.push((leaf, count));
        }
        Ok(())
    };
    match event {
        DpEvent::Gaussian {
            noise_multiplier: z,
        } => {
            super::rdp::check_noise(*z)?;
            if *z == 0.0 {
                *non_private = true;
            } else if z.is_finite() {
                push(Leaf::Gaussian(*z))?;
            }
        }
        DpEvent::DiscreteGaussian {
            sigma,
            l2_sensitivity,
        } => {
            // The continuous Gaussian with the same ratio (see `DpEvent::DiscreteGaussian`).
            check_discrete_gaussian(*sigma, *l2_sensitivity)?;
            push(Leaf::Gaussian(sigma / l2_sensitivity))?;
        }
        DpEvent::Laplace { scale } => {
            if scale.is_nan() || *scale < 0.0 {
                return Err(PrivacyError::InvalidParameter(format!(
                    "Laplace scale must be non-negative, got {scale}"
                )));
            }
            if *scale == 0.0 {
                *non_private = true;
            } else if scale.is_finite() {
                push(Leaf::Laplace(*scale))?;
            }
        }
        DpEvent::EpsilonDelta { epsilon, delta } => {
            if epsilon.is_infinite() || *delta >= 1.0 {
                *non_private = true;
            } else {
                push(Leaf::EpsilonDelta(*epsilon, *delta))?;
            }
        }
        DpEvent::PoissonSampled {
            sampling_rate: q,
            event: inner,
        } => {
            super::rdp::check_rate(*q)?;
            if *q == 0.0 {
                return Ok(());
            }
            if let DpEvent::Laplace { scale } = inner.as_ref() {
                if scale.is_nan() || *scale < 0.0 {
                    return Err(PrivacyError::InvalidParameter(format!(
                        "Laplace scale must be non-negative, got {scale}"
                    )));
                }
                if *scale == 0.0 {
                    *non_private = true;
                } else if scale.is_finite() {
                    push(Leaf::SampledLaplace(*q, *scale))?;
                }
                return Ok(());
            }
            let z = effective_gaussian_noise(inner).map_err(|bad| {
                PrivacyError::Unsupported(format!(
                    "PLD: a Poisson-sampled event must be a Laplace mechanism or a composition of \
                     Gaussians, got {bad:?}"
                ))
            })?;
            super::rdp::check_noise(z)?;
            if z == 0.0 {
                *non_private = true;
            } else if z.is_finite() {
                push(Leaf::SampledGaussian(*q, z))?;
            }
        }
        DpEvent::SelfComposed {
            event: inner,
            count: c,
        } => {
            let total = count.checked_mul(*c).ok_or_else(|| {
                PrivacyError::InvalidParameter("composition count overflows u64".into())
            })?;
            flatten(inner, total, out, non_private)?;
        }
        DpEvent::Composed { events } => {
            for e in events {
                flatten(e, count, out, non_private)?;
            }
        }
    }
    Ok(())
}

fn same_leaf(a: &Leaf, b: &Leaf) -> bool {
    let bits = |l: &Leaf| -> (u8, u64, u64) {
        match *l {
            Leaf::Gaussian(z) => (0, z.to_bits(), 0),
            Leaf::Laplace(b) => (1, b.to_bits(), 0),
            Leaf::EpsilonDelta(e, d) => (2, e.to_bits(), d.to_bits()),
            Leaf::SampledGaussian(q, z) => (3, q.to_bits(), z.to_bits()),
            Leaf::SampledLaplace(q, b) => (4, q.to_bits(), b.to_bits()),
        }
    };
    bits(a) == bits(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_lengths_are_smooth_and_minimal() {
        assert_eq!(next_fast_len(1), 1);
        assert_eq!(next_fast_len(11), 12);
        assert_eq!(next_fast_len(1025), 1029); // 3 * 7^3
        for t in [97usize, 242_254, 1_000_001] {
            let n = next_fast_len(t);
            assert!(n >= t);
            let mut m = n;
            for p in [2, 3, 5, 7] {
                while m.is_multiple_of(p) {
                    m /= p;
                }
            }
            assert_eq!(m, 1, "{n}");
        }
    }

    #[test]
    fn self_composition_matches_repeated_convolution() {
        let p = Pmf {
            discretization: 0.1,
            lower: -2,
            probs: vec![0.1, 0.2, 0.3, 0.4],
            infinity_mass: 0.0,
        };
        let fast = p.self_compose(5, 0.0).unwrap();
        let mut slow = p.clone();
        for _ in 1..5 {
            slow = slow.compose(&p, 0.0).unwrap();
        }
        assert_eq!(fast.lower, slow.lower);
        assert_eq!(fast.probs.len(), slow.probs.len());
        for (a, b) in fast.probs.iter().zip(&slow.probs) {
            assert!((a - b).abs() < 1e-15);
        }
    }

    #[test]
    fn truncation_is_pessimistic() {
        let (off, kept, right) = truncate_tails(vec![1e-17, 0.5, 0.5, 1e-17], 1e-15);
        assert_eq!(off, 1);
        assert_eq!(kept.len(), 2);
        assert!((kept[0] - (0.5 + 1e-17)).abs() < 1e-18);
        assert_eq!(right, 1e-17);
    }

    #[test]
    fn fft_plans_are_bounded() {
        // Other tests plan concurrently: only the bound holds at every moment.
        for len in 100..120 {
            assert_eq!(fft_plan(len).len(), len);
        }
        let kept = FFT_PLANS.lock().map(|p| p.len()).unwrap_or(0);
        assert!(kept <= FFT_PLAN_CACHE, "{kept} plans kept");
    }
}
