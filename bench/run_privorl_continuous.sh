#!/usr/bin/env bash
# PrivORL-n on continuous control (issue 56): runs scenarios/<STEM><SUFFIX>.toml (STEM
# pendulum-privorl or swingup-privorl) with the release build and appends one row per run to
# bench/results/privorl_continuous.jsonl: fidelity, utility (TD3+BC on the synthetic data
# against the same TD3+BC on as much held-out real data, normalised by random actions'
# return), the membership audit, epsilon and the wall clock of every phase.
#
#   cargo build --release -p fedrl-scenarios
#   bench/run_privorl_continuous.sh STEM [SUFFIX...]   # default suffix: "" (the epsilon-10 run)
#   nice -n 10 bench/run_privorl_continuous.sh pendulum-privorl "" -nonprivate
#   PRIVORL_SET="task.finetune_lr=1e-3" bench/run_privorl_continuous.sh pendulum-privorl ""
#
# Each run's noise comes from the OS (no `seed`): runs differ by the DP noise only (the
# datasets and the pre-trained synthesizer are cached and shared). The first run of a fresh
# data root also generates the datasets and pre-trains: its prepare phase is longer
# (`prepare_s` in the row: the wall clock before the deployment starts).
set -euo pipefail
cd "$(dirname "$0")/.."
stem=${1:?usage: bench/run_privorl_continuous.sh STEM [SUFFIX...]}
shift
suffixes=("$@")
if [ ${#suffixes[@]} -eq 0 ]; then suffixes=(""); fi
bin=${CARGO_TARGET_DIR:-target}/release/fedrl
out_root=${PRIVORL_OUT:-/tmp/privorl-continuous-bench}
mkdir -p "$out_root" bench/results
for s in "${suffixes[@]}"; do
  name="$stem$s"
  out="$out_root/$name-$(date +%s)"
  log="$out.log"
  t0=$(date +%s.%N)
  set_args=()
  for kv in ${PRIVORL_SET:-}; do set_args+=(--set "$kv"); done
  "$bin" run "scenarios/$name.toml" "${set_args[@]}" --out "$out" > "$log" 2>&1
  t1=$(date +%s.%N)
  python3 - "$out" "$log" "$name" "$t0" "$t1" "${PRIVORL_SET:-}" <<'PY' >> bench/results/privorl_continuous.jsonl
import json, re, subprocess, sys
out, log, name, t0, t1, overrides = sys.argv[1:]
r = json.load(open(f"{out}/report.json"))
op = json.load(open(f"{out}/operator/report.json"))
fe = r["final_evaluation"]
u = fe["utility"]
text = open(log).read()
ready = [float(x) for x in re.findall(r"privorl: \w+ dataset \S+ \(\S+\) ready \(([0-9.]+) s\)", text)]
pre = re.search(r"pre-training done in ([0-9.]+) s", text)
mia = op.get("model_audit", {}).get("membership", {})
row = {
    "bench": "privorl_continuous", "scenario": name,
    "cores": int(subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()),
    "epsilon": r["epsilon"], "delta": r["delta"], "rounds": r["rounds_completed"],
    "fidelity_marginal": fe["fidelity"]["marginal"],
    "fidelity_correlation": fe["fidelity"]["correlation"],
    "split": fe["fidelity"].get("split", "episodes"),
    "real_halves_marginal": (fe["fidelity"].get("real_halves") or {}).get("marginal"),
    "real_halves_correlation": (fe["fidelity"].get("real_halves") or {}).get("correlation"),
    "marginal_per_entry": fe["fidelity"].get("marginal_per_entry"),
    "set": overrides.split(),
    "learner": "td3bc",
    "synthetic_return": u["synthetic"]["return"],
    "synthetic_return_per_seed": u["synthetic"]["return_per_seed"],
    "real_return": (u["real_reference"] or {}).get("return"),
    "real_return_per_seed": (u["real_reference"] or {}).get("return_per_seed"),
    "random_return": u.get("random_return"),
    "utility_percent_of_real": u["percent_of_real"],
    "mia_tpr_at_10pct_fpr": mia.get("tpr_at_10pct_fpr"),
    "mia_tpr_at_1pct_fpr": mia.get("tpr_at_1pct_fpr"),
    "mia_auc": mia.get("auc"),
    "dataset_prepare_s": ready,
    "pretrain_s": float(pre.group(1)) if pre else None,
    "pretrain_cached": pre is None,
    "wall_s": float(t1) - float(t0),
    "run_s": r["wall_seconds"],
    "pretraining_phase_s": fe["phase_seconds"].get("pretraining"),
    "finetuning_phase_s": fe["phase_seconds"].get("finetuning"),
    "sampling_s": fe["phase_seconds"]["sampling"],
    "downstream_s": fe["phase_seconds"]["downstream"],
    "out": out,
}
print(json.dumps(row))
PY
  tail -1 bench/results/privorl_continuous.jsonl
done
