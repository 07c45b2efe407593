//! CUDA graph capture. While a stream is being captured, work queued on it goes into a graph
//! instead of running: querying or synchronizing it, or waiting on an event recorded in it,
//! invalidates the capture, and a graph's replays write to the addresses it captured long after
//! the pool saw them freed. So the pool refuses to allocate on a capturing stream (with a clear
//! error, [`PoolError::Capturing`]), never records fences on one, and holds a block freed while
//! one of its streams captures (freed for its user, so no longer allocated, but active: neither
//! reused nor returned to the device) until that capture ends, as PyTorch does with frees
//! during capture. While any stream captures, no memory goes back to the device either (a
//! release may synchronize, which a capture forbids), the device is waited for stream by stream,
//! and copies to or from an allocation whose stream captures are refused.

use super::{Pool, PoolError, Refused};
use crate::core::{Handle, Heap, USE_OVERFLOW_BIT};
use crate::device::{Device, DeviceError, StreamId, DEFAULT_STREAM};

/// The streams [`Pool::capture_underway`] asks about, without the overflowed uses.
fn watched<D: Device>(device: &D, heap: &Heap) -> Vec<StreamId> {
    let mut streams = heap.streams_in_use();
    streams.extend(device.created_streams());
    streams.push(DEFAULT_STREAM);
    streams
}

/// Whether one of those is being captured, on a device that captures at all.
pub(super) fn any_capturing<D: Device>(device: &mut D, heap: &Heap) -> bool {
    device.captures_graphs() && watched(device, heap).into_iter().any(|s| device.is_capturing(s).unwrap_or(false))
}

impl<D: Device> Pool<D> {
    /// Refuses `what` for `stream` while it is being captured.
    pub(super) fn refuse_capture(&mut self, stream: StreamId, what: Refused) -> Result<(), PoolError> {
        if self.device.is_capturing(stream)? {
            return Err(PoolError::Capturing(stream, what));
        }
        Ok(())
    }

    /// Whether a stream whose work can touch the pool's memory is being captured: then nothing
    /// is given back. O(blocks), so only where memory would go back or the device be waited for.
    pub(super) fn capture_underway(&mut self) -> bool {
        self.captures_graphs && self.watched_streams().into_iter().any(|s| self.device.is_capturing(s).unwrap_or(false))
    }

    /// The default stream, the streams the device made, and every stream the pool holds
    /// blocks, uses or fences for. Other imported streams are left alone: their owner may have
    /// destroyed them.
    fn watched_streams(&self) -> Vec<StreamId> {
        let mut streams = watched(&self.device, &self.heap);
        streams.extend(self.deferred.overflow_streams());
        streams.sort_unstable();
        streams.dedup();
        streams
    }

    /// Waits for the device's work, as `Device::synchronize_device` does, unless a stream
    /// captures: synchronizing the context then is invalid in every capture mode, so each other
    /// watched stream is waited for instead.
    pub(super) fn synchronize_device(&mut self) -> Result<(), PoolError> {
        if !self.capture_underway() {
            return Ok(self.device.synchronize_device()?);
        }
        for stream in self.watched_streams() {
            match self.device.is_capturing(stream) {
                Ok(false) => match self.device.synchronize_stream(stream) {
                    // Destroyed since: it was waited for then.
                    Err(DeviceError::InvalidStream(_)) => {}
                    other => other?,
                },
                Ok(true) | Err(DeviceError::InvalidStream(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Whether block `id` (allocated, pending or held) is used by a capturing stream.
    pub(super) fn block_used_by_capture(&mut self, id: u32) -> bool {
        if !self.captures_graphs {
            return false;
        }
        let b = self.heap.block_at(id);
        let (owner, mut uses) = (b.stream, b.uses & !(1 << USE_OVERFLOW_BIT));
        let mut streams = vec![owner];
        while uses != 0 {
            streams.push(uses.trailing_zeros());
            uses &= uses - 1;
        }
        streams.into_iter().any(|s| self.device.is_capturing(s).unwrap_or(false))
    }

    /// Whether the allocation's stream, or a stream recorded as using it, is capturing.
    pub(super) fn used_by_capture(&mut self, handle: Handle) -> Result<bool, PoolError> {
        let block = self.heap.block(handle)?;
        let (owner, uses) = (block.stream, block.uses);
        self.capturing_among(owner, uses)
    }

    /// Whether `owner`, or a stream of the use mask `uses`, is capturing; an error where the
    /// device cannot tell for the owner.
    fn capturing_among(&mut self, owner: StreamId, uses: u32) -> Result<bool, PoolError> {
        let mut uses = uses & !(1 << USE_OVERFLOW_BIT);
        if self.device.is_capturing(owner)? {
            return Ok(true);
        }
        while uses != 0 {
            let stream = uses.trailing_zeros();
            uses &= uses - 1;
            if self.device.is_capturing(stream).unwrap_or(false) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Completes the frees held for captures that have ended since, without the release
    /// watermark (`empty_cache` counts the segments they leave idle as it gives them back);
    /// returns whether any block went back to the cache. Free unless some are held.
    pub(super) fn settle_captured_frees(&mut self) -> Result<bool, PoolError> {
        if self.held_for_capture.is_empty() {
            return Ok(false);
        }
        let mut cached = false;
        let mut held = std::mem::take(&mut self.held_for_capture).into_iter();
        while let Some(block) = held.next() {
            let id = block.id();
            let (owner, uses, segment) = {
                let b = self.heap.block_at(id);
                (b.stream, b.uses, b.segment)
            };
            // As `free` would have done: its other streams' uses wait for events recorded now.
            let waits = match self.capturing_among(owner, uses) {
                Ok(true) => {
                    self.held_for_capture.push(block);
                    continue;
                }
                Ok(false) => self.deferred.record_waits(&mut self.device, id, uses).map_err(PoolError::from),
                Err(e) => Err(e),
            };
            match waits {
                Ok(waits) => {
                    self.held -= 1;
                    cached |= self.wait_or_cache(id, segment, waits).is_some();
                }
                Err(e) => {
                    // Nothing changed: it and those after it stay held for a retry, rather than
                    // pending forever with no one to complete them.
                    self.held_for_capture.push(block);
                    self.held_for_capture.extend(held);
                    return Err(e);
                }
            }
        }
        Ok(cached)
    }

    /// Blocks freed during a capture and still held for it.
    pub fn held_for_capture(&self) -> usize {
        self.held_for_capture.len()
    }
}
