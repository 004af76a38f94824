//! The named, seeded procedure that makes an offline dataset from a [`DatasetSpec`]: a behaviour
//! policy rolled out in a simulator population, each privacy unit owning its episodes.
//!
//! - [`Behaviour::Random`]: uniformly random actions.
//! - [`Behaviour::PpoMixed`]: a PPO policy is trained non-privately on simulator users that are
//!   not data units (user ids from [`TRAINING_USER_BASE`] on), with the project's one PPO
//!   ([`local_updates`], averaged over a cohort as in FedAvg, without clipping or noise).
//!   `checkpoints` parameter vectors are snapshotted evenly over the `iterations`, the first
//!   being the initial (untrained) policy and the last the final one; unit `u` then plays its
//!   episodes greedily with checkpoint `u % checkpoints`, taking a uniformly random action with
//!   probability `epsilon` at every step. Quality therefore ranges from near-random to good.
//!
//! Determinism: the policy's initial weights and training users come from `spec.seed`; episode
//! `k` of unit `u` draws its reset seed and its exploration from `(spec.seed, u, k)` alone, so
//! two calls give the same dataset bit for bit, whatever the thread count.

use candle_core::Device;
use fedrl_common::offline::{Behaviour, DatasetSpec};
use fedrl_sim::{Action, Env, Population, Space};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use super::dataset::{Dataset, Episode};
use crate::local_update::LocalUpdateExt;
use crate::mlp::{ModelSpec, ParamLayout};
use crate::{LocalUpdateConfig, NnError, Result, local_updates};

/// Population user ids of the behaviour policy's training users: far above any data unit id, so
/// the policy never trains on a unit's environment.
pub const TRAINING_USER_BASE: u64 = 1 << 48;

/// Training users per PPO iteration (each plays one episode and computes a local update; the
/// updates are averaged).
pub const PPO_COHORT: usize = 16;

/// The most episodes one generated dataset may hold (it lives in memory).
pub const MAX_EPISODES: u64 = 100_000_000;

/// What [`generate`] reports while it runs.
#[derive(Clone, Debug, PartialEq)]
pub enum Progress {
    /// PPO iteration `done` of `total` finished; `train_return` is the cohort's mean episode
    /// return (reward units) under the policy before the iteration.
    Training {
        done: u64,
        total: u64,
        train_return: f64,
    },
    /// Units whose episodes are recorded so far.
    Recording { done: u64, total: u64 },
    /// The behaviour quality, once the data is recorded: the mean return of the episodes played
    /// with checkpoint `index` (taken after `iteration` PPO iterations), epsilon-greedy noise
    /// included.
    Checkpoint {
        index: u32,
        iteration: u64,
        mean_return: f64,
        episodes: u64,
    },
}

/// The PPO settings of the behaviour policy: the workspace defaults (CleanRL-like, 2 x 32 tanh
/// MLP) with 4 local epochs over one episode per user and no DP clip (this training uses no
/// one's data).
pub fn behaviour_ppo_config() -> LocalUpdateConfig {
    LocalUpdateConfig {
        clip_norm: f64::INFINITY,
        threads: 2,
        ..LocalUpdateConfig::default()
    }
}

/// A 64-bit mix of several words (SplitMix64 finaliser chained): independent streams per
/// (seed, unit, episode).
pub(crate) fn mix(words: &[u64]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for &w in words {
        let mut z = h ^ w.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h = z ^ (z >> 31);
    }
    h
}

/// The greedy action of a discrete policy (plain f32 forward of the policy MLP, tanh hidden
/// layers, ties to the lowest index).
struct GreedyPolicy<'a> {
    spec: &'a ModelSpec,
    layout: &'a ParamLayout,
    params: &'a [f32],
}

impl GreedyPolicy<'_> {
    fn act(&self, obs: &[f32], buf: &mut Vec<f32>, next: &mut Vec<f32>) -> usize {
        buf.clear();
        buf.extend_from_slice(obs);
        self.spec.normalize_obs(buf);
        let n_layers = self.layout.policy_layers.len();
        for (l, &wi) in self.layout.policy_layers.iter().enumerate() {
            let w = &self.layout.params[wi];
            let b = &self.layout.params[wi + 1];
            let (out, inp) = (w.shape[0], w.shape[1]);
            let wv = &self.params[w.offset..w.offset + out * inp];
            let bv = &self.params[b.offset..b.offset + out];
            next.clear();
            for o in 0..out {
                let row = &wv[o * inp..(o + 1) * inp];
                let z = bv[o] + row.iter().zip(buf.iter()).map(|(a, x)| a * x).sum::<f32>();
                next.push(if l + 1 < n_layers { z.tanh() } else { z });
            }
            std::mem::swap(buf, next);
        }
        let mut best = 0;
        for (i, &v) in buf.iter().enumerate() {
            if v > buf[best] {
                best = i;
            }
        }
        best
    }
}

/// Who acts in one episode.
enum Actor<'a> {
    Random,
    Greedy {
        policy: GreedyPolicy<'a>,
        epsilon: f64,
    },
}

/// Plays one episode of `env` (to its own termination or truncation).
fn play(
    env: &mut dyn Env,
    actor: &Actor<'_>,
    n_actions: usize,
    reset_seed: u64,
    rng: &mut Xoshiro256PlusPlus,
    id: u64,
    unit: u64,
) -> Result<Episode> {
    let d = env.observation_space().dim();
    let mut obs = vec![0.0f32; d];
    env.reset(reset_seed, &mut obs);
    let mut e = Episode {
        id,
        unit,
        observations: obs.clone(),
        actions: Vec::new(),
        rewards: Vec::new(),
        terminations: Vec::new(),
        truncations: Vec::new(),
    };
    let (mut buf, mut next) = (Vec::new(), Vec::new());
    loop {
        let a = match actor {
            Actor::Random => rng.random_range(0..n_actions),
            Actor::Greedy { policy, epsilon } => {
                // Both draws happen every step so the stream does not depend on the policy.
                let explore = rng.random::<f64>() < *epsilon;
                let random = rng.random_range(0..n_actions);
                if explore {
                    random
                } else {
                    policy.act(&obs, &mut buf, &mut next)
                }
            }
        };
        let step = env.step(Action::Discrete(a), &mut obs)?;
        e.actions.push(a as u32);
        e.rewards.push(step.reward as f32);
        e.terminations.push(step.terminated);
        // A step that ends the episode for good is not also a truncation (Gymnasium's time
        // limit can flag both on the same step; d3rlpy's MDPDataset refuses such an episode).
        e.truncations.push(step.truncated && !step.terminated);
        e.observations.extend_from_slice(&obs);
        if step.terminated || step.truncated {
            return Ok(e);
        }
    }
}

/// Makes the environments of the given users, in order.
type MakeEnvs<'a> = dyn FnMut(&[u64]) -> Result<Vec<Box<dyn Env>>> + 'a;

/// Trains the behaviour policy and returns the checkpoints with the iteration each was taken
/// at.
fn train_checkpoints(
    spec: &DatasetSpec,
    make_envs: &mut MakeEnvs<'_>,
    model: &ModelSpec,
    iterations: u64,
    checkpoints: u32,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<(u64, Vec<f32>)>> {
    let cfg = behaviour_ppo_config();
    let device = Device::Cpu;
    let layout = model.layout();
    let mut global = model.init(mix(&[spec.seed, 0x5050]));
    // Checkpoint k is taken after round(k * iterations / (checkpoints - 1)) iterations.
    let at: Vec<u64> = (0..u64::from(checkpoints))
        .map(|k| {
            if checkpoints == 1 {
                iterations
            } else {
                (k * iterations + (u64::from(checkpoints) - 1) / 2) / (u64::from(checkpoints) - 1)
            }
        })
        .collect();
    let mut out = Vec::with_capacity(at.len());
    let take = |it: u64, global: &[f32], out: &mut Vec<(u64, Vec<f32>)>| {
        for &a in &at {
            if a == it {
                out.push((it, global.to_vec()));
            }
        }
    };
    take(0, &global, &mut out);
    for it in 0..iterations {
        let users: Vec<u64> = (0..PPO_COHORT as u64)
            .map(|i| TRAINING_USER_BASE + it * PPO_COHORT as u64 + i)
            .collect();
        let mut envs = make_envs(&users)?;
        let seeds: Vec<u64> = users.iter().map(|&u| mix(&[spec.seed, u])).collect();
        let ups = local_updates(model, &global, &mut envs, &seeds, &cfg, &device)?;
        let mut mean = vec![0.0f64; layout.len()];
        for u in &ups {
            for (m, d) in mean.iter_mut().zip(&u.delta) {
                *m += f64::from(*d);
            }
        }
        for (g, m) in global.iter_mut().zip(&mean) {
            *g += (*m / ups.len() as f64) as f32;
        }
        let rets: Vec<f64> = ups.iter().flat_map(|u| u.episode_returns.clone()).collect();
        progress(Progress::Training {
            done: it + 1,
            total: iterations,
            train_return: rets.iter().sum::<f64>() / rets.len().max(1) as f64,
        });
        take(it + 1, &global, &mut out);
    }
    Ok(out)
}

/// Reports each checkpoint's mean return over the episodes it played (unit `u` plays with
/// checkpoint `u % checkpoints.len()`).
fn report_checkpoints<P>(
    checkpoints: &[(u64, P)],
    episodes: &[Episode],
    progress: &mut dyn FnMut(Progress),
) {
    for (k, (iteration, _)) in checkpoints.iter().enumerate() {
        let eps: Vec<f64> = episodes
            .iter()
            .filter(|e| e.unit % checkpoints.len() as u64 == k as u64)
            .map(Episode::total_return)
            .collect();
        progress(Progress::Checkpoint {
            index: k as u32,
            iteration: *iteration,
            mean_return: eps.iter().sum::<f64>() / eps.len().max(1) as f64,
            episodes: eps.len() as u64,
        });
    }
}

/// Generates the dataset `spec` describes (see the module documentation). The dataset's id is
/// [`DatasetSpec::minari_id`]; its `env_id` the population's environment.
///
/// For [`Behaviour::Experts`] this trains the experts and returns their demonstrations only;
/// [`super::experts::generate_experts`] keeps the experts too.
pub fn generate(spec: &DatasetSpec, progress: &mut dyn FnMut(Progress)) -> Result<Dataset> {
    if let Behaviour::Experts { .. } = spec.behaviour {
        return Ok(super::experts::generate_experts(spec, progress)?.dataset);
    }
    if let Some((id, g)) = super::gym::gymnasium_of(spec)? {
        return generate_gym(spec, id, g, progress);
    }
    let pop = Population::new(&spec.env, spec.population_seed)?;
    let probe = pop.user_env(0)?;
    let obs_dim = match probe.observation_space() {
        Space::Box { low, .. } => low.len(),
        Space::Discrete { .. } => {
            return Err(NnError::Invalid(format!(
                "{}: offline datasets need a Box observation space",
                spec.env
            )));
        }
    };
    let n_actions = match probe.action_space() {
        Space::Discrete { n } => *n,
        Space::Box { .. } => {
            return Err(NnError::Invalid(format!(
                "{}: offline datasets (discrete CQL) need a Discrete action space",
                spec.env
            )));
        }
    };
    if spec.units == 0 || spec.episodes_per_unit == 0 {
        return Err(NnError::Invalid(
            "a dataset needs at least one unit and one episode per unit".into(),
        ));
    }
    // A dataset is held in memory: refuse sizes that cannot be (and would overflow the ids).
    match spec.units.checked_mul(spec.episodes_per_unit) {
        Some(n) if n <= MAX_EPISODES => {}
        _ => {
            return Err(NnError::Invalid(format!(
                "{} units x {} episodes is more than the {MAX_EPISODES} episodes a dataset may hold",
                spec.units, spec.episodes_per_unit
            )));
        }
    }
    let model =
        behaviour_ppo_config().model_spec(probe.observation_space(), probe.action_space())?;
    let layout = model.layout();
    let checkpoints = match spec.behaviour {
        Behaviour::Random | Behaviour::Experts { .. } => Vec::new(),
        Behaviour::PpoMixed {
            iterations,
            checkpoints,
            epsilon,
        } => {
            if checkpoints == 0 || !(0.0..=1.0).contains(&epsilon) {
                return Err(NnError::Invalid(format!(
                    "ppo_mixed needs checkpoints >= 1 and epsilon in [0, 1], got {checkpoints} \
                     and {epsilon}"
                )));
            }
            let mut make = |users: &[u64]| -> Result<Vec<Box<dyn Env>>> {
                users
                    .iter()
                    .map(|&u| pop.user_env(u).map_err(NnError::from))
                    .collect()
            };
            train_checkpoints(spec, &mut make, &model, iterations, checkpoints, progress)?
        }
    };
    let epsilon = match spec.behaviour {
        Behaviour::PpoMixed { epsilon, .. } => epsilon,
        Behaviour::Random | Behaviour::Experts { .. } => 1.0,
    };
    let epu = spec.episodes_per_unit;
    let threads = 2usize;
    let units: Vec<u64> = (0..spec.units).collect();
    let chunk = units.len().div_ceil(threads).max(1);
    let done = std::sync::atomic::AtomicU64::new(0);
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let results: Vec<Result<Vec<Episode>>> = std::thread::scope(|s| {
        let handles: Vec<_> = units
            .chunks(chunk)
            .map(|us| {
                let (pop, checkpoints, layout, model, done, tx) =
                    (&pop, &checkpoints, &layout, &model, &done, tx.clone());
                s.spawn(move || -> Result<Vec<Episode>> {
                    let mut out = Vec::with_capacity(us.len() * epu as usize);
                    for &u in us {
                        let mut env = pop.user_env(u)?;
                        let actor = if checkpoints.is_empty() {
                            Actor::Random
                        } else {
                            let (_, params) = &checkpoints[(u % checkpoints.len() as u64) as usize];
                            Actor::Greedy {
                                policy: GreedyPolicy {
                                    spec: model,
                                    layout,
                                    params,
                                },
                                epsilon,
                            }
                        };
                        for k in 0..epu {
                            let key = mix(&[spec.seed, u, k]);
                            let mut rng = Xoshiro256PlusPlus::seed_from_u64(key);
                            let reset_seed = mix(&[key, 0x0072_6573_6574]);
                            out.push(play(
                                env.as_mut(),
                                &actor,
                                n_actions,
                                reset_seed,
                                &mut rng,
                                u * epu + k,
                                u,
                            )?);
                        }
                        let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                        // The receiver lives until the scope ends; a send cannot fail before.
                        let _ = tx.send(n);
                    }
                    Ok(out)
                })
            })
            .collect();
        drop(tx);
        for n in rx {
            if n % 64 == 0 || n == spec.units {
                progress(Progress::Recording {
                    done: n,
                    total: spec.units,
                });
            }
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(NnError::Invalid("recording thread panicked".into())))
            })
            .collect()
    });
    let mut episodes = Vec::with_capacity((spec.units * epu) as usize);
    for r in results {
        episodes.extend(r?);
    }
    report_checkpoints(&checkpoints, &episodes, progress);
    Ok(Dataset {
        id: spec.minari_id(),
        env_id: pop.env_id().to_string(),
        obs_dim,
        n_actions,
        episodes,
    })
}

/// Units recorded together through the bridge: their environments are made in one MAKE per
/// worker and their episodes stepped in lockstep.
const GYM_UNIT_CHUNK: usize = 256;

/// [`generate`] for a `gymnasium:<id>` spec (random and `ppo_mixed` behaviours): the same
/// procedure, units and streams, with the environments in the bridge's workers and the
/// episodes of [`GYM_UNIT_CHUNK`] units played in lockstep ([`super::gym::play_lockstep`]).
fn generate_gym(
    spec: &DatasetSpec,
    env_id: &str,
    g: &fedrl_common::offline::DatasetGymnasium,
    progress: &mut dyn FnMut(Progress),
) -> Result<Dataset> {
    use super::gym::{Lane, gym_config, play_parallel, start_pool, user_envs};
    if spec.units == 0 || spec.episodes_per_unit == 0 {
        return Err(NnError::Invalid(
            "a dataset needs at least one unit and one episode per unit".into(),
        ));
    }
    match spec.units.checked_mul(spec.episodes_per_unit) {
        Some(n) if n <= MAX_EPISODES => {}
        _ => {
            return Err(NnError::Invalid(format!(
                "{} units x {} episodes is more than the {MAX_EPISODES} episodes a dataset may hold",
                spec.units, spec.episodes_per_unit
            )));
        }
    }
    let mut pool = start_pool(gym_config(env_id, g, spec.population_seed), g)?;
    let (obs_space, act_space) = (
        pool.observation_space().clone(),
        pool.action_space().clone(),
    );
    let obs_dim = obs_space.dim();
    let n_actions = match act_space {
        Space::Discrete { n } => n,
        Space::Box { .. } => {
            return Err(NnError::Invalid(format!(
                "{}: offline datasets (discrete CQL) need a Discrete action space",
                spec.env
            )));
        }
    };
    let model = behaviour_ppo_config().model_spec(&obs_space, &act_space)?;
    let layout = model.layout();
    let (checkpoints, epsilon) = match spec.behaviour {
        Behaviour::Random | Behaviour::Experts { .. } => (Vec::new(), 1.0),
        Behaviour::PpoMixed {
            iterations,
            checkpoints,
            epsilon,
        } => {
            if checkpoints == 0 || !(0.0..=1.0).contains(&epsilon) {
                return Err(NnError::Invalid(format!(
                    "ppo_mixed needs checkpoints >= 1 and epsilon in [0, 1], got {checkpoints} \
                     and {epsilon}"
                )));
            }
            let mut make = |users: &[u64]| user_envs(&mut pool, users);
            let c = train_checkpoints(spec, &mut make, &model, iterations, checkpoints, progress)?;
            (c, epsilon)
        }
    };
    let epu = spec.episodes_per_unit;
    let mut episodes = Vec::with_capacity((spec.units * epu) as usize);
    let shares = pool.workers();
    let mut first = 0u64;
    while first < spec.units {
        let last = (first + GYM_UNIT_CHUNK as u64).min(spec.units);
        let units: Vec<u64> = (first..last).collect();
        let mut envs = user_envs(&mut pool, &units)?;
        let mut per_unit: Vec<Vec<Episode>> = vec![Vec::with_capacity(epu as usize); units.len()];
        for k in 0..epu {
            let mut lanes: Vec<Lane> = units
                .iter()
                .map(|&u| {
                    let key = mix(&[spec.seed, u, k]);
                    Lane {
                        id: u * epu + k,
                        unit: u,
                        reset_seed: mix(&[key, 0x0072_6573_6574]),
                        rng: Xoshiro256PlusPlus::seed_from_u64(key),
                    }
                })
                .collect();
            let act = |i: usize, obs: &[f32], rng: &mut Xoshiro256PlusPlus| -> usize {
                if checkpoints.is_empty() {
                    return rng.random_range(0..n_actions);
                }
                // As `play`: both draws every step, so the stream does not depend on the policy.
                let explore = rng.random::<f64>() < epsilon;
                let random = rng.random_range(0..n_actions);
                if explore {
                    return random;
                }
                let (_, params) = &checkpoints[(units[i] % checkpoints.len() as u64) as usize];
                let (mut buf, mut next) = (Vec::new(), Vec::new());
                GreedyPolicy {
                    spec: &model,
                    layout: &layout,
                    params,
                }
                .act(obs, &mut buf, &mut next)
            };
            let eps = play_parallel(&mut envs, &mut lanes, obs_dim, 0, shares, &act)?;
            for (i, e) in eps.into_iter().enumerate() {
                per_unit[i].push(e);
            }
        }
        episodes.extend(per_unit.into_iter().flatten());
        progress(Progress::Recording {
            done: last,
            total: spec.units,
        });
        first = last;
    }
    report_checkpoints(&checkpoints, &episodes, progress);
    Ok(Dataset {
        id: spec.minari_id(),
        env_id: spec.env.clone(),
        obs_dim,
        n_actions,
        episodes,
    })
}
