//! DataRelease (seed 002, Algorithms 1-2) over the network, on the engine thread.
//!
//! Before any training step the coordinator walks T candidate trajectories drawn uniformly
//! without replacement from all experts' demonstrations. For each it asks the expert's client
//! for the trajectory ([`TrajectoryRequest`] -> [`TrajectoryData`]), broadcasts it to every
//! client ([`PrefixQuery`]), and each client answers, for every prefix length, the sum over its
//! experts of the probability that the expert plays that prefix ([`PrefixCounts`]; one expert's
//! term is a probability, so the count's sensitivity is 1 per expert). The coordinator checks
//! every answer (a count above the client's number of experts, a negative, a NaN or an
//! increasing sequence is refused and the client dropped), sums them, and runs the sparse
//! vector test itself with the Laplace noise of its own CSPRNG. Released prefixes form
//! D_stable; the rest (D_unst) stays with its owners for the DP-SGD steps.
//!
//! The engine does not see the clients until the release is over: their joins are held here,
//! and handed to it (with D_stable to the model) once the release is accounted in the ledger.

use std::collections::{BTreeSet, HashMap, HashSet};

use fedrl_common::privacy::expert_plan::ReleaseBudget;
use fedrl_common::privacy::expert_release::{self, ReleaseParameters};
use fedrl_common::protocol::{
    PrefixCounts, PrefixQuery, ReleasedPrefix, TrajectoryData, TrajectoryRequest, UnitId, UnitRange,
};
use fedrl_common::selective::ReleaseConfig;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::dpsgd::decode_rows;
use fedrl_rl::offline::qnet::QNetSpec;
use rand::rngs::ChaCha20Rng;
use rand::{RngExt, SeedableRng};

use crate::engine::ClientId;

/// A released prefix with its transitions (public once the release is accounted).
pub(super) struct StablePrefix {
    pub(super) prefix: ReleasedPrefix,
    pub(super) rows: TransitionBatch,
}

/// What the engine thread must do for the release.
pub(super) enum ReleaseAction {
    /// Ask `client` for a trajectory.
    Request(ClientId, TrajectoryRequest),
    /// Send the candidate to `client` (payload: rows of obs then action).
    Query(ClientId, PrefixQuery, Vec<f32>),
    /// `client` broke the protocol: close it with this message.
    Drop(ClientId, String),
}

enum State {
    /// Waiting until the joined clients host every expert.
    Gathering,
    AwaitTrajectory {
        query: u64,
        unit: UnitId,
        episode: u32,
        owner: ClientId,
    },
    AwaitCounts {
        query: u64,
        data: TrajectoryData,
        first_row: u32,
        /// Boxed: the other states are small.
        rows: Box<TransitionBatch>,
        waiting: HashSet<ClientId>,
        sum: Vec<f64>,
    },
    Done,
}

pub(super) struct Release {
    cfg: ReleaseConfig,
    params: ReleaseParameters,
    /// The experts' minimum action probability (Assumption 1).
    p_min: f64,
    spec: QNetSpec,
    experts: u64,
    episodes_per_unit: u64,
    rng: ChaCha20Rng,
    joined: HashMap<ClientId, Vec<UnitRange>>,
    drawn: BTreeSet<(UnitId, u32)>,
    walked: u64,
    next_query: u64,
    state: State,
    stable: Vec<StablePrefix>,
    /// Answers refused (operator-only count).
    pub(super) refused: u64,
    /// When the walk started (every expert hosted).
    started: Option<std::time::Instant>,
    /// When every agent had answered the first candidate's count query. In the federated mode
    /// agents join before they have loaded their data and experts, so the first query waits for
    /// the slowest of them; the walk proper is what follows.
    first_counts: Option<std::time::Instant>,
}

impl Release {
    /// A release over `experts` experts with `episodes_per_unit` demonstrations each; `p_min` is
    /// the experts' minimum action probability (Assumption 1); `seed` makes the candidates and
    /// the Laplace noise reproducible (not private), `None` draws them from the OS.
    pub(super) fn new(
        cfg: &ReleaseConfig,
        p_min: f64,
        spec: QNetSpec,
        experts: u64,
        episodes_per_unit: u64,
        seed: Option<u64>,
    ) -> anyhow::Result<Self> {
        // The same budget (and epsilon') the ledger charges: Scenario::release_event.
        let params = ReleaseBudget::new(cfg.epsilon, cfg.delta, cfg.trajectories, cfg.calibration)?
            .parameters(p_min, cfg.horizon)?;
        if cfg.trajectories > experts.saturating_mul(episodes_per_unit) {
            anyhow::bail!(
                "task.selective.release.trajectories ({}) exceeds the {} demonstrations of the dataset",
                cfg.trajectories,
                experts * episodes_per_unit
            );
        }
        let rng = match seed {
            Some(s) => ChaCha20Rng::seed_from_u64(s ^ 0xDA7A_2E1E_A5E0_0002),
            None => ChaCha20Rng::try_from_rng(&mut rand::rngs::SysRng)
                .map_err(|e| anyhow::anyhow!("the operating system's random source: {e}"))?,
        };
        Ok(Release {
            cfg: cfg.clone(),
            params,
            p_min,
            spec,
            experts,
            episodes_per_unit,
            rng,
            joined: HashMap::new(),
            drawn: BTreeSet::new(),
            walked: 0,
            next_query: 1,
            state: State::Gathering,
            stable: Vec::new(),
            refused: 0,
            started: None,
            first_counts: None,
        })
    }

    pub(super) fn params(&self) -> &ReleaseParameters {
        &self.params
    }

    pub(super) fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Seconds since the walk started (0 before).
    pub(super) fn walk_seconds(&self) -> f64 {
        self.started.map_or(0.0, |t| t.elapsed().as_secs_f64())
    }

    /// Of [`Release::walk_seconds`], those spent before every agent had answered the first
    /// candidate's counts (loading their data and experts; 0 if none was answered).
    pub(super) fn agents_ready_seconds(&self) -> f64 {
        match (self.started, self.first_counts) {
            (Some(s), Some(f)) => f.duration_since(s).as_secs_f64(),
            _ => 0.0,
        }
    }

    /// Candidate trajectories walked so far.
    pub(super) fn walked(&self) -> u64 {
        self.walked
    }

    /// Whether the engine has not seen `client` yet (its join is held here).
    pub(super) fn holds(&self, client: ClientId) -> bool {
        !self.is_done() && self.joined.contains_key(&client)
    }

    fn hosted(&self, client: ClientId) -> u64 {
        self.joined
            .get(&client)
            .map_or(0, |r| r.iter().map(|r| r.len()).sum())
    }

    fn owner(&self, unit: UnitId) -> Option<ClientId> {
        self.joined
            .iter()
            .find(|(_, r)| r.iter().any(|r| r.contains(unit)))
            .map(|(c, _)| *c)
    }

    /// A client's units wait here; the walk starts once every expert is hosted.
    pub(super) fn join(&mut self, client: ClientId, units: Vec<UnitRange>) -> Vec<ReleaseAction> {
        self.joined.insert(client, units);
        if matches!(self.state, State::Gathering) && self.all_hosted() {
            tracing::info!(
                experts = self.experts,
                trajectories = self.cfg.trajectories,
                epsilon_prime = self.params.epsilon_prime,
                theta = self.params.theta,
                "every expert is here: DataRelease starts"
            );
            self.started = Some(std::time::Instant::now());
            return self.next_candidate();
        }
        Vec::new()
    }

    fn all_hosted(&self) -> bool {
        let mut ranges: Vec<UnitRange> = self.joined.values().flatten().copied().collect();
        ranges.sort_by_key(|r| r.start);
        let mut covered = 0;
        for r in ranges {
            if r.start > covered {
                return false;
            }
            covered = covered.max(r.end);
        }
        covered >= self.experts
    }

    /// A client left: its experts no longer answer (their terms drop out of the counts, which
    /// can only lower them), and a trajectory it owed is replaced by another candidate.
    pub(super) fn left(&mut self, client: ClientId) -> Vec<ReleaseAction> {
        self.joined.remove(&client);
        match &mut self.state {
            State::AwaitTrajectory { owner, .. } if *owner == client => self.next_candidate(),
            State::AwaitCounts { waiting, .. } => {
                waiting.remove(&client);
                self.maybe_decide()
            }
            _ => Vec::new(),
        }
    }

    /// Draws the next candidate and asks its owner, or finishes after T.
    fn next_candidate(&mut self) -> Vec<ReleaseAction> {
        let total = self.experts * self.episodes_per_unit;
        while self.walked < self.cfg.trajectories && (self.drawn.len() as u64) < total {
            let k = self.rng.random_range(0..total);
            let (unit, episode) = (
                k / self.episodes_per_unit,
                (k % self.episodes_per_unit) as u32,
            );
            if !self.drawn.insert((unit, episode)) {
                continue;
            }
            let Some(owner) = self.owner(unit) else {
                // Its client left: nothing of it can be asked (no budget spent).
                continue;
            };
            let query = self.next_query;
            self.next_query += 1;
            self.state = State::AwaitTrajectory {
                query,
                unit,
                episode,
                owner,
            };
            return vec![ReleaseAction::Request(
                owner,
                TrajectoryRequest {
                    query,
                    unit,
                    episode,
                },
            )];
        }
        self.state = State::Done;
        tracing::info!(
            walked = self.walked,
            released = self.stable.len(),
            transitions = self.stable_transitions(),
            "DataRelease done"
        );
        Vec::new()
    }

    /// The owner's trajectory: checked, then broadcast as a prefix query.
    pub(super) fn trajectory(
        &mut self,
        client: ClientId,
        data: TrajectoryData,
        payload: &[f32],
    ) -> Vec<ReleaseAction> {
        let State::AwaitTrajectory {
            query,
            unit,
            episode,
            owner,
        } = self.state
        else {
            return vec![ReleaseAction::Drop(
                client,
                "trajectory data that nobody asked for".into(),
            )];
        };
        if client != owner || data.query != query || data.unit != unit || data.episode != episode {
            return vec![ReleaseAction::Drop(
                client,
                format!(
                    "trajectory data for query {} (unit {}, episode {}), expected query {query} (unit {unit}, episode {episode}) from its owner",
                    data.query, data.unit, data.episode
                ),
            )];
        }
        let rows = match decode_rows(
            &self.spec,
            data.obs_dim as usize,
            data.rows as usize,
            payload,
        ) {
            Ok(r) if (r.len() as u64) <= self.cfg.horizon => r,
            Ok(r) => {
                let m = format!(
                    "trajectory of {} steps, longer than the release's horizon L = {}",
                    r.len(),
                    self.cfg.horizon
                );
                let mut out = vec![ReleaseAction::Drop(client, m)];
                out.extend(self.left(client));
                return out;
            }
            Err(e) => {
                let mut out = vec![ReleaseAction::Drop(client, format!("trajectory data: {e}"))];
                out.extend(self.left(client));
                return out;
            }
        };
        // The walk is charged from here on: the candidate's answers decide its release.
        self.walked += 1;
        let d = rows.obs_dim;
        let mut payload = Vec::with_capacity(rows.len() * (d + 1));
        for i in 0..rows.len() {
            payload.extend_from_slice(&rows.obs[i * d..(i + 1) * d]);
            payload.push(rows.actions[i] as f32);
        }
        let msg = PrefixQuery {
            query,
            steps: rows.len() as u32,
            obs_dim: d as u32,
        };
        let waiting: HashSet<ClientId> = self.joined.keys().copied().collect();
        let out = waiting
            .iter()
            .map(|c| ReleaseAction::Query(*c, msg.clone(), payload.clone()))
            .collect();
        self.state = State::AwaitCounts {
            query,
            sum: vec![0.0; rows.len()],
            first_row: data.first_row,
            data,
            rows: Box::new(rows),
            waiting,
        };
        out
    }

    /// One client's counts: checked against its number of experts, then added.
    pub(super) fn counts(&mut self, client: ClientId, msg: PrefixCounts) -> Vec<ReleaseAction> {
        let hosted = self.hosted(client);
        let horizon = self.cfg.horizon;
        let State::AwaitCounts {
            query,
            waiting,
            sum,
            ..
        } = &mut self.state
        else {
            return vec![ReleaseAction::Drop(
                client,
                "prefix counts nobody asked for".into(),
            )];
        };
        if msg.query != *query || !waiting.contains(&client) {
            return vec![ReleaseAction::Drop(
                client,
                format!(
                    "prefix counts for query {} (expected one answer to query {query})",
                    msg.query
                ),
            )];
        }
        let checked = if msg.counts.len() != sum.len() {
            Err(format!(
                "{} prefix counts for a trajectory of {} steps",
                msg.counts.len(),
                sum.len()
            ))
        } else {
            fedrl_common::privacy::expert_answers::check_prefix_counts(&msg.counts, hosted, horizon)
                .map_err(|e| e.to_string())
        };
        if let Err(m) = checked {
            self.refused += 1;
            tracing::warn!(client, message = %m, "prefix counts refused; the client is dropped");
            let mut out = vec![ReleaseAction::Drop(client, format!("prefix counts: {m}"))];
            out.extend(self.left(client));
            return out;
        }
        for (s, c) in sum.iter_mut().zip(&msg.counts) {
            *s += c;
        }
        waiting.remove(&client);
        self.maybe_decide()
    }

    /// Every client answered (or left): the sparse vector test decides the candidate.
    fn maybe_decide(&mut self) -> Vec<ReleaseAction> {
        let State::AwaitCounts { waiting, .. } = &self.state else {
            return Vec::new();
        };
        if !waiting.is_empty() {
            return Vec::new();
        }
        self.first_counts
            .get_or_insert_with(std::time::Instant::now);
        let State::AwaitCounts {
            data,
            first_row,
            rows,
            sum,
            ..
        } = std::mem::replace(&mut self.state, State::Gathering)
        else {
            return Vec::new();
        };
        let k = match expert_release::stable_prefix(&sum, &self.params, &mut self.rng) {
            Ok(k) => k,
            Err(e) => {
                // Parameters were checked at construction; release nothing rather than guess.
                tracing::error!(error = %e, "sparse vector test failed; nothing released");
                0
            }
        };
        tracing::info!(
            query = data.query,
            steps = rows.len(),
            released = k,
            "candidate trajectory walked"
        );
        if k > 0 {
            let keep: Vec<usize> = (0..k).collect();
            self.stable.push(StablePrefix {
                prefix: ReleasedPrefix {
                    unit: data.unit,
                    episode: data.episode,
                    first_row,
                    steps: k as u32,
                },
                rows: rows.select(&keep),
            });
        }
        self.next_candidate()
    }

    /// The released prefixes.
    pub(super) fn stable(&self) -> &[StablePrefix] {
        &self.stable
    }

    /// |D_stable| in transitions.
    pub(super) fn stable_transitions(&self) -> usize {
        self.stable.iter().map(|s| s.rows.len()).sum()
    }

    /// The most D_stable can hold: the longest prefix a count can pass without noise when every
    /// expert agrees (L*, [`expert_release::max_stable_prefix`]) and T x L* transitions.
    pub(super) fn stable_bound(&self) -> anyhow::Result<(u64, u64)> {
        let longest = expert_release::max_stable_prefix(
            self.experts,
            self.spec.n_actions as u64,
            self.p_min,
            &self.params,
        )?;
        Ok((longest, longest.saturating_mul(self.cfg.trajectories)))
    }

    /// The held joins, handed to the engine once the release is accounted.
    pub(super) fn take_joined(&mut self) -> Vec<(ClientId, Vec<UnitRange>)> {
        self.joined.drain().collect()
    }
}

/// Folder of the published D_stable in the state directory: a Minari dataset root holding one
/// dataset, `fedrl/<env>-stable-v0`.
pub const STABLE_DIR: &str = "d_stable";

/// The ledger phase of the DataRelease (charged to every expert, before any DP-SGD step).
pub(super) const RELEASE_PHASE: &str = "release";

/// Writes D_stable into the Minari root `dir/d_stable` and returns its transitions and its
/// path relative to `dir`. Each
/// released prefix is one episode whose `unit` is its own index: the expert it came from is not
/// part of the release (the analysis covers the prefixes, not who played them), so it is not
/// published.
pub(super) fn publish(
    release: &Release,
    scenario: &fedrl_common::scenario::Scenario,
    dir: &std::path::Path,
) -> anyhow::Result<(TransitionBatch, String)> {
    use anyhow::Context;
    use fedrl_rl::offline::{Dataset, Episode, minari};
    let d = release.spec.obs_dim;
    let mut all = TransitionBatch::new(d);
    let mut episodes = Vec::new();
    for (i, s) in release.stable().iter().enumerate() {
        let r = &s.rows;
        all.extend_from(r);
        let n = r.len();
        let mut observations = r.obs.clone();
        observations.extend_from_slice(&r.next_obs[(n - 1) * d..n * d]);
        let terminations: Vec<bool> = r.terminals.iter().map(|&t| t > 0.5).collect();
        let mut truncations = vec![false; n];
        if !terminations[n - 1] {
            // A prefix ends where the release stopped, not where the episode did.
            truncations[n - 1] = true;
        }
        episodes.push(Episode {
            id: i as u64,
            unit: i as u64,
            observations,
            actions: r.actions.clone(),
            rewards: r.rewards.clone(),
            terminations,
            truncations,
        });
    }
    let env = match &scenario.task {
        fedrl_common::scenario::Task::OfflineCql(t) => t.dataset.env.clone(),
        _ => String::new(),
    };
    let name: String = env
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let dataset = Dataset {
        id: format!("fedrl/{name}-stable-v0"),
        env_id: env,
        obs_dim: d,
        n_actions: release.spec.n_actions,
        episodes,
    };
    let root = dir.join(STABLE_DIR);
    if root.exists() {
        std::fs::remove_dir_all(&root).with_context(|| format!("replacing {}", root.display()))?;
    }
    let out = root.join(&dataset.id);
    if !dataset.episodes.is_empty() {
        std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
        minari::write(
            &dataset,
            &out,
            &minari::WriteOptions {
                algorithm_name: Some("DataRelease (seed 002, Algorithm 2)".into()),
                description: Some(format!(
                    "Stable prefixes released by {} under expert-level differential privacy",
                    scenario.name
                )),
                spec: None,
            },
        )
        .with_context(|| format!("publishing D_stable in {}", out.display()))?;
    }
    Ok((all, format!("{STABLE_DIR}/{}", dataset.id)))
}

/// The dataset folder (the one holding `data/`) under a Minari root of one dataset.
fn find_dataset(root: &std::path::Path) -> Option<std::path::PathBuf> {
    let ns = std::fs::read_dir(root)
        .ok()?
        .flatten()
        .find(|e| e.path().is_dir())?;
    let ds = std::fs::read_dir(ns.path())
        .ok()?
        .flatten()
        .find(|e| e.path().join("data").is_dir())?;
    Some(ds.path())
}

/// The DataRelease of `scenario`, if its task has one and `ledger` has not accounted it yet (a
/// resumed run reads the published D_stable back instead, [`load_published`]).
pub(super) fn for_scenario(
    scenario: &fedrl_common::scenario::Scenario,
    ledger: &fedrl_common::privacy::ledger::PrivacyLedger,
) -> anyhow::Result<Option<Release>> {
    use fedrl_tasks::offline_cql::OfflineCqlTaskExt;
    let fedrl_common::scenario::Task::OfflineCql(task) = &scenario.task else {
        return Ok(None);
    };
    let Some(cfg) = task.selective.as_ref().and_then(|s| s.release.as_ref()) else {
        return Ok(None);
    };
    if released_already(ledger) {
        return Ok(None);
    }
    let p_min = fedrl_common::selective::expert_p_min(&task.dataset).ok_or_else(|| {
        anyhow::anyhow!(
            "a DataRelease needs expert policies with a minimum action probability: set task.dataset.behaviour to {{ kind = \"experts\", ... }}"
        )
    })?;
    Ok(Some(Release::new(
        cfg,
        p_min,
        task.qnet_spec()?,
        scenario.users,
        task.dataset.episodes_per_unit,
        scenario.seed,
    )?))
}

/// Whether `ledger` holds the DataRelease already.
pub(super) fn released_already(ledger: &fedrl_common::privacy::ledger::PrivacyLedger) -> bool {
    ledger.records().iter().any(|r| r.phase == RELEASE_PHASE)
}

/// D_stable as published in `dir` by an earlier process of this run (empty when nothing was
/// released).
pub(super) fn load_published(
    dir: &std::path::Path,
    obs_dim: usize,
) -> anyhow::Result<TransitionBatch> {
    use anyhow::Context;
    let Some(path) = find_dataset(&dir.join(STABLE_DIR)) else {
        return Ok(TransitionBatch::new(obs_dim));
    };
    let read = fedrl_rl::offline::minari::read(&path)
        .with_context(|| format!("reading the published D_stable in {}", path.display()))?;
    Ok(read.dataset.transitions())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fedrl_rl::offline::dpsgd::encode_rows;

    fn release(trajectories: u64) -> Release {
        let cfg = ReleaseConfig {
            epsilon: 50.0,
            delta: 0.1,
            trajectories,
            horizon: 4,
            calibration: Default::default(),
        };
        let spec = QNetSpec {
            obs_dim: 2,
            hidden: vec![4],
            n_actions: 2,
        };
        // 4 experts of 2 episodes each, in two clients.
        Release::new(&cfg, 0.02, spec, 4, 2, Some(7)).unwrap()
    }

    fn episode(steps: usize) -> TransitionBatch {
        let mut b = TransitionBatch::new(2);
        for t in 0..steps {
            b.obs.extend([t as f32, 1.0]);
            b.next_obs.extend([t as f32 + 1.0, 1.0]);
            b.actions.push((t % 2) as u32);
            b.rewards.push(1.0);
            b.terminals.push(0.0);
        }
        b
    }

    fn range(start: u64, end: u64) -> Vec<UnitRange> {
        vec![UnitRange { start, end }]
    }

    /// Answers the pending request with a trajectory of `steps` steps, as its owner would.
    fn answer_request(
        r: &mut Release,
        actions: Vec<ReleaseAction>,
        steps: usize,
    ) -> Vec<ReleaseAction> {
        let [ReleaseAction::Request(owner, req)] = actions.as_slice() else {
            panic!("expected one trajectory request");
        };
        let ep = episode(steps);
        let data = TrajectoryData {
            query: req.query,
            unit: req.unit,
            episode: req.episode,
            first_row: 0,
            rows: steps as u32,
            obs_dim: 2,
        };
        r.trajectory(*owner, data, &encode_rows(&ep))
    }

    #[test]
    fn the_walk_waits_for_every_expert_then_queries_every_client() {
        let mut r = release(2);
        assert!(r.join(1, range(0, 2)).is_empty(), "experts 2-3 are missing");
        let asked = r.join(2, range(2, 4));
        let queries = answer_request(&mut r, asked, 3);
        assert_eq!(queries.len(), 2, "both clients are asked");
        for q in &queries {
            let ReleaseAction::Query(_, msg, payload) = q else {
                panic!("expected prefix queries");
            };
            assert_eq!((msg.steps, msg.obs_dim), (3, 2));
            assert_eq!(payload.len(), 3 * 3);
        }
        // Every expert plays the whole trajectory with probability 1 (a count far above theta^
        // at epsilon_1 = 50 would still not pass: theta is about c_min / p_min = 50 x c_min,
        // far above 4 experts). The prefix is not released, the walk goes on.
        let q = r.next_query - 1;
        assert!(
            r.counts(
                1,
                PrefixCounts {
                    query: q,
                    counts: vec![2.0; 3]
                }
            )
            .is_empty()
        );
        let next = r.counts(
            2,
            PrefixCounts {
                query: q,
                counts: vec![2.0, 1.5, 1.0],
            },
        );
        assert!(matches!(next.as_slice(), [ReleaseAction::Request(..)]));
        assert_eq!(r.walked(), 1);
        let queries = answer_request(&mut r, next, 2);
        let q = r.next_query - 1;
        assert_eq!(queries.len(), 2);
        r.counts(
            1,
            PrefixCounts {
                query: q,
                counts: vec![1.0, 1.0],
            },
        );
        r.counts(
            2,
            PrefixCounts {
                query: q,
                counts: vec![1.0, 1.0],
            },
        );
        assert!(r.is_done(), "T = 2 candidates walked");
        assert_eq!(r.stable_transitions(), 0);
        assert_eq!(r.take_joined().len(), 2);
    }

    #[test]
    fn counts_above_the_clients_experts_drop_the_client_and_the_walk_goes_on() {
        let mut r = release(1);
        r.join(1, range(0, 2));
        let asked = r.join(2, range(2, 4));
        answer_request(&mut r, asked, 2);
        let q = r.next_query - 1;
        // Client 1 hosts 2 experts: a count of 2.5 claims more than 1 per expert.
        for bad in [
            vec![2.5, 1.0],
            vec![-0.1, -0.2],
            vec![f64::NAN, 0.0],
            vec![0.5, 1.0],
            vec![1.0],
        ] {
            let mut r2 = release(1);
            r2.join(1, range(0, 2));
            let asked = r2.join(2, range(2, 4));
            answer_request(&mut r2, asked, 2);
            let q2 = r2.next_query - 1;
            let out = r2.counts(
                1,
                PrefixCounts {
                    query: q2,
                    counts: bad.clone(),
                },
            );
            assert!(
                matches!(out.first(), Some(ReleaseAction::Drop(1, _))),
                "{bad:?} was accepted"
            );
            assert_eq!(r2.refused, 1);
            // The honest client's answer still completes the candidate.
            r2.counts(
                2,
                PrefixCounts {
                    query: q2,
                    counts: vec![1.0, 0.5],
                },
            );
            assert!(r2.is_done());
        }
        // A well-formed answer for another query, or from a client that was not asked, is
        // refused too.
        let out = r.counts(
            1,
            PrefixCounts {
                query: q + 5,
                counts: vec![1.0, 1.0],
            },
        );
        assert!(matches!(out.as_slice(), [ReleaseAction::Drop(1, _)]));
    }

    #[test]
    fn a_trajectory_longer_than_the_horizon_or_from_another_client_is_refused() {
        let mut r = release(1);
        r.join(1, range(0, 2));
        let asked = r.join(2, range(2, 4));
        let [ReleaseAction::Request(owner, req)] = asked.as_slice() else {
            panic!("expected a request");
        };
        let other = if *owner == 1 { 2 } else { 1 };
        let data = TrajectoryData {
            query: req.query,
            unit: req.unit,
            episode: req.episode,
            first_row: 0,
            rows: 2,
            obs_dim: 2,
        };
        let out = r.trajectory(other, data.clone(), &encode_rows(&episode(2)));
        assert!(matches!(out.as_slice(), [ReleaseAction::Drop(c, _)] if *c == other));
        let long = TrajectoryData { rows: 5, ..data };
        let out = r.trajectory(*owner, long, &encode_rows(&episode(5)));
        assert!(matches!(out.first(), Some(ReleaseAction::Drop(c, _)) if c == owner));
        assert_eq!(r.walked(), 0, "no candidate was charged");
    }
}
