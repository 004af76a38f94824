//! Offline datasets: episodes, each owned by one privacy unit.

use super::batch::TransitionBatch;

/// One recorded episode, Minari's layout: `observations` holds `len() + 1` rows of `obs_dim`
/// values (the last one is the state after the final step); the other arrays hold `len()`.
#[derive(Clone, Debug, PartialEq)]
pub struct Episode {
    /// Episode id, unique in its dataset (Minari's `episode_{id}`).
    pub id: u64,
    /// The privacy unit owning this episode (a trajectory, a user or an expert); stored as
    /// episode metadata in Minari files.
    pub unit: u64,
    pub observations: Vec<f32>,
    /// Discrete action indices.
    pub actions: Vec<u32>,
    pub rewards: Vec<f32>,
    pub terminations: Vec<bool>,
    pub truncations: Vec<bool>,
}

impl Episode {
    /// Number of steps.
    pub fn len(&self) -> usize {
        self.actions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.actions.is_empty()
    }

    /// Undiscounted return.
    pub fn total_return(&self) -> f64 {
        self.rewards.iter().map(|&r| r as f64).sum()
    }

    /// Appends this episode's transitions to `out` (whose `obs_dim` must match).
    pub fn push_transitions(&self, out: &mut TransitionBatch) {
        let d = out.obs_dim;
        for t in 0..self.len() {
            out.obs
                .extend_from_slice(&self.observations[t * d..(t + 1) * d]);
            out.next_obs
                .extend_from_slice(&self.observations[(t + 1) * d..(t + 2) * d]);
            out.actions.push(self.actions[t]);
            out.rewards.push(self.rewards[t]);
            out.terminals
                .push(if self.terminations[t] { 1.0 } else { 0.0 });
        }
    }
}

/// A dataset: episodes of one environment with discrete actions.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// Minari dataset id (`namespace/name-v0`).
    pub id: String,
    /// The fedrl-sim environment id the episodes were recorded in (for an imported Minari
    /// dataset: its Gymnasium `env_spec` id; empty when the file names no environment).
    pub env_id: String,
    pub obs_dim: usize,
    /// Number of discrete actions.
    pub n_actions: usize,
    pub episodes: Vec<Episode>,
}

impl Dataset {
    /// Every transition of every episode.
    pub fn transitions(&self) -> TransitionBatch {
        let mut out = TransitionBatch::new(self.obs_dim);
        for e in &self.episodes {
            e.push_transitions(&mut out);
        }
        out
    }

    /// Each unit's transitions, by unit id in increasing order.
    pub fn unit_transitions(&self) -> std::collections::BTreeMap<u64, TransitionBatch> {
        let mut out = std::collections::BTreeMap::new();
        for e in &self.episodes {
            e.push_transitions(
                out.entry(e.unit)
                    .or_insert_with(|| TransitionBatch::new(self.obs_dim)),
            );
        }
        out
    }
}

/// What `fedrl data summary` prints: sizes and the distribution of episode returns.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DatasetSummary {
    pub id: String,
    pub env_id: String,
    pub obs_dim: usize,
    pub n_actions: usize,
    pub episodes: usize,
    /// Transitions in all episodes.
    pub steps: usize,
    /// Distinct privacy units.
    pub units: usize,
    /// Episodes per unit: smallest and largest.
    pub episodes_per_unit_min: usize,
    pub episodes_per_unit_max: usize,
    /// Undiscounted episode returns (reward units): mean and the quantiles min, 25%, median,
    /// 75%, max (linear interpolation between order statistics, numpy's default). All 0 for an
    /// empty dataset.
    pub return_mean: f64,
    pub return_min: f64,
    pub return_q25: f64,
    pub return_median: f64,
    pub return_q75: f64,
    pub return_max: f64,
}

/// Quantile `q` in [0, 1] of sorted `v` with numpy's default linear interpolation.
pub fn quantile_sorted(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// Mean, min, 25%, median, 75% and max of `values` (quantiles as [`quantile_sorted`]); all 0
/// when empty. The summaries of datasets, continuous datasets and experts share it.
pub(crate) fn spread(mut values: Vec<f64>) -> [f64; 6] {
    values.sort_by(f64::total_cmp);
    let q = |x| quantile_sorted(&values, x);
    let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
    [mean, q(0.0), q(0.25), q(0.5), q(0.75), q(1.0)]
}

impl Dataset {
    /// Sizes and return quantiles.
    pub fn summary(&self) -> DatasetSummary {
        let [mean, min, q25, median, q75, max] =
            spread(self.episodes.iter().map(Episode::total_return).collect());
        let mut per_unit = std::collections::BTreeMap::<u64, usize>::new();
        for e in &self.episodes {
            *per_unit.entry(e.unit).or_default() += 1;
        }
        DatasetSummary {
            id: self.id.clone(),
            env_id: self.env_id.clone(),
            obs_dim: self.obs_dim,
            n_actions: self.n_actions,
            episodes: self.episodes.len(),
            steps: self.episodes.iter().map(Episode::len).sum(),
            units: per_unit.len(),
            episodes_per_unit_min: per_unit.values().copied().min().unwrap_or(0),
            episodes_per_unit_max: per_unit.values().copied().max().unwrap_or(0),
            return_mean: mean,
            return_min: min,
            return_q25: q25,
            return_median: median,
            return_q75: q75,
            return_max: max,
        }
    }
}
