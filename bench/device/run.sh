#!/usr/bin/env bash
# Runs ON the GPU machine (one H200, 16 cores, CUDA 13, no network), from the repo root, with
# .device/ carried (bench/device/prepare.sh makes it). Target: done within 9 minutes.
# 1. builds the CUDA variant (sm_90 only, no FlashAttention kernels, to keep the build short);
# 2. generates a Qwen3-30B-A3B-shaped MoE GGUF (128 experts, top-8, n_embd 2048, expert FFN 768,
#    Q4_0; $LAYERS layers, default 8) with stage-planted routing;
# 3. runs `bench --replay` for gpu-all, cpu-moe, n-cpu-moe, static-hot, lru, saem at ECR
#    3.125 / 12.5 / 25 / 50 %; the table and JSON go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/saem-out}; mkdir -p "$OUT"
LAYERS=${LAYERS:-8}; JOBS=${JOBS:-16}; REPS=${REPS:-2}
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/log.txt"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl
export PYTHONPATH="$PWD:/tmp/site:$PWD/.device/py"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" || true
stamp "unpacking source"
mkdir -p /tmp/src && tar -xzf .device/llama.cpp.tar.gz -C /tmp/src
stamp "building CUDA variant"
cmake -S . -B /tmp/bld -G Ninja -DSAEM_LLAMA_SRC=/tmp/src/llama.cpp -DCMAKE_BUILD_TYPE=Release \
    -DSAEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF \
    -DGGML_NATIVE=ON -DSAEM_BUILD_TESTS=OFF > "$OUT/cmake.txt" 2>&1
cmake --build /tmp/bld -j "$JOBS" > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
cmake --install /tmp/bld --prefix /tmp/prefix > /dev/null
export SAEM_GGUF_LIB_DIR=/tmp/prefix/lib
stamp "generating model ($LAYERS layers)"
python3 -m saem_gguf gen-model --arch qwen3moe --expert-type q4_0 --experts 128 --top-k 8 \
    --layers "$LAYERS" --embd 2048 --ff 768 --heads 32 --kv-heads 4 --head-dim 128 \
    --stage-routing --expert-pool 8 -o /tmp/qwen3-30b-shape.gguf
python3 -m saem_gguf inspect /tmp/qwen3-30b-shape.gguf --ecr 0.125 | tee "$OUT/inspect.txt"
stamp "bench"
python3 -m saem_gguf bench -m /tmp/qwen3-30b-shape.gguf -ngl 99 -c 2048 \
    --policies gpu-all,cpu-moe,n-cpu-moe,static-hot,lru,saem --ecr 0.03125,0.125,0.25,0.5 \
    --replay --max-prompts 3 --reps "$REPS" --json "$OUT/bench.json" | tee "$OUT/bench.md"
stamp "done"
