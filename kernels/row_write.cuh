// row_write.cuh — the two-plane row writers of docs/index-buffers.md section 7: the SWA ring write
// and the row scatter, with their row copy.
//
// Part of the one translation unit kernels/v4pool_kernels.cu: included there after v4pool_common.h
// and the helpers several families share, whose names it uses; never compiled on its own (no
// include guard, no includes of its own).

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
