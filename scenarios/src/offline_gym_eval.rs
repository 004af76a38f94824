//! The final evaluation of an offline CQL run whose dataset was recorded in a Gymnasium
//! environment (`task.dataset.env = "gymnasium:<id>"`), done by `fedrl run` once the aggregator
//! has ended. The aggregator runs no Python (DESIGN §2.6): its server model evaluates nothing
//! for such a task and reports its final evaluation as `{"deferred": true}` (with the public
//! step counts). This process evaluates the exported Q-network (`state/q_network.safetensors`,
//! the released model) greedily in the dataset's default environment through the bridge, on the
//! episodes the aggregator would have used (`eval_seed`'s final-evaluation seeds,
//! `final_eval_episodes`, `eval_max_steps`), and fills `final_eval_return`,
//! `final_eval_return_std` and `final_eval_episodes` into the report's `final_evaluation`,
//! keeping `deferred: true` (it says where the figures were computed).
//!
//! Invariants: only the released (exported) model is evaluated: a DP output. A failed
//! evaluation becomes `final_eval_error`, as in the aggregator; the run stands. Periodic
//! evaluations are not made for such runs (the network is not kept per step).

use std::time::Instant;

use fedrl_common::offline::DatasetSource;
use fedrl_common::scenario::Task;
use fedrl_rl::offline::QNetSpec;
use fedrl_tasks::offline_cql::server::final_eval_seed;
use fedrl_tasks::offline_cql::{QNET_FILE, evaluates_in_gymnasium};
use serde_json::Value;

use crate::deploy::{LocalRun, RunResult};

/// Completes the final evaluation of a finished offline CQL run on a Gymnasium dataset (see
/// the module doc); nothing for any other run. Returns whether it did anything.
pub fn complete(run: &LocalRun, result: &mut RunResult) -> anyhow::Result<bool> {
    let Task::OfflineCql(task) = &run.scenario.task else {
        return Ok(false);
    };
    let DatasetSource::Generated(dataset) = &task.dataset else {
        return Ok(false);
    };
    let fe = &result.report["final_evaluation"];
    if !evaluates_in_gymnasium(task)
        || fe["deferred"] != true
        || fe.get("final_eval_return").is_some()
        || fe.get("final_eval_error").is_some()
    {
        return Ok(false);
    }
    let path = run.out_dir.join("state").join(QNET_FILE);
    let t = Instant::now();
    eprintln!(
        "final evaluation of the released Q-network in {} through the Gymnasium bridge (the \
         aggregator runs no Python): {} episodes",
        dataset.env, task.final_eval_episodes
    );
    let eval = QNetSpec::load_file(&path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))
        .and_then(|(spec, params)| {
            fedrl_rl::offline::gym::evaluate_greedy_gym(
                dataset,
                &spec,
                &params,
                task.final_eval_episodes,
                final_eval_seed(task),
                task.eval_max_steps,
            )
            .map_err(anyhow::Error::from)
        });
    let mut out = result.report["final_evaluation"].clone();
    match eval {
        Ok(r) => {
            eprintln!(
                "  final evaluation: return {:.2} ± {:.2} over {} episodes ({:.1} s)",
                r.mean,
                r.std,
                r.returns.len(),
                t.elapsed().as_secs_f64()
            );
            out["final_eval_return"] = r.mean.into();
            out["final_eval_return_std"] = r.std.into();
            out["final_eval_episodes"] = r.returns.len().into();
        }
        Err(e) => {
            eprintln!("  final evaluation failed: {e:#}");
            out["final_eval_error"] = Value::String(format!("{e:#}"));
        }
    }
    result.report["final_evaluation"] = out.clone();
    if result.operator.get("final_evaluation").is_some() {
        result.operator["final_evaluation"] = out;
    }
    Ok(true)
}
