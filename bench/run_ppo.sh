#!/usr/bin/env bash
# PPO throughput and time-to-475 on CartPole-v1: fedrl's batched DPPG client step and the
# DP-FedAvg example (epsilon 1 and non-private), next to the CleanRL-style PyTorch peer.
# Usage: bench/run_ppo.sh   (peers from bench/peers/install.sh; skipped if torch is missing)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export RAYON_NUM_THREADS=1
echo "== fedrl: local_updates throughput"
cargo bench -p fedrl-bench --bench ppo -- --users 512 --threads 2
echo "== fedrl: the default job, \`fedrl run\` (CartPole-v1 DPPG, user-level epsilon 1, over QUIC)"
out="$(mktemp -d)"
cargo run --release -q -- run --out "$out/run" >/dev/null
grep -E '"(wall_seconds|final_eval_return|users|rounds_completed|epsilon)"' "$out/run/operator/report.json"  # users is an exact count: operator-only
rm -rf "$out"
echo "== fedrl: DP-FedAvg PPO, epsilon 1 (fresh users), time to eval >= 475"
cargo run --release -p fedrl-rl --example fedavg_cartpole -- \
  --epsilon 1 --cohort 1024 --rounds 80 --hidden 32,32 --clip 0.3 --server-lr 1.5 --threads 2
echo "== fedrl: non-private FedAvg PPO"
cargo run --release -p fedrl-rl --example fedavg_cartpole -- \
  --epsilon 0 --cohort 256 --rounds 80 --hidden 32,32 --threads 2
py="$root/bench/peers/.venv/bin/python"
if [ -x "$py" ] && "$py" -c "import torch, gymnasium" 2>/dev/null; then
  echo "== peer: CleanRL-style PyTorch PPO (non-private)"
  "$py" bench/peers/ppo_peer.py --threads 1
else
  echo "== peer skipped: run bench/peers/install.sh (needs torch and gymnasium==1.4.0)"
fi
