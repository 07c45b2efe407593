//! The cuda backend against the strict fake driver of tests/fake_cuda (feature `cuda`): mapped
//! runs and their driver calls, streams and events, copies ordered on their stream, the caller's
//! context kept, teardown after the device's work, graph capture, and a pool on top.
//!
//! The fake is compiled with the machine's C compiler and loaded by absolute path before cudarc
//! looks for a driver; its soname is `libcuda.so`, the first name cudarc asks the loader for, so
//! the loader hands cudarc the library already in the process. One fake serves the whole test
//! binary, so these tests use no failure switches (tests/test_cuda_fake.py covers those, one
//! process each). Without a C compiler to build the fake, the tests fail and say so. Nothing
//! here measures a GPU.
#![cfg(feature = "cuda")]

use gpupool::core::{Metric, StatType};
use gpupool::device::{Cuda, CudaMode, Device, DeviceError, DEFAULT_STREAM};
use gpupool::pool::{Config, Pool, PoolError, Refused};
use std::ffi::{c_char, CString};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

const MIB: u64 = 1 << 20;

/// The fake driver, built once per test binary and loaded before cudarc looks for a driver.
struct Fake {
    handle: usize,
}

/// Builds and loads the fake. Without a C compiler the tests fail, saying why: a test that
/// passes without running would hide a broken backend.
fn fake() -> &'static Fake {
    static FAKE: OnceLock<Fake> = OnceLock::new();
    FAKE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("gpupool-fake-cuda-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory for the fake driver");
        let library = dir.join("libcuda.so");
        let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cuda/fake_cuda.c");
        let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let built = Command::new(&compiler)
            .args(["-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so", "-o"])
            .arg(&library)
            .arg(&source)
            .arg("-lpthread")
            .status();
        assert!(
            built.is_ok_and(|s| s.success()),
            "the fake CUDA driver could not be built with '{compiler}' (install a C compiler or set CC)"
        );
        let path = CString::new(library.to_str().unwrap()).unwrap();
        // SAFETY: loads a library we just built; RTLD_GLOBAL keeps it for the process.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        assert!(!handle.is_null(), "the fake driver failed to load");
        Fake { handle: handle as usize }
    })
}

impl Fake {
    /// The address of an exported function (a driver call or a test control).
    fn symbol(&self, name: &str) -> usize {
        let name = CString::new(name).unwrap();
        // SAFETY: looks a symbol up in a live handle.
        let address = unsafe { libc::dlsym(self.handle as *mut libc::c_void, name.as_ptr()) };
        assert!(!address.is_null(), "the fake lacks {name:?}");
        address as usize
    }

    fn calls(&self, name: &str) -> u64 {
        let name = CString::new(name).unwrap();
        // SAFETY: `fake_cuda_calls` has exactly this signature in fake_cuda.c.
        let f: extern "C" fn(*const c_char) -> u64 = unsafe { std::mem::transmute(self.symbol("fake_cuda_calls")) };
        f(name.as_ptr())
    }

    fn violations(&self) -> u64 {
        // SAFETY: `fake_cuda_violations` has exactly this signature.
        let f: extern "C" fn() -> u64 = unsafe { std::mem::transmute(self.symbol("fake_cuda_violations")) };
        f()
    }

    /// Queues a kernel writing `tag` over the range on the stream with raw handle `stream`; it
    /// runs when completed or waited for.
    fn launch(&self, stream: u64, address: u64, size: u64, tag: u8) {
        // SAFETY: `fake_cuda_launch` has exactly this signature.
        let f: extern "C" fn(u64, u64, usize, u8) -> i32 =
            unsafe { std::mem::transmute(self.symbol("fake_cuda_launch")) };
        assert_eq!(f(stream, address, size as usize, tag), 0, "the kernel was launched on device memory");
    }

    fn complete(&self, stream: u64) {
        // SAFETY: `fake_cuda_complete` has exactly this signature.
        let f: extern "C" fn(u64) -> i32 = unsafe { std::mem::transmute(self.symbol("fake_cuda_complete")) };
        assert_eq!(f(stream), 0);
    }

    /// The calling thread's current context (0 for none).
    fn current_context(&self) -> u64 {
        let mut current = 0u64;
        // SAFETY: `cuCtxGetCurrent` writes one handle.
        let f: extern "C" fn(*mut u64) -> i32 = unsafe { std::mem::transmute(self.symbol("cuCtxGetCurrent")) };
        assert_eq!(f(&mut current), 0);
        current
    }

    /// The driver's handle for device `ordinal` (not necessarily the ordinal itself).
    fn device(&self, ordinal: i32) -> i32 {
        let mut device = 0i32;
        // SAFETY: `cuDeviceGet` writes one device handle.
        let get: extern "C" fn(*mut i32, i32) -> i32 = unsafe { std::mem::transmute(self.symbol("cuDeviceGet")) };
        assert_eq!(get(&mut device, ordinal), 0);
        device
    }

    /// Makes device `ordinal`'s primary context current on this thread, as a framework using the
    /// device would (kernels are launched and captures begun in a context).
    fn use_primary_context(&self, ordinal: i32) {
        let (device, mut context) = (self.device(ordinal), 0u64);
        // SAFETY: `cuDevicePrimaryCtxRetain` writes one handle; the retain is never released,
        // like a framework's.
        let retain: extern "C" fn(*mut u64, i32) -> i32 =
            unsafe { std::mem::transmute(self.symbol("cuDevicePrimaryCtxRetain")) };
        assert_eq!(retain(&mut context, device), 0);
        self.set_current_context(context);
    }

    fn set_current_context(&self, context: u64) {
        // SAFETY: `cuCtxSetCurrent` takes one handle.
        let f: extern "C" fn(u64) -> i32 = unsafe { std::mem::transmute(self.symbol("cuCtxSetCurrent")) };
        assert_eq!(f(context), 0);
    }

    /// A blocking stream (flags 0) of the current context, as a framework may make one: the
    /// legacy stream is ordered with it.
    fn blocking_stream(&self) -> u64 {
        let mut stream = 0u64;
        // SAFETY: `cuStreamCreate` writes one stream handle; flags 0 is a blocking stream.
        let f: extern "C" fn(*mut u64, u32) -> i32 = unsafe { std::mem::transmute(self.symbol("cuStreamCreate")) };
        assert_eq!(f(&mut stream, 0), 0);
        stream
    }

    /// Destroys a stream made with [`Fake::blocking_stream`], as its owner would.
    fn destroy_stream(&self, stream: u64) {
        // SAFETY: `cuStreamDestroy_v2` takes one stream handle.
        let f: extern "C" fn(u64) -> i32 = unsafe { std::mem::transmute(self.symbol("cuStreamDestroy_v2")) };
        assert_eq!(f(stream), 0);
    }

    /// Device memory in use on the current context's device, as the driver counts it.
    fn used(&self) -> usize {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: `cuMemGetInfo_v2` writes two sizes.
        let f: extern "C" fn(*mut usize, *mut usize) -> i32 =
            unsafe { std::mem::transmute(self.symbol("cuMemGetInfo_v2")) };
        assert_eq!(f(&mut free, &mut total), 0);
        total - free
    }

    /// Starts (`true`) a relaxed-mode capture on a stream (other streams may still allocate
    /// from the driver), or ends one, saying whether the capture stayed valid.
    fn capture(&self, stream: u64, begin: bool) -> bool {
        self.capture_in_mode(stream, begin, 2)
    }

    /// As [`Fake::capture`], in capture mode `mode` (0: global, where "potentially unsafe"
    /// calls such as freeing memory, from any thread, invalidate the capture).
    fn capture_in_mode(&self, stream: u64, begin: bool, mode: i32) -> bool {
        if begin {
            // SAFETY: `cuStreamBeginCapture_v2` takes a stream and a mode.
            let f: extern "C" fn(u64, i32) -> i32 =
                unsafe { std::mem::transmute(self.symbol("cuStreamBeginCapture_v2")) };
            assert_eq!(f(stream, mode), 0);
            true
        } else {
            let mut graph = 0u64;
            // SAFETY: `cuStreamEndCapture` takes a stream and writes one graph handle.
            let f: extern "C" fn(u64, *mut u64) -> i32 =
                unsafe { std::mem::transmute(self.symbol("cuStreamEndCapture")) };
            f(stream, &mut graph) == 0
        }
    }
}

fn reserved(pool: &Pool<Cuda>) -> u64 {
    pool.stats().get(Metric::ReservedBytes, StatType::All).current
}

fn calls(name: &str) -> u64 {
    fake().calls(name)
}

/// The driver's call counters are process-wide, so the tests take turns.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn open() -> (Cuda, MutexGuard<'static, ()>) {
    fake();
    let turn = serial();
    let cuda = Cuda::open(0, CudaMode::Direct, None).expect("the fake driver opens");
    fake().use_primary_context(0);
    (cuda, turn)
}

#[test]
fn segments_copy_and_release() {
    let (mut cuda, _turn) = open();
    assert_eq!(cuda.name(), "cuda:0");
    assert_eq!(cuda.memory_info().total, Some(1 << 30));
    let a = cuda.allocate(4096).unwrap();
    cuda.write(DEFAULT_STREAM, a + 10, b"device bytes").unwrap();
    let mut out = [0u8; 12];
    cuda.read(DEFAULT_STREAM, a + 10, &mut out).unwrap();
    assert_eq!(&out, b"device bytes");
    assert_eq!(cuda.write(DEFAULT_STREAM, a + 4090, b"too long"), Err(DeviceError::InvalidAddress(a + 4090)));
    assert_eq!(cuda.memory_info().held, 4096);
    assert!(matches!(cuda.allocate(2 << 30), Err(DeviceError::OutOfMemory { .. })));
    cuda.release(a).unwrap();
    assert_eq!(cuda.release(a), Err(DeviceError::InvalidAddress(a)));
    assert_eq!(cuda.memory_info().held, 0);
}

/// Driver calls per kind since `before` (create, map, set-access, unmap, release).
fn vmm_calls() -> [u64; 5] {
    ["cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"].map(calls)
}

fn since(before: [u64; 5]) -> [u64; 5] {
    let now = vmm_calls();
    std::array::from_fn(|i| now[i] - before[i])
}

#[test]
fn runs_are_mapped_one_handle_per_page_with_access_set_once() {
    let (mut cuda, _turn) = open();
    let page = cuda.page_size().unwrap();
    assert_eq!(page, 2 * MIB, "the fake's granularity");
    let base = cuda.reserve(13 * MIB).unwrap();
    assert_eq!(cuda.reserved_and_mapped(), (14 * MIB, 0), "rounded up to the granularity");
    assert_eq!(cuda.write(DEFAULT_STREAM, base, b"x"), Err(DeviceError::InvalidAddress(base)), "nothing mapped yet");

    let before = vmm_calls();
    cuda.map(base, 4 * MIB, 2 * MIB).unwrap();
    assert_eq!(since(before), [2, 2, 1, 0, 2], "two handles, mapped, access set once, released at once");
    assert_eq!(cuda.memory_info().held, 4 * MIB);
    let straddling = base + 2 * MIB - 3;
    cuda.write(DEFAULT_STREAM, straddling, b"across pages").unwrap();
    let mut out = [0u8; 12];
    cuda.read(DEFAULT_STREAM, straddling, &mut out).unwrap();
    assert_eq!(&out, b"across pages");

    let before = vmm_calls();
    cuda.map(base + 4 * MIB, 8 * MIB, 4 * MIB).unwrap();
    assert_eq!(since(before), [2, 2, 1, 0, 2], "4 MiB pages: two handles for 8 MiB");
    assert!(cuda.map(base + 2 * MIB, 4 * MIB, 2 * MIB).is_err(), "overlaps a mapped page");
    assert!(cuda.map(base + MIB, 2 * MIB, 2 * MIB).is_err(), "not aligned to the granularity");
    assert!(cuda.map(base + 12 * MIB, 2 * MIB, MIB).is_err(), "pages below the granularity");
    assert!(cuda.map(base + 12 * MIB, 4 * MIB, 2 * MIB).is_err(), "past the reservation");
    assert_eq!(cuda.reserved_and_mapped(), (14 * MIB, 12 * MIB));

    let before = vmm_calls();
    assert!(cuda.unmap(base + 4 * MIB, 2 * MIB).is_err(), "half of one mapping");
    cuda.unmap(base + 2 * MIB, 2 * MIB).unwrap();
    assert_eq!(since(before), [0, 0, 0, 1, 0], "one call unmaps a page (its memory goes with it)");
    assert!(cuda.read(DEFAULT_STREAM, base + 2 * MIB, &mut out).is_err(), "unmapped pages cannot be copied");
    assert!(cuda.unmap(base + 2 * MIB, 2 * MIB).is_err(), "already unmapped");
    assert!(cuda.unmap(base, 4 * MIB).is_err(), "half of it is unmapped");
    assert_eq!(cuda.memory_info().held, 10 * MIB);
    assert_eq!(cuda.unreserve(base), Err(DeviceError::InvalidAddress(base)), "pages are still mapped");
    cuda.unmap(base, 2 * MIB).unwrap();
    cuda.unmap(base + 4 * MIB, 8 * MIB).unwrap();
    cuda.unreserve(base).unwrap();
    assert_eq!(cuda.reserved_and_mapped(), (0, 0));
    assert_eq!(cuda.memory_info().held, 0);
    assert_eq!(cuda.unreserve(base), Err(DeviceError::InvalidAddress(base)));
    assert_eq!(calls("cuMemCreate"), calls("cuMemRelease"), "every physical allocation was released");
}

#[test]
fn streams_events_and_imports() {
    let (mut cuda, _turn) = open();
    let side = cuda.create_stream().unwrap();
    let handle = cuda.stream_handle(side).unwrap();
    assert_ne!(handle, 0);
    assert_eq!(cuda.stream_handle(DEFAULT_STREAM), Some(0));
    let event = cuda.record_event(side).unwrap();
    assert!(cuda.query_event(event).unwrap());
    cuda.stream_wait_event(DEFAULT_STREAM, event).unwrap();
    cuda.synchronize_event(event).unwrap();
    cuda.destroy_event(event).unwrap();
    assert_eq!(cuda.query_event(event), Err(DeviceError::InvalidEvent(event)));
    let reused = cuda.record_event(DEFAULT_STREAM).unwrap();
    assert_ne!(reused, event, "event ids are never reused, driver events are");

    assert_eq!(cuda.import_stream(0).unwrap(), DEFAULT_STREAM);
    let imported = cuda.import_stream(handle).unwrap();
    assert_ne!(imported, side);
    assert!(cuda.query_stream(imported).unwrap());
    let destroyed_before = calls("cuStreamDestroy_v2");
    cuda.destroy_stream(imported).unwrap();
    assert_eq!(calls("cuStreamDestroy_v2"), destroyed_before, "imported streams are only forgotten");
    assert!(cuda.query_stream(side).unwrap(), "the original stream lives on");
    cuda.destroy_stream(side).unwrap();
    assert_eq!(cuda.query_stream(side), Err(DeviceError::InvalidStream(side)));
    assert_eq!(cuda.destroy_stream(DEFAULT_STREAM), Err(DeviceError::InvalidStream(DEFAULT_STREAM)));
}

#[test]
fn async_mode_uses_the_stream_ordered_calls() {
    let (_, _turn) = open();
    let mut cuda = Cuda::open(0, CudaMode::Async, None).unwrap();
    let before = (calls("cuMemAllocAsync"), calls("cuMemFreeAsync"));
    let a = cuda.allocate(MIB).unwrap();
    cuda.release(a).unwrap();
    assert_eq!((calls("cuMemAllocAsync"), calls("cuMemFreeAsync")), (before.0 + 1, before.1 + 1));
}

#[test]
fn a_pool_over_the_fake_device() {
    let (cuda, _turn) = open();
    let mut pool = Pool::new(cuda, Config::default());
    let allocations: Vec<_> = (0..100).map(|i| pool.alloc(1000 + i).unwrap()).collect();
    pool.check_invariants().unwrap();
    for a in allocations {
        pool.free(a.handle).unwrap();
    }
    assert!(pool.empty_cache().unwrap() > 0);
    pool.check_invariants().unwrap();
    assert_eq!(pool.device().memory_info().held, 0);
}

#[test]
fn an_expandable_pool_maps_pages_through_the_driver() {
    let (cuda, _turn) = open();
    let config = Config::parse("expandable_segments:True").unwrap();
    let mut pool = Pool::new(cuda, config);
    let created = calls("cuMemCreate");
    let allocations: Vec<_> = (0..20).map(|i| pool.alloc(300_000 * (i + 1)).unwrap()).collect();
    pool.check_invariants().unwrap();
    assert!(calls("cuMemCreate") > created, "pages were mapped");
    for a in allocations {
        pool.free(a.handle).unwrap();
    }
    pool.empty_cache().unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(calls("cuMemCreate"), calls("cuMemRelease"), "empty_cache unmapped every page");
}

#[test]
fn a_closed_device_returns_everything() {
    let (mut cuda, _turn) = open();
    let before = calls("cuMemUnmap");
    cuda.allocate(MIB).unwrap();
    let base = cuda.reserve(4 * MIB).unwrap();
    cuda.map(base, 4 * MIB, 2 * MIB).unwrap();
    cuda.create_stream().unwrap();
    cuda.record_event(DEFAULT_STREAM).unwrap();
    drop(cuda);
    assert_eq!(calls("cuMemUnmap"), before + 2, "both mapped pages unmapped on close");
}

#[test]
fn every_call_leaves_the_callers_context_current() {
    let (mut cuda, _turn) = open();
    let fake = fake();
    // The caller's thread has no context (as a fresh thread in PyTorch has until it touches CUDA).
    fake.set_current_context(0);
    let a = cuda.allocate(4096).unwrap();
    assert_eq!(fake.current_context(), 0, "allocate left gpupool's context current");
    cuda.write(DEFAULT_STREAM, a, b"bytes").unwrap();
    let side = cuda.create_stream().unwrap();
    let event = cuda.record_event(side).unwrap();
    cuda.query_event(event).unwrap();
    cuda.stream_wait_event(DEFAULT_STREAM, event).unwrap();
    assert_eq!(fake.current_context(), 0, "stream and event calls left gpupool's context current");
    assert!(matches!(cuda.allocate(4 << 30), Err(DeviceError::OutOfMemory { .. })));
    assert_eq!(fake.current_context(), 0, "a failed driver call left gpupool's context current");
    cuda.release(a).unwrap();
    drop(cuda);
    assert_eq!(fake.current_context(), 0, "closing the device left its context current");
}

#[test]
fn copies_are_ordered_after_the_streams_work() {
    let (mut cuda, _turn) = open();
    let fake = fake();
    let side = cuda.create_stream().unwrap();
    let handle = cuda.stream_handle(side).unwrap();
    let a = cuda.allocate(4096).unwrap();
    let before = fake.violations();
    fake.launch(handle, a, 4096, 0xaa);
    cuda.write(side, a, b"after the kernel").unwrap();
    let mut out = [0u8; 16];
    cuda.read(side, a, &mut out).unwrap();
    assert_eq!(&out, b"after the kernel", "the copy ran after the kernel queued before it");
    assert_eq!(fake.violations(), before);

    // The legacy default stream does not wait for a non-blocking stream: the fake sees the race.
    fake.launch(handle, a, 4096, 0xbb);
    cuda.write(DEFAULT_STREAM, a, b"races the kernel").unwrap();
    assert_eq!(fake.violations(), before + 1, "the fake catches a copy on the legacy stream");
    fake.complete(handle);
    cuda.release(a).unwrap();
}

#[test]
fn a_pool_reuses_a_block_on_another_stream_only_after_its_kernels() {
    let (cuda, _turn) = open();
    let fake = fake();
    let mut pool = Pool::new(cuda, Config::parse("strategy:pytorch").unwrap());
    let side = pool.create_stream().unwrap();
    let handle = pool.device().stream_handle(side).unwrap();
    let before = fake.violations();
    let a = pool.alloc_on(MIB, side).unwrap();
    fake.launch(handle, a.address, MIB, 0x11);
    pool.free(a.handle).unwrap();
    let b = pool.alloc_on(MIB, DEFAULT_STREAM).unwrap();
    assert_ne!(b.address, a.address, "handed out while a kernel on its stream still runs");
    pool.write(b.handle, 0, b"mine").unwrap();
    fake.complete(handle);
    pool.free(b.handle).unwrap();
    pool.synchronize().unwrap();
    let c = pool.alloc_on(MIB, DEFAULT_STREAM).unwrap();
    let mut out = [0u8; 4];
    pool.write(c.handle, 0, b"next").unwrap();
    pool.read(c.handle, 0, &mut out).unwrap();
    assert_eq!(&out, b"next");
    assert_eq!(fake.violations(), before);
    pool.free(c.handle).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn the_async_backend_orders_segments_on_their_stream() {
    let (_, _turn) = open();
    let fake = fake();
    let mut cuda = Cuda::open(0, CudaMode::Async, None).unwrap();
    let side = cuda.create_stream().unwrap();
    let handle = cuda.stream_handle(side).unwrap();
    let before = fake.violations();
    let a = cuda.allocate_on(MIB, side).unwrap();
    fake.launch(handle, a, MIB, 0x22);
    cuda.release(a).unwrap();
    assert_eq!(fake.violations(), before, "the free was queued behind the kernel on the segment's stream");
    fake.complete(handle);

    let mut threshold = 0u64;
    let mut mempool = 0u64;
    // SAFETY: the fake's calls take these pointers (a pool handle, attribute 4 = release threshold).
    let get_pool: extern "C" fn(*mut u64, i32) -> i32 =
        unsafe { std::mem::transmute(fake.symbol("cuDeviceGetDefaultMemPool")) };
    // SAFETY: as above.
    let get_attribute: extern "C" fn(u64, i32, *mut u64) -> i32 =
        unsafe { std::mem::transmute(fake.symbol("cuMemPoolGetAttribute")) };
    assert_eq!(get_pool(&mut mempool, fake.device(0)), 0);
    assert_eq!(get_attribute(mempool, 4, &mut threshold), 0);
    assert_eq!(threshold, u64::MAX, "the driver's pool keeps what it caches");
}

/// While a blocking stream captures, the driver calls the legacy stream unusable (its capture
/// query fails with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and work queued there invalidates the
/// capture). The pool counts it as capturing: it records no fence there for its frees, and
/// refuses to allocate on it with its own error.
#[test]
fn a_blocking_streams_capture_leaves_the_legacy_stream_alone() {
    let (cuda, _turn) = open();
    let fake = fake();
    let mut pool = Pool::new(cuda, Config::parse("strategy:pytorch").unwrap());
    let side = pool.create_stream().unwrap();
    let a = pool.alloc_on(MIB, DEFAULT_STREAM).unwrap();
    pool.free(a.handle).unwrap();
    let blocking = fake.blocking_stream();
    assert!(fake.capture(blocking, true));
    // Not cached for `side`: other streams' frees would get fences first.
    pool.alloc_on(4 * MIB, side).unwrap();
    let refused = pool.alloc_on(MIB, DEFAULT_STREAM).unwrap_err();
    assert!(refused.to_string().contains("captured into a CUDA graph"), "{refused}");
    assert!(fake.capture(blocking, false), "gpupool used the legacy stream during the capture");
    pool.alloc_on(MIB, DEFAULT_STREAM).unwrap();
    pool.check_invariants().unwrap();
}

/// At teardown every segment goes back, even one allocated on an imported stream that its owner
/// has destroyed since: after waiting for the context, a plain free names no stream.
#[test]
fn teardown_frees_segments_whose_stream_is_gone() {
    let (cuda, _turn) = open();
    drop(cuda);
    let fake = fake();
    let before = fake.used();
    let raw = fake.blocking_stream();
    let mut cuda = Cuda::open(0, CudaMode::Async, None).unwrap();
    let imported = cuda.import_stream(raw).unwrap();
    cuda.allocate_on(4 * MIB, imported).unwrap();
    assert_eq!(fake.used(), before + 4 * MIB as usize);
    fake.destroy_stream(raw);
    drop(cuda);
    assert_eq!(fake.used(), before, "the segment leaked");
}

#[test]
fn closing_waits_for_work_before_unmapping() {
    let (mut cuda, _turn) = open();
    let fake = fake();
    let side = cuda.create_stream().unwrap();
    let handle = cuda.stream_handle(side).unwrap();
    let base = cuda.reserve(4 * MIB).unwrap();
    cuda.map(base, 4 * MIB, 2 * MIB).unwrap();
    let before = fake.violations();
    fake.launch(handle, base, 4 * MIB, 0x33);
    drop(cuda);
    assert_eq!(fake.violations(), before, "memory went back under a running kernel");
}

#[test]
fn graph_capture_is_refused_and_frees_wait_for_its_end() {
    let (cuda, _turn) = open();
    let fake = fake();
    let mut pool = Pool::new(cuda, Config::parse("strategy:pytorch").unwrap());
    let side = pool.create_stream().unwrap();
    let handle = pool.device().stream_handle(side).unwrap();
    let a = pool.alloc_on(MIB, side).unwrap();
    assert!(fake.capture(handle, true));
    let refused = pool.alloc_on(MIB, side).unwrap_err();
    assert!(refused.to_string().contains("captured into a CUDA graph"), "{refused}");
    pool.free(a.handle).unwrap();
    assert_eq!(pool.held_for_capture(), 1);
    let other = pool.alloc_on(MIB, DEFAULT_STREAM).unwrap();
    assert_ne!(other.address, a.address, "a block freed during capture was reused");
    // The fake invalidates a capture whose stream is queried or synchronized, or whose events are.
    assert!(fake.capture(handle, false), "gpupool invalidated the capture");
    pool.synchronize().unwrap();
    assert_eq!(pool.held_for_capture(), 0, "the free completes once the capture ends");
    pool.alloc_on(MIB, side).unwrap();
    pool.check_invariants().unwrap();
}

/// Synchronizing a context while one of its streams captures is invalid in every capture mode,
/// so while a stream captures, `synchronize`, `empty_cache` and the out-of-memory ladder wait
/// for each other stream instead and give nothing back.
#[test]
fn a_capture_leaves_synchronize_and_empty_cache_to_the_other_streams() {
    let (cuda, _turn) = open();
    let fake = fake();
    let mut pool = Pool::new(cuda, Config::parse("strategy:pytorch").unwrap());
    let side = pool.create_stream().unwrap();
    let handle = pool.device().stream_handle(side).unwrap();
    let a = pool.alloc_on(4 * MIB, DEFAULT_STREAM).unwrap();
    pool.free(a.handle).unwrap();
    assert!(fake.capture(handle, true));
    pool.synchronize().unwrap();
    assert_eq!(pool.empty_cache().unwrap(), 0, "nothing goes back during a capture");
    let big = pool.alloc_on(600 * MIB, DEFAULT_STREAM).unwrap();
    let refused = pool.alloc_on(600 * MIB, DEFAULT_STREAM).unwrap_err();
    assert!(matches!(refused, PoolError::OutOfMemory(_)), "{refused}");
    assert!(fake.capture(handle, false), "gpupool invalidated the capture");
    pool.free(big.handle).unwrap();
    assert!(pool.empty_cache().unwrap() > 0, "after the capture the cache goes back");
    pool.check_invariants().unwrap();
}

/// With `cross_stream_reuse:wait`, a block another stream freed is handed over after an event
/// on that stream; waiting for an event recorded in a capture would pull the new stream into
/// the capture, so a capturing owner's blocks are left alone.
#[test]
fn cross_stream_waits_leave_a_capturing_streams_blocks_alone() {
    let (cuda, _turn) = open();
    let fake = fake();
    let mut pool = Pool::new(cuda, Config::parse("strategy:pytorch,cross_stream_reuse:wait").unwrap());
    let (a, b) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    let handle = pool.device().stream_handle(a).unwrap();
    let first = pool.alloc_on(MIB, a).unwrap();
    pool.free(first.handle).unwrap();
    assert!(fake.capture(handle, true));
    let other = pool.alloc_on(MIB, b).unwrap();
    assert_ne!(other.address, first.address, "the capturing stream's block was handed over");
    assert!(fake.capture(handle, false), "stream b joined the capture and never left it");
    pool.check_invariants().unwrap();
}

/// A copy waits for its allocation's stream, which a capture forbids: refused with the pool's
/// capture error, and the capture stays valid.
#[test]
fn copies_of_a_capturing_streams_allocation_are_refused() {
    let (cuda, _turn) = open();
    let fake = fake();
    let mut pool = Pool::new(cuda, Config::parse("strategy:pytorch").unwrap());
    let side = pool.create_stream().unwrap();
    let handle = pool.device().stream_handle(side).unwrap();
    let a = pool.alloc_on(4096, side).unwrap();
    assert!(fake.capture(handle, true));
    let refused = pool.write(a.handle, 0, b"bytes").unwrap_err();
    assert!(refused.to_string().contains("captured into a CUDA graph"), "{refused}");
    let mut out = [0u8; 5];
    assert!(pool.read(a.handle, 0, &mut out).is_err());
    assert!(fake.capture(handle, false), "gpupool invalidated the capture");
    pool.write(a.handle, 0, b"bytes").unwrap();
}

/// During a global-mode capture on one stream, freeing memory from another is one of the
/// "potentially unsafe" calls that invalidate it: frees keep their memory cached until the
/// capture ends, for plain segments and for pages alike.
#[test]
fn frees_during_a_global_capture_keep_their_memory() {
    for config in ["strategy:pytorch,release_threshold:0", "strategy:expandable,release_threshold:0"] {
        let (cuda, _turn) = open();
        let fake = fake();
        let mut pool = Pool::new(cuda, Config::parse(config).unwrap());
        let side = pool.create_stream().unwrap();
        let handle = pool.device().stream_handle(side).unwrap();
        let a = pool.alloc_on(4 * MIB, DEFAULT_STREAM).unwrap();
        let before = reserved(&pool);
        assert!(fake.capture_in_mode(handle, true, 0));
        pool.free(a.handle).unwrap();
        assert_eq!(reserved(&pool), before, "{config}: memory went back during the capture");
        assert!(fake.capture_in_mode(handle, false, 0), "{config}: gpupool invalidated the capture");
        pool.empty_cache().unwrap();
        assert_eq!(reserved(&pool), 0, "{config}");
    }
}

/// `cuMemFree` is documented only as possibly synchronizing: a segment whose free block's stream
/// still has work queued stays cached until that work is done.
#[test]
fn segments_go_back_only_once_their_stream_is_done() {
    let (cuda, _turn) = open();
    let fake = fake();
    let mut pool = Pool::new(cuda, Config::parse("strategy:pytorch,release_threshold:0").unwrap());
    let side = pool.create_stream().unwrap();
    let handle = pool.device().stream_handle(side).unwrap();
    let a = pool.alloc_on(4 * MIB, side).unwrap();
    fake.launch(handle, a.address, 4 * MIB, 0x44);
    let before = fake.violations();
    pool.free(a.handle).unwrap();
    assert!(reserved(&pool) > 0, "the segment went back under the kernel");
    fake.complete(handle);
    let b = pool.alloc_on(MIB, DEFAULT_STREAM).unwrap();
    pool.free(b.handle).unwrap();
    assert_eq!(reserved(&pool), 0, "once the stream is done, the watermark gives everything back");
    assert_eq!(fake.violations(), before);
}

/// Synchronizing a context while one of its streams captures is invalid in every capture mode
/// (and the graph may still use the memory): a device closed then leaves everything to the
/// driver, whether its own stream captures or a blocking stream of the context does.
#[test]
fn closing_during_a_capture_leaves_it_valid() {
    for own in [true, false] {
        let (mut cuda, _turn) = open();
        let fake = fake();
        let side = cuda.create_stream().unwrap();
        let handle = if own { cuda.stream_handle(side).unwrap() } else { fake.blocking_stream() };
        cuda.allocate(MIB).unwrap();
        assert!(fake.capture(handle, true));
        drop(cuda);
        assert!(fake.capture(handle, false), "closing invalidated the capture (own stream: {own})");
    }
}

/// During a global-mode capture on one stream, a thread in the default (global) mode may not
/// allocate from the driver: the call fails and invalidates the capture. Memory for another
/// stream is invisible to the capture, so the backend asks for it in relaxed mode, as PyTorch
/// does, for plain segments and for pages alike.
#[test]
fn allocations_during_a_global_capture_leave_it_valid() {
    for config in ["strategy:pytorch", "strategy:expandable"] {
        let (cuda, _turn) = open();
        let fake = fake();
        let mut pool = Pool::new(cuda, Config::parse(config).unwrap());
        let side = pool.create_stream().unwrap();
        let handle = pool.device().stream_handle(side).unwrap();
        assert!(fake.capture_in_mode(handle, true, 0));
        let a = pool.alloc_on(4 * MIB, DEFAULT_STREAM).unwrap();
        assert!(fake.capture_in_mode(handle, false, 0), "{config}: gpupool invalidated the capture");
        pool.free(a.handle).unwrap();
        pool.check_invariants().unwrap();
    }
}

/// Querying or synchronizing a capturing stream is illegal and invalidates its capture, and
/// destroying a stream waits for it first: the pool refuses all three on a capturing stream (a
/// Python `Stream` dropped mid-capture destroys its stream), and the capture stays valid.
#[test]
fn a_capturing_stream_is_not_queried_synchronized_or_destroyed() {
    let (cuda, _turn) = open();
    let fake = fake();
    let mut pool = Pool::new(cuda, Config::parse("strategy:pytorch").unwrap());
    let side = pool.create_stream().unwrap();
    let handle = pool.device().stream_handle(side).unwrap();
    assert!(fake.capture(handle, true));
    let capturing = |refused: PoolError| matches!(refused, PoolError::Capturing(s, Refused::Wait) if s == side);
    assert!(capturing(pool.query_stream(side).unwrap_err()));
    assert!(capturing(pool.synchronize_stream(side).unwrap_err()));
    assert!(capturing(pool.destroy_stream(side).unwrap_err()));
    assert!(fake.capture(handle, false), "gpupool invalidated the capture");
    assert!(pool.query_stream(side).unwrap());
    pool.synchronize_stream(side).unwrap();
    pool.destroy_stream(side).unwrap();
}

/// A stream imported from elsewhere that the pool keeps nothing for is forgotten without a
/// driver call: its owner may have destroyed it already (a Python `Stream` wrapping a CuPy
/// stream is often dropped after the CuPy stream), and any use of a destroyed stream is
/// undefined. One that still owns a cached block is waited for first, as before: another
/// stream may reuse the block only after its work.
#[test]
fn an_imported_stream_its_owner_destroyed_is_forgotten_without_a_driver_call() {
    let (cuda, _turn) = open();
    let fake = fake();
    let mut pool = Pool::new(cuda, Config::parse("strategy:pytorch").unwrap());
    let raw = fake.blocking_stream();
    let imported = pool.device_mut().import_stream(raw).unwrap();
    let a = pool.alloc_on(MIB, imported).unwrap();
    pool.free(a.handle).unwrap();
    pool.synchronize().unwrap();
    fake.destroy_stream(raw);
    let before = fake.violations();
    pool.destroy_stream(imported).unwrap();
    assert_eq!(fake.violations(), before, "the pool used the destroyed stream");
    let b = pool.alloc_on(MIB, DEFAULT_STREAM).unwrap();
    assert_eq!(b.address, a.address, "the block, shared since the synchronize, is reused");

    let raw = fake.blocking_stream();
    let imported = pool.device_mut().import_stream(raw).unwrap();
    let c = pool.alloc_on(MIB, imported).unwrap();
    pool.free(c.handle).unwrap();
    let synchronized = calls("cuStreamSynchronize");
    pool.destroy_stream(imported).unwrap();
    assert_eq!(calls("cuStreamSynchronize"), synchronized + 1, "a stream with a cached block was not waited for");
    fake.destroy_stream(raw);
    pool.free(b.handle).unwrap();
    pool.check_invariants().unwrap();
}
