//! Persistent decode index buffers and the host's O(batch) share of a decode step.
//!
//! The host computes, per token, only slice lengths (`index-buffers.md` §3: window
//! `n = min(pos+1, win)`, CSA head `min((pos+1)/4, ctx/4, topk)`, HCA head
//! `min((pos+1)/128, ctx/128)` — causal per token, §13) and their prefix sums; it never walks
//! a context. One kernel launch then writes every window tail, every HCA head (from the
//! block tables) and the destination rows. Every buffer lives at a fixed address sized for
//! the largest batch, so the launch can be captured in a graph once and replayed with new
//! contents staged by [`DecodeIndexBuffers::stage`].

use crate::backend::{Backend, BackendError, DeviceAllocation, Stream};
use crate::geometry::{UnifiedPoolGeometry, CSA_RATIO, DENSE_RATIO, HCA_RATIO};
use crate::index::{
    ClassBuffers, CsaPackArgs, DecodeIndexArgs, DevicePtr, Launch, CLASS_CSA, CLASS_DENSE, CLASS_HCA,
};
use thiserror::Error;

/// Capacities the persistent buffers are sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeCapacity {
    /// Sequences in one step.
    pub max_seqs: usize,
    /// Tokens in one step (sequences × (1 + speculative steps)); also the captured grid.
    pub max_tokens: usize,
    /// Block-table columns per sequence (longest context / block size, rounded up).
    pub max_blocks_per_seq: usize,
    /// Sliding window `win` (≤ ring_slots).
    pub win: i32,
    /// CSA top-k reserved per token (`index_topk`).
    pub index_topk: i32,
    /// CSA layers whose top-k one translate-pack launch covers (1 = per-layer launches).
    pub csa_layers: usize,
}

/// One sequence of a decode step.
#[derive(Clone, Copy, Debug)]
pub struct DecodeSeq<'a> {
    /// Physical slot (a position from `physical_slot`, never a group).
    pub position: i64,
    /// Context length after this step, including its tokens.
    pub context_len: i64,
    /// Tokens this step writes for the sequence (1 + drafts).
    pub num_tokens: usize,
    /// Logical → physical block ids (the engine's host copy). [`DecodeIndexBuffers::stage`]
    /// uploads it; [`DecodeIndexBuffers::stage_resident`] only checks its length, the device
    /// rows being kept current with [`DecodeIndexBuffers::write_block_table`].
    pub block_table: &'a [i32],
}

#[derive(Debug, Error)]
pub enum DecodeError {
    #[error("batch of {got} sequences exceeds the {cap} the buffers were sized for")]
    TooManySeqs { got: usize, cap: usize },
    #[error("batch of {got} tokens exceeds the {cap} the buffers were sized for")]
    TooManyTokens { got: usize, cap: usize },
    #[error("sequence {seq}: block table of {got} columns exceeds {cap}")]
    BlockTableTooLong { seq: usize, got: usize, cap: usize },
    #[error("sequence {seq}: context {context_len} needs {needed} blocks, its table has {got}")]
    BlockTableTooShort { seq: usize, context_len: i64, needed: i64, got: usize },
    #[error("sequence {seq}: {num_tokens} tokens with context {context_len}")]
    BadSequence { seq: usize, num_tokens: usize, context_len: i64 },
    #[error("sequence {seq}: position {position} outside the pool's live slot positions {first}..{end}")]
    BadPosition { seq: usize, position: i64, first: i64, end: i64 },
    #[error("window {win} must be in 1..={ring_slots} (the ring)")]
    BadWindow { win: i32, ring_slots: i64 },
    #[error("{what} must be positive")]
    ZeroCapacity { what: &'static str },
    #[error("the geometry lacks the {ratio} class this buffer needs")]
    MissingClass { ratio: i32 },
    #[error("persistent buffers of {bytes} bytes overflow an i32 index buffer")]
    TooLarge { bytes: u64 },
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Slice lengths of one decode token: window rows, CSA head, HCA head.
#[inline]
pub fn decode_slice_lens(pos: i64, ctx: i64, win: i64, topk: i64) -> (i64, i64, i64) {
    let n = (pos + 1).min(win);
    let csa = ((pos + 1) / i64::from(CSA_RATIO)).min(ctx / i64::from(CSA_RATIO)).min(topk);
    let hca = ((pos + 1) / i64::from(HCA_RATIO)).min(ctx / i64::from(HCA_RATIO));
    (n, csa, hca)
}

/// Byte offsets of the sub-buffers inside the one allocation. The metadata part comes
/// first and is contiguous, so a step's staging is one host-to-device copy.
#[derive(Clone, Copy, Debug, Default)]
struct Layout {
    slots: u64,
    batch_ids: u64,
    positions: u64,
    indptr: [u64; 3],
    block_tables: u64,
    meta_end: u64,
    indices: [u64; 3],
    dest_rows: [u64; 3],
    csa_out_layer_stride: u64,
    total: u64,
}

/// What `plan` decides: the layout, which classes are present, their params, and each
/// class's per-token slice capacity.
struct Planned {
    layout: Layout,
    present: [bool; 3],
    params: [crate::geometry::WindowParams; 3],
    slice_cap: [u64; 3],
}

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Persistent decode index buffers on a backend.
pub struct DecodeIndexBuffers {
    cap: DecodeCapacity,
    layout: Layout,
    alloc: Option<DeviceAllocation>,
    /// Class present in the geometry (dense may be absent).
    present: [bool; 3],
    params: [crate::geometry::WindowParams; 3],
    envelope_rows: i64,
    hca_rows_per_block: i32,
    block_size: i64,
    live: std::ops::Range<i64>,
    staging: Vec<u8>,
    /// Per-token slice capacity of each class's index buffer.
    slice_cap: [u64; 3],
}

impl std::fmt::Debug for DecodeIndexBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeIndexBuffers")
            .field("cap", &self.cap)
            .field("bytes", &self.layout.total)
            .finish()
    }
}

impl DecodeIndexBuffers {
    /// Check `cap` against `geometry` and lay the buffers out (no allocation).
    fn plan(geometry: &UnifiedPoolGeometry, cap: DecodeCapacity) -> Result<Planned, DecodeError> {
        for (what, v) in [
            ("max_seqs", cap.max_seqs),
            ("max_tokens", cap.max_tokens),
            ("max_blocks_per_seq", cap.max_blocks_per_seq),
            ("csa_layers", cap.csa_layers),
        ] {
            if v == 0 {
                return Err(DecodeError::ZeroCapacity { what });
            }
        }
        if cap.win < 1 || i64::from(cap.win) > geometry.ring_slots {
            return Err(DecodeError::BadWindow { win: cap.win, ring_slots: geometry.ring_slots });
        }
        let ratios = [DENSE_RATIO, CSA_RATIO, HCA_RATIO];
        let mut present = [false; 3];
        let mut params = [crate::geometry::WindowParams::default(); 3];
        for (i, r) in ratios.iter().enumerate() {
            if let Ok(p) = geometry.window_params(*r) {
                present[i] = true;
                params[i] = p;
            }
        }
        for r in [CSA_RATIO, HCA_RATIO] {
            if geometry.class(r).is_none() {
                return Err(DecodeError::MissingClass { ratio: r });
            }
        }
        let win = cap.win.max(0) as u64;
        let max_ctx_blocks = cap.max_blocks_per_seq as u64;
        let hca_head_cap = max_ctx_blocks * geometry.block_size as u64 / HCA_RATIO as u64;
        let slice_cap = [win, win + cap.index_topk.max(0) as u64, win + hca_head_cap];
        let (t, s) = (cap.max_tokens as u64, cap.max_seqs as u64);
        let mut l = Layout::default();
        let mut cur = 0u64;
        let mut take = |bytes: u64| {
            let at = cur;
            cur = align(cur + bytes, 256);
            at
        };
        l.slots = take(4 * s);
        l.batch_ids = take(4 * t);
        l.positions = take(8 * t);
        for c in 0..3 {
            l.indptr[c] = take(4 * (t + 1));
        }
        l.block_tables = take(4 * s * max_ctx_blocks);
        l.meta_end = take(0);
        for c in 0..3 {
            let copies = if c == CLASS_CSA { cap.csa_layers as u64 } else { 1 };
            let per = align(4 * t * slice_cap[c], 256);
            if c == CLASS_CSA {
                l.csa_out_layer_stride = per;
            }
            l.indices[c] = take(per * copies);
        }
        for c in 0..3 {
            l.dest_rows[c] = take(4 * t);
        }
        l.total = take(0);
        if t * slice_cap[CLASS_HCA] > i32::MAX as u64 {
            return Err(DecodeError::TooLarge { bytes: l.total });
        }
        Ok(Planned { layout: l, present, params, slice_cap })
    }

    /// Device bytes the buffers for `cap` take, without allocating them (for sizing and
    /// overhead reports).
    pub fn required_bytes(geometry: &UnifiedPoolGeometry, cap: DecodeCapacity) -> Result<u64, DecodeError> {
        Ok(Self::plan(geometry, cap)?.layout.total)
    }

    /// Size and allocate the buffers for `cap` on `backend`, for `geometry`'s classes.
    pub fn new(
        backend: &dyn Backend,
        geometry: &UnifiedPoolGeometry,
        cap: DecodeCapacity,
    ) -> Result<Self, DecodeError> {
        let Planned { layout: l, present, params, slice_cap } = Self::plan(geometry, cap)?;
        let alloc = backend.alloc_zeroed(l.total)?;
        Ok(DecodeIndexBuffers {
            cap,
            layout: l,
            alloc: Some(alloc),
            present,
            params,
            envelope_rows: geometry.envelope_rows,
            hca_rows_per_block: (geometry.block_size / i64::from(HCA_RATIO)) as i32,
            block_size: geometry.block_size,
            live: geometry.live_positions(),
            staging: vec![0u8; l.meta_end as usize],
            slice_cap,
        })
    }

    /// Bytes these buffers hold on the device (the pool reports it as overhead).
    pub fn device_bytes(&self) -> u64 {
        self.layout.total
    }

    pub fn capacity(&self) -> DecodeCapacity {
        self.cap
    }

    fn base(&self) -> DevicePtr {
        self.alloc.as_ref().map_or(0, |a| a.ptr)
    }

    /// Update the live slot positions after the boundary moved (the buffers and every
    /// address stay; only the staging check changes).
    pub fn set_live_positions(&mut self, live: std::ops::Range<i64>) {
        self.live = live;
    }

    /// The decode builder's launch: fixed pointers, `num_tokens = max_tokens` (pad tokens
    /// carry batch id −1), so it can be captured once and replayed.
    pub fn decode_args(&self) -> DecodeIndexArgs {
        let b = self.base();
        let l = &self.layout;
        let mut classes = [ClassBuffers::default(); 3];
        for c in [CLASS_DENSE, CLASS_CSA, CLASS_HCA] {
            if self.present[c] {
                classes[c] = ClassBuffers {
                    params: self.params[c],
                    indptr: b + l.indptr[c],
                    indices: b + l.indices[c],
                    dest_rows: b + l.dest_rows[c],
                };
            }
        }
        DecodeIndexArgs {
            classes,
            state_slot_per_seq: b + l.slots,
            batch_id_per_token: b + l.batch_ids,
            positions: b + l.positions,
            block_tables: b + l.block_tables,
            envelope_rows: self.envelope_rows,
            block_table_stride: self.cap.max_blocks_per_seq as i32,
            hca_rows_per_block: self.hca_rows_per_block,
            num_tokens: self.cap.max_tokens as i32,
            win: self.cap.win,
        }
    }

    /// CSA translate-pack for one CSA layer (one launch per layer, as a forward runs it),
    /// reading the layer's top-k from `topk` (i32 `[max_tokens][topk_row_stride]`) and
    /// writing the heads of the one CSA buffer.
    pub fn csa_pack_args(&self, topk: DevicePtr, topk_row_stride: i32) -> CsaPackArgs {
        let b = self.base();
        let l = &self.layout;
        CsaPackArgs {
            topk,
            block_tables: b + l.block_tables,
            positions: b + l.positions,
            indptr: b + l.indptr[CLASS_CSA],
            batch_id_per_token: b + l.batch_ids,
            skip_prefix_len_per_token: 0,
            out: b + l.indices[CLASS_CSA],
            envelope_rows: self.envelope_rows,
            topk_row_stride,
            block_table_stride: self.cap.max_blocks_per_seq as i32,
            num_tokens: self.cap.max_tokens as i32,
            block_capacity: (self.block_size / i64::from(CSA_RATIO)) as i32,
            window_size: self.cap.win,
            _pad: 0,
        }
    }

    /// Device address and length (elements) of a class's index buffer (`class` is one of
    /// `CLASS_*`); for CSA, copy `layer` of the batched translate-pack.
    pub fn indices(&self, class: usize, layer: usize) -> (DevicePtr, u64) {
        let extra = if class == CLASS_CSA { layer as u64 * self.layout.csa_out_layer_stride } else { 0 };
        (self.base() + self.layout.indices[class] + extra, self.cap.max_tokens as u64 * self.slice_cap[class])
    }

    /// Device address of a class's indptr (`max_tokens + 1` i32).
    pub fn indptr(&self, class: usize) -> DevicePtr {
        self.base() + self.layout.indptr[class]
    }

    /// Device address of a class's destination rows (`max_tokens` i32).
    pub fn dest_rows(&self, class: usize) -> DevicePtr {
        self.base() + self.layout.dest_rows[class]
    }

    /// Compute the step's metadata on the host and upload it, block tables included, in one
    /// copy on `stream`. Returns the number of real tokens. The tables make this O(context);
    /// engines that keep their tables current use [`Self::stage_resident`].
    pub fn stage(
        &mut self,
        backend: &dyn Backend,
        batch: &[DecodeSeq<'_>],
        stream: Stream,
    ) -> Result<usize, DecodeError> {
        self.upload_metadata(backend, batch, true, stream)
    }

    /// Like [`Self::stage`], but the block tables stay resident on the device: only the
    /// per-token metadata is uploaded (O(tokens) bytes, whatever the contexts), and row `b`
    /// of the device table must already hold sequence `b`'s blocks (written with
    /// [`Self::write_block_table`] when a sequence enters the batch or gains a block).
    pub fn stage_resident(
        &mut self,
        backend: &dyn Backend,
        batch: &[DecodeSeq<'_>],
        stream: Stream,
    ) -> Result<usize, DecodeError> {
        self.upload_metadata(backend, batch, false, stream)
    }

    fn upload_metadata(
        &mut self,
        backend: &dyn Backend,
        batch: &[DecodeSeq<'_>],
        tables: bool,
        stream: Stream,
    ) -> Result<usize, DecodeError> {
        let _range = crate::profiling::range("v4pool.decode_stage");
        let (bytes, tokens) = self.build_metadata(batch, tables)?;
        // SAFETY: the allocation starts with the metadata region, of which the staging image
        // fills the first `bytes`; the allocation is live while `self` is.
        unsafe { backend.upload(self.base(), &self.staging[..bytes], stream)? };
        Ok(tokens)
    }

    /// Write `ids` into the device block table of batch row `row` from column `start_col`
    /// (an entering sequence's whole table, or the blocks a sequence just gained).
    pub fn write_block_table(
        &mut self,
        backend: &dyn Backend,
        row: usize,
        start_col: usize,
        ids: &[i32],
        stream: Stream,
    ) -> Result<(), DecodeError> {
        let cap = self.cap;
        if row >= cap.max_seqs {
            return Err(DecodeError::TooManySeqs { got: row + 1, cap: cap.max_seqs });
        }
        let end = start_col.saturating_add(ids.len());
        if end > cap.max_blocks_per_seq {
            return Err(DecodeError::BlockTableTooLong { seq: row, got: end, cap: cap.max_blocks_per_seq });
        }
        let off = self.layout.block_tables + 4 * (row * cap.max_blocks_per_seq + start_col) as u64;
        // SAFETY: row and columns were checked against the table's capacity, which lies in
        // the allocation; the allocation is live while `self` is.
        unsafe { backend.upload(self.base() + off, bytemuck::cast_slice(ids), stream)? };
        Ok(())
    }

    /// Fill the host staging image (with the block tables when `tables`); returns (bytes to
    /// upload, real tokens).
    fn build_metadata(
        &mut self,
        batch: &[DecodeSeq<'_>],
        tables: bool,
    ) -> Result<(usize, usize), DecodeError> {
        let cap = self.cap;
        if batch.len() > cap.max_seqs {
            return Err(DecodeError::TooManySeqs { got: batch.len(), cap: cap.max_seqs });
        }
        let tokens: usize = batch.iter().map(|s| s.num_tokens).sum();
        if tokens > cap.max_tokens {
            return Err(DecodeError::TooManyTokens { got: tokens, cap: cap.max_tokens });
        }
        for (i, s) in batch.iter().enumerate() {
            if s.num_tokens == 0 || s.context_len < s.num_tokens as i64 {
                return Err(DecodeError::BadSequence {
                    seq: i,
                    num_tokens: s.num_tokens,
                    context_len: s.context_len,
                });
            }
            if !self.live.contains(&s.position) {
                return Err(DecodeError::BadPosition {
                    seq: i,
                    position: s.position,
                    first: self.live.start,
                    end: self.live.end,
                });
            }
            if s.block_table.len() > cap.max_blocks_per_seq {
                return Err(DecodeError::BlockTableTooLong {
                    seq: i,
                    got: s.block_table.len(),
                    cap: cap.max_blocks_per_seq,
                });
            }
            let needed = (s.context_len + self.block_size - 1) / self.block_size;
            if (s.block_table.len() as i64) < needed {
                return Err(DecodeError::BlockTableTooShort {
                    seq: i,
                    context_len: s.context_len,
                    needed,
                    got: s.block_table.len(),
                });
            }
        }
        let l = self.layout;
        let st = &mut self.staging;
        let put_i32 = |st: &mut Vec<u8>, off: u64, i: usize, v: i32| {
            let o = off as usize + 4 * i;
            st[o..o + 4].copy_from_slice(&v.to_ne_bytes());
        };
        let (win, topk) = (i64::from(cap.win), i64::from(cap.index_topk));
        let mut ptr = [0i64; 3];
        for c in 0..3 {
            put_i32(st, l.indptr[c], 0, 0);
        }
        let mut t = 0usize;
        for (b, s) in batch.iter().enumerate() {
            put_i32(st, l.slots, b, s.position as i32);
            if tables {
                let row = l.block_tables as usize + 4 * b * cap.max_blocks_per_seq;
                st[row..row + 4 * s.block_table.len()].copy_from_slice(bytemuck::cast_slice(s.block_table));
            }
            for k in 0..s.num_tokens {
                let pos = s.context_len - s.num_tokens as i64 + k as i64;
                let (n, csa, hca) = decode_slice_lens(pos, s.context_len, win, topk);
                put_i32(st, l.batch_ids, t, b as i32);
                let o = l.positions as usize + 8 * t;
                st[o..o + 8].copy_from_slice(&pos.to_ne_bytes());
                ptr[CLASS_DENSE] += if self.present[CLASS_DENSE] { n } else { 0 };
                ptr[CLASS_CSA] += csa + n;
                ptr[CLASS_HCA] += hca + n;
                for c in 0..3 {
                    put_i32(st, l.indptr[c], t + 1, ptr[c] as i32);
                }
                t += 1;
            }
        }
        // Pad tokens: batch id −1, empty slices (the indptr tail repeats its last value).
        for p in t..cap.max_tokens {
            put_i32(st, l.batch_ids, p, -1);
            for c in 0..3 {
                put_i32(st, l.indptr[c], p + 1, ptr[c] as i32);
            }
        }
        Ok((if tables { l.meta_end } else { l.block_tables } as usize, t))
    }

    /// The decode launch, ready for [`Backend::launch`].
    pub fn launch(&self) -> Launch {
        Launch::Decode(self.decode_args())
    }

    /// Return the buffers to the backend.
    ///
    /// # Safety
    /// No queued or captured work may still use them.
    pub unsafe fn release(&mut self, backend: &dyn Backend) {
        if let Some(a) = self.alloc.take() {
            // SAFETY: forwarded from the caller.
            unsafe { backend.free(a) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_lengths_follow_the_contract() {
        // Position 0: one window row, no heads.
        assert_eq!(decode_slice_lens(0, 1, 128, 512), (1, 0, 0));
        // Deep context: full window, top-k bound, HCA causal per token.
        assert_eq!(decode_slice_lens(999_999, 1_000_000, 128, 512), (128, 512, 7812));
        // An earlier spec token sees only groups that end at or before it (§13).
        assert_eq!(decode_slice_lens(254, 256, 128, 512).2, 1);
        assert_eq!(decode_slice_lens(255, 256, 128, 512).2, 2);
    }
}
