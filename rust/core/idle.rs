//! Idle segments: cached segments that are one free block, the memory a pool can give back
//! without moving anything, with their ages for garbage collection and the release watermark.

use super::block::SHARED;
use super::heap::{Heap, SegmentId};
use super::rules::PoolKind;
use super::stats::{Metric, StatType};

/// A cached segment that is one free block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdleSegment {
    pub id: SegmentId,
    pub size: u64,
    pub kind: PoolKind,
    /// Allocations of its pool kind served since it became one free block (PyTorch's
    /// `gc_count`).
    pub age: u32,
}

impl Heap {
    /// Whether segment `sid` is one free block that could go back to the device. Expandable
    /// ranges never are: they give memory back by unmapping pages.
    pub fn is_idle(&self, sid: SegmentId) -> bool {
        match self.segments.get(sid as usize) {
            Some(Some(seg)) if !seg.expandable => self.is_fully_free(seg),
            _ => false,
        }
    }

    /// Free bytes outside partly used segments: the idle segments' (and, in expandable ranges,
    /// the free mapped pages'). O(1), from the statistics.
    pub fn idle_bytes(&self) -> u64 {
        let current = |m| self.stats.get(m, StatType::All).current;
        current(Metric::ReservedBytes)
            .saturating_sub(current(Metric::ActiveBytes))
            .saturating_sub(current(Metric::InactiveSplitBytes))
    }

    /// The streams that own free blocks of segment `sid` (none when all are shared): their
    /// queued work may still use those blocks.
    pub fn owners(&self, sid: SegmentId) -> Vec<u32> {
        let mut owners: Vec<u32> =
            self.blocks_of(self.segment(sid)).map(|(_, b)| b.stream).filter(|&s| s != SHARED).collect();
        owners.dedup();
        owners
    }

    /// Idle segment `sid` with its age; it must be idle.
    pub fn idle_segment(&self, sid: SegmentId) -> IdleSegment {
        let seg = self.segment(sid);
        let age = self.clocks[seg.kind.index()].wrapping_sub(seg.idle_since);
        IdleSegment { id: sid, size: seg.size, kind: seg.kind, age }
    }

    /// Every idle segment, oldest first (ties in slab order). O(segments).
    pub fn idle_segments(&self) -> Vec<IdleSegment> {
        let mut idle: Vec<IdleSegment> = (0..self.segments.len() as SegmentId)
            .filter(|&sid| self.is_idle(sid))
            .map(|sid| self.idle_segment(sid))
            .collect();
        idle.sort_by_key(|s| std::cmp::Reverse(s.age));
        idle
    }

    /// The address and size of segment `sid`.
    pub fn segment_extent(&self, sid: SegmentId) -> (u64, u64) {
        let seg = self.segment(sid);
        (seg.address, seg.size)
    }

    /// The stream segment `sid` was allocated for.
    pub fn segment_stream(&self, sid: SegmentId) -> u32 {
        self.segment(sid).stream
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::Rules;

    const MIB: u64 = 1 << 20;

    #[test]
    fn idle_segments_age_with_allocations_of_their_kind() {
        let mut heap = Heap::new(Rules::default());
        let old = heap.add_segment(0, 20 * MIB, PoolKind::Large, 0);
        let young = heap.add_segment(100 * MIB, 20 * MIB, PoolKind::Large, 0);
        let small = heap.add_segment(200 * MIB, 2 * MIB, PoolKind::Small, 0);
        let a = heap.take_segment(young, 12 * MIB, 0);
        let b = heap.take_segment(small, 4096, 0);
        assert_eq!(heap.idle_segments().iter().map(|s| s.id).collect::<Vec<_>>(), [old]);
        heap.release(a).unwrap();
        let ages: Vec<(SegmentId, u32)> = heap.idle_segments().iter().map(|s| (s.id, s.age)).collect();
        assert_eq!(ages, [(old, 1), (young, 0)], "one large allocation since `old` was binned");
        assert_eq!(heap.idle_bytes(), 40 * MIB);
        assert!(!heap.is_idle(small));
        heap.release(b).unwrap();
        assert_eq!(heap.idle_bytes(), 42 * MIB);
        assert_eq!(heap.segment_extent(old), (0, 20 * MIB));
        assert_eq!(heap.remove_segment(old), (0, 20 * MIB));
        assert_eq!(heap.idle_bytes(), 22 * MIB);
        heap.check_invariants().unwrap();
    }
}
