//! The forward's own-row writes (docs/forward.md): the model's bf16 KV into the pool's row
//! format, through the `v4pool_kv_rows` kernel (fp8 pack or bf16 copy), and the indexer's keys
//! into the indexer K cache's format through `v4pool_index_keys` (bf16 copy, FP8 or FP4 pack).
//!
//! ```text
//! let mut w = pool.kv_row_writer(RowWriteCapacity { max_tokens })?;   // once
//! // decode: the token's own rows are the decode build's destination rows
//! w.write_decode(&path, layer, &kv)?;                 // per layer, before its attention
//! // prefill: the chunk's window rows (the ring write), staged once per forward
//! w.stage_window(&[WindowSeq { slot, first_position, tokens }, ..])?;
//! w.write(layer, RowSet::Window, &kv)?;               // per layer, after its attention
//! // a compressor's emitted entries at the request's compressed rows
//! w.stage_compressed(Class::Csa, &[CompressedRow { block, row }, ..])?;
//! w.write(layer, RowSet::Compressed(Class::Csa), &kv)?;  // before the indexer and attention
//! w.write_index_keys(csa_rank, &keys, 128)?;           // the same entries' indexer keys
//! ```
//!
//! Rows are computed from the geometry (`window_index`, `compress_index`) from slot leases and
//! block handles, never taken from the caller; a write re-checks every staged lease and block
//! under the pool's state lock and queues its launch under the same lock.

use super::decode::check_live;
use super::owned::{Carve, Owned};
use super::{DecodeError, DecodePath, Pool, PoolError};
use crate::alloc::{AllocError, BlockHandle, SlotHandle};
use crate::backend::BackendError;
use crate::geometry::Class;
use crate::index::{DevicePtr, IndexKeysArgs, KvRowsArgs, Launch, KV_ROWS_ATOM_FP8, KV_ROW_VALUES};
use crate::sizing::IndexerDtype;
use std::sync::Arc;
use thiserror::Error;

crate::variant::variant_names! {
/// What a KV row write refuses, before anything is launched.
#[derive(Debug, Error)]
pub enum RowWriteError {
    /// More tokens than the writer was sized for.
    #[error("{got} tokens exceed the writer's capacity of {cap}")]
    TooManyTokens {
        /// Tokens given.
        got: usize,
        /// `max_tokens`.
        cap: usize,
    },
    /// A KV buffer that is not `tokens` rows of 512 bf16 values.
    #[error("kv holds {len} bf16 values, not {tokens} rows of {row} (row stride {stride})")]
    KvShape {
        /// Values given.
        len: usize,
        /// Rows needed.
        tokens: usize,
        /// Values per row read.
        row: usize,
        /// Values from one row to the next.
        stride: usize,
    },
    /// A layer the rows cannot go to.
    #[error("layer {layer}: {source}")]
    BadLayer {
        /// The layer given.
        layer: usize,
        /// The geometry's or pool's refusal.
        #[source]
        source: Box<PoolError>,
    },
    /// Nothing staged for this row set (or staged for another class).
    #[error("no rows staged for {what}")]
    NothingStaged {
        /// The row set asked for.
        what: String,
    },
    /// The layer's class has no compressed rows, or the geometry lacks the class.
    #[error("class {class:?} has no {what} rows in this pool")]
    NoSuchRows {
        /// The class asked for.
        class: Class,
        /// Window or compressed.
        what: &'static str,
    },
    /// A negative first position.
    #[error("sequence {seq}: position {position} is negative")]
    NegativePosition {
        /// Batch row.
        seq: usize,
        /// The position.
        position: i64,
    },
    /// A sequence whose last position (`first_position + tokens − 1`) is past `i64`.
    #[error("sequence {seq}: {tokens} tokens from position {first_position} run past i64")]
    PositionPastI64 {
        /// Batch row.
        seq: usize,
        /// Its first position.
        first_position: i64,
        /// Its tokens.
        tokens: usize,
    },
    /// Two sequences of one window stage on one slot: their ring rows would race.
    #[error("sequences {first} and {second} share slot position {position}")]
    SharedSlot {
        /// The first sequence.
        first: usize,
        /// The second.
        second: usize,
        /// Their position.
        position: i64,
    },
    /// A slot lease that is not live.
    #[error("sequence {seq}: slot lease is not live: {source}")]
    StaleLease {
        /// Batch row.
        seq: usize,
        /// The allocator's reason.
        #[source]
        source: AllocError,
    },
    /// A block handle that is not live, or a row outside the block.
    #[error("entry {entry}: {source}")]
    BadEntry {
        /// Entry index.
        entry: usize,
        /// The allocator's or geometry's refusal.
        #[source]
        source: Box<PoolError>,
    },
    /// A staged entry outside the indexer cache's view.
    #[error("entry {entry}: block {block} row {row} outside the indexer cache")]
    EntryOutsideIndexer {
        /// Entry index.
        entry: usize,
        /// Its block id.
        block: u32,
        /// Its row in the block.
        row: i64,
    },
    /// A row number past `i32` (the kernels' row type).
    #[error("row {row} exceeds i32")]
    RowPastI32 {
        /// The row.
        row: i64,
    },
    /// An indexer cache whose rows per block or blocks overflow the kernel's `i32` / `i64`.
    #[error("indexer cache of {blocks} blocks overflows the index-key kernel's integers")]
    IndexerTooLarge {
        /// Its blocks.
        blocks: u64,
    },
    /// A decode path of another pool.
    #[error("the decode path indexes another pool")]
    ForeignPath,
    /// The decode path's staged batch no longer matches the pool.
    #[error("decode path: {0}")]
    Decode(#[source] Box<DecodeError>),
    /// Index keys for a pool without an indexer cache.
    #[error("index keys: the pool's indexer cache is {format}")]
    IndexerFormat {
        /// The pool's indexer format (`none`: it has no indexer cache).
        format: &'static str,
    },
    /// A pool from parts whose spec says nothing of its rows (`PoolSpec::with_kv_spec`): its
    /// planes are bytes, and no format is read back from their widths.
    #[error(
        "the pool's spec has no row format (a spec from parts: give it one with PoolSpec::with_kv_spec)"
    )]
    NoRowFormat,
    /// Sizes whose byte counts overflow.
    #[error("a writer of {max_tokens} tokens overflows")]
    TooLarge {
        /// `max_tokens`.
        max_tokens: usize,
    },
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The pool refused.
    #[error("pool: {0}")]
    Pool(#[source] Box<PoolError>),
}
}

type Result<T> = std::result::Result<T, RowWriteError>;

fn pool_err(e: PoolError) -> RowWriteError {
    match e {
        PoolError::Backend(b) => RowWriteError::Backend(b),
        other => RowWriteError::Pool(Box::new(other)),
    }
}

/// What a writer is sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RowWriteCapacity {
    /// Most tokens (rows) one write carries.
    pub max_tokens: usize,
}

impl RowWriteCapacity {
    /// A writer for writes of up to `max_tokens` rows.
    pub fn new(max_tokens: usize) -> Self {
        RowWriteCapacity { max_tokens }
    }
}

/// One sequence of a prefill chunk: its tokens are `first_position ..` and sit contiguously in
/// the KV (sequences in batch order).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct WindowSeq {
    /// The request's slot.
    pub slot: SlotHandle,
    /// Position of the chunk's first token.
    pub first_position: i64,
    /// Tokens of the chunk.
    pub tokens: usize,
}

impl WindowSeq {
    /// One sequence's window writes, every field given (the struct is `#[non_exhaustive]`: a field added later
    /// gets a default here and a setter).
    pub fn new(slot: SlotHandle, first_position: i64, tokens: usize) -> Self {
        WindowSeq { slot, first_position, tokens }
    }
}

/// One compressed entry a compressor emitted: row `row` (`0 .. block_rows` of the class) of
/// block `block` of the request's block table.
#[derive(Clone, Copy, Debug)]
pub struct CompressedRow {
    /// The block holding the entry.
    pub block: BlockHandle,
    /// Row inside the block (entry index mod rows per block).
    pub row: i64,
}

/// Which staged rows a write goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowSet {
    /// The last [`WindowSeq`]s staged: their window rows in the layer's class ring.
    Window,
    /// The last [`CompressedRow`]s staged for this class.
    Compressed(Class),
}

/// Rows staged for one class: per-class destination rows (layer-independent) on the device.
#[derive(Debug, Default)]
enum Staged {
    #[default]
    Nothing,
    Window {
        slots: Vec<SlotHandle>,
        tokens: usize,
    },
    Compressed {
        class: Class,
        blocks: Vec<BlockHandle>,
        /// Each entry's row in its block (the indexer cache's row for a CSA entry).
        rows: Vec<i64>,
    },
}

pub use crate::index::INDEX_KEY_VALUES;

/// The KV row writer of one pool: an owned handle (see the module doc).
#[derive(Debug)]
pub struct KvRowWriter {
    pool: Arc<Pool>,
    owned: Owned,
    cap: RowWriteCapacity,
    kv_at: u64,
    /// Window destination rows, one buffer per class (dense, CSA, HCA).
    window_at: [u64; 3],
    compressed_at: u64,
    /// The staged CSA entries' indexer destinations (`block × rows_per_block + row`).
    index_at: u64,
    window: Staged,
    compressed: Staged,
    /// `KvRowsArgs::format` of the pool's planes.
    format: i32,
    /// `KvRowsArgs::format` of its compressed rows: `format`, or the packed rows' own
    /// (`KV_ROWS_FLASHMLA_V41_FP4`, written through [`Pool::compressed_view`]).
    compressed_format: i32,
}

fn class_index(class: Class) -> usize {
    match class {
        Class::Dense => 0,
        Class::Csa => 1,
        Class::Hca => 2,
    }
}

impl Pool {
    /// A KV row writer for this pool, sized for `cap` (see [`KvRowWriter`]).
    pub fn kv_row_writer(self: &Arc<Self>, cap: RowWriteCapacity) -> Result<KvRowWriter> {
        KvRowWriter::new(Arc::clone(self), cap)
    }
}

impl KvRowWriter {
    /// Buffers for `cap` on `pool`'s backend and stream.
    pub fn new(pool: Arc<Pool>, cap: RowWriteCapacity) -> Result<KvRowWriter> {
        // The spec says what the rows are (validated against the planes and the packing
        // when the spec was made); the kernels' codes are the formats' own.
        let kv = pool.spec().kv_spec().ok_or(RowWriteError::NoRowFormat)?;
        let format = kv.row_format().id.kernel_code();
        let compressed_format = kv.compressed_row_format().id.kernel_code();
        let too_large = RowWriteError::TooLarge { max_tokens: cap.max_tokens };
        if i32::try_from(cap.max_tokens).is_err() {
            return Err(too_large);
        }
        let n = cap.max_tokens as u64;
        let mut c = Carve::default();
        let layout = (|| {
            let kv = c.take(n.checked_mul(KV_ROW_VALUES as u64)?, 2)?;
            let w = [c.take(n, 4)?, c.take(n, 4)?, c.take(n, 4)?];
            let comp = c.take(n, 4)?;
            let index = c.take(n, 4)?;
            Some((kv, w, comp, index))
        })();
        let (kv_at, window_at, compressed_at, index_at) = layout.ok_or(too_large)?;
        let owned = Owned::new(Arc::clone(pool.backend()), pool.stream(), c.end())?;
        Ok(KvRowWriter {
            pool,
            owned,
            cap,
            kv_at,
            window_at,
            compressed_at,
            index_at,
            window: Staged::Nothing,
            compressed: Staged::Nothing,
            format,
            compressed_format,
        })
    }

    /// What the buffers were sized for.
    pub fn capacity(&self) -> RowWriteCapacity {
        self.cap
    }
    /// Whether the pool packs ATOM's fp8 rows (else bf16 copies or FlashMLA V4.1 rows).
    pub fn is_fp8(&self) -> bool {
        self.format == KV_ROWS_ATOM_FP8
    }
    /// The pool's row format as `KvRowsArgs::format` names it.
    pub fn row_format_code(&self) -> i32 {
        self.format
    }
    /// The compressed rows' format as `KvRowsArgs::format` names it (the row format's, unless
    /// the pool packs its compressed rows).
    pub fn compressed_format_code(&self) -> i32 {
        self.compressed_format
    }
    /// The pool written to.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    fn check_tokens(&self, tokens: usize) -> Result<()> {
        if tokens > self.cap.max_tokens {
            return Err(RowWriteError::TooManyTokens { got: tokens, cap: self.cap.max_tokens });
        }
        Ok(())
    }

    /// Stage a prefill chunk's window rows for every class of the pool (one upload per class):
    /// of each sequence's tokens the last `min(tokens, ring_slots)` go to their ring rows (the
    /// ring write), earlier ones nowhere (a later token of the chunk takes their row). Returns
    /// the tokens staged.
    pub fn stage_window(&mut self, seqs: &[WindowSeq]) -> Result<usize> {
        let tokens = seqs.iter().try_fold(0usize, |n, s| n.checked_add(s.tokens));
        let tokens =
            tokens.ok_or(RowWriteError::TooManyTokens { got: usize::MAX, cap: self.cap.max_tokens })?;
        self.check_tokens(tokens)?;
        for (seq, s) in seqs.iter().enumerate() {
            if s.first_position < 0 {
                return Err(RowWriteError::NegativePosition { seq, position: s.first_position });
            }
            // Positions are `first_position + i`, i < tokens: the last must be one too.
            let last =
                i64::try_from(s.tokens.saturating_sub(1)).ok().and_then(|t| s.first_position.checked_add(t));
            if last.is_none() {
                return Err(RowWriteError::PositionPastI64 {
                    seq,
                    first_position: s.first_position,
                    tokens: s.tokens,
                });
            }
        }
        let positions = self
            .pool
            .with_boundary(|b| {
                seqs.iter()
                    .enumerate()
                    .map(|(seq, s)| {
                        b.position(s.slot).map_err(|e| RowWriteError::StaleLease { seq, source: e })
                    })
                    .collect::<Result<Vec<i64>>>()
            })
            .map_err(pool_err)??;
        let mut seen = std::collections::HashMap::with_capacity(positions.len());
        for (i, &p) in positions.iter().enumerate() {
            if let Some(first) = seen.insert(p, i) {
                return Err(RowWriteError::SharedSlot { first, second: i, position: p });
            }
        }
        let g = self.pool.geometry().map_err(pool_err)?;
        self.window = Staged::Nothing;
        for class in [Class::Dense, Class::Csa, Class::Hca] {
            // The slot's ratio (V4.1's fine and coarse slots are ratios 1 and 2): window rows
            // are the same for every layer of a class, so its first layer names them.
            let Some(ratio) = g.class_ratio(class).ok().flatten() else { continue };
            let Some(layer) = g.ratios.iter().position(|&r| r == ratio) else { continue };
            let mut rows = Vec::with_capacity(tokens);
            for (s, &slot) in seqs.iter().zip(&positions) {
                let keep = s.tokens.min(g.ring_slots as usize);
                for i in 0..s.tokens {
                    if i < s.tokens - keep {
                        rows.push(-1); // dropped: the ring keeps only the last ring_slots
                        continue;
                    }
                    let p = s.first_position + i as i64;
                    let row = g
                        .window_index(layer, slot, p % g.ring_slots)
                        .map_err(|e| RowWriteError::BadLayer { layer, source: Box::new(e.into()) })?;
                    rows.push(i32::try_from(row).map_err(|_| RowWriteError::RowPastI32 { row })?);
                }
            }
            self.owned.upload(self.window_at[class_index(class)], bytemuck::cast_slice(&rows))?;
        }
        self.window = Staged::Window { slots: seqs.iter().map(|s| s.slot).collect(), tokens };
        Ok(tokens)
    }

    /// Stage compressed entries of `class` (CSA or HCA): entry `i` goes to row `row` of its
    /// block (`compress_index`). Returns the entries staged.
    pub fn stage_compressed(&mut self, class: Class, entries: &[CompressedRow]) -> Result<usize> {
        self.check_tokens(entries.len())?;
        if class == Class::Dense {
            return Err(RowWriteError::NoSuchRows { class, what: "compressed" });
        }
        let g = self.pool.geometry().map_err(pool_err)?;
        let ratio = g.class_ratio(class).ok().flatten();
        let layer = ratio
            .and_then(|ratio| g.ratios.iter().position(|&r| r == ratio))
            .ok_or(RowWriteError::NoSuchRows { class, what: "compressed" })?;
        self.pool
            .with_boundary(|b| {
                entries.iter().enumerate().try_for_each(|(entry, e)| {
                    b.check_block(e.block)
                        .map_err(|err| RowWriteError::BadEntry { entry, source: Box::new(err.into()) })
                })
            })
            .map_err(pool_err)??;
        let mut rows = Vec::with_capacity(entries.len());
        for (entry, e) in entries.iter().enumerate() {
            let row = g
                .compress_index(layer, i64::from(e.block.id), e.row)
                .map_err(|err| RowWriteError::BadEntry { entry, source: Box::new(err.into()) })?;
            rows.push(i32::try_from(row).map_err(|_| RowWriteError::RowPastI32 { row })?);
        }
        self.compressed = Staged::Nothing;
        self.owned.upload(self.compressed_at, bytemuck::cast_slice(&rows))?;
        self.compressed = Staged::Compressed {
            class,
            blocks: entries.iter().map(|e| e.block).collect(),
            rows: entries.iter().map(|e| e.row).collect(),
        };
        Ok(entries.len())
    }

    /// The layer's class and its views (NoPE or bf16 plane, RoPE plane in fp8), and the view's
    /// first row in the plane when the format is paged (the kernel then takes the plane's row
    /// 0: page arithmetic starts there), else 0.
    fn layer_target(&self, layer: usize) -> Result<(Class, DevicePtr, DevicePtr, i64, i64)> {
        let g = &self.pool.spec().geometry;
        let bad = |e: PoolError| RowWriteError::BadLayer { layer, source: Box::new(e) };
        // The layer's index-buffer slot (V4: its ratio's class; V4.1: ratio 1 fine, 2 coarse).
        let class = g.layer_slot(layer).map_err(|e| bad(e.into()))?;
        let v0 = self.pool.layer_view(layer, 0).map_err(bad)?;
        let f = self.pool.spec().row_format().ok_or(RowWriteError::NoRowFormat)?;
        // A second plane is the RoPE plane (ATOM's fp8).
        let rope = if f.planes.len() > 1 { self.pool.layer_view(layer, 1).map_err(bad)?.ptr } else { 0 };
        if f.is_paged() {
            let plane = self.pool.plane_ptr(0).map_err(bad)?;
            let row0 = (v0.ptr - plane) / f.planes[0].row_bytes();
            return Ok((class, plane, 0, v0.rows, row0 as i64));
        }
        Ok((class, v0.ptr, rope, v0.rows, 0))
    }

    /// Where `set`'s rows of `layer` go and in which format: the layer's view in the planes'
    /// format ([`Self::layer_target`]), but a packed pool's compressed rows in its compressed
    /// view (plane row 0 on, 288-B rows; compressed indices are absolute there).
    fn set_target(&self, layer: usize, set: RowSet) -> Result<(Class, DevicePtr, DevicePtr, i64, i64, i32)> {
        let (class, nope, rope, view_rows, view_row0) = self.layer_target(layer)?;
        if !matches!(set, RowSet::Compressed(_)) || self.compressed_format == self.format {
            return Ok((class, nope, rope, view_rows, view_row0, self.format));
        }
        let bad = |e: PoolError| RowWriteError::BadLayer { layer, source: Box::new(e) };
        let v = self.pool.compressed_view(layer).map_err(bad)?;
        Ok((class, v.ptr, 0, v.rows, 0, self.compressed_format))
    }

    /// Rows a write to `set` reads from its KV (what was staged for it).
    pub fn staged_rows(&self, set: RowSet) -> Result<usize> {
        match (set, &self.window, &self.compressed) {
            (RowSet::Window, Staged::Window { tokens, .. }, _) => Ok(*tokens),
            (RowSet::Compressed(c), _, Staged::Compressed { class, blocks, .. }) if *class == c => {
                Ok(blocks.len())
            }
            _ => Err(RowWriteError::NothingStaged { what: format!("{set:?}") }),
        }
    }

    /// The launch of a write of `tokens` rows of `kv` to `set`'s staged rows in `layer`, and
    /// the check to run under the lock.
    fn args(&self, layer: usize, set: RowSet, kv: DevicePtr, stride: usize) -> Result<(KvRowsArgs, usize)> {
        let (class, nope, rope, view_rows, view_row0, format) = self.set_target(layer, set)?;
        let (dest, tokens) = match (set, &self.window, &self.compressed) {
            (RowSet::Window, Staged::Window { tokens, .. }, _) => {
                (self.owned.base() + self.window_at[class_index(class)], *tokens)
            }
            (RowSet::Compressed(c), _, Staged::Compressed { class: staged, blocks, .. })
                if *staged == c && c == class =>
            {
                (self.owned.base() + self.compressed_at, blocks.len())
            }
            _ => {
                return Err(RowWriteError::NothingStaged {
                    what: format!("{set:?} of layer {layer} ({class:?})"),
                })
            }
        };
        Self::kv_span(0, tokens, stride, KV_ROW_VALUES)?;
        let args = KvRowsArgs {
            kv,
            dest_rows: dest,
            batch_id_per_token: 0,
            nope,
            rope,
            kv_row_stride: stride as i64,
            view_rows,
            num_tokens: tokens as i32, // at most max_tokens, which fits an i32
            format,
            view_row0,
        };
        Ok((args, tokens))
    }

    /// Queue `launch` under the pool's lock after re-checking what `set` was staged from.
    ///
    /// # Safety
    /// `launch`'s pointers cover what its kernel reads and writes.
    unsafe fn queue(&self, set: RowSet, launch: &Launch) -> Result<()> {
        self.pool
            .with_boundary(|b| {
                match (set, &self.window, &self.compressed) {
                    (RowSet::Window, Staged::Window { slots, .. }, _) => {
                        for (seq, h) in slots.iter().enumerate() {
                            b.check_slot(*h).map_err(|e| RowWriteError::StaleLease { seq, source: e })?;
                        }
                    }
                    (RowSet::Compressed(_), _, Staged::Compressed { blocks, .. }) => {
                        for (entry, h) in blocks.iter().enumerate() {
                            b.check_block(*h)
                                .map_err(|e| RowWriteError::BadEntry { entry, source: Box::new(e.into()) })?;
                        }
                    }
                    _ => return Err(RowWriteError::NothingStaged { what: format!("{set:?}") }),
                }
                // SAFETY: forwarded from the caller.
                unsafe { self.owned.launch(launch) }.map_err(RowWriteError::from)
            })
            .map_err(pool_err)?
    }

    /// The launch writing the staged CSA entries' keys (`keys`, rows `stride` values apart)
    /// into CSA layer `rank`'s indexer cache in its format, with each entry's destination
    /// (`block × rows_per_block + row`, checked inside the cache) uploaded to this handle's
    /// buffer.
    fn index_keys_args(&self, rank: usize, keys: DevicePtr, stride: usize) -> Result<IndexKeysArgs> {
        let ix = self.pool.spec().indexer.ok_or(RowWriteError::IndexerFormat { format: "none" })?;
        let (blocks, rows) = match &self.compressed {
            Staged::Compressed { class: Class::Csa, blocks, rows } => (blocks, rows),
            _ => return Err(RowWriteError::NothingStaged { what: "CSA entries (index keys)".into() }),
        };
        Self::kv_span(0, blocks.len(), stride, INDEX_KEY_VALUES)?;
        let data = self.pool.indexer_view(rank, 0).map_err(pool_err)?;
        let format = ix.key_format_code();
        let scales = match ix {
            IndexerDtype::Fp4 => self.pool.indexer_view(rank, 1).map_err(pool_err)?.ptr,
            _ => 0,
        };
        let bad_cache = || RowWriteError::IndexerTooLarge { blocks: data.blocks };
        let block_rows = i32::try_from(data.rows_per_block).map_err(|_| bad_cache())?;
        let num_blocks = i64::try_from(data.blocks).map_err(|_| bad_cache())?;
        let mut dest = Vec::with_capacity(blocks.len());
        for (entry, (b, &row)) in blocks.iter().zip(rows).enumerate() {
            let id = u64::from(b.id);
            if id >= data.blocks || row < 0 || row as u64 >= data.rows_per_block {
                return Err(RowWriteError::EntryOutsideIndexer { entry, block: b.id, row });
            }
            let e = id * data.rows_per_block + row as u64;
            let past = || RowWriteError::RowPastI32 { row: i64::try_from(e).unwrap_or(i64::MAX) };
            dest.push(i32::try_from(e).map_err(|_| past())?);
        }
        self.owned.upload(self.index_at, bytemuck::cast_slice(&dest))?;
        Ok(IndexKeysArgs {
            keys,
            dest: self.owned.base() + self.index_at,
            data: data.ptr,
            scales,
            key_row_stride: stride as i64,
            num_blocks,
            num_tokens: blocks.len() as i32, // at most max_tokens, an i32
            block_rows,
            format,
            _pad: 0,
        })
    }

    /// The indexer's key rows of the staged CSA entries (`stage_compressed(Class::Csa, ..)`,
    /// the same entries as the main compressor's) into CSA layer `rank`'s indexer cache:
    /// `keys` row `i` (128 bf16 values at `i × stride`) to entry `i`'s block and row, in the
    /// cache's format (bf16 copied; FP8 and FP4 quantised by `v4pool_index_keys`, the formula
    /// of `index::host::keys`). Uploaded to the writer's own buffer, then one launch under the
    /// pool's lock after the staged blocks are re-checked live; before the layer's indexer
    /// scores them.
    pub fn write_index_keys(&self, rank: usize, keys: &[u16], stride: usize) -> Result<()> {
        let kv = self.owned.base() + self.kv_at;
        let args = self.index_keys_args(rank, kv, INDEX_KEY_VALUES)?;
        let n = args.num_tokens as usize;
        self.upload_rows(keys, n, stride, INDEX_KEY_VALUES)?;
        // SAFETY: keys are this handle's staging buffer (n ≤ max_tokens rows of 128 ≤ its 512
        // values a row), dest its own buffer of n entries; data (and FP4 scales) the layer's
        // indexer arrays of num_blocks blocks, every entry checked inside them.
        unsafe { self.queue(RowSet::Compressed(Class::Csa), &Launch::IndexKeys(args)) }
    }

    /// [`Self::write_index_keys`] from device memory: `keys` row `i` at `keys + i × stride × 2`.
    ///
    /// # Safety
    /// `keys .. + ((entries − 1) × stride + 128) × 2` bytes (entries = the staged CSA entries)
    /// is live memory of the pool's backend holding bf16 values, 2-B aligned, ready on the
    /// pool's stream, overlapping neither the indexer cache nor this handle's buffers.
    pub unsafe fn write_index_keys_from(&self, rank: usize, keys: DevicePtr, stride: usize) -> Result<()> {
        let launch = self.index_keys_launch(rank, keys, stride)?;
        // SAFETY: keys covered by the caller; the rest as in `write_index_keys`.
        unsafe { self.queue(RowSet::Compressed(Class::Csa), &launch) }
    }

    /// The launch [`Self::write_index_keys_from`] queues, for graph capture and
    /// [`crate::pool::WriteBatch`]: the same checks and the same upload of the entries'
    /// destinations to this handle's buffer, but no re-check of the staged blocks and nothing
    /// queued. Launching it is the caller's `unsafe`: the contract of
    /// [`Self::write_index_keys_from`], with the staged blocks still held.
    pub fn index_keys_launch(&self, rank: usize, keys: DevicePtr, stride: usize) -> Result<Launch> {
        Ok(Launch::IndexKeys(self.index_keys_args(rank, keys, stride)?))
    }

    /// Values a read of `tokens` rows of `row` values, `stride` apart, spans: `(tokens − 1) ×
    /// stride + row` (0 for none). A stride shorter than a row, or a span whose bytes pass
    /// `i64` (the kernels' stride and offset type), is [`RowWriteError::KvShape`] (`len`: the
    /// values given, 0 for device memory).
    fn kv_span(len: usize, tokens: usize, stride: usize, row: usize) -> Result<usize> {
        let shape = RowWriteError::KvShape { len, tokens, row, stride };
        if stride < row {
            return Err(shape);
        }
        let Some(rest) = tokens.checked_sub(1) else { return Ok(0) };
        rest.checked_mul(stride)
            .and_then(|v| v.checked_add(row))
            .filter(|&v| v <= (i64::MAX / 2) as usize)
            .ok_or(shape)
    }

    fn upload_kv(&self, kv: &[u16], tokens: usize, stride: usize) -> Result<()> {
        self.upload_rows(kv, tokens, stride, KV_ROW_VALUES)
    }

    /// `tokens` rows of `row` values (`stride` apart in `kv`) packed into the staging buffer
    /// (`row` ≤ 512 values apart: the buffer holds `max_tokens` rows of 512).
    fn upload_rows(&self, kv: &[u16], tokens: usize, stride: usize, row: usize) -> Result<()> {
        self.check_tokens(tokens)?;
        let need = Self::kv_span(kv.len(), tokens, stride, row)?;
        if kv.len() < need || row > KV_ROW_VALUES {
            return Err(RowWriteError::KvShape { len: kv.len(), tokens, row, stride });
        }
        let mut packed = Vec::with_capacity(tokens * row);
        for t in 0..tokens {
            packed.extend_from_slice(&kv[t * stride..t * stride + row]);
        }
        self.owned.upload(self.kv_at, bytemuck::cast_slice(&packed))?;
        Ok(())
    }

    /// Write `kv` (bf16 bits, `tokens` rows `stride` values apart, from host memory) to `set`'s
    /// staged rows of `layer`: uploaded to the writer's own buffer, then one launch.
    pub fn write(&self, layer: usize, set: RowSet, kv: &[u16], stride: usize) -> Result<()> {
        let (args, tokens) = self.args(layer, set, self.owned.base() + self.kv_at, KV_ROW_VALUES)?;
        self.upload_kv(kv, tokens, stride)?;
        // SAFETY: kv is this handle's staging buffer holding `tokens` rows of 512; the dest rows
        // its own (`tokens` entries); the planes are the layer's views, bounded by view_rows.
        unsafe { self.queue(set, &Launch::KvRows(args)) }
    }

    /// As [`Self::write`], reading the KV from device memory.
    ///
    /// # Safety
    /// `kv .. + ((tokens − 1) × stride + 512) × 2` bytes (tokens = the staged rows) is live
    /// memory of the pool's backend holding bf16 values, 2-B aligned, ready on the pool's
    /// stream, overlapping neither the pool's planes nor this handle's buffers.
    pub unsafe fn write_from(&self, layer: usize, set: RowSet, kv: DevicePtr, stride: usize) -> Result<()> {
        let launch = self.write_launch(layer, set, kv, stride)?;
        // SAFETY: kv covered by the caller; the rest as in `write`.
        unsafe { self.queue(set, &launch) }
    }

    /// The launch [`Self::write_from`] queues, for graph capture and
    /// [`crate::pool::WriteBatch`]: the same checks, but no re-check of the staged leases or
    /// blocks and nothing queued. Launching it is the caller's `unsafe`: the contract of
    /// [`Self::write_from`], with what was staged still held where it was staged.
    pub fn write_launch(&self, layer: usize, set: RowSet, kv: DevicePtr, stride: usize) -> Result<Launch> {
        if stride < KV_ROW_VALUES {
            return Err(RowWriteError::KvShape { len: 0, tokens: 0, row: KV_ROW_VALUES, stride });
        }
        Ok(Launch::KvRows(self.args(layer, set, kv, stride)?.0))
    }

    /// The decode write's launch: the path's staged tokens to their destination rows of
    /// `layer`'s class (the decode build's output), pads skipped.
    fn decode_args(
        &self,
        path: &DecodePath,
        layer: usize,
        kv: DevicePtr,
        stride: usize,
    ) -> Result<(KvRowsArgs, usize)> {
        if !Arc::ptr_eq(path.pool(), &self.pool) {
            return Err(RowWriteError::ForeignPath);
        }
        let (class, nope, rope, view_rows, view_row0) = self.layer_target(layer)?;
        let dest = path.dest_rows(class).ok_or(RowWriteError::NoSuchRows { class, what: "destination" })?;
        let bids = path
            .buffer(crate::pool::DecodeBuffer::BatchIds)
            .ok_or(RowWriteError::NothingStaged { what: "decode batch ids".into() })?;
        let tokens = path.staged_tokens();
        Self::kv_span(0, tokens, stride, KV_ROW_VALUES)?;
        Ok((
            KvRowsArgs {
                kv,
                dest_rows: dest.ptr,
                batch_id_per_token: bids.ptr,
                nope,
                rope,
                kv_row_stride: stride as i64,
                view_rows,
                num_tokens: tokens as i32, // at most the path's max_tokens, an i32
                format: self.format,
                view_row0,
            },
            tokens,
        ))
    }

    /// Queue a decode write under the lock after checking the path's staged positions are
    /// still live slots (as its build does).
    ///
    /// # Safety
    /// As [`Self::queue`].
    unsafe fn queue_decode(&self, path: &DecodePath, launch: &Launch) -> Result<()> {
        self.pool
            .with_boundary(|b| {
                check_live(path.staged_positions(), &b.live_positions())
                    .map_err(|e| RowWriteError::Decode(Box::new(e)))?;
                // SAFETY: forwarded from the caller.
                unsafe { self.owned.launch(launch) }.map_err(RowWriteError::from)
            })
            .map_err(pool_err)?
    }

    /// A decode token's own rows: `kv` (host memory, the staged tokens' rows `stride` values
    /// apart) to `layer`'s destination rows from `path`'s last build. Call per layer after
    /// the build and before the layer's attention (the token attends to itself).
    pub fn write_decode(&self, path: &DecodePath, layer: usize, kv: &[u16], stride: usize) -> Result<()> {
        let (args, tokens) = self.decode_args(path, layer, self.owned.base() + self.kv_at, KV_ROW_VALUES)?;
        self.check_tokens(tokens)?;
        self.upload_kv(kv, tokens, stride)?;
        // SAFETY: kv is this handle's staging buffer (tokens ≤ max_tokens rows); the dest rows and
        // batch ids the path's own (max_tokens entries); the planes the layer's views.
        unsafe { self.queue_decode(path, &Launch::KvRows(args)) }
    }

    /// As [`Self::write_decode`], reading the KV from device memory.
    ///
    /// # Safety
    /// As [`Self::write_from`], with tokens = the path's staged tokens.
    pub unsafe fn write_decode_from(
        &self,
        path: &DecodePath,
        layer: usize,
        kv: DevicePtr,
        stride: usize,
    ) -> Result<()> {
        let launch = self.write_decode_launch(path, layer, kv, stride)?;
        // SAFETY: kv covered by the caller; the rest as in `write_decode`.
        unsafe { self.queue_decode(path, &launch) }
    }

    /// The launch [`Self::write_decode_from`] queues, for graph capture and
    /// [`crate::pool::WriteBatch`]: the same checks, but no re-check of the path's staged
    /// positions and nothing queued. Its destination rows and batch ids are the path's
    /// buffers, which every build rewrites, so one captured launch serves every step. Launching
    /// it is the caller's `unsafe`: the contract of [`Self::write_decode_from`], after the
    /// path's build, with its staged positions still live slots.
    pub fn write_decode_launch(
        &self,
        path: &DecodePath,
        layer: usize,
        kv: DevicePtr,
        stride: usize,
    ) -> Result<Launch> {
        if stride < KV_ROW_VALUES {
            return Err(RowWriteError::KvShape { len: 0, tokens: 0, row: KV_ROW_VALUES, stride });
        }
        Ok(Launch::KvRows(self.decode_args(path, layer, kv, stride)?.0))
    }
}
