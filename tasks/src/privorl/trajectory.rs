//! PrivORL-j as a level of the `privorl` kind (seed 003 section VI, issue 56 build items 3 and
//! 4): `level = "trajectory"`. Each of the first `trajectory.units` episodes of the sensitive
//! dataset is a privacy unit; the synthesizer is `fedrl_rl::diffusion::trajectory`'s
//! ([`TrajectorySynthesizer`]: fragments of `H` transitions conditioned on their link
//! transition, the conditional MLP by default or the paper's transformer), pre-trained on the
//! public dataset's episodes, fine-tuned by DP-SGD over trajectories and sampled into whole
//! stitched trajectories, which are released and evaluated as PrivORL-n's transitions are.
//!
//! - **Contribution** ([`TrajectoryCentral`], shared by both modes): a sampled trajectory's
//!   contribution is the mean EDM-loss gradient of up to `max_fragments` of its fragments
//!   (drawn from `(data_seed, round, unit)`), clipped **once** to `C`
//!   (`fedrl_rl::diffusion::trajectory::dp`); the aggregator Poisson-samples trajectories,
//!   the engine adds the noise, the ledger accounts each step at `unit_kind = "trajectory"`.
//!   In the central mode an agent uploads each hosted trajectory (at most the environment's
//!   step limit of transitions, [`max_unit_rows`]) and the aggregator computes the sum
//!   (summed path) or the vectors (per-unit path); in the federated mode the agent
//!   ([`TrajectoryTrainer`]) computes the same vectors itself.
//! - **Pre-training** ([`pretrained_trajectory`], public data only, cached beside the
//!   datasets): AdamW + EMA on the public episodes' fragments, cut at the offsets `0, H/4,
//!   H/2, 3H/4` (every offset's fragments keep their true link transition: public data, so
//!   the overlap costs nothing and gives four times the fragments), with curiosity when
//!   enabled: each refresh a pool of fragments is sampled (conditioned on links drawn from the
//!   public fragments), scored by random network distillation over fragment rows, and the
//!   most novel replace `curiosity_rate` of each batch (with their conditions), as PrivORL-n's
//!   pre-training does for transitions.
//! - **Release** ([`TrajectoryModel`]): the EMA weights generate `trajectory.synthetic`
//!   trajectories (each until a terminal or `trajectory.max_length` transitions), written as
//!   Minari episodes whose states are the generated next states (`s_0, s'_0, s'_1, ...`); the
//!   evaluated transitions are read back from those episodes, so what is measured is what is
//!   released. Fidelity is on transitions against the held-out real episodes, utility is
//!   discrete CQL as at transition level, and the operator-only membership audit scores each
//!   trajectory by its fragments' mean denoising loss.
//!
//! Invariants: the normaliser is fitted on public transitions only and the network's fixed
//! parts (Fourier frequencies) come from `model_seed`, so the agents, the central computation
//! and the server build the same function; a unit's contribution reads that unit's episode and
//! public numbers only; every contribution has L2 norm at most `C`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use fedrl_common::offline::DatasetSource;
use fedrl_common::protocol::{UnitId, UnitRange};
use fedrl_common::task::TaskError;
use fedrl_common::task::privorl::{PrivorlNet, PrivorlTask};
use fedrl_rl::audit::{AttackConfig, MembershipReport, denoising_loss_scores};
use fedrl_rl::candle_core::{Device, Tensor};
use fedrl_rl::diffusion::curiosity::EpochReport;
use fedrl_rl::diffusion::edm::{normal_tensor, per_example_loss};
use fedrl_rl::diffusion::trajectory::{
    CondNet, Conditioned, FragmentModel, FragmentNet, FragmentNetConfig, Fragments,
    TrajectoryConfig, TrajectorySynthesizer, TransformerConfig, split_fragments,
    summed_trajectory_contributions, trajectory_contributions,
};
use fedrl_rl::diffusion::{
    Actions, Normalizer, PublicRows, PublicSupport, Rnd, TransitionLayout, Transitions, Weights,
    replace_with_most_novel,
};
use fedrl_rl::offline::continuous::{ContinuousDataset, ContinuousEpisode, ContinuousMeta};
use fedrl_rl::offline::dataset::{Dataset, Episode};
use fedrl_rl::offline::per_example::SummedGradient;
use fedrl_rl::offline::qnet::QNetSpec;
use fedrl_rl::offline::td3bc::transitions_from_episodes;
use fedrl_rl::offline::{TransitionBatch, minari};
use fedrl_sim::population::Population;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;

use super::client::{PrivorlTrainer, UnitCompute};
use super::server::{FinetunedNet, Finetuning, SYNTHETIC_DIR, membership_json, synthetic_id};
use super::{
    Downstream, PrivorlTaskExt, batch_transitions, continuous, downstream, eval_env,
    transitions_in_order,
};
use crate::central::CentralGradients;
use crate::registry::model_error;
use crate::server::{ModelError, ModelState, ServerModel};

/// Steps per episode assumed for an environment whose step limit is not registered.
const FALLBACK_EPISODE_STEPS: u64 = 100_000;
/// Held-out fragments the curve's denoising loss is measured on.
const CURVE_FRAGMENTS: usize = 256;
/// Synthetic trajectories generated per call (progress lines between calls).
const GENERATE_CHUNK: usize = 100;
/// Seed offsets of the fine-tuning's and a restored model's training streams.
const FINETUNE_STREAM: u64 = 0xf1ae_0000_0000_0011;
const RESTORE_STREAM: u64 = 0xf1ae_0000_0000_0012;

/// The synthesizer's configuration at trajectory level: the fragment length, the network
/// (`synth.net`), EDM and AdamW/EMA as at transition level.
pub fn trajectory_config(task: &PrivorlTask) -> TrajectoryConfig {
    let base = task.synth_config();
    let net = match task.synth.net {
        PrivorlNet::Mlp => FragmentNetConfig::Mlp(base.denoiser),
        PrivorlNet::Transformer => {
            let t = &task.synth.transformer;
            FragmentNetConfig::Transformer(TransformerConfig {
                width: t.width,
                layers: t.layers,
                heads: t.heads,
                ff_mult: t.ff_mult,
                fourier_dim: task.synth.fourier_dim,
            })
        }
    };
    TrajectoryConfig {
        horizon: task.trajectory.horizon,
        net,
        edm: base.edm,
        train: base.train,
    }
}

/// The fine-tuning's configuration (its own learning rate, when set).
fn finetune_config(task: &PrivorlTask) -> TrajectoryConfig {
    let mut cfg = trajectory_config(task);
    if let Some(lr) = task.finetune_lr {
        cfg.train.lr = lr;
    }
    cfg
}

/// The model's length: the fragment network's trainable values.
pub fn dim(task: &PrivorlTask) -> Result<usize, TaskError> {
    let layout = task.layout()?;
    let cfg = trajectory_config(task);
    let (net, _) = FragmentNet::new(
        &layout,
        cfg.horizon,
        &cfg.net,
        task.model_seed,
        &Device::Cpu,
    )
    .map_err(|e| model_error("task.synth", e))?;
    Ok(net.num_params())
}

/// The registered step limit of the sensitive dataset's environment, if any.
fn env_step_limit(task: &PrivorlTask) -> Result<Option<u64>, TaskError> {
    let id = match &task.continuous {
        Some(c) => continuous::env_of(c)?.env_id,
        None => {
            let (env_id, seed) = crate::stored::source_env(&task.dataset)?;
            Population::new(&env_id, seed)
                .and_then(|p| p.user_env(0))
                .map_err(|e| model_error("task.dataset.env", e))?
                .id()
                .to_string()
        }
    };
    Ok(fedrl_sim::list()
        .into_iter()
        .find(|e| e.id == id)
        .map(|e| u64::from(e.max_episode_steps)))
}

/// The most transitions one unit's upload may hold: one episode of at most the environment's
/// step limit (a generated dataset), or the stored dataset's recorded step count. A public
/// bound from the dataset's shape.
pub fn max_unit_rows(task: &PrivorlTask) -> Result<u64, TaskError> {
    if task.continuous.is_some() {
        // One episode per unit in the continuous format.
        return Ok(env_step_limit(task)?.unwrap_or(FALLBACK_EPISODE_STEPS));
    }
    match &task.dataset {
        DatasetSource::Stored(s) => Ok(crate::stored::resolve(s)?.header.total_steps),
        DatasetSource::Generated(d) => Ok(d
            .episodes_per_unit
            .saturating_mul(env_step_limit(task)?.unwrap_or(FALLBACK_EPISODE_STEPS))),
    }
}

/// The most transitions of a generated trajectory: `trajectory.max_length`, or the
/// environment's step limit.
pub fn max_length(task: &PrivorlTask) -> anyhow::Result<usize> {
    if task.trajectory.max_length > 0 {
        return Ok(task.trajectory.max_length as usize);
    }
    match env_step_limit(task)? {
        Some(n) => Ok(n as usize),
        None => anyhow::bail!(
            "the sensitive dataset's environment has no registered step limit: set task.trajectory.max_length"
        ),
    }
}

/// One episode's transitions in time order.
fn episode_batch(e: &Episode, obs_dim: usize) -> TransitionBatch {
    let mut b = TransitionBatch::new(obs_dim);
    e.push_transitions(&mut b);
    b
}

/// The sensitive dataset's first `trajectory.units` episodes (in episode-id order; unit `i` =
/// the `i`-th) and the held-out episodes after them (at most `holdout_trajectories`).
pub fn split_trajectories(
    task: &PrivorlTask,
    d: &Dataset,
) -> anyhow::Result<(Vec<TransitionBatch>, Vec<TransitionBatch>)> {
    let n = task.trajectory.units as usize;
    let mut eps: Vec<&Episode> = d.episodes.iter().filter(|e| !e.is_empty()).collect();
    eps.sort_by_key(|e| e.id);
    if eps.len() < n {
        anyhow::bail!(
            "the sensitive dataset {} holds {} non-empty episodes, fewer than task.trajectory.units = {n}: raise task.dataset.units",
            d.id,
            eps.len()
        );
    }
    let units = eps[..n]
        .iter()
        .map(|e| episode_batch(e, d.obs_dim))
        .collect();
    let held = eps[n..]
        .iter()
        .take(task.holdout_trajectories() as usize)
        .map(|e| episode_batch(e, d.obs_dim))
        .collect();
    Ok((units, held))
}

/// The sensitive dataset's unit and held-out trajectories ([`split_trajectories`]), loaded from
/// the cache under `root` (generated there when missing). Continuous data: the episodes in unit
/// order, each packed ([`continuous::pack`]).
pub fn load_trajectories(
    task: &PrivorlTask,
    root: &Path,
) -> anyhow::Result<(Vec<TransitionBatch>, Vec<TransitionBatch>)> {
    let Some(c) = &task.continuous else {
        let (dataset, _) =
            fedrl_rl::offline::load_source_units(&task.dataset, root, &mut |_| {}, &|_| true)
                .with_context(|| format!("loading the task's dataset under {}", root.display()))?;
        return split_trajectories(task, &dataset);
    };
    let env = continuous::env_of(c)?;
    let d = fedrl_rl::offline::continuous::load_or_generate_units(
        &c.dataset,
        root,
        &mut |_| {},
        &|_| true,
    )
    .with_context(|| format!("loading the task's dataset under {}", root.display()))?;
    let mut eps: Vec<&ContinuousEpisode> = d.episodes.iter().filter(|e| !e.is_empty()).collect();
    eps.sort_by_key(|e| e.unit);
    let n = task.trajectory.units as usize;
    if eps.len() < n {
        anyhow::bail!(
            "the sensitive dataset ({}) holds {} non-empty episodes, fewer than task.trajectory.units = {n}: raise task.continuous.dataset.units",
            d.meta.env_id,
            eps.len()
        );
    }
    let pack = |e: &&ContinuousEpisode| {
        continuous::pack(&transitions_from_episodes(&[*e], env.obs_dim, env.act_dim))
    };
    let units = eps[..n].iter().map(pack).collect::<fedrl_rl::Result<_>>()?;
    let held = eps[n..]
        .iter()
        .take(task.holdout_trajectories() as usize)
        .map(pack)
        .collect::<fedrl_rl::Result<_>>()?;
    Ok((units, held))
}

/// The public dataset's episodes (encoded, not normalised: one row block per episode) and
/// their transitions as the normaliser's rows; at most `public_transitions` transitions in
/// whole episodes (0: all).
pub fn public_episodes(
    task: &PrivorlTask,
    root: &Path,
) -> anyhow::Result<(PublicRows, Vec<Vec<f32>>)> {
    let layout = task.layout()?;
    if let Some(c) = &task.continuous {
        let env = continuous::env_of(c)?;
        let d = fedrl_rl::offline::continuous::load_or_generate_units(
            &c.public,
            root,
            &mut |_| {},
            &|_| true,
        )
        .with_context(|| format!("loading the public dataset under {}", root.display()))?;
        if d.meta.obs_dim != env.obs_dim || d.meta.act_dim != env.act_dim {
            anyhow::bail!(
                "the public dataset ({}) has {} observation and {} action values, the task's environment {} and {}",
                d.meta.env_id,
                d.meta.obs_dim,
                d.meta.act_dim,
                env.obs_dim,
                env.act_dim
            );
        }
        let mut eps: Vec<&ContinuousEpisode> =
            d.episodes.iter().filter(|e| !e.is_empty()).collect();
        eps.sort_by_key(|e| e.unit);
        let (mut episodes, mut all, mut count) = (Vec::new(), Vec::new(), 0u64);
        for e in eps {
            if task.public_transitions > 0 && count >= task.public_transitions {
                break;
            }
            let rows = layout.encode(&transitions_from_episodes(&[e], env.obs_dim, env.act_dim))?;
            count += e.len() as u64;
            all.extend_from_slice(&rows);
            episodes.push(rows);
        }
        return Ok((PublicRows::new(layout.dim(), all)?, episodes));
    }
    let (d, _) =
        fedrl_rl::offline::load_or_generate_units(&task.public, root, &mut |_| {}, &|_| true)
            .with_context(|| format!("loading the public dataset under {}", root.display()))?;
    if d.obs_dim != layout.obs_dim || d.n_actions != task.row_spec()?.n_actions {
        anyhow::bail!(
            "the public dataset {} has observations of {} values and {} actions, the sensitive one {} and {}",
            d.id,
            d.obs_dim,
            d.n_actions,
            layout.obs_dim,
            task.row_spec()?.n_actions
        );
    }
    let mut eps: Vec<&Episode> = d.episodes.iter().filter(|e| !e.is_empty()).collect();
    eps.sort_by_key(|e| e.id);
    let mut episodes = Vec::new();
    let mut all = Vec::new();
    let mut count = 0u64;
    for e in eps {
        if task.public_transitions > 0 && count >= task.public_transitions {
            break;
        }
        let rows = layout.encode(&Transitions::from(&episode_batch(e, d.obs_dim)))?;
        count += e.len() as u64;
        all.extend_from_slice(&rows);
        episodes.push(rows);
    }
    Ok((PublicRows::new(layout.dim(), all)?, episodes))
}

/// A trajectory's fragments cut at offset `offset` (its transitions `offset..` split as
/// [`split_fragments`] does), the first one keeping its true link when `offset > 0`.
fn fragments_at(rows: &[f32], tdim: usize, horizon: usize, offset: usize) -> Option<Fragments> {
    let n = rows.len() / tdim;
    if offset > 0 && n < offset + horizon {
        return None;
    }
    let mut f = split_fragments(&rows[offset * tdim..], tdim, horizon).ok()?;
    if offset > 0 {
        f.cond[..tdim].copy_from_slice(&rows[(offset - 1) * tdim..offset * tdim]);
        f.cond[tdim] = 1.0;
    }
    Some(f)
}

/// Where the pre-trained trajectory synthesizer of `task` is cached under the data root: keyed
/// by everything pre-training reads. Public data only.
pub fn pretrained_trajectory_path(task: &PrivorlTask, root: &Path) -> anyhow::Result<PathBuf> {
    let key = serde_json::json!({
        "level": "trajectory",
        "public": task.public,
        "public_transitions": task.public_transitions,
        "layout": task.layout()?,
        "synth": trajectory_config(task),
        "pretrain": task.pretrain_config(),
        "model_seed": task.model_seed,
        "version": 1,
    });
    let text = serde_json::to_string(&key)?;
    Ok(root
        .join("privorl-pretrained")
        .join(format!("traj-{:016x}.f32", super::fnv1a(text.as_bytes()))))
}

/// The trajectory synthesizer fine-tuning starts from: the cached pre-trained one (pre-trained
/// here and cached when missing, each epoch reported through `on_epoch`), or a fresh one with
/// pre-training off. Its normaliser is fitted on the public transitions either way.
pub fn pretrained_trajectory(
    task: &PrivorlTask,
    root: &Path,
    device: &Device,
    on_epoch: &mut dyn FnMut(&EpochReport),
) -> anyhow::Result<(TrajectorySynthesizer, Option<Vec<EpochReport>>)> {
    let layout = task.layout()?;
    let cfg = trajectory_config(task);
    let (public, episodes) = public_episodes(task, root)?;
    let mut s = TrajectorySynthesizer::new(layout, &public, cfg, task.model_seed, device)?;
    if !task.pretrain.enabled {
        return Ok((s, None));
    }
    let path = pretrained_trajectory_path(task, root)?;
    if let Ok(bytes) = std::fs::read(&path) {
        let flat: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        *s.model_mut() = FragmentModel::from_weights(
            &layout,
            &cfg,
            task.model_seed,
            task.model_seed,
            device,
            &flat,
            None,
        )
        .with_context(|| format!("reading the pre-trained synthesizer {}", path.display()))?;
        return Ok((s, None));
    }
    let reports = pretrain_fragments(&mut s, &episodes, task, on_epoch)?;
    let mut bytes = Vec::new();
    for v in s.model().ema_flat()? {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, &path)?;
    Ok((s, Some(reports)))
}

/// Pre-trains `synth` on the public episodes' fragments (module docs), `pretrain.epochs` passes
/// of shuffled batches of `synth.batch_size` fragments.
fn pretrain_fragments(
    synth: &mut TrajectorySynthesizer,
    episodes: &[Vec<f32>],
    task: &PrivorlTask,
    on_epoch: &mut dyn FnMut(&EpochReport),
) -> anyhow::Result<Vec<EpochReport>> {
    let d = synth.layout().dim();
    let h = synth.horizon();
    let mut frags = Fragments::empty(d, h);
    let offsets: Vec<usize> = {
        let mut o: Vec<usize> = (0..4).map(|k| k * h / 4).collect();
        o.dedup();
        o
    };
    for e in episodes {
        let mut rows = e.clone();
        synth.normalizer().normalize(&mut rows);
        for &off in &offsets {
            if let Some(f) = fragments_at(&rows, d, h, off) {
                frags.extend(&f)?;
            }
        }
    }
    if frags.is_empty() {
        anyhow::bail!("the public dataset has no trajectory to pre-train on");
    }
    let (rd, cd) = (frags.row_dim(), frags.cond_dim());
    let n = frags.len();
    let bsz = task.synth.batch_size;
    let cur = task.pretrain_config().curiosity;
    let device = synth.model().net().device().clone();
    let mut rnd = if cur.enabled {
        Some(Rnd::new(rd, &cur, task.model_seed, &device)?)
    } else {
        None
    };
    let mut pick = Xoshiro256PlusPlus::seed_from_u64(task.model_seed ^ 0x7072_6574_7261_696e);
    let (mut pool, mut pool_cond, mut scores) = (Vec::new(), Vec::new(), Vec::<f32>::new());
    let mut order: Vec<usize> = (0..n).collect();
    let mut reports = Vec::with_capacity(task.pretrain.epochs);
    for epoch in 0..task.pretrain.epochs {
        let start = Instant::now();
        let (mut pool_mean, mut pool_max) = (None, None);
        if let Some(rnd) = rnd.as_mut()
            && epoch % cur.refresh_every_epochs == 0
        {
            // A pool conditioned on public links (drawn with replacement).
            pool_cond.clear();
            for _ in 0..cur.pool_size {
                let i = rand::RngExt::random_range(&mut pick, 0..n);
                pool_cond.extend_from_slice(frags.cond_row(i));
            }
            pool = synth
                .model_mut()
                .sample_normalized(&pool_cond, Weights::Online)?;
            scores = rnd.score(&pool)?;
            rnd.learn(&pool)?;
            pool_mean =
                Some(scores.iter().map(|&s| f64::from(s)).sum::<f64>() / scores.len() as f64);
            pool_max = scores.iter().map(|&s| f64::from(s)).reduce(f64::max);
        }
        order.shuffle(&mut pick);
        let (mut loss_sum, mut steps, mut novel) = (0.0f64, 0usize, 0usize);
        for chunk in order.chunks(bsz) {
            let mut batch = frags.select(chunk);
            if rnd.is_some() && !scores.is_empty() {
                let m = chunk.len().min(scores.len());
                let picks = rand::seq::index::sample(&mut pick, scores.len(), m);
                // Candidates are [fragment, condition] rows, so a novel fragment replaces a
                // batch row together with the link it was sampled for.
                let w = rd + cd;
                let mut joined = Vec::with_capacity(chunk.len() * w);
                for i in 0..chunk.len() {
                    joined.extend_from_slice(batch.row(i));
                    joined.extend_from_slice(batch.cond_row(i));
                }
                let mut cand = Vec::with_capacity(m * w);
                let mut cand_scores = Vec::with_capacity(m);
                for c in picks.iter() {
                    cand.extend_from_slice(&pool[c * rd..(c + 1) * rd]);
                    cand.extend_from_slice(&pool_cond[c * cd..(c + 1) * cd]);
                    cand_scores.push(scores[c]);
                }
                novel += replace_with_most_novel(&mut joined, w, &cand, &cand_scores, cur.rate)?;
                batch.x.clear();
                batch.cond.clear();
                for r in joined.chunks_exact(w) {
                    batch.x.extend_from_slice(&r[..rd]);
                    batch.cond.extend_from_slice(&r[rd..]);
                }
            }
            loss_sum += f64::from(synth.model_mut().train_step(&batch.x, &batch.cond)?);
            steps += 1;
        }
        let report = EpochReport {
            epoch,
            steps,
            mean_loss: loss_sum / steps.max(1) as f64,
            novel_rows: novel,
            pool_mean_score: pool_mean,
            pool_max_score: pool_max,
            seconds: start.elapsed().as_secs_f64(),
        };
        on_epoch(&report);
        reports.push(report);
    }
    Ok(reports)
}

/// The per-trajectory contribution shared by both modes: the fragment network built from
/// public numbers (the fixed parts from `model_seed`, the public normaliser).
pub struct TrajectoryCentral {
    task: PrivorlTask,
    row: QNetSpec,
    layout: TransitionLayout,
    normalizer: Normalizer,
    net: FragmentNet,
    cfg: TrajectoryConfig,
    max_unit_rows: u64,
}

impl TrajectoryCentral {
    /// Builds the network on `device`; the public data is read from the cache under `root`.
    pub fn new(task: &PrivorlTask, root: &Path, device: &Device) -> anyhow::Result<Self> {
        let layout = task.layout()?;
        let (public, _) = public_episodes(task, root)?;
        let normalizer = Normalizer::fit_public(&layout, &public)?;
        let cfg = trajectory_config(task);
        let (net, _) = FragmentNet::new(&layout, cfg.horizon, &cfg.net, task.model_seed, device)?;
        Ok(TrajectoryCentral {
            task: task.clone(),
            row: task.row_spec()?,
            layout,
            normalizer,
            net,
            cfg,
            max_unit_rows: max_unit_rows(task)?,
        })
    }

    /// One trajectory's fragments (encoded, normalised with the public statistics).
    pub fn fragments(&self, b: &TransitionBatch) -> fedrl_rl::Result<Fragments> {
        let mut rows = self.layout.encode(&batch_transitions(&self.layout, b)?)?;
        self.normalizer.normalize(&mut rows);
        split_fragments(&rows, self.layout.dim(), self.cfg.horizon)
    }

    /// The fragments of the units with data, in order.
    fn unit_fragments(
        &self,
        units: &[(UnitId, &TransitionBatch)],
    ) -> fedrl_rl::Result<Vec<(UnitId, Fragments)>> {
        units
            .iter()
            .filter(|(_, b)| !b.is_empty())
            .map(|(u, b)| Ok((*u, self.fragments(b)?)))
            .collect()
    }
}

impl CentralGradients for TrajectoryCentral {
    fn row_spec(&self) -> &QNetSpec {
        &self.row
    }

    /// A unit is one episode.
    fn max_unit_rows(&self) -> u64 {
        self.max_unit_rows
    }

    fn summed(
        &self,
        offer: &[f32],
        units: &[(UnitId, &TransitionBatch)],
        round: u64,
        clip_norm: f64,
    ) -> fedrl_rl::Result<SummedGradient> {
        let f = self.unit_fragments(units)?;
        let refs: Vec<(u64, &Fragments)> = f.iter().map(|(u, x)| (*u, x)).collect();
        summed_trajectory_contributions(
            &self.cfg.edm,
            &self.net,
            offer,
            &refs,
            round,
            self.task.data_seed,
            self.task.trajectory.max_fragments,
            clip_norm,
        )
    }

    fn per_unit(
        &self,
        offer: &[f32],
        units: &[(UnitId, &TransitionBatch)],
        round: u64,
        clip_norm: f64,
    ) -> fedrl_rl::Result<Vec<(UnitId, Vec<f32>)>> {
        let f = self.unit_fragments(units)?;
        let refs: Vec<(u64, &Fragments)> = f.iter().map(|(u, x)| (*u, x)).collect();
        Ok(trajectory_contributions(
            &self.cfg.edm,
            &self.net,
            offer,
            &refs,
            round,
            self.task.data_seed,
            self.task.trajectory.max_fragments,
            clip_norm,
        )?
        .contributions)
    }
}

impl FinetunedNet for FragmentModel {
    fn apply_gradient(&mut self, g: &[f32]) -> fedrl_rl::Result<()> {
        FragmentModel::apply_gradient(self, g)
    }
    fn online_flat(&self) -> fedrl_rl::Result<Vec<f32>> {
        FragmentModel::online_flat(self)
    }
    fn ema_flat(&self) -> fedrl_rl::Result<Vec<f32>> {
        FragmentModel::ema_flat(self)
    }
    fn steps(&self) -> u64 {
        FragmentModel::steps(self)
    }
    fn ema_calls(&self) -> u64 {
        FragmentModel::ema_calls(self)
    }
}

/// PrivORL-j's client trainer: the PrivORL trainer hosting episodes.
pub type TrajectoryTrainer = PrivorlTrainer<TrajectoryCentral>;

impl UnitCompute for TrajectoryCentral {
    const WHAT: &'static str = "the fragment network";
    fn build(task: &PrivorlTask, root: &Path, device: &Device) -> anyhow::Result<Self> {
        TrajectoryCentral::new(task, root, device)
    }
}

impl PrivorlTrainer<TrajectoryCentral> {
    /// Loads (or generates) the sensitive dataset and keeps the hosted units' episodes; every
    /// hosted unit must exist.
    pub fn trajectories(
        task: &PrivorlTask,
        hosted: &[UnitRange],
        device: Device,
    ) -> anyhow::Result<Self> {
        let root = fedrl_rl::offline::data_root(None)?;
        let (all, _) = load_trajectories(task, &root)?;
        let mut units = BTreeMap::new();
        for r in hosted {
            for u in r.start..r.end {
                let Some(b) = all.get(u as usize) else {
                    anyhow::bail!(
                        "unit {u} is hosted here but the dataset has {} unit trajectories",
                        all.len()
                    );
                };
                units.insert(u, b.clone());
            }
        }
        tracing::info!(units = units.len(), "PrivORL trajectories hosted");
        Ok(Self::hosting(task, units, device))
    }
}

/// PrivORL-j's server model: the trajectory synthesizer (pre-trained before the first round),
/// one AdamW step per released noisy mean contribution (EMA after it), and at the end the
/// generated trajectories, their evaluation and their export.
pub struct TrajectoryModel {
    task: PrivorlTask,
    synth: TrajectorySynthesizer,
    /// The offer, the released rounds, the curve.
    ft: Finetuning,
    /// Held-out real episodes (fidelity, the reference CQL, audit non-members).
    holdout: Vec<TransitionBatch>,
    /// Held-out fragments with fixed noise levels and noise (the curve's loss).
    curve_frags: (Tensor, Tensor, Vec<f64>, Tensor),
    pretrain: serde_json::Value,
    pretrain_s: f64,
    ready_at: Instant,
    max_len: usize,
    released: Option<Released>,
    /// The membership audit's trajectories as fragments: units' (members) and held-out ones
    /// (non-members); empty when the audit is off. Operator-only.
    audit: (Vec<Fragments>, Vec<Fragments>),
    /// The few-valued entries of the public data, snapped to in the release
    /// (`task.snap_public_values`).
    support: PublicSupport,
    device: Device,
}

impl TrajectoryModel {
    /// Builds (or reads from the cache) the pre-trained synthesizer and reads the held-out real
    /// episodes.
    pub fn new(task: &PrivorlTask, device: Device) -> anyhow::Result<Self> {
        let root = fedrl_rl::offline::data_root(None)?;
        let t0 = Instant::now();
        let (mut synth, reports) = pretrained_trajectory(task, &root, &device, &mut |r| {
            eprintln!(
                "privorl: pre-training epoch {}/{} (trajectory fragments): loss {:.4} ({:.1} s)",
                r.epoch + 1,
                task.pretrain.epochs,
                r.mean_loss,
                r.seconds
            );
        })?;
        let pretrain_s = t0.elapsed().as_secs_f64();
        let pretrain = serde_json::json!({
            "enabled": task.pretrain.enabled,
            "curiosity": task.pretrain.enabled && task.pretrain.curiosity,
            "epochs": if task.pretrain.enabled { task.pretrain.epochs } else { 0 },
            "cached": task.pretrain.enabled && reports.is_none(),
            "seconds_here": pretrain_s,
            "epoch_losses": reports
                .map(|r| r.iter().map(|e| e.mean_loss).collect::<Vec<_>>()),
        });
        // Fine-tuning starts from the pre-trained average, with a fresh EMA and AdamW.
        let layout = *synth.layout();
        let start = synth.model().ema_flat()?;
        *synth.model_mut() = FragmentModel::from_weights(
            &layout,
            &finetune_config(task),
            task.model_seed,
            task.model_seed ^ FINETUNE_STREAM,
            &device,
            &start,
            None,
        )?;
        let (units, holdout) = load_trajectories(task, &root)?;
        let support = PublicSupport::fit(
            &layout,
            &public_episodes(task, &root)?.0,
            task.snap_public_values,
        )?;
        if holdout.is_empty() {
            anyhow::bail!(
                "the sensitive dataset has no episode after the units' trajectories: raise task.dataset.units for held-out data"
            );
        }
        let k = (task.membership_rows() as usize)
            .min(units.len())
            .min(holdout.len());
        let mut pick = Xoshiro256PlusPlus::seed_from_u64(task.model_seed ^ 0x6d69_615f_7472_616a);
        let frag = |b: &TransitionBatch| synth.fragments(&batch_transitions(&layout, b)?);
        let members = sample(units.len(), k, &mut pick)
            .into_iter()
            .map(|i| frag(&units[i]))
            .collect::<fedrl_rl::Result<Vec<_>>>()?;
        let non_members = sample(holdout.len(), k, &mut pick)
            .into_iter()
            .map(|i| frag(&holdout[i]))
            .collect::<fedrl_rl::Result<Vec<_>>>()?;
        drop(units);
        // The curve: the first held-out fragments at fixed noise.
        let mut cf = Fragments::empty(layout.dim(), synth.horizon());
        for b in &holdout {
            if cf.len() >= CURVE_FRAGMENTS {
                break;
            }
            cf.extend(&frag(b)?)?;
        }
        let n = cf.len().min(CURVE_FRAGMENTS);
        let cf = cf.select(&(0..n).collect::<Vec<_>>());
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(task.model_seed ^ 0xc0ffee);
        let edm = trajectory_config(task).edm;
        let sigmas: Vec<f64> = (0..n).map(|_| edm.draw_sigma(&mut rng)).collect();
        let noise = normal_tensor(n, cf.row_dim(), &mut rng, &device)?;
        let x = Tensor::from_slice(&cf.x, (n, cf.row_dim()), &device)?;
        let c = Tensor::from_slice(&cf.cond, (n, cf.cond_dim()), &device)?;
        let mut m = TrajectoryModel {
            audit: (members, non_members),
            task: task.clone(),
            ft: Finetuning::new(synth.model())?,
            synth,
            holdout,
            curve_frags: (x, c, sigmas, noise),
            pretrain,
            pretrain_s,
            ready_at: Instant::now(),
            max_len: max_length(task)?,
            released: None,
            support,
            device,
        };
        m.record_curve()?;
        m.ready_at = Instant::now();
        Ok(m)
    }

    /// The EMA weights' denoising loss on the held-out fragments at fixed noise.
    fn heldout_loss(&self) -> anyhow::Result<f64> {
        let (x, c, s, n) = &self.curve_frags;
        let model = self.synth.model();
        let net = Conditioned {
            net: model.net(),
            cond: c,
        };
        let l = per_example_loss(model.edm(), &net, model.ema_params(), x, s, n)?
            .mean_all()?
            .to_scalar::<f32>()?;
        Ok(f64::from(l))
    }

    fn record_curve(&mut self) -> anyhow::Result<()> {
        let loss = self.heldout_loss()?;
        self.ft.curve.push(serde_json::json!({
            "step": self.synth.model().steps(),
            "heldout_loss": loss,
        }));
        Ok(())
    }

    /// Generates the synthetic trajectories as episodes (states `s_0, s'_0, s'_1, ...`;
    /// continuous actions clipped into the box) and the transitions read back from them (packed
    /// for continuous actions), with each trajectory's length.
    fn sample(&mut self) -> anyhow::Result<(Released, TransitionBatch, Vec<usize>)> {
        let n = self.task.synthetic_trajectories() as usize;
        let t0 = Instant::now();
        let obs_dim = self.synth.layout().obs_dim;
        let cont = match &self.task.continuous {
            Some(c) => Some(continuous::env_of(c)?),
            None => None,
        };
        let mut generated: Vec<Transitions> = Vec::with_capacity(n);
        let mut transitions = 0usize;
        while generated.len() < n {
            let m = GENERATE_CHUNK.min(n - generated.len());
            for mut t in self
                .synth
                .generate_snapped(m, self.max_len, Some(&self.support))?
            {
                if let Some(env) = &cont {
                    continuous::clip_actions(&mut t, env);
                }
                transitions += t.len();
                generated.push(t);
            }
            eprintln!(
                "privorl: generating {}/{n} synthetic trajectories, {transitions} transitions ({:.0} s)",
                generated.len(),
                t0.elapsed().as_secs_f64()
            );
        }
        let lens: Vec<usize> = generated.iter().map(Transitions::len).collect();
        let env_id = eval_env(&self.task)?;
        let states = |t: &Transitions| {
            let mut o = t.obs[..obs_dim].to_vec();
            o.extend_from_slice(&t.next_obs);
            o
        };
        if let Some(env) = &cont {
            let mut episodes = Vec::with_capacity(n);
            for (i, t) in generated.into_iter().enumerate() {
                let observations = states(&t);
                let Actions::Continuous { values, .. } = t.actions else {
                    anyhow::bail!("the synthesizer decoded discrete actions for a continuous task");
                };
                episodes.push(ContinuousEpisode {
                    unit: i as u64,
                    observations,
                    actions: values,
                    terminated: t.terminals.last().is_some_and(|&x| x > 0.5),
                    rewards: t.rewards,
                });
            }
            let ds = ContinuousDataset {
                meta: ContinuousMeta {
                    env_id: env.env_id.clone(),
                    obs_dim: env.obs_dim,
                    act_dim: env.act_dim,
                    procedure: serde_json::json!({
                        "privorl": "PrivORL-j (fedrl): DP synthetic trajectories generated fragment by fragment from a diffusion model fine-tuned by trajectory-level DP-SGD",
                        "task": self.task,
                    }),
                    spaces: None,
                },
                episodes,
            };
            ds.check()?;
            let refs: Vec<&ContinuousEpisode> = ds.episodes.iter().collect();
            let batch =
                continuous::pack(&transitions_from_episodes(&refs, env.obs_dim, env.act_dim))?;
            return Ok((Released::Continuous(ds), batch, lens));
        }
        let mut episodes = Vec::with_capacity(n);
        for (i, t) in generated.into_iter().enumerate() {
            let observations = states(&t);
            let Actions::Discrete(actions) = t.actions else {
                anyhow::bail!("the synthesizer decoded continuous actions for a discrete task");
            };
            let terminations: Vec<bool> = t.terminals.iter().map(|&x| x > 0.5).collect();
            let mut truncations = vec![false; actions.len()];
            if let (Some(last), Some(tr)) = (terminations.last(), truncations.last_mut()) {
                *tr = !*last;
            }
            episodes.push(Episode {
                id: i as u64,
                unit: i as u64,
                observations,
                actions,
                rewards: t.rewards,
                terminations,
                truncations,
            });
        }
        let d = Dataset {
            id: synthetic_id(&env_id),
            env_id,
            obs_dim,
            n_actions: self.task.row_spec()?.n_actions,
            episodes,
        };
        let batch = transitions_in_order(&d);
        Ok((Released::Minari(d), batch, lens))
    }

    fn evaluate_release(&mut self) -> anyhow::Result<serde_json::Value> {
        let finetuning_s = self.ready_at.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let (dataset, synthetic, lens) = self.sample()?;
        let sampling_s = t0.elapsed().as_secs_f64();
        let mut real = TransitionBatch::new(synthetic.obs_dim);
        for b in &self.holdout {
            real.extend_from(b);
        }
        let lens: Vec<f64> = lens.iter().map(|&l| l as f64).collect();
        let real_lens: Vec<f64> = self.holdout.iter().map(|b| b.len() as f64).collect();
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let layout = *self.synth.layout();
        let f = fedrl_rl::fidelity::fidelity(
            &layout.encode(&batch_transitions(&layout, &real)?)?,
            &layout.encode(&batch_transitions(&layout, &synthetic)?)?,
            layout.dim(),
        )?;
        let Downstream {
            on_synthetic: on_syn,
            reference,
            random,
            percent,
            seconds: downstream_s,
        } = downstream(&self.task, &synthetic, &real)?;
        let syn_return = on_syn["return"].as_f64().unwrap_or(f64::NAN);
        let id = dataset.id();
        let n_traj = lens.len();
        self.released = Some(dataset);
        let learner = if self.task.is_continuous() {
            "TD3+BC"
        } else {
            "CQL"
        };
        eprintln!(
            "privorl: fidelity marginal {:.3}, correlation {}; {n_traj} synthetic trajectories of mean length {:.1} (real {:.1}); {learner} on synthetic data returns {syn_return:.1}{}",
            f.marginal,
            f.correlation.map_or("n/a".into(), |c| format!("{c:.3}")),
            mean(&lens),
            mean(&real_lens),
            percent.map_or(String::new(), |p| format!(
                " ({p:.0}% of the real-data reference)"
            ))
        );
        Ok(serde_json::json!({
            "final_eval_return": syn_return,
            "final_eval_episodes": on_syn["episodes"],
            "level": "trajectory",
            "fidelity": {
                "marginal": f.marginal,
                "correlation": f.correlation,
                "undefined_pairs": f.undefined_pairs,
                "marginal_per_entry": f.per_dimension,
                "snapped_entries": self.support.snapped(),
                "real_transitions": real.len(),
                "synthetic_transitions": synthetic.len(),
                "against": "held-out real episodes' transitions (episodes after the units'; no unit's data): an evaluation beside the DP release, not covered by its epsilon",
            },
            "trajectories": {
                "synthetic": n_traj,
                "synthetic_mean_length": mean(&lens),
                "real_heldout": self.holdout.len(),
                "real_heldout_mean_length": mean(&real_lens),
                "horizon": self.synth.horizon(),
                "max_length": self.max_len,
                "net": self.task.synth.net,
            },
            "utility": {
                "learner": if self.task.is_continuous() {
                    "TD3+BC (alpha from task.utility.td3bc) on the synthetic trajectories' transitions only, deterministic evaluation"
                } else {
                    "discrete CQL on the synthetic trajectories' transitions only, greedy evaluation"
                },
                "synthetic": on_syn,
                "real_reference": reference,
                "real_reference_data": "the held-out real episodes (no unit's data; not covered by epsilon)",
                "percent_of_real": percent,
                "random_return": random,
                "percent_of_real_is": if random.is_some() {
                    "100 (synthetic - random) / (real - random): returns normalised by uniformly random actions' on the same episodes"
                } else {
                    "100 synthetic / real"
                },
            },
            "synthetic_dataset": {
                "id": id,
                "folder": SYNTHETIC_DIR,
                "format": if self.task.is_continuous() { "continuous" } else { "minari" },
                "transitions": synthetic.len(),
                "trajectories": n_traj,
            },
            "pretrain": self.pretrain,
            "finetune": {
                "applied": self.task.finetune,
                "rounds": self.ft.rounds,
                "steps": self.synth.model().steps(),
                "seconds_applying": self.ft.seconds,
            },
            "phase_seconds": {
                "pretraining": self.pretrain_s,
                "finetuning": finetuning_s,
                "sampling": sampling_s,
                "downstream": downstream_s,
            },
            "curve": self.ft.curve,
        }))
    }

    /// Per-trajectory membership scores: each trajectory's fragments' mean denoising loss
    /// (EMA weights, common noise).
    fn trajectory_scores(&self, trajs: &[Fragments]) -> anyhow::Result<Vec<f64>> {
        let Some(first) = trajs.first() else {
            return Ok(Vec::new());
        };
        let mut all = Fragments::empty(first.tdim, first.horizon);
        for t in trajs {
            all.extend(t)?;
        }
        let model = self.synth.model();
        let c = Tensor::from_slice(&all.cond, (all.len(), all.cond_dim()), &self.device)?;
        let net = Conditioned {
            net: model.net(),
            cond: &c,
        };
        let per_fragment = denoising_loss_scores(
            model.edm(),
            &net,
            model.ema_params(),
            &all.x,
            &AttackConfig::default(),
        )?;
        let mut out = Vec::with_capacity(trajs.len());
        let mut at = 0;
        for t in trajs {
            let k = t.len();
            out.push(per_fragment[at..at + k].iter().sum::<f64>() / k as f64);
            at += k;
        }
        Ok(out)
    }
}

impl ServerModel for TrajectoryModel {
    fn params(&self) -> &[f32] {
        &self.ft.offer
    }

    fn apply(&mut self, noisy_mean_gradient: &[f32]) -> Result<(), ModelError> {
        if self
            .ft
            .apply(&self.task, self.synth.model_mut(), noisy_mean_gradient)?
        {
            self.record_curve()
                .map_err(|e| ModelError::Other(e.to_string()))?;
        }
        Ok(())
    }

    fn diagnostics(&self) -> serde_json::Map<String, serde_json::Value> {
        Finetuning::diagnostics(&self.task, finetune_config(&self.task).train.lr)
    }

    fn state(&self) -> ModelState {
        self.ft.state("privorl-trajectory", self.synth.model())
    }

    fn restore(&mut self, state: ModelState) -> Result<(), ModelError> {
        let (online, ema, calls) = self.ft.restore(&state)?;
        let layout = *self.synth.layout();
        let model = FragmentModel::from_weights(
            &layout,
            &finetune_config(&self.task),
            self.task.model_seed,
            self.task.model_seed ^ RESTORE_STREAM,
            &self.device,
            online,
            Some((ema, calls)),
        )
        .map_err(|e| ModelError::Restore(e.to_string()))?;
        *self.synth.model_mut() = model;
        Ok(())
    }

    fn evaluate(&mut self, _round: u64) -> Option<serde_json::Value> {
        self.ft.evaluate()
    }

    fn final_evaluation(&mut self) -> Option<serde_json::Value> {
        Some(
            self.evaluate_release()
                .unwrap_or_else(|e| serde_json::json!({ "final_eval_error": format!("{e:#}") })),
        )
    }

    /// The membership-inference audit per trajectory: operator-only, since it scores the
    /// units' own episodes.
    fn operator_evaluation(&mut self) -> Option<serde_json::Value> {
        let (members, non_members) = &self.audit;
        if members.is_empty() {
            return None;
        }
        let t0 = Instant::now();
        let audit = self
            .trajectory_scores(members)
            .and_then(|m| Ok((m, self.trajectory_scores(non_members)?)))
            .and_then(|(m, n)| Ok(MembershipReport::new(&m, &n)?));
        Some(membership_json(
            audit.map_err(|e| format!("{e:#}")),
            Some("trajectory"),
            "white-box denoising loss (seed 003 section IX-D), EMA weights; a trajectory's score is its fragments' mean loss",
            t0,
        ))
    }

    /// Writes the synthetic trajectories into `dir/synthetic/<id>` (Minari's layout), or, with
    /// continuous actions, into `dir/synthetic/continuous/<name>.safetensors` (the project's
    /// continuous format).
    fn export(&self, dir: &Path) -> anyhow::Result<()> {
        let d = match &self.released {
            None => return Ok(()),
            Some(r @ Released::Continuous(d)) => {
                let id = r.id();
                let folder = dir.join(SYNTHETIC_DIR).join("continuous");
                std::fs::create_dir_all(&folder)?;
                d.save(&folder.join(format!(
                    "{}.safetensors",
                    id.trim_start_matches("continuous/")
                )))?;
                return Ok(());
            }
            Some(Released::Minari(d)) => d,
        };
        let target = minari::dataset_dir(&dir.join(SYNTHETIC_DIR), &d.id)?;
        if target.exists() {
            std::fs::remove_dir_all(&target)?;
        }
        std::fs::create_dir_all(&target)?;
        minari::write(
            d,
            &target,
            &minari::WriteOptions {
                algorithm_name: Some("PrivORL-j (fedrl)".into()),
                description: Some(
                    "DP synthetic trajectories generated fragment by fragment from a diffusion model fine-tuned by trajectory-level DP-SGD".into(),
                ),
                spec: Some(serde_json::json!({ "privorl": self.task })),
            },
        )?;
        Ok(())
    }
}

/// The released synthetic trajectories, in the format of their action space.
enum Released {
    /// Discrete actions: Minari's layout.
    Minari(Dataset),
    /// Continuous actions: the project's continuous format.
    Continuous(ContinuousDataset),
}

impl Released {
    /// The id `fedrl data list --data-dir OUT/synthetic` shows.
    fn id(&self) -> String {
        match self {
            Released::Minari(d) => d.id.clone(),
            Released::Continuous(d) => format!(
                "continuous/{}",
                fedrl_rl::offline::continuous::imported_name(&synthetic_id(&d.meta.env_id))
            ),
        }
    }
}

/// `k` distinct indices of `0..n` (all of them, in order, when `k >= n`).
fn sample(n: usize, k: usize, rng: &mut Xoshiro256PlusPlus) -> Vec<usize> {
    if k >= n {
        return (0..n).collect();
    }
    rand::seq::index::sample(rng, n, k).into_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use fedrl_rl::diffusion::trajectory::dp::norm_f64;
    use rand::RngExt;

    fn task() -> PrivorlTask {
        serde_json::from_value(serde_json::json!({
            "level": "trajectory",
            "trajectory": { "units": 3, "horizon": 8 },
            "dataset": { "env": "CartPole-v1", "units": 10 },
            "synth": { "width": 16, "blocks": 1, "dim_t": 8, "fourier_dim": 4 },
        }))
        .unwrap()
    }

    /// A made-up CartPole-shaped trajectory of `len` transitions, observations times `scale`,
    /// terminal at its end.
    fn trajectory(len: usize, seed: u64, scale: f32) -> TransitionBatch {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut b = TransitionBatch::new(4);
        let mut s: Vec<f32> = (0..4).map(|_| rng.random_range(-0.05f32..0.05)).collect();
        for t in 0..len {
            let next: Vec<f32> = s
                .iter()
                .map(|x| x + rng.random_range(-0.1f32..0.1))
                .collect();
            b.obs.extend(s.iter().map(|x| x * scale));
            b.next_obs.extend(next.iter().map(|x| x * scale));
            b.actions.push(rng.random_range(0..2u32));
            b.rewards.push(1.0);
            b.terminals.push(if t + 1 == len { 1.0 } else { 0.0 });
            s = next;
        }
        b
    }

    /// The task's central computation with a normaliser fitted on made-up public
    /// trajectories (no dataset cache needed), and its initial weights.
    fn central(task: &PrivorlTask) -> (TrajectoryCentral, Vec<f32>) {
        let layout = task.layout().unwrap();
        let mut public = Vec::new();
        for k in 0..10 {
            public.extend(
                layout
                    .encode(&Transitions::from(&trajectory(50, 100 + k, 1.0)))
                    .unwrap(),
            );
        }
        let public = PublicRows::new(layout.dim(), public).unwrap();
        let cfg = trajectory_config(task);
        let (net, init) = FragmentNet::new(
            &layout,
            cfg.horizon,
            &cfg.net,
            task.model_seed,
            &Device::Cpu,
        )
        .unwrap();
        (
            TrajectoryCentral {
                task: task.clone(),
                row: task.row_spec().unwrap(),
                layout,
                normalizer: Normalizer::fit_public(&layout, &public).unwrap(),
                net,
                cfg,
                max_unit_rows: 500,
            },
            init,
        )
    }

    fn diff_norm(a: &[f64], b: &[f64]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).powi(2))
            .sum::<f64>()
            .sqrt()
    }

    /// Issue 56's check "a trajectory's fragments make one clipped contribution (sensitivity
    /// per trajectory)", through the task's own computation (what the central aggregator and
    /// the federated agents run): a 100-transition trajectory has 13 fragments of 8 but gives
    /// one vector of norm at most C; adding it to, removing it from or scaling its data in a
    /// batch moves the sum by at most C (2C for a replacement), though its unclipped gradient
    /// is far larger.
    #[test]
    fn a_trajectory_is_one_contribution_of_sensitivity_c() {
        let task = task();
        let (c, offer) = central(&task);
        let (a, b) = (trajectory(100, 1, 1.0), trajectory(37, 2, 1.0));
        let scaled = trajectory(100, 1, 1000.0);
        assert_eq!(c.fragments(&a).unwrap().len(), 13);
        let clip = 0.05;
        let per = c
            .per_unit(&offer, &[(0, &a), (1, &b), (2, &scaled)], 3, clip)
            .unwrap();
        assert_eq!(per.len(), 3, "one contribution per trajectory");
        for (u, v) in &per {
            assert!(norm_f64(v) <= clip, "unit {u}: {}", norm_f64(v));
        }
        // Clipping binds: the unclipped gradients are much larger than C.
        let raw = c
            .per_unit(&offer, &[(0, &a), (2, &scaled)], 3, f64::INFINITY)
            .unwrap();
        assert!(norm_f64(&raw[0].1) > 10.0 * clip, "{}", norm_f64(&raw[0].1));
        assert!(norm_f64(&raw[1].1) > norm_f64(&raw[0].1));
        // A unit's contribution does not depend on the batch it is in.
        let alone = c.per_unit(&offer, &[(0, &a)], 3, clip).unwrap();
        assert_eq!(alone[0], per[0]);
        // Sums with and without trajectory 0, and with its data scaled 1000 times.
        let sum = |units: &[(UnitId, &TransitionBatch)]| c.summed(&offer, units, 3, clip).unwrap();
        let with = sum(&[(0, &a), (1, &b)]);
        let without = sum(&[(1, &b)]);
        let replaced = sum(&[(0, &scaled), (1, &b)]);
        let tol = 1.0 + 1e-9;
        assert!(diff_norm(&with.sum, &without.sum) <= clip * tol);
        assert!(diff_norm(&replaced.sum, &without.sum) <= clip * tol);
        assert!(diff_norm(&replaced.sum, &with.sum) <= 2.0 * clip * tol);
        assert!(
            diff_norm(&with.sum, &without.sum) > 0.9 * clip,
            "clipped to C"
        );
        // The summed path adds the per-unit vectors.
        let manual: Vec<f64> = per[0]
            .1
            .iter()
            .zip(&per[1].1)
            .map(|(x, y)| f64::from(*x) + f64::from(*y))
            .collect();
        assert!(diff_norm(&manual, &with.sum) < 1e-9);
        assert_eq!(with.norms.len(), 2);
        assert!(with.clip_factors.iter().all(|f| *f < 1.0));
    }

    #[test]
    fn the_spec_is_checked_at_trajectory_level() {
        use fedrl_common::task::TaskSpec;
        let t = task();
        assert!(t.check().is_ok());
        assert_eq!(t.unit_kind().to_string(), "trajectory");
        assert_eq!(t.central_summed_rows(), Some(1));
        let mut bad = t.clone();
        bad.trajectory.units = 0;
        assert!(bad.check().is_err());
        let mut bad = t.clone();
        bad.draws_per_unit = 4;
        assert!(bad.check().is_err());
        let mut tr = t.clone();
        tr.level = fedrl_common::task::privorl::PrivorlLevel::Transition;
        tr.synth.net = PrivorlNet::Transformer;
        assert!(tr.check().unwrap_err().to_string().contains("trajectory"));
        let mut tf = t;
        tf.synth.net = PrivorlNet::Transformer;
        tf.synth.transformer.heads = 3;
        assert!(tf.check().is_err(), "heads must divide width");
        tf.synth.transformer.heads = 4;
        assert!(tf.check().is_ok());
    }
}
