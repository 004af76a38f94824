//! The public per-round files of a finished `fedrl run`: `metrics.jsonl` with an epsilon on
//! every released row, and `metrics.csv` beside it (the same rows and columns, nested fields
//! flattened as `eval.eval_return`, `diagnostics.update_norm`), for pandas and spreadsheets.
//! The public training diagnostics (`diagnostics.*`, the evaluation's `eval.*`) become columns
//! like every other field. (The TensorBoard event files are written by the aggregator as lines
//! arrive: `fedrl_aggregator::tensorboard`.)
//!
//! Invariants: only the public `metrics.jsonl` is read (DP outputs and evaluations of released
//! models; the exact counts stay in `operator/metrics.jsonl`), so the CSV holds nothing the
//! JSON lines do not. The aggregator accounts a full epsilon on every `max(1, rounds / 100)`-th
//! round, evaluated rounds and the last (each is a whole PLD composition, 50-200 ms); a
//! released row in between gets the exact epsilon of the next accounted row, or the run's
//! final epsilon after the last one. Composition never lowers epsilon, so that figure is an
//! upper bound on the row's own; `epsilon_exact` says which rows carry their own figure.

use std::path::Path;

use anyhow::Context;
use serde_json::Value;

/// File name of the CSV beside `metrics.jsonl`.
pub const CSV_FILE: &str = "metrics.csv";

/// Fills the epsilon of the private released rows that have none (see the module doc) and
/// marks every private released row with `epsilon_exact`. Rows of a non-private run (no
/// `delta`) and abandoned rows are left as they are. Returns how many rows were filled.
pub fn fill_epsilon(rows: &mut [Value], final_epsilon: Option<f64>) -> usize {
    let mut next_exact = final_epsilon;
    let mut filled = 0;
    for row in rows.iter_mut().rev() {
        if row["status"] != "released" || row["delta"].is_null() {
            continue;
        }
        let Some(obj) = row.as_object_mut() else {
            continue;
        };
        match obj.get("epsilon").and_then(Value::as_f64) {
            Some(e) => {
                next_exact = Some(e);
                obj.insert("epsilon_exact".into(), Value::Bool(true));
            }
            None => {
                if let Some(e) = next_exact {
                    obj.insert("epsilon".into(), e.into());
                    obj.insert("epsilon_exact".into(), Value::Bool(false));
                    filled += 1;
                }
            }
        }
    }
    filled
}

/// The rows as CSV (RFC 4180): one column per leaf field (`round`, `status`, `epsilon`,
/// `epsilon_exact`, `delta` first, then in order of first appearance), nested objects
/// flattened with dots; arrays are written as their JSON text, null as an
/// empty cell.
pub fn to_csv(rows: &[Value]) -> String {
    let mut columns: Vec<String> = Vec::new();
    let flat: Vec<Vec<(String, String)>> = rows
        .iter()
        .map(|r| {
            let mut cells = Vec::new();
            flatten("", r, &mut cells);
            for (k, _) in &cells {
                if !columns.contains(k) {
                    columns.push(k.clone());
                }
            }
            cells
        })
        .collect();
    // The round and its privacy first; the rest as they come (serde_json orders an object's
    // keys alphabetically).
    let lead = ["round", "status", "epsilon", "epsilon_exact", "delta"];
    columns.sort_by_key(|c| lead.iter().position(|l| l == c).unwrap_or(lead.len()));
    let mut out = columns
        .iter()
        .map(|c| quote(c))
        .collect::<Vec<_>>()
        .join(",");
    out.push('\n');
    for cells in &flat {
        let line: Vec<String> = columns
            .iter()
            .map(|c| {
                cells
                    .iter()
                    .find(|(k, _)| k == c)
                    .map(|(_, v)| quote(v))
                    .unwrap_or_default()
            })
            .collect();
        out.push_str(&line.join(","));
        out.push('\n');
    }
    out
}

fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, x, out);
            }
        }
        Value::Null => out.push((prefix.to_string(), String::new())),
        Value::String(s) => out.push((prefix.to_string(), s.clone())),
        other => out.push((prefix.to_string(), other.to_string())),
    }
}

/// A CSV cell: quoted when it holds a comma, a quote or a line break (quotes doubled).
fn quote(cell: &str) -> String {
    if cell.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", cell.replace('"', "\"\""))
    } else {
        cell.to_string()
    }
}

/// Rewrites `dir/metrics.jsonl` with every private released row's epsilon filled (a run that
/// ended: `final_epsilon` is its report's) and writes `dir/metrics.csv` from it.
pub fn publish(dir: &Path, metrics_file: &str, final_epsilon: Option<f64>) -> anyhow::Result<()> {
    let path = dir.join(metrics_file);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut rows: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .with_context(|| format!("parsing {}", path.display()))?;
    fill_epsilon(&mut rows, final_epsilon);
    let mut jsonl = String::new();
    for r in &rows {
        jsonl.push_str(&serde_json::to_string(r)?);
        jsonl.push('\n');
    }
    std::fs::write(&path, jsonl).with_context(|| format!("writing {}", path.display()))?;
    let csv = dir.join(CSV_FILE);
    std::fs::write(&csv, to_csv(&rows)).with_context(|| format!("writing {}", csv.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_private_released_row_gets_an_epsilon_bound() {
        let mut rows = vec![
            json!({"round": 1, "status": "released", "epsilon": null, "delta": 1e-5}),
            json!({"round": 2, "status": "released", "epsilon": 0.5, "delta": 1e-5}),
            json!({"round": 3, "status": "abandoned"}),
            json!({"round": 4, "status": "released", "epsilon": null, "delta": 1e-5}),
            json!({"round": 5, "status": "released", "epsilon": 0.9, "delta": 1e-5}),
            json!({"round": 6, "status": "released", "epsilon": null, "delta": 1e-5}),
        ];
        assert_eq!(fill_epsilon(&mut rows, Some(1.2)), 3);
        let eps: Vec<Option<f64>> = rows.iter().map(|r| r["epsilon"].as_f64()).collect();
        assert_eq!(
            eps,
            vec![Some(0.5), Some(0.5), None, Some(0.9), Some(0.9), Some(1.2)]
        );
        assert_eq!(rows[0]["epsilon_exact"], false);
        assert_eq!(rows[1]["epsilon_exact"], true);
        assert!(rows[2].get("epsilon_exact").is_none());
        // A non-private twin has no epsilon at all.
        let mut twin =
            vec![json!({"round": 1, "status": "released", "epsilon": null, "delta": null})];
        assert_eq!(fill_epsilon(&mut twin, None), 0);
        assert!(twin[0]["epsilon"].is_null());
    }

    #[test]
    fn csv_flattens_nested_fields_and_quotes() {
        let rows = vec![
            json!({"round": 1, "status": "released", "epsilon": 0.5,
                   "eval": {"eval_return": 9.5, "note": "a, \"b\""},
                   "diagnostics": {"update_norm": 0.25}}),
            json!({"round": 2, "status": "abandoned", "t_s": 1.5}),
        ];
        let csv = to_csv(&rows);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(
            lines[0],
            "round,status,epsilon,diagnostics.update_norm,eval.eval_return,eval.note,t_s"
        );
        assert_eq!(lines[1], "1,released,0.5,0.25,9.5,\"a, \"\"b\"\"\",");
        assert_eq!(lines[2], "2,abandoned,,,,,1.5");
        assert_eq!(lines.len(), 3);
    }
}
