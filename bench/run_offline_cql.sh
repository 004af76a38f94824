#!/usr/bin/env bash
# Non-private discrete CQL, fedrl vs d3rlpy 2.8.1 (`DiscreteCQLConfig()` defaults on both sides:
# 256-256 ReLU Q-network, Adam lr 6.25e-5, batch 32, alpha 1, gamma 0.99, target every 8000
# steps), on the same Minari files written by `fedrl data generate` (PPO checkpoints with
# epsilon-greedy noise: mixed quality), 3 seeds per environment, greedy evaluation in the
# environment. Results are appended to bench/results/offline_cql.jsonl as they arrive; a rerun
# skips (system, env, seed) triples already there, so a stopped run resumes. The table at the end
# gives mean +- 95% interval (Student t, n - 1 degrees of freedom) of the return and the mean
# training wall-clock.
# Usage: [ENVS="CartPole-v1 Acrobot-v1"] bench/run_offline_cql.sh [STEPS] [EVAL_EPISODES]
#        (default 10000 steps, 100 episodes)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
steps="${1:-10000}"
episodes="${2:-100}"
py="$root/bench/peers/.venv-offline/bin/python"
[ -x "$py" ] || { echo "run bench/peers/install.sh first (the d3rlpy peer)"; exit 1; }
cargo build --release -q -p fedrl-scenarios
fedrl="$root/target/release/fedrl"
export FEDRL_DATA_DIR="${FEDRL_DATA_DIR:-$root/bench/results/datasets}"
results="$root/bench/results/offline_cql.jsonl"
touch "$results"
export RAYON_NUM_THREADS=2
uptime
for env in ${ENVS:-CartPole-v1 Acrobot-v1}; do
  # CartPole: the default ppo_mixed spec (checkpoints after 0, 20, 40, 60 PPO iterations, epsilon
  # 0.2). Acrobot: PPO learns it in under 20 iterations, so the default's checkpoints are the
  # untrained policy (500-step random episodes, 60% of the transitions) and three equally good
  # ones; with d3rlpy's defaults neither library learns from that mix in 50,000 steps (both -500,
  # rows kept in the results file). Acrobot uses the final policy with epsilon 0.3 instead
  # (returns -500 to -63, median -108).
  case "$env" in
    Acrobot-v1) gen=(--checkpoints 1 --epsilon 0.3) ;;
    *) gen=() ;;
  esac
  id="$("$fedrl" data generate --env "$env" "${gen[@]}" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
  for seed in 0 1 2; do
    for sys in fedrl d3rlpy; do
      if python3 - "$results" "$sys" "$id" "$seed" "$steps" <<'PY'
import json, sys
path, s, dataset, seed, steps = sys.argv[1:6]
for line in open(path):
    r = json.loads(line)
    if (r["system"], r["dataset"], str(r["seed"]), str(r["steps"])) == (s, dataset, seed, steps):
        sys.exit(0)
sys.exit(1)
PY
      then continue; fi
      echo "== $sys $env seed $seed"
      if [ "$sys" = fedrl ]; then
        line="$("$fedrl" cql "$id" --steps "$steps" --seed "$seed" --eval-episodes "$episodes" --json)"
      else
        line="$("$py" bench/peers/d3rlpy_cql.py --root "$FEDRL_DATA_DIR" --id "$id" --steps "$steps" --seed "$seed" --eval-episodes "$episodes")"
      fi
      python3 -c 'import json,sys; r=json.loads(sys.argv[1]); r.update(system=sys.argv[2], env=sys.argv[3], seed=int(sys.argv[4]), dataset=sys.argv[5]); print(json.dumps(r))' \
        "$line" "$sys" "$env" "$seed" "$id" >> "$results"
      tail -n 1 "$results"
    done
  done
done
python3 - "$results" <<'PY'
import json, statistics, sys
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"\n{'dataset':<38} {'steps':>6} {'system':<7} {'n':>2} {'return mean +- 95%':>20} {'train s':>8} {'wall s':>7}")
for key in sorted({(r["dataset"], r["steps"]) for r in rows}):
    for s in ("fedrl", "d3rlpy"):
        rs = [r for r in rows if (r["dataset"], r["steps"]) == key and r["system"] == s]
        if not rs:
            continue
        x = [r["return_mean"] for r in rs]
        m = statistics.mean(x)
        h = T95.get(len(x) - 1, 1.96) * statistics.stdev(x) / len(x) ** 0.5 if len(x) > 1 else float("nan")
        tr = statistics.mean(r["train_s"] for r in rs)
        wa = statistics.mean(r["wall_s"] for r in rs)
        print(f"{key[0]:<38} {key[1]:>6} {s:<7} {len(x):>2} {m:>10.1f} +- {h:<7.1f} {tr:>8.1f} {wa:>7.1f}")
PY
