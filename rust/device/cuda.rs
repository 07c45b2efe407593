//! `cuda:N`: device memory from the CUDA driver, loaded at run time (feature `cuda`).
//!
//! Segments come from `cuMemAlloc` ([`Mode::Direct`]) or from the driver's own stream-ordered
//! pool, `cuMemAllocAsync` / `cuMemFreeAsync` on the stream the segment is for ([`Mode::Async`]:
//! PyTorch's `backend:cudaMallocAsync`, and a baseline for benchmarks). Streams and events are
//! real driver objects behind the trait's numbering: stream [`DEFAULT_STREAM`] is the legacy
//! default stream (handle 0), streams made here are non-blocking (as PyTorch's and CuPy's side
//! streams are), and streams imported by handle (`torch.cuda.current_stream().cuda_stream`) are
//! used but never destroyed. Reserved address ranges mapped in runs (`reserve`, `map`) live in
//! [`vmm`].
//!
//! Work on memory goes on a stream ordered after the memory's users, never on the legacy stream
//! for memory a non-blocking stream uses: copies are queued on the stream the caller names and
//! then that stream is synchronized. Every entry point makes the device's primary context current
//! through a guard that restores the caller's on the way out ([`driver::Context::enter`]), and no
//! path can panic: [`driver::probe`] checks the library and its symbols before the first call.

pub mod driver;
pub mod ipc;
pub mod vmm;

use super::{
    check_capacity, Device, DeviceError, EventId, ExportedPages, MappingOptions, MemoryInfo, StreamId, DEFAULT_STREAM,
};
use cudarc::driver::sys;
use driver::{check, check_alloc, check_ready, Context};
use std::collections::{BTreeMap, HashMap};

/// How segments are obtained from the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `cuMemAlloc` / `cuMemFree`: every segment is a synchronous driver allocation.
    Direct,
    /// `cuMemAllocAsync` / `cuMemFreeAsync` on the segment's stream: the driver's pool, told to
    /// keep what it caches (release threshold: unlimited), as PyTorch's backend does.
    Async,
}

/// A stream as the driver knows it.
#[derive(Clone, Copy, Debug)]
struct RawStream {
    handle: u64,
    /// Created here (and destroyed here), as opposed to imported.
    owned: bool,
    /// The context the stream belongs to: ours, or, for a stream imported from another device
    /// (PyTorch's `record_stream` takes any device's stream), that device's primary context,
    /// retained in `foreign_contexts`. Work on it is ordered from its own context, and its
    /// events are made there.
    context: u64,
}

/// An event as the driver knows it, and the context it was made in (its stream's).
#[derive(Clone, Copy, Debug)]
struct RawEvent {
    handle: u64,
    context: u64,
}

/// A segment from `cuMemAlloc` or `cuMemAllocAsync`.
#[derive(Clone, Copy, Debug)]
struct Segment {
    size: u64,
    /// Where an async-mode segment is freed: the stream it was allocated for (stream order then
    /// puts the free after that stream's work; other streams' uses were waited for by the pool).
    stream: StreamId,
}

#[derive(Debug)]
pub struct Cuda {
    name: String,
    mode: Mode,
    context: Context,
    capacity: Option<u64>,
    /// The card's memory, from `cuMemGetInfo` when the device was opened.
    total: u64,
    held: u64,
    /// Live segments by address, ordered so copies find the segment holding a range.
    live: BTreeMap<u64, Segment>,
    streams: HashMap<StreamId, RawStream>,
    next_stream: StreamId,
    events: HashMap<EventId, RawEvent>,
    /// Destroyed events of our context kept for reuse: creating one costs a driver call,
    /// recording none. Other contexts' events are destroyed at once.
    spare_events: Vec<u64>,
    next_event: EventId,
    reservations: vmm::Reservations,
    /// Other devices' primary contexts that imported streams belong to, retained once each by
    /// handle: their owner (PyTorch, CuPy) may release them while the pool still holds events
    /// recorded there, and a released context takes its events with it. Dropped after `drop`
    /// has destroyed those events.
    foreign_contexts: HashMap<u64, Context>,
}

/// `cuda` or `cuda:N` -> N; `None` when `spec` names another kind of device.
pub fn parse_ordinal(spec: &str) -> Option<Result<i32, String>> {
    let rest = spec.strip_prefix("cuda")?;
    if rest.is_empty() {
        return Some(Ok(0));
    }
    let digits = rest.strip_prefix(':')?;
    Some(
        digits
            .parse::<i32>()
            .ok()
            .filter(|n| *n >= 0)
            .ok_or_else(|| format!("bad CUDA device '{spec}': expected 'cuda' or 'cuda:N' with N a device number")),
    )
}

/// Whether a CUDA device can be opened: a driver, recent enough, that sees at least one GPU.
pub fn available() -> bool {
    device_count() > 0
}

/// GPUs the driver sees; 0 when there is no usable driver.
pub fn device_count() -> usize {
    driver::probe().map_or(0, |info| info.device_count.max(0) as usize)
}

/// `(free, total)` bytes of `cuda:ordinal` as the driver counts them (`cuMemGetInfo`): memory
/// every process and pool holds counts as used.
pub fn memory_figures(ordinal: i32) -> Result<(u64, u64), DeviceError> {
    let context = Context::retain(ordinal)?;
    let _current = context.enter()?;
    let (mut free, mut total) = (0, 0);
    // SAFETY: the context is current; both pointers are valid for one write.
    check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
    Ok((free as u64, total as u64))
}

impl Cuda {
    /// Opens `cuda:ordinal`; `capacity` caps what this device hands out, below the card's size.
    pub fn open(ordinal: i32, mode: Mode, capacity: Option<u64>) -> Result<Self, DeviceError> {
        if mode == Mode::Async {
            driver::require_symbols(driver::ASYNC_SYMBOLS, "cuda async mode")?;
        }
        let context = Context::retain(ordinal)?;
        let _current = context.enter()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: the context is current; both pointers are valid for one write.
        check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        if mode == Mode::Async {
            let pools = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED;
            if !context.supports(pools)? {
                return Err(DeviceError::Unsupported("stream-ordered memory pools, which cuda async mode needs"));
            }
            keep_driver_pool_cache(context.device())?;
        }
        let mut streams = HashMap::new();
        streams.insert(DEFAULT_STREAM, RawStream { handle: 0, owned: false, context: context.raw() });
        Ok(Cuda {
            name: format!("cuda:{ordinal}"),
            mode,
            context,
            capacity,
            total: total as u64,
            held: 0,
            live: BTreeMap::new(),
            streams,
            next_stream: DEFAULT_STREAM + 1,
            events: HashMap::new(),
            spare_events: Vec::new(),
            next_event: 1,
            reservations: vmm::Reservations::default(),
            foreign_contexts: HashMap::new(),
        })
    }

    pub fn ordinal(&self) -> i32 {
        self.context.ordinal()
    }

    fn stream(&self, stream: StreamId) -> Result<sys::CUstream, DeviceError> {
        Ok(self.raw_stream(stream)?.handle as sys::CUstream)
    }

    fn raw_stream(&self, stream: StreamId) -> Result<RawStream, DeviceError> {
        self.streams.get(&stream).copied().ok_or(DeviceError::InvalidStream(stream))
    }

    /// A stream of our context, for stream-ordered allocation: the driver serves another
    /// device's stream from that device's pool.
    fn own_stream(&self, stream: StreamId) -> Result<sys::CUstream, DeviceError> {
        let raw = self.raw_stream(stream)?;
        if raw.context != self.context.raw() {
            return Err(DeviceError::Driver(format!(
                "stream {:#x} belongs to another device's context, not {}'s",
                raw.handle, self.name
            )));
        }
        Ok(raw.handle as sys::CUstream)
    }

    /// `stream`'s driver handle, with its context made current while the guard lives.
    fn enter_stream(&self, stream: StreamId) -> Result<(sys::CUstream, driver::Entered), DeviceError> {
        let raw = self.raw_stream(stream)?;
        Ok((raw.handle as sys::CUstream, driver::enter(raw.context)?))
    }

    fn event(&self, event: EventId) -> Result<RawEvent, DeviceError> {
        self.events.get(&event).copied().ok_or(DeviceError::InvalidEvent(event))
    }

    /// Checks that `[address, address + len)` lies in one live segment or one mapped range.
    fn check_range(&self, address: u64, len: usize) -> Result<(), DeviceError> {
        let end = address.checked_add(len as u64).ok_or(DeviceError::InvalidAddress(address))?;
        let in_segment = self.live.range(..=address).next_back().is_some_and(|(&base, s)| end <= base + s.size);
        if in_segment || self.reservations.is_mapped(address, end) {
            Ok(())
        } else {
            Err(DeviceError::InvalidAddress(address))
        }
    }

    /// Returns a segment to the driver; the context must be current.
    fn free_segment(&self, address: u64, segment: Segment) -> Result<(), DeviceError> {
        match self.mode {
            // SAFETY: `address` is a live allocation of ours, freed once (callers remove it first).
            Mode::Direct => check("cuMemFree", unsafe { sys::cuMemFree_v2(address) }),
            Mode::Async => {
                // A destroyed stream was synchronized first: its segments are idle, and any
                // stream may free them; the default stream is the one that always exists.
                let stream = self.stream(segment.stream).or_else(|_| self.stream(DEFAULT_STREAM))?;
                // SAFETY: as above; freed in the order of the stream it was allocated for.
                check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(address, stream) })
            }
        }
    }

    /// An event the pool is done with: ours are kept for reuse, another context's are destroyed
    /// from that context.
    fn retire_event(&mut self, raw: RawEvent) -> Result<(), DeviceError> {
        if raw.context == self.context.raw() {
            self.spare_events.push(raw.handle);
            return Ok(());
        }
        let _current = driver::enter(raw.context)?;
        // SAFETY: an event of that context, destroyed once (the caller forgot it).
        check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(raw.handle as sys::CUevent) })
    }

    /// Retains `context`, an imported stream's, for the device's life when it is another device's
    /// primary context. A context made with `cuCtxCreate` cannot be retained, and one its creator
    /// destroys leaves dangling handles the driver does not check: such streams are refused at
    /// import, with the way out, rather than crashing later. PyTorch, CuPy and Numba hand out
    /// primary contexts' streams only.
    fn keep_alive(&mut self, context: u64) -> Result<(), DeviceError> {
        if context == self.context.raw() || self.foreign_contexts.contains_key(&context) {
            return Ok(());
        }
        let primary = Context::retain_primary(context)?.ok_or(DeviceError::Unsupported(
            "streams of a context made with cuCtxCreate, which gpupool cannot keep alive (use the device's primary \
             context, as PyTorch, CuPy and Numba do)",
        ))?;
        self.foreign_contexts.insert(context, primary);
        Ok(())
    }

    /// Whether the legacy stream (which counts while a blocking stream of the context captures)
    /// or a stream made here is being captured. Imported streams are not asked: their owner may
    /// have destroyed them.
    fn own_streams_capturing(&mut self) -> bool {
        let own: Vec<StreamId> = self.streams.iter().filter(|(_, raw)| raw.owned).map(|(&id, _)| id).collect();
        own.into_iter().chain([DEFAULT_STREAM]).any(|s| self.is_capturing(s).unwrap_or(false))
    }

    /// Waits for all work in the device's context: before memory goes back at teardown, when
    /// streams imported from elsewhere may still be running kernels on it.
    fn synchronize_context(&self) -> Result<(), DeviceError> {
        let _current = self.context.enter()?;
        // SAFETY: no arguments; the context is current.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}

/// Makes the device's stream-ordered pool keep what it caches instead of returning it to the
/// driver at every synchronization (its default threshold is 0), as PyTorch's
/// `backend:cudaMallocAsync` does: otherwise the `async` baseline pays for re-allocation that no
/// caching allocator pays, and comparisons against it are unfair.
fn keep_driver_pool_cache(device: sys::CUdevice) -> Result<(), DeviceError> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: a device handle from `cuDeviceGet`; one pointer written.
    check("cuDeviceGetDefaultMemPool", unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, device) })?;
    let mut threshold = u64::MAX;
    let attribute = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // SAFETY: the attribute takes a cuuint64_t, which `threshold` is, for the call's duration.
    check("cuMemPoolSetAttribute", unsafe {
        sys::cuMemPoolSetAttribute(pool, attribute, (&mut threshold as *mut u64).cast())
    })
}

impl Device for Cuda {
    fn name(&self) -> &str {
        &self.name
    }

    fn allocate(&mut self, size: u64) -> Result<u64, DeviceError> {
        self.allocate_on(size, DEFAULT_STREAM)
    }

    fn allocate_on(&mut self, size: u64, stream: StreamId) -> Result<u64, DeviceError> {
        check_capacity(self.capacity, self.held, size)?;
        let bytes = usize::try_from(size.max(1)).map_err(|_| DeviceError::OutOfMemory { requested: size })?;
        let _current = self.context.enter()?;
        let mut address = 0;
        match self.mode {
            Mode::Direct => {
                let _relaxed = driver::relax_capture_mode();
                // SAFETY: the context is current; the pointer is valid for one write.
                check_alloc("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut address, bytes) }, size)?
            }
            Mode::Async => check_alloc(
                "cuMemAllocAsync",
                // SAFETY: as above; the symbol exists (checked when the device opened) and the
                // stream is live.
                unsafe { sys::cuMemAllocAsync(&mut address, bytes, self.own_stream(stream)?) },
                size,
            )?,
        }
        self.live.insert(address, Segment { size, stream });
        self.held += size;
        Ok(address)
    }

    fn release(&mut self, address: u64) -> Result<(), DeviceError> {
        let segment = *self.live.get(&address).ok_or(DeviceError::InvalidAddress(address))?;
        let _current = self.context.enter()?;
        self.free_segment(address, segment)?;
        self.live.remove(&address);
        self.held -= segment.size;
        Ok(())
    }

    fn memory_info(&self) -> MemoryInfo {
        MemoryInfo { total: Some(self.capacity.map_or(self.total, |cap| cap.min(self.total))), held: self.held }
    }

    /// Queued on `stream` (after the work the caller ordered there), then waited for.
    fn write(&mut self, stream: StreamId, address: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.check_range(address, data.len())?;
        let (raw_stream, _current) = self.enter_stream(stream)?;
        // SAFETY: the destination lies in live device memory of ours (checked above), the source
        // is a valid host slice, and the stream is synchronized before the slice is released.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(address, data.as_ptr().cast(), data.len(), raw_stream)
        })?;
        // SAFETY: a live stream of the current context.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(raw_stream) })
    }

    fn read(&self, stream: StreamId, address: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.check_range(address, out.len())?;
        let (raw_stream, _current) = self.enter_stream(stream)?;
        // SAFETY: the source lies in live device memory of ours (checked above), the destination
        // is an exclusively borrowed host slice, and the stream is synchronized before it is
        // released.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), address, out.len(), raw_stream)
        })?;
        // SAFETY: a live stream of the current context.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(raw_stream) })
    }

    fn create_stream(&mut self) -> Result<StreamId, DeviceError> {
        let _current = self.context.enter()?;
        // The id first: a stream the driver made and no id names would never be destroyed.
        let mut next = self.next_stream;
        let id = super::take_stream_id(&mut next)?;
        let mut raw = std::ptr::null_mut();
        let non_blocking = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: the context is current; a non-blocking stream, as frameworks make them: nothing
        // here relies on the legacy stream's implicit ordering.
        check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut raw, non_blocking) })?;
        self.next_stream = next;
        self.streams.insert(id, RawStream { handle: raw as u64, owned: true, context: self.context.raw() });
        Ok(id)
    }

    fn destroy_stream(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        if stream == DEFAULT_STREAM {
            return Err(DeviceError::InvalidStream(stream));
        }
        let raw = *self.streams.get(&stream).ok_or(DeviceError::InvalidStream(stream))?;
        if raw.owned {
            let _current = self.context.enter()?;
            // SAFETY: a stream we created and have not destroyed; pending work still completes.
            check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(raw.handle as sys::CUstream) })?;
        }
        self.streams.remove(&stream);
        Ok(())
    }

    fn query_stream(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        let (raw, _current) = self.enter_stream(stream)?;
        // SAFETY: a live stream of the current context.
        check_ready("cuStreamQuery", unsafe { sys::cuStreamQuery(raw) })
    }

    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        let (raw, _current) = self.enter_stream(stream)?;
        // SAFETY: a live stream of the current context.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(raw) })
    }

    fn synchronize_device(&mut self) -> Result<(), DeviceError> {
        self.synchronize_context()
    }

    /// The event is made in the stream's context: the driver records only an event and a stream
    /// of the same context.
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DeviceError> {
        let stream = self.raw_stream(stream)?;
        let _current = driver::enter(stream.context)?;
        let ours = stream.context == self.context.raw();
        let spare = if ours { self.spare_events.pop() } else { None };
        let raw = match spare {
            Some(raw) => raw as sys::CUevent,
            None => {
                let mut raw = std::ptr::null_mut();
                // SAFETY: the stream's context is current; timing is off, which makes events
                // cheaper.
                check("cuEventCreate", unsafe { sys::cuEventCreate(&mut raw, 2) })?;
                raw
            }
        };
        // SAFETY: a live event and a live stream, both of the current context.
        if let Err(e) = check("cuEventRecord", unsafe { sys::cuEventRecord(raw, stream.handle as sys::CUstream) }) {
            let _ = self.retire_event(RawEvent { handle: raw as u64, context: stream.context });
            return Err(e);
        }
        let id = self.next_event;
        self.next_event += 1;
        self.events.insert(id, RawEvent { handle: raw as u64, context: stream.context });
        Ok(id)
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, DeviceError> {
        let raw = self.event(event)?;
        let _current = driver::enter(raw.context)?;
        // SAFETY: a live event of the current context.
        check_ready("cuEventQuery", unsafe { sys::cuEventQuery(raw.handle as sys::CUevent) })
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        let raw = self.event(event)?;
        let _current = driver::enter(raw.context)?;
        // SAFETY: a live event of the current context.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(raw.handle as sys::CUevent) })
    }

    /// Ours go to the spare list: re-recording one later is allowed even while streams still
    /// wait on this recording, because a wait captures the recording it saw.
    fn destroy_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        let raw = self.events.remove(&event).ok_or(DeviceError::InvalidEvent(event))?;
        self.retire_event(raw)
    }

    /// The event may be another context's: the driver lets a stream wait for any context's.
    fn stream_wait_event(&mut self, stream: StreamId, event: EventId) -> Result<(), DeviceError> {
        let raw_event = self.event(event)?;
        let (raw_stream, _current) = self.enter_stream(stream)?;
        // SAFETY: a live stream of the current context and a live event.
        check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(raw_stream, raw_event.handle as sys::CUevent, 0) })
    }

    /// Handle 0, the legacy default stream, is [`DEFAULT_STREAM`]; any other import gets an id
    /// of its own, which `destroy_stream` forgets without destroying the driver's stream. The
    /// driver says which context the stream belongs to (the other special handles, the legacy
    /// and per-thread streams, are ours while ours is current); another device's is kept alive
    /// ([`Cuda::keep_alive`]).
    fn import_stream(&mut self, handle: u64) -> Result<StreamId, DeviceError> {
        if handle == 0 {
            return Ok(DEFAULT_STREAM);
        }
        let context = {
            let _current = self.context.enter()?;
            let mut context = std::ptr::null_mut();
            // SAFETY: one context handle written; a handle that is no stream is an error.
            check("cuStreamGetCtx", unsafe { sys::cuStreamGetCtx(handle as sys::CUstream, &mut context) })?;
            context as u64
        };
        self.keep_alive(context)?;
        let id = super::take_stream_id(&mut self.next_stream)?;
        self.streams.insert(id, RawStream { handle, owned: false, context });
        Ok(id)
    }

    fn stream_handle(&self, stream: StreamId) -> Option<u64> {
        self.streams.get(&stream).map(|raw| raw.handle)
    }

    fn captures_graphs(&self) -> bool {
        true
    }

    fn is_capturing(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        let (raw, _current) = self.enter_stream(stream)?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream of the current context; one status written. Unlike a query, asking about
        // capture is allowed during capture.
        let code = unsafe { sys::cuStreamIsCapturing(raw, &mut status) };
        // The legacy default stream, while a blocking stream of the context captures: the driver
        // calls it unusable until that capture ends, so it counts as capturing.
        if driver::is(code, sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) {
            return Ok(true);
        }
        check("cuStreamIsCapturing", code)?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// The driver defines the id for an active capture only.
    fn capture_id(&mut self, stream: StreamId) -> Result<Option<u64>, DeviceError> {
        let (raw, _current) = self.enter_stream(stream)?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id = 0;
        let (graph, dependencies, count) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a live stream of the current context; the status and the id written, the graph
        // and its dependencies not asked for (null). Allowed during capture, as is_capturing is.
        let code = unsafe { sys::cuStreamGetCaptureInfo_v2(raw, &mut status, &mut id, graph, dependencies, count) };
        // The legacy default stream, unusable while a blocking stream captures, is in no capture.
        if driver::is(code, sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) {
            return Ok(None);
        }
        check("cuStreamGetCaptureInfo", code)?;
        Ok((status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE).then_some(id))
    }

    fn created_streams(&self) -> Vec<StreamId> {
        self.streams.iter().filter(|(_, raw)| raw.owned).map(|(&id, _)| id).collect()
    }

    fn reserve(&mut self, size: u64) -> Result<u64, DeviceError> {
        self.reserve_range(size)
    }

    fn unreserve(&mut self, address: u64) -> Result<(), DeviceError> {
        self.unreserve_range(address)
    }

    fn map(&mut self, address: u64, size: u64, handle: u64) -> Result<(), DeviceError> {
        self.map_range(address, size, handle)
    }

    fn mapping_granularity(&mut self) -> Result<u64, DeviceError> {
        self.page_size()
    }

    fn export_pages(&mut self, address: u64, len: u64) -> Result<ExportedPages, DeviceError> {
        self.export_range(address, len)
    }

    /// CUDA's IPC handle (`cuIpcGetMemHandle`) of the `cuMemAlloc` segment holding `address`,
    /// which another process opens with `cuIpcOpenMemHandle` (as Numba's and PyTorch's IPC do).
    /// Pages of reserved ranges and the driver's stream-ordered pool have no such handle.
    fn ipc_handle(&mut self, address: u64) -> Result<(Vec<u8>, u64), DeviceError> {
        let (&base, _) = self
            .live
            .range(..=address)
            .next_back()
            .filter(|(&base, s)| address < base + s.size && self.mode == Mode::Direct)
            .ok_or(DeviceError::Unsupported(
                "IPC handles for paged or stream-ordered memory (a pool with plain segments, such as \
                 strategy:pytorch, has them)",
            ))?;
        let _current = self.context.enter()?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `base` is a live cuMemAlloc allocation of ours; 64 bytes written.
        check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut handle, base) })?;
        Ok((handle.reserved.iter().map(|&b| b as u8).collect(), address - base))
    }

    fn set_mapping_options(&mut self, options: &MappingOptions) {
        self.mapping_options(options);
    }

    fn unmap(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.unmap_range(address, size)
    }
}

impl Drop for Cuda {
    /// Waits for the context's work (streams imported from PyTorch or CuPy may still be running
    /// kernels on this memory), then returns everything still held. Errors are ignored because
    /// the driver may already be shutting down at process exit, when nothing is left to protect;
    /// if even waiting fails, the memory is left to the driver rather than freed under running
    /// work. So it is during a capture: synchronizing the context would invalidate it (in every
    /// capture mode), and its graph may still use the memory.
    fn drop(&mut self) {
        if self.own_streams_capturing() || self.synchronize_context().is_err() {
            return;
        }
        // Other devices' streams the pool still waits for, each from its own context, which
        // `foreign_contexts` keeps alive. One that cannot be entered all the same is gone, and its
        // work with it: its event is skipped, and our own memory still goes back.
        let foreign: Vec<RawEvent> =
            self.events.values().filter(|e| e.context != self.context.raw()).copied().collect();
        for event in foreign {
            let Ok(_current) = driver::enter(event.context) else { continue };
            // SAFETY: a live event of the current context, then destroyed once.
            if check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event.handle as sys::CUevent) }).is_err() {
                return;
            }
            // SAFETY: as above.
            let _ = unsafe { sys::cuEventDestroy_v2(event.handle as sys::CUevent) };
        }
        self.events.retain(|_, e| e.context == self.context.raw());
        let Ok(_current) = self.context.enter() else { return };
        // After the wait, plain cuMemFree returns stream-ordered memory too, without naming a
        // stream: an imported one may be gone by now.
        for &address in self.live.keys() {
            // SAFETY: live allocations of ours, each freed once, with no work left on them.
            let _ = unsafe { sys::cuMemFree_v2(address) };
        }
        self.reservations.release_all();
        for raw in self.streams.values().filter(|raw| raw.owned) {
            // SAFETY: streams we created and have not destroyed.
            let _ = unsafe { sys::cuStreamDestroy_v2(raw.handle as sys::CUstream) };
        }
        for &raw in self.events.values().map(|e| &e.handle).chain(&self.spare_events) {
            // SAFETY: events we created in our context, each destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(raw as sys::CUevent) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_ordinal;

    #[test]
    fn device_strings() {
        assert_eq!(parse_ordinal("cuda"), Some(Ok(0)));
        assert_eq!(parse_ordinal("cuda:3"), Some(Ok(3)));
        assert!(matches!(parse_ordinal("cuda:x"), Some(Err(_))));
        assert!(matches!(parse_ordinal("cuda:-1"), Some(Err(_))));
        assert!(parse_ordinal("cudax").is_none());
        assert_eq!(parse_ordinal("host"), None);
    }
}
