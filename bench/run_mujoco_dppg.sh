#!/usr/bin/env bash
# MuJoCo DPPG through the Gymnasium bridge (issue 57; seed 004's HalfCheetah and Hopper):
# scenarios/{halfcheetah,hopper}-dppg.toml and their non-private twins, each with
# `fedrl run --replicates N`, one JSON line per arm appended to bench/results/mujoco_dppg.jsonl
# (final return of each replicate, their mean with its 95% Student t interval, or with one
# replicate the final evaluation's mean with the t interval over its episodes; epsilon; wall
# clock per run). bench/README.md, "MuJoCo DPPG through the bridge", has the table.
#
# Usage: bench/run_mujoco_dppg.sh [REPLICATES] [ARM...]
#   ARM: halfcheetah-dppg, halfcheetah-dppg-nonprivate, hopper-dppg, hopper-dppg-nonprivate
#   (default: all four, 1 replicate). Runs under `nice -n 10`; outputs in runs/mujoco-dppg/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
reps="${1:-1}"
shift || true
arms=("$@")
[ ${#arms[@]} -eq 0 ] && arms=(halfcheetah-dppg halfcheetah-dppg-nonprivate hopper-dppg hopper-dppg-nonprivate)
scripts/install-python-bridge.sh --extra >/dev/null
cargo build --release -q -p fedrl-scenarios
bin="${CARGO_TARGET_DIR:-$root/target}/release/fedrl"
results=bench/results/mujoco_dppg.jsonl
mkdir -p bench/results runs/mujoco-dppg
commit="$(git rev-parse --short HEAD)"
for arm in "${arms[@]}"; do
  out="runs/mujoco-dppg/$arm-x$reps-$(date +%s)"
  load_before="$(cut -d' ' -f1 /proc/loadavg)"
  t0="$(date +%s.%N)"
  if [ "$reps" -gt 1 ]; then
    nice -n 10 "$bin" run "scenarios/$arm.toml" --replicates "$reps" --out "$out"
  else
    nice -n 10 "$bin" run "scenarios/$arm.toml" --out "$out"
  fi
  t1="$(date +%s.%N)"
  load_after="$(cut -d' ' -f1 /proc/loadavg)"
  .venv-bridge/bin/python - "$out" "$arm" "$reps" "$t0" "$t1" "$load_before" "$load_after" "$commit" >>"$results" <<'PY'
import json, math, os, sys, datetime
out, arm, reps, t0, t1, lb, la, commit = sys.argv[1:]
reps = int(reps)
def t95(df):
    # Two-sided 95% Student t quantiles (df 1..30; normal beyond).
    table = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
             2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
             2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
    return table[df - 1] if 1 <= df <= 30 else 1.96
dirs = [os.path.join(out, f"rep-{i}") for i in range(reps)] if reps > 1 else [out]
runs = []
for d in dirs:
    r = json.load(open(os.path.join(d, "report.json")))
    fe = r["final_evaluation"]
    runs.append({
        "dir": d,
        "final_eval_return": fe.get("final_eval_return"),
        "final_eval_return_std": fe.get("final_eval_return_std"),
        "final_eval_episodes": fe.get("final_eval_episodes"),
        "selected_model_eval_return": fe.get("selected_model_eval_return"),
        "epsilon": r.get("epsilon"),
        "rounds": r.get("rounds_completed"),
        "wall_seconds": r.get("wall_seconds"),
    })
vals = [x["final_eval_return"] for x in runs if x["final_eval_return"] is not None]
line = {"scenario": arm, "replicates": reps, "runs": runs, "epsilon": runs[0]["epsilon"],
        "delta": 1e-5, "commit": commit, "date": datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z",
        "shell_seconds": round(float(t1) - float(t0), 1), "loadavg_1m": [float(lb), float(la)],
        "machine": "2-core shared, release build, nice -n 10"}
if len(vals) > 1:
    m = sum(vals) / len(vals)
    s = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))
    h = t95(len(vals) - 1) * s / math.sqrt(len(vals))
    line.update(final_return_mean=m, ci95=[m - h, m + h],
                interval=f"95% Student t over {len(vals)} replicates")
elif vals:
    x = runs[0]
    n, m, sd = x["final_eval_episodes"], x["final_eval_return"], x["final_eval_return_std"]
    # The report's std is the population std of the episodes' returns.
    h = t95(n - 1) * sd * math.sqrt(n / (n - 1)) / math.sqrt(n) if n and n > 1 else float("nan")
    line.update(final_return_mean=m, ci95=[m - h, m + h],
                interval=f"95% Student t over the {n} final-evaluation episodes of one run")
print(json.dumps(line))
PY
  tail -1 "$results"
done
