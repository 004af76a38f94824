#!/usr/bin/env bash
# Soak of the QUIC aggregator: one long `load` run (default 2,000 rounds of 64 clients x 16 users,
# d = 10^4), sampling every SECONDS the resident set (VmRSS, kB) and open file descriptors of the
# aggregator (the `load --serve` child) and of the client process. Memory and descriptors must
# level off, not grow with the rounds. Prints `uptime` first (other work on the machine changes
# the rates), the samples as `t_s agg_rss_kb agg_fds clients_rss_kb clients_fds`, the load
# generator's JSON, then the first and last samples and the peak.
# Usage: bench/run_soak.sh [ROUNDS [SECONDS [extra load args]]]
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
rounds="${1:-2000}"
every="${2:-5}"
shift $(( $# > 2 ? 2 : $# ))
cargo build --release -p fedrl-bench --bin load
LOAD="$CARGO_TARGET_DIR/release/load"
out="$(mktemp)"
samples="$(mktemp)"
trap 'rm -f "$out" "$samples"' EXIT
echo "# $(uptime)"
"$LOAD" --clients 64 --dim 10000 --units-per-client 16 --rounds "$rounds" "$@" >"$out" &
lp=$!
t0=$(date +%s)
# One process's resident set (kB) and open descriptors.
probe() {
  local rss fds
  rss=$(awk '/^VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0)
  fds=$(ls "/proc/$1/fd" 2>/dev/null | wc -l)
  echo "${rss:-0} $fds"
}
while kill -0 "$lp" 2>/dev/null; do
  agg=$(pgrep -P "$lp" | head -n 1 || true)
  if [ -n "$agg" ]; then
    echo "$(( $(date +%s) - t0 )) $(probe "$agg") $(probe "$lp")" | tee -a "$samples"
  fi
  sleep "$every"
done
wait "$lp"
cat "$out"
python3 - "$samples" <<'PY'
import sys
rows = [list(map(int, l.split())) for l in open(sys.argv[1]) if l.strip()]
if not rows:
    sys.exit("no samples")
first, last = rows[0], rows[-1]
print(f"\nsamples: {len(rows)}; aggregator RSS {first[1] / 1024:.1f} MB at {first[0]} s, "
      f"{last[1] / 1024:.1f} MB at {last[0]} s, peak {max(r[1] for r in rows) / 1024:.1f} MB; "
      f"aggregator fds {first[2]} -> {last[2]} (max {max(r[2] for r in rows)}); "
      f"clients RSS {first[3] / 1024:.1f} -> {last[3] / 1024:.1f} MB, fds {first[4]} -> {last[4]}")
half = rows[len(rows) // 2:]
if len(half) >= 2:
    slope = (half[-1][1] - half[0][1]) / max(1, half[-1][0] - half[0][0])
    print(f"aggregator RSS slope over the second half: {slope:+.1f} kB/s")
PY
