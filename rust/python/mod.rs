//! The Python extension `gpupool._native`: one file per class, no algorithm.

mod advise;
mod cuda;
mod device;
mod device_ptr;
mod dlpack;
mod error;
mod export;
mod gil_lock;
mod interop;
#[cfg(feature = "cuda")]
mod ipc;
mod pickle;
mod pool;
mod replay;
mod stream;
mod trace;

use pyo3::prelude::*;

/// `gil_used`: the pool's lock ([`gil_lock::GilLock`]) is ordered by the GIL, so a free-threaded
/// interpreter (which builds this extension version-specific, not for the stable ABI) must turn
/// the GIL on when it imports it. Where the GIL was forced off (`PYTHON_GIL=0`, `-X gil=0`) the
/// import fails instead of racing.
#[pymodule(gil_used = true)]
#[pyo3(name = "_native")]
fn native_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let sys = m.py().import("sys")?;
    if let Ok(gil_enabled) = sys.getattr("_is_gil_enabled") {
        if !gil_enabled.call0()?.is_truthy()? {
            return Err(pyo3::exceptions::PyImportError::new_err(
                "gpupool needs the GIL, which PYTHON_GIL=0 or -X gil=0 turned off: run without either \
                 (a free-threaded Python turns the GIL on for gpupool by itself)",
            ));
        }
    }
    m.add_class::<pool::PyPool>()?;
    m.add_class::<device_ptr::PyDevicePtr>()?;
    m.add_class::<export::PyExport>()?;
    m.add_class::<device::PyDevice>()?;
    m.add_class::<stream::PyStream>()?;
    m.add_class::<trace::PyTrace>()?;
    m.add_class::<replay::PyReplayResult>()?;
    m.add_function(wrap_pyfunction!(replay::replay, m)?)?;
    m.add("OutOfMemoryError", m.py().get_type::<error::OutOfMemoryError>())?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(parse_capacity, m)?)?;
    m.add_function(wrap_pyfunction!(advise::replay_from_start, m)?)?;
    m.add_function(wrap_pyfunction!(advise::matched_in_order, m)?)?;
    m.add_function(wrap_pyfunction!(advise::inert_keys, m)?)?;
    m.add_function(wrap_pyfunction!(advise::first_block_rows, m)?)?;
    m.add_function(wrap_pyfunction!(advise::live_at_peak, m)?)?;
    m.add_function(wrap_pyfunction!(pickle::load_pickle, m)?)?;
    cuda::register(m)?;
    #[cfg(feature = "cuda")]
    ipc::register(m)?;
    Ok(())
}

/// Bytes in a size such as `80GiB`, `512 MiB`, `1.5GB` or `4096`.
#[pyfunction]
fn parse_size(text: &str) -> PyResult<u64> {
    crate::pool::parse_size(text).map_err(error::value_error)
}

/// A device's capacity in bytes, checked as `replay` and `Pool` check theirs.
#[pyfunction]
fn parse_capacity(capacity: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    device::capacity_arg(capacity)
}
