#!/usr/bin/env bash
# QUIC load benchmark of the aggregator: N clients upload d-float updates over loopback.
# Prints one JSON object per configuration (updates/s, MB/s ingested, rounds/s, aggregator peak
# RSS, CPU seconds per GB ingested, load average), each preceded by `uptime`: other work on the
# machine changes the wall-clock rates, not the CPU seconds per GB. Then a summary: for each d, the
# least-squares fit peak RSS = a + b x N (b is what one more connected client costs) next to what
# buffering every update would need, and peak RSS of a 300-round run (memory must not grow with
# the rounds either).
# Usage: bench/run_load.sh [extra args for every run, e.g. --mtu 1452]
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
cargo build --release -p fedrl-bench --bin load
LOAD="$CARGO_TARGET_DIR/release/load"
out="$(mktemp)"
trap 'rm -f "$out" "$out.one"' EXIT
one() {
  echo "# $*  $(uptime)"
  "$LOAD" "$@" >"$out.one"
  cat "$out.one"
  tr -d '\n' <"$out.one" >>"$out"
  echo >>"$out"
}
# d = 10^4: many small updates (N clients x 16 users each per round).
for n in 16 64 256 1024; do
  one --clients "$n" --dim 10000 --units-per-client 16 --rounds 8 "$@"
done
# d = 10^6: 4 MB per update.
for n in 16 64 256 1024; do
  one --clients "$n" --dim 1000000 --rounds 4 "$@"
done
# Many rounds: peak RSS must match the 8-round run of the same shape.
one --clients 64 --dim 10000 --units-per-client 16 --rounds 300 "$@"
python3 - "$out" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("\nsummary (peak RSS in MB)")
for d in sorted({r["dim"] for r in runs}):
    pts = [(r["clients"], r["aggregator_peak_rss_mb"], r["units_per_client"])
           for r in runs if r["dim"] == d and r["rounds"] <= 8]
    n = len(pts)
    mx = sum(p[0] for p in pts) / n
    my = sum(p[1] for p in pts) / n
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sum((p[0] - mx) ** 2 for p in pts)
    a = my - b * mx
    big = max(pts)
    naive = big[0] * big[2] * d * 4 / 1e6
    print(f"d={d:>8}: peak RSS ~ {a:.1f} + {b * 1000:.0f} KB x N; at N={big[0]}: {big[1]:.0f} MB "
          f"(buffering every update of a round: {naive:,.0f} MB)")
for r in runs:
    if r["rounds"] > 8:
        short = [s for s in runs if s["dim"] == r["dim"] and s["clients"] == r["clients"]
                 and s["rounds"] <= 8]
        ref = f"{short[0]['aggregator_peak_rss_mb']:.0f} MB in {short[0]['rounds']} rounds" if short else "-"
        print(f"{r['rounds']} rounds, d={r['dim']}, N={r['clients']}: peak RSS "
              f"{r['aggregator_peak_rss_mb']:.0f} MB ({ref})")
PY
