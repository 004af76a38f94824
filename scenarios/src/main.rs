//! `fedrl`: the one command-line program of fedrl (DESIGN §5).

mod cmd;
mod deferred_eval;
mod deploy;
mod metrics_files;
mod overrides;
mod plot;
mod replicates;

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
    /// Run a whole deployment on this machine (aggregator + client agents over QUIC on loopback).
    Run(cmd::run::Args),
    /// Start an aggregator (QUIC server, round engine, ledger).
    Aggregator(cmd::aggregator::Args),
    /// Start a client agent hosting simulated users.
    Client(cmd::client::Args),
    /// Privacy calculator: epsilon from noise, noise from epsilon (PLD or RDP accountant).
    Privacy(cmd::privacy::Args),
    /// Read a privacy ledger: rounds, units, total and per-unit epsilon.
    Ledger(cmd::ledger::Args),
    /// Evaluate a saved policy.
    Eval(cmd::eval::Args),
    /// Exercise and validate simulators.
    Sim(cmd::sim::Args),
    /// Generate, list, summarise and import offline datasets (Minari layout, Arrow/Parquet).
    Data(cmd::data::Args),
    /// Train the non-private discrete CQL baseline on an offline dataset and evaluate it.
    Cql(cmd::cql::Args),
    /// Run a hand-written glucose controller (basal-bolus, PID, proportional) on UVA/Padova users.
    Baseline(cmd::baseline::Args),
}

fn main() -> ExitCode {
    // Small MLPs run 2-3x faster on one candle thread per model; fedrl parallelises across users
    // itself (RUST-NOTES). Set before any thread exists, so the environment write is sound.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: the process is still single-threaded here.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    // Client agents and the aggregator train with candle: keep its buffers out of mmap/trim.
    fedrl_rl::alloc::tune_for_training();
    // Logs go to stderr (the per-process log files under `fedrl run`); RUST_LOG overrides.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colour only on a terminal: under `fedrl run` stderr is a log file, which must stay plain
    // text (escape codes in logs break grep and editors).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Aggregator(a) => cmd::aggregator::run(a),
        Command::Client(a) => cmd::client::run(a),
        Command::Privacy(a) => cmd::privacy::run(a),
        Command::Ledger(a) => cmd::ledger::run(a),
        Command::Eval(a) => cmd::eval::run(a),
        Command::Sim(a) => cmd::sim::run(a),
        Command::Data(a) => cmd::data::run(a),
        Command::Cql(a) => cmd::cql::run(a),
        Command::Baseline(a) => cmd::baseline::run(a),
    };
    match result {
        Ok(code) => code,
        Err(err) => cmd::report_error(&err),
    }
}
