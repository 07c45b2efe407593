//! Pages shared with other processes through their shareable handles (`shareable_handle:posix_fd`).
//!
//! The exporting process turns each mapping (one physical allocation) under a range into a file
//! descriptor (`cuMemRetainAllocationHandle`, `cuMemExportToShareableHandle`); the importing
//! process duplicates those descriptors out of the exporter (`pidfd_open` + `pidfd_getfd`, Linux
//! 5.6 and later, as PyTorch's expandable segments do), turns them back into handles
//! (`cuMemImportFromShareableHandle`) and maps them side by side in an address range of its own.
//! Each export also names the file behind each descriptor, because a handle can outlive its
//! descriptors: the importer checks that the number it duplicated still names that file.

use super::driver::{self, check, Context};
use super::vmm::device_access;
use super::Cuda;
use crate::device::{DeviceError, ExportedPage, ExportedPages};
use cudarc::driver::sys;

/// Exporting and importing need these beyond the virtual memory calls.
const IPC_SYMBOLS: &[&str] =
    &["cuMemRetainAllocationHandle", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"];

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

impl Cuda {
    /// A file descriptor for each mapping under `[address, address + len)`, which must be mapped
    /// pages made with `shareable_handle:posix_fd`. The descriptors belong to the caller.
    pub(super) fn export_range(&mut self, address: u64, len: u64) -> Result<ExportedPages, DeviceError> {
        if !self.shares_pages() {
            return Err(DeviceError::Unsupported(
                "exporting pages not made shareable (configure shareable_handle:posix_fd)",
            ));
        }
        let end = address.checked_add(len.max(1)).ok_or(DeviceError::InvalidAddress(address))?;
        let mappings = self.mappings_covering(address, end).ok_or(DeviceError::InvalidAddress(address))?;
        driver::require_symbols(IPC_SYMBOLS, "sharing pages between processes")?;
        let _current = self.context.enter()?;
        let mut pages = Vec::with_capacity(mappings.len());
        for &(start, size) in &mappings {
            match export_one(start, size) {
                Ok(page) => pages.push(page),
                Err(e) => {
                    close_all(&pages);
                    return Err(e);
                }
            }
        }
        Ok(ExportedPages { pid: std::process::id(), pages, offset: address - mappings[0].0 })
    }
}

/// The mapping at `address`, of `size` bytes, exported as a new file descriptor; the context
/// must be current.
fn export_one(address: u64, size: u64) -> Result<ExportedPage, DeviceError> {
    let mut handle = 0;
    // SAFETY: `address` is inside a live mapping of ours; one handle written, released below.
    check("cuMemRetainAllocationHandle", unsafe {
        sys::cuMemRetainAllocationHandle(&mut handle, address as *mut std::ffi::c_void)
    })?;
    let mut fd: i32 = -1;
    // SAFETY: the handle was retained above; a POSIX descriptor is an int, written through `fd`.
    let exported = check("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle((&mut fd as *mut i32).cast(), handle, POSIX_FD, 0)
    });
    // SAFETY: balances the retain; the mapping keeps the memory.
    let released = check("cuMemRelease", unsafe { sys::cuMemRelease(handle) });
    exported?;
    let page = released.and_then(|()| file_of(fd)).map(|file| ExportedPage { fd, file, size });
    if page.is_err() {
        // SAFETY: the descriptor the export just opened, which nobody else has seen.
        unsafe { libc::close(fd) };
    }
    page
}

fn close_all(pages: &[ExportedPage]) {
    for page in pages {
        // SAFETY: descriptors this module opened and nobody else has seen.
        unsafe { libc::close(page.fd) };
    }
}

/// The file `fd` names: its device and inode.
fn file_of(fd: i32) -> Result<(u64, u64), DeviceError> {
    // SAFETY: all zeroes is a valid `stat`, which fstat overwrites.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `stat` is writable and outlives the call; a bad descriptor is an error, not UB.
    if unsafe { libc::fstat(fd, &mut stat) } != 0 {
        return Err(DeviceError::Driver(format!("fstat: {}", std::io::Error::last_os_error())));
    }
    Ok((stat.st_dev, stat.st_ino))
}

/// Another process's pages mapped here, side by side; `close` unmaps them, or dropping does,
/// best-effort.
#[derive(Debug)]
pub struct ImportedPages {
    context: Context,
    base: u64,
    size: u64,
    /// The mappings still in place: each leaves once unmapped.
    mappings: Vec<(u64, u64)>,
    /// Set until `[base, base + size)` goes back to the driver.
    reserved: bool,
}

impl ImportedPages {
    /// Where the pages start in this process.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Unmaps the pages and frees their range. What fails stays recorded, so that a later call
    /// retries it rather than reporting success over a live mapping; the exporter's memory stays
    /// its own either way.
    pub fn close(&mut self) -> Result<(), DeviceError> {
        if self.mappings.is_empty() && !self.reserved {
            return Ok(());
        }
        let _current = self.context.enter()?;
        let mut first_error = None;
        self.mappings.retain(|&(address, len)| {
            // SAFETY: a mapping made by `import_pages` and not unmapped yet.
            match check("cuMemUnmap", unsafe { sys::cuMemUnmap(address, len as usize) }) {
                Ok(()) => false,
                Err(e) => {
                    first_error.get_or_insert(e);
                    true
                }
            }
        });
        if let Some(e) = first_error {
            return Err(e);
        }
        if self.reserved {
            // SAFETY: the range reserved by `import_pages`, now without mappings, freed once.
            check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(self.base, self.size as usize) })?;
            self.reserved = false;
        }
        Ok(())
    }
}

/// Maps on `cuda:ordinal` the pages process `pid` exported as `pages`.
pub fn import_pages(ordinal: i32, pid: u32, pages: &[ExportedPage]) -> Result<ImportedPages, DeviceError> {
    driver::require_symbols(driver::VMM_SYMBOLS, "virtual memory management")?;
    driver::require_symbols(IPC_SYMBOLS, "sharing pages between processes")?;
    let context = Context::retain(ordinal)?;
    let vmm = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED;
    if !context.supports(vmm)? {
        return Err(DeviceError::Unsupported("virtual memory management, which importing pages needs"));
    }
    let _current = context.enter()?;
    let size: u64 = pages.iter().map(|page| page.size).sum();
    let mut base = 0;
    // SAFETY: the context is current; the driver picks the address.
    check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut base, size as usize, 0, 0, 0) })?;
    // From here on, dropping `imported` undoes whatever was mapped.
    let mut imported = ImportedPages { context, base, size, mappings: Vec::new(), reserved: true };
    let pidfd = pidfd_open(pid)?;
    let mut at = base;
    let mapped = pages.iter().try_for_each(|page| {
        map_imported(pid, pidfd, page, at)?;
        imported.mappings.push((at, page.size));
        at += page.size;
        Ok(())
    });
    // SAFETY: a descriptor opened above, closed once.
    unsafe { libc::close(pidfd) };
    mapped?;
    let access = device_access(ordinal, &[]);
    // SAFETY: the whole range was just mapped; one valid descriptor.
    check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(base, size as usize, access.as_ptr(), access.len()) })?;
    Ok(imported)
}

/// Duplicates `page`'s descriptor out of process `pid` (open as `pidfd`), imports it and maps it
/// at `address`.
fn map_imported(pid: u32, pidfd: i32, page: &ExportedPage, address: u64) -> Result<(), DeviceError> {
    let (fd, len) = (page.fd, page.size);
    // SAFETY: pidfd_getfd takes a pidfd, the other process's descriptor and flags 0.
    let local = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) } as i32;
    if local < 0 {
        return Err(DeviceError::Driver(format!("pidfd_getfd: {}", std::io::Error::last_os_error())));
    }
    let same_file = file_of(local).and_then(|file| {
        if file == page.file {
            return Ok(());
        }
        Err(DeviceError::Driver(format!(
            "stale IPC handle: descriptor {fd} of process {pid} no longer names the exported pages (the \
             exporter closed the handle, and the number now belongs to another file)"
        )))
    });
    if same_file.is_err() {
        // SAFETY: our duplicate, closed once.
        unsafe { libc::close(local) };
    }
    same_file?;
    let mut handle = 0;
    // SAFETY: `local` is an open descriptor of an exported allocation; the driver takes the int
    // as a pointer-sized value.
    let status = unsafe { sys::cuMemImportFromShareableHandle(&mut handle, local as usize as *mut _, POSIX_FD) };
    // SAFETY: our duplicate, closed once; the handle keeps the memory.
    unsafe { libc::close(local) };
    check("cuMemImportFromShareableHandle", status)?;
    // SAFETY: `address` is an unmapped, aligned part of our reservation; the handle is released
    // once, the mapping keeping the memory.
    let mapped = check("cuMemMap", unsafe { sys::cuMemMap(address, len as usize, 0, handle, 0) });
    // SAFETY: as above.
    let released = check("cuMemRelease", unsafe { sys::cuMemRelease(handle) });
    if mapped.is_ok() && released.is_err() {
        // Not recorded as a mapping: undo it here, so the range can be freed.
        // SAFETY: the mapping just made, unmapped once.
        let _ = unsafe { sys::cuMemUnmap(address, len as usize) };
    }
    mapped.and(released)
}

fn pidfd_open(pid: u32) -> Result<i32, DeviceError> {
    // SAFETY: pidfd_open takes a pid and flags 0.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) } as i32;
    if pidfd < 0 {
        return Err(DeviceError::Driver(format!("pidfd_open({pid}): {}", std::io::Error::last_os_error())));
    }
    Ok(pidfd)
}

impl Drop for ImportedPages {
    /// Best-effort: a caller that must know whether the pages went calls `close` first.
    fn drop(&mut self) {
        let _ = self.close();
    }
}
