//! `gpupool.Pool`: the Python face of one pool; the GIL is released whenever the device is called.

use super::cuda::default_device;
use super::device::{capacity_arg, open_device_mode};
use super::device_ptr::PyDevicePtr;
use super::error::{poisoned, pool_error, size_arg, value_error};
use super::stream::PyStream;
use super::trace::device_trace;
use crate::core::{BlockState, Metric, StatType};
use crate::device::{Device, FaultPlan, Faulty};
use crate::pool::HistoryEntry;
use crate::pool::{Backend, Config, Pool, Setting, DEFAULT_STREAM, ENV_VAR};
use crate::trace::{csv, Trace};
use pyo3::exceptions::{PyAssertionError, PyOSError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

pub type DevicePool = Pool<Box<dyn Device>>;

/// What a Python pool and all of its pointers share, so memory outlives the `Pool` object.
pub struct Shared {
    pool: Mutex<DevicePool>,
    pub device: String,
    pub capacity: Option<u64>,
    pub host_accessible: bool,
}

impl Shared {
    pub fn lock(&self) -> PyResult<MutexGuard<'_, DevicePool>> {
        self.pool.lock().map_err(poisoned)
    }
}

#[pyclass(name = "Pool", module = "gpupool._native", subclass, frozen)]
pub struct PyPool {
    shared: Arc<Shared>,
}

fn fault_plan(spec: &Bound<'_, PyDict>) -> PyResult<FaultPlan> {
    let get = |key: &str| spec.get_item(key);
    for key in spec.keys() {
        let key: String = key.extract()?;
        if !matches!(key.as_str(), "nth" | "probability" | "seed") {
            return Err(value_error(format!(
                "inject_faults: unknown key '{key}' (use 'nth' or 'probability' and 'seed')"
            )));
        }
    }
    if get("nth")?.is_some() && (get("probability")?.is_some() || get("seed")?.is_some()) {
        return Err(value_error("inject_faults: give either 'nth' or 'probability' (with 'seed'), not both"));
    }
    if let Some(nth) = get("nth")? {
        let nth: u64 = nth
            .extract()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| value_error("inject_faults: 'nth' must be a positive int (1 = the first segment)"))?;
        return Ok(FaultPlan::Nth(nth));
    }
    let p: f64 =
        get("probability")?.ok_or_else(|| value_error("inject_faults needs 'nth' or 'probability'"))?.extract()?;
    if !(0.0..=1.0).contains(&p) {
        return Err(value_error(format!("inject_faults: 'probability' must be in [0, 1], got {p}")));
    }
    let seed: u64 = get("seed")?.map(|s| s.extract()).transpose()?.unwrap_or(0);
    Ok(FaultPlan::Probability { p, seed })
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

    fn stat(&self, metric: Metric) -> PyResult<(u64, u64)> {
        let s = self.shared.lock()?.stats().get(metric, StatType::All);
        Ok((s.current, s.peak))
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
        let device = device.unwrap_or_else(|| default_device());
        // PyTorch's `backend:cudaMallocAsync`: segments from the driver's stream-ordered pool.
        let async_cuda = config.backend == Backend::CudaMallocAsync && device.starts_with("cuda");
        let mode = if async_cuda { "async" } else { "direct" };
        let mut backend = py.detach(|| open_device_mode(device, capacity, mode))?;
        if let Some(spec) = inject_faults {
            backend = Box::new(Faulty::new(backend, fault_plan(spec)?));
        }
        let host_accessible = backend.host_accessible();
        let device = backend.name().to_string();
        let shared = Shared { pool: Mutex::new(Pool::new(backend, config)), device, capacity, host_accessible };
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
        let entries = self.shared.lock()?.config().entries();
        settings_dict(py, entries)
    }

    #[pyo3(signature = (size, stream = None))]
    fn alloc(&self, py: Python<'_>, size: &Bound<'_, PyAny>, stream: Option<&PyStream>) -> PyResult<PyDevicePtr> {
        let size = size_arg(size, "size")?;
        let stream = stream.map_or(Ok(DEFAULT_STREAM), |s| s.id_for(&self.shared))?;
        if size == 0 {
            return Ok(PyDevicePtr::empty(self.shared.clone()));
        }
        // The cache answers without the device: keep the GIL, it is cheaper than a release.
        let cached = self.shared.lock()?.alloc_cached(size, stream).map_err(pool_error)?;
        let allocation = match cached {
            Some(a) => a,
            None => py.detach(|| self.shared.lock()?.alloc_on(size, stream).map_err(pool_error))?,
        };
        Ok(PyDevicePtr::new(self.shared.clone(), allocation))
    }

    /// A new stream on this pool's device.
    fn stream(&self) -> PyResult<PyStream> {
        let id = self.shared.lock()?.create_stream().map_err(pool_error)?;
        Ok(PyStream::new(self.shared.clone(), id))
    }

    /// Wraps a stream made elsewhere from its raw handle (`torch.cuda.current_stream().cuda_stream`,
    /// `cupy.cuda.get_current_stream().ptr`); gpupool never destroys it. CUDA devices only.
    fn external_stream(&self, handle: u64) -> PyResult<PyStream> {
        let id = self.shared.lock()?.device_mut().import_stream(handle).map_err(|e| pool_error(e.into()))?;
        Ok(PyStream::new(self.shared.clone(), id))
    }

    #[getter]
    fn default_stream(&self) -> PyStream {
        PyStream::new(self.shared.clone(), DEFAULT_STREAM)
    }

    /// Marks `ptr` as used on `stream`: its free waits for that stream's queued work.
    fn record_stream(&self, ptr: &PyDevicePtr, stream: &PyStream) -> PyResult<()> {
        if !ptr.belongs_to(&self.shared) {
            return Err(value_error("this DevicePtr belongs to another pool"));
        }
        ptr.record_stream(stream)
    }

    /// Waits for every pending event; the blocks they held back become reusable.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.shared.lock()?.synchronize().map_err(pool_error))
    }

    fn free(&self, ptr: &PyDevicePtr) -> PyResult<()> {
        if !ptr.belongs_to(&self.shared) {
            return Err(value_error("this DevicePtr belongs to another pool"));
        }
        ptr.release()
    }

    fn memory_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let entries = self.shared.lock()?.stats().entries();
        let dict = PyDict::new(py);
        for (key, value) in entries {
            dict.set_item(key, value)?;
        }
        Ok(dict)
    }

    fn memory_allocated(&self) -> PyResult<u64> {
        Ok(self.stat(Metric::AllocatedBytes)?.0)
    }

    fn memory_reserved(&self) -> PyResult<u64> {
        Ok(self.stat(Metric::ReservedBytes)?.0)
    }

    fn max_memory_allocated(&self) -> PyResult<u64> {
        Ok(self.stat(Metric::AllocatedBytes)?.1)
    }

    fn max_memory_reserved(&self) -> PyResult<u64> {
        Ok(self.stat(Metric::ReservedBytes)?.1)
    }

    fn reset_peak_memory_stats(&self) -> PyResult<()> {
        self.shared.lock()?.reset_peak_stats();
        Ok(())
    }

    /// Returns every fully free cached segment to the device.
    fn empty_cache(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.shared.lock()?.empty_cache().map_err(pool_error))?;
        Ok(())
    }

    /// Bytes the device currently holds for this pool.
    fn device_memory_held(&self) -> PyResult<u64> {
        Ok(self.shared.lock()?.device().memory_info().held)
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.shared.lock()?.check_invariants().map_err(PyAssertionError::new_err)
    }

    /// Starts recording the newest `max_entries` events (a running record is resized), or with
    /// `enabled=False` stops and discards the record.
    #[pyo3(signature = (enabled = true, max_entries = 1_000_000))]
    fn record_history(&self, enabled: bool, max_entries: usize) -> PyResult<()> {
        if max_entries == 0 {
            return Err(value_error("max_entries must be at least 1"));
        }
        self.shared.lock()?.record_history(enabled.then_some(max_entries));
        Ok(())
    }

    /// Writes the recorded history as an RMM logging CSV, gzip-compressed if `path` ends in `.gz`.
    fn dump_trace(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let trace = {
            let mut pool = self.shared.lock()?;
            let history =
                pool.history().ok_or_else(|| value_error("no history is recorded: call record_history() first"))?;
            Trace::from_history(history)
        };
        py.detach(|| csv::write_path(&trace, &path))
            .map_err(|e| PyOSError::new_err(format!("cannot write {}: {e}", path.display())))
    }

    /// PyTorch's snapshot dict: segments with their blocks, traces, settings.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (segments, settings, history) = {
            let mut pool = self.shared.lock()?;
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
                match b.state {
                    BlockState::Allocated => {
                        allocated += b.size;
                        active += b.size;
                        requested += b.requested;
                    }
                    BlockState::Pending => active += b.size,
                    BlockState::Free => {}
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
