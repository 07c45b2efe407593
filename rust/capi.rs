//! `extern "C"` allocation with PyTorch's pluggable-allocator signatures, over one process-wide
//! pool per device (`gpupool.torch.install` points `torch.cuda.memory.CUDAPluggableAllocator` at
//! the extension module, which exports these functions).
//!
//! The caller hands back raw addresses, so each device keeps an address -> handle map, and raw
//! stream handles are imported once each. Nothing here may unwind into C: every entry point
//! catches panics, and failures become a null pointer (which PyTorch reports as out of memory)
//! or an ignored free.

use crate::core::Handle;
use crate::device::{Device, DeviceError, Host, StreamId};
use crate::pool::{Config, Pool, PoolError};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};

/// Where the process-wide pools get their memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Host memory: one `host` pool per device number, so the C ABI runs without a GPU.
    Host,
    /// `cuda:N` for device number N.
    #[cfg(feature = "cuda")]
    Cuda,
}

impl Default for Backend {
    /// The CUDA backend when compiled in: PyTorch only calls these functions for CUDA memory.
    fn default() -> Self {
        #[cfg(feature = "cuda")]
        return Backend::Cuda;
        #[cfg(not(feature = "cuda"))]
        Backend::Host
    }
}

impl Backend {
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn open(self, device: c_int) -> Result<Box<dyn Device>, DeviceError> {
        match self {
            Backend::Host => Ok(Box::new(Host::new(None))),
            #[cfg(feature = "cuda")]
            Backend::Cuda => Ok(Box::new(crate::device::Cuda::open(device, crate::device::CudaMode::Direct, None)?)),
        }
    }
}

struct DeviceState {
    pool: Pool<Box<dyn Device>>,
    /// Live allocations by address, so a raw-pointer free finds its handle.
    live: HashMap<u64, Handle>,
    /// Imported raw stream handles.
    streams: HashMap<u64, StreamId>,
}

impl DeviceState {
    fn stream(&mut self, handle: u64) -> Result<StreamId, PoolError> {
        if let Some(&id) = self.streams.get(&handle) {
            return Ok(id);
        }
        let id = self.pool.device_mut().import_stream(handle).or_else(|e| match e {
            // Devices without real streams (host) serve every caller on their default stream.
            DeviceError::Unsupported(_) => Ok(crate::device::DEFAULT_STREAM),
            e => Err(e),
        })?;
        self.streams.insert(handle, id);
        Ok(id)
    }
}

struct Global {
    backend: Backend,
    config: Config,
    devices: HashMap<c_int, DeviceState>,
}

static GLOBAL: Mutex<Option<Global>> = Mutex::new(None);

fn global() -> Result<MutexGuard<'static, Option<Global>>, String> {
    GLOBAL.lock().map_err(|_| "the global pool was left inconsistent by an earlier panic".to_string())
}

/// Chooses the backend and configuration of the process-wide pools. Pools already opened are
/// closed (their cached memory returned) unless they still serve allocations.
pub fn configure(backend: Backend, config: Config) -> Result<(), String> {
    let mut global = global()?;
    if let Some(g) = global.as_ref() {
        if let Some((device, state)) = g.devices.iter().find(|(_, s)| !s.live.is_empty()) {
            return Err(format!(
                "the global pool of device {device} still serves {} allocation(s); configure it before the first \
                 allocation",
                state.live.len()
            ));
        }
    }
    *global = Some(Global { backend, config, devices: HashMap::new() });
    Ok(())
}

impl Global {
    fn device(&mut self, device: c_int) -> Result<&mut DeviceState, PoolError> {
        if !self.devices.contains_key(&device) {
            let pool = Pool::new(self.backend.open(device)?, self.config.clone());
            self.devices.insert(device, DeviceState { pool, live: HashMap::new(), streams: HashMap::new() });
        }
        Ok(self.devices.get_mut(&device).expect("inserted above"))
    }
}

fn allocate(size: isize, device: c_int, stream: u64) -> Result<u64, String> {
    // PyTorch asks for 0 bytes for empty tensors; they still need a distinct, freeable address.
    let size = u64::try_from(size).map_err(|_| format!("negative size {size}"))?.max(1);
    let mut global = global()?;
    let g = global.get_or_insert_with(|| Global {
        backend: Backend::default(),
        config: Config::default(),
        devices: HashMap::new(),
    });
    let state = g.device(device).map_err(|e| e.to_string())?;
    let stream = state.stream(stream).map_err(|e| e.to_string())?;
    let allocation = state.pool.alloc_on(size, stream).map_err(|e| e.to_string())?;
    state.live.insert(allocation.address, allocation.handle);
    Ok(allocation.address)
}

fn free(address: u64, device: c_int) -> Result<(), String> {
    let mut global = global()?;
    let state = global.as_mut().and_then(|g| g.devices.get_mut(&device)).ok_or("no pool for this device")?;
    let handle = state.live.remove(&address).ok_or_else(|| format!("{address:#x} is not a live allocation"))?;
    state.pool.free(handle).map_err(|e| e.to_string())
}

/// `void* gpupool_alloc(ssize_t size, int device, cudaStream_t stream)`: null when the pool
/// cannot serve the request.
#[no_mangle]
pub extern "C" fn gpupool_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    let outcome = catch_unwind(AssertUnwindSafe(|| allocate(size, device, stream as u64)));
    match outcome {
        Ok(Ok(address)) => address as *mut c_void,
        Ok(Err(e)) => {
            remember_error(e);
            std::ptr::null_mut()
        }
        Err(_) => std::ptr::null_mut(),
    }
}

/// `void gpupool_free(void* ptr, ssize_t size, int device, cudaStream_t stream)`. The block goes
/// back to the pool on the stream it was allocated on; an unknown pointer is ignored (and kept
/// as the last error), since C has no way to be told.
#[no_mangle]
pub extern "C" fn gpupool_free(ptr: *mut c_void, _size: isize, device: c_int, _stream: *mut c_void) {
    if let Ok(Err(e)) = catch_unwind(AssertUnwindSafe(|| free(ptr as u64, device))) {
        remember_error(e);
    }
}

static LAST_ERROR: Mutex<Option<String>> = Mutex::new(None);

fn remember_error(e: String) {
    if let Ok(mut last) = LAST_ERROR.lock() {
        *last = Some(e);
    }
}

/// The most recent failure of a C entry point, cleared by reading it.
pub fn take_last_error() -> Option<String> {
    LAST_ERROR.lock().ok().and_then(|mut last| last.take())
}

/// The statistics of device `device`'s global pool, if it was opened.
pub fn memory_stats(device: c_int) -> Option<Vec<(String, u64)>> {
    let global = global().ok()?;
    global.as_ref()?.devices.get(&device).map(|s| s.pool.stats().entries())
}

/// Returns the cached, fully free segments of every global pool; returns the bytes released.
pub fn empty_cache() -> Result<u64, String> {
    let mut global = global()?;
    let Some(g) = global.as_mut() else { return Ok(0) };
    let mut released = 0;
    for state in g.devices.values_mut() {
        released += state.pool.empty_cache().map_err(|e| e.to_string())?;
    }
    Ok(released)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test, because the global pool is process-wide state.
    #[test]
    fn host_backend_round_trip() {
        configure(Backend::Host, Config::default()).unwrap();
        let stream = std::ptr::null_mut();
        let a = gpupool_alloc(1000, 0, stream);
        let b = gpupool_alloc(0, 1, stream);
        assert!(!a.is_null() && !b.is_null());
        // SAFETY: host-backend addresses are host memory of at least the requested size.
        unsafe { std::ptr::write_bytes(a.cast::<u8>(), 7, 1000) };
        assert_eq!(memory_stats(0).unwrap().iter().find(|(k, _)| k == "allocation.all.current").unwrap().1, 1);
        assert!(configure(Backend::Host, Config::default()).is_err(), "live allocations pin the configuration");
        gpupool_free(a, 1000, 0, stream);
        gpupool_free(b, 0, 1, stream);
        gpupool_free(a, 1000, 0, stream);
        assert!(take_last_error().unwrap().contains("not a live allocation"));
        assert!(gpupool_alloc(-1, 0, stream).is_null());
        assert!(take_last_error().unwrap().contains("negative"));
        assert!(empty_cache().unwrap() > 0);
        configure(Backend::Host, Config::default()).unwrap();
    }
}
