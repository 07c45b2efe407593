//! The heap: segments tiled by blocks, free blocks indexed by bins per owner, split on
//! allocation and coalesced with address neighbours on free.
//!
//! Free blocks belong to an owner: the stream that freed them (it may reuse them at once, its
//! own order protects them) or [`SHARED`] (no queued work can touch them; any stream may take
//! them). A stream's blocks become shared when a fence (an event the pool records on that stream)
//! completes: [`Heap::fence`] and [`Heap::promote`]. Neighbours merge when their owners agree or
//! one of them is shared; blocks of two different streams stay apart.

use super::bins::{bin_index, Bins};
use super::block::{Block, BlockState, Handle, NIL, SHARED, USE_OVERFLOW_BIT};
use super::owners::Epoch;
use super::rules::{PoolKind, Rules};
use super::stats::{Metric, Stats};
use std::fmt;

pub type SegmentId = u32;

#[derive(Clone, Debug)]
pub(super) struct Segment {
    pub address: u64,
    pub size: u64,
    pub kind: PoolKind,
    /// The stream the segment was first allocated for (reported in snapshots).
    pub stream: u32,
    /// Bytes backed by memory: all of a plain segment, the mapped pages of an expandable one.
    pub mapped: u64,
    /// Expandable: contiguous mapped runs, each of which counts (and shows) as a segment.
    pub runs: u32,
    pub expandable: bool,
    /// Its kind's allocation clock when it last became one free block (for its age when idle).
    pub idle_since: u32,
    /// The lowest-address block. Splits keep the lower half's index and merges keep the lower
    /// block's index, so the head never changes while the segment lives.
    pub head: u32,
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

/// What [`Heap::release`] did with a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Released {
    /// Back in the bins.
    Cached { segment: SegmentId },
    /// Waiting for the streams in `uses` (a use mask, see [`Block::uses`]).
    Pending { id: u32, uses: u32, segment: SegmentId },
}

/// What free blocks count for in the inactive-split statistics (blocks, bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct InactiveShare {
    pub blocks: u64,
    pub bytes: u64,
}

impl InactiveShare {
    pub const NONE: InactiveShare = InactiveShare { blocks: 0, bytes: 0 };

    #[inline(always)]
    pub fn plus(self, other: InactiveShare) -> InactiveShare {
        InactiveShare { blocks: self.blocks + other.blocks, bytes: self.bytes + other.bytes }
    }
}

/// A block as a snapshot sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    pub address: u64,
    pub size: u64,
    pub requested: u64,
    pub state: BlockState,
}

/// A segment as a snapshot sees it, with its blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    pub address: u64,
    /// Address space covered; for an expandable segment only `mapped` bytes of it are memory.
    pub size: u64,
    pub mapped: u64,
    pub expandable: bool,
    pub kind: PoolKind,
    pub stream: u32,
    pub blocks: Vec<BlockInfo>,
}

#[derive(Clone, Debug)]
pub struct Heap {
    pub(super) rules: Rules,
    pub(super) blocks: Vec<Block>,
    pub(super) unused_blocks: Vec<u32>,
    pub(super) segments: Vec<Option<Segment>>,
    unused_segments: Vec<u32>,
    /// Free blocks owned by each stream, then by pool kind; `None` for a stream that never
    /// freed a block or was retired (its bins' tables are some KiB, and stream ids are not
    /// reused, so a pool that makes and destroys streams must not keep them).
    pub(super) private: Vec<Option<Box<[Bins; 2]>>>,
    /// Free blocks any stream may take, by pool kind.
    pub(super) shared: [Bins; 2],
    pub(super) epochs: Vec<Epoch>,
    /// Allocations served per pool kind: the clock that free blocks age by (PyTorch's
    /// `gc_count`), for garbage collection and the release watermark.
    pub(super) clocks: [u32; 2],
    pub(super) stats: Stats,
    /// Whether a stream's free block may absorb shared neighbours (see `keep_shared_apart`).
    absorb_shared: bool,
}

impl Heap {
    pub fn new(rules: Rules) -> Self {
        Heap {
            rules,
            blocks: Vec::new(),
            unused_blocks: Vec::new(),
            segments: Vec::new(),
            unused_segments: Vec::new(),
            private: Vec::new(),
            shared: Default::default(),
            epochs: Vec::new(),
            clocks: [0; 2],
            stats: Stats::default(),
            absorb_shared: true,
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

    #[inline]
    fn bins(&self, owner: u32) -> Option<&[Bins; 2]> {
        if owner == SHARED {
            Some(&self.shared)
        } else {
            self.private.get(owner as usize)?.as_deref()
        }
    }

    #[inline(always)]
    fn bin_insert(&mut self, id: u32) {
        let (owner, kind) = (self.blocks[id as usize].stream, self.blocks[id as usize].kind);
        let block = &self.blocks[id as usize];
        if !block.is_split() {
            let segment = block.segment as usize;
            if let Some(seg) = self.segments[segment].as_mut() {
                seg.idle_since = self.clocks[kind.index()];
            }
        }
        let bins = if owner == SHARED {
            &mut self.shared
        } else {
            if owner as usize >= self.private.len() {
                self.private.resize_with(owner as usize + 1, Default::default);
            }
            self.private[owner as usize].get_or_insert_with(Default::default)
        };
        bins[kind.index()].insert(&mut self.blocks, id);
    }

    #[inline(always)]
    pub(super) fn bin_remove(&mut self, id: u32) {
        let (owner, kind) = (self.blocks[id as usize].stream, self.blocks[id as usize].kind);
        let (bins, blocks) = self.bins_of(owner, kind);
        bins.remove(blocks, id);
    }

    /// The bins of an owner that has free blocks, and the block slab (borrowed apart).
    #[inline(always)]
    fn bins_of(&mut self, owner: u32, kind: PoolKind) -> (&mut Bins, &mut [Block]) {
        let bins = if owner == SHARED {
            &mut self.shared
        } else {
            self.private[owner as usize].as_deref_mut().expect("a binned block's owner has bins")
        };
        (&mut bins[kind.index()], &mut self.blocks)
    }

    #[inline(always)]
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

    #[inline(always)]
    fn drop_block(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        b.generation = b.generation.wrapping_add(1);
        b.state = BlockState::Free;
        b.segment = NIL;
        self.unused_blocks.push(id);
    }

    /// Registers a fresh device allocation for `stream` as one free block owned by it.
    pub fn add_segment(&mut self, address: u64, size: u64, kind: PoolKind, stream: u32) -> SegmentId {
        self.insert_segment(address, size, kind, stream, false)
    }

    /// Registers a device allocation no stream has used yet (a pre-allocated pool): its free
    /// block is shared, so any stream may take it. Snapshots show it as stream 0's.
    pub fn add_shared_segment(&mut self, address: u64, size: u64, kind: PoolKind) -> SegmentId {
        let sid = self.add_segment(address, size, kind, 0);
        let head = self.segment(sid).head;
        self.bin_remove(head);
        self.blocks[head as usize].stream = SHARED;
        self.bin_insert(head);
        sid
    }

    /// Registers a reserved address range whose pages are mapped on demand: it adds nothing to
    /// reserved bytes until [`Heap::note_mapped`] says pages were mapped. No stream ever used
    /// the range, so its free space starts shared.
    pub fn add_expandable_segment(&mut self, address: u64, size: u64, kind: PoolKind, stream: u32) -> SegmentId {
        self.insert_segment(address, size, kind, stream, true)
    }

    fn insert_segment(&mut self, address: u64, size: u64, kind: PoolKind, stream: u32, expandable: bool) -> SegmentId {
        let mapped = if expandable { 0 } else { size };
        // A range serves every stream from its free space, unless streams keep their memory
        // apart: then it is its stream's alone, as PyTorch's expandable segments are.
        let owner = if expandable && self.absorb_shared { SHARED } else { stream };
        let segment = Segment { address, size, kind, stream, mapped, runs: 0, expandable, idle_since: 0, head: NIL };
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
            stream: owner,
            epoch: 0,
            kind,
            uses: 0,
            expandable,
            generation: 0,
            state: BlockState::Free,
        });
        if let Some(seg) = self.segments[sid as usize].as_mut() {
            seg.head = head;
        }
        if owner != SHARED {
            // The stream owns the fresh free space like memory it freed: a fence shares it.
            let e = self.epoch_mut(stream);
            e.unfenced = true;
            let epoch = e.current;
            self.blocks[head as usize].epoch = epoch;
        }
        self.bin_insert(head);
        // An expandable range counts as segments only as pages get mapped (`note_mapped`).
        self.stats.increase(Metric::Segment, kind, u64::from(!expandable));
        self.stats.increase(Metric::ReservedBytes, kind, mapped);
        // PyTorch counts plain segments only (`alloc_block`), not expandable ranges.
        if !expandable && size >= self.rules.max_split_size {
            self.stats.note_oversize(false, true);
        }
        sid
    }

    /// `bytes` of pages of expandable segment `sid` were mapped (or unmapped), which changed its
    /// number of contiguous mapped runs by `runs`: reserved bytes and segments follow.
    pub fn note_mapped(&mut self, sid: SegmentId, bytes: u64, mapped: bool, runs: i32) {
        let seg = self.segments[sid as usize].as_mut().expect("mapping in a released segment");
        let kind = seg.kind;
        seg.runs = seg.runs.checked_add_signed(runs).expect("mapped runs went negative");
        if runs > 0 {
            self.stats.increase(Metric::Segment, kind, runs as u64);
        } else {
            self.stats.decrease(Metric::Segment, kind, u64::from(runs.unsigned_abs()));
        }
        if mapped {
            seg.mapped += bytes;
            self.stats.increase(Metric::ReservedBytes, kind, bytes);
        } else {
            seg.mapped -= bytes;
            self.stats.decrease(Metric::ReservedBytes, kind, bytes);
        }
    }

    /// Contiguous mapped runs of segment `sid` (1 for a plain segment).
    pub fn mapped_runs(&self, sid: SegmentId) -> u32 {
        let seg = self.segment(sid);
        if seg.expandable {
            seg.runs
        } else {
            1
        }
    }

    /// The free blocks of segment `sid` with their slab indices, in address order.
    pub fn free_blocks(&self, sid: SegmentId) -> impl Iterator<Item = (u32, &Block)> {
        self.blocks_of(self.segment(sid)).filter(|(_, b)| b.state == BlockState::Free)
    }

    /// The (lowest-address) first block of segment `sid`.
    pub fn segment_head(&self, sid: SegmentId) -> u32 {
        self.segment(sid).head
    }

    /// Bytes backed by memory in segment `sid`.
    pub fn mapped_bytes(&self, sid: SegmentId) -> u64 {
        self.segment(sid).mapped
    }

    /// The segment a cached or allocated block lies in.
    pub fn segment_of(&self, id: u32) -> SegmentId {
        self.blocks[id as usize].segment
    }

    pub fn block_at(&self, id: u32) -> &Block {
        &self.blocks[id as usize]
    }

    /// A cached block owned by `owner` that fits `requested` bytes.
    #[inline(always)]
    pub fn find(&self, rounded: u64, owner: u32) -> Option<u32> {
        self.find_at_most(self.rules.kind(rounded), rounded, owner, self.rules.max_block_for(rounded))
    }

    /// [`Heap::find_in`] without the cap `max_split_size` puts on the blocks a request may use:
    /// the free blocks of expandable ranges are address space, mapped or not, and PyTorch maps a
    /// request's pages from its range's unmapped remainder whatever that remainder's size.
    pub fn find_uncapped_in(&self, kind: PoolKind, rounded: u64, owner: u32) -> Option<u32> {
        self.find_at_most(kind, rounded, owner, u64::MAX)
    }

    /// A cached block of pool `kind` owned by `owner` that fits `rounded` bytes and is at most
    /// `max_size`.
    #[inline(always)]
    fn find_at_most(&self, kind: PoolKind, rounded: u64, owner: u32, max_size: u64) -> Option<u32> {
        let bins = &self.bins(owner)?[kind.index()];
        if bins.is_empty() {
            return None;
        }
        bins.find(&self.blocks, rounded, max_size)
    }

    /// [`Heap::find`] among the free blocks of pool `kind`, whichever kind the rules give
    /// `rounded`: a paged pool may place a small request in a large range.
    pub fn find_in(&self, kind: PoolKind, rounded: u64, owner: u32) -> Option<u32> {
        self.find_at_most(kind, rounded, owner, self.rules.max_block_for(rounded))
    }

    /// A cached block of pool `kind` owned by a stream other than `stream` (nor shared) that
    /// fits, with its owner: the candidates for reuse after making `stream` wait on the owner.
    pub fn find_foreign_in(&self, kind: PoolKind, rounded: u64, stream: u32) -> Option<(u32, u32)> {
        (0..self.private.len() as u32)
            .filter(|&owner| owner != stream)
            .filter_map(|owner| self.find_in(kind, rounded, owner).map(|id| (id, owner)))
            .min_by_key(|&(id, _)| (self.blocks[id as usize].size, id))
    }

    /// Hands out the head of a fresh segment (which may exceed `max_split_size`: it was made
    /// for this request).
    pub fn take_segment(&mut self, sid: SegmentId, requested: u64, stream: u32) -> Handle {
        let head = self.segment(sid).head;
        let rounded = self.rules.round(requested);
        self.take_block(head, requested, rounded, stream).0
    }

    /// Allocates free block `id` (found by [`Heap::find`] or [`Heap::find_foreign_in`] for
    /// `rounded`, the rules' size for `requested`) to `stream`, splitting off the unused tail
    /// when the rules say so. Returns the handle and the block's address.
    #[inline(always)]
    pub fn take_block(&mut self, id: u32, requested: u64, rounded: u64, stream: u32) -> (Handle, u64) {
        let block = &self.blocks[id as usize];
        let kind = block.kind;
        self.clocks[kind.index()] = self.clocks[kind.index()].wrapping_add(1);
        // Splitting an expandable segment costs nothing: its pieces stay contiguous.
        let split = if block.expandable {
            block.size - rounded >= self.rules.granule
        } else {
            self.rules.should_split(kind, block.size, rounded)
        };
        let before = self.inactive_share(id);
        let mut tail = if split { self.split_in_place(id, rounded) } else { NIL };
        if tail == NIL {
            self.bin_remove(id);
            if split {
                tail = self.split(id, rounded);
            }
        }
        let after = if tail == NIL { InactiveShare::NONE } else { self.inactive_share(tail) };
        self.change_inactive(kind, before, after);
        let block = &mut self.blocks[id as usize];
        block.state = BlockState::Allocated;
        block.requested = requested;
        block.stream = stream;
        block.uses = 0;
        let (size, generation, address) = (block.size, block.generation, block.address);
        self.stats.increase(Metric::Allocation, kind, 1);
        self.stats.increase(Metric::Active, kind, 1);
        self.stats.increase(Metric::AllocatedBytes, kind, size);
        self.stats.increase(Metric::ActiveBytes, kind, size);
        self.stats.increase(Metric::RequestedBytes, kind, requested);
        if size >= self.rules.max_split_size {
            self.stats.note_oversize(true, true);
        }
        (Handle { index: id, generation }, address)
    }

    /// Allocates `rounded` bytes at exactly `address` in segment `sid` to `stream`, as
    /// [`Heap::take_block`] would had the free block started there: rebuilds a layout recorded
    /// elsewhere (a snapshot's blocks). The free space before `address` stays free. `None` when
    /// those bytes are not free in one block.
    pub fn take_at(
        &mut self,
        sid: SegmentId,
        address: u64,
        requested: u64,
        rounded: u64,
        stream: u32,
    ) -> Option<Handle> {
        let (mut id, start, state) = self
            .blocks_of(self.segment(sid))
            .find(|(_, b)| b.address <= address && address.checked_add(rounded).is_some_and(|end| end <= b.end()))
            .map(|(id, b)| (id, b.address, b.state))?;
        if state != BlockState::Free {
            return None;
        }
        if address > start {
            id = self.split_free(id, address - start);
        }
        Some(self.take_block(id, requested, rounded, stream).0)
    }

    /// Cuts binned free block `id` to `size` bytes; both pieces stay free and binned, with its
    /// owner. Returns the second piece.
    fn split_free(&mut self, id: u32, size: u64) -> u32 {
        let (kind, before) = (self.blocks[id as usize].kind, self.inactive_share(id));
        self.bin_remove(id);
        let tail = self.split(id, size);
        self.bin_insert(id);
        let after = self.inactive_share(id).plus(self.inactive_share(tail));
        self.change_inactive(kind, before, after);
        tail
    }

    /// Splits binned free block `id` for an allocation of its first `size` bytes, leaving the
    /// heap as `bin_remove` and [`Heap::split`] would, when the tail stays in the block's bin
    /// and the block is the first of it: the tail then just takes the block's place at the
    /// front of the list, and no bitmap changes. Returns the tail, or NIL, changing nothing,
    /// otherwise. The caller updates the inactive-split statistics.
    #[inline(always)]
    fn split_in_place(&mut self, id: u32, size: u64) -> u32 {
        let b = &self.blocks[id as usize];
        let bin = bin_index(b.size);
        if b.bin_prev != NIL || bin_index(b.size - size) != bin {
            return NIL;
        }
        let (stream, kind) = (b.stream, b.kind);
        let tail = self.cut(id, size);
        let (bins, blocks) = self.bins_of(stream, kind);
        bins.replace_first(blocks, bin, id, tail);
        tail
    }

    /// Cuts block `id` to `size` bytes; the tail stays free, with the same owner, and is
    /// returned. The caller updates the inactive-split statistics.
    #[inline(always)]
    fn split(&mut self, id: u32, size: u64) -> u32 {
        let tail = self.cut(id, size);
        self.bin_insert(tail);
        tail
    }

    /// Cuts block `id` to `size` bytes and links the rest after it as a new free block, with
    /// the same owner, in no bin and not counted; returns it.
    #[inline(always)]
    fn cut(&mut self, id: u32, size: u64) -> u32 {
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
        tail
    }

    /// The allocated block a handle names.
    #[inline]
    pub fn block(&self, handle: Handle) -> Result<&Block, HeapError> {
        let b = self.blocks.get(handle.index as usize).ok_or(HeapError::UnknownHandle)?;
        if b.generation != handle.generation || b.state != BlockState::Allocated {
            return Err(HeapError::NotAllocated);
        }
        Ok(b)
    }

    /// The use mask of the block a handle names, unvalidated (0 for an unknown index): a cheap
    /// look before a validating call.
    #[inline]
    pub fn peek_uses(&self, handle: Handle) -> u32 {
        self.blocks.get(handle.index as usize).map_or(0, |b| b.uses)
    }

    /// Notes that `stream` uses this allocated block, so its free must wait for it. Returns
    /// false when the stream is too high for the block's mask: the caller must list it.
    pub fn mark_use(&mut self, handle: Handle, stream: u32) -> Result<bool, HeapError> {
        self.block(handle)?;
        let block = &mut self.blocks[handle.index as usize];
        let in_mask = stream < USE_OVERFLOW_BIT;
        block.uses |= 1 << stream.min(USE_OVERFLOW_BIT);
        Ok(in_mask)
    }

    /// Forgets the streams recorded as using an allocated block (after they all finished).
    pub fn clear_uses(&mut self, handle: Handle) -> Result<(), HeapError> {
        self.block(handle)?;
        self.blocks[handle.index as usize].uses = 0;
        Ok(())
    }

    /// Ends an allocation: the user no longer holds the block. Its requested bytes stay counted
    /// while it is active, as PyTorch's do until `free_block`.
    #[inline(always)]
    fn end_allocation(&mut self, handle: Handle) -> Result<u32, HeapError> {
        let b = self.block(handle)?;
        let (size, kind) = (b.size, b.kind);
        self.stats.decrease(Metric::Allocation, kind, 1);
        self.stats.decrease(Metric::AllocatedBytes, kind, size);
        if size >= self.rules.max_split_size {
            self.stats.note_oversize(true, false);
        }
        let block = &mut self.blocks[handle.index as usize];
        block.generation = block.generation.wrapping_add(1);
        Ok(handle.index)
    }

    /// Ends an allocation, validating the handle once. A block no other stream used returns to
    /// its stream's bins, merged with free neighbours. One with recorded uses stays active (not
    /// reusable) until [`Heap::complete_pending`]: device work on those streams may not be done.
    #[inline(always)]
    pub fn release(&mut self, handle: Handle) -> Result<Released, HeapError> {
        let id = self.end_allocation(handle)?;
        let block = &mut self.blocks[id as usize];
        let (segment, uses) = (block.segment, block.uses);
        if uses == 0 {
            self.make_free(id);
            return Ok(Released::Cached { segment });
        }
        block.state = BlockState::Pending;
        Ok(Released::Pending { id, uses, segment })
    }

    /// Ends the allocation of `handle` but keeps its block out of the cache: its bytes are
    /// still referenced (exports of a freed pointer). The block is pending, active but not
    /// allocated, until [`Heap::complete_pending`]. Returns its slab index.
    pub fn hold(&mut self, handle: Handle) -> Result<u32, HeapError> {
        let id = self.end_allocation(handle)?;
        self.blocks[id as usize].state = BlockState::Pending;
        Ok(id)
    }

    /// The events a pending block waited for have completed: it becomes free.
    pub fn complete_pending(&mut self, id: u32) {
        debug_assert_eq!(self.blocks[id as usize].state, BlockState::Pending);
        self.make_free(id);
    }

    /// Turns allocated-or-pending block `id` into a free block of its stream and bins it.
    #[inline(always)]
    fn make_free(&mut self, id: u32) {
        let block = &mut self.blocks[id as usize];
        let (kind, size, stream, requested) = (block.kind, block.size, block.stream, block.requested);
        block.state = BlockState::Free;
        block.uses = 0;
        block.requested = 0;
        self.stats.decrease(Metric::Active, kind, 1);
        self.stats.decrease(Metric::ActiveBytes, kind, size);
        self.stats.decrease(Metric::RequestedBytes, kind, requested);
        if stream != SHARED {
            let e = self.epoch_mut(stream);
            e.unfenced = true;
            let epoch = e.current;
            self.blocks[id as usize].epoch = epoch;
        }
        self.coalesce_and_bin(id, InactiveShare::NONE);
    }

    /// Merges free, unbinned block `id` with free neighbours of the same owner, or shared ones
    /// (which become the block's owner's: stricter, so still safe), then bins the result.
    /// A shared block never absorbs a stream's block: that would hide the stream's block from
    /// its owner's bins for nothing. `before` is what `id` counted as inactive split before it
    /// was unbinned: as in PyTorch, the statistics take the operation's net change, once.
    #[inline(always)]
    pub(super) fn coalesce_and_bin(&mut self, mut id: u32, mut before: InactiveShare) {
        let (owner, kind) = (self.blocks[id as usize].stream, self.blocks[id as usize].kind);
        if self.merge_next_in_place(id, owner, before) {
            return;
        }
        // Loops, not ifs: absorbing a shared neighbour can expose another block of this owner
        // (shared and private blocks may alternate after promotions).
        loop {
            let next = self.blocks[id as usize].next;
            if next == NIL || !self.mergeable(owner, next) {
                break;
            }
            before = before.plus(self.unbin_free_neighbour(next));
            self.absorb_next(id, owner);
        }
        loop {
            let prev = self.blocks[id as usize].prev;
            if prev == NIL || !self.mergeable(owner, prev) {
                break;
            }
            before = before.plus(self.unbin_free_neighbour(prev));
            self.absorb_next(prev, owner);
            id = prev;
        }
        self.bin_insert(id);
        let after = self.inactive_share(id);
        self.change_inactive(kind, before, after);
    }

    /// The common free: block `id`'s only free neighbour is the next one, which belongs to
    /// `owner` already, is the first of its bin and stays in that bin when `id` absorbs it. The
    /// heap then ends as the general path leaves it (`id` absorbs it, and is binned in front),
    /// but `id` just takes the neighbour's place in the list. Returns false, changing nothing,
    /// otherwise.
    #[inline(always)]
    fn merge_next_in_place(&mut self, id: u32, owner: u32, before: InactiveShare) -> bool {
        let b = &self.blocks[id as usize];
        let (prev, next, size, kind, segment) = (b.prev, b.next, b.size, b.kind, b.segment);
        if next == NIL || (prev != NIL && self.mergeable(owner, prev)) {
            return false;
        }
        let n = &self.blocks[next as usize];
        let (after, next_size, next_epoch) = (n.next, n.size, n.epoch);
        let bin = bin_index(next_size);
        if n.state != BlockState::Free || n.stream != owner || n.bin_prev != NIL || bin_index(next_size + size) != bin {
            return false;
        }
        if after != NIL && self.mergeable(owner, after) {
            return false;
        }
        let before = before.plus(self.inactive_share(next));
        let block = &mut self.blocks[id as usize];
        block.size += next_size;
        block.next = after;
        block.epoch = block.epoch.max(next_epoch);
        if after != NIL {
            self.blocks[after as usize].prev = id;
        }
        let (bins, blocks) = self.bins_of(owner, kind);
        bins.replace_first(blocks, bin, next, id);
        self.drop_block(next);
        if prev == NIL && after == NIL {
            // As `bin_insert` notes: the segment is one free block from now on.
            let clock = self.clocks[kind.index()];
            if let Some(seg) = self.segments[segment as usize].as_mut() {
                seg.idle_since = clock;
            }
        }
        let after = self.inactive_share(id);
        self.change_inactive(kind, before, after);
        true
    }

    /// What free block `id` counts for in the inactive-split statistics.
    #[inline(always)]
    pub(super) fn inactive_share(&self, id: u32) -> InactiveShare {
        let b = &self.blocks[id as usize];
        if b.is_inactive_split() {
            InactiveShare { blocks: 1, bytes: b.size }
        } else {
            InactiveShare::NONE
        }
    }

    /// Applies one operation's net change of the inactive-split statistics, as PyTorch does
    /// (`free_block`, `alloc_found_block`): their `allocated` and `freed` sum net changes, so a
    /// block that is shrunk or grown is not counted as one removed and another added.
    #[inline(always)]
    fn change_inactive(&mut self, kind: PoolKind, before: InactiveShare, after: InactiveShare) {
        self.stats.change(Metric::InactiveSplit, kind, before.blocks, after.blocks);
        self.stats.change(Metric::InactiveSplitBytes, kind, before.bytes, after.bytes);
    }

    /// Removes free block `id` from the inactive-split statistics if it counted there.
    #[inline(always)]
    pub(super) fn uncount_inactive(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        if b.is_inactive_split() {
            self.stats.decrease(Metric::InactiveSplit, b.kind, 1);
            self.stats.decrease(Metric::InactiveSplitBytes, b.kind, b.size);
        }
    }

    #[inline(always)]
    fn mergeable(&self, owner: u32, neighbour: u32) -> bool {
        let n = &self.blocks[neighbour as usize];
        n.state == BlockState::Free && (n.stream == owner || (n.stream == SHARED && self.absorb_shared))
    }

    /// Stops streams' free blocks from absorbing shared neighbours. Without cross-stream reuse no
    /// fence ever shares them again, so absorbed shared memory would be lost to other streams.
    pub fn keep_shared_apart(&mut self) {
        self.absorb_shared = false;
    }

    /// Takes a free neighbour out of its bin before it is merged; returns what it counted as
    /// inactive split.
    #[inline(always)]
    fn unbin_free_neighbour(&mut self, id: u32) -> InactiveShare {
        self.bin_remove(id);
        self.inactive_share(id)
    }

    /// Merges the block after `id` into `id`; both are out of the bins. The result belongs to
    /// `owner` and keeps the later epoch.
    #[inline(always)]
    fn absorb_next(&mut self, id: u32, owner: u32) {
        let next = self.blocks[id as usize].next;
        // Only epochs of `owner`'s blocks mean anything for it; shared ones are stale.
        let epoch_of = |b: &Block| if b.stream == owner { b.epoch } else { 0 };
        let n = &self.blocks[next as usize];
        let (after, next_size, next_epoch) = (n.next, n.size, epoch_of(n));
        let block = &mut self.blocks[id as usize];
        block.size += next_size;
        block.next = after;
        block.epoch = epoch_of(block).max(next_epoch);
        block.stream = owner;
        if after != NIL {
            self.blocks[after as usize].prev = id;
        }
        self.drop_block(next);
    }

    pub(super) fn segment(&self, sid: u32) -> &Segment {
        self.segments[sid as usize].as_ref().expect("block of a released segment")
    }

    /// Every segment that is all free (an expandable one also fully unmapped), with its address,
    /// in the order PyTorch releases them. The caller gives each back to the device, then removes it with
    /// [`Heap::remove_segment`]: a refusal then leaves the heap and the device in agreement.
    pub fn free_segments(&self) -> Vec<(SegmentId, u64)> {
        let mut free: Vec<(SegmentId, &Segment)> = (0..self.segments.len())
            .filter_map(|sid| Some((sid as SegmentId, self.segments[sid].as_ref()?)))
            .filter(|(_, seg)| self.is_fully_free(seg) && !(seg.expandable && seg.mapped != 0))
            .collect();
        // PyTorch's order: the large pool, then the small one, each by (stream, size, address).
        free.sort_by_key(|(_, seg)| (seg.kind == PoolKind::Small, seg.stream, seg.size, seg.address));
        free.into_iter().map(|(sid, seg)| (sid, seg.address)).collect()
    }

    /// Whether every block of `seg` is free. Usually that is one block; free blocks of
    /// different owners may stay apart, so this walks until the first block in use.
    pub(super) fn is_fully_free(&self, seg: &Segment) -> bool {
        self.blocks_of(seg).all(|(_, b)| b.state == BlockState::Free)
    }

    /// Removes segment `sid`, whose blocks must all be free; returns its (address, size).
    pub fn remove_segment(&mut self, sid: SegmentId) -> (u64, u64) {
        let seg = self.segments[sid as usize].take().expect("removing a released segment");
        let mut id = seg.head;
        while id != NIL {
            let next = self.blocks[id as usize].next;
            self.uncount_inactive(id);
            self.bin_remove(id);
            self.drop_block(id);
            id = next;
        }
        self.unused_segments.push(sid);
        self.stats.decrease(Metric::Segment, seg.kind, if seg.expandable { u64::from(seg.runs) } else { 1 });
        self.stats.decrease(Metric::ReservedBytes, seg.kind, seg.mapped);
        if !seg.expandable && seg.size >= self.rules.max_split_size {
            self.stats.note_oversize(false, false);
        }
        (seg.address, seg.size)
    }

    /// Size of the biggest free block (0 when none); O(blocks), for error reports only.
    pub fn largest_free_block(&self) -> u64 {
        self.live_segments()
            .flat_map(|seg| self.blocks_of(seg))
            .filter(|(_, b)| b.state == BlockState::Free)
            .map(|(_, b)| b.size)
            .max()
            .unwrap_or(0)
    }

    pub(super) fn live_segments(&self) -> impl Iterator<Item = &Segment> {
        self.segments.iter().flatten()
    }

    pub(super) fn blocks_of<'a>(&'a self, seg: &Segment) -> impl Iterator<Item = (u32, &'a Block)> + 'a {
        let mut cur = seg.head;
        std::iter::from_fn(move || {
            let id = cur;
            let b = self.blocks.get(id as usize)?;
            cur = b.next;
            Some((id, b))
        })
    }

    /// Every segment with its blocks, ordered by address.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let mut out: Vec<SegmentInfo> = self
            .live_segments()
            .map(|seg| SegmentInfo {
                address: seg.address,
                size: seg.size,
                mapped: seg.mapped,
                expandable: seg.expandable,
                kind: seg.kind,
                stream: seg.stream,
                blocks: self
                    .blocks_of(seg)
                    .map(|(_, b)| BlockInfo {
                        address: b.address,
                        size: b.size,
                        requested: b.requested,
                        state: b.state,
                    })
                    .collect(),
            })
            .collect();
        out.sort_by_key(|s| s.address);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A free that merges into its already free neighbour takes the later of their epochs: a
    /// fence recorded before the free must not share the freed bytes, whose stream may still
    /// be using them.
    #[test]
    fn a_merged_free_is_not_shared_by_an_earlier_fence() {
        for rules in [Rules::default(), Rules::pytorch()] {
            let mut heap = Heap::new(rules);
            // 200 and 202 MiB share a bin: the last free merges in place.
            heap.add_segment(0x1000_0000, 202 * MIB, PoolKind::Large, 1);
            let take = |heap: &mut Heap| {
                let id = heap.find(2 * MIB, 1).expect("the segment has room");
                heap.take_block(id, 2 * MIB, 2 * MIB, 1).0
            };
            let (first, second) = (take(&mut heap), take(&mut heap));
            heap.release(second).unwrap();
            let fenced = heap.fence(1).expect("stream 1 freed a block");
            heap.release(first).unwrap();
            heap.promote(1, fenced);
            heap.check_invariants().unwrap();
            assert_eq!(heap.segments()[0].blocks.len(), 1, "the frees coalesced");
            assert_eq!(heap.find(2 * MIB, SHARED), None, "the fence shared bytes freed after it");
            assert!(heap.find(2 * MIB, 1).is_some());
        }
    }

    /// A segment's age as an idle segment starts when its last block is freed, also when that
    /// free merges into a neighbour without leaving its bin.
    #[test]
    fn a_segment_is_idle_from_its_last_free() {
        for rules in [Rules::default(), Rules::pytorch()] {
            let mut heap = Heap::new(rules);
            // 200 and 202 MiB share a bin; 198 MiB lies in the one below.
            let sid = heap.add_segment(0x1000_0000, 202 * MIB, PoolKind::Large, 1);
            let take = |heap: &mut Heap| {
                let id = heap.find(2 * MIB, 1).expect("the segment has room");
                heap.take_block(id, 2 * MIB, 2 * MIB, 1).0
            };
            let (first, second) = (take(&mut heap), take(&mut heap));
            heap.release(second).unwrap();
            assert!(!heap.is_idle(sid));
            heap.release(first).unwrap();
            assert!(heap.is_idle(sid));
            assert_eq!(heap.idle_segment(sid).age, 0, "idle since the last free, not since it was made");
            heap.check_invariants().unwrap();
        }
    }

    /// A recorded layout rebuilt block by block, from the highest address down: each block lands
    /// where it was, the space around it stays free, and the rules still decide whether a block
    /// keeps a small tail (PyTorch hands out a large block whole when at most 1 MiB would remain).
    #[test]
    fn take_at_rebuilds_a_recorded_layout() {
        let mut heap = Heap::new(Rules::pytorch());
        let sid = heap.add_segment(0x1000_0000, 20 * MIB, PoolKind::Large, 0);
        let base = 0x1000_0000;
        let high = heap.take_at(sid, base + 14 * MIB, 5 * MIB + 512, 5 * MIB + 512, 0).unwrap();
        let low = heap.take_at(sid, base + 2 * MIB, 3 * MIB, 3 * MIB, 0).unwrap();
        assert!(heap.take_at(sid, base + 3 * MIB, 2 * MIB, 2 * MIB, 0).is_none(), "overlaps a live block");
        let layout: Vec<(u64, u64, BlockState)> =
            heap.segments()[0].blocks.iter().map(|b| (b.address - base, b.size, b.state)).collect();
        assert_eq!(
            layout,
            [
                (0, 2 * MIB, BlockState::Free),
                (2 * MIB, 3 * MIB, BlockState::Allocated),
                (5 * MIB, 9 * MIB, BlockState::Free),
                // 20 - 14 = 6 MiB: less than 1 MiB would remain, so the block takes it whole.
                (14 * MIB, 6 * MIB, BlockState::Allocated),
            ]
        );
        heap.check_invariants().unwrap();
        heap.release(low).unwrap();
        heap.release(high).unwrap();
        assert_eq!(heap.segments()[0].blocks.len(), 1, "freed blocks coalesce again");
        heap.check_invariants().unwrap();
    }
}
