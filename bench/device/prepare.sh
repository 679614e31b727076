#!/usr/bin/env bash
# Run HERE (no GPU needed). Packs into a bundle directory (default .device/, git-ignored) what the GPU
# machine lacks, so that bench/device/run.sh spends its minutes measuring, not compiling:
#   - the prebuilt libraries of the current sources (CUDA sm_90, portable CPU code; stripped,
#     xz-compressed) with their build key (bundle.json): run.sh refuses them if the sources changed;
#     when that build does not exist yet, the patched llama.cpp source instead (run.sh compiles it);
#   - the pure-Python llama-cpp-python bindings, and wheels of what the GPU image lacks (gguf,
#     diskcache; it has numpy, numba, psutil, tqdm, jinja2).
#
#   python -m saem_gguf build --cuda --portable      # once (long on 2 cores), then
#   bash bench/device/prepare.sh                      # and, with the device tool:
#   run(command="bash bench/device/run.sh", carry=[".device"], timeout_s=560)
#
#   bash bench/device/prepare.sh --dry-run [--bundle DIR]   # this machine's CPU build, no download,
#       (default /tmp/saem-device-dry, never .device/): what `run.sh --dry-run` unpacks
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DRY=0; BUNDLE=; ARCH=90
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY=1; shift ;;
        --bundle) BUNDLE="$2"; shift 2 ;;
        --cuda-arch) ARCH="$2"; shift 2 ;;
        *) echo "error: unknown argument $1" >&2; exit 2 ;;
    esac
done
# the dry run's CPU bundle never replaces the device bundle in .device/
[[ -z $BUNDLE ]] && BUNDLE=$( [[ $DRY == 1 ]] && echo /tmp/saem-device-dry || echo .device )
LIMIT_MIB=48  # the work tree travels with at most 64 MiB; leave room for the tree itself

rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/py"
if [[ $DRY == 1 ]]; then
    lib=$("$PY" -m saem_gguf build --quiet)
    "$PY" -m saem_gguf.build.bundle pack --cpu --lib "$lib" --out "$BUNDLE"
else
    lib=$("$PY" - "$ARCH" <<'PY'
import sys
from saem_gguf.build import find_build
from saem_gguf.build.bundle import device_config
print(find_build(device_config(sys.argv[1])) or "")
PY
)
    if [[ -n "$lib" ]]; then
        "$PY" -m saem_gguf.build.bundle pack --cuda-arch "$ARCH" --lib "$lib" --out "$BUNDLE"
    else
        echo "note: no CUDA build of the current sources: packing the source (run.sh compiles it, minutes)" >&2
        src=$(mktemp -d)
        "$PY" -m saem_gguf.build.source --out "$src/llama.cpp"
        tar -C "$src" -czf "$BUNDLE/llama.cpp.tar.gz" \
            llama.cpp/CMakeLists.txt llama.cpp/cmake llama.cpp/ggml llama.cpp/src llama.cpp/include \
            llama.cpp/vendor llama.cpp/licenses llama.cpp/LICENSE llama.cpp/SAEM_COMMIT
        rm -rf "$src"
    fi
    mkdir -p "$BUNDLE/whl"
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$BUNDLE/whl" "gguf==0.19.0" "diskcache>=5.6.1"
fi
lcp=$("$PY" -c "import importlib.util,os; print(os.path.dirname(importlib.util.find_spec('llama_cpp').origin))")
cp -r "$lcp" "$BUNDLE/py/llama_cpp"
rm -rf "$BUNDLE/py/llama_cpp/lib" "$BUNDLE/py/llama_cpp/server"
find "$BUNDLE/py" -name __pycache__ -prune -exec rm -rf {} +
size_kib=$(du -sk "$BUNDLE" | cut -f1)
echo "bundle $BUNDLE: $(( size_kib / 1024 )) MiB ($size_kib KiB)"
if (( size_kib > LIMIT_MIB * 1024 )); then
    echo "error: the bundle is over $LIMIT_MIB MiB: it would not travel with the work tree" >&2
    exit 1
fi
