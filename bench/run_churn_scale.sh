#!/usr/bin/env bash
# Churn at scale (issue 15): 32 `fedrl client` processes hosting 100,000 users against one
# `fedrl aggregator`, 200 rounds of `fresh` participation (400 users offered per round, quorum 250),
# with the churn model dropping 30% of the offered users' uploads, and the same run without churn.
# A round with dropped users closes at its 2 s deadline (the dropped never answer), so the churn run
# takes about 200 x 2 s; the churn-free one closes each round as soon as all 400 have answered.
# Reports, per run: rounds released and abandoned (rounds reaching quorum), the ledger's epsilon
# (the two must be identical: churn changes who contributes, never what a unit is charged), the
# wall time, and the aggregator's RSS over time (sampled every second; CSV beside the JSON).
# Results: bench/results/churn_scale.jsonl (one line per run, appended as each finishes) and
# bench/results/churn_scale-<variant>-rss.csv. Usage: bench/run_churn_scale.sh [variant...]
# (variants: churn30, nochurn; default both; a variant already in the results file is skipped, so
# an interrupted run resumes).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
# FEDRL=path/to/fedrl uses that binary instead of building the release one.
if [ -z "${FEDRL:-}" ]; then
  cargo build --release -p fedrl-scenarios
  FEDRL="$CARGO_TARGET_DIR/release/fedrl"
fi
RESULTS=bench/results/churn_scale.jsonl
mkdir -p bench/results
AGENTS=32
USERS=100000
variants=("$@")
[ "${#variants[@]}" -gt 0 ] || variants=(churn30 nochurn)

# Seconds since $1 (an $EPOCHREALTIME), to 0.1 s.
since() { awk -v now="$EPOCHREALTIME" -v t0="$1" 'BEGIN { printf "%.1f", now - t0 }'; }

run_variant() {
  local variant=$1 drop
  case "$variant" in
    churn30) drop=0.3 ;;
    nochurn) drop=0.0 ;;
    *) echo "unknown variant $variant" >&2; return 1 ;;
  esac
  if [ -f "$RESULTS" ] && grep -q "\"variant\": \"$variant\"" "$RESULTS"; then
    echo "# $variant: already in $RESULTS, skipped"
    return 0
  fi
  local dir
  dir="$(mktemp -d)"
  cat >"$dir/scenario.toml" <<TOML
name = "churn-scale-$variant"
rounds = 200
users = $USERS
participation = { kind = "fresh" }
cohort_size = 400
quorum = 250
round_deadline_s = 2.0
start_timeout_s = 120.0
clip_norm = 1.0
noise_multiplier = 1.0
delta = 1e-5
target_epsilon = 10.0
checkpoint_every = 20

[churn]
drop_before_upload = $drop

[task]
kind = "mean_estimation"
dim = 64
TOML
  local ids=()
  for i in $(seq 1 $AGENTS); do ids+=(--issue-token "agent-$i"); done
  mapfile -t tokens < <("$FEDRL" aggregator --scenario "$dir/scenario.toml" --state-dir "$dir/state" "${ids[@]}")
  "$FEDRL" aggregator --scenario "$dir/scenario.toml" --state-dir "$dir/state" \
    --listen 127.0.0.1:0 >"$dir/aggregator.log" 2>&1 &
  local agg=$!
  while [ ! -f "$dir/state/address.json" ]; do sleep 0.1; done
  local addr fp
  addr=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["addr"])' "$dir/state/address.json")
  fp=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["fingerprint"])' "$dir/state/address.json")
  local per=$((USERS / AGENTS)) pids=()
  for i in $(seq 0 $((AGENTS - 1))); do
    local lo=$((i * per)) hi=$(((i + 1) * per))
    [ "$i" -eq $((AGENTS - 1)) ] && hi=$USERS
    "$FEDRL" client --server "$addr" --server-cert-sha256 "$fp" --token "${tokens[$i]}" \
      --users "$lo..$hi" --churn-seed "$((1000 + i))" >"$dir/client-$i.log" 2>&1 &
    pids+=($!)
  done
  local csv="bench/results/churn_scale-$variant-rss.csv" t0
  t0=$EPOCHREALTIME
  echo "t_s,rss_mb,rounds_released" >"$csv"
  while kill -0 "$agg" 2>/dev/null; do
    local rss released
    rss=$(awk '/VmRSS/ {print $2 / 1024}' "/proc/$agg/status" 2>/dev/null) || rss=""
    released=$(grep -c '"released"' "$dir/state/metrics.jsonl" 2>/dev/null) || released=0
    [ -n "$rss" ] && echo "$(since "$t0"),$rss,$released" >>"$csv"
    sleep 1
  done
  local agg_status=0
  wait "$agg" || agg_status=$?
  local failed=0
  for p in "${pids[@]}"; do wait "$p" || failed=$((failed + 1)); done
  local wall
  wall=$(since "$t0")
  "$FEDRL" ledger "$dir/state" --json >"$dir/ledger.json"
  python3 - "$variant" "$dir" "$csv" "$wall" "$agg_status" "$failed" >>"$RESULTS" <<'PY'
import csv, json, sys
variant, d, csv_path, wall, agg_status, failed = sys.argv[1:]
report = json.load(open(f"{d}/state/report.json"))
ledger = json.load(open(f"{d}/ledger.json"))
rss = [float(r["rss_mb"]) for r in csv.DictReader(open(csv_path))]
line = {
    "variant": variant,
    "agents": 32,
    "users": 100000,
    "rounds_released": report["rounds_completed"],
    "rounds_abandoned": report["rounds_abandoned"],
    "epsilon": ledger["epsilon"],
    "delta": report["delta"],
    "wall_s": round(float(wall), 1),
    "aggregator_exit": int(agg_status),
    "clients_failed": int(failed),
    "rss_mb_first": round(rss[0], 1) if rss else None,
    "rss_mb_median": round(sorted(rss)[len(rss) // 2], 1) if rss else None,
    "rss_mb_peak": round(max(rss), 1) if rss else None,
    "rss_mb_last": round(rss[-1], 1) if rss else None,
}
print(json.dumps(line))
PY
  tail -1 "$RESULTS"
  rm -rf "$dir"
}

for v in "${variants[@]}"; do
  echo "# $v  $(uptime)"
  run_variant "$v"
done
