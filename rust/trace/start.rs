//! Replays that begin where a recording began: the segments the traced allocator held and its
//! live blocks where they lay, then the recorded history. What PyTorch's allocator decided
//! after that point depends on that state (a warmed-up job grows into cached segments), so a
//! replay of the recorded settings is only comparable with the recorded decisions from there.

use super::replay::{bisect_capacity, checked_capacity, Cursor, JobActions, Metrics, MinCapacity, Timeline};
use super::{Event, Trace};
use crate::core::{PoolKind, SegmentId};
use crate::device::{Device, DeviceError, Sim, StreamId, DEFAULT_STREAM};
use crate::pool::{Config, HistoryAction, Pool, PoolError};
use std::time::Instant;

/// A segment the traced allocator held when recording began, at its recorded address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StartSegment {
    pub address: u64,
    pub size: u64,
    pub kind: PoolKind,
    /// The traced program's stream handle.
    pub stream: u64,
}

/// What a replay from the recorded start measured.
#[derive(Clone, Debug, PartialEq)]
pub struct FromStart {
    pub metrics: Metrics,
    /// The pool's own decisions during the history, in order (when asked for): segment
    /// allocations and releases, page maps and unmaps, with their sizes.
    pub segment_events: Vec<(HistoryAction, u64)>,
    /// Blocks live at the start that no start segment had room for where they were recorded;
    /// they were allocated as requests instead.
    pub unplaced: usize,
}

/// Seeds `pool` (fresh) with `start` and the trace's prelude blocks at their recorded
/// addresses: plain segments as they were, or for a paged pool the recorded mapped ranges as
/// mapped pages of one range per pool kind, at their recorded distances, then replays the history, repeating what `job` says of the job's
/// own actions; with `decisions`, the pool's segment decisions are recorded.
///
/// On a device too small for the whole start, segments holding live blocks are seeded first;
/// a fully free one that does not fit is left out (the allocator would give it back under that
/// pressure), one holding live blocks that does not fit counts as an out-of-memory failure.
pub fn replay_from_start<D: Device>(
    trace: &Trace,
    start: &[StartSegment],
    pool: &mut Pool<D>,
    timeline: Option<&mut Timeline>,
    decisions: bool,
    job: JobActions,
) -> Result<FromStart, PoolError> {
    replay_with(trace, start, pool, timeline, decisions, None, job).map(|(from_start, _)| from_start)
}

/// [`replay_from_start`], stopped at the first failed allocation beyond `ooms_allowed` if
/// given; also says whether it stopped so.
fn replay_with<D: Device>(
    trace: &Trace,
    start: &[StartSegment],
    pool: &mut Pool<D>,
    timeline: Option<&mut Timeline>,
    decisions: bool,
    ooms_allowed: Option<u64>,
    job: JobActions,
) -> Result<(FromStart, bool), PoolError> {
    let mut cursor = Cursor::new(trace, pool, job)?;
    if let Some(allowed) = ooms_allowed {
        cursor.stop_after_ooms(allowed);
    }
    let mut segments: Vec<StartSegment> = start.to_vec();
    segments.sort_by_key(|s| s.address);
    // From the highest address down: the free space after each block is then the recorded
    // gap to the next one, so the rules split (or do not) as they did.
    let mut prelude: Vec<(&Event, Option<usize>)> =
        trace.prelude().iter().map(|e| (e, segment_holding(&segments, e.address, e.size))).collect();
    prelude.sort_by_key(|(e, _)| std::cmp::Reverse(e.address));
    let mut holds = vec![false; segments.len()];
    for &(_, index) in &prelude {
        if let Some(i) = index {
            holds[i] = true;
        }
    }
    // Each start segment's place: the pool's segment and the segment's offset in it (a paged
    // pool holds every mapped range of a kind in one reserved range).
    let mut seeded: Vec<Option<(SegmentId, u64)>> = vec![None; segments.len()];
    let paged_ranges = if pool.is_paged() { paged_ranges(trace, &cursor, &segments, pool)? } else { Vec::new() };
    for live in [true, false] {
        for (i, s) in segments.iter().enumerate().filter(|&(i, _)| holds[i] == live) {
            let stream = pool_stream(trace, &cursor, s.stream);
            let placed = match paged_ranges.iter().find(|r| r.0 == s.kind) {
                Some(&(_, range, base)) => {
                    pool.seed_pages(range, s.address - base, s.size).map(|()| (range, s.address - base))
                }
                None if pool.is_paged() => continue,
                None => pool.seed_segment(s.size, s.kind, stream).map(|sid| (sid, 0)),
            };
            match placed {
                Ok(place) => seeded[i] = Some(place),
                Err(PoolError::Device(DeviceError::OutOfMemory { .. })) if live => cursor.count_oom(),
                Err(PoolError::Device(DeviceError::OutOfMemory { .. })) => {}
                Err(other) => return Err(other),
            }
        }
    }
    let mut unplaced = Vec::new();
    for (e, index) in prelude {
        let stream = cursor.streams[e.stream as usize];
        let placed = index
            .and_then(|i| Some((i, seeded[i]?)))
            .and_then(|(i, (sid, at))| pool.seed_block(sid, at + e.address - segments[i].address, e.size, stream));
        match placed {
            Some(a) => cursor.handles[e.slot as usize] = Some(a.handle),
            None => unplaced.push(e),
        }
    }
    for e in &unplaced {
        cursor.alloc(pool, e.slot, e.size, e.stream)?;
    }
    if cursor.failed() {
        let metrics = cursor.metrics(trace, pool, 0.0);
        return Ok((FromStart { metrics, segment_events: Vec::new(), unplaced: unplaced.len() }, true));
    }
    if decisions {
        // Every event but the prelude adds at most three entries (alloc or the two of a free).
        pool.record_history(Some(3 * trace.events().len() + 16));
    }
    let began = Instant::now();
    cursor.run(trace, pool, trace.prelude().len(), timeline)?;
    let metrics = cursor.metrics(trace, pool, began.elapsed().as_secs_f64());
    let segment_events = pool.history().map(segment_decisions).unwrap_or_default();
    pool.record_history(None);
    Ok((FromStart { metrics, segment_events, unplaced: unplaced.len() }, cursor.failed()))
}

fn segment_decisions(history: &crate::pool::History) -> Vec<(HistoryAction, u64)> {
    history
        .entries()
        .filter(|e| {
            matches!(
                e.action,
                HistoryAction::SegmentAlloc
                    | HistoryAction::SegmentFree
                    | HistoryAction::SegmentMap
                    | HistoryAction::SegmentUnmap
            )
        })
        .map(|e| (e.action, e.size))
        .collect()
}

/// Replays from the recorded start on a `sim` device of `capacity` bytes (`u64::MAX`: unlimited).
pub fn replay_from_start_sim(
    trace: &Trace,
    start: &[StartSegment],
    config: &Config,
    capacity: u64,
    job: JobActions,
) -> Result<FromStart, PoolError> {
    replay_from_start(trace, start, &mut Pool::new(Sim::new(capacity), config.clone()), None, false, job)
}

/// The smallest `sim` capacity on which the history runs from the recorded start without an
/// OOM, to within `tolerance`, given what an unlimited replay from there measured: the search
/// of [`bisect_capacity`] over seeded replays, each stopped at its first failure, then the
/// check of [`checked_capacity`]. `None` as for
/// [`min_capacity_after`](super::replay::min_capacity_after).
pub fn min_capacity_from_start(
    trace: &Trace,
    start: &[StartSegment],
    config: &Config,
    unlimited: &Metrics,
    tolerance: f64,
    job: JobActions,
) -> Result<Option<MinCapacity>, PoolError> {
    if unlimited.served_nothing() {
        return Ok(None);
    }
    let mut fits_on = |capacity| {
        let mut pool = Pool::new(Sim::new(capacity), config.clone());
        replay_with(trace, start, &mut pool, None, false, Some(unlimited.ooms), job).map(|(_, failed)| !failed)
    };
    let floor = trace.peak_live_bytes();
    match bisect_capacity(&mut fits_on, floor, unlimited.peak_reserved_bytes, tolerance)? {
        Some(found) => checked_capacity(fits_on, found, floor, tolerance).map(Some),
        None => Ok(None),
    }
}

/// For a paged pool, each pool kind's range, reserved to span that kind's start segments (the
/// mapped ranges of PyTorch's expandable segments), with the recorded address its offsets
/// count from: `(kind, range, base)`. A kind whose segments span more than any range reserves
/// (several streams' reservations far apart) is left out: its blocks are allocated instead.
fn paged_ranges<D: Device>(
    trace: &Trace,
    cursor: &Cursor,
    segments: &[StartSegment],
    pool: &mut Pool<D>,
) -> Result<Vec<(PoolKind, SegmentId, u64)>, PoolError> {
    let mut ranges = Vec::new();
    for kind in PoolKind::ALL {
        let mut of_kind = segments.iter().filter(|s| s.kind == kind);
        let Some(first) = of_kind.next() else { continue };
        let base = first.address;
        let extent = of_kind.fold(first.address + first.size, |end, s| end.max(s.address + s.size)) - base;
        match pool.seed_range(kind, pool_stream(trace, cursor, first.stream), extent) {
            Ok(range) => ranges.push((kind, range, base)),
            Err(PoolError::Device(DeviceError::OutOfMemory { .. } | DeviceError::Unsupported(_))) => {}
            Err(other) => return Err(other),
        }
    }
    Ok(ranges)
}

/// The pool stream of a traced stream handle: the trace's own, else the default stream (a
/// start segment of a stream the history never uses only matters to that stream).
fn pool_stream(trace: &Trace, cursor: &Cursor, handle: u64) -> StreamId {
    trace.streams().iter().position(|&s| s == handle).map_or(DEFAULT_STREAM, |i| cursor.streams[i])
}

/// The index of the segment (sorted by address) that holds `[address, address + size)`.
fn segment_holding(segments: &[StartSegment], address: u64, size: u64) -> Option<usize> {
    let index = segments.partition_point(|s| s.address <= address).checked_sub(1)?;
    let s = &segments[index];
    (address.checked_add(size)? <= s.address + s.size).then_some(index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Sim;
    use crate::pool::Config;
    use crate::trace::TraceBuilder;

    const MIB: u64 = 1 << 20;

    fn pytorch() -> Pool<Sim> {
        Pool::new(Sim::new(1 << 40), Config::parse("strategy:pytorch,cross_stream_reuse:never").unwrap())
    }

    /// A warmed-up job: a 40 MiB segment (made for an earlier, bigger request) holds a live
    /// 4 MiB block at its start and 36 MiB of free space. From nothing, the 30 MiB request
    /// needs a segment of its own; from the recorded start it fits in the cached one, as it
    /// did in the recorded run.
    #[test]
    fn a_cached_segment_serves_the_history() {
        let base = 0x7f00_0000_0000;
        let mut b = TraceBuilder::default();
        b.alloc(base, 4 * MIB, 0, 0).unwrap();
        b.begin_history();
        b.alloc(base + 4 * MIB, 30 * MIB, 0, 1).unwrap();
        b.free(base, 0, 2).unwrap();
        let trace = b.finish();
        assert_eq!(trace.prelude().len(), 1);
        let start = [StartSegment { address: base, size: 40 * MIB, kind: PoolKind::Large, stream: 0 }];
        let from_start = replay_from_start(&trace, &start, &mut pytorch(), None, true, JobActions::Honour).unwrap();
        assert_eq!(from_start.segment_events, []);
        assert_eq!((from_start.metrics.peak_reserved_bytes, from_start.unplaced), (40 * MIB, 0));
        let from_nothing = crate::trace::replay::replay(&trace, &mut pytorch(), None, JobActions::Honour).unwrap();
        assert_eq!(from_nothing.peak_reserved_bytes, 20 * MIB + 30 * MIB);
    }

    #[test]
    fn blocks_outside_every_start_segment_are_allocated_instead() {
        let mut b = TraceBuilder::default();
        b.alloc(0x9000_0000, 3 * MIB, 0, 0).unwrap();
        b.begin_history();
        let trace = b.finish();
        let start = [StartSegment { address: 0x1000_0000, size: 2 * MIB, kind: PoolKind::Small, stream: 0 }];
        let from_start = replay_from_start(&trace, &start, &mut pytorch(), None, true, JobActions::Honour).unwrap();
        assert_eq!(from_start.unplaced, 1);
        assert_eq!(from_start.segment_events, [], "seeding and the fallback happen before recording");
        assert_eq!(from_start.metrics.peak_reserved_bytes, 2 * MIB + 20 * MIB);
    }

    /// On a small device the live blocks' segment is seeded first, a free cached one is left
    /// out, and the search finds the least capacity: the live segment plus the growth.
    #[test]
    fn a_small_device_leaves_free_cached_segments_out() {
        let base = 0x7f00_0000_0000;
        let mut b = TraceBuilder::default();
        b.alloc(base + 100 * MIB, 4 * MIB, 0, 0).unwrap();
        b.begin_history();
        b.alloc(base + 200 * MIB, 30 * MIB, 0, 1).unwrap();
        let trace = b.finish();
        let start = [
            StartSegment { address: base, size: 64 * MIB, kind: PoolKind::Large, stream: 0 },
            StartSegment { address: base + 100 * MIB, size: 20 * MIB, kind: PoolKind::Large, stream: 0 },
        ];
        let config = Config::parse("strategy:pytorch,cross_stream_reuse:never").unwrap();
        let unlimited = replay_from_start_sim(&trace, &start, &config, u64::MAX, JobActions::Honour).unwrap();
        assert_eq!(unlimited.metrics.peak_reserved_bytes, 84 * MIB, "the 30 MiB request fits the cached 64 MiB");
        let min = min_capacity_from_start(&trace, &start, &config, &unlimited.metrics, 0.005, JobActions::Honour)
            .unwrap()
            .unwrap()
            .bytes;
        assert!((50 * MIB..=51 * MIB).contains(&min), "20 MiB live segment + a 30 MiB one: {min}");
        assert_eq!(replay_from_start_sim(&trace, &start, &config, min, JobActions::Honour).unwrap().metrics.ooms, 0);
        let short = replay_from_start_sim(&trace, &start, &config, 19 * MIB, JobActions::Honour).unwrap();
        assert!(short.metrics.ooms >= 1, "the segment holding live blocks does not fit");
    }

    /// An expandable job warmed up: two mapped 20 MiB pages hold a live 4 MiB block and free
    /// space, and a third page, mapped further on, a live 2 MiB one. The history's 30 MiB
    /// request fits on the first two pages, as it did in the recorded run: no page is mapped.
    #[test]
    fn a_paged_pool_is_seeded_with_its_mapped_pages() {
        let base = 0x7f00_0000_0000;
        let mut b = TraceBuilder::default();
        b.alloc(base, 4 * MIB, 0, 0).unwrap();
        b.alloc(base + 100 * MIB, 2 * MIB + 1, 0, 0).unwrap();
        b.begin_history();
        b.alloc(base + 4 * MIB, 30 * MIB, 0, 1).unwrap();
        b.free(base, 0, 2).unwrap();
        let trace = b.finish();
        let start = [
            StartSegment { address: base, size: 40 * MIB, kind: PoolKind::Large, stream: 0 },
            StartSegment { address: base + 100 * MIB, size: 20 * MIB, kind: PoolKind::Large, stream: 0 },
        ];
        let config = Config::parse("strategy:expandable,cross_stream_reuse:never").unwrap();
        let mut pool = Pool::new(Sim::new(1 << 40), config.clone());
        let from_start = replay_from_start(&trace, &start, &mut pool, None, true, JobActions::Honour).unwrap();
        assert_eq!((from_start.segment_events.len(), from_start.unplaced), (0, 0), "{:?}", from_start.segment_events);
        assert_eq!(from_start.metrics.peak_reserved_bytes, 60 * MIB);
        pool.check_invariants().unwrap();
        let layout: Vec<(u64, u64)> =
            pool.segments().iter().map(|s| (s.address - pool.segments()[0].address, s.size)).collect();
        assert_eq!(layout, [(0, 40 * MIB), (100 * MIB, 20 * MIB)], "the mapped ranges keep their distance");
        // From nothing the same history maps pages for every block.
        let mut fresh = Pool::new(Sim::new(1 << 40), config);
        fresh.record_history(Some(100));
        crate::trace::replay::replay(&trace, &mut fresh, None, JobActions::Honour).unwrap();
        let maps = fresh.history().unwrap().entries().filter(|e| e.action == HistoryAction::SegmentMap).count();
        assert!(maps >= 2, "{maps}");
    }
}
