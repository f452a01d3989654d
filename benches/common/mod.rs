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

/// One random decode batch over `g`, the draw both decode benches stage: `batch` distinct
/// live slot positions (shuffled), contexts uniform in `ctx_lo..=ctx_hi`, and for each a block
/// table of random block ids covering its context (the builders read the ids, not their blocks).
pub fn random_decode_batch(
    rng: &mut Rng,
    g: &v4pool::geometry::UnifiedPoolGeometry,
    batch: usize,
    ctx_lo: i64,
    ctx_hi: i64,
) -> (Vec<i64>, Vec<i64>, Vec<Vec<i32>>) {
    let mut pos: Vec<i64> = g.live_positions().collect();
    rng.shuffle(&mut pos);
    pos.truncate(batch);
    let ctx: Vec<i64> = (0..batch).map(|_| rng.range(ctx_lo, ctx_hi + 1)).collect();
    let tables = ctx
        .iter()
        .map(|&c| {
            let n = (c + g.block_size - 1) / g.block_size;
            (0..n).map(|_| rng.range(0, g.num_blocks) as i32).collect()
        })
        .collect();
    (pos, ctx, tables)
}

pub fn met(ok: bool) -> &'static str {
    if ok {
        "MET"
    } else {
        "NOT MET"
    }
}

/// Graph-replay timing on the CUDA backend, shared by the state-kernel benches: each rep
/// evicts L2 with a `FLUSH_BYTES` memset, then device events bracket the replay; the first
/// `GRAPH_WARM` reps are dropped and the median / p10 / p90 of `GRAPH_REPS` kept (µs).
pub mod graph {
    use std::error::Error;
    use v4pool::backend::cuda::{CudaBackend, CudaEvent, CudaGraph};
    use v4pool::backend::{Backend, DeviceAllocation, Stream};

    type Res<T> = Result<T, Box<dyn Error>>;

    /// The stream every timed graph runs on (the backend's own).
    pub const S: Stream = Stream::DEFAULT;
    /// Bytes memset before every rep: larger than the H200's L2.
    pub const FLUSH_BYTES: u64 = 256 << 20;
    /// Reps dropped before timing.
    pub const GRAPH_WARM: usize = 10;
    /// Reps timed.
    pub const GRAPH_REPS: usize = 200;

    /// An L2-flush buffer and two events on one backend.
    pub struct GraphTimer {
        /// The backend the graphs run on.
        pub be: CudaBackend,
        flush: DeviceAllocation,
        ev0: CudaEvent,
        ev1: CudaEvent,
    }

    impl GraphTimer {
        /// Allocate the flush buffer and the events on `be`.
        pub fn new(be: &CudaBackend) -> Res<GraphTimer> {
            Ok(GraphTimer {
                flush: be.alloc_zeroed(FLUSH_BYTES)?,
                ev0: be.event()?,
                ev1: be.event()?,
                be: be.clone(),
            })
        }

        /// Median / p10 / p90 µs of replaying `g`, `prep(i)` (untimed) before each rep's flush.
        pub fn replay(&self, g: &CudaGraph, prep: impl FnMut(usize) -> Res<()>) -> Res<(f64, f64, f64)> {
            self.replay_reps(g, GRAPH_REPS, prep)
        }

        /// [`Self::replay`] over `reps` timed reps (after `GRAPH_WARM` warm-ups).
        pub fn replay_reps(
            &self,
            g: &CudaGraph,
            reps: usize,
            mut prep: impl FnMut(usize) -> Res<()>,
        ) -> Res<(f64, f64, f64)> {
            let mut v = Vec::with_capacity(reps);
            for i in 0..GRAPH_WARM + reps {
                prep(i)?;
                // SAFETY: the flush allocation is live and FLUSH_BYTES long.
                unsafe { self.be.fill_u32(self.flush.ptr, FLUSH_BYTES / 4, i as u32, S)? };
                self.ev0.record(S)?;
                g.replay(S)?;
                self.ev1.record(S)?;
                if i >= GRAPH_WARM {
                    v.push(f64::from(self.ev0.elapsed_ms(&self.ev1)?) * 1e3);
                }
            }
            let med = super::median(&mut v);
            Ok((med, super::percentile_sorted(&v, 10.0), super::percentile_sorted(&v, 90.0)))
        }

        /// Capture what `queue()` puts on the stream into a graph.
        pub fn capture(&self, queue: impl FnOnce() -> Res<()>) -> Res<CudaGraph> {
            let cap = self.be.begin_capture(S)?;
            queue()?;
            Ok(cap.end()?)
        }
    }

    impl GraphTimer {
        /// Free the flush buffer.
        ///
        /// # Safety
        /// The stream is drained: no queued or captured work still names the buffer.
        pub unsafe fn release(self) {
            // SAFETY: the caller's contract.
            unsafe { self.be.free(self.flush) }
        }
    }
}
