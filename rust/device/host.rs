//! `host`: real, page-aligned host memory, so data written through an allocation reads back.

use super::{check_capacity, Device, DeviceError, MemoryInfo, SimStreams};
use std::alloc::{self, Layout};
use std::collections::BTreeMap;

const PAGE: usize = 4096;

#[derive(Debug, Default)]
pub struct Host {
    capacity: Option<u64>,
    held: u64,
    /// Live allocations by address; ordered so `read`/`write` find the one holding a range.
    live: BTreeMap<u64, Layout>,
    streams: SimStreams,
}

impl Host {
    pub fn new(capacity: Option<u64>) -> Self {
        Host { capacity, held: 0, live: BTreeMap::new(), streams: SimStreams::default() }
    }

    /// Checks that `[address, address + len)` lies inside one live allocation.
    fn check_range(&self, address: u64, len: usize) -> Result<(), DeviceError> {
        let (&base, layout) = self.live.range(..=address).next_back().ok_or(DeviceError::InvalidAddress(address))?;
        let end = address.checked_add(len as u64).ok_or(DeviceError::InvalidAddress(address))?;
        if end > base + layout.size() as u64 {
            return Err(DeviceError::InvalidAddress(address));
        }
        Ok(())
    }
}

impl Device for Host {
    fn name(&self) -> &str {
        "host"
    }

    fn allocate(&mut self, size: u64) -> Result<u64, DeviceError> {
        check_capacity(self.capacity, self.held, size)?;
        let oom = DeviceError::OutOfMemory { requested: size };
        let bytes = usize::try_from(size.max(1)).map_err(|_| oom.clone())?;
        let layout = Layout::from_size_align(bytes, PAGE).map_err(|_| oom.clone())?;
        // SAFETY: `layout` has a non-zero size.
        #[allow(unsafe_code)]
        let ptr = unsafe { alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(oom);
        }
        self.held += size;
        self.live.insert(ptr as u64, layout);
        Ok(ptr as u64)
    }

    fn release(&mut self, address: u64) -> Result<(), DeviceError> {
        let layout = self.live.remove(&address).ok_or(DeviceError::InvalidAddress(address))?;
        // SAFETY: `address` came from `alloc::alloc(layout)` and was removed from `live`, so it
        // is deallocated exactly once.
        #[allow(unsafe_code)]
        unsafe {
            alloc::dealloc(address as *mut u8, layout)
        };
        self.held -= layout.size() as u64;
        Ok(())
    }

    super::forward_streams!(streams);

    fn memory_info(&self) -> MemoryInfo {
        MemoryInfo { total: self.capacity, held: self.held }
    }

    fn host_accessible(&self) -> bool {
        true
    }

    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.check_range(address, data.len())?;
        // SAFETY: the destination range lies inside one live allocation of ours (checked above)
        // and cannot overlap `data`, which Rust borrows from elsewhere.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), address as *mut u8, data.len())
        };
        Ok(())
    }

    fn read(&self, address: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.check_range(address, out.len())?;
        // SAFETY: the source range lies inside one live allocation of ours (checked above).
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(address as *const u8, out.as_mut_ptr(), out.len())
        };
        Ok(())
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        for (address, layout) in std::mem::take(&mut self.live) {
            // SAFETY: every entry of `live` is an outstanding `alloc::alloc(layout)` result.
            #[allow(unsafe_code)]
            unsafe {
                alloc::dealloc(address as *mut u8, layout)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_round_trips_and_ranges_are_checked() {
        let mut host = Host::new(Some(1 << 20));
        let a = host.allocate(8192).unwrap();
        assert_eq!(a % PAGE as u64, 0);
        host.write(a + 100, b"gpupool").unwrap();
        let mut out = [0u8; 7];
        host.read(a + 100, &mut out).unwrap();
        assert_eq!(&out, b"gpupool");
        assert!(host.write(a + 8190, b"xyz").is_err());
        assert!(host.read(a + 8192 + PAGE as u64 * 100, &mut out).is_err());
        assert_eq!(host.allocate(2 << 20), Err(DeviceError::OutOfMemory { requested: 2 << 20 }));
        host.release(a).unwrap();
        assert!(host.release(a).is_err());
        assert_eq!(host.memory_info().held, 0);
    }
}
