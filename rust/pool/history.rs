//! History: a ring buffer of the pool's recent events, in PyTorch's trace-entry vocabulary.

use super::Pool;
use crate::core::{BlockState, Handle, Heap};
use crate::device::Device;
use std::collections::VecDeque;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// PyTorch's `device_traces` actions that a pool without mapped segments produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistoryAction {
    Alloc,
    /// The user freed the block; it may still wait for device work on other streams.
    FreeRequested,
    /// The block went back to the cache.
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    /// Pages of an expandable range were mapped or unmapped.
    SegmentMap,
    SegmentUnmap,
    /// An allocation failed for good; `address` holds the device's free bytes instead.
    Oom,
}

impl HistoryAction {
    pub fn name(self) -> &'static str {
        match self {
            HistoryAction::Alloc => "alloc",
            HistoryAction::FreeRequested => "free_requested",
            HistoryAction::FreeCompleted => "free_completed",
            HistoryAction::SegmentAlloc => "segment_alloc",
            HistoryAction::SegmentFree => "segment_free",
            HistoryAction::SegmentMap => "segment_map",
            HistoryAction::SegmentUnmap => "segment_unmap",
            HistoryAction::Oom => "oom",
        }
    }
}

/// One recorded event. Sizes are what PyTorch records: the request for block events, the
/// segment size for segment events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    pub action: HistoryAction,
    pub address: u64,
    pub size: u64,
    pub stream: u32,
    /// Microseconds since the Unix epoch, as PyTorch's `time_us`.
    pub time_us: u64,
}

/// A free that waits for other streams' work: its `free_completed` is recorded once the heap no
/// longer holds the block pending (the pool completes pending blocks in several places; watching
/// the heap here keeps recording out of them).
#[derive(Clone, Copy, Debug)]
struct PendingFree {
    block: u32,
    generation: u32,
    completed: HistoryEntry,
}

/// The newest `max_entries` events; older ones are dropped first.
#[derive(Clone, Debug)]
pub struct History {
    entries: VecDeque<HistoryEntry>,
    max_entries: usize,
    pending: Vec<PendingFree>,
    /// Times come from a monotonic clock, anchored once to the wall clock.
    started: Instant,
    started_us: u64,
}

impl History {
    pub fn new(max_entries: usize) -> Self {
        let started_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        History {
            entries: VecDeque::new(),
            max_entries: max_entries.max(1),
            pending: Vec::new(),
            started: Instant::now(),
            started_us,
        }
    }

    /// Keeps the newest `max_entries` of what was recorded so far and of what comes next.
    pub fn set_max_entries(&mut self, max_entries: usize) {
        self.max_entries = max_entries.max(1);
        let excess = self.entries.len().saturating_sub(self.max_entries);
        self.entries.drain(..excess);
    }

    pub fn record(&mut self, action: HistoryAction, address: u64, size: u64, stream: u32) {
        if self.entries.len() == self.max_entries {
            self.entries.pop_front();
        }
        let time_us = self.started_us + self.started.elapsed().as_micros() as u64;
        self.entries.push_back(HistoryEntry { action, address, size, stream, time_us });
    }

    /// Records `free_completed` for every watched free whose block stopped being pending.
    fn settle(&mut self, heap: &Heap) {
        let mut index = 0;
        while index < self.pending.len() {
            let p = self.pending[index];
            let block = heap.block_at(p.block);
            if block.state == BlockState::Pending && block.generation == p.generation {
                index += 1;
                continue;
            }
            self.pending.remove(index);
            let e = p.completed;
            self.record(e.action, e.address, e.size, e.stream);
        }
    }

    /// Oldest first.
    pub fn entries(&self) -> impl ExactSizeIterator<Item = &HistoryEntry> {
        self.entries.iter()
    }
}

impl<D: Device> Pool<D> {
    /// Starts recording the newest `max_entries` events (resizing a running record keeps what
    /// fits), or with `None` stops and discards the record.
    pub fn record_history(&mut self, max_entries: Option<usize>) {
        match (max_entries, self.history.as_mut()) {
            (Some(max), Some(history)) => history.set_max_entries(max),
            (Some(max), None) => self.history = Some(History::new(max)),
            (None, _) => self.history = None,
        }
        if let Some(pages) = self.expandable.as_mut() {
            pages.log_calls(self.history.is_some());
        }
    }

    /// Records the page maps and unmaps made since the last call (only kept while recording).
    pub(super) fn note_page_calls(&mut self, stream: u32) {
        let Some(calls) = self.expandable.as_mut().map(|pages| pages.take_calls()) else { return };
        for (mapped, address, size) in calls {
            let action = if mapped { HistoryAction::SegmentMap } else { HistoryAction::SegmentUnmap };
            self.note(action, address, size, stream);
        }
    }

    /// The record, brought up to date with frees that completed since the last event.
    pub fn history(&mut self) -> Option<&History> {
        let history = self.history.as_mut()?;
        history.settle(&self.heap);
        Some(history)
    }

    /// The one branch recording costs when it is off.
    pub(super) fn note(&mut self, action: HistoryAction, address: u64, size: u64, stream: u32) {
        if let Some(history) = self.history.as_mut() {
            history.settle(&self.heap);
            history.record(action, address, size, stream);
        }
    }

    /// A user's free of a live block: requested, and completed at once unless the block stays
    /// pending (`deferred`: other streams' work, or exports of its bytes); then it completes
    /// when the heap stops holding the block.
    pub(super) fn note_free(&mut self, handle: Handle, deferred: bool) {
        let Some(history) = self.history.as_mut() else { return };
        let Ok(b) = self.heap.block(handle) else { return };
        history.settle(&self.heap);
        history.record(HistoryAction::FreeRequested, b.address, b.requested, b.stream);
        if deferred {
            // Freeing bumps the generation once; the pending block keeps that one.
            let generation = handle.generation.wrapping_add(1);
            let (action, address, size, stream) = (HistoryAction::FreeCompleted, b.address, b.requested, b.stream);
            // Its time is set when the completion is recorded.
            let completed = HistoryEntry { action, address, size, stream, time_us: 0 };
            history.pending.push(PendingFree { block: handle.index, generation, completed });
        } else {
            history.record(HistoryAction::FreeCompleted, b.address, b.requested, b.stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Sim;
    use crate::pool::Config;

    fn actions(pool: &mut Pool<Sim>) -> Vec<HistoryAction> {
        pool.history().unwrap().entries().map(|e| e.action).collect()
    }

    #[test]
    fn a_free_waiting_for_another_stream_completes_when_its_block_does() {
        let mut pool = Pool::new(Sim::new(1 << 30), Config::parse("strategy:pytorch").unwrap());
        pool.record_history(Some(100));
        let side = pool.create_stream().unwrap();
        let a = pool.alloc(4096).unwrap();
        pool.record_stream(a.handle, side).unwrap();
        pool.hold_stream(side).unwrap();
        pool.free(a.handle).unwrap();
        assert_eq!(actions(&mut pool).last(), Some(&HistoryAction::FreeRequested));
        pool.synchronize().unwrap();
        let done = actions(&mut pool);
        assert_eq!(done[done.len() - 2..], [HistoryAction::FreeRequested, HistoryAction::FreeCompleted]);
        pool.alloc(4096).unwrap();
        assert_eq!(actions(&mut pool).last(), Some(&HistoryAction::Alloc));
    }

    #[test]
    fn keeps_the_newest_entries_in_order() {
        let mut history = History::new(3);
        for address in 1..=5 {
            history.record(HistoryAction::Alloc, address, 512, 0);
        }
        let kept: Vec<u64> = history.entries().map(|e| e.address).collect();
        assert_eq!(kept, [3, 4, 5]);
        let times: Vec<u64> = history.entries().map(|e| e.time_us).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        history.set_max_entries(2);
        assert_eq!(history.entries().map(|e| e.address).collect::<Vec<_>>(), [4, 5]);
        assert_eq!(HistoryAction::FreeCompleted.name(), "free_completed");
    }
}
