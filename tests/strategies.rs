//! Each strategy's own behaviour, and the settings that give memory back: the release
//! watermark, PyTorch's garbage collection, the memory fraction and the out-of-memory ladder.

use gpupool::core::{Metric, StatType};
use gpupool::device::{Device, Sim};
use gpupool::pool::{Config, Pool, PoolError};

const MIB: u64 = 1 << 20;

/// A pool with `config`; PyTorch's plain segments unless it names another strategy.
fn pool(capacity: u64, config: &str) -> Pool<Sim> {
    let named = config.contains("strategy:") || config.contains("expandable_segments");
    let config = if named { config.to_string() } else { format!("strategy:pytorch,{config}") };
    Pool::new(Sim::new(capacity), Config::parse(&config).unwrap())
}

fn reserved<D: Device>(pool: &Pool<D>) -> u64 {
    pool.stats().get(Metric::ReservedBytes, StatType::All).current
}

fn segment_addresses<D: Device>(pool: &Pool<D>) -> Vec<u64> {
    pool.segments().iter().map(|s| s.address).collect()
}

#[test]
fn bfc_regions_double_from_2_mib() {
    let mut pool = pool(1 << 40, "strategy:bfc");
    let a = pool.alloc(1000).unwrap();
    assert_eq!(pool.block_of(a.handle).unwrap().1, 1024, "256 B granules");
    assert_eq!(reserved(&pool), 2 * MIB);
    // The next region doubles; 3 MiB of a 4 MiB region is not split (less than half is left).
    let b = pool.alloc(3 * MIB).unwrap();
    assert_eq!((reserved(&pool), pool.block_of(b.handle).unwrap().1), (6 * MIB, 4 * MIB));
    // A request bigger than the region makes it grow to fit, and that size is the next one.
    pool.alloc(20 * MIB).unwrap();
    assert_eq!(reserved(&pool), 38 * MIB);
    pool.alloc(20 * MIB).unwrap();
    assert_eq!(reserved(&pool), 70 * MIB);
    pool.check_invariants().unwrap();
}

#[test]
fn bfc_regions_are_capped_by_what_the_device_has_left() {
    let mut pool = pool(100 * MIB, "strategy:bfc");
    pool.alloc(50 * MIB).unwrap();
    pool.alloc(30 * MIB).unwrap();
    assert_eq!(reserved(&pool), 100 * MIB, "the 128 MiB region shrank to the 36 MiB left, then 50 + 50");
    pool.check_invariants().unwrap();
}

#[test]
fn arena_preallocates_and_grows_by_doubling_units() {
    let mut pool = pool(1 << 30, "strategy:arena,initial_pool_size_mb:64");
    assert_eq!((reserved(&pool), pool.stats().num_device_alloc), (64 * MIB, 1));
    let small = pool.alloc(1000).unwrap();
    let other = pool.alloc(5000).unwrap();
    assert_eq!(pool.block_of(other.handle).unwrap().0, small.address + 1024, "split to the granule");
    pool.alloc(100 * MIB).unwrap();
    assert_eq!(reserved(&pool), 192 * MIB, "64 MiB doubled until 100 MiB fits");
    // The default unit is 1 GiB, capped by the device's capacity.
    assert_eq!(reserved(&self::pool(512 * MIB, "strategy:arena")), 512 * MIB);
    pool.check_invariants().unwrap();
}

#[test]
fn eager_splits_as_bfc_over_pytorch_segments() {
    for (strategy, block) in [("pytorch", 12 * MIB), ("eager", 20 * MIB)] {
        let mut pool = pool(1 << 40, &format!("strategy:{strategy}"));
        let a = pool.alloc(5 * MIB).unwrap();
        assert_eq!(reserved(&pool), 20 * MIB);
        pool.free(a.handle).unwrap();
        // PyTorch splits a cached 20 MiB block for 12 MiB; BFC's rule keeps it whole.
        let b = pool.alloc(12 * MIB).unwrap();
        assert_eq!(pool.block_of(b.handle).unwrap().1, block, "{strategy}");
    }
}

#[test]
fn direct_gives_every_free_back() {
    let mut pool = pool(1 << 30, "strategy:direct");
    let a = pool.alloc(1000).unwrap();
    let b = pool.alloc(3 * MIB).unwrap();
    assert_eq!(reserved(&pool), 1024 + 3 * MIB);
    pool.free(a.handle).unwrap();
    assert_eq!(reserved(&pool), 3 * MIB);
    pool.free(b.handle).unwrap();
    let stats = pool.stats();
    assert_eq!((reserved(&pool), stats.num_device_alloc, stats.num_device_free), (0, 2, 2));
}

#[test]
fn the_watermark_releases_the_oldest_idle_segments_first() {
    let mut pool = pool(1 << 30, "release_threshold:0.4");
    let [a, b, c] = [0; 3].map(|_| pool.alloc(12 * MIB).unwrap());
    pool.free(a.handle).unwrap();
    assert_eq!(reserved(&pool), 36 * MIB, "a third free is under the watermark");
    // A large allocation ages `a` by one.
    let d = pool.alloc(30 * MIB).unwrap();
    pool.free(b.handle).unwrap();
    assert_eq!(reserved(&pool), 66 * MIB);
    pool.free(c.handle).unwrap();
    // 36 of 66 MiB free is over 0.4: `a` (the oldest), then `b` go; 12 of 42 MiB is under.
    assert_eq!(reserved(&pool), 42 * MIB);
    assert_eq!(segment_addresses(&pool), [c.address, d.address]);
    assert_eq!(pool.stats().num_device_free, 2);
    pool.check_invariants().unwrap();
}

#[test]
fn garbage_collection_frees_the_older_idle_segments_first() {
    // Allowed 200 MiB; collection starts above 0.6 of that.
    let mut pool = pool(400 * MIB, "per_process_memory_fraction:0.5,garbage_collection_threshold:0.6");
    let big = [0; 5].map(|_| pool.alloc(30 * MIB).unwrap());
    pool.alloc(2 * MIB).unwrap();
    pool.free(big[0].handle).unwrap();
    pool.free(big[1].handle).unwrap();
    // Three large allocations (from the 20 MiB segment's free tail) age the two idle segments.
    for _ in 0..3 {
        pool.alloc(2 * MIB).unwrap();
    }
    for a in &big[2..] {
        pool.free(a.handle).unwrap();
    }
    assert_eq!(reserved(&pool), 170 * MIB);
    // No cached block fits 40 MiB: collection frees the two aged segments (60 MiB of the 50
    // over the threshold), not the three just freed.
    pool.alloc(40 * MIB).unwrap();
    assert_eq!(reserved(&pool), 150 * MIB);
    let kept = segment_addresses(&pool);
    assert!(!kept.contains(&big[0].address) && !kept.contains(&big[1].address));
    assert!(big[2..].iter().all(|a| kept.contains(&a.address)));
    pool.check_invariants().unwrap();
}

#[test]
fn garbage_collection_is_inert_without_a_fraction() {
    let mut pool = pool(400 * MIB, "garbage_collection_threshold:0.1");
    let a = pool.alloc(30 * MIB).unwrap();
    pool.free(a.handle).unwrap();
    pool.alloc(40 * MIB).unwrap();
    assert_eq!(reserved(&pool), 70 * MIB);
}

#[test]
fn the_memory_fraction_caps_the_pool_and_says_so() {
    let mut pool = pool(400 * MIB, "per_process_memory_fraction:0.25");
    pool.alloc(60 * MIB).unwrap();
    match pool.alloc(60 * MIB) {
        Err(PoolError::OutOfMemory(report)) => {
            assert_eq!(report.limit, Some(100 * MIB));
            let text = report.to_string();
            assert!(text.contains("per_process_memory_fraction"), "{text}");
        }
        other => panic!("expected OOM, got {other:?}"),
    }
    assert_eq!(reserved(&pool), 60 * MIB);
    pool.check_invariants().unwrap();
}

#[test]
fn oversize_cached_blocks_go_back_before_the_flush() {
    let mut pool = pool(100 * MIB, "max_split_size_mb:20");
    let big = pool.alloc(64 * MIB).unwrap();
    pool.free(big.handle).unwrap();
    pool.alloc(4 * MIB).unwrap();
    assert_eq!(reserved(&pool), 84 * MIB);
    // 30 MiB more does not fit; the idle 64 MiB segment (which it may not use) goes back.
    pool.alloc(30 * MIB).unwrap();
    assert_eq!(reserved(&pool), 50 * MIB);
    assert_eq!((pool.stats().num_device_free, pool.stats().num_alloc_retries), (1, 0));
}

#[test]
fn an_oom_from_fragmentation_suggests_the_default_pager() {
    let mut pool = pool(25 * MIB, "");
    let quarters = [0; 4].map(|_| pool.alloc(5 * MIB).unwrap());
    pool.free(quarters[0].handle).unwrap();
    pool.free(quarters[2].handle).unwrap();
    let Err(PoolError::OutOfMemory(report)) = pool.alloc(8 * MIB) else { panic!("expected OOM") };
    let text = report.to_string();
    assert!(text.contains("fragmentation") && text.contains("strategy:default"), "{text}");
    assert!(!text.contains("max_split_size_mb"), "useless below 20 MiB: {text}");
}

#[test]
fn roundup_power2_divisions_round_requests() {
    let mut pool = pool(1 << 30, "roundup_power2_divisions:4");
    let a = pool.alloc(MIB + 1).unwrap();
    assert_eq!(pool.block_of(a.handle).unwrap().1, MIB + 256 * 1024);
}
