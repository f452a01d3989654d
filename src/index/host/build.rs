//! The index builders and the CSA translate-pack (index-buffers.md §3–§6) on safe slices.

use super::*;
use crate::geometry::NUM_SLOTS;
use crate::index::CLASS_HCA;

// ---- §3 + §4: decode builder ----------------------------------------------------------------

/// One enabled class of the decode builder.
#[derive(Debug)]
pub struct DecodeClass<'a> {
    /// The class's window parameters.
    pub params: WindowParams,
    /// CSR offsets `[T+1]`.
    pub indptr: &'a [i32],
    /// The class's CSR index buffer (out); `None`: not written (FlashMLA's rows only).
    pub indices: Option<&'a mut [i32]>,
    /// Destination rows `[T]` (out), if wanted.
    pub dest_rows: Option<&'a mut [i32]>,
}

/// One class's outputs in FlashMLA's convention (§3f): per view `v` (one per distinct
/// page-view shift among the class's layers) a row of `topk` entries per token.
#[derive(Debug)]
pub struct FlashMlaClass<'a> {
    /// Each view's shift (its length is the number of views).
    pub shifts: &'a [i32],
    /// Entries per window row.
    pub topk: i32,
    /// `[views][T][topk]` (out): window rows oldest first, + shift, then −1.
    pub indices: &'a mut [i32],
    /// `[T]` (out): window entries per token (0 for pads).
    pub topk_length: &'a mut [i32],
    /// The compressed part (HCA with block tables).
    pub extra: Option<FlashMlaExtra<'a>>,
}

/// The compressed part of a class's FlashMLA outputs (§3f: the HCA head from the block tables).
#[derive(Debug)]
pub struct FlashMlaExtra<'a> {
    /// Entries per compressed row.
    pub extra_topk: i32,
    /// `[views][T][extra_topk]` (out): entries `0..head`, + shift, then −1 to
    /// [`crate::index::shape::flashmla_row_limit`]`(head, extra_topk)`; nothing past it.
    pub extra_indices: &'a mut [i32],
    /// `[T]` (out): the head per token (0 for pads).
    pub extra_topk_length: &'a mut [i32],
}

/// The decode builder's buffers and scalars; a class is off when its entry is `None`.
#[derive(Debug)]
pub struct DecodeIndices<'a> {
    /// [dense, csa, hca] (`CLASS_*`).
    pub classes: [Option<DecodeClass<'a>>; NUM_SLOTS],
    /// [dense, csa, hca]: FlashMLA outputs of an enabled class (§3f), if wanted.
    pub flashmla: [Option<FlashMlaClass<'a>>; NUM_SLOTS],
    /// Physical slot per sequence.
    pub state_slot_per_seq: &'a [i32],
    /// Sequence of each token; −1 for pads.
    pub batch_id_per_token: &'a [i32],
    /// Position of each token.
    pub positions: &'a [i64],
    /// Fused HCA heads (§4) when present.
    pub block_tables: Option<BlockTables<'a>>,
    /// Rows of one block's envelope.
    pub envelope_rows: i64,
    /// HCA rows one block holds per layer.
    pub hca_rows_per_block: i32,
    /// Tokens (T).
    pub num_tokens: i32,
    /// Sliding window.
    pub win: i32,
}

/// §3 with the fused §4 heads: per live token, each enabled class's window at the tail of its
/// slice (oldest first) and its dest row; with block tables, the HCA head `e = 0..head`.
///
/// FlashMLA outputs (§3f) of class c, for every token t < T (pads included): view v's row t is
/// `window_row(W_c, slot, p − n + 1 + i) + shift[v]` for `i < n`, −1 up to `topk`;
/// `topk_length[t] = n`; with the compressed part, `compress_row(e) + shift[v]` for
/// `e < head`, −1 up to `flashmla_row_limit(head, extra_topk)` and nothing past it,
/// `extra_topk_length[t] = head`. A pad's rows are −1 (window rows whole, compressed rows
/// through 64) and its lengths 0 (a captured grid runs FlashMLA over every row: a pad must
/// attend to nothing, whatever an earlier step left there).
pub fn decode_indices(k: DecodeIndices<'_>) -> Result<()> {
    let DecodeIndices {
        mut classes,
        mut flashmla,
        state_slot_per_seq,
        batch_id_per_token,
        positions,
        block_tables,
        envelope_rows,
        hca_rows_per_block,
        num_tokens,
        win,
    } = k;
    let tokens = i64::from(num_tokens);
    for t in 0..tokens {
        let b = at(batch_id_per_token, t, "batch_id_per_token")?;
        if b < 0 {
            // Pad token: no CSR store; FlashMLA rows −1, lengths 0.
            for fm in flashmla.iter_mut().flatten() {
                flashmla_pad(fm, t, tokens)?;
            }
            continue;
        }
        let p = at(positions, t, "positions")?;
        let n = add(p, 1, "position")?.min(i64::from(win));
        let slot = i64::from(at(state_slot_per_seq, i64::from(b), "state_slot_per_seq")?);
        for (class, fm) in classes.iter_mut().zip(flashmla.iter_mut()) {
            let Some(class) = class else { continue };
            let end = i64::from(at(class.indptr, t + 1, "indptr")?);
            if let Some(indices) = class.indices.as_deref_mut() {
                write_window(indices, end - n, n, &class.params, slot, p - n + 1, "indices")?;
            }
            if let Some(dest) = class.dest_rows.as_deref_mut() {
                put(dest, t, window_row(&class.params, slot, p)?, "dest_rows")?;
            }
            if let Some(fm) = fm.as_mut() {
                let rows = (0..n).map(|i| window_row(&class.params, slot, p - n + 1 + i).map(Some));
                let cut = Row { width: fm.topk, limit: fm.topk.into() };
                flashmla_rows(fm.indices, fm.shifts, cut, t, tokens, n, rows, "flashmla indices")?;
                put(fm.topk_length, t, n, "flashmla topk_length")?;
            }
        }
        let Some(tables) = &block_tables else { continue };
        let Some(hca) = classes[CLASS_HCA].as_mut() else { continue };
        let begin = i64::from(at(hca.indptr, t, "hca indptr")?);
        let head = i64::from(at(hca.indptr, t + 1, "hca indptr")?) - begin - n;
        let rpb = i64::from(hca_rows_per_block);
        if let Some(indices) = hca.indices.as_deref_mut() {
            write_compressed(indices, begin, head, tables, i64::from(b), rpb, envelope_rows, "hca indices")?;
        }
        let Some(fm) = flashmla[CLASS_HCA].as_mut() else { continue };
        let Some(x) = fm.extra.as_mut() else { continue };
        let rpb = divisor("rows_per_block", rpb)?;
        // A negative block id (a raw launch's; `DecodePath` refuses them) names no row: −1
        // (§3f), whatever the envelope (shifted, its row could land on another layer's rows).
        let rows = (0..head).map(|e| {
            let block = tables.get(i64::from(b), e / rpb)?;
            if block < 0 {
                return Ok(None);
            }
            compress_row(block, e % rpb, envelope_rows).map(Some)
        });
        let cut = Row::compressed(x.extra_topk, head);
        flashmla_rows(x.extra_indices, fm.shifts, cut, t, tokens, head, rows, "flashmla extra_indices")?;
        put(x.extra_topk_length, t, head.max(0), "flashmla extra_topk_length")?;
    }
    Ok(())
}

/// A FlashMLA row's width and the entries of it written (`limit ≤ width`): window rows and the
/// CSA pack's rows whole, HCA compressed rows to [`crate::index::shape::flashmla_row_limit`].
#[derive(Clone, Copy, Debug)]
struct Row {
    width: i32,
    limit: i64,
}

impl Row {
    /// An HCA compressed row of `width` entries holding `head` (§3f).
    fn compressed(width: i32, head: i64) -> Row {
        Row { width, limit: crate::index::shape::flashmla_row_limit(head, width.into()) }
    }
}

/// Row `t` of every view of a FlashMLA buffer `[views][tokens][width]`: the `count` values of
/// `rows` (view-relative; `None`: −1 in place) + the view's shift, then −1 to the row's limit;
/// entries past it untouched. A count past the row is [`HostKernelError::PastRow`] (the
/// device bounds its stores to the row instead).
#[allow(clippy::too_many_arguments)] // the row's coordinates as the kernel takes them
fn flashmla_rows(
    out: &mut [i32],
    shifts: &[i32],
    row: Row,
    t: i64,
    tokens: i64,
    count: i64,
    rows: impl Iterator<Item = Result<Option<i64>>>,
    buffer: &'static str,
) -> Result<()> {
    let width = i64::from(row.width);
    if count > width {
        return Err(HostKernelError::PastRow { buffer, token: t, entries: count, width });
    }
    let rows = rows.collect::<Result<Vec<Option<i64>>>>()?;
    for (v, &shift) in shifts.iter().enumerate() {
        let start =
            mul(add(mul(v as i64, tokens, "flashmla row")?, t, "flashmla row")?, width, "flashmla row")?;
        for i in 0..row.limit.min(width) {
            let value = match rows.get(i as usize) {
                Some(&Some(r)) => add(r, shift.into(), "shifted row")?,
                _ => -1,
            };
            put(out, add(start, i, "flashmla entry")?, value, buffer)?;
        }
    }
    Ok(())
}

/// A pad token's FlashMLA rows (§3f): −1 in every view (window rows whole, compressed rows
/// through 64), lengths 0.
fn flashmla_pad(fm: &mut FlashMlaClass<'_>, t: i64, tokens: i64) -> Result<()> {
    let cut = Row { width: fm.topk, limit: fm.topk.into() };
    flashmla_rows(fm.indices, fm.shifts, cut, t, tokens, 0, std::iter::empty(), "flashmla indices")?;
    put(fm.topk_length, t, 0, "flashmla topk_length")?;
    if let Some(x) = fm.extra.as_mut() {
        let buffer = "flashmla extra_indices";
        let cut = Row::compressed(x.extra_topk, 0);
        flashmla_rows(x.extra_indices, fm.shifts, cut, t, tokens, 0, std::iter::empty(), buffer)?;
        put(x.extra_topk_length, t, 0, "flashmla extra_topk_length")?;
    }
    Ok(())
}

// ---- §4: HCA offsets --------------------------------------------------------------------------

/// §4 as a plain gather: `out[i] = table[bid[i]][e / rpb] * envelope + e % rpb`, `e = entry[i]`.
pub fn hca_offsets(
    entry_idx: &[i32],
    bid_per_entry: &[i32],
    tables: &BlockTables<'_>,
    envelope_rows: i64,
    rows_per_block: i32,
    out: &mut [i32],
) -> Result<()> {
    let rpb = divisor("rows_per_block", rows_per_block.into())?;
    for (i, &e) in entry_idx.iter().enumerate() {
        let i = i as i64;
        let b = i64::from(at(bid_per_entry, i, "bid_per_entry")?);
        let e = i64::from(e);
        if e < 0 {
            return Err(HostKernelError::NegativeEntry { index: i, entry: e });
        }
        put(out, i, compress_row(tables.get(b, e / rpb)?, e % rpb, envelope_rows)?, "out")?;
    }
    Ok(())
}

// ---- §5: CSA translate-pack ---------------------------------------------------------------------

/// The translate-pack's buffers (one CSA layer).
#[derive(Debug)]
pub struct CsaPack<'a> {
    /// Sequence-local top-k rows.
    pub topk: &'a [i32],
    /// Logical → physical block ids.
    pub block_tables: BlockTables<'a>,
    /// Read when `window_size > 0`.
    pub positions: &'a [i64],
    /// CSA CSR offsets `[T+1]`.
    pub indptr: &'a [i32],
    /// Sequence of each token; −1 for pads.
    pub batch_id_per_token: &'a [i32],
    /// Read when `window_size == 0`.
    pub skip_prefix_len_per_token: &'a [i32],
    /// The CSA index buffer (out).
    pub out: &'a mut [i32],
    /// Rows of one block's envelope.
    pub envelope_rows: i64,
    /// Elements from one top-k row to the next.
    pub topk_row_stride: i32,
    /// Tokens (T).
    pub num_tokens: i32,
    /// Compressed rows per block of the class (64 for V4's CSA).
    pub block_capacity: i32,
    /// Window length (decode), or 0 to read the skip buffer (prefill).
    pub window_size: i32,
    /// Added to every packed row (the layer's compress bias; 0 in V4).
    pub compress_bias: i64,
    /// FlashMLA's convention (§5f): `out` is `[T][extra_topk]` rows, not CSR slices.
    pub flashmla: Option<FlashMlaPack<'a>>,
}

/// The translate-pack's FlashMLA mode (§5f, decode): dense rows with a −1 tail and a length.
#[derive(Debug)]
pub struct FlashMlaPack<'a> {
    /// Entries per output row.
    pub extra_topk: i32,
    /// The layer's page-view shift, added to every packed row.
    pub shift: i32,
    /// `[T]` (out): packed entries per token (0 for pads).
    pub extra_topk_length: &'a mut [i32],
}

/// §5 for every layer: the heads `[indptr[t], indptr[t] + valid_k)` from the top-k rows, block
/// index clamped to the table (C division, as the device).
///
/// FlashMLA mode (`flashmla`, §5f; decode): row t of `out` (`[T][extra_topk]`) holds the
/// `valid_k` packed rows + `shift` (a negative top-k value, transformers' −1 tail, is −1 in
/// place), then −1; `extra_topk_length[t] = max(valid_k, 0)`; a pad's row is −1, length 0.
pub fn csa_translate_pack(mut k: CsaPack<'_>) -> Result<()> {
    let cap = divisor("block_capacity", k.block_capacity.into())?;
    let last = i64::from(k.block_tables.stride) - 1;
    let tokens = i64::from(k.num_tokens);
    for t in 0..tokens {
        let b = at(k.batch_id_per_token, t, "batch_id_per_token")?;
        if b < 0 {
            if let Some(fm) = k.flashmla.as_mut() {
                let cut = Row { width: fm.extra_topk, limit: fm.extra_topk.into() };
                flashmla_rows(k.out, &[fm.shift], cut, t, tokens, 0, std::iter::empty(), "out")?;
                put(fm.extra_topk_length, t, 0, "extra_topk_length")?;
            }
            continue;
        }
        let skip = if k.window_size > 0 {
            add(at(k.positions, t, "positions")?, 1, "position")?.min(k.window_size.into())
        } else {
            at(k.skip_prefix_len_per_token, t, "skip_prefix_len_per_token")?.into()
        };
        let base = i64::from(at(k.indptr, t, "indptr")?);
        let valid_k = i64::from(at(k.indptr, t + 1, "indptr")?) - base - skip;
        if valid_k > i64::from(k.topk_row_stride) {
            return Err(HostKernelError::TopkPastRow {
                token: t,
                valid_k,
                row_stride: k.topk_row_stride.into(),
            });
        }
        let row = mul(t, k.topk_row_stride.into(), "topk index")?;
        if let Some(fm) = k.flashmla.as_mut() {
            let valid = valid_k.max(0);
            let entries = (0..valid).map(|i| {
                let v = i64::from(at(k.topk, row + i, "topk")?);
                if v < 0 {
                    return Ok(None);
                }
                let blk = (v / cap).clamp(0, last.max(0)); // clamp, do not drop (as §5)
                let r = compress_row(k.block_tables.get(b.into(), blk)?, v % cap, k.envelope_rows)?;
                Ok(Some(add(r, k.compress_bias, "biased row")?))
            });
            let cut = Row { width: fm.extra_topk, limit: fm.extra_topk.into() };
            flashmla_rows(k.out, &[fm.shift], cut, t, tokens, valid, entries, "out")?;
            put(fm.extra_topk_length, t, valid, "extra_topk_length")?;
            continue;
        }
        for i in 0..valid_k {
            let v = i64::from(at(k.topk, row + i, "topk")?);
            let blk = (v / cap).clamp(0, last.max(0)); // clamp, do not drop
            put(
                k.out,
                base + i,
                add(
                    compress_row(k.block_tables.get(b.into(), blk)?, v % cap, k.envelope_rows)?,
                    k.compress_bias,
                    "biased row",
                )?,
                "out",
            )?;
        }
    }
    Ok(())
}

// ---- §6: prefill builder ------------------------------------------------------------------------

/// One CSR buffer: `indices[indptr[t] .. indptr[t+1])` is token t's slice.
#[derive(Debug)]
pub struct Csr<'a> {
    /// CSR offsets `[T+1]`.
    pub indptr: &'a [i32],
    /// Index buffer (out).
    pub indices: &'a mut [i32],
}

/// The prefill builder's buffers and scalars.
#[derive(Debug)]
pub struct PrefillIndices<'a> {
    /// Dense window parameters.
    pub dense: WindowParams,
    /// CSA window parameters.
    pub csa: WindowParams,
    /// HCA window parameters.
    pub hca: WindowParams,
    /// Position of each token.
    pub positions: &'a [i32],
    /// Sequence of each token.
    pub bid_per_token: &'a [i32],
    /// Absolute position of each chunk's first token.
    pub chunk_start_per_seq: &'a [i32],
    /// Row of each chunk's first token in the forward's K.
    pub cu_seqlens_q_per_seq: &'a [i32],
    /// Physical slot per sequence.
    pub state_slot_per_seq: &'a [i32],
    /// Committed HCA rows per sequence (`ctx / 128`).
    pub n_committed_hca_per_seq: &'a [i32],
    /// Logical → physical block ids.
    pub block_tables: BlockTables<'a>,
    /// Extend rows (rows of the forward's own K).
    pub extend: Csr<'a>,
    /// `None` when the geometry has no dense class.
    pub prefix_swa: Option<Csr<'a>>,
    /// CSA prefix: `[top-k head | window rows]`.
    pub prefix_csa: Csr<'a>,
    /// HCA prefix: `[window rows | compressed]`.
    pub prefix_hca: Csr<'a>,
    /// Rows of one block's envelope.
    pub envelope_rows: i64,
    /// Tokens (T).
    pub num_tokens: i32,
    /// Sliding window.
    pub win: i32,
    /// HCA compress ratio (128).
    pub hca_ratio: i32,
    /// HCA rows one block holds per layer.
    pub hca_rows_per_block: i32,
    /// The coarse slot is packed per layer (V4.1): its slice is `[head | window]` as the
    /// CSA slice, the head left to the translate-pack; V4 (false): `[window | compressed]`.
    pub coarse_packed: bool,
}

/// §6: extend rows, dense window slice, CSA window tail, HCA `[window | compressed]` (packed
/// per layer: the HCA window tail only).
pub fn prefill_indices(k: PrefillIndices<'_>) -> Result<()> {
    let PrefillIndices {
        dense,
        csa,
        hca,
        positions,
        bid_per_token,
        chunk_start_per_seq,
        cu_seqlens_q_per_seq,
        state_slot_per_seq,
        n_committed_hca_per_seq,
        block_tables,
        extend,
        mut prefix_swa,
        prefix_csa,
        prefix_hca,
        envelope_rows,
        num_tokens,
        win,
        hca_ratio,
        hca_rows_per_block,
        coarse_packed,
    } = k;
    let hca_ratio = divisor("hca_ratio", hca_ratio.into())?;
    let win = i64::from(win);
    for t in 0..i64::from(num_tokens) {
        let b = at(bid_per_token, t, "bid_per_token")?;
        if b < 0 {
            continue; // prefill has no pads; the device skips them too
        }
        let b = i64::from(b);
        let p = i64::from(at(positions, t, "positions")?);
        let cs = i64::from(at(chunk_start_per_seq, b, "chunk_start_per_seq")?);
        let in_chunk = p - cs;
        let low = (p - win + 1).max(0);
        let ext = (in_chunk + 1).min(win);
        let pre = (cs - low).max(0);
        let n_hca =
            ((p + 1) / hca_ratio).min(at(n_committed_hca_per_seq, b, "n_committed_hca_per_seq")?.into());
        let slot = i64::from(at(state_slot_per_seq, b, "state_slot_per_seq")?);

        let start = i64::from(at(extend.indptr, t, "extend_indptr")?);
        let first = i64::from(at(cu_seqlens_q_per_seq, b, "cu_seqlens_q_per_seq")?) + in_chunk - ext + 1;
        for i in 0..ext {
            put(extend.indices, start + i, first + i, "extend_indices")?;
        }
        if let Some(swa) = prefix_swa.as_mut() {
            let start = i64::from(at(swa.indptr, t, "swa_indptr")?);
            write_window(swa.indices, start, pre, &dense, slot, low, "swa_indices")?;
        }
        let end = i64::from(at(prefix_csa.indptr, t + 1, "csa_indptr")?);
        write_window(prefix_csa.indices, end - pre, pre, &csa, slot, low, "csa_indices")?;
        if coarse_packed {
            let end = i64::from(at(prefix_hca.indptr, t + 1, "hca_indptr")?);
            write_window(prefix_hca.indices, end - pre, pre, &hca, slot, low, "hca_indices")?;
            continue;
        }
        let start = i64::from(at(prefix_hca.indptr, t, "hca_indptr")?);
        write_window(prefix_hca.indices, start, pre, &hca, slot, low, "hca_indices")?;
        write_compressed(
            prefix_hca.indices,
            start + pre,
            n_hca,
            &block_tables,
            b,
            hca_rows_per_block.into(),
            envelope_rows,
            "hca_indices",
        )?;
    }
    Ok(())
}
