//! Local deployments: start an aggregator and client agents as separate processes on loopback,
//! follow progress, and collect the results (`fedrl run`). Reusable: the RL tasks extend the
//! report (see [`RunResult::report`], a JSON object) without touching process management.
//!
//! Output directory layout ([`OUTPUT_FILES_GUIDE`], written as `FILES.md`): public files at the
//! top (`scenario.toml`, `report.json`, `metrics.jsonl`, the model, plots), operator-only files
//! under `operator/` (`report.json` and `metrics.jsonl` with exact counts, `privacy.ledger`, the
//! processes' logs), and `state/` (the aggregator's state directory, operator-only as a whole).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fedrl_aggregator::service::{AddressFile, read_address_file};
use fedrl_aggregator::state;
use fedrl_common::device::DeviceSpec;
use fedrl_common::protocol::auth::issue_token;
use fedrl_common::scenario::Scenario;

/// The built-in scenario (`fedrl run` with no file).
pub const DEFAULT_SCENARIO: &str = include_str!("../cartpole-dppg.toml");

/// `FILES.md` of a `fedrl run` output directory.
pub const OUTPUT_FILES_GUIDE: &str = "\
# Files in this `fedrl run` output directory

Public files are differentially private outputs or the run's configuration: they may be
published. Operator-only files hold exact counts, unit ids, keys or logs: under Poisson sampling
the units drawn each round (and how many) must stay secret, because the privacy amplification
relies on it. Do not publish them.

| file | who | what |
| --- | --- | --- |
| `report.json` | public | epsilon/delta, accountant, noise source, evaluations of the released model, run configuration |
| `metrics.jsonl` | public | per round: round, status, epsilon, delta, evaluation of the released model, time |
| `policy.safetensors` (or the task's model export) | public | the released model |
| `learning_curve.png` | public | evaluation return of released models per round |
| `d_stable/` | public | expert-level runs: the trajectory prefixes released by the DataRelease, a Minari dataset root (`MINARI_DATASETS_PATH=d_stable`) |
| `scenario.toml`, `twin-scenario.toml` | public | the scenario as run |
| `operator/report.json` | operator | the report plus exact counts (users, units, updates, bytes) and the client agents' summaries |
| `operator/metrics.jsonl` | operator | per round with exact counts (offered, accepted, clipped, rejected) |
| `operator/privacy.ledger` | operator | the privacy ledger: every released round and its unit ids (`fedrl ledger` reads it) |
| `operator/aggregator.log`, `operator/client-N.log` | operator | the processes' logs |
| `state/` | operator (holds keys) | the aggregator's state directory (see its own `FILES.md`) |
| `twin/` | public/operator as above | the non-private twin's run (`--twin`), same layout |
";

/// A prepared local run: the scenario and where its results go.
pub struct LocalRun {
    /// The scenario; its `device` (or the `--device` override written into it) is passed to the
    /// aggregator and to every client agent.
    pub scenario: Scenario,
    /// The scenario file the aggregator reads (inside `out_dir`).
    pub scenario_path: PathBuf,
    pub out_dir: PathBuf,
    /// Passed to the aggregator as `--allow-budget-increase`: a resumed run (an `out_dir` that
    /// already holds `state/`) may ask for a larger `target_epsilon` than its ledger's.
    pub allow_budget_increase: bool,
}

impl LocalRun {
    /// Reads the scenario (or the built-in one), builds its task's model (a scenario whose model
    /// cannot be built fails here), creates the output directory and writes the scenario into
    /// it. `device` overrides the scenario's `device`.
    pub fn prepare(
        scenario: Option<&Path>,
        out: Option<&Path>,
        device: Option<DeviceSpec>,
    ) -> anyhow::Result<LocalRun> {
        let text = match scenario {
            Some(p) => fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            None => DEFAULT_SCENARIO.to_string(),
        };
        let mut parsed =
            fedrl_rl::task::scenario_from_toml_str(&text).map_err(|e| match scenario {
                Some(p) => anyhow::anyhow!("{}: {e}", p.display()),
                None => anyhow::anyhow!("built-in scenario: {e}"),
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
        fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
        let scenario_path = out_dir.join("scenario.toml");
        // The scenario as resolved (`noise_multiplier = "auto"` and derived clip norms become the
        // numbers used), so the file says what ran and every process reads the same values.
        fs::write(&scenario_path, parsed.to_toml_string()?)?;
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

fn log_file(path: &Path) -> anyhow::Result<(Stdio, Stdio)> {
    let f = fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    Ok((Stdio::from(f.try_clone()?), Stdio::from(f)))
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
    let out = &run.out_dir;
    let state_dir = out.join("state");
    fs::create_dir_all(&state_dir)?;
    // The parent issues the tokens, so it chooses the enrolment secret.
    let secret = state::random_secret()?;
    state::store_secret(&state_dir, &secret)?;
    let op_dir = out.join(state::OPERATOR_DIR);
    fs::create_dir_all(&op_dir).with_context(|| format!("creating {}", op_dir.display()))?;
    fs::write(out.join(state::FILES_GUIDE_FILE), OUTPUT_FILES_GUIDE)?;
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
    let agg_status = loop {
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
            let mut msg = format!("{rel} released, {ab} abandoned, {users} users");
            if let Some(e) = epsilon {
                msg += &format!(", epsilon {e:.4}");
            }
            if let Some(r) = eval {
                msg += &format!(", eval return {r:.1}");
            }
            bar.set_message(msg);
        }
        if let Some(status) = children.0[0].1.try_wait()? {
            break status;
        }
        for (name, c) in children.0.iter_mut().skip(1) {
            if let Some(status) = c.try_wait()?
                && !status.success()
            {
                bar.abandon();
                bail!(
                    "{name} exited ({status}):\n{}",
                    tail(&op_dir.join(format!("{name}.log")))
                );
            }
        }
        if t0.elapsed().as_secs_f64() > timeout_s {
            bar.abandon();
            bail!("the run did not finish within {timeout_s} s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    bar.finish();
    if !agg_status.success() {
        bail!("the aggregator exited ({agg_status}):\n{}", tail(&agg_log));
    }
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
    fs::copy(&op_metrics_path, op_dir.join(state::METRICS_FILE))
        .context("copying operator/metrics.jsonl")?;
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
