#!/usr/bin/env bash
# Run HERE (no GPU needed): packs what the GPU machine lacks into .device/ (git-ignored), so that
# bench/device/run.sh runs there with no network: the patched llama.cpp source (pruned to what the
# library build needs), the pure-Python llama-cpp-python bindings, and wheels for gguf/diskcache.
#   bash bench/device/prepare.sh
# then, with the device tool: run(command="bash bench/device/run.sh", carry=[".device"], timeout_s=560)
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .device && mkdir -p .device/whl .device/py
src=$(python3 - <<'PY'
from pathlib import Path
import tempfile
from saem_gguf.build.source import patch_files, prepare_source
out = Path(tempfile.mkdtemp(prefix="saem-dev-src-")) / "llama.cpp"
prepare_source(out, patch_files())
print(out)
PY
)
tar -C "$(dirname "$src")" -czf .device/llama.cpp.tar.gz \
    llama.cpp/CMakeLists.txt llama.cpp/cmake llama.cpp/ggml llama.cpp/src llama.cpp/include \
    llama.cpp/vendor llama.cpp/licenses llama.cpp/LICENSE llama.cpp/SAEM_COMMIT
rm -rf "$(dirname "$src")"
python3 -m pip download -q --no-deps --only-binary=:all: -d .device/whl "gguf==0.19.0" "diskcache>=5.6.1"
lcp=$(python3 -c "import importlib.util,os; print(os.path.dirname(importlib.util.find_spec('llama_cpp').origin))")
cp -r "$lcp" .device/py/llama_cpp && rm -rf .device/py/llama_cpp/lib .device/py/llama_cpp/__pycache__
du -sh .device
