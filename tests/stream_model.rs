//! Property test: random programs over 4 streams (alloc, record_stream, free, hold,
//! synchronize, replacing a stream by a new one) never hand a block to a stream while another
//! stream may still use it.

use gpupool::core::{Metric, StatType};
use gpupool::device::{Device, Sim};
use gpupool::pool::{Allocation, Config, CrossStreamReuse, Pool, PoolError};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
/// Plain segments, paged ranges, and a pre-allocated arena shared by all streams.
const STRATEGIES: &[&str] = &["default", "pytorch", "expandable", "pages", "arena", "bfc"];

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: u64,
        stream: usize,
    },
    Record {
        which: usize,
        stream: usize,
    },
    Free(usize),
    Hold(usize),
    Synchronize(usize),
    SynchronizeAll,
    /// Destroys a side stream (its live allocations pass to the default stream) and creates a
    /// new one in its place.
    Replace(usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let stream = 0usize..4;
    let size = prop_oneof![1u64..(64 << 10), 1u64..(4 * MIB), 1u64..(24 * MIB)];
    let op = prop_oneof![
        5 => (size, stream.clone()).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        2 => (any::<usize>(), stream.clone()).prop_map(|(which, stream)| Op::Record { which, stream }),
        4 => any::<usize>().prop_map(Op::Free),
        2 => stream.clone().prop_map(Op::Hold),
        2 => stream.prop_map(Op::Synchronize),
        1 => Just(Op::SynchronizeAll),
        1 => (1usize..4).prop_map(Op::Replace),
    ];
    prop::collection::vec(op, 1..200)
}

struct Live {
    a: Allocation,
    stream: usize,
    uses: Vec<usize>,
}

/// A freed range that a stream may still be working on.
struct Busy {
    start: u64,
    end: u64,
    stream: usize,
}

fn run(mode: CrossStreamReuse, strategy: &str, ops: &[Op]) {
    let config = Config::parse(&format!("strategy:{strategy},cross_stream_reuse:{}", mode.name())).unwrap();
    let mut pool = Pool::new(Sim::new(160 * MIB), config);
    let mut streams: Vec<u32> = std::iter::once(0).chain((0..3).map(|_| pool.create_stream().unwrap())).collect();
    let (mut live, mut busy): (Vec<Live>, Vec<Busy>) = (Vec::new(), Vec::new());
    for op in ops {
        // Work on an idle stream has finished: its freed ranges are safe from it.
        let idle: Vec<bool> = streams.iter().map(|&s| pool.query_stream(s).unwrap()).collect();
        busy.retain(|b| !idle[b.stream]);
        match *op {
            Op::Alloc { size, stream } => match pool.alloc_on(size, streams[stream]) {
                Ok(a) => {
                    // Out of memory, the pool may synchronize streams: then their ranges are safe.
                    let idle: Vec<bool> = streams.iter().map(|&s| pool.query_stream(s).unwrap()).collect();
                    busy.retain(|b| !idle[b.stream] || b.stream == stream);
                    for b in
                        busy.iter().filter(|b| b.stream != stream && b.start < a.address + size && a.address < b.end)
                    {
                        assert_eq!(
                            mode,
                            CrossStreamReuse::Wait,
                            "{:#x} reached stream {stream} while {} uses it",
                            a.address,
                            b.stream
                        );
                        assert!(!pool.query_stream(streams[stream]).unwrap(), "the new stream must wait");
                    }
                    live.push(Live { a, stream, uses: Vec::new() });
                }
                Err(PoolError::OutOfMemory(_)) => {}
                Err(e) => panic!("{e}"),
            },
            Op::Record { which, stream } if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[which % n];
                pool.record_stream(l.a.handle, streams[stream]).unwrap();
                l.uses.push(stream);
            }
            Op::Free(which) if !live.is_empty() => {
                let l = live.swap_remove(which % live.len());
                pool.free(l.a.handle).unwrap();
                for s in l.uses.into_iter().chain([l.stream]) {
                    if !pool.query_stream(streams[s]).unwrap() {
                        busy.push(Busy { start: l.a.address, end: l.a.address + l.a.size, stream: s });
                    }
                }
            }
            Op::Hold(s) => pool.hold_stream(streams[s]).unwrap(),
            Op::Synchronize(s) => pool.synchronize_stream(streams[s]).unwrap(),
            Op::SynchronizeAll => {
                pool.synchronize().unwrap();
                assert_eq!(pool.pending_bytes(), 0);
            }
            Op::Replace(s) => {
                pool.destroy_stream(streams[s]).unwrap();
                streams[s] = pool.create_stream().unwrap();
                // Destroying waited for the stream; what it owned, the default stream now owns.
                busy.retain(|b| b.stream != s);
                for l in &mut live {
                    l.uses.retain(|&u| u != s);
                    if l.stream == s {
                        l.stream = 0;
                        assert_eq!(pool.stream_of(l.a.handle).unwrap(), streams[0]);
                    }
                }
            }
            Op::Record { .. } | Op::Free(_) => {}
        }
        pool.check_invariants().unwrap();
        let allocated: u64 = live.len() as u64;
        assert_eq!(pool.stats().get(Metric::Allocation, StatType::All).current, allocated);
    }
    for l in live {
        pool.free(l.a.handle).unwrap();
    }
    pool.empty_cache().unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(pool.device().memory_info().held, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn never_reuses_across_streams(ops in ops(), strategy in prop::sample::select(STRATEGIES)) {
        run(CrossStreamReuse::Never, strategy, &ops);
    }

    #[test]
    fn completed_reuses_only_after_events(ops in ops(), strategy in prop::sample::select(STRATEGIES)) {
        run(CrossStreamReuse::Completed, strategy, &ops);
    }

    #[test]
    fn wait_orders_the_new_stream_after_the_old(ops in ops(), strategy in prop::sample::select(STRATEGIES)) {
        run(CrossStreamReuse::Wait, strategy, &ops);
    }
}
