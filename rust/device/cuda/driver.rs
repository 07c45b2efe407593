//! Reaching the CUDA driver without ever panicking: the probe, error translation, the context.
//!
//! cudarc loads `libcuda` on first use and panics when the library or a symbol is missing. Every
//! path into the driver therefore starts at [`probe`], which looks for the library and for each
//! symbol gpupool calls before the first real driver call, inside `catch_unwind`.

use crate::device::DeviceError;
use cudarc::driver::sys::{self, CUresult};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// The oldest driver gpupool accepts (CUDA 12.0), as `cuDriverGetVersion` encodes it.
pub const MIN_DRIVER_VERSION: i32 = 12000;

/// What every CUDA device needs: context, segments, copies, streams and events.
const CORE_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuCtxGetDevice",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamQuery",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamIsCapturing",
    "cuStreamGetCaptureInfo_v2",
    "cuStreamGetCtx",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuIpcGetMemHandle",
];

/// The driver's stream-ordered pool, for [`super::Mode::Async`].
pub const ASYNC_SYMBOLS: &[&str] =
    &["cuMemAllocAsync", "cuMemFreeAsync", "cuDeviceGetDefaultMemPool", "cuMemPoolSetAttribute"];

/// Virtual memory management, for reserved address ranges backed page by page.
pub const VMM_SYMBOLS: &[&str] = &[
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuDeviceCanAccessPeer",
];

/// What the probe learned about the installed driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    /// `major * 1000 + minor * 10`, as the driver reports it.
    pub version: i32,
    pub device_count: i32,
}

/// `12.8` for `12080`.
pub fn version_text(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// Loads and checks the driver once per process; every later call returns the same answer.
pub fn probe() -> Result<DriverInfo, DeviceError> {
    static PROBE: OnceLock<Result<DriverInfo, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            catch_unwind(probe_uncached)
                .unwrap_or_else(|_| Err("the CUDA driver could not be loaded (cudarc panicked while probing)".into()))
        })
        .clone()
        .map_err(DeviceError::Driver)
}

fn probe_uncached() -> Result<DriverInfo, String> {
    // SAFETY: `is_culib_present` only tries to open candidate library names and closes them.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver found: libcuda.so.1 could not be loaded (is the NVIDIA driver installed, and \
                    LD_LIBRARY_PATH right?)"
            .into());
    }
    find_symbols(CORE_SYMBOLS)?;
    // cuInit comes before any other driver call, the version query included (the driver API's
    // initialization rule). It takes flags 0 and may be called any number of times.
    // SAFETY: the symbol exists (checked above); no pointers.
    let code = unsafe { sys::cuInit(0) };
    if is(code, CUresult::CUDA_ERROR_STUB_LIBRARY) {
        return Err("a stub libcuda (the CUDA toolkit's lib64/stubs) was loaded instead of the NVIDIA driver's: \
                    remove the stubs folder from LD_LIBRARY_PATH"
            .into());
    }
    check("cuInit", code).map_err(|e| format!("the CUDA driver failed to start: {e}"))?;
    watch_forks();
    let mut version = 0;
    // SAFETY: the symbol exists (checked above) and writes one int through a valid pointer.
    check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut version) }).map_err(|e| e.to_string())?;
    if version < MIN_DRIVER_VERSION {
        return Err(format!(
            "the CUDA driver is too old: it supports CUDA {}, gpupool needs CUDA {} or newer (update the NVIDIA \
             driver)",
            version_text(version),
            version_text(MIN_DRIVER_VERSION)
        ));
    }
    let mut device_count = 0;
    // SAFETY: writes one int through a valid pointer, after cuInit succeeded.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut device_count) }).map_err(|e| e.to_string())?;
    Ok(DriverInfo { version, device_count })
}

/// Set in a child forked after the driver started. CUDA does not survive a fork: any driver
/// call in such a child is undefined, so none is made there. Pools keep the parent's memory
/// out of the child's reach too, but a bare device, imported pages, or a destructor running at
/// the child's exit reach the driver only through [`Context`], which refuses.
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn mark_forked() {
    FORKED.store(true, Ordering::SeqCst);
}

/// Arms [`FORKED`] for children forked from now on; the probe runs it once, after `cuInit`.
fn watch_forks() {
    // SAFETY: the handler runs in the child right after the fork, where only async-signal-safe
    // code may run: an atomic store is.
    unsafe { libc::pthread_atfork(None, None, Some(mark_forked as unsafe extern "C" fn())) };
}

/// Refuses a driver call in a child forked after the driver started.
fn refuse_forked() -> Result<(), DeviceError> {
    if FORKED.load(Ordering::SeqCst) {
        return Err(DeviceError::Driver(
            "CUDA cannot be used in a process forked after it started CUDA (start it with multiprocessing's \
             'spawn' method)"
                .into(),
        ));
    }
    Ok(())
}

fn find_symbols(names: &[&str]) -> Result<(), String> {
    // SAFETY: only called after `is_culib_present` found the library, so `culib` opens it rather
    // than panicking (and a panic would be caught by the caller's `catch_unwind` anyway). Looking
    // a symbol up calls nothing.
    let library = unsafe { sys::culib() };
    for name in names {
        // SAFETY: the symbol is only looked up, never called through this type.
        if unsafe { library.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
            return Err(format!("the CUDA driver lacks {name} (is it older than CUDA 12?)"));
        }
    }
    Ok(())
}

/// Checks that the optional `names` exist, after a successful [`probe`].
pub fn require_symbols(names: &[&str], feature: &str) -> Result<(), DeviceError> {
    probe()?;
    catch_unwind(AssertUnwindSafe(|| find_symbols(names)))
        .unwrap_or_else(|_| Err("the CUDA driver could not be loaded".into()))
        .map_err(|e| DeviceError::Driver(format!("{feature} unavailable: {e}")))
}

/// Makes the calling thread's stream-capture mode relaxed until the guard drops, which gives the
/// thread its own mode back. While any thread captures in global mode (the default), a thread in
/// that mode may not allocate from the driver (`cuMemAlloc`, `cuMemCreate`, `cuMemMap`): the call
/// fails and invalidates the capture. Memory the pool asks for is invisible to every capture (it
/// allocates for no capturing stream, and a graph keeps the addresses it saw), so, as PyTorch
/// does, it relaxes only its own thread for the call. Every driver gpupool accepts has the call;
/// a stand-in without it leaves the mode as it is rather than failing the device.
pub fn relax_capture_mode() -> RelaxedCapture {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    let present = *PRESENT.get_or_init(|| require_symbols(&["cuThreadExchangeStreamCaptureMode"], "").is_ok());
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: the symbol exists (checked above); one mode read and written through a valid pointer.
    let swapped = present && is(unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }, CUresult::CUDA_SUCCESS);
    RelaxedCapture { previous: swapped.then_some(mode) }
}

/// The thread's capture mode before [`relax_capture_mode`], restored on drop.
#[must_use = "the thread's capture mode is relaxed only while the guard lives"]
pub struct RelaxedCapture {
    previous: Option<sys::CUstreamCaptureMode>,
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        if let Some(mut mode) = self.previous {
            // SAFETY: as in `relax_capture_mode`; puts back the mode the driver handed over.
            let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}

/// The statuses the bindings name (CUDA 12.8's `CUresult`). A newer driver returns others (CUDA
/// 13 added some), which the bindings' enum then holds without a name: such a value must never
/// be printed as the enum, whose formatting assumes a named one (a status of 36 crashed the
/// interpreter that way).
const NAMED_STATUSES: &[u32] = &[
    0, 1, 2, 3, 4, 5, 6, 7, 8, 34, 46, 100, 101, 102, 200, 201, 202, 205, 206, 207, 208, 209, 210, 211, 212, 213, 214,
    215, 216, 217, 218, 219, 220, 221, 222, 223, 224, 225, 226, 300, 301, 302, 303, 304, 400, 401, 402, 500, 600, 700,
    701, 702, 703, 704, 705, 708, 709, 710, 711, 712, 713, 714, 715, 716, 717, 718, 719, 720, 721, 800, 801, 802, 803,
    804, 805, 806, 807, 808, 809, 810, 811, 812, 900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910, 911, 912, 913,
    914, 915, 916, 999,
];

/// A driver status as the number the driver returned. Read through memory, as a plain integer:
/// a cast would let the compiler assume one of the named values and index tables by it.
pub fn raw_status(code: CUresult) -> u32 {
    // SAFETY: `CUresult` is `repr(u32)`: its bytes are a u32, read from a live local.
    unsafe { std::ptr::read_volatile((&code as *const CUresult).cast::<u32>()) }
}

/// Whether `code` is `status`, compared as numbers (see [`raw_status`]).
pub fn is(code: CUresult, status: CUresult) -> bool {
    raw_status(code) == status as u32
}

/// A driver status in words: its name when the bindings know it, else its number.
pub fn status_text(code: CUresult) -> String {
    let raw = raw_status(code);
    if NAMED_STATUSES.contains(&raw) {
        format!("{code:?}")
    } else {
        format!("CUDA error {raw}")
    }
}

/// A driver status as a `DeviceError` naming the call; never asks the driver for error text
/// (that would be one more symbol that may be missing).
pub fn check(call: &str, code: CUresult) -> Result<(), DeviceError> {
    if is(code, CUresult::CUDA_SUCCESS) {
        Ok(())
    } else {
        Err(DeviceError::Driver(format!("{call} failed with {}", status_text(code))))
    }
}

/// Like [`check`], but an out-of-memory status becomes [`DeviceError::OutOfMemory`].
pub fn check_alloc(call: &str, code: CUresult, requested: u64) -> Result<(), DeviceError> {
    if is(code, CUresult::CUDA_ERROR_OUT_OF_MEMORY) {
        return Err(DeviceError::OutOfMemory { requested });
    }
    check(call, code)
}

/// `Ok(true)` when finished, `Ok(false)` for `CUDA_ERROR_NOT_READY`, else the error.
pub fn check_ready(call: &str, code: CUresult) -> Result<bool, DeviceError> {
    if is(code, CUresult::CUDA_ERROR_NOT_READY) {
        return Ok(false);
    }
    check(call, code).map(|()| true)
}

/// A device's primary context (the one the CUDA runtime, PyTorch and CuPy share), retained for
/// as long as this value lives. Handles are kept as integers so devices stay `Send`.
#[derive(Debug)]
pub struct Context {
    ordinal: i32,
    device: sys::CUdevice,
    raw: u64,
}

impl Context {
    pub fn retain(ordinal: i32) -> Result<Self, DeviceError> {
        let info = probe()?;
        refuse_forked()?;
        if ordinal < 0 || ordinal >= info.device_count {
            return Err(DeviceError::Driver(format!(
                "cuda:{ordinal} does not exist: the driver sees {} CUDA device(s)",
                info.device_count
            )));
        }
        let mut device = 0;
        // SAFETY: the driver is initialized (probe) and `ordinal` is in range.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut device, ordinal) })?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `device` is a valid device handle; the context is released in `drop`.
        check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut raw, device) })?;
        Ok(Context { ordinal, device, raw: raw as u64 })
    }

    /// Retains context `raw` when it is its device's primary context, which then outlives its
    /// owner's release for as long as the value lives; `None` for a context made with
    /// `cuCtxCreate`, which only its creator can keep alive. `raw` must be alive now: the context
    /// of a stream the caller was just handed.
    pub fn retain_primary(raw: u64) -> Result<Option<Self>, DeviceError> {
        let info = probe()?;
        let device = {
            let _current = enter(raw)?;
            let mut device = 0;
            // SAFETY: `raw` is current; one device handle written.
            check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut device) })?;
            device
        };
        let ordinal = (0..info.device_count)
            .find(|&ordinal| {
                let mut handle = 0;
                // SAFETY: the driver is initialized (probe) and `ordinal` is in range.
                let code = unsafe { sys::cuDeviceGet(&mut handle, ordinal) };
                is(code, CUresult::CUDA_SUCCESS) && handle == device
            })
            .ok_or_else(|| DeviceError::Driver(format!("context {raw:#x} is on a device the driver does not list")))?;
        let primary = Context::retain(ordinal)?;
        Ok((primary.raw == raw).then_some(primary))
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The driver's handle for the device (what `cuDeviceGet` returned for the ordinal), which
    /// calls taking a `CUdevice` need; memory locations take the ordinal instead.
    pub fn device(&self) -> sys::CUdevice {
        self.device
    }

    /// Whether the device reports `attribute` (a yes/no attribute) as supported.
    pub fn supports(&self, attribute: sys::CUdevice_attribute) -> Result<bool, DeviceError> {
        refuse_forked()?;
        let mut value = 0;
        // SAFETY: `device` is a valid device handle; one int written.
        check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut value, attribute, self.device) })?;
        Ok(value != 0)
    }

    /// The driver's handle for the context.
    pub fn raw(&self) -> u64 {
        self.raw
    }

    /// Makes this context current on the calling thread until the returned guard drops, which
    /// restores whatever was current before (errors included: the guard restores on any exit).
    /// Python threads, PyTorch's autograd threads and the C ABI's callers reach a device from
    /// threads of their own, whose current context belongs to them: PyTorch and CuPy keep their
    /// notion of the current device there, and a gpupool call must leave it as it found it.
    pub fn enter(&self) -> Result<Entered, DeviceError> {
        enter(self.raw)
    }
}

/// Makes context `raw` current, as [`Context::enter`] does; the caller knows it is alive (one a
/// [`Context`] retains, or the context of a stream the caller was just handed).
pub fn enter(raw: u64) -> Result<Entered, DeviceError> {
    refuse_forked()?;
    let mut previous = std::ptr::null_mut();
    // SAFETY: writes one context handle through a valid pointer.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut previous) })?;
    let previous = previous as u64;
    if previous != raw {
        // SAFETY: a live context (see above).
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(raw as sys::CUcontext) })?;
    }
    Ok(Entered { previous: (previous != raw).then_some(previous) })
}

/// A context made current by [`Context::enter`]; dropping it makes the previous one current again.
#[must_use = "the context is current only while the guard lives"]
pub struct Entered {
    /// The context to restore (possibly none, 0), when it differed from ours.
    previous: Option<u64>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: the handle was current on this thread a moment ago (or null, which unbinds).
            // A failure cannot be reported from a destructor and would leave ours current, which
            // the next call through a guard corrects.
            let _ = unsafe { sys::cuCtxSetCurrent(previous as sys::CUcontext) };
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // The parent's retain, in a forked child: not this process's to release.
        if refuse_forked().is_err() {
            return;
        }
        // SAFETY: balances the retain in `Context::retain`. A failure (the driver shutting down
        // at exit) leaves nothing to clean up.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}
