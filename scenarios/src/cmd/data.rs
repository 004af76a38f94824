//! `fedrl data ...`: offline datasets held by privacy units, in Minari's Arrow/Parquet layout.
//!
//! - `generate [--spec FILE.toml | --env ... --units ...]`: generates the dataset of a spec, or
//!   loads it from the cache when it exists; prints its id and path.
//! - `list [--json]`: datasets under the root.
//! - `summary ID_OR_PATH [--json]`: episodes, steps, units, return quantiles (and, for an
//!   experts dataset, the spread of the experts' mean returns).
//! - `import PATH [--id NEW_ID]`: copies a Minari dataset folder (e.g. written by Python
//!   minari) into the root, validated; episodes without a unit id become one unit each, and
//!   every other episode metadata key (an `owner`, ...) is kept, so that a scenario can name the
//!   dataset (`[task.dataset] name = ...`) and map units by it.
//!
//! The root is `--data-dir`, else `$FEDRL_DATA_DIR`, else `$MINARI_DATASETS_PATH`, else
//! `~/.fedrl/datasets`; it is a Minari
//! root (`MINARI_DATASETS_PATH=ROOT python -c 'import minari; minari.load_dataset(ID)'`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use fedrl_common::offline::{Behaviour, DatasetSpec};
use fedrl_rl::offline::cache::{self, Source};
use fedrl_rl::offline::continuous::ContinuousDataset;
use fedrl_rl::offline::experts::{EXPERTS_FILE, ExpertReturns};
use fedrl_rl::offline::generate::Progress;
use fedrl_rl::offline::minari;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::cmd::UsageError;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: DataCommand,
}

#[derive(clap::Subcommand)]
enum DataCommand {
    /// Generate a dataset from a spec (or load it from the cache).
    Generate(Box<GenerateArgs>),
    /// List the datasets under the root (Minari folders, and PriMORL's continuous-action files).
    List(ListArgs),
    /// Summarise a dataset: episodes, steps, units, return quantiles.
    Summary(SummaryArgs),
    /// Import a Minari dataset folder from disk into the root (Box actions: into the continuous
    /// format, listed as `continuous/<id with / as ->`).
    Import(ImportArgs),
}

#[derive(clap::Args)]
pub(crate) struct RootArg {
    /// Dataset root (a Minari root). Default: $FEDRL_DATA_DIR, else $MINARI_DATASETS_PATH, else
    /// ~/.fedrl/datasets.
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

#[derive(clap::Args)]
struct GenerateArgs {
    #[command(flatten)]
    root: RootArg,
    /// A TOML file holding a whole DatasetSpec (fields as below; `[behaviour]` with `kind =
    /// "random"`, `"ppo_mixed"` or `"experts"`). Excludes the field flags.
    #[arg(long, conflicts_with_all = ["env", "population_seed", "behaviour", "iterations",
        "checkpoints", "epsilon", "units", "episodes_per_unit", "seed", "population",
        "per_setting", "hidden", "p_min", "max_steps", "shared_iterations", "expert_lr"])]
    spec: Option<PathBuf>,
    /// Population name or environment id (`fedrl sim list`). Default CartPole-v1.
    #[arg(long)]
    env: Option<String>,
    /// Seed of the population's per-user parameters. Default 0.
    #[arg(long)]
    population_seed: Option<u64>,
    /// Behaviour policy: `random`, `ppo_mixed` or `experts`. Default ppo_mixed.
    #[arg(long)]
    behaviour: Option<String>,
    /// ppo_mixed: PPO iterations of the behaviour policy (default 60); experts: PPO iterations
    /// per expert (default 20).
    #[arg(long)]
    iterations: Option<u64>,
    /// experts: the B.1 population the experts train on (cartpole-b1, acrobot-b1, hiv-b1);
    /// `--env` is then the default environment of the demonstrations. Default cartpole-b1.
    #[arg(long)]
    population: Option<String>,
    /// experts: experts per grid setting. Default 3.
    #[arg(long)]
    per_setting: Option<u32>,
    /// experts: hidden widths of the expert MLP, comma-separated. Default 32,32.
    #[arg(long, value_delimiter = ',')]
    hidden: Option<Vec<usize>>,
    /// experts: minimum action probability of the softened experts. Default 0.02.
    #[arg(long)]
    p_min: Option<f64>,
    /// experts: cap on an episode's steps (0: the environment's limit). Default 200.
    #[arg(long)]
    max_steps: Option<u64>,
    /// experts: PPO iterations of a shared starting policy before each expert's own (64
    /// experts' episodes per update). Default 0 (every expert starts from random weights).
    #[arg(long)]
    shared_iterations: Option<u64>,
    /// experts: Adam learning rate of each expert's own PPO iterations. Default 2.5e-3.
    #[arg(long)]
    expert_lr: Option<f64>,
    /// ppo_mixed: evenly spaced policy checkpoints; unit u acts with checkpoint u % this.
    /// Default 4.
    #[arg(long)]
    checkpoints: Option<u32>,
    /// ppo_mixed: probability of a uniformly random action at each step. Default 0.2.
    #[arg(long)]
    epsilon: Option<f64>,
    /// Number of privacy units. Default 1000.
    #[arg(long)]
    units: Option<u64>,
    /// Episodes each unit owns. Default 1.
    #[arg(long)]
    episodes_per_unit: Option<u64>,
    /// Seed of the behaviour policy's training and of the episodes. Default 0.
    #[arg(long)]
    seed: Option<u64>,
    /// Print one JSON object (id, path, source, summary) instead of lines.
    #[arg(long)]
    json: bool,
    /// `--spec` holds a continuous-action (PriMORL) dataset spec, as a scenario's
    /// `[task.dataset]` (env, units, public, seed, behaviour, and `[gymnasium]` for a
    /// `gymnasium:<id>` environment); stored as `continuous/<name>`.
    #[arg(long, requires = "spec")]
    continuous: bool,
}

#[derive(clap::Args)]
struct ListArgs {
    #[command(flatten)]
    root: RootArg,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct SummaryArgs {
    #[command(flatten)]
    root: RootArg,
    /// A dataset id under the root, or a dataset folder (the one holding `data/`); for a
    /// continuous (PriMORL) dataset, `continuous/<name>` or its `.safetensors` file.
    id_or_path: String,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct ImportArgs {
    #[command(flatten)]
    root: RootArg,
    /// The Minari dataset folder (the one holding `data/`), or a Minari dataset id
    /// (`namespace/name-vN`) found where Minari looks: `$MINARI_DATASETS_PATH`, else
    /// `~/.minari/datasets`.
    path: PathBuf,
    /// Store it under this id (`namespace/name-vN`) instead of the id in its metadata.
    #[arg(long)]
    id: Option<String>,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        DataCommand::Generate(a) => generate(*a),
        DataCommand::List(a) => list(a),
        DataCommand::Summary(a) => summary(a),
        DataCommand::Import(a) => import(a),
    }
}

fn root(r: &RootArg) -> anyhow::Result<PathBuf> {
    Ok(cache::data_root(r.data_dir.as_deref())?)
}

/// The spec from `--spec` or from the field flags over the defaults.
fn spec_of(a: &GenerateArgs) -> anyhow::Result<DatasetSpec> {
    if let Some(path) = &a.spec {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        return toml::from_str(&text)
            .map_err(|e| UsageError(format!("{}: {e}", path.display())).into());
    }
    let mut s = DatasetSpec::default();
    if let Some(v) = &a.env {
        s.env = v.clone();
    }
    if let Some(v) = a.population_seed {
        s.population_seed = v;
    }
    if let Some(v) = a.units {
        s.units = v;
    }
    if let Some(v) = a.episodes_per_unit {
        s.episodes_per_unit = v;
    }
    if let Some(v) = a.seed {
        s.seed = v;
    }
    let expert_flags = a.population.is_some()
        || a.per_setting.is_some()
        || a.hidden.is_some()
        || a.p_min.is_some()
        || a.max_steps.is_some()
        || a.shared_iterations.is_some()
        || a.expert_lr.is_some();
    if expert_flags && a.behaviour.as_deref() != Some("experts") {
        return Err(UsageError(
            "--population, --per-setting, --hidden, --p-min, --max-steps, --shared-iterations \
             and --expert-lr apply to --behaviour experts"
                .into(),
        )
        .into());
    }
    let ppo_flags = a.iterations.is_some() || a.checkpoints.is_some() || a.epsilon.is_some();
    match a.behaviour.as_deref() {
        Some("experts") => {
            if a.checkpoints.is_some() || a.epsilon.is_some() {
                return Err(UsageError(
                    "--checkpoints and --epsilon apply to --behaviour ppo_mixed".into(),
                )
                .into());
            }
            let mut b = Behaviour::experts(a.population.as_deref().unwrap_or("cartpole-b1"));
            if let Behaviour::Experts {
                per_setting,
                iterations,
                hidden,
                p_min,
                max_steps,
                shared_iterations,
                expert_lr,
                ..
            } = &mut b
            {
                if let Some(v) = a.per_setting {
                    *per_setting = v;
                }
                if let Some(v) = a.iterations {
                    *iterations = v;
                }
                if let Some(v) = &a.hidden {
                    *hidden = v.clone();
                }
                if let Some(v) = a.p_min {
                    *p_min = v;
                }
                if let Some(v) = a.max_steps {
                    *max_steps = v;
                }
                if let Some(v) = a.shared_iterations {
                    *shared_iterations = v;
                }
                if a.expert_lr.is_some() {
                    *expert_lr = a.expert_lr;
                }
            }
            s.behaviour = b;
        }
        Some("random") => {
            if ppo_flags {
                return Err(UsageError(
                    "--iterations, --checkpoints and --epsilon apply to --behaviour ppo_mixed"
                        .into(),
                )
                .into());
            }
            s.behaviour = Behaviour::Random;
        }
        None | Some("ppo_mixed") => {
            if let Behaviour::PpoMixed {
                iterations,
                checkpoints,
                epsilon,
            } = &mut s.behaviour
            {
                if let Some(v) = a.iterations {
                    *iterations = v;
                }
                if let Some(v) = a.checkpoints {
                    *checkpoints = v;
                }
                if let Some(v) = a.epsilon {
                    *epsilon = v;
                }
            }
        }
        Some(other) => {
            return Err(UsageError(format!(
                "--behaviour {other:?}: expected random, ppo_mixed or experts"
            ))
            .into());
        }
    }
    Ok(s)
}

/// The progress bar of a dataset generation (PPO training, then recording).
pub(crate) fn generation_bar() -> anyhow::Result<ProgressBar> {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} {elapsed}")
            .map_err(|e| anyhow::anyhow!("progress template: {e}"))?
            .progress_chars("=> "),
    );
    Ok(bar)
}

/// Whether progress from `prev` to `done` of `total` is where a log without a progress bar
/// gets a line: it passed into another tenth of the work, or reached its end. Progress may
/// jump (a SAC run reports once per checkpoint, 22,222 of 199,998 steps), so this compares
/// with the last report, not with `done - 1`.
pub(crate) fn at_tenth(prev: u64, done: u64, total: u64) -> bool {
    done == total || (total > 0 && done > prev && done * 10 / total != prev * 10 / total)
}

/// Moves `bar` to `done` of `total` with `message`. Where `bar` is hidden, it also prints
/// `dataset generation: <what> (<elapsed> s)` at each tenth of the phase (`at_tenth`, against
/// the bar's last position, or 0 when a new phase changes its length or starts over); `what`
/// is only formatted then.
fn advance(
    bar: &ProgressBar,
    done: u64,
    total: u64,
    message: impl Into<std::borrow::Cow<'static, str>>,
    what: impl FnOnce() -> String,
) {
    let prev = if bar.length() == Some(total) && bar.position() <= done {
        bar.position()
    } else {
        0
    };
    if bar.is_hidden() && at_tenth(prev, done, total) {
        eprintln!(
            "dataset generation: {} ({:.0} s)",
            what(),
            bar.elapsed().as_secs_f64()
        );
    }
    bar.set_length(total);
    bar.set_position(done);
    bar.set_message(message);
}

/// Shows a generation's training or recording progress on `bar` (checkpoints are the caller's).
/// Where the bar is hidden (stderr is not a terminal, e.g. `fedrl run` writing to a log), one
/// line per tenth of each phase says that the generation is alive and how far it is.
pub(crate) fn show_generation(bar: &ProgressBar, p: &Progress) {
    match p {
        Progress::Training {
            done,
            total,
            train_return,
        } => advance(
            bar,
            *done,
            *total,
            format!("PPO {train_return:7.1}"),
            || format!("PPO iteration {done}/{total}, mean training return {train_return:.1}"),
        ),
        Progress::Recording { done, total } => advance(bar, *done, *total, "recording", || {
            format!("recorded {done}/{total} units")
        }),
        Progress::Checkpoint { .. } => {}
    }
}

/// Shows a continuous dataset's generation (the behaviour's learning run, then recording).
pub(crate) fn show_continuous_generation(
    bar: &ProgressBar,
    p: &fedrl_rl::offline::continuous::ContinuousProgress,
) {
    use fedrl_rl::offline::continuous::ContinuousProgress as P;
    match p {
        P::Learning {
            step,
            total,
            recent_return,
        } => advance(
            bar,
            *step,
            *total,
            format!("SAC {recent_return:8.1}"),
            || format!("learner step {step}/{total}, recent return {recent_return:.1}"),
        ),
        P::Recording { done, total } => advance(bar, *done, *total, "recording", || {
            format!("recorded {done}/{total} units")
        }),
    }
}

/// `fedrl data generate --continuous --spec FILE`: the continuous dataset of the spec, generated
/// (through the Gymnasium bridge for a `gymnasium:<id>` environment) or found under the root.
fn generate_continuous(a: &GenerateArgs, path: &Path) -> anyhow::Result<ExitCode> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let spec: fedrl_common::task::primorl::ContinuousDatasetSpec =
        toml::from_str(&text).map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
    spec.validate()
        .map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
    let root = root(&a.root)?;
    let file = root.join("continuous").join(spec.file_name());
    let source = if file.is_file() { "cache" } else { "generated" };
    let bar = generation_bar()?;
    let started = std::time::Instant::now();
    fedrl_rl::offline::continuous::prepare(&spec, &root, &mut |p| {
        show_continuous_generation(&bar, &p)
    })?;
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let listed = format!(
        "continuous/{}",
        spec.file_name().trim_end_matches(".safetensors")
    );
    if a.json {
        let summary = ContinuousDataset::summarize_file(&file)?;
        println!(
            "{}",
            json!({ "id": listed, "path": file, "source": source, "seconds": seconds,
                    "summary": summary })
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!("{source}: {listed} ({seconds:.1} s)");
    continuous_summary(&file, false)
}

fn generate(a: GenerateArgs) -> anyhow::Result<ExitCode> {
    if let (true, Some(path)) = (a.continuous, &a.spec) {
        return generate_continuous(&a, path);
    }
    let spec = spec_of(&a)?;
    let root = root(&a.root)?;
    let bar = generation_bar()?;
    let mut checkpoints = Vec::new();
    let mut training = Vec::new();
    let mut on_progress = |p: Progress| match p {
        Progress::Training { train_return, .. } => {
            training.push(train_return);
            show_generation(&bar, &p);
        }
        Progress::Checkpoint {
            index,
            iteration,
            mean_return,
            episodes,
        } => checkpoints.push(json!({
            "checkpoint": index,
            "iteration": iteration,
            "mean_return": mean_return,
            "episodes": episodes,
        })),
        other => show_generation(&bar, &other),
    };
    let started = std::time::Instant::now();
    let (dataset, source) = cache::load_or_generate(&spec, &root, &mut on_progress)?;
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let path = minari::dataset_dir(&root, &dataset.id)?;
    let summary = dataset.summary();
    let experts = expert_returns(&path, &dataset);
    let source = match source {
        Source::Cache => "cache",
        Source::Generated => "generated",
    };
    if a.json {
        println!(
            "{}",
            json!({
                "id": dataset.id,
                "path": path,
                "source": source,
                "checkpoints": checkpoints,
                "training_returns": training,
                "summary": summary,
                "expert_returns": experts,
                "seconds": seconds,
            })
        );
    } else {
        for c in &checkpoints {
            println!(
                "checkpoint {} (after {} PPO iterations): mean return {:.1} over {} episodes",
                c["checkpoint"],
                c["iteration"],
                c["mean_return"].as_f64().unwrap_or(f64::NAN),
                c["episodes"]
            );
        }
        if let (Some(first), Some(last)) = (training.first(), training.last()) {
            println!(
                "PPO: mean training return {first:.1} before the first iteration, {last:.1} \
                 before the last ({} iterations)",
                training.len()
            );
        }
        println!("{source}: {} ({seconds:.1} s)", dataset.id);
        println!("path: {}", path.display());
        print_summary(&summary);
        print_expert_returns(experts.as_ref());
    }
    Ok(ExitCode::SUCCESS)
}

/// The spread of the experts' returns when the dataset folder holds experts.
fn expert_returns(dir: &Path, dataset: &fedrl_rl::offline::Dataset) -> Option<ExpertReturns> {
    dir.join(EXPERTS_FILE)
        .is_file()
        .then(|| ExpertReturns::of(dataset))
}

fn print_expert_returns(r: Option<&ExpertReturns>) {
    if let Some(r) = r {
        println!(
            "expert mean returns ({} experts): mean {:.2}  min {:.2}  q25 {:.2}  median {:.2}  \
             q75 {:.2}  max {:.2}",
            r.experts, r.mean, r.min, r.q25, r.median, r.q75, r.max
        );
    }
}

fn list(a: ListArgs) -> anyhow::Result<ExitCode> {
    let root = root(&a.root)?;
    let found = cache::list(&root)?;
    if a.json {
        println!("{}", json!({ "root": root, "datasets": found }));
        return Ok(ExitCode::SUCCESS);
    }
    println!("root: {}", root.display());
    if found.is_empty() {
        println!("(no datasets)");
    }
    for d in &found {
        match &d.problem {
            // One damaged dataset is marked; the others are listed as usual.
            Some(problem) => println!("{:50} DAMAGED: {problem}", d.id),
            None => println!(
                "{:50} {:>8} episodes {:>10} steps{}",
                d.id,
                d.total_episodes,
                d.total_steps,
                if d.generated { "  (generated)" } else { "" }
            ),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A dataset folder: `id_or_path` itself when it holds `data/`, else the id under the root.
pub(crate) fn locate(id_or_path: &str, root: &RootArg) -> anyhow::Result<PathBuf> {
    let p = Path::new(id_or_path);
    if p.join("data").is_dir() {
        return Ok(p.to_path_buf());
    }
    let root = self::root(root)?;
    let dir = minari::dataset_dir(&root, id_or_path).map_err(|_| {
        UsageError(format!(
            "{id_or_path:?} is neither a dataset folder nor an id"
        ))
    })?;
    if !dir.join("data").is_dir() {
        return Err(UsageError(format!(
            "no dataset {id_or_path:?} under {} (see `fedrl data list`)",
            root.display()
        ))
        .into());
    }
    Ok(dir)
}

fn print_summary(s: &fedrl_rl::offline::DatasetSummary) {
    println!(
        "env: {}  obs_dim {}  actions {}",
        s.env_id, s.obs_dim, s.n_actions
    );
    println!(
        "episodes {}  steps {}  units {} ({}-{} episodes each)",
        s.episodes, s.steps, s.units, s.episodes_per_unit_min, s.episodes_per_unit_max
    );
    println!(
        "return mean {:.2}  min {:.2}  q25 {:.2}  median {:.2}  q75 {:.2}  max {:.2}",
        s.return_mean, s.return_min, s.return_q25, s.return_median, s.return_q75, s.return_max
    );
}

/// The file of a continuous (PriMORL) dataset named by `id_or_path`: a `.safetensors` path, or
/// `continuous/<name>` as `fedrl data list` shows it; None for anything else.
fn continuous_file(id_or_path: &str, root: &RootArg) -> anyhow::Result<Option<PathBuf>> {
    let p = Path::new(id_or_path);
    if p.is_file() && p.extension().is_some_and(|e| e == "safetensors") {
        return Ok(Some(p.to_path_buf()));
    }
    if !id_or_path.starts_with("continuous/") {
        return Ok(None);
    }
    let root = self::root(root)?;
    let path = fedrl_rl::offline::continuous::named_file(&root, id_or_path);
    let Some(path) = path.filter(|p| p.is_file()) else {
        return Err(UsageError(format!(
            "no dataset {id_or_path:?} under {} (see `fedrl data list`)",
            root.display()
        ))
        .into());
    };
    Ok(Some(path))
}

fn continuous_summary(path: &Path, as_json: bool) -> anyhow::Result<ExitCode> {
    let s = ContinuousDataset::summarize_file(path)?;
    if as_json {
        println!("{}", json!({ "path": path, "summary": s }));
        return Ok(ExitCode::SUCCESS);
    }
    println!("{}", path.display());
    println!(
        "env: {}  obs_dim {}  act_dim {}",
        s.env_id, s.obs_dim, s.act_dim
    );
    println!(
        "episodes {} (one per unit)  steps {}  terminated {}",
        s.episodes, s.steps, s.terminated
    );
    println!(
        "return mean {:.2}  min {:.2}  q25 {:.2}  median {:.2}  q75 {:.2}  max {:.2}",
        s.return_mean, s.return_min, s.return_q25, s.return_median, s.return_q75, s.return_max
    );
    println!("procedure: {}", s.procedure);
    Ok(ExitCode::SUCCESS)
}

fn summary(a: SummaryArgs) -> anyhow::Result<ExitCode> {
    if let Some(path) = continuous_file(&a.id_or_path, &a.root)? {
        return continuous_summary(&path, a.json);
    }
    let dir = locate(&a.id_or_path, &a.root)?;
    let read = minari::read(&dir)?;
    let s = read.dataset.summary();
    let experts = expert_returns(&dir, &read.dataset);
    if a.json {
        println!(
            "{}",
            json!({
                "path": dir,
                "units_assigned": read.units_assigned,
                "summary": s,
                "expert_returns": experts,
            })
        );
    } else {
        println!("{} ({})", s.id, dir.display());
        print_summary(&s);
        print_expert_returns(experts.as_ref());
        if read.units_assigned > 0 {
            println!(
                "{} episodes named no unit: each counts as a unit of its own",
                read.units_assigned
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn import(a: ImportArgs) -> anyhow::Result<ExitCode> {
    let root = root(&a.root)?;
    let path = import_source(&a.path)?;
    let header = minari::header(&path).with_context(|| format!("importing {}", path.display()))?;
    if let minari::ActionSpace::Box(_) = header.action {
        return import_box(&a, &path, &header, &root);
    }
    let read = minari::read(&path).with_context(|| format!("importing {}", path.display()))?;
    let mut dataset = read.dataset;
    if let Some(id) = a.id {
        minari::check_id(&id).map_err(|e| UsageError(e.to_string()))?;
        dataset.id = id;
    }
    // Episode metadata beyond fedrl's own keys (e.g. an `owner` a scenario maps units by) is
    // copied into the stored episodes before the SHA-256 sums are written.
    let mut extras = Vec::with_capacity(dataset.episodes.len());
    for e in &dataset.episodes {
        extras.push((e.id, minari::extra_episode_metadata(&path, e.id)?));
    }
    let dir = cache::store_with(&dataset, &root, None, &|tmp| {
        for (id, extra) in &extras {
            minari::add_episode_metadata(tmp, *id, extra)?;
        }
        Ok(())
    })?;
    let s = dataset.summary();
    if a.json {
        println!(
            "{}",
            json!({
                "id": dataset.id,
                "path": dir,
                "units_assigned": read.units_assigned,
                "summary": s,
            })
        );
    } else {
        println!("imported: {}", dataset.id);
        println!("path: {}", dir.display());
        if read.units_assigned > 0 {
            println!(
                "{} episodes named no unit: each became a unit of its own",
                read.units_assigned
            );
        }
        print_summary(&s);
    }
    Ok(ExitCode::SUCCESS)
}

/// A Box-action Minari dataset goes into the continuous format PriMORL reads
/// (`root/continuous/<id with / as ->.safetensors`, SHA-256 sidecar beside it).
fn import_box(
    a: &ImportArgs,
    path: &Path,
    header: &minari::Header,
    root: &Path,
) -> anyhow::Result<ExitCode> {
    let id = a.id.clone().unwrap_or_else(|| header.id.clone());
    minari::check_id(&id).map_err(|e| UsageError(e.to_string()))?;
    let imported = fedrl_rl::offline::continuous::import_minari(path, &id, root)
        .with_context(|| format!("importing {}", path.display()))?;
    let listed = format!(
        "continuous/{}",
        fedrl_rl::offline::continuous::imported_name(&id)
    );
    let s = imported.dataset.summary();
    if a.json {
        println!(
            "{}",
            json!({
                "id": listed,
                "path": imported.path,
                "units_assigned": imported.units_assigned,
                "summary": s,
            })
        );
    } else {
        println!("imported: {listed} (Box actions: the continuous format)");
        println!("path: {}", imported.path.display());
        if imported.units_assigned > 0 {
            println!(
                "{} episodes named no unit: each became a unit of its own",
                imported.units_assigned
            );
        }
        println!(
            "env: {}  obs_dim {}  act_dim {}  episodes {}  steps {}",
            s.env_id, s.obs_dim, s.act_dim, s.episodes, s.steps
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// What `fedrl data import` reads: the folder given, or, when no such folder exists and the
/// argument is a dataset id, that id under Minari's root.
fn import_source(arg: &Path) -> anyhow::Result<PathBuf> {
    if arg.is_dir() {
        return Ok(arg.to_path_buf());
    }
    let as_id = arg.to_string_lossy();
    if minari::check_id(&as_id).is_ok()
        && let Some(root) = cache::minari_root()
    {
        let dir = root.join(arg);
        if dir.is_dir() {
            return Ok(dir);
        }
        return Err(UsageError(format!(
            "{}: no such folder, and no dataset {as_id} under Minari's root {} \
             ($MINARI_DATASETS_PATH, else ~/.minari/datasets)",
            arg.display(),
            root.display()
        ))
        .into());
    }
    Err(UsageError(format!("{}: no such dataset folder", arg.display())).into())
}

#[cfg(test)]
mod tests {
    use super::at_tenth;

    #[test]
    fn a_log_gets_one_line_per_tenth_and_one_at_the_end() {
        // Reports every `step` units of `total`.
        let lines = |step: u64, total: u64| {
            let mut prev = 0;
            let mut n = 0;
            for d in (step..=total).step_by(step as usize) {
                n += usize::from(at_tenth(prev, d, total));
                prev = d;
            }
            n
        };
        assert_eq!(lines(1, 100), 10);
        assert_eq!(lines(1, 1000), 10);
        assert_eq!(lines(1, 3), 3);
        assert_eq!(lines(1, 1), 1);
        assert!(at_tenth(499, 500, 500));
        // A SAC generation's checkpoints: 9 of 22,222 steps, none on a tenth's boundary.
        assert_eq!(lines(22_222, 199_998), 9);
        // Coarser than a tenth: every report is a line.
        assert_eq!(lines(250, 1000), 4);
    }

    #[test]
    fn a_hidden_bar_logs_jumping_progress_once_per_tenth() {
        // The bar remembers the last report, also when hidden; a new phase (another length)
        // starts from 0.
        let bar = indicatif::ProgressBar::hidden();
        bar.set_length(199_998);
        bar.set_position(22_222);
        assert!(at_tenth(bar.position(), 44_444, 199_998));
        assert!(!at_tenth(bar.position(), 22_222, 199_998));
    }
}
