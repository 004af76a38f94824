#!/usr/bin/env bash
# Federated (and central) DP-SGD round rate: steps/s with 256 sampled units (expected) spread
# over 4 client agents on loopback, and where the engine thread's time goes (operator timings:
# re-clip + fixed-point sum, ledger append = accounting + fsync, noise + release, Adam, central
# gradient computation). The rest of each step is the network and the clients.
# Usage: bench/run_dpsgd_rate.sh [ROUNDS]   (default 300)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
rounds="${1:-300}"
cargo build --release -q -p fedrl-scenarios
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export FEDRL_DATA_DIR="$work/datasets"
uptime
printf '%-10s %-10s %8s %8s %9s %s\n' mode hidden steps wall_s steps/s timings
for hidden in "[64, 64]" "[256, 256]"; do
  for mode in federated central; do
    s="$work/s.toml"
    sed -e "s/^rounds = .*/rounds = $rounds/" -e "s/^mode = .*/mode = \"$mode\"/" \
        -e "s/^hidden = .*/hidden = $hidden/" bench/scenarios/dpsgd-rate.toml > "$s"
    out="$work/out-$mode"
    rm -rf "$out"
    target/release/fedrl run "$s" --out "$out" >/dev/null 2>"$work/log" || { cat "$work/log"; exit 1; }
    python3 - "$out" "$mode" "$hidden" <<'PY'
import json, sys
out, mode, hidden = sys.argv[1:4]
op = json.load(open(f"{out}/operator/report.json"))
steps, wall = op["rounds_completed"], op["wall_seconds"]
t = op.get("timings", {})
# Steady state: the first round waits for every agent to join (start-up, dataset loading).
m = [json.loads(l) for l in open(f"{out}/metrics.jsonl") if l.strip()]
ts = [r["t_s"] for r in m if r.get("status") == "released"]
rate = (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 2 and ts[-1] > ts[0] else float("nan")
tt = " ".join(f"{k}={v:.2f}" for k, v in t.items())
print(f"{mode:<10} {hidden:<10} {steps:>8} {wall:>8.1f} {rate:>9.1f} {tt}")
PY
  done
done
