#!/usr/bin/env bash
# The exported policies, outside fedrl (issue 58, Build 6): short `fedrl run`s of every task kind
# that exports a policy for a Gymnasium environment produce the files, then
# bench/peers/torch_policy.py rebuilds each in PyTorch from the file alone (docs/policy-export.md),
# plays Gymnasium 1.4 from the same reset seeds as fedrl, and compares the returns with
# `fedrl eval --policy FILE --env ID --seed S` (fedrl's own simulators), or, for PriMORL's SAC
# policy (which `fedrl eval` does not play), with the run's own final evaluation in report.json.
# It also runs the README's PyTorch loader on the CartPole policy. The runs are short on purpose:
# a half-trained policy has returns that differ between episodes, a sharper check than 500 on
# every one.
#
# Cases (each a scenario of the repository with `--set` overrides):
#   cartpole-dppg   the default scenario (`fedrl run`), 6 rounds: Discrete, tanh MLP, best-evaluated
#   pendulum-dppg   the same on Pendulum-v1 with an observation offset/scale and an action range
#                   (Gaussian: the mean, mapped to [-2, 2], clipped)
#   cartpole-cql    cartpole-cql-dpsgd's non-private twin, 1,000 steps on 500 units: the Q-network
#                   (the private scenario exports the same file; at 500 units its noise keeps
#                   the policy at one action, 9.3 on every episode, a weak check of argmax)
#   pendulum-primorl pendulum-primorl, 300 random-policy units, 20 rounds, 2 SAC epochs
# Results: bench/results/policy_export.jsonl (rewritten), and a table on stdout.
# Usage: [FEDRL=path/to/fedrl] [OUT=dir] bench/run_policy_export.sh [EPISODES] [SEED]
#        (default 50 episodes, seed 0; FEDRL unset: a release build)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
episodes="${1:-50}"
seed="${2:-0}"
py="$root/bench/peers/.venv/bin/python"
[ -x "$py" ] || { echo "run bench/peers/install.sh first (torch, safetensors, gymnasium in .venv)"; exit 1; }
if [ -z "${FEDRL:-}" ]; then
  cargo build --release -q -p fedrl-scenarios
  FEDRL="$root/target/release/fedrl"
fi
out="${OUT:-$(mktemp -d -t fedrl-policy-export.XXXXXX)}"
mkdir -p "$out"
export FEDRL_DATA_DIR="$out/datasets"
results="$root/bench/results/policy_export.jsonl"
: > "$results"
uptime

run() { # name, then fedrl run arguments
  local name="$1"; shift
  if [ ! -f "$out/$name/report.json" ]; then
    rm -rf "${out:?}/$name"
    echo "== fedrl run: $name"
    "$FEDRL" run "$@" --out "$out/$name" > "$out/$name.log" 2>&1 || { tail -20 "$out/$name.log"; exit 1; }
    tail -n 3 "$out/$name.log"
  fi
}

run cartpole-dppg --set rounds=6
run pendulum-dppg --set name='"pendulum-dppg-export"' --set task.population='"Pendulum-v1"' \
  --set rounds=4 --set task.local.max_episode_steps=200 --set task.local.init_log_std=-0.5 \
  --set 'task.local.obs_offset=[0.0, 0.0, 0.0]' --set 'task.local.obs_scale=[1.0, 1.0, 8.0]' \
  --set 'task.local.action_low=[-2.0]' --set 'task.local.action_high=[2.0]'
run cartpole-cql scenarios/cartpole-cql-dpsgd-nonprivate.toml --set rounds=1000 --set users=500 \
  --set task.dataset.units=500 --set client_agents=2 \
  --set 'participation={kind="sampled", rate=0.2}' --set task.eval_every=250 \
  --set 'task.dataset.behaviour={kind="ppo_mixed", iterations=10, checkpoints=2, epsilon=0.2}'
run pendulum-primorl scenarios/pendulum-primorl.toml --set rounds=20 --set users=300 \
  --set task.dataset.units=300 --set task.dataset.public=30 \
  --set 'task.dataset.behaviour={kind="random"}' \
  --set 'participation={kind="sampled", rate=0.05}' --set noise_multiplier=1.0 \
  --set target_epsilon=50.0 --set task.eval_every=10 --set task.policy.epochs=2 \
  --set task.policy.updates_per_epoch=100 --set task.policy.rollout_batch=100 \
  --set task.policy.rollout_every=50 --set 'task.policy.hidden=[64, 64]' \
  --set task.policy.batch_size=64 --set task.policy.eval_episodes=5

status=0
peer() { "$py" bench/peers/torch_policy.py --fedrl "$FEDRL" --episodes "$episodes" --seed "$seed" \
  --json-out "$results" "$@" || status=1; }
peer --label cartpole-dppg --policy "$out/cartpole-dppg/policy.safetensors" --env CartPole-v1 --readme README.md
peer --label pendulum-dppg --policy "$out/pendulum-dppg/policy.safetensors" --env Pendulum-v1
peer --label cartpole-cql --policy "$out/cartpole-cql/q_network.safetensors" --env CartPole-v1
peer --label pendulum-primorl --policy "$out/pendulum-primorl/sac_policy.safetensors" --env Pendulum-v1 \
  --run-dir "$out/pendulum-primorl"

python3 - "$results" <<'PY'
import json, sys
print("| case | file | greedy rule | env | episodes | PyTorch + Gymnasium mean (min, max) | fedrl mean (min, max) | max abs diff | agree |")
print("| --- | --- | --- | --- | ---: | --- | --- | ---: | --- |")
rule = {"dppg-discrete": "argmax logits", "dppg-gaussian": "mean, range, clip",
        "qnet": "argmax Q", "sac": "center + half tanh(mean)"}
for line in open(sys.argv[1]):
    r = json.loads(line)
    t, f = r["torch"], r["fedrl"]
    mm = lambda d: f"{d['mean']:.4f}" + (f" ({d['min']:.2f}, {d['max']:.2f})" if "min" in d else "")
    src = "" if r["fedrl_source"] == "fedrl eval" else " (report.json)"
    agree = ("exact" if r["exact"] else "yes") if r["agree"] else "NO"
    if "readme_loader" in r:
        agree += "; README loader " + ("same" if r["readme_loader"]["agree"] else "DIFFERS")
    print(f"| {r['case']} | `{r['file']}` | {rule[r['kind']]} | {r['env']} | {r['episodes']} | {mm(t)} | {mm(f)}{src} | {r['max_abs_diff']:.2g} | {agree} |")
PY
echo "runs in $out"
exit $status
