//! The grammar (PyTorch's: spaces ignored, items split at commas outside brackets) and what
//! each key accepts; then the keys resolved into a [`Config`], in any order.

use super::policy::{self, Paging, PAGES_LADDER, PYTORCH_LADDER};
use super::{Backend, Config, ConfigError, CrossStreamReuse, Strategy};
use super::{DEFAULT_ARENA_MB, DEFAULT_PAGE_MB, MIB, MIN_SPLIT_LIMIT_MB};
use crate::core::{Rules, POWER2_INTERVALS};
use crate::device::MappingOptions;
use std::num::IntErrorKind;

/// Every key, for the message naming an unknown one.
const KNOWN_KEYS: &str = "strategy, backend, max_split_size_mb, max_non_split_rounding_mb, \
    roundup_power2_divisions, garbage_collection_threshold, expandable_segments, \
    per_process_memory_fraction, large_segment_size_mb, release_threshold, initial_pool_size_mb, \
    page_size_mb, cross_stream_reuse, shareable_handle, peer_access, rules_off, and PyTorch's keys that do not \
    affect device memory (release_lock_on_cudamalloc, pinned_*, graph_capture_record_stream_reuse, \
    throw_on_cudamalloc_oom, expandable_segments_reserve, expandable_segments_reserve_by_class)";

/// Megabyte counts stay far from overflowing when multiplied out.
const MAX_MB: u64 = 1 << 40;
/// PyTorch's expandable segments map the large pool in handles of `kLargeBuffer`.
const HANDLE_LARGE_MB: u64 = 20;

/// PyTorch's keys that shape nothing gpupool simulates: its pinned host-memory allocator, CUDA
/// graph capture, the lock it drops around `cudaMalloc`, the virtual address space reserved
/// for expandable segments, and `throw_on_cudamalloc_oom` (a request beyond the memory fraction
/// fails before the driver is called, which gpupool's limit always does). Accepted, validated
/// as PyTorch does, and listed in [`Config::inert`].
pub const NO_DEVICE_MEMORY_EFFECT: [&str; 14] = [
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_cached_size_mb",
    "pinned_max_round_threshold_mb",
    "pinned_free_catch_all",
    "graph_capture_record_stream_reuse",
    "throw_on_cudamalloc_oom",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
];
/// PyTorch's cap on `pinned_num_register_threads`.
const MAX_REGISTER_THREADS: u64 = 128;

/// The `(key, value)` items of a config string.
pub(super) fn items(text: &str) -> Result<Vec<(String, String)>, ConfigError> {
    let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let mut pieces = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (i, c) in compact.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth = depth.checked_sub(1).ok_or_else(|| ConfigError(format!("unbalanced ']' in config '{text}'")))?
            }
            ',' if depth == 0 => {
                pieces.push(&compact[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(ConfigError(format!("unclosed '[' in config '{text}'")));
    }
    pieces.push(&compact[start..]);
    pieces
        .into_iter()
        .filter(|item| !item.is_empty())
        .map(|item| match item.split_once(':') {
            Some((key, value)) if !key.is_empty() && !value.is_empty() => Ok((key.to_string(), value.to_string())),
            Some((key, _)) if !key.is_empty() => Err(ConfigError(format!("config key '{key}' needs a value"))),
            _ => Err(ConfigError(format!("config item '{item}' is not key:value"))),
        })
        .collect()
}

/// The keys a string set, before they are resolved against each other.
#[derive(Default)]
pub(super) struct Keys {
    strategy: Option<Strategy>,
    backend: Option<Backend>,
    expandable_segments: Option<bool>,
    /// Bytes (`max_split_size_mb` and `max_non_split_rounding_mb` as PyTorch multiplies them out).
    max_split_size: Option<u64>,
    max_non_split_rounding: Option<u64>,
    power2_divisions: Option<[u64; POWER2_INTERVALS]>,
    large_segment_size_mb: Option<u64>,
    garbage_collection_threshold: Option<f64>,
    per_process_memory_fraction: Option<f64>,
    release_lock_on_cudamalloc: bool,
    release_threshold: Option<f64>,
    initial_pool_size_mb: Option<u64>,
    page_size_mb: Option<u64>,
    cross_stream_reuse: Option<CrossStreamReuse>,
    mapping: MappingOptions,
    /// `rules_off`'s names, as given.
    rules_off: Vec<&'static str>,
    /// Keys set that do not affect device memory, in the order first given.
    inert: Vec<&'static str>,
}

impl Keys {
    fn note_inert(&mut self, key: &str) {
        if let Some(&name) = NO_DEVICE_MEMORY_EFFECT.iter().find(|&&k| k == key) {
            if !self.inert.contains(&name) {
                self.inert.push(name);
            }
        }
    }

    /// Records one item; a later item with the same key wins, as in PyTorch.
    pub(super) fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        match key {
            "strategy" => self.strategy = Some(choice(key, value, &Strategy::ALL.map(|s| (s.name(), s)))?),
            "backend" => {
                let backends = [("native", Backend::Native), ("cudaMallocAsync", Backend::CudaMallocAsync)];
                self.backend = Some(choice(key, value, &backends)?);
            }
            "max_split_size_mb" => self.max_split_size = Some(split_limit(key, value)?),
            "max_non_split_rounding_mb" => self.max_non_split_rounding = Some(split_limit(key, value)?),
            "roundup_power2_divisions" => {
                let table = divisions(value).map_err(|why| ConfigError(format!("config key '{key}': {why}")))?;
                self.power2_divisions = Some(table);
            }
            "large_segment_size_mb" => self.large_segment_size_mb = Some(at_least(key, value, 10)?),
            "garbage_collection_threshold" => {
                self.garbage_collection_threshold = Some(fraction(key, value, false)?);
            }
            "per_process_memory_fraction" => self.per_process_memory_fraction = Some(fraction(key, value, true)?),
            "expandable_segments" => self.expandable_segments = Some(boolean(key, value)?),
            "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => {
                self.release_lock_on_cudamalloc = boolean(key, value)?;
                self.note_inert(key);
            }
            "release_threshold" => self.release_threshold = Some(fraction(key, value, true)?),
            "initial_pool_size_mb" => self.initial_pool_size_mb = Some(at_least(key, value, 0)?),
            "page_size_mb" => self.page_size_mb = Some(power_of_two(key, value)?),
            "shareable_handle" => {
                self.mapping.shareable = choice(key, value, &[("none", false), ("posix_fd", true)])?;
            }
            "peer_access" => self.mapping.peers = devices(key, value)?,
            "rules_off" => self.rules_off = rule_names(key, value)?,
            "cross_stream_reuse" => {
                let modes = [CrossStreamReuse::Never, CrossStreamReuse::Completed, CrossStreamReuse::Wait];
                self.cross_stream_reuse = Some(choice(key, value, &modes.map(|m| (m.name(), m)))?);
            }
            "pinned_use_cuda_host_register"
            | "pinned_use_hip_host_register"
            | "pinned_use_background_threads"
            | "pinned_free_catch_all"
            | "graph_capture_record_stream_reuse"
            | "throw_on_cudamalloc_oom" => {
                boolean(key, value)?;
                self.note_inert(key);
            }
            "pinned_num_register_threads" => {
                let threads = at_least(key, value, 1)?;
                if !threads.is_power_of_two() || threads > MAX_REGISTER_THREADS {
                    let why = format!("a power of two up to {MAX_REGISTER_THREADS}");
                    return Err(ConfigError(format!("config key '{key}' needs {why}, got '{value}'")));
                }
                self.note_inert(key);
            }
            // PyTorch takes any positive count that fits 64 bits.
            "pinned_reserve_segment_size_mb" => {
                integer(key, value, 1, u64::MAX)?;
                self.note_inert(key);
            }
            "pinned_max_cached_size_mb" | "pinned_max_round_threshold_mb" => {
                at_least(key, value, 0)?;
                self.note_inert(key);
            }
            // PyTorch warns about a malformed reserve and keeps its default: so does this.
            "expandable_segments_reserve" | "expandable_segments_reserve_by_class" => self.note_inert(key),
            _ => return Err(ConfigError(format!("unknown config key '{key}' (known keys: {KNOWN_KEYS})"))),
        }
        Ok(())
    }

    pub(super) fn build(self) -> Result<Config, ConfigError> {
        let strategy = self.strategy()?;
        let default_initial = if strategy == Strategy::Arena { DEFAULT_ARENA_MB } else { 0 };
        let initial_mb = self.initial_pool_size_mb.unwrap_or(default_initial);
        let mut rules = match strategy {
            Strategy::Pytorch | Strategy::Expandable | Strategy::Pages | Strategy::Default => Rules::pytorch(),
            Strategy::Bfc => Rules::bfc(),
            Strategy::Arena => Rules::arena((if initial_mb > 0 { initial_mb } else { DEFAULT_ARENA_MB }) * MIB),
            Strategy::Eager => Rules::eager(),
            Strategy::Direct => Rules::direct(),
        };
        if let Some(bytes) = self.max_split_size {
            // Their regions and arena grow past any limit whether a request needs it or not, and
            // a free block over the limit serves no request under it: the pool would run out
            // with most of its memory free (TensorFlow and MindSpore have no such key).
            if matches!(strategy, Strategy::Bfc | Strategy::Arena) {
                return Err(ConfigError(format!(
                    "config key 'max_split_size_mb' does not combine with strategy '{}': its blocks \
                     grow past the limit unasked, and then serve no smaller request",
                    strategy.name()
                )));
            }
            rules.max_split_size = bytes;
        }
        if let Some(bytes) = self.max_non_split_rounding {
            rules.max_non_split_rounding = bytes;
        }
        if let Some(mb) = self.large_segment_size_mb {
            rules.large_segment = mb * MIB;
        }
        rules.power2_divisions = self.power2_divisions.filter(|table| table.iter().any(|&d| d > 1));
        let page = |default_mb: u64| self.page_size_mb.unwrap_or(default_mb) * MIB;
        let mut paging = match strategy {
            // PyTorch's handle sizes: its small and large segment sizes (kSmallBuffer, kLargeBuffer).
            Strategy::Expandable => Some(Paging::handles(page(DEFAULT_PAGE_MB), page(HANDLE_LARGE_MB))),
            Strategy::Pages => Some(Paging::pages(page(DEFAULT_PAGE_MB))),
            Strategy::Default => Some(Paging::pager(page(DEFAULT_PAGE_MB))),
            _ => None,
        };
        let oom_ladder = match strategy {
            Strategy::Default | Strategy::Pages => PAGES_LADDER,
            _ => PYTORCH_LADDER,
        };
        for &rule in &self.rules_off {
            let was_on = paging.as_mut().filter(|_| strategy == Strategy::Default).is_some_and(|p| p.turn_off(rule));
            if !was_on {
                return Err(ConfigError(format!(
                    "config key 'rules_off': '{rule}' is not a rule of strategy '{}' (the default's are: {})",
                    strategy.name(),
                    policy::RULES.map(|(name, _)| name).join(", ")
                )));
            }
        }
        // These shape the paged strategies' physical memory. The others allocate plain segments
        // (shared between processes through CUDA IPC handles, without `shareable_handle`), where
        // such a key would be accepted and do nothing.
        let paged_only = [
            ("page_size_mb", self.page_size_mb.is_some()),
            ("shareable_handle", self.mapping.shareable),
            ("peer_access", !self.mapping.peers.is_empty()),
        ];
        if let Some((key, _)) = paged_only.into_iter().find(|&(_, set)| set && paging.is_none()) {
            return Err(ConfigError(format!(
                "config key '{key}' applies to the paged strategies (default, expandable, pages), not to \
                 strategy '{}', which allocates plain segments",
                strategy.name()
            )));
        }
        Ok(Config {
            strategy,
            rules,
            cross_stream_reuse: self.cross_stream_reuse.unwrap_or_default(),
            paging,
            oom_ladder,
            rules_off: self.rules_off,
            backend: self.backend.unwrap_or_default(),
            // Without pooling every free goes straight back to the device.
            release_threshold: self.release_threshold.or((strategy == Strategy::Direct).then_some(0.0)),
            garbage_collection_threshold: self.garbage_collection_threshold,
            per_process_memory_fraction: self.per_process_memory_fraction,
            initial_pool_size: initial_mb * MIB,
            release_lock_on_cudamalloc: self.release_lock_on_cudamalloc,
            mapping: self.mapping,
            inert: self.inert,
        })
    }

    /// The strategy named, or implied by PyTorch's `backend` and `expandable_segments`; keys
    /// that disagree are an error.
    fn strategy(&self) -> Result<Strategy, ConfigError> {
        let mut implied = Vec::new();
        if self.backend == Some(Backend::CudaMallocAsync) {
            implied.push(("backend:cudaMallocAsync", Strategy::Direct));
        }
        if let Some(expandable) = self.expandable_segments {
            // PyTorch's switch picks between its two allocators, paged or not.
            let paged = |s: Strategy| matches!(s, Strategy::Expandable | Strategy::Pages | Strategy::Default);
            let label = if expandable { "expandable_segments:True" } else { "expandable_segments:False" };
            match self.strategy {
                Some(s) if paged(s) != expandable => return Err(conflict(label, s)),
                Some(_) => {}
                None => implied.push((label, if expandable { Strategy::Expandable } else { Strategy::Pytorch })),
            }
        }
        let chosen = self.strategy.or(implied.first().map(|&(_, s)| s)).unwrap_or_default();
        match implied.iter().find(|&&(_, s)| s != chosen) {
            Some(&(label, _)) => Err(conflict(label, chosen)),
            None => Ok(chosen),
        }
    }
}

fn conflict(label: &str, strategy: Strategy) -> ConfigError {
    ConfigError(format!("config '{label}' contradicts strategy '{}'", strategy.name()))
}

fn choice<T: Copy>(key: &str, value: &str, options: &[(&str, T)]) -> Result<T, ConfigError> {
    options.iter().find(|(name, _)| *name == value).map(|&(_, v)| v).ok_or_else(|| {
        let names: Vec<&str> = options.iter().map(|(name, _)| *name).collect();
        ConfigError(format!("config key '{key}' must be one of {}, got '{value}'", names.join(", ")))
    })
}

/// A megabyte count of gpupool's own bounds: at least `min`, below [`MAX_MB`].
fn at_least(key: &str, value: &str, min: u64) -> Result<u64, ConfigError> {
    integer(key, value, min, MAX_MB - 1)
}

/// An integer in `min..=max`; the error says which bound the value misses (a number too long
/// for 64 bits misses the upper one).
fn integer(key: &str, value: &str, min: u64, max: u64) -> Result<u64, ConfigError> {
    let parsed = value.parse::<u64>();
    let too_large = match &parsed {
        Ok(v) => *v > max,
        Err(e) => *e.kind() == IntErrorKind::PosOverflow,
    };
    if too_large {
        return Err(ConfigError(format!("config key '{key}' needs an integer of at most {max}, got '{value}'")));
    }
    parsed
        .ok()
        .filter(|v| *v >= min)
        .ok_or_else(|| ConfigError(format!("config key '{key}' needs an integer of at least {min}, got '{value}'")))
}

/// PyTorch's `max_split_size_mb` and `max_non_split_rounding_mb`: any count that fits 64 bits,
/// at least [`MIN_SPLIT_LIMIT_MB`]; in bytes capped where the product would overflow, as
/// PyTorch caps it (at `SIZE_MAX / 1 MiB` megabytes).
fn split_limit(key: &str, value: &str) -> Result<u64, ConfigError> {
    Ok(integer(key, value, MIN_SPLIT_LIMIT_MB, u64::MAX)?.min(u64::MAX / MIB) * MIB)
}

/// A page size in MiB: a power of two, as CUDA's mapping granularity (2 MiB) and its multiples
/// that divide address ranges evenly are.
fn power_of_two(key: &str, value: &str) -> Result<u64, ConfigError> {
    let mb = at_least(key, value, 1)?;
    if !mb.is_power_of_two() {
        return Err(ConfigError(format!("config key '{key}' needs a power of two (1, 2, 4, ...), got '{value}'")));
    }
    Ok(mb)
}

/// A float in [0, 1] (`closed`) or (0, 1).
fn fraction(key: &str, value: &str, closed: bool) -> Result<f64, ConfigError> {
    let ok = |v: &f64| if closed { (0.0..=1.0).contains(v) } else { *v > 0.0 && *v < 1.0 };
    value.parse::<f64>().ok().filter(ok).ok_or_else(|| {
        let range = if closed { "[0, 1]" } else { "(0, 1)" };
        ConfigError(format!("config key '{key}' needs a number in {range}, got '{value}'"))
    })
}

/// `[1,3]`: device numbers, each once.
fn devices(key: &str, value: &str) -> Result<Vec<i32>, ConfigError> {
    let bad = || ConfigError(format!("config key '{key}' needs a list of device numbers such as [1,2], got '{value}'"));
    let list = value.strip_prefix('[').and_then(|v| v.strip_suffix(']')).ok_or_else(bad)?;
    let mut devices = Vec::new();
    for item in list.split(',').filter(|item| !item.is_empty()) {
        let device = item.parse::<i32>().ok().filter(|d| *d >= 0 && !devices.contains(d)).ok_or_else(bad)?;
        devices.push(device);
    }
    Ok(devices)
}

/// `rules_off`: a list of names from [`policy::RULES`], each once, such as `[map_ahead]`.
fn rule_names(key: &str, value: &str) -> Result<Vec<&'static str>, ConfigError> {
    let known = policy::RULES.map(|(name, _)| name);
    let bad = |why: String| ConfigError(format!("config key '{key}' {why} (rules: {})", known.join(", ")));
    let list = value.strip_prefix('[').and_then(|v| v.strip_suffix(']'));
    let list = list.ok_or_else(|| bad(format!("needs a list of rules such as [map_ahead], got '{value}'")))?;
    let mut names: Vec<&'static str> = Vec::new();
    for item in list.split(',').filter(|item| !item.is_empty()) {
        let name = known.into_iter().find(|&k| k == item).ok_or_else(|| bad(format!("names no rule '{item}'")))?;
        if names.contains(&name) {
            return Err(bad(format!("names '{item}' twice")));
        }
        names.push(name);
    }
    Ok(names)
}

fn boolean(key: &str, value: &str) -> Result<bool, ConfigError> {
    match value {
        "True" | "true" => Ok(true),
        "False" | "false" => Ok(false),
        _ => Err(ConfigError(format!("config key '{key}' needs True or False, got '{value}'"))),
    }
}

/// `roundup_power2_divisions`: one count for every interval, or a list such as
/// `[256:1,512:2,>:8]` where the first start (in MiB) also covers the intervals below it and `>`
/// every interval after the last start named (PyTorch's reading).
fn divisions(value: &str) -> Result<[u64; POWER2_INTERVALS], String> {
    // Any power of two that fits 64 bits, as PyTorch reads a count (`stoull`).
    let count = |text: &str, zero_ok: bool| {
        text.parse::<u64>().ok().filter(|&n| n.is_power_of_two() || (zero_ok && n == 0)).ok_or_else(|| {
            format!("divisions must be a power of two{}, got '{text}'", if zero_ok { " or 0" } else { "" })
        })
    };
    let Some(list) = value.strip_prefix('[').and_then(|v| v.strip_suffix(']')) else {
        return Ok([count(value, false)?; POWER2_INTERVALS]);
    };
    let mut table = [0; POWER2_INTERVALS];
    let mut last = None;
    for pair in list.split(',').filter(|p| !p.is_empty()) {
        let (start, n) = pair.split_once(':').ok_or_else(|| format!("'{pair}' is not start_mb:divisions"))?;
        let n = count(n, true)?;
        if start == ">" {
            table[last.map_or(1, |i: usize| i + 1).min(POWER2_INTERVALS)..].fill(n);
            continue;
        }
        let mb = start
            .parse::<u64>()
            .ok()
            .filter(|v| v.is_power_of_two())
            .ok_or_else(|| format!("interval starts are powers of two in MiB or '>', got '{start}'"))?;
        let index = (mb.ilog2() as usize).min(POWER2_INTERVALS - 1);
        if last.is_none() {
            table[..index].fill(n);
        }
        table[index] = n;
        last = Some(index);
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{PoolKind, SegmentGrowth, SplitPolicy};
    use crate::pool::policy::Handles;

    fn err(text: &str) -> String {
        Config::parse(text).unwrap_err().0
    }

    #[test]
    fn pytorch_keys_parse_as_pytorch_reads_them() {
        let c = Config::parse(
            "backend:native, max_split_size_mb:64,max_non_split_rounding_mb:32,\
             roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6,\
             expandable_segments:False,release_lock_on_cudamalloc:True,\
             per_process_memory_fraction:0.5,large_segment_size_mb:32,pinned_use_cuda_host_register:True,\
             pinned_num_register_threads:8",
        )
        .unwrap();
        assert_eq!(c.strategy, Strategy::Pytorch);
        assert_eq!((c.rules.max_split_size, c.rules.max_non_split_rounding), (64 * MIB, 32 * MIB));
        assert_eq!(c.rules.power2_divisions.unwrap(), [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 8, 8, 8, 8, 8, 8]);
        assert_eq!(c.garbage_collection_threshold, Some(0.6));
        assert_eq!(c.per_process_memory_fraction, Some(0.5));
        assert_eq!(c.rules.large_segment, 32 * MIB);
        assert!(c.release_lock_on_cudamalloc && c.paging.is_none());
        assert_eq!(
            c.inert,
            ["release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads"]
        );
        assert_eq!(Config::parse("").unwrap(), Config::default());
        assert_eq!(Config::parse(" , ").unwrap(), Config::default());
        assert_eq!(Config::parse("roundup_power2_divisions:4").unwrap().rules.power2_divisions, Some([4; 16]));
        assert_eq!(Config::parse("roundup_power2_divisions:[>:0]").unwrap().rules.power2_divisions, None);
    }

    #[test]
    fn strategies_choose_their_rules() {
        let parse = |s: &str| Config::parse(&format!("strategy:{s}")).unwrap();
        assert_eq!(parse("default"), Config::default());
        assert_eq!(parse("pytorch").rules, Rules::pytorch());
        let pager = Paging::pager(2 * MIB);
        assert_eq!(parse("default").paging, Some(pager));
        assert_eq!((parse("default").oom_ladder, parse("default").rules), (PAGES_LADDER, Rules::pytorch()));
        assert_eq!(parse("bfc").rules, Rules::bfc());
        let arena = parse("arena");
        assert_eq!((arena.initial_pool_size, arena.rules.growth_unit), (1024 * MIB, 1024 * MIB));
        let small = Config::parse("strategy:arena,initial_pool_size_mb:64").unwrap();
        assert_eq!((small.initial_pool_size, small.rules.growth_unit), (64 * MIB, 64 * MIB));
        assert_eq!(parse("eager").rules.split, SplitPolicy::Bfc);
        let direct = parse("direct");
        assert_eq!((direct.rules.growth, direct.release_threshold), (SegmentGrowth::Exact, Some(0.0)));
        // PyTorch's handles: 2 MiB in the small pool, 20 MiB in the large one.
        let handles = parse("expandable").paging.unwrap();
        assert_eq!((handles.page, handles.map_ahead_of(PoolKind::Large)), ([2 * MIB, 20 * MIB], 20 * MIB));
        assert!(handles.handles == Handles::PerPage && !handles.give_back_on_refusal);
        assert_eq!(parse("expandable").oom_ladder, PYTORCH_LADDER);
        let pages = parse("pages").paging.unwrap();
        assert_eq!(
            (pages.page, pages.map_ahead_of(PoolKind::Small), pages.handles),
            ([2 * MIB; 2], 2 * MIB, Handles::PerPage)
        );
        assert!(!pages.give_back_on_refusal);
        assert_eq!(parse("pages").oom_ladder, PAGES_LADDER);
        assert_eq!(parse("pages").rules, Rules::pytorch());
        let pages = Config::parse("page_size_mb:16,expandable_segments:True").unwrap();
        assert_eq!((pages.strategy, pages.paging.unwrap().page), (Strategy::Expandable, [16 * MIB; 2]));
        // Order does not matter: overrides apply on top of the preset.
        let bfc = Config::parse("release_threshold:0.3,strategy:bfc").unwrap();
        assert_eq!((bfc.rules.granule, bfc.release_threshold), (256, Some(0.3)));
        let eager = Config::parse("max_split_size_mb:40,strategy:eager").unwrap();
        assert_eq!((eager.rules.split, eager.rules.max_split_size), (SplitPolicy::Bfc, 40 * MIB));
        let async_backend = Config::parse("backend:cudaMallocAsync").unwrap();
        assert_eq!((async_backend.strategy, async_backend.backend), (Strategy::Direct, Backend::CudaMallocAsync));
        let watermark = Config::parse("release_threshold:0.2,strategy:direct").unwrap();
        assert_eq!(watermark.release_threshold, Some(0.2));
    }

    #[test]
    fn bad_input_names_the_key() {
        for (text, needle) in [
            ("bogus:1", "unknown config key 'bogus'"),
            ("max_split_size_mb:x", "max_split_size_mb"),
            ("max_split_size_mb:4", "at least 20"),
            ("max_split_size_mb", "key:value"),
            ("max_split_size_mb:", "needs a value"),
            ("max_non_split_rounding_mb:8", "max_non_split_rounding_mb"),
            ("strategy:tlsf", "strategy"),
            ("backend:cuda", "backend"),
            ("garbage_collection_threshold:1.0", "garbage_collection_threshold"),
            ("garbage_collection_threshold:0", "garbage_collection_threshold"),
            ("per_process_memory_fraction:1.5", "per_process_memory_fraction"),
            ("release_threshold:-0.1", "release_threshold"),
            ("release_threshold:nan", "release_threshold"),
            ("expandable_segments:yes", "expandable_segments"),
            ("release_lock_on_cudamalloc:1", "release_lock_on_cudamalloc"),
            ("roundup_power2_divisions:3", "roundup_power2_divisions"),
            ("roundup_power2_divisions:[100:2]", "powers of two"),
            ("roundup_power2_divisions:[256:3]", "roundup_power2_divisions"),
            ("roundup_power2_divisions:[256:2", "unclosed"),
            ("roundup_power2_divisions:256:2]", "unbalanced"),
            ("large_segment_size_mb:4", "large_segment_size_mb"),
            ("page_size_mb:0", "page_size_mb"),
            ("initial_pool_size_mb:-1", "initial_pool_size_mb"),
            ("cross_stream_reuse:often", "cross_stream_reuse"),
            ("pinned_num_register_threads:x", "pinned_num_register_threads"),
            ("pinned_num_register_threads:3", "power of two"),
            ("pinned_num_register_threads:256", "up to 128"),
            ("pinned_reserve_segment_size_mb:0", "pinned_reserve_segment_size_mb"),
            ("throw_on_cudamalloc_oom:maybe", "throw_on_cudamalloc_oom"),
            ("strategy:bfc,expandable_segments:True", "contradicts strategy 'bfc'"),
            ("strategy:expandable,expandable_segments:False", "expandable_segments:False"),
            ("strategy:pytorch,backend:cudaMallocAsync", "backend:cudaMallocAsync"),
            ("backend:cudaMallocAsync,expandable_segments:True", "contradicts"),
        ] {
            let message = err(text);
            assert!(message.contains(needle), "{text}: {message}");
        }
    }

    /// PyTorch reads `max_split_size_mb` and `max_non_split_rounding_mb` with `stoull`: any count
    /// that fits 64 bits, multiplied out with the count capped at `SIZE_MAX / 1 MiB`; a longer
    /// number is an error. A count beyond a bound is named as such, not as one below the minimum.
    #[test]
    fn huge_megabyte_counts_read_as_pytorch_reads_them() {
        let capped = u64::MAX / MIB * MIB;
        for (text, bytes) in [
            ("max_split_size_mb:1099511627776", 1 << 60),
            ("max_split_size_mb:17592186044415", capped),
            ("max_split_size_mb:18446744073709551615", capped),
        ] {
            assert_eq!(Config::parse(text).unwrap().rules.max_split_size, bytes, "{text}");
        }
        let rounding = Config::parse("max_non_split_rounding_mb:18446744073709551615").unwrap();
        assert_eq!(rounding.rules.max_non_split_rounding, capped);
        assert!(Config::parse("pinned_reserve_segment_size_mb:18446744073709551615").is_ok());
        for (text, needle) in [
            ("max_split_size_mb:18446744073709551616", "at most 18446744073709551615"),
            ("max_non_split_rounding_mb:99999999999999999999999", "at most"),
            ("pinned_reserve_segment_size_mb:18446744073709551616", "at most"),
            ("page_size_mb:1099511627776", "at most 1099511627775"),
            ("initial_pool_size_mb:1099511627776", "at most"),
            ("large_segment_size_mb:1099511627776", "at most"),
            ("max_split_size_mb:19", "at least 20"),
        ] {
            let message = err(text);
            assert!(message.contains(needle) && message.contains(text.split(':').next().unwrap()), "{text}: {message}");
        }
    }

    /// PyTorch takes any power of two that fits 64 bits as a division count, in both forms, and
    /// records the table in snapshots as such; gpupool called 2^32 "not a power of two".
    #[test]
    fn division_counts_take_every_64_bit_power_of_two() {
        let table = |text: &str| {
            let c = Config::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            c.entries().into_iter().find(|(k, _)| *k == "roundup_power2_divisions").unwrap().1.to_string()
        };
        assert!(table("roundup_power2_divisions:4294967296").starts_with("[1:4294967296,2:4294967296,"));
        let top = "9223372036854775808";
        assert!(table(&format!("roundup_power2_divisions:[256:2,>:{top}]")).ends_with(&format!("32768:{top}]")));
        for bad in ["roundup_power2_divisions:18446744073709551616", "roundup_power2_divisions:[>:6442450944]"] {
            assert!(err(bad).contains("power of two"), "{bad}");
        }
    }

    /// Every key current PyTorch accepts in `PYTORCH_ALLOC_CONF` (c10/core/AllocatorConfig.h and
    /// c10/cuda/CUDAAllocatorConfig.cpp, 2.13) parses; those without effect on device memory say so.
    #[test]
    fn every_current_pytorch_key_is_accepted() {
        let c = Config::parse(
            "backend:native,large_segment_size_mb:20,max_split_size_mb:64,max_non_split_rounding_mb:40,\
             garbage_collection_threshold:0.7,roundup_power2_divisions:[64:8,>:4],expandable_segments:False,\
             pinned_use_background_threads:True,release_lock_on_cudamalloc:False,\
             pinned_use_cuda_host_register:True,pinned_num_register_threads:16,pinned_reserve_segment_size_mb:64,\
             pinned_max_cached_size_mb:1024,pinned_max_round_threshold_mb:1,pinned_free_catch_all:True,\
             graph_capture_record_stream_reuse:True,per_process_memory_fraction:0.9,throw_on_cudamalloc_oom:True,\
             expandable_segments_reserve:40G,expandable_segments_reserve_by_class:[kv:0.5,weights:20G]",
        )
        .unwrap();
        assert_eq!(c.per_process_memory_fraction, Some(0.9));
        let mut inert = c.inert.clone();
        inert.sort_unstable();
        let mut expected: Vec<&str> = NO_DEVICE_MEMORY_EFFECT.iter().copied().filter(|k| !k.contains("hip")).collect();
        expected.sort_unstable();
        assert_eq!(inert, expected);
        assert!(Config::parse("max_split_size_mb:64").unwrap().inert.is_empty());
    }

    #[test]
    fn entries_list_every_effective_setting() {
        let c = Config::parse("strategy:bfc,release_threshold:0.25,roundup_power2_divisions:[>:4]").unwrap();
        let entries = c.entries();
        let get = |key: &str| entries.iter().find(|(k, _)| *k == key).unwrap().1.to_string();
        assert_eq!(get("strategy"), "bfc");
        assert_eq!(get("max_split_size_mb"), "None");
        assert_eq!(get("release_threshold"), "0.25");
        assert_eq!(get("expandable_segments"), "False");
        assert!(get("roundup_power2_divisions").starts_with("[1:0,2:4,4:4"));
        assert_eq!((get("shareable_handle"), get("peer_access")), ("none".into(), "[]".into()));
        assert_eq!(get("rules_off"), "[]");
        assert_eq!(entries.len(), 17);
    }

    #[test]
    fn rules_off_turns_the_defaults_rules_off_one_by_one() {
        for (rule, _) in policy::RULES {
            let c = Config::parse(&format!("rules_off:[{rule}]")).unwrap();
            assert_ne!((c.paging, c.oom_ladder), (Config::default().paging, Config::default().oom_ladder), "{rule}");
            assert_eq!(c.rules_off, [rule]);
        }
        let c = Config::parse("rules_off:[map_ahead,give_back_on_refusal]").unwrap();
        let pager = c.paging.unwrap();
        assert_eq!((pager.map_ahead_of(PoolKind::Large), pager.give_back_on_refusal), (2 * MIB, false));
        assert_ne!(pager.handles, Handles::PerPage);
        assert_eq!(Config::parse("rules_off:[]").unwrap(), Config::default());
        for (bad, why) in [
            ("rules_off:map_ahead", "needs a list of rules"),
            ("rules_off:[sizerun]", "names no rule 'sizerun'"),
            ("rules_off:[size_run]", "names no rule 'size_run'"),
            ("rules_off:[map_ahead,map_ahead]", "names 'map_ahead' twice"),
            ("strategy:pages,rules_off:[handle_sizing]", "'handle_sizing' is not a rule of strategy 'pages'"),
            ("strategy:pytorch,rules_off:[map_ahead]", "is not a rule of strategy 'pytorch'"),
        ] {
            let message = err(bad);
            assert!(message.contains("rules_off") && message.contains(why), "{bad}: {message}");
        }
    }

    #[test]
    fn mapping_options() {
        let c = Config::parse("shareable_handle:posix_fd,peer_access:[1,3]").unwrap();
        assert!(c.mapping.shareable && c.mapping.peers == [1, 3]);
        assert_eq!(Config::default().mapping, Default::default());
        for bad in ["peer_access:1", "peer_access:[1,1]", "peer_access:[-1]", "shareable_handle:fabric"] {
            assert!(Config::parse(bad).is_err(), "{bad}");
        }
    }
}
