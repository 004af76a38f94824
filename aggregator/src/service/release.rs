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
        fedrl_common::scenario::Task::OfflineCql(t) => t.dataset.env.clone(),
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
