#!/usr/bin/env bash
# Runs ON the GPU machine (one H200, 16 cores, CUDA 13, no network), from the repo root, with the
# bundle carried (bench/device/prepare.sh makes it):
#   run(command="bash bench/device/run.sh", carry=[".device"], timeout_s=560)
# Target: <= 8 minutes end to end with prebuilt libraries; <= 8 files in $OUT:
#   log.txt (timeline + everything printed), env.txt (nvidia-smi, build key, library check),
#   correctness.json, bench.md, bench.json, overlap.json (bench/device/device_bench.py),
#   placement_cost.json (bench/bench_placement_cost.py).
# With prebuilt libraries whose build key is not the current sources' the run stops at once (a
# stale bundle); with only the source in the bundle it compiles first (minutes).
#
#   bash bench/device/run.sh --dry-run [--bundle DIR]   # HERE, on the CPU build (bundle from
#       prepare.sh --dry-run, default /tmp/saem-device-dry), tiny models:
#       the same steps, so the script never fails on the device for a reason a CPU could catch.
#   bash bench/device/run.sh --emulate   # HERE, by bench/device/emulate.sh: the device's own path
#       (the .device bundle's wheels, bindings and CUDA libraries, on their CPU backend) under
#       PYTHON, the GPU image's Python stack, with the dry run's tiny models.
# Env: OUT (/tmp/saem-out), LAYERS (16), REPS (3), JOBS (16, fallback compile only).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/saem-out}; mkdir -p "$OUT"
LAYERS=${LAYERS:-16}; REPS=${REPS:-3}; JOBS=${JOBS:-16}
DRY=0; EMULATE=0; BUNDLE=
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY=1; shift ;;
        --emulate) EMULATE=1; shift ;;
        --bundle) BUNDLE="$2"; shift 2 ;;
        *) echo "error: unknown argument $1" >&2; exit 2 ;;
    esac
done
# the dry run's CPU bundle never replaces the device bundle in .device/
[[ -z $BUNDLE ]] && BUNDLE=$( [[ $DRY == 1 ]] && echo /tmp/saem-device-dry || echo .device )
[[ -d $BUNDLE ]] && BUNDLE=$(cd "$BUNDLE" && pwd)  # PYTHONPATH and children need it absolute
exec > >(tee -a "$OUT/log.txt") 2>&1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
WORK=$(mktemp -d /tmp/saem-device.XXXX)
trap 'rm -rf "$WORK"' EXIT
if [[ $DRY == 1 ]]; then
    PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
    export PYTHONPATH="$PWD"
    BUNDLE_KIND=(--cpu)
else
    PY=${PYTHON:-python3}  # the image's python3 on the device; emulate.sh's here
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$BUNDLE"/whl/*.whl
    export PYTHONPATH="$PWD:$WORK/site:$BUNDLE/py"
    BUNDLE_KIND=()
    # cuBLAS and the CUDA runtime: the image's nvidia-* wheels (libggml-cuda's RUNPATH is $ORIGIN)
    NV_LIBS=$("$PY" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("nvidia")
dirs = {str(p.parent) for base in (spec.submodule_search_locations if spec else [])
        for p in pathlib.Path(base).glob("*/lib/lib*.so*")}
print(":".join(sorted(dirs)))
PY
)
    export LD_LIBRARY_PATH="$NV_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PYTHONUNBUFFERED=1

stamp "libraries"
if [[ -f "$BUNDLE/bundle.json" ]]; then
    # refuses (exit 1, one line) a bundle built from other sources
    LIB=$("$PY" -m saem_gguf.build.bundle unpack "${BUNDLE_KIND[@]}" --bundle "$BUNDLE" --dest "$WORK/lib")
elif [[ -f "$BUNDLE/llama.cpp.tar.gz" && $DRY == 0 ]]; then
    stamp "no prebuilt libraries in $BUNDLE: compiling the CUDA variant (sm_90, -j $JOBS)"
    mkdir -p "$WORK/src" && tar -xzf "$BUNDLE/llama.cpp.tar.gz" -C "$WORK/src"
    cmake -S . -B "$WORK/bld" -G Ninja -DSAEM_LLAMA_SRC="$WORK/src/llama.cpp" -DCMAKE_BUILD_TYPE=Release \
        -DSAEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF \
        -DGGML_CUDA_NO_VMM=ON -DGGML_NATIVE=OFF -DSAEM_BUILD_TESTS=OFF \
        $("$PY" -c "from saem_gguf.build.builder import portable_isa_args; print(' '.join(portable_isa_args()))") \
        > "$WORK/cmake.log" 2>&1 \
        || { tail -30 "$WORK/cmake.log"; exit 1; }
    cmake --build "$WORK/bld" -j "$JOBS" > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
    cmake --install "$WORK/bld" --prefix "$WORK/prefix" > /dev/null
    LIB="$WORK/prefix/lib"
else
    echo "error: $BUNDLE holds neither prebuilt libraries nor the source: run bench/device/prepare.sh" \
         "${BUNDLE_KIND[*]:+--dry-run }first"
    exit 1
fi
export SAEM_GGUF_LIB_DIR="$LIB"

stamp "environment -> env.txt"
{
    echo "== build"; cat "$BUNDLE/bundle.json" 2>/dev/null || echo "compiled here from source"
    echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "(no nvidia-smi)"
    echo "== libraries"; ls -la "$LIB"
    for l in "$LIB"/libllama.so "$LIB"/libggml-cuda.so; do
        [[ -e $l ]] && { echo "-- ldd $l"; ldd "$l"; }
    done
    echo "== cpu"; grep -m1 "model name" /proc/cpuinfo; nproc
    echo "== ggml cpu backend (the instruction sets it was compiled with)"
    "$PY" -c "from saem_gguf.llama_lib import load_llama_cpp; print(load_llama_cpp().llama_print_system_info().decode())"
    echo "== where stock llama.cpp puts CPU-run experts (docs/NATIVE.md, \"Not done / limits\")"
    "$PY" bench/device/stock_layout.py --dir "$WORK" || echo "(stock_layout.py failed: exit $?)"
    echo "== python"; "$PY" --version
    "$PY" - <<'PY'
from importlib import metadata
for name in ("numpy", "numba", "llvmlite", "jinja2", "psutil", "tqdm", "gguf", "diskcache", "nvidia-ml-py"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "(not installed)")
PY
} > "$OUT/env.txt" 2>&1
if grep -q "=> not found" "$OUT/env.txt"; then
    grep "=> not found" "$OUT/env.txt"; echo "error: a library dependency does not resolve (env.txt)"; exit 1
fi

SMALL=$(( DRY || EMULATE ))  # the dry run's tiny models
stamp "device_bench ($([[ $SMALL == 1 ]] && echo tiny models || echo "$LAYERS layers, $REPS reps"))"
DB=(--out "$OUT" --layers "$LAYERS" --reps "$REPS")
[[ $SMALL == 1 ]] && DB+=(--dry-run)
rc=0
"$PY" bench/device/device_bench.py "${DB[@]}" || rc=$?

# issue 12, item 5: the live engine's per-token placement cost at 48 layers x 128 experts x top-8,
# here with the device's async copies and slot maps (tiny matrices: the placement's share shows)
stamp "placement cost per token -> placement_cost.json"
PC=(--reps 2 -n 150 --policies cpu-moe,lru-cpu,lfu-cpu,temporal-cpu,saem,saem:uniform,saem-cue,gpu-all)
[[ $SMALL == 1 ]] && PC=(--layers 4 --experts 16 --top-k 2 --reps 1 -n 24 --skip 4 --policies cpu-moe,saem)
pc=0
"$PY" bench/bench_placement_cost.py "${PC[@]}" --json "$OUT/placement_cost.json" || pc=$?
[[ $pc != 0 ]] && echo "error: the placement cost bench failed (exit $pc)"
[[ $rc == 0 ]] && rc=$pc
stamp "done (exit $rc)"
exit $rc
