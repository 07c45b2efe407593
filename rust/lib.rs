//! gpupool: a caching device-memory pool for deep-learning workloads.
//!
//! # Glossary
//! - **device**: where memory comes from (`host`, `sim`, `cuda:N` with feature `cuda`), behind the
//!   [`device::Device`] trait.
//! - **segment**: one allocation obtained from the device. Blocks never merge across segments,
//!   because two device allocations are not guaranteed to be contiguous.
//! - **block**: a contiguous piece of a segment, allocated or free. Block metadata lives outside
//!   the managed memory (device memory cannot hold boundary tags), in a slab indexed by `u32`.
//! - **bin**: a size class holding free blocks; a two-level (TLSF) bitmap of non-empty bins finds
//!   a fitting free block without scanning the free blocks.
//! - **stream**: an ordered queue of device work. Every block remembers the stream it was
//!   allocated on; free blocks are binned per stream.
//! - **pool kind**: PyTorch's split between the *small* pool (requests <= 1 MiB, 2 MiB segments)
//!   and the *large* pool (everything else).
//! - **allocated / active / inactive split / reserved / requested** (PyTorch's meanings):
//!   allocated = blocks handed to users; active = allocated plus freed blocks still waiting for
//!   device work; inactive split = free blocks inside partly used segments (memory that
//!   `empty_cache` cannot return); reserved = all segments; requested = what users asked for,
//!   before rounding.
//! - **rules**: the data that makes a strategy (rounding, segment sizes, when to split).
//!
//! # Layers
//! [`core`] is the safe, device-free algorithm over addresses and sizes; [`device`] holds the
//! backends; [`pool`] joins them (segment growth, the out-of-memory ladder); [`trace`] reads,
//! writes and replays allocation traces on pools; `python` (feature `python`) is the thin PyO3
//! layer; [`capi`] exports C allocation functions for PyTorch's pluggable allocator.

pub mod capi;
pub mod core;
pub mod device;
pub mod pool;
pub mod trace;

#[cfg(feature = "python")]
mod python;
