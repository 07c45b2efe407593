//! Pool errors, with the out-of-memory report users need to act on.

use crate::core::HeapError;
use crate::device::DeviceError;
use std::fmt;

/// Everything a user needs to understand an out-of-memory failure.
#[derive(Clone, Debug, PartialEq)]
pub struct OomReport {
    pub device: String,
    pub requested: u64,
    pub capacity: Option<u64>,
    pub device_free: Option<u64>,
    pub allocated: u64,
    pub reserved: u64,
    /// The largest request the cache could serve now: its biggest free block, or in paged
    /// ranges the biggest free block as far as mapped pages and the device's free memory back it
    /// (free address space alone is not memory).
    pub largest_free_block: u64,
    /// The most the pool may reserve (`per_process_memory_fraction` x capacity), if limited.
    pub limit: Option<u64>,
    /// The pool's strategy and the settings the advice depends on.
    pub strategy: &'static str,
    pub max_split_size: Option<u64>,
    /// `garbage_collection_threshold` is set but, without a memory limit, does nothing.
    pub garbage_collection_inert: bool,
}

impl OomReport {
    pub fn reserved_unallocated(&self) -> u64 {
        self.reserved - self.allocated
    }

    /// Share of cached free memory that is not in the largest free block (TF BFC's figure).
    pub fn fragmentation(&self) -> f64 {
        let free = self.reserved_unallocated();
        if free == 0 {
            0.0
        } else {
            1.0 - (self.largest_free_block as f64 / free as f64).min(1.0)
        }
    }
}

/// `1.50 MiB`-style sizes for messages.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opt = |v: Option<u64>| v.map_or("unlimited".to_string(), format_bytes);
        write!(
            f,
            "out of memory on {}: tried to allocate {} ({} bytes). Device capacity {}, of which {} is free. \
             {} is allocated by gpupool and {} is reserved but unallocated; the largest free block is {} \
             (fragmentation {:.1}%).",
            self.device,
            format_bytes(self.requested),
            self.requested,
            opt(self.capacity),
            opt(self.device_free),
            format_bytes(self.allocated),
            format_bytes(self.reserved_unallocated()),
            format_bytes(self.largest_free_block),
            self.fragmentation() * 100.0,
        )?;
        if let Some(limit) = self.limit {
            write!(f, " The pool may reserve at most {} (per_process_memory_fraction).", format_bytes(limit))?;
        }
        if self.reserved_unallocated() >= self.requested {
            write!(f, " Reserved-but-unallocated memory could hold this request: fragmentation caused this failure.")?;
        }
        for advice in self.advice() {
            write!(f, " {advice}")?;
        }
        Ok(())
    }
}

const MIB: u64 = 1 << 20;

impl OomReport {
    /// Configuration that would have helped, as sentences naming `GPUPOOL_ALLOC_CONF` values.
    pub fn advice(&self) -> Vec<String> {
        let mut advice = Vec::new();
        let limited_by_fraction = self.limit.is_some_and(|limit| self.reserved + self.requested > limit)
            && self.device_free.is_none_or(|free| free >= self.requested);
        if limited_by_fraction {
            advice.push("The device has room: raise per_process_memory_fraction.".to_string());
        }
        if self.reserved_unallocated() >= self.requested && self.strategy != "default" {
            // The default pager maps pages on demand in one address range for all but tiny sizes
            // and gives whole free handles back under pressure: the fragmentation measured here
            // is what it avoids (PyTorch's expandable segments keep partly used 20 MiB handles).
            let mut text = "Try GPUPOOL_ALLOC_CONF=strategy:default (one address range for all but tiny sizes, \
                            pages mapped on demand and given back as they empty, so free holes coalesce and cost \
                            no memory)"
                .to_string();
            // Blocks at least max_split_size stay whole for requests at least that big.
            // (BFC and the arena refuse the key.)
            let takes_limit = !matches!(self.strategy, "bfc" | "arena");
            if takes_limit && self.max_split_size.is_none() && self.requested >= 20 * MIB {
                text += &format!(
                    ", or max_split_size_mb:{} to keep cached blocks this big whole for requests like this one",
                    self.requested / MIB
                );
            }
            advice.push(text + ".");
        }
        if self.garbage_collection_inert {
            advice.push(
                "garbage_collection_threshold needs a memory limit: per_process_memory_fraction on a device with a capacity."
                    .to_string(),
            );
        }
        advice
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum PoolError {
    OutOfMemory(Box<OomReport>),
    /// Zero, negative or absurd sizes never reach the heap.
    InvalidSize(u64),
    Heap(HeapError),
    Device(DeviceError),
    /// The stream is being captured into a CUDA graph (see `pool/capture.rs`), and this would
    /// break the graph or the capture.
    Capturing(crate::device::StreamId, Refused),
}

/// What a capture refuses, for [`PoolError::Capturing`]'s message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// An allocation on the capturing stream.
    Work,
    /// A copy to or from an allocation of the capturing stream: it waits for the stream.
    Copy,
    /// A query, a wait or a destroy, which the driver forbids during capture.
    Wait,
    /// An order between two streams across the capture's edge (a DLPack export's); the stream
    /// named is the one capturing, the allocation's.
    Order,
    /// The same, with the DLPack consumer's stream capturing; the stream named is the
    /// allocation's, which the user knows (the consumer's has only a temporary id here).
    Consumer,
    /// An order between streams of two different captures (a DLPack export's), which would merge
    /// them; the stream is the allocation's.
    Merge,
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::OutOfMemory(report) => report.fmt(f),
            PoolError::InvalidSize(size) => write!(f, "invalid allocation size {size}"),
            PoolError::Heap(e) => e.fmt(f),
            PoolError::Device(e) => e.fmt(f),
            PoolError::Capturing(stream, Refused::Work) => write!(
                f,
                "stream {stream} is being captured into a CUDA graph: gpupool does not allocate during capture \
                 (a graph's replays would write to memory the pool hands to others); allocate the graph's \
                 buffers before capturing"
            ),
            PoolError::Capturing(stream, Refused::Copy) => write!(
                f,
                "stream {stream} is being captured into a CUDA graph: its allocations cannot be copied to or from \
                 the host until the capture ends (a copy waits for the stream, which the driver forbids during \
                 capture, and a captured copy would run at replay, against a host buffer long gone)"
            ),
            PoolError::Capturing(stream, Refused::Wait) => write!(
                f,
                "stream {stream} is being captured into a CUDA graph: it cannot be queried, waited for or \
                 destroyed until the capture ends (the driver would invalidate the capture)"
            ),
            PoolError::Capturing(stream, Refused::Order) => write!(
                f,
                "stream {stream} is being captured into a CUDA graph: no order between streams can cross the \
                 capture's edge (export with stream=-1 for no ordering, or from a stream of the same capture)"
            ),
            PoolError::Capturing(stream, Refused::Consumer) => write!(
                f,
                "the DLPack consumer's stream is being captured into a CUDA graph (or is the legacy stream, \
                 unusable while a blocking stream captures), so it cannot wait for stream {stream}, the \
                 allocation's: no order between streams can cross the capture's edge (export with stream=-1 for \
                 no ordering, or from a stream of the same capture)"
            ),
            PoolError::Capturing(stream, Refused::Merge) => write!(
                f,
                "stream {stream} and the DLPack consumer's stream are being captured into two different CUDA \
                 graphs: ordering one after the other would merge the two captures, which the driver refuses by \
                 invalidating both (export with stream=-1 for no ordering, or consume on a stream that joined \
                 this stream's capture)"
            ),
        }
    }
}

impl std::error::Error for PoolError {}

impl From<HeapError> for PoolError {
    fn from(e: HeapError) -> Self {
        PoolError::Heap(e)
    }
}

impl From<DeviceError> for PoolError {
    fn from(e: DeviceError) -> Self {
        PoolError::Device(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(strategy: &'static str) -> OomReport {
        OomReport {
            device: "sim".into(),
            requested: 64 * MIB,
            capacity: Some(1 << 30),
            device_free: Some(0),
            allocated: 700 * MIB,
            reserved: 1 << 30,
            largest_free_block: 32 * MIB,
            limit: None,
            strategy,
            max_split_size: None,
            garbage_collection_inert: false,
        }
    }

    #[test]
    fn fragmentation_points_other_strategies_at_the_default_pager() {
        let advice = report("pytorch").advice().join(" ");
        assert!(advice.contains("strategy:default"), "{advice}");
        assert!(advice.contains("max_split_size_mb:64"), "{advice}");
        assert!(report("expandable").advice().join(" ").contains("strategy:default"));
        assert!(!report("default").advice().join(" ").contains("strategy:"), "the default is what ran");
        for refuses_the_key in ["bfc", "arena"] {
            assert!(!report(refuses_the_key).advice().join(" ").contains("max_split_size_mb"), "{refuses_the_key}");
        }
    }
}
