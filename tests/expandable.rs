//! Expandable segments: random programs keep every invariant, data stays intact, and freed
//! holes stop costing memory once their pages are unmapped.

use gpupool::core::{Metric, StatType};
use gpupool::device::{Device, Host, Sim};
use gpupool::pool::{Allocation, Config, Pool, PoolError};
use proptest::prelude::*;
use std::collections::BTreeMap;

const MIB: u64 = 1 << 20;

fn config() -> Config {
    Config::parse("strategy:expandable").unwrap()
}

fn reserved<D: Device>(pool: &Pool<D>) -> u64 {
    pool.stats().get(Metric::ReservedBytes, StatType::All).current
}

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64),
    Free(usize),
    EmptyCache,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let size = prop_oneof![3 => 1u64..(1 << 20), 2 => (1u64 << 20)..(24 << 20)];
    let op =
        prop_oneof![6 => size.prop_map(Op::Alloc), 5 => any::<usize>().prop_map(Op::Free), 1 => Just(Op::EmptyCache)];
    prop::collection::vec(op, 1..250)
}

fn run<D: Device>(mut pool: Pool<D>, ops: &[Op], data: bool) {
    let mut live: BTreeMap<u64, Allocation> = BTreeMap::new();
    for op in ops {
        match *op {
            Op::Alloc(size) => match pool.alloc(size) {
                Ok(a) => {
                    if data {
                        pool.write(a.handle, 0, &a.address.to_le_bytes()[..size.min(8) as usize]).unwrap();
                    }
                    live.insert(a.address, a);
                }
                Err(PoolError::OutOfMemory(_)) => {}
                Err(e) => panic!("{e}"),
            },
            Op::Free(i) if !live.is_empty() => {
                let address = *live.keys().nth(i % live.len()).unwrap();
                let a = live.remove(&address).unwrap();
                if data {
                    let mut out = vec![0; a.size.min(8) as usize];
                    pool.read(a.handle, 0, &mut out).unwrap();
                    assert_eq!(out, &a.address.to_le_bytes()[..out.len()]);
                }
                pool.free(a.handle).unwrap();
            }
            Op::Free(_) => {}
            Op::EmptyCache => {
                pool.empty_cache().unwrap();
            }
        }
        pool.check_invariants().unwrap();
        let mut end = 0;
        for (&address, a) in &live {
            assert!(address >= end, "overlap at {address:#x}");
            end = address + a.size;
        }
        let live_bytes: u64 = live.values().map(|a| a.size).sum();
        assert!(reserved(&pool) >= live_bytes);
    }
    for (_, a) in live {
        pool.free(a.handle).unwrap();
    }
    pool.empty_cache().unwrap();
    pool.check_invariants().unwrap();
    assert_eq!((reserved(&pool), pool.device().memory_info().held), (0, 0));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn sim_programs_keep_invariants(ops in ops()) {
        run(Pool::new(Sim::new(160 * MIB), config()), &ops, false);
    }

    #[test]
    fn host_programs_keep_data(ops in ops()) {
        run(Pool::new(Host::new(Some(160 * MIB)), config()), &ops, true);
    }
}

#[test]
fn allocation_order_no_longer_changes_reservation() {
    // PyTorch reserves 256 MiB for 8 x 16 MiB then 4 x 32 MiB; one address range needs 128.
    let mut pool = Pool::new(Sim::new(1 << 40), config());
    let mut maps = Vec::new();
    for (size, count) in [(16, 8), (32, 4)] {
        let live: Vec<_> = (0..count).map(|_| pool.alloc(size * MIB).unwrap()).collect();
        live.into_iter().for_each(|a| pool.free(a.handle).unwrap());
        maps.push(pool.stats().num_device_map);
    }
    // 128 MiB live at most, plus what one map call reaches ahead (20 MiB).
    assert!(pool.stats().get(Metric::ReservedBytes, StatType::All).peak <= 148 * MIB);
    assert_eq!(maps[0], maps[1], "the pages mapped for the first wave serve the second");
}

#[test]
fn holes_are_unmapped_under_pressure() {
    // Every other 8 MiB block freed leaves 8 MiB holes no 12 MiB request fits; with plain
    // segments this capacity would be exhausted, here the holes' pages move to the new block.
    let mut pool = Pool::new(Sim::new(72 * MIB), config());
    let blocks: Vec<_> = (0..8).map(|_| pool.alloc(8 * MIB).unwrap()).collect();
    for a in blocks.iter().step_by(2) {
        pool.free(a.handle).unwrap();
    }
    let big = pool.alloc(24 * MIB).unwrap();
    assert_eq!(pool.stats().num_alloc_retries, 1);
    assert!(pool.stats().num_device_unmap >= 1);
    pool.check_invariants().unwrap();
    pool.free(big.handle).unwrap();
}
