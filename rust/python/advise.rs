//! `gpupool._native.replay_from_start`, `matched_in_order` and the history walks: what
//! `gpupool advise` needs beyond plain replays, to check a replay of the recorded settings
//! against the recorded run and to find the allocation sites at the peak.

use super::error::{pool_error, value_error};
use super::replay::{job_actions, PyReplayResult, TIMELINE_POINTS};
use super::trace::PyTrace;
use crate::core::PoolKind;
use crate::device::Sim;
use crate::pool::{Config, Pool};
use crate::trace::fidelity;
use crate::trace::replay::Timeline;
use crate::trace::rows::{self, BlockAction, Row};
use crate::trace::start::{self, StartSegment};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

/// How close `gpupool advise`'s min-capacity searches get (a fraction of the answer): it calls
/// savings below that share none (`gpupool._advice.advice.TOLERANCE`), so a finer search would
/// only cost replays.
const ADVICE_TOLERANCE: f64 = 0.005;

/// One start segment as the Python side hands it over: `(address, size, is_small, stream)`.
type StartTuple = (u64, u64, bool, u64);
/// The result, the pool's segment decisions `(action, size)` and the unplaced prelude blocks.
type FromStartTuple = (PyReplayResult, Vec<(&'static str, u64)>, usize);

/// Replays `trace` with `config` (plain segments only) on a `sim` device of `capacity` bytes
/// (unlimited by default), from the segments in `start` and the trace's prelude blocks where
/// they were recorded, repeating what `job` names of the job's own actions (`honour`, or
/// `as_run` for the configuration that ran); with `min_capacity`, also searches for the
/// smallest capacity that runs it so. Returns the result,
/// the pool's segment decisions `(action, size)` in order (with `decisions`), and how many
/// prelude blocks had to be allocated because no start segment held them.
#[pyfunction]
#[pyo3(signature = (trace, config, start, min_capacity = false, decisions = false, capacity = None, job = "honour"))]
#[allow(clippy::too_many_arguments)]
pub fn replay_from_start(
    py: Python<'_>,
    trace: &PyTrace,
    config: &str,
    start: Vec<StartTuple>,
    min_capacity: bool,
    decisions: bool,
    capacity: Option<u64>,
    job: &str,
) -> PyResult<FromStartTuple> {
    let job = job_actions(job)?;
    let parsed = Config::parse(config).map_err(value_error)?;
    let segments: Vec<StartSegment> = start
        .into_iter()
        .map(|(address, size, small, stream)| {
            let kind = if small { PoolKind::Small } else { PoolKind::Large };
            StartSegment { address, size, kind, stream }
        })
        .collect();
    let events = trace.trace.clone();
    let (from_start, timeline, min) = py
        .detach(move || {
            let mut timeline = Timeline::new(events.events().len(), TIMELINE_POINTS);
            let mut pool = Pool::new(Sim::new(capacity.unwrap_or(u64::MAX)), parsed.clone());
            let run = start::replay_from_start(&events, &segments, &mut pool, Some(&mut timeline), decisions, job)?;
            let min = if min_capacity {
                // An unlimited run is the search's first step; after a limited one it is redone.
                let unlimited = match capacity {
                    None => run.metrics.clone(),
                    Some(_) => start::replay_from_start_sim(&events, &segments, &parsed, u64::MAX, job)?.metrics,
                };
                start::min_capacity_from_start(&events, &segments, &parsed, &unlimited, ADVICE_TOLERANCE, job)?
            } else {
                None
            };
            Ok((run, timeline, min))
        })
        .map_err(pool_error)?;
    let decisions = from_start.segment_events.iter().map(|(action, size)| (action.name(), *size)).collect();
    let result = PyReplayResult::on_sim(trace, config, capacity, from_start.metrics, min, timeline);
    Ok((result, decisions, from_start.unplaced))
}

/// The keys of `config` that are accepted without affecting device memory; a bad config is a
/// ValueError naming the key.
#[pyfunction]
pub fn inert_keys(config: &str) -> PyResult<Vec<&'static str>> {
    Ok(Config::parse(config).map_err(value_error)?.inert)
}

/// How many items of `recorded` `replayed` reproduces alike and in the same order (their
/// longest common subsequence); `None` when they differ by more than `max_edits` insertions
/// and deletions.
#[pyfunction]
pub fn matched_in_order(
    py: Python<'_>,
    recorded: Vec<(String, u64)>,
    replayed: Vec<(String, u64)>,
    max_edits: usize,
) -> Option<usize> {
    py.detach(|| fidelity::matched_in_order(&recorded, &replayed, max_edits))
}

/// Snapshot history rows `(action, address, size, stream, time_us)` as the walks read them.
fn block_rows(rows: &Bound<'_, PyList>) -> PyResult<Vec<Row>> {
    let mut read = Vec::with_capacity(rows.len());
    for row in rows.iter() {
        let row = row.cast::<PyTuple>()?;
        let action = match row.get_borrowed_item(0)?.cast::<PyString>()?.to_str()? {
            "alloc" => BlockAction::Alloc,
            "free_completed" => BlockAction::FreeCompleted,
            _ => BlockAction::None,
        };
        let (address, size) = match action {
            BlockAction::None => (0, 0),
            _ => (row.get_borrowed_item(1)?.extract()?, row.get_borrowed_item(2)?.extract()?),
        };
        read.push(Row { action, address, size });
    }
    Ok(read)
}

/// The index of each address's first alloc or completed free in `rows`, in the order the
/// addresses first appear.
#[pyfunction]
pub fn first_block_rows(rows: &Bound<'_, PyList>) -> PyResult<Vec<usize>> {
    Ok(rows::first_block_rows(&block_rows(rows)?))
}

/// The blocks live when the requested bytes live in `rows` first peaked, from the blocks
/// `start` `(address, size)` live before them, as `(row, address, size)` (`row` None for a
/// start block); see `rust/trace/rows.rs` for how they are counted.
#[pyfunction]
pub fn live_at_peak(rows: &Bound<'_, PyList>, start: Vec<(u64, u64)>) -> PyResult<Vec<(Option<usize>, u64, u64)>> {
    let blocks = rows::live_at_peak(&block_rows(rows)?, &start);
    Ok(blocks.into_iter().map(|b| (b.row, b.address, b.size)).collect())
}
