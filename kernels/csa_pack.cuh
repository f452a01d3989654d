// csa_pack.cuh — the CSA translate-pack, one layer (docs/index-buffers.md section 5): the gather
// form and the staged decode forms.
//
// Part of the one translation unit kernels/v4pool_kernels.cu: included there after v4pool_common.h
// and the helpers several families share, whose names it uses; never compiled on its own (no
// include guard, no includes of its own).

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

/// FlashMLA mode (index-buffers.md §5f; extra_topk > 0): the thread's columns c0 + u * 256 of
/// token t's output row from `from` to the row's end get -1 (the tail), and tile 0's thread 0
/// stores the row's length. A pad calls it with from = 0 and length 0. After the wait only.
template <int E>
V4P_DEVICE void csa_flash_tail(const CsaPackArgs& a, v4p_i32 t, v4p_i64 c0, v4p_i64 from, v4p_i64 tile, v4p_u32 tid,
                               v4p_i64 len) {
    v4p_i32* row = v4p_out<v4p_i32>(a.out) + (v4p_i64)t * a.extra_topk;
#pragma unroll
    for (int u = 0; u < E; ++u) {
        const v4p_i64 k = c0 + u * V4P_BLOCK;
        if (k >= from && k < a.extra_topk) row[k] = -1;
    }
    if (tile == 0 && tid == 0) v4p_out<v4p_i32>(a.extra_topk_length)[t] = (v4p_i32)len;
}

/// A packed entry as stored: CSR mode the biased row; FlashMLA mode the biased row + the
/// layer's shift, or -1 for a negative top-k value (transformers' -1 tail; FlashMLA skips -1).
/// shift is 0 in CSR mode (a launch check), so one expression serves both.
V4P_DEVICE v4p_i32 csa_store_value(const CsaPackArgs& a, v4p_i32 v, v4p_i32 blk, v4p_i32 r) {
    if (a.extra_topk > 0 && v < 0) return -1;
    return csa_biased_row(blk, r, a.envelope_rows, a.compress_bias + a.shift);
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
    const bool flash = a.extra_topk > 0;  // FlashMLA rows (§5f): whole rows, pads included
    const v4p_i64 c00 = (v4p_i64)tile * TILE + tid;
    if (b < 0) {  // block-uniform, like every return before the barrier
        if (flash) {
            v4p_overlap_wait();  // every store after the wait
            csa_flash_tail<E>(a, t, c00, 0, tile, tid, 0);
        }
        return;
    }
    const v4p_i64 row_stride = a.topk_row_stride;
    const v4p_i64 valid_k = end - base - v4p_min(pos + 1, (v4p_i64)a.window_size);
    // FlashMLA mode never stores past its row (a longer head is the host's error).
    const v4p_i64 lim = flash ? v4p_min(v4p_min(valid_k, row_stride), (v4p_i64)a.extra_topk)
                              : v4p_min(valid_k, row_stride);
    if (flash ? (v4p_i64)tile * TILE >= a.extra_topk : ((v4p_i64)tile * TILE >= lim && valid_k <= row_stride))
        return;  // nothing in this tile
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
    v4p_i32* out = v4p_out<v4p_i32>(a.out) + (flash ? (v4p_i64)t * a.extra_topk : base);
#pragma unroll
    for (int u = 0; u < E; ++u) {
        const v4p_i32 k = c0 + u * V4P_BLOCK;
        if (k < lim32) out[k] = csa_store_value(a, v[u], blk[u], r[u]);
    }
    if (flash) return csa_flash_tail<E>(a, t, c0, v4p_max(lim, (v4p_i64)0), tile, tid, v4p_max(lim, (v4p_i64)0));
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
    const bool flash = a.extra_topk > 0;  // FlashMLA rows (§5f; decode): pads included
    if (b < 0) {
        if (flash) csa_flash_tail<2>(a, t, k0, 0, tile, tid, 0);
        return;
    }
    const v4p_i64 skip = a.window_size > 0 ? v4p_min(skip_src + 1, (v4p_i64)a.window_size) : skip_src;
    const v4p_i64 valid_k = end - base - skip;
    const v4p_i64 lim =
        flash ? v4p_min(v4p_min(valid_k, row_stride), (v4p_i64)a.extra_topk) : v4p_min(valid_k, row_stride);
    const v4p_i32* table = v4p_in<v4p_i32>(a.block_tables) + (v4p_i64)b * a.block_table_stride;
    const v4p_i32 cap = a.block_capacity;
    const v4p_i32 last = a.block_table_stride - 1;
    v4p_i32 j[2], r[2], blk[2];
    csa_split<2>(v, cap, csa_cap_shift(cap), last, j, r);
#pragma unroll
    for (int u = 0; u < 2; ++u) blk[u] = k0 + u * V4P_BLOCK < lim ? table[j[u]] : 0;
    v4p_i32* out = v4p_out<v4p_i32>(a.out) + (flash ? (v4p_i64)t * a.extra_topk : base);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const v4p_i64 k = k0 + u * V4P_BLOCK;
        if (k < lim) out[k] = csa_store_value(a, v[u], blk[u], r[u]);
    }
    if (flash) return csa_flash_tail<2>(a, t, k0, v4p_max(lim, (v4p_i64)0), tile, tid, v4p_max(lim, (v4p_i64)0));
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
