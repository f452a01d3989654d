//! DLPack export by hand: the C structs of `dlpack.h` (v1.1), and a Python object with
//! `__dlpack__` / `__dlpack_device__` over one region of pool memory, so
//! `torch.from_dlpack` and `numpy.from_dlpack` alias the pool's bytes without a copy.
//!
//! The capsule's `DLManagedTensor` owns a clone of the view's keep-alive handle (the pool,
//! or the index buffers and their pool): a consumer tensor keeps the memory alive after the
//! Python objects that produced it are gone. The capsule destructor runs the deleter only
//! when no consumer renamed the capsule (`used_dltensor`), as the protocol says.

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;
use std::any::Any;
use std::ffi::{c_void, CStr};
use std::sync::Arc;

/// What keeps a view's memory alive (dropped from any thread, GIL or not).
pub type Keep = Arc<dyn Any + Send + Sync>;

pub const DL_CPU: i32 = 1;
/// Page-locked host memory (`kDLCUDAHost`; torch names a pinned CPU tensor's device so):
/// host memory the CPU reads and writes as any other.
pub const DL_CUDA_HOST: i32 = 3;
/// `kDLROCMHost`, ROCm's page-locked host memory.
pub const DL_ROCM_HOST: i32 = 11;
pub const DL_CUDA: i32 = 2;
pub const DL_ROCM: i32 = 10;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

#[repr(C)]
pub struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
pub struct DLPackVersion {
    pub major: u32,
    pub minor: u32,
}

#[repr(C)]
pub struct DLManagedTensorVersioned {
    pub version: DLPackVersion,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    pub flags: u64,
    pub dl_tensor: DLTensor,
}

/// Element types a view hands out (DLPack type codes: int 0, uint 1, float 2, bfloat 4,
/// float8_e4m3fn 10, float8_e4m3fnuz 11 — `kDLFloat8_e4m3fnuz`, which torch exports and
/// imports `float8_e4m3fnuz` as).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    U8,
    I32,
    I64,
    F32,
    Bf16,
    F8E4M3,
    /// gfx942's fp8 (`crate::format::Fp8Elem::E4m3fnuz`).
    F8E4M3Fnuz,
}

impl Elem {
    pub fn size(self) -> u64 {
        match self {
            Elem::U8 | Elem::F8E4M3 | Elem::F8E4M3Fnuz => 1,
            Elem::Bf16 => 2,
            Elem::I32 | Elem::F32 => 4,
            Elem::I64 => 8,
        }
    }
    fn dl(self) -> DLDataType {
        let (code, bits) = match self {
            Elem::U8 => (1, 8),
            Elem::I32 => (0, 32),
            Elem::I64 => (0, 64),
            Elem::F32 => (2, 32),
            Elem::Bf16 => (4, 16),
            Elem::F8E4M3 => (10, 8),
            Elem::F8E4M3Fnuz => (11, 8),
        };
        DLDataType { code, bits, lanes: 1 }
    }
    pub fn name(self) -> &'static str {
        match self {
            Elem::U8 => "uint8",
            Elem::I32 => "int32",
            Elem::I64 => "int64",
            Elem::F32 => "float32",
            Elem::Bf16 => "bfloat16",
            Elem::F8E4M3 => "float8_e4m3fn",
            Elem::F8E4M3Fnuz => "float8_e4m3fnuz",
        }
    }
    pub fn parse(name: &str) -> Option<Elem> {
        [Elem::U8, Elem::I32, Elem::I64, Elem::F32, Elem::Bf16, Elem::F8E4M3, Elem::F8E4M3Fnuz]
            .into_iter()
            .find(|e| e.name() == name)
    }
}

/// The backing of one exported tensor: its shape and strides live here, so the
/// `DLTensor`'s pointers stay valid until the deleter runs.
struct Export {
    shape: Vec<i64>,
    strides: Vec<i64>,
    _keep: Keep,
}

/// A zero-copy view of pool memory: `shape` elements of `elem` with element `strides`.
#[pyclass(module = "v4pool", frozen)]
pub struct DeviceView {
    pub ptr: u64,
    pub elem: Elem,
    pub shape: Vec<i64>,
    pub strides: Vec<i64>,
    pub device: DLDevice,
    pub keep: Keep,
    /// Called before export when the consumer names a stream: makes the producer's queued
    /// work visible (the pool's stream is drained).
    pub sync: Option<Arc<dyn Fn() -> PyResult<()> + Send + Sync>>,
}

impl DeviceView {
    /// A row-major view.
    pub fn contiguous(ptr: u64, elem: Elem, shape: Vec<i64>, device: DLDevice, keep: Keep) -> DeviceView {
        let mut strides = vec![1i64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        DeviceView { ptr, elem, shape, strides, device, keep, sync: None }
    }

    fn tensor(&self, export: &Export) -> DLTensor {
        DLTensor {
            data: self.ptr as *mut c_void,
            device: self.device,
            ndim: export.shape.len() as i32,
            dtype: self.elem.dl(),
            shape: export.shape.as_ptr() as *mut i64,
            strides: export.strides.as_ptr() as *mut i64,
            byte_offset: 0,
        }
    }
}

unsafe extern "C" fn delete_legacy(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its context were made by `Box::into_raw` in `__dlpack__` and the
    // protocol calls the deleter once.
    unsafe {
        drop(Box::from_raw((*m).manager_ctx as *mut Export));
        drop(Box::from_raw(m));
    }
}

unsafe extern "C" fn delete_versioned(m: *mut DLManagedTensorVersioned) {
    if m.is_null() {
        return;
    }
    // SAFETY: as `delete_legacy`.
    unsafe {
        drop(Box::from_raw((*m).manager_ctx as *mut Export));
        drop(Box::from_raw(m));
    }
}

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";

/// Capsule destructor: a capsule still named `dltensor[_versioned]` was never consumed, so
/// its tensor is ours to delete; a consumed one was renamed and the consumer deletes it.
unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the capsule; the pointer checks match the name we gave.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let m = pyo3::ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = (*m).deleter {
                d(m);
            }
        } else if pyo3::ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let m =
                pyo3::ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr()) as *mut DLManagedTensorVersioned;
            if let Some(d) = (*m).deleter {
                d(m);
            }
        }
        // A failed check set an error; a destructor must not leave one behind.
        pyo3::ffi::PyErr_Clear();
    }
}

#[pymethods]
impl DeviceView {
    /// Export as a DLPack capsule (versioned when the consumer asks for DLPack ≥ 1.0).
    #[pyo3(signature = (stream=None, *, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        if copy == Some(true) {
            return Err(PyBufferError::new_err("v4pool views are zero-copy; copy=True is not supported"));
        }
        if let Some((t, id)) = dl_device {
            if t != self.device.device_type || id != self.device.device_id {
                return Err(PyBufferError::new_err("v4pool views export on their own device only"));
            }
        }
        // A named stream (not None, not -1 "no sync") must see the pool's queued writes.
        let wants_sync = match &stream {
            None => false,
            Some(s) => s.extract::<i64>().map_or(true, |v| v != -1),
        };
        if wants_sync {
            if let Some(sync) = &self.sync {
                sync()?;
            }
        }
        let export = Box::new(Export {
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            _keep: self.keep.clone(),
        });
        let dl_tensor = self.tensor(&export);
        let ctx = Box::into_raw(export) as *mut c_void;
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        // SAFETY: the capsule takes ownership of the boxed tensor; `capsule_destructor` or the
        // consumer frees it exactly once through the deleter.
        let capsule = unsafe {
            if versioned {
                let m = Box::into_raw(Box::new(DLManagedTensorVersioned {
                    version: DLPackVersion { major: 1, minor: 1 },
                    manager_ctx: ctx,
                    deleter: Some(delete_versioned),
                    flags: 0,
                    dl_tensor,
                }));
                pyo3::ffi::PyCapsule_New(m.cast(), VERSIONED.as_ptr(), Some(capsule_destructor))
            } else {
                let m = Box::into_raw(Box::new(DLManagedTensor {
                    dl_tensor,
                    manager_ctx: ctx,
                    deleter: Some(delete_legacy),
                }));
                pyo3::ffi::PyCapsule_New(m.cast(), LEGACY.as_ptr(), Some(capsule_destructor))
            }
        };
        if capsule.is_null() {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: a new reference returned by PyCapsule_New.
        Ok(unsafe { Py::from_owned_ptr(py, capsule) })
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (self.device.device_type, self.device.device_id)
    }

    /// Device (or host) address of element 0.
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.shape.clone()
    }
    /// Element strides.
    #[getter]
    fn strides(&self) -> Vec<i64> {
        self.strides.clone()
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.elem.name()
    }
    /// Bytes from element 0 to one past the last element.
    #[getter]
    fn nbytes(&self) -> u64 {
        let last: i64 = self.shape.iter().zip(&self.strides).map(|(&d, &s)| (d - 1).max(0) * s).sum();
        if self.shape.contains(&0) {
            0
        } else {
            (last as u64 + 1) * self.elem.size()
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "DeviceView(ptr={:#x}, shape={:?}, dtype={}, device={:?})",
            self.ptr,
            self.shape,
            self.elem.name(),
            self.__dlpack_device__()
        )
    }
}

/// Reinterpret rows of `row_bytes` as elements of `elem`: `[rows, row_bytes / size]`.
pub fn row_shape(rows: i64, row_bytes: u64, elem: Elem) -> PyResult<Vec<i64>> {
    if row_bytes % elem.size() != 0 {
        return Err(PyValueError::new_err(format!(
            "{row_bytes}-byte rows do not hold whole {} elements",
            elem.name()
        )));
    }
    Ok(vec![rows, (row_bytes / elem.size()) as i64])
}

/// Most dimensions an imported tensor may have (a guard on the producer's `ndim`).
const MAX_IMPORT_DIMS: i32 = 64;

/// Memory an engine hands in, proven by its producer through DLPack: `obj.__dlpack__()`
/// must return a legacy `dltensor` capsule on `device`, C-contiguous (compact strides),
/// whose extent is computed with checked arithmetic. Returns `(address, bytes, capsule)`:
/// the capsule is not consumed, so holding it keeps the producer's memory alive and its own
/// destructor releases it. No address a Python object merely states (`data_ptr()`,
/// `__array_interface__`) is accepted.
pub fn import_region(obj: &Bound<'_, PyAny>, device: DLDevice) -> PyResult<(u64, u64, Py<PyAny>)> {
    use pyo3::exceptions::PyTypeError;
    if !obj.hasattr("__dlpack__")? {
        return Err(PyTypeError::new_err(
            "pool memory must come through DLPack (a torch tensor or a writable numpy array)",
        ));
    }
    let capsule = obj.call_method0("__dlpack__")?;
    let raw = capsule.as_ptr();
    // SAFETY: `raw` is a live object (held by `capsule`); PyCapsule_IsValid accepts any
    // object and only reads it, setting no error.
    if unsafe { pyo3::ffi::PyCapsule_IsValid(raw, LEGACY.as_ptr()) } != 1 {
        return Err(PyTypeError::new_err("__dlpack__ did not return an unconsumed dltensor capsule"));
    }
    // SAFETY: checked valid under this name just above.
    let m = unsafe { pyo3::ffi::PyCapsule_GetPointer(raw, LEGACY.as_ptr()) } as *const DLManagedTensor;
    if m.is_null() {
        return Err(PyTypeError::new_err("the dltensor capsule holds no tensor"));
    }
    // SAFETY: a valid `dltensor` capsule points at its producer's DLManagedTensor, live while
    // the capsule is (we hold it and consume nothing); `shape` / `strides` hold `ndim`
    // entries when not null, as the protocol requires of its producers.
    let t = unsafe { &(*m).dl_tensor };
    if t.device.device_type != device.device_type || t.device.device_id != device.device_id {
        return Err(PyValueError::new_err(format!(
            "the memory is on DLPack device ({}, {}), the pool's backend on ({}, {})",
            t.device.device_type, t.device.device_id, device.device_type, device.device_id
        )));
    }
    if !(0..=MAX_IMPORT_DIMS).contains(&t.ndim) || (t.ndim > 0 && t.shape.is_null()) {
        return Err(PyValueError::new_err(format!("a tensor of {} dimensions", t.ndim)));
    }
    let ndim = t.ndim as usize;
    // SAFETY: see above: `ndim` entries, non-null when ndim > 0.
    let shape: &[i64] = if ndim == 0 { &[] } else { unsafe { std::slice::from_raw_parts(t.shape, ndim) } };
    let strides: Option<&[i64]> =
        // SAFETY: as for `shape`.
        (!t.strides.is_null() && ndim > 0).then(|| unsafe { std::slice::from_raw_parts(t.strides, ndim) });
    let too_large = || PyValueError::new_err("the tensor's extent overflows 64 bits");
    if t.dtype.bits == 0 || t.dtype.bits % 8 != 0 || t.dtype.lanes == 0 {
        return Err(PyValueError::new_err(format!(
            "dtype of {} bits x {} lanes",
            t.dtype.bits, t.dtype.lanes
        )));
    }
    let elem = u64::from(t.dtype.bits / 8) * u64::from(t.dtype.lanes);
    let mut numel = 1u64;
    for &d in shape {
        let d = u64::try_from(d).map_err(|_| PyValueError::new_err("a negative dimension"))?;
        numel = numel.checked_mul(d).ok_or_else(too_large)?;
    }
    // Compact row-major strides (in elements), a size-1 dimension's stride being free.
    if let Some(st) = strides {
        let mut want = 1i64;
        for (&d, &s) in shape.iter().zip(st).rev() {
            if d != 1 && s != want {
                return Err(PyValueError::new_err("the memory backing a pool must be C-contiguous"));
            }
            want = want.checked_mul(d.max(1)).ok_or_else(too_large)?;
        }
    }
    let bytes = numel.checked_mul(elem).ok_or_else(too_large)?;
    let addr = (t.data as u64).checked_add(t.byte_offset).ok_or_else(too_large)?;
    if addr.checked_add(bytes).is_none() || (bytes > 0 && t.data.is_null()) {
        return Err(too_large());
    }
    Ok((addr, bytes, capsule.unbind()))
}
