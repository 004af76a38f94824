//! Local deployments: start an aggregator and client agents as separate processes on loopback,
//! follow progress, and collect the results (`fedrl run`). Reusable: the RL tasks extend the
//! report (see [`RunResult::report`], a JSON object) without touching process management.
//!
//! Output directory layout ([`OUTPUT_FILES_GUIDE`] and the aggregator's diagnostics table,
//! written as `FILES.md`): public files at the
//! top (`scenario.toml`, `report.json`, `metrics.jsonl`, `tensorboard/`, the model, plots),
//! operator-only files
//! under `operator/` (`report.json` and `metrics.jsonl` with exact counts, `privacy.ledger`, the
//! processes' logs), and `state/` (the aggregator's state directory, operator-only as a whole).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fedrl_aggregator::service::{AddressFile, Outcome, PublicReport, read_address_file};
use fedrl_aggregator::state;
use fedrl_common::device::DeviceSpec;
use fedrl_common::protocol::auth::issue_token;
use fedrl_common::scenario::Scenario;

use crate::cmd::aggregator::{StopSignal, StopSignals};
use crate::overrides::{self, Override};

/// The built-in scenario (`fedrl run` with no file).
pub const DEFAULT_SCENARIO: &str = include_str!("../cartpole-dppg.toml");

/// `FILES.md` of a `fedrl run` output directory.
pub const OUTPUT_FILES_GUIDE: &str = "\
# Files in this `fedrl run` output directory

Public files are differentially private outputs, evaluations of the released models or the
scenario as run: they may be published. Operator-only files hold exact counts, unit ids, keys or logs: under Poisson sampling
the units drawn each round (and how many) must stay secret, because the privacy amplification
relies on it. Do not publish them.

| file | who | what |
| --- | --- | --- |
| `report.json` | public | epsilon/delta (epsilon null for a non-private twin), accountant, noise source, the final evaluation of the released model (`final_evaluation.final_eval_return`); fields described by `scenarios/report.schema.json` in the fedrl repository (the configuration is `scenario.toml`) |
| `metrics.jsonl` | public | per round: round, status, epsilon (on every released row: `epsilon_exact` false where it is the next accounted round's, an upper bound), delta, evaluation of the released model (`eval`; runs evaluated in Gymnasium environments, `gymnasium:` DPPG populations and offline CQL on `gymnasium:` datasets: computed by `fedrl run` after the aggregator ended, marked `deferred`, offline CQL's naming their `snapshot`; DPPG adds the policy's entropy and the value network's error on the evaluation episodes), public training diagnostics of the release (`diagnostics`: `update_norm` of the released noisy update, `step_norm` and `param_norm` of the offered parameters, the server's step size `server_lr`), time |
| `metrics.csv` | public | the same rows and columns as CSV |
| `tensorboard/events.out.tfevents.*` | public | the numbers of `metrics.jsonl`'s released rows as TensorBoard scalars (`tensorboard --logdir tensorboard`), step = round, one tag per field (`eval/eval_return`, `diagnostics/update_norm`, ...); one file per aggregator process (a resume adds one); `epsilon` only on the rows the aggregator accounted (`epsilon_exact` true); no `t_s`, and every event of a file carries the file's start time, so it reveals no per-round timing |
| `policy.safetensors` (or the task's model export) | public | the released model |
| `learning_curve.png` | public | evaluation return of released models per round (offline CQL: per training step, DP-SGD and free steps together) |
| `d_stable/` | public | expert-level runs: the trajectory prefixes released by the DataRelease, a Minari dataset root (`MINARI_DATASETS_PATH=d_stable`) |
| `synthetic/` | public | PrivORL: the released synthetic dataset, a Minari dataset root (`fedrl data list --data-dir synthetic`), its epsilon and delta in `privacy.json` and under `fedrl_privacy` in its metadata |
| `privorl_curve.png` | public | PrivORL: the synthesizer's denoising loss on held-out real transitions per fine-tuning step (held-out data, not units: not covered by epsilon, like the report's fidelity and reference utility) |
| `scenario.toml`, `twin-scenario.toml` | public | the scenario as run (kept as first run: `--resume` checks against it) |
| `scenario-resume-N.toml` | public | a resume's scenario, when it changed `target_epsilon` (`--resume --allow-budget-increase`) |
| `operator/report.json` | operator | the report plus exact counts (users, units, updates, bytes) and the client agents' summaries |
| `operator/metrics.jsonl` | operator | per round with exact counts (offered, accepted, clipped, rejected) and `operator_diagnostics`: the accepted updates' norms before clipping (`unit_norm_mean`, `unit_norm_max`), `clipped_fraction`, and in the central mode the training loss on the units' data (`train_loss`) |
| `operator/privacy.ledger` | operator | the privacy ledger: every released round and its unit ids (`fedrl ledger` reads it) |
| `operator/aggregator.log`, `operator/client-N.log` | operator | the processes' logs (a resume appends to them) |
| `state/` | operator (holds keys) | the aggregator's state directory (see its own `FILES.md`) |
| `twin/` | public/operator as above | the non-private twin's run (`--twin`), same layout |

Timings are public but not differentially private: `t_s` in `metrics.jsonl` (seconds from the
aggregator's start to the round's release), `wall_seconds` in `report.json` (seconds the
aggregator ran) and, in expert-level runs, `release_seconds`, `agents_ready_seconds` and
`started_after_seconds` under `selective.release` in `report.json` are wall-clock times published
without noise. They grow with the work done: a round's time with the number of units sampled
into it and the size of their data (the secret sample), the DataRelease's time with how many
steps of each candidate trajectory were walked (the candidates' and released prefixes' lengths).
The epsilon reported does not cover what they reveal. Drop these fields before publishing if
the sample size or the candidates' lengths must stay secret.
";

/// A prepared local run: the scenario and where its results go.
pub struct LocalRun {
    /// The scenario; its `device` (or the `--device` override written into it) is passed to the
    /// aggregator and to every client agent.
    pub scenario: Scenario,
    /// The scenario file the aggregator reads (inside `out_dir`).
    pub scenario_path: PathBuf,
    pub out_dir: PathBuf,
    /// Passed to the aggregator as `--allow-budget-increase`: a resumed run (`--resume`) may ask
    /// for a larger `target_epsilon` than its ledger's.
    pub allow_budget_increase: bool,
}

/// The scenario file of an output directory: the scenario as first run.
pub const SCENARIO_FILE: &str = "scenario.toml";

/// Why a prepared run may not use its output directory.
#[derive(Debug, thiserror::Error)]
pub enum OutDirError {
    #[error(
        "output directory {0} exists and is not empty (it holds an earlier run); pass --resume to continue that run, or choose another --out"
    )]
    NotEmpty(PathBuf),
    #[error("--resume: output directory {0} holds no run to resume (it is missing or empty)")]
    NothingToResume(PathBuf),
    #[error("--resume: {path} holds no readable scenario: {reason}")]
    NoStoredScenario { path: PathBuf, reason: String },
    #[error(
        "--resume: the scenario differs from the one this run started with ({path}):\n  {}\nresume with the stored scenario (leave SCENARIO out) or start a new run in another --out",
        .differences.join("\n  ")
    )]
    Differs {
        path: PathBuf,
        differences: Vec<String>,
    },
}

/// True when `dir` exists and has an entry.
fn has_entries(dir: &Path) -> anyhow::Result<bool> {
    match fs::read_dir(dir) {
        Ok(mut entries) => Ok(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| format!("reading {}", dir.display())),
    }
}

/// The fields in which two scenarios differ, as `field: stored X, given Y` (dotted paths into
/// their resolved TOML form).
pub(crate) fn differences(stored: &Scenario, given: &Scenario) -> anyhow::Result<Vec<String>> {
    let table = |s: &Scenario| -> anyhow::Result<toml::Table> {
        Ok(s.to_toml_string()?.parse::<toml::Table>()?)
    };
    let mut out = Vec::new();
    diff_tables("", &table(stored)?, &table(given)?, &mut out);
    if out.is_empty() && stored != given {
        // Not visible in the TOML form (it round-trips, so this should not happen).
        out.push("(a field without a TOML form)".into());
    }
    Ok(out)
}

fn diff_tables(prefix: &str, a: &toml::Table, b: &toml::Table, out: &mut Vec<String>) {
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    for k in keys {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match (a.get(k), b.get(k)) {
            (Some(toml::Value::Table(x)), Some(toml::Value::Table(y))) => {
                diff_tables(&path, x, y, out)
            }
            (x, y) if x == y => {}
            (x, y) => {
                let show =
                    |v: Option<&toml::Value>| v.map_or("(none)".to_string(), |v| v.to_string());
                out.push(format!("{path}: stored {}, given {}", show(x), show(y)));
            }
        }
    }
}

impl LocalRun {
    /// Reads the scenario (or the built-in one), builds its task's model (a scenario whose model
    /// cannot be built fails here), creates the output directory and writes the scenario into
    /// it. `device` overrides the scenario's `device`.
    ///
    /// An existing non-empty output directory is refused ([`OutDirError::NotEmpty`]) unless
    /// `resume`: then it must hold a run, whose stored `scenario.toml` is what runs when no
    /// scenario is given; a given one must resolve to the same scenario
    /// ([`OutDirError::Differs`]), except for `device` and `target_epsilon` (a raise still
    /// needs `--allow-budget-increase`, checked by the aggregator against its ledger). The
    /// stored `scenario.toml` is never rewritten.
    ///
    /// `sets` (`--set key=value`) are applied to the scenario's text before it is parsed and
    /// validated (see [`crate::overrides`]); the stored `scenario.toml` holds their result. On
    /// a resume they apply to the stored scenario when no file is given, and the result must
    /// still be the stored scenario (as a given file must).
    pub fn prepare(
        scenario: Option<&Path>,
        out: Option<&Path>,
        device: Option<DeviceSpec>,
        resume: bool,
        sets: &[Override],
    ) -> anyhow::Result<LocalRun> {
        let stored_path = out.map(|o| o.join(SCENARIO_FILE));
        let text = match (scenario, &stored_path) {
            (Some(p), _) => {
                fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?
            }
            (None, Some(stored)) if resume => {
                fs::read_to_string(stored).map_err(|e| OutDirError::NoStoredScenario {
                    path: stored.clone(),
                    reason: e.to_string(),
                })?
            }
            (None, _) => DEFAULT_SCENARIO.to_string(),
        };
        let mut parsed = overrides::load(&text, sets, fedrl_tasks::scenario_from_toml_str)
            .map_err(|e| match scenario {
                Some(p) => anyhow::anyhow!("{}: {e:#}", p.display()),
                None if resume => anyhow::anyhow!("stored scenario: {e:#}"),
                None => anyhow::anyhow!("built-in scenario: {e:#}"),
            })?;
        if let Some(d) = device {
            parsed.device = d;
        }
        // Fail before starting any process if this build cannot open the device.
        fedrl_rl::device::open(parsed.device)?;
        let out_dir = match out {
            Some(o) => o.to_path_buf(),
            None => {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                PathBuf::from("runs").join(format!("{}-{t}", parsed.name))
            }
        };
        let existing = has_entries(&out_dir)?;
        if existing && !resume {
            return Err(OutDirError::NotEmpty(out_dir).into());
        }
        if resume && !existing {
            return Err(OutDirError::NothingToResume(out_dir).into());
        }
        fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
        let stored_path = out_dir.join(SCENARIO_FILE);
        let scenario_path = if resume {
            let no_stored = |reason: String| OutDirError::NoStoredScenario {
                path: stored_path.clone(),
                reason,
            };
            let text = fs::read_to_string(&stored_path).map_err(|e| no_stored(e.to_string()))?;
            let mut stored =
                fedrl_tasks::scenario_from_toml_str(&text).map_err(|e| no_stored(e.to_string()))?;
            // Where it computes is no part of the run; the budget is the ledger's to check.
            stored.device = parsed.device;
            let raised_from = stored.target_epsilon;
            stored.target_epsilon = parsed.target_epsilon;
            let differences = differences(&stored, &parsed)?;
            if !differences.is_empty() {
                return Err(OutDirError::Differs {
                    path: stored_path,
                    differences,
                }
                .into());
            }
            if raised_from == parsed.target_epsilon {
                stored_path
            } else {
                // The aggregator must read the new budget; the first scenario stays as it was.
                let mut n = 1;
                while out_dir.join(format!("scenario-resume-{n}.toml")).exists() {
                    n += 1;
                }
                let p = out_dir.join(format!("scenario-resume-{n}.toml"));
                fs::write(&p, parsed.to_toml_string()?)
                    .with_context(|| format!("writing {}", p.display()))?;
                p
            }
        } else {
            // The scenario as resolved (`noise_multiplier = "auto"` and derived clip norms become
            // the numbers used), so the file says what ran and every process reads the same
            // values.
            fs::write(&stored_path, parsed.to_toml_string()?)?;
            stored_path
        };
        Ok(LocalRun {
            scenario: parsed,
            scenario_path,
            out_dir,
            allow_budget_increase: false,
        })
    }
}

/// What a local run produced.
pub struct RunResult {
    /// `report.json` as written (public): the aggregator's public report plus `wall_seconds` of
    /// the whole run. Extend it freely (it is a JSON object), with DP outputs only.
    pub report: serde_json::Value,
    /// `operator/report.json` as written (operator-only): the aggregator's whole report with its
    /// exact counts, `wall_seconds` and the client agents' summaries.
    pub operator: serde_json::Value,
}

/// Kills and reaps child processes when dropped (errors, panics, timeouts).
struct Children(Vec<(String, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in self.0.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Opens a process's log for appending: a resumed run keeps what the earlier processes wrote,
/// below a line that marks the new start.
fn log_file(path: &Path) -> anyhow::Result<(Stdio, Stdio)> {
    let mut f = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    if f.metadata()?.len() > 0 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        writeln!(
            f,
            "\n--- fedrl run: started again (resume) at unix time {t} ---"
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok((Stdio::from(f.try_clone()?), Stdio::from(f)))
}

/// The signal `fedrl run` caught (its number; 0: none). Caught from the first [`run_local`] on,
/// for the whole process.
fn stop_flag() -> anyhow::Result<&'static AtomicI32> {
    static FLAG: OnceLock<AtomicI32> = OnceLock::new();
    static WATCHING: OnceLock<()> = OnceLock::new();
    let flag = FLAG.get_or_init(|| AtomicI32::new(0));
    if WATCHING.get().is_none() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // Registered here, before any child starts, so no signal slips through.
        let mut signals = {
            let _guard = rt.enter();
            StopSignals::register()?
        };
        std::thread::Builder::new()
            .name("fedrl-signals".into())
            .spawn(move || {
                rt.block_on(async move {
                    loop {
                        let s = signals.first().await;
                        flag.store(s.number(), Ordering::SeqCst);
                    }
                })
            })
            .context("starting the signal thread")?;
        let _ = WATCHING.set(());
    }
    Ok(flag)
}

/// The signal `fedrl run` caught since its first [`run_local`], if any (work done after the
/// processes ended, such as deferred evaluations, checks it to stop early).
pub fn stop_requested() -> Option<StopSignal> {
    caught_signal(stop_flag().ok()?)
}

fn caught_signal(flag: &AtomicI32) -> Option<StopSignal> {
    match flag.load(Ordering::SeqCst) {
        libc::SIGINT => Some(StopSignal::Interrupt),
        libc::SIGTERM => Some(StopSignal::Terminate),
        _ => None,
    }
}

/// `fedrl run` was interrupted (SIGINT or SIGTERM): the signal went on to the aggregator and the
/// client agents; the aggregator wrote its state and report into `state/`, and `--resume`
/// continues the run.
#[derive(Debug, thiserror::Error)]
#[error(
    "interrupted ({}) after {released} rounds released; the run's state is kept: resume it with `fedrl run --out {} --resume`",
    .signal.name(),
    .out_dir.display()
)]
pub struct Interrupted {
    pub signal: StopSignal,
    pub released: u64,
    pub out_dir: PathBuf,
}

/// Sends `signal` to a child (which may have exited already: then nothing happens).
fn forward(child: &Child, signal: StopSignal) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) has no memory effects; `pid` is our child, not yet reaped (a reaped
        // child's pid could be reused, but `Children` reaps only when dropped).
        unsafe {
            libc::kill(pid, signal.number());
        }
    }
}

/// Copies what grows while a run runs (the ledger, both metrics files, the TensorBoard event
/// files) from the state directory into the output directory.
fn copy_progress(state_dir: &Path, out: &Path) -> anyhow::Result<()> {
    let tb = state_dir.join(state::TENSORBOARD_DIR);
    if tb.is_dir() {
        let dst = out.join(state::TENSORBOARD_DIR);
        fs::create_dir_all(&dst).context("creating tensorboard/")?;
        for entry in fs::read_dir(&tb).context("listing the event files")? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                fs::copy(entry.path(), dst.join(entry.file_name()))
                    .context("copying an event file")?;
            }
        }
    }
    let op_dir = out.join(state::OPERATOR_DIR);
    fs::copy(
        state_dir.join(state::LEDGER_FILE),
        op_dir.join(state::LEDGER_FILE),
    )
    .context("copying the ledger")?;
    fs::copy(
        state_dir.join(state::METRICS_FILE),
        out.join(state::METRICS_FILE),
    )
    .context("copying metrics.jsonl")?;
    fs::copy(
        state_dir
            .join(state::OPERATOR_DIR)
            .join(state::METRICS_FILE),
        op_dir.join(state::METRICS_FILE),
    )
    .context("copying operator/metrics.jsonl")?;
    Ok(())
}

/// Why the aggregator of a run stopped with an error, from the report it wrote (one written
/// since `since`: an earlier process's report says nothing about this one).
fn failure_reason(state_dir: &Path, since: std::time::SystemTime) -> Option<String> {
    let path = state_dir.join(state::REPORT_FILE);
    if fs::metadata(&path).ok()?.modified().ok()? < since {
        return None;
    }
    let text = fs::read_to_string(&path).ok()?;
    let report: PublicReport = serde_json::from_str(&text).ok()?;
    (report.outcome == Outcome::Failed).then_some(report.finished)
}

/// The aggregator's latest policy-phase line (PriMORL's SAC in the released model runs after
/// the rounds and prints one line per epoch to its log), from the log's last 8 KiB; `None`
/// before that phase.
fn policy_phase_status(log: &Path) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = fs::File::open(log).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(8192))).ok()?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf);
    text.lines()
        .rev()
        .find(|l| {
            l.trim_start().starts_with("SAC epoch")
                || l.starts_with("policy phase:")
                || l.starts_with("privorl:")
        })
        .map(|l| l.trim().to_string())
}

fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join("\n")
}

/// Starts `exe aggregator` with `state_dir` on `device` (and `extra_args`) and waits for its
/// address file.
pub fn spawn_aggregator(
    exe: &Path,
    scenario_path: &Path,
    state_dir: &Path,
    listen: &str,
    device: DeviceSpec,
    extra_args: &[&str],
    log: &Path,
) -> anyhow::Result<(Child, AddressFile)> {
    fs::create_dir_all(state_dir)?;
    let _ = fs::remove_file(state_dir.join(state::ADDRESS_FILE));
    let (out, err) = log_file(log)?;
    let mut child = Command::new(exe)
        .arg("aggregator")
        .arg("--scenario")
        .arg(scenario_path)
        .arg("--listen")
        .arg(listen)
        .arg("--state-dir")
        .arg(state_dir)
        .arg("--device")
        .arg(device.to_string())
        .args(extra_args)
        .stdout(out)
        .stderr(err)
        .spawn()
        .with_context(|| format!("starting {} aggregator", exe.display()))?;
    let t0 = Instant::now();
    loop {
        if let Ok(a) = read_address_file(state_dir)
            && a.pid == child.id()
        {
            return Ok((child, a));
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "the aggregator exited ({status}) before listening:\n{}",
                tail(log)
            );
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            bail!(
                "the aggregator did not start listening within 60 s:\n{}",
                tail(log)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts `exe client` for `token` hosting `users` (`A..B`), computing on `device`.
pub fn spawn_client(
    exe: &Path,
    addr: &AddressFile,
    token: &str,
    users: &str,
    device: DeviceSpec,
    log: &Path,
) -> anyhow::Result<Child> {
    let (out, err) = log_file(log)?;
    Command::new(exe)
        .arg("client")
        .arg("--server")
        .arg(addr.addr.to_string())
        .arg("--server-cert-sha256")
        .arg(&addr.fingerprint)
        .arg("--token")
        .arg(token)
        .arg("--users")
        .arg(users)
        .arg("--device")
        .arg(device.to_string())
        .stdout(out)
        .stderr(err)
        .spawn()
        .with_context(|| format!("starting {} client", exe.display()))
}

/// Runs `run` to completion: aggregator + `client_agents` client processes, progress bar (if
/// `progress`), results in `run.out_dir`.
pub fn run_local(
    run: &LocalRun,
    exe: &Path,
    timeout_s: f64,
    progress: bool,
) -> anyhow::Result<RunResult> {
    let t0 = Instant::now();
    let started = std::time::SystemTime::now();
    let stop = stop_flag()?;
    let out = &run.out_dir;
    let state_dir = out.join("state");
    fs::create_dir_all(&state_dir)?;
    // The parent issues the tokens, so it chooses the enrolment secret.
    let secret = state::random_secret()?;
    state::store_secret(&state_dir, &secret)?;
    let op_dir = out.join(state::OPERATOR_DIR);
    fs::create_dir_all(&op_dir).with_context(|| format!("creating {}", op_dir.display()))?;
    fs::write(
        out.join(state::FILES_GUIDE_FILE),
        format!("{OUTPUT_FILES_GUIDE}\n{}", state::DIAGNOSTICS_GUIDE),
    )?;
    let agg_log = op_dir.join("aggregator.log");
    let extra: &[&str] = if run.allow_budget_increase {
        &["--allow-budget-increase"]
    } else {
        &[]
    };
    let device = run.scenario.device;
    let (agg, addr) = spawn_aggregator(
        exe,
        &run.scenario_path,
        &state_dir,
        "127.0.0.1:0",
        device,
        extra,
        &agg_log,
    )?;
    let mut children = Children(vec![("aggregator".into(), agg)]);
    for i in 0..run.scenario.client_agents {
        let token = issue_token(&secret, &format!("agent-{i}"))?;
        let units = run.scenario.agent_units(i);
        let log = op_dir.join(format!("client-{i}.log"));
        let c = spawn_client(exe, &addr, &token, &units.to_string(), device, &log)?;
        children.0.push((format!("client-{i}"), c));
    }

    let bar = if progress {
        let b = indicatif::ProgressBar::new(run.scenario.rounds);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} round {pos}/{len} [{bar:30}] {msg} ({elapsed})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    // The progress bar is the operator's: it reads the exact counts.
    let op_metrics_path = state_dir
        .join(state::OPERATOR_DIR)
        .join(state::METRICS_FILE);
    // A signal to `fedrl run` goes on to every child (once); the aggregator then stops as it
    // does on its own signal, and has this long to write its state and report.
    let mut forwarded: Option<(StopSignal, Instant)> = None;
    const STOP_GRACE: Duration = Duration::from_secs(60);
    // A client that failed: the aggregator probably stopped for an error that it reports
    // better, so it gets a moment to exit first.
    let mut client_failed: Option<(String, ExitStatus, Instant)> = None;
    const CLIENT_FAILED_GRACE: Duration = Duration::from_secs(5);
    let mut released = 0u64;
    let (mut polls, mut phase) = (0u64, None::<String>);
    // Without a terminal the bar draws nothing, so a log (nohup, CI) gets a plain line at each
    // tenth of the rounds and at each new policy-phase status instead.
    let plain = progress && bar.is_hidden();
    let (mut logged_rounds, mut logged_phase) = (0u64, None::<String>);
    let agg_status = loop {
        // Asked before the metrics are read, so that the last read after the aggregator exits
        // sees all its rounds.
        let exited = children.0[0].1.try_wait()?;
        if let Ok(text) = fs::read_to_string(&op_metrics_path) {
            let (mut rel, mut ab) = (0u64, 0u64);
            let (mut users, mut epsilon, mut eval) = (0u64, None, None);
            for line in text.lines() {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                    continue; // a line being written
                };
                match v["status"].as_str() {
                    Some("released") => rel += 1,
                    Some("abandoned") => ab += 1,
                    _ => {}
                }
                users = v["users"].as_u64().unwrap_or(users);
                epsilon = v["epsilon"].as_f64().or(epsilon);
                eval = v["eval"]["eval_return"].as_f64().or(eval);
            }
            bar.set_position(rel + ab);
            released = rel;
            polls += 1;
            // About once a second: the policy phase, once the rounds are over.
            if polls % 10 == 0 {
                phase = policy_phase_status(&agg_log).or(phase);
            }
            // The plain line leaves out the exact user count (operator-only), which a log may
            // carry further than the operator's terminal.
            let mut tail = String::new();
            if let Some(e) = epsilon {
                tail += &format!(", epsilon {e:.4}");
            }
            if let Some(r) = eval {
                tail += &format!(", eval return {r:.1}");
            }
            let line = format!("{rel} released, {ab} abandoned{tail}");
            let mut msg = format!("{rel} released, {ab} abandoned, {users} users{tail}");
            if let Some(p) = &phase {
                msg = format!("{rel} rounds released; {p}");
            }
            let done = rel + ab;
            let elapsed = bar.elapsed().as_secs_f64();
            if plain
                && done != logged_rounds
                && crate::cmd::data::at_tenth(logged_rounds, done, run.scenario.rounds)
            {
                eprintln!(
                    "round {done}/{}: {line} ({elapsed:.0} s)",
                    run.scenario.rounds
                );
                logged_rounds = done;
            }
            if plain && phase.is_some() && phase != logged_phase {
                eprintln!("{msg} ({elapsed:.0} s)");
                logged_phase.clone_from(&phase);
            }
            bar.set_message(msg);
        }
        if let Some(status) = exited {
            break status;
        }
        if forwarded.is_none()
            && let Some(signal) = caught_signal(stop)
        {
            for (_, c) in &children.0 {
                forward(c, signal);
            }
            forwarded = Some((signal, Instant::now()));
        }
        if let Some((signal, at)) = forwarded {
            if at.elapsed() > STOP_GRACE {
                bar.abandon();
                // `children` kills them on the way out.
                eprintln!(
                    "the aggregator did not stop within {} s of the signal; killed",
                    STOP_GRACE.as_secs()
                );
                return Err(Interrupted {
                    signal,
                    released,
                    out_dir: out.clone(),
                }
                .into());
            }
        } else {
            if client_failed.is_none() {
                for (name, c) in children.0.iter_mut().skip(1) {
                    if let Some(status) = c.try_wait()?
                        && !status.success()
                    {
                        client_failed = Some((name.clone(), status, Instant::now()));
                        break;
                    }
                }
            }
            if let Some((name, status, at)) = &client_failed
                && at.elapsed() > CLIENT_FAILED_GRACE
            {
                bar.abandon();
                bail!(
                    "{name} exited ({status}):\n{}",
                    tail(&op_dir.join(format!("{name}.log")))
                );
            }
            if t0.elapsed().as_secs_f64() > timeout_s {
                bar.abandon();
                bail!("the run did not finish within {timeout_s} s");
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if let Some((signal, _)) = forwarded {
        bar.abandon();
        // The clients leave on their signal; what the run has so far is copied out (the ledger
        // and metrics grow by appending), but report.json is only written by a run that ends.
        let deadline = Instant::now() + Duration::from_secs(5);
        for (_, c) in children.0.iter_mut().skip(1) {
            while c.try_wait()?.is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        drop(children);
        let _ = copy_progress(&state_dir, out);
        return Err(Interrupted {
            signal,
            released,
            out_dir: out.clone(),
        }
        .into());
    }
    if !agg_status.success() {
        bar.abandon();
        drop(children);
        let _ = copy_progress(&state_dir, out);
        if let Some(reason) = failure_reason(&state_dir, started) {
            bail!(
                "the run stopped with an error: {reason}\n(aggregator log: {}; once the cause is fixed, `fedrl run --out {} --resume` continues the run)",
                agg_log.display(),
                out.display()
            );
        }
        bail!("the aggregator exited ({agg_status}):\n{}", tail(&agg_log));
    }
    if let Some((name, status, _)) = client_failed {
        bar.abandon();
        bail!(
            "{name} exited ({status}):\n{}",
            tail(&op_dir.join(format!("{name}.log")))
        );
    }
    bar.finish();
    // Clients leave on the aggregator's "finished"; give them a moment, then stop them.
    let mut clients = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    for (name, c) in children.0.iter_mut().skip(1) {
        let status = loop {
            if let Some(s) = c.try_wait()? {
                break Some(s);
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let log = op_dir.join(format!("{name}.log"));
        let summary = fs::read_to_string(&log)
            .ok()
            .and_then(|t| {
                t.lines()
                    .rev()
                    .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            })
            .unwrap_or(serde_json::Value::Null);
        clients.push(serde_json::json!({
            "name": name,
            "exit": status.map(|s| s.to_string()).unwrap_or_else(|| "killed after 10 s".into()),
            "summary": summary,
        }));
    }
    drop(children);

    let read_json = |path: PathBuf| -> anyhow::Result<serde_json::Value> {
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    };
    let wall = serde_json::json!(t0.elapsed().as_secs_f64());
    let mut report = read_json(state_dir.join(state::REPORT_FILE))?;
    let mut operator = read_json(state_dir.join(state::OPERATOR_DIR).join(state::REPORT_FILE))?;
    for r in [&mut report, &mut operator] {
        if let Some(obj) = r.as_object_mut() {
            obj.insert(
                "aggregator_wall_seconds".into(),
                obj.get("wall_seconds").cloned().unwrap_or_default(),
            );
            obj.insert("wall_seconds".into(), wall.clone());
        }
    }
    if let Some(obj) = operator.as_object_mut() {
        obj.insert("client_agents".into(), serde_json::Value::Array(clients));
    }
    copy_progress(&state_dir, out)?;
    fs::write(
        out.join(state::REPORT_FILE),
        serde_json::to_vec_pretty(&report)?,
    )?;
    fs::write(
        op_dir.join(state::REPORT_FILE),
        serde_json::to_vec_pretty(&operator)?,
    )?;
    Ok(RunResult { report, operator })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_progress_line_follows_the_policy_phase() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("aggregator.log");
        assert_eq!(policy_phase_status(&log), None);
        fs::write(&log, "WARN something\n").unwrap();
        assert_eq!(policy_phase_status(&log), None);
        let mut text = "x".repeat(20_000);
        text += "\npolicy phase: SAC in the private model (15 epochs of 1000 updates)\n";
        fs::write(&log, &text).unwrap();
        assert!(
            policy_phase_status(&log)
                .unwrap()
                .starts_with("policy phase:")
        );
        text += "  SAC epoch   2/15: return  -1248.58 (normalised   167.6), 56 s\n";
        fs::write(&log, &text).unwrap();
        assert!(
            policy_phase_status(&log)
                .unwrap()
                .starts_with("SAC epoch   2/15")
        );
    }
}
