//! The kernel contract (`docs/index-buffers.md`): by-value launch arguments that
//! every backend takes, and the host reference of every kernel.
//!
//! Each `*Args` struct is `#[repr(C)]` and `Pod`, passed to its kernel **by value** as the
//! kernel's single parameter; `kernels/v4pool_common.h` declares the same structs and a test
//! checks size, alignment and field offsets on both sides. Pointers are raw device
//! addresses (`u64`); `0` means "absent" where a field says so. Everything that moves with
//! the batch lives behind a pointer, so a captured graph replays with new contents; the
//! scalars are fixed for the life of an allocation (window params, envelope rows) or are
//! sizes of the persistent buffers.
//!
//! Element types: positions are `i64` in decode and CSA pack, `i32` in prefill and the ring
//! write (as the contract allows); everything else is `i32`.
//!
//! Every index a builder or pack writes is relative to a layer view and lies in
//! `[0, view_rows)`, also where layers share compressors (V4.1): a reader reaches its owner's
//! compressed rows through a non-negative per-layer compress bias, the views starting in a
//! lead below plane row 0 where the spec's bias would be negative (open point O1, decided in
//! `docs/v41.md`); −1 stays the pad value of every top-k and index buffer.

pub mod bounds;
mod gather;
pub mod host;
pub mod shape;

mod with;

pub use gather::{
    WindowGatherArgs, FP8_NOPE_ROW_BYTES, FP8_NOPE_VALUES, FP8_TILE, GATHER_ROW_BYTES, ROPE_ROW_BYTES,
};

use crate::format::RowFormatId;
use crate::geometry::WindowParams;
use crate::geometry::NUM_SLOTS;
use bytemuck::{Pod, Zeroable};

/// Raw device address (a host address on the host backend).
pub type DevicePtr = u64;

/// Class slots in the decode builder's `classes` array (kernel-side numbering; the typed
/// form is [`crate::Class`], whose discriminants these are).
pub const CLASS_DENSE: usize = crate::Class::Dense as usize;
/// The CSA class's slot (see [`CLASS_DENSE`]).
pub const CLASS_CSA: usize = crate::Class::Csa as usize;
/// The HCA class's slot (see [`CLASS_DENSE`]).
pub const CLASS_HCA: usize = crate::Class::Hca as usize;

/// One class's buffers in the decode builder. The class is off when `indptr == 0`
/// (then `indices` and `dest_rows` must be 0 too and nothing of the class is stored).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct ClassBuffers {
    /// The class's window parameters.
    pub params: WindowParams,
    /// i32 [>= T+1]
    pub indptr: DevicePtr,
    /// i32 out
    pub indices: DevicePtr,
    /// i32 out [>= T]; 0 = no destination rows for this class.
    pub dest_rows: DevicePtr,
}

/// One class's outputs of the decode builder in FlashMLA's sparse-decode convention
/// (index-buffers.md §3f): dense rows, valid entries left, a −1 tail, a length per token, each
/// index a page-aligned view's (`Pool::page_view(layer, plane, 64)`): view index + the view's
/// `shift`. A class's layers whose views have different shifts get one **view** each (HCA:
/// every layer); the views' rows are one allocation, `[num_views][num_tokens][topk]`, view `v`
/// at element `v * num_tokens * topk` (a stride derived from the scalars, so no pointer table
/// is loaded on the kernel's critical path; the shifts are one small device array). The
/// lengths are the same for every view: one array each. Off when `indices == 0` (then every
/// other field must be 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct FlashMlaOut {
    /// i32 out `[num_views][num_tokens][topk]`: the window part (FlashMLA's `indices`), the
    /// window rows oldest first, shifted, then −1.
    pub indices: DevicePtr,
    /// i32 out `[num_tokens]`: window entries per token (FlashMLA's `topk_length`).
    pub topk_length: DevicePtr,
    /// i32 out `[num_views][num_tokens][extra_topk]`: the compressed part
    /// (`extra_indices_in_kvcache`): HCA only, with `block_tables` (entries `0..head` from the
    /// tables, shifted, then −1 through [`shape::flashmla_row_limit`]`(head, extra_topk)`;
    /// nothing past it, so a row is valid only with `extra_topk_length`); 0 = not written by
    /// the builder (the CSA part is the pack's).
    pub extra_indices: DevicePtr,
    /// i32 out `[num_tokens]`: compressed entries per token (`extra_topk_length`); with
    /// `extra_indices`.
    pub extra_topk_length: DevicePtr,
    /// i32 `[num_views]`: each view's shift (`page_view`'s `row_shift`, base row mod 64).
    pub shifts: DevicePtr,
    /// Entries per row of `indices` (≥ `win`; FlashMLA wants a multiple of 64).
    pub topk: i32,
    /// Entries per row of `extra_indices` (0 without it).
    pub extra_topk: i32,
    /// Views (≥ 1 when on).
    pub num_views: i32,
    /// Padding to the C layout.
    pub _pad: i32,
}

/// Decode index builder (§3) with the HCA heads (§4) fused: one launch per decode step.
///
/// Per live token `t` (batch id >= 0): every enabled class gets its window tail
/// (`n = min(pos+1, win)` rows, oldest first, ending at `indptr[t+1]`) and its dest row.
/// When `block_tables != 0` the HCA class's head `[indptr[t], indptr[t+1]-n)` is filled with
/// compressed entries `e = 0..head`: `block_tables[b][e / rpb] * envelope_rows + e % rpb`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct DecodeIndexArgs {
    /// [dense, csa, hca], see `CLASS_*`.
    pub classes: [ClassBuffers; NUM_SLOTS],
    /// `i32 [bs]`: physical slot per sequence.
    pub state_slot_per_seq: DevicePtr,
    /// i32 [>= T]; -1 = pad.
    pub batch_id_per_token: DevicePtr,
    /// i64 [>= T]
    pub positions: DevicePtr,
    /// i32 [bs, block_table_stride]; 0 = leave HCA heads to someone else (peer mode).
    pub block_tables: DevicePtr,
    /// Rows from one block's compressed rows to the next (the geometry's `compress_stride`:
    /// the envelope's rows, or a packed pool's compressed rows a block).
    pub envelope_rows: i64,
    /// Columns per block-table row.
    pub block_table_stride: i32,
    /// Rows one block holds per HCA layer (`block_size / 128`, 2 in production).
    pub hca_rows_per_block: i32,
    /// Tokens in the grid, pads included.
    pub num_tokens: i32,
    /// Sliding window (≤ ring_slots).
    pub win: i32,
    /// [dense, csa, hca]: each class's FlashMLA outputs (§3f); all zero = CSR only. A class is
    /// still on or off by its `indptr` (its slice lengths: window `n`, HCA head
    /// `indptr[t+1] − indptr[t] − n`), and writes its CSR `indices` only when that is given.
    pub flashmla: [FlashMlaOut; NUM_SLOTS],
}

/// Prefill index builder (§6): one launch per prefill forward, no pad tokens.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct PrefillIndexArgs {
    /// Dense window parameters.
    pub dense: WindowParams,
    /// CSA window parameters.
    pub csa: WindowParams,
    /// HCA window parameters.
    pub hca: WindowParams,
    /// `i32 [T]`
    pub positions: DevicePtr,
    /// `i32 [T]`
    pub bid_per_token: DevicePtr,
    /// `i32 [bs]`
    pub chunk_start_per_seq: DevicePtr,
    /// `i32 [bs]`
    pub cu_seqlens_q_per_seq: DevicePtr,
    /// `i32 [bs]`
    pub state_slot_per_seq: DevicePtr,
    /// `i32 [bs]`
    pub n_committed_hca_per_seq: DevicePtr,
    /// i32 [bs, block_table_stride]
    pub block_tables: DevicePtr,
    /// i32 [>= T+1]
    pub extend_indptr: DevicePtr,
    /// i32 out
    pub extend_indices: DevicePtr,
    /// 0 when the geometry has no dense class (then `prefix_swa` is untouched).
    pub swa_indptr: DevicePtr,
    /// i32 out (with `swa_indptr`; both 0 without a dense class)
    pub swa_indices: DevicePtr,
    /// i32 [>= T+1]
    pub csa_indptr: DevicePtr,
    /// i32 out: `[top-k head (left to the pack) | window rows]`
    pub csa_indices: DevicePtr,
    /// i32 [>= T+1]
    pub hca_indptr: DevicePtr,
    /// i32 out: `[window rows | compressed]` (`coarse_packed`: `[head | window rows]`)
    pub hca_indices: DevicePtr,
    /// Compressed rows from one block to the next (`compress_stride`; see `DecodeIndexArgs`).
    pub envelope_rows: i64,
    /// Columns per block-table row.
    pub block_table_stride: i32,
    /// Tokens (exact; prefill has no pads).
    pub num_tokens: i32,
    /// Sliding window (≤ ring_slots).
    pub win: i32,
    /// HCA compress ratio (128).
    pub hca_ratio: i32,
    /// HCA rows one block holds per layer (`block_size / 128`).
    pub hca_rows_per_block: i32,
    /// 0: V4's coarse slice `[window rows | compressed]`, the compressed head from the block
    /// tables (class-wide). 1: the coarse slot is filled per layer by the translate-pack
    /// (V4.1, `UnifiedPoolGeometry::coarse_head_fill` false): `[top-k head (left to the
    /// pack) | window rows]`, as the CSA slice; the builder writes only the window tail.
    pub coarse_packed: i32,
}

/// HCA compressed offsets (§4) as a standalone gather.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct HcaOffsetsArgs {
    /// `i32 [N]`
    pub entry_idx: DevicePtr,
    /// `i32 [N]`
    pub bid_per_entry: DevicePtr,
    /// i32 [bs, block_table_stride]
    pub block_tables: DevicePtr,
    /// `i32 out [N]`
    pub out: DevicePtr,
    /// Compressed rows from one block to the next (`compress_stride`; see `DecodeIndexArgs`).
    pub envelope_rows: i64,
    /// Columns per block-table row.
    pub block_table_stride: i32,
    /// HCA rows one block holds per layer.
    pub rows_per_block: i32,
    /// Entries (N).
    pub num_entries: i32,
    /// Padding to the C layout.
    pub _pad: i32,
}

/// CSA translate-and-pack (§5) for one CSA layer: one launch per layer, as a forward pass runs
/// it (layer L's top-k exists only after layer L's indexer ran), into the one CSA buffer.
///
/// **Input readiness.** Only `topk` may be the output of the kernel just before the pack in
/// the stream. Every other input (`block_tables`, `positions`, `indptr`,
/// `batch_id_per_token`, `skip_prefix_len_per_token`) must be complete before the kernel
/// preceding the pack in the stream *starts*: the CUDA backend launches packs as programmatic
/// dependents (`CudaBackend::overlapped_launches`), and in decode mode the kernel reads those
/// inputs — the block-table row into shared memory included — before it waits for its
/// predecessor, while a chain of such launches may still be running ahead of it. v4pool's own
/// paths satisfy this by construction (the host uploads them when a batch is staged, before
/// the builder; no kernel writes them). A launch whose metadata is written by the kernel
/// right before the pack must be made without overlap (`set_overlapped_launches(false)`) or
/// with a non-overlapped kernel between the writer and the pack.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct CsaPackArgs {
    /// i32 [T, topk_row_stride]
    pub topk: DevicePtr,
    /// i32 [bs, block_table_stride]
    pub block_tables: DevicePtr,
    /// i64 [>= T]; read only when `window_size > 0`.
    pub positions: DevicePtr,
    /// i32 [>= T+1]
    pub indptr: DevicePtr,
    /// i32 [>= T]
    pub batch_id_per_token: DevicePtr,
    /// i32 [>= T]; required when `window_size == 0`.
    pub skip_prefix_len_per_token: DevicePtr,
    /// `i32 out [>= indptr[T]]`
    pub out: DevicePtr,
    /// Compressed rows from one block to the next (`compress_stride`; see `DecodeIndexArgs`).
    pub envelope_rows: i64,
    /// Elements from one top-k row to the next (≥ index_topk).
    pub topk_row_stride: i32,
    /// Columns per block-table row.
    pub block_table_stride: i32,
    /// Tokens in the grid (T).
    pub num_tokens: i32,
    /// Compressed rows per block of the class (`block_size / ratio`: 64 for V4's CSA).
    pub block_capacity: i32,
    /// Window length (decode: skip derived per token), or 0 (prefill: the skip buffer).
    pub window_size: i32,
    /// The class's compress ratio (4 for V4's CSA; 1 or 2 for V4.1): a token at position p
    /// reaches `(p + 1) / ratio` rows. Only bounds the columns the decode form stages, so
    /// the result never depends on it; at least 1.
    pub compress_ratio: i32,
    /// Added to every packed row: the layer's compress bias (0 in V4; a V4.1 layer reaches
    /// its owner's rows through it, `docs/v41.md`), never negative.
    pub compress_bias: i64,
    /// FlashMLA's convention (§5f, decode only): i32 out `[>= T]`, each token's packed entries
    /// (`extra_topk_length`); with `extra_topk > 0`, else 0.
    pub extra_topk_length: DevicePtr,
    /// 0: CSR (`out` at `indptr[t]`, §5). > 0: FlashMLA's `extra_indices_in_kvcache`, `out` is
    /// i32 `[T][extra_topk]`: row t's `valid_k` entries (a negative top-k value → −1), each
    /// + `shift`, then −1 to the row's end; pads a row of −1 and length 0.
    pub extra_topk: i32,
    /// FlashMLA mode: the CSA layer's page-view shift, added to every packed row; else 0.
    pub shift: i32,
}

/// One plane a row write targets: `pool` is the layer view's base in that plane.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct PlaneWrite {
    /// [T, row_bytes] source rows.
    pub kv: DevicePtr,
    /// Layer view base.
    pub pool: DevicePtr,
    /// Bytes per row.
    pub row_bytes: i64,
}

/// SWA ring write (§7): the last `w = min(tok, write_per_batch)` tokens of each sequence
/// to their window rows, in up to two planes; rows outside `[0, view_rows)` are dropped.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct RingWriteArgs {
    /// The layer's class window parameters.
    pub params: WindowParams,
    /// `planes[1].pool == 0` when the pool has one plane.
    pub planes: [PlaneWrite; 2],
    /// i32 [>= T]
    pub positions: DevicePtr,
    /// i32 [bs+1]
    pub cu_seqlens_q: DevicePtr,
    /// `i32 [bs]`
    pub state_slot_per_seq: DevicePtr,
    /// Rows of the layer view; rows outside it are dropped.
    pub view_rows: i64,
    /// Sequences (bs ≥ 1).
    pub num_seqs: i32,
    /// Most tokens written per sequence (1..=ring_slots).
    pub write_per_batch: i32,
}

/// Row scatter (§7, decode): `kv[t]` to `pool[dest_rows[t]]` for live tokens with an
/// in-range row, in up to two planes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct RowScatterArgs {
    /// Up to two planes (`planes[1].pool == 0`: one plane).
    pub planes: [PlaneWrite; 2],
    /// i32 [>= T]
    pub batch_id_per_token: DevicePtr,
    /// i32 [>= T]
    pub dest_rows: DevicePtr,
    /// Rows of the layer view; rows outside it are dropped.
    pub view_rows: i64,
    /// Tokens in the grid, pads included.
    pub num_tokens: i32,
    /// Padding to the C layout.
    pub _pad: i32,
}

/// Values in one KV row the model hands over: 448 NoPE, then 64 RoPE (head_dim 512).
pub const KV_ROW_VALUES: usize = crate::format::KV_ROW_VALUES;

/// bf16 KV rows into the pool's row format (docs/forward.md): `kv[t]` (512 bf16: 448 NoPE
/// values, then 64 RoPE) to row `dest_rows[t]` of the layer view, for every token whose batch id
/// is not negative (`batch_id_per_token == 0`: every token) and whose row is in
/// `[0, view_rows)`, in the row format `format` names ([`KV_ROWS_BF16`], [`KV_ROWS_ATOM_FP8`],
/// [`KV_ROWS_FLASHMLA_V41`]; `crate::format` describes each): ATOM's fp8 packs the NoPE part into
/// e4m3 values with seven e8m0 tile scales (`index::host::pack_fp8_row`) and copies the RoPE part
/// into the second plane; bf16 copies all 512 values into the one plane; FlashMLA's V4.1 packs
/// all 512 into e4m3 with an e8m0 scale per 32 (528-B rows, one plane).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct KvRowsArgs {
    /// bf16 `[T][kv_row_stride]`.
    pub kv: DevicePtr,
    /// i32 `[>= T]`: the row of the layer view each token goes to.
    pub dest_rows: DevicePtr,
    /// i32 `[>= T]`, or 0 (no pads).
    pub batch_id_per_token: DevicePtr,
    /// Layer view base of the NoPE plane (ATOM's fp8) or of the format's one plane.
    pub nope: DevicePtr,
    /// Layer view base of the RoPE plane (ATOM's fp8), else 0.
    pub rope: DevicePtr,
    /// Elements from one source row to the next (>= 512).
    pub kv_row_stride: i64,
    /// Rows of the layer view; rows outside it are dropped.
    pub view_rows: i64,
    /// Tokens in the grid.
    pub num_tokens: i32,
    /// The row format: [`KV_ROWS_BF16`], [`KV_ROWS_ATOM_FP8`], [`KV_ROWS_FLASHMLA_V41`],
    /// [`KV_ROWS_FLASHMLA_V4`], [`KV_ROWS_FLASHMLA_V4_P2`] or [`KV_ROWS_FLASHMLA_V41_FP4`].
    pub format: i32,
    /// Paged formats ([`KV_ROWS_FLASHMLA_V4`], [`KV_ROWS_FLASHMLA_V4_P2`]): `nope` is the
    /// plane's row 0 (its first page)
    /// and view row `r` is plane row `view_row0 + r`, whose bytes the page arithmetic places;
    /// 0 for the unpaged formats.
    pub view_row0: i64,
}

/// `KvRowsArgs::format`: the bf16 pool's one plane of 1,024-B rows.
pub const KV_ROWS_BF16: i32 = RowFormatId::Bf16.kernel_code();
/// `KvRowsArgs::format`: ATOM's fp8 pool, a 512-B NoPE plane and a 128-B RoPE plane.
pub const KV_ROWS_ATOM_FP8: i32 = RowFormatId::AtomFp8.kernel_code();
/// `KvRowsArgs::format`: FlashMLA's V4.1 fp8 rows, one plane of 528-B rows.
pub const KV_ROWS_FLASHMLA_V41: i32 = RowFormatId::FlashMlaV41.kernel_code();
/// Bytes of a FlashMLA V4.1 row: 512 e4m3, then 16 e8m0 scales (`crate::format`).
pub const FLASHMLA_V41_ROW_BYTES: u64 = 528;
/// `KvRowsArgs::format`: FlashMLA's V4 rows, one plane of 584-B rows in pages of 64 (a page:
/// 64 data rows of 448 e4m3 + 64 bf16, then 64 scale rows of 7 e8m0 + a pad byte).
pub const KV_ROWS_FLASHMLA_V4: i32 = RowFormatId::FlashMlaV4.kernel_code();
/// Bytes of a FlashMLA V4 row (576 data + 8 scale bytes; paged, `crate::format`).
pub const FLASHMLA_V4_ROW_BYTES: u64 = 584;
/// `KvRowsArgs::format`: FlashMLA's V4 rows in pages of 2 (`crate::format`'s `flashmla-v4-p2`:
/// a page is 2 data rows of 576 B, then their 2 scale rows of 8 B).
pub const KV_ROWS_FLASHMLA_V4_P2: i32 = RowFormatId::FlashMlaV4P2.kernel_code();
/// `KvRowsArgs::format`: FlashMLA's V4.1 fp4 rows, 288 B (256 B e2m1, 32 e4m3 scales): the
/// compressed rows of a packed pool (`crate::geometry::PackedRows`).
pub const KV_ROWS_FLASHMLA_V41_FP4: i32 = RowFormatId::FlashMlaV41Fp4.kernel_code();
/// Bytes of a FlashMLA V4.1 fp4 row (`crate::format`'s `flashmla-v41-fp4`).
pub const FLASHMLA_V41_FP4_ROW_BYTES: u64 = 288;

/// Values of one indexer key row (V4's `index_head_dim`).
pub const INDEX_KEY_VALUES: usize = 128;

/// `IndexKeysArgs::format`: the bf16 indexer cache (256-B rows, keys copied).
pub const INDEX_KEYS_BF16: i32 = 0;
/// `IndexKeysArgs::format`: the FP8 indexer cache (per block `[rows × 128 e4m3][rows × f32]`).
pub const INDEX_KEYS_FP8: i32 = 1;
/// `IndexKeysArgs::format`: the FP4 indexer cache (e2m1 data `[4][rows][16]`, e8m0 scales
/// `[4][rows]`, in two pools).
pub const INDEX_KEYS_FP4: i32 = 2;
/// `IndexKeysArgs::format`: ATOM's preshuffled FP8 indexer cache in OCP e4m3 (`fp8_max` 448;
/// gfx950, gfx1250): `crate::format::ATOM_FP8_KEYS`. Blocks of a multiple of 16 rows.
pub const INDEX_KEYS_ATOM_FP8: i32 = 3;
/// `IndexKeysArgs::format`: ATOM's preshuffled FP8 indexer cache in e4m3fnuz (`fp8_max` 240;
/// gfx942): `crate::format::ATOM_FP8_FNUZ_KEYS`. Blocks of a multiple of 16 rows.
pub const INDEX_KEYS_ATOM_FP8_FNUZ: i32 = 4;

/// The indexer's key rows into one CSA layer's indexer K cache (docs/forward.md, "Indexer
/// keys"): `keys[t]` (128 bf16) to entry `dest[t] = block × block_rows + row` of the layer's
/// cache, for every `t < num_tokens` whose entry is in `[0, num_blocks × block_rows)` (others
/// dropped). `format` picks the cache's row format ([`INDEX_KEYS_BF16`], [`INDEX_KEYS_FP8`],
/// [`INDEX_KEYS_FP4`]); the quantisation is `index::host::keys`' formula, bit for bit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct IndexKeysArgs {
    /// bf16 `[T][key_row_stride]`.
    pub keys: DevicePtr,
    /// i32 `[>= T]`: `block × block_rows + row`.
    pub dest: DevicePtr,
    /// The layer's cache at block 0 (FP4: its data pool).
    pub data: DevicePtr,
    /// FP4: the layer's scale pool at block 0; otherwise 0.
    pub scales: DevicePtr,
    /// Elements from one key row to the next (>= 128).
    pub key_row_stride: i64,
    /// Blocks of the cache.
    pub num_blocks: i64,
    /// Keys in the grid (T).
    pub num_tokens: i32,
    /// Rows one block holds per layer (64 for V4's CSA).
    pub block_rows: i32,
    /// The cache's row format (`INDEX_KEYS_*`).
    pub format: i32,
    /// Padding to the C layout.
    pub _pad: i32,
}

/// `WriteItem::kind`: a [`KvRowsArgs`] write.
pub const WRITE_KV_ROWS: i32 = 1;
/// `WriteItem::kind`: an [`IndexKeysArgs`] write.
pub const WRITE_INDEX_KEYS: i32 = 2;
/// `WriteItem::kind`: a [`StateUpdateArgs`] write.
pub const WRITE_STATE_UPDATE: i32 = 3;
/// Most items one [`WriteBatchArgs`] launch carries.
pub const WRITE_BATCH_MAX_ITEMS: usize = 128;

/// One write of a [`WriteBatchArgs`] launch: `kind` (`WRITE_*`) names which argument struct
/// `args` holds (its bytes from offset 0, the rest zero): the same arguments, and the same
/// blocks, the write's own kernel takes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct WriteItem {
    /// `WRITE_KV_ROWS`, `WRITE_INDEX_KEYS` or `WRITE_STATE_UPDATE`.
    pub kind: i32,
    /// Padding to the C layout.
    pub _pad: i32,
    /// The argument struct's bytes (a union of the three in the kernel header).
    pub args: [u64; 15],
}

impl WriteItem {
    /// The item running `launch`, if it is a write the batch kernel carries.
    pub fn of(launch: &Launch) -> Option<WriteItem> {
        let (kind, bytes): (i32, &[u8]) = match launch {
            Launch::KvRows(a) => (WRITE_KV_ROWS, bytemuck::bytes_of(a)),
            Launch::IndexKeys(a) => (WRITE_INDEX_KEYS, bytemuck::bytes_of(a)),
            Launch::StateUpdate(a) => (WRITE_STATE_UPDATE, bytemuck::bytes_of(a)),
            _ => return None,
        };
        let mut item = WriteItem { kind, ..Default::default() };
        bytemuck::bytes_of_mut(&mut item.args)[..bytes.len()].copy_from_slice(bytes);
        Some(item)
    }

    /// The launch this item stands for (`None`: an unknown kind).
    pub fn launch(&self) -> Option<Launch> {
        let bytes = bytemuck::bytes_of(&self.args);
        fn read<T: Pod>(b: &[u8]) -> T {
            bytemuck::pod_read_unaligned(&b[..std::mem::size_of::<T>()])
        }
        match self.kind {
            WRITE_KV_ROWS => Some(Launch::KvRows(read(bytes))),
            WRITE_INDEX_KEYS => Some(Launch::IndexKeys(read(bytes))),
            WRITE_STATE_UPDATE => Some(Launch::StateUpdate(read(bytes))),
            _ => None,
        }
    }
}

/// Several independent writes in one launch (docs/forward.md, "Fewer launches"): block `b` of
/// the grid runs block `b − first_block[i]` of item `i`, the last item whose `first_block` is
/// at most `b`, exactly as the item's own kernel runs that block. The items may run in any
/// order and at once: none may read what another writes, and no two may write one byte (the
/// pool's writes of one layer, or the state updates of many, are such a set). Item `i` covers
/// `first_block[i] .. first_block[i + 1]` (the last: `.. num_blocks`), its own kernel's grid.
///
/// **Input readiness** (the kernel is a programmatic dependent, as the CSA translate-pack): the
/// two tables, every state item's `write_plan`, every index-key item's `dest`, and the
/// `dest_rows` of every KV row item with `batch_id_per_token == 0` are read before the kernel
/// waits for its predecessor, so they must be complete before the kernel preceding the batch in
/// the stream *starts*; v4pool's writers stage all of them by host upload. Everything else (the
/// engine's kv / score / keys, a decode write's destination rows and batch ids) is read after
/// the wait and may be the previous kernel's output.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct WriteBatchArgs {
    /// `WriteItem [num_items]` in device memory, 8-byte aligned.
    pub items: DevicePtr,
    /// i32 `[num_items]` in device memory: each item's first block, `0` first, increasing.
    pub first_block: DevicePtr,
    /// Items (1 ..= `WRITE_BATCH_MAX_ITEMS`).
    pub num_items: i32,
    /// Blocks of the grid: the items' grids together.
    pub num_blocks: i32,
}

/// Element type of a state-update input (`V4POOL_DTYPE_*`): what an engine's compressor
/// emits (kv, score) and the positional bias (ape) are either; the state is always f32.
#[repr(i32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ElemType {
    /// 32-bit float.
    #[default]
    F32 = 0,
    /// bfloat16 (widened exactly to f32).
    Bf16 = 1,
}

impl ElemType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            ElemType::F32 => 4,
            ElemType::Bf16 => 2,
        }
    }
    /// The kernel-side code of a raw `in_dtype` / `ape_dtype` field, if it names a type.
    pub fn from_code(code: i32) -> Option<ElemType> {
        match code {
            0 => Some(ElemType::F32),
            1 => Some(ElemType::Bf16),
            _ => None,
        }
    }
}

/// Compressor-state update (§8) for one compressor of one layer: per plan row with a
/// non-negative position, `kv_state[s][pos % ring] = f32(kv[ragged])` and
/// `score_state[s][pos % ring] = f32(score[ragged]) + f32(ape[pos % ratio])`.
///
/// Plan rows are `(ragged_id, batch_id, position, slot)`; `s = slot_map[batch_id]` when
/// `slot_map != 0` (the contract's form), else the row's own column 3 (v4pool's staging
/// writes the physical slot there). State addresses are `kv_state + s * kv_slot_bytes +
/// (pos % ring) * dim * 4`, 64-bit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct StateUpdateArgs {
    /// `[rows][kv_row_stride]` elements of `in_dtype`.
    pub kv: DevicePtr,
    /// `[rows][score_row_stride]` elements of `in_dtype`.
    pub score: DevicePtr,
    /// `[ratio][dim]` elements of `ape_dtype`, contiguous.
    pub ape: DevicePtr,
    /// i32 `[num_rows][4]`, 16-byte aligned.
    pub write_plan: DevicePtr,
    /// i32 `[bs]`; 0 = the slot is the plan row's column 3.
    pub slot_map: DevicePtr,
    /// f32 `[positions][ring][dim]` at position 0, positions `kv_slot_bytes` apart.
    pub kv_state: DevicePtr,
    /// f32, as `kv_state`, positions `score_slot_bytes` apart.
    pub score_state: DevicePtr,
    /// Bytes from one slot position's kv state to the next.
    pub kv_slot_bytes: i64,
    /// Bytes from one slot position's score state to the next.
    pub score_slot_bytes: i64,
    /// Elements from one kv row to the next (≥ dim).
    pub kv_row_stride: i64,
    /// Elements from one score row to the next (≥ dim).
    pub score_row_stride: i64,
    /// Plan rows in the grid, pads (negative positions) included.
    pub num_rows: i32,
    /// Elements per row.
    pub dim: i32,
    /// S: state rows per slot (the ring modulo).
    pub ring: i32,
    /// K = (2 if overlap else 1) · ratio; `ring >= window` is checked.
    pub window: i32,
    /// Rows of `ape` (the compress ratio).
    pub ratio: i32,
    /// [`ElemType`] code of kv and score.
    pub in_dtype: i32,
    /// [`ElemType`] code of ape.
    pub ape_dtype: i32,
    /// Padding to the C layout.
    pub _pad: i32,
}

/// A byte range to fill with a repeated 32-bit pattern (compressor-state initialisation:
/// `0xff80_0000` is f32 −inf, 0 is kv). `dst` and `bytes` are multiples of 4.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct FillRun {
    /// Destination address (4-byte aligned).
    pub dst: DevicePtr,
    /// Bytes to fill (a multiple of 4).
    pub bytes: u64,
    /// The 32-bit word repeated over the range.
    pub pattern: u32,
    /// Padding to the C layout.
    pub _pad: u32,
}

/// Compressor-state initialisation: every run of a descriptor in device memory, one launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct FillRunsArgs {
    /// `FillRun [num_runs]` in device memory.
    pub runs: DevicePtr,
    /// Runs in the descriptor.
    pub num_runs: i32,
    /// Padding to the C layout.
    pub _pad: i32,
}

/// A byte range to copy; source and destination must not overlap.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CopyRun {
    /// Source address.
    pub src: DevicePtr,
    /// Destination address.
    pub dst: DevicePtr,
    /// Bytes to copy.
    pub bytes: u64,
}

/// Slot copy (checkpoints, restores, relocations): every run of a descriptor, one launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct CopyRunsArgs {
    /// `CopyRun [num_runs]` in device memory.
    pub runs: DevicePtr,
    /// Runs in the descriptor.
    pub num_runs: i32,
    /// Padding to the C layout.
    pub _pad: i32,
}

/// One kernel launch, as every backend takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launch {
    /// `v4pool_decode_indices`
    Decode(DecodeIndexArgs),
    /// `v4pool_prefill_indices`, or `v4pool_prefill_indices_short` for short HCA heads
    /// ([`shape::prefill_short`]).
    Prefill(PrefillIndexArgs),
    /// `v4pool_hca_offsets`
    HcaOffsets(HcaOffsetsArgs),
    /// `v4pool_csa_translate_pack`
    CsaPack(CsaPackArgs),
    /// `v4pool_ring_write`
    RingWrite(RingWriteArgs),
    /// `v4pool_row_scatter`
    RowScatter(RowScatterArgs),
    /// `v4pool_update_compressor_states`
    StateUpdate(StateUpdateArgs),
    /// `v4pool_fill_runs`
    FillRuns(FillRunsArgs),
    /// `v4pool_copy_runs`
    CopyRuns(CopyRunsArgs),
    /// `v4pool_window_gather`: §9 window gather of 1024-B bf16 rows.
    WindowGather(WindowGatherArgs),
    /// `v4pool_window_gather_fp8`: §9 window gather from the fp8 NoPE and bf16 RoPE planes.
    WindowGatherFp8(WindowGatherArgs),
    /// `v4pool_kv_rows`: bf16 KV rows into the pool's row format.
    KvRows(KvRowsArgs),
    /// `v4pool_index_keys`: the indexer's bf16 keys into an indexer K cache's row format.
    IndexKeys(IndexKeysArgs),
    /// `v4pool_write_batch`: KV row, index-key and state-update writes in one launch.
    WriteBatch(WriteBatchArgs),
    /// `v4pool_empty`: the launch-overhead floor benchmarks measure against.
    Empty,
}

impl Launch {
    /// The kernel symbol this launch runs (`extern "C"`, `v4pool_` prefix).
    pub fn symbol(&self) -> &'static str {
        match self {
            Launch::Decode(_) => "v4pool_decode_indices",
            Launch::Prefill(a) if shape::prefill_short(a) => "v4pool_prefill_indices_short",
            Launch::Prefill(a) if shape::prefill_pair(a) => "v4pool_prefill_indices_pair",
            Launch::Prefill(_) => "v4pool_prefill_indices",
            Launch::HcaOffsets(_) => "v4pool_hca_offsets",
            Launch::CsaPack(a) if shape::csa_wide(a) => "v4pool_csa_translate_pack_staged_x4",
            Launch::CsaPack(a) if shape::csa_staged(a) => "v4pool_csa_translate_pack_staged",
            Launch::CsaPack(_) => "v4pool_csa_translate_pack",
            Launch::RingWrite(_) => "v4pool_ring_write",
            Launch::RowScatter(_) => "v4pool_row_scatter",
            Launch::StateUpdate(_) => "v4pool_update_compressor_states",
            Launch::FillRuns(_) => "v4pool_fill_runs",
            Launch::CopyRuns(_) => "v4pool_copy_runs",
            Launch::WindowGather(_) => "v4pool_window_gather",
            Launch::WindowGatherFp8(_) => "v4pool_window_gather_fp8",
            Launch::KvRows(_) => "v4pool_kv_rows",
            Launch::IndexKeys(_) => "v4pool_index_keys",
            Launch::WriteBatch(_) => "v4pool_write_batch",
            Launch::Empty => "v4pool_empty",
        }
    }

    /// Every kernel symbol, for module loading and the code-object symbol test.
    pub const SYMBOLS: [&'static str; 19] = [
        "v4pool_decode_indices",
        "v4pool_prefill_indices",
        "v4pool_prefill_indices_short",
        "v4pool_prefill_indices_pair",
        "v4pool_hca_offsets",
        "v4pool_csa_translate_pack",
        "v4pool_csa_translate_pack_staged",
        "v4pool_csa_translate_pack_staged_x4",
        "v4pool_ring_write",
        "v4pool_row_scatter",
        "v4pool_update_compressor_states",
        "v4pool_fill_runs",
        "v4pool_copy_runs",
        "v4pool_window_gather",
        "v4pool_window_gather_fp8",
        "v4pool_kv_rows",
        "v4pool_empty",
        "v4pool_index_keys",
        "v4pool_write_batch",
    ];
}
