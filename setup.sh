#!/usr/bin/env bash
# One-time setup (idempotent; a second run takes seconds). Everything goes into the project's own
# virtual environment, .venv/ beside this file, so no other Python on the machine is touched (the
# llama-cpp-python installed here has no native library of its own: saem_gguf binds it to ours):
#   Python dependencies, llama-cpp-python's bindings WITHOUT their own llama.cpp build, this
#   package (editable), the patched llama.cpp and the same llama.cpp unpatched (the tests' reference;
#   each compiled once, cached outside the tree under ~/.cache/saem_gguf, shared by every checkout).
#   SAEM_CUDA=1 bash setup.sh      also builds the CUDA variant (sm_90 by default: SAEM_CUDA_ARCH)
#   PYTHON=python3.12 bash setup.sh   the interpreter the environment is made from (3.11+)
set -euo pipefail
cd "$(dirname "$0")"
BASE=${PYTHON:-python3}
LCP=0.3.36
VENV=.venv
PY=$VENV/bin/python

if [ ! -x "$PY" ]; then
    echo "creating the project's virtual environment in $VENV" >&2
    "$BASE" -m venv "$VENV"
fi
PIP=("$PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" numpy gguf numba psutil tqdm matplotlib pytest hypothesis \
    starlette uvicorn prometheus-client pydantic openai anthropic httpx2 \
    "typing-extensions>=4.5.0" "diskcache>=5.6.1" "jinja2>=2.11.3" setuptools wheel

if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama_cpp_python') != '$LCP')" 2>/dev/null; then
    echo "installing llama-cpp-python==$LCP bindings into $VENV (no native build: LLAMA_BUILD=OFF)" >&2
    sdist=$(PYTHONPATH=. "$PY" -c "from saem_gguf.build.source import fetch_sdist; print(fetch_sdist())")
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${PIP[@]}" --no-deps "$sdist"
fi
"${PIP[@]}" --no-deps --no-build-isolation -e .

"$PY" -m saem_gguf build
# the same llama.cpp unpatched: the reference the fidelity tests compare with (tests/test_fidelity.py)
"$PY" -m saem_gguf build --variant stock
if [ "${SAEM_CUDA:-0}" = 1 ]; then
    "$PY" -m saem_gguf build --cuda --cuda-arch "${SAEM_CUDA_ARCH:-90}"
fi
echo "ready: .venv/bin/python -m saem_gguf chat    (or: source .venv/bin/activate)" >&2
