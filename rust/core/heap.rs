//! The heap: segments tiled by blocks, free blocks indexed by bins, split on allocation and
//! coalesced with both address neighbours on free.

use super::bins::Bins;
use super::block::{Block, BlockState, Handle, NIL};
use super::rules::{PoolKind, Rules};
use super::stats::{Metric, StatType, Stats};
use std::collections::HashSet;
use std::fmt;

pub type SegmentId = u32;

#[derive(Clone, Debug)]
struct Segment {
    address: u64,
    size: u64,
    kind: PoolKind,
    stream: u32,
    /// The lowest-address block. Splits keep the lower half's index and merges keep the lower
    /// block's index, so the head never changes while the segment lives.
    head: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeapError {
    /// The handle never named a block of this heap.
    UnknownHandle,
    /// The block was already freed (a double free) or its slot was reused.
    NotAllocated,
}

impl fmt::Display for HeapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeapError::UnknownHandle => write!(f, "pointer does not belong to this pool"),
            HeapError::NotAllocated => write!(f, "pointer was already freed (double free)"),
        }
    }
}

/// A block as a snapshot sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    pub address: u64,
    pub size: u64,
    pub requested: u64,
    pub allocated: bool,
}

/// A segment as a snapshot sees it, with its blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    pub address: u64,
    pub size: u64,
    pub kind: PoolKind,
    pub stream: u32,
    pub blocks: Vec<BlockInfo>,
}

#[derive(Clone, Debug)]
pub struct Heap {
    rules: Rules,
    blocks: Vec<Block>,
    unused_blocks: Vec<u32>,
    segments: Vec<Option<Segment>>,
    unused_segments: Vec<u32>,
    /// Free blocks per stream, then per pool kind.
    bins: Vec<[Bins; 2]>,
    stats: Stats,
}

impl Heap {
    pub fn new(rules: Rules) -> Self {
        Heap {
            rules,
            blocks: Vec::new(),
            unused_blocks: Vec::new(),
            segments: Vec::new(),
            unused_segments: Vec::new(),
            bins: Vec::new(),
            stats: Stats::default(),
        }
    }

    pub fn rules(&self) -> &Rules {
        &self.rules
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn stats_mut(&mut self) -> &mut Stats {
        &mut self.stats
    }

    fn bin_insert(&mut self, stream: u32, kind: PoolKind, id: u32) {
        let s = stream as usize;
        if s >= self.bins.len() {
            self.bins.resize_with(s + 1, Default::default);
        }
        self.bins[s][kind.index()].insert(&mut self.blocks, id);
    }

    fn bin_remove(&mut self, stream: u32, kind: PoolKind, id: u32) {
        self.bins[stream as usize][kind.index()].remove(&mut self.blocks, id);
    }

    fn new_block(&mut self, block: Block) -> u32 {
        match self.unused_blocks.pop() {
            Some(id) => {
                let generation = self.blocks[id as usize].generation;
                self.blocks[id as usize] = Block { generation, ..block };
                id
            }
            None => {
                self.blocks.push(block);
                u32::try_from(self.blocks.len() - 1).expect("more than 4 billion blocks")
            }
        }
    }

    fn drop_block(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        b.generation = b.generation.wrapping_add(1);
        b.state = BlockState::Free;
        b.segment = NIL;
        self.unused_blocks.push(id);
    }

    /// Registers a fresh device allocation as one free block.
    pub fn add_segment(&mut self, address: u64, size: u64, kind: PoolKind, stream: u32) -> SegmentId {
        let segment = Segment { address, size, kind, stream, head: NIL };
        let sid = match self.unused_segments.pop() {
            Some(sid) => {
                self.segments[sid as usize] = Some(segment);
                sid
            }
            None => {
                self.segments.push(Some(segment));
                (self.segments.len() - 1) as u32
            }
        };
        let head = self.new_block(Block {
            address,
            size,
            requested: 0,
            segment: sid,
            prev: NIL,
            next: NIL,
            bin_prev: NIL,
            bin_next: NIL,
            stream,
            generation: 0,
            state: BlockState::Free,
        });
        if let Some(seg) = self.segments[sid as usize].as_mut() {
            seg.head = head;
        }
        self.bin_insert(stream, kind, head);
        self.stats.increase(Metric::Segment, kind, 1);
        self.stats.increase(Metric::ReservedBytes, kind, size);
        sid
    }

    /// Hands out a cached block for `requested` bytes on `stream`, splitting off the unused
    /// tail when the rules say so. `None` when no cached block fits.
    pub fn take(&mut self, requested: u64, stream: u32) -> Option<Handle> {
        let rounded = self.rules.round(requested);
        let kind = self.rules.kind(rounded);
        let max_block = self.rules.max_block_for(rounded);
        let bins = &self.bins.get(stream as usize)?[kind.index()];
        let id = bins.find(&self.blocks, rounded, max_block)?;
        Some(self.take_block(id, requested, kind))
    }

    /// Hands out the head of a fresh segment (which may exceed `max_split_size`: it was made
    /// for this request).
    pub fn take_segment(&mut self, sid: SegmentId, requested: u64) -> Handle {
        let seg = self.segment(sid);
        let (head, kind) = (seg.head, seg.kind);
        self.take_block(head, requested, kind)
    }

    fn take_block(&mut self, id: u32, requested: u64, kind: PoolKind) -> Handle {
        let rounded = self.rules.round(requested);
        let stream = self.blocks[id as usize].stream;
        self.bin_remove(stream, kind, id);
        let block = &self.blocks[id as usize];
        if block.is_split() {
            self.stats.decrease(Metric::InactiveSplit, kind, 1);
            self.stats.decrease(Metric::InactiveSplitBytes, kind, block.size);
        }
        if self.rules.should_split(kind, block.size, rounded) {
            self.split(id, rounded, kind);
        }
        let block = &mut self.blocks[id as usize];
        block.state = BlockState::Allocated;
        block.requested = requested;
        let (size, generation) = (block.size, block.generation);
        self.stats.increase(Metric::Allocation, kind, 1);
        self.stats.increase(Metric::Active, kind, 1);
        self.stats.increase(Metric::AllocatedBytes, kind, size);
        self.stats.increase(Metric::ActiveBytes, kind, size);
        self.stats.increase(Metric::RequestedBytes, kind, requested);
        Handle { index: id, generation }
    }

    /// Cuts block `id` to `size` bytes; the tail becomes a free block in the same bins.
    fn split(&mut self, id: u32, size: u64, kind: PoolKind) {
        let b = self.blocks[id as usize].clone();
        let tail = self.new_block(Block {
            address: b.address + size,
            size: b.size - size,
            requested: 0,
            prev: id,
            bin_prev: NIL,
            bin_next: NIL,
            state: BlockState::Free,
            ..b
        });
        if b.next != NIL {
            self.blocks[b.next as usize].prev = tail;
        }
        let block = &mut self.blocks[id as usize];
        block.next = tail;
        block.size = size;
        let tail_size = b.size - size;
        self.bin_insert(b.stream, kind, tail);
        self.stats.increase(Metric::InactiveSplit, kind, 1);
        self.stats.increase(Metric::InactiveSplitBytes, kind, tail_size);
    }

    /// The allocated block a handle names.
    pub fn block(&self, handle: Handle) -> Result<&Block, HeapError> {
        let b = self.blocks.get(handle.index as usize).ok_or(HeapError::UnknownHandle)?;
        if b.generation != handle.generation || b.state != BlockState::Allocated {
            return Err(HeapError::NotAllocated);
        }
        Ok(b)
    }

    /// Returns an allocated block to the bins, merging it with free neighbours.
    pub fn release(&mut self, handle: Handle) -> Result<(), HeapError> {
        let b = self.block(handle)?;
        let (size, requested, segment) = (b.size, b.requested, b.segment);
        let kind = self.segment(segment).kind;
        self.stats.decrease(Metric::Allocation, kind, 1);
        self.stats.decrease(Metric::Active, kind, 1);
        self.stats.decrease(Metric::AllocatedBytes, kind, size);
        self.stats.decrease(Metric::ActiveBytes, kind, size);
        self.stats.decrease(Metric::RequestedBytes, kind, requested);

        let mut id = handle.index;
        let block = &mut self.blocks[id as usize];
        block.state = BlockState::Free;
        block.requested = 0;
        block.generation = block.generation.wrapping_add(1);
        let (prev, next) = (block.prev, block.next);
        if next != NIL && self.blocks[next as usize].state == BlockState::Free {
            self.unbin_free_neighbour(next, kind);
            self.absorb_next(id);
        }
        if prev != NIL && self.blocks[prev as usize].state == BlockState::Free {
            self.unbin_free_neighbour(prev, kind);
            self.absorb_next(prev);
            id = prev;
        }
        let block = &self.blocks[id as usize];
        if block.is_split() {
            self.stats.increase(Metric::InactiveSplit, kind, 1);
            self.stats.increase(Metric::InactiveSplitBytes, kind, block.size);
        }
        let stream = block.stream;
        self.bin_insert(stream, kind, id);
        Ok(())
    }

    /// Takes a free neighbour (necessarily split, so counted as inactive split) out of its bin
    /// before it is merged.
    fn unbin_free_neighbour(&mut self, id: u32, kind: PoolKind) {
        let (stream, size) = (self.blocks[id as usize].stream, self.blocks[id as usize].size);
        self.bin_remove(stream, kind, id);
        self.stats.decrease(Metric::InactiveSplit, kind, 1);
        self.stats.decrease(Metric::InactiveSplitBytes, kind, size);
    }

    /// Merges the block after `id` into `id`; both are out of the bins.
    fn absorb_next(&mut self, id: u32) {
        let next = self.blocks[id as usize].next;
        let (after, next_size) = (self.blocks[next as usize].next, self.blocks[next as usize].size);
        let block = &mut self.blocks[id as usize];
        block.size += next_size;
        block.next = after;
        if after != NIL {
            self.blocks[after as usize].prev = id;
        }
        self.drop_block(next);
    }

    fn segment(&self, sid: u32) -> &Segment {
        self.segments[sid as usize].as_ref().expect("block of a released segment")
    }

    /// Removes every segment that is one free block and for which `want` says yes; returns
    /// their (address, size) so the caller can give them back to the device.
    pub fn release_free_segments(&mut self, mut want: impl FnMut(u64, u64) -> bool) -> Vec<(u64, u64)> {
        let mut released = Vec::new();
        for sid in 0..self.segments.len() {
            let Some(seg) = self.segments[sid].clone() else {
                continue;
            };
            let head = &self.blocks[seg.head as usize];
            if head.state != BlockState::Free || head.next != NIL || !want(seg.address, seg.size) {
                continue;
            }
            self.bin_remove(seg.stream, seg.kind, seg.head);
            self.drop_block(seg.head);
            self.segments[sid] = None;
            self.unused_segments.push(sid as u32);
            self.stats.decrease(Metric::Segment, seg.kind, 1);
            self.stats.decrease(Metric::ReservedBytes, seg.kind, seg.size);
            released.push((seg.address, seg.size));
        }
        released
    }

    /// Size of the biggest free block (0 when none); O(blocks), for error reports only.
    pub fn largest_free_block(&self) -> u64 {
        self.live_segments()
            .flat_map(|seg| self.blocks_of(seg))
            .filter(|b| b.state == BlockState::Free)
            .map(|b| b.size)
            .max()
            .unwrap_or(0)
    }

    fn live_segments(&self) -> impl Iterator<Item = &Segment> {
        self.segments.iter().flatten()
    }

    fn blocks_of<'a>(&'a self, seg: &Segment) -> impl Iterator<Item = &'a Block> + 'a {
        let mut cur = seg.head;
        std::iter::from_fn(move || {
            let b = self.blocks.get(cur as usize)?;
            cur = b.next;
            Some(b)
        })
    }

    /// Every segment with its blocks, ordered by address.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let mut out: Vec<SegmentInfo> = self
            .live_segments()
            .map(|seg| SegmentInfo {
                address: seg.address,
                size: seg.size,
                kind: seg.kind,
                stream: seg.stream,
                blocks: self
                    .blocks_of(seg)
                    .map(|b| BlockInfo {
                        address: b.address,
                        size: b.size,
                        requested: b.requested,
                        allocated: b.state == BlockState::Allocated,
                    })
                    .collect(),
            })
            .collect();
        out.sort_by_key(|s| s.address);
        out
    }

    /// Verifies every structural invariant and that the statistics equal a recount.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut recount = Stats::default();
        let mut free_in_segments = HashSet::new();
        let mut live_blocks = 0usize;
        for (sid, seg) in self.segments.iter().enumerate() {
            let Some(seg) = seg else { continue };
            recount.increase(Metric::Segment, seg.kind, 1);
            recount.increase(Metric::ReservedBytes, seg.kind, seg.size);
            let (mut expected_address, mut prev, mut prev_free) = (seg.address, NIL, false);
            for (i, b) in self.blocks_of(seg).enumerate() {
                let id = if i == 0 { seg.head } else { self.blocks[prev as usize].next };
                if b.segment != sid as u32 || b.prev != prev || b.stream != seg.stream {
                    return Err(format!("block {id} is mislinked in segment {sid}"));
                }
                if b.address != expected_address || b.size == 0 {
                    return Err(format!("segment {sid} is not tiled exactly at {:#x}", b.address));
                }
                let free = b.state == BlockState::Free;
                if free && prev_free {
                    return Err(format!("adjacent free blocks at {:#x} were not coalesced", b.address));
                }
                if free {
                    free_in_segments.insert(id);
                    if b.is_split() {
                        recount.increase(Metric::InactiveSplit, seg.kind, 1);
                        recount.increase(Metric::InactiveSplitBytes, seg.kind, b.size);
                    }
                } else {
                    for (metric, amount) in [
                        (Metric::Allocation, 1),
                        (Metric::Active, 1),
                        (Metric::AllocatedBytes, b.size),
                        (Metric::ActiveBytes, b.size),
                        (Metric::RequestedBytes, b.requested),
                    ] {
                        recount.increase(metric, seg.kind, amount);
                    }
                }
                expected_address = b.end();
                prev = id;
                prev_free = free;
                live_blocks += 1;
            }
            if expected_address != seg.address + seg.size {
                return Err(format!("blocks of segment {sid} do not reach its end"));
            }
        }
        if live_blocks + self.unused_blocks.len() != self.blocks.len() {
            return Err("block slab leaks entries".into());
        }
        let mut binned = HashSet::new();
        for (stream, pair) in self.bins.iter().enumerate() {
            for kind in PoolKind::ALL {
                for id in pair[kind.index()].check(&self.blocks)? {
                    let b = &self.blocks[id as usize];
                    if b.state != BlockState::Free || b.stream != stream as u32 || self.segment(b.segment).kind != kind
                    {
                        return Err(format!("block {id} sits in the wrong bins"));
                    }
                    if !binned.insert(id) {
                        return Err(format!("block {id} is binned twice"));
                    }
                }
            }
        }
        if binned != free_in_segments {
            return Err("the free blocks and the binned blocks differ".into());
        }
        if recount.currents() != self.stats.currents() {
            return Err(format!(
                "statistics disagree with a recount: kept {:?}, recounted {:?}",
                self.stats.currents(),
                recount.currents()
            ));
        }
        for metric in [Metric::Allocation, Metric::AllocatedBytes, Metric::ReservedBytes] {
            let s = self.stats.get(metric, StatType::All);
            if s.peak < s.current || s.allocated - s.freed != s.current {
                return Err(format!("{} counters are inconsistent: {s:?}", metric.name()));
            }
        }
        Ok(())
    }
}
