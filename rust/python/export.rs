//! `gpupool.Export`: a live export of an allocation's bytes. While one exists the bytes are
//! neither reused nor unmapped, even if the allocation is freed; NumPy arrays, `View`s and DLPack
//! capsules each hold one.

use super::device_ptr::PyDevicePtr;
use super::dlpack::DataType;
use super::interop;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};

#[pyclass(name = "Export", module = "gpupool._native", frozen)]
pub struct PyExport {
    ptr: Py<PyDevicePtr>,
}

impl PyExport {
    /// Only [`PyDevicePtr::pin`] makes one, after counting it.
    pub fn new(ptr: Py<PyDevicePtr>) -> Self {
        PyExport { ptr }
    }
}

impl Drop for PyExport {
    fn drop(&mut self) {
        Python::attach(|py| {
            let ptr = self.ptr.get();
            if ptr.left_by_fork(py) {
                return;
            }
            if let Err(e) = ptr.unpin(py) {
                // As CPython does for errors in `__del__`.
                e.write_unraisable(py, None);
            }
        });
    }
}

#[pymethods]
impl PyExport {
    /// The allocation exported.
    #[getter]
    fn ptr(&self, py: Python<'_>) -> Py<PyDevicePtr> {
        self.ptr.clone_ref(py)
    }

    /// The bytes as a uint8 array for NumPy (host memory only).
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ptr = self.ptr.get();
        ptr.check_host()?;
        let memory = ptr.memory();
        let d = PyDict::new(py);
        d.set_item("shape", (memory.size,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (memory.address, false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    /// The bytes as a uint8 array for CuPy, Numba and PyTorch (CUDA memory only).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let memory = self.ptr.get().memory();
        memory.cuda_array_interface(py, "|u1", &[memory.size as i64])
    }

    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        interop::dlpack_device(self.ptr.get().memory().shared)
    }

    /// A DLPack capsule of the bytes as uint8; it keeps this export alive until consumed.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let memory = slf.get().ptr.get().memory();
        if copy == Some(true) {
            return Err(PyBufferError::new_err("gpupool exports memory without copying"));
        }
        let device = interop::dlpack_device(memory.shared)?;
        if dl_device.is_some_and(|d| d != device) {
            return Err(PyBufferError::new_err(format!(
                "cannot export memory of '{}' to {dl_device:?}",
                memory.shared.device
            )));
        }
        Self::_dlpack(slf, DataType::BYTE.code, DataType::BYTE.bits, vec![memory.size as i64], stream, max_version)
    }

    /// DLPack export as `shape` elements of type (`code`, `bits`), for `View`.
    #[pyo3(signature = (code, bits, shape, stream = None, max_version = None))]
    fn _dlpack<'py>(
        slf: &Bound<'py, Self>,
        code: u8,
        bits: u8,
        shape: Vec<i64>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let memory = slf.get().ptr.get().memory();
        let owner = slf.clone().into_any().unbind();
        memory.dlpack(slf.py(), owner, DataType { code, bits, lanes: 1 }, shape, stream, max_version)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("Export({})", self.ptr.bind(py).repr()?))
    }
}
