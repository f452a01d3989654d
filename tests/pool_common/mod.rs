//! Shared by the host pool tests: a small pool with a three-field arena in two planes (or
//! one), and a deterministic byte pattern.
#![allow(dead_code)]

use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::pool::{Pool, PoolSpec};
use v4pool::raw::arena::{ArenaLayout, Dtype, Fill, StateField};
use v4pool::sizing::IndexerDtype;
use v4pool::GeometrySpec;

/// Row bytes of the small pool's two planes.
pub const WIDTHS: [u64; 2] = [64, 32];
/// The small pool's ratios: dense, CSA, HCA, CSA, HCA, dense.
pub const RATIOS: [i32; 6] = [0, 4, 128, 4, 128, 0];

fn field(name: &str, rows: u64, fill: Fill, carried: bool) -> StateField {
    StateField {
        name: name.into(),
        layers: 2,
        shape: vec![rows, 8],
        dtype: Dtype::F32,
        fill,
        carried,
        align: 256,
    }
}

/// The spec of a small pool: `ratios`, ring 11, a 3-field arena in `widths`, `positions` slot
/// positions' worth of plane rows, `initial_slots` of them slots and the rest blocks.
pub fn small_spec(
    ratios: &[i32],
    widths: &[u64],
    indexer: IndexerDtype,
    positions: i64,
    initial_slots: i64,
) -> PoolSpec {
    small_spec_with(ratios, widths, indexer, positions, 11, initial_slots, None, None)
}

/// The small pool's 3-field arena (`csa_kv`, `csa_score`, `hca_kv`).
pub fn small_fields() -> Vec<StateField> {
    vec![
        field("csa_kv", 10, Fill::Zero, true),
        field("csa_score", 10, Fill::NegInf, true),
        field("hca_kv", 24, Fill::Zero, false),
    ]
}

/// As [`small_spec`] with ring size `ring` (another ring is another checkpoint layout),
/// `blocks` blocks (`None`: every row the slots leave) and the arena's `fields` (`None`:
/// [`small_fields`]).
#[allow(clippy::too_many_arguments)]
pub fn small_spec_with(
    ratios: &[i32],
    widths: &[u64],
    indexer: IndexerDtype,
    positions: i64,
    ring: i64,
    initial_slots: i64,
    blocks: Option<i64>,
    fields: Option<Vec<StateField>>,
) -> PoolSpec {
    let fields = fields.unwrap_or_else(small_fields);
    let arena = ArenaLayout::new(fields, widths).expect("arena");
    let probe = GeometrySpec::new(ratios.to_vec(), 0, 0, ring, 256)
        .arena_rows(arena.arena_rows())
        .slot_align_rows(arena.slot_align_rows())
        .build()
        .expect("geometry");
    let plane_rows = positions * probe.slot_rows;
    let blocks = blocks.unwrap_or((positions - initial_slots) * probe.slot_rows / probe.envelope_rows);
    let geometry = probe.with_capacity(blocks, initial_slots, Some(plane_rows)).expect("carve");
    let csa = (0..ratios.len()).filter(|&l| ratios[l] == 4).collect();
    PoolSpec::new(geometry, widths.to_vec(), arena, Some(indexer), csa).expect("spec")
}

/// A small pool of `positions` slot positions, `initial_slots` of them slots, on `backend`.
pub fn small_pool_on(backend: Arc<dyn Backend>, positions: i64, initial_slots: i64) -> Pool {
    let spec = small_spec(&RATIOS, &WIDTHS, IndexerDtype::Fp8, positions, initial_slots);
    Pool::new(backend, spec, Stream::DEFAULT).expect("pool")
}

/// [`small_pool_on`] the host backend.
pub fn small_pool(positions: i64, initial_slots: i64) -> Pool {
    small_pool_on(Arc::new(HostBackend::new()), positions, initial_slots)
}

/// The bytes of `ranges` (plane, offset, length) of `pool`'s planes, concatenated.
pub fn read(pool: &Pool, ranges: &[(usize, u64, u64)]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(p, off, len) in ranges {
        let mut buf = vec![0u8; len as usize];
        pool.read_plane(p, off, &mut buf).expect("read");
        out.extend(buf);
    }
    out
}

/// Random bytes for a seed, from the tests' generator ([`v4pool::sim::Rng`], which
/// `tests/common` wraps; reached directly, as this module is loaded without `common`). Equal
/// seeds give equal bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    v4pool::sim::Rng::new(seed).bytes(len)
}
