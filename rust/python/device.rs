//! `gpupool.Device`: a backend used directly, with no pooling (the benchmarks' baseline).

use super::error::{poisoned, pool_error, size_arg, value_error, OutOfMemoryError};
use crate::device::{Device, DeviceError, Host, Sim};
use crate::pool::{parse_size, PoolError};
use pyo3::prelude::*;
use std::sync::Mutex;

/// Opens `host`, `sim` or `cuda[:N]` with an optional capacity (`sim` requires one).
pub fn open_device(kind: &str, capacity: Option<u64>) -> PyResult<Box<dyn Device>> {
    open_device_mode(kind, capacity, "direct")
}

/// As [`open_device`]; `mode` is `direct` or, for CUDA only, `async` (the driver's own pool).
pub fn open_device_mode(kind: &str, capacity: Option<u64>, mode: &str) -> PyResult<Box<dyn Device>> {
    if mode != "direct" && !(mode == "async" && kind.starts_with("cuda")) {
        return Err(value_error(format!(
            "unknown mode '{mode}' for device '{kind}': expected 'direct' (or 'async' on CUDA)"
        )));
    }
    if kind.starts_with("cuda") {
        return open_cuda(kind, capacity, mode);
    }
    match kind {
        "host" => Ok(Box::new(Host::new(capacity))),
        "sim" => {
            let capacity =
                capacity.ok_or_else(|| value_error("device 'sim' needs a capacity, e.g. capacity='80GiB'"))?;
            Ok(Box::new(Sim::new(capacity)))
        }
        other => Err(value_error(format!("unknown device '{other}': expected 'host', 'sim' or 'cuda:N'"))),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(kind: &str, capacity: Option<u64>, mode: &str) -> PyResult<Box<dyn Device>> {
    use crate::device::{cuda, Cuda, CudaMode};
    let ordinal =
        cuda::parse_ordinal(kind).unwrap_or_else(|| Err(format!("unknown device '{kind}'"))).map_err(value_error)?;
    let mode = if mode == "async" { CudaMode::Async } else { CudaMode::Direct };
    Ok(Box::new(Cuda::open(ordinal, mode, capacity).map_err(device_error)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(kind: &str, _capacity: Option<u64>, _mode: &str) -> PyResult<Box<dyn Device>> {
    Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
        "cannot open '{kind}': this gpupool was built without the 'cuda' feature"
    )))
}

/// `None`, an int of bytes, or a string such as `"80GiB"`.
pub fn capacity_arg(capacity: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    let Some(value) = capacity.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    let bytes = match value.extract::<String>() {
        Ok(text) => parse_size(&text).map_err(|e| value_error(format!("capacity: {e}")))?,
        Err(_) => size_arg(value, "capacity")?,
    };
    if bytes == 0 {
        return Err(value_error("capacity must be positive"));
    }
    Ok(Some(bytes))
}

pub fn device_error(e: DeviceError) -> PyErr {
    match e {
        DeviceError::OutOfMemory { requested } => {
            OutOfMemoryError::new_err(format!("device refused an allocation of {requested} bytes"))
        }
        other => pool_error(PoolError::Device(other)),
    }
}

#[pyclass(name = "Device", module = "gpupool._native", frozen)]
pub struct PyDevice {
    inner: Mutex<Box<dyn Device>>,
}

#[pymethods]
impl PyDevice {
    /// `mode="async"` on CUDA allocates through `cuMemAllocAsync` (the driver's pool).
    #[new]
    #[pyo3(signature = (kind = "host", capacity = None, mode = "direct"))]
    fn new(py: Python<'_>, kind: &str, capacity: Option<&Bound<'_, PyAny>>, mode: &str) -> PyResult<Self> {
        let capacity = capacity_arg(capacity)?;
        let device = py.detach(|| open_device_mode(kind, capacity, mode))?;
        Ok(PyDevice { inner: Mutex::new(device) })
    }

    fn allocate(&self, py: Python<'_>, size: &Bound<'_, PyAny>) -> PyResult<u64> {
        let size = size_arg(size, "size")?;
        py.detach(|| self.inner.lock().map_err(poisoned)?.allocate(size).map_err(device_error))
    }

    fn release(&self, py: Python<'_>, address: u64) -> PyResult<()> {
        py.detach(|| self.inner.lock().map_err(poisoned)?.release(address).map_err(device_error))
    }
}
