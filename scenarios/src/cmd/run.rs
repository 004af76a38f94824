//! `fedrl run`: a whole deployment on this machine (aggregator + client agents over QUIC on
//! loopback, as separate processes). The orchestration lives in [`crate::deploy`]; this module
//! adds what a user reads afterwards: the report fields, the exported policy and the learning
//! curve (with the non-private twin's curve when `--twin` ran it too), and for runs evaluated in
//! Gymnasium environments (`gymnasium:<id>` DPPG populations, offline CQL datasets) the
//! evaluations the aggregator leaves to it ([`crate::deferred_eval`]);
//! for glucose simulators
//! also the control variability grid of the held-out patient-days (`cvga.png`) and the pooled
//! time in range in the summary.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::builder::TypedValueParser;
use fedrl_aggregator::state;
use fedrl_common::device::DeviceSpec;

use crate::cmd::UsageError;
use crate::deploy::{self, LocalRun, RunResult};
use crate::plot::{CvgaSeries, Series, cvga_plot, line_plot};

/// File name of the learning curve in the output directory.
const CURVE_FILE: &str = "learning_curve.png";
/// File name of the policy-phase curves (normalised return against SAC epochs; PriMORL).
const POLICY_CURVE_FILE: &str = "policy_curve.png";
/// File name of PrivORL's fine-tuning curve (held-out denoising loss against steps).
const PRIVORL_CURVE_FILE: &str = "privorl_curve.png";
/// File name of the control variability grid (glucose simulators only).
const CVGA_FILE: &str = "cvga.png";
/// File name of the exported policy (written by the aggregator's model).
const POLICY_FILE: &str = fedrl_tasks::dppg::POLICY_FILE;
/// What a task's model exports and the run copies next to report.json: the DPPG policy, the
/// CQL Q-network, PriMORL's ensemble and its SAC policy.
const MODEL_FILES: [&str; 4] = [
    POLICY_FILE,
    fedrl_tasks::offline_cql::QNET_FILE,
    fedrl_tasks::primorl::ENSEMBLE_FILE,
    fedrl_tasks::primorl::POLICY_FILE,
];

#[derive(clap::Args)]
pub struct Args {
    /// Scenario file (TOML); default: the built-in `scenarios/cartpole-dppg.toml`.
    pub scenario: Option<PathBuf>,
    /// Output directory (public: report.json, metrics.jsonl, policy, plots; operator-only, under
    /// operator/: exact counts, privacy.ledger, logs; FILES.md says which is which); default
    /// runs/NAME-UNIXTIME. It must not exist or be empty, unless --resume.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the run in --out (interrupted, stopped by an error, or out of budget): with no
    /// SCENARIO it runs the stored OUT/scenario.toml; a given SCENARIO must resolve to the same
    /// scenario (only `target_epsilon` and `device` may differ). Logs are appended to, and
    /// report.json is replaced only when the resumed run ends.
    #[arg(long, requires = "out")]
    pub resume: bool,
    /// Also run this twin scenario afterwards (the first into OUT/twin, further ones into
    /// OUT/twin-2, OUT/twin-3...) and plot every curve together: the non-private twin, other
    /// privacy levels, baselines such as MOPO. Repeatable. With no value for the built-in
    /// scenario, its twin `cartpole-dppg-nonprivate.toml`.
    // Parsed as an OsString: clap's PathBuf parser refuses the empty "no file given" marker.
    #[arg(
        long,
        num_args = 0..=1,
        default_missing_value = "",
        action = clap::ArgAction::Append,
        value_parser = clap::builder::OsStringValueParser::new().map(PathBuf::from)
    )]
    pub twin: Vec<PathBuf>,
    /// Give up (and stop every process) after this many seconds.
    #[arg(long, default_value_t = 3600.0)]
    pub timeout: f64,
    /// With --resume: allow a larger `target_epsilon` than the ledger was created with (refused
    /// otherwise; the raise is recorded in the ledger).
    #[arg(long)]
    pub allow_budget_increase: bool,
    /// Where the aggregator and the client agents compute: `cpu` or `cuda:N` (needs a build
    /// with the `cuda` feature). Overrides the scenario's `device` (and the twin's).
    #[arg(long, value_name = "cpu|cuda:N")]
    pub device: Option<DeviceSpec>,
    /// Override a field of SCENARIO by its dotted path, e.g. `--set task.clip_norm=0.5 --set
    /// rounds=20`. The value is read as TOML (`0.5`, `20`, `true`, `[64, 64]`; a bare word is a
    /// string) and typed by the scenario's schema: an unknown field or a wrong type is refused
    /// and names the key. Applied before validation, so the run checks it as it checks a file;
    /// the stored `OUT/scenario.toml` holds the result. Repeatable (a later one wins). Not
    /// applied to --twin scenarios.
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = crate::overrides::parse)]
    pub sets: Vec<crate::overrides::Override>,
    /// Run N independent replicates of the scenario, one after the other, into OUT/rep-0 ...
    /// OUT/rep-(N-1) (each a complete run directory): fresh noise (from the OS, unless the
    /// scenario sets `seed`) and different training seeds in each, the same users, data and
    /// held-out episodes (replicate 0 is the scenario as given; OUT/report.json lists the
    /// seeds). OUT/report.json gives the mean final return with a 95% Student t interval,
    /// OUT/learning_curve.png the mean curve with its 95% band. Privacy is per replicate: each
    /// has its own ledger and epsilon, and publishing all of them composes (the report says
    /// so). With --twin, each replicate runs the twins too (OUT/rep-i/twin, ...) and the plot
    /// has a mean curve and band per scenario; --resume continues an interrupted set (those
    /// finished are read back, the one running resumes, the rest start).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub replicates: u64,
}

/// The built-in scenario's non-private twin.
const DEFAULT_TWIN: &str = include_str!("../../cartpole-dppg-nonprivate.toml");

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.replicates == 0 {
        return Err(UsageError("--replicates must be at least 1".into()).into());
    }
    if args.replicates > 1 {
        return run_replicates(args);
    }
    let mut run = LocalRun::prepare(
        args.scenario.as_deref(),
        args.out.as_deref(),
        args.device,
        args.resume,
        &args.sets,
    )
    .map_err(|e| UsageError(format!("{e:#}")))?;
    run.allow_budget_increase = args.allow_budget_increase;
    let mut twins = Vec::with_capacity(args.twin.len());
    for (i, t) in args.twin.iter().enumerate() {
        let file = if t.as_os_str().is_empty() {
            if args.scenario.is_some() {
                return Err(UsageError(
                    "--twin needs the twin's scenario file when a scenario is given".into(),
                )
                .into());
            }
            // Written once: a resume keeps the file the run started with.
            let twin_file = run.out_dir.join("twin-scenario.toml");
            if !twin_file.exists() {
                std::fs::write(&twin_file, DEFAULT_TWIN)?;
            }
            twin_file
        } else {
            t.clone()
        };
        // The first twin runs in OUT/twin, further ones (baselines) in OUT/twin-2, OUT/twin-3...
        let twin_dir = run.out_dir.join(twin_dir_name(i));
        // A resumed run resumes its twins too, if they had started.
        let twin_started = std::fs::read_dir(&twin_dir).is_ok_and(|mut d| d.next().is_some());
        twins.push(
            LocalRun::prepare(
                Some(&file),
                Some(&twin_dir),
                args.device,
                args.resume && twin_started,
                &[],
            )
            .map_err(|e| UsageError(format!("{e:#}")))?,
        );
    }
    let exe = std::env::current_exe()?;
    let kind = run.scenario.unit_kind.to_string();
    // "trajectory" -> "trajectories"; "user" and "expert" take an s.
    let plural = match kind.strip_suffix('y') {
        Some(stem) => format!("{stem}ies"),
        None => format!("{kind}s"),
    };
    eprintln!(
        "{}: {} rounds, {} {plural}, results in {}",
        run.scenario.name,
        run.scenario.rounds,
        run.scenario.users,
        run.out_dir.display()
    );
    if let Some(sel) = run.scenario.selective() {
        let schedule = fedrl_common::selective::Schedule::new(sel);
        eprintln!(
            "selective DP-SGD: {} steps = {} DP-SGD steps (the rounds) + {} free steps on released prefixes{}",
            sel.steps,
            schedule.dp_steps(),
            schedule.free_steps(),
            match &sel.release {
                Some(r) => format!(
                    "; DataRelease first: {} candidate trajectories at epsilon_1 = {}, delta_1 = {:e}",
                    r.trajectories, r.epsilon, r.delta
                ),
                None => String::new(),
            }
        );
    }
    prepare_dataset(&run.scenario)?;
    let mut result = match deploy::run_local(&run, &exe, args.timeout, true) {
        Ok(r) => r,
        Err(e) => return interrupted(e),
    };
    if let Err(e) = crate::deferred_eval::complete(&run, &mut result) {
        return interrupted(e);
    }
    // Offline CQL evaluates by training step (a Selective run's free steps have no round):
    // its curves are drawn against steps, the others' against rounds.
    let by_step = !step_points(&result.report).is_empty();
    let series = |r: &LocalRun, report: &serde_json::Value, name: &str| {
        if by_step {
            let (points, band) = step_curve(report);
            Ok(Series {
                name: name.into(),
                points,
                band,
            })
        } else {
            curve(r, name)
        }
    };
    let mut curves = vec![series(
        &run,
        &result.report,
        &private_label(&result.report),
    )?];
    let mut twin_reports = Vec::with_capacity(twins.len());
    for t in &twins {
        eprintln!(
            "twin {}: results in {}",
            t.scenario.name,
            t.out_dir.display()
        );
        prepare_dataset(&t.scenario)?;
        let mut tr = match deploy::run_local(t, &exe, args.timeout, true) {
            Ok(r) => r,
            Err(e) => return interrupted(e),
        };
        if let Err(e) = crate::deferred_eval::complete(t, &mut tr) {
            return interrupted(e);
        }
        finish(t, &mut tr)?;
        let label = twin_label(&t.scenario, &tr.report);
        curves.push(series(t, &tr.report, &label)?);
        twin_reports.push((label, tr.report));
    }
    if curves.iter().any(|c| !c.points.is_empty()) {
        line_plot(
            &run.out_dir.join(CURVE_FILE),
            &format!(
                "{}: evaluation return on held-out users, 95% band",
                run.scenario.name
            ),
            if by_step {
                "training step (DP-SGD and free)"
            } else {
                "round"
            },
            "mean return",
            &curves,
        )?;
    }
    write_policy_curves(
        &run.out_dir.join(POLICY_CURVE_FILE),
        &run.scenario.name,
        &result.report,
        &twin_reports,
    )?;
    write_privorl_curves(
        &run.out_dir.join(PRIVORL_CURVE_FILE),
        &run.scenario.name,
        &result.report,
        &twin_reports,
    )?;
    finish(&run, &mut result)?;
    write_cvga(
        &run.out_dir.join(CVGA_FILE),
        &run.scenario.name,
        &result.report,
        twin_reports.first().map(|(_, r)| r),
    )?;
    print_summary(&run, &result.report, &result.operator);
    Ok(ExitCode::SUCCESS)
}

/// The legend of a run's own curve: "private" with its epsilon and delta (seeded noise is
/// marked; a non-private run says so).
fn private_label(report: &serde_json::Value) -> String {
    match (report["epsilon"].as_f64(), report["delta"].as_f64()) {
        (Some(e), Some(d)) => format!(
            "private (epsilon {e:.2}, delta {d:e}{})",
            if report["seeded"] == true {
                ", seeded noise"
            } else {
                ""
            }
        ),
        _ => "non-private".into(),
    }
}

/// What one replicate of one arm (the scenario or one of its twins) left behind.
struct ArmRun {
    report: serde_json::Value,
    /// (round or training step, evaluation return) of its learning curve.
    points: Vec<(f64, f64)>,
    by_step: bool,
}

/// Runs one replicate of one arm in `dir` from `scenario_file` with `sets` (its seeds); with
/// --resume, reads back a replicate that finished before (its `report.json` is written only
/// when it ends) or resumes one that started. `Ok(Err(code))` when a signal interrupted it.
fn replicate_arm(
    args: &Args,
    exe: &Path,
    scenario_file: &Path,
    dir: &Path,
    sets: &[crate::overrides::Override],
    title: &str,
) -> anyhow::Result<Result<ArmRun, ExitCode>> {
    let arm = |report: serde_json::Value| -> anyhow::Result<ArmRun> {
        let steps = step_points(&report);
        let by_step = !steps.is_empty();
        let points = if by_step {
            steps
        } else {
            eval_points(&dir.join(state::METRICS_FILE))?
        };
        Ok(ArmRun {
            report,
            points,
            by_step,
        })
    };
    let report_path = dir.join(state::REPORT_FILE);
    if args.resume && report_path.exists() {
        let report: serde_json::Value = serde_json::from_slice(
            &std::fs::read(&report_path)
                .with_context(|| format!("reading {}", report_path.display()))?,
        )
        .with_context(|| format!("reading {}", report_path.display()))?;
        // A Gymnasium run stopped during its deferred evaluations is resumed (they run again).
        if !crate::deferred_eval::pending(&report) {
            eprintln!("{title}: finished before, read from {}", dir.display());
            return Ok(Ok(arm(report)?));
        }
    }
    let started = std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some());
    let run = LocalRun::prepare(
        Some(scenario_file),
        Some(dir),
        args.device,
        args.resume && started,
        sets,
    )
    .map_err(|e| UsageError(format!("{e:#}")))?;
    eprintln!(
        "{title}: {} rounds, results in {}{}",
        run.scenario.rounds,
        run.out_dir.display(),
        if args.resume && started {
            " (resumed)"
        } else {
            ""
        }
    );
    prepare_dataset(&run.scenario)?;
    let mut result = match deploy::run_local(&run, exe, args.timeout, true) {
        Ok(r) => r,
        Err(e) => return interrupted(e).map(Err),
    };
    if let Err(e) = crate::deferred_eval::complete(&run, &mut result) {
        return interrupted(e).map(Err);
    }
    finish(&run, &mut result)?;
    let out = arm(result.report.clone())?;
    if !out.points.is_empty() {
        let (points, band) = if out.by_step {
            step_curve(&result.report)
        } else {
            eval_curve(&run.out_dir.join(state::METRICS_FILE))?
        };
        line_plot(
            &run.out_dir.join(CURVE_FILE),
            &format!("{title}: evaluation return, 95% band"),
            if out.by_step {
                "training step"
            } else {
                "round"
            },
            "mean return",
            &[Series {
                name: private_label(&result.report),
                points,
                band,
            }],
        )?;
    }
    print_summary(&run, &result.report, &result.operator);
    Ok(Ok(out))
}

/// The legend of an arm's mean curve: its name and epsilon (the largest of its replicates').
fn replicates_label(
    name: &str,
    s: &fedrl_common::scenario::Scenario,
    eps: &serde_json::Value,
) -> String {
    let n = eps.as_array().map_or(0, Vec::len);
    if s.non_private {
        return format!("{name}: mean of {n} (non-private)");
    }
    let max = eps
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_f64())
        .fold(0.0, f64::max);
    format!(
        "{name}: mean of {n} (epsilon up to {max:.2} each, delta {:e})",
        s.delta
    )
}

/// `--replicates N`: N runs of the scenario into OUT/rep-i (and of each `--twin` into
/// OUT/rep-i/twin...), then the summary report and the mean learning curves with their 95%
/// bands at OUT's top (see [`crate::replicates`]). The resolved scenario is stored as
/// OUT/scenario.toml and the twins' as OUT/twin-scenario.toml, ... so that `--resume` needs
/// neither: it reads back the replicates that finished, resumes the one that was running and
/// starts the rest.
fn run_replicates(args: Args) -> anyhow::Result<ExitCode> {
    let t0 = std::time::Instant::now();
    let usage = |e: anyhow::Error| UsageError(format!("{e:#}"));
    let read = |p: &Path| {
        std::fs::read_to_string(p)
            .with_context(|| format!("reading {}", p.display()))
            .map_err(usage)
    };
    let given_text = match &args.scenario {
        Some(p) => Some(read(p)?),
        None if !args.resume => Some(deploy::DEFAULT_SCENARIO.to_string()),
        None => None,
    };
    let out = match &args.out {
        Some(o) => o.clone(),
        None => {
            // Only a new run gets here (--resume requires --out).
            let name = crate::overrides::load(
                given_text.as_deref().unwrap_or(deploy::DEFAULT_SCENARIO),
                &args.sets,
                fedrl_tasks::scenario_from_toml_str,
            )
            .map_err(usage)?
            .name;
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            PathBuf::from("runs").join(format!("{name}-{t}"))
        }
    };
    let existing = std::fs::read_dir(&out).is_ok_and(|mut d| d.next().is_some());
    if existing && !args.resume {
        return Err(UsageError(format!(
            "output directory {} exists and is not empty; pass --resume to continue its \
             replicates, or choose another --out",
            out.display()
        ))
        .into());
    }
    let top = out.join(deploy::SCENARIO_FILE);
    let base = if args.resume {
        if !existing {
            return Err(UsageError(format!(
                "--resume: output directory {} holds no replicates to resume (it is missing or \
                 empty)",
                out.display()
            ))
            .into());
        }
        if !args.twin.is_empty() {
            return Err(UsageError(
                "--resume runs the twins the replicates started with (stored in OUT); leave \
                 --twin out"
                    .into(),
            )
            .into());
        }
        let stored_text = read(&top).map_err(|e| {
            UsageError(format!(
                "{e}: not the output of `fedrl run --replicates` (or from an older fedrl)"
            ))
        })?;
        let stored = fedrl_tasks::scenario_from_toml_str(&stored_text)
            .with_context(|| format!("reading {}", top.display()))
            .map_err(usage)?;
        let given = crate::overrides::load(
            given_text.as_deref().unwrap_or(&stored_text),
            &args.sets,
            fedrl_tasks::scenario_from_toml_str,
        )
        .map_err(usage)?;
        let differences = deploy::differences(&stored, &given)?;
        if !differences.is_empty() {
            return Err(usage(
                deploy::OutDirError::Differs {
                    path: top,
                    differences,
                }
                .into(),
            )
            .into());
        }
        stored
    } else {
        let base = crate::overrides::load(
            given_text.as_deref().unwrap_or(deploy::DEFAULT_SCENARIO),
            &args.sets,
            fedrl_tasks::scenario_from_toml_str,
        )
        .map_err(usage)?;
        std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
        std::fs::write(&top, base.to_toml_string()?)
            .with_context(|| format!("writing {}", top.display()))?;
        base
    };
    // The twins' scenario files, stored at OUT's top (resolved, so a resume needs no file).
    let twin_file = |j: usize| out.join(format!("{}-scenario.toml", twin_dir_name(j)));
    let mut twins = Vec::new();
    if args.resume {
        while twin_file(twins.len()).exists() {
            let f = twin_file(twins.len());
            let s = fedrl_tasks::scenario_from_toml_str(&read(&f)?)
                .with_context(|| format!("reading {}", f.display()))
                .map_err(usage)?;
            twins.push((f, s));
        }
    } else {
        for (j, t) in args.twin.iter().enumerate() {
            let text = if t.as_os_str().is_empty() {
                if args.scenario.is_some() {
                    return Err(UsageError(
                        "--twin needs the twin's scenario file when a scenario is given".into(),
                    )
                    .into());
                }
                DEFAULT_TWIN.to_string()
            } else {
                read(t)?
            };
            let s = fedrl_tasks::scenario_from_toml_str(&text)
                .map_err(|e| UsageError(format!("{}: {e:#}", t.display())))?;
            std::fs::write(twin_file(j), s.to_toml_string()?)?;
            twins.push((twin_file(j), s));
        }
    }
    let exe = std::env::current_exe()?;
    let n = args.replicates;
    let mut reps = Vec::with_capacity(n as usize);
    let mut curves = Vec::with_capacity(n as usize);
    let mut twin_reps: Vec<Vec<crate::replicates::Replicate>> =
        twins.iter().map(|_| Vec::new()).collect();
    let mut twin_curves: Vec<Vec<Vec<(f64, f64)>>> = vec![Vec::new(); twins.len()];
    let mut by_step = false;
    for i in 0..n {
        let seeds = crate::replicates::seed_overrides(&base, i)?;
        let dir = crate::replicates::dir_name(i);
        let title = format!("{} (replicate {}/{n})", base.name, i + 1);
        let arm = match replicate_arm(&args, &exe, &top, &out.join(&dir), &seeds, &title)? {
            Ok(a) => a,
            Err(code) => return Ok(code),
        };
        by_step = arm.by_step;
        curves.push(arm.points);
        reps.push(crate::replicates::Replicate {
            dir: dir.clone(),
            report: arm.report,
            seeds,
        });
        for (j, (file, s)) in twins.iter().enumerate() {
            let seeds = crate::replicates::seed_overrides(s, i)?;
            let tdir = format!("{dir}/{}", twin_dir_name(j));
            let title = format!("{} (twin, replicate {}/{n})", s.name, i + 1);
            let arm = match replicate_arm(&args, &exe, file, &out.join(&tdir), &seeds, &title)? {
                Ok(a) => a,
                Err(code) => return Ok(code),
            };
            twin_curves[j].push(arm.points);
            twin_reps[j].push(crate::replicates::Replicate {
                dir: tdir,
                report: arm.report,
                seeds,
            });
        }
    }
    let twin_summaries: Vec<(&fedrl_common::scenario::Scenario, Vec<_>)> =
        twins.iter().map(|(_, s)| s).zip(twin_reps).collect();
    let summary =
        crate::replicates::summary(&base, &reps, &twin_summaries, t0.elapsed().as_secs_f64());
    std::fs::write(
        out.join(state::REPORT_FILE),
        serde_json::to_vec_pretty(&summary)?,
    )?;
    std::fs::write(out.join(state::FILES_GUIDE_FILE), REPLICATES_GUIDE)?;
    let mut series = Vec::new();
    let (mean, band) = crate::replicates::mean_curve(&curves);
    if !mean.is_empty() {
        series.push(Series {
            name: replicates_label(&base.name, &base, &summary["epsilon"]),
            points: mean,
            band,
        });
    }
    for (j, (_, s)) in twins.iter().enumerate() {
        let (mean, band) = crate::replicates::mean_curve(&twin_curves[j]);
        if !mean.is_empty() {
            series.push(Series {
                name: replicates_label(&s.name, s, &summary["twins"][j]["epsilon"]),
                points: mean,
                band,
            });
        }
    }
    if !series.is_empty() {
        line_plot(
            &out.join(CURVE_FILE),
            &format!(
                "{}: mean evaluation return of {n} replicates, 95% band",
                base.name
            ),
            if by_step { "training step" } else { "round" },
            "mean return",
            &series,
        )?;
    }
    let print_return = |name: &str, fr: &serde_json::Value| match (
        fr["mean"].as_f64(),
        fr["ci95_low"].as_f64(),
        fr["ci95_high"].as_f64(),
    ) {
        (Some(m), Some(lo), Some(hi)) => println!(
            "{name}, {n} replicates: final return {m:.2}, 95% interval [{lo:.2}, {hi:.2}] \
             (Student t; sample sd {:.2})",
            fr["std"].as_f64().unwrap_or(f64::NAN)
        ),
        _ => println!("{name}, {n} replicates: no final return to summarise"),
    };
    print_return(&base.name, &summary["final_return"]);
    for (j, (_, s)) in twins.iter().enumerate() {
        print_return(&s.name, &summary["twins"][j]["final_return"]);
    }
    if !base.non_private {
        println!(
            "privacy is per replicate (each its own epsilon, listed in {}); publishing all {n} \
             composes: up to epsilon {:.4} at delta {n} x {:e} in total",
            out.join(state::REPORT_FILE).display(),
            summary["epsilon_all_replicates"]
                .as_f64()
                .unwrap_or(f64::NAN),
            base.delta
        );
    }
    println!(
        "results in {} (mean curve: {})",
        out.display(),
        out.join(CURVE_FILE).display()
    );
    Ok(ExitCode::SUCCESS)
}

/// `FILES.md` at the top of a `--replicates` output directory.
const REPLICATES_GUIDE: &str = "\
# Files in this `fedrl run --replicates N` output directory

| file | who | what |
| --- | --- | --- |
| `report.json` | public | the replicates' final returns, their mean and 95% Student t interval, each replicate's epsilon, the seeds each changed (`report.schema.json`, definition `replicates`) |
| `learning_curve.png` | public | mean evaluation return of the replicates per round (or step), with its 95% band (and each twin's, with `--twin`) |
| `scenario.toml`, `twin-scenario.toml`, ... | public | the resolved scenario (and twins) every replicate started from; `--resume` reads them |
| `rep-0/`, `rep-1/`, ... | public/operator | one complete run each, with its own `FILES.md` (public files at its top, operator-only under its `operator/`); with `--twin`, the twins' runs of that replicate in `rep-N/twin`, `rep-N/twin-2`, ... |

Privacy is per replicate: each replicate's epsilon (its `report.json`) covers that replicate
alone. The replicates train on the same users, so publishing all of them composes their privacy
loss (at most the sum of their epsilons, `epsilon_all_replicates`, at N x delta).
";

/// The output folder of the `i`-th (0-based) twin.
fn twin_dir_name(i: usize) -> String {
    if i == 0 {
        "twin".into()
    } else {
        format!("twin-{}", i + 1)
    }
}

/// How a twin's curves are labelled: its scenario name, with its epsilon or marked
/// non-private.
fn twin_label(s: &fedrl_common::scenario::Scenario, report: &serde_json::Value) -> String {
    match report["epsilon"].as_f64() {
        _ if s.non_private => format!("{} (non-private)", s.name),
        Some(e) => format!("{} (epsilon {e:.2})", s.name),
        None => s.name.clone(),
    }
}

/// (x, y) of the entries of a report's `final_evaluation[curve]` list; empty without one.
fn report_points(report: &serde_json::Value, curve: &str, x: &str, y: &str) -> Vec<(f64, f64)> {
    report["final_evaluation"][curve]
        .as_array()
        .map(|c| {
            c.iter()
                .filter_map(|e| Some((e[x].as_f64()?, e[y].as_f64()?)))
                .collect()
        })
        .unwrap_or_default()
}

/// (SAC epoch, normalised return) of a report's policy phase (PriMORL), with the 95% band of
/// each mean over its evaluation episodes; empty otherwise.
fn policy_curve(report: &serde_json::Value) -> (Vec<(f64, f64)>, crate::replicates::Band) {
    spread_curve(
        report["final_evaluation"]["policy_curve"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| Some((e["epoch"].as_f64()?, e))),
        "normalized_return",
    )
}

/// Draws the policy phase's normalised return against SAC epochs for the run and each twin
/// (the baselines) at `path`; nothing when no report has a policy phase. Returns whether it
/// drew.
fn write_policy_curves(
    path: &Path,
    name: &str,
    report: &serde_json::Value,
    twins: &[(String, serde_json::Value)],
) -> anyhow::Result<bool> {
    let series_of = |name: String, r: &serde_json::Value| {
        let (points, band) = policy_curve(r);
        Series { name, points, band }
    };
    let mut series = vec![series_of(private_label(report), report)];
    for (label, r) in twins {
        series.push(series_of(label.clone(), r));
    }
    if series.iter().all(|s| s.points.is_empty()) {
        return Ok(false);
    }
    line_plot(
        path,
        &format!("{name}: policy in the model, evaluated in the real environment"),
        "SAC epoch",
        "normalised return",
        &series,
    )?;
    Ok(true)
}

/// PrivORL: the EMA synthesizer's denoising loss on held-out real transitions against
/// fine-tuning steps, for the run and each twin, at `path`; nothing when no report has one.
fn write_privorl_curves(
    path: &Path,
    name: &str,
    report: &serde_json::Value,
    twins: &[(String, serde_json::Value)],
) -> anyhow::Result<bool> {
    let points = |r: &serde_json::Value| report_points(r, "curve", "step", "heldout_loss");
    let mut series = vec![Series {
        name: private_label(report),
        points: points(report),
        band: Vec::new(),
    }];
    for (label, r) in twins {
        series.push(Series {
            name: label.clone(),
            points: points(r),
            band: Vec::new(),
        });
    }
    if series.iter().all(|s| s.points.is_empty()) {
        return Ok(false);
    }
    line_plot(
        path,
        &format!("{name}: synthesizer's denoising loss on held-out real transitions"),
        "fine-tuning step",
        "EDM loss (EMA weights)",
        &series,
    )?;
    Ok(true)
}

/// The (low, high) BG CVGA coordinates of a report's held-out patient-days (mg/dL); empty when
/// the final evaluation has no clinical report.
fn cvga_points(report: &serde_json::Value) -> Vec<(f64, f64)> {
    report["final_evaluation"]["clinical"]["patient_days"]
        .as_array()
        .map(|days| {
            days.iter()
                .filter_map(|d| {
                    let p = &d["cvga_bg"];
                    Some((p["x_mg_dl"].as_f64()?, p["y_mg_dl"].as_f64()?))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Draws the CVGA of the policy's (and the twin's) held-out patient-days at `path`; nothing
/// when the run has no clinical report. Returns whether it drew.
fn write_cvga(
    path: &Path,
    name: &str,
    report: &serde_json::Value,
    twin: Option<&serde_json::Value>,
) -> anyhow::Result<bool> {
    let mut series = vec![CvgaSeries {
        name: "private policy".into(),
        points: cvga_points(report),
    }];
    if let Some(t) = twin {
        series.push(CvgaSeries {
            name: "non-private twin".into(),
            points: cvga_points(t),
        });
    }
    series.retain(|s| !s.points.is_empty());
    if series.is_empty() {
        return Ok(false);
    }
    cvga_plot(
        path,
        &format!("{name}: control variability grid (held-out patient-days, BG)"),
        &series,
    )?;
    Ok(true)
}

/// One summary line of a clinical pool (`final_evaluation.clinical.pooled` or a group).
fn clinical_line(label: &str, pool: &serde_json::Value) -> Option<String> {
    let bg = &pool["bg"];
    let pct = |k: &str| bg[k].as_f64().map(|v| 100.0 * v);
    Some(format!(
        "{label}: {} patient-days, time in range {:.1}%, below 70 {:.1}%, below 54 {:.1}%, above 180 {:.1}%, mean {:.0} mg/dL; worst patient {} ({:.1}% in range)",
        pool["patient_days"],
        pct("time_in_range")?,
        pct("time_below_70")?,
        pct("time_below_54")?,
        pct("time_above_180")?,
        bg["mean_mg_dl"].as_f64()?,
        pool["worst"]["patient"].as_str()?,
        100.0 * pool["worst"]["bg"]["time_in_range"].as_f64()?,
    ))
}

/// An interrupted run exits with the signal's status (130, 143) and says how to resume; any
/// other error goes on as it is.
fn interrupted(e: anyhow::Error) -> anyhow::Result<ExitCode> {
    match e.downcast::<deploy::Interrupted>() {
        Ok(i) => {
            eprintln!("{i}");
            Ok(ExitCode::from(i.signal.exit_status()))
        }
        Err(e) => Err(e),
    }
}

/// An offline task's dataset is generated (or found in the cache) once here, before the client
/// agents start: they then all load it from the cache instead of generating it side by side.
fn prepare_dataset(scenario: &fedrl_common::scenario::Scenario) -> anyhow::Result<()> {
    if let fedrl_common::scenario::Task::OfflineCql(t) = &scenario.task {
        let root = fedrl_rl::offline::data_root(None)?;
        let spec = match &t.dataset {
            fedrl_common::offline::DatasetSource::Generated(spec) => spec,
            fedrl_common::offline::DatasetSource::Stored(s) => {
                return prepare_stored(scenario, s);
            }
        };
        let bar = crate::cmd::data::generation_bar()?;
        // Checked against its spec (or generated), but no episode read: the agents read
        // their own units' episodes.
        fedrl_rl::offline::cache::prepare(spec, &root, &mut |p| {
            crate::cmd::data::show_generation(&bar, &p)
        })
        .with_context(|| format!("preparing the dataset under {}", root.display()))?;
        bar.finish_and_clear();
        let id = spec.minari_id();
        let (episodes, steps) = fedrl_rl::offline::minari::totals(
            &fedrl_rl::offline::minari::dataset_dir(&root, &id)?,
        )?;
        // Exact counts (for CartPole the step count is the sum of every private return).
        eprintln!(
            "operator-only (exact counts, do not publish): dataset {id}: {episodes} episodes \
             ({steps} steps) of {} units",
            spec.units
        );
    }
    if let fedrl_common::scenario::Task::Privorl(t) = &scenario.task {
        prepare_privorl(scenario, t)?;
    }
    if let fedrl_common::scenario::Task::Primorl(t) = &scenario.task {
        let root = fedrl_rl::offline::data_root(None)?;
        let bar = crate::cmd::data::generation_bar()?;
        let (h, private) =
            fedrl_rl::offline::continuous::prepare_source(&t.dataset, &root, &mut |p| {
                crate::cmd::data::show_continuous_generation(&bar, &p)
            })
            .with_context(|| format!("preparing the dataset under {}", root.display()))?;
        bar.finish_and_clear();
        let name = match &t.dataset {
            fedrl_common::task::primorl::ContinuousSource::Generated(g) => g.file_name(),
            fedrl_common::task::primorl::ContinuousSource::Stored(s) => s.name.clone(),
        };
        // A stored dataset: the operator states the unit count (`users`) rather than having it
        // derived from the data.
        if private != scenario.users {
            anyhow::bail!(
                "users ({}) must equal the private trajectories of dataset {name} ({private}: its episodes less the {} public ones; an exact count, keep it out of anything you publish)",
                scenario.users,
                t.dataset.public()
            );
        }
        eprintln!(
            "operator-only (exact counts, do not publish): dataset {name} ({}): {} episodes, {} steps",
            h.meta.env_id, h.episodes, h.steps
        );
    }
    Ok(())
}

/// A stored dataset named by the scenario (`[task.dataset] name = ...`), checked once before
/// any process starts: it exists under the data root, its recorded SHA-256 sums match, every
/// episode maps to a unit (a metadata key present on each), and the scenario's `users` equals
/// its unit count. The agents then read their own units' episodes with the same mapping.
fn prepare_stored(
    scenario: &fedrl_common::scenario::Scenario,
    s: &fedrl_common::offline::StoredDataset,
) -> anyhow::Result<()> {
    let root = fedrl_rl::offline::data_root(None)?;
    let dir = fedrl_rl::offline::cache::stored_dir(&root, &s.name)?;
    if !fedrl_rl::offline::cache::verify_content(&dir)? {
        eprintln!(
            "warning: dataset {} records no SHA-256 sums (stored by hand, not by `fedrl data \
             import`): it is read unchecked",
            s.name
        );
    }
    let units = fedrl_tasks::stored::check_units(s, scenario.users)?;
    let (episodes, steps) = fedrl_rl::offline::minari::totals(&dir)?;
    eprintln!(
        "operator-only (exact counts, do not publish): dataset {}: {episodes} episodes \
         ({steps} steps) in {units} units under {}",
        s.name,
        fedrl_tasks::stored::describe(&s.units)
    );
    Ok(())
}

/// PrivORL: both datasets (sensitive and public) are generated or found in the cache, and the
/// synthesizer is pre-trained on the public data here, with its progress in the terminal, and
/// cached beside the datasets (the aggregator then reads it instead of pre-training before it
/// listens; twins with the same pre-training share it). No unit's data is read.
fn prepare_privorl(
    scenario: &fedrl_common::scenario::Scenario,
    t: &fedrl_common::task::privorl::PrivorlTask,
) -> anyhow::Result<()> {
    let root = fedrl_rl::offline::data_root(None)?;
    let mut specs = vec![("public", &t.public)];
    if let Some(c) = &t.continuous {
        prepare_privorl_continuous(c, &root)?;
        specs.clear();
    }
    match &t.dataset {
        // Continuous data: prepared above (the discrete fields are unset).
        _ if t.continuous.is_some() => {}
        fedrl_common::offline::DatasetSource::Generated(d) => specs.insert(0, ("sensitive", d)),
        // A stored sensitive dataset: found, its SHA-256 sums checked, nothing generated (its
        // transition count is checked against task.transitions where the units are split).
        fedrl_common::offline::DatasetSource::Stored(s) => {
            let dir = fedrl_rl::offline::cache::stored_dir(&root, &s.name)?;
            fedrl_rl::offline::cache::verify_content(&dir)?;
            eprintln!("privorl: sensitive dataset {} (stored) checked", s.name);
        }
    }
    for (what, spec) in specs {
        let t0 = std::time::Instant::now();
        let bar = crate::cmd::data::generation_bar()?;
        fedrl_rl::offline::cache::prepare(spec, &root, &mut |p| {
            crate::cmd::data::show_generation(&bar, &p)
        })
        .with_context(|| format!("preparing the {what} dataset under {}", root.display()))?;
        bar.finish_and_clear();
        eprintln!(
            "privorl: {what} dataset {} ready ({:.1} s)",
            spec.minari_id(),
            t0.elapsed().as_secs_f64()
        );
    }
    if !t.pretrain.enabled {
        eprintln!("privorl: no pre-training (fine-tuning starts from random weights)");
        return Ok(());
    }
    let trajectory = t.level == fedrl_common::task::privorl::PrivorlLevel::Trajectory;
    let path = if trajectory {
        fedrl_tasks::privorl::trajectory::pretrained_trajectory_path(t, &root)?
    } else {
        fedrl_tasks::privorl::pretrained_path(t, &root)?
    };
    if path.exists() {
        eprintln!(
            "privorl: pre-trained synthesizer found in the cache ({})",
            path.display()
        );
        return Ok(());
    }
    eprintln!(
        "privorl: pre-training the synthesizer on the public data: {} epochs, curiosity {}",
        t.pretrain.epochs,
        if t.pretrain.curiosity { "on" } else { "off" }
    );
    let device = fedrl_rl::device::open(scenario.device)?;
    let t0 = std::time::Instant::now();
    let mut on_epoch = |r: &fedrl_rl::diffusion::curiosity::EpochReport| {
        eprintln!(
            "privorl: pre-training epoch {}/{}: loss {:.4}, {} novel rows ({:.1} s)",
            r.epoch + 1,
            t.pretrain.epochs,
            r.mean_loss,
            r.novel_rows,
            r.seconds
        );
    };
    if trajectory {
        fedrl_tasks::privorl::trajectory::pretrained_trajectory(t, &root, &device, &mut on_epoch)?;
    } else {
        fedrl_tasks::privorl::pretrained(t, &root, &device, &mut on_epoch)?;
    }
    eprintln!(
        "privorl: pre-training done in {:.1} s, cached in {}",
        t0.elapsed().as_secs_f64(),
        path.display()
    );
    Ok(())
}

/// PrivORL on continuous control: both continuous-format datasets generated or found in the
/// cache (checked against their recorded digests).
fn prepare_privorl_continuous(
    c: &fedrl_common::task::privorl::PrivorlContinuous,
    root: &std::path::Path,
) -> anyhow::Result<()> {
    for (what, spec) in [("sensitive", &c.dataset), ("public", &c.public)] {
        let t0 = std::time::Instant::now();
        let bar = crate::cmd::data::generation_bar()?;
        let h = fedrl_rl::offline::continuous::prepare(spec, root, &mut |p| {
            crate::cmd::data::show_continuous_generation(&bar, &p)
        })
        .with_context(|| format!("preparing the {what} dataset under {}", root.display()))?;
        bar.finish_and_clear();
        eprintln!(
            "privorl: {what} dataset continuous/{} ({}) ready ({:.1} s)",
            spec.file_name().trim_end_matches(".safetensors"),
            h.meta.env_id,
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// PrivORL's released dataset: copied from the aggregator's state into `OUT/synthetic` (a
/// Minari root, listed by `fedrl data list --data-dir OUT/synthetic`), its metadata stamped
/// with the run's epsilon and delta. Returns what the report says about it.
fn publish_synthetic(
    run: &LocalRun,
    report: &serde_json::Value,
) -> anyhow::Result<Option<serde_json::Value>> {
    let from = run
        .out_dir
        .join("state")
        .join(fedrl_tasks::privorl::SYNTHETIC_DIR);
    if !from.exists() {
        return Ok(None);
    }
    let to = run.out_dir.join(fedrl_tasks::privorl::SYNTHETIC_DIR);
    copy_tree(&from, &to).context("copying the synthetic dataset")?;
    let epsilon = if run.scenario.non_private {
        serde_json::json!("inf")
    } else {
        report["epsilon"].clone()
    };
    let privacy = serde_json::json!({
        "epsilon": epsilon,
        "delta": report["delta"],
        "unit": run.scenario.unit_kind.to_string(),
        "accountant": report["accountant"],
        "non_private": run.scenario.non_private,
        "seeded_noise": run.scenario.seed.is_some(),
    });
    let mut ids = Vec::new();
    for d in fedrl_rl::offline::cache::list(&to)? {
        // A continuous-format release (one file): the privacy goes into its own metadata
        // (`procedure.fedrl_privacy`, rewritten with its digest) and into `<file>.privacy.json`.
        if d.id.starts_with("continuous/") {
            let mut ds = fedrl_rl::offline::continuous::ContinuousDataset::load(&d.path)?;
            ds.meta.procedure["fedrl_privacy"] = privacy.clone();
            ds.save(&d.path)?;
            let mut side = d.path.clone().into_os_string();
            side.push(".privacy.json");
            std::fs::write(side, serde_json::to_vec_pretty(&privacy)?)?;
            ids.push(d.id);
            continue;
        }
        let meta = d.path.join("data").join("metadata.json");
        let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&meta)?)?;
        v["fedrl_privacy"] = privacy.clone();
        std::fs::write(&meta, serde_json::to_vec(&v)?)?;
        std::fs::write(
            d.path.join("privacy.json"),
            serde_json::to_vec_pretty(&privacy)?,
        )?;
        ids.push(d.id);
    }
    Ok(Some(serde_json::json!({
        "ids": ids,
        "folder": fedrl_tasks::privorl::SYNTHETIC_DIR,
        "privacy": privacy,
        "list_with": format!("fedrl data list --data-dir {}", to.display()),
    })))
}

/// Completes `report.json` with the fields a user looks for first (DP outputs only) and
/// `operator/report.json` with the exact count of contributions, and copies the policy.
/// Copies the folder `from` to `to` (replacing `to`).
fn copy_tree(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
    if to.exists() {
        std::fs::remove_dir_all(to)?;
    }
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

fn finish(run: &LocalRun, result: &mut RunResult) -> anyhow::Result<()> {
    let state_dir = run.out_dir.join("state");
    for file in MODEL_FILES {
        let model = state_dir.join(file);
        if model.exists() {
            std::fs::copy(&model, run.out_dir.join(file))
                .with_context(|| format!("copying {file}"))?;
        }
    }
    // An expert-level run's released prefixes (public: the DataRelease's output).
    let stable = state_dir.join(fedrl_aggregator::service::STABLE_DIR);
    if stable.exists() {
        copy_tree(
            &stable,
            &run.out_dir.join(fedrl_aggregator::service::STABLE_DIR),
        )
        .context("copying the released prefixes (d_stable)")?;
    }
    let synthetic = publish_synthetic(run, &result.report)?;
    let r = &mut result.report;
    let fe = r["final_evaluation"].clone();
    // The aggregator's report already holds the final evaluation, the epsilon (null for a
    // twin) and the noise source, once each; the run adds where its files are.
    if let Some(obj) = r.as_object_mut() {
        obj.insert(
            "rounds".into(),
            obj.get("rounds_completed").cloned().unwrap_or_default(),
        );
        for file in MODEL_FILES {
            if file != fedrl_tasks::primorl::ENSEMBLE_FILE && state_dir.join(file).exists() {
                obj.insert("policy".into(), serde_json::json!(file));
            }
        }
        if let Some(s) = synthetic {
            obj.insert("synthetic_dataset".into(), s);
            for k in ["fidelity", "utility"] {
                obj.insert(k.into(), fe[k].clone());
            }
        }
    }
    // The operator's report gets the same fields plus the exact count of contributions.
    let mut operator = r.clone();
    if let (Some(op), Some(obj)) = (result.operator.as_object(), operator.as_object_mut()) {
        for (k, v) in op {
            obj.entry(k.clone()).or_insert_with(|| v.clone());
        }
        let op_dir = run.out_dir.join(state::OPERATOR_DIR);
        let users = last_users(&op_dir.join(state::METRICS_FILE));
        obj.insert("users".into(), serde_json::json!(users));
    }
    result.operator = operator;
    // An epsilon on every released row, and the CSV beside the JSON lines (public rows only).
    crate::metrics_files::publish(
        &run.out_dir,
        state::METRICS_FILE,
        result.report["epsilon"].as_f64(),
    )
    .context("completing metrics.jsonl and writing metrics.csv")?;
    std::fs::write(
        run.out_dir.join(state::REPORT_FILE),
        serde_json::to_vec_pretty(&result.report)?,
    )?;
    std::fs::write(
        run.out_dir
            .join(state::OPERATOR_DIR)
            .join(state::REPORT_FILE),
        serde_json::to_vec_pretty(&result.operator)?,
    )?;
    Ok(())
}

/// Evaluation return of each released model against its round, from the public `metrics.jsonl`.
fn curve(run: &LocalRun, name: &str) -> anyhow::Result<Series> {
    let (points, band) = eval_curve(&run.out_dir.join(state::METRICS_FILE))?;
    Ok(Series {
        name: name.into(),
        points,
        band,
    })
}

/// (training step, evaluation return) of an offline CQL report's curve, with the 95% band of
/// each mean over its evaluation episodes; empty otherwise.
fn step_points(report: &serde_json::Value) -> Vec<(f64, f64)> {
    step_curve(report).0
}

fn step_curve(report: &serde_json::Value) -> (Vec<(f64, f64)>, crate::replicates::Band) {
    episode_curve(
        report["final_evaluation"]["curve"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| Some((e["step"].as_f64()?, e))),
    )
}

/// (round, evaluation return) of the evaluated rounds in a public `metrics.jsonl`.
fn eval_points(path: &Path) -> anyhow::Result<Vec<(f64, f64)>> {
    Ok(eval_curve(path)?.0)
}

/// [`eval_points`] with the 95% band of each mean over its evaluation episodes.
fn eval_curve(path: &Path) -> anyhow::Result<(Vec<(f64, f64)>, crate::replicates::Band)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let rows: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    Ok(episode_curve(
        rows.iter()
            .filter_map(|v| Some((v["round"].as_f64()?, &v["eval"]))),
    ))
}

/// The (x, mean return) points of evaluations (`eval_return`), and where an evaluation gives
/// its episodes' spread (`eval_return_std`, `eval_episodes`) the 95% Student t interval of its
/// mean: how far the mean of that many held-out episodes is from the policy's expected return.
fn episode_curve<'a>(
    rows: impl Iterator<Item = (f64, &'a serde_json::Value)>,
) -> (Vec<(f64, f64)>, crate::replicates::Band) {
    spread_curve(rows, "eval_return")
}

/// [`episode_curve`] of the figure `key` (its spread under `{key}_std`).
fn spread_curve<'a>(
    rows: impl Iterator<Item = (f64, &'a serde_json::Value)>,
    key: &str,
) -> (Vec<(f64, f64)>, crate::replicates::Band) {
    let sd_key = format!("{key}_std");
    let (mut points, mut band) = (Vec::new(), Vec::new());
    for (x, e) in rows {
        let Some(m) = e[key].as_f64() else {
            continue;
        };
        points.push((x, m));
        if let (Some(sd), Some(n)) = (e[sd_key.as_str()].as_f64(), e["eval_episodes"].as_u64())
            && let Some((lo, hi)) = crate::replicates::mean_interval(m, sd, n)
        {
            band.push((x, lo, hi));
        }
    }
    (points, band)
}

/// Contributions in released rounds, from the last released line of the operator's
/// `metrics.jsonl` (an exact count: operator-only).
fn last_users(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["users"].as_u64())
        .next_back()
        .unwrap_or(0)
}

/// Public figures first; the exact counts after them, labelled operator-only.
fn print_summary(run: &LocalRun, r: &serde_json::Value, op: &serde_json::Value) {
    let eps = match r["epsilon"].as_f64() {
        Some(e) => format!("{e:.4}"),
        None => "none (non-private)".to_string(),
    };
    println!(
        "{}: {} rounds released, {} abandoned, epsilon {eps} at delta {:e}{} ({:.1} s)",
        run.scenario.name,
        r["rounds_completed"],
        r["rounds_abandoned"],
        r["delta"].as_f64().unwrap_or(f64::NAN),
        if run.scenario.seed.is_some() {
            ", SEEDED noise (not private)"
        } else {
            ""
        },
        r["wall_seconds"].as_f64().unwrap_or(f64::NAN),
    );
    if let Some(rho) = r["zcdp_rho"].as_f64() {
        println!("zCDP rho {rho:.4} (every round un-sampled: exact, the discrete Gaussian's too)");
    }
    if let Some(rel) = r["selective"]["release"].as_object() {
        println!(
            "DataRelease: {} candidate trajectories walked, {} prefixes released, {} transitions in D_stable of at most {} (published in {}); {:.1} s, of which {:.1} s waiting for the agents to load their data",
            rel["trajectories_walked"],
            rel["prefixes_released"],
            rel["stable_transitions"],
            rel["stable_transitions_bound"],
            run.out_dir
                .join(rel["published"].as_str().unwrap_or("d_stable"))
                .display(),
            rel["release_seconds"].as_f64().unwrap_or(f64::NAN),
            rel["agents_ready_seconds"].as_f64().unwrap_or(f64::NAN),
        );
    }
    if let Some(ret) = r["final_evaluation"]["final_eval_return"].as_f64() {
        println!(
            "final evaluation: mean return {ret:.2} over {} held-out episodes",
            r["final_evaluation"]["final_eval_episodes"]
        );
    }
    if let (Some(score), Some(how)) = (
        r["final_evaluation"]["final_normalized_score"].as_f64(),
        r["final_evaluation"]["normalization"].as_str(),
    ) {
        println!("normalised score {score:.4} ({how})");
    }
    if let Some(n) = r["final_evaluation"]["final_normalized_return"].as_f64() {
        println!(
            "policy phase: normalised return {n:.1} (of 1000); curve in {}",
            run.out_dir.join(POLICY_CURVE_FILE).display()
        );
    }
    if let Some(e) = r["final_evaluation"]["policy_error"].as_str() {
        println!("policy phase failed: {e}");
    }
    if let Some(syn) = r["synthetic_dataset"].as_object() {
        let f = &r["fidelity"];
        let u = &r["utility"];
        println!(
            "PrivORL: synthetic dataset {} in {} (epsilon {}); fidelity marginal {:.3}, correlation {:.3}; {} return {:.1} on it, {:.1} on as much held-out real data ({:.0}%{})",
            syn["ids"][0].as_str().unwrap_or("?"),
            run.out_dir
                .join(fedrl_tasks::privorl::SYNTHETIC_DIR)
                .display(),
            syn["privacy"]["epsilon"],
            f["marginal"].as_f64().unwrap_or(f64::NAN),
            f["correlation"].as_f64().unwrap_or(f64::NAN),
            if u["td3bc_seeds"].is_null() && u["synthetic"]["td3bc_seeds"].is_null() {
                "CQL"
            } else {
                "TD3+BC"
            },
            u["synthetic"]["return"].as_f64().unwrap_or(f64::NAN),
            u["real_reference"]["return"].as_f64().unwrap_or(f64::NAN),
            u["percent_of_real"].as_f64().unwrap_or(f64::NAN),
            match u["random_return"].as_f64() {
                Some(r) => format!(", normalised by random actions' {r:.1}"),
                None => String::new(),
            },
        );
    }
    if let Some(e) = r["final_evaluation"]["final_eval_error"].as_str() {
        println!("end-of-run evaluation failed: {e}");
    }
    let clinical = &r["final_evaluation"]["clinical"];
    if let Some(line) = clinical_line("clinical (BG, held-out)", &clinical["pooled"]) {
        println!("{line}");
        if let Some(groups) = clinical["groups"].as_object().filter(|g| g.len() > 1) {
            for (g, pool) in groups {
                if let Some(line) = clinical_line(&format!("  {g}"), pool) {
                    println!("{line}");
                }
            }
        }
        // The baseline controllers on the same held-out users and days.
        if let Some(baselines) = r["final_evaluation"]["baselines"].as_object() {
            for (name, b) in baselines {
                if let Some(line) = clinical_line(&format!("baseline {name}"), &b["pooled"]) {
                    println!("{line}");
                }
            }
        }
        println!(
            "control variability grid: {}",
            run.out_dir.join(CVGA_FILE).display()
        );
    }
    println!(
        "operator-only (exact counts, do not publish): {} contributions in released rounds, {} updates accepted, {} rejected",
        op["users"], op["updates_accepted"], op["updates_rejected"]
    );
    let mia = &op["model_audit"]["membership"];
    if let (Some(t10), Some(t1), Some(auc)) = (
        mia["tpr_at_10pct_fpr"].as_f64(),
        mia["tpr_at_1pct_fpr"].as_f64(),
        mia["auc"].as_f64(),
    ) {
        println!(
            "operator-only (an audit that reads the units' data, do not publish): membership \
             inference on {} members against {} held-out: TPR {:.1}% at 10% FPR (chance 10%), \
             {:.1}% at 1% FPR, AUC {auc:.3} (operator/report.json, model_audit)",
            mia["members"],
            mia["non_members"],
            100.0 * t10,
            100.0 * t1
        );
    }
    println!(
        "results in {} (public; operator-only files in {}; see FILES.md)",
        run.out_dir.display(),
        run.out_dir.join(state::OPERATOR_DIR).display()
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use fedrl_sim::clinical::{ClinicalReport, ClinicalSummary};

    fn report() -> serde_json::Value {
        let day = |p: &str, lo: f64, hi: f64| {
            let bg: Vec<f64> = (0..=480)
                .map(|k| lo + (hi - lo) * f64::from(k) / 480.0)
                .collect();
            ClinicalSummary::new(p, &bg, &bg).unwrap()
        };
        let c = ClinicalReport::new(vec![
            day("adult#001", 95.0, 170.0),
            day("child#002", 60.0, 320.0),
        ])
        .unwrap();
        serde_json::json!({ "final_evaluation": { "clinical": c } })
    }

    #[test]
    fn cvga_png_is_written_for_clinical_reports_only() {
        let dir = tempfile::tempdir().unwrap();
        let r = report();
        assert_eq!(cvga_points(&r).len(), 2);
        let path = dir.path().join(CVGA_FILE);
        assert!(write_cvga(&path, "uva-padova-dppg", &r, Some(&r)).unwrap());
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        let other = dir.path().join("none.png");
        let no_clinical = serde_json::json!({ "final_evaluation": { "final_eval_return": 1.0 } });
        assert!(!write_cvga(&other, "cartpole", &no_clinical, None).unwrap());
        assert!(!other.exists());
    }

    #[test]
    fn twin_repeats_and_takes_an_optional_file() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            run: Args,
        }
        use clap::Parser;
        let c = Cli::try_parse_from(["fedrl", "a.toml", "--twin", "b.toml", "--twin", "c.toml"])
            .unwrap();
        assert_eq!(
            c.run.twin,
            vec![PathBuf::from("b.toml"), PathBuf::from("c.toml")]
        );
        let c = Cli::try_parse_from(["fedrl", "--twin"]).unwrap();
        assert_eq!(c.run.twin, vec![PathBuf::new()]);
        let c = Cli::try_parse_from(["fedrl"]).unwrap();
        assert!(c.run.twin.is_empty());
    }

    #[test]
    fn policy_curves_are_drawn_for_policy_phase_reports_only() {
        let dir = tempfile::tempdir().unwrap();
        let curve = |v: f64| {
            serde_json::json!({ "final_evaluation": { "policy_curve": [
                { "epoch": 1, "normalized_return": v },
                { "epoch": 2, "normalized_return": v + 100.0, "normalized_return_std": 30.0,
                  "eval_episodes": 4 },
            ] } })
        };
        let (points, band) = policy_curve(&curve(300.0));
        assert_eq!(points, vec![(1.0, 300.0), (2.0, 400.0)]);
        // Only the epoch with its spread has a band: t(0.975, 3) = 3.1824, sample sd
        // 30 sqrt(4/3), over sqrt(4).
        assert_eq!(band.len(), 1);
        let half = 3.182_446 * 30.0 * (4.0f64 / 3.0).sqrt() / 2.0;
        assert!((band[0].2 - 400.0 - half).abs() < 1e-3, "{band:?}");
        let path = dir.path().join(POLICY_CURVE_FILE);
        let twins = vec![("mopo (non-private)".to_string(), curve(500.0))];
        assert!(write_policy_curves(&path, "pendulum-primorl", &curve(300.0), &twins).unwrap());
        assert_eq!(&std::fs::read(&path).unwrap()[1..4], b"PNG");
        let other = dir.path().join("none.png");
        assert!(!write_policy_curves(&other, "cartpole", &report(), &[]).unwrap());
        assert!(!other.exists());
        assert_eq!(twin_dir_name(0), "twin");
        assert_eq!(twin_dir_name(2), "twin-3");
    }

    #[test]
    fn summary_line_reads_the_pool() {
        let r = report();
        let line = clinical_line("all", &r["final_evaluation"]["clinical"]["pooled"]).unwrap();
        assert!(line.contains("2 patient-days"), "{line}");
        assert!(line.contains("worst patient child#002"), "{line}");
        assert!(clinical_line("x", &serde_json::Value::Null).is_none());
    }
}
