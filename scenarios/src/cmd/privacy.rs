//! `fedrl privacy ...`: the accountants as a calculator.
//!
//! - `epsilon`: epsilon of T Poisson-sampled Gaussian rounds (PLD by default, RDP on request);
//! - `noise`: the smallest noise multiplier meeting a target epsilon;
//! - `gaussian`: epsilon of one Gaussian mechanism, exactly (analytic Gaussian).
//!
//! Epsilons are in nats. `--json` prints one JSON object (result, inputs, accountant).

use std::process::ExitCode;

use clap::Subcommand;
use fedrl_common::privacy::accountant::{self, AccountantKind};
use fedrl_common::privacy::gaussian;
use fedrl_common::privacy::{Delta, PrivacyError, SamplingRate};
use serde_json::json;

use crate::cmd::UsageError;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: PrivacyCommand,
}

#[derive(Subcommand)]
enum PrivacyCommand {
    /// Epsilon of `--steps` rounds of a Gaussian mechanism on Poisson samples.
    Epsilon(EpsilonArgs),
    /// Smallest noise multiplier whose rounds meet a target epsilon.
    Noise(NoiseArgs),
    /// Epsilon of one Gaussian mechanism with L2 sensitivity 1 (exact, analytic Gaussian).
    Gaussian(GaussianArgs),
}

#[derive(clap::Args)]
struct EpsilonArgs {
    /// Noise standard deviation divided by the L2 clipping bound (z > 0).
    #[arg(long, allow_negative_numbers = true)]
    noise_multiplier: f64,
    /// Probability that a unit takes part in a round, in (0, 1] (1 = every round).
    #[arg(long, allow_negative_numbers = true)]
    sampling_rate: f64,
    /// Number of rounds (>= 1).
    #[arg(long, allow_negative_numbers = true)]
    steps: i64,
    /// Target delta, in (0, 1).
    #[arg(long, allow_negative_numbers = true)]
    delta: f64,
    /// Accountant: pld (reported figure) or rdp (cross-check).
    #[arg(long, default_value = "pld")]
    accountant: String,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct NoiseArgs {
    /// Target epsilon (nats, > 0).
    #[arg(long, allow_negative_numbers = true)]
    epsilon: f64,
    /// Target delta, in (0, 1).
    #[arg(long, allow_negative_numbers = true)]
    delta: f64,
    /// Probability that a unit takes part in a round, in (0, 1].
    #[arg(long, allow_negative_numbers = true)]
    sampling_rate: f64,
    /// Number of rounds (>= 1).
    #[arg(long, allow_negative_numbers = true)]
    steps: i64,
    /// Accountant: pld (reported figure) or rdp (cross-check).
    #[arg(long, default_value = "pld")]
    accountant: String,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct GaussianArgs {
    /// Noise standard deviation in units of the L2 sensitivity (> 0).
    #[arg(long, allow_negative_numbers = true)]
    sigma: f64,
    /// Target delta, in (0, 1).
    #[arg(long, allow_negative_numbers = true)]
    delta: f64,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
}

fn usage(msg: String) -> anyhow::Error {
    UsageError(msg).into()
}

fn positive(name: &str, v: f64) -> anyhow::Result<f64> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(usage(format!(
            "--{name} must be a positive finite number, got {v}"
        )))
    }
}

fn rate(v: f64) -> anyhow::Result<f64> {
    SamplingRate::try_from(v)
        .map(SamplingRate::get)
        .map_err(|e| usage(format!("--sampling-rate: {e}")))
}

fn delta(v: f64) -> anyhow::Result<f64> {
    Delta::try_from(v)
        .map(Delta::get)
        .map_err(|e| usage(format!("--delta: {e}")))
}

fn steps(v: i64) -> anyhow::Result<u64> {
    match u64::try_from(v) {
        Ok(s) if s >= 1 => Ok(s),
        _ => Err(usage(format!("--steps must be at least 1, got {v}"))),
    }
}

fn kind(s: &str) -> anyhow::Result<AccountantKind> {
    s.parse::<AccountantKind>()
        .map_err(|_| usage(format!("--accountant must be pld or rdp, got {s:?}")))
}

/// Parameter errors from the library are the user's; anything else is ours to report (exit 1).
fn library(err: PrivacyError) -> anyhow::Error {
    match err {
        PrivacyError::InvalidParameter(m) => usage(m),
        other => other.into(),
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        PrivacyCommand::Epsilon(a) => epsilon(a),
        PrivacyCommand::Noise(a) => noise(a),
        PrivacyCommand::Gaussian(a) => single_gaussian(a),
    }
}

fn epsilon(a: EpsilonArgs) -> anyhow::Result<ExitCode> {
    let z = positive("noise-multiplier", a.noise_multiplier)?;
    let q = rate(a.sampling_rate)?;
    let t = steps(a.steps)?;
    let d = delta(a.delta)?;
    let k = kind(&a.accountant)?;
    let event = accountant::sampled_gaussian_rounds(z, q, t);
    let eps = accountant::epsilon(&event, d, k).map_err(library)?;
    if a.json {
        let out = json!({
            "epsilon": eps,
            "noise_multiplier": z,
            "sampling_rate": q,
            "steps": t,
            "delta": d,
            "accountant": k.to_string(),
        });
        println!("{out}");
    } else {
        println!(
            "epsilon = {eps:.6} at delta = {d:e} ({} accountant: noise multiplier {z}, sampling \
             rate {q}, {t} steps)",
            k.to_string().to_uppercase()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn noise(a: NoiseArgs) -> anyhow::Result<ExitCode> {
    let e = positive("epsilon", a.epsilon)?;
    let d = delta(a.delta)?;
    let q = rate(a.sampling_rate)?;
    let t = steps(a.steps)?;
    let k = kind(&a.accountant)?;
    let z = accountant::noise_multiplier(e, d, q, t, k).map_err(library)?;
    let achieved = accountant::epsilon(&accountant::sampled_gaussian_rounds(z, q, t), d, k)
        .map_err(library)?;
    if a.json {
        let out = json!({
            "noise_multiplier": z,
            "epsilon": e,
            "achieved_epsilon": achieved,
            "delta": d,
            "sampling_rate": q,
            "steps": t,
            "accountant": k.to_string(),
        });
        println!("{out}");
    } else {
        println!(
            "noise multiplier = {z:.6} meets epsilon = {e} at delta = {d:e} ({} accountant: \
             sampling rate {q}, {t} steps; achieved epsilon {achieved:.6})",
            k.to_string().to_uppercase()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn single_gaussian(a: GaussianArgs) -> anyhow::Result<ExitCode> {
    let s = positive("sigma", a.sigma)?;
    let d = delta(a.delta)?;
    let eps = gaussian::epsilon(s, d).map_err(library)?;
    if a.json {
        let out = json!({
            "epsilon": eps,
            "sigma": s,
            "delta": d,
            "accountant": "analytic_gaussian",
        });
        println!("{out}");
    } else {
        println!(
            "epsilon = {eps:.6} at delta = {d:e} (one Gaussian mechanism, sigma {s}, exact \
             analytic Gaussian)"
        );
    }
    Ok(ExitCode::SUCCESS)
}
