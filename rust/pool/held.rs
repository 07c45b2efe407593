//! Held frees: blocks their users freed while exports of their bytes (array views, DLPack
//! capsules) are still alive, or while a stream they use is captured into a CUDA graph.
//!
//! Such a free ends the allocation at once (the block stops counting as allocated, a second free
//! is a double free) but keeps the bytes where they are: the block stays pending, active and
//! neither reused nor unmapped, like a free waiting on another stream's work, until whoever
//! counted the exports releases it. Only then does the usual free path run (events for other
//! streams' uses, the cache, the release watermark); a release the device fails is completed
//! by the next synchronize.

use super::{Pool, PoolError};
use crate::core::Handle;
use crate::device::{Device, StreamId};

/// A freed block whose bytes are still referenced. Not `Clone`: it is released exactly once.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a held block stays pending until released"]
pub struct HeldBlock {
    id: u32,
}

impl HeldBlock {
    /// The heap's id of the block.
    pub(super) fn id(&self) -> u32 {
        self.id
    }
}

impl<D: Device> Pool<D> {
    /// Frees `handle` for its user while keeping its bytes: pass the result to
    /// [`Pool::release_held`] once nothing references them. An error means nothing changed.
    pub fn free_held(&mut self, handle: Handle) -> Result<HeldBlock, PoolError> {
        self.heap.block(handle)?;
        self.note_free(handle, true);
        let id = self.heap.hold(handle)?;
        self.held += 1;
        Ok(HeldBlock { id })
    }

    /// The last reference to a held block's bytes is gone: it is freed as [`Pool::free`] would,
    /// waiting for other streams that used it. If the device refuses to record those waits, the
    /// whole device is synchronized instead (nothing can then still use the block); if it refuses
    /// that too (or panics), the block stays held and the error is returned, and the next
    /// [`Pool::synchronize`] (which `empty_cache` and the out-of-memory ladder call) releases it.
    pub fn release_held(&mut self, block: HeldBlock) -> Result<(), PoolError> {
        let id = block.id;
        // Queued first, so that neither a refusal nor a panic below loses the block.
        self.unreleased.push(block);
        // A capture must not be queried or waited for: the block waits for a synchronize after
        // the capture ends, like the frees held for a capture.
        if self.block_used_by_capture(id) {
            return Ok(());
        }
        let (uses, segment) = {
            let b = self.heap.block_at(id);
            (b.uses, b.segment)
        };
        let waits = match self.deferred.record_waits(&mut self.device, id, uses) {
            Ok(waits) => waits,
            Err(_) => {
                self.synchronize_device()?;
                Vec::new()
            }
        };
        self.unreleased.pop();
        self.held -= 1;
        if let Some(segment) = self.wait_or_cache(id, segment, waits) {
            self.after_free(segment);
        }
        Ok(())
    }

    /// Releases the held blocks whose release failed or waited for a capture; the device has
    /// just synchronized every stream but capturing ones, so nothing else uses them. One at a
    /// time: a panic in one's release leaves the rest queued. Without the release watermark, as
    /// [`Pool::settle_captured_frees`].
    pub(super) fn settle_unreleased(&mut self) {
        let mut captured = Vec::new();
        while let Some(block) = self.unreleased.pop() {
            if self.block_used_by_capture(block.id) {
                captured.push(block);
                continue;
            }
            let segment = self.heap.block_at(block.id).segment;
            self.held -= 1;
            let _cached = self.wait_or_cache(block.id, segment, Vec::new());
        }
        self.unreleased = captured;
    }

    /// The stream a held block's bytes are ordered on (its allocation's, or the default stream
    /// once that one was destroyed).
    pub fn held_stream(&self, block: &HeldBlock) -> StreamId {
        self.heap.block_at(block.id).stream
    }

    /// How many freed blocks are held for their exports, for a capture, or until the next
    /// synchronize.
    pub fn held_blocks(&self) -> usize {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{Metric, StatType};
    use crate::device::Sim;
    use crate::pool::Config;

    fn current(pool: &Pool<Sim>, metric: Metric) -> u64 {
        pool.stats().get(metric, StatType::All).current
    }

    #[test]
    fn a_held_block_is_active_not_allocated_and_not_reused_until_released() {
        for strategy in ["default", "pytorch", "expandable", "bfc"] {
            let mut pool = Pool::new(Sim::new(1 << 30), Config::parse(&format!("strategy:{strategy}")).unwrap());
            let a = pool.alloc(4 << 20).unwrap();
            let block = pool.free_held(a.handle).unwrap();
            assert_eq!(current(&pool, Metric::AllocatedBytes), 0, "{strategy}");
            assert!(current(&pool, Metric::ActiveBytes) >= 4 << 20, "{strategy}");
            assert!(pool.free(a.handle).is_err(), "{strategy}: a second free is a double free");
            pool.check_invariants().unwrap();
            let b = pool.alloc(4 << 20).unwrap();
            assert_ne!(b.address, a.address, "{strategy}: held bytes were handed out again");
            pool.empty_cache().unwrap();
            pool.check_invariants().unwrap();
            assert!(current(&pool, Metric::ReservedBytes) >= 8 << 20, "{strategy}: held bytes were given back");
            pool.release_held(block).unwrap();
            assert_eq!(current(&pool, Metric::ActiveBytes), current(&pool, Metric::AllocatedBytes));
            pool.check_invariants().unwrap();
            pool.free(b.handle).unwrap();
            let c = pool.alloc(4 << 20).unwrap();
            assert!(c.address == a.address || c.address == b.address, "{strategy}: the cache is reused");
        }
    }

    #[test]
    fn a_held_block_used_on_a_busy_stream_waits_for_it_after_release() {
        let mut pool = Pool::new(Sim::new(1 << 30), Config::parse("strategy:pytorch").unwrap());
        let side = pool.create_stream().unwrap();
        let a = pool.alloc(1 << 20).unwrap();
        pool.record_stream(a.handle, side).unwrap();
        pool.hold_stream(side).unwrap();
        let block = pool.free_held(a.handle).unwrap();
        pool.release_held(block).unwrap();
        assert_eq!(pool.pending_bytes(), 1 << 20, "still waiting for the side stream");
        pool.check_invariants().unwrap();
        pool.synchronize().unwrap();
        assert_eq!(pool.pending_bytes(), 0);
        pool.check_invariants().unwrap();
    }
}
