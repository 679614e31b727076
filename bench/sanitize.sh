#!/usr/bin/env bash
# Build the patched llama.cpp + native/ with AddressSanitizer + UndefinedBehaviorSanitizer into
# its own cache key (builds/saem-cpu-asan-<key>, never the normal build), then run the native C
# test and the native/engine Python tests against it (libasan preloaded into Python).
#
#   bash bench/sanitize.sh            # build (incremental) + run; exit 0 = no sanitizer report
#   SAN_BUILD_ONLY=1 bash bench/sanitize.sh
#   SAN_TESTS="tests/test_engine.py" bash bench/sanitize.sh
#
# A full llama.cpp build: on the shared 2-core machine run it as
#   flock /tmp/saem-heavy.lock nice -n 5 bash bench/sanitize.sh
# Reports go to $SAN_REPORTS (default: <cache>/work/asan-reports), one file per process that
# reported; the script prints their count and the first lines of each.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
JOBS="${JOBS:-$(nproc)}"
SAN_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -g"

# the cache key: the normal build's key (sources, patches, native/, flags) plus the sanitizer flags
read -r KEY WORK <<<"$("$PY" - "$SAN_FLAGS" <<'EOF'
import hashlib, sys
from saem_gguf.build.builder import BuildConfig, build_key
from saem_gguf.build.paths import REPO_ROOT, cache_root
base = build_key(BuildConfig(build_type="RelWithDebInfo"))
h = hashlib.sha256((base + sys.argv[1]).encode()).hexdigest()[:16]
tree = hashlib.sha256(str(REPO_ROOT).encode()).hexdigest()[:8]
print(f"saem-cpu-asan-{h}", cache_root() / "work" / f"asan-{tree}")
EOF
)"
CACHE="$("$PY" -c 'from saem_gguf.build.paths import cache_root; print(cache_root())')"
PREFIX="$CACHE/builds/$KEY"
SRC="$WORK/llama.cpp"
BLD="$WORK/build"
LOG="$WORK/build.log"
REPORTS="${SAN_REPORTS:-$CACHE/work/asan-reports}"
mkdir -p "$WORK"

t0=$(date +%s)
if [ -f "$PREFIX/lib/libllama.so" ] && [ -z "${SAN_FORCE:-}" ]; then
    echo "sanitizer build cached: $PREFIX"
else
    echo "building llama.cpp with ASan+UBSan -> $PREFIX (log: $LOG)"
    : >"$LOG"
    "$PY" -c 'import sys; from pathlib import Path
from saem_gguf.build.source import patch_files, prepare_source
prepare_source(Path(sys.argv[1]), patch_files())' "$SRC" >>"$LOG" 2>&1
    if ! { cmake -S "$REPO" -B "$BLD" -DSAEM_LLAMA_SRC="$SRC" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
            -DGGML_NATIVE=ON -DSAEM_CUDA=OFF -DSAEM_WITH_NATIVE=ON \
            -DCMAKE_C_FLAGS="$SAN_FLAGS" -DCMAKE_CXX_FLAGS="$SAN_FLAGS" \
            -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
            -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
          && cmake --build "$BLD" -j "$JOBS" \
          && rm -rf "$PREFIX" && cmake --install "$BLD" --prefix "$PREFIX"; } >>"$LOG" 2>&1; then
        echo "error: sanitizer build failed; log: $LOG" >&2
        exit 1
    fi
fi
t1=$(date +%s)
echo "build: $((t1 - t0)) s"
[ -n "${SAN_BUILD_ONLY:-}" ] && exit 0

# libstdc++ preloaded with libasan: Python does not link it, and ASan's __cxa_throw interceptor
# must find the real one when the runtime starts (else a C++ throw in llama.cpp fails a CHECK)
PRELOAD="$(gcc -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)"
rm -rf "$REPORTS"
mkdir -p "$REPORTS"
# Python itself leaks by design at exit: leak detection off; every other ASan/UBSan finding is
# written to $REPORTS and counted below.
export ASAN_OPTIONS="detect_leaks=0:log_path=$REPORTS/asan:abort_on_error=0:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:log_path=$REPORTS/ubsan:halt_on_error=0"

echo "native C test"
LD_LIBRARY_PATH="$PREFIX/lib" "$PREFIX/bin/saem-test-mul-mat-id" | tail -1
TESTS="${SAN_TESTS:-tests/test_native_api.py tests/test_native_counts.py tests/test_native_exact.py tests/test_native_mul_mat_id.py tests/test_engine.py}"
echo "python tests against the sanitized library: $TESTS"
set +e
# shellcheck disable=SC2086
SAEM_GGUF_LIB_DIR="$PREFIX/lib" LD_PRELOAD="$PRELOAD" \
    "$PY" -m pytest -q -x -p no:cacheprovider $TESTS
rc=$?
set -e
t2=$(date +%s)
n_reports=$(find "$REPORTS" -type f | wc -l)
echo "tests: exit $rc in $((t2 - t1)) s; sanitizer report files: $n_reports ($REPORTS)"
for f in $(find "$REPORTS" -type f | head -5); do
    echo "--- $f"
    grep -m 3 -E "ERROR: AddressSanitizer|runtime error" "$f" || head -3 "$f"
done
[ "$rc" -eq 0 ] && [ "$n_reports" -eq 0 ]
