//! What the Python module and the C ABI share, so each stays a thin translation of its
//! host language: error variant names, opening a backend by name and device, and a decode
//! step over flat arrays (the shape both languages hand over: one array per field) on top of
//! the pool's [`DecodePath`].

use crate::backend::{self, Backend, BackendChoice, BackendError, BackendKind, Stream};
use crate::geometry::Class;
use crate::index::DevicePtr;
use crate::pool::{DecodeCapacity, DecodeError, DecodePath, DecodeSeq, DeviceBuffer, Pool, PoolError};
use std::sync::Arc;
use thiserror::Error;

/// What a [`DecodeStep`] rejects beyond the decode path's own checks.
#[derive(Debug, Error)]
pub enum StepError {
    /// The decode path refused the batch.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The pool refused.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(
        "batch arrays differ in length: {positions} positions, {context_lens} context lengths, {num_tokens} token counts"
    )]
    /// The batch arrays differ in length.
    BatchShape {
        /// Positions given.
        positions: usize,
        /// Context lengths given.
        context_lens: usize,
        /// Token counts given.
        num_tokens: usize,
    },
    #[error("sequence {seq}: {num_tokens} tokens is not a count")]
    /// A token count is negative or too large.
    BadTokenCount {
        /// The sequence.
        seq: usize,
        /// Its token count.
        num_tokens: i64,
    },
    #[error("class {class:?} is not in this geometry")]
    /// The class is not in this geometry.
    NoSuchClass {
        /// The class asked for.
        class: Class,
    },
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

/// Parse a class name (`dense`, `csa`, `hca`).
pub fn class_from_name(name: &str) -> Option<Class> {
    match name {
        "dense" => Some(Class::Dense),
        "csa" => Some(Class::Csa),
        "hca" => Some(Class::Hca),
        _ => None,
    }
}

/// Parse a compressor name (`csa_main`, `csa_idx`, `hca_main`).
pub fn compressor_from_name(name: &str) -> Option<crate::state::update::Compressor> {
    use crate::state::update::Compressor;
    match name {
        "csa_main" => Some(Compressor::CsaMain),
        "csa_idx" => Some(Compressor::CsaIdx),
        "hca_main" => Some(Compressor::HcaMain),
        _ => None,
    }
}

/// The state-update element type of a DLPack `(code, bits)` (float32 or bfloat16).
pub fn elem_type_from_dlpack(code: u8, bits: u8) -> Option<crate::index::ElemType> {
    match (code, bits) {
        (2, 32) => Some(crate::index::ElemType::F32),
        (4, 16) => Some(crate::index::ElemType::Bf16),
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
    /// Columns from one block-table row to the next.
    pub table_stride: usize,
}

/// A pool's [`DecodePath`] driven by flat arrays, with the build launched on any stream
/// (the staging goes on the pool's stream; a graph may capture the build on its own).
pub struct DecodeStep {
    path: DecodePath,
    /// Stands in for resident block tables in the length check of `stage_resident`.
    resident_table: Vec<i32>,
    /// Positions of the batch last staged, checked live again before a build.
    staged: Vec<i64>,
    /// Streams a build went on besides the pool's; drained before the buffers go.
    streams: Vec<Stream>,
}

impl std::fmt::Debug for DecodeStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeStep").field("path", &self.path).finish()
    }
}

impl DecodeStep {
    /// A decode path for `cap` on the pool.
    pub fn new(pool: Arc<Pool>, cap: DecodeCapacity) -> Result<DecodeStep, StepError> {
        let path = pool.decode_path(cap)?;
        Ok(DecodeStep {
            resident_table: vec![0; cap.max_blocks_per_seq],
            staged: Vec::new(),
            streams: Vec::new(),
            path,
        })
    }

    /// The decode path this step drives.
    pub fn path(&self) -> &DecodePath {
        &self.path
    }

    /// Stage `batch` on the pool's stream (one host-to-device copy); returns the real tokens.
    pub fn stage(&mut self, batch: &FlatBatch<'_>) -> Result<usize, StepError> {
        let n = batch.positions.len();
        if batch.context_lens.len() != n || batch.num_tokens.len() != n {
            return Err(StepError::BatchShape {
                positions: n,
                context_lens: batch.context_lens.len(),
                num_tokens: batch.num_tokens.len(),
            });
        }
        let bs = self.path.pool().spec().geometry.block_size.max(1);
        let mut seqs = Vec::with_capacity(n);
        for b in 0..n {
            let ctx = batch.context_lens[b];
            let tokens = usize::try_from(batch.num_tokens[b])
                .map_err(|_| StepError::BadTokenCount { seq: b, num_tokens: batch.num_tokens[b] })?;
            // Each sequence's table is the columns its context needs (the path checks them
            // against the capacity and the pool); resident tables are only length-checked.
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
        let tokens = if batch.block_tables.is_some() {
            self.path.stage(&seqs)?
        } else {
            self.path.stage_resident(&seqs)?
        };
        self.staged.clear();
        self.staged.extend_from_slice(batch.positions);
        Ok(tokens)
    }

    /// Write batch row `row`'s device block table from column `start_col`.
    pub fn write_block_table(&mut self, row: usize, start_col: usize, ids: &[i32]) -> Result<(), StepError> {
        Ok(self.path.write_block_table(row, start_col, ids)?)
    }

    /// Queue the decode index build on `stream` (the pool's when `None`): fixed pointers and
    /// grid, so the launch may be captured in a graph and replayed after each stage. The
    /// staged positions are checked live first, as [`DecodePath::build`] does.
    pub fn build(&mut self, stream: Option<Stream>) -> Result<(), StepError> {
        let pool = Arc::clone(self.path.pool());
        let stream = match stream {
            Some(s) if s != pool.stream() => s,
            _ => return Ok(self.path.build()?),
        };
        let live = pool.with_boundary(|b| b.live_positions())?;
        if let Some((seq, &position)) = self.staged.iter().enumerate().find(|(_, p)| !live.contains(p)) {
            return Err(DecodeError::BadPosition { seq, position, first: live.start, end: live.end }.into());
        }
        // SAFETY: the launch's pointers are the path's own buffers (sized for its capacity,
        // the staged offsets checked against each class's slice capacity) and the pool's
        // planes at positions just checked live; both outlive the call (`self` holds them).
        // The caller orders `stream` after the staging on the pool's stream.
        unsafe { pool.backend().launch(&self.path.build_launch(), stream)? };
        if !self.streams.contains(&stream) {
            self.streams.push(stream);
        }
        Ok(())
    }

    fn buffer(&self, class: Class, b: Option<DeviceBuffer>) -> Result<(DevicePtr, u64), StepError> {
        b.map(|b| (b.ptr, b.len)).ok_or(StepError::NoSuchClass { class })
    }

    /// A class's index buffer (`i32`, `max_tokens × slice capacity`): address and elements.
    pub fn indices(&self, class: Class) -> Result<(DevicePtr, u64), StepError> {
        self.buffer(class, self.path.indices(class))
    }

    /// A class's indptr (`max_tokens + 1` i32).
    pub fn indptr(&self, class: Class) -> Result<(DevicePtr, u64), StepError> {
        self.buffer(class, self.path.indptr(class))
    }

    /// A class's destination rows (`max_tokens` i32).
    pub fn dest_rows(&self, class: Class) -> Result<(DevicePtr, u64), StepError> {
        self.buffer(class, self.path.dest_rows(class))
    }

    /// Wait for the pool's stream and every other stream a build went on.
    pub fn synchronize(&self) -> Result<(), BackendError> {
        let pool = self.path.pool();
        pool.backend().synchronize(pool.stream())?;
        for &s in &self.streams {
            pool.backend().synchronize(s)?;
        }
        Ok(())
    }
}

impl Drop for DecodeStep {
    fn drop(&mut self) {
        // The path frees its buffers on drop after its own stream; builds on other streams
        // must be done first.
        let _ = self.synchronize();
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
        let d = PoolError::Decode(Box::new(DecodeError::NegativeTopk(-1)));
        assert_eq!(error_variant(&d), "NegativeTopk");
        let p = DecodeError::Pool(Box::new(PoolError::Poisoned));
        assert_eq!(error_variant(&p), "Poisoned");
        assert_eq!(error_variant(&PoolError::MinSlots(3)), "MinSlots");
        assert_eq!(error_variant(&PoolError::Poisoned), "Poisoned");
        let b = PoolError::Backend(BackendError::UnknownBackendName { value: "x".into() });
        assert_eq!(error_variant(&b), "UnknownBackendName");
    }

    #[test]
    fn backends_open_by_name() {
        assert_eq!(open_backend("host", 0).unwrap().kind(), BackendKind::Host);
        assert_eq!(error_variant(&open_backend("tpu", 0).unwrap_err()), "UnknownBackendName");
        assert_eq!(class_from_name("hca"), Some(Class::Hca));
        assert_eq!(class_from_name("x"), None);
    }
}
