//! Checkpoint store and restore plans executed on host byte buffers: random slot contents,
//! poisoned destinations, and every byte outside the plan verified untouched.

use v4pool::checkpoint::{CheckpointLayout, Region, RegionCopy};
use v4pool::geometry::{GeometrySpec, UnifiedPoolGeometry};
use v4pool::model::{DraftMode, ModelShape};
use v4pool::raw::arena::{ArenaLayout, Dtype, Fill, StateField};
use v4pool::sim::Rng;
use v4pool::sizing::{IndexerDtype, KvDtype, PoolLayout};

const POISON: u8 = 0xA5;

struct Memory {
    planes: Vec<Vec<u8>>,
    indexer: Vec<Vec<u8>>,
}

impl Memory {
    fn region(&mut self, r: Region) -> &mut Vec<u8> {
        match r {
            Region::Plane(p) => &mut self.planes[p],
            Region::Indexer(i) => &mut self.indexer[i],
        }
    }
    fn apply(&mut self, plan: &[RegionCopy]) {
        for run in plan {
            let (s, n) = (run.src.offset as usize, run.bytes as usize);
            let bytes = self.region(run.src.region)[s..s + n].to_vec();
            let d = run.dst.offset as usize;
            self.region(run.dst.region)[d..d + n].copy_from_slice(&bytes);
        }
    }
}

/// Bytes of each region a plan writes, as a mask.
fn written(mem: &Memory, plan: &[RegionCopy]) -> (Vec<Vec<bool>>, Vec<Vec<bool>>) {
    let mut planes: Vec<Vec<bool>> = mem.planes.iter().map(|p| vec![false; p.len()]).collect();
    let mut indexer: Vec<Vec<bool>> = mem.indexer.iter().map(|p| vec![false; p.len()]).collect();
    for run in plan {
        let mask = match run.dst.region {
            Region::Plane(p) => &mut planes[p],
            Region::Indexer(i) => &mut indexer[i],
        };
        for b in &mut mask[run.dst.offset as usize..(run.dst.offset + run.bytes) as usize] {
            assert!(!*b, "two copies write one byte");
            *b = true;
        }
    }
    (planes, indexer)
}

/// Store slot `src_group` into `units`, restore into `dst_group`, and check both directions.
#[allow(clippy::too_many_arguments)]
fn round_trip(
    ck: &CheckpointLayout,
    g: &UnifiedPoolGeometry,
    indexer_parts: &[u64],
    n_csa: u64,
    indexer_blocks: i64,
    units: &[i64],
    src_group: i64,
    dst_group: i64,
    rng: &mut Rng,
) {
    let plane_len: Vec<usize> = ck.widths.iter().map(|&w| (g.plane_rows as u64 * w) as usize).collect();
    let idx_len: Vec<usize> =
        indexer_parts.iter().map(|&b| (n_csa * indexer_blocks as u64 * b) as usize).collect();
    // The whole pool random (the source slot included); the destination is what gets poisoned.
    let mut mem = Memory {
        planes: plane_len.iter().map(|&n| rng.bytes(n)).collect(),
        indexer: idx_len.iter().map(|&n| rng.bytes(n)).collect(),
    };
    let src = g.physical_slot(src_group).unwrap();
    let store = ck.store_plan(g, src, units, indexer_blocks).unwrap();
    let (pmask, imask) = written(&mem, &store);
    for (buf, mask) in mem.planes.iter_mut().zip(&pmask).chain(mem.indexer.iter_mut().zip(&imask)) {
        for (b, &m) in buf.iter_mut().zip(mask) {
            if m {
                *b = POISON;
            }
        }
    }
    let before = (mem.planes.clone(), mem.indexer.clone());
    mem.apply(&store);
    // Every image byte arrived, in image order across the units' streams.
    let total: u64 = store.iter().map(|r| r.bytes).sum();
    assert_eq!(total, ck.image_bytes);
    let slot_row = g.slot_span(src).unwrap().0 as u64;
    let mut image = Vec::new();
    for (p, off, n) in ck.image_segments() {
        let base = (slot_row * ck.widths[p] + off) as usize;
        image.extend_from_slice(&mem.planes[p][base..base + n as usize]);
    }
    let mut stored = Vec::new();
    for r in &store {
        let d = r.dst.offset as usize;
        stored.extend_from_slice(&mem.region(r.dst.region)[d..d + r.bytes as usize]);
    }
    assert_eq!(stored, image);
    // Nothing else changed.
    for (p, mask) in pmask.iter().enumerate() {
        for (i, &m) in mask.iter().enumerate() {
            if !m {
                assert_eq!(mem.planes[p][i], before.0[p][i], "plane {p} byte {i} touched");
            }
        }
    }
    for (q, mask) in imask.iter().enumerate() {
        for (i, &m) in mask.iter().enumerate() {
            if !m {
                assert_eq!(mem.indexer[q][i], before.1[q][i], "indexer {q} byte {i} touched");
            }
        }
    }

    // Restore into a poisoned destination slot: the image ranges come back, the rest of the
    // slot keeps its poison.
    let dst = g.physical_slot(dst_group).unwrap();
    let dst_row = g.slot_span(dst).unwrap().0 as u64;
    for (p, &w) in ck.widths.iter().enumerate() {
        let (a, b) = ((dst_row * w) as usize, ((dst_row + g.slot_rows as u64) * w) as usize);
        mem.planes[p][a..b].fill(POISON);
    }
    let restore = ck.restore_plan(g, dst, units, indexer_blocks).unwrap();
    mem.apply(&restore);
    for (p, &w) in ck.widths.iter().enumerate() {
        let mut inside = vec![false; (g.slot_rows as u64 * w) as usize];
        for &(off, n) in &ck.plane_ranges[p] {
            inside[off as usize..(off + n) as usize].fill(true);
        }
        let (sb, db) = ((slot_row * w) as usize, (dst_row * w) as usize);
        for (i, &m) in inside.iter().enumerate() {
            if m {
                assert_eq!(
                    mem.planes[p][db + i],
                    mem.planes[p][sb + i],
                    "plane {p} slot byte {i} not restored"
                );
            } else {
                assert_eq!(
                    mem.planes[p][db + i],
                    POISON,
                    "plane {p} slot byte {i} outside the image written"
                );
            }
        }
    }
}

#[test]
fn toy_two_plane_pool_round_trips() {
    let mut rng = Rng::new(0xc4ec_0001);
    // The §7 toy shape: widths 16 and 8, with a carried and a non-carried state field.
    let f = |name: &str, bytes: u64, carried: bool| StateField {
        name: name.into(),
        layers: 1,
        shape: vec![bytes / 4],
        dtype: Dtype::F32,
        fill: Fill::Zero,
        carried,
        align: 256,
    };
    let arena =
        ArenaLayout::new(vec![f("a", 200, true), f("b", 100, false), f("c", 40, true)], &[16, 8]).unwrap();
    let g = GeometrySpec::new(vec![4, 128, 4, 0], 9, 3, 7, 256)
        .arena_rows(arena.arena_rows())
        .slot_align_rows(arena.slot_align_rows())
        .build()
        .unwrap();
    for idx in [IndexerDtype::Fp8, IndexerDtype::Fp4] {
        let ck = CheckpointLayout::new(&arena, &g, &[0, 2], idx).unwrap();
        let units: Vec<i64> = [5, 0, 8, 2, 7, 1, 3, 6, 4][..ck.units_per_checkpoint as usize].to_vec();
        round_trip(&ck, &g, idx.pool_block_bytes(), 2, 11, &units, 0, 2, &mut rng);
    }
}

#[test]
fn real_pools_round_trip() {
    let mut rng = Rng::new(0xc4ec_0002);
    let cases = [
        (ModelShape::v4_flash(1).unwrap(), KvDtype::Fp8, IndexerDtype::Fp8),
        (ModelShape::v4_flash_dspark(3, DraftMode::Absent).unwrap(), KvDtype::Fp8, IndexerDtype::Fp4),
        (ModelShape::v4_flash_dspark(5, DraftMode::Absent).unwrap(), KvDtype::Bf16, IndexerDtype::Fp8),
    ];
    for (model, kv, idx) in cases {
        let l = PoolLayout::new(&model, kv, idx).unwrap();
        let ck = CheckpointLayout::for_pool(&l).unwrap();
        let units_needed = ck.units_per_checkpoint as i64;
        // Enough blocks for the units plus a couple of slots: tens of MB of host memory.
        let blocks = units_needed + 3;
        let s = l.geometry.slot_rows;
        let positions = 2 + (blocks * l.geometry.envelope_rows + s - 1) / s;
        let g = l.carve(blocks, 2, positions * s).unwrap();
        let units: Vec<i64> = (0..units_needed).rev().map(|u| u + 2).collect();
        round_trip(&ck, &g, idx.pool_block_bytes(), l.n_csa(), blocks + 1, &units, 1, 0, &mut rng);
    }
}
