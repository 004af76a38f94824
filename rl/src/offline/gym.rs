//! Offline datasets recorded in Gymnasium environments (`env = "gymnasium:<id>"`): the bridge's
//! Python workers ([`GymPool`]) made from a spec's `[task.dataset.gymnasium]` table (discrete:
//! [`DatasetGymnasium`]; continuous: `fedrl_common::task::primorl::ContinuousGymnasium`, both
//! through [`BridgeFields`]), a lockstep player that steps many episodes at once so that every
//! step of a batch is one message per worker, and [`reset_shares`] / [`step_shares`], which do
//! one batched reset or step with one thread per worker share (the continuous recorder's and
//! PriMORL's deferred evaluations).
//!
//! Invariants:
//! - The data does not depend on how the episodes are batched or on the number of workers:
//!   every episode is reset with its own seed and draws its actions from its own random stream,
//!   exactly as the one-at-a-time players of [`super::generate`] and [`super::experts`] do, so a
//!   `gymnasium:<id>` dataset equals the one fedrl's own environment gives where the two
//!   environments agree (CartPole-v1: checked by a test).
//! - Generation never drops a unit: a worker fault fails the generation with its reason (a
//!   dataset with missing units would be another dataset under the same key).
//! - A missing interpreter is refused before anything starts, naming the install script.

use fedrl_common::offline::{BridgeFields, DatasetGymnasium, DatasetSpec, GYMNASIUM_PREFIX};
use fedrl_common::task::dppg::KwargDraw;
use fedrl_sim::gym_bridge::{DeclaredAction, DeclaredSpaces, Draw, GymConfig, GymPool};
use fedrl_sim::{Action, Env};
use rand::rngs::Xoshiro256PlusPlus;
use serde_json::{Map, Value};

use super::dataset::Episode;
use crate::{NnError, Result};

fn invalid(m: String) -> NnError {
    NnError::Invalid(m)
}

/// The Gymnasium id and table of a `gymnasium:<id>` spec, `None` for fedrl's own
/// environments; an error when the two disagree ([`DatasetSpec::check_gymnasium`]).
pub fn gymnasium_of(spec: &DatasetSpec) -> Result<Option<(&str, &DatasetGymnasium)>> {
    spec.check_gymnasium().map_err(invalid)?;
    Ok(
        match (spec.env.strip_prefix(GYMNASIUM_PREFIX), &spec.gymnasium) {
            (Some(id), Some(g)) => Some((id, &**g)),
            _ => None,
        },
    )
}

/// The bridge configuration of a dataset's environments: `population_seed` keys the users'
/// drawn kwargs, as for a `gymnasium:<id>` DPPG population.
pub fn gym_config(env_id: &str, g: &DatasetGymnasium, population_seed: u64) -> GymConfig {
    bridge_config(env_id, g.bridge(), population_seed)
}

/// [`gym_config`] of any `[task.dataset.gymnasium]` table's worker settings (discrete or
/// continuous datasets).
pub fn bridge_config(env_id: &str, g: BridgeFields<'_>, population_seed: u64) -> GymConfig {
    let mut cfg = GymConfig::new(env_id);
    cfg.module = g.module.map(str::to_string);
    cfg.python = g.python.map(std::path::PathBuf::from);
    cfg.kwargs = g.kwargs.clone();
    cfg.user_kwargs = g
        .user_kwargs
        .iter()
        .map(|(k, d)| {
            let draw = match d {
                KwargDraw::Uniform([low, high]) => Draw::Uniform {
                    low: *low,
                    high: *high,
                },
                KwargDraw::Linspace(low, high, n) => Draw::Linspace {
                    low: *low,
                    high: *high,
                    n: *n,
                },
                KwargDraw::Choice(v) => Draw::Choice(v.clone()),
            };
            (k.clone(), draw)
        })
        .collect();
    cfg.seed = population_seed;
    cfg.workers = g.workers;
    cfg.step_timeout = std::time::Duration::from_secs_f64(g.step_timeout_s);
    cfg.start_timeout = std::time::Duration::from_secs_f64(g.start_timeout_s);
    cfg
}

/// Starts the workers of `cfg`, their spaces checked against the table's declaration. A missing
/// interpreter is refused first with the command that installs one.
pub fn start_pool(cfg: GymConfig, g: &DatasetGymnasium) -> Result<GymPool> {
    let declared = DeclaredSpaces {
        obs_dim: g.obs_dim,
        action: DeclaredAction::Discrete { n: g.actions },
    };
    start_declared(cfg, declared)
}

/// [`start_pool`] with the declared spaces given: a Discrete action of `n` values or a Box of
/// `dim` values (continuous datasets).
pub fn start_declared(cfg: GymConfig, declared: DeclaredSpaces) -> Result<GymPool> {
    let python = cfg.python_path();
    if !python.exists() {
        return Err(invalid(format!(
            "gymnasium:{}: the Python interpreter {} does not exist; install the Gymnasium \
             bridge with scripts/install-python-bridge.sh (--extra for Box2D environments such as \
             LunarLander, and MuJoCo), or name one with task.dataset.gymnasium.python or \
             FEDRL_PYTHON",
            cfg.env_id,
            python.display()
        )));
    }
    let id = cfg.env_id.clone();
    GymPool::start(cfg, Some(declared)).map_err(|e| invalid(format!("gymnasium:{id}: {e}")))
}

/// The environments of `users`, user `users[i]` made with `kwargs[i]`, in `users` order; any
/// user the pool cannot serve fails the whole call (with the worker's reason).
pub fn make_envs(
    pool: &mut GymPool,
    users: &[u64],
    kwargs: &[Map<String, Value>],
) -> Result<Vec<Box<dyn Env>>> {
    let (groups, dropped) = pool.envs_with_kwargs(users, kwargs);
    if let Some((u, why)) = dropped.first() {
        return Err(invalid(format!(
            "gymnasium environment of unit {u} could not be made: {why}"
        )));
    }
    // The groups are the workers' contiguous shares, in worker order: flattening keeps `users`
    // order.
    let envs: Vec<Box<dyn Env>> = groups.into_iter().flat_map(|g| g.envs).collect();
    if envs.len() != users.len() {
        return Err(invalid(format!(
            "{} gymnasium environments made for {} units",
            envs.len(),
            users.len()
        )));
    }
    Ok(envs)
}

/// The users' own environments (the population's drawn kwargs), in `users` order.
pub fn user_envs(pool: &mut GymPool, users: &[u64]) -> Result<Vec<Box<dyn Env>>> {
    let kwargs: Vec<Map<String, Value>> = users
        .iter()
        .map(|&u| pool.config().user_kwargs(u))
        .collect();
    make_envs(pool, users, &kwargs)
}

/// One episode to play in [`play_lockstep`]: its ids, the reset seed and its own random stream.
pub struct Lane {
    pub id: u64,
    pub unit: u64,
    pub reset_seed: u64,
    pub rng: Xoshiro256PlusPlus,
}

/// Plays one episode per lane, lane `i` in `envs[i]`, all in lockstep: each step queues every
/// running episode's action (`act(offset + i, obs, rng)`) before collecting any result, so
/// batching environments step a worker's episodes in one message. An episode ends when it
/// terminates, is truncated, or (with `max_steps > 0`) reaches `max_steps` steps, which
/// truncates it; a step that terminates is never also a truncation. The episodes come back in
/// lane order.
pub fn play_lockstep(
    envs: &mut [Box<dyn Env>],
    lanes: &mut [Lane],
    obs_dim: usize,
    max_steps: u64,
    offset: usize,
    act: &(dyn Fn(usize, &[f32], &mut Xoshiro256PlusPlus) -> usize + Sync),
) -> Result<Vec<Episode>> {
    let n = lanes.len();
    if envs.len() < n {
        return Err(invalid(format!(
            "{} environments for {n} episodes",
            envs.len()
        )));
    }
    let d = obs_dim;
    let mut obs = vec![0.0f32; n * d];
    let mut done = Vec::with_capacity(n);
    for (i, lane) in lanes.iter().enumerate() {
        done.push(envs[i].reset_queue(lane.reset_seed, &mut obs[i * d..(i + 1) * d]));
    }
    for (i, now) in done.into_iter().enumerate() {
        if !now {
            envs[i].reset_collect(&mut obs[i * d..(i + 1) * d])?;
        }
    }
    let mut eps: Vec<Episode> = lanes
        .iter()
        .enumerate()
        .map(|(i, l)| Episode {
            id: l.id,
            unit: l.unit,
            observations: obs[i * d..(i + 1) * d].to_vec(),
            actions: Vec::new(),
            rewards: Vec::new(),
            terminations: Vec::new(),
            truncations: Vec::new(),
        })
        .collect();
    let mut active: Vec<usize> = (0..n).collect();
    let mut queued = Vec::with_capacity(n);
    while !active.is_empty() {
        queued.clear();
        for &i in &active {
            let a = act(offset + i, &obs[i * d..(i + 1) * d], &mut lanes[i].rng);
            eps[i].actions.push(a as u32);
            queued.push(envs[i].step_queue(Action::Discrete(a), &mut obs[i * d..(i + 1) * d])?);
        }
        let mut still = Vec::with_capacity(active.len());
        for (k, &i) in active.iter().enumerate() {
            let o = &mut obs[i * d..(i + 1) * d];
            let step = match queued[k] {
                Some(s) => s,
                None => envs[i].step_collect(o)?,
            };
            let e = &mut eps[i];
            e.rewards.push(step.reward as f32);
            e.terminations.push(step.terminated);
            e.observations.extend_from_slice(o);
            let capped = max_steps > 0 && e.actions.len() as u64 >= max_steps;
            let truncated = !step.terminated && (step.truncated || capped);
            e.truncations.push(truncated);
            if !(step.terminated || truncated) {
                still.push(i);
            }
        }
        active = still;
    }
    Ok(eps)
}

/// [`play_lockstep`] over `shares` contiguous parts of the lanes at once, one thread each: with
/// the environments of [`make_envs`] and `shares` the pool's worker count, each thread drives
/// one worker, so the workers step concurrently (one thread waiting on every worker in turn
/// would leave all but one idle). The episodes come back in lane order, the same whatever
/// `shares` is.
pub fn play_parallel(
    envs: &mut [Box<dyn Env>],
    lanes: &mut [Lane],
    obs_dim: usize,
    max_steps: u64,
    shares: usize,
    act: &(dyn Fn(usize, &[f32], &mut Xoshiro256PlusPlus) -> usize + Sync),
) -> Result<Vec<Episode>> {
    let n = lanes.len();
    if envs.len() < n {
        return Err(invalid(format!(
            "{} environments for {n} episodes",
            envs.len()
        )));
    }
    let shares = shares.clamp(1, n.max(1));
    // The pool's split of a MAKE's users over its workers (`GymPool::envs_for`).
    let bounds: Vec<usize> = (0..=shares).map(|w| n * w / shares).collect();
    let mut env_parts = Vec::with_capacity(shares);
    let mut lane_parts = Vec::with_capacity(shares);
    let (mut env_rest, mut lane_rest) = (&mut envs[..n], lanes);
    for w in 0..shares {
        let len = bounds[w + 1] - bounds[w];
        let (e, er) = env_rest.split_at_mut(len);
        let (l, lr) = lane_rest.split_at_mut(len);
        env_parts.push(e);
        lane_parts.push(l);
        env_rest = er;
        lane_rest = lr;
    }
    let parts: Vec<Result<Vec<Episode>>> = std::thread::scope(|s| {
        let handles: Vec<_> = env_parts
            .into_iter()
            .zip(lane_parts)
            .enumerate()
            .map(|(w, (e, l))| {
                let offset = bounds[w];
                s.spawn(move || play_lockstep(e, l, obs_dim, max_steps, offset, act))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(invalid("an episode thread panicked".into())))
            })
            .collect()
    });
    let mut out = Vec::with_capacity(n);
    for p in parts {
        out.extend(p?);
    }
    Ok(out)
}

/// The environments `0..n` split into `shares` contiguous parts, as the pool splits a MAKE's
/// users over its workers (`GymPool::envs_for`): part `w` is `n w / shares .. n (w + 1) /
/// shares`.
fn share_bounds(n: usize, shares: usize) -> Vec<usize> {
    let shares = shares.clamp(1, n.max(1));
    (0..=shares).map(|w| n * w / shares).collect()
}

/// What [`in_shares`] runs on each part: `(environments, index of the first, their observation
/// rows)`.
type ShareFn<'a, T> = dyn Fn(&mut [Box<dyn Env>], usize, &mut [f32]) -> Result<T> + Sync + 'a;

/// Runs `f(part, first index, obs rows)` on each part of `envs` (and the matching rows of
/// `obs`, `d` values per environment) in its own thread, the results in part order; one part
/// runs in this thread.
fn in_shares<T: Send>(
    envs: &mut [Box<dyn Env>],
    obs: &mut [f32],
    d: usize,
    shares: usize,
    f: &ShareFn<'_, T>,
) -> Result<Vec<T>> {
    let n = envs.len();
    if obs.len() < n * d {
        return Err(invalid(format!(
            "{} observation values for {n} environments of {d}",
            obs.len()
        )));
    }
    let bounds = share_bounds(n, shares);
    if bounds.len() <= 2 {
        return Ok(vec![f(envs, 0, &mut obs[..n * d])?]);
    }
    let (mut env_rest, mut obs_rest) = (envs, &mut obs[..n * d]);
    let mut parts = Vec::with_capacity(bounds.len() - 1);
    for w in 0..bounds.len() - 1 {
        let len = bounds[w + 1] - bounds[w];
        let (e, er) = env_rest.split_at_mut(len);
        let (o, or) = obs_rest.split_at_mut(len * d);
        parts.push((bounds[w], e, o));
        env_rest = er;
        obs_rest = or;
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .into_iter()
            .map(|(first, e, o)| s.spawn(move || f(e, first, o)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(invalid("an environment thread panicked".into())))
            })
            .collect()
    })
}

/// Resets `envs[i]` with `seeds[i]`, writing its first observation into `obs[i d..(i + 1) d]`:
/// every reset queued before any is collected, the environments in `shares` contiguous parts
/// ([`GymPool`]'s split of a MAKE over its workers) reset by one thread each, so each worker
/// gets one RESET message and the workers answer concurrently. Rust environments reset at once
/// (the trait's default queue); with `shares` 1 nothing leaves this thread.
pub fn reset_shares(
    envs: &mut [Box<dyn Env>],
    seeds: &[u64],
    obs: &mut [f32],
    d: usize,
    shares: usize,
) -> Result<()> {
    if seeds.len() != envs.len() {
        return Err(invalid(format!(
            "{} reset seeds for {} environments",
            seeds.len(),
            envs.len()
        )));
    }
    in_shares(envs, obs, d, shares, &|part, first, o| {
        let mut now = Vec::with_capacity(part.len());
        for (k, env) in part.iter_mut().enumerate() {
            now.push(env.reset_queue(seeds[first + k], &mut o[k * d..(k + 1) * d]));
        }
        for (k, env) in part.iter_mut().enumerate() {
            if !now[k] {
                env.reset_collect(&mut o[k * d..(k + 1) * d])?;
            }
        }
        Ok(())
    })?;
    Ok(())
}

/// Steps `envs[i]` for each `i` of `live` (ascending) with the Box action
/// `actions[j act_dim..(j + 1) act_dim]` (`j` its position in `live`), writing its next
/// observation into `obs[i d..(i + 1) d]`; the steps come back in `live` order. As
/// [`reset_shares`]: every action queued before any result is collected, one thread per
/// contiguous part, so a pool's workers each step their share in one message, concurrently.
pub fn step_shares(
    envs: &mut [Box<dyn Env>],
    live: &[usize],
    actions: &[f32],
    act_dim: usize,
    obs: &mut [f32],
    d: usize,
    shares: usize,
) -> Result<Vec<fedrl_sim::Step>> {
    if actions.len() != live.len() * act_dim || live.windows(2).any(|w| w[0] >= w[1]) {
        return Err(invalid(format!(
            "{} action values for {} environments of {act_dim} (ascending)",
            actions.len(),
            live.len()
        )));
    }
    if live.last().is_some_and(|&i| i >= envs.len()) {
        return Err(invalid(format!(
            "an environment index beyond the {} environments",
            envs.len()
        )));
    }
    let parts = in_shares(envs, obs, d, shares, &|part, first, o| {
        // The live environments of this part, with their positions in `live`.
        let mine: Vec<(usize, usize)> = live
            .iter()
            .enumerate()
            .filter(|&(_, &i)| i >= first && i < first + part.len())
            .map(|(j, &i)| (j, i - first))
            .collect();
        let mut queued = Vec::with_capacity(mine.len());
        for &(j, k) in &mine {
            let a = &actions[j * act_dim..(j + 1) * act_dim];
            queued.push(part[k].step_queue(Action::Continuous(a), &mut o[k * d..(k + 1) * d])?);
        }
        let mut out = Vec::with_capacity(mine.len());
        for (q, &(_, k)) in queued.into_iter().zip(&mine) {
            out.push(match q {
                Some(s) => s,
                None => part[k].step_collect(&mut o[k * d..(k + 1) * d])?,
            });
        }
        Ok(out)
    })?;
    Ok(parts.into_iter().flatten().collect())
}

/// The greedy evaluation of a Q-network ([`super::train::evaluate_greedy_in`]) in the default
/// environment of a `gymnasium:<id>` dataset (`gymnasium.make(id, **kwargs)`), `episodes`
/// episodes played together in the bridge's workers. Several networks: [`GreedyGymEvaluator`],
/// which starts the workers once.
pub fn evaluate_greedy_gym(
    dataset: &DatasetSpec,
    q: &super::qnet::QNetSpec,
    params: &[f32],
    episodes: usize,
    seed: u64,
    max_steps: u64,
) -> Result<crate::EvalResult> {
    GreedyGymEvaluator::start(dataset)?.evaluate(q, params, episodes, seed, max_steps)
}

/// Greedy evaluations of Q-networks in the default environment of a `gymnasium:<id>` dataset,
/// the bridge's workers started once for all of them (they end when it is dropped). Each
/// evaluation makes its episodes' environments afresh, so it plays what
/// [`evaluate_greedy_gym`] plays, whatever was evaluated before.
pub struct GreedyGymEvaluator {
    pool: GymPool,
    env: String,
    kwargs: Map<String, Value>,
}

impl GreedyGymEvaluator {
    /// Starts the workers of `dataset`'s `[task.dataset.gymnasium]` table (spaces checked
    /// against its declaration; a missing interpreter refused first, naming the install
    /// script). Fails for a dataset that is not `gymnasium:<id>`.
    pub fn start(dataset: &DatasetSpec) -> Result<Self> {
        let Some((id, g)) = gymnasium_of(dataset)? else {
            return Err(invalid(format!(
                "{:?} is not a gymnasium:<id> dataset",
                dataset.env
            )));
        };
        let pool = start_pool(gym_config(id, g, dataset.population_seed), g)?;
        Ok(Self {
            pool,
            env: dataset.env.clone(),
            kwargs: g.kwargs.clone(),
        })
    }

    /// [`evaluate_greedy_gym`] of `params` with these workers: `episodes` episodes, episode `i`
    /// reset from `(seed, i)`, at most `max_steps` steps each (0: the environment's limit).
    pub fn evaluate(
        &mut self,
        q: &super::qnet::QNetSpec,
        params: &[f32],
        episodes: usize,
        seed: u64,
        max_steps: u64,
    ) -> Result<crate::EvalResult> {
        let users: Vec<u64> = (0..episodes as u64).collect();
        let kwargs = vec![self.kwargs.clone(); episodes];
        let mut envs = make_envs(&mut self.pool, &users, &kwargs)?;
        super::train::evaluate_greedy_in(q, params, &mut envs, &self.env, seed, max_steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    #[test]
    fn lockstep_play_equals_one_episode_at_a_time_on_rust_environments() {
        // Rust environments step at once (the trait's default queue), so the lockstep player
        // must give exactly what a plain loop gives, stream for stream.
        let n = 5;
        let mut envs: Vec<Box<dyn Env>> = (0..n)
            .map(|_| fedrl_sim::make("CartPole-v1").unwrap())
            .collect();
        let mut lanes: Vec<Lane> = (0..n as u64)
            .map(|i| Lane {
                id: i,
                unit: i / 2,
                reset_seed: 100 + i,
                rng: Xoshiro256PlusPlus::seed_from_u64(i),
            })
            .collect();
        let eps = play_parallel(&mut envs, &mut lanes, 4, 30, 2, &|_, _, rng| {
            rng.random_range(0..2)
        })
        .unwrap();
        for (i, e) in eps.iter().enumerate() {
            let mut env = fedrl_sim::make("CartPole-v1").unwrap();
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(i as u64);
            let mut o = vec![0.0f32; 4];
            env.reset(100 + i as u64, &mut o);
            let mut obs = o.clone();
            let mut actions = Vec::new();
            loop {
                let a = rng.random_range(0..2usize);
                let s = env.step(Action::Discrete(a), &mut o).unwrap();
                actions.push(a as u32);
                obs.extend_from_slice(&o);
                if s.terminated || s.truncated || actions.len() >= 30 {
                    assert_eq!(*e.truncations.last().unwrap(), !s.terminated);
                    break;
                }
            }
            assert_eq!(e.actions, actions);
            assert_eq!(e.observations, obs);
            assert_eq!(e.unit, i as u64 / 2);
        }
    }

    #[test]
    fn stepping_in_shares_equals_stepping_in_one_thread() {
        // Rust environments step at once; split over threads they must give what one loop
        // gives, every step back in `live` order, and a wrong action length is refused.
        let n = 7;
        let run = |shares: usize| {
            let mut envs: Vec<Box<dyn Env>> = (0..n)
                .map(|_| fedrl_sim::make("Pendulum-v1").unwrap())
                .collect();
            let seeds: Vec<u64> = (0..n as u64).map(|i| 40 + i).collect();
            let mut obs = vec![0.0f32; n * 3];
            reset_shares(&mut envs, &seeds, &mut obs, 3, shares).unwrap();
            let mut rewards = Vec::new();
            for t in 0..5 {
                // Every other environment sits out odd steps.
                let live: Vec<usize> = (0..n).filter(|i| t % 2 == 0 || i % 2 == 0).collect();
                let actions: Vec<f32> = live.iter().map(|&i| (i as f32 - 3.0) / 2.0).collect();
                let steps =
                    step_shares(&mut envs, &live, &actions, 1, &mut obs, 3, shares).unwrap();
                assert_eq!(steps.len(), live.len());
                rewards.extend(steps.iter().map(|s| s.reward));
            }
            (obs, rewards)
        };
        let one = run(1);
        assert_eq!(run(3), one);
        assert_eq!(run(n + 4), one);
        let mut envs: Vec<Box<dyn Env>> = vec![fedrl_sim::make("Pendulum-v1").unwrap()];
        let mut obs = vec![0.0f32; 3];
        assert!(step_shares(&mut envs, &[0], &[0.0, 1.0], 1, &mut obs, 3, 1).is_err());
        assert!(step_shares(&mut envs, &[1], &[0.0], 1, &mut obs, 3, 1).is_err());
    }
}
