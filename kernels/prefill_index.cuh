// prefill_index.cuh — the prefill index builder (docs/index-buffers.md section 6) and its window
// writer.
//
// Part of the one translation unit kernels/v4pool_kernels.cu: included there after v4pool_common.h
// and the helpers several families share, whose names it uses; never compiled on its own (no
// include guard, no includes of its own).

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
