//! `gpupool._native._SharedPages` and the functions that export and import pages between
//! processes (`shareable_handle:posix_fd`); gpupool.numba's IPC handles use them.

use super::error::{not_allocated, pool_error};
use super::pool::PyPool;
use crate::device::cuda::ipc::{import_pages, ImportedPages};
use crate::device::ExportedPage;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::Mutex;

/// One exported page as Python sees it: `(fd, size, st_dev, st_ino)`, the last two naming the
/// file behind `fd` so that the importer can refuse a number since reused.
type Page = (i32, u64, u64, u64);

/// What Python receives for exported pages: `(pid, [page, ...], offset)`.
type Export = (u32, Vec<Page>, u64);

/// The pages under `[address, address + size)` of `pool`, exported; the caller closes the
/// descriptors once the other process has taken them.
#[pyfunction]
fn _export_pages(py: Python<'_>, pool: &PyPool, address: u64, size: u64) -> PyResult<Export> {
    pool.shared().lock(py)?.detach(|pool| {
        if !pool.is_allocated(address, size) {
            return Err(not_allocated(address, size));
        }
        let exported = pool.device_mut().export_pages(address, size);
        let e = exported.map_err(|e| pool_error(e.into()))?;
        let pages = e.pages.iter().map(|p| (p.fd, p.size, p.file.0, p.file.1)).collect();
        Ok((e.pid, pages, e.offset))
    })
}

/// Another process's pages mapped into this one; `close()` (or dropping it) unmaps them.
#[pyclass(name = "_SharedPages", module = "gpupool._native", frozen)]
pub struct PySharedPages {
    pages: Mutex<Option<ImportedPages>>,
    base: u64,
}

#[pymethods]
impl PySharedPages {
    /// Where the imported pages start in this process.
    #[getter]
    fn base(&self) -> u64 {
        self.base
    }

    /// Unmaps the pages; raises the driver's error if that fails, keeping what is left for a
    /// later `close()` to retry.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let lock = || self.pages.lock().map_err(|_| PyValueError::new_err("a close panicked"));
        // Taken out first: the lock is never held while detached, where a thread waiting for it
        // with the interpreter attached would deadlock with this one.
        let Some(mut imported) = lock()?.take() else { return Ok(()) };
        match py.detach(|| imported.close()) {
            Ok(()) => Ok(()),
            Err(e) => {
                *lock()? = Some(imported);
                Err(pool_error(e.into()))
            }
        }
    }
}

/// Maps on `cuda:device` the pages process `pid` exported (see `_export_pages`).
#[pyfunction]
fn _import_pages(py: Python<'_>, device: i32, pid: u32, pages: Vec<Page>) -> PyResult<PySharedPages> {
    let pages: Vec<_> =
        pages.into_iter().map(|(fd, size, dev, ino)| ExportedPage { fd, file: (dev, ino), size }).collect();
    let imported = py.detach(|| import_pages(device, pid, &pages)).map_err(|e| pool_error(e.into()))?;
    Ok(PySharedPages { base: imported.base(), pages: Mutex::new(Some(imported)) })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySharedPages>()?;
    m.add_function(wrap_pyfunction!(_export_pages, m)?)?;
    m.add_function(wrap_pyfunction!(_import_pages, m)?)?;
    Ok(())
}
