//! Statistics with PyTorch's names and meanings, updated where the state changes.

use super::rules::PoolKind;

/// One counter as PyTorch reports it: `current`, `peak`, `allocated` (sum of increases) and
/// `freed` (sum of decreases).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: u64,
    pub peak: u64,
    pub allocated: u64,
    pub freed: u64,
}

/// What is stored of a counter. `freed` is always `allocated - current`, so it is derived and a
/// decrease is one subtraction (statistics are on every allocation's hot path).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counter {
    current: u64,
    peak: u64,
    allocated: u64,
}

impl Counter {
    #[inline(always)]
    fn increase(&mut self, amount: u64) {
        self.current += amount;
        self.allocated += amount;
        self.peak = self.peak.max(self.current);
    }

    #[inline(always)]
    fn decrease(&mut self, amount: u64) {
        debug_assert!(self.current >= amount, "statistic would go negative");
        self.current -= amount;
    }

    fn view(self) -> Stat {
        Stat { current: self.current, peak: self.peak, allocated: self.allocated, freed: self.allocated - self.current }
    }
}

/// The metrics of `torch.cuda.memory_stats`, in its key order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    Allocation,
    Segment,
    Active,
    InactiveSplit,
    AllocatedBytes,
    ReservedBytes,
    ActiveBytes,
    InactiveSplitBytes,
    RequestedBytes,
}

impl Metric {
    pub const ALL: [Metric; 9] = [
        Metric::Allocation,
        Metric::Segment,
        Metric::Active,
        Metric::InactiveSplit,
        Metric::AllocatedBytes,
        Metric::ReservedBytes,
        Metric::ActiveBytes,
        Metric::InactiveSplitBytes,
        Metric::RequestedBytes,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Metric::Allocation => "allocation",
            Metric::Segment => "segment",
            Metric::Active => "active",
            Metric::InactiveSplit => "inactive_split",
            Metric::AllocatedBytes => "allocated_bytes",
            Metric::ReservedBytes => "reserved_bytes",
            Metric::ActiveBytes => "active_bytes",
            Metric::InactiveSplitBytes => "inactive_split_bytes",
            Metric::RequestedBytes => "requested_bytes",
        }
    }
}

/// PyTorch's three views of every metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatType {
    All,
    LargePool,
    SmallPool,
}

impl StatType {
    pub const ALL: [StatType; 3] = [StatType::All, StatType::LargePool, StatType::SmallPool];

    pub fn name(self) -> &'static str {
        match self {
            StatType::All => "all",
            StatType::LargePool => "large_pool",
            StatType::SmallPool => "small_pool",
        }
    }
}

/// One metric: a counter per pool kind, and the peak of their sum. The `all` view's current and
/// allocated values are sums, so an update touches one counter and one peak, not two counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Row {
    /// By [`PoolKind::index`].
    kinds: [Counter; 2],
    all_peak: u64,
}

impl Row {
    #[inline(always)]
    fn all_current(&self) -> u64 {
        self.kinds[0].current + self.kinds[1].current
    }

    fn view(&self, of: StatType) -> Stat {
        match of {
            StatType::SmallPool => self.kinds[PoolKind::Small.index()].view(),
            StatType::LargePool => self.kinds[PoolKind::Large.index()].view(),
            StatType::All => {
                let [a, b] = self.kinds;
                let (current, allocated) = (a.current + b.current, a.allocated + b.allocated);
                Stat { current, peak: self.all_peak, allocated, freed: allocated - current }
            }
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    table: [Row; 9],
    /// PyTorch's two single counters (no per-pool views): allocations and plain segments of
    /// `max_split_size` or more.
    oversize_allocations: Counter,
    oversize_segments: Counter,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    /// Waits for every stream before returning cached memory (`empty_cache`, the
    /// out-of-memory path), as PyTorch's `synchronize_and_free_events` counts them.
    pub num_sync_all_streams: u64,
    pub num_device_alloc: u64,
    pub num_device_free: u64,
    /// Page-range map and unmap calls of expandable segments.
    pub num_device_map: u64,
    pub num_device_unmap: u64,
    /// What those operations cost in driver calls, by kind.
    pub driver: super::DriverCalls,
    /// Where `reset_accumulated` left the sums; `None` until it is called (kept off the
    /// counters themselves, which every allocation updates).
    accumulated_from: Option<Box<AccumulatedFrom>>,
}

/// Each counter's (`allocated`, `freed`) when the accumulated statistics were last reset.
#[derive(Clone, Debug, PartialEq, Eq)]
struct AccumulatedFrom {
    table: [[(u64, u64); 2]; 9],
    oversize: [(u64, u64); 2],
}

impl Counter {
    fn sums(self) -> (u64, u64) {
        (self.allocated, self.allocated - self.current)
    }
}

/// `stat` with the sums `from` (per pool kind) taken off: what accumulated since the reset.
fn since(mut stat: Stat, from: &[(u64, u64)]) -> Stat {
    let (allocated, freed) = from.iter().fold((0, 0), |(a, f), &(x, y)| (a + x, f + y));
    stat.allocated -= allocated;
    stat.freed -= freed;
    stat
}

impl Stats {
    pub fn get(&self, metric: Metric, of: StatType) -> Stat {
        let stat = self.table[metric as usize].view(of);
        let Some(from) = self.accumulated_from.as_deref() else { return stat };
        let kinds = &from.table[metric as usize];
        match of {
            StatType::All => since(stat, kinds),
            StatType::LargePool => since(stat, &kinds[PoolKind::Large.index()..][..1]),
            StatType::SmallPool => since(stat, &kinds[PoolKind::Small.index()..][..1]),
        }
    }

    /// PyTorch's `reset_accumulated_memory_stats`: every counter's `allocated` and `freed`, and
    /// the event counts (retries, OOMs, synchronizations, device and driver calls), start again
    /// from 0; `current` and `peak` stay.
    pub fn reset_accumulated(&mut self) {
        let table = self.table.map(|row| row.kinds.map(Counter::sums));
        let oversize = [self.oversize_allocations.sums(), self.oversize_segments.sums()];
        self.accumulated_from = Some(Box::new(AccumulatedFrom { table, oversize }));
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_device_map = 0;
        self.num_device_unmap = 0;
        self.driver = super::DriverCalls::default();
    }

    #[inline(always)]
    pub fn increase(&mut self, metric: Metric, kind: PoolKind, amount: u64) {
        let row = &mut self.table[metric as usize];
        row.kinds[kind.index()].increase(amount);
        row.all_peak = row.all_peak.max(row.all_current());
    }

    #[inline(always)]
    pub fn decrease(&mut self, metric: Metric, kind: PoolKind, amount: u64) {
        self.table[metric as usize].kinds[kind.index()].decrease(amount);
    }

    /// Moves a counter from `from` to `to` in one step: an increase or a decrease of the
    /// difference, as PyTorch applies an operation's net change.
    #[inline(always)]
    pub fn change(&mut self, metric: Metric, kind: PoolKind, from: u64, to: u64) {
        if to > from {
            self.increase(metric, kind, to - from);
        } else if from > to {
            self.decrease(metric, kind, from - to);
        }
    }

    /// An allocation (`allocation: true`) or plain segment of `max_split_size` or more began
    /// (`began: true`) or ended.
    #[inline(always)]
    pub fn note_oversize(&mut self, allocation: bool, began: bool) {
        let counter = if allocation { &mut self.oversize_allocations } else { &mut self.oversize_segments };
        if began {
            counter.increase(1);
        } else {
            counter.decrease(1);
        }
    }

    pub fn oversize_allocations(&self) -> Stat {
        self.oversize(self.oversize_allocations, 0)
    }

    pub fn oversize_segments(&self) -> Stat {
        self.oversize(self.oversize_segments, 1)
    }

    fn oversize(&self, counter: Counter, index: usize) -> Stat {
        match self.accumulated_from.as_deref() {
            Some(from) => since(counter.view(), &from.oversize[index..][..1]),
            None => counter.view(),
        }
    }

    pub fn reset_peaks(&mut self) {
        for row in &mut self.table {
            for counter in &mut row.kinds {
                counter.peak = counter.current;
            }
            row.all_peak = row.all_current();
        }
        for counter in [&mut self.oversize_allocations, &mut self.oversize_segments] {
            counter.peak = counter.current;
        }
    }

    /// Every counter under its PyTorch key, e.g. `("allocated_bytes.all.current", 512)`.
    pub fn entries(&self) -> Vec<(String, u64)> {
        let mut out = Vec::with_capacity(9 * 3 * 4 + 4);
        for metric in Metric::ALL {
            for of in StatType::ALL {
                let s = self.get(metric, of);
                let prefix = format!("{}.{}", metric.name(), of.name());
                out.push((format!("{prefix}.current"), s.current));
                out.push((format!("{prefix}.peak"), s.peak));
                out.push((format!("{prefix}.allocated"), s.allocated));
                out.push((format!("{prefix}.freed"), s.freed));
            }
        }
        for (name, s) in
            [("oversize_allocations", self.oversize_allocations()), ("oversize_segments", self.oversize_segments())]
        {
            out.push((format!("{name}.current"), s.current));
            out.push((format!("{name}.peak"), s.peak));
            out.push((format!("{name}.allocated"), s.allocated));
            out.push((format!("{name}.freed"), s.freed));
        }
        out.push(("num_alloc_retries".into(), self.num_alloc_retries));
        out.push(("num_ooms".into(), self.num_ooms));
        out.push(("num_sync_all_streams".into(), self.num_sync_all_streams));
        out.push(("num_device_alloc".into(), self.num_device_alloc));
        out.push(("num_device_free".into(), self.num_device_free));
        out.push(("num_device_map".into(), self.num_device_map));
        out.push(("num_device_unmap".into(), self.num_device_unmap));
        out.push(("num_driver_calls".into(), self.driver.total()));
        out.extend(self.driver.entries().map(|(kind, n)| (format!("num_driver_{kind}"), n)));
        out
    }

    /// The `current` values only, for comparing against a recount.
    pub fn currents(&self) -> ([[u64; 3]; 9], [u64; 2]) {
        let table = self.table.map(|row| StatType::ALL.map(|of| row.view(of).current));
        (table, [self.oversize_allocations.current, self.oversize_segments.current])
    }
}
