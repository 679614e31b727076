#!/usr/bin/env bash
# One-time setup (idempotent; a second run takes seconds): Python dependencies, llama-cpp-python's
# bindings WITHOUT their own llama.cpp build, this package (editable), and the patched llama.cpp
# (compiled once, cached outside the tree under ~/.cache/saem_gguf).
#   SAEM_CUDA=1 bash setup.sh      also builds the CUDA variant (sm_90 by default: SAEM_CUDA_ARCH)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
LCP=0.3.36

"$PY" -m pip install -q --disable-pip-version-check numpy gguf numba psutil tqdm matplotlib pytest \
    hypothesis "typing-extensions>=4.5.0" "diskcache>=5.6.1" "jinja2>=2.11.3"

if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama_cpp_python') != '$LCP')" 2>/dev/null; then
    echo "installing llama-cpp-python==$LCP bindings (no native build: LLAMA_BUILD=OFF)" >&2
    sdist=$("$PY" -c "from saem_gguf.build.source import fetch_sdist; print(fetch_sdist())")
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PY" -m pip install -q --no-deps \
        --disable-pip-version-check "$sdist"
fi
"$PY" -m pip install -q --no-deps --disable-pip-version-check --no-build-isolation -e . 2>/dev/null \
    || "$PY" -m pip install -q --no-deps --disable-pip-version-check -e .

"$PY" -m saem_gguf build
if [ "${SAEM_CUDA:-0}" = 1 ]; then
    "$PY" -m saem_gguf build --cuda --cuda-arch "${SAEM_CUDA_ARCH:-90}"
fi
