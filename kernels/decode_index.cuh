// decode_index.cuh — the decode index builder (docs/index-buffers.md sections 3 and 4: window
// tails, dest rows and the fused HCA heads) with its window and head writers, and the standalone
// HCA compressed-offset gather (section 4).
//
// Part of the one translation unit kernels/v4pool_kernels.cu: included there after v4pool_common.h
// and the helpers several families share, whose names it uses; never compiled on its own (no
// include guard, no includes of its own).

/// v4p_write_window past 32 bits (a ring past 2^31 positions or a position past 2^32: no V4
/// geometry), out of line: a 64-bit division per thread, then running counters.
V4P_DEVICE_COLD void v4p_write_window_wide(v4p_i32* __restrict__ out, WindowParams w, v4p_i64 slot, v4p_i64 first,
                                           v4p_i64 n, v4p_u32 lane, v4p_u32 lanes, v4p_i32* last) {
    v4p_i64 q = v4p_ring_pos(w, first + (v4p_i64)lane);
    const v4p_i64 step = (v4p_i64)lanes % w.ring_slots;
    for (v4p_i64 i = lane; i < n; i += lanes) {
        const v4p_i32 row = (v4p_i32)v4p_window_row_q(w, slot, q);
        out[i] = row;
        if (last != nullptr && i == n - 1) *last = row;
        q += step;
        if (q >= w.ring_slots) q -= w.ring_slots;
    }
}

/// Whether window_row(w, ., pos) may take 32-bit arithmetic: a ring and a stride in [1, 2^31)
/// and a position in [0, 2^32) (every V4 geometry: plane rows are i32, and the launch check
/// refuses rings below 1). The one condition of the builder's 32-bit window forms.
V4P_DEVICE bool v4p_window_fits32(WindowParams w, v4p_i64 pos) {
    return pos >= 0 && (v4p_u64)pos <= 0xffffffffull && (v4p_u64)w.ring_slots - 1 < 0x7fffffffull &&
           (v4p_u64)w.ring_stride - 1 < 0x7fffffffull;
}

/// The decode builder's window tail: out[i] = window_row(w, slot, first + i) for i < n, and
/// entry n - 1 to `*last` when not null, from the thread that computes it (so the dest row
/// costs no division of its own). 32-bit running counters (v4p_window_run32) whenever the
/// ring and the positions fit; anything wider out of line.
V4P_DEVICE void v4p_write_window(v4p_i32* __restrict__ out, WindowParams w, v4p_i64 slot, v4p_i64 first, v4p_i64 n,
                                 v4p_u32 lane, v4p_u32 lanes, v4p_i32* last) {
    if ((v4p_i64)lane >= n) return;
    const v4p_i64 pos = first + (v4p_i64)lane;  // >= 0 here: first >= 0 when n > 0
    if (!v4p_window_fits32(w, pos)) {
        v4p_write_window_wide(out, w, slot, first, n, lane, lanes, last);
        return;
    }
    v4p_window_run32(out, (v4p_u32)(slot * w.slot_rows + w.ring_start), (v4p_u32)w.ring_slots,
                     (v4p_u32)w.ring_stride, (v4p_u32)w.run_rows, (v4p_u32)pos % (v4p_u32)w.ring_slots, n, lane, lanes,
                     last);
}

/// window_row out of line: the dest row of a token whose window is empty (position < 0), and
/// v4p_window_row_fast's rows past 32 bits.
V4P_DEVICE_COLD v4p_i64 v4p_window_row_cold(WindowParams w, v4p_i64 slot, v4p_i64 pos) {
    return window_row(w, slot, pos);
}

/// Compressed entries e = 0..count-1 of one sequence, tiled: dst[e] = table[e / rpb] * envelope
/// + e % rpb. Tile `tile` of `ntiles` takes entries [tile * 8B, tile * 8B + 8B) (B = the
/// decode builder's V4POOL_DECODE_THREADS), then every ntiles-th such range after it; thread i
/// takes e = i, i + B, ..., i + 7B of its range, so every load and store instruction of a warp touches one contiguous span
/// (4-byte lanes, coalesced), and all eight table loads are in flight before the first store.
/// (block, row) of those entries come from one division and a running counter. The decode
/// builder's writer for rows per block other than 2 (v4p_write_head_vec), exact for any.
V4P_DEVICE_COLD void v4p_write_compressed_tiled(v4p_i32* __restrict__ dst, const v4p_i32* __restrict__ table,
                                                v4p_i64 count, v4p_i64 rpb, v4p_i64 envelope, v4p_i64 tile,
                                                v4p_i64 ntiles, v4p_u32 tid) {
    const v4p_i64 per_tile = 8 * V4P_DECODE_NT;
    const v4p_i64 jstep = (v4p_i64)V4P_DECODE_NT / rpb, rstep = (v4p_i64)V4P_DECODE_NT % rpb;
    for (v4p_i64 e0 = tile * per_tile + tid; e0 < count; e0 += ntiles * per_tile) {
        v4p_i64 j, r;
        if ((v4p_u64)e0 <= 0xffffffffull && (v4p_u64)rpb <= 0xffffffffull) {
            const v4p_u32 e32 = (v4p_u32)e0, d32 = (v4p_u32)rpb;
            j = (v4p_i64)(e32 / d32);
            r = (v4p_i64)(e32 - (e32 / d32) * d32);
        } else {
            j = e0 / rpb;
            r = e0 % rpb;
        }
        v4p_i32 blk[8], row[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            blk[u] = e0 + u * V4P_DECODE_NT < count ? table[j] : 0;
            row[u] = (v4p_i32)r;
            j += jstep;
            r += rstep;
            if (r >= rpb) {
                r -= rpb;
                ++j;
            }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const v4p_i64 e = e0 + u * V4P_DECODE_NT;
            if (e < count) dst[e] = (v4p_i32)compress_row(blk[u], row[u], envelope);
        }
    }
}

/// 16-byte groups (4 entries) per thread of one decode-builder tile.
#define V4P_HEAD_GROUPS (V4POOL_DECODE_HCA_TILE / (4 * V4POOL_DECODE_THREADS))
static_assert(V4P_HEAD_GROUPS % 2 == 0, "a tile is whole generic tiles of 8 entries per thread");

/// Four entries, one 16-byte store at a 16-byte aligned `p`. NVIDIA targets say so in PTX, as a
/// global store (STG.128): NVVM may split a vector store of computed values into four, and a
/// generic store is what plain `st.v4` becomes.
V4P_DEVICE void v4p_head_store4(v4p_i32* p, v4p_u32 x, v4p_u32 y, v4p_u32 z, v4p_u32 w) {
#if defined(V4P_TARGET_NVCC) || defined(V4P_TARGET_CLANG_CUDA)
    asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %0; st.global.v4.u32 [g], {%1, %2, %3, %4}; }" ::"l"(p), "r"(x),
                 "r"(y), "r"(z), "r"(w)
                 : "memory");
#else
    v4p_vec16 v;
    v.x = x, v.y = y, v.z = z, v.w = w;
#if defined(V4P_TARGET_EMU)
    if (((v4p_u64)p & 15) != 0) __builtin_trap();  // a device would fault: so must the tests
    __builtin_memcpy(p, &v, 16);                    // no type punning in the C++ emulation
#else
    *(v4p_vec16*)p = v;
#endif
#endif
}

/// Table entries j and j + 1 (`pair`: one 8-byte load, j is 8-byte aligned in the row).
V4P_DEVICE void v4p_head_load2(const v4p_i32* __restrict__ table, v4p_u32 j, bool pair, v4p_u32& a, v4p_u32& b) {
    if (pair) {
#if defined(V4P_TARGET_EMU)
        v4p_u64 v;
        if (((v4p_u64)(table + j) & 7) != 0) __builtin_trap();  // as a device's misaligned load
        __builtin_memcpy(&v, table + j, 8);
#else
        const v4p_u64 v = *(const v4p_u64*)(table + j);
#endif
        a = (v4p_u32)v, b = (v4p_u32)(v >> 32);
    } else {
        a = (v4p_u32)table[j], b = (v4p_u32)table[j + 1];
    }
}

/// The 16-byte groups of a head (see v4p_write_head_vec): group g = 4 entries at d + 4g from
/// table entries t[2g], t[2g + 1] (and t[2g + 2] when ODD: the group starts at a block's second
/// row); PAIR: t + 2g is 8-byte aligned (ODD: else t + 2g + 1 is). Per thread one pointer
/// pair, V4P_HEAD_GROUPS groups V4POOL_DECODE_THREADS apart at fixed offsets from it.
template <bool ODD, bool PAIR>
V4P_DEVICE void v4p_head_groups(v4p_i32* __restrict__ d, const v4p_i32* __restrict__ t, v4p_u32 ngroups, v4p_u32 env,
                                v4p_i64 tile, v4p_i64 ntiles, v4p_u32 tid) {
    const v4p_u64 per_tile = (v4p_u64)V4P_HEAD_GROUPS * V4P_DECODE_NT;
    for (v4p_u64 g0 = (v4p_u64)tile * per_tile + tid; g0 < ngroups; g0 += (v4p_u64)ntiles * per_tile) {
        const v4p_i32* tp = t + 2 * g0;
        v4p_i32* dp = d + 4 * g0;
        v4p_u32 a[V4P_HEAD_GROUPS], b[V4P_HEAD_GROUPS], c[V4P_HEAD_GROUPS];
#pragma unroll
        for (int k = 0; k < V4P_HEAD_GROUPS; ++k) {
            a[k] = b[k] = c[k] = 0;
            if (g0 + (v4p_u64)k * V4P_DECODE_NT >= ngroups) continue;
            const v4p_u32 o = 2 * k * V4P_DECODE_NT;
            if (!ODD || PAIR) {
                v4p_head_load2(tp, o, PAIR, a[k], b[k]);
                if (ODD) c[k] = (v4p_u32)tp[o + 2];
            } else {
                a[k] = (v4p_u32)tp[o];
                v4p_head_load2(tp, o + 1, true, b[k], c[k]);
            }
        }
#pragma unroll
        for (int k = 0; k < V4P_HEAD_GROUPS; ++k) {
            if (g0 + (v4p_u64)k * V4P_DECODE_NT >= ngroups) continue;
            v4p_i32* p = dp + 4 * k * V4P_DECODE_NT;
            if (!ODD)
                v4p_head_store4(p, a[k] * env, a[k] * env + 1, b[k] * env, b[k] * env + 1);
            else
                v4p_head_store4(p, a[k] * env + 1, b[k] * env, b[k] * env + 1, c[k] * env);
        }
    }
}

/// The decode builder's fused HCA head with 16-byte stores, for rows per block 2 (every V4
/// geometry): the slice head `dst` is cut into at most 3 leading entries up to a 16-byte
/// boundary (hbegin is arbitrary), groups of 4 entries = 2 whole or 3 partial blocks (one
/// 16-byte store from 2 or 3 table entries, one 8-byte load when aligned), and at most 3
/// trailing entries; tile 0's threads 0-2 and 4-6 write the leading and trailing ones. Tile
/// `tile` of `ntiles` (V4POOL_DECODE_HCA_TILE entries) takes V4P_HEAD_GROUPS * 128 groups,
/// thread i groups i, i + 128, ...; all table loads of a thread are issued before its first
/// store. 32-bit entry arithmetic, the i32 of the 64-bit row as the generic writer. Any other
/// rows per block, a head past 2^31 entries or an unaligned buffer take the generic writer over
/// the same tile (exact either way; out of line, off the hot path's instruction stream). Eight
/// groups (32 entries, 128 B) per thread measured fastest on the H200 (BENCHMARKS.md, issue
/// 13: T = 2,048 25.2 µs against 27.9 with four groups, 32.4 with two and 37.3 for the scalar
/// writer; level at small batches).
V4P_DEVICE void v4p_write_head_vec(v4p_i32* __restrict__ dst, const v4p_i32* __restrict__ table, v4p_i64 count64,
                                   v4p_i64 rpb, v4p_i64 envelope, v4p_i64 tile, v4p_i64 ntiles, v4p_u32 tid) {
    if (count64 <= 0) return;
    const v4p_u64 daddr = (v4p_u64)dst, taddr = (v4p_u64)table;
    if (rpb != 2 || count64 > 0x7fffffffll || ((daddr | taddr) & 3) != 0) {
        const v4p_i64 sub = V4P_HEAD_GROUPS / 2;  // generic tiles (8 entries per thread) per tile
        for (v4p_i64 s = 0; s < sub; ++s)
            v4p_write_compressed_tiled(dst, table, count64, rpb, envelope, tile * sub + s, ntiles * sub, tid);
        return;
    }
    const v4p_u32 count = (v4p_u32)count64, env = (v4p_u32)envelope;
    const v4p_u32 lead = (v4p_u32)(0 - (daddr >> 2)) & 3u;  // entries before a 16-byte boundary
    const v4p_u32 nlead = lead < count ? lead : count;
    const v4p_u32 ngroups = (count - nlead) >> 2;
    const v4p_u32 tail0 = nlead + 4 * ngroups;
    // Leading / trailing entry of this thread (tile 0 only), loaded with the groups' loads.
    v4p_u32 e1 = 0xffffffffu, blk1 = 0;
    if (tile == 0) {
        if (tid < nlead)
            e1 = tid;
        else if (tid >= 4 && tid - 4 < count - tail0)
            e1 = tail0 + (tid - 4);
        if (e1 != 0xffffffffu) blk1 = (v4p_u32)table[e1 >> 1];
    }
    // Group g covers entries lead + 4g .. lead + 4g + 3: blocks jb + 2g and jb + 2g + 1, and
    // jb + 2g + 2 when lead is odd (then the group starts at a block's second row). Both
    // choices are uniform over the block: one loop each, with no per-group branch.
    const bool odd = (lead & 1) != 0;
    const v4p_u32 jb = lead >> 1;
    const bool pair0 = ((taddr + 4 * (v4p_u64)jb) & 7) == 0;  // (jb + 2g) starts an 8-byte pair
    const v4p_i32* tb = table + jb;
    v4p_i32* db = dst + lead;
    if (!odd) {
        if (pair0)
            v4p_head_groups<false, true>(db, tb, ngroups, env, tile, ntiles, tid);
        else
            v4p_head_groups<false, false>(db, tb, ngroups, env, tile, ntiles, tid);
    } else {
        if (pair0)
            v4p_head_groups<true, true>(db, tb, ngroups, env, tile, ntiles, tid);
        else
            v4p_head_groups<true, false>(db, tb, ngroups, env, tile, ntiles, tid);
    }
    if (e1 != 0xffffffffu) dst[e1] = (v4p_i32)(blk1 * env + (e1 & 1));
}

/// Tiles of the fused HCA head in the decode builder (grid x after the window block;
/// launch_shape derives the same): enough for the longest head a block-table row can describe
/// (block_table_stride * rpb entries), at most V4POOL_MAX_GRID_YZ (the writer strides by the
/// count, so a cap loses nothing). One tile when nothing is fused.
/// FlashMLA's compressed part (index-buffers.md §3f) is written through v4p_flashmla_limit of a
/// row of extra_topk entries, in tiles of V4POOL_DECODE_FLASH_TILE (the CSR head's): the grid
/// covers the whole width (it may depend on the scalars only; tiles past a token's limit return
/// at once), in at most V4POOL_DECODE_FLASH_BLOCKS tiles over all tokens (a tile strides by the
/// count), and has the more tiles of the two (shape.rs derives the same). The cap's division in
/// 32 bits (num_tokens is an i32): every thread of every block computes it.
V4P_DEVICE v4p_i64 v4p_decode_hca_tiles(const DecodeIndexArgs& a) {
    const ClassBuffers& hca = a.classes[V4POOL_CLASS_HCA];
    if (a.block_tables == 0 || hca.indptr == 0) return 1;
    const v4p_i64 stride = a.block_table_stride > 0 ? a.block_table_stride : 0;
    const v4p_i64 rpb = a.hca_rows_per_block > 0 ? a.hca_rows_per_block : 0;
    const v4p_i64 csr = hca.indices != 0 ? stride * rpb : 0;
    const FlashMlaOut& fm = a.flashmla[V4POOL_CLASS_HCA];
    const v4p_i64 flash = fm.extra_indices != 0 && fm.extra_topk > 0 ? (v4p_i64)fm.extra_topk : 0;
    const v4p_i64 csr_tiles = (csr + V4POOL_DECODE_HCA_TILE - 1) / V4POOL_DECODE_HCA_TILE;
    v4p_i64 flash_tiles = (flash + V4POOL_DECODE_FLASH_TILE - 1) / V4POOL_DECODE_FLASH_TILE;
    const v4p_u32 tokens = a.num_tokens > 0 ? (v4p_u32)a.num_tokens : 1u;
    const v4p_i64 spread = (v4p_i64)((V4POOL_DECODE_FLASH_BLOCKS - 1u) / tokens + 1u);  // >= 1
    if (flash_tiles > spread) flash_tiles = spread;
    const v4p_i64 tiles = csr_tiles > flash_tiles ? csr_tiles : flash_tiles;
    return tiles < 1 ? 1 : (tiles > V4POOL_MAX_GRID_YZ ? V4POOL_MAX_GRID_YZ : tiles);
}

/// One entry of a FlashMLA row in every view (§3f): `row` (view-relative; negative = none) +
/// view v's shift at element (v * T + t) * width + i, -1 where there is no row. The views'
/// shifts are a handful of i32 the block reads alike (L1 broadcasts).
V4P_DEVICE void v4p_flashmla_put(v4p_i32* __restrict__ out, const v4p_i32* __restrict__ shifts, v4p_i32 views,
                                 v4p_i64 tokens, v4p_i64 t, v4p_i64 width, v4p_i64 i, v4p_i64 row) {
    for (v4p_i32 v = 0; v < views; ++v)
        out[((v4p_i64)v * tokens + t) * width + i] = row < 0 ? -1 : (v4p_i32)(row + shifts[v]);
}

/// window_row in 32-bit arithmetic where the ring and the position fit (v4p_window_fits32, as
/// v4p_write_window; one 32-bit division and remainder where window_row does three 64-bit ones),
/// window_row itself out of line past that (no V4 geometry gets there: plane rows are i32). The
/// FlashMLA window rows take one a entry. (With the head's 32-bit groups: the FlashMLA builder
/// 2-5 % shorter on an H100, 2026-12-07; the 64-bit divisions were not most of its instructions.)
V4P_DEVICE v4p_i64 v4p_window_row_fast(WindowParams w, v4p_i64 slot, v4p_i64 pos) {
    if (!v4p_window_fits32(w, pos)) return v4p_window_row_cold(w, slot, pos);
    const v4p_u32 q = (v4p_u32)pos % (v4p_u32)w.ring_slots, s = (v4p_u32)w.ring_stride;
    return slot * w.slot_rows + w.ring_start + (v4p_i64)(q / s) * w.run_rows + (v4p_i64)(q % s);
}

/// A class's FlashMLA window rows and lengths for token t (§3f), the block's lanes across the
/// row: entries i < n the window rows of positions p - n + 1 + i (oldest first), -1 to `topk`;
/// a pad (b < 0) all -1 and length 0, its HCA compressed length 0 too (the tiles write its
/// rows). `head` is the HCA head the indptr gives (written as extra_topk_length when the
/// compressed part is on).
V4P_DEVICE void v4p_flashmla_window(const FlashMlaOut& fm, WindowParams w, v4p_i64 tokens, v4p_i64 t, bool pad,
                                    v4p_i64 slot, v4p_i64 p, v4p_i64 n, v4p_i64 head, v4p_u32 tid) {
    v4p_i32* out = v4p_out<v4p_i32>(fm.indices);
    const v4p_i32* shifts = v4p_in<v4p_i32>(fm.shifts);
    for (v4p_i64 i = tid; i < fm.topk; i += V4P_DECODE_NT) {
        const v4p_i64 row = !pad && i < n ? v4p_window_row_fast(w, slot, p - n + 1 + i) : -1;
        v4p_flashmla_put(out, shifts, fm.num_views, tokens, t, fm.topk, i, row);
    }
    if (tid != 0) return;
    v4p_out<v4p_i32>(fm.topk_length)[t] = pad ? 0 : (v4p_i32)n;
    if (fm.extra_indices != 0) v4p_out<v4p_i32>(fm.extra_topk_length)[t] = pad || head < 0 ? 0 : (v4p_i32)head;
}

/// A FlashMLA compressed entry's row (view-relative; index-buffers.md §3f): -1 for a negative
/// block id, whatever the envelope (the host reference's and the 16-byte groups' rule).
V4P_DEVICE v4p_i64 v4p_flashmla_row(v4p_i64 block, v4p_i64 r, v4p_i64 envelope) {
    return block < 0 ? -1 : compress_row(block, r, envelope);
}

/// Entries of a FlashMLA compressed row written for a length of `length` (shape.rs
/// flashmla_row_limit, index-buffers.md §3f): through the first multiple of 64 (FlashMLA's
/// TOPK_BLOCK_SIZE) strictly past the length, at most the width. FlashMLA loads whole blocks of
/// 64 entries up to the (per batch entry) length and replaces any entry at or past the length
/// by -1 (splitkv_mla.cuh, MODEL1); "strictly past" leaves one -1 after the length, for an MTP
/// sibling whose HCA head is one longer and whose batch entry's length is that head.
V4P_DEVICE v4p_i64 v4p_flashmla_limit(v4p_i64 length, v4p_i64 width) {
    if (length >= width) return width;
    const v4p_i64 limit = ((length < 0 ? 0 : length) / 64 + 1) * 64;  // a negative length counts as 0
    return limit < width ? limit : width;
}

/// The FlashMLA compressed row's 16-byte groups for rows per block 2 (every V4 geometry), laid
/// out as the CSR head's (v4p_head_groups): a tile is V4POOL_DECODE_FLASH_TILE entries, thread
/// tid takes groups tid, tid + 128, ... (V4P_HEAD_GROUPS of them, 4 entries each: blocks 2g and
/// 2g + 1 of the row, one 8-byte load when PAIR), every table load of the tile before its first
/// store, then one 16-byte store a group and view. Entries e < head: table[e / 2] * env + e % 2
/// + the view's shift (-1 where the block id is negative, as the generic form); head <= e <
/// limit: -1; nothing at or past limit. `row` is view 0's row of the token, views `vstride`
/// entries apart; head <= limit <= 2^31 and limit a multiple of 4 (the caller's checks).
/// 32-bit entry arithmetic throughout, the i32 of the 64-bit row as the generic form. On an H100
/// (2026-12-07, 1,024 tokens) the FlashMLA builder took 18.4 us this way against the CSR
/// builder's 16.0, where 512-entry tiles of one group a thread took 23.9.
template <bool PAIR>
V4P_DEVICE void v4p_flashmla_head_groups(v4p_i32* __restrict__ row, v4p_u64 vstride, const v4p_i32* __restrict__ shifts,
                                         v4p_i32 views, const v4p_i32* __restrict__ table, v4p_u32 head,
                                         v4p_u32 limit, v4p_u32 env, v4p_i64 tile, v4p_i64 ntiles, v4p_u32 tid) {
    const v4p_u64 per_tile = V4POOL_DECODE_FLASH_TILE;
    for (v4p_u64 base = (v4p_u64)tile * per_tile; base < limit; base += (v4p_u64)ntiles * per_tile) {
        v4p_u32 a[V4P_HEAD_GROUPS], b[V4P_HEAD_GROUPS];
#pragma unroll
        for (int k = 0; k < V4P_HEAD_GROUPS; ++k) {
            const v4p_u32 e = (v4p_u32)base + 4 * (k * V4P_DECODE_NT + tid);
            a[k] = b[k] = 0;
            if (e >= head) continue;  // past the head: -1 or nothing, no load
            if (PAIR && e + 2 < head) {
                v4p_head_load2(table, e >> 1, true, a[k], b[k]);
            } else {
                a[k] = (v4p_u32)table[e >> 1];
                if (e + 2 < head) b[k] = (v4p_u32)table[(e >> 1) + 1];
            }
        }
        for (v4p_i32 v = 0; v < views; ++v) {
            const v4p_u32 sh = (v4p_u32)shifts[v];
            v4p_i32* out = row + (v4p_u64)v * vstride;
#pragma unroll
            for (int k = 0; k < V4P_HEAD_GROUPS; ++k) {
                const v4p_u32 e = (v4p_u32)base + 4 * (k * V4P_DECODE_NT + tid);
                if (e >= limit) continue;
                // Entry e + i holds block a (i < 2) or b, row i % 2; -1 past the head and for a
                // negative block id (a negative row, which the generic form writes as -1).
                const bool oka = (v4p_i32)a[k] >= 0, okb = (v4p_i32)b[k] >= 0;
                const v4p_u32 ra = a[k] * env + sh, rb = b[k] * env + sh, none = 0xffffffffu;
                v4p_head_store4(out + e, oka && e < head ? ra : none, oka && e + 1 < head ? ra + 1 : none,
                                okb && e + 2 < head ? rb : none, okb && e + 3 < head ? rb + 1 : none);
            }
        }
    }
}

/// Tile `tile` of `ntiles` of token t's FlashMLA compressed row (§3f; HCA): entries e < head
/// from the block table (as the CSR head: table[e / rpb] * envelope + e % rpb), -1 from head
/// to v4p_flashmla_limit(head, extra_topk), in every view; nothing past it (an earlier step's
/// entries stay: FlashMLA never loads them when the lengths are passed). A head past the row
/// is the host's error; the stores stay in the row. A pad (table == nullptr) gets -1 through
/// the first 64. Tiles past the limit return at once (the grid covers the whole width).
/// Rows per block 2 with 16-byte aligned rows take v4p_flashmla_head_groups; anything else the
/// forms below, in sub-tiles of 512 entries (4 a thread).
V4P_DEVICE void v4p_flashmla_head(const FlashMlaOut& fm, const v4p_i32* __restrict__ table, v4p_i64 head, v4p_i64 rpb,
                                  v4p_i64 envelope, v4p_i64 tokens, v4p_i64 t, v4p_i64 tile, v4p_i64 ntiles,
                                  v4p_u32 tid) {
    v4p_i32* out = v4p_out<v4p_i32>(fm.extra_indices);
    const v4p_i32* shifts = v4p_in<v4p_i32>(fm.shifts);
    const v4p_i64 width = fm.extra_topk;
    const v4p_i64 limit = v4p_flashmla_limit(table != nullptr ? head : 0, width);
    // 16-byte stores where every row of every view starts 16-byte aligned (FlashMLA's widths are
    // multiples of 64, so its rows are). The limit is then a multiple of 4 (of 64, or the
    // width), so a group is all in or all out.
    const bool vec = ((v4p_u64)out & 15) == 0 && width % 4 == 0;
    if (vec && rpb == 2 && ((v4p_u64)table & 3) == 0 && (v4p_u64)envelope <= 0xffffffffull) {
        const v4p_i64 h = table == nullptr || head < 0 ? 0 : (head < limit ? head : limit);
        v4p_i32* row = out + t * width;
        const v4p_u64 vstride = (v4p_u64)tokens * (v4p_u64)width;
        if (((v4p_u64)table & 7) == 0)
            v4p_flashmla_head_groups<true>(row, vstride, shifts, fm.num_views, table, (v4p_u32)h, (v4p_u32)limit,
                                           (v4p_u32)envelope, tile, ntiles, tid);
        else
            v4p_flashmla_head_groups<false>(row, vstride, shifts, fm.num_views, table, (v4p_u32)h, (v4p_u32)limit,
                                            (v4p_u32)envelope, tile, ntiles, tid);
        return;
    }
    constexpr v4p_i64 small = 4 * V4P_DECODE_NT;  // a sub-tile: 4 entries a thread
    constexpr v4p_i64 subs = V4POOL_DECODE_FLASH_TILE / small;
    constexpr int per = 4;
    const v4p_i64 stride = ntiles * V4POOL_DECODE_FLASH_TILE;
    if (vec) {
        // Thread tid writes entries 4 tid .. 4 tid + 3 of a sub-tile, a warp 512 contiguous bytes
        // a store; one 32-bit division a group.
        for (v4p_i64 tbase = tile * V4POOL_DECODE_FLASH_TILE; tbase < limit; tbase += stride) {
            for (v4p_i64 s = 0; s < subs; ++s) {
                const v4p_i64 i0 = tbase + s * small + (v4p_i64)per * tid;
                if (i0 >= limit) break;  // later sub-tiles start further out
                v4p_i64 rows[per];
                // (block, row) of entry i0 in 32 bits: 0 <= i0 < width and rpb are i32 arguments.
                v4p_i64 j = 0, r = 0;
                if (rpb > 0) {
                    const v4p_u32 a32 = (v4p_u32)i0, d32 = (v4p_u32)rpb, q32 = a32 / d32;
                    j = q32, r = a32 - q32 * d32;
                }
#pragma unroll
                for (int k = 0; k < per; ++k) {
                    rows[k] = table != nullptr && i0 + k < head ? v4p_flashmla_row(table[j], r, envelope) : -1;
                    if (++r == rpb) r = 0, ++j;
                }
                for (v4p_i32 v = 0; v < fm.num_views; ++v) {
                    const v4p_i32 sh = shifts[v];
                    v4p_u32 w[per];
#pragma unroll
                    for (int k = 0; k < per; ++k) w[k] = rows[k] < 0 ? 0xffffffffu : (v4p_u32)(rows[k] + sh);
                    v4p_head_store4(out + ((v4p_i64)v * tokens + t) * width + i0, w[0], w[1], w[2], w[3]);
                }
            }
        }
        return;
    }
    for (v4p_i64 tbase = tile * V4POOL_DECODE_FLASH_TILE; tbase < limit; tbase += stride) {
        for (v4p_i64 s = 0; s < subs; ++s) {
            const v4p_i64 base = tbase + s * small;
            if (base >= limit) break;
            // The thread's entries base + tid + k * NT: every table load first, then the stores.
            v4p_i64 rows[per];
#pragma unroll
            for (int k = 0; k < per; ++k) {
                const v4p_i64 i = base + tid + (v4p_i64)k * V4P_DECODE_NT;
                rows[k] = table != nullptr && i < head && i < width
                              ? v4p_flashmla_row(table[i / rpb], i % rpb, envelope)
                              : -1;
            }
#pragma unroll
            for (int k = 0; k < per; ++k) {
                const v4p_i64 i = base + tid + (v4p_i64)k * V4P_DECODE_NT;
                if (i < limit) v4p_flashmla_put(out, shifts, fm.num_views, tokens, t, width, i, rows[k]);
            }
        }
    }
}

// ---- §3 + §4: decode index builder with fused HCA heads --------------------------------------
// grid (1 + v4p_decode_hca_tiles, T), block V4POOL_DECODE_THREADS (128). Token t is grid y; its
// blocks are side by side in grid x, so they are dispatched together and share the token's
// metadata lines in L2: x = 0 writes the window tails and dest rows, x = 1 + k tile k of
// 4,096 entries of the HCA head (two tiles for a 1M context; FlashMLA's compressed rows in
// tiles of the same size: the grid has the more tiles of the two). The windows in a
// block of their own run beside the head instead of before it: in one block, the head's table
// loads waited for batch id -> state slot -> window stores. (H200 A/B, BENCHMARKS.md 2026-11-30 23:06 UTC:
// batch 256 8.29 -> 6.78 µs, 1,024 15.36 -> 12.64, MTP verify 2,048 25.09 -> 19.28; 128-thread
// blocks at 8 per SM keep twice the tokens' dependent chains in flight of the 256-thread form.)

extern "C" __global__ V4P_LAUNCH_BOUNDS_MIN(V4POOL_DECODE_THREADS, 8) void v4pool_decode_indices(DecodeIndexArgs a) {
    v4p_overlap_begin();  // before any global access (launched as a dependent)
    const v4p_i32 t = (v4p_i32)v4p_bid_y();
    if (t >= a.num_tokens) return;
    const v4p_u32 x = v4p_bid_x();
    const v4p_u32 tid = v4p_tid_x();
    // Every load that needs only t goes out before the batch id comes back (a cold chain
    // batch id -> slot / table row is the kernel's critical path).
    const v4p_i32 b = v4p_in<v4p_i32>(a.batch_id_per_token)[t];
    const v4p_i64 p = v4p_in<v4p_i64>(a.positions)[t];
    const v4p_i64 n = v4p_min(p + 1, (v4p_i64)a.win);  // window entries: the tail of every slice
    if (x == 0) {
        v4p_i64 ends[3] = {0, 0, 0};
#pragma unroll
        for (int c = 0; c < 3; ++c)
            if (a.classes[c].indptr != 0) ends[c] = v4p_in<v4p_i32>(a.classes[c].indptr)[t + 1];
        // FlashMLA rows (§3f) are written for pads too: a captured grid runs FlashMLA over every
        // row, so a pad's row must say "nothing" (-1, length 0) whatever an earlier step left.
        const FlashMlaOut& fh = a.flashmla[V4POOL_CLASS_HCA];
        const v4p_i64 hhead = fh.extra_indices != 0 && b >= 0
                                  ? ends[V4POOL_CLASS_HCA] - v4p_in<v4p_i32>(a.classes[V4POOL_CLASS_HCA].indptr)[t] - n
                                  : 0;
        if (b < 0) {  // pad token: no CSR store at all
#pragma unroll
            for (int c = 0; c < 3; ++c)
                if (a.flashmla[c].indices != 0)
                    v4p_flashmla_window(a.flashmla[c], a.classes[c].params, a.num_tokens, t, true, 0, p, 0, 0, tid);
            return;
        }
        const v4p_i64 slot = v4p_in<v4p_i32>(a.state_slot_per_seq)[b];
#pragma unroll
        for (int c = 0; c < 3; ++c) {
            const ClassBuffers cb = a.classes[c];
            if (cb.indptr == 0) continue;  // class off
            // Window at the tail of the slice, oldest first, the token itself last (its row is
            // the dest row). Without a CSR buffer (FlashMLA only) the dest row is computed alone.
            v4p_i32* dest = cb.dest_rows != 0 ? v4p_out<v4p_i32>(cb.dest_rows) + t : nullptr;
            if (cb.indices != 0) {
                v4p_write_window(v4p_out<v4p_i32>(cb.indices) + (ends[c] - n), cb.params, slot, p - n + 1, n, tid,
                                 V4P_DECODE_NT, dest);
                if (tid == 0 && dest != nullptr && n <= 0) *dest = (v4p_i32)v4p_window_row_cold(cb.params, slot, p);
            } else if (tid == 0 && dest != nullptr) {
                *dest = (v4p_i32)window_row(cb.params, slot, p);
            }
            if (a.flashmla[c].indices != 0)
                v4p_flashmla_window(a.flashmla[c], cb.params, a.num_tokens, t, false, slot, p, n,
                                    c == V4POOL_CLASS_HCA ? hhead : 0, tid);
        }
        return;
    }
    const ClassBuffers hca = a.classes[V4POOL_CLASS_HCA];
    if (a.block_tables == 0 || hca.indptr == 0) return;  // nothing fused
    const v4p_i64 hbegin = v4p_in<v4p_i32>(hca.indptr)[t];
    const v4p_i64 hend = v4p_in<v4p_i32>(hca.indptr)[t + 1];
    const FlashMlaOut& fh = a.flashmla[V4POOL_CLASS_HCA];
    const v4p_i32* table = b >= 0 ? v4p_in<v4p_i32>(a.block_tables) + (v4p_i64)b * a.block_table_stride : nullptr;
    const v4p_i64 tiles = v4p_decode_hca_tiles(a);  // the grid's tile count, for both writers' strides
    if (fh.extra_indices != 0)  // pads included: their rows are -1
        v4p_flashmla_head(fh, table, hend - hbegin - n, a.hca_rows_per_block, a.envelope_rows, a.num_tokens, t,
                          (v4p_i64)x - 1, tiles, tid);
    if (b < 0 || hca.indices == 0) return;
    // Compressed entries 0..head-1 at the head of the slice, ascending; this block's tile.
    v4p_write_head_vec(v4p_out<v4p_i32>(hca.indices) + hbegin, table, hend - hbegin - n, a.hca_rows_per_block,
                       a.envelope_rows, (v4p_i64)x - 1, tiles, tid);
}

// ---- §4: HCA compressed offsets as a standalone gather -----------------------------------
// grid (ceil(N / 256)), block 256: one thread per entry.

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_hca_offsets(HcaOffsetsArgs a) {
    v4p_overlap_begin();  // before any global access (launched as a dependent)
    const v4p_i64 i = (v4p_i64)v4p_bid_x() * V4P_BLOCK + v4p_tid_x();
    if (i >= a.num_entries) return;
    const v4p_i32 e = v4p_in<v4p_i32>(a.entry_idx)[i];
    const v4p_i32 b = v4p_in<v4p_i32>(a.bid_per_entry)[i];
    const v4p_i32 rpb = a.rows_per_block;
    const v4p_i64 blk = v4p_in<v4p_i32>(a.block_tables)[(v4p_i64)b * a.block_table_stride + e / rpb];
    v4p_out<v4p_i32>(a.out)[i] = (v4p_i32)compress_row(blk, e % rpb, a.envelope_rows);
}
