//! The CUDA backend itself: every embedded image loads and runs; work on streams the caller
//! owns, from several threads at once, through the shared staging ring; device facts.

use crate::common;

use common::{case_seed, cuda_or_skip, Rng};
use cudarc::driver::sys;
use v4pool::backend::cuda::{self, ModuleSource};
use v4pool::backend::{Backend, Stream};

#[test]
fn every_kernel_image_loads_and_runs() {
    let Some(cuda) = cuda_or_skip("every_kernel_image_loads_and_runs") else {
        return;
    };
    println!(
        "device {} sm_{}{}, module in use: {:?}, memory (free, total) {:?}, {} device(s)",
        cuda.device_name(),
        cuda.compute_capability().0,
        cuda.compute_capability().1,
        cuda.module_source(),
        cuda.memory_info(),
        cuda::device_count().unwrap_or(0)
    );
    assert!(cuda::is_available());
    let probes = cuda.probe_images();
    for (source, result) in &probes {
        println!("IMAGE {source:?}: {result:?}");
    }
    for (source, result) in probes {
        if let Err(e) = result {
            panic!("image {source:?} failed: {e}");
        }
    }
    let forced = std::env::var("V4POOL_CUDA_MODULE").is_ok();
    if !forced && cuda.compute_capability().0 == 9 && v4pool::raw::kernels::sm90_cubin().is_some() {
        assert_eq!(cuda.module_source().ok(), Some(ModuleSource::Cubin));
    }
}

/// A raw stream of the caller's own, on the backend's device (primary context).
fn caller_stream(ordinal: i32) -> u64 {
    let mut dev = 0;
    let mut ctx = std::ptr::null_mut();
    let mut stream = std::ptr::null_mut();
    // SAFETY: the backend exists (so the driver is initialised); plain out-pointers.
    unsafe {
        assert_eq!(sys::cuDeviceGet(&mut dev, ordinal), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuCtxSetCurrent(ctx), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(
            sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
            sys::CUresult::CUDA_SUCCESS
        );
    }
    stream as u64
}

/// Four threads, each on its own caller stream, queue uploads (small and multi-MB, so the
/// staging ring wraps while copies are in flight), fills and copies without waiting, then
/// check the device bytes against a host model of the same operations.
#[test]
fn caller_streams_from_several_threads() {
    let Some(cuda) = cuda_or_skip("caller_streams_from_several_threads") else {
        return;
    };
    let threads: Vec<_> = (0..4u64)
        .map(|k| {
            let cuda = cuda.clone();
            std::thread::spawn(move || {
                let seed = case_seed("streams", k);
                let mut rng = Rng::new(seed);
                let s = Stream(caller_stream(cuda.ordinal() as i32));
                let len = 8u64 << 20;
                let x = cuda.alloc_zeroed(len).expect("alloc");
                let y = cuda.alloc_zeroed(len).expect("alloc");
                let mut model_x = vec![0u8; len as usize];
                let mut model_y = rng.bytes(len as usize);
                // SAFETY: all ranges below stay inside `x` / `y`; the stream orders them.
                unsafe {
                    cuda.upload(y.ptr, &model_y, s).expect("upload");
                    for _ in 0..60 {
                        let n = [16u64, 4096, 3 << 20][rng.below(3) as usize];
                        let a = rng.below((len - n) / 4) * 4;
                        match rng.below(3) {
                            0 => {
                                let bytes = rng.bytes(n as usize);
                                cuda.upload(x.ptr + a, &bytes, s).expect("upload");
                                model_x[a as usize..(a + n) as usize].copy_from_slice(&bytes);
                            }
                            1 => {
                                let v = rng.next_u64() as u32;
                                cuda.fill_u32(y.ptr + a, n / 4, v, s).expect("fill");
                                for c in model_y[a as usize..(a + n) as usize].chunks_exact_mut(4) {
                                    c.copy_from_slice(&v.to_le_bytes());
                                }
                            }
                            _ => {
                                let b = rng.below((len - n) / 4) * 4;
                                cuda.copy(x.ptr + a, y.ptr + b, n, s).expect("copy");
                                let src = model_y[b as usize..(b + n) as usize].to_vec();
                                model_x[a as usize..(a + n) as usize].copy_from_slice(&src);
                            }
                        }
                    }
                    let mut got = vec![0u8; len as usize];
                    cuda.download(&mut got, x.ptr, s).expect("download");
                    assert!(got == model_x, "thread {k}: x differs (seed {seed:#x})");
                    cuda.download(&mut got, y.ptr, s).expect("download");
                    assert!(got == model_y, "thread {k}: y differs (seed {seed:#x})");
                    cuda.free(x);
                    cuda.free(y);
                    sys::cuStreamDestroy_v2(s.0 as sys::CUstream);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
}

#[test]
fn events_time_work_on_a_stream() {
    let Some(cuda) = cuda_or_skip("events_time_work_on_a_stream") else {
        return;
    };
    let s = Stream::DEFAULT;
    let buf = cuda.alloc_zeroed(1 << 30).expect("alloc");
    let (a, b) = (cuda.event().expect("event"), cuda.event().expect("event"));
    a.record(s).expect("record");
    for _ in 0..10 {
        // SAFETY: inside the allocation.
        unsafe { cuda.fill_u32(buf.ptr, (1 << 30) / 4, 7, s).expect("fill") };
    }
    b.record(s).expect("record");
    let ms = a.elapsed_ms(&b).expect("elapsed");
    println!(
        "TIMING 10 x 1 GiB cuMemsetD32Async: {ms:.3} ms ({:.0} GB/s)",
        10.0 * 1.073741824 / (ms as f64 / 1e3)
    );
    assert!(ms > 0.0);
    // SAFETY: idle after elapsed_ms waited for `b`.
    unsafe { cuda.free(buf) };
}

/// The index path never waits for the device: with ~45 ms of memsets queued ahead, two
/// decode steps' uploads (inputs and 16 MB of block tables), poison fills and launches
/// return to the host while the device is still busy with the memsets.
///
/// Alone in a process of its own (`common::alone`): run beside the suite's 61 other tests on an
/// H100 (2026-12-07) the host took 76.2 ms behind 66.3 ms of queued device work; as its own
/// binary it had passed, and alone it queued in 6.9 ms.
#[test]
fn index_path_does_not_wait_for_the_device() {
    if !common::alone(module_path!(), "index_path_does_not_wait_for_the_device") {
        return;
    }
    let Some(cuda) = cuda_or_skip("index_path_does_not_wait_for_the_device") else {
        return;
    };
    let s = Stream::DEFAULT;
    let mut rng = Rng::new(case_seed("no-wait", 0));
    let big = cuda.alloc_zeroed(1 << 30).expect("alloc");
    let small = cuda.alloc_zeroed(32 << 20).expect("alloc");
    let (busy_start, busy_end) = (cuda.event().expect("event"), cuda.event().expect("event"));
    let inputs: Vec<Vec<u8>> = [8 << 10, 16 << 10, 1 << 20, 16 << 20].iter().map(|&n| rng.bytes(n)).collect();
    let step_bytes: usize = inputs.iter().map(Vec::len).sum();
    // Warm the staging ring to its working size first (growing it waits once).
    // SAFETY: all ranges inside `small`.
    unsafe {
        for b in &inputs {
            cuda.upload(small.ptr, b, s).expect("upload");
        }
    }
    cuda.synchronize(s).expect("sync");
    // SAFETY: all ranges inside the allocations; the empty kernel touches nothing.
    let host_ms = unsafe {
        busy_start.record(s).expect("record");
        for _ in 0..200 {
            cuda.fill_u32(big.ptr, (1 << 30) / 4, 3, s).expect("fill");
        }
        busy_end.record(s).expect("record");
        let t0 = std::time::Instant::now();
        for step in 0..2 {
            let mut offset = 0u64;
            for b in &inputs {
                cuda.upload(small.ptr + offset, b, s).expect("upload");
                offset += b.len() as u64;
            }
            cuda.fill_u32(small.ptr + offset, 1024, step, s).expect("poison");
            cuda.launch(&v4pool::raw::index::Launch::Empty, s).expect("launch");
        }
        t0.elapsed().as_secs_f64() * 1e3
    };
    let still_busy = !busy_end.is_complete().expect("query");
    let busy_ms = busy_start.elapsed_ms(&busy_end).expect("elapsed");
    println!(
        "TIMING 2 decode steps of uploads ({:.1} MB each) + fills + launches queued in {host_ms:.3} ms behind {busy_ms:.1} ms of device work; device still busy when they returned: {still_busy}",
        step_bytes as f64 / 1e6
    );
    assert!(still_busy, "the host waited for the device ({host_ms:.3} ms vs {busy_ms:.1} ms)");
    cuda.synchronize(s).expect("sync");
    // SAFETY: idle.
    unsafe {
        cuda.free(big);
        cuda.free(small);
    }
}
