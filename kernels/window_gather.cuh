// window_gather.cuh — the DSpark window gather (docs/index-buffers.md section 9), copy and fp8
// forms.
//
// Part of the one translation unit kernels/v4pool_kernels.cu: included there after v4pool_common.h
// and the helpers several families share, whose names it uses; never compiled on its own (no
// include guard, no includes of its own).

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
/// Lanes of a group that write NoPE values (8 each); the other 8 copy the RoPE part.
#define V4P_NOPE_LANES (V4P_NOPE_VALUES / 8)
/// bf16 bits of `f`, rounded to nearest even (as a cast to bf16 does); NaN is 0x7fc0.
V4P_DEVICE v4p_u32 v4p_bf16_rne(float f) {
    const v4p_u32 u = v4p_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/// The e8m0 scale byte `e` as a float: 2^(e-127), 0 for e = 0 (an all-zero tile).
V4P_DEVICE float v4p_e8m0_scale(v4p_u32 e) { return e == 0 ? 0.0f : v4p_f32_from_bits(e << 23); }

/// The value of an e4m3fn byte other than NaN (0x7f / 0xff): a normal byte's exponent and
/// mantissa are an f32's once the bias difference (127 - 7 = 120) is added to the exponent; a
/// subnormal one is m x 2^-9; both exact. (The KV row writer's fp4 scales decode through it too.)
V4P_DEVICE float v4p_e4m3_value(v4p_u32 byte) {
    const v4p_u32 mag = byte & 0x7fu;
    const float v =
        mag >= 8 ? v4p_f32_from_bits((mag << 20) + (120u << 23)) : (float)mag * v4p_f32_from_bits(118u << 23);
    return (byte & 0x80u) ? -v : v;
}

/// One e4m3fn byte times `scale`, as bf16 bits: the only rounding is the product's (as
/// float(x) * scale does). 0x7f / 0xff are NaN.
V4P_DEVICE v4p_u32 v4p_fp8_scaled_bf16(v4p_u32 byte, float scale) {
    if ((byte & 0x7fu) == 0x7fu) return 0x7fc0u;
    return v4p_bf16_rne(v4p_e4m3_value(byte) * scale);
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
