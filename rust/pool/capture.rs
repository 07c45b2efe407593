//! CUDA graph capture. While a stream is being captured, work queued on it goes into a graph
//! instead of running: querying or synchronizing it, or waiting on an event recorded in it,
//! invalidates the capture, and a graph's replays write to the addresses it captured long after
//! the pool saw them freed. So the pool refuses to allocate on a capturing stream (with a clear
//! error, [`PoolError::Capturing`]), never records fences on one, and holds a block freed while
//! one of its streams captures (neither reused nor returned to the device) until that capture
//! ends, as PyTorch does with frees during capture. While any stream captures, no memory goes
//! back to the device either (a release may synchronize, which a capture forbids), and copies
//! to or from an allocation whose stream captures are refused.

use super::{Pool, PoolError};
use crate::core::{Handle, USE_OVERFLOW_BIT};
use crate::device::{Device, StreamId};

impl<D: Device> Pool<D> {
    /// Refuses work for `stream` while it is being captured.
    pub(super) fn refuse_capture(&mut self, stream: StreamId) -> Result<(), PoolError> {
        if self.device.is_capturing(stream)? {
            return Err(PoolError::Capturing(stream));
        }
        Ok(())
    }

    /// Whether some stream of the device is being captured: then nothing is given back.
    pub(super) fn capture_underway(&mut self) -> bool {
        self.captures_graphs && self.device.capture_underway()
    }

    /// Whether the allocation's stream, or a stream recorded as using it, is capturing.
    pub(super) fn used_by_capture(&mut self, handle: Handle) -> Result<bool, PoolError> {
        let block = self.heap.block(handle)?;
        let (owner, mut uses) = (block.stream, block.uses & !(1 << USE_OVERFLOW_BIT));
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

    /// Completes the frees held for captures that have ended since. Free unless some are held.
    pub(super) fn settle_captured_frees(&mut self) -> Result<(), PoolError> {
        if self.held_for_capture.is_empty() {
            return Ok(());
        }
        for handle in std::mem::take(&mut self.held_for_capture) {
            self.free(handle)?;
        }
        Ok(())
    }

    /// Allocations freed during a capture and still held for it.
    pub fn held_for_capture(&self) -> usize {
        self.held_for_capture.len()
    }
}
