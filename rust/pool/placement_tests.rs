//! Placements under streams, cross-stream modes, `max_split_size` and pressure, for the paged
//! strategies: each names a block the stream may use, and every invariant holds.

use super::placement::{Placement, Search};
use super::{BlockState, Config, Handle, Pool, PoolError, PoolKind, StreamId, DEFAULT_STREAM};
use crate::core::SHARED;
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

/// For sizes of both pool kinds and every stream: a placement among the stream's own blocks
/// names one it owns or a shared one, and one among other streams' names a block of another
/// stream, which the request then waits for; a block is in the pool kind the rules give the size.
fn check_placements(pool: &Pool<Sim>, streams: &[StreamId]) -> Result<(), String> {
    for &rounded in &[512u64, 300 << 10, MIB, 3 * MIB, 24 * MIB] {
        for &s in streams {
            for search in [Search::Own, Search::Foreign] {
                let Placement::Block { id, wait_for, .. } = pool.place(rounded, s, search) else { continue };
                let b = pool.heap.block_at(id);
                let owner = b.stream;
                let fits =
                    b.state == BlockState::Free && b.size >= rounded && b.kind == pool.heap.rules().kind(rounded);
                let allowed = match search {
                    Search::Own => (owner == s || owner == SHARED) && wait_for.is_none(),
                    _ => owner != s && owner != SHARED && wait_for == Some(owner),
                };
                if !fits || !allowed {
                    return Err(format!("{search:?} for {rounded} on {s}: block of {} owned by {owner}", b.size));
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
        check_placements(&pool, &streams).map_err(TestCaseError::fail)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn placements_name_usable_blocks(
        ops in ops(),
        strategy in 0usize..2,
        mode in 0usize..3,
        split in 0usize..2,
        cap in 0usize..2,
    ) {
        let strategy = ["default", "pages"][strategy];
        let mode = ["never", "completed", "wait"][mode];
        let split = ["", ",max_split_size_mb:64"][split];
        let capacity = [1u64 << 34, 200 * MIB][cap];
        run(&format!("strategy:{strategy},cross_stream_reuse:{mode}{split}"), capacity, &ops)?;
    }
}
