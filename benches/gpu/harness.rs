//! The timing harness (cold-L2 repetitions between two events, the floors measured in the
//! same run) and the table the groups print.

use crate::common::{fmt_bytes, median, percentile_sorted};
use crate::{Res, FLUSH_BYTES, REPS, S, WARM};
use v4pool::backend::cuda::{CudaBackend, CudaEvent, CudaGraph};
use v4pool::backend::{Backend, DeviceAllocation};
use v4pool::raw::index::{CopyRun, CopyRunsArgs, DevicePtr, Launch};

#[derive(Clone, Copy, Debug)]
pub(crate) struct Stat {
    /// Median, 10th and 90th percentile, µs.
    pub(crate) med: f64,
    pub(crate) p10: f64,
    pub(crate) p90: f64,
}

pub(crate) struct Gpu {
    pub(crate) be: CudaBackend,
    pub(crate) flush: DeviceAllocation,
    pub(crate) flush_value: std::cell::Cell<u32>,
    pub(crate) ev0: CudaEvent,
    pub(crate) ev1: CudaEvent,
    /// Copy floor buffers.
    pub(crate) copy_src: DeviceAllocation,
    pub(crate) copy_dst: DeviceAllocation,
    /// Descriptors of the kernel copy floor (`copy_runs` over 1 MiB pieces).
    pub(crate) copy_desc: DeviceAllocation,
}

/// Piece size of the kernel copy floor.
pub(crate) const COPY_PIECE: u64 = 1 << 20;
/// The traffic floor's pieces: 128 KiB, so even a 4 MB floor spreads over every SM (32 blocks
/// a piece).
pub(crate) const TRAFFIC_PIECE: u64 = 128 << 10;

impl Gpu {
    /// Evict L2 (and keep the GPU busy while the host queues what follows).
    pub(crate) fn flush(&self) -> Res<()> {
        let v = self.flush_value.get().wrapping_add(1);
        self.flush_value.set(v);
        // SAFETY: the scratch allocation is live and FLUSH_BYTES long.
        unsafe { self.be.fill_u32(self.flush.ptr, FLUSH_BYTES / 4, v, S)? };
        Ok(())
    }

    /// `prep(i)` (untimed), flush, then the device time of `work(i)`; WARM + REPS times.
    pub(crate) fn time(
        &self,
        reps: usize,
        mut prep: impl FnMut(usize) -> Res<()>,
        mut work: impl FnMut(usize) -> Res<()>,
    ) -> Res<Stat> {
        let mut v = Vec::with_capacity(reps);
        for i in 0..WARM + reps {
            prep(i)?;
            self.flush()?;
            self.ev0.record(S)?;
            work(i)?;
            self.ev1.record(S)?;
            let us = f64::from(self.ev0.elapsed_ms(&self.ev1)?) * 1e3;
            if i >= WARM {
                v.push(us);
            }
        }
        let med = median(&mut v);
        Ok(Stat { med, p10: percentile_sorted(&v, 10.0), p90: percentile_sorted(&v, 90.0) })
    }

    pub(crate) fn time_graphs(&self, graphs: &[CudaGraph], prep: impl FnMut(usize) -> Res<()>) -> Res<Stat> {
        self.time(REPS, prep, |i| Ok(graphs[i % graphs.len()].replay(S)?))
    }

    /// Capture `queue()` on the stream into a graph.
    pub(crate) fn capture(&self, queue: impl FnOnce() -> Res<()>) -> Res<CudaGraph> {
        let cap = self.be.begin_capture(S)?;
        queue()?;
        Ok(cap.end()?)
    }

    pub(crate) fn launch(&self, l: &Launch) -> Res<()> {
        // SAFETY: every caller builds `l` from buffers it allocated on this backend and sized
        // as the argument struct states (a decode path's own, the prefill layout, copy runs).
        unsafe { self.be.launch(l, S)? };
        Ok(())
    }

    pub(crate) fn graph_of(&self, launches: &[Launch]) -> Res<CudaGraph> {
        self.capture(|| {
            for l in launches {
                self.launch(l)?;
            }
            Ok(())
        })
    }

    /// As [`graph_of`](Self::graph_of), with every launch serialised as a plain launch (no
    /// programmatic dependent launch): the comparison for the overlapped default.
    pub(crate) fn graph_serial(&self, launches: &[Launch]) -> Res<CudaGraph> {
        let was = self.be.overlapped_launches();
        self.be.set_overlapped_launches(false)?;
        let g = self.graph_of(launches);
        self.be.set_overlapped_launches(was)?;
        g
    }

    /// The bandwidth floor for `bytes`: the faster (by median) of two device-to-device copies,
    /// each a graph replay with a cold L2: the driver's memcpy, and `copy_runs` over 1 MiB
    /// pieces (on the first H200 run the driver's memcpy reached 4.16 TB/s at 256 MiB but only
    /// 2.5-2.7 TB/s at the other sizes of the tables, so one path alone is not a fair floor).
    pub(crate) fn copy_floor(&self, bytes: u64) -> Res<Stat> {
        Ok(self.copy_floors(bytes)?.0)
    }

    /// `(floor, memcpy, kernel copy)`.
    pub(crate) fn copy_floors(&self, bytes: u64) -> Res<(Stat, Stat, Stat)> {
        let bytes = bytes.clamp(16, self.copy_src.bytes);
        let memcpy = self.capture(|| {
            // SAFETY: both floor buffers are live, disjoint and at least `bytes` long.
            unsafe { self.be.copy(self.copy_dst.ptr, self.copy_src.ptr, bytes, S)? };
            Ok(())
        })?;
        let kernel = self.copy_runs_graph(bytes, COPY_PIECE, |k| k)?;
        let m = self.time_graphs(std::slice::from_ref(&memcpy), |_| Ok(()))?;
        let k = self.time_graphs(std::slice::from_ref(&kernel), |_| Ok(()))?;
        Ok((if k.med < m.med { k } else { m }, m, k))
    }

    /// The traffic floor of a kernel that reads `read` distinct bytes and writes `written`:
    /// one copy_runs launch whose destination pieces (TRAFFIC_PIECE) cover `written`, consecutive
    /// pieces sharing a source piece so the distinct source bytes are `read` (blocks of one
    /// source run side by side: its second and later readers find it in L2). Graph replay,
    /// cold L2.
    pub(crate) fn traffic_floor(&self, read: u64, written: u64) -> Res<Stat> {
        let written = written.clamp(16, self.copy_dst.bytes);
        let read = read.clamp(16, written);
        let (nsrc, ndst) = (read.div_ceil(TRAFFIC_PIECE), written.div_ceil(TRAFFIC_PIECE));
        let kernel = self.copy_runs_graph(written, TRAFFIC_PIECE, |k| k * nsrc / ndst)?;
        self.time_graphs(std::slice::from_ref(&kernel), |_| Ok(()))
    }

    /// One copy_runs launch, captured: destination pieces of `piece` bytes cover `bytes` of the
    /// floor's destination, piece k reading source piece `src_piece(k)`.
    pub(crate) fn copy_runs_graph(
        &self,
        bytes: u64,
        piece: u64,
        src_piece: impl Fn(u64) -> u64,
    ) -> Res<CudaGraph> {
        let runs: Vec<CopyRun> = (0..bytes.div_ceil(piece))
            .map(|k| {
                let off = k * piece;
                CopyRun {
                    src: self.copy_src.ptr + src_piece(k) * piece,
                    dst: self.copy_dst.ptr + off,
                    bytes: piece.min(bytes - off),
                }
            })
            .collect();
        // The previous floor's replays have finished (every timed rep waits for its end event).
        self.upload(self.copy_desc.ptr, &runs)?;
        self.graph_of(&[Launch::CopyRuns(
            CopyRunsArgs::default().with_runs(self.copy_desc.ptr).with_num_runs(runs.len() as i32),
        )])
    }

    /// The write floor for `bytes`: a driver memset of them (graph replay, cold L2).
    pub(crate) fn memset_floor(&self, bytes: u64) -> Res<Stat> {
        let words = bytes.clamp(16, self.copy_dst.bytes) / 4;
        let graph = self.capture(|| {
            // SAFETY: the floor's destination buffer is live and at least `words` words long.
            unsafe { self.be.fill_u32(self.copy_dst.ptr, words, 0x5a5a_5a5a, S)? };
            Ok(())
        })?;
        self.time_graphs(std::slice::from_ref(&graph), |_| Ok(()))
    }

    pub(crate) fn upload<T: bytemuck::Pod>(&self, dst: DevicePtr, v: &[T]) -> Res<()> {
        // SAFETY: callers pass a range inside one of their own live allocations.
        unsafe { self.be.upload(dst, bytemuck::cast_slice(v), S)? };
        Ok(())
    }
}

pub(crate) fn alloc(be: &dyn Backend, bytes: u64) -> Res<DeviceAllocation> {
    Ok(be.alloc_zeroed(bytes.max(256))?)
}

pub(crate) fn free(be: &dyn Backend, a: DeviceAllocation) {
    // SAFETY: every caller synchronises (a download or elapsed_ms) before freeing, and drops
    // the graphs that name the allocation first.
    unsafe { be.free(a) };
}

pub(crate) fn download_i32(be: &dyn Backend, ptr: DevicePtr, n: usize) -> Res<Vec<i32>> {
    let mut v = vec![0i32; n];
    // SAFETY: callers pass ranges inside their live allocations.
    unsafe { be.download(bytemuck::cast_slice_mut(&mut v), ptr, S)? };
    Ok(v)
}

pub(crate) fn download_u8(be: &dyn Backend, ptr: DevicePtr, n: usize) -> Res<Vec<u8>> {
    let mut v = vec![0u8; n];
    // SAFETY: callers pass ranges inside their live allocations.
    unsafe { be.download(&mut v, ptr, S)? };
    Ok(v)
}

/// First mismatch of two outputs, as an error naming the buffer.
pub(crate) fn compare(what: &str, gpu: &[i32], host: &[i32]) -> Res<()> {
    if gpu.len() != host.len() {
        return Err(format!("{what}: {} entries on the GPU, {} on the host", gpu.len(), host.len()).into());
    }
    if let Some(i) = gpu.iter().zip(host).position(|(a, b)| a != b) {
        return Err(format!("{what}: entry {i} is {} on the GPU, {} on the host", gpu[i], host[i]).into());
    }
    Ok(())
}

// ---- table printing -----------------------------------------------------------------------

pub(crate) struct Floors {
    pub(crate) empty_launch: Stat,
    pub(crate) empty_graph: Stat,
}

pub(crate) fn header(title: &str) {
    println!("\n== {title}");
    println!(
        "  {:<34} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>8} {:>8} {:>9}",
        "config",
        "eager µs",
        "graph µs",
        "g p90",
        "read",
        "written",
        "copy µs",
        "g/empty",
        "g/copy",
        "W GB/s"
    );
    println!("  {:<34} {:>9} {:>9}", "", "memset µs", "g/memset");
}

pub(crate) struct Row<'a> {
    pub(crate) name: &'a str,
    pub(crate) eager: Option<Stat>,
    pub(crate) graph: Stat,
    pub(crate) read: u64,
    pub(crate) written: u64,
    pub(crate) copy: Stat,
    /// A memset of the written bytes (graph replay, cold L2): a builder only writes.
    pub(crate) memset: Stat,
}

pub(crate) fn print_row(f: &Floors, r: &Row<'_>) {
    let eager = r.eager.map_or("-".to_string(), |s| format!("{:.2}", s.med));
    println!(
        "  {:<34} {:>9} {:>9.2} {:>9.2} {:>10} {:>10} {:>9.2} {:>8.2} {:>8.2} {:>9.0}",
        r.name,
        eager,
        r.graph.med,
        r.graph.p90,
        fmt_bytes(r.read),
        fmt_bytes(r.written),
        r.copy.med,
        r.graph.med / f.empty_graph.med,
        r.graph.med / r.copy.med,
        r.written as f64 / (r.graph.med * 1e3),
    );
    println!("  {:<34} {:>9.2} {:>9.2}", "", r.memset.med, r.graph.med / r.memset.med);
}
