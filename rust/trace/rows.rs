//! The walks `gpupool advise` makes over a whole snapshot history (a million rows and more), in
//! Rust because in Python each took seconds: which addresses the history touches first, and
//! which blocks were live at its peak.

use rustc_hash::{FxHashMap, FxHashSet};

/// What a history row does to the block at its address; segment events, failures and markers
/// do nothing to one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockAction {
    Alloc,
    FreeCompleted,
    None,
}

/// One row of a snapshot history, as the walks read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub action: BlockAction,
    pub address: u64,
    pub size: u64,
}

/// A block live at the peak: `row` is the index of the alloc that made it, `None` for a block
/// live before the first row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    pub row: Option<usize>,
    pub address: u64,
    pub size: u64,
}

/// The index of each address's first block row (an alloc or a completed free), in the order
/// the addresses first appear.
pub fn first_block_rows(rows: &[Row]) -> Vec<usize> {
    let mut seen = FxHashSet::default();
    let mut first = |r: &Row| r.action != BlockAction::None && seen.insert(r.address);
    rows.iter().enumerate().filter(|(_, r)| first(r)).map(|(index, _)| index).collect()
}

/// The blocks live just after the row at which the requested bytes live first reached their
/// highest (before the first row when no row raises them), sorted by address. `start` are the
/// blocks live before the first row as `(address, size)`.
///
/// Blocks are kept by address: an alloc at a live address replaces the block there, a free of
/// an address that is not live frees nothing, and the count is always what the live blocks add
/// up to (a free of a `start` block lowers it too).
pub fn live_at_peak(rows: &[Row], start: &[(u64, u64)]) -> Vec<LiveBlock> {
    let mut live: FxHashMap<u64, (Option<usize>, u64)> =
        start.iter().map(|&(address, size)| (address, (None, size))).collect();
    let mut sizes: FxHashMap<u64, u64> = live.iter().map(|(&address, &(_, size))| (address, size)).collect();
    // In u128: a million sizes below 2**64 can add up past it.
    let mut count: u128 = sizes.values().map(|&size| u128::from(size)).sum();
    let (mut highest, mut peak_rows) = (count, 0);
    for (index, r) in rows.iter().enumerate() {
        match r.action {
            BlockAction::Alloc => {
                let replaced = sizes.insert(r.address, r.size).unwrap_or(0);
                count = count - u128::from(replaced) + u128::from(r.size);
                if count > highest {
                    (highest, peak_rows) = (count, index + 1);
                }
            }
            BlockAction::FreeCompleted => count -= u128::from(sizes.remove(&r.address).unwrap_or(0)),
            BlockAction::None => {}
        }
    }
    for (index, r) in rows[..peak_rows].iter().enumerate() {
        match r.action {
            BlockAction::Alloc => _ = live.insert(r.address, (Some(index), r.size)),
            BlockAction::FreeCompleted => _ = live.remove(&r.address),
            BlockAction::None => {}
        }
    }
    let mut blocks: Vec<LiveBlock> =
        live.into_iter().map(|(address, (row, size))| LiveBlock { row, address, size }).collect();
    blocks.sort_unstable_by_key(|b| b.address);
    blocks
}

#[cfg(test)]
mod tests {
    use super::BlockAction::{Alloc, FreeCompleted, None as Segment};
    use super::*;

    fn row(action: BlockAction, address: u64, size: u64) -> Row {
        Row { action, address, size }
    }

    fn block(row: Option<usize>, address: u64, size: u64) -> LiveBlock {
        LiveBlock { row, address, size }
    }

    #[test]
    fn the_first_block_row_of_each_address_in_order() {
        let rows = [
            row(Segment, 0x100, 64),
            row(FreeCompleted, 0x200, 8),
            row(Alloc, 0x100, 8),
            row(Alloc, 0x200, 8),
            row(FreeCompleted, 0x100, 8),
            row(Alloc, 0x300, 8),
        ];
        assert_eq!(first_block_rows(&rows), [1, 2, 5]);
        assert!(first_block_rows(&[]).is_empty());
    }

    #[test]
    fn live_at_peak_is_what_was_live_the_first_time_the_most_was() {
        let rows = [
            row(Alloc, 0x200, 20),
            row(Segment, 0x1000, 1 << 20),
            row(Alloc, 0x300, 30),
            row(FreeCompleted, 0x200, 20),
            row(Alloc, 0x400, 20),
            // As many bytes as the peak, not more: the peak stays where it was first reached.
            row(FreeCompleted, 0x400, 20),
            row(Alloc, 0x500, 20),
        ];
        let start = [(0x100, 10)];
        assert_eq!(
            live_at_peak(&rows, &start),
            [block(None, 0x100, 10), block(Some(0), 0x200, 20), block(Some(2), 0x300, 30)]
        );
        // No row raises the count above the start's: the start is the peak.
        assert_eq!(live_at_peak(&rows[3..4], &start), [block(None, 0x100, 10)]);
        assert!(live_at_peak(&[], &[]).is_empty());
    }

    #[test]
    fn a_free_of_a_start_block_lowers_the_count() {
        // 100 at the start, 0 after its free, 60 after the alloc: the start is the peak.
        let rows = [row(FreeCompleted, 0x100, 100), row(Alloc, 0x200, 60)];
        assert_eq!(live_at_peak(&rows, &[(0x100, 100)]), [block(None, 0x100, 100)]);
        // 100, 0, then 160 live: the peak is the end.
        let rows = [row(FreeCompleted, 0x100, 100), row(Alloc, 0x200, 60), row(Alloc, 0x300, 100)];
        assert_eq!(live_at_peak(&rows, &[(0x100, 100)]), [block(Some(1), 0x200, 60), block(Some(2), 0x300, 100)]);
    }

    #[test]
    fn blocks_are_kept_by_address() {
        // A second alloc at a live address replaces the block there (its count too); a free of
        // an address that is not live frees nothing; null addresses count like any other.
        let rows = [row(Alloc, 0, 5), row(Alloc, 0, 7), row(FreeCompleted, 0x900, 1), row(Alloc, 0x10, 1)];
        assert_eq!(live_at_peak(&rows, &[]), [block(Some(1), 0, 7), block(Some(3), 0x10, 1)]);
        // 9 bytes, then 2 where the 9 were: the first alloc alone is the peak.
        let rows = [row(Alloc, 0x10, 9), row(Alloc, 0x10, 2), row(Alloc, 0x20, 3)];
        assert_eq!(live_at_peak(&rows, &[]), [block(Some(0), 0x10, 9)]);
    }
}
