//! The C ABI (feature `capi`): `extern "C"` functions over opaque handles. The header
//! `include/v4pool.h` is generated from this module (this file and `decode.rs`, `events.rs`,
//! `forward.rs`, `sized.rs`) by cbindgen (CI fails on a stale one).
//!
//! Conventions: every fallible function returns a [`V4poolStatus`] (`V4POOL_OK` is 0) and
//! writes results through out-pointers; on failure the thread's last error holds the Rust
//! error's variant name and message ([`v4pool_last_error_variant`],
//! [`v4pool_last_error_message`]). Handles are freed by their `_free` function; a decode
//! handle keeps its pool alive, so the order of frees does not matter. A Rust panic never
//! crosses the boundary: it becomes `V4POOL_PANIC`.
//!
//! Versioning: see [`V4POOL_ABI_VERSION`] and [`SizedStruct`] (every struct passed by pointer, in or
//! out, starts with `struct_size`, which the caller sets to `sizeof` and the library checks).

use crate::backend::external::ExternalRegion;
use crate::backend::{self, BackendChoice, Stream};
use crate::plan_report::{PlanOptions, PlanReport};
use crate::pool::{DecodePath, LayerView, Pool, PoolSpec};
use crate::VariantName;
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// What a call returned.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum V4poolStatus {
    /// Success.
    Ok = 0,
    /// A null pointer, a non-UTF-8 string, an unknown name.
    InvalidArgument = 1,
    /// The library rejected the input (see the last error's variant).
    Rejected = 2,
    /// The backend failed (driver absent, out of memory, a failed launch).
    Backend = 3,
    /// A bug: a Rust panic was caught at the boundary.
    Panic = 4,
    /// A struct's `struct_size` is not a size this library knows (variant `StructSize`; the
    /// message names the struct, the size given and the sizes known): the caller was compiled
    /// against another `v4pool.h`, or left `struct_size` unset.
    AbiMismatch = 5,
}

/// A sized plan (opaque).
pub struct V4poolPlan {
    report: PlanReport,
}

/// A pool on a backend (opaque).
pub struct V4poolPool {
    pool: Arc<Pool>,
}

/// Decode index buffers of one pool (opaque).
pub struct V4poolDecode {
    step: DecodePath,
}

/// A plan's main numbers.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct V4poolPlanInfo {
    /// `sizeof` of this struct, set by the caller (see the header's versioning note).
    pub struct_size: u32,
    /// Blocks at the plan's split.
    pub num_blocks: i64,
    /// Slots at the plan's split.
    pub num_slots: i64,
    /// Rows of each plane (fixed for the pool's life).
    pub plane_rows: i64,
    /// Planes: 2 (fp8 NoPE + bf16 RoPE) or 1 (bf16).
    pub num_planes: u32,
    /// Row bytes of each plane (the second is 0 for the one-plane bf16 layout).
    pub plane_widths: [u64; 2],
    /// Tokens per block.
    pub block_size: i64,
    /// Sliding window length.
    pub sliding_window: i64,
    /// Ring entries per slot and window layer (window + speculative steps).
    pub ring_slots: i64,
    /// CSA top-k per token.
    pub index_topk: i64,
    /// Speculative (MTP) steps.
    pub spec_steps: i64,
    /// Bytes the pool allocates.
    pub total_bytes: u64,
}

/// One layer's view of one plane (or a whole plane, `layer` = -1): row `x` is at
/// `ptr + x * row_bytes`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct V4poolView {
    /// `sizeof` of this struct, set by the caller (see the header's versioning note).
    pub struct_size: u32,
    /// Device (or host) address of row 0.
    pub ptr: u64,
    /// Rows addressable from `ptr`.
    pub rows: i64,
    /// Bytes per row.
    pub row_bytes: u64,
}

/// A slot handed out: the allocator's handle and its position.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct V4poolSlot {
    /// The allocator's group id.
    pub group: u32,
    /// The allocator that handed it out.
    pub pool: u32,
    /// Generation, checked on every use.
    pub generation: u64,
    /// Physical slot position (what kernels take).
    pub position: i64,
}

/// A block handed out.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct V4poolBlock {
    /// Block id (row-space envelope index).
    pub id: u32,
    /// The allocator that handed it out.
    pub pool: u32,
    /// Generation, checked on every use.
    pub generation: u64,
}

/// A device buffer of `len` int32 elements.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct V4poolBuffer {
    /// Device address.
    pub ptr: u64,
    /// Elements (int32).
    pub len: u64,
}

thread_local! {
    static LAST: RefCell<(CString, CString)> = RefCell::new((CString::default(), CString::default()));
}

fn set_last(variant: &str, message: &str) {
    let clean = |s: &str| CString::new(s.replace('\0', " ")).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = (clean(variant), clean(message)));
}

/// Run `f`, turning an error into a status and the thread's last error, and a panic into
/// `Panic`.
fn guard(f: impl FnOnce() -> Result<(), (V4poolStatus, String, String)>) -> V4poolStatus {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            set_last("", "");
            V4poolStatus::Ok
        }
        Ok(Err((status, variant, message))) => {
            set_last(&variant, &message);
            status
        }
        Err(_) => {
            set_last("Panic", "a Rust panic was caught at the C boundary");
            V4poolStatus::Panic
        }
    }
}

type Fail = (V4poolStatus, String, String);

fn rejected<E: VariantName + std::fmt::Display>(e: E) -> Fail {
    let status = if e.is_device_failure() { V4poolStatus::Backend } else { V4poolStatus::Rejected };
    (status, e.variant_name().to_string(), e.to_string())
}

fn invalid(what: &str) -> Fail {
    (V4poolStatus::InvalidArgument, "InvalidArgument".into(), what.into())
}

/// A C string argument (`Ok(None)` for null: the caller decides whether null is allowed).
///
/// # Safety
/// `s` is null or points to a NUL-terminated string, readable up to and including its NUL and
/// not written for `'a` (null is checked; nothing else is).
unsafe fn text<'a>(s: *const c_char, what: &str) -> Result<Option<&'a str>, Fail> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, and the rest is this function's `# Safety`.
    unsafe { CStr::from_ptr(s) }.to_str().map(Some).map_err(|_| invalid(&format!("{what} is not UTF-8")))
}

/// `n` items at `p` (null allowed when `n` is 0; "`what` is null" otherwise).
///
/// # Safety
/// When `n` > 0, `p` is null or points to `n` initialised, properly aligned `T`s in one
/// allocation, readable and not written for `'a` (null is checked; nothing else is; `p` is
/// not read when `n` is 0).
unsafe fn items<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Fail> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(invalid(&format!("{what} is null")));
    }
    // SAFETY: non-null, `n` > 0, and the rest is this function's `# Safety`.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// The caller's pointer `p` as a mutable reference ("`what` is null" for null): an
/// out-pointer, or a handle the call changes.
///
/// # Safety
/// `p` is null or points to properly aligned storage for a `T`, readable and writable for
/// `'a`, holding a valid `T` if it is read before it is written (the out-slots here are
/// written first, and have no drop glue; a handle is live), and nothing else reads or writes
/// it for `'a` (no other live reference or pointer use, no other thread): null is checked;
/// nothing else is.
unsafe fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Fail> {
    // SAFETY: null is `None`; the rest is this function's `# Safety`.
    unsafe { p.as_mut() }.ok_or_else(|| invalid(&format!("{what} is null")))
}

/// The caller's pointer `p` as a shared reference ("`what` is null" for null): a handle the
/// call reads.
///
/// # Safety
/// `p` is null or points to a valid, properly aligned `T`, readable and not written for `'a`
/// (other threads may read it meanwhile only if `T` is `Sync`, as the plan, pool, decode and
/// top-k handles are): null is checked; nothing else is.
unsafe fn get<'a, T>(p: *const T, what: &str) -> Result<&'a T, Fail> {
    // SAFETY: null is `None`; the rest is this function's `# Safety`.
    unsafe { p.as_ref() }.ok_or_else(|| invalid(&format!("{what} is null")))
}

/// `v` written to the caller's `out_view` (the layer and compressed views' one translation).
///
/// # Safety
/// As [`write_out`]'s `p`: `out_view` is null or points to the caller's `V4poolView`.
unsafe fn write_view(out_view: *mut V4poolView, v: LayerView) -> Result<(), Fail> {
    // SAFETY: this function's `# Safety` is `write_out`'s.
    unsafe {
        write_out(
            out_view,
            "out_view",
            V4poolView { struct_size: 0, ptr: v.ptr, rows: v.rows, row_bytes: v.row_bytes },
        )
    }
}

/// The variant name of this thread's last error ("" after a success). Valid until the
/// thread's next v4pool call.
#[no_mangle]
pub extern "C" fn v4pool_last_error_variant() -> *const c_char {
    LAST.with(|l| l.borrow().0.as_ptr())
}

/// The message of this thread's last error ("" after a success). Valid until the thread's
/// next v4pool call.
#[no_mangle]
pub extern "C" fn v4pool_last_error_message() -> *const c_char {
    LAST.with(|l| l.borrow().1.as_ptr())
}

/// Size a pool: `v4pool plan`. `dtype` (`fp8`/`bf16`/`flashmla-v4`/`flashmla-v4-p2`/`flashmla-v41`/
/// `flashmla-v41-fp4`) and `indexer` (`fp8`/`fp4`/`bf16`) may be null for the defaults (the
/// model family's rows, as `v4pool plan`: fp8 for V4, flashmla-v41 for V4.1; an fp8
/// indexer); `spec_steps` 0 is the default the CLI and Python take. `model` is a preset name or
/// a `config.json` path (a directory means its `config.json`). A config is read only if it is a regular file of at most 4 MiB: a FIFO or
/// device is refused unread (`NotAFile`), a larger file refused (`TooLarge`); nothing blocks.
///
/// # Safety
/// Strings are null or NUL-terminated; `out_plan` points to writable storage for a handle.
#[no_mangle]
pub unsafe extern "C" fn v4pool_plan_new(
    model: *const c_char,
    budget_bytes: u64,
    max_seqs: i64,
    dtype: *const c_char,
    indexer: *const c_char,
    spec_steps: i64,
    out_plan: *mut *mut V4poolPlan,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: forwarded string promises.
        let model = unsafe { text(model, "model") }?.ok_or_else(|| invalid("model is null"))?;
        let mut o = PlanOptions::new(model, budget_bytes, max_seqs);
        let named = |e: crate::plan_report::PlanOptionError| {
            (V4poolStatus::Rejected, e.variant_name().to_string(), e.to_string())
        };
        // SAFETY: as above.
        if let Some(d) = unsafe { text(dtype, "dtype") }? {
            o.kv = Some(PlanOptions::kv_from_name(d).map_err(named)?);
        }
        // SAFETY: as above.
        if let Some(i) = unsafe { text(indexer, "indexer") }? {
            o.indexer = Some(PlanOptions::indexer_from_name(i).map_err(named)?);
        }
        o.spec_steps = spec_steps;
        // SAFETY: `out_plan` is writable storage for a handle (this function's `# Safety`).
        let slot = unsafe { out(out_plan, "out_plan") }?;
        let report = o.report().map_err(named)?;
        *slot = Box::into_raw(Box::new(V4poolPlan { report }));
        Ok(())
    })
}

/// Free a plan (null is ignored).
///
/// # Safety
/// `plan` is null or from `v4pool_plan_new`, freed once.
#[no_mangle]
pub unsafe extern "C" fn v4pool_plan_free(plan: *mut V4poolPlan) {
    if !plan.is_null() {
        // SAFETY: the caller's promise.
        drop(unsafe { Box::from_raw(plan) });
    }
}

/// The plan as the JSON text of `v4pool plan --json`; free it with `v4pool_string_free`.
///
/// # Safety
/// `plan` is a live plan; `out_json` is writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_plan_json(
    plan: *const V4poolPlan,
    out_json: *mut *mut c_char,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `plan` is a live plan (this function's `# Safety`).
        let plan = unsafe { get(plan, "plan") }?;
        let text = CString::new(plan.report.to_json().to_string()).map_err(|_| invalid("NUL in JSON"))?;
        // SAFETY: `out_json` is writable (this function's `# Safety`).
        *unsafe { out(out_json, "out_json") }? = text.into_raw();
        Ok(())
    })
}

/// The plan's main numbers.
///
/// # Safety
/// `plan` is a live plan; `out_info` is writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_plan_info(
    plan: *const V4poolPlan,
    out_info: *mut V4poolPlanInfo,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `plan` is a live plan (this function's `# Safety`).
        let p = &unsafe { get(plan, "plan") }?.report.plan;
        let widths = p.layout.widths();
        let m = &p.layout.model;
        // The window, top-k and MTP steps are the spec's: what a decode capacity's 0 takes.
        let kv = p.kv_spec().map_err(rejected)?;
        let info = V4poolPlanInfo {
            struct_size: 0,
            num_blocks: p.num_blocks,
            num_slots: p.num_slots,
            plane_rows: p.plane_rows,
            num_planes: widths.len() as u32,
            plane_widths: [widths[0], widths.get(1).copied().unwrap_or(0)],
            block_size: m.block_size,
            sliding_window: i64::from(kv.window()),
            ring_slots: m.ring_slots(),
            index_topk: i64::from(kv.index_topk()),
            spec_steps: kv.spec_steps(),
            total_bytes: p.total_bytes,
        };
        // SAFETY: `out_info` is the caller's writable `V4poolPlanInfo` (this function's `# Safety`).
        unsafe { write_out(out_info, "out_info", info) }?;
        Ok(())
    })
}

/// Free a string this library returned (null is ignored).
///
/// # Safety
/// `s` is null or from this library, freed once.
#[no_mangle]
pub unsafe extern "C" fn v4pool_string_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: the caller's promise; made by `CString::into_raw`.
        drop(unsafe { CString::from_raw(s) });
    }
}

/// The pool `v4pool_pool_new` and `v4pool_pool_new_external` make.
///
/// # Safety
/// `plan` is null or a live plan; `backend` null or NUL-terminated; `out_pool` null or writable
/// storage for a handle; `stream` a live stream of the device or 0; `external`, where given, a
/// region as `v4pool_pool_new_external`'s `# Safety` states.
unsafe fn new_pool(
    plan: *const V4poolPlan,
    backend: *const c_char,
    device: u32,
    stream: u64,
    external: Option<(u64, u64)>,
    out_pool: *mut *mut V4poolPool,
) -> Result<(), Fail> {
    // SAFETY (the three calls): `plan`, `backend` and `out_pool` as this function's `# Safety`.
    let plan = unsafe { get(plan, "plan") }?;
    let name = unsafe { text(backend, "backend") }?.unwrap_or("auto");
    let slot = unsafe { out(out_pool, "out_pool") }?;
    let mut b =
        BackendChoice::parse(name).and_then(|c| backend::select_on(c, device as usize)).map_err(rejected)?;
    let spec = PoolSpec::from_plan(&plan.report.plan).map_err(rejected)?;
    if let Some((ptr, bytes)) = external {
        let need = Pool::required_bytes(&spec).map_err(rejected)?;
        if bytes < need {
            return Err((
                V4poolStatus::Rejected,
                "RegionTooSmall".into(),
                format!("the pool needs {need} bytes of memory, got {bytes}"),
            ));
        }
        // SAFETY: the region, as this function's `# Safety` (`v4pool_pool_new_external`'s).
        b = Arc::new(unsafe { ExternalRegion::new(b, ptr, bytes) }.map_err(rejected)?);
    }
    let pool = Pool::new(b, spec, Stream(stream)).map_err(rejected)?;
    *slot = Box::into_raw(Box::new(V4poolPool { pool: Arc::new(pool) }));
    Ok(())
}

/// A pool for `plan` on `backend` (`auto`, `host`, `cuda`, `hip`; null = auto) and device
/// `device`; its work goes on `stream` (0: the backend's own).
///
/// # Safety
/// `plan` is a live plan; `backend` null or NUL-terminated; `out_pool` writable; `stream` a
/// live stream of that device or 0.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_new(
    plan: *const V4poolPlan,
    backend: *const c_char,
    device: u32,
    stream: u64,
    out_pool: *mut *mut V4poolPool,
) -> V4poolStatus {
    // SAFETY: `plan`, `backend`, `stream` and `out_pool` (this function's `# Safety`), as
    // `new_pool` takes them.
    guard(|| unsafe { new_pool(plan, backend, device, stream, None, out_pool) })
}

/// Bytes `v4pool_pool_new_external` needs for `plan`.
///
/// # Safety
/// `plan` is a live plan; `out_bytes` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_required_bytes(
    plan: *const V4poolPlan,
    out_bytes: *mut u64,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `plan` is a live plan (this function's `# Safety`).
        let plan = unsafe { get(plan, "plan") }?;
        let spec = PoolSpec::from_plan(&plan.report.plan).map_err(rejected)?;
        // SAFETY: `out_bytes` is writable (this function's `# Safety`).
        *unsafe { out(out_bytes, "out_bytes") }? = Pool::required_bytes(&spec).map_err(rejected)?;
        Ok(())
    })
}

/// A pool whose planes, indexer cache and descriptors live in the caller's memory
/// `ptr .. ptr + bytes` (at least `v4pool_pool_required_bytes`).
///
/// # Safety
/// As `v4pool_pool_new`, and: the region is memory of that backend's device (host memory
/// for `host`), stays allocated until the pool and every decode handle of it are freed, and
/// nothing else reads or writes it meanwhile except through the pool's views.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_new_external(
    plan: *const V4poolPlan,
    backend: *const c_char,
    device: u32,
    stream: u64,
    ptr: u64,
    bytes: u64,
    out_pool: *mut *mut V4poolPool,
) -> V4poolStatus {
    // SAFETY: the pointers, `stream` and the region (this function's `# Safety`), as
    // `new_pool` takes them.
    guard(|| unsafe { new_pool(plan, backend, device, stream, Some((ptr, bytes)), out_pool) })
}

/// Free a pool (null is ignored); waits for its stream. Decode handles keep it alive.
///
/// # Safety
/// `pool` is null or from `v4pool_pool_new*`, freed once.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_free(pool: *mut V4poolPool) {
    if !pool.is_null() {
        // SAFETY: the caller's promise.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(pool) })));
    }
}

/// Plane `plane` as a view (`rows` = plane rows).
///
/// # Safety
/// `pool` is live; `out_view` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_plane(
    pool: *const V4poolPool,
    plane: u32,
    out_view: *mut V4poolView,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let p = &unsafe { get(pool, "pool") }?.pool;
        let ptr = p.plane_ptr(plane as usize).map_err(rejected)?;
        let row_bytes = p.spec().plane_widths[plane as usize];
        let view = V4poolView { struct_size: 0, ptr, rows: p.spec().geometry.plane_rows, row_bytes };
        // SAFETY: `out_view` is the caller's writable `V4poolView` (this function's `# Safety`).
        unsafe { write_out(out_view, "out_view", view) }?;
        Ok(())
    })
}

/// Layer `layer`'s view of plane `plane` (index-buffer entries are its rows).
///
/// # Safety
/// `pool` is live; `out_view` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_layer_view(
    pool: *const V4poolPool,
    layer: u32,
    plane: u32,
    out_view: *mut V4poolView,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let p = &unsafe { get(pool, "pool") }?.pool;
        let v = p.layer_view(layer as usize, plane as usize).map_err(rejected)?;
        // SAFETY: `out_view` is the caller's writable `V4poolView` (this function's `# Safety`).
        unsafe { write_view(out_view, v) }
    })
}

/// The view `layer`'s compressed indices are rows of (`Pool::compressed_view`): its layer view
/// of plane 0, or in a packed pool (`flashmla-v41-fp4`) the 288-B fp4 rows from plane row 0
/// (FlashMLA's `extra_k_cache`, shift 0). Refused for a layer without compressed rows.
///
/// # Safety
/// `pool` is live; `out_view` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_compressed_view(
    pool: *const V4poolPool,
    layer: u32,
    out_view: *mut V4poolView,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let v = unsafe { get(pool, "pool") }?.pool.compressed_view(layer as usize).map_err(rejected)?;
        // SAFETY: `out_view` is the caller's writable `V4poolView` (this function's `# Safety`).
        unsafe { write_view(out_view, v) }
    })
}

/// A layer's rows as a paged attention kernel takes them (FlashMLA's `k_cache`
/// `[pages, page_rows, 1, row_bytes]`): the page holding the layer's first row of plane
/// `plane`, whole pages to the plane's end, and the shift its view indices take
/// (`Pool::page_view`; `NotPageable` where the layer's pages are not whole in the plane).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct V4poolPageView {
    /// `sizeof` of this struct, set by the caller (see the header's versioning note).
    pub struct_size: u32,
    /// Address of the first page.
    pub ptr: u64,
    /// Whole pages from there to the plane's end.
    pub pages: i64,
    /// Rows of a page.
    pub page_rows: i64,
    /// Bytes per row.
    pub row_bytes: u64,
    /// Kernel index of view row 0: add it to the layer's view indices.
    pub row_shift: i64,
}

/// Layer `layer`'s page view of plane `plane` in pages of `page_rows` rows (FlashMLA: 64).
///
/// # Safety
/// `pool` is live; `out_view` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_page_view(
    pool: *const V4poolPool,
    layer: u32,
    plane: u32,
    page_rows: i64,
    out_view: *mut V4poolPageView,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let p = &unsafe { get(pool, "pool") }?.pool;
        let v = p.page_view(layer as usize, plane as usize, page_rows).map_err(rejected)?;
        let view = V4poolPageView {
            struct_size: 0,
            ptr: v.ptr,
            pages: v.pages,
            page_rows: v.page_rows,
            row_bytes: v.row_bytes,
            row_shift: v.row_shift,
        };
        // SAFETY: `out_view` is the caller's writable `V4poolPageView` (this function's `# Safety`).
        unsafe { write_out(out_view, "out_view", view) }?;
        Ok(())
    })
}

/// Row of `layer`'s view holding ring entry `ring_pos` of the slot at `position`.
///
/// # Safety
/// `pool` is live; `out_row` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_window_index(
    pool: *const V4poolPool,
    layer: u32,
    position: i64,
    ring_pos: i64,
    out_row: *mut i64,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let g = unsafe { get(pool, "pool") }?.pool.geometry().map_err(rejected)?;
        let row = g.window_index(layer as usize, position, ring_pos).map_err(rejected)?;
        // SAFETY: `out_row` is writable (this function's `# Safety`).
        *unsafe { out(out_row, "out_row") }? = row;
        Ok(())
    })
}

/// Hand out a slot (its compressor state initialised on the pool's stream).
///
/// # Safety
/// `pool` is live; `out_slot` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_alloc_slot(
    pool: *const V4poolPool,
    out_slot: *mut V4poolSlot,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let s = unsafe { get(pool, "pool") }?.pool.alloc_slot().map_err(rejected)?;
        // SAFETY: `out_slot` is writable (this function's `# Safety`).
        *unsafe { out(out_slot, "out_slot") }? = V4poolSlot {
            group: s.handle.group,
            pool: s.handle.pool,
            generation: s.handle.generation,
            position: s.position,
        };
        Ok(())
    })
}

/// Return a slot.
///
/// # Safety
/// `pool` is live.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_free_slot(pool: *const V4poolPool, slot: V4poolSlot) -> V4poolStatus {
    guard(|| {
        let h = crate::alloc::SlotHandle { group: slot.group, generation: slot.generation, pool: slot.pool };
        // SAFETY: `pool` is live (this function's `# Safety`).
        unsafe { get(pool, "pool") }?.pool.free_slot(h).map_err(rejected)
    })
}

/// Hand out a block.
///
/// # Safety
/// `pool` is live; `out_block` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_alloc_block(
    pool: *const V4poolPool,
    out_block: *mut V4poolBlock,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let h = unsafe { get(pool, "pool") }?.pool.alloc_block().map_err(rejected)?.handle;
        // SAFETY: `out_block` is writable (this function's `# Safety`).
        *unsafe { out(out_block, "out_block") }? =
            V4poolBlock { id: h.id, pool: h.pool, generation: h.generation };
        Ok(())
    })
}

/// Return a block.
///
/// # Safety
/// `pool` is live.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_free_block(pool: *const V4poolPool, block: V4poolBlock) -> V4poolStatus {
    guard(|| {
        let h = crate::alloc::BlockHandle { id: block.id, generation: block.generation, pool: block.pool };
        // SAFETY: `pool` is live (this function's `# Safety`).
        unsafe { get(pool, "pool") }?.pool.free_block(h).map_err(rejected)
    })
}

/// Copy `len` bytes of plane `plane` from `offset` to host memory `dst` (waits).
///
/// # Safety
/// `pool` is live; `dst` holds `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_read_plane(
    pool: *const V4poolPool,
    plane: u32,
    offset: u64,
    dst: *mut u8,
    len: usize,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let p = &unsafe { get(pool, "pool") }?.pool;
        if dst.is_null() && len > 0 {
            return Err(invalid("dst is null"));
        }
        // SAFETY: the caller's promise; an empty read never touches `dst`.
        let buf = if len == 0 { &mut [][..] } else { unsafe { std::slice::from_raw_parts_mut(dst, len) } };
        p.read_plane(plane as usize, offset, buf).map_err(rejected)
    })
}

/// Copy `len` host bytes from `src` into plane `plane` at `offset`.
///
/// # Safety
/// `pool` is live; `src` holds `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn v4pool_pool_write_plane(
    pool: *const V4poolPool,
    plane: u32,
    offset: u64,
    src: *const u8,
    len: usize,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let p = &unsafe { get(pool, "pool") }?.pool;
        if src.is_null() && len > 0 {
            return Err(invalid("src is null"));
        }
        // SAFETY: the caller's promise; an empty write never touches `src`.
        let buf = if len == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(src, len) } };
        p.write_plane(plane as usize, offset, buf).map_err(rejected)
    })
}

mod decode;
mod events;
mod forward;
mod sized;
pub use decode::{
    v4pool_decode_buffer, v4pool_decode_build, v4pool_decode_flashmla, v4pool_decode_free, v4pool_decode_new,
    v4pool_decode_new_flashmla, v4pool_decode_stage, v4pool_decode_synchronize, V4poolDecodeBuffer,
    V4poolDecodeCapacity, V4poolFlashMla, V4poolFlashMlaWidths,
};
pub use events::{
    v4pool_block_hashes, v4pool_events_cleared, v4pool_events_endpoint, v4pool_events_flush,
    v4pool_events_free, v4pool_events_new, v4pool_events_removed, v4pool_events_replay_endpoint,
    v4pool_events_stored, V4poolEventEncoding, V4poolEvents, V4poolHash, V4poolMedium,
};
pub use forward::{v4pool_csa_topk_free, v4pool_csa_topk_new, v4pool_decode_csa_pack, V4poolCsaTopk};
use sized::{read_in, write_out};
pub use sized::{v4pool_abi_version, SizedStruct, V4POOL_ABI_VERSION};

#[cfg(test)]
mod tests;
