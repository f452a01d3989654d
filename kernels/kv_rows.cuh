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
// shape). 16-byte path (aligned rows, every V4 engine's): fp8: four lanes per NoPE tile (each
// loads the tile's 64 values, takes its amax and e8m0 scale, and writes 16 of its e4m3 bytes),
// the last four the RoPE part and the padding; bf16: every lane copies 32 bytes. Each lane's
// loads all go out before its stores. (Issue 34's step bench: the element path below, one lane
// per tile looping over 64 values with byte stores the compiler must order after the next
// load, took 14 us a launch at batch 1 and 25 us at 2,048 tokens, against 2 us for the bf16
// copy; it stays for unaligned sources.) Element path: lane i < 7 packs NoPE tile i (64
// values: amax, its e8m0 scale, 64 e4m3 bytes and the scale twice), lane 7 copies the RoPE part
// and zeroes the padding; bf16: every lane copies 16 of the 512 values. The pack formula is
// src/index/host/pack.rs's, integer
// for integer: the scale is the least power of two 2^(B-127) with amax / scale <= 448, and each
// value is x / scale (exact: a power of two) rounded to nearest even e4m3fn.

/// The least e8m0 byte B with amax / 2^(B-127) <= max (f32 bits, max a normal float): the
/// exponent of amax minus max's, plus one when amax's mantissa passes max's; 0 for amax = 0,
/// else clamped to 1..254 (src/format/ e8m0_fitting).
V4P_DEVICE v4p_u32 v4p_e8m0_fitting(v4p_u32 amax, v4p_u32 max) {
    if (amax == 0) return 0;
    v4p_i32 b = (v4p_i32)(amax >> 23) - ((v4p_i32)(max >> 23) - 127) + ((amax & 0x7fffffu) > (max & 0x7fffffu) ? 1 : 0);
    if (b < 1) b = 1;
    if (b > 254) b = 254;
    return (v4p_u32)b;
}

/// The e8m0 byte of a tile whose largest magnitude has f32 bits `amax` (non-negative): 0 for an
/// all-zero tile; else the exponent of amax minus 8, plus one when its mantissa passes 1.75
/// (448 = 1.75 x 2^8), at least 1 (amax below 448 x 2^-126).
V4P_DEVICE v4p_u32 v4p_e8m0_of_amax(v4p_u32 amax) { return v4p_e8m0_fitting(amax, 0x43e00000u); }

/// The e4m3 magnitude code (no sign) of positive finite f32 bits `a` under exponent bias `bias`
/// (7: e4m3fn, 8: e4m3fnuz), rounded to nearest even; past the largest code is the caller's to
/// saturate; f32 subnormals are 0 (src/format/ e4m3_magnitude).
V4P_DEVICE v4p_u32 v4p_e4m3_magnitude(v4p_u32 a, v4p_i32 bias) {
    const v4p_i32 e = (v4p_i32)(a >> 23) - 127;
    v4p_u32 code, rem, half;
    if (e >= 1 - bias) {
        code = ((v4p_u32)(e + bias) << 3) | ((a & 0x7fffffu) >> 20);
        rem = a & 0xfffffu;
        half = 0x80000u;
    } else {
        if ((a >> 23) == 0) return 0;
        const v4p_u32 m = (a & 0x7fffffu) | 0x800000u;
        const v4p_u32 sh = (v4p_u32)(21 - bias - e);  // value / 2^(-2 - bias) = m >> sh; sh >= 21
        if (sh > 31) return 0;
        code = m >> sh;
        rem = m & ((1u << sh) - 1u);
        half = 1u << (sh - 1u);
    }
    if (rem > half || (rem == half && (code & 1u))) code += 1;
    return code;
}

/// f32 bits `u` as e4m3fn, rounded to nearest even; magnitudes past 448 (and infinities)
/// saturate to 448, NaN is 0x7f with the sign, f32 subnormals become a signed zero.
V4P_DEVICE v4p_u32 v4p_e4m3_rne(v4p_u32 u) {
    const v4p_u32 s = (u >> 24) & 0x80u;
    const v4p_u32 a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return s | 0x7fu;
    if (a >= 0x43e00000u) return s | 0x7eu;  // >= 448
    const v4p_u32 code = v4p_e4m3_magnitude(a, 7);
    return s | (code > 0x7eu ? 0x7eu : code);
}

/// f32 bits `u` as e4m3fnuz (bias 8, largest 240, the one NaN 0x80, no -0), rounded to nearest
/// even, as aiter's gfx942 conversion writes it: NaN and infinities 0x80, finite magnitudes past
/// 240 clip to 240, anything rounding to zero 0x00 whatever its sign (src/format/ e4m3fnuz_rne).
V4P_DEVICE v4p_u32 v4p_e4m3fnuz_rne(v4p_u32 u) {
    const v4p_u32 a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return 0x80u;
    v4p_u32 code = a >= 0x43700000u ? 0x7fu : v4p_e4m3_magnitude(a, 8);  // >= 240
    if (code > 0x7fu) code = 0x7fu;
    return code == 0 ? 0u : (((u >> 24) & 0x80u) | code);
}

/// bf16 bits `x` times `inv` (1 / scale) as an e4m3fn byte: v4p_e4m3_rne of the product, but a
/// NaN value is 0x7f with its own sign. A product's NaN sign is the platform's (x86 keeps the
/// operand's, NVIDIA returns a canonical NaN), so the rule is on the input: every backend and
/// the host reference (src/format/ e4m3_of_scaled_bf16) write the same byte.
V4P_DEVICE bool v4p_bf16_is_nan(v4p_u32 x) { return (x & 0x7fffu) > 0x7f80u; }
/// The e4m3 byte of a NaN bf16 `x`: 0x7f with its sign.
V4P_DEVICE v4p_u32 v4p_e4m3_nan(v4p_u32 x) { return ((x >> 8) & 0x80u) | 0x7fu; }
V4P_DEVICE v4p_u32 v4p_e4m3_scaled(v4p_u32 x, float inv) {
    if (v4p_bf16_is_nan(x)) return v4p_e4m3_nan(x);
    return v4p_e4m3_rne(v4p_f32_bits(v4p_f32_from_bits(x << 16) * inv));
}

// On NVIDIA sm_89 and later the 16-byte paths convert and reduce with the hardware's own
// instructions: `cvt.rn.satfinite.e4m3x2.f32` (two f32 to two e4m3fn, nearest even, finite
// saturation: exactly v4p_e4m3_rne but for the sign of a NaN, which v4p_e4m3_bf16x2 sets from
// the input as v4p_e4m3_scaled does) and
// `max.bf16x2` (a NaN operand yields the other: NaN is never the amax, as below). The
// software forms cost ~40 instructions a value; at batch 1 a row write is latency-bound and a
// node of the decode step fetched ~10 KB of straight-line code per lane for its 16 values
// (issue 34's ablation, 2026-12-02: 4.6 us a layer batch of own rows against 1.5 for the state
// update, whose path has no conversion). HIP (gfx942's fp8 instructions are the FNUZ variant,
// not e4m3fn), the host emulation and older targets keep the software forms; the host
// reference (src/format/) is the formula for both.
#if (defined(V4P_TARGET_NVCC) || defined(V4P_TARGET_CLANG_CUDA)) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define V4P_HW_FP8 1
#endif

/// The larger of `amax` and the magnitudes (f32 bits) of the two bf16 in word `w`, NaN
/// ignored (the low half is the earlier value).
V4P_DEVICE v4p_u32 v4p_amax_bf16x2(v4p_u32 amax, v4p_u32 w) {
    const v4p_u32 lo = (w << 16) & 0x7fffffffu, hi = w & 0x7fff0000u;
    if (lo <= 0x7f800000u && lo > amax) amax = lo;
    if (hi <= 0x7f800000u && hi > amax) amax = hi;
    return amax;
}

#ifdef V4P_HW_FP8
/// Lane-wise max of two bf16x2 words of magnitudes (sign bits clear), a NaN lane yielding the
/// other operand's.
V4P_DEVICE v4p_u32 v4p_hmax2(v4p_u32 a, v4p_u32 b) {
    v4p_u32 d;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
#endif

/// Largest magnitude (f32 bits) of the bf16 in `n` vectors, NaN ignored.
V4P_DEVICE v4p_u32 v4p_amax_vecs(const v4p_u32x4* w, int n) {
#ifdef V4P_HW_FP8
    // Four independent chains of bf16x2 maxima over the magnitudes (the accumulators start at
    // +0 and a NaN lane keeps the accumulator's), then the two halves as f32 bits: the same
    // value as the integer form (non-negative non-NaN floats order as their bits).
    const v4p_u32 m = 0x7fff7fffu;
    v4p_u32 a = 0, b = 0, c = 0, d = 0;
    for (int k = 0; k < n; ++k) {
        a = v4p_hmax2(a, w[k].x & m);
        b = v4p_hmax2(b, w[k].y & m);
        c = v4p_hmax2(c, w[k].z & m);
        d = v4p_hmax2(d, w[k].w & m);
    }
    const v4p_u32 r = v4p_hmax2(v4p_hmax2(a, b), v4p_hmax2(c, d));
    const v4p_u32 lo = r << 16, hi = r & 0xffff0000u;
    return lo > hi ? lo : hi;
#else
    v4p_u32 amax = 0;
    for (int k = 0; k < n; ++k) {
        amax = v4p_amax_bf16x2(amax, w[k].x);
        amax = v4p_amax_bf16x2(amax, w[k].y);
        amax = v4p_amax_bf16x2(amax, w[k].z);
        amax = v4p_amax_bf16x2(amax, w[k].w);
    }
    return amax;
#endif
}

/// The e4m3 bytes of f32 bits `lo`, `hi`, packed little-endian into the low 16 bits
/// (v4p_e4m3_rne of each, but for the sign of a NaN).
V4P_DEVICE v4p_u32 v4p_e4m3x2(v4p_u32 lo, v4p_u32 hi) {
#ifdef V4P_HW_FP8
    unsigned short h;
    // d = [cvt(a) : cvt(b)]: a is the upper byte.
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(v4p_f32_from_bits(hi)), "f"(v4p_f32_from_bits(lo)));
    return h;  // a NaN's sign: the caller's rule (v4p_e4m3_bf16x2)
#else
    return v4p_e4m3_rne(lo) | (v4p_e4m3_rne(hi) << 8);
#endif
}

/// The e4m3 bytes of the two bf16 in word `w` times `inv` (exact: a power of two), packed
/// little-endian into the low 16 bits; each v4p_e4m3_scaled of its value (a NaN keeps the
/// input's sign).
V4P_DEVICE v4p_u32 v4p_e4m3_bf16x2(v4p_u32 w, float inv) {
    v4p_u32 r = v4p_e4m3x2(v4p_f32_bits(v4p_f32_from_bits(w << 16) * inv),
                           v4p_f32_bits(v4p_f32_from_bits(w & 0xffff0000u) * inv));
    if (v4p_bf16_is_nan(w & 0xffffu)) r = (r & 0xff00u) | v4p_e4m3_nan(w & 0xffffu);
    if (v4p_bf16_is_nan(w >> 16)) r = (r & 0x00ffu) | (v4p_e4m3_nan(w >> 16) << 8);
    return r;
}

/// Vectors `2q` and `2q + 1` of `w` (q in 0..3) by selects, not an indexed load: an array
/// indexed by a run-time value lives in local memory (the stack frame the 16-byte paths had).
V4P_DEVICE void v4p_quarter(const v4p_u32x4* w, v4p_u32 q, v4p_u32x4& a, v4p_u32x4& b) {
    a = w[0];
    b = w[1];
    if (q == 1) {
        a = w[2];
        b = w[3];
    }
    if (q == 2) {
        a = w[4];
        b = w[5];
    }
    if (q == 3) {
        a = w[6];
        b = w[7];
    }
}

/// The e4m3 bytes of the eight bf16 in `w0`, `w1` (values in order), four to a word.
V4P_DEVICE v4p_u32x4 v4p_e4m3_bf16x8(v4p_u32x4 w0, v4p_u32x4 w1, float inv) {
    v4p_u32x4 r;
    r.x = v4p_e4m3_bf16x2(w0.x, inv) | (v4p_e4m3_bf16x2(w0.y, inv) << 16);
    r.y = v4p_e4m3_bf16x2(w0.z, inv) | (v4p_e4m3_bf16x2(w0.w, inv) << 16);
    r.z = v4p_e4m3_bf16x2(w1.x, inv) | (v4p_e4m3_bf16x2(w1.y, inv) << 16);
    r.w = v4p_e4m3_bf16x2(w1.z, inv) | (v4p_e4m3_bf16x2(w1.w, inv) << 16);
    return r;
}

/// One scale group of a FlashMLA format (src/format/): the least e8m0 scale with
/// max(amax, 448e-4) / scale <= 448 (FlashMLA's tests/quant.py:
/// 2^ceil(log2(max(amax / 448, 1e-4)))), the `n` values `x / scale` as e4m3 bytes at `out`;
/// returns the scale's byte. NaN is never the amax.
V4P_DEVICE v4p_u32 v4p_flashmla_group(const v4p_u16* x, int n, v4p_u8* out) {
    v4p_u32 amax = 0x3d378034u;  // 448e-4 as f32 bits: FlashMLA's floor
    for (int i = 0; i < n; ++i) {
        const v4p_u32 m = ((v4p_u32)x[i] << 16) & 0x7fffffffu;
        if (m <= 0x7f800000u && m > amax) amax = m;
    }
    const v4p_u32 b = v4p_e8m0_of_amax(amax);
    const float inv = v4p_f32_from_bits((254u - b) << 23);
    for (int i = 0; i < n; ++i) out[i] = (v4p_u8)v4p_e4m3_scaled(x[i], inv);
    return b;
}

/// Token `t`'s destination row (`row` when `row_known`, else dest_rows[t]), or -1 when its
/// batch id marks a pad token. Both loads go out together (each buffer holds num_tokens
/// entries, so reading a pad token's row is in bounds): one round trip after the wait, where
/// the check-then-load form took two in a row.
V4P_DEVICE v4p_i64 v4p_kv_dest(const KvRowsArgs& a, v4p_i64 t, bool row_known, v4p_i64 row) {
    const v4p_i32 bid = a.batch_id_per_token != 0 ? v4p_in<v4p_i32>(a.batch_id_per_token)[t] : 0;
    if (!row_known) row = v4p_in<v4p_i32>(a.dest_rows)[t];
    return bid < 0 ? -1 : row;
}

/// FlashMLA's V4 formats (3: pages of 64, 5: pages of 2; src/format/ `flashmla-v4`,
/// `flashmla-v4-p2`): plane row R = view_row0 + row sits in page R / P (P x 584 bytes), its 576
/// data bytes at R mod P data rows in, its 8 scale bytes after the page's P data rows, at
/// P x 576 + (R mod P) x 8. FlashMLA's sparse decode reads a row of a [pages, P, 1, 584] view
/// by the same arithmetic (splitkv_mla.cuh).
V4P_DEVICE bool v4p_is_flashmla_v4(v4p_i32 format) {
    return format == V4P_KV_ROWS_FLASHMLA_V4 || format == V4P_KV_ROWS_FLASHMLA_V4_P2;
}
template <v4p_i64 P>
V4P_DEVICE void v4p_flashmla_v4_place_in(v4p_u64 plane, v4p_i64 r, v4p_u64& data, v4p_u64& scales) {
    const v4p_u64 page = plane + (v4p_u64)(r / P) * (v4p_u64)(P * 584);
    data = page + (v4p_u64)(r % P) * 576;
    scales = page + (v4p_u64)P * 576 + (v4p_u64)(r % P) * 8;
}
// The page a compile-time constant in each branch: r / P and r mod P are shifts, not divisions.
V4P_DEVICE void v4p_flashmla_v4_place(const KvRowsArgs& a, v4p_i64 row, v4p_u64& data, v4p_u64& scales) {
    const v4p_i64 r = a.view_row0 + row;
    if (a.format == V4P_KV_ROWS_FLASHMLA_V4_P2)
        v4p_flashmla_v4_place_in<V4P_PAGE_ROWS_FLASHMLA_V4_P2>(a.nope, r, data, scales);
    else
        v4p_flashmla_v4_place_in<V4P_PAGE_ROWS_FLASHMLA_V4>(a.nope, r, data, scales);
}

/// The FlashMLA formats' 16-byte path (every row start 16-byte aligned; see v4p_kv_rows_token):
/// the source loads of a lane first, then the batch id and destination row, then the stores.
/// Formats 3 and 5 (V4, 584 B paged): lane L < 28 loads NoPE tile L / 4 (64 values, eight vectors; the
/// four lanes of a tile read the same 128 bytes), takes FlashMLA's scale of it and stores its
/// quarter L % 4 as 16 e4m3 bytes, quarter 0 also the scale byte; lanes 28..31 copy 32 bytes
/// of RoPE each, lane 28 zeroes the pad byte. Format 2 (V4.1, 528 B): lane i < 16 loads group i
/// (32 values, four vectors), stores 32 e4m3 bytes and its scale byte. The bytes are
/// v4p_flashmla_group's (same floor, same rounding; tests hold both to src/format/).
V4P_DEVICE void v4p_flashmla_row_vec(const KvRowsArgs& a, v4p_i64 t, v4p_u32 lane, bool row_known, v4p_i64 row) {
    const v4p_ptr s = (v4p_ptr)(v4p_in<v4p_u16>(a.kv) + t * a.kv_row_stride);
    const bool v4 = v4p_is_flashmla_v4(a.format);
    if (!v4 && lane >= 16) return;
    v4p_u32x4 w[8];
    if (v4 && lane < 28) {
        for (int k = 0; k < 8; ++k) w[k] = v4p_ld16(s + (lane / 4) * 128 + 16 * k);
    } else if (v4) {
        w[0] = v4p_ld16(s + 2 * V4P_NOPE_VALUES + 32 * (lane - 28));
        w[1] = v4p_ld16(s + 2 * V4P_NOPE_VALUES + 32 * (lane - 28) + 16);
    } else {
        for (int k = 0; k < 4; ++k) w[k] = v4p_ld16(s + 64 * lane + 16 * k);
    }
    row = v4p_kv_dest(a, t, row_known, row);
    if (row < 0 || row >= a.view_rows) return;  // dropped, not wrapped
    const v4p_u32 floor_bits = 0x3d378034u;  // 448e-4 as f32 bits: FlashMLA's floor
    if (!v4) {
        v4p_u32 amax = v4p_amax_vecs(w, 4);
        if (amax < floor_bits) amax = floor_bits;
        const v4p_u32 b = v4p_e8m0_of_amax(amax);
        const float inv = v4p_f32_from_bits((254u - b) << 23);
        const v4p_u64 out = a.nope + row_byte_offset(row, 528);
        v4p_st16(out + 32 * lane, v4p_e4m3_bf16x8(w[0], w[1], inv));
        v4p_st16(out + 32 * lane + 16, v4p_e4m3_bf16x8(w[2], w[3], inv));
        *(v4p_u8*)(out + 512 + lane) = (v4p_u8)b;
        return;
    }
    v4p_u64 data, scale_at;
    v4p_flashmla_v4_place(a, row, data, scale_at);
    v4p_u8* scales = (v4p_u8*)scale_at;
    if (lane < 28) {
        const v4p_u32 tile = lane / 4, q = lane % 4;
        v4p_u32 amax = v4p_amax_vecs(w, 8);
        if (amax < floor_bits) amax = floor_bits;
        const v4p_u32 b = v4p_e8m0_of_amax(amax);
        const float inv = v4p_f32_from_bits((254u - b) << 23);
        v4p_u32x4 w0, w1;
        v4p_quarter(w, q, w0, w1);
        v4p_st16(data + tile * 64 + q * 16, v4p_e4m3_bf16x8(w0, w1, inv));
        if (q == 0) scales[tile] = (v4p_u8)b;
        return;
    }
    const v4p_u32 j = lane - 28;
    v4p_st16(data + 448 + 32 * j, w[0]);
    v4p_st16(data + 448 + 32 * j + 16, w[1]);
    if (j == 0) scales[7] = 0;
}

/// Token `t`'s row, lane `lane`, of v4pool_kv_rows; `row` is dest_rows[t] when `row_known`
/// (v4pool_write_batch loads it before its wait where the destinations are a host upload),
/// else loaded here. The 16-byte path when every row start is 16-byte aligned (the pool's views
/// always are; the source when its base and row stride are, as every engine tensor's): the same
/// for the whole launch, so no lane diverges on it; anything else takes the element path. On
/// the 16-byte path the source row's loads (which depend on the token alone) go out before the
/// batch id and destination row come back, and every load of a lane before its first store:
/// one round trip. fp8: lane L < 28 loads its tile's 64 values (tile L / 4: eight vectors, the
/// four lanes of a tile read the same 128 bytes), takes their amax and scale, and stores 16 of
/// the 64 bytes (quarter L % 4) as one vector, quarter 0 the scale twice; lanes 28..31 copy 32
/// bytes of RoPE each and zero the padding (bytes 462..511: 2 bytes, then three vectors).
V4P_DEVICE void v4p_fp4_row(const KvRowsArgs& a, v4p_i64 t, v4p_u32 lane, bool row_known, v4p_i64 row, bool vec);

V4P_DEVICE void v4p_kv_rows_token(const KvRowsArgs& a, v4p_i64 t, v4p_u32 lane, bool row_known, v4p_i64 row) {
    const v4p_u16* src = v4p_in<v4p_u16>(a.kv) + t * a.kv_row_stride;
    if (a.format == V4P_KV_ROWS_FLASHMLA_V41_FP4) {
        // FlashMLA V4.1 fp4 (288-B rows): a packed pool's compressed rows (v4p_fp4_row).
        v4p_fp4_row(a, t, lane, row_known, row, ((a.kv | ((v4p_u64)a.kv_row_stride * 2)) & 15) == 0);
        return;
    }
    if (a.format >= V4P_KV_ROWS_FLASHMLA_V41 && ((a.kv | ((v4p_u64)a.kv_row_stride * 2) | a.nope) & 15) == 0) {
        v4p_flashmla_row_vec(a, t, lane, row_known, row);
        return;
    }
    if (a.format >= V4P_KV_ROWS_FLASHMLA_V41) {
        // The FlashMLA formats (2: V4.1 528 B; 3, 5: V4 584 B paged) off the 16-byte path.
        row = v4p_kv_dest(a, t, row_known, row);
        if (row < 0 || row >= a.view_rows) return;  // dropped, not wrapped
    }
    if (a.format == V4P_KV_ROWS_FLASHMLA_V41) {
        // FlashMLA V4.1 (528-B rows, src/format/ `flashmla-v41`): lane i < 16 packs group i of
        // 32 values: the least e8m0 scale with max(amax, 448e-4) / scale <= 448 (FlashMLA's
        // tests/quant.py: 2^ceil(log2(max(amax / 448, 1e-4)))), 32 e4m3 bytes, the scale byte at
        // 512 + i. Lanes 16..31 idle.
        if (lane >= 16) return;
        v4p_u8* out = v4p_out<v4p_u8>(a.nope) + row * 528;
        out[512 + lane] = (v4p_u8)v4p_flashmla_group(src + lane * 32, 32, out + lane * 32);
        return;
    }
    if (v4p_is_flashmla_v4(a.format)) {
        // FlashMLA V4 (584-B rows in pages, v4p_flashmla_v4_place). Lane i < 7 packs NoPE tile
        // i (64 values, FlashMLA's floor as in format 2) and writes scale byte i; lane 7 copies
        // the 64 bf16 RoPE values after the 448 e4m3 and zeroes the pad byte.
        v4p_u64 data_at, scale_at;
        v4p_flashmla_v4_place(a, row, data_at, scale_at);
        v4p_u8* data = (v4p_u8*)data_at;
        v4p_u8* scales = (v4p_u8*)scale_at;
        if (lane < 7) {
            scales[lane] = (v4p_u8)v4p_flashmla_group(src + lane * 64, 64, data + lane * 64);
        } else if (lane == 7) {
            v4p_u16* rope = (v4p_u16*)(data + 448);
            for (int i = 0; i < 64; ++i) rope[i] = src[V4P_NOPE_VALUES + i];
            scales[7] = 0;
        }
        return;
    }
    const bool fp8 = a.format == V4P_KV_ROWS_ATOM_FP8;
    const bool vec = ((a.kv | ((v4p_u64)a.kv_row_stride * 2) | a.nope | a.rope) & 15) == 0;
    if (vec) {
        const v4p_ptr s = (v4p_ptr)src;
        v4p_u32x4 w[8];
        if (!fp8) {
            w[0] = v4p_ld16(s + 32 * lane);
            w[1] = v4p_ld16(s + 32 * lane + 16);
        } else if (lane < 28) {
            for (int k = 0; k < 8; ++k) w[k] = v4p_ld16(s + (lane / 4) * 128 + 16 * k);
        } else {
            w[0] = v4p_ld16(s + 2 * V4P_NOPE_VALUES + 32 * (lane - 28));
            w[1] = v4p_ld16(s + 2 * V4P_NOPE_VALUES + 32 * (lane - 28) + 16);
        }
        row = v4p_kv_dest(a, t, row_known, row);
        if (row < 0 || row >= a.view_rows) return;  // dropped, not wrapped
        if (!fp8) {
            const v4p_u64 d = a.nope + row_byte_offset(row, 1024) + 32 * lane;
            v4p_st16(d, w[0]);
            v4p_st16(d + 16, w[1]);
            return;
        }
        const v4p_u64 nope = a.nope + row_byte_offset(row, V4P_NOPE_ROW_BYTES);
        if (lane < 28) {
            const v4p_u32 tile = lane / 4, q = lane % 4;
            const v4p_u32 b = v4p_e8m0_of_amax(v4p_amax_vecs(w, 8));
            // 1 / scale = 2^(127 - b), a normal f32 for every b the formula gives (1..248).
            const float inv = b == 0 ? 0.0f : v4p_f32_from_bits((254u - b) << 23);
            v4p_u32x4 w0, w1;
            v4p_quarter(w, q, w0, w1);
            v4p_st16(nope + tile * 64 + q * 16, v4p_e4m3_bf16x8(w0, w1, inv));
            if (q == 0) *(v4p_u16*)(nope + V4P_NOPE_VALUES + 2 * tile) = (v4p_u16)(b | (b << 8));
            return;
        }
        const v4p_u32 j = lane - 28;
        const v4p_u64 rope = a.rope + row_byte_offset(row, V4P_ROPE_ROW_BYTES);
        v4p_st16(rope + 32 * j, w[0]);
        v4p_st16(rope + 32 * j + 16, w[1]);
        v4p_u32x4 zero;
        zero.x = zero.y = zero.z = zero.w = 0;
        if (j == 0)
            *(v4p_u16*)(nope + V4P_NOPE_VALUES + 14) = 0;
        else
            v4p_st16(nope + 464 + 16 * (j - 1), zero);
        return;
    }
    row = v4p_kv_dest(a, t, row_known, row);
    if (row < 0 || row >= a.view_rows) return;  // dropped, not wrapped
    if (!fp8) {
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
            nope[lane * 64 + i] = (v4p_u8)v4p_e4m3_scaled(x[i], inv);
        nope[V4P_NOPE_VALUES + 2 * lane] = (v4p_u8)b;
        nope[V4P_NOPE_VALUES + 2 * lane + 1] = (v4p_u8)b;
    } else if (lane == 7) {
        v4p_u16* rope = v4p_out<v4p_u16>(a.rope) + row * (V4P_ROPE_ROW_BYTES / 2);
        for (int i = 0; i < 64; ++i) rope[i] = src[V4P_NOPE_VALUES + i];
        for (int i = V4P_NOPE_VALUES + 14; i < V4P_NOPE_ROW_BYTES; ++i) nope[i] = 0;
    }
}

/// Block `bid` of v4pool_kv_rows.
V4P_DEVICE void v4p_kv_rows_block(const KvRowsArgs& a, v4p_u32 bid) {
    const v4p_u32 tid = v4p_tid_x();
    const v4p_i64 t = (v4p_i64)bid * V4POOL_ROWS_PER_BLOCK + tid / V4POOL_ROW_LANES;
    if (t >= a.num_tokens) return;
    v4p_kv_rows_token(a, t, tid % V4POOL_ROW_LANES, false, 0);
}

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_kv_rows(KvRowsArgs a) {
    v4p_overlap_begin();  // before any global access (launched as a dependent)
    v4p_kv_rows_block(a, v4p_bid_x());
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
//   ATOM FP8 (3: OCP e4m3, max 448; 4: e4m3fnuz, max 240; src/format/ ATOM_FP8_KEYS and
//        ATOM_FP8_FNUZ_KEYS): the FP8 rule at the encoding's max, over the finite values only (a
//        NaN or infinite value is the encoding's NaN: 0x7f with its sign, or 0x80), the value
//        bytes in ATOM's preshuffled order: (r / 16) x 2048 + (d / 16) x 256 + (r % 16) x 16 + d % 16.
// amax ignores NaN and counts infinities (but in the ATOM formats).

/// The e8m0 byte of a group whose largest magnitude has f32 bits `amax`, to fit e2m1's 6:
/// 0 for an all-zero group; else the exponent of amax minus 2, plus one when its mantissa
/// passes 1.5 (6 = 1.5 x 2^2), at least 1 (at most 253: amax = inf).
V4P_DEVICE v4p_u32 v4p_e8m0_of_amax_e2m1(v4p_u32 amax) { return v4p_e8m0_fitting(amax, 0x40c00000u); }

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

/// bf16 bits `x` times `inv` as an e2m1 nibble: v4p_e2m1_rne of the product, a NaN value 6 with
/// its own sign (the input's, as v4p_e4m3_scaled; src/format/ e2m1_of_scaled_bf16).
V4P_DEVICE v4p_u32 v4p_e2m1_scaled(v4p_u32 x, float inv) {
    if (v4p_bf16_is_nan(x)) return ((x >> 12) & 0x8u) | 0x7u;
    return v4p_e2m1_rne(v4p_f32_bits(v4p_f32_from_bits(x << 16) * inv));
}

/// Token `t`'s row in FlashMLA's V4.1 fp4 format (288-B rows, src/format/ `flashmla-v41-fp4`):
/// lane i packs group i of 16 values — the e4m3 scale of amax / 6 rounded to nearest even (amax
/// over the group, NaN ignored, infinities counted), 1 / scale (0 for a zero scale), the values
/// as e2m1 nibbles (v4p_e2m1_scaled: nearest even, saturating at 6, a NaN 6 with its sign), the
/// even-indexed value in the low nibble, 8 bytes at 8i, then the scale byte at 256 + i. Both
/// divisions are IEEE f32 divisions, as the host reference's (CUDA and HIP compile `/` correctly
/// rounded: no fast-math flag, and the quotient rounds once to f32 before e4m3, as on the host).
/// `vec`: the source row is 16-byte aligned (two vector loads); the loads go out before the
/// destination row comes back.
V4P_DEVICE void v4p_fp4_row(const KvRowsArgs& a, v4p_i64 t, v4p_u32 lane, bool row_known, v4p_i64 row, bool vec) {
    const v4p_u16* src = v4p_in<v4p_u16>(a.kv) + t * a.kv_row_stride + lane * 16;
    v4p_u32 w[8];
    if (vec) {
        const v4p_u32x4 v0 = v4p_ld16((v4p_ptr)src), v1 = v4p_ld16((v4p_ptr)src + 16);
        w[0] = v0.x, w[1] = v0.y, w[2] = v0.z, w[3] = v0.w;
        w[4] = v1.x, w[5] = v1.y, w[6] = v1.z, w[7] = v1.w;
    } else {
        for (int k = 0; k < 8; ++k) w[k] = (v4p_u32)src[2 * k] | ((v4p_u32)src[2 * k + 1] << 16);
    }
    row = v4p_kv_dest(a, t, row_known, row);
    if (row < 0 || row >= a.view_rows) return;  // dropped, not wrapped
    v4p_u32 amax = 0;
    for (int k = 0; k < 8; ++k) amax = v4p_amax_bf16x2(amax, w[k]);
    const v4p_u32 sb = v4p_e4m3_rne(v4p_f32_bits(v4p_f32_from_bits(amax) / 6.0f));
    const float scale = v4p_e4m3_value(sb);  // sb <= 0x7e: amax / 6 is never NaN
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    v4p_u8* out = v4p_out<v4p_u8>(a.nope) + row * 288;
    for (int k = 0; k < 8; ++k) {
        out[8 * lane + k] = (v4p_u8)(v4p_e2m1_scaled(w[k] & 0xffffu, inv) | (v4p_e2m1_scaled(w[k] >> 16, inv) << 4));
    }
    out[256 + lane] = (v4p_u8)sb;
}

/// Largest magnitude (f32 bits) of `n` bf16 values, NaN ignored; from 16-byte vectors (all
/// loads before the first compare) when `vec` (`x` 16-byte aligned, `n` a multiple of 8).
V4P_DEVICE v4p_u32 v4p_bf16_amax(const v4p_u16* x, int n, bool vec) {
    v4p_u32 amax = 0;
    if (vec) {
        v4p_u32x4 w[16];  // n <= 128
        for (int k = 0; k < n / 8; ++k) w[k] = v4p_ld16((v4p_ptr)x + 16 * k);
        return v4p_amax_vecs(w, n / 8);
    }
    for (int i = 0; i < n; ++i) {
        const v4p_u32 m = ((v4p_u32)x[i] << 16) & 0x7fffffffu;
        if (m <= 0x7f800000u && m > amax) amax = m;
    }
    return amax;
}

/// Block `bid` of v4pool_index_keys (the kernel, and v4pool_write_batch's index-key items).
V4P_DEVICE void v4p_index_keys_entry(const IndexKeysArgs& a, v4p_i64 t, v4p_u32 lane, v4p_i64 e);

V4P_DEVICE void v4p_index_keys_block(const IndexKeysArgs& a, v4p_u32 bid) {
    const v4p_u32 tid = v4p_tid_x();
    const v4p_i64 t = (v4p_i64)bid * V4POOL_ROWS_PER_BLOCK + tid / V4POOL_ROW_LANES;
    if (t >= a.num_tokens) return;
    v4p_index_keys_entry(a, t, tid % V4POOL_ROW_LANES, v4p_in<v4p_i32>(a.dest)[t]);
}

/// Key `t` to entry `e` (dest[t], loaded by the caller: v4pool_write_batch loads it before its
/// wait, the destinations being a host upload), lane `lane`.
V4P_DEVICE void v4p_index_keys_entry(const IndexKeysArgs& a, v4p_i64 t, v4p_u32 lane, v4p_i64 e) {
    const v4p_i64 rows = a.block_rows;
    if (e < 0 || e >= a.num_blocks * rows) return;  // dropped, not wrapped
    const v4p_i64 block = e / rows, r = e % rows;
    const v4p_u16* src = v4p_in<v4p_u16>(a.keys) + t * a.key_row_stride;
    const v4p_u32 i0 = lane * 4;
    // The amax from 16-byte vectors when the rows are 16-byte aligned (uniform per launch).
    const bool vec = ((a.keys | ((v4p_u64)a.key_row_stride * 2)) & 15) == 0;
    if (a.format == V4P_INDEX_KEYS_BF16) {
        v4p_u16* dst = v4p_out<v4p_u16>(a.data) + e * 128;
        for (v4p_u32 i = i0; i < i0 + 4; ++i) dst[i] = src[i];
        return;
    }
    if (a.format == V4P_INDEX_KEYS_FP8) {
        v4p_u8* blk = v4p_out<v4p_u8>(a.data) + block * rows * 132;
        v4p_u32 amax = v4p_bf16_amax(src, 128, vec);
        if (amax < 0x38d1b717u) amax = 0x38d1b717u;  // 1e-4f
        const v4p_u32 b = v4p_e8m0_of_amax(amax);  // 105..247 here: scale and 1/scale normal
        const float inv = v4p_f32_from_bits((254u - b) << 23);
        // The lane's four values as two bf16x2 words, their four e4m3 bytes in one store
        // (the row's bytes i0..i0 + 3: a 4-byte aligned word, 132 and 128 being multiples of 4).
        v4p_u32 w01, w23;
        if (vec) {
            w01 = ((const v4p_u32*)(src + i0))[0];
            w23 = ((const v4p_u32*)(src + i0))[1];
        } else {
            w01 = (v4p_u32)src[i0] | ((v4p_u32)src[i0 + 1] << 16);
            w23 = (v4p_u32)src[i0 + 2] | ((v4p_u32)src[i0 + 3] << 16);
        }
        *(v4p_u32*)(blk + r * 128 + i0) = v4p_e4m3_bf16x2(w01, inv) | (v4p_e4m3_bf16x2(w23, inv) << 16);
        if (lane == 0) v4p_out<v4p_u32>(a.data)[(block * rows * 132 + rows * 128 + r * 4) / 4] = b << 23;
        return;
    }
    if (a.format == V4P_INDEX_KEYS_ATOM_FP8 || a.format == V4P_INDEX_KEYS_ATOM_FP8_FNUZ) {
        // Every lane takes the row's amax over its finite values (NaN and infinities are the
        // encoding's NaN, not part of the scale), then writes its four values: bytes
        // d % 16 .. + 3 of one 16-byte tile row, a 4-byte aligned word.
        const bool fnuz = a.format == V4P_INDEX_KEYS_ATOM_FP8_FNUZ;
        v4p_u32 amax = 0;
        for (int i = 0; i < 128; ++i) {
            const v4p_u32 m = ((v4p_u32)src[i] << 16) & 0x7fffffffu;
            if (m < 0x7f800000u && m > amax) amax = m;
        }
        if (amax < 0x38d1b717u) amax = 0x38d1b717u;  // 1e-4f
        const v4p_u32 b = v4p_e8m0_fitting(amax, fnuz ? 0x43700000u : 0x43e00000u);  // 105..248
        const float inv = v4p_f32_from_bits((254u - b) << 23);
        v4p_u32 word = 0;
        for (v4p_u32 k = 0; k < 4; ++k) {
            const v4p_u32 x = src[i0 + k];
            v4p_u32 q;
            if ((x & 0x7f80u) == 0x7f80u) {
                q = fnuz ? 0x80u : (((x >> 8) & 0x80u) | 0x7fu);
            } else {
                const v4p_u32 p = v4p_f32_bits(v4p_f32_from_bits(x << 16) * inv);
                q = fnuz ? v4p_e4m3fnuz_rne(p) : v4p_e4m3_rne(p);
            }
            word |= q << (8 * k);
        }
        v4p_u8* blk = v4p_out<v4p_u8>(a.data) + block * rows * 132;
        const v4p_i64 at = (r / 16) * 2048 + (v4p_i64)(i0 / 16) * 256 + (r % 16) * 16 + i0 % 16;
        *(v4p_u32*)(blk + at) = word;
        if (lane == 0) v4p_out<v4p_u32>(a.data)[(block * rows * 132 + rows * 128 + r * 4) / 4] = b << 23;
        return;
    }
    // FP4: lane 8g + j holds values 32g + 4j .. + 3 of group g: bytes 2j, 2j + 1 of its 16.
    const v4p_u32 g = lane / 8, j = lane % 8;
    const v4p_u32 b = v4p_e8m0_of_amax_e2m1(v4p_bf16_amax(src + 32 * g, 32, vec));
    // 1 / scale = 2^(127 - b), a normal f32 for every b the formula gives (1..253).
    const float inv = b == 0 ? 0.0f : v4p_f32_from_bits((254u - b) << 23);
    v4p_u8* data = v4p_out<v4p_u8>(a.data) + block * rows * 64 + ((v4p_i64)g * rows + r) * 16;
    for (v4p_u32 k = 0; k < 2; ++k) {
        data[2 * j + k] =
            (v4p_u8)(v4p_e2m1_scaled(src[i0 + 2 * k], inv) | (v4p_e2m1_scaled(src[i0 + 2 * k + 1], inv) << 4));
    }
    if (j == 0) v4p_out<v4p_u8>(a.scales)[block * rows * 4 + (v4p_i64)g * rows + r] = (v4p_u8)b;
}

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_index_keys(IndexKeysArgs a) {
    v4p_overlap_begin();  // before any global access (launched as a dependent)
    v4p_index_keys_block(a, v4p_bid_x());
}

// ---- several writes in one launch (v4pool_write_batch) ---------------------------------------
// grid (num_blocks), block 256 (every item's own kernel's block). Block b finds its item (the
// last one whose first block is <= b: a binary search over at most 128 i32, L1-resident after
// the first blocks) and runs block b - first_block of it through the item's own kernel body, so
// a batched write is the per-layer write bit for bit. Launched as a programmatic dependent: the
// item table and first blocks are host uploads made before the kernel preceding this one
// started (WriteBatch::set, refused while a stream captures), so the search and the item's
// arguments load before the wait, while the predecessor still runs, and so does each item's
// host-staged metadata (WriteBatchArgs' input readiness): a plan row, a key's destination, a
// staged row write's destination row. The write's data (the engine's inputs, and a decode
// write's destination rows, the builder's output) and every store come after the wait. At
// batch 1 that takes a dependent round trip off each layer's critical path. Threads of a block
// take one item: no divergence on the kind.
extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_write_batch(WriteBatchArgs a) {
    v4p_overlap_trigger();  // the next launch may start now; this one waits below
    const v4p_i32 b = (v4p_i32)v4p_bid_x();
    const v4p_i32* first = v4p_in<v4p_i32>(a.first_block);
    v4p_i32 lo = 0, hi = a.num_items - 1;
    while (lo < hi) {
        const v4p_i32 mid = (lo + hi + 1) / 2;
        if (first[mid] <= b)
            lo = mid;
        else
            hi = mid - 1;
    }
    const WriteItem it = v4p_in<WriteItem>(a.items)[lo];
    const v4p_u32 block = (v4p_u32)(b - first[lo]), tid = v4p_tid_x();
    // Before the wait, what the host staged (the contract of WriteBatchArgs): a state update's
    // plan row, an index key's destination, and the destination row of a KV row write without
    // batch ids (the writer's staged window or compressed rows; a decode write's rows are the
    // builder's output and its batch ids mark them: those load after the wait).
    if (it.kind == V4POOL_WRITE_STATE_UPDATE) {
        const StateUpdateArgs& s = it.args.state;
        const v4p_u32 lanes = v4p_state_lanes(s.dim);
        const v4p_i64 r = (v4p_i64)block * (V4P_BLOCK / lanes) + tid / lanes;
        v4p_u32x4 row;
        row.x = row.y = row.z = row.w = 0;
        if (r < s.num_rows) row = v4p_ld16(s.write_plan + (v4p_u64)r * 16);
        v4p_overlap_wait();
        if (r < s.num_rows) v4p_state_update_row(s, row, tid % lanes, lanes);
        return;
    }
    const v4p_i64 t = (v4p_i64)block * V4POOL_ROWS_PER_BLOCK + tid / V4POOL_ROW_LANES;
    const v4p_u32 lane = tid % V4POOL_ROW_LANES;
    if (it.kind == V4POOL_WRITE_INDEX_KEYS) {
        const IndexKeysArgs& k = it.args.index_keys;
        const v4p_i64 e = t < k.num_tokens ? (v4p_i64)v4p_in<v4p_i32>(k.dest)[t] : -1;
        v4p_overlap_wait();
        if (t < k.num_tokens) v4p_index_keys_entry(k, t, lane, e);
        return;
    }
    if (it.kind == V4POOL_WRITE_KV_ROWS) {
        const KvRowsArgs& w = it.args.kv_rows;
        const bool staged = w.batch_id_per_token == 0 && t < w.num_tokens;
        const v4p_i64 row = staged ? (v4p_i64)v4p_in<v4p_i32>(w.dest_rows)[t] : 0;
        v4p_overlap_wait();
        if (t < w.num_tokens) v4p_kv_rows_token(w, t, lane, staged, row);
        return;
    }
    v4p_overlap_wait();
}
