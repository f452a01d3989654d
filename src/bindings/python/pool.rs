//! `v4pool.Pool` and `v4pool.Decode`: the pool on a backend (its own memory or the
//! engine's), views as DLPack objects, slots and blocks, boundary moves, and the decode
//! index buffers staged from numpy arrays and built on the caller's stream.

use super::dlpack::{row_shape, DLDevice, DeviceView, Elem, Keep, DL_CPU, DL_CUDA, DL_ROCM};
use super::{error, lib_err, Plan};
use crate::alloc::{BlockHandle, SlotHandle};
use crate::arena::Dtype;
use crate::backend::external::ExternalRegion;
use crate::backend::{self, Backend, BackendChoice, BackendKind, Stream};
use crate::boundary::BoundaryChange;
use crate::checkpoint::{CheckpointImage, LayoutId};
use crate::geometry::Class;
use crate::pool::{
    CsaTopk, DecodeCapacity, DecodeError, DecodePath, DeviceBuffer, FlashMlaWidths, FlatDecodeBatch, Pool,
    PoolSpec, TopkRows,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::{Arc, Mutex};

/// The pool and what its memory depends on. Field order is drop order: the pool (and its
/// final stream drain) goes before the engine's tensor that may back it.
pub struct Hold {
    pool: Arc<Pool>,
    _memory: Option<Py<PyAny>>,
}

/// A slot handed out: the allocator's handle and where it sits.
#[pyclass(module = "v4pool", frozen, eq)]
#[derive(Clone, PartialEq, Eq)]
pub struct Slot {
    #[pyo3(get)]
    group: u32,
    #[pyo3(get)]
    generation: u64,
    #[pyo3(get)]
    pool_id: u32,
    /// Position at hand-out (a boundary move reports the new one).
    #[pyo3(get)]
    position: i64,
}

impl Slot {
    pub(super) fn handle(&self) -> SlotHandle {
        SlotHandle { group: self.group, generation: self.generation, pool: self.pool_id }
    }
    pub(super) fn from_handle(h: SlotHandle, position: i64) -> Slot {
        Slot { group: h.group, generation: h.generation, pool_id: h.pool, position }
    }
}

#[pymethods]
impl Slot {
    fn __repr__(&self) -> String {
        format!("Slot(group={}, generation={}, position={})", self.group, self.generation, self.position)
    }
}

/// A block handed out.
#[pyclass(module = "v4pool", frozen, eq)]
#[derive(Clone, PartialEq, Eq)]
pub struct Block {
    #[pyo3(get)]
    id: u32,
    #[pyo3(get)]
    generation: u64,
    #[pyo3(get)]
    pool_id: u32,
}

impl Block {
    pub(super) fn handle(&self) -> BlockHandle {
        BlockHandle { id: self.id, generation: self.generation, pool: self.pool_id }
    }
    pub(super) fn from_handle(h: BlockHandle) -> Block {
        Block { id: h.id, generation: h.generation, pool_id: h.pool }
    }
}

#[pymethods]
impl Block {
    fn __repr__(&self) -> String {
        format!("Block(id={}, generation={})", self.id, self.generation)
    }
}

/// `CU_STREAM_LEGACY`: the handle CUDA reads as the legacy default stream.
const CUDA_LEGACY_STREAM: u64 = 1;

/// A stream argument: None (the default), an int handle (0 is the backend's own stream),
/// or an object with `.cuda_stream` (a `torch.cuda.Stream`). torch names the legacy default
/// stream 0, which v4pool reads as its own stream, so a stream object's 0 becomes
/// `CU_STREAM_LEGACY`: work then really is ordered with torch's default stream.
fn stream_arg(stream: Option<&Bound<'_, PyAny>>, default: Stream) -> PyResult<Stream> {
    let Some(s) = stream else { return Ok(default) };
    if s.is_none() {
        return Ok(default);
    }
    if let Ok(v) = s.extract::<u64>() {
        return Ok(Stream(v));
    }
    let handle: u64 = s.getattr("cuda_stream")?.extract()?;
    Ok(Stream(if handle == 0 { CUDA_LEGACY_STREAM } else { handle }))
}

/// `(address, bytes, what keeps it alive)` of an engine's buffer, through DLPack only (a
/// torch tensor, a writable numpy array): the producer proves the memory, its device, size
/// and strides; a stated pointer (`data_ptr()`, `__array_interface__`) is never taken.
fn memory_arg(obj: &Bound<'_, PyAny>, kind: BackendKind, device: usize) -> PyResult<(u64, u64, Py<PyAny>)> {
    let (ptr, bytes, capsule) = super::dlpack::import_region(obj, device_of(kind, device))?;
    // The capsule keeps the producer's memory; the object too, for the engine's sake.
    let keep = pyo3::types::PyTuple::new(obj.py(), [obj.clone().unbind(), capsule])?;
    Ok((ptr, bytes, keep.into_any().unbind()))
}

fn device_of(kind: BackendKind, device: usize) -> DLDevice {
    let device_type = match kind {
        BackendKind::Host => DL_CPU,
        BackendKind::Cuda => DL_CUDA,
        BackendKind::Hip => DL_ROCM,
    };
    DLDevice { device_type, device_id: if kind == BackendKind::Host { 0 } else { device as i32 } }
}

/// The pool on a backend: `Pool(plan, backend="auto", device=0, stream=None, memory=None)`.
///
/// `memory` (a torch tensor or a writable numpy array) puts the pool's planes, indexer cache
/// and descriptor buffer in the engine's bytes (at least `Pool.required_bytes(plan)`); the
/// pool keeps the object alive, and the engine must not touch those bytes except through
/// the pool's views.
#[pyclass(module = "v4pool", name = "Pool", frozen)]
pub struct PyPool {
    hold: Arc<Hold>,
    plan: Py<Plan>,
    device: DLDevice,
    region: Option<(u64, u64)>,
}

impl PyPool {
    fn pool(&self) -> &Pool {
        &self.hold.pool
    }

    /// The DLPack device of the pool's memory, for the forward binding's views.
    pub(super) fn dl_device(&self) -> DLDevice {
        self.device
    }

    /// The pool, and the hold that keeps its memory alive, for the manager binding.
    pub(super) fn shared(&self) -> (Arc<Pool>, Arc<Hold>) {
        (self.hold.pool.clone(), self.hold.clone())
    }

    fn build(
        py: Python<'_>,
        plan: Py<Plan>,
        backend: Arc<dyn Backend>,
        device: usize,
        stream: Stream,
        memory: Option<(u64, u64, Py<PyAny>)>,
    ) -> PyResult<PyPool> {
        let spec = PoolSpec::from_plan(&plan.get().report.plan).map_err(lib_err)?;
        let kind = backend.kind();
        let (backend, region, keep): (Arc<dyn Backend>, _, _) = match memory {
            None => (backend, None, None),
            Some((ptr, bytes, obj)) => {
                let need = Pool::required_bytes(&spec).map_err(lib_err)?;
                if bytes < need {
                    return Err(error(
                        "RegionTooSmall",
                        format!("the pool needs {need} bytes of memory, got {bytes}"),
                    ));
                }
                // SAFETY: the bytes came through DLPack from their producer, on this backend's
                // device (checked in `memory_arg`), stay allocated while we hold the capsule
                // and the object (`obj`), and are the pool's alone: the engine handed them over.
                let ext = unsafe { ExternalRegion::new(backend, ptr, bytes) }.map_err(lib_err)?;
                let region = ext.region();
                (Arc::new(ext), Some(region), Some(obj))
            }
        };
        let pool = py.detach(|| Pool::new(backend, spec, stream)).map_err(lib_err)?;
        Ok(PyPool {
            hold: Arc::new(Hold { pool: Arc::new(pool), _memory: keep }),
            plan,
            device: device_of(kind, device),
            region,
        })
    }

    fn keep(&self) -> Keep {
        self.hold.clone()
    }

    fn view(&self, ptr: u64, elem: Elem, shape: Vec<i64>) -> DeviceView {
        let mut v = DeviceView::contiguous(ptr, elem, shape, self.device, self.keep());
        v.sync = Some(sync_fn(&self.hold));
        v
    }

    /// Default element type of a plane's rows, from the pool's row format
    /// (`PoolSpec::plane_elem`): bf16 for a plane of bf16 values alone (ATOM fp8's RoPE plane,
    /// the bf16 layout's), raw bytes wherever encodings or scales share a row (the fp8 NoPE
    /// plane, FlashMLA's packed e4m3 / fp4 rows) or the format is unknown.
    fn plane_elem(&self, plane: usize, dtype: Option<&str>) -> PyResult<Elem> {
        if let Some(name) = dtype {
            return Elem::parse(name).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "dtype {name:?}: one of uint8, float8_e4m3fn, float8_e4m3fnuz, bfloat16, int32, float32"
                ))
            });
        }
        Ok(match self.pool().spec().plane_elem(plane) {
            Some(crate::format::Elem::Bf16) => Elem::Bf16,
            Some(crate::format::Elem::E4m3) => Elem::F8E4M3,
            // e2m1 has no DLPack type: two values a byte, handed over as the bytes.
            Some(crate::format::Elem::E2m1) | None => Elem::U8,
        })
    }
}

/// A decode path over `pool` at `cap`: CSR buffers, or with `flashmla` (`True` for the
/// narrowest widths, or `(topk, csa_extra_topk, hca_extra_topk)`; `False` / `None`: CSR)
/// FlashMLA's convention (index-buffers.md §3f). The one parser `Pool.decode` and `Forward`
/// share.
pub(super) fn decode_path_of(
    pool: &Arc<Pool>,
    cap: DecodeCapacity,
    flashmla: Option<&Bound<'_, PyAny>>,
) -> PyResult<DecodePath> {
    let widths = match flashmla {
        None => None,
        Some(f) => {
            if let Ok((topk, csa_extra_topk, hca_extra_topk)) = f.extract::<(i32, i32, i32)>() {
                Some(FlashMlaWidths { topk, csa_extra_topk, hca_extra_topk })
            } else if f.extract::<bool>()? {
                let g = pool.geometry().map_err(lib_err)?;
                Some(FlashMlaWidths::for_capacity(&g, cap).map_err(lib_err)?)
            } else {
                None
            }
        }
    };
    match widths {
        None => pool.decode_path(cap),
        Some(w) => pool.flashmla_decode_path(cap, w),
    }
    .map_err(lib_err)
}

/// A layer's FlashMLA operands as the dict `Decode.flashmla` / `Forward.flashmla` return:
/// int32 views `indices [max_tokens, topk]`, `topk_length [max_tokens]` (per token),
/// `seq_topk_length [max_seqs]` (per sequence: FlashMLA's `topk_length`), for a compressed
/// layer `extra_indices [max_tokens, extra_topk]`, `extra_topk_length [max_tokens]` and
/// `seq_extra_topk_length [max_seqs]`, and `shift`.
pub(super) fn flashmla_dict<'py>(
    py: Python<'py>,
    ops: &crate::pool::FlashMlaBuffers,
    device: DLDevice,
    keep: &Keep,
    sync: Option<Arc<dyn Fn() -> PyResult<()> + Send + Sync>>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let view = |b: DeviceBuffer, shape: Vec<i64>| {
        let mut v = DeviceView::contiguous(b.ptr, Elem::I32, shape, device, keep.clone());
        v.sync = sync.clone();
        v
    };
    let t = ops.topk_length.len as i64;
    let b = ops.seq_topk_length.len as i64;
    d.set_item("indices", view(ops.indices, vec![t, i64::from(ops.topk)]))?;
    d.set_item("topk_length", view(ops.topk_length, vec![t]))?;
    d.set_item("seq_topk_length", view(ops.seq_topk_length, vec![b]))?;
    if let (Some(x), Some(xl)) = (ops.extra_indices, ops.extra_topk_length) {
        d.set_item("extra_indices", view(x, vec![t, i64::from(ops.extra_topk)]))?;
        d.set_item("extra_topk_length", view(xl, vec![t]))?;
    }
    if let Some(sx) = ops.seq_extra_topk_length {
        d.set_item("seq_extra_topk_length", view(sx, vec![b]))?;
    }
    d.set_item("shift", ops.shift)?;
    Ok(d)
}

fn sync_fn(hold: &Arc<Hold>) -> Arc<dyn Fn() -> PyResult<()> + Send + Sync> {
    let hold = hold.clone();
    Arc::new(move || hold.pool.backend().synchronize(hold.pool.stream()).map_err(lib_err))
}

fn change_dict<'py>(py: Python<'py>, c: &BoundaryChange) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let blocks: Vec<(Block, Block)> =
        c.block_moves.iter().map(|m| (Block::from_handle(m.old), Block::from_handle(m.new))).collect();
    let slots: Vec<(Slot, Slot)> = c
        .slot_moves
        .iter()
        .map(|m| (Slot::from_handle(m.old, m.from_position), Slot::from_handle(m.new, m.to_position)))
        .collect();
    d.set_item("block_moves", blocks)?;
    d.set_item("slot_moves", slots)?;
    d.set_item("new_live_positions", (c.new_live_positions.start, c.new_live_positions.end))?;
    d.set_item("retired_positions", (c.retired_positions.start, c.retired_positions.end))?;
    d.set_item("num_blocks", c.num_blocks)?;
    d.set_item("num_slots", c.num_slots)?;
    d.set_item("max_blocks", c.max_blocks)?;
    Ok(d)
}

#[pymethods]
impl PyPool {
    #[new]
    #[pyo3(signature = (plan, backend="auto", device=0, stream=None, memory=None))]
    fn new(
        py: Python<'_>,
        plan: Py<Plan>,
        backend: &str,
        device: usize,
        stream: Option<Bound<'_, PyAny>>,
        memory: Option<Bound<'_, PyAny>>,
    ) -> PyResult<PyPool> {
        let b = BackendChoice::parse(backend).and_then(|c| backend::select_on(c, device)).map_err(lib_err)?;
        let stream = stream_arg(stream.as_ref(), Stream::DEFAULT)?;
        let memory = match memory {
            None => None,
            Some(m) => Some(memory_arg(&m, b.kind(), device)?),
        };
        PyPool::build(py, plan, b, device, stream, memory)
    }

    /// Bytes `memory` must provide for `plan`'s pool.
    #[staticmethod]
    fn required_bytes(plan: &Bound<'_, Plan>) -> PyResult<u64> {
        let spec = PoolSpec::from_plan(&plan.get().report.plan).map_err(lib_err)?;
        Pool::required_bytes(&spec).map_err(lib_err)
    }

    #[getter]
    fn plan(&self, py: Python<'_>) -> Py<Plan> {
        self.plan.clone_ref(py)
    }
    #[getter]
    fn backend(&self) -> String {
        self.pool().backend().kind().to_string()
    }
    #[getter]
    fn device_name(&self) -> String {
        self.pool().backend().device_name()
    }
    #[getter]
    fn stream(&self) -> u64 {
        self.pool().stream().0
    }
    #[getter]
    fn num_planes(&self) -> usize {
        self.pool().num_planes()
    }
    /// What the pool's rows are (`Pool::kv_spec`) as a dict: the `kv_spec` of its plan's
    /// `--json`. `window`, `index_topk` and `spec_steps` are what `decode`, `Forward` and the
    /// prefill path default to.
    #[getter]
    fn kv_spec<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        super::kv_spec_dict(py, self.pool().kv_spec())
    }
    #[getter]
    fn plane_widths(&self) -> Vec<u64> {
        self.pool().spec().plane_widths.clone()
    }
    #[getter]
    fn plane_rows(&self) -> i64 {
        self.pool().spec().geometry.plane_rows
    }
    /// Compress ratio of every layer (0 dense, 4 CSA, 128 HCA, -1 absent).
    #[getter]
    fn ratios(&self) -> Vec<i32> {
        self.pool().spec().geometry.ratios.clone()
    }
    /// `(address, bytes)` of the engine memory the pool was carved from, if any.
    #[getter]
    fn region(&self) -> Option<(u64, u64)> {
        self.region
    }

    /// Plane `plane` as `[plane_rows, row elements]` (dtype: see `layer_view`).
    #[pyo3(signature = (plane, dtype=None))]
    fn plane(&self, plane: usize, dtype: Option<&str>) -> PyResult<DeviceView> {
        let ptr = self.pool().plane_ptr(plane).map_err(lib_err)?;
        let elem = self.plane_elem(plane, dtype)?;
        let shape = row_shape(self.plane_rows(), self.pool().spec().plane_widths[plane], elem)?;
        Ok(self.view(ptr, elem, shape))
    }

    /// Layer `layer`'s view of plane `plane`: `[view rows, row elements]` from the layer's
    /// base row; index-buffer entries are rows of it. `dtype` defaults to the pool's row
    /// format's: `bfloat16` for a plane of bf16 values (the fp8 layout's RoPE plane, the bf16
    /// layout), else `uint8` (the fp8 NoPE plane, FlashMLA's packed rows); `float8_e4m3fn`
    /// on request.
    #[pyo3(signature = (layer, plane, dtype=None))]
    fn layer_view(&self, layer: usize, plane: usize, dtype: Option<&str>) -> PyResult<DeviceView> {
        let v = self.pool().layer_view(layer, plane).map_err(lib_err)?;
        let elem = self.plane_elem(plane, dtype)?;
        Ok(self.view(v.ptr, elem, row_shape(v.rows, v.row_bytes, elem)?))
    }

    /// The view `layer`'s compressed indices are rows of, uint8 `[rows, row_bytes]`
    /// (`Pool::compressed_view`): the layer's view of plane 0, or in a packed pool
    /// (`flashmla-v41-fp4`) the 288-B fp4 rows from plane row 0 — FlashMLA's `extra_k_cache` as
    /// `view[: rows // 64 * 64].view(-1, 64, 1, 288)`, shift 0.
    fn compressed_view(&self, layer: usize) -> PyResult<DeviceView> {
        let v = self.pool().compressed_view(layer).map_err(lib_err)?;
        Ok(self.view(v.ptr, Elem::U8, vec![v.rows, v.row_bytes as i64]))
    }
    /// `layer`'s rows as a paged attention kernel takes them (FlashMLA's `k_cache`): a
    /// uint8 view `[pages, page_rows, 1, row_bytes]` from the page holding the layer's first
    /// row, and the shift to add to the layer's view indices (`Pool::page_view`). `page_rows`
    /// defaults to the row format's kernel page (`PoolSpec::kernel_page_rows`: 64, or 2 for
    /// `flashmla-v4-p2`).
    #[pyo3(signature = (layer, plane=0, page_rows=None))]
    fn page_view(&self, layer: usize, plane: usize, page_rows: Option<i64>) -> PyResult<(DeviceView, i64)> {
        let page_rows = page_rows.unwrap_or_else(|| self.pool().spec().kernel_page_rows());
        let v = self.pool().page_view(layer, plane, page_rows).map_err(lib_err)?;
        let shape = vec![v.pages, v.page_rows, 1, v.row_bytes as i64];
        Ok((self.view(v.ptr, Elem::U8, shape), v.row_shift))
    }
    /// CSA layer `rank`'s indexer K cache (its rank among the CSA layers) in indexer pool
    /// `part` (FP8 and BF16: 0; FP4: 0 data, 1 scales): `[blocks, 64, 128]` bfloat16 for a bf16
    /// cache, else `[blocks, 64, row bytes]` uint8; block `b` is the pool's block id `b`.
    #[pyo3(signature = (rank, part=0))]
    fn indexer_view(&self, rank: usize, part: usize) -> PyResult<DeviceView> {
        let v = self.pool().indexer_view(rank, part).map_err(lib_err)?;
        let bf16 = self.pool().spec().indexer == Some(crate::sizing::IndexerDtype::Bf16);
        let (elem, cols) = if bf16 { (Elem::Bf16, v.row_bytes / 2) } else { (Elem::U8, v.row_bytes) };
        Ok(self.view(v.ptr, elem, vec![v.blocks as i64, v.rows_per_block as i64, cols as i64]))
    }

    /// Names of the compressor-state fields.
    fn state_fields(&self) -> Vec<String> {
        self.pool().spec().arena.fields().iter().map(|f| f.name.clone()).collect()
    }

    /// One state field over every position: `[layers, positions, *shape]`, float32 or
    /// bfloat16, strided as it sits in the slots.
    fn state_view(&self, field: &str) -> PyResult<DeviceView> {
        let (ptr, v) = self.pool().state_view(field).map_err(lib_err)?;
        let elem = match v.dtype {
            Dtype::F32 => Elem::F32,
            Dtype::Bf16 => Elem::Bf16,
            Dtype::I64 => Elem::I64,
        };
        let mut view = self.view(ptr, elem, v.dims.iter().map(|&d| d as i64).collect());
        view.strides = v.strides.iter().map(|&s| s as i64).collect();
        Ok(view)
    }

    fn alloc_slot(&self) -> PyResult<Slot> {
        let s = self.pool().alloc_slot().map_err(lib_err)?;
        Ok(Slot::from_handle(s.handle, s.position))
    }
    fn free_slot(&self, slot: &Slot) -> PyResult<()> {
        self.pool().free_slot(slot.handle()).map_err(lib_err)
    }
    /// Current position of a held slot.
    fn slot_position(&self, slot: &Slot) -> PyResult<i64> {
        self.pool().slot_position(slot.handle()).map_err(lib_err)
    }
    fn alloc_block(&self) -> PyResult<Block> {
        Ok(Block::from_handle(self.pool().alloc_block().map_err(lib_err)?.handle))
    }
    fn free_block(&self, block: &Block) -> PyResult<()> {
        self.pool().free_block(block.handle()).map_err(lib_err)
    }
    fn check_block(&self, block: &Block) -> PyResult<()> {
        self.pool().check_block(block.handle()).map_err(lib_err)
    }

    /// Allocator counts now.
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.pool().counts().map_err(lib_err)?;
        Ok(super::py_dict!(py, {
            "num_blocks" => c.num_blocks,
            "num_slots" => c.num_slots,
            "free_blocks" => c.free_blocks,
            "free_slots" => c.free_slots,
            "max_blocks" => c.max_blocks,
            "slot_positions" => c.slot_positions,
        }))
    }

    /// Live slot positions `(first, end)` at the current split.
    fn live_positions(&self) -> PyResult<(i64, i64)> {
        let r = self.pool().with_boundary(|b| b.live_positions()).map_err(lib_err)?;
        Ok((r.start, r.end))
    }

    fn grow_slots<'py>(&self, py: Python<'py>, n: u32) -> PyResult<Bound<'py, PyDict>> {
        change_dict(py, &self.pool().grow_slots(n).map_err(lib_err)?)
    }
    fn shrink_slots<'py>(&self, py: Python<'py>, n: u32) -> PyResult<Bound<'py, PyDict>> {
        change_dict(py, &self.pool().shrink_slots(n).map_err(lib_err)?)
    }
    fn grow_blocks<'py>(&self, py: Python<'py>, n: u32) -> PyResult<Bound<'py, PyDict>> {
        change_dict(py, &self.pool().grow_blocks(n).map_err(lib_err)?)
    }
    fn shrink_blocks<'py>(&self, py: Python<'py>, n: u32) -> PyResult<Bound<'py, PyDict>> {
        change_dict(py, &self.pool().shrink_blocks(n).map_err(lib_err)?)
    }
    fn resize<'py>(&self, py: Python<'py>, num_blocks: u32, num_slots: u32) -> PyResult<Bound<'py, PyDict>> {
        change_dict(py, &self.pool().resize(num_blocks, num_slots).map_err(lib_err)?)
    }

    /// Row of `layer`'s view holding ring entry `ring_pos` of the slot at `position`.
    fn window_index(&self, layer: usize, position: i64, ring_pos: i64) -> PyResult<i64> {
        let g = self.pool().geometry().map_err(lib_err)?;
        g.window_index(layer, position, ring_pos).map_err(lib_err)
    }
    /// Row of `layer`'s view holding compressed row `row` of block `block`.
    fn compress_index(&self, layer: usize, block: i64, row: i64) -> PyResult<i64> {
        let g = self.pool().geometry().map_err(lib_err)?;
        g.compress_index(layer, block, row).map_err(lib_err)
    }
    /// Plane row of `layer`'s view row `index`.
    fn absolute_row(&self, layer: usize, index: i64) -> PyResult<i64> {
        let g = self.pool().geometry().map_err(lib_err)?;
        g.absolute_row(layer, index).map_err(lib_err)
    }

    /// Bytes `offset .. offset + nbytes` of a plane (waits for the pool's stream).
    fn read_plane<'py>(
        &self,
        py: Python<'py>,
        plane: usize,
        offset: u64,
        nbytes: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        // The range is checked against the plane before a byte is allocated for it.
        let limit = self.pool().plane_bytes(plane).map_err(lib_err)?;
        if offset.checked_add(nbytes as u64).is_none_or(|end| end > limit) {
            return Err(lib_err(crate::pool::PoolError::PlaneRange {
                plane,
                offset,
                len: nbytes as u64,
                plane_bytes: limit,
            }));
        }
        let mut buf = vec![0u8; nbytes];
        self.pool().read_plane(plane, offset, &mut buf).map_err(lib_err)?;
        Ok(PyBytes::new(py, &buf))
    }
    /// Write bytes into a plane at `offset` (stream-ordered).
    /// The whole units of `blocks` (every plane, then every indexer layer, part-major: the
    /// bytes a tier stores for them).
    fn read_units<'py>(
        &self,
        py: Python<'py>,
        blocks: Vec<PyRef<'py, Block>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let h: Vec<_> = blocks.iter().map(|b| b.handle()).collect();
        let bytes = py.detach(|| crate::transfer::host_tier::read_units(self.pool(), &h)).map_err(lib_err)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Write `data` (as `read_units` returns it) over the whole units of `blocks`.
    fn write_units(&self, py: Python<'_>, blocks: Vec<PyRef<'_, Block>>, data: &[u8]) -> PyResult<()> {
        let h: Vec<_> = blocks.iter().map(|b| b.handle()).collect();
        py.detach(|| crate::transfer::host_tier::write_units(self.pool(), &h, data)).map_err(lib_err)
    }

    fn write_plane(&self, plane: usize, offset: u64, data: &[u8]) -> PyResult<()> {
        self.pool().write_plane(plane, offset, data).map_err(lib_err)
    }

    /// A held slot's checkpoint image (carried state and window rows) as
    /// `(layout_id, data)`; a restore checks both against the pool.
    fn checkpoint<'py>(&self, py: Python<'py>, slot: &Slot) -> PyResult<(String, Bound<'py, PyBytes>)> {
        let image = self.pool().checkpoint(slot.handle()).map_err(lib_err)?;
        Ok((image.layout_id().to_string(), PyBytes::new(py, image.bytes())))
    }
    /// Restore a held slot from a `checkpoint` image.
    fn restore(&self, slot: &Slot, layout_id: &str, data: &[u8]) -> PyResult<()> {
        let image = CheckpointImage::new(LayoutId::new(layout_id), data.to_vec());
        self.pool().restore(slot.handle(), &image).map_err(lib_err)
    }

    /// Wait for the pool's stream.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let pool = &self.hold.pool;
        py.detach(|| pool.backend().synchronize(pool.stream())).map_err(lib_err)
    }

    /// Persistent decode index buffers for this pool. Defaults: one token per sequence
    /// plus the plan's speculative steps, the model's window and top-k, one CSA copy.
    /// `flashmla`: write FlashMLA's convention instead of CSR (index-buffers.md §3f): `True` for
    /// the narrowest widths, or `(topk, csa_extra_topk, hca_extra_topk)` (multiples of 64);
    /// `Decode.flashmla(layer)` then gives a layer's operands (a CSA layer's after
    /// `Decode.csa_pack`).
    #[pyo3(signature = (max_seqs, max_blocks_per_seq, *, max_tokens=None, win=None, index_topk=None, flashmla=None))]
    fn decode(
        &self,
        max_seqs: usize,
        max_blocks_per_seq: usize,
        max_tokens: Option<usize>,
        win: Option<i32>,
        index_topk: Option<i32>,
        flashmla: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyDecode> {
        let pool = &self.hold.pool;
        let per_seq = 1 + usize::try_from(pool.kv_spec().map_err(lib_err)?.spec_steps()).unwrap_or(0);
        let max_tokens = max_tokens.unwrap_or(max_seqs.saturating_mul(per_seq));
        let mut cap =
            DecodeCapacity::for_pool(pool, max_seqs, max_tokens, max_blocks_per_seq).map_err(lib_err)?;
        cap.win = win.unwrap_or(cap.win);
        cap.index_topk = index_topk.unwrap_or(cap.index_topk);
        let step = decode_path_of(&self.hold.pool, cap, flashmla)?;
        let topk =
            CsaTopk::new(&self.hold.pool, cap.max_tokens, cap.index_topk.max(0) as usize).map_err(lib_err)?;
        let step = Arc::new(Mutex::new(step));
        let keep: Keep = Arc::new((step.clone(), self.hold.clone()));
        Ok(PyDecode { step, topk, hold: self.hold.clone(), device: self.device, keep })
    }

    fn __repr__(&self) -> String {
        let p = self.pool();
        format!(
            "Pool(backend={}, planes={:?}, plane_rows={})",
            p.backend().kind(),
            p.spec().plane_widths,
            self.plane_rows()
        )
    }
}

/// An integer array argument of rank `ndim` (1: one value per sequence or column; 2: rows of
/// a table), copied into `tmp`: anything exporting the buffer protocol (numpy arrays; read
/// through Python's own `memoryview`, so the memory is what the exporter proves, never a
/// stated pointer) of element format `format` and C-contiguous; anything else as a sequence
/// of ints (then 1-D). Returns the elements and the shape.
///
/// The rank is checked here, not in the library: the library takes each field as a slice,
/// which has no rank, and this reader is the one place an N-D array becomes one (`tobytes`
/// flattens); a `[1, 1]` positions array passed through would be staged as one position.
fn int_array<'a, T: bytemuck::Pod>(
    obj: &Bound<'_, PyAny>,
    format: &str,
    ndim: usize,
    tmp: &'a mut Vec<T>,
    extract: fn(&Bound<'_, PyAny>) -> PyResult<Vec<T>>,
) -> PyResult<(&'a [T], Vec<usize>)> {
    let py = obj.py();
    let memoryview = py.import("builtins")?.getattr("memoryview")?;
    let Ok(mv) = memoryview.call1((obj,)) else {
        if ndim != 1 {
            return Err(PyValueError::new_err(format!("expected a {ndim}-D {format} array, got a sequence")));
        }
        *tmp = extract(obj)?;
        let n = tmp.len();
        return Ok((tmp.as_slice(), vec![n]));
    };
    let fmt: String = mv.getattr("format")?.extract()?;
    let itemsize: usize = mv.getattr("itemsize")?.extract()?;
    // Native little-endian integers of T's size: numpy writes 'l'/'q' for int64, 'i' for int32.
    let ok_fmt = match format {
        I64 => matches!(fmt.as_str(), "l" | "q" | "<l" | "<q" | "=l" | "=q"),
        _ => matches!(fmt.as_str(), "i" | "<i" | "=i"),
    };
    if !ok_fmt || itemsize != std::mem::size_of::<T>() || !cfg!(target_endian = "little") {
        return Err(PyTypeError::new_err(format!(
            "expected a C-contiguous {format} array, got buffer format {fmt:?} of {itemsize}-byte items \
             (use numpy.ascontiguousarray(x, dtype=...))"
        )));
    }
    if !mv.getattr("c_contiguous")?.extract::<bool>()? {
        return Err(PyTypeError::new_err(format!("expected a C-contiguous {format} array")));
    }
    let shape: Vec<usize> = mv.getattr("shape")?.extract()?;
    if shape.len() != ndim {
        return Err(PyValueError::new_err(format!(
            "expected a {ndim}-D {format} array, got shape {shape:?} (not flattened)"
        )));
    }
    let bytes = mv.call_method0("tobytes")?;
    let bytes = bytes.cast::<PyBytes>()?.as_bytes();
    let n = bytes.len() / std::mem::size_of::<T>();
    if shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(n) {
        return Err(PyValueError::new_err("the buffer's shape does not match its bytes"));
    }
    tmp.clear();
    tmp.resize(n, T::zeroed());
    bytemuck::cast_slice_mut::<T, u8>(tmp).copy_from_slice(bytes);
    Ok((tmp.as_slice(), shape))
}

fn i64s(o: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    o.extract()
}
fn i32s(o: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    o.extract()
}

/// A decode batch of the arrays given, `block_tables` (2-D `[batch, columns]` int32, copied
/// into `tmp`) or `None` for resident tables.
fn flat_batch<'a>(
    positions: &'a [i64],
    context_lens: &'a [i64],
    num_tokens: &'a [i64],
    block_tables: Option<&Bound<'_, PyAny>>,
    tmp: &'a mut Vec<i32>,
) -> PyResult<FlatDecodeBatch<'a>> {
    let (block_tables, table_stride) = match block_tables {
        Some(t) => {
            // `[batch, columns]`, a 2-D array (a list of lists is no buffer).
            let (flat, shape) = int_array(t, I32, 2, tmp, i32s)?;
            (Some(flat), shape[1])
        }
        None => (None, 0),
    };
    Ok(FlatDecodeBatch { positions, context_lens, num_tokens, block_tables, table_stride })
}

const I64: &str = "<i8";
const I32: &str = "<i4";

/// A decode capacity as `Decode.capacity()` / `Forward.capacity()` return it.
pub(super) fn capacity_dict<'py>(py: Python<'py>, c: &DecodeCapacity) -> PyResult<Bound<'py, PyDict>> {
    Ok(super::py_dict!(py, {
        "max_seqs" => c.max_seqs,
        "max_tokens" => c.max_tokens,
        "max_blocks_per_seq" => c.max_blocks_per_seq,
        "win" => c.win,
        "index_topk" => c.index_topk,
    }))
}

/// Decode index buffers of one pool: `stage` a batch, `build` on a stream (capturable),
/// and the buffers as int32 DLPack views.
#[pyclass(module = "v4pool", name = "Decode", frozen)]
pub struct PyDecode {
    step: Arc<Mutex<DecodePath>>,
    /// The checked top-k staging of `csa_pack`.
    topk: CsaTopk,
    hold: Arc<Hold>,
    device: DLDevice,
    keep: Keep,
}

impl PyDecode {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, DecodePath>> {
        self.step.lock().map_err(|_| error("Poisoned", "decode buffers' lock poisoned".into()))
    }

    /// An int32 view of `b` (`None`: the geometry lacks `class`).
    fn view(&self, class: Class, b: Option<DeviceBuffer>) -> PyResult<DeviceView> {
        let b = b.ok_or(DecodeError::MissingClass(class)).map_err(lib_err)?;
        let mut v =
            DeviceView::contiguous(b.ptr, Elem::I32, vec![b.len as i64], self.device, self.keep.clone());
        v.sync = Some(sync_fn(&self.hold));
        Ok(v)
    }

    fn class(&self, cls: &str) -> PyResult<Class> {
        Class::from_name(cls)
            .ok_or_else(|| PyValueError::new_err(format!("class {cls:?}: one of dense, csa, hca")))
    }
}

#[pymethods]
impl PyDecode {
    /// Stage one step: per sequence its slot position, context length after the step and
    /// tokens this step (default 1); `block_tables` an int32 `[batch, columns]` array, or
    /// None when the tables are resident (`write_block_table`). One host-to-device copy on
    /// `stream` (default: the pool's). Returns the real token count.
    #[pyo3(signature = (positions, context_lens, num_tokens=None, block_tables=None))]
    fn stage(
        &self,
        positions: &Bound<'_, PyAny>,
        context_lens: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
        block_tables: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let (mut t0, mut t1, mut t2, mut t3) = (Vec::new(), Vec::new(), Vec::new(), Vec::<i32>::new());
        let (positions, _) = int_array(positions, I64, 1, &mut t0, i64s)?;
        let (context_lens, _) = int_array(context_lens, I64, 1, &mut t1, i64s)?;
        let ones;
        let num_tokens = match num_tokens {
            Some(n) => int_array(n, I64, 1, &mut t2, i64s)?.0,
            None => {
                ones = vec![1i64; positions.len()];
                &ones
            }
        };
        let batch = flat_batch(positions, context_lens, num_tokens, block_tables, &mut t3)?;
        self.lock()?.stage_flat(&batch).map_err(lib_err)
    }

    /// Write batch row `row`'s device block table from column `start_col`.
    #[pyo3(signature = (row, ids, start_col=0))]
    fn write_block_table(&self, row: usize, ids: &Bound<'_, PyAny>, start_col: usize) -> PyResult<()> {
        let mut tmp = Vec::new();
        let (ids, _) = int_array(ids, I32, 1, &mut tmp, i32s)?;
        self.lock()?.write_block_table(row, start_col, ids).map_err(lib_err)
    }

    /// Queue the index build on `stream` (an int handle or a `torch.cuda.Stream`; default
    /// the pool's). One launch with fixed pointers: capturable in `torch.cuda.graph`.
    #[pyo3(signature = (stream=None))]
    fn build(&self, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let stream = stream_arg(stream, self.hold.pool.stream())?;
        self.lock()?.build_on(stream).map_err(lib_err)
    }

    /// Class `cls`'s index buffer (`dense`, `csa`, `hca`), int32 `[max_tokens × slice
    /// capacity]`. Token `t`'s rows are `indices[indptr[t]:indptr[t+1]]`.
    fn indices(&self, cls: &str) -> PyResult<DeviceView> {
        let c = self.class(cls)?;
        self.view(c, self.lock()?.indices(c))
    }
    /// Class `cls`'s indptr, int32 `[max_tokens + 1]`.
    fn indptr(&self, cls: &str) -> PyResult<DeviceView> {
        let c = self.class(cls)?;
        self.view(c, self.lock()?.indptr(c))
    }
    /// Class `cls`'s destination rows (where each token's new row goes), int32 `[max_tokens]`.
    fn dest_rows(&self, cls: &str) -> PyResult<DeviceView> {
        let c = self.class(cls)?;
        self.view(c, self.lock()?.dest_rows(c))
    }

    /// Layer `layer`'s FlashMLA operands (a `decode(..., flashmla=...)` buffer set): a dict of
    /// int32 views `indices [max_tokens, topk]`, `topk_length [max_tokens]` (per token),
    /// `seq_topk_length [max_seqs]`, and for a compressed layer `extra_indices [max_tokens,
    /// extra_topk]`, `extra_topk_length [max_tokens]`, `seq_extra_topk_length [max_seqs]`; plus
    /// the layer's `shift` (already in every index). Hand FlashMLA `Pool.page_view(layer)` as
    /// `k_cache` and `extra_k_cache`.
    ///
    /// FlashMLA's shapes: with every sequence staging `s_q` tokens (MTP: 1 + draft tokens) and
    /// `B` sequences, `indices[:B * s_q].view(B, s_q, topk)` and `seq_topk_length[:B]` are its
    /// `indices` and `topk_length` (likewise the extra ones): a batch entry's tokens share one
    /// length, the longest of theirs, and each token's row is -1 from its own length on, which
    /// FlashMLA skips. The per-token lengths are for kernels that take one query a row.
    ///
    /// A CSA layer's compressed part is what `csa_pack` wrote since the last `build`: each
    /// build resets it to -1 with length 0, so an unpacked layer names no rows (never row 0,
    /// never the previous step's pack); pack each CSA layer before its attention.
    fn flashmla<'py>(&self, py: Python<'py>, layer: usize) -> PyResult<Bound<'py, PyDict>> {
        let ops = self.lock()?.flashmla(layer).map_err(lib_err)?;
        flashmla_dict(py, &ops, self.device, &self.keep, Some(sync_fn(&self.hold)))
    }

    /// One CSA layer's translate-pack (after `build`, before the layer's attention) from the
    /// indexer's top-k: a C-contiguous int32 or int64 array `[staged tokens, width]`, each row
    /// `[valid ids | -1]` (transformers' form; the first `min((pos + 1) // 4, index_topk)`
    /// entries must be ids of the token's visible CSA entries, else a typed error and nothing
    /// packed). CSR mode: the CSA heads of `indices("csa")`; FlashMLA mode: the CSA layer's
    /// `extra_indices` and lengths. Every CSA layer overwrites the one CSA buffer in turn.
    fn csa_pack(&self, topk: &Bound<'_, PyAny>) -> PyResult<()> {
        let step = self.lock()?;
        let (mut t32, mut t64) = (Vec::<i32>::new(), Vec::<i64>::new());
        let (rows, width) = match int_array(topk, I32, 2, &mut t32, i32s) {
            Ok((flat, shape)) => (TopkRows::I32(flat), shape[1]),
            Err(_) => {
                let (flat, shape) = int_array(topk, I64, 2, &mut t64, i64s)?;
                (TopkRows::I64(flat), shape[1])
            }
        };
        self.topk.pack_decode(&step, rows, width).map_err(lib_err)
    }

    /// The capacities the buffers were sized for.
    fn capacity<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        capacity_dict(py, &self.lock()?.capacity())
    }

    /// Wait for every stream the buffers were used on.
    fn synchronize(&self) -> PyResult<()> {
        self.lock()?.synchronize().map_err(lib_err)
    }

    /// Mean seconds of `iters` stage + build calls made from Rust on the same arrays (the
    /// baseline the Python-call overhead is measured against; see the bench script).
    /// `block_tables=None` times the resident-table path; `build=False` times staging alone.
    #[pyo3(signature = (positions, context_lens, num_tokens, block_tables=None, iters=1000, build=true))]
    #[allow(clippy::too_many_arguments)]
    fn time_stage_build(
        &self,
        positions: &Bound<'_, PyAny>,
        context_lens: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
        block_tables: Option<&Bound<'_, PyAny>>,
        iters: u32,
        build: bool,
    ) -> PyResult<f64> {
        let (mut t0, mut t1, mut t2, mut t3) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (positions, _) = int_array(positions, I64, 1, &mut t0, i64s)?;
        let (context_lens, _) = int_array(context_lens, I64, 1, &mut t1, i64s)?;
        let (num_tokens, _) = int_array(num_tokens, I64, 1, &mut t2, i64s)?;
        let batch = flat_batch(positions, context_lens, num_tokens, block_tables, &mut t3)?;
        let mut step = self.lock()?;
        let start = std::time::Instant::now();
        for _ in 0..iters.max(1) {
            step.stage_flat(&batch).map_err(lib_err)?;
            if build {
                step.build().map_err(lib_err)?;
            }
        }
        Ok(start.elapsed().as_secs_f64() / f64::from(iters.max(1)))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPool>()?;
    m.add_class::<PyDecode>()?;
    m.add_class::<Slot>()?;
    m.add_class::<Block>()?;
    Ok(())
}
