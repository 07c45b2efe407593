//! What the benchmarks share: a seeded RNG, the operation sequences every implementation replays,
//! and one small allocator trait over gpupool and its bookkeeping peers.
// Each bench binary compiles this module and uses only part of it.
#![allow(dead_code)]

use gpupool::core::{Handle, Rules};
use gpupool::device::Sim;
use gpupool::pool::{Config, Pool};
use std::ops::Range;
use std::time::Duration;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
/// The sim device's capacity: far more address space than any scenario touches.
const SIM_CAPACITY: u64 = 1 << 44;
/// The peers count in units of gpupool's granule, so that every implementation sees the same
/// block sizes and offset-allocator's `u32` sizes reach 2 TiB.
const UNIT: u64 = 512;

/// Short runs: the benchmark machine is small and shared.
pub fn criterion_config() -> criterion::Criterion {
    criterion::Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}

/// xorshift64 (Marsaglia), seeded, so every run and every implementation sees the same numbers.
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        XorShift(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in `0..n` (the modulo bias is below 2^-40 for the ranges used here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `low..=high`.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high - low + 1)
    }

    /// Log-uniform in `low..=high`: as many small requests as big ones per power of two.
    pub fn log_uniform(&mut self, low: u64, high: u64) -> u64 {
        let (lo, hi) = ((low as f64).ln(), (high as f64).ln());
        let fraction = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((lo + fraction * (hi - lo)).exp() as u64).clamp(low, high)
    }
}

/// One step of a replayed program. `slot` numbers allocations in order, so a free names the
/// allocation it returns whatever handle type an implementation uses.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    Alloc { slot: usize, size: u64 },
    Free { slot: usize },
}

/// A program and how many slots (allocations) it uses.
pub struct Program {
    pub ops: Vec<Op>,
    pub slots: usize,
}

/// A request's block size in gpupool (and, through [`UNIT`], in the peers).
pub fn rounded(size: u64) -> u64 {
    Rules::default().round(size)
}

impl Program {
    /// The largest request and the peak of live bytes, both rounded to the granule.
    pub fn footprint(&self) -> (u64, u64) {
        let mut sizes = vec![0; self.slots];
        let (mut largest, mut live, mut peak) = (0, 0, 0);
        for op in &self.ops {
            match *op {
                Op::Alloc { slot, size } => {
                    sizes[slot] = rounded(size);
                    largest = largest.max(sizes[slot]);
                    live += sizes[slot];
                    peak = peak.max(live);
                }
                Op::Free { slot } => live -= sizes[slot],
            }
        }
        (largest, peak)
    }

    /// Runs the program on `allocator`; `handles` must hold `self.slots` entries.
    pub fn replay<A: Allocator>(&self, allocator: &mut A, handles: &mut [Option<A::Handle>]) {
        for op in &self.ops {
            match *op {
                Op::Alloc { slot, size } => handles[slot] = Some(allocator.alloc(size)),
                Op::Free { slot } => allocator.free(handles[slot].take().expect("program frees a live slot")),
            }
        }
    }
}

/// `random_allocations`' parameters: RMM's values of `n`; of its maximum sizes (1 to 4096 MiB)
/// the small, middle and large ones; RMM's cap on live bytes; the programs' seed.
pub const COUNTS: [usize; 3] = [1_000, 10_000, 100_000];
pub const MAX_SIZES_MIB: [u64; 3] = [1, 64, 1024];
pub const MAX_USAGE: u64 = 16_000 * MIB;
pub const RANDOM_SEED: u64 = 0x5eed_0003;

/// RMM's random_allocations: `2n` steps; a step allocates (size uniform in `[1, max_size]`) with
/// probability 73% while fewer than `n` allocations were made and the live bytes stay under
/// `max_usage`, and otherwise frees a uniformly chosen live allocation. Whatever is still live
/// at the end is freed too (RMM asserts that nothing is), so every replay starts empty.
pub fn random_allocations(n: usize, max_size: u64, max_usage: u64, seed: u64) -> Program {
    let mut rng = XorShift::new(seed);
    let mut ops = Vec::with_capacity(3 * n);
    let mut live: Vec<(usize, u64)> = Vec::new();
    let (mut made, mut live_bytes) = (0, 0);
    for _ in 0..2 * n {
        let size = rng.between(1, max_size);
        let allocate = live.is_empty() || (rng.below(100) < 73 && made < n && live_bytes + size < max_usage);
        if allocate {
            ops.push(Op::Alloc { slot: made, size });
            live.push((made, size));
            made += 1;
            live_bytes += size;
        } else {
            let (slot, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
            ops.push(Op::Free { slot });
            live_bytes -= size;
        }
    }
    ops.extend(live.iter().map(|&(slot, _)| Op::Free { slot }));
    Program { ops, slots: made }
}

/// `count` requests from `sizes`, drawn with a seeded RNG.
pub fn request_sizes(count: usize, seed: u64, mut draw: impl FnMut(&mut XorShift) -> u64) -> Vec<u64> {
    let mut rng = XorShift::new(seed);
    (0..count).map(|_| draw(&mut rng)).collect()
}

/// What the implementations share: allocate a block, give it back. A refusal is a bug in the
/// benchmark's sizing (arenas are made large enough), so it panics.
pub trait Allocator {
    type Handle;
    const NAME: &'static str;
    /// An allocator that can hold `peak_bytes` of live blocks (rounded to the granule) while
    /// still serving a request of `largest` bytes, in at most `max_blocks` blocks.
    fn with_capacity(peak_bytes: u64, largest: u64, max_blocks: usize) -> Self;
    fn alloc(&mut self, size: u64) -> Self::Handle;
    fn free(&mut self, handle: Self::Handle);
}

/// gpupool's pool on the `sim` device: the full public path (validation, rounding, bins, stats),
/// with the default strategy (paged address ranges).
pub struct GpuPool(Pool<Sim>);

/// The same pool with `strategy:pytorch` (PyTorch's plain segments).
pub struct GpuPoolPytorch(Pool<Sim>);

macro_rules! pool_allocator {
    ($type:ident, $name:literal, $config:literal) => {
        impl Allocator for $type {
            type Handle = Handle;
            const NAME: &'static str = $name;

            fn with_capacity(_peak_bytes: u64, _largest: u64, _max_blocks: usize) -> Self {
                $type(Pool::new(Sim::new(SIM_CAPACITY), Config::parse($config).expect("valid config")))
            }

            #[inline]
            fn alloc(&mut self, size: u64) -> Handle {
                self.0.alloc(size).expect("sim never runs out").handle
            }

            #[inline]
            fn free(&mut self, handle: Handle) {
                self.0.free(handle).expect("handle is live")
            }
        }
    };
}

pool_allocator!(GpuPool, "gpupool", "strategy:default");
pool_allocator!(GpuPoolPytorch, "gpupool-pytorch", "strategy:pytorch");

/// Room for fragmentation: twice the peak plus the largest request, and a floor.
fn arena_bytes(peak_bytes: u64, largest: u64) -> u64 {
    2 * peak_bytes + 2 * largest + 64 * MIB
}

fn units(size: u64) -> u32 {
    u32::try_from(size.div_ceil(UNIT)).expect("size fits offset-allocator's u32 units")
}

/// offset-allocator (Sebastian Aaltonen's OffsetAllocator in Rust): O(1) bins over one arena.
pub struct OffsetAlloc(offset_allocator::Allocator);

impl Allocator for OffsetAlloc {
    type Handle = offset_allocator::Allocation;
    const NAME: &'static str = "offset-allocator";

    fn with_capacity(peak_bytes: u64, largest: u64, max_blocks: usize) -> Self {
        // Each live block and each free region between them needs a node.
        let nodes = u32::try_from(2 * max_blocks + 1024).expect("node count fits u32");
        OffsetAlloc(offset_allocator::Allocator::with_max_allocs(units(arena_bytes(peak_bytes, largest)), nodes))
    }

    #[inline]
    fn alloc(&mut self, size: u64) -> Self::Handle {
        self.0.allocate(units(size)).expect("offset-allocator arena is large enough")
    }

    #[inline]
    fn free(&mut self, handle: Self::Handle) {
        self.0.free(handle)
    }
}

/// range-alloc (gfx-rs): best fit over a sorted `Vec` of free ranges.
pub struct RangeAlloc(range_alloc::RangeAllocator<u64>);

impl Allocator for RangeAlloc {
    type Handle = Range<u64>;
    const NAME: &'static str = "range-alloc";

    fn with_capacity(peak_bytes: u64, largest: u64, _max_blocks: usize) -> Self {
        RangeAlloc(range_alloc::RangeAllocator::new(0..arena_bytes(peak_bytes, largest)))
    }

    #[inline]
    fn alloc(&mut self, size: u64) -> Range<u64> {
        self.0.allocate_range(size.div_ceil(UNIT) * UNIT).expect("range-alloc arena is large enough")
    }

    #[inline]
    fn free(&mut self, handle: Range<u64>) {
        self.0.free_range(handle)
    }
}

/// Times whole replays of `program`; the allocator is made once, so gpupool's memory stays
/// cached between replays as it would in a running program.
pub fn bench_warm_replay<A: Allocator>(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    label: &str,
    program: &Program,
) {
    let (largest, peak) = program.footprint();
    let mut allocator = A::with_capacity(peak, largest, program.slots);
    let mut handles: Vec<Option<A::Handle>> = (0..program.slots).map(|_| None).collect();
    group.bench_function(criterion::BenchmarkId::new(A::NAME, label), |b| {
        b.iter(|| program.replay(&mut allocator, &mut handles))
    });
}
