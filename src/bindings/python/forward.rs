//! `v4pool.Forward`: every pool-side step of a DeepSeek-V4 forward on one pool, for an engine
//! (or `v4pool.hf`) driving a model from Python. A thin translation over the library: the
//! decode path (`DecodePath`), the prefill path, the KV row writer and the checked CSA top-k
//! pack; tensors arrive as `torch.Tensor`s (`tensor.rs`), checked before any launch.

use super::dlpack::{DLDevice, DeviceView, Elem, Keep, DL_CPU};
use super::pool::{Block, PyPool, Slot};
use super::tensor::elem_type_from_dlpack;
use super::tensor::{tensor, Tensor, DL_BFLOAT, DL_INT};
use super::{error, lib_err};
use crate::geometry::Class;
use crate::index::KV_ROW_VALUES;
use crate::pool::{
    CompressedRow, CsaTopk, DecodeCapacity, DecodeError, DecodePath, FlatDecodeBatch, KvRowWriter, Pool,
    PrefillBuffer, PrefillCapacity, PrefillPath, PrefillSeq, RowSet, RowWriteCapacity, TopkRows, WindowSeq,
    INDEX_KEY_VALUES,
};
use crate::state::gather::{GatherCapacity, GatherSeq, WindowGather};
use crate::state::inputs::{HostStateInputs, StateStaging};
use crate::state::update::{Compressor, StateInputs, StateSeq, StateUpdate, StateUpdateCapacity};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex, MutexGuard};

type Shared<T> = Arc<Mutex<T>>;

/// The pool-side steps of a forward on one pool: `Forward(pool, max_seqs, max_tokens,
/// max_blocks_per_seq, *, prefill_tokens=None, hca_entries=None, win=None, index_topk=None,
/// gather_window=None)` (`gather_window`: rows per sequence of the §9 window gather's own
/// output, default `win`).
#[pyclass(module = "v4pool", name = "Forward", frozen)]
pub struct PyForward {
    pool: Arc<Pool>,
    device: DLDevice,
    decode: Shared<DecodePath>,
    prefill: Shared<PrefillPath>,
    writer: Shared<KvRowWriter>,
    topk: CsaTopk,
    state: Shared<(StateUpdate, StateStaging)>,
    gather: Shared<WindowGather>,
    max_blocks_per_seq: usize,
    keep: Keep,
}

fn lock<T>(m: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
    m.lock().map_err(|_| error("Poisoned", "forward buffers' lock poisoned".into()))
}

fn class_arg(cls: &str) -> PyResult<Class> {
    Class::from_name(cls)
        .ok_or_else(|| PyValueError::new_err(format!("class {cls:?}: one of dense, csa, hca")))
}

/// Block tables as one flat row-major array of `stride` columns (missing columns 0, never read).
fn flat_tables(tables: &[Vec<i32>], stride: usize) -> PyResult<Vec<i32>> {
    let mut flat = vec![0i32; tables.len() * stride];
    for (b, row) in tables.iter().enumerate() {
        if row.len() > stride {
            return Err(error(
                "BlockTableTooLong",
                format!("block table {b} has {} columns, more than {stride}", row.len()),
            ));
        }
        flat[b * stride..b * stride + row.len()].copy_from_slice(row);
    }
    Ok(flat)
}

impl PyForward {
    fn view(&self, buf: crate::pool::DeviceBuffer, elem: Elem) -> DeviceView {
        DeviceView::contiguous(buf.ptr, elem, vec![buf.len as i64], self.device, self.keep.clone())
    }

    /// A bf16 KV tensor `[tokens, >= 512]` on the pool's device, and how the writer reads it.
    fn kv<'py>(
        &self,
        kv: &Bound<'py, PyAny>,
        tokens: Option<usize>,
    ) -> PyResult<(Tensor<'py>, usize, usize)> {
        let t = tensor(kv, "kv")?;
        let (rows, _, stride) = t.rows("kv", DL_BFLOAT, 16, KV_ROW_VALUES as i64)?;
        if let Some(n) = tokens.filter(|&n| n != rows) {
            return Err(error("BadTensor", format!("kv: {rows} rows, the staged batch has {n} tokens")));
        }
        self.check_device(&t, "kv")?;
        Ok((t, rows, stride))
    }

    /// `t` lies on the pool's device.
    fn check_device(&self, t: &Tensor<'_>, name: &str) -> PyResult<()> {
        if t.device.device_type != self.device.device_type
            || (self.device.device_type != DL_CPU && t.device.device_id != self.device.device_id)
        {
            return Err(error(
                "BadTensor",
                format!(
                    "{name}: device {:?} is not the pool's {:?}",
                    (t.device.device_type, t.device.device_id),
                    (self.device.device_type, self.device.device_id)
                ),
            ));
        }
        Ok(())
    }

    /// Write `kv` through the writer: host memory on the host backend, the device address on a
    /// GPU backend.
    fn write_kv(
        &self,
        kv: &Bound<'_, PyAny>,
        tokens: Option<usize>,
        host: impl FnOnce(&KvRowWriter, &[u16], usize) -> PyResult<()>,
        device: impl FnOnce(&KvRowWriter, u64, usize) -> PyResult<()>,
    ) -> PyResult<()> {
        let (t, rows, stride) = self.kv(kv, tokens)?;
        let w = lock(&self.writer)?;
        if self.device.device_type == DL_CPU {
            // SAFETY: checked bf16 rows (u16 bits) of `t`, used only inside this call.
            let s = unsafe { t.host_slice::<u16>("kv", rows, KV_ROW_VALUES, stride)? };
            host(&w, s, stride)
        } else {
            device(&w, t.ptr, stride)
        }
    }

    /// The engine's top-k tensor `[tokens, width]` (int32 or int64, any device: read on the
    /// host, where the library checks and converts it).
    fn with_topk<R>(
        &self,
        topk: &Bound<'_, PyAny>,
        f: impl FnOnce(TopkRows<'_>, usize) -> PyResult<R>,
    ) -> PyResult<R> {
        let on_host = topk.call_method0("cpu")?.call_method0("contiguous")?;
        let t = tensor(&on_host, "topk")?;
        let bits = t.bits;
        let (rows, cols, stride) = t.rows("topk", DL_INT, bits, 0)?;
        if bits != 32 && bits != 64 {
            return Err(error("BadTensor", format!("topk: int{bits}, expected int32 or int64")));
        }
        // SAFETY: checked rows of `on_host` (held by `t`'s capsule) of the element type read.
        unsafe {
            if bits == 64 {
                f(TopkRows::I64(t.host_slice::<i64>("topk", rows, cols, stride)?), cols)
            } else {
                f(TopkRows::I32(t.host_slice::<i32>("topk", rows, cols, stride)?), cols)
            }
        }
    }
}

#[pymethods]
impl PyForward {
    #[new]
    #[pyo3(signature = (pool, max_seqs, max_tokens, max_blocks_per_seq, *, prefill_tokens=None, hca_entries=None, win=None, index_topk=None, gather_window=None, flashmla=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        pool: &Bound<'_, PyPool>,
        max_seqs: usize,
        max_tokens: usize,
        max_blocks_per_seq: usize,
        prefill_tokens: Option<usize>,
        hca_entries: Option<u64>,
        win: Option<i32>,
        index_topk: Option<i32>,
        gather_window: Option<usize>,
        flashmla: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyForward> {
        let p = pool.get();
        let (arc, hold) = p.shared();
        let device = p.dl_device();
        let prefill_tokens = prefill_tokens.unwrap_or(max_tokens);
        // The window and top-k default to the pool's spec (the model's), as `Pool.decode`'s do.
        let mut dcap =
            DecodeCapacity::for_pool(&arc, max_seqs, max_tokens, max_blocks_per_seq).map_err(lib_err)?;
        dcap.win = win.unwrap_or(dcap.win);
        dcap.index_topk = index_topk.unwrap_or(dcap.index_topk);
        let (win, index_topk) = (dcap.win, dcap.index_topk);
        // FlashMLA's convention when asked (`Pool.decode`'s `flashmla`): the build and every
        // `decode_csa_pack` then write FlashMLA's operands, `flashmla(layer)` names them.
        let decode = super::pool::decode_path_of(&arc, dcap, flashmla)?;
        let pcap = PrefillCapacity {
            win,
            index_topk,
            max_hca_entries: hca_entries,
            ..PrefillCapacity::for_pool(&arc, max_seqs, prefill_tokens, max_blocks_per_seq)
                .map_err(lib_err)?
        };
        let prefill = arc.prefill_path(pcap).map_err(lib_err)?;
        let writer = arc
            .kv_row_writer(RowWriteCapacity { max_tokens: max_tokens.max(prefill_tokens) })
            .map_err(lib_err)?;
        let topk = CsaTopk::new(&arc, max_tokens.max(prefill_tokens), index_topk.max(0) as usize)
            .map_err(lib_err)?;
        let scap = StateUpdateCapacity { max_seqs, max_tokens: max_tokens.max(prefill_tokens) };
        let update = arc.state_update(scap).map_err(lib_err)?;
        // The widest compressor row is CSA main's 1,024; the largest bias table HCA's 128 rows.
        let staging = StateStaging::new(&arc, scap.max_tokens, 1024, 128).map_err(lib_err)?;
        let state = Arc::new(Mutex::new((update, staging)));
        let out_window = gather_window.unwrap_or(win.max(0) as usize);
        let gather = Arc::new(Mutex::new(
            arc.window_gather(GatherCapacity { max_seqs, out_window }).map_err(lib_err)?,
        ));
        let decode = Arc::new(Mutex::new(decode));
        let prefill = Arc::new(Mutex::new(prefill));
        let writer = Arc::new(Mutex::new(writer));
        let keep: Keep = Arc::new((decode.clone(), prefill.clone(), gather.clone(), hold.clone()));
        Ok(PyForward {
            pool: arc,
            device,
            decode,
            prefill,
            writer,
            topk,
            state,
            gather,
            max_blocks_per_seq,
            keep,
        })
    }

    /// The decode capacities the buffers were sized for (`Decode.capacity()`'s dict; the
    /// prefill path takes the same window and top-k).
    fn capacity<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        super::pool::capacity_dict(py, &lock(&self.decode)?.capacity())
    }

    /// Whether the pool packs fp8 rows (else bf16 rows).
    #[getter]
    fn fp8(&self) -> PyResult<bool> {
        Ok(lock(&self.writer)?.is_fp8())
    }

    // ---- decode -------------------------------------------------------------------------

    /// Stage one decode step: per sequence its slot position, context length after the step,
    /// tokens this step (default 1) and block table (a list of block ids). Returns the tokens.
    #[pyo3(signature = (positions, context_lens, block_tables, num_tokens=None))]
    fn decode_stage(
        &self,
        positions: Vec<i64>,
        context_lens: Vec<i64>,
        block_tables: Vec<Vec<i32>>,
        num_tokens: Option<Vec<i64>>,
    ) -> PyResult<usize> {
        let num_tokens = num_tokens.unwrap_or_else(|| vec![1; positions.len()]);
        let flat = flat_tables(&block_tables, self.max_blocks_per_seq)?;
        let batch = FlatDecodeBatch {
            positions: &positions,
            context_lens: &context_lens,
            num_tokens: &num_tokens,
            block_tables: Some(&flat),
            table_stride: self.max_blocks_per_seq,
        };
        lock(&self.decode)?.stage_flat(&batch).map_err(lib_err)
    }

    /// The decode build (one launch on the pool's stream): window tails, HCA heads, dest rows.
    fn decode_build(&self) -> PyResult<()> {
        lock(&self.decode)?.build().map_err(lib_err)
    }

    /// Layer `layer`'s FlashMLA operands after `decode_build` (and, for a CSA layer, its
    /// `decode_csa_pack`), of a Forward made with `flashmla=`: `Decode.flashmla`'s dict.
    fn flashmla<'py>(&self, py: Python<'py>, layer: usize) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let ops = lock(&self.decode)?.flashmla(layer).map_err(lib_err)?;
        super::pool::flashmla_dict(py, &ops, self.device, &self.keep, None)
    }

    /// A class's decode index buffer, indptr or destination rows (int32 views).
    fn decode_indices(&self, cls: &str) -> PyResult<DeviceView> {
        let d = lock(&self.decode)?;
        let c = class_arg(cls)?;
        let b = d.indices(c).ok_or(DecodeError::MissingClass(c)).map_err(lib_err)?;
        Ok(self.view(b, Elem::I32))
    }
    fn decode_indptr(&self, cls: &str) -> PyResult<DeviceView> {
        let d = lock(&self.decode)?;
        let c = class_arg(cls)?;
        let b = d.indptr(c).ok_or(DecodeError::MissingClass(c)).map_err(lib_err)?;
        Ok(self.view(b, Elem::I32))
    }

    /// One CSA layer's decode translate-pack from the indexer's top-k (`[tokens, width]`
    /// int32 or int64, e.g. transformers' `[valid | -1]` rows `min(index_topk, entries)` wide).
    fn decode_csa_pack(&self, topk: &Bound<'_, PyAny>) -> PyResult<()> {
        let d = lock(&self.decode)?;
        self.with_topk(topk, |rows, width| self.topk.pack_decode(&d, rows, width).map_err(lib_err))
    }

    /// A decode token's own rows at `layer`: `kv` `[staged tokens, 512]` bf16 to the build's
    /// destination rows of the layer's class (before the layer's attention).
    fn write_decode(&self, layer: usize, kv: &Bound<'_, PyAny>) -> PyResult<()> {
        let d = lock(&self.decode)?;
        let tokens = d.staged_tokens();
        self.write_kv(
            kv,
            Some(tokens),
            |w, s, stride| w.write_decode(&d, layer, s, stride).map_err(lib_err),
            // SAFETY: `ptr` is a checked bf16 tensor of the pool's device with `tokens` rows at
            // `stride`, alive for the call; the engine orders it before the pool's stream.
            |w, ptr, stride| unsafe { w.write_decode_from(&d, layer, ptr, stride) }.map_err(lib_err),
        )
    }

    // ---- prefill ------------------------------------------------------------------------

    /// Stage one prefill forward: per chunk its slot position, first position, tokens and
    /// block table (covering the context after the chunk). Returns the tokens.
    fn prefill_stage(
        &self,
        positions: Vec<i64>,
        chunk_starts: Vec<i64>,
        num_tokens: Vec<usize>,
        block_tables: Vec<Vec<i32>>,
    ) -> PyResult<usize> {
        let n = positions.len();
        if chunk_starts.len() != n || num_tokens.len() != n || block_tables.len() != n {
            return Err(error("BatchShape", "prefill arrays differ in length".into()));
        }
        let seqs: Vec<PrefillSeq<'_>> = (0..n)
            .map(|b| PrefillSeq {
                position: positions[b],
                chunk_start: chunk_starts[b],
                num_tokens: num_tokens[b],
                block_table: &block_tables[b],
            })
            .collect();
        lock(&self.prefill)?.stage(&seqs).map_err(lib_err)
    }

    /// The prefill build (one launch).
    fn prefill_build(&self) -> PyResult<()> {
        lock(&self.prefill)?.build().map_err(lib_err)
    }

    /// A prefill buffer as an int32 view: `extend_indices`, `extend_indptr`, or a class's
    /// prefix `indices` / `indptr` (`cls` = dense, csa, hca).
    #[pyo3(signature = (which, cls=None))]
    fn prefill_buffer(&self, which: &str, cls: Option<&str>) -> PyResult<DeviceView> {
        let buf = match (which, cls) {
            ("extend_indices", None) => PrefillBuffer::ExtendIndices,
            ("extend_indptr", None) => PrefillBuffer::ExtendIndptr,
            ("indices", Some(c)) => PrefillBuffer::Indices(class_arg(c)?),
            ("indptr", Some(c)) => PrefillBuffer::Indptr(class_arg(c)?),
            _ => return Err(PyValueError::new_err(format!("prefill buffer {which:?} (class {cls:?})"))),
        };
        let p = lock(&self.prefill)?;
        let b = p.buffer(buf).ok_or_else(|| error("MissingClass", format!("no {which} for {cls:?}")))?;
        Ok(self.view(b, Elem::I32))
    }

    /// One CSA layer's prefill translate-pack (top-k as in `decode_csa_pack`).
    fn prefill_csa_pack(&self, topk: &Bound<'_, PyAny>) -> PyResult<()> {
        let p = lock(&self.prefill)?;
        self.with_topk(topk, |rows, width| self.topk.pack_prefill(&p, rows, width).map_err(lib_err))
    }

    // ---- row writes ---------------------------------------------------------------------

    /// Stage a prefill forward's window rows (the ring write): per chunk its slot, first
    /// position and tokens; the KV of every chunk follows in batch order.
    fn stage_window(
        &self,
        slots: Vec<Slot>,
        first_positions: Vec<i64>,
        tokens: Vec<usize>,
    ) -> PyResult<usize> {
        if first_positions.len() != slots.len() || tokens.len() != slots.len() {
            return Err(error("BatchShape", "window arrays differ in length".into()));
        }
        let seqs: Vec<WindowSeq> = (0..slots.len())
            .map(|i| WindowSeq {
                slot: slots[i].handle(),
                first_position: first_positions[i],
                tokens: tokens[i],
            })
            .collect();
        lock(&self.writer)?.stage_window(&seqs).map_err(lib_err)
    }

    /// Stage a compressor's emitted entries of class `cls` (csa or hca): entry `i` at row
    /// `rows[i]` of block `blocks[i]`.
    fn stage_compressed(&self, cls: &str, blocks: Vec<Block>, rows: Vec<i64>) -> PyResult<usize> {
        if blocks.len() != rows.len() {
            return Err(error("BatchShape", "blocks and rows differ in length".into()));
        }
        let entries: Vec<CompressedRow> =
            blocks.iter().zip(&rows).map(|(b, &row)| CompressedRow { block: b.handle(), row }).collect();
        lock(&self.writer)?.stage_compressed(class_arg(cls)?, &entries).map_err(lib_err)
    }

    /// Write `kv` `[tokens, 512]` bf16 to the staged window rows of `layer` (after its attention).
    fn write_window(&self, layer: usize, kv: &Bound<'_, PyAny>) -> PyResult<()> {
        self.write_rows(layer, RowSet::Window, kv)
    }

    /// Write the indexer's keys `[entries, 128]` bf16 of the staged CSA entries (the same
    /// `stage_compressed("csa", ..)` as the main compressor's) to CSA layer `rank`'s indexer
    /// cache in its format (bf16 copied, FP8 / FP4 quantised by `v4pool_index_keys`; before the
    /// layer's indexer scores them).
    fn write_index_keys(&self, rank: usize, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let staged = lock(&self.writer)?.staged_rows(RowSet::Compressed(Class::Csa)).map_err(lib_err)?;
        let t = tensor(keys, "keys")?;
        let (rows, _, stride) = t.rows("keys", DL_BFLOAT, 16, INDEX_KEY_VALUES as i64)?;
        if rows != staged {
            return Err(error("BadTensor", format!("keys: {rows} rows, {staged} CSA entries staged")));
        }
        self.check_device(&t, "keys")?;
        let w = lock(&self.writer)?;
        if self.device.device_type == DL_CPU {
            // SAFETY: checked bf16 rows (u16 bits) of `t`, used only inside this call.
            let s = unsafe { t.host_slice::<u16>("keys", rows, INDEX_KEY_VALUES, stride)? };
            w.write_index_keys(rank, s, stride).map_err(lib_err)
        } else {
            // SAFETY: a checked bf16 tensor of the pool's device with exactly the staged rows
            // at `stride`, alive for the call; the engine orders it before the pool's stream.
            unsafe { w.write_index_keys_from(rank, t.ptr, stride) }.map_err(lib_err)
        }
    }

    /// Write `kv` `[entries, 512]` bf16 to the staged compressed rows at `layer` (before the
    /// indexer and attention that read them).
    fn write_compressed(&self, layer: usize, cls: &str, kv: &Bound<'_, PyAny>) -> PyResult<()> {
        self.write_rows(layer, RowSet::Compressed(class_arg(cls)?), kv)
    }

    // ---- compressor state (§8) ----------------------------------------------------------

    /// Stage a forward's compressor-state plan: per sequence its slot, the row of its first
    /// new token in the forward's compressor outputs, its new tokens' positions and its
    /// context length after the forward. Returns the live plan rows `[csa, hca]`.
    fn state_stage(
        &self,
        slots: Vec<Slot>,
        first_tokens: Vec<usize>,
        positions: Vec<Vec<i64>>,
        context_lens: Vec<i64>,
    ) -> PyResult<[usize; 2]> {
        let n = slots.len();
        if first_tokens.len() != n || positions.len() != n || context_lens.len() != n {
            return Err(error("BatchShape", "state arrays differ in length".into()));
        }
        let seqs: Vec<StateSeq<'_>> = (0..n)
            .map(|i| StateSeq {
                slot: slots[i].handle(),
                first_token: first_tokens[i],
                positions: &positions[i],
                context_len: context_lens[i],
            })
            .collect();
        lock(&self.state)?.0.stage(&seqs).map_err(lib_err)
    }

    /// Write `compressor`'s state (`csa_main`, `csa_idx`, `hca_main`) at `layer` (its ordinal
    /// among its class's layers) from the staged plan: `kv`, `score` `[rows, dim]` float32 or
    /// bfloat16 (the score without the bias), `ape` `[ratio, dim]`.
    fn state_update(
        &self,
        compressor: &str,
        layer: u64,
        kv: &Bound<'_, PyAny>,
        score: &Bound<'_, PyAny>,
        ape: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let comp = Compressor::from_name(compressor).ok_or_else(|| {
            PyValueError::new_err(format!("compressor {compressor:?}: csa_main, csa_idx or hca_main"))
        })?;
        let (kv, score, ape) = (tensor(kv, "kv")?, tensor(score, "score")?, tensor(ape, "ape")?);
        let dtype = elem_type_from_dlpack(kv.code, kv.bits)
            .ok_or_else(|| error("BadTensor", "kv: float32 or bfloat16 expected".into()))?;
        let ape_dtype = elem_type_from_dlpack(ape.code, ape.bits)
            .ok_or_else(|| error("BadTensor", "ape: float32 or bfloat16 expected".into()))?;
        let (rows, dim, kstride) = kv.rows("kv", kv.code, kv.bits, 1)?;
        let (srows, sdim, sstride) = score.rows("score", kv.code, kv.bits, 1)?;
        let (arows, adim, astride) = ape.rows("ape", ape.code, ape.bits, 1)?;
        if (srows, sdim) != (rows, dim) || adim != dim || arows as i64 != comp.ratio() || astride != adim {
            return Err(error(
                "BadTensor",
                format!("score [{srows}, {sdim}] and ape [{arows}, {adim}] must match kv [{rows}, {dim}] and [ratio, dim]"),
            ));
        }
        for t in [&kv, &score, &ape] {
            if t.device.device_type != self.device.device_type
                || (self.device.device_type != DL_CPU && t.device.device_id != self.device.device_id)
            {
                return Err(error("BadTensor", "compressor inputs must be on the pool's device".into()));
            }
        }
        let st = lock(&self.state)?;
        if self.device.device_type == DL_CPU {
            if kstride != dim || sstride != dim {
                return Err(error("BadTensor", "host compressor inputs must be contiguous".into()));
            }
            // SAFETY: checked CPU tensors of the element types read, used within this call.
            let (k, s, a) = unsafe {
                (
                    kv.host_slice::<u8>("kv", 1, rows * dim * dtype.size() as usize, 0)?,
                    score.host_slice::<u8>("score", 1, rows * dim * dtype.size() as usize, 0)?,
                    ape.host_slice::<u8>("ape", 1, arows * dim * ape_dtype.size() as usize, 0)?,
                )
            };
            let inputs = HostStateInputs { kv: k, score: s, ape: a, rows, dim, dtype, ape_dtype };
            st.0.update_from_host(&st.1, comp, layer, &inputs).map_err(lib_err)
        } else {
            let inputs = StateInputs {
                kv: kv.ptr,
                score: score.ptr,
                ape: ape.ptr,
                kv_row_stride: kstride as i64,
                score_row_stride: sstride as i64,
                rows: rows as i64,
                dim: dim as i64,
                dtype,
                ape_dtype,
            };
            // SAFETY: three checked tensors of the pool's device, of the shapes and element
            // types described, alive for the call; the engine orders them before the stream.
            unsafe { st.0.update(comp, layer, &inputs) }.map_err(lib_err)
        }
    }

    // ---- window gather (§9) -------------------------------------------------------------

    /// Stage a window gather: per sequence its slot, its anchor (the window's newest
    /// position) and optionally its context length (the anchor must be below it). Returns
    /// the batch size.
    #[pyo3(signature = (slots, anchors, context_lens=None))]
    fn gather_stage(
        &self,
        slots: Vec<Slot>,
        anchors: Vec<i64>,
        context_lens: Option<Vec<i64>>,
    ) -> PyResult<usize> {
        if anchors.len() != slots.len() || context_lens.as_ref().is_some_and(|c| c.len() != slots.len()) {
            return Err(error("BatchShape", "gather arrays differ in length".into()));
        }
        let seqs: Vec<GatherSeq> = (0..slots.len())
            .map(|i| GatherSeq {
                slot: slots[i].handle(),
                anchor: anchors[i],
                context_len: context_lens.as_ref().map(|c| c[i]),
            })
            .collect();
        lock(&self.gather)?.stage(&seqs).map_err(lib_err)
    }

    /// Gather `layer`'s window of `draft_window` rows for the staged batch (one launch on the
    /// pool's stream) into the handle's own output: a bf16 view `[staged, draft_window, 512]`
    /// (row `s` of sequence `b` is position `anchor_b - (draft_window - 1) + s`; zeros below
    /// position 0; fp8 rows dequantised). The next gather overwrites it.
    fn gather(&self, layer: usize, draft_window: usize) -> PyResult<DeviceView> {
        let mut g = lock(&self.gather)?;
        let buf = g.gather(layer, draft_window).map_err(lib_err)?;
        let shape = vec![g.staged() as i64, draft_window as i64, KV_ROW_VALUES as i64];
        Ok(DeviceView::contiguous(buf.ptr, Elem::Bf16, shape, self.device, self.keep.clone()))
    }

    /// Gather `layer`'s window of `draft_window` rows for the staged batch into `out`, an
    /// engine's tensor: bfloat16 `[max_seqs, draft_window, 512]`, contiguous, on the pool's
    /// device (row `s` of sequence `b` as in `gather`; rows of pad sequences past the staged
    /// batch untouched). Every argument is checked before the launch: dtype, shape, strides,
    /// device, alignment, and that `out` overlaps neither the pool's planes nor the gather's
    /// own buffers (`WindowGather::check_output`).
    fn gather_into(&self, layer: usize, draft_window: usize, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let g = lock(&self.gather)?;
        let t = tensor(out, "out")?;
        let max_seqs = g.capacity().max_seqs;
        let shape = [max_seqs as i64, draft_window as i64, KV_ROW_VALUES as i64];
        let bytes = t.contiguous("out", DL_BFLOAT, 16, &shape)?;
        self.check_device(&t, "out")?;
        g.check_output(draft_window, t.ptr, bytes).map_err(lib_err)?;
        if self.device.device_type != DL_CPU {
            // SAFETY: `out` is a checked bf16 tensor of the pool's device covering max_seqs x
            // draft_window rows, 16-B aligned, overlapping neither the pool's planes nor the
            // handle's buffers (check_output), alive for the call (the capsule in `t`); torch
            // orders its later use after the pool's stream (the engine shares the stream).
            return unsafe { g.gather_into(layer, draft_window, t.ptr) }.map_err(lib_err);
        }
        // The host backend accepts no memory it did not allocate: the gather goes through a
        // buffer of its own and the staged rows are copied into the tensor.
        // SAFETY: checked bf16 elements of `t`'s CPU memory (u16 bits), written only inside
        // this call while the capsule in `t` keeps the tensor alive.
        let dst = unsafe { t.host_slice_mut::<u16>("out", 1, (bytes / 2) as usize, 0)? };
        g.gather_into_host(layer, draft_window, dst).map_err(lib_err)
    }

    fn __repr__(&self) -> String {
        format!("Forward(pool={:?}, planes={:?})", self.pool.backend().kind(), self.pool.spec().plane_widths)
    }
}

impl PyForward {
    fn write_rows(&self, layer: usize, set: RowSet, kv: &Bound<'_, PyAny>) -> PyResult<()> {
        let staged = lock(&self.writer)?.staged_rows(set).map_err(lib_err)?;
        self.write_kv(
            kv,
            Some(staged),
            |w, s, stride| w.write(layer, set, s, stride).map_err(lib_err),
            // SAFETY: a checked bf16 tensor of the pool's device with exactly the staged rows
            // (checked above) at `stride`, alive for the call; the writer reads those rows.
            |w, ptr, stride| unsafe { w.write_from(layer, set, ptr, stride) }.map_err(lib_err),
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyForward>()?;
    Ok(())
}
