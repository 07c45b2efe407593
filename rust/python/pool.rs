//! `gpupool.Pool`: the Python face of one pool; the GIL is released whenever the device is called.

use super::cuda::default_device;
use super::device::{capacity_arg, open_device_mode};
use super::device_ptr::PyDevicePtr;
use super::error::{left_by_fork, poisoned_pool, pool_error, size_arg, value_error};
use super::gil_lock::{GilGuard, GilLock};
use super::stream::PyStream;
use super::trace::device_trace;
use crate::core::{BlockState, Metric, StatType};
use crate::device::{Device, FaultPlan, FaultSetting, Faulty};
use crate::pool::HistoryEntry;
use crate::pool::{Backend, Config, Pool, Setting, DEFAULT_STREAM, ENV_VAR};
use crate::trace::{csv, Trace};
use pyo3::exceptions::{PyAssertionError, PyOSError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyTuple};
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::Arc;

pub type DevicePool = Pool<Box<dyn Device>>;

/// What a Python pool and all of its pointers share, so memory outlives the `Pool` object.
pub struct Shared {
    /// Not dropped by a forked child that cannot use it (see [`Shared::adopt_after_fork`]).
    pool: ManuallyDrop<GilLock<DevicePool>>,
    pub device: String,
    pub capacity: Option<u64>,
    pub host_accessible: bool,
}

impl Shared {
    /// Locks the pool. If another thread holds it (over a device call, say), the wait happens
    /// detached, so other Python threads run. Anything that may call the device runs in
    /// [`GilGuard::detach`].
    #[inline]
    pub fn lock<'a, 'py>(&'a self, py: Python<'py>) -> PyResult<PoolGuard<'a, 'py>> {
        if self.pool.forked(py) {
            self.adopt_after_fork(py)?;
        }
        self.pool.lock(py).or_else(|poisoned| self.recover(poisoned))
    }

    /// A pool made before this process forked works in the child, on the copy of its memory
    /// that the fork made, unless that memory is CUDA's (a CUDA context does not survive a
    /// fork) or another thread was inside the pool then (it left the pool midway). Those raise,
    /// never hang on a lock whose holder is gone.
    #[cold]
    fn adopt_after_fork(&self, py: Python<'_>) -> PyResult<()> {
        let cuda = self.device.starts_with("cuda");
        if cuda || !self.pool.adopt_after_fork(py) {
            return Err(left_by_fork(&self.device, cuda));
        }
        Ok(())
    }

    /// Whether this is a pool of the parent's that this forked child cannot use: destructors
    /// leave its memory alone, as the parent's or unknown.
    pub fn left_by_fork(&self, py: Python<'_>) -> bool {
        self.pool.forked(py) && self.adopt_after_fork(py).is_err()
    }

    /// A panic inside the lock poisons it. If the pool's invariants still hold (the panic came
    /// before any change, as an injected device fault does), the pool is trusted again;
    /// otherwise every later call fails with an error that says why.
    #[cold]
    fn recover<'a, 'py>(&'a self, guard: PoolGuard<'a, 'py>) -> PyResult<PoolGuard<'a, 'py>> {
        match guard.check_invariants() {
            Ok(()) => {
                guard.clear_poison();
                Ok(guard)
            }
            Err(why) => Err(poisoned_pool(&self.device, &why)),
        }
    }

    /// Whether addresses have bytes behind them that copies reach (`sim`'s have none).
    pub fn holds_bytes(&self) -> bool {
        self.host_accessible || self.device.starts_with("cuda:")
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if !Python::attach(|py| self.left_by_fork(py)) {
            // SAFETY: dropped once, here, and never used again.
            unsafe { ManuallyDrop::drop(&mut self.pool) };
        }
    }
}

pub type PoolGuard<'a, 'py> = GilGuard<'a, 'py, DevicePool>;

#[pyclass(name = "Pool", module = "gpupool._native", subclass, frozen)]
pub struct PyPool {
    shared: Arc<Shared>,
}

/// `inject_faults`: a dict of [`FaultPlan::from_settings`] keys, its values converted.
fn fault_plan(spec: &Bound<'_, PyDict>) -> PyResult<FaultPlan> {
    let mut settings = Vec::new();
    for (key, value) in spec.iter() {
        let key: String = key.extract()?;
        let setting = if value.is_instance_of::<PyBool>() {
            return Err(value_error(format!("inject_faults: '{key}' takes a number, a name or a list, not a bool")));
        } else if let Ok(n) = value.extract::<u64>() {
            FaultSetting::Int(n)
        } else if let Ok(x) = value.extract::<f64>() {
            FaultSetting::Float(x)
        } else if let Ok(text) = value.extract::<String>() {
            FaultSetting::Text(text)
        } else if let Ok(names) = value.extract::<Vec<String>>() {
            FaultSetting::List(names)
        } else {
            return Err(value_error(format!("inject_faults: '{key}' has a value of the wrong type")));
        };
        settings.push((key, setting));
    }
    FaultPlan::from_settings(&settings).map_err(|e| value_error(format!("inject_faults: {e}")))
}

/// `config`, else the `GPUPOOL_ALLOC_CONF` environment variable, else the defaults.
fn pool_config(config: Option<&str>) -> PyResult<Config> {
    match (config, std::env::var(ENV_VAR)) {
        (Some(text), _) => Config::parse(text).map_err(value_error),
        (None, Ok(text)) => Config::parse(&text).map_err(|e| value_error(format!("{ENV_VAR}: {e}"))),
        (None, Err(_)) => Ok(Config::default()),
    }
}

/// Settings as a dict of Python values (`None` for unset; divisions as PyTorch's snapshot shows
/// them, interval start in MiB -> divisions).
fn settings_dict<'py>(py: Python<'py>, entries: Vec<(&'static str, Setting)>) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (key, value) in entries {
        match value {
            Setting::Text(text) => dict.set_item(key, text)?,
            Setting::Int(v) => dict.set_item(key, v)?,
            Setting::Float(v) => dict.set_item(key, v)?,
            Setting::Bool(v) => dict.set_item(key, v)?,
            Setting::Unset => dict.set_item(key, py.None())?,
            Setting::List(items) => dict.set_item(key, items)?,
            Setting::Names(names) => dict.set_item(key, names)?,
            Setting::Divisions(pairs) => {
                let divisions = PyDict::new(py);
                for (mb, count) in pairs {
                    divisions.set_item(mb.to_string(), count)?;
                }
                dict.set_item(key, divisions)?;
            }
        }
    }
    Ok(dict)
}

/// PyTorch's block state strings (torch/csrc/cuda/memory_snapshot.cpp).
fn block_state(state: BlockState) -> &'static str {
    match state {
        BlockState::Allocated => "active_allocated",
        BlockState::Pending => "active_pending_free",
        BlockState::Free => "inactive",
    }
}

impl PyPool {
    /// What the pool's pointers share (for module functions that reach its device).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    fn stat(&self, py: Python<'_>, metric: Metric) -> PyResult<(u64, u64)> {
        let s = self.shared.lock(py)?.stats().get(metric, StatType::All);
        Ok((s.current, s.peak))
    }

    /// Runs `op` on the pool with the interpreter detached: for anything that may call the device.
    fn detached<T: Send>(&self, py: Python<'_>, op: impl FnOnce(&mut DevicePool) -> PyResult<T> + Send) -> PyResult<T> {
        self.shared.lock(py)?.detach(op)
    }
}

#[pymethods]
impl PyPool {
    #[new]
    /// With no `device`, `cuda:0` when a GPU is usable, else `host`.
    #[pyo3(signature = (device = None, capacity = None, config = None, inject_faults = None))]
    fn new(
        py: Python<'_>,
        device: Option<&str>,
        capacity: Option<&Bound<'_, PyAny>>,
        config: Option<&str>,
        inject_faults: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let capacity = capacity_arg(capacity)?;
        let config = pool_config(config)?;
        let faults = inject_faults.map(fault_plan).transpose()?;
        let device = device.unwrap_or_else(|| default_device());
        // PyTorch's `backend:cudaMallocAsync`: segments from the driver's stream-ordered pool.
        let async_cuda = config.backend == Backend::CudaMallocAsync && device.starts_with("cuda");
        let mode = if async_cuda { "async" } else { "direct" };
        let shared = py.detach(|| {
            let mut backend = open_device_mode(device, capacity, mode)?;
            if let Some(plan) = faults {
                backend = Box::new(Faulty::new(backend, plan));
            }
            let host_accessible = backend.host_accessible();
            let device = backend.name().to_string();
            let total = backend.memory_info().total;
            let pool = Pool::new(backend, config);
            if let Some(why) = total.and_then(|total| pool.config().device_too_small(&device, total)) {
                return Err(value_error(why));
            }
            // Pre-allocation (`initial_pool_size_mb`) calls the device.
            let pool = ManuallyDrop::new(GilLock::new(pool));
            PyResult::Ok(Shared { pool, device, capacity, host_accessible })
        })?;
        Ok(PyPool { shared: Arc::new(shared) })
    }

    #[getter]
    fn device(&self) -> &str {
        &self.shared.device
    }

    #[getter]
    fn capacity(&self) -> Option<u64> {
        self.shared.capacity
    }

    /// The effective settings, by config key.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let entries = self.shared.lock(py)?.config().entries();
        settings_dict(py, entries)
    }

    #[pyo3(signature = (size, stream = None))]
    fn alloc(
        &self,
        py: Python<'_>,
        size: &Bound<'_, PyAny>,
        stream: Option<Bound<'_, PyStream>>,
    ) -> PyResult<PyDevicePtr> {
        let size = size_arg(size, "size")?;
        let id = stream.as_ref().map_or(Ok(DEFAULT_STREAM), |s| s.get().id_for(&self.shared))?;
        // The pointer keeps its stream alive: dropping the last other reference must not
        // forget a stream whose allocation is still in use.
        let stream = (id, stream.map(Bound::unbind));
        if size == 0 {
            return Ok(PyDevicePtr::empty(self.shared.clone(), stream));
        }
        // A cache hit needs no device: keep the GIL, it is cheaper than a release.
        let cached = self.shared.lock(py)?.alloc_cached(size, id).map_err(pool_error)?;
        let allocation = match cached {
            Some(a) => a,
            None => self.detached(py, |pool| pool.alloc_on(size, id).map_err(pool_error))?,
        };
        Ok(PyDevicePtr::new(self.shared.clone(), allocation, stream))
    }

    /// A new stream on this pool's device.
    fn stream(&self, py: Python<'_>) -> PyResult<PyStream> {
        let id = self.detached(py, |pool| pool.create_stream().map_err(pool_error))?;
        Ok(PyStream::new(self.shared.clone(), id))
    }

    /// Wraps a stream made elsewhere from its raw handle (`torch.cuda.current_stream().cuda_stream`,
    /// `cupy.cuda.get_current_stream().ptr`); gpupool never destroys it. CUDA devices only.
    fn external_stream(&self, py: Python<'_>, handle: u64) -> PyResult<PyStream> {
        crate::device::refuse_stream_handle(handle).map_err(value_error)?;
        let id = self.detached(py, |pool| pool.device_mut().import_stream(handle).map_err(|e| pool_error(e.into())))?;
        Ok(PyStream::external(self.shared.clone(), id))
    }

    #[getter]
    fn default_stream(&self) -> PyStream {
        PyStream::new(self.shared.clone(), DEFAULT_STREAM)
    }

    /// Marks `ptr` as used on `stream`: its free waits for that stream's queued work.
    fn record_stream(&self, py: Python<'_>, ptr: &PyDevicePtr, stream: &Bound<'_, PyStream>) -> PyResult<()> {
        if !ptr.belongs_to(&self.shared) {
            return Err(value_error("this DevicePtr belongs to another pool"));
        }
        ptr.record_stream(py, stream)
    }

    /// Waits for all work on every stream of the device (a device synchronize); the blocks that
    /// waited on it become reusable.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        self.detached(py, |pool| pool.synchronize().map_err(pool_error))
    }

    fn free(&self, py: Python<'_>, ptr: &PyDevicePtr) -> PyResult<()> {
        if !ptr.belongs_to(&self.shared) {
            return Err(value_error("this DevicePtr belongs to another pool"));
        }
        ptr.release(py)
    }

    fn memory_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let entries = self.shared.lock(py)?.memory_stats();
        let dict = PyDict::new(py);
        for (key, value) in entries {
            dict.set_item(key, value)?;
        }
        Ok(dict)
    }

    fn memory_allocated(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.stat(py, Metric::AllocatedBytes)?.0)
    }

    fn memory_reserved(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.stat(py, Metric::ReservedBytes)?.0)
    }

    fn max_memory_allocated(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.stat(py, Metric::AllocatedBytes)?.1)
    }

    fn max_memory_reserved(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.stat(py, Metric::ReservedBytes)?.1)
    }

    /// Every statistic's peak becomes its current value (`torch.cuda.reset_peak_memory_stats`).
    fn reset_peak_memory_stats(&self, py: Python<'_>) -> PyResult<()> {
        self.shared.lock(py)?.reset_peak_stats();
        Ok(())
    }

    /// Every statistic's `allocated` and `freed` sums, and the event counts (`num_alloc_retries`,
    /// `num_ooms`, `num_sync_all_streams`, device and driver calls), start again from 0
    /// (`torch.cuda.reset_accumulated_memory_stats`); current values and peaks stay.
    fn reset_accumulated_memory_stats(&self, py: Python<'_>) -> PyResult<()> {
        self.shared.lock(py)?.reset_accumulated_stats();
        Ok(())
    }

    /// Returns every fully free cached segment to the device.
    fn empty_cache(&self, py: Python<'_>) -> PyResult<()> {
        self.detached(py, |pool| pool.empty_cache().map(drop).map_err(pool_error))
    }

    /// Bytes the device currently holds for this pool.
    fn device_memory_held(&self, py: Python<'_>) -> PyResult<u64> {
        self.detached(py, |pool| Ok(pool.device().memory_info().held))
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.detached(py, |pool| pool.check_invariants().map_err(PyAssertionError::new_err))
    }

    /// Starts recording the newest `max_entries` events (a running record is resized), or with
    /// `enabled=False` stops and discards the record.
    #[pyo3(signature = (enabled = true, max_entries = 1_000_000))]
    fn record_history(&self, py: Python<'_>, enabled: bool, max_entries: usize) -> PyResult<()> {
        if max_entries == 0 {
            return Err(value_error("max_entries must be at least 1"));
        }
        self.shared.lock(py)?.record_history(enabled.then_some(max_entries));
        Ok(())
    }

    /// Writes the recorded history as an RMM logging CSV, gzip-compressed if `path` ends in `.gz`;
    /// returns how many of the job's releases of cached memory (`empty_cache()` calls and the
    /// out-of-memory path's) RMM's format could not say and were left out.
    fn dump_trace(&self, py: Python<'_>, path: PathBuf) -> PyResult<usize> {
        let trace = {
            let mut pool = self.shared.lock(py)?;
            let history =
                pool.history().ok_or_else(|| value_error("no history is recorded: call record_history() first"))?;
            Trace::from_history(history)
        };
        py.detach(|| csv::write_path(&trace, &path))
            .map_err(|e| PyOSError::new_err(format!("cannot write {}: {e}", path.display())))
    }

    /// PyTorch's snapshot dict: segments with their blocks, traces, settings. Paged strategies
    /// show one segment per contiguous mapped run, as PyTorch does for expandable segments.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (segments, settings, history) = {
            let mut pool = self.shared.lock(py)?;
            let history: Vec<HistoryEntry> = pool.history().map(|h| h.entries().copied().collect()).unwrap_or_default();
            (pool.segments(), pool.config().entries(), history)
        };
        let list = PyList::empty(py);
        for seg in segments {
            let blocks = PyList::empty(py);
            let (mut allocated, mut active, mut requested) = (0, 0, 0);
            for b in &seg.blocks {
                let block = PyDict::new(py);
                block.set_item("address", b.address)?;
                block.set_item("size", b.size)?;
                block.set_item("requested_size", b.requested)?;
                block.set_item("state", block_state(b.state))?;
                block.set_item("frames", PyList::empty(py))?;
                blocks.append(block)?;
                // As PyTorch's: a block pending free is active and still counts its request.
                if b.state == BlockState::Allocated {
                    allocated += b.size;
                }
                if b.state != BlockState::Free {
                    active += b.size;
                    requested += b.requested;
                }
            }
            let d = PyDict::new(py);
            d.set_item("device", 0)?;
            d.set_item("address", seg.address)?;
            d.set_item("total_size", seg.size)?;
            d.set_item("allocated_size", allocated)?;
            d.set_item("active_size", active)?;
            d.set_item("requested_size", requested)?;
            d.set_item("stream", seg.stream)?;
            d.set_item("segment_type", seg.kind.name())?;
            d.set_item("segment_pool_id", PyTuple::new(py, [0, 0])?)?;
            d.set_item("is_expandable", seg.expandable)?;
            d.set_item("frames", PyList::empty(py))?;
            d.set_item("blocks", blocks)?;
            list.append(d)?;
        }
        let snapshot = PyDict::new(py);
        snapshot.set_item("segments", list)?;
        snapshot.set_item("device_traces", PyList::new(py, [device_trace(py, &history)?])?)?;
        snapshot.set_item("allocator_settings", settings_dict(py, settings)?)?;
        Ok(snapshot)
    }
}
