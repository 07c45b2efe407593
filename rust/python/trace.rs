//! `gpupool._native.Trace`: a loaded allocation trace, and the snapshot form of a pool's history.

use super::error::value_error;
use crate::pool::{HistoryAction, HistoryEntry};
use crate::trace::{csv, job, Trace};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::path::PathBuf;
use std::sync::Arc;

#[pyclass(name = "Trace", module = "gpupool._native", frozen)]
pub struct PyTrace {
    pub trace: Arc<Trace>,
    name: String,
}

/// One PyTorch `device_traces` entry as the Python reader hands it over:
/// `(action, addr, size, stream, time_us)`.
type SnapshotEntry = (String, u64, u64, u64, f64);

#[pymethods]
impl PyTrace {
    /// Reads an RMM logging CSV, plain or gzip-compressed.
    #[staticmethod]
    fn read_csv(py: Python<'_>, path: PathBuf) -> PyResult<PyTrace> {
        let trace = py.detach(|| csv::read_path(&path)).map_err(value_error)?;
        Ok(PyTrace { trace: Arc::new(trace), name: path.display().to_string() })
    }

    /// Builds a trace from PyTorch snapshot entries, after allocating `live_before` (blocks
    /// allocated before recording began, as `(addr, size, stream)`) at its start; releases of
    /// cached memory become the job's events (`gpupool.trace` says which). `final_reserved` is
    /// what the snapshot's segments of the device hold: the start of the recorded reserved
    /// bytes. Errors name `name` and the entry's index.
    #[staticmethod]
    #[pyo3(signature = (name, entries, live_before, final_reserved = None))]
    fn from_snapshot_entries(
        py: Python<'_>,
        name: String,
        entries: Vec<SnapshotEntry>,
        live_before: Vec<(u64, u64, u64)>,
        final_reserved: Option<u64>,
    ) -> PyResult<PyTrace> {
        let start = entries.first().map_or(0.0, |e| e.4);
        let read: Vec<job::Entry<'_>> = entries
            .iter()
            .map(|(action, address, size, stream, time_us)| job::Entry {
                action,
                address: *address,
                size: *size,
                stream: *stream,
                time_ns: ((time_us - start).max(0.0) * 1000.0) as u64,
            })
            .collect();
        let trace =
            py.detach(|| Trace::from_snapshot(&read, &live_before, final_reserved)).map_err(|(at, e)| match at {
                Some(index) => value_error(format!("{name}, entry {index}: {e}")),
                None => value_error(format!("{name}, blocks allocated before recording: {e}")),
            })?;
        Ok(PyTrace { trace: Arc::new(trace), name })
    }

    /// How many events of each action the trace holds (`alloc`, `free`, `oom`, `empty_cache`,
    /// `oom_release`).
    fn action_counts(&self) -> std::collections::BTreeMap<&'static str, usize> {
        let mut counts = std::collections::BTreeMap::new();
        for e in self.trace.events() {
            *counts.entry(e.action.name()).or_insert(0) += 1;
        }
        counts
    }

    /// The most bytes the job could hold on its GPU, from its `oom` entries (each records the
    /// device's free bytes beside what the job had reserved); `None` without any.
    #[getter]
    fn capacity(&self) -> Option<u64> {
        self.trace.capacity()
    }

    /// Where the trace came from.
    #[getter]
    pub fn name(&self) -> &str {
        &self.name
    }

    fn __len__(&self) -> usize {
        self.trace.events().len()
    }

    /// The traced program's stream handles, in order of first use.
    #[getter]
    fn streams(&self) -> Vec<u64> {
        self.trace.streams().to_vec()
    }

    #[getter]
    fn peak_live_bytes(&self) -> u64 {
        self.trace.peak_live_bytes()
    }

    #[getter]
    fn allocations(&self) -> usize {
        self.trace.allocations()
    }

    /// Events `start..stop` as `(action, address, size, stream, time_us)` tuples.
    fn events(&self, start: usize, stop: usize) -> Vec<(&'static str, u64, u64, u64, f64)> {
        let events = self.trace.events();
        let (start, stop) = (start.min(events.len()), stop.min(events.len()));
        events[start..stop.max(start)]
            .iter()
            .map(|e| {
                (e.action.name(), e.address, e.size, self.trace.streams()[e.stream as usize], e.time_ns as f64 / 1e3)
            })
            .collect()
    }
}

/// A pool's history as PyTorch's `device_traces` entries (`oom` carries `device_free`, not `addr`).
pub fn device_trace<'py>(py: Python<'py>, entries: &[HistoryEntry]) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for e in entries {
        let d = PyDict::new(py);
        d.set_item("action", e.action.name())?;
        let address_key = if e.action == HistoryAction::Oom { "device_free" } else { "addr" };
        d.set_item(address_key, e.address)?;
        d.set_item("size", e.size)?;
        d.set_item("stream", e.stream)?;
        d.set_item("time_us", e.time_us)?;
        d.set_item("frames", PyList::empty(py))?;
        list.append(d)?;
    }
    Ok(list)
}
