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
    /// sized by the rules as an allocation would be. `None` when those bytes are not free, or
    /// not on mapped pages of a paged range.
    pub fn seed_block(
        &mut self,
        segment: SegmentId,
        offset: u64,
        requested: u64,
        stream: StreamId,
    ) -> Option<Allocation> {
        let rounded = self.heap.rules().round(requested);
        let address = self.heap.block_at(self.heap.segment_head(segment)).address + offset;
        if self.expandable.as_ref().is_some_and(|pages| !pages.is_backed(segment, address, rounded)) {
            return None;
        }
        let handle = self.heap.take_at(segment, address, requested, rounded, stream)?;
        Some(Allocation { handle, address, size: requested })
    }

    /// The paged range of `kind`, reserved for at least `extent` bytes if there is none yet,
    /// for pages mapped before a replay began (see [`Pool::seed_pages`]). Plain pools have none.
    pub fn seed_range(&mut self, kind: PoolKind, stream: StreamId, extent: u64) -> Result<SegmentId, PoolError> {
        let pages = self
            .expandable
            .as_mut()
            .ok_or(PoolError::Device(DeviceError::Unsupported("seeding the pages of a pool with plain segments")))?;
        Ok(pages.seed_range(&mut self.device, &mut self.heap, kind, stream, extent)?)
    }

    /// Maps `size` bytes at `offset` of seeded range `segment` (whole pages), as if mapped
    /// before the replay began: no driver call is counted.
    pub fn seed_pages(&mut self, segment: SegmentId, offset: u64, size: u64) -> Result<(), PoolError> {
        let pages = self
            .expandable
            .as_mut()
            .ok_or(PoolError::Device(DeviceError::Unsupported("seeding the pages of a pool with plain segments")))?;
        Ok(pages.seed_pages(&mut self.device, &mut self.heap, segment, offset, size)?)
    }

    /// Whether the pool maps pages of ranges rather than holding plain segments.
    pub fn is_paged(&self) -> bool {
        self.expandable.is_some()
    }
}
