//! The client-side task trait ([`LocalTrainer`]) and its optional capabilities: what a client
//! agent asks of a task kind. Every kind implements [`LocalTrainer::local_updates`]; only the
//! kinds that need them return [`CentralData`] (central update mode) or [`ExpertHost`]
//! (DataRelease), so no kind stubs methods it has no use for.

use std::sync::Arc;

use fedrl_common::protocol::{ReleasedPrefix, RoundSpec, UnitId, UnitRange, Welcome};

/// Computes local updates for the units a client agent hosts.
///
/// Called once per round offer with every offered unit of this agent, so implementations can
/// batch many users into one tensor job. It runs on a blocking thread (`spawn_blocking`), never on
/// a tokio worker. Rules (DESIGN §3): a unit's update may depend only on that unit's data and the
/// global model (no optimizer state carried from one unit to another). The agent clips every
/// returned update to `round.clip_norm` before sending; returning fewer units than asked simply
/// means those units do not contribute this round.
pub trait LocalTrainer: Send {
    /// `global` has `round.offer_dim` values (the model, then any public state the task's offer
    /// carries); each returned vector must have `round.dim` values.
    fn local_updates(
        &mut self,
        round: &RoundSpec,
        global: &[f32],
        units: &[UnitId],
    ) -> Vec<(UnitId, Vec<f32>)>;

    /// The central update mode's capability (DESIGN §2.5: the agent uploads its units' data
    /// once after joining and the aggregator computes their clipped updates itself). `None`
    /// (the default, and the federated mode): the data never leaves the agent.
    fn central_data(&self) -> Option<&dyn CentralData> {
        None
    }

    /// DataRelease's capability (seed 002): a trainer whose units are experts with
    /// demonstrations and policies. `None` (the default): this task holds no experts.
    fn expert_host(&mut self) -> Option<&mut dyn ExpertHost> {
        None
    }
}

/// Optional capability of a [`LocalTrainer`]: the units' data for the central update mode.
pub trait CentralData {
    /// The units' data to upload once after joining (the aggregator then computes the units'
    /// clipped updates itself).
    fn unit_data(&self) -> Vec<UnitUpload>;
}

/// Optional capability of a [`LocalTrainer`]: hosting experts for DataRelease (seed 002).
pub trait ExpertHost {
    /// Steps `from_step..from_step + steps` of episode `episode` of unit `unit` (fewer where
    /// the episode ends), as an upload (its `payload` in `encode_rows` layout), the row of the
    /// episode's first transition among the unit's transitions, and whether the episode ends
    /// with these steps. The coordinator asks for a candidate a chunk at a time, the next chunk
    /// only after the prefix before it passed: nothing beyond what it asks for may leave the
    /// agent.
    fn episode_rows(
        &self,
        unit: UnitId,
        episode: u32,
        from_step: u32,
        steps: u32,
    ) -> Result<(UnitUpload, u32, bool), String>;

    /// The counts of the prefixes ending in a new chunk of a candidate. `running` holds, per
    /// hosted expert, the probability of the candidate's prefix before the chunk (empty at the
    /// candidate's first chunk: every expert starts at 1), and is updated to the prefix ending
    /// with the chunk. `obs` (one row of `obs_dim` raw observations per step) and `actions` are
    /// the chunk's steps. Returns, for each of them, the sum over this agent's experts of the
    /// probability of playing the prefix up to and including it.
    fn prefix_counts(
        &self,
        running: &mut Vec<f64>,
        obs: &[f32],
        actions: &[u32],
    ) -> Result<Vec<f64>, String>;

    /// These prefixes of this agent's units are public now; DP-SGD steps draw from the rest.
    fn stable_released(&mut self, prefixes: &[ReleasedPrefix]);
}

/// One unit's data for a `UnitData` frame: `rows` rows of f32 (layout:
/// `fedrl_rl::offline::dpsgd::encode_rows`).
#[derive(Clone, Debug, PartialEq)]
pub struct UnitUpload {
    pub unit: UnitId,
    pub obs_dim: u32,
    pub rows: u32,
    pub payload: Vec<f32>,
}

/// Builds an agent's trainer from the server's welcome (the task, dimension, seed) and the unit
/// ranges the agent hosts. Called once per agent process, at the first successful join
/// ([`crate::registry::default_factory`] builds every registered kind).
pub type TrainerFactory =
    Arc<dyn Fn(&Welcome, &[UnitRange]) -> anyhow::Result<Box<dyn LocalTrainer>> + Send + Sync>;
