//! The generalised row space and V4.1-Flash's compact form: the worked numbers of
//! `docs/v41.md` (the spec's worked numbers: the generalised row space, the small example,
//! the compact form), and properties over V4.1 shapes
//! (block 16 and 256, ring 128 and 133): no two rows collide, every compressed read of a
//! reader lands on its owner's row, moving the boundary keeps every address.

use proptest::prelude::*;
use std::collections::HashMap;
use v4pool::geometry::{
    entry_order, envelope_order, GeometryError, GeometrySpec, RowForm, UnifiedPoolGeometry,
};

fn v41_ratios(drafts: usize) -> Vec<i32> {
    let mut r = vec![0, 0];
    r.extend([2; 18]);
    r.extend([1; 20]);
    r.extend(std::iter::repeat_n(0, drafts));
    r
}
const KV_SOURCES: [usize; 4] = [2, 8, 14, 20];

/// Absolute plane row of a layer's window position (slot position, ring position).
fn window_row(g: &UnifiedPoolGeometry, layer: usize, slot: i64, q: i64) -> i64 {
    g.absolute_row(layer, g.window_index(layer, slot, q).unwrap()).unwrap()
}

/// Absolute plane row a layer's compressed read of (block, row) reaches.
fn compressed_row(g: &UnifiedPoolGeometry, layer: usize, block: i64, row: i64) -> i64 {
    g.absolute_row(layer, g.compress_index(layer, block, row).unwrap()).unwrap()
}

#[test]
fn class_order_is_a_function_of_the_ratios() {
    assert_eq!(envelope_order(&v41_ratios(0)), vec![2, 1]);
    assert_eq!(entry_order(&v41_ratios(0)), vec![0, 2, 1]);
    let mut flash = vec![0, 0];
    for _ in 0..20 {
        flash.extend([4, 128]);
    }
    assert_eq!(envelope_order(&flash), v4pool::geometry::ENVELOPE_ORDER.to_vec());
    assert_eq!(entry_order(&flash), v4pool::geometry::ENTRY_ORDER.to_vec());
    assert_eq!(entry_order(&[128, 4]), vec![128, 4]);
    assert_eq!(entry_order(&[1, 256, 0, 16, 2]), vec![0, 256, 16, 2, 1]);
}

#[test]
fn ratios_must_divide_the_block_and_negatives_are_refused() {
    let b = |r: Vec<i32>, bs: i64| GeometrySpec::new(r, 1, 1, 8, bs).build().map(|_| ());
    assert_eq!(b(vec![0, 3], 16), Err(GeometryError::BlockSizeNotDivisible { block_size: 16, ratio: 3 }));
    assert_eq!(b(vec![0, -2], 16), Err(GeometryError::UnknownRatios { ratios: vec![-2] }));
    for r in [1, 2, 8, 16] {
        assert_eq!(b(vec![0, r], 16), Ok(()), "ratio {r}");
    }
    assert_eq!(b(vec![0, 32], 16), Err(GeometryError::BlockSizeNotDivisible { block_size: 16, ratio: 32 }));
    // Compact without sources, and sources across classes, are refused.
    let compact = GeometrySpec::new(v41_ratios(0), 1, 1, 128, 256).form(RowForm::Compact).build();
    assert_eq!(compact.map(|_| ()), Err(GeometryError::CompactWithoutSources));
    let across = GeometrySpec::new(v41_ratios(0), 1, 1, 128, 256).kv_sources(vec![2, 8, 14, 19]).build();
    assert!(matches!(across, Err(GeometryError::OwnerClassDiffers { layer: 20, owner: 19, .. })));
}

/// The spec's worked numbers for the generalised (envelope) row space on V4.1's ratios, block 256, ring
/// 128, 3 blocks, 2 slots, no arena, align 2.
#[test]
fn worked_5_1_envelope_form_on_v41_ratios() {
    let g = GeometrySpec::new(v41_ratios(0), 3, 2, 128, 256).build().unwrap();
    assert_eq!(g.envelope_order, vec![2, 1]);
    let (c2, c1, d) = (g.class(2).unwrap(), g.class(1).unwrap(), g.class(0).unwrap());
    assert_eq!((c2.envelope_offset, c1.envelope_offset), (0, 2304));
    assert_eq!((d.block_rows, c2.block_rows, c1.block_rows), (0, 128, 256));
    assert_eq!(g.envelope_rows, 7424);
    assert_eq!((d.entry_rows(), c2.entry_rows(), c1.entry_rows()), (256, 2304, 4992));
    assert_eq!((g.entry_rows, g.slot_rows, g.plane_rows, g.slot_positions), (7552, 7552, 37760, 5));
    assert_eq!((g.physical_slot(0).unwrap(), g.physical_slot(1).unwrap()), (4, 3));
    assert_eq!((g.slot_span(4).unwrap(), g.slot_span(3).unwrap()), ((30208, 37760), (22656, 30208)));
    let bases: Vec<i64> =
        [0, 1, 2, 3, 8, 19, 20, 21, 39].iter().map(|&l| g.layer_base_row(l).unwrap()).collect();
    assert_eq!(bases, vec![0, 128, 0, 128, 768, 2176, 2304, 2560, 7168]);
    let p = |r: i32| {
        let w = g.window_params(r).unwrap();
        (w.ring_start, w.slot_rows, w.ring_slots, w.ring_stride, w.run_rows)
    };
    assert_eq!(p(0), (0, 7552, 128, 128, 256));
    assert_eq!(p(2), (256, 7552, 128, 128, 2304));
    assert_eq!(p(1), (256, 7552, 128, 256, 5120));
    let l20: Vec<i64> = (0..128).map(|q| window_row(&g, 20, 4, q)).collect();
    assert_eq!(l20, (32768..32896).collect::<Vec<_>>());
    let l39: Vec<i64> = (0..128).map(|q| window_row(&g, 39, 4, q)).collect();
    assert_eq!(l39, (37632..37760).collect::<Vec<_>>());
    let (compressed, window) = distinct_rows(&g);
    assert_eq!((compressed, window), (22272, 10240));
    assert_eq!(g.view_lead_rows, 0);
}

/// Every envelope row (each layer an envelope holds, every block and row) and every (layer,
/// slot, ring position) of the live split, each counted once; panics on a shared row. Returns (compressed rows, window rows).
fn distinct_rows(g: &UnifiedPoolGeometry) -> (usize, usize) {
    let mut seen: HashMap<i64, String> = HashMap::new();
    let mut put = |row: i64, what: String| {
        assert!((0..g.plane_rows).contains(&row), "{what}: row {row} outside the plane");
        if let Some(prev) = seen.insert(row, what.clone()) {
            panic!("row {row} shared by {prev} and {what}");
        }
    };
    let mut n = (0, 0);
    for cls in g.classes.values() {
        for &holder in &cls.owners {
            let at = cls.envelope_position(holder).unwrap();
            for block in 0..g.num_blocks {
                for row in 0..cls.block_rows {
                    put(
                        block * g.envelope_rows + at + row,
                        format!("holder {holder} block {block} row {row}"),
                    );
                    n.0 += 1;
                }
            }
        }
    }
    for slot in g.live_positions() {
        for layer in 0..g.num_layers {
            if g.ratios[layer] < 0 {
                continue;
            }
            for q in 0..g.ring_slots {
                put(window_row(g, layer, slot, q), format!("layer {layer} slot {slot} q {q}"));
                n.1 += 1;
            }
        }
    }
    n
}

/// The spec's small example: ratios [0,2,2,1,1], KV sources (1, 3), block 8, ring 6, 2 blocks,
/// 2 slots, envelope (reference) form.
#[test]
fn worked_5_2_small_example() {
    let g = GeometrySpec::new(vec![0, 2, 2, 1, 1], 2, 2, 6, 8).kv_sources(vec![1, 3]).build().unwrap();
    let (d, c2, c1) = (g.class(0).unwrap(), g.class(2).unwrap(), g.class(1).unwrap());
    assert_eq!((d.block_rows, c2.block_rows, c1.block_rows), (0, 4, 8));
    assert_eq!((c2.envelope_offset, c1.envelope_offset, g.envelope_rows), (0, 8, 24));
    assert_eq!((d.entry_rows(), c2.entry_rows(), c1.entry_rows()), (6, 14, 14));
    assert_eq!((d.entry_offset, c2.entry_offset, c1.entry_offset), (0, 6, 20));
    assert_eq!((g.entry_rows, g.slot_rows, g.plane_rows, g.slot_positions), (34, 34, 136, 4));
    assert_eq!((g.physical_slot(0).unwrap(), g.physical_slot(1).unwrap()), (3, 2));
    // The spec's bases are before the view lead; the lead (8 rows, from layer 4's bias −8)
    // moves every view down by the same amount.
    assert_eq!(g.view_lead_rows, 8);
    let bases: Vec<i64> = (0..5).map(|l| g.layer_base_row(l).unwrap() + g.view_lead_rows).collect();
    assert_eq!(bases, vec![0, 0, 4, 8, 16]);
    assert_eq!(g.owners, vec![None, Some(1), Some(1), Some(3), Some(3)]);
    let bias: Vec<i64> = (1..5).map(|l| g.layer_compress_bias(l).unwrap() - g.view_lead_rows).collect();
    assert_eq!(bias, vec![0, -4, 0, -8]);
    let p = |r: i32| {
        let w = g.window_params(r).unwrap();
        (w.ring_start - g.view_lead_rows, w.slot_rows, w.ring_slots, w.ring_stride, w.run_rows)
    };
    assert_eq!(p(0), (0, 34, 6, 6, 6));
    assert_eq!(p(2), (6, 34, 6, 4, 8));
    assert_eq!(p(1), (12, 34, 6, 8, 16));
    let rows = |l: usize| (0..6).map(|q| window_row(&g, l, 3, q)).collect::<Vec<_>>();
    assert_eq!(rows(0), (102..108).collect::<Vec<_>>());
    assert_eq!(rows(1), vec![108, 109, 110, 111, 116, 117]);
    assert_eq!(rows(2), vec![112, 113, 114, 115, 120, 121]);
    assert_eq!(rows(3), (122..128).collect::<Vec<_>>());
    assert_eq!(rows(4), (130..136).collect::<Vec<_>>());
    // Block 1's compressed rows, as each layer's own envelope rows (the reference form
    // keeps them, unwritten for readers): layer 1 24..27, 2 28..31, 3 32..39, 4 40..47.
    let own = |l: usize, n: i64| {
        (0..n)
            .map(|r| g.layer_base_row(l).unwrap() + g.view_lead_rows + g.envelope_rows + r)
            .collect::<Vec<_>>()
    };
    assert_eq!(own(1, 4), (24..28).collect::<Vec<_>>());
    assert_eq!(own(2, 4), (28..32).collect::<Vec<_>>());
    assert_eq!(own(3, 8), (32..40).collect::<Vec<_>>());
    assert_eq!(own(4, 8), (40..48).collect::<Vec<_>>());
    // Layer 2 reading block 0 through its owner: spec indices −4..−1 reach rows 0..3
    // (layer 1's); layer 4: −8..−1 reach 8..15. With the lead the indices are those + 8.
    let read = |l: usize, n: i64| (0..n).map(|r| g.compress_index(l, 0, r).unwrap()).collect::<Vec<_>>();
    assert_eq!(read(2, 4), (-4 + 8..8).collect::<Vec<_>>());
    assert_eq!(read(4, 8), (0..8).collect::<Vec<_>>());
    let abs = |l: usize, n: i64| (0..n).map(|r| compressed_row(&g, l, 0, r)).collect::<Vec<_>>();
    assert_eq!(abs(2, 4), (0..4).collect::<Vec<_>>());
    assert_eq!(abs(4, 8), (8..16).collect::<Vec<_>>());
    // 108 distinct addresses: every layer's envelope rows (24 × 2 blocks) + 5 × 6 × 2 windows.
    let mut all = std::collections::HashSet::new();
    for l in 1..5 {
        for b in 0..2 {
            for r in 0..g.layer_class(l).unwrap().block_rows {
                assert!(all.insert(g.layer_base_row(l).unwrap() + g.view_lead_rows + b * 24 + r));
            }
        }
    }
    for s in g.live_positions() {
        for l in 0..5 {
            for q in 0..6 {
                assert!(all.insert(window_row(&g, l, s, q)));
            }
        }
    }
    assert_eq!(all.len(), 108);
}

fn compact(block: i64, ring: i64, drafts: usize, blocks: i64, slots: i64, arena: i64) -> UnifiedPoolGeometry {
    GeometrySpec::new(v41_ratios(drafts), blocks, slots, ring, block)
        .kv_sources(KV_SOURCES.to_vec())
        .form(RowForm::Compact)
        .arena_rows(arena)
        .build()
        .unwrap()
}

/// The spec's proposal, the compact form: owners-only envelopes, one contiguous ring per layer.
#[test]
fn worked_compact_form() {
    let g = compact(256, 128, 0, 3, 2, 33);
    assert_eq!(g.envelope_rows, 640);
    let pos: Vec<i64> =
        KV_SOURCES.iter().map(|&o| g.layer_class(o).unwrap().envelope_position(o).unwrap()).collect();
    assert_eq!(pos, vec![0, 128, 256, 384]);
    assert_eq!((g.entry_rows, g.slot_rows), (5120, 5154));
    assert_eq!(g.slot_bytes(1024), 5_277_696);
    let spec_bias = |l: usize| g.layer_compress_bias(l).unwrap() - g.view_lead_rows;
    let got: Vec<i64> = [2, 3, 8, 19, 20, 21, 39].iter().map(|&l| spec_bias(l)).collect();
    assert_eq!(got, vec![0, -128, -640, -1920, 384, 256, -2048]);
    assert_eq!(g.view_lead_rows, 2048);
    // Every stored index is non-negative: the lead absorbs the lowest relative index.
    assert!((0..40).filter(|&l| l >= 2).all(|l| g.compress_index(l, 0, 0).unwrap() >= 0));
    distinct_rows(&g);
    // Block 16: owners at 0, 8, 16, 24 of a 40-row envelope; lowest relative index −2,408.
    let g16 = compact(16, 128, 0, 2, 2, 33);
    assert_eq!(g16.envelope_rows, 40);
    let pos: Vec<i64> =
        KV_SOURCES.iter().map(|&o| g16.layer_class(o).unwrap().envelope_position(o).unwrap()).collect();
    assert_eq!(pos, vec![0, 8, 16, 24]);
    assert_eq!(g16.view_lead_rows, 2408);
    // With drafts at ring 133: entry 43 × 133 = 5,719.
    let gd = compact(256, 133, 3, 2, 2, 0);
    assert_eq!(gd.entry_rows, 5719);
}

/// The generalised row space's block-16 line: envelope 464 rows; entry 5,120; with drafts and ring 133, 665 +
/// 2,445 + 2,869 = 5,979.
#[test]
fn worked_5_1_block_16() {
    let g = GeometrySpec::new(v41_ratios(0), 1, 1, 128, 16).build().unwrap();
    assert_eq!((g.envelope_rows, g.entry_rows), (464, 5120));
    let g = GeometrySpec::new(v41_ratios(3), 1, 1, 133, 16).build().unwrap();
    let e: Vec<i64> = [0, 2, 1].iter().map(|&r| g.class(r).unwrap().entry_rows()).collect();
    assert_eq!(e, vec![665, 2445, 2869]);
    assert_eq!(g.entry_rows, 5979);
}

/// Every compressed read of every layer (block, row) lands on its owner's row, and the
/// owner's own read of it is that row.
fn reads_land_on_owners(g: &UnifiedPoolGeometry) {
    for l in 0..g.num_layers {
        let Ok(owner) = g.owner(l) else { continue };
        let rows = g.layer_class(l).unwrap().block_rows;
        for b in 0..g.num_blocks {
            for r in 0..rows {
                let got = compressed_row(g, l, b, r);
                assert_eq!(got, compressed_row(g, owner, b, r), "layer {l} block {b} row {r}");
                let idx = g.compress_index(l, b, r).unwrap();
                assert!(idx >= 0 && idx < g.layer_view_rows(l).unwrap(), "layer {l}: index {idx}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// V4.1 shapes, both forms: no two rows collide, reads land on owners, and every
    /// address is the same at another split of the same plane.
    #[test]
    fn v41_shapes_hold_their_invariants(
        block in prop_oneof![Just(16i64), Just(256i64)],
        ring in prop_oneof![Just(128i64), Just(133i64)],
        drafts in prop_oneof![Just(0usize), Just(3usize)],
        compact_form in any::<bool>(),
        arena in 0i64..40,
        blocks in 1i64..4,
        slots in 1i64..3,
        move_to in 0i64..8,
    ) {
        let spec = GeometrySpec::new(v41_ratios(drafts), blocks, slots, ring, block)
            .kv_sources(KV_SOURCES.to_vec())
            .form(if compact_form { RowForm::Compact } else { RowForm::Envelope })
            .arena_rows(arena);
        let tight = spec.clone().build().unwrap();
        // A plane with room for the boundary to move.
        let plane = tight.plane_rows + 3 * tight.slot_rows;
        let g = spec.plane_rows(plane).build().unwrap();
        distinct_rows(&g);
        reads_land_on_owners(&g);
        // Another split of the same plane: every address that both splits hold is equal.
        let moved_slots = (slots + move_to % 3).min(g.plane_rows / g.slot_rows);
        let moved_blocks = (g.plane_rows / g.slot_rows - moved_slots) * g.slot_rows / g.envelope_rows;
        let m = g.with_capacity(moved_blocks.min(blocks + move_to), moved_slots, Some(plane)).unwrap();
        prop_assert_eq!(m.view_lead_rows, g.view_lead_rows);
        prop_assert_eq!(&m.compress_bias, &g.compress_bias);
        for l in 0..g.num_layers {
            prop_assert_eq!(m.layer_base_row(l).unwrap(), g.layer_base_row(l).unwrap());
        }
        for r in g.entry_order.clone() {
            prop_assert_eq!(m.window_params(r).unwrap(), g.window_params(r).unwrap());
        }
        for b in 0..blocks.min(m.num_blocks) {
            for l in 2..40 {
                prop_assert_eq!(m.compress_index(l, b, 0).unwrap(), g.compress_index(l, b, 0).unwrap());
            }
        }
        for s in m.live_positions().filter(|s| g.live_positions().contains(s)) {
            for l in 0..g.num_layers {
                prop_assert_eq!(window_row(&m, l, s, ring - 1), window_row(&g, l, s, ring - 1));
            }
        }
    }
}
