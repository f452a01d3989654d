//! Properties of the arena layout (`pool-runtime.md` §2) across models, k and dtypes.

use proptest::prelude::*;
use v4pool::geometry::GeometrySpec;
use v4pool::model::{DraftMode, ModelShape};
use v4pool::raw::arena::{ArenaBinding, ArenaError, ArenaLayout, Fill, FIELD_ALIGN};

fn model(which: u8, k: i64) -> ModelShape {
    match which {
        0 => ModelShape::v4_flash(k),
        1 => ModelShape::v4_pro(k),
        2 => ModelShape::v4_flash_dspark(k, DraftMode::Absent),
        _ => ModelShape::v4_pro_dspark(k, DraftMode::Absent),
    }
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn fields_fit_views_agree_and_bindings_hold(
        which in 0u8..4,
        k in 0i64..8,
        wsel in 0usize..6,
        positions in 2i64..40,
        probe in any::<(u64, u64, u64, u64)>(),
    ) {
        // bf16, fp8 (NoPE + RoPE), FlashMLA's V4 (584 B), V4.1 (528 B) and V4.1 fp4 (288 B)
        // rows, and narrow planes: widths that are no power of two still start every slot (so
        // every field) on the fields' alignment in memory, which check_binding holds below.
        let widths: &[u64] = [&[1024][..], &[512, 128], &[584], &[528], &[288], &[64, 32]][wsel];
        let m = model(which, k);
        let a = match ArenaLayout::for_model(&m, widths) {
            // A DSpark window's 1,024-B rows need a plane width that divides them.
            Err(ArenaError::WindowPlaneWidth { .. }) if which >= 2 => return Ok(()),
            other => other.unwrap(),
        };
        let g = GeometrySpec::new(m.ratios.clone(), 0, 0, m.ring_slots(), 256)
            .arena_rows(a.arena_rows())
            .slot_align_rows(a.slot_align_rows())
            .build()
            .unwrap();
        let s = g.slot_rows;
        for (p, plane) in a.planes().iter().enumerate() {
            // The plane's fields fit its arena, in declared order, without overlap.
            prop_assert!(plane.entry_bytes <= a.arena_rows() as u64 * plane.width);
            let mut end = 0u64;
            for pf in &plane.fields {
                let f = &a.fields()[pf.field];
                prop_assert!(pf.offset >= end && pf.offset % f.align.max(FIELD_ALIGN) == 0);
                end = pf.offset + f.bytes().unwrap();
            }
            // The carved slot stride satisfies every §2.4 precondition.
            let stride = s as u64 * plane.width;
            let binding = ArenaBinding {
                plane: p,
                base: 0,
                len: positions as u64 * stride,
                stride,
                entries: positions,
                live: positions / 2,
            };
            prop_assert_eq!(a.check_binding(&binding), Ok(()));
            // Fill runs of a position cover exactly its arena bytes in this plane.
            let runs = a.fill_runs(positions - 1, s).unwrap();
            let covered: u64 = runs.iter().filter(|r| r.plane == p).map(|r| r.bytes).sum();
            prop_assert_eq!(covered, a.arena_rows() as u64 * plane.width);
        }
        // A random element reached through the view equals byte_offset + in-layer offset.
        let field = (probe.0 % a.fields().len() as u64) as usize;
        let f = &a.fields()[field];
        prop_assume!(f.layers > 0);
        let layer = probe.1 % f.layers;
        let pos = (probe.2 % positions as u64) as i64;
        let elem = probe.3 % f.per_layer_elems().unwrap();
        let v = a.field_view(field, s, positions).unwrap();
        let mut idx = vec![layer, pos as u64];
        let mut rem = elem;
        let mut inner = Vec::new();
        for &d in f.shape.iter().rev() {
            inner.push(rem % d);
            rem /= d;
        }
        idx.extend(inner.into_iter().rev());
        let elems: u64 = idx.iter().zip(&v.strides).map(|(i, st)| i * st).sum();
        let (plane, off) = a.byte_offset(pos, field, layer, s).unwrap();
        prop_assert_eq!(plane, v.plane);
        prop_assert_eq!(v.offset + elems * f.dtype.itemsize(), off + elem * f.dtype.itemsize());
        // The run that covers that byte carries the field's fill.
        let runs = a.fill_runs(pos, s).unwrap();
        let run = runs.iter().find(|r| r.plane == plane && r.offset <= off && off < r.offset + r.bytes).unwrap();
        prop_assert_eq!(run.pattern, f.fill.pattern(f.dtype));
        prop_assert_eq!(run.pattern != 0, f.fill == Fill::NegInf);
    }
}
