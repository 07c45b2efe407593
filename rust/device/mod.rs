//! Devices: where segments come from. One small trait, one file per backend.
//!
//! # Contract
//! - [`Device::allocate`] returns the address of `size` fresh bytes, aligned to at least 512 B,
//!   or [`DeviceError::OutOfMemory`] when the device (or its capacity cap) cannot provide them.
//!   A refusal leaves the device unchanged.
//! - [`Device::release`] takes back exactly an address `allocate` returned and not yet released;
//!   anything else is [`DeviceError::InvalidAddress`] and changes nothing.
//! - [`Device::write`] / [`Device::read`] copy between host buffers and device memory inside one
//!   live allocation; devices without memory behind their addresses answer `Unsupported`.
//! - A device never panics on bad input: every failure is a `DeviceError`.

mod faulty;
mod host;
mod sim;

pub use faulty::{FaultPlan, Faulty};
pub use host::Host;
pub use sim::Sim;

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceError {
    OutOfMemory { requested: u64 },
    InvalidAddress(u64),
    Unsupported(&'static str),
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::OutOfMemory { requested } => write!(f, "device refused {requested} bytes"),
            DeviceError::InvalidAddress(a) => {
                write!(f, "address {a:#x} is not a live device allocation")
            }
            DeviceError::Unsupported(what) => write!(f, "this device does not support {what}"),
        }
    }
}

/// What a device has: `total` is its capacity (None for "whatever the host gives").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    pub total: Option<u64>,
    /// Bytes currently allocated from the device through this handle.
    pub held: u64,
}

impl MemoryInfo {
    pub fn free(&self) -> Option<u64> {
        self.total.map(|t| t.saturating_sub(self.held))
    }
}

pub trait Device: Send {
    /// The device string users see: `host`, `sim`, `cuda:0`.
    fn name(&self) -> &str;
    fn allocate(&mut self, size: u64) -> Result<u64, DeviceError>;
    fn release(&mut self, address: u64) -> Result<(), DeviceError>;
    fn memory_info(&self) -> MemoryInfo;
    /// Whether addresses are host pointers that Python may view directly.
    fn host_accessible(&self) -> bool {
        false
    }
    fn write(&mut self, _address: u64, _data: &[u8]) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("copies"))
    }
    fn read(&self, _address: u64, _out: &mut [u8]) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("copies"))
    }
}

impl<D: Device + ?Sized> Device for Box<D> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn allocate(&mut self, size: u64) -> Result<u64, DeviceError> {
        (**self).allocate(size)
    }
    fn release(&mut self, address: u64) -> Result<(), DeviceError> {
        (**self).release(address)
    }
    fn memory_info(&self) -> MemoryInfo {
        (**self).memory_info()
    }
    fn host_accessible(&self) -> bool {
        (**self).host_accessible()
    }
    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), DeviceError> {
        (**self).write(address, data)
    }
    fn read(&self, address: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        (**self).read(address, out)
    }
}

/// Refuses a request that would exceed `capacity`.
fn check_capacity(capacity: Option<u64>, held: u64, size: u64) -> Result<(), DeviceError> {
    match capacity {
        Some(cap) if held.checked_add(size).is_none_or(|total| total > cap) => {
            Err(DeviceError::OutOfMemory { requested: size })
        }
        _ => Ok(()),
    }
}
