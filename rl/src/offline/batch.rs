//! Transitions as flat row-major arrays: what every offline loss consumes.

/// `len()` transitions `(s, a, r, s', terminal)`. `obs` and `next_obs` hold `len() * obs_dim`
/// values, row `i` being transition `i`. `terminals[i]` is 1 when `s'` is a terminal state (the
/// episode ended by termination, not by a time limit), 0 otherwise: the target bootstraps from
/// `s'` iff it is 0.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TransitionBatch {
    pub obs_dim: usize,
    pub obs: Vec<f32>,
    pub actions: Vec<u32>,
    pub rewards: Vec<f32>,
    pub next_obs: Vec<f32>,
    pub terminals: Vec<f32>,
}

impl TransitionBatch {
    /// An empty batch of `obs_dim`-dimensional observations.
    pub fn new(obs_dim: usize) -> Self {
        TransitionBatch {
            obs_dim,
            ..Default::default()
        }
    }

    /// Number of transitions.
    pub fn len(&self) -> usize {
        self.actions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.actions.is_empty()
    }

    /// Appends transition `i` of `other` (same `obs_dim`).
    pub fn push_from(&mut self, other: &TransitionBatch, i: usize) {
        let d = self.obs_dim;
        debug_assert_eq!(d, other.obs_dim);
        self.obs.extend_from_slice(&other.obs[i * d..(i + 1) * d]);
        self.next_obs
            .extend_from_slice(&other.next_obs[i * d..(i + 1) * d]);
        self.actions.push(other.actions[i]);
        self.rewards.push(other.rewards[i]);
        self.terminals.push(other.terminals[i]);
    }

    /// The transitions at `rows` of `self`, in that order.
    pub fn select(&self, rows: &[usize]) -> TransitionBatch {
        let mut out = TransitionBatch::new(self.obs_dim);
        for &i in rows {
            out.push_from(self, i);
        }
        out
    }

    /// `self` without the rows of `ranges` (`(first_row, count)` pairs; rows past the end are
    /// ignored): what stays private once some prefixes are released.
    pub fn without_ranges(&self, ranges: &[(usize, usize)]) -> TransitionBatch {
        let mut drop = vec![false; self.len()];
        for &(start, count) in ranges {
            for d in drop.iter_mut().skip(start).take(count) {
                *d = true;
            }
        }
        let keep: Vec<usize> = (0..self.len()).filter(|&i| !drop[i]).collect();
        self.select(&keep)
    }

    /// Appends every transition of `other` (same `obs_dim`).
    pub fn extend_from(&mut self, other: &TransitionBatch) {
        for i in 0..other.len() {
            self.push_from(other, i);
        }
    }
}
