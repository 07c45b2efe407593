//! `host`: real, page-aligned host memory, so data written through an allocation reads back.

use super::{check_capacity, Device, DeviceError, MemoryInfo, Reservations, SimStreams, StreamId};
use std::alloc::{self, Layout};
use std::collections::BTreeMap;

const PAGE: usize = 4096;

#[derive(Debug, Default)]
pub struct Host {
    capacity: Option<u64>,
    held: u64,
    /// Live allocations by address; ordered so `read`/`write` find the one holding a range.
    live: BTreeMap<u64, Layout>,
    /// Address ranges from `mmap(PROT_NONE)`; mapping commits pages, unmapping returns them.
    reservations: Reservations,
    streams: SimStreams,
}

/// The machine's physical memory, the most a `host` device can hold: beyond it the kernel would
/// overcommit, and touching the memory would kill the process instead of failing an allocation.
pub fn physical_memory() -> Option<u64> {
    // SAFETY: `sysconf` reads system constants; it has no preconditions.
    #[allow(unsafe_code)]
    let (pages, page_size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages > 0 && page_size > 0).then(|| pages as u64 * page_size as u64)
}

impl Host {
    /// A host device of `capacity` bytes, or of the machine's physical memory (which also caps
    /// a larger `capacity`).
    pub fn new(capacity: Option<u64>) -> Self {
        let physical = physical_memory();
        let capacity = match (capacity, physical) {
            (Some(c), Some(p)) => Some(c.min(p)),
            (c, p) => c.or(p),
        };
        Host {
            capacity,
            held: 0,
            live: BTreeMap::new(),
            reservations: Reservations::default(),
            streams: SimStreams::default(),
        }
    }

    /// Checks that `[address, address + len)` lies inside one live allocation or one mapped
    /// range of a reservation.
    fn check_range(&self, address: u64, len: usize) -> Result<(), DeviceError> {
        let end = address.checked_add(len as u64).ok_or(DeviceError::InvalidAddress(address))?;
        let in_allocation = self.live.range(..=address).next_back().is_some_and(|(&b, l)| end <= b + l.size() as u64);
        if in_allocation || self.reservations.check_mapped(address, len.max(1) as u64).is_ok() {
            return Ok(());
        }
        Err(DeviceError::InvalidAddress(address))
    }

    /// Sets the access of a page-aligned range inside one of our reservations.
    fn protect(address: u64, size: u64, prot: libc::c_int) -> Result<(), DeviceError> {
        // SAFETY: callers pass a range inside a live `mmap` reservation of ours (checked by
        // `Reservations`), so no memory Rust owns changes access.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::mprotect(address as *mut libc::c_void, size as usize, prot) };
        if rc != 0 {
            return Err(DeviceError::OutOfMemory { requested: size });
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
        // What `release` gives back: a zero-byte request holds one byte.
        self.held += bytes as u64;
        self.live.insert(ptr as u64, layout);
        Ok(ptr as u64)
    }

    /// Like `cudaFree`, returning memory first waits for all queued work.
    fn release(&mut self, address: u64) -> Result<(), DeviceError> {
        let layout = self.live.remove(&address).ok_or(DeviceError::InvalidAddress(address))?;
        self.streams.synchronize_all();
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

    fn reserve(&mut self, size: u64) -> Result<u64, DeviceError> {
        let len = usize::try_from(size).map_err(|_| DeviceError::OutOfMemory { requested: size })?;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing touches no
        // existing memory.
        #[allow(unsafe_code)]
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, flags, -1, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(DeviceError::OutOfMemory { requested: size });
        }
        self.reservations.insert(ptr as u64, size);
        Ok(ptr as u64)
    }

    fn unreserve(&mut self, address: u64) -> Result<(), DeviceError> {
        let size = self.reservations.remove(address)?;
        // SAFETY: `address` is the base of a reservation we made with `mmap` and just forgot, with
        // nothing mapped in it.
        #[allow(unsafe_code)]
        unsafe {
            libc::munmap(address as *mut libc::c_void, size as usize)
        };
        Ok(())
    }

    fn map(&mut self, address: u64, size: u64, handle: u64) -> Result<(), DeviceError> {
        self.reservations.check_mappable(address, size, handle)?;
        check_capacity(self.capacity, self.held, size)?;
        Self::protect(address, size, libc::PROT_READ | libc::PROT_WRITE)?;
        self.reservations.map(address, size, handle)?;
        self.held += size;
        Ok(())
    }

    /// Returns the pages to the OS (resident memory drops) and makes the range inaccessible.
    fn unmap(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.reservations.check_unmappable(address, size)?;
        // SAFETY: the range is mapped inside our reservation (checked above); discarding its
        // contents is what unmapping means.
        #[allow(unsafe_code)]
        unsafe {
            libc::madvise(address as *mut libc::c_void, size as usize, libc::MADV_DONTNEED)
        };
        Self::protect(address, size, libc::PROT_NONE)?;
        self.reservations.unmap(address, size)?;
        self.held -= size;
        Ok(())
    }

    fn memory_info(&self) -> MemoryInfo {
        MemoryInfo { total: self.capacity, held: self.held }
    }

    fn host_accessible(&self) -> bool {
        true
    }

    /// Host copies are synchronous and host streams simulated: no queued work to order after.
    fn write(&mut self, _stream: StreamId, address: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.check_range(address, data.len())?;
        // SAFETY: the destination range lies inside one live allocation of ours (checked above)
        // and cannot overlap `data`, which Rust borrows from elsewhere.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), address as *mut u8, data.len())
        };
        Ok(())
    }

    fn read(&self, _stream: StreamId, address: u64, out: &mut [u8]) -> Result<(), DeviceError> {
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
        for (base, size) in self.reservations.bases() {
            // SAFETY: every reservation is an outstanding `mmap` of ours; nothing else uses it once
            // the device is dropped.
            #[allow(unsafe_code)]
            unsafe {
                libc::munmap(base as *mut libc::c_void, size as usize)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DEFAULT_STREAM;

    #[test]
    fn data_round_trips_and_ranges_are_checked() {
        let mut host = Host::new(Some(1 << 20));
        let a = host.allocate(8192).unwrap();
        assert_eq!(a % PAGE as u64, 0);
        host.write(DEFAULT_STREAM, a + 100, b"gpupool").unwrap();
        let mut out = [0u8; 7];
        host.read(DEFAULT_STREAM, a + 100, &mut out).unwrap();
        assert_eq!(&out, b"gpupool");
        assert!(host.write(DEFAULT_STREAM, a + 8190, b"xyz").is_err());
        assert!(host.read(DEFAULT_STREAM, a + 8192 + PAGE as u64 * 100, &mut out).is_err());
        assert_eq!(host.allocate(2 << 20), Err(DeviceError::OutOfMemory { requested: 2 << 20 }));
        host.release(a).unwrap();
        assert!(host.release(a).is_err());
        assert_eq!(host.memory_info().held, 0);
    }

    #[test]
    fn mapped_pages_hold_data_and_count_against_capacity() {
        let mut host = Host::new(Some(8 << 20));
        let base = host.reserve(1 << 30).unwrap();
        assert!(host.write(DEFAULT_STREAM, base, b"x").is_err(), "unmapped");
        host.map(base + (2 << 20), 4 << 20, 2 << 20).unwrap();
        host.write(DEFAULT_STREAM, base + (3 << 20), b"page").unwrap();
        let mut out = [0u8; 4];
        host.read(DEFAULT_STREAM, base + (3 << 20), &mut out).unwrap();
        assert_eq!(&out, b"page");
        assert!(host.map(base + (8 << 20), 6 << 20, 2 << 20).is_err(), "capacity");
        host.unmap(base + (2 << 20), 4 << 20).unwrap();
        assert!(host.read(DEFAULT_STREAM, base + (3 << 20), &mut out).is_err());
        host.unreserve(base).unwrap();
        assert_eq!(host.memory_info().held, 0);
    }
}
