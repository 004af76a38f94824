//! PrivORL-n on continuous control (`[task.continuous]`): Box-action sensitive and public
//! datasets of the project's continuous format (`fedrl_rl::offline::continuous`), actions coded
//! as their values (`ActionCoding::Continuous`), the release written in that format, and
//! TD3+BC (`fedrl_rl::offline::td3bc`) as the downstream learner.
//!
//! The rest of the kind moves transitions as [`TransitionBatch`]es (the units a client agent
//! hosts, the central mode's uploads, the held-out data, the sampled release), whose actions
//! are discrete indices. A continuous transition travels in one **packed**: `obs = s ++ a`
//! (`obs_dim + act_dim` values), `next_obs = s' ++ 0` (zero-padded to the same width), action
//! index 0 of 1, the reward and the terminal flag as they are. [`pack`] and [`unpack`] are the
//! only places that know it; the central data plane then checks uploads as it checks any other
//! (width, finiteness, the action index, the terminal flag) and needs no second row format.
//!
//! Invariants: `unpack(pack(t)) == t` for any continuous transitions; unpacking reads the
//! padding of `next_obs` never, so a client's padding cannot reach the model; the environment,
//! its action box and both datasets' shapes come from public specs only.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use fedrl_common::task::TaskError;
use fedrl_common::task::privorl::{PrivorlContinuous, PrivorlTask};
use fedrl_rl::candle_core::Device;
use fedrl_rl::diffusion::{Actions, PublicRows, TransitionLayout, Transitions};
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::continuous::{
    BEHAVIOUR_USER, ContinuousDataset, ContinuousEpisode, ContinuousMeta, load_or_generate_units,
    user_env,
};
use fedrl_rl::offline::td3bc::{Td3Bc, Td3BcConfig, evaluate_policy, transitions_from_episodes};

use crate::registry::model_error;

/// The shapes of the task's environment: what the layout, the packing, the clipping of sampled
/// actions and the evaluation read.
#[derive(Clone, Debug, PartialEq)]
pub struct ContinuousEnv {
    /// The sensitive dataset's environment id (the utility is evaluated in it).
    pub env_id: String,
    pub obs_dim: usize,
    pub act_dim: usize,
    /// The action box.
    pub low: Vec<f32>,
    pub high: Vec<f32>,
}

/// The sensitive dataset's environment and its Box spaces (an error for other spaces).
pub fn env_of(c: &PrivorlContinuous) -> Result<ContinuousEnv, TaskError> {
    let spaces = |id: &str, seed: u64| -> Result<(usize, Vec<f32>, Vec<f32>), TaskError> {
        let env =
            user_env(id, seed, BEHAVIOUR_USER).map_err(|e| model_error("task.continuous", e))?;
        match (env.observation_space(), env.action_space()) {
            (fedrl_sim::Space::Box { low: o, .. }, fedrl_sim::Space::Box { low, high }) => {
                Ok((o.len(), low.clone(), high.clone()))
            }
            (o, a) => Err(TaskError::Invalid(format!(
                "task.continuous: `{id}` needs box observations and actions, it has {o:?} and {a:?}"
            ))),
        }
    };
    let (obs_dim, low, high) = spaces(&c.dataset.env, c.dataset.seed)?;
    let (public_obs, public_low, _) = spaces(&c.public.env, c.public.seed)?;
    if public_obs != obs_dim || public_low.len() != low.len() {
        return Err(TaskError::Invalid(format!(
            "task.continuous.public: `{}` has {public_obs} observation and {} action values, the sensitive `{}` {obs_dim} and {}",
            c.public.env,
            public_low.len(),
            c.dataset.env,
            low.len()
        )));
    }
    Ok(ContinuousEnv {
        env_id: c.dataset.env.clone(),
        obs_dim,
        act_dim: low.len(),
        low,
        high,
    })
}

/// `[s, a, r, s', done]` with the action's values.
pub fn layout(env: &ContinuousEnv) -> TransitionLayout {
    TransitionLayout {
        obs_dim: env.obs_dim,
        action: fedrl_rl::diffusion::ActionCoding::Continuous { dim: env.act_dim },
        model_terminal: true,
    }
}

/// Continuous transitions packed into a [`TransitionBatch`] (see the module's doc).
pub fn pack(t: &Transitions) -> fedrl_rl::Result<TransitionBatch> {
    let Actions::Continuous { dim, values } = &t.actions else {
        return Err(fedrl_rl::NnError::Invalid(
            "packing continuous transitions: the actions are discrete".into(),
        ));
    };
    let (d, a, n) = (t.obs_dim, *dim, t.len());
    if values.len() != n * a || t.obs.len() != n * d || t.next_obs.len() != n * d {
        return Err(fedrl_rl::NnError::Invalid(format!(
            "packing continuous transitions: {n} rows with {} observation and {} action values",
            t.obs.len(),
            values.len()
        )));
    }
    let mut b = TransitionBatch::new(d + a);
    for i in 0..n {
        b.obs.extend_from_slice(&t.obs[i * d..(i + 1) * d]);
        b.obs.extend_from_slice(&values[i * a..(i + 1) * a]);
        b.next_obs
            .extend_from_slice(&t.next_obs[i * d..(i + 1) * d]);
        b.next_obs.extend(std::iter::repeat_n(0.0, a));
    }
    b.actions = vec![0; n];
    b.rewards = t.rewards.clone();
    b.terminals = t.terminals.clone();
    Ok(b)
}

/// The continuous transitions of a packed batch with `obs_dim`-value observations.
pub fn unpack(b: &TransitionBatch, obs_dim: usize) -> fedrl_rl::Result<Transitions> {
    let w = b.obs_dim;
    if w <= obs_dim || b.obs.len() != b.len() * w || b.next_obs.len() != b.len() * w {
        return Err(fedrl_rl::NnError::Invalid(format!(
            "unpacking continuous transitions: rows of {w} values cannot hold {obs_dim} observation values and an action"
        )));
    }
    let a = w - obs_dim;
    let n = b.len();
    let mut t = Transitions {
        obs_dim,
        obs: Vec::with_capacity(n * obs_dim),
        actions: Actions::Continuous {
            dim: a,
            values: Vec::with_capacity(n * a),
        },
        rewards: b.rewards.clone(),
        next_obs: Vec::with_capacity(n * obs_dim),
        terminals: b.terminals.clone(),
    };
    for i in 0..n {
        let row = &b.obs[i * w..(i + 1) * w];
        t.obs.extend_from_slice(&row[..obs_dim]);
        if let Actions::Continuous { values, .. } = &mut t.actions {
            values.extend_from_slice(&row[obs_dim..]);
        }
        t.next_obs
            .extend_from_slice(&b.next_obs[i * w..i * w + obs_dim]);
    }
    Ok(t)
}

/// Clips every sampled action into the box (post-processing with public numbers: a learner and
/// the simulator only accept actions inside it).
pub fn clip_actions(t: &mut Transitions, env: &ContinuousEnv) {
    if let Actions::Continuous { dim, values } = &mut t.actions {
        for row in values.chunks_mut(*dim) {
            for ((v, lo), hi) in row.iter_mut().zip(&env.low).zip(&env.high) {
                *v = v.clamp(*lo, *hi);
            }
        }
    }
}

/// The episodes of a continuous dataset in unit order.
fn in_unit_order(d: &ContinuousDataset) -> Vec<&ContinuousEpisode> {
    let mut eps: Vec<&ContinuousEpisode> = d.episodes.iter().collect();
    eps.sort_by_key(|e| e.unit);
    eps
}

/// The public rows (encoded, not normalised): every episode of the public dataset (loaded from
/// the cache under `root`, generated there first if missing), at most `public_transitions`.
pub fn public_rows(
    task: &PrivorlTask,
    c: &PrivorlContinuous,
    root: &Path,
) -> anyhow::Result<PublicRows> {
    let env = env_of(c)?;
    let d = load_or_generate_units(&c.public, root, &mut |_| {}, &|_| true)
        .with_context(|| format!("loading the public dataset under {}", root.display()))?;
    check_shape(&d.meta, &env, "public")?;
    let mut t = transitions_from_episodes(&in_unit_order(&d), env.obs_dim, env.act_dim);
    if task.public_transitions > 0 && (t.len() as u64) > task.public_transitions {
        t = first(&t, task.public_transitions as usize)?;
    }
    let l = layout(&env);
    let rows = l.encode(&t)?;
    Ok(PublicRows::new(l.dim(), rows)?)
}

fn check_shape(meta: &ContinuousMeta, env: &ContinuousEnv, what: &str) -> anyhow::Result<()> {
    if meta.obs_dim != env.obs_dim || meta.act_dim != env.act_dim {
        anyhow::bail!(
            "the {what} dataset ({}) has {} observation and {} action values, the task's environment {} and {}",
            meta.env_id,
            meta.obs_dim,
            meta.act_dim,
            env.obs_dim,
            env.act_dim
        );
    }
    Ok(())
}

/// The first `n` transitions of `t`.
fn first(t: &Transitions, n: usize) -> fedrl_rl::Result<Transitions> {
    let b = pack(t)?;
    let rows: Vec<usize> = (0..n.min(b.len())).collect();
    unpack(&b.select(&rows), t.obs_dim)
}

/// The sensitive dataset split as `super::split_sensitive` splits a discrete one
/// ([`super::split_transitions`]), packed.
pub fn load_sensitive(
    task: &PrivorlTask,
    c: &PrivorlContinuous,
    root: &Path,
) -> anyhow::Result<(TransitionBatch, TransitionBatch)> {
    let env = env_of(c)?;
    let d = load_or_generate_units(&c.dataset, root, &mut |_| {}, &|_| true)
        .with_context(|| format!("loading the task's dataset under {}", root.display()))?;
    check_shape(&d.meta, &env, "sensitive")?;
    let eps = in_unit_order(&d);
    let mut ends = Vec::with_capacity(eps.len());
    let mut total = 0;
    for e in &eps {
        total += e.len();
        ends.push(total);
    }
    let mut fetch = |k: usize| -> anyhow::Result<TransitionBatch> {
        Ok(pack(&transitions_from_episodes(
            &[eps[k]],
            env.obs_dim,
            env.act_dim,
        ))?)
    };
    super::split_transitions(
        task,
        &ends,
        env.obs_dim + env.act_dim,
        &mut fetch,
        &format!("({})", d.meta.env_id),
        "task.continuous.dataset.units",
    )
}

/// The released synthetic dataset in the continuous format: one one-step episode per packed
/// transition of `batch` (unit `i`; the transitions are independent), terminated where the
/// synthesizer's terminal flag says so.
pub fn release_dataset(
    batch: &TransitionBatch,
    env: &ContinuousEnv,
    procedure: serde_json::Value,
) -> anyhow::Result<ContinuousDataset> {
    let t = unpack(batch, env.obs_dim)?;
    let Actions::Continuous { values, .. } = &t.actions else {
        anyhow::bail!("unpacked transitions with discrete actions");
    };
    let (d, a) = (env.obs_dim, env.act_dim);
    let episodes = (0..t.len())
        .map(|i| {
            let mut observations = t.obs[i * d..(i + 1) * d].to_vec();
            observations.extend_from_slice(&t.next_obs[i * d..(i + 1) * d]);
            ContinuousEpisode {
                unit: i as u64,
                observations,
                actions: values[i * a..(i + 1) * a].to_vec(),
                rewards: vec![t.rewards[i]],
                terminated: t.terminals[i] > 0.5,
            }
        })
        .collect();
    let ds = ContinuousDataset {
        meta: ContinuousMeta {
            env_id: env.env_id.clone(),
            obs_dim: d,
            act_dim: a,
            procedure,
            spaces: None,
        },
        episodes,
    };
    ds.check()?;
    Ok(ds)
}

/// The mean return over the evaluation episodes of uniformly random actions in the box (the
/// zero of the normalised utility: the `D4RL`-style score `100 (R - R_random) / (R_real -
/// R_random)`, since continuous-control returns may be negative).
pub fn random_return(task: &PrivorlTask, env: &ContinuousEnv) -> anyhow::Result<f64> {
    use rand::{RngExt, SeedableRng};
    let u = &task.utility;
    let mut rng = rand::rngs::Xoshiro256PlusPlus::seed_from_u64(u.eval_seed ^ 0x7a4d_0000);
    Ok(evaluate_policy(
        &env.env_id,
        u.eval_episodes,
        u.eval_seed,
        env.obs_dim,
        &mut |obs| {
            let rows = obs.len() / env.obs_dim;
            Ok((0..rows)
                .flat_map(|_| {
                    env.low
                        .iter()
                        .zip(&env.high)
                        .map(|(lo, hi)| lo + (hi - lo) * rng.random::<f32>())
                        .collect::<Vec<_>>()
                })
                .collect())
        },
    )?)
}

/// TD3+BC trained `utility.seeds` times on the packed `data` (seeds `td3bc.model_seed + i`),
/// each evaluated deterministically on the same `eval_episodes` episodes; the utility is the
/// mean of the per-training mean returns.
pub fn td3bc_utility(
    task: &PrivorlTask,
    env: &ContinuousEnv,
    data: &TransitionBatch,
    what: &str,
) -> anyhow::Result<serde_json::Value> {
    let u = &task.utility;
    let t = &u.td3bc;
    let cfg = Td3BcConfig {
        hidden: t.hidden.clone(),
        batch_size: t.batch,
        alpha: t.alpha,
        ..Td3BcConfig::default()
    };
    let transitions = unpack(data, env.obs_dim)?;
    let t0 = Instant::now();
    let every = (t.steps / 5).max(1);
    let mut per_seed = Vec::with_capacity(u.seeds as usize);
    for i in 0..u.seeds {
        let mut agent = Td3Bc::new(
            transitions.clone(),
            &env.low,
            &env.high,
            cfg.clone(),
            t.model_seed.wrapping_add(i),
            &Device::Cpu,
        )?;
        for step in 1..=t.steps {
            let s = agent.update()?;
            if step % every == 0 {
                eprintln!(
                    "privorl: TD3+BC {}/{} on {what} data, step {step}/{}: critic loss {:.4}",
                    i + 1,
                    u.seeds,
                    t.steps,
                    s.critic_loss
                );
            }
        }
        per_seed.push(agent.evaluate(&env.env_id, u.eval_episodes, u.eval_seed)?);
    }
    let mean = per_seed.iter().sum::<f64>() / per_seed.len() as f64;
    let sd = if per_seed.len() < 2 {
        0.0
    } else {
        (per_seed.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (per_seed.len() - 1) as f64)
            .sqrt()
    };
    Ok(serde_json::json!({
        "return": mean,
        "return_per_seed": per_seed,
        "return_sd_over_seeds": sd,
        "td3bc_seeds": u.seeds,
        "episodes": per_seed.len() * u.eval_episodes,
        "transitions": data.len(),
        "seconds": t0.elapsed().as_secs_f64(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Transitions {
        Transitions {
            obs_dim: 3,
            obs: (0..6).map(|x| x as f32).collect(),
            actions: Actions::Continuous {
                dim: 2,
                values: vec![0.5, -1.5, 2.0, 0.25],
            },
            rewards: vec![-1.0, -2.0],
            next_obs: (10..16).map(|x| x as f32).collect(),
            terminals: vec![0.0, 1.0],
        }
    }

    #[test]
    fn packing_round_trips_and_ignores_the_padding() {
        let t = sample();
        let mut b = pack(&t).unwrap();
        assert_eq!(b.obs_dim, 5);
        assert_eq!(b.len(), 2);
        assert_eq!(&b.obs[..5], &[0.0, 1.0, 2.0, 0.5, -1.5]);
        assert_eq!(&b.next_obs[5..], &[13.0, 14.0, 15.0, 0.0, 0.0]);
        assert_eq!(b.actions, vec![0, 0]);
        assert_eq!(unpack(&b, 3).unwrap(), t);
        // A client's padding never reaches the unpacked transitions.
        b.next_obs[3] = 99.0;
        assert_eq!(unpack(&b, 3).unwrap(), t);
        assert!(unpack(&b, 5).is_err());
        let discrete = Transitions {
            actions: Actions::Discrete(vec![0, 1]),
            ..sample()
        };
        assert!(pack(&discrete).is_err());
    }

    #[test]
    fn a_release_has_one_step_episodes_with_clipped_actions() {
        let env = ContinuousEnv {
            env_id: "Pendulum-v1".into(),
            obs_dim: 3,
            act_dim: 2,
            low: vec![-1.0, -1.0],
            high: vec![1.0, 1.0],
        };
        let mut t = sample();
        clip_actions(&mut t, &env);
        let Actions::Continuous { values, .. } = &t.actions else {
            panic!()
        };
        assert_eq!(values, &vec![0.5, -1.0, 1.0, 0.25]);
        let d = release_dataset(&pack(&t).unwrap(), &env, serde_json::json!("test")).unwrap();
        assert_eq!(d.episodes.len(), 2);
        assert_eq!(
            d.episodes[1].observations,
            vec![3.0, 4.0, 5.0, 13.0, 14.0, 15.0]
        );
        assert!(d.episodes[1].terminated && !d.episodes[0].terminated);
        let back = ContinuousDataset::from_bytes(&d.to_bytes().unwrap()).unwrap();
        assert_eq!(back, d);
    }
}
