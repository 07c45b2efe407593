//! Property tests: random alloc/free/empty_cache programs against a shadow model, for every
//! strategy; then PyTorch's documented behaviour and each strategy's own.

use gpupool::core::{BlockState, Metric, SegmentInfo, StatType};
use gpupool::device::{Device, FaultPlan, FaultSchedule, Faulty, Host, Sim};
use gpupool::pool::{Allocation, Config, Pool, PoolError};
use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64),
    /// Frees the live allocation at this position (modulo the number live).
    Free(usize),
    EmptyCache,
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 1u64..4096,
        3 => 1u64..(1 << 20),
        2 => (1u64 << 20)..(12 << 20),
        1 => (1u64 << 20)..(64 << 20),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => size_strategy().prop_map(Op::Alloc),
        5 => any::<usize>().prop_map(Op::Free),
        1 => Just(Op::EmptyCache),
    ]
}

/// What the pool must agree with: live allocations by address, with their requested sizes.
#[derive(Default)]
struct Shadow {
    live: BTreeMap<u64, (Allocation, u64)>,
}

impl Shadow {
    fn check<D: Device>(&self, pool: &Pool<D>) {
        pool.check_invariants().unwrap();
        let stats = pool.stats();
        let current = |m| stats.get(m, StatType::All).current;
        assert_eq!(current(Metric::Allocation), self.live.len() as u64);
        let requested: u64 = self.live.values().map(|(a, _)| a.size).sum();
        assert_eq!(current(Metric::RequestedBytes), requested);
        let block_bytes: u64 = self.live.values().map(|(_, block)| block).sum();
        assert_eq!(current(Metric::AllocatedBytes), block_bytes);
        let mut end = 0;
        for (&address, (a, block)) in &self.live {
            assert!(address >= end, "allocations overlap at {address:#x}");
            assert_eq!(address % pool.rules().granule, 0);
            assert!(*block >= pool.rules().round(a.size));
            end = address + block;
        }
        let segments = pool.segments();
        for (&address, (_, block)) in &self.live {
            assert!(segments.iter().any(|s| s.address <= address && address + block <= s.address + s.size));
        }
    }
}

/// Every strategy the engine offers; `default` joins once it parses.
const STRATEGIES: &[&str] = &["default", "pytorch", "bfc", "arena", "eager", "direct", "expandable", "pages"];

/// `settings` under each strategy that takes them (a strategy setting wins over a `strategy:`
/// inside); BFC and the arena refuse `max_split_size_mb`.
fn configs(settings: &str) -> impl Iterator<Item = Config> + '_ {
    let takes = move |s: &&&str| !(settings.contains("max_split_size_mb") && matches!(**s, "bfc" | "arena"));
    STRATEGIES.iter().filter(takes).map(move |s| Config::parse(&format!("strategy:{s},{settings}")).unwrap())
}

/// After a free, the release watermark holds unless no idle segment is left to give back.
fn check_watermark<D: Device>(pool: &Pool<D>) {
    let Some(threshold) = pool.config().release_threshold.filter(|_| pool.config().paging.is_none()) else { return };
    let stat = |m| pool.stats().get(m, StatType::All).current;
    let (reserved, free) = (stat(Metric::ReservedBytes), stat(Metric::ReservedBytes) - stat(Metric::ActiveBytes));
    let idle = |s: &SegmentInfo| s.blocks.len() == 1 && s.blocks[0].state == BlockState::Free;
    if free as f64 > threshold * reserved as f64 {
        assert!(!pool.segments().iter().any(idle), "over the watermark with an idle segment left");
    }
}

/// The pool never reserves more than its memory fraction allows, paged strategies included.
fn check_limit<D: Device>(pool: &Pool<D>) {
    let (Some(fraction), Some(total)) = (pool.config().per_process_memory_fraction, pool.device().memory_info().total)
    else {
        return;
    };
    let reserved = pool.stats().get(Metric::ReservedBytes, StatType::All).current;
    assert!(
        reserved as f64 <= fraction * total as f64,
        "{:?}: {reserved} reserved beyond the fraction {fraction}",
        pool.config().strategy
    );
}

fn run<D: Device>(mut pool: Pool<D>, ops: &[Op], verify_data: bool) {
    let mut shadow = Shadow::default();
    pool.check_invariants().unwrap();
    for op in ops {
        match *op {
            Op::Alloc(size) => match pool.alloc(size) {
                Ok(a) => {
                    let (address, block) = pool.block_of(a.handle).unwrap();
                    assert_eq!(address, a.address);
                    if verify_data {
                        pool.write(a.handle, 0, &pattern(a.address, a.size)).unwrap();
                    }
                    shadow.live.insert(a.address, (a, block));
                }
                Err(PoolError::OutOfMemory(report)) => {
                    assert_eq!(report.requested, size);
                    assert!(report.reserved >= report.allocated);
                }
                Err(e) => panic!("unexpected error {e}"),
            },
            Op::Free(i) if !shadow.live.is_empty() => {
                let address = *shadow.live.keys().nth(i % shadow.live.len()).unwrap();
                let (a, _) = shadow.live.remove(&address).unwrap();
                if verify_data {
                    let mut out = vec![0; pattern_len(a.size)];
                    pool.read(a.handle, 0, &mut out).unwrap();
                    assert_eq!(out, pattern(a.address, a.size), "data corrupted at {address:#x}");
                }
                pool.free(a.handle).unwrap();
                assert!(matches!(pool.free(a.handle), Err(PoolError::Heap(_))), "double free must fail");
                check_watermark(&pool);
            }
            Op::Free(_) => {}
            Op::EmptyCache => {
                pool.empty_cache().unwrap();
            }
        }
        shadow.check(&pool);
        check_limit(&pool);
    }
    for (_, (a, _)) in std::mem::take(&mut shadow.live) {
        pool.free(a.handle).unwrap();
    }
    pool.empty_cache().unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(pool.stats().get(Metric::ReservedBytes, StatType::All).current, 0);
    assert_eq!(pool.device().memory_info().held, 0);
}

fn pattern_len(size: u64) -> usize {
    size.min(256) as usize
}

fn pattern(address: u64, size: u64) -> Vec<u8> {
    (0..pattern_len(size)).map(|i| (address >> 9) as u8 ^ i as u8 ^ size as u8).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn sim_pool_matches_shadow(ops in prop::collection::vec(op_strategy(), 1..300)) {
        for config in configs("") {
            run(Pool::new(Sim::new(256 << 20), config), &ops, false);
        }
    }

    #[test]
    fn host_pool_keeps_data_intact(ops in prop::collection::vec(op_strategy(), 1..200)) {
        for config in configs("") {
            run(Pool::new(Host::new(Some(192 << 20)), config), &ops, true);
        }
    }

    #[test]
    fn refused_segments_are_clean_ooms(
        ops in prop::collection::vec(op_strategy(), 1..200),
        seed in any::<u64>(),
    ) {
        for config in configs("") {
            let device = Faulty::new(Sim::new(1 << 30), FaultPlan::new(FaultSchedule::Probability { p: 0.3, seed }));
            run(Pool::new(device, config), &ops, false);
        }
    }

    #[test]
    fn max_split_size_is_honoured(ops in prop::collection::vec(op_strategy(), 1..200)) {
        for config in configs("max_split_size_mb:24") {
            run(Pool::new(Sim::new(512 << 20), config), &ops, false);
        }
    }

    #[test]
    fn release_and_limit_settings_keep_the_pool_consistent(
        ops in prop::collection::vec(op_strategy(), 1..200),
        settings in prop::sample::select(&[
            "release_threshold:0.2",
            "release_threshold:0",
            "per_process_memory_fraction:0.5,garbage_collection_threshold:0.6",
            "per_process_memory_fraction:0.3,max_split_size_mb:20",
            "roundup_power2_divisions:[1:4,>:8],initial_pool_size_mb:48",
            "initial_pool_size_mb:100,release_threshold:0.5",
        ][..]),
    ) {
        for config in configs(settings) {
            run(Pool::new(Sim::new(512 << 20), config), &ops, false);
        }
    }
}

const MIB: u64 = 1 << 20;

/// PyTorch's rules, named: the fidelity tests must not follow a change of the default.
fn pytorch() -> Config {
    Config::parse("strategy:pytorch").unwrap()
}

fn reserved<D: Device>(pool: &Pool<D>) -> u64 {
    pool.stats().get(Metric::ReservedBytes, StatType::All).current
}

#[test]
fn pytorch_segment_sizes() {
    let fresh = || Pool::new(Sim::new(1 << 40), pytorch());
    let mut pool = fresh();
    pool.alloc(MIB * 3 / 2).unwrap();
    assert_eq!(reserved(&pool), 20 * MIB);
    let mut pool = fresh();
    let a = pool.alloc(11 * MIB + 1).unwrap();
    assert_eq!(pool.rules().round(11 * MIB + 1), 11 * MIB + 512);
    // Less than 1 MiB would remain, so the large pool hands out the whole segment.
    assert_eq!(pool.block_of(a.handle).unwrap().1, 12 * MIB);
    assert_eq!(reserved(&pool), 12 * MIB);
    let mut pool = fresh();
    pool.alloc(1000).unwrap();
    pool.alloc(1000).unwrap();
    assert_eq!(reserved(&pool), 2 * MIB);
}

#[test]
fn allocation_order_changes_reservation_as_in_pytorch() {
    let run_order = |first: (u64, usize), second: (u64, usize)| {
        let mut pool = Pool::new(Sim::new(1 << 40), pytorch());
        for (size, count) in [first, second] {
            let live: Vec<_> = (0..count).map(|_| pool.alloc(size * MIB).unwrap()).collect();
            live.into_iter().for_each(|a| pool.free(a.handle).unwrap());
        }
        reserved(&pool)
    };
    assert_eq!(run_order((16, 8), (32, 4)), 256 * MIB);
    assert_eq!(run_order((32, 4), (16, 8)), 128 * MIB);
}

#[test]
fn max_split_size_keeps_big_blocks_for_big_requests() {
    let mut pool = Pool::new(Sim::new(1 << 40), Config::parse("strategy:pytorch,max_split_size_mb:20").unwrap());
    let big = pool.alloc(64 * MIB).unwrap();
    pool.free(big.handle).unwrap();
    pool.alloc(4 * MIB).unwrap();
    assert_eq!(reserved(&pool), 84 * MIB, "the 64 MiB block must not serve 4 MiB");
}

#[test]
fn oom_flushes_cache_then_retries() {
    let mut pool = Pool::new(Sim::new(40 * MIB), pytorch());
    let a = pool.alloc(12 * MIB).unwrap();
    pool.free(a.handle).unwrap();
    pool.alloc(30 * MIB).unwrap();
    assert_eq!(pool.stats().num_alloc_retries, 1);
    assert_eq!(pool.stats().num_device_free, 1);
    match pool.alloc(30 * MIB) {
        Err(PoolError::OutOfMemory(report)) => {
            assert_eq!(report.requested, 30 * MIB);
            assert_eq!(report.capacity, Some(40 * MIB));
            let text = report.to_string();
            assert!(text.contains("30.00 MiB") && text.contains("fragmentation"), "{text}");
        }
        other => panic!("expected OOM, got {other:?}"),
    }
    assert_eq!(pool.stats().num_ooms, 1);
    pool.check_invariants().unwrap();
}

#[test]
fn invalid_sizes_are_refused() {
    let mut pool = Pool::new(Sim::new(MIB), Config::default());
    assert_eq!(pool.alloc(0), Err(PoolError::InvalidSize(0)));
    assert_eq!(pool.alloc(u64::MAX), Err(PoolError::InvalidSize(u64::MAX)));
    pool.check_invariants().unwrap();
}
