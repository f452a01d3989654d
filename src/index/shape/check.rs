//! The checks a launch must pass before any backend runs it ([`check_launch`]) and what they
//! refuse ([`LaunchError`]): what the contract's error table (index-buffers.md §11) assigns to
//! the host and what can be seen without reading device memory.
//!
//! Separate from the launch geometry in the parent: the parent says how a valid launch is
//! laid out on the device, this says which launches are valid, one rule set per kernel.

use super::{launch_shape, MAX_GRID_YZ};
use crate::geometry::WindowParams;
use crate::index::{
    ClassBuffers, CsaPackArgs, DecodeIndexArgs, FlashMlaOut, HcaOffsetsArgs, Launch, PlaneWrite,
    PrefillIndexArgs, RingWriteArgs, RowScatterArgs, StateUpdateArgs, WindowGatherArgs, CLASS_HCA,
};
use thiserror::Error;

crate::variant::variant_names! {
/// Why a launch was rejected before it ran.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LaunchError {
    #[error("{field} = {value} must not be negative")]
    /// `field` = `value` must not be negative.
    Negative {
        /// The field.
        field: &'static str,
        /// The value given.
        value: i64,
    },
    #[error("{field} = {value} must be at least {min}")]
    /// `field` = `value` must be at least `min`.
    TooSmall {
        /// The field.
        field: &'static str,
        /// The value given.
        value: i64,
        /// The least allowed.
        min: i64,
    },
    #[error("{field} = {value} exceeds {max}")]
    /// `field` = `value` exceeds `max`.
    TooLarge {
        /// The field.
        field: &'static str,
        /// The value given.
        value: i64,
        /// The most allowed.
        max: i64,
    },
    #[error("required buffer {field} is absent (null)")]
    /// Required buffer `field` is absent (null).
    MissingBuffer {
        /// The field.
        field: &'static str,
    },
    #[error("{field} is given although {because}")]
    /// `field` is given although `because`.
    UnexpectedBuffer {
        /// The field.
        field: &'static str,
        /// Why it must be absent.
        because: &'static str,
    },
    #[error("decode launch enables no class")]
    /// Decode launch enables no class.
    NoClass,
    #[error("decode launch has no dest_rows buffer")]
    /// Decode launch has no dest_rows buffer.
    NoDestRows,
    #[error(
        "class {class}: window params {params:?} are not a ring (ring_slots and ring_stride >= 1, rows >= 0)"
    )]
    /// Class `class`: window params `params` are not a ring (ring_slots and ring_stride >= 1, rows >= 0).
    BadWindowParams {
        /// Which class.
        class: &'static str,
        /// The parameters given.
        params: WindowParams,
    },
    #[error("window {win} exceeds ring_slots {ring_slots} of class {class}")]
    /// Window `win` exceeds ring_slots `ring_slots` of class `class`.
    WindowExceedsRing {
        /// Which class.
        class: &'static str,
        /// The window.
        win: i64,
        /// Ring positions.
        ring_slots: i64,
    },
    #[error("{field} = {value} names no element type")]
    /// `field` = `value` names no element type.
    BadCode {
        /// The field.
        field: &'static str,
        /// The value given.
        value: i32,
    },
    #[error("{field} = {addr:#x} is not {align}-byte aligned")]
    /// `field` = `addr` is not `align`-byte aligned.
    Misaligned {
        /// The field.
        field: &'static str,
        /// The address.
        addr: u64,
        /// Required alignment in bytes.
        align: u64,
    },
    #[error("plane {plane}: kv and pool must both be given or both absent")]
    /// Plane `plane`: kv and pool must both be given or both absent.
    PlaneHalfGiven {
        /// Plane index.
        plane: usize,
    },
    #[error("{field} = {value} is not a multiple of {of}")]
    /// `field` = `value` is not a multiple of `of` (ATOM's preshuffled key blocks: 16 rows).
    NotMultiple {
        /// The field.
        field: &'static str,
        /// The value given.
        value: i64,
        /// What it must be a multiple of.
        of: i64,
    },
}
}

const CLASS_NAMES: [&str; 3] = ["dense", "csa", "hca"];

fn non_negative(field: &'static str, value: i64) -> Result<(), LaunchError> {
    if value < 0 {
        return Err(LaunchError::Negative { field, value });
    }
    Ok(())
}

fn at_least(field: &'static str, value: i64, min: i64) -> Result<(), LaunchError> {
    if value < min {
        return Err(LaunchError::TooSmall { field, value, min });
    }
    Ok(())
}

fn at_most(field: &'static str, value: i64, max: i64) -> Result<(), LaunchError> {
    if value > max {
        return Err(LaunchError::TooLarge { field, value, max });
    }
    Ok(())
}

fn present(field: &'static str, ptr: u64) -> Result<(), LaunchError> {
    if ptr == 0 {
        return Err(LaunchError::MissingBuffer { field });
    }
    Ok(())
}

/// A ring: at least one slot position and a positive stride; offsets non-negative. Positions
/// fit the kernels' 32-bit fast path (a valid geometry's rows fit an i32).
fn check_params(class: &'static str, p: &WindowParams) -> Result<(), LaunchError> {
    let ok = (1..=i64::from(i32::MAX)).contains(&p.ring_slots)
        && p.ring_stride >= 1
        && p.slot_rows >= 0
        && p.run_rows >= 0
        && p.ring_start >= i64::from(i32::MIN);
    if !ok {
        return Err(LaunchError::BadWindowParams { class, params: *p });
    }
    Ok(())
}

fn check_window(class: &'static str, p: &WindowParams, win: i64) -> Result<(), LaunchError> {
    check_params(class, p)?;
    if win > p.ring_slots {
        return Err(LaunchError::WindowExceedsRing { class, win, ring_slots: p.ring_slots });
    }
    Ok(())
}

fn check_planes(planes: &[PlaneWrite; 2]) -> Result<(), LaunchError> {
    present("planes[0].pool", planes[0].pool)?;
    present("planes[0].kv", planes[0].kv)?;
    for (i, p) in planes.iter().enumerate() {
        if (p.pool == 0) != (p.kv == 0) {
            return Err(LaunchError::PlaneHalfGiven { plane: i });
        }
        if p.pool != 0 {
            at_least(if i == 0 { "planes[0].row_bytes" } else { "planes[1].row_bytes" }, p.row_bytes, 1)?;
        }
    }
    Ok(())
}

fn check_grid(launch: &Launch) -> Result<(), LaunchError> {
    let shape = launch_shape(launch);
    for (field, d) in [("grid y", shape.grid[1]), ("grid z", shape.grid[2])] {
        at_most(field, i64::from(d), i64::from(MAX_GRID_YZ))?;
    }
    Ok(())
}

fn check_decode(a: &DecodeIndexArgs) -> Result<(), LaunchError> {
    non_negative("num_tokens", a.num_tokens.into())?;
    // Tokens are grid y.
    at_most("num_tokens", a.num_tokens.into(), i64::from(MAX_GRID_YZ))?;
    non_negative("win", a.win.into())?;
    let mut any_class = false;
    let mut any_dest = false;
    for (c, (cls, fm)) in a.classes.iter().zip(&a.flashmla).enumerate() {
        let ClassBuffers { params, indptr, indices, dest_rows } = cls;
        check_flashmla_out(c, fm, *indptr != 0, a)?;
        if *indptr == 0 {
            if *indices != 0 {
                return Err(LaunchError::UnexpectedBuffer {
                    field: "indices",
                    because: "its class's indptr is absent",
                });
            }
            if *dest_rows != 0 {
                return Err(LaunchError::UnexpectedBuffer {
                    field: "dest_rows",
                    because: "its class's indptr is absent",
                });
            }
            continue;
        }
        if *indices == 0 && fm.indices == 0 {
            return Err(LaunchError::MissingBuffer { field: "indices (CSR or flashmla)" });
        }
        check_window(CLASS_NAMES[c], params, a.win.into())?;
        any_class = true;
        any_dest |= *dest_rows != 0;
    }
    if !any_class {
        return Err(LaunchError::NoClass);
    }
    if !any_dest {
        return Err(LaunchError::NoDestRows);
    }
    if a.num_tokens > 0 {
        present("state_slot_per_seq", a.state_slot_per_seq)?;
        present("batch_id_per_token", a.batch_id_per_token)?;
        present("positions", a.positions)?;
    }
    if a.block_tables != 0 && a.classes[CLASS_HCA].indptr != 0 {
        at_least("hca_rows_per_block", a.hca_rows_per_block.into(), 1)?;
        at_least("block_table_stride", a.block_table_stride.into(), 1)?;
        non_negative("envelope_rows", a.envelope_rows)?;
    }
    Ok(())
}

/// A class's FlashMLA outputs (§3f): all absent, or window rows at least `win` wide with their
/// lengths and shifts for at least one view, and a compressed part only for HCA with block
/// tables (the builder's fused head). Views × tokens × width must stay in an i64 element count.
fn check_flashmla_out(
    c: usize,
    fm: &FlashMlaOut,
    class_on: bool,
    a: &DecodeIndexArgs,
) -> Result<(), LaunchError> {
    if fm.indices == 0 {
        if *fm != FlashMlaOut::default() {
            return Err(LaunchError::UnexpectedBuffer {
                field: "flashmla",
                because: "its indices are absent (the class's FlashMLA outputs are off)",
            });
        }
        return Ok(());
    }
    if !class_on {
        return Err(LaunchError::UnexpectedBuffer {
            field: "flashmla.indices",
            because: "its class's indptr is absent",
        });
    }
    present("flashmla.topk_length", fm.topk_length)?;
    present("flashmla.shifts", fm.shifts)?;
    at_least("flashmla.num_views", fm.num_views.into(), 1)?;
    at_least("flashmla.topk", fm.topk.into(), i64::from(a.win.max(1)))?;
    if fm.extra_indices == 0 {
        if fm.extra_topk_length != 0 || fm.extra_topk != 0 {
            return Err(LaunchError::UnexpectedBuffer {
                field: "flashmla.extra_topk_length",
                because: "flashmla.extra_indices is absent",
            });
        }
        return Ok(());
    }
    if c != CLASS_HCA || a.block_tables == 0 {
        return Err(LaunchError::UnexpectedBuffer {
            field: "flashmla.extra_indices",
            because: "only the HCA class with block tables has a builder-written compressed part",
        });
    }
    present("flashmla.extra_topk_length", fm.extra_topk_length)?;
    at_least("flashmla.extra_topk", fm.extra_topk.into(), 1)?;
    Ok(())
}

fn check_prefill(a: &PrefillIndexArgs) -> Result<(), LaunchError> {
    non_negative("num_tokens", a.num_tokens.into())?;
    non_negative("win", a.win.into())?;
    // The prefill builder needs CSA and HCA (§6); dense is optional.
    for (field, ptr) in [
        ("extend_indptr", a.extend_indptr),
        ("extend_indices", a.extend_indices),
        ("csa_indptr", a.csa_indptr),
        ("csa_indices", a.csa_indices),
        ("hca_indptr", a.hca_indptr),
        ("hca_indices", a.hca_indices),
    ] {
        present(field, ptr)?;
    }
    if (a.swa_indptr == 0) != (a.swa_indices == 0) {
        return Err(LaunchError::UnexpectedBuffer {
            field: if a.swa_indptr == 0 { "swa_indices" } else { "swa_indptr" },
            because: "the dense buffers come as a pair",
        });
    }
    let win = i64::from(a.win);
    if a.swa_indptr != 0 {
        check_window("dense", &a.dense, win)?;
    }
    check_window("csa", &a.csa, win)?;
    check_window("hca", &a.hca, win)?;
    at_least("hca_ratio", a.hca_ratio.into(), 1)?;
    at_least("hca_rows_per_block", a.hca_rows_per_block.into(), 1)?;
    non_negative("coarse_packed", a.coarse_packed.into())?; // a flag: 0 or 1
    at_most("coarse_packed", a.coarse_packed.into(), 1)?;
    at_least("block_table_stride", a.block_table_stride.into(), 1)?;
    non_negative("envelope_rows", a.envelope_rows)?;
    if a.num_tokens > 0 {
        for (field, ptr) in [
            ("positions", a.positions),
            ("bid_per_token", a.bid_per_token),
            ("chunk_start_per_seq", a.chunk_start_per_seq),
            ("cu_seqlens_q_per_seq", a.cu_seqlens_q_per_seq),
            ("state_slot_per_seq", a.state_slot_per_seq),
            ("n_committed_hca_per_seq", a.n_committed_hca_per_seq),
            ("block_tables", a.block_tables),
        ] {
            present(field, ptr)?;
        }
    }
    Ok(())
}

fn check_hca_offsets(a: &HcaOffsetsArgs) -> Result<(), LaunchError> {
    non_negative("num_entries", a.num_entries.into())?;
    at_least("rows_per_block", a.rows_per_block.into(), 1)?;
    at_least("block_table_stride", a.block_table_stride.into(), 1)?;
    non_negative("envelope_rows", a.envelope_rows)?;
    if a.num_entries > 0 {
        for (field, ptr) in [
            ("entry_idx", a.entry_idx),
            ("bid_per_entry", a.bid_per_entry),
            ("block_tables", a.block_tables),
            ("out", a.out),
        ] {
            present(field, ptr)?;
        }
    }
    Ok(())
}

fn check_csa_pack(a: &CsaPackArgs) -> Result<(), LaunchError> {
    non_negative("num_tokens", a.num_tokens.into())?;
    non_negative("window_size", a.window_size.into())?;
    non_negative("topk_row_stride", a.topk_row_stride.into())?;
    non_negative("envelope_rows", a.envelope_rows)?;
    at_least("block_capacity", a.block_capacity.into(), 1)?;
    at_least("compress_ratio", a.compress_ratio.into(), 1)?;
    non_negative("compress_bias", a.compress_bias)?;
    at_least("block_table_stride", a.block_table_stride.into(), 1)?;
    if a.num_tokens > 0 {
        for (field, ptr) in [
            ("topk", a.topk),
            ("block_tables", a.block_tables),
            ("indptr", a.indptr),
            ("batch_id_per_token", a.batch_id_per_token),
            ("out", a.out),
        ] {
            present(field, ptr)?;
        }
        if a.window_size > 0 {
            present("positions", a.positions)?;
        } else {
            // §11: window_size = 0 without a skip buffer is a host error.
            present("skip_prefix_len_per_token", a.skip_prefix_len_per_token)?;
        }
    }
    // FlashMLA mode (§5f): decode only (the window derives each token's skip), with a length
    // buffer; CSR mode carries neither.
    non_negative("extra_topk", a.extra_topk.into())?;
    if a.extra_topk > 0 {
        at_least("window_size", a.window_size.into(), 1)?;
        non_negative("shift", a.shift.into())?;
        if a.num_tokens > 0 {
            present("extra_topk_length", a.extra_topk_length)?;
        }
    } else if a.extra_topk_length != 0 || a.shift != 0 {
        return Err(LaunchError::UnexpectedBuffer {
            field: "extra_topk_length / shift",
            because: "extra_topk is 0 (CSR mode)",
        });
    }
    Ok(())
}

fn check_ring_write(a: &RingWriteArgs) -> Result<(), LaunchError> {
    check_params("ring write", &a.params)?;
    // §7: bs = 0 and write_per_batch outside [1, ring_slots] are host errors (two tokens of
    // one sequence would race for one row).
    at_least("num_seqs", a.num_seqs.into(), 1)?;
    at_least("write_per_batch", a.write_per_batch.into(), 1)?;
    at_most("write_per_batch", a.write_per_batch.into(), a.params.ring_slots)?;
    non_negative("view_rows", a.view_rows)?;
    check_planes(&a.planes)?;
    for (field, ptr) in [
        ("positions", a.positions),
        ("cu_seqlens_q", a.cu_seqlens_q),
        ("state_slot_per_seq", a.state_slot_per_seq),
    ] {
        present(field, ptr)?;
    }
    Ok(())
}

/// §9 / §11: `draft_window` in `[1, ring_slots]` (a wider window would read rows the ring
/// already recycled); the variant's planes present or absent; every address a 16-B vector
/// access touches 16-B aligned.
fn check_window_gather(a: &WindowGatherArgs, fp8: bool) -> Result<(), LaunchError> {
    check_params("window gather", &a.params)?;
    non_negative("num_seqs", a.num_seqs.into())?;
    at_least("draft_window", a.draft_window.into(), 1)?;
    check_window("window gather", &a.params, a.draft_window.into())?;
    non_negative("view_rows", a.view_rows)?;
    if fp8 {
        present("rope", a.rope)?;
    } else if a.rope != 0 {
        return Err(LaunchError::UnexpectedBuffer {
            field: "rope",
            because: "the copy variant reads one plane",
        });
    }
    if a.num_seqs > 0 {
        for (field, ptr) in [
            ("pool", a.pool),
            ("state_slot_per_seq", a.state_slot_per_seq),
            ("anchor_pos", a.anchor_pos),
            ("out", a.out),
        ] {
            present(field, ptr)?;
        }
    }
    for (field, ptr) in [("pool", a.pool), ("rope", a.rope), ("out", a.out)] {
        if ptr % 16 != 0 {
            return Err(LaunchError::Misaligned { field, addr: ptr, align: 16 });
        }
    }
    Ok(())
}

fn check_row_scatter(a: &RowScatterArgs) -> Result<(), LaunchError> {
    non_negative("num_tokens", a.num_tokens.into())?;
    non_negative("view_rows", a.view_rows)?;
    check_planes(&a.planes)?;
    if a.num_tokens > 0 {
        present("batch_id_per_token", a.batch_id_per_token)?;
        present("dest_rows", a.dest_rows)?;
    }
    Ok(())
}

fn check_kv_rows(a: &crate::index::KvRowsArgs) -> Result<(), LaunchError> {
    non_negative("num_tokens", a.num_tokens.into())?;
    non_negative("view_rows", a.view_rows)?;
    at_least("kv_row_stride", a.kv_row_stride, crate::index::KV_ROW_VALUES as i64)?;
    use crate::index::KV_ROWS_ATOM_FP8;
    // Every row format has a code (`RowFormatId::kernel_code`); no other code is one.
    let Some(format) = crate::format::RowFormatId::from_kernel_code(a.format) else {
        return Err(LaunchError::BadCode { field: "format", value: a.format });
    };
    // Only a paged format has a view offset inside its plane; it is a row, never negative.
    non_negative("view_row0", a.view_row0)?;
    if !format.format().is_paged() && a.view_row0 != 0 {
        return Err(LaunchError::BadCode {
            field: "view_row0",
            value: i32::try_from(a.view_row0).unwrap_or(i32::MAX),
        });
    }
    if a.num_tokens > 0 {
        present("kv", a.kv)?;
        present("dest_rows", a.dest_rows)?;
        present("nope", a.nope)?;
    }
    // The RoPE plane exists exactly in the fp8 pool.
    if (a.rope != 0) != (a.format == KV_ROWS_ATOM_FP8) {
        return Err(LaunchError::PlaneHalfGiven { plane: 1 });
    }
    Ok(())
}

fn check_index_keys(a: &crate::index::IndexKeysArgs) -> Result<(), LaunchError> {
    use crate::index::{
        INDEX_KEYS_ATOM_FP8, INDEX_KEYS_ATOM_FP8_FNUZ, INDEX_KEYS_BF16, INDEX_KEYS_FP4, INDEX_KEYS_FP8,
    };
    non_negative("num_tokens", a.num_tokens.into())?;
    non_negative("num_blocks", a.num_blocks)?;
    at_least("block_rows", a.block_rows.into(), 1)?;
    at_least("key_row_stride", a.key_row_stride, crate::index::INDEX_KEY_VALUES as i64)?;
    let formats =
        [INDEX_KEYS_BF16, INDEX_KEYS_FP8, INDEX_KEYS_FP4, INDEX_KEYS_ATOM_FP8, INDEX_KEYS_ATOM_FP8_FNUZ];
    if !formats.contains(&a.format) {
        return Err(LaunchError::BadCode { field: "format", value: a.format });
    }
    // ATOM's preshuffle tiles a block 16 rows at a time (crate::format::KeyOrder).
    let preshuffled = [INDEX_KEYS_ATOM_FP8, INDEX_KEYS_ATOM_FP8_FNUZ].contains(&a.format);
    if preshuffled && a.block_rows % 16 != 0 {
        return Err(LaunchError::NotMultiple { field: "block_rows", value: a.block_rows.into(), of: 16 });
    }
    // The scale pool exists exactly in the FP4 cache.
    if (a.scales != 0) != (a.format == INDEX_KEYS_FP4) {
        return Err(LaunchError::PlaneHalfGiven { plane: 1 });
    }
    if a.num_tokens > 0 {
        present("keys", a.keys)?;
        present("dest", a.dest)?;
        present("data", a.data)?;
        // bf16 stores and the FP8 f32 scale store at their own alignment.
        let align = match a.format {
            INDEX_KEYS_FP8 | INDEX_KEYS_ATOM_FP8 | INDEX_KEYS_ATOM_FP8_FNUZ => 4,
            INDEX_KEYS_BF16 => 2,
            _ => 1,
        };
        for (field, addr, align) in [("keys", a.keys, 2), ("dest", a.dest, 4), ("data", a.data, align)] {
            if addr % align != 0 {
                return Err(LaunchError::Misaligned { field, addr, align });
            }
        }
    }
    Ok(())
}

fn check_state_update(a: &StateUpdateArgs) -> Result<(), LaunchError> {
    non_negative("num_rows", a.num_rows.into())?;
    at_least("dim", a.dim.into(), 1)?;
    at_least("ratio", a.ratio.into(), 1)?;
    at_least("window", a.window.into(), 1)?;
    // §11: S < K is a host error (the last K positions would not all have a row).
    at_least("ring", a.ring.into(), a.window.into())?;
    for (field, code) in [("in_dtype", a.in_dtype), ("ape_dtype", a.ape_dtype)] {
        if crate::index::ElemType::from_code(code).is_none() {
            return Err(LaunchError::BadCode { field, value: code });
        }
    }
    let dim = i64::from(a.dim);
    at_least("kv_row_stride", a.kv_row_stride, dim)?;
    at_least("score_row_stride", a.score_row_stride, dim)?;
    // One position's [ring][dim] f32 must not reach the next position's.
    let state = i64::from(a.ring) * dim * 4;
    at_least("kv_slot_bytes", a.kv_slot_bytes, state)?;
    at_least("score_slot_bytes", a.score_slot_bytes, state)?;
    if a.num_rows > 0 {
        for (field, ptr) in [
            ("kv", a.kv),
            ("score", a.score),
            ("ape", a.ape),
            ("write_plan", a.write_plan),
            ("kv_state", a.kv_state),
            ("score_state", a.score_state),
        ] {
            present(field, ptr)?;
        }
        // The kernel reads a plan row as one 16-byte vector and every element at its own
        // alignment.
        let in_size = crate::index::ElemType::from_code(a.in_dtype).map_or(4, crate::index::ElemType::size);
        let ape_size = crate::index::ElemType::from_code(a.ape_dtype).map_or(4, crate::index::ElemType::size);
        for (field, addr, align) in [
            ("write_plan", a.write_plan, 16),
            ("kv", a.kv, in_size),
            ("score", a.score, in_size),
            ("ape", a.ape, ape_size),
            ("slot_map", a.slot_map, 4),
            ("kv_state", a.kv_state, 4),
            ("score_state", a.score_state, 4),
            ("kv_slot_bytes", a.kv_slot_bytes as u64, 4),
            ("score_slot_bytes", a.score_slot_bytes as u64, 4),
        ] {
            if addr % align != 0 {
                return Err(LaunchError::Misaligned { field, addr, align });
            }
        }
    }
    Ok(())
}

/// What can be seen of a write batch without reading its tables: a count of items the kernel
/// takes, a grid, both tables present and aligned (the items' contents are the host
/// reference's and [`crate::pool::WriteBatch`]'s to check).
fn check_write_batch(a: &crate::index::WriteBatchArgs) -> Result<(), LaunchError> {
    at_least("num_items", a.num_items.into(), 1)?;
    at_most("num_items", a.num_items.into(), crate::index::WRITE_BATCH_MAX_ITEMS as i64)?;
    at_least("num_blocks", a.num_blocks.into(), a.num_items.into())?;
    present("items", a.items)?;
    present("first_block", a.first_block)?;
    for (field, addr, align) in [("items", a.items, 8), ("first_block", a.first_block, 4)] {
        if addr % align != 0 {
            return Err(LaunchError::Misaligned { field, addr, align });
        }
    }
    Ok(())
}

/// Reject a launch the contract says the host must reject, before any backend runs it.
pub fn check_launch(launch: &Launch) -> Result<(), LaunchError> {
    match launch {
        Launch::Decode(a) => check_decode(a)?,
        Launch::Prefill(a) => check_prefill(a)?,
        Launch::HcaOffsets(a) => check_hca_offsets(a)?,
        Launch::CsaPack(a) => check_csa_pack(a)?,
        Launch::RingWrite(a) => check_ring_write(a)?,
        Launch::RowScatter(a) => check_row_scatter(a)?,
        Launch::KvRows(a) => check_kv_rows(a)?,
        Launch::IndexKeys(a) => check_index_keys(a)?,
        Launch::StateUpdate(a) => check_state_update(a)?,
        Launch::FillRuns(a) => {
            non_negative("num_runs", a.num_runs.into())?;
            if a.num_runs > 0 {
                present("runs", a.runs)?;
            }
        }
        Launch::CopyRuns(a) => {
            non_negative("num_runs", a.num_runs.into())?;
            if a.num_runs > 0 {
                present("runs", a.runs)?;
            }
        }
        Launch::WindowGather(a) => check_window_gather(a, false)?,
        Launch::WindowGatherFp8(a) => check_window_gather(a, true)?,
        Launch::WriteBatch(a) => check_write_batch(a)?,
        Launch::Empty => {}
    }
    check_grid(launch)
}
