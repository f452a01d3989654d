// v4pool_emulation.cpp — the device kernels compiled as plain C++ for host tests.
//
// Not a backend: tests/kernels/index_emulated.rs loads this library (built by build.rs when a clang is
// found) and runs the *kernel code itself* on random inputs, comparing with the host reference
// of src/index/host.rs, so the CUDA/HIP source is exercised on a machine without a GPU.
#define V4POOL_HOST_EMULATION 1
#include "v4pool_kernels.cu"

#include <cstring>

/// Run kernel `symbol` over `grid` blocks of `threads` threads (x only). Returns 0, or -1 for an
/// unknown symbol.
extern "C" int v4pool_emu_launch(const char* symbol, const void* args, const unsigned grid[3], unsigned threads) {
#define V4P_EMU_CASE(name, Args)                          \
    if (std::strcmp(symbol, #name) == 0) {                \
        v4p_emu_run<Args>(name, args, grid, threads);     \
        return 0;                                         \
    }
    V4P_EMU_CASE(v4pool_decode_indices, DecodeIndexArgs)
    V4P_EMU_CASE(v4pool_prefill_indices, PrefillIndexArgs)
    V4P_EMU_CASE(v4pool_prefill_indices_short, PrefillIndexArgs)
    V4P_EMU_CASE(v4pool_prefill_indices_pair, PrefillIndexArgs)
    V4P_EMU_CASE(v4pool_hca_offsets, HcaOffsetsArgs)
    V4P_EMU_CASE(v4pool_csa_translate_pack, CsaPackArgs)
    V4P_EMU_CASE(v4pool_csa_translate_pack_staged, CsaPackArgs)
    V4P_EMU_CASE(v4pool_csa_translate_pack_staged_x4, CsaPackArgs)
    V4P_EMU_CASE(v4pool_ring_write, RingWriteArgs)
    V4P_EMU_CASE(v4pool_row_scatter, RowScatterArgs)
    V4P_EMU_CASE(v4pool_update_compressor_states, StateUpdateArgs)
    V4P_EMU_CASE(v4pool_fill_runs, FillRunsArgs)
    V4P_EMU_CASE(v4pool_copy_runs, CopyRunsArgs)
#undef V4P_EMU_CASE
    if (std::strcmp(symbol, "v4pool_empty") == 0) {
        v4pool_empty();
        return 0;
    }
    return -1;
}

/// The §9 window gather kernels (copy and fp8), for tests/kernels/index_emulated.rs (the table above
/// is shared with other kernels; this entry keeps the gather's registration in one place).
extern "C" int v4pool_emu_launch_gather(const char* symbol, const void* args, const unsigned grid[3], unsigned threads) {
    if (std::strcmp(symbol, "v4pool_window_gather") == 0) {
        v4p_emu_run<WindowGatherArgs>(v4pool_window_gather, args, grid, threads);
        return 0;
    }
    if (std::strcmp(symbol, "v4pool_window_gather_fp8") == 0) {
        v4p_emu_run<WindowGatherArgs>(v4pool_window_gather_fp8, args, grid, threads);
        return 0;
    }
    return -1;
}

/// The KV row writer (bf16 KV into the pool's row format), for tests/kernels/kv_rows.rs.
extern "C" int v4pool_emu_launch_kv_rows(const void* args, const unsigned grid[3], unsigned threads) {
    v4p_emu_run<KvRowsArgs>(v4pool_kv_rows, args, grid, threads);
    return 0;
}

/// The indexer key writer (bf16 keys into an indexer K cache), for tests/kernels/index_keys.rs.
extern "C" int v4pool_emu_launch_index_keys(const void* args, const unsigned grid[3], unsigned threads) {
    v4p_emu_run<IndexKeysArgs>(v4pool_index_keys, args, grid, threads);
    return 0;
}

/// The write batch (KV row, index-key and state-update writes in one launch), for
/// tests/kernels/step_batch.rs.
extern "C" int v4pool_emu_launch_write_batch(const void* args, const unsigned grid[3], unsigned threads) {
    v4p_emu_run<WriteBatchArgs>(v4pool_write_batch, args, grid, threads);
    return 0;
}
