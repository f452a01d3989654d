//! The spec documents' worked numbers, as the geometry computes them.

use v4pool::geometry::{GeometrySpec, UnifiedPoolGeometry, WindowParams};
use v4pool::model::{DraftMode, ModelShape};

fn build(ratios: &[i32], blocks: i64, slots: i64, ring: i64) -> UnifiedPoolGeometry {
    GeometrySpec::new(ratios.to_vec(), blocks, slots, ring, 256).build().unwrap()
}

fn wp(ring_start: i64, slot_rows: i64, ring_slots: i64, ring_stride: i64, run_rows: i64) -> WindowParams {
    WindowParams { ring_start, slot_rows, ring_slots, ring_stride, run_rows }
}

fn base_rows(g: &UnifiedPoolGeometry) -> Vec<i64> {
    (0..g.num_layers).map(|l| g.layer_base_row(l).unwrap()).collect()
}

/// Window rows (relative to the layer view) of `slot` for absolute positions `positions`.
fn rows(
    g: &UnifiedPoolGeometry,
    layer: usize,
    slot: i64,
    positions: std::ops::RangeInclusive<i64>,
) -> Vec<i64> {
    let w = g.window_params(g.ratios[layer]).unwrap();
    positions.map(|p| w.index(slot, p)).collect()
}

/// ATOM's Flash-DSpark test list with the drafts still dense: `[0,0]+[4,128]*20+[4]+[0,0,0]`.
fn flash_dspark_dense_ratios() -> Vec<i32> {
    let mut r = vec![0, 0];
    for _ in 0..20 {
        r.extend([4, 128]);
    }
    r.extend([4, 0, 0, 0]);
    r
}

#[test]
fn flash_with_three_dense_drafts() {
    let ratios = flash_dspark_dense_ratios();
    assert_eq!(ratios, ModelShape::v4_flash_dspark(3, DraftMode::Dense).unwrap().ratios);
    let g = build(&ratios, 3, 2, 131);
    assert_eq!(g.envelope_rows, 1_384);
    assert_eq!(g.entry_rows, 7_265);
    assert_eq!(g.slot_rows, 7_266);
    assert_eq!(g.plane_rows, 21_798);
    assert_eq!((g.slot_positions, g.slot_origin), (3, 0));
    assert_eq!((g.physical_slot(0).unwrap(), g.physical_slot(1).unwrap()), (2, 1));

    // pool-runtime §6: the packed entry rows a checkpoint carries.
    let runs = g.entry_row_runs();
    assert_eq!(runs.iter().map(|r| r.1).sum::<i64>(), 6_026);
    assert_eq!(&runs[..3], &[(0, 3_256), (3_257, 1), (3_259, 1)]);
    assert!(runs.contains(&(3_293, 2_692)));
    assert!(runs.contains(&(6_046, 3)));
    assert_eq!(runs.last(), Some(&(7_262, 3)));
}

/// index-buffers.md §2, geometry A.
#[test]
fn geometry_a() {
    let g = build(&[0, 4, 128, 4, 128, 0], 4, 6, 11);
    assert_eq!((g.envelope_rows, g.entry_rows, g.slot_rows, g.plane_rows), (132, 120, 120, 1_320));
    assert_eq!(g.slot_positions, 11);
    assert_eq!(base_rows(&g), vec![0, 4, 0, 68, 2, 11]);

    assert_eq!(g.window_params(0).unwrap(), wp(0, 120, 11, 11, 22));
    assert_eq!(g.window_params(4).unwrap(), wp(41, 120, 11, 64, 128));
    assert_eq!(g.window_params(128).unwrap(), wp(22, 120, 11, 2, 4));

    // Rows of slot 3, q = 0..10, for every layer of each class.
    for layer in [0, 5] {
        assert_eq!(rows(&g, layer, 3, 0..=10), (360..=370).collect::<Vec<_>>());
    }
    for layer in [1, 3] {
        assert_eq!(rows(&g, layer, 3, 0..=10), (401..=411).collect::<Vec<_>>());
    }
    for layer in [2, 4] {
        assert_eq!(rows(&g, layer, 3, 0..=10), vec![382, 383, 386, 387, 390, 391, 394, 395, 398, 399, 402]);
        let q: Vec<i64> = (0..11).map(|q| g.window_index(layer, 3, q).unwrap()).collect();
        assert_eq!(q, rows(&g, layer, 3, 0..=10));
    }
    // CSA layer 3: view row 401 = plane row 469, inside slot 3's span [360, 480).
    assert_eq!(g.absolute_row(3, 401).unwrap(), 469);
    assert_eq!(g.slot_span(3).unwrap(), (360, 480));

    // §3 decode example: token 1 (pos 20, slot 0), token 2 (pos 13, slot 4, wraps), win 8.
    assert_eq!(rows(&g, 0, 0, 13..=20), (2..=9).collect::<Vec<_>>());
    assert_eq!(rows(&g, 1, 0, 13..=20), (43..=50).collect::<Vec<_>>());
    assert_eq!(rows(&g, 2, 0, 13..=20), vec![26, 27, 30, 31, 34, 35, 38, 39]);
    assert_eq!(rows(&g, 0, 4, 6..=13), vec![486, 487, 488, 489, 490, 480, 481, 482]);
    assert_eq!(rows(&g, 1, 4, 6..=13), vec![527, 528, 529, 530, 531, 521, 522, 523]);
    assert_eq!(rows(&g, 2, 4, 6..=13), vec![514, 515, 518, 519, 522, 502, 503, 506]);
    // §7 ring write: CSA layer 3, view rows 1,252.
    assert_eq!(g.layer_view_rows(3).unwrap(), 1_252);

    // The same batch without dense layers ([4,128,4,128]): CSA window rows.
    let nd = build(&[4, 128, 4, 128], 4, 6, 11);
    assert!(nd.class(0).is_none());
    assert_eq!(rows(&nd, 0, 3, 0..=5), (313..=318).collect::<Vec<_>>());
    assert_eq!(rows(&nd, 0, 0, 13..=20), (21..=28).collect::<Vec<_>>());
    assert_eq!(rows(&nd, 0, 4, 6..=13), vec![417, 418, 419, 420, 421, 411, 412, 413]);
}

/// index-buffers.md §6, geometry B.
#[test]
fn geometry_b() {
    let g = build(&[0, 4, 128, 4, 128], 40, 4, 11);
    assert_eq!((g.envelope_rows, g.slot_rows), (132, 110));
    assert_eq!(g.window_params(0).unwrap(), wp(0, 110, 11, 11, 11));
    assert_eq!(g.window_params(4).unwrap(), wp(30, 110, 11, 64, 128));
    assert_eq!(g.window_params(128).unwrap(), wp(11, 110, 11, 2, 4));
    // Seq 1 (slot 0) resumed at 14, window 8: prefix positions 7..13.
    assert_eq!(rows(&g, 0, 0, 7..=13), vec![7, 8, 9, 10, 0, 1, 2]);
    assert_eq!(rows(&g, 1, 0, 7..=13), vec![37, 38, 39, 40, 30, 31, 32]);
    assert_eq!(rows(&g, 2, 0, 7..=13), vec![24, 27, 28, 31, 11, 12, 15]);
    // Compressed HCA entry 0 of block 21; CSA top-k rows 2 of block 21, 65 of block 5.
    assert_eq!(g.compress_index(2, 21, 0).unwrap(), 2_772);
    assert_eq!(g.compress_index(4, 21, 1).unwrap(), 2_773);
    assert_eq!(g.compress_index(1, 21, 2).unwrap(), 2_774);
    assert_eq!(g.compress_index(3, 5, 1).unwrap(), 661);
}

/// pool-runtime.md §2.5: entry rows (and slot rows at the arena rows and alignment the
/// table gives) for each config.
#[test]
fn pool_runtime_entry_rows() {
    // (model, arena_rows, bytes per row over the planes, entry_rows, slot_rows, slot bytes)
    let cases = [
        (ModelShape::v4_flash(0).unwrap(), 20_480, 640u64, 5_632, 26_112, 16_711_680u64),
        (ModelShape::v4_flash(1).unwrap(), 20_640, 640, 6_955, 27_596, 17_661_440),
        (ModelShape::v4_flash(3).unwrap(), 20_960, 640, 7_003, 27_964, 17_896_960),
        (ModelShape::v4_flash(0).unwrap(), 11_920, 1_024, 5_632, 17_552, 17_973_248),
        (ModelShape::v4_pro(1).unwrap(), 31_992, 640, 9_855, 41_848, 26_782_720),
        (
            ModelShape::v4_flash_dspark(5, DraftMode::Absent).unwrap(),
            13_769,
            1_024,
            6_918,
            20_688,
            21_184_512,
        ),
    ];
    for (model, arena, row_bytes, entry, slot, slot_bytes) in cases {
        let g = model.geometry_spec(0, 0).arena_rows(arena).build().unwrap();
        assert_eq!(g.entry_rows, entry, "{}", model.name);
        assert_eq!(g.slot_rows, slot, "{}", model.name);
        assert_eq!(g.slot_bytes(row_bytes), slot_bytes, "{}", model.name);
    }
    let flash = ModelShape::v4_flash(0).unwrap().geometry_spec(0, 0).build().unwrap();
    assert_eq!(flash.envelope_rows, 1_384);
    assert_eq!(flash.block_bytes(640), 885_760);
    assert_eq!(flash.block_bytes(1_024), 1_417_216);
    let pro = ModelShape::v4_pro(1).unwrap().geometry_spec(0, 0).build().unwrap();
    assert_eq!(pro.envelope_rows, 1_982);
}

/// pool-runtime.md §6 (entry row runs) and §7 (transfer regions).
#[test]
fn pool_runtime_small_example() {
    let g = GeometrySpec::new(vec![4, 128, 4, 0], 3, 2, 7, 256).arena_rows(10).build().unwrap();
    assert_eq!((g.envelope_rows, g.entry_rows, g.slot_rows, g.plane_rows), (130, 85, 96, 672));
    assert_eq!(g.slot_positions, 7);
    let positions: Vec<i64> = (0..2).map(|grp| g.physical_slot(grp).unwrap()).collect();
    assert_eq!(positions, vec![6, 5]);
    // Slot region base: the slot start of physical_slot(num_slots - 1), row 480 (7,680 B at 16 B).
    let base = g.slot_span(g.physical_slot(1).unwrap()).unwrap().0;
    assert_eq!(base, 480);
    assert_eq!(base as u64 * 16, 7_680);
    assert_eq!(g.slot_span(6).unwrap().0 as u64 * 16, 9_216);
    assert_eq!(g.slot_bytes(16), 1_536);
    assert_eq!(g.block_bytes(16), 2_080);
    assert_eq!(g.plane_bytes(16), 10_752);
    assert_eq!(g.arena_span(6).unwrap(), (576, 586));

    // §6: runs in entry coordinates; with arena 10 and a 32-B plane the window byte ranges.
    let runs = g.entry_row_runs();
    assert_eq!(runs, vec![(0, 21), (78, 7)]);
    let bytes: Vec<(i64, i64)> = runs.iter().map(|&(s, c)| ((10 + s) * 32, c * 32)).collect();
    assert_eq!(bytes, vec![(320, 672), (2_816, 224)]);
}
