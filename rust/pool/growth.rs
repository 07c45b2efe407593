//! Growth: how big a new segment is (the rules' [`SegmentGrowth`] plus the state it needs), the
//! pool's memory limit (`per_process_memory_fraction`) and pre-allocation
//! (`initial_pool_size_mb`).

use super::{Config, Pool, DEFAULT_STREAM};
use crate::core::{Metric, PoolKind, SegmentGrowth, StatType};
use crate::device::{Device, DeviceError, StreamId};

/// What growth remembers between segments.
#[derive(Clone, Copy, Debug)]
pub(super) struct Growth {
    /// The next region's size ([`SegmentGrowth::Doubling`]).
    region: u64,
    /// The most bytes the pool may reserve (fraction x capacity); `None` when unlimited.
    pub limit: Option<u64>,
    /// The most one block can ever be: the limit, else the device's capacity (fixed for a
    /// device's life, so the hot path need not ask it).
    pub ceiling: Option<u64>,
}

impl Growth {
    pub fn new(config: &Config, capacity: Option<u64>) -> Self {
        let mut growth = Growth { region: config.rules.growth_unit, limit: None, ceiling: None };
        growth.limit_to(config.per_process_memory_fraction, capacity);
        growth
    }

    /// Sets the limit to `fraction` of `capacity` (none without either).
    pub fn limit_to(&mut self, fraction: Option<f64>, capacity: Option<u64>) {
        self.limit = fraction.zip(capacity).map(|(f, total)| (total as f64 * f) as u64);
        self.ceiling = self.limit.into_iter().chain(capacity).min();
    }
}

impl<D: Device> Pool<D> {
    /// Limits the pool to `fraction` of the device's capacity from now on, as PyTorch's
    /// `torch.cuda.set_per_process_memory_fraction` does: memory already reserved past the new
    /// limit stays until it is freed and released. A fraction outside [0, 1] is refused.
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), String> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(format!("per_process_memory_fraction must be in [0, 1], got {fraction}"));
        }
        self.config.per_process_memory_fraction = Some(fraction);
        self.growth.limit_to(Some(fraction), self.device.memory_info().total);
        Ok(())
    }

    pub(super) fn reserved(&self) -> u64 {
        self.heap.stats().get(Metric::ReservedBytes, StatType::All).current
    }

    /// Bytes the device and the limit can still give; `u64::MAX` when unknown.
    pub(super) fn available(&self) -> u64 {
        let device = self.device.memory_info().free().unwrap_or(u64::MAX);
        let limit = self.growth.limit.map_or(u64::MAX, |limit| limit.saturating_sub(self.reserved()));
        device.min(limit)
    }

    /// Asks the device for `size` bytes; past the limit the pool refuses itself, as PyTorch
    /// does with a memory fraction, so the out-of-memory ladder runs as for a device refusal.
    fn device_allocate(&mut self, size: u64, stream: StreamId) -> Result<u64, DeviceError> {
        if self.growth.limit.is_some_and(|limit| self.reserved().saturating_add(size) > limit) {
            return Err(DeviceError::OutOfMemory { requested: size });
        }
        let address = self.device.allocate_on(size, stream)?;
        let stats = self.heap.stats_mut();
        stats.num_device_alloc += 1;
        stats.driver.malloc += 1;
        Ok(address)
    }

    /// A new segment that holds `rounded` bytes: its address and size. Strategies that size
    /// segments by what is left back off to the bare request when the device refuses more
    /// (TF BFC's back-off, in one step).
    /// The segment is for use on `stream` (where stream-ordered devices order its allocation).
    pub(super) fn allocate_segment(&mut self, rounded: u64, stream: StreamId) -> Result<(u64, u64), DeviceError> {
        let rules = self.heap.rules();
        let (backs_off, doubling) = (rules.may_back_off(), rules.growth == SegmentGrowth::Doubling);
        let available = if backs_off { self.available() } else { u64::MAX };
        let size = self.heap.rules().segment_size(rounded, self.growth.region, available);
        let (address, size) = match self.device_allocate(size, stream) {
            Ok(address) => (address, size),
            Err(DeviceError::OutOfMemory { .. }) if backs_off && size > rounded => {
                (self.device_allocate(rounded, stream)?, rounded)
            }
            Err(e) => return Err(e),
        };
        if doubling {
            self.growth.region = self.heap.rules().next_region(self.growth.region, rounded);
        }
        Ok((address, size))
    }

    /// Obtains `initial_pool_size` bytes (capped by what the device and the limit can give) as
    /// one segment any stream may use, or as pages (see [`Pool::premap`]). A refusal is retried
    /// once, then the pool grows on demand instead.
    pub(super) fn preallocate(&mut self) {
        if self.expandable.is_some() {
            return self.premap();
        }
        let granule = self.heap.rules().granule;
        let size = self.config.initial_pool_size.min(self.available()) & !(granule - 1);
        if size == 0 {
            return;
        }
        let address = match self.device_allocate(size, DEFAULT_STREAM) {
            Ok(address) => address,
            Err(DeviceError::OutOfMemory { .. }) => {
                self.heap.stats_mut().num_alloc_retries += 1;
                match self.device_allocate(size, DEFAULT_STREAM) {
                    Ok(address) => address,
                    Err(_) => return,
                }
            }
            Err(_) => return,
        };
        self.heap.add_shared_segment(address, size, PoolKind::Large);
    }

    /// The paged strategies' pre-allocation: the large range, reserved now, with its first
    /// `initial_pool_size` bytes mapped (whole pages, capped as above), free space of every
    /// stream as the rest of the range is. Kept like any mapped page: under pressure, on
    /// `empty_cache` or past the release watermark its free handles go back. A refusal leaves
    /// the pages to be mapped on demand.
    fn premap(&mut self) {
        let Some(page) = self.config.paging.map(|paging| paging.page_of(PoolKind::Large)) else { return };
        let size = self.config.initial_pool_size.min(self.available()) / page * page;
        let Some(pages) = self.expandable.as_mut().filter(|_| size > 0) else { return };
        let Ok(segment) = pages.reserve_range(&mut self.device, &mut self.heap, PoolKind::Large, DEFAULT_STREAM, size)
        else {
            return;
        };
        // Exactly those pages: no map-ahead past them.
        let (base, limit) = (self.heap.block_at(self.heap.segment_head(segment)).address, self.growth.limit);
        let end = base + size;
        let (device, heap) = (&mut self.device, &mut self.heap);
        if pages.ensure_mapped(device, heap, segment, base, size, end, limit).is_err() {
            heap.stats_mut().num_alloc_retries += 1;
            let _ = pages.ensure_mapped(device, heap, segment, base, size, end, limit);
        }
    }
}
