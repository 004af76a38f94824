//! Validated privacy parameters. Each newtype checks its range once, where the number enters the
//! program (TOML, JSON, a command-line flag), so the code behind it never re-checks. They
//! serialise as plain numbers (`serde(try_from = "f64", into = "f64")`), so ledgers and scenario
//! files keep their shape.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::PrivacyError;

/// A privacy parameter outside its domain.
#[derive(Clone, Debug, Error, PartialEq)]
#[error("{name} must be {range}, got {value}")]
pub struct ParamError {
    /// What the number is (`delta`, `sampling rate`, ...).
    pub name: &'static str,
    /// The allowed values, in words.
    pub range: &'static str,
    pub value: f64,
}

impl From<ParamError> for PrivacyError {
    fn from(e: ParamError) -> Self {
        PrivacyError::InvalidParameter(e.to_string())
    }
}

macro_rules! param {
    ($(#[$doc:meta])* $name:ident, $what:literal, $range:literal, |$x:ident| $ok:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, PartialOrd, Serialize, Deserialize)]
        #[serde(try_from = "f64", into = "f64")]
        pub struct $name(f64);

        impl $name {
            /// The number.
            pub fn get(self) -> f64 {
                self.0
            }
        }

        impl TryFrom<f64> for $name {
            type Error = ParamError;

            fn try_from($x: f64) -> Result<Self, ParamError> {
                if $ok {
                    Ok(Self($x))
                } else {
                    Err(ParamError {
                        name: $what,
                        range: $range,
                        value: $x,
                    })
                }
            }
        }

        impl From<$name> for f64 {
            fn from(v: $name) -> f64 {
                v.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

param!(
    /// The delta of an (epsilon, delta) guarantee: a probability in the open interval (0, 1).
    /// Zero is excluded because the Gaussian mechanisms this project runs are never
    /// (epsilon, 0)-DP for a finite epsilon.
    Delta,
    "delta",
    "in (0, 1)",
    |x| x > 0.0 && x < 1.0
);

param!(
    /// The probability q with which a Poisson sample includes each unit, in (0, 1]. Rate 1 means
    /// every unit every time (no amplification).
    SamplingRate,
    "sampling rate",
    "in (0, 1]",
    |x| x > 0.0 && x <= 1.0
);

param!(
    /// z: the Gaussian noise standard deviation divided by the L2 sensitivity (the clip norm).
    /// Positive and finite. A non-private twin, which adds no noise, has no `NoiseMultiplier` at
    /// all: its zero is a plain number handed to the noise generator, never to an accountant.
    NoiseMultiplier,
    "noise multiplier",
    "positive and finite",
    |x| x.is_finite() && x > 0.0
);

param!(
    /// C: the L2 norm every unit's contribution is clipped to, in the units of the contribution.
    /// Positive and finite. A non-private twin clips nothing: its +inf is a plain number handed
    /// to the clipping code, never recorded.
    ClipNorm,
    "clip norm",
    "positive and finite",
    |x| x.is_finite() && x > 0.0
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_enforced_with_a_named_error() {
        assert!(Delta::try_from(1e-5).is_ok());
        for bad in [0.0, 1.0, -1e-9, f64::NAN, f64::INFINITY] {
            let e = Delta::try_from(bad).unwrap_err();
            assert!(e.to_string().starts_with("delta must be in (0, 1)"), "{e}");
        }
        assert!(SamplingRate::try_from(1.0).is_ok());
        assert!(SamplingRate::try_from(1e-9).is_ok());
        for bad in [0.0, 1.0 + 1e-12, f64::NAN, -0.5] {
            let e = SamplingRate::try_from(bad).unwrap_err();
            assert!(
                e.to_string().contains("sampling rate must be in (0, 1]"),
                "{e}"
            );
        }
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(NoiseMultiplier::try_from(bad).is_err());
            assert!(ClipNorm::try_from(bad).is_err());
        }
        assert_eq!(
            NoiseMultiplier::try_from(0.7).map(NoiseMultiplier::get),
            Ok(0.7)
        );
        assert_eq!(ClipNorm::try_from(2.5).map(f64::from), Ok(2.5));
    }

    #[test]
    fn serde_keeps_plain_numbers_and_validates() {
        let d = Delta::try_from(1e-6).unwrap();
        assert_eq!(serde_json::to_string(&d).unwrap(), "1e-6");
        assert_eq!(serde_json::from_str::<Delta>("1e-6").unwrap(), d);
        let e = serde_json::from_str::<Delta>("1.5").unwrap_err();
        assert!(e.to_string().contains("delta must be in (0, 1)"), "{e}");
        // An integer in the text is a number too.
        assert_eq!(
            serde_json::from_str::<SamplingRate>("1").unwrap().get(),
            1.0
        );
        #[derive(Deserialize)]
        struct T {
            q: SamplingRate,
        }
        let t: T = toml::from_str("q = 0.25").unwrap();
        assert_eq!(t.q.get(), 0.25);
        assert!(toml::from_str::<T>("q = 0.0").is_err());
    }
}
