//! PrivORL-n's parameters ([`Task::Privorl`]): DP synthetic offline-RL transitions (seed 003,
//! sections IV-V).
//!
//! This is the kind's spec: plain serde data, checked without a model. It sits in the kind's
//! folder with the rest of the kind, but `common/src/task.rs` compiles it into `fedrl-common`
//! (as `fedrl_common::task::privorl`): `Task`, which the protocol, the scenario loader and the
//! engine read without candle, names it. So `crate` here is `fedrl_common`. Adding a kind:
//! docs/adding-a-task-kind.md.
//!
//! The run: (1) the aggregator pre-trains the diffusion synthesizer on the **public** dataset
//! (`public`, e.g. CartPole variants of another physics), with curiosity unless switched off;
//! (2) every round is one DP-SGD fine-tuning step on the **sensitive** dataset, in which each of
//! the first `transitions` transitions of `dataset` is a privacy unit: the aggregator
//! Poisson-samples units, each sampled unit's gradient of its own EDM loss (its own noise
//! levels and noise draws) is clipped to the scenario's `clip_norm`, the engine sums, adds the
//! noise, divides by the expected batch and the server takes one AdamW step (EMA updated);
//! (3) the EMA weights are sampled into the synthetic dataset, which is released with the
//! run's epsilon and delta; (4) it is evaluated: fidelity against held-out real transitions
//! and the utility of discrete CQL trained on it alone.
//!
//! Continuous control (`[task.continuous]`): the sensitive and public datasets are Box-action
//! datasets of the project's continuous format (the generation specs PriMORL's scenarios use),
//! actions are coded as their values, the release is written in that format, and the downstream
//! learner is TD3+BC (`[task.utility.td3bc]`) instead of discrete CQL.

use serde::{Deserialize, Serialize};

use crate::privacy::ledger::UnitKind;
use crate::task::{TaskError, TaskSpec};
// Named by the docs only.
#[cfg(doc)]
use crate::task::Task;

/// Parameters of [`Task::Privorl`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrivorlTask {
    /// The sensitive dataset: a generation spec (generated or loaded from the cache by every
    /// client agent), or a stored dataset by name with `units = "transition"` (the only
    /// mapping PrivORL-n's single-transition contributions honour). Its first `transitions`
    /// transitions, in episode order, are the privacy units; transitions of the episodes after
    /// the one holding the last unit are the held-out real data.
    #[serde(default)]
    pub dataset: crate::offline::DatasetSource,
    /// Privacy units: the first `transitions` transitions of `dataset` (the scenario's `users`
    /// must equal it). Default 10,000.
    #[serde(default = "d_transitions")]
    pub transitions: u64,
    /// Held-out real transitions (fidelity, and the reference CQL trained on real data); 0
    /// (default): as many as `transitions`.
    #[serde(default)]
    pub holdout_transitions: u64,
    /// The public dataset of the same domain (pre-training and the normaliser).
    #[serde(default = "d_public")]
    pub public: crate::offline::DatasetSpec,
    /// At most this many public transitions are used (0: all). Default 0.
    #[serde(default)]
    pub public_transitions: u64,
    /// Continuous-action (Box) data instead of `dataset` and `public` (which must then be left
    /// unset): both datasets are generation specs of the project's continuous format.
    #[serde(default)]
    pub continuous: Option<PrivorlContinuous>,
    /// `federated` or `central` (default; DESIGN §2.5).
    #[serde(default = "d_central")]
    pub mode: crate::offline::UpdateMode,
    /// Central mode only: `summed` (default) or `per_unit`.
    #[serde(default)]
    pub central_path: crate::offline::CentralPath,
    /// The synthesizer's network and training.
    #[serde(default)]
    pub synth: PrivorlSynth,
    /// Pre-training on the public data (off: the "no pre-training" ablation).
    #[serde(default)]
    pub pretrain: PrivorlPretrain,
    /// Off: the rounds' released gradients are not applied (the "pre-training only" ablation;
    /// its scenario runs one round, accounted as any other). Default true.
    #[serde(default = "d_true")]
    pub finetune: bool,
    /// AdamW learning rate of the DP fine-tuning; absent: `synth.lr` (pre-training's).
    #[serde(default)]
    pub finetune_lr: Option<f64>,
    /// Noise draws `(sigma, n)` per unit and step; the unit's gradient is the mean over them.
    /// Default 1.
    #[serde(default = "d_one_u32")]
    pub draws_per_unit: u32,
    /// How PrivORL-n's units and held-out transitions are drawn from the sensitive dataset:
    /// `shuffled` (default) or `episodes` ([`PrivorlSplit`]). PrivORL-j always splits by
    /// episode (its units are episodes).
    #[serde(default)]
    pub split: PrivorlSplit,
    /// Seed of the units' noise draws (not privacy noise) and of the `shuffled` split.
    /// Default 0.
    #[serde(default)]
    pub data_seed: u64,
    /// Seed of the initial weights, pre-training and sampling. Default 0.
    #[serde(default)]
    pub model_seed: u64,
    /// Synthetic transitions sampled and released; 0 (default): as many as `transitions`.
    #[serde(default)]
    pub synthetic_transitions: u64,
    /// Entries of a transition (observation, continuous action, reward) whose public data
    /// takes at most this many distinct values are released as the nearest of those values,
    /// as one-hot actions and terminal flags are decoded to theirs (CartPole's reward is
    /// always 1: without it the release holds values around 1). Public data only, so it costs
    /// no privacy; it assumes the sensitive data's values of such an entry lie in the public
    /// ones (same domain). 0 turns it off. Default 8.
    #[serde(default = "d_snap_public_values")]
    pub snap_public_values: usize,
    /// Held-out denoising loss of the EMA weights every K fine-tuning steps (the curve).
    /// Default 50.
    #[serde(default = "d_eval_every")]
    pub eval_every: u64,
    /// The downstream learner.
    #[serde(default)]
    pub utility: PrivorlUtility,
    /// The operator-only empirical privacy audit at the end of the run.
    #[serde(default)]
    pub audit: PrivorlAudit,
    /// The privacy unit: `transition` (default, PrivORL-n: the fields above) or `trajectory`
    /// (PrivORL-j, seed 003 section VI: each episode of `dataset` is a unit, the synthesizer
    /// generates whole trajectories; its settings in [`PrivorlTask::trajectory`]).
    #[serde(default)]
    pub level: PrivorlLevel,
    /// PrivORL-j's settings (read at `level = "trajectory"` only).
    #[serde(default)]
    pub trajectory: PrivorlTrajectory,
}

/// Which of the sensitive dataset's transitions are PrivORL-n's units and which are held out
/// (the fidelity's and the reference learner's real data, the audit's non-members).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrivorlSplit {
    /// The seed's protocol (appendix D: the trajectories are decomposed into transitions, a
    /// random subset is the fine-tuning data, the transitions being treated as contributed by
    /// distinct users): the dataset's transitions are permuted (seeded by `data_seed`), the
    /// first `transitions` are the units (unit `i` = the `i`-th of the permutation) and the
    /// next `holdout_transitions` are held out. Units and held-out data come from the same
    /// distribution, so a faithful synthesizer scores near the real data's own fidelity.
    #[default]
    Shuffled,
    /// The units are the first `transitions` transitions in episode order, the held-out ones
    /// come from the episodes after: no held-out transition shares an episode with a unit.
    /// With few episodes this measures the episodes' own spread too: at 5,000 CartPole
    /// transitions (about 19 episodes each side) the real units score only 0.80-0.88 against
    /// the held-out data on the cart's position, velocity and the pole's angle.
    Episodes,
}

/// What one privacy unit of the fine-tuning is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrivorlLevel {
    /// PrivORL-n: one transition (the scenario's `unit_kind = "transition"`).
    #[default]
    Transition,
    /// PrivORL-j: one episode of the sensitive dataset (`unit_kind = "trajectory"`). Each
    /// sampled trajectory contributes the mean EDM-loss gradient of up to `max_fragments` of
    /// its fragments, clipped once to the scenario's `clip_norm`, so its sensitivity is `C`
    /// however long it is.
    Trajectory,
}

/// PrivORL-j's trajectory settings (seed 003 section VI). The units are the first `units`
/// episodes of the sensitive dataset (in episode order); the held-out real data are the
/// `holdout` episodes after them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrivorlTrajectory {
    /// Privacy units: trajectories (the scenario's `users` must equal it). Default 0: must be
    /// set at trajectory level.
    pub units: u64,
    /// Held-out real episodes (fidelity, reference CQL, membership non-members); 0 (default):
    /// as many as `units`.
    pub holdout: u64,
    /// Synthetic trajectories generated and released; 0 (default): as many as `units`.
    pub synthetic: u64,
    /// Transitions per fragment `H`. Default 64 (the authors' `horizon`).
    pub horizon: usize,
    /// Most fragments of one trajectory in its contribution per step. Default 32 (section
    /// VI-B).
    pub max_fragments: usize,
    /// Most transitions of a generated trajectory (generation also stops at a terminal); 0
    /// (default): the environment's step limit.
    pub max_length: u64,
}

impl Default for PrivorlTrajectory {
    fn default() -> Self {
        PrivorlTrajectory {
            units: 0,
            holdout: 0,
            synthetic: 0,
            horizon: 64,
            max_fragments: 32,
            max_length: 0,
        }
    }
}

/// The fragment denoiser of PrivORL-j (`synth.net`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrivorlNet {
    /// The conditional residual MLP (`width`, `blocks`, `dim_t`, `fourier_dim` of
    /// [`PrivorlSynth`]): the CPU default, the paper's PrivORL-j-U-style baseline. The only
    /// network at transition level.
    #[default]
    Mlp,
    /// The paper's transformer denoiser (sizes in `synth.transformer`): about 1.5 GFLOP per
    /// 64-transition fragment and network call, a GPU scenario (`--device cuda:0`).
    Transformer,
}

/// The transformer's sizes (defaults: the paper's, appendix F-A).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrivorlTransformer {
    /// Token width. Default 256.
    pub width: usize,
    /// Encoder layers. Default 6.
    pub layers: usize,
    /// Attention heads (divides `width`). Default 4.
    pub heads: usize,
    /// Feed-forward width as a multiple of `width`. Default 4.
    pub ff_mult: usize,
}

impl Default for PrivorlTransformer {
    fn default() -> Self {
        PrivorlTransformer {
            width: 256,
            layers: 6,
            heads: 4,
            ff_mult: 4,
        }
    }
}

/// PrivORL-n on continuous control: the sensitive and the public dataset as continuous-format
/// generation specs (`fedrl_rl::offline::continuous`; the same specs as PriMORL's
/// `[task.dataset]`, so a dataset generated for one is reused by the other from the cache).
/// The sensitive dataset's episodes, in unit order, give the units and the held-out data as
/// `dataset` does; all episodes of the public one (its public split included) are public data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrivorlContinuous {
    /// The sensitive dataset (an environment id with Box actions: the utility is evaluated in
    /// it).
    pub dataset: crate::task::primorl::ContinuousDatasetSpec,
    /// The public dataset of the same domain: an environment id or a population of the same
    /// observation and action shapes (`pendulum-gml`: Pendulum with other gravity, mass and
    /// length).
    pub public: crate::task::primorl::ContinuousDatasetSpec,
}

/// Seed 003 section IX-D's membership-inference audit of the fine-tuned synthesizer
/// (`fedrl_rl::audit::membership`): the white-box denoising-loss attack on the EMA weights (the
/// released samples' model), `rows` fine-tuning units' transitions (members) against as many
/// held-out real transitions (non-members). It reads the units' own transitions, so its result
/// is operator-only (`operator/report.json`, `model_audit.membership`): an audit of the
/// guarantee, not a release.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrivorlAudit {
    /// Members and non-members scored (each; trajectories at `level = "trajectory"`, each
    /// scored by its fragments' mean denoising loss); 0 turns the audit off. Default (unset): 1,000 in
    /// the central mode, where the aggregator holds the units' data anyway, and off in the
    /// federated mode, where the units' transitions live on the client agents and the audit
    /// would read them from the dataset file on the aggregator's machine (an emulation-only
    /// check: set it explicitly).
    pub membership_rows: Option<u64>,
}

/// The denoiser and its optimiser (defaults: the CPU size; the paper's is width 1024, 6
/// blocks, meant for `--device cuda:0`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrivorlSynth {
    /// Width of the residual blocks. Default 256.
    pub width: usize,
    /// Residual blocks. Default 4.
    pub blocks: usize,
    /// Width of the input projection and time embedding. Default 128.
    pub dim_t: usize,
    /// Random Fourier features (even). Default 16.
    pub fourier_dim: usize,
    /// AdamW learning rate of pre-training and fine-tuning. Default 3e-4.
    pub lr: f64,
    /// Pre-training batch rows. Default 128.
    pub batch_size: usize,
    /// Heun steps of the sampler. Default 128.
    pub sample_steps: usize,
    /// PrivORL-j's fragment denoiser: `mlp` (default) or `transformer`.
    pub net: PrivorlNet,
    /// The transformer's sizes (`net = "transformer"`).
    pub transformer: PrivorlTransformer,
}

impl Default for PrivorlSynth {
    fn default() -> Self {
        PrivorlSynth {
            width: 256,
            blocks: 4,
            dim_t: 128,
            fourier_dim: 16,
            lr: 3e-4,
            batch_size: 128,
            sample_steps: 128,
            net: PrivorlNet::Mlp,
            transformer: PrivorlTransformer::default(),
        }
    }
}

/// Curiosity-driven pre-training on the public data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrivorlPretrain {
    /// Off: fine-tuning starts from random weights. Default true.
    pub enabled: bool,
    /// Passes over the public data. Default 10.
    pub epochs: usize,
    /// Curiosity (RND) during pre-training. Default true.
    pub curiosity: bool,
    /// Share of each batch replaced by novel samples. Default 0.3.
    pub curiosity_rate: f64,
    /// Samples per curiosity pool. Default 1000.
    pub pool_size: usize,
    /// Refresh the pool every this many epochs. Default 1.
    pub refresh_every_epochs: usize,
}

impl Default for PrivorlPretrain {
    fn default() -> Self {
        PrivorlPretrain {
            enabled: true,
            epochs: 10,
            curiosity: true,
            curiosity_rate: 0.3,
            pool_size: 1000,
            refresh_every_epochs: 1,
        }
    }
}

/// The downstream learner trained on the synthetic data alone (and, as the reference, on the
/// held-out real data), evaluated greedily in the simulator: discrete CQL for discrete actions,
/// TD3+BC (`td3bc`) for continuous ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrivorlUtility {
    pub cql: crate::offline::CqlConfig,
    /// The continuous-action learner (read only with `[task.continuous]`).
    pub td3bc: PrivorlTd3bc,
    /// CQL gradient steps. Default 3000.
    pub steps: u64,
    /// Independent CQL (or TD3+BC) trainings (model seeds `cql.model_seed + i`, or
    /// `td3bc.model_seed + i`) per dataset, each evaluated
    /// on the same episodes; the utility is their mean return. One training's greedy return
    /// varies by 10-20 points between seeds here, which drowned the differences between
    /// settings. Default 3.
    pub seeds: u64,
    /// Evaluation episodes. Default 20.
    pub eval_episodes: usize,
    /// Seed of the evaluation episodes. Default 1_000_000.
    pub eval_seed: u64,
    /// Step limit of an evaluation episode (0: the environment's; discrete CQL only: TD3+BC's
    /// episodes run to the environment's limit). Default 0.
    pub eval_max_steps: u64,
    /// Also train the reference on held-out real data. Default true.
    pub reference: bool,
}

/// TD3+BC (Fujimoto and Gu 2021; `fedrl_rl::offline::td3bc`): the paper's settings (alpha
/// 2.5, normalised states, policy delay 2, target smoothing, Adam 3e-4, gamma 0.99) with the
/// size of the run from the scenario.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrivorlTd3bc {
    /// Critic updates per training (the actor moves every second one). Default 5000.
    pub steps: u64,
    /// Transitions per update, drawn uniformly with replacement. Default 256.
    pub batch: usize,
    /// Hidden widths of the actor and of each critic. Default [256, 256] (the paper's).
    pub hidden: Vec<usize>,
    /// The BC trade-off alpha. Default 2.5 (the paper's).
    pub alpha: f64,
    /// Seed of the first training's weights, batches and smoothing noise. Default 0.
    pub model_seed: u64,
}

impl Default for PrivorlTd3bc {
    fn default() -> Self {
        PrivorlTd3bc {
            steps: 5000,
            batch: 256,
            hidden: vec![256, 256],
            alpha: 2.5,
            model_seed: 0,
        }
    }
}

impl Default for PrivorlUtility {
    fn default() -> Self {
        PrivorlUtility {
            cql: crate::offline::CqlConfig {
                hidden: vec![64, 64],
                learning_rate: 1e-3,
                target_update_interval: 100,
                batch_size: 256,
                ..Default::default()
            },
            td3bc: PrivorlTd3bc::default(),
            steps: 3000,
            seeds: 3,
            eval_episodes: 20,
            eval_seed: 1_000_000,
            eval_max_steps: 0,
            reference: true,
        }
    }
}

impl TaskSpec for PrivorlTask {
    const KIND: &'static str = "privorl";
    const CONFIG_VERSION: u32 = 1;
    /// PrivORL-n: one transition per contribution; PrivORL-j: one trajectory.
    fn unit_kind(&self) -> UnitKind {
        match self.level {
            PrivorlLevel::Transition => UnitKind::Transition,
            PrivorlLevel::Trajectory => UnitKind::Trajectory,
        }
    }
    fn central_summed_rows(&self) -> Option<u64> {
        // A trajectory's fragments make one clipped vector: one row per unit in the sum.
        let rows = match self.level {
            PrivorlLevel::Transition => u64::from(self.draws_per_unit),
            PrivorlLevel::Trajectory => 1,
        };
        (self.mode == crate::offline::UpdateMode::Central
            && self.central_path == crate::offline::CentralPath::Summed)
            .then_some(rows)
    }
    fn check(&self) -> Result<(), TaskError> {
        let bad = |m: String| Err(TaskError::Invalid(m));
        self.check_level()?;
        if self.transitions == 0 {
            return bad("task.transitions must be >= 1".into());
        }
        if let Some(c) = &self.continuous {
            self.check_continuous(c)?;
        }
        let mut specs = vec![("task.public", &self.public)];
        match &self.dataset {
            crate::offline::DatasetSource::Generated(d) => specs.push(("task.dataset", d)),
            crate::offline::DatasetSource::Stored(s) => {
                s.check()?;
                // One contribution is one transition: any grouping the scenario states (an
                // episode, an owner) would be split across many units, which PrivORL-n cannot
                // account for. (Trajectory level: checked in `check_level`.)
                if self.level == PrivorlLevel::Transition
                    && s.units != crate::offline::UnitMap::Transition
                {
                    return bad(format!(
                        "task.dataset.units: PrivORL-n's privacy unit is one transition, so a stored dataset's units must be \"transition\" (each transition a different person's); {:?} would put one unit's data into many contributions",
                        s.units
                    ));
                }
                if s.name == self.public.minari_id() {
                    return bad(
                        "task.public is the sensitive dataset itself: pre-training must use other, public data"
                            .into(),
                    );
                }
            }
        }
        for (name, d) in specs {
            // As for continuous data (`check_continuous`): the utility is measured in the
            // aggregator, which runs no Python.
            if d.env.starts_with(crate::offline::GYMNASIUM_PREFIX) || d.gymnasium.is_some() {
                return bad(format!(
                    "{name}.env = {:?}: PrivORL evaluates its release's utility (CQL in the real \
                     environment) in the aggregator, which runs no Python, so its datasets must \
                     be fedrl's own environments; a gymnasium:<id> dataset works with offline \
                     CQL and PriMORL, whose evaluations `fedrl run` completes through the bridge",
                    d.env
                ));
            }
            if d.units == 0 || d.episodes_per_unit != 1 {
                return bad(format!(
                    "{name}: units must be >= 1 and episodes_per_unit = 1 (PrivORL-n reads transitions)"
                ));
            }
        }
        if self.dataset.generated() == Some(&self.public) {
            return bad(
                "task.public is the sensitive dataset itself: pre-training must use other, public data"
                    .into(),
            );
        }
        let s = &self.synth;
        if s.width == 0
            || s.blocks == 0
            || s.dim_t == 0
            || s.fourier_dim == 0
            || !s.fourier_dim.is_multiple_of(2)
            || s.batch_size == 0
            || s.sample_steps < 2
        {
            return bad(format!(
                "task.synth: width, blocks, dim_t, batch_size must be >= 1, fourier_dim even and >= 2, sample_steps >= 2; got {s:?}"
            ));
        }
        if !(s.lr.is_finite() && s.lr > 0.0) {
            return bad(format!("task.synth.lr must be > 0, got {}", s.lr));
        }
        if let Some(lr) = self.finetune_lr
            && !(lr.is_finite() && lr > 0.0)
        {
            return bad(format!("task.finetune_lr must be > 0, got {lr}"));
        }
        let p = &self.pretrain;
        if p.enabled && p.epochs == 0 {
            return bad("task.pretrain.epochs must be >= 1 (or set enabled = false)".into());
        }
        if !p.enabled && p.curiosity {
            return bad(
                "task.pretrain.curiosity = true needs pre-training: curiosity acts only on the public data (set curiosity = false with enabled = false)"
                    .into(),
            );
        }
        if p.curiosity
            && (!(0.0..=1.0).contains(&p.curiosity_rate)
                || p.pool_size == 0
                || p.refresh_every_epochs == 0)
        {
            return bad(format!(
                "task.pretrain: curiosity_rate in [0, 1], pool_size and refresh_every_epochs >= 1; got {p:?}"
            ));
        }
        if !self.finetune && !p.enabled {
            return bad(
                "task.finetune = false and task.pretrain.enabled = false: the synthesizer would learn nothing"
                    .into(),
            );
        }
        if self.draws_per_unit == 0 || self.eval_every == 0 {
            return bad("task.draws_per_unit and task.eval_every must be >= 1".into());
        }
        let u = &self.utility;
        if u.cql.hidden.is_empty() || u.cql.hidden.contains(&0) || u.cql.batch_size == 0 {
            return bad("task.utility.cql: hidden widths and batch_size must be >= 1".into());
        }
        if u.steps == 0 || u.eval_episodes == 0 || u.seeds == 0 {
            return bad(
                "task.utility.steps, task.utility.seeds and task.utility.eval_episodes must be >= 1"
                    .into(),
            );
        }
        Ok(())
    }
}

impl PrivorlTask {
    /// The checks of `level`, `trajectory` and `synth.net`.
    fn check_level(&self) -> Result<(), TaskError> {
        let bad = |m: String| Err(TaskError::Invalid(m));
        let tr = &self.synth.transformer;
        if self.synth.net == PrivorlNet::Transformer
            && (tr.width == 0
                || tr.layers == 0
                || tr.heads == 0
                || tr.ff_mult == 0
                || !tr.width.is_multiple_of(tr.heads))
        {
            return bad(format!(
                "task.synth.transformer: width, layers, heads, ff_mult must be >= 1 and heads must divide width; got {tr:?}"
            ));
        }
        if self.level == PrivorlLevel::Transition {
            if self.synth.net != PrivorlNet::Mlp {
                return bad(
                    "task.synth.net = \"transformer\" is PrivORL-j's fragment denoiser: set level = \"trajectory\""
                        .into(),
                );
            }
            return Ok(());
        }
        let t = &self.trajectory;
        if t.units == 0 || t.horizon == 0 || t.max_fragments == 0 {
            return bad(format!(
                "task.trajectory: units, horizon and max_fragments must be >= 1 at level = \"trajectory\"; got {t:?}"
            ));
        }
        if self.draws_per_unit != 1 {
            return bad(
                "task.draws_per_unit is PrivORL-n's: at level = \"trajectory\" each fragment has one noise draw (leave it at 1)"
                    .into(),
            );
        }
        if let crate::offline::DatasetSource::Stored(s) = &self.dataset
            && s.units != crate::offline::UnitMap::Episode
        {
            return bad(format!(
                "task.dataset.units: PrivORL-j's privacy unit is one episode, so a stored dataset's units must be \"episode\" (no person with more than one episode); got {:?}",
                s.units
            ));
        }
        Ok(())
    }

    /// The checks of `[task.continuous]` and of the learner it uses.
    fn check_continuous(&self, c: &PrivorlContinuous) -> Result<(), TaskError> {
        let bad = |m: String| Err(TaskError::Invalid(m));
        // The discrete fields would be silently ignored: refuse them instead.
        if self.dataset != crate::offline::DatasetSource::default() || self.public != d_public() {
            return bad(
                "task.continuous names the sensitive and public datasets: leave task.dataset and task.public unset"
                    .into(),
            );
        }
        // PrivORL's utility (TD3+BC evaluated in the real environment) and its action box are
        // the aggregator's, which runs no Python (DESIGN §2.6): a Gymnasium environment cannot
        // be evaluated there, and its evaluation is not deferred to `fedrl run` as PriMORL's is.
        for (what, d) in [("dataset", &c.dataset), ("public", &c.public)] {
            if d.env.starts_with(crate::offline::GYMNASIUM_PREFIX) || d.gymnasium.is_some() {
                return bad(format!(
                    "task.continuous.{what}.env = {:?}: PrivORL evaluates its release's utility \
                     (TD3+BC in the real environment) in the aggregator, which runs no Python, \
                     so its continuous datasets must be fedrl's own environments; a \
                     gymnasium:<id> dataset works with PriMORL, whose policy evaluations \
                     `fedrl run` completes through the bridge",
                    d.env
                ));
            }
        }
        c.dataset.validate().map_err(|e| {
            TaskError::Invalid(e.replace("task.dataset", "task.continuous.dataset"))
        })?;
        c.public
            .validate()
            .map_err(|e| TaskError::Invalid(e.replace("task.dataset", "task.continuous.public")))?;
        if c.public == c.dataset {
            return bad(
                "task.continuous.public is the sensitive dataset itself: pre-training must use other, public data"
                    .into(),
            );
        }
        let t = &self.utility.td3bc;
        if t.steps == 0
            || t.batch == 0
            || t.hidden.is_empty()
            || t.hidden.contains(&0)
            || !(t.alpha.is_finite() && t.alpha >= 0.0)
        {
            return bad(format!(
                "task.utility.td3bc: steps, batch and hidden widths must be >= 1, alpha >= 0; got {t:?}"
            ));
        }
        Ok(())
    }

    /// Privacy units: transitions, or trajectories at `level = "trajectory"`.
    pub fn units(&self) -> u64 {
        match self.level {
            PrivorlLevel::Transition => self.transitions,
            PrivorlLevel::Trajectory => self.trajectory.units,
        }
    }

    /// Held-out real episodes at trajectory level.
    pub fn holdout_trajectories(&self) -> u64 {
        if self.trajectory.holdout == 0 {
            self.trajectory.units
        } else {
            self.trajectory.holdout
        }
    }

    /// Synthetic trajectories released at trajectory level.
    pub fn synthetic_trajectories(&self) -> u64 {
        if self.trajectory.synthetic == 0 {
            self.trajectory.units
        } else {
            self.trajectory.synthetic
        }
    }

    /// Whether the data are continuous-action (`[task.continuous]`).
    pub fn is_continuous(&self) -> bool {
        self.continuous.is_some()
    }

    /// Held-out real transitions used.
    pub fn holdout(&self) -> u64 {
        if self.holdout_transitions == 0 {
            self.transitions
        } else {
            self.holdout_transitions
        }
    }

    /// Members (and non-members) the membership audit scores; 0: no audit.
    pub fn membership_rows(&self) -> u64 {
        self.audit.membership_rows.unwrap_or(match self.mode {
            crate::offline::UpdateMode::Central => 1000,
            crate::offline::UpdateMode::Federated => 0,
        })
    }

    /// Synthetic transitions released.
    pub fn synthetic(&self) -> u64 {
        if self.synthetic_transitions == 0 {
            self.transitions
        } else {
            self.synthetic_transitions
        }
    }
}

fn d_transitions() -> u64 {
    10_000
}

fn d_public() -> crate::offline::DatasetSpec {
    crate::offline::DatasetSpec {
        env: "cartpole-b1".into(),
        units: 100,
        seed: 1,
        ..Default::default()
    }
}

fn d_central() -> crate::offline::UpdateMode {
    crate::offline::UpdateMode::Central
}

fn d_true() -> bool {
    true
}

fn d_one_u32() -> u32 {
    1
}

fn d_snap_public_values() -> usize {
    8
}

fn d_eval_every() -> u64 {
    50
}
