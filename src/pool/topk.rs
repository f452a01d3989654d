//! An engine's top-k rows into the CSA translate-pack (index-buffers.md §5), checked.
//!
//! The pack reads `head` entries of each token's row, i32, at a row stride of at least
//! `index_topk`. Engines hand over other shapes: transformers' indexer returns int64 rows
//! `[valid ids | -1 tail]`, only `min(index_topk, entries)` wide. [`CsaTopk`] takes either
//! element type and any width, checks that every entry the pack will read is an id the
//! token may select (`0 <= id < (pos + 1) / 4`), converts them into its own i32 buffer and
//! runs the pack from there: a safe call, because nothing the kernel reads is unchecked.

use super::owned::Owned;
use super::{DecodeError, DecodePath, Pool, PrefillPath};
use crate::backend::BackendError;
use crate::index::DevicePtr;
use std::sync::Arc;
use thiserror::Error;

/// One engine's top-k tensor, row-major `[tokens][width]`.
#[derive(Clone, Copy, Debug)]
pub enum TopkRows<'a> {
    /// int32 ids.
    I32(&'a [i32]),
    /// int64 ids (transformers' `topk().indices`).
    I64(&'a [i64]),
}

impl TopkRows<'_> {
    fn len(&self) -> usize {
        match self {
            TopkRows::I32(v) => v.len(),
            TopkRows::I64(v) => v.len(),
        }
    }
    fn get(&self, i: usize) -> i64 {
        match self {
            TopkRows::I32(v) => i64::from(v[i]),
            TopkRows::I64(v) => v[i],
        }
    }
}

crate::variant::variant_names! {
/// What a checked pack refuses, before anything is launched.
#[derive(Debug, Error)]
pub enum TopkError {
    /// The rows are not `tokens × width` (tokens = the path's staged tokens).
    #[error("top-k holds {len} ids, not {tokens} rows of {width}")]
    Shape {
        /// Ids given.
        len: usize,
        /// Staged tokens.
        tokens: usize,
        /// Row width given.
        width: usize,
    },
    /// A row narrower than the entries the pack reads of it.
    #[error("token {token}: a top-k row of {width} ids, but the pack reads {head}")]
    TooNarrow {
        /// Token.
        token: usize,
        /// Row width.
        width: usize,
        /// Entries read.
        head: i32,
    },
    /// An id the pack would read that the token cannot select (negative, or a compressed
    /// entry that closes after its position).
    #[error("token {token}: top-k entry {k} = {id} is not a CSA entry below {entries}")]
    BadId {
        /// Token.
        token: usize,
        /// Column.
        k: usize,
        /// The id.
        id: i64,
        /// Entries the token may select.
        entries: i32,
    },
    /// More tokens than the handle holds.
    #[error("{got} tokens exceed the handle's {cap}")]
    TooManyTokens {
        /// Tokens staged.
        got: usize,
        /// `max_tokens`.
        cap: usize,
    },
    /// The path belongs to another pool.
    #[error("the path indexes another pool")]
    OtherPool,
    /// The path refused.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}
}

/// A checked top-k staging buffer for one pool's packs (see the module doc).
#[derive(Debug)]
pub struct CsaTopk {
    pool: Arc<Pool>,
    owned: Owned,
    max_tokens: usize,
    stride: usize,
}

/// Check and convert `rows` (`heads.len()` rows of `width`) into `[tokens][stride]` i32, every
/// cell the pack does not read −1.
pub fn convert_topk(
    rows: TopkRows<'_>,
    width: usize,
    heads: &[[i32; 2]],
    stride: usize,
) -> Result<Vec<i32>, TopkError> {
    let tokens = heads.len();
    if tokens.checked_mul(width) != Some(rows.len()) {
        return Err(TopkError::Shape { len: rows.len(), tokens, width });
    }
    let mut out = vec![-1i32; tokens * stride];
    for (t, &[head, entries]) in heads.iter().enumerate() {
        let h = head.max(0) as usize;
        if h > width {
            return Err(TopkError::TooNarrow { token: t, width, head });
        }
        if h > stride {
            return Err(TopkError::TooNarrow { token: t, width: stride, head });
        }
        for k in 0..h {
            let id = rows.get(t * width + k);
            if !(0..i64::from(entries)).contains(&id) {
                return Err(TopkError::BadId { token: t, k, id, entries });
            }
            out[t * stride + k] = id as i32; // below entries, an i32
        }
    }
    Ok(out)
}

impl CsaTopk {
    /// A buffer of `max_tokens` rows of `index_topk` on `pool`'s backend and stream.
    pub fn new(pool: &Arc<Pool>, max_tokens: usize, index_topk: usize) -> Result<CsaTopk, TopkError> {
        let stride = index_topk.max(1);
        let too_large = TopkError::TooManyTokens { got: max_tokens, cap: (i32::MAX as usize) / stride };
        let elems = max_tokens.checked_mul(stride).filter(|&n| n <= i32::MAX as usize).ok_or(too_large)?;
        let owned = Owned::new(Arc::clone(pool.backend()), pool.stream(), elems as u64 * 4)?;
        Ok(CsaTopk { pool: Arc::clone(pool), owned, max_tokens, stride })
    }

    fn load(&self, rows: TopkRows<'_>, width: usize, heads: &[[i32; 2]]) -> Result<DevicePtr, TopkError> {
        if heads.len() > self.max_tokens {
            return Err(TopkError::TooManyTokens { got: heads.len(), cap: self.max_tokens });
        }
        let out = convert_topk(rows, width, heads, self.stride)?;
        self.owned.upload(0, bytemuck::cast_slice(&out))?;
        Ok(self.owned.base())
    }

    /// Check `rows` (the staged tokens' top-k, `width` ids each) against `path`'s staged batch
    /// and run one CSA layer's decode pack from the converted copy.
    pub fn pack_decode(&self, path: &DecodePath, rows: TopkRows<'_>, width: usize) -> Result<(), TopkError> {
        if !Arc::ptr_eq(path.pool(), &self.pool) {
            return Err(TopkError::OtherPool);
        }
        let heads = path.staged_csa_heads();
        if path.capacity().max_tokens > self.max_tokens {
            return Err(TopkError::TooManyTokens { got: path.capacity().max_tokens, cap: self.max_tokens });
        }
        let ptr = self.load(rows, width, heads)?;
        // SAFETY: `ptr` is this handle's buffer, max_tokens ≥ the path's max_tokens rows of
        // `stride` ≥ index_topk i32, on the pool's backend and stream; every entry the pack
        // reads (the staged heads) was checked to be a selectable id.
        unsafe { path.csa_pack(ptr, self.stride as i32) }?;
        Ok(())
    }

    /// As [`Self::pack_decode`], for a staged prefill forward.
    pub fn pack_prefill(
        &self,
        path: &PrefillPath,
        rows: TopkRows<'_>,
        width: usize,
    ) -> Result<(), TopkError> {
        if !Arc::ptr_eq(path.pool(), &self.pool) {
            return Err(TopkError::OtherPool);
        }
        let ptr = self.load(rows, width, path.staged_csa_heads())?;
        // SAFETY: as in `pack_decode`: the staged tokens' rows (≤ max_tokens) at `stride`.
        unsafe { path.csa_pack(ptr, self.stride as i32) }?;
        Ok(())
    }
}
