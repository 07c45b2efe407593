//! Seeding: a pool put into a state recorded elsewhere (the segments and live blocks a PyTorch
//! snapshot's history began with), so that a replay carries on from there.

use super::{Allocation, Pool, PoolError};
use crate::core::{PoolKind, SegmentId};
use crate::device::{Device, DeviceError, StreamId};

impl<D: Device> Pool<D> {
    /// Obtains a plain segment of exactly `size` bytes for `stream`, as if grown for it before
    /// the replay began (no device call is counted). Paged pools have no such segments.
    pub fn seed_segment(&mut self, size: u64, kind: PoolKind, stream: StreamId) -> Result<SegmentId, PoolError> {
        if self.expandable.is_some() {
            return Err(PoolError::Device(DeviceError::Unsupported("seeding segments of a paged pool")));
        }
        let address = self.device.allocate(size)?;
        Ok(self.heap.add_segment(address, size, kind, stream))
    }

    /// Allocates `requested` bytes at `offset` in seeded `segment` for `stream`, the block
    /// sized by the rules as an allocation would be. `None` when those bytes are not free.
    pub fn seed_block(
        &mut self,
        segment: SegmentId,
        offset: u64,
        requested: u64,
        stream: StreamId,
    ) -> Option<Allocation> {
        let rounded = self.heap.rules().round(requested);
        let address = self.heap.block_at(self.heap.segment_head(segment)).address + offset;
        let handle = self.heap.take_at(segment, address, requested, rounded, stream)?;
        Some(Allocation { handle, address, size: requested })
    }
}
