//! Stream ownership of free blocks: fences that share a stream's frees with every stream once
//! its queued work is done, and retiring destroyed streams.
//!
//! A free block belongs to the stream that freed it, which may reuse it at once (its own order
//! protects it). When a fence (a device event the pool records on that stream, covering every
//! block it freed so far) completes, those blocks become [`SHARED`]. Epochs tell which blocks a
//! fence covers: each free takes its stream's current epoch, and a fence closes it.

use super::bins::Bins;
use super::block::{BlockState, NIL, SHARED};
use super::heap::Heap;

/// Per stream: the epoch its next free gets, and whether frees happened since the last fence.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Epoch {
    pub current: u32,
    pub unfenced: bool,
}

impl Heap {
    #[inline]
    pub(super) fn epoch_mut(&mut self, stream: u32) -> &mut Epoch {
        if stream as usize >= self.epochs.len() {
            self.epochs.resize(stream as usize + 1, Epoch::default());
        }
        &mut self.epochs[stream as usize]
    }

    /// Starts a fence on `stream` if it freed blocks since its last one: returns the epoch the
    /// fence covers (record a device event now; pass the epoch to `promote` once it completes).
    pub fn fence(&mut self, stream: u32) -> Option<u32> {
        let e = self.epochs.get_mut(stream as usize).filter(|e| e.unfenced)?;
        e.unfenced = false;
        e.current += 1;
        Some(e.current - 1)
    }

    /// Streams that freed blocks since their last fence.
    pub fn unfenced_streams(&self) -> impl Iterator<Item = u32> + '_ {
        self.epochs.iter().enumerate().filter(|(_, e)| e.unfenced).map(|(s, _)| s as u32)
    }

    /// A fence on `stream` covering `epoch` completed: its blocks freed up to then are shared.
    pub fn promote(&mut self, stream: u32, epoch: u32) {
        let Some(bins) = self.private.get(stream as usize).and_then(Option::as_deref) else { return };
        let members: Vec<u32> = bins.iter().flat_map(|b| b.members(&self.blocks)).collect();
        for id in members {
            // An earlier promotion in this loop may have merged this block away (its slot is then
            // unused: no segment).
            let b = &self.blocks[id as usize];
            if b.segment == NIL || b.state != BlockState::Free || b.stream != stream || b.epoch > epoch {
                continue;
            }
            let before = self.inactive_share(id);
            self.bin_remove(id);
            self.blocks[id as usize].stream = SHARED;
            self.coalesce_and_bin(id, before);
        }
    }

    /// A destroyed stream's blocks are safe for everyone (it was synchronized first). Its bins,
    /// now empty, are dropped: stream ids are never reused, so a pool that makes and destroys
    /// streams would otherwise keep every one's tables.
    pub fn retire_stream(&mut self, stream: u32) {
        self.promote(stream, u32::MAX);
        if let Some(e) = self.epochs.get_mut(stream as usize) {
            e.unfenced = false;
        }
        if let Some(bins) = self.private.get_mut(stream as usize) {
            debug_assert!(bins.as_ref().is_none_or(|b| b.iter().all(Bins::is_empty)), "promoted, so empty");
            *bins = None;
        }
        while self.private.last().is_some_and(Option::is_none) {
            self.private.pop();
        }
    }

    /// Every stream the heap holds something for: owners of blocks (allocated, pending, or free
    /// and not yet shared) and streams recorded as using them (the first 31; the pool lists the
    /// rest). O(blocks).
    pub fn streams_in_use(&self) -> Vec<u32> {
        let mut streams = Vec::new();
        for b in self.blocks.iter().filter(|b| b.segment != NIL) {
            if b.stream != SHARED {
                streams.push(b.stream);
            }
            let mut uses = b.uses & !(1 << super::USE_OVERFLOW_BIT);
            while uses != 0 {
                streams.push(uses.trailing_zeros());
                uses &= uses - 1;
            }
        }
        streams.sort_unstable();
        streams.dedup();
        streams
    }

    /// Whether an allocated or pending block belongs to `stream` or was used on it.
    pub fn holds_for(&self, stream: u32) -> bool {
        let bit = if stream < super::USE_OVERFLOW_BIT { 1 << stream } else { 0 };
        self.blocks
            .iter()
            .any(|b| b.segment != NIL && b.state != BlockState::Free && (b.stream == stream || b.uses & bit != 0))
    }

    /// A destroyed stream's allocated and pending blocks pass to `heir`: they stay usable
    /// (freed, copied, exported) in `heir`'s order, since nothing of the old stream can still run.
    pub fn hand_over(&mut self, stream: u32, heir: u32) {
        for b in self.blocks.iter_mut() {
            if b.segment != NIL && b.state != BlockState::Free && b.stream == stream {
                b.stream = heir;
                // The owner's own use needs no wait.
                if heir < super::USE_OVERFLOW_BIT {
                    b.uses &= !(1 << heir);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{PoolKind, Rules};

    /// Streams that freed a block and were destroyed keep no bins: each stream's bins hold
    /// tables of some KiB, and a program that makes a stream per step makes millions of them.
    #[test]
    fn retired_streams_keep_no_bins() {
        let mut heap = Heap::new(Rules::default());
        let free_one = |heap: &mut Heap, stream: u32| {
            let id = heap.find(512, stream).or_else(|| heap.find(512, SHARED));
            let id = id.unwrap_or_else(|| {
                let sid = heap.add_segment(u64::from(stream) << 24, 2 << 20, PoolKind::Small, stream);
                heap.segment(sid).head
            });
            let (handle, _) = heap.take_block(id, 512, 512, stream);
            heap.release(handle).unwrap();
        };
        // Stream 1 lives throughout; every later one frees a block and is destroyed, in turn
        // and with the next one made before the last is destroyed.
        free_one(&mut heap, 1);
        for stream in 2..200 {
            free_one(&mut heap, stream);
            if stream > 2 {
                heap.retire_stream(stream - 1);
            }
            heap.check_invariants().unwrap();
            let with_bins: Vec<usize> =
                heap.private.iter().enumerate().filter(|(_, b)| b.is_some()).map(|(s, _)| s).collect();
            assert_eq!(with_bins, [1, stream as usize], "only live streams have bins");
        }
        heap.retire_stream(199);
        assert_eq!(heap.private.len(), 2, "the retired streams above the live one are forgotten");
    }
}
