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
pub(crate) mod owned;
mod path;
pub mod prefill;
pub mod regions;
mod rows;
#[cfg(test)]
mod tests;
mod topk;

pub use batch::{WriteBatch, WriteBatchError};
pub use decode::{
    decode_slice_lens, DecodeBuffer, DecodeCapacity, DecodeError, DecodeSeq, FlashMlaBuffers, FlashMlaWidths,
    FlatDecodeBatch,
};
pub use owned::DeviceBuffer;
pub use path::{DecodePath, PrefillPath};
pub use prefill::{prefill_slice_lens, PrefillBuffer, PrefillCapacity, PrefillSeq};
pub use rows::{
    CompressedRow, KvRowWriter, RowSet, RowWriteCapacity, RowWriteError, WindowSeq, INDEX_KEY_VALUES,
};
pub use topk::{convert_topk, CsaTopk, TopkError, TopkRows};

// What the pool's calls take and return from the layers under it (which are public only
// under `crate::raw`): the allocators' handles, the arena layout, the boundary's moves.
pub use crate::alloc::{AllocError, BlockGrant, BlockHandle, SlotHandle};
pub use crate::arena::{ArenaError, ArenaLayout, FieldView};
pub use crate::boundary::{BlockMove, Boundary, BoundaryChange, BoundaryError, SlotMove};
pub use crate::index::CopyRun;

use crate::backend::{Backend, BackendError, DeviceAllocation, Stream};
use crate::checkpoint::{LayoutId, Loc, Region, RegionCopy};
use crate::geometry::{GeometryError, UnifiedPoolGeometry, DENSE_RATIO};
use crate::index::{CopyRunsArgs, DevicePtr, FillRun, FillRunsArgs, Launch};
use crate::sizing::{IndexerDtype, IndexerPart, KvSpec, SizingError};
use regions::{TransferConfig, TransferRegions};
use std::sync::{Arc, Mutex, MutexGuard};
use thiserror::Error;

/// Runs one descriptor launch carries; longer lists take several launches.
const DESCRIPTOR_RUNS: usize = 4096;
const DESCRIPTOR_BYTES: u64 = (DESCRIPTOR_RUNS * std::mem::size_of::<CopyRun>()) as u64;
const PLANE_ALIGN: u64 = 256;

/// What the pool is built from: a geometry at a fixed plane capacity (its split is the
/// initial one), the plane widths, the arena, and the indexer cache's shape.
///
/// The fields are public to read; [`Pool::new`] checks them all against each other again
/// ([`PoolSpec::validate`]), so a spec edited into inconsistency is refused, never carved.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    /// The row space at its fixed plane capacity and initial split.
    pub geometry: UnifiedPoolGeometry,
    /// Row bytes of each plane (the row format's, where the spec has one: [`PoolSpec::kv_spec`]).
    pub plane_widths: Vec<u64>,
    /// The compressor-state fields and where they sit in a slot.
    pub arena: ArenaLayout,
    /// The CSA indexer cache's format (`None`: no indexer cache).
    pub indexer: Option<IndexerDtype>,
    /// Global ids of the layers owning index keys, the indexer cache's layer order
    /// ([`UnifiedPoolGeometry::index_key_layers`]): V4's CSA layers, V4.1's KV sources.
    pub csa_layers: Vec<usize>,
    /// The §6 layout id of the plan the spec came from, with the spec's fingerprint then: a
    /// pool only reports the plan's id while the spec still is what the plan made.
    plan_layout: Option<(LayoutId, String)>,
    /// What the rows are ([`KvSpec`]): the plan's, or one given to a spec from parts
    /// ([`PoolSpec::with_kv_spec`]); a spec from parts without one has byte planes only (no
    /// row writer, gather or attention path).
    kv_spec: Option<KvSpec>,
}

impl PoolSpec {
    /// A spec from its parts, checked ([`PoolSpec::validate`]). Its images carry a layout id
    /// derived from every part that gives image bytes their meaning
    /// ([`PoolSpec::layout_id`]); use [`PoolSpec::from_plan`] for the §6 id of a model.
    pub fn new(
        geometry: UnifiedPoolGeometry,
        plane_widths: Vec<u64>,
        arena: ArenaLayout,
        indexer: Option<IndexerDtype>,
        csa_layers: Vec<usize>,
    ) -> Result<PoolSpec, PoolError> {
        let spec =
            PoolSpec { geometry, plane_widths, arena, indexer, csa_layers, plan_layout: None, kv_spec: None };
        spec.validate()?;
        Ok(spec)
    }

    /// The checkpoint layout of pools of this spec: what one checkpoint's units hold (the
    /// manager's, and the shared tier's count of a checkpoint entry's units).
    pub fn checkpoint_layout(
        &self,
    ) -> Result<crate::checkpoint::CheckpointLayout, crate::checkpoint::CheckpointError> {
        let layers: &[usize] = if self.indexer.is_some() { &self.csa_layers } else { &[] };
        crate::checkpoint::CheckpointLayout::new(
            &self.arena,
            &self.geometry,
            layers,
            self.indexer.unwrap_or(IndexerDtype::Fp8),
        )
    }

    /// The spec of a sized plan: its carve, its arena, its indexer shape. The pool sizes
    /// its indexer cache for every block the plane can hold, so the plan must allow the
    /// boundary down to zero slots (`min_slots = 0`, the default).
    pub fn from_plan(plan: &crate::sizing::Plan) -> Result<PoolSpec, PoolError> {
        if plan.min_slots != 0 {
            return Err(PoolError::MinSlots(plan.min_slots));
        }
        let mut spec = Self::from_layout(&plan.layout, plan.geometry.clone())?;
        spec.kv_spec = Some(plan.kv_spec()?);
        Ok(spec)
    }

    /// This spec with its rows described by `kv` (a spec from parts: tests, engines carving
    /// their own geometry): refused unless the planes are `kv`'s row format's and the
    /// geometry packs compressed rows as `kv` does.
    pub fn with_kv_spec(mut self, kv: KvSpec) -> Result<PoolSpec, PoolError> {
        self.kv_spec = Some(kv);
        self.validate()?;
        Ok(self)
    }

    /// The spec of a priced layout carved to `geometry` (e.g. [`PoolLayout::carve`]): the
    /// layout's arena, widths and indexer, and its §6 layout id for the pool's images.
    ///
    /// [`PoolLayout::carve`]: crate::sizing::PoolLayout::carve
    pub fn from_layout(
        layout: &crate::sizing::PoolLayout,
        geometry: UnifiedPoolGeometry,
    ) -> Result<PoolSpec, PoolError> {
        let mut spec = PoolSpec {
            geometry,
            plane_widths: layout.widths().to_vec(),
            arena: layout.arena.clone(),
            indexer: Some(layout.indexer),
            csa_layers: layout.model.indexer_layers(),
            plan_layout: None,
            kv_spec: Some(layout.kv_spec(None)?),
        };
        spec.validate()?;
        let id = LayoutId::for_layout(layout)?;
        spec.plan_layout = Some((id, spec.fingerprint()));
        Ok(spec)
    }

    /// Check every part against the others: the geometry is what its own inputs build
    /// (no field edited after the carve) with positions numbered from 0, the arena was
    /// planned for these plane widths and has the geometry's arena rows and slot alignment,
    /// the CSA layers are the geometry's ratio-4 layers, and the plan's layout id (if any)
    /// still describes the spec.
    pub fn validate(&self) -> Result<(), PoolError> {
        let g = &self.geometry;
        if g.slot_origin != 0 {
            return Err(PoolError::SlotOrigin(g.slot_origin));
        }
        if UnifiedPoolGeometry::new(g.spec())? != *g {
            return Err(PoolError::InconsistentSpec {
                what: "geometry (a field differs from what its inputs build)",
            });
        }
        if self.plane_widths.is_empty() || self.plane_widths.contains(&0) {
            return Err(PoolError::InconsistentSpec { what: "plane_widths (empty, or a zero width)" });
        }
        if let Some(p) = g.packed_rows {
            // Compressed rows packed at their own width live in one plane of `p.plane`-B rows.
            if self.plane_widths.len() != 1 || i64::try_from(self.plane_widths[0]).ok() != Some(p.plane) {
                return Err(PoolError::InconsistentSpec {
                    what: "plane_widths (packed compressed rows need one plane of the packing's row width)",
                });
            }
        }
        if self.arena.widths() != self.plane_widths {
            return Err(PoolError::InconsistentSpec {
                what: "plane_widths (the arena was planned for others)",
            });
        }
        if self.arena.arena_rows() != g.arena_rows {
            return Err(PoolError::ArenaMismatch { arena: self.arena.arena_rows(), geometry: g.arena_rows });
        }
        if self.arena.slot_align_rows() != g.slot_align_rows {
            return Err(PoolError::InconsistentSpec { what: "slot_align_rows (arena and geometry differ)" });
        }
        if g.index_key_layers() != self.csa_layers {
            return Err(PoolError::InconsistentSpec {
                what:
                    "csa_layers (not the geometry's index-key layers: V4's ratio-4 layers, V4.1's KV sources)",
            });
        }
        if let Some(kv) = &self.kv_spec {
            if !kv.row_format().planes.iter().map(|p| p.row_bytes()).eq(self.plane_widths.iter().copied()) {
                return Err(PoolError::InconsistentSpec {
                    what: "plane_widths (not the row format's planes)",
                });
            }
            if kv.packed() != g.packed_rows {
                return Err(PoolError::InconsistentSpec {
                    what: "packed_rows (the geometry packs compressed rows otherwise than the row format)",
                });
            }
        }
        if let Some((_, fp)) = &self.plan_layout {
            if *fp != self.fingerprint() {
                return Err(PoolError::InconsistentSpec { what: "a part edited after from_plan" });
            }
        }
        Ok(())
    }

    /// What the pool's rows are (`None` for a spec from parts given none).
    pub fn kv_spec(&self) -> Option<&KvSpec> {
        self.kv_spec.as_ref()
    }

    /// The row format: what every byte of a plane row means (`None` without a [`KvSpec`]).
    pub fn row_format(&self) -> Option<&'static crate::format::RowFormat> {
        self.kv_spec.as_ref().map(KvSpec::row_format)
    }

    /// The one element type every byte of plane `plane`'s rows holds, read from the row format:
    /// `Some(e)` where the plane is values of `e` alone (ATOM fp8's RoPE plane, the bf16 plane:
    /// bf16), `None` where encodings or scales share it (the fp8 NoPE plane, FlashMLA's rows:
    /// bytes) or the spec has no format. What a binding exports a plane's views as.
    pub fn plane_elem(&self, plane: usize) -> Option<crate::format::Elem> {
        let f = self.row_format()?;
        let row_bits = f.planes.get(plane)?.row_bytes() * 8;
        if f.segments.iter().any(|s| s.scale.is_some_and(|c| c.place.plane == plane)) {
            return None;
        }
        let mut elem = None;
        let mut bits = 0u64;
        for s in f.segments.iter().filter(|s| s.data.plane == plane) {
            if elem.is_some_and(|e| e != s.elem) {
                return None;
            }
            elem = Some(s.elem);
            bits += s.count as u64 * s.elem.bits() as u64;
        }
        elem.filter(|_| bits == row_bits)
    }

    /// The indexer cache's layers per indexer pool ([`IndexerDtype::layer_parts`]); empty
    /// without an indexer cache.
    pub fn indexer_parts(&self) -> Result<Vec<Vec<IndexerPart>>, PoolError> {
        match self.indexer.filter(|_| !self.csa_layers.is_empty()) {
            Some(ix) => Ok(ix.layer_parts(&self.geometry, &self.csa_layers)?),
            None => Ok(Vec::new()),
        }
    }

    /// The layout id images of this spec's pools carry: the plan's §6 id for a spec from
    /// [`PoolSpec::from_plan`], else one built from every part that gives image bytes their
    /// meaning (ratios in order, ring, block size, rows, widths, arena fields, indexer).
    pub fn layout_id(&self) -> LayoutId {
        match &self.plan_layout {
            Some((id, _)) => id.clone(),
            None => LayoutId::new(self.fingerprint()),
        }
    }

    /// Everything that decides what an image's bytes mean, on one line.
    fn fingerprint(&self) -> String {
        let g = &self.geometry;
        let join = |v: &[String]| v.join(",");
        let fields: Vec<String> = self
            .arena
            .fields()
            .iter()
            .map(|f| {
                let shape: Vec<String> = f.shape.iter().map(u64::to_string).collect();
                format!(
                    "{}[{}x{}]{:?}/{:?}/{}/{}",
                    f.name,
                    f.layers,
                    shape.join("x"),
                    f.dtype,
                    f.fill,
                    if f.carried { "carried" } else { "nocopy" },
                    f.align
                )
            })
            .collect();
        let id = format!(
            "v4pool-spec:ratios={}:block={}:ring={}:arena_rows={}:entry_rows={}:slot_rows={}:widths={}\
             :fields={}:indexer={}:csa={}",
            join(&g.ratios.iter().map(i32::to_string).collect::<Vec<_>>()),
            g.block_size,
            g.ring_slots,
            g.arena_rows,
            g.entry_rows,
            g.slot_rows,
            join(&self.plane_widths.iter().map(u64::to_string).collect::<Vec<_>>()),
            fields.join(";"),
            self.indexer.map_or("none", |ix| ix.name()),
            join(&self.csa_layers.iter().map(usize::to_string).collect::<Vec<_>>()),
        );
        // Shared compressors change every compressed address; V4's id stays as it was.
        let id = match &g.kv_sources {
            None => id,
            Some(src) => format!(
                "{id}:kv_sources={}:form={:?}",
                join(&src.iter().map(usize::to_string).collect::<Vec<_>>()),
                g.form
            ),
        };
        match g.packed_rows {
            None => id,
            Some(p) => format!("{id}:packed={}/{}", p.compressed, p.plane),
        }
    }
}

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
/// (a layer's base need not start a page: V4's CSA layers start 40 rows into one). Every layer
/// of a class has the same shift where its layer term is whole pages (CSA; dense at ring 128),
/// so one index buffer, shifted once, serves the class; HCA layers (2 rows apart) each have
/// their own (docs/flashmla.md).
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
        let own = crate::format::plane_of_width(w).page_rows as i64;
        if own > 1 && own != page_rows {
            return Err(not("the plane's rows are paged at another size"));
        }
        let base = g.layer_base_row(layer)?;
        if base < 0 {
            return Err(not("the view starts in the plane's lead"));
        }
        let first = base / page_rows * page_rows;
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
            row_shift: base - first,
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

    /// Run a closure on the boundary (read-only), e.g. for reporting.
    pub fn with_boundary<R>(&self, f: impl FnOnce(&Boundary) -> R) -> Result<R, PoolError> {
        Ok(f(&self.lock()?.boundary))
    }

    // ---- the elastic boundary -----------------------------------------------------------

    /// Move the boundary by `op` and carry out what it reports: copy relocated blocks (both
    /// planes and every indexer layer) and slots. The copies are queued on the pool's stream
    /// before anything else the caller queues.
    ///
    /// All or nothing: the move is planned on a copy of the bookkeeping and committed only
    /// once every copy is queued. If one fails, the pool keeps its old split and handles;
    /// the copies that did run wrote only ids and positions that are free in the old split
    /// (block moves go to free ids below the new count, slot moves to vacant groups), and
    /// the pool's allocator indexes no hashes, so nothing live was touched. Newly live
    /// positions are not filled here: [`Pool::alloc_slot`] initialises every position it
    /// hands out, under this lock, before its holder can write it — a fill here would
    /// overwrite the rows of the old split's blocks before the move is known to stand.
    fn apply(
        &self,
        op: impl FnOnce(&mut Boundary) -> Result<BoundaryChange, BoundaryError>,
    ) -> Result<BoundaryChange, PoolError> {
        let _range = crate::profiling::range("v4pool.boundary_move");
        let mut st = self.lock()?;
        if st.pins > 0 {
            return Err(PoolError::BoundaryPinned { pins: st.pins });
        }
        let mut next = st.boundary.clone();
        let change = op(&mut next)?;
        let runs = self.relocation_runs(&change)?;
        // Under the lock that moves the boundary: a slot or block handed out right after
        // the move is written by its holder only after these are queued.
        // SAFETY: the runs were derived from this pool's planes and indexer by the geometry.
        unsafe { self.queue_copies(&runs)? };
        st.boundary = next;
        Ok(change)
    }

    /// Pin the boundary: until the returned guard drops, every boundary move is refused
    /// with [`PoolError::BoundaryPinned`], so the ids and positions of held handles stay
    /// where they are. For copies that run outside the pool's stream and lock (a transfer
    /// engine's, a host tier's): pin first, then look handles up, copy, and drop the pin.
    /// Allocation and release go on meanwhile.
    pub fn pin_boundary(&self) -> Result<BoundaryPin<'_>, PoolError> {
        let mut st = self.lock()?;
        st.pins = st.pins.checked_add(1).ok_or(PoolError::Overflow("boundary pins"))?;
        Ok(BoundaryPin { pool: self })
    }

    /// Block ids of held handles, looked up together under the state lock.
    pub fn block_ids(&self, blocks: &[BlockHandle]) -> Result<Vec<u32>, PoolError> {
        let st = self.lock()?;
        blocks
            .iter()
            .map(|&b| {
                st.boundary.check_block(b)?;
                Ok(b.id)
            })
            .collect()
    }

    /// Add `n` slots, moving the boundary down (relocating blocks as needed).
    pub fn grow_slots(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.grow_slots(n))
    }
    /// Remove `n` slots, moving the boundary up (relocating slots as needed).
    pub fn shrink_slots(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.shrink_slots(n))
    }
    /// Add `n` blocks in the gap.
    pub fn grow_blocks(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.grow_blocks(n))
    }
    /// Add `n` blocks, giving up slots when the gap is too small.
    pub fn grow_blocks_shrinking_slots(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.grow_blocks_shrinking_slots(n))
    }
    /// Remove `n` blocks (relocating blocks as needed).
    pub fn shrink_blocks(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.shrink_blocks(n))
    }
    /// Move the split to exactly `num_blocks` blocks and `num_slots` slots.
    pub fn resize(&self, num_blocks: u32, num_slots: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.resize(num_blocks, num_slots))
    }

    /// The copies a boundary change needs, as device byte ranges.
    fn relocation_runs(&self, change: &BoundaryChange) -> Result<Vec<CopyRun>, PoolError> {
        let mut runs = Vec::new();
        for m in &change.block_moves {
            runs.extend(self.block_copy_runs(m.old.id, m.new.id)?);
        }
        for m in &change.slot_moves {
            runs.extend(self.slot_copy_runs(m.from_position, m.to_position)?);
        }
        Ok(runs)
    }

    /// Copies that move block `from`'s bytes to block `to`: its envelope rows in every plane
    /// and its block in every indexer pool and CSA layer.
    pub fn block_copy_runs(&self, from: u32, to: u32) -> Result<Vec<CopyRun>, PoolError> {
        let g = &self.spec.geometry;
        for id in [from, to] {
            if u64::from(id) >= self.indexer_blocks {
                return Err(PoolError::NoSuchBlock { id, max: self.indexer_blocks });
            }
        }
        let (from, to) = (u64::from(from), u64::from(to));
        let mut runs = Vec::new();
        for (p, &w) in self.spec.plane_widths.iter().enumerate() {
            let base = self.plane_ptr(p)?;
            let bytes = g.block_bytes(w);
            runs.push(CopyRun { src: base + from * bytes, dst: base + to * bytes, bytes });
        }
        if let Some(base) = self.indexer_ptr() {
            for (parts, &off) in self.indexer_parts().iter().zip(&self.indexer_offsets) {
                for part in parts {
                    let (pb, layer) = (part.block_bytes, base + off + part.prefix * self.indexer_blocks);
                    runs.push(CopyRun { src: layer + from * pb, dst: layer + to * pb, bytes: pb });
                }
            }
        }
        Ok(runs)
    }

    /// Copies that move the slot at position `from` to position `to` (state and windows,
    /// every plane).
    pub fn slot_copy_runs(&self, from: i64, to: i64) -> Result<Vec<CopyRun>, PoolError> {
        let g = &self.spec.geometry;
        let (from, _) = g.slot_span(from)?;
        let (to, _) = g.slot_span(to)?;
        let mut runs = Vec::new();
        for (p, &w) in self.spec.plane_widths.iter().enumerate() {
            let base = self.plane_ptr(p)?;
            runs.push(CopyRun {
                src: base + from as u64 * w,
                dst: base + to as u64 * w,
                bytes: g.slot_bytes(w),
            });
        }
        Ok(runs)
    }

    /// Queue `runs` (non-overlapping byte copies) as descriptor launches on the pool stream,
    /// ordered after every relocation queued before it.
    ///
    /// # Safety
    /// Every run's source and destination must be live memory of this pool's backend that
    /// stays live until the pool's stream has run the copy, and no destination may overlap
    /// another run's bytes. Prefer [`Pool::copy_regions`], which checks runs against the
    /// pool's own memory.
    pub unsafe fn copy_runs(&self, runs: &[CopyRun]) -> Result<(), PoolError> {
        let _st = self.lock()?;
        // SAFETY: the caller's contract.
        unsafe { self.queue_copies(runs) }
    }

    /// Queue copies between the pool's own regions (planes and indexer pools, offsets from
    /// each region's first byte; [`crate::checkpoint::RegionCopy`], as a store or restore plan
    /// writes them), under the lock that moves the boundary. Every run is checked to lie in
    /// its regions and not to overlap itself; nothing is queued if one fails.
    pub fn copy_regions(&self, runs: &[RegionCopy]) -> Result<(), PoolError> {
        let mut raw = Vec::with_capacity(runs.len());
        for (index, r) in runs.iter().enumerate() {
            let src = self.region_range(r.src, r.bytes)?;
            let dst = self.region_range(r.dst, r.bytes)?;
            if r.src.region == r.dst.region
                && r.src.offset < r.dst.offset + r.bytes
                && r.dst.offset < r.src.offset + r.bytes
            {
                return Err(PoolError::SelfOverlap { index });
            }
            raw.push(CopyRun { src, dst, bytes: r.bytes });
        }
        let _st = self.lock()?;
        // SAFETY: every run was checked to lie inside this pool's planes or indexer.
        unsafe { self.queue_copies(&raw) }
    }

    /// Bytes of a region: a plane, or one indexer pool (`[n_csa][indexer_blocks][block]`).
    fn region_bytes(&self, region: Region) -> Result<u64, PoolError> {
        match region {
            Region::Plane(p) => self.plane_bytes(p),
            Region::Indexer(i) => {
                let parts = self.indexer_parts().get(i).ok_or(PoolError::NoSuchRegion { region })?;
                let per_block = parts.iter().try_fold(0u64, |acc, p| acc.checked_add(p.block_bytes));
                checked(per_block.and_then(|b| b.checked_mul(self.indexer_blocks)), "indexer pool bytes")
            }
        }
    }

    /// The device address of `loc .. loc + bytes`, checked to lie in its region.
    fn region_range(&self, loc: Loc, bytes: u64) -> Result<DevicePtr, PoolError> {
        let limit = self.region_bytes(loc.region)?;
        if loc.offset.checked_add(bytes).is_none_or(|end| end > limit) {
            return Err(PoolError::OutOfRange { what: "the region", offset: loc.offset, len: bytes, limit });
        }
        Ok(match loc.region {
            Region::Plane(p) => self.plane_ptr(p)?,
            Region::Indexer(i) => self.indexer_ptr().unwrap_or(0) + self.indexer_offsets[i],
        } + loc.offset)
    }

    /// Queue copies with the caller holding the state lock (or owning the pool outright).
    ///
    /// # Safety
    /// As [`Pool::copy_runs`].
    unsafe fn queue_copies(&self, runs: &[CopyRun]) -> Result<(), PoolError> {
        let _range = crate::profiling::range("v4pool.copy_runs");
        self.run_descriptors(&split_runs(runs), |runs, num_runs| {
            Launch::CopyRuns(CopyRunsArgs { runs, num_runs, _pad: 0 })
        })
    }

    /// Initialise the compressor state of `positions` (zero kv, −inf scores, zero padding),
    /// under the lock that hands positions out. Every position must be a live slot position
    /// (one the slot region holds now); anything else is refused before a byte is written.
    pub fn init_positions(&self, positions: std::ops::Range<i64>) -> Result<(), PoolError> {
        let st = self.lock()?;
        self.init_positions_locked(&st, positions)
    }

    /// [`Pool::init_positions`] with the lock held by the caller (`st` proves it).
    fn init_positions_locked(&self, st: &State, positions: std::ops::Range<i64>) -> Result<(), PoolError> {
        let _range = crate::profiling::range("v4pool.init_state");
        let live = st.boundary.live_positions();
        if !positions.is_empty() && (positions.start < live.start || positions.end > live.end) {
            return Err(PoolError::NotLive {
                start: positions.start,
                end: positions.end,
                live_start: live.start,
                live_end: live.end,
            });
        }
        let g = &self.spec.geometry;
        let mut runs = Vec::new();
        for pos in positions {
            for r in self.spec.arena.fill_runs(pos, g.slot_rows)? {
                runs.push(FillRun {
                    dst: self.plane_range(r.plane, r.offset, r.bytes)?,
                    bytes: r.bytes,
                    pattern: r.pattern,
                    _pad: 0,
                });
            }
        }
        self.run_descriptors(&runs, |runs, num_runs| {
            Launch::FillRuns(FillRunsArgs { runs, num_runs, _pad: 0 })
        })
    }

    /// Upload `items` into the descriptor buffer a chunk at a time and queue `launch` for each
    /// chunk. The descriptor lock is held across each upload and its launch: both are queued
    /// on the pool's one stream, so another thread's next upload is ordered after this launch
    /// and cannot overwrite descriptors it has yet to read.
    fn run_descriptors<T: bytemuck::Pod>(
        &self,
        items: &[T],
        launch: impl Fn(DevicePtr, i32) -> Launch,
    ) -> Result<(), PoolError> {
        let desc = self.descriptors.as_ref().map_or(0, |a| a.ptr);
        let per = (DESCRIPTOR_BYTES as usize / std::mem::size_of::<T>()).max(1);
        let _guard = self.descriptor_lock.lock().map_err(|_| PoolError::Poisoned)?;
        for chunk in items.chunks(per) {
            // SAFETY: the descriptor buffer holds DESCRIPTOR_BYTES and is live while the pool
            // is; every run was derived from this pool's own allocations (checked by the
            // geometry and the arena); upload and launch are ordered on the same stream.
            unsafe {
                self.backend.upload(desc, bytemuck::cast_slice(chunk), self.stream)?;
                self.backend.launch(&launch(desc, chunk.len() as i32), self.stream)?;
            }
        }
        Ok(())
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

/// Bytes one copy run carries at most once split: the copy kernel gives every run the same
/// number of blocks, so a few large runs (a 17 MB slot move is two) would leave most of the
/// device idle. Pieces this size keep every run's blocks busy and the grid wide.
pub const COPY_PIECE_BYTES: u64 = 256 << 10;

/// `runs` with every run longer than [`COPY_PIECE_BYTES`] cut into pieces (same bytes).
pub fn split_runs(runs: &[CopyRun]) -> Vec<CopyRun> {
    let mut out = Vec::with_capacity(runs.len());
    for r in runs {
        let mut done = 0;
        while done < r.bytes {
            let n = (r.bytes - done).min(COPY_PIECE_BYTES);
            out.push(CopyRun { src: r.src + done, dst: r.dst + done, bytes: n });
            done += n;
        }
    }
    out
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
