//! The crate's one random-number generator (SplitMix64): the simulator's workload stream, the
//! benches' inputs and every test's random data, unit and integration tests alike. It lives
//! at the bottom of the layering so that a unit test of any module may use it; the public path
//! is [`crate::sim::Rng`].

/// wyhash's four secret constants: the multiply-fold mixing of the block hashes
/// (`manager::hash`) and of the shared tier's checksum (`transfer::shared_tier`).
pub(crate) const WY: [u64; 4] =
    [0xa076_1d64_78bd_642f, 0xe703_7ed1_a0b4_28db, 0x8ebc_6af0_9c88_c6e3, 0x5899_65cc_7537_4cc3];

/// wyhash's folded 64×64→128 multiply: the high and low halves of the product xor-ed.
#[inline]
pub(crate) fn mum(a: u64, b: u64) -> u64 {
    let r = u128::from(a) * u128::from(b);
    (r as u64) ^ ((r >> 64) as u64)
}

/// A deterministic PRNG (SplitMix64): the simulator's workload must be identical for every
/// run kind of one seed, and the benches and every test (unit and integration) draw their
/// inputs from it too. Reached as [`crate::sim::Rng`].
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`; equal seeds give equal sequences.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, n)` (multiply-shift, no modulo bias worth the name); `below(0)` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
    /// Fill `buf` with random bytes: each 8 bytes one draw, little-endian (a tail of fewer
    /// takes the low bytes of one more draw).
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let last = self.next_u64().to_le_bytes();
            rest.copy_from_slice(&last[..rest.len()]);
        }
    }
    /// `n` random bytes ([`Rng::fill`]).
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.fill(&mut v);
        v
    }
    /// Uniform in `lo..hi` (`hi > lo`; an empty range yields `lo`).
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        let span = hi.wrapping_sub(lo).max(1) as u64;
        lo.wrapping_add((self.next_u64() % span) as i64)
    }
    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Poisson-distributed count (Knuth; fine for the small means a step sees). Capped at
    /// 1,001 draws, so a huge mean cannot loop long.
    pub fn poisson(&mut self, mean: f64) -> u64 {
        let l = (-mean).exp();
        let (mut k, mut p) = (0u64, 1.0);
        loop {
            p *= self.f64();
            if p <= l || k > 1000 {
                return k;
            }
            k += 1;
        }
    }
    /// Log-normal with the given median and log-sd, clamped to [lo, hi].
    pub fn lognormal(&mut self, median: f64, sigma: f64, lo: u64, hi: u64) -> u64 {
        let (u1, u2) = (self.f64().max(1e-12), self.f64());
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        ((median * (sigma * z).exp()) as u64).clamp(lo, hi)
    }
    /// Log-uniform in [lo, hi].
    pub fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        ((a + (b - a) * self.f64()).exp() as u64).clamp(lo, hi)
    }
}
