//! `fedrl`: the one command-line program of fedrl (DESIGN §5).

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "fedrl",
    version,
    about = "Federated reinforcement learning with user-level differential privacy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Privacy calculator: epsilon from noise, noise from epsilon (PLD or RDP accountant).
    #[command(subcommand)]
    Privacy(cmd::privacy::PrivacyCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Privacy(c) => cmd::privacy::run(c),
    };
    match result {
        Ok(code) => code,
        Err(err) => cmd::report_error(&err),
    }
}
