//! Empirical privacy audits of trained models: attacks whose success a DP guarantee bounds, so
//! a run can report how much an attacker actually learns next to its epsilon (issue 56, item
//! 6). Model-agnostic pieces (the ROC, TPR at a fixed FPR) serve any DP-SGD run; the scores of
//! a particular attack live next to it.
//!
//! - [`membership`]: membership inference, the white-box denoising-loss attack on a diffusion
//!   synthesizer (seed 003, section IX-D) and the ROC / TPR-at-FPR report of any attack score.

pub mod membership;

pub use membership::{AttackConfig, MembershipReport, Roc, denoising_loss_scores};
