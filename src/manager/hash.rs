//! Content addresses of full blocks: a 128-bit chained hash of a block's tokens, its parent's
//! hash and the engine's namespace.
//!
//! 128 bits, tokens not verified: a match compares hashes only (verifying 1M tokens would cost
//! more than the 100 µs a match is allowed). The hash is not cryptographic; accidental
//! collisions among 2^32 cached blocks have probability about 2^-64. An engine that accepts
//! adversarial token streams across tenants should give each tenant its own namespace.

use std::hash::{BuildHasherDefault, Hasher};

/// The content address of a full block: its tokens and every token before it, in one
/// namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// What the engine sets so blocks of different models or adapters never match: a model
/// revision, an adapter id, a tenant. Derive it with [`Namespace::from_label`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Namespace(pub u128);

impl Namespace {
    /// The namespace of a label such as `"deepseek-v4-flash@rev3+adapter7"`.
    pub fn from_label(label: &str) -> Namespace {
        let mut h = Mixer::new(0x6e61_6d65_7370_6163_6500_0000_0000_0001);
        for chunk in label.as_bytes().chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            h.push(u64::from_le_bytes(w));
        }
        h.push(label.len() as u64);
        Namespace(h.finish())
    }
}

use crate::rng::{mum, WY};

const K0: u64 = WY[0];
const K1: u64 = WY[1];
const K2: u64 = WY[2];
const K3: u64 = WY[3];

/// Two independent 64-bit lanes, each a wyhash-style absorb of 64-bit words.
struct Mixer {
    a: u64,
    b: u64,
    n: u64,
}

impl Mixer {
    fn new(seed: u128) -> Mixer {
        Mixer { a: seed as u64 ^ K0, b: (seed >> 64) as u64 ^ K1, n: 0 }
    }
    #[inline]
    fn push(&mut self, w: u64) {
        self.a = mum(self.a ^ w ^ K2, self.b ^ K3 ^ self.n);
        self.b = mum(self.b ^ w.rotate_left(32) ^ K1, self.a ^ K0);
        self.n = self.n.wrapping_add(1);
    }
    fn finish(self) -> u128 {
        let a = mum(self.a ^ K1, self.n ^ K3);
        let b = mum(self.b ^ K2, a ^ K0);
        (u128::from(b) << 64) | u128::from(a ^ mum(a, K3))
    }
}

/// The hash of one full block: `tokens` (exactly one block of them) after `parent` (`None` for
/// the first block) in `namespace`.
pub fn block_hash(namespace: Namespace, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = Mixer::new(namespace.0 ^ parent.map_or(0x0123_4567_89ab_cdef, |p| p.0.rotate_left(17)));
    h.push(parent.map_or(u64::MAX, |p| p.0 as u64));
    h.push(parent.map_or(u64::MAX, |p| (p.0 >> 64) as u64));
    for pair in tokens.chunks(2) {
        let w = u64::from(pair[0]) | pair.get(1).map_or(1u64 << 63, |&t| u64::from(t) << 32);
        h.push(w);
    }
    h.push(tokens.len() as u64);
    BlockHash(h.finish())
}

/// The hashes of every full block of `tokens` (a trailing partial block has none), chained
/// from `parent`.
pub fn chain_hashes(
    namespace: Namespace,
    parent: Option<BlockHash>,
    tokens: &[u32],
    block_size: usize,
) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut prev = parent;
    for block in tokens.chunks_exact(block_size.max(1)) {
        let h = block_hash(namespace, prev, block);
        out.push(h);
        prev = Some(h);
    }
    out
}

/// The hash maps keyed by [`BlockHash`] use its low 64 bits as the bucket hash: the key is
/// already uniformly mixed, so hashing it again would only cost time.
#[derive(Default)]
pub struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

/// `BuildHasher` for maps keyed by [`BlockHash`].
pub type BuildPassThrough = BuildHasherDefault<PassThrough>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_every_input() {
        let ns = Namespace::from_label("m@1");
        let t: Vec<u32> = (0..512).collect();
        let h = chain_hashes(ns, None, &t, 256);
        assert_eq!(h.len(), 2);
        assert_eq!(h[1], block_hash(ns, Some(h[0]), &t[256..]));
        let mut u = t.clone();
        u[3] ^= 1;
        let g = chain_hashes(ns, None, &u, 256);
        assert_ne!(g[0], h[0]);
        assert_ne!(g[1], h[1], "a change in block 0 changes every later hash");
        assert_ne!(chain_hashes(Namespace::from_label("m@2"), None, &t, 256)[0], h[0]);
        assert_eq!(chain_hashes(ns, None, &t[..300], 256).len(), 1);
        // Swapping two tokens changes the hash.
        let mut s = t.clone();
        s.swap(0, 1);
        assert_ne!(chain_hashes(ns, None, &s, 256)[0], h[0]);
    }
}
