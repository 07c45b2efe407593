//! Driver calls counted by kind, as the CUDA backend makes them for what the pool asks of its
//! device. Counted from the pool's own segment and page bookkeeping, not by the CUDA backend, so
//! a replay on `sim` or `host` counts what a GPU would have been asked.

/// One counter per kind of driver call.
///
/// | pool operation | calls |
/// |---|---|
/// | obtain / return a plain segment | `malloc` (`cuMemAlloc` or `cuMemAllocAsync`) / `free` |
/// | reserve / give back an address range | `reserve` / `unreserve` (`cuMemAddressReserve` / `Free`) |
/// | map a run backed by n handles (physical allocations) | n `create`, n `map`, one `set_access`, n `release` |
/// | unmap one handle | one `unmap` (it was released when it was mapped) |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverCalls {
    pub malloc: u64,
    pub free: u64,
    pub reserve: u64,
    pub unreserve: u64,
    pub create: u64,
    pub map: u64,
    pub set_access: u64,
    pub unmap: u64,
    pub release: u64,
}

impl DriverCalls {
    /// A run backed by `handles` physical allocations mapped in one go.
    pub fn mapped_run(&mut self, handles: u64) {
        self.create += handles;
        self.map += handles;
        self.set_access += 1;
        self.release += handles;
    }

    pub fn total(&self) -> u64 {
        self.entries().iter().map(|(_, n)| n).sum()
    }

    /// Each kind under its name.
    pub fn entries(&self) -> [(&'static str, u64); 9] {
        [
            ("malloc", self.malloc),
            ("free", self.free),
            ("reserve", self.reserve),
            ("unreserve", self.unreserve),
            ("create", self.create),
            ("map", self.map),
            ("set_access", self.set_access),
            ("unmap", self.unmap),
            ("release", self.release),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::DriverCalls;

    #[test]
    fn a_run_costs_three_calls_a_page_and_one_access() {
        let mut calls = DriverCalls::default();
        calls.mapped_run(10);
        calls.unmap += 10;
        assert_eq!((calls.create, calls.map, calls.set_access, calls.release), (10, 10, 1, 10));
        assert_eq!(calls.total(), 41);
    }
}
