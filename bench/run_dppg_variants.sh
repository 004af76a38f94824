#!/usr/bin/env bash
# Users (and environment steps) to a greedy return of 475 on 100 held-out CartPole users, per
# server-optimizer / cohort / local-update variant of DP-FedAvg PPO at user-level epsilon 1
# (delta 1e-5, fresh users: one Gaussian per user), 3 seeds each, in one process without the
# network (rl/examples/fedavg_cartpole.rs). Resumable: a (variant, seed) already in the results
# file is skipped; each result is appended as it arrives.
# Usage: bench/run_dppg_variants.sh [SEEDS...]   (default seeds 0 1 2)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
results=bench/results/dppg_variants.jsonl
mkdir -p bench/results
touch "$results"
cargo build --release -q -p fedrl-rl --example fedavg_cartpole
bin=target/release/examples/fedavg_cartpole
seeds=("$@")
[ ${#seeds[@]} -eq 0 ] && seeds=(0 1 2)
# name | arguments (every run: epsilon 1, 2 threads, evaluation every 2 rounds)
variants=(
  "sgd-lr1.5|--server-lr 1.5"
  "sgd-mom0.7-lr0.5|--server-lr 0.5 --server-momentum 0.7"
  "adam-lr0.01|--server-opt adam --server-lr 0.01 --server-momentum 0.9"
  "sgd-mom0.7-lr0.5-steps128|--server-lr 0.5 --server-momentum 0.7 --max-steps 128"
  "sgd-mom0.7-lr0.5-steps128-rawadv|--server-lr 0.5 --server-momentum 0.7 --max-steps 128 --norm-adv 0"
  "sgd-mom0.7-lr0.8-steps128-rawadv|--server-lr 0.8 --server-momentum 0.7 --max-steps 128 --norm-adv 0"
  "sgd-mom0.7-lr0.5-steps128-rawadv-cohort512|--server-lr 0.5 --server-momentum 0.7 --max-steps 128 --norm-adv 0 --cohort 512"
  "sgd-mom0.7-lr0.8-steps128-rawadv-cohort512|--server-lr 0.8 --server-momentum 0.7 --max-steps 128 --norm-adv 0 --cohort 512"
  "sgd-mom0.7-lr0.8-steps128-rawadv-cohort512-adaminit1|--server-lr 0.8 --server-momentum 0.7 --max-steps 128 --norm-adv 0 --cohort 512 --adam-init 1"
  "sgd-mom0.7-lr0.8-steps128-rawadv-cohort512-adaminit50|--server-lr 0.8 --server-momentum 0.7 --max-steps 128 --norm-adv 0 --cohort 512 --adam-init 50"
  "sgd-mom0.7-lr0.5-cohort2048|--server-lr 0.5 --server-momentum 0.7 --cohort 2048"
  "adam-lr0.01-decay30|--server-opt adam --server-lr 0.01 --server-momentum 0.9 --decay-rounds 30"
  "sgd-mom0.9-lr0.2|--server-lr 0.2 --server-momentum 0.9"
)
for v in "${variants[@]}"; do
  name="${v%%|*}"
  args="${v#*|}"
  for seed in "${seeds[@]}"; do
    if grep -q "\"variant\":\"$name\",\"seed\":$seed," "$results"; then
      continue
    fi
    # shellcheck disable=SC2086
    line="$("$bin" --epsilon 1 --rounds 80 --threads 2 --seed "$seed" $args | grep '^RESULT ' | cut -c8-)"
    echo "{\"variant\":\"$name\",\"seed\":$seed,\"args\":\"$args\",\"load\":$(cut -d' ' -f1 /proc/loadavg),${line:1}" | tee -a "$results"
  done
done
