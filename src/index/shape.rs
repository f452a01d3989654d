//! Launch geometry of every kernel, and the checks a launch must pass before any backend runs it.
//!
//! Both device backends take their grid and block from [`launch_shape`], so the CUDA and HIP
//! launches agree and match what `kernels/v4pool_kernels.cu` assumes (the kernels use the
//! constants below instead of reading the block size).
//!
//! **Empty launches.** Every grid dimension is at least 1: a launch with nothing to do (no
//! tokens, no runs, no layers) is still a valid launch of one block that returns at once,
//! never a zero grid. A captured graph therefore keeps its nodes whatever the batch holds;
//! backends need not (but may) skip such launches.
//!
//! [`check_launch`] rejects what the contract's error table (index-buffers.md §11) assigns to
//! the host and what can be seen without reading device memory: negative counts, missing
//! buffers, inconsistent class switches, window parameters no ring could have, a grid past the
//! hardware limits. The host backend additionally checks every index it reads.

mod check;

pub use check::{check_launch, LaunchError};

use super::{CsaPackArgs, DecodeIndexArgs, Launch, PrefillIndexArgs, CLASS_HCA};

/// Threads per block of every kernel but `v4pool_empty` (`V4POOL_BLOCK_THREADS`).
pub const BLOCK_THREADS: u32 = 256;
/// Lanes that copy one row together in the row kernels (`V4POOL_ROW_LANES`).
pub const ROW_LANES: u32 = 32;
/// Rows one block of the row kernels copies (`V4POOL_ROWS_PER_BLOCK`).
pub const ROWS_PER_BLOCK: u32 = BLOCK_THREADS / ROW_LANES;
/// Blocks that share one run in fill_runs / copy_runs, grid y (`V4POOL_RUN_SPLIT`).
pub const RUN_SPLIT: u32 = 32;
/// Largest grid y and z both vendors accept (`V4POOL_MAX_GRID_YZ`).
pub const MAX_GRID_YZ: u32 = 65_535;
/// Threads per block of the decode builder (`V4POOL_DECODE_THREADS`).
pub const DECODE_THREADS: u32 = 128;
/// Fused HCA head entries one decode-builder block writes (`V4POOL_DECODE_HCA_TILE`): 32 per
/// thread in eight 16-byte stores, so two tiles hold a 1M-context head (8,192 entries).
pub const DECODE_HCA_TILE: u32 = 32 * DECODE_THREADS;
/// FlashMLA compressed-row entries one decode-builder block writes per round
/// (`V4POOL_DECODE_FLASH_TILE`): the CSR head's tile, 32 per thread in eight 16-byte groups,
/// their table loads before their stores.
pub const DECODE_FLASH_TILE: u32 = DECODE_HCA_TILE;
/// FlashMLA compressed-row tiles the decode builder's grid holds over all its tokens, at most
/// (`V4POOL_DECODE_FLASH_BLOCKS`): a large batch fills the device with tokens, and every tile
/// past a token's row still costs a dispatch and three loads (the header says what it cost).
pub const DECODE_FLASH_BLOCKS: u32 = 4096;
/// Lanes that build one token's lists in the prefill builder (`V4POOL_PREFILL_LANES`).
pub const PREFILL_LANES: u32 = 64;
/// Tokens one prefill-builder block holds (`V4POOL_PREFILL_TOKENS_PER_BLOCK`).
pub const PREFILL_TOKENS_PER_BLOCK: u32 = BLOCK_THREADS / PREFILL_LANES;

/// Entries of one block FlashMLA's sparse decode loads at a time (its `TOPK_BLOCK_SIZE`).
pub const FLASHMLA_TOPK_BLOCK: i64 = 64;

/// Entries of a FlashMLA compressed (HCA extra) row of `width` entries the decode builder
/// writes for a row of `length` valid entries (index-buffers.md §3f; `v4p_flashmla_limit` in
/// the kernel): through the first multiple of [`FLASHMLA_TOPK_BLOCK`] strictly past the
/// length, at most `width`; a negative length counts as 0 (a pad: −1 through 64). FlashMLA
/// loads `ceil(length / 64)` blocks of a row, `length` read per batch entry, and makes every
/// entry at or past the length −1 before use (FlashMLA 9241ae3,
/// `csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh`): past the limit it loads nothing, so the
/// builder writes nothing there. "Strictly past" keeps a −1 after every row's length, for a
/// batch entry whose MTP tokens share the longest head (one more entry) as their length.
pub fn flashmla_row_limit(length: i64, width: i64) -> i64 {
    if length >= width {
        return width.max(0);
    }
    let blocks = length.max(0) / FLASHMLA_TOPK_BLOCK + 1;
    (blocks * FLASHMLA_TOPK_BLOCK).min(width).max(0)
}

/// Lanes per token of the prefill builder's short form (`V4POOL_PREFILL_SHORT_LANES`).
pub const PREFILL_SHORT_LANES: u32 = 16;
/// The longest HCA head the short form is launched for (`V4POOL_PREFILL_SHORT_HEAD`).
pub const PREFILL_SHORT_HEAD: u64 = 256;

/// Whether a prefill launch runs the short form (`v4pool_prefill_indices_short`, 16 lanes per
/// token): no token's HCA head can pass [`PREFILL_SHORT_HEAD`] entries, the most one
/// block-table row describes (`block_table_stride * hca_rows_per_block`). Only the
/// arguments' scalars decide (a graph replays the shape with new contents). Short heads are
/// bound by per-token latency and prologue, which fewer lanes per token spread over more
/// resident tokens; long heads want 64 lanes' loads in flight (H200, BENCHMARKS.md).
pub fn prefill_short(a: &PrefillIndexArgs) -> bool {
    prefill_max_head(a) <= PREFILL_SHORT_HEAD
}

/// The longest HCA head a prefill launch can write: what one block-table row describes
/// (none when the coarse slot is packed per layer: the builder writes windows only).
fn prefill_max_head(a: &PrefillIndexArgs) -> u64 {
    if a.coarse_packed != 0 {
        return 0;
    }
    count(a.block_table_stride) * count(a.hca_rows_per_block)
}

/// The fewest tokens a prefill launch pairs (`v4pool_prefill_indices_pair`).
pub const PREFILL_PAIR_MIN_TOKENS: i32 = 4096;
/// The longest HCA head (`block_table_stride * hca_rows_per_block`) a paired launch serves.
pub const PREFILL_PAIR_MAX_HEAD: u64 = 4096;

/// Whether a long-form prefill launch runs the paired form (`v4pool_prefill_indices_pair`: two
/// consecutive tokens per 64 lanes, their HCA heads from one set of table loads): rows per
/// block 2, at least [`PREFILL_PAIR_MIN_TOKENS`] tokens, and heads of at most
/// [`PREFILL_PAIR_MAX_HEAD`] entries. Pairing halves the block-table reads, which bound the
/// builder while the rows are L2-resident (H200, 8,192 tokens at 128K: 15.55 µs against
/// 17.28); with fewer tokens its grid is too small (2,048 at 128K: 8.83 against 7.49), and
/// past 512K-token rows the builder is bound by its DRAM writes, where pairing lost (8,192 at
/// 1M: 89.31 against 85.81; mixed contexts up to 1M: 41.81 against 38.54). Only the
/// arguments' scalars decide, as for the short form.
pub fn prefill_pair(a: &PrefillIndexArgs) -> bool {
    !prefill_short(a)
        && a.hca_rows_per_block == 2
        && a.num_tokens >= PREFILL_PAIR_MIN_TOKENS
        && prefill_max_head(a) <= PREFILL_PAIR_MAX_HEAD
}

/// Tokens one block of a prefill launch builds: 256 lanes over [`prefill_lanes`] per token,
/// twice as many in the paired form.
pub fn prefill_tokens_per_block(a: &PrefillIndexArgs) -> u32 {
    BLOCK_THREADS / prefill_lanes(a) * if prefill_pair(a) { 2 } else { 1 }
}

/// Lanes per token of a prefill launch: [`PREFILL_SHORT_LANES`] or [`PREFILL_LANES`].
pub fn prefill_lanes(a: &PrefillIndexArgs) -> u32 {
    if prefill_short(a) {
        PREFILL_SHORT_LANES
    } else {
        PREFILL_LANES
    }
}
/// Top-k columns one CSA translate-pack block covers, grid y (`V4POOL_CSA_TILE`): the gather
/// form and the staged decode form for top-k rows up to this long.
pub const CSA_TILE: u32 = 2 * BLOCK_THREADS;
/// Top-k columns one block of the wide staged decode form covers (`V4POOL_CSA_TILE_X4`), for
/// rows longer than [`CSA_TILE`]: V4-Pro's 1,024 is one tile, 2,048 two.
pub const CSA_TILE_X4: u32 = 4 * BLOCK_THREADS;

/// Whether a CSA translate-pack launch runs a staged decode form
/// (`v4pool_csa_translate_pack_staged[_x4]`): decode mode (`window_size > 0`) and a non-empty
/// top-k row. Those forms load everything but the top-k, the token's block-table row included
/// (into shared memory), before they wait for the kernel before them, so a graph of per-layer
/// packs keeps one dependent round trip per layer instead of two. Prefill rows are not bounded
/// by a position, so prefill launches gather table entries instead. Only the arguments'
/// scalars decide (a graph replays the shape with new contents).
pub fn csa_staged(a: &CsaPackArgs) -> bool {
    a.window_size > 0 && a.topk_row_stride > 0
}

/// Whether a staged decode launch takes the wide form (four columns per thread, tiles of
/// [`CSA_TILE_X4`]): rows longer than [`CSA_TILE`]. H200, 21 per-layer packs at batch 256
/// (BENCHMARKS.md): top-k 1,024 in 34.9 µs against 40.3 with two columns per thread; 2,048 in
/// 46.6 against 69.4. At 512 two per thread win (29.2 against 31.9).
pub fn csa_wide(a: &CsaPackArgs) -> bool {
    csa_staged(a) && a.topk_row_stride as u32 > CSA_TILE
}

/// Top-k columns per block of this launch.
pub fn csa_tile(a: &CsaPackArgs) -> u32 {
    if csa_wide(a) {
        CSA_TILE_X4
    } else {
        CSA_TILE
    }
}
/// Elements one lane of the state update moves per chunk (`V4POOL_STATE_CHUNK`).
pub const STATE_CHUNK: u32 = 8;
/// Lanes that write one 1024-B window row in the §9 gather (`V4POOL_GATHER_LANES`).
pub const GATHER_LANES: u32 = 64;
/// Window rows one §9 gather block writes, grid y (`V4POOL_GATHER_ROWS_PER_BLOCK`).
pub const GATHER_ROWS_PER_BLOCK: u32 = 8;

/// Grid and block of one launch, in CUDA/HIP order (x, y, z).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchShape {
    /// Blocks per grid dimension.
    pub grid: [u32; 3],
    /// Threads per block dimension.
    pub block: [u32; 3],
}

impl LaunchShape {
    fn linear(blocks: u64, threads: u32) -> Self {
        LaunchShape { grid: [grid_dim(blocks), 1, 1], block: [threads, 1, 1] }
    }

    /// Blocks in the grid.
    pub fn blocks(&self) -> u64 {
        self.grid.iter().map(|&d| u64::from(d)).product()
    }

    /// Threads per block.
    pub fn threads_per_block(&self) -> u32 {
        self.block.iter().product()
    }
}

/// A grid dimension: at least 1 (see the module doc), at most `u32::MAX`.
fn grid_dim(n: u64) -> u32 {
    u32::try_from(n.max(1)).unwrap_or(u32::MAX)
}

fn count(n: i32) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn ceil_div(n: u64, d: u64) -> u64 {
    n.div_ceil(d)
}

/// Tiles of one top-k row in the CSA translate-pack (grid y); the kernel derives the same
/// number from `topk_row_stride` to stride past a row should `valid_k` exceed it.
///
/// FlashMLA mode (`extra_topk > 0`, §5f) writes whole rows (the −1 tail included): the tiles
/// cover the longer of the top-k row and the output row.
pub fn csa_tiles(a: &CsaPackArgs) -> u64 {
    ceil_div(count(a.topk_row_stride).max(count(a.extra_topk)), u64::from(csa_tile(a))).max(1)
}

/// Lanes of the state update that share one plan row: the power of two covering
/// `dim / STATE_CHUNK` chunks, at most a block (`v4p_state_lanes` in the kernel).
pub fn state_update_lanes(dim: i32) -> u32 {
    let chunks = count(dim.max(1)).div_ceil(u64::from(STATE_CHUNK));
    let mut lanes = 1u32;
    while u64::from(lanes) < chunks && lanes < BLOCK_THREADS {
        lanes *= 2;
    }
    lanes
}

/// Tiles of a token's fused HCA head in the decode builder (grid x after the token's window
/// block: the grid is `[1 + tiles, tokens, 1]`). The grid may depend only
/// on the arguments' scalars (graphs replay it with new contents), so it covers the longest
/// head one block-table row can describe, `block_table_stride * hca_rows_per_block` entries;
/// tiles past a token's head return at once. One tile when nothing is fused. The kernel
/// derives the same number (`v4p_decode_hca_tiles`) and strides by it, so a cap at
/// `MAX_GRID_YZ` loses nothing.
///
/// FlashMLA's compressed part (§3f, `flashmla[HCA].extra_indices`) is a whole row of
/// `extra_topk` entries (the −1 tail included) in tiles of [`DECODE_FLASH_TILE`], at most
/// [`DECODE_FLASH_BLOCKS`] tiles over all tokens (each strides by the count); the grid has the
/// more tiles of that row and the CSR head.
pub fn decode_hca_tiles(a: &DecodeIndexArgs) -> u64 {
    let hca = &a.classes[CLASS_HCA];
    if a.block_tables == 0 || hca.indptr == 0 {
        return 1;
    }
    let csr = if hca.indices != 0 { count(a.block_table_stride) * count(a.hca_rows_per_block) } else { 0 };
    let fm = &a.flashmla[CLASS_HCA];
    let flash = if fm.extra_indices != 0 { count(fm.extra_topk) } else { 0 };
    let spread = ceil_div(u64::from(DECODE_FLASH_BLOCKS), count(a.num_tokens).max(1));
    ceil_div(csr, u64::from(DECODE_HCA_TILE))
        .max(ceil_div(flash, u64::from(DECODE_FLASH_TILE)).min(spread))
        .clamp(1, u64::from(MAX_GRID_YZ))
}

/// Grid and block of a launch. Total for any arguments; run [`check_launch`] first to know the
/// arguments are valid (a shape past the hardware limits is one of its errors).
pub fn launch_shape(launch: &Launch) -> LaunchShape {
    let b = BLOCK_THREADS;
    match launch {
        // (window block + tiles of the token's fused HCA head, token): a token's blocks side by
        // side, so they are dispatched together.
        Launch::Decode(a) => {
            let blocks_per_token = if a.num_tokens > 0 { 1 + decode_hca_tiles(a) } else { 1 };
            LaunchShape {
                grid: [grid_dim(blocks_per_token), grid_dim(count(a.num_tokens)), 1],
                block: [DECODE_THREADS, 1, 1],
            }
        }
        // prefill_lanes(a) lanes per token, the rest of the block other tokens.
        Launch::Prefill(a) => {
            LaunchShape::linear(ceil_div(count(a.num_tokens), u64::from(prefill_tokens_per_block(a))), b)
        }
        // One thread per entry.
        Launch::HcaOffsets(a) => LaunchShape::linear(ceil_div(count(a.num_entries), u64::from(b)), b),
        // (token, tile of the top-k row).
        Launch::CsaPack(a) => {
            LaunchShape { grid: [grid_dim(count(a.num_tokens)), grid_dim(csa_tiles(a)), 1], block: [b, 1, 1] }
        }
        // (sequence, group of ROWS_PER_BLOCK ring rows).
        Launch::RingWrite(a) => LaunchShape {
            grid: [
                grid_dim(count(a.num_seqs)),
                grid_dim(ceil_div(count(a.write_per_batch), u64::from(ROWS_PER_BLOCK))),
                1,
            ],
            block: [b, 1, 1],
        },
        Launch::RowScatter(a) => {
            LaunchShape::linear(ceil_div(count(a.num_tokens), u64::from(ROWS_PER_BLOCK)), b)
        }
        Launch::KvRows(a) => LaunchShape::linear(ceil_div(count(a.num_tokens), u64::from(ROWS_PER_BLOCK)), b),
        Launch::IndexKeys(a) => {
            LaunchShape::linear(ceil_div(count(a.num_tokens), u64::from(ROWS_PER_BLOCK)), b)
        }
        // BLOCK_THREADS / lanes plan rows per block.
        Launch::StateUpdate(a) => {
            LaunchShape::linear(ceil_div(count(a.num_rows), u64::from(b / state_update_lanes(a.dim))), b)
        }
        // (run, RUN_SPLIT blocks per run).
        Launch::FillRuns(a) => {
            LaunchShape { grid: [grid_dim(count(a.num_runs)), RUN_SPLIT, 1], block: [b, 1, 1] }
        }
        Launch::CopyRuns(a) => {
            LaunchShape { grid: [grid_dim(count(a.num_runs)), RUN_SPLIT, 1], block: [b, 1, 1] }
        }
        // (sequence, group of GATHER_ROWS_PER_BLOCK window rows).
        Launch::WindowGather(a) | Launch::WindowGatherFp8(a) => LaunchShape {
            grid: [
                grid_dim(count(a.num_seqs)),
                grid_dim(ceil_div(count(a.draft_window), u64::from(GATHER_ROWS_PER_BLOCK))),
                1,
            ],
            block: [b, 1, 1],
        },
        // Every item's own grid, side by side.
        Launch::WriteBatch(a) => LaunchShape::linear(count(a.num_blocks), b),
        Launch::Empty => LaunchShape { grid: [1, 1, 1], block: [1, 1, 1] },
    }
}

/// Blocks a write the batch kernel carries takes: its own kernel's grid (linear for every kind
/// a [`super::WriteItem`] holds), `None` for any other launch.
pub fn write_item_blocks(launch: &Launch) -> Option<u64> {
    match launch {
        Launch::KvRows(_) | Launch::IndexKeys(_) | Launch::StateUpdate(_) => {
            Some(launch_shape(launch).blocks())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::WindowParams;
    use crate::index::{
        ClassBuffers, CopyRunsArgs, FillRunsArgs, HcaOffsetsArgs, PlaneWrite, RingWriteArgs, RowScatterArgs,
        StateUpdateArgs,
    };

    fn params() -> WindowParams {
        WindowParams { ring_start: 41, slot_rows: 120, ring_slots: 11, ring_stride: 64, run_rows: 128 }
    }

    fn decode(t: i32) -> DecodeIndexArgs {
        let mut a = DecodeIndexArgs { num_tokens: t, win: 8, ..Default::default() };
        a.classes[1] = ClassBuffers { params: params(), indptr: 0x100, indices: 0x200, dest_rows: 0x300 };
        a.state_slot_per_seq = 0x400;
        a.batch_id_per_token = 0x500;
        a.positions = 0x600;
        a
    }

    #[test]
    fn empty_launches_are_one_block() {
        for l in [
            Launch::Decode(decode(0)),
            Launch::HcaOffsets(HcaOffsetsArgs {
                rows_per_block: 2,
                block_table_stride: 1,
                ..Default::default()
            }),
            Launch::FillRuns(FillRunsArgs::default()),
            Launch::CopyRuns(CopyRunsArgs::default()),
            Launch::RowScatter(RowScatterArgs::default()),
            Launch::Empty,
        ] {
            let s = launch_shape(&l);
            assert!(s.grid.iter().all(|&d| d >= 1), "{l:?} -> {s:?}");
            assert_eq!(s.grid[0], 1);
            assert!(s.blocks() <= u64::from(RUN_SPLIT));
        }
    }

    #[test]
    fn shapes_cover_the_work() {
        // Without fused heads: a token's window block and one (empty) head tile.
        assert_eq!(launch_shape(&Launch::Decode(decode(256))).grid, [2, 256, 1]);
        assert_eq!(launch_shape(&Launch::Decode(decode(256))).block, [DECODE_THREADS, 1, 1]);
        // Fused heads: tiles of DECODE_HCA_TILE entries over the longest head a table row holds
        // (1M contexts: 4,096 blocks of 2 rows = 8,192 entries, two tiles).
        let mut d = decode(256);
        d.classes[CLASS_HCA] = ClassBuffers { params: params(), indptr: 0x700, indices: 0x800, dest_rows: 0 };
        d.block_tables = 0x900;
        d.hca_rows_per_block = 2;
        // (window block + head tiles of 4,096 entries, token): 1M contexts are 2 tiles.
        d.block_table_stride = 2048;
        assert_eq!(launch_shape(&Launch::Decode(d)).grid, [2, 256, 1]);
        assert_eq!(launch_shape(&Launch::Decode(d)).block, [DECODE_THREADS, 1, 1]);
        d.block_table_stride = 4096;
        assert_eq!(launch_shape(&Launch::Decode(d)).grid, [3, 256, 1]);
        d.block_table_stride = 4097;
        assert_eq!(launch_shape(&Launch::Decode(d)).grid, [4, 256, 1]);
        d.block_table_stride = 16_385;
        assert_eq!(launch_shape(&Launch::Decode(d)).grid, [10, 256, 1]);
        d.block_tables = 0; // peer mode: nothing fused
        assert_eq!(launch_shape(&Launch::Decode(d)).grid, [2, 256, 1]);
        let mut huge = decode(3);
        huge.classes[CLASS_HCA] = d.classes[CLASS_HCA];
        huge.block_tables = 0x900;
        huge.hca_rows_per_block = i32::MAX;
        huge.block_table_stride = i32::MAX;
        assert_eq!(launch_shape(&Launch::Decode(huge)).grid, [1 + MAX_GRID_YZ, 3, 1]);
        assert_eq!(check_launch(&Launch::Decode(huge)), Ok(()));
        // Tokens are grid y: at most MAX_GRID_YZ of them.
        let mut many = decode(MAX_GRID_YZ as i32);
        assert_eq!(check_launch(&Launch::Decode(many)), Ok(()));
        many.num_tokens += 1;
        assert!(matches!(
            check_launch(&Launch::Decode(many)),
            Err(LaunchError::TooLarge { field: "num_tokens", .. })
        ));
        // (token, CSA_TILE columns); decode rows past CSA_TILE take CSA_TILE_X4 columns.
        for (stride, tiles, decode_tiles) in
            [(0, 1, 1), (1, 1, 1), (512, 1, 1), (513, 2, 1), (1024, 2, 1), (2048, 4, 2), (2049, 5, 3)]
        {
            let csa = CsaPackArgs { num_tokens: 7, topk_row_stride: stride, ..Default::default() };
            assert_eq!(csa_tiles(&csa), tiles, "top-k row {stride}");
            assert_eq!(launch_shape(&Launch::CsaPack(csa)).grid, [7, tiles as u32, 1]);
            let dec = CsaPackArgs { window_size: 128, ..csa };
            assert_eq!(csa_tiles(&dec), decode_tiles, "decode top-k row {stride}");
            assert_eq!(launch_shape(&Launch::CsaPack(dec)).grid, [7, decode_tiles as u32, 1]);
            let want = match stride {
                0 => "v4pool_csa_translate_pack",
                1..=512 => "v4pool_csa_translate_pack_staged",
                _ => "v4pool_csa_translate_pack_staged_x4",
            };
            assert_eq!(Launch::CsaPack(dec).symbol(), want, "decode top-k row {stride}");
            assert_eq!(Launch::CsaPack(csa).symbol(), "v4pool_csa_translate_pack");
        }
        let csa = CsaPackArgs { num_tokens: 0, topk_row_stride: 0, ..Default::default() };
        assert_eq!(launch_shape(&Launch::CsaPack(csa)).grid, [1, 1, 1]);
        // Prefill: four tokens per block, sixteen (the short form) while stride * rpb <= 256.
        let mut pre = PrefillIndexArgs {
            num_tokens: 9,
            block_table_stride: 129,
            hca_rows_per_block: 2,
            ..Default::default()
        };
        assert_eq!(launch_shape(&Launch::Prefill(pre)).grid, [3, 1, 1]);
        assert_eq!(Launch::Prefill(pre).symbol(), "v4pool_prefill_indices");
        pre.block_table_stride = 128;
        pre.num_tokens = 33;
        assert_eq!(launch_shape(&Launch::Prefill(pre)).grid, [3, 1, 1]);
        assert_eq!(Launch::Prefill(pre).symbol(), "v4pool_prefill_indices_short");
        // Paired: eight tokens per block for 4,096+ tokens over heads of at most 4,096 entries.
        pre.num_tokens = 8192;
        pre.block_table_stride = 2048;
        assert_eq!(launch_shape(&Launch::Prefill(pre)).grid, [1024, 1, 1]);
        assert_eq!(Launch::Prefill(pre).symbol(), "v4pool_prefill_indices_pair");
        for (tokens, stride, rpb) in [(4095, 2048, 2), (8192, 2049, 2), (8192, 1365, 3)] {
            let p = PrefillIndexArgs {
                num_tokens: tokens,
                block_table_stride: stride,
                hca_rows_per_block: rpb,
                ..pre
            };
            assert_eq!(Launch::Prefill(p).symbol(), "v4pool_prefill_indices", "{tokens} {stride} {rpb}");
            assert_eq!(launch_shape(&Launch::Prefill(p)).grid, [(tokens as u32).div_ceil(4), 1, 1]);
        }
        let ring = RingWriteArgs { num_seqs: 3, write_per_batch: 128, ..Default::default() };
        assert_eq!(launch_shape(&Launch::RingWrite(ring)).grid, [3, 16, 1]);
        let ring = RingWriteArgs { num_seqs: 3, write_per_batch: 9, ..Default::default() };
        assert_eq!(launch_shape(&Launch::RingWrite(ring)).grid, [3, 2, 1]);
        let rs = RowScatterArgs { num_tokens: 17, ..Default::default() };
        assert_eq!(launch_shape(&Launch::RowScatter(rs)).grid, [3, 1, 1]);
        let h = HcaOffsetsArgs { num_entries: 257, ..Default::default() };
        assert_eq!(launch_shape(&Launch::HcaOffsets(h)).grid, [2, 1, 1]);
        let f = FillRunsArgs { num_runs: 5, ..Default::default() };
        assert_eq!(launch_shape(&Launch::FillRuns(f)).grid, [5, RUN_SPLIT, 1]);
    }

    #[test]
    fn decode_checks() {
        assert_eq!(check_launch(&Launch::Decode(decode(4))), Ok(()));
        assert_eq!(check_launch(&Launch::Decode(decode(0))), Ok(()));
        let mut a = decode(4);
        a.classes[1].dest_rows = 0;
        assert_eq!(check_launch(&Launch::Decode(a)), Err(LaunchError::NoDestRows));
        let mut a = decode(4);
        a.classes[1] = ClassBuffers::default();
        assert_eq!(check_launch(&Launch::Decode(a)), Err(LaunchError::NoClass));
        let mut a = decode(4);
        a.classes[0].indices = 0x10;
        assert!(matches!(check_launch(&Launch::Decode(a)), Err(LaunchError::UnexpectedBuffer { .. })));
        let mut a = decode(4);
        a.win = 12;
        assert_eq!(
            check_launch(&Launch::Decode(a)),
            Err(LaunchError::WindowExceedsRing { class: "csa", win: 12, ring_slots: 11 })
        );
        let mut a = decode(4);
        a.classes[1].params.ring_stride = 0;
        assert!(matches!(check_launch(&Launch::Decode(a)), Err(LaunchError::BadWindowParams { .. })));
        let mut a = decode(-1);
        a.num_tokens = -1;
        assert_eq!(
            check_launch(&Launch::Decode(a)),
            Err(LaunchError::Negative { field: "num_tokens", value: -1 })
        );
    }

    #[test]
    fn ring_write_checks() {
        let mut a = RingWriteArgs {
            params: params(),
            num_seqs: 2,
            write_per_batch: 11,
            view_rows: 100,
            positions: 1,
            cu_seqlens_q: 2,
            state_slot_per_seq: 3,
            ..Default::default()
        };
        a.planes[0] = PlaneWrite { kv: 4, pool: 5, row_bytes: 512 };
        assert_eq!(check_launch(&Launch::RingWrite(a)), Ok(()));
        let mut b = a;
        b.write_per_batch = 12;
        assert_eq!(
            check_launch(&Launch::RingWrite(b)),
            Err(LaunchError::TooLarge { field: "write_per_batch", value: 12, max: 11 })
        );
        let mut b = a;
        b.write_per_batch = 0;
        assert!(check_launch(&Launch::RingWrite(b)).is_err());
        let mut b = a;
        b.num_seqs = 0;
        assert!(check_launch(&Launch::RingWrite(b)).is_err());
        let mut b = a;
        b.planes[1].pool = 9;
        assert_eq!(check_launch(&Launch::RingWrite(b)), Err(LaunchError::PlaneHalfGiven { plane: 1 }));
    }

    #[test]
    fn state_update_rows_per_block_and_checks() {
        // No idle lane at the V4 dims: 32 / 64 / 128 lanes, 8 / 4 / 2 rows per block.
        for (dim, lanes) in [(256, 32), (512, 64), (1024, 128), (8, 1), (13, 2), (4096, 256), (0, 1)] {
            assert_eq!(state_update_lanes(dim), lanes, "dim {dim}");
        }
        let a = StateUpdateArgs {
            kv: 0x100,
            score: 0x200,
            ape: 0x300,
            write_plan: 0x400,
            kv_state: 0x1000,
            score_state: 0x2000,
            kv_slot_bytes: 9 * 1024 * 4,
            score_slot_bytes: 9 * 1024 * 4,
            kv_row_stride: 1024,
            score_row_stride: 1024,
            num_rows: 5,
            dim: 1024,
            ring: 9,
            window: 8,
            ratio: 4,
            in_dtype: 1,
            ..Default::default()
        };
        assert_eq!(check_launch(&Launch::StateUpdate(a)), Ok(()));
        assert_eq!(launch_shape(&Launch::StateUpdate(a)).grid, [3, 1, 1]);
        let bad = |f: fn(&mut StateUpdateArgs)| {
            let mut b = a;
            f(&mut b);
            check_launch(&Launch::StateUpdate(b))
        };
        assert_eq!(bad(|b| b.ring = 7), Err(LaunchError::TooSmall { field: "ring", value: 7, min: 8 }));
        assert_eq!(bad(|b| b.in_dtype = 2), Err(LaunchError::BadCode { field: "in_dtype", value: 2 }));
        assert!(matches!(
            bad(|b| b.write_plan = 0x408),
            Err(LaunchError::Misaligned { field: "write_plan", .. })
        ));
        assert!(matches!(bad(|b| b.kv_row_stride = 1000), Err(LaunchError::TooSmall { .. })));
        assert!(matches!(bad(|b| b.kv_slot_bytes = 4), Err(LaunchError::TooSmall { .. })));
        assert_eq!(bad(|b| b.ape = 0), Err(LaunchError::MissingBuffer { field: "ape" }));
        assert_eq!(bad(|b| b.num_rows = -1), Err(LaunchError::Negative { field: "num_rows", value: -1 }));
    }

    #[test]
    fn csa_pack_needs_a_skip_buffer_without_a_window() {
        let a = CsaPackArgs {
            topk: 1,
            block_tables: 2,
            indptr: 3,
            batch_id_per_token: 4,
            out: 5,
            num_tokens: 2,
            block_capacity: 64,
            compress_ratio: 4,
            block_table_stride: 3,
            topk_row_stride: 8,
            ..Default::default()
        };
        assert_eq!(
            check_launch(&Launch::CsaPack(a)),
            Err(LaunchError::MissingBuffer { field: "skip_prefix_len_per_token" })
        );
        let b = CsaPackArgs { window_size: 8, positions: 6, ..a };
        assert_eq!(check_launch(&Launch::CsaPack(b)), Ok(()));
        let c = CsaPackArgs { topk_row_stride: i32::MAX, ..b };
        assert!(matches!(
            check_launch(&Launch::CsaPack(c)),
            Err(LaunchError::TooLarge { field: "grid y", .. })
        ));
    }
}
