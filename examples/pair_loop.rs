//! A cached alloc+free pair (64 KiB, or SIZE bytes) on `sim` with the default strategy, `N`
//! times: for counting instructions per pair with callgrind, which stays steady where
//! wall-clock times do not.
//!
//! cargo build --release --example pair_loop
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/pair_loop 100000 [SIZE]
//! (the count at 200000 minus that at 100000, over 100000, is the cost of one pair)

use gpupool::device::Sim;
use gpupool::pool::{Config, Pool};
use std::hint::black_box;

fn main() {
    let usage = "usage: pair_loop PAIRS [SIZE]";
    let pairs: u64 = std::env::args().nth(1).and_then(|n| n.parse().ok()).expect(usage);
    let size: u64 = std::env::args().nth(2).map_or(Some(64 << 10), |n| n.parse().ok()).expect(usage);
    let mut pool = Pool::new(Sim::new(1 << 34), Config::default());
    let first = pool.alloc(size).expect("a 16 GiB device holds it");
    pool.free(first.handle).expect("a live allocation frees");
    for _ in 0..pairs {
        let a = black_box(pool.alloc(size).expect("served from the cache"));
        pool.free(a.handle).expect("a live allocation frees");
    }
}
