//! The held-out evaluations of a run whose evaluation environment is a Gymnasium one, done by
//! `fedrl run` once the aggregator has ended: DPPG on a `gymnasium:<id>` population, and
//! offline CQL on a dataset recorded in a Gymnasium environment (`task.dataset.env =
//! "gymnasium:<id>"`). The aggregator runs no Python (DESIGN §2.6), so for such a run its server
//! model evaluates nothing: at each evaluation it keeps the released model as a snapshot in its
//! state directory (`state/eval-snapshots/`, [`fedrl_tasks::eval_snapshots`]: DPPG's
//! `round-R.safetensors` at each evaluation round, offline CQL's `step-S.safetensors` at each
//! `eval_every` training step, named in the evaluation's `snapshot` field) and marks the
//! evaluation `{"deferred": true}` (offline CQL's also keep their `step` and `dp_steps`); its
//! final evaluation is `{"deferred": true}` (offline CQL's with its `curve` of marks and public
//! step counts). This process (which may start Python: client agents do) then
//!
//! 1. evaluates each marked evaluation's snapshot through the bridge, the workers started once
//!    for all of them, on exactly the episodes the aggregator's own evaluation would play: DPPG
//!    on the held-out users and reset seeds of `fedrl_tasks::dppg::held_out`, offline CQL
//!    greedily in the dataset's default environment on `eval_episodes` episodes reset from
//!    `eval_seed`, at most `eval_max_steps` steps each (as `CqlModel` evaluates in a Rust
//!    environment). It fills the evaluation with `eval_return`, `eval_return_std` and
//!    `eval_episodes` (keeping `deferred: true`: it says where the figures were computed) in the
//!    public `metrics.jsonl`, in `operator/metrics.jsonl`, and, for offline CQL, in the report's
//!    `final_evaluation.curve` (the learning curve by training step: a Selective run's free
//!    steps have evaluations no round line carries);
//! 2. selects the model as the aggregator would: DPPG exports the best-evaluated snapshot (the
//!    first of equal returns, its `keep_best`), else the aggregator's export (the last model);
//!    offline CQL exports the final network, never selected by evaluation, so its export stays;
//! 3. runs the final evaluation of that model (DPPG: on the final-evaluation users, with
//!    `selected_model_eval_return`; offline CQL: `final_eval_episodes` episodes from
//!    `final_eval_seed`) and writes it into the report's `final_evaluation`.
//!
//! A standalone `fedrl aggregator` (not under `fedrl run`) ends with the same deferred rows in
//! its state directory and says so; `fedrl eval --deferred STATE_DIR --scenario FILE` then does
//! the same three steps there ([`complete_state_dir`]: the state directory is its own public
//! folder, its `report.json` and `operator/report.json` get the final evaluation).
//!
//! Invariants: only released models are evaluated (the snapshots, kept after the ledger record
//! of the release that produced them was durable, and the export) and only released rows are
//! filled: DP outputs. The aggregator's own files in `state/` are left as written except
//! `policy.safetensors`, DPPG's export, which becomes the selected model; the public copies in
//! the output directory are completed. Every step is recomputed from the snapshots after each
//! `fedrl run` (a `--resume` copies the aggregator's unfilled lines again; a filled or failed
//! evaluation whose snapshot exists is evaluated again), so a resumed run ends as an
//! uninterrupted one. A failed evaluation becomes `eval_error` (`final_eval_error`) as in the
//! aggregator; the run stands.
//!
//! PriMORL on a dataset recorded in a Gymnasium environment defers its policy phase's
//! per-epoch evaluations instead (they live in the final evaluation, not in round lines):
//! [`primorl`] completes them, from [`complete`]; `fedrl eval --deferred` does not yet.

mod primorl;

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use fedrl_aggregator::state;
use fedrl_common::offline::{DatasetSource, DatasetSpec};
use fedrl_common::scenario::{Scenario, Task};
use fedrl_common::task::{DppgTask, OfflineCqlTask};
use fedrl_rl::offline::QNetSpec;
use fedrl_rl::offline::gym::GreedyGymEvaluator;
use fedrl_tasks::dppg::held_out::{self, GymEvaluator};
use fedrl_tasks::dppg::{POLICY_FILE, gymnasium_of};
use fedrl_tasks::offline_cql::server::{final_eval_seed, read_snapshot};
use fedrl_tasks::offline_cql::{QNET_FILE, evaluates_in_gymnasium};
use fedrl_tasks::server::{BestModel, final_evaluation_json, keep_best};
use serde_json::Value;

use crate::deploy::{LocalRun, RunResult};

/// Whether a metrics line's or a report's evaluation waits for this step.
fn is_deferred(eval: &Value) -> bool {
    eval["deferred"] == true
}

/// Whether `report` (a run's `report.json`) still waits for its deferred final evaluation: the
/// aggregator ended but `fedrl run` was stopped before it evaluated (such a run is resumed, not
/// read back as finished).
pub fn pending(report: &Value) -> bool {
    let fe = &report["final_evaluation"];
    is_deferred(fe) && fe.get("final_eval_return").is_none() && fe.get("final_eval_error").is_none()
}

/// A run whose aggregator leaves its evaluations to this step.
enum Deferring<'a> {
    /// DPPG on a `gymnasium:<id>` population.
    Dppg(&'a DppgTask),
    /// Offline CQL on a dataset recorded in a Gymnasium environment.
    Cql(&'a OfflineCqlTask, &'a DatasetSpec),
}

/// What `scenario`'s aggregator defers, if anything.
fn deferring(scenario: &Scenario) -> Option<Deferring<'_>> {
    match &scenario.task {
        Task::Dppg(t) if gymnasium_of(t).is_some() => Some(Deferring::Dppg(t)),
        Task::OfflineCql(t) if evaluates_in_gymnasium(t) => match &t.dataset {
            DatasetSource::Generated(d) => Some(Deferring::Cql(t, d)),
            DatasetSource::Stored(_) => None,
        },
        _ => None,
    }
}

/// Whether `scenario` is one whose aggregator leaves its evaluations to another process (a
/// `gymnasium:<id>` DPPG population, or offline CQL on a dataset recorded in Gymnasium).
pub fn defers_evaluations(scenario: &Scenario) -> bool {
    deferring(scenario).is_some()
}

/// The fields of an evaluation that this step writes (anything else a mark carries, such as
/// offline CQL's `step` or the `snapshot` name, is kept).
const EVAL_FIELDS: [&str; 6] = [
    "eval_return",
    "eval_return_std",
    "eval_episodes",
    "eval_policy_entropy",
    "eval_value_rmse",
    "eval_error",
];

impl Deferring<'_> {
    /// The snapshot of a deferred evaluation `eval` (of the row of `round`, if on a row): DPPG's
    /// by its round, offline CQL's by its own `snapshot` field; `None` when the aggregator kept
    /// none.
    fn snapshot(&self, round: Option<u64>, eval: &Value) -> Option<String> {
        match self {
            Deferring::Dppg(_) => round.map(held_out::snapshot_name),
            Deferring::Cql(..) => eval["snapshot"].as_str().map(str::to_string),
        }
    }

    /// What a progress line calls an evaluation: its round (DPPG) or training step (offline
    /// CQL).
    fn label(&self, round: Option<u64>, eval: &Value) -> String {
        match self {
            Deferring::Dppg(_) => format!("round {}", round.unwrap_or(0)),
            Deferring::Cql(..) => format!("step {}", eval["step"]),
        }
    }

    /// Starts the bridge's workers the evaluations need.
    fn start<'b>(&'b self, scenario: &Scenario) -> anyhow::Result<Evaluator<'b>> {
        Ok(match *self {
            Deferring::Dppg(task) => Evaluator::Dppg {
                ev: GymEvaluator::start(task, fedrl_rl::device::open(scenario.device)?)?,
                task,
                training_users: scenario.users,
            },
            Deferring::Cql(task, dataset) => Evaluator::Cql {
                ev: GreedyGymEvaluator::start(dataset)?,
                task,
            },
        })
    }
}

/// The bridge's workers of a run's deferred evaluations, started once for all of them (they end
/// when it is dropped).
enum Evaluator<'a> {
    Dppg {
        ev: GymEvaluator,
        task: &'a DppgTask,
        training_users: u64,
    },
    Cql {
        ev: GreedyGymEvaluator,
        task: &'a OfflineCqlTask,
    },
}

/// An evaluation's metrics fields (`eval_*`), its mean return and the evaluated parameters.
type Evaluated = (Value, f64, Vec<f32>);

impl Evaluator<'_> {
    /// The periodic evaluation of the snapshot `name` in the state directory `state_dir`.
    fn periodic(&mut self, state_dir: &Path, name: &str) -> anyhow::Result<Evaluated> {
        match self {
            Evaluator::Dppg {
                ev,
                task,
                training_users,
            } => {
                let params = held_out::read_snapshot_named(state_dir, name)?;
                let e = ev.evaluate(&params, held_out::periodic_users(task, *training_users))?;
                Ok((e.to_json(), e.mean, params))
            }
            Evaluator::Cql { ev, task } => {
                let (spec, params) = read_snapshot(state_dir, name)?;
                let r = ev.evaluate(
                    &spec,
                    &params,
                    task.eval_episodes,
                    task.eval_seed,
                    task.eval_max_steps,
                )?;
                Ok((q_eval_json(&r), r.mean, params))
            }
        }
    }

    /// The final evaluation of `params` (DPPG's selected model; offline CQL's exported network
    /// is read from `state_dir`), in `eval_*` fields.
    fn final_eval(&mut self, state_dir: &Path, params: &[f32]) -> anyhow::Result<Value> {
        let t = Instant::now();
        match self {
            Evaluator::Dppg {
                ev,
                task,
                training_users,
            } => {
                let users = held_out::final_users(task, *training_users);
                let e = ev.evaluate(params, users.clone())?;
                eprintln!(
                    "  final evaluation on users {}..{}: return {:.2} ± {:.2} over {} episodes ({:.1} s)",
                    users.start,
                    users.end,
                    e.mean,
                    e.std,
                    e.episodes,
                    t.elapsed().as_secs_f64()
                );
                Ok(e.to_json())
            }
            Evaluator::Cql { ev, task } => {
                let path = state_dir.join(QNET_FILE);
                let (spec, params) = QNetSpec::load_file(&path).with_context(|| {
                    format!("reading the exported Q-network {}", path.display())
                })?;
                let r = ev.evaluate(
                    &spec,
                    &params,
                    task.final_eval_episodes,
                    final_eval_seed(task),
                    task.eval_max_steps,
                )?;
                eprintln!(
                    "  final evaluation of the exported Q-network: return {:.2} ± {:.2} over {} episodes ({:.1} s)",
                    r.mean,
                    r.std,
                    r.returns.len(),
                    t.elapsed().as_secs_f64()
                );
                Ok(q_eval_json(&r))
            }
        }
    }
}

/// A Q-network's greedy evaluation in the metrics fields `CqlModel` writes.
fn q_eval_json(r: &fedrl_rl::EvalResult) -> Value {
    serde_json::json!({
        "eval_return": r.mean,
        "eval_return_std": r.std,
        "eval_episodes": r.returns.len(),
    })
}

/// The deferred evaluation `mark` completed with `result`: the mark's own fields (`deferred`,
/// offline CQL's `step`, `dp_steps`, `snapshot`) and the evaluation's, or its `eval_error`.
fn filled(mark: &Value, result: &Result<Value, String>) -> Value {
    let mut e = mark.clone();
    if let Some(obj) = e.as_object_mut() {
        for k in EVAL_FIELDS {
            obj.remove(k);
        }
        match result {
            Ok(Value::Object(fields)) => obj.extend(fields.clone()),
            Ok(other) => {
                obj.insert(
                    "eval_error".into(),
                    format!("not an evaluation: {other}").into(),
                );
            }
            Err(why) => {
                obj.insert("eval_error".into(), why.clone().into());
            }
        }
        obj.insert("deferred".into(), Value::Bool(true));
    }
    e
}

/// Completes the evaluations of a finished run in `run.out_dir` whose aggregator deferred them
/// (see the module doc); nothing for any other run. Returns whether it did anything.
pub fn complete(run: &LocalRun, result: &mut RunResult) -> anyhow::Result<bool> {
    let out = &run.out_dir;
    let rows = complete_in(&run.scenario, &out.join("state"), out, &mut result.report)?;
    // PriMORL's deferred evaluations are its policy phase's epochs, not metrics rows.
    let policy = primorl::complete(run, result)?;
    Ok(rows || policy)
}

/// [`complete`] for any layout: the aggregator's state directory `state_dir` (snapshots, the
/// exported model) and the folder `public_dir` whose `metrics.jsonl`,
/// `operator/metrics.jsonl` and `tensorboard/` are filled (`fedrl run`'s output directory, or
/// the state directory itself for a standalone aggregator: `fedrl eval --deferred`); `report`
/// gets the final evaluation (and offline CQL's curve). Returns whether it did anything.
pub fn complete_in(
    scenario: &Scenario,
    state_dir: &Path,
    public_dir: &Path,
    report: &mut Value,
) -> anyhow::Result<bool> {
    let Some(kind) = deferring(scenario) else {
        return Ok(false);
    };
    let out = public_dir;
    let public_path = out.join(state::METRICS_FILE);
    let mut rows = read_rows(&public_path)?;
    // An evaluation waits when it is deferred and its snapshot was kept: not yet evaluated, or
    // evaluated by an earlier completion (recomputed), or failed there (tried again). One the
    // aggregator could not keep stays with its `eval_error`.
    let waits = |round: Option<u64>, eval: &Value| -> Option<String> {
        if !is_deferred(eval) {
            return None;
        }
        let name = kind.snapshot(round, eval)?;
        let kept = fedrl_tasks::eval_snapshots::path(state_dir, &name).exists();
        (eval.get("eval_error").is_none() || kept).then_some(name)
    };
    let pending_rows: Vec<(usize, String)> = rows
        .iter()
        .enumerate()
        .filter_map(|(i, r)| match r {
            Row::Json(v) if v["status"] == "released" => {
                waits(v["round"].as_u64(), &v["eval"]).map(|n| (i, n))
            }
            _ => None,
        })
        .collect();
    let curve: Vec<Value> = report["final_evaluation"]["curve"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let pending_curve: Vec<(usize, String)> = curve
        .iter()
        .enumerate()
        .filter_map(|(i, e)| waits(None, e).map(|n| (i, n)))
        .collect();
    let final_deferred = is_deferred(&report["final_evaluation"]);
    if pending_rows.is_empty() && pending_curve.is_empty() && !final_deferred {
        return Ok(false);
    }
    // Each snapshot once, in training order: the curve's (every evaluation step), then any row
    // the curve lacks (the rounds of a timeline a crash cut off; DPPG has no curve).
    let mut jobs: Vec<(String, String)> = Vec::new();
    for (i, name) in &pending_curve {
        if !jobs.iter().any(|(n, _)| n == name) {
            jobs.push((name.clone(), kind.label(None, &curve[*i])));
        }
    }
    for (i, name) in &pending_rows {
        if let Row::Json(v) = &rows[*i]
            && !jobs.iter().any(|(n, _)| n == name)
        {
            jobs.push((name.clone(), kind.label(v["round"].as_u64(), &v["eval"])));
        }
    }
    let t0 = Instant::now();
    eprintln!(
        "evaluating {} released models through the Gymnasium bridge (the aggregator runs no \
         Python){}",
        jobs.len(),
        if final_deferred {
            ", then the final evaluation"
        } else {
            ""
        }
    );
    let mut evaluator = kind.start(scenario).map_err(|e| format!("{e:#}"));
    let mut best: BestModel = None;
    let mut results: HashMap<String, Result<Value, String>> = HashMap::new();
    for (k, (name, label)) in jobs.iter().enumerate() {
        // Ctrl-C or SIGTERM: stop between evaluations; the report keeps its deferred final
        // evaluation, so `--resume` does them again.
        if let Some(signal) = crate::deploy::stop_requested() {
            return Err(crate::deploy::Interrupted {
                signal,
                released: report["rounds_completed"].as_u64().unwrap_or(0),
                out_dir: out.to_path_buf(),
            }
            .into());
        }
        let t = Instant::now();
        let evaluated = match &mut evaluator {
            Ok(ev) => ev.periodic(state_dir, name).map_err(|e| format!("{e:#}")),
            Err(e) => Err(e.clone()),
        };
        let n = jobs.len();
        let result = match evaluated {
            Ok((fields, mean, params)) => {
                eprintln!(
                    "  {label} ({}/{n}): eval return {mean:.2} ± {:.2} over {} episodes ({:.1} s)",
                    k + 1,
                    fields["eval_return_std"].as_f64().unwrap_or(f64::NAN),
                    fields["eval_episodes"],
                    t.elapsed().as_secs_f64()
                );
                // DPPG's model selection (offline CQL exports its final network).
                if let Deferring::Dppg(_) = kind {
                    keep_best(&mut best, mean, &params);
                }
                Ok(fields)
            }
            Err(e) => {
                eprintln!("  {label} ({}/{n}): evaluation failed: {e}", k + 1);
                Err(e)
            }
        };
        results.insert(name.clone(), result);
    }
    let missing = || Err("not evaluated".to_string());
    for (i, name) in &pending_rows {
        if let Row::Json(row) = &mut rows[*i] {
            row["eval"] = filled(&row["eval"], results.get(name).unwrap_or(&missing()));
        }
    }
    write_rows(&public_path, &rows)?;
    fill_operator_rows(
        &out.join(state::OPERATOR_DIR).join(state::METRICS_FILE),
        &rows,
    )?;
    write_tensorboard(&out.join("tensorboard"), &rows)
        .context("writing the evaluations' TensorBoard events")?;
    let mut curve = curve;
    for (i, name) in &pending_curve {
        curve[*i] = filled(&curve[*i], results.get(name).unwrap_or(&missing()));
    }

    // DPPG's exported policy: the best evaluated snapshot, else the aggregator's export (the
    // last released model), as the aggregator's `keep_best` selection would have it.
    let chosen: Result<Vec<f32>, String> = match kind {
        Deferring::Dppg(task) => {
            let policy_path = state_dir.join(POLICY_FILE);
            match &best {
                Some((_, params)) => {
                    let spec = task_spec(task)?;
                    fedrl_rl::io::save(&policy_path, &spec, params)
                        .with_context(|| format!("writing {}", policy_path.display()))?;
                    Ok(params.clone())
                }
                None => fedrl_rl::io::load(&policy_path)
                    .map(|(_, p)| p)
                    .map_err(|e| {
                        format!("reading the exported policy {}: {e}", policy_path.display())
                    }),
            }
        }
        // The exported network, read by the final evaluation itself.
        Deferring::Cql(..) => Ok(Vec::new()),
    };
    if final_deferred {
        let eval = match (&mut evaluator, chosen) {
            (Ok(ev), Ok(params)) => ev.final_eval(state_dir, &params),
            (Err(e), _) => Err(anyhow::anyhow!("{e}")),
            (_, Err(e)) => Err(anyhow::anyhow!("{e}")),
        };
        if let Err(e) = &eval {
            eprintln!("  final evaluation failed: {e:#}");
        }
        let fe = match kind {
            Deferring::Dppg(_) => {
                let mut fe = final_evaluation_json(eval, &best);
                fe["deferred"] = Value::Bool(true);
                fe
            }
            Deferring::Cql(..) => {
                // The aggregator's public step counts stay; the figures are replaced.
                let mut fe = report["final_evaluation"].clone();
                if let Some(obj) = fe.as_object_mut() {
                    obj.retain(|k, _| !k.starts_with("final_eval_"));
                    match eval {
                        Ok(Value::Object(fields)) => {
                            obj.extend(fields.into_iter().map(|(k, v)| (format!("final_{k}"), v)));
                        }
                        Ok(other) => {
                            obj.insert(
                                "final_eval_error".into(),
                                format!("not an evaluation: {other}").into(),
                            );
                        }
                        Err(e) => {
                            obj.insert("final_eval_error".into(), format!("{e:#}").into());
                        }
                    }
                    if !curve.is_empty() {
                        obj.insert("curve".into(), Value::Array(curve));
                    }
                    obj.insert("deferred".into(), Value::Bool(true));
                }
                fe
            }
        };
        report["final_evaluation"] = fe;
    } else if !curve.is_empty() {
        report["final_evaluation"]["curve"] = Value::Array(curve);
    }
    eprintln!(
        "held-out evaluations done in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(true)
}

/// What [`complete_state_dir`] did.
pub enum StandaloneOutcome {
    /// The run's evaluations were done; its report's `final_evaluation` as written.
    Evaluated(Value),
    /// Nothing was deferred (not a run of a Gymnasium environment, or no evaluation waits).
    NothingDeferred,
}

/// Why [`complete_state_dir`] refused a state directory (the user's to fix).
#[derive(Debug, thiserror::Error)]
pub enum StandaloneError {
    #[error(
        "{0} has no report.json: the aggregator has not ended there (its deferred evaluations run once it has)"
    )]
    NotEnded(std::path::PathBuf),
    #[error("{dir}: report.json is of scenario {found:?}, the given scenario is {given:?}")]
    OtherScenario {
        dir: std::path::PathBuf,
        found: String,
        given: String,
    },
    #[error("{0}")]
    Locked(#[from] state::StateLockError),
}

/// The deferred evaluations of a standalone `fedrl aggregator` (not under `fedrl run`) whose
/// run of a Gymnasium environment ended in `state_dir`, run with `scenario` (the file and
/// overrides the aggregator was given): [`complete_in`] with the state directory as the
/// public folder, then the final evaluation written into its `report.json` and
/// `operator/report.json`. The state directory's lock is held throughout, so it cannot run
/// while an aggregator uses the directory; a later aggregator on it (a resumed run) and a later
/// call recompute everything from the snapshots.
pub fn complete_state_dir(
    scenario: &Scenario,
    state_dir: &Path,
) -> anyhow::Result<StandaloneOutcome> {
    let _lock = state::lock_state_dir(state_dir).map_err(StandaloneError::from)?;
    let report_path = state_dir.join(state::REPORT_FILE);
    let text = match std::fs::read(&report_path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(StandaloneError::NotEnded(state_dir.to_path_buf()).into());
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", report_path.display())),
    };
    let mut report: Value = serde_json::from_slice(&text)
        .with_context(|| format!("reading {}", report_path.display()))?;
    let found = report["scenario"].as_str().unwrap_or_default();
    if found != scenario.name {
        return Err(StandaloneError::OtherScenario {
            dir: state_dir.to_path_buf(),
            found: found.to_string(),
            given: scenario.name.clone(),
        }
        .into());
    }
    if !complete_in(scenario, state_dir, state_dir, &mut report)? {
        return Ok(StandaloneOutcome::NothingDeferred);
    }
    let fe = report["final_evaluation"].clone();
    state::write_atomic(&report_path, &serde_json::to_vec_pretty(&report)?)?;
    let op_path = state_dir.join(state::OPERATOR_DIR).join(state::REPORT_FILE);
    if op_path.exists() {
        let mut op: Value = serde_json::from_slice(
            &std::fs::read(&op_path).with_context(|| format!("reading {}", op_path.display()))?,
        )
        .with_context(|| format!("reading {}", op_path.display()))?;
        op["final_evaluation"] = fe.clone();
        state::write_atomic(&op_path, &serde_json::to_vec_pretty(&op)?)?;
    }
    Ok(StandaloneOutcome::Evaluated(fe))
}

/// Tag of the event file holding the evaluations filled here (one per output folder: a later
/// completion replaces it).
const TB_TAG: &str = "deferred-eval";

/// The evaluations of the deferred rows as TensorBoard scalars (`eval/eval_return`, ...; step =
/// round), beside the aggregator's event files, which have none for them. Written from the
/// public rows (as the aggregator's are), in a file of its own that replaces the one an earlier
/// completion of this run wrote, so that a resumed run shows each evaluation once.
fn write_tensorboard(dir: &Path, rows: &[Row]) -> anyhow::Result<()> {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_name()
                .to_string_lossy()
                .ends_with(&format!(".{TB_TAG}"))
            {
                std::fs::remove_file(e.path())?;
            }
        }
    }
    let mut w = fedrl_aggregator::tensorboard::EventWriter::create_tagged(dir, Some(TB_TAG))?;
    for r in rows {
        if let Row::Json(v) = r
            && v["status"] == "released"
            && is_deferred(&v["eval"])
            && let Some(round) = v["round"].as_i64()
        {
            let only_eval = serde_json::json!({ "eval": v["eval"] });
            w.scalars(round, &fedrl_aggregator::tensorboard::scalars(&only_eval))?;
        }
    }
    Ok(())
}

/// The task's policy/value model.
fn task_spec(task: &DppgTask) -> anyhow::Result<fedrl_rl::ModelSpec> {
    use fedrl_tasks::dppg::DppgTaskExt;
    Ok(task.model_spec()?)
}

/// One line of a metrics file: parsed, or kept as it was (a line being written when a process
/// died).
enum Row {
    Json(Value),
    Text(String),
}

fn read_rows(path: &Path) -> anyhow::Result<Vec<Row>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .map(|l| match serde_json::from_str::<Value>(l) {
            Ok(v) if v.is_object() => Row::Json(v),
            _ => Row::Text(l.to_string()),
        })
        .collect())
}

/// Rewrites `path` with `rows` (a temporary file renamed over it).
fn write_rows(path: &Path, rows: &[Row]) -> anyhow::Result<()> {
    let mut text = String::new();
    for r in rows {
        match r {
            Row::Json(v) => text.push_str(&v.to_string()),
            Row::Text(t) => text.push_str(t),
        }
        text.push('\n');
    }
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Gives the operator's lines the evaluations of the public ones (matched by round; the
/// operator's file has the same released rounds plus exact counts).
fn fill_operator_rows(path: &Path, public: &[Row]) -> anyhow::Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let evals: std::collections::HashMap<u64, &Value> = public
        .iter()
        .filter_map(|r| match r {
            Row::Json(v) if v["status"] == "released" => Some((v["round"].as_u64()?, &v["eval"])),
            _ => None,
        })
        .collect();
    let mut rows = read_rows(path)?;
    for r in &mut rows {
        if let Row::Json(v) = r
            && v["status"] == "released"
            && let Some(e) = v["round"].as_u64().and_then(|round| evals.get(&round))
        {
            v["eval"] = (*e).clone();
        }
    }
    write_rows(path, &rows)
}
