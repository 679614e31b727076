#!/usr/bin/env bash
# Build the CUDA variant of the patched llama.cpp (+ native/) for one architecture (sm_90 by default),
# to check that the patched sources compile with CUDA on. Long on a small machine: run it as
#   nice -n 15 bash bench/build_cuda.sh > /tmp/cuda-build.log 2>&1 &
#
#   bash bench/build_cuda.sh [--touched-only] [--arch 90] [--dir DIR] [-j N]
#
# --touched-only  compile only the CUDA source the patches touch (ggml-cuda.cu) with nvcc, plus
#                 the ggml-base files declaring the new API, in the CUDA configuration: a quick check.
# Default: the whole library set (libggml-cuda.so, libllama.so with native/), installed in DIR/prefix.
#
# cuBLAS: ggml-cuda needs it. When the CUDA toolkit has no libcublas, set CUBLAS_ROOT to a
# directory holding include/cublas_v2.h and lib/libcublas.so* (e.g. the nvidia-cublas wheel's
# nvidia/cu13), or have that wheel installed in the Python environment; it is found there.
# libcuda (driver) is not needed: the build uses GGML_CUDA_NO_VMM=ON.
# FlashAttention kernels stay on (GGML_CUDA_FA), the default set of FA quants only.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARCH=90
DIR=/tmp/saem-cuda-build
JOBS=2
TOUCHED=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --touched-only) TOUCHED=1; shift ;;
        --arch) ARCH="$2"; shift 2 ;;
        --dir) DIR="$2"; shift 2 ;;
        -j) JOBS="$2"; shift 2 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

command -v nvcc >/dev/null || { echo "nvcc not found" >&2; exit 1; }
mkdir -p "$DIR"
SRC="$DIR/llama.cpp-patched"
BLD="$DIR/build"

echo "== patched source -> $SRC"
(cd "$REPO" && PYTHONPATH="$REPO" python -m saem_gguf.build.source --out "$SRC")

# cuBLAS location
CUBLAS_ARGS=()
if [[ -z "${CUBLAS_ROOT:-}" ]]; then
    NVCC_DIR="$(dirname "$(readlink -f "$(command -v nvcc)")")"
    if ! ls "$NVCC_DIR"/../lib64/libcublas.so* >/dev/null 2>&1 && ! ls "$NVCC_DIR"/../targets/*/lib/libcublas.so* >/dev/null 2>&1; then
        CUBLAS_ROOT="$(python - <<'EOF' 2>/dev/null || true
import importlib.util, pathlib
spec = importlib.util.find_spec("nvidia")
for base in (spec.submodule_search_locations if spec else []):
    for d in sorted(pathlib.Path(base).glob("*")):
        if (d / "include" / "cublas_v2.h").exists():
            print(d); raise SystemExit
EOF
)"
    fi
fi
if [[ -n "${CUBLAS_ROOT:-}" ]]; then
    echo "== cuBLAS from $CUBLAS_ROOT"
    LINKS="$DIR/cublas-lib"
    mkdir -p "$LINKS"
    for l in cublas cublasLt; do
        f="$(ls "$CUBLAS_ROOT"/lib/lib$l.so* | head -1)"
        ln -sf "$f" "$LINKS/lib$l.so"
    done
    CUBLAS_ARGS=(-DCUDA_cublas_LIBRARY="$LINKS/libcublas.so" -DCUDA_cublasLt_LIBRARY="$LINKS/libcublasLt.so"
                 "-DCMAKE_CUDA_FLAGS=-I$CUBLAS_ROOT/include" "-DCMAKE_CXX_FLAGS=-I$CUBLAS_ROOT/include"
                 "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath-link,$LINKS")
fi

LAUNCH=()
if command -v ccache >/dev/null; then
    LAUNCH=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi

echo "== configure (sm_$ARCH) -> $BLD"
cmake -S "$REPO" -B "$BLD" -DSAEM_LLAMA_SRC="$SRC" -DSAEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
      -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_NCCL=OFF \
      "${LAUNCH[@]}" "${CUBLAS_ARGS[@]}" > "$DIR/configure.log"

t0=$(date +%s)
if [[ $TOUCHED == 1 ]]; then
    echo "== compile the touched CUDA-configured sources only"
    # the one .cu the patches touch, with nvcc, and the ggml-base files that declare its API; the
    # llama/native/ggml-cpu sources do not depend on the CUDA configuration (built by the CPU build)
    ( cd "$BLD/llama.cpp/ggml/src/ggml-cuda" && make "ggml-cuda.cu.o" ) || { echo "FAILED: ggml-cuda.cu" >&2; exit 1; }
    ( cd "$BLD/llama.cpp/ggml/src" && make "ggml.c.o" "ggml-backend.cpp.o" ) || { echo "FAILED: ggml-base" >&2; exit 1; }
else
    echo "== build everything (-j $JOBS)"
    cmake --build "$BLD" -j "$JOBS"
    cmake --install "$BLD" --prefix "$DIR/prefix" > /dev/null
    ls -la "$DIR/prefix/lib"
fi
echo "== OK in $(( $(date +%s) - t0 )) s"
