//! Module functions about CUDA (`cuda_available`, `device_count`) and the private controls of
//! the C ABI's process-wide pools (`gpupool.torch` and the tests use them).

use super::error::{not_allocated, pool_error, value_error};
use super::pool::PyPool;
use crate::capi::{self, Backend};
use crate::pool::Config;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Whether `cuda:0` can be opened: a CUDA driver recent enough that sees a GPU. Never raises.
#[pyfunction]
fn cuda_available(py: Python<'_>) -> bool {
    py.detach(cuda_usable)
}

/// GPUs the CUDA driver sees; 0 without a usable driver. Never raises.
#[pyfunction]
fn device_count(py: Python<'_>) -> usize {
    #[cfg(feature = "cuda")]
    return py.detach(crate::device::cuda::device_count);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = py;
        0
    }
}

/// `(free, total)` bytes of CUDA device `device` as the driver counts them (`cuMemGetInfo`,
/// `torch.cuda.mem_get_info`): memory that pools cache counts as used.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn cuda_mem_get_info(py: Python<'_>, device: i32) -> PyResult<(u64, u64)> {
    #[cfg(feature = "cuda")]
    return py
        .detach(|| crate::device::cuda::memory_figures(device))
        .map_err(|e| PyRuntimeError::new_err(e.to_string()));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (py, device);
        Err(PyRuntimeError::new_err("this gpupool was built without the 'cuda' feature"))
    }
}

/// The CUDA IPC handle (64 bytes) of the allocation holding `address` in `pool`, and the offset
/// of `address` in it: what Numba's `IpcHandle` carries to another process.
#[pyfunction]
fn _ipc_handle(py: Python<'_>, pool: &PyPool, address: u64) -> PyResult<(Vec<u8>, u64)> {
    pool.shared().lock(py)?.detach(|pool| {
        if !pool.is_allocated(address, 1) {
            return Err(not_allocated(address, 1));
        }
        pool.device_mut().ipc_handle(address).map_err(|e| pool_error(e.into()))
    })
}

fn cuda_usable() -> bool {
    #[cfg(feature = "cuda")]
    return crate::device::cuda::available();
    #[cfg(not(feature = "cuda"))]
    false
}

/// The device `Pool()` uses when none is named.
pub fn default_device() -> &'static str {
    if cuda_usable() {
        "cuda:0"
    } else {
        "host"
    }
}

/// Sets the backend (`"cuda"` or `"host"`) and config of the pools behind `gpupool_alloc`.
#[pyfunction]
fn _capi_configure(py: Python<'_>, backend: &str, config: &str) -> PyResult<()> {
    let backend = match backend {
        "host" => Backend::Host,
        #[cfg(feature = "cuda")]
        "cuda" => Backend::Cuda,
        other => return Err(value_error(format!("unknown C ABI backend '{other}'"))),
    };
    let config = Config::parse(config).map_err(value_error)?;
    // It waits for every device's lock, and the pools it replaces wait for their devices.
    py.detach(|| capi::configure(backend, config)).map_err(PyRuntimeError::new_err)
}

/// The statistics of device `device`'s global pool, or None before its first allocation; a
/// `RuntimeError` when the pools cannot be reached (a forked child).
#[pyfunction]
fn _capi_memory_stats(py: Python<'_>, device: i32) -> PyResult<Option<Bound<'_, PyDict>>> {
    // The device's lock may be held through a long synchronization: wait without the GIL.
    let Some(entries) = py.detach(|| capi::memory_stats(device)).map_err(PyRuntimeError::new_err)? else {
        return Ok(None);
    };
    let dict = PyDict::new(py);
    for (key, value) in entries {
        dict.set_item(key, value)?;
    }
    Ok(Some(dict))
}

/// Returns every global pool's fully free cached segments to the device; returns the bytes.
#[pyfunction]
fn _capi_empty_cache(py: Python<'_>) -> PyResult<u64> {
    py.detach(capi::empty_cache).map_err(PyRuntimeError::new_err)
}

/// Why the last `gpupool_alloc` / `gpupool_free` failed (cleared by reading).
#[pyfunction]
fn _capi_last_error() -> Option<String> {
    capi::take_last_error()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_mem_get_info, m)?)?;
    m.add_function(wrap_pyfunction!(_ipc_handle, m)?)?;
    m.add_function(wrap_pyfunction!(_capi_configure, m)?)?;
    m.add_function(wrap_pyfunction!(_capi_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(_capi_empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(_capi_last_error, m)?)?;
    Ok(())
}
