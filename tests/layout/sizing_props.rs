//! Properties of the budget plan (`pool-runtime.md` §3): it never exceeds the budget, never
//! beats the spec's tight fit, and leaves no whole position unused that would still fit.

use proptest::prelude::*;
use v4pool::model::{DraftMode, ModelShape};
use v4pool::raw::arena::plan_regions;
use v4pool::sizing::{parse_bytes, plan, IndexerDtype, KvDtype, PlanRequest, SizingError};

fn model(which: u8, k: i64) -> ModelShape {
    match which {
        0 => ModelShape::v4_flash(k),
        1 => ModelShape::v4_pro(k),
        2 => ModelShape::v4_flash_dspark(k, DraftMode::Absent),
        3 => ModelShape::v4_pro_dspark(k, DraftMode::Absent),
        _ => ModelShape::v4_flash_dspark(k, DraftMode::Dense),
    }
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn plan_never_exceeds_the_budget(
        which in 0u8..5,
        k in 0i64..8,
        bf16 in any::<bool>(),
        fp4 in any::<bool>(),
        m in 1i64..600,
        min_frac in 0u32..=100,
        budget_exp in 28u32..42,
        budget_frac in any::<u64>(),
        overhead in prop_oneof![Just(0u64), 0u64..(4u64 << 30)],
    ) {
        // Log-uniform over 256 MiB .. 4 TiB: both refusals and i32-capped planes occur.
        let budget = (1u64 << budget_exp) + budget_frac % (1u64 << budget_exp);
        let kv = if bf16 { KvDtype::Bf16 } else { KvDtype::Fp8 };
        let indexer = if fp4 { IndexerDtype::Fp4 } else { IndexerDtype::Fp8 };
        let min_slots = m * i64::from(min_frac) / 100;
        let req = PlanRequest::new(kv, indexer, m, budget).with_min_slots(min_slots).with_overhead_bytes(overhead);
        let shape = model(which, k);
        match plan(&shape, &req) {
            Ok(p) => {
                prop_assert!(p.total_bytes <= budget);
                prop_assert_eq!(p.total_bytes, p.planes_total_bytes + p.indexer_total_bytes + overhead);
                prop_assert!(p.num_blocks >= 1);
                prop_assert!(p.num_blocks <= p.tight_fit_blocks);
                prop_assert!(p.max_blocks >= p.num_blocks);
                prop_assert_eq!(p.num_slots, m);
                let g = &p.geometry;
                prop_assert_eq!(g.plane_rows, p.slot_positions * g.slot_rows);
                prop_assert_eq!(g.max_blocks_beside(m as u32), p.num_blocks);
                prop_assert_eq!(g.max_blocks_beside(min_slots as u32), p.max_blocks);
                prop_assert_eq!(p.tokens, p.num_blocks * 256);
                // Maximal: one more position would not fit (or the plane is at the i32 limit).
                if !p.plane_capped {
                    let rows = p.plane_rows + g.slot_rows;
                    let planes = plan_regions(&p.layout.plane_bytes(rows).unwrap()).unwrap().1;
                    let maxb = (p.slot_positions + 1 - min_slots) * g.slot_rows / g.envelope_rows;
                    let idx = plan_regions(&p.layout.indexer_pool_bytes(maxb).unwrap()).unwrap().1;
                    prop_assert!(planes + idx + overhead > budget);
                }
            }
            Err(SizingError::BudgetTooSmall { budget: b, required, num_slots, .. }) => {
                prop_assert_eq!(b, budget);
                prop_assert_eq!(num_slots, m);
                prop_assert!(required > budget);
            }
            Err(e) => prop_assert!(false, "unexpected error {e:?}"),
        }
    }

    #[test]
    fn parse_bytes_round_trips(n in 0u64..(1u64 << 24)) {
        prop_assert_eq!(parse_bytes(&n.to_string()), Ok(n));
        prop_assert_eq!(parse_bytes(&format!("{n}GiB")), Ok(n << 30));
        prop_assert_eq!(parse_bytes(&format!("{n}MB")), Ok(n * 1_000_000));
        prop_assert_eq!(parse_bytes(&format!("{n}.5KiB")), Ok(n * 1024 + 512));
    }
}
