//! The raw-pointer entry: buffer lengths derived from the launch arguments, then the safe
//! functions.

use super::*;
use crate::geometry::NUM_SLOTS;
use crate::index::shape::check_launch;
use crate::index::ElemType;
use crate::index::{
    CopyRun, CopyRunsArgs, CsaPackArgs, DecodeIndexArgs, FillRun, FillRunsArgs, FlashMlaOut, HcaOffsetsArgs,
    Launch, PlaneWrite, PrefillIndexArgs, RingWriteArgs, RowScatterArgs, StateUpdateArgs, WindowGatherArgs,
    CLASS_HCA,
};

// ---- raw-pointer entry ----------------------------------------------------------------------------

fn len_of(buffer: &'static str, n: i64) -> Result<usize> {
    usize::try_from(n.max(0)).map_err(|_| HostKernelError::TooLong { buffer, len: n })
}

/// A shared slice of `len` elements at `addr` (none read when `len == 0`).
///
/// # Safety
/// When `len > 0`, `addr .. addr + len * size_of::<T>()` is readable memory holding `T`s that
/// nothing writes while the slice lives.
unsafe fn input<'a, T>(buffer: &'static str, addr: u64, len: usize) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    check_address::<T>(buffer, addr, len)?;
    crate::index::bounds::claim(buffer, addr, len * std::mem::size_of::<T>(), false)?;
    // SAFETY: non-null, aligned and sized as checked; readable and unaliased by the caller's
    // promise.
    Ok(unsafe { std::slice::from_raw_parts(addr as usize as *const T, len) })
}

/// A mutable slice of `len` elements at `addr`.
///
/// # Safety
/// When `len > 0`, the range is writable memory that no other live reference covers.
unsafe fn output<'a, T>(buffer: &'static str, addr: u64, len: usize) -> Result<&'a mut [T]> {
    if len == 0 {
        return Ok(&mut []);
    }
    check_address::<T>(buffer, addr, len)?;
    crate::index::bounds::claim(buffer, addr, len * std::mem::size_of::<T>(), true)?;
    // SAFETY: as `input`, and the caller promises no other reference covers the range.
    Ok(unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut T, len) })
}

fn check_address<T>(buffer: &'static str, addr: u64, len: usize) -> Result<()> {
    let align = std::mem::align_of::<T>();
    if addr == 0 || addr % align as u64 != 0 || usize::try_from(addr).is_err() {
        return Err(HostKernelError::BadAddress { buffer, addr, align });
    }
    let too_long = || HostKernelError::TooLong { buffer, len: len as i64 };
    let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(too_long)?;
    if bytes > isize::MAX as usize || (addr as usize).checked_add(bytes).is_none() {
        return Err(too_long());
    }
    crate::index::bounds::check(buffer, addr, bytes as u64)
}

/// Largest value of an indptr's first `n + 1` entries: the length its indices buffer needs.
fn indptr_extent(indptr: &[i32]) -> i64 {
    indptr.iter().copied().max().map_or(0, |m| i64::from(m).max(0))
}

/// Sequences a batch-id array reaches: `max(bid) + 1` over non-negative ids.
fn seqs_reached(bids: &[i32]) -> i64 {
    bids.iter().copied().max().map_or(0, |m| i64::from(m) + 1).max(0)
}

fn count(n: i32) -> usize {
    usize::try_from(n).unwrap_or(0)
}

/// Run one launch on host memory: the host backend's `launch`.
///
/// # Safety
/// Every pointer in the arguments is a host address covering what the kernel reads and writes
/// (index-buffers.md; the lengths are derived from the arguments and the indptr / cu_seqlens
/// values), and no output buffer overlaps another buffer of the same launch.
pub unsafe fn run_launch(launch: &Launch) -> Result<()> {
    check_launch(launch)?;
    // SAFETY (all arms): forwarded from this function's contract.
    unsafe {
        match launch {
            Launch::Decode(a) => run_decode(a),
            Launch::Prefill(a) => run_prefill(a),
            Launch::HcaOffsets(a) => run_hca_offsets(a),
            Launch::CsaPack(a) => run_csa_pack(a),
            Launch::RingWrite(a) => run_ring_write(a),
            Launch::RowScatter(a) => run_row_scatter(a),
            Launch::StateUpdate(a) => run_state_update(a),
            Launch::FillRuns(a) => run_fill_runs(a),
            Launch::CopyRuns(a) => run_copy_runs(a),
            Launch::WindowGather(a) => run_window_gather(a, false),
            Launch::WindowGatherFp8(a) => run_window_gather(a, true),
            Launch::KvRows(a) => run_kv_rows(a),
            Launch::IndexKeys(a) => run_index_keys(a),
            Launch::WriteBatch(a) => run_write_batch(a),
            Launch::Empty => Ok(()),
        }
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_decode(a: &DecodeIndexArgs) -> Result<()> {
    let t = count(a.num_tokens);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let bids: &[i32] = input("batch_id_per_token", a.batch_id_per_token, t)?;
        let positions: &[i64] = input("positions", a.positions, t)?;
        let live: Vec<i32> = bids.iter().copied().filter(|&b| b >= 0).collect();
        let bs = len_of("state_slot_per_seq", seqs_reached(&live))?;
        let slots: &[i32] = input("state_slot_per_seq", a.state_slot_per_seq, bs)?;
        let mut classes: [Option<DecodeClass<'_>>; NUM_SLOTS] = [None, None, None];
        let mut flashmla: [Option<FlashMlaClass<'_>>; NUM_SLOTS] = [None, None, None];
        for (c, cls) in a.classes.iter().enumerate() {
            if cls.indptr == 0 {
                continue;
            }
            let indptr: &[i32] = input("indptr", cls.indptr, t + 1)?;
            let n = len_of("indices", indptr_extent(indptr))?;
            let dest_rows =
                if cls.dest_rows == 0 { None } else { Some(output("dest_rows", cls.dest_rows, t)?) };
            let indices = if cls.indices == 0 { None } else { Some(output("indices", cls.indices, n)?) };
            classes[c] = Some(DecodeClass { params: cls.params, indptr, indices, dest_rows });
            flashmla[c] = flashmla_class(&a.flashmla[c], t)?;
        }
        let block_tables = if a.block_tables != 0 && a.classes[CLASS_HCA].indptr != 0 {
            let n = len_of("block_tables", mul(bs as i64, a.block_table_stride.into(), "block_tables")?)?;
            Some(BlockTables {
                table: input("block_tables", a.block_tables, n)?,
                stride: a.block_table_stride,
            })
        } else {
            None
        };
        decode_indices(DecodeIndices {
            classes,
            flashmla,
            state_slot_per_seq: slots,
            batch_id_per_token: bids,
            positions,
            block_tables,
            envelope_rows: a.envelope_rows,
            hca_rows_per_block: a.hca_rows_per_block,
            num_tokens: a.num_tokens,
            win: a.win,
        })
    }
}

/// A class's FlashMLA outputs (§3f) as slices: `[views][t][width]` rows and `[t]` lengths.
///
/// # Safety
/// See [`run_launch`].
unsafe fn flashmla_class<'a>(fm: &FlashMlaOut, t: usize) -> Result<Option<FlashMlaClass<'a>>> {
    if fm.indices == 0 {
        return Ok(None);
    }
    let rows = |width: i32, what| -> Result<usize> {
        let n = mul(mul(fm.num_views.into(), t as i64, what)?, width.into(), what)?;
        len_of(what, n)
    };
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let extra = if fm.extra_indices == 0 {
            None
        } else {
            Some(FlashMlaExtra {
                extra_topk: fm.extra_topk,
                extra_indices: output(
                    "flashmla extra_indices",
                    fm.extra_indices,
                    rows(fm.extra_topk, "flashmla extra_indices")?,
                )?,
                extra_topk_length: output("flashmla extra_topk_length", fm.extra_topk_length, t)?,
            })
        };
        Ok(Some(FlashMlaClass {
            shifts: input("flashmla shifts", fm.shifts, count(fm.num_views))?,
            topk: fm.topk,
            indices: output("flashmla indices", fm.indices, rows(fm.topk, "flashmla indices")?)?,
            topk_length: output("flashmla topk_length", fm.topk_length, t)?,
            extra,
        }))
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_prefill(a: &PrefillIndexArgs) -> Result<()> {
    let t = count(a.num_tokens);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let bids: &[i32] = input("bid_per_token", a.bid_per_token, t)?;
        let bs = len_of("per-sequence arrays", seqs_reached(bids))?;
        let per_seq = |name: &'static str, addr: u64| -> Result<&[i32]> { input(name, addr, bs) };
        let csr = |name: &'static str, indptr: u64, indices: u64| -> Result<Csr<'_>> {
            let indptr: &[i32] = input(name, indptr, t + 1)?;
            let n = len_of(name, indptr_extent(indptr))?;
            Ok(Csr { indptr, indices: output(name, indices, n)? })
        };
        let table_len = len_of("block_tables", mul(bs as i64, a.block_table_stride.into(), "block_tables")?)?;
        prefill_indices(PrefillIndices {
            dense: a.dense,
            csa: a.csa,
            hca: a.hca,
            positions: input("positions", a.positions, t)?,
            bid_per_token: bids,
            chunk_start_per_seq: per_seq("chunk_start_per_seq", a.chunk_start_per_seq)?,
            cu_seqlens_q_per_seq: per_seq("cu_seqlens_q_per_seq", a.cu_seqlens_q_per_seq)?,
            state_slot_per_seq: per_seq("state_slot_per_seq", a.state_slot_per_seq)?,
            n_committed_hca_per_seq: per_seq("n_committed_hca_per_seq", a.n_committed_hca_per_seq)?,
            block_tables: BlockTables {
                table: input("block_tables", a.block_tables, table_len)?,
                stride: a.block_table_stride,
            },
            extend: csr("extend", a.extend_indptr, a.extend_indices)?,
            prefix_swa: if a.swa_indptr == 0 {
                None
            } else {
                Some(csr("prefix_swa", a.swa_indptr, a.swa_indices)?)
            },
            prefix_csa: csr("prefix_csa", a.csa_indptr, a.csa_indices)?,
            prefix_hca: csr("prefix_hca", a.hca_indptr, a.hca_indices)?,
            envelope_rows: a.envelope_rows,
            num_tokens: a.num_tokens,
            win: a.win,
            hca_ratio: a.hca_ratio,
            hca_rows_per_block: a.hca_rows_per_block,
            coarse_packed: a.coarse_packed != 0,
        })
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_hca_offsets(a: &HcaOffsetsArgs) -> Result<()> {
    let n = count(a.num_entries);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let entries: &[i32] = input("entry_idx", a.entry_idx, n)?;
        let bids: &[i32] = input("bid_per_entry", a.bid_per_entry, n)?;
        let rows = mul(seqs_reached(bids), a.block_table_stride.into(), "block_tables")?;
        let table = input("block_tables", a.block_tables, len_of("block_tables", rows)?)?;
        let tables = BlockTables { table, stride: a.block_table_stride };
        hca_offsets(entries, bids, &tables, a.envelope_rows, a.rows_per_block, output("out", a.out, n)?)
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_csa_pack(a: &CsaPackArgs) -> Result<()> {
    let t = count(a.num_tokens);
    if t == 0 {
        return Ok(());
    }
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let bids: &[i32] = input("batch_id_per_token", a.batch_id_per_token, t)?;
        let indptr: &[i32] = input("indptr", a.indptr, t + 1)?;
        let positions: &[i64] = if a.window_size > 0 { input("positions", a.positions, t)? } else { &[] };
        let skip: &[i32] = if a.window_size > 0 {
            &[]
        } else {
            input("skip_prefix_len_per_token", a.skip_prefix_len_per_token, t)?
        };
        let live: Vec<i32> = bids.iter().copied().filter(|&b| b >= 0).collect();
        let rows = mul(seqs_reached(&live), a.block_table_stride.into(), "block_tables")?;
        let table = input("block_tables", a.block_tables, len_of("block_tables", rows)?)?;
        let topk_len = mul(t as i64, a.topk_row_stride.into(), "topk length")?;
        // FlashMLA mode: `out` is [T][extra_topk] rows; CSR: the slices the indptr spans.
        let (out_len, flashmla) = if a.extra_topk > 0 {
            let fm = FlashMlaPack {
                extra_topk: a.extra_topk,
                shift: a.shift,
                extra_topk_length: output("extra_topk_length", a.extra_topk_length, t)?,
            };
            (mul(t as i64, a.extra_topk.into(), "out length")?, Some(fm))
        } else {
            (indptr_extent(indptr), None)
        };
        csa_translate_pack(CsaPack {
            topk: input("topk", a.topk, len_of("topk", topk_len)?)?,
            block_tables: BlockTables { table, stride: a.block_table_stride },
            positions,
            indptr,
            batch_id_per_token: bids,
            skip_prefix_len_per_token: skip,
            out: output("out", a.out, len_of("out", out_len)?)?,
            envelope_rows: a.envelope_rows,
            topk_row_stride: a.topk_row_stride,
            num_tokens: a.num_tokens,
            block_capacity: a.block_capacity,
            window_size: a.window_size,
            compress_bias: a.compress_bias,
            flashmla,
        })
    }
}

/// Both planes' row slices: `src_rows` source rows, `view_rows` pool rows.
///
/// # Safety
/// See [`run_launch`].
unsafe fn plane_rows<'a>(
    planes: &[PlaneWrite; 2],
    src_rows: i64,
    view_rows: i64,
) -> Result<Vec<PlaneRows<'a>>> {
    let mut out = Vec::with_capacity(2);
    for p in planes.iter().filter(|p| p.pool != 0) {
        let w = len_of("row_bytes", p.row_bytes)?;
        let kv_len = len_of("kv", mul(src_rows, p.row_bytes, "kv bytes")?)?;
        let pool_len = len_of("pool", mul(view_rows, p.row_bytes, "pool bytes")?)?;
        // SAFETY: lengths from the arguments; the caller covers them.
        unsafe {
            out.push(PlaneRows {
                kv: input("kv", p.kv, kv_len)?,
                pool: output("pool", p.pool, pool_len)?,
                row_bytes: w,
            });
        }
    }
    Ok(out)
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_ring_write(a: &RingWriteArgs) -> Result<()> {
    let bs = count(a.num_seqs);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let cu: &[i32] = input("cu_seqlens_q", a.cu_seqlens_q, bs + 1)?;
        let tokens = indptr_extent(cu);
        let positions: &[i32] = input("positions", a.positions, len_of("positions", tokens)?)?;
        let slots: &[i32] = input("state_slot_per_seq", a.state_slot_per_seq, bs)?;
        let mut planes = plane_rows(&a.planes, tokens, a.view_rows)?;
        ring_write(&a.params, &mut planes, positions, cu, slots, a.view_rows, a.num_seqs, a.write_per_batch)
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_row_scatter(a: &RowScatterArgs) -> Result<()> {
    let t = count(a.num_tokens);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let bids: &[i32] = input("batch_id_per_token", a.batch_id_per_token, t)?;
        let dest: &[i32] = input("dest_rows", a.dest_rows, t)?;
        let mut planes = plane_rows(&a.planes, t as i64, a.view_rows)?;
        row_scatter(&mut planes, bids, dest, a.view_rows, a.num_tokens)
    }
}

/// The write batch: each item as its own launch, in table order (the items are independent,
/// so any order gives these bytes), after checking that the table tiles the grid exactly as
/// the items' own kernels' grids do (the device kernel trusts it).
///
/// # Safety
/// See [`run_launch`]; every item's pointers as its own launch's.
unsafe fn run_write_batch(a: &crate::index::WriteBatchArgs) -> Result<()> {
    use crate::index::shape::write_item_blocks;
    use crate::index::WriteItem;
    let n = count(a.num_items);
    // Copied out: the tables' slices end here, before any item takes its own.
    // SAFETY: lengths from the arguments; the caller covers them.
    let (items, first): (Vec<WriteItem>, Vec<i32>) = unsafe {
        (
            input::<WriteItem>("items", a.items, n)?.to_vec(),
            input::<i32>("first_block", a.first_block, n)?.to_vec(),
        )
    };
    crate::index::bounds::release_claims();
    let bad = |item: usize, reason: String| HostKernelError::BadWriteBatch { item, reason };
    let mut launches = Vec::with_capacity(n);
    for (i, item) in items.iter().enumerate() {
        let launch = item.launch().ok_or_else(|| bad(i, format!("kind {} is no write", item.kind)))?;
        let start = i64::from(first[i]);
        let end = if i + 1 < n { i64::from(first[i + 1]) } else { i64::from(a.num_blocks) };
        if i == 0 && start != 0 {
            return Err(bad(i, format!("first block {start}: the table starts at 0")));
        }
        let own = write_item_blocks(&launch).map_or(0, |b| b as i64);
        if end - start != own {
            return Err(bad(i, format!("blocks {start}..{end}, its own grid has {own}")));
        }
        launches.push(launch);
    }
    for launch in &launches {
        // SAFETY: forwarded from this function's contract; each item's slices are released
        // when it returns (they alias nothing the next item holds).
        unsafe { run_launch(launch)? };
        crate::index::bounds::release_claims();
    }
    Ok(())
}

/// Bytes of a paged plane from its row 0 through the last whole page holding the view's rows
/// (`view_row0 .. view_row0 + view_rows`), in the plane's page.
fn paged_plane_bytes(a: &crate::index::KvRowsArgs, plane: &crate::format::PlaneFormat) -> Result<usize> {
    let page = plane.page_rows as i64;
    let oob = |index| HostKernelError::OutOfBounds { buffer: "nope", index, len: 0 };
    let end = a.view_row0.checked_add(a.view_rows).ok_or(oob(a.view_row0))?;
    let pages = end.checked_add(page - 1).map(|e| e / page).ok_or(oob(end))?;
    let page_bytes = mul(page, plane.row_bytes() as i64, "plane bytes")?;
    len_of("plane bytes", mul(pages, page_bytes, "plane bytes")?)
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_kv_rows(a: &crate::index::KvRowsArgs) -> Result<()> {
    use super::{kv_rows, KvPlanes};
    use crate::index::{FP8_NOPE_ROW_BYTES, KV_ROW_VALUES, ROPE_ROW_BYTES};
    let t = count(a.num_tokens);
    if t == 0 {
        return Ok(());
    }
    let stride = len_of("kv_row_stride", a.kv_row_stride)?;
    // The last row needs only its 512 values, not a whole stride.
    let kv_len = (t - 1).checked_mul(stride).and_then(|n| n.checked_add(KV_ROW_VALUES));
    let kv_len =
        kv_len.ok_or(HostKernelError::OutOfBounds { buffer: "kv", index: a.num_tokens.into(), len: 0 })?;
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let kv: &[u16] = input("kv", a.kv, kv_len)?;
        let dest: &[i32] = input("dest_rows", a.dest_rows, t)?;
        let bids: Option<&[i32]> = if a.batch_id_per_token == 0 {
            None
        } else {
            Some(input("batch_id_per_token", a.batch_id_per_token, t)?)
        };
        let rows = |w: u64| len_of("view bytes", mul(a.view_rows, w as i64, "view bytes")?);
        let paged = crate::format::RowFormatId::from_kernel_code(a.format).filter(|f| f.format().is_paged());
        let mut planes = match (a.format, paged) {
            // A paged format's plane (FlashMLA's V4 rows, pages of 64 or of 2) from row 0.
            (_, Some(format)) => {
                let bytes = paged_plane_bytes(a, &format.format().planes[0])?;
                KvPlanes::Paged { format, plane: output("nope", a.nope, bytes)?, row0: a.view_row0 }
            }
            (crate::index::KV_ROWS_ATOM_FP8, None) => KvPlanes::Fp8 {
                nope: output("nope", a.nope, rows(FP8_NOPE_ROW_BYTES)?)?,
                rope: output("rope", a.rope, rows(ROPE_ROW_BYTES)?)?,
            },
            (crate::index::KV_ROWS_FLASHMLA_V41, None) => KvPlanes::Interleaved {
                format: crate::format::RowFormatId::FlashMlaV41,
                pool: output("nope", a.nope, rows(crate::index::FLASHMLA_V41_ROW_BYTES)?)?,
            },
            (crate::index::KV_ROWS_FLASHMLA_V41_FP4, None) => KvPlanes::Interleaved {
                format: crate::format::RowFormatId::FlashMlaV41Fp4,
                pool: output("nope", a.nope, rows(crate::index::FLASHMLA_V41_FP4_ROW_BYTES)?)?,
            },
            _ => KvPlanes::Bf16 { pool: output("nope", a.nope, rows(2 * KV_ROW_VALUES as u64)?)? },
        };
        kv_rows(kv, stride, dest, bids, &mut planes, a.view_rows, a.num_tokens)
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_index_keys(a: &crate::index::IndexKeysArgs) -> Result<()> {
    use super::{index_keys, key_block_bytes, KeyCache};
    use crate::index::{
        INDEX_KEYS_ATOM_FP8, INDEX_KEYS_ATOM_FP8_FNUZ, INDEX_KEYS_BF16, INDEX_KEYS_FP8, INDEX_KEY_VALUES,
    };
    let t = count(a.num_tokens);
    if t == 0 {
        return Ok(());
    }
    let stride = len_of("key_row_stride", a.key_row_stride)?;
    let keys_len = (t - 1).checked_mul(stride).and_then(|n| n.checked_add(INDEX_KEY_VALUES));
    let keys_len = keys_len.ok_or(HostKernelError::OutOfBounds {
        buffer: "keys",
        index: a.num_tokens.into(),
        len: 0,
    })?;
    let rows = len_of("block_rows", a.block_rows.into())?;
    let (block, scale) = key_block_bytes(a.format, rows)
        .ok_or(HostKernelError::Launch(super::LaunchError::BadCode { field: "format", value: a.format }))?;
    let bytes = |per: usize| len_of("indexer bytes", mul(a.num_blocks, per as i64, "indexer bytes")?);
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let keys: &[u16] = input("keys", a.keys, keys_len)?;
        let dest: &[i32] = input("dest", a.dest, t)?;
        let data: &mut [u8] = output("data", a.data, bytes(block)?)?;
        let mut cache = match a.format {
            INDEX_KEYS_BF16 => KeyCache::Bf16 { data },
            INDEX_KEYS_FP8 => KeyCache::Fp8 { data },
            INDEX_KEYS_ATOM_FP8 => KeyCache::AtomFp8 { data, fnuz: false },
            INDEX_KEYS_ATOM_FP8_FNUZ => KeyCache::AtomFp8 { data, fnuz: true },
            _ => KeyCache::Fp4 { data, scales: output("scales", a.scales, bytes(scale)?)? },
        };
        index_keys(keys, stride, dest, &mut cache, a.num_blocks, a.block_rows, a.num_tokens)
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_state_update(a: &StateUpdateArgs) -> Result<()> {
    let n = count(a.num_rows);
    // SAFETY: lengths from the arguments and the plan's values; the caller covers them.
    unsafe {
        let plan: &[i32] = input("write_plan", a.write_plan, n * 4)?;
        let live: Vec<usize> = (0..n).filter(|&r| plan[4 * r + 2] >= 0).collect();
        if live.is_empty() {
            return Ok(());
        }
        let slot_map: Option<&[i32]> = if a.slot_map == 0 {
            None
        } else {
            let bids: Vec<i32> = live.iter().map(|&r| plan[4 * r + 1]).collect();
            Some(input("slot_map", a.slot_map, len_of("slot_map", seqs_reached(&bids))?)?)
        };
        let (mut slots, mut max_ragged) = ((i64::MAX, i64::MIN), 0i64);
        for &r in &live {
            if let Some((ragged, slot, _)) = state::plan_row(plan, slot_map, r as i64)? {
                slots = (slots.0.min(slot), slots.1.max(slot));
                max_ragged = max_ragged.max(ragged);
            }
        }
        let (dim, ring) = (i64::from(a.dim), i64::from(a.ring));
        let in_size = ElemType::from_code(a.in_dtype).map_or(4, ElemType::size) as i64;
        let ape_size = ElemType::from_code(a.ape_dtype).map_or(4, ElemType::size) as i64;
        let rows_bytes = |stride: i64| -> Result<usize> {
            len_of(
                "kv / score",
                mul(add(mul(max_ragged, stride, "input rows")?, dim, "input rows")?, in_size, "input bytes")?,
            )
        };
        let kv: &[u8] = input("kv", a.kv, rows_bytes(a.kv_row_stride)?)?;
        let score: &[u8] = input("score", a.score, rows_bytes(a.score_row_stride)?)?;
        let ape_len = len_of("ape", mul(mul(a.ratio.into(), dim, "ape")?, ape_size, "ape bytes")?)?;
        let ape: &[u8] = input("ape", a.ape, ape_len)?;
        // The two state ranges; one part when they overlap (two fields of the same slots in
        // one plane).
        let k = state::state_extent(a.kv_state, slots, a.kv_slot_bytes, ring, dim)?;
        let s = state::state_extent(a.score_state, slots, a.score_slot_bytes, ring, dim)?;
        let mut ranges = if k.0 < s.1 && s.0 < k.1 { vec![(k.0.min(s.0), k.1.max(s.1))] } else { vec![k, s] };
        ranges.sort_unstable();
        let mut parts = Vec::with_capacity(2);
        for (first, end) in ranges {
            let len = usize::try_from(end - first)
                .map_err(|_| HostKernelError::TooLong { buffer: "state", len: -1 })?;
            parts.push((first, output::<u8>("state", first, len)?));
        }
        update_compressor_states(a, kv, score, ape, plan, slot_map, &mut state::StateMemory::new(parts))
    }
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_fill_runs(a: &FillRunsArgs) -> Result<()> {
    // SAFETY: the descriptor array is covered by the caller. Copied out, so a run that
    // writes over the descriptor does not alias a live slice of it.
    let runs: Vec<FillRun> = unsafe { input::<FillRun>("runs", a.runs, count(a.num_runs))? }.to_vec();
    // Check every run before writing any, so a bad descriptor writes nothing.
    for (i, r) in runs.iter().enumerate() {
        if r.dst % 4 != 0 || r.bytes % 4 != 0 {
            return Err(HostKernelError::FillRunUnaligned { run: i, dst: r.dst, bytes: r.bytes });
        }
        let len = usize::try_from(r.bytes / 4)
            .map_err(|_| HostKernelError::TooLong { buffer: "fill run", len: -1 })?;
        check_address::<u32>("fill run", r.dst, len)?;
    }
    for r in &runs {
        let len = (r.bytes / 4) as usize; // fits: checked above
        if len == 0 {
            continue;
        }
        // SAFETY: the caller covers each run (checked non-null, aligned and, under
        // `run_launch_within`, inside one allowed range above); runs are written one at a
        // time and no other slice of the launch is alive, so overlapping runs do not alias.
        let words: &mut [u32] = unsafe { std::slice::from_raw_parts_mut(r.dst as usize as *mut u32, len) };
        words.fill(r.pattern);
    }
    Ok(())
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_copy_runs(a: &CopyRunsArgs) -> Result<()> {
    // SAFETY: the descriptor array is covered by the caller. Copied out, so a run that
    // writes over the descriptor does not alias a live slice of it.
    let runs: Vec<CopyRun> = unsafe { input::<CopyRun>("runs", a.runs, count(a.num_runs))? }.to_vec();
    for (i, r) in runs.iter().enumerate() {
        let len =
            usize::try_from(r.bytes).map_err(|_| HostKernelError::TooLong { buffer: "copy run", len: -1 })?;
        if len == 0 {
            continue;
        }
        check_address::<u8>("copy run src", r.src, len)?;
        check_address::<u8>("copy run dst", r.dst, len)?;
        if r.src < r.dst + r.bytes && r.dst < r.src + r.bytes {
            return Err(HostKernelError::CopyRunOverlap { run: i });
        }
    }
    for r in &runs {
        if r.bytes == 0 {
            continue;
        }
        // SAFETY: both ranges are covered by the caller, checked non-null and disjoint above.
        unsafe {
            std::ptr::copy_nonoverlapping(
                r.src as usize as *const u8,
                r.dst as usize as *mut u8,
                r.bytes as usize,
            );
        }
    }
    Ok(())
}

/// # Safety
/// See [`run_launch`].
unsafe fn run_window_gather(a: &WindowGatherArgs, fp8: bool) -> Result<()> {
    use crate::index::{FP8_NOPE_ROW_BYTES, GATHER_ROW_BYTES, ROPE_ROW_BYTES};
    let bs = count(a.num_seqs);
    if bs == 0 {
        return Ok(()); // an empty grid reads nothing (its pointers may be absent)
    }
    let rows = |width: u64, what: &'static str| len_of(what, mul(a.view_rows, width as i64, what)?);
    let out_rows = mul(bs as i64, a.draft_window.into(), "out rows")?;
    // SAFETY: lengths from the arguments; the caller covers them.
    unsafe {
        let planes = if fp8 {
            GatherPlanes::Fp8 {
                nope: input("nope", a.pool, rows(FP8_NOPE_ROW_BYTES, "nope bytes")?)?,
                rope: input("rope", a.rope, rows(ROPE_ROW_BYTES, "rope bytes")?)?,
            }
        } else {
            GatherPlanes::Bf16 { pool: input("pool", a.pool, rows(GATHER_ROW_BYTES, "pool bytes")?)? }
        };
        window_gather(
            &a.params,
            planes,
            input("state_slot_per_seq", a.state_slot_per_seq, bs)?,
            input("anchor_pos", a.anchor_pos, bs)?,
            output("out", a.out, len_of("out", mul(out_rows, GATHER_ROW_BYTES as i64, "out bytes")?)?)?,
            a.view_rows,
            a.num_seqs,
            a.draft_window,
        )
    }
}
