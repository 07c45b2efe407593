//! `gpupool._native.replay` and its `ReplayResult`: a trace replayed on a fresh pool.

use super::device::{capacity_arg, open_device};
use super::error::{pool_error, value_error};
use super::trace::PyTrace;
use crate::device::Sim;
use crate::pool::{Config, Pool};
use crate::trace::replay::{min_capacity_after, replay as run, JobActions, Metrics, MinCapacity, Timeline};
use pyo3::prelude::*;

/// Enough points for a plot as wide as a screen.
pub(super) const TIMELINE_POINTS: usize = 2000;
/// The min-capacity search stops when its bounds are this close (a fraction of the answer):
/// 0.02%, finer than the tenths of a point by which strategies' utilizations differ. Each
/// halving of it costs one more replay.
const MIN_CAPACITY_TOLERANCE: f64 = 0.0002;

#[pyclass(name = "ReplayResult", module = "gpupool._native", frozen)]
pub struct PyReplayResult {
    trace: String,
    config: String,
    device: String,
    capacity: Option<u64>,
    metrics: Metrics,
    min_capacity: Option<MinCapacity>,
    timeline: Timeline,
}

/// How much of the job's own actions a replay repeats, by name: `ignore`, `honour` (the
/// default) or `as_run` (see [`JobActions`]).
pub(super) fn job_actions(name: &str) -> PyResult<JobActions> {
    match name {
        "ignore" => Ok(JobActions::Ignore),
        "honour" => Ok(JobActions::Honour),
        "as_run" => Ok(JobActions::AsRun),
        other => Err(value_error(format!("job must be 'ignore', 'honour' or 'as_run', not {other:?}"))),
    }
}

impl PyReplayResult {
    /// A result for `trace` replayed with `config` on a `sim` device (`None`: unlimited).
    pub(super) fn on_sim(
        trace: &PyTrace,
        config: &str,
        capacity: Option<u64>,
        metrics: Metrics,
        min_capacity: Option<MinCapacity>,
        timeline: Timeline,
    ) -> Self {
        let (trace, config, device) = (trace.name().to_string(), config.to_string(), "sim".to_string());
        PyReplayResult { trace, config, device, capacity, metrics, min_capacity, timeline }
    }
}

#[pymethods]
impl PyReplayResult {
    #[getter]
    fn trace(&self) -> &str {
        &self.trace
    }

    /// The configuration string the pool used (empty for the default).
    #[getter]
    fn config(&self) -> &str {
        &self.config
    }

    #[getter]
    fn device(&self) -> &str {
        &self.device
    }

    #[getter]
    fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    #[getter]
    fn events(&self) -> usize {
        self.metrics.events
    }

    #[getter]
    fn peak_live_bytes(&self) -> u64 {
        self.metrics.peak_live_bytes
    }

    #[getter]
    fn peak_reserved_bytes(&self) -> u64 {
        self.metrics.peak_reserved_bytes
    }

    #[getter]
    fn utilization(&self) -> f64 {
        self.metrics.utilization()
    }

    #[getter]
    fn device_allocs(&self) -> u64 {
        self.metrics.device_allocs
    }

    /// Driver calls that obtain or return memory, as the CUDA backend makes them.
    #[getter]
    fn device_calls(&self) -> u64 {
        self.metrics.device_calls
    }

    /// Those calls by kind: malloc, free, reserve, unreserve, create, map, set_access, unmap,
    /// release.
    #[getter]
    fn driver_calls(&self) -> std::collections::BTreeMap<&'static str, u64> {
        self.metrics.driver_calls.entries().into_iter().collect()
    }

    #[getter]
    fn device_calls_per_1k_allocs(&self) -> f64 {
        self.metrics.device_calls_per_1k_allocs()
    }

    #[getter]
    fn ooms(&self) -> u64 {
        self.metrics.ooms
    }

    /// Of `ooms`, the requests that failed when the trace was recorded too.
    #[getter]
    fn ooms_as_recorded(&self) -> u64 {
        self.metrics.ooms_as_recorded
    }

    /// The job's releases of cached memory the replay repeated (`empty_cache()` calls, and
    /// with `job='as_run'` the out-of-memory path's).
    #[getter]
    fn releases(&self) -> u64 {
        self.metrics.releases
    }

    #[getter]
    fn seconds(&self) -> f64 {
        self.metrics.seconds
    }

    #[getter]
    fn events_per_second(&self) -> f64 {
        self.metrics.events_per_second()
    }

    /// The smallest capacity that runs the trace; `None` when not searched for, or when none
    /// does: the search gives up at about 7,500 times the unlimited peak reserved (a tiny
    /// `per_process_memory_fraction`, say), and a trace whose every allocation fails even on
    /// an unlimited device runs on none.
    #[getter]
    fn min_capacity_bytes(&self) -> Option<u64> {
        self.min_capacity.map(|m| m.bytes)
    }

    /// Whether the bisection's answer did not hold when checked (the trace failed on it, or
    /// also ran a search tolerance below it) and a search past it found `min_capacity_bytes`.
    #[getter]
    fn min_capacity_corrected(&self) -> bool {
        self.min_capacity.is_some_and(|m| m.corrected)
    }

    /// The trace's peak live bytes over the smallest capacity that fits it.
    #[getter]
    fn min_capacity_utilization(&self) -> Option<f64> {
        self.min_capacity_bytes().map(|c| self.metrics.peak_live_bytes as f64 / c.max(1) as f64)
    }

    /// `(event_index, reserved_bytes, live_bytes)`: each point is the highest value over the
    /// events from its index to the next point's.
    #[getter]
    fn timeline(&self) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
        let t = &self.timeline;
        (t.event_index.clone(), t.reserved_bytes.clone(), t.live_bytes.clone())
    }

    /// The recorded run's reserved bytes at the points of `timeline`, where the trace's
    /// snapshot recorded its segments (an empty list otherwise).
    #[getter]
    fn recorded_reserved_bytes(&self) -> Vec<u64> {
        self.timeline.recorded_bytes.clone()
    }

    /// The most the replay's reserved bytes differed from the recorded run's at any event;
    /// `None` where the trace does not know the recorded ones.
    #[getter]
    fn largest_gap_bytes(&self) -> Option<u64> {
        self.timeline.largest_gap_bytes
    }

    fn __repr__(&self) -> String {
        format!(
            "ReplayResult(trace={:?}, config={:?}, peak_live_bytes={}, peak_reserved_bytes={}, utilization={:.3}, ooms={})",
            self.trace,
            self.config,
            self.metrics.peak_live_bytes,
            self.metrics.peak_reserved_bytes,
            self.metrics.utilization(),
            self.metrics.ooms
        )
    }
}

/// Replays `trace` on a fresh pool over `device` (`sim` without a capacity is unlimited),
/// repeating what `job` names of the job's own actions; with `min_capacity`, also bisects for
/// the smallest `sim` capacity without an OOM.
#[pyfunction]
#[pyo3(signature = (trace, config = None, capacity = None, min_capacity = false, device = "sim", tolerance = None, job = "honour"))]
#[allow(clippy::too_many_arguments)]
pub fn replay(
    py: Python<'_>,
    trace: &PyTrace,
    config: Option<&str>,
    capacity: Option<&Bound<'_, PyAny>>,
    min_capacity: bool,
    device: &str,
    tolerance: Option<f64>,
    job: &str,
) -> PyResult<PyReplayResult> {
    let job = job_actions(job)?;
    let tolerance = tolerance.unwrap_or(MIN_CAPACITY_TOLERANCE);
    if !(tolerance > 0.0 && tolerance < 1.0) {
        return Err(value_error(format!("tolerance must lie between 0 and 1, not {tolerance}")));
    }
    let config_text = config.unwrap_or("").to_string();
    let parsed = Config::parse(&config_text).map_err(value_error)?;
    let capacity = capacity_arg(capacity)?;
    let backend = match (device, capacity) {
        ("sim", None) => open_device("sim", Some(u64::MAX))?,
        _ => open_device(device, capacity)?,
    };
    let events = trace.trace.clone();
    // The replay itself is the search's unlimited one when it ran on an unlimited `sim`.
    let unlimited = device == "sim" && capacity.is_none();
    let (metrics, min_capacity, timeline) = py
        .detach(move || {
            let mut timeline = Timeline::new(events.events().len(), TIMELINE_POINTS);
            let metrics = run(&events, &mut Pool::new(backend, parsed.clone()), Some(&mut timeline), job)?;
            let min = match (min_capacity, unlimited) {
                (false, _) => None,
                (true, true) => min_capacity_after(&events, &parsed, &metrics, tolerance, job)?,
                (true, false) => {
                    let unlimited = run(&events, &mut Pool::new(Sim::new(u64::MAX), parsed.clone()), None, job)?;
                    min_capacity_after(&events, &parsed, &unlimited, tolerance, job)?
                }
            };
            Ok((metrics, min, timeline))
        })
        .map_err(pool_error)?;
    Ok(PyReplayResult {
        trace: trace.name().to_string(),
        config: config_text,
        device: device.to_string(),
        capacity,
        metrics,
        min_capacity,
        timeline,
    })
}
