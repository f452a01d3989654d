//! `with_*` setters of the kernel contract's structs, which are `#[non_exhaustive]` so that a
//! field the kernels gain is not a break: code outside the crate builds them from `Default`
//! (all zeros, as `Zeroable`) and these setters; the crate itself still writes literals.

use super::*;

crate::setters::with_setters!(ClassBuffers {
    with_params(params: WindowParams),
    with_indptr(indptr: DevicePtr),
    with_indices(indices: DevicePtr),
    with_dest_rows(dest_rows: DevicePtr),
});

crate::setters::with_setters!(FlashMlaOut {
    with_indices(indices: DevicePtr),
    with_topk_length(topk_length: DevicePtr),
    with_extra_indices(extra_indices: DevicePtr),
    with_extra_topk_length(extra_topk_length: DevicePtr),
    with_shifts(shifts: DevicePtr),
    with_topk(topk: i32),
    with_extra_topk(extra_topk: i32),
    with_num_views(num_views: i32),
});

crate::setters::with_setters!(DecodeIndexArgs {
    with_classes(classes: [ClassBuffers; NUM_SLOTS]),
    with_state_slot_per_seq(state_slot_per_seq: DevicePtr),
    with_batch_id_per_token(batch_id_per_token: DevicePtr),
    with_positions(positions: DevicePtr),
    with_block_tables(block_tables: DevicePtr),
    with_envelope_rows(envelope_rows: i64),
    with_block_table_stride(block_table_stride: i32),
    with_hca_rows_per_block(hca_rows_per_block: i32),
    with_num_tokens(num_tokens: i32),
    with_win(win: i32),
    with_flashmla(flashmla: [FlashMlaOut; NUM_SLOTS]),
});

crate::setters::with_setters!(PrefillIndexArgs {
    with_dense(dense: WindowParams),
    with_csa(csa: WindowParams),
    with_hca(hca: WindowParams),
    with_positions(positions: DevicePtr),
    with_bid_per_token(bid_per_token: DevicePtr),
    with_chunk_start_per_seq(chunk_start_per_seq: DevicePtr),
    with_cu_seqlens_q_per_seq(cu_seqlens_q_per_seq: DevicePtr),
    with_state_slot_per_seq(state_slot_per_seq: DevicePtr),
    with_n_committed_hca_per_seq(n_committed_hca_per_seq: DevicePtr),
    with_block_tables(block_tables: DevicePtr),
    with_extend_indptr(extend_indptr: DevicePtr),
    with_extend_indices(extend_indices: DevicePtr),
    with_swa_indptr(swa_indptr: DevicePtr),
    with_swa_indices(swa_indices: DevicePtr),
    with_csa_indptr(csa_indptr: DevicePtr),
    with_csa_indices(csa_indices: DevicePtr),
    with_hca_indptr(hca_indptr: DevicePtr),
    with_hca_indices(hca_indices: DevicePtr),
    with_envelope_rows(envelope_rows: i64),
    with_block_table_stride(block_table_stride: i32),
    with_num_tokens(num_tokens: i32),
    with_win(win: i32),
    with_hca_ratio(hca_ratio: i32),
    with_hca_rows_per_block(hca_rows_per_block: i32),
    with_coarse_packed(coarse_packed: i32),
});

crate::setters::with_setters!(HcaOffsetsArgs {
    with_entry_idx(entry_idx: DevicePtr),
    with_bid_per_entry(bid_per_entry: DevicePtr),
    with_block_tables(block_tables: DevicePtr),
    with_out(out: DevicePtr),
    with_envelope_rows(envelope_rows: i64),
    with_block_table_stride(block_table_stride: i32),
    with_rows_per_block(rows_per_block: i32),
    with_num_entries(num_entries: i32),
});

crate::setters::with_setters!(CsaPackArgs {
    with_topk(topk: DevicePtr),
    with_block_tables(block_tables: DevicePtr),
    with_positions(positions: DevicePtr),
    with_indptr(indptr: DevicePtr),
    with_batch_id_per_token(batch_id_per_token: DevicePtr),
    with_skip_prefix_len_per_token(skip_prefix_len_per_token: DevicePtr),
    with_out(out: DevicePtr),
    with_envelope_rows(envelope_rows: i64),
    with_topk_row_stride(topk_row_stride: i32),
    with_block_table_stride(block_table_stride: i32),
    with_num_tokens(num_tokens: i32),
    with_block_capacity(block_capacity: i32),
    with_window_size(window_size: i32),
    with_compress_ratio(compress_ratio: i32),
    with_compress_bias(compress_bias: i64),
    with_extra_topk_length(extra_topk_length: DevicePtr),
    with_extra_topk(extra_topk: i32),
    with_shift(shift: i32),
});

crate::setters::with_setters!(PlaneWrite {
    with_kv(kv: DevicePtr),
    with_pool(pool: DevicePtr),
    with_row_bytes(row_bytes: i64),
});

crate::setters::with_setters!(RingWriteArgs {
    with_params(params: WindowParams),
    with_planes(planes: [PlaneWrite; 2]),
    with_positions(positions: DevicePtr),
    with_cu_seqlens_q(cu_seqlens_q: DevicePtr),
    with_state_slot_per_seq(state_slot_per_seq: DevicePtr),
    with_view_rows(view_rows: i64),
    with_num_seqs(num_seqs: i32),
    with_write_per_batch(write_per_batch: i32),
});

crate::setters::with_setters!(RowScatterArgs {
    with_planes(planes: [PlaneWrite; 2]),
    with_batch_id_per_token(batch_id_per_token: DevicePtr),
    with_dest_rows(dest_rows: DevicePtr),
    with_view_rows(view_rows: i64),
    with_num_tokens(num_tokens: i32),
});

crate::setters::with_setters!(KvRowsArgs {
    with_kv(kv: DevicePtr),
    with_dest_rows(dest_rows: DevicePtr),
    with_batch_id_per_token(batch_id_per_token: DevicePtr),
    with_nope(nope: DevicePtr),
    with_rope(rope: DevicePtr),
    with_kv_row_stride(kv_row_stride: i64),
    with_view_rows(view_rows: i64),
    with_num_tokens(num_tokens: i32),
    with_format(format: i32),
    with_view_row0(view_row0: i64),
});

crate::setters::with_setters!(IndexKeysArgs {
    with_keys(keys: DevicePtr),
    with_dest(dest: DevicePtr),
    with_data(data: DevicePtr),
    with_scales(scales: DevicePtr),
    with_key_row_stride(key_row_stride: i64),
    with_num_blocks(num_blocks: i64),
    with_num_tokens(num_tokens: i32),
    with_block_rows(block_rows: i32),
    with_format(format: i32),
});

crate::setters::with_setters!(WriteItem {
    with_kind(kind: i32),
    with_args(args: [u64; 15]),
});

crate::setters::with_setters!(WriteBatchArgs {
    with_items(items: DevicePtr),
    with_first_block(first_block: DevicePtr),
    with_num_items(num_items: i32),
    with_num_blocks(num_blocks: i32),
});

crate::setters::with_setters!(StateUpdateArgs {
    with_kv(kv: DevicePtr),
    with_score(score: DevicePtr),
    with_ape(ape: DevicePtr),
    with_write_plan(write_plan: DevicePtr),
    with_slot_map(slot_map: DevicePtr),
    with_kv_state(kv_state: DevicePtr),
    with_score_state(score_state: DevicePtr),
    with_kv_slot_bytes(kv_slot_bytes: i64),
    with_score_slot_bytes(score_slot_bytes: i64),
    with_kv_row_stride(kv_row_stride: i64),
    with_score_row_stride(score_row_stride: i64),
    with_num_rows(num_rows: i32),
    with_dim(dim: i32),
    with_ring(ring: i32),
    with_window(window: i32),
    with_ratio(ratio: i32),
    with_in_dtype(in_dtype: i32),
    with_ape_dtype(ape_dtype: i32),
});

crate::setters::with_setters!(FillRunsArgs {
    with_runs(runs: DevicePtr),
    with_num_runs(num_runs: i32),
});

crate::setters::with_setters!(CopyRunsArgs {
    with_runs(runs: DevicePtr),
    with_num_runs(num_runs: i32),
});
