//! Shared by the GPU tests: device acquisition (skip or fail), a seeded PRNG, V4 shapes, and
//! a two-backend harness that runs one set of launches on CUDA and on the host reference
//! and compares every buffer, inputs included, byte for byte.
#![allow(dead_code)]

pub mod batches;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::OnceLock;
use v4pool::backend::cuda::CudaBackend;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, BackendResult, Stream};
use v4pool::raw::index::Launch;
use v4pool::{GeometrySpec, UnifiedPoolGeometry};

/// The host-emulation library build.rs compiled from `kernels/` (the kernel source as plain
/// C++), loaded; or `None` after printing SKIP (a failure with V4POOL_REQUIRE_DEVICE_BUILD=1).
pub fn emulation_library() -> Option<libloading::Library> {
    let Some(path) = v4pool::raw::kernels::host_emulation_library() else {
        assert!(
            !std::env::var("V4POOL_REQUIRE_DEVICE_BUILD").is_ok_and(|v| v == "1"),
            "V4POOL_REQUIRE_DEVICE_BUILD=1 but build.rs built no host-emulation library"
        );
        println!("SKIP: no host-emulation library");
        return None;
    };
    // SAFETY: the library is ours (build.rs built it from kernels/); loading runs no code of
    // its own beyond the C++ runtime's initialisers.
    Some(unsafe { libloading::Library::new(path) }.expect("load"))
}

/// An emulation library's per-kernel entry: `(argument bytes, grid, threads) -> 0`.
pub type EmuLaunch = unsafe extern "C" fn(*const std::ffi::c_void, *const u32, u32) -> i32;

/// The emulation library's entry of one kernel (`v4pool_emu_launch_<kernel>`) and the library
/// that holds it (keep it alive while the entry is used); `None` as [`emulation_library`].
pub fn emulation_entry(kernel: &str) -> Option<(libloading::Library, EmuLaunch)> {
    let lib = emulation_library()?;
    let symbol = format!("v4pool_emu_launch_{kernel}\0");
    // SAFETY: every `v4pool_emu_launch_*` entry of kernels/v4pool_emulation.cpp has this
    // signature.
    let emu = unsafe { *lib.get::<EmuLaunch>(symbol.as_bytes()).expect("symbol") };
    Some((lib, emu))
}

/// Run `launch` through the host reference (`reference`) or the kernel source's emulation
/// entry `emu`, over the launch's own grid.
///
/// # Safety
/// Every pointer in the launch's arguments is a live buffer of the sizes they name; `emu` is
/// the entry of the launch's kernel.
pub unsafe fn run_reference_or_emulated(launch: &Launch, emu: EmuLaunch, reference: bool) {
    if reference {
        // SAFETY: the caller's promise.
        unsafe { v4pool::raw::index::host::run_launch(launch) }.expect("reference");
    } else {
        let shape = v4pool::raw::index::shape::launch_shape(launch);
        let bytes = v4pool::raw::launch::kernel_argument(launch);
        // SAFETY: as above; the argument bytes are the struct the kernel takes.
        assert_eq!(unsafe { emu(bytes.as_ptr().cast(), shape.grid.as_ptr(), shape.block[0]) }, 0);
    }
}

/// `run(reference)` through the host reference (`true`) and through the kernel source's
/// emulation (`false`): the two results must be equal (`what` names the case in a failure);
/// returns the reference's.
pub fn reference_equals_emulated<T: PartialEq>(
    mut run: impl FnMut(bool) -> T,
    what: std::fmt::Arguments,
) -> T {
    let host = run(true);
    let dev = run(false);
    assert!(host == dev, "{what}: kernel and host reference differ");
    host
}

/// The CUDA backend on device 0, or `None` after printing why the test is skipped. With
/// `V4POOL_REQUIRE_GPU=1` a missing device fails the test instead.
pub fn cuda_or_skip(test: &str) -> Option<CudaBackend> {
    if std::env::var("V4POOL_BACKEND").is_ok_and(|v| v.eq_ignore_ascii_case("hip")) {
        println!("SKIP: {test} is CUDA-only (V4POOL_BACKEND=hip)");
        return None;
    }
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            if std::env::var("V4POOL_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("{test}: V4POOL_REQUIRE_GPU=1 but no CUDA device: {e}");
            }
            println!("SKIP: no CUDA device ({e}) in {test}");
            None
        }
    }
}

/// The backend the kernel tests check against the host reference: CUDA device 0, or — with
/// `V4POOL_TEST_DEVICE=host`, a dry run of the generators and harness on a machine without a
/// GPU — a second host backend. `None` (after printing SKIP) when there is no device.
pub fn device_or_skip(test: &str) -> Option<Box<dyn Backend>> {
    if std::env::var("V4POOL_TEST_DEVICE").is_ok_and(|v| v == "host") {
        println!("DRY RUN: {test} compares the host backend with itself");
        return Some(Box::new(host()));
    }
    // `V4POOL_BACKEND=hip` points the same checks at the HIP backend (scripts/rocm-smoke.sh).
    if std::env::var("V4POOL_BACKEND").is_ok_and(|v| v.eq_ignore_ascii_case("hip")) {
        return match v4pool::backend::hip::HipBackend::new(0) {
            Ok(b) => Some(Box::new(b)),
            Err(e) => {
                if std::env::var("V4POOL_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                    panic!("{test}: V4POOL_REQUIRE_GPU=1 but no HIP device: {e}");
                }
                println!("SKIP: no HIP device ({e}) in {test}");
                None
            }
        };
    }
    cuda_or_skip(test).map(|b| Box::new(b) as Box<dyn Backend>)
}

/// True when the device tests run over the HIP runtime double (tests/hip_double/,
/// docs/amd.md): `V4POOL_BACKEND=hip` and `V4POOL_HIP_RUNTIME` names a library exporting the
/// double's own `v4poolHipDoubleLastError`. The double runs every kernel through its host
/// emulation, one thread after another on one CPU core, in a CI step with a time budget, so
/// the device tests run the same cases at smaller sizes there ([`sized`]); CUDA and a real
/// ROCm runtime keep the full ones.
pub fn hip_double() -> bool {
    static DOUBLE: OnceLock<bool> = OnceLock::new();
    *DOUBLE.get_or_init(|| {
        if !std::env::var("V4POOL_BACKEND").is_ok_and(|v| v.eq_ignore_ascii_case("hip")) {
            return false;
        }
        let Some(path) = std::env::var_os("V4POOL_HIP_RUNTIME").filter(|p| !p.is_empty()) else {
            return false;
        };
        // SAFETY: the library the run names as the HIP runtime (the backend loads the same
        // one; its initialisers start nothing); the symbol is only looked up, never called.
        let Ok(lib) = (unsafe { libloading::Library::new(&path) }) else {
            return false;
        };
        // SAFETY: as above.
        let double = unsafe { lib.get::<unsafe extern "C" fn()>(b"v4poolHipDoubleLastError") }.is_ok();
        // Kept loaded: the backend holds the same library for the rest of the process.
        std::mem::forget(lib);
        if double {
            println!("HIP runtime double: the device cases run at their reduced sizes");
        }
        double
    })
}

/// `full` on a real device; `double` under the HIP runtime double ([`hip_double`]).
pub fn sized<T>(full: T, double: T) -> T {
    if hip_double() {
        double
    } else {
        full
    }
}

/// For a test that runs no device code: true (after printing SKIP) under the HIP runtime
/// double, whose CI step would only repeat what the plain `cargo test` run already checked.
pub fn host_only_under_double(test: &str) -> bool {
    let skip = hip_double();
    if skip {
        println!("SKIP: {test} runs no device code (the plain run covers it)");
    }
    skip
}

pub fn host() -> HostBackend {
    HostBackend::new()
}

// ---- one test alone in a child process ----------------------------------------------------

/// The harness's name of the test `name` declared in `module` (the caller's `module_path!()`):
/// the module path without the suite's crate name in front (`shared_tier::child_shared_writer`
/// in the `tiers` binary). A suite binary holds many test files, so a child names its test in
/// full.
pub fn test_path(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, m)) => format!("{m}::{name}"),
        None => name.to_string(),
    }
}

/// This test binary run again for the one test `name` of `module` (the caller's
/// `module_path!()`), ignored or not, alone in its process, output not captured. For what
/// cannot share the suite's process: a resident-set reading, an environment a C library reads
/// (set on the child's `Command`, never with `set_var` in a process whose other tests run),
/// several processes of one scenario.
pub fn child_test(module: &str, name: &str) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", &test_path(module, name), "--include-ignored", "--nocapture", "--test-threads", "1"]);
    c
}

/// Run `c` (a [`child_test`]) to its end: its output, after checking it succeeded and ran its
/// one test (`what` names it in a failure).
pub fn run_child_test(mut c: std::process::Command, what: &str) -> String {
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what}: child failed:\n{text}");
    assert!(text.contains("1 passed"), "{what}: the child test did not run:\n{text}");
    text
}

/// For a test that times device work against the host or against its own stream: true when
/// this process runs it alone (run the body); otherwise it runs test `name` of `module` again
/// in a process of its own ([`child_test`], its output passed on) and answers false. The
/// suite's other tests share this process's CUDA context: their allocations, module loads and
/// work on the legacy default stream would be timed with it (seen on an H100, 2026-12-07: a
/// host that waited 76 ms behind 66 ms of queued work, a graph replay timed at 17 ms a step).
pub fn alone(module: &str, name: &str) -> bool {
    if std::env::var_os("V4POOL_TEST_ALONE").is_some() {
        return true;
    }
    let mut child = child_test(module, name);
    child.env("V4POOL_TEST_ALONE", "1");
    print_child_output(&run_child_test(child, name));
    false
}

/// Print what a child test printed (its SKIP lines too), without its harness's lines: a
/// log's `test result` lines then count this binary's runs only.
pub fn print_child_output(text: &str) {
    let status = |l: &str| ["ok", "FAILED", "ignored"].contains(&l) || l.starts_with("ignored, ");
    for l in text.lines() {
        // The test's own first line follows the harness's `test NAME ... ` (output not captured).
        let l = match l.split_once(" ... ") {
            Some((name, rest)) if name.starts_with("test ") => rest,
            _ => l,
        };
        if !(l.is_empty() || status(l) || l.starts_with("running ") || l.starts_with("test result: ")) {
            println!("{l}");
        }
    }
}

/// Held by each test that builds 1M-token host pools (4 to 5 GB each, two at a time in some):
/// one such test at a time in a suite binary, whichever file it comes from, so two of them
/// side by side never need twice the memory.
pub fn large_pools() -> std::sync::MutexGuard<'static, ()> {
    static LARGE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LARGE.lock().unwrap_or_else(|e| e.into_inner())
}

// ---- randomness -------------------------------------------------------------------------

/// The run's base seed: `V4POOL_SEED` when set (to replay a failure), else fresh per run.
pub fn base_seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        if let Some(s) = std::env::var("V4POOL_SEED").ok().and_then(|s| s.parse().ok()) {
            return s;
        }
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9e37_79b9_7f4a_7c15);
        t ^ u64::from(std::process::id()).rotate_left(32)
    })
}

/// The seed of one case: the run's seed mixed with the case's name and number.
pub fn case_seed(name: &str, i: u64) -> u64 {
    let mut h = DefaultHasher::new();
    (name, i).hash(&mut h);
    base_seed() ^ h.finish()
}

/// The tests' one random-number generator: the library's SplitMix64 ([`v4pool::sim::Rng`],
/// the simulator's and the benches'), with the draws tests need on top (`below`, `fill` and
/// `bytes` are the library's own). Reproducible from
/// its seed; any seed (zero too) is a good one.
#[derive(Clone, Debug)]
pub struct Rng(v4pool::sim::Rng);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(v4pool::sim::Rng::new(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `[0, n)`; `n > 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }
    /// Uniform in `[lo, hi]`.
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + self.below((hi - lo + 1) as u64) as i64
    }
    /// True with probability `p` (0..=1).
    pub fn chance(&mut self, p: f64) -> bool {
        self.0.f64() < p
    }
    /// One of `items` (not empty), uniformly.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        self.0.fill(buf)
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        self.0.bytes(n)
    }
    /// `k` distinct values of `[0, n)`, in random order.
    pub fn distinct(&mut self, k: usize, n: u64) -> Vec<i64> {
        assert!(k as u64 <= n);
        let mut seen = std::collections::HashSet::with_capacity(k);
        let mut out = Vec::with_capacity(k);
        while out.len() < k {
            let v = self.below(n) as i64;
            if seen.insert(v) {
                out.push(v);
            }
        }
        out
    }
}

// ---- V4 shapes --------------------------------------------------------------------------

pub const BLOCK_SIZE: i64 = 256;
pub const WIN: i32 = 128;

/// DeepSeek-V4-Flash: `[0,0] + [4,128]*20 + [4] + [0]`.
pub fn flash_ratios() -> Vec<i32> {
    let mut r = vec![0, 0];
    for _ in 0..20 {
        r.extend([4, 128]);
    }
    r.extend([4, 0]);
    r
}

/// DeepSeek-V4-Pro: `[128,128] + [4,128]*29 + [4] + [0]`.
pub fn pro_ratios() -> Vec<i32> {
    let mut r = vec![128, 128];
    for _ in 0..29 {
        r.extend([4, 128]);
    }
    r.extend([4, 0]);
    r
}

pub fn models() -> [(&'static str, Vec<i32>); 2] {
    [("flash", flash_ratios()), ("pro", pro_ratios())]
}

/// A geometry at a fixed plane of `plane_rows`, with `num_slots` slots and as many blocks as
/// fit beside them.
pub fn geometry_at(ratios: &[i32], ring: i64, plane_rows: i64, num_slots: i64) -> UnifiedPoolGeometry {
    let g0 = GeometrySpec::new(ratios.to_vec(), 0, num_slots, ring, BLOCK_SIZE)
        .plane_rows(plane_rows)
        .build()
        .unwrap_or_else(|e| panic!("geometry {ratios:?} ring {ring} plane {plane_rows}: {e}"));
    let blocks = g0.max_blocks_beside(u32::try_from(num_slots).expect("slot count fits u32"));
    g0.with_capacity(blocks, num_slots, Some(plane_rows)).expect("max_blocks_beside fits")
}

/// A production-sized geometry: plane near 1.5e8 rows, ring 128..=135.
pub fn big_geometry(rng: &mut Rng, ratios: &[i32]) -> UnifiedPoolGeometry {
    let ring = rng.range(128, 135);
    let plane = 150_000_000 - rng.range(0, 1_000_000);
    let slots = rng.range(1024, 4096);
    geometry_at(ratios, ring, plane, slots)
}

// ---- the two-backend harness --------------------------------------------------------------

/// Builds a buffer's bytes from every buffer's address.
pub type ContentFn = Box<dyn Fn(&[u64]) -> Vec<u8>>;

/// Byte contents of a buffer, possibly depending on where every buffer landed (descriptors
/// that hold device addresses).
pub enum Content {
    Bytes(Vec<u8>),
    WithPtrs(u64, ContentFn),
}

pub struct Buf {
    pub name: String,
    pub content: Content,
}

impl Buf {
    fn len(&self) -> u64 {
        match &self.content {
            Content::Bytes(b) => b.len() as u64,
            Content::WithPtrs(n, _) => *n,
        }
    }
}

/// Buffers of one test case; `add_*` return the buffer's index into the pointer slice the
/// launch builder receives.
pub struct Case {
    pub name: String,
    pub seed: u64,
    pub bufs: Vec<Buf>,
}

pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

pub fn i64_bytes(v: &[i64]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

impl Case {
    pub fn new(name: impl Into<String>, seed: u64) -> Self {
        Case { name: name.into(), seed, bufs: Vec::new() }
    }
    pub fn bytes(&mut self, name: &str, b: Vec<u8>) -> usize {
        self.bufs.push(Buf { name: name.into(), content: Content::Bytes(b) });
        self.bufs.len() - 1
    }
    pub fn i32s(&mut self, name: &str, v: &[i32]) -> usize {
        self.bytes(name, i32_bytes(v))
    }
    pub fn i64s(&mut self, name: &str, v: &[i64]) -> usize {
        self.bytes(name, i64_bytes(v))
    }
    /// An output buffer of `n` i32 pre-filled with `poison`.
    pub fn poisoned(&mut self, name: &str, n: usize, poison: i32) -> usize {
        self.i32s(name, &vec![poison; n])
    }
    pub fn with_ptrs(&mut self, name: &str, len: u64, f: impl Fn(&[u64]) -> Vec<u8> + 'static) -> usize {
        self.bufs.push(Buf { name: name.into(), content: Content::WithPtrs(len, Box::new(f)) });
        self.bufs.len() - 1
    }
    pub fn total_bytes(&self) -> u64 {
        self.bufs.iter().map(Buf::len).sum()
    }
}

/// Allocate and fill every buffer of `case` on `backend`, run the launches `make` builds from
/// the buffers' addresses, and return every buffer's final bytes.
pub fn run_case(
    backend: &dyn Backend,
    case: &Case,
    make: &dyn Fn(&[u64]) -> Vec<Launch>,
) -> BackendResult<Vec<Vec<u8>>> {
    let s = Stream::DEFAULT;
    let mut allocs = Vec::new();
    for b in &case.bufs {
        allocs.push(backend.alloc_zeroed(b.len())?);
    }
    let ptrs: Vec<u64> = allocs.iter().map(|a| a.ptr).collect();
    let result = (|| {
        for (b, &p) in case.bufs.iter().zip(&ptrs) {
            let bytes = match &b.content {
                Content::Bytes(v) => std::borrow::Cow::Borrowed(v),
                Content::WithPtrs(n, f) => {
                    let v = f(&ptrs);
                    assert_eq!(v.len() as u64, *n, "{}: content length", b.name);
                    std::borrow::Cow::Owned(v)
                }
            };
            // SAFETY: `p` is a live allocation of exactly this buffer's length.
            unsafe { backend.upload(p, &bytes, s)? };
        }
        for l in make(&ptrs) {
            // SAFETY: the launch builders size every buffer to what its kernel touches
            // (the contract of `index-buffers.md`), from these live allocations.
            unsafe { backend.launch(&l, s)? };
        }
        let mut out = Vec::new();
        for (b, &p) in case.bufs.iter().zip(&ptrs) {
            let mut v = vec![0u8; b.len() as usize];
            // SAFETY: `p` is a live allocation of this length.
            unsafe { backend.download(&mut v, p, s)? };
            if let Content::WithPtrs(_, f) = &b.content {
                // Holds this backend's addresses, so it cannot match the other backend's:
                // checked here against what was uploaded (kernels only read descriptors).
                assert!(v == f(&ptrs), "case {}: descriptor buffer {} was written", case.name, b.name);
                v.clear();
            }
            out.push(v);
        }
        Ok(out)
    })();
    backend.synchronize(s)?;
    for a in allocs {
        // SAFETY: the stream is idle (synchronized) and the addresses are not used again.
        unsafe { backend.free(a) };
    }
    result
}

/// Panic with the case's seed and the first differences when the buffers differ.
pub fn assert_same(case: &Case, reference: &[Vec<u8>], device: &[Vec<u8>]) {
    let mut report = Vec::new();
    for ((b, r), d) in case.bufs.iter().zip(reference).zip(device) {
        if r == d {
            continue;
        }
        let mut diffs = Vec::new();
        let mut count = 0usize;
        for (i, (x, y)) in r.chunks(4).zip(d.chunks(4)).enumerate() {
            if x != y {
                count += 1;
                if diffs.len() < 8 {
                    let v = |c: &[u8]| {
                        if c.len() == 4 {
                            i32::from_le_bytes([c[0], c[1], c[2], c[3]]).to_string()
                        } else {
                            format!("{c:?}")
                        }
                    };
                    diffs.push(format!("[{i}] host {} cuda {}", v(x), v(y)));
                }
            }
        }
        report.push(format!(
            "  buffer {} ({} bytes): {count} words differ: {}",
            b.name,
            r.len(),
            diffs.join(", ")
        ));
    }
    if !report.is_empty() {
        panic!(
            "case {} (seed {:#x}, replay with V4POOL_SEED={}) differs from the host reference:\n{}",
            case.name,
            case.seed,
            base_seed(),
            report.join("\n")
        );
    }
}

/// Run a case on both backends and compare everything.
pub fn check_case(cuda: &dyn Backend, case: &Case, make: &dyn Fn(&[u64]) -> Vec<Launch>) {
    let reference = run_case(&host(), case, make)
        .unwrap_or_else(|e| panic!("case {} (seed {:#x}): host backend failed: {e}", case.name, case.seed));
    let device = run_case(cuda, case, make)
        .unwrap_or_else(|e| panic!("case {} (seed {:#x}): cuda backend failed: {e}", case.name, case.seed));
    assert_same(case, &reference, &device);
}

/// A pool over `ratios` (ring 129, 256-token blocks) with 16-byte rows and a one-field
/// arena: for the index paths, which never touch the planes' bytes or the compressor state.
pub fn index_pool(
    backend: std::sync::Arc<dyn Backend>,
    ratios: Vec<i32>,
    blocks: i64,
    slots: i64,
) -> std::sync::Arc<v4pool::pool::Pool> {
    index_pool_of(backend, GeometrySpec::new(ratios, blocks, slots, 129, 256))
}

/// As [`index_pool`] for any geometry spec (its arena rows and alignment are the pool's).
pub fn index_pool_of(
    backend: std::sync::Arc<dyn Backend>,
    spec: GeometrySpec,
) -> std::sync::Arc<v4pool::pool::Pool> {
    try_index_pool_of(backend, spec).expect("index pool")
}

/// [`index_pool_of`], its refusal returned (the host bench's staging pool: a plan's geometry
/// with rows too small to take its budget of host memory).
pub fn try_index_pool_of(
    backend: std::sync::Arc<dyn Backend>,
    spec: GeometrySpec,
) -> Result<std::sync::Arc<v4pool::pool::Pool>, Box<dyn std::error::Error>> {
    use v4pool::raw::arena::{ArenaLayout, Dtype, Fill, StateField};
    let field = StateField {
        name: "state".into(),
        layers: 1,
        shape: vec![1, 4],
        dtype: Dtype::F32,
        fill: Fill::Zero,
        carried: true,
        align: 256,
    };
    let arena = ArenaLayout::new(vec![field], &[16])?;
    let geometry = spec.arena_rows(arena.arena_rows()).slot_align_rows(arena.slot_align_rows()).build()?;
    let csa_layers = geometry.index_key_layers();
    let spec = v4pool::pool::PoolSpec::new(geometry, vec![16], arena, None, csa_layers)?;
    Ok(std::sync::Arc::new(v4pool::pool::Pool::new(backend, spec, Stream::DEFAULT)?))
}
