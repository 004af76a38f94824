//! `fedrl privacy ...`: the accountants as a calculator.

use std::process::ExitCode;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum PrivacyCommand {}

pub fn run(cmd: PrivacyCommand) -> anyhow::Result<ExitCode> {
    match cmd {}
}
