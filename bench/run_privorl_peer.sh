#!/usr/bin/env bash
# PrivORL-n's diffusion synthesizer (issue 56, Performance): fedrl (`privorl_core`,
# `privorl_dp_step`) against its PyTorch peer (`bench/peers/synther_peer.py`: SynthER's
# residual-MLP denoiser, EDM loss, AdamW, EMA and stochastic Heun sampler), same machine, same
# script, interleaved: each repeat runs both sides at every thread count, alternating which
# side goes first; every side's figure is its best over the repeats (the machine is shared).
#
#   bench/peers/install.sh            # once: torch into bench/peers/.venv
#   cargo build --release -p fedrl-bench --bin privorl_core --bin privorl_dp_step
#   bench/run_privorl_peer.sh [REPEATS]          # default 3; PRIVORL_PEER_THREADS="1 2"
#
# First checks the peer computes fedrl's function (`privorl_core --dump`, `synther_peer.py
# --check`: network output, denoiser and losses under fedrl's initial weights). Then measures
# denoiser training steps/s at batch 128 and 256 (200 steps after 5 warm-up steps),
# sampled transitions/s (2,000 samples in one chunk of 2,000, after a warm-up call; 128 Heun
# steps, 255 network calls), and the DP fine-tuning step (256 units: exact per-example norms,
# clip, f64 sum, exact discrete Gaussian noise, AdamW + EMA) against the non-private step at the
# same batch; the peer's DP step is torch.func's vmap(grad) with Gaussian noise. Appends every
# side's JSON lines and one summary line (the ratios fedrl / torch, the DP / plain ratios, the
# 1-minute load averages seen) to bench/results/privorl_core.jsonl, and prints the summary.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-3}
threads_list=${PRIVORL_PEER_THREADS:-"1 2"}
bin=${CARGO_TARGET_DIR:-target}/release
py=${PRIVORL_PEER_PYTHON:-bench/peers/.venv/bin/python}
results=bench/results/privorl_core.jsonl
for b in "$bin/privorl_core" "$bin/privorl_dp_step" "$py"; do
  [ -x "$b" ] || { echo "missing $b (see the header of $0)" >&2; exit 1; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p bench/results

fedrl_side() {
  local t=$1
  RAYON_NUM_THREADS=$t "$bin/privorl_core" --batch 128 --samples 2000 --sample-chunk 2000 \
    --results "$tmp/fedrl.jsonl" > /dev/null
  RAYON_NUM_THREADS=$t "$bin/privorl_core" --batch 256 --samples 0 \
    --results "$tmp/fedrl.jsonl" > /dev/null
  RAYON_NUM_THREADS=$t "$bin/privorl_dp_step" --units 256 --rounds 2 --seconds 2 \
    --results "$tmp/fedrl_dp.jsonl" > /dev/null
}
torch_side() {
  local t=$1
  OMP_NUM_THREADS=$t "$py" bench/peers/synther_peer.py --threads "$t" --repeats 1 \
    --batches 128,256 --steps 200 --samples 2000 --sample-chunk 2000 --dp --dp-steps 5 \
    --results "$tmp/torch.jsonl" > /dev/null
}

# Same network: fedrl's initial weights in the peer give fedrl's outputs.
"$bin/privorl_core" --dump "$tmp/reference.json"
"$py" bench/peers/synther_peer.py --check "$tmp/reference.json" 2>/dev/null | tee -a "$results"

for r in $(seq 1 "$reps"); do
  for t in $threads_list; do
    echo "repeat $r/$reps, $t thread(s), load $(cut -d' ' -f1 /proc/loadavg)" >&2
    if [ $(( r % 2 )) -eq 1 ]; then fedrl_side "$t"; torch_side "$t"
    else torch_side "$t"; fedrl_side "$t"; fi
  done
done

cat "$tmp/fedrl.jsonl" "$tmp/fedrl_dp.jsonl" "$tmp/torch.jsonl" >> "$results"
python3 - "$tmp" "$reps" <<'EOF' | tee -a "$results"
import json, sys
tmp, reps = sys.argv[1], int(sys.argv[2])
rows = lambda f: [json.loads(l) for l in open(f"{tmp}/{f}")]
fedrl, dp, torch = rows("fedrl.jsonl"), rows("fedrl_dp.jsonl"), rows("torch.jsonl")
out = {"bench": "privorl_core_summary", "repeats": reps, "per_threads": {}}
loads = [r.get("load_avg_1m") for r in fedrl + torch if r.get("load_avg_1m") is not None]
out["load_avg_1m_min"], out["load_avg_1m_max"] = min(loads), max(loads)
for t in sorted({int(r["threads"]) for r in fedrl}):
    f = [r for r in fedrl if int(r["threads"]) == t]
    p = [r for r in torch if int(r["threads"]) == t]
    s = {"params_fedrl": f[0]["params"], "params_torch": p[0]["params"]}
    for b in (128, 256):
        fr = max(r["train_steps_per_s"] for r in f if r["batch"] == b)
        tr = max(r["train"][str(b)]["train_steps_per_s"] for r in p)
        s[f"train_b{b}"] = {"fedrl": fr, "torch": tr, "fedrl_over_torch": fr / tr}
    fs = max(r["sampled_transitions_per_s"] for r in f if r["sampled_transitions_per_s"])
    ts = max(r["sampled_transitions_per_s"] for r in p)
    s["sample"] = {"fedrl": fs, "torch": ts, "fedrl_over_torch": fs / ts}
    d = [r for r in dp if str(r["threads"]) == str(t)]
    ratio = [r["ratio_dp_over_plain"] for r in d if "ratio_dp_over_plain" in r]
    ratio_nn = [r["ratio_dp_no_noise_over_plain"] for r in d if "ratio_dp_no_noise_over_plain" in r]
    best = lambda case: min(r["seconds_per_step"] for r in d if r.get("case") == case)
    s["dp_step_b256"] = {
        "fedrl_dp_s": best("dp"), "fedrl_plain_s": best("plain"),
        "fedrl_dp_over_plain_best": best("dp") / best("plain"),
        "fedrl_dp_over_plain_per_run": ratio,
        "fedrl_dp_no_noise_over_plain_per_run": ratio_nn,
        "torch_dp_over_plain": min(r["dp"]["dp_over_plain_time"] for r in p),
        "torch_dp_steps_per_s": max(r["dp"]["dp_steps_per_s"] for r in p),
        "fedrl_dp_over_torch_dp_speed": (1 / best("dp")) / max(r["dp"]["dp_steps_per_s"] for r in p),
    }
    out["per_threads"][str(t)] = s
print(json.dumps(out))
EOF
