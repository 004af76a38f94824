//! DPPG (seed 004, Algorithm 2), client side: each offered user plays its episode(s) in its own
//! simulator with the current global policy and computes a local PPO update with a fresh
//! optimizer; all offered users of this agent are trained as one batched tensor job
//! ([`fedrl_rl::local_updates`]) on the agent's device.
//!
//! A `gymnasium:<id>` population's users live in the Python workers of a [`GymPool`] that the
//! trainer (so the client agent) owns: each worker's share of a round is one batched job, and a
//! worker that faults (crash, deadline, NaN, wrong shapes) costs only its own users that round,
//! each dropped with the reason logged; the pool restarts the worker for the next round.

use super::DppgTaskExt;
use fedrl_common::protocol::{RoundSpec, UnitId};
use fedrl_common::scenario::DppgTask;
use fedrl_rl::candle_core::Device;
use fedrl_rl::{LocalUpdateConfig, ModelSpec, local_updates};
use fedrl_sim::Env;
use fedrl_sim::gym_bridge::GymPool;
use fedrl_sim::population::Population;

use crate::client::LocalTrainer;

/// The DPPG local trainer of one client agent.
pub struct DppgTrainer {
    population: Population,
    spec: ModelSpec,
    local: LocalUpdateConfig,
    /// Seeds the users' episodes (simulation randomness, not privacy noise).
    episode_seed: u64,
    /// Where the rollouts and the local PPO update run.
    device: Device,
    /// The Python workers of a `gymnasium:<id>` population (`None` for Rust simulators).
    bridge: Option<GymPool>,
}

impl DppgTrainer {
    /// The trainer for `task`, computing on `device`.
    pub fn new(task: &DppgTask, device: Device) -> anyhow::Result<Self> {
        let population = task.population()?;
        let spec = task.model_spec()?;
        // Workers start here, once per agent, and their spaces are checked against the task:
        // a mismatch stops the agent with the message instead of failing every round.
        let bridge = match super::gym_config(task) {
            Some(cfg) => {
                let declared = task.gymnasium.as_ref().map(super::declared_spaces);
                let pool = GymPool::start(cfg, declared)
                    .map_err(|e| anyhow::anyhow!("task.population {}: {e}", task.population))?;
                tracing::info!(
                    population = %task.population,
                    workers = pool.workers(),
                    "gymnasium workers started"
                );
                Some(pool)
            }
            None => None,
        };
        Ok(Self {
            population,
            spec,
            local: task.local.clone(),
            episode_seed: task.episode_seed,
            device,
            bridge,
        })
    }

    /// The bridge's pool, for tests and diagnostics (`None` for Rust simulators).
    pub fn gym_pool(&self) -> Option<&GymPool> {
        self.bridge.as_ref()
    }

    /// [`LocalTrainer::local_updates`] for a `gymnasium:<id>` population: one batched job per
    /// worker; the users of a worker that faults are dropped from the round.
    fn bridge_updates(
        &mut self,
        round: &RoundSpec,
        global: &[f32],
        units: &[UnitId],
        cfg: &LocalUpdateConfig,
    ) -> Vec<(UnitId, Vec<f32>)> {
        let Some(pool) = self.bridge.as_mut() else {
            return Vec::new();
        };
        let (groups, dropped) = pool.envs_for(units);
        for (unit, reason) in dropped {
            tracing::warn!(round = round.round, unit, %reason, "user dropped from the round: its gymnasium worker is down");
        }
        // One job per worker, all at once: the workers step in parallel, and a fault in one
        // costs only its own job.
        let (spec, device, base) = (&self.spec, &self.device, self.episode_seed);
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|mut g| {
                    s.spawn(move || {
                        let seeds: Vec<u64> = g
                            .users
                            .iter()
                            .map(|&u| episode_seed(base, round.round, u))
                            .collect();
                        let r = local_updates(spec, global, &mut g.envs, &seeds, cfg, device)
                            .map_err(|e| e.to_string());
                        (g.worker, g.users, r)
                    })
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|h| {
                    h.join()
                        .map_err(|_| {
                            tracing::error!(
                                round = round.round,
                                "a gymnasium worker's local-update job panicked; its users are dropped from the round"
                            )
                        })
                        .ok()
                })
                .collect()
        });
        let mut out = Vec::with_capacity(units.len());
        for (worker, users, r) in results {
            match r {
                Ok(updates) => out.extend(users.iter().zip(updates).map(|(&u, up)| (u, up.delta))),
                Err(e) => {
                    let reason = pool.fault(worker).unwrap_or(e);
                    tracing::warn!(
                        round = round.round,
                        worker,
                        users = ?users,
                        %reason,
                        "users dropped from the round: their gymnasium worker faulted (it restarts before the next round)"
                    );
                }
            }
        }
        out
    }
}

/// A seed for `unit`'s episodes in `round`: distinct per (round, unit), identical on every
/// machine (SplitMix64 finaliser over the three).
pub fn episode_seed(base: u64, round: u64, unit: UnitId) -> u64 {
    let mut z =
        base ^ round.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ unit.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl LocalTrainer for DppgTrainer {
    fn local_updates(
        &mut self,
        round: &RoundSpec,
        global: &[f32],
        units: &[UnitId],
    ) -> Vec<(UnitId, Vec<f32>)> {
        if self.bridge.is_some() {
            let mut cfg = self.local.clone();
            cfg.clip_norm = round.clip_norm;
            return self.bridge_updates(round, global, units, &cfg);
        }
        let mut hosted: Vec<UnitId> = Vec::with_capacity(units.len());
        let mut envs: Vec<Box<dyn Env>> = Vec::with_capacity(units.len());
        for &u in units {
            match self.population.user_env(u) {
                Ok(env) => {
                    hosted.push(u);
                    envs.push(env);
                }
                Err(e) => {
                    tracing::warn!(unit = u, error = %e, "cannot build the user's simulator; skipping")
                }
            }
        }
        let seeds: Vec<u64> = hosted
            .iter()
            .map(|&u| episode_seed(self.episode_seed, round.round, u))
            .collect();
        // The aggregator's C is authoritative; the client clips to it (the server clips again).
        let mut cfg = self.local.clone();
        cfg.clip_norm = round.clip_norm;
        match local_updates(&self.spec, global, &mut envs, &seeds, &cfg, &self.device) {
            Ok(updates) => hosted
                .into_iter()
                .zip(updates)
                .map(|(u, up)| (u, up.delta))
                .collect(),
            Err(e) => {
                tracing::error!(round = round.round, error = %e, "local PPO update failed; no updates this round");
                Vec::new()
            }
        }
    }
}
