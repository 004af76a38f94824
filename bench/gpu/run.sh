#!/usr/bin/env bash
# GPU smoke test and figures of a `--features fedrl-scenarios/cuda` build of fedrl, built
# elsewhere by bench/gpu/build_cuda.sh into .gpu/ (no CUDA toolkit needed here). Run from the
# repository root on the GPU machine, with .gpu/ beside it:   bash bench/gpu/run.sh
# (`bash bench/gpu/run.sh --hidden-sweep`: only hidden [64, 64] and [128, 128], or $HIDDEN).
#
# Built with: nvcc 13.0.88 (pip wheels), CUDA_COMPUTE_CAP=90 (kernels: PTX ISA 9.0, .target sm_90a;
# candle's MoE/GGUF kernels as sm_90a cubins), cudarc 0.19.10 `dynamic-linking` against CUDA 13.0.
# The binaries have DT_NEEDED entries (loaded by ld.so at start-up, even for --help / --device cpu):
#   libcuda.so.1 (driver)  libcublas.so.13 (-> libcublasLt.so.13 via its RUNPATH $ORIGIN)
#   libcurand.so.10  libcudart.so.13  libstdc++.so.6  libgcc_s.so.1  libm/libc (GLIBC <= 2.34)
# Step failures do not stop the script (set +e); everything goes to $OUT/log.txt.
set +e
cd "$(dirname "$0")/../.." || exit 1
REPO=$PWD
TORCH_VENV=${TORCH_VENV:-/opt/torch/.venv}
OUT=${OUT:-/tmp/fedrl-gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s.%N)
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }'; }
step() { echo; echo "=== [$(since "$T0")s] $*"; }
timed() { # timed LABEL CMD... : runs CMD, then prints its exit status and wall time
  local label=$1; shift
  local s rc
  s=$(date +%s.%N); "$@"; rc=$?
  echo ">>> $label: rc=$rc wall=$(since "$s")s"
  return $rc
}
unset RUST_BACKTRACE
export RUST_LOG=${RUST_LOG:-warn}

step "machine"
uname -a; nproc; ldd --version 2>&1 | head -1; echo "OUT=$OUT"

step "unpack binaries (xz; python lzma as fallback)"
BIN=${TMPDIR:-/tmp}/fedrl-gpu-bin
mkdir -p "$BIN"
PY=$TORCH_VENV/bin/python; [ -x "$PY" ] || PY=$(command -v python3)
for f in .gpu/*.xz; do
  b=$BIN/$(basename "$f" .xz)
  if command -v xz >/dev/null; then xz -dc "$f" > "$b"; else "$PY" -c 'import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$f" "$b"; fi
  chmod +x "$b"; ls -la "$b"
done
FEDRL=$BIN/fedrl
EXAMPLE=$BIN/fedavg_cartpole

step "locate CUDA libraries"
LDP=
add_dir() { local d; d=$(dirname "$1"); case ":$LDP:" in *":$d:"*) ;; *) LDP=${LDP:+$LDP:}$d;; esac; }
# The driver: ld.so's cache first, then the usual places (never a stubs/ or compat/ copy).
DRV=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}')
[ -z "$DRV" ] && DRV=$(timeout 60 find /usr/lib/x86_64-linux-gnu /usr/local/nvidia /usr/lib64 /usr/lib /run/nvidia -name 'libcuda.so.1' 2>/dev/null | grep -v -e /stubs/ -e /compat/ | head -1)
# cuBLAS/cuRAND/cudart/NVRTC (CUDA 13): the torch venv's nvidia wheels first.
LIBS="libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libcudart.so.13 libnvrtc.so.13"
declare -A FOUND
for lib in $LIBS; do FOUND[$lib]=$(find "$TORCH_VENV" -name "$lib" 2>/dev/null | grep -v /stubs/ | head -1); done
# Anything still missing (the driver included): one pass over the whole file system.
MISSING=""; [ -z "$DRV" ] && MISSING="libcuda.so.1"
for lib in $LIBS; do [ -z "${FOUND[$lib]}" ] && MISSING="$MISSING $lib"; done
if [ -n "$MISSING" ]; then
  echo "searching / for:$MISSING"
  ALL=$(timeout 120 find / \( -path /proc -o -path /sys \) -prune -o \( -name 'libcuda.so.1' -o -name 'libcublas*.so.13' -o -name 'libcurand.so.10' -o -name 'libcudart.so.13' -o -name 'libnvrtc.so.13' \) -print 2>/dev/null | grep -v -e /stubs/ -e /compat/)
  [ -z "$DRV" ] && DRV=$(echo "$ALL" | grep '/libcuda\.so\.1$' | head -1)
  for lib in $LIBS; do [ -z "${FOUND[$lib]}" ] && FOUND[$lib]=$(echo "$ALL" | grep "/$lib\$" | head -1); done
fi
echo "libcuda.so.1: ${DRV:-NOT FOUND}"; [ -n "$DRV" ] && add_dir "$DRV"
for lib in $LIBS; do echo "$lib: ${FOUND[$lib]:-NOT FOUND}"; [ -n "${FOUND[$lib]}" ] && add_dir "${FOUND[$lib]}"; done
echo "every libcublas.so* / libcuda.so* on this machine (for the record):"
timeout 30 find / \( -path /proc -o -path /sys \) -prune -o \( -name 'libcublas.so*' -o -name 'libcuda.so*' \) -print 2>/dev/null | head -20
LD_LIBRARY_PATH=$LDP${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
for b in "$FEDRL" "$EXAMPLE"; do [ -x "$b" ] && { echo "ldd $(basename "$b"):"; ldd "$b"; }; done

step "nvidia-smi"
timeout 30 nvidia-smi
timeout 30 nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.used,memory.total --format=csv

if [ "${1:-}" = "--hidden-sweep" ]; then
  # Only the model-size sweep: bench/gpu/h256.toml with hidden [H, H], cuda:0 against cpu.
  for h in ${HIDDEN:-64 128}; do
    sed "s/^hidden = .*/hidden = [$h, $h]/; s/^name = .*/name = \"cartpole-dppg-h$h\"/" bench/gpu/h256.toml > "$OUT/h$h.toml"
    for d in cuda:0 cpu; do
      step "hidden [$h, $h], cohort 1024, 3 rounds on $d"
      rm -rf "$OUT/h$h-${d%%:*}"
      timed "h$h run $d" timeout 150 "$FEDRL" run "$OUT/h$h.toml" --out "$OUT/h$h-${d%%:*}" --device $d --timeout 140
      grep -h -o '"round":[0-9]*,"rounds_abandoned":[0-9]*,"rounds_completed":[0-9]*,"status":"released","t_s":[0-9.]*' "$OUT/h$h-${d%%:*}/operator/metrics.jsonl"
    done
  done
  grep '^>>>' "$OUT/log.txt"
  exit 0
fi

step "fedrl --version (start-up: all DT_NEEDED libraries resolve)"
timed "fedrl --version" "$FEDRL" --version

step "fedrl run --device cuda:0 (6 rounds of CartPole DPPG, cohort 512)"
rm -rf "$OUT/run-cuda"
timed "fedrl run cuda:0" timeout 150 "$FEDRL" run bench/gpu/smoke-cartpole.toml --out "$OUT/run-cuda" --device cuda:0 --timeout 130
for f in "$OUT"/run-cuda/operator/*.log; do [ -s "$f" ] && { echo "--- tail $f"; tail -20 "$f"; }; done
[ -f "$OUT/run-cuda/metrics.jsonl" ] && cat "$OUT/run-cuda/metrics.jsonl"

step "fedrl eval --device cuda:0 (the policy just trained, or none)"
POL=$OUT/run-cuda/policy.safetensors
if [ -f "$POL" ]; then
  timed "fedrl eval cuda:0" timeout 45 "$FEDRL" eval --policy "$POL" --env CartPole-v1 --device cuda:0
  timed "fedrl eval cpu" timeout 45 "$FEDRL" eval --policy "$POL" --env CartPole-v1 --device cpu
else
  echo "no policy from the cuda run"
fi

step "fedrl run --device cpu (same scenario, for comparison)"
rm -rf "$OUT/run-cpu"
timed "fedrl run cpu" timeout 90 "$FEDRL" run bench/gpu/smoke-cartpole.toml --out "$OUT/run-cpu" --device cpu --timeout 80
[ -f "$OUT/run-cpu/metrics.jsonl" ] && cat "$OUT/run-cpu/metrics.jsonl"
if [ ! -f "$POL" ] && [ -f "$OUT/run-cpu/policy.safetensors" ]; then
  timed "fedrl eval cuda:0 (cpu-trained policy)" timeout 45 "$FEDRL" eval --policy "$OUT/run-cpu/policy.safetensors" --env CartPole-v1 --device cuda:0
fi

step "in-process example fedavg_cartpole (no QUIC): cuda:0 vs cpu, 6 rounds, cohort 512"
if [ -x "$EXAMPLE" ]; then
  timed "fedavg_cartpole cuda:0" timeout 90 "$EXAMPLE" --device cuda:0 --rounds 6 --cohort 512 --eval-every 3 --eval-users 20 --seed 1
  timed "fedavg_cartpole cpu" timeout 45 "$EXAMPLE" --device cpu --rounds 6 --cohort 512 --eval-every 3 --eval-users 20 --seed 1
else
  echo "example binary not shipped"
fi

step "hidden [256, 256], cohort 1024, 3 rounds: cuda:0 vs cpu (2 client threads)"
for d in cuda:0 cpu; do
  rm -rf "$OUT/h256-$d"
  timed "h256 run $d" timeout 170 "$FEDRL" run bench/gpu/h256.toml --out "$OUT/h256-$d" --device $d --timeout 160
  [ -f "$OUT/h256-$d/operator/metrics.jsonl" ] && cat "$OUT/h256-$d/operator/metrics.jsonl"
done

step "scaling bench: skipped (bench/src/bin/scaling.rs takes no device argument and always runs \`fedrl run\` on the scenario's default device, cpu)"

step "summary"
for r in run-cuda run-cpu h256-cuda:0 h256-cpu; do
  [ -f "$OUT/$r/report.json" ] && echo "$r: $(grep -E '"(wall_seconds|aggregator_wall_seconds|final_eval_return|outcome)"' "$OUT/$r/report.json" | tr -d ' \n')"
done
grep '^>>>' "$OUT/log.txt"
echo "total $(since "$T0")s"
