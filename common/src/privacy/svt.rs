//! The sparse vector technique: AboveThreshold (Dwork & Roth 2014, Algorithm 1).
//!
//! A stream of queries of sensitivity `s` is compared with a threshold; the mechanism answers
//! "below" until the first query whose noisy value reaches the noisy threshold, answers "above"
//! for it and halts. The threshold is perturbed once with Lap(2s/epsilon), each query with
//! Lap(4s/epsilon), and the whole interaction — however many "below" answers — is epsilon-DP.
//! Its accounting event is [`AboveThreshold::event`].

use rand::Rng;

use super::laplace;
use super::{DpEvent, PrivacyError};

/// One answer of AboveThreshold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The noisy query value reached the noisy threshold; the mechanism has halted.
    Above,
    /// It did not.
    Below,
}

/// AboveThreshold with caller-provided randomness.
#[derive(Clone, Debug)]
pub struct AboveThreshold {
    noisy_threshold: f64,
    query_scale: f64,
    epsilon: f64,
    halted: bool,
}

impl AboveThreshold {
    /// Starts an epsilon-DP (`epsilon` in nats) AboveThreshold for queries of L1 sensitivity
    /// `sensitivity` against `threshold`, drawing the threshold noise from `rng`.
    pub fn new<R: Rng + ?Sized>(
        threshold: f64,
        epsilon: f64,
        sensitivity: f64,
        rng: &mut R,
    ) -> Result<Self, PrivacyError> {
        if !threshold.is_finite() {
            return Err(PrivacyError::InvalidParameter(format!(
                "threshold must be finite, got {threshold}"
            )));
        }
        let threshold_scale = laplace::scale_for_epsilon(epsilon / 2.0, sensitivity)?;
        let query_scale = laplace::scale_for_epsilon(epsilon / 4.0, sensitivity)?;
        Ok(Self {
            noisy_threshold: threshold + laplace::sample(threshold_scale, rng)?,
            query_scale,
            epsilon,
            halted: false,
        })
    }

    /// Compares `value` (the exact query answer) with the threshold. Errors once the mechanism
    /// has answered [`Answer::Above`]: further answers would cost more privacy.
    pub fn query<R: Rng + ?Sized>(
        &mut self,
        value: f64,
        rng: &mut R,
    ) -> Result<Answer, PrivacyError> {
        if self.halted {
            return Err(PrivacyError::InvalidParameter(
                "AboveThreshold has halted; start a new instance (and account for it)".into(),
            ));
        }
        if !value.is_finite() {
            return Err(PrivacyError::InvalidParameter(format!(
                "query value must be finite, got {value}"
            )));
        }
        if value + laplace::sample(self.query_scale, rng)? >= self.noisy_threshold {
            self.halted = true;
            Ok(Answer::Above)
        } else {
            Ok(Answer::Below)
        }
    }

    /// True once an [`Answer::Above`] has been given.
    pub fn is_halted(&self) -> bool {
        self.halted
    }

    /// Privacy cost of the whole interaction (pure epsilon-DP).
    pub fn event(&self) -> DpEvent {
        DpEvent::EpsilonDelta {
            epsilon: self.epsilon,
            delta: 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::ChaCha20Rng;

    #[test]
    fn finds_the_first_large_query_and_halts() {
        let mut rng = ChaCha20Rng::seed_from_u64(3);
        // Large epsilon: little noise, so the answer is the exact comparison.
        let mut svt =
            AboveThreshold::new(10.0, 1000.0, 1.0, &mut rng).unwrap_or_else(|e| panic!("{e}"));
        let answers: Vec<Answer> = [1.0, 5.0, 9.0, 50.0]
            .iter()
            .map(|&v| svt.query(v, &mut rng).unwrap_or(Answer::Below))
            .collect();
        assert_eq!(
            answers,
            vec![Answer::Below, Answer::Below, Answer::Below, Answer::Above]
        );
        assert!(svt.is_halted());
        assert!(svt.query(1.0, &mut rng).is_err());
        assert_eq!(
            svt.event(),
            DpEvent::EpsilonDelta {
                epsilon: 1000.0,
                delta: 0.0
            }
        );
    }

    #[test]
    fn rejects_bad_parameters() {
        let mut rng = ChaCha20Rng::seed_from_u64(3);
        assert!(AboveThreshold::new(1.0, 0.0, 1.0, &mut rng).is_err());
        assert!(AboveThreshold::new(f64::NAN, 1.0, 1.0, &mut rng).is_err());
    }
}
