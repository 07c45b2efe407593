//! Runs of same-size allocations, for gpupool's pager.
//!
//! A job that makes many tensors of one size one after another (a K and a V tensor per layer
//! for each request a server admits, per-layer buffers) makes tensors that live and die
//! together, not with whatever lies around them. Best fit would put blocks of a page or less in
//! the free pieces between large blocks of the large range, where they cost no page while their
//! neighbours live; when the neighbours die first, each keeps a partly used page mapped and
//! splits the hole a large request could have reused (BENCHMARKS.md, "Serving with a KV tensor
//! per request"). So past the first [`RUN_TO_SMALL`] of a run, and while the device is nearly
//! full, such blocks go to the small range, where they pack together. Blocks of a training step
//! die with their neighbours, and there filling the large blocks' edge pages is what saves
//! memory: runs that long are rare in them, and no shared trace or snapshot moves.

use super::policy::SizeRunRule;

/// Runs are sent to the small range only while less than this share of what the pool may hold
/// (the device, or its limit) is unmapped. With more room a second range only adds its own high
/// water and map calls to the large range's: on devices 1.1 to 8 times a serving job, sending
/// runs there at any fill level raised peak reserved by 2% to 15% and driver calls by 5% to 72%.
/// An unlimited device never sends them.
pub const TIGHT_SHARE: f64 = 0.1;

/// The allocations of one size in a row after which the rest of the run goes to the small
/// range. Shorter runs cost memory on Wedsonlin__medium_128_training (4: 86 MiB); longer ones
/// help the serving programs less (BENCHMARKS.md).
pub const RUN_TO_SMALL: u32 = 8;

/// The rounded size of the last allocations and how many in a row had it.
#[derive(Debug)]
pub struct SizeRun {
    pub rule: SizeRunRule,
    size: u64,
    count: u32,
    /// Sizes in `(smallest, largest]` are redirected: above the small range's own blocks, at
    /// most its page.
    smallest: u64,
    largest: u64,
}

impl SizeRun {
    pub fn new(rule: SizeRunRule, smallest: u64, largest: u64) -> Self {
        SizeRun { rule, size: 0, count: 0, smallest, largest: largest.max(smallest) }
    }

    /// Counts an allocation of `rounded` bytes.
    #[inline(always)]
    pub fn note(&mut self, rounded: u64) {
        if rounded == self.size {
            self.count = self.count.saturating_add(1);
        } else {
            self.size = rounded;
            self.count = 1;
        }
    }

    /// Whether a request of `rounded` bytes continues a long run of blocks of at most a page
    /// (above the small range's own).
    #[inline(always)]
    pub fn continues(&self, rounded: u64) -> bool {
        rounded == self.size
            && self.count >= self.rule.run_to_small
            && rounded > self.smallest
            && rounded <= self.largest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_long_run_of_mid_sizes_is_redirected() {
        let rule = SizeRunRule { run_to_small: RUN_TO_SMALL, tight_share: TIGHT_SHARE };
        let mut run = SizeRun::new(rule, 256 << 10, 2 << 20);
        for size in [512 << 10, 4 << 20, 128 << 10] {
            for i in 0..RUN_TO_SMALL + 2 {
                let expected = i >= RUN_TO_SMALL && size == 512 << 10;
                assert_eq!(run.continues(size), expected, "{size} bytes, {i} before it");
                run.note(size);
            }
        }
        // Another size breaks the run.
        run.note(512 << 10);
        assert!(!run.continues(512 << 10));
    }
}
