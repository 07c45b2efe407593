//! `gpupool.DevicePtr`: one allocation; it keeps its pool alive and frees itself when dropped.

use super::error::{pool_error, size_arg, value_error};
use super::pool::Shared;
use crate::core::Handle;
use crate::pool::Allocation;
use pyo3::exceptions::PyAttributeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[pyclass(name = "DevicePtr", module = "gpupool._native", frozen)]
pub struct PyDevicePtr {
    shared: Arc<Shared>,
    address: u64,
    size: u64,
    /// `None` for zero-size allocations, which own no block.
    handle: Option<Handle>,
    freed: AtomicBool,
}

impl PyDevicePtr {
    pub fn new(shared: Arc<Shared>, a: Allocation) -> Self {
        PyDevicePtr { shared, address: a.address, size: a.size, handle: Some(a.handle), freed: AtomicBool::new(false) }
    }

    pub fn empty(shared: Arc<Shared>) -> Self {
        PyDevicePtr { shared, address: 0, size: 0, handle: None, freed: AtomicBool::new(false) }
    }

    pub fn belongs_to(&self, shared: &Arc<Shared>) -> bool {
        Arc::ptr_eq(&self.shared, shared)
    }

    /// Frees once; the flag flips before the pool lock is taken, so a racing second free fails.
    pub fn release(&self) -> PyResult<()> {
        if self.freed.swap(true, Ordering::AcqRel) {
            return Err(value_error(format!("double free of DevicePtr {:#x}", self.address)));
        }
        match self.handle {
            Some(handle) => self.shared.lock()?.free(handle).map_err(pool_error),
            None => Ok(()),
        }
    }

    fn check_live(&self) -> PyResult<()> {
        if self.freed.load(Ordering::Acquire) {
            return Err(value_error(format!("DevicePtr {:#x} was freed", self.address)));
        }
        Ok(())
    }

    fn check_host(&self) -> PyResult<()> {
        if !self.shared.host_accessible {
            return Err(PyAttributeError::new_err(format!(
                "memory on device '{}' is not host-accessible",
                self.shared.device
            )));
        }
        Ok(())
    }
}

impl Drop for PyDevicePtr {
    fn drop(&mut self) {
        if !self.freed.load(Ordering::Acquire) {
            // Errors cannot surface from a destructor; the pool stays consistent either way.
            let _ = self.release();
        }
    }
}

/// Bytes of any buffer-protocol object (bytes, bytearray, numpy arrays, memoryviews).
fn buffer_bytes(data: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(bytes) = data.cast::<PyBytes>() {
        return Ok(bytes.as_bytes().to_vec());
    }
    let view = data.py().import("builtins")?.getattr("memoryview")?.call1((data,))?;
    Ok(view.call_method0("tobytes")?.cast_into::<PyBytes>()?.as_bytes().to_vec())
}

#[pymethods]
impl PyDevicePtr {
    #[getter]
    fn ptr(&self) -> u64 {
        self.address
    }

    fn __int__(&self) -> u64 {
        self.address
    }

    fn __index__(&self) -> u64 {
        self.address
    }

    /// Requested bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }

    #[getter]
    fn device(&self) -> &str {
        &self.shared.device
    }

    #[getter]
    fn freed(&self) -> bool {
        self.freed.load(Ordering::Acquire)
    }

    fn free(&self) -> PyResult<()> {
        self.release()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyAny>) -> PyResult<()> {
        if self.freed() {
            return Ok(());
        }
        self.release()
    }

    fn __repr__(&self) -> String {
        let state = if self.freed() { ", freed" } else { "" };
        format!("DevicePtr({:#x}, size={}, device='{}'{state})", self.address, self.size, self.shared.device)
    }

    /// A zero-copy uint8 view for numpy (host memory only).
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check_host()?;
        self.check_live()?;
        let d = PyDict::new(py);
        d.set_item("shape", (self.size,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.address, false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    #[pyo3(signature = (data, offset = None))]
    fn copy_from_host(&self, data: &Bound<'_, PyAny>, offset: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let offset = offset.map_or(Ok(0), |o| size_arg(o, "offset"))?;
        let bytes = buffer_bytes(data)?;
        let end = offset.checked_add(bytes.len() as u64);
        if end.is_none_or(|end| end > self.size) {
            return Err(value_error(format!(
                "{} bytes at offset {offset} do not fit in an allocation of {} bytes",
                bytes.len(),
                self.size
            )));
        }
        if bytes.is_empty() {
            return self.check_live();
        }
        // Checking `freed` under the pool lock orders it with a concurrent free.
        let mut pool = self.shared.lock()?;
        self.check_live()?;
        pool.device_mut().write(self.address + offset, &bytes).map_err(|e| value_error(e.to_string()))
    }

    fn copy_to_host<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        PyBytes::new_with(py, self.size as usize, |out| {
            if out.is_empty() {
                return self.check_live();
            }
            let pool = self.shared.lock()?;
            self.check_live()?;
            pool.device().read(self.address, out).map_err(|e| value_error(e.to_string()))
        })
    }
}
