//! The central update mode (DESIGN §2.5) on the engine thread: client agents upload their units'
//! transitions once ([`UnitData`] frames, then [`DataComplete`](fedrl_common::protocol::DataComplete)),
//! and the aggregator, as the trusted curator of the seeds' setting, computes the sampled units'
//! clipped gradients itself in one batch per round instead of sending offers.
//!
//! A client's units enter the engine's population (`ClientJoined`) only once all of their data
//! is here, and its offers are turned into local work.
//!
//! **The summed path (default for a private run).** A round's work is one computation,
//! [`summed_unit_gradients`]: per-example norms, then one weighted f64 product per layer, which
//! gives the sum of the sampled units' clipped gradients without materialising them. The sum
//! goes to the engine as one pre-summed contribution ([`Event::SumArrived`](crate::engine::Event::SumArrived)),
//! which quantises it once; the engine's noise is calibrated to that path's (slightly larger)
//! sensitivity and the ledger records it ([`crate::engine`]'s module docs).
//!
//! **The per-unit path** ([`Central::compute`]; `central_path = "per_unit"`, and what a
//! non-private twin uses, whose clip norm is infinite): every unit's clipped gradient from [`unit_gradients`], the very function a
//! federated agent runs, fed back as that client's updates through the same re-clipping and
//! per-update quantisation as federated ones. Both paths draw the same per-(round, unit)
//! transitions, so under one seed and one engine calibration they release the same parameters
//! up to float rounding (tested below).

use std::collections::HashMap;

use fedrl_common::offline::UpdateMode;
use fedrl_common::protocol::{RoundSpec, UnitData, UnitId, UnitRange};
use fedrl_common::scenario::{Scenario, Task};
use fedrl_common::task::OfflineCqlTask;
use fedrl_rl::candle_core::Device;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::dpsgd::{decode_rows, summed_unit_gradients, unit_gradients};
use fedrl_rl::offline::qnet::QNetSpec;
use fedrl_tasks::offline_cql::OfflineCqlTaskExt;

use crate::engine::{ClientId, SummedUnit};

/// A client that joined but whose units are not all uploaded yet.
struct Pending {
    units: Vec<UnitRange>,
    /// The client said it sent everything.
    complete: bool,
}

/// One offer the engine emitted, to be computed here.
struct Work {
    client: ClientId,
    spec: RoundSpec,
    units: Vec<UnitId>,
}

/// A unit's gradient computed here, to be fed to the engine as `client`'s update.
pub(super) struct CentralUpdate {
    pub(super) client: ClientId,
    pub(super) round: u64,
    pub(super) unit: UnitId,
    pub(super) data: Vec<f32>,
}

/// A round's pre-summed contribution computed here (the summed path).
pub(super) struct CentralSum {
    pub(super) round: u64,
    pub(super) units: Vec<SummedUnit>,
    /// The sum of the units' clipped gradients, f64 (operator-only).
    pub(super) sum: Vec<f64>,
}

pub(super) struct Central {
    task: OfflineCqlTask,
    /// Whether rounds go through the summed path (a private run) or the per-unit one.
    summed: bool,
    spec: QNetSpec,
    device: Device,
    /// Uploaded transitions by unit (operator-side data: never written to any output).
    data: HashMap<UnitId, TransitionBatch>,
    /// Which session uploaded each unit (a unit is hosted by one client at a time).
    owner: HashMap<UnitId, ClientId>,
    pending: HashMap<ClientId, Pending>,
    work: Vec<Work>,
}

impl Central {
    /// The central mode of `scenario`, if its task runs in it.
    pub(super) fn for_scenario(scenario: &Scenario) -> anyhow::Result<Option<Self>> {
        let Task::OfflineCql(task) = &scenario.task else {
            return Ok(None);
        };
        if task.mode != UpdateMode::Central {
            return Ok(None);
        }
        Ok(Some(Central {
            // A twin clips at +inf: no grid, no summed path. Must agree with the engine's
            // configuration (`EngineConfig::summed`), whose noise is calibrated for it.
            summed: !scenario.non_private
                && task.central_path == fedrl_common::offline::CentralPath::Summed,
            spec: task.qnet_spec()?,
            task: task.clone(),
            device: fedrl_rl::device::open(scenario.device)?,
            data: HashMap::new(),
            owner: HashMap::new(),
            pending: HashMap::new(),
            work: Vec::new(),
        }))
    }

    /// Holds a join until the client's data is complete.
    pub(super) fn hold_join(&mut self, client: ClientId, units: Vec<UnitRange>) {
        self.pending.insert(
            client,
            Pending {
                units,
                complete: false,
            },
        );
    }

    /// Stores one uploaded unit after checking it; the message says why it was refused.
    pub(super) fn unit_data(
        &mut self,
        client: ClientId,
        header: &UnitData,
        payload: &[f32],
    ) -> Result<(), String> {
        let Some(p) = self.pending.get(&client) else {
            return Err(format!(
                "unit data for unit {} after this client's upload was complete",
                header.unit
            ));
        };
        if !p.units.iter().any(|r| r.contains(header.unit)) {
            return Err(format!("unit {} is not hosted by this client", header.unit));
        }
        let batch = decode_rows(
            &self.spec,
            header.obs_dim as usize,
            header.rows as usize,
            payload,
        )
        .map_err(|e| format!("unit {}: {e}", header.unit))?;
        self.data.insert(header.unit, batch);
        self.owner.insert(header.unit, client);
        Ok(())
    }

    /// The client says it sent all `units` of its units (their frames may still be on their
    /// way: the join waits for them). A count other than the number of units it hosts is
    /// refused.
    pub(super) fn data_complete(&mut self, client: ClientId, units: u64) -> Result<(), String> {
        let Some(p) = self.pending.get_mut(&client) else {
            return Err("data complete sent twice, or before joining".into());
        };
        let hosted: u64 = p.units.iter().map(|r| r.len()).sum();
        if units != hosted {
            return Err(format!(
                "data complete after {units} unit(s), but this client hosts {hosted}: every hosted unit must upload its data"
            ));
        }
        p.complete = true;
        Ok(())
    }

    /// Clients that said they are complete and whose every unit's data is here: their joins go
    /// to the engine now.
    pub(super) fn ready(&mut self) -> Vec<(ClientId, Vec<UnitRange>)> {
        let ready: Vec<(ClientId, Vec<UnitRange>)> = self
            .pending
            .iter()
            .filter(|(client, p)| {
                p.complete
                    && p.units
                        .iter()
                        .flat_map(|r| r.start..r.end)
                        .all(|u| self.owner.get(&u) == Some(*client))
            })
            .map(|(c, p)| (*c, p.units.clone()))
            .collect();
        for (c, _) in &ready {
            self.pending.remove(c);
        }
        ready
    }

    /// Whether `client` is still uploading (its join was not given to the engine).
    pub(super) fn is_pending(&self, client: ClientId) -> bool {
        self.pending.contains_key(&client)
    }

    pub(super) fn left(&mut self, client: ClientId) {
        self.pending.remove(&client);
        self.work.retain(|w| w.client != client);
    }

    /// An offer of the engine becomes local work.
    pub(super) fn offer(&mut self, client: ClientId, spec: RoundSpec, units: Vec<UnitId>) {
        self.work.push(Work {
            client,
            spec,
            units,
        });
    }

    /// DataRelease: the released prefixes are public now; DP-SGD steps draw from the rest of
    /// each unit's data (D_unst) only.
    pub(super) fn release_prefixes(&mut self, prefixes: &[fedrl_common::protocol::ReleasedPrefix]) {
        for (unit, ranges) in fedrl_common::protocol::ReleasedPrefix::ranges_by_unit(prefixes) {
            if let Some(d) = self.data.get_mut(&unit) {
                *d = d.without_ranges(&ranges);
            }
        }
    }

    pub(super) fn has_work(&self) -> bool {
        !self.work.is_empty()
    }

    /// Whether this run's rounds go through the summed path ([`Self::compute_summed`]).
    pub(super) fn summed(&self) -> bool {
        self.summed
    }

    /// Offers of one round share the model: the pending work grouped by round, in order.
    fn rounds(&self) -> Vec<u64> {
        let mut rounds: Vec<u64> = self.work.iter().map(|w| w.spec.round).collect();
        rounds.sort_unstable();
        rounds.dedup();
        rounds
    }

    /// The summed path: every pending round's units in one computation each, giving the sum of
    /// their clipped gradients (f64) and the units it holds, with the offered vector `offer`.
    pub(super) fn compute_summed(&mut self, offer: &[f32]) -> anyhow::Result<Vec<CentralSum>> {
        let rounds = self.rounds();
        let work = std::mem::take(&mut self.work);
        let mut out = Vec::new();
        for round in rounds {
            let of_round: Vec<&Work> = work.iter().filter(|w| w.spec.round == round).collect();
            let Some(first) = of_round.first() else {
                continue;
            };
            let clip = first.spec.clip_norm;
            let mut chosen = Vec::new();
            let mut owners = Vec::new();
            // A unit offered twice in one round (a re-offer) is summed once: the engine would
            // refuse the whole sum for a duplicate.
            let mut seen = std::collections::HashSet::new();
            for w in &of_round {
                for u in &w.units {
                    if !seen.insert(*u) {
                        continue;
                    }
                    if let Some(d) = self.data.get(u) {
                        chosen.push((*u, d));
                        owners.push(w.client);
                    }
                }
            }
            let g = summed_unit_gradients(
                &self.spec,
                &self.task.cql,
                offer,
                &chosen,
                round,
                self.task.data_seed,
                self.task.transitions_per_unit,
                clip,
                &self.device,
            )?;
            // Norms and clip factors follow the units with data, in order; a unit without data
            // contributes zero.
            let mut stats = g.norms.iter().zip(&g.clip_factors);
            let mut units = Vec::with_capacity(chosen.len());
            for ((unit, data), client) in chosen.iter().zip(owners) {
                let (norm, clipped) = if data.is_empty() {
                    (0.0, false)
                } else {
                    let (n, s) = stats
                        .next()
                        .ok_or_else(|| anyhow::anyhow!("summed path: fewer norms than units"))?;
                    (*n, *s < 1.0)
                };
                units.push(SummedUnit {
                    client,
                    unit: *unit,
                    norm,
                    clipped,
                });
            }
            out.push(CentralSum {
                round,
                units,
                sum: g.sum,
            });
        }
        Ok(out)
    }

    /// The per-unit path: every pending offer's units in one batch with the offered vector
    /// `offer`, each unit's clipped gradient materialised.
    pub(super) fn compute(&mut self, offer: &[f32]) -> anyhow::Result<Vec<CentralUpdate>> {
        let rounds = self.rounds();
        let work = std::mem::take(&mut self.work);
        let mut out = Vec::new();
        for round in rounds {
            let of_round: Vec<&Work> = work.iter().filter(|w| w.spec.round == round).collect();
            let Some(first) = of_round.first() else {
                continue;
            };
            let clip = first.spec.clip_norm;
            let mut owners = Vec::new();
            let mut chosen = Vec::new();
            for w in &of_round {
                for u in &w.units {
                    if let Some(d) = self.data.get(u) {
                        chosen.push((*u, d));
                        owners.push(w.client);
                    }
                }
            }
            let grads = unit_gradients(
                &self.spec,
                &self.task.cql,
                offer,
                &chosen,
                round,
                self.task.data_seed,
                self.task.transitions_per_unit,
                clip,
                &self.device,
            )?;
            for ((unit, data), client) in grads.into_iter().zip(owners) {
                out.push(CentralUpdate {
                    client,
                    round,
                    unit,
                    data,
                });
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fedrl_rl::offline::dpsgd::encode_rows;

    fn central() -> Central {
        let scenario = fedrl_tasks::scenario_from_toml_str(
            r#"
users = 4
participation = { kind = "sampled", rate = 0.5 }
unit_kind = "trajectory"
[task]
kind = "offline_cql"
mode = "central"
[task.dataset]
units = 4
behaviour = { kind = "random" }
[task.cql]
hidden = [8]
"#,
        )
        .unwrap();
        Central::for_scenario(&scenario)
            .unwrap()
            .expect("central mode")
    }

    fn rows(n: usize) -> (UnitData, Vec<f32>) {
        let mut b = TransitionBatch::new(4);
        for i in 0..n {
            b.obs.extend([0.1, 0.2, 0.3, i as f32]);
            b.next_obs.extend([0.2, 0.3, 0.4, i as f32]);
            b.actions.push((i % 2) as u32);
            b.rewards.push(1.0);
            b.terminals.push(0.0);
        }
        let header = UnitData {
            unit: 0,
            rows: n as u32,
            obs_dim: 4,
        };
        (header, encode_rows(&b))
    }

    /// Under one seed and one engine configuration, the summed path (one pre-summed
    /// contribution, quantised once) releases what the per-unit path (every unit's clipped
    /// gradient, quantised one by one) releases, to float tolerance; the ledger records are
    /// identical (the engine's noise is calibrated to the summed sensitivity either way).
    #[test]
    fn the_summed_path_releases_what_the_per_unit_path_releases() {
        use crate::engine::{Action, Engine, Event, Resume, SeededEntropy};
        let scenario = fedrl_tasks::scenario_from_toml_str(
            r#"
users = 6
participation = { kind = "sampled", rate = 1.0 }
unit_kind = "trajectory"
clip_norm = 0.05
noise_multiplier = 1.0
[task]
kind = "offline_cql"
mode = "central"
transitions_per_unit = 2
[task.dataset]
units = 6
behaviour = { kind = "random" }
[task.cql]
hidden = [8]
"#,
        )
        .unwrap();
        let cfg = crate::engine_config(&scenario).unwrap();
        assert!(
            cfg.summed.is_some(),
            "central private runs take the summed path"
        );
        // Each path with its own engine, same configuration and seed.
        let mut releases = Vec::new();
        let mut records = Vec::new();
        for summed in [false, true] {
            let mut c = Central::for_scenario(&scenario).unwrap().unwrap();
            assert!(c.summed());
            c.hold_join(1, vec![UnitRange { start: 0, end: 6 }]);
            for u in 0..6u64 {
                let (mut h, mut p) = rows(3 + u as usize);
                // Different data per unit (rewards), some with large gradients (clipped).
                for (i, v) in p.chunks_mut(11).enumerate() {
                    v[9] = (u as f32 - 2.5) * (1.0 + i as f32);
                }
                h.unit = u;
                c.unit_data(1, &h, &p).unwrap();
            }
            c.data_complete(1, 6).unwrap();
            let (client, units) = c.ready().pop().unwrap();
            let mut e = Engine::new(
                cfg.clone(),
                Resume::default(),
                Box::new(SeededEntropy::new(9)),
            )
            .unwrap();
            let mut a = e.handle(0.0, Event::ClientJoined { client, units });
            for act in std::mem::take(&mut a) {
                if let Action::SendOffer {
                    client,
                    spec,
                    units,
                } = act
                {
                    c.offer(client, spec, units);
                }
            }
            let mut offer = c.spec.init(3);
            offer.extend(c.spec.init(4));
            if summed {
                for s in c.compute_summed(&offer).unwrap() {
                    assert_eq!(s.units.len(), 6);
                    a.extend(e.handle_sum(1.0, s.round, &s.units, &s.sum));
                }
            } else {
                for mut u in c.compute(&offer).unwrap() {
                    a.extend(e.handle_update(1.0, u.client, u.round, u.unit, &mut u.data));
                }
            }
            // Some unit must be clipped: the summed path reports it; the per-unit path's vectors
            // arrive clipped already, at norm C.
            let clipped = a
                .iter()
                .filter(|x| match x {
                    Action::Accepted { clipped, norm, .. } => *clipped || *norm > 0.05 * 0.999,
                    _ => false,
                })
                .count();
            assert!(clipped >= 1, "some unit must be clipped: {a:?}");
            let rec = a
                .iter()
                .find_map(|x| match x {
                    Action::AppendLedger { record, .. } => Some(record.clone()),
                    _ => None,
                })
                .expect("the round closes");
            records.push(rec.event.clone());
            let rel = e
                .handle(1.0, Event::LedgerAppended { round: 1 })
                .into_iter()
                .find_map(|x| match x {
                    Action::Release(r) => Some(r),
                    _ => None,
                })
                .expect("released");
            assert_eq!(rel.accepted, 6);
            releases.push(rel.noisy_mean);
        }
        assert_eq!(records[0], records[1]);
        let (per_unit, summed) = (&releases[0], &releases[1]);
        let mut max_diff = 0f32;
        for (a, b) in per_unit.iter().zip(summed) {
            max_diff = max_diff.max((a - b).abs());
        }
        // The noise is ~z C / 6 ~ 8e-3 per coordinate; the paths differ by float rounding.
        assert!(max_diff <= 1e-6, "max |per-unit - summed| = {max_diff:e}");
        assert!(per_unit.iter().any(|v| v.abs() > 1e-3), "noise was added");
    }

    #[test]
    fn a_join_waits_for_every_units_data_and_the_declared_count() {
        let mut c = central();
        c.hold_join(7, vec![UnitRange { start: 0, end: 2 }]);
        let (mut h, p) = rows(3);
        c.unit_data(7, &h, &p).unwrap();
        // Complete with the wrong count: refused; with the right one: still waiting for unit 1.
        assert!(c.data_complete(7, 1).unwrap_err().contains("hosts 2"));
        c.data_complete(7, 2).unwrap();
        assert!(c.ready().is_empty());
        assert!(c.is_pending(7));
        h.unit = 1;
        c.unit_data(7, &h, &p).unwrap();
        let ready = c.ready();
        assert_eq!(ready, vec![(7, vec![UnitRange { start: 0, end: 2 }])]);
        assert!(!c.is_pending(7));
        // After the join, more data for its units is refused (the population is fixed).
        assert!(c.unit_data(7, &h, &p).is_err());
    }

    #[test]
    fn bad_uploads_are_refused_with_a_reason_and_change_nothing() {
        let mut c = central();
        c.hold_join(1, vec![UnitRange { start: 0, end: 1 }]);
        let (mut h, p) = rows(2);
        h.unit = 3;
        assert!(c.unit_data(1, &h, &p).unwrap_err().contains("not hosted"));
        h.unit = 0;
        h.rows = 3;
        assert!(c.unit_data(1, &h, &p).unwrap_err().contains("payload"));
        h.rows = 2;
        let mut bad = p.clone();
        bad[8] = 5.0; // action of row 0 out of range (2 actions)
        assert!(c.unit_data(1, &h, &bad).unwrap_err().contains("action"));
        assert!(c.data.is_empty());
        // Data from a client that never joined.
        assert!(c.unit_data(9, &h, &p).is_err());
        assert!(c.data_complete(9, 1).is_err());
        c.unit_data(1, &h, &p).unwrap();
        c.data_complete(1, 1).unwrap();
        assert_eq!(c.ready().len(), 1);
    }

    #[test]
    fn offers_become_one_batch_of_clipped_gradients() {
        let mut c = central();
        c.hold_join(1, vec![UnitRange { start: 0, end: 2 }]);
        let (mut h, p) = rows(3);
        c.unit_data(1, &h, &p).unwrap();
        h.unit = 1;
        c.unit_data(1, &h, &p).unwrap();
        let spec = RoundSpec {
            round: 1,
            dim: c.spec.dim() as u32,
            offer_dim: 2 * c.spec.dim() as u32,
            clip_norm: 0.01,
            deadline_s: 1.0,
        };
        c.offer(1, spec, vec![0, 1]);
        assert!(c.has_work());
        let mut offer = c.spec.init(0);
        offer.extend(c.spec.init(0));
        let ups = c.compute(&offer).unwrap();
        assert!(!c.has_work());
        assert_eq!(ups.iter().map(|u| u.unit).collect::<Vec<_>>(), vec![0, 1]);
        for u in &ups {
            assert_eq!((u.client, u.round), (1, 1));
            let n: f64 = u
                .data
                .iter()
                .map(|v| (*v as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            assert!(n <= 0.01 * (1.0 + 1e-6), "{n}");
        }
    }
}
