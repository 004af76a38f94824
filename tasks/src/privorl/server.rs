//! PrivORL-n, server side: the synthesizer (pre-trained on public data before the first
//! round), one AdamW step per released noisy mean gradient with the EMA updated after it, and,
//! when the rounds are over, the sampling of the synthetic dataset from the EMA weights, its
//! evaluation and its export in Minari's layout (continuous actions: in the project's
//! continuous format, evaluated with TD3+BC; [`super::continuous`]).
//!
//! Everything here is post-processing of released gradients and public data, except the
//! evaluation's real data: held-out transitions of the sensitive dataset (`task.split`: drawn
//! at random beside the units, or the episodes after the units'; no unit's transition is among
//! them). The fidelity and the reference CQL are
//! computed on those, and so are operator-side diagnostics about held-out data, not about any
//! unit. The held-out loss curve uses them too.
//!
//! A checkpoint keeps the online and EMA weights (not AdamW's moments: a resumed run restarts
//! them, as a new training phase does).

use std::path::Path;
use std::time::Instant;

use fedrl_common::task::privorl::{PrivorlSplit, PrivorlTask};
use fedrl_rl::audit::{AttackConfig, MembershipReport, denoising_loss_scores};
use fedrl_rl::candle_core::{Device, Tensor};
use fedrl_rl::diffusion::edm::{normal_tensor, per_example_loss};
use fedrl_rl::diffusion::{Actions, DiffusionModel, PublicSupport, TransitionSynthesizer};
use fedrl_rl::offline::dataset::{Dataset, Episode};
use fedrl_rl::offline::{TransitionBatch, minari};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;

use super::{
    Downstream, PrivorlTaskExt, batch_transitions, continuous, downstream, eval_env,
    load_sensitive, pretrained, public_rows,
};
use crate::server::{ModelError, ModelState, ServerModel};

/// Folder of the released synthetic dataset in the output directory (a Minari root: the
/// dataset sits at `SYNTHETIC_DIR/<id>/data/`).
pub const SYNTHETIC_DIR: &str = "synthetic";

/// Held-out rows the curve's denoising loss is measured on.
const CURVE_ROWS: usize = 1000;

/// Synthetic transitions sampled per sampler call (progress lines between calls).
const SAMPLE_CHUNK: usize = 2000;

pub struct PrivorlModel {
    task: PrivorlTask,
    synth: TransitionSynthesizer,
    /// The offer, the released rounds, the curve.
    ft: Finetuning,
    /// Held-out real transitions (fidelity, the reference CQL).
    holdout: TransitionBatch,
    /// Normalised held-out rows with fixed noise levels and noise (the curve's loss).
    curve_rows: (Tensor, Vec<f64>, Tensor),
    pretrain: serde_json::Value,
    /// Wall-clock seconds of building (or reading from the cache) the pre-trained synthesizer.
    pretrain_s: f64,
    /// When the model was ready for fine-tuning (the end of [`PrivorlModel::new`]): the
    /// fine-tuning phase's wall clock runs from here to the start of the final evaluation.
    ready_at: Instant,
    /// The sampled synthetic dataset, once the run is over.
    released: Option<Released>,
    /// The membership audit's normalised rows: units' transitions (members) and held-out ones
    /// (non-members); empty when the audit is off. Operator-only.
    audit_rows: (Vec<f32>, Vec<f32>),
    /// The few-valued entries of the public data, snapped to in the release
    /// (`task.snap_public_values`).
    support: PublicSupport,
    device: Device,
}

impl PrivorlModel {
    /// Builds (or reads from the cache) the pre-trained synthesizer and reads the held-out real
    /// data.
    pub fn new(task: &PrivorlTask, device: Device) -> anyhow::Result<Self> {
        let root = fedrl_rl::offline::data_root(None)?;
        let t0 = Instant::now();
        let (synth, reports) = pretrained(task, &root, &device, &mut |r| {
            eprintln!(
                "privorl: pre-training epoch {}/{}: loss {:.4} ({:.1} s)",
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
        let mut synth = synth;
        let dim = synth.dim();
        let start = synth.model().ema_flat()?;
        let freqs = synth.model().denoiser().freqs()?;
        *synth.model_mut() = DiffusionModel::from_parts(
            dim,
            finetune_config(task),
            &start,
            None,
            &freqs,
            task.model_seed ^ 0xf1ae_0000_0000_0001,
            &device,
        )?;
        let (units, holdout) = load_sensitive(task, &root)?;
        let layout = *synth.layout();
        let support =
            PublicSupport::fit(&layout, &public_rows(task, &root)?, task.snap_public_values)?;
        if holdout.is_empty() {
            anyhow::bail!(
                "the sensitive dataset has no episode after the units' transitions: raise task.dataset.units for held-out data"
            );
        }
        // The membership audit's rows (operator-only, see `PrivorlAudit`): a seeded sample of
        // the units' transitions and as many held-out ones, normalised as the model sees them.
        let k = (task.membership_rows() as usize)
            .min(units.len())
            .min(holdout.len());
        let mut pick = Xoshiro256PlusPlus::seed_from_u64(task.model_seed ^ 0x6d69_615f_726f_7773);
        let members = synth.encode(&batch_transitions(
            &layout,
            &units.select(&sample_rows(units.len(), k, &mut pick)),
        )?)?;
        let non_members = synth.encode(&batch_transitions(
            &layout,
            &holdout.select(&sample_rows(holdout.len(), k, &mut pick)),
        )?)?;
        drop(units);
        let n = holdout.len().min(CURVE_ROWS);
        let rows: Vec<usize> = (0..n).collect();
        let x = synth.encode(&batch_transitions(&layout, &holdout.select(&rows))?)?;
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(task.model_seed ^ 0xc0ffee);
        let edm = task.synth_config().edm;
        let sigmas: Vec<f64> = (0..n).map(|_| edm.draw_sigma(&mut rng)).collect();
        let noise = normal_tensor(n, dim, &mut rng, &device)?;
        let x = Tensor::from_vec(x, (n, dim), &device)?;
        let mut m = PrivorlModel {
            audit_rows: (members, non_members),
            task: task.clone(),
            ft: Finetuning::new(synth.model())?,
            synth,
            holdout,
            curve_rows: (x, sigmas, noise),
            pretrain,
            pretrain_s,
            ready_at: Instant::now(),
            released: None,
            support,
            device,
        };
        m.record_curve()?;
        m.ready_at = Instant::now();
        Ok(m)
    }

    /// The EMA weights' denoising loss on the held-out rows at fixed noise.
    fn heldout_loss(&self) -> anyhow::Result<f64> {
        let (x, s, n) = &self.curve_rows;
        let model = self.synth.model();
        let l = per_example_loss(
            &model.config().edm,
            model.denoiser(),
            model.ema_params(),
            x,
            s,
            n,
        )?
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

    /// Samples the synthetic dataset (one-step episodes: the transitions are independent).
    fn sample(&mut self) -> anyhow::Result<(Released, TransitionBatch)> {
        let n = self.task.synthetic() as usize;
        let t0 = Instant::now();
        let obs_dim = self.synth.layout().obs_dim;
        let cont = match &self.task.continuous {
            Some(c) => Some(continuous::env_of(c)?),
            None => None,
        };
        let mut batch = TransitionBatch::new(
            obs_dim
                + cont
                    .as_ref()
                    .map_or(0, |e: &continuous::ContinuousEnv| e.act_dim),
        );
        let mut done = 0;
        while done < n {
            let m = SAMPLE_CHUNK.min(n - done);
            let mut t = self.synth.sample_snapped(m, Some(&self.support))?;
            match (&t.actions, &cont) {
                (Actions::Discrete(actions), None) => {
                    batch.obs.extend_from_slice(&t.obs);
                    batch.next_obs.extend_from_slice(&t.next_obs);
                    batch.actions.extend_from_slice(actions);
                    batch.rewards.extend_from_slice(&t.rewards);
                    batch.terminals.extend_from_slice(&t.terminals);
                }
                (Actions::Continuous { .. }, Some(env)) => {
                    continuous::clip_actions(&mut t, env);
                    batch.extend_from(&continuous::pack(&t)?);
                }
                _ => {
                    anyhow::bail!("the synthesizer decoded actions of another kind than the task's")
                }
            }
            done += m;
            eprintln!(
                "privorl: sampling {done}/{n} synthetic transitions ({:.0} s)",
                t0.elapsed().as_secs_f64()
            );
        }
        if let Some(env) = &cont {
            let d = continuous::release_dataset(
                &batch,
                env,
                serde_json::json!({
                    "privorl": "PrivORL-n (fedrl): DP synthetic transitions (one-step episodes) sampled from a diffusion model fine-tuned by transition-level DP-SGD",
                    "task": self.task,
                }),
            )?;
            return Ok((Released::Continuous(d), batch));
        }
        let q = self.task.row_spec()?;
        let mut episodes = Vec::with_capacity(n);
        for i in 0..batch.len() {
            let mut observations = batch.obs[i * obs_dim..(i + 1) * obs_dim].to_vec();
            observations.extend_from_slice(&batch.next_obs[i * obs_dim..(i + 1) * obs_dim]);
            let terminal = batch.terminals[i] > 0.5;
            episodes.push(Episode {
                id: i as u64,
                unit: i as u64,
                observations,
                actions: vec![batch.actions[i]],
                rewards: vec![batch.rewards[i]],
                terminations: vec![terminal],
                truncations: vec![!terminal],
            });
        }
        let d = Dataset {
            id: synthetic_id(&eval_env(&self.task)?),
            env_id: eval_env(&self.task)?,
            obs_dim,
            n_actions: q.n_actions,
            episodes,
        };
        Ok((Released::Minari(d), batch))
    }

    fn evaluate_release(&mut self) -> anyhow::Result<serde_json::Value> {
        let finetuning_s = self.ready_at.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let (dataset, synthetic) = self.sample()?;
        let sampling_s = t0.elapsed().as_secs_f64();
        let layout = *self.synth.layout();
        let real = layout.encode(&batch_transitions(&layout, &self.holdout)?)?;
        let syn = layout.encode(&batch_transitions(&layout, &synthetic)?)?;
        let f = fedrl_rl::fidelity::fidelity(&real, &syn, layout.dim())?;
        // The scale of the scores: real data against real data, the held-out rows' halves.
        let halves = {
            let d = layout.dim();
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for (i, row) in real.chunks_exact(d).enumerate() {
                if i % 2 == 0 { &mut a } else { &mut b }.extend_from_slice(row);
            }
            fedrl_rl::fidelity::fidelity(&a, &b, d).ok()
        };
        let Downstream {
            on_synthetic: on_syn,
            reference,
            random,
            percent,
            seconds: downstream_s,
        } = downstream(&self.task, &synthetic, &self.holdout)?;
        let syn_return = on_syn["return"].as_f64().unwrap_or(f64::NAN);
        let id = dataset.id();
        self.released = Some(dataset);
        let learner = if self.task.is_continuous() {
            "TD3+BC"
        } else {
            "CQL"
        };
        eprintln!(
            "privorl: fidelity marginal {:.3}, correlation {}; {learner} on synthetic data returns {syn_return:.1}{}",
            f.marginal,
            f.correlation.map_or("n/a".into(), |c| format!("{c:.3}")),
            percent.map_or(String::new(), |p| format!(
                " ({p:.0}% of the real-data reference)"
            ))
        );
        Ok(serde_json::json!({
            "final_eval_return": syn_return,
            "final_eval_episodes": on_syn["episodes"],
            "fidelity": {
                "marginal": f.marginal,
                "correlation": f.correlation,
                "undefined_pairs": f.undefined_pairs,
                "marginal_per_entry": f.per_dimension,
                "snapped_entries": self.support.snapped(),
                "real_halves": halves.map(|h| serde_json::json!({
                    "marginal": h.marginal,
                    "correlation": h.correlation,
                    "what": "one half of the held-out real transitions against the other (every other row): the scores two real samples of half this size get",
                })),
                "real_transitions": self.holdout.len(),
                "synthetic_transitions": synthetic.len(),
                "split": self.task.split,
                "against": match self.task.split {
                    PrivorlSplit::Shuffled => "held-out real transitions (drawn at random from the sensitive dataset beside the units, none of them a unit's): an evaluation beside the DP release, not covered by its epsilon",
                    PrivorlSplit::Episodes => "held-out real transitions (episodes after the units'; no unit's data): an evaluation beside the DP release, not covered by its epsilon",
                },
            },
            "utility": {
                "learner": if self.task.is_continuous() {
                    "TD3+BC (alpha from task.utility.td3bc) on the synthetic data only, deterministic evaluation"
                } else {
                    "discrete CQL on the synthetic data only, greedy evaluation"
                },
                "synthetic": on_syn,
                "real_reference": reference,
                "real_reference_data": "as many held-out real transitions as units (no unit's data; not covered by epsilon)",
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
            },
            "pretrain": self.pretrain,
            "finetune": {
                "applied": self.task.finetune,
                "rounds": self.ft.rounds,
                "steps": self.synth.model().steps(),
                "seconds_applying": self.ft.seconds,
            },
            // Wall clock of every phase in this process: pre-training (or reading it from
            // the cache, with the datasets), fine-tuning (from the model's construction to
            // the end of the last round: the engine's start, every round's DP gradient, noise
            // and step, the curve's evaluations), sampling the release, and the downstream CQL
            // trainings with their evaluations (on the synthetic and the real reference data).
            "phase_seconds": {
                "pretraining": self.pretrain_s,
                "finetuning": finetuning_s,
                "sampling": sampling_s,
                "downstream": downstream_s,
            },
            "curve": self.ft.curve,
        }))
    }
}

/// The synthesizer's configuration during fine-tuning (its own learning rate, when set).
fn finetune_config(task: &PrivorlTask) -> fedrl_rl::diffusion::SynthesizerConfig {
    let mut cfg = task.synth_config();
    if let Some(lr) = task.finetune_lr {
        cfg.train.lr = lr;
    }
    cfg
}

/// The membership audit's operator-only report (`model_audit.membership`) and its summary line
/// on stderr, for either level: `unit` names the unit when it is not a transition.
pub(crate) fn membership_json(
    audit: Result<MembershipReport, String>,
    unit: Option<&str>,
    attack: &str,
    started: Instant,
) -> serde_json::Value {
    match audit {
        Ok(r) => {
            eprintln!(
                "operator-only (an audit reading the units' data, do not publish): membership \
                 inference{}: TPR {:.1}% at 10% FPR, {:.1}% at 1% FPR, AUC {:.3} ({} members, {} \
                 non-members)",
                unit.map_or(String::new(), |u| format!(" over {u}s")),
                100.0 * r.tpr_at_10pct_fpr,
                100.0 * r.tpr_at_1pct_fpr,
                r.auc,
                r.members,
                r.non_members
            );
            let mut m = serde_json::json!({
                "attack": attack,
                "members": r.members,
                "non_members": r.non_members,
                "tpr_at_10pct_fpr": r.tpr_at_10pct_fpr,
                "tpr_at_1pct_fpr": r.tpr_at_1pct_fpr,
                "auc": r.auc,
                "chance": { "tpr_at_10pct_fpr": 0.1, "tpr_at_1pct_fpr": 0.01, "auc": 0.5 },
                "seconds": started.elapsed().as_secs_f64(),
            });
            if let Some(u) = unit {
                m["unit"] = u.into();
            }
            serde_json::json!({ "membership": m })
        }
        Err(e) => serde_json::json!({ "membership": { "error": e } }),
    }
}

/// The released synthetic dataset, in the format of its action space.
enum Released {
    /// Discrete actions: Minari's layout.
    Minari(Dataset),
    /// Continuous actions: the project's continuous format.
    Continuous(fedrl_rl::offline::continuous::ContinuousDataset),
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

/// The released dataset's Minari id for environment `env`.
pub fn synthetic_id(env: &str) -> String {
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
    format!("privorl/{name}-synthetic-v0")
}

/// The synthesizer network a PrivORL server model fine-tunes (PrivORL-n's [`DiffusionModel`],
/// PrivORL-j's `FragmentModel`).
pub(crate) trait FinetunedNet {
    fn apply_gradient(&mut self, noisy_mean_gradient: &[f32]) -> fedrl_rl::Result<()>;
    fn online_flat(&self) -> fedrl_rl::Result<Vec<f32>>;
    fn ema_flat(&self) -> fedrl_rl::Result<Vec<f32>>;
    /// Optimiser steps taken.
    fn steps(&self) -> u64;
    /// EMA updates so far.
    fn ema_calls(&self) -> u64;
}

impl FinetunedNet for DiffusionModel {
    fn apply_gradient(&mut self, g: &[f32]) -> fedrl_rl::Result<()> {
        DiffusionModel::apply_gradient(self, g)
    }
    fn online_flat(&self) -> fedrl_rl::Result<Vec<f32>> {
        DiffusionModel::online_flat(self)
    }
    fn ema_flat(&self) -> fedrl_rl::Result<Vec<f32>> {
        DiffusionModel::ema_flat(self)
    }
    fn steps(&self) -> u64 {
        DiffusionModel::steps(self)
    }
    fn ema_calls(&self) -> u64 {
        DiffusionModel::ema_calls(self)
    }
}

/// The fine-tuning bookkeeping both PrivORL server models keep: the offer (the online weights
/// every round carries), the released rounds, the seconds spent applying them and the held-out
/// loss curve, with the [`ServerModel`] methods that only read or write these.
pub(crate) struct Finetuning {
    pub offer: Vec<f32>,
    /// Released rounds received (applied: the same, unless the run only pre-trains).
    pub rounds: u64,
    /// Seconds spent in AdamW and EMA steps.
    pub seconds: f64,
    pub curve: Vec<serde_json::Value>,
    /// How many of `curve`'s points the rounds' metrics lines have seen.
    pub reported: usize,
}

impl Finetuning {
    pub fn new(net: &dyn FinetunedNet) -> fedrl_rl::Result<Self> {
        Ok(Finetuning {
            offer: net.online_flat()?,
            rounds: 0,
            seconds: 0.0,
            curve: Vec::new(),
            reported: 0,
        })
    }

    /// One released round: an AdamW step with the noisy mean gradient, then the EMA update
    /// (nothing is applied in a pre-training-only run). Returns whether a point of the
    /// held-out curve is due (every `task.eval_every` steps).
    pub fn apply(
        &mut self,
        task: &PrivorlTask,
        net: &mut dyn FinetunedNet,
        noisy_mean_gradient: &[f32],
    ) -> Result<bool, ModelError> {
        if noisy_mean_gradient.len() != self.offer.len() {
            return Err(ModelError::Length {
                expected: self.offer.len(),
                got: noisy_mean_gradient.len(),
            });
        }
        self.rounds += 1;
        if !task.finetune {
            return Ok(false);
        }
        let t0 = Instant::now();
        let other = |e: fedrl_rl::NnError| ModelError::Other(e.to_string());
        net.apply_gradient(noisy_mean_gradient).map_err(other)?;
        self.offer = net.online_flat().map_err(other)?;
        self.seconds += t0.elapsed().as_secs_f64();
        Ok(net.steps().is_multiple_of(task.eval_every))
    }

    /// The fine-tuning's AdamW learning rate `lr` (a public setting; absent in a
    /// pre-training-only run, which applies nothing).
    pub fn diagnostics(task: &PrivorlTask, lr: f64) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        if task.finetune {
            m.insert("server_lr".into(), lr.into());
        }
        m
    }

    /// The online weights, then the EMA weights; `model` names the kind in the metadata.
    pub fn state(&self, model: &str, net: &dyn FinetunedNet) -> ModelState {
        let mut tensors = self.offer.clone();
        tensors.extend(net.ema_flat().unwrap_or_default());
        ModelState {
            meta: serde_json::json!({
                "model": model,
                "rounds": self.rounds,
                "ema_calls": net.ema_calls(),
                "curve": self.curve,
            }),
            tensors,
        }
    }

    /// Checks a checkpoint of [`Self::state`] and takes its bookkeeping; returns the online
    /// and EMA weights and the EMA's update count, from which the caller rebuilds its network.
    pub fn restore<'a>(
        &mut self,
        state: &'a ModelState,
    ) -> Result<(&'a [f32], &'a [f32], u64), ModelError> {
        let dim = self.offer.len();
        if state.tensors.len() != 2 * dim {
            return Err(ModelError::Restore(format!(
                "the checkpoint has {} values, the online and EMA weights need {}",
                state.tensors.len(),
                2 * dim
            )));
        }
        self.rounds = state.meta["rounds"].as_u64().unwrap_or(0);
        // Checkpoints written before the count was kept: one EMA update per applied round.
        let calls = state.meta["ema_calls"].as_u64().unwrap_or(self.rounds);
        self.offer = state.tensors[..dim].to_vec();
        self.curve = state.meta["curve"].as_array().cloned().unwrap_or_default();
        self.reported = self.curve.len();
        Ok((&state.tensors[..dim], &state.tensors[dim..], calls))
    }

    /// The latest held-out loss when a new one was measured since the last round.
    pub fn evaluate(&mut self) -> Option<serde_json::Value> {
        let new = self.curve.len() > self.reported;
        self.reported = self.curve.len();
        new.then(|| self.curve.last().cloned()).flatten()
    }
}

impl ServerModel for PrivorlModel {
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
        self.ft.state("privorl", self.synth.model())
    }

    fn restore(&mut self, state: ModelState) -> Result<(), ModelError> {
        let freqs = self
            .synth
            .model()
            .denoiser()
            .freqs()
            .map_err(|e| ModelError::Restore(e.to_string()))?;
        let (online, ema, calls) = self.ft.restore(&state)?;
        let model = DiffusionModel::from_parts(
            self.synth.dim(),
            finetune_config(&self.task),
            online,
            Some((ema, calls)),
            &freqs,
            self.task.model_seed ^ 0xf1ae_0000_0000_0002,
            &self.device,
        )
        .map_err(|e| ModelError::Restore(e.to_string()))?;
        *self.synth.model_mut() = model;
        Ok(())
    }

    /// The latest held-out loss when a new one was measured since the last round.
    fn evaluate(&mut self, _round: u64) -> Option<serde_json::Value> {
        self.ft.evaluate()
    }

    fn final_evaluation(&mut self) -> Option<serde_json::Value> {
        Some(
            self.evaluate_release()
                .unwrap_or_else(|e| serde_json::json!({ "final_eval_error": format!("{e:#}") })),
        )
    }

    /// The membership-inference audit (seed 003 IX-D) of the EMA weights the release was
    /// sampled from: operator-only, since it scores the units' own transitions.
    fn operator_evaluation(&mut self) -> Option<serde_json::Value> {
        let (members, non_members) = &self.audit_rows;
        if members.is_empty() {
            return None;
        }
        let t0 = Instant::now();
        let model = self.synth.model();
        let cfg = AttackConfig::default();
        let score = |rows: &[f32]| {
            denoising_loss_scores(
                &model.config().edm,
                model.denoiser(),
                model.ema_params(),
                rows,
                &cfg,
            )
        };
        let audit = score(members)
            .and_then(|m| Ok((m, score(non_members)?)))
            .and_then(|(m, n)| MembershipReport::new(&m, &n));
        Some(membership_json(
            audit.map_err(|e| e.to_string()),
            None,
            "white-box denoising loss (seed 003 section IX-D), EMA weights",
            t0,
        ))
    }

    /// Writes the synthetic dataset into `dir/synthetic/<id>` (Minari's layout), or, with
    /// continuous actions, into `dir/synthetic/continuous/<name>.safetensors` (the project's
    /// continuous format, its SHA-256 beside it).
    fn export(&self, dir: &Path) -> anyhow::Result<()> {
        let d = match &self.released {
            None => return Ok(()),
            Some(Released::Continuous(d)) => {
                let id = self.released.as_ref().map(Released::id).unwrap_or_default();
                let name = id.trim_start_matches("continuous/");
                let folder = dir.join(SYNTHETIC_DIR).join("continuous");
                std::fs::create_dir_all(&folder)?;
                d.save(&folder.join(format!("{name}.safetensors")))?;
                return Ok(());
            }
            Some(Released::Minari(d)) => d,
        };
        let root = dir.join(SYNTHETIC_DIR);
        let target = minari::dataset_dir(&root, &d.id)?;
        if target.exists() {
            std::fs::remove_dir_all(&target)?;
        }
        std::fs::create_dir_all(&target)?;
        minari::write(
            d,
            &target,
            &minari::WriteOptions {
                algorithm_name: Some("PrivORL-n (fedrl)".into()),
                description: Some(
                    "DP synthetic transitions (one-step episodes) sampled from a diffusion model fine-tuned by transition-level DP-SGD".into(),
                ),
                spec: Some(serde_json::json!({ "privorl": self.task })),
            },
        )?;
        Ok(())
    }
}

/// `k` distinct row indices of `0..n` drawn with `rng` (all of them, in order, when `k >= n`).
fn sample_rows(n: usize, k: usize, rng: &mut Xoshiro256PlusPlus) -> Vec<usize> {
    if k >= n {
        return (0..n).collect();
    }
    rand::seq::index::sample(rng, n, k).into_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in network: the online weights move by the gradient, the EMA copies them.
    struct Net {
        online: Vec<f32>,
        ema: Vec<f32>,
        steps: u64,
    }

    impl FinetunedNet for Net {
        fn apply_gradient(&mut self, g: &[f32]) -> fedrl_rl::Result<()> {
            for (w, d) in self.online.iter_mut().zip(g) {
                *w -= d;
            }
            self.ema = self.online.clone();
            self.steps += 1;
            Ok(())
        }
        fn online_flat(&self) -> fedrl_rl::Result<Vec<f32>> {
            Ok(self.online.clone())
        }
        fn ema_flat(&self) -> fedrl_rl::Result<Vec<f32>> {
            Ok(self.ema.clone())
        }
        fn steps(&self) -> u64 {
            self.steps
        }
        fn ema_calls(&self) -> u64 {
            self.steps
        }
    }

    #[test]
    fn finetuning_applies_checkpoints_and_restores_its_bookkeeping() {
        let task: PrivorlTask =
            serde_json::from_value(serde_json::json!({ "eval_every": 2 })).unwrap();
        let mut net = Net {
            online: vec![1.0, 2.0],
            ema: vec![1.0, 2.0],
            steps: 0,
        };
        let mut ft = Finetuning::new(&net).unwrap();
        assert!(matches!(
            ft.apply(&task, &mut net, &[1.0]),
            Err(ModelError::Length {
                expected: 2,
                got: 1
            })
        ));
        assert!(!ft.apply(&task, &mut net, &[0.5, 0.5]).unwrap());
        assert!(
            ft.apply(&task, &mut net, &[0.5, 0.5]).unwrap(),
            "curve due at step 2"
        );
        assert_eq!(ft.offer, vec![0.0, 1.0]);
        ft.curve.push(serde_json::json!({ "step": 2 }));
        assert_eq!(ft.evaluate(), Some(serde_json::json!({ "step": 2 })));
        assert_eq!(ft.evaluate(), None, "reported once");
        let state = ft.state("test", &net);
        assert_eq!(state.tensors, vec![0.0, 1.0, 0.0, 1.0]);
        assert_eq!(state.meta["ema_calls"], 2);

        let mut back = Finetuning::new(&Net {
            online: vec![9.0, 9.0],
            ema: vec![9.0, 9.0],
            steps: 0,
        })
        .unwrap();
        let (online, ema, calls) = back.restore(&state).unwrap();
        assert_eq!((online, ema, calls), (&[0.0, 1.0][..], &[0.0, 1.0][..], 2));
        assert_eq!((back.rounds, back.offer.clone()), (2, vec![0.0, 1.0]));
        assert_eq!(
            back.evaluate(),
            None,
            "the restored curve counts as reported"
        );
        // A pre-training-only run counts rounds but applies nothing.
        let frozen: PrivorlTask =
            serde_json::from_value(serde_json::json!({ "finetune": false })).unwrap();
        assert!(!back.apply(&frozen, &mut net, &[1.0, 1.0]).unwrap());
        assert_eq!((back.rounds, back.offer.clone()), (3, vec![0.0, 1.0]));
        // A checkpoint of another size is refused.
        let mut short = state.clone();
        short.tensors.pop();
        assert!(matches!(back.restore(&short), Err(ModelError::Restore(_))));
    }
}
