#!/usr/bin/env bash
# One central DP-SGD step with 256 sampled units (issue 55 §3), Q-network 8-256-256-4 and the
# ~1 M-parameter MLP 8-1024-1024-4, CPU, 2 threads: fedrl's summed path vs the per-unit path it
# replaced vs a plain non-private candle step (bench/src/bin/central_step.rs), then Opacus 1.6
# ghost clipping and plain PyTorch on the same networks (bench/peers/opacus_peer.py), ratios
# printed at the end. Every line is appended to bench/results/central_step.jsonl with the run's
# time, commit and load average.
# Usage: bench/run_central_step.sh [ROUNDS] [SECONDS_PER_CASE_AND_ROUND]
#   (peer: a python with torch and opacus, from bench/peers/install.sh: $PEER_PY, else
#    bench/peers/.venv-offline/bin/python, else bench/peers/.venv/bin/python)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
rounds="${1:-5}"
secs="${2:-2}"
export RAYON_NUM_THREADS=2
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# CENTRAL_STEP_PROFILE=dev-opt builds in the dev profile with opt-level 3 for every crate
# (dependencies and fedrl-common are at 3 there already; this adds fedrl-rl and fedrl-bench):
# for a machine whose dev build is warm and a release build of candle would take too long.
if [ "${CENTRAL_STEP_PROFILE:-release}" = dev-opt ]; then
  cargo build -q -p fedrl-bench --bin central_step \
    --config 'profile.dev.package.fedrl-rl.opt-level=3' \
    --config 'profile.dev.package.fedrl-bench.opt-level=3'
  bin="${CARGO_TARGET_DIR:-$root/target}/debug/central_step"
else
  cargo build -q --release -p fedrl-bench --bin central_step
  bin="${CARGO_TARGET_DIR:-$root/target}/release/central_step"
fi
echo "== load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== fedrl (candle, RAYON_NUM_THREADS=2, $rounds interleaved rounds)"
"$bin" --units 256 --rounds "$rounds" --seconds "$secs" --networks 256,1024 | tee "$out/fedrl.jsonl"
py="${PEER_PY:-}"
for cand in "$root/bench/peers/.venv-offline/bin/python" "$root/bench/peers/.venv/bin/python"; do
  [ -z "$py" ] && [ -x "$cand" ] && py="$cand"
done
touch "$out/peer.jsonl"
if [ -n "$py" ] && [ -x "$py" ] && "$py" -c "import torch, opacus" 2>/dev/null; then
  echo "== peers: plain PyTorch and Opacus ghost clipping (torch.set_num_threads(2), $rounds repeats)"
  for h in 256,256 1024,1024; do
    "$py" bench/peers/opacus_peer.py --batch 256 --threads 2 --seconds "$secs" --hidden "$h" \
      --modes plain,ghost --repeats "$rounds" | tee -a "$out/peer.jsonl"
  done
else
  echo "== peers skipped: no python with torch and opacus (bench/peers/install.sh)"
fi
echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$out/fedrl.jsonl" "$out/peer.jsonl" "$root/bench/results/central_step.jsonl" \
  "$(git rev-parse --short HEAD)" "$(cut -d' ' -f1-3 /proc/loadavg)" <<'PY'
import json, os, statistics, sys, time
fedrl, peer, results, commit, load = sys.argv[1:6]
rows = [json.loads(l) for f in (fedrl, peer) for l in open(f) if l.startswith("{")]
stamp = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit,
         "loadavg_after": load, "profile": os.environ.get("CENTRAL_STEP_PROFILE", "release")}
with open(results, "a") as f:
    for r in rows:
        f.write(json.dumps({**stamp, **r}) + "\n")
step = {}
for r in rows:
    if "case" not in r:
        continue
    who = r.get("peer", "fedrl")
    step.setdefault((r["network"], who, r["case"]), []).append(r["seconds_per_step"])
print("== median seconds per step (batch of 256 units, one transition each)")
for net in sorted({k[0] for k in step}, key=len):
    print(f"-- {net}")
    base = statistics.median(step[(net, "fedrl", "plain")])
    summed = statistics.median(step[(net, "fedrl", "summed")])
    for (n, who, case), v in sorted(step.items()):
        if n != net:
            continue
        m = statistics.median(v)
        print(f"{who + ':' + case:28s} {m * 1e3:9.2f} ms   / fedrl plain = {m / base:5.2f}"
              f"   fedrl summed / this = {summed / m:5.2f}")
for r in rows:
    if "ratio_summed_over_plain" in r:
        print(f"{r['network']}: summed / plain (median of interleaved rounds) = "
              f"{r['ratio_summed_over_plain']:.2f} with noise, "
              f"{r['ratio_summed_no_noise_over_plain']:.2f} without; per-unit / plain = "
              f"{r['ratio_per_unit_over_plain']:.2f}; sensitivity {r['summed_sensitivity_grid_units']:.1f} "
              f"vs {r['per_unit_sensitivity_grid_units']:.1f} grid units")
print("peers ran after fedrl in their own process: their ratios carry the machine's load drift")
PY
