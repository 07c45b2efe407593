//! The cuda backend against the fake driver of tests/fake_cuda (feature `cuda`): page
//! bookkeeping of reserved ranges, streams and events, copies, and a pool on top.
//!
//! The fake is compiled with the machine's C compiler and loaded by absolute path before cudarc
//! looks for a driver; its soname is `libcuda.so`, the first name cudarc asks the loader for, so
//! the loader hands cudarc the library already in the process. One fake serves the whole test
//! binary, so these tests use no failure switches (tests/test_cuda_fake.py covers those, one
//! process each). Nothing here measures a GPU.
#![cfg(feature = "cuda")]

use gpupool::device::{Cuda, CudaMode, Device, DeviceError, DEFAULT_STREAM};
use gpupool::pool::{Config, Pool};
use std::ffi::CString;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

const MIB: u64 = 1 << 20;

/// The fake's `fake_cuda_calls`, or None when no C compiler is available (the tests then pass
/// vacuously, saying so).
fn fake() -> Option<extern "C" fn(*const std::ffi::c_char) -> u64> {
    static CALLS: OnceLock<Option<usize>> = OnceLock::new();
    let calls = CALLS.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("gpupool-fake-cuda-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let library = dir.join("libcuda.so");
        let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cuda/fake_cuda.c");
        let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let built = Command::new(compiler)
            .args(["-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so", "-o"])
            .arg(&library)
            .arg(&source)
            .arg("-lpthread")
            .status();
        if !built.is_ok_and(|s| s.success()) {
            eprintln!("no C compiler: the fake driver tests are skipped");
            return None;
        }
        let path = CString::new(library.to_str()?).ok()?;
        // SAFETY: loads a library we just built; RTLD_GLOBAL keeps it for the process.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        assert!(!handle.is_null(), "the fake driver failed to load");
        // SAFETY: looks a symbol up in a live handle.
        let symbol = unsafe { libc::dlsym(handle, c"fake_cuda_calls".as_ptr()) };
        Some(symbol as usize)
    });
    // SAFETY: `fake_cuda_calls` has exactly this signature in fake_cuda.c.
    calls.map(|address| unsafe { std::mem::transmute::<usize, extern "C" fn(*const std::ffi::c_char) -> u64>(address) })
}

fn calls(name: &str) -> u64 {
    let name = CString::new(name).unwrap();
    fake().map_or(0, |f| f(name.as_ptr()))
}

/// The driver's call counters are process-wide, so the tests take turns.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn open() -> Option<(Cuda, MutexGuard<'static, ()>)> {
    fake()?;
    let turn = serial();
    Some((Cuda::open(0, CudaMode::Direct, None).expect("the fake driver opens"), turn))
}

#[test]
fn segments_copy_and_release() {
    let Some((mut cuda, _turn)) = open() else { return };
    assert_eq!(cuda.name(), "cuda:0");
    assert_eq!(cuda.memory_info().total, Some(1 << 30));
    let a = cuda.allocate(4096).unwrap();
    cuda.write(a + 10, b"device bytes").unwrap();
    let mut out = [0u8; 12];
    cuda.read(a + 10, &mut out).unwrap();
    assert_eq!(&out, b"device bytes");
    assert_eq!(cuda.write(a + 4090, b"too long"), Err(DeviceError::InvalidAddress(a + 4090)));
    assert_eq!(cuda.memory_info().held, 4096);
    assert!(matches!(cuda.allocate(2 << 30), Err(DeviceError::OutOfMemory { .. })));
    cuda.release(a).unwrap();
    assert_eq!(cuda.release(a), Err(DeviceError::InvalidAddress(a)));
    assert_eq!(cuda.memory_info().held, 0);
}

#[test]
fn reserved_ranges_are_mapped_page_by_page() {
    let Some((mut cuda, _turn)) = open() else { return };
    let page = cuda.page_size().unwrap();
    assert_eq!(page, 2 * MIB);
    let base = cuda.reserve(5 * MIB).unwrap();
    assert_eq!(cuda.reserved_and_mapped(), (6 * MIB, 0), "rounded up to whole pages");
    assert_eq!(cuda.write(base, b"x"), Err(DeviceError::InvalidAddress(base)), "nothing mapped yet");

    cuda.map(base, 4 * MIB).unwrap();
    assert_eq!(cuda.memory_info().held, 4 * MIB);
    let straddling = base + 2 * MIB - 3;
    cuda.write(straddling, b"across pages").unwrap();
    let mut out = [0u8; 12];
    cuda.read(straddling, &mut out).unwrap();
    assert_eq!(&out, b"across pages");

    assert!(cuda.map(base + 2 * MIB, 4 * MIB).is_err(), "overlaps a mapped page");
    assert!(cuda.map(base + MIB, 2 * MIB).is_err(), "not page-aligned");
    assert!(cuda.map(base + 4 * MIB, 4 * MIB).is_err(), "past the reservation");
    cuda.map(base + 4 * MIB, 2 * MIB).unwrap();
    assert_eq!(cuda.reserved_and_mapped(), (6 * MIB, 6 * MIB));

    cuda.unmap(base + 2 * MIB, 2 * MIB).unwrap();
    assert!(cuda.read(base + 2 * MIB, &mut out).is_err(), "unmapped pages cannot be copied");
    assert!(cuda.unmap(base + 2 * MIB, 2 * MIB).is_err(), "already unmapped");
    assert!(cuda.unmap(base, 4 * MIB).is_err(), "half of it is unmapped");
    assert_eq!(cuda.memory_info().held, 4 * MIB);
    assert_eq!(cuda.unreserve(base), Err(DeviceError::InvalidAddress(base)), "pages are still mapped");
    cuda.unmap(base, 2 * MIB).unwrap();
    cuda.unmap(base + 4 * MIB, 2 * MIB).unwrap();
    cuda.unreserve(base).unwrap();
    assert_eq!(cuda.reserved_and_mapped(), (0, 0));
    assert_eq!(cuda.memory_info().held, 0);
    assert_eq!(cuda.unreserve(base), Err(DeviceError::InvalidAddress(base)));
    assert_eq!(calls("cuMemCreate"), calls("cuMemRelease"), "every physical page was released");
}

#[test]
fn streams_events_and_imports() {
    let Some((mut cuda, _turn)) = open() else { return };
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
    let Some((_, _turn)) = open() else { return };
    let mut cuda = Cuda::open(0, CudaMode::Async, None).unwrap();
    let before = (calls("cuMemAllocAsync"), calls("cuMemFreeAsync"));
    let a = cuda.allocate(MIB).unwrap();
    cuda.release(a).unwrap();
    assert_eq!((calls("cuMemAllocAsync"), calls("cuMemFreeAsync")), (before.0 + 1, before.1 + 1));
}

#[test]
fn a_pool_over_the_fake_device() {
    let Some((cuda, _turn)) = open() else { return };
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
    let Some((cuda, _turn)) = open() else { return };
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
    let Some((mut cuda, _turn)) = open() else { return };
    let before = calls("cuMemRelease");
    cuda.allocate(MIB).unwrap();
    let base = cuda.reserve(4 * MIB).unwrap();
    cuda.map(base, 4 * MIB).unwrap();
    cuda.create_stream().unwrap();
    cuda.record_event(DEFAULT_STREAM).unwrap();
    drop(cuda);
    assert_eq!(calls("cuMemRelease"), before + 2, "both mapped pages released on close");
}
