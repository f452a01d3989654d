//! What the Python module and the C ABI share, so each stays a thin translation of its
//! host language: error variant names, opening a backend by name and device, and a decode
//! step over flat arrays (the shape both languages hand over: one array per field).

use crate::backend::{self, Backend, BackendChoice, BackendError, BackendKind, Stream};
use crate::index::{DevicePtr, CLASS_CSA, CLASS_DENSE, CLASS_HCA};
use crate::pool::{DecodeCapacity, DecodeError, DecodeIndexBuffers, DecodeSeq, Pool, PoolError};
use std::sync::Arc;
use thiserror::Error;

/// What a [`DecodeStep`] rejects beyond the buffers' own checks.
#[derive(Debug, Error)]
pub enum StepError {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("batch arrays differ in length: {positions} positions, {context_lens} context lengths, {num_tokens} token counts")]
    BatchShape { positions: usize, context_lens: usize, num_tokens: usize },
    #[error("sequence {seq}: {num_tokens} tokens is not a count")]
    BadTokenCount { seq: usize, num_tokens: i64 },
    #[error("CSA copy {layer} outside 0..{copies}")]
    NoSuchCopy { layer: usize, copies: usize },
    #[error("class {class} is not in this geometry (dense 0, csa 1, hca 2)")]
    NoSuchClass { class: usize },
}

/// The innermost variant name of an error, read from its `Debug` form: wrappers of the
/// form `Outer(Inner { .. })` or `Outer(Inner(..))` report `Inner`, so a geometry error
/// inside a pool error reports the geometry's variant, as `v4pool plan --json` does.
/// Errors with a `variant_name` of their own should use it; this serves the rest.
pub fn error_variant(err: &dyn std::fmt::Debug) -> String {
    let text = format!("{err:?}");
    let mut rest = text.as_str();
    loop {
        let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
        let name = &rest[..end];
        let after = &rest[end..];
        // Descend only into a single tuple field that is itself a variant (starts with an
        // upper-case identifier), not into a message string or a number.
        match after.strip_prefix('(') {
            Some(inner) if inner.starts_with(|c: char| c.is_ascii_uppercase()) => rest = inner,
            _ => return name.to_string(),
        }
    }
}

/// Open a backend by name (`auto`, `host`, `cuda`, `hip`) on device `device`.
pub fn open_backend(name: &str, device: usize) -> Result<Arc<dyn Backend>, BackendError> {
    let kind = match name {
        "auto" => {
            let b = backend::select(BackendChoice::Auto)?;
            if device == 0 || b.kind() == BackendKind::Host {
                return Ok(b);
            }
            b.kind()
        }
        other => BackendKind::parse(other)?,
    };
    Ok(match kind {
        BackendKind::Host => Arc::new(backend::host::HostBackend::new()),
        BackendKind::Cuda => Arc::new(backend::cuda::CudaBackend::new(device)?),
        BackendKind::Hip => Arc::new(backend::hip::HipBackend::new(device)?),
    })
}

/// Parse a class name (`dense`, `csa`, `hca`) into its `CLASS_*` slot.
pub fn class_from_name(name: &str) -> Option<usize> {
    match name {
        "dense" => Some(CLASS_DENSE),
        "csa" => Some(CLASS_CSA),
        "hca" => Some(CLASS_HCA),
        _ => None,
    }
}

/// One decode step's batch as flat arrays (index `b` is sequence `b`).
#[derive(Clone, Copy, Debug)]
pub struct FlatBatch<'a> {
    /// Slot positions (from `physical_slot`).
    pub positions: &'a [i64],
    /// Context length after the step, its tokens included.
    pub context_lens: &'a [i64],
    /// Tokens the step writes per sequence (1 + drafts).
    pub num_tokens: &'a [i64],
    /// Block tables, row `b` at `b * table_stride`; `None`: the tables are resident on the
    /// device (written with [`DecodeStep::write_block_table`]).
    pub block_tables: Option<&'a [i32]>,
    pub table_stride: usize,
}

/// The decode index buffers of one pool: stage a batch, build on a stream, read the
/// buffers' addresses. Holds the pool so the buffers never outlive the planes they index.
pub struct DecodeStep {
    pool: Arc<Pool>,
    bufs: DecodeIndexBuffers,
    /// Stands in for resident block tables in the length check of `stage_resident`.
    resident_table: Vec<i32>,
    /// Streams work was queued on; drained before the buffers go.
    streams: Vec<Stream>,
}

impl std::fmt::Debug for DecodeStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeStep").field("bufs", &self.bufs).finish()
    }
}

impl DecodeStep {
    /// Buffers for `cap` on the pool's backend.
    pub fn new(pool: Arc<Pool>, cap: DecodeCapacity) -> Result<DecodeStep, StepError> {
        let g = pool.geometry()?;
        let bufs = DecodeIndexBuffers::new(pool.backend().as_ref(), &g, cap)?;
        Ok(DecodeStep {
            resident_table: vec![0; cap.max_blocks_per_seq],
            streams: vec![pool.stream()],
            pool,
            bufs,
        })
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn buffers(&self) -> &DecodeIndexBuffers {
        &self.bufs
    }

    fn note(&mut self, stream: Stream) {
        if !self.streams.contains(&stream) {
            self.streams.push(stream);
        }
    }

    /// Stage `batch` on `stream` (one host-to-device copy); returns the real tokens. The
    /// pool's current live positions bound the batch's positions.
    pub fn stage(&mut self, batch: &FlatBatch<'_>, stream: Stream) -> Result<usize, StepError> {
        let n = batch.positions.len();
        if batch.context_lens.len() != n || batch.num_tokens.len() != n {
            return Err(StepError::BatchShape {
                positions: n,
                context_lens: batch.context_lens.len(),
                num_tokens: batch.num_tokens.len(),
            });
        }
        let live = self.pool.with_boundary(|b| b.live_positions())?;
        self.bufs.set_live_positions(live);
        let bs = self.pool.spec().geometry.block_size.max(1);
        let mut seqs = Vec::with_capacity(n);
        for b in 0..n {
            let ctx = batch.context_lens[b];
            let tokens = usize::try_from(batch.num_tokens[b])
                .map_err(|_| StepError::BadTokenCount { seq: b, num_tokens: batch.num_tokens[b] })?;
            // Each sequence's table is the columns its context needs (checked below by the
            // buffers against the capacity); resident tables are only length-checked.
            let needed = usize::try_from((ctx.max(0) + bs - 1) / bs).unwrap_or(usize::MAX);
            let block_table = match batch.block_tables {
                Some(t) => {
                    let start = b.saturating_mul(batch.table_stride);
                    let cols = needed.min(batch.table_stride);
                    t.get(start..start.saturating_add(cols)).ok_or(DecodeError::BlockTableTooShort {
                        seq: b,
                        context_len: ctx,
                        needed: needed as i64,
                        got: t.len().saturating_sub(start).min(batch.table_stride),
                    })?
                }
                None => &self.resident_table[..needed.min(self.resident_table.len())],
            };
            seqs.push(DecodeSeq {
                position: batch.positions[b],
                context_len: ctx,
                num_tokens: tokens,
                block_table,
            });
        }
        let backend = self.pool.backend().clone();
        let tokens = if batch.block_tables.is_some() {
            self.bufs.stage(backend.as_ref(), &seqs, stream)?
        } else {
            self.bufs.stage_resident(backend.as_ref(), &seqs, stream)?
        };
        self.note(stream);
        Ok(tokens)
    }

    /// Write batch row `row`'s device block table from column `start_col`.
    pub fn write_block_table(
        &mut self,
        row: usize,
        start_col: usize,
        ids: &[i32],
        stream: Stream,
    ) -> Result<(), StepError> {
        let backend = self.pool.backend().clone();
        self.bufs.write_block_table(backend.as_ref(), row, start_col, ids, stream)?;
        self.note(stream);
        Ok(())
    }

    /// Queue the decode index build on `stream`: fixed pointers and grid, so the launch may
    /// be captured in a graph and replayed after each [`Self::stage`].
    pub fn build(&mut self, stream: Stream) -> Result<(), StepError> {
        let launch = self.bufs.launch();
        // SAFETY: the launch's pointers are the buffers' own (sized for their capacity at
        // construction) and the pool's planes, both live while `self` holds the pool.
        unsafe { self.pool.backend().launch(&launch, stream)? };
        self.note(stream);
        Ok(())
    }

    /// A class's index buffer (`i32`, `max_tokens × slice capacity`): address and elements.
    pub fn indices(&self, class: usize, layer: usize) -> Result<(DevicePtr, u64), StepError> {
        self.check_class(class)?;
        let copies = self.bufs.capacity().csa_layers;
        if class == CLASS_CSA && layer >= copies {
            return Err(StepError::NoSuchCopy { layer, copies });
        }
        Ok(self.bufs.indices(class, if class == CLASS_CSA { layer } else { 0 }))
    }

    /// A class's indptr (`max_tokens + 1` i32).
    pub fn indptr(&self, class: usize) -> Result<(DevicePtr, u64), StepError> {
        self.check_class(class)?;
        Ok((self.bufs.indptr(class), self.bufs.capacity().max_tokens as u64 + 1))
    }

    /// A class's destination rows (`max_tokens` i32).
    pub fn dest_rows(&self, class: usize) -> Result<(DevicePtr, u64), StepError> {
        self.check_class(class)?;
        Ok((self.bufs.dest_rows(class), self.bufs.capacity().max_tokens as u64))
    }

    fn check_class(&self, class: usize) -> Result<(), StepError> {
        let present = self.bufs.decode_args().classes.get(class).is_some_and(|c| c.indptr != 0);
        if present {
            Ok(())
        } else {
            Err(StepError::NoSuchClass { class })
        }
    }

    /// Wait for every stream this step queued work on.
    pub fn synchronize(&self) -> Result<(), BackendError> {
        for &s in &self.streams {
            self.pool.backend().synchronize(s)?;
        }
        Ok(())
    }
}

impl Drop for DecodeStep {
    fn drop(&mut self) {
        let _ = self.synchronize();
        // SAFETY: every stream the buffers were used on is drained; a captured graph that
        // still names them is the caller's documented misuse (it must not outlive the step).
        unsafe { self.bufs.release(self.pool.backend().as_ref()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::GeometryError;

    #[test]
    fn variant_names_descend_through_wrappers() {
        let e = PoolError::Geometry(GeometryError::RingSlots { got: -1 });
        assert_eq!(error_variant(&e), "RingSlots");
        assert_eq!(error_variant(&PoolError::Decode("x".into())), "Decode");
        assert_eq!(error_variant(&PoolError::MinSlots(3)), "MinSlots");
        assert_eq!(error_variant(&PoolError::Poisoned), "Poisoned");
        let b = PoolError::Backend(BackendError::UnknownBackendName { value: "x".into() });
        assert_eq!(error_variant(&b), "UnknownBackendName");
    }

    #[test]
    fn backends_open_by_name() {
        assert_eq!(open_backend("host", 0).unwrap().kind(), BackendKind::Host);
        assert_eq!(error_variant(&open_backend("tpu", 0).unwrap_err()), "UnknownBackendName");
        assert_eq!(class_from_name("hca"), Some(CLASS_HCA));
        assert_eq!(class_from_name("x"), None);
    }
}
