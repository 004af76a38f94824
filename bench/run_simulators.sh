#!/usr/bin/env bash
# Steps per second of fedrl-sim's environments against Gymnasium 1.4.0, measured in the same run
# on the same machine, and the ratios. Goal: >= 50x on CartPole-v1 and Acrobot-v1.
#
#   bench/run_simulators.sh [SECONDS_PER_ENV]      (default 2)
#
# Builds the `simulators` bench in release mode (CARGO_TARGET_DIR is honoured), installs
# Gymnasium into bench/peers/.venv if it is missing (requirements-gymnasium.txt), then prints a
# table. Both sides draw random actions beforehand and time only step() and the resets it
# triggers; Gymnasium is measured through gym.make (its wrappers: the fair peer, since fedrl-sim
# includes the time limit) and unwrapped (bare dynamics).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
secs="${1:-2}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

venv="$here/peers/.venv"
if ! "$venv/bin/python" -c 'import gymnasium' 2>/dev/null; then
  echo "installing Gymnasium into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet -r "$here/peers/requirements-gymnasium.txt"
fi

echo "building the simulators bench (release)..." >&2
(cd "$root" && cargo bench -p fedrl-bench --bench simulators --no-run --quiet)

echo "running fedrl-sim (${secs} s per environment)..." >&2
(cd "$root" && FEDRL_BENCH_SECONDS="$secs" cargo bench -p fedrl-bench --bench simulators --quiet -- --json) \
  | grep '^{' > "$out/rust.jsonl"
echo "running Gymnasium (${secs} s per environment and variant)..." >&2
"$venv/bin/python" "$here/peers/gymnasium_peer.py" --seconds "$secs" > "$out/gym.jsonl"

python3 - "$out/rust.jsonl" "$out/gym.jsonl" <<'PY'
import json, sys
rust = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
gym = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
peer = {(g["env"], g["variant"]): g["steps_per_second"] for g in gym}
version = gym[0]["version"] if gym else "?"
print(f"{'environment':<24} {'fedrl-sim steps/s':>18} {'gymnasium (make)':>17} {'ratio':>8} {'gymnasium (raw)':>16} {'ratio':>8}")
failed = []
for r in rust:
    env, rate = r["env"], r["steps_per_second"]
    mk, raw = peer.get((env, "make")), peer.get((env, "unwrapped"))
    if mk is None:
        print(f"{env:<24} {rate:>18,.0f} {'-':>17} {'-':>8} {'-':>16} {'-':>8}")
        continue
    ratio = rate / mk
    print(f"{env:<24} {rate:>18,.0f} {mk:>17,.0f} {ratio:>7.0f}x {raw:>16,.0f} {rate / raw:>7.0f}x")
    if env in ("CartPole-v1", "Acrobot-v1") and ratio < 50:
        failed.append(env)
print(f"(gymnasium {version}; ratio = fedrl-sim / gymnasium; goal >= 50x on CartPole-v1 and Acrobot-v1: "
      + ("met" if not failed else "NOT met for " + ", ".join(failed)) + ")")
PY
