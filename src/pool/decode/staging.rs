//! Staging a decode step and running what was staged: the host staging image (metadata and
//! block tables, one upload), the host mirror of the device block tables, the checks a build
//! or pack re-runs against the pool's bounds, and the builder and translate-pack launches.
//!
//! Separate from the buffers' layout and accessors in the parent: this is the per-step
//! code, the parent the once-per-path sizing.

use super::{
    add_tokens, check_batch_len, check_blocks, check_live, check_seq, class_slice_lens, read_columns,
    DecodeError, DecodeIndexBuffers, DecodeSeq, PoolBounds,
};
use crate::geometry::{Class, NUM_SLOTS};
use crate::index::{DevicePtr, Launch};

impl DecodeIndexBuffers {
    /// Stage a batch: metadata and the sequences' block tables, one upload of O(context)
    /// bytes (every table is sent). Returns the batch's real token count.
    pub(crate) fn stage(&mut self, batch: &[DecodeSeq<'_>]) -> Result<usize, DecodeError> {
        self.upload_metadata(batch, true)
    }

    /// Stage a batch whose block tables are already resident on the device (batch row `b`
    /// holds sequence `b`'s table, kept current with [`Self::write_block_table`]): one
    /// upload of the O(batch) metadata only. Each `block_table` is checked for length but not
    /// sent.
    pub(crate) fn stage_resident(&mut self, batch: &[DecodeSeq<'_>]) -> Result<usize, DecodeError> {
        self.upload_metadata(batch, false)
    }

    pub(super) fn upload_metadata(
        &mut self,
        batch: &[DecodeSeq<'_>],
        tables: bool,
    ) -> Result<usize, DecodeError> {
        let _range = crate::profiling::range("v4pool.decode_stage");
        let (bytes, tokens) = self.build_metadata(batch, tables)?;
        self.mem.upload(0, &self.staging[..bytes])?;
        if tables {
            for (b, s) in batch.iter().enumerate() {
                self.mirror_write(b, 0, s.block_table);
            }
        }
        self.staged_positions.clear();
        self.staged_positions.extend(batch.iter().map(|s| s.position));
        self.staged_columns.clear();
        self.staged_columns.extend(batch.iter().map(|s| read_columns(s.context_len, self.block_size)));
        self.staged_tokens = tokens;
        Ok(tokens)
    }

    /// Record `ids` written at `row`, `start ..` of the device tables (both checked in range).
    fn mirror_write(&mut self, row: usize, start: usize, ids: &[i32]) {
        let w = self.cap.max_blocks_per_seq;
        let r = row * w;
        let end = start + ids.len();
        self.tables[r + start..r + end].copy_from_slice(ids);
        self.row_len[row] = self.row_len[row].max(end);
        let mut m = if start == 0 { i32::MIN } else { self.table_max[r + start - 1] };
        for c in start..self.row_len[row] {
            m = m.max(self.tables[r + c]);
            self.table_max[r + c] = m;
        }
    }

    /// The highest block id the build reads from each staged row, from the mirror (columns
    /// never written hold id 0 on the device).
    fn staged_max_ids(&self) -> Vec<Option<i32>> {
        let w = self.cap.max_blocks_per_seq;
        self.staged_columns
            .iter()
            .enumerate()
            .map(|(row, &cols)| {
                if cols == 0 {
                    return None;
                }
                let len = self.row_len[row];
                let written = (len > 0).then(|| self.table_max[row * w + cols.min(len) - 1]);
                let unwritten = (cols > len).then_some(0);
                written.max(unwritten)
            })
            .collect()
    }

    /// Check the staged batch against `bounds` (the pool's now; the boundary may have moved
    /// since staging): its positions still live slots, and the block ids a build or a
    /// translate-pack reads (from the tables staged or written since) still below the block
    /// count. Both kernels turn those ids into pool rows, so both run only after this.
    pub(crate) fn check_staged(&self, bounds: &PoolBounds) -> Result<(), DecodeError> {
        check_live(&self.staged_positions, &bounds.live)?;
        check_blocks(&self.staged_max_ids(), bounds.num_blocks)
    }

    /// Write `ids` into the device block table of batch row `row` from column `start_col`
    /// (an entering sequence's whole table, or the blocks a sequence just gained). Every id
    /// must be a block of the pool (see [`PoolBounds`]).
    pub(crate) fn write_block_table(
        &mut self,
        row: usize,
        start_col: usize,
        ids: &[i32],
    ) -> Result<(), DecodeError> {
        let cap = self.cap;
        if row >= cap.max_seqs {
            return Err(DecodeError::TooManySeqs { got: row.saturating_add(1), cap: cap.max_seqs });
        }
        let end = start_col.saturating_add(ids.len());
        if end > cap.max_blocks_per_seq {
            return Err(DecodeError::BlockTableTooLong { seq: row, got: end, cap: cap.max_blocks_per_seq });
        }
        let n = self.bounds.num_blocks;
        if let Some((i, &block)) = ids.iter().enumerate().find(|(_, &b)| !(0..n).contains(&i64::from(b))) {
            return Err(DecodeError::BadBlock { seq: row, column: start_col + i, block, num_blocks: n });
        }
        let off = self.layout.block_tables + 4 * (row * cap.max_blocks_per_seq + start_col) as u64;
        self.mem.upload(off, bytemuck::cast_slice(ids))?;
        self.mirror_write(row, start_col, ids);
        Ok(())
    }

    /// Run the decode builder over the staged batch on the buffers' stream.
    pub(crate) fn build(&self) -> Result<(), DecodeError> {
        let _range = crate::profiling::range("v4pool.decode_build");
        // SAFETY: every pointer is this handle's own, sized for `max_tokens`; the staged
        // indptrs were computed here and fit each class's slice capacity (checked when the
        // batch was staged), so the kernel writes inside the index buffers.
        unsafe { self.mem.launch(&self.launch())? };
        Ok(())
    }

    /// Run the translate-pack of [`Self::pack_args`] on the buffers' stream.
    ///
    /// # Safety
    /// `topk` must address live memory of this backend holding i32
    /// `[max_tokens][topk_row_stride]`, ordered before this call on the stream, non-negative where the
    /// contract reads it (`index-buffers.md` §5): the first `min((pos+1)/4, ctx/4,
    /// index_topk)` entries of each real token's row for the CSA pack, the first
    /// `min(visible_groups(pos, ratio), index_topk)` for a layer's.
    pub(crate) unsafe fn pack(
        &self,
        layer: Option<usize>,
        topk: DevicePtr,
        topk_row_stride: i32,
    ) -> Result<(), DecodeError> {
        let args = self.pack_args(layer, topk, topk_row_stride)?;
        // SAFETY: the caller vouches for `topk`; every other pointer is this handle's own.
        unsafe { self.mem.launch(&Launch::CsaPack(args))? };
        Ok(())
    }

    /// Fill the host staging image (with the block tables when `tables`); returns (bytes to
    /// upload, real tokens). Nothing is written unless the whole batch is valid.
    fn build_metadata(
        &mut self,
        batch: &[DecodeSeq<'_>],
        tables: bool,
    ) -> Result<(usize, usize), DecodeError> {
        let cap = self.cap;
        check_batch_len(batch.len(), cap.max_seqs)?;
        let mut tokens = 0usize;
        for (i, s) in batch.iter().enumerate() {
            tokens = add_tokens(tokens, s.num_tokens, cap.max_tokens)?;
            // num_tokens ≤ max_tokens here, so the cast is exact.
            if s.num_tokens == 0 || s.context_len < s.num_tokens as i64 {
                return Err(DecodeError::BadSequence {
                    seq: i,
                    num_tokens: s.num_tokens,
                    context_len: s.context_len,
                });
            }
            check_seq(
                i,
                s.position,
                s.context_len,
                s.block_table,
                tables,
                &self.bounds,
                cap.max_blocks_per_seq,
                self.block_size,
            )?;
        }
        let l = self.layout;
        let dense = self.has_class(Class::Dense);
        let st = &mut self.staging;
        let put_i32 = |st: &mut Vec<u8>, off: u64, i: usize, v: i32| {
            let o = off as usize + 4 * i;
            st[o..o + 4].copy_from_slice(&v.to_ne_bytes());
        };
        let (win, topk) = (i64::from(cap.win), i64::from(cap.index_topk));
        let mut ptr = [0i64; NUM_SLOTS];
        for c in 0..NUM_SLOTS {
            put_i32(st, l.indptr[c], 0, 0);
        }
        self.csa_heads.clear();
        let flash = self.flash.is_some();
        if flash {
            // Pads (and the rest of a longer earlier batch) get length 0.
            for b in 0..cap.max_seqs {
                put_i32(st, l.fm_seq_length, b, 0);
                for &at in &l.fm_seq_extra_length {
                    put_i32(st, at, b, 0);
                }
            }
        }
        let mut t = 0usize;
        for (b, s) in batch.iter().enumerate() {
            // Live positions lie in the plane, whose rows fit an i32.
            put_i32(st, l.slots, b, s.position as i32);
            if tables {
                let row = l.block_tables as usize + 4 * b * cap.max_blocks_per_seq;
                st[row..row + 4 * s.block_table.len()].copy_from_slice(bytemuck::cast_slice(s.block_table));
            }
            for k in 0..s.num_tokens {
                let pos = s.context_len - s.num_tokens as i64 + k as i64;
                let (n, csa, hca) =
                    class_slice_lens(pos, s.context_len, win, topk, self.slot_ratios, self.targets.head_fill);
                // At most index_topk and a position / the fine ratio: both i32.
                self.csa_heads.push([csa as i32, ((pos + 1) / self.slot_ratios[0]) as i32]);
                if flash {
                    // FlashMLA's per-batch-entry lengths (its `s_q` tokens share one): the
                    // longest of the sequence's tokens, the same slice lengths the builder and
                    // the pack write per token (each within an i32, as the indptrs are).
                    let get = |st: &Vec<u8>, off: u64| {
                        let o = off as usize + 4 * b;
                        i32::from_ne_bytes([st[o], st[o + 1], st[o + 2], st[o + 3]])
                    };
                    let longest = get(st, l.fm_seq_length).max(n as i32);
                    put_i32(st, l.fm_seq_length, b, longest);
                    for (c, part) in [(Class::Csa, csa), (Class::Hca, hca)] {
                        let at = l.fm_seq_extra_length[c.index()];
                        let longest = get(st, at).max(part as i32);
                        put_i32(st, at, b, longest);
                    }
                }
                put_i32(st, l.batch_ids, t, b as i32);
                let o = l.positions as usize + 8 * t;
                st[o..o + 8].copy_from_slice(&pos.to_ne_bytes());
                ptr[Class::Dense.index()] += if dense { n } else { 0 };
                ptr[Class::Csa.index()] += csa + n;
                ptr[Class::Hca.index()] += hca + n;
                // Each slice is within its class's capacity (the context checks bound the
                // HCA head), and `plan` checked max_tokens × capacity fits an i32.
                for (&at, &p) in l.indptr.iter().zip(&ptr) {
                    put_i32(st, at, t + 1, p as i32);
                }
                t += 1;
            }
        }
        // Pad tokens: batch id −1, empty slices (the indptr tail repeats its last value).
        for p in t..cap.max_tokens {
            put_i32(st, l.batch_ids, p, -1);
            for (&at, &end) in l.indptr.iter().zip(&ptr) {
                put_i32(st, at, p + 1, end as i32);
            }
        }
        Ok((if tables { l.meta_end } else { l.block_tables } as usize, t))
    }
}
