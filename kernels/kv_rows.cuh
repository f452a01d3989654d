// kv_rows.cuh — the KV row writers: bf16 KV of the forward's own rows into the pool's row format
// (docs/forward.md). New kernels of the forward's own-row writes go in this file, after the ones
// here.
//
// Part of the one translation unit kernels/v4pool_kernels.cu: included there after v4pool_common.h
// and the helpers several families share, whose names it uses; never compiled on its own (no
// include guard, no includes of its own).

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
