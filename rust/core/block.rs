//! Blocks: pieces of a segment, stored in a slab and linked to their address neighbours by index.

use super::rules::PoolKind;

/// Sentinel index: no neighbour / no bin link.
pub const NIL: u32 = u32::MAX;

/// In [`Block::uses`], the bit that stands for every stream from this one up.
pub const USE_OVERFLOW_BIT: u32 = 31;

/// The owner of free blocks that any stream may take (see [`Block::stream`]).
pub const SHARED: u32 = u32::MAX - 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    Free,
    Allocated,
    /// Freed by its user but still possibly in use by device work on other streams: not
    /// reusable, counted as active.
    Pending,
}

/// One piece of a segment. `prev`/`next` are its address neighbours inside the same segment
/// (never across segments), `bin_prev`/`bin_next` its links in a free-block bin list.
#[derive(Clone, Debug)]
pub struct Block {
    pub address: u64,
    pub size: u64,
    /// Bytes the user asked for (0 while free).
    pub requested: u64,
    pub segment: u32,
    pub prev: u32,
    pub next: u32,
    pub bin_prev: u32,
    pub bin_next: u32,
    /// Allocated or pending: the stream it was allocated on. Free: its owner, the stream that
    /// may reuse it at once (stream order protects it), or [`SHARED`] once no stream's queued
    /// work can touch it.
    pub stream: u32,
    /// Free and owned by a stream: that stream's fence epoch when it was freed; a completed
    /// fence of a later or equal epoch makes it [`SHARED`].
    pub epoch: u32,
    pub kind: PoolKind,
    /// Other streams that recorded a use of this allocated block (`record_stream`): bit `s` for
    /// stream `s` < 31, bit 31 for any higher stream (the pool lists those). Kept in the block so
    /// that a free with uses needs no lookup.
    pub uses: u32,
    /// Lives in an expandable segment (an address range mapped page by page).
    pub expandable: bool,
    /// Bumped on every free, so a stale [`Handle`] (a double free) is detected in O(1).
    pub generation: u32,
    pub state: BlockState,
}

impl Block {
    /// A block that shares its segment with others: a free one is "inactive split" memory.
    #[inline]
    pub fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }

    /// Free memory `empty_cache` cannot return: a free piece of a partly used segment. Free
    /// space in expandable segments is not counted: its pages can always be unmapped.
    #[inline]
    pub fn is_inactive_split(&self) -> bool {
        !self.expandable && self.state == BlockState::Free && self.is_split()
    }

    #[inline]
    pub fn has_uses(&self) -> bool {
        self.uses != 0
    }

    #[inline]
    pub fn end(&self) -> u64 {
        self.address + self.size
    }
}

/// What a caller holds for an allocated block: the slab index plus the generation it was
/// allocated at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle {
    pub index: u32,
    pub generation: u32,
}
