//! `gpupool.DevicePtr`: one allocation; it keeps its pool alive and frees itself when dropped.
//!
//! Its bytes have other holders too: every live export ([`PyExport`]: NumPy arrays, views,
//! DLPack capsules). A free while exports are alive ends the allocation but holds the bytes
//! (see `rust/pool/held.rs`) until the last export is gone. Every change to that lifetime
//! state happens under the pool's lock, so it is ordered with the pool's own.

use super::error::{panic_error, pool_error, size_arg, value_error};
use super::export::PyExport;
use super::interop;
use super::pool::{DevicePool, Shared};
use super::stream::PyStream;
use crate::core::Handle;
use crate::device::StreamId;
use crate::pool::{Allocation, HeldBlock};
use pyo3::exceptions::{PyAttributeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

#[pyclass(name = "DevicePtr", module = "gpupool._native", frozen)]
pub struct PyDevicePtr {
    shared: Arc<Shared>,
    address: u64,
    size: u64,
    stream: StreamId,
    /// `None` for zero-size allocations, which own no block.
    handle: Option<Handle>,
    /// Set once the user freed it (changed under the pool's lock; read without it).
    freed: AtomicBool,
    /// Live exports of the bytes (changed under the pool's lock).
    exports: AtomicU32,
    /// The block a free left held for the exports (taken under the pool's lock).
    held: Mutex<Option<HeldBlock>>,
    /// The `Stream` objects it was allocated on and recorded as used on, kept alive until the
    /// bytes are back in the pool: a stream forgotten while its allocation is in use would leave
    /// the bytes without an order.
    streams: Mutex<Vec<Py<PyStream>>>,
    /// Whether `streams` ever held one: most pointers live on the default stream, and their
    /// frees skip its lock.
    keeps_streams: AtomicBool,
}

/// A stream id, and the `Stream` object it came from (none for the default stream).
pub type StreamArg = (StreamId, Option<Py<PyStream>>);

impl PyDevicePtr {
    pub fn new(shared: Arc<Shared>, a: Allocation, stream: StreamArg) -> Self {
        Self::with(shared, a.address, a.size, stream, Some(a.handle))
    }

    pub fn empty(shared: Arc<Shared>, stream: StreamArg) -> Self {
        Self::with(shared, 0, 0, stream, None)
    }

    fn with(shared: Arc<Shared>, address: u64, size: u64, stream: StreamArg, handle: Option<Handle>) -> Self {
        let (freed, exports, held) = (AtomicBool::new(false), AtomicU32::new(0), Mutex::new(None));
        let (stream, object) = stream;
        let keeps_streams = AtomicBool::new(object.is_some());
        let streams = Mutex::new(object.into_iter().collect());
        PyDevicePtr { shared, address, size, stream, handle, freed, exports, held, streams, keeps_streams }
    }

    /// Whether its pool is a parent's that this forked child cannot use (see `Shared`).
    pub fn left_by_fork(&self, py: Python<'_>) -> bool {
        self.shared.left_by_fork(py)
    }

    pub fn belongs_to(&self, shared: &Arc<Shared>) -> bool {
        Arc::ptr_eq(&self.shared, shared)
    }

    /// Frees once. The pointer counts as freed only once the pool has freed it: an error leaves
    /// it live, so the free can be retried. With exports alive the bytes are held for them.
    pub fn release(&self, py: Python<'_>) -> PyResult<()> {
        self.free_block(py)?;
        self.let_streams_go();
        Ok(())
    }

    fn free_block(&self, py: Python<'_>) -> PyResult<()> {
        let Some(handle) = self.handle else {
            let _pool = self.shared.lock(py)?;
            return self.end(|| Ok(()));
        };
        let mut pool = self.shared.lock(py)?;
        // The common free touches no device: keep the GIL, it is cheaper than a release.
        if self.exports.load(Ordering::Relaxed) > 0 || !pool.free_calls_device(handle).unwrap_or(false) {
            return self.free_locked(&mut pool, handle);
        }
        pool.detach(|pool| self.free_locked(pool, handle))
    }

    /// Marks the pointer freed if `free` succeeds; a second free is a double free.
    fn end(&self, free: impl FnOnce() -> PyResult<()>) -> PyResult<()> {
        if self.freed.load(Ordering::Relaxed) {
            return Err(value_error(format!("double free of DevicePtr {:#x}", self.address)));
        }
        free()?;
        self.freed.store(true, Ordering::Release);
        Ok(())
    }

    fn free_locked(&self, pool: &mut DevicePool, handle: Handle) -> PyResult<()> {
        self.end(|| {
            if self.exports.load(Ordering::Relaxed) == 0 {
                return pool.free(handle).map_err(pool_error);
            }
            let held = pool.free_held(handle).map_err(pool_error)?;
            *self.held.lock().unwrap_or_else(|e| e.into_inner()) = Some(held);
            Ok(())
        })
    }

    /// A free the pool refused changed nothing, and is left to be retried: but a pointer being
    /// destroyed has no one left to retry it, and its block would stay allocated for the pool's
    /// life. It is freed as a block held for exports is, which waits for the whole device when
    /// the device refuses the events the free needs and, if the device refuses that too, stays
    /// held until the pool's next synchronize (which `empty_cache` calls). Returns `refused` if
    /// even that cannot start, else the error of a release that must wait.
    fn free_as_held(&self, py: Python<'_>, refused: PyErr) -> PyResult<()> {
        let Some(handle) = self.handle else { return Err(refused) };
        let mut pool = self.shared.lock(py)?;
        if self.freed.load(Ordering::Acquire) {
            return Err(refused);
        }
        let Ok(block) = pool.free_held(handle) else { return Err(refused) };
        self.freed.store(true, Ordering::Release);
        pool.detach(|pool| pool.release_held(block).map_err(pool_error))
    }

    /// A new export of the bytes; they stay put until it is dropped.
    pub fn pin(slf: &Bound<'_, Self>) -> PyResult<PyExport> {
        let this = slf.get();
        let _pool = this.shared.lock(slf.py())?;
        this.check_live()?;
        this.exports.fetch_add(1, Ordering::Relaxed);
        Ok(PyExport::new(slf.clone().unbind()))
    }

    /// An export is gone. The last one of a freed pointer releases the held block; the device
    /// may be called then (other streams' uses), so the interpreter is detached for it. If that
    /// fails, the pool keeps the block for its next synchronize.
    pub fn unpin(&self, py: Python<'_>) -> PyResult<()> {
        self.shared.lock(py)?.detach(|pool| {
            if self.exports.fetch_sub(1, Ordering::Relaxed) != 1 {
                return Ok(());
            }
            let held = self.held.lock().unwrap_or_else(|e| e.into_inner()).take();
            held.map_or(Ok(()), |block| pool.release_held(block).map_err(pool_error))
        })?;
        self.let_streams_go();
        Ok(())
    }

    /// Drops the `Stream` objects once the bytes are back in the pool (freed, no export left):
    /// the pool's events order what is left, and a user who keeps the freed pointer must not
    /// keep a stream alive that its owner means to destroy. Called without the pool's lock,
    /// since dropping the last reference to a stream destroys it, which takes that lock.
    fn let_streams_go(&self) {
        if !self.keeps_streams.load(Ordering::Acquire)
            || !self.freed.load(Ordering::Acquire)
            || self.exports.load(Ordering::Relaxed) > 0
        {
            return;
        }
        let streams = std::mem::take(&mut *self.streams.lock().unwrap_or_else(|e| e.into_inner()));
        drop(streams);
    }

    /// Marks this allocation as used on `stream` (see `Pool.record_stream`).
    pub fn record_stream(&self, py: Python<'_>, stream: &Bound<'_, PyStream>) -> PyResult<()> {
        let id = stream.get().id_for(&self.shared)?;
        let Some(handle) = self.handle else { return self.check_live() };
        // Recording a use asks the device whether the stream exists.
        self.shared.lock(py)?.detach(|pool| {
            self.check_live()?;
            pool.record_stream(handle, id).map_err(pool_error)
        })?;
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        // A long-lived allocation used on many short-lived streams keeps only the live ones.
        streams.retain(|s| !s.get().is_destroyed());
        // A free on another thread since the record has let its streams go (see `let_streams_go`).
        if !self.freed.load(Ordering::Acquire) && !streams.iter().any(|s| s.is(stream)) {
            streams.push(stream.clone().unbind());
            self.keeps_streams.store(true, Ordering::Release);
        }
        Ok(())
    }

    fn check_live(&self) -> PyResult<()> {
        if self.freed.load(Ordering::Acquire) {
            return Err(value_error(format!("DevicePtr {:#x} was freed", self.address)));
        }
        Ok(())
    }

    pub fn memory(&self) -> interop::Memory<'_> {
        let (shared, address, size, stream, handle) = (&self.shared, self.address, self.size, self.stream, self.handle);
        interop::Memory { shared, address, size, stream, handle, held: &self.held }
    }

    /// For the array-interface getters: their AttributeError tells NumPy the interface is absent.
    pub fn check_host(&self) -> PyResult<()> {
        self.host_only().map_err(PyAttributeError::new_err)
    }

    fn host_only(&self) -> Result<(), String> {
        if !self.shared.host_accessible {
            return Err(format!("memory on device '{}' is not host-accessible", self.shared.device));
        }
        Ok(())
    }

    /// Checks that `len` bytes at `offset` lie inside the allocation.
    fn check_span(&self, offset: u64, len: u64) -> PyResult<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(value_error(format!(
                "{len} bytes at offset {offset} do not fit in an allocation of {} bytes",
                self.size
            )));
        }
        Ok(())
    }
}

impl Drop for PyDevicePtr {
    fn drop(&mut self) {
        if self.freed.load(Ordering::Acquire) {
            return;
        }
        // Exports hold a reference to this pointer, so none is alive now: a plain free.
        Python::attach(|py| {
            if self.shared.left_by_fork(py) {
                return;
            }
            // A panic (in a device call) would end the destructor, and with it the block's free.
            let released = catch_unwind(AssertUnwindSafe(|| self.release(py))).unwrap_or_else(|p| Err(panic_error(p)));
            if let Err(e) = released.or_else(|refused| self.free_as_held(py, refused)) {
                // As CPython does for errors in `__del__`.
                e.write_unraisable(py, None);
            }
        });
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

    /// Live exports of the bytes (arrays, views, DLPack capsules).
    #[getter]
    fn exports(&self) -> u32 {
        self.exports.load(Ordering::Acquire)
    }

    fn free(&self, py: Python<'_>) -> PyResult<()> {
        self.release(py)
    }

    #[pyo3(name = "record_stream")]
    fn py_record_stream(&self, py: Python<'_>, stream: &Bound<'_, PyStream>) -> PyResult<()> {
        self.record_stream(py, stream)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyAny>) -> PyResult<()> {
        if self.freed() {
            return Ok(());
        }
        self.release(py)
    }

    fn __repr__(&self) -> String {
        let state = if self.freed() { ", freed" } else { "" };
        format!("DevicePtr({:#x}, size={}, device='{}'{state})", self.address, self.size, self.shared.device)
    }

    /// A zero-copy uint8 NumPy array of the bytes (host memory only). It is an export: the bytes
    /// stay put while the array (or any view of it) is alive, even after `free()`. As NumPy 2
    /// asks, another `dtype` or `copy=True` gives a copy, and `copy=False` refuses to make one.
    #[pyo3(signature = (dtype = None, copy = None))]
    fn __array__<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // As PyTorch and CuPy refuse to convert device memory implicitly.
        slf.get().host_only().map_err(PyTypeError::new_err)?;
        let numpy = slf.py().import("numpy")?;
        let export = Bound::new(slf.py(), Self::pin(slf)?)?;
        let array = numpy.call_method1("asarray", (export,))?;
        let dtype = match dtype.filter(|d| !d.is_none()) {
            Some(dtype) => numpy.call_method1("dtype", (dtype,))?,
            None => array.getattr("dtype")?,
        };
        let converts = !dtype.eq(array.getattr("dtype")?)?;
        match copy {
            Some(false) if converts => {
                Err(value_error(format!("the bytes are uint8: {dtype} needs a copy, and copy=False forbids one")))
            }
            _ if converts || copy == Some(true) => array.call_method1("astype", (dtype,)),
            _ => Ok(array),
        }
    }

    /// An export of the bytes with the array protocols and DLPack (see `gpupool.View`).
    fn _export(slf: &Bound<'_, Self>) -> PyResult<PyExport> {
        Self::pin(slf)
    }

    /// A zero-copy uint8 view for CuPy, Numba and PyTorch (CUDA memory only). The consumer keeps
    /// this pointer alive, but the protocol has no release: use `view()` to pin the bytes.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check_live()?;
        self.memory().cuda_array_interface(py, "|u1", &[self.size as i64])
    }

    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        interop::dlpack_device(&self.shared)
    }

    /// A DLPack capsule of the bytes; it pins them until the consumer is done.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let export = Bound::new(slf.py(), Self::pin(slf)?)?;
        let kwargs = PyDict::new(slf.py());
        kwargs.set_item("stream", stream)?;
        kwargs.set_item("max_version", max_version)?;
        kwargs.set_item("dl_device", dl_device)?;
        kwargs.set_item("copy", copy)?;
        export.call_method("__dlpack__", (), Some(&kwargs))
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
    fn copy_from_host(
        &self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        offset: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let offset = offset.map_or(Ok(0), |o| size_arg(o, "offset"))?;
        let bytes = buffer_bytes(data)?;
        self.check_span(offset, bytes.len() as u64)?;
        if bytes.is_empty() {
            return self.check_live();
        }
        let handle = self.handle.ok_or_else(|| value_error("an empty allocation holds no bytes"))?;
        // Checking `freed` under the pool lock orders it with a concurrent free.
        self.shared.lock(py)?.detach(|pool| {
            self.check_live()?;
            pool.write(handle, offset, &bytes).map_err(|e| value_error(e.to_string()))
        })
    }

    /// The bytes, or `size` of them from `offset`, as `bytes`.
    #[pyo3(signature = (offset = None, size = None))]
    fn copy_to_host<'py>(
        &self,
        py: Python<'py>,
        offset: Option<&Bound<'py, PyAny>>,
        size: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let offset = offset.map_or(Ok(0), |o| size_arg(o, "offset"))?;
        let len = size.map_or(Ok(self.size.saturating_sub(offset)), |s| size_arg(s, "size"))?;
        self.check_span(offset, len)?;
        // Before the bytes object: it is allocated and zeroed, which for `sim` may be GiBs.
        if len > 0 && !self.shared.holds_bytes() {
            return Err(value_error(format!("device '{}' does not support copies", self.shared.device)));
        }
        PyBytes::new_with(py, len as usize, |out| {
            if out.is_empty() {
                return self.check_live();
            }
            let handle = self.handle.ok_or_else(|| value_error("an empty allocation holds no bytes"))?;
            // `out` belongs to a bytes object no other thread can see yet.
            self.shared.lock(py)?.detach(|pool| {
                self.check_live()?;
                pool.read(handle, offset, out).map_err(|e| value_error(e.to_string()))
            })
        })
    }
}
