//! Transfer bench (CUDA): request handoff GB/s per request size (8K, 128K, 1M tokens of
//! V4-Flash) over NCCL between GPU 0 and GPU 1 against `cuMemcpyPeerAsync` of the same bytes,
//! and through the local engine on one GPU against `cuMemcpyDtoDAsync`; spans per request;
//! host-tier restore GB/s against a pinned host-to-device copy of the same bytes.
//!
//! Method: wall-clock time after warm-up, median of the repetitions. For a handoff the ratio
//! uses the span transfer alone (post → completion, `Rebound::transfer_time`); the whole
//! handoff (handshake, reservation, transfer) is printed beside it. The receiver's blocks
//! are freed between repetitions, untimed. The copies it is compared against are
//! timed the same way (queue, synchronise). Target: ≥ 80 % of the copy at 128K tokens and
//! above. Without `--bench` (`cargo test --benches`) it returns at once; without a GPU it
//! prints a notice (fails under V4POOL_REQUIRE_GPU=1). Sets NCCL_NVLS_ENABLE=0.

#[allow(unused_imports)] // the shared bench helpers re-export an Rng this bench does not need
mod common;

use common::{bench_requested, fmt_bytes, median, met};
use cudarc::driver::sys;
use std::error::Error;
use std::sync::Arc;
use std::time::Instant;
use v4pool::backend::cuda::{self, CudaBackend};
use v4pool::backend::{Backend, Stream};
use v4pool::checkpoint::layout_id;
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec};
use v4pool::sizing::{IndexerDtype, KvDtype, PoolLayout};
use v4pool::transfer::nccl::{self, NcclEngine};
use v4pool::transfer::{handoff, Endpoint, HostTier, LocalEngine, RequestKv, TransferEngine};

type Res<T> = Result<T, Box<dyn Error>>;
const TOKENS: [i64; 3] = [8 << 10, 128 << 10, 1 << 20];
const REPS: usize = 7;

fn pool(b: Arc<dyn Backend>, blocks: i64) -> Res<(Pool, String)> {
    let model = ModelShape::v4_flash(1)?;
    let layout = PoolLayout::new(&model, KvDtype::Fp8, IndexerDtype::Fp8)?;
    let g = &layout.geometry;
    let rows = blocks * g.envelope_rows + 3 * (g.slot_rows + g.slot_align_rows.max(1));
    let spec = PoolSpec::from_layout(&layout, layout.carve(blocks, 2, rows)?)?;
    Ok((Pool::new(b, spec, Stream::DEFAULT)?, layout_id(&layout)?))
}

fn request(p: &Pool, tokens: i64) -> Res<RequestKv> {
    let slot = p.alloc_slot()?;
    let blocks =
        (0..(tokens + 255) / 256).map(|_| p.alloc_block().map(|g| g.handle)).collect::<Result<_, _>>()?;
    Ok(RequestKv { blocks, slot: slot.handle, context_len: tokens as u64 })
}

fn cu(r: sys::CUresult) -> Res<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{r:?}").into())
    }
}

fn ctx(ordinal: i32) -> Res<sys::CUcontext> {
    let (mut dev, mut c) = (0, std::ptr::null_mut());
    // SAFETY: the driver is initialised (a backend exists); out-pointers.
    unsafe {
        cu(sys::cuDeviceGet(&mut dev, ordinal))?;
        cu(sys::cuDevicePrimaryCtxRetain(&mut c, dev))?;
        cu(sys::cuCtxSetCurrent(c))?;
    }
    Ok(c)
}

/// Median seconds of `f` over REPS after one warm-up.
fn time(mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    f()?;
    let mut t = Vec::new();
    for _ in 0..REPS {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    Ok(median(&mut t))
}

/// Handoff `tokens` from `s` to `r` REPS times; returns the median seconds of the span
/// transfer alone (post → complete) and of the whole handoff, bytes and spans.
fn time_handoff(
    engine: &mut dyn TransferEngine,
    s: &Pool,
    r: &Pool,
    tokens: i64,
) -> Res<(f64, f64, u64, usize)> {
    let req = request(s, tokens)?;
    let (mut bytes, mut spans) = (0, 0);
    let mut moves = Vec::new();
    let secs = time(|| {
        let out = handoff(engine, &Endpoint::new(s), &Endpoint::new(r), &req)?;
        bytes = out.bytes;
        spans = out.spans;
        moves.push(out.transfer_time.as_secs_f64());
        for b in out.blocks {
            r.free_block(b)?;
        }
        r.free_slot(out.slot.handle)?;
        Ok(())
    })?;
    moves.remove(0); // the warm-up
    Ok((median(&mut moves), secs, bytes, spans))
}

fn gbs(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn main() -> Res<()> {
    if !bench_requested() {
        return Ok(());
    }
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    let gpu0 = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            if std::env::var("V4POOL_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                return Err(format!("V4POOL_REQUIRE_GPU=1 but no CUDA device: {e}").into());
            }
            println!("NOTICE: no CUDA device ({e}); transfer bench skipped");
            return Ok(());
        }
    };
    let devices = cuda::device_count()?;
    println!("# transfer bench: {} device(s), NCCL {:?}", devices, nccl::version().ok());
    let two = devices >= 2 && nccl::is_available();
    let gpu1 = if two { Some(CudaBackend::new(1)?) } else { None };
    let b0: Arc<dyn Backend> = Arc::new(gpu0.clone());
    for tokens in TOKENS {
        let blocks = (tokens + 255) / 256 + 4;
        // One GPU, local engine, against a device-to-device copy of the same bytes.
        {
            let (s, _) = pool(b0.clone(), blocks)?;
            let (r, _) = pool(b0.clone(), blocks)?;
            let mut e = LocalEngine::new(b0.clone(), b0.clone(), Stream::DEFAULT);
            let (secs, whole, bytes, spans) = time_handoff(&mut e, &s, &r, tokens)?;
            let (a, c) = (gpu0.alloc_zeroed(bytes)?, gpu0.alloc_zeroed(bytes)?);
            let copy = time(|| {
                // SAFETY: two fresh allocations of `bytes`.
                unsafe { gpu0.copy(c.ptr, a.ptr, bytes, Stream::DEFAULT)? };
                Ok(gpu0.synchronize(Stream::DEFAULT)?)
            })?;
            // SAFETY: synchronised above.
            unsafe {
                gpu0.free(a);
                gpu0.free(c);
            }
            let ratio = copy / secs;
            println!(
                "local 1-GPU  {tokens:>8} tokens: {} in {spans} spans, transfer {:.1} GB/s (whole handoff {:.1}) vs cuMemcpyDtoDAsync {:.1} GB/s = {:.0} % {}",
                fmt_bytes(bytes),
                gbs(bytes, secs),
                gbs(bytes, whole),
                gbs(bytes, copy),
                100.0 * ratio,
                met(tokens < 128 << 10 || ratio >= 0.8)
            );
        }
        // Two GPUs over NCCL, against cuMemcpyPeerAsync of the same bytes.
        if let Some(gpu1) = &gpu1 {
            let b1: Arc<dyn Backend> = Arc::new(gpu1.clone());
            let (s, _) = pool(b0.clone(), blocks)?;
            let (r, _) = pool(b1.clone(), blocks)?;
            let mut e = NcclEngine::new(&gpu0, gpu1)?;
            let (secs, whole, bytes, spans) = time_handoff(&mut e, &s, &r, tokens)?;
            let (a, c) = (gpu0.alloc_zeroed(bytes)?, gpu1.alloc_zeroed(bytes)?);
            let (c0, c1) = (ctx(0)?, ctx(1)?);
            // Peer access both ways (already enabled by NCCL is fine).
            // SAFETY: both contexts are live primary contexts.
            unsafe {
                sys::cuCtxSetCurrent(c0);
                sys::cuCtxEnablePeerAccess(c1, 0);
                sys::cuCtxSetCurrent(c1);
                sys::cuCtxEnablePeerAccess(c0, 0);
                sys::cuCtxSetCurrent(c0);
            }
            let stream = gpu0.raw_stream(Stream::DEFAULT) as sys::CUstream;
            let peer = time(|| {
                // SAFETY: fresh allocations of `bytes` on each device; our own stream.
                unsafe {
                    cu(sys::cuCtxSetCurrent(c0))?;
                    cu(sys::cuMemcpyPeerAsync(c.ptr, c1, a.ptr, c0, bytes as usize, stream))?;
                    cu(sys::cuStreamSynchronize(stream))
                }
            })?;
            // SAFETY: synchronised above.
            unsafe {
                gpu0.free(a);
                gpu1.free(c);
            }
            let ratio = peer / secs;
            println!(
                "nccl 2-GPU   {tokens:>8} tokens: {} in {spans} spans, transfer {:.1} GB/s (whole handoff {:.1}) vs cuMemcpyPeerAsync {:.1} GB/s = {:.0} % {}",
                fmt_bytes(bytes),
                gbs(bytes, secs),
                gbs(bytes, whole),
                gbs(bytes, peer),
                100.0 * ratio,
                met(tokens < 128 << 10 || ratio >= 0.8)
            );
        } else if tokens == TOKENS[0] {
            println!(
                "NOTICE: two-GPU NCCL rows skipped ({devices} device(s), NCCL available: {})",
                nccl::is_available()
            );
        }
    }
    // Host tier: restore of 128K and 1M tokens' blocks against a pinned H2D copy.
    for tokens in [128i64 << 10, 1 << 20] {
        let n = ((tokens + 255) / 256) as usize;
        let (p, _) = pool(b0.clone(), n as i64 + 4)?;
        let blocks: Vec<_> = (0..n).map(|_| p.alloc_block().map(|g| g.handle)).collect::<Result<_, _>>()?;
        let mut tier: HostTier<u64> = HostTier::new(&p, 0)?;
        let unit = tier.unit_bytes();
        tier = HostTier::new(&p, unit * n as u64)?;
        let bytes = unit * n as u64;
        let mut t = Vec::new();
        for rep in 0..=REPS {
            tier.spill(&p, 7, &blocks)?;
            let s = Instant::now();
            tier.restore_into(&p, &7, &blocks)?;
            if rep > 0 {
                t.push(s.elapsed().as_secs_f64());
            }
        }
        let restore = median(&mut t);
        let dev = gpu0.alloc_zeroed(bytes)?;
        let c0 = ctx(0)?;
        let mut host = std::ptr::null_mut();
        // SAFETY: a context is current; out-pointer.
        unsafe { cu(sys::cuMemHostAlloc(&mut host, bytes as usize, sys::CU_MEMHOSTALLOC_PORTABLE))? };
        let stream = gpu0.raw_stream(Stream::DEFAULT) as sys::CUstream;
        let h2d = time(|| {
            // SAFETY: pinned buffer and device allocation of `bytes` each; our own stream.
            unsafe {
                cu(sys::cuCtxSetCurrent(c0))?;
                cu(sys::cuMemcpyHtoDAsync_v2(dev.ptr, host, bytes as usize, stream))?;
                cu(sys::cuStreamSynchronize(stream))
            }
        })?;
        // SAFETY: synchronised; nothing uses them after.
        unsafe {
            sys::cuMemFreeHost(host);
            gpu0.free(dev);
        }
        let ratio = h2d / restore;
        println!(
            "host tier    {tokens:>8} tokens: restore {} ({} units) {:.1} GB/s vs pinned H2D {:.1} GB/s = {:.0} % {}",
            fmt_bytes(bytes),
            n,
            gbs(bytes, restore),
            gbs(bytes, h2d),
            100.0 * ratio,
            met(ratio >= 0.8)
        );
    }
    Ok(())
}
