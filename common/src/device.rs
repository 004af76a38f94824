//! Which device a deployment's tensors live on, as plain scenario data (`"cpu"`, `"cuda:N"`).
//!
//! This crate only parses the name; `fedrl-rl` turns it into a candle device and reports a build
//! without the `cuda` feature as an error there.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A device name: `cpu` or `cuda:N` (GPU ordinal N).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceSpec {
    /// The CPU (the default; what CI runs).
    #[default]
    Cpu,
    /// CUDA GPU with this ordinal.
    Cuda(usize),
}

/// A device name that is neither `cpu` nor `cuda:N`.
#[derive(Debug, Error, PartialEq, Eq)]
#[error(
    "device \"{0}\" is not a device name: use \"cpu\" or \"cuda:N\" (N a GPU number, e.g. cuda:0)"
)]
pub struct DeviceSpecError(pub String);

impl FromStr for DeviceSpec {
    type Err = DeviceSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || DeviceSpecError(s.to_string());
        if s == "cpu" {
            return Ok(DeviceSpec::Cpu);
        }
        let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
        // Digits only: `usize::from_str` would also take a leading `+`.
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        n.parse().map(DeviceSpec::Cuda).map_err(|_| bad())
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = DeviceSpecError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<DeviceSpec> for String {
    fn from(d: DeviceSpec) -> String {
        d.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print_back() {
        assert_eq!("cpu".parse(), Ok(DeviceSpec::Cpu));
        assert_eq!("cuda:0".parse(), Ok(DeviceSpec::Cuda(0)));
        assert_eq!("cuda:1".parse(), Ok(DeviceSpec::Cuda(1)));
        assert_eq!(
            "cuda:12".parse::<DeviceSpec>().unwrap().to_string(),
            "cuda:12"
        );
        for bad in [
            "", "CPU", "gpu", "cuda", "cuda:", "cuda:-1", "cuda:+1", "cuda:x", " cpu", "cuda:1 ",
        ] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert_eq!(e, DeviceSpecError(bad.to_string()));
            assert!(e.to_string().contains("cuda:N"), "{e}");
        }
    }
}
