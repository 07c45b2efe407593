//! gpupool: a caching device-memory pool for deep-learning workloads.
//!
//! # Glossary
//! - **device**: where memory comes from (`host`, `sim`, `cuda:N` with feature `cuda`), behind the
//!   [`device::Device`] trait.
//! - **segment**: one allocation obtained from the device, or (expandable segments) one reserved
//!   address range whose **pages** are mapped on demand. Blocks never merge across segments,
//!   because two device allocations are not guaranteed to be contiguous.
//! - **block**: a contiguous piece of a segment, allocated or free. Block metadata lives outside
//!   the managed memory (device memory cannot hold boundary tags), in a slab indexed by `u32`.
//! - **bin**: a size class holding free blocks; a two-level (TLSF) bitmap of non-empty bins finds
//!   a fitting free block without scanning the free blocks.
//! - **stream / event**: an ordered queue of device work, and a marker in it. An allocated block
//!   remembers its stream; a free block belongs to the stream that freed it until a **fence** (an
//!   event recorded on that stream after the free) completes, then it is **shared** by all.
//! - **pool kind**: PyTorch's split between the *small* pool (requests <= 1 MiB, 2 MiB segments)
//!   and the *large* pool (everything else).
//! - **allocated / active / inactive split / reserved / requested** (PyTorch's meanings):
//!   allocated = blocks handed to users; active = allocated plus freed blocks still waiting for
//!   device work; inactive split = free blocks inside partly used segments (memory that
//!   `empty_cache` cannot return); reserved = all segments (mapped pages, for expandable ones);
//!   requested = what users asked for, before rounding.
//! - **rules**: the data that makes a strategy (rounding, segment sizes, when to split).
//! - **strategy**: a named preset of rules and growth/release behaviour over the one engine
//!   (`default`, `pytorch`, `bfc`, `arena`, `eager`, `expandable`, `pages`, `direct`).
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
