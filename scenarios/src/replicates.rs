//! `fedrl run --replicates N`: what makes the replicates independent (their seeds) and what is
//! reported across them (a Student t interval of the mean final return, the mean learning curve
//! with its 95% band, per-replicate privacy).
//!
//! Invariants: replicate 0 runs the scenario exactly as given; replicate i > 0 changes every
//! seed of training randomness (the task's `*_seed` fields outside its dataset, other than the
//! population's and the held-out evaluation's, and the scenario's noise `seed` if it set one)
//! to `mix(seed ^ fnv1a(key), i) >> 1` (salted by the field's dotted name, 63 bits: TOML
//! integers are signed), so the replicates see the same
//! users, data and held-out episodes with fresh training randomness; the noise of an unseeded
//! scenario is fresh from the OS in every replicate anyway. Privacy is never pooled: each
//! replicate is a run with its own ledger and epsilon, and publishing all of them composes.

use fedrl_common::scenario::Scenario;
use serde_json::{Value, json};
use statrs::distribution::{ContinuousCDF, StudentsT};

use crate::overrides::Override;

/// The folder of replicate `i` inside the output directory.
pub fn dir_name(i: u64) -> String {
    format!("rep-{i}")
}

/// Seed fields that stay the same in every replicate: they choose who the users are and which
/// held-out episodes evaluate the model, not the training's randomness.
const SHARED_SEEDS: [&str; 2] = ["population_seed", "eval_seed"];

/// The overrides that make replicate `i` (see the module doc); none for replicate 0.
pub fn seed_overrides(resolved: &Scenario, i: u64) -> anyhow::Result<Vec<Override>> {
    if i == 0 {
        return Ok(Vec::new());
    }
    let table: toml::Table = resolved.to_toml_string()?.parse()?;
    let mut seeds = Vec::new();
    if let Some(toml::Value::Integer(s)) = table.get("seed") {
        seeds.push(("seed".to_string(), *s));
    }
    if let Some(toml::Value::Table(task)) = table.get("task") {
        task_seeds("task", task, &mut seeds);
    }
    Ok(seeds
        .into_iter()
        .map(|(key, s)| {
            // Salted by the key, so two seeds that are equal in the scenario (both 0 by
            // default) still differ in a replicate.
            let salt = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            let derived = fedrl_rl::rollout::mix(s as u64 ^ salt, i) >> 1;
            Override {
                key,
                value: toml::Value::Integer(derived as i64),
            }
        })
        .collect())
}

fn task_seeds(prefix: &str, t: &toml::Table, out: &mut Vec<(String, i64)>) {
    for (k, v) in t {
        let path = format!("{prefix}.{k}");
        match v {
            // The dataset is the data: every replicate trains on the same one.
            toml::Value::Table(sub) if k != "dataset" => task_seeds(&path, sub, out),
            toml::Value::Integer(s)
                if k.ends_with("seed") && !SHARED_SEEDS.contains(&k.as_str()) =>
            {
                out.push((path, *s))
            }
            _ => {}
        }
    }
}

/// Mean, sample standard deviation and the 95% Student t interval of the mean of `values`;
/// `None` with fewer than two values or a value that is not finite.
pub fn t_interval(values: &[f64]) -> Option<(f64, f64, f64, f64)> {
    let n = values.len();
    if n < 2 || values.iter().any(|v| !v.is_finite()) {
        return None;
    }
    let nf = n as f64;
    let mean = values.iter().sum::<f64>() / nf;
    let sd = (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (nf - 1.0)).sqrt();
    let t = StudentsT::new(0.0, 1.0, nf - 1.0).ok()?.inverse_cdf(0.975);
    let half = t * sd / nf.sqrt();
    Some((mean, sd, mean - half, mean + half))
}

/// The 95% Student t interval of a mean of `n` values whose population (divide-by-n) standard
/// deviation is `pop_sd`, as an evaluation reports its episodes' returns: `None` for fewer than
/// two values or figures that are not finite.
pub fn mean_interval(mean: f64, pop_sd: f64, n: u64) -> Option<(f64, f64)> {
    if n < 2 || !mean.is_finite() || !pop_sd.is_finite() || pop_sd < 0.0 {
        return None;
    }
    let nf = n as f64;
    let sd = pop_sd * (nf / (nf - 1.0)).sqrt();
    let t = StudentsT::new(0.0, 1.0, nf - 1.0).ok()?.inverse_cdf(0.975);
    let half = t * sd / nf.sqrt();
    Some((mean - half, mean + half))
}

/// A curve's (x, low, high) band.
pub type Band = Vec<(f64, f64, f64)>;

/// The mean curve and its 95% band over the replicates' curves, at every x some replicate has:
/// (x, mean) points and (x, low, high) band. A replicate whose curve ended before x (its run
/// stopped early, e.g. at its target return) counts with its last value: its released model
/// does not change after it ends. An x before a replicate's first point, or missing inside its
/// curve, is skipped; a replicate without any point (no evaluation) is left out.
pub fn mean_curve(curves: &[Vec<(f64, f64)>]) -> (Vec<(f64, f64)>, Band) {
    let curves: Vec<&Vec<(f64, f64)>> = curves.iter().filter(|c| !c.is_empty()).collect();
    let mut xs: Vec<f64> = curves.iter().flat_map(|c| c.iter().map(|p| p.0)).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let (mut mean, mut band) = (Vec::new(), Vec::new());
    for x in xs {
        let ys: Option<Vec<f64>> = curves
            .iter()
            .map(|c| match c.iter().find(|p| p.0 == x) {
                Some(p) => Some(p.1),
                None => c.last().filter(|last| last.0 < x).map(|last| last.1),
            })
            .collect();
        let Some(ys) = ys else { continue };
        if let Some((m, _, lo, hi)) = t_interval(&ys) {
            mean.push((x, m));
            band.push((x, lo, hi));
        }
    }
    (mean, band)
}

/// What one replicate's report contributes to the summary.
pub struct Replicate {
    pub dir: String,
    pub report: Value,
    pub seeds: Vec<Override>,
}

/// The replicates' final returns (`final_evaluation.final_eval_return` of each), their mean and
/// 95% Student t interval (`report.schema.json`, definition `final_return`).
fn final_return(reps: &[Replicate]) -> Value {
    let values: Vec<Option<f64>> = reps
        .iter()
        .map(|r| r.report["final_evaluation"]["final_eval_return"].as_f64())
        .collect();
    let all: Option<Vec<f64>> = values.iter().copied().collect();
    let stats = all.as_deref().and_then(t_interval);
    let n = reps.len();
    json!({
        "values": values,
        "mean": stats.map(|s| s.0),
        "std": stats.map(|s| s.1),
        "ci95_low": stats.map(|s| s.2),
        "ci95_high": stats.map(|s| s.3),
        "interval": format!(
            "95% Student t interval of the mean over {n} replicates ({} degrees of freedom)",
            n.saturating_sub(1)
        ),
    })
}

fn epsilons(reps: &[Replicate]) -> Vec<Option<f64>> {
    reps.iter().map(|r| r.report["epsilon"].as_f64()).collect()
}

fn seeds(reps: &[Replicate]) -> Vec<serde_json::Map<String, Value>> {
    reps.iter()
        .map(|r| {
            r.seeds
                .iter()
                .map(|o| (o.key.clone(), json!(o.value.as_integer())))
                .collect()
        })
        .collect()
}

/// The replicates' `report.json` (see `report.schema.json`, definition `replicates`): the
/// scenario's replicates, and each twin scenario's (`--twin`) summarised the same way.
pub fn summary(
    scenario: &Scenario,
    reps: &[Replicate],
    twins: &[(&Scenario, Vec<Replicate>)],
    wall_seconds: f64,
) -> Value {
    let eps = epsilons(reps);
    let all_eps: Option<f64> = eps.iter().copied().sum();
    let n = reps.len();
    let privacy = if scenario.non_private {
        format!("none: {n} non-private replicates")
    } else {
        format!(
            "per replicate: each replicate is a separate run with its own noise and its own \
             ledger (rep-N/operator/privacy.ledger), and its epsilon holds for that replicate \
             alone. The replicates train on the same users' data, so publishing the models of \
             all {n} composes their privacy loss: at most the sum of their epsilons at {n} x \
             delta (epsilon_all_replicates, basic composition).{}",
            if twins.iter().any(|(t, _)| !t.non_private) {
                " A private twin's replicates are further runs on the same users: publishing \
                 them composes too."
            } else {
                ""
            }
        )
    };
    let mut v = json!({
        "report_version": fedrl_aggregator::service::REPORT_VERSION,
        "scenario": scenario.name,
        "replicates": n,
        "replicate_dirs": reps.iter().map(|r| r.dir.clone()).collect::<Vec<_>>(),
        "final_return": final_return(reps),
        "epsilon": eps,
        "epsilon_all_replicates": all_eps,
        "delta": scenario.delta,
        "non_private": scenario.non_private,
        "privacy": privacy,
        "seeds": seeds(reps),
        "wall_seconds": wall_seconds,
    });
    if !twins.is_empty() {
        v["twins"] = twins
            .iter()
            .map(|(s, reps)| {
                json!({
                    "scenario": s.name,
                    "replicate_dirs": reps.iter().map(|r| r.dir.clone()).collect::<Vec<_>>(),
                    "final_return": final_return(reps),
                    "epsilon": epsilons(reps),
                    "non_private": s.non_private,
                    "seeds": seeds(reps),
                })
            })
            .collect();
    }
    v
}

#[cfg(test)]
#[path = "../tests/e2e_support/schema.rs"]
mod schema_check;

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(text: &str) -> Scenario {
        fedrl_tasks::scenario_from_toml_str(text).unwrap()
    }

    #[test]
    fn replicates_vary_training_seeds_only() {
        let s =
            scenario("seed = 7\n[task]\nkind = \"dppg\"\nepisode_seed = 3\npopulation_seed = 5\n");
        assert!(seed_overrides(&s, 0).unwrap().is_empty());
        let one = seed_overrides(&s, 1).unwrap();
        let keys: Vec<&str> = one.iter().map(|o| o.key.as_str()).collect();
        assert!(
            keys.contains(&"seed") && keys.contains(&"task.episode_seed"),
            "{keys:?}"
        );
        assert!(keys.contains(&"task.model_seed"), "{keys:?}");
        assert!(
            !keys.iter().any(|k| k.ends_with("population_seed")),
            "{keys:?}"
        );
        let two = seed_overrides(&s, 2).unwrap();
        assert_ne!(one, two);
        // model_seed and episode_seed are both 0 by default; the replicate's still differ.
        let value = |k: &str| one.iter().find(|o| o.key == k).unwrap().value.clone();
        assert_ne!(value("task.model_seed"), value("task.episode_seed"));
        assert!(one.iter().all(|o| o.value.as_integer().unwrap() >= 0));
        // Unseeded noise stays unseeded (fresh from the OS); the dataset and held-out
        // evaluation seeds of an offline task stay too.
        let cql = scenario(include_str!("../cartpole-cql-dpsgd.toml"));
        let keys: Vec<String> = seed_overrides(&cql, 1)
            .unwrap()
            .into_iter()
            .map(|o| o.key)
            .collect();
        assert!(!keys.contains(&"seed".to_string()), "{keys:?}");
        assert!(keys.contains(&"task.data_seed".to_string()), "{keys:?}");
        assert!(
            !keys
                .iter()
                .any(|k| k.contains("dataset") || k.ends_with("eval_seed")),
            "{keys:?}"
        );
    }

    #[test]
    fn student_t_interval_matches_the_table() {
        // t(0.975, 2) = 4.3027; mean 2, sd 1, half width 4.3027 / sqrt(3).
        let (m, sd, lo, hi) = t_interval(&[1.0, 2.0, 3.0]).unwrap();
        assert_eq!((m, sd), (2.0, 1.0));
        assert!((hi - m - 4.302_653 / 3f64.sqrt()).abs() < 1e-5, "{hi}");
        assert!((m - lo - (hi - m)).abs() < 1e-12);
        assert!(t_interval(&[1.0]).is_none());
        // The same interval from the mean and the population sd (sqrt(2/3) for 1, 2, 3).
        let (plo, phi) = mean_interval(2.0, (2.0f64 / 3.0).sqrt(), 3).unwrap();
        assert!(
            (plo - lo).abs() < 1e-12 && (phi - hi).abs() < 1e-12,
            "{plo} {phi}"
        );
        assert!(mean_interval(2.0, 1.0, 1).is_none());
        assert!(t_interval(&[1.0, f64::NAN]).is_none());
        // The second replicate stopped after x = 2: it counts with its last value at x = 3; the
        // third has no point before x = 2, so x = 1 is skipped; an empty curve is left out.
        let (mean, band) = mean_curve(&[
            vec![(1.0, 1.0), (2.0, 2.0), (3.0, 5.0)],
            vec![(1.0, 3.0), (2.0, 4.0)],
            vec![(2.0, 3.0), (3.0, 4.0)],
            vec![],
        ]);
        assert_eq!(mean, vec![(2.0, 3.0), (3.0, 13.0 / 3.0)]);
        assert!(band[0].1 < 3.0 && band[0].2 > 3.0);
    }

    #[test]
    fn summary_matches_the_schema_and_says_privacy_is_per_replicate() {
        let s = scenario("[task]\nkind = \"mean_estimation\"\n");
        let rep = |ret: f64, eps: f64, i: u64| Replicate {
            dir: dir_name(i),
            report: json!({"final_evaluation": {"final_eval_return": ret}, "epsilon": eps}),
            seeds: seed_overrides(&s, i).unwrap(),
        };
        let v = summary(
            &s,
            &[rep(10.0, 0.5, 0), rep(12.0, 0.5, 1), rep(14.0, 0.6, 2)],
            &[],
            3.0,
        );
        assert_eq!(v["final_return"]["mean"], 12.0);
        assert!(v["final_return"]["ci95_low"].as_f64().unwrap() < 12.0);
        assert!((v["epsilon_all_replicates"].as_f64().unwrap() - 1.6).abs() < 1e-12);
        assert!(v["privacy"].as_str().unwrap().starts_with("per replicate"));
        let schema: Value = serde_json::from_str(include_str!("../report.schema.json")).unwrap();
        let errors = schema_check::violations(&schema, &v);
        assert!(errors.is_empty(), "{errors:?}\n{v}");
        // A replicate without a final return: null figures, still valid.
        let none = Replicate {
            dir: dir_name(1),
            report: json!({"final_evaluation": {"l2_error": 0.1}, "epsilon": 0.5}),
            seeds: Vec::new(),
        };
        let v = summary(&s, &[rep(1.0, 0.5, 0), none], &[], 1.0);
        assert!(v["final_return"]["mean"].is_null());
        assert!(schema_check::violations(&schema, &v).is_empty(), "{v}");
        // With a non-private twin: its replicates summarised beside, still valid.
        let twin = scenario("non_private = true\n[task]\nkind = \"mean_estimation\"\n");
        let t = |ret: f64, i: u64| Replicate {
            dir: format!("{}/twin", dir_name(i)),
            report: json!({"final_evaluation": {"final_eval_return": ret}, "epsilon": null}),
            seeds: seed_overrides(&twin, i).unwrap(),
        };
        let v = summary(
            &s,
            &[rep(1.0, 0.5, 0), rep(2.0, 0.5, 1)],
            &[(&twin, vec![t(3.0, 0), t(5.0, 1)])],
            1.0,
        );
        assert_eq!(v["twins"][0]["final_return"]["mean"], 4.0, "{v}");
        assert!(v["twins"][0]["epsilon"][0].is_null(), "{v}");
        assert!(schema_check::violations(&schema, &v).is_empty(), "{v}");
        let mut bad = v.clone();
        bad["twins"][0]["final_return"]["std"] = json!(-1.0);
        assert!(!schema_check::violations(&schema, &bad).is_empty());
    }
}
