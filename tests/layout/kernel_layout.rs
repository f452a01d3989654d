//! Rust ↔ header ↔ device compilers: the layout lines of `kernels/v4pool_common.h`
//! (`V4POOL_CHECK_SIZE/ALIGN/OFFSET`) are `static_assert`s every device compile enforces; this
//! test parses the same lines and compares each with `size_of` / `align_of` / `offset_of!` of
//! the Rust structs, and checks that the two sets are the same (no field unchecked on either
//! side).

use std::collections::BTreeMap;
use std::mem::{align_of, offset_of, size_of};
use v4pool::geometry::WindowParams;
use v4pool::raw::index::shape::{
    BLOCK_THREADS, CSA_TILE, CSA_TILE_X4, DECODE_FLASH_BLOCKS, DECODE_FLASH_TILE, DECODE_HCA_TILE,
    DECODE_THREADS, GATHER_LANES, GATHER_ROWS_PER_BLOCK, MAX_GRID_YZ, PREFILL_LANES, PREFILL_SHORT_HEAD,
    PREFILL_SHORT_LANES, PREFILL_TOKENS_PER_BLOCK, ROWS_PER_BLOCK, ROW_LANES, RUN_SPLIT, STATE_CHUNK,
};
use v4pool::raw::index::{
    ClassBuffers, CopyRun, CopyRunsArgs, CsaPackArgs, DecodeIndexArgs, FillRun, FillRunsArgs, FlashMlaOut,
    HcaOffsetsArgs, IndexKeysArgs, KvRowsArgs, PlaneWrite, PrefillIndexArgs, RingWriteArgs, RowScatterArgs,
    StateUpdateArgs, WindowGatherArgs, WriteBatchArgs, WriteItem, CLASS_CSA, CLASS_DENSE, CLASS_HCA,
    WRITE_BATCH_MAX_ITEMS, WRITE_INDEX_KEYS, WRITE_KV_ROWS, WRITE_STATE_UPDATE,
};

const HEADER: &str = include_str!("../../kernels/v4pool_common.h");

/// (kind, type, field) → value; kind is SIZE, ALIGN or OFFSET; field is "" for SIZE/ALIGN.
type Checks = BTreeMap<(String, String, String), usize>;

fn header_checks() -> Checks {
    let mut checks = Checks::new();
    for line in HEADER.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("V4POOL_CHECK_") else {
            continue;
        };
        let (kind, args) = rest.split_once('(').unwrap_or_else(|| panic!("malformed check line: {line}"));
        let args = args.strip_suffix(");").unwrap_or_else(|| panic!("check line must end with ');': {line}"));
        let parts: Vec<&str> = args.split(',').map(str::trim).collect();
        let (ty, field, value) = match (kind, parts.as_slice()) {
            ("SIZE" | "ALIGN", [ty, v]) => (*ty, "", *v),
            ("OFFSET", [ty, f, v]) => (*ty, *f, *v),
            _ => panic!("unknown check line: {line}"),
        };
        let value: usize = value.parse().unwrap_or_else(|_| panic!("non-numeric value in: {line}"));
        let key = (kind.to_string(), ty.to_string(), field.to_string());
        assert!(checks.insert(key, value).is_none(), "duplicate check line: {line}");
    }
    checks
}

macro_rules! rust_layout {
    ($checks:ident; $($ty:ident { $($field:ident),* $(,)? })*) => {
        $(
            $checks.insert(("SIZE".into(), stringify!($ty).into(), String::new()), size_of::<$ty>());
            $checks.insert(("ALIGN".into(), stringify!($ty).into(), String::new()), align_of::<$ty>());
            $(
                $checks.insert(
                    ("OFFSET".into(), stringify!($ty).into(), stringify!($field).into()),
                    offset_of!($ty, $field),
                );
            )*
        )*
    };
}

fn rust_checks() -> Checks {
    let mut c = Checks::new();
    rust_layout! { c;
        WindowParams { ring_start, slot_rows, ring_slots, ring_stride, run_rows }
        ClassBuffers { params, indptr, indices, dest_rows }
        DecodeIndexArgs {
            classes, state_slot_per_seq, batch_id_per_token, positions, block_tables, envelope_rows,
            block_table_stride, hca_rows_per_block, num_tokens, win, flashmla,
        }
        FlashMlaOut { indices, topk_length, extra_indices, extra_topk_length, shifts, topk, extra_topk, num_views, _pad }
        PrefillIndexArgs {
            dense, csa, hca, positions, bid_per_token, chunk_start_per_seq, cu_seqlens_q_per_seq,
            state_slot_per_seq, n_committed_hca_per_seq, block_tables, extend_indptr, extend_indices,
            swa_indptr, swa_indices, csa_indptr, csa_indices, hca_indptr, hca_indices, envelope_rows,
            block_table_stride, num_tokens, win, hca_ratio, hca_rows_per_block, coarse_packed,
        }
        HcaOffsetsArgs {
            entry_idx, bid_per_entry, block_tables, out, envelope_rows, block_table_stride, rows_per_block,
            num_entries, _pad,
        }
        CsaPackArgs {
            topk, block_tables, positions, indptr, batch_id_per_token, skip_prefix_len_per_token, out,
            envelope_rows, topk_row_stride, block_table_stride, num_tokens, block_capacity, window_size,
            compress_ratio, compress_bias, extra_topk_length, extra_topk, shift,
        }
        PlaneWrite { kv, pool, row_bytes }
        RingWriteArgs {
            params, planes, positions, cu_seqlens_q, state_slot_per_seq, view_rows, num_seqs, write_per_batch,
        }
        RowScatterArgs { planes, batch_id_per_token, dest_rows, view_rows, num_tokens, _pad }
        StateUpdateArgs {
            kv, score, ape, write_plan, slot_map, kv_state, score_state, kv_slot_bytes, score_slot_bytes,
            kv_row_stride, score_row_stride, num_rows, dim, ring, window, ratio, in_dtype, ape_dtype, _pad,
        }
        FillRun { dst, bytes, pattern, _pad }
        FillRunsArgs { runs, num_runs, _pad }
        CopyRun { src, dst, bytes }
        CopyRunsArgs { runs, num_runs, _pad }
        WindowGatherArgs {
            params, pool, rope, state_slot_per_seq, anchor_pos, out, view_rows, num_seqs, draft_window,
        }
        KvRowsArgs { kv, dest_rows, batch_id_per_token, nope, rope, kv_row_stride, view_rows, num_tokens, format, view_row0 }
        IndexKeysArgs { keys, dest, data, scales, key_row_stride, num_blocks, num_tokens, block_rows, format, _pad }
        WriteItem { kind, _pad, args }
        WriteBatchArgs { items, first_block, num_items, num_blocks }
    }
    c
}

#[test]
fn header_layout_lines_match_the_rust_structs() {
    let header = header_checks();
    let rust = rust_checks();
    let mut problems = Vec::new();
    for (key, value) in &rust {
        match header.get(key) {
            None => {
                problems.push(format!("header lacks V4POOL_CHECK_{}({}, {}) = {value}", key.0, key.1, key.2))
            }
            Some(h) if h != value => problems.push(format!("{key:?}: header {h}, Rust {value}")),
            Some(_) => {}
        }
    }
    for key in header.keys().filter(|k| !rust.contains_key(*k)) {
        problems.push(format!("header checks {key:?}, which the Rust side does not list"));
    }
    assert!(problems.is_empty(), "layout mismatch:\n{}", problems.join("\n"));
    assert!(header.len() > 100, "parsed only {} checks", header.len());
}

fn header_define(name: &str) -> i64 {
    let prefix = format!("#define {name} ");
    let line = HEADER.lines().find_map(|l| l.trim().strip_prefix(prefix.as_str()));
    let line = line.unwrap_or_else(|| panic!("header lacks #define {name}"));
    line.trim().parse().unwrap_or_else(|_| panic!("#define {name} is not a number"))
}

#[test]
fn header_constants_match_the_launch_shapes() {
    assert_eq!(header_define("V4POOL_BLOCK_THREADS"), i64::from(BLOCK_THREADS));
    assert_eq!(header_define("V4POOL_ROW_LANES"), i64::from(ROW_LANES));
    assert_eq!(header_define("V4POOL_ROWS_PER_BLOCK"), i64::from(ROWS_PER_BLOCK));
    assert_eq!(header_define("V4POOL_RUN_SPLIT"), i64::from(RUN_SPLIT));
    assert_eq!(header_define("V4POOL_DECODE_HCA_TILE"), i64::from(DECODE_HCA_TILE));
    assert_eq!(header_define("V4POOL_DECODE_FLASH_TILE"), i64::from(DECODE_FLASH_TILE));
    assert_eq!(header_define("V4POOL_DECODE_FLASH_BLOCKS"), i64::from(DECODE_FLASH_BLOCKS));
    assert_eq!(header_define("V4POOL_DECODE_THREADS"), i64::from(DECODE_THREADS));
    assert_eq!(header_define("V4POOL_PREFILL_LANES"), i64::from(PREFILL_LANES));
    assert_eq!(header_define("V4POOL_PREFILL_TOKENS_PER_BLOCK"), i64::from(PREFILL_TOKENS_PER_BLOCK));
    assert_eq!(header_define("V4POOL_PREFILL_SHORT_LANES"), i64::from(PREFILL_SHORT_LANES));
    assert_eq!(header_define("V4POOL_PREFILL_SHORT_HEAD") as u64, PREFILL_SHORT_HEAD);
    assert_eq!(header_define("V4POOL_CSA_TILE"), i64::from(CSA_TILE));
    assert_eq!(header_define("V4POOL_CSA_TILE_X4"), i64::from(CSA_TILE_X4));
    assert_eq!(header_define("V4POOL_MAX_GRID_YZ"), i64::from(MAX_GRID_YZ));
    assert_eq!(header_define("V4POOL_STATE_CHUNK"), i64::from(STATE_CHUNK));
    assert_eq!(header_define("V4POOL_DTYPE_F32"), v4pool::raw::index::ElemType::F32 as i64);
    assert_eq!(header_define("V4POOL_DTYPE_BF16"), v4pool::raw::index::ElemType::Bf16 as i64);
    assert_eq!(header_define("V4POOL_GATHER_LANES"), i64::from(GATHER_LANES));
    assert_eq!(header_define("V4POOL_GATHER_ROWS_PER_BLOCK"), i64::from(GATHER_ROWS_PER_BLOCK));
    assert_eq!(header_define("V4POOL_CLASS_DENSE"), CLASS_DENSE as i64);
    assert_eq!(header_define("V4POOL_CLASS_CSA"), CLASS_CSA as i64);
    assert_eq!(header_define("V4POOL_CLASS_HCA"), CLASS_HCA as i64);
    assert_eq!(header_define("V4POOL_WRITE_KV_ROWS"), i64::from(WRITE_KV_ROWS));
    assert_eq!(header_define("V4POOL_WRITE_INDEX_KEYS"), i64::from(WRITE_INDEX_KEYS));
    assert_eq!(header_define("V4POOL_WRITE_STATE_UPDATE"), i64::from(WRITE_STATE_UPDATE));
    assert_eq!(header_define("V4POOL_WRITE_BATCH_MAX_ITEMS"), WRITE_BATCH_MAX_ITEMS as i64);
}

#[test]
fn embedded_source_carries_the_same_header() {
    // What NVRTC / hiprtc compile is the header verbatim (less `#pragma once`) plus the kernels.
    for line in HEADER.lines().filter(|l| l.trim_start().starts_with("V4POOL_CHECK_")) {
        assert!(v4pool::raw::kernels::SOURCE.contains(line), "embedded source lacks: {line}");
    }
    assert_eq!(v4pool::raw::kernels::COMMON_HEADER, HEADER);
}
