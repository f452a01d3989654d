//! Compressor outputs from host memory into the state update (`index-buffers.md` §8): an
//! engine (or a binding) whose kv, score and positional-bias rows are host arrays uploads them
//! into a [`StateStaging`] buffer of the pool's backend and runs [`StateUpdate::update`] from
//! there, so the launch reads only memory the library owns and sized: a safe call.

use super::update::{Compressor, StateInputs, StateUpdate, StateUpdateError};
use crate::index::ElemType;
use crate::pool::owned::{Carve, Owned};
use crate::pool::Pool;
use std::sync::Arc;

/// One launch's compressor outputs in host memory, row-major and contiguous.
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct HostStateInputs<'a> {
    /// `[rows][dim]` elements of `dtype`, as bytes.
    pub kv: &'a [u8],
    /// `[rows][dim]` elements of `dtype` (the bias not yet added), as bytes.
    pub score: &'a [u8],
    /// `[ratio][dim]` elements of `ape_dtype`, as bytes.
    pub ape: &'a [u8],
    /// Rows of kv and score.
    pub rows: usize,
    /// Elements per row.
    pub dim: usize,
    /// Element type of kv and score.
    pub dtype: ElemType,
    /// Element type of ape.
    pub ape_dtype: ElemType,
}

crate::setters::with_setters!(impl<'a> HostStateInputs<'a> {
    with_kv(kv: &'a [u8]),
    with_score(score: &'a [u8]),
    with_ape(ape: &'a [u8]),
    with_rows(rows: usize),
    with_dim(dim: usize),
    with_dtype(dtype: ElemType),
    with_ape_dtype(ape_dtype: ElemType),
});

/// A device buffer for one launch's inputs: `max_rows` rows of up to `max_dim` f32 for kv and
/// score each, and the largest compressor's bias table.
#[derive(Debug)]
pub struct StateStaging {
    owned: Owned,
    kv_at: u64,
    score_at: u64,
    ape_at: u64,
    row_bytes: u64,
    max_rows: usize,
    ape_bytes: u64,
}

impl StateStaging {
    /// Buffers on `pool`'s backend and stream for `max_rows` rows of at most `max_dim` f32
    /// elements (bf16 inputs take half) and a bias table of `max_ratio × max_dim` f32.
    pub fn new(
        pool: &Arc<Pool>,
        max_rows: usize,
        max_dim: usize,
        max_ratio: usize,
    ) -> Result<StateStaging, StateUpdateError> {
        let too_large = StateUpdateError::OverCapacity { what: "staging bytes", got: max_rows, max: 0 };
        let row_bytes = (max_dim as u64).checked_mul(4).ok_or(too_large)?;
        let ape_bytes = (max_ratio as u64).checked_mul(row_bytes).ok_or(StateUpdateError::OverCapacity {
            what: "staging bytes",
            got: max_ratio,
            max: 0,
        })?;
        let mut c = Carve::default();
        let err = || StateUpdateError::OverCapacity { what: "staging bytes", got: max_rows, max: 0 };
        let kv_at = c.take(max_rows as u64, row_bytes).ok_or_else(err)?;
        let score_at = c.take(max_rows as u64, row_bytes).ok_or_else(err)?;
        let ape_at = c.take(1, ape_bytes).ok_or_else(err)?;
        let owned = Owned::new(Arc::clone(pool.backend()), pool.stream(), c.end())?;
        Ok(StateStaging { owned, kv_at, score_at, ape_at, row_bytes, max_rows, ape_bytes })
    }
}

impl StateUpdate {
    /// Upload `inputs` into `staging` and write `compressor`'s state at `layer` from the staged
    /// plan (see [`StateUpdate::update`]). Every length is checked against `rows × dim` (and
    /// `ratio × dim` for the bias) and against the staging buffer before anything is uploaded.
    pub fn update_from_host(
        &self,
        staging: &StateStaging,
        compressor: Compressor,
        layer: u64,
        inputs: &HostStateInputs<'_>,
    ) -> Result<(), StateUpdateError> {
        let small = |what: &'static str, got: usize, needed: u64| StateUpdateError::InputTooSmall {
            what,
            got: got as i64,
            needed: needed as i64,
        };
        let row = inputs.dim as u64 * inputs.dtype.size();
        let data = inputs.rows as u64 * row;
        let ape = compressor.ratio() as u64 * inputs.dim as u64 * inputs.ape_dtype.size();
        if inputs.kv.len() as u64 != data {
            return Err(small("kv bytes", inputs.kv.len(), data));
        }
        if inputs.score.len() as u64 != data {
            return Err(small("score bytes", inputs.score.len(), data));
        }
        if inputs.ape.len() as u64 != ape {
            return Err(small("ape bytes", inputs.ape.len(), ape));
        }
        if inputs.rows > self.capacity().max_tokens || inputs.rows > staging.max_rows {
            return Err(StateUpdateError::OverCapacity {
                what: "input rows",
                got: inputs.rows,
                max: staging.max_rows,
            });
        }
        if row > staging.row_bytes || ape > staging.ape_bytes {
            return Err(StateUpdateError::OverCapacity {
                what: "input dim",
                got: inputs.dim,
                max: (staging.row_bytes / 4) as usize,
            });
        }
        staging.owned.upload(staging.kv_at, inputs.kv)?;
        staging.owned.upload(staging.score_at, inputs.score)?;
        staging.owned.upload(staging.ape_at, inputs.ape)?;
        let base = staging.owned.base();
        let dev = StateInputs {
            kv: base + staging.kv_at,
            score: base + staging.score_at,
            ape: base + staging.ape_at,
            kv_row_stride: inputs.dim as i64,
            score_row_stride: inputs.dim as i64,
            rows: inputs.rows as i64,
            dim: inputs.dim as i64,
            dtype: inputs.dtype,
            ape_dtype: inputs.ape_dtype,
        };
        // SAFETY: kv, score and ape are this staging buffer's (rows × dim and ratio × dim
        // elements just uploaded, checked to fit), on the pool's backend and stream, aligned
        // to 256 B, disjoint from the pool's planes.
        unsafe { self.update(compressor, layer, &dev) }
    }
}
