//! The C ABI's CSA translate-pack beside its decode path: an engine's top-k from host memory
//! (int32 or int64 rows of any width, e.g. `[valid ids | -1 tail]`), checked and converted by
//! the library's [`CsaTopk`] before the pack runs on the decode handle's staged batch.

use super::{get, guard, invalid, out, rejected, V4poolDecode, V4poolPool, V4poolStatus};
use crate::pool::{CsaTopk, TopkRows};

/// A checked top-k buffer for a pool's CSA packs (opaque).
pub struct V4poolCsaTopk {
    topk: CsaTopk,
}

/// A top-k buffer for `max_tokens` rows of `index_topk` on `pool` (sized like the decode
/// handle it serves).
///
/// # Safety
/// `pool` is live; `out_topk` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_csa_topk_new(
    pool: *const V4poolPool,
    max_tokens: usize,
    index_topk: usize,
    out_topk: *mut *mut V4poolCsaTopk,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `pool` is live (this function's `# Safety`).
        let p = unsafe { get(pool, "pool") }?;
        // SAFETY: `out_topk` is writable storage for a handle (this function's `# Safety`).
        let slot = unsafe { out(out_topk, "out_topk") }?;
        let topk = CsaTopk::new(&p.pool, max_tokens, index_topk).map_err(rejected)?;
        *slot = Box::into_raw(Box::new(V4poolCsaTopk { topk }));
        Ok(())
    })
}

/// Free a top-k buffer (null is a no-op).
///
/// # Safety
/// `topk` is null or a live handle, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn v4pool_csa_topk_free(topk: *mut V4poolCsaTopk) {
    if !topk.is_null() {
        // SAFETY: the caller's promise: a handle from `v4pool_csa_topk_new`, freed once.
        drop(unsafe { Box::from_raw(topk) });
    }
}

/// One CSA layer's decode translate-pack: `ids` holds `rows × width` ids (`bits` 32: int32,
/// 64: int64), row `t` the indexer's top-k of the staged batch's token `t`; every id the pack
/// reads is checked (`0 <= id < (pos + 1) / 4`) before the launch on the pool's stream.
///
/// # Safety
/// `decode` and `topk` are live handles of the same pool; `ids` holds `rows × width` elements
/// of the named width (or is null with `rows × width == 0`).
#[no_mangle]
pub unsafe extern "C" fn v4pool_decode_csa_pack(
    decode: *const V4poolDecode,
    topk: *const V4poolCsaTopk,
    ids: *const core::ffi::c_void,
    bits: u32,
    rows: usize,
    width: usize,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `decode` is live (this function's `# Safety`).
        let d = unsafe { get(decode, "decode") }?;
        // SAFETY: `topk` is live (this function's `# Safety`).
        let t = unsafe { get(topk, "topk") }?;
        let n = rows.checked_mul(width).ok_or_else(|| invalid("rows × width overflows"))?;
        if n > 0 && ids.is_null() {
            return Err(invalid("ids is null"));
        }
        let rows_of = match bits {
            // SAFETY (both arms): the caller's promise, `n` elements of the named width.
            32 => {
                TopkRows::I32(if n == 0 { &[] } else { unsafe { std::slice::from_raw_parts(ids.cast(), n) } })
            }
            64 => {
                TopkRows::I64(if n == 0 { &[] } else { unsafe { std::slice::from_raw_parts(ids.cast(), n) } })
            }
            _ => return Err(invalid("bits is not 32 or 64")),
        };
        t.topk.pack_decode(&d.step, rows_of, width).map_err(rejected)
    })
}
