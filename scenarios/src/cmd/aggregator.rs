//! `fedrl aggregator`: the QUIC server, round engine and ledger of one deployment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use fedrl_aggregator::service::{self, AggregatorOptions, Outcome, RunFailed};
use fedrl_aggregator::state;
use fedrl_common::device::DeviceSpec;
use fedrl_common::protocol::auth::issue_token;

use crate::cmd::UsageError;

#[derive(clap::Args)]
pub struct Args {
    /// Scenario file (TOML).
    #[arg(long)]
    pub scenario: PathBuf,
    /// Override a scenario field by its dotted path (`task.clip_norm=0.5`, `rounds=20`); the
    /// value is read as TOML (a bare word as a string) and checked like the file. Repeatable.
    /// Every restart on the same state directory must pass the same ones.
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = crate::overrides::parse)]
    pub sets: Vec<crate::overrides::Override>,
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
    let mut scenario = if args.sets.is_empty() {
        fedrl_tasks::scenario_from_file(&args.scenario).map_err(|e| UsageError(e.to_string()))?
    } else {
        let text = std::fs::read_to_string(&args.scenario)
            .map_err(|e| UsageError(format!("reading {}: {e}", args.scenario.display())))?;
        crate::overrides::load(&text, &args.sets, fedrl_tasks::scenario_from_toml_str)
            .map_err(|e| UsageError(format!("{}: {e:#}", args.scenario.display())))?
    };
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
    let model = fedrl_tasks::server_model(&scenario)?;
    let state_dir = args.state_dir.clone();
    let defers = crate::deferred_eval::defers_evaluations(&scenario);
    let mut opts = AggregatorOptions::new(scenario, args.listen, args.state_dir);
    opts.max_inflight_updates = args.max_inflight_updates;
    opts.allow_budget_increase = args.allow_budget_increase;
    opts.max_connections = args.max_connections;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (report, signal) = rt.block_on(async move {
        // Registered before the endpoint exists: from now on SIGINT and SIGTERM stop the run
        // gracefully (later ones are ignored while it stops).
        let mut stop = StopSignals::register()?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let caught = tokio::spawn(async move {
            let signal = stop.first().await;
            let _ = tx.send(());
            signal
        });
        let report = service::run(opts, model, Some(rx)).await;
        let signal = if caught.is_finished() {
            caught.await.ok()
        } else {
            caught.abort();
            None
        };
        report.map(|r| (r, signal))
    })
    .map_err(|e| match e.downcast::<RunFailed>() {
        Ok(failed) => anyhow::anyhow!(
            "{failed}\n(the report is in {}; once the cause is fixed, restarting with the same --state-dir resumes the run)",
            state_dir.join(state::REPORT_FILE).display()
        ),
        Err(e) => e,
    })?;
    // The whole report, exact counts included, goes to the operator's console; the publishable
    // part is STATE_DIR/report.json.
    eprintln!(
        "run report (operator-only: it has exact counts; the public part is {}):",
        state_dir.join(state::REPORT_FILE).display()
    );
    println!("{}", serde_json::to_string_pretty(&report)?);
    if defers {
        eprintln!(
            "{}",
            deferred_hint(
                &args.scenario,
                &args.sets,
                &state_dir,
                report.public.outcome
            )
        );
    }
    if report.public.outcome == Outcome::Interrupted {
        let signal = signal.unwrap_or(StopSignal::Interrupt);
        eprintln!(
            "interrupted ({}) after {} rounds released: resume with the same --state-dir {}",
            signal.name(),
            report.public.rounds_completed,
            state_dir.display()
        );
        return Ok(ExitCode::from(signal.exit_status()));
    }
    Ok(ExitCode::SUCCESS)
}

/// What a standalone aggregator of a run evaluated in Gymnasium environments (a
/// `gymnasium:<id>` DPPG population, offline CQL on a Gymnasium dataset) tells its operator at
/// its end: it evaluated nothing (it runs no Python), and the command that evaluates its
/// released models.
pub fn deferred_hint(
    scenario: &std::path::Path,
    sets: &[crate::overrides::Override],
    state_dir: &std::path::Path,
    outcome: Outcome,
) -> String {
    let sets: String = sets.iter().map(|s| format!(" {s}")).collect();
    format!(
        "held-out evaluations deferred: this run is evaluated in Gymnasium environments, which \
         run in Python, and the aggregator starts no Python, so the models it would have \
         evaluated are kept in {}{}. {} evaluate them, fill metrics.jsonl and write the final \
         evaluation into report.json on a machine with the Gymnasium bridge \
         (scripts/install-python-bridge.sh):\n  \
         fedrl eval --deferred {} --scenario {}{sets}\n(`fedrl run` does this itself when it \
         started the aggregator.)",
        state_dir
            .join(fedrl_tasks::eval_snapshots::SNAPSHOT_DIR)
            .display(),
        if outcome == Outcome::Finished {
            ""
        } else {
            " (the evaluation rounds released so far)"
        },
        if outcome == Outcome::Finished {
            "To"
        } else {
            "Once the run has finished (or now, for the rounds released so far), to"
        },
        state_dir.display(),
        scenario.display(),
    )
}

/// A signal that stops a process gracefully.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGINT (Ctrl-C).
    Interrupt,
    /// SIGTERM (`kill`, service managers).
    Terminate,
}

impl StopSignal {
    pub fn name(self) -> &'static str {
        match self {
            StopSignal::Interrupt => "SIGINT",
            StopSignal::Terminate => "SIGTERM",
        }
    }
    /// The signal's number.
    pub fn number(self) -> i32 {
        match self {
            StopSignal::Interrupt => libc::SIGINT,
            StopSignal::Terminate => libc::SIGTERM,
        }
    }
    /// The shell's convention for a process ended by the signal, 128 + its number (130, 143):
    /// scripts and service managers read it as "stopped by that signal".
    pub fn exit_status(self) -> u8 {
        (128 + self.number()) as u8
    }
}

/// SIGINT and SIGTERM, caught (once registered, neither ends the process by itself any more).
pub struct StopSignals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Registers the handlers; needs a tokio runtime with I/O enabled.
    pub fn register() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(StopSignals {
            interrupt: signal(SignalKind::interrupt()).context("catching SIGINT")?,
            terminate: signal(SignalKind::terminate()).context("catching SIGTERM")?,
        })
    }

    /// Waits for the next SIGINT or SIGTERM.
    pub async fn first(&mut self) -> StopSignal {
        tokio::select! {
            _ = self.interrupt.recv() => StopSignal::Interrupt,
            _ = self.terminate.recv() => StopSignal::Terminate,
        }
    }
}
