#!/usr/bin/env bash
# Wall-clock of the expert-level DataRelease (seed 002) over loopback and over a UDP relay that
# adds DELAY_MS (default 20) to every datagram in each direction (bench/src/bin/udp_relay.rs: the
# kernel here has no netem). One aggregator and two client agents run as separate `fedrl`
# processes; the figure is the report's `selective.release.release_seconds` (the walk, from the
# moment every expert is hosted to the release's end), next to `agents_ready_seconds` (of it, the
# wait for the agents' first answers while they load their data and experts).
#
# Usage: bench/run_release_latency.sh [FEDRL_BINARY ...]
#   Each binary is measured in turn (default: this checkout's debug build), e.g. a build of the
#   commit before the DataRelease moved into the engine for "before". Prints one JSON line per
#   (binary, link, repetition). REPS (default 3), DELAY_MS, CHUNK (the release's k, default 1)
#   and TRAJECTORIES (T, default 8) are read from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
cargo build -q -p fedrl-bench --bin udp_relay
cargo build -q -p fedrl-scenarios --bin fedrl
RELAY="$CARGO_TARGET_DIR/debug/udp_relay"
BINS=("$@")
[ ${#BINS[@]} -eq 0 ] && BINS=("$CARGO_TARGET_DIR/debug/fedrl")
REPS="${REPS:-3}"
DELAY_MS="${DELAY_MS:-20}"
CHUNK="${CHUNK:-1}"
TRAJECTORIES="${TRAJECTORIES:-8}"
work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
export FEDRL_DATA_DIR="$work/datasets"

# The e2e expert scenario's population (48 uniform experts, 2 demonstrations each, episodes of
# at most 40 steps), T candidates. `chunk` is left out for binaries that predate it.
scenario() {
  local with_chunk=$1
  local extra=""
  [ "$with_chunk" = 1 ] && extra=", chunk = $CHUNK, answer_deadline_s = 60.0"
  cat <<EOF
name = "release-latency"
seed = 5
users = 48
client_agents = 2
participation = { kind = "sampled", rate = 0.5 }
round_deadline_s = 60.0
start_timeout_s = 300.0
clip_norm = 1.0
noise_multiplier = 1.0
delta = 0.01
target_epsilon = 1000.0
unit_kind = "expert"

[task]
kind = "offline_cql"
mode = "federated"
eval_every = 100
eval_episodes = 1
final_eval_episodes = 1
eval_max_steps = 10

[task.selective]
steps = 2
unstable_probability = 0.0
stable_batch = 8
schedule_seed = 2
release = { epsilon = 200.0, delta = 0.005, trajectories = $TRAJECTORIES, horizon = 40$extra }

[task.dataset]
env = "CartPole-v1"
units = 48
episodes_per_unit = 2
behaviour = { kind = "experts", population = "cartpole-b1", per_setting = 3, iterations = 2, hidden = [8], p_min = 0.5, max_steps = 40 }

[task.cql]
hidden = [16]
learning_rate = 1e-3
target_update_interval = 5
EOF
}

free_port() {
  python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# One release: aggregator on a free port, the agents direct or through the relay.
one() {
  local bin=$1 link=$2 rep=$3
  local d="$work/run-$RANDOM"
  mkdir -p "$d/state"
  # A binary that predates the chunked release does not know its fields.
  local with_chunk=0
  grep -qa 'answer_deadline_s' "$bin" && with_chunk=1
  scenario "$with_chunk" >"$d/s.toml"
  local tokens
  tokens=$("$bin" aggregator --scenario "$d/s.toml" --state-dir "$d/state" --issue-token a0 --issue-token a1)
  local port
  port=$(free_port)
  "$bin" aggregator --scenario "$d/s.toml" --state-dir "$d/state" --listen "127.0.0.1:$port" \
    >"$d/agg.log" 2>&1 &
  local agg=$!
  pids+=("$agg")
  local fp=""
  for _ in $(seq 1 600); do
    fp=$(grep -o 'certificate SHA-256: [0-9a-f]*' "$d/agg.log" | awk '{print $3}' || true)
    [ -n "$fp" ] && break
    sleep 0.1
  done
  local server="127.0.0.1:$port"
  local relay=""
  if [ "$link" = relay ]; then
    local rport
    rport=$(free_port)
    "$RELAY" --listen "127.0.0.1:$rport" --upstream "127.0.0.1:$port" --delay-ms "$DELAY_MS" \
      2>"$d/relay.log" &
    relay=$!
    pids+=("$relay")
    server="127.0.0.1:$rport"
  fi
  local i=0
  for tok in $tokens; do
    "$bin" client --server "$server" --server-cert-sha256 "$fp" --token "$tok" \
      --users "$((i * 24))..$(((i + 1) * 24))" --give-up-after 120 >"$d/c$i.log" 2>&1 &
    pids+=("$!")
    i=$((i + 1))
  done
  wait "$agg" || true
  [ -n "$relay" ] && kill "$relay" 2>/dev/null || true
  python3 - "$d/state/report.json" "$bin" "$link" "$rep" "$DELAY_MS" <<'PY'
import json, sys
path, binary, link, rep, delay = sys.argv[1:]
r = json.load(open(path))["selective"]["release"]
print(json.dumps({
    "binary": binary, "link": link, "delay_ms_each_way": float(delay) if link == "relay" else 0.0,
    "rep": int(rep), "chunk": r.get("chunk"), "walked": r["trajectories_walked"],
    "stable_transitions": r["stable_transitions"],
    "release_seconds": round(r["release_seconds"], 3),
    "agents_ready_seconds": round(r["agents_ready_seconds"], 3),
    "walk_after_ready_seconds": round(r["release_seconds"] - r["agents_ready_seconds"], 3),
}))
PY
}

# Generates and caches the dataset and experts once (not timed).
warm=0
grep -qa 'answer_deadline_s' "${BINS[0]}" && warm=1
scenario "$warm" >"$work/warm.toml"
"${BINS[0]}" run "$work/warm.toml" --out "$work/warm" >/dev/null
for bin in "${BINS[@]}"; do
  for link in loopback relay; do
    for rep in $(seq 1 "$REPS"); do
      one "$bin" "$link" "$rep"
    done
  done
done
