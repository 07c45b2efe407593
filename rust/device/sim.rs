//! `sim`: a device with address space but no memory, for replaying and fuzzing huge GPUs.

use super::{check_capacity, Device, DeviceError, MemoryInfo, Reservations, SimStreams};
use std::collections::HashMap;

/// Addresses start high and never repeat, so a stale address can never alias a live one.
const BASE_ADDRESS: u64 = 0x7000_0000_0000;
const ALIGNMENT: u64 = 2 << 20;

#[derive(Debug)]
pub struct Sim {
    capacity: u64,
    held: u64,
    next_address: u64,
    live: HashMap<u64, u64>,
    reservations: Reservations,
    streams: SimStreams,
}

impl Sim {
    pub fn new(capacity: u64) -> Self {
        Sim {
            capacity,
            held: 0,
            next_address: BASE_ADDRESS,
            live: HashMap::new(),
            reservations: Reservations::default(),
            streams: SimStreams::default(),
        }
    }
}

impl Sim {
    /// A fresh, never reused address range of `size` bytes.
    fn take_addresses(&mut self, size: u64) -> Result<u64, DeviceError> {
        let address = self.next_address;
        let span = size.div_ceil(ALIGNMENT).max(1) * ALIGNMENT;
        self.next_address = address.checked_add(span).ok_or(DeviceError::OutOfMemory { requested: size })?;
        Ok(address)
    }
}

impl Device for Sim {
    fn name(&self) -> &str {
        "sim"
    }

    fn allocate(&mut self, size: u64) -> Result<u64, DeviceError> {
        check_capacity(Some(self.capacity), self.held, size)?;
        let address = self.take_addresses(size)?;
        self.held += size;
        self.live.insert(address, size);
        Ok(address)
    }

    fn reserve(&mut self, size: u64) -> Result<u64, DeviceError> {
        let address = self.take_addresses(size)?;
        self.reservations.insert(address, size);
        Ok(address)
    }

    fn unreserve(&mut self, address: u64) -> Result<(), DeviceError> {
        self.reservations.remove(address).map(|_| ())
    }

    fn map(&mut self, address: u64, size: u64, handle: u64) -> Result<(), DeviceError> {
        self.reservations.check_mappable(address, size, handle)?;
        check_capacity(Some(self.capacity), self.held, size)?;
        self.reservations.map(address, size, handle)?;
        self.held += size;
        Ok(())
    }

    fn unmap(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.reservations.unmap(address, size)?;
        self.held -= size;
        Ok(())
    }

    /// Like `cudaFree`, returning memory first waits for all queued work.
    fn release(&mut self, address: u64) -> Result<(), DeviceError> {
        let size = self.live.remove(&address).ok_or(DeviceError::InvalidAddress(address))?;
        self.streams.synchronize_all();
        self.held -= size;
        Ok(())
    }

    super::forward_streams!(streams);

    fn memory_info(&self) -> MemoryInfo {
        MemoryInfo { total: Some(self.capacity), held: self.held }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DEFAULT_STREAM;

    #[test]
    fn capacity_and_release() {
        let mut sim = Sim::new(80 << 30);
        let a = sim.allocate(60 << 30).unwrap();
        assert_eq!(sim.allocate(30 << 30), Err(DeviceError::OutOfMemory { requested: 30 << 30 }));
        let b = sim.allocate(20 << 30).unwrap();
        assert!(b >= a + (60 << 30));
        assert_eq!(sim.release(a + 1), Err(DeviceError::InvalidAddress(a + 1)));
        sim.release(a).unwrap();
        assert_eq!(sim.release(a), Err(DeviceError::InvalidAddress(a)));
        assert_eq!(sim.memory_info().held, 20 << 30);
        assert!(sim.read(DEFAULT_STREAM, b, &mut [0u8; 4]).is_err());
    }

    #[test]
    fn mapping_counts_against_capacity() {
        let mut sim = Sim::new(8 << 20);
        let base = sim.reserve(1 << 40).unwrap();
        sim.map(base, 6 << 20, 2 << 20).unwrap();
        assert_eq!(sim.map(base + (6 << 20), 4 << 20, 2 << 20), Err(DeviceError::OutOfMemory { requested: 4 << 20 }));
        sim.unmap(base, 2 << 20).unwrap();
        sim.map(base + (6 << 20), 4 << 20, 4 << 20).unwrap();
        assert_eq!(sim.memory_info().held, 8 << 20);
        assert!(sim.unreserve(base).is_err());
        assert!(sim.unmap(base + (6 << 20), 2 << 20).is_err(), "half a handle");
        sim.unmap(base + (2 << 20), 8 << 20).unwrap();
        sim.unreserve(base).unwrap();
        assert_eq!(sim.memory_info().held, 0);
    }
}
