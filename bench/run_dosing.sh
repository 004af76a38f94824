#!/usr/bin/env bash
# Personalized dosing, issue 17: the private DPPG pump policies (with and without meal
# announcements) and their non-private twins, 3 seeds each, with the baseline controllers
# (basal-bolus, tuned PID, proportional) evaluated by the same run on the same 100 held-out
# patient-days. Resumable: a seed whose report.json exists is skipped; each finished run appends
# its clinical rows to bench/results/dosing_clinical.jsonl at once.
#
#   bash bench/run_dosing.sh                 # everything (about 4-8 min per run on 2 cores)
#   RUNS="pump-meals:2 pump:2" bash bench/run_dosing.sh   # a subset, "<setting>:<seed>[:twin]"
#
# Probes (validation seeds, other task options) keep their rows apart from the table's:
#   TAG=w4 TASK_EXTRA="low_risk_weight = 4.0" CLINICAL=bench/results/dosing_validation.jsonl \
#     RUNS="pump:4" bash bench/run_dosing.sh
# TASK_EXTRA (lines separated by \n) goes into the scenario's [task] table; TAG suffixes the
# run's name.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p fedrl-scenarios >&2
FEDRL=target/release/fedrl
OUT=bench/results/dosing
mkdir -p "$OUT"
CLINICAL=${CLINICAL:-bench/results/dosing_clinical.jsonl}
TASK_EXTRA=${TASK_EXTRA:-}
TAG=${TAG:+-$TAG}
RUNS=${RUNS:-"pump-meals:1 pump:1 pump-meals:2 pump:2 pump-meals:3 pump:3 pump-meals:1:twin pump:1:twin pump-meals:2:twin pump:2:twin pump-meals:3:twin pump:3:twin"}
for spec in $RUNS; do
  IFS=: read -r setting seed twin <<<"$spec"
  base="scenarios/uva-padova-$setting-dppg"
  toml="$base.toml"; [[ "${twin:-}" == twin ]] && toml="$base-nonprivate.toml"
  name="$(basename "$toml" .toml)$TAG-s$seed"
  dir="$OUT/$name"
  if [[ -f "$dir/report.json" ]]; then echo "skip $name (done)" >&2; continue; fi
  rm -rf "$dir"
  # Seed s: its own initial model, episodes and user population (held-out users included).
  awk -v seed="$seed" -v extra="$TASK_EXTRA" '{ print }
    $0 == "[task]" { printf "model_seed = %s\nepisode_seed = %s\npopulation_seed = %s\n", seed, seed, seed
                     if (extra != "") print extra }' "$toml" > "/tmp/$name.toml"
  echo "run $name" >&2
  start=$(date +%s)
  "$FEDRL" run "/tmp/$name.toml" --out "$dir" > "$OUT/$name.log" 2>&1
  wall=$(( $(date +%s) - start ))
  python3 - "$dir/report.json" "$name" "$setting" "$seed" "${twin:-private}" "$wall" \
    >> "$CLINICAL" <<'PY'
import json, sys
path, name, setting, seed, kind, wall = sys.argv[1:]
r = json.load(open(path))
f = r["final_evaluation"]
def rows(who, rep):
    out = []
    pools = {"pooled": rep["pooled"], **rep.get("groups", {})}
    for group, p in pools.items():
        bg = p["bg"]
        out.append({"run": name, "setting": setting, "seed": int(seed), "policy": kind,
                    "controller": who, "group": group, "days": p["patient_days"],
                    "epsilon": r["epsilon"], "wall_s": int(wall),
                    **{k: bg[k] for k in ("time_in_range", "time_below_70", "time_below_54",
                                          "time_above_180", "time_above_250", "mean_mg_dl",
                                          "lbgi", "hbgi", "risk_index")}})
    return out
lines = rows("dppg", f["clinical"])
for who, rep in f.get("baselines", {}).items():
    if who != "pid_tuning":
        lines += rows(who, rep)
for l in lines:
    print(json.dumps(l))
PY
done
