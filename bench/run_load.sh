#!/usr/bin/env bash
# QUIC load benchmark of the aggregator: N clients upload d-float updates over loopback.
# Prints one JSON object per configuration (updates/s, MB/s ingested, rounds/s, aggregator peak
# RSS, CPU seconds per GB ingested, load average), each preceded by `uptime`: other work on the
# machine changes the wall-clock rates, not the CPU seconds per GB.
# Usage: bench/run_load.sh [extra args for every run, e.g. --mtu 1452]
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
cargo build --release -p fedrl-bench --bin load
LOAD="$CARGO_TARGET_DIR/release/load"
# d = 10^4: many small updates (N clients x 16 users each per round); RSS sweep over N.
for n in 16 64 256; do
  echo "# d=1e4 N=$n  $(uptime)"
  "$LOAD" --clients "$n" --dim 10000 --units-per-client 16 --rounds 8 "$@"
done
# d = 10^6 (4 MB per update): peak RSS must not grow with N.
for n in 16 64 256; do
  echo "# d=1e6 N=$n  $(uptime)"
  "$LOAD" --clients "$n" --dim 1000000 --rounds 4 "$@"
done
