//! Deferred frees and fences: the events that decide when freed memory may be reused.
//!
//! Two kinds of waiting, both polled cheaply (one branch when nothing waits):
//! - a block with uses recorded on other streams is *pending* until an event recorded on each
//!   of those streams at free time completes;
//! - a stream's freed blocks become shared (usable by every stream) when a *fence*, one event
//!   recorded on that stream covering every block it freed before, completes. Fences are recorded
//!   lazily, only when another stream finds nothing in its own bins.
//!
//! Events on one stream complete in order, so each queue is checked from its front and the
//! first pending event stops the scan, as PyTorch does.

use crate::core::{Heap, USE_OVERFLOW_BIT};
use crate::device::{Device, DeviceError, EventId, StreamId};
use rustc_hash::FxHashMap as HashMap;
use std::collections::VecDeque;

#[derive(Debug, Default)]
pub struct Deferred {
    /// Per stream: events recorded for pending blocks, with the block's slab index.
    pending: HashMap<StreamId, VecDeque<(EventId, u32)>>,
    /// Events still outstanding per pending block.
    remaining: HashMap<u32, u32>,
    /// Per stream: fence events with the epoch each covers.
    fences: HashMap<StreamId, VecDeque<(EventId, u32)>>,
    /// Uses by streams too high for a block's own use mask, by slab index.
    overflow_uses: HashMap<u32, Vec<StreamId>>,
    /// Events not yet completed in `pending` and `fences`; zero makes polling free.
    outstanding: usize,
}

impl Deferred {
    pub fn is_idle(&self) -> bool {
        self.outstanding == 0
    }

    pub fn add_overflow_use(&mut self, block: u32, stream: StreamId) {
        let others = self.overflow_uses.entry(block).or_default();
        if !others.contains(&stream) {
            others.push(stream);
        }
    }

    /// For block `block` about to be freed while other streams (`uses`, its use mask) use it:
    /// records an event on each of them and returns the ones still pending, for
    /// [`Deferred::attach`]. Nothing changes if the device refuses an event, so the free can be
    /// retried.
    /// Whether a block's overflowed use list names `stream`.
    pub fn lists_use_on(&self, stream: StreamId) -> bool {
        self.overflow_uses.values().any(|streams| streams.contains(&stream))
    }

    /// The streams listed for blocks whose use masks overflowed.
    pub fn overflow_streams(&self) -> impl Iterator<Item = StreamId> + '_ {
        self.overflow_uses.values().flatten().copied()
    }

    pub fn record_waits<D: Device>(
        &mut self,
        device: &mut D,
        block: u32,
        uses: u32,
    ) -> Result<Vec<(StreamId, EventId)>, DeviceError> {
        let mut mask = uses & !(1 << USE_OVERFLOW_BIT);
        let others = if uses & (1 << USE_OVERFLOW_BIT) != 0 {
            self.overflow_uses.get(&block).cloned().unwrap_or_default()
        } else {
            Vec::new()
        };
        let low = std::iter::from_fn(|| {
            let s = (mask != 0).then(|| mask.trailing_zeros())?;
            mask &= mask - 1;
            Some(s)
        });
        let mut waits = Vec::new();
        for stream in low.chain(others) {
            let recorded = match device.record_event(stream) {
                // Work on an idle stream is already done: nothing to wait for.
                Ok(event) => match device.query_event(event) {
                    Ok(true) => device.destroy_event(event),
                    Ok(false) => {
                        waits.push((stream, event));
                        Ok(())
                    }
                    Err(e) => Err(e).inspect_err(|_| _ = device.destroy_event(event)),
                },
                // A destroyed stream was synchronized first: nothing of it can still run.
                Err(DeviceError::InvalidStream(_)) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = recorded {
                for (_, event) in waits {
                    // Best effort: the events were never attached to anything.
                    let _ = device.destroy_event(event);
                }
                return Err(e);
            }
        }
        Ok(waits)
    }

    /// Makes pending block `block` wait for `waits` (from [`Deferred::record_waits`], not empty).
    pub fn attach(&mut self, block: u32, waits: Vec<(StreamId, EventId)>) {
        debug_assert!(!waits.is_empty());
        self.overflow_uses.remove(&block);
        self.remaining.insert(block, waits.len() as u32);
        self.outstanding += waits.len();
        for (stream, event) in waits {
            self.pending.entry(stream).or_default().push_back((event, block));
        }
    }

    /// Forgets the extra uses of a block that needs no waiting after all.
    pub fn forget_uses(&mut self, block: u32) {
        self.overflow_uses.remove(&block);
    }

    /// Records a fence on every stream (but `except`) that freed blocks since its last fence.
    /// Returns whether a destroyed stream's blocks were shared instead.
    pub fn fence_streams<D: Device>(
        &mut self,
        device: &mut D,
        heap: &mut Heap,
        except: Option<StreamId>,
    ) -> Result<bool, DeviceError> {
        let mut retired = false;
        let streams: Vec<StreamId> = heap.unfenced_streams().filter(|&s| Some(s) != except).collect();
        for stream in streams {
            // An event recorded in a capture would be a graph node, never completed here.
            if device.is_capturing(stream).unwrap_or(false) {
                continue;
            }
            let Some(epoch) = heap.fence(stream) else { continue };
            match device.record_event(stream) {
                Ok(event) => {
                    self.fences.entry(stream).or_default().push_back((event, epoch));
                    self.outstanding += 1;
                }
                Err(DeviceError::InvalidStream(_)) => {
                    heap.retire_stream(stream);
                    retired = true;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(retired)
    }

    /// Completes whatever finished: pending blocks become free, fenced blocks shared. With
    /// `wait`, blocks until everything outstanding has finished. Returns whether anything did.
    pub fn poll<D: Device>(&mut self, device: &mut D, heap: &mut Heap, wait: bool) -> Result<bool, DeviceError> {
        if self.outstanding == 0 {
            return Ok(false);
        }
        let before = self.outstanding;
        for queue in self.pending.values_mut() {
            while let Some(&(event, block)) = queue.front() {
                if !Self::finished(device, event, wait)? {
                    break;
                }
                queue.pop_front();
                self.outstanding -= 1;
                let left = self.remaining.get_mut(&block).expect("pending block without a count");
                *left -= 1;
                if *left == 0 {
                    self.remaining.remove(&block);
                    heap.complete_pending(block);
                }
            }
        }
        for (&stream, queue) in self.fences.iter_mut() {
            while let Some(&(event, epoch)) = queue.front() {
                if !Self::finished(device, event, wait)? {
                    break;
                }
                queue.pop_front();
                self.outstanding -= 1;
                heap.promote(stream, epoch);
            }
        }
        Ok(self.outstanding != before)
    }

    /// Whether `event` has completed (waiting for it if asked); completed events are destroyed.
    fn finished<D: Device>(device: &mut D, event: EventId, wait: bool) -> Result<bool, DeviceError> {
        if wait {
            device.synchronize_event(event)?;
        } else if !device.query_event(event)? {
            return Ok(false);
        }
        device.destroy_event(event)?;
        Ok(true)
    }

    /// Drops the queues of destroyed stream `stream` (synchronized, so they are empty), and its
    /// uses of live blocks (no free need wait for it): stream ids are never reused, and polling
    /// walks every queue.
    pub fn forget_stream(&mut self, stream: StreamId) {
        for queues in [&mut self.pending, &mut self.fences] {
            if queues.get(&stream).is_some_and(VecDeque::is_empty) {
                queues.remove(&stream);
            }
        }
        self.overflow_uses.retain(|_, streams| {
            streams.retain(|&s| s != stream);
            !streams.is_empty()
        });
    }

    /// How many blocks wait on events, for cross-checking the heap.
    pub fn pending_blocks(&self) -> usize {
        self.remaining.len()
    }
}

#[cfg(test)]
mod tests {
    use crate::device::Sim;
    use crate::pool::{Config, Pool, DEFAULT_STREAM};

    /// A destroyed stream leaves no queues behind, whether its blocks waited on events
    /// (pending frees) or on fences.
    #[test]
    fn destroyed_streams_leave_no_queues() {
        let mut pool = Pool::new(Sim::new(1 << 30), Config::default());
        for _ in 0..100 {
            let side = pool.create_stream().unwrap();
            let a = pool.alloc_on(512, side).unwrap();
            let b = pool.alloc_on(512, DEFAULT_STREAM).unwrap();
            pool.record_stream(b.handle, side).unwrap();
            pool.hold_stream(side).unwrap();
            pool.free(a.handle).unwrap();
            pool.free(b.handle).unwrap();
            pool.synchronize().unwrap();
            pool.destroy_stream(side).unwrap();
            pool.check_invariants().unwrap();
            let queued: Vec<_> = pool.deferred.pending.keys().chain(pool.deferred.fences.keys()).collect();
            assert!(queued.iter().all(|&&s| s == DEFAULT_STREAM), "queues of destroyed streams: {queued:?}");
        }
    }

    /// A long-lived block used on many short-lived streams lists only the live ones among its
    /// uses beyond its use mask.
    #[test]
    fn destroyed_streams_leave_no_uses() {
        let mut pool = Pool::new(Sim::new(1 << 30), Config::default());
        let low: Vec<_> = (0..40).map(|_| pool.create_stream().unwrap()).collect();
        let a = pool.alloc_on(512, DEFAULT_STREAM).unwrap();
        for _ in 0..100 {
            let side = pool.create_stream().unwrap();
            pool.record_stream(a.handle, side).unwrap();
            pool.destroy_stream(side).unwrap();
            let listed: Vec<_> = pool.deferred.overflow_streams().collect();
            assert!(listed.is_empty(), "uses by destroyed streams: {listed:?}");
        }
        pool.record_stream(a.handle, low[39]).unwrap();
        assert_eq!(pool.deferred.overflow_streams().collect::<Vec<_>>(), [low[39]]);
        pool.free(a.handle).unwrap();
        pool.check_invariants().unwrap();
    }
}
