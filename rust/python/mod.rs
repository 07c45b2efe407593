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

#[pymodule]
#[pyo3(name = "_native")]
fn native_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
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
