//! The C ABI's version and its structs' sizes: every struct passed by pointer starts with
//! `struct_size`, which the caller sets and the library checks before reading or writing it.

use super::{
    invalid, Fail, V4poolDecodeCapacity, V4poolFlashMla, V4poolFlashMlaWidths, V4poolPageView,
    V4poolPlanInfo, V4poolStatus, V4poolView,
};

/// The version of this C ABI, `V4POOL_ABI_VERSION` in the header (the same number): bumped
/// whenever a struct, an enum or a function's signature changes. 1: the first versioned ABI
/// (`struct_size` in every struct passed by pointer; `V4poolFlashMla`'s per-sequence lengths).
pub const V4POOL_ABI_VERSION: u32 = 1;

/// The ABI version of the library that is loaded (`V4POOL_ABI_VERSION` of the header it was
/// built with). A caller compares it with its own header's `V4POOL_ABI_VERSION` at start-up.
#[no_mangle]
pub extern "C" fn v4pool_abi_version() -> u32 {
    V4POOL_ABI_VERSION
}

/// A struct that crosses the boundary by pointer, in or out: `#[repr(C)]`, its first field
/// `struct_size: u32`, which the caller sets to `sizeof` of the struct as its header declares
/// it (Win32's `cbSize`; a fixed-width `u32` rather than `size_t`, so the field and every offset
/// after it are the same on 32- and 64-bit targets). The library reads and writes only that
/// many bytes, and refuses (`V4POOL_STATUS_ABI_MISMATCH`) a size not in [`SizedStruct::SIZES`].
///
/// Policy: structs grow only at the end; a grown struct keeps its older sizes in `SIZES`, and
/// an input struct of an older size reads the missing tail fields from [`SizedStruct::tail`] (the
/// documented defaults), an output struct of an older size gets only its own fields written.
/// ABI 1 knows one size per struct. Small value types passed by value or in arrays
/// (`V4poolSlot`, `V4poolBlock`, `V4poolBuffer`, `V4poolHash`) carry no size: they are frozen,
/// and a change to one is a new type and a new `V4POOL_ABI_VERSION`.
///
/// # Safety
/// Implementors are `#[repr(C)]`, start with `struct_size: u32`, and every bit pattern of their
/// bytes is a valid value (plain integers only), so a caller's prefix copied over
/// [`SizedStruct::tail`] is a valid value.
pub unsafe trait SizedStruct: Copy {
    /// The name C sees, for messages.
    const NAME: &'static str;
    /// The sizes this library accepts: `size_of::<Self>()` and every older (shorter) size.
    const SIZES: &'static [usize];
    /// The value whose fields past an older caller's size are taken (their defaults).
    fn tail() -> Self;
}

macro_rules! sized {
    ($($t:ident),*) => {$(
        // SAFETY: `#[repr(C)]`, `struct_size: u32` first, integer fields only (see the type).
        unsafe impl SizedStruct for $t {
            const NAME: &'static str = stringify!($t);
            const SIZES: &'static [usize] = &[std::mem::size_of::<$t>()];
            fn tail() -> Self {
                $t { struct_size: std::mem::size_of::<$t>() as u32, ..Default::default() }
            }
        }
    )*};
}
sized!(
    V4poolPlanInfo,
    V4poolView,
    V4poolPageView,
    V4poolDecodeCapacity,
    V4poolFlashMlaWidths,
    V4poolFlashMla
);

/// The `struct_size` at `p` (non-null), checked against `T::SIZES`.
///
/// # Safety
/// `p` is non-null and its first 4 bytes are a readable, properly aligned `u32` (the caller's
/// struct's first field, `struct_size`).
unsafe fn struct_size<T: SizedStruct>(p: *const T) -> Result<usize, Fail> {
    // SAFETY: this function's `# Safety`.
    let size = unsafe { p.cast::<u32>().read() } as usize;
    if T::SIZES.contains(&size) {
        return Ok(size);
    }
    Err((
        V4poolStatus::AbiMismatch,
        "StructSize".into(),
        format!(
            "{}.struct_size is {size}; this library (ABI {V4POOL_ABI_VERSION}) knows {:?}: set it to sizeof({})",
            T::NAME,
            T::SIZES,
            T::NAME
        ),
    ))
}

/// An input struct: the caller's `struct_size` bytes over [`SizedStruct::tail`].
///
/// # Safety
/// `p` is null or points to the caller's `T` (as its header declares it), properly aligned for
/// `T`: its first 4 bytes (`struct_size`) readable, and, where they hold a size in `T::SIZES`,
/// that many bytes from `p` readable and not written during the call (null and the size are
/// checked; nothing else is; nothing past the size is read).
pub(super) unsafe fn read_in<T: SizedStruct>(p: *const T, what: &str) -> Result<T, Fail> {
    if p.is_null() {
        return Err(invalid(&format!("{what} is null")));
    }
    // SAFETY: non-null and this function's `# Safety`: `struct_size` readable, then `size`
    // readable bytes (a checked size, at most `size_of::<T>()`, so within `v`); `T`'s bytes
    // take any pattern (`SizedStruct`'s contract).
    unsafe {
        let size = struct_size(p)?;
        let mut v = T::tail();
        std::ptr::copy_nonoverlapping(p.cast::<u8>(), (&raw mut v).cast::<u8>(), size);
        Ok(v)
    }
}

/// An output struct: `value`'s first `struct_size` bytes (the caller's) written to `p`.
///
/// # Safety
/// `p` is null or points to the caller's `T` (as its header declares it), properly aligned for
/// `T`: its first 4 bytes (`struct_size`) readable, and, where they hold a size in `T::SIZES`,
/// that many bytes from `p` writable and not read or written by anything else during the call
/// (null and the size are checked; nothing else is; nothing past the size is written).
pub(super) unsafe fn write_out<T: SizedStruct>(p: *mut T, what: &str, value: T) -> Result<(), Fail> {
    if p.is_null() {
        return Err(invalid(&format!("{what} is null")));
    }
    // SAFETY: non-null and this function's `# Safety`: `struct_size` readable, then `size`
    // writable bytes; the first field of `value` is its own `struct_size`, which equals the
    // caller's when the size is the current one (an older caller's size is shorter: its bytes
    // are the prefix).
    unsafe {
        let size = struct_size(p)?;
        let mut v = value;
        let head: *mut u32 = (&raw mut v).cast();
        *head = size as u32;
        std::ptr::copy_nonoverlapping((&raw const v).cast::<u8>(), p.cast::<u8>(), size);
    }
    Ok(())
}
