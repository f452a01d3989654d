//! The decode handle: its capacities and FlashMLA widths, creating one (CSR or FlashMLA
//! convention), staging a batch, the build, its buffers and the FlashMLA operands.

use super::{
    get, guard, invalid, items, out, read_in, rejected, write_out, Fail, V4poolBuffer, V4poolDecode,
    V4poolPool, V4poolStatus,
};
use crate::backend::Stream;
use crate::geometry::Class;
use crate::pool::{DecodeCapacity, DecodeError, FlatDecodeBatch, Pool};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Capacities of decode index buffers (see `DecodeCapacity`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct V4poolDecodeCapacity {
    /// `sizeof` of this struct, set by the caller (see the header's versioning note).
    pub struct_size: u32,
    /// Sequences in one step.
    pub max_seqs: u64,
    /// Tokens in one step.
    pub max_tokens: u64,
    /// Block-table columns per sequence.
    pub max_blocks_per_seq: u64,
    /// Sliding window; 0: the pool's (its plan's model's, `V4poolPlanInfo::sliding_window`).
    pub win: i32,
    /// CSA top-k reserved per token; 0: the pool's (its plan's model's,
    /// `V4poolPlanInfo::index_topk`).
    pub index_topk: i32,
}

/// Index widths of a FlashMLA-convention decode path (see `FlashMlaWidths`): entries per row
/// of the window part (`topk`), the CSA and the HCA compressed parts; multiples of 64.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct V4poolFlashMlaWidths {
    /// `sizeof` of this struct, set by the caller (see the header's versioning note).
    pub struct_size: u32,
    /// Window part (`indices`), at least the window.
    pub topk: i32,
    /// CSA compressed part, at least the top-k.
    pub csa_extra_topk: i32,
    /// HCA compressed part, at least the longest HCA head the capacity allows.
    pub hca_extra_topk: i32,
}

/// One layer's FlashMLA operands in a FlashMLA-convention decode path: int32 buffers
/// `indices [max_tokens × topk]`, `topk_length [max_tokens]` (per token), and for a compressed
/// layer `extra_indices [max_tokens × extra_topk]`, `extra_topk_length` (`ptr` 0 for a dense
/// layer); every index already shifted by `shift` to the layer's page view
/// (`v4pool_pool_page_view`'s first page). FlashMLA's own lengths are per batch entry:
/// `seq_topk_length` / `seq_extra_topk_length [max_seqs]` (MTP: stage every sequence with the
/// same `s_q` tokens, then `indices` is `[B, s_q, topk]` with these; docs/flashmla.md).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct V4poolFlashMla {
    /// `sizeof` of this struct, set by the caller (see the header's versioning note).
    pub struct_size: u32,
    /// `indices` (FlashMLA's window part).
    pub indices: V4poolBuffer,
    /// `topk_length`.
    pub topk_length: V4poolBuffer,
    /// `extra_indices_in_kvcache` (0 for a dense layer).
    pub extra_indices: V4poolBuffer,
    /// `extra_topk_length` (0 for a dense layer).
    pub extra_topk_length: V4poolBuffer,
    /// FlashMLA's own `topk_length [max_seqs]`, per batch entry (a staged sequence): the
    /// longest of its tokens' `topk_length`, 0 for a pad (docs/flashmla.md, the MTP rule).
    pub seq_topk_length: V4poolBuffer,
    /// FlashMLA's own `extra_topk_length [max_seqs]`, formed likewise (0 for a dense layer).
    pub seq_extra_topk_length: V4poolBuffer,
    /// Entries per row of `indices`.
    pub topk: i32,
    /// Entries per row of `extra_indices` (0 for a dense layer).
    pub extra_topk: i32,
    /// The layer's page-view shift, already in every index.
    pub shift: i32,
}

/// The capacity a C caller's struct asks for on `pool`: `DecodeCapacity::for_pool`'s, with the
/// window and top-k the caller's where non-zero (0: the pool's spec's, as every binding
/// defaults). Counts past `usize` are refused, not wrapped.
fn decode_capacity(pool: &Pool, c: V4poolDecodeCapacity) -> Result<DecodeCapacity, Fail> {
    let count = |v: u64, what: &str| {
        usize::try_from(v).map_err(|_| invalid(&format!("cap.{what} {v} is past this target's size_t")))
    };
    let mut cap = DecodeCapacity::for_pool(
        pool,
        count(c.max_seqs, "max_seqs")?,
        count(c.max_tokens, "max_tokens")?,
        count(c.max_blocks_per_seq, "max_blocks_per_seq")?,
    )
    .map_err(rejected)?;
    if c.win != 0 {
        cap.win = c.win;
    }
    if c.index_topk != 0 {
        cap.index_topk = c.index_topk;
    }
    Ok(cap)
}

/// Decode index buffers for `pool` sized for `cap` (`cap->win` / `cap->index_topk` 0: the
/// pool's spec's window / top-k, the model's).
///
/// # Safety
/// `pool` is live; `cap` readable; `out_decode` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_decode_new(
    pool: *const V4poolPool,
    cap: *const V4poolDecodeCapacity,
    out_decode: *mut *mut V4poolDecode,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let p = unsafe { get(pool, "pool") }?.pool.clone();
        // SAFETY: `cap` is the caller's readable `V4poolDecodeCapacity` (this function's `# Safety`).
        let cap = decode_capacity(&p, unsafe { read_in(cap, "cap") }?)?;
        // SAFETY: `out_decode` is writable storage for a handle (this function's `# Safety`).
        let slot = unsafe { out(out_decode, "out_decode") }?;
        let step = p.decode_path(cap).map_err(rejected)?;
        *slot = Box::into_raw(Box::new(V4poolDecode { step }));
        Ok(())
    })
}

/// Decode index buffers for `pool` sized for `cap` (0 for the window or top-k: the pool's spec's),
/// in FlashMLA's convention (index-buffers.md
/// §3f: the build and `v4pool_decode_csa_pack` write FlashMLA's operands, read with
/// `v4pool_decode_flashmla`) at `widths` (null: the narrowest the capacity allows).
///
/// # Safety
/// `pool` is live; `cap` readable; `widths` null or readable; `out_decode` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_decode_new_flashmla(
    pool: *const V4poolPool,
    cap: *const V4poolDecodeCapacity,
    widths: *const V4poolFlashMlaWidths,
    out_decode: *mut *mut V4poolDecode,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let p = unsafe { get(pool, "pool") }?.pool.clone();
        // SAFETY: `cap` is the caller's readable `V4poolDecodeCapacity` (this function's `# Safety`).
        let cap = decode_capacity(&p, unsafe { read_in(cap, "cap") }?)?;
        let w = if widths.is_null() {
            let g = p.geometry().map_err(rejected)?;
            crate::pool::FlashMlaWidths::for_capacity(&g, cap).map_err(rejected)?
        } else {
            // SAFETY: `widths` is non-null here, so the caller's readable
            // `V4poolFlashMlaWidths` (this function's `# Safety`).
            let w: V4poolFlashMlaWidths = unsafe { read_in(widths, "widths") }?;
            crate::pool::FlashMlaWidths {
                topk: w.topk,
                csa_extra_topk: w.csa_extra_topk,
                hca_extra_topk: w.hca_extra_topk,
            }
        };
        // SAFETY: `out_decode` is writable storage for a handle (this function's `# Safety`).
        let slot = unsafe { out(out_decode, "out_decode") }?;
        let step = p.flashmla_decode_path(cap, w).map_err(rejected)?;
        *slot = Box::into_raw(Box::new(V4poolDecode { step }));
        Ok(())
    })
}

/// Layer `layer`'s FlashMLA operands of a decode path from `v4pool_decode_new_flashmla`
/// (`NoFlashMla` for a CSR path).
///
/// # Safety
/// `decode` is live; `out_ops` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_decode_flashmla(
    decode: *const V4poolDecode,
    layer: u32,
    out_ops: *mut V4poolFlashMla,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `decode` is live (this function's `# Safety`).
        let ops = unsafe { get(decode, "decode") }?.step.flashmla(layer as usize).map_err(rejected)?;
        let buf = |b: Option<crate::pool::DeviceBuffer>| {
            b.map_or(V4poolBuffer::default(), |b| V4poolBuffer { ptr: b.ptr, len: b.len })
        };
        let v = V4poolFlashMla {
            struct_size: 0,
            indices: buf(Some(ops.indices)),
            topk_length: buf(Some(ops.topk_length)),
            extra_indices: buf(ops.extra_indices),
            extra_topk_length: buf(ops.extra_topk_length),
            seq_topk_length: buf(Some(ops.seq_topk_length)),
            seq_extra_topk_length: buf(ops.seq_extra_topk_length),
            topk: ops.topk,
            extra_topk: ops.extra_topk,
            shift: ops.shift,
        };
        // SAFETY: `out_ops` is the caller's writable `V4poolFlashMla` (this function's `# Safety`).
        unsafe { write_out(out_ops, "out_ops", v) }?;
        Ok(())
    })
}

/// Free decode buffers (null is ignored); waits for the streams they were used on.
///
/// # Safety
/// `decode` is null or from `v4pool_decode_new`, freed once, and no captured graph that
/// names its buffers runs after.
#[no_mangle]
pub unsafe extern "C" fn v4pool_decode_free(decode: *mut V4poolDecode) {
    if !decode.is_null() {
        // SAFETY: the caller's promise.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(decode) })));
    }
}

/// Stage one decode step of `batch` sequences: slot positions, context lengths after the
/// step, tokens per sequence, and block tables (`batch × table_stride` int32, row-major;
/// null when the tables are resident). One copy on the pool's stream; `out_tokens` gets the
/// real token count (may be null).
///
/// # Safety
/// `decode` is live and no other call uses it meanwhile; the three arrays hold `batch`
/// elements; `block_tables` is null or holds `batch * table_stride` elements; `out_tokens` is
/// null or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn v4pool_decode_stage(
    decode: *mut V4poolDecode,
    batch: usize,
    positions: *const i64,
    context_lens: *const i64,
    num_tokens: *const i64,
    block_tables: *const i32,
    table_stride: usize,
    out_tokens: *mut usize,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `decode` is live and this call's alone (this function's `# Safety`).
        let d = unsafe { out(decode, "decode") }?;
        let tables = if block_tables.is_null() || batch == 0 {
            None
        } else {
            let n = batch.checked_mul(table_stride).ok_or_else(|| invalid("table size overflows"))?;
            // SAFETY: non-null here, holding `batch * table_stride` elements (this function's
            // `# Safety`).
            Some(unsafe { items(block_tables, n, "block_tables") }?)
        };
        // SAFETY (the three calls): `positions`, `context_lens` and `num_tokens` hold `batch`
        // elements each (this function's `# Safety`).
        let flat = FlatDecodeBatch {
            positions: unsafe { items(positions, batch, "positions") }?,
            context_lens: unsafe { items(context_lens, batch, "context_lens") }?,
            num_tokens: unsafe { items(num_tokens, batch, "num_tokens") }?,
            block_tables: tables,
            table_stride,
        };
        let tokens = d.step.stage_flat(&flat).map_err(rejected)?;
        // SAFETY: `out_tokens` is null or writable (this function's `# Safety`).
        if let Some(slot) = unsafe { out_tokens.as_mut() } {
            *slot = tokens;
        }
        Ok(())
    })
}

/// Queue the index build on `stream` (0: the pool's stream; another stream must be ordered
/// after the staging): one launch with fixed pointers, capturable in a graph.
///
/// # Safety
/// `decode` is live and no other call uses it meanwhile; `stream` a live stream of the pool's
/// device or 0.
#[no_mangle]
pub unsafe extern "C" fn v4pool_decode_build(decode: *mut V4poolDecode, stream: u64) -> V4poolStatus {
    guard(|| {
        // SAFETY: `decode` is live and this call's alone (this function's `# Safety`).
        let d = unsafe { out(decode, "decode") }?;
        let stream = if stream == 0 { d.step.stream() } else { Stream(stream) };
        d.step.build_on(stream).map_err(rejected)
    })
}

/// Which decode buffer `v4pool_decode_buffer` returns (passed as its integer value).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum V4poolDecodeBuffer {
    /// The class's index buffer.
    Indices = 0,
    /// Its per-token offsets.
    Indptr = 1,
    /// Destination rows of the step's tokens.
    DestRows = 2,
}

/// Device address and int32 length of a class's buffer: `which` a `V4poolDecodeBuffer`,
/// `cls` 0 dense, 1 CSA, 2 HCA.
///
/// # Safety
/// `decode` is live; `out_buffer` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_decode_buffer(
    decode: *const V4poolDecode,
    which: u32,
    cls: u32,
    out_buffer: *mut V4poolBuffer,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `decode` is live (this function's `# Safety`).
        let s = &unsafe { get(decode, "decode") }?.step;
        let class = *Class::ALL.get(cls as usize).ok_or_else(|| invalid("cls is not 0, 1 or 2"))?;
        // `which` arrives as an integer: a C caller can pass any value, and an out-of-range
        // Rust enum would be undefined behaviour.
        let b = match which {
            w if w == V4poolDecodeBuffer::Indices as u32 => s.indices(class),
            w if w == V4poolDecodeBuffer::Indptr as u32 => s.indptr(class),
            w if w == V4poolDecodeBuffer::DestRows as u32 => s.dest_rows(class),
            _ => return Err(invalid("which is not a V4poolDecodeBuffer")),
        }
        .ok_or(DecodeError::MissingClass(class))
        .map_err(rejected)?;
        // SAFETY: `out_buffer` is writable (this function's `# Safety`).
        *unsafe { out(out_buffer, "out_buffer") }? = V4poolBuffer { ptr: b.ptr, len: b.len };
        Ok(())
    })
}

/// Wait for every stream the decode buffers were used on.
///
/// # Safety
/// `decode` is live.
#[no_mangle]
pub unsafe extern "C" fn v4pool_decode_synchronize(decode: *const V4poolDecode) -> V4poolStatus {
    guard(|| {
        // SAFETY: `decode` is live (this function's `# Safety`).
        unsafe { get(decode, "decode") }?.step.synchronize().map_err(rejected)
    })
}
