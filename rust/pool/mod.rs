//! The pool: a heap of cached segments over a device, growing on demand and shrinking on
//! `empty_cache` or under memory pressure.
//!
//! One allocation under the default strategy whose best fit lies on pages not mapped yet (the
//! common cache miss: a paged range always has free address space) calls each of these once,
//! in this order:
//! 1. [`Pool::alloc_on`]: validates and rounds the size;
//! 2. `Pool::place_cached` -> `Pool::place` (`placement.rs`): the pool kind the rules give
//!    the size and the best fit among the stream's own and shared free blocks (`Heap::find_in`),
//!    whose pages turn out not all mapped: the only search;
//! 3. `Pool::alloc_slow` -> `Pool::settle_and_take`: nothing completed since, so the
//!    placement stands; `Pool::place_new` passes a block through;
//! 4. `Pool::take` -> `Pool::take_block`: `Expandable::ensure_mapped` maps the missing
//!    pages (reaching ahead, in handles sized by the room left; a refused map gives back free
//!    pages elsewhere and maps again), then `Heap::take_block` splits the block.
//!
//! A request for which no free block fits gets `Placement::New` from the same search, and
//! `Pool::alloc_new` reserves a range (paged) or a segment (plain) in step 4 instead. Only when
//! the device refuses for good does the strategy's out-of-memory ladder run ([`OomStep`]s), each
//! step placing the request anew through the same `Pool::place`.

mod capture;
mod config;
mod deferred;
mod error;
mod expandable;
mod growth;
mod held;
mod history;
mod page_map;
mod placement;
#[cfg(test)]
mod placement_tests;
pub mod policy;
mod release;
mod seed;
mod streams;

pub use config::{
    parse_size, Backend, Config, ConfigError, CrossStreamReuse, Setting, Strategy, ENV_VAR, NO_DEVICE_MEMORY_EFFECT,
};
pub use error::{format_bytes, OomReport, PoolError, Refused};
pub use held::HeldBlock;
pub use history::{History, HistoryAction, HistoryEntry};
pub use policy::{OomStep, Paging};

use crate::core::{
    BlockState, Handle, Heap, Metric, PoolKind, Released, Rules, SegmentId, SegmentInfo, StatType, Stats,
};
use crate::device::{Device, DeviceError, EventId, StreamId};
use deferred::Deferred;
use expandable::{Backing, Expandable};
use growth::Growth;
use placement::{Placement, Search};

pub use crate::device::DEFAULT_STREAM;

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
    /// Off (`None`) unless recording was asked for.
    history: Option<History>,
    /// Page mapping of expandable segments; `None` for plain segments.
    expandable: Option<Expandable>,
    /// Segment sizing state and the memory limit.
    growth: Growth,
    /// Freed blocks kept pending for their exports or a capture (see `held.rs`).
    held: usize,
    /// Held blocks whose release the device refused: the next synchronize releases them.
    unreleased: Vec<HeldBlock>,
    /// Blocks freed while a stream they use was being captured into a CUDA graph: held (see
    /// `held.rs`) until that capture ends.
    held_for_capture: Vec<HeldBlock>,
    /// Whether the device's streams can be captured: only then must the hot path ask.
    captures_graphs: bool,
}

impl<D: Device> Pool<D> {
    pub fn new(mut device: D, config: Config) -> Self {
        let mut heap = Heap::new(config.rules.clone());
        if config.cross_stream_reuse == CrossStreamReuse::Never {
            heap.keep_shared_apart();
        }
        let config = Self::fit_pages_to(&mut device, config);
        let expandable = config.paging.map(Expandable::new);
        let growth = Growth::new(&config, device.memory_info().total);
        let mut pool = Pool {
            device,
            heap,
            deferred: Deferred::default(),
            config,
            history: None,
            expandable,
            growth,
            held: 0,
            unreleased: Vec::new(),
            held_for_capture: Vec::new(),
            captures_graphs: false,
        };
        pool.captures_graphs = pool.device.captures_graphs();
        pool.preallocate();
        pool
    }

    /// Paged strategies: pages are whole multiples of what the device maps in (CUDA's
    /// granularity, asked of the driver: a smaller `page_size_mb` would fail every map), and the
    /// device makes them as `shareable_handle` / `peer_access` say. The effective page size is
    /// what `config()` reports. A device that cannot map at all is left to fail the first map,
    /// with the driver's reason.
    fn fit_pages_to(device: &mut D, mut config: Config) -> Config {
        if let Some(paging) = config.paging.as_mut() {
            device.set_mapping_options(&config.mapping);
            if let Ok(granularity) = device.mapping_granularity() {
                for page in &mut paging.page {
                    *page = page.next_multiple_of(granularity);
                }
            }
        }
        config
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

    /// `torch.cuda.memory_stats()`'s entries: every statistic, and `max_split_size` as PyTorch
    /// reports it: the byte limit cast to a signed count, so -1 when unset (`SIZE_MAX`).
    pub fn memory_stats(&self) -> Vec<(String, i64)> {
        let mut entries: Vec<(String, i64)> = self
            .stats()
            .entries()
            .into_iter()
            .map(|(key, value)| (key, i64::try_from(value).unwrap_or(i64::MAX)))
            .collect();
        entries.push(("max_split_size".into(), self.rules().max_split_size as i64));
        entries
    }

    pub fn reset_peak_stats(&mut self) {
        self.heap.stats_mut().reset_peaks();
    }

    /// See [`crate::core::Stats::reset_accumulated`].
    pub fn reset_accumulated_stats(&mut self) {
        self.heap.stats_mut().reset_accumulated();
    }

    fn validate(size: u64) -> Result<(), PoolError> {
        if size == 0 || size > Rules::MAX_REQUEST {
            return Err(PoolError::InvalidSize(size));
        }
        Ok(())
    }

    /// Every successful allocation passes here.
    fn allocation(&mut self, handle: Handle, address: u64, size: u64, stream: StreamId) -> Allocation {
        self.note(HistoryAction::Alloc, address, size, stream);
        Allocation { handle, address, size }
    }

    /// Serves `size` bytes on `stream` from the cache without calling the device (no event
    /// queries, no page maps); `None` means [`Pool::alloc_on`] must. Callers that hold an
    /// interpreter lock try this first and release the lock only for the device.
    #[inline(always)]
    pub fn alloc_cached(&mut self, size: u64, stream: StreamId) -> Result<Option<Allocation>, PoolError> {
        Self::validate(size)?;
        let rounded = self.heap.rules().round(size);
        Ok(match self.place_cached(rounded, stream) {
            Some(Placement::Block { id, wait_for: None, mapped: true }) => {
                Some(self.take_cached(id, size, rounded, stream))
            }
            _ => None,
        })
    }

    /// [`Pool::place`] among the stream's own and shared blocks, or `None` while frees wait on
    /// events or streams may be captured: the placement would then need device calls.
    #[inline(always)]
    fn place_cached(&self, rounded: u64, stream: StreamId) -> Option<Placement> {
        // Asking whether the stream is being captured is itself a device call.
        (self.deferred.is_idle() && !self.captures_graphs).then(|| self.place(rounded, stream, Search::Own))
    }

    /// Allocates cached free block `id`, whose pages are mapped, for `size` (`rounded`) bytes.
    #[inline(always)]
    fn take_cached(&mut self, id: u32, size: u64, rounded: u64, stream: StreamId) -> Allocation {
        let (handle, address) = self.heap.take_block(id, size, rounded, stream);
        self.allocation(handle, address, size, stream)
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

    /// Allocates `size` bytes for use on `stream`: from the cache, else from new device memory;
    /// when the device refuses, the strategy's out-of-memory ladder runs: by default every
    /// event is waited for, cached memory returned, the cache searched again (PyTorch forgets
    /// to) and the device asked once more (a device may refuse transiently, so that happens
    /// even if nothing was freed).
    #[inline(always)]
    pub fn alloc_on(&mut self, size: u64, stream: StreamId) -> Result<Allocation, PoolError> {
        Self::validate(size)?;
        let rounded = self.heap.rules().round(size);
        // The cache hit first: it needs none of the checks below, only the bins.
        let placed = self.place_cached(rounded, stream);
        if let Some(Placement::Block { id, wait_for: None, mapped: true }) = placed {
            return Ok(self.take_cached(id, size, rounded, stream));
        }
        self.alloc_slow(size, rounded, stream, placed)
    }

    /// [`Pool::alloc_on`] when the cache could not serve the request without calling the device:
    /// `placed` is where [`Pool::place`] put it, if it could look.
    #[inline(never)]
    fn alloc_slow(
        &mut self,
        size: u64,
        rounded: u64,
        stream: StreamId,
        placed: Option<Placement>,
    ) -> Result<Allocation, PoolError> {
        if self.captures_graphs {
            self.refuse_capture(stream, Refused::Work)?;
        }
        // More than the device or the pool's limit could ever hold: no cache flush can help, and
        // no bookkeeping is set up for it.
        if self.growth.ceiling.is_some_and(|most| rounded > most) {
            return Err(self.out_of_memory(size, stream));
        }
        match self.settle_and_take(size, rounded, stream, placed) {
            Err(PoolError::Device(DeviceError::OutOfMemory { .. })) => {}
            done => return done,
        }
        for &step in self.config.oom_ladder {
            let served = match step {
                OomStep::ReleaseOversize if self.release_oversize(size)? => {
                    let placement = self.place(rounded, stream, Search::Own);
                    let placement = self.place_new(rounded, stream, placement)?;
                    self.take(placement, size, rounded, stream)
                }
                OomStep::ReleaseOversize => continue,
                OomStep::ReleaseCached => {
                    self.empty_cache()?;
                    self.heap.stats_mut().num_alloc_retries += 1;
                    continue;
                }
                OomStep::Place => self.settle_and_take(size, rounded, stream, None),
                OomStep::PlaceLeastMapping => match self.place(rounded, stream, Search::LeastMapping) {
                    Placement::New(_) => continue,
                    placement => self.take(placement, size, rounded, stream),
                },
            };
            match served {
                Err(PoolError::Device(DeviceError::OutOfMemory { .. })) => {}
                done => return done,
            }
        }
        Err(self.out_of_memory(size, stream))
    }

    /// Completes what finished (frees held for a capture, frees waiting on events), places the
    /// request again only if that changed the cache (else `placed` stands), tries other
    /// streams' blocks as `cross_stream_reuse` allows, and takes the block or new memory.
    fn settle_and_take(
        &mut self,
        size: u64,
        rounded: u64,
        stream: StreamId,
        placed: Option<Placement>,
    ) -> Result<Allocation, PoolError> {
        let mut changed = false;
        if self.settle_captured_frees()? {
            self.after_completions();
            changed = true;
        }
        if !self.deferred.is_idle() {
            changed |= self.deferred.poll(&mut self.device, &mut self.heap, false)?;
        }
        let mut placement = match placed {
            Some(placement) if !changed => placement,
            _ => self.place(rounded, stream, Search::Own),
        };
        // Shared blocks are safe for every stream; under `never` only destroyed streams' land there.
        if matches!(placement, Placement::New(_)) && self.config.cross_stream_reuse != CrossStreamReuse::Never {
            // Other streams' frees become shared once a fence recorded after them completes.
            let retired = self.deferred.fence_streams(&mut self.device, &mut self.heap, Some(stream))?;
            if self.deferred.poll(&mut self.device, &mut self.heap, false)? || retired {
                placement = self.place(rounded, stream, Search::Own);
            }
        }
        if matches!(placement, Placement::New(_)) && self.config.cross_stream_reuse == CrossStreamReuse::Wait {
            // An event recorded on a capturing stream would pull `stream` into the capture.
            match self.place(rounded, stream, Search::Foreign) {
                Placement::Block { wait_for: Some(owner), .. }
                    if self.captures_graphs && self.device.is_capturing(owner).unwrap_or(true) => {}
                foreign @ Placement::Block { .. } => placement = foreign,
                Placement::New(_) => {}
            }
        }
        let placement = self.place_new(rounded, stream, placement)?;
        self.take(placement, size, rounded, stream)
    }

    /// `placement`, unless it asks for new memory while a range's free address space beyond the
    /// `max_split_size` cap could take the request: then that space (see [`Search::Uncapped`]).
    /// New memory for a stream that is gone is an error, rather than memory cached for it.
    fn place_new(&mut self, rounded: u64, stream: StreamId, placement: Placement) -> Result<Placement, PoolError> {
        let Placement::New(_) = placement else { return Ok(placement) };
        self.device.query_stream(stream)?;
        // Uncapped, the search that placed the request already looked at every free block.
        if self.heap.rules().max_block_for(rounded) == u64::MAX {
            return Ok(placement);
        }
        Ok(match self.place(rounded, stream, Search::Uncapped) {
            found @ Placement::Block { .. } => found,
            Placement::New(_) => placement,
        })
    }

    /// Allocates what [`Pool::place`] chose: the block (after making `stream` wait for its owner,
    /// if it is another stream's) or new memory.
    fn take(
        &mut self,
        placement: Placement,
        size: u64,
        rounded: u64,
        stream: StreamId,
    ) -> Result<Allocation, PoolError> {
        match placement {
            Placement::Block { id, wait_for, .. } => {
                if let Some(owner) = wait_for {
                    self.make_wait_for(stream, owner)?;
                }
                self.take_block(id, size, rounded, stream)
            }
            Placement::New(kind) => self.alloc_new(kind, size, rounded, stream),
        }
    }

    /// Allocates the front of free block `id` for `size` (`rounded` by the rules), first mapping
    /// its pages if it lies in an expandable range.
    fn take_block(&mut self, id: u32, size: u64, rounded: u64, stream: StreamId) -> Result<Allocation, PoolError> {
        if let Some(pages) = self.expandable.as_mut() {
            let (block, segment) = (self.heap.block_at(id), self.heap.segment_of(id));
            let (address, free_end) = (block.address, block.end());
            let (device, heap, limit) = (&mut self.device, &mut self.heap, self.growth.limit);
            if pages.ensure_mapped(device, heap, segment, address, rounded, free_end, limit)? == Backing::Mapped {
                self.note_page_calls(stream);
            }
        }
        let (handle, address) = self.heap.take_block(id, size, rounded, stream);
        Ok(self.allocation(handle, address, size, stream))
    }

    /// Counts and records a request for `size` bytes that failed for good; returns its error.
    fn out_of_memory(&mut self, size: u64, stream: StreamId) -> PoolError {
        self.heap.stats_mut().num_ooms += 1;
        self.note(HistoryAction::Oom, self.device.memory_info().free().unwrap_or(0), size, stream);
        PoolError::OutOfMemory(Box::new(self.oom_report(size)))
    }

    /// New device memory of pool `kind` for `size` bytes on `stream`, allocated from: a segment,
    /// or for a paged strategy a new address range, whose pages then get mapped.
    fn alloc_new(
        &mut self,
        kind: PoolKind,
        size: u64,
        rounded: u64,
        stream: StreamId,
    ) -> Result<Allocation, PoolError> {
        if let Some(pages) = self.expandable.as_mut() {
            let segment = pages.reserve_range(&mut self.device, &mut self.heap, kind, stream, rounded)?;
            let id = self.heap.segment_head(segment);
            return self.take_block(id, size, rounded, stream);
        }
        self.collect_garbage()?;
        let (address, segment_size) = self.allocate_segment(rounded, stream)?;
        self.note(HistoryAction::SegmentAlloc, address, segment_size, stream);
        let segment = self.heap.add_segment(address, segment_size, kind, stream);
        let handle = self.heap.take_segment(segment, size, stream);
        let address = self.heap.block_at(handle.index).address;
        Ok(self.allocation(handle, address, size, stream))
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
            largest_free_block: match self.expandable.as_ref() {
                Some(pages) => pages.largest_servable(&self.heap, self.available()),
                None => self.heap.largest_free_block(),
            },
            limit: self.growth.limit,
            strategy: self.config.strategy.name(),
            max_split_size: Some(self.rules().max_split_size).filter(|&m| m != u64::MAX),
            garbage_collection_inert: self.config.garbage_collection_threshold.is_some() && self.growth.limit.is_none(),
        }
    }

    /// Returns an allocation's block to the cache. A block used on other streams waits for
    /// events recorded on them now; otherwise the device is not called, unless the release
    /// watermark gives memory back. An error means nothing changed: the handle is still live.
    #[inline(always)]
    pub fn free(&mut self, handle: Handle) -> Result<(), PoolError> {
        if let Some(segment) = self.free_to_cache(handle)? {
            self.after_free(segment);
        }
        Ok(())
    }

    /// [`Pool::free`] without the release watermark: returns the segment the block went back to
    /// the cache in, or `None` while it waits for other streams or for a capture to end.
    #[inline(always)]
    fn free_to_cache(&mut self, handle: Handle) -> Result<Option<SegmentId>, PoolError> {
        if self.captures_graphs && self.used_by_capture(handle)? {
            // Freed for its user now, as PyTorch does (no longer allocated, a second free is a
            // double free), but held, neither reused nor given back, until the capture ends.
            let block = self.free_held(handle)?;
            self.held_for_capture.push(block);
            return Ok(None);
        }
        // A peek: `release` validates the handle (and a stale one's new occupant has uses or not).
        if self.heap.peek_uses(handle) != 0 {
            return self.free_used(handle);
        }
        self.note_free(handle, false);
        Ok(match self.heap.release(handle)? {
            Released::Cached { segment } => Some(segment),
            Released::Pending { id, segment, .. } => self.wait_or_cache(id, segment, Vec::new()),
        })
    }

    /// [`Pool::free_to_cache`] of a block other streams used: their events are recorded first, so
    /// that if the device refuses one the free has not happened and can be retried.
    #[cold]
    fn free_used(&mut self, handle: Handle) -> Result<Option<SegmentId>, PoolError> {
        let uses = self.heap.block(handle)?.uses;
        let waits = self.deferred.record_waits(&mut self.device, handle.index, uses)?;
        self.note_free(handle, !waits.is_empty());
        Ok(match self.heap.release(handle)? {
            Released::Cached { segment } => Some(segment),
            Released::Pending { id, segment, .. } => self.wait_or_cache(id, segment, waits),
        })
    }

    /// Pending block `id` waits for `waits`, or, with nothing to wait for, returns to the cache:
    /// then its segment comes back, for the caller to apply the release watermark or not.
    #[must_use]
    fn wait_or_cache(&mut self, id: u32, segment: SegmentId, waits: Vec<(StreamId, EventId)>) -> Option<SegmentId> {
        if waits.is_empty() {
            self.deferred.forget_uses(id);
            self.heap.complete_pending(id);
            Some(segment)
        } else {
            self.deferred.attach(id, waits);
            None
        }
    }

    /// Whether freeing `handle` now would call the device (events for other streams' uses, or
    /// memory given back past the watermark): callers that hold an interpreter lock release it
    /// first only then.
    pub fn free_calls_device(&self, handle: Handle) -> Result<bool, PoolError> {
        let block = self.heap.block(handle)?;
        // Asking whether its streams are being captured is a device call too.
        if block.has_uses() || self.captures_graphs {
            return Ok(true);
        }
        let Some(threshold) = self.config.release_threshold else { return Ok(false) };
        // After the free, `size` more bytes are free; over the watermark something goes back.
        let reserved = self.reserved();
        let active = self.heap.stats().get(Metric::ActiveBytes, StatType::All).current;
        let free_after = reserved - (active - block.size);
        Ok(free_after as f64 > threshold * reserved as f64)
    }

    /// The address and block size of a live allocation.
    pub fn block_of(&self, handle: Handle) -> Result<(u64, u64), PoolError> {
        let b = self.heap.block(handle)?;
        Ok((b.address, b.size))
    }

    /// Copies `data` into a live allocation at `offset`, ordered after the work queued on the
    /// allocation's stream (where its users' work is, or was waited for).
    pub fn write(&mut self, handle: Handle, offset: u64, data: &[u8]) -> Result<(), PoolError> {
        let (address, stream) = self.copy_target(handle, offset, data.len())?;
        Ok(self.device.write(stream, address, data)?)
    }

    /// Copies from a live allocation at `offset` into `out`, ordered as [`Pool::write`].
    pub fn read(&mut self, handle: Handle, offset: u64, out: &mut [u8]) -> Result<(), PoolError> {
        let (address, stream) = self.copy_target(handle, offset, out.len())?;
        Ok(self.device.read(stream, address, out)?)
    }

    /// Where a copy of `len` bytes at `offset` into an allocation goes, and on which stream.
    /// A copy waits for its stream, which a capture forbids (and the captured copy would read
    /// or write a host buffer long gone), so a capturing stream's allocations are refused.
    fn copy_target(&mut self, handle: Handle, offset: u64, len: usize) -> Result<(u64, StreamId), PoolError> {
        let b = self.heap.block(handle)?;
        let (address, size, stream) = (b.address, b.size, b.stream);
        if offset.checked_add(len as u64).is_none_or(|end| end > size) {
            return Err(PoolError::Device(DeviceError::InvalidAddress(address.saturating_add(offset))));
        }
        if self.captures_graphs {
            self.refuse_capture(stream, Refused::Copy)?;
        }
        Ok((address + offset, stream))
    }

    /// The stream a live allocation was made for.
    pub fn stream_of(&self, handle: Handle) -> Result<StreamId, PoolError> {
        Ok(self.heap.block(handle)?.stream)
    }

    /// Waits for pending events, then gives every fully free segment back to the device;
    /// returns the bytes released.
    pub fn empty_cache(&mut self) -> Result<u64, PoolError> {
        self.complete_all()?;
        self.heap.stats_mut().num_sync_all_streams += 1;
        self.release_cached()
    }

    /// Returns cached memory to the device: free pages of expandable ranges, then every fully
    /// free segment (or range). Returns the bytes that stop being reserved.
    fn release_cached(&mut self) -> Result<u64, PoolError> {
        if self.capture_underway() {
            return Ok(0);
        }
        let mut bytes = match self.expandable.as_mut() {
            Some(pages) => pages.unmap_free_pages(&mut self.device, &mut self.heap, true)?,
            None => 0,
        };
        self.note_page_calls(DEFAULT_STREAM);
        // The device goes first: a refusal leaves the segment cached and the heap in agreement.
        for (sid, address) in self.heap.free_segments() {
            if let Some(pages) = self.expandable.as_mut().filter(|p| p.is_range(address)) {
                self.device.unreserve(address)?;
                pages.forget(address);
                self.heap.remove_segment(sid);
                self.heap.stats_mut().driver.unreserve += 1;
                continue;
            }
            bytes += self.release_segment(sid)?;
        }
        Ok(bytes)
    }

    /// Every segment with its blocks, by address, as PyTorch's snapshots show them: a paged
    /// range appears as one segment per contiguous mapped run, so sizes add up to reserved bytes.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let segments = self.heap.segments();
        match self.expandable.as_ref() {
            Some(pages) => segments.into_iter().flat_map(|s| pages.split_by_mapping(s)).collect(),
            None => segments,
        }
    }

    /// Whether `[address, address + size)` lies inside one allocated block: memory its owner
    /// may hand to another process. A freed block's bytes are the cache's (or another
    /// allocation's) from then on. O(blocks): for exports, not for the hot path.
    pub fn is_allocated(&self, address: u64, size: u64) -> bool {
        let Some(end) = address.checked_add(size.max(1)) else { return false };
        self.heap
            .segments()
            .iter()
            .flat_map(|s| &s.blocks)
            .any(|b| b.state == BlockState::Allocated && b.address <= address && end <= b.address + b.size)
    }

    /// The heap's invariants, plus: the device holds exactly the reserved bytes.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.heap.check_invariants()?;
        let reserved = self.stats().get(Metric::ReservedBytes, StatType::All).current;
        let held = self.device.memory_info().held;
        if held != reserved {
            return Err(format!("device holds {held} bytes but the pool reserves {reserved}"));
        }
        let pending =
            self.heap.segments().iter().flat_map(|s| &s.blocks).filter(|b| b.state == BlockState::Pending).count();
        let (waiting, held) = (self.deferred.pending_blocks(), self.held);
        if pending != waiting + held {
            return Err(format!("{pending} blocks are pending but {waiting} wait on events and {held} are held"));
        }
        self.expandable.as_ref().map_or(Ok(()), |pages| pages.check(&self.heap))
    }
}
