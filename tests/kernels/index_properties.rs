//! Properties of the host reference on random geometries (proptest): window rows stay inside
//! their slot and agree with the geometry; the decode builder writes exactly the window tail of
//! each live slice and nothing else; the host backend's launch equals the safe reference.

use proptest::prelude::*;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::geometry::GeometrySpec;
use v4pool::raw::index::host::{decode_indices, window_row, DecodeClass, DecodeIndices};
use v4pool::raw::index::{ClassBuffers, DecodeIndexArgs, Launch, CLASS_CSA};

fn spec() -> impl Strategy<Value = GeometrySpec> {
    (
        prop::collection::vec(prop::sample::select(vec![0, 4, 128]), 1..8),
        0i64..50,
        1i64..8,
        8i64..14,
        prop::sample::select(vec![128i64, 256]),
        0i64..6,
    )
        .prop_map(|(ratios, blocks, slots, ring, block, arena)| {
            GeometrySpec::new(ratios, blocks, slots, ring, block).arena_rows(arena)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn window_rows_stay_in_their_slot(spec in spec(), pos in 0i64..2_000_000, pick in 0usize..64) {
        let g = spec.build().unwrap();
        let layer = pick % g.num_layers;
        let ratio = g.ratios[layer];
        let w = g.window_params(ratio).unwrap();
        let slot = g.physical_slot((pick as i64) % g.num_slots).unwrap();
        let row = window_row(&w, slot, pos).unwrap();
        prop_assert_eq!(row, g.window_index(layer, slot, pos % g.ring_slots).unwrap());
        let (start, stop) = g.slot_span(slot).unwrap();
        let plane_row = g.absolute_row(layer, row).unwrap();
        prop_assert!(start + g.arena_rows <= plane_row && plane_row < stop);
    }

    #[test]
    fn decode_writes_exactly_the_window_tails(
        spec in spec(),
        positions in prop::collection::vec(0i64..100_000, 0..8),
        heads in prop::collection::vec(0i64..5, 8),
        pads in prop::collection::vec(any::<bool>(), 8),
        win_pick in 1i64..14,
    ) {
        let g = spec.build().unwrap();
        let w = g.window_params(g.ratios[0]).unwrap();
        let win = win_pick.min(g.ring_slots) as i32;
        let t = positions.len();
        let slots: Vec<i32> = (0..g.num_slots).map(|j| g.physical_slot(j).unwrap() as i32).collect();
        let bids: Vec<i32> = (0..t).map(|i| if pads[i] { -1 } else { (i as i64 % g.num_slots) as i32 }).collect();
        let mut indptr = vec![0i32];
        for i in 0..t {
            let n = if bids[i] < 0 { 0 } else { heads[i] + (positions[i] + 1).min(win.into()) };
            indptr.push(indptr[i] + n as i32);
        }
        let poison = vec![-9; *indptr.last().unwrap() as usize + 2];
        let mut indices = poison.clone();
        let mut dest = vec![-9; t];
        let class =
            DecodeClass { params: w, indptr: &indptr, indices: Some(&mut indices), dest_rows: Some(&mut dest) };
        decode_indices(DecodeIndices {
            flashmla: [None, None, None],
            classes: [None, Some(class), None],
            state_slot_per_seq: &slots,
            batch_id_per_token: &bids,
            positions: &positions,
            block_tables: None,
            envelope_rows: g.envelope_rows,
            hca_rows_per_block: 2,
            num_tokens: t as i32,
            win,
        }).unwrap();
        for i in 0..t {
            let (begin, end) = (indptr[i] as usize, indptr[i + 1] as usize);
            if bids[i] < 0 {
                prop_assert_eq!(dest[i], -9);
                continue;
            }
            let n = (positions[i] + 1).min(win.into()) as usize;
            let slot = i64::from(slots[bids[i] as usize]);
            prop_assert!(indices[begin..end - n].iter().all(|&x| x == -9), "head touched");
            for (k, &row) in indices[end - n..end].iter().enumerate() {
                let pos = positions[i] - n as i64 + 1 + k as i64;
                prop_assert_eq!(i64::from(row), window_row(&w, slot, pos).unwrap());
            }
            prop_assert_eq!(dest[i], indices[end - 1]);
        }
        prop_assert!(indices[*indptr.last().unwrap() as usize..].iter().all(|&x| x == -9));

        // The host backend runs the same reference through raw addresses of its own
        // allocations (it refuses any other address).
        let b = HostBackend::new();
        let put = |bytes: &[u8]| {
            let a = b.alloc_zeroed(bytes.len() as u64).unwrap();
            // SAFETY: `a` holds `bytes.len()` bytes.
            unsafe { b.upload(a.ptr, bytes, Stream::DEFAULT).unwrap() };
            a
        };
        let slots_d = put(bytemuck::cast_slice(&slots));
        let bids_d = put(bytemuck::cast_slice(&bids));
        let positions_d = put(bytemuck::cast_slice(&positions));
        let indptr_d = put(bytemuck::cast_slice(&indptr));
        let again_d = put(bytemuck::cast_slice(&poison));
        let dest_d = put(bytemuck::cast_slice(&vec![-9i32; t]));
        let mut a = DecodeIndexArgs::default().with_state_slot_per_seq(slots_d.ptr).with_batch_id_per_token(bids_d.ptr).with_positions(positions_d.ptr).with_num_tokens(t as i32).with_win(win);
        a.classes[CLASS_CSA] =
            ClassBuffers::default().with_params(w).with_indptr(indptr_d.ptr).with_indices(again_d.ptr).with_dest_rows(dest_d.ptr);
        let mut again = vec![0i32; poison.len()];
        let mut dest2 = vec![0i32; t];
        // SAFETY: every address is a live allocation sized for the launch.
        unsafe {
            b.launch(&Launch::Decode(a), Stream::DEFAULT).unwrap();
            b.download(bytemuck::cast_slice_mut(&mut again), again_d.ptr, Stream::DEFAULT).unwrap();
            b.download(bytemuck::cast_slice_mut(&mut dest2), dest_d.ptr, Stream::DEFAULT).unwrap();
            for d in [slots_d, bids_d, positions_d, indptr_d, again_d, dest_d] {
                b.free(d);
            }
        }
        prop_assert_eq!(again, indices);
        prop_assert_eq!(dest2, dest);
    }
}
