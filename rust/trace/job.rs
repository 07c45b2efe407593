//! What a job did to its own pool, read from the allocator's segment entries of a snapshot:
//! when it gave cached memory back, why, and how much of the GPU it had.
//!
//! PyTorch's allocator releases segments by its own rules only with garbage collection on; every
//! other `segment_free` (or `segment_unmap`) burst is either the job's `torch.cuda.empty_cache()`
//! or the out-of-memory path, which releases the cache after the device refused a segment and
//! then retries. The two look alike in the history (a burst, then usually a new segment), so
//! a burst counts as the out-of-memory path only where something says the device was full:
//! an `oom` entry follows it, or the retry's segment could not have fit beside what was
//! reserved before the burst (more than the job ever held, or more than the GPU it had).
//! Otherwise it is `empty_cache()`: a user's call to it is the common case, and mistaking one
//! for the out-of-memory path would keep memory in every replay that the job gave back.
//!
//! The GPU's size follows from `oom` entries: each records the device's free bytes when the
//! request failed, after the path's release, so the job could hold at most what it had
//! reserved then plus those bytes; and at least what it held at its peak.

/// One snapshot entry as the classification reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry<'a> {
    pub action: &'a str,
    /// The block's or segment's address; an `oom` entry's device free bytes.
    pub address: u64,
    pub size: u64,
    pub stream: u64,
    /// Nanoseconds since the trace began.
    pub time_ns: u64,
}

/// Why cached memory went back to the device in a burst of segment releases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// The job called `torch.cuda.empty_cache()`.
    EmptyCache,
    /// The allocator's out-of-memory path released the cache before retrying a request.
    OutOfMemory,
}

/// What the job did, by entry index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobRecord {
    /// Each release burst: the index of its first entry, why, and the bytes it released.
    pub releases: Vec<(usize, Release, u64)>,
    /// Bytes reserved before the first entry, from the final reserved bytes with the
    /// history's segment entries undone (never below what the history itself releases).
    pub start_reserved: u64,
    /// Bytes reserved after each entry.
    pub reserved: Vec<u64>,
    /// The most bytes the job could have held on its GPU, from its `oom` entries.
    pub capacity: Option<u64>,
}

fn is_release(action: &str) -> bool {
    matches!(action, "segment_free" | "segment_unmap")
}

/// How an entry changes the reserved bytes.
fn growth(e: &Entry<'_>) -> i128 {
    match e.action {
        "segment_alloc" | "segment_map" => i128::from(e.size),
        "segment_free" | "segment_unmap" => -i128::from(e.size),
        _ => 0,
    }
}

/// PyTorch's small requests (at most 1 MiB) come from 2 MiB segments, the others from larger ones.
const SMALL_REQUEST: u64 = 1 << 20;
const SMALL_SEGMENT: u64 = 2 << 20;

/// Whether a cached segment of `segment` bytes, released whole, could have served `request`
/// bytes on its own: then the allocator would have taken it rather than ask the device.
fn could_serve(segment: u64, request: u64) -> bool {
    let rounded = request.div_ceil(512).max(1) * 512;
    if rounded <= SMALL_REQUEST {
        segment == SMALL_SEGMENT
    } else {
        segment != SMALL_SEGMENT && segment >= rounded
    }
}

/// Reads the job's releases and GPU size from one device's entries, oldest first, given the
/// bytes reserved at the snapshot (`None` when the snapshot lists no segments).
pub fn read(entries: &[Entry<'_>], final_reserved: Option<u64>) -> JobRecord {
    // Reserved bytes after each entry, from a start that keeps them from going negative.
    let mut running = 0i128;
    let mut lowest = 0i128;
    for e in entries {
        running += growth(e);
        lowest = lowest.min(running);
    }
    let from_final = i128::from(final_reserved.unwrap_or(0)) - running;
    let start = from_final.max(-lowest).max(0);
    let mut reserved = Vec::with_capacity(entries.len());
    let mut now = start;
    for e in entries {
        now += growth(e);
        reserved.push(now as u64);
    }
    let held_most = reserved.iter().copied().max().unwrap_or(0).max(start as u64);
    // Never below what the job held at once: other processes' memory may have grown between
    // the job's peak and its error, and a replay on less would fail where the job did not.
    let capacity = entries
        .iter()
        .zip(&reserved)
        .filter(|(e, _)| e.action == "oom")
        .map(|(e, &at)| at.saturating_add(e.address))
        .min()
        .map(|gpu| gpu.max(held_most));
    let mut releases = Vec::new();
    let mut index = 0;
    while index < entries.len() {
        if !is_release(entries[index].action) {
            index += 1;
            continue;
        }
        let first = index;
        while index < entries.len() && is_release(entries[index].action) {
            index += 1;
        }
        let burst = &entries[first..index];
        let before = if first == 0 { start as u64 } else { reserved[first - 1] };
        let why = if device_was_full(burst, &entries[index..], before, held_most, capacity) {
            Release::OutOfMemory
        } else {
            Release::EmptyCache
        };
        releases.push((first, why, burst.iter().map(|e| e.size).sum()));
    }
    JobRecord { releases, start_reserved: start as u64, reserved, capacity }
}

/// Whether a release `burst` with `before` bytes reserved was the out-of-memory path, from the
/// entries `after` it: an `oom` comes before the next allocation, or the next allocation
/// needed new memory (a segment, or pages mapped in one or more runs) that no released segment
/// could have spared it, and that memory beside `before` is more than the job ever held and
/// than the GPU it had.
fn device_was_full(burst: &[Entry<'_>], after: &[Entry<'_>], before: u64, held_most: u64, gpu: Option<u64>) -> bool {
    let mut grown = None;
    for e in after.iter().filter(|e| e.action != "free_requested" && e.action != "snapshot") {
        match e.action {
            "oom" => return true,
            // An expandable segment may map a request's pages in several runs.
            "segment_alloc" if grown.is_none() => grown = Some(e.size),
            "segment_map" => grown = Some(grown.unwrap_or(0) + e.size),
            "alloc" => {
                let Some(segment) = grown else { return false };
                let needed = before.saturating_add(segment);
                let cached = burst.iter().any(|r| r.stream == e.stream && could_serve(r.size, e.size));
                return !cached && needed > held_most && gpu.is_none_or(|gpu| needed > gpu);
            }
            _ => return false,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn entry(action: &str, address: u64, size: u64) -> Entry<'_> {
        Entry { action, address, size, stream: 0, time_ns: 0 }
    }

    #[test]
    fn a_burst_then_an_oom_is_the_out_of_memory_path_and_gives_the_gpu_size() {
        let entries = |device_free| {
            [
                entry("segment_alloc", 0x1000, 20 * MIB),
                entry("alloc", 0x1000, 6 * MIB),
                entry("segment_alloc", 0x9000, 40 * MIB),
                entry("segment_free", 0x9000, 40 * MIB),
                entry("oom", device_free, 50 * MIB),
            ]
        };
        let record = read(&entries(45 * MIB), Some(20 * MIB));
        assert_eq!(record.releases, [(3, Release::OutOfMemory, 40 * MIB)]);
        assert_eq!(record.start_reserved, 0);
        assert_eq!(record.reserved, [20, 20, 60, 20, 20].map(|mib| mib * MIB));
        assert_eq!(record.capacity, Some(65 * MIB), "20 MiB reserved at the oom plus 45 MiB free");
        // Less free than the job held before: something else took memory; the job had its peak.
        assert_eq!(read(&entries(5 * MIB), Some(20 * MIB)).capacity, Some(60 * MIB));
    }

    /// After the burst a new segment serves a request that a released segment could have
    /// served: the allocator would have used that one, so the device was not full.
    #[test]
    fn a_burst_whose_segments_could_serve_the_next_request_is_empty_cache() {
        let entries = [
            entry("segment_free", 0x9000, 40 * MIB),
            entry("segment_alloc", 0x1000, 20 * MIB),
            entry("alloc", 0x1000, 6 * MIB),
        ];
        let record = read(&entries, Some(20 * MIB));
        assert_eq!(record.releases, [(0, Release::EmptyCache, 40 * MIB)]);
        assert_eq!(record.start_reserved, 40 * MIB);
    }

    /// A 2 MiB segment serves small requests only; a retry that needs more than the job ever
    /// held is the out-of-memory path; one that fits under a level the job reached later is not.
    #[test]
    fn a_retry_beyond_everything_the_job_held_is_the_out_of_memory_path() {
        let retry = |later: u64| {
            let mut entries = vec![
                entry("segment_free", 0x9000, 2 * MIB),
                entry("segment_alloc", 0x1000, 20 * MIB),
                entry("alloc", 0x1000, 6 * MIB),
            ];
            if later > 0 {
                entries.push(entry("segment_alloc", 0x5000, later));
            }
            read(&entries, None).releases[0].1
        };
        // Start: 2 MiB (the burst's). Before the burst 2 MiB, with the retry 22 MiB.
        assert_eq!(retry(0), Release::OutOfMemory);
        assert_eq!(retry(MIB), Release::OutOfMemory, "the job later held 21 MiB: still less than 22");
        assert_eq!(retry(2 * MIB), Release::EmptyCache, "the job later held 22 MiB: the device had room");
    }

    /// With the GPU's size known, a retry that fits on it was no out-of-memory path.
    #[test]
    fn a_retry_that_fits_the_known_gpu_is_empty_cache() {
        let entries = |device_free| {
            [
                entry("segment_free", 0x9000, 2 * MIB),
                entry("segment_alloc", 0x1000, 20 * MIB),
                entry("alloc", 0x1000, 6 * MIB),
                entry("oom", device_free, 64 * MIB),
            ]
        };
        // Reserved at the oom: 20 MiB.
        assert_eq!(read(&entries(MIB), Some(20 * MIB)).releases[0].1, Release::OutOfMemory);
        assert_eq!(read(&entries(3 * MIB), Some(20 * MIB)).releases[0].1, Release::EmptyCache);
    }

    /// An expandable segment's retry maps its pages in two runs: together they did not fit.
    #[test]
    fn a_retry_mapped_in_several_runs_counts_them_all() {
        let entries = [
            entry("segment_map", 0x1000, 40 * MIB),
            entry("segment_unmap", 0x1000, 20 * MIB),
            entry("segment_map", 0x9000, 20 * MIB),
            entry("segment_map", 0xb000, 20 * MIB),
            entry("alloc", 0x9000, 30 * MIB),
        ];
        // Before the burst 40 MiB; the retry maps 40 more: 80 MiB, more than the job ever held.
        assert_eq!(read(&entries, None).releases, [(1, Release::OutOfMemory, 20 * MIB)]);
    }

    #[test]
    fn a_burst_followed_by_a_free_or_a_cached_allocation_is_empty_cache() {
        for next in ["free_completed", "alloc"] {
            let entries = [entry("segment_free", 0x9000, 20 * MIB), entry(next, 0x1000, MIB)];
            assert_eq!(read(&entries, Some(0)).releases, [(0, Release::EmptyCache, 20 * MIB)], "{next}");
        }
        assert_eq!(read(&[entry("segment_unmap", 0x9000, 20 * MIB)], None).releases[0].1, Release::EmptyCache);
    }

    /// Final segments that contradict the history (fewer than it releases) still give a start
    /// from which reserved bytes never go negative.
    #[test]
    fn the_start_never_goes_below_what_the_history_releases() {
        let entries = [entry("segment_free", 0x9000, 20 * MIB), entry("segment_alloc", 0x1000, 2 * MIB)];
        assert_eq!(read(&entries, Some(0)).start_reserved, 20 * MIB);
        assert_eq!(read(&entries, Some(50 * MIB)).start_reserved, 68 * MIB);
    }
}
