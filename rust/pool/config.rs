//! The configuration string: PyTorch's `key:value,key:value` grammar.

use crate::core::Rules;
use std::fmt;

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

/// The effective settings of a pool.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Config {
    pub rules: Rules,
    pub cross_stream_reuse: CrossStreamReuse,
}

const MIB: u64 = 1 << 20;

impl Config {
    /// Parses `key:value,key:value`; an unknown key or a bad value is an error naming it.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let mut config = Config::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) =
                item.split_once(':').ok_or_else(|| ConfigError(format!("config item '{item}' is not key:value")))?;
            let (key, value) = (key.trim(), value.trim());
            match key {
                "max_split_size_mb" => {
                    // As PyTorch: at least a large segment, so shared segments still split.
                    let mb = parse_u64(key, value)?;
                    if mb * MIB < config.rules.large_segment {
                        return Err(ConfigError(format!("max_split_size_mb must be at least 20, got {value}")));
                    }
                    config.rules.max_split_size = mb * MIB;
                }
                "max_non_split_rounding_mb" => {
                    config.rules.max_non_split_rounding = parse_u64(key, value)? * MIB;
                }
                "cross_stream_reuse" => {
                    config.cross_stream_reuse = match value {
                        "never" => CrossStreamReuse::Never,
                        "completed" => CrossStreamReuse::Completed,
                        "wait" => CrossStreamReuse::Wait,
                        _ => {
                            return Err(ConfigError(format!(
                                "config key 'cross_stream_reuse' must be never, completed or wait, got '{value}'"
                            )))
                        }
                    }
                }
                _ => return Err(ConfigError(format!("unknown config key '{key}'"))),
            }
        }
        Ok(config)
    }

    /// Every setting as `(key, value)`, for `pool.config` and snapshots.
    pub fn entries(&self) -> Vec<(&'static str, String)> {
        let r = &self.rules;
        let mb = |v: u64| {
            if v == u64::MAX {
                "unlimited".to_string()
            } else {
                (v / MIB).to_string()
            }
        };
        vec![("max_split_size_mb", mb(r.max_split_size)), ("max_non_split_rounding_mb", mb(r.max_non_split_rounding))]
    }
}

fn parse_u64(key: &str, value: &str) -> Result<u64, ConfigError> {
    value
        .parse::<u64>()
        .ok()
        .filter(|v| *v < (1 << 40))
        .ok_or_else(|| ConfigError(format!("config key '{key}' needs a non-negative integer, got '{value}'")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_names_bad_keys() {
        let c = Config::parse("max_split_size_mb:64, max_non_split_rounding_mb:8").unwrap();
        assert_eq!(c.rules.max_split_size, 64 * MIB);
        assert_eq!(c.rules.max_non_split_rounding, 8 * MIB);
        assert!(Config::parse("").unwrap() == Config::default());
        assert!(Config::parse("bogus:1").unwrap_err().0.contains("bogus"));
        assert!(Config::parse("max_split_size_mb:x").unwrap_err().0.contains("max_split_size_mb"));
        assert!(Config::parse("max_split_size_mb:4").unwrap_err().0.contains("max_split_size_mb"));
        assert!(Config::parse("max_split_size_mb").unwrap_err().0.contains("key:value"));
        assert_eq!(Config::parse("cross_stream_reuse:wait").unwrap().cross_stream_reuse, CrossStreamReuse::Wait);
        assert!(Config::parse("cross_stream_reuse:often").unwrap_err().0.contains("cross_stream_reuse"));
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
    }
}
