//! Log-linear policy gradient (seed 004 §4.2.1 and appendix C.2.2, the Riverswim experiments):
//! a log-linear policy, a linear baseline, REINFORCE. Plain f64 arithmetic, no candle: the
//! Riverswim model has 18 numbers.
//!
//! # Model
//!
//! For an observation `o` (length `obs_dim`) and discrete actions `0..n_actions`:
//!
//! ```text
//! pi(a | o) = exp(theta . phi(o, a)) / sum_b exp(theta . phi(o, b)),   phi(o, a) = o (x) e_a
//! b(o)      = w . o
//! ```
//!
//! `theta` is an `[obs_dim, n_actions]` matrix (row-major), so the logit of action `a` is
//! `sum_s o_s theta[s, a]`. On Riverswim `o` is the one-hot state and `phi(s, a)` is the one-hot
//! of the (state, action) pair: the standard tabular log-linear policy. Seed 004 C.1 says the
//! feature is "a concatenation of the one-hot state and the action", but with a concatenation
//! `theta . phi(s, a) = theta_s . onehot(s) + theta_a . onehot(a)` the state term is the same for
//! every action and cancels in the softmax, leaving a policy that ignores the state; we use the
//! product features instead (a documented deviation).
//!
//! The flat parameter vector (what travels on the wire, f32) is `theta` (row-major) followed by
//! `w`: `dim = obs_dim * n_actions + obs_dim`.
//!
//! # Local update of one user
//!
//! The user plays `E` episodes with the current policy. With the discounted return-to-go
//! `G_t = sum_{k >= t} gamma^(k-t) r_k`:
//!
//! ```text
//! g_theta = 1/E sum_episodes sum_t gamma^t (G_t - b(o_t)) grad_theta log pi(a_t | o_t)
//! g_w     = 1/E sum_episodes 1/T sum_t (G_t - b(o_t)) o_t
//! ```
//!
//! `g_theta` is an unbiased estimate of the gradient of the expected discounted return (the
//! baseline adds no bias); `g_w` is the negative gradient of the baseline's mean squared error
//! (one regression step). With `grad_theta[s, c] log pi(a | o) = o_s (1[c = a] - pi(c | o))`.
//!
//! The update sent is `u = [eta_t g_theta ; beta g_w]` (policy learning rate `eta_t`, baseline
//! learning rate `beta`); the aggregator clips it, adds noise and applies the noisy mean with
//! server learning rate 1 (see `privacy::trust_region` for why the learning rate lives here).

use std::path::Path;

use fedrl_sim::{Action, Env, Space};
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};
use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};

use crate::tensor_io::{self, Tensor};
use crate::{NnError, Result};

/// Metadata key holding the [`LogLinearSpec`] as JSON in an exported policy file.
pub const LOGLINEAR_SPEC_KEY: &str = "fedrl.loglinear_spec";
/// Tensor name of `theta` (`[obs_dim, n_actions]`, f32) in an exported policy file.
pub const THETA_NAME: &str = "policy.theta";
/// Tensor name of the baseline weights `w` (`[obs_dim]`, f32) in an exported policy file.
pub const BASELINE_NAME: &str = "baseline.w";

/// Safety cap on the steps of one episode (environments truncate long before).
const MAX_EPISODE_STEPS: usize = 1_000_000;

/// Shape of a log-linear policy and its linear baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLinearSpec {
    /// Length of an observation (Riverswim: the number of states).
    pub obs_dim: usize,
    /// Number of discrete actions.
    pub n_actions: usize,
}

impl LogLinearSpec {
    /// The spec for an environment with a box observation space and a discrete action space.
    pub fn from_spaces(obs: &Space, act: &Space) -> Result<Self> {
        let obs_dim = match obs {
            Space::Box { low, .. } if !low.is_empty() => low.len(),
            other => {
                return Err(NnError::Invalid(format!(
                    "a log-linear policy needs a non-empty box observation space, got {other:?}"
                )));
            }
        };
        let n_actions = match act {
            Space::Discrete { n } if *n >= 2 => *n,
            other => {
                return Err(NnError::Invalid(format!(
                    "a log-linear policy needs at least 2 discrete actions, got {other:?}"
                )));
            }
        };
        Ok(Self { obs_dim, n_actions })
    }

    /// Number of policy parameters (`theta`).
    pub fn policy_len(&self) -> usize {
        self.obs_dim * self.n_actions
    }

    /// Length of the flat parameter vector: `theta` then `w`.
    pub fn dim(&self) -> usize {
        self.policy_len() + self.obs_dim
    }

    /// The initial parameters: all zero (the uniform policy and a zero baseline).
    pub fn init(&self) -> Vec<f32> {
        vec![0.0; self.dim()]
    }

    fn check(&self, params: &[f32]) -> Result<()> {
        if params.len() != self.dim() {
            return Err(NnError::ParamLength {
                got: params.len(),
                expected: self.dim(),
            });
        }
        Ok(())
    }

    /// Writes `pi(. | obs)` into `probs` (length `n_actions`); `params` is the flat vector.
    pub fn probs(&self, params: &[f32], obs: &[f32], probs: &mut [f64]) {
        let a_n = self.n_actions;
        probs.fill(0.0);
        for (s, &o) in obs.iter().enumerate().take(self.obs_dim) {
            if o != 0.0 {
                let row = &params[s * a_n..(s + 1) * a_n];
                for (p, &t) in probs.iter_mut().zip(row) {
                    *p += o as f64 * t as f64;
                }
            }
        }
        // Softmax with the maximum subtracted (no overflow for large logits).
        let max = probs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut sum = 0.0;
        for p in probs.iter_mut() {
            *p = (*p - max).exp();
            sum += *p;
        }
        for p in probs.iter_mut() {
            *p /= sum;
        }
    }

    /// `ln pi(action | obs)`.
    pub fn log_prob(&self, params: &[f32], obs: &[f32], action: usize) -> f64 {
        let mut p = vec![0.0; self.n_actions];
        self.probs(params, obs, &mut p);
        p[action].ln()
    }

    /// The baseline `b(obs) = w . obs`.
    pub fn baseline(&self, params: &[f32], obs: &[f32]) -> f64 {
        let w = &params[self.policy_len()..];
        w.iter().zip(obs).map(|(w, o)| *w as f64 * *o as f64).sum()
    }
}

/// One episode: observations before each action, actions and rewards.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Episode {
    /// `len() x obs_dim` observations, row by row (the one each action was chosen on).
    pub obs: Vec<f32>,
    /// The actions taken.
    pub actions: Vec<usize>,
    /// The rewards received.
    pub rewards: Vec<f64>,
}

impl Episode {
    /// Number of steps.
    pub fn len(&self) -> usize {
        self.actions.len()
    }

    /// True for an episode without steps.
    pub fn is_empty(&self) -> bool {
        self.actions.is_empty()
    }

    /// Undiscounted return.
    pub fn total_reward(&self) -> f64 {
        self.rewards.iter().sum()
    }

    /// `G_t = sum_{k >= t} gamma^(k-t) r_k` for every step.
    pub fn returns_to_go(&self, gamma: f64) -> Vec<f64> {
        let mut g = vec![0.0; self.rewards.len()];
        let mut acc = 0.0;
        for t in (0..self.rewards.len()).rev() {
            acc = self.rewards[t] + gamma * acc;
            g[t] = acc;
        }
        g
    }
}

/// Plays one episode in `env` (reset with `seed`) with the policy in `params`. Actions are
/// sampled from `pi` with a generator derived from `seed`, or the most likely action when
/// `greedy`.
pub fn rollout(
    spec: &LogLinearSpec,
    params: &[f32],
    env: &mut dyn Env,
    seed: u64,
    greedy: bool,
) -> Result<Episode> {
    spec.check(params)?;
    let got = LogLinearSpec::from_spaces(env.observation_space(), env.action_space())?;
    if got != *spec {
        return Err(NnError::Invalid(format!(
            "environment {} has shape {got:?}, the policy {spec:?}",
            env.id()
        )));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6c6f_676c_696e_0001);
    let mut obs = vec![0.0f32; spec.obs_dim];
    let mut probs = vec![0.0f64; spec.n_actions];
    env.reset(seed, &mut obs);
    let mut ep = Episode::default();
    for _ in 0..MAX_EPISODE_STEPS {
        spec.probs(params, &obs, &mut probs);
        let action = if greedy {
            // First maximum: ties go to the lower action index.
            probs
                .iter()
                .enumerate()
                .fold((0, f64::NEG_INFINITY), |(bi, bp), (i, &p)| {
                    if p > bp { (i, p) } else { (bi, bp) }
                })
                .0
        } else {
            let u: f64 = rng.random();
            let mut acc = 0.0;
            let mut a = spec.n_actions - 1;
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if u < acc {
                    a = i;
                    break;
                }
            }
            a
        };
        ep.obs.extend_from_slice(&obs);
        ep.actions.push(action);
        let step = env.step(Action::Discrete(action), &mut obs)?;
        ep.rewards.push(step.reward);
        if step.terminated || step.truncated {
            break;
        }
    }
    Ok(ep)
}

/// The two halves of a user's gradient (see the module documentation), in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct PgGradient {
    /// `g_theta`, length `policy_len` (ascent direction of the expected discounted return).
    pub policy: Vec<f64>,
    /// `g_w`, length `obs_dim` (descent direction of the baseline's squared error).
    pub baseline: Vec<f64>,
    /// Mean undiscounted return of the episodes.
    pub mean_return: f64,
}

/// REINFORCE with the linear baseline over `episodes` (all played with `params`), discount
/// `gamma` in [0, 1].
pub fn reinforce_gradient(
    spec: &LogLinearSpec,
    params: &[f32],
    episodes: &[Episode],
    gamma: f64,
) -> Result<PgGradient> {
    spec.check(params)?;
    let mut policy = vec![0.0; spec.policy_len()];
    let mut baseline = vec![0.0; spec.obs_dim];
    let mut probs = vec![0.0; spec.n_actions];
    let d = spec.obs_dim;
    let a_n = spec.n_actions;
    let mut total = 0.0;
    let mut counted = 0usize;
    for ep in episodes {
        total += ep.total_reward();
        if ep.is_empty() {
            continue;
        }
        counted += 1;
        let g = ep.returns_to_go(gamma);
        let inv_t = 1.0 / ep.len() as f64;
        let mut discount = 1.0;
        for (t, &action) in ep.actions.iter().enumerate() {
            let o = &ep.obs[t * d..(t + 1) * d];
            let adv = g[t] - spec.baseline(params, o);
            spec.probs(params, o, &mut probs);
            let coef = discount * adv;
            for (s, &os) in o.iter().enumerate() {
                if os == 0.0 {
                    continue;
                }
                let os = os as f64;
                for c in 0..a_n {
                    let ind = if c == action { 1.0 } else { 0.0 };
                    policy[s * a_n + c] += coef * os * (ind - probs[c]);
                }
                baseline[s] += inv_t * adv * os;
            }
            discount *= gamma;
        }
    }
    let scale = 1.0 / counted.max(1) as f64;
    for x in policy.iter_mut().chain(baseline.iter_mut()) {
        *x *= scale;
    }
    Ok(PgGradient {
        policy,
        baseline,
        mean_return: total / episodes.len().max(1) as f64,
    })
}

/// The vector a user sends: `[lr * g_theta ; baseline_lr * g_w]` as f32 (unclipped; the caller
/// or the client agent clips it).
pub fn local_update(grad: &PgGradient, lr: f64, baseline_lr: f64) -> Vec<f32> {
    grad.policy
        .iter()
        .map(|g| (lr * g) as f32)
        .chain(grad.baseline.iter().map(|g| (baseline_lr * g) as f32))
        .collect()
}

/// Mean and (population) standard deviation of the undiscounted return of `params` over one
/// episode per `(env, seed)` pair, sampled (`greedy = false`) or greedy actions.
pub fn evaluate(
    spec: &LogLinearSpec,
    params: &[f32],
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    greedy: bool,
) -> Result<(f64, f64)> {
    let mut returns = Vec::with_capacity(envs.len());
    for (env, &seed) in envs.iter_mut().zip(seeds) {
        returns.push(rollout(spec, params, env.as_mut(), seed, greedy)?.total_reward());
    }
    let n = returns.len().max(1) as f64;
    let mean = returns.iter().sum::<f64>() / n;
    let var = returns.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n;
    Ok((mean, var.sqrt()))
}

/// Serialises a log-linear policy as safetensors: `policy.theta` `[obs_dim, n_actions]` and
/// `baseline.w` `[obs_dim]` (f32), the spec as JSON under [`LOGLINEAR_SPEC_KEY`].
pub fn to_bytes(spec: &LogLinearSpec, params: &[f32]) -> Result<Vec<u8>> {
    spec.check(params)?;
    let tensors = [
        Tensor::f32(
            THETA_NAME,
            vec![spec.obs_dim, spec.n_actions],
            &params[..spec.policy_len()],
        ),
        Tensor::f32(
            BASELINE_NAME,
            vec![spec.obs_dim],
            &params[spec.policy_len()..],
        ),
    ];
    let json = serde_json::to_string(spec).map_err(|e| NnError::Invalid(e.to_string()))?;
    tensor_io::serialize(&tensors, LOGLINEAR_SPEC_KEY, json)
}

/// Parses bytes written by [`to_bytes`].
pub fn from_bytes(bytes: &[u8]) -> Result<(LogLinearSpec, Vec<f32>)> {
    let json = tensor_io::metadata_entry(bytes, LOGLINEAR_SPEC_KEY)?
        .ok_or_else(|| NnError::Invalid(format!("no {LOGLINEAR_SPEC_KEY} in the metadata")))?;
    let spec: LogLinearSpec =
        serde_json::from_str(&json).map_err(|e| NnError::Invalid(e.to_string()))?;
    let st = tensor_io::parse(bytes)?;
    let mut params = Vec::with_capacity(spec.dim());
    for (name, n) in [
        (THETA_NAME, spec.policy_len()),
        (BASELINE_NAME, spec.obs_dim),
    ] {
        let data = tensor_io::tensor_bytes(&st, name, Dtype::F32, None)?;
        if data.len() != 4 * n {
            return Err(NnError::Invalid(format!(
                "{name}: expected {n} f32 values, got {} bytes",
                data.len()
            )));
        }
        params.extend(tensor_io::le_f32s(data));
    }
    Ok((spec, params))
}

/// Writes [`to_bytes`] to `path`.
pub fn save(path: &Path, spec: &LogLinearSpec, params: &[f32]) -> Result<()> {
    std::fs::write(path, to_bytes(spec, params)?)?;
    Ok(())
}

/// Exact expected returns of a tabular policy on [`fedrl_sim::riverswim::RiverSwim`] from its
/// start state (left bank), by forward dynamic programming over the horizon: `(discounted with
/// gamma, undiscounted)`. `action_probs(s)` gives `pi(. | s)` for state index `s`. For tests and
/// for comparing learned policies with the optimum.
pub fn riverswim_expected_return(
    env: &fedrl_sim::riverswim::RiverSwim,
    gamma: f64,
    mut action_probs: impl FnMut(usize) -> [f64; 2],
) -> (f64, f64) {
    let n = env.n_states;
    let mut dist = vec![0.0; n];
    dist[0] = 1.0;
    let (mut disc, mut undisc, mut g) = (0.0, 0.0, 1.0);
    let pis: Vec<[f64; 2]> = (0..n).map(&mut action_probs).collect();
    for _ in 0..env.horizon {
        let mut next = vec![0.0; n];
        let mut r = 0.0;
        for s in 0..n {
            for (a, &pa) in pis[s].iter().enumerate() {
                let m = dist[s] * pa;
                r += m * env.expected_reward(s, a);
                for (s2, nx) in next.iter_mut().enumerate() {
                    *nx += m * env.transition_prob(s, a, s2);
                }
            }
        }
        disc += g * r;
        undisc += r;
        g *= gamma;
        dist = next;
    }
    (disc, undisc)
}

/// The optimal undiscounted expected return of a finite-horizon [`fedrl_sim::riverswim::RiverSwim`]
/// episode from the left bank (backward induction; the optimal policy is non-stationary).
pub fn riverswim_optimal_return(env: &fedrl_sim::riverswim::RiverSwim) -> f64 {
    let n = env.n_states;
    let mut v = vec![0.0; n];
    for _ in 0..env.horizon {
        v = (0..n)
            .map(|s| {
                (0..2)
                    .map(|a| {
                        env.expected_reward(s, a)
                            + (0..n)
                                .map(|s2| env.transition_prob(s, a, s2) * v[s2])
                                .sum::<f64>()
                    })
                    .fold(f64::NEG_INFINITY, f64::max)
            })
            .collect();
    }
    v[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use fedrl_sim::riverswim::RiverSwim;
    use rand_distr::{Distribution, StandardNormal};

    fn riverswim_spec() -> LogLinearSpec {
        let env = RiverSwim::new();
        LogLinearSpec::from_spaces(env.observation_space(), env.action_space()).unwrap()
    }

    fn random_params(spec: &LogLinearSpec, seed: u64, scale: f64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..spec.dim())
            .map(|_| {
                let z: f64 = StandardNormal.sample(&mut rng);
                (scale * z) as f32
            })
            .collect()
    }

    fn tabular_probs(spec: &LogLinearSpec, params: &[f32], s: usize) -> [f64; 2] {
        let mut o = vec![0.0f32; spec.obs_dim];
        o[s] = 1.0;
        let mut p = [0.0; 2];
        spec.probs(params, &o, &mut p);
        p
    }

    #[test]
    fn riverswim_shape() {
        let spec = riverswim_spec();
        assert_eq!((spec.obs_dim, spec.n_actions), (6, 2));
        assert_eq!(spec.dim(), 18);
        let p = tabular_probs(&spec, &spec.init(), 3);
        assert_eq!(p, [0.5, 0.5]);
    }

    /// The policy half of the gradient is the gradient of the surrogate
    /// `sum_t gamma^t A_t ln pi(a_t | o_t)` with the advantages held fixed: check it against
    /// central finite differences in f64.
    #[test]
    fn policy_gradient_matches_finite_differences() {
        let spec = riverswim_spec();
        let params = random_params(&spec, 3, 0.7);
        let mut env = RiverSwim::new();
        let ep = rollout(&spec, &params, &mut env, 11, false).unwrap();
        assert_eq!(ep.len(), 20);
        let gamma = 0.9;
        let grad = reinforce_gradient(&spec, &params, std::slice::from_ref(&ep), gamma).unwrap();
        let g = ep.returns_to_go(gamma);
        let adv: Vec<f64> = (0..ep.len())
            .map(|t| g[t] - spec.baseline(&params, &ep.obs[t * 6..(t + 1) * 6]))
            .collect();
        // The surrogate in f64 parameters (finite differences in f32 would be too coarse).
        let surrogate = |theta: &[f64]| -> f64 {
            let mut total = 0.0;
            let mut disc = 1.0;
            for t in 0..ep.len() {
                let o = &ep.obs[t * 6..(t + 1) * 6];
                let logits: Vec<f64> = (0..2)
                    .map(|a| (0..6).map(|s| o[s] as f64 * theta[s * 2 + a]).sum())
                    .collect();
                let lse = (logits[0].exp() + logits[1].exp()).ln();
                total += disc * adv[t] * (logits[ep.actions[t]] - lse);
                disc *= gamma;
            }
            total
        };
        let theta: Vec<f64> = params[..12].iter().map(|x| *x as f64).collect();
        let h = 1e-6;
        for i in 0..12 {
            let mut up = theta.clone();
            up[i] += h;
            let mut dn = theta.clone();
            dn[i] -= h;
            let fd = (surrogate(&up) - surrogate(&dn)) / (2.0 * h);
            assert!(
                (fd - grad.policy[i]).abs() < 1e-6 * (1.0 + fd.abs()),
                "component {i}: finite differences {fd}, analytic {}",
                grad.policy[i]
            );
        }
        // Baseline half: the negative gradient of the mean squared error / 2.
        let mse = |w: &[f64]| -> f64 {
            (0..ep.len())
                .map(|t| {
                    let o = &ep.obs[t * 6..(t + 1) * 6];
                    let b: f64 = (0..6).map(|s| o[s] as f64 * w[s]).sum();
                    0.5 * (g[t] - b).powi(2)
                })
                .sum::<f64>()
                / ep.len() as f64
        };
        let w: Vec<f64> = params[12..].iter().map(|x| *x as f64).collect();
        for i in 0..6 {
            let mut up = w.clone();
            up[i] += h;
            let mut dn = w.clone();
            dn[i] -= h;
            let fd = -(mse(&up) - mse(&dn)) / (2.0 * h);
            assert!(
                (fd - grad.baseline[i]).abs() < 1e-6 * (1.0 + fd.abs()),
                "baseline {i}: {fd} vs {}",
                grad.baseline[i]
            );
        }
    }

    /// REINFORCE is unbiased: averaged over many episodes it matches the finite-difference
    /// gradient of the exact expected discounted return (dynamic programming), whatever the
    /// baseline.
    #[test]
    fn expected_gradient_matches_the_exact_return_gradient() {
        let spec = riverswim_spec();
        let env = RiverSwim::new();
        // Lean to the right so that the right bank is reached often enough to matter.
        let mut params = random_params(&spec, 5, 0.3);
        for s in 0..6 {
            params[s * 2 + 1] += 0.4;
        }
        let gamma = 0.95;
        let exact = |theta: &[f32]| {
            riverswim_expected_return(&env, gamma, |s| tabular_probs(&spec, theta, s)).0
        };
        let h = 1e-3f32;
        let fd: Vec<f64> = (0..12)
            .map(|i| {
                let mut up = params.clone();
                up[i] += h;
                let mut dn = params.clone();
                dn[i] -= h;
                (exact(&up) - exact(&dn)) / (2.0 * h as f64)
            })
            .collect();
        let episodes: Vec<Episode> = (0..40_000u64)
            .map(|k| rollout(&spec, &params, &mut RiverSwim::new(), k, false).unwrap())
            .collect();
        let grad = reinforce_gradient(&spec, &params, &episodes, gamma).unwrap();
        let err: f64 = fd
            .iter()
            .zip(&grad.policy)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm: f64 = fd.iter().map(|a| a * a).sum::<f64>().sqrt();
        assert!(norm > 0.05, "{fd:?}");
        assert!(
            err < 0.1 * norm,
            "error {err} vs norm {norm}: {fd:?} vs {:?}",
            grad.policy
        );
        // The sampled mean return matches the exact undiscounted expectation.
        let (_, undisc) =
            riverswim_expected_return(&env, gamma, |s| tabular_probs(&spec, &params, s));
        assert!((grad.mean_return - undisc).abs() < 0.05 * undisc.max(0.1));
    }

    #[test]
    fn optimal_riverswim_return_beats_every_stationary_policy() {
        let env = RiverSwim::new();
        let opt = riverswim_optimal_return(&env);
        let always_right = riverswim_expected_return(&env, 1.0, |_| [0.0, 1.0]).1;
        let always_left = riverswim_expected_return(&env, 1.0, |_| [1.0, 0.0]).1;
        assert!((always_left - 0.1).abs() < 1e-12, "{always_left}");
        assert!(opt >= always_right && always_right > always_left);
        // Backward induction from the last step: the optimum is close to always-right.
        assert!(opt - always_right < 0.5, "{opt} vs {always_right}");
    }

    #[test]
    fn update_scales_and_export_round_trips() {
        let spec = riverswim_spec();
        let params = random_params(&spec, 9, 1.0);
        let ep = rollout(&spec, &params, &mut RiverSwim::new(), 2, false).unwrap();
        let grad = reinforce_gradient(&spec, &params, &[ep], 0.99).unwrap();
        let u = local_update(&grad, 12.0, 0.5);
        assert_eq!(u.len(), 18);
        assert!((u[3] as f64 - 12.0 * grad.policy[3]).abs() < 1e-4);
        assert!((u[14] as f64 - 0.5 * grad.baseline[2]).abs() < 1e-5);
        let bytes = to_bytes(&spec, &params).unwrap();
        let (s2, p2) = from_bytes(&bytes).unwrap();
        assert_eq!((s2, p2), (spec, params.clone()));
        assert!(to_bytes(&spec, &params[..3]).is_err());
        // Greedy rollouts are deterministic; an env of another shape is refused.
        let a = rollout(&spec, &params, &mut RiverSwim::new(), 4, true).unwrap();
        let b = rollout(&spec, &params, &mut RiverSwim::new(), 4, true).unwrap();
        assert_eq!(a, b);
        assert!(rollout(&spec, &params, &mut RiverSwim::with_states(4), 4, true).is_err());
    }
}
