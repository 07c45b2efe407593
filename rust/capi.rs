//! `extern "C"` allocation with PyTorch's pluggable-allocator signatures, over one process-wide
//! pool per device (`gpupool.torch.install` points `torch.cuda.memory.CUDAPluggableAllocator` at
//! the extension module, which exports these functions).
//!
//! Each device has its own pool behind its own lock; the process-wide lock is held only to find
//! (or open) a device's pool, so one device's synchronization never stalls another's
//! allocations. The caller hands back raw addresses, so each device keeps an address -> handle
//! map, and raw stream handles are imported once each. Nothing here may unwind into C except
//! [`gpupool_torch_alloc`], which throws a C++ exception on purpose (see there): every other entry
//! point catches panics, and failures become a null pointer or an ignored call, remembered for
//! [`take_last_error`].

use crate::core::Handle;
use crate::device::{Device, DeviceError, Host, StreamId};
use crate::pool::{Config, Pool, PoolError};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

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
    /// PyTorch's `backend:cudaMallocAsync` opens the device in stream-ordered mode, as for a
    /// Python pool.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn open(self, device: c_int, config: &Config) -> Result<Box<dyn Device>, DeviceError> {
        match self {
            // Device numbers are C ints, as CUDA's: a negative one names no device there either
            // (and each number opens a pool of its own).
            Backend::Host if device < 0 => Err(DeviceError::Driver(format!("host device {device} does not exist"))),
            Backend::Host => Ok(Box::new(Host::new(None))),
            #[cfg(feature = "cuda")]
            Backend::Cuda => {
                use crate::device::{Cuda, CudaMode};
                use crate::pool::Backend as PoolBackend;
                let mode = match config.backend {
                    PoolBackend::CudaMallocAsync => CudaMode::Async,
                    PoolBackend::Native => CudaMode::Direct,
                };
                Ok(Box::new(Cuda::open(device, mode, None)?))
            }
        }
    }
}

struct DeviceState {
    pool: Pool<Box<dyn Device>>,
    /// Live allocations by address, so a raw-pointer free finds its handle.
    live: HashMap<u64, Handle>,
    /// Imported raw stream handles.
    streams: HashMap<u64, StreamId>,
    /// Frees the pool refused (a device call failed, and the free did not happen). The caller
    /// never frees an address twice, so they are retried at the device's next call.
    refused: Vec<Handle>,
    /// Replaced by [`configure`]: a caller that found this state before then looks again.
    closed: bool,
}

impl DeviceState {
    /// Frees `handle`, or keeps it to retry.
    fn free(&mut self, handle: Handle) -> Result<(), PoolError> {
        self.pool.free(handle).inspect_err(|_| self.refused.push(handle))
    }

    /// Retries the refused frees; one refused again is freed after waiting for the device, so
    /// that no event is needed (the stream that refused one may be gone). Those refused even
    /// then stay, and the last error says why.
    fn retry_refused(&mut self) {
        if !self.refused.is_empty() {
            for handle in std::mem::take(&mut self.refused) {
                let freed = self.pool.free(handle).or_else(|_| self.pool.free_synchronized(handle));
                if let Err(e) = freed {
                    self.refused.push(handle);
                    remember_error(format!("a refused free failed again: {e}"));
                }
            }
        }
    }

    fn stream(&mut self, handle: u64) -> Result<StreamId, String> {
        if let Some(&id) = self.streams.get(&handle) {
            return Ok(id);
        }
        crate::device::refuse_stream_handle(handle)?;
        let id = self.pool.device_mut().import_stream(handle).or_else(|e| match e {
            // Devices without real streams (host) serve every caller on their default stream.
            DeviceError::Unsupported(_) => Ok(crate::device::DEFAULT_STREAM),
            e => Err(e.to_string()),
        })?;
        self.streams.insert(handle, id);
        Ok(id)
    }
}

type SharedState = Arc<Mutex<DeviceState>>;

struct Global {
    backend: Backend,
    config: Config,
    devices: HashMap<c_int, SharedState>,
}

static GLOBAL: Mutex<Option<Global>> = Mutex::new(None);

/// Set in a child forked after the first device's pool was opened: the pools are the parent's.
/// Their CUDA contexts do not survive a fork, and a thread of the parent's may have held one of
/// their locks then, which nothing in the child would ever release. A child forked before that
/// (after `gpupool.torch.install()` configured the pools, say, and before CUDA started) opens
/// its own, unless a parent thread held the process-wide lock at the fork.
static FORKED: AtomicBool = AtomicBool::new(false);

/// Set just before the first device's pool opens.
static POOLS_OPENED: AtomicBool = AtomicBool::new(false);

/// Threads holding or waiting for the process-wide lock. A child forked while one held it (in the
/// very first call, opening the first pool, say) would wait for it forever: the thread that holds
/// it was not copied. Such a child is refused instead.
static IN_GLOBAL: AtomicUsize = AtomicUsize::new(0);

extern "C" fn mark_forked() {
    if POOLS_OPENED.load(Ordering::SeqCst) || IN_GLOBAL.load(Ordering::SeqCst) > 0 {
        FORKED.store(true, Ordering::SeqCst);
    }
}

/// Arms [`FORKED`] for children forked from now on.
extern "C" fn watch_forks() {
    // SAFETY: the handler runs in the child right after the fork, where only async-signal-safe
    // code may run: atomic loads and a store are.
    unsafe { libc::pthread_atfork(None, None, Some(mark_forked as unsafe extern "C" fn())) };
}

/// [`watch_forks`] runs as the library loads, before any thread can call it. Registered by the
/// first call instead, a second thread could pass it before the registration was made and take
/// the process-wide lock, and a fork then would copy that lock into a child nothing marks.
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".init_array"]
static WATCH_FORKS_ON_LOAD: extern "C" fn() = watch_forks;

/// Elsewhere, on the first call that reaches [`global`] (no `Once`: a child forked while
/// another thread ran one would wait for it forever).
fn watch_forks_once() {
    #[cfg(not(target_os = "linux"))]
    {
        static WATCHING: AtomicBool = AtomicBool::new(false);
        if !WATCHING.load(Ordering::Relaxed) && !WATCHING.swap(true, Ordering::SeqCst) {
            watch_forks();
        }
    }
}

/// The process-wide lock, counted in [`IN_GLOBAL`] from before it is taken until after it is let
/// go, so that a fork at any point in between marks the child.
struct GlobalGuard(Option<MutexGuard<'static, Option<Global>>>);

impl std::ops::Deref for GlobalGuard {
    type Target = Option<Global>;
    fn deref(&self) -> &Self::Target {
        self.0.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for GlobalGuard {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.0.as_mut().expect("held until dropped")
    }
}

impl Drop for GlobalGuard {
    fn drop(&mut self) {
        // Unlocked first: a fork between the two still finds the count up.
        drop(self.0.take());
        IN_GLOBAL.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The process-wide lock; every way to a pool starts here, so a forked child is refused here,
/// before any lock or driver call.
fn global() -> Result<GlobalGuard, String> {
    watch_forks_once();
    IN_GLOBAL.fetch_add(1, Ordering::SeqCst);
    let mut guard = GlobalGuard(None);
    if FORKED.load(Ordering::SeqCst) {
        return Err("the C ABI's pools were made before this process forked and are the parent's (a CUDA context \
                    does not survive a fork), or another thread was inside the C ABI at the fork: a forked child \
                    cannot use them"
            .to_string());
    }
    let held = GLOBAL.lock().map_err(|_| "the global pool was left inconsistent by an earlier panic".to_string())?;
    guard.0 = Some(held);
    Ok(guard)
}

fn lock(state: &SharedState) -> Result<MutexGuard<'_, DeviceState>, String> {
    state.lock().map_err(|_| "a device's pool was left inconsistent by an earlier panic".to_string())
}

/// Every device's pool, in device order (the process-wide lock is released on return).
fn all_devices() -> Result<Vec<SharedState>, String> {
    let mut devices: Vec<(c_int, SharedState)> =
        global()?.iter().flat_map(|g| &g.devices).map(|(&device, state)| (device, state.clone())).collect();
    devices.sort_by_key(|(device, _)| *device);
    Ok(devices.into_iter().map(|(_, state)| state).collect())
}

/// Chooses the backend and configuration of the process-wide pools. Pools already opened are
/// closed (their cached memory returned, after their device finished its work) unless they still
/// serve allocations.
pub fn configure(backend: Backend, config: Config) -> Result<(), String> {
    let mut global = global()?;
    // Every device's lock at once, in device order (no one holding a device's lock waits for
    // another's or for the process-wide one): none can gain an allocation between the check
    // and the replacement.
    let mut devices: Vec<(&c_int, &SharedState)> = global.iter().flat_map(|g| &g.devices).collect();
    devices.sort_by_key(|(device, _)| **device);
    let mut states = Vec::with_capacity(devices.len());
    for (device, state) in devices {
        let state = lock(state)?;
        let live = state.live.len();
        if live > 0 {
            return Err(format!(
                "the global pool of device {device} still serves {live} allocation(s); configure it before the first \
                 allocation"
            ));
        }
        states.push(state);
    }
    for mut state in states {
        state.closed = true;
    }
    let replaced = global.replace(Global { backend, config, devices: HashMap::new() });
    drop(global);
    // The pools replaced wait for their devices as they close: not under the process-wide lock.
    drop(replaced);
    Ok(())
}

/// Runs `f` on device `device`'s pool, opened on first use. The process-wide lock is let go
/// before the device's is taken, so a device busy in a long call (a synchronizing
/// `empty_cache`) stalls no other device's callers; a pool [`configure`] replaced meanwhile is
/// closed, and the lookup starts again (an allocation made there would dangle once it is
/// dropped).
fn with_device<R, E: From<String>>(device: c_int, f: impl FnOnce(&mut DeviceState) -> Result<R, E>) -> Result<R, E> {
    loop {
        let state = device_state(&mut *global()?, device)?;
        let mut state = lock(&state)?;
        if !state.closed {
            return f(&mut state);
        }
    }
}

/// Device `device`'s pool, opened on first use; the caller holds the process-wide lock.
fn device_state(global: &mut Option<Global>, device: c_int) -> Result<SharedState, String> {
    let g = global.get_or_insert_with(|| Global {
        backend: Backend::default(),
        config: Config::default(),
        devices: HashMap::new(),
    });
    if let Some(state) = g.devices.get(&device) {
        return Ok(state.clone());
    }
    POOLS_OPENED.store(true, Ordering::SeqCst);
    let pool = Pool::new(g.backend.open(device, &g.config).map_err(|e| e.to_string())?, g.config.clone());
    let state = Arc::new(Mutex::new(DeviceState {
        pool,
        live: HashMap::new(),
        streams: HashMap::new(),
        refused: Vec::new(),
        closed: false,
    }));
    g.devices.insert(device, state.clone());
    Ok(state)
}

/// Why an allocation failed, and whether for want of memory.
struct AllocError {
    out_of_memory: bool,
    text: String,
}

impl From<String> for AllocError {
    fn from(text: String) -> Self {
        AllocError { out_of_memory: false, text }
    }
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

fn allocate(size: isize, device: c_int, stream: u64) -> Result<u64, AllocError> {
    let size = u64::try_from(size).map_err(|_| format!("negative size {size}"))?;
    // PyTorch asks for 0 bytes for empty tensors. Its own allocator gives them null and counts
    // nothing (and its free and recordStream ignore null): users compare the statistics.
    if size == 0 {
        return Ok(0);
    }
    with_device(device, |state| {
        state.retry_refused();
        let stream = state.stream(stream)?;
        match state.pool.alloc_on(size, stream) {
            Ok(allocation) => {
                state.live.insert(allocation.address, allocation.handle);
                Ok(allocation.address)
            }
            Err(e) => Err(AllocError { out_of_memory: matches!(e, PoolError::OutOfMemory(_)), text: e.to_string() }),
        }
    })
}

fn free(address: u64, device: c_int) -> Result<(), String> {
    // An empty tensor's null, from `allocate`.
    if address == 0 {
        return Ok(());
    }
    let state = global()?
        .as_ref()
        .and_then(|g| g.devices.get(&device).cloned())
        .ok_or_else(|| format!("no pool for device {device}"))?;
    let mut state = lock(&state)?;
    state.retry_refused();
    let handle = state.live.remove(&address).ok_or_else(|| format!("{address:#x} is not a live allocation"))?;
    state.free(handle).map_err(|e| e.to_string())
}

/// The call names no device: each pool is searched for the address, the idle ones first, so a
/// device busy in a long call stalls only the blocks it holds.
fn record_stream(address: u64, stream: u64) -> Result<(), String> {
    // An empty tensor's null holds no memory to wait for.
    if address == 0 {
        return Ok(());
    }
    let mut busy = Vec::new();
    for state in all_devices()? {
        let found = match state.try_lock() {
            Ok(mut guard) => Some(record_in(&mut guard, address, stream)),
            Err(std::sync::TryLockError::WouldBlock) => None,
            Err(std::sync::TryLockError::Poisoned(_)) => Some(Some(lock(&state).map(drop))),
        };
        match found {
            None => busy.push(state),
            Some(Some(recorded)) => return recorded,
            Some(None) => {}
        }
    }
    for state in busy {
        if let Some(recorded) = record_in(&mut *lock(&state)?, address, stream) {
            return recorded;
        }
    }
    Err(format!("record_stream: {address:#x} is not a live allocation"))
}

/// [`record_stream`] in one device's pool; `None` if the address is not one of its blocks.
fn record_in(state: &mut DeviceState, address: u64, stream: u64) -> Option<Result<(), String>> {
    let &handle = state.live.get(&address)?;
    Some(state.stream(stream).and_then(|stream| state.pool.record_stream(handle, stream).map_err(|e| e.to_string())))
}

/// `void* gpupool_alloc(ssize_t size, int device, cudaStream_t stream)`: null when the pool
/// cannot serve the request (the reason is kept for [`take_last_error`]), and for 0 bytes (no
/// error kept), which freeing ignores. For C callers, who check for null; PyTorch does not, and
/// gets [`gpupool_torch_alloc`].
#[no_mangle]
pub extern "C" fn gpupool_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    entry_point("gpupool_alloc", || allocate(size, device, stream as u64))
        .map_or(std::ptr::null_mut(), |address| address as *mut c_void)
}

extern "C-unwind" {
    /// Throws the C++ exception for a failed allocation (rust/capi_torch.cpp): a `std::bad_alloc`
    /// whose `what()` is `message` when memory ran out, else a `std::runtime_error`.
    fn gpupool_throw_alloc_error(out_of_memory: c_int, message: *const c_char) -> !;
}

/// `void* gpupool_torch_alloc(ssize_t size, int device, cudaStream_t stream)`: the allocation
/// function for PyTorch's `CUDAPluggableAllocator`, which uses whatever pointer it gets back
/// (a null becomes a tensor at address 0, which is right only for 0 bytes, an empty tensor). A failure is therefore thrown as a C++ exception
/// carrying gpupool's report, which unwinds through PyTorch's frames exactly like its own
/// allocator's out-of-memory error and reaches Python as a `RuntimeError` with that text. The
/// exception starts in C++ and crosses only this frame, which the `C-unwind` ABI allows.
#[no_mangle]
pub extern "C-unwind" fn gpupool_torch_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    let error = match entry_point("gpupool_torch_alloc", || allocate(size, device, stream as u64)) {
        Ok(address) => return address as *mut c_void,
        Err(e) => e,
    };
    // PyTorch's own message starts "CUDA out of memory.", and tools that retry with a smaller
    // batch (accelerate's find_executable_batch_size) look for exactly that.
    let prefix = if error.out_of_memory { "CUDA out of memory. gpupool: " } else { "gpupool: " };
    let message = CString::new(format!("{prefix}{}", error.text).replace('\0', " ")).unwrap_or_default();
    // SAFETY: the thrower copies the message before throwing; `message` is dropped while the
    // exception unwinds through this frame, after that copy.
    unsafe { gpupool_throw_alloc_error(c_int::from(error.out_of_memory), message.as_ptr()) }
}

/// `void gpupool_free(void* ptr, ssize_t size, int device, cudaStream_t stream)`. The block goes
/// back to the pool on the stream it was allocated on; null is ignored, and so is an unknown
/// pointer (kept as the last error), since C has no way to be told.
#[no_mangle]
pub extern "C" fn gpupool_free(ptr: *mut c_void, _size: isize, device: c_int, _stream: *mut c_void) {
    let _ = entry_point("gpupool_free", || free(ptr as u64, device));
}

/// `void gpupool_record_stream(void* ptr, cudaStream_t stream)`: PyTorch's pluggable-allocator
/// record-stream hook (`tensor.record_stream(s)`): the block's free waits for the work queued on
/// `stream` until then, as with PyTorch's own allocator.
#[no_mangle]
pub extern "C" fn gpupool_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    let _ = entry_point("gpupool_record_stream", || record_stream(ptr as u64, stream as u64));
}

/// `void gpupool_set_memory_fraction(double fraction, int device)`: PyTorch's pluggable-allocator
/// memory-fraction hook (`torch.cuda.set_per_process_memory_fraction`): device `device`'s pool
/// reserves at most that share of the device from now on, as `per_process_memory_fraction`.
#[no_mangle]
pub extern "C" fn gpupool_set_memory_fraction(fraction: f64, device: c_int) {
    let _ = entry_point("gpupool_set_memory_fraction", || {
        with_device(device, |state| state.pool.set_memory_fraction(fraction))
    });
}

/// `void gpupool_empty_cache(void)`: PyTorch's pluggable-allocator reset hook
/// (`torch.cuda.empty_cache()`): every device's fully free cached memory goes back.
#[no_mangle]
pub extern "C" fn gpupool_empty_cache() {
    let _ = entry_point("gpupool_empty_cache", empty_cache);
}

/// Runs the body of C entry point `name`. A panic must not unwind into C, so it is caught and
/// becomes an error naming the entry point; any error is kept as the thread's last error (C
/// callers get a null or nothing back) and returned.
fn entry_point<T, E: From<String> + fmt::Display>(name: &str, body: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let result = catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| Err(E::from(format!("{name} panicked"))));
    if let Err(e) = &result {
        remember_error(e.to_string());
    }
    result
}

thread_local! {
    /// Per thread, as `errno` and `cudaGetLastError`: with one slot for the process, a thread's
    /// failure was read (and cleared) by another thread, or replaced by its failure.
    static LAST_ERROR: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

fn remember_error(e: String) {
    // `try_with`: a C call made while this thread's locals are being destroyed has nowhere to
    // keep its reason.
    let _ = LAST_ERROR.try_with(|last| *last.borrow_mut() = Some(e));
}

/// The most recent failure of a C entry point on this thread, cleared by reading it.
pub fn take_last_error() -> Option<String> {
    LAST_ERROR.try_with(|last| last.borrow_mut().take()).ok().flatten()
}

/// The statistics of device `device`'s global pool, if it was opened; an error if the pools
/// cannot be reached (a forked child, a poisoned lock) rather than statistics that look empty.
pub fn memory_stats(device: c_int) -> Result<Option<Vec<(String, i64)>>, String> {
    let Some(state) = global()?.as_ref().and_then(|g| g.devices.get(&device).cloned()) else { return Ok(None) };
    let entries = lock(&state)?.pool.memory_stats();
    Ok(Some(entries))
}

/// Returns the cached, fully free segments of every global pool; returns the bytes released,
/// or the first failure once every device was tried (one device's failure keeps no other's
/// cache).
pub fn empty_cache() -> Result<u64, String> {
    let (mut released, mut failed) = (0, None);
    for state in all_devices()? {
        let emptied = lock(&state).and_then(|mut state| {
            state.retry_refused();
            state.pool.empty_cache().map_err(|e| e.to_string())
        });
        match emptied {
            Ok(bytes) => released += bytes,
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    failed.map_or(Ok(released), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child forked while another thread holds the process-wide lock, before any pool opened
    /// (in the very first call, opening the first pool, say): refused, where it used to wait
    /// forever for a lock whose holder was not copied into it.
    fn fork_while_another_thread_holds_the_global_lock() {
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _guard = global().unwrap();
            held_tx.send(()).unwrap();
            done_rx.recv().unwrap();
        });
        held_rx.recv().unwrap();
        // SAFETY: the child only calls the C ABI (which allocates with glibc's fork-safe malloc)
        // and exits without unwinding.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let refused = gpupool_alloc(64, 0, std::ptr::null_mut()).is_null()
                && take_last_error().is_some_and(|e| e.contains("forked"));
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(if refused { 0 } else { 1 }) };
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        // SAFETY: our child, reaped once.
        while unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == 0 {
            if std::time::Instant::now() > deadline {
                // SAFETY: our child, killed and reaped.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                panic!("the child waited for a lock held by a thread that the fork did not copy");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child was not refused: {status}");
        done_tx.send(()).unwrap();
        holder.join().unwrap();
    }

    /// A panic must not unwind into C: each entry point's body runs in [`entry_point`], which
    /// keeps the panic as the thread's last error, named, as it keeps a failure.
    #[test]
    fn a_panic_in_an_entry_point_is_its_last_error() {
        let panicked = entry_point("gpupool_free", || -> Result<(), String> { panic!("a bug in the pool") });
        assert_eq!(panicked, Err("gpupool_free panicked".to_string()));
        assert_eq!(take_last_error().as_deref(), Some("gpupool_free panicked"));
        let failed = entry_point("gpupool_empty_cache", || Err::<u64, _>("no pool".to_string()));
        assert_eq!(failed, Err("no pool".to_string()));
        assert_eq!(take_last_error().as_deref(), Some("no pool"));
        assert_eq!(entry_point("gpupool_empty_cache", || Ok::<_, String>(7)), Ok(7));
        assert_eq!(take_last_error(), None, "a success leaves no error");
    }

    /// An empty tensor's request on device 0 (whose pool is open): null, and no statistic
    /// changes, as with PyTorch's own allocator; freeing that null (once per empty tensor) or
    /// recording a stream on it is harmless: no error, no statistic.
    fn zero_byte_requests_are_null_and_count_nothing() {
        let stream = std::ptr::null_mut();
        let before = memory_stats(0).unwrap().unwrap();
        let empty = gpupool_alloc(0, 0, stream);
        assert!(empty.is_null());
        assert!(gpupool_torch_alloc(0, 0, stream).is_null());
        assert_eq!(take_last_error(), None);
        assert_eq!(memory_stats(0).unwrap().unwrap(), before, "a zero-byte request was counted");
        gpupool_record_stream(empty, stream);
        gpupool_free(empty, 0, 0, stream);
        gpupool_free(empty, 0, 0, stream);
        assert_eq!(take_last_error(), None, "freeing null reported an error");
        assert_eq!(memory_stats(0).unwrap().unwrap(), before, "freeing null changed the statistics");
    }

    /// One test, because the global pool is process-wide state.
    #[test]
    fn host_backend_round_trip() {
        // Before any pool opens: the fork check depends on it.
        fork_while_another_thread_holds_the_global_lock();
        configure(Backend::Host, Config::default()).unwrap();
        let stream = std::ptr::null_mut();
        let a = gpupool_alloc(1000, 0, stream);
        assert!(!a.is_null());
        // SAFETY: host-backend addresses are host memory of at least the requested size.
        unsafe { std::ptr::write_bytes(a.cast::<u8>(), 7, 1000) };
        assert_eq!(memory_stats(0).unwrap().unwrap().iter().find(|(k, _)| k == "allocation.all.current").unwrap().1, 1);
        zero_byte_requests_are_null_and_count_nothing();
        assert!(configure(Backend::Host, Config::default()).is_err(), "live allocations pin the configuration");
        gpupool_record_stream(a, stream);
        assert_eq!(take_last_error(), None, "recording the default stream on a live block");
        gpupool_free(a, 1000, 0, stream);
        gpupool_free(a, 1000, 0, stream);
        assert!(take_last_error().unwrap().contains("not a live allocation"));
        gpupool_record_stream(a, stream);
        assert!(take_last_error().unwrap().contains("record_stream"));
        // One handle for a different stream on each thread: refused, as a stream no pool can order.
        assert!(gpupool_alloc(64, 0, 2 as *mut c_void).is_null());
        assert!(take_last_error().unwrap().contains("per-thread default stream"));
        assert!(gpupool_alloc(64, -1, stream).is_null());
        assert!(take_last_error().unwrap().contains("host device -1 does not exist"));
        assert!(gpupool_alloc(-1, 0, stream).is_null());
        assert!(take_last_error().unwrap().contains("negative"));
        // A thread's failure is its own to read.
        let bad_free = || gpupool_free(8 as *mut c_void, 8, 0, std::ptr::null_mut());
        std::thread::spawn(bad_free).join().unwrap();
        assert_eq!(take_last_error(), None, "another thread's failure read here");
        let own = std::thread::spawn(move || {
            bad_free();
            take_last_error()
        });
        assert!(own.join().unwrap().unwrap().contains("not a live allocation"));
        assert!(memory_stats(0).unwrap().unwrap().iter().any(|(k, v)| k == "reserved_bytes.all.current" && *v > 0));
        gpupool_empty_cache();
        assert!(memory_stats(0).unwrap().unwrap().iter().any(|(k, v)| k == "reserved_bytes.all.current" && *v == 0));

        // A device busy in a long call (its lock held, as through a synchronizing empty_cache)
        // stalls its own callers only.
        let alloc_on = |device| move || gpupool_alloc(64, device, std::ptr::null_mut()) as usize;
        let busy = global().unwrap().as_ref().unwrap().devices[&0].clone();
        let held = lock(&busy).unwrap();
        let waiting = std::thread::spawn(alloc_on(0));
        std::thread::sleep(std::time::Duration::from_millis(100));
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let other = alloc_on(1)();
            // record_stream names no device: device 1's block is found without waiting for 0.
            gpupool_record_stream(other as *mut c_void, std::ptr::null_mut());
            sender.send((other, take_last_error()))
        });
        let other = receiver.recv_timeout(std::time::Duration::from_secs(20));
        drop(held);
        let waited = waiting.join().unwrap();
        let (other, recorded) = other.expect("a call on device 1 waited for device 0's lock");
        assert_eq!(recorded, None);
        gpupool_free(other as *mut c_void, 64, 1, stream);
        gpupool_free(waited as *mut c_void, 64, 0, stream);
        assert_eq!(take_last_error(), None);
        configure(Backend::Host, Config::default()).unwrap();
        // The pools it replaced are closed: a new one serves the next call.
        assert!(busy.lock().unwrap().closed);
        let fresh = gpupool_alloc(64, 0, stream);
        assert!(!fresh.is_null());
        assert!(!Arc::ptr_eq(&busy, &global().unwrap().as_ref().unwrap().devices[&0]));
        gpupool_free(fresh, 64, 0, stream);
        configure(Backend::Host, Config::default()).unwrap();

        // A device that cannot be emptied (here its lock poisoned) keeps no other's cache.
        for device in [0, 1] {
            gpupool_free(gpupool_alloc(64, device, stream), 64, device, stream);
        }
        let broken = global().unwrap().as_ref().unwrap().devices[&0].clone();
        std::thread::spawn(move || {
            let _held = broken.lock();
            panic!("poisons device 0's lock");
        })
        .join()
        .unwrap_err();
        let reserved = |device| {
            memory_stats(device).unwrap().and_then(|s| s.into_iter().find(|(k, _)| k == "reserved_bytes.all.current"))
        };
        assert!(reserved(1).unwrap().1 > 0);
        assert!(empty_cache().unwrap_err().contains("inconsistent"));
        assert_eq!(reserved(1).unwrap().1, 0);
    }
}
