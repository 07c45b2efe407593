//! Blocks: pieces of a segment, stored in a slab and linked to their address neighbours by index.

/// Sentinel index: no neighbour / no bin link.
pub const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    Free,
    Allocated,
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
    pub stream: u32,
    /// Bumped on every free, so a stale [`Handle`] (a double free) is detected in O(1).
    pub generation: u32,
    pub state: BlockState,
}

impl Block {
    /// A block that shares its segment with others: a free one is "inactive split" memory.
    pub fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }

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
