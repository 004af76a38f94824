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
use fedrl_rl::offline::qnet::QNetSpec;
use fedrl_rl::offline::train::{evaluate_greedy_for, train_cql};
use fedrl_rl::offline::{TransitionBatch, minari};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;

use super::{
    PrivorlTaskExt, batch_transitions, continuous, eval_env, load_sensitive, pretrained,
    public_rows,
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
    /// The online weights (what every offer carries).
    offer: Vec<f32>,
    /// Held-out real transitions (fidelity, the reference CQL).
    holdout: TransitionBatch,
    /// Normalised held-out rows with fixed noise levels and noise (the curve's loss).
    curve_rows: (Tensor, Vec<f64>, Tensor),
    curve: Vec<serde_json::Value>,
    reported: usize,
    /// Released rounds received, and applied (0 without fine-tuning).
    rounds: u64,
    finetune_s: f64,
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
            offer: Vec::new(),
            synth,
            holdout,
            curve_rows: (x, sigmas, noise),
            curve: Vec::new(),
            reported: 0,
            rounds: 0,
            finetune_s: 0.0,
            pretrain,
            pretrain_s,
            ready_at: Instant::now(),
            released: None,
            support,
            device,
        };
        m.offer = m.synth.model().online_flat()?;
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
        self.curve.push(serde_json::json!({
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

    /// Trains the downstream learner on `data` and evaluates it greedily: TD3+BC for continuous
    /// actions ([`continuous::td3bc_utility`]), else discrete CQL.
    fn utility(&self, data: &TransitionBatch, what: &str) -> anyhow::Result<serde_json::Value> {
        if let Some(c) = &self.task.continuous {
            return continuous::td3bc_utility(&self.task, &continuous::env_of(c)?, data, what);
        }
        let u = &self.task.utility;
        let spec: QNetSpec = self.task.row_spec()?;
        let t0 = Instant::now();
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
                &eval_env(&self.task)?,
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
        let t1 = Instant::now();
        let on_syn = self.utility(&synthetic, "synthetic")?;
        let reference = if self.task.utility.reference {
            Some(self.utility(&self.holdout, "held-out real")?)
        } else {
            None
        };
        let downstream_s = t1.elapsed().as_secs_f64();
        let syn_return = on_syn["return"].as_f64().unwrap_or(f64::NAN);
        // Continuous control's returns may be negative (Pendulum's are): the share is
        // normalised by uniformly random actions' return on the same episodes, as D4RL's
        // scores are; CartPole's stays the plain ratio of returns.
        let random = match &self.task.continuous {
            Some(c) => Some(continuous::random_return(
                &self.task,
                &continuous::env_of(c)?,
            )?),
            None => None,
        };
        let zero = random.unwrap_or(0.0);
        let percent = reference
            .as_ref()
            .and_then(|r| r["return"].as_f64())
            .map(|r| 100.0 * (syn_return - zero) / (r - zero));
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
                "rounds": self.rounds,
                "steps": self.synth.model().steps(),
                "seconds_applying": self.finetune_s,
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
            "curve": self.curve,
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

impl ServerModel for PrivorlModel {
    fn params(&self) -> &[f32] {
        &self.offer
    }

    /// One AdamW step with the released noisy mean gradient, then the EMA update (skipped
    /// entirely in a pre-training-only run).
    fn apply(&mut self, noisy_mean_gradient: &[f32]) -> Result<(), ModelError> {
        if noisy_mean_gradient.len() != self.offer.len() {
            return Err(ModelError::Length {
                expected: self.offer.len(),
                got: noisy_mean_gradient.len(),
            });
        }
        self.rounds += 1;
        if !self.task.finetune {
            return Ok(());
        }
        let t0 = Instant::now();
        let other = |e: fedrl_rl::NnError| ModelError::Other(e.to_string());
        self.synth
            .model_mut()
            .apply_gradient(noisy_mean_gradient)
            .map_err(other)?;
        self.offer = self.synth.model().online_flat().map_err(other)?;
        if self
            .synth
            .model()
            .steps()
            .is_multiple_of(self.task.eval_every)
        {
            self.record_curve()
                .map_err(|e| ModelError::Other(e.to_string()))?;
        }
        self.finetune_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// The fine-tuning's AdamW learning rate (a public setting; absent in a pre-training-only
    /// run, which applies nothing).
    fn diagnostics(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        if self.task.finetune {
            m.insert(
                "server_lr".into(),
                finetune_config(&self.task).train.lr.into(),
            );
        }
        m
    }

    /// The online weights, then the EMA weights.
    fn state(&self) -> ModelState {
        let mut tensors = self.offer.clone();
        tensors.extend(self.synth.model().ema_flat().unwrap_or_default());
        ModelState {
            meta: serde_json::json!({
                "model": "privorl",
                "rounds": self.rounds,
                "curve": self.curve,
            }),
            tensors,
        }
    }

    fn restore(&mut self, state: ModelState) -> Result<(), ModelError> {
        let dim = self.offer.len();
        if state.tensors.len() != 2 * dim {
            return Err(ModelError::Restore(format!(
                "the checkpoint has {} values, the online and EMA weights need {}",
                state.tensors.len(),
                2 * dim
            )));
        }
        let freqs = self
            .synth
            .model()
            .denoiser()
            .freqs()
            .map_err(|e| ModelError::Restore(e.to_string()))?;
        self.rounds = state.meta["rounds"].as_u64().unwrap_or(0);
        let model = DiffusionModel::from_parts(
            self.synth.dim(),
            finetune_config(&self.task),
            &state.tensors[..dim],
            Some((&state.tensors[dim..], self.rounds)),
            &freqs,
            self.task.model_seed ^ 0xf1ae_0000_0000_0002,
            &self.device,
        )
        .map_err(|e| ModelError::Restore(e.to_string()))?;
        *self.synth.model_mut() = model;
        self.offer = state.tensors[..dim].to_vec();
        self.curve = state.meta["curve"].as_array().cloned().unwrap_or_default();
        self.reported = self.curve.len();
        Ok(())
    }

    /// The latest held-out loss when a new one was measured since the last round.
    fn evaluate(&mut self, _round: u64) -> Option<serde_json::Value> {
        let new = self.curve.len() > self.reported;
        self.reported = self.curve.len();
        new.then(|| self.curve.last().cloned()).flatten()
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
        Some(match audit {
            Ok(r) => {
                eprintln!(
                    "operator-only (an audit reading the units' data, do not publish): membership \
                     inference TPR {:.1}% at 10% FPR, {:.1}% at 1% FPR, AUC {:.3} ({} members, {} \
                     non-members)",
                    100.0 * r.tpr_at_10pct_fpr,
                    100.0 * r.tpr_at_1pct_fpr,
                    r.auc,
                    r.members,
                    r.non_members
                );
                serde_json::json!({ "membership": {
                    "attack": "white-box denoising loss (seed 003 section IX-D), EMA weights",
                    "members": r.members,
                    "non_members": r.non_members,
                    "tpr_at_10pct_fpr": r.tpr_at_10pct_fpr,
                    "tpr_at_1pct_fpr": r.tpr_at_1pct_fpr,
                    "auc": r.auc,
                    "chance": { "tpr_at_10pct_fpr": 0.1, "tpr_at_1pct_fpr": 0.01, "auc": 0.5 },
                    "seconds": t0.elapsed().as_secs_f64(),
                } })
            }
            Err(e) => serde_json::json!({ "membership": { "error": e.to_string() } }),
        })
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
