//! Giving memory back between `empty_cache` calls: the release watermark after frees, PyTorch's
//! garbage collection before growing, and the out-of-memory ladder's release of oversize
//! cached blocks. Only idle segments (one free block) go back, and only once the stream that
//! owns that block has finished its queued work: a free block has no pending work of other
//! streams (pending frees are not free yet), but its owner may still be using it, and the
//! driver's `cuMemFree` is documented only as *possibly* synchronizing. Nothing goes back while
//! a stream captures.

use super::{HistoryAction, Pool, PoolError, DEFAULT_STREAM};
use crate::core::{IdleSegment, Metric, PoolKind, SegmentId, StatType};
use crate::device::Device;

impl<D: Device> Pool<D> {
    /// The release watermark, after a free that left memory in `segment`: while free-but-reserved
    /// bytes exceed `release_threshold` of reserved bytes, idle segments go back to the device,
    /// oldest first. O(1) unless there is something to release. The free itself has happened:
    /// a device that refuses to take memory back leaves it cached (the heap and the device still
    /// agree), and the next `empty_cache` reports the refusal.
    #[inline]
    pub(super) fn after_free(&mut self, segment: SegmentId) {
        if self.config.release_threshold.is_some() {
            let _ = self.release_past_watermark(Some(segment));
        }
    }

    /// The release watermark after frees that waited for other streams completed outside a
    /// free (a synchronize, a stream's destroy): otherwise `direct` would keep their blocks
    /// reserved until some later free.
    pub(super) fn after_completions(&mut self) {
        if self.config.release_threshold.is_some() {
            let _ = self.release_past_watermark(None);
        }
    }

    fn release_past_watermark(&mut self, segment: Option<SegmentId>) -> Result<(), PoolError> {
        let Some(threshold) = self.config.release_threshold else { return Ok(()) };
        if self.expandable.is_some() {
            // Expandable ranges give back pages, not segments.
            let over = self.over_watermark(threshold) && !self.capture_underway();
            if let Some(pages) = self.expandable.as_mut().filter(|_| over) {
                pages.unmap_free_pages(&mut self.device, &mut self.heap, false)?;
            }
            self.note_page_calls(DEFAULT_STREAM);
            return Ok(());
        }
        let idle = self.heap.idle_bytes();
        if idle == 0 || !self.over_watermark(threshold) || self.capture_underway() {
            return Ok(());
        }
        // Usually the segment just freed is the only idle one: no need to look for the oldest.
        if let Some(segment) = segment.filter(|&s| self.heap.is_idle(s) && self.heap.idle_segment(s).size == idle) {
            return self.give_back(segment).map(drop);
        }
        for candidate in self.heap.idle_segments() {
            if !self.over_watermark(threshold) {
                break;
            }
            self.give_back(candidate.id)?;
        }
        Ok(())
    }

    fn over_watermark(&self, threshold: f64) -> bool {
        let reserved = self.reserved();
        let free = reserved - self.heap.stats().get(Metric::ActiveBytes, StatType::All).current;
        free as f64 > threshold * reserved as f64
    }

    /// PyTorch's garbage collection, before asking the device for more: when reserved bytes
    /// exceed `garbage_collection_threshold` of the allowed bytes, idle large segments at least
    /// as old as the average go back, pass after pass, until the excess is reclaimed. Inert
    /// without a memory limit, as in PyTorch.
    pub(super) fn collect_garbage(&mut self) -> Result<(), PoolError> {
        let (Some(threshold), Some(limit)) = (self.config.garbage_collection_threshold, self.growth.limit) else {
            return Ok(());
        };
        let allowed = (threshold * limit as f64) as u64;
        let reserved = self.reserved();
        if reserved <= allowed || self.capture_underway() {
            return Ok(());
        }
        let target = reserved - allowed;
        let mut candidates: Vec<IdleSegment> =
            self.heap.idle_segments().into_iter().filter(|s| s.kind == PoolKind::Large).collect();
        let mut total_age: u64 = candidates.iter().map(|s| u64::from(s.age)).sum();
        let mut reclaimed = 0;
        // Each pass frees at least the oldest candidate, whose age is at least the average.
        while reclaimed < target && !candidates.is_empty() {
            let average = total_age / candidates.len() as u64;
            let (old, young): (Vec<_>, Vec<_>) = candidates.into_iter().partition(|s| u64::from(s.age) >= average);
            for s in old {
                reclaimed += self.give_back(s.id)?;
                total_age -= u64::from(s.age);
            }
            candidates = young;
        }
        Ok(())
    }

    /// PyTorch's first out-of-memory remedy when `max_split_size` is set: give back the smallest
    /// idle oversize segment that holds the request, else oversize ones from the largest down
    /// until as many bytes as the request are freed. Returns whether that much was freed.
    pub(super) fn release_oversize(&mut self, size: u64) -> Result<bool, PoolError> {
        let max_split = self.heap.rules().max_split_size;
        if max_split == u64::MAX || self.capture_underway() {
            return Ok(false);
        }
        let wanted = self.heap.rules().round(size).max(max_split);
        let mut oversize: Vec<IdleSegment> =
            self.heap.idle_segments().into_iter().filter(|s| s.size >= max_split).collect();
        oversize.sort_by_key(|s| s.size);
        if let Some(fit) = oversize.iter().find(|s| s.size >= wanted) {
            return Ok(self.give_back(fit.id)? > 0);
        }
        let mut released = 0;
        for s in oversize.iter().rev() {
            if released >= wanted {
                break;
            }
            released += self.give_back(s.id)?;
        }
        Ok(released >= wanted)
    }

    /// Returns idle segment `sid` to the device; returns its size, or 0 while the stream that
    /// owns its free block still has work queued (the segment then stays cached).
    fn give_back(&mut self, sid: SegmentId) -> Result<u64, PoolError> {
        debug_assert!(self.heap.is_idle(sid), "segment {sid} is not idle");
        // A stream destroyed since was waited for first.
        if self.heap.owners(sid).into_iter().any(|owner| !self.device.query_stream(owner).unwrap_or(true)) {
            return Ok(0);
        }
        self.release_segment(sid)
    }

    /// Gives plain segment `sid`, all free, back to the device; returns its size. The device
    /// goes first: if it refuses, the segment stays cached and the heap still agrees with it.
    pub(super) fn release_segment(&mut self, sid: SegmentId) -> Result<u64, PoolError> {
        let (address, size) = self.heap.segment_extent(sid);
        let stream = self.heap.segment_stream(sid);
        self.device.release(address)?;
        self.heap.remove_segment(sid);
        self.heap.stats_mut().num_device_free += 1;
        self.heap.stats_mut().driver.free += 1;
        self.note(HistoryAction::SegmentFree, address, size, stream);
        Ok(size)
    }
}

#[cfg(test)]
mod tests {
    use crate::core::{Metric, StatType};
    use crate::device::{forward_streams, Device, DeviceError, MemoryInfo, Sim, StreamId};
    use crate::pool::{Config, Pool};

    /// A `sim` device one of whose streams can be said to be captured into a CUDA graph.
    struct Capturing {
        sim: Sim,
        capturing: Option<StreamId>,
        /// Whether asking if a stream is capturing fails, as a driver error.
        queries_fail: bool,
    }

    impl Capturing {
        fn new() -> Self {
            Capturing { sim: Sim::new(1 << 30), capturing: None, queries_fail: false }
        }
    }

    /// A pool on `Capturing` under `config` with a 12 MiB free and a 12 MiB export's release
    /// held for a capture on a side stream that has just ended.
    fn held_for_an_ended_capture(config: &str) -> Pool<Capturing> {
        let mut pool = Pool::new(Capturing::new(), Config::parse(config).unwrap());
        let side = pool.create_stream().unwrap();
        let freed = pool.alloc_on(12 << 20, side).unwrap();
        let exported = pool.alloc_on(12 << 20, side).unwrap();
        let export = pool.free_held(exported.handle).unwrap();
        pool.device_mut().capturing = Some(side);
        pool.free(freed.handle).unwrap();
        pool.release_held(export).unwrap();
        assert_eq!((pool.held_for_capture(), pool.held_blocks()), (1, 2), "{config}");
        pool.device_mut().capturing = None;
        pool
    }

    impl Device for Capturing {
        fn name(&self) -> &str {
            "sim"
        }
        fn allocate(&mut self, size: u64) -> Result<u64, DeviceError> {
            self.sim.allocate(size)
        }
        fn release(&mut self, address: u64) -> Result<(), DeviceError> {
            self.sim.release(address)
        }
        fn memory_info(&self) -> MemoryInfo {
            self.sim.memory_info()
        }
        fn captures_graphs(&self) -> bool {
            true
        }
        fn is_capturing(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
            if self.queries_fail {
                return Err(DeviceError::Driver("cuStreamIsCapturing failed".into()));
            }
            Ok(self.capturing == Some(stream))
        }
        forward_streams!(sim);
    }

    /// `empty_cache` returns every byte it gave back: a free that completes in its own wait is
    /// given back by it, not by the watermark on the way.
    #[test]
    fn empty_cache_counts_frees_that_complete_in_its_wait() {
        for config in ["strategy:direct", "strategy:pytorch,release_threshold:0"] {
            let mut pool = Pool::new(Sim::new(1 << 30), Config::parse(config).unwrap());
            let side = pool.create_stream().unwrap();
            let a = pool.alloc(3 << 20).unwrap();
            pool.record_stream(a.handle, side).unwrap();
            pool.hold_stream(side).unwrap();
            pool.free(a.handle).unwrap();
            let reserved = pool.reserved();
            assert!(reserved > 0, "{config}: the free waits for the side stream");
            assert_eq!(pool.empty_cache().unwrap(), reserved, "{config}");
            assert_eq!(pool.reserved(), 0, "{config}");
            pool.check_invariants().unwrap();
        }
    }

    /// The same for frees made while a capture ran, a plain one and an export's release: they
    /// wait for the capture's end and complete in `empty_cache`'s wait, which gives them back.
    #[test]
    fn empty_cache_counts_frees_held_for_a_capture() {
        for config in ["strategy:direct", "strategy:pytorch,release_threshold:0"] {
            let mut pool = held_for_an_ended_capture(config);
            let reserved = pool.reserved();
            assert!(reserved >= 24 << 20, "{config}: both blocks wait for the capture");
            assert_eq!(pool.empty_cache().unwrap(), reserved, "{config}");
            assert_eq!(pool.reserved(), 0, "{config}");
            pool.check_invariants().unwrap();
        }
    }

    /// A held free that fails once the capture ended (the device cannot say whether its stream
    /// still captures) stays held, with those after it: retried later, not leaked.
    #[test]
    fn a_held_free_that_fails_stays_held() {
        let mut pool = Pool::new(Capturing::new(), Config::parse("strategy:pytorch").unwrap());
        let side = pool.create_stream().unwrap();
        let blocks: Vec<_> = (0..3).map(|_| pool.alloc_on(4 << 20, side).unwrap()).collect();
        pool.device_mut().capturing = Some(side);
        for block in &blocks {
            pool.free(block.handle).unwrap();
        }
        assert_eq!(pool.held_for_capture(), 3);
        pool.device_mut().capturing = None;
        pool.device_mut().queries_fail = true;
        assert!(pool.synchronize().is_err(), "settling asks the device, which fails");
        assert_eq!(pool.held_for_capture(), 3, "the failed free and those after it stay held");
        pool.device_mut().queries_fail = false;
        let reserved = pool.reserved();
        assert_eq!(pool.empty_cache().unwrap(), reserved, "all three freed, then given back");
        let active = pool.memory_stats().into_iter().find(|(k, _)| k == "active_bytes.all.current").map(|(_, v)| v);
        assert_eq!(active, Some(0), "no block left live");
        pool.check_invariants().unwrap();
    }

    /// A block freed while its stream captures is freed for its user at once (no longer
    /// allocated, as in PyTorch), so a second free, plain or for an export, is refused as a double
    /// free; the held block completes once the capture has ended. (It used to stay allocated
    /// until then, in the statistics and snapshots too, and a second free for an export
    /// succeeded.)
    #[test]
    fn a_block_freed_twice_during_a_capture_is_freed_once() {
        for second in ["free", "free_held"] {
            let mut pool = Pool::new(Capturing::new(), Config::parse("strategy:pytorch").unwrap());
            let side = pool.create_stream().unwrap();
            let a = pool.alloc_on(4 << 20, side).unwrap();
            pool.device_mut().capturing = Some(side);
            pool.free(a.handle).unwrap();
            let allocated = pool.stats().get(Metric::AllocatedBytes, StatType::All).current;
            assert_eq!(allocated, 0, "{second}: a block freed during a capture still counts as allocated");
            assert_eq!(pool.pending_bytes(), 4 << 20, "{second}: it stays active until the capture ends");
            let again = match second {
                "free" => pool.free(a.handle).map(|_| ()),
                _ => pool.free_held(a.handle).map(|_| ()),
            };
            assert!(again.is_err(), "{second}: a double free while held for the capture");
            pool.check_invariants().unwrap();
            pool.device_mut().capturing = None;
            pool.synchronize().unwrap();
            assert_eq!((pool.held_for_capture(), pool.pending_bytes()), (0, 0), "{second}");
            assert!(pool.alloc(64 << 20).is_ok(), "{second}: the pool still allocates");
            pool.empty_cache().unwrap();
            pool.check_invariants().unwrap();
        }
    }

    /// A synchronize whose settling of the capture's frees fails still applies the release
    /// watermark to the held blocks it completed before that: it did so when they were
    /// released one by one, and `synchronize` adds it after completing them all.
    #[test]
    fn a_synchronize_that_fails_still_applies_the_watermark() {
        let mut pool = held_for_an_ended_capture("strategy:pytorch,release_threshold:0");
        pool.device_mut().queries_fail = true;
        let reserved = pool.reserved();
        assert!(pool.synchronize().is_err(), "settling the capture's free asks the device, which fails");
        let held = (pool.held_blocks(), pool.held_for_capture());
        assert_eq!(held, (1, 1), "the export's block was completed, the capture's free kept for a retry");
        assert!(pool.reserved() < reserved, "and its idle segment given back by the watermark");
        pool.check_invariants().unwrap();
    }
}
