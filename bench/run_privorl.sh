#!/usr/bin/env bash
# PrivORL-n on CartPole (issue 56): runs scenarios/cartpole-privorl*.toml with the release build
# and appends one row per run to bench/results/privorl.jsonl: fidelity, utility (CQL on the
# synthetic data against the same CQL on as much held-out real data), epsilon and the wall
# clock of every phase.
#
#   cargo build --release -p fedrl-scenarios
#   bench/run_privorl.sh [RUNS] [SCENARIO_SUFFIX...]    # default: 1 run of "" -eps1 -nonprivate
#   PRIVORL_SET="task.finetune_lr=1e-3" bench/run_privorl.sh 3 "" -eps1   # with --set overrides
#
# Each run's noise comes from the OS (no `seed`): runs differ by the DP noise only (the
# datasets and the pre-trained synthesizer are cached and shared). The first run of a fresh
# data root also generates the datasets and pre-trains: its prepare phase is longer.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-1}
shift || true
suffixes=("$@")
if [ ${#suffixes[@]} -eq 0 ]; then suffixes=("" "-eps1" "-nonprivate"); fi
bin=${CARGO_TARGET_DIR:-target}/release/fedrl
out_root=${PRIVORL_OUT:-/tmp/privorl-bench}
mkdir -p "$out_root" bench/results
for r in $(seq 1 "$runs"); do
  for s in "${suffixes[@]}"; do
    name="cartpole-privorl$s"
    out="$out_root/$name-$(date +%s)"
    log="$out.log"
    t0=$(date +%s.%N)
    set_args=()
    for kv in ${PRIVORL_SET:-}; do set_args+=(--set "$kv"); done
    "$bin" run "scenarios/$name.toml" "${set_args[@]}" --out "$out" > "$log" 2>&1
    t1=$(date +%s.%N)
    python3 - "$out" "$log" "$name" "$t0" "$t1" "$r" "${PRIVORL_SET:-}" <<'EOF' >> bench/results/privorl.jsonl
import json, re, subprocess, sys
out, log, name, t0, t1, run, overrides = sys.argv[1:]
r = json.load(open(f"{out}/report.json"))
fe = r["final_evaluation"]
text = open(log).read()
pre = re.search(r"pre-training done in ([0-9.]+) s", text)
cpu = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
row = {
    "bench": "privorl", "scenario": name, "set": overrides.split(), "run": int(run),
    "cores": int(cpu),
    "epsilon": r["epsilon"], "delta": r["delta"],
    "rounds": r["rounds_completed"],
    "fidelity_marginal": fe["fidelity"]["marginal"],
    "fidelity_correlation": fe["fidelity"]["correlation"],
    "synthetic_return": fe["utility"]["synthetic"]["return"],
    "real_return": (fe["utility"]["real_reference"] or {}).get("return"),
    "percent_of_real": fe["utility"]["percent_of_real"],
    "wall_s": float(t1) - float(t0),
    "pretrain_s": float(pre.group(1)) if pre else None,
    "pretrain_cached": pre is None,
    "run_s": r["wall_seconds"],
    "finetune_apply_s": fe["finetune"]["seconds_applying"],
    "pretraining_phase_s": fe["phase_seconds"].get("pretraining"),
    "finetuning_phase_s": fe["phase_seconds"].get("finetuning"),
    "sampling_s": fe["phase_seconds"]["sampling"],
    "downstream_s": fe["phase_seconds"]["downstream"],
    "split": fe["fidelity"].get("split", "episodes"),
    "real_halves_marginal": (fe["fidelity"].get("real_halves") or {}).get("marginal"),
    "real_halves_correlation": (fe["fidelity"].get("real_halves") or {}).get("correlation"),
    "marginal_per_entry": fe["fidelity"].get("marginal_per_entry"),
    "snapped_entries": fe["fidelity"].get("snapped_entries"),
    "out": out,
}
try:
    op = json.load(open(f"{out}/operator/report.json"))
    def find(v):
        if isinstance(v, dict):
            if "membership" in v and isinstance(v["membership"], dict):
                return v["membership"]
            for x in v.values():
                f = find(x)
                if f: return f
        return None
    mem = find(op)
    if mem and "tpr_at_10pct_fpr" in mem:
        row["mia_tpr_at_10pct_fpr"] = mem["tpr_at_10pct_fpr"]
        row["mia_tpr_at_1pct_fpr"] = mem["tpr_at_1pct_fpr"]
except (OSError, ValueError):
    pass
print(json.dumps(row))
EOF
    tail -1 bench/results/privorl.jsonl
  done
done
