//! Compressor-state update (`index-buffers.md` §8): per compressor, per forward, the last K
//! tokens' kv and score rows into the slot's state ring, score plus the positional bias (ape).
//!
//! [`StateUpdate`] is the engine-facing handle (`pool.state_update(cap)`), shaped like the
//! decode path: it owns two persistent write plans (one per compressed class: K = 8 for CSA,
//! 128 for HCA) and a slot map, sized by a [`StateUpdateCapacity`] at construction, so a
//! captured graph replays with whatever was staged last.
//!
//! ```text
//! let mut upd = pool.state_update(cap)?;         // once: buffers at fixed addresses
//! upd.stage(&seqs)?;                              // per forward: O(tokens) plan rows
//! unsafe { upd.update(Compressor::CsaMain, l, &inputs)? };   // per compressor and layer
//! ```
//!
//! Staging takes what an engine has: each sequence's slot handle (checked live and mapped to
//! its position under the pool's lock), the positions of its new tokens, where they sit in the
//! forward's flat token array, and its context length after the forward. It keeps the tokens
//! with `position >= context − K` (§8; ATOM's `make_compress_plans`) and pads every plan to
//! its capacity with position −1, the fixed grid a captured graph replays. A plan row is
//! `(ragged id, batch id, position, slot)`: the kernel takes the physical slot from column 3
//! (one dependent load fewer than `slot_map[batch id]`); the slot map is staged too, for the
//! contract's form. After a boundary move, restage: a replay writes where the plan says.
//!
//! Every write lands in the pool's own state fields: the launch takes the field pair's
//! addresses and strides from the arena ([`Pool::state_view`]), never from the caller; only
//! the engine's kv / score / ape inputs are raw pointers, hence `unsafe`. Input element
//! types: kv and score f32 or bf16 (an engine's compressor emits either; the kernel widens),
//! ape f32 or bf16; the state is f32.
//!
//! DeepSeek-V4.1 (a pool whose arena holds `compress_kv` / `compress_score`): only the KV
//! owners have compressors, all with one ring of `S = max owner ratio + k` rows (`docs/v41.md`).
//! One plan keeps each sequence's last `S` positions (no overlap, so `S` covers the ratio and
//! the draft tokens); [`StateUpdate::update_owner`] writes owner `o`'s ring with its own ratio
//! (the rows of its ape). The cursor (committed position and Engram history) is the engine's
//! to write: its Engram ids come from the model, not from a compressor.

use crate::alloc::SlotHandle;
use crate::backend::BackendError;
use crate::geometry::Class;
use crate::index::{DevicePtr, Launch, StateUpdateArgs};
// The element type of an engine's state inputs (defined with the kernel contract).
pub use crate::index::ElemType;
use crate::pool::owned::{Carve, Owned};
use crate::pool::{DeviceBuffer, Pool, PoolError};
use std::sync::Arc;
use thiserror::Error;

/// One compressor of a layer: the arena field pair it writes and its pool window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Compressor {
    /// A CSA layer's main compressor: `csa_main_kv` / `csa_main_score`, dim 1,024.
    CsaMain,
    /// A CSA layer's indexer compressor: `csa_idx_kv` / `csa_idx_score`, dim 256.
    CsaIdx,
    /// An HCA layer's compressor: `hca_main_kv` / `hca_main_score`, dim 512.
    HcaMain,
}

impl Compressor {
    /// Every V4 compressor (V4.1's owners: [`StateUpdate::update_owner`]).
    pub const ALL: [Compressor; 3] = [Compressor::CsaMain, Compressor::CsaIdx, Compressor::HcaMain];

    /// Its name as callers spell it (`csa_main`, `csa_idx`, `hca_main`).
    pub const fn name(self) -> &'static str {
        match self {
            Compressor::CsaMain => "csa_main",
            Compressor::CsaIdx => "csa_idx",
            Compressor::HcaMain => "hca_main",
        }
    }

    /// The compressor named `name` ([`Compressor::name`]'s spelling); any other text names
    /// none.
    pub fn from_name(name: &str) -> Option<Compressor> {
        Compressor::ALL.into_iter().find(|c| c.name() == name)
    }

    /// The arena fields `(kv, score)` it writes (`pool-runtime.md` §2.1).
    pub fn fields(self) -> (&'static str, &'static str) {
        match self {
            Compressor::CsaMain => ("csa_main_kv", "csa_main_score"),
            Compressor::CsaIdx => ("csa_idx_kv", "csa_idx_score"),
            Compressor::HcaMain => ("hca_main_kv", "hca_main_score"),
        }
    }
    /// The class of the layers it belongs to.
    pub fn class(self) -> Class {
        match self {
            Compressor::CsaMain | Compressor::CsaIdx => Class::Csa,
            Compressor::HcaMain => Class::Hca,
        }
    }
    /// Compress ratio: the rows of its ape.
    pub fn ratio(self) -> i64 {
        self.class().ratio().into()
    }
    /// Pool window K = (2 if overlap else 1) · ratio: CSA overlaps (8), HCA does not (128).
    pub fn window(self) -> i64 {
        window(self.class())
    }
}

/// K of a compressed class (§8): the positions a forward keeps in the state ring.
pub fn window(class: Class) -> i64 {
    match class {
        Class::Csa => 2 * i64::from(Class::Csa.ratio()),
        _ => i64::from(Class::Hca.ratio()),
    }
}

/// The two plans, in this order.
const CLASSES: [Class; 2] = [Class::Csa, Class::Hca];

/// What the buffers are sized for: the most sequences and new tokens one forward stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StateUpdateCapacity {
    /// Sequences per forward.
    pub max_seqs: usize,
    /// New tokens per forward (every sequence's together).
    pub max_tokens: usize,
}

impl StateUpdateCapacity {
    /// `max_seqs` sequences and `max_tokens` new tokens per forward.
    pub fn new(max_seqs: usize, max_tokens: usize) -> Self {
        StateUpdateCapacity { max_seqs, max_tokens }
    }
}

impl StateUpdateCapacity {
    /// Plan rows of `class`: a sequence keeps at most K of its tokens, so
    /// `min(max_tokens, max_seqs · K)` — the fixed grid of every launch of that class.
    pub fn rows(&self, class: Class) -> usize {
        let k = window(class) as usize;
        self.max_tokens.min(self.max_seqs.saturating_mul(k))
    }
}

/// One sequence of a forward, as an engine has it.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct StateSeq<'a> {
    /// The sequence's slot (checked live against the pool, mapped to its position).
    pub slot: SlotHandle,
    /// Index of `positions[0]`'s token in the forward's flat token array (the row of kv and
    /// score); token j of the sequence is row `first_token + j`.
    pub first_token: usize,
    /// Absolute positions of the sequence's new tokens.
    pub positions: &'a [i64],
    /// Context length after this forward; every position is below it.
    pub context_len: i64,
}

impl<'a> StateSeq<'a> {
    /// One sequence of a forward, every field given (the struct is `#[non_exhaustive]`: a field added later
    /// gets a default here and a setter).
    pub fn new(slot: SlotHandle, first_token: usize, positions: &'a [i64], context_len: i64) -> Self {
        StateSeq { slot, first_token, positions, context_len }
    }
}

/// The engine's compressor outputs for one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StateInputs {
    /// `[rows][kv_row_stride]` elements of `dtype`.
    pub kv: DevicePtr,
    /// `[rows][score_row_stride]` elements of `dtype` (ape not yet added).
    pub score: DevicePtr,
    /// `[ratio][dim]` elements of `ape_dtype`, contiguous.
    pub ape: DevicePtr,
    /// Elements from one kv row to the next.
    pub kv_row_stride: i64,
    /// Elements from one score row to the next.
    pub score_row_stride: i64,
    /// Rows kv and score hold: every staged token's row must be below.
    pub rows: i64,
    /// Elements per row (must be the fields' dim).
    pub dim: i64,
    /// Element type of kv and score.
    pub dtype: ElemType,
    /// Element type of ape.
    pub ape_dtype: ElemType,
}

crate::setters::with_setters!(StateInputs {
    with_kv(kv: DevicePtr),
    with_score(score: DevicePtr),
    with_ape(ape: DevicePtr),
    with_kv_row_stride(kv_row_stride: i64),
    with_score_row_stride(score_row_stride: i64),
    with_rows(rows: i64),
    with_dim(dim: i64),
    with_dtype(dtype: ElemType),
    with_ape_dtype(ape_dtype: ElemType),
});

crate::variant::variant_names! {
/// What staging and launching refuse, before anything reaches the device.
#[derive(Debug, Error)]
pub enum StateUpdateError {
    /// The pool refused (a stale or foreign slot handle among them).
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A field's ring is shorter than the window the forward keeps.
    #[error("field {field}: ring of {ring} rows is smaller than the window K = {window}")]
    RingTooSmall {
        /// The field.
        field: &'static str,
        /// Its state rows per slot (S).
        ring: i64,
        /// K.
        window: i64,
    },
    /// A negative position.
    #[error("sequence {seq}: position {position} is negative")]
    NegativePosition {
        /// The sequence.
        seq: usize,
        /// The position.
        position: i64,
    },
    /// A position at or past the context length.
    #[error("sequence {seq}: position {position} is not below its context length {context_len}")]
    PastContext {
        /// The sequence.
        seq: usize,
        /// The position.
        position: i64,
        /// Its context length.
        context_len: i64,
    },
    /// A position given twice in one sequence (two writes would race for one ring row).
    #[error("sequence {seq}: position {position} is given twice")]
    DuplicatePosition {
        /// The sequence.
        seq: usize,
        /// The position.
        position: i64,
    },
    /// Two sequences on one slot (their writes would race).
    #[error("sequences {first} and {second} share slot position {position}")]
    SharedSlot {
        /// The earlier sequence.
        first: usize,
        /// The later one.
        second: usize,
        /// The slot position.
        position: i64,
    },
    /// More than the capacity.
    #[error("{what}: {got} exceeds the capacity {max}")]
    OverCapacity {
        /// What overflowed.
        what: &'static str,
        /// How many were given.
        got: usize,
        /// The capacity.
        max: usize,
    },
    /// A value the i32 plan cannot hold.
    #[error("{what} = {value} does not fit the i32 write plan")]
    NotI32 {
        /// What.
        what: &'static str,
        /// The value.
        value: i64,
    },
    /// An owner ordinal outside the KV owners (V4.1), or a V4 pool asked for one.
    #[error("owner {owner} outside the pool's {owners} KV owners")]
    NoSuchOwner {
        /// The owner ordinal asked for.
        owner: u64,
        /// KV owners the pool's compressor rings hold (0: not a V4.1 pool).
        owners: u64,
    },
    /// A layer the field pair has no tensor for.
    #[error("{compressor:?}: layer {layer} outside its {layers} layers")]
    NoSuchLayer {
        /// The compressor.
        compressor: Compressor,
        /// The layer (ordinal among the compressor's layers).
        layer: u64,
        /// Layers the fields hold.
        layers: u64,
    },
    /// A field that is not `[layers][positions][S][dim]` f32, or a kv / score pair that differs.
    #[error("field {field}: {reason}")]
    FieldShape {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Inputs whose dim differs from the fields'.
    #[error("inputs have dim {got}, the fields {expected}")]
    DimMismatch {
        /// The fields' dim.
        expected: i64,
        /// The inputs'.
        got: i64,
    },
    /// Input rows that do not cover the staged tokens, or a row stride below dim.
    #[error("inputs: {what} = {got}, needs at least {needed}")]
    InputTooSmall {
        /// What.
        what: &'static str,
        /// Given.
        got: i64,
        /// Needed.
        needed: i64,
    },
    /// A staged slot moved or was freed since staging: restage.
    #[error("staged slot position {position} is no longer where its handle is ({now:?}); restage")]
    Restage {
        /// The staged position.
        position: i64,
        /// Where the handle is now (`None`: not held).
        now: Option<i64>,
    },
}
}

type Result<T> = std::result::Result<T, StateUpdateError>;

impl Pool {
    /// The compressor-state update for this pool: persistent plans sized for `cap` on the
    /// pool's backend and stream. See [`StateUpdate`].
    pub fn state_update(self: &Arc<Self>, cap: StateUpdateCapacity) -> Result<StateUpdate> {
        StateUpdate::new(Arc::clone(self), cap)
    }
}

/// The §8 state update of one pool: an owned handle with its write plans.
#[derive(Debug)]
pub struct StateUpdate {
    pool: Arc<Pool>,
    cap: StateUpdateCapacity,
    mem: Owned,
    /// Byte offsets of the CSA and HCA plans (i32 [rows][4]) and the slot map (i32 [max_seqs]).
    plan_at: [u64; 2],
    slot_map_at: u64,
    /// Rows of each plan staged last (live rows; the rest are pads).
    live_rows: [usize; 2],
    /// Rows of each plan that may hold a live row on the device (re-padded at the next stage).
    dirty_rows: [usize; 2],
    /// One past the highest ragged id staged.
    tokens: i64,
    /// Slot handles and positions staged, re-checked at every launch.
    staged: Vec<(SlotHandle, i64)>,
    /// Each plan's window K (V4: 8 and 128; V4.1: the owners' ring S, and 0 = no plan) and
    /// its rows (`min(max_tokens, max_seqs · K)`).
    windows: [i64; 2],
    rows: [usize; 2],
}

/// A pad row: position −1, the kernel skips it.
const PAD: [i32; 4] = [0, 0, -1, 0];

impl StateUpdate {
    /// Buffers for `cap` on `pool`'s backend and stream, every plan row a pad.
    pub fn new(pool: Arc<Pool>, cap: StateUpdateCapacity) -> Result<StateUpdate> {
        let too_large = || StateUpdateError::OverCapacity { what: "buffer bytes", got: usize::MAX, max: 0 };
        for (what, n) in [("max_seqs", cap.max_seqs), ("max_tokens", cap.max_tokens)] {
            if i32::try_from(n).is_err() {
                return Err(StateUpdateError::OverCapacity { what, got: n, max: i32::MAX as usize });
            }
        }
        let windows = plan_windows(&pool)?;
        let rows = windows.map(|k| cap.max_tokens.min(cap.max_seqs.saturating_mul(k as usize)));
        let mut carve = Carve::default();
        let csa = carve.take(rows[0] as u64, 16).ok_or_else(too_large)?;
        let hca = carve.take(rows[1] as u64, 16).ok_or_else(too_large)?;
        let slot_map_at = carve.take(cap.max_seqs as u64, 4).ok_or_else(too_large)?;
        let mem = Owned::new(Arc::clone(pool.backend()), pool.stream(), carve.end())?;
        let mut upd = StateUpdate {
            pool,
            cap,
            mem,
            plan_at: [csa, hca],
            slot_map_at,
            live_rows: [0; 2],
            dirty_rows: rows,
            tokens: 0,
            staged: Vec::new(),
            windows,
            rows,
        };
        upd.stage(&[])?;
        Ok(upd)
    }

    /// The pool this handle writes.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }
    /// The capacity the buffers were sized for.
    pub fn capacity(&self) -> StateUpdateCapacity {
        self.cap
    }
    /// Live plan rows of `class` staged last (CSA or HCA; 0 for dense).
    pub fn staged_rows(&self, class: Class) -> usize {
        plan_index(class).map_or(0, |i| self.live_rows[i])
    }
    /// `class`'s write plan (i32 `[rows(class)][4]`; `None` for dense).
    pub fn plan(&self, class: Class) -> Option<DeviceBuffer> {
        let i = plan_index(class)?;
        Some(DeviceBuffer {
            ptr: self.mem.base() + self.plan_at[i],
            len: 4 * self.rows[i] as u64,
            elem_bytes: 4,
        })
    }
    /// The slot map (i32 `[max_seqs]`: batch id → physical slot position).
    pub fn slot_map(&self) -> DeviceBuffer {
        DeviceBuffer { ptr: self.mem.base() + self.slot_map_at, len: self.cap.max_seqs as u64, elem_bytes: 4 }
    }
    /// Read `class`'s whole plan back (waits for the stream).
    pub fn read_plan(&self, class: Class) -> Result<Vec<i32>> {
        let buf = self.plan(class).ok_or(StateUpdateError::FieldShape {
            field: "plan",
            reason: "the dense class has no compressor".into(),
        })?;
        Ok(self.mem.read_i32(buf)?)
    }

    /// Stage one forward: per class, the rows of every token inside its sequence's last K
    /// positions, in O(tokens); pads after them. Returns the live rows `[csa, hca]`.
    ///
    /// Refused before anything is uploaded: more sequences or rows than the capacity, a
    /// stale or foreign slot handle, two sequences on one slot, a negative position or one
    /// at or past the context, a position given twice, a row or position past i32.
    pub fn stage(&mut self, seqs: &[StateSeq<'_>]) -> Result<[usize; 2]> {
        if seqs.len() > self.cap.max_seqs {
            return Err(StateUpdateError::OverCapacity {
                what: "sequences",
                got: seqs.len(),
                max: self.cap.max_seqs,
            });
        }
        // Every handle to its position under one lock.
        let positions = self
            .pool
            .with_boundary(|b| {
                seqs.iter().map(|s| b.position(s.slot)).collect::<std::result::Result<Vec<_>, _>>()
            })?
            .map_err(PoolError::from)?;
        let mut seen = std::collections::HashMap::with_capacity(seqs.len());
        for (i, &p) in positions.iter().enumerate() {
            if let Some(first) = seen.insert(p, i) {
                return Err(StateUpdateError::SharedSlot { first, second: i, position: p });
            }
        }
        let mut plans: [Vec<i32>; 2] = [Vec::new(), Vec::new()];
        let mut tokens = 0i64;
        for (b, (s, &slot)) in seqs.iter().zip(&positions).enumerate() {
            let slot = i32_of("slot position", slot)?;
            for (plan, &k) in plans.iter_mut().zip(&self.windows) {
                if k == 0 {
                    continue; // no plan (V4.1's second)
                }
                // Positions ctx-K..ctx-1 as bits 0..K-1 (K <= 128): a duplicate is a race.
                let mut seen = 0u128;
                for (j, &p) in s.positions.iter().enumerate() {
                    if p < 0 {
                        return Err(StateUpdateError::NegativePosition { seq: b, position: p });
                    }
                    if p >= s.context_len {
                        return Err(StateUpdateError::PastContext {
                            seq: b,
                            position: p,
                            context_len: s.context_len,
                        });
                    }
                    // Checked before use: a wrapped row would point before the engine's
                    // buffer (saturation only makes an overflow fail the i32 check).
                    let ragged = i64::try_from(s.first_token).unwrap_or(i64::MAX).saturating_add(j as i64);
                    i32_of("token row", ragged)?;
                    tokens = tokens.max(ragged + 1);
                    let from_end = s.context_len - p; // 1..
                    if from_end > k {
                        continue;
                    }
                    let bit = 1u128 << (k - from_end);
                    if seen & bit != 0 {
                        return Err(StateUpdateError::DuplicatePosition { seq: b, position: p });
                    }
                    seen |= bit;
                    plan.extend([i32_of("token row", ragged)?, b as i32, i32_of("position", p)?, slot]);
                }
            }
        }
        for (c, plan) in plans.iter().enumerate() {
            let rows = plan.len() / 4;
            if rows > self.rows[c] {
                return Err(StateUpdateError::OverCapacity {
                    what: if c == 0 { "CSA plan rows" } else { "HCA plan rows" },
                    got: rows,
                    max: self.rows[c],
                });
            }
        }
        // Upload: the live rows, then pads over whatever the last stage left live.
        for (c, plan) in plans.iter_mut().enumerate() {
            let rows = plan.len() / 4;
            for _ in rows..self.dirty_rows[c].max(rows) {
                plan.extend(PAD);
            }
            self.mem.upload(self.plan_at[c], bytemuck::cast_slice(plan))?;
            self.live_rows[c] = rows;
            self.dirty_rows[c] = rows;
        }
        let map: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        self.mem.upload(self.slot_map_at, bytemuck::cast_slice(&map))?;
        self.tokens = tokens;
        self.staged = seqs.iter().map(|s| s.slot).zip(positions).collect();
        Ok(self.live_rows)
    }

    /// The launch of `compressor` at `layer` (its ordinal among the layers of its class, the
    /// fields' layer index) over the staged plan, checked against the pool's arena and the
    /// staged tokens: for graph capture (launching it is the caller's `unsafe`;
    /// [`Self::update`] is the checked way). The grid is the plan's capacity.
    pub fn launch(&self, compressor: Compressor, layer: u64, inputs: &StateInputs) -> Result<Launch> {
        if self.windows[1] == 0 {
            // A V4.1 pool: its compressors are the owners' (`owner_launch`).
            return Err(StateUpdateError::NoSuchLayer { compressor, layer, layers: 0 });
        }
        let (kv_name, score_name) = compressor.fields();
        let plan_i = plan_index(compressor.class()).unwrap_or(0);
        self.field_launch((kv_name, score_name), plan_i, layer, compressor.ratio(), inputs, |layers| {
            StateUpdateError::NoSuchLayer { compressor, layer, layers }
        })
    }

    /// The launch of V4.1 KV owner `owner` (its ordinal among the KV sources, the rings'
    /// layer index) over the staged plan, with the owner's ratio (its ape's rows); as
    /// [`Self::launch`] otherwise.
    pub fn owner_launch(&self, owner: u64, inputs: &StateInputs) -> Result<Launch> {
        let g = &self.pool.spec().geometry;
        let sources = g.kv_sources.as_deref().unwrap_or(&[]);
        let owners = if self.windows[1] == 0 { sources.len() as u64 } else { 0 };
        let ratio = usize::try_from(owner)
            .ok()
            .and_then(|o| sources.get(o))
            .filter(|_| owner < owners)
            .and_then(|&l| g.ratios.get(l))
            .ok_or(StateUpdateError::NoSuchOwner { owner, owners })?;
        let fields = (crate::arena::V41_COMPRESS_KV, crate::arena::V41_COMPRESS_SCORE);
        self.field_launch(fields, 0, owner, i64::from(*ratio), inputs, |_| StateUpdateError::NoSuchOwner {
            owner,
            owners,
        })
    }

    /// Write V4.1 KV owner `owner`'s compressor ring from the staged plan
    /// ([`Self::owner_launch`]); as [`Self::update`] otherwise.
    ///
    /// # Safety
    /// As [`Self::update`], `inputs.ape` holding the owner's `[ratio][dim]` elements.
    pub unsafe fn update_owner(&self, owner: u64, inputs: &StateInputs) -> Result<()> {
        let launch = self.owner_launch(owner, inputs)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.run(&launch) }
    }

    /// The launch writing the field pair `(kv_name, score_name)` at `layer` from plan
    /// `plan_i` with `ratio` ape rows; `no_layer(layers)` names a layer past the fields'.
    fn field_launch(
        &self,
        (kv_name, score_name): (&'static str, &'static str),
        plan_i: usize,
        layer: u64,
        ratio: i64,
        inputs: &StateInputs,
        no_layer: impl Fn(u64) -> StateUpdateError,
    ) -> Result<Launch> {
        let (kv_ptr, kv) = self.pool.state_view(kv_name)?;
        let (score_ptr, score) = self.pool.state_view(score_name)?;
        let shape = |name: &'static str, v: &crate::arena::FieldView| -> Result<()> {
            if v.dtype != crate::arena::Dtype::F32
                || v.dims.len() != 4
                || v.strides.len() != 4
                || v.strides[3] != 1
            {
                return Err(StateUpdateError::FieldShape {
                    field: name,
                    reason: format!("{v:?} is not [layers][positions][S][dim] f32"),
                });
            }
            Ok(())
        };
        shape(kv_name, &kv)?;
        shape(score_name, &score)?;
        if kv.dims != score.dims {
            return Err(StateUpdateError::FieldShape {
                field: score_name,
                reason: format!("dims {:?} differ from {kv_name}'s {:?}", score.dims, kv.dims),
            });
        }
        let (layers, ring, dim) = (kv.dims[0], kv.dims[2] as i64, kv.dims[3] as i64);
        if layer >= layers {
            return Err(no_layer(layers));
        }
        let k = self.windows[plan_i];
        if ring < k {
            return Err(StateUpdateError::RingTooSmall { field: kv_name, ring, window: k });
        }
        if inputs.dim != dim {
            return Err(StateUpdateError::DimMismatch { expected: dim, got: inputs.dim });
        }
        for (what, got, needed) in [
            ("rows", inputs.rows, self.tokens),
            ("kv_row_stride", inputs.kv_row_stride, dim),
            ("score_row_stride", inputs.score_row_stride, dim),
        ] {
            if got < needed {
                return Err(StateUpdateError::InputTooSmall { what, got, needed });
            }
        }
        let plan = self.plan(CLASSES[plan_i]).ok_or(StateUpdateError::FieldShape {
            field: kv_name,
            reason: "its class has no write plan".into(),
        })?;
        let field_at = |ptr: DevicePtr, v: &crate::arena::FieldView| ptr + layer * v.strides[0] * 4;
        Ok(Launch::StateUpdate(StateUpdateArgs {
            kv: inputs.kv,
            score: inputs.score,
            ape: inputs.ape,
            write_plan: plan.ptr,
            slot_map: 0,
            kv_state: field_at(kv_ptr, &kv),
            score_state: field_at(score_ptr, &score),
            kv_slot_bytes: (kv.strides[1] * 4) as i64,
            score_slot_bytes: (score.strides[1] * 4) as i64,
            kv_row_stride: inputs.kv_row_stride,
            score_row_stride: inputs.score_row_stride,
            num_rows: self.rows[plan_i] as i32,
            dim: i32_of("dim", dim)?,
            ring: i32_of("ring", ring)?,
            window: k as i32,
            ratio: i32_of("ratio", ratio)?,
            in_dtype: inputs.dtype as i32,
            ape_dtype: inputs.ape_dtype as i32,
            _pad: 0,
        }))
    }

    /// Write `compressor`'s state at `layer` from the staged plan (one launch on the pool's
    /// stream), queued under the pool's lock after checking every staged slot is still where
    /// it was staged (a boundary move in between asks for a restage).
    ///
    /// # Safety
    /// `inputs.kv` and `inputs.score` address live memory of the pool's backend holding
    /// `inputs.rows` rows of `*_row_stride` elements of `inputs.dtype` (the last row needs only
    /// `dim`), and `inputs.ape` `[ratio][dim]` elements of `inputs.ape_dtype`, all ready on the
    /// pool's stream, aligned to their element size and not overlapping the pool's planes.
    pub unsafe fn update(&self, compressor: Compressor, layer: u64, inputs: &StateInputs) -> Result<()> {
        let launch = self.launch(compressor, layer, inputs)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.run(&launch) }
    }

    /// Queue `launch` under the pool's lock after checking every staged slot is still where
    /// it was staged.
    ///
    /// # Safety
    /// As [`Self::update`], for the inputs `launch` reads.
    unsafe fn run(&self, launch: &Launch) -> Result<()> {
        let backend = self.pool.backend();
        let stream = self.pool.stream();
        self.pool.with_boundary(|b| {
            for &(handle, position) in &self.staged {
                let now = b.position(handle).ok();
                if now != Some(position) {
                    return Err(StateUpdateError::Restage { position, now });
                }
            }
            // SAFETY: the plan and the state fields are the pool's and this handle's own
            // (addresses from the arena and the carve); the inputs are the caller's promise.
            unsafe { backend.launch(launch, stream)? };
            Ok(())
        })?
    }
}

/// Each plan's window K for `pool`: V4's (8, 128); for V4.1 (an arena with the owners'
/// compressor rings) the rings' S rows and no second plan.
fn plan_windows(pool: &Pool) -> Result<[i64; 2]> {
    if pool.spec().arena.field_index(crate::arena::V41_COMPRESS_KV).is_err() {
        return Ok(CLASSES.map(window));
    }
    let (_, kv) = pool.state_view(crate::arena::V41_COMPRESS_KV)?;
    let ring = kv.dims.get(2).copied().unwrap_or(0) as i64;
    // The stage's duplicate check holds K positions in a 128-bit mask.
    if !(1..=128).contains(&ring) {
        return Err(StateUpdateError::FieldShape {
            field: crate::arena::V41_COMPRESS_KV,
            reason: format!("a ring of {ring} rows (1..=128 rows a plan keeps)"),
        });
    }
    Ok([ring, 0])
}

fn plan_index(class: Class) -> Option<usize> {
    CLASSES.iter().position(|&c| c == class)
}

fn i32_of(what: &'static str, value: i64) -> Result<i32> {
    i32::try_from(value).map_err(|_| StateUpdateError::NotI32 { what, value })
}
