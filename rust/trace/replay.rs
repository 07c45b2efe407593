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
    /// Of those, the requests that failed when the trace was recorded too.
    pub ooms_as_recorded: u64,
    /// Releases of cached memory the replay made where the job made them.
    pub releases: u64,
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
/// each point is the highest value over its stretch of events, so peaks survive. Where the
/// trace knows what the recorded allocator held, that too, and the largest gap between the
/// replay's reserved bytes and the recorded ones at any event.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// Index of the first event of each stretch.
    pub event_index: Vec<u64>,
    pub reserved_bytes: Vec<u64>,
    pub live_bytes: Vec<u64>,
    /// The recorded run's reserved bytes (empty when the trace does not know them).
    pub recorded_bytes: Vec<u64>,
    /// The most the replay's reserved bytes differed from the recorded ones at one event.
    pub largest_gap_bytes: Option<u64>,
    stride: usize,
}

impl Timeline {
    pub fn new(events: usize, max_points: usize) -> Self {
        Timeline { stride: events.div_ceil(max_points.max(1)).max(1), ..Timeline::default() }
    }

    fn sample(&mut self, index: usize, reserved: u64, live: u64, recorded: Option<u64>) {
        if let Some(recorded) = recorded {
            let gap = reserved.abs_diff(recorded);
            self.largest_gap_bytes = Some(self.largest_gap_bytes.map_or(gap, |most| most.max(gap)));
        }
        if index.is_multiple_of(self.stride) || self.event_index.is_empty() {
            self.event_index.push(index as u64);
            self.reserved_bytes.push(reserved);
            self.live_bytes.push(live);
            self.recorded_bytes.extend(recorded);
            return;
        }
        let highest = |values: &mut Vec<u64>, value: u64| {
            if let Some(last) = values.last_mut() {
                *last = (*last).max(value);
            }
        };
        highest(&mut self.reserved_bytes, reserved);
        highest(&mut self.live_bytes, live);
        if let Some(recorded) = recorded {
            highest(&mut self.recorded_bytes, recorded);
        }
    }
}

/// Every CUDA driver call that obtains or returns device memory, as the CUDA backend makes them
/// for what the pool did (see [`DriverCalls`]): the one place that says what a driver call is.
pub fn driver_calls(stats: &Stats) -> u64 {
    stats.driver.total()
}

/// How much of what the job did to its pool a replay repeats, beside its requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum JobActions {
    /// Requests only: recorded failures are skipped and recorded releases ignored.
    Ignore,
    /// `empty_cache()` where the job called it, and recorded failures tried again where the
    /// trace knows the GPU the job had (freed at once when served); the out-of-memory path's
    /// releases are left to the pool's own.
    #[default]
    Honour,
    /// [`JobActions::Honour`], and the out-of-memory path's releases where the recorded run
    /// made them: for a replay of the configuration that ran.
    AsRun,
}

/// A replay in progress: the pool's stream for each trace stream, the live allocations by
/// slot, and the counts so far.
pub(super) struct Cursor {
    pub streams: Vec<StreamId>,
    pub handles: Vec<Option<Handle>>,
    job: JobActions,
    ooms: u64,
    ooms_as_recorded: u64,
    releases: u64,
    allocations: u64,
    /// Stop once more allocations than this failed: a capacity probe needs no more.
    ooms_allowed: Option<u64>,
}

impl Cursor {
    /// Each trace stream gets a stream of the pool (the traced program's null stream is the
    /// default stream), so blocks pass between streams only as the pool's configuration allows.
    pub fn new<D: Device>(trace: &Trace, pool: &mut Pool<D>, job: JobActions) -> Result<Self, PoolError> {
        let streams = trace
            .streams()
            .iter()
            .map(|&s| if s == 0 { Ok(DEFAULT_STREAM) } else { pool.create_stream() })
            .collect::<Result<Vec<StreamId>, _>>()?;
        Ok(Cursor {
            streams,
            handles: vec![None; trace.allocations()],
            job,
            ooms: 0,
            ooms_as_recorded: 0,
            releases: 0,
            allocations: 0,
            ooms_allowed: None,
        })
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
                Action::Failure if self.job == JobActions::Ignore => {}
                Action::Failure => {
                    self.retry_failure(pool, e.size, e.stream, trace.capacity())?;
                    if self.failed() {
                        return Ok(());
                    }
                }
                Action::EmptyCache if self.job != JobActions::Ignore => self.release(pool)?,
                Action::OomRelease if self.job == JobActions::AsRun => self.release(pool)?,
                Action::EmptyCache | Action::OomRelease => {}
            }
            if let Some(t) = timeline.as_deref_mut() {
                let current = |m| pool.stats().get(m, StatType::All).current;
                let recorded = trace.recorded_reserved().get(index).copied();
                t.sample(index, current(Metric::ReservedBytes), current(Metric::RequestedBytes), recorded);
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

    /// A request that failed when the trace was recorded, on the GPU the job had (`gpu`): tried
    /// again, it is freed at once if served (the job went on without it) and counted if refused.
    /// One larger than that GPU is refused untried: no configuration could have served it there,
    /// so it fails everywhere, as requests beyond any device do, and weighs on no capacity.
    /// Where the GPU is unknown (a trace without `oom` entries that say it), the failure is
    /// skipped: nothing says what a retry would have met.
    fn retry_failure<D: Device>(
        &mut self,
        pool: &mut Pool<D>,
        size: u64,
        stream: u32,
        gpu: Option<u64>,
    ) -> Result<(), PoolError> {
        let Some(gpu) = gpu else { return Ok(()) };
        self.allocations += 1;
        let refused = size > gpu
            || match pool.alloc_on(size, self.streams[stream as usize]) {
                Ok(a) => {
                    pool.free(a.handle)?;
                    false
                }
                Err(PoolError::OutOfMemory(_) | PoolError::InvalidSize(_)) => true,
                Err(other) => return Err(other),
            };
        if refused {
            self.ooms += 1;
            self.ooms_as_recorded += 1;
        }
        Ok(())
    }

    fn release<D: Device>(&mut self, pool: &mut Pool<D>) -> Result<(), PoolError> {
        self.releases += 1;
        pool.empty_cache().map(drop)
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
            ooms_as_recorded: self.ooms_as_recorded,
            releases: self.releases,
            seconds,
        }
    }
}

/// Runs `trace` on `pool` (which should be fresh: its peaks are the replay's), from nothing:
/// the blocks live before recording began are allocated first; `job` says which of the job's
/// own actions are repeated.
pub fn replay<D: Device>(
    trace: &Trace,
    pool: &mut Pool<D>,
    timeline: Option<&mut Timeline>,
    job: JobActions,
) -> Result<Metrics, PoolError> {
    let mut cursor = Cursor::new(trace, pool, job)?;
    let start = Instant::now();
    cursor.run(trace, pool, 0, timeline)?;
    Ok(cursor.metrics(trace, pool, start.elapsed().as_secs_f64()))
}

/// Replays `trace` on a fresh pool over a `sim` device of `capacity` bytes, honouring the job.
pub fn replay_sim(trace: &Trace, config: &Config, capacity: u64) -> Result<Metrics, PoolError> {
    replay(trace, &mut Pool::new(Sim::new(capacity), config.clone()), None, JobActions::Honour)
}

/// The peak bytes reserved when `trace` replays on a `sim` device of `capacity` bytes with at
/// most `ooms` failed allocations, or `None` if it fails more often; stops at the first failure
/// beyond them.
fn fits_sim(
    trace: &Trace,
    config: &Config,
    capacity: u64,
    ooms: u64,
    job: JobActions,
) -> Result<Option<u64>, PoolError> {
    let mut pool = Pool::new(Sim::new(capacity), config.clone());
    let mut cursor = Cursor::new(trace, &mut pool, job)?;
    cursor.stop_after_ooms(ooms);
    cursor.run(trace, &mut pool, 0, None)?;
    Ok((!cursor.failed()).then(|| pool.stats().get(Metric::ReservedBytes, StatType::All).peak))
}

/// The answer of a min-capacity search.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MinCapacity {
    /// The smallest capacity found on which the trace runs without an OOM.
    pub bytes: u64,
    /// Whether the bisection's answer failed the check of [`checked_capacity`] and a search
    /// past it found this one.
    pub corrected: bool,
}

/// The smallest `sim` capacity on which `trace` replays without an OOM, honouring the job, to
/// within `tolerance` (a fraction of the answer), or `None` if none does. See
/// [`min_capacity_after`].
pub fn min_capacity(trace: &Trace, config: &Config, tolerance: f64) -> Result<Option<MinCapacity>, PoolError> {
    let unlimited = replay_sim(trace, config, u64::MAX)?;
    min_capacity_after(trace, config, &unlimited, tolerance, JobActions::Honour)
}

/// [`min_capacity`], given what a replay on an unlimited `sim` device measured: the bisection of
/// [`bisect_capacity`], then the peak the replay on the capacity found reserved, if the trace
/// fits on exactly that too, then the check of [`checked_capacity`]. The bisection ends
/// anywhere in its last interval, while a pool's reservations move in whole segments or pages:
/// so the answer is what the pool needs, and two strategies that need the same pages read the
/// same. `None` when no capacity runs the trace: the search finds none, or the unlimited replay
/// served none of its allocations.
pub fn min_capacity_after(
    trace: &Trace,
    config: &Config,
    unlimited: &Metrics,
    tolerance: f64,
    job: JobActions,
) -> Result<Option<MinCapacity>, PoolError> {
    if unlimited.served_nothing() {
        return Ok(None);
    }
    // Requests no device could hold fail everywhere; they do not count against a capacity.
    let mut least: Option<(u64, u64)> = None;
    let mut fits_on = |capacity| {
        let peak = fits_sim(trace, config, capacity, unlimited.ooms, job)?;
        if let Some(peak) = peak.filter(|_| least.is_none_or(|(fitted, _)| capacity < fitted)) {
            least = Some((capacity, peak));
        }
        Ok(peak.is_some())
    };
    let floor = trace.peak_live_bytes();
    let Some(found) = bisect_capacity(&mut fits_on, floor, unlimited.peak_reserved_bytes, tolerance)? else {
        return Ok(None);
    };
    let found = match least {
        Some((fitted, peak)) if fitted == found && peak < found => {
            if fits_sim(trace, config, peak, unlimited.ooms, job)?.is_some() {
                peak
            } else {
                found
            }
        }
        _ => found,
    };
    let fits_on = |capacity| Ok(fits_sim(trace, config, capacity, unlimited.ooms, job)?.is_some());
    checked_capacity(fits_on, found, floor, tolerance).map(Some)
}

/// Checks a search's answer `found` as a user would: the trace runs on it, and fails
/// `tolerance` below it (or that is under `floor`, where nothing runs). Capacity and failure
/// need not be monotone (a pool that sizes segments by what is left may run on one capacity
/// and fail on a larger one), so a bisection can end on an answer that does not hold: where
/// `found` fails, capacities above it are tried, a `tolerance` above it first and then twice as
/// far each time, until one runs; where the trace also runs `tolerance` below, the search
/// bisects on below that. A few rounds at most; the last capacity shown to run is the answer
/// (`found` if none was).
pub fn checked_capacity(
    mut fits_on: impl FnMut(u64) -> Result<bool, PoolError>,
    found: u64,
    floor: u64,
    tolerance: f64,
) -> Result<MinCapacity, PoolError> {
    let step = |capacity: u64| ((capacity as f64 * tolerance) as u64).max(1);
    let (mut answer, mut corrected, mut runs) = (found, false, None);
    // Upward steps double after each failure, so a gap of any width is crossed in a few rounds.
    let mut up = step(found);
    for _ in 0..MAX_CHECKS {
        if !fits_on(answer)? {
            answer = answer.saturating_add(up);
            up = up.saturating_mul(2);
            corrected = true;
            continue;
        }
        runs = Some(answer);
        let below = answer.saturating_sub(step(answer));
        if below < floor || !fits_on(below)? {
            break;
        }
        match bisect_capacity(&mut fits_on, floor, below, tolerance)? {
            Some(lower) if lower < answer => (answer, corrected) = (lower, true),
            _ => break,
        }
    }
    Ok(MinCapacity { bytes: runs.unwrap_or(found), corrected })
}

/// How many rounds [`checked_capacity`] takes at most: 20 doubling steps from 0.5% reach
/// thousands of times an answer that does not hold.
const MAX_CHECKS: u32 = 20;

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
    use crate::trace::{job, TraceBuilder};

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
        let min = min_capacity(&trace, &config, 0.005).unwrap().unwrap().bytes;
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
            let min = min_capacity(&trace, &config, 0.005).unwrap().unwrap().bytes;
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
        let min = min_capacity(&trace, &config, 0.005).unwrap().unwrap().bytes;
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
            assert!(min.is_some_and(|min| min.bytes >= 8 * MIB), "{strategy}: {min:?}");
        }
    }

    #[test]
    fn host_and_sim_agree() {
        let trace = small_trace();
        let config = Config::parse("strategy:pytorch").unwrap();
        let on_host =
            replay(&trace, &mut Pool::new(Host::new(Some(64 * MIB)), config.clone()), None, JobActions::Honour)
                .unwrap();
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
            JobActions::Honour,
        )
        .unwrap();
        assert_eq!(timeline.event_index, [0, 3]);
        assert_eq!(timeline.live_bytes, [16 * MIB, 20 * MIB]);
        assert_eq!(timeline.reserved_bytes, [20 * MIB, 32 * MIB]);
    }

    /// A job that frees a 20 MiB tensor, calls `empty_cache()`, then allocates 4 MiB; then a
    /// release of the out-of-memory path; then a request that failed when recorded.
    fn job_trace() -> Trace {
        let mut b = TraceBuilder::default();
        b.alloc(0x1000, 20 * MIB, 0, 0).unwrap();
        b.free(0x1000, 0, 1).unwrap();
        b.release(Action::EmptyCache, 20 * MIB, 0, 2);
        b.alloc(0x2000, 4 * MIB, 0, 3).unwrap();
        b.alloc(0x3000, 40 * MIB, 0, 4).unwrap();
        b.free(0x3000, 0, 5).unwrap();
        b.release(Action::OomRelease, 40 * MIB, 0, 6);
        b.failure(64 * MIB, 0, 7);
        // Beyond the GPU: refused everywhere, untried.
        b.failure(200 * MIB, 0, 8);
        b.set_capacity(Some(100 * MIB));
        b.finish()
    }

    #[test]
    fn a_replay_repeats_what_the_job_did_as_asked() {
        let config = Config::parse("strategy:pytorch").unwrap();
        let run = |job, capacity| {
            let mut pool = Pool::new(Sim::new(capacity), config.clone());
            let metrics = replay(&job_trace(), &mut pool, None, job).unwrap();
            let reserved = pool.stats().get(Metric::ReservedBytes, StatType::All).current;
            (metrics, reserved)
        };
        // Ignored: the 20 MiB segment is reused for 4 MiB, the 40 MiB one stays cached, and
        // the recorded failure is not tried.
        let (ignored, reserved) = run(JobActions::Ignore, u64::MAX);
        assert_eq!((ignored.releases, ignored.ooms, ignored.allocations), (0, 0, 3));
        assert_eq!((ignored.peak_reserved_bytes, reserved), (60 * MIB, 60 * MIB));
        // Honoured: the 20 MiB segment goes back before the 4 MiB request (which gets a new
        // one); the out-of-memory release is the pool's own business; the failure is tried,
        // served on an unlimited device and freed at once.
        let (honoured, reserved) = run(JobActions::Honour, u64::MAX);
        assert_eq!((honoured.releases, honoured.ooms, honoured.allocations), (1, 1, 5));
        assert_eq!(reserved, 20 * MIB + 40 * MIB + 64 * MIB, "the failed request's segment stays cached");
        // As run: the out-of-memory path's release too; on 80 MiB the request fails again.
        let (as_run, reserved) = run(JobActions::AsRun, 80 * MIB);
        assert_eq!((as_run.releases, as_run.ooms, as_run.ooms_as_recorded), (2, 2, 2));
        assert_eq!(reserved, 20 * MIB);
    }

    /// A recorded failure that the GPU could hold counts in the search: the least capacity
    /// holds the failed request too. Without a known GPU the failure is skipped.
    #[test]
    fn min_capacity_includes_requests_that_failed_when_recorded() {
        let config = Config::parse("strategy:pytorch").unwrap();
        let min = min_capacity(&job_trace(), &config, 0.005).unwrap().unwrap();
        assert!(min.bytes >= 64 * MIB + 20 * MIB, "{min:?}");
        assert_eq!(replay_sim(&job_trace(), &config, min.bytes).unwrap().ooms, 1, "only the one beyond the GPU");
        let mut unknown = job_trace();
        unknown.capacity = None;
        let min = min_capacity(&unknown, &config, 0.005).unwrap().unwrap();
        assert!(min.bytes < 64 * MIB, "{min:?}");
    }

    /// Capacities that run a trace need not form one interval: the check moves an answer that
    /// fails up to one that runs, and one that also runs lower down to the lower one.
    #[test]
    fn the_check_moves_answers_that_do_not_hold() {
        let runs = |c: u64| (1000..1100).contains(&c) || c >= 2000;
        let holds = |m: MinCapacity| runs(m.bytes) && !runs(m.bytes - (m.bytes as f64 * 0.005) as u64);
        let checked = checked_capacity(|c| Ok(runs(c)), 1500, 100, 0.005).unwrap();
        assert!(checked.corrected && holds(checked) && checked.bytes >= 1500, "{checked:?}");
        // 2100 runs, and so does 0.5% below: the search goes on below, into the lower interval.
        let checked = checked_capacity(|c| Ok(runs(c)), 2100, 100, 0.005).unwrap();
        assert!(checked.corrected && holds(checked) && checked.bytes < 2100, "{checked:?}");
        let checked = checked_capacity(|c| Ok(runs(c)), 1000, 100, 0.005).unwrap();
        assert_eq!(checked, MinCapacity { bytes: 1000, corrected: false });
        // Past its rounds the check keeps the last capacity shown to run, never an unchecked one.
        let checked = checked_capacity(|c| Ok(c >= 1 << 40), 1000, 100, 0.005).unwrap();
        assert_eq!(checked.bytes, 1000);
    }

    #[test]
    fn the_timeline_compares_with_the_recorded_reserved_bytes() {
        let entries = [
            job::Entry { action: "segment_alloc", address: 0x1000, size: 20 * MIB, stream: 0, time_ns: 0 },
            job::Entry { action: "alloc", address: 0x1000, size: 8 * MIB, stream: 0, time_ns: 1 },
            job::Entry { action: "free_completed", address: 0x1000, size: 8 * MIB, stream: 0, time_ns: 2 },
            job::Entry { action: "segment_free", address: 0x1000, size: 20 * MIB, stream: 0, time_ns: 3 },
            job::Entry { action: "segment_alloc", address: 0x9000, size: 20 * MIB, stream: 0, time_ns: 4 },
            job::Entry { action: "alloc", address: 0x9000, size: 6 * MIB, stream: 0, time_ns: 5 },
        ];
        let trace = Trace::from_snapshot(&entries, &[], Some(20 * MIB)).unwrap();
        let actions: Vec<Action> = trace.events().iter().map(|e| e.action).collect();
        assert_eq!(actions, [Action::Alloc, Action::Free, Action::EmptyCache, Action::Alloc]);
        assert_eq!(trace.recorded_reserved(), [20 * MIB, 20 * MIB, 0, 20 * MIB]);
        let config = Config::parse("strategy:pytorch").unwrap();
        for (job, gap) in [(JobActions::Honour, 0), (JobActions::Ignore, 20 * MIB)] {
            let mut timeline = Timeline::new(trace.events().len(), 100);
            replay(&trace, &mut Pool::new(Sim::new(u64::MAX), config.clone()), Some(&mut timeline), job).unwrap();
            assert_eq!(timeline.largest_gap_bytes, Some(gap), "{job:?}");
            assert_eq!(timeline.recorded_bytes, trace.recorded_reserved());
        }
    }
}
