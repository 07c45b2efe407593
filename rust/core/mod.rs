//! The allocation algorithm: size classes, bins, the block slab, segments and statistics.
//!
//! Everything here is safe Rust over addresses and sizes; no device, FFI or Python types.
#![forbid(unsafe_code)]

mod bins;
mod block;
mod check;
mod driver_calls;
mod heap;
mod idle;
mod owners;
mod rules;
mod stats;

pub use bins::{bin_index, Bins, BIN_COUNT};
pub use block::{Block, BlockState, Handle, NIL, SHARED, USE_OVERFLOW_BIT};
pub use driver_calls::DriverCalls;
pub use heap::{BlockInfo, Heap, HeapError, Released, SegmentId, SegmentInfo};
pub use idle::IdleSegment;
pub use rules::{PoolKind, Rules, SegmentGrowth, SplitPolicy, BFC_SPLIT_REMAINDER, POWER2_INTERVALS};
pub use stats::{Metric, Stat, StatType, Stats};
