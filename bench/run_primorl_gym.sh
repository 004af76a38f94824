#!/usr/bin/env bash
# PriMORL on HalfCheetah-v5 through the Gymnasium bridge (issue 57; seed 001 Table 6 reduced,
# scenarios/halfcheetah-primorl.toml): one `fedrl run` in release, its stderr timestamped to tell
# the phases apart (dataset generation through the bridge, model phase, policy phase in the
# aggregator, the deferred evaluations through the bridge), then one JSON line appended to
# bench/results/primorl_gym.jsonl with the wall-clock of each phase, epsilon, the final return
# and the return of uniformly random actions on the same evaluation seeds (for scale).
#
# Needs scripts/install-python-bridge.sh --extra (MuJoCo).
# Usage: [SCENARIO=scenarios/halfcheetah-primorl.toml] [SEED=0 (model, data order, policy)] [OUT=runs/primorl-gym/...] \
#        [FEDRL_BIN=path/to/fedrl (skip the build)] [EXTRA="--set k=v ..."] bench/run_primorl_gym.sh
# Datasets are cached in $FEDRL_DATA_DIR (default bench/results/datasets).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if [ -z "${FEDRL_BIN:-}" ]; then
  cargo build --release -q -p fedrl-scenarios
fi
fedrl="${FEDRL_BIN:-${CARGO_TARGET_DIR:-$root/target}/release/fedrl}"
scenario="${SCENARIO:-scenarios/halfcheetah-primorl.toml}"
name="$(basename "$scenario" .toml)"
seed="${SEED:-0}"
out="${OUT:-runs/primorl-gym/$name-s$seed}"
export FEDRL_DATA_DIR="${FEDRL_DATA_DIR:-$root/bench/results/datasets}"
results="$root/bench/results/primorl_gym.jsonl"
mkdir -p "$(dirname "$out")"
log="$out.log"
uptime
start=$(date +%s.%N)
# One line per stderr line: seconds since the start, then the line.
# shellcheck disable=SC2086
# The seed is the ensemble's initial weights, the trajectories' minibatch order and the policy
# phase's (as bench/run_primorl.sh); the DP noise stays unseeded (a private run).
"$fedrl" run "$scenario" --out "$out" --set task.model_seed="$seed" --set task.data_seed="$seed" \
  --set task.policy.seed="$seed" ${EXTRA:-} 2>&1 \
  | while IFS= read -r line; do
      printf '%.1f %s\n' "$(echo "$(date +%s.%N) - $start" | bc)" "$line"
    done | tee "$log"
end=$(date +%s.%N)
python3 - "$out" "$log" "$scenario" "$seed" "$start" "$end" "$results" <<'PY'
import json, subprocess, sys
out, log, scenario, seed, start, end, results = sys.argv[1:8]
report = json.load(open(f"{out}/report.json"))
fe = report["final_evaluation"]
# Phase boundaries from the timestamped log (seconds since the start).
marks = {}
for line in open(log):
    t, _, text = line.partition(" ")
    for key, needle in [
        ("data_done", "operator-only (exact counts, do not publish): dataset"),
        ("policy_start", "policy phase: SAC"),
        ("deferred_start", "policy evaluations in"),
        ("deferred_done", "final policy: return"),
    ]:
        if needle in text and key not in marks:
            marks[key] = float(t)
total = float(end) - float(start)
def span(a, b):
    return round(marks[b] - marks[a], 1) if a in marks and b in marks else None
# Random actions on the policy phase's evaluation seeds (3e9 + 10,000 x policy seed + k).
py = f"{__import__('os').getcwd()}/.venv-bridge/bin/python"
code = """
import gymnasium as gym, numpy as np, sys
env = gym.make("HalfCheetah-v5"); rets = []
base = 3_000_000_000 + 10_000 * int(sys.argv[1])
for k in range(10):
    env.reset(seed=base + k); rng = np.random.default_rng(k); R = 0.0; done = False
    while not done:
        _, r, te, tr, _ = env.step(rng.uniform(-1, 1, 6).astype(np.float32)); R += r; done = te or tr
    rets.append(R)
print(np.mean(rets), np.std(rets))
"""
policy_seed = int(seed)
r = subprocess.run([py, "-c", code, str(policy_seed)], capture_output=True, text=True, check=True)
rand_mean, rand_std = map(float, r.stdout.split())
row = {
    "scenario": __import__("os").path.basename(scenario)[:-len(".toml")],
    "seed": int(seed),
    "overrides": f"--set task.model_seed={seed} --set task.data_seed={seed} --set task.policy.seed={seed}",
    "epsilon": report.get("epsilon"),
    "delta": report.get("delta"),
    "rounds": report.get("rounds"),
    "selected_round": fe.get("selected_round"),
    "public_mse": fe.get("public_mse"),
    "deferred": fe.get("deferred"),
    "final_eval_return": fe.get("final_eval_return"),
    "final_eval_return_std": fe.get("final_eval_return_std"),
    "last5_mean_return": (lambda c: sum(c) / len(c) if c else None)(
        [e["eval_return"] for e in fe.get("policy_curve", [])[-5:] if e.get("eval_return") is not None]),
    "curve": [[e["epoch"], e["eval_return"]] for e in fe.get("policy_curve", [])],
    "random_return": rand_mean,
    "random_return_std": rand_std,
    "policy_error": fe.get("policy_error"),
    "final_eval_error": fe.get("final_eval_error"),
    "seconds": round(total, 1),
    "data_seconds": round(marks["data_done"], 1) if "data_done" in marks else None,
    "model_seconds": span("data_done", "policy_start"),
    "policy_seconds": span("policy_start", "deferred_start"),
    "deferred_eval_seconds": span("deferred_start", "deferred_done"),
}
with open(results, "a") as f:
    f.write(json.dumps(row) + "\n")
print(json.dumps(row, indent=1))
PY
