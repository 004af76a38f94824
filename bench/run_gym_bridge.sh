#!/usr/bin/env bash
# Overhead of the Gymnasium bridge (issue 57): users' environment steps per second through the
# bridge (Rust lockstep over `python -m fedrl_bridge.worker` processes, batched STEP/RESET
# messages) against Gymnasium's own vector environments on the same machine in the same run:
# AsyncVectorEnv (one process per environment) and SyncVectorEnv (all in one process, no IPC:
# the ceiling of one worker). Random actions; only the stepping (and the resets it triggers) is
# timed. Appends one JSON line per measurement to bench/results/gym_bridge.jsonl.
#
#   scripts/install-python-bridge.sh [--extra]     once (--extra: LunarLander, HalfCheetah)
#   bench/run_gym_bridge.sh [LOCKSTEP_STEPS]       (default 600 at batch 64; 4x at batch 1,
#                                                   a quarter at batch 512)
#
# Batches 1, 64 and 512; bridge with 1 and 2 workers (this machine has 2 cores); AsyncVectorEnv
# up to 64 processes (512 Python processes do not fit a 2-core machine usefully).
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-600}"
log=$(mktemp)
echo "workers' and peers' stderr (MuJoCo prints a warning per environment): $log" >&2
py=.venv-bridge/bin/python
[ -x "$py" ] || { echo "run scripts/install-python-bridge.sh first" >&2; exit 1; }
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
# The dev profile builds fedrl-sim with opt-level 3 (Cargo.toml), like the release profile.
cargo build --quiet -p fedrl-sim --example gym_bridge_bench
bench="$CARGO_TARGET_DIR/debug/examples/gym_bridge_bench"
out=bench/results/gym_bridge.jsonl
meta() {
    printf '{"utc": "%s", "commit": "%s", "loadavg": "%s"}' "$(date -u +%FT%TZ)" \
        "$(git rev-parse --short HEAD)" "$(cut -d' ' -f1-3 /proc/loadavg)"
}
record() {
    # Merge the run's JSON with the metadata, one line.
    "$py" -c 'import json,sys; a=json.loads(sys.argv[1]); a.update(json.loads(sys.argv[2])); print(json.dumps(a, sort_keys=True))' \
        "$1" "$(meta)" | tee -a "$out"
}
envs=(CartPole-v1)
"$py" -c 'import Box2D' 2>/dev/null && envs+=(LunarLander-v3)
"$py" -c 'import mujoco' 2>/dev/null && envs+=(HalfCheetah-v5)
for env in "${envs[@]}"; do
    for batch in 1 64 512; do
        n=$steps
        [ "$batch" -le 1 ] && n=$((steps * 4))
        [ "$batch" -ge 512 ] && n=$((steps / 4))
        for workers in 1 2; do
            [ "$workers" -gt "$batch" ] && continue
            record "$("$bench" "$env" "$batch" "$workers" "$n" 2>>"$log")"
        done
        record "$("$py" bench/peers/gym_vector_peer.py "$env" "$batch" "$n" sync 2>>"$log")"
        if [ "$batch" -le 64 ]; then
            record "$("$py" bench/peers/gym_vector_peer.py "$env" "$batch" "$n" async 2>>"$log")"
        fi
    done
done
