#!/usr/bin/env bash
# Run HERE (no GPU needed), after bench/device/prepare.sh: the device run's own path - run.sh without
# --dry-run: the .device bundle's wheels, bindings and CUDA libraries (on their CPU backend: no
# driver here) - under the GPU image's Python stack as docs/NATIVE.md records it (Python 3.12,
# numpy 2.5.2, numba and the image's other packages; not starlette, uvicorn or pydantic, which the
# image lacks and the bundle does not carry), with the dry run's tiny models. It catches what the
# dry run cannot: another Python, NumPy or a missing package on the device.
#
#   bash bench/device/emulate.sh [--python PYTHON3.12]     # default: pyenv's 3.12 when there is one
#
# The virtual environment (EMULATE_VENV, default /tmp/saem-device-py312) is made once, from PyPI.
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=$(ls -d /root/.pyenv/versions/3.12*/bin/python 2>/dev/null | tail -1 || true)
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python) BASE="$2"; shift 2 ;;
        *) echo "error: unknown argument $1" >&2; exit 2 ;;
    esac
done
VENV=${EMULATE_VENV:-/tmp/saem-device-py312}
if [[ ! -x $VENV/bin/python ]]; then
    [[ -n $BASE && -x $BASE ]] || { echo "error: no Python 3.12 found: give one with --python" >&2; exit 1; }
    "$BASE" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q numpy==2.5.2 numba jinja2 psutil tqdm matplotlib prometheus-client \
        pyyaml regex requests typing-extensions nvidia-ml-py
fi
[[ -f .device/bundle.json ]] || { echo "error: no device bundle in .device/: run bench/device/prepare.sh" >&2; exit 1; }
# cuBLAS and the CUDA runtime the bundle's libggml-cuda links: the build's (the device takes the image's)
CUBLAS=$(.venv/bin/python -c "from saem_gguf.build.builder import cublas_root; r = cublas_root(); print(r / 'lib' if r else '')")
export LD_LIBRARY_PATH="$CUBLAS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OUT=${OUT:-/tmp/saem-device-emulate}
rm -rf "$OUT"
PYTHON="$VENV/bin/python" exec bash bench/device/run.sh --emulate
