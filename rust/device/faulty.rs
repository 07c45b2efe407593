//! `Faulty`: a device adaptor that refuses chosen segment allocations, to exercise OOM paths.

use super::{Device, DeviceError, MemoryInfo};

#[derive(Clone, Debug, PartialEq)]
pub enum FaultPlan {
    /// Refuse the n-th allocation (1-based) and only it.
    Nth(u64),
    /// Refuse each allocation with this probability, from a seeded generator.
    Probability { p: f64, seed: u64 },
}

#[derive(Debug)]
pub struct Faulty<D> {
    inner: D,
    plan: FaultPlan,
    calls: u64,
    rng: u64,
}

impl<D: Device> Faulty<D> {
    pub fn new(inner: D, plan: FaultPlan) -> Self {
        let rng = match plan {
            FaultPlan::Probability { seed, .. } => seed ^ 0x9E37_79B9_7F4A_7C15,
            FaultPlan::Nth(_) => 0,
        };
        Faulty { inner, plan, calls: 0, rng: rng.max(1) }
    }

    /// xorshift64*: a dependency-free generator; quality is ample for fault schedules.
    fn next_unit(&mut self) -> f64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn refuse_this_call(&mut self) -> bool {
        self.calls += 1;
        match self.plan {
            FaultPlan::Nth(n) => self.calls == n,
            FaultPlan::Probability { p, .. } => self.next_unit() < p,
        }
    }
}

impl<D: Device> Device for Faulty<D> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn allocate(&mut self, size: u64) -> Result<u64, DeviceError> {
        if self.refuse_this_call() {
            return Err(DeviceError::OutOfMemory { requested: size });
        }
        self.inner.allocate(size)
    }
    fn allocate_on(&mut self, size: u64, stream: super::StreamId) -> Result<u64, DeviceError> {
        if self.refuse_this_call() {
            return Err(DeviceError::OutOfMemory { requested: size });
        }
        self.inner.allocate_on(size, stream)
    }
    fn release(&mut self, address: u64) -> Result<(), DeviceError> {
        self.inner.release(address)
    }
    fn memory_info(&self) -> MemoryInfo {
        self.inner.memory_info()
    }
    fn host_accessible(&self) -> bool {
        self.inner.host_accessible()
    }
    fn write(&mut self, stream: super::StreamId, address: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.inner.write(stream, address, data)
    }
    fn read(&self, stream: super::StreamId, address: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.inner.read(stream, address, out)
    }
    fn is_capturing(&mut self, stream: super::StreamId) -> Result<bool, DeviceError> {
        self.inner.is_capturing(stream)
    }
    super::forward_streams!(inner);
    fn reserve(&mut self, size: u64) -> Result<u64, DeviceError> {
        self.inner.reserve(size)
    }
    fn unreserve(&mut self, address: u64) -> Result<(), DeviceError> {
        self.inner.unreserve(address)
    }
    /// Mapping pages is how expandable pools obtain memory, so it fails like `allocate`.
    fn map(&mut self, address: u64, size: u64, page: u64) -> Result<(), DeviceError> {
        if self.refuse_this_call() {
            return Err(DeviceError::OutOfMemory { requested: size });
        }
        self.inner.map(address, size, page)
    }
    fn mapping_granularity(&mut self) -> Result<u64, DeviceError> {
        self.inner.mapping_granularity()
    }
    fn ipc_handle(&mut self, address: u64) -> Result<(Vec<u8>, u64), DeviceError> {
        self.inner.ipc_handle(address)
    }
    fn export_pages(&mut self, address: u64, len: u64) -> Result<super::ExportedPages, DeviceError> {
        self.inner.export_pages(address, len)
    }
    fn set_mapping_options(&mut self, options: &super::MappingOptions) {
        self.inner.set_mapping_options(options)
    }
    fn unmap(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.inner.unmap(address, size)
    }
    fn import_stream(&mut self, handle: u64) -> Result<super::StreamId, DeviceError> {
        self.inner.import_stream(handle)
    }
    fn stream_handle(&self, s: super::StreamId) -> Option<u64> {
        self.inner.stream_handle(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Sim;

    #[test]
    fn nth_refuses_exactly_once() {
        let mut dev = Faulty::new(Sim::new(1 << 30), FaultPlan::Nth(2));
        assert!(dev.allocate(1024).is_ok());
        assert!(dev.allocate(1024).is_err());
        assert!(dev.allocate(1024).is_ok());
    }

    #[test]
    fn probability_is_seeded() {
        let outcomes = |seed| {
            let mut dev = Faulty::new(Sim::new(1 << 40), FaultPlan::Probability { p: 0.5, seed });
            (0..64).map(|_| dev.allocate(512).is_ok()).collect::<Vec<_>>()
        };
        assert_eq!(outcomes(7), outcomes(7));
        let refused = outcomes(7).iter().filter(|ok| !**ok).count();
        assert!((16..48).contains(&refused), "refused {refused} of 64");
    }
}
