#!/usr/bin/env bash
# PriMORL (seed 001) result table: each task's four variants (high privacy, low privacy, No
# Privacy, MOPO) run as whole `fedrl run` deployments, one per seed (the ensemble's initial
# weights, the trajectories' minibatch order and the policy phase's seed; the dataset is the
# same). One JSON line per finished run is appended to bench/results/primorl.jsonl as it arrives;
# a rerun skips (scenario, seed) pairs already there and resumes an interrupted run from its
# output directory (runs/primorl/...), so a stopped session loses nothing. The table at the end
# gives mean +- 95% interval (Student t, n - 1 degrees of freedom) of the final normalised
# return and the mean wall-clock of each phase.
#
# Usage: [TASKS="pendulum balance swingup"] [SEEDS="0 1 2 3 4"] \
#        [VARIANTS="primorl primorl-low primorl-nonprivate primorl-mopo"] [TIMEOUT=14400] \
#        [POLICY_EPOCHS=N (fewer SAC epochs than the scenario's; each is 1,000 updates)] \
#        [ROUNDS=N (another model-phase round budget than the scenario's)] \
#        [SAC_EPOCHS=N (then re-run the policy phase with N SAC epochs on each released
#         ensemble: target/release/primorl_policy, `--real` for MOPO, rows appended to
#         bench/results/primorl_policy.jsonl and skipped when already there)] \
#        [PROBE_TARGET_ENTROPY=X (with SAC_EPOCHS: also a policy phase at target entropy X on
#         the same ensemble and SAC seed, skipped when its row is there)] \
#        [RERUN_MISSING=1 (train again the recorded runs whose ensemble was deleted)] \
#        [FEDRL_BIN=path/to/fedrl PRIMORL_POLICY_BIN=path/to/primorl_policy (skip the builds)] \
#        bench/run_primorl.sh
# Datasets are cached in $FEDRL_DATA_DIR (default bench/results/datasets).
# Issue 14's balance table, one (variant, seed) at a time; several copies of the script with
# different VARIANTS or SEEDS can share the machine (the result files are appended line by line):
#   TASKS=balance POLICY_EPOCHS=1 SAC_EPOCHS=50 VARIANTS=primorl-mopo SEEDS=4 bench/run_primorl.sh
# then `python3 bench/primorl_table.py --task balance`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if [ -z "${FEDRL_BIN:-}" ]; then
  cargo build --release -q -p fedrl-scenarios
fi
fedrl="${FEDRL_BIN:-$root/target/release/fedrl}"
if [ -n "${SAC_EPOCHS:-}" ] && [ -z "${PRIMORL_POLICY_BIN:-}" ]; then
  cargo build --release -q -p fedrl-bench --bin primorl_policy
fi
policy_bin="${PRIMORL_POLICY_BIN:-$root/target/release/primorl_policy}"
policy_results="$root/bench/results/primorl_policy.jsonl"
export FEDRL_DATA_DIR="${FEDRL_DATA_DIR:-$root/bench/results/datasets}"
results="$root/bench/results/primorl.jsonl"
touch "$results"
uptime
for task in ${TASKS:-pendulum}; do
  for seed in ${SEEDS:-0 1 2 3 4}; do
    for variant in ${VARIANTS:-primorl primorl-low primorl-nonprivate primorl-mopo}; do
      name="$task-$variant"
      # A run counts as done for the same scenario, seed, clip norm, SAC epochs, target
      # normalisation and round budget (rows from before the last two were recorded had raw
      # targets and 5,000 rounds).
      clip="$(sed -n 's/^clip_norm = //p' "scenarios/$name.toml")"
      epochs="${POLICY_EPOCHS:-$(sed -n 's/^epochs = //p' "scenarios/$name.toml")}"
      budget="${ROUNDS:-$(sed -n 's/^rounds = //p' "scenarios/$name.toml")}"
      norm=false
      if grep -q '^normalize_targets = true' "scenarios/$name.toml"; then norm=true; fi
      if python3 - "$results" "$name" "$seed" "$clip" "$epochs" "$norm" "$budget" "scenarios/$name.toml" <<'PY'
import json, sys
path, name, seed, clip, epochs, norm, budget, scen = sys.argv[1:9]
# Rows without a round budget ran at 5,000 (every task's budget then).
default_budget = 5000
for line in open(path):
    r = json.loads(line)
    if (r["scenario"], str(r["seed"])) == (name, seed) and float(r["clip_norm"]) == float(clip) \
            and int(r["policy_epochs"]) == int(epochs) \
            and bool(r.get("normalize_targets", False)) == (norm == "true") \
            and int(r.get("round_budget", default_budget)) == int(budget):
        sys.exit(0)
sys.exit(1)
PY
      then model_done=true; else model_done=false; fi
      tag="$name-c$clip"
      if [ "$norm" = true ]; then tag="$tag-norm"; fi
      # The round budget names the directory unless it is 5,000 (pendulum's, and every task's
      # before balance and swing-up shipped 1,000), whose runs kept untagged directories.
      if [ "$budget" != 5000 ]; then tag="$tag-r$budget"; fi
      out="$root/runs/primorl/$tag-e$epochs-s$seed"
      # RERUN_MISSING: a recorded run whose released ensemble is no longer on disk trains a new
      # one (a new row; a new realisation of the noise and the sampling) for SAC_EPOCHS.
      if [ "$model_done" = true ] && [ -n "${RERUN_MISSING:-}" ] && [ ! -s "$out/ensemble.safetensors" ]; then
        model_done=false
      fi
      mkdir -p "$root/runs/primorl"
      # The seed goes into the model's and the policy phase's seeds; nothing else changes.
      scen="$root/runs/primorl/$tag-e$epochs-s$seed.toml"
      sed -e "s/^rounds = .*/rounds = $budget/" -e "s/^kind = \"primorl\"/kind = \"primorl\"\nmodel_seed = $seed\ndata_seed = $seed/" \
          -e "s/^updates_per_epoch = \(.*\)/updates_per_epoch = \1\nseed = $seed/" \
          -e "s/^epochs = \(.*\)/epochs = ${POLICY_EPOCHS:-\1}/" \
          "scenarios/$name.toml" > "$scen"
      if [ "$model_done" = false ]; then
        echo "== $name seed $seed ($(date -u +%H:%M:%S))"
        start=$(date +%s)
        if [ -s "$out/report.json" ] && python3 -c 'import json,sys; sys.exit(json.load(open(sys.argv[1])).get("outcome") != "finished")' "$out/report.json"; then
          echo "$out finished earlier; recording it"
          start=""
        elif [ -s "$out/scenario.toml" ]; then
          "$fedrl" run --out "$out" --resume --timeout "${TIMEOUT:-14400}" || true
        else
          rm -rf "$out"
          "$fedrl" run "$scen" --out "$out" --timeout "${TIMEOUT:-14400}" || true
        fi
        end=$(date +%s)
        secs=""
        if [ -n "$start" ]; then secs=$((end - start)); fi
        python3 - "$out/report.json" "$name" "$seed" "$secs" "$clip" "$norm" "$budget" \
            "$out/scenario.toml" >> "$results" <<'PY'
import json, sys, tomllib
path, name, seed, secs, clip, norm, budget, scen = sys.argv[1:9]
r = json.load(open(path))
pol = tomllib.load(open(scen, "rb"))["task"]["policy"]
fe = r.get("final_evaluation") or {}
curve = fe.get("policy_curve") or []
policy_s = curve[-1]["seconds"] if curve else None
wall = r.get("wall_seconds")
print(json.dumps({
    "scenario": name, "seed": int(seed), "clip_norm": float(clip),
    "normalize_targets": norm == "true", "round_budget": int(budget),
    "policy_epochs": len(curve),
    # Where the run's own policy phase branched its rollouts from (bench/primorl_table.py).
    "data_start_fraction": pol.get("data_start_fraction", 0.0),
    "public_start_fraction": pol.get("public_start_fraction", 0.0),
    "target_entropy": pol.get("target_entropy", -3.0),
    "epsilon": r.get("epsilon"), "delta": r.get("delta"),
    "rounds": r.get("rounds_completed"), "selected_round": fe.get("selected_round"),
    "public_mse": fe.get("public_mse"),
    "final_normalized_return": fe.get("final_normalized_return"),
    "final_eval_return": fe.get("final_eval_return"),
    "final_eval_return_std": fe.get("final_eval_return_std"),
    "policy_error": fe.get("policy_error"),
    "curve": [[e["epoch"], e["normalized_return"]] for e in curve],
    # No command time for a run recorded after it finished elsewhere.
    "command_seconds": int(secs) if secs else None, "wall_seconds": wall,
    "policy_seconds": policy_s,
    "model_seconds": (wall - policy_s) if (wall is not None and policy_s is not None) else None,
}))
PY
        tail -1 "$results" | cut -c1-300
      fi
      if [ -n "${SAC_EPOCHS:-}" ] && [ -s "$out/ensemble.safetensors" ]; then
        # The policy phase at the shipped scenario's settings (read from it, so a run whose
        # model phase began before a policy setting changed gets the current one), unless that
        # row is already there. Rows name the run relative to the repository, as
        # primorl_policy records its argument.
        run="runs/primorl/$(basename "$out")"
        touch "$policy_results"
        # "" is the scenario's target entropy; PROBE_TARGET_ENTROPY adds a second policy phase
        # on the same ensemble and SAC seed (a paired probe; bench/primorl_table.py leaves its
        # rows out of the table).
        for entropy in "" ${PROBE_TARGET_ENTROPY:-}; do
          starts="$(python3 - "$policy_results" "$run" "$SAC_EPOCHS" "$seed" "$scen" "$entropy" <<'PY'
import json, sys, tomllib
sys.path.insert(0, "bench")
from primorl_table import row_starts
path, run, epochs, seed, scen, entropy = sys.argv[1:7]
pol = tomllib.load(open(scen, "rb"))["task"]["policy"]
shipped = {"lambda": pol["lambda"], "rollout_length": pol["rollout_length"],
           "model_start_fraction": pol.get("model_start_fraction", 0.5),
           "target_entropy": float(entropy) if entropy else pol.get("target_entropy", -3.0)}
starts = (pol.get("data_start_fraction", 0.0), pol.get("public_start_fraction", 0.0))
for line in open(path):
    r = json.loads(line)
    if r["run"] == run and int(r["epochs"]) == int(epochs) and int(r["seed"]) == int(seed) \
            and all(r.get(k) == v for k, v in shipped.items()) \
            and not r.get("uncertainty_in_learned_units") and row_starts(r) == starts:
        sys.exit(0)
print(*starts)
PY
)" || true
          if [ -n "$starts" ]; then
            read -r data_starts public_starts <<< "$starts"
            flags=(--public-starts "$public_starts")
            if [ "$variant" = primorl-mopo ]; then
              flags+=(--real --data-start-fraction "$data_starts")
            fi
            if [ -n "$entropy" ]; then
              flags+=(--target-entropy "$entropy")
            fi
            echo "== $name seed $seed: policy phase, $SAC_EPOCHS SAC epochs${entropy:+, target entropy $entropy} ($(date -u +%H:%M:%S))"
            "$policy_bin" "$run" --epochs "$SAC_EPOCHS" --seed "$seed" \
                "${flags[@]}" --results "$policy_results" || true
          fi
        done
      fi
    done
  done
done
python3 - "$results" <<'PY'
import json, math, sys
from collections import defaultdict
rows = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    key = f'{r["scenario"]} C={r["clip_norm"]:g}'
    if r.get("normalize_targets"):
        key += " norm"
    if "round_budget" in r:
        key += f' T={r["round_budget"]}'
    # Runs with different SAC epoch counts are different experiments: never pool them.
    key += f' E={r.get("policy_epochs", len(r.get("curve") or []))}'
    rows[key].append(r)
# Student t 97.5% quantiles for n - 1 = 1..9 degrees of freedom.
T = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262]
print(f"{'scenario, clip norm, rounds, epochs':52} {'n':>2} {'epsilon':>8} {'normalised return':>22} {'last-5 mean':>11} {'model s':>8} {'policy s':>8}")
for name, rs in sorted(rows.items()):
    v = [r["final_normalized_return"] for r in rs if r["final_normalized_return"] is not None]
    if not v:
        print(f"{name:52} {len(rs):>2} no policy ({rs[-1].get('policy_error')})")
        continue
    m = sum(v) / len(v)
    half = float("nan")
    if len(v) > 1:
        sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
        half = T[min(len(v) - 2, len(T) - 1)] * sd / math.sqrt(len(v))
    eps = rs[-1]["epsilon"]
    eps = f"{eps:.2f}" if isinstance(eps, (int, float)) else str(eps)
    ms = [r["model_seconds"] for r in rs if r["model_seconds"] is not None]
    ps = [r["policy_seconds"] for r in rs if r["policy_seconds"] is not None]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    # The final epoch swings by +-200 on cart-pole balance; the mean of the last 5 epochs
    # (averaged over seeds) is the steadier figure.
    last5 = [mean([ret for _, ret in r["curve"][-5:]]) for r in rs if r.get("curve")]
    print(f"{name:52} {len(v):>2} {eps:>8} {m:10.1f} +- {half:8.1f} {mean(last5):11.1f} {mean(ms):8.0f} {mean(ps):8.0f}")
PY
