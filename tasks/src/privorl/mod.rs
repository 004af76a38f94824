//! PrivORL-n (seed 003): differentially private synthetic transitions from a diffusion model.
//! A synthesizer pre-trained on public data ([`pretrained`], cached beside the datasets), then
//! fine-tuned by DP-SGD where each transition of the sensitive dataset is a privacy unit: the
//! units' clipped EDM-loss gradients ([`client`] in the federated mode, [`PrivorlCentral`] in
//! the central one), the AdamW/EMA server model, the sampling of the released dataset and its
//! evaluation ([`server`]). Continuous-action data (`[task.continuous]`) go through the same
//! code, with their transitions packed for it and TD3+BC downstream ([`continuous`]).
//!
//! Invariants: the normaliser is fitted on the public data only and the Fourier frequencies
//! come from `model_seed`, so the client agents, the central computation and the server model
//! build the same network without seeing any unit; a unit's gradient depends on that unit's
//! transition and public numbers only (`fedrl_rl::diffusion::dp`).
//!
//! `level = "trajectory"` selects PrivORL-j instead (each episode a privacy unit, whole
//! trajectories generated): [`trajectory`], which the kind's hooks below dispatch to.

/// The kind's parameters: `spec.rs` in this folder, compiled into `fedrl-common` as
/// `fedrl_common::task::privorl` (its doc says why).
pub use fedrl_common::task::privorl as spec;

pub mod client;
pub mod continuous;
pub mod server;
pub mod trajectory;

pub use client::PrivorlTrainer;
pub use server::{PrivorlModel, SYNTHETIC_DIR};

use std::path::{Path, PathBuf};

use anyhow::Context;
use fedrl_common::protocol::{UnitId, UnitRange};
use fedrl_common::scenario::Scenario;
use fedrl_common::task::TaskError;
use fedrl_common::task::privorl::{PrivorlLevel, PrivorlSplit, PrivorlTask};
use fedrl_rl::candle_core::Device;
use fedrl_rl::diffusion::curiosity::{CuriosityConfig, EpochReport, PretrainConfig};
use fedrl_rl::diffusion::dp::{UnitRows, summed_unit_gradients, unit_gradients};
use fedrl_rl::diffusion::{
    ActionCoding, Denoiser, DenoiserConfig, DenoiserSpec, EdmConfig, Normalizer, PublicRows,
    SynthesizerConfig, TrainConfig, TransitionLayout, TransitionSynthesizer, Transitions,
};
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::dataset::Dataset;
use fedrl_rl::offline::per_example::SummedGradient;
use fedrl_rl::offline::qnet::QNetSpec;
use fedrl_rl::offline::train::{evaluate_greedy_for, train_cql};
use fedrl_sim::population::Population;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use crate::central::CentralGradients;
use crate::client::LocalTrainer;
use crate::registry::{TaskKind, model_error};
use crate::server::ServerModel;

/// The PrivORL kind in the registry.
pub struct Privorl;

impl TaskKind for Privorl {
    type Spec = PrivorlTask;

    fn dim(spec: &PrivorlTask) -> Result<usize, TaskError> {
        if spec.level == PrivorlLevel::Trajectory {
            return trajectory::dim(spec);
        }
        Ok(spec.denoiser_spec()?.num_params())
    }

    fn trainer(
        spec: &PrivorlTask,
        units: &[UnitRange],
        device: &Device,
    ) -> anyhow::Result<Box<dyn LocalTrainer>> {
        if spec.level == PrivorlLevel::Trajectory {
            return Ok(Box::new(trajectory::TrajectoryTrainer::trajectories(
                spec,
                units,
                device.clone(),
            )?));
        }
        Ok(Box::new(PrivorlTrainer::new(spec, units, device.clone())?))
    }

    fn server_model(
        spec: &PrivorlTask,
        scenario: &Scenario,
    ) -> anyhow::Result<Box<dyn ServerModel>> {
        let device = fedrl_rl::device::open(scenario.device).context("scenario device")?;
        if spec.level == PrivorlLevel::Trajectory {
            return Ok(Box::new(trajectory::TrajectoryModel::new(spec, device)?));
        }
        Ok(Box::new(PrivorlModel::new(spec, device)?))
    }

    fn transition_shape(spec: &PrivorlTask) -> Result<Option<(usize, u32)>, TaskError> {
        let q = spec.row_spec()?;
        Ok(Some((q.obs_dim, q.n_actions as u32)))
    }

    fn central(
        spec: &PrivorlTask,
        scenario: &Scenario,
    ) -> anyhow::Result<Option<Box<dyn CentralGradients>>> {
        if spec.mode != fedrl_common::offline::UpdateMode::Central {
            return Ok(None);
        }
        let device = fedrl_rl::device::open(scenario.device)?;
        let root = fedrl_rl::offline::data_root(None)?;
        if spec.level == PrivorlLevel::Trajectory {
            return Ok(Some(Box::new(trajectory::TrajectoryCentral::new(
                spec, &root, &device,
            )?)));
        }
        Ok(Some(Box::new(PrivorlCentral::new(spec, &root, &device)?)))
    }
}

/// The shapes a [`PrivorlTask`] builds for its environment.
pub trait PrivorlTaskExt {
    /// The observation size and action count of the dataset's environment (box observations,
    /// discrete actions), with the downstream CQL's hidden widths: the shape of a unit's
    /// transition on the data plane. Continuous actions: the packed shape (observations of
    /// `obs_dim + act_dim` values, one action; [`continuous::pack`]).
    fn row_spec(&self) -> Result<QNetSpec, TaskError>;
    /// `[s, one-hot a, r, s', done]` (continuous actions: `[s, a, r, s', done]`).
    fn layout(&self) -> Result<TransitionLayout, TaskError>;
    /// The denoiser for that layout.
    fn denoiser_spec(&self) -> Result<DenoiserSpec, TaskError>;
    /// The synthesizer's configuration (EDM and EMA at the library's, i.e. the paper's,
    /// defaults; the network, learning rate, batch and sampler steps from the task).
    fn synth_config(&self) -> SynthesizerConfig;
    /// The pre-training configuration.
    fn pretrain_config(&self) -> PretrainConfig;
}

impl PrivorlTaskExt for PrivorlTask {
    fn row_spec(&self) -> Result<QNetSpec, TaskError> {
        if let Some(c) = &self.continuous {
            let env = continuous::env_of(c)?;
            return Ok(QNetSpec {
                obs_dim: env.obs_dim + env.act_dim,
                hidden: self.utility.cql.hidden.clone(),
                n_actions: 1,
            });
        }
        let resolved = match &self.dataset {
            fedrl_common::offline::DatasetSource::Stored(s) => {
                crate::stored::resolve_if_present(s)?
            }
            fedrl_common::offline::DatasetSource::Generated(_) => None,
        };
        let (env_id, population_seed) = match &resolved {
            Some(r) => (r.env.clone(), 0),
            None => crate::stored::source_env(&self.dataset)?,
        };
        let env = Population::new(&env_id, population_seed)
            .and_then(|p| p.user_env(0))
            .map_err(|e| model_error("task.dataset.env", e))?;
        let obs_dim = match env.observation_space() {
            fedrl_sim::Space::Box { low, .. } => low.len(),
            other => {
                return Err(TaskError::Invalid(format!(
                    "task.dataset.env: PrivORL-n needs a box observation space, `{env_id}` has {other:?}"
                )));
            }
        };
        let n_actions = match env.action_space() {
            fedrl_sim::Space::Discrete { n } => *n,
            other => {
                return Err(TaskError::Invalid(format!(
                    "task.dataset.env: this PrivORL-n kind writes discrete-action datasets, `{env_id}` has {other:?}"
                )));
            }
        };
        if let (Some(r), fedrl_common::offline::DatasetSource::Stored(s)) =
            (&resolved, &self.dataset)
        {
            crate::stored::check_discrete(r, &s.name, "privorl", obs_dim, n_actions)?;
        }
        Ok(QNetSpec {
            obs_dim,
            hidden: self.utility.cql.hidden.clone(),
            n_actions,
        })
    }

    fn layout(&self) -> Result<TransitionLayout, TaskError> {
        if let Some(c) = &self.continuous {
            return Ok(continuous::layout(&continuous::env_of(c)?));
        }
        let q = self.row_spec()?;
        Ok(TransitionLayout {
            obs_dim: q.obs_dim,
            action: ActionCoding::Discrete { n: q.n_actions },
            model_terminal: true,
        })
    }

    fn denoiser_spec(&self) -> Result<DenoiserSpec, TaskError> {
        Ok(DenoiserSpec {
            data_dim: self.layout()?.dim(),
            config: self.synth_config().denoiser,
        })
    }

    fn synth_config(&self) -> SynthesizerConfig {
        let s = &self.synth;
        SynthesizerConfig {
            denoiser: DenoiserConfig {
                width: s.width,
                blocks: s.blocks,
                dim_t: s.dim_t,
                fourier_dim: s.fourier_dim,
            },
            edm: EdmConfig {
                sample_steps: s.sample_steps,
                ..EdmConfig::default()
            },
            train: TrainConfig {
                lr: s.lr,
                batch_size: s.batch_size,
                ..TrainConfig::default()
            },
        }
    }

    fn pretrain_config(&self) -> PretrainConfig {
        let p = &self.pretrain;
        PretrainConfig {
            epochs: p.epochs,
            curiosity: CuriosityConfig {
                enabled: p.curiosity,
                rate: p.curiosity_rate,
                pool_size: p.pool_size,
                refresh_every_epochs: p.refresh_every_epochs,
                ..CuriosityConfig::default()
            },
        }
    }
}

/// `b`'s transitions as the synthesizer encodes them: discrete ones as they are, continuous ones
/// unpacked ([`continuous::unpack`]).
pub fn batch_transitions(
    layout: &TransitionLayout,
    b: &TransitionBatch,
) -> fedrl_rl::Result<Transitions> {
    match layout.action {
        ActionCoding::Discrete { .. } => Ok(Transitions::from(b)),
        ActionCoding::Continuous { .. } => continuous::unpack(b, layout.obs_dim),
    }
}

/// The environment the utility is evaluated in (and the release is named after).
pub fn eval_env(task: &PrivorlTask) -> Result<String, TaskError> {
    let env = match &task.continuous {
        Some(c) => c.dataset.env.clone(),
        None => crate::stored::source_env(&task.dataset)?.0,
    };
    // A stored dataset recorded through the Gymnasium bridge (generation specs are refused at
    // load, `PrivorlTask::check`): the aggregator, where the utility runs, has no Python.
    if env.starts_with(fedrl_common::offline::GYMNASIUM_PREFIX) {
        return Err(TaskError::Invalid(format!(
            "the sensitive dataset was recorded in {env}: PrivORL evaluates its release's utility \
             in the aggregator, which runs no Python; use a dataset of one of fedrl's own \
             environments"
        )));
    }
    Ok(env)
}

/// The sensitive dataset's units and held-out transitions ([`split_sensitive`], or
/// [`continuous::load_sensitive`] packed), loaded from the cache under `root` (generated there
/// when missing).
pub fn load_sensitive(
    task: &PrivorlTask,
    root: &Path,
) -> anyhow::Result<(TransitionBatch, TransitionBatch)> {
    if let Some(c) = &task.continuous {
        return continuous::load_sensitive(task, c, root);
    }
    let (dataset, _) =
        fedrl_rl::offline::load_source_units(&task.dataset, root, &mut |_| {}, &|_| true)
            .with_context(|| format!("loading the task's dataset under {}", root.display()))?;
    split_sensitive(task, &dataset)
}

/// A dataset's transitions in episode order (episodes sorted by id).
pub fn transitions_in_order(d: &Dataset) -> TransitionBatch {
    let mut eps: Vec<&fedrl_rl::offline::Episode> = d.episodes.iter().collect();
    eps.sort_by_key(|e| e.id);
    let mut out = TransitionBatch::new(d.obs_dim);
    for e in eps {
        e.push_transitions(&mut out);
    }
    out
}

/// The public rows (encoded, not normalised) of the task's public dataset, loaded from the
/// cache under `root` (generated there first if missing), at most `public_transitions`.
pub fn public_rows(task: &PrivorlTask, root: &Path) -> anyhow::Result<PublicRows> {
    if let Some(c) = &task.continuous {
        return continuous::public_rows(task, c, root);
    }
    let layout = task.layout()?;
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
    let mut b = transitions_in_order(&d);
    if task.public_transitions > 0 && (b.len() as u64) > task.public_transitions {
        let rows: Vec<usize> = (0..task.public_transitions as usize).collect();
        b = b.select(&rows);
    }
    let rows = layout.encode(&Transitions::from(&b))?;
    Ok(PublicRows::new(layout.dim(), rows)?)
}

/// The sensitive dataset's units and held-out transitions ([`split_transitions`] of its
/// transitions in episode order).
pub fn split_sensitive(
    task: &PrivorlTask,
    d: &Dataset,
) -> anyhow::Result<(TransitionBatch, TransitionBatch)> {
    let mut eps: Vec<&fedrl_rl::offline::Episode> = d.episodes.iter().collect();
    eps.sort_by_key(|e| e.id);
    let mut ends = Vec::with_capacity(eps.len());
    let mut total = 0;
    for e in &eps {
        total += e.actions.len();
        ends.push(total);
    }
    let mut fetch = |k: usize| {
        let mut b = TransitionBatch::new(d.obs_dim);
        eps[k].push_transitions(&mut b);
        Ok(b)
    };
    split_transitions(
        task,
        &ends,
        d.obs_dim,
        &mut fetch,
        &d.id,
        "task.dataset.units",
    )
}

/// Splits a sensitive dataset's transitions in episode order (episode `k` ends before row
/// `ends[k]`; `fetch(k)` gives its transitions, rows of `obs_dim`) into the units
/// (`task.transitions` rows, unit `i` = row `i` of the result) and at most `task.holdout()`
/// held-out rows, as `task.split` says ([`PrivorlSplit`]). Only the episodes holding a chosen
/// row are fetched. `name` and `raise` (the field that adds data) make the error when there
/// are too few.
pub fn split_transitions(
    task: &PrivorlTask,
    ends: &[usize],
    obs_dim: usize,
    fetch: &mut dyn FnMut(usize) -> anyhow::Result<TransitionBatch>,
    name: &str,
    raise: &str,
) -> anyhow::Result<(TransitionBatch, TransitionBatch)> {
    let n = task.transitions as usize;
    let want = task.holdout() as usize;
    let total = ends.last().copied().unwrap_or(0);
    if total < n {
        anyhow::bail!(
            "the sensitive dataset {name} holds {total} transitions, fewer than task.transitions = {n}: raise {raise}"
        );
    }
    let order: Vec<usize> = match task.split {
        PrivorlSplit::Shuffled => {
            // Fisher-Yates from the task's data seed (its own stream).
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(task.data_seed ^ 0x7370_6c69_745f_7472);
            let mut p: Vec<usize> = (0..total).collect();
            for i in (1..p.len()).rev() {
                let j = rng.random_range(0..=i);
                p.swap(i, j);
            }
            p.truncate(n + want.min(total - n));
            p
        }
        PrivorlSplit::Episodes => {
            // The held-out rows start at the first episode after the one holding the last unit.
            let from = ends.iter().copied().find(|&e| e >= n).unwrap_or(total);
            (0..n)
                .chain(from..total.min(from.saturating_add(want)))
                .collect()
        }
    };
    // Gather the chosen rows episode by episode, then put them in `order`'s order.
    let mut by_row: Vec<(usize, usize)> = order.iter().copied().zip(0..).collect();
    by_row.sort_unstable();
    let mut gathered = TransitionBatch::new(obs_dim);
    let mut at = vec![0usize; order.len()];
    let mut k = 0;
    let mut i = 0;
    while i < by_row.len() {
        while ends[k] <= by_row[i].0 {
            k += 1;
        }
        let start = if k == 0 { 0 } else { ends[k - 1] };
        let ep = fetch(k)?;
        let mut rows = Vec::new();
        while i < by_row.len() && by_row[i].0 < ends[k] {
            at[by_row[i].1] = gathered.len() + rows.len();
            rows.push(by_row[i].0 - start);
            i += 1;
        }
        gathered.extend_from(&ep.select(&rows));
    }
    Ok((gathered.select(&at[..n]), gathered.select(&at[n..])))
}

/// Where the pre-trained synthesizer of `task` is cached under the data root: keyed by
/// everything pre-training reads (public data, network, pre-training settings, seed), so twins
/// that differ only in their fine-tuning share it. Public data only: no unit is involved.
pub fn pretrained_path(task: &PrivorlTask, root: &Path) -> anyhow::Result<PathBuf> {
    let mut key = serde_json::json!({
        "public": task.public,
        "public_transitions": task.public_transitions,
        "layout": task.layout()?,
        "synth": task.synth_config(),
        "pretrain": task.pretrain_config(),
        "model_seed": task.model_seed,
        "version": 1,
    });
    // Only when set, so the discrete tasks' keys (and caches) stay as they were.
    if let Some(c) = &task.continuous {
        key["continuous_public"] = serde_json::to_value(&c.public)?;
    }
    let text = serde_json::to_string(&key)?;
    let digest = fnv1a(text.as_bytes());
    Ok(root
        .join("privorl-pretrained")
        .join(format!("{digest:016x}.safetensors")))
}

/// FNV-1a 64 of `bytes` (a cache key, not a security property).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The synthesizer fine-tuning starts from: the cached pre-trained one (pre-trained here and
/// cached when missing, reporting each epoch through `on_epoch`), or, with pre-training off, a
/// fresh one whose normaliser is fitted on the public data. Its EMA restarts from its weights.
pub fn pretrained(
    task: &PrivorlTask,
    root: &Path,
    device: &Device,
    on_epoch: &mut dyn FnMut(&EpochReport),
) -> anyhow::Result<(TransitionSynthesizer, Option<Vec<EpochReport>>)> {
    let layout = task.layout()?;
    let public = public_rows(task, root)?;
    if !task.pretrain.enabled {
        let s = TransitionSynthesizer::new(
            layout,
            &public,
            task.synth_config(),
            task.model_seed,
            device,
        )?;
        return Ok((s, None));
    }
    let path = pretrained_path(task, root)?;
    if let Ok(bytes) = std::fs::read(&path) {
        let s = TransitionSynthesizer::from_bytes(&bytes, task.model_seed, device)
            .with_context(|| format!("reading the pre-trained synthesizer {}", path.display()))?;
        return Ok((s, None));
    }
    let mut s = TransitionSynthesizer::new(
        layout,
        &public,
        task.synth_config(),
        task.model_seed,
        device,
    )?;
    let reports = fedrl_rl::diffusion::pretrain(
        &mut s,
        &public,
        &task.pretrain_config(),
        task.model_seed,
        on_epoch,
    )?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, s.to_bytes()?)?;
    std::fs::rename(&tmp, &path)?;
    Ok((s, Some(reports)))
}

/// The per-unit computation shared by both modes: the network built from public numbers (the
/// Fourier frequencies of `model_seed`, the public normaliser) and the units' noise draws.
pub struct PrivorlCentral {
    task: PrivorlTask,
    row: QNetSpec,
    layout: TransitionLayout,
    normalizer: Normalizer,
    net: Denoiser,
    edm: EdmConfig,
}

impl PrivorlCentral {
    /// Builds the network on `device`; the public data is read from the cache under `root`.
    pub fn new(task: &PrivorlTask, root: &Path, device: &Device) -> anyhow::Result<Self> {
        let layout = task.layout()?;
        let public = public_rows(task, root)?;
        let normalizer = Normalizer::fit_public(&layout, &public)?;
        let spec = task.denoiser_spec()?;
        let (_, freqs) = spec.init(task.model_seed)?;
        Ok(PrivorlCentral {
            task: task.clone(),
            row: task.row_spec()?,
            layout,
            normalizer,
            net: Denoiser::new(spec, &freqs, device)?,
            edm: task.synth_config().edm,
        })
    }

    /// Normalised encoded rows of every unit (the same encoding as the server's).
    fn rows(&self, units: &[(UnitId, &TransitionBatch)]) -> fedrl_rl::Result<Vec<Vec<f32>>> {
        units
            .iter()
            .map(|(_, b)| {
                if b.is_empty() {
                    return Ok(Vec::new());
                }
                let mut r = self.layout.encode(&batch_transitions(&self.layout, b)?)?;
                self.normalizer.normalize(&mut r);
                Ok(r)
            })
            .collect()
    }
}

impl CentralGradients for PrivorlCentral {
    fn row_spec(&self) -> &QNetSpec {
        &self.row
    }

    /// A unit is one transition.
    fn max_unit_rows(&self) -> u64 {
        1
    }

    fn summed(
        &self,
        offer: &[f32],
        units: &[(UnitId, &TransitionBatch)],
        round: u64,
        clip_norm: f64,
    ) -> fedrl_rl::Result<SummedGradient> {
        let rows = self.rows(units)?;
        let ur: Vec<UnitRows> = units
            .iter()
            .zip(&rows)
            .map(|((u, _), r)| UnitRows { unit: *u, rows: r })
            .collect();
        summed_unit_gradients(
            &self.net,
            &self.edm,
            offer,
            &ur,
            round,
            self.task.data_seed,
            self.task.draws_per_unit,
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
        let rows = self.rows(units)?;
        let ur: Vec<UnitRows> = units
            .iter()
            .zip(&rows)
            .map(|((u, _), r)| UnitRows { unit: *u, rows: r })
            .collect();
        unit_gradients(
            &self.net,
            &self.edm,
            offer,
            &ur,
            round,
            self.task.data_seed,
            self.task.draws_per_unit,
            clip_norm,
        )
    }
}

/// The downstream evaluation of a released synthetic dataset, at either level: the task's
/// learner trained on it alone and, when `task.utility.reference`, on as much held-out real
/// data; random actions' return for continuous control; the share of the reference.
pub(crate) struct Downstream {
    pub on_synthetic: serde_json::Value,
    pub reference: Option<serde_json::Value>,
    /// Continuous control: uniformly random actions' return on the same episodes.
    pub random: Option<f64>,
    /// `100 (R_syn - R_0) / (R_real - R_0)`, `R_0` the random return for continuous control
    /// (Pendulum's returns are negative; D4RL normalises the same way), else 0.
    pub percent: Option<f64>,
    /// Wall-clock seconds of all of it.
    pub seconds: f64,
}

/// [`Downstream`] of `synthetic` against the held-out `real` transitions.
pub(crate) fn downstream(
    task: &PrivorlTask,
    synthetic: &TransitionBatch,
    real: &TransitionBatch,
) -> anyhow::Result<Downstream> {
    let t0 = std::time::Instant::now();
    let on_synthetic = utility(task, synthetic, "synthetic")?;
    let reference = if task.utility.reference {
        Some(utility(task, real, "held-out real")?)
    } else {
        None
    };
    let random = match &task.continuous {
        Some(c) => Some(continuous::random_return(task, &continuous::env_of(c)?)?),
        None => None,
    };
    let zero = random.unwrap_or(0.0);
    let syn = on_synthetic["return"].as_f64().unwrap_or(f64::NAN);
    let percent = reference
        .as_ref()
        .and_then(|r| r["return"].as_f64())
        .map(|r| 100.0 * (syn - zero) / (r - zero));
    Ok(Downstream {
        on_synthetic,
        reference,
        random,
        percent,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Trains the downstream learner on `data` and evaluates it greedily: TD3+BC for continuous
/// actions ([`continuous::td3bc_utility`]), else discrete CQL.
pub(crate) fn utility(
    task: &PrivorlTask,
    data: &TransitionBatch,
    what: &str,
) -> anyhow::Result<serde_json::Value> {
    if let Some(c) = &task.continuous {
        return continuous::td3bc_utility(task, &continuous::env_of(c)?, data, what);
    }
    let u = &task.utility;
    let spec: QNetSpec = task.row_spec()?;
    let t0 = std::time::Instant::now();
    let every = (u.steps / 5).max(1);
    let mut per_seed = Vec::with_capacity(u.seeds as usize);
    let mut all = Vec::new();
    for i in 0..u.seeds {
        let params = train_cql(
            &spec,
            &u.cql,
            data,
            u.steps,
            u.cql.model_seed.wrapping_add(i),
            &Device::Cpu,
            &mut |step, loss| {
                if step % every == 0 {
                    eprintln!(
                        "privorl: CQL {}/{} on {what} data, step {step}/{}: loss {loss:.4}",
                        i + 1,
                        u.seeds,
                        u.steps
                    );
                }
            },
        )?;
        let r = evaluate_greedy_for(
            &spec,
            &params,
            &eval_env(task)?,
            u.eval_episodes,
            u.eval_seed,
            u.eval_max_steps,
        )?;
        per_seed.push(r.mean);
        all.extend(r.returns);
    }
    let mean = per_seed.iter().sum::<f64>() / per_seed.len() as f64;
    let sd = |v: &[f64], m: f64| {
        if v.len() < 2 {
            0.0
        } else {
            (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
        }
    };
    Ok(serde_json::json!({
        "return": mean,
        "return_per_seed": per_seed,
        "return_sd_over_seeds": sd(&per_seed, mean),
        "return_std": sd(&all, mean),
        "cql_seeds": u.seeds,
        "episodes": all.len(),
        "transitions": data.len(),
        "seconds": t0.elapsed().as_secs_f64(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three episodes of 4, 3 and 5 transitions; row `r`'s reward is `r` (so rows can be told
    /// apart after the split).
    fn episodes() -> (Vec<usize>, Vec<TransitionBatch>) {
        let lens = [4usize, 3, 5];
        let mut r = 0;
        let mut eps = Vec::new();
        let mut ends = Vec::new();
        for len in lens {
            let mut b = TransitionBatch::new(1);
            for _ in 0..len {
                b.obs.push(r as f32);
                b.next_obs.push(r as f32 + 0.5);
                b.actions.push(0);
                b.rewards.push(r as f32);
                b.terminals.push(0.0);
                r += 1;
            }
            eps.push(b);
            ends.push(r);
        }
        (ends, eps)
    }

    fn split(
        split: PrivorlSplit,
        n: u64,
        holdout: u64,
        seed: u64,
    ) -> (Vec<f32>, Vec<f32>, Vec<usize>) {
        let task: PrivorlTask = serde_json::from_value(serde_json::json!({})).unwrap();
        let task = PrivorlTask {
            split,
            transitions: n,
            holdout_transitions: holdout,
            data_seed: seed,
            ..task
        };
        let (ends, eps) = episodes();
        let mut fetched = Vec::new();
        let mut fetch = |k: usize| {
            fetched.push(k);
            Ok(eps[k].clone())
        };
        let (u, h) = split_transitions(&task, &ends, 1, &mut fetch, "test", "units").unwrap();
        assert_eq!(u.obs, u.rewards, "rows stay whole");
        assert_eq!(h.obs, h.rewards, "rows stay whole");
        (u.rewards, h.rewards, fetched)
    }

    #[test]
    fn the_episode_split_holds_out_the_episodes_after_the_units() {
        // 5 units end inside episode 1: the held-out rows start at episode 2 (row 7).
        let (u, h, fetched) = split(PrivorlSplit::Episodes, 5, 3, 0);
        assert_eq!(u, vec![0.0, 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(h, vec![7.0, 8.0, 9.0]);
        assert_eq!(fetched, vec![0, 1, 2], "each episode fetched once");
        // More held-out rows wanted than remain: what remains.
        let (_, h, _) = split(PrivorlSplit::Episodes, 5, 10, 0);
        assert_eq!(h, vec![7.0, 8.0, 9.0, 10.0, 11.0]);
    }

    #[test]
    fn the_shuffled_split_draws_disjoint_rows_from_every_episode_by_seed() {
        let (u, h, fetched) = split(PrivorlSplit::Shuffled, 6, 6, 3);
        assert_eq!((u.len(), h.len()), (6, 6));
        let mut all: Vec<f32> = u.iter().chain(&h).copied().collect();
        all.sort_by(f32::total_cmp);
        assert_eq!(
            all,
            (0..12).map(|r| r as f32).collect::<Vec<_>>(),
            "disjoint"
        );
        assert!(
            u != vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
            "not the episode order"
        );
        assert_eq!(fetched, vec![0, 1, 2], "each episode fetched once");
        // The same seed gives the same split; another seed another one.
        assert_eq!(split(PrivorlSplit::Shuffled, 6, 6, 3).0, u);
        let others: Vec<Vec<f32>> = (4..8)
            .map(|s| split(PrivorlSplit::Shuffled, 6, 6, s).0)
            .collect();
        assert!(others.iter().any(|o| *o != u));
        // Too few transitions: an error naming the field to raise.
        let task: PrivorlTask =
            serde_json::from_value(serde_json::json!({"transitions": 13})).unwrap();
        let (ends, eps) = episodes();
        let err = split_transitions(
            &task,
            &ends,
            1,
            &mut |k| Ok(eps[k].clone()),
            "d",
            "task.dataset.units",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("12 transitions") && err.contains("task.dataset.units"),
            "{err}"
        );
    }
}
