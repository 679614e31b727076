#!/usr/bin/env bash
# Build the CUDA variant of the patched llama.cpp (+ native/) for one architecture (sm_90 by
# default) with the project's builder, then link-check it. Long on a small machine (17-50 min on
# 2 cores from scratch, measured idle and loaded, docs/NATIVE.md; the CMake tree persists under
# ~/.cache/saem_gguf/work/, so a later change recompiles only what it touched). Run it niced, in
# the background:
#   nice -n 19 bash bench/build_cuda.sh > /tmp/cuda-build.log 2>&1 &
#
#   bash bench/build_cuda.sh [--arch 90] [-j N] [--fa]
#
# What is built (saem_gguf/build/builder.py, BuildConfig(cuda=True, native_cpu=False)): the portable
# CPU code (the GPU machine's processor is not this one), GGML_CUDA_NO_VMM (no link against the
# driver's libcuda), no NCCL, and no FlashAttention kernels unless --fa (they are about half of
# the compile; llama.cpp's flash_attn "auto" then runs attention without them, on every policy).
# cuBLAS: when the CUDA toolkit has none, from the nvidia-cublas wheel, found at $CUBLAS_ROOT, in
# ~/.cache/saem_gguf/cuda-deps (pip install --no-deps --target ~/.cache/saem_gguf/cuda-deps
# nvidia-cublas), or on this Python's path. libcudart/libcublas are found at run time through
# LD_LIBRARY_PATH (bench/device/run.sh sets it from the GPU image's nvidia wheels).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ARCH=90; JOBS=2; FA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --arch) ARCH="$2"; shift 2 ;;
        -j) JOBS="$2"; shift 2 ;;
        --fa) FA=(--cuda-fa); shift ;;
        *) echo "error: unknown argument $1" >&2; exit 2 ;;
    esac
done
command -v nvcc >/dev/null || { echo "error: nvcc not found" >&2; exit 1; }

t0=$(date +%s)
lib=$("$PY" -m saem_gguf build --cuda --cuda-arch "$ARCH" --portable "${FA[@]}" -j "$JOBS" --quiet)
echo "== built in $(( $(date +%s) - t0 )) s: $lib"
ls -la "$lib"
cublas=$("$PY" -c "from saem_gguf.build.builder import cublas_root; r = cublas_root(); print(r / 'lib' if r else '')")
echo "== link check"
"$PY" -m saem_gguf.build.link_check "$lib" ${cublas:+--extra-path "$cublas"}
