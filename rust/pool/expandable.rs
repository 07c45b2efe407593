//! Expandable segments: each pool kind allocates from one large reserved address range whose
//! pages are mapped on demand, so every block of a kind can coalesce with every other and a
//! free hole costs no memory once its pages are unmapped.
//!
//! Mapped pages are kept after frees and reused (a map call costs microseconds on a GPU); they
//! are unmapped only under pressure (a refused map, an OOM flush), on `empty_cache`, or past the
//! release watermark, and only in whole handles (physical allocations, see `page_map.rs`).
//! Physical use is then the pages that live blocks touch, not the address space that
//! fragmentation spreads them over.
//!
//! How a range maps, and what a refused map does, is the strategy's [`Paging`] policy
//! (`policy.rs`): PyTorch's handles (`strategy:expandable`: 20 MiB in the large range, 2 MiB in
//! the small one, exactly those a block needs), the reference pager (`pages`: 2 MiB pages, each
//! its own handle, a map call reaching ahead) and gpupool's pager (`default`): the same, with
//! handles that shrink with the room left on the device, and a refused map that gives back free
//! pages elsewhere that no queued work uses and maps again, so the block keeps its place and no
//! stream is waited for; only if none are free does the out-of-memory path run. Where a block
//! goes is not decided here but in `placement.rs`.

use super::page_map::PageMap;
use super::policy::{Handles, Paging};
use crate::core::{BlockInfo, BlockState, Heap, Metric, PoolKind, SegmentId, SegmentInfo, StatType, SHARED};
use crate::device::{Device, DeviceError};

/// What [`Expandable::ensure_mapped`] did for a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Its pages were mapped already.
    Ready,
    /// The device mapped what was missing.
    Mapped,
}

/// One reserved range and its page map.
#[derive(Debug)]
struct Range {
    segment: SegmentId,
    /// How far one map call reaches into free space (at least one page).
    map_ahead: u64,
    base: u64,
    kind: PoolKind,
    page_size: u64,
    /// log2 of `page_size` when it is a power of two: the hot path then shifts instead of
    /// dividing. PyTorch's 20 MiB handles are not.
    page_shift: Option<u32>,
    pages: PageMap,
}

impl Range {
    /// The pages `[first, end)` that bytes `[address, address + len)` touch.
    #[inline]
    fn pages_under(&self, address: u64, len: u64) -> std::ops::Range<u64> {
        let (start, end) = (address - self.base, address + len - self.base + self.page_size - 1);
        match self.page_shift {
            Some(shift) => (start >> shift)..(end >> shift),
            None => (start / self.page_size)..(end / self.page_size),
        }
    }

    /// The address and size of `pages`.
    fn extent(&self, pages: &std::ops::Range<u64>) -> (u64, u64) {
        (self.base + pages.start * self.page_size, (pages.end - pages.start) * self.page_size)
    }
}

/// [`Handles::ByHeadroom`]'s thresholds.
struct Headroom {
    share: f64,
    roomy_divisor: u64,
    tight_divisor: u64,
}

impl Headroom {
    /// The handle size for a map of `bytes` that leaves `reserved` bytes mapped: while at least
    /// `share` of what the pool may hold (the device's capacity, or its limit if lower) stays
    /// free, `1 / roomy_divisor` of that; past it, `1 / tight_divisor` of what stays free. Whole
    /// pages, at least one, at most the map. A device of unknown capacity under no limit always
    /// has room, and a map there is one handle.
    fn handle_size<D: Device>(&self, device: &D, reserved: u64, limit: Option<u64>, bytes: u64, page: u64) -> u64 {
        let info = device.memory_info();
        let Some(capacity) = info.total.into_iter().chain(limit).min() else { return bytes };
        let device_free = info.total.map_or(u64::MAX, |total| total.saturating_sub(info.held));
        let free = device_free.min(capacity.saturating_sub(reserved));
        let most = if free as f64 >= self.share * capacity as f64 {
            capacity / self.roomy_divisor
        } else {
            free / self.tight_divisor
        };
        (most / page).clamp(1, (bytes / page).max(1)) * page
    }
}

/// The largest range reserved (1 PiB, far beyond any device): its page map is at most 64 MiB of
/// address space, and only the words of mapped pages are ever written.
const MAX_RANGE: u64 = 1 << 50;

/// `size` raised by half the width of its free-list bin (`core::bins`), so that the range's
/// free space stays in one bin while allocations split pieces off its front and frees merge
/// them back: those then change no bitmap (`Heap::split_in_place`). A range sized to a power of
/// two would sit on a bin's lower edge and change bins on every split.
fn mid_bin(size: u64) -> u64 {
    let log2 = 63 - size.max(1).leading_zeros();
    size.saturating_add(1u64.checked_shl(log2.saturating_sub(6)).unwrap_or(0))
}

/// A handle to unmap: its range's index, its pages, and its free stretch's place in PyTorch's
/// release order (the large pool, then the small one, each by size and address).
type Unmap = (usize, std::ops::Range<u64>, (bool, u64, u64));

#[derive(Debug)]
pub struct Expandable {
    paging: Paging,
    ranges: Vec<Range>,
    /// Map (true) and unmap calls as (address, size), kept only while history is recorded.
    calls: Option<Vec<(bool, u64, u64)>>,
}

impl Expandable {
    pub fn new(paging: Paging) -> Self {
        assert!(paging.page.iter().all(|&p| p > 0), "pages have a size");
        Expandable { paging, ranges: Vec::new(), calls: None }
    }

    pub fn log_calls(&mut self, on: bool) {
        self.calls = on.then(Vec::new);
    }

    pub fn take_calls(&mut self) -> Vec<(bool, u64, u64)> {
        self.calls.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn is_range(&self, address: u64) -> bool {
        self.ranges.iter().any(|r| r.base == address)
    }

    /// Reserves a new range for `kind`, big enough for `rounded` bytes and for the device's
    /// capacity many times over (address space is cheap; running out of it would fragment).
    /// Maps nothing.
    pub fn reserve_range<D: Device>(
        &mut self,
        device: &mut D,
        heap: &mut Heap,
        kind: PoolKind,
        stream: u32,
        rounded: u64,
    ) -> Result<SegmentId, DeviceError> {
        // The page map costs a bit per page of the range: a request no device could hold must
        // not size one.
        let map_ahead = self.paging.map_ahead_of(kind);
        if rounded > MAX_RANGE - map_ahead {
            return Err(DeviceError::OutOfMemory { requested: rounded });
        }
        let capacity = device.memory_info().total.unwrap_or(1 << 40);
        // Twice the capacity, at most 1 TiB unless one request needs more.
        let page_size = self.paging.page_of(kind);
        let wanted = capacity.saturating_mul(2).min(1 << 40).max(rounded + map_ahead);
        let size = mid_bin(wanted).div_ceil(page_size) * page_size;
        let base = device.reserve(size)?;
        heap.stats_mut().driver.reserve += 1;
        let segment = heap.add_expandable_segment(base, size, kind, stream);
        let pages = size / page_size;
        let page_shift = page_size.is_power_of_two().then(|| page_size.trailing_zeros());
        self.ranges.push(Range { segment, base, kind, map_ahead, page_size, page_shift, pages: PageMap::new(pages) });
        Ok(segment)
    }

    /// Whether `[address, address + len)` in `segment` lies on mapped pages (plain segments are
    /// not ranges: always).
    #[inline(always)]
    pub fn is_backed(&self, segment: SegmentId, address: u64, len: u64) -> bool {
        let Some(range) = self.ranges.iter().find(|r| r.segment == segment) else { return true };
        range.pages.all_mapped(range.pages_under(address, len))
    }

    /// Maps whatever pages of `[address, address + len)` in `segment` are not mapped yet. When
    /// the last page needs mapping, the call maps ahead up to the range's `map_ahead` into the free
    /// space that follows (up to `free_end`), so growing allocations cost few map calls; if the
    /// device refuses that much, exactly what is needed is mapped.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn ensure_mapped<D: Device>(
        &mut self,
        device: &mut D,
        heap: &mut Heap,
        segment: SegmentId,
        address: u64,
        len: u64,
        free_end: u64,
        limit: Option<u64>,
    ) -> Result<Backing, DeviceError> {
        let Some(index) = self.ranges.iter().position(|r| r.segment == segment) else { return Ok(Backing::Ready) };
        let range = &self.ranges[index];
        let pages = range.pages_under(address, len);
        // The common case, a block on pages already mapped: no call and no allocation.
        if range.pages.all_mapped(pages.clone()) {
            return Ok(Backing::Ready);
        }
        self.map_missing(device, heap, index, pages, free_end, limit)
    }

    /// [`Expandable::ensure_mapped`]'s slow path: maps the unmapped runs of `pages` in range
    /// `index`, mapping ahead after the last one. When the device refuses, and the policy says
    /// so, first gives back free pages elsewhere and maps again.
    #[cold]
    fn map_missing<D: Device>(
        &mut self,
        device: &mut D,
        heap: &mut Heap,
        index: usize,
        pages: std::ops::Range<u64>,
        free_end: u64,
        limit: Option<u64>,
    ) -> Result<Backing, DeviceError> {
        let refused = match self.map_pages(device, heap, index, pages.clone(), free_end, limit) {
            Err(DeviceError::OutOfMemory { requested }) if self.paging.give_back_on_refusal => requested,
            other => return other.map(|()| Backing::Mapped),
        };
        // The device is full. Free pages elsewhere that no queued work uses go back, as many as
        // this map needs and one map-ahead more (so the next one need not ask again), and the
        // block keeps its best-fit place. Only if that frees nothing does the out-of-memory path
        // wait for every stream and place the block anew.
        let range = &self.ranges[index];
        let new_pages: u64 = range.pages.runs(pages.clone(), false).iter().map(|run| run.end - run.start).sum();
        let want = new_pages * range.page_size + range.map_ahead;
        let keep = (index, pages.start..((free_end - range.base) / range.page_size).max(pages.end));
        // Nothing goes back while a stream captures (see capture.rs).
        if super::capture::any_capturing(device, heap)
            || self.unmap_handles(device, heap, false, want, Some(keep))? == 0
        {
            return Err(DeviceError::OutOfMemory { requested: refused });
        }
        self.map_pages(device, heap, index, pages, free_end, limit)?;
        Ok(Backing::Mapped)
    }

    /// Maps the unmapped runs of `pages` in range `index`, mapping ahead after the last one.
    fn map_pages<D: Device>(
        &mut self,
        device: &mut D,
        heap: &mut Heap,
        index: usize,
        pages: std::ops::Range<u64>,
        free_end: u64,
        limit: Option<u64>,
    ) -> Result<(), DeviceError> {
        let handles = self.paging.handles;
        let range = &mut self.ranges[index];
        let page_size = range.page_size;
        let (first, end) = (pages.start, pages.end);
        let ahead_end = ((free_end - range.base) / page_size).max(end);
        for run in range.pages.runs(first..end, false) {
            let wanted_end = (run.start + range.map_ahead / page_size).clamp(run.end, ahead_end);
            let ahead =
                if run.end == end { range.pages.runs(run.end..wanted_end, false).first().cloned() } else { None };
            let extended = match ahead {
                Some(more) if more.start == run.end => run.start..more.end,
                _ => run.clone(),
            };
            let done = match Self::map_run(device, heap, range, extended.clone(), limit, handles) {
                Err(DeviceError::OutOfMemory { .. }) if extended != run => {
                    Self::map_run(device, heap, range, run.clone(), limit, handles).map(|_| run)?
                }
                other => other.map(|_| extended)?,
            };
            if let Some(calls) = self.calls.as_mut() {
                let (address, size) = range.extent(&done);
                calls.push((true, address, size));
            }
        }
        Ok(())
    }

    /// Maps unmapped `run` of `range` in one device call, backed by handles as `handles` says.
    fn map_run<D: Device>(
        device: &mut D,
        heap: &mut Heap,
        range: &mut Range,
        run: std::ops::Range<u64>,
        limit: Option<u64>,
        handles: Handles,
    ) -> Result<(), DeviceError> {
        let (address, bytes) = range.extent(&run);
        // The pool's own limit (a memory fraction) refuses like the device would.
        let reserved = heap.stats().get(Metric::ReservedBytes, StatType::All).current;
        if limit.is_some_and(|limit| reserved + bytes > limit) {
            return Err(DeviceError::OutOfMemory { requested: bytes });
        }
        let handle = match handles {
            Handles::PerPage => range.page_size,
            Handles::ByHeadroom { roomy_share, roomy_divisor, tight_divisor } => {
                let room = Headroom { share: roomy_share, roomy_divisor, tight_divisor };
                room.handle_size(device, reserved + bytes, limit, bytes, range.page_size)
            }
        };
        device.map(address, bytes, handle)?;
        heap.stats_mut().driver.mapped_run(bytes.div_ceil(handle));
        let runs = 1 - range.pages.touches_mapped(&run);
        range.pages.map(run, handle / range.page_size);
        heap.note_mapped(range.segment, bytes, true, runs);
        heap.stats_mut().num_device_map += 1;
        Ok(())
    }

    /// Unmaps every handle that lies wholly inside free space; returns the bytes freed.
    /// Space a stream freed while busy may still be in use by its queued work: with `wait` the
    /// stream is synchronized first (as `cudaFree` would), else that space stays mapped.
    pub fn unmap_free_pages<D: Device>(
        &mut self,
        device: &mut D,
        heap: &mut Heap,
        wait: bool,
    ) -> Result<u64, DeviceError> {
        self.unmap_handles(device, heap, wait, u64::MAX, None)
    }

    /// Unmaps handles that lie wholly inside free space, in address order, except those that
    /// overlap `keep` (a range's index and pages), until at least `want` bytes went back;
    /// returns the bytes freed. See [`Expandable::unmap_free_pages`] for `wait`.
    fn unmap_handles<D: Device>(
        &mut self,
        device: &mut D,
        heap: &mut Heap,
        wait: bool,
        want: u64,
        keep: Option<(usize, std::ops::Range<u64>)>,
    ) -> Result<u64, DeviceError> {
        let mut handles: Vec<Unmap> = Vec::new();
        let mut idle: Vec<(u32, bool)> = Vec::new();
        for (index, range) in self.ranges.iter().enumerate() {
            let page_size = range.page_size;
            // Adjacent free blocks of different owners still free the pages they share. A block
            // its stream freed while busy may still be in use by queued work: it stays mapped.
            let mut free: Vec<(u64, u64)> = Vec::new();
            let candidates: Vec<(u64, u64, u32)> =
                heap.free_blocks(range.segment).map(|(_, b)| (b.address, b.size, b.stream)).collect();
            for (address, size, owner) in candidates {
                if owner != SHARED && !Self::stream_idle(device, &mut idle, owner, wait)? {
                    continue;
                }
                match free.last_mut() {
                    Some((start, len)) if *start + *len == address => *len += size,
                    _ => free.push((address, size)),
                }
            }
            for (address, size) in free {
                let first = (address - range.base).div_ceil(page_size);
                let end = (address + size - range.base) / page_size;
                if first >= end {
                    continue;
                }
                let order = (range.kind == PoolKind::Small, size, address);
                for handle in range.pages.handles_within(first..end) {
                    let kept =
                        keep.as_ref().is_some_and(|(i, k)| *i == index && handle.start < k.end && k.start < handle.end);
                    if !kept {
                        handles.push((index, handle, order));
                    }
                }
            }
        }
        // Everything goes back: the order only orders the calls, as PyTorch's release orders them.
        // A partial release keeps address order (the lowest free handles first).
        if want == u64::MAX {
            handles.sort_by_key(|&(_, _, order)| order);
        }
        let mut released = 0;
        // One handle per call (on CUDA, one mapping each), so a failure leaves every handle
        // before it unmapped and recorded as such, and the rest mapped.
        for (index, handle, _) in handles {
            if released >= want {
                break;
            }
            let range = &mut self.ranges[index];
            let (address, size) = range.extent(&handle);
            device.unmap(address, size)?;
            // One entry for the handles of one free stretch, as PyTorch records one unmap a block.
            if let Some(calls) = self.calls.as_mut() {
                match calls.last_mut().filter(|&&mut (mapped, at, len)| !mapped && at + len == address) {
                    Some(last) => last.2 += size,
                    None => calls.push((false, address, size)),
                }
            }
            let runs = range.pages.touches_mapped(&handle) - 1;
            range.pages.unmap(handle);
            heap.note_mapped(range.segment, size, false, runs);
            heap.stats_mut().num_device_unmap += 1;
            heap.stats_mut().driver.unmap += 1;
            released += size;
        }
        Ok(released)
    }

    /// Whether free block `id` may serve a request whose cached blocks `max_split_size` caps at
    /// `cap`: within the cap, or lying partly on unmapped pages (address space to map, as PyTorch
    /// maps a request's pages from a range's unmapped remainder). A block wholly on mapped pages
    /// beyond the cap is cached memory that the cap keeps whole for big requests.
    pub fn may_grow_into(&self, heap: &Heap, id: u32, cap: u64) -> bool {
        let b = heap.block_at(id);
        b.size <= cap || !self.is_backed(heap.segment_of(id), b.address, b.size)
    }

    /// The smallest free block of `owner` in `kind`'s ranges that holds `rounded` bytes and
    /// [`Expandable::may_grow_into`] allows (lowest address first among equals). Scans every
    /// free block of those ranges: only the growth path calls it, when the best fit is cached
    /// memory beyond the cap.
    pub fn growth_fit(&self, heap: &Heap, rounded: u64, cap: u64, kind: PoolKind, owner: u32) -> Option<u32> {
        let mut best: Option<(u64, u64, u32)> = None;
        for range in self.ranges.iter().filter(|r| r.kind == kind) {
            for (id, b) in heap.free_blocks(range.segment) {
                if b.size < rounded || b.stream != owner || !self.may_grow_into(heap, id, cap) {
                    continue;
                }
                if best.is_none_or(|(size, at, _)| (b.size, b.address) < (size, at)) {
                    best = Some((b.size, b.address, id));
                }
            }
        }
        best.map(|(_, _, id)| id)
    }

    /// Under memory pressure: the free block for `rounded` bytes on `stream` whose front needs
    /// the fewest pages mapped, typically a hole whose first page a live neighbour keeps mapped;
    /// ties go to the lowest address. Fronts only: a block at a hole's back would sit against the
    /// live block after the hole, so the free rest could not merge with that block's space when
    /// it is freed, as a tensor grown by copying frees its last version right after the new one
    /// is placed (BENCHMARKS.md, "Growing tensors"). Scans every free block of the kind's ranges;
    /// only the out-of-memory path calls it.
    pub fn least_mapping_fit(&self, heap: &Heap, rounded: u64, kind: PoolKind, stream: u32) -> Option<u32> {
        let mut best: Option<(u64, u64, u32)> = None;
        for range in self.ranges.iter().filter(|r| r.kind == kind) {
            for (id, b) in heap.free_blocks(range.segment) {
                if b.size < rounded || (b.stream != stream && b.stream != SHARED) {
                    continue;
                }
                let pages = range.pages_under(b.address, rounded);
                let new_pages = pages.filter(|&p| !range.pages.is_mapped(p)).count() as u64;
                if best.is_none_or(|(n, at, _)| (new_pages, b.address) < (n, at)) {
                    best = Some((new_pages, b.address, id));
                }
            }
        }
        best.map(|(_, _, id)| id)
    }

    /// Whether `stream` has no queued work (after waiting for it, with `wait`), asking the
    /// device once per stream per reclaim. A destroyed stream was synchronized first.
    fn stream_idle<D: Device>(
        device: &mut D,
        known: &mut Vec<(u32, bool)>,
        stream: u32,
        wait: bool,
    ) -> Result<bool, DeviceError> {
        if let Some(&(_, idle)) = known.iter().find(|(s, _)| *s == stream) {
            return Ok(idle);
        }
        let idle = match device.is_capturing(stream) {
            // A capturing stream may not be queried or waited for: its space stays mapped.
            Ok(true) => false,
            Ok(false) => match device.query_stream(stream) {
                Ok(false) if wait => device.synchronize_stream(stream).map(|_| true)?,
                Err(DeviceError::InvalidStream(_)) => true,
                other => other?,
            },
            Err(DeviceError::InvalidStream(_)) => true,
            Err(e) => return Err(e),
        };
        known.push((stream, idle));
        Ok(idle)
    }

    /// A range as PyTorch's snapshots show an expandable segment: one segment per contiguous
    /// mapped run, holding the blocks that lie in it (free ones clipped to it), so that the
    /// segments' sizes add up to the reserved bytes. Other segments pass through unchanged.
    pub fn split_by_mapping(&self, segment: SegmentInfo) -> Vec<SegmentInfo> {
        let Some(range) = self.ranges.iter().find(|r| r.base == segment.address) else { return vec![segment] };
        let blocks = &segment.blocks;
        let mut first = 0;
        let mut out = Vec::new();
        let page_size = range.page_size;
        for run in range.pages.runs(0..segment.size / page_size, true) {
            let (start, end) = (range.base + run.start * page_size, range.base + run.end * page_size);
            // Blocks are in address order; one that reaches past this run also starts the next.
            while blocks[first].address + blocks[first].size <= start {
                first += 1;
            }
            let pieces = blocks[first..]
                .iter()
                .take_while(|b| b.address < end)
                .map(|b| {
                    let (from, to) = (b.address.max(start), (b.address + b.size).min(end));
                    let whole = (from, to) == (b.address, b.address + b.size);
                    // Blocks in use are mapped whole (checked by `check`): only free ones are cut.
                    debug_assert!(whole || b.state == BlockState::Free);
                    BlockInfo { address: from, size: to - from, requested: if whole { b.requested } else { 0 }, ..*b }
                })
                .collect();
            let size = end - start;
            let (kind, stream) = (segment.kind, segment.stream);
            out.push(SegmentInfo {
                address: start,
                size,
                mapped: size,
                expandable: true,
                kind,
                stream,
                blocks: pieces,
            });
        }
        out
    }

    /// Bytes of `[address, address + size)` (inside the range at `base`) on mapped pages.
    fn mapped_within(&self, range: &Range, address: u64, size: u64) -> u64 {
        let page_size = range.page_size;
        range
            .pages
            .runs(range.pages_under(address, size), true)
            .iter()
            .map(|run| {
                let (from, to) = (range.base + run.start * page_size, range.base + run.end * page_size);
                to.min(address + size) - from.max(address)
            })
            .sum()
    }

    /// The largest request the ranges could serve now: a free block, as far as its mapped pages
    /// plus `available` bytes of new pages (what the device and the pool's limit still give) back
    /// it. Free address space alone is not memory. O(free blocks); for error reports.
    pub fn largest_servable(&self, heap: &Heap, available: u64) -> u64 {
        let mut largest = 0;
        for range in &self.ranges {
            for (_, b) in heap.free_blocks(range.segment) {
                let mapped = self.mapped_within(range, b.address, b.size);
                largest = largest.max(b.size.min(mapped.saturating_add(available)));
            }
        }
        largest
    }

    /// Forgets the range at `address` after the heap released its (fully free, unmapped) segment.
    /// The range of `kind`, reserved for at least `extent` bytes if there is none yet: for a
    /// pool seeded with pages mapped before a replay began.
    pub fn seed_range<D: Device>(
        &mut self,
        device: &mut D,
        heap: &mut Heap,
        kind: PoolKind,
        stream: u32,
        extent: u64,
    ) -> Result<SegmentId, DeviceError> {
        match self.ranges.iter().find(|r| r.kind == kind) {
            Some(range) if range.pages.len() * range.page_size >= extent => Ok(range.segment),
            Some(_) => Err(DeviceError::Unsupported("seeding pages beyond a range reserved before")),
            None => self.reserve_range(device, heap, kind, stream, extent),
        }
    }

    /// Maps the pages under `[offset, offset + size)` of range `segment` that are not mapped
    /// yet, as if mapped before the replay: no driver call is counted and none is logged.
    pub fn seed_pages<D: Device>(
        &mut self,
        device: &mut D,
        heap: &mut Heap,
        segment: SegmentId,
        offset: u64,
        size: u64,
    ) -> Result<(), DeviceError> {
        let range = self.ranges.iter_mut().find(|r| r.segment == segment).ok_or(DeviceError::InvalidAddress(offset))?;
        let end = offset.checked_add(size).filter(|&end| end <= range.pages.len() * range.page_size);
        if size == 0 || end.is_none() {
            return Err(DeviceError::InvalidAddress(offset));
        }
        for run in range.pages.runs(range.pages_under(range.base + offset, size), false) {
            let (address, bytes) = range.extent(&run);
            device.map(address, bytes, range.page_size)?;
            let runs = 1 - range.pages.touches_mapped(&run);
            range.pages.map(run, 1);
            heap.note_mapped(range.segment, bytes, true, runs);
        }
        Ok(())
    }

    pub fn forget(&mut self, address: u64) {
        self.ranges.retain(|r| r.base != address);
    }

    /// Every allocated or pending block's pages are mapped, and the heap's mapped bytes equal
    /// the page map's.
    pub fn check(&self, heap: &Heap) -> Result<(), String> {
        for seg in heap.segments() {
            let Some(range) = self.ranges.iter().find(|r| r.base == seg.address) else { continue };
            if range.kind != seg.kind {
                return Err(format!("range {:#x} changed pool kind", range.base));
            }
            if range.pages.mapped_pages() * range.page_size != heap.mapped_bytes(range.segment) {
                return Err(format!("range {:#x}: page map and heap disagree on mapped bytes", range.base));
            }
            let runs = range.pages.runs(0..range.pages.len(), true).len();
            if runs != heap.mapped_runs(range.segment) as usize {
                return Err(format!("range {:#x}: page map and heap disagree on mapped runs", range.base));
            }
            range.pages.check().map_err(|e| format!("range {:#x}: {e}", range.base))?;
            for b in seg.blocks.iter().filter(|b| b.state != crate::core::BlockState::Free) {
                if !range.pages.all_mapped(range.pages_under(b.address, b.size)) {
                    return Err(format!("block {:#x} is in use but not fully mapped", b.address));
                }
            }
        }
        Ok(())
    }
}
