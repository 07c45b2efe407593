//! Devices: where segments come from. One small trait, one file per backend.
//!
//! # Contract
//! - [`Device::allocate`] returns the address of `size` fresh bytes, aligned to at least 512 B,
//!   or [`DeviceError::OutOfMemory`] when the device (or its capacity cap) cannot provide them.
//!   A refusal leaves the device unchanged.
//! - [`Device::release`] takes back exactly an address `allocate` returned and not yet released;
//!   anything else is [`DeviceError::InvalidAddress`] and changes nothing.
//! - [`Device::allocate_on`] is `allocate` for use on a stream: devices whose allocation is
//!   stream-ordered (CUDA's `cudaMallocAsync`) order it on that stream.
//! - [`Device::write`] / [`Device::read`] copy between host buffers and device memory inside one
//!   live allocation, ordered after the work queued on the given stream, and complete before they
//!   return; devices without memory behind their addresses answer `Unsupported`.
//! - Streams and events: stream [`DEFAULT_STREAM`] always exists. `record_event` marks the
//!   current end of a stream's work; `query_event` says whether everything before it finished;
//!   `synchronize_*` block until it has (`synchronize_device`: every stream); `stream_wait_event` orders a stream's later work after an
//!   event without blocking the host. `hold_stream` exists for simulated devices (it makes the
//!   stream busy until synchronized) and is a no-op where real kernels keep streams busy.
//!   `import_stream` wraps a stream made elsewhere (a raw `cudaStream_t`) and `stream_handle`
//!   gives a stream's raw handle back; devices without real streams answer `Unsupported` / `None`.
//!   `is_capturing` says whether a stream is being captured into a CUDA graph, when queries,
//!   synchronization and allocation from the driver are not allowed on it; `capture_id` names
//!   the capture, which streams share when they capture into the same graph.
//! - A device never panics on bad input: every failure is a `DeviceError`.

#[cfg(feature = "cuda")]
pub mod cuda;
mod faulty;
mod host;
mod reservations;
mod sim;
mod streams;

#[cfg(feature = "cuda")]
pub use cuda::{Cuda, Mode as CudaMode};
pub use faulty::{FaultCall, FaultEffect, FaultPlan, FaultSchedule, FaultSetting, Faulty};
pub use host::Host;
pub use reservations::Reservations;
pub use sim::Sim;
pub use streams::SimStreams;

/// A stream of device work, as numbered by its device.
pub type StreamId = u32;
/// A marker recorded in a stream, as numbered by its device.
pub type EventId = u64;
/// The stream that exists on every device from the start.
pub const DEFAULT_STREAM: StreamId = 0;
/// The driver's handle for the per-thread default stream (`CU_STREAM_PER_THREAD`): one handle
/// naming a different stream on each thread. The pool keys its reuse and its fences by stream,
/// so a block freed by one thread's work could serve another thread's at once: it is refused.
pub const PER_THREAD_STREAM_HANDLE: u64 = 2;

/// Why a stream handle cannot be imported, before any device call: the per-thread default stream.
pub fn refuse_stream_handle(handle: u64) -> Result<(), String> {
    if handle == PER_THREAD_STREAM_HANDLE {
        return Err("the per-thread default stream (handle 2, cudaStreamPerThread) is a different stream on each \
                    thread, which gpupool cannot tell apart: allocate on a stream of your own"
            .to_string());
    }
    Ok(())
}

/// Ids from here up name the pool's own owners of free blocks (`core::SHARED`, `core::NIL`), and
/// the pool indexes per-stream tables by id: a device numbers at most this many streams.
pub const STREAM_IDS: StreamId = u32::MAX - 1;

/// Takes the id `next` holds for a new stream and advances it; ids are never reused, so after
/// [`STREAM_IDS`] streams a device refuses more instead of wrapping onto live ones.
pub fn take_stream_id(next: &mut StreamId) -> Result<StreamId, DeviceError> {
    let id = *next;
    if id >= STREAM_IDS {
        return Err(DeviceError::Unsupported("more than 4,294,967,294 streams in its lifetime"));
    }
    *next = id + 1;
    Ok(id)
}

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceError {
    OutOfMemory {
        requested: u64,
    },
    InvalidAddress(u64),
    InvalidStream(StreamId),
    InvalidEvent(EventId),
    Unsupported(&'static str),
    /// A driver call failed (real devices only); the text names the call and the code.
    Driver(String),
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::OutOfMemory { requested } => write!(f, "device refused {requested} bytes"),
            DeviceError::InvalidAddress(a) => {
                write!(f, "address {a:#x} is not a live device allocation")
            }
            DeviceError::InvalidStream(s) => write!(f, "stream {s} does not exist on this device (destroyed?)"),
            DeviceError::InvalidEvent(e) => write!(f, "event {e} does not exist on this device"),
            DeviceError::Unsupported(what) => write!(f, "this device does not support {what}"),
            DeviceError::Driver(message) => f.write_str(message),
        }
    }
}

/// How paged memory is made (the `shareable_handle` and `peer_access` settings).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MappingOptions {
    /// Physical memory exportable as a POSIX file descriptor (for IPC and NCCL peer-to-peer).
    pub shareable: bool,
    /// Other devices granted read/write access to mapped memory.
    pub peers: Vec<i32>,
}

/// Pages exported for another process: the exporter's pid, one page per physical allocation (in
/// address order), and where the range asked for starts in the first. The exporting process
/// closes the descriptors once the other side has duplicated them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedPages {
    pub pid: u32,
    pub pages: Vec<ExportedPage>,
    pub offset: u64,
}

/// One physical allocation's descriptor in the exporter, with the file it names (`st_dev`,
/// `st_ino`): once the exporter closes it, a later export may get the same number, and an
/// importer holding a stale handle must be able to tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportedPage {
    pub fd: i32,
    pub file: (u64, u64),
    pub size: u64,
}

/// What a device has: `total` is its capacity (None for "whatever the host gives").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    pub total: Option<u64>,
    /// Bytes currently allocated from the device through this handle.
    pub held: u64,
}

impl MemoryInfo {
    pub fn free(&self) -> Option<u64> {
        self.total.map(|t| t.saturating_sub(self.held))
    }
}

pub trait Device: Send {
    /// The device string users see: `host`, `sim`, `cuda:0`.
    fn name(&self) -> &str;
    fn allocate(&mut self, size: u64) -> Result<u64, DeviceError>;
    /// Allocates `size` bytes to be used on `stream` (see the contract).
    fn allocate_on(&mut self, size: u64, _stream: StreamId) -> Result<u64, DeviceError> {
        self.allocate(size)
    }
    fn release(&mut self, address: u64) -> Result<(), DeviceError>;
    fn memory_info(&self) -> MemoryInfo;
    /// Whether addresses are host pointers that Python may view directly.
    fn host_accessible(&self) -> bool {
        false
    }
    fn write(&mut self, _stream: StreamId, _address: u64, _data: &[u8]) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("copies"))
    }
    fn read(&self, _stream: StreamId, _address: u64, _out: &mut [u8]) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("copies"))
    }
    /// Whether streams of this device can be captured into graphs, so that the pool must ask
    /// `is_capturing` (a device call) before using one.
    fn captures_graphs(&self) -> bool {
        false
    }
    /// Whether `stream` is being captured into a CUDA graph; devices without graphs never are.
    fn is_capturing(&mut self, _stream: StreamId) -> Result<bool, DeviceError> {
        Ok(false)
    }
    /// The capture sequence `stream` is in, as an id that two streams share exactly when they
    /// capture into the same graph (one joined the other's capture by waiting for its event).
    /// None when it is in no active capture, or the device cannot tell which: an invalidated
    /// capture has no id, nor does a device without graphs.
    fn capture_id(&mut self, _stream: StreamId) -> Result<Option<u64>, DeviceError> {
        Ok(None)
    }
    /// The streams this device made and has not destroyed (not the imported ones).
    fn created_streams(&self) -> Vec<StreamId> {
        Vec::new()
    }
    fn create_stream(&mut self) -> Result<StreamId, DeviceError>;
    fn destroy_stream(&mut self, stream: StreamId) -> Result<(), DeviceError>;
    fn hold_stream(&mut self, _stream: StreamId) -> Result<(), DeviceError> {
        Ok(())
    }
    fn query_stream(&mut self, stream: StreamId) -> Result<bool, DeviceError>;
    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), DeviceError>;
    /// Blocks until the work queued on every stream of the device has finished.
    fn synchronize_device(&mut self) -> Result<(), DeviceError>;
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DeviceError>;
    fn query_event(&mut self, event: EventId) -> Result<bool, DeviceError>;
    fn synchronize_event(&mut self, event: EventId) -> Result<(), DeviceError>;
    fn destroy_event(&mut self, event: EventId) -> Result<(), DeviceError>;
    fn stream_wait_event(&mut self, _stream: StreamId, _event: EventId) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("stream waits"))
    }
    /// Wraps a stream created outside gpupool from its raw handle. The device uses it but never
    /// destroys it: `destroy_stream` only forgets the id.
    fn import_stream(&mut self, _handle: u64) -> Result<StreamId, DeviceError> {
        Err(DeviceError::Unsupported("external streams"))
    }
    /// The raw driver handle of a stream (0 for the legacy default stream).
    fn stream_handle(&self, _stream: StreamId) -> Option<u64> {
        None
    }
    /// Reserves `size` bytes of address space with no memory behind it (expandable segments).
    /// `size` is a multiple of the page size the pool maps with.
    fn reserve(&mut self, _size: u64) -> Result<u64, DeviceError> {
        Err(DeviceError::Unsupported("address reservations"))
    }
    /// Gives back a reservation; every page of it must be unmapped.
    fn unreserve(&mut self, address: u64) -> Result<(), DeviceError> {
        Err(DeviceError::InvalidAddress(address))
    }
    /// Backs `[address, address + size)` of a reservation with memory; counts against capacity
    /// (`OutOfMemory` when it would exceed it). The range must be unmapped, and `address`, `size`
    /// and `handle` multiples of the mapping granularity: one physical allocation (handle) of
    /// `handle` bytes is made for each `handle` bytes of the range, the last one holding what is
    /// left when `handle` does not divide `size`; `unmap` later takes each back whole (on CUDA, a
    /// `cuMemCreate` and `cuMemMap` each; access is granted once for the whole range). All or
    /// nothing: on error nothing stays mapped.
    fn map(&mut self, address: u64, _size: u64, _handle: u64) -> Result<(), DeviceError> {
        Err(DeviceError::InvalidAddress(address))
    }
    /// Returns the memory behind mapped handles of a reservation to the device:
    /// `[address, address + size)` must be whole handles as `map` made them (a range that starts
    /// or ends inside one is `InvalidAddress` and changes nothing). The pool unmaps one handle
    /// per call, so that a failure leaves its page map and the device agreeing.
    fn unmap(&mut self, address: u64, _size: u64) -> Result<(), DeviceError> {
        Err(DeviceError::InvalidAddress(address))
    }
    /// An inter-process handle for the allocation holding `address`: the driver's bytes and the
    /// offset of `address` in that allocation. Devices without IPC answer `Unsupported`.
    fn ipc_handle(&mut self, _address: u64) -> Result<(Vec<u8>, u64), DeviceError> {
        Err(DeviceError::Unsupported("IPC handles"))
    }
    /// File descriptors for the pages under `[address, address + len)`, for another process to
    /// map (CUDA with `shareable_handle:posix_fd`); others answer `Unsupported`.
    fn export_pages(&mut self, _address: u64, _len: u64) -> Result<ExportedPages, DeviceError> {
        Err(DeviceError::Unsupported("exporting pages to other processes"))
    }
    /// The smallest unit `map` can work in (CUDA's allocation granularity); addresses and
    /// handles must be multiples of it.
    fn mapping_granularity(&mut self) -> Result<u64, DeviceError> {
        Ok(1)
    }
    /// How mapped memory is made from now on: shareable with other processes, accessible from
    /// peer devices. Devices without such things ignore the options; a device that cannot honour
    /// them says so at the next `map`.
    fn set_mapping_options(&mut self, _options: &MappingOptions) {}
}

/// Implements the stream and event calls of [`Device`] by forwarding to field `$field`.
macro_rules! forward_streams {
    ($field:ident) => {
        fn create_stream(&mut self) -> Result<$crate::device::StreamId, $crate::device::DeviceError> {
            self.$field.create_stream()
        }
        fn destroy_stream(&mut self, s: $crate::device::StreamId) -> Result<(), $crate::device::DeviceError> {
            self.$field.destroy_stream(s)
        }
        fn hold_stream(&mut self, s: $crate::device::StreamId) -> Result<(), $crate::device::DeviceError> {
            self.$field.hold_stream(s)
        }
        fn query_stream(&mut self, s: $crate::device::StreamId) -> Result<bool, $crate::device::DeviceError> {
            self.$field.query_stream(s)
        }
        fn synchronize_stream(&mut self, s: $crate::device::StreamId) -> Result<(), $crate::device::DeviceError> {
            self.$field.synchronize_stream(s)
        }
        fn synchronize_device(&mut self) -> Result<(), $crate::device::DeviceError> {
            self.$field.synchronize_device()
        }
        fn record_event(
            &mut self,
            s: $crate::device::StreamId,
        ) -> Result<$crate::device::EventId, $crate::device::DeviceError> {
            self.$field.record_event(s)
        }
        fn query_event(&mut self, e: $crate::device::EventId) -> Result<bool, $crate::device::DeviceError> {
            self.$field.query_event(e)
        }
        fn synchronize_event(&mut self, e: $crate::device::EventId) -> Result<(), $crate::device::DeviceError> {
            self.$field.synchronize_event(e)
        }
        fn destroy_event(&mut self, e: $crate::device::EventId) -> Result<(), $crate::device::DeviceError> {
            self.$field.destroy_event(e)
        }
        fn stream_wait_event(
            &mut self,
            s: $crate::device::StreamId,
            e: $crate::device::EventId,
        ) -> Result<(), $crate::device::DeviceError> {
            self.$field.stream_wait_event(s, e)
        }
    };
}
pub(crate) use forward_streams;

impl<D: Device + ?Sized> Device for Box<D> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn allocate(&mut self, size: u64) -> Result<u64, DeviceError> {
        (**self).allocate(size)
    }
    fn allocate_on(&mut self, size: u64, stream: StreamId) -> Result<u64, DeviceError> {
        (**self).allocate_on(size, stream)
    }
    fn release(&mut self, address: u64) -> Result<(), DeviceError> {
        (**self).release(address)
    }
    fn memory_info(&self) -> MemoryInfo {
        (**self).memory_info()
    }
    fn host_accessible(&self) -> bool {
        (**self).host_accessible()
    }
    fn write(&mut self, stream: StreamId, address: u64, data: &[u8]) -> Result<(), DeviceError> {
        (**self).write(stream, address, data)
    }
    fn read(&self, stream: StreamId, address: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        (**self).read(stream, address, out)
    }
    fn captures_graphs(&self) -> bool {
        (**self).captures_graphs()
    }
    fn is_capturing(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        (**self).is_capturing(stream)
    }
    fn capture_id(&mut self, stream: StreamId) -> Result<Option<u64>, DeviceError> {
        (**self).capture_id(stream)
    }
    fn created_streams(&self) -> Vec<StreamId> {
        (**self).created_streams()
    }
    fn create_stream(&mut self) -> Result<StreamId, DeviceError> {
        (**self).create_stream()
    }
    fn destroy_stream(&mut self, s: StreamId) -> Result<(), DeviceError> {
        (**self).destroy_stream(s)
    }
    fn hold_stream(&mut self, s: StreamId) -> Result<(), DeviceError> {
        (**self).hold_stream(s)
    }
    fn query_stream(&mut self, s: StreamId) -> Result<bool, DeviceError> {
        (**self).query_stream(s)
    }
    fn synchronize_stream(&mut self, s: StreamId) -> Result<(), DeviceError> {
        (**self).synchronize_stream(s)
    }
    fn synchronize_device(&mut self) -> Result<(), DeviceError> {
        (**self).synchronize_device()
    }
    fn record_event(&mut self, s: StreamId) -> Result<EventId, DeviceError> {
        (**self).record_event(s)
    }
    fn query_event(&mut self, e: EventId) -> Result<bool, DeviceError> {
        (**self).query_event(e)
    }
    fn synchronize_event(&mut self, e: EventId) -> Result<(), DeviceError> {
        (**self).synchronize_event(e)
    }
    fn destroy_event(&mut self, e: EventId) -> Result<(), DeviceError> {
        (**self).destroy_event(e)
    }
    fn stream_wait_event(&mut self, s: StreamId, e: EventId) -> Result<(), DeviceError> {
        (**self).stream_wait_event(s, e)
    }
    fn import_stream(&mut self, handle: u64) -> Result<StreamId, DeviceError> {
        (**self).import_stream(handle)
    }
    fn stream_handle(&self, s: StreamId) -> Option<u64> {
        (**self).stream_handle(s)
    }
    fn reserve(&mut self, size: u64) -> Result<u64, DeviceError> {
        (**self).reserve(size)
    }
    fn unreserve(&mut self, address: u64) -> Result<(), DeviceError> {
        (**self).unreserve(address)
    }
    fn map(&mut self, address: u64, size: u64, handle: u64) -> Result<(), DeviceError> {
        (**self).map(address, size, handle)
    }
    fn mapping_granularity(&mut self) -> Result<u64, DeviceError> {
        (**self).mapping_granularity()
    }
    fn ipc_handle(&mut self, address: u64) -> Result<(Vec<u8>, u64), DeviceError> {
        (**self).ipc_handle(address)
    }
    fn export_pages(&mut self, address: u64, len: u64) -> Result<ExportedPages, DeviceError> {
        (**self).export_pages(address, len)
    }
    fn set_mapping_options(&mut self, options: &MappingOptions) {
        (**self).set_mapping_options(options)
    }
    fn unmap(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        (**self).unmap(address, size)
    }
}

/// Refuses a request that would exceed `capacity`.
fn check_capacity(capacity: Option<u64>, held: u64, size: u64) -> Result<(), DeviceError> {
    match capacity {
        Some(cap) if held.checked_add(size).is_none_or(|total| total > cap) => {
            Err(DeviceError::OutOfMemory { requested: size })
        }
        _ => Ok(()),
    }
}
