//! Reserved address ranges backed in runs (the driver's virtual memory management calls), the
//! mechanism behind PyTorch's expandable segments: the cuda backend's `reserve`, `map`, `unmap`
//! and `unreserve` of the [`Device`](crate::device::Device) trait.
//!
//! A *reservation* is address space with nothing behind it (`cuMemAddressReserve`). Mapping a run
//! creates one physical allocation per handle the pool asks for (`cuMemCreate`; a handle is one
//! page or a whole run), the unit the pool may later unmap on its own, maps each (`cuMemMap`),
//! grants access to the whole run in one call (`cuMemSetAccess`, with a descriptor per peer
//! device), and releases each handle at once (`cuMemRelease`: the memory lives until its mapping
//! goes, so unmapping a handle is one call, `cuMemUnmap`, that either happens or not). Sizes and
//! addresses are multiples of the driver's granularity (`cuMemGetAllocationGranularity`). Mapped
//! handles count as memory the device holds.

use super::driver::{self, check, check_alloc};
use super::Cuda;
use crate::device::reservations::handles;
use crate::device::{DeviceError, MappingOptions};
use cudarc::driver::sys;
use std::collections::BTreeMap;

#[derive(Debug)]
struct Reservation {
    size: u64,
    /// Mappings (one physical allocation each): address -> size.
    mappings: BTreeMap<u64, u64>,
}

/// Every reservation of one device, by base address, and how their memory is made.
#[derive(Debug, Default)]
pub struct Reservations {
    by_base: BTreeMap<u64, Reservation>,
    granularity: Option<u64>,
    options: MappingOptions,
    /// Whether the device was found to support `options` (POSIX descriptor export, each peer
    /// reaching its memory): checked once, at the first map under them.
    options_checked: bool,
}

impl Reservations {
    fn holding(&self, address: u64) -> Option<(u64, &Reservation)> {
        let (&base, r) = self.by_base.range(..=address).next_back()?;
        (address < base + r.size).then_some((base, r))
    }

    /// Whether every byte of `[address, end)` is mapped.
    pub fn is_mapped(&self, address: u64, end: u64) -> bool {
        let Some((_, r)) = self.holding(address) else { return false };
        let mut at = address;
        // Mappings are contiguous where the range is covered: walk them from the one holding it.
        while at < end {
            match r.mappings.range(..=at).next_back() {
                Some((&start, &size)) if start + size > at => at = start + size,
                _ => return false,
            }
        }
        true
    }

    /// Unmaps and frees everything (when the device closes, after its work finished); errors are
    /// ignored, but a range whose unmap failed stays reserved: the driver frees only a range with
    /// nothing mapped in it.
    pub fn release_all(&mut self) {
        for (base, r) in std::mem::take(&mut self.by_base) {
            let mut unmapped = true;
            for (&address, &size) in &r.mappings {
                // SAFETY: a mapping of ours, unmapped once; its handle was released when mapped.
                let code = unsafe { sys::cuMemUnmap(address, size as usize) };
                unmapped &= driver::is(code, sys::CUresult::CUDA_SUCCESS);
            }
            if unmapped {
                // SAFETY: a range we reserved, now without mappings, freed once.
                let _ = unsafe { sys::cuMemAddressFree(base, r.size as usize) };
            }
        }
    }
}

/// Pinned device memory on `ordinal`, exportable as a file descriptor when `shareable`.
fn allocation_properties(ordinal: i32, shareable: bool) -> sys::CUmemAllocationProp {
    let handle_type = if shareable {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
    };
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handle_type,
        location: device_location(ordinal),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The devices of `peer_access` other than `ordinal` itself, which always has access.
fn peers(ordinal: i32, listed: &[i32]) -> impl Iterator<Item = i32> + '_ {
    listed.iter().copied().filter(move |&peer| peer != ordinal)
}

/// Read/write access for `ordinal` and each other device `listed`.
pub(super) fn device_access(ordinal: i32, listed: &[i32]) -> Vec<sys::CUmemAccessDesc> {
    let rw = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    let devices = std::iter::once(ordinal).chain(peers(ordinal, listed));
    devices.map(|d| sys::CUmemAccessDesc { location: device_location(d), flags: rw }).collect()
}

fn device_location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal }
}

/// Unmaps one mapping; on success its memory goes back to the driver (its handle was released).
fn unmap_one(address: u64, size: u64) -> Result<(), DeviceError> {
    // SAFETY: `[address, address + size)` is exactly one mapping of ours.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(address, size as usize) })
}

impl Cuda {
    /// The mapping granularity: reservations, mappings and pool pages are whole multiples of it.
    pub fn page_size(&mut self) -> Result<u64, DeviceError> {
        if let Some(page) = self.reservations.granularity {
            return Ok(page);
        }
        driver::require_symbols(driver::VMM_SYMBOLS, "virtual memory management")?;
        let vmm = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED;
        if !self.context.supports(vmm)? {
            return Err(DeviceError::Unsupported(
                "virtual memory management, which paged strategies need (strategy:pytorch does not)",
            ));
        }
        let _current = self.context.enter()?;
        let prop = allocation_properties(self.ordinal(), self.reservations.options.shareable);
        let mut page = 0usize;
        let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: valid pointers to a granularity and a fully initialized properties struct.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(&mut page, &prop, minimum)
        })?;
        if page == 0 || !page.is_power_of_two() {
            return Err(DeviceError::Driver(format!("the driver reported a mapping granularity of {page} bytes")));
        }
        self.reservations.granularity = Some(page as u64);
        Ok(page as u64)
    }

    /// Takes effect for memory mapped from now on.
    pub(super) fn mapping_options(&mut self, options: &MappingOptions) {
        self.reservations.options = options.clone();
        self.reservations.options_checked = false;
    }

    /// Reserves address space for `size` bytes (rounded up to the granularity); nothing is mapped.
    pub(super) fn reserve_range(&mut self, size: u64) -> Result<u64, DeviceError> {
        let page = self.page_size()?;
        let size = size.max(1).checked_next_multiple_of(page).ok_or(DeviceError::OutOfMemory { requested: size })?;
        let _current = self.context.enter()?;
        let _relaxed = driver::relax_capture_mode();
        let mut base = 0;
        // SAFETY: the context is current; the driver picks the address (hint 0).
        check_alloc(
            "cuMemAddressReserve",
            unsafe { sys::cuMemAddressReserve(&mut base, size as usize, 0, 0, 0) },
            size,
        )?;
        self.reservations.by_base.insert(base, Reservation { size, mappings: BTreeMap::new() });
        Ok(base)
    }

    /// Checks that `[address, address + size)` lies in one reservation, starts on the
    /// granularity and is a whole number of `unit`s (a multiple of the granularity); returns the
    /// reservation's base.
    fn aligned_range(&mut self, address: u64, size: u64, unit: u64) -> Result<u64, DeviceError> {
        let granularity = self.page_size()?;
        let invalid = DeviceError::InvalidAddress(address);
        let (base, r) = self.reservations.holding(address).ok_or(invalid.clone())?;
        let end = address.checked_add(size).ok_or(invalid.clone())?;
        let aligned = |v: u64, to: u64| to != 0 && v.is_multiple_of(to);
        if size == 0 || !aligned(unit, granularity) || !aligned(address - base, granularity) || !aligned(size, unit) {
            return Err(invalid);
        }
        if end > base + r.size {
            return Err(invalid);
        }
        Ok(base)
    }

    /// Whether pages are made exportable (`shareable_handle:posix_fd`).
    pub(super) fn shares_pages(&self) -> bool {
        self.reservations.options.shareable
    }

    /// The mappings that together cover `[address, end)`, in order; `None` unless all of it is
    /// mapped.
    pub(super) fn mappings_covering(&self, address: u64, end: u64) -> Option<Vec<(u64, u64)>> {
        let (_, r) = self.reservations.holding(address)?;
        let mut covering = Vec::new();
        let mut at = address;
        while at < end {
            let (&start, &size) = r.mappings.range(..=at).next_back().filter(|(&s, &l)| s + l > at)?;
            covering.push((start, size));
            at = start + size;
        }
        Some(covering)
    }

    /// The access descriptors for mapped memory: this device, then each peer, read/write.
    fn access(&mut self) -> Result<Vec<sys::CUmemAccessDesc>, DeviceError> {
        let ordinal = self.ordinal();
        if !self.reservations.options_checked {
            let posix_fd = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
            if self.reservations.options.shareable && !self.context.supports(posix_fd)? {
                return Err(DeviceError::Unsupported(
                    "exporting memory as POSIX file descriptors (shareable_handle:posix_fd)",
                ));
            }
            for peer in peers(ordinal, &self.reservations.options.peers) {
                let (mut peer_device, mut can) = (0, 0);
                // SAFETY: writes one device handle; the driver validates the ordinal.
                let mut status = unsafe { sys::cuDeviceGet(&mut peer_device, peer) };
                if driver::is(status, sys::CUresult::CUDA_SUCCESS) {
                    // Whether the peer's contexts can reach this device's memory (that way round).
                    // SAFETY: writes one int; both are device handles from `cuDeviceGet`.
                    status = unsafe { sys::cuDeviceCanAccessPeer(&mut can, peer_device, self.context.device()) };
                }
                if !driver::is(status, sys::CUresult::CUDA_SUCCESS) || can == 0 {
                    return Err(DeviceError::Driver(format!(
                        "peer_access: cuda:{peer} cannot access cuda:{ordinal}'s memory ({})",
                        driver::status_text(status)
                    )));
                }
            }
            self.reservations.options_checked = true;
        }
        Ok(device_access(ordinal, &self.reservations.options.peers))
    }

    /// Backs `[address, address + size)` with one physical allocation per `handle` bytes (the
    /// last one holding the rest), mapped each, with access set once for the whole run. Nothing
    /// in the range may be mapped; on failure whatever this call mapped is unmapped again.
    pub(super) fn map_range(&mut self, address: u64, size: u64, handle: u64) -> Result<(), DeviceError> {
        let granularity = self.page_size()?;
        let base = self.aligned_range(address, size, granularity)?;
        if handle == 0 || !handle.is_multiple_of(granularity) {
            return Err(DeviceError::InvalidAddress(address));
        }
        if self.reservations.by_base[&base]
            .mappings
            .range(..address + size)
            .next_back()
            .is_some_and(|(&s, &l)| s + l > address)
        {
            return Err(DeviceError::InvalidAddress(address));
        }
        super::check_capacity(self.capacity, self.held, size)?;
        let access = self.access()?;
        let _current = self.context.enter()?;
        let _relaxed = driver::relax_capture_mode();
        let prop = allocation_properties(self.ordinal(), self.reservations.options.shareable);
        let mut mapped = Vec::new();
        let outcome = handles(address, size, handle).try_for_each(|(at, len)| {
            map_one(at, len, &prop)?;
            mapped.push((at, len));
            Ok(())
        });
        let outcome = outcome.and_then(|()| {
            // SAFETY: the run was just mapped in full; the descriptors are valid for the call.
            check("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(address, size as usize, access.as_ptr(), access.len())
            })
        });
        if let Err(e) = outcome {
            for (at, len) in mapped {
                // A failure here leaves the handle mapped but unknown to the pool: a later map of
                // it fails, which is safe; nothing is handed out on it.
                unmap_one(at, len).ok();
            }
            return Err(e);
        }
        let mappings = &mut self.reservations.by_base.get_mut(&base).expect("reservation checked above").mappings;
        mappings.extend(handles(address, size, handle));
        self.held += size;
        Ok(())
    }

    /// Unmaps `[address, address + size)`, which must be whole mappings; stops at the first
    /// failure with the mappings before it gone and the rest still mapped (the pool asks for one
    /// handle at a time, so that is all or nothing).
    pub(super) fn unmap_range(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        let granularity = self.page_size()?;
        let base = self.aligned_range(address, size, granularity)?;
        let end = address + size;
        let r = &self.reservations.by_base[&base];
        let whole: Vec<(u64, u64)> = r.mappings.range(address..end).map(|(&a, &l)| (a, l)).collect();
        let covered: u64 = whole.iter().map(|&(_, l)| l).sum();
        if covered != size || whole.last().is_some_and(|&(a, l)| a + l > end) {
            return Err(DeviceError::InvalidAddress(address));
        }
        let _current = self.context.enter()?;
        let mappings = &mut self.reservations.by_base.get_mut(&base).expect("reservation checked above").mappings;
        for (at, len) in whole {
            unmap_one(at, len)?;
            mappings.remove(&at);
            self.held -= len;
        }
        Ok(())
    }

    /// Gives the reservation at `base` back; every handle of it must be unmapped.
    pub(super) fn unreserve_range(&mut self, base: u64) -> Result<(), DeviceError> {
        let r = self.reservations.by_base.get(&base).ok_or(DeviceError::InvalidAddress(base))?;
        if !r.mappings.is_empty() {
            return Err(DeviceError::InvalidAddress(base));
        }
        let size = r.size;
        let _current = self.context.enter()?;
        // SAFETY: a range we reserved, with no mappings left, freed once.
        check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(base, size as usize) })?;
        self.reservations.by_base.remove(&base);
        Ok(())
    }

    /// Bytes reserved and bytes mapped, summed over reservations.
    pub fn reserved_and_mapped(&self) -> (u64, u64) {
        self.reservations
            .by_base
            .values()
            .fold((0, 0), |(reserved, mapped), r| (reserved + r.size, mapped + r.mappings.values().sum::<u64>()))
    }
}

/// Creates one physical allocation of `size` bytes, maps it at `address` and releases the handle
/// (the mapping keeps the memory alive). The context must be current.
fn map_one(address: u64, size: u64, prop: &sys::CUmemAllocationProp) -> Result<(), DeviceError> {
    let mut handle = 0;
    // SAFETY: `prop` is fully initialized; one handle written.
    check_alloc("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, size as usize, prop, 0) }, size)?;
    // SAFETY: `[address, address + size)` is unmapped, aligned and inside a live reservation of ours.
    let mapped = check("cuMemMap", unsafe { sys::cuMemMap(address, size as usize, 0, handle, 0) });
    // SAFETY: the handle is released once; if it was mapped, the mapping keeps the memory until
    // it is unmapped (the driver's documented lifetime), else the memory goes now.
    let released = check("cuMemRelease", unsafe { sys::cuMemRelease(handle) });
    match (mapped, released) {
        (Err(e), _) => Err(e),
        (Ok(()), Err(e)) => {
            unmap_one(address, size).ok();
            Err(e)
        }
        (Ok(()), Ok(())) => Ok(()),
    }
}
