//! The placement's run redirect under streams, cross-stream modes, `max_split_size` and
//! pressure: every search honours it and every invariant holds.

use super::placement::{Placement, Search};
use super::{BlockState, Config, Handle, Pool, PoolError, PoolKind, StreamId, DEFAULT_STREAM};
use crate::device::Sim;
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64, usize),
    Free(usize),
    Record(usize, usize),
    Sync,
    EmptyCache,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let size = prop::sample::select(vec![
        300u64 << 10,
        512 << 10,
        768 << 10,
        MIB,
        3 * MIB,
        16 * MIB,
        24 * MIB,
        24 * MIB,
        32 * MIB,
        (24 * MIB) - 4096,
    ]);
    let op = prop_oneof![
        6 => (size, 0usize..3).prop_map(|(s, k)| Op::Alloc(s, k)),
        5 => any::<usize>().prop_map(Op::Free),
        1 => (any::<usize>(), 0usize..3).prop_map(|(i, k)| Op::Record(i, k)),
        1 => Just(Op::Sync),
        1 => Just(Op::EmptyCache),
    ];
    prop::collection::vec(op, 1..300)
}

/// For every mid size and stream: a long run near the limit is never placed outside the small
/// range, whether among the stream's own blocks or another stream's.
fn check_consistent(pool: &Pool<Sim>, streams: &[StreamId]) -> Result<(), String> {
    for &rounded in &[300u64 << 10, 512 << 10, 768 << 10, MIB] {
        for &s in streams {
            for search in [Search::Own, Search::Foreign] {
                let Placement::Block { id, .. } = pool.place(rounded, s, search) else { continue };
                if pool.runs_to_small(rounded) && pool.heap.block_at(id).kind != PoolKind::Small {
                    return Err(format!("{search:?} placement leaves the small range a run of {rounded} goes to"));
                }
            }
        }
    }
    // Nothing allocated in the small range exceeds its page.
    let page = pool.config.paging.unwrap().page_of(PoolKind::Small);
    for seg in pool.heap.segments() {
        for b in &seg.blocks {
            if seg.kind == PoolKind::Small && b.state == BlockState::Allocated && b.size > page {
                return Err(format!("small-range block of {} bytes", b.size));
            }
        }
    }
    Ok(())
}

fn run(config: &str, capacity: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut pool = Pool::new(Sim::new(capacity), Config::parse(config).unwrap());
    let streams = [DEFAULT_STREAM, pool.create_stream().unwrap(), pool.create_stream().unwrap()];
    let mut live: Vec<Handle> = Vec::new();
    for op in ops {
        match *op {
            Op::Alloc(size, k) => match pool.alloc_on(size, streams[k]) {
                Ok(a) => live.push(a.handle),
                Err(PoolError::OutOfMemory(_)) => {}
                Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
            },
            Op::Free(i) if !live.is_empty() => {
                let h = live.swap_remove(i % live.len());
                pool.free(h).unwrap();
            }
            Op::Record(i, k) if !live.is_empty() => {
                let h = live[i % live.len()];
                pool.record_stream(h, streams[k]).unwrap();
            }
            Op::Sync => pool.synchronize().unwrap(),
            Op::EmptyCache => {
                pool.empty_cache().unwrap();
            }
            _ => {}
        }
        pool.check_invariants().map_err(TestCaseError::fail)?;
        check_consistent(&pool, &streams).map_err(TestCaseError::fail)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn placements_keep_invariants(ops in ops(), mode in 0usize..3, split in 0usize..2, cap in 0usize..2) {
        let mode = ["never", "completed", "wait"][mode];
        let split = ["", ",max_split_size_mb:64"][split];
        let capacity = [1u64 << 34, 200 * MIB][cap];
        run(&format!("strategy:default,cross_stream_reuse:{mode}{split}"), capacity, &ops)?;
    }
}

/// Other strategies, and the default without the rule, track no run.
#[test]
fn other_strategies_keep_nothing() {
    for config in ["strategy:pages", "strategy:expandable", "strategy:pytorch", "rules_off:[size_run]"] {
        let pool = Pool::new(Sim::new(1 << 30), Config::parse(config).unwrap());
        assert!(pool.run.is_none(), "{config}");
    }
}

#[test]
fn another_streams_hole_does_not_take_a_run_meant_for_the_small_range() {
    // Nearly full: 60 of 64 MiB, so a long run of one size goes to the small range.
    let mut pool = Pool::new(Sim::new(64 * MIB), Config::parse("strategy:default,cross_stream_reuse:wait").unwrap());
    let (a, b) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    // Three holes of different sizes.
    let held: Vec<_> = [16, 12, 20].iter().map(|&m| pool.alloc_on(m * MIB, a).unwrap()).collect();
    let _rest = pool.alloc_on(8 * MIB, a).unwrap();
    let run: Vec<_> = (0..8).map(|_| pool.alloc_on(512 << 10, b).unwrap()).collect();
    pool.free(held[1].handle).unwrap();
    pool.hold_stream(a).unwrap();
    let next = pool.alloc_on(512 << 10, b).unwrap();
    assert!(!(held[1].address..held[2].address).contains(&next.address), "the run's block waited for stream a");
    let within = |s: &&crate::core::SegmentInfo| (s.address..s.address + s.size).contains(&next.address);
    assert_eq!(pool.heap.segments().iter().find(within).map(|s| s.kind), Some(PoolKind::Small));
    assert!(run.iter().all(|r| r.address != next.address));
    pool.check_invariants().unwrap();
}
