//! Deterministic simulated streams and events for devices without real asynchrony (`host`, `sim`).
//!
//! A stream is idle unless `hold` marks it busy (as if kernels were queued on it). An event
//! recorded on an idle stream completes at once; one recorded on a held stream stays pending until
//! the stream is synchronized, which completes everything recorded on it and ends the hold. A
//! stream made to wait on a pending event is busy until that event completes.

use super::{DeviceError, EventId, StreamId, DEFAULT_STREAM};
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

/// Marks the ids of events that completed when recorded.
const DONE: EventId = 1 << 63;

#[derive(Debug, Default)]
struct StreamState {
    held: bool,
    /// Pending events this stream was made to wait on.
    waits_on: Vec<EventId>,
    /// Events recorded on this stream while it was busy: its next synchronization completes them.
    recorded: Vec<EventId>,
}

#[derive(Debug, Clone, Copy)]
struct EventState {
    stream: StreamId,
    completed: bool,
    /// Destroyed while pending: invisible to callers, but streams waiting on it still wait.
    destroyed: bool,
}

#[derive(Debug)]
pub struct SimStreams {
    streams: HashMap<StreamId, StreamState>,
    /// Streams held, waiting or with pending events since they were last synchronized: the
    /// only ones a device-wide synchronization has anything to do for. A replay of a trace with
    /// thousands of streams synchronizes the device at every segment it frees.
    active: HashSet<StreamId>,
    events: HashMap<EventId, EventState>,
    next_stream: StreamId,
    next_event: EventId,
}

impl Default for SimStreams {
    fn default() -> Self {
        let mut streams = HashMap::default();
        streams.insert(DEFAULT_STREAM, StreamState::default());
        SimStreams {
            streams,
            active: HashSet::default(),
            events: HashMap::default(),
            next_stream: DEFAULT_STREAM + 1,
            next_event: 1,
        }
    }
}

impl SimStreams {
    fn stream(&mut self, s: StreamId) -> Result<&mut StreamState, DeviceError> {
        self.streams.get_mut(&s).ok_or(DeviceError::InvalidStream(s))
    }

    fn event(&self, e: EventId) -> Result<EventState, DeviceError> {
        self.events.get(&e).copied().filter(|ev| !ev.destroyed).ok_or(DeviceError::InvalidEvent(e))
    }

    pub fn create_stream(&mut self) -> Result<StreamId, DeviceError> {
        let s = super::take_stream_id(&mut self.next_stream)?;
        self.streams.insert(s, StreamState::default());
        Ok(s)
    }

    pub fn destroy_stream(&mut self, s: StreamId) -> Result<(), DeviceError> {
        if s == DEFAULT_STREAM {
            return Err(DeviceError::InvalidStream(s));
        }
        self.synchronize_stream(s)?;
        self.streams.remove(&s);
        self.active.remove(&s);
        Ok(())
    }

    /// Whether work on `s` is outstanding: a hold, or a wait on an event not yet complete.
    fn busy(&mut self, s: StreamId) -> Result<bool, DeviceError> {
        let state = self.stream(s)?;
        if state.waits_on.is_empty() {
            return Ok(state.held);
        }
        let waits = std::mem::take(&mut state.waits_on);
        let pending: Vec<EventId> =
            waits.into_iter().filter(|e| self.events.get(e).is_some_and(|ev| !ev.completed)).collect();
        let state = self.stream(s)?;
        let busy = state.held || !pending.is_empty();
        state.waits_on = pending;
        Ok(busy)
    }

    pub fn hold_stream(&mut self, s: StreamId) -> Result<(), DeviceError> {
        self.stream(s)?.held = true;
        self.active.insert(s);
        Ok(())
    }

    /// Events recorded on an idle stream are complete from the start and never change, so
    /// they are not stored: their ids carry the `DONE` bit instead.
    pub fn record_event(&mut self, s: StreamId) -> Result<EventId, DeviceError> {
        let completed = !self.busy(s)?;
        let e = self.next_event;
        self.next_event += 1;
        if completed {
            return Ok(e | DONE);
        }
        self.events.insert(e, EventState { stream: s, completed, destroyed: false });
        self.stream(s)?.recorded.push(e);
        self.active.insert(s);
        Ok(e)
    }

    fn is_done(&self, e: EventId) -> bool {
        e & DONE != 0 && e & !DONE < self.next_event
    }

    pub fn query_event(&mut self, e: EventId) -> Result<bool, DeviceError> {
        if self.is_done(e) {
            return Ok(true);
        }
        Ok(self.event(e)?.completed)
    }

    /// Waiting for an event means waiting for its stream.
    pub fn synchronize_event(&mut self, e: EventId) -> Result<(), DeviceError> {
        if self.is_done(e) {
            return Ok(());
        }
        let ev = self.event(e)?;
        if !ev.completed {
            self.synchronize_stream(ev.stream)?;
        }
        Ok(())
    }

    /// As with CUDA, destroying an event that streams wait on does not cancel the wait.
    pub fn destroy_event(&mut self, e: EventId) -> Result<(), DeviceError> {
        if self.is_done(e) {
            return Ok(());
        }
        let ev = self.event(e)?;
        if ev.completed {
            self.events.remove(&e);
        } else if let Some(ev) = self.events.get_mut(&e) {
            ev.destroyed = true;
        }
        Ok(())
    }

    pub fn query_stream(&mut self, s: StreamId) -> Result<bool, DeviceError> {
        Ok(!self.busy(s)?)
    }

    /// Completes everything recorded on `s` (and what it waits on) and ends its hold.
    pub fn synchronize_stream(&mut self, s: StreamId) -> Result<(), DeviceError> {
        let state = self.stream(s)?;
        let (waits, recorded) = (std::mem::take(&mut state.waits_on), std::mem::take(&mut state.recorded));
        state.held = false;
        self.active.remove(&s);
        for e in waits {
            if let Some(ev) = self.events.get(&e).copied() {
                if !ev.completed && ev.stream != s {
                    self.synchronize_stream(ev.stream)?;
                }
            }
        }
        // Only events recorded while the stream was busy are stored, each listed once in
        // `recorded`: completing those completes every event of the stream. A destroyed one
        // was kept only for the streams waiting on it, which now need it no longer.
        for e in recorded {
            match self.events.get_mut(&e) {
                Some(ev) if ev.destroyed => {
                    self.events.remove(&e);
                }
                Some(ev) => ev.completed = true,
                None => {}
            }
        }
        Ok(())
    }

    /// Completes all work on every stream: what `cudaFree` does before returning memory.
    pub fn synchronize_all(&mut self) {
        let streams: Vec<StreamId> = self.active.iter().copied().collect();
        for s in streams {
            // Every id here exists, so this cannot fail.
            let _ = self.synchronize_stream(s);
        }
    }

    pub fn synchronize_device(&mut self) -> Result<(), DeviceError> {
        self.synchronize_all();
        Ok(())
    }

    pub fn stream_wait_event(&mut self, s: StreamId, e: EventId) -> Result<(), DeviceError> {
        let completed = self.is_done(e) || self.event(e)?.completed;
        let state = self.stream(s)?;
        if !completed {
            state.waits_on.push(e);
            self.active.insert(s);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_follow_holds_and_waits() {
        let mut st = SimStreams::default();
        let (a, b) = (st.create_stream().unwrap(), st.create_stream().unwrap());
        let idle = st.record_event(a).unwrap();
        assert!(st.query_event(idle).unwrap());
        st.hold_stream(a).unwrap();
        let busy = st.record_event(a).unwrap();
        assert!(!st.query_event(busy).unwrap() && !st.query_stream(a).unwrap());
        st.stream_wait_event(b, busy).unwrap();
        let after = st.record_event(b).unwrap();
        assert!(!st.query_event(after).unwrap(), "b waits for a");
        st.synchronize_stream(b).unwrap();
        assert!(st.query_event(busy).unwrap() && st.query_event(after).unwrap());
        assert!(st.query_stream(a).unwrap());
        assert_eq!(st.destroy_stream(DEFAULT_STREAM), Err(DeviceError::InvalidStream(0)));
        st.destroy_stream(a).unwrap();
        assert_eq!(st.record_event(a), Err(DeviceError::InvalidStream(a)));
        assert_eq!(st.query_event(999), Err(DeviceError::InvalidEvent(999)));
    }

    #[test]
    fn stream_ids_run_out_instead_of_wrapping_onto_live_streams() {
        let mut st = SimStreams { next_stream: crate::device::STREAM_IDS - 2, ..SimStreams::default() };
        let (a, b) = (st.create_stream().unwrap(), st.create_stream().unwrap());
        assert_eq!((a, b), (u32::MAX - 3, u32::MAX - 2));
        assert!(matches!(st.create_stream(), Err(DeviceError::Unsupported(_))));
        st.destroy_stream(a).unwrap();
        assert!(matches!(st.create_stream(), Err(DeviceError::Unsupported(_))), "ids are never reused");
        assert!(st.query_stream(b).unwrap() && st.query_stream(DEFAULT_STREAM).unwrap());
    }

    #[test]
    fn a_device_synchronization_completes_every_stream_and_keeps_no_event_it_need_not() {
        let mut st = SimStreams::default();
        let streams: Vec<StreamId> = (0..100).map(|_| st.create_stream().unwrap()).collect();
        let (a, b, c) = (streams[10], streams[50], streams[90]);
        st.hold_stream(a).unwrap();
        let destroyed = st.record_event(a).unwrap();
        let kept = st.record_event(a).unwrap();
        st.stream_wait_event(b, destroyed).unwrap();
        st.destroy_event(destroyed).unwrap();
        st.hold_stream(c).unwrap();
        let on_c = st.record_event(c).unwrap();
        st.hold_stream(streams[70]).unwrap();
        assert!(!st.query_stream(b).unwrap(), "b still waits on the destroyed event");
        assert_eq!(st.active.len(), 4);
        st.synchronize_all();
        assert!(streams.iter().all(|&s| st.query_stream(s).unwrap()));
        assert!(st.query_event(kept).unwrap() && st.query_event(on_c).unwrap());
        assert_eq!(st.query_event(destroyed), Err(DeviceError::InvalidEvent(destroyed)));
        // The two live events stay until destroyed; the destroyed one is gone.
        assert_eq!(st.events.len(), 2);
        st.destroy_event(kept).unwrap();
        st.destroy_event(on_c).unwrap();
        assert!(st.events.is_empty() && st.active.is_empty());
    }
}
