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
    /// The fedrl-sim environment id the episodes were recorded in.
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
