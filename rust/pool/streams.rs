//! The pool's stream operations: creating and retiring streams, recording uses, synchronizing.

use super::{Pool, PoolError, Refused};
use crate::core::{Handle, Metric, StatType};
use crate::device::{Device, StreamId, DEFAULT_STREAM};

impl<D: Device> Pool<D> {
    pub fn create_stream(&mut self) -> Result<StreamId, PoolError> {
        Ok(self.device.create_stream()?)
    }

    /// Waits for `stream`, hands its cached blocks to every stream and its live allocations to
    /// the default stream (which always exists: their frees and copies need a stream), and
    /// destroys it. A stream imported from elsewhere that the pool keeps nothing for (no block,
    /// free or not, is its own or used on it) is not waited for: nothing here needs its work,
    /// and its owner may have destroyed it already.
    pub fn destroy_stream(&mut self, stream: StreamId) -> Result<(), PoolError> {
        let kept_for = self.heap.streams_in_use().contains(&stream) || self.deferred.lists_use_on(stream);
        if kept_for || !self.imported(stream) {
            self.refuse_stream_capture(stream)?;
            self.device.synchronize_stream(stream)?;
        }
        self.deferred.poll(&mut self.device, &mut self.heap, false)?;
        self.device.destroy_stream(stream)?;
        self.deferred.forget_stream(stream);
        self.heap.retire_stream(stream);
        self.heap.hand_over(stream, DEFAULT_STREAM);
        self.after_completions();
        Ok(())
    }

    /// Whether `stream` is a driver stream made elsewhere (`Device::import_stream`): one with a
    /// handle that the device did not create.
    fn imported(&self, stream: StreamId) -> bool {
        stream != DEFAULT_STREAM
            && self.device.stream_handle(stream).is_some()
            && !self.device.created_streams().contains(&stream)
    }

    /// Whether an allocation, or a free still waiting for work, belongs to `stream` or was used
    /// on it. O(blocks).
    pub fn holds_memory_for(&self, stream: StreamId) -> bool {
        self.heap.holds_for(stream) || self.deferred.lists_use_on(stream)
    }

    /// [`Pool::free`] for a block whose free failed because the events its uses need could not
    /// be recorded (a stream its owner destroyed since, a driver refusal): the device is waited
    /// for first, and then nothing can still use the block. As with `free`, an error changes
    /// nothing.
    pub fn free_synchronized(&mut self, handle: Handle) -> Result<(), PoolError> {
        // A capture's uses are not waited for by a synchronize: the free holds the block for it.
        if self.captures_graphs && self.used_by_capture(handle)? {
            return self.free(handle);
        }
        self.synchronize_device()?;
        self.heap.clear_uses(handle)?;
        self.deferred.forget_uses(handle.index);
        self.free(handle)
    }

    /// Simulated devices: marks `stream` busy until synchronized.
    pub fn hold_stream(&mut self, stream: StreamId) -> Result<(), PoolError> {
        Ok(self.device.hold_stream(stream)?)
    }

    /// Whether all work queued on `stream` has finished.
    pub fn query_stream(&mut self, stream: StreamId) -> Result<bool, PoolError> {
        self.refuse_stream_capture(stream)?;
        Ok(self.device.query_stream(stream)?)
    }

    /// Waits for `stream`, then returns whatever its completion made reusable.
    pub fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), PoolError> {
        self.refuse_stream_capture(stream)?;
        self.device.synchronize_stream(stream)?;
        self.deferred.poll(&mut self.device, &mut self.heap, false)?;
        self.after_completions();
        Ok(())
    }

    /// Refuses to query, wait for or destroy a capturing stream: the driver forbids the first two
    /// during a capture (and invalidates it), and destroying waits first.
    fn refuse_stream_capture(&mut self, stream: StreamId) -> Result<(), PoolError> {
        if self.captures_graphs {
            self.refuse_capture(stream, Refused::Wait)?;
        }
        Ok(())
    }

    /// Marks a live allocation as used on `stream` too: freeing it will wait for that stream.
    pub fn record_stream(&mut self, handle: Handle, stream: StreamId) -> Result<(), PoolError> {
        let owner = self.heap.block(handle)?.stream;
        // Validates the stream; a capturing stream must not be queried (it would break the capture).
        if !self.device.is_capturing(stream)? {
            self.device.query_stream(stream)?;
        }
        if stream != owner && !self.heap.mark_use(handle, stream)? {
            self.deferred.add_overflow_use(handle.index, stream);
        }
        Ok(())
    }

    /// Waits for all work on every stream of the device, as a device synchronize does: pending
    /// blocks become free and, unless cross-stream reuse is off, every stream's free blocks
    /// become shared.
    pub fn synchronize(&mut self) -> Result<(), PoolError> {
        // Also after a failure: the frees completed before it are done, and left to the
        // watermark's next free, `direct` would keep their memory reserved meanwhile.
        let completed = self.complete_all();
        self.after_completions();
        completed
    }

    /// [`Pool::synchronize`] without the release watermark, for callers that give back every
    /// idle segment next (and count what they gave back): the frees it completes, held ones
    /// and those held for a capture included, leave their segments idle for them.
    pub(super) fn complete_all(&mut self) -> Result<(), PoolError> {
        self.synchronize_device()?;
        self.settle_unreleased();
        self.settle_captured_frees()?;
        // Pending blocks first: completing them frees blocks that the fences must then cover.
        self.deferred.poll(&mut self.device, &mut self.heap, true)?;
        if self.config.cross_stream_reuse != super::CrossStreamReuse::Never {
            self.deferred.fence_streams(&mut self.device, &mut self.heap, None)?;
            self.deferred.poll(&mut self.device, &mut self.heap, true)?;
        }
        Ok(())
    }

    /// Bytes freed by users but still waiting on events (`active` minus `allocated`).
    pub fn pending_bytes(&self) -> u64 {
        let stat = |m| self.stats().get(m, StatType::All).current;
        stat(Metric::ActiveBytes) - stat(Metric::AllocatedBytes)
    }
}
