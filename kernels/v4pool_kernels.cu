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
// instructions before). The index builders and the forward's writers (KV rows, index keys,
// state update) begin with v4p_overlap_begin(): the CUDA backend launches them as programmatic
// dependents, so a graph of a decode step's launches overlaps each launch with the kernel before
// it (the CSA pack's decode form and the write batch also their loads of host-staged metadata:
// §5, csa_pack.cuh; kv_rows.cuh). Other stores of consecutive entries are coalesced 4-byte stores
// across a warp; every row x width product of a plane address is 64-bit.
//
// Files. This is the one translation unit: the shared header, the device helpers several kernel
// families use, then one file per family, included in this order (build.rs inlines every
// include, with #line markers, into the one string NVRTC / hiprtc compile):
//   decode_index.cuh   decode index builder with fused HCA heads; HCA compressed offsets
//   prefill_index.cuh  prefill index builder
//   csa_pack.cuh       CSA translate-pack
//   row_write.cuh      SWA ring write and row scatter
//   state_update.cuh   compressor-state update; fill / copy runs
//   window_gather.cuh  DSpark window gather
//   kv_rows.cuh        KV row writers (the forward's own rows), indexer keys, and the write
//                      batch (several of those writes and state updates in one launch)
#include "v4pool_common.h"

// ---- device helpers of several families ------------------------------------------------------

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

// ---- 16-byte vectors (the state update, the KV row and index-key writers) -----------------------

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

/// A plain 16-byte global store (the pool's rows: attention reads them soon, no streaming hint).
V4P_DEVICE void v4p_st16(v4p_u64 p, v4p_u32x4 v) {
#if defined(V4P_TARGET_NVCC) || defined(V4P_TARGET_CLANG_CUDA)
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
    *(v4p_u32x4*)p = v;
#endif
}

// ---- the pool's fp8 row format (the window gather reads it, the KV row writers write it) -----

/// fp8 NoPE row: 448 e4m3 values in 7 tiles of 64, the scales (twice each) from byte 448.
#define V4P_NOPE_ROW_BYTES 512
#define V4P_NOPE_VALUES 448
#define V4P_ROPE_ROW_BYTES 128

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

// ---- launch-overhead floor ------------------------------------------------------------------

extern "C" __global__ void v4pool_empty(void) {}

// ---- the kernel families, one file each ------------------------------------------------------

#include "decode_index.cuh"
#include "prefill_index.cuh"
#include "csa_pack.cuh"
#include "row_write.cuh"
#include "state_update.cuh"
#include "window_gather.cuh"
#include "kv_rows.cuh"
