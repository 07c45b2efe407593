//! Rules: the data that makes a strategy (rounding, pool kinds, segment sizes, split policy).

const MIB: u64 = 1 << 20;

/// PyTorch's two pools: small requests are carved from small segments so that they do not
/// fragment the large ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    Small,
    Large,
}

impl PoolKind {
    pub const ALL: [PoolKind; 2] = [PoolKind::Small, PoolKind::Large];

    pub fn index(self) -> usize {
        self as usize
    }

    /// PyTorch's `segment_type` string.
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }
}

/// The rules of one strategy. The default is PyTorch's native caching allocator.
#[derive(Clone, Debug, PartialEq)]
pub struct Rules {
    /// Every size rounds up to a multiple of this (and is at least this).
    pub granule: u64,
    /// Rounded requests up to this size use the small pool.
    pub small_max: u64,
    /// Segment size of the small pool.
    pub small_segment: u64,
    /// Large requests below this share a `large_segment`; bigger ones get their own segment.
    pub large_shared_max: u64,
    pub large_segment: u64,
    /// Own segments of big requests round up to a multiple of this.
    pub large_rounding: u64,
    /// A small block splits when at least this much would remain.
    pub small_min_remainder: u64,
    /// A large block splits only when more than this would remain.
    pub large_min_remainder: u64,
    /// Blocks at least this big never serve smaller requests and are never split
    /// (PyTorch's `max_split_size`); `u64::MAX` disables the limit.
    pub max_split_size: u64,
    /// An oversize request may take a cached block at most this much bigger than itself.
    pub max_non_split_rounding: u64,
}

impl Default for Rules {
    fn default() -> Self {
        Rules {
            granule: 512,
            small_max: MIB,
            small_segment: 2 * MIB,
            large_shared_max: 10 * MIB,
            large_segment: 20 * MIB,
            large_rounding: 2 * MIB,
            small_min_remainder: 512,
            large_min_remainder: MIB,
            max_split_size: u64::MAX,
            max_non_split_rounding: 20 * MIB,
        }
    }
}

impl Rules {
    /// The block size a request needs. `size` must be at most [`Rules::MAX_REQUEST`].
    pub fn round(&self, size: u64) -> u64 {
        size.max(1).div_ceil(self.granule) * self.granule
    }

    /// Requests above this are refused before any arithmetic can overflow (4 EiB).
    pub const MAX_REQUEST: u64 = 1 << 62;

    pub fn kind(&self, rounded: u64) -> PoolKind {
        if rounded <= self.small_max {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// Size of the segment to request from the device when no cached block fits.
    pub fn segment_size(&self, rounded: u64) -> u64 {
        if rounded <= self.small_max {
            self.small_segment
        } else if rounded < self.large_shared_max {
            self.large_segment
        } else {
            rounded.div_ceil(self.large_rounding) * self.large_rounding
        }
    }

    /// Whether a free block of `block_size` handed out for `rounded` leaves its tail free.
    pub fn should_split(&self, kind: PoolKind, block_size: u64, rounded: u64) -> bool {
        let remaining = block_size - rounded;
        match kind {
            PoolKind::Small => remaining >= self.small_min_remainder,
            PoolKind::Large => rounded < self.max_split_size && remaining > self.large_min_remainder,
        }
    }

    /// The biggest cached block that may serve a request of `rounded` bytes.
    pub fn max_block_for(&self, rounded: u64) -> u64 {
        if rounded < self.max_split_size {
            // Oversize blocks are kept for oversize requests.
            self.max_split_size.saturating_sub(1)
        } else {
            rounded.saturating_add(self.max_non_split_rounding)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1 << 10;

    #[test]
    fn pytorch_rounding_and_segments() {
        let r = Rules::default();
        assert_eq!(r.round(0), 512);
        assert_eq!(r.round(1), 512);
        assert_eq!(r.round(513), 1024);
        assert_eq!(r.kind(MIB), PoolKind::Small);
        assert_eq!(r.kind(MIB + 512), PoolKind::Large);
        assert_eq!(r.segment_size(4 * KIB), 2 * MIB);
        assert_eq!(r.segment_size(r.round(3 * MIB / 2)), 20 * MIB);
        assert_eq!(r.segment_size(r.round(11 * MIB + 1)), 12 * MIB);
    }

    #[test]
    fn split_policy() {
        let r = Rules::default();
        assert!(r.should_split(PoolKind::Small, 2 * MIB, 2 * MIB - 512));
        assert!(!r.should_split(PoolKind::Small, 1024, 1024));
        assert!(!r.should_split(PoolKind::Large, 20 * MIB, 19 * MIB));
        assert!(r.should_split(PoolKind::Large, 20 * MIB, 18 * MIB));
        let limited = Rules { max_split_size: 20 * MIB, ..Rules::default() };
        assert_eq!(limited.max_block_for(4 * MIB), 20 * MIB - 1);
        assert!(!limited.should_split(PoolKind::Large, 64 * MIB, 32 * MIB));
    }
}
