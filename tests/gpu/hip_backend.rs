//! The HIP backend: what can be proven without an AMD GPU (no crash without ROCm; the
//! embedded code objects hold every kernel the backend looks up, for the arch they claim),
//! and device checks that run only where ROCm and a GPU are present and `V4POOL_BACKEND` is
//! unset or `hip` (`scripts/rocm-smoke.sh` runs them with `V4POOL_REQUIRE_GPU=1`).
//!
//! Environment:
//! * `V4POOL_REQUIRE_HIP_OBJECTS=1` (or CI's `V4POOL_REQUIRE_DEVICE_BUILD=1`): fail instead of
//!   skipping when build.rs embedded no HIP code objects.
//! * `V4POOL_BACKEND=hip V4POOL_REQUIRE_GPU=1`: fail instead of skipping when no HIP device.
//! * `V4POOL_HIP_RUNTIME=$(tests/hip_double/build.sh)`: every device test runs over the HIP
//!   runtime double (docs/amd.md), and the `double_*` tests run;
//!   `V4POOL_REQUIRE_HIP_DOUBLE=1` (CI) fails them instead of skipping without it.

use crate::common;

use common::Rng;
use v4pool::backend::hip::{HipBackend, ModuleOrigin};
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, BackendError, BackendKind, BackendResult, DeviceAllocation, Stream};
use v4pool::raw::hip::elf::{self, EF_AMDGPU_MACH_GFX90A, EF_AMDGPU_MACH_GFX942, EM_AMDGPU};
use v4pool::raw::hip::embedded_code_objects;
use v4pool::raw::index::{CopyRun, CopyRunsArgs, FillRun, FillRunsArgs, Launch};

fn env_set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

// ---- without a GPU ------------------------------------------------------------------------

#[test]
fn new_without_rocm_is_unavailable_not_a_panic() {
    if HipBackend::is_available() {
        println!("SKIP new_without_rocm_is_unavailable_not_a_panic: a HIP device is present");
        return;
    }
    match HipBackend::new(0) {
        Err(BackendError::Unavailable { backend: BackendKind::Hip, reason }) => {
            assert!(!reason.is_empty());
            println!("HIP unavailable, as expected here: {reason}");
        }
        other => panic!("expected Unavailable without ROCm, got {other:?}"),
    }
    assert!(matches!(
        v4pool::backend::hip::device_count(),
        Err(BackendError::Unavailable { backend: BackendKind::Hip, .. })
    ));
}

#[test]
fn absent_device_ordinal_is_unavailable() {
    for ordinal in [1usize << 20, usize::MAX] {
        let r = HipBackend::new(ordinal);
        assert!(
            matches!(r, Err(BackendError::Unavailable { backend: BackendKind::Hip, .. })),
            "ordinal {ordinal}: {r:?}"
        );
    }
}

// ---- the embedded code objects --------------------------------------------------------------

/// The embedded objects, or `None` after a visible SKIP (fails when objects are required).
fn objects_or_skip(test: &str) -> Option<Vec<(&'static str, &'static [u8])>> {
    let objects = embedded_code_objects();
    if objects.is_empty() {
        let required = env_set("V4POOL_REQUIRE_HIP_OBJECTS") || env_set("V4POOL_REQUIRE_DEVICE_BUILD");
        assert!(
            !required,
            "HIP code objects are required but build.rs embedded none:\n{}",
            v4pool::raw::kernels::build_log()
        );
        println!("SKIP {test}: build.rs embedded no HIP code objects (no clang 19+ at build time)");
        return None;
    }
    Some(objects)
}

fn expected_mach(arch: &str) -> u32 {
    match arch {
        "gfx942" => EF_AMDGPU_MACH_GFX942,
        "gfx90a" => EF_AMDGPU_MACH_GFX90A,
        other => panic!("unexpected embedded arch {other}"),
    }
}

#[test]
fn embedded_code_objects_hold_every_kernel_symbol() {
    let Some(objects) = objects_or_skip("embedded_code_objects_hold_every_kernel_symbol") else {
        return;
    };
    let arches: Vec<&str> = objects.iter().map(|(a, _)| *a).collect();
    assert_eq!(arches, ["gfx942", "gfx90a"], "build.rs embeds both or neither");
    for (arch, bytes) in objects {
        // --no-gpu-bundle-output gives a plain ELF; an offload bundle is unpacked all the same.
        let entries = elf::code_objects(bytes).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(entries.len(), 1, "{arch}: one device object expected");
        let obj = elf::parse(entries[0].bytes).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(obj.machine, EM_AMDGPU, "{arch}: not an AMDGPU object");
        assert_eq!(obj.amdgpu_mach(), expected_mach(arch), "{arch}: built for another processor");
        for symbol in Launch::SYMBOLS {
            assert!(obj.has_kernel(symbol), "{arch}: no kernel {symbol} (function + {symbol}.kd)");
        }
        println!("{arch}: {} bytes, all {} kernels present", bytes.len(), Launch::SYMBOLS.len());
    }
}

/// The symbol check can fail: rename one kernel descriptor in a copy and it must notice.
#[test]
fn symbol_check_notices_a_missing_kernel() {
    let Some(objects) = objects_or_skip("symbol_check_notices_a_missing_kernel") else {
        return;
    };
    let (arch, bytes) = objects[0];
    let needle = b"v4pool_empty.kd\0";
    let mut copy = bytes.to_vec();
    let mut renamed = 0;
    let mut i = 0;
    while i + needle.len() <= copy.len() {
        if &copy[i..i + needle.len()] == needle {
            copy[i] = b'V';
            renamed += 1;
        }
        i += 1;
    }
    assert!(renamed > 0, "{arch}: string v4pool_empty.kd not found");
    let obj = elf::parse(&copy).unwrap_or_else(|e| panic!("{arch}: {e}"));
    assert!(!obj.has_kernel("v4pool_empty"));
    assert!(obj.has_kernel("v4pool_copy_runs"));
}

// ---- on a HIP device --------------------------------------------------------------------------

/// The HIP backend on device 0, or `None` after a visible SKIP. Fails instead when
/// `V4POOL_BACKEND=hip` and `V4POOL_REQUIRE_GPU=1`.
fn hip_or_skip(test: &str) -> Option<HipBackend> {
    let selected = std::env::var("V4POOL_BACKEND").unwrap_or_default();
    if !selected.is_empty() && selected != "hip" {
        println!("SKIP {test}: V4POOL_BACKEND={selected}");
        return None;
    }
    match HipBackend::new(0) {
        Ok(b) => {
            println!("{test}: {} arch {:?}, module {:?}", b.device_name(), b.arch(), b.module_origin());
            Some(b)
        }
        Err(e) => {
            assert!(
                !(selected == "hip" && env_set("V4POOL_REQUIRE_GPU")),
                "V4POOL_BACKEND=hip V4POOL_REQUIRE_GPU=1 but the HIP backend failed: {e}"
            );
            println!("SKIP {test}: {e}");
            None
        }
    }
}

/// A device allocation freed on drop (after the backend's stream has drained).
struct Buf<'a> {
    backend: &'a dyn Backend,
    alloc: Option<DeviceAllocation>,
}

impl<'a> Buf<'a> {
    fn new(backend: &'a dyn Backend, bytes: u64) -> Self {
        let alloc = backend.alloc_zeroed(bytes).unwrap_or_else(|e| panic!("alloc {bytes}: {e}"));
        assert_eq!(alloc.ptr % 256, 0, "allocation not 256-byte aligned");
        Buf { backend, alloc: Some(alloc) }
    }
    fn ptr(&self) -> u64 {
        self.alloc.as_ref().map_or(0, |a| a.ptr)
    }
    fn bytes(&self) -> u64 {
        self.alloc.as_ref().map_or(0, |a| a.bytes)
    }
    fn upload(&self, offset: u64, data: &[u8], stream: Stream) {
        assert!(offset + data.len() as u64 <= self.bytes());
        // SAFETY: the range lies inside this live allocation (asserted).
        unsafe { self.backend.upload(self.ptr() + offset, data, stream) }.unwrap();
    }
    fn download(&self, stream: Stream) -> Vec<u8> {
        let mut out = vec![0u8; self.bytes() as usize];
        // SAFETY: the whole live allocation.
        unsafe { self.backend.download(&mut out, self.ptr(), stream) }.unwrap();
        out
    }
}

impl Drop for Buf<'_> {
    fn drop(&mut self) {
        if let Some(a) = self.alloc.take() {
            let _ = self.backend.synchronize(Stream::DEFAULT);
            // SAFETY: the stream the tests use has drained; the address is not used again.
            unsafe { self.backend.free(a) };
        }
    }
}

/// Allocation, upload/download, device copy and fill on random data with poisoned
/// destinations; every byte outside the written range must keep its poison.
pub fn check_memory_ops(b: &dyn Backend, seed: u64) {
    let s = Stream::DEFAULT;
    let mut rng = Rng::new(seed);
    const N: usize = 1 << 16;

    // Zeroed even where an earlier allocation left data.
    {
        let dirty = Buf::new(b, N as u64);
        dirty.upload(0, &rng.bytes(N), s);
    }
    let fresh = Buf::new(b, N as u64);
    assert!(fresh.download(s).iter().all(|&x| x == 0), "alloc_zeroed returned non-zero bytes");
    drop(fresh);

    // Round trip at odd offsets and lengths, some small enough to stage, one above 1 MiB.
    let buf = Buf::new(b, (N * 32) as u64);
    let mut expect = rng.bytes(N * 32);
    buf.upload(0, &expect, s);
    for len in [1usize, 3, 4093, 70_001, (1 << 20) + 5] {
        let off = rng.below((N * 32 - len) as u64) as usize;
        let data = rng.bytes(len);
        buf.upload(off as u64, &data, s);
        expect[off..off + len].copy_from_slice(&data);
    }
    assert!(buf.download(s) == expect, "upload/download round trip differs");

    // Many back-to-back uploads without a wait in between: staged buffers must not be reused
    // while a copy from them may still run.
    for i in 0..200u64 {
        let len = 1 + rng.below(9000) as usize;
        let off = rng.below((N * 32 - len) as u64) as usize;
        let data = rng.bytes(len);
        buf.upload(off as u64, &data, s);
        expect[off..off + len].copy_from_slice(&data);
        if i % 50 == 0 {
            b.synchronize(s).unwrap();
        }
    }
    assert!(buf.download(s) == expect, "burst of uploads differs");

    // Device copy into a poisoned buffer.
    let src = Buf::new(b, N as u64);
    let dst = Buf::new(b, N as u64);
    let src_bytes = rng.bytes(N);
    let mut dst_bytes = rng.bytes(N);
    src.upload(0, &src_bytes, s);
    dst.upload(0, &dst_bytes, s);
    let (so, d_o, len) = (7u64, 1001u64, 40_000u64);
    // SAFETY: both ranges lie in live, distinct allocations.
    unsafe { b.copy(dst.ptr() + d_o, src.ptr() + so, len, s) }.unwrap();
    dst_bytes[d_o as usize..(d_o + len) as usize]
        .copy_from_slice(&src_bytes[so as usize..(so + len) as usize]);
    assert!(dst.download(s) == dst_bytes, "device copy differs");

    // fill_u32 over a poisoned middle range.
    let pattern = 0xff80_0000u32 ^ (rng.next_u64() as u32 & 0xffff);
    let (word_off, words) = (13u64, 5000u64);
    // SAFETY: the range lies in `dst`.
    unsafe { b.fill_u32(dst.ptr() + 4 * word_off, words, pattern, s) }.unwrap();
    for w in 0..words as usize {
        let at = 4 * word_off as usize + 4 * w;
        dst_bytes[at..at + 4].copy_from_slice(&pattern.to_le_bytes());
    }
    assert!(dst.download(s) == dst_bytes, "fill_u32 differs");
}

/// `v4pool_fill_runs` and `v4pool_copy_runs` on random runs (every alignment, lengths around
/// the kernels' 16-byte vector split) over poisoned buffers, plus `v4pool_empty`.
pub fn check_run_kernels(b: &dyn Backend, seed: u64) {
    let s = Stream::DEFAULT;
    let mut rng = Rng::new(seed);
    const N: u64 = 1 << 18;
    let target = Buf::new(b, N);
    let source = Buf::new(b, N);
    let mut expect = rng.bytes(N as usize);
    let src_bytes = rng.bytes(N as usize);
    target.upload(0, &expect, s);
    source.upload(0, &src_bytes, s);

    // Disjoint fill runs: 4-byte aligned starts and lengths, in separate 8 KiB lanes.
    let mut fills = Vec::new();
    for lane in 0..12u64 {
        let start = lane * 8192 + 4 * rng.below(64);
        let bytes = 4 * [0, 1, 3, 4, 5, 17, 255, 1000][rng.below(8) as usize];
        let pattern = rng.next_u64() as u32;
        fills.push(FillRun { dst: target.ptr() + start, bytes, pattern, _pad: 0 });
        for w in 0..(bytes / 4) as usize {
            let at = start as usize + 4 * w;
            expect[at..at + 4].copy_from_slice(&pattern.to_le_bytes());
        }
    }
    let desc = Buf::new(b, (fills.len() * std::mem::size_of::<FillRun>()) as u64);
    desc.upload(0, bytemuck::cast_slice(&fills), s);
    let launch =
        Launch::FillRuns(FillRunsArgs::default().with_runs(desc.ptr()).with_num_runs(fills.len() as i32));
    // SAFETY: every run lies in `target`; the descriptor in `desc`.
    unsafe { b.launch(&launch, s) }.unwrap();
    assert!(target.download(s) == expect, "fill_runs differs");

    // Copy runs at any byte alignment into the upper half, sources from `source`.
    let mut copies = Vec::new();
    for lane in 0..12u64 {
        let dst = N / 2 + lane * 8192 + rng.below(100);
        let src = lane * 8192 + rng.below(100);
        let bytes = [0u64, 1, 15, 16, 17, 33, 4095, 7000][rng.below(8) as usize];
        copies.push(CopyRun { src: source.ptr() + src, dst: target.ptr() + dst, bytes });
        let (d, sr, n) = (dst as usize, src as usize, bytes as usize);
        expect[d..d + n].copy_from_slice(&src_bytes[sr..sr + n]);
    }
    let desc = Buf::new(b, (copies.len() * std::mem::size_of::<CopyRun>()) as u64);
    desc.upload(0, bytemuck::cast_slice(&copies), s);
    let launch =
        Launch::CopyRuns(CopyRunsArgs::default().with_runs(desc.ptr()).with_num_runs(copies.len() as i32));
    // SAFETY: every run lies in `source` / `target`, which do not overlap.
    unsafe { b.launch(&launch, s) }.unwrap();
    assert!(target.download(s) == expect, "copy_runs differs");

    // No runs at all: a valid launch that touches nothing.
    let launch = Launch::FillRuns(FillRunsArgs::default().with_runs(desc.ptr()).with_num_runs(0));
    // SAFETY: no run is read.
    unsafe { b.launch(&launch, s) }.unwrap();
    // SAFETY: the empty kernel takes no arguments.
    unsafe { b.launch(&Launch::Empty, s) }.unwrap();
    assert!(target.download(s) == expect, "an empty launch changed memory");
}

/// The checks themselves, on the host backend: proves they pass on a correct backend, so a
/// failure on HIP is the backend's (nothing HIP runs on the machines this project tests on).
#[test]
fn checks_pass_on_the_host_backend() {
    let host = HostBackend::new();
    check_memory_ops(&host, 0x5eed_0001);
    check_run_kernels(&host, 0x5eed_0002);
    assert_eq!(host.live_allocations(), 0, "the checks leak allocations");
}

/// A host backend with one seeded fault, to show each check notices a wrong backend.
#[derive(Debug)]
struct Faulty {
    host: HostBackend,
    fault: Fault,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// `fill_u32` stops one word short.
    ShortFill,
    /// `copy` reads one byte late.
    ShiftedCopy,
    /// Launches of the run kernels do nothing.
    SkippedLaunch,
}

// SAFETY: forwards allocation to the host backend; its faults stay inside the ranges the
// callers pass (see each method).
unsafe impl Backend for Faulty {
    fn kind(&self) -> BackendKind {
        self.host.kind()
    }
    fn device_name(&self) -> String {
        "faulty host".into()
    }
    fn alloc_zeroed(&self, bytes: u64) -> BackendResult<DeviceAllocation> {
        self.host.alloc_zeroed(bytes)
    }
    unsafe fn free(&self, alloc: DeviceAllocation) {
        // SAFETY: forwarded contract.
        unsafe { self.host.free(alloc) }
    }
    unsafe fn upload(&self, dst: u64, src: &[u8], stream: Stream) -> BackendResult<()> {
        // SAFETY: forwarded contract.
        unsafe { self.host.upload(dst, src, stream) }
    }
    unsafe fn download(&self, dst: &mut [u8], src: u64, stream: Stream) -> BackendResult<()> {
        // SAFETY: forwarded contract.
        unsafe { self.host.download(dst, src, stream) }
    }
    unsafe fn copy(&self, dst: u64, src: u64, bytes: u64, stream: Stream) -> BackendResult<()> {
        let shift = u64::from(self.fault == Fault::ShiftedCopy);
        // SAFETY: the tests copy from well inside their source buffers, so one byte later
        // stays in bounds.
        unsafe { self.host.copy(dst, src + shift, bytes, stream) }
    }
    unsafe fn fill_u32(&self, dst: u64, count: u64, value: u32, stream: Stream) -> BackendResult<()> {
        let short = u64::from(self.fault == Fault::ShortFill);
        // SAFETY: a sub-range of the caller's range.
        unsafe { self.host.fill_u32(dst, count - short, value, stream) }
    }
    unsafe fn launch(&self, launch: &Launch, stream: Stream) -> BackendResult<()> {
        if self.fault == Fault::SkippedLaunch {
            return Ok(());
        }
        // SAFETY: forwarded contract.
        unsafe { self.host.launch(launch, stream) }
    }
    fn synchronize(&self, stream: Stream) -> BackendResult<()> {
        self.host.synchronize(stream)
    }
}

#[test]
fn checks_fail_on_a_faulty_backend() {
    for (fault, check) in [
        (Fault::ShortFill, check_memory_ops as fn(&dyn Backend, u64)),
        (Fault::ShiftedCopy, check_memory_ops),
        (Fault::SkippedLaunch, check_run_kernels),
    ] {
        let faulty = Faulty { host: HostBackend::new(), fault };
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&faulty, 0x5eed_0003)));
        assert!(caught.is_err(), "{fault:?} went unnoticed");
    }
}

#[test]
fn hip_memory_ops_on_random_data() {
    if let Some(b) = hip_or_skip("hip_memory_ops_on_random_data") {
        check_memory_ops(&b, 0x5eed_0001);
    }
}

#[test]
fn hip_fill_and_copy_runs_on_random_data() {
    if let Some(b) = hip_or_skip("hip_fill_and_copy_runs_on_random_data") {
        check_run_kernels(&b, 0x5eed_0002);
    }
}

#[test]
fn hip_rejects_invalid_launches_before_the_device() {
    if let Some(b) = hip_or_skip("hip_rejects_invalid_launches_before_the_device") {
        let bad = Launch::FillRuns(FillRunsArgs::default().with_runs(0).with_num_runs(3));
        // SAFETY: rejected before anything runs.
        let r = unsafe { b.launch(&bad, Stream::DEFAULT) };
        assert!(matches!(r, Err(BackendError::InvalidLaunch { .. })), "{r:?}");
    }
}

#[test]
fn hip_module_comes_from_the_expected_place() {
    let Some(b) = hip_or_skip("hip_module_comes_from_the_expected_place") else {
        return;
    };
    let forced = env_set("V4POOL_HIP_FORCE_HIPRTC");
    let processor = b.arch().map(|a| a.split(':').next().unwrap_or(a).to_owned());
    let embedded: Vec<&str> = embedded_code_objects().iter().map(|(a, _)| *a).collect();
    match b.module_origin() {
        ModuleOrigin::Embedded(arch) => {
            assert!(!forced, "V4POOL_HIP_FORCE_HIPRTC=1 but an embedded object was loaded");
            if let Some(p) = &processor {
                assert_eq!(p, arch);
            }
        }
        ModuleOrigin::Hiprtc(arch) => {
            assert_eq!(arch.as_deref(), b.arch());
            let matching = processor.as_deref().is_some_and(|p| embedded.contains(&p));
            assert!(forced || !matching, "device {processor:?} has an embedded object, yet hiprtc ran");
        }
    }
}

#[test]
fn hip_events_time_an_empty_launch() {
    let Some(b) = hip_or_skip("hip_events_time_an_empty_launch") else {
        return;
    };
    let (start, end) = (b.event().unwrap(), b.event().unwrap());
    start.record(Stream::DEFAULT).unwrap();
    for _ in 0..100 {
        // SAFETY: no arguments.
        unsafe { b.launch(&Launch::Empty, Stream::DEFAULT) }.unwrap();
    }
    end.record(Stream::DEFAULT).unwrap();
    let ms = start.elapsed_ms(&end).unwrap();
    assert!(ms.is_finite() && ms >= 0.0, "{ms}");
    println!("100 empty launches: {ms:.3} ms");
}

// ---- hiprtc (needs the library, not a GPU) -------------------------------------------------

/// hiprtc compiles the one kernel source for gfx90a into an object with every kernel. Runs
/// wherever hiprtc loads (ROCm installed, GPU or not). gfx90a rather than gfx942: hiprtc
/// releases before ROCm 5.7 do not know gfx942 (ROCm 5.2's aborts inside comgr).
#[test]
fn hiprtc_compiles_the_kernel_source() {
    let code = match v4pool::raw::hip::hiprtc_compile(Some("gfx90a")) {
        Err(BackendError::Unavailable { reason, .. }) => {
            println!("SKIP hiprtc_compiles_the_kernel_source: {reason}");
            return;
        }
        other => other.unwrap_or_else(|e| panic!("hiprtc failed on the kernel source: {e}")),
    };
    let entries = elf::code_objects(&code).unwrap();
    let obj = elf::parse(entries[0].bytes).unwrap();
    assert_eq!((obj.machine, obj.amdgpu_mach()), (EM_AMDGPU, EF_AMDGPU_MACH_GFX90A));
    for symbol in Launch::SYMBOLS {
        assert!(obj.has_kernel(symbol), "hiprtc output lacks {symbol}");
    }
    println!("hiprtc gfx90a: {} bytes, all {} kernels present", code.len(), Launch::SYMBOLS.len());
}

#[test]
fn hiprtc_compile_errors_carry_the_log() {
    let broken = "extern \"C\" __global__ void v4pool_broken(int a) { this is not C++; }";
    match v4pool::raw::hip::hiprtc_compile_source(broken, Some("gfx90a")) {
        Err(BackendError::Unavailable { reason, .. }) => {
            println!("SKIP hiprtc_compile_errors_carry_the_log: {reason}");
        }
        Err(BackendError::Compile { backend: BackendKind::Hip, log }) => {
            assert!(log.contains("error"), "log without the diagnostic: {log}");
        }
        other => panic!("a broken source must not compile: {other:?}"),
    }
}

// ---- through the HIP runtime double (tests/hip_double/, docs/amd.md) -----------------------
//
// With `V4POOL_HIP_RUNTIME` pointing at the double, every `hip_*` test above runs the backend
// over it. The tests below call the double directly, as a backend with a bug would, and
// assert that the double refuses what a real runtime must: they are what shows its checks
// can fail. `V4POOL_REQUIRE_HIP_DOUBLE=1` (CI) fails instead of skipping without it.

type HipErr = std::ffi::c_int;
type Raw = *mut std::ffi::c_void;
const HIP_ERROR_INVALID_VALUE: HipErr = 1;
const HIP_ERROR_NOT_FOUND: HipErr = 500;

/// The double's entry points the tests call.
struct Double {
    lib: libloading::Library,
}

impl Double {
    /// # Safety
    /// `T` is the C signature of `name` in tests/hip_double/hip_double.cpp.
    unsafe fn sym<T: Copy>(&self, name: &str) -> T {
        // SAFETY: forwarded to the caller; the library outlives every use in a test.
        *unsafe { self.lib.get::<T>(name.as_bytes()) }.unwrap_or_else(|e| panic!("{name}: {e}"))
    }
    fn last_error(&self) -> String {
        // SAFETY: the double's own `const char* v4poolHipDoubleLastError(void)`.
        let f: unsafe extern "C" fn() -> *const std::ffi::c_char =
            unsafe { self.sym("v4poolHipDoubleLastError") };
        // SAFETY: a NUL-terminated thread-local string, valid until the next refusal on this thread.
        unsafe { std::ffi::CStr::from_ptr(f()) }.to_string_lossy().into_owned()
    }
    /// `hipModuleLoadData` on a copy of `image` (whose ELF headers must describe its extent:
    /// the call takes no size).
    fn try_load(&self, image: &[u8]) -> Result<Raw, HipErr> {
        // SAFETY: signatures as hip_runtime_api.h (and the double) declare them.
        let (init, load): (
            unsafe extern "C" fn(std::ffi::c_uint) -> HipErr,
            unsafe extern "C" fn(*mut Raw, *const std::ffi::c_void) -> HipErr,
        ) = unsafe { (self.sym("hipInit"), self.sym("hipModuleLoadData")) };
        let mut aligned = vec![0u64; image.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..image.len()].copy_from_slice(image);
        let mut module: Raw = std::ptr::null_mut();
        // SAFETY: a code object in aligned memory that outlives the call.
        unsafe {
            assert_eq!(init(0), 0);
            match load(&mut module, aligned.as_ptr().cast()) {
                0 => Ok(module),
                rc => Err(rc),
            }
        }
    }
    fn load_module(&self, image: &[u8]) -> Raw {
        self.try_load(image).unwrap_or_else(|rc| panic!("hipModuleLoadData {rc}: {}", self.last_error()))
    }
    fn function(&self, module: Raw, name: &str) -> Result<Raw, (HipErr, String)> {
        // SAFETY: as hip_runtime_api.h declares it.
        let get: unsafe extern "C" fn(*mut Raw, Raw, *const std::ffi::c_char) -> HipErr =
            unsafe { self.sym("hipModuleGetFunction") };
        let c = std::ffi::CString::new(name).unwrap();
        let mut f: Raw = std::ptr::null_mut();
        // SAFETY: a live module, a valid name.
        match unsafe { get(&mut f, module, c.as_ptr()) } {
            0 => Ok(f),
            rc => Err((rc, self.last_error())),
        }
    }
    /// `hipModuleLaunchKernel` on the null stream; `args` go as `kernelParams` (one by-value
    /// struct, as the backend passes them) or, with `extra_size`, as HIP_LAUNCH_PARAM_BUFFER_*
    /// claiming that many bytes.
    ///
    /// # Safety
    /// Every pointer inside `args` is valid for the kernel.
    unsafe fn launch(
        &self,
        f: Raw,
        grid: u32,
        block: [u32; 3],
        shared: u32,
        args: &mut [u8],
        extra_size: Option<usize>,
    ) -> Result<(), (HipErr, String)> {
        #[allow(clippy::type_complexity)]
        let launch: unsafe extern "C" fn(Raw, u32, u32, u32, u32, u32, u32, u32, Raw, *mut Raw, *mut Raw) -> HipErr =
            // SAFETY: as hip_runtime_api.h declares it.
            unsafe { self.sym("hipModuleLaunchKernel") };
        let mut arg: Raw = args.as_mut_ptr().cast();
        let mut size = extra_size.unwrap_or(0);
        let mut extra: [Raw; 5] =
            [1 as Raw, args.as_mut_ptr().cast(), 2 as Raw, (&mut size as *mut usize).cast(), 3 as Raw];
        let (params, extra): (*mut Raw, *mut Raw) = match extra_size {
            Some(_) => (std::ptr::null_mut(), extra.as_mut_ptr()),
            None => (&mut arg, std::ptr::null_mut()),
        };
        let null_stream: Raw = std::ptr::null_mut();
        // SAFETY: the caller's promise on the arguments; the buffers outlive the call (the
        // runtime copies them).
        match unsafe {
            launch(f, grid, 1, 1, block[0], block[1], block[2], shared, null_stream, params, extra)
        } {
            0 => Ok(()),
            rc => Err((rc, self.last_error())),
        }
    }
    fn sync(&self) {
        // SAFETY: as hip_runtime_api.h declares it.
        let sync: unsafe extern "C" fn() -> HipErr = unsafe { self.sym("hipDeviceSynchronize") };
        // SAFETY: no arguments.
        assert_eq!(unsafe { sync() }, 0);
    }
}

/// The double the backend was pointed at, or `None` after a visible SKIP.
fn double_or_skip(test: &str) -> Option<(HipBackend, Double)> {
    let required = env_set("V4POOL_REQUIRE_HIP_DOUBLE");
    let path = std::env::var("V4POOL_HIP_RUNTIME").unwrap_or_default();
    // SAFETY: the library the run names as the HIP runtime (loading it again shares the
    // backend's instance); its initialisers start nothing.
    let lib = (!path.is_empty()).then(|| unsafe { libloading::Library::new(&path) }).and_then(Result::ok);
    let lib = lib.filter(|l| {
        // SAFETY: only looked up, not called.
        unsafe { l.get::<unsafe extern "C" fn()>(b"v4poolHipDoubleLastError") }.is_ok()
    });
    let Some(lib) = lib else {
        assert!(
            !required,
            "V4POOL_REQUIRE_HIP_DOUBLE=1 but V4POOL_HIP_RUNTIME={path:?} is not the runtime double"
        );
        println!("SKIP {test}: V4POOL_HIP_RUNTIME does not name the HIP runtime double (tests/hip_double/build.sh)");
        return None;
    };
    let backend = HipBackend::new(0).unwrap_or_else(|e| panic!("the backend over the double: {e}"));
    Some((backend, Double { lib }))
}

/// The embedded object for the double's device (its arch as the backend read it).
fn object_for(b: &HipBackend) -> &'static [u8] {
    let arch = b.arch().expect("the double reports its arch");
    let processor = arch.split(':').next().unwrap_or(arch);
    embedded_code_objects()
        .into_iter()
        .find(|(a, _)| *a == processor)
        .map(|(_, o)| o)
        .unwrap_or_else(|| panic!("no embedded object for {processor}"))
}

/// The double refuses a wrong kernarg size, a block past the kernel's
/// `.max_flat_workgroup_size`, LDS past 64 KiB and an unknown symbol — each with its own
/// reason — and runs nothing it refused; the same launch with the right facts runs the kernel.
#[test]
fn double_refuses_launches_that_contradict_the_code_object() {
    let Some((b, dbl)) = double_or_skip("double_refuses_launches_that_contradict_the_code_object") else {
        return;
    };
    let module = dbl.load_module(object_for(&b));
    let (rc, why) = dbl.function(module, "v4pool_no_such_kernel").unwrap_err();
    assert_eq!(rc, HIP_ERROR_NOT_FOUND);
    assert!(why.contains("has no kernel v4pool_no_such_kernel"), "{why}");

    // A fill-runs launch over a poisoned buffer: the positive control, then the faults.
    let s = Stream::DEFAULT;
    let mut rng = Rng::new(0x5eed_0d0b);
    let target = Buf::new(&b, 4096);
    let poison = rng.bytes(4096);
    target.upload(0, &poison, s);
    let pattern = rng.next_u64() as u32;
    let runs = [FillRun { dst: target.ptr() + 64, bytes: 512, pattern, _pad: 0 }];
    let desc = Buf::new(&b, std::mem::size_of_val(&runs) as u64);
    desc.upload(0, bytemuck::cast_slice(&runs), s);
    b.synchronize(s).unwrap();
    let args = FillRunsArgs::default().with_runs(desc.ptr()).with_num_runs(1);
    let mut bytes = bytemuck::bytes_of(&args).to_vec();
    let n = bytes.len();
    let fill = dbl.function(module, "v4pool_fill_runs").unwrap();
    let block = v4pool::raw::index::shape::launch_shape(&Launch::FillRuns(args)).block;

    // Wrong kernarg sizes (through `extra`, where the caller states the size).
    for wrong in [n - 8, n + 8] {
        // SAFETY: refused before anything runs (asserted).
        let (rc, why) = unsafe { dbl.launch(fill, 1, block, 0, &mut bytes, Some(wrong)) }.unwrap_err();
        assert_eq!(rc, HIP_ERROR_INVALID_VALUE);
        assert!(
            why.contains(&format!("kernarg bytes {wrong} != the kernel's .kernarg_segment_size {n}")),
            "{why}"
        );
    }
    // A block one past the kernel's bound, through kernelParams as the backend passes them.
    // SAFETY: refused before anything runs.
    let (rc, why) = unsafe { dbl.launch(fill, 1, [4096, 1, 1], 0, &mut bytes, None) }.unwrap_err();
    assert_eq!(rc, HIP_ERROR_INVALID_VALUE);
    let bound: u32 = why
        .split(".max_flat_workgroup_size ")
        .nth(1)
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or_else(|| panic!("{why}"));
    assert!(bound >= block[0], "the backend's own block {block:?} is past the bound {bound}");
    // SAFETY: refused before anything runs.
    let (rc, why) = unsafe { dbl.launch(fill, 1, [bound + 1, 1, 1], 0, &mut bytes, None) }.unwrap_err();
    assert_eq!(rc, HIP_ERROR_INVALID_VALUE);
    assert!(why.contains(&format!(".max_flat_workgroup_size {bound}")), "{why}");
    // Dynamic LDS past 64 KiB.
    // SAFETY: refused before anything runs.
    let (rc, why) = unsafe { dbl.launch(fill, 1, block, 64 * 1024 + 1, &mut bytes, None) }.unwrap_err();
    assert_eq!(rc, HIP_ERROR_INVALID_VALUE);
    assert!(why.contains("exceeds 64 KiB"), "{why}");
    dbl.sync();
    assert!(target.download(s) == poison, "a refused launch wrote memory");

    // The right facts, both ways of passing arguments: the kernel runs.
    let mut expect = poison.clone();
    for w in 0..128 {
        expect[64 + 4 * w..68 + 4 * w].copy_from_slice(&pattern.to_le_bytes());
    }
    for extra in [None, Some(n)] {
        // SAFETY: `desc` and `target` are live; the run lies in `target`.
        unsafe { dbl.launch(fill, 1, [bound, 1, 1], 0, &mut bytes, extra) }.unwrap();
        dbl.sync();
        assert!(target.download(s) == expect, "fill_runs through the double differs");
    }
}

/// The double's stream delays are what make a missing wait visible: copies queued on one
/// stream and read back on another without a wait come back wrong; with the event wait HIP
/// requires they come back right.
#[test]
fn double_delays_expose_a_missing_wait() {
    let Some((b, dbl)) = double_or_skip("double_delays_expose_a_missing_wait") else {
        return;
    };
    if std::env::var("V4POOL_HIP_DOUBLE_MAX_DELAY_US").is_ok_and(|v| v.trim() == "0") {
        println!("SKIP double_delays_expose_a_missing_wait: V4POOL_HIP_DOUBLE_MAX_DELAY_US=0");
        return;
    }
    // SAFETY: as hip_runtime_api.h declares them.
    let (create, destroy): (
        unsafe extern "C" fn(*mut Raw, u32) -> HipErr,
        unsafe extern "C" fn(Raw) -> HipErr,
    ) = unsafe { (dbl.sym("hipStreamCreateWithFlags"), dbl.sym("hipStreamDestroy")) };
    let (mut x, mut y): (Raw, Raw) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid out-pointers; non-blocking streams.
    unsafe { assert_eq!((create(&mut x, 1), create(&mut y, 1)), (0, 0)) };
    let (sx, sy) = (Stream(x as u64), Stream(y as u64));
    let mut rng = Rng::new(0x5eed_de1a);
    const CHUNKS: u64 = 64;
    const CHUNK: u64 = 256;
    let src = Buf::new(&b, CHUNKS * CHUNK);
    let dst = Buf::new(&b, CHUNKS * CHUNK);
    let data = rng.bytes((CHUNKS * CHUNK) as usize);
    src.upload(0, &data, Stream::DEFAULT);
    b.synchronize(Stream::DEFAULT).unwrap();
    let mut missed = 0;
    for round in 0..5 {
        let poison = rng.bytes((CHUNKS * CHUNK) as usize);
        dst.upload(0, &poison, sy);
        b.synchronize(sy).unwrap();
        for c in 0..CHUNKS {
            // SAFETY: both ranges lie in live, distinct allocations.
            unsafe { b.copy(dst.ptr() + c * CHUNK, src.ptr() + c * CHUNK, CHUNK, sx) }.unwrap();
        }
        // The bug under test: read on stream y what stream x is still writing.
        if dst.download(sy) != data {
            missed += 1;
        }
        // The wait HIP requires: an event recorded after the copies, waited for.
        let done = b.event().unwrap();
        done.record(sx).unwrap();
        done.synchronize().unwrap();
        assert!(dst.download(sy) == data, "round {round}: the copies after their event differ");
    }
    println!("reads without a wait that saw unfinished copies: {missed} of 5");
    assert!(missed > 0, "the double's delays never exposed the missing wait");
    // SAFETY: our streams, drained above.
    unsafe { assert_eq!((destroy(x), destroy(y)), (0, 0)) };
}

/// The double's code-object reader on damaged AMDGPU metadata (random bytes of the msgpack
/// note changed): a load succeeds or is refused as an invalid image, never a crash or hang.
#[test]
fn double_reads_damaged_metadata_without_crashing() {
    let Some((b, dbl)) = double_or_skip("double_reads_damaged_metadata_without_crashing") else {
        return;
    };
    let image = object_for(&b);
    let needle = b"amdhsa.kernels";
    let at = image.windows(needle.len()).position(|w| w == needle).expect("no AMDGPU metadata note");
    let mut rng = Rng::new(0x5eed_3e7a);
    let (mut loaded, mut refused) = (0, 0);
    for _ in 0..300 {
        let mut copy = image.to_vec();
        for _ in 0..1 + rng.below(4) {
            // The note's header (sizes, type) just before the map, and the map itself.
            let i = at - 24 + rng.below(2048) as usize;
            copy[i] = rng.next_u64() as u8;
        }
        match dbl.try_load(&copy) {
            Ok(_) => loaded += 1,
            Err(200) => refused += 1, // hipErrorInvalidImage
            Err(rc) => panic!("hipError {rc}: {}", dbl.last_error()),
        }
    }
    println!("damaged metadata: {loaded} loaded, {refused} refused");
    assert!(refused > 0, "no damage was noticed");
}
