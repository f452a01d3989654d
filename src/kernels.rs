//! The kernel source and whatever device code `build.rs` could build with the tools it found.
//!
//! [`SOURCE`] is always present: `kernels/v4pool_kernels.cu` with what it includes — the shared
//! header `kernels/v4pool_common.h` and one `kernels/*.cuh` file per kernel family — inlined
//! into one translation unit with no includes (`#line` markers keep each file's name and line
//! numbers in diagnostics), ready for NVRTC or hiprtc. The precompiled objects
//! are present only when the build machine had the compiler (see `build.rs`); a backend loads
//! one if it exists and compiles [`SOURCE`] at run time otherwise.

/// Header and kernel families as one string NVRTC / hiprtc compile without include paths.
pub const SOURCE: &str = include_str!(concat!(env!("OUT_DIR"), "/v4pool_kernels_embedded.cu"));

/// Name to give [`SOURCE`] in run-time compiler diagnostics.
pub const SOURCE_NAME: &str = "v4pool_kernels.cu";

/// The shared header alone, as in the source tree (layout tests parse it).
pub const COMMON_HEADER: &str = include_str!("../kernels/v4pool_common.h");

const CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/v4pool_sm90.cubin"));
const PTX: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/v4pool_sm90.ptx"));
const GFX942: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/v4pool_gfx942.hsaco"));
const GFX90A: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/v4pool_gfx90a.hsaco"));
const BUILD_LOG: &str = include_str!(concat!(env!("OUT_DIR"), "/v4pool_kernel_build.txt"));

fn non_empty(bytes: &'static [u8]) -> Option<&'static [u8]> {
    (!bytes.is_empty()).then_some(bytes)
}

/// sm_90 cubin from nvcc (`-arch=sm_90 -O3 --cubin`), if it was built.
pub fn sm90_cubin() -> Option<&'static [u8]> {
    non_empty(CUBIN)
}

/// sm_90 PTX (nvcc `--ptx`, or clang `--cuda-gpu-arch=sm_90 -S` without nvcc), if built.
/// Not NUL-terminated; add one before handing it to the driver.
pub fn sm90_ptx() -> Option<&'static [u8]> {
    non_empty(PTX)
}

/// gfx942 (MI300) code object, an ELF `hipModuleLoadData` takes, if built.
pub fn gfx942_code_object() -> Option<&'static [u8]> {
    non_empty(GFX942)
}

/// gfx90a (MI200) code object, if built.
pub fn gfx90a_code_object() -> Option<&'static [u8]> {
    non_empty(GFX90A)
}

/// Which precompiled objects this build carries: any of "sm_90.cubin", "sm_90.ptx",
/// "gfx942", "gfx90a".
pub fn built_targets() -> Vec<&'static str> {
    [
        ("sm_90.cubin", sm90_cubin()),
        ("sm_90.ptx", sm90_ptx()),
        ("gfx942", gfx942_code_object()),
        ("gfx90a", gfx90a_code_object()),
    ]
    .into_iter()
    .filter_map(|(name, bytes)| bytes.map(|_| name))
    .collect()
}

/// The kernels compiled as plain C++ (`kernels/v4pool_emulation.cpp`), a shared library
/// exporting `v4pool_emu_launch`, if `build.rs` found a clang: tests run the kernel code itself
/// through it on machines without a GPU. Not a backend.
#[doc(hidden)]
pub fn host_emulation_library() -> Option<&'static std::path::Path> {
    let path = std::path::Path::new(concat!(env!("OUT_DIR"), "/libv4pool_emu.so"));
    path.is_file().then_some(path)
}

/// One line per artifact `build.rs` tried: the command and compiler version, or why not.
pub fn build_log() -> &'static str {
    BUILD_LOG
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Launch;

    #[test]
    fn source_is_one_unit_with_every_symbol() {
        assert!(!SOURCE.contains("#include"), "the embedded source must not need include paths");
        assert!(!SOURCE.contains("#pragma once"));
        assert!(SOURCE.contains("struct DecodeIndexArgs"));
        // Every family file of kernels/ is inlined (a file nothing includes would be dead code
        // the device compilers never see), under its own name for diagnostics.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut families = 0;
        for entry in std::fs::read_dir(&dir).expect("read kernels/") {
            let name = entry.expect("a kernels/ entry").file_name().to_string_lossy().into_owned();
            if name.ends_with(".cuh") {
                families += 1;
                assert!(SOURCE.contains(&format!("#line 1 \"{name}\"\n")), "kernels/{name} is not inlined");
            }
        }
        assert!(families > 0, "no kernel family files found in {}", dir.display());
        for sym in Launch::SYMBOLS {
            assert!(SOURCE.contains(&format!("void {sym}(")), "kernel {sym} missing from the source");
        }
    }

    #[test]
    fn built_objects_are_what_they_claim() {
        if let Some(ptx) = sm90_ptx() {
            let text = String::from_utf8_lossy(ptx);
            assert!(text.contains(".target sm_90"));
            for sym in Launch::SYMBOLS {
                assert!(text.contains(sym), "PTX lacks {sym}");
            }
        }
        for obj in [sm90_cubin(), gfx942_code_object(), gfx90a_code_object()].into_iter().flatten() {
            assert_eq!(&obj[..4], b"\x7fELF");
            for sym in Launch::SYMBOLS {
                assert!(obj.windows(sym.len()).any(|w| w == sym.as_bytes()), "object lacks {sym}");
            }
        }
    }
}
