//! The central update mode (DESIGN §2.5) on the engine thread: client agents upload their units'
//! transitions once ([`UnitData`] frames, then [`DataComplete`](fedrl_common::protocol::DataComplete)),
//! and the aggregator, as the trusted curator of the seeds' setting, computes the sampled units'
//! clipped gradients itself in one batch per round instead of sending offers.
//!
//! The engine does not know the difference: a client's units enter its population
//! (`ClientJoined`) only once all of their data is here, its offers are turned into local work,
//! and the gradients are fed back as that client's updates, so they go through the same
//! re-clipping, fixed-point sum, noise, ledger and server optimizer as federated ones. The
//! gradients come from [`unit_gradients`], the very function a federated agent runs, with the
//! same per-(round, unit) transition draw: under one seed both modes release the same
//! parameters up to float rounding.

use std::collections::HashMap;

use fedrl_common::offline::UpdateMode;
use fedrl_common::protocol::{RoundSpec, UnitData, UnitId, UnitRange};
use fedrl_common::scenario::{Scenario, Task};
use fedrl_common::task::OfflineCqlTask;
use fedrl_rl::candle_core::Device;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::dpsgd::{decode_rows, unit_gradients};
use fedrl_rl::offline::qnet::QNetSpec;
use fedrl_tasks::offline_cql::OfflineCqlTaskExt;

use crate::engine::ClientId;

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

pub(super) struct Central {
    task: OfflineCqlTask,
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

    /// Computes every pending offer's units in one batch with the offered vector `offer`.
    pub(super) fn compute(&mut self, offer: &[f32]) -> anyhow::Result<Vec<CentralUpdate>> {
        let work = std::mem::take(&mut self.work);
        let mut out = Vec::new();
        // Offers of one round share the model: one batch per round.
        let mut rounds: Vec<u64> = work.iter().map(|w| w.spec.round).collect();
        rounds.sort_unstable();
        rounds.dedup();
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
