//! `Pool`: the planes on a backend, per-layer views, slot state, checkpoints, relocations,
//! transfer regions, and the persistent index buffers.
//!
//! The pool is the one place that combines the geometry, the allocators and a backend. It
//! owns one allocation carved into 256-byte aligned planes (NoPE then RoPE, or the single
//! bf16 plane) and, when the model has CSA layers, a second one for the indexer cache sized
//! for the most blocks the plane can ever hold, so neither moves when the boundary does.
//!
//! Threads: `Pool` is `Send + Sync`. Allocation, release and boundary moves take one
//! internal mutex (they are host bookkeeping plus, for moves, copies queued on the pool's
//! stream); views and index-buffer addresses are plain values that never change.

mod batch;
pub mod decode;
mod image;
mod moves;
pub(crate) mod owned;
mod path;
pub mod prefill;
pub mod regions;
mod rows;
mod spec;
#[cfg(test)]
mod tests;
mod topk;

pub use batch::{WriteBatch, WriteBatchError};
pub use decode::{
    decode_slice_lens, DecodeBuffer, DecodeCapacity, DecodeError, DecodeSeq, FlashMlaBuffers, FlashMlaWidths,
    FlatDecodeBatch,
};
pub use moves::{split_runs, COPY_PIECE_BYTES};
pub use owned::DeviceBuffer;
pub use path::{DecodePath, PrefillPath};
pub use prefill::{prefill_slice_lens, PrefillBuffer, PrefillCapacity, PrefillSeq};
pub use rows::{
    CompressedRow, KvRowWriter, RowSet, RowWriteCapacity, RowWriteError, WindowSeq, INDEX_KEY_VALUES,
};
pub use spec::PoolSpec;
pub use topk::{convert_topk, CsaTopk, TopkError, TopkRows};

// What the pool's calls take and return from the layers under it (which are public only
// under `crate::raw`): the allocators' handles, the arena layout, the boundary's moves.
pub use crate::alloc::{AllocError, BlockGrant, BlockHandle, SlotHandle};
pub use crate::arena::{ArenaError, ArenaLayout, FieldView};
pub use crate::boundary::{BlockMove, Boundary, BoundaryChange, BoundaryError, SlotMove};
pub use crate::index::CopyRun;

use crate::backend::{Backend, BackendError, DeviceAllocation, Stream};
use crate::checkpoint::{LayoutId, Region};
use crate::geometry::{GeometryError, UnifiedPoolGeometry, DENSE_RATIO};
use crate::index::DevicePtr;
use crate::sizing::{IndexerDtype, IndexerPart, KvSpec, SizingError};
use regions::{TransferConfig, TransferRegions};
use std::sync::{Arc, Mutex, MutexGuard};
use thiserror::Error;

/// Runs one descriptor launch carries; longer lists take several launches.
const DESCRIPTOR_RUNS: usize = 4096;
const DESCRIPTOR_BYTES: u64 = (DESCRIPTOR_RUNS * std::mem::size_of::<CopyRun>()) as u64;
const PLANE_ALIGN: u64 = 256;

crate::variant::variant_names! {
#[derive(Debug, Error)]
/// What the pool refuses or fails with.
pub enum PoolError {
    #[error(transparent)]
    /// A failure of the layer below ([`GeometryError`]).
    Geometry(#[from] GeometryError),
    #[error(transparent)]
    /// A failure of the layer below ([`ArenaError`]).
    Arena(#[from] ArenaError),
    #[error(transparent)]
    /// A failure of the layer below ([`AllocError`]).
    Alloc(#[from] AllocError),
    #[error(transparent)]
    /// A failure of the layer below ([`BoundaryError`]).
    Boundary(#[from] BoundaryError),
    #[error(transparent)]
    /// A failure of the layer below ([`BackendError`]).
    Backend(#[from] BackendError),
    #[error("the pool has no indexer cache")]
    /// The pool has no indexer cache (no CSA layer, or a plan without one).
    NoIndexer,
    #[error("indexer pool {part} outside 0..{parts}")]
    /// Indexer pool `part` outside 0..`parts` (FP8 and BF16: one; FP4: data, scales).
    NoSuchIndexerPart {
        /// Pool index.
        part: usize,
        /// Pools there are.
        parts: usize,
    },
    #[error("CSA layer rank {rank} outside 0..{layers}")]
    /// CSA layer rank `rank` outside 0..`layers`.
    NoSuchCsaLayer {
        /// Rank among the CSA layers.
        rank: usize,
        /// CSA layers there are.
        layers: usize,
    },
    #[error("plane {plane} outside 0..{planes}")]
    /// Plane `plane` outside 0..`planes`.
    NoSuchPlane {
        /// Plane index.
        plane: usize,
        /// Planes there are.
        planes: usize,
    },
    #[error("layer {layer}'s rows cannot be handed to a kernel in pages of {page_rows}: {why}")]
    /// A layer view a paged kernel cannot take ([`Pool::page_view`]).
    NotPageable {
        /// The layer.
        layer: usize,
        /// The page asked for.
        page_rows: i64,
        /// Why not.
        why: &'static str,
    },
    #[error("arena rows {arena} differ from the geometry's {geometry}")]
    /// Arena rows `arena` differ from the geometry's `geometry`.
    ArenaMismatch {
        /// Arena rows of the layout.
        arena: i64,
        /// Arena rows of the geometry.
        geometry: i64,
    },
    #[error("the geometry's slot_origin is {0}; a pool numbers its own positions (origin 0)")]
    /// The geometry's slot_origin is the value; a pool numbers its own positions (origin 0).
    SlotOrigin(i64),
    #[error("bytes {offset}..{offset}+{len} outside plane {plane} of {plane_bytes} bytes")]
    /// Bytes `offset`..`offset`+`len` outside plane `plane` of `plane_bytes` bytes.
    PlaneRange {
        /// Plane index.
        plane: usize,
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Bytes of the plane.
        plane_bytes: u64,
    },
    #[error("buffer of {got} bytes, expected {expected}")]
    /// Buffer of `got` bytes, expected `expected`.
    BufferSize {
        /// The value given.
        got: usize,
        /// The value expected.
        expected: u64,
    },
    #[error(
        "a plan with min_slots {0} sizes the indexer below what the plane can hold; pools need min_slots 0"
    )]
    /// A plan with min_slots the value sizes the indexer below what the plane can hold; pools need min_slots 0.
    MinSlots(i64),
    #[error(transparent)]
    /// The transfer regions could not be computed ([`regions::TransferError`]).
    Transfer(#[from] regions::TransferError),
    #[error(transparent)]
    /// A failure of the layer below ([`crate::checkpoint::CheckpointError`]).
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error(transparent)]
    /// The plan's rows have no spec ([`SizingError`]).
    Sizing(#[from] SizingError),
    #[error("the pool's spec says nothing of its rows (a spec from parts: PoolSpec::with_kv_spec)")]
    /// A pool from parts without a [`KvSpec`]: no default window, top-k or row format.
    NoKvSpec,
    #[error("decode buffers: {0}")]
    /// The decode index buffers cannot be laid out ([`DecodeError`]; boxed, a decode error
    /// can carry a pool error).
    Decode(#[source] Box<DecodeError>),
    #[error("arithmetic overflow computing {0}")]
    /// Arithmetic overflow computing the value.
    Overflow(&'static str),
    /// A [`PoolSpec`] whose parts disagree (edited after it was made).
    #[error("inconsistent pool spec: {what}")]
    /// Inconsistent pool spec: `what`.
    InconsistentSpec {
        /// What was computed or checked.
        what: &'static str,
    },
    #[error("block id {id} outside the {max} blocks the plane can hold")]
    /// Block id `id` outside the `max` blocks the plane can hold.
    NoSuchBlock {
        /// The id.
        id: u32,
        /// The most allowed.
        max: u64,
    },
    #[error("positions {start}..{end} are not all live slot positions (live {live_start}..{live_end})")]
    /// Positions `start`..`end` are not all live slot positions (live `live_start`..`live_end`).
    NotLive {
        /// Start of the run.
        start: i64,
        /// One past the last live position.
        end: i64,
        /// First live position.
        live_start: i64,
        /// One past the last live position.
        live_end: i64,
    },
    #[error("bytes {offset}..{offset}+{len} outside {what} of {limit} bytes")]
    /// Bytes `offset`..`offset`+`len` outside `what` of `limit` bytes.
    OutOfRange {
        /// What was computed or checked.
        what: &'static str,
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u64,
        /// The most allowed.
        limit: u64,
    },
    #[error("no region {region:?} in this pool")]
    /// No region `region` in this pool.
    NoSuchRegion {
        /// Which region of the slot.
        region: Region,
    },
    #[error("copy run {index} overlaps itself (source and destination share bytes)")]
    /// Copy run `index` overlaps itself (source and destination share bytes).
    SelfOverlap {
        /// The index.
        index: usize,
    },
    #[error("the boundary is pinned by {pins} copy(ies) in flight; boundary moves wait until they end")]
    /// The boundary is pinned ([`Pool::pin_boundary`]) by copies in flight.
    BoundaryPinned {
        /// Pins held.
        pins: u64,
    },
    #[error("the pool's lock was poisoned by a panic in another thread")]
    /// The pool's lock was poisoned by a panic in another thread.
    Poisoned,
}
}

/// A layer's rows as an attention kernel that reads pages of rows takes them (FlashMLA:
/// `k_cache = [pages, page_rows, 1, row_bytes]`, an index `page × page_rows + offset`): the
/// view's first row rounded down to a page, so view index `i` is kernel index `i + row_shift`
/// (a layer's base need not start a page: V4's CSA layers start 40 rows into a 64-row one).
/// Every layer of a class has the same shift where its layer term is whole pages (CSA; dense at
/// ring 128), so one index buffer, shifted once, serves the class; HCA layers (2 rows apart)
/// each have their own in 64-row pages and share one in `flashmla-v4-p2`'s 2-row pages
/// (docs/flashmla.md). The page and shift are the geometry's (`UnifiedPoolGeometry::layer_page`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageView {
    /// Global layer id.
    pub layer: usize,
    /// Plane index.
    pub plane: usize,
    /// Address of the view's first page.
    pub ptr: DevicePtr,
    /// Whole pages from there to the plane's end.
    pub pages: i64,
    /// Rows of a page.
    pub page_rows: i64,
    /// Bytes per row of the plane.
    pub row_bytes: u64,
    /// Kernel index of view row 0 (`base mod page_rows`).
    pub row_shift: i64,
}

/// One layer's view of one plane: from the layer's base row to the plane's end. Index
/// buffer entries are rows of this view; row `x` is at `ptr + x * row_bytes` (64-bit) in an
/// unpaged plane; a paged plane's rows sit where its format's page arithmetic puts them
/// (`crate::format`), and a kernel takes them through [`Pool::page_view`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerView {
    /// Global layer id.
    pub layer: usize,
    /// Plane index.
    pub plane: usize,
    /// Address of the view's row 0.
    pub ptr: DevicePtr,
    /// Rows of the view (its base to the plane's end).
    pub rows: i64,
    /// Bytes per row of the plane.
    pub row_bytes: u64,
}

/// A slot handed out: the allocator's handle and where it sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLease {
    /// The allocator's handle (frees the slot).
    pub handle: SlotHandle,
    /// Where the slot sits: the position kernels take.
    pub position: i64,
}

/// One CSA layer's indexer cache in one indexer pool: `[blocks][rows_per_block][row_bytes]`
/// from `ptr` (block `b` of the pool's block ids is block `b` here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerView {
    /// Address of block 0, row 0.
    pub ptr: DevicePtr,
    /// Blocks (the most the plane can hold).
    pub blocks: u64,
    /// Index-key rows per block (a V4 CSA block: 64).
    pub rows_per_block: u64,
    /// Bytes of one row in this pool.
    pub row_bytes: u64,
}

/// The pool's own memory besides the planes, reported so it can be held under 1 %.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overhead {
    /// Bytes of the planes.
    pub plane_bytes: u64,
    /// Bytes of the CSA indexer cache.
    pub indexer_bytes: u64,
    /// Device descriptor buffers (copy and fill runs).
    pub descriptor_bytes: u64,
    /// Persistent index and metadata buffers (decode/prefill), when known.
    pub index_bytes: u64,
    /// Host bookkeeping: allocator state.
    pub host_bytes: u64,
}

/// Host bookkeeping per block id and per slot group (allocator state, upper bound).
const HOST_BYTES_PER_BLOCK: u64 = 64;
const HOST_BYTES_PER_SLOT: u64 = 32;

impl Overhead {
    /// What a pool for `spec` would hold besides its planes, with decode index buffers of
    /// capacity `decode`, computed without allocating (for production sizes).
    pub fn estimate(spec: &PoolSpec, decode: Option<DecodeCapacity>) -> Result<Overhead, PoolError> {
        let g = &spec.geometry;
        // Each plane's allocation holds its view lead too (none in V4).
        let planes: u64 = spec.plane_widths.iter().map(|&w| g.allocation_rows() as u64 * w).sum();
        let max_blocks = g.max_blocks_beside(0).max(0) as u64;
        let per_block: u64 = spec.indexer_parts()?.iter().flatten().map(|p| p.block_bytes).sum();
        let indexer = per_block * max_blocks;
        let index = match decode {
            Some(cap) => DecodePath::required_bytes(g, cap).map_err(|e| match e {
                DecodeError::Backend(b) => PoolError::Backend(b),
                other => PoolError::Decode(Box::new(other)),
            })?,
            None => 0,
        };
        Ok(Overhead {
            plane_bytes: planes,
            indexer_bytes: indexer,
            descriptor_bytes: DESCRIPTOR_BYTES,
            index_bytes: index,
            host_bytes: std::mem::size_of::<Boundary>() as u64
                + HOST_BYTES_PER_BLOCK * max_blocks
                + HOST_BYTES_PER_SLOT * g.slot_positions.max(0) as u64,
        })
    }

    /// The pool's own bytes (descriptors, index buffers, host bookkeeping) over the planes'.
    pub fn fraction(&self) -> f64 {
        (self.descriptor_bytes + self.index_bytes + self.host_bytes) as f64 / self.plane_bytes.max(1) as f64
    }
}

impl Pool {
    /// Bytes a pool for `spec` allocates for itself (planes, indexer cache, descriptors),
    /// counting the 256-byte alignment of each: an
    /// [`ExternalRegion`](crate::backend::external::ExternalRegion) this large holds all of them.
    pub fn required_bytes(spec: &PoolSpec) -> Result<u64, PoolError> {
        use crate::backend::external::ALIGN;
        let o = Overhead::estimate(spec, None)?;
        // Planes are padded to 256 bytes each, the indexer pools likewise (at most two).
        let pad = ALIGN * (spec.plane_widths.len() as u64 + 2 + 1);
        o.plane_bytes
            .checked_add(o.indexer_bytes)
            .and_then(|x| x.checked_add(o.descriptor_bytes))
            .and_then(|x| x.checked_add(pad))
            .ok_or(PoolError::Overflow("external region bytes"))
    }
}

struct State {
    boundary: Boundary,
    /// Live [`BoundaryPin`]s: boundary moves are refused while any is held.
    pins: u64,
}

/// A pin on a pool's boundary ([`Pool::pin_boundary`]): no boundary move happens while it
/// lives, so held handles keep their ids and positions.
#[derive(Debug)]
pub struct BoundaryPin<'a> {
    pool: &'a Pool,
}

impl Drop for BoundaryPin<'_> {
    fn drop(&mut self) {
        // A poisoned lock still holds the count: unpin through it.
        let mut st = self.pool.state.lock().unwrap_or_else(|p| p.into_inner());
        st.pins = st.pins.saturating_sub(1);
    }
}

/// The KV pool on one backend. See the module docs.
pub struct Pool {
    backend: Arc<dyn Backend>,
    stream: Stream,
    spec: PoolSpec,
    planes: Option<DeviceAllocation>,
    plane_offsets: Vec<u64>,
    indexer: Option<DeviceAllocation>,
    /// Offset of each indexer pool inside the indexer allocation.
    indexer_offsets: Vec<u64>,
    /// Each indexer pool's index-key layers ([`PoolSpec::indexer_parts`]).
    indexer_parts: Vec<Vec<IndexerPart>>,
    /// Blocks the indexer cache is sized for (the most the plane can hold).
    indexer_blocks: u64,
    descriptors: Option<DeviceAllocation>,
    /// Per plane, the slot byte ranges a checkpoint image carries.
    image_ranges: Vec<Vec<(u64, u64)>>,
    /// Serialises use of the descriptor buffer (see `run_descriptors`).
    descriptor_lock: Mutex<()>,
    /// What every image of this pool is tagged with.
    layout_id: LayoutId,
    state: Mutex<State>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("backend", &self.backend.kind())
            .field("plane_rows", &self.spec.geometry.plane_rows)
            .field("plane_widths", &self.spec.plane_widths)
            .finish()
    }
}

fn checked(v: Option<u64>, what: &'static str) -> Result<u64, PoolError> {
    v.ok_or(PoolError::Overflow(what))
}

impl Pool {
    /// Carve the planes for `spec` on `backend`; all pool work goes on `stream`.
    pub fn new(backend: Arc<dyn Backend>, spec: PoolSpec, stream: Stream) -> Result<Pool, PoolError> {
        // Everything below trusts the spec's parts to agree: check them (public fields can
        // have been edited since the spec was made).
        spec.validate()?;
        let g = &spec.geometry;
        let layout_id = spec.layout_id();
        let boundary = Boundary::new(g)?;
        let image_ranges = Self::plan_image_ranges(&spec)?;
        // Planes back to back, each start on a 256-byte boundary.
        let mut plane_offsets = Vec::with_capacity(spec.plane_widths.len());
        let mut cursor = 0u64;
        // A plane's view lead (rows below row 0 that views may start in; none in V4) comes
        // first, so the plane's row 0 is its base address.
        for &w in &spec.plane_widths {
            let lead = checked((g.view_lead_rows as u64).checked_mul(w), "plane bytes")?;
            plane_offsets.push(checked(cursor.checked_add(lead), "planes")?);
            let bytes = checked((g.allocation_rows() as u64).checked_mul(w), "plane bytes")?;
            cursor = checked(cursor.checked_add(bytes), "planes")?.div_ceil(PLANE_ALIGN) * PLANE_ALIGN;
        }
        // The indexer cache: one region per indexer pool (FP8: one; FP4: data, scales),
        // each the index-key layers' `[indexer_blocks][layer block bytes]` in layer order
        // (V4: `[n_csa][indexer_blocks][pool block bytes]`), sized for every block the plane
        // can hold so the boundary never outgrows it.
        let indexer_blocks = boundary.max_blocks_beside(0) as u64;
        let indexer_parts = spec.indexer_parts()?;
        let mut indexer_offsets = Vec::new();
        let mut indexer_bytes = 0u64;
        for parts in &indexer_parts {
            indexer_offsets.push(indexer_bytes);
            let per_block = parts.iter().try_fold(0u64, |acc, p| acc.checked_add(p.block_bytes));
            let bytes = checked(per_block.and_then(|b| b.checked_mul(indexer_blocks)), "indexer bytes")?;
            indexer_bytes = checked(indexer_bytes.checked_add(bytes), "indexer bytes")?.div_ceil(PLANE_ALIGN)
                * PLANE_ALIGN;
        }
        let planes = backend.alloc_zeroed(cursor.max(PLANE_ALIGN))?;
        let indexer = if indexer_bytes > 0 { Some(backend.alloc_zeroed(indexer_bytes)?) } else { None };
        let descriptors = Some(backend.alloc_zeroed(DESCRIPTOR_BYTES)?);
        let pool = Pool {
            backend,
            stream,
            spec,
            planes: Some(planes),
            plane_offsets,
            indexer,
            indexer_offsets,
            indexer_parts,
            indexer_blocks,
            descriptors,
            image_ranges,
            descriptor_lock: Mutex::new(()),
            layout_id,
            state: Mutex::new(State { boundary, pins: 0 }),
        };
        // Initialise every live position's state (the allocation is already zero).
        {
            let st = pool.lock()?;
            let live = st.boundary.live_positions();
            pool.init_positions_locked(&st, live)?;
        }
        Ok(pool)
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, PoolError> {
        self.state.lock().map_err(|_| PoolError::Poisoned)
    }

    /// The backend the pool lives on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
    /// The stream all pool work goes on.
    pub fn stream(&self) -> Stream {
        self.stream
    }
    /// What the pool's rows are ([`PoolSpec::kv_spec`]); refused for a pool from parts given
    /// none.
    pub fn kv_spec(&self) -> Result<&KvSpec, PoolError> {
        self.spec.kv_spec().ok_or(PoolError::NoKvSpec)
    }
    /// The spec the pool was built from.
    pub fn spec(&self) -> &PoolSpec {
        &self.spec
    }
    /// The layout id every checkpoint image of this pool carries ([`PoolSpec::layout_id`]).
    pub fn layout_id(&self) -> &LayoutId {
        &self.layout_id
    }
    /// The layout at the current split (plane capacity and every address are fixed).
    pub fn geometry(&self) -> Result<UnifiedPoolGeometry, PoolError> {
        Ok(self.lock()?.boundary.geometry().clone())
    }
    /// Planes (2 for fp8 KV, 1 for bf16).
    pub fn num_planes(&self) -> usize {
        self.spec.plane_widths.len()
    }

    /// Base address of plane `plane`.
    pub fn plane_ptr(&self, plane: usize) -> Result<DevicePtr, PoolError> {
        let off = self
            .plane_offsets
            .get(plane)
            .ok_or(PoolError::NoSuchPlane { plane, planes: self.plane_offsets.len() })?;
        Ok(self.planes.as_ref().map_or(0, |a| a.ptr) + off)
    }

    /// Bytes of plane `plane`.
    pub fn plane_bytes(&self, plane: usize) -> Result<u64, PoolError> {
        let w = self
            .spec
            .plane_widths
            .get(plane)
            .ok_or(PoolError::NoSuchPlane { plane, planes: self.spec.plane_widths.len() })?;
        Ok(self.spec.geometry.plane_bytes(*w))
    }

    /// Base address of the indexer cache, if any: one region per indexer pool (see
    /// [`Pool::indexer_offsets`]), each `[n_csa][indexer_blocks][pool block bytes]`.
    pub fn indexer_ptr(&self) -> Option<DevicePtr> {
        self.indexer.as_ref().map(|a| a.ptr)
    }
    /// Blocks the indexer cache is sized for (the most the plane can hold).
    pub fn indexer_blocks(&self) -> u64 {
        self.indexer_blocks
    }
    /// Byte offset of each indexer pool (FP8: one; FP4: data, scales) in the allocation.
    pub fn indexer_offsets(&self) -> &[u64] {
        &self.indexer_offsets
    }
    /// Each indexer pool's index-key layers, in [`PoolSpec::csa_layers`] order (empty
    /// without an indexer cache): layer `i`'s block `b` of pool `p` is at
    /// `indexer_ptr + indexer_offsets[p] + indexer_parts()[p][i].offset(b, indexer_blocks)`.
    pub fn indexer_parts(&self) -> &[Vec<IndexerPart>] {
        if self.indexer.is_none() {
            return &[];
        }
        &self.indexer_parts
    }

    /// The indexer cache of index-key layer `rank` (its index in [`PoolSpec::csa_layers`]: V4's
    /// CSA layers, V4.1's KV owners) in indexer pool `part`: its base, and its shape
    /// `[indexer_blocks][rows per block][row bytes]` (a V4 CSA block: 64 rows), placed by
    /// [`Pool::indexer_parts`], the one formula.
    pub fn indexer_view(&self, rank: usize, part: usize) -> Result<IndexerView, PoolError> {
        let ix = self.spec.indexer.filter(|_| self.indexer.is_some()).ok_or(PoolError::NoIndexer)?;
        let parts = self.indexer_parts();
        let (layers, &off) = parts
            .get(part)
            .zip(self.indexer_offsets.get(part))
            .ok_or(PoolError::NoSuchIndexerPart { part, parts: parts.len() })?;
        let layer = layers.get(rank).ok_or(PoolError::NoSuchCsaLayer { rank, layers: layers.len() })?;
        let row_bytes = ix.pool_row_bytes()[part];
        let start = checked(layer.offset(0, self.indexer_blocks), "indexer layer offset")?;
        let base = self.indexer_ptr().ok_or(PoolError::NoIndexer)?;
        Ok(IndexerView {
            ptr: base + off + start,
            blocks: self.indexer_blocks,
            rows_per_block: layer.block_bytes / row_bytes,
            row_bytes,
        })
    }

    /// PD / offload transfer regions at the current split (`pool-runtime.md` §7): block
    /// regions for both planes and every CSA indexer layer, slot regions for both planes,
    /// reverse indexed by group. Offsets are relative to [`Pool::plane_ptr`]`(0)` (planes)
    /// and [`Pool::indexer_ptr`] (indexer). The slot base moves with the split: re-register
    /// after every boundary move.
    pub fn transfer_regions(&self, config: &TransferConfig) -> Result<TransferRegions, PoolError> {
        let g = self.geometry()?;
        let ix = self.spec.indexer.unwrap_or(IndexerDtype::Fp8);
        let layers = regions::indexer_layers(&g, &self.spec.csa_layers, ix)?;
        Ok(regions::transfer_regions(
            &g,
            &self.spec.plane_widths,
            &layers,
            ix,
            self.indexer_blocks as i64,
            config,
        )?)
    }

    /// The per-layer view of `layer` in `plane`. Absent layers have none (an error).
    pub fn layer_view(&self, layer: usize, plane: usize) -> Result<LayerView, PoolError> {
        let g = &self.spec.geometry;
        let base = g.layer_base_row(layer)?;
        let ptr = self.plane_ptr(plane)?;
        let w = self.spec.plane_widths[plane]; // plane_ptr checked the index
                                               // A base below row 0 lies in the plane's view lead, which the allocation holds.
        let ptr = checked(
            (base.checked_mul(w as i64)).and_then(|off| ptr.checked_add_signed(off)),
            "layer view address",
        )?;
        Ok(LayerView { layer, plane, ptr, rows: g.layer_view_rows(layer)?, row_bytes: w })
    }

    /// The view `layer`'s compressed indices are rows of: its layer view in plane 0, or in a
    /// pool packing its compressed rows ([`crate::geometry::PackedRows`]) the compressed view,
    /// from plane row 0 over the whole plane at the compressed width (FlashMLA's
    /// `extra_k_cache`: `[rows / 64, 64, 1, 288]`, shift 0). Refused for a layer with no
    /// compressed rows.
    pub fn compressed_view(&self, layer: usize) -> Result<LayerView, PoolError> {
        let g = &self.spec.geometry;
        g.owner(layer)?;
        match g.packed_rows {
            None => self.layer_view(layer, 0),
            Some(p) => Ok(LayerView {
                layer,
                plane: 0,
                // No view lead: a packed geometry has none (compressed indices are absolute).
                ptr: self.plane_ptr(0)?,
                rows: g.compressed_view_rows(layer)?,
                row_bytes: p.compressed as u64,
            }),
        }
    }

    /// `layer`'s rows in `plane` as a kernel reading pages of `page_rows` takes them
    /// ([`PageView`]). A paged plane's own page must be the kernel's; a view starting in the
    /// plane's lead (below row 0) has no page origin (V4.1's compact form: refused).
    pub fn page_view(&self, layer: usize, plane: usize, page_rows: i64) -> Result<PageView, PoolError> {
        let g = &self.spec.geometry;
        let not = |why| PoolError::NotPageable { layer, page_rows, why };
        if page_rows < 1 {
            return Err(not("a page holds at least one row"));
        }
        let ptr = self.plane_ptr(plane)?;
        let w = self.spec.plane_widths[plane];
        let own = self.spec.plane_format(plane).map_or(1, |p| p.page_rows as i64);
        if own > 1 && own != page_rows {
            return Err(not("the plane's rows are paged at another size"));
        }
        let Some((first, row_shift)) = g.layer_page(layer, page_rows)? else {
            return Err(not("the view starts in the plane's lead"));
        };
        // Not one whole page from the view's page to the plane's end (a page larger than the
        // plane): a kernel reading pages would get an empty view with a page size no plane
        // has (numpy refuses `[0, 2^63 − 1, 1, row]`).
        if g.plane_rows - first < page_rows {
            return Err(not("a page is larger than the plane from the view's page on"));
        }
        let off =
            checked(first.checked_mul(w as i64).and_then(|o| u64::try_from(o).ok()), "page view address")?;
        Ok(PageView {
            layer,
            plane,
            ptr: checked(ptr.checked_add(off), "page view address")?,
            pages: (g.plane_rows - first) / page_rows,
            page_rows,
            row_bytes: w,
            row_shift,
        })
    }

    /// Every non-absent layer's view in every plane, in layer order.
    pub fn layer_views(&self) -> Result<Vec<Vec<LayerView>>, PoolError> {
        let g = &self.spec.geometry;
        (0..g.num_layers)
            .filter(|&l| g.ratios[l] != crate::geometry::ABSENT_RATIO)
            .map(|l| (0..self.num_planes()).map(|p| self.layer_view(l, p)).collect())
            .collect()
    }

    /// A typed view of one arena field across all positions, with its device address.
    pub fn state_view(&self, field: &str) -> Result<(DevicePtr, FieldView), PoolError> {
        let g = &self.spec.geometry;
        let idx = self.spec.arena.field_index(field)?;
        let view = self.spec.arena.field_view(idx, g.slot_rows, g.slot_positions)?;
        Ok((self.plane_ptr(view.plane)? + view.offset, view))
    }

    // ---- allocation ---------------------------------------------------------------------

    /// Hand out a slot and initialise its compressor state (queued on the pool's stream).
    pub fn alloc_slot(&self) -> Result<SlotLease, PoolError> {
        let _range = crate::profiling::range("v4pool.alloc_slot");
        let mut st = self.lock()?;
        let handle = st.boundary.alloc_slot()?;
        let position = st.boundary.position(handle)?;
        // Under the lock that handed the position out: a boundary move cannot relocate the
        // slot between the look-up and the fill, and the fill is queued before the caller
        // can queue a write.
        if let Err(e) = self.init_positions_locked(&st, position..position + 1) {
            st.boundary.free_slot(handle)?;
            return Err(e);
        }
        Ok(SlotLease { handle, position })
    }

    /// Return a slot.
    pub fn free_slot(&self, handle: SlotHandle) -> Result<(), PoolError> {
        Ok(self.lock()?.boundary.free_slot(handle)?)
    }

    /// Position of a held slot (the only group → position crossing is in the geometry).
    pub fn slot_position(&self, handle: SlotHandle) -> Result<i64, PoolError> {
        Ok(self.lock()?.boundary.position(handle)?)
    }

    /// Hand out a block.
    pub fn alloc_block(&self) -> Result<BlockGrant, PoolError> {
        Ok(self.lock()?.boundary.alloc_block()?)
    }

    /// Return a block.
    pub fn free_block(&self, handle: BlockHandle) -> Result<(), PoolError> {
        Ok(self.lock()?.boundary.free_block(handle)?)
    }

    /// Check a block handle is current (not freed, not relocated away, from this pool).
    pub fn check_block(&self, handle: BlockHandle) -> Result<(), PoolError> {
        Ok(self.lock()?.boundary.check_block(handle)?)
    }

    /// (num_blocks, num_slots, free blocks, free slots, max blocks beside the slots).
    pub fn counts(&self) -> Result<PoolCounts, PoolError> {
        let st = self.lock()?;
        let b = &st.boundary;
        Ok(PoolCounts {
            num_blocks: b.num_blocks(),
            num_slots: b.num_slots(),
            free_blocks: b.blocks().num_free(),
            free_slots: b.slots().num_free(),
            max_blocks: b.max_blocks(),
            slot_positions: self.spec.geometry.slot_positions,
        })
    }

    /// The pool's own memory next to its planes (`index_bytes` counts what the caller
    /// passes: the index buffers it created for this pool).
    pub fn overhead(&self, index_bytes: u64) -> Result<Overhead, PoolError> {
        let mut o = Overhead::estimate(&self.spec, None)?;
        o.indexer_bytes = self.indexer.as_ref().map_or(0, |a| a.bytes);
        o.descriptor_bytes = self.descriptors.as_ref().map_or(0, |a| a.bytes);
        o.index_bytes = index_bytes;
        Ok(o)
    }

    /// Whether the geometry has a dense class (its decode buffer is always passed).
    pub fn has_dense(&self) -> bool {
        self.spec.geometry.class(DENSE_RATIO).is_some()
    }
}

/// Allocator counts at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolCounts {
    /// Blocks at the current split.
    pub num_blocks: u32,
    /// Slots at the current split.
    pub num_slots: u32,
    /// Blocks not handed out.
    pub free_blocks: u32,
    /// Slots not handed out.
    pub free_slots: u32,
    /// Most blocks the plane holds beside the current slots.
    pub max_blocks: u32,
    /// Slot positions the plane is numbered by.
    pub slot_positions: i64,
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Nothing may still use the memory: wait for the pool's stream first.
        let _ = self.backend.synchronize(self.stream);
        for a in [self.planes.take(), self.indexer.take(), self.descriptors.take()].into_iter().flatten() {
            // SAFETY: the stream is drained and the pool hands out no owning references;
            // views held past the pool's life are the caller's documented misuse.
            unsafe { self.backend.free(a) };
        }
    }
}
