//! The candle device a scenario's `device` name (`cpu`, `cuda:N`) stands for.
//!
//! The name is plain scenario data ([`DeviceSpec`], in `fedrl-common`); opening it needs candle.
//! CUDA needs this crate's `cuda` feature (candle's CUDA backend, built with nvcc): without it a
//! `cuda:N` name is an error that says so, never a silent fall back to the CPU.

use candle_core::Device;
use fedrl_common::device::{DeviceSpec, DeviceSpecError};
use thiserror::Error;

/// Why a device could not be opened.
#[derive(Debug, Error)]
pub enum DeviceError {
    /// Not `cpu` nor `cuda:N`.
    #[error(transparent)]
    Name(#[from] DeviceSpecError),
    /// A GPU was asked for but this build has no CUDA backend.
    #[error(
        "{0} requested but fedrl was built without the `cuda` feature (rebuild with \
         `--features fedrl-scenarios/cuda` on a machine with the CUDA toolkit, or use --device cpu)"
    )]
    NoCuda(DeviceSpec),
    /// The CUDA backend could not open that GPU (no such ordinal, driver error, ...).
    #[error("opening {spec}: {source}")]
    Open {
        spec: DeviceSpec,
        #[source]
        source: candle_core::Error,
    },
}

/// Whether this build can open `cuda:N` devices.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Opens the device `spec` names.
pub fn open(spec: DeviceSpec) -> Result<Device, DeviceError> {
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(_) if !CUDA_BUILT => Err(DeviceError::NoCuda(spec)),
        DeviceSpec::Cuda(n) => {
            Device::new_cuda(n).map_err(|source| DeviceError::Open { spec, source })
        }
    }
}

/// Parses a device name (`cpu`, `cuda:N`) and opens it.
pub fn parse(name: &str) -> Result<Device, DeviceError> {
    open(name.parse()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_opens_and_bad_names_are_named() {
        assert!(matches!(parse("cpu"), Ok(Device::Cpu)));
        for bad in ["gpu", "cuda", "cuda:x", "CPU", ""] {
            let e = parse(bad).unwrap_err();
            assert!(matches!(e, DeviceError::Name(_)), "{bad}: {e}");
            assert!(e.to_string().contains("cuda:N"), "{e}");
        }
    }

    /// `cuda:N` parses; without the `cuda` feature opening it is a clear error, not the CPU.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_clear_error() {
        assert_eq!("cuda:1".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(1)));
        let e = parse("cuda:0").unwrap_err();
        assert!(matches!(e, DeviceError::NoCuda(DeviceSpec::Cuda(0))), "{e}");
        let msg = e.to_string();
        assert!(
            msg.starts_with("cuda:0 requested but fedrl was built without the `cuda` feature"),
            "{msg}"
        );
    }
}
