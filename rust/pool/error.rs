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
    pub largest_free_block: u64,
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
            1.0 - self.largest_free_block as f64 / free as f64
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
        if self.reserved_unallocated() >= self.requested {
            write!(f, " Reserved-but-unallocated memory could hold this request: fragmentation caused this failure.")?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum PoolError {
    OutOfMemory(Box<OomReport>),
    /// Zero, negative or absurd sizes never reach the heap.
    InvalidSize(u64),
    Heap(HeapError),
    Device(DeviceError),
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::OutOfMemory(report) => report.fmt(f),
            PoolError::InvalidSize(size) => write!(f, "invalid allocation size {size}"),
            PoolError::Heap(e) => e.fmt(f),
            PoolError::Device(e) => e.fmt(f),
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
