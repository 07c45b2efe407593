//! The page map of a reserved range: which pages are mapped, and which physical allocation
//! (handle) backs each, so that only whole handles are ever given back.
//!
//! ```text
//!  page      0   1   2   3   4   5   6   7   8
//!  mapped    1   1   1   1   0   0   1   1   0
//!  starts    1   0   1   1   0   0   1   0   0     handles: [0,2) [2,3) [3,4) [6,8)
//! ```
//! A handle begins at a page whose start bit is set and runs to the next start or unmapped page.
//! Invariants (checked by [`PageMap::check`]): start bits lie on mapped pages, and every mapped
//! run begins with one.

use std::ops::Range;

#[derive(Debug)]
pub struct PageMap {
    /// One bit per page: mapped.
    mapped: Vec<u64>,
    /// One bit per page: the first page of a handle.
    starts: Vec<u64>,
}

fn bit(page: u64) -> (usize, u64) {
    ((page / 64) as usize, 1 << (page % 64))
}

impl PageMap {
    pub fn new(pages: u64) -> Self {
        let words = pages.div_ceil(64) as usize;
        PageMap { mapped: vec![0; words], starts: vec![0; words] }
    }

    /// Pages the map can hold (a multiple of 64).
    pub fn len(&self) -> u64 {
        self.mapped.len() as u64 * 64
    }

    pub fn is_mapped(&self, page: u64) -> bool {
        let (word, mask) = bit(page);
        self.mapped[word] & mask != 0
    }

    fn is_start(&self, page: u64) -> bool {
        let (word, mask) = bit(page);
        self.starts[word] & mask != 0
    }

    /// Whether every page in `pages` is mapped, a 64-page word at a time.
    #[inline(always)]
    pub fn all_mapped(&self, pages: Range<u64>) -> bool {
        // Most blocks lie within one word's 64 pages: one mask test.
        if pages.start < pages.end && pages.start / 64 == (pages.end - 1) / 64 {
            let mask = (u64::MAX >> (64 - (pages.end - pages.start))) << (pages.start % 64);
            return self.mapped[(pages.start / 64) as usize] & mask == mask;
        }
        let mut page = pages.start;
        while page < pages.end {
            let (word, bit) = ((page / 64) as usize, page % 64);
            let span = (64 - bit).min(pages.end - page);
            let mask = if span == 64 { u64::MAX } else { ((1u64 << span) - 1) << bit };
            if self.mapped[word] & mask != mask {
                return false;
            }
            page += span;
        }
        true
    }

    /// Pages mapped in all.
    pub fn mapped_pages(&self) -> u64 {
        self.mapped.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Records unmapped `run` as mapped by handles of `handle_pages` pages each.
    pub fn map(&mut self, run: Range<u64>, handle_pages: u64) {
        for page in run.clone() {
            let (word, mask) = bit(page);
            self.mapped[word] |= mask;
            if (page - run.start).is_multiple_of(handle_pages) {
                self.starts[word] |= mask;
            }
        }
    }

    /// Records `handle` (as [`PageMap::handle_at`] gives it) as unmapped.
    pub fn unmap(&mut self, handle: Range<u64>) {
        for page in handle {
            let (word, mask) = bit(page);
            self.mapped[word] &= !mask;
            self.starts[word] &= !mask;
        }
    }

    /// The handle holding mapped `page`: back to its start bit, on to the next start or
    /// unmapped page.
    pub fn handle_at(&self, page: u64) -> Range<u64> {
        let run_end = self.next_in(&self.mapped, page + 1, self.len(), false);
        self.start_at_or_before(page)..self.next_in(&self.starts, page + 1, run_end, true)
    }

    /// The last handle start at or before `page`, a word at a time (a mapped page has one).
    fn start_at_or_before(&self, page: u64) -> u64 {
        let (mut word, bit) = ((page / 64) as usize, page % 64);
        let mut bits = self.starts[word] & (u64::MAX >> (63 - bit));
        while bits == 0 {
            word -= 1;
            bits = self.starts[word];
        }
        word as u64 * 64 + 63 - u64::from(bits.leading_zeros())
    }

    /// The handles lying wholly inside `pages`, in address order.
    pub fn handles_within(&self, pages: Range<u64>) -> Vec<Range<u64>> {
        let mut handles = Vec::new();
        let mut page = self.next_in(&self.starts, pages.start, pages.end, true);
        while page < pages.end {
            let handle = self.handle_at(page);
            if handle.end > pages.end {
                break;
            }
            page = self.next_in(&self.starts, handle.end, pages.end, true);
            handles.push(handle);
        }
        handles
    }

    /// How many of the pages just outside `pages` (before and after) are mapped: 0, 1 or 2.
    pub fn touches_mapped(&self, pages: &Range<u64>) -> i32 {
        let before = pages.start > 0 && self.is_mapped(pages.start - 1);
        let after = pages.end < self.len() && self.is_mapped(pages.end);
        i32::from(before) + i32::from(after)
    }

    /// Maximal runs of pages in `pages` whose mapped state equals `state`, a word at a time.
    pub fn runs(&self, pages: Range<u64>, state: bool) -> Vec<Range<u64>> {
        let mut runs = Vec::new();
        let mut page = self.next_in(&self.mapped, pages.start, pages.end, state);
        while page < pages.end {
            let end = self.next_in(&self.mapped, page, pages.end, !state);
            runs.push(page..end);
            page = self.next_in(&self.mapped, end, pages.end, state);
        }
        runs
    }

    /// The first page from `from` (before `end`, else `end`) whose bit in `bits` is `state`.
    fn next_in(&self, bits: &[u64], from: u64, end: u64, state: bool) -> u64 {
        let mut page = from;
        while page < end {
            let (word, bit) = ((page / 64) as usize, page % 64);
            let word = if state { bits[word] } else { !bits[word] } >> bit;
            if word != 0 {
                return (page + u64::from(word.trailing_zeros())).min(end);
            }
            page += 64 - bit;
        }
        end
    }

    /// Start bits lie on mapped pages, and every mapped run begins with one.
    pub fn check(&self) -> Result<(), String> {
        if let Some(word) = self.starts.iter().zip(&self.mapped).position(|(s, m)| s & !m != 0) {
            return Err(format!("a handle starts on an unmapped page near page {}", word * 64));
        }
        match self.runs(0..self.len(), true).into_iter().find(|run| !self.is_start(run.start)) {
            Some(run) => Err(format!("mapped pages from {} on belong to no handle", run.start)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout drawn at the top of this file.
    fn drawn() -> PageMap {
        let mut map = PageMap::new(9);
        map.map(0..2, 2);
        map.map(2..4, 1);
        map.map(6..8, 2);
        map
    }

    #[test]
    fn handles_are_found_from_any_of_their_pages() {
        let map = drawn();
        map.check().unwrap();
        assert_eq!([0, 1, 2, 3, 6, 7].map(|p| map.handle_at(p)), [0..2, 0..2, 2..3, 3..4, 6..8, 6..8]);
        assert_eq!(map.handles_within(0..9), [0..2, 2..3, 3..4, 6..8]);
        // A handle reaching past the pages, or starting before them, is not inside them.
        assert_eq!(map.handles_within(1..7), [2..3, 3..4]);
        assert_eq!(map.runs(0..9, true), [0..4, 6..8]);
        assert_eq!((map.mapped_pages(), map.touches_mapped(&(4..6))), (6, 2));
    }

    /// `all_mapped` against a page-by-page look, for every range over a map of 3 words with
    /// holes at word edges and inside words.
    #[test]
    fn all_mapped_agrees_with_each_page() {
        let mut map = PageMap::new(192);
        for run in [0..63, 64..130, 131..192] {
            map.map(run, 1);
        }
        for start in 0..192 {
            for end in start..=192 {
                let each = (start..end).all(|p| map.is_mapped(p));
                assert_eq!(map.all_mapped(start..end), each, "pages {start}..{end}");
            }
        }
    }

    #[test]
    fn unmapping_a_handle_clears_it_and_keeps_the_rest_whole() {
        let mut map = drawn();
        map.unmap(2..3);
        map.check().unwrap();
        assert_eq!(map.handles_within(0..9), [0..2, 3..4, 6..8]);
        assert_eq!(map.handle_at(3), 3..4);
        assert!(map.all_mapped(6..8) && !map.all_mapped(1..4));
    }

    #[test]
    fn a_mapped_run_without_a_start_is_reported() {
        let mut map = drawn();
        map.mapped[0] |= 1 << 5;
        assert!(map.check().unwrap_err().contains("no handle"));
        let mut map = drawn();
        map.starts[0] |= 1 << 5;
        assert!(map.check().unwrap_err().contains("unmapped page"));
    }

    /// Handles across word boundaries: the scans go a word at a time.
    #[test]
    fn long_handles_cross_words() {
        let mut map = PageMap::new(300);
        map.map(60..200, 140);
        map.map(200..203, 1);
        assert_eq!(map.handle_at(130), 60..200);
        assert_eq!(map.handles_within(0..300), [60..200, 200..201, 201..202, 202..203]);
        assert_eq!(map.handles_within(61..300), [200..201, 201..202, 202..203]);
    }
}
