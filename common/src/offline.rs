//! Plain-data descriptions of the offline half (DESIGN §2.2-2.5): how a dataset held by privacy
//! units is generated, the discrete CQL hyper-parameters and the two DP-SGD update modes. The
//! datasets themselves, the losses and the per-unit gradients live in `fedrl_rl::offline`.

use serde::{Deserialize, Serialize};

/// A named, seeded procedure that generates an offline dataset: a behaviour policy rolled out in
/// a simulator population. Two equal specs produce the same dataset bit for bit, so a dataset is
/// cached on disk under a key derived from its spec ([`DatasetSpec::cache_key`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSpec {
    /// Population name or environment id (`fedrl sim list`). Default `CartPole-v1`.
    #[serde(default = "d_env")]
    pub env: String,
    /// Seed of the population's per-user parameters. Default 0.
    #[serde(default)]
    pub population_seed: u64,
    /// Who acts while the data is recorded. Default: PPO checkpoints with epsilon-greedy noise.
    #[serde(default)]
    pub behaviour: Behaviour,
    /// Number of privacy units (trajectories or experts) in the dataset. Default 1000.
    #[serde(default = "d_units")]
    pub units: u64,
    /// Episodes each unit owns: 1 for trajectory-level units, e.g. 20 for an expert. Default 1.
    #[serde(default = "d_one")]
    pub episodes_per_unit: u64,
    /// Seed of the behaviour policy's training and of the episodes. Default 0.
    #[serde(default)]
    pub seed: u64,
    /// `env = "gymnasium:<id>"` only: how the Gymnasium bridge's Python workers make the
    /// environments, and the spaces they must have ([`DatasetGymnasium`]). Absent (and left out
    /// of the canonical JSON, so older cache keys do not move) for fedrl's own environments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gymnasium: Option<Box<DatasetGymnasium>>,
}

/// How a `gymnasium:<id>` dataset's environments are made by the Gymnasium bridge
/// (`fedrl_sim::gym_bridge`), in the process that generates the data (`fedrl run`, `fedrl data
/// generate`, a client agent): never in the aggregator, which builds its network from the
/// declared spaces.
///
/// - Random and `ppo_mixed` behaviours: unit (user) `u` plays in `gymnasium.make(id, **kwargs,
///   **drawn)`, `drawn` being `user_kwargs` drawn for user `u` from `population_seed` (as a
///   `gymnasium:<id>` DPPG population's users); the behaviour policy's training users are
///   users of the same population.
/// - Experts: expert `u` trains on grid setting `(u / per_setting) mod settings` of `grid` (the
///   B.1 grid: the product of its axes in name order, the last name varying fastest), made with
///   `grid_kwargs` and the setting's values; the demonstrations are played in
///   `gymnasium.make(id, **kwargs)`, the default environment.
///
/// Everything but `python`, `workers` and the deadlines enters the dataset's cache key (they do
/// not change the data: every episode is reset with its own seed).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetGymnasium {
    /// Observation length, flattened (a Discrete observation of `n` values counts `n`).
    pub obs_dim: usize,
    /// Number of discrete actions (offline datasets are discrete-action).
    pub actions: usize,
    /// A Python module imported before `gymnasium.make` (it may register the user's own
    /// environment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module: Option<String>,
    /// The Python interpreter. Default: `FEDRL_PYTHON`, else `.venv-bridge/bin/python` made by
    /// `scripts/install-python-bridge.sh`. Not part of the cache key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<String>,
    /// Keyword arguments of the default environment (and of every user, for random and
    /// `ppo_mixed` data).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    /// Random and `ppo_mixed` data: keyword arguments drawn per user (after `kwargs`), as
    /// `[task.gymnasium.user_kwargs]` of a DPPG task.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub user_kwargs: std::collections::BTreeMap<String, crate::task::dppg::KwargDraw>,
    /// Experts: the B.1 grid's axes by keyword, each `{ linspace = [low, high, n] }` (its n
    /// values) or `{ choice = [v1, ...] }`; the settings are their product.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub grid: std::collections::BTreeMap<String, crate::task::dppg::KwargDraw>,
    /// Experts: keyword arguments every grid setting gets (before the grid's values), e.g.
    /// `enable_wind = true` when the grid varies the wind.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub grid_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Worker processes stepping the environments. Default 2. Not part of the cache key.
    #[serde(default = "d_gym_workers")]
    pub workers: usize,
    /// Seconds one batched reset or step may take. Default 60. Not part of the cache key.
    #[serde(default = "d_gym_step_timeout")]
    pub step_timeout_s: f64,
    /// Seconds a worker may take to start or to make a batch of environments. Default 300.
    /// Not part of the cache key.
    #[serde(default = "d_gym_start_timeout")]
    pub start_timeout_s: f64,
}

pub(crate) fn d_gym_workers() -> usize {
    2
}

pub(crate) fn d_gym_step_timeout() -> f64 {
    60.0
}

pub(crate) fn d_gym_start_timeout() -> f64 {
    300.0
}

/// What every `[task.dataset.gymnasium]` table says about the bridge's workers, discrete
/// ([`DatasetGymnasium`]) and continuous (`task::primorl::ContinuousGymnasium`) alike: one view,
/// so the two tables are turned into a bridge configuration and checked by the same code.
#[derive(Clone, Copy, Debug)]
pub struct BridgeFields<'a> {
    pub module: Option<&'a str>,
    pub python: Option<&'a str>,
    pub kwargs: &'a serde_json::Map<String, serde_json::Value>,
    pub user_kwargs: &'a std::collections::BTreeMap<String, crate::task::dppg::KwargDraw>,
    pub workers: usize,
    /// Seconds.
    pub step_timeout_s: f64,
    /// Seconds.
    pub start_timeout_s: f64,
}

impl BridgeFields<'_> {
    /// Checks the worker count, the deadlines and the per-user draws.
    pub fn check(&self) -> Result<(), String> {
        if self.workers == 0 {
            return Err("task.dataset.gymnasium.workers must be >= 1".into());
        }
        for (name, t) in [
            ("step_timeout_s", self.step_timeout_s),
            ("start_timeout_s", self.start_timeout_s),
        ] {
            if !(t.is_finite() && t > 0.0) {
                return Err(format!(
                    "task.dataset.gymnasium.{name} must be > 0, got {t}"
                ));
            }
        }
        use crate::task::dppg::KwargDraw;
        for (name, d) in self.user_kwargs {
            let ok = match d {
                KwargDraw::Uniform([lo, hi]) => lo.is_finite() && hi.is_finite() && lo <= hi,
                KwargDraw::Linspace(lo, hi, n) => lo.is_finite() && hi.is_finite() && *n >= 1,
                KwargDraw::Choice(v) => !v.is_empty(),
            };
            if !ok {
                return Err(format!(
                    "task.dataset.gymnasium.user_kwargs.{name}: {d:?} is not a draw"
                ));
            }
        }
        Ok(())
    }
}

/// The prefix of an environment name that selects the Gymnasium bridge.
pub const GYMNASIUM_PREFIX: &str = "gymnasium:";

impl DatasetGymnasium {
    /// The bridge's worker settings.
    pub fn bridge(&self) -> BridgeFields<'_> {
        BridgeFields {
            module: self.module.as_deref(),
            python: self.python.as_deref(),
            kwargs: &self.kwargs,
            user_kwargs: &self.user_kwargs,
            workers: self.workers,
            step_timeout_s: self.step_timeout_s,
            start_timeout_s: self.start_timeout_s,
        }
    }

    /// Number of settings of [`Self::grid`] (the product of its axes' sizes; 1 for no axis).
    pub fn grid_settings(&self) -> u64 {
        self.grid
            .values()
            .map(|d| match d {
                crate::task::dppg::KwargDraw::Linspace(_, _, n) => u64::from(*n),
                crate::task::dppg::KwargDraw::Choice(v) => v.len() as u64,
                crate::task::dppg::KwargDraw::Uniform(_) => 0,
            })
            .product()
    }

    /// The keyword arguments of grid setting `s` (`0..grid_settings()`): `grid_kwargs`, then
    /// each axis's value, axes in name order, the last varying fastest.
    pub fn grid_kwargs_of(&self, s: u64) -> serde_json::Map<String, serde_json::Value> {
        use crate::task::dppg::KwargDraw;
        let mut out = self.grid_kwargs.clone();
        let mut rest = s;
        for (name, d) in self.grid.iter().rev() {
            let v = match d {
                KwargDraw::Linspace(lo, hi, n) => {
                    let n = u64::from((*n).max(1));
                    let k = rest % n;
                    rest /= n;
                    let x = if n == 1 {
                        *lo
                    } else {
                        lo + (hi - lo) * k as f64 / (n - 1) as f64
                    };
                    serde_json::json!(x)
                }
                KwargDraw::Choice(vals) => {
                    let n = vals.len().max(1) as u64;
                    let k = rest % n;
                    rest /= n;
                    vals.get(k as usize)
                        .cloned()
                        .unwrap_or(serde_json::Value::Null)
                }
                KwargDraw::Uniform(_) => serde_json::Value::Null,
            };
            out.insert(name.clone(), v);
        }
        out
    }

    /// Checks what needs no Python: the declared spaces, the deadlines, the draws and the grid's
    /// axes (`linspace` or `choice`, a finite product).
    pub fn check(&self) -> Result<(), String> {
        if self.obs_dim == 0 || self.actions < 2 || self.workers == 0 {
            return Err(format!(
                "task.dataset.gymnasium: obs_dim >= 1, actions >= 2 (offline datasets have \
                 discrete actions) and workers >= 1, got {}, {} and {}",
                self.obs_dim, self.actions, self.workers
            ));
        }
        self.bridge().check()?;
        use crate::task::dppg::KwargDraw;
        let mut settings: u64 = 1;
        for (name, d) in &self.grid {
            let n = match d {
                KwargDraw::Linspace(lo, hi, n) if lo.is_finite() && hi.is_finite() && *n >= 1 => {
                    u64::from(*n)
                }
                KwargDraw::Choice(v) if !v.is_empty() => v.len() as u64,
                _ => {
                    return Err(format!(
                        "task.dataset.gymnasium.grid.{name}: a grid axis is {{ linspace = [low, \
                         high, n] }} or {{ choice = [...] }}, got {d:?}"
                    ));
                }
            };
            settings = settings.checked_mul(n).ok_or_else(|| {
                "task.dataset.gymnasium.grid has more settings than fit in 64 bits".to_string()
            })?;
        }
        Ok(())
    }
}

/// The behaviour policy of a generated dataset.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Behaviour {
    /// Uniformly random actions.
    Random,
    /// A PPO policy trained (non-privately, on the simulator, not on anyone's data) for
    /// `iterations`, snapshotted at `checkpoints` evenly spaced points; unit `u` acts with
    /// checkpoint `u % checkpoints`, taking a uniformly random action with probability `epsilon`
    /// at every step: a dataset of mixed quality.
    PpoMixed {
        /// PPO iterations of the behaviour policy (each: 16 simulator users play one episode
        /// and their local updates are averaged). Default 60 (CartPole-v1: greedy return about
        /// 10 untrained, 350-440 after 20-60 iterations).
        #[serde(default = "d_ppo_iterations")]
        iterations: u64,
        /// Snapshots taken evenly from the untrained policy (the first) to the final one (the
        /// last). Default 4.
        #[serde(default = "d_checkpoints")]
        checkpoints: u32,
        /// Probability of a uniformly random action at each step, in [0, 1]. Default 0.2.
        #[serde(default = "d_epsilon")]
        epsilon: f64,
    },
    /// Seed 000/002 appendix B.1: one PPO expert per unit, trained on a setting of a B.1
    /// population, softened so that every action has probability at least `p_min` (Assumption
    /// 1), playing `episodes_per_unit` demonstrations on the default environment
    /// [`DatasetSpec::env`]. Unit `u` trains on grid setting `(u / per_setting) mod settings`
    /// with its own initial weights and sampling, so the `per_setting` experts of a setting
    /// differ by their seeds only; with more units than `settings x per_setting` the grid is
    /// walked again (as the paper's HIV experts: 2,000 settings, 1,000 of them twice).
    ///
    /// Reduced honestly for a 2-core CPU: the paper trains (512, 256, 64) networks with tuned
    /// learning rates and batch sizes and keeps the best 3 of several agents per setting; here
    /// every expert is one small tanh MLP (`hidden`) trained for `iterations` PPO iterations of
    /// one episode each (after an optional shared start, `shared_iterations`), and all are kept.
    /// The demonstrations are therefore of mixed quality, which the paper's Figure 2 shows too.
    Experts {
        /// The B.1 population whose grid settings the experts train on: `cartpole-b1`,
        /// `acrobot-b1` or `hiv-b1` (its environment must have the spaces of
        /// [`DatasetSpec::env`]). Default `cartpole-b1`.
        #[serde(default = "d_expert_population")]
        population: String,
        /// Experts per setting, >= 1. Default 3.
        #[serde(default = "d_per_setting")]
        per_setting: u32,
        /// PPO iterations per expert (each: one episode in its setting, then one local PPO
        /// update from its own parameters). Default 20 (3,000 CartPole experts in 32 s on 2
        /// cores, median demonstration return 158 of 200); the shipped expert scenarios use 150
        /// for CartPole and Acrobot (5 and 4 minutes, CartPole median 200) and 100 for HIV (its
        /// ODE: about 13 minutes).
        #[serde(default = "d_expert_iterations")]
        iterations: u64,
        /// Hidden layer widths of the expert's tanh MLP policy (and of its value network).
        /// Default `[32, 32]`: the paper's (512, 256, 64) is out of reach for 3,000 experts on
        /// a 2-core CPU.
        #[serde(default = "d_expert_hidden")]
        hidden: Vec<usize>,
        /// Minimum action probability of the softened expert (Assumption 1), in (0, 1 /
        /// n_actions]. Default 0.02.
        #[serde(default = "d_p_min")]
        p_min: f64,
        /// Cap on an episode's length in steps, for the demonstrations and the training
        /// episodes alike (the paper: 200 for CartPole and Acrobot); 0 = the environment's
        /// own limit. Default 200.
        #[serde(default = "d_max_steps")]
        max_steps: u64,
        /// PPO iterations of a shared starting policy, trained before the experts' own
        /// iterations; 0 (the default) starts every expert from its own random weights. Each
        /// shared iteration, [`SHARED_COHORT`] grid settings (taken in expert order, cycling)
        /// play one episode each with the shared policy, each runs one local PPO update from
        /// it, and the shared policy moves by their mean update (FedAvg with step 1; no clip,
        /// no noise: this training uses no one's data). The experts then start from it and
        /// train on their own settings.
        ///
        /// Why: a lone expert's PPO update on one episode is noisy enough that independent
        /// experts end in different local optima and, on HIV, far from competent; the paper's
        /// experts are the best of several long runs per setting, which a 2-core CPU cannot
        /// afford for 3,000 experts. The shared start pools the early learning (64 episodes
        /// per update), and each expert's own iterations keep it specific to its setting.
        #[serde(default, skip_serializing_if = "is_zero")]
        shared_iterations: u64,
        /// Adam learning rate of each expert's own PPO iterations (after the shared start).
        /// Default (`None`): the PPO default, 2.5e-3.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expert_lr: Option<f64>,
    },
}

/// Where an offline task's data comes from: generated by a [`DatasetSpec`] (the default, and
/// every scenario written before stored datasets existed), or a dataset stored under the data
/// root and named by its Minari id ([`StoredDataset`]: imported with `fedrl data import`, or
/// generated earlier).
///
/// In a scenario both are the table `[task.dataset]`: a table with `name` is a stored dataset,
/// any other a generation spec. Mixing the two (`name` with `behaviour`, `seed`, ... or a number
/// of `units`) or a unit mapping without `name` is refused with a message saying which is which;
/// unknown fields are refused in both shapes.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum DatasetSource {
    Generated(DatasetSpec),
    Stored(StoredDataset),
}

impl Default for DatasetSource {
    fn default() -> Self {
        DatasetSource::Generated(DatasetSpec::default())
    }
}

impl From<DatasetSpec> for DatasetSource {
    fn from(s: DatasetSpec) -> Self {
        DatasetSource::Generated(s)
    }
}

impl DatasetSource {
    /// The generation spec, when the data is generated.
    pub fn generated(&self) -> Option<&DatasetSpec> {
        match self {
            DatasetSource::Generated(s) => Some(s),
            DatasetSource::Stored(_) => None,
        }
    }

    /// The stored dataset, when one is named.
    pub fn stored(&self) -> Option<&StoredDataset> {
        match self {
            DatasetSource::Stored(s) => Some(s),
            DatasetSource::Generated(_) => None,
        }
    }

    /// The Minari id the data lives under in the data root: the stored dataset's name, or the
    /// generated dataset's [`DatasetSpec::minari_id`].
    pub fn minari_id(&self) -> String {
        match self {
            DatasetSource::Generated(s) => s.minari_id(),
            DatasetSource::Stored(s) => s.name.clone(),
        }
    }
}

/// Keys that only a generation spec has (a stored dataset's `units` is a mapping, not a count).
const GENERATION_ONLY: [&str; 4] = ["population_seed", "behaviour", "episodes_per_unit", "seed"];

impl<'de> Deserialize<'de> for DatasetSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        // Buffered once, then read as the one shape its keys select: an untagged enum would
        // answer a typo with "did not match any variant" instead of naming the field.
        let v = serde_json::Value::deserialize(d)?;
        let Some(obj) = v.as_object() else {
            return Err(D::Error::custom(
                "the dataset must be a table: a generation spec (env, behaviour, units, ...) or a stored dataset (name = \"namespace/name-vN\", units = \"episode\")",
            ));
        };
        let units_is_count = obj.get("units").is_some_and(serde_json::Value::is_number);
        if obj.contains_key("name") {
            let mut mixed: Vec<&str> = GENERATION_ONLY
                .iter()
                .copied()
                .filter(|k| obj.contains_key(*k))
                .collect();
            if units_is_count {
                mixed.push("units (a number)");
            }
            if !mixed.is_empty() {
                return Err(D::Error::custom(format!(
                    "`name` names a stored dataset, but {} belong to a generation spec: give either `name` (with `units` = \"episode\", \"stored\" or {{ metadata_key = \"...\" }}, and optionally `env`) or a generation spec, not both",
                    mixed.join(", ")
                )));
            }
            StoredDataset::deserialize(v)
                .map(DatasetSource::Stored)
                .map_err(D::Error::custom)
        } else {
            if obj.contains_key("units") && !units_is_count {
                return Err(D::Error::custom(
                    "`units` is a unit mapping (\"episode\", \"stored\", { metadata_key = ... }), which only a stored dataset takes: add `name = \"namespace/name-vN\"` (see `fedrl data list`), or give `units` as the number of units to generate",
                ));
            }
            DatasetSpec::deserialize(v)
                .map(DatasetSource::Generated)
                .map_err(D::Error::custom)
        }
    }
}

/// A dataset stored under the data root (`fedrl data list`), used as an offline task's data
/// without generating anything. Its episodes are mapped to privacy units by `units`; the
/// mapping is a pure function of the stored files, so the aggregator and every client agent
/// compute the same units.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredDataset {
    /// The Minari id under the data root, e.g. `myorg/cartpole-v0` (`fedrl data import` puts a
    /// dataset there; a generated one sits under its `fedrl/...` id).
    pub name: String,
    /// How episodes map to privacy units. Default `"episode"`.
    #[serde(default)]
    pub units: UnitMap,
    /// The environment the released policy is evaluated in (`fedrl sim list`). Absent: the
    /// environment the dataset records (`env_spec` id or fedrl's own), which must then be one
    /// fedrl simulates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<String>,
}

impl StoredDataset {
    /// Checks what needs no data root: a non-empty name, a non-empty metadata key and
    /// environment. The dataset itself is checked where it is read (`fedrl_tasks`).
    pub fn check(&self) -> Result<(), crate::task::TaskError> {
        let bad = |m: &str| Err(crate::task::TaskError::Invalid(m.to_string()));
        if self.name.trim().is_empty() {
            return bad("task.dataset.name must name a dataset (`fedrl data list`)");
        }
        if let UnitMap::MetadataKey(k) = &self.units
            && k.is_empty()
        {
            return bad("task.dataset.units.metadata_key must not be empty");
        }
        if self.env.as_deref().is_some_and(str::is_empty) {
            return bad("task.dataset.env must not be empty (leave it out to use the dataset's)");
        }
        Ok(())
    }
}

/// How a stored dataset's episodes map to privacy units (DESIGN §3). Every mapping puts each
/// episode in exactly one unit; units are numbered 0, 1, ... in the order their first episode
/// appears (episodes in id order), so the numbering depends on the files only.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnitMap {
    /// Each episode is a unit of its own (trajectory-level privacy): right when no person
    /// contributed more than one episode.
    #[default]
    Episode,
    /// The unit id stored with each episode (episode metadata key `unit`, which fedrl writes
    /// for generated datasets and assigns on import to episodes without one: one unit each).
    /// Episodes with equal ids form one unit.
    Stored,
    /// Episodes whose episode metadata holds an equal value under this key form one unit
    /// (e.g. `owner`: all of a person's episodes together, user-level privacy). Every episode
    /// must hold the key.
    MetadataKey(String),
    /// Each transition is a unit of its own (PrivORL-n's level, the weakest): right only when
    /// no person contributed more than one transition. Only `privorl` takes it, and it takes
    /// only this one (its contributions are single transitions).
    Transition,
}

/// Experts whose episodes make one update of the shared starting policy of
/// [`Behaviour::Experts`] (`shared_iterations`).
pub const SHARED_COHORT: usize = 64;

/// Serde helper: new fields at their default stay out of the canonical JSON, so the cache keys
/// of specs written before the field existed do not move.
fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl Behaviour {
    /// The defaults of [`Behaviour::Experts`] for a population (see there).
    pub fn experts(population: &str) -> Self {
        Behaviour::Experts {
            population: population.to_string(),
            per_setting: d_per_setting(),
            iterations: d_expert_iterations(),
            hidden: d_expert_hidden(),
            p_min: d_p_min(),
            max_steps: d_max_steps(),
            shared_iterations: 0,
            expert_lr: None,
        }
    }

    /// Checks the fields that need no simulator: `checkpoints >= 1` and `epsilon` in [0, 1]
    /// for `ppo_mixed`; `per_setting >= 1`, non-empty hidden widths >= 1 and `p_min` in (0, 1)
    /// for `experts` (the bound `p_min x n_actions <= 1` needs the environment and is checked
    /// by the generator).
    pub fn validate(&self) -> Result<(), String> {
        match self {
            Behaviour::Random => Ok(()),
            Behaviour::PpoMixed {
                checkpoints,
                epsilon,
                ..
            } => {
                if *checkpoints == 0 || !(0.0..=1.0).contains(epsilon) {
                    return Err(format!(
                        "ppo_mixed needs checkpoints >= 1 and epsilon in [0, 1], got \
                         {checkpoints} and {epsilon}"
                    ));
                }
                Ok(())
            }
            Behaviour::Experts {
                per_setting,
                hidden,
                p_min,
                expert_lr,
                ..
            } => {
                if let Some(lr) = expert_lr
                    && !(lr.is_finite() && *lr > 0.0)
                {
                    return Err(format!("experts need expert_lr > 0, got {lr}"));
                }
                if *per_setting == 0 {
                    return Err("experts need per_setting >= 1".into());
                }
                if hidden.is_empty() || hidden.contains(&0) {
                    return Err("experts need non-empty hidden widths >= 1".into());
                }
                // Assumption 1 needs p_min > 0; p_min = 1 / n_actions (uniform) is the upper end.
                if !(p_min.is_finite() && *p_min > 0.0 && *p_min < 1.0) {
                    return Err(format!("experts need p_min in (0, 1), got {p_min}"));
                }
                Ok(())
            }
        }
    }
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour::PpoMixed {
            iterations: d_ppo_iterations(),
            checkpoints: d_checkpoints(),
            epsilon: d_epsilon(),
        }
    }
}

/// Version of the generation procedure and of the on-disk layout. Part of every cache key:
/// bump it when either changes, so old caches are not mistaken for new ones.
pub const DATASET_FORMAT_VERSION: u32 = 1;

impl DatasetSpec {
    /// The `[task.dataset.gymnasium]` table's consistency with the spec (no Python needed): it is
    /// there exactly when `env` is `gymnasium:<id>`; its own checks ([`DatasetGymnasium::check`]);
    /// experts name the same `gymnasium:<id>` as their population and train on a non-empty
    /// grid (and take no `user_kwargs`), other behaviours take no grid: a setting that would be
    /// ignored is refused.
    pub fn check_gymnasium(&self) -> Result<(), String> {
        let gym = self.env.starts_with(GYMNASIUM_PREFIX);
        let g = match (gym, &self.gymnasium) {
            (false, None) => return Ok(()),
            (false, Some(_)) => {
                return Err(format!(
                    "task.dataset.gymnasium applies to env = \"gymnasium:<id>\" only, not {:?}",
                    self.env
                ));
            }
            (true, None) => {
                return Err(format!(
                    "task.dataset.env = {:?} needs a [task.dataset.gymnasium] table (obs_dim, \
                     actions, ...)",
                    self.env
                ));
            }
            (true, Some(g)) => g,
        };
        g.check()?;
        match &self.behaviour {
            Behaviour::Experts { population, .. } => {
                if population != &self.env {
                    return Err(format!(
                        "experts of a Gymnasium dataset train on the grid of \
                         [task.dataset.gymnasium]: behaviour.population must be {:?} too, got \
                         {population:?}",
                        self.env
                    ));
                }
                if g.grid.is_empty() || !g.user_kwargs.is_empty() {
                    return Err(
                        "experts of a Gymnasium dataset need task.dataset.gymnasium.grid (the B.1 \
                         settings) and take no user_kwargs"
                            .into(),
                    );
                }
            }
            Behaviour::Random | Behaviour::PpoMixed { .. } => {
                if !g.grid.is_empty() || !g.grid_kwargs.is_empty() {
                    return Err(
                        "task.dataset.gymnasium.grid and grid_kwargs are the experts' training \
                         settings; random and ppo_mixed data draw user_kwargs instead"
                            .into(),
                    );
                }
            }
        }
        Ok(())
    }

    /// This spec with what cannot change the data at its defaults: a Gymnasium dataset's
    /// interpreter path (machine-specific), worker count and deadlines. Two specs with equal
    /// identities describe the same data; the cache key is computed from it.
    pub fn data_identity(&self) -> DatasetSpec {
        let mut keyed = self.clone();
        if let Some(g) = &mut keyed.gymnasium {
            g.python = None;
            g.workers = d_gym_workers();
            g.step_timeout_s = d_gym_step_timeout();
            g.start_timeout_s = d_gym_start_timeout();
        }
        keyed
    }

    /// The stable key of this spec: FNV-1a (64 bits) of its canonical JSON (keys sorted, every
    /// field written, defaults included) followed by [`DATASET_FORMAT_VERSION`], as 16 lowercase
    /// hex digits. Equal specs have equal keys on every machine and every build.
    pub fn cache_key(&self) -> String {
        let keyed = self.data_identity();
        // `serde_json::Value` keeps object keys in a BTreeMap (no `preserve_order` feature in
        // this workspace), so its text is canonical.
        let canonical = serde_json::to_value(&keyed)
            .map(|v| v.to_string())
            .unwrap_or_else(|e| unreachable!("a DatasetSpec always serialises: {e}"));
        let text = format!("{canonical}#format{DATASET_FORMAT_VERSION}");
        format!("{:016x}", fnv1a64(text.as_bytes()))
    }

    /// The Minari dataset id of this spec: `fedrl/<env>-<behaviour>-<first 8 hex digits of the
    /// key>-v0`, e.g. `fedrl/cartpole-ppo_mixed-1a2b3c4d-v0`. `<env>` is the environment or
    /// population name lower-cased, without its `-vN` suffix, other characters than letters,
    /// digits, `_` and `-` replaced by `_`.
    pub fn minari_id(&self) -> String {
        let base = match self.env.rsplit_once("-v") {
            Some((head, v)) if !v.is_empty() && v.chars().all(|c| c.is_ascii_digit()) => head,
            _ => self.env.as_str(),
        };
        let env: String = base
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .collect();
        let behaviour = match self.behaviour {
            Behaviour::Random => "random",
            Behaviour::PpoMixed { .. } => "ppo_mixed",
            Behaviour::Experts { .. } => "experts",
        };
        format!("fedrl/{env}-{behaviour}-{}-v0", &self.cache_key()[..8])
    }
}

/// FNV-1a, 64 bits: tiny, stable across platforms and releases (unlike `std`'s `Hasher`s).
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Default for DatasetSpec {
    fn default() -> Self {
        DatasetSpec {
            env: d_env(),
            population_seed: 0,
            behaviour: Behaviour::default(),
            units: d_units(),
            episodes_per_unit: 1,
            seed: 0,
            gymnasium: None,
        }
    }
}

/// Discrete CQL (Kumar et al. 2020, CQL(H) on a double-DQN target) hyper-parameters. Defaults are
/// d3rlpy 2.8's `DiscreteCQLConfig` with its default vector encoder (ReLU MLP `[256, 256]`), its
/// default `AdamFactory` (betas 0.9 and 0.999, no weight decay) and one critic, so the two
/// compare like for like (checked against `d3rlpy/algos/qlearning/cql.py` and
/// `models/torch/q_functions/mean_q_function.py`). As in d3rlpy, the TD term is the Huber loss
/// with threshold 1 (`compute_huber_loss`, not a squared error) on the double-DQN target, and
/// the conservative term `logsumexp_a Q(s, a) - Q(s, a_data)` is averaged over the batch and
/// weighted by `alpha`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CqlConfig {
    /// Hidden layer widths of the Q-network MLP (ReLU). Default `[256, 256]`.
    #[serde(default = "d_hidden")]
    pub hidden: Vec<usize>,
    /// Discount factor. Default 0.99.
    #[serde(default = "d_gamma")]
    pub gamma: f64,
    /// Weight of the CQL(H) regulariser `logsumexp_a Q(s, a) - Q(s, a_data)`. Default 1.
    #[serde(default = "d_alpha")]
    pub alpha: f64,
    /// Adam learning rate. Default 6.25e-5.
    #[serde(default = "d_lr")]
    pub learning_rate: f64,
    /// Adam epsilon. Default 1e-8.
    #[serde(default = "d_adam_eps")]
    pub adam_eps: f64,
    /// Minibatch size of the non-private trainer (the private one draws units instead). Default
    /// 32.
    #[serde(default = "d_batch")]
    pub batch_size: usize,
    /// Gradient steps between copies of the online network into the target network. Default
    /// 8000.
    #[serde(default = "d_target_update")]
    pub target_update_interval: u64,
    /// Seed of the Q-network's initial weights. Default 0.
    #[serde(default)]
    pub model_seed: u64,
    /// Factor the rewards are multiplied by in the TD target (a fixed public constant, like
    /// d3rlpy's `MultiplyRewardScaler`): HIV treatment rewards reach 1e6 per step. Default 1.
    #[serde(default = "d_reward_scale")]
    pub reward_scale: f64,
}

fn d_reward_scale() -> f64 {
    1.0
}

impl Default for CqlConfig {
    fn default() -> Self {
        CqlConfig {
            hidden: d_hidden(),
            gamma: d_gamma(),
            alpha: d_alpha(),
            learning_rate: d_lr(),
            adam_eps: d_adam_eps(),
            batch_size: d_batch(),
            target_update_interval: d_target_update(),
            model_seed: 0,
            reward_scale: d_reward_scale(),
        }
    }
}

/// Where per-unit DP-SGD gradients are computed (DESIGN §2.5); both feed the same noise, server
/// optimizer and ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpdateMode {
    /// The data stays on the client agents, which send each sampled unit's clipped gradient.
    #[default]
    Federated,
    /// The client agents upload their units' data once to the aggregator (the trusted curator of
    /// the seeds' setting), which computes the clipped per-unit gradients itself in large batches.
    Central,
}

/// In the central mode, how the aggregator hands the sampled units' gradients to the round
/// engine (issue 55 §3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CentralPath {
    /// The sum of the clipped gradients, computed in f64 without materialising them and
    /// quantised once; the noise is calibrated to that path's slightly larger sensitivity
    /// (`(1 + 2e) C / gamma + sqrt(d)` grid units instead of `C / gamma`).
    #[default]
    Summed,
    /// Every unit's clipped gradient materialised and quantised one by one, as federated
    /// updates are: the same noise and ledger records as the federated mode (slower; kept for
    /// comparisons).
    PerUnit,
}

fn d_env() -> String {
    "CartPole-v1".into()
}
fn d_units() -> u64 {
    1000
}
fn d_one() -> u64 {
    1
}
fn d_ppo_iterations() -> u64 {
    60
}
fn d_checkpoints() -> u32 {
    4
}
fn d_epsilon() -> f64 {
    0.2
}
fn d_expert_population() -> String {
    "cartpole-b1".into()
}
fn d_per_setting() -> u32 {
    3
}
fn d_expert_iterations() -> u64 {
    20
}
fn d_expert_hidden() -> Vec<usize> {
    vec![32, 32]
}
fn d_p_min() -> f64 {
    0.02
}
fn d_max_steps() -> u64 {
    200
}
fn d_hidden() -> Vec<usize> {
    vec![256, 256]
}
fn d_gamma() -> f64 {
    0.99
}
fn d_alpha() -> f64 {
    1.0
}
fn d_lr() -> f64 {
    6.25e-5
}
fn d_adam_eps() -> f64 {
    1e-8
}
fn d_batch() -> usize {
    32
}
fn d_target_update() -> u64 {
    8000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_is_stable_and_tracks_every_field() {
        let a = DatasetSpec::default();
        // Pinned: a change of the canonical JSON or the hash would silently orphan caches.
        assert_eq!(a.cache_key(), DatasetSpec::default().cache_key());
        assert_eq!(a.cache_key().len(), 16);
        let mut b = a.clone();
        b.seed = 1;
        assert_ne!(a.cache_key(), b.cache_key());
        let mut c = a.clone();
        c.behaviour = Behaviour::PpoMixed {
            iterations: 60,
            checkpoints: 4,
            epsilon: 0.25,
        };
        assert_ne!(a.cache_key(), c.cache_key());
    }

    /// Keys of the default spec and of the default spec with random actions, computed by an
    /// independent implementation (Python's `json.dumps(sort_keys=True)` and FNV-1a) of the
    /// scheme documented on [`DatasetSpec::cache_key`].
    const PINNED_DEFAULT_KEY: &str = "12b0409381acd81e";
    const PINNED_RANDOM_KEY: &str = "e83e9b09ab9fcba1";

    #[test]
    fn existing_cache_keys_are_unchanged() {
        // Pinned before Behaviour::Experts existed: adding a variant must not move old caches.
        assert_eq!(DatasetSpec::default().cache_key(), PINNED_DEFAULT_KEY);
        let r = DatasetSpec {
            behaviour: Behaviour::Random,
            ..DatasetSpec::default()
        };
        assert_eq!(r.cache_key(), PINNED_RANDOM_KEY);
    }

    #[test]
    fn experts_parse_with_defaults_and_validate() {
        let s: DatasetSpec = serde_json::from_str(
            r#"{"env": "CartPole-v1", "units": 30, "episodes_per_unit": 20,
                "behaviour": {"kind": "experts", "population": "cartpole-b1"}}"#,
        )
        .unwrap();
        assert_eq!(s.behaviour, Behaviour::experts("cartpole-b1"));
        assert!(s.behaviour.validate().is_ok());
        assert!(s.minari_id().starts_with("fedrl/cartpole-experts-"));
        let mut other = s.clone();
        other.behaviour = Behaviour::Experts {
            population: "cartpole-b1".into(),
            per_setting: 3,
            iterations: 20,
            hidden: vec![32, 32],
            p_min: 0.05,
            max_steps: 200,
            shared_iterations: 0,
            expert_lr: None,
        };
        assert_ne!(s.cache_key(), other.cache_key());
        // The newer fields leave the keys of specs without them alone, and change them when set.
        let key = s.cache_key();
        let mut warm = s.clone();
        assert!(
            !serde_json::to_string(&s)
                .unwrap()
                .contains("shared_iterations")
        );
        if let Behaviour::Experts {
            shared_iterations, ..
        } = &mut warm.behaviour
        {
            *shared_iterations = 400;
        }
        assert_ne!(warm.cache_key(), key);
        let shared_key = warm.cache_key();
        if let Behaviour::Experts { expert_lr, .. } = &mut warm.behaviour {
            *expert_lr = Some(5e-4);
        }
        assert_ne!(warm.cache_key(), shared_key);
        let json = serde_json::to_string(&warm).unwrap();
        assert_eq!(serde_json::from_str::<DatasetSpec>(&json).unwrap(), warm);
        let bad = |b: Behaviour| b.validate().unwrap_err();
        let with = |f: &dyn Fn(&mut Behaviour)| {
            let mut b = Behaviour::experts("cartpole-b1");
            f(&mut b);
            b
        };
        bad(with(&|b| {
            if let Behaviour::Experts { per_setting, .. } = b {
                *per_setting = 0;
            }
        }));
        bad(with(&|b| {
            if let Behaviour::Experts { p_min, .. } = b {
                *p_min = 0.0;
            }
        }));
        bad(with(&|b| {
            if let Behaviour::Experts { hidden, .. } = b {
                hidden.clear();
            }
        }));
        bad(with(&|b| {
            if let Behaviour::Experts { expert_lr, .. } = b {
                *expert_lr = Some(0.0);
            }
        }));
        assert!(
            serde_json::from_str::<Behaviour>(r#"{"kind": "experts", "typo": 1}"#).is_err(),
            "unknown fields are refused"
        );
    }

    #[test]
    fn minari_id_names_env_and_behaviour() {
        let mut s = DatasetSpec::default();
        let id = s.minari_id();
        assert!(id.starts_with("fedrl/cartpole-ppo_mixed-"), "{id}");
        assert!(id.ends_with("-v0"));
        assert_eq!(id.len(), "fedrl/cartpole-ppo_mixed-".len() + 8 + 3);
        s.env = "acrobot-b1".into();
        s.behaviour = Behaviour::Random;
        assert!(s.minari_id().starts_with("fedrl/acrobot-b1-random-"));
    }

    #[test]
    fn a_dataset_table_is_a_generation_spec_or_a_stored_dataset() {
        let parse = |t: &str| toml::from_str::<DatasetSource>(t).map_err(|e| e.to_string());
        // Every generation spec reads as before, with the same cache key.
        let g =
            parse("env = \"CartPole-v1\"\nunits = 24\nbehaviour = { kind = \"random\" }").unwrap();
        let spec = g.generated().unwrap();
        assert_eq!((spec.units, &spec.behaviour), (24, &Behaviour::Random));
        assert_eq!(parse("").unwrap(), DatasetSource::default());
        assert_eq!(
            DatasetSource::default().minari_id(),
            DatasetSpec::default().minari_id()
        );
        // Stored, with each mapping.
        let s = parse("name = \"myorg/c-v0\"").unwrap();
        assert_eq!(
            s.stored().unwrap(),
            &StoredDataset {
                name: "myorg/c-v0".into(),
                units: UnitMap::Episode,
                env: None
            }
        );
        let owner = parse(
            "name = \"myorg/c-v0\"\nunits = { metadata_key = \"owner\" }\nenv = \"CartPole-v1\"",
        )
        .unwrap();
        assert_eq!(
            owner.stored().unwrap().units,
            UnitMap::MetadataKey("owner".into())
        );
        assert_eq!(
            parse("name = \"a/b-v0\"\nunits = \"stored\"")
                .unwrap()
                .stored()
                .unwrap()
                .units,
            UnitMap::Stored
        );
        // Both, neither, typos: refused with what to do.
        let e = parse("name = \"a/b-v0\"\nseed = 3\nunits = 4").unwrap_err();
        assert!(
            e.contains("seed, units (a number)") && e.contains("not both"),
            "{e}"
        );
        let e = parse("units = \"episode\"").unwrap_err();
        assert!(e.contains("only a stored dataset takes"), "{e}");
        let e = parse("name = \"a/b-v0\"\nunit = \"episode\"").unwrap_err();
        assert!(e.contains("unknown field `unit`"), "{e}");
        let e = parse("name = \"a/b-v0\"\nunits = \"owner\"").unwrap_err();
        assert!(e.contains("unknown variant `owner`"), "{e}");
        let e = parse("envv = \"x\"").unwrap_err();
        assert!(e.contains("unknown field `envv`"), "{e}");
        // The wire (JSON) and the stored scenario (TOML) read back what was written.
        for d in [g, owner, DatasetSource::default()] {
            let j = serde_json::to_string(&d).unwrap();
            assert_eq!(serde_json::from_str::<DatasetSource>(&j).unwrap(), d, "{j}");
            let t = toml::to_string(&d).unwrap();
            assert_eq!(toml::from_str::<DatasetSource>(&t).unwrap(), d, "{t}");
        }
    }

    #[test]
    fn fnv_matches_reference_vectors() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
