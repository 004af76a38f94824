//! PNG plots with plotters: line plots (learning curves) and the control variability grid
//! (CVGA) of glucose runs. The font ships in `assets/` so plots render on machines without
//! system fonts.

use std::path::Path;
use std::sync::Once;

use anyhow::{Context, anyhow};
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

static FONT: Once = Once::new();

fn ensure_font() {
    FONT.call_once(|| {
        // The bytes are a valid TTF compiled into the binary; failure would be a build defect.
        let _ = register_font(
            "sans-serif",
            FontStyle::Normal,
            include_bytes!("../assets/DejaVuSans.ttf"),
        );
    });
}

/// One named curve of (x, y) points, with an optional band (x, low, high) drawn shaded
/// beneath it (an interval around the curve; empty for none).
#[derive(Default)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub band: Vec<(f64, f64, f64)>,
}

/// The y axis of a line plot whose data span `[lo, hi]`, with `n` series in the legend: 5%
/// padding below and above, and headroom above for the legend (upper right, one line per
/// series) so that it covers no curve or band.
fn y_axis(mut lo: f64, mut hi: f64, n: usize) -> (f64, f64) {
    if hi - lo <= lo.abs().max(hi.abs()) * 1e-3 {
        // A flat curve (an offline run whose greedy return never moved): a span of zero
        // would give ticks that all print the same number, so centre it in a visible range.
        let half = (lo.abs().max(hi.abs()) * 0.1).max(0.5);
        let mid = 0.5 * (lo + hi);
        (lo, hi) = (mid - half, mid + half);
    }
    let pad = (hi - lo) * 0.05;
    let legend = pad * (2.0 + 1.4 * n as f64);
    (lo - pad, hi + pad + legend)
}

/// Draws `series` as lines (and their bands, shaded) into a PNG of 960 x 600 pixels at
/// `path`. When every x is a whole number (rounds, steps, epochs) the x axis is labelled
/// with whole numbers.
pub fn line_plot(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> anyhow::Result<()> {
    ensure_font();
    let band_pts = series
        .iter()
        .flat_map(|s| s.band.iter())
        .flat_map(|&(x, lo, hi)| [(x, lo), (x, hi)]);
    let pts = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .chain(band_pts)
        .filter(|(x, y)| x.is_finite() && y.is_finite());
    let whole_x = series
        .iter()
        .flat_map(|s| s.points.iter())
        .all(|(x, _)| x.fract() == 0.0);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1e-12 {
        x1 = x0 + 1.0;
    }
    let (y0, y1) = y_axis(y0, y1, series.len());

    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| err(&e))?;
    let whole = |x: &f64| format!("{x:.0}");
    let mut mesh = chart.configure_mesh();
    mesh.x_desc(x_label)
        .y_desc(y_label)
        .label_style(("sans-serif", 14));
    if y1 - y0 >= 20.0 {
        // Returns in the tens and more: "250", not "250.0".
        mesh.y_label_formatter(&whole);
    }
    if whole_x {
        // Rounds are whole numbers: no "2.0", and no tick between two of them.
        mesh.x_label_formatter(&whole)
            .x_labels(((x1 - x0).round() as usize + 1).clamp(2, 12));
    }
    mesh.draw().map_err(|e| err(&e))?;
    let palette = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
    ];
    for (i, s) in series.iter().enumerate() {
        let color = palette[i % palette.len()];
        if !s.band.is_empty() {
            // The band's outline: along the highs, back along the lows.
            let outline: Vec<(f64, f64)> = s
                .band
                .iter()
                .map(|&(x, _, hi)| (x, hi))
                .chain(s.band.iter().rev().map(|&(x, lo, _)| (x, lo)))
                .collect();
            chart
                .draw_series(std::iter::once(Polygon::new(
                    outline,
                    color.mix(0.2).filled(),
                )))
                .map_err(|e| err(&e))?;
        }
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(s.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| err(&e))?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// One named set of CVGA points: (lower, upper) glucose of each patient-day (mg/dL), as
/// [`fedrl_sim::clinical::CvgaPoint`]'s `x_mg_dl`, `y_mg_dl`.
pub struct CvgaSeries {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// The grid's cells as simglucose draws them: (x from, x to, y from, y to) in mg/dL, label,
/// colour.
const CVGA_CELLS: [(f64, f64, f64, f64, &str, RGBColor); 9] = [
    (90.0, 110.0, 110.0, 180.0, "A", RGBColor(50, 205, 50)),
    (70.0, 90.0, 110.0, 180.0, "Lower B", RGBColor(0, 128, 0)),
    (90.0, 110.0, 180.0, 300.0, "Upper B", RGBColor(0, 128, 0)),
    (70.0, 90.0, 180.0, 300.0, "B", RGBColor(0, 128, 0)),
    (50.0, 70.0, 110.0, 180.0, "Lower C", RGBColor(255, 255, 0)),
    (90.0, 110.0, 300.0, 400.0, "Upper C", RGBColor(255, 255, 0)),
    (50.0, 70.0, 180.0, 300.0, "Lower D", RGBColor(255, 165, 0)),
    (70.0, 90.0, 300.0, 400.0, "Upper D", RGBColor(255, 165, 0)),
    (50.0, 70.0, 300.0, 400.0, "E", RGBColor(255, 0, 0)),
];

/// Draws the control variability grid (Magni et al. 2008, as simglucose's `CVGA` plot) with
/// every series' points into a PNG of 800 x 720 pixels at `path`. The horizontal axis is the
/// day's low (2.5th percentile) BG running from 110 down to 50 mg/dL, the vertical its high
/// (97.5th percentile) from 110 to 400; points beyond are drawn on the edge, as the grid does.
pub fn cvga_plot(path: &Path, title: &str, series: &[CvgaSeries]) -> anyhow::Result<()> {
    ensure_font();
    // Plot coordinate u = 160 - x, so the axis runs 110 -> 50 left to right.
    let flip = |x: f64| 160.0 - x;
    let root = BitMapBackend::new(path, (800, 760)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    // The legend goes in a strip beneath the grid: patient-days crowd every edge and corner of
    // the grid (values beyond it are drawn on its edge), so no place inside is free.
    let (top, strip) = root.split_vertically(720);
    let mut chart = ChartBuilder::on(&top)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(flip(111.0)..flip(49.0), 105.0..405.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("low BG (2.5th percentile, mg/dL)")
        .y_desc("high BG (97.5th percentile, mg/dL)")
        .x_labels(7)
        .x_label_formatter(&|u| format!("{:.0}", 160.0 - u))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| err(&e))?;
    for (x0, x1, y0, y1, label, color) in CVGA_CELLS {
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(flip(x1), y0), (flip(x0), y1)],
                color.mix(0.55).filled(),
            )))
            .map_err(|e| err(&e))?;
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(flip(x1), y0), (flip(x0), y1)],
                WHITE.stroke_width(2),
            )))
            .map_err(|e| err(&e))?;
        chart
            .draw_series(std::iter::once(Text::new(
                label.to_string(),
                (flip(x1) + 1.0, y1 - 8.0),
                ("sans-serif", 14),
            )))
            .map_err(|e| err(&e))?;
    }
    let palette = [
        RGBColor(31, 119, 180),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(0, 0, 0),
    ];
    for (i, s) in series.iter().enumerate() {
        let color = palette[i % palette.len()];
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|&(x, y)| (flip(x.clamp(50.0, 110.0)), y.clamp(110.0, 400.0)))
            .collect();
        // Translucent, so that the series' points on the same edge show through each other.
        chart
            .draw_series(
                pts.iter()
                    .map(|&p| Circle::new(p, 5, color.mix(0.7).filled().stroke_width(1))),
            )
            .map_err(|e| err(&e))?;
        // Two entries per line (the run and its twin fill the first).
        let (x, y) = (80 + 340 * (i % 2) as i32, 6 + 18 * (i / 2) as i32);
        strip
            .draw(&Circle::new((x, y + 8), 5, color.filled()))
            .map_err(|e| err(&e))?;
        strip
            .draw(&Text::new(
                format!("{} ({} patient-days)", s.name, pts.len()),
                (x + 12, y),
                ("sans-serif", 14),
            ))
            .map_err(|e| err(&e))?;
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_cvga_png() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cvga.png");
        let s = CvgaSeries {
            name: "policy".into(),
            // Inside the grid, beyond both edges, and not finite (skipped).
            points: vec![
                (95.0, 160.0),
                (40.0, 450.0),
                (130.0, 100.0),
                (f64::NAN, 1.0),
            ],
        };
        cvga_plot(&p, "uva-padova", &[s]).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(bytes.len() > 5000);
    }

    #[test]
    fn a_flat_curve_gets_a_visible_y_range() {
        let (lo, hi) = y_axis(9.3, 9.3, 1);
        assert!(lo < 9.0 && hi > 9.6, "{lo} {hi}");
        let (lo, hi) = y_axis(0.0, 0.0, 1);
        assert!(lo <= -0.5 && hi >= 0.5, "{lo} {hi}");
        // A small but real change (a loss going from 0.462 to 0.458) keeps its own scale.
        let (lo, hi) = y_axis(0.458, 0.462, 1);
        assert!(lo > 0.45 && hi < 0.48, "{lo} {hi}");
    }

    #[test]
    fn writes_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("curve.png");
        let s = Series {
            name: "private".into(),
            points: vec![(0.0, 10.0), (100.0, 200.0), (200.0, 480.0)],
            ..Series::default()
        };
        line_plot(&p, "CartPole-v1", "users", "evaluation return", &[s]).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(bytes.len() > 5000);
        // With a band (whose extremes widen the y range) on whole-number rounds.
        let banded = Series {
            name: "mean of 3".into(),
            points: vec![(1.0, 10.0), (2.0, 20.0), (3.0, 30.0)],
            band: vec![(1.0, 5.0, 15.0), (2.0, 12.0, 28.0), (3.0, 20.0, 40.0)],
        };
        let q = dir.path().join("band.png");
        line_plot(&q, "mean", "round", "return", &[banded]).unwrap();
        assert!(std::fs::read(&q).unwrap().len() > 5000);
    }
}
