//! How the cost of a DPPG round grows with the work: time per round and users per second of
//! the default CartPole deployment (`fedrl run`, aggregator and client agents over QUIC on
//! loopback) against the cohort size, the number of client agent processes and the hidden
//! width, one factor at a time from the default scenario. Results are appended to a JSON-lines
//! file as they arrive (a configuration already there is skipped, so a stopped sweep resumes),
//! and drawn into a PNG with one panel per factor.
//!
//! ```text
//! cargo build --release -p fedrl-scenarios -p fedrl-bench
//! target/release/scaling [--fedrl target/release/fedrl] [--rounds 4]
//!     [--results bench/results/scaling.jsonl] [--plot bench/scaling.png]
//! ```
//!
//! Each run is `rounds` rounds with no periodic evaluation and no early stop; the time per round
//! is the mean gap between released rounds 2..=rounds in `operator/metrics.jsonl` (round 1 also
//! pays start-up and connection set-up). The policy is the initial one, so every user plays a
//! short CartPole episode (about 20 steps): the figures are the cost of a round's users, QUIC
//! transfers and aggregation, not of long episodes.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

/// One configuration: which factor it varies and its value.
#[derive(Clone, Copy, Debug)]
struct Config {
    factor: &'static str,
    cohort: u64,
    agents: u64,
    hidden: u64,
}

impl Config {
    fn value(&self) -> u64 {
        match self.factor {
            "cohort" => self.cohort,
            "agents" => self.agents,
            _ => self.hidden,
        }
    }
}

/// The sweeps: the default scenario is cohort 1,024, one agent, hidden 32.
fn configs() -> Vec<Config> {
    let base = Config {
        factor: "",
        cohort: 1024,
        agents: 1,
        hidden: 32,
    };
    let mut out = Vec::new();
    for cohort in [256, 1024, 4096, 16384] {
        out.push(Config {
            factor: "cohort",
            cohort,
            ..base
        });
    }
    for agents in [1, 2, 4] {
        out.push(Config {
            factor: "agents",
            agents,
            ..base
        });
    }
    for hidden in [32, 64, 128, 256] {
        out.push(Config {
            factor: "hidden",
            hidden,
            ..base
        });
    }
    out
}

fn arg(argv: &[String], name: &str) -> Option<String> {
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1))
        .cloned()
}

/// The default scenario with this configuration's factor changed.
fn scenario_text(default: &str, c: &Config, rounds: u64) -> anyhow::Result<String> {
    let mut doc: toml::Table = toml::from_str(default).context("parsing the default scenario")?;
    doc.insert(
        "name".into(),
        format!("scaling-{}-{}", c.factor, c.value()).into(),
    );
    doc.insert("rounds".into(), (rounds as i64).into());
    doc.insert("cohort_size".into(), (c.cohort as i64).into());
    doc.insert("quorum".into(), ((c.cohort * 9 / 10) as i64).into());
    doc.insert(
        "users".into(),
        ((c.cohort * rounds).max(100_000) as i64).into(),
    );
    doc.insert("client_agents".into(), (c.agents as i64).into());
    doc.insert("checkpoint_every".into(), 1000i64.into());
    let task = doc
        .get_mut("task")
        .and_then(|t| t.as_table_mut())
        .context("the default scenario has no [task]")?;
    task.remove("stop_at_return");
    task.insert("eval_every".into(), 1_000_000i64.into());
    task.insert("final_eval_users".into(), 1i64.into());
    let local = task
        .get_mut("local")
        .and_then(|t| t.as_table_mut())
        .context("the default scenario has no [task.local]")?;
    let h = toml::Value::Integer(c.hidden as i64);
    local.insert("hidden".into(), toml::Value::Array(vec![h.clone(), h]));
    Ok(toml::to_string(&doc)?)
}

/// Runs one configuration; returns (seconds per round, users per second).
fn measure(fedrl: &Path, text: &str, rounds: u64) -> anyhow::Result<(f64, f64)> {
    let dir = tempfile::tempdir()?;
    let scenario = dir.path().join("scenario.toml");
    std::fs::write(&scenario, text)?;
    let out = dir.path().join("run");
    let status = Command::new(fedrl)
        .arg("run")
        .arg(&scenario)
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .with_context(|| format!("starting {}", fedrl.display()))?;
    if !status.success() {
        bail!(
            "fedrl run failed ({status}); its logs were in {}",
            out.display()
        );
    }
    let metrics = std::fs::read_to_string(out.join("operator/metrics.jsonl"))?;
    let mut t = Vec::new();
    let mut users = Vec::new();
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        if v["status"] == "released" {
            t.push(v["t_s"].as_f64().unwrap_or(f64::NAN));
            users.push(v["accepted"].as_f64().unwrap_or(f64::NAN));
        }
    }
    if t.len() < rounds as usize || rounds < 2 {
        bail!("{} rounds released of {rounds}", t.len());
    }
    let span = t[t.len() - 1] - t[0];
    let per_round = span / (t.len() - 1) as f64;
    let users_after_first: f64 = users[1..].iter().sum();
    Ok((per_round, users_after_first / span))
}

fn main() -> anyhow::Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the bench crate's folder has no parent")?
        .to_path_buf();
    let fedrl = arg(&argv, "--fedrl")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/release/fedrl"));
    let rounds: u64 = arg(&argv, "--rounds").map_or(Ok(4), |v| v.parse())?;
    let results = arg(&argv, "--results")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("bench/results/scaling.jsonl"));
    let plot = arg(&argv, "--plot")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("bench/scaling.png"));
    let default = std::fs::read_to_string(root.join("scenarios/cartpole-dppg.toml"))?;
    let mut done: Vec<serde_json::Value> = std::fs::read_to_string(&results)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    for c in configs() {
        let seen = done
            .iter()
            .any(|d| d["factor"] == c.factor && d["value"].as_u64() == Some(c.value()));
        if seen {
            continue;
        }
        let text = scenario_text(&default, &c, rounds)?;
        let (per_round, users_per_s) = measure(&fedrl, &text, rounds)
            .with_context(|| format!("{} = {}", c.factor, c.value()))?;
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let row = serde_json::json!({
            "factor": c.factor,
            "value": c.value(),
            "cohort": c.cohort,
            "agents": c.agents,
            "hidden": c.hidden,
            "rounds": rounds,
            "seconds_per_round": per_round,
            "users_per_s": users_per_s,
            "loadavg_1m": load.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()),
        });
        println!("{row}");
        if let Some(dir) = results.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&results)?;
        std::io::Write::write_all(&mut f, format!("{row}\n").as_bytes())?;
        done.push(row);
    }
    draw(&plot, &done)?;
    println!("plot: {}", plot.display());
    Ok(())
}

/// One panel per factor: seconds per round (left axis) against the factor (log2 scale), with
/// users per second printed at each point.
fn draw(path: &Path, rows: &[serde_json::Value]) -> anyhow::Result<()> {
    // The font ships with the repository (plots render without system fonts).
    register_font(
        "sans-serif",
        FontStyle::Normal,
        include_bytes!("../../../scenarios/assets/DejaVuSans.ttf"),
    )
    .map_err(|_| anyhow::anyhow!("registering the plot font"))?;
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
    let root = BitMapBackend::new(path, (1500, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let panels = root.split_evenly((1, 3));
    let names = [
        ("cohort", "cohort size (users per round)"),
        ("agents", "client agent processes"),
        ("hidden", "hidden width (2 layers, policy and value)"),
    ];
    for (area, (factor, label)) in panels.iter().zip(names) {
        let mut pts: Vec<(f64, f64, f64)> = rows
            .iter()
            .filter(|r| r["factor"] == factor)
            .filter_map(|r| {
                Some((
                    r["value"].as_f64()?,
                    r["seconds_per_round"].as_f64()?,
                    r["users_per_s"].as_f64()?,
                ))
            })
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        if pts.is_empty() {
            continue;
        }
        let x0 = pts[0].0.log2() - 0.3;
        let x1 = pts[pts.len() - 1].0.log2() + 0.6;
        let y1 = pts.iter().map(|p| p.1).fold(0.0, f64::max) * 1.25;
        let mut chart = ChartBuilder::on(area)
            .caption(format!("time per round vs {factor}"), ("sans-serif", 20))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, 0.0..y1.max(1e-3))
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc(label)
            .y_desc("seconds per round")
            // Ticks at powers of two only (the axis is log2 of the factor).
            .x_labels(((x1 - x0).ceil() as usize * 4).max(2))
            .x_label_formatter(&|v| {
                if (v - v.round()).abs() < 0.02 {
                    format!("{:.0}", v.round().exp2())
                } else {
                    String::new()
                }
            })
            .label_style(("sans-serif", 13))
            .draw()
            .map_err(|e| err(&e))?;
        let color = RGBColor(31, 119, 180);
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|p| (p.0.log2(), p.1)),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?;
        chart
            .draw_series(pts.iter().map(|p| {
                EmptyElement::at((p.0.log2(), p.1))
                    + Circle::new((0, 0), 4, color.filled())
                    + Text::new(format!("{:.0} users/s", p.2), (6, -16), ("sans-serif", 12))
            }))
            .map_err(|e| err(&e))?;
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
