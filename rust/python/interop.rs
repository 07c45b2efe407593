//! Zero-copy hand-off of an allocation to other libraries: `__cuda_array_interface__` (CuPy,
//! Numba, PyTorch) and DLPack (`numpy.from_dlpack`, `torch.from_dlpack`).

use super::dlpack::{self, DataType};
use super::error::{pool_error, value_error};
use super::pool::{DevicePool, Shared};
use crate::core::Handle;
use crate::device::{Device, DeviceError, StreamId, DEFAULT_STREAM};
use crate::pool::{HeldBlock, PoolError, Refused};
use pyo3::exceptions::{PyAttributeError, PyBufferError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};
use std::sync::Mutex;

/// The bytes of one allocation, as the exports see them.
pub struct Memory<'a> {
    pub shared: &'a Shared,
    pub address: u64,
    pub size: u64,
    /// The stream the allocation was made on: consumers are ordered after it.
    pub stream: StreamId,
    /// The allocation, whose stream the pool knows now (a destroyed stream's allocations pass
    /// to the default stream), and its block once a free left it held for exports.
    pub handle: Option<Handle>,
    pub held: &'a Mutex<Option<HeldBlock>>,
}

/// `(kDLCUDA, N)` for `cuda:N`, `(kDLCPU, 0)` for host memory.
pub fn dlpack_device(shared: &Shared) -> PyResult<(i32, i32)> {
    if let Some(ordinal) = cuda_ordinal(shared) {
        return Ok((dlpack::DEVICE_CUDA, ordinal));
    }
    if shared.host_accessible {
        return Ok((dlpack::DEVICE_CPU, 0));
    }
    Err(PyBufferError::new_err(format!("memory on device '{}' has no data to export", shared.device)))
}

fn cuda_ordinal(shared: &Shared) -> Option<i32> {
    shared.device.strip_prefix("cuda:")?.parse().ok()
}

impl Memory<'_> {
    /// The stream the allocation's work is ordered on.
    fn producer(&self, pool: &DevicePool) -> StreamId {
        if let Some(stream) = self.handle.and_then(|handle| pool.stream_of(handle).ok()) {
            return stream;
        }
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.as_ref().map_or(self.stream, |block| pool.held_stream(block))
    }

    /// Version 3 of the CUDA Array Interface: `typestr`/`shape` describe the bytes, `stream` is
    /// the allocation's stream (1 for the legacy default stream, as the protocol spells it).
    pub fn cuda_array_interface<'py>(
        &self,
        py: Python<'py>,
        typestr: &str,
        shape: &[i64],
    ) -> PyResult<Bound<'py, PyDict>> {
        if cuda_ordinal(self.shared).is_none() {
            return Err(PyAttributeError::new_err(format!(
                "memory on device '{}' is not CUDA memory",
                self.shared.device
            )));
        }
        let pool = self.shared.lock(py)?;
        let stream = pool.device().stream_handle(self.producer(&pool)).map(|raw| if raw == 0 { 1 } else { raw });
        drop(pool);
        let d = PyDict::new(py);
        d.set_item("shape", shape.to_vec())?;
        d.set_item("typestr", typestr)?;
        d.set_item("data", (self.address, false))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        d.set_item("stream", stream)?;
        Ok(d)
    }

    /// A DLPack capsule of `shape` elements of `dtype`, owned by `owner`. On CUDA, the consumer's
    /// `stream` (DLPack's numbering: None or 1 legacy default, 2 per-thread, -1 no ordering) is
    /// made to wait for the allocation's stream without blocking the host. `max_version` is the
    /// newest DLPack ABI the consumer reads (None: the unversioned one).
    pub fn dlpack<'py>(
        &self,
        py: Python<'py>,
        owner: Py<PyAny>,
        dtype: DataType,
        shape: Vec<i64>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let device = dlpack_device(self.shared)?;
        let elements = shape.iter().try_fold(1i64, |n, &d| if d < 0 { None } else { n.checked_mul(d) });
        let bytes = elements.and_then(|n| n.checked_mul(i64::from(dtype.bits) * i64::from(dtype.lanes)));
        let bytes = bytes.and_then(|bits| bits.checked_add(7)).map(|bits| bits / 8);
        if bytes.is_none_or(|bytes| bytes > self.size as i64) {
            return Err(value_error(format!("shape {shape:?} does not fit in an allocation of {} bytes", self.size)));
        }
        if device.0 == dlpack::DEVICE_CUDA && stream != Some(-1) {
            let consumer = match stream {
                None | Some(1) => 0,
                Some(raw) if raw > 0 => raw as u64,
                Some(raw) => return Err(value_error(format!("invalid DLPack stream {raw}"))),
            };
            self.shared.lock(py)?.detach(|pool| self.order_before(pool, consumer))?;
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        dlpack::export(py, owner, self.address, device, dtype, shape, versioned)
    }

    /// Makes the stream with raw handle `consumer` wait for the work queued on the allocation's.
    fn order_before(&self, pool: &mut DevicePool, consumer: u64) -> PyResult<()> {
        let producer = self.producer(pool);
        let device = pool.device_mut();
        if device.stream_handle(producer) == Some(consumer) {
            return Ok(());
        }
        let waiter = device.import_stream(consumer).map_err(|e| pool_error(e.into()))?;
        let ordered = order_after(device, producer, waiter);
        if waiter != DEFAULT_STREAM {
            device.destroy_stream(waiter).map_err(|e| pool_error(e.into()))?;
        }
        ordered.map_err(pool_error)
    }
}

/// Makes `waiter` wait for the work queued on `producer`. No order can cross a capture's edge:
/// an event recorded in a capture and waited for outside it pulls the waiter into the capture,
/// which then cannot end; a capturing stream may not wait for an event recorded outside its
/// capture (only as an external event node, which would outlive the event made here), nor for
/// one recorded in another capture (that would merge two independent captures, and the driver
/// invalidates both); and the legacy stream, which counts as capturing while a blocking stream
/// captures, may not be used at all then (using it invalidates that capture). All are refused,
/// as copies during a capture are.
fn order_after(device: &mut dyn Device, producer: StreamId, waiter: StreamId) -> Result<(), PoolError> {
    let (producing, waiting) = (device.is_capturing(producer)?, device.is_capturing(waiter)?);
    if producing && (!waiting || producer == DEFAULT_STREAM) {
        return Err(PoolError::Capturing(producer, Refused::Order));
    }
    if waiting && (!producing || waiter == DEFAULT_STREAM) {
        return Err(PoolError::Capturing(producer, Refused::Consumer));
    }
    if producing && !same_capture(device, producer, waiter)? {
        return Err(PoolError::Capturing(producer, Refused::Merge));
    }
    let event = device.record_event(producer)?;
    let waited = device.stream_wait_event(waiter, event);
    Ok(device.destroy_event(event).and(waited)?)
}

/// Whether two capturing streams capture into the same graph. An id the device cannot give (an
/// invalidated capture) matches nothing: no order is made there.
fn same_capture(device: &mut dyn Device, a: StreamId, b: StreamId) -> Result<bool, DeviceError> {
    let id = device.capture_id(a)?;
    Ok(id.is_some() && id == device.capture_id(b)?)
}
