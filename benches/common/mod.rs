//! Shared by the bench binaries: the `--bench` gate, a small deterministic PRNG (the crate
//! has no `rand`), medians.
#![allow(dead_code)]

/// True when the binary was started by `cargo bench` (or `.gpu/run`), which pass `--bench`.
/// `cargo test --benches` runs the binaries without it: they must exit at once.
pub fn bench_requested() -> bool {
    std::env::args().skip(1).any(|a| a == "--bench")
}

/// SplitMix64, the simulator's PRNG: deterministic, good enough to draw inputs.
pub use v4pool::sim::Rng;

/// Median of a sample (sorts it).
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// `p`-th percentile (0..=100) of a sorted sample.
pub fn percentile_sorted(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Human bytes (decimal).
pub fn fmt_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{b:.0} B")
    }
}

pub fn met(ok: bool) -> &'static str {
    if ok {
        "MET"
    } else {
        "NOT MET"
    }
}
