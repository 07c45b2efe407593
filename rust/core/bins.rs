//! Bins: a two-level segregated-fit (TLSF) index of free blocks.
//!
//! ```text
//!  first level: one bit per power of two        fl_bitmap  0b0..0101100
//!                                                               │ │
//!  second level: 32 bit per power of two,        sl_bitmap[fl] 0b0..1001  (sub-ranges of 1/32)
//!  one intrusive list of free blocks per bit                    │   │
//!                                                heads[bin] -> block -> block -> ...
//! ```
//! Sizes below 8 KiB map linearly (one bin per 256 B); above, each power of two splits into 32
//! bins, so a bin spans at most 1/32 (3%) of its sizes. Finding a fitting block looks at the
//! request's own bin, then jumps with two `trailing_zeros` to the next non-empty bin, whose every
//! block fits: O(1), never a walk over the free blocks. Inside a bin a few entries are compared
//! so that the smallest block of the bin usually wins, as in best fit. Ties go to the lowest slab
//! index, not the lowest address: the choice, and so a replay's figures, must not depend on where
//! a device happens to place its segments (`host` and `sim` must agree).

use super::block::{Block, NIL};

const GRANULE_LOG2: u32 = 8;
const SL_LOG2: u32 = 5;
const SL_COUNT: usize = 1 << SL_LOG2;
const LINEAR_LOG2: u32 = GRANULE_LOG2 + SL_LOG2;
const FL_COUNT: usize = (64 - LINEAR_LOG2 + 1) as usize;
pub const BIN_COUNT: usize = FL_COUNT * SL_COUNT;
/// How many entries of a bin are compared to pick the best-fitting one.
const SCAN_LIMIT: usize = 8;

/// Index of the bin holding free blocks of `size` bytes.
///
/// Without a branch: with `log2` at least `LINEAR_LOG2`, `size >> (log2 - SL_LOG2)` is the
/// second-level index plus `SL_COUNT` above the linear range and the granule below it, and each
/// power of two above adds `SL_COUNT` bins.
#[inline(always)]
pub fn bin_index(size: u64) -> usize {
    let log2 = (63 - (size | 1).leading_zeros()).max(LINEAR_LOG2);
    ((size >> (log2 - SL_LOG2)) as usize) + (((log2 - LINEAR_LOG2) as usize) << SL_LOG2)
}

/// The free blocks of one (stream, pool kind), by size class.
#[derive(Clone, Debug)]
pub struct Bins {
    fl_bitmap: u64,
    sl_bitmap: [u32; FL_COUNT],
    /// Empty until the first insert: a pool keeps bins per stream, and a trace may name
    /// hundreds of thousands of streams that never free a block.
    heads: Box<[u32]>,
    len: usize,
}

impl Default for Bins {
    fn default() -> Self {
        Bins { fl_bitmap: 0, sl_bitmap: [0; FL_COUNT], heads: Box::default(), len: 0 }
    }
}

impl Bins {
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first block of `bin`, NIL when it is empty.
    #[inline(always)]
    fn head(&self, bin: usize) -> u32 {
        self.heads.get(bin).copied().unwrap_or(NIL)
    }

    /// Pushes free block `id` onto the front of its bin (recently freed memory is warm).
    #[inline(always)]
    pub fn insert(&mut self, blocks: &mut [Block], id: u32) {
        if self.heads.is_empty() {
            self.heads = vec![NIL; BIN_COUNT].into_boxed_slice();
        }
        let bin = bin_index(blocks[id as usize].size);
        let head = self.heads[bin];
        blocks[id as usize].bin_prev = NIL;
        blocks[id as usize].bin_next = head;
        if head != NIL {
            blocks[head as usize].bin_prev = id;
        }
        self.heads[bin] = id;
        self.fl_bitmap |= 1 << (bin / SL_COUNT);
        self.sl_bitmap[bin / SL_COUNT] |= 1 << (bin % SL_COUNT);
        self.len += 1;
    }

    /// Unlinks free block `id`; it must be in this structure.
    #[inline(always)]
    pub fn remove(&mut self, blocks: &mut [Block], id: u32) {
        let (prev, next, size) = {
            let b = &blocks[id as usize];
            (b.bin_prev, b.bin_next, b.size)
        };
        if next != NIL {
            blocks[next as usize].bin_prev = prev;
        }
        if prev != NIL {
            blocks[prev as usize].bin_next = next;
        } else {
            let bin = bin_index(size);
            self.heads[bin] = next;
            if next == NIL {
                let fl = bin / SL_COUNT;
                self.sl_bitmap[fl] &= !(1 << (bin % SL_COUNT));
                if self.sl_bitmap[fl] == 0 {
                    self.fl_bitmap &= !(1 << fl);
                }
            }
        }
        blocks[id as usize].bin_prev = NIL;
        blocks[id as usize].bin_next = NIL;
        self.len -= 1;
    }

    /// Puts block `new` in place of `old`, the first block of `bin`, which leaves the bin as
    /// removing `old` and inserting `new` would (both must be of the bin's sizes).
    #[inline(always)]
    pub fn replace_first(&mut self, blocks: &mut [Block], bin: usize, old: u32, new: u32) {
        debug_assert_eq!(self.heads[bin], old);
        let next = blocks[old as usize].bin_next;
        if next != NIL {
            blocks[next as usize].bin_prev = new;
        }
        blocks[new as usize].bin_prev = NIL;
        blocks[new as usize].bin_next = next;
        blocks[old as usize].bin_next = NIL;
        self.heads[bin] = new;
    }

    /// A free block of at least `size` bytes and at most `max_size`, close to the smallest such.
    #[inline(always)]
    pub fn find(&self, blocks: &[Block], size: u64, max_size: u64) -> Option<u32> {
        let own = bin_index(size);
        if let Some(id) = self.best_in_bin(blocks, own, size) {
            return Some(id).filter(|&id| blocks[id as usize].size <= max_size);
        }
        let bin = self.next_non_empty_bin(own + 1)?;
        let id = self.best_in_bin(blocks, bin, size)?;
        Some(id).filter(|&id| blocks[id as usize].size <= max_size)
    }

    /// The first non-empty bin at index `from` or above.
    #[inline(always)]
    fn next_non_empty_bin(&self, from: usize) -> Option<usize> {
        if from >= BIN_COUNT {
            return None;
        }
        let fl = from / SL_COUNT;
        let sl_map = self.sl_bitmap[fl] & (u32::MAX << (from % SL_COUNT));
        if sl_map != 0 {
            return Some(fl * SL_COUNT + sl_map.trailing_zeros() as usize);
        }
        let fl_map = self.fl_bitmap & u64::MAX.checked_shl(fl as u32 + 1).unwrap_or(0);
        if fl_map == 0 {
            return None;
        }
        let fl = fl_map.trailing_zeros() as usize;
        Some(fl * SL_COUNT + self.sl_bitmap[fl].trailing_zeros() as usize)
    }

    #[inline(always)]
    fn best_in_bin(&self, blocks: &[Block], bin: usize, size: u64) -> Option<u32> {
        // Among equal sizes the lowest address, as PyTorch's (size, address) order: a choice
        // that depends on where blocks lie, not on the order the slab handed out its slots.
        let mut best: Option<(u64, u64, u32)> = None;
        let mut id = self.head(bin);
        for _ in 0..SCAN_LIMIT {
            if id == NIL {
                break;
            }
            let b = &blocks[id as usize];
            if b.size >= size && best.is_none_or(|(s, a, _)| (b.size, b.address) < (s, a)) {
                best = Some((b.size, b.address, id));
            }
            id = b.bin_next;
        }
        best.map(|(_, _, id)| id)
    }

    /// Every free block held here, found through the bitmaps (cost grows with the blocks held,
    /// not with the number of bins).
    pub fn members(&self, blocks: &[Block]) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        let mut bin = self.next_non_empty_bin(0);
        while let Some(b) = bin {
            let mut cur = self.head(b);
            while cur != NIL {
                out.push(cur);
                cur = blocks[cur as usize].bin_next;
            }
            bin = self.next_non_empty_bin(b + 1);
        }
        out
    }

    /// Every block in every bin, with the bin it is linked in; and whether the bitmaps agree
    /// with the lists.
    pub fn check(&self, blocks: &[Block]) -> Result<Vec<u32>, String> {
        let mut all = Vec::with_capacity(self.len);
        for bin in 0..BIN_COUNT {
            let (fl, sl) = (bin / SL_COUNT, bin % SL_COUNT);
            let bit_set = self.sl_bitmap[fl] & (1 << sl) != 0;
            let mut cur = self.head(bin);
            if bit_set != (cur != NIL) {
                return Err(format!("bin {bin}: bitmap says non-empty={bit_set}"));
            }
            let mut prev = NIL;
            while cur != NIL {
                let b = &blocks[cur as usize];
                if bin_index(b.size) != bin {
                    return Err(format!("block {cur} of size {} sits in bin {bin}", b.size));
                }
                if b.bin_prev != prev {
                    return Err(format!("block {cur}: broken back link in bin {bin}"));
                }
                all.push(cur);
                if all.len() > self.len {
                    return Err(format!("bins hold more than their count {}", self.len));
                }
                prev = cur;
                cur = b.bin_next;
            }
            if (self.fl_bitmap & (1 << fl) != 0) != (self.sl_bitmap[fl] != 0) {
                return Err(format!("first-level bitmap disagrees at {fl}"));
            }
        }
        if all.len() != self.len {
            return Err(format!("bins count {} but hold {}", self.len, all.len()));
        }
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::block::BlockState;

    fn block(address: u64, size: u64) -> Block {
        Block {
            address,
            size,
            requested: 0,
            segment: 0,
            prev: NIL,
            next: NIL,
            bin_prev: NIL,
            bin_next: NIL,
            stream: 0,
            epoch: 0,
            kind: crate::core::PoolKind::Small,
            uses: 0,
            expandable: false,
            generation: 0,
            state: BlockState::Free,
        }
    }

    /// The two-level mapping written out with a branch, as TLSF describes it.
    fn two_level(size: u64) -> usize {
        if size < (1 << LINEAR_LOG2) {
            (size >> GRANULE_LOG2) as usize
        } else {
            let log2 = 63 - size.leading_zeros();
            let sl = (size >> (log2 - SL_LOG2)) as usize & (SL_COUNT - 1);
            (log2 - LINEAR_LOG2 + 1) as usize * SL_COUNT + sl
        }
    }

    #[test]
    fn branchless_index_is_the_two_level_mapping() {
        let mut sizes: Vec<u64> = (0..70_000).chain([u64::MAX, u64::MAX - 1, 1 << 63]).collect();
        for log2 in 0..64 {
            let p = 1u64 << log2;
            sizes.extend([p - 1, p, p + 1, p | (p >> 1), p | (p >> 6)]);
        }
        for size in sizes {
            assert_eq!(bin_index(size), two_level(size), "size {size}");
        }
    }

    #[test]
    fn mapping_is_monotonic_and_tight() {
        let sizes: Vec<u64> = (256..65536).chain((65536..1u64 << 40).step_by(1 << 20)).collect();
        for pair in sizes.windows(2) {
            assert!(bin_index(pair[0]) <= bin_index(pair[1]));
        }
        for &size in &sizes[1..] {
            // Bins are at most 1/32 of their size wide.
            let bin = bin_index(size);
            assert_eq!(bin_index(size + size / 64), bin.max(bin_index(size + size / 64)));
        }
        assert_eq!(bin_index(256), 1);
        assert_eq!(bin_index(8191), 31);
        assert_eq!(bin_index(8192), 32);
        assert!(bin_index(u64::MAX) < BIN_COUNT);
    }

    #[test]
    fn finds_best_fit_and_respects_bounds() {
        let mut blocks = vec![block(0, 4096), block(10_000, 1 << 20), block(1 << 30, 3 << 20)];
        let mut bins = Bins::default();
        for id in 0..3 {
            bins.insert(&mut blocks, id);
        }
        assert_eq!(bins.find(&blocks, 512, u64::MAX), Some(0));
        assert_eq!(bins.find(&blocks, 5000, u64::MAX), Some(1));
        assert_eq!(bins.find(&blocks, 2 << 20, u64::MAX), Some(2));
        assert_eq!(bins.find(&blocks, 4 << 20, u64::MAX), None);
        assert_eq!(bins.find(&blocks, 2 << 20, 2 << 20), None);
        bins.remove(&mut blocks, 1);
        assert_eq!(bins.find(&blocks, 5000, u64::MAX), Some(2));
        assert_eq!(bins.check(&blocks).unwrap().len(), 2);
    }

    #[test]
    fn prefers_smaller_then_lower_address_in_a_bin() {
        let mut blocks = vec![block(0, (1 << 20) + 4096), block(3 << 20, 1 << 20), block(1 << 20, 1 << 20)];
        let mut bins = Bins::default();
        for id in 0..3 {
            bins.insert(&mut blocks, id);
        }
        // Blocks 1 and 2 are the same size: the one at the lower address, whatever its slot.
        assert_eq!(bins.find(&blocks, 1 << 20, u64::MAX), Some(2));
    }
}
