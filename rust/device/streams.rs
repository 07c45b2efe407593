//! Deterministic simulated streams and events for devices without real asynchrony (`host`, `sim`).
//!
//! A stream is idle unless `hold` marks it busy (as if kernels were queued on it). An event
//! recorded on an idle stream completes at once; one recorded on a held stream stays pending until
//! the stream is synchronized, which completes everything recorded on it and ends the hold. A
//! stream made to wait on a pending event is busy until that event completes.

use super::{DeviceError, EventId, StreamId, DEFAULT_STREAM};
use rustc_hash::FxHashMap as HashMap;

/// Marks the ids of events that completed when recorded.
const DONE: EventId = 1 << 63;

#[derive(Debug, Default)]
struct StreamState {
    held: bool,
    /// Pending events this stream was made to wait on.
    waits_on: Vec<EventId>,
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
    events: HashMap<EventId, EventState>,
    next_stream: StreamId,
    next_event: EventId,
}

impl Default for SimStreams {
    fn default() -> Self {
        let mut streams = HashMap::default();
        streams.insert(DEFAULT_STREAM, StreamState::default());
        SimStreams { streams, events: HashMap::default(), next_stream: DEFAULT_STREAM + 1, next_event: 1 }
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
        let s = self.next_stream;
        self.next_stream += 1;
        self.streams.insert(s, StreamState::default());
        Ok(s)
    }

    pub fn destroy_stream(&mut self, s: StreamId) -> Result<(), DeviceError> {
        if s == DEFAULT_STREAM {
            return Err(DeviceError::InvalidStream(s));
        }
        self.synchronize_stream(s)?;
        self.streams.remove(&s);
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
        let waits = std::mem::take(&mut self.stream(s)?.waits_on);
        self.stream(s)?.held = false;
        for e in waits {
            if let Some(ev) = self.events.get(&e).copied() {
                if !ev.completed && ev.stream != s {
                    self.synchronize_stream(ev.stream)?;
                }
            }
        }
        for ev in self.events.values_mut().filter(|ev| ev.stream == s) {
            ev.completed = true;
        }
        self.events.retain(|_, ev| !(ev.destroyed && ev.completed));
        Ok(())
    }

    /// Completes all work on every stream: what `cudaFree` does before returning memory.
    pub fn synchronize_all(&mut self) {
        let streams: Vec<StreamId> = self.streams.keys().copied().collect();
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
}
