// v4pool_kernels.cu — every v4pool kernel, one source for CUDA (nvcc, NVRTC, clang -x cuda)
// and HIP (clang -x hip, hiprtc). The contract is docs/index-buffers.md; the host
// reference of each kernel is src/index/host.rs and the launch shapes src/index/shape.rs.
//
// Every kernel is `extern "C"`, named as `Launch::SYMBOLS` in src/index/mod.rs, and takes its
// argument struct by value as its only parameter. Grids never depend on data the host does not
// have: a launch with nothing to do runs one block that returns at once.
//
// Performance notes (H200 profiles and the measured alternatives in BENCHMARKS.md). At the
// sizes of a decode step or a 128K prefill these kernels wait on chains of dependent loads
// (token -> batch id -> sequence values / table row -> table entries), with a cold L2 each a
// DRAM round trip; at 1M contexts the prefill builder is issue-bound. So loads that need only
// the token go out before the batch id returns, each thread keeps several independent loads
// in flight (8 per thread in the prefill HCA heads, 16 in the decode builder's), and long
// per-token work is tiled over grid y or over lanes. The prefill builder writes 16-byte groups
// of four entries, issues every load of a round before any store (a store may alias a later
// load, so the compiler would otherwise wait for it) and works in 32-bit without per-entry
// division; the decode builder's HCA heads, the bulk of its bytes, are 16-byte stores of four
// entries, 32 entries per thread (at batch 1,024 and the MTP verify step 1.4-1.5x faster than
// 4-byte stores of 8 per thread), 32-bit and division-free. Window loops carry quotients as
// running counters instead of dividing (the divisions were most of the prefill builder's
// instructions before). The index builders begin with v4p_overlap_begin(): the CUDA backend
// launches them as programmatic dependents, so a graph of per-layer packs overlaps each launch
// with the kernel before it (the CSA pack's decode form also its loads of everything but
// the top-k: §5 below). Other stores of consecutive entries are coalesced 4-byte stores
// across a warp; every row x width product of a plane address is 64-bit.
#include "v4pool_common.h"

#define V4P_BLOCK V4POOL_BLOCK_THREADS
#define V4P_DECODE_NT V4POOL_DECODE_THREADS

V4P_DEVICE v4p_i64 v4p_min(v4p_i64 a, v4p_i64 b) { return a < b ? a : b; }
V4P_DEVICE v4p_i64 v4p_max(v4p_i64 a, v4p_i64 b) { return a > b ? a : b; }
V4P_DEVICE v4p_u32 v4p_min32(v4p_u32 a, v4p_u32 b) { return a < b ? a : b; }
V4P_DEVICE v4p_u32 v4p_max32(v4p_u32 a, v4p_u32 b) { return a > b ? a : b; }

template <typename T>
V4P_DEVICE const T* v4p_in(v4p_ptr p) {
    return (const T*)p;
}
template <typename T>
V4P_DEVICE T* v4p_out(v4p_ptr p) {
    return (T*)p;
}

/// Divide a non-negative `n` by a positive `d`: 32-bit when both fit (they do for every
/// valid geometry: ring positions, strides, table columns), 64-bit otherwise.
V4P_DEVICE void v4p_divmod(v4p_i64 n, v4p_i64 d, v4p_i64& quot, v4p_i64& rem) {
    if ((v4p_u64)n <= 0xffffffffull && (v4p_u64)d <= 0xffffffffull) {
        const v4p_u32 n32 = (v4p_u32)n, d32 = (v4p_u32)d, q32 = n32 / d32;
        quot = (v4p_i64)q32;
        rem = (v4p_i64)(n32 - q32 * d32);
    } else {
        quot = n / d;
        rem = n % d;
    }
}

/// An entry count as u32: negative counts are none (a slice shorter than its window).
V4P_DEVICE v4p_u32 v4p_count32(v4p_i64 n) { return n <= 0 ? 0u : (n > 0x7fffffffll ? 0x7fffffffu : (v4p_u32)n); }

/// `window_row_at` with the fast division.
V4P_DEVICE v4p_i64 v4p_window_row_q(WindowParams w, v4p_i64 slot, v4p_i64 q) {
    v4p_i64 chunk, within;
    v4p_divmod(q, w.ring_stride, chunk, within);
    return slot * w.slot_rows + w.ring_start + chunk * w.run_rows + within;
}

/// Ring position of absolute position `pos` (Euclidean, as `window_row`).
V4P_DEVICE v4p_i64 v4p_ring_pos(WindowParams w, v4p_i64 pos) {
    if (pos >= 0) {
        v4p_i64 quot, rem;
        v4p_divmod(pos, w.ring_slots, quot, rem);
        return rem;
    }
    v4p_i64 q = pos % w.ring_slots;
    return q < 0 ? q + w.ring_slots : q;
}

/// out[i] = window_row(w, slot, first + i) for i < n, `lanes` threads striding over i from
/// `lane`. One ring position (and its run and offset in the run) per thread from a division,
/// then running counters: a window is at most ring_slots long, so one subtraction wraps the
/// position, and the run/offset pair is carried like a two-digit counter (recomputed on the
/// rare wrap). The prefill builder was issue-bound on this loop: with a division per entry it
/// cost ~80 instructions an entry (three windows per token), now ~10. Rows are computed in
/// wrapping 32-bit arithmetic: the buffer holds the i32 of the 64-bit row (the host reference
/// rejects a row that does not fit), which is its low 32 bits. Rings past 2^31 positions (no
/// V4 geometry) take the 64-bit division per entry.
/// The 32-bit body of the window writers: out[i] for i = lane, lane + lanes, ... < n, from the
/// ring position q of entry `lane` (q < slots) and the ring's 32-bit geometry; entry n - 1 also
/// to `*last` when `last` is not null (the decode builder's dest row, the token's own row).
V4P_DEVICE void v4p_window_run32(v4p_i32* __restrict__ out, v4p_u32 base, v4p_u32 slots, v4p_u32 stride, v4p_u32 run,
                                 v4p_u32 q, v4p_i64 n, v4p_u32 lane, v4p_u32 lanes, v4p_i32* last = nullptr) {
    v4p_u32 c = q / stride, r = q - c * stride;
    const v4p_u32 step = lanes % slots;
    const v4p_u32 sc = step / stride, sr = step - sc * stride;
    for (v4p_i64 i = lane; i < n; i += lanes) {
        out[i] = (v4p_i32)(base + c * run + r);
        if (last != nullptr && i == n - 1) *last = (v4p_i32)(base + c * run + r);
        q += step;
        c += sc;
        r += sr;
        if (r >= stride) {
            r -= stride;
            ++c;
        }
        if (q >= slots) {
            q -= slots;
            c = q / stride;
            r = q - c * stride;
        }
    }
}

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

/// The decode builder's window tail: out[i] = window_row(w, slot, first + i) for i < n, and
/// entry n - 1 to `*last` when not null, from the thread that computes it (so the dest row
/// costs no division of its own). 32-bit running counters (v4p_window_run32) whenever the
/// ring and the positions fit; anything wider out of line.
V4P_DEVICE void v4p_write_window(v4p_i32* __restrict__ out, WindowParams w, v4p_i64 slot, v4p_i64 first, v4p_i64 n,
                                 v4p_u32 lane, v4p_u32 lanes, v4p_i32* last) {
    if ((v4p_i64)lane >= n) return;
    const v4p_u64 pos = (v4p_u64)(first + (v4p_i64)lane);  // >= 0 here: first >= 0 when n > 0
    if ((v4p_u64)w.ring_slots > 0x7fffffffull || (v4p_u64)w.ring_stride > 0x7fffffffull || pos > 0xffffffffull) {
        v4p_write_window_wide(out, w, slot, first, n, lane, lanes, last);
        return;
    }
    v4p_window_run32(out, (v4p_u32)(slot * w.slot_rows + w.ring_start), (v4p_u32)w.ring_slots,
                     (v4p_u32)w.ring_stride, (v4p_u32)w.run_rows, (v4p_u32)pos % (v4p_u32)w.ring_slots, n, lane, lanes,
                     last);
}

/// window_row out of line: the dest row of a token whose window is empty (position < 0).
V4P_DEVICE_COLD v4p_i32 v4p_window_row_cold(WindowParams w, v4p_i64 slot, v4p_i64 pos) {
    return (v4p_i32)window_row(w, slot, pos);
}

/// v4p_write_window for the prefill builder, without the 64-bit paths (their division
/// subroutine set the kernel's register count): positions there are i32 and the first is
/// >= 0 (low), check_launch holds ring_slots to [1, 2^31 - 1], and a ring_stride past
/// 2^32 - 1 leaves every position in run 0, as its clamp to 2^32 - 1 does.
V4P_DEVICE void v4p_write_window_prefill(v4p_i32* __restrict__ out, WindowParams w, v4p_i64 slot, v4p_u32 first,
                                         v4p_i64 n, v4p_u32 lane, v4p_u32 lanes) {
    if ((v4p_i64)lane >= n) return;
    const v4p_u32 slots = (v4p_u32)w.ring_slots;
    const v4p_u32 stride = w.ring_stride > 0xffffffffll ? 0xffffffffu : (v4p_u32)w.ring_stride;
    v4p_window_run32(out, (v4p_u32)(slot * w.slot_rows + w.ring_start), slots, stride, (v4p_u32)w.run_rows,
                     (first + lane) % slots, n, lane, lanes);
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
V4P_DEVICE v4p_i64 v4p_decode_hca_tiles(const DecodeIndexArgs& a) {
    if (a.block_tables == 0 || a.classes[V4POOL_CLASS_HCA].indptr == 0) return 1;
    const v4p_i64 stride = a.block_table_stride > 0 ? a.block_table_stride : 0;
    const v4p_i64 rpb = a.hca_rows_per_block > 0 ? a.hca_rows_per_block : 0;
    const v4p_i64 tiles = (stride * rpb + V4POOL_DECODE_HCA_TILE - 1) / V4POOL_DECODE_HCA_TILE;
    return tiles < 1 ? 1 : (tiles > V4POOL_MAX_GRID_YZ ? V4POOL_MAX_GRID_YZ : tiles);
}

/// Copy `bytes` from src to dst with `nlanes` lanes: 16 B at a time when both ends and the
/// length allow it, else 4 B, else bytes.
V4P_DEVICE void v4p_copy_row(v4p_u64 dst, v4p_u64 src, v4p_u64 bytes, v4p_u32 lane, v4p_u32 nlanes) {
    const v4p_u64 all = dst | src | bytes;
    if ((all & 15) == 0) {
        v4p_vec16* d = (v4p_vec16*)dst;
        const v4p_vec16* s = (const v4p_vec16*)src;
        for (v4p_u64 u = lane; u < bytes / 16; u += nlanes) d[u] = s[u];
    } else if ((all & 3) == 0) {
        v4p_u32* d = (v4p_u32*)dst;
        const v4p_u32* s = (const v4p_u32*)src;
        for (v4p_u64 u = lane; u < bytes / 4; u += nlanes) d[u] = s[u];
    } else {
        v4p_u8* d = (v4p_u8*)dst;
        const v4p_u8* s = (const v4p_u8*)src;
        for (v4p_u64 u = lane; u < bytes; u += nlanes) d[u] = s[u];
    }
}

/// Row `src_row` of one plane's kv to row `dst_row` of its pool view; absent plane: nothing.
V4P_DEVICE void v4p_copy_plane(PlaneWrite pw, v4p_i64 src_row, v4p_i64 dst_row, v4p_u32 lane) {
    if (pw.pool == 0) return;
    v4p_copy_row(pw.pool + row_byte_offset(dst_row, pw.row_bytes), pw.kv + row_byte_offset(src_row, pw.row_bytes),
                 (v4p_u64)pw.row_bytes, lane, V4POOL_ROW_LANES);
}

// ---- §3 + §4: decode index builder with fused HCA heads --------------------------------------
// grid (1 + v4p_decode_hca_tiles, T), block V4POOL_DECODE_THREADS (128). Token t is grid y; its
// blocks are side by side in grid x, so they are dispatched together and share the token's
// metadata lines in L2: x = 0 writes the window tails and dest rows, x = 1 + k tile k of
// 4,096 entries of the HCA head (two tiles for a 1M context). The windows in a block of their
// own run beside the head instead of before it: in one block, the head's table loads waited
// for batch id -> state slot -> window stores. (H200 A/B, BENCHMARKS.md 2026-11-30 23:06 UTC:
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
        if (b < 0) return;  // pad token: no store at all
        const v4p_i64 slot = v4p_in<v4p_i32>(a.state_slot_per_seq)[b];
#pragma unroll
        for (int c = 0; c < 3; ++c) {
            const ClassBuffers cb = a.classes[c];
            if (cb.indptr == 0) continue;  // class off
            // Window at the tail of the slice, oldest first, the token itself last (its row is
            // the dest row).
            v4p_i32* dest = cb.dest_rows != 0 ? v4p_out<v4p_i32>(cb.dest_rows) + t : nullptr;
            v4p_write_window(v4p_out<v4p_i32>(cb.indices) + (ends[c] - n), cb.params, slot, p - n + 1, n, tid,
                             V4P_DECODE_NT, dest);
            if (tid == 0 && dest != nullptr && n <= 0) *dest = v4p_window_row_cold(cb.params, slot, p);
        }
        return;
    }
    const ClassBuffers hca = a.classes[V4POOL_CLASS_HCA];
    if (a.block_tables == 0 || hca.indptr == 0) return;  // nothing fused
    const v4p_i64 hbegin = v4p_in<v4p_i32>(hca.indptr)[t];
    const v4p_i64 hend = v4p_in<v4p_i32>(hca.indptr)[t + 1];
    if (b < 0) return;
    // Compressed entries 0..head-1 at the head of the slice, ascending; this block's tile.
    const v4p_i32* table = v4p_in<v4p_i32>(a.block_tables) + (v4p_i64)b * a.block_table_stride;
    v4p_write_head_vec(v4p_out<v4p_i32>(hca.indices) + hbegin, table, hend - hbegin - n, a.hca_rows_per_block,
                       a.envelope_rows, (v4p_i64)x - 1, v4p_decode_hca_tiles(a), tid);
}

// ---- §6: prefill index builder -----------------------------------------------------------
// grid (ceil(T / (256 / lanes))), block 256: `lanes` threads per token, the rest of the block
// other tokens; lanes = V4POOL_PREFILL_LANES (64), or V4POOL_PREFILL_SHORT_LANES (16) when
// no HCA head can pass V4POOL_PREFILL_SHORT_HEAD entries (block_table_stride x rows per
// block; launch_shape picks, the two kernels are one template). Short heads are latency- and
// prologue-bound (16 lanes: four times the tokens resident, a quarter of the warps); long ones
// want every lane's loads in flight (64 lanes: a 128K token's 1,024 entries are one round).
// Fewer instructions per written entry than a 4-byte store each: the extend run and the HCA
// compressed head (all of a 128K/1M token's bytes but the window) go out as 16-byte stores of
// four entries, peeled to the slice's 16-byte alignment (a scalar head and tail of at most
// three entries each); rows per block 2 and 1 (every V4 geometry) take a group of four from
// two or three table loads without division (SASS: ~2.4 instructions per HCA entry, ~8 for
// the scalar writer); the per-token arithmetic is 32-bit. Windows (written only by a chunk's
// first win-1 tokens) use the running-counter writer. No barrier and no cross-lane exchange
// (the host emulation runs threads one after another).

/// Groups g = lane, lane + LANES, ... below `groups` of a 16-byte-aligned run v: `four(g)`
/// gives group g's four entries. U groups per thread per round, every load of a round before
/// its first store (the loads of a round in flight together), no per-group guard but in the
/// last rounds.
template <v4p_u32 LANES, int U, typename Four>
V4P_DEVICE void v4p_groups(v4p_vec16* __restrict__ v, v4p_u32 groups, v4p_u32 lane, Four four) {
#if defined(V4P_TARGET_EMU)
    if (groups != 0 && ((v4p_u64)v & 15) != 0) __builtin_trap();  // a device would fault: so must the tests
#endif
    v4p_u32 g = lane;
    for (; g + (U - 1) * LANES < groups; g += U * LANES) {
        v4p_vec16 x[U];
#pragma unroll
        for (int u = 0; u < U; ++u) x[u] = four(g + (v4p_u32)u * LANES);
#pragma unroll
        for (int u = 0; u < U; ++u) v[g + (v4p_u32)u * LANES] = x[u];
    }
    for (; g < groups; g += LANES) v[g] = four(g);
}

/// The split of a run dst[0..n) at 16-byte boundaries: `head` scalar entries up to the first
/// boundary, `groups` groups of four, the rest scalar from `tail`.
struct V4pRun16 {
    v4p_u32 head, groups, tail;
    V4P_DEVICE V4pRun16(const v4p_i32* dst, v4p_u32 n) {
        head = (4u - (v4p_u32)(((v4p_u64)dst >> 2) & 3u)) & 3u;
        if (head > n) head = n;
        groups = (n - head) >> 2;
        tail = head + 4 * groups;
    }
};

/// The compressed head dst[j] = table[j / rpb] * envelope + j % rpb, j < n (§4), in 16-byte
/// stores. Rows per block 2 (block 256, every V4 geometry) and 1 are compile-time: a group's
/// first entry has the parity of the run's scalar head for every group (4 is even), so a group
/// is two table loads (even) or three (odd) at consecutive columns and no division; any other
/// `rpb` takes a running (block, row) pair per entry.
/// A head run's scalar entries (each lane at most one of the lead and one of the tail), with
/// the division of rows per block `dd` (a constant where inlined).
V4P_DEVICE void v4p_head_ends(v4p_i32* dst, const v4p_i32* table, const V4pRun16& s, v4p_u32 n, v4p_u32 dd,
                              v4p_u32 env, v4p_u32 lane) {
    const v4p_u32 k = s.tail + lane;
    if (lane < s.head) dst[lane] = (v4p_i32)((v4p_u32)table[lane / dd] * env + lane % dd);
    if (k < n) dst[k] = (v4p_i32)((v4p_u32)table[k / dd] * env + k % dd);
}

/// Four consecutive head entries at rows per block 2, from table columns x0, x1 (and x2 when
/// the group starts on an odd entry): (x0 r0, x0 r1, x1 r0, x1 r1) or (x0 r1, x1 r0, x1 r1, x2 r0).
V4P_DEVICE v4p_vec16 v4p_rpb2_group(bool odd, v4p_u32 x0, v4p_u32 x1, v4p_u32 x2, v4p_u32 env) {
    const v4p_u32 b0 = x0 * env, b1 = x1 * env;
    return odd ? v4p_vec16{b0 + 1, b1, b1 + 1, x2 * env} : v4p_vec16{b0, b0 + 1, b1, b1 + 1};
}

template <v4p_u32 LANES>
V4P_DEVICE void v4p_head_by16(v4p_i32* __restrict__ dst, const v4p_i32* __restrict__ table, v4p_u32 n, v4p_u32 rpb,
                              v4p_u32 env, v4p_u32 lane) {
    const V4pRun16 s(dst, n);
    v4p_vec16* v = (v4p_vec16*)(dst + s.head);
    const v4p_u32 d = rpb;
    auto ends = [&](v4p_u32 dd) { v4p_head_ends(dst, table, s, n, dd, env, lane); };
    if (d == 2) {
        ends(2);
        const v4p_i32* tq = table + (s.head >> 1);  // group g starts at column 2g of tq
        if (s.head & 1) {
            v4p_groups<LANES, 4>(v, s.groups, lane, [&](v4p_u32 g) {
                const v4p_i32* c = tq + 2 * g;
                return v4p_rpb2_group(true, (v4p_u32)c[0], (v4p_u32)c[1], (v4p_u32)c[2], env);
            });
        } else {
            v4p_groups<LANES, 4>(v, s.groups, lane, [&](v4p_u32 g) {
                const v4p_i32* c = tq + 2 * g;  // no third column: it may lie past the row
                return v4p_rpb2_group(false, (v4p_u32)c[0], (v4p_u32)c[1], 0, env);
            });
        }
    } else if (d == 1) {
        ends(1);
        const v4p_i32* tq = table + s.head;
        v4p_groups<LANES, 2>(v, s.groups, lane, [&](v4p_u32 g) {
            const v4p_i32* c = tq + 4 * g;
            return v4p_vec16{(v4p_u32)c[0] * env, (v4p_u32)c[1] * env, (v4p_u32)c[2] * env, (v4p_u32)c[3] * env};
        });
    } else {
        ends(d);
        v4p_groups<LANES, 2>(v, s.groups, lane, [&](v4p_u32 g) {
            const v4p_u32 j = s.head + 4 * g;
            v4p_u32 q = j / d, r = j - q * d, e[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                e[i] = (v4p_u32)table[q] * env + r;
                if (++r == d) {
                    r = 0;
                    ++q;
                }
            }
            return v4p_vec16{e[0], e[1], e[2], e[3]};
        });
    }
}

/// A token's head to write: dst[0..n) from `table` (the sequence's block-table row); n = 0
/// for none. `b` is the token's sequence (two tokens of one sequence share `table`).
struct V4pHead {
    v4p_i32* dst;
    const v4p_i32* table;
    v4p_u32 n;
    v4p_i32 b;
};

V4P_DEVICE V4pHead v4p_no_head() { return V4pHead{nullptr, nullptr, 0, -1}; }

/// Token t's extend run, windows (SWA / CSA / HCA) and the place of its HCA compressed head.
template <v4p_u32 LANES>
V4P_DEVICE V4pHead v4p_prefill_token(const PrefillIndexArgs& a, v4p_i64 t, v4p_u32 lane) {
    const V4pHead none = v4p_no_head();
    // Everything that needs only t, then the sequence's values.
    const v4p_i32 b = v4p_in<v4p_i32>(a.bid_per_token)[t];
    const v4p_i32 p32 = v4p_in<v4p_i32>(a.positions)[t];
    const v4p_i64 ext_at = v4p_in<v4p_i32>(a.extend_indptr)[t];
    const v4p_i64 swa_at = a.swa_indptr != 0 ? (v4p_i64)v4p_in<v4p_i32>(a.swa_indptr)[t] : 0;
    const v4p_i64 csa_end = v4p_in<v4p_i32>(a.csa_indptr)[t + 1];
    // The coarse slice's window goes at its start ([window | compressed], V4) or, packed per
    // layer, at its tail as the fine slot's ([head | window], V4.1).
    const v4p_i64 hca_at = v4p_in<v4p_i32>(a.hca_indptr)[t + (a.coarse_packed != 0 ? 1 : 0)];
    if (b < 0) return none;  // prefill has no pads; a negative id would be a wild read
    const v4p_i64 cs = v4p_in<v4p_i32>(a.chunk_start_per_seq)[b];
    const v4p_i64 cu = v4p_in<v4p_i32>(a.cu_seqlens_q_per_seq)[b];
    const v4p_i64 committed = v4p_in<v4p_i32>(a.n_committed_hca_per_seq)[b];
    const v4p_i64 slot = v4p_in<v4p_i32>(a.state_slot_per_seq)[b];
    const v4p_i32* table = v4p_in<v4p_i32>(a.block_tables) + (v4p_i64)b * a.block_table_stride;
    const v4p_i64 p = p32;
    // (p+1) / hca_ratio (check_launch: ratio >= 1): unsigned for every valid input (p >= 0), C
    // division otherwise, as the host reference; 32-bit either way (p is an i32).
    const v4p_i64 by_pos = p32 >= -1 ? (v4p_i64)((v4p_u32)(p32 + 1) / (v4p_u32)a.hca_ratio)
                                     : (v4p_i64)((p32 + 1) / a.hca_ratio);
    const v4p_i64 win = a.win;
    const v4p_i64 in_chunk = p - cs;
    const v4p_i64 low = v4p_max(p - win + 1, 0);
    const v4p_u32 ext = v4p_count32(v4p_min(in_chunk + 1, win));
    const v4p_i64 pre = v4p_max(cs - low, 0);
    const v4p_u32 nh = a.coarse_packed != 0 ? 0u : v4p_count32(v4p_min(by_pos, committed));
    // extend: the ext most recent in-chunk tokens' rows in this forward's K, oldest first.
    {
        v4p_i32* dst = v4p_out<v4p_i32>(a.extend_indices) + ext_at;
        const v4p_u32 first = (v4p_u32)(cu + in_chunk - (v4p_i64)ext + 1);
        const V4pRun16 s(dst, ext);
        if (lane < s.head) dst[lane] = (v4p_i32)(first + lane);
        if (s.tail + lane < ext) dst[s.tail + lane] = (v4p_i32)(first + s.tail + lane);
        const v4p_u32 f = first + s.head;
        v4p_groups<LANES, 1>((v4p_vec16*)(dst + s.head), s.groups, lane, [&](v4p_u32 g) {
            const v4p_u32 e = f + 4 * g;
            return v4p_vec16{e, e + 1, e + 2, e + 3};
        });
    }
    v4p_i32* out = v4p_out<v4p_i32>(a.hca_indices) + (a.coarse_packed != 0 ? hca_at - pre : hca_at);
    if (pre > 0) {
        const v4p_u32 first = (v4p_u32)low;
        if (a.swa_indptr != 0)  // dense: the whole slice is window rows
            v4p_write_window_prefill(v4p_out<v4p_i32>(a.swa_indices) + swa_at, a.dense, slot, first, pre, lane, LANES);
        // CSA: window at the tail, the top-k head is left for the translate-pack.
        v4p_write_window_prefill(v4p_out<v4p_i32>(a.csa_indices) + (csa_end - pre), a.csa, slot, first, pre, lane,
                                 LANES);
        // HCA: [window | compressed entries], or the window tail when packed per layer.
        v4p_write_window_prefill(out, a.hca, slot, first, pre, lane, LANES);
    }
    return V4pHead{out + pre, table, nh, b};
}

template <v4p_u32 LANES>
V4P_DEVICE void v4p_prefill_by16(const PrefillIndexArgs& a) {
    const v4p_u32 lane = v4p_tid_x() % LANES;
    const v4p_i64 t = (v4p_i64)v4p_bid_x() * (V4POOL_BLOCK_THREADS / LANES) + v4p_tid_x() / LANES;
    if (t >= a.num_tokens) return;
    const V4pHead h = v4p_prefill_token<LANES>(a, t, lane);
    if (h.n == 0) return;
    v4p_head_by16<LANES>(h.dst, h.table, h.n, (v4p_u32)a.hca_rows_per_block, (v4p_u32)a.envelope_rows, lane);
}

/// N tokens' compressed heads of one block-table row at rows per block 2 (N = 2 in
/// v4pool_prefill_indices_pair): one set of table loads feeds every head's 16-byte groups.
/// Group g of head i starts at entry h_i + 4g (h_i its scalar head, 0..3, which may differ
/// between the slices' alignments); all lie within entries 2c .. 2c + 7, c = min_i h_i / 2 +
/// 2g, i.e. table columns c .. c + 3 (clamped to the last column any head needs, so no load
/// passes the row). Head i's group is then columns q_i .. q_i + 2 of those by its offset
/// o_i = h_i - 2c.
template <v4p_u32 LANES, int N>
V4P_DEVICE void v4p_head_multi(const V4pHead* h, v4p_u32 env, v4p_u32 lane) {
    const v4p_i32* table = h[0].table;
    v4p_u32 hd[N], gs[N], hmin = 4, nmax = 0, gmin = 0xffffffffu, gmax = 0;
    v4p_vec16* v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const V4pRun16 s(h[i].dst, h[i].n);
        v4p_head_ends(h[i].dst, table, s, h[i].n, 2, env, lane);
        hd[i] = s.head, gs[i] = s.groups;
        v[i] = (v4p_vec16*)(h[i].dst + s.head);
#if defined(V4P_TARGET_EMU)
        if (s.groups != 0 && ((v4p_u64)v[i] & 15) != 0) __builtin_trap();
#endif
        hmin = v4p_min32(hmin, s.head), nmax = v4p_max32(nmax, h[i].n);
        gmin = v4p_min32(gmin, s.groups), gmax = v4p_max32(gmax, s.groups);
    }
    const v4p_u32 c0 = hmin >> 1, cmax = (nmax - 1) >> 1;
    v4p_u32 o[N];  // 0..4
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = hd[i] - 2 * c0;
    // Entries o .. o + 3 of the eight that columns x0..x3 give (entry 2i + r = x_i * env + r).
    auto four = [&](v4p_u32 oo, const v4p_u32* x) {
        const v4p_u32 q = oo >> 1;
        const v4p_u32 a = q == 0 ? x[0] : q == 1 ? x[1] : x[2];
        const v4p_u32 b = q == 0 ? x[1] : q == 1 ? x[2] : x[3];
        const v4p_u32 c = q == 0 ? x[2] : x[3];  // only for odd o (q <= 1)
        return v4p_rpb2_group((oo & 1) != 0, a, b, c, env);
    };
    auto cols = [&](v4p_u32 g, v4p_u32* x) {
        const v4p_u32 c = c0 + 2 * g;
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = (v4p_u32)table[v4p_min32(c + (v4p_u32)i, cmax)];
    };
    constexpr int U = 2;
    v4p_u32 g = lane;
    for (; g + (U - 1) * LANES < gmin; g += U * LANES) {
        v4p_u32 x[U][4];
#pragma unroll
        for (int u = 0; u < U; ++u) cols(g + (v4p_u32)u * LANES, x[u]);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int i = 0; i < N; ++i) v[i][g + (v4p_u32)u * LANES] = four(o[i], x[u]);
    }
    for (; g < gmax; g += LANES) {
        v4p_u32 x[4];
        cols(g, x);
#pragma unroll
        for (int i = 0; i < N; ++i)
            if (g < gs[i]) v[i][g] = four(o[i], x);
    }
}

/// N consecutive tokens per LANES lanes: each token's extend
/// run and windows as v4p_prefill_by16; the HCA heads from one set of table loads when all N
/// tokens have heads, are of one sequence, and rows per block is 2, else each on its own.
template <v4p_u32 LANES, int N>
V4P_DEVICE void v4p_prefill_multi(const PrefillIndexArgs& a) {
    const v4p_u32 lane = v4p_tid_x() % LANES;
    const v4p_i64 t = N * ((v4p_i64)v4p_bid_x() * (V4POOL_BLOCK_THREADS / LANES) + v4p_tid_x() / LANES);
    if (t >= a.num_tokens) return;
    V4pHead h[N];
    bool shared = a.hca_rows_per_block == 2;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        h[i] = t + i < a.num_tokens ? v4p_prefill_token<LANES>(a, t + i, lane) : v4p_no_head();
        shared = shared && h[i].n != 0 && h[i].b == h[0].b;
    }
    const v4p_u32 rpb = (v4p_u32)a.hca_rows_per_block, env = (v4p_u32)a.envelope_rows;
    if (shared) {
        v4p_head_multi<LANES, N>(h, env, lane);
        return;
    }
#pragma unroll
    for (int i = 0; i < N; ++i)
        if (h[i].n != 0) v4p_head_by16<LANES>(h[i].dst, h[i].table, h[i].n, rpb, env, lane);
}

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_prefill_indices(PrefillIndexArgs a) {
    v4p_overlap_begin();  // before any global access (launched as a dependent)
    v4p_prefill_by16<V4POOL_PREFILL_LANES>(a);
}
extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_prefill_indices_short(PrefillIndexArgs a) {
    v4p_overlap_begin();  // before any global access (launched as a dependent)
    v4p_prefill_by16<V4POOL_PREFILL_SHORT_LANES>(a);
}
// Two consecutive tokens per 64 lanes (8 per block), their HCA heads from one set of table
// loads (v4p_prefill_multi). The host picks it (shape::prefill_pair) for long forwards over
// moderate contexts, where the block-table row reads are L2-resident and half of them can go:
// H200, 8,192 tokens at 128K in 15.55 µs against 17.28 (BENCHMARKS.md). With fewer tokens the
// grid is too small (2,048 at 128K: 8.83 against 7.49), and at 1M the kernel is bound by its
// DRAM writes (8,192 at 1M: 89.31 against 85.81), so those keep the one-token form.
extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_prefill_indices_pair(PrefillIndexArgs a) {
    v4p_overlap_begin();  // before any global access (launched as a dependent)
    v4p_prefill_multi<V4POOL_PREFILL_LANES, 2>(a);
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

// ---- §5: CSA translate-pack, one layer ---------------------------------------------------
// grid (T, tiles = ceil(topk_row_stride / 512)), block 256: one block per (token, 512 top-k
// columns), two columns per thread. (A spread of about four blocks per token with 32-bit
// shift/mask math measured slower at top-k 512 and 1,024 and level at 2,048: BENCHMARKS.md.)
//
// Decode mode (window_size > 0), the form a forward runs 21 times in a row: everything but the
// top-k is loaded BEFORE v4p_overlap_wait() — batch id, slice bounds, position and the part of
// the sequence's block-table row its top-k can reach, staged in shared memory — so while the
// previous layer's pack still runs this block already holds its table, and after the wait one
// dependent round trip is left (top-k load -> shared-memory lookup -> store) instead of two.
// That is only sound because none of those inputs is written by a kernel that may still run:
// the contract (index-buffers.md §5, ARCHITECTURE.md) requires every input but the top-k to be
// complete before the kernel preceding the pack in the stream starts; in v4pool's own paths
// they are host uploads staged before the builder, and no kernel writes them. Prefill mode
// (window_size = 0: no position bounds the reachable columns, and a forward's tokens share
// rows) reads everything after the wait and gathers table entries from global memory.

/// Block-table columns the decode form stages in shared memory (16 KB): a 1M-token context at
/// 256 tokens (64 CSA rows) per block. Columns past it, or past what the position reaches,
/// are read from the table itself, so the result never depends on this bound.
#define V4POOL_CSA_STAGE_COLS 4096

#if defined(V4P_TARGET_EMU)
// The emulation runs each thread of a block to completion in turn (no barrier exists): every
// thread stages the whole row itself into its own copy, so lane 0 of 1.
#define V4P_CSA_STAGE_SHARED static thread_local
#define V4P_CSA_STAGE_LANE(tid) 0u
#define V4P_CSA_STAGE_LANES 1u
#else
#define V4P_CSA_STAGE_SHARED __shared__
#define V4P_CSA_STAGE_LANE(tid) (tid)
#define V4P_CSA_STAGE_LANES ((v4p_u32)V4P_BLOCK)
#endif

/// Prefetch the 128-byte line holding `p` into L2 (sm_90 CUDA; nothing elsewhere). A hint:
/// it moves no value into the thread, so it is no read in the memory model's sense.
#if (defined(V4P_TARGET_NVCC) || defined(V4P_TARGET_CLANG_CUDA)) && defined(__CUDA_ARCH__)
V4P_DEVICE void v4p_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#else
V4P_DEVICE void v4p_prefetch_l2(const void*) {}
#endif

/// Shift for a power-of-two `cap` (-1 for any other): csa_split's fast path, computed once per
/// thread before the wait.
V4P_DEVICE v4p_i32 csa_cap_shift(v4p_i32 cap) {
    if ((cap & (cap - 1)) != 0) return -1;
    v4p_i32 sh = 0;
    while ((((v4p_u32)cap - 1) >> sh) != 0) ++sh;
    return sh;
}

/// Top-k values -> (table column, row within the block), as csa_pack_entry spells it: column
/// v / cap clamped to [0, last], row v % cap (C's truncating division and remainder). A
/// power-of-two cap (64 in every DeepSeek-V4 layout; `sh` >= 0) takes a shift and a mask on
/// the magnitude, a branch uniform over the block; any other cap divides.
template <int E>
V4P_DEVICE void csa_split(const v4p_i32 (&v)[E], v4p_i32 cap, v4p_i32 sh, v4p_i32 last, v4p_i32 (&j)[E],
                          v4p_i32 (&r)[E]) {
    if (sh >= 0) {
        const v4p_u32 m = (v4p_u32)cap - 1;
#pragma unroll
        for (int u = 0; u < E; ++u) {
            // |v| in unsigned arithmetic (INT_MIN included): its low bits give |v % cap|.
            const v4p_u32 mag = v[u] < 0 ? 0u - (v4p_u32)v[u] : (v4p_u32)v[u];
            const v4p_i32 q = (v4p_i32)(mag >> sh);
            const v4p_i32 rem = (v4p_i32)(mag & m);
            j[u] = v[u] < 0 ? 0 : (q > last ? last : q);  // v < 0: v / cap <= 0, clamped to 0
            r[u] = v[u] < 0 ? -rem : rem;
        }
    } else {
#pragma unroll
        for (int u = 0; u < E; ++u) {
            const v4p_i32 q = v[u] / cap;
            j[u] = q < 0 ? 0 : (q > last ? last : q);  // clamp, do not drop
            r[u] = v[u] % cap;
        }
    }
}

/// A packed row: the compressed row of (block, row) plus the layer's compress bias (0 in V4;
/// a V4.1 reader reaches its owner's rows through it), formed in 64 bits, stored as i32.
V4P_DEVICE v4p_i32 csa_biased_row(v4p_i64 blk, v4p_i64 r, v4p_i64 envelope, v4p_i64 bias) {
    return (v4p_i32)(compress_row(blk, r, envelope) + bias);
}

/// One pack entry (the overrun path): top-k value `v` -> pool row. Table columns below
/// `staged_cols` come from the shared-memory copy `staged`, the rest from `table`.
V4P_DEVICE v4p_i32 csa_pack_entry(const v4p_i32* table, const v4p_i32* staged, v4p_i32 staged_cols,
                                  v4p_i32 last, v4p_i32 v, v4p_i32 cap, v4p_i64 envelope, v4p_i64 bias) {
    const v4p_i32 vv[1] = {v};
    v4p_i32 j[1], r[1];
    csa_split<1>(vv, cap, csa_cap_shift(cap), last, j, r);
    const v4p_i32 blk = j[0] < staged_cols ? staged[j[0]] : table[j[0]];
    return csa_biased_row(blk, r[0], envelope, bias);
}

/// A thread's two top-k columns k0 and k0 + 256 (0 at or past `bound`), both loads in flight.
V4P_DEVICE void csa_load_topk(v4p_i32 (&v)[2], const v4p_i32* topk, v4p_i64 k0, v4p_i64 bound) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const v4p_i64 k = k0 + u * V4P_BLOCK;
        v[u] = k < bound ? topk[k] : 0;
    }
}

/// A slice longer than its top-k row (a host error) still gets every entry, read past the row
/// as the contract's reference kernel would; the row's tiles (TILE columns each) share entries
/// [row_stride, valid_k).
template <int TILE = V4POOL_CSA_TILE>
V4P_DEVICE void csa_pack_overrun(v4p_i32* out, const v4p_i32* topk, const v4p_i32* table, const v4p_i32* staged,
                                 v4p_i32 staged_cols, v4p_i32 last, v4p_i32 cap, v4p_i64 envelope, v4p_i64 bias,
                                 v4p_i64 valid_k, v4p_i64 row_stride, v4p_i64 tile, v4p_u32 tid) {
    if (valid_k <= row_stride) return;
    const v4p_i64 row_tiles = (row_stride + TILE - 1) / TILE;
    const v4p_i64 ntiles = row_tiles > 0 ? row_tiles : 1;
    for (v4p_i64 k = row_stride + tile * V4P_BLOCK + tid; k < valid_k; k += ntiles * V4P_BLOCK)
        out[k] = csa_pack_entry(table, staged, staged_cols, last, topk[k], cap, envelope, bias);
}

/// Copy columns [0, n) of `table` into `staged` with the block's lanes: 16-byte loads when the
/// row is 16-byte aligned, four in flight per lane before any shared store (a generic load
/// might alias the shared array, so the compiler would otherwise wait for each store).
/// Reads stay inside [0, n) of the row; writes inside [0, n) of `staged`.
V4P_DEVICE void csa_stage_row(v4p_i32* staged, const v4p_i32* table, v4p_i32 n, v4p_u32 lane, v4p_u32 lanes) {
    v4p_i32 scalar_from = 0;
    if ((((v4p_u64)table) & 15) == 0) {
        const v4p_vec16* src = (const v4p_vec16*)table;
        v4p_vec16* dst = (v4p_vec16*)staged;
        const v4p_i32 n4 = n / 4;
        for (v4p_i32 q = (v4p_i32)lane; q < n4; q += 4 * (v4p_i32)lanes) {
            v4p_vec16 r[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const v4p_i32 i = q + u * (v4p_i32)lanes;
                if (i < n4) r[u] = src[i];
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const v4p_i32 i = q + u * (v4p_i32)lanes;
                if (i < n4) dst[i] = r[u];
            }
        }
        scalar_from = n4 * 4;
    }
    for (v4p_i32 c = scalar_from + (v4p_i32)lane; c < n; c += (v4p_i32)lanes) staged[c] = table[c];
}

/// Decode mode with the table row staged before the wait (see above): E columns per thread, a
/// tile of E * 256 columns per block (grid y); the row is staged in V4POOL_CSA_STAGE_COLS i32
/// of shared memory, 16-byte aligned. After the wait: 32-bit columns, every top-k load of the
/// thread in flight before the first use, no per-entry branch (the H200 A/B in BENCHMARKS.md:
/// this body took 21 layers at top-k 2,048 from 58.3 to 46.6 µs).
template <int E>
V4P_DEVICE void csa_pack_staged(const CsaPackArgs& a) {
    constexpr v4p_i32 TILE = E * V4P_BLOCK;
    V4P_CSA_STAGE_SHARED v4p_vec16 staged16[V4POOL_CSA_STAGE_COLS / 4];
    v4p_i32* staged = (v4p_i32*)staged16;
    const v4p_i32 t = (v4p_i32)v4p_bid_x();
    const v4p_i32 tile = (v4p_i32)v4p_bid_y();
    if (t >= a.num_tokens) return;
    const v4p_u32 tid = v4p_tid_x();
    // Before the wait: inputs the contract declares complete before the previous kernel
    // started (never the top-k: the kernel before may still be writing it).
    const v4p_i32 b = v4p_in<v4p_i32>(a.batch_id_per_token)[t];
    const v4p_i32* ptr = v4p_in<v4p_i32>(a.indptr);
    const v4p_i64 base = ptr[t];
    const v4p_i64 end = ptr[t + 1];
    const v4p_i64 pos = v4p_in<v4p_i64>(a.positions)[t];
    if (b < 0) return;  // block-uniform, like every return before the barrier
    const v4p_i64 row_stride = a.topk_row_stride;
    const v4p_i64 valid_k = end - base - v4p_min(pos + 1, (v4p_i64)a.window_size);
    const v4p_i64 lim = v4p_min(valid_k, row_stride);
    if ((v4p_i64)tile * TILE >= lim && valid_k <= row_stride) return;  // nothing in this tile
    const v4p_i32* table = v4p_in<v4p_i32>(a.block_tables) + (v4p_i64)b * a.block_table_stride;
    const v4p_i32 cap = a.block_capacity;
    const v4p_i32 last = a.block_table_stride - 1;
    const v4p_i32 sh = csa_cap_shift(cap);
    // Columns the token's top-k can reach: its (pos + 1) / ratio compressed rows, `cap` per
    // block (pos >= 0 spelled without pos + 1, which could overflow), within the row and the
    // stage. A ratio below 1 (refused at launch) stages nothing; the table serves every column.
    const v4p_i64 ratio = a.compress_ratio;
    const v4p_i64 rows = pos < 0 || ratio < 1 ? 0 : pos / ratio + (pos % ratio == ratio - 1);
    const v4p_i64 reach = rows / cap + (rows % cap != 0);
    const v4p_i32 n = (v4p_i32)v4p_min(reach, v4p_min((v4p_i64)a.block_table_stride, V4POOL_CSA_STAGE_COLS));
    const v4p_i32* topk = v4p_in<v4p_i32>(a.topk) + (v4p_i64)t * row_stride;
    // 32-bit columns: lim <= row_stride < 2^31, and a negative lim writes nothing.
    const v4p_i32 lim32 = (v4p_i32)v4p_max(lim, (v4p_i64)-1);
    const v4p_i32 c0 = tile * TILE + (v4p_i32)tid;
    {
        // Pull this tile's top-k lines toward L2 now, one prefetch per 128-byte line: a hint
        // with no value, so it may race the writer (L2 is where every SM's stores land; the
        // load after the wait reads there).
        static_assert(TILE <= 32 * V4P_BLOCK, "one prefetch per thread covers the tile");
        const v4p_i32 k = tile * TILE + (v4p_i32)tid * 32;
        if ((v4p_i32)tid * 32 < TILE && k < lim32) v4p_prefetch_l2(topk + k);
    }
    csa_stage_row(staged, table, n, V4P_CSA_STAGE_LANE(tid), V4P_CSA_STAGE_LANES);
    v4p_overlap_wait();  // the top-k is the previous kernel's (or its predecessors') output
    v4p_i32 v[E];
#pragma unroll
    for (int u = 0; u < E; ++u) {
        const v4p_i32 k = c0 + u * V4P_BLOCK;
        v[u] = k < lim32 ? topk[k] : 0;
    }
    v4p_sync();
    v4p_i32 j[E], r[E], blk[E];
    csa_split<E>(v, cap, sh, last, j, r);
#pragma unroll
    for (int u = 0; u < E; ++u) blk[u] = staged[j[u] < n ? j[u] : 0];
    // Columns past the stage (past what the position reaches, or past 4,096): the table.
#pragma unroll
    for (int u = 0; u < E; ++u)
        if (j[u] >= n && c0 + u * V4P_BLOCK < lim32) blk[u] = table[j[u]];
    v4p_i32* out = v4p_out<v4p_i32>(a.out) + base;
#pragma unroll
    for (int u = 0; u < E; ++u) {
        const v4p_i32 k = c0 + u * V4P_BLOCK;
        if (k < lim32) out[k] = csa_biased_row(blk[u], r[u], a.envelope_rows, a.compress_bias);
    }
    csa_pack_overrun<TILE>(out, topk, table, staged, n, last, cap, a.envelope_rows, a.compress_bias, valid_k,
                           row_stride, tile, tid);
}

/// Every load after the wait, table entries gathered from global memory: prefill mode (and a
/// decode launch with an empty top-k row). Both top-k loads go out with the
/// metadata, then both table loads, then the stores.
V4P_DEVICE void csa_pack_gather(const CsaPackArgs& a) {
    const v4p_i32 t = (v4p_i32)v4p_bid_x();
    const v4p_i64 tile = v4p_bid_y();
    if (t >= a.num_tokens) return;
    const v4p_u32 tid = v4p_tid_x();
    const v4p_i64 row_stride = a.topk_row_stride;
    // Loads that need only t go out first: batch id, slice bounds, skip source and the top-k
    // values themselves (in the row whatever the slice length; the topk buffer covers T rows).
    const v4p_i32 b = v4p_in<v4p_i32>(a.batch_id_per_token)[t];
    const v4p_i32* ptr = v4p_in<v4p_i32>(a.indptr);
    const v4p_i64 base = ptr[t];
    const v4p_i64 end = ptr[t + 1];
    const v4p_i64 skip_src = a.window_size > 0 ? v4p_in<v4p_i64>(a.positions)[t]
                                                : (v4p_i64)v4p_in<v4p_i32>(a.skip_prefix_len_per_token)[t];
    const v4p_i32* topk = v4p_in<v4p_i32>(a.topk) + (v4p_i64)t * row_stride;
    const v4p_i64 k0 = tile * V4POOL_CSA_TILE + tid;
    v4p_i32 v[2];
    csa_load_topk(v, topk, k0, row_stride);
    if (b < 0) return;
    const v4p_i64 skip = a.window_size > 0 ? v4p_min(skip_src + 1, (v4p_i64)a.window_size) : skip_src;
    const v4p_i64 valid_k = end - base - skip;
    const v4p_i64 lim = v4p_min(valid_k, row_stride);
    const v4p_i32* table = v4p_in<v4p_i32>(a.block_tables) + (v4p_i64)b * a.block_table_stride;
    const v4p_i32 cap = a.block_capacity;
    const v4p_i32 last = a.block_table_stride - 1;
    v4p_i32 j[2], r[2], blk[2];
    csa_split<2>(v, cap, csa_cap_shift(cap), last, j, r);
#pragma unroll
    for (int u = 0; u < 2; ++u) blk[u] = k0 + u * V4P_BLOCK < lim ? table[j[u]] : 0;
    v4p_i32* out = v4p_out<v4p_i32>(a.out) + base;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const v4p_i64 k = k0 + u * V4P_BLOCK;
        if (k < lim) out[k] = csa_biased_row(blk[u], r[u], a.envelope_rows, a.compress_bias);
    }
    csa_pack_overrun(out, topk, table, table, 0, last, cap, a.envelope_rows, a.compress_bias, valid_k, row_stride,
                     tile, tid);
}

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_csa_translate_pack(CsaPackArgs a) {
    v4p_overlap_begin();  // before any global access (launched as a dependent)
    csa_pack_gather(a);
}

/// The decode forms, with the table row staged before the wait: symbols of their own, so the
/// gather form (prefill) carries no shared memory. The host picks them (`Launch::symbol`) for
/// window_size > 0: `staged` (two columns per thread, tiles of 512) for top-k rows up to 512,
/// `staged_x4` (four per thread, tiles of 1,024) for longer ones. Both run at 8 blocks per SM
/// (32 registers): a layer's blocks then take at most half the resident slots, so the next
/// layer's pack is resident and staging its row while this one runs (H200 A/B, BENCHMARKS.md:
/// 21 layers at top-k 1,024 in 43.2 µs at 8 blocks/SM against 51.1 at 6). Prefill launches
/// reach them only through a caller's own symbol choice; they gather then, as the plain form.
extern "C" __global__ V4P_LAUNCH_BOUNDS_MIN(V4POOL_BLOCK_THREADS, 8) void v4pool_csa_translate_pack_staged(CsaPackArgs a) {
    v4p_overlap_trigger();  // the next layer's pack may launch now; this one waits below
    if (a.window_size > 0) return csa_pack_staged<2>(a);  // waits once its row is staged
    v4p_overlap_wait();  // before any global access
    csa_pack_gather(a);
}
extern "C" __global__ V4P_LAUNCH_BOUNDS_MIN(V4POOL_BLOCK_THREADS, 8) void v4pool_csa_translate_pack_staged_x4(CsaPackArgs a) {
    v4p_overlap_trigger();  // the next layer's pack may launch now; this one waits below
    if (a.window_size > 0) return csa_pack_staged<4>(a);  // waits once its row is staged
    v4p_overlap_wait();  // before any global access
    csa_pack_gather(a);
}

// ---- §7: SWA ring write, two planes --------------------------------------------------------
// grid (bs, ceil(write_per_batch / 8)), block 256: 8 rows per block, 32 lanes per row.

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_ring_write(RingWriteArgs a) {
    const v4p_i32 b = (v4p_i32)v4p_bid_x();
    if (b >= a.num_seqs) return;
    const v4p_u32 tid = v4p_tid_x();
    const v4p_i64 r = (v4p_i64)v4p_bid_y() * V4POOL_ROWS_PER_BLOCK + tid / V4POOL_ROW_LANES;
    const v4p_i32* cu = v4p_in<v4p_i32>(a.cu_seqlens_q);
    const v4p_i64 end = cu[b + 1];
    const v4p_i64 tok = end - cu[b];
    if (tok <= 0) return;
    const v4p_i64 w = v4p_min(tok, (v4p_i64)a.write_per_batch);
    if (r >= w) return;  // short sequence beside a long one: never read a neighbour's KV
    const v4p_i64 src = end - w + r;
    const v4p_i64 row = window_row(a.params, v4p_in<v4p_i32>(a.state_slot_per_seq)[b], v4p_in<v4p_i32>(a.positions)[src]);
    if (row < 0 || row >= a.view_rows) return;  // dropped, not wrapped
    v4p_copy_plane(a.planes[0], src, row, tid % V4POOL_ROW_LANES);
    v4p_copy_plane(a.planes[1], src, row, tid % V4POOL_ROW_LANES);
}

// ---- §7: row scatter, two planes ---------------------------------------------------------
// grid (ceil(T / 8)), block 256: 8 tokens per block, 32 lanes per row.

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_row_scatter(RowScatterArgs a) {
    const v4p_u32 tid = v4p_tid_x();
    const v4p_i64 t = (v4p_i64)v4p_bid_x() * V4POOL_ROWS_PER_BLOCK + tid / V4POOL_ROW_LANES;
    if (t >= a.num_tokens) return;
    if (v4p_in<v4p_i32>(a.batch_id_per_token)[t] < 0) return;
    const v4p_i64 row = v4p_in<v4p_i32>(a.dest_rows)[t];
    if (row < 0 || row >= a.view_rows) return;
    v4p_copy_plane(a.planes[0], t, row, tid % V4POOL_ROW_LANES);
    v4p_copy_plane(a.planes[1], t, row, tid % V4POOL_ROW_LANES);
}

// ---- §8: compressor-state update, one compressor of one layer ---------------------------------
// grid (ceil(num_rows / (256 / lanes))), block 256: `lanes` = the power of two covering
// dim / 8 (32 at dim 256, 64 at 512, 128 at 1,024), so every lane moves 8 elements of its row
// (two chunks of 4, half a row apart: each warp-wide store is one contiguous 512-byte span) and
// a block holds 256 / lanes plan rows (8, 4, 2): no idle lane at the V4 dims. One dependent
// load (the 16-byte plan row) before the row's data; kv, score and ape go out together, then
// four 16-byte f32 stores per lane with the streaming hint (st.global.cs: nothing reads the
// state this forward). Addresses are 64-bit: slot x slot bytes passes 2^31.
//
// Chosen on one H200 (17:35 UTC, issue 15's A/B of nine forms in one binary): this form was
// the fastest or within noise of it at every bench shape, 0.5-0.7 us under the previous kernel
// (generic loads and stores, 64-bit-checked divisions, a looped row) at batch <= 256 and 1 us
// under it at bs 1,024 and prefill. Reading kv / score row r and every CSA ape row in the plan
// row's round trip (decode plans read input row r at plan row r) was slower everywhere (the
// plan is as cold as the data, and 72 registers cost occupancy at bs 1,024); so were 8
// contiguous elements per lane at bs 1,024 and an L2 bulk prefetch of HCA's ape table.

/// Lanes that share one plan row (shape.rs state_update_lanes).
V4P_DEVICE v4p_u32 v4p_state_lanes(v4p_i32 dim) {
    const v4p_i64 chunks = ((v4p_i64)(dim > 0 ? dim : 1) + V4POOL_STATE_CHUNK - 1) / V4POOL_STATE_CHUNK;
    v4p_u32 lanes = 1;
    while ((v4p_i64)lanes < chunks && lanes < V4P_BLOCK) lanes *= 2;
    return lanes;
}

/// The f32 whose bits are `u`, and back (register moves, no memory).
#if defined(V4P_TARGET_NVCC)
V4P_DEVICE float v4p_f32_bits(v4p_u32 u) { return __uint_as_float(u); }
V4P_DEVICE v4p_u32 v4p_bits_f32(float f) { return __float_as_uint(f); }
#else
V4P_DEVICE float v4p_f32_bits(v4p_u32 u) { return __builtin_bit_cast(float, u); }
V4P_DEVICE v4p_u32 v4p_bits_f32(float f) { return __builtin_bit_cast(v4p_u32, f); }
#endif

/// Element i of a row of `dtype` (scalar path).
V4P_DEVICE float v4p_load_elem(v4p_ptr row, v4p_i32 dtype, v4p_i64 i) {
    if (dtype == V4POOL_DTYPE_BF16) return v4p_f32_bits((v4p_u32)((const unsigned short*)row)[i] << 16);
    return ((const float*)row)[i];
}

/// Four u32 loaded or stored as one 16-byte vector: clang's vector extension, or (nvcc,
/// NVRTC) the 16-byte aligned struct.
#if defined(V4P_TARGET_NVCC)
typedef v4p_vec16 v4p_u32x4;
#else
typedef v4p_u32 v4p_u32x4 __attribute__((ext_vector_type(4)));
#endif

/// Global loads and the streaming store as inline PTX on NVIDIA targets: NVVM splits a vector
/// store of computed values into four scalar stores (seen in nvcc 13.0's PTX for the score
/// row), and a generic access costs an address-space check the global one does not.
V4P_DEVICE v4p_u32x4 v4p_ld16(v4p_ptr p) {
#if defined(V4P_TARGET_NVCC) || defined(V4P_TARGET_CLANG_CUDA)
    v4p_u32x4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return *(const v4p_u32x4*)p;
#endif
}

V4P_DEVICE void v4p_ld8(v4p_ptr p, v4p_u32& w0, v4p_u32& w1) {
#if defined(V4P_TARGET_NVCC) || defined(V4P_TARGET_CLANG_CUDA)
    asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(w0), "=r"(w1) : "l"(p));
#else
    w0 = ((const v4p_u32*)p)[0];
    w1 = ((const v4p_u32*)p)[1];
#endif
}

V4P_DEVICE void v4p_st16_cs(v4p_u64 p, v4p_u32x4 v) {
#if defined(V4P_TARGET_NVCC) || defined(V4P_TARGET_CLANG_CUDA)
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
#else
    *(v4p_u32x4*)p = v;
#endif
}

/// Four bf16 in two words as f32 bit patterns (exact: the bf16 is the f32's upper half).
/// Little-endian: the low half of a word is the earlier element.
V4P_DEVICE v4p_u32x4 v4p_widen_bf16x4(v4p_u32 w0, v4p_u32 w1) {
    v4p_u32x4 r;
    r.x = w0 << 16, r.y = w0 & 0xffff0000u, r.z = w1 << 16, r.w = w1 & 0xffff0000u;
    return r;
}

/// Four elements at `p` as f32 bit patterns: one 8-byte load for bf16, one 16-byte load for
/// f32. Integers, so the kv copy never passes through float registers.
template <bool BF16>
V4P_DEVICE v4p_u32x4 v4p_ld4_elems(v4p_ptr p) {
    if (BF16) {
        v4p_u32 w0, w1;
        v4p_ld8(p, w0, w1);
        return v4p_widen_bf16x4(w0, w1);
    }
    return v4p_ld16(p);
}

/// f32 sum of two bit patterns, as bits.
V4P_DEVICE v4p_u32 v4p_add_bits(v4p_u32 a, v4p_u32 b) { return v4p_bits_f32(v4p_f32_bits(a) + v4p_f32_bits(b)); }

V4P_DEVICE v4p_u32x4 v4p_add4(v4p_u32x4 a, v4p_u32x4 b) {
    v4p_u32x4 r;
    r.x = v4p_add_bits(a.x, b.x), r.y = v4p_add_bits(a.y, b.y);
    r.z = v4p_add_bits(a.z, b.z), r.w = v4p_add_bits(a.w, b.w);
    return r;
}

/// The 16-byte path: every row start 16-byte aligned (all V4 fields and engine tensors) and a
/// lane's 8 elements exactly cover the row (dim == 8 * lanes: 256, 512, 1,024). The same for
/// the whole launch, so no lane diverges on it; anything else takes the element path.
V4P_DEVICE bool v4p_state_vec(const StateUpdateArgs& a, v4p_u32 lanes) {
    const v4p_u64 in_size = a.in_dtype == V4POOL_DTYPE_BF16 ? 2 : 4;
    return (v4p_i64)a.dim == (v4p_i64)lanes * V4POOL_STATE_CHUNK &&
           ((a.kv | a.score | a.ape | a.kv_state | a.score_state | (v4p_u64)a.kv_slot_bytes |
             (v4p_u64)a.score_slot_bytes | ((v4p_u64)a.kv_row_stride * in_size) |
             ((v4p_u64)a.score_row_stride * in_size)) &
            15) == 0;
}

/// Where plan row `row` writes: its slot (column 3, or slot_map[batch id] in the contract's
/// form) at ring row `ring_row`, 64-bit.
V4P_DEVICE void v4p_state_dst(const StateUpdateArgs& a, v4p_u32x4 row, v4p_u32 ring_row, v4p_u64& kv_dst,
                              v4p_u64& score_dst) {
    const v4p_u64 slot = a.slot_map != 0 ? (v4p_u64)v4p_in<v4p_i32>(a.slot_map)[(v4p_i32)row.y] : (v4p_u64)row.w;
    const v4p_u64 in_state = (v4p_u64)ring_row * (v4p_u64)a.dim * 4;
    kv_dst = a.kv_state + slot * (v4p_u64)a.kv_slot_bytes + in_state;
    score_dst = a.score_state + slot * (v4p_u64)a.score_slot_bytes + in_state;
}

/// Plan row `row`'s 16-byte path, for one pair of input types (a separate instantiation each,
/// so no load or store is split by a run-time type branch): chunks at elements e0 and
/// e0 + 4 * lanes. kv and score go out first (their rows are in the plan row), the divisions
/// while they fly, then ape; all six loads before the four stores.
template <bool IN_BF16, bool APE_BF16>
V4P_DEVICE void v4p_state_row_vec(const StateUpdateArgs& a, v4p_u32x4 row, v4p_u32 lane, v4p_u32 lanes) {
    const v4p_u64 in_size = IN_BF16 ? 2 : 4, ape_size = APE_BF16 ? 2 : 4;
    const v4p_u64 e0 = (v4p_u64)lane * 4, e1 = e0 + (v4p_u64)lanes * 4;
    const v4p_u64 ragged = (v4p_u64)(v4p_i32)row.x;
    const v4p_ptr kv = a.kv + ragged * (v4p_u64)a.kv_row_stride * in_size;
    const v4p_ptr score = a.score + ragged * (v4p_u64)a.score_row_stride * in_size;
    const v4p_u32x4 k0 = v4p_ld4_elems<IN_BF16>(kv + e0 * in_size), k1 = v4p_ld4_elems<IN_BF16>(kv + e1 * in_size);
    const v4p_u32x4 s0 = v4p_ld4_elems<IN_BF16>(score + e0 * in_size);
    const v4p_u32x4 s1 = v4p_ld4_elems<IN_BF16>(score + e1 * in_size);
    // Plan positions are non-negative i32, ring and ratio positive i32: 32-bit divisions.
    const v4p_u32 ring_row = row.z % (v4p_u32)a.ring, ape_row = row.z % (v4p_u32)a.ratio;
    const v4p_ptr ape = a.ape + (v4p_u64)ape_row * (v4p_u64)a.dim * ape_size;
    const v4p_u32x4 p0 = v4p_ld4_elems<APE_BF16>(ape + e0 * ape_size);
    const v4p_u32x4 p1 = v4p_ld4_elems<APE_BF16>(ape + e1 * ape_size);
    v4p_u64 kv_dst, score_dst;
    v4p_state_dst(a, row, ring_row, kv_dst, score_dst);
    v4p_st16_cs(kv_dst + e0 * 4, k0);
    v4p_st16_cs(kv_dst + e1 * 4, k1);
    v4p_st16_cs(score_dst + e0 * 4, v4p_add4(s0, p0));
    v4p_st16_cs(score_dst + e1 * 4, v4p_add4(s1, p1));
}

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_update_compressor_states(StateUpdateArgs a) {
    const v4p_u32 lanes = v4p_state_lanes(a.dim);
    const v4p_u32 tid = v4p_tid_x(), lane = tid % lanes;
    const v4p_i64 r = (v4p_i64)v4p_bid_x() * (V4P_BLOCK / lanes) + tid / lanes;
    if (r >= a.num_rows) return;
    const v4p_u32x4 row = v4p_ld16(a.write_plan + (v4p_u64)r * 16);
    if ((v4p_i32)row.z < 0) return;  // pad row: no load, no store
    if (v4p_state_vec(a, lanes)) {
        const bool in_bf16 = a.in_dtype == V4POOL_DTYPE_BF16, ape_bf16 = a.ape_dtype == V4POOL_DTYPE_BF16;
        if (in_bf16 && ape_bf16)
            v4p_state_row_vec<true, true>(a, row, lane, lanes);
        else if (in_bf16)
            v4p_state_row_vec<true, false>(a, row, lane, lanes);
        else if (ape_bf16)
            v4p_state_row_vec<false, true>(a, row, lane, lanes);
        else
            v4p_state_row_vec<false, false>(a, row, lane, lanes);
        return;
    }
    // Element path (no V4 field takes it): any dim, alignment and stride.
    const v4p_u32 ring_row = row.z % (v4p_u32)a.ring, ape_row = row.z % (v4p_u32)a.ratio;
    v4p_u64 kv_dst, score_dst;
    v4p_state_dst(a, row, ring_row, kv_dst, score_dst);
    const v4p_u64 in_size = a.in_dtype == V4POOL_DTYPE_BF16 ? 2 : 4;
    const v4p_u64 ape_size = a.ape_dtype == V4POOL_DTYPE_BF16 ? 2 : 4;
    const v4p_u64 ragged = (v4p_u64)(v4p_i32)row.x;
    const v4p_ptr kv = a.kv + ragged * (v4p_u64)a.kv_row_stride * in_size;
    const v4p_ptr score = a.score + ragged * (v4p_u64)a.score_row_stride * in_size;
    const v4p_ptr ape = a.ape + (v4p_u64)ape_row * (v4p_u64)a.dim * ape_size;
    for (v4p_i64 e = lane; e < a.dim; e += lanes) {
        const float k = v4p_load_elem(kv, a.in_dtype, e);
        const float s = v4p_load_elem(score, a.in_dtype, e) + v4p_load_elem(ape, a.ape_dtype, e);
        ((float*)kv_dst)[e] = k;
        ((float*)score_dst)[e] = s;
    }
}

// ---- fill / copy runs (compressor-state init, slot copies) -----------------------------------
// grid (num_runs, 32), block 256: 32 blocks share a run.

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_fill_runs(FillRunsArgs a) {
    const v4p_i64 i = v4p_bid_x();
    if (i >= a.num_runs) return;
    const FillRun run = v4p_in<FillRun>(a.runs)[i];
    const v4p_u64 part = v4p_bid_y(), tid = v4p_tid_x();
    const v4p_u64 stride = (v4p_u64)V4POOL_RUN_SPLIT * V4P_BLOCK;
    const v4p_u64 words = run.bytes / 4;
    // Words up to the first 16-byte boundary, 16-byte vectors, then the last words.
    v4p_u64 head = ((16 - (run.dst & 15)) & 15) / 4;
    if (head > words) head = words;
    const v4p_u64 vecs = (words - head) / 4;
    const v4p_u64 tail = words - head - vecs * 4;
    v4p_u32* w = (v4p_u32*)run.dst;
    if (part == 0 && tid < head) w[tid] = run.pattern;
    if (part == 0 && tid < tail) w[head + vecs * 4 + tid] = run.pattern;
    v4p_vec16 pat;
    pat.x = pat.y = pat.z = pat.w = run.pattern;
    v4p_vec16* v = (v4p_vec16*)(run.dst + head * 4);
    for (v4p_u64 u = part * V4P_BLOCK + tid; u < vecs; u += stride) v[u] = pat;
}

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_copy_runs(CopyRunsArgs a) {
    const v4p_i64 i = v4p_bid_x();
    if (i >= a.num_runs) return;
    const CopyRun run = v4p_in<CopyRun>(a.runs)[i];
    const v4p_u64 part = v4p_bid_y(), tid = v4p_tid_x();
    const v4p_u64 stride = (v4p_u64)V4POOL_RUN_SPLIT * V4P_BLOCK;
    v4p_u8* d8 = (v4p_u8*)run.dst;
    const v4p_u8* s8 = (const v4p_u8*)run.src;
    if (((run.src ^ run.dst) & 15) != 0) {
        // Ends that can never be 16-aligned together: bytes.
        for (v4p_u64 u = part * V4P_BLOCK + tid; u < run.bytes; u += stride) d8[u] = s8[u];
        return;
    }
    // Same alignment: bytes up to the first 16-byte boundary, 16-byte vectors, the last bytes.
    v4p_u64 head = (16 - (run.dst & 15)) & 15;
    if (head > run.bytes) head = run.bytes;
    const v4p_u64 vecs = (run.bytes - head) / 16;
    const v4p_u64 tail = run.bytes - head - vecs * 16;
    if (part == 0 && tid < head) d8[tid] = s8[tid];
    if (part == 0 && tid < tail) d8[head + vecs * 16 + tid] = s8[head + vecs * 16 + tid];
    v4p_vec16* d = (v4p_vec16*)(run.dst + head);
    const v4p_vec16* s = (const v4p_vec16*)(run.src + head);
    for (v4p_u64 u = part * V4P_BLOCK + tid; u < vecs; u += stride) d[u] = s[u];
}

// ---- §9: DSpark window gather ------------------------------------------------------------
// grid (num_seqs, ceil(draft_window / 8)), block 256: four groups of 64 lanes, each group
// writing two window rows of one sequence; a lane moves 16 B of a 1024-B output row. Both
// rows' loads are in flight before either store (the kernel is a pure DRAM stream at large
// batches: ~2 x 16 B outstanding per thread instead of one). The same source serves the copy
// variant (bf16 rows: a bf16 plane or the carried `state_window` field) and the fp8 variant
// (NoPE e4m3 + per-tile e8m0 scale, RoPE bf16), which differ only in what a lane loads.

#define V4P_GATHER_GROUPS (V4POOL_BLOCK_THREADS / V4POOL_GATHER_LANES)
#define V4P_GATHER_ROWS (V4POOL_GATHER_ROWS_PER_BLOCK / V4P_GATHER_GROUPS)
static_assert(V4P_GATHER_ROWS * V4P_GATHER_GROUPS == V4POOL_GATHER_ROWS_PER_BLOCK, "groups tile the rows");
static_assert(V4POOL_GATHER_LANES * 16 == 1024, "a lane group moves one 1024-B bf16 row");
/// fp8 NoPE row: 448 e4m3 values in 7 tiles of 64, the scales (twice each) from byte 448.
#define V4P_NOPE_ROW_BYTES 512
#define V4P_NOPE_VALUES 448
#define V4P_ROPE_ROW_BYTES 128
/// Lanes of a group that write NoPE values (8 each); the other 8 copy the RoPE part.
#define V4P_NOPE_LANES (V4P_NOPE_VALUES / 8)

union V4pF32Bits {
    float f;
    v4p_u32 u;
};
V4P_DEVICE float v4p_f32_from_bits(v4p_u32 u) {
    V4pF32Bits x;
    x.u = u;
    return x.f;
}
V4P_DEVICE v4p_u32 v4p_f32_bits(float f) {
    V4pF32Bits x;
    x.f = f;
    return x.u;
}

/// bf16 bits of `f`, rounded to nearest even (as a cast to bf16 does); NaN is 0x7fc0.
V4P_DEVICE v4p_u32 v4p_bf16_rne(float f) {
    const v4p_u32 u = v4p_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/// The e8m0 scale byte `e` as a float: 2^(e-127), 0 for e = 0 (an all-zero tile).
V4P_DEVICE float v4p_e8m0_scale(v4p_u32 e) { return e == 0 ? 0.0f : v4p_f32_from_bits(e << 23); }

/// One e4m3fn byte times `scale`, as bf16 bits. A normal byte's exponent and mantissa are an
/// f32's once the bias difference (127 - 7 = 120) is added to the exponent; a subnormal one
/// is m x 2^-9; both exact, so the only rounding is the product's (as float(x) * scale does).
/// 0x7f / 0xff are NaN.
V4P_DEVICE v4p_u32 v4p_fp8_scaled_bf16(v4p_u32 byte, float scale) {
    const v4p_u32 mag = byte & 0x7fu;
    if (mag == 0x7fu) return 0x7fc0u;
    float v = mag >= 8 ? v4p_f32_from_bits((mag << 20) + (120u << 23)) : (float)mag * v4p_f32_from_bits(118u << 23);
    if (byte & 0x80u) v = -v;
    return v4p_bf16_rne(v * scale);
}

/// What one lane loaded for one window row: 16 B (copy, RoPE) or 8 e4m3 bytes + their scale.
struct V4pGatherLoad {
    v4p_vec16 v;
    v4p_u32 scale;
};

/// Loads index typed pointers cast straight from the kernel's argument (a 64-bit element index:
/// row x elements per row never wraps), which lets nvcc emit global rather than generic loads.
template <bool FP8>
V4P_DEVICE V4pGatherLoad v4p_gather_load(const WindowGatherArgs& a, v4p_i64 row, v4p_u32 lane) {
    V4pGatherLoad l;
    l.scale = 0;
    if (!FP8) {
        l.v = v4p_in<v4p_vec16>(a.pool)[row * (1024 / 16) + lane];
    } else if (lane < V4P_NOPE_LANES) {
        const v4p_u64 q = v4p_in<v4p_u64>(a.pool)[row * (V4P_NOPE_ROW_BYTES / 8) + lane];
        l.v.x = (v4p_u32)q;
        l.v.y = (v4p_u32)(q >> 32);
        l.v.z = l.v.w = 0;
        // Tile lane / 8 (64 values); its scale is the even byte of the pair.
        l.scale = v4p_in<v4p_u8>(a.pool)[row * V4P_NOPE_ROW_BYTES + V4P_NOPE_VALUES + 2 * (lane / 8)];
    } else {
        l.v = v4p_in<v4p_vec16>(a.rope)[row * (V4P_ROPE_ROW_BYTES / 16) + (lane - V4P_NOPE_LANES)];
    }
    return l;
}

template <bool FP8>
V4P_DEVICE v4p_vec16 v4p_gather_value(V4pGatherLoad l, v4p_u32 lane) {
    if (!FP8 || lane >= V4P_NOPE_LANES) return l.v;
    const float scale = v4p_e8m0_scale(l.scale);
    v4p_u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const v4p_u32 pair = (i < 2 ? l.v.x : l.v.y) >> (16 * (i & 1));
        w[i] = v4p_fp8_scaled_bf16(pair & 0xffu, scale) | (v4p_fp8_scaled_bf16((pair >> 8) & 0xffu, scale) << 16);
    }
    v4p_vec16 o;
    o.x = w[0];
    o.y = w[1];
    o.z = w[2];
    o.w = w[3];
    return o;
}

template <bool FP8>
V4P_DEVICE void v4p_window_gather(const WindowGatherArgs& a) {
    const v4p_i32 b = (v4p_i32)v4p_bid_x();
    if (b >= a.num_seqs) return;
    const v4p_u32 tid = v4p_tid_x();
    const v4p_u32 lane = tid % V4POOL_GATHER_LANES, group = tid / V4POOL_GATHER_LANES;
    const v4p_i64 slot = v4p_in<v4p_i32>(a.state_slot_per_seq)[b];
    const v4p_i64 anchor = v4p_in<v4p_i64>(a.anchor_pos)[b];
    if (slot < 0) return;  // pad of a fixed grid: no store at all
    const v4p_i64 wd = a.draft_window;
    // 0: nothing (past the window, or a row outside the view), 1: zeros (p < 0), 2: a row.
    int what[V4P_GATHER_ROWS];
    v4p_i64 s[V4P_GATHER_ROWS];
    V4pGatherLoad l[V4P_GATHER_ROWS];
#pragma unroll
    for (int r = 0; r < V4P_GATHER_ROWS; ++r) {
        s[r] = (v4p_i64)v4p_bid_y() * V4POOL_GATHER_ROWS_PER_BLOCK + r * V4P_GATHER_GROUPS + group;
        what[r] = 0;
        if (s[r] >= wd) continue;
        const v4p_i64 p = anchor - (wd - 1) + s[r];
        if (p < 0) {
            what[r] = 1;
            continue;
        }
        const v4p_i64 row = v4p_window_row_q(a.params, slot, v4p_ring_pos(a.params, p));
        if (row < 0 || row >= a.view_rows) continue;  // never for a staged lease: the row is in its slot
        what[r] = 2;
        l[r] = v4p_gather_load<FP8>(a, row, lane);
    }
#pragma unroll
    for (int r = 0; r < V4P_GATHER_ROWS; ++r) {
        if (what[r] == 0) continue;
        v4p_vec16 v;
        v.x = v.y = v.z = v.w = 0;
        if (what[r] == 2) v = v4p_gather_value<FP8>(l[r], lane);
        v4p_out<v4p_vec16>(a.out)[((v4p_i64)b * wd + s[r]) * (1024 / 16) + lane] = v;
    }
}

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_window_gather(WindowGatherArgs a) {
    v4p_window_gather<false>(a);
}

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_window_gather_fp8(WindowGatherArgs a) {
    v4p_window_gather<true>(a);
}

// ---- launch-overhead floor ------------------------------------------------------------------

extern "C" __global__ void v4pool_empty(void) {}

// =============================================================================================
// ---- KV row writers (issue 23): bf16 KV into the pool's row format ---------------------------
// New kernels of the forward's own-row writes go in this section (docs/forward.md).
// =============================================================================================
// grid (ceil(T / 8)), block 256: 8 tokens per block, 32 lanes per token (the row kernels'
// shape). fp8: lane i < 7 packs NoPE tile i (64 values: amax, its e8m0 scale, 64 e4m3 bytes and
// the scale twice), lane 7 copies the RoPE part and zeroes the padding; lanes 8..31 idle. bf16:
// every lane copies 16 of the 512 values. The pack formula is src/index/host/pack.rs's, integer
// for integer: the scale is the least power of two 2^(B-127) with amax / scale <= 448, and each
// value is x / scale (exact: a power of two) rounded to nearest even e4m3fn.

/// The e8m0 byte of a tile whose largest magnitude has f32 bits `amax` (non-negative): 0 for an
/// all-zero tile; else the exponent of amax minus 8, plus one when its mantissa passes 1.75
/// (448 = 1.75 x 2^8), at least 1 (amax below 448 x 2^-126).
V4P_DEVICE v4p_u32 v4p_e8m0_of_amax(v4p_u32 amax) {
    if (amax == 0) return 0;
    v4p_i32 b = (v4p_i32)(amax >> 23) - 8 + ((amax & 0x7fffffu) > 0x600000u ? 1 : 0);
    if (b < 1) b = 1;
    if (b > 254) b = 254;
    return (v4p_u32)b;
}

/// f32 bits `u` as e4m3fn, rounded to nearest even; magnitudes past 448 (and infinities)
/// saturate to 448, NaN is 0x7f with the sign, f32 subnormals become a signed zero.
V4P_DEVICE v4p_u32 v4p_e4m3_rne(v4p_u32 u) {
    const v4p_u32 s = (u >> 24) & 0x80u;
    const v4p_u32 a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return s | 0x7fu;
    if (a >= 0x43e00000u) return s | 0x7eu;  // >= 448
    const v4p_i32 e = (v4p_i32)(a >> 23) - 127;
    v4p_u32 code, rem, half;
    if (e >= -6) {
        code = ((v4p_u32)(e + 7) << 3) | ((a & 0x7fffffu) >> 20);
        rem = a & 0xfffffu;
        half = 0x80000u;
    } else {
        if ((a >> 23) == 0) return s;
        const v4p_u32 m = (a & 0x7fffffu) | 0x800000u;
        const v4p_u32 sh = (v4p_u32)(14 - e);  // value / 2^-9 = m >> sh; sh >= 21
        if (sh > 31) return s;
        code = m >> sh;
        rem = m & ((1u << sh) - 1u);
        half = 1u << (sh - 1u);
    }
    if (rem > half || (rem == half && (code & 1u))) code += 1;
    if (code > 0x7eu) code = 0x7eu;
    return s | code;
}

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_kv_rows(KvRowsArgs a) {
    const v4p_u32 tid = v4p_tid_x();
    const v4p_i64 t = (v4p_i64)v4p_bid_x() * V4POOL_ROWS_PER_BLOCK + tid / V4POOL_ROW_LANES;
    const v4p_u32 lane = tid % V4POOL_ROW_LANES;
    if (t >= a.num_tokens) return;
    if (a.batch_id_per_token != 0 && v4p_in<v4p_i32>(a.batch_id_per_token)[t] < 0) return;
    const v4p_i64 row = v4p_in<v4p_i32>(a.dest_rows)[t];
    if (row < 0 || row >= a.view_rows) return;  // dropped, not wrapped
    const v4p_u16* src = v4p_in<v4p_u16>(a.kv) + t * a.kv_row_stride;
    if (!a.fp8) {
        v4p_u16* dst = v4p_out<v4p_u16>(a.nope) + row * 512;
        for (v4p_u32 i = lane * 16; i < lane * 16 + 16; ++i) dst[i] = src[i];
        return;
    }
    v4p_u8* nope = v4p_out<v4p_u8>(a.nope) + row * V4P_NOPE_ROW_BYTES;
    if (lane < 7) {
        const v4p_u16* x = src + lane * 64;
        v4p_u32 amax = 0;
        for (int i = 0; i < 64; ++i) {
            const v4p_u32 m = ((v4p_u32)x[i] << 16) & 0x7fffffffu;
            if (m <= 0x7f800000u && m > amax) amax = m;  // NaN never the amax
        }
        const v4p_u32 b = v4p_e8m0_of_amax(amax);
        // 1 / scale = 2^(127 - b), a normal f32 for every b the formula gives (1..248).
        const float inv = b == 0 ? 0.0f : v4p_f32_from_bits((254u - b) << 23);
        for (int i = 0; i < 64; ++i)
            nope[lane * 64 + i] = (v4p_u8)v4p_e4m3_rne(v4p_f32_bits(v4p_f32_from_bits((v4p_u32)x[i] << 16) * inv));
        nope[V4P_NOPE_VALUES + 2 * lane] = (v4p_u8)b;
        nope[V4P_NOPE_VALUES + 2 * lane + 1] = (v4p_u8)b;
    } else if (lane == 7) {
        v4p_u16* rope = v4p_out<v4p_u16>(a.rope) + row * (V4P_ROPE_ROW_BYTES / 2);
        for (int i = 0; i < 64; ++i) rope[i] = src[V4P_NOPE_VALUES + i];
        for (int i = V4P_NOPE_VALUES + 14; i < V4P_NOPE_ROW_BYTES; ++i) nope[i] = 0;
    }
}

// ---- the indexer's key rows (v4pool_index_keys) ---------------------------------------------
// grid (ceil(T / 8)), block 256: 8 keys per block, 32 lanes per key, 4 of its 128 values per
// lane. No lane reads another's result (the C++ emulation runs lanes one after another), so a
// lane that needs a row's or a group's amax computes it itself. The formulas are
// src/index/host/keys.rs's, integer for integer (docs/forward.md, "Indexer keys"):
//   FP8: per row, B = v4p_e8m0_of_amax(max(amax, 1e-4)): the least power of two 2^(B-127) with
//        max(amax, 1e-4) / scale <= 448 (an all-zero row gets 2^-22), stored as an f32; each
//        value x / scale (exact) rounded to nearest even e4m3fn, saturating at 448.
//   FP4: per group of 32 values, the least e8m0 byte B with amax / 2^(B-127) <= 6 (0 for an
//        all-zero group); each value x / scale rounded to nearest even e2m1, saturating at 6.
// amax ignores NaN and counts infinities.

/// The e8m0 byte of a group whose largest magnitude has f32 bits `amax`, to fit e2m1's 6:
/// 0 for an all-zero group; else the exponent of amax minus 2, plus one when its mantissa
/// passes 1.5 (6 = 1.5 x 2^2), at least 1 (at most 253: amax = inf).
V4P_DEVICE v4p_u32 v4p_e8m0_of_amax_e2m1(v4p_u32 amax) {
    if (amax == 0) return 0;
    v4p_i32 b = (v4p_i32)(amax >> 23) - 2 + ((amax & 0x7fffffu) > 0x400000u ? 1 : 0);
    if (b < 1) b = 1;
    return (v4p_u32)b;
}

/// f32 bits `u` as an e2m1 nibble (sign in bit 3), rounded to nearest even code: codes 0..7 are
/// 0, 0.5, 1, 1.5, 2, 3, 4, 6; the midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to the even
/// code; 6 and past (infinities and NaN too) saturate to 6 with the sign.
V4P_DEVICE v4p_u32 v4p_e2m1_rne(v4p_u32 u) {
    const v4p_u32 s = (u >> 28) & 0x8u;
    const v4p_u32 a = u & 0x7fffffffu;  // positive f32 bits order as their values
    v4p_u32 c;
    if (a <= 0x3e800000u) c = 0;        // <= 0.25
    else if (a < 0x3f400000u) c = 1;    // < 0.75
    else if (a <= 0x3fa00000u) c = 2;   // <= 1.25
    else if (a < 0x3fe00000u) c = 3;    // < 1.75
    else if (a <= 0x40200000u) c = 4;   // <= 2.5
    else if (a < 0x40600000u) c = 5;    // < 3.5
    else if (a <= 0x40a00000u) c = 6;   // <= 5
    else c = 7;
    return s | c;
}

/// Largest magnitude (f32 bits) of `n` bf16 values, NaN ignored.
V4P_DEVICE v4p_u32 v4p_bf16_amax(const v4p_u16* x, int n) {
    v4p_u32 amax = 0;
    for (int i = 0; i < n; ++i) {
        const v4p_u32 m = ((v4p_u32)x[i] << 16) & 0x7fffffffu;
        if (m <= 0x7f800000u && m > amax) amax = m;
    }
    return amax;
}

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_index_keys(IndexKeysArgs a) {
    const v4p_u32 tid = v4p_tid_x();
    const v4p_i64 t = (v4p_i64)v4p_bid_x() * V4POOL_ROWS_PER_BLOCK + tid / V4POOL_ROW_LANES;
    const v4p_u32 lane = tid % V4POOL_ROW_LANES;
    if (t >= a.num_tokens) return;
    const v4p_i64 rows = a.block_rows;
    const v4p_i64 e = v4p_in<v4p_i32>(a.dest)[t];
    if (e < 0 || e >= a.num_blocks * rows) return;  // dropped, not wrapped
    const v4p_i64 block = e / rows, r = e % rows;
    const v4p_u16* src = v4p_in<v4p_u16>(a.keys) + t * a.key_row_stride;
    const v4p_u32 i0 = lane * 4;
    if (a.format == 0) {
        v4p_u16* dst = v4p_out<v4p_u16>(a.data) + e * 128;
        for (v4p_u32 i = i0; i < i0 + 4; ++i) dst[i] = src[i];
        return;
    }
    if (a.format == 1) {
        v4p_u8* blk = v4p_out<v4p_u8>(a.data) + block * rows * 132;
        v4p_u32 amax = v4p_bf16_amax(src, 128);
        if (amax < 0x38d1b717u) amax = 0x38d1b717u;  // 1e-4f
        const v4p_u32 b = v4p_e8m0_of_amax(amax);  // 105..247 here: scale and 1/scale normal
        const float inv = v4p_f32_from_bits((254u - b) << 23);
        for (v4p_u32 i = i0; i < i0 + 4; ++i)
            blk[r * 128 + i] = (v4p_u8)v4p_e4m3_rne(v4p_f32_bits(v4p_f32_from_bits((v4p_u32)src[i] << 16) * inv));
        if (lane == 0) v4p_out<v4p_u32>(a.data)[(block * rows * 132 + rows * 128 + r * 4) / 4] = b << 23;
        return;
    }
    // FP4: lane 8g + j holds values 32g + 4j .. + 3 of group g: bytes 2j, 2j + 1 of its 16.
    const v4p_u32 g = lane / 8, j = lane % 8;
    const v4p_u32 b = v4p_e8m0_of_amax_e2m1(v4p_bf16_amax(src + 32 * g, 32));
    // 1 / scale = 2^(127 - b), a normal f32 for every b the formula gives (1..253).
    const float inv = b == 0 ? 0.0f : v4p_f32_from_bits((254u - b) << 23);
    v4p_u8* data = v4p_out<v4p_u8>(a.data) + block * rows * 64 + ((v4p_i64)g * rows + r) * 16;
    for (v4p_u32 k = 0; k < 2; ++k) {
        const v4p_u32 lo = (v4p_u32)src[i0 + 2 * k] << 16, hi = (v4p_u32)src[i0 + 2 * k + 1] << 16;
        data[2 * j + k] = (v4p_u8)(v4p_e2m1_rne(v4p_f32_bits(v4p_f32_from_bits(lo) * inv)) |
                                   (v4p_e2m1_rne(v4p_f32_bits(v4p_f32_from_bits(hi) * inv)) << 4));
    }
    if (j == 0) v4p_out<v4p_u8>(a.scales)[block * rows * 4 + (v4p_i64)g * rows + r] = (v4p_u8)b;
}
