// v4pool_common.h — what every v4pool kernel shares, with no vendor headers.
//
// One header for four compilers: nvcc and NVRTC (CUDA), clang -x cuda (-nocudainc) and
// clang -x hip / hiprtc (-nogpuinc). It holds
//   * a portable prelude (thread/block ids, barrier, launch bounds, 16-byte vectors);
//   * fixed-width integer typedefs (v4p_i32, v4p_i64, ...);
//   * every launch-argument struct of src/index/mod.rs, field for field, with its layout
//     pinned by V4POOL_CHECK_* lines that the device compilers enforce and that
//     tests/layout/kernel_layout.rs compares with the Rust structs (offset_of!/size_of/align_of);
//   * the device transcription of the geometry formulas (index-buffers.md §2).
//
// Keep every layout line in the form `V4POOL_CHECK_xxx(Type, [field,] N);` on one line: the
// Rust test parses them.
#pragma once

// ---- prelude --------------------------------------------------------------------------------

#if defined(__HIP__)
// clang -x hip (with -nogpuinc) or hiprtc: AMDGCN builtins, no HIP headers.
#define V4P_TARGET_HIP 1
#elif defined(__NVCC__) || defined(__CUDACC_RTC__)
// nvcc / NVRTC: the CUDA built-in variables exist without any include.
#define V4P_TARGET_NVCC 1
#elif defined(__CUDA__) && defined(__clang__)
// clang -x cuda with -nocudainc: NVVM builtins, no CUDA headers.
#define V4P_TARGET_CLANG_CUDA 1
#elif defined(V4POOL_HOST_EMULATION)
// A plain C++ compile for tests: kernels become functions, the launcher below (`v4p_emu_run`)
// sets the ids and runs every thread of every block in turn (no kernel uses a barrier, so that
// is a valid schedule).
#define V4P_TARGET_EMU 1
#else
#error "v4pool kernels need a CUDA or HIP device compiler (nvcc, NVRTC, clang -x cuda, clang -x hip, hiprtc)"
#endif

// clang without the vendor wrapper headers knows the attributes but not the keywords.
#if defined(V4P_TARGET_HIP) || defined(V4P_TARGET_CLANG_CUDA)
#ifndef __global__
#define __global__ __attribute__((global))
#endif
#ifndef __device__
#define __device__ __attribute__((device))
#endif
#ifndef __shared__
#define __shared__ __attribute__((shared))
#endif
#ifndef __forceinline__
#define __forceinline__ __inline__ __attribute__((always_inline))
#endif
#endif

#define V4P_DEVICE __device__ __forceinline__
/// Out of line: a path no V4 geometry takes, kept off the hot path's instruction stream (a
/// cold L2 makes every instruction fetch miss of a small grid a DRAM round trip).
#define V4P_DEVICE_COLD __device__ __attribute__((noinline))

#if defined(V4P_TARGET_HIP)
V4P_DEVICE unsigned v4p_tid_x() { return __builtin_amdgcn_workitem_id_x(); }
V4P_DEVICE unsigned v4p_bid_x() { return __builtin_amdgcn_workgroup_id_x(); }
V4P_DEVICE unsigned v4p_bid_y() { return __builtin_amdgcn_workgroup_id_y(); }
V4P_DEVICE unsigned v4p_bid_z() { return __builtin_amdgcn_workgroup_id_z(); }
V4P_DEVICE void v4p_sync() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
#define V4P_LAUNCH_BOUNDS(n) __attribute__((amdgpu_flat_work_group_size(1, n)))
// The minimum blocks per SM is an NVIDIA register budget; AMD's differs: the size alone.
#define V4P_LAUNCH_BOUNDS_MIN(n, m) V4P_LAUNCH_BOUNDS(n)
#elif defined(V4P_TARGET_CLANG_CUDA)
V4P_DEVICE unsigned v4p_tid_x() { return __nvvm_read_ptx_sreg_tid_x(); }
V4P_DEVICE unsigned v4p_bid_x() { return __nvvm_read_ptx_sreg_ctaid_x(); }
V4P_DEVICE unsigned v4p_bid_y() { return __nvvm_read_ptx_sreg_ctaid_y(); }
V4P_DEVICE unsigned v4p_bid_z() { return __nvvm_read_ptx_sreg_ctaid_z(); }
V4P_DEVICE void v4p_sync() { __syncthreads(); }
#define V4P_LAUNCH_BOUNDS(n) __attribute__((launch_bounds(n)))
#define V4P_LAUNCH_BOUNDS_MIN(n, m) __attribute__((launch_bounds(n, m)))
#elif defined(V4P_TARGET_EMU)
#define __global__
#define __device__
#define __forceinline__ inline
struct v4p_emu_ids {
    unsigned tid, bx, by, bz;
};
static thread_local v4p_emu_ids v4p_emu;
// The emulation's launch (v4pool_emulation.cpp and the HIP runtime double): `kernel` on a copy
// of its argument struct, every thread of every block of `grid` in turn, `threads` per block.
template <typename Args>
static void v4p_emu_run(void (*kernel)(Args), const void* args, const unsigned grid[3], unsigned threads) {
    Args a;
    __builtin_memcpy(&a, args, sizeof(Args));
    for (unsigned z = 0; z < grid[2]; ++z)
        for (unsigned y = 0; y < grid[1]; ++y)
            for (unsigned x = 0; x < grid[0]; ++x)
                for (unsigned t = 0; t < threads; ++t) {
                    v4p_emu = v4p_emu_ids{t, x, y, z};
                    kernel(a);
                }
}
V4P_DEVICE unsigned v4p_tid_x() { return v4p_emu.tid; }
V4P_DEVICE unsigned v4p_bid_x() { return v4p_emu.bx; }
V4P_DEVICE unsigned v4p_bid_y() { return v4p_emu.by; }
V4P_DEVICE unsigned v4p_bid_z() { return v4p_emu.bz; }
V4P_DEVICE void v4p_sync() {}
#define V4P_LAUNCH_BOUNDS(n)
#define V4P_LAUNCH_BOUNDS_MIN(n, m)
#else
V4P_DEVICE unsigned v4p_tid_x() { return threadIdx.x; }
V4P_DEVICE unsigned v4p_bid_x() { return blockIdx.x; }
V4P_DEVICE unsigned v4p_bid_y() { return blockIdx.y; }
V4P_DEVICE unsigned v4p_bid_z() { return blockIdx.z; }
V4P_DEVICE void v4p_sync() { __syncthreads(); }
#define V4P_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#define V4P_LAUNCH_BOUNDS_MIN(n, m) __launch_bounds__(n, m)
#endif

// Programmatic dependent launch (sm_90+). The CUDA backend launches the index builders with
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, so the next kernel in the stream may
// start while this one runs: v4p_overlap_begin() lets the kernel after this one launch now
// (its blocks then sit in their own wait), and waits until the kernel before this one has
// finished and its writes are visible. Every kernel launched that way calls it before its
// first global load or store, so nothing reads or writes across that edge early; what
// overlaps is the launch, block scheduling and the prologue (the CSA translate-pack splits
// it, below, to overlap its metadata and block-table loads too). Without the attribute (any
// other launch, HIP, the host emulation, or a pre-Hopper target) it does nothing.
#if (defined(V4P_TARGET_NVCC) || defined(V4P_TARGET_CLANG_CUDA)) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void v4p_overlap_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void v4p_overlap_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
#else
__device__ __forceinline__ void v4p_overlap_trigger() {}
__device__ __forceinline__ void v4p_overlap_wait() {}
#endif
// The two halves apart: a kernel that opens with v4p_overlap_trigger() instead may load, before
// v4p_overlap_wait(), only inputs its contract declares complete before the kernel preceding it
// in the stream starts (the CSA translate-pack's metadata and block tables), never anything the
// kernel before it writes, and stores nothing before the wait.
__device__ __forceinline__ void v4p_overlap_begin() {
    v4p_overlap_trigger();
    v4p_overlap_wait();
}

// ---- fixed-width integers ---------------------------------------------------------------------

typedef signed char v4p_i8;
typedef unsigned char v4p_u8;
typedef unsigned short v4p_u16;
typedef int v4p_i32;
typedef unsigned int v4p_u32;
typedef long long v4p_i64;
typedef unsigned long long v4p_u64;
/// A raw device address, as src/index/mod.rs `DevicePtr` (u64); 0 = absent where stated.
typedef v4p_u64 v4p_ptr;

static_assert(sizeof(v4p_i32) == 4 && sizeof(v4p_u32) == 4, "32-bit ints");
static_assert(sizeof(v4p_i64) == 8 && sizeof(v4p_u64) == 8, "64-bit ints");
static_assert(sizeof(void*) == 8, "device pointers are 64-bit");

/// Sixteen bytes moved as one vector load/store (ld.global.v4 / global_load_dwordx4).
struct alignas(16) v4p_vec16 {
    v4p_u32 x, y, z, w;
};

// ---- launch constants (mirrored in src/index/shape.rs; tests/layout/kernel_layout.rs checks) ------

/// Threads per block of every kernel but v4pool_empty and the decode builder.
#define V4POOL_BLOCK_THREADS 256
/// Threads per block of the decode builder (v4pool_decode_indices).
#define V4POOL_DECODE_THREADS 128
/// Lanes that copy one row together in the row kernels (ring write, row scatter).
#define V4POOL_ROW_LANES 32
/// Rows one block of the row kernels copies: V4POOL_BLOCK_THREADS / V4POOL_ROW_LANES.
#define V4POOL_ROWS_PER_BLOCK 8
/// Blocks that share one run in fill_runs / copy_runs (grid y).
#define V4POOL_RUN_SPLIT 32
static_assert(V4POOL_ROWS_PER_BLOCK * V4POOL_ROW_LANES == V4POOL_BLOCK_THREADS, "row groups tile a block");
/// Fused HCA head entries one decode-builder block writes per round (grid x tiles the head):
/// 32 per thread, eight 16-byte stores.
#define V4POOL_DECODE_HCA_TILE 4096
/// FlashMLA compressed-row entries (§3f) one decode-builder block writes per round: as the CSR
/// head's tile, 32 per thread in eight 16-byte groups whose table entries all load before any
/// of its stores (each group goes to every view). At 1,024 tokens on an H100 the builder took
/// 18.4 us so, 23.9 with 512-entry tiles (4 a thread), the CSR builder 16.0 (2026-12-07,
/// docs/flashmla.md).
#define V4POOL_DECODE_FLASH_TILE 4096
/// FlashMLA compressed-row tiles the decode builder's grid holds over all its tokens, at most:
/// a larger batch gets fewer tiles a token, each striding over more of its row. The grid may
/// depend on the scalars only, so it covers the row's whole width, and a tile past a token's
/// row still costs a dispatch and three loads: at 1,024 x 2 tokens on an H100 the 16 tiles a
/// token took 84.4 us against the CSR builder's 23.7 (2026-12-07, docs/flashmla.md).
#define V4POOL_DECODE_FLASH_BLOCKS 4096
static_assert(V4POOL_DECODE_FLASH_TILE == V4POOL_DECODE_HCA_TILE, "the FlashMLA row's groups are the CSR head's");
static_assert(V4POOL_DECODE_FLASH_TILE % (4 * V4POOL_DECODE_THREADS) == 0, "whole 512-entry sub-tiles");
/// Lanes that build one token's lists in the prefill builder (two warps); a block holds
/// V4POOL_BLOCK_THREADS / V4POOL_PREFILL_LANES tokens.
#define V4POOL_PREFILL_LANES 64
#define V4POOL_PREFILL_TOKENS_PER_BLOCK 4
/// The prefill builder's short form (v4pool_prefill_indices_short): lanes per token, and the
/// longest HCA head (block_table_stride x hca_rows_per_block entries) it is launched for.
#define V4POOL_PREFILL_SHORT_LANES 16
#define V4POOL_PREFILL_SHORT_HEAD 256
/// Top-k columns one CSA translate-pack block covers (grid y): two per thread (the gather
/// form and v4pool_csa_translate_pack_staged), four per thread (..._staged_x4, top-k rows
/// longer than V4POOL_CSA_TILE).
#define V4POOL_CSA_TILE 512
#define V4POOL_CSA_TILE_X4 1024
/// Lanes that write one window row in the §9 gather: 64 x 16 B = one 1024-B bf16 row.
#define V4POOL_GATHER_LANES 64
/// Window rows one §9 gather block writes (grid y tiles the window): two per lane group.
#define V4POOL_GATHER_ROWS_PER_BLOCK 8
/// Largest grid y and z both vendors accept (shape.rs MAX_GRID_YZ).
#define V4POOL_MAX_GRID_YZ 65535
/// Element types of the state update's inputs (src/index/mod.rs ElemType).
#define V4POOL_DTYPE_F32 0
#define V4POOL_DTYPE_BF16 1
/// Elements one lane of the state update moves per chunk (16-byte bf16 loads, two 16-byte
/// f32 stores).
#define V4POOL_STATE_CHUNK 8
static_assert(V4POOL_DECODE_HCA_TILE == 32 * V4POOL_DECODE_THREADS, "32 entries per thread");
static_assert(V4POOL_CSA_TILE == 2 * V4POOL_BLOCK_THREADS, "two columns per thread");
static_assert(V4POOL_CSA_TILE_X4 == 4 * V4POOL_BLOCK_THREADS, "four columns per thread");
static_assert(V4POOL_PREFILL_LANES * V4POOL_PREFILL_TOKENS_PER_BLOCK == V4POOL_BLOCK_THREADS, "tokens tile a block");
static_assert(V4POOL_PREFILL_LANES % 32 == 0, "a prefill token owns whole warps (wave32 and wave64 halves)");
static_assert(V4POOL_BLOCK_THREADS % V4POOL_PREFILL_SHORT_LANES == 0, "short-form tokens tile a block");

// ---- layout checks ----------------------------------------------------------------------------

#define V4POOL_CHECK_SIZE(T, n) static_assert(sizeof(T) == (n), "size of " #T)
#define V4POOL_CHECK_ALIGN(T, n) static_assert(alignof(T) == (n), "alignment of " #T)
#if defined(__CUDACC_RTC__)
// NVRTC has no offsetof in any form (no __builtin_offsetof, no headers). Sizes and alignments
// are still checked here; the offsets were checked by nvcc and clang on this same text at build
// time, and the ABI is the same.
#define V4POOL_CHECK_OFFSET(T, f, n) static_assert(true, "")
#else
#define V4POOL_CHECK_OFFSET(T, f, n) static_assert(__builtin_offsetof(T, f) == (n), "offset of " #T "." #f)
#endif

// ---- launch argument structs (src/index/mod.rs, field for field) ------------------------------

struct WindowParams {
    v4p_i64 ring_start;
    v4p_i64 slot_rows;
    v4p_i64 ring_slots;
    v4p_i64 ring_stride;
    v4p_i64 run_rows;
};
V4POOL_CHECK_SIZE(WindowParams, 40);
V4POOL_CHECK_ALIGN(WindowParams, 8);
V4POOL_CHECK_OFFSET(WindowParams, ring_start, 0);
V4POOL_CHECK_OFFSET(WindowParams, slot_rows, 8);
V4POOL_CHECK_OFFSET(WindowParams, ring_slots, 16);
V4POOL_CHECK_OFFSET(WindowParams, ring_stride, 24);
V4POOL_CHECK_OFFSET(WindowParams, run_rows, 32);

#define V4POOL_CLASS_DENSE 0
#define V4POOL_CLASS_CSA 1
#define V4POOL_CLASS_HCA 2

struct ClassBuffers {
    WindowParams params;
    v4p_ptr indptr;     // i32 [>= T+1]; 0 = class off
    v4p_ptr indices;    // i32 out
    v4p_ptr dest_rows;  // i32 out [>= T]; 0 = none
};
V4POOL_CHECK_SIZE(ClassBuffers, 64);
V4POOL_CHECK_ALIGN(ClassBuffers, 8);
V4POOL_CHECK_OFFSET(ClassBuffers, params, 0);
V4POOL_CHECK_OFFSET(ClassBuffers, indptr, 40);
V4POOL_CHECK_OFFSET(ClassBuffers, indices, 48);
V4POOL_CHECK_OFFSET(ClassBuffers, dest_rows, 56);

// One class's decode-builder outputs in FlashMLA's convention (index-buffers.md §3f): rows of
// [num_views][num_tokens][topk] (window) and [num_views][num_tokens][extra_topk] (HCA's
// compressed part), view v's entries + shifts[v], -1 tails; indices == 0: off.
struct FlashMlaOut {
    v4p_ptr indices;            // i32 out [num_views][T][topk]
    v4p_ptr topk_length;        // i32 out [T]
    v4p_ptr extra_indices;      // i32 out [num_views][T][extra_topk]; HCA with block_tables only
    v4p_ptr extra_topk_length;  // i32 out [T]; with extra_indices
    v4p_ptr shifts;             // i32 [num_views]
    v4p_i32 topk;
    v4p_i32 extra_topk;
    v4p_i32 num_views;
    v4p_i32 _pad;
};
V4POOL_CHECK_SIZE(FlashMlaOut, 56);
V4POOL_CHECK_ALIGN(FlashMlaOut, 8);
V4POOL_CHECK_OFFSET(FlashMlaOut, indices, 0);
V4POOL_CHECK_OFFSET(FlashMlaOut, topk_length, 8);
V4POOL_CHECK_OFFSET(FlashMlaOut, extra_indices, 16);
V4POOL_CHECK_OFFSET(FlashMlaOut, extra_topk_length, 24);
V4POOL_CHECK_OFFSET(FlashMlaOut, shifts, 32);
V4POOL_CHECK_OFFSET(FlashMlaOut, topk, 40);
V4POOL_CHECK_OFFSET(FlashMlaOut, extra_topk, 44);
V4POOL_CHECK_OFFSET(FlashMlaOut, num_views, 48);
V4POOL_CHECK_OFFSET(FlashMlaOut, _pad, 52);

struct DecodeIndexArgs {
    ClassBuffers classes[3];
    v4p_ptr state_slot_per_seq;  // i32 [bs]
    v4p_ptr batch_id_per_token;  // i32 [>= T]
    v4p_ptr positions;           // i64 [>= T]
    v4p_ptr block_tables;        // i32 [bs, block_table_stride]; 0 = no fused HCA heads
    v4p_i64 envelope_rows;
    v4p_i32 block_table_stride;
    v4p_i32 hca_rows_per_block;
    v4p_i32 num_tokens;
    v4p_i32 win;
    FlashMlaOut flashmla[3];  // all zero: CSR only
};
V4POOL_CHECK_SIZE(DecodeIndexArgs, 416);
V4POOL_CHECK_ALIGN(DecodeIndexArgs, 8);
V4POOL_CHECK_OFFSET(DecodeIndexArgs, classes, 0);
V4POOL_CHECK_OFFSET(DecodeIndexArgs, state_slot_per_seq, 192);
V4POOL_CHECK_OFFSET(DecodeIndexArgs, batch_id_per_token, 200);
V4POOL_CHECK_OFFSET(DecodeIndexArgs, positions, 208);
V4POOL_CHECK_OFFSET(DecodeIndexArgs, block_tables, 216);
V4POOL_CHECK_OFFSET(DecodeIndexArgs, envelope_rows, 224);
V4POOL_CHECK_OFFSET(DecodeIndexArgs, block_table_stride, 232);
V4POOL_CHECK_OFFSET(DecodeIndexArgs, hca_rows_per_block, 236);
V4POOL_CHECK_OFFSET(DecodeIndexArgs, num_tokens, 240);
V4POOL_CHECK_OFFSET(DecodeIndexArgs, win, 244);
V4POOL_CHECK_OFFSET(DecodeIndexArgs, flashmla, 248);

struct PrefillIndexArgs {
    WindowParams dense;
    WindowParams csa;
    WindowParams hca;
    v4p_ptr positions;                // i32 [T]
    v4p_ptr bid_per_token;            // i32 [T]
    v4p_ptr chunk_start_per_seq;      // i32 [bs]
    v4p_ptr cu_seqlens_q_per_seq;     // i32 [bs]
    v4p_ptr state_slot_per_seq;       // i32 [bs]
    v4p_ptr n_committed_hca_per_seq;  // i32 [bs]
    v4p_ptr block_tables;             // i32 [bs, block_table_stride]
    v4p_ptr extend_indptr;
    v4p_ptr extend_indices;
    v4p_ptr swa_indptr;  // 0 = no dense class
    v4p_ptr swa_indices;
    v4p_ptr csa_indptr;
    v4p_ptr csa_indices;
    v4p_ptr hca_indptr;
    v4p_ptr hca_indices;
    v4p_i64 envelope_rows;
    v4p_i32 block_table_stride;
    v4p_i32 num_tokens;
    v4p_i32 win;
    v4p_i32 hca_ratio;
    v4p_i32 hca_rows_per_block;
    // 0: V4's coarse slice [window | compressed], the compressed head from the block tables;
    // 1: the coarse slot packed per layer (V4.1): [top-k head (left to the pack) | window].
    v4p_i32 coarse_packed;
};
V4POOL_CHECK_SIZE(PrefillIndexArgs, 272);
V4POOL_CHECK_ALIGN(PrefillIndexArgs, 8);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, dense, 0);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, csa, 40);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, hca, 80);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, positions, 120);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, bid_per_token, 128);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, chunk_start_per_seq, 136);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, cu_seqlens_q_per_seq, 144);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, state_slot_per_seq, 152);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, n_committed_hca_per_seq, 160);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, block_tables, 168);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, extend_indptr, 176);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, extend_indices, 184);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, swa_indptr, 192);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, swa_indices, 200);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, csa_indptr, 208);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, csa_indices, 216);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, hca_indptr, 224);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, hca_indices, 232);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, envelope_rows, 240);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, block_table_stride, 248);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, num_tokens, 252);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, win, 256);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, hca_ratio, 260);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, hca_rows_per_block, 264);
V4POOL_CHECK_OFFSET(PrefillIndexArgs, coarse_packed, 268);

struct HcaOffsetsArgs {
    v4p_ptr entry_idx;      // i32 [N]
    v4p_ptr bid_per_entry;  // i32 [N]
    v4p_ptr block_tables;   // i32 [bs, block_table_stride]
    v4p_ptr out;            // i32 out [N]
    v4p_i64 envelope_rows;
    v4p_i32 block_table_stride;
    v4p_i32 rows_per_block;
    v4p_i32 num_entries;
    v4p_i32 _pad;
};
V4POOL_CHECK_SIZE(HcaOffsetsArgs, 56);
V4POOL_CHECK_ALIGN(HcaOffsetsArgs, 8);
V4POOL_CHECK_OFFSET(HcaOffsetsArgs, entry_idx, 0);
V4POOL_CHECK_OFFSET(HcaOffsetsArgs, bid_per_entry, 8);
V4POOL_CHECK_OFFSET(HcaOffsetsArgs, block_tables, 16);
V4POOL_CHECK_OFFSET(HcaOffsetsArgs, out, 24);
V4POOL_CHECK_OFFSET(HcaOffsetsArgs, envelope_rows, 32);
V4POOL_CHECK_OFFSET(HcaOffsetsArgs, block_table_stride, 40);
V4POOL_CHECK_OFFSET(HcaOffsetsArgs, rows_per_block, 44);
V4POOL_CHECK_OFFSET(HcaOffsetsArgs, num_entries, 48);
V4POOL_CHECK_OFFSET(HcaOffsetsArgs, _pad, 52);

struct CsaPackArgs {
    v4p_ptr topk;                       // i32 [T, topk_row_stride]
    v4p_ptr block_tables;               // i32 [bs, block_table_stride]
    v4p_ptr positions;                  // i64 [>= T]; read only when window_size > 0
    v4p_ptr indptr;                     // i32 [>= T+1]
    v4p_ptr batch_id_per_token;         // i32 [>= T]
    v4p_ptr skip_prefix_len_per_token;  // i32 [>= T]; read only when window_size == 0
    v4p_ptr out;                        // i32 out [>= indptr[T]]
    v4p_i64 envelope_rows;
    v4p_i32 topk_row_stride;
    v4p_i32 block_table_stride;
    v4p_i32 num_tokens;
    v4p_i32 block_capacity;             // compressed rows per block of the class (block_size / ratio)
    v4p_i32 window_size;
    v4p_i32 compress_ratio;             // (p + 1) / ratio rows reachable; bounds the staged columns only
    v4p_i64 compress_bias;              // added to every packed row (0 in V4; docs/v41.md)
    v4p_ptr extra_topk_length;          // i32 out [>= T]; FlashMLA mode only
    v4p_i32 extra_topk;                 // 0: CSR out; > 0: FlashMLA rows out[T][extra_topk], -1 tails
    v4p_i32 shift;                      // FlashMLA mode: the layer's page-view shift
};
V4POOL_CHECK_SIZE(CsaPackArgs, 112);
V4POOL_CHECK_ALIGN(CsaPackArgs, 8);
V4POOL_CHECK_OFFSET(CsaPackArgs, topk, 0);
V4POOL_CHECK_OFFSET(CsaPackArgs, block_tables, 8);
V4POOL_CHECK_OFFSET(CsaPackArgs, positions, 16);
V4POOL_CHECK_OFFSET(CsaPackArgs, indptr, 24);
V4POOL_CHECK_OFFSET(CsaPackArgs, batch_id_per_token, 32);
V4POOL_CHECK_OFFSET(CsaPackArgs, skip_prefix_len_per_token, 40);
V4POOL_CHECK_OFFSET(CsaPackArgs, out, 48);
V4POOL_CHECK_OFFSET(CsaPackArgs, envelope_rows, 56);
V4POOL_CHECK_OFFSET(CsaPackArgs, topk_row_stride, 64);
V4POOL_CHECK_OFFSET(CsaPackArgs, block_table_stride, 68);
V4POOL_CHECK_OFFSET(CsaPackArgs, num_tokens, 72);
V4POOL_CHECK_OFFSET(CsaPackArgs, block_capacity, 76);
V4POOL_CHECK_OFFSET(CsaPackArgs, window_size, 80);
V4POOL_CHECK_OFFSET(CsaPackArgs, compress_ratio, 84);
V4POOL_CHECK_OFFSET(CsaPackArgs, compress_bias, 88);
V4POOL_CHECK_OFFSET(CsaPackArgs, extra_topk_length, 96);
V4POOL_CHECK_OFFSET(CsaPackArgs, extra_topk, 104);
V4POOL_CHECK_OFFSET(CsaPackArgs, shift, 108);

struct PlaneWrite {
    v4p_ptr kv;    // [T, row_bytes] source rows
    v4p_ptr pool;  // layer view base
    v4p_i64 row_bytes;
};
V4POOL_CHECK_SIZE(PlaneWrite, 24);
V4POOL_CHECK_ALIGN(PlaneWrite, 8);
V4POOL_CHECK_OFFSET(PlaneWrite, kv, 0);
V4POOL_CHECK_OFFSET(PlaneWrite, pool, 8);
V4POOL_CHECK_OFFSET(PlaneWrite, row_bytes, 16);

struct RingWriteArgs {
    WindowParams params;
    PlaneWrite planes[2];         // planes[1].pool == 0: one plane
    v4p_ptr positions;            // i32 [>= T]
    v4p_ptr cu_seqlens_q;         // i32 [bs+1]
    v4p_ptr state_slot_per_seq;   // i32 [bs]
    v4p_i64 view_rows;
    v4p_i32 num_seqs;
    v4p_i32 write_per_batch;
};
V4POOL_CHECK_SIZE(RingWriteArgs, 128);
V4POOL_CHECK_ALIGN(RingWriteArgs, 8);
V4POOL_CHECK_OFFSET(RingWriteArgs, params, 0);
V4POOL_CHECK_OFFSET(RingWriteArgs, planes, 40);
V4POOL_CHECK_OFFSET(RingWriteArgs, positions, 88);
V4POOL_CHECK_OFFSET(RingWriteArgs, cu_seqlens_q, 96);
V4POOL_CHECK_OFFSET(RingWriteArgs, state_slot_per_seq, 104);
V4POOL_CHECK_OFFSET(RingWriteArgs, view_rows, 112);
V4POOL_CHECK_OFFSET(RingWriteArgs, num_seqs, 120);
V4POOL_CHECK_OFFSET(RingWriteArgs, write_per_batch, 124);

struct RowScatterArgs {
    PlaneWrite planes[2];
    v4p_ptr batch_id_per_token;  // i32 [>= T]
    v4p_ptr dest_rows;           // i32 [>= T]
    v4p_i64 view_rows;
    v4p_i32 num_tokens;
    v4p_i32 _pad;
};
V4POOL_CHECK_SIZE(RowScatterArgs, 80);
V4POOL_CHECK_ALIGN(RowScatterArgs, 8);
V4POOL_CHECK_OFFSET(RowScatterArgs, planes, 0);
V4POOL_CHECK_OFFSET(RowScatterArgs, batch_id_per_token, 48);
V4POOL_CHECK_OFFSET(RowScatterArgs, dest_rows, 56);
V4POOL_CHECK_OFFSET(RowScatterArgs, view_rows, 64);
V4POOL_CHECK_OFFSET(RowScatterArgs, num_tokens, 72);
V4POOL_CHECK_OFFSET(RowScatterArgs, _pad, 76);

// §8 compressor-state update, one compressor of one layer. Plan row r = (ragged_id, batch_id,
// position, slot): a negative position is a pad row (skipped); the slot is slot_map[batch_id]
// when slot_map != 0 (the contract's form, as the peer's plans), else column 3 (v4pool's own
// staging writes the physical slot there, one dependent load fewer).
struct StateUpdateArgs {
    v4p_ptr kv;           // [rows][kv_row_stride] elements of in_dtype (f32 or bf16)
    v4p_ptr score;        // [rows][score_row_stride] elements of in_dtype
    v4p_ptr ape;          // [ratio][dim] elements of ape_dtype, contiguous
    v4p_ptr write_plan;   // i32 [num_rows][4], 16-byte aligned
    v4p_ptr slot_map;     // i32 [bs]; 0 = the slot is the plan's column 3
    v4p_ptr kv_state;     // f32 [positions][ring][dim], position p at + p * kv_slot_bytes
    v4p_ptr score_state;  // f32, the same shape, + p * score_slot_bytes
    v4p_i64 kv_slot_bytes;
    v4p_i64 score_slot_bytes;
    v4p_i64 kv_row_stride;     // elements
    v4p_i64 score_row_stride;  // elements
    v4p_i32 num_rows;          // plan rows in the grid, pads included
    v4p_i32 dim;
    v4p_i32 ring;    // S: state rows per slot (the ring modulo)
    v4p_i32 window;  // K = (2 if overlap else 1) * ratio; ring >= window (host check)
    v4p_i32 ratio;   // rows of ape
    v4p_i32 in_dtype;   // V4POOL_DTYPE_* of kv and score
    v4p_i32 ape_dtype;  // V4POOL_DTYPE_* of ape
    v4p_i32 _pad;
};
V4POOL_CHECK_SIZE(StateUpdateArgs, 120);
V4POOL_CHECK_ALIGN(StateUpdateArgs, 8);
V4POOL_CHECK_OFFSET(StateUpdateArgs, kv, 0);
V4POOL_CHECK_OFFSET(StateUpdateArgs, score, 8);
V4POOL_CHECK_OFFSET(StateUpdateArgs, ape, 16);
V4POOL_CHECK_OFFSET(StateUpdateArgs, write_plan, 24);
V4POOL_CHECK_OFFSET(StateUpdateArgs, slot_map, 32);
V4POOL_CHECK_OFFSET(StateUpdateArgs, kv_state, 40);
V4POOL_CHECK_OFFSET(StateUpdateArgs, score_state, 48);
V4POOL_CHECK_OFFSET(StateUpdateArgs, kv_slot_bytes, 56);
V4POOL_CHECK_OFFSET(StateUpdateArgs, score_slot_bytes, 64);
V4POOL_CHECK_OFFSET(StateUpdateArgs, kv_row_stride, 72);
V4POOL_CHECK_OFFSET(StateUpdateArgs, score_row_stride, 80);
V4POOL_CHECK_OFFSET(StateUpdateArgs, num_rows, 88);
V4POOL_CHECK_OFFSET(StateUpdateArgs, dim, 92);
V4POOL_CHECK_OFFSET(StateUpdateArgs, ring, 96);
V4POOL_CHECK_OFFSET(StateUpdateArgs, window, 100);
V4POOL_CHECK_OFFSET(StateUpdateArgs, ratio, 104);
V4POOL_CHECK_OFFSET(StateUpdateArgs, in_dtype, 108);
V4POOL_CHECK_OFFSET(StateUpdateArgs, ape_dtype, 112);
V4POOL_CHECK_OFFSET(StateUpdateArgs, _pad, 116);

struct FillRun {
    v4p_ptr dst;
    v4p_u64 bytes;
    v4p_u32 pattern;
    v4p_u32 _pad;
};
V4POOL_CHECK_SIZE(FillRun, 24);
V4POOL_CHECK_ALIGN(FillRun, 8);
V4POOL_CHECK_OFFSET(FillRun, dst, 0);
V4POOL_CHECK_OFFSET(FillRun, bytes, 8);
V4POOL_CHECK_OFFSET(FillRun, pattern, 16);
V4POOL_CHECK_OFFSET(FillRun, _pad, 20);

struct FillRunsArgs {
    v4p_ptr runs;  // FillRun [num_runs]
    v4p_i32 num_runs;
    v4p_i32 _pad;
};
V4POOL_CHECK_SIZE(FillRunsArgs, 16);
V4POOL_CHECK_ALIGN(FillRunsArgs, 8);
V4POOL_CHECK_OFFSET(FillRunsArgs, runs, 0);
V4POOL_CHECK_OFFSET(FillRunsArgs, num_runs, 8);
V4POOL_CHECK_OFFSET(FillRunsArgs, _pad, 12);

struct CopyRun {
    v4p_ptr src;
    v4p_ptr dst;
    v4p_u64 bytes;
};
V4POOL_CHECK_SIZE(CopyRun, 24);
V4POOL_CHECK_ALIGN(CopyRun, 8);
V4POOL_CHECK_OFFSET(CopyRun, src, 0);
V4POOL_CHECK_OFFSET(CopyRun, dst, 8);
V4POOL_CHECK_OFFSET(CopyRun, bytes, 16);

struct CopyRunsArgs {
    v4p_ptr runs;  // CopyRun [num_runs]
    v4p_i32 num_runs;
    v4p_i32 _pad;
};
V4POOL_CHECK_SIZE(CopyRunsArgs, 16);
V4POOL_CHECK_ALIGN(CopyRunsArgs, 8);
V4POOL_CHECK_OFFSET(CopyRunsArgs, runs, 0);
V4POOL_CHECK_OFFSET(CopyRunsArgs, num_runs, 8);
V4POOL_CHECK_OFFSET(CopyRunsArgs, _pad, 12);

/// §9 DSpark window gather: out[b][s] = row window_row(params, slot[b], anchor[b] - (W-1) + s)
/// of the source, bf16 [num_seqs, draft_window, 512]; p < 0 writes zeros, slot < 0 (a pad of a
/// fixed graph grid) writes nothing. Copy variant (v4pool_window_gather): `pool` has 1024-B
/// bf16 rows (a bf16 plane's layer view, or the plane holding `state_window` retyped to
/// 1024-B rows) and `rope` is 0. fp8 variant (v4pool_window_gather_fp8): `pool` is the NoPE
/// plane's layer view (512-B rows: 448 e4m3 | 7 e8m0 scales, each twice | pad), `rope` the
/// RoPE plane's (128-B rows, 64 bf16), NoPE dequantised per 64-value tile.
struct WindowGatherArgs {
    WindowParams params;
    v4p_ptr pool;                // source view base (row 0)
    v4p_ptr rope;                // fp8 variant: RoPE view base; 0 in the copy variant
    v4p_ptr state_slot_per_seq;  // i32 [num_seqs]; < 0 = pad
    v4p_ptr anchor_pos;          // i64 [num_seqs]
    v4p_ptr out;                 // bf16 out [num_seqs, draft_window, 512]
    v4p_i64 view_rows;           // rows of the source view; rows outside it are not read
    v4p_i32 num_seqs;
    v4p_i32 draft_window;
};
V4POOL_CHECK_SIZE(WindowGatherArgs, 96);
V4POOL_CHECK_ALIGN(WindowGatherArgs, 8);
V4POOL_CHECK_OFFSET(WindowGatherArgs, params, 0);
V4POOL_CHECK_OFFSET(WindowGatherArgs, pool, 40);
V4POOL_CHECK_OFFSET(WindowGatherArgs, rope, 48);
V4POOL_CHECK_OFFSET(WindowGatherArgs, state_slot_per_seq, 56);
V4POOL_CHECK_OFFSET(WindowGatherArgs, anchor_pos, 64);
V4POOL_CHECK_OFFSET(WindowGatherArgs, out, 72);
V4POOL_CHECK_OFFSET(WindowGatherArgs, view_rows, 80);
V4POOL_CHECK_OFFSET(WindowGatherArgs, num_seqs, 88);
V4POOL_CHECK_OFFSET(WindowGatherArgs, draft_window, 92);

// bf16 KV rows -> the pool's row format at given destination rows (docs/forward.md: a decode
// token's own rows, a prefill chunk's window rows, a compressor's emitted rows). format 1 (ATOM's
// fp8): the NoPE plane's 512-B rows (448 e4m3 values, seven e8m0 tile scales each written twice,
// zero padding) and the RoPE plane's 128-B rows (64 bf16 copied); format 0: the bf16 plane's
// 1024-B rows (512 bf16 copied); format 2 (FlashMLA V4.1): one plane of 528-B rows, 512 e4m3
// then 16 e8m0 scales, one per 32 values (src/format/).
// KvRowsArgs::format: src/format/ RowFormatId::kernel_code, one per row format
// (tests/layout/row_formats.rs reads these lines and fails on any drift).
#define V4P_KV_ROWS_BF16 0
#define V4P_KV_ROWS_ATOM_FP8 1
#define V4P_KV_ROWS_FLASHMLA_V41 2
#define V4P_KV_ROWS_FLASHMLA_V4 3
#define V4P_KV_ROWS_FLASHMLA_V41_FP4 4
#define V4P_KV_ROWS_FLASHMLA_V4_P2 5
// Rows of a page of each paged format (src/format/ PlaneFormat::page_rows; tests/layout/row_formats.rs
// reads these lines too): FlashMLA's V4 rows in pages of 64 (format 3) or of 2 (format 5).
#define V4P_PAGE_ROWS_FLASHMLA_V4 64
#define V4P_PAGE_ROWS_FLASHMLA_V4_P2 2
struct KvRowsArgs {
    v4p_ptr kv;                  // bf16 [T][kv_row_stride]: 448 NoPE values, then 64 RoPE
    v4p_ptr dest_rows;           // i32 [>= T]: row of the layer view; outside [0, view_rows) dropped
    v4p_ptr batch_id_per_token;  // i32 [>= T] or 0: a negative id is a pad token (skipped)
    v4p_ptr nope;                // layer view base: the fp8 NoPE plane, or the bf16 plane
    v4p_ptr rope;                // layer view base of the RoPE plane (format 1), else 0
    v4p_i64 kv_row_stride;       // elements from one source row to the next (>= 512)
    v4p_i64 view_rows;
    v4p_i32 num_tokens;
    v4p_i32 format;              // 0 bf16, 1 ATOM fp8, 2 FlashMLA V4.1 (528 B), 3 FlashMLA V4 (584 B, pages of
                                 // 64), 4 FlashMLA V4.1 fp4 (288 B), 5 FlashMLA V4 (584 B, pages of 2)
    v4p_i64 view_row0;           // paged formats: nope is plane row 0, view row r is plane row view_row0 + r
};
V4POOL_CHECK_SIZE(KvRowsArgs, 72);
V4POOL_CHECK_ALIGN(KvRowsArgs, 8);
V4POOL_CHECK_OFFSET(KvRowsArgs, kv, 0);
V4POOL_CHECK_OFFSET(KvRowsArgs, dest_rows, 8);
V4POOL_CHECK_OFFSET(KvRowsArgs, batch_id_per_token, 16);
V4POOL_CHECK_OFFSET(KvRowsArgs, nope, 24);
V4POOL_CHECK_OFFSET(KvRowsArgs, rope, 32);
V4POOL_CHECK_OFFSET(KvRowsArgs, kv_row_stride, 40);
V4POOL_CHECK_OFFSET(KvRowsArgs, view_rows, 48);
V4POOL_CHECK_OFFSET(KvRowsArgs, num_tokens, 56);
V4POOL_CHECK_OFFSET(KvRowsArgs, format, 60);
V4POOL_CHECK_OFFSET(KvRowsArgs, view_row0, 64);

// The indexer's bf16 key rows -> one CSA layer's indexer K cache (docs/forward.md, "Indexer
// keys"): keys[t] (128 bf16) to entry dest[t] = block x block_rows + row; entries outside
// [0, num_blocks x block_rows) dropped. format 0: bf16 rows (256 B, copied); 1: FP8, per block
// [block_rows x 128 e4m3][block_rows x f32 scale]; 2: FP4, data per block [4][block_rows][16]
// (e2m1, value 2j in the low nibble of byte j), scales per block [4][block_rows] (e8m0).
// IndexKeysArgs::format: src/sizing.rs IndexerDtype::key_format_code (checked as above).
#define V4P_INDEX_KEYS_BF16 0
#define V4P_INDEX_KEYS_FP8 1
#define V4P_INDEX_KEYS_FP4 2
#define V4P_INDEX_KEYS_ATOM_FP8 3
#define V4P_INDEX_KEYS_ATOM_FP8_FNUZ 4
struct IndexKeysArgs {
    v4p_ptr keys;            // bf16 [T][key_row_stride]
    v4p_ptr dest;            // i32 [>= T]
    v4p_ptr data;            // the layer's cache at block 0 (FP4: its data pool)
    v4p_ptr scales;          // FP4: the layer's scale pool at block 0; else 0
    v4p_i64 key_row_stride;  // >= 128
    v4p_i64 num_blocks;
    v4p_i32 num_tokens;
    v4p_i32 block_rows;
    v4p_i32 format;
    v4p_i32 _pad;
};
V4POOL_CHECK_SIZE(IndexKeysArgs, 64);
V4POOL_CHECK_ALIGN(IndexKeysArgs, 8);
V4POOL_CHECK_OFFSET(IndexKeysArgs, keys, 0);
V4POOL_CHECK_OFFSET(IndexKeysArgs, dest, 8);
V4POOL_CHECK_OFFSET(IndexKeysArgs, data, 16);
V4POOL_CHECK_OFFSET(IndexKeysArgs, scales, 24);
V4POOL_CHECK_OFFSET(IndexKeysArgs, key_row_stride, 32);
V4POOL_CHECK_OFFSET(IndexKeysArgs, num_blocks, 40);
V4POOL_CHECK_OFFSET(IndexKeysArgs, num_tokens, 48);
V4POOL_CHECK_OFFSET(IndexKeysArgs, block_rows, 52);
V4POOL_CHECK_OFFSET(IndexKeysArgs, format, 56);
V4POOL_CHECK_OFFSET(IndexKeysArgs, _pad, 60);

// Several independent writes in one launch (docs/forward.md, "Fewer launches"): block b runs
// block b - first_block[i] of item i (the last item with first_block[i] <= b), as the item's
// own kernel (v4pool_kv_rows, v4pool_index_keys, v4pool_update_compressor_states) runs it.
#define V4POOL_WRITE_KV_ROWS 1
#define V4POOL_WRITE_INDEX_KEYS 2
#define V4POOL_WRITE_STATE_UPDATE 3
#define V4POOL_WRITE_BATCH_MAX_ITEMS 128

struct WriteItem {
    v4p_i32 kind;  // V4POOL_WRITE_*
    v4p_i32 _pad;
    union {
        KvRowsArgs kv_rows;
        IndexKeysArgs index_keys;
        StateUpdateArgs state;
        v4p_u64 raw[15];
    } args;
};
V4POOL_CHECK_SIZE(WriteItem, 128);
V4POOL_CHECK_ALIGN(WriteItem, 8);
V4POOL_CHECK_OFFSET(WriteItem, kind, 0);
V4POOL_CHECK_OFFSET(WriteItem, _pad, 4);
V4POOL_CHECK_OFFSET(WriteItem, args, 8);

struct WriteBatchArgs {
    v4p_ptr items;        // WriteItem [num_items]
    v4p_ptr first_block;  // i32 [num_items]: 0 first, increasing
    v4p_i32 num_items;    // 1 .. V4POOL_WRITE_BATCH_MAX_ITEMS
    v4p_i32 num_blocks;   // the grid: every item's blocks
};
V4POOL_CHECK_SIZE(WriteBatchArgs, 24);
V4POOL_CHECK_ALIGN(WriteBatchArgs, 8);
V4POOL_CHECK_OFFSET(WriteBatchArgs, items, 0);
V4POOL_CHECK_OFFSET(WriteBatchArgs, first_block, 8);
V4POOL_CHECK_OFFSET(WriteBatchArgs, num_items, 16);
V4POOL_CHECK_OFFSET(WriteBatchArgs, num_blocks, 20);

// ---- geometry (index-buffers.md §2), device side -----------------------------------------

/// Window row of absolute position `pos` in physical slot `slot`, relative to the layer view.
/// i64 throughout; the wrap happens here (Euclidean, as the host's `WindowParams::index`, so
/// a stray negative position stays inside its slot instead of reaching a wild row).
V4P_DEVICE v4p_i64 window_row(WindowParams w, v4p_i64 slot, v4p_i64 pos) {
    v4p_i64 q = pos % w.ring_slots;
    if (q < 0) q += w.ring_slots;
    return slot * w.slot_rows + w.ring_start + (q / w.ring_stride) * w.run_rows + (q % w.ring_stride);
}

/// Window row of ring position `q` (already wrapped, 0 <= q < ring_slots).
V4P_DEVICE v4p_i64 window_row_at(WindowParams w, v4p_i64 slot, v4p_i64 q) {
    return slot * w.slot_rows + w.ring_start + (q / w.ring_stride) * w.run_rows + (q % w.ring_stride);
}

/// Compressed row `r` of logical-to-physical block `block` (no layer term: it is in the view).
/// A layer that reads another layer's rows (V4.1) adds its non-negative compress bias to this
/// (CsaPackArgs::compress_bias); indices stay in [0, view_rows): docs/v41.md, open point O1.
V4P_DEVICE v4p_i64 compress_row(v4p_i64 block, v4p_i64 r, v4p_i64 envelope_rows) {
    return block * envelope_rows + r;
}

/// Byte offset of `row` in a plane of `row_bytes`-byte rows: always 64-bit (row 4,194,304 at
/// 512 B/row already passes 2^31).
V4P_DEVICE v4p_u64 row_byte_offset(v4p_i64 row, v4p_i64 row_bytes) {
    return (v4p_u64)row * (v4p_u64)row_bytes;
}
