#!/usr/bin/env bash
# A short gymnasium:CartPole-v1 DPPG run (12 rounds of 512 users, 2 workers) with the bridge's
# workers keeping their environments for the run (task.gymnasium.reuse_envs = true, the default)
# and re-making them every round (false), twice each, alternating; one JSON line per run on
# stdout (aggregator wall clock, mean seconds per round after the first, final return: equal in
# both modes). bench/README.md, "MuJoCo DPPG through the bridge (issue 57)".
# Usage: bench/run_gym_reuse.sh > bench/results/gym_bridge_reuse.jsonl (after a release build)
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${CARGO_TARGET_DIR:-$root/target}/release/fedrl"
work="$(mktemp -d)"
cat > "$work/cp-bridge.toml" <<'TOML'
name = "cp-bridge-reuse"
seed = 3
rounds = 12
users = 100000
client_agents = 1
participation = { kind = "fresh" }
cohort_size = 512
quorum = 450
round_deadline_s = 600.0
start_timeout_s = 120.0
clip_norm = 0.8
noise_multiplier = 3.74
delta = 1e-5
target_epsilon = 1.0
unit_kind = "user"

[task]
kind = "dppg"
population = "gymnasium:CartPole-v1"
server_lr = 0.8
server_momentum = 0.7
eval_every = 12
eval_users = 20
final_eval_users = 20

[task.gymnasium]
obs_dim = 4
actions = 2
workers = 2

[task.local]
episodes_per_user = 1
max_episode_steps = 128
normalize_advantages = false
epochs = 4
minibatches = 2
lr = 2.5e-3
hidden = [32, 32]
threads = 2
TOML
for i in 1 2; do
for reuse in true false; do
  out=$work/reuse-$reuse-$i; rm -rf $out
  t0=$(date +%s.%N)
  nice -n 10 "$bin" run "$work/cp-bridge.toml" --set task.gymnasium.reuse_envs=$reuse --out $out > $out.log 2>&1
  rc=$?
  t1=$(date +%s.%N)
  python3 - "$out" "$reuse" "$i" "$t0" "$t1" "$rc" "$(cut -d' ' -f1 /proc/loadavg)" <<'PY'
import json, sys
out, reuse, i, t0, t1, rc, load = sys.argv[1:]
r = json.load(open(out + "/report.json"))
rows = [json.loads(l) for l in open(out + "/metrics.jsonl")]
ts = [x["t_s"] for x in rows if x.get("status") == "released"]
print(json.dumps({"reuse_envs": reuse == "true", "run": int(i), "rc": int(rc), "aggregator_wall_s": r.get("wall_seconds"),
  "shell_s": round(float(t1) - float(t0), 2), "first_release_t_s": ts[0], "last_release_t_s": ts[-1],
  "rounds": len(ts), "mean_round_s_after_first": (ts[-1] - ts[0]) / (len(ts) - 1),
  "final_eval_return": r["final_evaluation"].get("final_eval_return"), "loadavg_1m": float(load)}), flush=True)
PY
done
done
