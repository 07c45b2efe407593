//! `gpupool.DevicePtr`: one allocation; it keeps its pool alive and frees itself when dropped.

use super::dlpack::DataType;
use super::error::{pool_error, size_arg, value_error};
use super::interop;
use super::pool::Shared;
use super::stream::PyStream;
use crate::core::Handle;
use crate::pool::Allocation;
use pyo3::exceptions::{PyAttributeError, PyBufferError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule, PyDict};
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

    /// Marks this allocation as used on `stream` (see `Pool.record_stream`).
    pub fn record_stream(&self, stream: &PyStream) -> PyResult<()> {
        let id = stream.id_for(&self.shared)?;
        let mut pool = self.shared.lock()?;
        self.check_live()?;
        match self.handle {
            Some(handle) => pool.record_stream(handle, id).map_err(pool_error),
            None => Ok(()),
        }
    }

    fn check_live(&self) -> PyResult<()> {
        if self.freed.load(Ordering::Acquire) {
            return Err(value_error(format!("DevicePtr {:#x} was freed", self.address)));
        }
        Ok(())
    }

    fn export<'py>(
        slf: &Bound<'py, Self>,
        dtype: DataType,
        shape: Vec<i64>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let this = slf.get();
        this.check_live()?;
        this.memory().dlpack(slf.py(), slf.clone().into_any().unbind(), dtype, shape, stream, max_version)
    }

    fn memory(&self) -> interop::Memory<'_> {
        interop::Memory { shared: &self.shared, address: self.address, size: self.size, handle: self.handle }
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

    #[pyo3(name = "record_stream")]
    fn py_record_stream(&self, stream: &PyStream) -> PyResult<()> {
        self.record_stream(stream)
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

    /// A zero-copy uint8 view for CuPy, Numba and PyTorch (CUDA memory only).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check_live()?;
        self.memory().cuda_array_interface(py, "|u1", &[self.size as i64])
    }

    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        interop::dlpack_device(&self.shared)
    }

    /// A DLPack capsule of the bytes; it keeps this pointer (and its memory) alive.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let this = slf.get();
        if copy == Some(true) {
            return Err(PyBufferError::new_err("gpupool exports memory without copying"));
        }
        if dl_device.is_some_and(|d| d != interop::dlpack_device(&this.shared).unwrap_or((-1, -1))) {
            return Err(PyBufferError::new_err(format!(
                "cannot export memory of '{}' to {dl_device:?}",
                this.shared.device
            )));
        }
        Self::export(slf, DataType::BYTE, vec![this.size as i64], stream, max_version)
    }

    /// DLPack export as `shape` elements of type (`code`, `bits`), for `view`.
    #[pyo3(signature = (code, bits, shape, stream = None, max_version = None))]
    fn _dlpack<'py>(
        slf: &Bound<'py, Self>,
        code: u8,
        bits: u8,
        shape: Vec<i64>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        Self::export(slf, DataType { code, bits, lanes: 1 }, shape, stream, max_version)
    }

    /// The memory as `shape` elements of `dtype`, with the array protocols (see `gpupool.View`).
    #[pyo3(signature = (dtype, shape = None))]
    fn view<'py>(
        slf: &Bound<'py, Self>,
        dtype: &Bound<'py, PyAny>,
        shape: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        slf.py().import("gpupool._view")?.getattr("View")?.call1((slf, dtype, shape))
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
        let handle = self.handle.ok_or_else(|| value_error("an empty allocation holds no bytes"))?;
        pool.write(handle, offset, &bytes).map_err(|e| value_error(e.to_string()))
    }

    fn copy_to_host<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        PyBytes::new_with(py, self.size as usize, |out| {
            if out.is_empty() {
                return self.check_live();
            }
            let pool = self.shared.lock()?;
            self.check_live()?;
            let handle = self.handle.ok_or_else(|| value_error("an empty allocation holds no bytes"))?;
            pool.read(handle, 0, out).map_err(|e| value_error(e.to_string()))
        })
    }
}
