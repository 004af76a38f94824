//! Transitions `(s, a, r, s', done)` as flat real vectors for the diffusion synthesizer, and back.
//!
//! A vector is `[s (obs_dim), a, r, s' (obs_dim), done]` in SynthER's order (`make_inputs`,
//! `synther/diffusion/utils.py:28-31`), where `a` is the action's one-hot code (discrete actions,
//! seed 003 section VI-D) or its `act_dim` values (continuous), and `done` is the terminal flag
//! (1 = `s'` is terminal), present when [`TransitionLayout::model_terminal`] is set (SynthER's
//! and PrivORL's `modelled_terminals = True`, gin line 4).
//!
//! Decoding is the synthesizer's post-processing: a discrete action is the argmax of its one-hot
//! block (ties to the lowest index), `done` is `value > 0.5` (`split_diffusion_samples.
//! terminal_threshold`, gin line 7).
//!
//! Invariants: every vector of a layout has [`TransitionLayout::dim`] entries; encoding then
//! decoding returns the transitions exactly (f32 values are copied, not transformed).

use serde::{Deserialize, Serialize};

use crate::offline::batch::TransitionBatch;
use crate::{NnError, Result};

/// How actions are coded in the vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionCoding {
    /// `n` discrete actions, one-hot over `n` entries.
    Discrete { n: usize },
    /// `dim` real-valued action entries, copied as they are.
    Continuous { dim: usize },
}

/// What each entry of an encoded vector is (the normaliser and the metrics read this).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// A real value: an observation, next-observation, continuous action or reward entry.
    Real,
    /// One entry of a one-hot action code (0 or 1 in real data).
    OneHot,
    /// The terminal flag (0 or 1 in real data).
    Terminal,
}

/// The layout of encoded transitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransitionLayout {
    /// Observation entries.
    pub obs_dim: usize,
    pub action: ActionCoding,
    /// Whether the terminal flag is the last entry.
    pub model_terminal: bool,
}

/// Transitions in columns: `obs` and `next_obs` hold `len * obs_dim` values, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Transitions {
    pub obs_dim: usize,
    pub obs: Vec<f32>,
    pub actions: Actions,
    pub rewards: Vec<f32>,
    pub next_obs: Vec<f32>,
    /// 1.0 when `s'` is terminal, else 0.0.
    pub terminals: Vec<f32>,
}

/// The actions of [`Transitions`].
#[derive(Clone, Debug, PartialEq)]
pub enum Actions {
    /// One index per transition.
    Discrete(Vec<u32>),
    /// `len * dim` values, row-major.
    Continuous { dim: usize, values: Vec<f32> },
}

impl Transitions {
    /// Number of transitions.
    pub fn len(&self) -> usize {
        self.rewards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rewards.is_empty()
    }
}

impl From<&TransitionBatch> for Transitions {
    fn from(b: &TransitionBatch) -> Self {
        Transitions {
            obs_dim: b.obs_dim,
            obs: b.obs.clone(),
            actions: Actions::Discrete(b.actions.clone()),
            rewards: b.rewards.clone(),
            next_obs: b.next_obs.clone(),
            terminals: b.terminals.clone(),
        }
    }
}

impl TransitionLayout {
    /// Entries of the action code.
    pub fn action_width(&self) -> usize {
        match self.action {
            ActionCoding::Discrete { n } => n,
            ActionCoding::Continuous { dim } => dim,
        }
    }

    /// Entries of one encoded transition.
    pub fn dim(&self) -> usize {
        2 * self.obs_dim + self.action_width() + 1 + usize::from(self.model_terminal)
    }

    /// Offset of the action code.
    fn action_at(&self) -> usize {
        self.obs_dim
    }

    /// Offset of the reward.
    pub fn reward_at(&self) -> usize {
        self.obs_dim + self.action_width()
    }

    /// Offset of `s'`.
    fn next_obs_at(&self) -> usize {
        self.reward_at() + 1
    }

    /// The kind of every entry, in order.
    pub fn kinds(&self) -> Vec<EntryKind> {
        let mut k = vec![EntryKind::Real; self.dim()];
        if let ActionCoding::Discrete { n } = self.action {
            for e in &mut k[self.action_at()..self.action_at() + n] {
                *e = EntryKind::OneHot;
            }
        }
        if self.model_terminal {
            let last = k.len() - 1;
            k[last] = EntryKind::Terminal;
        }
        k
    }

    /// Checks the layout is usable (a one-hot code needs at least one action).
    pub fn check(&self) -> Result<()> {
        if self.obs_dim == 0 || self.action_width() == 0 {
            return Err(NnError::Invalid(format!(
                "transition layout: obs_dim {} and action width {} must be positive",
                self.obs_dim,
                self.action_width()
            )));
        }
        Ok(())
    }

    /// Encodes `t` as `t.len()` rows of [`Self::dim`] values (row-major). Errors when `t` does
    /// not fit the layout (observation width, action kind or range, column lengths).
    pub fn encode(&self, t: &Transitions) -> Result<Vec<f32>> {
        self.check()?;
        let n = t.len();
        let d = self.obs_dim;
        let bad = |what: &str| Err(NnError::Invalid(format!("encode transitions: {what}")));
        if t.obs_dim != d || t.obs.len() != n * d || t.next_obs.len() != n * d {
            return bad("observation widths or lengths do not match the layout");
        }
        if t.terminals.len() != n {
            return bad("one terminal flag per transition is needed");
        }
        match (&t.actions, self.action) {
            (Actions::Discrete(a), ActionCoding::Discrete { n: k }) => {
                if a.len() != n {
                    return bad("one action per transition is needed");
                }
                if let Some(x) = a.iter().find(|&&x| x as usize >= k) {
                    return Err(NnError::Invalid(format!(
                        "encode transitions: action {x} outside 0..{k}"
                    )));
                }
            }
            (Actions::Continuous { dim, values }, ActionCoding::Continuous { dim: k }) => {
                if *dim != k || values.len() != n * k {
                    return bad("continuous action widths or lengths do not match");
                }
            }
            _ => return bad("action kind (discrete/continuous) does not match the layout"),
        }
        let w = self.dim();
        let mut out = vec![0.0f32; n * w];
        for (i, row) in out.chunks_exact_mut(w).enumerate() {
            row[..d].copy_from_slice(&t.obs[i * d..(i + 1) * d]);
            match &t.actions {
                Actions::Discrete(a) => row[self.action_at() + a[i] as usize] = 1.0,
                Actions::Continuous { dim, values } => row
                    [self.action_at()..self.action_at() + dim]
                    .copy_from_slice(&values[i * dim..(i + 1) * dim]),
            }
            row[self.reward_at()] = t.rewards[i];
            row[self.next_obs_at()..self.next_obs_at() + d]
                .copy_from_slice(&t.next_obs[i * d..(i + 1) * d]);
            if self.model_terminal {
                row[w - 1] = t.terminals[i];
            }
        }
        Ok(out)
    }

    /// Decodes rows of [`Self::dim`] values (row-major) into transitions: argmax over a
    /// one-hot block, terminal iff the flag exceeds 0.5 (0 when the layout has no flag).
    pub fn decode(&self, rows: &[f32]) -> Result<Transitions> {
        self.check()?;
        let w = self.dim();
        if !rows.len().is_multiple_of(w) {
            return Err(NnError::Invalid(format!(
                "decode transitions: {} values are not rows of {w}",
                rows.len()
            )));
        }
        let n = rows.len() / w;
        let d = self.obs_dim;
        let mut t = Transitions {
            obs_dim: d,
            obs: Vec::with_capacity(n * d),
            actions: match self.action {
                ActionCoding::Discrete { .. } => Actions::Discrete(Vec::with_capacity(n)),
                ActionCoding::Continuous { dim } => Actions::Continuous {
                    dim,
                    values: Vec::with_capacity(n * dim),
                },
            },
            rewards: Vec::with_capacity(n),
            next_obs: Vec::with_capacity(n * d),
            terminals: Vec::with_capacity(n),
        };
        let a0 = self.action_at();
        for row in rows.chunks_exact(w) {
            t.obs.extend_from_slice(&row[..d]);
            match &mut t.actions {
                Actions::Discrete(a) => a.push(argmax(&row[a0..a0 + self.action_width()])),
                Actions::Continuous { dim, values } => {
                    values.extend_from_slice(&row[a0..a0 + *dim])
                }
            }
            t.rewards.push(row[self.reward_at()]);
            t.next_obs
                .extend_from_slice(&row[self.next_obs_at()..self.next_obs_at() + d]);
            let done = self.model_terminal && row[w - 1] > 0.5;
            t.terminals.push(if done { 1.0 } else { 0.0 });
        }
        Ok(t)
    }
}

/// Index of the largest value (the first one on ties; NaN never wins).
fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] || xs[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cartpole_like() -> Transitions {
        Transitions {
            obs_dim: 2,
            obs: vec![0.1, -0.2, 0.3, 0.4, -1.0, 2.0],
            actions: Actions::Discrete(vec![1, 0, 1]),
            rewards: vec![1.0, 1.0, 0.5],
            next_obs: vec![0.2, -0.1, 0.35, 0.5, -1.5, 2.5],
            terminals: vec![0.0, 0.0, 1.0],
        }
    }

    #[test]
    fn discrete_round_trip_and_layout() {
        let layout = TransitionLayout {
            obs_dim: 2,
            action: ActionCoding::Discrete { n: 2 },
            model_terminal: true,
        };
        assert_eq!(layout.dim(), 8);
        let t = cartpole_like();
        let rows = layout.encode(&t).unwrap();
        assert_eq!(&rows[..8], &[0.1, -0.2, 0.0, 1.0, 1.0, 0.2, -0.1, 0.0]);
        assert_eq!(layout.decode(&rows).unwrap(), t);
        use EntryKind::*;
        assert_eq!(
            layout.kinds(),
            vec![Real, Real, OneHot, OneHot, Real, Real, Real, Terminal]
        );
    }

    #[test]
    fn decoding_takes_the_argmax_and_thresholds_done() {
        let layout = TransitionLayout {
            obs_dim: 1,
            action: ActionCoding::Discrete { n: 3 },
            model_terminal: true,
        };
        // s, a (3), r, s', done
        let rows = [
            0.5, 0.2, 0.7, 0.69, -1.0, 0.6, 0.51, //
            0.5, -0.3, -0.2, -0.9, 2.0, 0.6, 0.49,
        ];
        let t = layout.decode(&rows).unwrap();
        assert_eq!(t.actions, Actions::Discrete(vec![1, 1]));
        assert_eq!(t.terminals, vec![1.0, 0.0]);
        assert_eq!(t.rewards, vec![-1.0, 2.0]);
    }

    #[test]
    fn continuous_round_trip_and_bad_input() {
        let layout = TransitionLayout {
            obs_dim: 1,
            action: ActionCoding::Continuous { dim: 2 },
            model_terminal: false,
        };
        let t = Transitions {
            obs_dim: 1,
            obs: vec![0.5, 0.6],
            actions: Actions::Continuous {
                dim: 2,
                values: vec![0.1, 0.2, 0.3, 0.4],
            },
            rewards: vec![-1.0, -2.0],
            next_obs: vec![0.55, 0.65],
            terminals: vec![0.0, 0.0],
        };
        let rows = layout.encode(&t).unwrap();
        assert_eq!(rows.len(), 2 * layout.dim());
        assert_eq!(layout.decode(&rows).unwrap(), t);
        assert!(layout.decode(&rows[..4]).is_err(), "rows of 5");
        let mut wrong = cartpole_like();
        wrong.obs_dim = 1;
        assert!(layout.encode(&wrong).is_err());
        let discrete = TransitionLayout {
            obs_dim: 2,
            action: ActionCoding::Discrete { n: 1 },
            model_terminal: true,
        };
        assert!(discrete.encode(&cartpole_like()).is_err(), "action 1 of 1");
    }
}
