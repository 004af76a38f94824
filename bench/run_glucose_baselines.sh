#!/usr/bin/env bash
# fedrl's glucose controllers (basal-bolus, PID) against simglucose 0.2.11's own BBController and
# PIDController on the same patients and the same meal days (issue 17, item 2).
#
#   bench/run_glucose_baselines.sh
#
# Environment knobs: USERS (evaluated users per seed, default 6), SEEDS (default "0 1000 2000"),
# NOISE (off|on, default off: CGM reads Gsub exactly on both sides; on: each side's own Dexcom
# noise, compare means over the seeds), TRAIN_USERS (PID tuning users, default 30),
# FIRST_USER (default 1000000), POPULATION (default uva-padova).
#
# For each seed and controller: `fedrl baseline --dump-meals` runs fedrl's controller on users
# FIRST_USER.. (one day each from reset seed SEED + i) and writes those users' patients, meals and
# PID gains; bench/peers/simglucose_controllers.py runs simglucose's controller on the same days.
# PID gains are tuned by fedrl (`--tune-pid`, training users 0..TRAIN_USERS only) and simglucose's
# PIDController gets the same gains. Writes bench/results/glucose_baselines.jsonl (one line per
# side, controller, seed and user) and bench/results/glucose_baselines.csv (per patient and
# controller: mean time in range over the seeds, fedrl and simglucose).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
users="${USERS:-6}"
seeds="${SEEDS:-0 1000 2000}"
noise="${NOISE:-off}"
train_users="${TRAIN_USERS:-30}"
first_user="${FIRST_USER:-1000000}"
population="${POPULATION:-uva-padova}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

venv="${SIMGLUCOSE_VENV:-$here/peers/.venv-simglucose}"
if ! "$venv/bin/python" -c 'import simglucose' 2>/dev/null; then
  echo "installing simglucose into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet -r "$here/peers/requirements-simglucose.txt"
fi

echo "building fedrl (release)..." >&2
(cd "$root" && cargo build --release -p fedrl-scenarios --quiet)
fedrl="${CARGO_TARGET_DIR:-$root/target}/release/fedrl"

for seed in $seeds; do
  for ctl in basal-bolus pid; do
    extra=()
    peer_ctl=bb
    if [ "$ctl" = pid ]; then
      extra=(--tune-pid --train-users "$train_users")
      peer_ctl=pid
    fi
    echo "seed $seed, $ctl: fedrl..." >&2
    "$fedrl" baseline --population "$population" --controller "$ctl" "${extra[@]}" \
      --first-user "$first_user" --users "$users" --seed "$seed" --sensor-noise "$noise" \
      --dump-meals "$out/days-$ctl-$seed.json" --json > "$out/fedrl-$ctl-$seed.json"
    echo "seed $seed, $ctl: simglucose..." >&2
    "$venv/bin/python" "$here/peers/simglucose_controllers.py" --days "$out/days-$ctl-$seed.json" \
      --controller "$peer_ctl" --noise "$noise" --out "$out/sg-$ctl-$seed.jsonl" 2>/dev/null
  done
done

mkdir -p "$here/results"
python3 - "$out" "$here/results/glucose_baselines" "$noise" <<'PY'
import csv, glob, json, os, statistics, sys
src, dst, noise = sys.argv[1], sys.argv[2], sys.argv[3]
rows = []
for path in sorted(glob.glob(os.path.join(src, "fedrl-*.json"))):
    ctl, seed = os.path.basename(path)[len("fedrl-"):-len(".json")].rsplit("-", 1)
    run = json.load(open(path))
    for t in run.get("tuning", []):
        print(f"seed {seed}: tuned {t['group']}: P {t['gains']['p']:.3g} I {t['gains']['i']:.3g} "
              f"D {t['gains']['d']:.3g} ({t['days']} days, tuning {run['tuning_seconds']:.1f} s)")
    for u in run["per_user"]:
        rows.append({"side": "fedrl", "controller": ctl, "seed": int(seed), "noise": noise,
                     "user": u["user"], "patient": u["patient"], "pid_gains": u["pid_gains"],
                     **{f"bg_{k}": v for k, v in u["bg"].items()},
                     "insulin_u": u["insulin_u"], "carbs_g": u["carbs_g"]})
    for line in open(os.path.join(src, f"sg-{ctl}-{seed}.jsonl")):
        u = json.loads(line)
        rows.append({"side": "simglucose", "controller": ctl, "seed": int(seed), "noise": noise,
                     "user": u["user"], "patient": u["patient"], "pid_gains": None,
                     **{f"bg_{k}": v for k, v in u["bg"].items()},
                     "insulin_u": u["insulin_u"], "carbs_g": u["carbs_g"]})
with open(dst + ".jsonl", "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
# Per patient and controller: means over that patient's days (all seeds), both sides.
keys = sorted({(r["controller"], r["patient"]) for r in rows})
metrics = ["time_in_range", "time_below_70", "time_below_54", "time_above_180", "mean_mg_dl"]
with open(dst + ".csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["controller", "patient", "days", "noise"]
               + [f"{side}_{m}" for m in metrics for side in ("fedrl", "simglucose")])
    print(f"{'controller':<12} {'patient':<15} {'days':>4}  TIR fedrl  TIR simglucose   diff")
    for ctl, pat in keys:
        sel = {s: [r for r in rows if r["controller"] == ctl and r["patient"] == pat and r["side"] == s]
               for s in ("fedrl", "simglucose")}
        mean = {(s, m): statistics.fmean(r[f"bg_{m}"] for r in sel[s]) for s in sel for m in metrics}
        w.writerow([ctl, pat, len(sel["fedrl"]), noise]
                   + [f"{mean[(s, m)]:.4f}" for m in metrics for s in ("fedrl", "simglucose")])
        a, b = mean[("fedrl", "time_in_range")], mean[("simglucose", "time_in_range")]
        print(f"{ctl:<12} {pat:<15} {len(sel['fedrl']):>4}  {a:9.3f}  {b:14.3f}  {a - b:+.3f}")
    for ctl in sorted({k[0] for k in keys}):
        d = {s: [r["bg_time_in_range"] for r in rows if r["controller"] == ctl and r["side"] == s]
             for s in ("fedrl", "simglucose")}
        print(f"{ctl:<12} {'pooled':<15} {len(d['fedrl']):>4}  {statistics.fmean(d['fedrl']):9.3f}"
              f"  {statistics.fmean(d['simglucose']):14.3f}")
PY
echo "wrote bench/results/glucose_baselines.{jsonl,csv}" >&2
