//! `gpupool.Pool`: the Python face of one pool; the GIL is released whenever the device is called.

use super::device::{capacity_arg, open_device};
use super::device_ptr::PyDevicePtr;
use super::error::{poisoned, pool_error, size_arg, value_error};
use crate::core::{BlockState, Metric, StatType};
use crate::device::{Device, FaultPlan, Faulty};
use crate::pool::{Config, Pool, DEFAULT_STREAM};
use pyo3::exceptions::PyAssertionError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
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

/// PyTorch's block state strings (torch/csrc/cuda/memory_snapshot.cpp).
fn block_state(state: BlockState) -> &'static str {
    match state {
        BlockState::Allocated => "active_allocated",
        BlockState::Pending => "active_pending_free",
        BlockState::Free => "inactive",
    }
}

impl PyPool {
    fn stat(&self, metric: Metric) -> PyResult<(u64, u64)> {
        let s = self.shared.lock()?.stats().get(metric, StatType::All);
        Ok((s.current, s.peak))
    }
}

#[pymethods]
impl PyPool {
    #[new]
    #[pyo3(signature = (device = "host", capacity = None, config = None, inject_faults = None))]
    fn new(
        device: &str,
        capacity: Option<&Bound<'_, PyAny>>,
        config: Option<&str>,
        inject_faults: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let capacity = capacity_arg(capacity)?;
        let config = Config::parse(config.unwrap_or("")).map_err(value_error)?;
        let mut backend = open_device(device, capacity)?;
        if let Some(spec) = inject_faults {
            backend = Box::new(Faulty::new(backend, fault_plan(spec)?));
        }
        let host_accessible = backend.host_accessible();
        let shared = Shared {
            pool: Mutex::new(Pool::new(backend, config)),
            device: device.to_string(),
            capacity,
            host_accessible,
        };
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

    /// Effective settings, as `key -> value` strings.
    #[getter]
    fn config(&self) -> PyResult<Vec<(&'static str, String)>> {
        Ok(self.shared.lock()?.config().entries())
    }

    fn alloc(&self, py: Python<'_>, size: &Bound<'_, PyAny>) -> PyResult<PyDevicePtr> {
        let size = size_arg(size, "size")?;
        if size == 0 {
            return Ok(PyDevicePtr::empty(self.shared.clone()));
        }
        // The cache answers without the device: keep the GIL, it is cheaper than a release.
        let cached = self.shared.lock()?.alloc_cached(size, DEFAULT_STREAM).map_err(pool_error)?;
        let allocation = match cached {
            Some(a) => a,
            None => py.detach(|| self.shared.lock()?.alloc(size).map_err(pool_error))?,
        };
        Ok(PyDevicePtr::new(self.shared.clone(), allocation))
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

    /// PyTorch's snapshot dict: segments with their blocks, traces, settings.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (segments, settings) = {
            let pool = self.shared.lock()?;
            (pool.segments(), pool.config().entries())
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
            d.set_item("is_expandable", false)?;
            d.set_item("frames", PyList::empty(py))?;
            d.set_item("blocks", blocks)?;
            list.append(d)?;
        }
        let snapshot = PyDict::new(py);
        snapshot.set_item("segments", list)?;
        snapshot.set_item("device_traces", PyList::new(py, [PyList::empty(py)])?)?;
        let settings_dict = PyDict::new(py);
        for (key, value) in settings {
            settings_dict.set_item(key, value)?;
        }
        snapshot.set_item("allocator_settings", settings_dict)?;
        Ok(snapshot)
    }
}
