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

/// The effective settings of a pool.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub rules: Rules,
}

impl Default for Config {
    fn default() -> Self {
        Config { rules: Rules::default() }
    }
}

const MIB: u64 = 1 << 20;

impl Config {
    /// Parses `key:value,key:value`; an unknown key or a bad value is an error naming it.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let mut config = Config::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once(':')
                .ok_or_else(|| ConfigError(format!("config item '{item}' is not key:value")))?;
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
                _ => return Err(ConfigError(format!("unknown config key '{key}'"))),
            }
        }
        Ok(config)
    }

    /// Every setting as `(key, value)`, for `pool.config` and snapshots.
    pub fn entries(&self) -> Vec<(&'static str, String)> {
        let r = &self.rules;
        let mb = |v: u64| if v == u64::MAX { "unlimited".to_string() } else { (v / MIB).to_string() };
        vec![
            ("max_split_size_mb", mb(r.max_split_size)),
            ("max_non_split_rounding_mb", mb(r.max_non_split_rounding)),
        ]
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
    }
}
