//! Expandable segments: each pool kind allocates from one large reserved address range whose
//! pages are mapped on demand, so every block of a kind can coalesce with every other and a
//! free hole costs no memory once its pages are unmapped.
//!
//! Mapped pages are kept after frees and reused (a map call costs microseconds on a GPU); they
//! are unmapped only under pressure (a refused map, an OOM flush), on `empty_cache`, or past the
//! release watermark. Physical use is then the pages that live blocks touch, not the address
//! space that fragmentation spreads them over.

use crate::core::{Heap, PoolKind, SegmentId};
use crate::device::{Device, DeviceError};

/// One reserved range and which of its pages are mapped.
#[derive(Debug)]
struct Range {
    segment: SegmentId,
    base: u64,
    kind: PoolKind,
    /// One bit per page.
    mapped: Vec<u64>,
}

impl Range {
    fn is_mapped(&self, page: u64) -> bool {
        self.mapped[(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    fn set(&mut self, pages: std::ops::Range<u64>, on: bool) {
        for page in pages {
            let (word, bit) = ((page / 64) as usize, 1u64 << (page % 64));
            if on {
                self.mapped[word] |= bit;
            } else {
                self.mapped[word] &= !bit;
            }
        }
    }

    /// Maximal runs of pages in `pages` whose mapped state equals `state`.
    fn runs(&self, pages: std::ops::Range<u64>, state: bool) -> Vec<std::ops::Range<u64>> {
        let mut runs = Vec::new();
        let mut start = None;
        for page in pages.clone() {
            match (self.is_mapped(page) == state, start) {
                (true, None) => start = Some(page),
                (false, Some(s)) => {
                    runs.push(s..page);
                    start = None;
                }
                _ => {}
            }
        }
        if let Some(s) = start {
            runs.push(s..pages.end);
        }
        runs
    }
}

#[derive(Debug)]
pub struct Expandable {
    page_size: u64,
    ranges: Vec<Range>,
}

impl Expandable {
    pub fn new(page_size: u64) -> Self {
        Expandable { page_size, ranges: Vec::new() }
    }

    fn range_of(&mut self, segment: SegmentId) -> Option<&mut Range> {
        self.ranges.iter_mut().find(|r| r.segment == segment)
    }

    pub fn is_range(&self, address: u64) -> bool {
        self.ranges.iter().any(|r| r.base == address)
    }

    /// Reserves a new range for `kind`, big enough for `rounded` bytes and for the device's
    /// capacity many times over (address space is cheap; running out of it would fragment).
    pub fn grow<D: Device>(
        &mut self,
        device: &mut D,
        heap: &mut Heap,
        kind: PoolKind,
        stream: u32,
        rounded: u64,
    ) -> Result<SegmentId, DeviceError> {
        let capacity = device.memory_info().total.unwrap_or(1 << 40);
        let wanted = capacity.saturating_mul(2).max(rounded.saturating_mul(2)).min(1 << 46);
        let size = wanted.div_ceil(self.page_size) * self.page_size;
        let base = device.reserve(size)?;
        let segment = heap.add_expandable_segment(base, size, kind, stream);
        let pages = size / self.page_size;
        self.ranges.push(Range { segment, base, kind, mapped: vec![0; pages.div_ceil(64) as usize] });
        Ok(segment)
    }

    /// Maps whatever pages of `[address, address + len)` in `segment` are not mapped yet.
    pub fn ensure_mapped<D: Device>(
        &mut self,
        device: &mut D,
        heap: &mut Heap,
        segment: SegmentId,
        address: u64,
        len: u64,
    ) -> Result<(), DeviceError> {
        let page_size = self.page_size;
        let Some(range) = self.range_of(segment) else { return Ok(()) };
        let first = (address - range.base) / page_size;
        let end = (address + len - range.base).div_ceil(page_size);
        for run in range.runs(first..end, false) {
            device.map(range.base + run.start * page_size, (run.end - run.start) * page_size)?;
            range.set(run.clone(), true);
            heap.note_mapped(segment, (run.end - run.start) * page_size, true);
            heap.stats_mut().num_device_map += 1;
        }
        Ok(())
    }

    /// Unmaps every mapped page that lies wholly inside a free block; returns the bytes freed.
    pub fn unmap_free_pages<D: Device>(&mut self, device: &mut D, heap: &mut Heap) -> Result<u64, DeviceError> {
        let page_size = self.page_size;
        let mut released = 0;
        for range in &mut self.ranges {
            for (address, size) in heap.free_ranges(range.segment) {
                let first = (address - range.base).div_ceil(page_size);
                let end = (address + size - range.base) / page_size;
                if first >= end {
                    continue;
                }
                for run in range.runs(first..end, true) {
                    let bytes = (run.end - run.start) * page_size;
                    device.unmap(range.base + run.start * page_size, bytes)?;
                    range.set(run, false);
                    heap.note_mapped(range.segment, bytes, false);
                    heap.stats_mut().num_device_unmap += 1;
                    released += bytes;
                }
            }
        }
        Ok(released)
    }

    /// Forgets the range at `address` after the heap released its (fully free, unmapped) segment.
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
            let pages: u64 = range.mapped.iter().map(|w| w.count_ones() as u64).sum();
            if pages * self.page_size != heap.mapped_bytes(range.segment) {
                return Err(format!("range {:#x}: page map and heap disagree on mapped bytes", range.base));
            }
            for b in seg.blocks.iter().filter(|b| b.state != crate::core::BlockState::Free) {
                let first = (b.address - range.base) / self.page_size;
                let end = (b.address + b.size - range.base).div_ceil(self.page_size);
                if (first..end).any(|p| !range.is_mapped(p)) {
                    return Err(format!("block {:#x} is in use but not fully mapped", b.address));
                }
            }
        }
        Ok(())
    }
}
