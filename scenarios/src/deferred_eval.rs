//! The held-out evaluations of a `gymnasium:<id>` DPPG run, done by `fedrl run` once the
//! aggregator has ended. The aggregator runs no Python (DESIGN §2.6), so for such a population
//! its server model evaluates nothing: at each evaluation round it keeps the released model as
//! a snapshot in its state directory (`state/eval-snapshots/round-R.safetensors`) and marks the
//! round's metrics line `"eval": {"deferred": true}`; its final evaluation is
//! `{"deferred": true}`. This process (which may start Python: client agents do) then
//!
//! 1. evaluates each marked round's snapshot through the bridge on the held-out users and reset
//!    seeds the aggregator's own evaluation uses (`fedrl_tasks::dppg::held_out`), and fills the
//!    line's `eval` with `eval_return`, `eval_return_std` and `eval_episodes` (keeping
//!    `deferred: true`: it says where the figures were computed), in the public
//!    `metrics.jsonl` and in `operator/metrics.jsonl`;
//! 2. exports the best-evaluated snapshot as the policy (the first of equal returns, as the
//!    aggregator's model selection does), else the aggregator's export (the last model);
//! 3. runs the final evaluation of that policy on the final-evaluation users and writes it into
//!    the report's `final_evaluation`, with `selected_model_eval_return`, as the aggregator would.
//!
//! A standalone `fedrl aggregator` (not under `fedrl run`) ends with the same deferred rows in
//! its state directory and says so; `fedrl eval --deferred STATE_DIR --scenario FILE` then does
//! the same three steps there ([`complete_state_dir`]: the state directory is its own public
//! folder, its `report.json` and `operator/report.json` get the final evaluation).
//!
//! Invariants: only released models are evaluated (the snapshots, kept after their round's
//! ledger record was durable) and only released rows are filled: DP outputs. The aggregator's
//! own files in `state/` are left as written except `policy.safetensors`, the export, which
//! becomes the selected model; the public copies in the output directory are completed. Every
//! step is recomputed from the snapshots after each `fedrl run` (a `--resume` copies the
//! aggregator's unfilled lines again), so a resumed run ends as an uninterrupted one. A failed
//! evaluation becomes `eval_error` (`final_eval_error`) as in the aggregator; the run stands.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use fedrl_aggregator::state;
use fedrl_common::scenario::{Scenario, Task};
use fedrl_common::task::DppgTask;
use fedrl_tasks::dppg::held_out::{self, GymEvaluator};
use fedrl_tasks::dppg::{POLICY_FILE, gymnasium_of};
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

/// Completes the evaluations of a finished `gymnasium:<id>` DPPG run in `run.out_dir` (see
/// the module doc); nothing for any other run. Returns whether it did anything.
pub fn complete(run: &LocalRun, result: &mut RunResult) -> anyhow::Result<bool> {
    let out = &run.out_dir;
    complete_in(&run.scenario, &out.join("state"), out, &mut result.report)
}

/// [`complete`] for any layout: the aggregator's state directory `state_dir` (snapshots, the
/// exported policy) and the folder `public_dir` whose `metrics.jsonl`,
/// `operator/metrics.jsonl` and `tensorboard/` are filled (`fedrl run`'s output directory, or
/// the state directory itself for a standalone aggregator: `fedrl eval --deferred`); `report`
/// gets the final evaluation. Returns whether it did anything.
pub fn complete_in(
    scenario: &Scenario,
    state_dir: &Path,
    public_dir: &Path,
    report: &mut Value,
) -> anyhow::Result<bool> {
    let Task::Dppg(task) = &scenario.task else {
        return Ok(false);
    };
    if gymnasium_of(task).is_none() {
        return Ok(false);
    }
    let out = public_dir;
    let public_path = out.join(state::METRICS_FILE);
    let mut rows = read_rows(&public_path)?;
    let pending: Vec<usize> = rows
        .iter()
        .enumerate()
        .filter_map(|(i, r)| match r {
            Row::Json(v)
                if v["status"] == "released"
                    && is_deferred(&v["eval"])
                    && v["eval"].get("eval_error").is_none() =>
            {
                Some(i)
            }
            _ => None,
        })
        .collect();
    let final_deferred = is_deferred(&report["final_evaluation"]);
    if pending.is_empty() && !final_deferred {
        return Ok(false);
    }
    let training_users = scenario.users;
    let t0 = Instant::now();
    eprintln!(
        "evaluating {} released models on held-out users through the Gymnasium bridge \
         (the aggregator runs no Python){}",
        pending.len(),
        if final_deferred {
            ", then the final evaluation"
        } else {
            ""
        }
    );
    let device = fedrl_rl::device::open(scenario.device)?;
    let mut evaluator = GymEvaluator::start(task, device).map_err(|e| format!("{e:#}"));
    let mut best: BestModel = None;
    let users = held_out::periodic_users(task, training_users);
    for (k, &i) in pending.iter().enumerate() {
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
        let Row::Json(row) = &mut rows[i] else {
            continue;
        };
        let round = row["round"].as_u64().unwrap_or(0);
        let t = Instant::now();
        let evaluated = match &mut evaluator {
            Ok(ev) => held_out::read_snapshot(state_dir, round)
                .and_then(|p| ev.evaluate(&p, users.clone()).map(|e| (e, p)))
                .map_err(|e| format!("{e:#}")),
            Err(e) => Err(e.clone()),
        };
        let mut eval = match &evaluated {
            Ok((e, params)) => {
                keep_best(&mut best, e.mean, params);
                eprintln!(
                    "  round {round} ({}/{}): eval return {:.2} ± {:.2} over {} episodes ({:.1} s)",
                    k + 1,
                    pending.len(),
                    e.mean,
                    e.std,
                    e.episodes,
                    t.elapsed().as_secs_f64()
                );
                e.to_json()
            }
            Err(e) => {
                eprintln!(
                    "  round {round} ({}/{}): evaluation failed: {e}",
                    k + 1,
                    pending.len()
                );
                serde_json::json!({ "eval_error": e })
            }
        };
        eval["deferred"] = Value::Bool(true);
        row["eval"] = eval;
    }
    write_rows(&public_path, &rows)?;
    fill_operator_rows(
        &out.join(state::OPERATOR_DIR).join(state::METRICS_FILE),
        &rows,
    )?;
    write_tensorboard(&out.join("tensorboard"), &rows)
        .context("writing the evaluations' TensorBoard events")?;

    // The exported policy: the best evaluated snapshot, else the aggregator's export (the last
    // released model), as the aggregator's `keep_best` selection would have it.
    let policy_path = state_dir.join(POLICY_FILE);
    let chosen = match &best {
        Some((_, params)) => {
            let spec = task_spec(task)?;
            fedrl_rl::io::save(&policy_path, &spec, params)
                .with_context(|| format!("writing {}", policy_path.display()))?;
            Ok(params.clone())
        }
        None => fedrl_rl::io::load(&policy_path)
            .map(|(_, p)| p)
            .map_err(|e| format!("reading the exported policy {}: {e}", policy_path.display())),
    };
    if final_deferred {
        let final_users = held_out::final_users(task, training_users);
        let t = Instant::now();
        let eval = match (&mut evaluator, chosen) {
            (Ok(ev), Ok(params)) => ev.evaluate(&params, final_users.clone()),
            (Err(e), _) => Err(anyhow::anyhow!("{e}")),
            (_, Err(e)) => Err(anyhow::anyhow!("{e}")),
        };
        match &eval {
            Ok(e) => eprintln!(
                "  final evaluation on users {}..{}: return {:.2} ± {:.2} over {} episodes ({:.1} s)",
                final_users.start,
                final_users.end,
                e.mean,
                e.std,
                e.episodes,
                t.elapsed().as_secs_f64()
            ),
            Err(e) => eprintln!("  final evaluation failed: {e:#}"),
        }
        let mut fe = final_evaluation_json(eval.map(|e| e.to_json()), &best);
        fe["deferred"] = Value::Bool(true);
        report["final_evaluation"] = fe;
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
    /// Nothing was deferred (not a `gymnasium:<id>` DPPG run, or no evaluation waits).
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
/// `gymnasium:<id>` DPPG run ended in `state_dir`, run with `scenario` (the file and
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

/// Whether `scenario` is one whose aggregator leaves its evaluations to another process (a
/// `gymnasium:<id>` DPPG run).
pub fn defers_evaluations(scenario: &Scenario) -> bool {
    matches!(&scenario.task, Task::Dppg(t) if gymnasium_of(t).is_some())
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
