#!/usr/bin/env bash
# QUIC load benchmark of the aggregator: N clients upload d-float updates over loopback.
# Prints one JSON object per configuration (updates/s, MB/s ingested, rounds/s, aggregator peak
# RSS). Usage: bench/run_load.sh [extra args for every run]
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-net}"
cargo build --release -p fedrl-bench --bin load
LOAD="$CARGO_TARGET_DIR/release/load"
# d = 10^4: many small updates (256 clients x 16 users each per round).
"$LOAD" --clients 256 --dim 10000 --units-per-client 16 --rounds 8 "$@"
# d = 10^6 (4 MB per update): peak RSS must not grow with N.
for n in 16 64 256; do
  "$LOAD" --clients "$n" --dim 1000000 --rounds 4 "$@"
done
