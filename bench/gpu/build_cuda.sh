#!/usr/bin/env bash
# Builds `fedrl` and the in-process example `fedavg_cartpole` with the `cuda` feature on a machine
# that has neither a GPU nor a CUDA toolkit, for an NVIDIA H100 (sm_90) machine whose driver runs
# CUDA 13 (driver 580 or newer), and packs them into `.gpu/` for `bench/gpu/run.sh` there.
#
# - CUDA 13.0's compiler, headers and libraries come from PyPI wheels, in a virtual environment
#   outside the repository ($TK). 13.0 on purpose: a newer nvcc writes PTX that driver 580
#   cannot load.
# - candle-core's `cuda` feature links cudarc with `dynamic-linking`: the binaries need
#   libcuda.so.1, libcublas.so.13, libcurand.so.10 and libcudart.so.13 at start-up. Here the
#   linker gets the wheels' libraries and a stub libcuda generated from cudarc's driver bindings
#   (every call answers CUDA_ERROR_NO_DEVICE); the stub never leaves this machine, the GPU
#   machine's own driver is used there.
# - No nvidia-smi here, so CUDA_COMPUTE_CAP=90 names the target (candle's build: sm_90a).
#
# Measured 2026-11-26 on the 2-core machine: 22 min for `fedrl` from a cold target directory
# (about 10 of them nvcc on candle's kernels), 13 min more for the example; about 4 GB of disk
# ($TK 1.2 GB, the target directory 2.7 GB). The packed binaries are about 16 MB (xz).
#
# Usage: bench/gpu/build_cuda.sh   (TK, CUDA_STUB_ROOT and CARGO_TARGET_DIR override the places)
# Then, on the GPU machine, from the repository root: bash bench/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
TK=${TK:-/work/cuda-tk}
ROOT=${CUDA_STUB_ROOT:-/work/cuda-root}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/cuda-target}

if [ ! -x "$TK/bin/python" ]; then
  python3 -m venv "$TK"
fi
NV=$TK/lib/python$("$TK/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')/site-packages/nvidia/cu13
if [ ! -x "$NV/bin/nvcc" ]; then
  # One resolution with every CUDA 13.0 piece pinned (nvcc alone would pull 13.5's crt and nvvm).
  "$TK/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
  # Only their shared libraries are needed, to link against.
  "$TK/bin/pip" install -q --no-deps nvidia-cublas==13.1.0.3 nvidia-curand==10.4.0.35
fi
"$NV/bin/nvcc" --version | tail -2

# What cudarc's build script searches ($CUDA_ROOT/lib and lib/stubs): unversioned names of the
# wheels' libraries and the stub driver.
mkdir -p "$ROOT/lib/stubs"
ln -sfn "$NV/bin" "$ROOT/bin"
ln -sfn "$NV/include" "$ROOT/include"
ln -sfn "$NV/nvvm" "$ROOT/nvvm"
ln -sf "$NV/lib/libcublas.so.13" "$ROOT/lib/libcublas.so"
ln -sf "$NV/lib/libcublasLt.so.13" "$ROOT/lib/libcublasLt.so"
ln -sf "$NV/lib/libcudart.so.13" "$ROOT/lib/libcudart.so"
ln -sf "$NV/lib/libcurand.so.10" "$ROOT/lib/libcurand.so"
bindings=$(ls -d "$HOME"/.cargo/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs 2>/dev/null | head -1)
if [ -z "$bindings" ]; then
  cargo fetch --quiet
  bindings=$(ls -d "$HOME"/.cargo/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs | head -1)
fi
{
  echo '/* Link-time stub of libcuda.so.1 (bench/gpu/build_cuda.sh): every call fails with'
  echo '   CUDA_ERROR_NO_DEVICE (100). Generated from cudarc 0.19.10 driver bindings. */'
  echo 'static const char *msg = "CUDA_ERROR_NO_DEVICE (stub libcuda: no NVIDIA driver here)";'
  echo 'int cuGetErrorString(int e, const char **p) { (void)e; if (p) *p = msg; return 0; }'
  echo 'int cuGetErrorName(int e, const char **p) { (void)e; if (p) *p = "CUDA_ERROR_NO_DEVICE"; return 0; }'
  grep -oE 'pub unsafe fn cu[A-Za-z0-9_]+' "$bindings" | sed 's/pub unsafe fn //' | sort -u |
    grep -vx -e cuGetErrorString -e cuGetErrorName |
    sed 's/.*/int &(void) { return 100; }/'
} > "$ROOT/stubs-libcuda.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/lib/stubs/libcuda.so" "$ROOT/stubs-libcuda.c"
ln -sf libcuda.so "$ROOT/lib/stubs/libcuda.so.1"

export PATH=$NV/bin:$PATH CUDA_ROOT=$ROOT CUDA_COMPUTE_CAP=90 CUDAFORGE_THREADS=2
nice -n 19 cargo build --release -j 2 -p fedrl-scenarios --features fedrl-scenarios/cuda --bin fedrl
nice -n 19 cargo build --release -j 2 -p fedrl-rl --features fedrl-rl/cuda --example fedavg_cartpole

mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
for b in "$CARGO_TARGET_DIR/release/fedrl" "$CARGO_TARGET_DIR/release/examples/fedavg_cartpole"; do
  name=$(basename "$b")
  strip -o ".gpu/$name" "$b"
  xz -T1 -6 -f ".gpu/$name"
done
# The binaries start here with the stub (a CPU run works; cuda:0 is refused with a clear error).
LD_LIBRARY_PATH=$ROOT/lib/stubs:$NV/lib xz -dc .gpu/fedrl.xz > "$CARGO_TARGET_DIR/fedrl-check"
chmod +x "$CARGO_TARGET_DIR/fedrl-check"
LD_LIBRARY_PATH=$ROOT/lib/stubs:$NV/lib "$CARGO_TARGET_DIR/fedrl-check" --version
ls -la .gpu
echo "next: the device run of \`bash bench/gpu/run.sh\` with .gpu carried along"
