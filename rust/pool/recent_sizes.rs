//! Holes that fit a recent large request exactly, for gpupool's pager.
//!
//! A training step frees a large tensor and soon asks for one of the same size (a temporary of
//! each layer, an activation recomputed). The hole it leaves between live blocks is best fit for
//! that next request, but best fit also sends a mid-size block (above the small range's tiny
//! ones, at most half a page) to that hole's front when no smaller piece holds it. The hole then
//! no longer holds the large request, which goes to the top, and the rest of the hole stays a
//! hole whose edge pages cost memory under pressure. So a mid-size block whose best fit is a hole
//! with a block after it (not the free end of the range), of at least [`KEEP_PAGES`] pages and
//! exactly one of the [`RECENT`] large sizes most recently asked for, one asked for
//! [`MIN_SEEN`] times or more (a size that recurs, not one that came up once), goes to the
//! small range instead, where it packs with others (BENCHMARKS.md, "Holes kept for a recent
//! size"). Smaller holes are left to best fit: there mid-size blocks fill the partly used pages
//! between large blocks, which is what saves memory on the training traces.

/// Holes are kept for a recent size from this many pages up. At 2 to 6 pages resnet50_train
/// needs 1,678 to 1,680 MiB instead of 1,672; from 8 to 12 only MAGMA27 moves, by 6 MiB, down
/// to what the reference pager needs (its holes are 12 pages).
pub const KEEP_PAGES: u64 = 8;

/// How many requests of a size make its holes kept. Kept after one request, random_sizes_3 of
/// `benches/handle_sizes.py` (random sizes, random lifetimes) needed 6,318 MiB instead of
/// 6,310; from two (and at three) it needs 6,310 MiB again, and MAGMA27 keeps its 13,280 MiB.
pub const MIN_SEEN: u32 = 2;

/// How many large sizes are remembered.
pub const RECENT: usize = 16;

use super::policy::KeptHolesRule;

/// The [`RECENT`] sizes of at least [`KEEP_PAGES`] pages most recently asked for, each with how
/// many requests it had since it was taken in; a new size replaces the one asked for least
/// recently, so a size that every step asks for stays however many others come and go.
#[derive(Debug)]
pub struct RecentSizes {
    sizes: [u64; RECENT],
    /// How many requests of each remembered size there were.
    seen: [u32; RECENT],
    /// When each was last asked for, in remembered requests.
    last: [u64; RECENT],
    clock: u64,
    /// Requests from this size up are remembered.
    smallest: u64,
    /// How many requests of a size make its holes kept.
    min_seen: u32,
    /// Requests in `(mid_above, mid_most]` are the mid-size ones a kept hole turns away.
    mid_above: u64,
    mid_most: u64,
}

impl RecentSizes {
    /// For a pager whose small range holds blocks of at most `small_max` and whose pages are
    /// `page` bytes.
    pub fn new(rule: KeptHolesRule, small_max: u64, page: u64) -> Self {
        RecentSizes {
            sizes: [0; RECENT],
            seen: [0; RECENT],
            last: [0; RECENT],
            clock: 0,
            smallest: rule.keep_pages * page,
            min_seen: rule.min_seen,
            mid_above: small_max,
            mid_most: page / 2,
        }
    }

    /// Counts an allocation of `rounded` bytes.
    #[inline(always)]
    pub fn note(&mut self, rounded: u64) {
        if rounded >= self.smallest {
            self.remember(rounded);
        }
    }

    #[cold]
    fn remember(&mut self, rounded: u64) {
        self.clock += 1;
        let slot = match self.sizes.iter().position(|&s| s == rounded) {
            Some(slot) => {
                self.seen[slot] = self.seen[slot].saturating_add(1);
                slot
            }
            None => {
                let oldest = (0..RECENT).min_by_key(|&i| self.last[i]).unwrap_or(0);
                (self.sizes[oldest], self.seen[oldest]) = (rounded, 1);
                oldest
            }
        };
        self.last[slot] = self.clock;
    }

    /// Whether a request of `rounded` bytes is mid-size: one a kept hole turns away.
    #[inline(always)]
    pub fn is_mid(&self, rounded: u64) -> bool {
        rounded > self.mid_above && rounded <= self.mid_most
    }

    /// Whether a hole of `size` bytes is kept for a recent request of exactly that size.
    pub fn keeps(&self, size: u64) -> bool {
        size >= self.smallest && self.sizes.iter().zip(self.seen).any(|(&s, n)| s == size && n >= self.min_seen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn keeps_holes_of_recent_large_sizes_only() {
        let rule = KeptHolesRule { keep_pages: KEEP_PAGES, min_seen: MIN_SEEN };
        let mut recent = RecentSizes::new(rule, 256 << 10, 2 * MIB);
        assert!(recent.is_mid(512 << 10) && recent.is_mid(MIB));
        assert!(!recent.is_mid(256 << 10) && !recent.is_mid(MIB + 512));
        // Below eight pages nothing is remembered.
        recent.note(14 * MIB);
        assert!(!recent.keeps(14 * MIB));
        recent.note(14 * MIB);
        assert!(!recent.keeps(14 * MIB));
        // One request of a size keeps nothing; a second does.
        recent.note(24 * MIB);
        assert!(!recent.keeps(24 * MIB));
        recent.note(24 * MIB);
        assert!(recent.keeps(24 * MIB) && !recent.keeps(26 * MIB));
        // A size asked for between the others stays however many come and go; a repeat takes
        // no slot, and the size asked for least recently is the one a new size replaces.
        for i in 0..4 * RECENT as u64 {
            recent.note((32 + i) * MIB);
            recent.note((32 + i) * MIB);
            recent.note(24 * MIB);
        }
        assert!(recent.keeps(24 * MIB) && recent.keeps((32 + 4 * RECENT as u64 - 1) * MIB));
        assert!(!recent.keeps((32 + 4 * RECENT as u64 - RECENT as u64) * MIB), "replaced");
        for i in 0..RECENT as u64 {
            recent.note((200 + i) * MIB);
        }
        assert!(!recent.keeps(24 * MIB));
        // A size taken in again starts its count anew.
        recent.note(24 * MIB);
        assert!(!recent.keeps(24 * MIB));
    }
}
