//! Invariant checking for the heap: recomputes everything the hot path maintains incrementally.

use super::block::{BlockState, SHARED};
use super::heap::Heap;
use super::rules::PoolKind;
use super::stats::{Metric, StatType, Stats};
use std::collections::HashSet;

impl Heap {
    /// Verifies that blocks tile each segment exactly, that no two adjacent free blocks of one
    /// owner were left unmerged, that every free block sits in its owner's bin for its size and
    /// only there, and that the statistics equal a recount.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut recount = Stats::default();
        let mut free_blocks = HashSet::new();
        let mut live_blocks = 0usize;
        for (sid, seg) in self.segments.iter().enumerate() {
            let Some(seg) = seg else { continue };
            recount.increase(Metric::Segment, seg.kind, if seg.expandable { u64::from(seg.runs) } else { 1 });
            recount.increase(Metric::ReservedBytes, seg.kind, seg.mapped);
            if !seg.expandable && seg.size >= self.rules.max_split_size {
                recount.note_oversize(false, true);
            }
            let (mut expected_address, mut prev, mut prev_owner) = (seg.address, super::NIL, None);
            for (id, b) in self.blocks_of(seg) {
                if b.segment != sid as u32 || b.prev != prev || b.kind != seg.kind {
                    return Err(format!("block {id} is mislinked in segment {sid}"));
                }
                if b.address != expected_address || b.size == 0 {
                    return Err(format!("segment {sid} is not tiled exactly at {:#x}", b.address));
                }
                let owner = (b.state == BlockState::Free).then_some(b.stream);
                if owner.is_some() && owner == prev_owner {
                    return Err(format!("adjacent free blocks at {:#x} were not coalesced", b.address));
                }
                match b.state {
                    BlockState::Free => {
                        free_blocks.insert(id);
                        if b.is_inactive_split() {
                            recount.increase(Metric::InactiveSplit, seg.kind, 1);
                            recount.increase(Metric::InactiveSplitBytes, seg.kind, b.size);
                        }
                    }
                    BlockState::Allocated => {
                        recount.increase(Metric::Allocation, seg.kind, 1);
                        recount.increase(Metric::AllocatedBytes, seg.kind, b.size);
                        if b.size >= self.rules.max_split_size {
                            recount.note_oversize(true, true);
                        }
                    }
                    BlockState::Pending => {}
                }
                if b.state != BlockState::Free {
                    recount.increase(Metric::Active, seg.kind, 1);
                    recount.increase(Metric::ActiveBytes, seg.kind, b.size);
                    recount.increase(Metric::RequestedBytes, seg.kind, b.requested);
                }
                expected_address = b.end();
                prev = id;
                prev_owner = owner;
                live_blocks += 1;
            }
            if expected_address != seg.address + seg.size {
                return Err(format!("blocks of segment {sid} do not reach its end"));
            }
        }
        if live_blocks + self.unused_blocks.len() != self.blocks.len() {
            return Err("block slab leaks entries".into());
        }
        self.check_bins(&free_blocks)?;
        if recount.currents() != self.stats.currents() {
            return Err(format!(
                "statistics disagree with a recount: kept {:?}, recounted {:?}",
                self.stats.currents(),
                recount.currents()
            ));
        }
        for metric in Metric::ALL {
            let [all, large, small] = StatType::ALL.map(|of| self.stats.get(metric, of));
            let pools_add_up = all.current == large.current + small.current
                && all.allocated == large.allocated + small.allocated
                && all.peak <= large.peak + small.peak;
            if [all, large, small].iter().any(|s| s.peak < s.current) || !pools_add_up {
                return Err(format!("{} counters are inconsistent: {all:?} {large:?} {small:?}", metric.name()));
            }
        }
        Ok(())
    }

    /// Every binned block is free, in the bins of its owner and kind, exactly once; and every
    /// free block is binned.
    fn check_bins(&self, free_blocks: &HashSet<u32>) -> Result<(), String> {
        let private = self.private.iter().enumerate().filter_map(|(s, bins)| Some((s as u32, bins.as_deref()?)));
        let owners = private.chain([(SHARED, &self.shared)]);
        let mut binned = HashSet::new();
        for (owner, pair) in owners {
            for kind in PoolKind::ALL {
                for id in pair[kind.index()].check(&self.blocks)? {
                    let b = &self.blocks[id as usize];
                    if b.state != BlockState::Free || b.stream != owner || b.kind != kind {
                        return Err(format!("block {id} sits in the wrong bins"));
                    }
                    if !binned.insert(id) {
                        return Err(format!("block {id} is binned twice"));
                    }
                }
            }
        }
        if &binned != free_blocks {
            return Err("the free blocks and the binned blocks differ".into());
        }
        Ok(())
    }
}
