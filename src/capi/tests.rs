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
        let mut info = V4poolPlanInfo::default();
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
        let mut view = V4poolView::default();
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
        let mut plane0 = V4poolView::default();
        assert_eq!(v4pool_pool_plane(pool, 0, &mut plane0), V4poolStatus::Ok);
        let mut b = [0u8; 1];
        assert_eq!(v4pool_pool_read_plane(pool, 0, addr - plane0.ptr, b.as_mut_ptr(), 1), V4poolStatus::Ok);
        assert_eq!(b[0], 0x5A);

        v4pool_pool_free(pool);
        v4pool_plan_free(plan);
    }
}
