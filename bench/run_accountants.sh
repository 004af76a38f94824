#!/usr/bin/env bash
# PLD and RDP epsilon of z = 1.1, q = 0.004, T = 100 000 Poisson-sampled Gaussian rounds at
# delta = 1e-5: fedrl's accountants against dp_accounting 0.6.0, measured in the same run on the
# same machine, with the ratios and the epsilons side by side. Goal: >= 10x at equal accuracy.
#
#   bench/run_accountants.sh [REPEATS]      (default 5 for fedrl, 3 for dp_accounting)
#
# Builds the `accountants` bench in release mode (CARGO_TARGET_DIR is honoured) and installs
# dp_accounting into bench/peers/.venv if it is missing (requirements-dp_accounting.txt).
# "cold" is the first call in a fresh process; "best" the fastest of the repeats.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
repeats="${1:-}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

venv="$here/peers/.venv"
if ! "$venv/bin/python" -c 'import dp_accounting' 2>/dev/null; then
  echo "installing dp_accounting into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet -r "$here/peers/requirements-dp_accounting.txt"
fi

echo "building the accountants bench (release)..." >&2
(cd "$root" && cargo bench -p fedrl-bench --bench accountants --no-run --quiet)

echo "running fedrl..." >&2
(cd "$root" && FEDRL_BENCH_REPEATS="${repeats:-5}" cargo bench -p fedrl-bench --bench accountants --quiet -- --json) \
  | grep '^{' > "$out/rust.jsonl"
echo "running dp_accounting..." >&2
"$venv/bin/python" "$here/peers/dp_accounting_peer.py" --repeats "${repeats:-3}" > "$out/peer.jsonl"

python3 - "$out/rust.jsonl" "$out/peer.jsonl" <<'PY'
import json, sys
rust = {r["accountant"]: r for r in map(json.loads, open(sys.argv[1])) if r}
peer = {r["accountant"]: r for r in map(json.loads, open(sys.argv[2])) if r}
print(f"{'accountant':<10} {'fedrl eps':>12} {'dp_acc eps':>12} {'rel diff':>9} "
      f"{'fedrl cold':>11} {'dp_acc cold':>12} {'ratio':>7} {'fedrl best':>11} {'dp_acc best':>12} {'ratio':>7}")
ok = True
for name in ("pld", "rdp"):
    r, p = rust[name], peer[name]
    diff = abs(r["epsilon"] - p["epsilon"]) / p["epsilon"]
    cold, best = p["seconds_cold"] / r["seconds_cold"], p["seconds_min"] / r["seconds_min"]
    print(f"{name:<10} {r['epsilon']:>12.6f} {p['epsilon']:>12.6f} {diff:>9.1e} "
          f"{r['seconds_cold']*1e3:>9.1f}ms {p['seconds_cold']*1e3:>10.1f}ms {cold:>6.1f}x "
          f"{r['seconds_min']*1e3:>9.1f}ms {p['seconds_min']*1e3:>10.1f}ms {best:>6.1f}x")
    ok = ok and cold >= 10 and best >= 10
print("(z = 1.1, q = 0.004, T = 100000, delta = 1e-5; ratio = dp_accounting time / fedrl time; "
      "goal >= 10x: " + ("met" if ok else "NOT met") + ")")
PY
