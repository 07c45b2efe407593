//! What a paged strategy does beyond mapping pages on demand, as data: [`Paging`] is built once
//! by config parsing, as [`crate::core::Rules`] is for plain segments, and the pool reads its
//! fields instead of asking which strategy it runs. Each of gpupool's own rules is a field that
//! `rules_off` can turn off, so that `benches/ablate.py` can measure what each one buys
//! (BENCHMARKS.md, "What each rule of the default buys").
//!
//! The out-of-memory ladder is data too: [`OomStep`]s, one list per strategy.

use crate::core::PoolKind;

/// How a paged strategy maps physical memory into its address ranges, and where it places
/// blocks in them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Paging {
    /// The mapping unit of each pool kind's range, indexed by [`PoolKind::index`].
    pub page: [u64; 2],
    /// How far one map call reaches into the free space after a block, per pool kind (at least
    /// a page: then it maps exactly what the block needs).
    pub map_ahead: [u64; 2],
    /// How many pages each physical allocation (handle) of a map call holds.
    pub handles: Handles,
    /// When the device refuses a map: give back free pages elsewhere that no queued work uses
    /// and map again, so the block keeps its place and no stream is waited for.
    pub give_back_on_refusal: bool,
}

impl Paging {
    pub fn page_of(&self, kind: PoolKind) -> u64 {
        self.page[kind.index()]
    }

    pub fn map_ahead_of(&self, kind: PoolKind) -> u64 {
        self.map_ahead[kind.index()].max(self.page_of(kind))
    }
}

/// How a map call's bytes are split into physical allocations.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Handles {
    /// One per page: any free page can go back on its own.
    PerPage,
    /// As many pages as the room left on the device allows (see `Expandable::handle_size`):
    /// few driver calls while there is room, a page each near the limit.
    ByHeadroom { roomy_share: f64, roomy_divisor: u64, tight_divisor: u64 },
}

/// [`Handles::ByHeadroom`]'s thresholds. A map call is backed by big handles while at least
/// `ROOMY_SHARE` of what the pool may hold stays free after it: closer to the limit a big
/// handle could not go back in part when the device runs short. At 0.8 the confirm half of
/// `benches/ablate.py` averaged 98.68% utilization at min capacity instead of 98.76%
/// (BENCHMARKS.md, "What each rule of the default buys").
pub const ROOMY_SHARE: f64 = 0.9;
/// While the device has room, one handle holds at most this fraction of what the pool may hold:
/// a handle that a block later keeps partly used cannot go back, and one 256 MiB tensor mapped
/// as one handle on a 3 GiB device would strand most of itself. At 2048: +0.01 point on the
/// confirm half, for 6% more driver calls on an 80 GiB device.
pub const ROOMY_HANDLE_DIVISOR: u64 = 512;
/// Past that, one handle holds at most this fraction of what stays free after the map, and at
/// least a page: near the limit every page is its own handle. At 16384: +0.02 point on the tune
/// half, none on the confirm half, for 2.9x the driver calls on an 80 GiB device.
pub const TIGHT_HANDLE_DIVISOR: u64 = 4096;

/// How far one map call of `pages` and the default reaches: PyTorch's segment sizes (20 MiB
/// large, 2 MiB small), so a growing job makes as few calls as PyTorch's segments would:
/// without it the default made 2.1x the driver calls, more than `expandable` on 25 of 32 programs.
pub const MAP_AHEAD: [u64; 2] = [2 << 20, 20 << 20];

/// One step of the out-of-memory ladder, run in order after the device refused a request until
/// one serves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OomStep {
    /// PyTorch's first remedy with `max_split_size` set: give back idle oversize segments and,
    /// if that freed as much as the request, ask the device again.
    ReleaseOversize,
    /// Wait for every stream and give back every free page and fully free segment (a retry in
    /// the statistics). Serves nothing by itself.
    ReleaseCached,
    /// Place the request as usual: a cached block, else new memory.
    Place,
    /// Place it where it needs the fewest new pages (paged strategies).
    PlaceLeastMapping,
}

/// PyTorch's ladder, for plain segments and its expandable segments.
pub const PYTORCH_LADDER: &[OomStep] = &[OomStep::ReleaseOversize, OomStep::ReleaseCached, OomStep::Place];
/// `pages` and the default: a block that does not fit by best fit goes where it needs the
/// fewest new pages.
pub const PAGES_LADDER: &[OomStep] =
    &[OomStep::ReleaseOversize, OomStep::ReleaseCached, OomStep::Place, OomStep::PlaceLeastMapping];

/// The default's rules that `rules_off` may turn off, each with what it says.
pub const RULES: [(&str, &str); 3] = [
    ("map_ahead", "a map call reaches 20 MiB (small range: 2 MiB) into the free space after a block"),
    ("handle_sizing", "a map call's handles grow with the room left on the device (else one per page)"),
    ("give_back_on_refusal", "a refused map gives back free pages elsewhere and maps again"),
];

impl Paging {
    /// The default's pager.
    pub fn pager(page: u64) -> Paging {
        Paging {
            page: [page; 2],
            map_ahead: MAP_AHEAD,
            handles: Handles::ByHeadroom {
                roomy_share: ROOMY_SHARE,
                roomy_divisor: ROOMY_HANDLE_DIVISOR,
                tight_divisor: TIGHT_HANDLE_DIVISOR,
            },
            give_back_on_refusal: true,
        }
    }

    /// `pages`, the reference pager: the default's mapping without its handle sizing and
    /// its rules under pressure.
    pub fn pages(page: u64) -> Paging {
        Paging { handles: Handles::PerPage, give_back_on_refusal: false, ..Paging::pager(page) }
    }

    /// PyTorch's expandable segments: `large` and `small` handles, exactly those a block needs.
    pub fn handles(small: u64, large: u64) -> Paging {
        Paging { page: [small, large], map_ahead: [0; 2], ..Paging::pages(small) }
    }

    /// Turns rule `name` of [`RULES`] off; whether it was on.
    pub fn turn_off(&mut self, name: &str) -> bool {
        match name {
            "map_ahead" => std::mem::take(&mut self.map_ahead) != [0; 2],
            "handle_sizing" => std::mem::replace(&mut self.handles, Handles::PerPage) != Handles::PerPage,
            "give_back_on_refusal" => std::mem::take(&mut self.give_back_on_refusal),
            _ => false,
        }
    }
}
