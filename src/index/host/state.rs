//! The compressor-state update (index-buffers.md §8): the host reference of
//! `v4pool_update_compressor_states`.

use super::*;
use crate::index::{ElemType, StateUpdateArgs};

/// The bytes the state update may write: disjoint byte ranges, each known by the address of
/// its first byte (a device address on a device, a host address or any offset in tests). The
/// kv and score state of one compressor are two fields of the same slots, often in one plane,
/// so one range may hold both.
#[derive(Debug, Default)]
pub struct StateMemory<'a> {
    parts: Vec<(u64, &'a mut [u8])>,
}

impl<'a> StateMemory<'a> {
    /// Ranges `(address of byte 0, bytes)`; they must not overlap.
    pub fn new(parts: Vec<(u64, &'a mut [u8])>) -> Self {
        StateMemory { parts }
    }

    /// Copy `src` to `addr`, which must lie with all of `src` inside one range.
    fn write(&mut self, addr: u64, src: &[u8], buffer: &'static str) -> Result<()> {
        for (base, bytes) in self.parts.iter_mut() {
            let Some(off) = addr.checked_sub(*base) else { continue };
            let Ok(off) = usize::try_from(off) else { continue };
            if let Some(dst) = off.checked_add(src.len()).and_then(|end| bytes.get_mut(off..end)) {
                dst.copy_from_slice(src);
                return Ok(());
            }
        }
        Err(HostKernelError::OutsideAllocation { buffer, addr, bytes: src.len() as u64 })
    }
}

/// Element `index` of a row-major array of `ty` as f32 (bf16 widens exactly).
fn elem(buf: &[u8], ty: ElemType, index: i64, buffer: &'static str) -> Result<f32> {
    let size = ty.size() as usize;
    let at_byte = usize::try_from(index).ok().and_then(|i| i.checked_mul(size));
    let b = at_byte.and_then(|s| buf.get(s..s + size)).ok_or(HostKernelError::OutOfBounds {
        buffer,
        index,
        len: buf.len() / size,
    })?;
    Ok(match ty {
        ElemType::F32 => f32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
        ElemType::Bf16 => f32::from_bits(u32::from(u16::from_ne_bytes([b[0], b[1]])) << 16),
    })
}

fn elem_type(code: i32) -> Result<ElemType> {
    ElemType::from_code(code).ok_or(HostKernelError::Launch(crate::index::shape::LaunchError::BadCode {
        field: "dtype",
        value: code,
    }))
}

/// One live plan row, resolved: `(ragged id, slot, position)`; `None` for a pad row.
pub(crate) fn plan_row(plan: &[i32], slot_map: Option<&[i32]>, r: i64) -> Result<Option<(i64, i64, i64)>> {
    let col = |c: i64| -> Result<i64> { Ok(at(plan, mul(r, 4, "plan index")? + c, "write_plan")?.into()) };
    let pos = col(2)?;
    if pos < 0 {
        return Ok(None);
    }
    let slot = match slot_map {
        Some(map) => at(map, col(1)?, "slot_map")?.into(),
        None => col(3)?,
    };
    Ok(Some((col(0)?, slot, pos)))
}

/// Address of state row `pos % ring` of `slot` in a state tensor at `base`, `slot_bytes`
/// between positions and `dim` f32 per row: `base + slot * slot_bytes + (pos % ring) * dim * 4`.
fn state_row(base: u64, slot: i64, slot_bytes: i64, pos: i64, ring: i64, dim: i64) -> Result<u64> {
    let ovf = HostKernelError::Overflow { what: "state address" };
    let slot = u64::try_from(slot)
        .map_err(|_| HostKernelError::NotI32 { what: "negative state slot", value: slot })?;
    let row = u64::try_from(pos.rem_euclid(divisor("ring", ring)?)).map_err(|_| ovf.clone())?;
    let slot_off =
        slot.checked_mul(u64::try_from(slot_bytes).map_err(|_| ovf.clone())?).ok_or(ovf.clone())?;
    let row_off = row.checked_mul(u64::try_from(dim).map_err(|_| ovf.clone())? * 4).ok_or(ovf.clone())?;
    base.checked_add(slot_off).and_then(|x| x.checked_add(row_off)).ok_or(ovf)
}

/// §8 compressor-state update: for every plan row `r < num_rows` with a non-negative
/// position, `kv_state[s][pos % ring] = f32(kv[ragged])` and `score_state[s][pos % ring] =
/// f32(score[ragged]) + f32(ape[pos % ratio])`, `s` from `slot_map[batch_id]` when given,
/// else the row's column 3. `kv`, `score` and `ape` are raw bytes of their element types;
/// the state addresses are `a.kv_state` / `a.score_state` inside `state` (a row outside it is
/// an error, not a wild write). The f32 sum is the device's (IEEE, round to nearest).
pub fn update_compressor_states(
    a: &StateUpdateArgs,
    kv: &[u8],
    score: &[u8],
    ape: &[u8],
    write_plan: &[i32],
    slot_map: Option<&[i32]>,
    state: &mut StateMemory<'_>,
) -> Result<()> {
    let (in_ty, ape_ty) = (elem_type(a.in_dtype)?, elem_type(a.ape_dtype)?);
    let (dim, ring, ratio) = (i64::from(a.dim), i64::from(a.ring), divisor("ratio", a.ratio.into())?);
    let (mut k, mut s) = (Vec::with_capacity(4 * dim as usize), Vec::with_capacity(4 * dim as usize));
    for r in 0..i64::from(a.num_rows) {
        let Some((ragged, slot, pos)) = plan_row(write_plan, slot_map, r)? else { continue };
        let kv_row = mul(ragged, a.kv_row_stride, "kv index")?;
        let score_row = mul(ragged, a.score_row_stride, "score index")?;
        let ape_row = mul(pos % ratio, dim, "ape index")?;
        k.clear();
        s.clear();
        for e in 0..dim {
            k.extend_from_slice(&elem(kv, in_ty, kv_row + e, "kv")?.to_ne_bytes());
            let sum = elem(score, in_ty, score_row + e, "score")? + elem(ape, ape_ty, ape_row + e, "ape")?;
            s.extend_from_slice(&sum.to_ne_bytes());
        }
        state.write(state_row(a.kv_state, slot, a.kv_slot_bytes, pos, ring, dim)?, &k, "kv_state")?;
        state.write(
            state_row(a.score_state, slot, a.score_slot_bytes, pos, ring, dim)?,
            &s,
            "score_state",
        )?;
    }
    Ok(())
}

/// The byte range `[first, end)` the update writes in one state tensor at `base`: from the
/// lowest slot's first row to the end of the highest slot's last ring row.
pub(crate) fn state_extent(
    base: u64,
    slots: (i64, i64),
    slot_bytes: i64,
    ring: i64,
    dim: i64,
) -> Result<(u64, u64)> {
    let first = state_row(base, slots.0, slot_bytes, 0, ring, dim)?;
    let last = state_row(base, slots.1, slot_bytes, ring - 1, ring, dim)?;
    let end = last
        .checked_add(u64::try_from(dim * 4).unwrap_or(0))
        .ok_or(HostKernelError::Overflow { what: "state end" })?;
    Ok((first, end))
}
