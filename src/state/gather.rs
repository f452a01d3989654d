//! DSpark window gather (`index-buffers.md` §9): a dense `[B, Wd, 512]` bf16 draft window
//! materialised from each sequence's ring, addressed by its slot lease.
//!
//! ```text
//! let mut g = pool.window_gather(GatherCapacity { max_seqs, out_window })?;  // once
//! g.stage(&[GatherSeq { slot, anchor, context_len }, ...])?;                  // per step
//! g.gather(layer, wd)?;                    // into the handle's own output (readable back)
//! unsafe { g.gather_into(layer, wd, out)? };  // or into an engine tensor
//! ```
//!
//! The source is a layer: a layer of a class reads its class's ring through its own view
//! (both planes in an fp8 pool, dequantised; one bf16 plane copied); an absent (DSpark draft)
//! layer reads its carried window, the `state_window` field, through the plane retyped to
//! 1024-B rows (`pool-runtime.md` §2.4, the carried-window view). The handle owns its slot and
//! anchor buffers at fixed addresses (graph-capture safe: a replay reads whatever was staged
//! last) and launches one grid of `max_seqs` sequences; sequences past the staged batch are
//! pads (slot −1) and nothing of theirs is written.

use crate::alloc::{AllocError, SlotHandle};
use crate::arena::{ArenaError, STATE_WINDOW, WINDOW_ROW_BYTES};
use crate::backend::{BackendError, Stream};
use crate::format::RowFormatId;
use crate::geometry::{GeometryError, WindowParams, ABSENT_RATIO};
use crate::index::{DevicePtr, Launch, WindowGatherArgs, GATHER_ROW_BYTES};
use crate::pool::owned::{Carve, Owned};
use crate::pool::{DeviceBuffer, Pool, PoolError};
use std::sync::Arc;
use thiserror::Error;

crate::variant::variant_names! {
/// What the window gather refuses, before anything is launched.
#[derive(Debug, Error)]
pub enum GatherError {
    /// A draft window of no rows.
    #[error("the draft window must be at least 1 row")]
    EmptyWindow,
    /// A draft window wider than the ring: its oldest rows were already recycled (§9, §11).
    #[error("draft window {draft_window} exceeds the ring's {ring_slots} slots")]
    WindowExceedsRing {
        /// The window asked for.
        draft_window: usize,
        /// Ring positions.
        ring_slots: i64,
    },
    /// A draft window wider than the handle's own output was sized for.
    #[error("draft window {draft_window} exceeds the {cap} rows per sequence of the handle's output")]
    WindowExceedsOutput {
        /// The window asked for.
        draft_window: usize,
        /// `out_window`.
        cap: usize,
    },
    /// The handle was built without an output of its own (`out_window = 0`).
    #[error("the handle has no output buffer (capacity out_window = 0); use gather_into")]
    NoOutput,
    /// More sequences than the buffers hold.
    #[error("batch of {got} sequences exceeds the {cap} the buffers were sized for")]
    TooManySeqs {
        /// Sequences given.
        got: usize,
        /// `max_seqs`.
        cap: usize,
    },
    /// A negative anchor position.
    #[error("sequence {seq}: anchor {anchor} is negative")]
    NegativeAnchor {
        /// Batch row.
        seq: usize,
        /// The anchor given.
        anchor: i64,
    },
    /// An anchor at or past the sequence's context: that position was never written.
    #[error("sequence {seq}: anchor {anchor} is past its context of {context_len} tokens")]
    AnchorPastContext {
        /// Batch row.
        seq: usize,
        /// The anchor given.
        anchor: i64,
        /// Tokens written so far.
        context_len: i64,
    },
    /// A layer id the pool does not have.
    #[error("layer {layer} is not a layer of the pool ({layers} layers)")]
    NoSuchLayer {
        /// The layer given.
        layer: usize,
        /// Layers of the pool.
        layers: usize,
    },
    /// A layer whose ring cannot be gathered.
    #[error("layer {layer} has no gatherable window: {why}")]
    NoWindow {
        /// The layer given.
        layer: usize,
        /// Why.
        why: String,
    },
    /// A layer whose ratio has no ring window in this geometry.
    #[error("layer {layer} has no gatherable window: {source}")]
    WindowGeometry {
        /// The layer given.
        layer: usize,
        /// What the geometry refused.
        source: GeometryError,
    },
    /// An absent layer whose carried window the arena does not place (no `state_window`
    /// field).
    #[error("layer {layer} has no carried window: {source}")]
    NoCarriedWindow {
        /// The layer given.
        layer: usize,
        /// What the arena refused.
        source: ArenaError,
    },
    /// A slot lease that is not live (freed, relocated away, or another pool's).
    #[error("sequence {seq}: slot lease is not live: {source}")]
    StaleLease {
        /// Batch row.
        seq: usize,
        /// What the slot allocator refused.
        source: AllocError,
    },
    /// Sizes whose byte counts overflow.
    #[error("gather buffers of {max_seqs} sequences x {out_window} rows overflow")]
    TooLarge {
        /// `max_seqs`.
        max_seqs: usize,
        /// `out_window`.
        out_window: usize,
    },
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A staged position that does not fit the kernel's i32 slot index.
    #[error("sequence {seq}: position {position} exceeds i32")]
    PositionPastI32 {
        /// Batch row.
        seq: usize,
        /// Its slot position.
        position: i64,
    },
    /// The pool refused (a poisoned lock, a plane it does not have).
    #[error("pool: {0}")]
    Pool(#[source] PoolError),
    /// An output range [`WindowGather::gather_into`] cannot write: too short, misaligned, or
    /// overlapping what the launch reads.
    #[error("gather output at {out:#x} ({bytes} B): {why}")]
    BadOutput {
        /// The output's address.
        out: DevicePtr,
        /// Its length in bytes.
        bytes: u64,
        /// Why.
        why: String,
    },
}
}

fn pool_err(e: PoolError) -> GatherError {
    match e {
        PoolError::Backend(b) => GatherError::Backend(b),
        other => GatherError::Pool(other),
    }
}

/// What a gather handle is sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GatherCapacity {
    /// Sequences per gather: the grid every launch runs (sequences past the staged batch are
    /// pads).
    pub max_seqs: usize,
    /// Rows per sequence of the handle's own output (`[max_seqs, out_window, 512]` bf16);
    /// 0 = no output of its own (only [`WindowGather::gather_into`]).
    pub out_window: usize,
}

impl GatherCapacity {
    /// `max_seqs` sequences per gather, `out_window` rows each of the handle's own output.
    pub fn new(max_seqs: usize, out_window: usize) -> Self {
        GatherCapacity { max_seqs, out_window }
    }
}

/// One sequence of a gather batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GatherSeq {
    /// The sequence's slot lease (checked live; its position is what the kernel reads).
    pub slot: SlotHandle,
    /// The newest position of the window: rows `anchor − (Wd − 1) ..= anchor`, zeros below 0.
    pub anchor: i64,
    /// Tokens written so far, when the engine knows it: the anchor must be below it.
    pub context_len: Option<i64>,
}

impl GatherSeq {
    /// One draft-window request, every field given (the struct is `#[non_exhaustive]`: a field added later
    /// gets a default here and a setter).
    pub fn new(slot: SlotHandle, anchor: i64, context_len: Option<i64>) -> Self {
        GatherSeq { slot, anchor, context_len }
    }
}

/// Where a layer's window lives: view base(s), window params, rows of the view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherSource {
    /// The layer.
    pub layer: usize,
    /// Its ring's window parameters (its class's, or its carried window's field params).
    pub params: WindowParams,
    /// Row 0 of the view rows are read through (1024-B bf16 rows, or fp8 NoPE rows).
    pub pool: DevicePtr,
    /// The RoPE plane's view when the rows are fp8 (dequantised), else 0 (rows copied).
    pub rope: DevicePtr,
    /// Rows of the view.
    pub view_rows: i64,
}

impl GatherSource {
    /// Whether the gather dequantises (fp8 NoPE + bf16 RoPE) rather than copies.
    pub fn is_fp8(&self) -> bool {
        self.rope != 0
    }
}

impl Pool {
    /// A window-gather handle for this pool: slot and anchor buffers for `cap.max_seqs`
    /// sequences (and an output of `cap.out_window` rows each) on the pool's backend.
    pub fn window_gather(self: &Arc<Self>, cap: GatherCapacity) -> Result<WindowGather, GatherError> {
        WindowGather::new(Arc::clone(self), cap)
    }

    /// Where `layer`'s window is read from (§9): its class's ring through its layer view(s),
    /// or, for an absent layer, its `state_window` field through the carried-window view.
    pub fn gather_source(&self, layer: usize) -> Result<GatherSource, GatherError> {
        let spec = self.spec();
        let g = &spec.geometry;
        let ratio = *g.ratios.get(layer).ok_or(GatherError::NoSuchLayer { layer, layers: g.num_layers })?;
        let no_window = |why: String| GatherError::NoWindow { layer, why };
        if ratio == ABSENT_RATIO {
            return self.carried_window_source(layer);
        }
        let params =
            g.window_params(ratio).map_err(|source| GatherError::WindowGeometry { layer, source })?;
        let view = |plane| self.layer_view(layer, plane).map_err(pool_err);
        // The spec says what the rows are; the gather kernel reads bf16 rows, or ATOM's fp8
        // rows (NoPE and RoPE planes), and dequantises them to bf16.
        let format = spec.row_format().ok_or_else(|| {
            no_window("the pool's spec has no row format (a spec from parts without a KvSpec)".into())
        })?;
        let (pool, rope) = match format.id {
            RowFormatId::Bf16 => (view(0)?, None),
            RowFormatId::AtomFp8 => (view(0)?, Some(view(1)?)),
            _ => {
                return Err(no_window(format!(
                    "the window gather reads atom-fp8 or bf16 rows, not {}",
                    format.name
                )))
            }
        };
        Ok(GatherSource {
            layer,
            params,
            pool: pool.ptr,
            rope: rope.map_or(0, |r| r.ptr),
            view_rows: pool.rows,
        })
    }

    /// An absent layer's carried window: draft layer `j` (its rank among the absent layers)
    /// owns rows `j × ring_slots ..` of the `state_window` field, read through the field's
    /// plane retyped to 1024-B rows with `field_window_params` (`pool-runtime.md` §2.4).
    fn carried_window_source(&self, layer: usize) -> Result<GatherSource, GatherError> {
        let spec = self.spec();
        let g = &spec.geometry;
        let no_window = |why: String| GatherError::NoWindow { layer, why };
        let no_field = |source| GatherError::NoCarriedWindow { layer, source };
        let field = spec.arena.field_index(STATE_WINDOW).map_err(no_field)?;
        let (plane, offset) = spec.arena.field_place(field).map_err(no_field)?;
        let width = spec.plane_widths[plane];
        if width == 0 || WINDOW_ROW_BYTES % width != 0 {
            return Err(no_window(format!("a {width}-B plane does not divide {WINDOW_ROW_BYTES}-B rows")));
        }
        let rank = g.ratios[..layer].iter().filter(|&&r| r == ABSENT_RATIO).count() as u64;
        let layers = spec.arena.fields()[field].layers;
        if rank >= layers {
            return Err(no_window(format!("draft rank {rank} outside the field's {layers} layers")));
        }
        let too_large = || no_window("field offset overflows".into());
        let bytes = (rank.checked_mul(g.ring_slots as u64))
            .and_then(|r| r.checked_mul(WINDOW_ROW_BYTES))
            .and_then(|r| r.checked_add(offset))
            .ok_or_else(too_large)?;
        let rows = i64::try_from(bytes / width).map_err(|_| too_large())?;
        let per = (WINDOW_ROW_BYTES / width) as i64;
        let params = g
            .field_window_params(rows, per)
            .map_err(|source| GatherError::WindowGeometry { layer, source })?;
        Ok(GatherSource {
            layer,
            params,
            pool: self.plane_ptr(plane).map_err(pool_err)?,
            rope: 0,
            view_rows: g.plane_rows / per,
        })
    }
}

/// The DSpark window gather of one pool: an owned handle (see the module doc).
///
/// Every lease is checked live at [`Self::stage`] and again when a gather is queued, under the
/// pool's lock (so no boundary move slips between the check and the launch).
#[derive(Debug)]
pub struct WindowGather {
    pool: Arc<Pool>,
    owned: Owned,
    cap: GatherCapacity,
    slots_at: u64,
    anchors_at: u64,
    out_at: u64,
    /// Leases of the batch staged last.
    staged: Vec<SlotHandle>,
    /// Entries of the device slot array that may hold a real slot (the rest are pads).
    dirty: usize,
    /// `(sequences, draft window)` of the last gather into the handle's output.
    last_gather: Option<(usize, usize)>,
}

/// `(slots, anchors, out, total)` byte offsets of a handle's buffers.
fn layout(cap: GatherCapacity) -> Option<(u64, u64, u64, u64)> {
    let n = cap.max_seqs as u64;
    let mut c = Carve::default();
    let slots = c.take(n, 4)?;
    let anchors = c.take(n, 8)?;
    let out = c.take(n.checked_mul(cap.out_window as u64)?, GATHER_ROW_BYTES)?;
    Some((slots, anchors, out, c.end()))
}

impl WindowGather {
    /// Buffers for `cap` on `pool`'s backend and stream (see [`Pool::window_gather`]).
    pub fn new(pool: Arc<Pool>, cap: GatherCapacity) -> Result<WindowGather, GatherError> {
        let too_large = GatherError::TooLarge { max_seqs: cap.max_seqs, out_window: cap.out_window };
        if i32::try_from(cap.max_seqs).is_err() {
            return Err(too_large);
        }
        let (slots_at, anchors_at, out_at, bytes) = layout(cap).ok_or(too_large)?;
        let owned = Owned::new(Arc::clone(pool.backend()), pool.stream(), bytes)?;
        let mut g = WindowGather {
            pool,
            owned,
            cap,
            slots_at,
            anchors_at,
            out_at,
            staged: Vec::new(),
            dirty: cap.max_seqs,
            last_gather: None,
        };
        g.stage(&[])?; // every sequence a pad until a batch is staged
        Ok(g)
    }

    /// Device bytes a handle for `cap` takes, without allocating.
    pub fn required_bytes(cap: GatherCapacity) -> Result<u64, GatherError> {
        layout(cap)
            .map(|l| l.3)
            .ok_or(GatherError::TooLarge { max_seqs: cap.max_seqs, out_window: cap.out_window })
    }

    /// The pool this handle reads.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }
    /// The stream every upload and launch goes on (the pool's).
    pub fn stream(&self) -> Stream {
        self.owned.stream()
    }
    /// What the buffers were sized for.
    pub fn capacity(&self) -> GatherCapacity {
        self.cap
    }
    /// Sequences of the batch staged last.
    pub fn staged(&self) -> usize {
        self.staged.len()
    }

    /// Stage a batch: every lease checked live and mapped to its position, every anchor
    /// checked (non-negative, below a known context); uploads O(batch) bytes. Returns the
    /// batch size.
    pub fn stage(&mut self, batch: &[GatherSeq]) -> Result<usize, GatherError> {
        if batch.len() > self.cap.max_seqs {
            return Err(GatherError::TooManySeqs { got: batch.len(), cap: self.cap.max_seqs });
        }
        for (seq, s) in batch.iter().enumerate() {
            if s.anchor < 0 {
                return Err(GatherError::NegativeAnchor { seq, anchor: s.anchor });
            }
            if let Some(context_len) = s.context_len.filter(|&c| s.anchor >= c) {
                return Err(GatherError::AnchorPastContext { seq, anchor: s.anchor, context_len });
            }
        }
        let positions = self.positions(batch.iter().map(|s| s.slot))?;
        // Pads over whatever an earlier, longer batch left.
        let mut slots = vec![-1i32; batch.len().max(self.dirty)];
        for (seq, (dst, &position)) in slots.iter_mut().zip(&positions).enumerate() {
            // A position is below the plane's rows, which fit an i32.
            *dst = i32::try_from(position).map_err(|_| GatherError::PositionPastI32 { seq, position })?;
        }
        let anchors: Vec<i64> = batch.iter().map(|s| s.anchor).collect();
        self.owned.upload(self.slots_at, bytemuck::cast_slice(&slots))?;
        self.owned.upload(self.anchors_at, bytemuck::cast_slice(&anchors))?;
        self.staged = batch.iter().map(|s| s.slot).collect();
        self.dirty = batch.len();
        Ok(batch.len())
    }

    /// Positions of `leases` under one pool lock; a lease that is not live is an error.
    fn positions(&self, leases: impl Iterator<Item = SlotHandle>) -> Result<Vec<i64>, GatherError> {
        self.pool
            .with_boundary(|b| {
                leases
                    .enumerate()
                    .map(|(seq, h)| b.position(h).map_err(|source| GatherError::StaleLease { seq, source }))
                    .collect()
            })
            .map_err(pool_err)?
    }

    /// The launch of a gather of `layer`'s window of `draft_window` rows into `out`
    /// (`[max_seqs, draft_window, 512]` bf16), checked; for graph capture (running it through
    /// [`crate::backend::Backend::launch`] is the caller's `unsafe`). A replay gathers the batch
    /// staged at that time.
    pub fn gather_launch(
        &self,
        layer: usize,
        draft_window: usize,
        out: DevicePtr,
    ) -> Result<Launch, GatherError> {
        let src = self.pool.gather_source(layer)?;
        if draft_window == 0 {
            return Err(GatherError::EmptyWindow);
        }
        if draft_window as i64 > src.params.ring_slots {
            return Err(GatherError::WindowExceedsRing { draft_window, ring_slots: src.params.ring_slots });
        }
        let base = self.owned.base();
        let args = WindowGatherArgs {
            params: src.params,
            pool: src.pool,
            rope: src.rope,
            state_slot_per_seq: base + self.slots_at,
            anchor_pos: base + self.anchors_at,
            out,
            view_rows: src.view_rows,
            num_seqs: self.cap.max_seqs as i32, // checked to fit at construction
            draft_window: draft_window as i32,  // at most ring_slots, which fits an i32
        };
        Ok(if src.is_fp8() { Launch::WindowGatherFp8(args) } else { Launch::WindowGather(args) })
    }

    /// Queue `launch` after checking the staged leases are still live, under the pool's lock.
    ///
    /// # Safety
    /// `launch`'s pointers cover what its kernel reads and writes.
    unsafe fn queue(&self, launch: &Launch) -> Result<(), GatherError> {
        self.pool
            .with_boundary(|b| {
                for (seq, h) in self.staged.iter().enumerate() {
                    b.check_slot(*h).map_err(|source| GatherError::StaleLease { seq, source })?;
                }
                // SAFETY: forwarded from the caller.
                unsafe { self.owned.launch(launch) }.map_err(GatherError::from)
            })
            .map_err(pool_err)?
    }

    /// Gather `layer`'s window of `draft_window` rows for the staged batch into `out` (one
    /// launch on the pool's stream): sequence `b`'s rows at `out + (b × draft_window + s) × 1024`.
    ///
    /// # Safety
    /// `out .. out + max_seqs × draft_window × 1024` bytes is live memory of the pool's backend,
    /// 16-B aligned, overlapping neither the pool's planes nor this handle's buffers, and stays
    /// live (and unread by others) until the pool's stream has run the launch.
    pub unsafe fn gather_into(
        &self,
        layer: usize,
        draft_window: usize,
        out: DevicePtr,
    ) -> Result<(), GatherError> {
        let launch = self.gather_launch(layer, draft_window, out)?;
        // SAFETY: the sources are the pool's views (bounded by view_rows), the slot and anchor
        // buffers this handle's own (max_seqs entries), `out` is covered by the caller.
        unsafe { self.queue(&launch) }
    }

    /// Check an engine's output range for [`Self::gather_into`] of `draft_window` rows: at
    /// least `max_seqs × draft_window × 1024` bytes, 16-B aligned, overlapping neither a plane
    /// of the pool (what the gather reads) nor this handle's buffers. What it cannot check —
    /// that the range is live memory of the pool's backend — stays the caller's.
    pub fn check_output(&self, draft_window: usize, out: DevicePtr, bytes: u64) -> Result<(), GatherError> {
        let bad = |why: String| GatherError::BadOutput { out, bytes, why };
        let need = (self.cap.max_seqs as u64)
            .checked_mul(draft_window as u64)
            .and_then(|n| n.checked_mul(GATHER_ROW_BYTES))
            .ok_or_else(|| bad("the window's size overflows".into()))?;
        if bytes < need {
            return Err(bad(format!(
                "{need} B needed: {} sequences x {draft_window} rows",
                self.cap.max_seqs
            )));
        }
        if out % 16 != 0 {
            return Err(bad("not 16-B aligned".into()));
        }
        let end = out.checked_add(bytes).ok_or_else(|| bad("the range wraps".into()))?;
        let overlaps = |base: DevicePtr, len: u64| base < end && out < base.saturating_add(len);
        let own = layout(self.cap).map_or(0, |l| l.3);
        if overlaps(self.owned.base(), own) {
            return Err(bad("overlaps the gather handle's own buffers".into()));
        }
        for plane in 0..self.pool.num_planes() {
            let base = self.pool.plane_ptr(plane).map_err(pool_err)?;
            let len = self.pool.plane_bytes(plane).map_err(pool_err)?;
            if overlaps(base, len) {
                return Err(bad(format!("overlaps the pool's plane {plane}")));
            }
        }
        Ok(())
    }

    /// [`Self::gather_into`] for an output in host memory (`[max_seqs, draft_window, 512]` bf16
    /// bits, e.g. an engine's CPU tensor on the host backend): gathered into a buffer of the
    /// pool's backend made for the call, then the staged sequences' rows copied into `out`
    /// (waits for the stream); rows of pad sequences are untouched, as on a device.
    pub fn gather_into_host(
        &self,
        layer: usize,
        draft_window: usize,
        out: &mut [u16],
    ) -> Result<(), GatherError> {
        let rows = (self.cap.max_seqs as u64).checked_mul(draft_window as u64);
        let bytes = rows.and_then(|r| r.checked_mul(GATHER_ROW_BYTES));
        let have = (out.len() as u64).saturating_mul(2);
        let bad = |why: String| GatherError::BadOutput { out: 0, bytes: have, why };
        let bytes = bytes.ok_or_else(|| bad("the window's size overflows".into()))?;
        if have < bytes {
            return Err(bad(format!(
                "{bytes} B needed: {} sequences x {draft_window} rows",
                self.cap.max_seqs
            )));
        }
        let tmp = Owned::new(Arc::clone(self.pool.backend()), self.pool.stream(), bytes.max(16))?;
        let launch = self.gather_launch(layer, draft_window, tmp.base())?;
        // SAFETY: `tmp` is this call's own buffer of max_seqs × draft_window rows; the rest as
        // in `gather_into`.
        unsafe { self.queue(&launch)? };
        let staged = self.staged.len() * draft_window * GATHER_ROW_BYTES as usize;
        tmp.download(0, &mut bytemuck::cast_slice_mut(out)[..staged])?;
        Ok(())
    }

    /// Gather into the handle's own output (`[max_seqs, out_window, 512]` bf16, rows of
    /// sequence `b` at `b × draft_window`); read it back with [`Self::read_output`].
    pub fn gather(&mut self, layer: usize, draft_window: usize) -> Result<DeviceBuffer, GatherError> {
        if self.cap.out_window == 0 {
            return Err(GatherError::NoOutput);
        }
        if draft_window > self.cap.out_window {
            return Err(GatherError::WindowExceedsOutput { draft_window, cap: self.cap.out_window });
        }
        let out = self.owned.base() + self.out_at;
        let launch = self.gather_launch(layer, draft_window, out)?;
        // SAFETY: `out` is this handle's output, max_seqs × out_window ≥ max_seqs × draft_window
        // rows; the rest as in `gather_into`.
        unsafe { self.queue(&launch)? };
        self.last_gather = Some((self.staged.len(), draft_window));
        self.output().ok_or(GatherError::NoOutput)
    }

    /// The handle's output buffer (bf16 elements), if it has one.
    pub fn output(&self) -> Option<DeviceBuffer> {
        (self.cap.out_window > 0).then(|| DeviceBuffer {
            ptr: self.owned.base() + self.out_at,
            len: (self.cap.max_seqs * self.cap.out_window) as u64 * GATHER_ROW_BYTES / 2,
            elem_bytes: 2,
        })
    }

    /// The real sequences' rows of the last [`Self::gather`], `[sequences, draft_window, 512]`
    /// bf16 bits (waits for the stream). Empty before any gather.
    pub fn read_output(&self) -> Result<Vec<u16>, GatherError> {
        let Some((seqs, wd)) = self.last_gather else { return Ok(Vec::new()) };
        let mut bytes = vec![0u8; seqs * wd * GATHER_ROW_BYTES as usize];
        self.owned.download(self.out_at, &mut bytes)?;
        Ok(bytes.chunks_exact(2).map(|c| u16::from_ne_bytes([c[0], c[1]])).collect())
    }
}
