//! Alloc+free pairs: on an otherwise empty allocator (cached), and among 1k, 100k and 1M live
//! blocks, packed back to back or with a free hole after every 16th; gpupool beside
//! offset-allocator and range-alloc on the same sizes.

mod common;

use common::{
    criterion_config, request_sizes, rounded, Allocator, GpuPool, GpuPoolPytorch, OffsetAlloc, RangeAlloc, KIB, MIB,
};
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion};
use std::hint::black_box;

const CACHED_SIZES: [(u64, &str); 3] = [(512, "512B"), (64 * KIB, "64KiB"), (8 * MIB, "8MiB")];
const LIVE_COUNTS: [(usize, &str); 3] = [(1_000, "1k"), (100_000, "100k"), (1_000_000, "1M")];
/// The fragmented variant adds 1,600 live blocks: 100 holes, where issue 13 asks gpupool to be
/// no slower than range-alloc (1k has 62).
const FRAGMENTED_COUNTS: [(usize, &str); 4] = [(1_000, "1k"), (1_600, "1.6k"), (100_000, "100k"), (1_000_000, "1M")];
/// How many different sizes the timed pairs cycle through.
const PAIR_SIZES: usize = 256;
/// In the fragmented variant one block in this many is freed after the live set is built.
const HOLE_EVERY: usize = 17;

type Group<'a> = BenchmarkGroup<'a, criterion::measurement::WallTime>;

/// One size, allocated and freed again and again: the cache hit every training step makes.
fn cached_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("cached_pair");
    for (size, label) in CACHED_SIZES {
        cached_pair_on::<GpuPool>(&mut group, size, label);
        cached_pair_on::<GpuPoolPytorch>(&mut group, size, label);
        cached_pair_on::<OffsetAlloc>(&mut group, size, label);
        cached_pair_on::<RangeAlloc>(&mut group, size, label);
    }
    group.finish();
}

fn cached_pair_on<A: Allocator>(group: &mut Group, size: u64, label: &str) {
    let mut allocator = A::with_capacity(size, size, 16);
    group.bench_function(BenchmarkId::new(A::NAME, label), |b| {
        b.iter(|| {
            let handle = allocator.alloc(black_box(size));
            allocator.free(black_box(handle));
        })
    });
}

/// The live set: `count` blocks of 512 B..4 KiB, allocated back to back.
fn live_sizes(count: usize) -> Vec<u64> {
    request_sizes(count, 0x5eed_0001, |rng| rng.between(512, 4 * KIB))
}

/// The timed requests: log-uniform 512 B..8 MiB, so small and large pools and splits all occur.
fn pair_sizes() -> Vec<u64> {
    request_sizes(PAIR_SIZES, 0x5eed_0002, |rng| rng.log_uniform(512, 8 * MIB))
}

/// Pairs among `live` blocks; with `fragmented`, extra blocks were allocated and every
/// `HOLE_EVERY`-th freed so that exactly `live` remain, between about `live / 16` holes.
fn pairs_among_live(c: &mut Criterion, name: &str, fragmented: bool) {
    let mut group = c.benchmark_group(name);
    let counts: &[(usize, &str)] = if fragmented { &FRAGMENTED_COUNTS } else { &LIVE_COUNTS };
    for &(live, label) in counts {
        let built = if fragmented { live + live / (HOLE_EVERY - 1) } else { live };
        let sizes = live_sizes(built);
        pairs_among_live_on::<GpuPool>(&mut group, label, &sizes, fragmented);
        pairs_among_live_on::<GpuPoolPytorch>(&mut group, label, &sizes, fragmented);
        pairs_among_live_on::<OffsetAlloc>(&mut group, label, &sizes, fragmented);
        pairs_among_live_on::<RangeAlloc>(&mut group, label, &sizes, fragmented);
    }
    group.finish();
}

fn pairs_among_live_on<A: Allocator>(group: &mut Group, label: &str, live_sizes: &[u64], fragmented: bool) {
    let pairs = pair_sizes();
    let largest = pairs.iter().copied().max().unwrap_or(0);
    // Built on first use, so that a filtered-out benchmark costs nothing (building range-alloc's
    // fragmented 1M set takes seconds).
    let mut built: Option<A> = None;
    let mut next = 0;
    group.bench_function(BenchmarkId::new(A::NAME, label), |b| {
        let allocator = built.get_or_insert_with(|| with_live_blocks(live_sizes, largest, fragmented));
        b.iter(|| {
            let handle = allocator.alloc(black_box(pairs[next % PAIR_SIZES]));
            allocator.free(black_box(handle));
            next += 1;
        })
    });
}

/// An allocator holding blocks of `sizes`, less every `HOLE_EVERY`-th one when `fragmented`,
/// with room for one more request of `largest` bytes.
fn with_live_blocks<A: Allocator>(sizes: &[u64], largest: u64, fragmented: bool) -> A {
    let live_bytes = sizes.iter().map(|&size| rounded(size)).sum();
    let mut allocator = A::with_capacity(live_bytes, largest, sizes.len());
    let mut handles: Vec<Option<A::Handle>> = sizes.iter().map(|&size| Some(allocator.alloc(size))).collect();
    if fragmented {
        for handle in handles.iter_mut().skip(HOLE_EVERY - 1).step_by(HOLE_EVERY) {
            allocator.free(handle.take().expect("allocated above"));
        }
    }
    allocator
}

fn pair_at_live_blocks(c: &mut Criterion) {
    pairs_among_live(c, "pair_at_live_blocks", false);
}

fn pair_at_live_blocks_fragmented(c: &mut Criterion) {
    pairs_among_live(c, "pair_at_live_blocks_fragmented", true);
}

criterion_group! {
    name = benches;
    config = criterion_config();
    targets = cached_pair, pair_at_live_blocks, pair_at_live_blocks_fragmented
}
criterion_main!(benches);
