//! Where a request goes: the one decision every allocation path asks for.
//!
//! [`Pool::place`] answers "which range, which block" for `rounded` bytes on a stream, and the
//! cached path, foreign-stream reuse, growth and the out-of-memory ladder all call it; they
//! differ only in the [`Search`] they pass: the pool kind the rules give the size (small or
//! large), then the best fit in that kind among the blocks the search looks at, or new memory.
//!
//! Nothing here changes the pool: taking the block, mapping its pages or reserving new memory is
//! the caller's.

use super::{Pool, StreamId};
use crate::core::{PoolKind, SHARED};
use crate::device::Device;

/// Which free blocks a placement looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Search {
    /// The stream's own, else shared ones: blocks it may use at once.
    Own,
    /// Other streams' (the request then waits for the owner): `cross_stream_reuse:wait`.
    Foreign,
    /// Own or shared, past the cap `max_split_size` puts on cached blocks, where they lie partly
    /// on unmapped pages: a range's free address space, mapped before a new range is reserved
    /// (PyTorch maps a request's pages from its range's unmapped remainder, whatever its size).
    Uncapped,
    /// Own or shared, whichever front needs the fewest new pages: the out-of-memory ladder's
    /// step for paged strategies.
    LeastMapping,
}

/// What [`Pool::place`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Placement {
    /// Free block `id`; `wait_for` names the stream that owns it when the request must wait for
    /// that stream first, and `mapped` says whether its pages for the request are all mapped
    /// (always, for plain segments).
    Block { id: u32, wait_for: Option<StreamId>, mapped: bool },
    /// No cached block: new memory of this kind (a segment, or a new range).
    New(PoolKind),
}

impl<D: Device> Pool<D> {
    /// Where `rounded` bytes on `stream` go, looking at the blocks `search` names.
    #[inline(always)]
    pub(super) fn place(&self, rounded: u64, stream: StreamId, search: Search) -> Placement {
        let kind = self.heap.rules().kind(rounded);
        match self.search(kind, rounded, stream, search) {
            Some((id, owner)) => Placement::Block {
                id,
                wait_for: (search == Search::Foreign).then_some(owner),
                mapped: self.is_mapped_for(id, rounded),
            },
            None => Placement::New(kind),
        }
    }

    /// The best-fitting free block of `kind` for `rounded` bytes among those `search` names,
    /// with its owner.
    #[inline(always)]
    fn search(&self, kind: PoolKind, rounded: u64, stream: StreamId, search: Search) -> Option<(u32, StreamId)> {
        let heap = &self.heap;
        match search {
            Search::Own => heap
                .find_in(kind, rounded, stream)
                .map(|id| (id, stream))
                .or_else(|| heap.find_in(kind, rounded, SHARED).map(|id| (id, SHARED))),
            Search::Foreign => heap.find_foreign_in(kind, rounded, stream),
            Search::Uncapped => {
                let (pages, cap) = (self.expandable.as_ref()?, heap.rules().max_block_for(rounded));
                [stream, SHARED].into_iter().find_map(|owner| {
                    let id = match heap.find_uncapped_in(kind, rounded, owner)? {
                        id if pages.may_grow_into(heap, id, cap) => id,
                        _ => pages.growth_fit(heap, rounded, cap, kind, owner)?,
                    };
                    Some((id, owner))
                })
            }
            Search::LeastMapping => {
                let pages = self.expandable.as_ref()?;
                let id = pages.least_mapping_fit(heap, rounded, kind, stream)?;
                Some((id, heap.block_at(id).stream))
            }
        }
    }

    /// Whether block `id`'s pages under its first `rounded` bytes are mapped (plain segments:
    /// always).
    #[inline(always)]
    fn is_mapped_for(&self, id: u32, rounded: u64) -> bool {
        self.expandable.as_ref().is_none_or(|pages| {
            let block = self.heap.block_at(id);
            pages.is_backed(self.heap.segment_of(id), block.address, rounded)
        })
    }
}
