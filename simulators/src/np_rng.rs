//! numpy's default generator (`SeedSequence` + `PCG64`), so that `reset(seed)` draws the same
//! initial states as Gymnasium's `env.reset(seed=seed)` (which seeds `np.random.PCG64` through a
//! `SeedSequence`). Only what the environments need: uniform doubles.

/// PCG's default 128-bit LCG multiplier.
const PCG_MULT: u128 = (2_549_297_995_355_413_924u128 << 64) | 4_865_540_595_714_422_341u128;

// SeedSequence hashing constants (O'Neill's seed_seq design as numpy implements it).
const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;
const POOL_SIZE: usize = 4;

fn hashmix(value: u32, hash_const: &mut u32) -> u32 {
    let mut v = value ^ *hash_const;
    *hash_const = hash_const.wrapping_mul(MULT_A);
    v = v.wrapping_mul(*hash_const);
    v ^ (v >> XSHIFT)
}

fn mix(x: u32, y: u32) -> u32 {
    let r = MIX_MULT_L
        .wrapping_mul(x)
        .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    r ^ (r >> XSHIFT)
}

/// The entropy pool of `np.random.SeedSequence(seed)` for a non-negative integer seed.
fn seed_sequence_pool(seed: u64) -> [u32; POOL_SIZE] {
    // The integer is split into little-endian 32-bit words; 0 becomes [0].
    let entropy: [u32; 2] = [seed as u32, (seed >> 32) as u32];
    let n_words = if seed >> 32 == 0 { 1 } else { 2 };
    let mut pool = [0u32; POOL_SIZE];
    let mut hash_const = INIT_A;
    for (i, slot) in pool.iter_mut().enumerate() {
        let word = if i < n_words { entropy[i] } else { 0 };
        *slot = hashmix(word, &mut hash_const);
    }
    for i_src in 0..POOL_SIZE {
        for i_dst in 0..POOL_SIZE {
            if i_src != i_dst {
                let h = hashmix(pool[i_src], &mut hash_const);
                pool[i_dst] = mix(pool[i_dst], h);
            }
        }
    }
    pool
}

/// `SeedSequence.generate_state(4, np.uint64)`.
fn generate_state_u64x4(pool: &[u32; POOL_SIZE]) -> [u64; 4] {
    let mut words = [0u32; 8];
    let mut hash_const = INIT_B;
    for (i, w) in words.iter_mut().enumerate() {
        let mut v = pool[i % POOL_SIZE] ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_B);
        v = v.wrapping_mul(hash_const);
        *w = v ^ (v >> XSHIFT);
    }
    let mut out = [0u64; 4];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u64::from(words[2 * i]) | (u64::from(words[2 * i + 1]) << 32);
    }
    out
}

/// numpy's `PCG64` bit generator (XSL-RR output on a 128-bit LCG).
#[derive(Clone, Debug)]
pub struct NpPcg64 {
    state: u128,
    inc: u128,
}

impl NpPcg64 {
    /// The generator of `np.random.default_rng(seed)` / Gymnasium's `np_random` for `seed`.
    pub fn from_seed(seed: u64) -> Self {
        let s = generate_state_u64x4(&seed_sequence_pool(seed));
        // numpy passes (seed[0], seed[1]) as (high, low) halves of the 128-bit values.
        let init_state = (u128::from(s[0]) << 64) | u128::from(s[1]);
        let init_seq = (u128::from(s[2]) << 64) | u128::from(s[3]);
        let mut rng = NpPcg64 {
            state: 0,
            inc: (init_seq << 1) | 1,
        };
        rng.step();
        rng.state = rng.state.wrapping_add(init_state);
        rng.step();
        rng
    }

    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let hi = (self.state >> 64) as u64;
        let lo = self.state as u64;
        (hi ^ lo).rotate_right((self.state >> 122) as u32)
    }

    /// A double in [0, 1) with 53 random bits, as numpy draws it.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `Generator.uniform(low, high)`: `low + (high - low) * u`.
    pub fn uniform(&mut self, low: f64, high: f64) -> f64 {
        low + (high - low) * self.next_f64()
    }
}

impl NpPcg64 {
    /// A standard normal draw (Box-Muller on two uniforms). Deterministic, but not the ziggurat
    /// numpy's `standard_normal` uses: only for simulators that do not claim numpy's streams.
    pub fn standard_normal(&mut self) -> f64 {
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_rng_zero_matches_numpy() {
        // np.random.default_rng(0).random() == 0.6369616873214543
        let mut r = NpPcg64::from_seed(0);
        assert_eq!(r.next_f64(), 0.6369616873214543);
    }
}
