//! Reserved address ranges backed page by page (the driver's virtual memory management calls),
//! the mechanism behind PyTorch's expandable segments: the cuda backend's `reserve`, `map`,
//! `unmap` and `unreserve` of the [`Device`](crate::device::Device) trait.
//!
//! A *reservation* is address space with nothing behind it (`cuMemAddressReserve`). Mapping a
//! page range creates one physical allocation per page (`cuMemCreate`), maps it (`cuMemMap`) and
//! grants this device read/write access (`cuMemSetAccess`); one handle per page lets any page be
//! unmapped on its own later. Mapped pages count as memory the device holds.

use super::driver::{self, check, check_alloc};
use super::Cuda;
use crate::device::DeviceError;
use cudarc::driver::sys;
use std::collections::BTreeMap;

#[derive(Debug)]
struct Reservation {
    size: u64,
    /// Mapped pages: address -> physical allocation handle.
    pages: BTreeMap<u64, u64>,
}

/// Every reservation of one device, by base address.
#[derive(Debug, Default)]
pub struct Reservations {
    by_base: BTreeMap<u64, Reservation>,
    page_size: Option<u64>,
}

impl Reservations {
    fn holding(&self, address: u64) -> Option<(u64, &Reservation)> {
        let (&base, r) = self.by_base.range(..=address).next_back()?;
        (address < base + r.size).then_some((base, r))
    }

    /// Whether every byte of `[address, end)` is on mapped pages.
    pub fn is_mapped(&self, address: u64, end: u64) -> bool {
        let (Some((base, r)), Some(page)) = (self.holding(address), self.page_size) else {
            return false;
        };
        end <= base + r.size && {
            let first = address - (address - base) % page;
            (first..end).step_by(page as usize).all(|p| r.pages.contains_key(&p))
        }
    }

    /// Unmaps and frees everything (when the device closes); errors are ignored.
    pub fn release_all(&mut self) {
        let page = self.page_size.unwrap_or(0);
        for (base, r) in std::mem::take(&mut self.by_base) {
            for (&address, &handle) in &r.pages {
                unmap_page(address, page, handle).ok();
            }
            // SAFETY: a range we reserved, now without mappings, freed once.
            let _ = unsafe { sys::cuMemAddressFree(base, r.size as usize) };
        }
    }
}

/// Pinned device memory on `ordinal`, with no shareable handle.
fn allocation_properties(ordinal: i32) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn unmap_page(address: u64, page: u64, handle: u64) -> Result<(), DeviceError> {
    // SAFETY: `address` is a page we mapped with `handle`; after the unmap nothing refers to the
    // physical allocation, which is released once.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(address, page as usize) })?;
    // SAFETY: as above.
    check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}

impl Cuda {
    /// The mapping granularity: reservations and mappings are whole multiples of it.
    pub fn page_size(&mut self) -> Result<u64, DeviceError> {
        if let Some(page) = self.reservations.page_size {
            return Ok(page);
        }
        driver::require_symbols(driver::VMM_SYMBOLS, "virtual memory management")?;
        let _current = self.context.enter()?;
        let prop = allocation_properties(self.ordinal());
        let mut page = 0usize;
        let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: valid pointers to a granularity and a fully initialized properties struct.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(&mut page, &prop, minimum)
        })?;
        if page == 0 || !page.is_power_of_two() {
            return Err(DeviceError::Driver(format!("the driver reported a mapping granularity of {page} bytes")));
        }
        self.reservations.page_size = Some(page as u64);
        Ok(page as u64)
    }

    /// Reserves address space for `size` bytes (rounded up to whole pages); nothing is mapped.
    pub(super) fn reserve_range(&mut self, size: u64) -> Result<u64, DeviceError> {
        let page = self.page_size()?;
        let size = size.max(1).checked_next_multiple_of(page).ok_or(DeviceError::OutOfMemory { requested: size })?;
        let _current = self.context.enter()?;
        let mut base = 0;
        // SAFETY: the context is current; the driver picks the address (hint 0).
        check_alloc(
            "cuMemAddressReserve",
            unsafe { sys::cuMemAddressReserve(&mut base, size as usize, 0, 0, 0) },
            size,
        )?;
        self.reservations.by_base.insert(base, Reservation { size, pages: BTreeMap::new() });
        Ok(base)
    }

    /// The page-aligned `[address, address + size)` inside one reservation, and its base.
    fn page_range(&mut self, address: u64, size: u64) -> Result<(u64, u64), DeviceError> {
        let page = self.page_size()?;
        let invalid = DeviceError::InvalidAddress(address);
        let (base, r) = self.reservations.holding(address).ok_or(invalid.clone())?;
        let end = address.checked_add(size).ok_or(invalid.clone())?;
        if size == 0 || !(address - base).is_multiple_of(page) || !size.is_multiple_of(page) || end > base + r.size {
            return Err(invalid);
        }
        Ok((base, page))
    }

    /// Backs `[address, address + size)` with device memory, one physical allocation per page.
    /// Every page must be unmapped; on failure the pages this call mapped are unmapped again.
    pub(super) fn map_range(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        let (base, page) = self.page_range(address, size)?;
        let pages = &self.reservations.by_base[&base].pages;
        if pages.range(address..address + size).next().is_some() {
            return Err(DeviceError::InvalidAddress(address));
        }
        super::check_capacity(self.capacity, self.held, size)?;
        let _current = self.context.enter()?;
        let mut mapped = Vec::new();
        let outcome = (address..address + size).step_by(page as usize).try_for_each(|p| {
            mapped.push((p, self.map_page(p, page)?));
            Ok(())
        });
        let pages = &mut self.reservations.by_base.get_mut(&base).expect("reservation checked above").pages;
        match outcome {
            Ok(()) => {
                pages.extend(mapped);
                self.held += size;
                Ok(())
            }
            Err(e) => {
                for (p, handle) in mapped {
                    unmap_page(p, page, handle).ok();
                }
                Err(e)
            }
        }
    }

    fn map_page(&self, address: u64, page: u64) -> Result<u64, DeviceError> {
        let prop = allocation_properties(self.ordinal());
        let mut handle = 0;
        // SAFETY: the context is current; `prop` is fully initialized.
        check_alloc("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, page as usize, &prop, 0) }, page)?;
        // SAFETY: `address` is an unmapped, page-aligned page of a live reservation of ours.
        if let Err(e) = check("cuMemMap", unsafe { sys::cuMemMap(address, page as usize, 0, handle, 0) }) {
            // SAFETY: created above and never mapped.
            let _ = unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the page was just mapped; one valid access descriptor.
        if let Err(e) = check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(address, page as usize, &access, 1) }) {
            unmap_page(address, page, handle).ok();
            return Err(e);
        }
        Ok(handle)
    }

    /// Unmaps and frees the pages of `[address, address + size)`, which must all be mapped.
    pub(super) fn unmap_range(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        let (base, page) = self.page_range(address, size)?;
        let r = &self.reservations.by_base[&base];
        if r.pages.range(address..address + size).count() as u64 != size / page {
            return Err(DeviceError::InvalidAddress(address));
        }
        let _current = self.context.enter()?;
        let pages = &mut self.reservations.by_base.get_mut(&base).expect("reservation checked above").pages;
        for p in (address..address + size).step_by(page as usize) {
            let handle = pages[&p];
            unmap_page(p, page, handle)?;
            pages.remove(&p);
            self.held -= page;
        }
        Ok(())
    }

    /// Gives the reservation at `base` back; every page of it must be unmapped.
    pub(super) fn unreserve_range(&mut self, base: u64) -> Result<(), DeviceError> {
        let r = self.reservations.by_base.get(&base).ok_or(DeviceError::InvalidAddress(base))?;
        if !r.pages.is_empty() {
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
        let page = self.reservations.page_size.unwrap_or(0);
        self.reservations
            .by_base
            .values()
            .fold((0, 0), |(reserved, mapped), r| (reserved + r.size, mapped + r.pages.len() as u64 * page))
    }
}
