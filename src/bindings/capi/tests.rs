//! The C ABI called from Rust as C would: statuses, out-pointers, the last error.

use super::*;
use std::ptr;

fn last() -> (String, String) {
    // SAFETY: the library's own NUL-terminated thread-local strings.
    unsafe {
        (
            CStr::from_ptr(v4pool_last_error_variant()).to_string_lossy().into_owned(),
            CStr::from_ptr(v4pool_last_error_message()).to_string_lossy().into_owned(),
        )
    }
}

#[test]
fn plan_pool_views_and_errors() {
    // SAFETY: every pointer below is a live local or a handle this test made.
    unsafe {
        let mut plan = ptr::null_mut();
        let st = v4pool_plan_new(c"v4-nope".as_ptr(), 1 << 30, 4, ptr::null(), ptr::null(), 0, &mut plan);
        assert_eq!(st, V4poolStatus::Rejected);
        assert_eq!(last().0, "UnknownPreset");
        assert!(plan.is_null());
        assert_eq!(
            v4pool_plan_new(ptr::null(), 1 << 30, 4, ptr::null(), ptr::null(), 0, &mut plan),
            V4poolStatus::InvalidArgument
        );

        let st = v4pool_plan_new(c"v4-flash".as_ptr(), 256 << 20, 4, ptr::null(), ptr::null(), 0, &mut plan);
        assert_eq!(st, V4poolStatus::Ok, "{:?}", last());
        assert_eq!(last(), (String::new(), String::new()));
        let mut info = V4poolPlanInfo::tail();
        assert_eq!(v4pool_plan_info(plan, &mut info), V4poolStatus::Ok);
        assert_eq!(info.num_slots, 4);
        let mut json = ptr::null_mut();
        assert_eq!(v4pool_plan_json(plan, &mut json), V4poolStatus::Ok);
        let j: serde_json::Value = serde_json::from_str(CStr::from_ptr(json).to_str().unwrap()).unwrap();
        assert_eq!(j["plane_rows"], info.plane_rows);
        v4pool_string_free(json);

        let mut pool = ptr::null_mut();
        assert_eq!(v4pool_pool_new(plan, c"tpu".as_ptr(), 0, 0, &mut pool), V4poolStatus::Rejected);
        assert_eq!(last().0, "UnknownBackendName");
        assert_eq!(
            v4pool_pool_new(plan, c"host".as_ptr(), 0, 0, &mut pool),
            V4poolStatus::Ok,
            "{:?}",
            last()
        );
        let mut view = V4poolView::tail();
        assert_eq!(v4pool_pool_layer_view(pool, 2, 0, &mut view), V4poolStatus::Ok);
        assert_eq!(view.row_bytes, 512);
        assert_eq!(v4pool_pool_layer_view(pool, 2, 7, &mut view), V4poolStatus::Rejected);
        assert_eq!(last().0, "NoSuchPlane");
        assert_eq!(v4pool_pool_plane(pool, 9, &mut view), V4poolStatus::Rejected);

        let mut slot = V4poolSlot::default();
        assert_eq!(v4pool_pool_alloc_slot(pool, &mut slot), V4poolStatus::Ok);
        // Write a byte through the host address of the view, read it back through the pool.
        let mut row = 0i64;
        assert_eq!(v4pool_pool_window_index(pool, 2, slot.position, 5, &mut row), V4poolStatus::Ok);
        assert_eq!(v4pool_pool_layer_view(pool, 2, 0, &mut view), V4poolStatus::Ok);
        let addr = view.ptr + row as u64 * view.row_bytes;
        *(addr as *mut u8) = 0x5A;
        let mut plane0 = V4poolView::tail();
        assert_eq!(v4pool_pool_plane(pool, 0, &mut plane0), V4poolStatus::Ok);
        let mut b = [0u8; 1];
        assert_eq!(v4pool_pool_read_plane(pool, 0, addr - plane0.ptr, b.as_mut_ptr(), 1), V4poolStatus::Ok);
        assert_eq!(b[0], 0x5A);

        v4pool_pool_free(pool);
        v4pool_plan_free(plan);
    }
}

#[test]
fn decode_csa_pack_checks_the_topk() {
    // SAFETY: every pointer below is a live local or a handle this test made.
    unsafe {
        let mut plan = ptr::null_mut();
        let st = v4pool_plan_new(c"v4-flash".as_ptr(), 256 << 20, 4, ptr::null(), ptr::null(), 0, &mut plan);
        assert_eq!(st, V4poolStatus::Ok, "{:?}", last());
        let mut pool = ptr::null_mut();
        assert_eq!(v4pool_pool_new(plan, c"host".as_ptr(), 0, 0, &mut pool), V4poolStatus::Ok);
        let mut slot = V4poolSlot::default();
        assert_eq!(v4pool_pool_alloc_slot(pool, &mut slot), V4poolStatus::Ok);
        let mut block = V4poolBlock::default();
        assert_eq!(v4pool_pool_alloc_block(pool, &mut block), V4poolStatus::Ok);
        let cap = V4poolDecodeCapacity {
            struct_size: size_of::<V4poolDecodeCapacity>() as u32,
            max_seqs: 2,
            max_tokens: 2,
            max_blocks_per_seq: 2,
            win: 128,
            index_topk: 4,
        };
        let mut decode = ptr::null_mut();
        assert_eq!(v4pool_decode_new(pool, &cap, &mut decode), V4poolStatus::Ok, "{:?}", last());
        let mut topk = ptr::null_mut();
        assert_eq!(v4pool_csa_topk_new(pool, 2, 4, &mut topk), V4poolStatus::Ok);
        // One token at position 8 (context 9): the pack reads 2 ids, below (8 + 1) / 4 = 2.
        let (pos, ctx, n, table) = ([slot.position], [9i64], [1i64], [block.id as i32, 0]);
        let mut tokens = 0usize;
        let st = v4pool_decode_stage(
            decode,
            1,
            pos.as_ptr(),
            ctx.as_ptr(),
            n.as_ptr(),
            table.as_ptr(),
            2,
            &mut tokens,
        );
        assert_eq!(st, V4poolStatus::Ok, "{:?}", last());
        assert_eq!(v4pool_decode_build(decode, 0), V4poolStatus::Ok);
        let bad: [i64; 2] = [1, -1];
        assert_eq!(
            v4pool_decode_csa_pack(decode, topk, bad.as_ptr().cast(), 64, 1, 2),
            V4poolStatus::Rejected
        );
        assert_eq!(last().0, "BadId");
        let narrow: [i32; 1] = [0];
        assert_eq!(
            v4pool_decode_csa_pack(decode, topk, narrow.as_ptr().cast(), 32, 1, 1),
            V4poolStatus::Rejected
        );
        assert_eq!(last().0, "TooNarrow");
        assert_eq!(
            v4pool_decode_csa_pack(decode, topk, bad.as_ptr().cast(), 16, 1, 2),
            V4poolStatus::InvalidArgument
        );
        let good: [i64; 2] = [1, 0];
        assert_eq!(
            v4pool_decode_csa_pack(decode, topk, good.as_ptr().cast(), 64, 1, 2),
            V4poolStatus::Ok,
            "{:?}",
            last()
        );
        // The CSA heads are the ids' pool rows: block row 1 and 0 of the block.
        let mut ptrb = V4poolBuffer::default();
        assert_eq!(v4pool_decode_buffer(decode, 1, 1, &mut ptrb), V4poolStatus::Ok);
        let mut idx = V4poolBuffer::default();
        assert_eq!(v4pool_decode_buffer(decode, 0, 1, &mut idx), V4poolStatus::Ok);
        let heads = std::slice::from_raw_parts(idx.ptr as *const i32, 2);
        let r = i64::from(block.id) * (*pool).pool.spec().geometry.envelope_rows;
        assert_eq!(heads, [r as i32 + 1, r as i32]);
        v4pool_csa_topk_free(topk);
        v4pool_decode_free(decode);
        v4pool_pool_free(pool);
        v4pool_plan_free(plan);
    }
}

/// A struct grown by one field (ABI 1 has none yet): its older size reads the new field's
/// default and gets only its own bytes written; a size between the two is refused.
#[test]
fn an_older_struct_size_reads_tail_defaults_and_is_written_only_to_its_size() {
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq)]
    struct Grown {
        struct_size: u32,
        old: u32,
        added: u64,
    }
    // SAFETY: `#[repr(C)]`, `struct_size: u32` first, integers only.
    unsafe impl SizedStruct for Grown {
        const NAME: &'static str = "Grown";
        const SIZES: &'static [usize] = &[8, 16];
        fn tail() -> Self {
            Grown { struct_size: 16, old: 0, added: 99 }
        }
    }
    // An older caller's struct: 8 bytes, then memory that is not its struct (all access through
    // one raw pointer, as C's would be).
    let mut mem: [u64; 2] = [0; 2];
    let bytes: *mut u8 = mem.as_mut_ptr().cast();
    let p: *mut Grown = bytes.cast();
    // SAFETY (every block below): reads and writes within `mem`, aligned.
    unsafe {
        bytes.cast::<u32>().write(8);
        bytes.add(4).cast::<u32>().write(5);
        bytes.add(8).cast::<u64>().write(0xA5A5_A5A5_A5A5_A5A5);
    }
    // SAFETY: `p` is `mem`'s start, aligned for `Grown`, its `struct_size` (8) bytes readable.
    let got = unsafe { read_in(p.cast_const(), "grown") }.unwrap();
    assert_eq!(got, Grown { struct_size: 8, old: 5, added: 99 });
    // SAFETY: as above, writable, no reference to `mem` live.
    unsafe { write_out(p, "grown", Grown { struct_size: 0, old: 6, added: 7 }) }.unwrap();
    unsafe {
        assert_eq!(
            bytes.add(8).cast::<u64>().read(),
            0xA5A5_A5A5_A5A5_A5A5,
            "written past the caller's size"
        );
        assert_eq!((bytes.cast::<u32>().read(), bytes.add(4).cast::<u32>().read()), (8, 6));
        bytes.cast::<u32>().write(12);
    }
    // SAFETY: as above (a refused size reads only `struct_size`).
    let e = unsafe { read_in(p.cast_const(), "grown") }.unwrap_err();
    assert_eq!((e.0, e.1.as_str()), (V4poolStatus::AbiMismatch, "StructSize"));
    assert!(e.2.contains("Grown.struct_size is 12") && e.2.contains("[8, 16]"), "{}", e.2);
}
