#!/usr/bin/env bash
# Per-example clipped gradients of the discrete CQL loss, Q-network 8-256-256-4, batch 256, CPU,
# 2 threads: fedrl (candle) next to plain PyTorch, Opacus hooks and Opacus ghost clipping, in one
# run, with the ratios the issue asks for.
# Usage: bench/run_per_example.sh [SECONDS_PER_CASE]
#   (peer: a python with torch and opacus, from bench/peers/install.sh: $PEER_PY, else
#    bench/peers/.venv-offline/bin/python, else bench/peers/.venv/bin/python)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
secs="${1:-3}"
export RAYON_NUM_THREADS=2
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
echo "== fedrl (candle, RAYON_NUM_THREADS=2)"
cargo bench -q -p fedrl-bench --bench per_example -- --batch 256 --seconds "$secs" --rounds 5 | tee "$out/fedrl.jsonl"
py="${PEER_PY:-}"
for cand in "$root/bench/peers/.venv-offline/bin/python" "$root/bench/peers/.venv/bin/python"; do
  [ -z "$py" ] && [ -x "$cand" ] && py="$cand"
done
if [ -x "$py" ] && "$py" -c "import torch, opacus" 2>/dev/null; then
  echo "== peers: PyTorch and Opacus (torch.set_num_threads(2))"
  "$py" bench/peers/opacus_peer.py --batch 256 --threads 2 --seconds "$secs" | tee "$out/peer.jsonl"
else
  echo "== peers skipped: no python with torch and opacus at $py"
  exit 0
fi
echo "== ratios (examples/s, same run)"
python3 - "$out/fedrl.jsonl" "$out/peer.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for f in sys.argv[1:] for l in open(f) if l.startswith("{")]
eps = {r.get("peer", "fedrl") + ":" + r["case"]: r["examples_per_s"] for r in rows if "case" in r}
f = eps["fedrl:clipped_sum"]
print(f"fedrl clipped_sum            {f:12.0f} examples/s")
for k in ["fedrl:plain", "pytorch:plain", "opacus-hooks:hooks", "opacus-ghost:ghost"]:
    print(f"{k:28s} {eps[k]:12.0f} examples/s   fedrl clipped_sum / this = {f / eps[k]:.2f}")
ratio = [r for r in rows if "ratio_plain_over_clipped_sum" in r][0]
print(f"fedrl clipped_sum time / plain time = {ratio['ratio_plain_over_clipped_sum']:.2f} "
      "(median of interleaved rounds; issue: within 2x)")
print("peers ran after fedrl in their own process: their ratios carry the machine's load drift")
PY
