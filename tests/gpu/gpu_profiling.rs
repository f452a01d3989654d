//! Profiler ranges around device work. Run under Nsight Compute to see the NVTX injection
//! path work: `ncu --nvtx --nvtx-include "v4pool.range_test/" .gpu/tests/gpu gpu_profiling::`
//! profiles the kernel only if the range reached the tool. Without a tool (or without the
//! `profiling` feature) the ranges are no-ops and the test only checks they do no harm.

use crate::common;

use common::cuda_or_skip;
use v4pool::backend::{Backend, Stream};
use v4pool::raw::index::Launch;

#[test]
fn ranges_wrap_device_work() {
    let Some(cuda) = cuda_or_skip("ranges_wrap_device_work") else {
        return;
    };
    let sink = v4pool::raw::profiling::sink();
    println!(
        "PROFILING feature={} sink={sink} NVTX_INJECTION64_PATH={:?}",
        cfg!(feature = "profiling"),
        std::env::var("NVTX_INJECTION64_PATH").ok()
    );
    {
        let _outer = v4pool::raw::profiling::range("v4pool.range_test");
        let _inner = v4pool::raw::profiling::range("v4pool.empty");
        // SAFETY: the empty kernel touches nothing.
        unsafe { cuda.launch(&Launch::Empty, Stream::DEFAULT).expect("launch") };
        cuda.synchronize(Stream::DEFAULT).expect("sync");
    }
    // Outside every range: a tool filtering on v4pool.range_test skips this one.
    // SAFETY: as above.
    unsafe { cuda.launch(&Launch::Empty, Stream::DEFAULT).expect("launch") };
    cuda.synchronize(Stream::DEFAULT).expect("sync");
    if cfg!(feature = "profiling") && std::env::var_os("NVTX_INJECTION64_PATH").is_some() {
        assert_eq!(sink, "nvtx-injection", "a tool is attached but the injection did not load");
    }
}
