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

use super::shape::LaunchError;
use crate::checked::{add, mul};
use crate::geometry::WindowParams;
use thiserror::Error;

// The builders and translate-pack (§3–§6), the row movers (§7) and the raw-pointer entry live
// in their own files; every public name stays at `crate::index::host::*`.
mod build;
mod gather;
mod keys;
mod pack;
mod raw;
mod rows;
mod state;
#[cfg(test)]
mod tests;

pub use build::{
    csa_translate_pack, decode_indices, hca_offsets, prefill_indices, CsaPack, Csr, DecodeClass,
    DecodeIndices, FlashMlaClass, FlashMlaExtra, FlashMlaPack, PrefillIndices,
};
pub use gather::{dequant_fp8_row, e8m0_scale, fp8_scaled_bf16, window_gather, GatherPlanes};
pub use keys::{
    e2m1_rne, e8m0_of_amax_e2m1, fp8_key_format, index_keys, key_block_bytes, pack_fp4_key, pack_fp8_key,
    KeyCache, FP8_KEY_AMAX_FLOOR,
};
pub use pack::{e4m3_rne, e8m0_of_amax, kv_rows, pack_fp8_row, KvPlanes};
pub use raw::run_launch;
pub use rows::{fill_pattern, ring_write, row_scatter, PlaneRows};
pub use state::{update_compressor_states, StateMemory};

crate::checked::overflow_into!(HostKernelError);

crate::variant::variant_names! {
/// Why a host kernel refused or stopped.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HostKernelError {
    #[error(transparent)]
    /// A failure of the layer below ([`LaunchError`]).
    Launch(#[from] LaunchError),
    #[error("{buffer}[{index}] is outside the buffer (length {len})")]
    /// Index `index` of `buffer` is outside the buffer (length `len`).
    OutOfBounds {
        /// Which buffer.
        buffer: &'static str,
        /// The index.
        index: i64,
        /// Length.
        len: usize,
    },
    #[error("{what} = {value} does not fit an i32")]
    /// `what` = `value` does not fit an i32.
    NotI32 {
        /// What was computed or checked.
        what: &'static str,
        /// The value given.
        value: i64,
    },
    #[error("{what} overflows 64-bit arithmetic")]
    /// `what` overflows 64-bit arithmetic.
    Overflow {
        /// What was computed or checked.
        what: &'static str,
    },
    #[error("window params {params:?} are not a ring (ring_slots and ring_stride must be >= 1)")]
    /// Window params `params` are not a ring (ring_slots and ring_stride must be >= 1).
    NotARing {
        /// The parameters given.
        params: WindowParams,
    },
    #[error("{what} = {value} must be at least 1")]
    /// `what` = `value` must be at least 1.
    ZeroDivisor {
        /// What was computed or checked.
        what: &'static str,
        /// The value given.
        value: i64,
    },
    #[error("sequence {seq}: block table column {column} is outside [0, {stride})")]
    /// Sequence `seq`: block table column `column` is outside [0, `stride`).
    TableColumn {
        /// Sequence (batch row).
        seq: i64,
        /// Column of the table.
        column: i64,
        /// The stride.
        stride: i64,
    },
    #[error("entry_idx[{index}] = {entry} is negative")]
    /// `entry_idx[`index`]` = `entry` is negative.
    NegativeEntry {
        /// The index.
        index: i64,
        /// The entry read.
        entry: i64,
    },
    #[error("token {token}: valid_k {valid_k} exceeds the top-k row stride {row_stride}")]
    /// Token `token`: valid_k `valid_k` exceeds the top-k row stride `row_stride`.
    TopkPastRow {
        /// The token.
        token: i64,
        /// Top-k entries the token reads.
        valid_k: i64,
        /// Elements per top-k row.
        row_stride: i64,
    },
    #[error("{buffer}: token {token} has {entries} entries, its row holds {width}")]
    /// `buffer`: token `token` has `entries` entries, more than its FlashMLA row's `width`.
    PastRow {
        /// Which buffer.
        buffer: &'static str,
        /// The token.
        token: i64,
        /// Entries the token has.
        entries: i64,
        /// Entries per row.
        width: i64,
    },
    #[error("{buffer}: address {addr:#x} is null or not {align}-byte aligned")]
    /// `buffer`: address `addr` is null or not `align`-byte aligned.
    BadAddress {
        /// Which buffer.
        buffer: &'static str,
        /// The address.
        addr: u64,
        /// Required alignment in bytes.
        align: usize,
    },
    #[error("{buffer}: {len} elements do not fit this host's address space")]
    /// `buffer`: `len` elements do not fit this host's address space.
    TooLong {
        /// Which buffer.
        buffer: &'static str,
        /// Length.
        len: i64,
    },
    #[error("fill run {run}: dst {dst:#x} and bytes {bytes} must be multiples of 4")]
    /// Fill run `run`: dst `dst` and bytes `bytes` must be multiples of 4.
    FillRunUnaligned {
        /// Index of the run.
        run: usize,
        /// Destination address.
        dst: u64,
        /// Bytes.
        bytes: u64,
    },
    #[error("copy run {run}: source and destination overlap")]
    /// Copy run `run`: source and destination overlap.
    CopyRunOverlap {
        /// Index of the run.
        run: usize,
    },
    #[error("{buffer}: rows are {got} bytes, expected {expected}")]
    /// `buffer`: rows are `got` bytes, expected `expected`.
    RowWidth {
        /// Which buffer.
        buffer: &'static str,
        /// The value given.
        got: usize,
        /// The value expected.
        expected: usize,
    },
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
    /// A write batch whose item table does not describe its grid.
    #[error("write batch item {item}: {reason}")]
    BadWriteBatch {
        /// The item.
        item: usize,
        /// What is wrong with it.
        reason: String,
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

/// A block table `[bs, stride]`, row-major.
#[derive(Clone, Copy, Debug)]
pub struct BlockTables<'a> {
    /// Rows `[bs, stride]`, row-major.
    pub table: &'a [i32],
    /// Columns per row.
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
#[allow(clippy::too_many_arguments)] // the head's inputs as the kernel takes them
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
