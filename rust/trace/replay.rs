//! Replay: a trace's allocations and frees run on a pool, with the figures that say how well the
//! pool packed them and the smallest device they fit on.

use super::{Action, Trace};
use crate::core::{DriverCalls, Handle, Metric, StatType, Stats};
use crate::device::{Device, Sim, StreamId};
use crate::pool::{Config, Pool, PoolError, DEFAULT_STREAM};
use std::time::Instant;

/// What one replay measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Metrics {
    pub events: usize,
    /// Most bytes the trace's allocations held at once, as requested (failed ones excluded).
    pub peak_live_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Segments obtained from the device.
    pub device_allocs: u64,
    /// Driver calls that obtain or return device memory, as the CUDA backend makes them (each
    /// costs microseconds on a GPU): [`Metrics::driver_calls`] summed.
    pub device_calls: u64,
    /// Those calls by kind.
    pub driver_calls: DriverCalls,
    /// Allocations attempted (the unit of `device_calls_per_1k_allocs`).
    pub allocations: u64,
    /// Allocations the pool could not serve: skipped, and their frees ignored.
    pub ooms: u64,
    pub seconds: f64,
}

impl Metrics {
    /// Peak live / peak reserved (1 when nothing was reserved: nothing was wasted).
    pub fn utilization(&self) -> f64 {
        if self.peak_reserved_bytes == 0 {
            1.0
        } else {
            self.peak_live_bytes as f64 / self.peak_reserved_bytes as f64
        }
    }

    pub fn device_calls_per_1k_allocs(&self) -> f64 {
        1000.0 * self.device_calls as f64 / self.allocations.max(1) as f64
    }

    pub fn events_per_second(&self) -> f64 {
        self.events as f64 / self.seconds.max(1e-9)
    }

    /// Whether allocations failed and none was served: on an unlimited device, no capacity runs
    /// any of the trace (and a search, which lets those failures be, would say it fits in 0).
    pub fn served_nothing(&self) -> bool {
        self.ooms > 0 && self.peak_live_bytes == 0
    }
}

/// Reserved and live bytes over event index, downsampled to at most a fixed number of points:
/// each point is the highest value over its stretch of events, so peaks survive.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// Index of the first event of each stretch.
    pub event_index: Vec<u64>,
    pub reserved_bytes: Vec<u64>,
    pub live_bytes: Vec<u64>,
    stride: usize,
}

impl Timeline {
    pub fn new(events: usize, max_points: usize) -> Self {
        Timeline { stride: events.div_ceil(max_points.max(1)).max(1), ..Timeline::default() }
    }

    fn sample(&mut self, index: usize, reserved: u64, live: u64) {
        if index.is_multiple_of(self.stride) {
            self.event_index.push(index as u64);
            self.reserved_bytes.push(reserved);
            self.live_bytes.push(live);
        } else if let (Some(r), Some(l)) = (self.reserved_bytes.last_mut(), self.live_bytes.last_mut()) {
            *r = (*r).max(reserved);
            *l = (*l).max(live);
        }
    }
}

/// Every CUDA driver call that obtains or returns device memory, as the CUDA backend makes them
/// for what the pool did (see [`DriverCalls`]): the one place that says what a driver call is.
pub fn driver_calls(stats: &Stats) -> u64 {
    stats.driver.total()
}

/// A replay in progress: the pool's stream for each trace stream, the live allocations by
/// slot, and the counts so far.
pub(super) struct Cursor {
    pub streams: Vec<StreamId>,
    pub handles: Vec<Option<Handle>>,
    ooms: u64,
    allocations: u64,
    /// Stop once more allocations than this failed: a capacity probe needs no more.
    ooms_allowed: Option<u64>,
}

impl Cursor {
    /// Each trace stream gets a stream of the pool (the traced program's null stream is the
    /// default stream), so blocks pass between streams only as the pool's configuration allows.
    pub fn new<D: Device>(trace: &Trace, pool: &mut Pool<D>) -> Result<Self, PoolError> {
        let streams = trace
            .streams()
            .iter()
            .map(|&s| if s == 0 { Ok(DEFAULT_STREAM) } else { pool.create_stream() })
            .collect::<Result<Vec<StreamId>, _>>()?;
        Ok(Cursor { streams, handles: vec![None; trace.allocations()], ooms: 0, allocations: 0, ooms_allowed: None })
    }

    /// Makes [`Cursor::run`] stop at the allocation that fails beyond `allowed`.
    pub fn stop_after_ooms(&mut self, allowed: u64) {
        self.ooms_allowed = Some(allowed);
    }

    /// Whether more allocations failed than allowed (the replay stopped there).
    pub fn failed(&self) -> bool {
        self.ooms_allowed.is_some_and(|allowed| self.ooms > allowed)
    }

    /// Runs the trace's events `from..` on `pool`.
    pub fn run<D: Device>(
        &mut self,
        trace: &Trace,
        pool: &mut Pool<D>,
        from: usize,
        mut timeline: Option<&mut Timeline>,
    ) -> Result<(), PoolError> {
        for (index, e) in trace.events().iter().enumerate().skip(from) {
            match e.action {
                // A zero-byte allocation holds no memory.
                Action::Alloc if e.size == 0 => {}
                Action::Alloc => {
                    self.alloc(pool, e.slot, e.size, e.stream)?;
                    if self.failed() {
                        return Ok(());
                    }
                }
                Action::Free => {
                    if let Some(handle) = self.handles[e.slot as usize].take() {
                        pool.free(handle)?;
                    }
                }
                Action::Failure => {}
            }
            if let Some(t) = timeline.as_deref_mut() {
                let current = |m| pool.stats().get(m, StatType::All).current;
                t.sample(index, current(Metric::ReservedBytes), current(Metric::RequestedBytes));
            }
        }
        Ok(())
    }

    /// Allocates `size` bytes for `slot` on trace stream `stream`; a failure is counted.
    pub fn alloc<D: Device>(&mut self, pool: &mut Pool<D>, slot: u32, size: u64, stream: u32) -> Result<(), PoolError> {
        self.allocations += 1;
        match pool.alloc_on(size, self.streams[stream as usize]) {
            Ok(a) => self.handles[slot as usize] = Some(a.handle),
            // A request beyond any device's size fails like one beyond this device's.
            Err(PoolError::OutOfMemory(_) | PoolError::InvalidSize(_)) => self.ooms += 1,
            Err(other) => return Err(other),
        }
        Ok(())
    }

    /// Counts an allocation that failed before the events ran (a start that does not fit).
    pub fn count_oom(&mut self) {
        self.ooms += 1;
    }

    pub fn metrics<D: Device>(&self, trace: &Trace, pool: &Pool<D>, seconds: f64) -> Metrics {
        let stats = pool.stats();
        Metrics {
            events: trace.events().len(),
            peak_live_bytes: stats.get(Metric::RequestedBytes, StatType::All).peak,
            peak_reserved_bytes: stats.get(Metric::ReservedBytes, StatType::All).peak,
            device_allocs: stats.num_device_alloc,
            device_calls: driver_calls(stats),
            driver_calls: stats.driver,
            allocations: self.allocations,
            ooms: self.ooms,
            seconds,
        }
    }
}

/// Runs `trace` on `pool` (which should be fresh: its peaks are the replay's), from nothing:
/// the blocks live before recording began are allocated first.
pub fn replay<D: Device>(
    trace: &Trace,
    pool: &mut Pool<D>,
    timeline: Option<&mut Timeline>,
) -> Result<Metrics, PoolError> {
    let mut cursor = Cursor::new(trace, pool)?;
    let start = Instant::now();
    cursor.run(trace, pool, 0, timeline)?;
    Ok(cursor.metrics(trace, pool, start.elapsed().as_secs_f64()))
}

/// Replays `trace` on a fresh pool over a `sim` device of `capacity` bytes.
pub fn replay_sim(trace: &Trace, config: &Config, capacity: u64) -> Result<Metrics, PoolError> {
    replay(trace, &mut Pool::new(Sim::new(capacity), config.clone()), None)
}

/// The peak bytes reserved when `trace` replays on a `sim` device of `capacity` bytes with at
/// most `ooms` failed allocations, or `None` if it fails more often; stops at the first failure
/// beyond them.
fn fits_sim(trace: &Trace, config: &Config, capacity: u64, ooms: u64) -> Result<Option<u64>, PoolError> {
    let mut pool = Pool::new(Sim::new(capacity), config.clone());
    let mut cursor = Cursor::new(trace, &mut pool)?;
    cursor.stop_after_ooms(ooms);
    cursor.run(trace, &mut pool, 0, None)?;
    Ok((!cursor.failed()).then(|| pool.stats().get(Metric::ReservedBytes, StatType::All).peak))
}

/// The smallest `sim` capacity on which `trace` replays without an OOM, to within `tolerance`
/// (a fraction of the answer), or `None` if none does. See [`min_capacity_after`].
pub fn min_capacity(trace: &Trace, config: &Config, tolerance: f64) -> Result<Option<u64>, PoolError> {
    min_capacity_after(trace, config, &replay_sim(trace, config, u64::MAX)?, tolerance)
}

/// [`min_capacity`], given what a replay on an unlimited `sim` device measured: the bisection of
/// [`bisect_capacity`], then the peak the replay on the capacity found reserved, if the trace
/// fits on exactly that too. The bisection ends anywhere in its last interval, while a pool's
/// reservations move in whole segments or pages: so the answer is what the pool needs, and two
/// strategies that need the same pages read the same. `None` when no capacity runs the trace:
/// the search finds none, or the unlimited replay served none of its allocations.
pub fn min_capacity_after(
    trace: &Trace,
    config: &Config,
    unlimited: &Metrics,
    tolerance: f64,
) -> Result<Option<u64>, PoolError> {
    if unlimited.served_nothing() {
        return Ok(None);
    }
    // Requests no device could hold fail everywhere; they do not count against a capacity.
    let mut least: Option<(u64, u64)> = None;
    let fits_on = |capacity| {
        let peak = fits_sim(trace, config, capacity, unlimited.ooms)?;
        if let Some(peak) = peak.filter(|_| least.is_none_or(|(fitted, _)| capacity < fitted)) {
            least = Some((capacity, peak));
        }
        Ok(peak.is_some())
    };
    let floor = trace.peak_live_bytes();
    let Some(found) = bisect_capacity(fits_on, floor, unlimited.peak_reserved_bytes, tolerance)? else {
        return Ok(None);
    };
    match least {
        Some((fitted, peak)) if fitted == found && peak < found => {
            Ok(Some(if fits_sim(trace, config, peak, unlimited.ooms)?.is_some() { peak } else { found }))
        }
        _ => Ok(Some(found)),
    }
}

/// Bisects for the smallest capacity `fits_on`, between `floor` (below which nothing fits: the
/// peak live bytes) and a capacity shown to fit: usually `unlimited_peak`, the peak reserved
/// bytes of an unlimited replay, but a pool whose limit follows the capacity (a memory
/// fraction) or whose segments do (strategies that size them by what is left) may need more,
/// so that bound is replayed too and raised until it fits. The answer is always a capacity
/// that was replayed; `None` when none fits.
pub fn bisect_capacity(
    mut fits_on: impl FnMut(u64) -> Result<bool, PoolError>,
    floor: u64,
    unlimited_peak: u64,
    tolerance: f64,
) -> Result<Option<u64>, PoolError> {
    let mut fits = unlimited_peak.max(1);
    let mut raises = 0;
    while !fits_on(fits)? {
        raises += 1;
        if raises > MAX_RAISES {
            return Ok(None);
        }
        fits = fits.saturating_add((fits / 4).max(1));
    }
    let mut fails = floor.min(fits);
    // At least a byte apart: below 1 / tolerance bytes the relative step rounds to 0, and a
    // midpoint between neighbours would be `fails` forever.
    while fits - fails > ((fits as f64 * tolerance) as u64).max(1) {
        let middle = fails + (fits - fails) / 2;
        if fits_on(middle)? {
            fits = middle;
        } else {
            fails = middle;
        }
    }
    Ok(Some(fits))
}

/// How many times [`bisect_capacity`] raises its upper bound by a quarter (x 1.25^40, about
/// 7500) before it reports that no capacity fits.
const MAX_RAISES: u32 = 40;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::Rules;
    use crate::device::Host;
    use crate::trace::TraceBuilder;

    const MIB: u64 = 1 << 20;

    /// Tiny capacities, where tolerance x capacity is under a byte, and upper bounds under 4
    /// bytes, which a quarter does not raise: the search still ends, at the smallest that fits.
    #[test]
    fn bisection_ends_on_capacities_of_a_few_bytes() {
        for least in [1u64, 2, 3, 5, 137, 4_999] {
            for start in [1u64, 2, least] {
                let found = bisect_capacity(|c| Ok(c >= least), 0, start, 0.0002).unwrap();
                assert_eq!(found, Some(least), "least {least}, starting at {start}");
            }
        }
    }

    /// Two 8 MiB tensors, one freed, then a 12 MiB one.
    fn small_trace() -> Trace {
        let mut b = TraceBuilder::default();
        b.alloc(0x1000, 8 * MIB, 0, 0).unwrap();
        b.alloc(0x2000, 8 * MIB, 0, 1).unwrap();
        b.free(0x1000, 0, 2).unwrap();
        b.alloc(0x3000, 12 * MIB, 0, 3).unwrap();
        b.free(0x2000, 0, 4).unwrap();
        b.free(0x3000, 0, 5).unwrap();
        b.finish()
    }

    #[test]
    fn measures_peaks_and_device_allocations() {
        let trace = small_trace();
        assert_eq!(trace.peak_live_bytes(), 20 * MIB);
        let m = replay_sim(&trace, &Config::parse("strategy:pytorch").unwrap(), u64::MAX).unwrap();
        // Both 8 MiB requests share one 20 MiB segment; the 12 MiB one needs its own.
        assert_eq!((m.peak_live_bytes, m.peak_reserved_bytes, m.device_allocs, m.ooms), (20 * MIB, 32 * MIB, 2, 0));
        assert!((m.utilization() - 20.0 / 32.0).abs() < 1e-12);
        assert_eq!(m.events, 6);
    }

    #[test]
    fn an_oom_is_counted_and_its_free_ignored() {
        let m = replay_sim(&small_trace(), &Config::parse("strategy:pytorch").unwrap(), 24 * MIB).unwrap();
        assert_eq!((m.ooms, m.peak_reserved_bytes), (1, 20 * MIB));
    }

    #[test]
    fn min_capacity_fits_and_a_little_less_does_not() {
        let (trace, config) = (small_trace(), Config::parse("strategy:pytorch").unwrap());
        let min = min_capacity(&trace, &config, 0.005).unwrap().unwrap();
        assert_eq!(replay_sim(&trace, &config, min).unwrap().ooms, 0);
        assert!(replay_sim(&trace, &config, min - min / 100).unwrap().ooms > 0);
        assert!(min <= 32 * MIB);
    }

    /// A pager reserves whole pages: the answer is a number of pages that fits, one fewer does
    /// not, and no bisection interval's end in between.
    #[test]
    fn min_capacity_is_what_the_pool_reserves() {
        for strategy in ["pages", "default"] {
            let (trace, config) = (small_trace(), Config::parse(&format!("strategy:{strategy}")).unwrap());
            let min = min_capacity(&trace, &config, 0.005).unwrap().unwrap();
            assert_eq!(min % (2 * MIB), 0, "{strategy}: {min}");
            assert_eq!(replay_sim(&trace, &config, min).unwrap().ooms, 0);
            assert!(replay_sim(&trace, &config, min - 2 * MIB).unwrap().ooms > 0);
        }
    }

    /// With a memory fraction the pool's limit follows the capacity: at the unlimited replay's
    /// peak only half of it may be used, so the search must raise its bound before bisecting.
    #[test]
    fn a_memory_fraction_raises_the_bound() {
        let (trace, config) =
            (small_trace(), Config::parse("strategy:pytorch,per_process_memory_fraction:0.5").unwrap());
        let unlimited = replay_sim(&trace, &config, u64::MAX).unwrap();
        assert!(replay_sim(&trace, &config, unlimited.peak_reserved_bytes).unwrap().ooms > 0);
        let min = min_capacity(&trace, &config, 0.005).unwrap().unwrap();
        assert_eq!(replay_sim(&trace, &config, min).unwrap().ooms, 0);
        assert!(min >= 2 * trace.peak_live_bytes());
    }

    /// A trace whose every allocation fails even on an unlimited device runs on no capacity: the
    /// search lets such failures be, and used to answer 0 bytes beside them. One allocation that
    /// is served is enough for an answer.
    #[test]
    fn a_trace_no_device_serves_fits_no_capacity() {
        let impossible = |served: Option<u64>| {
            let mut b = TraceBuilder::default();
            b.alloc(0x1000, Rules::MAX_REQUEST + 1, 0, 0).unwrap();
            b.free(0x1000, 0, 1).unwrap();
            b.alloc(0x2000, 1 << 63, 0, 2).unwrap();
            if let Some(size) = served {
                b.alloc(0x3000, size, 0, 3).unwrap();
            }
            b.finish()
        };
        for strategy in ["pytorch", "default", "bfc"] {
            let config = Config::parse(&format!("strategy:{strategy}")).unwrap();
            let trace = impossible(None);
            assert_eq!(replay_sim(&trace, &config, u64::MAX).unwrap().ooms, 2, "{strategy}");
            assert_eq!(min_capacity(&trace, &config, 0.005).unwrap(), None, "{strategy}");
            let min = min_capacity(&impossible(Some(8 * MIB)), &config, 0.005).unwrap();
            assert!(min.is_some_and(|min| min >= 8 * MIB), "{strategy}: {min:?}");
        }
    }

    #[test]
    fn host_and_sim_agree() {
        let trace = small_trace();
        let config = Config::parse("strategy:pytorch").unwrap();
        let on_host = replay(&trace, &mut Pool::new(Host::new(Some(64 * MIB)), config.clone()), None).unwrap();
        let on_sim = replay_sim(&trace, &config, 64 * MIB).unwrap();
        assert_eq!(
            (on_host.peak_reserved_bytes, on_host.device_allocs),
            (on_sim.peak_reserved_bytes, on_sim.device_allocs)
        );
    }

    /// Stream 7 frees 8 MiB that stream 9 then asks for: PyTorch's rule (`never`) makes a second
    /// segment, the default reuses the block once the free's event has completed.
    #[test]
    fn each_trace_stream_replays_on_its_own_pool_stream() {
        let mut b = TraceBuilder::default();
        b.alloc(0x1000, 8 * MIB, 7, 0).unwrap();
        b.free(0x1000, 7, 1).unwrap();
        b.alloc(0x2000, 8 * MIB, 9, 2).unwrap();
        b.free(0x2000, 9, 3).unwrap();
        let trace = b.finish();
        let never = Config::parse("strategy:pytorch,cross_stream_reuse:never").unwrap();
        assert_eq!(replay_sim(&trace, &never, u64::MAX).unwrap().device_allocs, 2);
        let completed = Config::parse("strategy:pytorch").unwrap();
        assert_eq!(replay_sim(&trace, &completed, u64::MAX).unwrap().device_allocs, 1);
    }

    #[test]
    fn timeline_keeps_peaks_when_downsampled() {
        let trace = small_trace();
        let mut timeline = Timeline::new(trace.events().len(), 2);
        replay(
            &trace,
            &mut Pool::new(Sim::new(u64::MAX), Config::parse("strategy:pytorch").unwrap()),
            Some(&mut timeline),
        )
        .unwrap();
        assert_eq!(timeline.event_index, [0, 3]);
        assert_eq!(timeline.live_bytes, [16 * MIB, 20 * MIB]);
        assert_eq!(timeline.reserved_bytes, [20 * MIB, 32 * MIB]);
    }
}
