//! DataRelease (seed 002, Algorithms 1-2), the driver's side: the walk itself is engine logic
//! ([`crate::engine::release`]); here D_stable is decoded, published in the state directory as a
//! Minari dataset, read back by a resumed run, and described in the report.

use fedrl_common::privacy::expert_release;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::dpsgd::decode_rows;
use fedrl_rl::offline::qnet::QNetSpec;

use crate::engine::{RELEASE_PHASE, ReleaseSpec, StableRelease};

/// D_stable's transitions, decoded from the engine's rows.
pub(super) fn stable_rows(
    spec: &QNetSpec,
    release: &StableRelease,
) -> anyhow::Result<Vec<TransitionBatch>> {
    release
        .prefixes
        .iter()
        .map(|(p, rows)| {
            decode_rows(spec, spec.obs_dim, p.steps as usize, rows)
                .map_err(|e| anyhow::anyhow!("released prefix of unit {}: {e}", p.unit))
        })
        .collect()
}

/// The most D_stable can hold: the longest prefix a count can pass without noise when every
/// expert agrees (L*, [`expert_release::max_stable_prefix`]) and T x L* transitions.
pub(super) fn stable_bound(
    spec: &ReleaseSpec,
    experts: u64,
    p_min: f64,
) -> anyhow::Result<(u64, u64)> {
    let longest =
        expert_release::max_stable_prefix(experts, spec.n_actions as u64, p_min, &spec.params)?;
    Ok((longest, longest.saturating_mul(spec.trajectories)))
}

/// Folder of the published D_stable in the state directory: a Minari dataset root holding one
/// dataset, `fedrl/<env>-stable-v0`.
pub const STABLE_DIR: &str = "d_stable";

/// Writes D_stable into the Minari root `dir/d_stable` and returns its transitions and its
/// path relative to `dir`. Each
/// released prefix is one episode whose `unit` is its own index: the expert it came from is not
/// part of the release (the analysis covers the prefixes, not who played them), so it is not
/// published.
pub(super) fn publish(
    stable: &[TransitionBatch],
    spec: &QNetSpec,
    scenario: &fedrl_common::scenario::Scenario,
    dir: &std::path::Path,
) -> anyhow::Result<(TransitionBatch, String)> {
    use anyhow::Context;
    use fedrl_rl::offline::{Dataset, Episode, minari};
    let d = spec.obs_dim;
    let mut all = TransitionBatch::new(d);
    let mut episodes = Vec::new();
    for (i, r) in stable.iter().enumerate() {
        all.extend_from(r);
        let n = r.len();
        let mut observations = r.obs.clone();
        observations.extend_from_slice(&r.next_obs[(n - 1) * d..n * d]);
        let terminations: Vec<bool> = r.terminals.iter().map(|&t| t > 0.5).collect();
        let mut truncations = vec![false; n];
        if !terminations[n - 1] {
            // A prefix ends where the release stopped, not where the episode did.
            truncations[n - 1] = true;
        }
        episodes.push(Episode {
            id: i as u64,
            unit: i as u64,
            observations,
            actions: r.actions.clone(),
            rewards: r.rewards.clone(),
            terminations,
            truncations,
        });
    }
    let env = match &scenario.task {
        // A DataRelease needs a generated experts dataset.
        fedrl_common::scenario::Task::OfflineCql(t) => t
            .dataset
            .generated()
            .map_or_else(String::new, |d| d.env.clone()),
        _ => String::new(),
    };
    let name: String = env
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let dataset = Dataset {
        id: format!("fedrl/{name}-stable-v0"),
        env_id: env,
        obs_dim: d,
        n_actions: spec.n_actions,
        episodes,
    };
    let root = dir.join(STABLE_DIR);
    if root.exists() {
        std::fs::remove_dir_all(&root).with_context(|| format!("replacing {}", root.display()))?;
    }
    // The root exists even when nothing was released: a resumed run tells an empty release
    // from a missing one by it (and by the summary, [`write_summary`]).
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let out = root.join(&dataset.id);
    if !dataset.episodes.is_empty() {
        std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
        minari::write(
            &dataset,
            &out,
            &minari::WriteOptions {
                algorithm_name: Some("DataRelease (seed 002, Algorithm 2)".into()),
                description: Some(format!(
                    "Stable prefixes released by {} under expert-level differential privacy",
                    scenario.name
                )),
                spec: None,
            },
        )
        .with_context(|| format!("publishing D_stable in {}", out.display()))?;
    }
    Ok((all, format!("{STABLE_DIR}/{}", dataset.id)))
}

/// The dataset folder (the one holding `data/`) under a Minari root of one dataset.
fn find_dataset(root: &std::path::Path) -> Option<std::path::PathBuf> {
    let ns = std::fs::read_dir(root)
        .ok()?
        .flatten()
        .find(|e| e.path().is_dir())?;
    let ds = std::fs::read_dir(ns.path())
        .ok()?
        .flatten()
        .find(|e| e.path().join("data").is_dir())?;
    Some(ds.path())
}

/// Whether `ledger` holds the DataRelease already.
pub(super) fn released_already(ledger: &fedrl_common::privacy::ledger::PrivacyLedger) -> bool {
    ledger.records().iter().any(|r| r.phase == RELEASE_PHASE)
}

/// The public summary of the release (the report's `selective` section) beside D_stable, so a
/// resumed run's report keeps it and can check D_stable against it.
pub const STABLE_SUMMARY_FILE: &str = "d_stable.json";

/// Writes the report's `selective` section (public: the release's parameters and sizes)
/// atomically into `dir`'s [`STABLE_SUMMARY_FILE`], after D_stable itself was published.
pub(super) fn write_summary(
    dir: &std::path::Path,
    selective: &serde_json::Value,
) -> anyhow::Result<()> {
    crate::state::write_atomic(
        &dir.join(STABLE_SUMMARY_FILE),
        &serde_json::to_vec_pretty(selective)?,
    )
}

/// Why a resumed expert-level run cannot take its D_stable back.
#[derive(Debug, thiserror::Error)]
pub enum StableResumeError {
    #[error(
        "the ledger records the DataRelease (its epsilon is spent), but the released prefixes it published, {path}, are missing: the run cannot go on without them and the release must not run (nor be charged) twice. Put d_stable back from a copy (`fedrl run` copies it into its output folder), or start a new run in an empty state directory"
    )]
    Missing { path: std::path::PathBuf },
    #[error(
        "the published D_stable in {path} holds {found} transitions, but the release published {expected} ({summary}): it was changed since. Put the published d_stable back, or start a new run in an empty state directory"
    )]
    Changed {
        path: std::path::PathBuf,
        found: usize,
        expected: u64,
        summary: std::path::PathBuf,
    },
}

/// What a resumed expert-level run whose ledger holds the DataRelease takes back from `dir`:
/// D_stable as published, and the report's `selective` section (`None` for a release published
/// by a version that wrote no summary). Refused when D_stable is missing or does not hold what
/// the summary says was published.
pub(super) fn load_for_resume(
    dir: &std::path::Path,
    obs_dim: usize,
) -> anyhow::Result<(TransitionBatch, Option<serde_json::Value>)> {
    use anyhow::Context;
    let summary_path = dir.join(STABLE_SUMMARY_FILE);
    let summary: Option<serde_json::Value> = match std::fs::read(&summary_path) {
        Ok(bytes) => Some(
            serde_json::from_slice(&bytes)
                .with_context(|| format!("reading {}", summary_path.display()))?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("reading {}", summary_path.display())),
    };
    let expected = summary
        .as_ref()
        .and_then(|s| s["release"]["stable_transitions"].as_u64());
    let root = dir.join(STABLE_DIR);
    if !root.is_dir() && expected != Some(0) {
        return Err(StableResumeError::Missing { path: root }.into());
    }
    let stable = load_published(dir, obs_dim)?;
    if let Some(n) = expected
        && stable.len() as u64 != n
    {
        return Err(StableResumeError::Changed {
            path: root,
            found: stable.len(),
            expected: n,
            summary: summary_path,
        }
        .into());
    }
    Ok((stable, summary))
}

/// D_stable as published in `dir` by an earlier process of this run (empty when nothing was
/// released).
pub(super) fn load_published(
    dir: &std::path::Path,
    obs_dim: usize,
) -> anyhow::Result<TransitionBatch> {
    use anyhow::Context;
    let Some(path) = find_dataset(&dir.join(STABLE_DIR)) else {
        return Ok(TransitionBatch::new(obs_dim));
    };
    let read = fedrl_rl::offline::minari::read(&path)
        .with_context(|| format!("reading the published D_stable in {}", path.display()))?;
    Ok(read.dataset.transitions())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stable(n: usize) -> TransitionBatch {
        let mut b = TransitionBatch::new(2);
        for i in 0..n {
            b.obs.extend([0.1, i as f32]);
            b.next_obs.extend([0.2, i as f32]);
            b.actions.push(0);
            b.rewards.push(1.0);
            b.terminals.push(0.0);
        }
        b
    }

    fn spec() -> QNetSpec {
        QNetSpec {
            obs_dim: 2,
            hidden: vec![4],
            n_actions: 2,
        }
    }

    fn scenario() -> fedrl_common::scenario::Scenario {
        fedrl_tasks::scenario_from_toml_str(
            "users = 4\nparticipation = { kind = \"sampled\", rate = 0.5 }\nunit_kind = \"trajectory\"\n[task]\nkind = \"offline_cql\"\n[task.dataset]\nunits = 4\nbehaviour = { kind = \"random\" }\n[task.cql]\nhidden = [4]\n",
        )
        .unwrap()
    }

    fn summary(transitions: usize) -> serde_json::Value {
        serde_json::json!({ "release": { "stable_transitions": transitions, "epsilon_1": 2.0 } })
    }

    /// Issue 59, item 6: a resume whose ledger holds the release takes D_stable and the report's
    /// `selective` section back, and refuses to go on when D_stable is gone or changed (it
    /// used to go on with "0 released transitions read back").
    #[test]
    fn a_resume_takes_the_release_back_or_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // Nothing published (the process died before, or d_stable was deleted): refused.
        let e = load_for_resume(d, 2).unwrap_err().to_string();
        assert!(e.contains("missing") && e.contains(STABLE_DIR), "{e}");

        // Published with its summary: both come back.
        let (all, _) = publish(&[stable(3), stable(2)], &spec(), &scenario(), d).unwrap();
        assert_eq!(all.len(), 5);
        write_summary(d, &summary(5)).unwrap();
        let (back, sel) = load_for_resume(d, 2).unwrap();
        assert_eq!(back.len(), 5);
        assert_eq!(sel.unwrap()["release"]["epsilon_1"], 2.0);

        // d_stable deleted: refused, with the path.
        std::fs::remove_dir_all(d.join(STABLE_DIR)).unwrap();
        let e = load_for_resume(d, 2).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
        // Replaced by a smaller one: refused with both numbers.
        publish(&[stable(1)], &spec(), &scenario(), d).unwrap();
        let e = load_for_resume(d, 2).unwrap_err().to_string();
        assert!(e.contains("holds 1") && e.contains("published 5"), "{e}");

        // An empty release is not a missing one.
        let empty = tempfile::tempdir().unwrap();
        publish(&[], &spec(), &scenario(), empty.path()).unwrap();
        write_summary(empty.path(), &summary(0)).unwrap();
        let (back, sel) = load_for_resume(empty.path(), 2).unwrap();
        assert!(back.is_empty() && sel.is_some());
    }
}
