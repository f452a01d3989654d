#[test]
fn kv_dtype_names_round_trip() {
    for k in KvDtype::ALL {
        assert_eq!(KvDtype::from_name(k.name()), Some(k));
    }
}

use super::*;
use crate::model::ModelShape;

const GIB100: u64 = 100 << 30;

struct Row {
    model: ModelShape,
    kv: KvDtype,
    indexer: IndexerDtype,
    page: u64,
    slot: u64,
    blocks: i64,
    plane_rows: i64,
    positions: i64,
}

fn table() -> Vec<Row> {
    let (k8, kb) = (KvDtype::Fp8, KvDtype::Bf16);
    let (i8, i4) = (IndexerDtype::Fp8, IndexerDtype::Fp4);
    let f = |k| ModelShape::v4_flash(k).unwrap();
    let p = |k| ModelShape::v4_pro(k).unwrap();
    let r = |model, kv, indexer, page, slot, blocks, plane_rows, positions| Row {
        model,
        kv,
        indexer,
        page,
        slot,
        blocks,
        plane_rows,
        positions,
    };
    vec![
        r(f(0), k8, i8, 1_063_168, 16_711_680, 96_970, 140_900_352, 5_396),
        r(f(1), k8, i8, 1_063_168, 17_661_440, 96_741, 140_960_368, 5_108),
        r(f(1), k8, i4, 977_152, 17_661_440, 105_257, 152_743_860, 5_535),
        r(f(1), kb, i8, 1_594_624, 19_625_984, 64_184, 93_740_906, 4_891),
        r(p(1), k8, i8, 1_521_920, 26_782_720, 66_046, 141_655_480, 3_385),
        r(p(1), k8, i4, 1_399_040, 26_782_720, 71_847, 153_121_832, 3_659),
    ]
}

#[test]
fn section_3_table_page_and_slot_bytes_exact() {
    for row in table() {
        let plan = plan(&row.model, &PlanRequest::new(row.kv, row.indexer, 256, GIB100)).unwrap();
        assert_eq!(plan.page_bytes, row.page, "{} {:?} {:?}", row.model.name, row.kv, row.indexer);
        assert_eq!(plan.slot_bytes, row.slot);
        // The spec's own split reproduces its table exactly...
        assert_eq!(plan.tight_fit_blocks, row.blocks);
        // ...and its tight plane is what the table lists.
        let tight = plan.layout.geometry.with_capacity(row.blocks, 256, None).unwrap();
        assert_eq!((tight.plane_rows, tight.slot_positions), (row.plane_rows, row.positions));
    }
}

#[test]
fn section_3_blocks_under_the_table_within_the_stated_margin() {
    for row in table() {
        let s = plan(&row.model, &PlanRequest::new(row.kv, row.indexer, 256, GIB100)).unwrap();
        let (sr, e) = (s.geometry.slot_rows, s.geometry.envelope_rows);
        assert!(s.total_bytes <= GIB100);
        // min_slots = m: only the whole-slot rounding separates this plan from the table.
        let tight = plan(
            &row.model,
            &PlanRequest { min_slots: 256, ..PlanRequest::new(row.kv, row.indexer, 256, GIB100) },
        )
        .unwrap();
        assert!(tight.total_bytes <= GIB100);
        assert_eq!(tight.max_blocks, tight.num_blocks);
        let margin = (sr + e - 1) / e + 3;
        assert!(
            tight.num_blocks <= row.blocks && row.blocks - tight.num_blocks <= margin,
            "{}: {} vs {}",
            row.model.name,
            tight.num_blocks,
            row.blocks
        );
        // min_slots = 0: the indexer headroom for the slots' rows comes off too (and the two
        // plans round to whole slots independently).
        let idx = s.layout.indexer_block_bytes().unwrap() as i64;
        let headroom = (256 * sr / e + 1) * idx / s.page_bytes as i64 + 1;
        assert!(s.num_blocks <= tight.num_blocks && tight.num_blocks - s.num_blocks <= headroom + margin);
        assert_eq!(s.max_blocks, s.slot_positions * sr / e);
        assert!(s.max_blocks > s.num_blocks);
        // Within 1.5 % of the table either way.
        assert!((row.blocks - s.num_blocks) * 1000 <= 15 * row.blocks, "{} {}", s.num_blocks, row.blocks);
    }
}

#[test]
fn plan_accounting_adds_up() {
    let m = ModelShape::v4_pro(1).unwrap();
    let p = plan(&m, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp4, 256, GIB100)).unwrap();
    assert_eq!(p.plane_rows, p.slot_positions * p.geometry.slot_rows);
    assert_eq!(p.plane_bytes, vec![p.plane_rows as u64 * 512, p.plane_rows as u64 * 128]);
    assert_eq!(p.plane_offsets, vec![0, p.plane_bytes[0]]);
    assert_eq!(p.indexer_pool_bytes, vec![30 * p.max_blocks as u64 * 4096, 30 * p.max_blocks as u64 * 256]);
    assert_eq!(p.total_bytes, p.planes_total_bytes + p.indexer_total_bytes);
    assert_eq!(p.tokens, p.num_blocks * 256);
    assert_eq!(p.geometry.num_blocks, p.num_blocks);
    assert_eq!(p.geometry.num_slots, 256);
    assert_eq!(p.geometry.slot_origin, 0);
    assert!(p.rows_wasted >= 0 && p.rows_wasted < p.geometry.envelope_rows);
    // One more position would not fit.
    let (planes, idx, _) = cost(&p.layout, p.slot_positions + 1, 0).unwrap();
    assert!(planes + idx > GIB100);
    // The plane's blocks are exactly what max_blocks_beside gives.
    assert_eq!(p.geometry.max_blocks_beside(256), p.num_blocks);
    assert_eq!(p.geometry.max_blocks_beside(0), p.max_blocks);
}

#[test]
fn verify_carve_catches_a_different_layout() {
    let m = ModelShape::v4_flash(1).unwrap();
    let p = plan(&m, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 16, 8 << 30)).unwrap();
    assert_eq!(p.verify_carve(&p.geometry), Ok(()));
    // The elastic boundary moving changes nothing sizing priced.
    let moved = p.geometry.with_capacity(p.num_blocks / 2, 20, Some(p.plane_rows)).unwrap();
    assert_eq!(p.verify_carve(&moved), Ok(()));
    let k0 = PoolLayout::new(&ModelShape::v4_flash(0).unwrap(), KvDtype::Fp8, IndexerDtype::Fp8).unwrap();
    let other = k0.carve(10, 16, p.plane_rows).unwrap();
    assert!(matches!(p.verify_carve(&other), Err(SizingError::CarveMismatch { what: "slot_bytes", .. })));
    let tight = p.geometry.with_capacity(p.num_blocks - 100, 16, None).unwrap();
    assert!(matches!(p.verify_carve(&tight), Err(SizingError::CarveMismatch { what: "plane_rows", .. })));
}

#[test]
fn overhead_comes_off_the_budget() {
    let m = ModelShape::v4_flash(1).unwrap();
    let base = PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 256, GIB100);
    let a = plan(&m, &base).unwrap();
    let b = plan(&m, &PlanRequest { overhead_bytes: 2 << 30, ..base }).unwrap();
    assert!(b.num_blocks < a.num_blocks);
    assert!(b.total_bytes <= GIB100 && b.overhead_bytes == 2 << 30);
    assert_eq!(b.total_bytes, b.planes_total_bytes + b.indexer_total_bytes + (2 << 30));
}

#[test]
fn too_small_budgets_carry_the_numbers() {
    let m = ModelShape::v4_flash(1).unwrap();
    let req = PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 256, 4 << 30);
    match plan(&m, &req) {
        Err(SizingError::BudgetTooSmall { budget, required, num_slots, slot_bytes, page_bytes, .. }) => {
            assert_eq!((budget, num_slots, slot_bytes, page_bytes), (4 << 30, 256, 17_661_440, 1_063_168));
            assert!(required > budget && required >= 256 * slot_bytes + page_bytes);
        }
        other => panic!("{other:?}"),
    }
    // Exactly the smallest feasible budget works, one byte less does not.
    let lo_req = PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 1, 1);
    let need = match plan(&m, &lo_req) {
        Err(SizingError::BudgetTooSmall { required, .. }) => required,
        other => panic!("{other:?}"),
    };
    let p = plan(&m, &PlanRequest { budget_bytes: need, ..lo_req }).unwrap();
    assert!(p.num_blocks >= 1 && p.total_bytes == need);
    assert!(plan(&m, &PlanRequest { budget_bytes: need - 1, ..lo_req }).is_err());
    assert_eq!(plan(&m, &PlanRequest { max_num_seqs: 0, ..lo_req }), Err(SizingError::NoSlots { got: 0 }));
    assert!(matches!(
        plan(&m, &PlanRequest { min_slots: 2, ..lo_req }),
        Err(SizingError::MinSlots { min_slots: 2, max_num_seqs: 1 })
    ));
}

#[test]
fn huge_budgets_stop_at_the_i32_plane() {
    let m = ModelShape::v4_flash(0).unwrap();
    let p = plan(&m, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 256, 4 << 40)).unwrap();
    assert!(p.plane_capped);
    assert!(p.plane_rows <= MAX_PLANE_ROWS && p.plane_rows + p.geometry.slot_rows > MAX_PLANE_ROWS);
    assert!(p.total_bytes <= 4 << 40);
}

#[test]
fn parse_bytes_units_and_errors() {
    assert_eq!(parse_bytes("100GiB"), Ok(107_374_182_400));
    assert_eq!(parse_bytes("512MiB"), Ok(536_870_912));
    assert_eq!(parse_bytes("80GB"), Ok(80_000_000_000));
    assert_eq!(parse_bytes("1234"), Ok(1234));
    assert_eq!(parse_bytes(" 7 kib "), Ok(7168));
    assert_eq!(parse_bytes("1.5GiB"), Ok(1_610_612_736));
    assert_eq!(parse_bytes("3B"), Ok(3));
    assert_eq!(parse_bytes(""), Err(SizingError::EmptyBytes));
    assert!(matches!(parse_bytes("12XB"), Err(SizingError::UnknownUnit { .. })));
    assert!(matches!(parse_bytes("GiB"), Err(SizingError::BadBytes { .. })));
    assert!(matches!(parse_bytes("-5"), Err(SizingError::UnknownUnit { .. })));
    assert!(matches!(parse_bytes("1.2.3"), Err(SizingError::BadBytes { .. })));
    assert!(matches!(parse_bytes("."), Err(SizingError::BadBytes { .. })));
    assert!(matches!(parse_bytes("20000000TiB"), Err(SizingError::BytesOverflow { .. })));
    assert!(matches!(
        parse_bytes("99999999999999999999999999999999999999999"),
        Err(SizingError::BytesOverflow { .. })
    ));
    assert_eq!(parse_bytes("18446744073709551615"), Ok(u64::MAX));
}
