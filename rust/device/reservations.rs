//! Address reservations with mapped sub-ranges: the bookkeeping behind `reserve`/`map`/`unmap`
//! shared by the `host` and `sim` backends. Like CUDA, they remember each physical allocation
//! (handle) a map made and take back only whole ones, so a pool that would unmap part of a handle
//! fails here as it would on a GPU.

use super::DeviceError;
use std::collections::BTreeMap;

/// The handles that map `[address, address + size)` in pieces of `handle` bytes, as (address,
/// size): the last one holds the rest when `handle` does not divide `size`.
pub fn handles(address: u64, size: u64, handle: u64) -> impl Iterator<Item = (u64, u64)> {
    let end = address + size;
    (address..end).step_by(handle as usize).map(move |at| (at, handle.min(end - at)))
}

#[derive(Debug, Default)]
struct Reservation {
    size: u64,
    /// Mapped ranges as start -> end, kept merged (no two touch).
    mapped: BTreeMap<u64, u64>,
    /// Every handle mapped, start -> size.
    handles: BTreeMap<u64, u64>,
}

#[derive(Debug, Default)]
pub struct Reservations {
    by_base: BTreeMap<u64, Reservation>,
    /// Bytes mapped over all reservations.
    pub mapped_bytes: u64,
}

impl Reservations {
    pub fn insert(&mut self, base: u64, size: u64) {
        self.by_base.insert(base, Reservation { size, ..Reservation::default() });
    }

    /// Forgets a reservation with nothing mapped; returns its size.
    pub fn remove(&mut self, base: u64) -> Result<u64, DeviceError> {
        match self.by_base.get(&base) {
            Some(r) if r.mapped.is_empty() => Ok(self.by_base.remove(&base).map(|r| r.size).unwrap_or(0)),
            _ => Err(DeviceError::InvalidAddress(base)),
        }
    }

    fn holding(&self, address: u64, size: u64) -> Result<&Reservation, DeviceError> {
        let (&base, r) = self.by_base.range(..=address).next_back().ok_or(DeviceError::InvalidAddress(address))?;
        let end = address.checked_add(size).ok_or(DeviceError::InvalidAddress(address))?;
        if size == 0 || end > base + r.size {
            return Err(DeviceError::InvalidAddress(address));
        }
        Ok(r)
    }

    fn holding_mut(&mut self, address: u64) -> &mut Reservation {
        self.by_base.range_mut(..=address).next_back().map(|(_, r)| r).expect("checked by `holding`")
    }

    /// The mapped range containing `address`, as (start, end).
    fn mapped_around(r: &Reservation, address: u64) -> Option<(u64, u64)> {
        r.mapped.range(..=address).next_back().filter(|(_, &end)| end > address).map(|(&s, &e)| (s, e))
    }

    /// Checks that `[address, address + size)` can be mapped as handles of `handle` bytes (the
    /// last one holding the rest): it lies in one reservation and is unmapped.
    pub fn check_mappable(&self, address: u64, size: u64, handle: u64) -> Result<(), DeviceError> {
        let r = self.holding(address, size)?;
        let overlaps = r.mapped.range(..address + size).next_back().is_some_and(|(_, &end)| end > address);
        if overlaps || handle == 0 {
            return Err(DeviceError::InvalidAddress(address));
        }
        Ok(())
    }

    /// Maps `[address, address + size)` as handles of `handle` bytes (see `check_mappable`).
    pub fn map(&mut self, address: u64, size: u64, handle: u64) -> Result<(), DeviceError> {
        self.check_mappable(address, size, handle)?;
        let r = self.holding_mut(address);
        let (mut start, mut end) = (address, address + size);
        if let Some((s, _)) =
            r.mapped.range(..address).next_back().filter(|(_, &e)| e == address).map(|(&s, &e)| (s, e))
        {
            r.mapped.remove(&s);
            start = s;
        }
        if let Some(e) = r.mapped.remove(&end) {
            end = e;
        }
        r.mapped.insert(start, end);
        r.handles.extend(handles(address, size, handle));
        self.mapped_bytes += size;
        Ok(())
    }

    /// Checks that `[address, address + size)` is mapped.
    pub fn check_mapped(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let (&base, r) = self.by_base.range(..=address).next_back().ok_or(DeviceError::InvalidAddress(address))?;
        match Self::mapped_around(r, address) {
            Some((_, end)) if address >= base && address + size <= end => Ok(()),
            _ => Err(DeviceError::InvalidAddress(address)),
        }
    }

    /// Checks that `[address, address + size)` is exactly a run of whole handles: a device
    /// gives back a physical allocation whole or not at all.
    pub fn check_unmappable(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let r = self.holding(address, size)?;
        let mut at = address;
        for (&start, &len) in r.handles.range(address..address + size) {
            if start != at {
                return Err(DeviceError::InvalidAddress(address));
            }
            at += len;
        }
        if at != address + size {
            return Err(DeviceError::InvalidAddress(address));
        }
        Ok(())
    }

    /// Unmaps whole handles (see `check_unmappable`).
    pub fn unmap(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.check_unmappable(address, size)?;
        let r = self.holding_mut(address);
        let starts: Vec<u64> = r.handles.range(address..address + size).map(|(&s, _)| s).collect();
        for start in starts {
            r.handles.remove(&start);
        }
        let (start, end) = Self::mapped_around(r, address).expect("whole handles are mapped");
        r.mapped.remove(&start);
        if start < address {
            r.mapped.insert(start, address);
        }
        if address + size < end {
            r.mapped.insert(address + size, end);
        }
        self.mapped_bytes -= size;
        Ok(())
    }

    /// Every mapped range, for tearing a device down.
    pub fn all_mapped(&self) -> Vec<(u64, u64)> {
        self.by_base.values().flat_map(|r| r.mapped.iter().map(|(&s, &e)| (s, e - s))).collect()
    }

    pub fn bases(&self) -> Vec<(u64, u64)> {
        self.by_base.iter().map(|(&b, r)| (b, r.size)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn map_unmap_merge_and_split() {
        let mut rs = Reservations::default();
        rs.insert(1 << 30, 64 * MIB);
        let base = 1 << 30;
        rs.map(base, 4 * MIB, 2 * MIB).unwrap();
        rs.map(base + 4 * MIB, 4 * MIB, 2 * MIB).unwrap();
        assert!(rs.map(base + 2 * MIB, 4 * MIB, 2 * MIB).is_err(), "overlap");
        assert!(rs.map(base + 62 * MIB, 4 * MIB, 2 * MIB).is_err(), "past the end");
        rs.check_mapped(base + 3 * MIB, 2 * MIB).unwrap();
        rs.unmap(base + 2 * MIB, 2 * MIB).unwrap();
        assert!(rs.check_mapped(base + MIB, 2 * MIB).is_err());
        assert_eq!(rs.mapped_bytes, 6 * MIB);
        assert!(rs.remove(base).is_err(), "still mapped");
        rs.unmap(base, 2 * MIB).unwrap();
        rs.unmap(base + 4 * MIB, 4 * MIB).unwrap();
        assert_eq!(rs.remove(base).unwrap(), 64 * MIB);
        assert_eq!(rs.mapped_bytes, 0);
    }

    /// A handle goes back whole, as on CUDA: part of one, or a range that starts or ends inside
    /// one, is refused and changes nothing.
    #[test]
    fn only_whole_handles_are_unmapped() {
        let mut rs = Reservations::default();
        let base = 1 << 30;
        rs.insert(base, 64 * MIB);
        assert!(rs.map(base, 6 * MIB, 0).is_err(), "no handle is empty");
        rs.map(base, 12 * MIB, 12 * MIB).unwrap();
        rs.map(base + 12 * MIB, 4 * MIB, 2 * MIB).unwrap();
        // 10 MiB in handles of 4: the last one holds the 2 left.
        rs.map(base + 16 * MIB, 10 * MIB, 4 * MIB).unwrap();
        for (from, len) in [(0, 2), (2, 10), (10, 4), (12, 3), (0, 13), (16, 2), (18, 4), (22, 2), (20, 5)] {
            assert!(rs.unmap(base + from * MIB, len * MIB).is_err(), "{from}+{len} MiB");
        }
        assert_eq!(rs.mapped_bytes, 26 * MIB);
        rs.unmap(base, 14 * MIB).unwrap();
        rs.unmap(base + 14 * MIB, 2 * MIB).unwrap();
        rs.unmap(base + 24 * MIB, 2 * MIB).unwrap();
        rs.unmap(base + 16 * MIB, 8 * MIB).unwrap();
        assert_eq!(rs.mapped_bytes, 0);
    }
}
