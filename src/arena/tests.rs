//! Unit tests of the arena layout (moved out of `arena.rs` to keep it under 1,000 lines).

use super::*;
use crate::geometry::GeometrySpec;
use crate::model::{DraftMode, ModelShape};
use crate::variant::VariantName;

const FP8: [u64; 2] = [512, 128];
const BF16: [u64; 1] = [1024];

struct Row {
    model: ModelShape,
    widths: &'static [u64],
    state_bytes: u64,
    plane_rows: &'static [u64],
    arena_rows: i64,
    entry_rows: i64,
    slot_rows: i64,
    slot_bytes: u64,
}

fn check(row: Row) {
    let a = ArenaLayout::for_model(&row.model, row.widths).unwrap();
    assert_eq!(a.state_bytes().unwrap(), row.state_bytes, "{}", row.model.name);
    let rows: Vec<u64> = a.planes().iter().map(|p| p.entry_bytes.div_ceil(p.width)).collect();
    assert_eq!(rows, row.plane_rows, "{}", row.model.name);
    assert_eq!(a.arena_rows(), row.arena_rows);
    let g = GeometrySpec::new(row.model.ratios.clone(), 0, 0, row.model.ring_slots(), 256)
        .arena_rows(a.arena_rows())
        .slot_align_rows(a.slot_align_rows())
        .build()
        .unwrap();
    assert_eq!(g.entry_rows, row.entry_rows);
    assert_eq!(g.slot_rows, row.slot_rows);
    let slot_bytes: u64 = row.widths.iter().map(|&w| g.slot_bytes(w)).sum();
    assert_eq!(slot_bytes, row.slot_bytes);
}

#[test]
fn section_2_5_table() {
    check(Row {
        model: ModelShape::v4_flash(0).unwrap(),
        widths: &FP8,
        state_bytes: 12_206_080,
        plane_rows: &[20_480, 13_440],
        arena_rows: 20_480,
        entry_rows: 5_632,
        slot_rows: 26_112,
        slot_bytes: 16_711_680,
    });
    check(Row {
        model: ModelShape::v4_flash(1).unwrap(),
        widths: &FP8,
        state_bytes: 12_503_040,
        plane_rows: &[20_640, 15_120],
        arena_rows: 20_640,
        entry_rows: 6_955,
        slot_rows: 27_596,
        slot_bytes: 17_661_440,
    });
    check(Row {
        model: ModelShape::v4_flash(3).unwrap(),
        widths: &FP8,
        state_bytes: 13_096_960,
        plane_rows: &[20_960, 18_480],
        arena_rows: 20_960,
        entry_rows: 7_003,
        slot_rows: 27_964,
        slot_bytes: 17_896_960,
    });
    check(Row {
        model: ModelShape::v4_flash(0).unwrap(),
        widths: &BF16,
        state_bytes: 12_206_080,
        plane_rows: &[11_920],
        arena_rows: 11_920,
        entry_rows: 5_632,
        slot_rows: 17_552,
        slot_bytes: 17_973_248,
    });
    check(Row {
        model: ModelShape::v4_pro(1).unwrap(),
        widths: &FP8,
        state_bytes: 19_144_704,
        plane_rows: &[31_992, 21_600],
        arena_rows: 31_992,
        entry_rows: 9_855,
        slot_rows: 41_848,
        slot_bytes: 26_782_720,
    });
    check(Row {
        model: ModelShape::v4_flash_dspark(5, DraftMode::Absent).unwrap(),
        widths: &BF16,
        state_bytes: 14_099_456,
        plane_rows: &[13_769],
        arena_rows: 13_769,
        entry_rows: 6_918,
        slot_rows: 20_688,
        slot_bytes: 21_184_512,
    });
}

#[test]
fn section_2_5_plane_bytes_and_field_sizes() {
    let a = ArenaLayout::for_model(&ModelShape::v4_flash(0).unwrap(), &FP8).unwrap();
    assert_eq!(a.planes()[0].entry_bytes, 10_485_760);
    assert_eq!(a.planes()[1].entry_bytes, 1_720_320);
    let sizes: Vec<u64> = a.fields().iter().map(|f| f.bytes().unwrap()).collect();
    // Flash k=0: CSA main 2 × 688,128, CSA idx 2 × 172,032, HCA 2 × 5,242,880.
    assert_eq!(sizes, vec![688_128, 688_128, 172_032, 172_032, 5_242_880, 5_242_880]);
    let k3 = ArenaLayout::for_model(&ModelShape::v4_flash(3).unwrap(), &FP8).unwrap();
    assert_eq!(k3.planes()[0].entry_bytes, 10_731_520);
    assert_eq!(k3.planes()[1].entry_bytes, 2_365_440);
}

#[test]
fn plane_assignment_matches_section_2_3() {
    for model in [ModelShape::v4_flash(1).unwrap(), ModelShape::v4_pro(1).unwrap()] {
        let a = ArenaLayout::for_model(&model, &FP8).unwrap();
        let names = |p: usize| -> Vec<&str> {
            a.planes()[p].fields.iter().map(|pf| a.fields()[pf.field].name.as_str()).collect()
        };
        assert_eq!(names(0), ["hca_main_kv", "hca_main_score"]);
        assert_eq!(names(1), ["csa_main_kv", "csa_main_score", "csa_idx_kv", "csa_idx_score"]);
        assert_eq!(a.slot_align_rows(), 2);
    }
    let bf = ArenaLayout::for_model(&ModelShape::v4_flash(0).unwrap(), &BF16).unwrap();
    assert_eq!(bf.planes()[0].fields.len(), 6);
    // Flash-DSpark k=3 fp8: csa_idx_score joins HCA, state_window goes to the 128-B plane.
    let d =
        ArenaLayout::for_model(&ModelShape::v4_flash_dspark(3, DraftMode::Absent).unwrap(), &FP8).unwrap();
    let plane = |name: &str| d.field_place(d.field_index(name).unwrap()).unwrap().0;
    assert_eq!(plane("csa_idx_score"), 0);
    assert_eq!(plane("hca_main_kv"), 0);
    assert_eq!(plane("state_window"), 1);
    assert_eq!(d.slot_align_rows(), 8);
    let (_, off) = d.field_place(d.field_index("state_window").unwrap()).unwrap();
    assert_eq!(off % WINDOW_ROW_BYTES, 0);
}

#[test]
fn cursor_walk_checkpoint_ranges_and_regions() {
    let f = |name: &str, bytes: u64, carried: bool, align: u64| StateField {
        name: name.into(),
        layers: 1,
        shape: vec![bytes],
        dtype: Dtype::Bf16,
        fill: Fill::Zero,
        carried,
        align,
    };
    // 100 B, 10 B, 0 B, 300 B (align 1024), 5 B
    let fields = vec![
        f("a", 50, true, 256),
        f("b", 5, true, 256),
        f("z", 0, false, 256),
        f("c", 150, true, 1024),
        f("d", 3, false, 256),
    ];
    let l = entry_layout(&fields).unwrap();
    assert_eq!(l.offsets, vec![0, 256, 512, 1024, 1536]);
    assert_eq!(l.entry_bytes, 1792);
    // A zero-size non-carried field still splits the run.
    assert_eq!(checkpoint_ranges(&fields).unwrap(), vec![(0, 266), (1024, 300)]);
    assert_eq!(plan_regions(&[]).unwrap(), (vec![], 0));
    assert_eq!(plan_regions(&[10, 0, 300]).unwrap(), (vec![0, 256, 256], 768));
    assert_eq!(plan_regions(&[10_752, 5_376]).unwrap(), (vec![0, 10_752], 16_128));
}

#[test]
fn refusals_are_typed() {
    let good = state_fields(&ModelShape::v4_flash(0).unwrap()).unwrap();
    assert_eq!(assign_planes(&[], &FP8), Err(ArenaError::NoFields));
    assert_eq!(assign_planes(&good, &[]), Err(ArenaError::NoPlanes));
    assert_eq!(assign_planes(&good, &[512, 0]), Err(ArenaError::ZeroWidth { plane: 1 }));
    let mut dup = good.clone();
    dup[1].name = "csa_main_kv".into();
    assert!(matches!(assign_planes(&dup, &FP8), Err(ArenaError::DuplicateField { .. })));
    let mut bad_align = good.clone();
    bad_align[2].align = 128;
    assert!(matches!(assign_planes(&bad_align, &FP8), Err(ArenaError::FieldAlign { align: 128, .. })));
    // 5 planes ^ 7 fields = 78,125 > 65,536; 4 ^ 7 = 16,384 is fine.
    let seven = state_fields(&ModelShape::v4_flash_dspark(1, DraftMode::Absent).unwrap()).unwrap();
    assert_eq!(seven.len(), 7);
    assert_eq!(
        assign_planes(&seven, &[512, 256, 128, 64, 32]),
        Err(ArenaError::TooManyPlans { planes: 5, fields: 7 })
    );
    assert!(assign_planes(&seven, &[512, 256, 128, 64]).is_ok());
    assert_eq!(slot_align_rows(Some(2048)), Err(ArenaError::WindowPlaneWidth { width: 2048 }));
    assert_eq!(slot_align_rows(Some(96)), Err(ArenaError::WindowPlaneWidth { width: 96 }));
    assert_eq!(slot_align_rows(Some(1024)), Ok(2));
    assert_eq!(slot_align_rows(Some(64)), Ok(16));
    assert_eq!(slot_align_rows(None), Ok(2));
}

#[test]
fn offsets_views_and_strides_are_64_bit() {
    let a = ArenaLayout::for_model(&ModelShape::v4_flash(1).unwrap(), &FP8).unwrap();
    let slot_rows = 27_596;
    let hs = a.field_index("hca_main_score").unwrap();
    // Position 5,000 of a Flash plane is far past 2^32 bytes.
    let (plane, off) = a.byte_offset(5_000, hs, 19, slot_rows).unwrap();
    let per_layer = 129 * 512 * 4;
    assert_eq!(plane, 0);
    assert_eq!(off, 5_000u64 * 27_596 * 512 + 20 * per_layer + 19 * per_layer);
    assert!(off > u64::from(u32::MAX));
    let v = a.field_view(hs, slot_rows, 5_108).unwrap();
    assert_eq!(v.offset, 20 * per_layer);
    assert_eq!(v.dims, vec![20, 5_108, 129, 512]);
    assert_eq!(v.strides, vec![129 * 512, 27_596 * 512 / 4, 512, 1]);
    let ck = a.field_index("csa_idx_kv").unwrap();
    let v = a.field_view(ck, slot_rows, 3).unwrap();
    assert_eq!((v.plane, v.offset), (1, 2 * 21 * 9 * 1024 * 4));
    assert_eq!(v.strides, vec![9 * 256, 27_596 * 128 / 4, 256, 1]);
    assert!(matches!(a.byte_offset(0, hs, 20, slot_rows), Err(ArenaError::LayerOutOfRange { .. })));
    assert!(matches!(a.byte_offset(-1, hs, 0, slot_rows), Err(ArenaError::PositionOutOfRange { .. })));
    assert!(matches!(a.byte_offset(0, 9, 0, slot_rows), Err(ArenaError::FieldOutOfRange { .. })));
    assert!(matches!(a.byte_offset(0, hs, 0, 100), Err(ArenaError::SlotRowsTooSmall { .. })));
    let g = GeometrySpec::new(ModelShape::v4_flash(1).unwrap().ratios, 10, 3, 129, 256)
        .arena_rows(a.arena_rows())
        .plane_rows(6 * slot_rows)
        .build()
        .unwrap();
    assert_eq!(a.slot_base(&g, 1, 5), Ok(5 * slot_rows as u64 * 128));
    assert_eq!(a.slot_base(&g, 1, 5).unwrap(), a.byte_offset(5, 0, 0, slot_rows).unwrap().1);
    assert!(matches!(a.slot_base(&g, 1, 6), Err(ArenaError::PositionOutOfRange { .. })));
    let g0 = GeometrySpec::new(vec![4, 128, 0], 0, 1, 129, 256).arena_rows(3).build().unwrap();
    assert_eq!(a.slot_base(&g0, 0, 0), Err(ArenaError::ArenaRowsMismatch { layout: 20_640, geometry: 3 }));
}

#[test]
fn fill_runs_cover_the_arena_with_the_right_words() {
    let a = ArenaLayout::for_model(&ModelShape::v4_flash(1).unwrap(), &FP8).unwrap();
    let slot_rows = 27_596u64;
    let runs = a.fill_runs(3, slot_rows as i64).unwrap();
    // Plane 0: hca_kv zero, hca_score −inf (no tail: 20,640 rows exactly).
    let hca = 20 * 129 * 512 * 4;
    let b0 = 3 * slot_rows * 512;
    assert_eq!(runs[0], PlaneFill { plane: 0, offset: b0, bytes: hca, pattern: 0 });
    assert_eq!(runs[1], PlaneFill { plane: 0, offset: b0 + hca, bytes: hca, pattern: F32_NEG_INF });
    // Plane 1: main kv 0, main score −inf, idx kv 0, idx score −inf, no tail.
    let b1 = 3 * slot_rows * 128;
    let (m, i) = (21 * 9 * 1024 * 4, 21 * 9 * 256 * 4);
    let tail = 20_640 * 128 - 1_935_360;
    let want = [
        (b1, m, 0),
        (b1 + m, m, F32_NEG_INF),
        (b1 + 2 * m, i, 0),
        (b1 + 2 * m + i, i, F32_NEG_INF),
        (b1 + 2 * m + 2 * i, tail, 0),
    ];
    let got: Vec<(u64, u64, u32)> = runs[2..].iter().map(|r| (r.offset, r.bytes, r.pattern)).collect();
    assert_eq!(got, want);
    let total: u64 = runs.iter().map(|r| r.bytes).sum();
    assert_eq!(total, 20_640 * 640);
    // bf16 DSpark: the state window (zero) abuts the HCA score; tail padding is zeroed.
    let d =
        ArenaLayout::for_model(&ModelShape::v4_flash_dspark(5, DraftMode::Absent).unwrap(), &BF16).unwrap();
    let runs = d.fill_runs(0, 20_688).unwrap();
    let total: u64 = runs.iter().map(|r| r.bytes).sum();
    assert_eq!(total, 13_769 * 1024);
    assert_eq!(runs.last().unwrap().pattern, 0);
    assert!(runs.windows(2).all(|w| w[0].offset + w[0].bytes == w[1].offset));
}

#[test]
fn binding_preconditions() {
    let a = ArenaLayout::for_model(&ModelShape::v4_flash(1).unwrap(), &FP8).unwrap();
    let stride = 27_596 * 128;
    let ok = ArenaBinding { plane: 1, base: 1 << 20, len: 10 * stride, stride, entries: 10, live: 3 };
    assert_eq!(a.check_binding(&ok), Ok(()));
    let e = |b: ArenaBinding| a.check_binding(&b).unwrap_err().variant_name();
    assert_eq!(e(ArenaBinding { stride: 256, ..ok }), "SlotStrideTooSmall");
    assert_eq!(e(ArenaBinding { stride: stride + 128, ..ok }), "SlotStrideMisaligned");
    assert_eq!(e(ArenaBinding { live: 11, ..ok }), "LiveOutOfRange");
    assert_eq!(e(ArenaBinding { live: -1, ..ok }), "LiveOutOfRange");
    assert_eq!(e(ArenaBinding { base: 128, ..ok }), "BufferMisaligned");
    assert_eq!(e(ArenaBinding { len: 9 * stride + 1_935_359, ..ok }), "BufferTooShort");
    assert_eq!(a.check_binding(&ArenaBinding { len: 9 * stride + 1_935_360, ..ok }), Ok(()));
    assert_eq!(e(ArenaBinding { plane: 2, ..ok }), "PlaneOutOfRange");
    assert_eq!(e(ArenaBinding { entries: 0, live: 0, ..ok }), "NoEntries");
    // Alignment is per plane: the 1024-B state window asks only its own plane.
    let d =
        ArenaLayout::for_model(&ModelShape::v4_flash_dspark(5, DraftMode::Absent).unwrap(), &FP8).unwrap();
    let (wp, _) = d.field_place(d.field_index(STATE_WINDOW).unwrap()).unwrap();
    let other = 1 - wp;
    assert_eq!((d.max_align(wp), d.max_align(other)), (Ok(1024), Ok(256)));
    let s = 28_998u64; // any even slot_rows larger than the arena
    let bind = |plane: usize, base: u64| ArenaBinding {
        plane,
        base,
        len: 4 * s * FP8[plane],
        stride: s * FP8[plane],
        entries: 4,
        live: 4,
    };
    assert_eq!(d.check_binding(&bind(other, 256)), Ok(()));
    assert_eq!(d.check_binding(&bind(wp, 512)).unwrap_err().variant_name(), "BufferMisaligned");
    assert_eq!(d.check_binding(&bind(wp, 2048)), Ok(()));
}
