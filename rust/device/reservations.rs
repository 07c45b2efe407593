//! Address reservations with mapped sub-ranges: the bookkeeping behind `reserve`/`map`/`unmap`
//! shared by the `host` and `sim` backends.

use super::DeviceError;
use std::collections::BTreeMap;

#[derive(Debug, Default)]
struct Reservation {
    size: u64,
    /// Mapped ranges as start -> end, kept merged (no two touch).
    mapped: BTreeMap<u64, u64>,
}

#[derive(Debug, Default)]
pub struct Reservations {
    by_base: BTreeMap<u64, Reservation>,
    /// Bytes mapped over all reservations.
    pub mapped_bytes: u64,
}

impl Reservations {
    pub fn insert(&mut self, base: u64, size: u64) {
        self.by_base.insert(base, Reservation { size, mapped: BTreeMap::new() });
    }

    /// Forgets a reservation with nothing mapped; returns its size.
    pub fn remove(&mut self, base: u64) -> Result<u64, DeviceError> {
        match self.by_base.get(&base) {
            Some(r) if r.mapped.is_empty() => Ok(self.by_base.remove(&base).map(|r| r.size).unwrap_or(0)),
            _ => Err(DeviceError::InvalidAddress(base)),
        }
    }

    fn holding(&mut self, address: u64, size: u64) -> Result<&mut Reservation, DeviceError> {
        let (&base, r) = self.by_base.range_mut(..=address).next_back().ok_or(DeviceError::InvalidAddress(address))?;
        let end = address.checked_add(size).ok_or(DeviceError::InvalidAddress(address))?;
        if size == 0 || end > base + r.size {
            return Err(DeviceError::InvalidAddress(address));
        }
        Ok(r)
    }

    /// The mapped range containing `address`, as (start, end).
    fn mapped_around(r: &Reservation, address: u64) -> Option<(u64, u64)> {
        r.mapped.range(..=address).next_back().filter(|(_, &end)| end > address).map(|(&s, &e)| (s, e))
    }

    /// Checks that `[address, address + size)` lies in one reservation and is unmapped.
    pub fn check_unmapped(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        let r = self.holding(address, size)?;
        let overlaps = r.mapped.range(..address + size).next_back().is_some_and(|(_, &end)| end > address);
        if overlaps {
            return Err(DeviceError::InvalidAddress(address));
        }
        Ok(())
    }

    pub fn map(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.check_unmapped(address, size)?;
        let r = self.holding(address, size)?;
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

    pub fn unmap(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.check_mapped(address, size)?;
        let r = self.holding(address, size)?;
        let (start, end) = Self::mapped_around(r, address).ok_or(DeviceError::InvalidAddress(address))?;
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

    #[test]
    fn map_unmap_merge_and_split() {
        let mut rs = Reservations::default();
        rs.insert(1 << 30, 64 << 20);
        let base = 1 << 30;
        rs.map(base, 4 << 20).unwrap();
        rs.map(base + (4 << 20), 4 << 20).unwrap();
        assert!(rs.map(base + (2 << 20), 4 << 20).is_err(), "overlap");
        assert!(rs.map(base + (62 << 20), 4 << 20).is_err(), "past the end");
        rs.check_mapped(base + (3 << 20), 2 << 20).unwrap();
        rs.unmap(base + (2 << 20), 2 << 20).unwrap();
        assert!(rs.check_mapped(base + (1 << 20), 2 << 20).is_err());
        assert_eq!(rs.mapped_bytes, 6 << 20);
        assert!(rs.remove(base).is_err(), "still mapped");
        rs.unmap(base, 2 << 20).unwrap();
        rs.unmap(base + (4 << 20), 4 << 20).unwrap();
        assert_eq!(rs.remove(base).unwrap(), 64 << 20);
        assert_eq!(rs.mapped_bytes, 0);
    }
}
