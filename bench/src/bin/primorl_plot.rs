//! Draws the PriMORL result curves of `bench/results/primorl.jsonl` (written by
//! `bench/run_primorl.sh`): per task, the normalised return after each SAC epoch, averaged over
//! the seeds run so far, one line per variant (high and low privacy, No Privacy, MOPO) and clip
//! norm and SAC length, as the paper's Figure 2.
//!
//! ```text
//! cargo build --release -p fedrl-bench --bin primorl_plot
//! target/release/primorl_plot [--results bench/results/primorl.jsonl] [--out bench]
//! ```
//! writes `OUT/primorl_TASK.png` for every task with results.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "bench/results/primorl.jsonl")]
    results: PathBuf,
    #[arg(long, default_value = "bench")]
    out: PathBuf,
}

/// One run's (SAC epoch, normalised return) points.
type Curve = Vec<(f64, f64)>;

/// Mean normalised return per epoch over the runs of one scenario, and how many runs.
fn mean_curve(runs: &[Curve]) -> Curve {
    let mut by_epoch: BTreeMap<u64, (f64, usize)> = BTreeMap::new();
    for run in runs {
        for &(e, v) in run {
            let s = by_epoch.entry(e as u64).or_insert((0.0, 0));
            s.0 += v;
            s.1 += 1;
        }
    }
    by_epoch
        .into_iter()
        .map(|(e, (s, n))| (e as f64, s / n as f64))
        .collect()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let text = std::fs::read_to_string(&args.results)
        .with_context(|| format!("reading {}", args.results.display()))?;
    // task -> (scenario, clip norm, SAC epochs) -> runs
    let mut tasks: BTreeMap<String, BTreeMap<String, Vec<Curve>>> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let r: serde_json::Value = serde_json::from_str(line)?;
        let Some(name) = r["scenario"].as_str() else {
            continue;
        };
        let task = name.split('-').next().unwrap_or(name).to_string();
        let curve: Curve = r["curve"]
            .as_array()
            .map(|c| {
                c.iter()
                    .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                    .collect()
            })
            .unwrap_or_default();
        // Runs of one scenario at another clip norm or SAC length are another line.
        let label = format!(
            "{name}, C = {}, {} SAC epochs",
            r["clip_norm"], r["policy_epochs"]
        );
        tasks
            .entry(task)
            .or_default()
            .entry(label)
            .or_default()
            .push(curve);
    }
    register_font(
        "sans-serif",
        FontStyle::Normal,
        include_bytes!("../../../scenarios/assets/DejaVuSans.ttf"),
    )
    .map_err(|_| anyhow::anyhow!("registering the plot font"))?;
    let colors = [
        RGBColor(214, 39, 40),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(31, 119, 180),
        RGBColor(148, 103, 189),
    ];
    for (task, scenarios) in &tasks {
        let path = args.out.join(format!("primorl_{task}.png"));
        let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
        // One-seed probes (other clip norms, shorter runs) stay in the tables: where a
        // configuration has several seeds, only those are drawn (five colours, one per line).
        let most = scenarios.values().map(Vec::len).max().unwrap_or(0);
        let curves: Vec<(String, Curve)> = scenarios
            .iter()
            .filter(|(_, runs)| runs.len() >= 2 || most < 2)
            .map(|(name, runs)| (format!("{name} ({} seeds)", runs.len()), mean_curve(runs)))
            .collect();
        let x1 = curves
            .iter()
            .flat_map(|(_, c)| c.iter().map(|p| p.0))
            .fold(1.0, f64::max);
        let root = BitMapBackend::new(&path, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("PriMORL {task}: policy in the model, real-environment return"),
                ("sans-serif", 22),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..x1, 0.0..1000.0)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("SAC epoch")
            .y_desc("normalised return (mean over seeds)")
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| err(&e))?;
        for (i, (label, c)) in curves.iter().enumerate() {
            let color = colors[i % colors.len()];
            chart
                .draw_series(LineSeries::new(c.iter().copied(), color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(|e| err(&e))?;
        root.present()
            .with_context(|| format!("writing {}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(())
}
