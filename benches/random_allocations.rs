//! RMM's random_allocations scenario: `n` allocations with sizes uniform in 1 B..=max, 73%
//! allocate / 27% free under a 16000 MiB cap on live bytes; gpupool on `sim` beside
//! offset-allocator and range-alloc, all replaying one seeded program per parameter.

mod common;

use common::{
    bench_warm_replay, criterion_config, random_allocations, GpuPool, GpuPoolPytorch, OffsetAlloc, RangeAlloc, COUNTS,
    MAX_SIZES_MIB, MAX_USAGE, MIB, RANDOM_SEED,
};
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};

fn random_allocations_bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("random_allocations");
    // One iteration replays a whole program (up to a second for range-alloc), so samples are
    // flat and few.
    group.sampling_mode(SamplingMode::Flat).sample_size(10);
    for n in COUNTS {
        for max_mib in MAX_SIZES_MIB {
            let program = random_allocations(n, max_mib * MIB, MAX_USAGE, RANDOM_SEED);
            group.throughput(Throughput::Elements(program.ops.len() as u64));
            let label = format!("n={n},max={max_mib}MiB");
            bench_warm_replay::<GpuPool>(&mut group, &label, &program);
            bench_warm_replay::<GpuPoolPytorch>(&mut group, &label, &program);
            bench_warm_replay::<OffsetAlloc>(&mut group, &label, &program);
            bench_warm_replay::<RangeAlloc>(&mut group, &label, &program);
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = criterion_config();
    targets = random_allocations_bench
}
criterion_main!(benches);
