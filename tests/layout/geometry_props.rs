//! Properties of the row space over random ratio lists (absent layers, lists without a dense
//! class) and sizes: no two live rows share a plane row, every row sits inside the plane and
//! its own envelope or slot part, indices are layer-independent within a class, the entry
//! height is the residue-counting bound, the split moves no address at a fixed plane, and
//! garbage input is a typed error, never a panic.

use proptest::prelude::*;
use std::collections::HashMap;
use v4pool::geometry::{
    entry_rows_for, ring_offset_for, GeometryError, GeometrySpec, UnifiedPoolGeometry, ABSENT_RATIO,
    DENSE_RATIO, MAX_PLANE_ROWS,
};
use v4pool::VariantName;

/// A small geometry's arguments: few layers, blocks and slots, so properties can walk
/// every live row. `plane_extra` and `positions_extra` grow the plane past the tight fit
/// and number its slots from a larger one.
#[derive(Clone, Debug)]
struct Small {
    ratios: Vec<i32>,
    num_blocks: i64,
    num_slots: i64,
    ring: i64,
    block_size: i64,
    arena: i64,
    align: i64,
    plane_extra: Option<i64>,
    positions_extra: Option<i64>,
}

fn small() -> impl Strategy<Value = Small> {
    let ratios = proptest::collection::vec(prop_oneof![Just(-1), Just(0), Just(4), Just(128)], 1..7);
    (
        ratios,
        0i64..4,
        0i64..4,
        1i64..40,
        prop_oneof![Just(4i64), Just(8), Just(12), Just(64), Just(128), Just(256)],
        prop_oneof![Just(0i64), 0i64..9],
        1i64..5,
        proptest::option::of(0i64..300),
        proptest::option::of(0i64..3),
    )
        .prop_map(
            |(ratios, num_blocks, num_slots, ring, bs, arena, align, plane_extra, positions_extra)| {
                // HCA needs a block size divisible by 128.
                let block_size = if ratios.contains(&128) { 128 * (1 + bs % 2) } else { bs };
                Small {
                    ratios,
                    num_blocks,
                    num_slots,
                    ring,
                    block_size,
                    arena,
                    align,
                    plane_extra,
                    positions_extra,
                }
            },
        )
}

impl Small {
    fn tight(&self) -> GeometrySpec {
        GeometrySpec::new(self.ratios.clone(), self.num_blocks, self.num_slots, self.ring, self.block_size)
            .arena_rows(self.arena)
            .slot_align_rows(self.align)
    }

    /// The geometry with its extra room, or `None` when the list keeps nothing (all absent
    /// and no arena: an empty slot).
    fn build(&self) -> Option<UnifiedPoolGeometry> {
        let tight = match self.tight().build() {
            Err(GeometryError::EmptySlot) => return None,
            other => other.expect("small arguments always build"),
        };
        let mut spec = self.tight();
        if let Some(extra) = self.plane_extra {
            spec = spec.plane_rows(tight.plane_rows + extra);
            if let Some(more) = self.positions_extra {
                spec = spec.slot_positions((tight.plane_rows + extra) / tight.slot_rows + more);
            }
        }
        Some(spec.build().expect("a larger plane always builds"))
    }
}

/// Every live row: compressed (layer, block, row), window (layer, position, ring position),
/// and the arena rows of live positions. Checks containment on the way and panics (via
/// `prop_assert`-style returns) on the first collision.
fn walk_live_rows(g: &UnifiedPoolGeometry) -> Result<usize, TestCaseError> {
    let mut owner: HashMap<i64, String> = HashMap::new();
    let mut claim = |row: i64, who: String| -> Result<(), TestCaseError> {
        prop_assert!((0..g.plane_rows).contains(&row), "{who} at row {row} outside the plane");
        if let Some(prev) = owner.insert(row, who.clone()) {
            return Err(TestCaseError::fail(format!("row {row}: {prev} and {who}")));
        }
        Ok(())
    };
    for layer in 0..g.num_layers {
        if g.ratios[layer] == ABSENT_RATIO {
            let absent = matches!(g.layer_base_row(layer), Err(GeometryError::AbsentLayer { .. }));
            prop_assert!(absent, "absent layer {} has a base row", layer);
            continue;
        }
        let cls = g.layer_class(layer).unwrap().clone();
        let view = g.layer_view_rows(layer).unwrap();
        if cls.ratio != DENSE_RATIO {
            for b in 0..g.num_blocks {
                let lo = b * g.envelope_rows + cls.envelope_offset;
                for r in 0..cls.block_rows {
                    let idx = g.compress_index(layer, b, r).unwrap();
                    prop_assert!((0..view).contains(&idx));
                    let row = g.absolute_row(layer, idx).unwrap();
                    prop_assert!(
                        (lo..lo + cls.envelope_rows()).contains(&row),
                        "compressed row outside its class part"
                    );
                    prop_assert!(row < g.num_blocks * g.envelope_rows);
                    claim(row, format!("compressed L{layer} b{b} r{r}"))?;
                }
            }
        }
        for j in g.live_positions() {
            let (start, stop) = g.slot_span(j).unwrap();
            let lo = start + g.arena_rows + cls.entry_offset;
            prop_assert!(lo + cls.entry_rows() <= stop);
            for q in 0..g.ring_slots {
                let idx = g.window_index(layer, j, q).unwrap();
                prop_assert!((0..view).contains(&idx));
                let row = g.absolute_row(layer, idx).unwrap();
                prop_assert!((lo..lo + cls.entry_rows()).contains(&row), "window row outside its class part");
                claim(row, format!("window L{layer} pos{j} q{q}"))?;
            }
        }
    }
    for j in g.live_positions() {
        let (a, b) = g.arena_span(j).unwrap();
        prop_assert_eq!(a, g.slot_span(j).unwrap().0);
        for row in a..b {
            claim(row, format!("arena pos{j}"))?;
        }
    }
    Ok(owner.len())
}

/// Least height `H` such that every residue `c` mod `s` has at least `L · n_c` rows below
/// `H`, `n_c` being the ring positions with that residue. Found by search, not by formula.
fn residue_bound(layers: i64, stride: i64, ring: i64) -> i64 {
    let mut need = vec![0i64; stride as usize];
    for q in 0..ring {
        need[(q % stride) as usize] += layers;
    }
    let enough = |h: i64| {
        (0..stride).all(|c| (if h > c { (h - c + stride - 1) / stride } else { 0 }) >= need[c as usize])
    };
    let (mut lo, mut hi) = (0i64, layers * stride * (ring / stride + 1) + stride);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if enough(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// Values that break careless arithmetic.
fn nasty_i64() -> impl Strategy<Value = i64> {
    prop_oneof![
        Just(0i64),
        Just(1),
        Just(-1),
        Just(2),
        Just(i64::MIN),
        Just(i64::MAX),
        Just(i64::MAX / 2),
        Just(i64::MIN / 2),
        Just(MAX_PLANE_ROWS),
        Just(MAX_PLANE_ROWS + 1),
        Just(1 << 32),
        -300i64..300,
        any::<i64>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn live_rows_never_collide_and_stay_in_their_parts(s in small()) {
        let Some(g) = s.build() else { return Ok(()) };
        let live = walk_live_rows(&g)?;
        // Every claimed row is distinct; the count is what the layout promises.
        let compressed: i64 = g.classes.values().map(|c| c.envelope_rows()).sum::<i64>() * g.num_blocks;
        let window: i64 = g.classes.values().map(|c| c.num_layers() as i64 * g.ring_slots).sum::<i64>() * g.num_slots;
        prop_assert_eq!(live as i64, compressed + window + g.arena_rows * g.num_slots);
        prop_assert_eq!(compressed, g.envelope_rows * g.num_blocks);
    }

    #[test]
    fn indices_are_layer_independent_within_a_class(s in small(), far in 0i64..5_000_000) {
        let Some(g) = s.build() else { return Ok(()) };
        for (&ratio, cls) in &g.classes {
            let w = g.window_params(ratio).unwrap();
            let first = cls.layers[0];
            for j in g.slot_origin..g.slot_positions {
                for q in 0..g.ring_slots {
                    let want = g.window_index(first, j, q).unwrap();
                    prop_assert_eq!(w.index(j, q), want);
                    // The wrap happens in the formula: any absolute position lands on its ring slot.
                    prop_assert_eq!(w.index(j, q + far * g.ring_slots), want);
                    for &l in &cls.layers[1..] {
                        prop_assert_eq!(g.window_index(l, j, q).unwrap(), want);
                    }
                }
            }
            if ratio != DENSE_RATIO {
                for b in 0..g.num_blocks {
                    for r in 0..cls.block_rows {
                        let want = g.compress_index(first, b, r).unwrap();
                        prop_assert_eq!(want, b * g.envelope_rows + r);
                        for &l in &cls.layers[1..] {
                            prop_assert_eq!(g.compress_index(l, b, r).unwrap(), want);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn entry_rows_are_the_residue_bound(layers in 1i64..40, stride in 1i64..300, ring in 1i64..1200) {
        let h = entry_rows_for(layers, stride, ring).unwrap();
        prop_assert_eq!(h, residue_bound(layers, stride, ring));
        // The construction reaches exactly that height: its tallest row is h - 1.
        let last = (layers - 1) * stride + ring_offset_for(layers, stride, ring - 1).unwrap();
        prop_assert_eq!(last, h - 1);
    }

    #[test]
    fn interleaved_rows_are_distinct_and_below_the_bound(layers in 1i64..8, stride in 1i64..20, ring in 1i64..60) {
        let h = entry_rows_for(layers, stride, ring).unwrap();
        let mut seen = std::collections::HashSet::new();
        for i in 0..layers {
            for q in 0..ring {
                let row = i * stride + ring_offset_for(layers, stride, q).unwrap();
                prop_assert!((0..h).contains(&row));
                prop_assert!(seen.insert(row), "layer {} position {} collides", i, q);
            }
        }
    }

    #[test]
    fn split_moves_no_address_at_a_fixed_plane(
        s in small(),
        splits in proptest::collection::vec((0i64..6, 0i64..6), 2..5),
    ) {
        // A plane sized for the largest split; the others must fit or be refused.
        let Some(big) = Small { num_blocks: 5, num_slots: 5, ..s.clone() }.build() else { return Ok(()) };
        let plane = big.plane_rows;
        let mut built: Vec<UnifiedPoolGeometry> = Vec::new();
        for (nb, ns) in splits {
            let spec = GeometrySpec::new(s.ratios.clone(), nb, ns, s.ring, s.block_size)
                .arena_rows(s.arena)
                .slot_align_rows(s.align)
                .plane_rows(plane)
                .slot_positions(big.slot_positions);
            match spec.build() {
                Ok(g) => built.push(g),
                Err(e) => {
                    let held = plane / big.slot_rows;
                    let fits = ns <= held && (held - ns) * big.slot_rows >= nb * big.envelope_rows;
                    prop_assert!(!fits, "a split that fits was refused: {:?}", e);
                    prop_assert!(matches!(e, GeometryError::PlaneTooSmall { .. }), "{:?}", e);
                }
            }
        }
        for g in &built {
            prop_assert_eq!((g.slot_positions, g.slot_origin, g.slot_rows), (big.slot_positions, big.slot_origin, big.slot_rows));
            for &ratio in g.classes.keys() {
                prop_assert_eq!(g.window_params(ratio).unwrap(), big.window_params(ratio).unwrap());
            }
            for layer in 0..g.num_layers {
                prop_assert_eq!(g.layer_base_row(layer), big.layer_base_row(layer));
                prop_assert_eq!(g.layer_view_rows(layer), big.layer_view_rows(layer));
                for j in g.slot_origin..g.slot_positions {
                    for q in [0, g.ring_slots / 2, g.ring_slots - 1] {
                        prop_assert_eq!(g.window_index(layer, j, q), big.window_index(layer, j, q));
                    }
                }
                for b in 0..g.num_blocks {
                    prop_assert_eq!(g.compress_index(layer, b, 0), big.compress_index(layer, b, 0));
                }
            }
            for grp in 0..g.num_slots {
                prop_assert_eq!(g.physical_slot(grp), big.physical_slot(grp));
            }
        }
    }

    #[test]
    fn with_capacity_is_the_same_layout(s in small(), nb in 0i64..8, ns in 0i64..8, extra in proptest::option::of(-50i64..400)) {
        let Some(g) = s.build() else { return Ok(()) };
        prop_assert_eq!(&g.spec().build().unwrap(), &g);
        let plane = extra.map(|e| g.plane_rows + e);
        let mut direct = GeometrySpec::new(g.ratios.clone(), nb, ns, g.ring_slots, g.block_size)
            .arena_rows(g.arena_rows)
            .slot_align_rows(g.slot_align_rows);
        if let Some(p) = plane {
            direct = direct.plane_rows(p);
        }
        let resized = g.with_capacity(nb, ns, plane);
        prop_assert_eq!(&resized, &direct.build());
        if let Ok(h) = resized {
            prop_assert_eq!((h.envelope_rows, h.entry_rows, h.slot_rows), (g.envelope_rows, g.entry_rows, g.slot_rows));
            prop_assert_eq!(&h.classes, &g.classes);
            prop_assert_eq!((h.num_blocks, h.num_slots), (nb, ns));
            // Without a plane it is the tight fit: no whole slot of slack.
            if plane.is_none() {
                prop_assert!(h.plane_rows - h.slot_rows * h.num_slots - h.num_blocks * h.envelope_rows < h.slot_rows);
            }
        }
    }

}

proptest! {
    // Cheap cases; many of them, since the edges are rare draws.
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn garbage_is_a_typed_error_never_a_panic(
        ratios in proptest::collection::vec(prop_oneof![Just(-1i32), Just(0), Just(4), Just(128), any::<i32>()], 0..6),
        num_blocks in nasty_i64(),
        num_slots in nasty_i64(),
        ring in nasty_i64(),
        block_size in prop_oneof![Just(256i64), Just(128), nasty_i64()],
        plane in proptest::option::of(nasty_i64()),
        arena in nasty_i64(),
        positions in proptest::option::of(nasty_i64()),
        align in nasty_i64(),
        args in proptest::collection::vec(nasty_i64(), 8),
    ) {
        let mut spec = GeometrySpec::new(ratios, num_blocks, num_slots, ring, block_size)
            .arena_rows(arena)
            .slot_align_rows(align);
        spec.plane_rows = plane;
        spec.slot_positions = positions;
        let _ = ring_offset_for(args[0], args[1], args[2]);
        let _ = entry_rows_for(args[0], args[1], args[2]);
        let g = match spec.build() {
            Err(e) => {
                prop_assert!(!e.variant_name().is_empty() && !e.to_string().is_empty());
                return Ok(());
            }
            Ok(g) => g,
        };
        prop_assert!(g.plane_rows <= MAX_PLANE_ROWS);
        let layer = args[0].unsigned_abs() as usize % (g.num_layers + 2);
        let _ = g.layer_base_row(layer);
        let _ = g.layer_view_rows(args[1] as usize);
        let _ = g.compress_index(layer, args[2], args[3]);
        let _ = g.window_index(layer, args[4], args[5]);
        let _ = g.window_params(args[6] as i32);
        let _ = g.field_window_params(args[6], args[7]);
        let _ = g.physical_slot(args[1]);
        let _ = g.slot_span(args[2]);
        let _ = g.arena_span(args[3]);
        let _ = g.absolute_row(layer, args[4]);
        let _ = g.with_capacity(args[5], args[6], Some(args[7]));
        let _ = g.with_capacity(args[5], args[6], None);
        let _ = g.entry_row_runs();
        for grp in [0, g.num_slots - 1] {
            if let Ok(p) = g.physical_slot(grp) {
                let (a, b) = g.slot_span(p).unwrap();
                prop_assert!(0 <= a && a <= b && b <= g.plane_rows);
            }
        }
    }
}

/// `max_blocks_beside` (not in the spec; Rust only) takes an unsigned slot count, so a
/// negative count cannot be expressed; the answer never exceeds what the plane holds.
#[test]
fn max_blocks_beside_stays_inside_the_plane() {
    let g = GeometrySpec::new(vec![4, 0], 2, 2, 7, 256).build().unwrap();
    let held_blocks = g.plane_rows / g.envelope_rows;
    for slots in [0u32, 1, 2, 3, u32::MAX] {
        let b = g.max_blocks_beside(slots);
        assert!(b <= held_blocks, "{b} blocks beside {slots} slots");
        assert!(b * g.envelope_rows + i64::from(slots) * g.slot_rows <= g.plane_rows || b == 0);
    }
    assert_eq!(g.max_blocks_beside(u32::MAX), 0);
}

/// The edges random garbage reaches only by luck, each pinned down.
#[test]
fn arithmetic_edges_are_typed_errors() {
    for layers in [i64::MIN, i64::MIN + 1, -1, 0] {
        for (stride, ring) in [(1, 1), (1, 2), (64, 131), (i64::MAX, 1)] {
            let got = std::panic::catch_unwind(|| entry_rows_for(layers, stride, ring));
            assert!(got.is_ok(), "entry_rows_for({layers}, {stride}, {ring}) panicked");
        }
    }
    for positions in [i64::MIN, i64::MIN + 1, -1] {
        let spec = GeometrySpec::new(vec![4, 0], 2, 2, 7, 256).slot_positions(positions);
        let got = std::panic::catch_unwind(|| spec.build());
        assert!(got.is_ok(), "slot_positions {positions} panicked");
        assert!(got.unwrap().is_err());
    }
}

/// A geometry of a million layers, and every layer's base row, envelope position and class
/// index, take O(layers · log layers) work. Seen failing before the fix: the per-layer
/// searches were linear scans inside per-layer loops, so this ran for minutes (killed after
/// 120 s; 16,000 layers already took 0.1 s). A shape of the layout is checked too, so the
/// loop cannot be optimised away.
#[test]
fn a_million_layers_lay_out_without_a_per_layer_scan() {
    let n = 1_000_000usize;
    let g = GeometrySpec::new(vec![4; n], 1, 1, 8, 256).build().expect("a million CSA layers");
    let cls = g.class(4).expect("the CSA class");
    assert_eq!(g.envelope_rows, 64 * n as i64);
    for l in (0..n).rev() {
        assert_eq!(cls.layer_index(l), Ok(l));
        assert_eq!(cls.envelope_position(l), Ok(64 * l as i64));
        assert_eq!(g.layer_base_row(l), Ok(64 * l as i64));
    }
    let mixed: Vec<i32> = (0..n).map(|l| [0, 4, 128][l % 3]).collect();
    let g = GeometrySpec::new(mixed, 1, 1, 8, 256).build().expect("a million mixed layers");
    assert_eq!(g.layer_class(n - 1).unwrap().layer_index(n - 1), Ok(n / 3));
}
