//! Tensor arguments from Python: a `torch.Tensor` read through torch's own DLPack export
//! (`torch.utils.dlpack.to_dlpack`, which a subclass cannot override), its device, dtype,
//! shape and strides checked before any library call sees its address.

use super::dlpack::{DLDevice, DLManagedTensor, DL_CPU, DL_CUDA_HOST, DL_ROCM_HOST};
use super::error;
use pyo3::prelude::*;

/// DLPack type codes.
pub const DL_INT: u8 = 0;
/// bfloat16's DLPack type code.
pub const DL_BFLOAT: u8 = 4;
/// IEEE float's DLPack type code.
const DL_FLOAT: u8 = 2;

/// The state update's element type of a DLPack `(code, bits)`: float32 or bfloat16.
pub fn elem_type_from_dlpack(code: u8, bits: u8) -> Option<crate::index::ElemType> {
    match (code, bits) {
        (DL_FLOAT, 32) => Some(crate::index::ElemType::F32),
        (DL_BFLOAT, 16) => Some(crate::index::ElemType::Bf16),
        _ => None,
    }
}

/// A tensor argument as torch describes it; `_capsule` keeps torch's export (and so the
/// memory) alive while the call uses the address.
pub struct Tensor<'py> {
    _capsule: Bound<'py, PyAny>,
    pub ptr: u64,
    pub device: DLDevice,
    pub code: u8,
    pub bits: u8,
    pub shape: Vec<i64>,
    pub strides: Vec<i64>,
}

fn bad(name: &str, what: String) -> PyErr {
    error("BadTensor", format!("{name}: {what}"))
}

/// Read `obj` (must be a `torch.Tensor`) as its DLPack description.
pub fn tensor<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Tensor<'py>> {
    let py = obj.py();
    let cls = py.import("torch")?.getattr("Tensor")?;
    if !obj.is_instance(&cls)? {
        return Err(bad(name, format!("expected a torch.Tensor, got {}", obj.get_type().name()?)));
    }
    let capsule = py.import("torch.utils.dlpack")?.call_method1("to_dlpack", (obj,))?;
    // SAFETY: `capsule` is the object torch's to_dlpack returned; PyCapsule_GetPointer checks it
    // is a capsule named "dltensor" and returns null (with an exception set) otherwise.
    let m = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr()) }
        as *const DLManagedTensor;
    if m.is_null() {
        return Err(PyErr::take(py).unwrap_or_else(|| bad(name, "torch exported no DLPack tensor".into())));
    }
    // SAFETY: a live DLManagedTensor owned by the capsule, which we hold; its shape and
    // strides arrays have `ndim` entries (DLPack), strides may be null (row-major).
    let (t, shape, strides) = unsafe {
        let t = &(*m).dl_tensor;
        let ndim = usize::try_from(t.ndim).map_err(|_| bad(name, format!("ndim {}", t.ndim)))?;
        let shape = if ndim == 0 { Vec::new() } else { std::slice::from_raw_parts(t.shape, ndim).to_vec() };
        let strides = if t.strides.is_null() || ndim == 0 {
            let mut s = vec![1i64; ndim];
            for i in (0..ndim.saturating_sub(1)).rev() {
                s[i] = s[i + 1] * shape[i + 1];
            }
            s
        } else {
            std::slice::from_raw_parts(t.strides, ndim).to_vec()
        };
        (t, shape, strides)
    };
    if t.dtype.lanes != 1 {
        return Err(bad(name, format!("{} lanes", t.dtype.lanes)));
    }
    let ptr =
        (t.data as u64).checked_add(t.byte_offset).ok_or_else(|| bad(name, "address overflows".into()))?;
    Ok(Tensor {
        ptr,
        device: t.device,
        code: t.dtype.code,
        bits: t.dtype.bits,
        shape,
        strides,
        _capsule: capsule,
    })
}

impl Tensor<'_> {
    /// A 2-D row-major tensor `[rows][>= min_cols]` with unit inner stride and a row stride
    /// covering the columns; returns `(rows, cols, row_stride)`.
    pub fn rows(&self, name: &str, code: u8, bits: u8, min_cols: i64) -> PyResult<(usize, usize, usize)> {
        if (self.code, self.bits) != (code, bits) {
            return Err(bad(
                name,
                format!("dtype code {} bits {}, expected code {code} bits {bits}", self.code, self.bits),
            ));
        }
        let [rows, cols] = self.shape[..] else {
            return Err(bad(name, format!("shape {:?}, expected 2-D", self.shape)));
        };
        if cols < min_cols || rows < 0 {
            return Err(bad(name, format!("shape {:?}, expected [rows, >= {min_cols}]", self.shape)));
        }
        if rows > 0 && (self.strides[1] != 1 || (rows > 1 && self.strides[0] < cols)) {
            return Err(bad(name, format!("strides {:?}: rows must be contiguous", self.strides)));
        }
        let stride = if rows > 1 { self.strides[0] } else { cols };
        Ok((rows as usize, cols as usize, stride as usize))
    }

    /// A row-major contiguous tensor of exactly `shape` and element type (`code`, `bits`);
    /// strides of dimensions of size 1 are not looked at (torch leaves them arbitrary).
    /// Returns its length in bytes.
    pub fn contiguous(&self, name: &str, code: u8, bits: u8, shape: &[i64]) -> PyResult<u64> {
        if (self.code, self.bits) != (code, bits) {
            return Err(bad(
                name,
                format!("dtype code {} bits {}, expected code {code} bits {bits}", self.code, self.bits),
            ));
        }
        if self.shape != shape {
            return Err(bad(name, format!("shape {:?}, expected {shape:?}", self.shape)));
        }
        let mut want = 1i64;
        for (d, (&n, &s)) in self.shape.iter().zip(&self.strides).enumerate().rev() {
            if n != 1 && s != want {
                return Err(bad(
                    name,
                    format!("strides {:?}: dimension {d} is not contiguous", self.strides),
                ));
            }
            want = want.checked_mul(n).ok_or_else(|| bad(name, "size overflows".into()))?;
        }
        u64::try_from(want)
            .ok()
            .and_then(|n| n.checked_mul(u64::from(bits) / 8))
            .ok_or_else(|| bad(name, format!("shape {shape:?}")))
    }

    /// The elements of a `rows()`-checked CPU tensor as a slice (`(rows − 1) × stride + cols`).
    ///
    /// # Safety
    /// `T` is the element type `rows()` checked; the slice must not outlive `self` (which keeps
    /// torch's export alive) nor a Python call that could resize or free the tensor.
    pub unsafe fn host_slice<T>(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        stride: usize,
    ) -> PyResult<&[T]> {
        // Host memory, pageable or page-locked (a pinned tensor may say `kDLCUDAHost`).
        if !matches!(self.device.device_type, DL_CPU | DL_CUDA_HOST | DL_ROCM_HOST) {
            return Err(bad(name, format!("device type {} is not the CPU", self.device.device_type)));
        }
        let len = if rows == 0 { 0 } else { (rows - 1) * stride + cols };
        if len == 0 {
            return Ok(&[]);
        }
        if self.ptr == 0 || self.ptr % std::mem::align_of::<T>() as u64 != 0 {
            return Err(bad(name, format!("address {:#x} is not aligned", self.ptr)));
        }
        // SAFETY: torch describes `len` elements of T from `ptr` (shape and strides checked),
        // alive while the capsule is; the caller bounds the lifetime.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as usize as *const T, len) })
    }

    /// As [`Self::host_slice`], writable.
    ///
    /// # Safety
    /// As [`Self::host_slice`]; nothing else may read or write the elements while the slice
    /// lives (the caller holds the GIL and hands the slice to no other thread).
    #[allow(clippy::mut_from_ref)] // the memory is torch's, not `self`'s
    pub unsafe fn host_slice_mut<T>(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        stride: usize,
    ) -> PyResult<&mut [T]> {
        // SAFETY: forwarded; only its checks (device, alignment) and length are used.
        let len = unsafe { self.host_slice::<T>(name, rows, cols, stride)? }.len();
        if len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: torch describes `len` elements of T from `ptr` (checked above), alive while the
        // capsule is, which torch lets us write (a tensor argument we hold); no other reference
        // to them exists during the caller's use (its contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as usize as *mut T, len) })
    }
}
