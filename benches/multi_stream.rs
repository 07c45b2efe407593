//! Stream-ordered frees: alloc/free across 4 streams with a `record_stream` use on a neighbour
//! stream (one event recorded per free, polled and destroyed by a later allocation), beside the
//! plain single-stream pair on the same sizes.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use gpupool::device::Sim;
use gpupool::pool::{Config, Pool};
use std::hint::black_box;
use std::time::{Duration, Instant};

const STREAMS: usize = 4;
/// Allocations live at once in the free benchmark (about 1 GiB of the sizes below).
const BATCH: usize = 1024;
const SIZES: [u64; 8] = [512, 4096, 65536, 1 << 20, 3 << 20, 512, 8192, 2 << 20];

fn pool_with_streams() -> (Pool<Sim>, Vec<u32>) {
    let mut pool = Pool::new(Sim::new(1 << 40), Config::default());
    let mut streams = vec![gpupool::device::DEFAULT_STREAM];
    streams.extend((1..STREAMS).map(|_| pool.create_stream().unwrap()));
    (pool, streams)
}

/// A full alloc+free pair per iteration.
fn pairs(c: &mut Criterion) {
    let mut group = c.benchmark_group("multi_stream_pair");
    let (mut pool, _) = pool_with_streams();
    let mut i = 0;
    group.bench_function(BenchmarkId::new("single_stream", "plain"), |b| {
        b.iter(|| {
            let a = pool.alloc(black_box(SIZES[i % SIZES.len()])).unwrap();
            pool.free(black_box(a.handle)).unwrap();
            i += 1;
        })
    });
    let (mut pool, streams) = pool_with_streams();
    group.bench_function(BenchmarkId::new("4_streams", "record_stream"), |b| {
        b.iter(|| {
            let s = streams[i % STREAMS];
            let a = pool.alloc_on(black_box(SIZES[i % SIZES.len()]), s).unwrap();
            pool.record_stream(a.handle, streams[(i + 1) % STREAMS]).unwrap();
            pool.free(black_box(a.handle)).unwrap();
            i += 1;
        })
    });
    group.finish();
}

/// The free alone: plain, and with one recorded use (which records an event).
fn frees(c: &mut Criterion) {
    let mut group = c.benchmark_group("multi_stream_free");
    for (name, with_use) in [("plain", false), ("record_stream", true)] {
        let (mut pool, streams) = pool_with_streams();
        group.bench_function(BenchmarkId::new("free", name), |b| {
            // Allocate batches untimed, then time freeing them; batches bound the live memory.
            b.iter_custom(|iters| {
                let mut elapsed = Duration::ZERO;
                let mut left = iters as usize;
                while left > 0 {
                    let batch = left.min(BATCH);
                    left -= batch;
                    let handles: Vec<_> = (0..batch)
                        .map(|i| {
                            let a = pool.alloc_on(SIZES[i % SIZES.len()], streams[i % STREAMS]).unwrap();
                            if with_use {
                                pool.record_stream(a.handle, streams[(i + 1) % STREAMS]).unwrap();
                            }
                            a.handle
                        })
                        .collect();
                    let start = Instant::now();
                    for handle in handles {
                        pool.free(black_box(handle)).unwrap();
                    }
                    elapsed += start.elapsed();
                    pool.synchronize().unwrap();
                }
                elapsed
            })
        });
    }
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}

criterion_group! { name = benches; config = config(); targets = pairs, frees }
criterion_main!(benches);
