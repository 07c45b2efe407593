//! `cuda:N`: device memory from the CUDA driver, loaded at run time (feature `cuda`).
//!
//! Segments come from `cuMemAlloc` ([`Mode::Direct`]) or from the driver's own stream-ordered
//! pool, `cuMemAllocAsync` on the legacy default stream ([`Mode::Async`]: PyTorch's
//! `backend:cudaMallocAsync`, and a baseline for benchmarks). Streams and events are real driver objects behind the trait's numbering: stream
//! [`DEFAULT_STREAM`] is the legacy default stream (handle 0), streams made here are created with
//! default flags, and streams imported by handle (`torch.cuda.current_stream().cuda_stream`) are
//! used but never destroyed. Reserved address ranges mapped page by page (`reserve`, `map`) live
//! in [`vmm`].
//!
//! Every driver call binds the device's primary context to the calling thread first, and no
//! path can panic: [`driver::probe`] checks the library and its symbols before the first call.

pub mod driver;
pub mod vmm;

use super::{check_capacity, Device, DeviceError, EventId, MemoryInfo, StreamId, DEFAULT_STREAM};
use cudarc::driver::sys;
use driver::{check, check_alloc, check_ready, Context};
use std::collections::{BTreeMap, HashMap};

/// How segments are obtained from the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `cuMemAlloc` / `cuMemFree`: every segment is a synchronous driver allocation.
    Direct,
    /// `cuMemAllocAsync` / `cuMemFreeAsync` on the legacy default stream: the driver's pool.
    Async,
}

/// A stream as the driver knows it.
#[derive(Clone, Copy, Debug)]
struct RawStream {
    handle: u64,
    /// Created here (and destroyed here), as opposed to imported.
    owned: bool,
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
    /// Live segments: address -> size, ordered so copies find the segment holding a range.
    live: BTreeMap<u64, u64>,
    streams: HashMap<StreamId, RawStream>,
    next_stream: StreamId,
    events: HashMap<EventId, u64>,
    /// Destroyed events kept for reuse: creating one costs a driver call, recording none.
    spare_events: Vec<u64>,
    next_event: EventId,
    reservations: vmm::Reservations,
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

impl Cuda {
    /// Opens `cuda:ordinal`; `capacity` caps what this device hands out, below the card's size.
    pub fn open(ordinal: i32, mode: Mode, capacity: Option<u64>) -> Result<Self, DeviceError> {
        if mode == Mode::Async {
            driver::require_symbols(driver::ASYNC_SYMBOLS, "cuda async mode")?;
        }
        let context = Context::retain(ordinal)?;
        context.bind()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: the context is current; both pointers are valid for one write.
        check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        let mut streams = HashMap::new();
        streams.insert(DEFAULT_STREAM, RawStream { handle: 0, owned: false });
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
        })
    }

    pub fn ordinal(&self) -> i32 {
        self.context.ordinal()
    }

    fn stream(&self, stream: StreamId) -> Result<sys::CUstream, DeviceError> {
        let raw = self.streams.get(&stream).ok_or(DeviceError::InvalidStream(stream))?;
        Ok(raw.handle as sys::CUstream)
    }

    fn event(&self, event: EventId) -> Result<sys::CUevent, DeviceError> {
        self.events.get(&event).map(|&e| e as sys::CUevent).ok_or(DeviceError::InvalidEvent(event))
    }

    /// Checks that `[address, address + len)` lies in one live segment or one mapped range.
    fn check_range(&self, address: u64, len: usize) -> Result<(), DeviceError> {
        let end = address.checked_add(len as u64).ok_or(DeviceError::InvalidAddress(address))?;
        let in_segment = self.live.range(..=address).next_back().is_some_and(|(&base, &size)| end <= base + size);
        if in_segment || self.reservations.is_mapped(address, end) {
            Ok(())
        } else {
            Err(DeviceError::InvalidAddress(address))
        }
    }

    fn free_segment(&self, address: u64) -> Result<(), DeviceError> {
        match self.mode {
            // SAFETY: `address` is a live allocation of ours, freed once (callers remove it first).
            Mode::Direct => check("cuMemFree", unsafe { sys::cuMemFree_v2(address) }),
            // SAFETY: as above; freed on the legacy default stream, where it was allocated.
            Mode::Async => check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(address, std::ptr::null_mut()) }),
        }
    }
}

impl Device for Cuda {
    fn name(&self) -> &str {
        &self.name
    }

    fn allocate(&mut self, size: u64) -> Result<u64, DeviceError> {
        check_capacity(self.capacity, self.held, size)?;
        let bytes = usize::try_from(size.max(1)).map_err(|_| DeviceError::OutOfMemory { requested: size })?;
        self.context.bind()?;
        let mut address = 0;
        match self.mode {
            // SAFETY: the context is current; the pointer is valid for one write.
            Mode::Direct => check_alloc("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut address, bytes) }, size)?,
            Mode::Async => check_alloc(
                "cuMemAllocAsync",
                // SAFETY: as above; the symbol exists (checked when the device opened).
                unsafe { sys::cuMemAllocAsync(&mut address, bytes, std::ptr::null_mut()) },
                size,
            )?,
        }
        self.live.insert(address, size);
        self.held += size;
        Ok(address)
    }

    fn release(&mut self, address: u64) -> Result<(), DeviceError> {
        let size = *self.live.get(&address).ok_or(DeviceError::InvalidAddress(address))?;
        self.context.bind()?;
        self.free_segment(address)?;
        self.live.remove(&address);
        self.held -= size;
        Ok(())
    }

    fn memory_info(&self) -> MemoryInfo {
        MemoryInfo { total: Some(self.capacity.map_or(self.total, |cap| cap.min(self.total))), held: self.held }
    }

    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.check_range(address, data.len())?;
        self.context.bind()?;
        // SAFETY: the destination lies in live device memory of ours (checked above) and the
        // source is a valid host slice; the copy completes before the call returns.
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(address, data.as_ptr().cast(), data.len()) })
    }

    fn read(&self, address: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.check_range(address, out.len())?;
        self.context.bind()?;
        // SAFETY: the source lies in live device memory of ours (checked above) and the
        // destination is a valid, exclusively borrowed host slice.
        check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), address, out.len()) })
    }

    fn create_stream(&mut self) -> Result<StreamId, DeviceError> {
        self.context.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the context is current; flags 0 = a stream that synchronizes with the legacy
        // default stream, so copies on it see the stream's work finished.
        check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut raw, 0) })?;
        let id = self.next_stream;
        self.next_stream += 1;
        self.streams.insert(id, RawStream { handle: raw as u64, owned: true });
        Ok(id)
    }

    fn destroy_stream(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        if stream == DEFAULT_STREAM {
            return Err(DeviceError::InvalidStream(stream));
        }
        let raw = *self.streams.get(&stream).ok_or(DeviceError::InvalidStream(stream))?;
        if raw.owned {
            self.context.bind()?;
            // SAFETY: a stream we created and have not destroyed; pending work still completes.
            check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(raw.handle as sys::CUstream) })?;
        }
        self.streams.remove(&stream);
        Ok(())
    }

    fn query_stream(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        let raw = self.stream(stream)?;
        self.context.bind()?;
        // SAFETY: a live stream of this context.
        check_ready("cuStreamQuery", unsafe { sys::cuStreamQuery(raw) })
    }

    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        let raw = self.stream(stream)?;
        self.context.bind()?;
        // SAFETY: a live stream of this context.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(raw) })
    }

    fn synchronize_device(&mut self) -> Result<(), DeviceError> {
        self.context.bind()?;
        // SAFETY: the context is current on this thread.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DeviceError> {
        let raw_stream = self.stream(stream)?;
        self.context.bind()?;
        let raw = match self.spare_events.pop() {
            Some(raw) => raw as sys::CUevent,
            None => {
                let mut raw = std::ptr::null_mut();
                // SAFETY: the context is current; timing is off, which makes events cheaper.
                check("cuEventCreate", unsafe { sys::cuEventCreate(&mut raw, 2) })?;
                raw
            }
        };
        // SAFETY: a live event and a live stream of this context.
        if let Err(e) = check("cuEventRecord", unsafe { sys::cuEventRecord(raw, raw_stream) }) {
            self.spare_events.push(raw as u64);
            return Err(e);
        }
        let id = self.next_event;
        self.next_event += 1;
        self.events.insert(id, raw as u64);
        Ok(id)
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, DeviceError> {
        let raw = self.event(event)?;
        self.context.bind()?;
        // SAFETY: a live event of this context.
        check_ready("cuEventQuery", unsafe { sys::cuEventQuery(raw) })
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        let raw = self.event(event)?;
        self.context.bind()?;
        // SAFETY: a live event of this context.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(raw) })
    }

    /// The event goes to the spare list: re-recording it later is allowed even while streams
    /// still wait on this recording, because a wait captures the recording it saw.
    fn destroy_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        let raw = self.events.remove(&event).ok_or(DeviceError::InvalidEvent(event))?;
        self.spare_events.push(raw);
        Ok(())
    }

    fn stream_wait_event(&mut self, stream: StreamId, event: EventId) -> Result<(), DeviceError> {
        let (raw_stream, raw_event) = (self.stream(stream)?, self.event(event)?);
        self.context.bind()?;
        // SAFETY: a live stream and a live event of this context.
        check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(raw_stream, raw_event, 0) })
    }

    /// Handle 0, the legacy default stream, is [`DEFAULT_STREAM`]; any other import gets an id
    /// of its own, which `destroy_stream` forgets without destroying the driver's stream.
    fn import_stream(&mut self, handle: u64) -> Result<StreamId, DeviceError> {
        if handle == 0 {
            return Ok(DEFAULT_STREAM);
        }
        let id = self.next_stream;
        self.next_stream += 1;
        self.streams.insert(id, RawStream { handle, owned: false });
        Ok(id)
    }

    fn stream_handle(&self, stream: StreamId) -> Option<u64> {
        self.streams.get(&stream).map(|raw| raw.handle)
    }

    fn reserve(&mut self, size: u64) -> Result<u64, DeviceError> {
        self.reserve_range(size)
    }

    fn unreserve(&mut self, address: u64) -> Result<(), DeviceError> {
        self.unreserve_range(address)
    }

    fn map(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.map_range(address, size)
    }

    fn unmap(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.unmap_range(address, size)
    }
}

impl Drop for Cuda {
    /// Returns everything still held; errors are ignored because the driver may already be
    /// shutting down at process exit, when nothing is left to protect.
    fn drop(&mut self) {
        if self.context.bind().is_err() {
            return;
        }
        for &address in self.live.keys() {
            let _ = self.free_segment(address);
        }
        self.reservations.release_all();
        for raw in self.streams.values().filter(|raw| raw.owned) {
            // SAFETY: streams we created and have not destroyed.
            let _ = unsafe { sys::cuStreamDestroy_v2(raw.handle as sys::CUstream) };
        }
        for &raw in self.events.values().chain(&self.spare_events) {
            // SAFETY: events we created, each destroyed once.
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
