//! Host reference of every kernel: the contract's pseudo-code (index-buffers.md §3–§7) on
//! safe slices, in i64, bit for bit what `kernels/v4pool_kernels.cu` computes for valid input.
//!
//! Where the device has a precondition it cannot check (a table column in range, a top-k row
//! long enough, a row that fits an i32), the reference checks it and returns a
//! [`HostKernelError`]: the host backend is the strict twin the GPU backends are compared
//! with. Every access is bounds-checked, so no input panics. On an error, outputs may be
//! partly written (as a faulting kernel would leave them).
//!
//! [`run_launch`] is the raw-pointer entry the host backend uses: it derives every buffer's
//! length from the arguments (output lengths from the indptr values it reads) and calls the
//! safe function.

use super::shape::{check_launch, LaunchError};
use super::{
    CopyRun, CopyRunsArgs, CsaPackArgs, DecodeIndexArgs, FillRun, FillRunsArgs, HcaOffsetsArgs, Launch,
    PlaneWrite, PrefillIndexArgs, RingWriteArgs, RowScatterArgs, CLASS_CSA, CLASS_HCA,
};
use crate::geometry::WindowParams;
use thiserror::Error;

/// Why a host kernel refused or stopped.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HostKernelError {
    #[error(transparent)]
    Launch(#[from] LaunchError),
    #[error("{buffer}[{index}] is outside the buffer (length {len})")]
    OutOfBounds { buffer: &'static str, index: i64, len: usize },
    #[error("{what} = {value} does not fit an i32")]
    NotI32 { what: &'static str, value: i64 },
    #[error("{what} overflows 64-bit arithmetic")]
    Overflow { what: &'static str },
    #[error("window params {params:?} are not a ring (ring_slots and ring_stride must be >= 1)")]
    NotARing { params: WindowParams },
    #[error("{what} = {value} must be at least 1")]
    ZeroDivisor { what: &'static str, value: i64 },
    #[error("sequence {seq}: block table column {column} is outside [0, {stride})")]
    TableColumn { seq: i64, column: i64, stride: i64 },
    #[error("entry_idx[{index}] = {entry} is negative")]
    NegativeEntry { index: i64, entry: i64 },
    #[error("token {token}: valid_k {valid_k} exceeds the top-k row stride {row_stride}")]
    TopkPastRow { token: i64, valid_k: i64, row_stride: i64 },
    #[error("{buffer}: address {addr:#x} is null or not {align}-byte aligned")]
    BadAddress { buffer: &'static str, addr: u64, align: usize },
    #[error("{buffer}: {len} elements do not fit this host's address space")]
    TooLong { buffer: &'static str, len: i64 },
    #[error("fill run {run}: dst {dst:#x} and bytes {bytes} must be multiples of 4")]
    FillRunUnaligned { run: usize, dst: u64, bytes: u64 },
    #[error("copy run {run}: source and destination overlap")]
    CopyRunOverlap { run: usize },
    #[error("{buffer}: rows are {got} bytes, expected {expected}")]
    RowWidth { buffer: &'static str, got: usize, expected: usize },
    #[error("CSA copies {stride} elements apart overlap a buffer of {len}")]
    CopiesOverlap { stride: i64, len: usize },
    /// A buffer outside every range [`super::bounds::run_launch_within`] allows.
    #[error("{buffer}: {bytes} bytes at {addr:#x} are not inside one live allocation")]
    OutsideAllocation {
        /// The kernel's name for the buffer.
        buffer: &'static str,
        /// Its first byte.
        addr: u64,
        /// Its length in bytes.
        bytes: u64,
    },
    /// A buffer that overlaps another of the same launch where one of them is written.
    #[error(
        "{buffer}: {bytes} bytes at {addr:#x} overlap another buffer of the launch that one of them writes"
    )]
    Aliased {
        /// The kernel's name for the buffer.
        buffer: &'static str,
        /// Its first byte.
        addr: u64,
        /// Its length in bytes.
        bytes: u64,
    },
}

type Result<T> = std::result::Result<T, HostKernelError>;

// ---- shared formulas (§2) ----------------------------------------------------------------

/// Window row of absolute position `pos` in physical slot `slot`, relative to the layer view
/// (§2). The wrap is Euclidean, as on the device and in `WindowParams::index`.
pub fn window_row(w: &WindowParams, slot: i64, pos: i64) -> Result<i64> {
    if w.ring_slots < 1 || w.ring_stride < 1 {
        return Err(HostKernelError::NotARing { params: *w });
    }
    let q = pos.rem_euclid(w.ring_slots);
    let ovf = || HostKernelError::Overflow { what: "window row" };
    slot.checked_mul(w.slot_rows)
        .and_then(|r| r.checked_add(w.ring_start))
        .and_then(|r| r.checked_add((q / w.ring_stride).checked_mul(w.run_rows)?))
        .and_then(|r| r.checked_add(q % w.ring_stride))
        .ok_or_else(ovf)
}

/// Compressed row `r` of physical block `block` (§2): `block * envelope_rows + r`.
pub fn compress_row(block: i64, r: i64, envelope_rows: i64) -> Result<i64> {
    block
        .checked_mul(envelope_rows)
        .and_then(|x| x.checked_add(r))
        .ok_or(HostKernelError::Overflow { what: "compressed row" })
}

/// Byte offset of `row` in a plane of `row_bytes`-byte rows, in 64 bits (§1).
pub fn row_byte_offset(row: i64, row_bytes: i64) -> Result<u64> {
    let (r, w) = (u64::try_from(row), u64::try_from(row_bytes));
    match (r, w) {
        (Ok(r), Ok(w)) => r.checked_mul(w).ok_or(HostKernelError::Overflow { what: "row byte offset" }),
        _ => Err(HostKernelError::Overflow { what: "row byte offset of a negative row" }),
    }
}

// ---- checked access -------------------------------------------------------------------------

fn at<T: Copy>(buf: &[T], index: i64, buffer: &'static str) -> Result<T> {
    usize::try_from(index).ok().and_then(|i| buf.get(i).copied()).ok_or(HostKernelError::OutOfBounds {
        buffer,
        index,
        len: buf.len(),
    })
}

fn put(buf: &mut [i32], index: i64, value: i64, buffer: &'static str) -> Result<()> {
    let v = i32::try_from(value).map_err(|_| HostKernelError::NotI32 { what: buffer, value })?;
    let len = buf.len();
    let cell = usize::try_from(index)
        .ok()
        .and_then(|i| buf.get_mut(i))
        .ok_or(HostKernelError::OutOfBounds { buffer, index, len })?;
    *cell = v;
    Ok(())
}

fn divisor(what: &'static str, value: i64) -> Result<i64> {
    if value < 1 {
        return Err(HostKernelError::ZeroDivisor { what, value });
    }
    Ok(value)
}

fn add(a: i64, b: i64, what: &'static str) -> Result<i64> {
    a.checked_add(b).ok_or(HostKernelError::Overflow { what })
}

fn mul(a: i64, b: i64, what: &'static str) -> Result<i64> {
    a.checked_mul(b).ok_or(HostKernelError::Overflow { what })
}

/// A block table `[bs, stride]`, row-major.
#[derive(Clone, Copy, Debug)]
pub struct BlockTables<'a> {
    pub table: &'a [i32],
    pub stride: i32,
}

impl BlockTables<'_> {
    /// Physical block of sequence `seq`'s logical block `column`; the column must be in range.
    fn get(&self, seq: i64, column: i64) -> Result<i64> {
        let stride = i64::from(self.stride);
        if !(0..stride).contains(&column) {
            return Err(HostKernelError::TableColumn { seq, column, stride });
        }
        Ok(i64::from(at(
            self.table,
            add(mul(seq, stride, "table index")?, column, "table index")?,
            "block_tables",
        )?))
    }
}

/// Writes `out[start + e] = table[seq][e / rpb] * envelope + e % rpb` for `e < count` (§4).
fn write_compressed(
    out: &mut [i32],
    start: i64,
    count: i64,
    tables: &BlockTables<'_>,
    seq: i64,
    rows_per_block: i64,
    envelope_rows: i64,
    buffer: &'static str,
) -> Result<()> {
    let rpb = divisor("rows_per_block", rows_per_block)?;
    for e in 0..count {
        let row = compress_row(tables.get(seq, e / rpb)?, e % rpb, envelope_rows)?;
        put(out, add(start, e, "entry index")?, row, buffer)?;
    }
    Ok(())
}

/// Writes `out[start + k] = window_row(w, slot, first + k)` for `k < count`.
fn write_window(
    out: &mut [i32],
    start: i64,
    count: i64,
    w: &WindowParams,
    slot: i64,
    first: i64,
    buffer: &'static str,
) -> Result<()> {
    for k in 0..count {
        put(out, add(start, k, "window index")?, window_row(w, slot, add(first, k, "position")?)?, buffer)?;
    }
    Ok(())
}

// ---- §3 + §4: decode builder ----------------------------------------------------------------

/// One enabled class of the decode builder.
#[derive(Debug)]
pub struct DecodeClass<'a> {
    pub params: WindowParams,
    pub indptr: &'a [i32],
    pub indices: &'a mut [i32],
    pub dest_rows: Option<&'a mut [i32]>,
}

/// The decode builder's buffers and scalars; a class is off when its entry is `None`.
#[derive(Debug)]
pub struct DecodeIndices<'a> {
    /// [dense, csa, hca] (`CLASS_*`).
    pub classes: [Option<DecodeClass<'a>>; 3],
    pub state_slot_per_seq: &'a [i32],
    pub batch_id_per_token: &'a [i32],
    pub positions: &'a [i64],
    /// Fused HCA heads (§4) when present.
    pub block_tables: Option<BlockTables<'a>>,
    pub envelope_rows: i64,
    pub hca_rows_per_block: i32,
    pub num_tokens: i32,
    pub win: i32,
    /// Further copies of the CSA index buffer (layers 1.. of a batched translate-pack), each
    /// laid out like the CSA class's own; they get the same window tails.
    pub csa_copies: Vec<&'a mut [i32]>,
}

/// §3 with the fused §4 heads: per live token, each enabled class's window at the tail of its
/// slice (oldest first) and its dest row; with block tables, the HCA head `e = 0..head`.
pub fn decode_indices(k: DecodeIndices<'_>) -> Result<()> {
    let DecodeIndices {
        mut classes,
        state_slot_per_seq,
        batch_id_per_token,
        positions,
        block_tables,
        envelope_rows,
        hca_rows_per_block,
        num_tokens,
        win,
        mut csa_copies,
    } = k;
    for t in 0..i64::from(num_tokens) {
        let b = at(batch_id_per_token, t, "batch_id_per_token")?;
        if b < 0 {
            continue; // pad token
        }
        let p = at(positions, t, "positions")?;
        let n = add(p, 1, "position")?.min(i64::from(win));
        let slot = i64::from(at(state_slot_per_seq, i64::from(b), "state_slot_per_seq")?);
        for (c, class) in classes.iter_mut().enumerate() {
            let Some(class) = class else { continue };
            let end = i64::from(at(class.indptr, t + 1, "indptr")?);
            write_window(class.indices, end - n, n, &class.params, slot, p - n + 1, "indices")?;
            if c == CLASS_CSA {
                for copy in csa_copies.iter_mut() {
                    write_window(copy, end - n, n, &class.params, slot, p - n + 1, "csa copy")?;
                }
            }
            if let Some(dest) = class.dest_rows.as_deref_mut() {
                put(dest, t, window_row(&class.params, slot, p)?, "dest_rows")?;
            }
        }
        if let (Some(tables), Some(hca)) = (&block_tables, classes[CLASS_HCA].as_mut()) {
            let begin = i64::from(at(hca.indptr, t, "hca indptr")?);
            let head = i64::from(at(hca.indptr, t + 1, "hca indptr")?) - begin - n;
            write_compressed(
                hca.indices,
                begin,
                head,
                tables,
                i64::from(b),
                i64::from(hca_rows_per_block),
                envelope_rows,
                "hca indices",
            )?;
        }
    }
    Ok(())
}

// ---- §4: HCA offsets --------------------------------------------------------------------------

/// §4 as a plain gather: `out[i] = table[bid[i]][e / rpb] * envelope + e % rpb`, `e = entry[i]`.
pub fn hca_offsets(
    entry_idx: &[i32],
    bid_per_entry: &[i32],
    tables: &BlockTables<'_>,
    envelope_rows: i64,
    rows_per_block: i32,
    out: &mut [i32],
) -> Result<()> {
    let rpb = divisor("rows_per_block", rows_per_block.into())?;
    for (i, &e) in entry_idx.iter().enumerate() {
        let i = i as i64;
        let b = i64::from(at(bid_per_entry, i, "bid_per_entry")?);
        let e = i64::from(e);
        if e < 0 {
            return Err(HostKernelError::NegativeEntry { index: i, entry: e });
        }
        put(out, i, compress_row(tables.get(b, e / rpb)?, e % rpb, envelope_rows)?, "out")?;
    }
    Ok(())
}

// ---- §5: CSA translate-pack ---------------------------------------------------------------------

/// The translate-pack's buffers; layer `l` reads `topk[l * topk_layer_stride..]` and writes
/// `out[l * out_layer_stride..]`.
#[derive(Debug)]
pub struct CsaPack<'a> {
    pub topk: &'a [i32],
    pub block_tables: BlockTables<'a>,
    /// Read when `window_size > 0`.
    pub positions: &'a [i64],
    pub indptr: &'a [i32],
    pub batch_id_per_token: &'a [i32],
    /// Read when `window_size == 0`.
    pub skip_prefix_len_per_token: &'a [i32],
    pub out: &'a mut [i32],
    pub topk_layer_stride: i64,
    pub out_layer_stride: i64,
    pub envelope_rows: i64,
    pub topk_row_stride: i32,
    pub num_tokens: i32,
    pub num_layers: i32,
    pub block_capacity: i32,
    pub window_size: i32,
}

/// §5 for every layer: the heads `[indptr[t], indptr[t] + valid_k)` from the top-k rows, block
/// index clamped to the table (C division, as the device).
pub fn csa_translate_pack(k: CsaPack<'_>) -> Result<()> {
    let cap = divisor("block_capacity", k.block_capacity.into())?;
    let last = i64::from(k.block_tables.stride) - 1;
    for l in 0..i64::from(k.num_layers) {
        for t in 0..i64::from(k.num_tokens) {
            let b = at(k.batch_id_per_token, t, "batch_id_per_token")?;
            if b < 0 {
                continue;
            }
            let skip = if k.window_size > 0 {
                add(at(k.positions, t, "positions")?, 1, "position")?.min(k.window_size.into())
            } else {
                at(k.skip_prefix_len_per_token, t, "skip_prefix_len_per_token")?.into()
            };
            let base = i64::from(at(k.indptr, t, "indptr")?);
            let valid_k = i64::from(at(k.indptr, t + 1, "indptr")?) - base - skip;
            if valid_k > i64::from(k.topk_row_stride) {
                return Err(HostKernelError::TopkPastRow {
                    token: t,
                    valid_k,
                    row_stride: k.topk_row_stride.into(),
                });
            }
            let row = add(
                mul(l, k.topk_layer_stride, "topk index")?,
                mul(t, k.topk_row_stride.into(), "topk index")?,
                "topk index",
            )?;
            let out0 = add(mul(l, k.out_layer_stride, "out index")?, base, "out index")?;
            for i in 0..valid_k {
                let v = i64::from(at(k.topk, row + i, "topk")?);
                let blk = (v / cap).clamp(0, last.max(0)); // clamp, do not drop
                put(
                    k.out,
                    out0 + i,
                    compress_row(k.block_tables.get(b.into(), blk)?, v % cap, k.envelope_rows)?,
                    "out",
                )?;
            }
        }
    }
    Ok(())
}

// ---- §6: prefill builder ------------------------------------------------------------------------

/// One CSR buffer: `indices[indptr[t] .. indptr[t+1])` is token t's slice.
#[derive(Debug)]
pub struct Csr<'a> {
    pub indptr: &'a [i32],
    pub indices: &'a mut [i32],
}

/// The prefill builder's buffers and scalars.
#[derive(Debug)]
pub struct PrefillIndices<'a> {
    pub dense: WindowParams,
    pub csa: WindowParams,
    pub hca: WindowParams,
    pub positions: &'a [i32],
    pub bid_per_token: &'a [i32],
    pub chunk_start_per_seq: &'a [i32],
    pub cu_seqlens_q_per_seq: &'a [i32],
    pub state_slot_per_seq: &'a [i32],
    pub n_committed_hca_per_seq: &'a [i32],
    pub block_tables: BlockTables<'a>,
    pub extend: Csr<'a>,
    /// `None` when the geometry has no dense class.
    pub prefix_swa: Option<Csr<'a>>,
    pub prefix_csa: Csr<'a>,
    pub prefix_hca: Csr<'a>,
    pub envelope_rows: i64,
    pub num_tokens: i32,
    pub win: i32,
    pub hca_ratio: i32,
    pub hca_rows_per_block: i32,
}

/// §6: extend rows, dense window slice, CSA window tail, HCA `[window | compressed]`.
pub fn prefill_indices(k: PrefillIndices<'_>) -> Result<()> {
    let PrefillIndices {
        dense,
        csa,
        hca,
        positions,
        bid_per_token,
        chunk_start_per_seq,
        cu_seqlens_q_per_seq,
        state_slot_per_seq,
        n_committed_hca_per_seq,
        block_tables,
        extend,
        mut prefix_swa,
        prefix_csa,
        prefix_hca,
        envelope_rows,
        num_tokens,
        win,
        hca_ratio,
        hca_rows_per_block,
    } = k;
    let hca_ratio = divisor("hca_ratio", hca_ratio.into())?;
    let win = i64::from(win);
    for t in 0..i64::from(num_tokens) {
        let b = at(bid_per_token, t, "bid_per_token")?;
        if b < 0 {
            continue; // prefill has no pads; the device skips them too
        }
        let b = i64::from(b);
        let p = i64::from(at(positions, t, "positions")?);
        let cs = i64::from(at(chunk_start_per_seq, b, "chunk_start_per_seq")?);
        let in_chunk = p - cs;
        let low = (p - win + 1).max(0);
        let ext = (in_chunk + 1).min(win);
        let pre = (cs - low).max(0);
        let n_hca =
            ((p + 1) / hca_ratio).min(at(n_committed_hca_per_seq, b, "n_committed_hca_per_seq")?.into());
        let slot = i64::from(at(state_slot_per_seq, b, "state_slot_per_seq")?);

        let start = i64::from(at(extend.indptr, t, "extend_indptr")?);
        let first = i64::from(at(cu_seqlens_q_per_seq, b, "cu_seqlens_q_per_seq")?) + in_chunk - ext + 1;
        for i in 0..ext {
            put(extend.indices, start + i, first + i, "extend_indices")?;
        }
        if let Some(swa) = prefix_swa.as_mut() {
            let start = i64::from(at(swa.indptr, t, "swa_indptr")?);
            write_window(swa.indices, start, pre, &dense, slot, low, "swa_indices")?;
        }
        let end = i64::from(at(prefix_csa.indptr, t + 1, "csa_indptr")?);
        write_window(prefix_csa.indices, end - pre, pre, &csa, slot, low, "csa_indices")?;
        let start = i64::from(at(prefix_hca.indptr, t, "hca_indptr")?);
        write_window(prefix_hca.indices, start, pre, &hca, slot, low, "hca_indices")?;
        write_compressed(
            prefix_hca.indices,
            start + pre,
            n_hca,
            &block_tables,
            b,
            hca_rows_per_block.into(),
            envelope_rows,
            "hca_indices",
        )?;
    }
    Ok(())
}

// ---- §7: ring write and row scatter ---------------------------------------------------------------

/// One plane of a row write: source rows `kv` and the layer view `pool`, `row_bytes` each.
#[derive(Debug)]
pub struct PlaneRows<'a> {
    pub kv: &'a [u8],
    pub pool: &'a mut [u8],
    pub row_bytes: usize,
}

fn copy_row(plane: &mut PlaneRows<'_>, src_row: i64, dst_row: i64) -> Result<()> {
    let w = plane.row_bytes;
    let range = |row: i64, len: usize, buffer: &'static str| -> Result<std::ops::Range<usize>> {
        let off = row_byte_offset(row, w as i64)?;
        let start =
            usize::try_from(off).map_err(|_| HostKernelError::OutOfBounds { buffer, index: row, len })?;
        match start.checked_add(w) {
            Some(end) if end <= len => Ok(start..end),
            _ => Err(HostKernelError::OutOfBounds { buffer, index: row, len }),
        }
    };
    let src = range(src_row, plane.kv.len(), "kv")?;
    let dst = range(dst_row, plane.pool.len(), "pool")?;
    plane.pool[dst].copy_from_slice(&plane.kv[src]);
    Ok(())
}

/// §7 ring write: the last `min(tok, write_per_batch)` tokens of each sequence to their window
/// rows in every plane; rows outside `[0, view_rows)` are dropped.
pub fn ring_write(
    params: &WindowParams,
    planes: &mut [PlaneRows<'_>],
    positions: &[i32],
    cu_seqlens_q: &[i32],
    state_slot_per_seq: &[i32],
    view_rows: i64,
    num_seqs: i32,
    write_per_batch: i32,
) -> Result<()> {
    for b in 0..i64::from(num_seqs) {
        let end = i64::from(at(cu_seqlens_q, b + 1, "cu_seqlens_q")?);
        let tok = end - i64::from(at(cu_seqlens_q, b, "cu_seqlens_q")?);
        if tok <= 0 {
            continue;
        }
        let w = tok.min(write_per_batch.into());
        let slot = i64::from(at(state_slot_per_seq, b, "state_slot_per_seq")?);
        for r in 0..w {
            let src = end - w + r;
            let row = window_row(params, slot, at(positions, src, "positions")?.into())?;
            if !(0..view_rows).contains(&row) {
                continue; // dropped, not wrapped
            }
            for plane in planes.iter_mut() {
                copy_row(plane, src, row)?;
            }
        }
    }
    Ok(())
}

/// §7 row scatter: `kv[t]` to `pool[dest_rows[t]]` for live tokens with an in-range row.
pub fn row_scatter(
    planes: &mut [PlaneRows<'_>],
    batch_id_per_token: &[i32],
    dest_rows: &[i32],
    view_rows: i64,
    num_tokens: i32,
) -> Result<()> {
    for t in 0..i64::from(num_tokens) {
        if at(batch_id_per_token, t, "batch_id_per_token")? < 0 {
            continue;
        }
        let row = i64::from(at(dest_rows, t, "dest_rows")?);
        if !(0..view_rows).contains(&row) {
            continue;
        }
        for plane in planes.iter_mut() {
            copy_row(plane, t, row)?;
        }
    }
    Ok(())
}

/// Fill a byte range with a repeated 32-bit pattern (native byte order, as the device stores
/// it); `dst.len()` must be a multiple of 4.
pub fn fill_pattern(dst: &mut [u8], pattern: u32) -> Result<()> {
    if dst.len() % 4 != 0 {
        return Err(HostKernelError::FillRunUnaligned { run: 0, dst: 0, bytes: dst.len() as u64 });
    }
    for word in dst.chunks_exact_mut(4) {
        word.copy_from_slice(&pattern.to_ne_bytes());
    }
    Ok(())
}

// ---- raw-pointer entry ----------------------------------------------------------------------------

fn len_of(buffer: &'static str, n: i64) -> Result<usize> {
    usize::try_from(n.max(0)).map_err(|_| HostKernelError::TooLong { buffer, len: n })
}

/// A shared slice of `len` elements at `addr` (none read when `len == 0`).
///
/// # Safety
/// When `len > 0`, `addr .. addr + len * size_of::<T>()` is readable memory holding `T`s that
/// nothing writes while the slice lives.
unsafe fn input<'a, T>(buffer: &'static str, addr: u64, len: usize) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    check_address::<T>(buffer, addr, len)?;
    super::bounds::claim(buffer, addr, len * std::mem::size_of::<T>(), false)?;
    // SAFETY: non-null, aligned and sized as checked; readable and unaliased by the caller's
    // promise.
    Ok(unsafe { std::slice::from_raw_parts(addr as usize as *const T, len) })
}

/// A mutable slice of `len` elements at `addr`.
///
/// # Safety
/// When `len > 0`, the range is writable memory that no other live reference covers.
unsafe fn output<'a, T>(buffer: &'static str, addr: u64, len: usize) -> Result<&'a mut [T]> {
    if len == 0 {
        return Ok(&mut []);
    }
    check_address::<T>(buffer, addr, len)?;
    super::bounds::claim(buffer, addr, len * std::mem::size_of::<T>(), true)?;
    // SAFETY: as `input`, and the caller promises no other reference covers the range.
    Ok(unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut T, len) })
}

fn check_address<T>(buffer: &'static str, addr: u64, len: usize) -> Result<()> {
    let align = std::mem::align_of::<T>();
    if addr == 0 || addr % align as u64 != 0 || usize::try_from(addr).is_err() {
        return Err(HostKernelError::BadAddress { buffer, addr, align });
    }
    let too_long = || HostKernelError::TooLong { buffer, len: len as i64 };
    let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(too_long)?;
    if bytes > isize::MAX as usize || (addr as usize).checked_add(bytes).is_none() {
        return Err(too_long());
    }
    super::bounds::check(buffer, addr, bytes as u64)
}

/// Largest value of an indptr's first `n + 1` entries: the length its indices buffer needs.
fn indptr_extent(indptr: &[i32]) -> i64 {
    indptr.iter().copied().max().map_or(0, |m| i64::from(m).max(0))
}

/// Sequences a batch-id array reaches: `max(bid) + 1` over non-negative ids.
fn seqs_reached(bids: &[i32]) -> i64 {
    bids.iter().copied().max().map_or(0, |m| i64::from(m) + 1).max(0)
}

fn count(n: i32) -> usize {
    usize::try_from(n).unwrap_or(0)
}

/// Run one launch on host memory: the host backend's `launch`.
///
/// # Safety
/// Every pointer in the arguments is a host address covering what the kernel reads and writes
/// (index-buffers.md; the lengths are derived from the arguments and the indptr / cu_seqlens
/// values), and no output buffer overlaps another buffer of the same launch.
pub unsafe fn run_launch(launch: &Launch) -> Result<()> {
    check_launch(launch)?;
    // SAFETY (all arms): forwarded from this function's contract.
    unsafe {
        match launch {
            Launch::Decode(a) => run_decode(a),
            Launch::Prefill(a) => run_prefill(a),
            Launch::HcaOffsets(a) => run_hca_offsets(a),
            Launch::CsaPack(a) => run_csa_pack(a),
            Launch::RingWrite(a) => run_ring_write(a),
            Launch::RowScatter(a) => run_row_scatter(a),
            Launch::FillRuns(a) => run_fill_runs(a),
            Launch::CopyRuns(a) => run_copy_runs(a),
            Launch::Empty => Ok(()),
        }
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_decode(a: &DecodeIndexArgs) -> Result<()> {
    let t = count(a.num_tokens);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let bids: &[i32] = input("batch_id_per_token", a.batch_id_per_token, t)?;
        let positions: &[i64] = input("positions", a.positions, t)?;
        let live: Vec<i32> = bids.iter().copied().filter(|&b| b >= 0).collect();
        let bs = len_of("state_slot_per_seq", seqs_reached(&live))?;
        let slots: &[i32] = input("state_slot_per_seq", a.state_slot_per_seq, bs)?;
        let mut classes: [Option<DecodeClass<'_>>; 3] = [None, None, None];
        for (c, cls) in a.classes.iter().enumerate() {
            if cls.indptr == 0 {
                continue;
            }
            let indptr: &[i32] = input("indptr", cls.indptr, t + 1)?;
            let n = len_of("indices", indptr_extent(indptr))?;
            let dest_rows =
                if cls.dest_rows == 0 { None } else { Some(output("dest_rows", cls.dest_rows, t)?) };
            classes[c] = Some(DecodeClass {
                params: cls.params,
                indptr,
                indices: output("indices", cls.indices, n)?,
                dest_rows,
            });
        }
        let block_tables = if a.block_tables != 0 && a.classes[CLASS_HCA].indptr != 0 {
            let n = len_of("block_tables", mul(bs as i64, a.block_table_stride.into(), "block_tables")?)?;
            Some(BlockTables {
                table: input("block_tables", a.block_tables, n)?,
                stride: a.block_table_stride,
            })
        } else {
            None
        };
        // Copies 1.. of the CSA buffer, as long as the class's own.
        let mut csa_copies = Vec::new();
        let csa = &a.classes[CLASS_CSA];
        if csa.indptr != 0 && a.csa_copies > 1 {
            let n = classes[CLASS_CSA].as_ref().map_or(0, |c| c.indices.len());
            // Copies are separate slices of one allocation: they must not overlap.
            if a.csa_copy_stride < n as i64 {
                return Err(HostKernelError::CopiesOverlap { stride: a.csa_copy_stride, len: n });
            }
            for k in 1..i64::from(a.csa_copies) {
                let off = mul(mul(k, a.csa_copy_stride, "csa copy")?, 4, "csa copy")?;
                let ptr = csa.indices.wrapping_add(off as u64);
                csa_copies.push(output("csa copy", ptr, n)?);
            }
        }
        decode_indices(DecodeIndices {
            classes,
            state_slot_per_seq: slots,
            batch_id_per_token: bids,
            positions,
            block_tables,
            envelope_rows: a.envelope_rows,
            hca_rows_per_block: a.hca_rows_per_block,
            num_tokens: a.num_tokens,
            win: a.win,
            csa_copies,
        })
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_prefill(a: &PrefillIndexArgs) -> Result<()> {
    let t = count(a.num_tokens);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let bids: &[i32] = input("bid_per_token", a.bid_per_token, t)?;
        let bs = len_of("per-sequence arrays", seqs_reached(bids))?;
        let per_seq = |name: &'static str, addr: u64| -> Result<&[i32]> { input(name, addr, bs) };
        let csr = |name: &'static str, indptr: u64, indices: u64| -> Result<Csr<'_>> {
            let indptr: &[i32] = input(name, indptr, t + 1)?;
            let n = len_of(name, indptr_extent(indptr))?;
            Ok(Csr { indptr, indices: output(name, indices, n)? })
        };
        let table_len = len_of("block_tables", mul(bs as i64, a.block_table_stride.into(), "block_tables")?)?;
        prefill_indices(PrefillIndices {
            dense: a.dense,
            csa: a.csa,
            hca: a.hca,
            positions: input("positions", a.positions, t)?,
            bid_per_token: bids,
            chunk_start_per_seq: per_seq("chunk_start_per_seq", a.chunk_start_per_seq)?,
            cu_seqlens_q_per_seq: per_seq("cu_seqlens_q_per_seq", a.cu_seqlens_q_per_seq)?,
            state_slot_per_seq: per_seq("state_slot_per_seq", a.state_slot_per_seq)?,
            n_committed_hca_per_seq: per_seq("n_committed_hca_per_seq", a.n_committed_hca_per_seq)?,
            block_tables: BlockTables {
                table: input("block_tables", a.block_tables, table_len)?,
                stride: a.block_table_stride,
            },
            extend: csr("extend", a.extend_indptr, a.extend_indices)?,
            prefix_swa: if a.swa_indptr == 0 {
                None
            } else {
                Some(csr("prefix_swa", a.swa_indptr, a.swa_indices)?)
            },
            prefix_csa: csr("prefix_csa", a.csa_indptr, a.csa_indices)?,
            prefix_hca: csr("prefix_hca", a.hca_indptr, a.hca_indices)?,
            envelope_rows: a.envelope_rows,
            num_tokens: a.num_tokens,
            win: a.win,
            hca_ratio: a.hca_ratio,
            hca_rows_per_block: a.hca_rows_per_block,
        })
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_hca_offsets(a: &HcaOffsetsArgs) -> Result<()> {
    let n = count(a.num_entries);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let entries: &[i32] = input("entry_idx", a.entry_idx, n)?;
        let bids: &[i32] = input("bid_per_entry", a.bid_per_entry, n)?;
        let rows = mul(seqs_reached(bids), a.block_table_stride.into(), "block_tables")?;
        let table = input("block_tables", a.block_tables, len_of("block_tables", rows)?)?;
        let tables = BlockTables { table, stride: a.block_table_stride };
        hca_offsets(entries, bids, &tables, a.envelope_rows, a.rows_per_block, output("out", a.out, n)?)
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_csa_pack(a: &CsaPackArgs) -> Result<()> {
    let t = count(a.num_tokens);
    if t == 0 || a.num_layers <= 0 {
        return Ok(());
    }
    let layers = i64::from(a.num_layers);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let bids: &[i32] = input("batch_id_per_token", a.batch_id_per_token, t)?;
        let indptr: &[i32] = input("indptr", a.indptr, t + 1)?;
        let positions: &[i64] = if a.window_size > 0 { input("positions", a.positions, t)? } else { &[] };
        let skip: &[i32] = if a.window_size > 0 {
            &[]
        } else {
            input("skip_prefix_len_per_token", a.skip_prefix_len_per_token, t)?
        };
        let live: Vec<i32> = bids.iter().copied().filter(|&b| b >= 0).collect();
        let rows = mul(seqs_reached(&live), a.block_table_stride.into(), "block_tables")?;
        let table = input("block_tables", a.block_tables, len_of("block_tables", rows)?)?;
        let topk_len = add(
            mul(layers - 1, a.topk_layer_stride, "topk length")?,
            mul(t as i64, a.topk_row_stride.into(), "topk length")?,
            "topk length",
        )?;
        let out_len =
            add(mul(layers - 1, a.out_layer_stride, "out length")?, indptr_extent(indptr), "out length")?;
        csa_translate_pack(CsaPack {
            topk: input("topk", a.topk, len_of("topk", topk_len)?)?,
            block_tables: BlockTables { table, stride: a.block_table_stride },
            positions,
            indptr,
            batch_id_per_token: bids,
            skip_prefix_len_per_token: skip,
            out: output("out", a.out, len_of("out", out_len)?)?,
            topk_layer_stride: a.topk_layer_stride,
            out_layer_stride: a.out_layer_stride,
            envelope_rows: a.envelope_rows,
            topk_row_stride: a.topk_row_stride,
            num_tokens: a.num_tokens,
            num_layers: a.num_layers,
            block_capacity: a.block_capacity,
            window_size: a.window_size,
        })
    }
}

/// Both planes' row slices: `src_rows` source rows, `view_rows` pool rows.
///
/// # Safety
/// See [`run_launch`].
unsafe fn plane_rows<'a>(
    planes: &[PlaneWrite; 2],
    src_rows: i64,
    view_rows: i64,
) -> Result<Vec<PlaneRows<'a>>> {
    let mut out = Vec::with_capacity(2);
    for p in planes.iter().filter(|p| p.pool != 0) {
        let w = len_of("row_bytes", p.row_bytes)?;
        let kv_len = len_of("kv", mul(src_rows, p.row_bytes, "kv bytes")?)?;
        let pool_len = len_of("pool", mul(view_rows, p.row_bytes, "pool bytes")?)?;
        // SAFETY: lengths from the arguments; the caller covers them.
        unsafe {
            out.push(PlaneRows {
                kv: input("kv", p.kv, kv_len)?,
                pool: output("pool", p.pool, pool_len)?,
                row_bytes: w,
            });
        }
    }
    Ok(out)
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_ring_write(a: &RingWriteArgs) -> Result<()> {
    let bs = count(a.num_seqs);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let cu: &[i32] = input("cu_seqlens_q", a.cu_seqlens_q, bs + 1)?;
        let tokens = indptr_extent(cu);
        let positions: &[i32] = input("positions", a.positions, len_of("positions", tokens)?)?;
        let slots: &[i32] = input("state_slot_per_seq", a.state_slot_per_seq, bs)?;
        let mut planes = plane_rows(&a.planes, tokens, a.view_rows)?;
        ring_write(&a.params, &mut planes, positions, cu, slots, a.view_rows, a.num_seqs, a.write_per_batch)
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_row_scatter(a: &RowScatterArgs) -> Result<()> {
    let t = count(a.num_tokens);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let bids: &[i32] = input("batch_id_per_token", a.batch_id_per_token, t)?;
        let dest: &[i32] = input("dest_rows", a.dest_rows, t)?;
        let mut planes = plane_rows(&a.planes, t as i64, a.view_rows)?;
        row_scatter(&mut planes, bids, dest, a.view_rows, a.num_tokens)
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_fill_runs(a: &FillRunsArgs) -> Result<()> {
    // SAFETY: the descriptor array is covered by the caller. Copied out, so a run that
    // writes over the descriptor does not alias a live slice of it.
    let runs: Vec<FillRun> = unsafe { input::<FillRun>("runs", a.runs, count(a.num_runs))? }.to_vec();
    // Check every run before writing any, so a bad descriptor writes nothing.
    for (i, r) in runs.iter().enumerate() {
        if r.dst % 4 != 0 || r.bytes % 4 != 0 {
            return Err(HostKernelError::FillRunUnaligned { run: i, dst: r.dst, bytes: r.bytes });
        }
        let len = usize::try_from(r.bytes / 4)
            .map_err(|_| HostKernelError::TooLong { buffer: "fill run", len: -1 })?;
        check_address::<u32>("fill run", r.dst, len)?;
    }
    for r in &runs {
        let len = (r.bytes / 4) as usize; // fits: checked above
        if len == 0 {
            continue;
        }
        // SAFETY: the caller covers each run (checked non-null, aligned and, under
        // `run_launch_within`, inside one allowed range above); runs are written one at a
        // time and no other slice of the launch is alive, so overlapping runs do not alias.
        let words: &mut [u32] = unsafe { std::slice::from_raw_parts_mut(r.dst as usize as *mut u32, len) };
        words.fill(r.pattern);
    }
    Ok(())
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_copy_runs(a: &CopyRunsArgs) -> Result<()> {
    // SAFETY: the descriptor array is covered by the caller. Copied out, so a run that
    // writes over the descriptor does not alias a live slice of it.
    let runs: Vec<CopyRun> = unsafe { input::<CopyRun>("runs", a.runs, count(a.num_runs))? }.to_vec();
    for (i, r) in runs.iter().enumerate() {
        let len =
            usize::try_from(r.bytes).map_err(|_| HostKernelError::TooLong { buffer: "copy run", len: -1 })?;
        if len == 0 {
            continue;
        }
        check_address::<u8>("copy run src", r.src, len)?;
        check_address::<u8>("copy run dst", r.dst, len)?;
        if r.src < r.dst + r.bytes && r.dst < r.src + r.bytes {
            return Err(HostKernelError::CopyRunOverlap { run: i });
        }
    }
    for r in &runs {
        if r.bytes == 0 {
            continue;
        }
        // SAFETY: both ranges are covered by the caller, checked non-null and disjoint above.
        unsafe {
            std::ptr::copy_nonoverlapping(
                r.src as usize as *const u8,
                r.dst as usize as *mut u8,
                r.bytes as usize,
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The worked examples of index-buffers.md §1, §3–§7, built from `UnifiedPoolGeometry`.
    //! Outputs are poisoned (−7 / −9) first; every cell the contract leaves alone must keep it.
    use super::*;
    use crate::geometry::{GeometrySpec, UnifiedPoolGeometry};

    const U: i32 = -7;

    /// Geometry A: ratios [0,4,128,4,128,0], 4 blocks, 6 slots, ring 11, block 256.
    fn geometry_a() -> UnifiedPoolGeometry {
        GeometrySpec::new(vec![0, 4, 128, 4, 128, 0], 4, 6, 11, 256).build().unwrap()
    }

    /// Geometry B: ratios [0,4,128,4,128], 40 blocks, 4 slots, ring 11, block 256.
    fn geometry_b() -> UnifiedPoolGeometry {
        GeometrySpec::new(vec![0, 4, 128, 4, 128], 40, 4, 11, 256).build().unwrap()
    }

    fn range(a: i32, b: i32) -> Vec<i32> {
        (a..=b).collect()
    }

    fn cat(parts: &[&[i32]]) -> Vec<i32> {
        parts.concat()
    }

    #[test]
    fn byte_offsets_are_64_bit() {
        let rows = [0i64, 1, 4194303, 4194304, 4194305, 100000000, 148610071];
        let want = [0u64, 512, 2147483136, 2147483648, 2147484160, 51200000000, 76088356352];
        for (r, w) in rows.iter().zip(want) {
            assert_eq!(row_byte_offset(*r, 512).unwrap(), w);
        }
        assert!(row_byte_offset(-1, 512).is_err());
    }

    #[test]
    fn geometry_a_window_table() {
        let g = geometry_a();
        assert_eq!((g.envelope_rows, g.entry_rows, g.slot_rows, g.plane_rows), (132, 120, 120, 1320));
        let rows = |ratio: i32| -> Vec<i64> {
            let w = g.window_params(ratio).unwrap();
            (0..11).map(|q| window_row(&w, 3, q).unwrap()).collect()
        };
        assert_eq!(rows(0), (360..=370).collect::<Vec<i64>>());
        assert_eq!(rows(4), (401..=411).collect::<Vec<i64>>());
        assert_eq!(rows(128), vec![382, 383, 386, 387, 390, 391, 394, 395, 398, 399, 402]);
        // The device formula agrees with the geometry's own.
        for ratio in [0, 4, 128] {
            let w = g.window_params(ratio).unwrap();
            for pos in [0, 5, 11, 1_000_000] {
                assert_eq!(window_row(&w, 4, pos).unwrap(), w.index(4, pos));
            }
        }
        assert_eq!(g.layer_base_row(3).unwrap() + 401, 469);
    }

    /// The §3 batch: window 8, slots [3,0,4], positions [5,20,13,7], batch ids [0,1,2,−1].
    struct DecodeCase {
        slots: Vec<i32>,
        bids: Vec<i32>,
        positions: Vec<i64>,
        swa_indptr: Vec<i32>,
        csa_indptr: Vec<i32>,
        hca_indptr: Vec<i32>,
    }

    fn decode_case() -> DecodeCase {
        DecodeCase {
            slots: vec![3, 0, 4],
            bids: vec![0, 1, 2, -1],
            positions: vec![5, 20, 13, 7],
            swa_indptr: vec![0, 6, 14, 22, 22],
            csa_indptr: vec![0, 9, 17, 30, 30],
            hca_indptr: vec![0, 7, 17, 25, 25],
        }
    }

    struct DecodeOut {
        swa: Vec<i32>,
        csa: Vec<i32>,
        hca: Vec<i32>,
        dest: [Vec<i32>; 3],
    }

    fn run_decode_case(g: &UnifiedPoolGeometry, tables: Option<&[i32]>) -> DecodeOut {
        let c = decode_case();
        let mut out = DecodeOut {
            swa: vec![U; 22],
            csa: vec![U; 30],
            hca: vec![U; 25],
            dest: [vec![U; 4], vec![U; 4], vec![U; 4]],
        };
        let [d0, d1, d2] = &mut out.dest;
        let dense = g.window_params(0).ok().map(|params| DecodeClass {
            params,
            indptr: &c.swa_indptr,
            indices: &mut out.swa,
            dest_rows: Some(d0.as_mut_slice()),
        });
        let csa = DecodeClass {
            params: g.window_params(4).unwrap(),
            indptr: &c.csa_indptr,
            indices: &mut out.csa,
            dest_rows: Some(d1.as_mut_slice()),
        };
        let hca = DecodeClass {
            params: g.window_params(128).unwrap(),
            indptr: &c.hca_indptr,
            indices: &mut out.hca,
            dest_rows: Some(d2.as_mut_slice()),
        };
        decode_indices(DecodeIndices {
            classes: [dense, Some(csa), Some(hca)],
            state_slot_per_seq: &c.slots,
            batch_id_per_token: &c.bids,
            positions: &c.positions,
            block_tables: tables.map(|table| BlockTables { table, stride: 3 }),
            envelope_rows: g.envelope_rows,
            hca_rows_per_block: 2,
            num_tokens: 4,
            win: 8,
            csa_copies: Vec::new(),
        })
        .unwrap();
        out
    }

    fn decode_csa_expected() -> Vec<i32> {
        cat(&[&[U; 3], &range(401, 406), &range(43, 50), &[U; 5], &range(527, 531), &[521, 522, 523]])
    }

    #[test]
    fn decode_builder_worked_example() {
        let out = run_decode_case(&geometry_a(), None);
        assert_eq!(out.swa, cat(&[&range(360, 365), &range(2, 9), &range(486, 490), &range(480, 482)]));
        assert_eq!(out.csa, decode_csa_expected());
        assert_eq!(
            out.hca,
            vec![
                U, 382, 383, 386, 387, 390, 391, U, U, 26, 27, 30, 31, 34, 35, 38, 39, 514, 515, 518, 519,
                522, 502, 503, 506
            ]
        );
        assert_eq!(out.dest[0], vec![365, 9, 482, U]);
        assert_eq!(out.dest[1], vec![406, 50, 523, U]);
        assert_eq!(out.dest[2], vec![391, 39, 506, U]);
    }

    #[test]
    fn decode_builder_fuses_hca_heads() {
        // §4 in the §3 example: tables [[2,0,3],[1,3,0],[3,1,2]], envelope 132, rpb 2.
        let tables = [2, 0, 3, 1, 3, 0, 3, 1, 2];
        let out = run_decode_case(&geometry_a(), Some(&tables));
        let plain = run_decode_case(&geometry_a(), None);
        assert_eq!(out.hca[0], 264);
        assert_eq!(&out.hca[7..9], &[132, 133]);
        // Everything else as without the fused heads.
        let mut expect = plain.hca.clone();
        expect[0] = 264;
        expect[7] = 132;
        expect[8] = 133;
        assert_eq!(out.hca, expect);
        assert_eq!(out.csa, plain.csa);
    }

    #[test]
    fn decode_builder_without_dense_class() {
        let g = GeometrySpec::new(vec![4, 128, 4, 128], 4, 6, 11, 256).build().unwrap();
        assert!(g.window_params(0).is_err());
        let out = run_decode_case(&g, None);
        assert_eq!(out.swa, vec![U; 22]);
        assert_eq!(out.dest[0], vec![U; 4]);
        assert_eq!(
            out.csa,
            cat(&[&[U; 3], &range(313, 318), &range(21, 28), &[U; 5], &range(417, 421), &[411, 412, 413]])
        );
    }

    #[test]
    fn hca_offsets_worked_example() {
        let entries = [0, 1, 2, 3, 0, 1, 2];
        let bids = [0, 0, 0, 0, 1, 1, 1];
        let tables = BlockTables { table: &[5, 9, 13, 17, 2, 6, 10, 14], stride: 4 };
        let mut out = vec![-9; 8];
        hca_offsets(&entries, &bids, &tables, 10000, 2, &mut out).unwrap();
        assert_eq!(out, vec![50000, 50001, 90000, 90001, 20000, 20001, 60000, -9]);
        let mut out = vec![-9; 8];
        hca_offsets(&entries, &bids, &tables, 10000, 1, &mut out).unwrap();
        assert_eq!(out, vec![50000, 90000, 130000, 170000, 20000, 60000, 100000, -9]);
        // A column past the table is an error on the host (the device would read past the row).
        let err = hca_offsets(&[8], &[0], &tables, 10000, 2, &mut out).unwrap_err();
        assert_eq!(err, HostKernelError::TableColumn { seq: 0, column: 4, stride: 4 });
        assert!(hca_offsets(&[-1], &[0], &tables, 10000, 2, &mut out).is_err());
    }

    #[test]
    fn csa_pack_decode_worked_example() {
        let c = decode_case();
        let mut csa = run_decode_case(&geometry_a(), None).csa;
        let topk =
            cat(&[&[1, 70, 130, -1, -1, -1, -1, -1], &[7; 8], &[0, 64, 65, 127, 200, -1, 5, 9], &[3; 8]]);
        csa_translate_pack(CsaPack {
            topk: &topk,
            block_tables: BlockTables { table: &[2, 0, 3, 1, 3, 0, 3, 1, 2], stride: 3 },
            positions: &c.positions,
            indptr: &c.csa_indptr,
            batch_id_per_token: &c.bids,
            skip_prefix_len_per_token: &[],
            out: &mut csa,
            topk_layer_stride: 0,
            out_layer_stride: 0,
            envelope_rows: 132,
            topk_row_stride: 8,
            num_tokens: 4,
            num_layers: 1,
            block_capacity: 64,
            window_size: 8,
        })
        .unwrap();
        assert_eq!(
            csa,
            cat(&[
                &[265, 6, 398],
                &range(401, 406),
                &range(43, 50),
                &[396, 132, 133, 195, 272],
                &range(527, 531),
                &[521, 522, 523]
            ])
        );
    }

    #[test]
    fn csa_pack_layers_write_their_own_heads() {
        // Two layers in one call: layer 1's top-k differs; each writes its own output copy.
        let c = decode_case();
        let one = decode_csa_expected();
        let mut out = cat(&[&one, &one]);
        let layer0 =
            cat(&[&[1, 70, 130, -1, -1, -1, -1, -1], &[7; 8], &[0, 64, 65, 127, 200, -1, 5, 9], &[3; 8]]);
        let layer1 = cat(&[&[0, 1, 2, 9, 9, 9, 9, 9], &[7; 8], &[191, 0, 0, 0, 1, 9, 9, 9], &[3; 8]]);
        csa_translate_pack(CsaPack {
            topk: &cat(&[&layer0, &layer1]),
            block_tables: BlockTables { table: &[2, 0, 3, 1, 3, 0, 3, 1, 2], stride: 3 },
            positions: &c.positions,
            indptr: &c.csa_indptr,
            batch_id_per_token: &c.bids,
            skip_prefix_len_per_token: &[],
            out: &mut out,
            topk_layer_stride: 32,
            out_layer_stride: 30,
            envelope_rows: 132,
            topk_row_stride: 8,
            num_tokens: 4,
            num_layers: 2,
            block_capacity: 64,
            window_size: 8,
        })
        .unwrap();
        assert_eq!(&out[..3], &[265, 6, 398]);
        assert_eq!(&out[30..33], &[264, 265, 266]);
        assert_eq!(&out[47..52], &[2 * 132 + 63, 396, 396, 396, 397]);
        assert_eq!(&out[33..47], &one[3..17]);
    }

    /// The §6 batch on geometry B.
    #[test]
    fn prefill_builder_worked_example_and_csa_follow_up() {
        let g = geometry_b();
        assert_eq!(g.envelope_rows, 132);
        let (dense, csa, hca) =
            (g.window_params(0).unwrap(), g.window_params(4).unwrap(), g.window_params(128).unwrap());
        let p = |w: &WindowParams| (w.ring_start, w.slot_rows, w.ring_slots, w.ring_stride, w.run_rows);
        assert_eq!(p(&dense), (0, 110, 11, 11, 11));
        assert_eq!(p(&csa), (30, 110, 11, 64, 128));
        assert_eq!(p(&hca), (11, 110, 11, 2, 4));

        let positions = [0, 1, 2, 14, 15];
        let bids = [0, 0, 0, 1, 1];
        let tables = [7, 8, 21, 5];
        let (ext_ptr, swa_ptr, csa_ptr, hca_ptr) =
            ([0, 1, 3, 6, 7, 9], [0, 0, 0, 0, 7, 13], [0, 0, 0, 0, 9, 17], [0, 0, 0, 0, 8, 16]);
        let (mut ext, mut swa, mut csa_idx, mut hca_idx) =
            (vec![U; 10], vec![U; 14], vec![U; 18], vec![U; 17]);
        prefill_indices(PrefillIndices {
            dense,
            csa,
            hca,
            positions: &positions,
            bid_per_token: &bids,
            chunk_start_per_seq: &[0, 14],
            cu_seqlens_q_per_seq: &[0, 3],
            state_slot_per_seq: &[3, 0],
            n_committed_hca_per_seq: &[0, 2],
            block_tables: BlockTables { table: &tables, stride: 2 },
            extend: Csr { indptr: &ext_ptr, indices: &mut ext },
            prefix_swa: Some(Csr { indptr: &swa_ptr, indices: &mut swa }),
            prefix_csa: Csr { indptr: &csa_ptr, indices: &mut csa_idx },
            prefix_hca: Csr { indptr: &hca_ptr, indices: &mut hca_idx },
            envelope_rows: 132,
            num_tokens: 5,
            win: 8,
            hca_ratio: 8,
            hca_rows_per_block: 2,
        })
        .unwrap();
        assert_eq!(ext, vec![0, 0, 1, 0, 1, 2, 3, 3, 4, U]);
        assert_eq!(swa, vec![7, 8, 9, 10, 0, 1, 2, 8, 9, 10, 0, 1, 2, U]);
        assert_eq!(csa_idx, vec![U, U, 37, 38, 39, 40, 30, 31, 32, U, U, 38, 39, 40, 30, 31, 32, U]);
        assert_eq!(hca_idx, vec![24, 27, 28, 31, 11, 12, 15, 2772, 27, 28, 31, 11, 12, 15, 2772, 2773, U]);

        // §5 in prefill mode fills the CSA heads.
        let topk = cat(&[&[0, 0, 0, 0], &[0, 0, 0, 0], &[0, 0, 0, 0], &[2, 0, -1, -1], &[3, 65, -1, -1]]);
        csa_translate_pack(CsaPack {
            topk: &topk,
            block_tables: BlockTables { table: &tables, stride: 2 },
            positions: &[],
            indptr: &csa_ptr,
            batch_id_per_token: &bids,
            skip_prefix_len_per_token: &[0, 0, 0, 7, 6],
            out: &mut csa_idx,
            topk_layer_stride: 0,
            out_layer_stride: 0,
            envelope_rows: 132,
            topk_row_stride: 4,
            num_tokens: 5,
            num_layers: 1,
            block_capacity: 64,
            window_size: 0,
        })
        .unwrap();
        assert_eq!(
            csa_idx,
            vec![2774, 2772, 37, 38, 39, 40, 30, 31, 32, 2775, 661, 38, 39, 40, 30, 31, 32, U]
        );
    }

    #[test]
    fn prefill_without_dense_leaves_swa_alone() {
        let g = GeometrySpec::new(vec![4, 128, 4, 128], 40, 4, 11, 256).build().unwrap();
        let (csa, hca) = (g.window_params(4).unwrap(), g.window_params(128).unwrap());
        let (mut ext, mut csa_idx, mut hca_idx) = (vec![U; 2], vec![U; 9], vec![U; 8]);
        prefill_indices(PrefillIndices {
            dense: WindowParams::default(),
            csa,
            hca,
            positions: &[14],
            bid_per_token: &[0],
            chunk_start_per_seq: &[14],
            cu_seqlens_q_per_seq: &[0],
            state_slot_per_seq: &[0],
            n_committed_hca_per_seq: &[2],
            block_tables: BlockTables { table: &[21, 5], stride: 2 },
            extend: Csr { indptr: &[0, 1], indices: &mut ext },
            prefix_swa: None,
            prefix_csa: Csr { indptr: &[0, 9], indices: &mut csa_idx },
            prefix_hca: Csr { indptr: &[0, 8], indices: &mut hca_idx },
            envelope_rows: g.envelope_rows,
            num_tokens: 1,
            win: 8,
            hca_ratio: 8,
            hca_rows_per_block: 2,
        })
        .unwrap();
        assert_eq!(ext, vec![0, U]);
        assert_eq!(&csa_idx[..2], &[U, U]);
        assert_eq!(hca_idx[7], 21 * g.envelope_rows as i32);
    }

    fn kv_rows(n: usize, w: usize) -> Vec<u8> {
        (0..n * w).map(|i| (i * 7 + 3) as u8).collect()
    }

    #[test]
    fn ring_write_worked_example() {
        let g = geometry_a();
        let params = g.window_params(4).unwrap();
        let view_rows = g.layer_view_rows(3).unwrap();
        assert_eq!(view_rows, 1252);
        let (w0, w1) = (16usize, 4usize);
        let (kv0, kv1) = (kv_rows(6, w0), kv_rows(6, w1));
        let positions = [0, 1, 2, 3, 20, 21];
        let cu = [0, 4, 6];
        for (slots, written) in [
            ([3, 0], vec![(402, 1), (403, 2), (404, 3), (50, 4), (51, 5)]),
            ([3, 11], vec![(402, 1), (403, 2), (404, 3)]),
        ] {
            let mut pool0 = vec![0xa5u8; view_rows as usize * w0];
            let mut pool1 = vec![0x5au8; view_rows as usize * w1];
            let mut planes = [
                PlaneRows { kv: &kv0, pool: &mut pool0, row_bytes: w0 },
                PlaneRows { kv: &kv1, pool: &mut pool1, row_bytes: w1 },
            ];
            ring_write(&params, &mut planes, &positions, &cu, &slots, view_rows, 2, 3).unwrap();
            let mut expect0 = vec![0xa5u8; pool0.len()];
            let mut expect1 = vec![0x5au8; pool1.len()];
            for (row, src) in written {
                expect0[row * w0..(row + 1) * w0].copy_from_slice(&kv0[src * w0..(src + 1) * w0]);
                expect1[row * w1..(row + 1) * w1].copy_from_slice(&kv1[src * w1..(src + 1) * w1]);
            }
            assert!(pool0 == expect0 && pool1 == expect1, "slots {slots:?}");
        }
        // The stale slot's rows really are past the view.
        assert_eq!(window_row(&params, 11, 20).unwrap(), 1370);
        assert_eq!(window_row(&params, 11, 21).unwrap(), 1371);
    }

    #[test]
    fn row_scatter_skips_pads_and_out_of_view_rows() {
        let w = 8usize;
        let kv = kv_rows(5, w);
        let view_rows = 600i64;
        let mut pool = vec![0xeeu8; view_rows as usize * w];
        // dest rows of the §3 CSA class plus one past the view and one negative.
        let dest = [406, 50, 523, 7, 600];
        let bids = [0, 1, 2, -1, 0];
        let mut planes = [PlaneRows { kv: &kv, pool: &mut pool, row_bytes: w }];
        row_scatter(&mut planes, &bids, &dest, view_rows, 5).unwrap();
        let mut expect = vec![0xeeu8; view_rows as usize * w];
        for (t, row) in [(0usize, 406usize), (1, 50), (2, 523)] {
            expect[row * w..(row + 1) * w].copy_from_slice(&kv[t * w..(t + 1) * w]);
        }
        assert!(pool == expect);
    }

    #[test]
    fn raw_entry_matches_the_safe_reference() {
        // The §3 example through run_launch on host addresses.
        let g = geometry_a();
        let c = decode_case();
        let tables = [2, 0, 3, 1, 3, 0, 3, 1, 2];
        let (mut swa, mut csa, mut hca) = (vec![U; 22], vec![U; 30], vec![U; 25]);
        let mut dest = [vec![U; 4], vec![U; 4], vec![U; 4]];
        let addr = |s: &[i32]| s.as_ptr() as u64;
        let mut a = DecodeIndexArgs {
            state_slot_per_seq: addr(&c.slots),
            batch_id_per_token: addr(&c.bids),
            positions: c.positions.as_ptr() as u64,
            block_tables: addr(&tables),
            envelope_rows: 132,
            block_table_stride: 3,
            hca_rows_per_block: 2,
            num_tokens: 4,
            win: 8,
            ..Default::default()
        };
        let bufs = [(&c.swa_indptr, &mut swa), (&c.csa_indptr, &mut csa), (&c.hca_indptr, &mut hca)];
        for (i, ((indptr, indices), d)) in bufs.into_iter().zip(dest.iter_mut()).enumerate() {
            a.classes[i] = super::super::ClassBuffers {
                params: g.window_params([0, 4, 128][i]).unwrap(),
                indptr: addr(indptr),
                indices: indices.as_mut_ptr() as u64,
                dest_rows: d.as_mut_ptr() as u64,
            };
        }
        // SAFETY: every address is a live Vec of the length the arguments imply.
        unsafe { run_launch(&Launch::Decode(a)).unwrap() };
        let want = run_decode_case(&g, Some(&tables));
        assert_eq!((swa, csa, hca), (want.swa, want.csa, want.hca));
        assert_eq!(dest, want.dest);
    }

    #[test]
    fn raw_fill_and_copy_runs() {
        let mut buf = vec![0u32; 64];
        let base = buf.as_mut_ptr() as u64;
        let runs = [
            FillRun { dst: base + 4, bytes: 40, pattern: 0xff80_0000, _pad: 0 },
            FillRun { dst: base + 100, bytes: 8, pattern: 7, _pad: 0 },
        ];
        let a = FillRunsArgs { runs: runs.as_ptr() as u64, num_runs: 2, _pad: 0 };
        // SAFETY: the runs lie inside `buf`.
        unsafe { run_launch(&Launch::FillRuns(a)).unwrap() };
        let mut want = vec![0u32; 64];
        want[1..11].fill(0xff80_0000);
        want[25..27].fill(7);
        assert_eq!(buf, want);

        let src: Vec<u8> = (0..200u32).map(|i| (i * 13 + 1) as u8).collect();
        let mut dst = vec![0x11u8; 200];
        let runs = [
            CopyRun { src: src.as_ptr() as u64 + 3, dst: dst.as_mut_ptr() as u64 + 5, bytes: 50 },
            CopyRun { src: src.as_ptr() as u64 + 100, dst: dst.as_mut_ptr() as u64 + 100, bytes: 64 },
        ];
        let a = CopyRunsArgs { runs: runs.as_ptr() as u64, num_runs: 2, _pad: 0 };
        // SAFETY: the runs lie inside `src` and `dst`.
        unsafe { run_launch(&Launch::CopyRuns(a)).unwrap() };
        let mut want = vec![0x11u8; 200];
        want[5..55].copy_from_slice(&src[3..53]);
        want[100..164].copy_from_slice(&src[100..164]);
        assert_eq!(dst, want);

        let bad = [FillRun { dst: base + 2, bytes: 8, pattern: 1, _pad: 0 }];
        let a = FillRunsArgs { runs: bad.as_ptr() as u64, num_runs: 1, _pad: 0 };
        // SAFETY: rejected before any write.
        let err = unsafe { run_launch(&Launch::FillRuns(a)) }.unwrap_err();
        assert!(matches!(err, HostKernelError::FillRunUnaligned { run: 0, .. }));
    }
}
