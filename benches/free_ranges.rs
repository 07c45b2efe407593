//! How many free ranges (holes, the tail included) range-alloc holds while it replays each of
//! `random_allocations`' programs: its cost per operation grows with them, gpupool's does not.
//! Issue 13 asks gpupool to be no slower than range-alloc once there are 100 or more holes;
//! this says which of the benchmark's rows have that many. Not timed:
//! `cargo bench --bench free_ranges`.

mod common;

use common::{random_allocations, Op, COUNTS, MAX_SIZES_MIB, MAX_USAGE, MIB, RANDOM_SEED};
use range_alloc::RangeAllocator;
use std::ops::Range;

const ARENA: u64 = 1 << 44;

/// Free ranges of `allocator`: the gaps between its allocated ranges, and the tail.
fn free_ranges(allocator: &RangeAllocator<u64>) -> u64 {
    let (mut holes, mut end) = (0, 0);
    for range in allocator.allocated_ranges() {
        holes += u64::from(range.start > end);
        end = range.end;
    }
    holes + u64::from(end < ARENA)
}

fn main() {
    println!("| program | free ranges, mean | most | steps with 100 or more |");
    println!("|---|---:|---:|---:|");
    for n in COUNTS {
        for max_mib in MAX_SIZES_MIB {
            let program = random_allocations(n, max_mib * MIB, MAX_USAGE, RANDOM_SEED);
            let mut allocator = RangeAllocator::new(0..ARENA);
            let mut live: Vec<Option<Range<u64>>> = vec![None; program.slots];
            let (mut total, mut most, mut many) = (0, 0, 0);
            for op in &program.ops {
                match *op {
                    Op::Alloc { slot, size } => {
                        let range = allocator.allocate_range(common::rounded(size)).expect("the arena is large enough");
                        live[slot] = Some(range);
                    }
                    Op::Free { slot } => allocator.free_range(live[slot].take().expect("program frees a live slot")),
                }
                let holes = free_ranges(&allocator);
                (total, most, many) = (total + holes, most.max(holes), many + u64::from(holes >= 100));
            }
            let steps = program.ops.len() as f64;
            println!(
                "| n={n}, max={max_mib} MiB | {:.1} | {most} | {:.0}% |",
                total as f64 / steps,
                100.0 * many as f64 / steps
            );
        }
    }
}
