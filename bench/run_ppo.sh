#!/usr/bin/env bash
# PPO throughput and time-to-475 on CartPole-v1: fedrl's batched DPPG client step and the
# DP-FedAvg example (epsilon 1 and non-private), next to the CleanRL-style PyTorch peer and the
# Stable-Baselines3 PPO peer with the RL Zoo's CartPole-v1 settings (3 seeds, appended to
# bench/results/sb3_ppo.jsonl).
# Usage: bench/run_ppo.sh [--headline]   (peers from bench/peers/install.sh; skipped if torch or
# SB3 is missing). --headline runs only issue 16's ratio: the default `fedrl run` and its
# non-private twin, three times each (whole process, timed by the shell; appended to
# bench/results/default_run.jsonl), then the SB3 peer three times.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export RAYON_NUM_THREADS=1
py="$root/bench/peers/.venv/bin/python"
headline=0
[ "${1:-}" = "--headline" ] && headline=1
cargo build --release -q -p fedrl-scenarios
# The default job and its non-private twin, whole process as the shell sees it.
run_default() { # label, extra arguments
  local label="$1"; shift
  for run in 1 2 3; do
    out="$(mktemp -d)"
    load="$(cut -d' ' -f1 /proc/loadavg)"
    t0="$(date +%s.%N)"
    rc=0
    target/release/fedrl run "$@" --out "$out/run" >/dev/null 2>&1 || rc=$?
    t1="$(date +%s.%N)"
    python3 - "$out/run" "$label" "$run" "$rc" "$t0" "$t1" "$load" <<'PY' | tee -a bench/results/default_run.jsonl
import json, sys, datetime
out, label, run, rc, t0, t1, load = sys.argv[1:]
try:
    rep = json.load(open(out + "/operator/report.json"))  # operator-only: timings; only public fields are printed besides
except OSError:
    rep = {}
print(json.dumps({"command": label, "run": int(run), "rc": int(rc),
                  "shell_seconds": round(float(t1) - float(t0), 2),
                  "final_eval_return": (rep.get("final_evaluation") or {}).get("final_eval_return"), "rounds": rep.get("rounds"),
                  "epsilon": rep.get("epsilon"), "timings": rep.get("timings"),
                  "loadavg_1m": float(load),
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}))
PY
    rm -rf "$out"
  done
}
mkdir -p bench/results
echo "== fedrl: the default job, \`fedrl run\` (CartPole-v1 DPPG, user-level epsilon 1, over QUIC), 3 runs"
uptime
run_default "fedrl run (default scenario, release build)"
echo "== fedrl: its non-private twin, 3 runs"
run_default "fedrl run scenarios/cartpole-dppg-nonprivate.toml (release build)" scenarios/cartpole-dppg-nonprivate.toml
if [ "$headline" = 0 ]; then
echo "== fedrl: local_updates throughput"
cargo bench -p fedrl-bench --bench ppo -- --users 512 --threads 2
echo "== fedrl: DP-FedAvg PPO, epsilon 1 (fresh users), time to eval >= 475"
cargo run --release -p fedrl-rl --example fedavg_cartpole -- \
  --epsilon 1 --cohort 1024 --rounds 80 --hidden 32,32 --clip 0.3 --server-lr 0.5 --server-momentum 0.7 \
  --max-steps 128 --threads 2
echo "== fedrl: non-private FedAvg PPO"
cargo run --release -p fedrl-rl --example fedavg_cartpole -- \
  --epsilon 0 --cohort 256 --rounds 80 --hidden 32,32 --threads 2
if [ -x "$py" ] && "$py" -c "import torch, gymnasium" 2>/dev/null; then
  echo "== peer: CleanRL-style PyTorch PPO (non-private)"
  "$py" bench/peers/ppo_peer.py --threads 1
else
  echo "== peer skipped: run bench/peers/install.sh (needs torch and gymnasium==1.4.0)"
fi
fi
# sb3-peer-begin
if [ -x "$py" ] && "$py" -c "import stable_baselines3, torch, gymnasium" 2>/dev/null; then
  echo "== peer: Stable-Baselines3 PPO, RL Zoo CartPole-v1 settings, one learn(100_000), 2 threads"
  mkdir -p bench/results
  results=bench/results/sb3_ppo.jsonl
  runs="$(mktemp)"
  uptime
  for seed in 0 1 2; do
    t0="$(date +%s.%N)"
    line="$("$py" bench/peers/sb3_ppo.py --seed "$seed" --threads 2)"
    t1="$(date +%s.%N)"
    # Whole process as the shell saw it (interpreter start-up and imports included).
    secs="$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')"
    line="$("$py" -c 'import json, sys; d = json.loads(sys.argv[1]); d.update(shell_process_seconds=float(sys.argv[2]), date=sys.argv[3], loadavg_1m=float(sys.argv[4])); print(json.dumps(d))' \
      "$line" "$secs" "$(date -u +%FT%TZ)" "$(cut -d' ' -f1 /proc/loadavg)")"
    echo "$line" | tee -a "$results" >>"$runs"
  done
  # A run that missed the target counts as slower than any other (median "not reached").
  "$py" - "$runs" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def median(key):
    vals = sorted(float("inf") if r.get(key) is None else r[key] for r in rows)
    m = vals[len(vals) // 2]
    return "not reached" if m == float("inf") else m
print(f"median of {len(rows)} seeds: " + ", ".join(
    f"{k} {median(k)}" for k in ("process_seconds_to_target", "train_seconds_to_target",
                                 "shell_process_seconds", "steps_to_target")))
PY
  rm -f "$runs"
else
  echo "== SB3 peer skipped: run bench/peers/install.sh (needs stable-baselines3, torch, gymnasium==1.4.0)"
fi
# sb3-peer-end
