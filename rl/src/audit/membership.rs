//! Membership inference (seed 003, section IX-D): given a trained model, members of its training
//! (fine-tuning) set and held-out non-members from the same distribution, how well does an
//! attacker tell them apart?
//!
//! **The attack** ([`denoising_loss_scores`]): white-box, on a diffusion model. A row's score is
//! its weighted EDM denoising loss (the training loss's per-example term,
//! [`edm::per_example_loss`]) averaged over fixed noise levels `sigmas` and `draws` noise draws
//! per level. The noise is common to all rows (draw `j` of level `i` is the same vector for
//! every row, from `seed`), so scores differ only through the rows and the model; a lower loss
//! means the model fits the row better, i.e. "member". (The paper attacks with the white-box
//! method of its reference [2023whithmiadiffusion]; fedrl uses the loss-threshold form of that
//! white-box access, the standard baseline of membership inference on diffusion models.)
//!
//! **The report** ([`Roc`], [`MembershipReport`]): the attacker predicts "member" when the score
//! is at most a threshold `tau`; sweeping `tau` over every distinct score gives the empirical
//! ROC points `(FPR(tau), TPR(tau))` from `(0, 0)` to `(1, 1)`, tied scores falling on the same
//! side of every threshold (one point per distinct value). **TPR at FPR `alpha`** is the largest
//! TPR among ROC points with `FPR <= alpha`, with no interpolation between points: the
//! attacker's real operating points only, which is conservative (never above the linear
//! interpolation). With `n` non-members the achievable FPRs are multiples of `1/n`, so TPR at
//! 1% FPR needs at least 100 non-members to mean more than TPR at FPR 0. The AUC is the area
//! under the points joined linearly, i.e. the Mann-Whitney probability that a member scores
//! below a non-member, ties counting one half.
//!
//! Invariants: scores must be finite (an error otherwise); both sets must be non-empty.

use candle_core::Tensor;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use serde::{Deserialize, Serialize};

use crate::diffusion::edm::{self, EdmConfig, EdmNet};
use crate::{NnError, Result};

/// The attack's fixed noise levels and draws.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AttackConfig {
    /// Noise levels (normalised units). Default: 8 levels, geometric from 0.01 to 2, the
    /// range where a denoiser's loss still depends on the particular row (at large sigma the
    /// estimate falls back to the data mean for every row).
    pub sigmas: Vec<f64>,
    /// Noise draws per level.
    pub draws: usize,
    /// Seed of the common noise.
    pub seed: u64,
}

impl Default for AttackConfig {
    fn default() -> Self {
        let (lo, hi, n) = (0.01f64, 2.0f64, 8);
        AttackConfig {
            sigmas: (0..n)
                .map(|i| lo * (hi / lo).powf(i as f64 / (n - 1) as f64))
                .collect(),
            draws: 4,
            seed: 0x006d_6961,
        }
    }
}

/// Every row's attack score: its weighted denoising loss under `net` with `params`, averaged
/// over `cfg`'s levels and draws (lower: more likely a member). `rows` are normalised rows of
/// `net.data_dim()` values; all of them go through the network together, so a conditional
/// network ([`crate::diffusion::trajectory::Conditioned`]) must be bound to one condition row
/// per row.
pub fn denoising_loss_scores<N: EdmNet + ?Sized>(
    edm_cfg: &EdmConfig,
    net: &N,
    params: &[Tensor],
    rows: &[f32],
    cfg: &AttackConfig,
) -> Result<Vec<f64>> {
    let d = net.data_dim();
    if rows.is_empty() || !rows.len().is_multiple_of(d) {
        return Err(NnError::Invalid(format!(
            "membership attack: {} values are not rows of {d}",
            rows.len()
        )));
    }
    if cfg.sigmas.is_empty()
        || cfg.draws == 0
        || cfg.sigmas.iter().any(|s| !(s.is_finite() && *s > 0.0))
    {
        return Err(NnError::Invalid(format!(
            "membership attack: levels {:?} and {} draws",
            cfg.sigmas, cfg.draws
        )));
    }
    let n = rows.len() / d;
    let dev = net.device().clone();
    let x0 = Tensor::from_slice(rows, (n, d), &dev)?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(cfg.seed);
    let mut total = vec![0f64; n];
    for &s in &cfg.sigmas {
        for _ in 0..cfg.draws {
            // One noise vector for every row: common random numbers.
            let noise = edm::normal_tensor(1, d, &mut rng, &dev)?.broadcast_as((n, d))?;
            let noise = noise.contiguous()?;
            let l: Vec<f32> =
                edm::per_example_loss(edm_cfg, net, params, &x0, &vec![s; n], &noise)?.to_vec1()?;
            for (t, v) in total.iter_mut().zip(l) {
                *t += f64::from(v);
            }
        }
    }
    let k = (cfg.sigmas.len() * cfg.draws) as f64;
    Ok(total.into_iter().map(|t| t / k).collect())
}

/// An empirical ROC of a score where lower means "member".
#[derive(Clone, Debug, PartialEq)]
pub struct Roc {
    /// `(FPR, TPR)` points, non-decreasing in both, from `(0, 0)` to `(1, 1)`.
    pub points: Vec<(f64, f64)>,
}

impl Roc {
    /// The ROC of `members`' scores against `non_members`' (module docs).
    pub fn new(members: &[f64], non_members: &[f64]) -> Result<Self> {
        if members.is_empty() || non_members.is_empty() {
            return Err(NnError::Invalid(
                "membership ROC: members and non-members must both be non-empty".into(),
            ));
        }
        if members.iter().chain(non_members).any(|s| !s.is_finite()) {
            return Err(NnError::Invalid(
                "membership ROC: a score is not finite".into(),
            ));
        }
        // (score, is_member), ascending score.
        let mut all: Vec<(f64, bool)> = members
            .iter()
            .map(|&s| (s, true))
            .chain(non_members.iter().map(|&s| (s, false)))
            .collect();
        all.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (m, n) = (members.len() as f64, non_members.len() as f64);
        let mut points = vec![(0.0, 0.0)];
        let (mut tp, mut fp) = (0usize, 0usize);
        let mut i = 0;
        while i < all.len() {
            // Every row tied with this score falls below the same thresholds.
            let s = all[i].0;
            while i < all.len() && all[i].0 == s {
                if all[i].1 {
                    tp += 1;
                } else {
                    fp += 1;
                }
                i += 1;
            }
            points.push((fp as f64 / n, tp as f64 / m));
        }
        Ok(Roc { points })
    }

    /// The largest TPR among points with `FPR <= alpha` (no interpolation).
    pub fn tpr_at_fpr(&self, alpha: f64) -> f64 {
        self.points
            .iter()
            .filter(|(f, _)| *f <= alpha)
            .map(|(_, t)| *t)
            .fold(0.0, f64::max)
    }

    /// Area under the points joined linearly (the Mann-Whitney statistic, ties one half).
    pub fn auc(&self) -> f64 {
        self.points
            .windows(2)
            .map(|w| (w[1].0 - w[0].0) * (w[1].1 + w[0].1) / 2.0)
            .sum()
    }
}

/// What a run reports of one membership attack.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MembershipReport {
    pub members: usize,
    pub non_members: usize,
    /// TPR at 10% FPR (the paper's headline; chance = 0.1).
    pub tpr_at_10pct_fpr: f64,
    /// TPR at 1% FPR (chance = 0.01; needs >= 100 non-members to be meaningful).
    pub tpr_at_1pct_fpr: f64,
    /// Area under the ROC (chance = 0.5).
    pub auc: f64,
}

impl MembershipReport {
    /// The report of `members`' scores against `non_members'` (lower: member).
    pub fn new(members: &[f64], non_members: &[f64]) -> Result<Self> {
        let roc = Roc::new(members, non_members)?;
        Ok(MembershipReport {
            members: members.len(),
            non_members: non_members.len(),
            tpr_at_10pct_fpr: roc.tpr_at_fpr(0.10),
            tpr_at_1pct_fpr: roc.tpr_at_fpr(0.01),
            auc: roc.auc(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roc_matches_a_hand_computation() {
        // Ascending: 1m 2m 2.5n 3m 4m 5n 6n 7n.
        let roc = Roc::new(&[3.0, 1.0, 4.0, 2.0], &[5.0, 2.5, 7.0, 6.0]).unwrap();
        assert_eq!(
            roc.points,
            vec![
                (0.0, 0.0),
                (0.0, 0.25),
                (0.0, 0.5),
                (0.25, 0.5),
                (0.25, 0.75),
                (0.25, 1.0),
                (0.5, 1.0),
                (0.75, 1.0),
                (1.0, 1.0)
            ]
        );
        assert_eq!(roc.tpr_at_fpr(0.1), 0.5);
        assert_eq!(roc.tpr_at_fpr(0.01), 0.5);
        assert_eq!(roc.tpr_at_fpr(0.25), 1.0);
        // Mann-Whitney: member below non-member in 4 + 4 + 3 + 3 of 16 pairs.
        assert!((roc.auc() - 14.0 / 16.0).abs() < 1e-15);
    }

    #[test]
    fn ties_share_one_point_and_count_half() {
        let roc = Roc::new(&[1.0, 1.0], &[1.0, 2.0]).unwrap();
        assert_eq!(roc.points, vec![(0.0, 0.0), (0.5, 1.0), (1.0, 1.0)]);
        // The attacker cannot take one tied member without the tied non-member.
        assert_eq!(roc.tpr_at_fpr(0.1), 0.0);
        assert!((roc.auc() - 0.75).abs() < 1e-15);
        let r = MembershipReport::new(&[1.0, 1.0], &[1.0, 2.0]).unwrap();
        assert_eq!((r.members, r.non_members), (2, 2));
        assert!(Roc::new(&[], &[1.0]).is_err());
        assert!(Roc::new(&[f64::NAN], &[1.0]).is_err());
    }
}
