//! RMM's replay scenario on the real traces in `../shared/traces`: the trace replay driver
//! (a fresh pool per run, as `gpupool replay` does) beside the same allocations and frees on a
//! warm gpupool and on offset-allocator and range-alloc. Throughput is in trace events.

mod common;

use common::{bench_warm_replay, criterion_config, GpuPool, OffsetAlloc, Op, Program, RangeAlloc};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput};
use gpupool::device::Sim;
use gpupool::pool::{Config, Pool};
use gpupool::trace::replay::JobActions;
use gpupool::trace::{csv, replay, Action, Trace};
use std::path::Path;

const TRACES: [&str; 3] = ["resnet50_train.csv.gz", "llama_train.csv.gz", "bert_serve_varbatch.csv.gz"];

/// The trace's allocations and frees as the peers' program (zero-byte allocations hold nothing).
fn program(trace: &Trace) -> Program {
    let sized: Vec<bool> = {
        let mut sized = vec![false; trace.allocations()];
        for e in trace.events().iter().filter(|e| e.action == Action::Alloc) {
            sized[e.slot as usize] = e.size > 0;
        }
        sized
    };
    let ops = trace
        .events()
        .iter()
        .filter(|e| e.action != Action::Failure && sized[e.slot as usize])
        .map(|e| match e.action {
            Action::Alloc => Op::Alloc { slot: e.slot as usize, size: e.size },
            _ => Op::Free { slot: e.slot as usize },
        })
        .collect();
    Program { ops, slots: trace.allocations() }
}

fn replay_bench(c: &mut Criterion) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces");
    let mut group = c.benchmark_group("replay");
    group.sampling_mode(SamplingMode::Flat);
    for name in TRACES {
        let Ok(trace) = csv::read_path(&dir.join(name)) else {
            eprintln!("skipping {name}: not found in {}", dir.display());
            continue;
        };
        let label = name.trim_end_matches(".csv.gz");
        group.throughput(Throughput::Elements(trace.events().len() as u64));
        // Every strategy on the same trace: what `gpupool replay` measures, side by side.
        for strategy in ["default", "pytorch", "expandable", "pages", "bfc", "arena", "eager", "direct"] {
            let config = Config::parse(&format!("strategy:{strategy}")).unwrap();
            group.bench_function(BenchmarkId::new(format!("trace::replay/{strategy}"), label), |b| {
                b.iter(|| {
                    replay::replay(&trace, &mut Pool::new(Sim::new(1 << 40), config.clone()), None, JobActions::Honour)
                        .unwrap()
                })
            });
        }
        let program = program(&trace);
        bench_warm_replay::<GpuPool>(&mut group, label, &program);
        bench_warm_replay::<OffsetAlloc>(&mut group, label, &program);
        bench_warm_replay::<RangeAlloc>(&mut group, label, &program);
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = criterion_config();
    targets = replay_bench
}
criterion_main!(benches);
