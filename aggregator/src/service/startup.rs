//! Start-up and resume: the state directory, TLS identity and enrolment secret, the ledger and
//! checkpoint (which decide where the run continues), the engine configuration, and spawning the
//! endpoint, the engine thread and the connection acceptor.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use fedrl_common::privacy::ledger::{OpenPolicy, PrivacyLedger};
use fedrl_common::protocol::Welcome;
use quinn::VarInt;
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::connection::{
    BufferPool, MAX_CONCURRENT_OFFERS, STALL_TIMEOUT_S, Shared, serve_connection,
};
use super::driver::{EngineThread, Input};
use super::gate::{AUTH_TIMEOUT_S, Gate, Limits};
use super::report::{Outcome, RunFailed};
use super::transport::{self, IDLE_RECEIVE_WINDOW};
use super::{AddressFile, AggregatorOptions, RunReport, resume};
use crate::checkpoint;
use crate::engine::{self, Engine};
use crate::journal::{JOURNAL_FILE, JournalError, JournalWriter};
use crate::state;
use crate::tls;
use fedrl_tasks::server::ServerModel;

/// Runs an aggregator until the scenario's rounds are done (or the budget or population is
/// exhausted, or `shutdown` fires). Returns the report: its `outcome` is
/// [`Outcome::Interrupted`] after `shutdown` (the state directory resumes the run). A run that
/// stopped for an error returns [`RunFailed`] (its report, as far as it could be written, is in
/// the state directory).
pub async fn run(
    opts: AggregatorOptions,
    model: Box<dyn ServerModel>,
    shutdown: Option<oneshot::Receiver<()>>,
) -> anyhow::Result<RunReport> {
    let scenario = opts.scenario.clone();
    let dir = opts.state_dir.clone();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // One aggregator per state directory, for the whole run (released when `run` returns or the
    // process dies): two would append to one ledger and under-report epsilon.
    let _lock = state::lock_state_dir(&dir)?;
    state::write_files_guide(&dir)?;
    let identity = tls::load_or_create_identity(&dir)?;
    let secret = state::load_or_create_secret(&dir)?;

    // The ledger and checkpoint decide where this run continues, or that it must not. The
    // ledger refuses a larger target epsilon than it allows unless the operator said so
    // (`--allow-budget-increase`), and records an allowed raise before anything else runs.
    let ledger_path = dir.join(state::LEDGER_FILE);
    let raises_before = PrivacyLedger::read_file(&ledger_path)
        .map(|f| f.budget_changes().len())
        .unwrap_or(0);
    let policy = OpenPolicy {
        allow_budget_increase: opts.allow_budget_increase,
    };
    let (ledger, recovery) =
        PrivacyLedger::open_with(&ledger_path, scenario.ledger_config()?, policy)
            .context("opening the privacy ledger")?;
    if recovery.torn_bytes > 0 || recovery.unchained_entries.is_some() {
        eprintln!("ledger recovery: {recovery}");
    }
    if ledger.budget_changes().len() > raises_before
        && let Some(raise) = ledger.budget_changes().last()
    {
        eprintln!(
            "privacy budget raised by the operator (--allow-budget-increase): target epsilon {} -> {} (recorded in the ledger)",
            raise.from, raise.to
        );
    }
    let mut model = model;
    model
        .set_state_dir(&dir)
        .context("handing the state directory to the model")?;
    let ckpt = checkpoint::load(&dir)?;
    let ckpt_meta = ckpt.as_ref().map(|(m, _)| m);
    let previous = resume::previous_report(&dir)?;
    resume::check_state(&dir, &ledger, ckpt_meta, previous.as_ref())?;
    let resume = resume::resume_point(&ledger, ckpt_meta, scenario.participation);
    let last_round = resume.next_round - 1;
    if let Some((meta, st)) = ckpt {
        model
            .restore(st)
            .context("restoring the model from the checkpoint")?;
        eprintln!(
            "resuming from checkpoint at round {} ({} ledger records; the ledger has {})",
            meta.round,
            meta.ledger_records,
            ledger.records().len()
        );
    }

    // A resumed expert-level run whose DataRelease is in the ledger already: D_stable comes
    // back from where it was published (a release is never run, nor charged, twice).
    let mut selective_report = None;
    if scenario.selective().is_some() && super::release::released_already(&ledger) {
        let obs_dim = match &scenario.task {
            fedrl_common::scenario::Task::OfflineCql(t) => {
                fedrl_tasks::offline_cql::OfflineCqlTaskExt::qnet_spec(t)?.obs_dim
            }
            _ => 0,
        };
        let (stable, summary) = super::release::load_for_resume(&dir, obs_dim)?;
        eprintln!(
            "DataRelease already accounted: {} released transitions read back",
            stable.len()
        );
        if summary.is_none() {
            eprintln!(
                "warning: no {} beside d_stable (published by an older version): the report will have no `selective` section",
                super::release::STABLE_SUMMARY_FILE
            );
        }
        selective_report = summary;
        model
            .stable_data()
            .context("this task trains on no released data")?
            .set_stable_data(stable)
            .context("handing the published D_stable to the model")?;
    }

    let cfg = crate::engine_config(&scenario)?;
    if model.params().len() != cfg.offer_dim {
        anyhow::bail!(
            "the model offers {} values but the task's offer has {}",
            model.params().len(),
            cfg.offer_dim
        );
    }

    // Before listening: a journal that cannot be continued stops the start here, not after
    // clients were told where to connect.
    let journal = open_journal(&dir.join(JOURNAL_FILE), scenario.journal)?;
    let endpoint = transport::create_endpoint(&opts, &identity, &secret)?;
    let addr = endpoint.local_addr()?;
    println!("fedrl aggregator listening on {addr}");
    println!("certificate SHA-256: {}", identity.fingerprint);
    let addr_file = AddressFile {
        addr,
        fingerprint: identity.fingerprint.clone(),
        pid: std::process::id(),
    };
    state::write_atomic(
        &dir.join(state::ADDRESS_FILE),
        &serde_json::to_vec_pretty(&addr_file)?,
    )?;

    let (engine_tx, engine_rx) = mpsc::channel::<Input>(1024);
    let shared = Arc::new(Shared {
        engine_tx: engine_tx.clone(),
        secret,
        max_frame: scenario.max_frame_bytes,
        permits: Arc::new(Semaphore::new(opts.max_inflight_updates.max(1))),
        pool: Arc::new(BufferPool {
            free: Mutex::new(Vec::new()),
            keep: opts.max_inflight_updates.max(1),
            allocated: AtomicU64::new(0),
        }),
        idle_window: IDLE_RECEIVE_WINDOW as u64,
        admitted_window: opts.tuning.receive_window as u64,
        stall_timeout: Duration::from_secs_f64(
            STALL_TIMEOUT_S.min(scenario.round_deadline_s.max(1.0) * 2.0),
        ),
        offer_permits: Arc::new(Semaphore::new(MAX_CONCURRENT_OFFERS)),
        welcome: Welcome {
            session: 0,
            task: scenario.task.to_wire()?,
            churn_json: serde_json::to_string(&scenario.churn)?,
            dim: cfg.dim as u32,
            clip_norm: scenario.clip_norm,
            max_frame_bytes: scenario.max_frame_bytes,
            seed: scenario.seed,
        },
        next_session: AtomicU64::new(1),
        clients: Mutex::new(HashMap::new()),
        bytes_ingested: AtomicU64::new(0),
        update_timeout: Duration::from_secs_f64(scenario.round_deadline_s.max(1.0) * 2.0),
        auth_timeout: Duration::from_secs_f64(AUTH_TIMEOUT_S),
        stats: opts.connection_stats.clone(),
    });

    let (done_tx, done_rx) = oneshot::channel::<anyhow::Result<RunReport>>();
    let engine_shared = shared.clone();
    // Entropy is injected: the OS CSPRNG, or the scenario's seed (reproducible, not private).
    let engine = Engine::new(cfg, resume, engine::for_seed(scenario.seed))?;
    // Contributions in released rounds before this start (a resumed run continues the count):
    // every unit listed in a training record contributed to a released output.
    let users_released = ledger
        .records()
        .iter()
        .filter(|r| r.phase != crate::engine::RELEASE_PHASE)
        .map(|r| r.units.len() as u64)
        .sum();
    let ctx = EngineThread {
        engine,
        journal,
        ledger,
        model,
        dir: dir.clone(),
        scenario: scenario.clone(),
        sessions: HashMap::new(),
        snapshot: Bytes::new(),
        started: Instant::now(),
        accepted: 0,
        rejected: 0,
        last_eval: None,
        final_eval: None,
        model_audit: None,
        users_released,
        shared: engine_shared,
        last_round,
        central: super::central::Central::for_scenario(&scenario)?,
        selective_report,
        ended_by_engine: false,
        failure: None,
        ledger_fault: super::driver::ledger_fault_from_env(),
        timings: Default::default(),
        pending_eval: None,
        checkpoint_due: false,
        round_stats: Default::default(),
    };
    std::thread::Builder::new()
        .name("fedrl-engine".into())
        .spawn(move || {
            let r = ctx.run(engine_rx);
            let _ = done_tx.send(r);
        })
        .context("starting the engine thread")?;

    // Ticks drive deadlines; a full channel just skips a tick.
    let tick_tx = engine_tx.clone();
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(Duration::from_millis(20));
        loop {
            iv.tick().await;
            match tick_tx.try_send(Input::Tick) {
                Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => {}
                Err(mpsc::error::TrySendError::Closed(_)) => break,
            }
        }
    });
    if let Some(sd) = shutdown {
        let tx = engine_tx.clone();
        tokio::spawn(async move {
            if sd.await.is_ok() {
                let _ = tx.send(Input::Shutdown).await;
            }
        });
    }

    let accept_ep = endpoint.clone();
    let accept_shared = shared.clone();
    let gate = Gate::new(
        Limits {
            max_connections: opts.max_connections,
            max_unauthenticated: opts.max_unauthenticated,
            max_unauthenticated_per_address: opts.max_unauthenticated_per_address,
        },
        opts.connection_stats.clone(),
    );
    let acceptor = tokio::spawn(async move {
        while let Some(incoming) = accept_ep.accept().await {
            // Decided from the first packet, before any handshake work: a refused attempt
            // costs one small close packet, and its client (if honest) retries with backoff.
            match gate.admit(incoming.remote_address().ip()) {
                Ok((open, auth)) => {
                    tokio::spawn(serve_connection(
                        accept_shared.clone(),
                        incoming,
                        open,
                        auth,
                    ));
                }
                Err(_) => incoming.refuse(),
            }
        }
    });

    let result = done_rx.await.context("the engine thread died")?;
    // Every close from now on says how the run ended: "finished" only when it is over,
    // "shutting down, come back" after an interrupt (the clients reconnect and find the restarted
    // aggregator), "error" after a failure. Connections still open (clients that reconnected
    // while the engine was stopping) get it from the endpoint's close; connections arriving
    // during the drain are not admitted any more, only told.
    let (outcome, reason) = match &result {
        Ok(r) => (r.public.outcome, r.public.finished.clone()),
        Err(e) => (Outcome::Failed, format!("{e:#}")),
    };
    let (code, close_reason, _) = super::driver::close_for(outcome, &reason);
    let close_reason: Bytes = Bytes::from(close_reason.chars().take(900).collect::<String>());
    acceptor.abort();
    let late_ep = endpoint.clone();
    let late_reason = close_reason.clone();
    let late = tokio::spawn(async move {
        while let Some(incoming) = late_ep.accept().await {
            let why = late_reason.clone();
            tokio::spawn(async move {
                if let Ok(connecting) = incoming.accept()
                    && let Ok(Ok(conn)) =
                        tokio::time::timeout(Duration::from_secs_f64(AUTH_TIMEOUT_S), connecting)
                            .await
                {
                    conn.close(VarInt::from_u32(code), &why[..]);
                }
            });
        }
    });
    // Let the writers deliver the final Leave messages, then close.
    tokio::time::sleep(Duration::from_secs_f64(opts.drain_s.min(0.5))).await;
    let deadline = Instant::now() + Duration::from_secs_f64(opts.drain_s);
    while Instant::now() < deadline && endpoint.open_connections() > 0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    endpoint.close(VarInt::from_u32(code), &close_reason[..]);
    late.abort();
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
    match result {
        Ok(r) if r.public.outcome == Outcome::Failed => Err(RunFailed {
            reason: r.public.finished,
        }
        .into()),
        Err(e) => Err(RunFailed {
            reason: format!("{e:#}"),
        }
        .into()),
        ok => ok,
    }
}

/// Opens the event journal for appending. Bytes at its end that are not a frame cut short
/// (garbage, not a torn write) stop the start with the file and what to do: the journal is an
/// operator-only record for inspection and replay (the privacy ledger is the durable record),
/// so moving it away loses no privacy accounting.
fn open_journal(
    path: &std::path::Path,
    mode: fedrl_common::scenario::JournalMode,
) -> anyhow::Result<JournalWriter> {
    JournalWriter::open(path, mode).map_err(|e| match e {
        JournalError::Corrupt { .. } => anyhow::anyhow!(
            "{e}. The event journal cannot be continued. It is an operator-only record for \
             inspection and replay, not the privacy accounting (that is the ledger): move it \
             away (e.g. `mv {p} {p}.damaged`) to resume with a new journal, or keep it for \
             inspection and start a new run in an empty state directory",
            p = path.display()
        ),
        e => anyhow::Error::new(e).context("opening the event journal"),
    })
}
