//! Allocation traces: the allocations and frees a workload made, paired up once at load time so
//! that replay finds a free's allocation by index, never by address.
//!
//! Sources: RMM's logging CSV ([`csv`]), PyTorch snapshot entries ([`TraceBuilder::snapshot_entry`],
//! fed by the Python snapshot reader, whose pickles [`pickle`] decodes) and a pool's own
//! [`History`]. [`replay`] runs a trace on a pool.

pub mod csv;
pub mod fidelity;
pub mod job;
pub mod pickle;
pub mod replay;
pub mod rows;
pub mod start;

use crate::pool::History;
use rustc_hash::FxHashMap;
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Alloc,
    Free,
    /// An allocation that failed when the trace was recorded. A replay that honours the job
    /// tries it again and, if it is served, frees it at once: the job went on without it.
    Failure,
    /// The job called `torch.cuda.empty_cache()`: every replay that honours the job does too.
    EmptyCache,
    /// The allocator's out-of-memory path released its cache before retrying a request. A
    /// replay of the recorded configuration releases there too; any other configuration runs
    /// its own out-of-memory path, where its own capacity makes it.
    OomRelease,
}

impl Action {
    /// PyTorch's names (`oom` for a failure), and gpupool's for the job's releases.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::Free => "free",
            Action::Failure => "oom",
            Action::EmptyCache => "empty_cache",
            Action::OomRelease => "oom_release",
        }
    }

    /// Whether the event is the job's management of its pool rather than a request.
    pub fn is_release(self) -> bool {
        matches!(self, Action::EmptyCache | Action::OomRelease)
    }
}

impl From<job::Release> for Action {
    fn from(why: job::Release) -> Self {
        match why {
            job::Release::EmptyCache => Action::EmptyCache,
            job::Release::OutOfMemory => Action::OomRelease,
        }
    }
}

/// No allocation: the slot of a [`Action::Failure`] and of a release.
pub const NO_SLOT: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub action: Action,
    /// Index into [`Trace::streams`].
    pub stream: u32,
    /// Numbers allocations densely from 0: an `Alloc` and the `Free` that ends it share a slot.
    pub slot: u32,
    /// The address the traced program saw (for reports and for writing the trace back).
    pub address: u64,
    /// Bytes requested; a `Free` carries its allocation's size, a release the bytes the
    /// recorded allocator gave back.
    pub size: u64,
    /// Nanoseconds since the trace began.
    pub time_ns: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceError {
    /// A free of an address that is not live: never allocated, or already freed.
    UnknownFree(u64),
    /// An allocation at an address that is still live.
    LiveAddress(u64),
    UnknownAction(String),
    /// An allocation that takes the bytes live at once past 2**64: sizes no device has.
    LiveBytesOverflow(u64),
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::UnknownFree(a) => write!(f, "free of {a:#x}, which is not a live allocation of this trace"),
            TraceError::LiveAddress(a) => write!(f, "allocation at {a:#x}, which is still allocated (no free before)"),
            TraceError::UnknownAction(action) => write!(f, "unknown action '{action}'"),
            TraceError::LiveBytesOverflow(size) => {
                write!(f, "an allocation of {size} bytes takes the bytes live at once past 2**64")
            }
        }
    }
}

impl std::error::Error for TraceError {}

/// A loaded trace: events in order, with every free paired to its allocation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    events: Vec<Event>,
    /// The traced program's stream handles, in order of first use.
    streams: Vec<u64>,
    slots: u32,
    peak_live_bytes: u64,
    /// How many leading events are allocations that were live before recording began (see
    /// [`TraceBuilder::begin_history`]); 0 when the trace starts from nothing.
    prelude: usize,
    /// The most bytes the job could hold on its GPU, where its `oom` entries say.
    capacity: Option<u64>,
    /// The bytes the recorded allocator held reserved at each event, where the snapshot's
    /// segment entries say (empty otherwise).
    recorded_reserved: Vec<u64>,
}

impl Trace {
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    pub fn streams(&self) -> &[u64] {
        &self.streams
    }

    /// How many allocations the trace makes (the slots replay needs).
    pub fn allocations(&self) -> usize {
        self.slots as usize
    }

    /// The most bytes live at once, as requested: what any allocator must hold at least.
    pub fn peak_live_bytes(&self) -> u64 {
        self.peak_live_bytes
    }

    /// The most bytes the job could hold on its GPU, inferred from its `oom` entries.
    pub fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// The bytes the recorded allocator held reserved at each event; empty when the source
    /// recorded no segment entries.
    pub fn recorded_reserved(&self) -> &[u64] {
        &self.recorded_reserved
    }

    /// The leading allocations of blocks that were live before recording began: a replay from
    /// nothing makes them first; [`start::replay_from_start`] puts them back where they lay.
    pub fn prelude(&self) -> &[Event] {
        &self.events[..self.prelude]
    }

    /// A trace from one device's snapshot entries, oldest first: the blocks `live_before`
    /// recording began (`(address, size, stream)`) allocated first, then `alloc`,
    /// `free_completed` and `oom` entries as requests, and each burst of segment releases as
    /// the job's [`Action::EmptyCache`] or the out-of-memory path's [`Action::OomRelease`] (see
    /// [`job`]). `final_reserved` is what the snapshot's segments of the device hold. An error
    /// names the entry at fault (`None`: a block live before recording).
    pub fn from_snapshot(
        entries: &[job::Entry<'_>],
        live_before: &[(u64, u64, u64)],
        final_reserved: Option<u64>,
    ) -> Result<Trace, (Option<usize>, TraceError)> {
        let record = job::read(entries, final_reserved);
        let mut builder = TraceBuilder::default();
        for &(address, size, stream) in live_before {
            builder.alloc(address, size, stream, 0).map_err(|e| (None, e))?;
        }
        builder.begin_history();
        let segments_recorded = entries.iter().any(|e| e.action.starts_with("segment_"));
        if segments_recorded {
            builder.trace.recorded_reserved = vec![record.start_reserved; builder.trace.events.len()];
        }
        let mut releases = record.releases.iter().peekable();
        for (index, e) in entries.iter().enumerate() {
            if let Some(&(_, why, bytes)) = releases.next_if(|r| r.0 == index) {
                builder.release(why.into(), bytes, e.stream, e.time_ns);
                if segments_recorded {
                    // The whole burst at once, as a replay releases it.
                    let before = index.checked_sub(1).map_or(record.start_reserved, |i| record.reserved[i]);
                    builder.trace.recorded_reserved.push(before.saturating_sub(bytes));
                }
            }
            builder
                .snapshot_entry(e.action, e.address, e.size, e.stream, e.time_ns)
                .map_err(|error| (Some(index), error))?;
            if segments_recorded {
                let missing = builder.trace.events.len() - builder.trace.recorded_reserved.len();
                builder.trace.recorded_reserved.extend(std::iter::repeat_n(record.reserved[index], missing));
            }
        }
        builder.set_capacity(record.capacity);
        Ok(builder.finish())
    }

    /// A pool's recorded history as a trace of its users' requests: allocations, the frees
    /// users asked for, failed allocations, and the pool's releases of cached memory as the
    /// job's (see [`Trace::from_snapshot`]). Frees of blocks allocated before the oldest kept
    /// entry (the ring buffer dropped them) are left out.
    pub fn from_history(history: &History) -> Trace {
        let start = history.entries().next().map_or(0, |e| e.time_us);
        let entries: Vec<job::Entry<'_>> = history
            .entries()
            .map(|e| job::Entry {
                action: e.action.name(),
                address: e.address,
                size: e.size,
                stream: u64::from(e.stream),
                time_ns: (e.time_us - start) * 1000,
            })
            .collect();
        let record = job::read(&entries, None);
        let mut releases = record.releases.iter().peekable();
        let mut builder = TraceBuilder::default();
        for (index, e) in entries.iter().enumerate() {
            if let Some(&(_, why, bytes)) = releases.next_if(|r| r.0 == index) {
                builder.release(why.into(), bytes, e.stream, e.time_ns);
            }
            match e.action {
                "alloc" => {
                    let fresh = builder.alloc(e.address, e.size, e.stream, e.time_ns);
                    debug_assert!(fresh.is_ok(), "the pool handed out a live address: {fresh:?}");
                }
                // An unknown free's allocation is older than the oldest kept entry.
                "free_requested" => _ = builder.free(e.address, e.stream, e.time_ns),
                "oom" => builder.failure(e.size, e.stream, e.time_ns),
                _ => {}
            }
        }
        builder.set_capacity(record.capacity);
        builder.finish()
    }
}

/// Builds a [`Trace`] event by event, pairing each free with the live allocation at its address.
#[derive(Debug, Default)]
pub struct TraceBuilder {
    trace: Trace,
    /// Live allocations: address -> (slot, size).
    live: FxHashMap<u64, (u32, u64)>,
    stream_index: FxHashMap<u64, u32>,
    live_bytes: u64,
}

impl TraceBuilder {
    fn stream(&mut self, stream: u64) -> u32 {
        let streams = &mut self.trace.streams;
        *self.stream_index.entry(stream).or_insert_with(|| {
            streams.push(stream);
            (streams.len() - 1) as u32
        })
    }

    /// Records an allocation. A null address (a zero-byte allocation) is left out, as C's
    /// `free(NULL)` is.
    pub fn alloc(&mut self, address: u64, size: u64, stream: u64, time_ns: u64) -> Result<(), TraceError> {
        if address == 0 {
            return Ok(());
        }
        let live_bytes = self.live_bytes.checked_add(size).ok_or(TraceError::LiveBytesOverflow(size))?;
        let slot = self.trace.slots;
        if self.live.insert(address, (slot, size)).is_some() {
            return Err(TraceError::LiveAddress(address));
        }
        self.trace.slots += 1;
        self.live_bytes = live_bytes;
        self.trace.peak_live_bytes = self.trace.peak_live_bytes.max(self.live_bytes);
        let stream = self.stream(stream);
        self.trace.events.push(Event { action: Action::Alloc, stream, slot, address, size, time_ns });
        Ok(())
    }

    /// Records the free of the live allocation at `address`; a null address is a no-op.
    pub fn free(&mut self, address: u64, stream: u64, time_ns: u64) -> Result<(), TraceError> {
        if address == 0 {
            return Ok(());
        }
        let (slot, size) = self.live.remove(&address).ok_or(TraceError::UnknownFree(address))?;
        self.live_bytes -= size;
        let stream = self.stream(stream);
        self.trace.events.push(Event { action: Action::Free, stream, slot, address, size, time_ns });
        Ok(())
    }

    pub fn failure(&mut self, size: u64, stream: u64, time_ns: u64) {
        let stream = self.stream(stream);
        self.trace.events.push(Event { action: Action::Failure, stream, slot: NO_SLOT, address: 0, size, time_ns });
    }

    /// Says how many bytes the job could hold on its GPU (see [`Trace::capacity`]).
    pub fn set_capacity(&mut self, capacity: Option<u64>) {
        self.trace.capacity = capacity;
    }

    /// Records a release of cached memory (`bytes` given back as recorded).
    pub fn release(&mut self, action: Action, bytes: u64, stream: u64, time_ns: u64) {
        debug_assert!(action.is_release());
        let stream = self.stream(stream);
        self.trace.events.push(Event { action, stream, slot: NO_SLOT, address: 0, size: bytes, time_ns });
    }

    /// One entry of a PyTorch snapshot's `device_traces`: `alloc` and `free_completed` are
    /// the events replay needs, `oom` a failure; the others describe the allocator's own
    /// work (segments, pending frees, markers) and are skipped.
    pub fn snapshot_entry(
        &mut self,
        action: &str,
        address: u64,
        size: u64,
        stream: u64,
        time_ns: u64,
    ) -> Result<(), TraceError> {
        match action {
            "alloc" => self.alloc(address, size, stream, time_ns),
            "free_completed" => self.free(address, stream, time_ns),
            "oom" => {
                self.failure(size, stream, time_ns);
                Ok(())
            }
            "free_requested" | "segment_alloc" | "segment_free" | "segment_map" | "segment_unmap" | "snapshot" => {
                Ok(())
            }
            other => Err(TraceError::UnknownAction(other.to_string())),
        }
    }

    /// Marks the end of the allocations made so far as the blocks live before recording began.
    pub fn begin_history(&mut self) {
        self.trace.prelude = self.trace.events.len();
    }

    pub fn finish(self) -> Trace {
        self.trace
    }
}

#[cfg(test)]
mod tests {
    use super::replay::{replay, replay_sim, JobActions};
    use super::*;
    use crate::core::{Metric, StatType};
    use crate::device::Sim;
    use crate::pool::{Config, Pool};

    #[test]
    fn builder_pairs_frees_and_rejects_inconsistent_events() {
        let mut b = TraceBuilder::default();
        b.alloc(0x100, 10, 7, 0).unwrap();
        b.alloc(0x200, 20, 0, 1).unwrap();
        assert_eq!(b.alloc(0x100, 5, 7, 2), Err(TraceError::LiveAddress(0x100)));
        let mut b = TraceBuilder::default();
        b.alloc(0x100, 10, 7, 0).unwrap();
        b.free(0, 7, 1).unwrap();
        assert_eq!(b.free(0x300, 7, 1), Err(TraceError::UnknownFree(0x300)));
        b.free(0x100, 7, 2).unwrap();
        assert_eq!(b.free(0x100, 7, 3), Err(TraceError::UnknownFree(0x100)));
        b.alloc(0x100, 30, 9, 4).unwrap();
        let trace = b.finish();
        assert_eq!(trace.streams(), [7, 9]);
        let slots: Vec<u32> = trace.events().iter().map(|e| e.slot).collect();
        assert_eq!(slots, [0, 0, 1]);
        assert_eq!(trace.events()[1].size, 10);
        assert_eq!(trace.peak_live_bytes(), 30);
    }

    #[test]
    fn snapshot_entries_keep_allocs_and_completed_frees() {
        let mut b = TraceBuilder::default();
        for (action, address) in
            [("segment_alloc", 0x100), ("alloc", 0x100), ("free_requested", 0x100), ("free_completed", 0x100)]
        {
            b.snapshot_entry(action, address, 512, 0, 0).unwrap();
        }
        b.snapshot_entry("oom", 1 << 20, 1 << 30, 0, 0).unwrap();
        b.snapshot_entry("snapshot", 0, 0, 0, 0).unwrap();
        assert_eq!(b.snapshot_entry("realloc", 0, 0, 0, 0), Err(TraceError::UnknownAction("realloc".into())));
        let actions: Vec<Action> = b.finish().events().iter().map(|e| e.action).collect();
        assert_eq!(actions, [Action::Alloc, Action::Free, Action::Failure]);
    }

    /// Record a workload with history on, rebuild the trace from it, replay: same peaks.
    #[test]
    fn recorded_history_replays_to_the_same_peaks() {
        let mut pool = Pool::new(Sim::new(256 << 20), Config::parse("strategy:pytorch").unwrap());
        pool.record_history(Some(1000));
        let mut live = Vec::new();
        for i in 0..200u64 {
            let size = 1000 + (i * 7919) % (3 << 20);
            match pool.alloc(size) {
                Ok(a) => live.push(a.handle),
                Err(e) => panic!("{e}"),
            }
            if i % 3 == 2 {
                pool.free(live.swap_remove((i as usize * 31) % live.len())).unwrap();
            }
        }
        assert!(pool.alloc(1 << 30).is_err());
        for handle in live.drain(..) {
            pool.free(handle).unwrap();
        }
        pool.empty_cache().unwrap();
        let history = pool.history().unwrap();
        let names: std::collections::BTreeSet<&str> = history.entries().map(|e| e.action.name()).collect();
        assert_eq!(names.len(), 6, "{names:?}");
        let trace = Trace::from_history(history);
        assert_eq!(trace.events().iter().filter(|e| e.action == Action::Failure).count(), 1);
        let replayed = replay_sim(&trace, &Config::parse("strategy:pytorch").unwrap(), 256 << 20).unwrap();
        let peak = |m| pool.stats().get(m, StatType::All).peak;
        assert_eq!(replayed.peak_live_bytes, peak(Metric::RequestedBytes));
        assert_eq!(replayed.peak_reserved_bytes, peak(Metric::ReservedBytes));
        // A recorded failure is tried again, and fails as it did on a device of the same size;
        // a replay that ignores the job's actions skips it.
        assert_eq!((replayed.ooms, replayed.ooms_as_recorded, replayed.releases), (1, 1, 1));
        let mut fresh = Pool::new(Sim::new(256 << 20), Config::parse("strategy:pytorch").unwrap());
        let ignored = replay(&trace, &mut fresh, None, JobActions::Ignore).unwrap();
        assert_eq!((ignored.ooms, ignored.releases, ignored.peak_reserved_bytes), (0, 0, replayed.peak_reserved_bytes));
    }

    #[test]
    fn a_wrapped_history_leaves_out_frees_of_forgotten_allocations() {
        let mut pool = Pool::new(Sim::new(1 << 30), Config::parse("strategy:pytorch").unwrap());
        pool.record_history(Some(5));
        let first = pool.alloc(4096).unwrap();
        let second = pool.alloc(4096).unwrap();
        pool.free(first.handle).unwrap();
        pool.free(second.handle).unwrap();
        // Kept: the second alloc, both frees (requested and completed); the first alloc is gone.
        let trace = Trace::from_history(pool.history().unwrap());
        let actions: Vec<Action> = trace.events().iter().map(|e| e.action).collect();
        assert_eq!(actions, [Action::Alloc, Action::Free]);
        assert_eq!(trace.events()[1].address, second.address);
        let pool_of = |c| Pool::new(Sim::new(1 << 30), Config::parse(c).unwrap());
        replay(&trace, &mut pool_of("strategy:pytorch"), None, JobActions::Honour).unwrap();
        pool.record_history(None);
        assert!(pool.history().is_none());
    }
}
