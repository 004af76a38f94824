//! Errors of the privacy core.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum PrivacyError {
    /// A parameter is outside its domain (NaN, negative noise, q outside (0, 1], ...).
    #[error("invalid parameter: {0}")]
    InvalidParameter(String),
    /// The accountant cannot handle this event (e.g. an RDP bound for an (epsilon, delta) event).
    #[error("unsupported event for this accountant: {0}")]
    Unsupported(String),
    /// A participant's answer to a query is malformed (non-finite, out of range, not
    /// monotone...): refused before it reaches any mechanism, since the sensitivity the
    /// mechanism is calibrated for holds only for well-formed answers.
    #[error("invalid answer: {0}")]
    InvalidAnswer(String),
    /// No finite answer exists (e.g. no noise level reaches the requested epsilon).
    #[error("no solution: {0}")]
    NoSolution(String),
}
