//! `gpupool.Stream`: a stream of one pool's device (simulated on `host` and `sim`).

use super::error::{pool_error, value_error};
use super::pool::Shared;
use crate::device::{StreamId, DEFAULT_STREAM};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[pyclass(name = "Stream", module = "gpupool._native", frozen)]
pub struct PyStream {
    shared: Arc<Shared>,
    id: StreamId,
    destroyed: AtomicBool,
    /// Made elsewhere (`Pool.external_stream`): its owner may go on queuing work on it after
    /// gpupool forgets it.
    external: bool,
}

impl PyStream {
    pub fn new(shared: Arc<Shared>, id: StreamId) -> Self {
        PyStream { shared, id, destroyed: AtomicBool::new(false), external: false }
    }

    pub fn external(shared: Arc<Shared>, id: StreamId) -> Self {
        PyStream { shared, id, destroyed: AtomicBool::new(false), external: true }
    }

    /// The stream's id, after checking it belongs to `shared`'s pool and still exists.
    pub fn id_for(&self, shared: &Arc<Shared>) -> PyResult<StreamId> {
        if !Arc::ptr_eq(&self.shared, shared) {
            return Err(value_error("this Stream belongs to another pool"));
        }
        self.live_id()
    }

    /// Whether `destroy()` destroyed it: then nothing needs it kept alive.
    pub fn is_destroyed(&self) -> bool {
        self.destroyed.load(Ordering::Acquire)
    }

    fn live_id(&self) -> PyResult<StreamId> {
        if self.destroyed.load(Ordering::Acquire) {
            return Err(value_error(format!("stream {} was destroyed", self.id)));
        }
        Ok(self.id)
    }
}

impl Drop for PyStream {
    fn drop(&mut self) {
        if self.id != DEFAULT_STREAM && !self.destroyed.swap(true, Ordering::AcqRel) {
            // Destroying synchronizes the stream: never with the interpreter attached.
            Python::attach(|py| {
                if self.shared.left_by_fork(py) {
                    return;
                }
                let destroyed = self
                    .shared
                    .lock(py)
                    .and_then(|mut pool| pool.detach(|pool| pool.destroy_stream(self.id).map_err(pool_error)));
                if let Err(e) = destroyed {
                    // As CPython does for errors in `__del__`; the stream stays alive.
                    e.write_unraisable(py, None);
                }
            });
        }
    }
}

#[pymethods]
impl PyStream {
    #[getter]
    fn id(&self) -> StreamId {
        self.id
    }

    /// The driver's handle (`cudaStream_t` as an int; 0 is the legacy default stream), for
    /// `torch.cuda.ExternalStream` or `cupy.cuda.ExternalStream`; None on simulated devices.
    #[getter]
    fn handle(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        let id = self.live_id()?;
        Ok(self.shared.lock(py)?.device().stream_handle(id))
    }

    /// Simulated devices: the stream stays busy (its events pending) until `synchronize()`.
    fn hold(&self, py: Python<'_>) -> PyResult<()> {
        let id = self.live_id()?;
        self.shared.lock(py)?.hold_stream(id).map_err(pool_error)
    }

    /// Whether all work recorded on the stream has completed.
    fn query(&self, py: Python<'_>) -> PyResult<bool> {
        let id = self.live_id()?;
        self.shared.lock(py)?.detach(|pool| pool.query_stream(id).map_err(pool_error))
    }

    /// Waits for the stream's work; blocks it freed or used become reusable.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let id = self.live_id()?;
        self.shared.lock(py)?.detach(|pool| pool.synchronize_stream(id).map_err(pool_error))
    }

    /// Synchronizes and destroys the stream; its cached blocks go to every stream and its live
    /// allocations to the default stream. An external stream is only forgotten, and refused
    /// while allocations are made or used on it.
    fn destroy(&self, py: Python<'_>) -> PyResult<()> {
        if self.id == DEFAULT_STREAM {
            return Err(value_error("the default stream cannot be destroyed"));
        }
        self.shared.lock(py)?.detach(|pool| {
            // Checked under the lock: two racing destroys must not both reach the device.
            let id = self.live_id()?;
            // Its allocations would pass to the default stream, which does not see the work
            // the owner may still queue on this one. (A gpupool stream is gone for everyone.)
            if self.external && pool.holds_memory_for(id) {
                return Err(value_error(format!(
                    "external stream {id} still has allocations made or used on it: free them (and let their \
                     frees complete) before destroying it"
                )));
            }
            pool.destroy_stream(id).map_err(pool_error)?;
            self.destroyed.store(true, Ordering::Release);
            Ok(())
        })
    }

    fn __repr__(&self) -> String {
        let state = if self.destroyed.load(Ordering::Acquire) { ", destroyed" } else { "" };
        format!("Stream({}, device='{}'{state})", self.id, self.shared.device)
    }

    fn __eq__(&self, other: &PyStream) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared) && self.id == other.id
    }

    fn __hash__(&self) -> u64 {
        self.id as u64
    }
}
