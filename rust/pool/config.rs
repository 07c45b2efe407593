//! The configuration string: PyTorch's `key:value,key:value` grammar, PyTorch's keys with their
//! meanings, and gpupool's own keys (`strategy`, `release_threshold`, ...).
//!
//! A `PYTORCH_CUDA_ALLOC_CONF` value can be pasted as is. Keys, in the order `entries` lists them:
//! - `strategy`: `pytorch`, `bfc`, `arena`, `eager`, `expandable`, `pages`, `direct`,
//!   `default` (the default); the presets of [`Rules`] plus the pool's growth and release behaviour.
//! - `backend`: `native`, or `cudaMallocAsync`: no pooling in gpupool (`direct`); on CUDA the
//!   segments come from the driver's own stream-ordered pool.
//! - `max_split_size_mb` (>= 20), `max_non_split_rounding_mb` (>= 20),
//!   `roundup_power2_divisions` (`4`, or `[256:1,512:2,>:8]`: interval start in MiB, a power of
//!   two, or `>` for the rest, then divisions, a power of two or 0), `large_segment_size_mb`
//!   (>= 10, the segment shared by requests in (1, 10) MiB): PyTorch's rounding and split knobs.
//! - `garbage_collection_threshold` (0, 1): as PyTorch, only with a memory fraction set.
//! - `per_process_memory_fraction` [0, 1]: the pool never holds more than this share of the
//!   device's capacity (no effect on devices without one, such as `host` without `capacity`).
//! - `expandable_segments` (`True`/`False`): `True` selects `strategy:expandable`.
//! - `release_lock_on_cudamalloc` (`True`/`False`): accepted, no effect. PyTorch drops its
//!   allocator lock around `cudaMalloc`; gpupool's device lives inside the pool's lock, so a
//!   segment allocation always holds it (the Python binding releases the GIL, not that lock).
//! - `release_threshold` [0, 1]: after a free (and after a synchronize or a stream's destroy
//!   completes waiting frees), while free-but-reserved bytes exceed this share of reserved
//!   bytes, fully free segments go back to the device, oldest first.
//! - `initial_pool_size_mb`: memory obtained when the pool is made (capped by capacity): a
//!   segment, or under the paged strategies that much of the large range's pages, mapped (whole
//!   pages); `arena` grows by this unit too (default 1024).
//! - `page_size_mb`: the mapping unit of the paged strategies, a power of two: `default` and
//!   `pages` map 2 MiB pages by default; `expandable` maps PyTorch's handles, 20 MiB in the large
//!   pool and 2 MiB in the small one, and this key sets both. On CUDA each is rounded up to the
//!   driver's allocation granularity when below it.
//! - `shareable_handle`: `none` (default) or `posix_fd`: CUDA pages exportable as file
//!   descriptors (IPC, NCCL peer-to-peer).
//! - `peer_access`: `[1,2]`: devices granted read/write access to CUDA pages.
//! - These three keys (`shareable_handle` other than `none`, `peer_access` other than `[]`) with a
//!   strategy of plain segments are an error: they would do nothing there.
//! - `cross_stream_reuse`: `never`, `completed` (default) or `wait`.
//! - `rules_off`: `[map_ahead,handle_sizing]`: rules of the `default` strategy turned off, to
//!   measure what each buys ([`policy::RULES`] names them).
//! - PyTorch's keys for its pinned host memory, CUDA graphs, address-space reserve and
//!   `throw_on_cudamalloc_oom` are validated and accepted without effect on device memory
//!   ([`Config::inert`] lists those given).

mod parse;

pub use parse::NO_DEVICE_MEMORY_EFFECT;

use super::policy::{self, OomStep, Paging};
use crate::core::{PoolKind, Rules, POWER2_INTERVALS};
use crate::device::MappingOptions;
use std::fmt;

/// The environment variable the Python `Pool` reads when it is given no `config`.
pub const ENV_VAR: &str = "GPUPOOL_ALLOC_CONF";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// When a block freed on one stream may serve another.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CrossStreamReuse {
    /// Never (PyTorch): a block only ever serves the stream it was allocated on.
    Never,
    /// Once an event recorded on its stream after the free has completed.
    #[default]
    Completed,
    /// At once, after making the requesting stream wait on such an event (RMM).
    Wait,
}

impl CrossStreamReuse {
    pub fn name(self) -> &'static str {
        match self {
            CrossStreamReuse::Never => "never",
            CrossStreamReuse::Completed => "completed",
            CrossStreamReuse::Wait => "wait",
        }
    }
}

/// A named preset: rules plus the pool's growth and release behaviour.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Strategy {
    /// PyTorch's native caching allocator.
    Pytorch,
    /// TensorFlow's best-fit-with-coalescing allocator, growing by doubling regions.
    Bfc,
    /// MindSpore's dynamic pool: a pre-allocated arena that grows by doubling units.
    Arena,
    /// OneFlow's bin allocator: BFC's splitting over PyTorch's segment sizes.
    Eager,
    /// PyTorch's expandable segments: one reserved address range per pool kind, physical memory
    /// mapped in fixed handles (20 MiB large, 2 MiB small) and unmapped only by `empty_cache`
    /// or the out-of-memory path.
    Expandable,
    /// An idealized pager for comparison: `expandable`'s two ranges, mapped and unmapped 2 MiB
    /// page by page, a map call reaching 20 MiB ahead.
    Pages,
    /// No pooling: every allocation is a segment of its own, released on free.
    Direct,
    /// gpupool's own choice: one address range for all but tiny sizes, mapped in pages that are
    /// kept and reused, one physical allocation per map call while the device has room to spare
    /// (see BENCHMARKS.md for the measurements behind it).
    #[default]
    Default,
}

impl Strategy {
    pub const ALL: [Strategy; 8] = [
        Strategy::Pytorch,
        Strategy::Bfc,
        Strategy::Arena,
        Strategy::Eager,
        Strategy::Expandable,
        Strategy::Pages,
        Strategy::Direct,
        Strategy::Default,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Pytorch => "pytorch",
            Strategy::Bfc => "bfc",
            Strategy::Arena => "arena",
            Strategy::Eager => "eager",
            Strategy::Expandable => "expandable",
            Strategy::Pages => "pages",
            Strategy::Direct => "direct",
            Strategy::Default => "default",
        }
    }
}

/// Where segments come from (PyTorch's `backend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    #[default]
    Native,
    /// The driver's stream-ordered pool (`cuMemAllocAsync`) on CUDA, with no pooling in gpupool.
    CudaMallocAsync,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Native => "native",
            Backend::CudaMallocAsync => "cudaMallocAsync",
        }
    }
}

/// The effective settings of a pool.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub strategy: Strategy,
    pub rules: Rules,
    pub cross_stream_reuse: CrossStreamReuse,
    /// Paged strategies: each pool kind is one reserved address range whose pages are mapped on
    /// demand (rust/pool/expandable.rs), by this policy; `None` uses plain segments.
    pub paging: Option<Paging>,
    /// What the pool tries, in order, when the device refuses a request.
    pub oom_ladder: &'static [OomStep],
    /// The default's rules turned off by `rules_off` (names from [`policy::RULES`]).
    pub rules_off: Vec<&'static str>,
    pub backend: Backend,
    /// The release watermark: a share of reserved bytes that free-but-reserved bytes may reach.
    pub release_threshold: Option<f64>,
    /// PyTorch's garbage collection threshold, a share of the allowed bytes.
    pub garbage_collection_threshold: Option<f64>,
    pub per_process_memory_fraction: Option<f64>,
    /// Bytes to obtain when the pool is made (0: none).
    pub initial_pool_size: u64,
    pub release_lock_on_cudamalloc: bool,
    /// How pages are made (`shareable_handle`, `peer_access`); paged strategies on CUDA only.
    pub mapping: MappingOptions,
    /// The keys given that are accepted without affecting device memory
    /// ([`parse::NO_DEVICE_MEMORY_EFFECT`]), so that a report can say so.
    pub inert: Vec<&'static str>,
}

/// The `default` strategy with no other key set: what `Config::parse("")` gives.
impl Default for Config {
    fn default() -> Self {
        parse::Keys::default().build().expect("the default configuration is valid")
    }
}

const MIB: u64 = 1 << 20;
/// PyTorch's `kLargeBuffer`: the smallest `max_split_size_mb` and `max_non_split_rounding_mb`.
const MIN_SPLIT_LIMIT_MB: u64 = 20;
const DEFAULT_ARENA_MB: u64 = 1024;
const DEFAULT_PAGE_MB: u64 = 2;

/// One setting's value, typed for `pool.config` and snapshots.
#[derive(Clone, Debug, PartialEq)]
pub enum Setting {
    Text(&'static str),
    Int(u64),
    Float(f64),
    Bool(bool),
    /// Unset or unlimited.
    Unset,
    /// Device numbers (`peer_access`).
    List(Vec<u64>),
    /// `roundup_power2_divisions`: each interval's start in MiB with its divisions.
    Divisions(Vec<(u64, u64)>),
    /// Names (`rules_off`).
    Names(Vec<&'static str>),
}

impl Config {
    /// Parses `key:value,key:value`; an unknown key or a bad value is an error naming it.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let mut keys = parse::Keys::default();
        for (key, value) in parse::items(text)? {
            keys.set(&key, &value)?;
        }
        keys.build()
    }

    /// Why a device of `total` bytes named `device` cannot serve this configuration, naming the
    /// key: a paged strategy maps whole pages, and PyTorch's segment growth takes a large
    /// segment for every request from 1 to 10 MiB (paged strategies share its rules but grow by
    /// pages, never taking such a segment). Either larger than the device would fail
    /// those requests with an out-of-memory error that blames nothing. PyTorch's own 20 MiB
    /// segment is only refused when set explicitly, so a small simulated device keeps working
    /// for the other requests.
    pub fn device_too_small(&self, device: &str, total: u64) -> Option<String> {
        let name = self.strategy.name();
        if let Some(page) = self.paging.map(|p| p.page.into_iter().min().unwrap_or(0)).filter(|&p| p > total) {
            let (page, total) = (super::format_bytes(page), super::format_bytes(total));
            return Some(format!("page_size_mb: strategy {name} maps pages of {page}, more than {device}'s {total}"));
        }
        let segment = self.rules.large_segment;
        let set = segment != crate::core::Rules::pytorch().large_segment;
        let takes_segments = self.paging.is_none() && self.rules.growth == crate::core::SegmentGrowth::PyTorch;
        if takes_segments && set && segment > total {
            let (segment, total) = (super::format_bytes(segment), super::format_bytes(total));
            return Some(format!(
                "large_segment_size_mb: strategy {name} takes segments of {segment}, more than {device}'s {total}"
            ));
        }
        None
    }

    /// Every effective setting under its config key, in a fixed order.
    pub fn entries(&self) -> Vec<(&'static str, Setting)> {
        let r = &self.rules;
        let float = |v: Option<f64>| v.map_or(Setting::Unset, Setting::Float);
        let max_split =
            if r.max_split_size == u64::MAX { Setting::Unset } else { Setting::Int(r.max_split_size / MIB) };
        let divisions = r.power2_divisions.unwrap_or([0; POWER2_INTERVALS]);
        vec![
            ("strategy", Setting::Text(self.strategy.name())),
            ("backend", Setting::Text(self.backend.name())),
            ("max_split_size_mb", max_split),
            ("max_non_split_rounding_mb", Setting::Int(r.max_non_split_rounding / MIB)),
            ("roundup_power2_divisions", Setting::Divisions((0..).zip(divisions).map(|(i, d)| (1 << i, d)).collect())),
            ("garbage_collection_threshold", float(self.garbage_collection_threshold)),
            ("expandable_segments", Setting::Bool(self.paging.is_some())),
            ("release_lock_on_cudamalloc", Setting::Bool(self.release_lock_on_cudamalloc)),
            ("per_process_memory_fraction", float(self.per_process_memory_fraction)),
            ("large_segment_size_mb", Setting::Int(r.large_segment / MIB)),
            ("release_threshold", float(self.release_threshold)),
            ("initial_pool_size_mb", Setting::Int(self.initial_pool_size / MIB)),
            // The large pool's unit: every strategy's large requests are mapped in it.
            ("page_size_mb", self.paging.map_or(Setting::Unset, |p| Setting::Int(p.page_of(PoolKind::Large) / MIB))),
            ("cross_stream_reuse", Setting::Text(self.cross_stream_reuse.name())),
            ("shareable_handle", Setting::Text(if self.mapping.shareable { "posix_fd" } else { "none" })),
            ("peer_access", Setting::List(self.mapping.peers.iter().map(|&d| d as u64).collect())),
            ("rules_off", Setting::Names(self.rules_off.clone())),
        ]
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Setting::Text(t) => f.write_str(t),
            Setting::Int(v) => write!(f, "{v}"),
            Setting::Float(v) => write!(f, "{v}"),
            Setting::Bool(v) => f.write_str(if *v { "True" } else { "False" }),
            Setting::Unset => f.write_str("None"),
            Setting::List(items) => {
                let items: Vec<String> = items.iter().map(u64::to_string).collect();
                write!(f, "[{}]", items.join(","))
            }
            Setting::Names(names) => write!(f, "[{}]", names.join(",")),
            Setting::Divisions(pairs) => {
                let items: Vec<String> = pairs.iter().map(|(mb, d)| format!("{mb}:{d}")).collect();
                write!(f, "[{}]", items.join(","))
            }
        }
    }
}

/// Bytes in a size such as `80GiB`, `512 MiB`, `1.5GB` or `4096` (KB/MB/GB are powers of
/// 1000, KiB/MiB/GiB powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, ConfigError> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = (t[..split].trim(), t[split..].trim());
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(ConfigError(format!("unknown size unit in '{text}'"))),
    };
    let value: f64 = number
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v >= 0.0)
        .ok_or_else(|| ConfigError(format!("'{text}' is not a size such as 80GiB")))?;
    // A fraction of a larger unit rounds down to whole bytes; a fraction of a byte is a typo.
    if scale == 1 && value.fract() != 0.0 {
        return Err(ConfigError(format!("'{text}' is not a whole number of bytes")));
    }
    let bytes = value * scale as f64;
    if bytes > crate::core::Rules::MAX_REQUEST as f64 {
        return Err(ConfigError(format!("size '{text}' is absurdly large")));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod size_tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("80GiB").unwrap(), 80 << 30);
        assert_eq!(parse_size("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("-1GiB").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("1.5").is_err());
        assert!(parse_size("2.5B").is_err());
        assert_eq!(parse_size("2.0").unwrap(), 2);
        assert_eq!(parse_size("0.5KiB").unwrap(), 512);
    }
}
