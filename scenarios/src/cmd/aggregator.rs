//! `fedrl aggregator`: the QUIC server, round engine and ledger of one deployment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use fedrl_aggregator::service::{self, AggregatorOptions};
use fedrl_aggregator::{state, tasks};
use fedrl_common::device::DeviceSpec;
use fedrl_common::protocol::auth::issue_token;

use crate::cmd::UsageError;

#[derive(clap::Args)]
pub struct Args {
    /// Scenario file (TOML).
    #[arg(long)]
    pub scenario: PathBuf,
    /// UDP address to listen on; port 0 lets the OS choose (the address is written to
    /// STATE_DIR/address.json).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// State directory: certificate, enrolment secret, ledger, checkpoints, metrics. Reusing it
    /// after a crash resumes the run.
    #[arg(long)]
    pub state_dir: PathBuf,
    /// Print the enrolment token of this client id (repeatable) and exit.
    #[arg(long, value_name = "CLIENT_ID")]
    pub issue_token: Vec<String>,
    /// Update frames read concurrently (bounds memory: each holds about 8 x dim bytes).
    #[arg(long, default_value_t = 8)]
    pub max_inflight_updates: usize,
    /// Resume even though the scenario's `target_epsilon` is larger than the one the state
    /// directory's ledger was created with (refused otherwise): raising a run's privacy budget is
    /// the operator's explicit decision, and it is logged.
    #[arg(long)]
    pub allow_budget_increase: bool,
    /// Where the server model computes: `cpu` or `cuda:N` (needs a build with the `cuda`
    /// feature). Overrides the scenario's `device`.
    #[arg(long, value_name = "cpu|cuda:N")]
    pub device: Option<DeviceSpec>,
    /// Connections open at once, authenticated or not (each client agent process holds one);
    /// further attempts are refused until some close.
    #[arg(long, default_value_t = service::DEFAULT_MAX_CONNECTIONS, value_name = "N")]
    pub max_connections: usize,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.max_connections == 0 {
        return Err(UsageError("--max-connections must be at least 1".into()).into());
    }
    let mut scenario = fedrl_rl::task::scenario_from_file(&args.scenario)
        .map_err(|e| UsageError(e.to_string()))?;
    if let Some(d) = args.device {
        scenario.device = d;
    }
    fedrl_rl::device::open(scenario.device).map_err(|e| UsageError(e.to_string()))?;
    std::fs::create_dir_all(&args.state_dir)
        .with_context(|| format!("creating {}", args.state_dir.display()))?;
    if !args.issue_token.is_empty() {
        let secret = state::load_or_create_secret(&args.state_dir)?;
        for id in &args.issue_token {
            let token = issue_token(&secret, id)
                .map_err(|e| UsageError(format!("client id {id:?}: {e}")))?;
            println!("{token}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let model = tasks::server_model(&scenario)?;
    let state_dir = args.state_dir.clone();
    let mut opts = AggregatorOptions::new(scenario, args.listen, args.state_dir);
    opts.max_inflight_updates = args.max_inflight_updates;
    opts.allow_budget_increase = args.allow_budget_increase;
    opts.max_connections = args.max_connections;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(async move {
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let _ = tokio::signal::ctrl_c().await;
            let _ = tx.send(());
        });
        service::run(opts, model, Some(rx)).await
    })?;
    // The whole report, exact counts included, goes to the operator's console; the publishable
    // part is STATE_DIR/report.json.
    eprintln!(
        "run report (operator-only: it has exact counts; the public part is {}):",
        state_dir.join(state::REPORT_FILE).display()
    );
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(ExitCode::SUCCESS)
}
