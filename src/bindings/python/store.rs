//! A Python object as the shared tier's key-value store ([`KvStore`]): what
//! `KvManager.set_shared_store` installs, `v4pool.mooncake.MooncakeStore` (over Mooncake's
//! `MooncakeDistributedStore`) being the one the package ships. The protocol, each call
//! raising on a store error (the manager counts it and misses):
//! `register_buffer(addr, size)`, `unregister_buffer(addr)`, `exist(keys) -> list[bool]`,
//! `size(key) -> int | None`, `put(key, addr, size)`, `get_into(key, addr, size)` (the whole
//! value, exactly `size` bytes), `remove(key) -> bool`. Addresses are the tier's staging
//! buffer, registered first; the object must touch no byte outside `[addr, addr + size)`.
//! `unregister_buffer` raising an `OSError` with errno EBUSY says a call it gave up on may
//! still touch the buffer: the tier then never frees it.

use crate::transfer::KvStore;
use pyo3::prelude::*;
use std::io;

/// Linux's EBUSY, what `v4pool.mooncake.MooncakeBufferBusy` carries.
const EBUSY: i32 = 16;

/// The Python object behind a [`KvStore`].
pub(super) struct PyStore {
    obj: Py<PyAny>,
}

impl PyStore {
    pub(super) fn new(obj: Py<PyAny>) -> PyStore {
        PyStore { obj }
    }

    /// `self.obj.<method>(args)` with the GIL (the manager's calls run without it).
    fn call<T>(
        &self,
        method: &str,
        args: impl for<'py> pyo3::call::PyCallArgs<'py>,
        out: impl for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
    ) -> io::Result<T> {
        Python::attach(|py| {
            let r = self.obj.bind(py).call_method1(method, args).and_then(|r| out(&r));
            r.map_err(|e| {
                // EBUSY (`MooncakeBufferBusy`): the store may still touch the buffer; the tier
                // must keep it (`KvStore::unregister_buffer`). Every other error is a miss.
                let busy = e.is_instance_of::<pyo3::exceptions::PyOSError>(py)
                    && e.value(py).getattr("errno").and_then(|n| n.extract::<i32>()).ok() == Some(EBUSY);
                let kind = if busy { io::ErrorKind::ResourceBusy } else { io::ErrorKind::Other };
                io::Error::new(kind, format!("{method}: {e}"))
            })
        })
    }
}

impl std::fmt::Debug for PyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PyStore")
    }
}

impl KvStore for PyStore {
    fn register_buffer(&self, addr: u64, len: u64) -> io::Result<()> {
        self.call("register_buffer", (addr, len), |_| Ok(()))
    }
    fn unregister_buffer(&self, addr: u64) -> io::Result<()> {
        self.call("unregister_buffer", (addr,), |_| Ok(()))
    }
    fn exist(&self, keys: &[String]) -> io::Result<Vec<bool>> {
        self.call("exist", (keys.to_vec(),), |r| r.extract())
    }
    fn size(&self, key: &str) -> io::Result<Option<u64>> {
        self.call("size", (key,), |r| r.extract())
    }
    fn put(&self, key: &str, data: &[u8]) -> io::Result<()> {
        self.call("put", (key, data.as_ptr() as u64, data.len() as u64), |_| Ok(()))
    }
    fn get_into(&self, key: &str, dst: &mut [u8]) -> io::Result<()> {
        self.call("get_into", (key, dst.as_mut_ptr() as u64, dst.len() as u64), |_| Ok(()))
    }
    fn remove(&self, key: &str) -> io::Result<bool> {
        self.call("remove", (key,), |r| r.extract())
    }
}
