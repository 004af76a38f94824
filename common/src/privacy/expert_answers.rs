//! Validation of the answers to DataRelease's count queries (seed 002, Algorithm 1) before they
//! reach the sparse vector test.
//!
//! The release is private because one expert moves a prefix count by at most 1: its answer is
//! the probability that it would take the prefix's actions, a number in [0, 1], and that
//! probability can only shrink as the prefix grows. An answer that breaks this (a value above 1,
//! a negative or non-finite value, a count rising with the prefix length) voids the sensitivity
//! the Laplace noise is calibrated for, so the coordinator refuses it whole (clamping it would
//! hide a broken or malicious client and still release a count computed from its numbers).

use super::PrivacyError;

/// How much an expert's prefix probability may rise from one prefix length to the next, relative
/// to its value: a few ulps, for products evaluated in another order (e.g. through logarithms).
/// A cumulative product of probabilities in [0, 1] never rises in IEEE arithmetic (rounding is
/// monotone), so honest answers pass with room to spare.
pub const PROBABILITY_RISE_TOLERANCE: f64 = 8.0 * f64::EPSILON;

/// The float slack of a client's summed answer, relative to the number of experts it hosts: a
/// sum of n probabilities carries a rounding error of order n x 1e-16 per unit, far below this,
/// and the slack adds at most `hosted x 1e-9` to what the client can contribute (negligible
/// beside the Laplace noise, whose scale 4/epsilon' is above 4).
pub const COUNT_RELATIVE_SLACK: f64 = 1e-9;

/// Checks one expert's answer to a count query: `p[h-1]` is the probability that the expert
/// takes the first h actions of the candidate trajectory in its states (h = 1..=len). Every value
/// must be finite, in [0, 1] (no slack: a product of probabilities never exceeds 1), and
/// non-increasing in h up to [`PROBABILITY_RISE_TOLERANCE`]. An empty answer is refused.
pub fn check_expert_prefix_probabilities(p: &[f64]) -> Result<(), PrivacyError> {
    if p.is_empty() {
        return Err(PrivacyError::InvalidAnswer(
            "an expert's answer holds at least one prefix probability".into(),
        ));
    }
    for (i, &v) in p.iter().enumerate() {
        if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
            return Err(PrivacyError::InvalidAnswer(format!(
                "expert's probability of the prefix of length {} is {v}: must be finite and in \
                 [0, 1]",
                i + 1
            )));
        }
        if i > 0 && v > p[i - 1] * (1.0 + PROBABILITY_RISE_TOLERANCE) {
            return Err(PrivacyError::InvalidAnswer(format!(
                "expert's probability rises from {} (prefix of length {i}) to {v} (length {}): \
                 a longer prefix cannot be more likely",
                p[i - 1],
                i + 1
            )));
        }
    }
    Ok(())
}

/// Checks a client's answer to a count query: `counts[h-1]` is the sum, over the
/// `hosted_experts` experts it hosts, of their probabilities of the prefix of length h. The
/// length must be in 1..=`horizon` (L), every value finite, in [0, hosted] up to a relative
/// [`COUNT_RELATIVE_SLACK`] of `hosted` (beyond it the answer is refused, never clamped), and
/// non-increasing in h up to the same slack. The coordinator must also check that the length is
/// the one of the trajectory it broadcast.
pub fn check_prefix_counts(
    counts: &[f64],
    hosted_experts: u64,
    horizon: u64,
) -> Result<(), PrivacyError> {
    let len = counts.len();
    if len == 0 || len as u64 > horizon {
        return Err(PrivacyError::InvalidAnswer(format!(
            "a count answer holds 1 to L = {horizon} prefix counts, got {len}"
        )));
    }
    let hosted = hosted_experts as f64;
    let slack = COUNT_RELATIVE_SLACK * hosted;
    let top = hosted + slack;
    for (i, &c) in counts.iter().enumerate() {
        if !(c.is_finite() && c >= 0.0 && c <= top) {
            return Err(PrivacyError::InvalidAnswer(format!(
                "count of the prefix of length {} is {c}: must be finite and in [0, {hosted_experts}] \
                 (the client hosts {hosted_experts} experts, each contributing a probability)",
                i + 1
            )));
        }
        if i > 0 && c > counts[i - 1] + slack {
            return Err(PrivacyError::InvalidAnswer(format!(
                "count rises from {} (prefix of length {i}) to {c} (length {}): a longer prefix \
                 cannot be more likely",
                counts[i - 1],
                i + 1
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(r: Result<(), PrivacyError>, needle: &str) {
        match r {
            Err(PrivacyError::InvalidAnswer(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("expected a refusal naming {needle:?}, got {other:?}"),
        }
    }

    #[test]
    fn honest_expert_answers_pass() {
        // A cumulative product of probabilities, as an expert computes it.
        let steps = [0.98, 0.02, 0.5, 1.0, 0.98];
        let mut p = Vec::new();
        let mut acc = 1.0;
        for s in steps {
            acc *= s;
            p.push(acc);
        }
        assert!(check_expert_prefix_probabilities(&p).is_ok());
        // The same through logarithms: equal up to ulps, accepted.
        let logs: Vec<f64> = steps
            .iter()
            .scan(0.0, |l, s: &f64| {
                *l += s.ln();
                Some(l.exp())
            })
            .collect();
        assert!(check_expert_prefix_probabilities(&logs).is_ok());
        assert!(check_expert_prefix_probabilities(&[1.0, 1.0, 0.0, 0.0]).is_ok());
    }

    #[test]
    fn bad_expert_answers_are_refused_with_the_index() {
        refused(
            check_expert_prefix_probabilities(&[0.9, 1.2]),
            "length 2 is 1.2",
        );
        refused(
            check_expert_prefix_probabilities(&[-0.1]),
            "length 1 is -0.1",
        );
        refused(check_expert_prefix_probabilities(&[0.5, f64::NAN]), "NaN");
        refused(
            check_expert_prefix_probabilities(&[0.5, 0.4, 0.45]),
            "rises from 0.4 (prefix of length 2) to 0.45 (length 3)",
        );
        refused(check_expert_prefix_probabilities(&[1.0 + 1e-15]), "[0, 1]");
        refused(check_expert_prefix_probabilities(&[]), "at least one");
    }

    #[test]
    fn client_counts_are_checked() {
        assert!(check_prefix_counts(&[3.0, 2.5, 2.5, 0.1], 3, 4).is_ok());
        // Float slack of the sum is accepted, a real excess is not.
        assert!(check_prefix_counts(&[3.0 + 1e-12], 3, 4).is_ok());
        refused(check_prefix_counts(&[3.01], 3, 4), "length 1 is 3.01");
        refused(
            check_prefix_counts(&[2.0, -1e-3], 3, 4),
            "length 2 is -0.001",
        );
        refused(check_prefix_counts(&[f64::NAN], 3, 4), "NaN");
        refused(check_prefix_counts(&[f64::INFINITY], 3, 4), "inf");
        refused(
            check_prefix_counts(&[1.0, 2.0], 3, 4),
            "rises from 1 (prefix of length 1) to 2 (length 2)",
        );
        refused(check_prefix_counts(&[], 3, 4), "got 0");
        refused(check_prefix_counts(&[1.0; 5], 3, 4), "L = 4");
        // A client with no experts can only answer zeros.
        assert!(check_prefix_counts(&[0.0, 0.0], 0, 4).is_ok());
        refused(check_prefix_counts(&[1e-300], 0, 4), "length 1");
    }
}
