//! Rules: the data that makes a strategy (rounding, pool kinds, segment sizes, split policy).
//!
//! Every strategy runs on the same heap; only these numbers and two small enums differ:
//!
//! | preset    | granule | pools        | split ([`SplitPolicy`])       | new segment ([`SegmentGrowth`])   |
//! |-----------|---------|--------------|-------------------------------|-----------------------------------|
//! | `pytorch` | 512 B   | small, large | PyTorch                       | 2 MiB / 20 MiB / rounded to 2 MiB |
//! | `bfc`     | 256 B   | one          | BFC: >= 2x, or >= 128 MiB left | regions doubling from 2 MiB       |
//! | `arena`   | 512 B   | one          | always                        | the unit, doubled until it fits   |
//! | `eager`   | 512 B   | one          | BFC                           | 2 MiB / 20 MiB / rounded to 2 MiB |
//! | `direct`  | 512 B   | one          | never                         | exactly the rounded request       |

const MIB: u64 = 1 << 20;

/// A TF BFC / OneFlow block always splits when at least this much would remain.
pub const BFC_SPLIT_REMAINDER: u64 = 128 * MIB;

/// `roundup_power2_divisions` has one entry per power of two from 1 MiB up; the last entry also
/// covers everything above 32 GiB.
pub const POWER2_INTERVALS: usize = 16;
const POWER2_FIRST_LOG2: u32 = 20;

/// PyTorch's two pools: small requests are carved from small segments so that they do not
/// fragment the large ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    Small,
    Large,
}

impl PoolKind {
    pub const ALL: [PoolKind; 2] = [PoolKind::Small, PoolKind::Large];

    #[inline(always)]
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

/// When a free block bigger than a request is cut, leaving its tail free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitPolicy {
    /// PyTorch: a small block splits when `small_min_remainder` or more would remain; a large
    /// one only for requests below `max_split_size` and when more than `large_min_remainder`
    /// would remain (else the user gets the whole block).
    PyTorch,
    /// TensorFlow BFC and OneFlow: when the block is at least twice the request, or at least
    /// [`BFC_SPLIT_REMAINDER`] would remain.
    Bfc,
    /// MindSpore: whenever a granule or more would remain.
    Always,
    /// Never; a cached block then only serves requests of exactly its size (`direct`).
    Never,
}

/// How big a new segment is when no cached block fits a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentGrowth {
    /// PyTorch: `small_segment` for small requests, `large_segment` below `large_shared_max`,
    /// else the request rounded up to `large_rounding`.
    PyTorch,
    /// TF BFC with `allow_growth`: the pool's current region size (from `growth_unit`), doubled
    /// until the request fits; each region obtained doubles the next one (see
    /// [`Rules::next_region`]). Capped by what the device can still give.
    Doubling,
    /// MindSpore: `growth_unit` doubled until the request fits, capped by what the device can
    /// still give.
    Units,
    /// Exactly the rounded request (no pooling).
    Exact,
}

/// The rules of one strategy. The default is PyTorch's native caching allocator.
#[derive(Clone, Debug, PartialEq)]
pub struct Rules {
    /// Every size rounds up to a multiple of this power of two (and is at least this).
    pub granule: u64,
    /// Whether small requests have a pool of their own (PyTorch); otherwise every block is
    /// [`PoolKind::Large`].
    pub small_pool: bool,
    /// Rounded requests up to this size are small (pool kind, PyTorch segment sizes).
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
    /// PyTorch's `roundup_power2_divisions`: per power-of-two interval from 1 MiB, the number
    /// of equal steps sizes round up to (0 or 1: plain granule rounding). `None` when unset, so
    /// the common case costs one branch.
    pub power2_divisions: Option<[u64; POWER2_INTERVALS]>,
    pub split: SplitPolicy,
    pub growth: SegmentGrowth,
    /// [`SegmentGrowth::Doubling`]: the first region; [`SegmentGrowth::Units`]: the unit.
    pub growth_unit: u64,
}

impl Default for Rules {
    fn default() -> Self {
        Rules::pytorch()
    }
}

impl Rules {
    /// PyTorch's native caching allocator (c10/cuda/CUDACachingAllocator.cpp).
    pub fn pytorch() -> Self {
        Rules {
            granule: 512,
            small_pool: true,
            small_max: MIB,
            small_segment: 2 * MIB,
            large_shared_max: 10 * MIB,
            large_segment: 20 * MIB,
            large_rounding: 2 * MIB,
            small_min_remainder: 512,
            large_min_remainder: MIB,
            max_split_size: u64::MAX,
            max_non_split_rounding: 20 * MIB,
            power2_divisions: None,
            split: SplitPolicy::PyTorch,
            growth: SegmentGrowth::PyTorch,
            growth_unit: 0,
        }
    }

    /// TensorFlow's BFC allocator with `allow_growth`: 256 B granules, one pool, regions that
    /// double from 2 MiB.
    pub fn bfc() -> Self {
        Rules {
            granule: 256,
            small_pool: false,
            split: SplitPolicy::Bfc,
            growth: SegmentGrowth::Doubling,
            growth_unit: 2 * MIB,
            ..Rules::pytorch()
        }
    }

    /// MindSpore's dynamic pool: one pool split to the granule, growing by `unit`s doubled
    /// until a request fits.
    pub fn arena(unit: u64) -> Self {
        Rules {
            small_pool: false,
            split: SplitPolicy::Always,
            growth: SegmentGrowth::Units,
            growth_unit: unit,
            ..Rules::pytorch()
        }
    }

    /// OneFlow's bin allocator: BFC's split rule over PyTorch's segment sizes, one pool.
    pub fn eager() -> Self {
        Rules { small_pool: false, split: SplitPolicy::Bfc, ..Rules::pytorch() }
    }

    /// No pooling: every allocation is a segment of its own (the baseline).
    pub fn direct() -> Self {
        Rules { small_pool: false, split: SplitPolicy::Never, growth: SegmentGrowth::Exact, ..Rules::pytorch() }
    }

    /// The block size a request needs. `size` must be at most [`Rules::MAX_REQUEST`].
    #[inline]
    pub fn round(&self, size: u64) -> u64 {
        if let Some(divisions) = &self.power2_divisions {
            if let Some(rounded) = self.round_power2(divisions, size) {
                return rounded;
            }
        }
        let mask = self.granule - 1;
        (size.max(1) + mask) & !mask
    }

    /// PyTorch's `roundup_power2_divisions`: a size in `[2^k, 2^(k+1))` rounds up to the next
    /// of `divisions` equal steps of that interval. `None` when plain rounding applies.
    #[cold]
    fn round_power2(&self, divisions: &[u64; POWER2_INTERVALS], size: u64) -> Option<u64> {
        let log2 = 63 - size.max(1).leading_zeros();
        let interval = (log2.saturating_sub(POWER2_FIRST_LOG2) as usize).min(POWER2_INTERVALS - 1);
        let steps = divisions[interval];
        // Wrapping, as PyTorch's `kMinBlockSize * divisions` does: a count may be any power of
        // two that fits 64 bits, and from 2^55 on (with 512-byte granules) the product is 0, so
        // every size rounds (up to the next power of two, the steps being below one byte).
        if steps <= 1 || size <= self.granule.wrapping_mul(steps) {
            return None;
        }
        if size.is_power_of_two() {
            return Some(size);
        }
        let floor = 1u64 << log2;
        let step = floor >> steps.ilog2();
        if step == 0 {
            return Some(floor << 1);
        }
        Some((size + step - 1) & !(step - 1))
    }

    /// Requests above this are refused before any arithmetic can overflow (4 EiB).
    pub const MAX_REQUEST: u64 = 1 << 62;

    #[inline]
    pub fn kind(&self, rounded: u64) -> PoolKind {
        if self.small_pool && rounded <= self.small_max {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// Size of the segment to request from the device when no cached block fits `rounded`
    /// bytes. `region` is the pool's growth state ([`SegmentGrowth::Doubling`]'s next region),
    /// `available` the bytes the device and the pool's limit can still give (`u64::MAX` when
    /// unknown). Capped strategies never go below the request: the device then refuses and the
    /// out-of-memory ladder takes over.
    pub fn segment_size(&self, rounded: u64, region: u64, available: u64) -> u64 {
        let wanted = match self.growth {
            SegmentGrowth::PyTorch => return self.pytorch_segment_size(rounded),
            SegmentGrowth::Exact => return rounded,
            SegmentGrowth::Doubling => doubled_until(region.max(self.granule), rounded),
            SegmentGrowth::Units => doubled_until(self.growth_unit.max(self.granule), rounded),
        };
        wanted.min(available & !(self.granule - 1)).max(rounded)
    }

    fn pytorch_segment_size(&self, rounded: u64) -> u64 {
        if rounded <= self.small_max {
            self.small_segment
        } else if rounded < self.large_shared_max {
            self.large_segment
        } else {
            rounded.div_ceil(self.large_rounding) * self.large_rounding
        }
    }

    /// Whether a segment of the size [`Rules::segment_size`] chose may shrink to the bare
    /// request when the device refuses it (TF BFC backs off; PyTorch asks for exactly its size).
    pub fn may_back_off(&self) -> bool {
        matches!(self.growth, SegmentGrowth::Doubling | SegmentGrowth::Units)
    }

    /// The next region size after one was obtained for `rounded` bytes at `region` (TF BFC):
    /// the grown size if the request needed growth, else double.
    pub fn next_region(&self, region: u64, rounded: u64) -> u64 {
        let grown = doubled_until(region.max(self.granule), rounded);
        if grown > region {
            grown
        } else {
            region.saturating_mul(2)
        }
    }

    /// Whether a free block of `block_size` handed out for `rounded` leaves its tail free.
    #[inline]
    pub fn should_split(&self, kind: PoolKind, block_size: u64, rounded: u64) -> bool {
        let remaining = block_size - rounded;
        let splittable = rounded < self.max_split_size;
        match self.split {
            SplitPolicy::PyTorch => match kind {
                PoolKind::Small => remaining >= self.small_min_remainder,
                PoolKind::Large => splittable && remaining > self.large_min_remainder,
            },
            SplitPolicy::Bfc => splittable && (block_size / 2 >= rounded || remaining >= BFC_SPLIT_REMAINDER),
            SplitPolicy::Always => splittable && remaining >= self.granule,
            SplitPolicy::Never => false,
        }
    }

    /// The biggest cached block that may serve a request of `rounded` bytes.
    #[inline]
    pub fn max_block_for(&self, rounded: u64) -> u64 {
        if self.split == SplitPolicy::Never {
            // An unsplit block bigger than the request would waste its tail.
            rounded
        } else if rounded < self.max_split_size {
            // Oversize blocks are kept for oversize requests.
            self.max_split_size.saturating_sub(1)
        } else {
            rounded.saturating_add(self.max_non_split_rounding)
        }
    }
}

/// `start`, doubled until it is at least `size`.
fn doubled_until(start: u64, size: u64) -> u64 {
    let mut s = start.max(1);
    while s < size {
        s = s.saturating_mul(2);
    }
    s
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
        let segment = |rounded| r.segment_size(rounded, 0, u64::MAX);
        assert_eq!(segment(4 * KIB), 2 * MIB);
        assert_eq!(segment(r.round(3 * MIB / 2)), 20 * MIB);
        assert_eq!(segment(r.round(11 * MIB + 1)), 12 * MIB);
        // PyTorch asks for its fixed sizes whatever the device has left.
        assert_eq!(r.segment_size(4 * KIB, 0, MIB), 2 * MIB);
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

    #[test]
    fn other_presets_split_as_their_frameworks() {
        let bfc = Rules::bfc();
        assert_eq!((bfc.round(1), bfc.round(257)), (256, 512));
        assert_eq!(bfc.kind(256), PoolKind::Large);
        assert!(bfc.should_split(PoolKind::Large, 8 * MIB, 4 * MIB));
        assert!(!bfc.should_split(PoolKind::Large, 8 * MIB - 256, 4 * MIB));
        assert!(bfc.should_split(PoolKind::Large, 1024 * MIB, 600 * MIB));
        let arena = Rules::arena(1024 * MIB);
        assert!(arena.should_split(PoolKind::Large, 1024, 512));
        assert!(!arena.should_split(PoolKind::Large, 1024, 1024));
        let direct = Rules::direct();
        assert!(!direct.should_split(PoolKind::Large, 64 * MIB, 512));
        assert_eq!(direct.max_block_for(4096), 4096);
        assert_eq!(Rules::eager().segment_size(4096, 0, u64::MAX), 2 * MIB);
        assert_eq!(Rules::eager().kind(4096), PoolKind::Large);
    }

    #[test]
    fn growth_doubles_and_respects_what_is_left() {
        let bfc = Rules::bfc();
        assert_eq!(bfc.segment_size(4096, 2 * MIB, u64::MAX), 2 * MIB);
        assert_eq!(bfc.segment_size(5 * MIB, 2 * MIB, u64::MAX), 8 * MIB);
        assert_eq!(bfc.segment_size(5 * MIB, 2 * MIB, 6 * MIB + 100), 6 * MIB);
        assert_eq!(bfc.segment_size(5 * MIB, 2 * MIB, MIB), 5 * MIB, "never below the request");
        // TF: a region that had to grow for its request is the next region; otherwise it doubles.
        assert_eq!(bfc.next_region(2 * MIB, 5 * MIB), 8 * MIB);
        assert_eq!(bfc.next_region(8 * MIB, 5 * MIB), 16 * MIB);
        let arena = Rules::arena(64 * MIB);
        assert_eq!(arena.segment_size(MIB, 0, u64::MAX), 64 * MIB);
        assert_eq!(arena.segment_size(100 * MIB, 0, u64::MAX), 128 * MIB);
        assert_eq!(arena.segment_size(MIB, 0, 10 * MIB), 10 * MIB);
        assert_eq!(Rules::direct().segment_size(4096, 0, u64::MAX), 4096);
        assert!(bfc.may_back_off() && !Rules::pytorch().may_back_off());
    }

    #[test]
    fn power2_divisions_round_as_pytorch() {
        let mut divisions = [0; POWER2_INTERVALS];
        divisions[0] = 4; // [1 MiB, 2 MiB): quarters
        divisions[POWER2_INTERVALS - 1] = 8;
        let r = Rules { power2_divisions: Some(divisions), ..Rules::default() };
        assert_eq!(r.round(MIB + 1), MIB + 256 * KIB);
        assert_eq!(r.round(MIB + 300 * KIB), MIB + 512 * KIB);
        assert_eq!(r.round(MIB), MIB);
        assert_eq!(r.round(1000), 1024, "below 1 MiB the first interval's setting applies");
        assert_eq!(r.round(2 * MIB + 1), 2 * MIB + 512, "an interval set to 0 rounds plainly");
        assert_eq!(r.round((100 << 30) + 1), 104 << 30);
        assert_eq!(Rules::default().round(MIB + 1), MIB + 512);
        // Counts up to 2^63, with PyTorch's arithmetic: 512 x 2^54 bounds the sizes that round
        // plainly, and from 2^55 the product wraps to 0, so every size rounds to a power of two.
        let large = Rules { power2_divisions: Some([1 << 54; POWER2_INTERVALS]), ..Rules::default() };
        assert_eq!(large.round(MIB + 1), MIB + 512);
        for count in [1 << 55, 1 << 63] {
            let huge = Rules { power2_divisions: Some([count; POWER2_INTERVALS]), ..Rules::default() };
            assert_eq!(huge.round(Rules::MAX_REQUEST - 1), Rules::MAX_REQUEST);
            assert_eq!(huge.round(MIB + 1), 2 * MIB, "{count}");
            assert_eq!(huge.round(4 * MIB), 4 * MIB, "{count}");
            assert_eq!(huge.round(1000), 1024, "{count}");
        }
    }
}
