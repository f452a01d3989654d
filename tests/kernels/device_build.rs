//! What build.rs embedded. CI sets `V4POOL_REQUIRE_DEVICE_BUILD=1` after installing nvcc 13.0
//! and clang-19, so there this test proves the one kernel source compiled for sm_90 (cubin
//! and PTX) and for gfx942 and gfx90a; elsewhere it reports what was built.

use v4pool::raw::index::Launch;
use v4pool::raw::kernels;

fn required() -> bool {
    std::env::var("V4POOL_REQUIRE_DEVICE_BUILD").is_ok_and(|v| v == "1")
}

#[test]
fn device_code_was_built_for_every_target() {
    let built = kernels::built_targets();
    println!("embedded device code: {built:?}");
    if !required() {
        println!("NOTE: V4POOL_REQUIRE_DEVICE_BUILD is not 1; not requiring device compiles");
        return;
    }
    let cubin = kernels::sm90_cubin().unwrap_or_else(|| panic!("no sm_90 cubin:\n{}", kernels::build_log()));
    let ptx = kernels::sm90_ptx().unwrap_or_else(|| panic!("no sm_90 PTX:\n{}", kernels::build_log()));
    let gfx942 = kernels::gfx942_code_object()
        .unwrap_or_else(|| panic!("no gfx942 object:\n{}", kernels::build_log()));
    let gfx90a = kernels::gfx90a_code_object()
        .unwrap_or_else(|| panic!("no gfx90a object:\n{}", kernels::build_log()));
    // Every kernel symbol is in the PTX (text) and the cubin (ELF string table).
    let ptx = String::from_utf8_lossy(ptx);
    assert!(ptx.contains(".target sm_90"), "PTX is not for sm_90");
    for sym in Launch::SYMBOLS {
        assert!(ptx.contains(&format!(".entry {sym}")), "PTX lacks {sym}");
        for (name, obj) in [("sm_90 cubin", cubin), ("gfx942", gfx942), ("gfx90a", gfx90a)] {
            assert!(obj.windows(sym.len()).any(|w| w == sym.as_bytes()), "{name} lacks {sym}");
        }
    }
    // Code objects are ELF files.
    for obj in [cubin, gfx942, gfx90a] {
        assert_eq!(&obj[..4], b"\x7fELF");
    }
}
