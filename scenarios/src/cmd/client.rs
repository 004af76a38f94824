//! `fedrl client`: a client agent hosting simulated users.

use std::net::{SocketAddr, ToSocketAddrs};
use std::process::ExitCode;

use anyhow::Context;
use fedrl_client::agent::close_endpoint;
use fedrl_client::{AgentOptions, default_factory, parse_unit_ranges, run_agent};
use fedrl_common::device::DeviceSpec;
use fedrl_common::protocol::auth::parse_fingerprint;

use crate::cmd::UsageError;
use crate::cmd::aggregator::{StopSignal, StopSignals};

#[derive(clap::Args)]
pub struct Args {
    /// Aggregator address (HOST:PORT, UDP).
    #[arg(long)]
    pub server: String,
    /// SHA-256 fingerprint of the aggregator's certificate (printed by `fedrl aggregator`).
    #[arg(long = "server-cert-sha256", value_name = "HEX")]
    pub server_cert_sha256: String,
    /// Enrolment token (`fedrl aggregator --issue-token ID` prints one).
    #[arg(long)]
    pub token: String,
    /// Users hosted, `A..B` (half-open), comma-separated; default: every user no other agent
    /// hosts.
    #[arg(long, value_name = "RANGE")]
    pub users: Option<String>,
    /// Give up after this many seconds without joining the aggregator (counted from the start,
    /// or from the end of the last session; waits included): the agent then exits non-zero with
    /// the last error. `inf`: never.
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
    pub give_up_after: f64,
    /// Seed of the churn model's random choices (default: from the OS).
    #[arg(long)]
    pub churn_seed: Option<u64>,
    /// Where the local updates compute: `cpu` or `cuda:N` (needs a build with the `cuda`
    /// feature).
    #[arg(long, value_name = "cpu|cuda:N", default_value = "cpu")]
    pub device: DeviceSpec,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let server: SocketAddr = args
        .server
        .to_socket_addrs()
        .map_err(|e| UsageError(format!("--server {}: {e}", args.server)))?
        .next()
        .ok_or_else(|| UsageError(format!("--server {}: no address", args.server)))?;
    let fingerprint =
        parse_fingerprint(&args.server_cert_sha256).map_err(|e| UsageError(e.to_string()))?;
    let units = match &args.users {
        Some(r) => parse_unit_ranges(r).map_err(|e| UsageError(format!("--users: {e}")))?,
        None => Vec::new(),
    };
    if args.give_up_after.is_nan() || args.give_up_after < 0.0 {
        return Err(UsageError(format!(
            "--give-up-after: expected seconds >= 0, got {}",
            args.give_up_after
        ))
        .into());
    }
    let device = fedrl_rl::device::open(args.device).map_err(|e| UsageError(e.to_string()))?;
    let mut opts = AgentOptions::new(server, fingerprint, args.token, units);
    opts.give_up_after_s = args.give_up_after;
    opts.churn_seed = args.churn_seed;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let ended = rt.block_on(async move {
        let mut stop = StopSignals::register()?;
        // The agent's endpoint is ours, so that a signal can close its connection cleanly.
        let endpoint = fedrl_client::tls::client_endpoint(server).context("client endpoint")?;
        opts.endpoint = Some(endpoint.clone());
        let factory = default_factory(device);
        let ended = tokio::select! {
            r = run_agent(opts, factory) => Ended::Agent(r),
            s = stop.first() => Ended::Signal(s),
        };
        close_endpoint(&endpoint, matches!(ended, Ended::Signal(_))).await;
        anyhow::Ok(ended)
    })?;
    match ended {
        Ended::Agent(r) => {
            let summary = r.context("client agent")?;
            println!("{}", serde_json::to_string(&summary)?);
            Ok(ExitCode::SUCCESS)
        }
        Ended::Signal(s) => {
            eprintln!(
                "client agent interrupted ({}): it left the aggregator (which goes on without its users)",
                s.name()
            );
            Ok(ExitCode::from(s.exit_status()))
        }
    }
}

/// How the agent's run ended: by itself, or by a signal.
enum Ended {
    Agent(Result<fedrl_client::AgentSummary, fedrl_client::AgentError>),
    Signal(StopSignal),
}
