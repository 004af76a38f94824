//! The central update mode (DESIGN §2.5) on the engine thread: client agents upload their units'
//! transitions once ([`UnitData`] frames, then [`DataComplete`](fedrl_common::protocol::DataComplete)),
//! and the aggregator, as the trusted curator of the seeds' setting, computes the sampled units'
//! clipped gradients itself in one batch per round instead of sending offers.
//!
//! A client's units enter the engine's population (`ClientJoined`) only once all of their data
//! is here, and its offers are turned into local work.
//!
//! **Who may upload what (issue 59).** A join is checked when it arrives, by the engine's own
//! rule ([`resolve_units`]) against the units the engine hosts and the units other sessions
//! still uploading have claimed: units outside the population, or claimed by another session,
//! refuse the join at once. A unit's data is accepted only from the session that claimed it,
//! and only while that session uploads; data already complete (a unit whose earlier session
//! finished its upload and was admitted) is never replaced: a re-upload of it by the unit's
//! next host is checked for its size and dropped. Uploads stay with their session until its
//! upload is complete and every unit's data is here; a session that leaves before that takes
//! its uploads with it (freed at once).
//!
//! **Memory bounds** ([`UploadLimits`], from the scenario's data shape): a unit's upload may
//! hold at most `max_unit_rows` transitions (the task kind's public bound,
//! `fedrl_tasks::CentralGradients::max_unit_rows`; offline CQL: episodes per unit x the
//! environment's step limit), i.e. `unit_bytes`; a session's pending uploads at most
//! `unit_bytes` x the units it claimed; all sessions' pending uploads together at most
//! `unit_bytes` x the population. The aggregator thus never holds more than about twice the
//! whole dataset (complete plus pending) however clients behave; an upload past a bound is
//! refused with the numbers.
//!
//! **Units left out of a step.** A unit whose gradient is not finite at some step is left out
//! of it, by id ([`ExcludedUnit`]); why that keeps the privacy guarantee is in
//! [`crate::engine`]'s module docs ("Excluding a unit").
//!
//! **The summed path (default for a private run).** A round's work is one computation,
//! the task kind's `CentralGradients::summed`: per-example norms, then one weighted f64 product per layer, which
//! gives the sum of the sampled units' clipped gradients without materialising them. The sum
//! goes to the engine as one pre-summed contribution ([`Event::SumArrived`](crate::engine::Event::SumArrived)),
//! which quantises it once; the engine's noise is calibrated to that path's (slightly larger)
//! sensitivity and the ledger records it ([`crate::engine`]'s module docs).
//!
//! **The per-unit path** ([`Central::compute`]; `central_path = "per_unit"`, and what a
//! non-private twin uses, whose clip norm is infinite): every unit's clipped gradient from the
//! kind's `CentralGradients::per_unit`, the very function a federated agent runs, fed back as that client's updates through the same re-clipping and
//! per-update quantisation as federated ones. Both paths draw the same per-(round, unit)
//! transitions, so under one seed and one engine calibration they release the same parameters
//! up to float rounding (tested below).

use std::collections::{BTreeMap, HashMap, HashSet};

use fedrl_common::protocol::{RoundSpec, UnitData, UnitId, UnitRange};
use fedrl_common::scenario::Scenario;
use fedrl_rl::offline::TransitionBatch;
use fedrl_rl::offline::dpsgd::{decode_rows, row_width, without_non_finite_units};
use fedrl_tasks::CentralGradients;

use crate::engine::{ClientId, SummedUnit, resolve_units};

/// The public bounds on what the central mode holds in memory, derived from the scenario's data
/// shape (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct UploadLimits {
    /// Transitions one unit's upload may hold: `episodes_per_unit` x the step limit of an
    /// episode.
    pub(super) max_unit_rows: u64,
    /// Bytes one unit's decoded transitions take at most (`max_unit_rows` rows of
    /// `2 obs_dim + 3` four-byte values).
    pub(super) unit_bytes: u64,
    /// The population (units `0..population`): all pending uploads together hold at most
    /// `population x unit_bytes`.
    pub(super) population: u64,
}

impl UploadLimits {
    fn new(max_unit_rows: u64, obs_dim: usize, population: u64) -> Self {
        UploadLimits {
            max_unit_rows,
            unit_bytes: max_unit_rows.saturating_mul(4 * row_width(obs_dim) as u64),
            population,
        }
    }

    /// The most a session claiming `units` units may hold in pending uploads.
    fn session_bytes(&self, units: u64) -> u64 {
        units.saturating_mul(self.unit_bytes)
    }

    /// The most all sessions' pending uploads together may hold.
    fn total_bytes(&self) -> u64 {
        self.population.saturating_mul(self.unit_bytes)
    }
}

/// Bytes a decoded unit's transitions take (what the bounds count).
fn batch_bytes(b: &TransitionBatch) -> u64 {
    (b.len() * 4 * row_width(b.obs_dim)) as u64
}

/// A session that joined but whose units are not all uploaded yet.
struct Pending {
    /// The units it claimed (resolved, within the population, nobody else's).
    units: Vec<UnitRange>,
    /// The client said it sent everything.
    complete: bool,
    /// Its uploads, kept apart until its upload is complete (freed if it leaves before).
    uploads: HashMap<UnitId, TransitionBatch>,
    /// Its units whose data was complete already (kept from an earlier session) and which it
    /// sent again: counted as here, not stored.
    resent: HashSet<UnitId>,
    /// Bytes of `uploads`.
    bytes: u64,
}

impl Pending {
    fn claimed(&self) -> u64 {
        self.units.iter().map(|r| r.len()).sum()
    }
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

/// A unit left out of a round's step because its gradient is not finite (operator-only).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct ExcludedUnit {
    pub(super) client: ClientId,
    pub(super) round: u64,
    pub(super) unit: UnitId,
    pub(super) reason: String,
}

/// A round's pre-summed contribution computed here (the summed path).
pub(super) struct CentralSum {
    pub(super) round: u64,
    pub(super) units: Vec<SummedUnit>,
    /// The sum of the units' clipped gradients, f64 (operator-only).
    pub(super) sum: Vec<f64>,
    /// The mean training loss of the round's rows at the offered parameters, where the kind's
    /// computation gives it (operator-only: a statistic of the units' data).
    pub(super) loss: Option<f64>,
}

/// The reason logged for a unit left out of a step.
const NON_FINITE: &str = "its gradient is not finite (its uploaded data overflows the network, or the model diverged on it)";

pub(super) struct Central {
    /// The task kind's computation (`fedrl_tasks::central_gradients`).
    grads: Box<dyn CentralGradients>,
    /// Whether rounds go through the summed path (a private run) or the per-unit one.
    summed: bool,
    limits: UploadLimits,
    /// Complete data by unit: the units of sessions whose upload was complete (operator-side
    /// data: never written to any output). Never replaced.
    data: HashMap<UnitId, TransitionBatch>,
    /// Sessions still uploading.
    pending: HashMap<ClientId, Pending>,
    /// Bytes of every pending session's uploads.
    pending_bytes: u64,
    /// Released prefixes by unit (DataRelease): cut from a unit's data when it is admitted
    /// after the release, as from data already here.
    released: BTreeMap<UnitId, Vec<(usize, usize)>>,
    work: Vec<Work>,
}

impl Central {
    /// The central mode of `scenario`, if its task runs in it.
    pub(super) fn for_scenario(scenario: &Scenario) -> anyhow::Result<Option<Self>> {
        let Some(grads) = fedrl_tasks::central_gradients(scenario)? else {
            return Ok(None);
        };
        let limits = UploadLimits::new(
            grads.max_unit_rows(),
            grads.row_spec().obs_dim,
            scenario.users,
        );
        Ok(Some(Central {
            // A twin clips at +inf: no grid, no summed path. The same rule as the engine's
            // configuration (`EngineConfig::summed`), whose noise is calibrated for it.
            summed: scenario.summed_bound().is_some(),
            grads,
            limits,
            data: HashMap::new(),
            pending: HashMap::new(),
            pending_bytes: 0,
            released: BTreeMap::new(),
            work: Vec::new(),
        }))
    }

    /// Holds a join until the client's data is complete. Its units are checked now, by the
    /// engine's rule, against the units the engine hosts (`hosted`: start -> (end, client)) and
    /// those other sessions still uploading claimed: `Err` says why the join is refused.
    pub(super) fn hold_join(
        &mut self,
        client: ClientId,
        units: Vec<UnitRange>,
        hosted: &BTreeMap<UnitId, (UnitId, ClientId)>,
    ) -> Result<(), String> {
        if self.pending.contains_key(&client) {
            return Err(format!("session {client} already joined"));
        }
        let mut taken = hosted.clone();
        for (c, p) in &self.pending {
            for r in &p.units {
                taken.insert(r.start, (r.end, *c));
            }
        }
        let units = resolve_units(&units, &taken, self.limits.population)?;
        self.pending.insert(
            client,
            Pending {
                units,
                complete: false,
                uploads: HashMap::new(),
                resent: HashSet::new(),
                bytes: 0,
            },
        );
        Ok(())
    }

    /// Stores one uploaded unit after checking it; the message says why it was refused.
    pub(super) fn unit_data(
        &mut self,
        client: ClientId,
        header: &UnitData,
        payload: &[f32],
    ) -> Result<(), String> {
        let unit = header.unit;
        let Some(p) = self.pending.get_mut(&client) else {
            return Err(format!(
                "unit data for unit {unit} after this client's upload was complete (or before it joined)"
            ));
        };
        if !p.units.iter().any(|r| r.contains(unit)) {
            return Err(format!(
                "unit {unit} is not hosted by this client (it claimed {})",
                p.units
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if u64::from(header.rows) > self.limits.max_unit_rows {
            return Err(format!(
                "unit {unit}: {} rows, more than a unit of this dataset can hold ({}: episodes per unit x the environment's step limit)",
                header.rows, self.limits.max_unit_rows
            ));
        }
        let batch = decode_rows(
            self.grads.row_spec(),
            header.obs_dim as usize,
            header.rows as usize,
            payload,
        )
        .map_err(|e| format!("unit {unit}: {e}"))?;
        if self.data.contains_key(&unit) {
            // Complete already (an earlier session of its host): kept, never replaced.
            p.resent.insert(unit);
            return Ok(());
        }
        let bytes = batch_bytes(&batch);
        let old = p.uploads.get(&unit).map_or(0, batch_bytes);
        let session = p.bytes - old + bytes;
        let session_max = self.limits.session_bytes(p.claimed());
        if session > session_max {
            return Err(format!(
                "unit {unit}: this session's pending uploads would hold {session} bytes, above its bound of {session_max} ({} claimed units x {} bytes)",
                p.claimed(),
                self.limits.unit_bytes
            ));
        }
        let total = self.pending_bytes - old + bytes;
        if total > self.limits.total_bytes() {
            return Err(format!(
                "unit {unit}: pending uploads would hold {total} bytes, above the bound of {} (population {} x {} bytes)",
                self.limits.total_bytes(),
                self.limits.population,
                self.limits.unit_bytes
            ));
        }
        p.uploads.insert(unit, batch);
        p.bytes = session;
        self.pending_bytes = total;
        Ok(())
    }

    /// The client says it sent all `units` of its units (their frames may still be on their
    /// way: the join waits for them). A count other than the number of units it hosts is
    /// refused.
    pub(super) fn data_complete(&mut self, client: ClientId, units: u64) -> Result<(), String> {
        let Some(p) = self.pending.get_mut(&client) else {
            return Err("data complete sent twice, or before joining".into());
        };
        let hosted = p.claimed();
        if units != hosted {
            return Err(format!(
                "data complete after {units} unit(s), but this client hosts {hosted}: every hosted unit must upload its data"
            ));
        }
        p.complete = true;
        Ok(())
    }

    /// Clients that said they are complete and whose every unit's data is here: their data
    /// joins the complete data (released prefixes cut) and their joins go to the engine now.
    pub(super) fn ready(&mut self) -> Vec<(ClientId, Vec<UnitRange>)> {
        let ready: Vec<ClientId> = self
            .pending
            .iter()
            .filter(|(_, p)| {
                p.complete
                    && p.units.iter().flat_map(|r| r.start..r.end).all(|u| {
                        p.uploads.contains_key(&u)
                            || (p.resent.contains(&u) && self.data.contains_key(&u))
                    })
            })
            .map(|(c, _)| *c)
            .collect();
        let mut out = Vec::with_capacity(ready.len());
        for c in ready {
            let Some(p) = self.pending.remove(&c) else {
                continue;
            };
            self.pending_bytes -= p.bytes;
            for (unit, batch) in p.uploads {
                let batch = match self.released.get(&unit) {
                    Some(ranges) => batch.without_ranges(ranges),
                    None => batch,
                };
                self.data.entry(unit).or_insert(batch);
            }
            out.push((c, p.units));
        }
        out
    }

    /// Whether `client` is still uploading (its join was not given to the engine).
    pub(super) fn is_pending(&self, client: ClientId) -> bool {
        self.pending.contains_key(&client)
    }

    /// `client` left: its incomplete uploads are freed, its work dropped.
    pub(super) fn left(&mut self, client: ClientId) {
        if let Some(p) = self.pending.remove(&client) {
            self.pending_bytes -= p.bytes;
        }
        self.work.retain(|w| w.client != client);
    }

    /// Bytes held in pending (incomplete) uploads, all sessions together.
    #[cfg(test)]
    fn pending_bytes(&self) -> u64 {
        self.pending_bytes
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
    /// each unit's data (D_unst) only, for data here and data admitted later alike.
    pub(super) fn release_prefixes(&mut self, prefixes: &[fedrl_common::protocol::ReleasedPrefix]) {
        for (unit, ranges) in fedrl_common::protocol::ReleasedPrefix::ranges_by_unit(prefixes) {
            if let Some(d) = self.data.get_mut(&unit) {
                *d = d.without_ranges(&ranges);
            }
            self.released.insert(unit, ranges);
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

    /// The offered vector must be finite: a non-finite model would make every unit's gradient
    /// non-finite, which is the model's failure, not the units'.
    fn check_offer(offer: &[f32]) -> anyhow::Result<()> {
        if let Some(i) = offer.iter().position(|v| !v.is_finite()) {
            anyhow::bail!(
                "the model has a non-finite parameter (index {i}): training diverged; no unit's gradient can be computed"
            );
        }
        Ok(())
    }

    /// The summed path: every pending round's units in one computation each, giving the sum of
    /// their clipped gradients (f64) and the units it holds, with the offered vector `offer`,
    /// and the units left out because their gradient is not finite.
    pub(super) fn compute_summed(
        &mut self,
        offer: &[f32],
    ) -> anyhow::Result<(Vec<CentralSum>, Vec<ExcludedUnit>)> {
        self.each_round(offer, |me, round, clip, chosen, owner| {
            let (g, left_out) =
                without_non_finite_units(chosen, |c| me.grads.summed(offer, c, round, clip))?;
            // Norms and clip factors follow the units kept that have data, in order; a unit
            // without data contributes zero.
            let mut stats = g.norms.iter().zip(&g.clip_factors);
            let mut units = Vec::with_capacity(chosen.len());
            for (unit, data) in chosen.iter().filter(|(u, _)| !left_out.contains(u)) {
                let (norm, clipped) = if data.is_empty() {
                    (0.0, false)
                } else {
                    let (n, s) = stats
                        .next()
                        .ok_or_else(|| anyhow::anyhow!("summed path: fewer norms than units"))?;
                    (*n, *s < 1.0)
                };
                units.push(SummedUnit {
                    client: owner[unit],
                    unit: *unit,
                    norm,
                    clipped,
                });
            }
            let sum = CentralSum {
                round,
                units,
                sum: g.sum,
                loss: g.mean_loss,
            };
            Ok((vec![sum], left_out))
        })
    }

    /// Takes the pending work and, round by round, hands `step` the round, its clip norm, the
    /// round's units with data ([`Self::gather`]) and each unit's client; `step` returns the
    /// round's results and the units it left out because their gradient is not finite, which
    /// become [`ExcludedUnit`]s.
    #[allow(clippy::type_complexity)]
    fn each_round<R>(
        &mut self,
        offer: &[f32],
        mut step: impl FnMut(
            &Self,
            u64,
            f64,
            &[(UnitId, &TransitionBatch)],
            &HashMap<UnitId, ClientId>,
        ) -> anyhow::Result<(Vec<R>, Vec<UnitId>)>,
    ) -> anyhow::Result<(Vec<R>, Vec<ExcludedUnit>)> {
        Self::check_offer(offer)?;
        let rounds = self.rounds();
        let work = std::mem::take(&mut self.work);
        let mut out = Vec::new();
        let mut excluded = Vec::new();
        for round in rounds {
            let of_round: Vec<&Work> = work.iter().filter(|w| w.spec.round == round).collect();
            let Some(first) = of_round.first() else {
                continue;
            };
            let (chosen, owner) = self.gather(&of_round);
            let (results, left_out) = step(self, round, first.spec.clip_norm, &chosen, &owner)?;
            out.extend(results);
            excluded.extend(left_out.into_iter().map(|unit| ExcludedUnit {
                client: owner[&unit],
                round,
                unit,
                reason: NON_FINITE.into(),
            }));
        }
        Ok((out, excluded))
    }

    /// The units of one round's work that have data, in the order the work lists them, each
    /// once (a re-offer lists a unit again: it contributes once, and the engine would refuse a
    /// sum or an update that counts it twice), with the client each was offered to.
    fn gather<'a>(
        &'a self,
        of_round: &[&Work],
    ) -> (
        Vec<(UnitId, &'a TransitionBatch)>,
        HashMap<UnitId, ClientId>,
    ) {
        let mut chosen = Vec::new();
        let mut owner = HashMap::new();
        let mut seen = HashSet::new();
        for w in of_round {
            for u in &w.units {
                if !seen.insert(*u) {
                    continue;
                }
                if let Some(d) = self.data.get(u) {
                    chosen.push((*u, d));
                    owner.insert(*u, w.client);
                }
            }
        }
        (chosen, owner)
    }

    /// The per-unit path: every pending offer's units in one batch with the offered vector
    /// `offer`, each unit's clipped gradient materialised, and the units left out because
    /// their gradient is not finite.
    pub(super) fn compute(
        &mut self,
        offer: &[f32],
    ) -> anyhow::Result<(Vec<CentralUpdate>, Vec<ExcludedUnit>)> {
        self.each_round(offer, |me, round, clip, chosen, owner| {
            let (grads, left_out) =
                without_non_finite_units(chosen, |c| me.grads.per_unit(offer, c, round, clip))?;
            let updates = grads
                .into_iter()
                .map(|(unit, data)| CentralUpdate {
                    client: owner[&unit],
                    round,
                    unit,
                    data,
                })
                .collect();
            Ok((updates, left_out))
        })
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

    fn none() -> BTreeMap<UnitId, (UnitId, ClientId)> {
        BTreeMap::new()
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
            c.hold_join(1, vec![UnitRange { start: 0, end: 6 }], &none())
                .unwrap();
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
            let mut offer = c.grads.row_spec().init(3);
            offer.extend(c.grads.row_spec().init(4));
            if summed {
                for s in c.compute_summed(&offer).unwrap().0 {
                    assert_eq!(s.units.len(), 6);
                    a.extend(e.handle_sum(1.0, s.round, &s.units, &s.sum));
                }
            } else {
                for mut u in c.compute(&offer).unwrap().0 {
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
        c.hold_join(7, vec![UnitRange { start: 0, end: 2 }], &none())
            .unwrap();
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
        c.hold_join(1, vec![UnitRange { start: 0, end: 1 }], &none())
            .unwrap();
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
        c.hold_join(1, vec![UnitRange { start: 0, end: 2 }], &none())
            .unwrap();
        let (mut h, p) = rows(3);
        c.unit_data(1, &h, &p).unwrap();
        h.unit = 1;
        c.unit_data(1, &h, &p).unwrap();
        c.data_complete(1, 2).unwrap();
        assert_eq!(c.ready().len(), 1);
        let spec = RoundSpec {
            round: 1,
            dim: c.grads.row_spec().dim() as u32,
            offer_dim: 2 * c.grads.row_spec().dim() as u32,
            clip_norm: 0.01,
            deadline_s: 1.0,
        };
        c.offer(1, spec, vec![0, 1]);
        assert!(c.has_work());
        let mut offer = c.grads.row_spec().init(0);
        offer.extend(c.grads.row_spec().init(0));
        let (ups, excluded) = c.compute(&offer).unwrap();
        assert!(excluded.is_empty());
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

    /// Issue 59, item 2: a client claiming units another session claimed (or the engine hosts)
    /// is refused at its join, so it can upload nothing for them; complete data is never
    /// replaced, not even by the units' next host.
    #[test]
    fn unit_data_comes_only_from_the_units_host_and_complete_data_is_kept() {
        let mut c = central();
        c.hold_join(1, vec![UnitRange { start: 0, end: 2 }], &none())
            .unwrap();
        // Another session claiming the same units while 1 uploads: refused at once.
        let e = c
            .hold_join(2, vec![UnitRange { start: 1, end: 3 }], &none())
            .unwrap_err();
        assert!(e.contains("hosted by another client"), "{e}");
        assert!(!c.is_pending(2));
        let (mut h, p) = rows(3);
        assert!(c.unit_data(2, &h, &p).is_err());
        // The honest host completes; its units join.
        c.unit_data(1, &h, &p).unwrap();
        h.unit = 1;
        c.unit_data(1, &h, &p).unwrap();
        c.data_complete(1, 2).unwrap();
        assert_eq!(c.ready().len(), 1);
        let honest = c.data[&1].clone();
        // While the engine hosts them, nobody else may claim them (nor take "every unit").
        let mut hosted = none();
        hosted.insert(0, (2, 1));
        let e = c
            .hold_join(3, vec![UnitRange { start: 0, end: 1 }], &hosted)
            .unwrap_err();
        assert!(e.contains("hosted by another client"), "{e}");
        c.hold_join(3, vec![], &hosted).unwrap();
        // "Every unit nobody hosts" resolved to 2..4, never 0..2.
        let (mut other, bad) = rows(5);
        other.unit = 1;
        assert!(
            c.unit_data(3, &other, &bad)
                .unwrap_err()
                .contains("not hosted")
        );
        c.left(3);
        // The host left (engine hosts nothing); its next session re-sends different data for
        // unit 1: accepted as sent, but the complete data stays.
        c.hold_join(4, vec![UnitRange { start: 0, end: 2 }], &none())
            .unwrap();
        c.unit_data(4, &other, &bad).unwrap();
        other.unit = 0;
        c.unit_data(4, &other, &bad).unwrap();
        c.data_complete(4, 2).unwrap();
        assert_eq!(c.ready(), vec![(4, vec![UnitRange { start: 0, end: 2 }])]);
        assert_eq!(c.data[&1], honest, "complete data was replaced");
        assert_eq!(c.data[&1].len(), 3);
        assert_eq!(c.pending_bytes(), 0);
    }

    /// Issue 59, item 3: units outside the population are refused at the join; one unit's
    /// upload is bounded by the dataset's shape (episodes per unit x the step limit); a
    /// session's pending uploads are freed when it leaves; the totals stay within their bounds.
    #[test]
    fn uploads_are_bounded_and_freed_when_their_session_leaves() {
        let mut c = central();
        // CartPole-v1 (the default env): 1 episode of at most 500 steps per unit, 11 values a
        // row of 4 bytes.
        assert_eq!(c.limits.max_unit_rows, 500);
        assert_eq!(c.limits.unit_bytes, 500 * 11 * 4);
        assert_eq!(c.limits.total_bytes(), 4 * 500 * 11 * 4);
        let e = c
            .hold_join(
                1,
                vec![UnitRange {
                    start: 2,
                    end: 20000,
                }],
                &none(),
            )
            .unwrap_err();
        assert!(e.contains("outside the population 0..4"), "{e}");
        c.hold_join(1, vec![UnitRange { start: 0, end: 2 }], &none())
            .unwrap();
        // More rows than a unit can hold: refused before decoding, nothing stored.
        let (h, p) = rows(501);
        let e = c.unit_data(1, &h, &p).unwrap_err();
        assert!(e.contains("501 rows") && e.contains("500"), "{e}");
        assert_eq!(c.pending_bytes(), 0);
        // At the bound: fine; uploading the same unit again replaces its pending copy.
        let (h, p) = rows(500);
        c.unit_data(1, &h, &p).unwrap();
        c.unit_data(1, &h, &p).unwrap();
        assert_eq!(c.pending_bytes(), 500 * 11 * 4);
        let (mut h, p) = rows(10);
        h.unit = 20000;
        assert!(c.unit_data(1, &h, &p).unwrap_err().contains("not hosted"));
        // Never complete; the session leaves: everything it uploaded is freed.
        c.left(1);
        assert_eq!(c.pending_bytes(), 0);
        assert!(c.data.is_empty());
        assert!(!c.is_pending(1));
        // The bounds' arithmetic: a session may hold its claimed units' worth, the pending
        // total the population's.
        let l = UploadLimits::new(500, 4, 10_000);
        assert_eq!(l.session_bytes(3), 3 * 22_000);
        assert_eq!(l.total_bytes(), 10_000 * 22_000);
    }

    /// Issue 59, item 1: a unit whose uploaded rows make its gradient non-finite (observations
    /// of 1e30) is left out of the step by its id and client, on both paths; the other units'
    /// contributions are computed as without it. Before, the whole step failed ("unit 1:
    /// gradient norm is not finite", a batch position) and the aggregator exited.
    #[test]
    fn a_unit_with_absurd_data_is_left_out_of_the_step_by_id() {
        let mut c = central();
        c.hold_join(1, vec![UnitRange { start: 0, end: 2 }], &none())
            .unwrap();
        c.hold_join(2, vec![UnitRange { start: 2, end: 4 }], &none())
            .unwrap();
        for u in 0..4u64 {
            let (mut h, mut p) = rows(3);
            h.unit = u;
            if u == 3 {
                for (i, v) in p.iter_mut().enumerate() {
                    if i % 11 < 8 {
                        *v = 1e30;
                    }
                }
            }
            c.unit_data(if u < 2 { 1 } else { 2 }, &h, &p).unwrap();
        }
        c.data_complete(1, 2).unwrap();
        c.data_complete(2, 2).unwrap();
        assert_eq!(c.ready().len(), 2);
        let spec = RoundSpec {
            round: 1,
            dim: c.grads.row_spec().dim() as u32,
            offer_dim: 2 * c.grads.row_spec().dim() as u32,
            clip_norm: 0.01,
            deadline_s: 1.0,
        };
        let mut offer = c.grads.row_spec().init(0);
        offer.extend(c.grads.row_spec().init(0));
        for summed in [true, false] {
            c.offer(1, spec.clone(), vec![0, 1]);
            c.offer(2, spec.clone(), vec![2, 3]);
            let (kept, excluded) = if summed {
                let (sums, excluded) = c.compute_summed(&offer).unwrap();
                assert!(sums[0].sum.iter().all(|v| v.is_finite()));
                (
                    sums[0].units.iter().map(|u| u.unit).collect::<Vec<_>>(),
                    excluded,
                )
            } else {
                let (ups, excluded) = c.compute(&offer).unwrap();
                (ups.iter().map(|u| u.unit).collect(), excluded)
            };
            assert_eq!(kept, vec![0, 1, 2]);
            assert_eq!(excluded.len(), 1);
            assert_eq!((excluded[0].unit, excluded[0].client), (3, 2));
            assert!(excluded[0].reason.contains("not finite"));
        }
        // A model that diverged is the model's failure: an error, not every unit left out.
        c.offer(1, spec, vec![0, 1]);
        offer[0] = f32::NAN;
        assert!(c.compute_summed(&offer).is_err());
    }

    /// Resident set size of this process, bytes (Linux).
    fn rss_bytes() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        kb * 1024
    }

    /// Issue 59, item 3, measured: the probe's attack (sessions claiming units 20000.. of a
    /// 10,000-unit run and uploading 64 MiB per unit without completing, then leaving) no
    /// longer grows the aggregator's memory; an honest-looking session that uploads its whole
    /// claim and leaves before completing holds at most its bound, and what it held is freed
    /// (a second such session reuses it instead of growing the process).
    ///
    /// Slow and allocator-dependent, so ignored; run it alone (RSS is per process):
    /// `cargo test -p fedrl-aggregator --lib service::central::tests::rss_stays_within_the_upload_bounds -- --ignored --nocapture --test-threads=1`
    #[test]
    #[ignore]
    fn rss_stays_within_the_upload_bounds() {
        let scenario = fedrl_tasks::scenario_from_toml_str(
            r#"
users = 10000
participation = { kind = "sampled", rate = 0.01 }
unit_kind = "trajectory"
[task]
kind = "offline_cql"
mode = "central"
[task.dataset]
units = 10000
behaviour = { kind = "random" }
[task.cql]
hidden = [8]
"#,
        )
        .unwrap();
        let mut c = Central::for_scenario(&scenario).unwrap().unwrap();
        let mb = |b: u64| b as f64 / (1 << 20) as f64;
        let start = rss_bytes();
        // The attack: out-of-population claims are refused at the join; a 64 MiB unit (more
        // rows than a unit holds) is refused before it is decoded.
        let huge_rows = (64 << 20) / (4 * 11);
        let (mut h, p) = rows(huge_rows);
        for session in 1..=3u64 {
            assert!(
                c.hold_join(
                    session,
                    vec![UnitRange {
                        start: 20000,
                        end: 30000
                    }],
                    &none()
                )
                .is_err()
            );
            c.hold_join(
                session,
                vec![UnitRange {
                    start: (session - 1) * 100,
                    end: session * 100,
                }],
                &none(),
            )
            .unwrap();
            h.unit = (session - 1) * 100;
            assert!(c.unit_data(session, &h, &p).is_err());
            c.left(session);
        }
        drop(p);
        let after_attack = rss_bytes();
        // An honest-looking session uploads 2,000 units at the bound (500 rows) and leaves.
        let claim = 2000u64;
        let (h, p) = rows(500);
        let mut peaks = Vec::new();
        for session in [10u64, 11] {
            c.hold_join(
                session,
                vec![UnitRange {
                    start: 0,
                    end: claim,
                }],
                &none(),
            )
            .unwrap();
            let mut h = h.clone();
            for u in 0..claim {
                h.unit = u;
                c.unit_data(session, &h, &p).unwrap();
            }
            assert_eq!(c.pending_bytes(), claim * c.limits.unit_bytes);
            assert!(c.pending_bytes() <= c.limits.session_bytes(claim));
            peaks.push(rss_bytes());
            c.left(session);
            assert_eq!(c.pending_bytes(), 0);
        }
        let end = rss_bytes();
        let bound = c.limits.session_bytes(claim);
        println!(
            "RSS: start {:.1} MiB, after the attack {:.1} MiB, peak with one session's {} units pending {:.1} MiB (bound {:.1} MiB), peak with the next session {:.1} MiB, end {:.1} MiB",
            mb(start),
            mb(after_attack),
            claim,
            mb(peaks[0]),
            mb(bound),
            mb(peaks[1]),
            mb(end)
        );
        // The attack's payload itself (64 MiB, held by this test) came and went; no upload of
        // it was kept.
        assert!(
            after_attack < start + (80 << 20),
            "the attack grew RSS by {:.1} MiB",
            mb(after_attack - start)
        );
        // One session's pending uploads cost about their bound (decoded batches), plus
        // allocator slack.
        assert!(
            peaks[0] < after_attack + 2 * bound + (16 << 20),
            "one session's uploads grew RSS by {:.1} MiB (bound {:.1} MiB)",
            mb(peaks[0].saturating_sub(after_attack)),
            mb(bound)
        );
        // Freed on leave: the next session's uploads reuse the memory.
        assert!(
            peaks[1] < peaks[0] + bound / 4,
            "the second session grew RSS from {:.1} to {:.1} MiB: the first one's uploads were not freed",
            mb(peaks[0]),
            mb(peaks[1])
        );
    }
}
