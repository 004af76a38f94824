//! fedrl-bench: micro benchmarks, load/churn generators and peer comparisons (see README.md).

/// Runs candle on one thread and keeps its buffers out of mmap, as the `fedrl` binary does:
/// small MLPs are several times slower on more threads, and far slower beside other jobs
/// (RUST-NOTES). Call first thing in `main`, while the process is single-threaded.
pub fn train_like_fedrl() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: called before any other thread exists (documented contract above).
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    fedrl_rl::alloc::tune_for_training();
}

/// A finished `primorl` run read back from its output directory: its scenario name, its task and
/// the released ensemble (on the CPU).
pub struct PrimorlRun {
    pub name: String,
    /// Whether the scenario is `non_private` (only then may a re-run read the dataset).
    pub non_private: bool,
    pub task: fedrl_common::task::primorl::PrimorlTask,
    pub ensemble: fedrl_rl::ensemble::Ensemble,
}

/// Reads `<run>/scenario.toml` (which must be a `primorl` scenario) and
/// `<run>/ensemble.safetensors`.
pub fn load_primorl_run(run: &std::path::Path) -> anyhow::Result<PrimorlRun> {
    use anyhow::Context;
    let scenario_path = run.join("scenario.toml");
    let scenario = fedrl_tasks::scenario_from_file(&scenario_path)
        .with_context(|| format!("reading {}", scenario_path.display()))?;
    let fedrl_common::scenario::Task::Primorl(task) = scenario.task else {
        anyhow::bail!("{}: not a primorl scenario", scenario_path.display());
    };
    let model_path = run.join("ensemble.safetensors");
    let (spec, params) = fedrl_rl::ensemble::load(&model_path)
        .with_context(|| format!("reading {}", model_path.display()))?;
    let ensemble =
        fedrl_rl::ensemble::Ensemble::new(&spec, &params, &fedrl_rl::candle_core::Device::Cpu)?;
    Ok(PrimorlRun {
        name: scenario.name,
        non_private: scenario.non_private,
        task,
        ensemble,
    })
}

/// The `usize` value after `--name` on the command line (`default` when absent or not a number):
/// the hand-rolled benches' (`harness = false`) only argument form.
pub fn arg_usize(name: &str, default: usize) -> usize {
    let argv: Vec<String> = std::env::args().collect();
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Best wall-clock seconds of `repeats` runs of `f`.
pub fn best_of(repeats: usize, mut f: impl FnMut()) -> f64 {
    (0..repeats)
        .map(|_| {
            let start = std::time::Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}
