//! The pool: a heap of cached segments over a device, growing on demand and shrinking on
//! `empty_cache` or under memory pressure.

mod config;
mod error;

pub use config::{parse_size, Config, ConfigError};
pub use error::{format_bytes, OomReport, PoolError};

use crate::core::{Handle, Heap, Rules, SegmentInfo, Stats};
use crate::device::{Device, DeviceError};

/// The stream every allocation uses until streams are exposed.
pub const DEFAULT_STREAM: u32 = 0;

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
    config: Config,
}

impl<D: Device> Pool<D> {
    pub fn new(device: D, config: Config) -> Self {
        let heap = Heap::new(config.rules.clone());
        Pool { device, heap, config }
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

    /// Serves `size` bytes from cached segments only; `None` means the device must be asked.
    /// Callers that must not block (the Python binding holding the GIL) try this first.
    pub fn alloc_cached(&mut self, size: u64) -> Result<Option<Allocation>, PoolError> {
        Self::validate(size)?;
        Ok(self.heap.take(size, DEFAULT_STREAM).map(|h| self.allocation(h, size)))
    }

    /// Allocates `size` bytes: from the cache, else from a new segment; when the device refuses,
    /// every fully free cached segment is returned and the device asked once more.
    pub fn alloc(&mut self, size: u64) -> Result<Allocation, PoolError> {
        if let Some(a) = self.alloc_cached(size)? {
            return Ok(a);
        }
        let rules = self.heap.rules();
        let rounded = rules.round(size);
        let (kind, segment_size) = (rules.kind(rounded), rules.segment_size(rounded));
        let address = match self.device.allocate(segment_size) {
            Ok(address) => address,
            Err(DeviceError::OutOfMemory { .. }) => self.retry_after_flush(size, segment_size)?,
            Err(e) => return Err(e.into()),
        };
        self.heap.stats_mut().num_device_alloc += 1;
        let segment = self.heap.add_segment(address, segment_size, kind, DEFAULT_STREAM);
        let handle = self.heap.take_segment(segment, size);
        Ok(self.allocation(handle, size))
    }

    /// PyTorch's last resort: return every fully free cached segment, then ask once more
    /// (a device may also refuse transiently, so the retry happens even if nothing was freed).
    fn retry_after_flush(&mut self, size: u64, segment_size: u64) -> Result<u64, PoolError> {
        self.release_cached()?;
        self.heap.stats_mut().num_alloc_retries += 1;
        match self.device.allocate(segment_size) {
            Ok(address) => Ok(address),
            Err(DeviceError::OutOfMemory { .. }) => {
                self.heap.stats_mut().num_ooms += 1;
                Err(PoolError::OutOfMemory(Box::new(self.oom_report(size))))
            }
            Err(e) => Err(e.into()),
        }
    }

    pub fn oom_report(&self, requested: u64) -> OomReport {
        let info = self.device.memory_info();
        let stat = |m| self.stats().get(m, crate::core::StatType::All).current;
        OomReport {
            device: self.device.name().to_string(),
            requested,
            capacity: info.total,
            device_free: info.free(),
            allocated: stat(crate::core::Metric::AllocatedBytes),
            reserved: stat(crate::core::Metric::ReservedBytes),
            largest_free_block: self.heap.largest_free_block(),
        }
    }

    /// Returns an allocation's block to the cache. Never calls the device.
    pub fn free(&mut self, handle: Handle) -> Result<(), PoolError> {
        Ok(self.heap.release(handle)?)
    }

    /// The address and block size of a live allocation.
    pub fn block_of(&self, handle: Handle) -> Result<(u64, u64), PoolError> {
        let b = self.heap.block(handle)?;
        Ok((b.address, b.size))
    }

    /// Gives every fully free segment back to the device; returns the bytes released.
    pub fn empty_cache(&mut self) -> Result<u64, PoolError> {
        self.release_cached()
    }

    fn release_cached(&mut self) -> Result<u64, PoolError> {
        let released = self.heap.release_free_segments(|_, _| true);
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
        let reserved = self.stats().get(crate::core::Metric::ReservedBytes, crate::core::StatType::All).current;
        let held = self.device.memory_info().held;
        if held != reserved {
            return Err(format!("device holds {held} bytes but the pool reserves {reserved}"));
        }
        Ok(())
    }
}
