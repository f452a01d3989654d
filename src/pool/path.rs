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
    check_live, DecodeBuffer, DecodeCapacity, DecodeError, DecodeIndexBuffers, DecodeSeq, PoolBounds,
};
use super::owned::DeviceBuffer;
use super::prefill::{PrefillBuffer, PrefillCapacity, PrefillIndexBuffers, PrefillSeq};
use super::{Pool, PoolError};
use crate::backend::Stream;
use crate::geometry::Class;
use crate::index::{DevicePtr, Launch};
use std::sync::Arc;

impl Pool {
    /// The decode path for this pool: persistent buffers sized for `cap` on the pool's
    /// backend and stream. See [`DecodePath`].
    pub fn decode_path(self: &Arc<Self>, cap: DecodeCapacity) -> Result<DecodePath, DecodeError> {
        DecodePath::new(Arc::clone(self), cap)
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
/// staging, and both are checked again at build (the boundary may have moved in between). [`Self::stage`] sends the block tables (O(context) bytes);
/// [`Self::stage_resident`] sends only the per-token metadata (O(batch)) when the tables are
/// kept on the device with [`Self::write_block_table`].
#[derive(Debug)]
pub struct DecodePath {
    pool: Arc<Pool>,
    bufs: DecodeIndexBuffers,
}

impl DecodePath {
    /// Buffers sized for `cap` on `pool`'s backend and stream (see
    /// [`Pool::decode_path`]).
    pub fn new(pool: Arc<Pool>, cap: DecodeCapacity) -> Result<DecodePath, DecodeError> {
        let geometry = pool.geometry().map_err(pool_err)?;
        let bufs = DecodeIndexBuffers::new(Arc::clone(pool.backend()), pool.stream(), &geometry, cap)?;
        Ok(DecodePath { pool, bufs })
    }

    /// Device bytes a decode path for `cap` takes on `pool`, without allocating.
    pub fn required_bytes(pool: &Pool, cap: DecodeCapacity) -> Result<u64, DecodeError> {
        DecodeIndexBuffers::required_bytes(&pool.spec().geometry, cap)
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
    /// `b`'s table): O(batch) bytes uploaded. See [`DecodeIndexBuffers::stage_resident`].
    pub fn stage_resident(&mut self, batch: &[DecodeSeq<'_>]) -> Result<usize, DecodeError> {
        self.refresh()?;
        self.bufs.stage_resident(batch)
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
        self.refresh()?;
        check_live(self.bufs.staged_positions(), &self.bufs.bounds().live)?;
        self.bufs.check_staged_blocks()?;
        self.bufs.build()
    }

    /// CSA translate-pack for one CSA layer (call once per CSA layer, after its indexer and
    /// before its attention: every layer overwrites the heads of the one CSA buffer).
    ///
    /// # Safety
    /// As [`DecodeIndexBuffers::csa_pack`]: `topk` addresses live memory of the pool's
    /// backend holding i32 `[max_tokens][topk_row_stride]`, ready on the pool's stream, with
    /// non-negative entries where the contract reads them.
    pub unsafe fn csa_pack(&self, topk: DevicePtr, topk_row_stride: i32) -> Result<(), DecodeError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.bufs.csa_pack(topk, topk_row_stride) }
    }

    /// Translate-pack of compressed layer `layer` into its slot's heads, with its compress
    /// bias (V4.1: every compressed layer, both slots, after its indexer).
    ///
    /// # Safety
    /// As [`DecodeIndexBuffers::layer_pack`]: `topk` addresses live memory of the pool's
    /// backend holding i32 `[max_tokens][topk_row_stride]`, ready on the pool's stream, with
    /// non-negative entries where the contract reads them.
    pub unsafe fn layer_pack(
        &self,
        layer: usize,
        topk: DevicePtr,
        topk_row_stride: i32,
    ) -> Result<(), DecodeError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.bufs.layer_pack(layer, topk, topk_row_stride) }
    }

    /// One compressed layer's translate-pack launch, for graph capture.
    pub fn layer_pack_launch(
        &self,
        layer: usize,
        topk: DevicePtr,
        topk_row_stride: i32,
    ) -> Result<Launch, DecodeError> {
        Ok(Launch::CsaPack(self.bufs.layer_pack_args(layer, topk, topk_row_stride)?))
    }

    /// The decode builder's launch, for graph capture (advanced: running it through
    /// [`crate::backend::Backend::launch`] is the caller's `unsafe`; [`Self::build`] is the safe
    /// way).
    pub fn build_launch(&self) -> Launch {
        self.bufs.launch()
    }

    /// One CSA layer's translate-pack launch, for graph capture (see [`Self::build_launch`]).
    pub fn csa_pack_launch(&self, topk: DevicePtr, topk_row_stride: i32) -> Result<Launch, DecodeError> {
        Ok(Launch::CsaPack(self.bufs.csa_pack_args(topk, topk_row_stride)?))
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

    /// Device bytes a prefill path for `cap` takes on `pool`, without allocating.
    pub fn required_bytes(pool: &Pool, cap: PrefillCapacity) -> Result<u64, DecodeError> {
        PrefillIndexBuffers::required_bytes(&pool.spec().geometry, cap)
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

    /// CSA translate-pack (prefill mode) for one CSA layer over the staged forward.
    ///
    /// # Safety
    /// `topk` addresses live memory of the pool's backend holding i32
    /// `[staged tokens][topk_row_stride]`, ready on the pool's stream, with non-negative
    /// entries where the contract reads them (`index-buffers.md` §5).
    pub unsafe fn csa_pack(&self, topk: DevicePtr, topk_row_stride: i32) -> Result<(), DecodeError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.bufs.csa_pack(topk, topk_row_stride) }
    }

    /// Translate-pack (prefill mode) of compressed layer `layer` into its slot's heads, with
    /// its compress bias (V4.1: every compressed layer, both slots, after its indexer).
    ///
    /// # Safety
    /// As [`PrefillIndexBuffers::layer_pack`]: `topk` addresses live memory of the pool's
    /// backend holding i32 `[staged tokens][topk_row_stride]`, ready on the pool's stream,
    /// with non-negative entries where the contract reads them.
    pub unsafe fn layer_pack(
        &self,
        layer: usize,
        topk: DevicePtr,
        topk_row_stride: i32,
    ) -> Result<(), DecodeError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.bufs.layer_pack(layer, topk, topk_row_stride) }
    }

    /// One compressed layer's translate-pack launch (prefill mode), for graph capture.
    pub fn layer_pack_launch(
        &self,
        layer: usize,
        topk: DevicePtr,
        topk_row_stride: i32,
    ) -> Result<Launch, DecodeError> {
        Ok(Launch::CsaPack(self.bufs.layer_pack_args(layer, topk, topk_row_stride)?))
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
