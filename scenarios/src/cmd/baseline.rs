//! `fedrl baseline`: a hand-written glucose controller in closed loop on a UVA/Padova
//! population's users, one day each, with the clinical figures a diabetes researcher reads.
//!
//! `fedrl baseline --population uva-padova --controller basal-bolus|pid|proportional
//! [--pid P,I,D | --tune-pid [--train-users N]] [--first-user N] [--users N] [--seed S]
//! [--sensor-noise population|on|off] [--dump-meals FILE] [--json]`
//!
//! User `--first-user + i` runs one day from reset seed `--seed + i` (as `fedrl eval` does).
//! `--tune-pid` grid-searches PID gains per age group on the training users
//! `0..--train-users` only, then runs each held-out user with its age group's gains.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use fedrl_sim::clinical::{GlucoseMetrics, glucose_metrics};
use fedrl_sim::controllers::{
    self, BasalBolus, Controller, Pid, PidGains, PidGrid, PidTuning, Proportional,
};
use fedrl_sim::population::{Population, UserParams};
use fedrl_sim::uva_padova::UvaPadovaEnv;
use serde_json::{Value, json};

use super::UsageError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ControllerKind {
    /// simglucose's BBController: patient basal, meal bolus from CR, correction from CF.
    BasalBolus,
    /// simglucose's PIDController (no basal offset, no bolus).
    Pid,
    /// 0.02 U/min + 0.0002 U/min per mg/dL above 140, never negative.
    Proportional,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SensorNoise {
    /// As the population sets it (`uva-padova`: off; `uva-padova-pump*`: on).
    Population,
    On,
    Off,
}

#[derive(clap::Args)]
pub struct Args {
    /// A UVA/Padova population (`uva-padova`, `uva-padova-adults`, ..., `uva-padova-pump`).
    #[arg(long, default_value = "uva-padova")]
    pub population: String,
    /// Population seed.
    #[arg(long, default_value_t = 0)]
    pub population_seed: u64,
    #[arg(long, value_enum)]
    pub controller: ControllerKind,
    /// PID gains `P,I,D` (U/min per mg/dL, per mg/dL min, U per mg/dL).
    #[arg(long, value_name = "P,I,D", conflicts_with = "tune_pid")]
    pub pid: Option<String>,
    /// Tune PID gains per age group on the training users `0..--train-users` (grid search).
    #[arg(long)]
    pub tune_pid: bool,
    /// Training users for `--tune-pid`.
    #[arg(long, default_value_t = 30)]
    pub train_users: u64,
    /// First evaluated user (choose ids outside the training users).
    #[arg(long, default_value_t = 1_000_000)]
    pub first_user: u64,
    /// Number of evaluated users (one day each).
    #[arg(long, default_value_t = 100)]
    pub users: u64,
    /// Reset seed of the first evaluated day (user `first-user + i` uses seed + i); tuning
    /// days use seed + user.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// CGM noise of the evaluated days (tuning keeps the population's).
    #[arg(long, value_enum, default_value_t = SensorNoise::Population)]
    pub sensor_noise: SensorNoise,
    /// Write the evaluated users' patients, seeds, meals (minute of day, g) and PID gains to
    /// this JSON file (for the simglucose peer, `bench/peers/simglucose_controllers.py`).
    #[arg(long, value_name = "FILE")]
    pub dump_meals: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One evaluated patient-day.
#[derive(Debug)]
struct UserDay {
    user: u64,
    patient: String,
    group: String,
    seed: u64,
    pid_gains: Option<PidGains>,
    /// Figures on the true blood glucose.
    bg: GlucoseMetrics,
    /// Figures on the CGM readings.
    cgm: GlucoseMetrics,
    insulin_u: f64,
    carbs_g: f64,
    /// Meals of the day (minute after midnight, g).
    meals: Vec<(u32, f64)>,
    /// The day ended early (glucose left the survivable range).
    ended_early: bool,
}

impl UserDay {
    fn to_json(&self) -> Value {
        json!({
            "user": self.user, "patient": self.patient, "group": self.group, "seed": self.seed,
            "pid_gains": self.pid_gains, "bg": self.bg, "cgm": self.cgm,
            "insulin_u": self.insulin_u, "carbs_g": self.carbs_g, "meals": self.meals,
            "ended_early": self.ended_early,
        })
    }
}

/// Means over a set of patient-days, and the worst day.
#[derive(Debug)]
struct Pooled {
    days: usize,
    bg: GlucoseMetrics,
    cgm: GlucoseMetrics,
    worst_time_in_range: f64,
    worst_patient: String,
}

impl Pooled {
    fn to_json(&self) -> Value {
        json!({
            "days": self.days, "bg": self.bg, "cgm": self.cgm,
            "worst_time_in_range": self.worst_time_in_range,
            "worst_patient": self.worst_patient,
        })
    }
}

fn parse_gains(s: &str) -> Result<PidGains, UsageError> {
    let v: Vec<f64> = s
        .split(',')
        .map(|x| x.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .map_err(|e| UsageError(format!("--pid {s:?}: {e}")))?;
    match v[..] {
        [p, i, d] if v.iter().all(|x| x.is_finite()) => Ok(PidGains { p, i, d }),
        _ => Err(UsageError(format!(
            "--pid {s:?}: expected three finite numbers P,I,D"
        ))),
    }
}

fn mean_stats(all: &[&GlucoseMetrics]) -> GlucoseMetrics {
    GlucoseMetrics::mean_of(&all.iter().map(|m| **m).collect::<Vec<_>>())
}

fn pool(days: &[&UserDay]) -> Pooled {
    let worst = days
        .iter()
        .min_by(|a, b| a.bg.time_in_range.total_cmp(&b.bg.time_in_range));
    Pooled {
        days: days.len(),
        bg: mean_stats(&days.iter().map(|d| &d.bg).collect::<Vec<_>>()),
        cgm: mean_stats(&days.iter().map(|d| &d.cgm).collect::<Vec<_>>()),
        worst_time_in_range: worst.map_or(f64::NAN, |d| d.bg.time_in_range),
        worst_patient: worst.map_or_else(String::new, |d| d.patient.clone()),
    }
}

/// A user's patient and the environment a controller runs it in.
fn user_env(
    population: &Population,
    user: u64,
    noise: SensorNoise,
) -> anyhow::Result<UvaPadovaEnv> {
    let UserParams::Patient { name, pump } = population.user_params(user)? else {
        return Err(UsageError(format!(
            "population {:?} is not a UVA/Padova population",
            population.name()
        ))
        .into());
    };
    let mut opts = controllers::controller_options(pump);
    match noise {
        SensorNoise::Population => {}
        SensorNoise::On => opts.sensor.noise = true,
        SensorNoise::Off => opts.sensor.noise = false,
    }
    Ok(UvaPadovaEnv::new(&name, opts)?)
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.users == 0 {
        return Err(UsageError("--users must be at least 1".into()).into());
    }
    let population = Population::new(&args.population, args.population_seed)
        .map_err(|e| UsageError(e.to_string()))?;
    if !matches!(population.user_params(0)?, UserParams::Patient { .. }) {
        return Err(UsageError(format!(
            "--population {:?} is not a UVA/Padova population",
            args.population
        ))
        .into());
    }
    if args.controller == ControllerKind::Pid && args.pid.is_none() && !args.tune_pid {
        return Err(UsageError("--controller pid needs --pid P,I,D or --tune-pid".into()).into());
    }
    if args.controller != ControllerKind::Pid && (args.pid.is_some() || args.tune_pid) {
        return Err(UsageError("--pid and --tune-pid go with --controller pid".into()).into());
    }
    if args.tune_pid && args.first_user < args.train_users {
        return Err(UsageError(format!(
            "--first-user {} overlaps the training users 0..{}",
            args.first_user, args.train_users
        ))
        .into());
    }

    // PID gains per age group: fixed, or tuned on training users only.
    let mut tuning: Vec<PidTuning> = Vec::new();
    let mut tuning_seconds = 0.0;
    let fixed = args.pid.as_deref().map(parse_gains).transpose()?;
    if args.tune_pid {
        let grid = PidGrid::default();
        let t = Instant::now();
        tuning = controllers::tune_pid(&population, 0..args.train_users, &grid, args.seed)
            .context("tuning PID gains")?;
        tuning_seconds = t.elapsed().as_secs_f64();
    }
    let group_gains: BTreeMap<String, PidGains> =
        tuning.iter().map(|t| (t.group.clone(), t.gains)).collect();

    let started = Instant::now();
    let mut days = Vec::with_capacity(args.users as usize);
    for i in 0..args.users {
        let user = args.first_user + i;
        // The reset seed `fedrl eval` gives episode i (seed + i, mixed as every rollout is), so
        // a controller and a policy evaluated with the same --seed play the same days.
        let seed = fedrl_rl::rollout::mix(args.seed.wrapping_add(i), 0);
        let mut env = user_env(&population, user, args.sensor_noise)?;
        let params = env.patient().params().clone();
        let group = fedrl_sim::clinical::group_of(&params.name).to_string();
        let mut pid_gains = None;
        let mut ctl: Box<dyn Controller> = match args.controller {
            ControllerKind::BasalBolus => Box::new(BasalBolus::for_patient(&params)?),
            ControllerKind::Proportional => Box::new(Proportional::default()),
            ControllerKind::Pid => {
                let g = match fixed {
                    Some(g) => g,
                    None => *group_gains.get(&group).ok_or_else(|| {
                        UsageError(format!(
                            "no training user of age group {group} in 0..{}: raise --train-users",
                            args.train_users
                        ))
                    })?,
                };
                pid_gains = Some(g);
                Box::new(Pid::new(g, controllers::BB_TARGET_MG_DL))
            }
        };
        let log = controllers::run_episode(&mut env, ctl.as_mut(), seed)
            .with_context(|| format!("user {user} ({})", params.name))?;
        let bg: Vec<f64> = log.iter().map(|s| s.bg_mg_dl).collect();
        let cgm: Vec<f64> = log.iter().map(|s| s.cgm_mg_dl).collect();
        let day = env.meals_today();
        let minutes = f64::from(env.options().episode_minutes);
        days.push(UserDay {
            user,
            patient: params.name.clone(),
            group,
            seed,
            pid_gains,
            bg: glucose_metrics(&bg)?,
            cgm: glucose_metrics(&cgm)?,
            insulin_u: log.iter().map(|s| s.insulin_u).sum(),
            carbs_g: log.iter().map(|s| s.cho_g).sum(),
            meals: day.meals[..day.count].to_vec(),
            ended_early: log.last().is_some_and(|s| s.minute < minutes - 1e-9),
        });
    }
    let wall = started.elapsed().as_secs_f64();

    let all: Vec<&UserDay> = days.iter().collect();
    let pooled = pool(&all);
    let by_group: BTreeMap<String, Pooled> = controllers::AGE_GROUPS
        .iter()
        .filter_map(|g| {
            let members: Vec<&UserDay> = days.iter().filter(|d| d.group == *g).collect();
            (!members.is_empty()).then(|| (g.to_string(), pool(&members)))
        })
        .collect();

    if let Some(path) = &args.dump_meals {
        let users: Vec<_> = days
            .iter()
            .map(|d| {
                json!({
                    "user": d.user, "patient": d.patient, "seed": d.seed,
                    "meals": d.meals, "pid_gains": d.pid_gains,
                })
            })
            .collect();
        let dump = json!({
            "population": args.population,
            "population_seed": args.population_seed,
            "controller": format!("{:?}", args.controller),
            "sample_time_min": 3,
            "episode_minutes": 1440,
            "pid_target_mg_dl": controllers::BB_TARGET_MG_DL,
            "users": users,
        });
        std::fs::write(path, serde_json::to_string_pretty(&dump)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }

    let controller = match args.controller {
        ControllerKind::BasalBolus => "basal-bolus",
        ControllerKind::Pid => "pid",
        ControllerKind::Proportional => "proportional",
    };
    if args.json {
        println!(
            "{}",
            json!({
                "population": args.population,
                "population_seed": args.population_seed,
                "controller": controller,
                "first_user": args.first_user,
                "users": args.users,
                "seed": args.seed,
                "sensor_noise": format!("{:?}", args.sensor_noise).to_lowercase(),
                "tuning": tuning,
                "tuning_seconds": tuning_seconds,
                "per_user": days.iter().map(UserDay::to_json).collect::<Vec<_>>(),
                "pooled": pooled.to_json(),
                "by_group": by_group
                    .iter()
                    .map(|(g, p)| (g.clone(), p.to_json()))
                    .collect::<serde_json::Map<_, _>>(),
                "wall_seconds": wall,
            })
        );
        return Ok(ExitCode::SUCCESS);
    }
    for t in &tuning {
        println!(
            "tuned {:<10} P {:.3e} I {:.3e} D {:.3e}: TIR {:.1}%, <70 {:.1}%{} ({} training users, {} days)",
            t.group,
            t.gains.p,
            t.gains.i,
            t.gains.d,
            100.0 * t.stats.time_in_range,
            100.0 * t.stats.time_below_70,
            if t.meets_hypo_target {
                ""
            } else {
                " (no gain meets <70 <= 4%: least hypoglycaemia)"
            },
            t.users,
            t.days
        );
    }
    if args.tune_pid {
        println!("tuning took {tuning_seconds:.1} s");
    }
    println!(
        "{controller} on {} users {}..{} (BG, % of time; CGM and fractions in --json)",
        args.population,
        args.first_user,
        args.first_user + args.users
    );
    println!(
        "{:<18} {:>15} {:>6} {:>6} {:>6} {:>6} {:>6} {:>7}",
        "user", "patient", "TIR%", "<70%", "<54%", ">180%", ">250%", "mean BG"
    );
    let row = |label: &str, patient: &str, s: &GlucoseMetrics| {
        println!(
            "{:<18} {:>15} {:>6.1} {:>6.1} {:>6.1} {:>6.1} {:>6.1} {:>7.1}",
            label,
            patient,
            100.0 * s.time_in_range,
            100.0 * s.time_below_70,
            100.0 * s.time_below_54,
            100.0 * s.time_above_180,
            100.0 * s.time_above_250,
            s.mean_mg_dl
        )
    };
    for d in &days {
        row(&d.user.to_string(), &d.patient, &d.bg);
    }
    for (g, p) in &by_group {
        row(&format!("{g} ({})", p.days), "", &p.bg);
    }
    row(&format!("pooled ({})", pooled.days), "", &pooled.bg);
    println!(
        "worst patient-day: {} (TIR {:.1}%); {:.1} s",
        pooled.worst_patient,
        100.0 * pooled.worst_time_in_range,
        wall
    );
    Ok(ExitCode::SUCCESS)
}
