// state_update.cuh — the compressor-state update (docs/index-buffers.md section 8) and the fill /
// copy runs that initialise and copy compressor-state slots.
//
// Part of the one translation unit kernels/v4pool_kernels.cu: included there after v4pool_common.h
// and the helpers several families share, whose names it uses; never compiled on its own (no
// include guard, no includes of its own).

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

// The 16-byte vector loads and stores (v4p_u32x4, v4p_ld16, v4p_ld8, v4p_st16_cs) are the
// shared helpers of v4pool_kernels.cu.

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

/// Block `bid` of v4pool_update_compressor_states (the kernel, and v4pool_write_batch's
/// state-update items).
V4P_DEVICE void v4p_state_update_row(const StateUpdateArgs& a, v4p_u32x4 row, v4p_u32 lane, v4p_u32 lanes);

V4P_DEVICE void v4p_state_update_block(const StateUpdateArgs& a, v4p_u32 bid) {
    const v4p_u32 lanes = v4p_state_lanes(a.dim);
    const v4p_u32 tid = v4p_tid_x(), lane = tid % lanes;
    const v4p_i64 r = (v4p_i64)bid * (V4P_BLOCK / lanes) + tid / lanes;
    if (r >= a.num_rows) return;
    v4p_state_update_row(a, v4p_ld16(a.write_plan + (v4p_u64)r * 16), lane, lanes);
}

/// Plan row `row` (loaded by the caller: v4pool_write_batch loads it before its wait, the plan
/// being a host upload) of v4pool_update_compressor_states, lane `lane` of `lanes`.
V4P_DEVICE void v4p_state_update_row(const StateUpdateArgs& a, v4p_u32x4 row, v4p_u32 lane, v4p_u32 lanes) {
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

extern "C" __global__ V4P_LAUNCH_BOUNDS(V4POOL_BLOCK_THREADS) void v4pool_update_compressor_states(StateUpdateArgs a) {
    v4p_overlap_begin();  // before any global access (launched as a dependent)
    v4p_state_update_block(a, v4p_bid_x());
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
