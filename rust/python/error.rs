//! Maps core, device and pool errors to Python exceptions.

use crate::device::DeviceError;
use crate::pool::PoolError;
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt};

pyo3::create_exception!(gpupool, OutOfMemoryError, PyMemoryError, "The device cannot provide the requested memory.");

pub fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

pub fn pool_error(e: PoolError) -> PyErr {
    match e {
        PoolError::OutOfMemory(report) => OutOfMemoryError::new_err(report.to_string()),
        PoolError::InvalidSize(_) | PoolError::Heap(_) => PyValueError::new_err(e.to_string()),
        // Bad addresses, streams and events come from the caller; anything else is the device's.
        PoolError::Device(
            d @ (DeviceError::InvalidAddress(_) | DeviceError::InvalidStream(_) | DeviceError::InvalidEvent(_)),
        ) => PyValueError::new_err(d.to_string()),
        PoolError::Device(d) => PyRuntimeError::new_err(d.to_string()),
        PoolError::Capturing(..) => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Exporting memory (to another process) that is not inside one live allocation.
pub fn not_allocated(address: u64, size: u64) -> PyErr {
    PyValueError::new_err(format!("{size} bytes at {address:#x} are not inside a live allocation of this pool"))
}

/// A poisoned lock means a panic interrupted a device call; its state can no longer be trusted.
pub fn poisoned<T>(_: T) -> PyErr {
    PyRuntimeError::new_err("the device was left in an unknown state by an earlier internal panic")
}

/// A panic caught where it cannot propagate (a destructor), as PyO3 raises one elsewhere.
pub fn panic_error(payload: Box<dyn std::any::Any + Send>) -> PyErr {
    let message = match payload.downcast::<String>() {
        Ok(text) => *text,
        Err(payload) => payload.downcast_ref::<&str>().map_or("a panic without a message", |text| text).to_string(),
    };
    pyo3::panic::PanicException::new_err(message)
}

/// A pool that a panic left inconsistent, with the invariant it breaks.
pub fn poisoned_pool(device: &str, why: &str) -> PyErr {
    PyRuntimeError::new_err(format!(
        "the pool on '{device}' is unusable: an earlier call panicked inside it (the PanicException it raised \
         says where) and left it inconsistent: {why}"
    ))
}

/// A pool of the parent's that a forked child cannot use, and why.
pub fn left_by_fork(device: &str, cuda: bool) -> PyErr {
    let why = match cuda {
        true => "CUDA memory cannot be used in a forked child (start it with multiprocessing's 'spawn' method)",
        false => "another thread was inside it then, so its state here is unknown",
    };
    PyRuntimeError::new_err(format!("the pool on '{device}' was made before this process forked: {why}"))
}

/// A non-negative integer size; floats, strings and bools are a TypeError, negatives a ValueError.
pub fn size_arg(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    let index;
    let value = if value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>() {
        value
    } else {
        index = integer_index(value, what)?;
        &index
    };
    // Most sizes fit a u64: one C call. Only negatives and huge values take the slower path
    // that tells them apart.
    if let Ok(n) = value.extract::<u64>() {
        if n <= crate::core::Rules::MAX_REQUEST {
            return Ok(n);
        }
    }
    let n: i128 = value.extract().map_err(|_| PyValueError::new_err(format!("{what} {value} is absurdly large")))?;
    if n < 0 {
        return Err(PyValueError::new_err(format!("{what} must be non-negative, got {n}")));
    }
    if n > crate::core::Rules::MAX_REQUEST as i128 {
        return Err(PyValueError::new_err(format!("{what} {n} is absurdly large (limit 2**62)")));
    }
    Ok(n as u64)
}

/// A size of another integer type (NumPy's, as `np.prod(shape) * itemsize` gives) as an int,
/// through `__index__` as PyTorch and NumPy read sizes. A bool is an int to Python, but as a
/// size it is a mistake, which they refuse too.
#[cold]
fn integer_index<'py>(value: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyAny>> {
    if value.is_instance_of::<PyBool>() || !value.hasattr("__index__")? {
        let kind = value.get_type().name()?;
        return Err(PyTypeError::new_err(format!("{what} must be an int, not {kind}")));
    }
    value.py().import("operator")?.getattr("index")?.call1((value,))
}
