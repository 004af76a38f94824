#!/usr/bin/env bash
# One central DP-SGD step with 256 sampled units (issue 55 §3), Q-network 8-256-256-4 and the
# ~1 M-parameter MLP 8-1024-1024-4, CPU, 2 threads: fedrl's summed path vs the per-unit path it
# replaced vs a plain non-private candle step (bench/src/bin/central_step.rs), then Opacus 1.6
# ghost clipping and plain PyTorch on the same networks (bench/peers/opacus_peer.py), ratios
# printed at the end. Every line is appended to bench/results/central_step.jsonl with the run's
# time, commit and load average.
# Usage: bench/run_central_step.sh [ROUNDS] [SECONDS_PER_CASE_AND_ROUND]
#   CENTRAL_STEP_CASES=plain,summed,... picks fedrl's cases (default: all of central_step's);
#   the peers run Opacus ghost clipping with noise multiplier 0 and 1 (its documented setting).
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
up_before="$(uptime)"
echo "== load before: $up_before"
echo "== fedrl (candle, RAYON_NUM_THREADS=2, $rounds interleaved rounds)"
cases=()
[ -n "${CENTRAL_STEP_CASES:-}" ] && cases=(--cases "$CENTRAL_STEP_CASES")
"$bin" --units 256 --rounds "$rounds" --seconds "$secs" --networks 256,1024 "${cases[@]}" \
  | tee "$out/fedrl.jsonl"
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
    "$py" bench/peers/opacus_peer.py --batch 256 --threads 2 --seconds "$secs" --hidden "$h" \
      --modes ghost --noise 1 --repeats "$rounds" | tee -a "$out/peer.jsonl"
  done
else
  echo "== peers skipped: no python with torch and opacus (bench/peers/install.sh)"
fi
up_after="$(uptime)"
echo "== load after: $up_after"
python3 - "$out/fedrl.jsonl" "$out/peer.jsonl" "$root/bench/results/central_step.jsonl" \
  "$(git rev-parse --short HEAD)" "$(cut -d' ' -f1-3 /proc/loadavg)" "$up_before" "$up_after" <<'PY'
import json, os, statistics, sys, time
fedrl, peer, results, commit, load, up_before, up_after = sys.argv[1:8]
rows = [json.loads(l) for f in (fedrl, peer) for l in open(f) if l.startswith("{")]
stamp = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit,
         "loadavg_after": load, "uptime_before": up_before.strip(), "uptime_after": up_after.strip(),
         "profile": os.environ.get("CENTRAL_STEP_PROFILE", "release")}
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
    summed = statistics.median(step.get((net, "fedrl", "summed"), [float("nan")]))
    for (n, who, case), v in sorted(step.items()):
        if n != net:
            continue
        m = statistics.median(v)
        print(f"{who + ':' + case:28s} {m * 1e3:9.2f} ms   / fedrl plain = {m / base:5.2f}"
              f"   fedrl summed / this = {summed / m:5.2f}")
for r in rows:
    ratios = {k[len("ratio_"):-len("_over_plain")]: v for k, v in r.items() if k.startswith("ratio_")}
    if ratios:
        print(f"{r['network']}: case / plain (median of interleaved rounds): "
              + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
              + f"; sensitivity {r['summed_sensitivity_grid_units']:.1f} "
              f"vs {r['per_unit_sensitivity_grid_units']:.1f} grid units")
    if "ns_per_coordinate" in r:
        print(f"{r['network']}: exact noise, {r['rayon_threads']} thread(s): "
              f"{r['ns_per_coordinate']:.1f} ns per coordinate (sigma {r['noise_sigma_grid_units']:.0f})")
print("peers ran after fedrl in their own process: their ratios carry the machine's load drift")
PY
