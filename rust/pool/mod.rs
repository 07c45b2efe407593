//! The pool: a heap of cached segments over a device, growing on demand and shrinking on
//! `empty_cache` or under memory pressure.

mod config;
mod deferred;
mod error;
mod streams;

pub use config::{parse_size, Config, ConfigError, CrossStreamReuse};
pub use error::{format_bytes, OomReport, PoolError};

use crate::core::{BlockState, Handle, Heap, Metric, Rules, SegmentInfo, StatType, Stats};
use crate::device::{Device, DeviceError, StreamId};
use deferred::Deferred;

pub use crate::device::DEFAULT_STREAM;

enum Retry {
    Cached(Allocation),
    Segment(u64),
}

/// A live allocation: the handle to free it with, its address and the bytes asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub handle: Handle,
    pub address: u64,
    pub size: u64,
}

pub struct Pool<D: Device> {
    device: D,
    heap: Heap,
    deferred: Deferred,
    config: Config,
}

impl<D: Device> Pool<D> {
    pub fn new(device: D, config: Config) -> Self {
        let heap = Heap::new(config.rules.clone());
        Pool { device, heap, deferred: Deferred::default(), config }
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn rules(&self) -> &Rules {
        self.heap.rules()
    }

    pub fn stats(&self) -> &Stats {
        self.heap.stats()
    }

    pub fn reset_peak_stats(&mut self) {
        self.heap.stats_mut().reset_peaks();
    }

    fn validate(size: u64) -> Result<(), PoolError> {
        if size == 0 || size > Rules::MAX_REQUEST {
            return Err(PoolError::InvalidSize(size));
        }
        Ok(())
    }

    fn allocation(&self, handle: Handle, size: u64) -> Allocation {
        let address = self.heap.block(handle).map(|b| b.address).unwrap_or_default();
        Allocation { handle, address, size }
    }

    /// Serves `size` bytes on `stream` from cached segments only; `None` means the device must
    /// be asked. Callers that must not block (the Python binding holding the GIL) try this first.
    pub fn alloc_cached(&mut self, size: u64, stream: StreamId) -> Result<Option<Allocation>, PoolError> {
        Self::validate(size)?;
        if !self.deferred.is_idle() {
            self.deferred.poll(&mut self.device, &mut self.heap, false)?;
        }
        // Shared blocks are safe for every stream; under `never` only destroyed streams' land there.
        if let Some(h) = self.heap.take(size, stream, true) {
            return Ok(Some(self.allocation(h, size)));
        }
        if self.config.cross_stream_reuse == CrossStreamReuse::Never {
            return Ok(None);
        }
        // Other streams' frees become shared once a fence recorded after them completes.
        self.deferred.fence_streams(&mut self.device, &mut self.heap, Some(stream))?;
        self.deferred.poll(&mut self.device, &mut self.heap, false)?;
        if let Some(h) = self.heap.take(size, stream, true) {
            return Ok(Some(self.allocation(h, size)));
        }
        if self.config.cross_stream_reuse == CrossStreamReuse::Wait {
            if let Some((id, owner)) = self.heap.find_foreign(size, stream) {
                self.make_wait_for(stream, owner)?;
                let h = self.heap.take_block(id, size, stream);
                return Ok(Some(self.allocation(h, size)));
            }
        }
        Ok(None)
    }

    /// Orders `stream`'s later work after everything queued on `owner` so far.
    fn make_wait_for(&mut self, stream: StreamId, owner: StreamId) -> Result<(), PoolError> {
        let event = self.device.record_event(owner)?;
        self.device.stream_wait_event(stream, event)?;
        self.device.destroy_event(event)?;
        Ok(())
    }

    /// Allocates `size` bytes on the default stream.
    pub fn alloc(&mut self, size: u64) -> Result<Allocation, PoolError> {
        self.alloc_on(size, DEFAULT_STREAM)
    }

    /// Allocates `size` bytes for use on `stream`: from the cache, else from a new segment; when
    /// the device refuses, every event is waited for, every fully free cached segment returned
    /// and the device asked once more.
    pub fn alloc_on(&mut self, size: u64, stream: StreamId) -> Result<Allocation, PoolError> {
        if let Some(a) = self.alloc_cached(size, stream)? {
            return Ok(a);
        }
        // Fail before growing if the stream is gone, rather than cache memory for it.
        self.device.query_stream(stream)?;
        let rules = self.heap.rules();
        let rounded = rules.round(size);
        let (kind, segment_size) = (rules.kind(rounded), rules.segment_size(rounded));
        let address = match self.device.allocate(segment_size) {
            Ok(address) => address,
            Err(DeviceError::OutOfMemory { .. }) => match self.retry_after_flush(size, stream, segment_size)? {
                Retry::Cached(a) => return Ok(a),
                Retry::Segment(address) => address,
            },
            Err(e) => return Err(e.into()),
        };
        self.heap.stats_mut().num_device_alloc += 1;
        let segment = self.heap.add_segment(address, segment_size, kind, stream);
        let handle = self.heap.take_segment(segment, size, stream);
        Ok(self.allocation(handle, size))
    }

    /// PyTorch's last resort: wait for all events, return every fully free cached segment, then
    /// look in the cache again (PyTorch forgets to) and ask the device once more (a device may
    /// refuse transiently, so that happens even if nothing was freed).
    fn retry_after_flush(&mut self, size: u64, stream: StreamId, segment_size: u64) -> Result<Retry, PoolError> {
        self.synchronize()?;
        self.release_cached()?;
        self.heap.stats_mut().num_alloc_retries += 1;
        if let Some(a) = self.alloc_cached(size, stream)? {
            return Ok(Retry::Cached(a));
        }
        match self.device.allocate(segment_size) {
            Ok(address) => Ok(Retry::Segment(address)),
            Err(DeviceError::OutOfMemory { .. }) => {
                self.heap.stats_mut().num_ooms += 1;
                Err(PoolError::OutOfMemory(Box::new(self.oom_report(size))))
            }
            Err(e) => Err(e.into()),
        }
    }

    pub fn oom_report(&self, requested: u64) -> OomReport {
        let info = self.device.memory_info();
        let stat = |m| self.stats().get(m, StatType::All).current;
        OomReport {
            device: self.device.name().to_string(),
            requested,
            capacity: info.total,
            device_free: info.free(),
            allocated: stat(Metric::AllocatedBytes),
            reserved: stat(Metric::ReservedBytes),
            largest_free_block: self.heap.largest_free_block(),
        }
    }

    /// Returns an allocation's block to the cache. A block used on other streams waits for
    /// events recorded on them now; otherwise the device is not called.
    pub fn free(&mut self, handle: Handle) -> Result<(), PoolError> {
        if !self.heap.block(handle)?.has_uses {
            return Ok(self.heap.release(handle)?);
        }
        let block = self.heap.release_pending(handle)?;
        if !self.deferred.defer(&mut self.device, block)? {
            self.heap.complete_pending(block);
        }
        Ok(())
    }

    /// The address and block size of a live allocation.
    pub fn block_of(&self, handle: Handle) -> Result<(u64, u64), PoolError> {
        let b = self.heap.block(handle)?;
        Ok((b.address, b.size))
    }

    /// Waits for pending events, then gives every fully free segment back to the device;
    /// returns the bytes released.
    pub fn empty_cache(&mut self) -> Result<u64, PoolError> {
        self.synchronize()?;
        self.release_cached()
    }

    fn release_cached(&mut self) -> Result<u64, PoolError> {
        let released = self.heap.release_free_segments();
        let mut bytes = 0;
        for (address, size) in released {
            self.device.release(address)?;
            self.heap.stats_mut().num_device_free += 1;
            bytes += size;
        }
        Ok(bytes)
    }

    pub fn segments(&self) -> Vec<SegmentInfo> {
        self.heap.segments()
    }

    /// The heap's invariants, plus: the device holds exactly the reserved bytes.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.heap.check_invariants()?;
        let reserved = self.stats().get(Metric::ReservedBytes, StatType::All).current;
        let held = self.device.memory_info().held;
        if held != reserved {
            return Err(format!("device holds {held} bytes but the pool reserves {reserved}"));
        }
        let pending = self.segments().iter().flat_map(|s| &s.blocks).filter(|b| b.state == BlockState::Pending).count();
        if pending != self.deferred.pending_blocks() {
            return Err(format!("{pending} blocks are pending but {} wait on events", self.deferred.pending_blocks()));
        }
        Ok(())
    }
}
