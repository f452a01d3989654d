//! The row movers (index-buffers.md §7): ring write, row scatter and pattern fill.

use super::*;

// ---- §7: ring write and row scatter ---------------------------------------------------------------

/// One plane of a row write: source rows `kv` and the layer view `pool`, `row_bytes` each.
#[derive(Debug)]
pub struct PlaneRows<'a> {
    /// Source rows.
    pub kv: &'a [u8],
    /// The layer view's rows.
    pub pool: &'a mut [u8],
    /// Bytes per row.
    pub row_bytes: usize,
}

fn copy_row(plane: &mut PlaneRows<'_>, src_row: i64, dst_row: i64) -> Result<()> {
    let w = plane.row_bytes;
    let range = |row: i64, len: usize, buffer: &'static str| -> Result<std::ops::Range<usize>> {
        let off = row_byte_offset(row, w as i64)?;
        let start =
            usize::try_from(off).map_err(|_| HostKernelError::OutOfBounds { buffer, index: row, len })?;
        match start.checked_add(w) {
            Some(end) if end <= len => Ok(start..end),
            _ => Err(HostKernelError::OutOfBounds { buffer, index: row, len }),
        }
    };
    let src = range(src_row, plane.kv.len(), "kv")?;
    let dst = range(dst_row, plane.pool.len(), "pool")?;
    plane.pool[dst].copy_from_slice(&plane.kv[src]);
    Ok(())
}

/// §7 ring write: the last `min(tok, write_per_batch)` tokens of each sequence to their window
/// rows in every plane; rows outside `[0, view_rows)` are dropped.
#[allow(clippy::too_many_arguments)] // the kernel's argument list, one for one
pub fn ring_write(
    params: &WindowParams,
    planes: &mut [PlaneRows<'_>],
    positions: &[i32],
    cu_seqlens_q: &[i32],
    state_slot_per_seq: &[i32],
    view_rows: i64,
    num_seqs: i32,
    write_per_batch: i32,
) -> Result<()> {
    for b in 0..i64::from(num_seqs) {
        let end = i64::from(at(cu_seqlens_q, b + 1, "cu_seqlens_q")?);
        let tok = end - i64::from(at(cu_seqlens_q, b, "cu_seqlens_q")?);
        if tok <= 0 {
            continue;
        }
        let w = tok.min(write_per_batch.into());
        let slot = i64::from(at(state_slot_per_seq, b, "state_slot_per_seq")?);
        for r in 0..w {
            let src = end - w + r;
            let row = window_row(params, slot, at(positions, src, "positions")?.into())?;
            if !(0..view_rows).contains(&row) {
                continue; // dropped, not wrapped
            }
            for plane in planes.iter_mut() {
                copy_row(plane, src, row)?;
            }
        }
    }
    Ok(())
}

/// §7 row scatter: `kv[t]` to `pool[dest_rows[t]]` for live tokens with an in-range row.
pub fn row_scatter(
    planes: &mut [PlaneRows<'_>],
    batch_id_per_token: &[i32],
    dest_rows: &[i32],
    view_rows: i64,
    num_tokens: i32,
) -> Result<()> {
    for t in 0..i64::from(num_tokens) {
        if at(batch_id_per_token, t, "batch_id_per_token")? < 0 {
            continue;
        }
        let row = i64::from(at(dest_rows, t, "dest_rows")?);
        if !(0..view_rows).contains(&row) {
            continue;
        }
        for plane in planes.iter_mut() {
            copy_row(plane, t, row)?;
        }
    }
    Ok(())
}

/// Fill a byte range with a repeated 32-bit pattern (native byte order, as the device stores
/// it); `dst.len()` must be a multiple of 4.
pub fn fill_pattern(dst: &mut [u8], pattern: u32) -> Result<()> {
    if dst.len() % 4 != 0 {
        return Err(HostKernelError::FillRunUnaligned { run: 0, dst: 0, bytes: dst.len() as u64 });
    }
    for word in dst.chunks_exact_mut(4) {
        word.copy_from_slice(&pattern.to_ne_bytes());
    }
    Ok(())
}
