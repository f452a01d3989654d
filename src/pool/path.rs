//! The index paths as handles the pool gives out: [`DecodePath`] and [`PrefillPath`].
//!
//! An engine's decode step is: stage the batch, build, (per CSA layer) translate-pack,
//! then hand the index buffers to attention. A handle owns its device buffers (freed on
//! drop), holds the pool it indexes (so the backend and stream are the pool's, and live
//! slot positions and block ids are read from the pool itself), and its staging and build
//! calls are safe: they touch only the handle's own memory and validate every position,
//! block id and size first. Only the translate-pack, which reads an engine's raw top-k
//! pointer, is `unsafe`.
//!
//! Both handles hold an `Arc<Pool>` and no borrow, so bindings can keep them as `'static`
//! objects.

use super::decode::{
    DecodeBuffer, DecodeCapacity, DecodeError, DecodeIndexBuffers, DecodeSeq, FlashMlaBuffers,
    FlashMlaWidths, FlatDecodeBatch, PoolBounds,
};
use super::owned::DeviceBuffer;
use super::prefill::{PrefillBuffer, PrefillCapacity, PrefillIndexBuffers, PrefillSeq};
use super::{Pool, PoolError};
use crate::backend::Stream;
use crate::geometry::{Class, UnifiedPoolGeometry};
use crate::index::{DevicePtr, Launch};
use std::sync::Arc;

impl Pool {
    /// The decode path for this pool: persistent buffers sized for `cap` on the pool's
    /// backend and stream. See [`DecodePath`].
    pub fn decode_path(self: &Arc<Self>, cap: DecodeCapacity) -> Result<DecodePath, DecodeError> {
        DecodePath::new(Arc::clone(self), cap)
    }

    /// A decode path in FlashMLA's convention ([`DecodePath::new_flashmla`]).
    pub fn flashmla_decode_path(
        self: &Arc<Self>,
        cap: DecodeCapacity,
        widths: FlashMlaWidths,
    ) -> Result<DecodePath, DecodeError> {
        DecodePath::new_flashmla(Arc::clone(self), cap, widths)
    }

    /// The prefill path for this pool: buffers sized for `cap` on the pool's backend and
    /// stream. See [`PrefillPath`].
    pub fn prefill_path(self: &Arc<Self>, cap: PrefillCapacity) -> Result<PrefillPath, DecodeError> {
        PrefillPath::new(Arc::clone(self), cap)
    }

    /// The live slot positions and block count now (one lock).
    pub(crate) fn bounds(&self) -> Result<PoolBounds, PoolError> {
        self.with_boundary(|b| PoolBounds { live: b.live_positions(), num_blocks: i64::from(b.num_blocks()) })
    }
}

fn pool_err(e: PoolError) -> DecodeError {
    match e {
        PoolError::Backend(b) => DecodeError::Backend(b),
        PoolError::Decode(d) => *d,
        other => DecodeError::Pool(Box::new(other)),
    }
}

/// The decode index path of one pool: an owned handle.
///
/// ```text
/// let mut path = pool.decode_path(cap)?;      // once: buffers at fixed addresses
/// path.stage(&batch)?;                         // per step: metadata (+ block tables)
/// path.build()?;                               // one launch: windows, HCA heads, dest rows
/// unsafe { path.csa_pack(topk, stride)? };     // per CSA layer, after its indexer
/// attention(path.indices(Class::Csa), ...);    // fixed addresses, graph-capturable
/// ```
///
/// Positions are checked live and block ids inside the block region against the pool at
/// staging, and both are checked again at build and at every translate-pack (the boundary may
/// have moved in between). [`Self::stage`] sends the block tables (O(context) bytes);
/// [`Self::stage_resident`] sends only the per-token metadata (O(batch)) when the tables are
/// kept on the device with [`Self::write_block_table`]; [`Self::stage_flat`] takes the batch
/// as flat arrays (a foreign caller's shape). [`Self::build_on`] builds on another stream
/// (a graph's capture stream) with the same checks as [`Self::build`].
pub struct DecodePath {
    pool: Arc<Pool>,
    bufs: DecodeIndexBuffers,
    /// Zeros, the buffers' columns: stand in for resident tables in `stage_flat`'s length
    /// check.
    no_table: Vec<i32>,
    /// Streams a build went on besides the pool's; drained before the buffers go.
    streams: Vec<Stream>,
}

impl std::fmt::Debug for DecodePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodePath").field("bufs", &self.bufs).field("streams", &self.streams).finish()
    }
}

impl Drop for DecodePath {
    fn drop(&mut self) {
        // The buffers free themselves after the pool's stream drains; builds queued on other
        // streams must be done first. A failure here has no caller to go to.
        for &s in &self.streams {
            let _ = self.pool.backend().synchronize(s);
        }
    }
}

impl DecodePath {
    /// Buffers sized for `cap` on `pool`'s backend and stream (see
    /// [`Pool::decode_path`]).
    pub fn new(pool: Arc<Pool>, cap: DecodeCapacity) -> Result<DecodePath, DecodeError> {
        Self::with_flashmla(pool, cap, None)
    }

    /// A decode path writing FlashMLA's convention (index-buffers.md §3f, §5f) instead of CSR:
    /// the builder writes every class's window rows (one view per distinct page-view shift
    /// among the class's layers, in the row format's kernel pages: HCA one per layer in 64-row
    /// pages, one in all in `flashmla-v4-p2`'s 2-row pages) and HCA's compressed rows in its one launch;
    /// `csa_pack` writes the CSA rows. [`Self::flashmla`] gives a layer's operands. Widths not
    /// a multiple of 64 are [`DecodeError::FlashMlaWidth`], rows too narrow for what the path
    /// can stage [`DecodeError::FlashMlaTooNarrow`]; V4.1's shared compressors are refused.
    pub fn new_flashmla(
        pool: Arc<Pool>,
        cap: DecodeCapacity,
        widths: FlashMlaWidths,
    ) -> Result<DecodePath, DecodeError> {
        Self::with_flashmla(pool, cap, Some(widths))
    }

    fn with_flashmla(
        pool: Arc<Pool>,
        cap: DecodeCapacity,
        widths: Option<FlashMlaWidths>,
    ) -> Result<DecodePath, DecodeError> {
        let geometry = pool.geometry().map_err(pool_err)?;
        // Each layer's shift is its page view's in the pages FlashMLA reads the rows in (the
        // row format's `kernel_page_rows`: 64, or 2 for `flashmla-v4-p2`): the one formula,
        // `Pool::page_view`.
        let page = pool.spec().kernel_page_rows();
        let shifts: Vec<Option<i32>> = match widths {
            None => Vec::new(),
            Some(_) => (0..geometry.num_layers)
                .map(|l| match geometry.layer_slot(l) {
                    Err(_) => Ok(None),
                    Ok(_) => pool.page_view(l, 0, page).map(|v| Some(v.row_shift as i32)).map_err(pool_err),
                })
                .collect::<Result<_, _>>()?,
        };
        let flash = widths.map(|w| (w, shifts.as_slice()));
        let bufs = DecodeIndexBuffers::new(Arc::clone(pool.backend()), pool.stream(), &geometry, cap, flash)?;
        Ok(DecodePath { pool, bufs, no_table: vec![0; cap.max_blocks_per_seq], streams: Vec::new() })
    }

    /// Layer `layer`'s FlashMLA operands (a path from [`Self::new_flashmla`]; else
    /// [`DecodeError::NoFlashMla`]): `indices` / `topk_length` (its class's view) and
    /// `extra_indices` / `extra_topk_length` (HCA: its view; CSA: the one buffer the layer's
    /// pack fills, so read it between that pack and the next; each build resets it to −1 with
    /// length 0 until then). Hand FlashMLA `Pool::page_view(layer, plane, page)` (`page` the
    /// spec's [`PoolSpec::kernel_page_rows`](crate::pool::PoolSpec::kernel_page_rows)) as `k_cache` and
    /// `extra_k_cache`, and `seq_topk_length` / `seq_extra_topk_length` (one per sequence,
    /// its tokens sharing it) as its `topk_length` / `extra_topk_length` with `indices` viewed
    /// `[sequences, s_q, topk]` (docs/flashmla.md, "MTP").
    pub fn flashmla(&self, layer: usize) -> Result<FlashMlaBuffers, DecodeError> {
        self.bufs.flashmla(layer)
    }

    /// Read one of [`Self::flashmla`]'s buffers back (waits for the pool's stream).
    pub fn read_flashmla(&self, buf: DeviceBuffer) -> Result<Vec<i32>, DecodeError> {
        self.bufs.read_buffer(buf)
    }

    /// Device bytes a decode path for `cap` takes on a pool of `geometry`, without
    /// allocating (sizing, overhead reports; sizes that overflow are
    /// [`DecodeError::TooLarge`]).
    pub fn required_bytes(geometry: &UnifiedPoolGeometry, cap: DecodeCapacity) -> Result<u64, DecodeError> {
        DecodeIndexBuffers::required_bytes(geometry, cap)
    }

    /// The pool this path indexes.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }
    /// The stream every upload and launch goes on (the pool's).
    pub fn stream(&self) -> Stream {
        self.bufs.stream()
    }
    /// The capacity the buffers were sized for.
    pub fn capacity(&self) -> DecodeCapacity {
        self.bufs.capacity()
    }
    /// Bytes the buffers hold on the device.
    pub fn device_bytes(&self) -> u64 {
        self.bufs.device_bytes()
    }
    /// Real tokens of the batch last staged.
    pub fn staged_tokens(&self) -> usize {
        self.bufs.staged_tokens()
    }

    fn refresh(&mut self) -> Result<(), DecodeError> {
        let bounds = self.pool.bounds().map_err(pool_err)?;
        self.bufs.set_bounds(bounds);
        Ok(())
    }

    /// Stage a decode batch with its block tables (O(context) bytes uploaded). Every
    /// position must be a live slot of the pool and every block id a block of its block
    /// region; returns the batch's real token count.
    pub fn stage(&mut self, batch: &[DecodeSeq<'_>]) -> Result<usize, DecodeError> {
        self.refresh()?;
        self.bufs.stage(batch)
    }

    /// Stage a decode batch whose block tables are resident (batch row `b` holds sequence
    /// `b`'s table, see [`Self::write_block_table`]): O(batch) bytes uploaded; each
    /// sequence's `block_table` is only length-checked.
    pub fn stage_resident(&mut self, batch: &[DecodeSeq<'_>]) -> Result<usize, DecodeError> {
        self.refresh()?;
        self.bufs.stage_resident(batch)
    }

    /// Stage a batch given as flat arrays ([`FlatDecodeBatch`]): with its block tables as
    /// [`Self::stage`], or, when `block_tables` is `None`, resident as
    /// [`Self::stage_resident`]. Arrays of different lengths and negative token counts are
    /// refused; returns the batch's real token count.
    pub fn stage_flat(&mut self, batch: &FlatDecodeBatch<'_>) -> Result<usize, DecodeError> {
        let block_size = self.pool.spec().geometry.block_size;
        let seqs = batch.seqs(block_size, &self.no_table)?;
        // `refresh`, field by field: `seqs` borrows `no_table`.
        self.bufs.set_bounds(self.pool.bounds().map_err(pool_err)?);
        if batch.block_tables.is_some() {
            self.bufs.stage(&seqs)
        } else {
            self.bufs.stage_resident(&seqs)
        }
    }

    /// Write block ids into batch row `row`'s resident table from column `start_col`.
    pub fn write_block_table(
        &mut self,
        row: usize,
        start_col: usize,
        ids: &[i32],
    ) -> Result<(), DecodeError> {
        self.refresh()?;
        self.bufs.write_block_table(row, start_col, ids)
    }

    /// Slot positions of the batch staged last (one per sequence).
    pub fn staged_positions(&self) -> &[i64] {
        self.bufs.staged_positions()
    }

    /// The CSA head of every staged token: `[head, entries]` (see the buffers' doc).
    pub fn staged_csa_heads(&self) -> &[[i32; 2]] {
        self.bufs.staged_csa_heads()
    }

    /// Run the decode builder over the staged batch (one launch on the pool's stream),
    /// after checking its positions are still live slots of the pool and the block ids it
    /// reads (staged, or written to the resident tables since) still blocks of its region.
    pub fn build(&mut self) -> Result<(), DecodeError> {
        self.build_on(self.stream())
    }

    /// [`Self::build`] queued on `stream` instead of the pool's (a graph's capture stream):
    /// the same checks, then the same launch, whose pointers and grid are fixed, so it may be
    /// captured once and replayed after each stage. The caller orders `stream` after the
    /// staging on the pool's stream; the path drains `stream` before its buffers go.
    ///
    /// FlashMLA mode: the build first resets the CSA compressed rows to −1 and their lengths
    /// to 0 (two fills on `stream`), so a CSA layer's operands before its pack show no rows —
    /// neither row 0 nor the previous step's pack ([`Self::build_launch`] alone does not).
    pub fn build_on(&mut self, stream: Stream) -> Result<(), DecodeError> {
        self.refresh()?;
        self.bufs.check_staged(self.bufs.bounds())?;
        // Drained on drop: every stream work of this path is queued on.
        if stream != self.stream() && !self.streams.contains(&stream) {
            self.streams.push(stream);
        }
        for (ptr, count, value) in self.bufs.csa_flash_reset().into_iter().flatten() {
            // SAFETY: `ptr` and `count` name one of the path's own buffers (its CSA compressed
            // rows or lengths, `count` u32 inside the allocation), which outlives the fill (drop
            // drains every stream a build went on).
            unsafe { self.pool.backend().fill_u32(ptr, count, value, stream)? };
        }
        if stream == self.stream() {
            return self.bufs.build();
        }
        // SAFETY: the launch's pointers are the path's own buffers (sized for its capacity,
        // the staged offsets checked against each class's slice capacity) and its positions
        // were just checked live; the buffers outlive the launch (drop drains `stream`).
        // Misordered against the staging, the builder reads stale metadata of these same
        // buffers: wrong indices, never an address outside them.
        unsafe { self.pool.backend().launch(&self.bufs.launch(), stream)? };
        Ok(())
    }

    /// Wait for the pool's stream and every other stream a build went on.
    pub fn synchronize(&self) -> Result<(), DecodeError> {
        self.pool.backend().synchronize(self.stream())?;
        for &s in &self.streams {
            self.pool.backend().synchronize(s)?;
        }
        Ok(())
    }

    /// CSA translate-pack for one CSA layer (call once per CSA layer, after its indexer and
    /// before its attention: every layer overwrites the heads of the one CSA buffer). The pack
    /// turns the staged block ids into pool rows, so it is refused as [`Self::build`] is when
    /// the boundary moved under the staged batch ([`DecodeError::StaleBlock`],
    /// [`DecodeError::BadPosition`]).
    ///
    /// # Safety
    /// `topk` addresses live memory of the pool's backend holding i32
    /// `[max_tokens][topk_row_stride]`, ready on the pool's stream, with the first
    /// `min((pos+1)/4, ctx/4, index_topk)` entries of each real token's row non-negative
    /// (`index-buffers.md` §5).
    pub unsafe fn csa_pack(&self, topk: DevicePtr, topk_row_stride: i32) -> Result<(), DecodeError> {
        self.bufs.check_staged(&self.pool.bounds().map_err(pool_err)?)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.bufs.pack(None, topk, topk_row_stride) }
    }

    /// Translate-pack of compressed layer `layer` into its slot's heads, with its compress
    /// bias (V4.1: every compressed layer, both slots, after its indexer).
    ///
    /// # Safety
    /// As [`Self::csa_pack`], the non-negative entries being the first
    /// `min(visible_groups(pos, ratio), index_topk)` of each real token's row.
    pub unsafe fn layer_pack(
        &self,
        layer: usize,
        topk: DevicePtr,
        topk_row_stride: i32,
    ) -> Result<(), DecodeError> {
        self.bufs.check_staged(&self.pool.bounds().map_err(pool_err)?)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.bufs.pack(Some(layer), topk, topk_row_stride) }
    }

    /// The decode builder's launch, for graph capture (advanced: running it through
    /// [`crate::backend::Backend::launch`] is the caller's `unsafe`; [`Self::build`] and
    /// [`Self::build_on`] are the safe ways, and in FlashMLA mode also reset the CSA
    /// compressed rows, which this launch does not write: capture `build_on` instead).
    pub fn build_launch(&self) -> Launch {
        self.bufs.launch()
    }

    /// One CSA layer's translate-pack launch, for graph capture (see [`Self::build_launch`];
    /// [`Self::csa_pack`] runs the same arguments).
    pub fn csa_pack_launch(&self, topk: DevicePtr, topk_row_stride: i32) -> Result<Launch, DecodeError> {
        Ok(Launch::CsaPack(self.bufs.pack_args(None, topk, topk_row_stride)?))
    }

    /// Compressed layer `layer`'s translate-pack launch (V4.1: every compressed layer), for
    /// graph capture (see [`Self::build_launch`]; [`Self::layer_pack`] runs the same arguments).
    pub fn layer_pack_launch(
        &self,
        layer: usize,
        topk: DevicePtr,
        topk_row_stride: i32,
    ) -> Result<Launch, DecodeError> {
        Ok(Launch::CsaPack(self.bufs.pack_args(Some(layer), topk, topk_row_stride)?))
    }

    /// A sub-buffer by name (`None`: dense buffers of a geometry without dense layers).
    pub fn buffer(&self, which: DecodeBuffer) -> Option<DeviceBuffer> {
        self.bufs.buffer(which)
    }
    /// A class's index buffer, for attention (`None`: no dense layers).
    pub fn indices(&self, class: Class) -> Option<DeviceBuffer> {
        self.bufs.indices(class)
    }
    /// A class's indptr (`max_tokens + 1` i32).
    pub fn indptr(&self, class: Class) -> Option<DeviceBuffer> {
        self.bufs.indptr(class)
    }
    /// A class's destination rows (`max_tokens` i32).
    pub fn dest_rows(&self, class: Class) -> Option<DeviceBuffer> {
        self.bufs.dest_rows(class)
    }
    /// Read an i32 sub-buffer back to the host (waits for the stream).
    pub fn read_i32(&self, which: DecodeBuffer) -> Result<Vec<i32>, DecodeError> {
        self.bufs.read_i32(which)
    }
}

/// The prefill index path of one pool: an owned handle, the same shape as [`DecodePath`].
///
/// Per prefill forward: [`Self::stage`] the chunks, [`Self::build`] (one launch: extend
/// rows, dense window, CSA window tails, HCA `[window | compressed]`), then per CSA layer
/// [`Self::csa_pack`] fills the CSA heads from the indexer's top-k.
#[derive(Debug)]
pub struct PrefillPath {
    pool: Arc<Pool>,
    bufs: PrefillIndexBuffers,
}

impl PrefillPath {
    /// Buffers sized for `cap` on `pool`'s backend and stream (see [`Pool::prefill_path`]).
    pub fn new(pool: Arc<Pool>, cap: PrefillCapacity) -> Result<PrefillPath, DecodeError> {
        let geometry = pool.geometry().map_err(pool_err)?;
        let bufs = PrefillIndexBuffers::new(Arc::clone(pool.backend()), pool.stream(), &geometry, cap)?;
        Ok(PrefillPath { pool, bufs })
    }

    /// Device bytes a prefill path for `cap` takes on a pool of `geometry`, without
    /// allocating.
    pub fn required_bytes(geometry: &UnifiedPoolGeometry, cap: PrefillCapacity) -> Result<u64, DecodeError> {
        PrefillIndexBuffers::required_bytes(geometry, cap)
    }

    /// The pool this path indexes.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }
    /// The stream every upload and launch goes on (the pool's).
    pub fn stream(&self) -> Stream {
        self.bufs.stream()
    }
    /// The capacity the buffers were sized for.
    pub fn capacity(&self) -> PrefillCapacity {
        self.bufs.capacity()
    }
    /// Bytes the buffers hold on the device.
    pub fn device_bytes(&self) -> u64 {
        self.bufs.device_bytes()
    }
    /// Tokens of the forward last staged.
    pub fn staged_tokens(&self) -> usize {
        self.bufs.staged_tokens()
    }

    /// Stage one prefill forward: its chunks in token order (sequence `b`'s tokens are rows
    /// `cu[b]..cu[b+1]` of the forward's K, `cu` the running sum of `num_tokens`). Positions
    /// must be live slots of the pool and block ids blocks of its block region; returns the
    /// forward's token count.
    pub fn stage(&mut self, batch: &[PrefillSeq<'_>]) -> Result<usize, DecodeError> {
        let bounds = self.pool.bounds().map_err(pool_err)?;
        self.bufs.set_bounds(bounds);
        self.bufs.stage(batch)
    }

    /// The CSA head of every staged token: `[head, entries]` (see the buffers' doc).
    pub fn staged_csa_heads(&self) -> &[[i32; 2]] {
        self.bufs.staged_csa_heads()
    }

    /// Run the prefill builder over the staged forward (one launch on the pool's stream),
    /// after checking its positions are still live slots of the pool and its block ids
    /// still blocks of its region.
    pub fn build(&mut self) -> Result<(), DecodeError> {
        let bounds = self.pool.bounds().map_err(pool_err)?;
        self.bufs.set_bounds(bounds);
        self.bufs.build()
    }

    /// CSA translate-pack (prefill mode) for one CSA layer over the staged forward, refused
    /// as [`Self::build`] is when the boundary moved under it.
    ///
    /// # Safety
    /// `topk` addresses live memory of the pool's backend holding i32
    /// `[staged tokens][topk_row_stride]`, ready on the pool's stream, with non-negative
    /// entries where the contract reads them (`index-buffers.md` §5).
    pub unsafe fn csa_pack(&self, topk: DevicePtr, topk_row_stride: i32) -> Result<(), DecodeError> {
        self.bufs.check_staged(&self.pool.bounds().map_err(pool_err)?)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.bufs.pack(None, topk, topk_row_stride) }
    }

    /// Translate-pack (prefill mode) of compressed layer `layer` into its slot's heads, with
    /// its compress bias (V4.1: every compressed layer, both slots, after its indexer).
    ///
    /// # Safety
    /// As [`Self::csa_pack`], the non-negative entries being the first
    /// `min(visible_groups(pos, ratio), index_topk)` of each token's row.
    pub unsafe fn layer_pack(
        &self,
        layer: usize,
        topk: DevicePtr,
        topk_row_stride: i32,
    ) -> Result<(), DecodeError> {
        self.bufs.check_staged(&self.pool.bounds().map_err(pool_err)?)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.bufs.pack(Some(layer), topk, topk_row_stride) }
    }

    /// A sub-buffer by name (`None`: dense buffers of a geometry without dense layers).
    pub fn buffer(&self, which: PrefillBuffer) -> Option<DeviceBuffer> {
        self.bufs.buffer(which)
    }
    /// A class's prefix index buffer (`prefix_swa` for dense, `prefix_csa`, `prefix_hca`).
    pub fn indices(&self, class: Class) -> Option<DeviceBuffer> {
        self.bufs.buffer(PrefillBuffer::Indices(class))
    }
    /// A class's prefix indptr (`staged tokens + 1` meaningful entries).
    pub fn indptr(&self, class: Class) -> Option<DeviceBuffer> {
        self.bufs.buffer(PrefillBuffer::Indptr(class))
    }
    /// Read an i32 sub-buffer back to the host (waits for the stream).
    pub fn read_i32(&self, which: PrefillBuffer) -> Result<Vec<i32>, DecodeError> {
        self.bufs.read_i32(which)
    }
}
