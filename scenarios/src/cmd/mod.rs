//! One module per `fedrl` subcommand. Each exposes `Args` (clap) and `run(Args)`.

pub mod aggregator;
pub mod baseline;
pub mod client;
pub mod cql;
pub mod data;
pub mod eval;
pub mod ledger;
pub mod privacy;
pub mod run;
pub mod sim;

use std::process::ExitCode;

/// An error in the user's arguments: printed on one line, exit code 2 (as clap does).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Prints `err` on one line to stderr and maps it to the exit code: 2 for [`UsageError`], else 1.
pub fn report_error(err: &anyhow::Error) -> ExitCode {
    if let Some(usage) = err.downcast_ref::<UsageError>() {
        eprintln!("error: {usage}");
        return ExitCode::from(2);
    }
    eprintln!("error: {err:#}");
    ExitCode::from(1)
}
