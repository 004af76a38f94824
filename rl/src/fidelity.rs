//! Fidelity of a synthetic table against real rows (seed 003, section VIII-C and appendix H-C):
//! the statistics SDMetrics' quality report names "column shapes" and "column pair trends".
//!
//! - **Marginal**: the mean over dimensions of `1 - KS`, where `KS` is the two-sample
//!   Kolmogorov-Smirnov statistic `sup_x |F_real(x) - F_syn(x)|` of the empirical CDFs (the
//!   statistic of `scipy.stats.ks_2samp`).
//! - **Correlation**: the mean over dimension pairs `j < k` of `1 - |rho_real - rho_syn| / 2`,
//!   with Spearman's rho (the Pearson correlation of ranks, tied values sharing their average
//!   rank, as `scipy.stats.spearmanr`). A pair whose rho is undefined on either side (a constant
//!   column) is left out of the mean and counted in [`Fidelity::undefined_pairs`].
//!
//! Both scores lie in `[0, 1]`, 1 meaning identical marginals / rank correlations. Tables are
//! row-major `f32` (rows of `dim`), sums are in f64. The inputs are what a caller reports: the
//! real rows are held-out sensitive data, so the scores are operator-side evaluations, not DP
//! outputs, unless the caller computes them on public data.

use crate::{NnError, Result};

/// Both fidelity scores of one synthetic table.
#[derive(Clone, Debug, PartialEq)]
pub struct Fidelity {
    /// Mean over dimensions of `1 - KS`.
    pub marginal: f64,
    /// Mean over defined pairs of `1 - |rho_real - rho_syn| / 2`; `None` when no pair is
    /// defined (fewer than two dimensions, or every pair has a constant column).
    pub correlation: Option<f64>,
    /// Pairs left out of `correlation` because a column is constant on one side.
    pub undefined_pairs: usize,
    /// `1 - KS` of each dimension, in column order (their mean is `marginal`): where a
    /// synthetic table's marginals fall short.
    pub per_dimension: Vec<f64>,
}

/// The two-sample Kolmogorov-Smirnov statistic of `a` and `b` (non-empty, no NaN).
pub fn ks_statistic(a: &[f64], b: &[f64]) -> f64 {
    let mut a = a.to_vec();
    let mut b = b.to_vec();
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j, mut d) = (0usize, 0usize, 0.0f64);
    // Step through the distinct values of both samples; after passing every copy of a value,
    // both CDFs are right-continuous values at it.
    while i < a.len() && j < b.len() {
        let x = if a[i] <= b[j] { a[i] } else { b[j] };
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
        d = d.max((i as f64 / na - j as f64 / nb).abs());
    }
    d
}

/// Ranks `1..=n` of `x`, ties sharing their average rank.
pub fn average_ranks(x: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&p, &q| x[p].total_cmp(&x[q]));
    let mut ranks = vec![0.0; x.len()];
    let mut s = 0;
    while s < idx.len() {
        let mut e = s + 1;
        while e < idx.len() && x[idx[e]] == x[idx[s]] {
            e += 1;
        }
        // Positions s..e (0-based) hold ranks s+1..=e: their average.
        let r = (s + 1 + e) as f64 / 2.0;
        for &k in &idx[s..e] {
            ranks[k] = r;
        }
        s = e;
    }
    ranks
}

/// Pearson correlation; `None` when either input is constant.
pub fn pearson(x: &[f64], y: &[f64]) -> Option<f64> {
    let n = x.len() as f64;
    let mx = x.iter().sum::<f64>() / n;
    let my = y.iter().sum::<f64>() / n;
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx) * (a - mx);
        syy += (b - my) * (b - my);
    }
    if sxx == 0.0 || syy == 0.0 {
        return None;
    }
    Some((sxy / (sxx.sqrt() * syy.sqrt())).clamp(-1.0, 1.0))
}

/// Spearman's rho of `x` and `y`; `None` when either is constant.
pub fn spearman(x: &[f64], y: &[f64]) -> Option<f64> {
    pearson(&average_ranks(x), &average_ranks(y))
}

/// Column `j` of a row-major table as f64.
fn column(rows: &[f32], dim: usize, j: usize) -> Vec<f64> {
    rows.chunks_exact(dim).map(|r| f64::from(r[j])).collect()
}

/// Both fidelity scores of `synthetic` against `real` (row-major, rows of `dim`). Errors on
/// empty or ragged tables or a non-finite value.
pub fn fidelity(real: &[f32], synthetic: &[f32], dim: usize) -> Result<Fidelity> {
    for (name, t) in [("real", real), ("synthetic", synthetic)] {
        if dim == 0 || t.is_empty() || !t.len().is_multiple_of(dim) {
            return Err(NnError::Invalid(format!(
                "fidelity: the {name} table has {} values, not a positive number of rows of {dim}",
                t.len()
            )));
        }
        if t.iter().any(|v| !v.is_finite()) {
            return Err(NnError::Invalid(format!(
                "fidelity: the {name} table has a non-finite value"
            )));
        }
    }
    let real_cols: Vec<Vec<f64>> = (0..dim).map(|j| column(real, dim, j)).collect();
    let syn_cols: Vec<Vec<f64>> = (0..dim).map(|j| column(synthetic, dim, j)).collect();
    let per_dimension: Vec<f64> = real_cols
        .iter()
        .zip(&syn_cols)
        .map(|(r, s)| 1.0 - ks_statistic(r, s))
        .collect();
    let marginal = per_dimension.iter().sum::<f64>() / dim as f64;
    let real_ranks: Vec<Vec<f64>> = real_cols.iter().map(|c| average_ranks(c)).collect();
    let syn_ranks: Vec<Vec<f64>> = syn_cols.iter().map(|c| average_ranks(c)).collect();
    let (mut sum, mut defined, mut undefined) = (0.0, 0usize, 0usize);
    for j in 0..dim {
        for k in j + 1..dim {
            match (
                pearson(&real_ranks[j], &real_ranks[k]),
                pearson(&syn_ranks[j], &syn_ranks[k]),
            ) {
                (Some(a), Some(b)) => {
                    sum += 1.0 - (a - b).abs() / 2.0;
                    defined += 1;
                }
                _ => undefined += 1,
            }
        }
    }
    Ok(Fidelity {
        marginal,
        correlation: (defined > 0).then(|| sum / defined as f64),
        undefined_pairs: undefined,
        per_dimension,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ks_by_hand() {
        // CDFs at 1, 2, 3, 4: a = 1/3, 2/3, 1, 1; b = 0, 1/2, 1/2, 1: the largest gap is 1/2 at 3.
        let d = ks_statistic(&[1.0, 2.0, 3.0], &[2.0, 4.0]);
        assert!((d - 0.5).abs() < 1e-12, "{d}");
        assert_eq!(ks_statistic(&[1.0, 2.0], &[2.0, 1.0]), 0.0);
        assert_eq!(ks_statistic(&[0.0], &[1.0]), 1.0);
    }

    #[test]
    fn ties_share_their_average_rank() {
        assert_eq!(
            average_ranks(&[3.0, 1.0, 3.0, 2.0]),
            vec![3.5, 1.0, 3.5, 2.0]
        );
        let rho = spearman(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]).unwrap();
        assert!((rho + 1.0).abs() < 1e-12, "{rho}");
        assert_eq!(spearman(&[1.0, 1.0], &[1.0, 2.0]), None);
    }

    #[test]
    fn identical_tables_score_one() {
        let t = [0.1, 5.0, 0.2, 3.0, -0.4, 4.0, 0.9, 1.0];
        let f = fidelity(&t, &t, 2).unwrap();
        assert_eq!(f.marginal, 1.0);
        assert_eq!(f.correlation, Some(1.0));
        assert!(fidelity(&t, &t[..3], 2).is_err());
    }
}
