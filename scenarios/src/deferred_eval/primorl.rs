//! The policy-phase evaluations of a PriMORL run whose dataset was recorded in a Gymnasium
//! environment (`task.dataset.env = "gymnasium:<id>"`), done by `fedrl run` once the aggregator
//! has ended. The aggregator runs no Python (DESIGN §2.6): its policy phase trains SAC in the
//! pessimistic released model as usual but evaluates no epoch in the real environment; it keeps
//! each epoch's actor (`state/policy_actors.safetensors`, beside the agent's
//! `state/sac_policy.safetensors`) and reports its `policy_curve` with the evaluation fields
//! null and `deferred: true`. This process evaluates every epoch's actor deterministically in
//! the dataset's default environment (`gymnasium.make(id, **kwargs)`) through the bridge, on
//! the episodes the aggregator would have used (`task.policy.eval_episodes`, episode `k` reset
//! with `fedrl_rl::primorl::eval_seed`), fills each epoch's `eval_return`,
//! `eval_return_std`, `normalized_return`, `normalized_return_std` and `eval_episodes`, and
//! the final figures by the aggregator's own rule (the last epoch's: `final_eval_return`,
//! `final_eval_return_std`, `final_normalized_return`, `final_eval_episodes`), keeping
//! `deferred: true` (it says where the figures were computed).
//!
//! Invariants: only released models are evaluated (each actor is post-processing of the DP
//! ensemble and the public split); the evaluation reads no dataset. A failed evaluation becomes
//! `final_eval_error`, as in the aggregator; the run stands.

use std::time::Instant;

use fedrl_common::scenario::Task;
use fedrl_rl::candle_core::Device;
use fedrl_rl::primorl::{evaluate_actors_gym, load_actor_snapshots, normalized_return};
use fedrl_rl::sac::SacAgent;
use fedrl_tasks::primorl::{POLICY_FILE, POLICY_SNAPSHOTS_FILE, evaluates_in_gymnasium};
use serde_json::Value;

use crate::deploy::{LocalRun, RunResult};

/// Completes the policy-phase evaluations of a finished PriMORL run on a Gymnasium dataset (see
/// the module doc); nothing for any other run. Returns whether it did anything.
pub fn complete(run: &LocalRun, result: &mut RunResult) -> anyhow::Result<bool> {
    let Task::Primorl(task) = &run.scenario.task else {
        return Ok(false);
    };
    let Some(spec) = task.dataset.generated() else {
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
    let state = run.out_dir.join("state");
    let p = &task.policy;
    let t = Instant::now();
    let epochs = fe["policy_curve"].as_array().map_or(0, Vec::len);
    eprintln!(
        "policy evaluations in {} through the Gymnasium bridge (the aggregator runs no Python): \
         {epochs} epochs' actors, {} episodes each",
        spec.env, p.eval_episodes
    );
    let eval = (|| -> anyhow::Result<Vec<(f64, f64)>> {
        let policy = state.join(POLICY_FILE);
        let mut agent = SacAgent::load(&policy, p.seed, &Device::Cpu)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", policy.display()))?;
        let snapshots = state.join(POLICY_SNAPSHOTS_FILE);
        let actors = load_actor_snapshots(&snapshots)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", snapshots.display()))?;
        if actors.len() != epochs {
            anyhow::bail!(
                "{} holds {} actors for a curve of {epochs} epochs",
                snapshots.display(),
                actors.len()
            );
        }
        Ok(evaluate_actors_gym(
            spec,
            &mut agent,
            &actors,
            p,
            &mut |i, m, sd| {
                eprintln!(
                    "  SAC epoch {:>3}/{epochs}: return {m:9.2} ± {sd:.2} (normalised {:7.1}), {:.0} s",
                    i + 1,
                    normalized_return(&spec.env, m),
                    t.elapsed().as_secs_f64()
                );
            },
        )?)
    })();
    let mut out = result.report["final_evaluation"].clone();
    // The normalisation is affine: a standard deviation scales by its slope.
    let slope = (normalized_return(&spec.env, 1.0) - normalized_return(&spec.env, 0.0)).abs();
    match eval {
        Ok(evals) => {
            if let Some(curve) = out["policy_curve"].as_array_mut() {
                for (e, (m, sd)) in curve.iter_mut().zip(&evals) {
                    e["eval_return"] = (*m).into();
                    e["eval_return_std"] = (*sd).into();
                    e["normalized_return"] = normalized_return(&spec.env, *m).into();
                    e["normalized_return_std"] = (sd * slope).into();
                    e["eval_episodes"] = p.eval_episodes.into();
                }
            }
            // The aggregator's rule: the last epoch's policy is the result.
            if let Some((m, sd)) = evals.last() {
                out["final_eval_return"] = (*m).into();
                out["final_eval_return_std"] = (*sd).into();
                out["final_normalized_return"] = normalized_return(&spec.env, *m).into();
                out["final_eval_episodes"] = p.eval_episodes.into();
            }
            eprintln!(
                "  final policy: return {} ({:.1} s)",
                out["final_eval_return"],
                t.elapsed().as_secs_f64()
            );
        }
        Err(e) => {
            eprintln!("  policy evaluations failed: {e:#}");
            out["final_eval_error"] = Value::String(format!("{e:#}"));
        }
    }
    result.report["final_evaluation"] = out.clone();
    if result.operator.get("final_evaluation").is_some() {
        result.operator["final_evaluation"] = out;
    }
    Ok(true)
}
